"""The version, in a module of its own so that recording it in a run imports nothing else."""
__version__ = "0.1.0"


def release(version: str) -> tuple[int, ...]:
    """'0.28.1rc2.dev77+gabc' -> (0, 28, 1): the numeric release part of a version string, for
    comparing a package's version with a floor."""
    import itertools

    out = []
    for part in version.split("+")[0].split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        out.append(int(digits))
        if digits != part:
            break
    return tuple(out)

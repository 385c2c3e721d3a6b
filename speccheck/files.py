"""Files speccheck writes (the store, exported checkpoints) are shared like any file the user
writes: a vLLM container running as another user, a CI cache."""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def share_mode(path: Path, directory: bool = False) -> None:
    """mkstemp/mkdtemp create 0600/0700; stored files are shared like any file the user
    writes (a vLLM container running as another user, a CI cache), as the umask says."""
    os.chmod(path, (0o777 if directory else 0o666) & ~_umask())


class OutputError(ValueError):
    """An output path that cannot take a file (a FIFO, a directory, a device): bad input, exit 2."""


def write_output(path: Path, data: str | bytes, option: str) -> Path:
    """Write a report file the user asked for (``option`` names where it came from): into a
    temporary file beside it, then renamed over it, so a reader never sees half a report and
    Ctrl-C leaves the old one. A FIFO there would block the write forever, and a directory or
    device is not a file: each refused, named."""
    path = Path(path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISLNK(mode) and path.is_file()):
        what = ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode)
                else "a symlink to no regular file" if stat.S_ISLNK(mode) else "not a regular file")
        raise OutputError(f"{option} {path}: {what} is there, not a file speccheck can replace; give "
                          "another path, or remove it first.")
    target = path.resolve() if path.is_symlink() else path  # a link is written through, as a plain write would
    target.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as e:  # named by the file meant, not the temporary one
        raise OSError(e.errno, e.strerror, str(path)) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        share_mode(Path(tmp))
        os.replace(tmp, target)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        if e.filename is None:  # a failed write names no file: name the one being written
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path

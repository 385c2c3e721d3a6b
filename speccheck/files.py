"""Files speccheck writes (the store, exported checkpoints) are shared like any file the user
writes: a vLLM container running as another user, a CI cache."""
from __future__ import annotations

import os
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def share_mode(path: Path, directory: bool = False) -> None:
    """mkstemp/mkdtemp create 0600/0700; stored files are shared like any file the user
    writes (a vLLM container running as another user, a CI cache), as the umask says."""
    os.chmod(path, (0o777 if directory else 0o666) & ~_umask())

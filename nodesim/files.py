"""Atomic file writes: a temporary file in the same directory, then rename over the target, so a
reader (or a restarted daemon) sees the old content or the new, never half of one."""

from __future__ import annotations

import os
import re
from pathlib import Path

TMP_MARK = ".tmp-"
# A temporary file's name ends with the mark and a pid: an allocation id may hold the mark itself.
_TEMPORARY = re.compile(re.escape(TMP_MARK) + r"[0-9]+$")


def write_atomic(path: Path, data: bytes | str, mode: int = 0o644) -> None:
    """Write `data` to `path` atomically; the file is created with `mode` (never wider first)."""
    if isinstance(data, str):
        data = data.encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(fd, mode)  # O_CREAT's mode is narrowed by the umask; state it exactly
        f.write(data)
    os.replace(tmp, path)


def remove(path: Path) -> None:
    path.unlink(missing_ok=True)


def is_temporary(path: Path) -> bool:
    return _TEMPORARY.search(path.name) is not None

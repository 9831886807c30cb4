"""Durable file replacement: a reader (or a process started after a power cut) sees the old file or the new one,
never a part of either."""

from __future__ import annotations

import os
import uuid
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (a rename or a new file in it) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, mode: int | None = None) -> None:
    """Replace ``path`` with ``data``: a temp file beside it, fsync, rename over ``path``, fsync of the directory.

    Args:
        path: the file to create or replace; its directory must exist.
        data: the whole new content.
        mode: the file's permission bits (e.g. ``0o600`` for a secret), set before the first byte is written and
            not narrowed or widened by the umask; ``None`` gives a new file's default (``0o666`` less the umask).

    The temp file is named ``<name>.tmp-<hex>`` so that a caller can sweep what a crash left. On any failure it
    is removed and ``path`` is untouched.
    """
    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else mode)
    try:
        with os.fdopen(fd, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)

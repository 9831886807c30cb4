"""Native libraries that write to the process's stderr themselves (llama.cpp prints its model and context set-up
on file descriptor 2 whatever ``verbose`` says): silencing them means redirecting the descriptor, not sys.stderr."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """File descriptor 2 goes to the null device while the block runs. Process-wide: another thread's line written
    meanwhile is lost too, so keep the block to a native call's set-up."""
    saved = os.dup(2)
    with Path(os.devnull).open("wb") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)

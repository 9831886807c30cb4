"""The zoo's text corpus: the Python standard library's own source files, split by file."""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Skipped: vendored third-party code. The regression-test trees are optional extra training text: they are
# never held out, so the held-out set (what benchmarks score) is the same whether or not they are used.
_EXCLUDED_PARTS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_TEST_PARTS = frozenset({"test", "tests", "idle_test"})
_MAX_FILE_BYTES = 400_000
HELD_OUT_MODULUS = 10


@dataclass(frozen=True, slots=True)
class SourceFile:
    """One standard-library file: its path relative to the stdlib root, and its text."""

    relpath: str
    text: str

    @property
    def is_test(self) -> bool:
        return bool(_TEST_PARTS.intersection(self.relpath.split("/")[:-1]))


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relpath: str) -> bool:
    """Deterministic file-level split: about one file in ten is held out, by a hash of its path."""
    digest = hashlib.sha256(relpath.encode()).digest()
    return int.from_bytes(digest[:4], "big") % HELD_OUT_MODULUS == 0


def iter_stdlib_files(root: Path | None = None, include_tests: bool = False) -> list[SourceFile]:
    """All readable ``.py`` files of the standard library, sorted by path; test trees only when asked."""
    root = root or stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        dirs = rel.parts[:-1]
        if _EXCLUDED_PARTS.intersection(dirs) or (not include_tests and _TEST_PARTS.intersection(dirs)):
            continue
        try:
            raw = path.read_bytes()
        except OSError:
            continue
        if not raw.strip() or len(raw) > _MAX_FILE_BYTES:
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        files.append(SourceFile(rel.as_posix(), text))
    return files


def split_corpus(
    files: list[SourceFile], max_train_files: int | None = None
) -> tuple[list[SourceFile], list[SourceFile]]:
    """(train, held_out). Test-tree files always train. ``max_train_files`` keeps an evenly spaced subset."""
    held_out = [f for f in files if is_held_out(f.relpath) and not f.is_test]
    train = [f for f in files if f.is_test or not is_held_out(f.relpath)]
    if max_train_files is not None and len(train) > max_train_files:
        stride = len(train) / max_train_files
        train = [train[int(i * stride)] for i in range(max_train_files)]
        held_out = held_out[: max(4, max_train_files // 8)]
    return train, held_out


def held_out_files() -> list[SourceFile]:
    """The held-out files used by benchmarks (never seen in training, for any preset)."""
    return split_corpus(iter_stdlib_files())[1]

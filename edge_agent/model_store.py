"""The device's versioned model store: ``<state_dir>/models/<name>/<version>/`` and one state file.

Layout::

    models/state.json                  {name: {"current", "previous", "activated_at", "blocked"}}
    models/<name>/<version>.json       the version's signed manifest (written before its directory appears)
    models/<name>/<version>/           exactly the artifact's files

Crash safety (kill -9 or power loss at any point):

* ``state.json`` is replaced by write-to-temp, fsync, rename, fsync of the directory: a reader sees the old
  state or the new one, never half of either. Temp files left by a crash are ignored and removed on open.
* A version arrives by renaming a complete, fsynced directory into place after its manifest; only a
  version with both is "on disk", and ``activate`` refuses any other, so a half-copied version is never
  current.
* Old versions leave by manifest unlink, rename to a ``.trash-`` name, then delete; whatever a crash
  leaves over (trash, versions no state names) is removed when the store next opens.

At most two versions of a model stay on disk: current and previous (the updater's staging area is its own).
A version rolled back for bad health (or failing its smoke test) is ``blocked``, with the time it was blocked:
the updater does not install it again until the block is lifted (it expires, or the cloud desires another
version of the model).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.artifacts import Manifest, read_manifest
from shared.atomic import fsync_dir, write_atomic
from shared.errors import ConflictError, NotFoundError, ValidationError

logger = logging.getLogger(__name__)

STATE_FILE = "state.json"
MAX_BLOCKED = 16  # versions remembered per model, the most recently blocked
_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")
_TRASH, _INCOMING = ".trash-", ".incoming-"


def check_segment(value: str, what: str) -> str:
    """``value`` as a single safe path segment (a model name or version), or a ValidationError."""
    if not _SEGMENT.fullmatch(value):
        raise ValidationError(f"{what} {value!r}: letters, digits and '._+-' only, at most 128", param=what)
    return value


@dataclass(slots=True)
class ModelState:
    current: str | None = None
    previous: str | None = None
    activated_at: float | None = None
    blocked: dict[str, float] = field(default_factory=dict)  # version -> when it was blocked (unix seconds)

    def referenced(self) -> set[str]:
        return {v for v in (self.current, self.previous) if v is not None}


class ModelStore:
    """Installed model versions on this device; thread-safe within one process."""

    def __init__(self, state_dir: Path) -> None:
        self.root = state_dir / "models"
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._states = self._load()
        self._recover()

    # --- reading -----------------------------------------------------------------------------------------

    def names(self) -> list[str]:
        with self._lock:
            return sorted(n for n, s in self._states.items() if s.current is not None)

    def state(self, name: str) -> ModelState:
        with self._lock:
            s = self._states.get(name, ModelState())
            return ModelState(s.current, s.previous, s.activated_at, dict(s.blocked))

    def current(self, name: str) -> str | None:
        return self.state(name).current

    def current_dir(self, name: str) -> Path | None:
        """The directory of ``name``'s current version, or None when none is active."""
        version = self.current(name)
        return None if version is None else self.version_dir(name, version)

    def version_dir(self, name: str, version: str) -> Path:
        return self.root / check_segment(name, "model") / check_segment(version, "version")

    def manifest(self, name: str, version: str) -> Manifest:
        return read_manifest(self._manifest_path(name, version))

    def versions(self, name: str) -> list[str]:
        """Complete versions of ``name`` on disk (directory and manifest both present), sorted."""
        model_dir = self.root / check_segment(name, "model")
        if not model_dir.is_dir():
            return []
        return sorted(
            p.name
            for p in model_dir.iterdir()
            if p.is_dir() and _SEGMENT.fullmatch(p.name) and (model_dir / f"{p.name}.json").is_file()
        )

    def is_blocked(self, name: str, version: str) -> bool:
        return version in self.state(name).blocked

    # --- changing ----------------------------------------------------------------------------------------

    def install(self, name: str, version: str, source_dir: Path, manifest: Manifest) -> Path:
        """Move the verified ``source_dir`` in as ``name``/``version`` (not yet current); returns its directory.

        The caller has verified the files. A move within one file system is a rename; otherwise the files are
        copied beside the store first, fsynced, and renamed in.
        """
        target = self.version_dir(name, version)
        with self._lock:
            if version in self.versions(name):
                raise ConflictError(f"{name} {version} is already installed")
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.exists():  # a leftover without its manifest: never current, safe to drop
                self._discard(target)
            write_atomic(self._manifest_path(name, version), manifest.to_json().encode())
            incoming = target.with_name(f"{_INCOMING}{version}-{uuid.uuid4().hex[:8]}")
            try:
                source_dir.rename(incoming)
            except OSError:
                shutil.copytree(source_dir, incoming)
                _fsync_tree(incoming)
                shutil.rmtree(source_dir, ignore_errors=True)
            incoming.rename(target)
            fsync_dir(target.parent)
        return target

    def activate(self, name: str, version: str) -> None:
        """Make ``version`` current; the old current becomes previous and anything older is deleted."""
        with self._lock:
            if version not in self.versions(name):
                raise NotFoundError(f"{name} {version} is not installed")
            old = self._states.get(name, ModelState())
            if old.current == version:
                return
            blocked = {v: at for v, at in old.blocked.items() if v != version}
            self._commit(name, ModelState(version, old.current, time.time(), blocked))

    def rollback(self, name: str, *, block: bool = True) -> str:
        """Make the previous version current again and delete the current one; returns the version now current.

        With ``block`` the abandoned version is remembered so that it is not installed again.
        """
        with self._lock:
            old = self._states.get(name, ModelState())
            if old.current is None or old.previous is None:
                raise NotFoundError(f"{name}: no previous version to roll back to")
            blocked = _with_block(old.blocked, old.current) if block else old.blocked
            self._commit(name, ModelState(old.previous, None, time.time(), blocked))
            return old.previous

    def block(self, name: str, version: str) -> None:
        """Remember that ``version`` must not be installed again (it failed on this device)."""
        with self._lock:
            old = self._states.get(name, ModelState())
            if version not in old.blocked:
                self._commit(
                    name, ModelState(old.current, old.previous, old.activated_at, _with_block(old.blocked, version))
                )

    def unblock(self, name: str, version: str) -> None:
        """Let ``version`` be installed again (its block expired, or the cloud moved on and may come back to it)."""
        with self._lock:
            old = self._states.get(name, ModelState())
            if version in old.blocked:
                blocked = {v: at for v, at in old.blocked.items() if v != version}
                self._commit(name, ModelState(old.current, old.previous, old.activated_at, blocked))

    # --- internals ---------------------------------------------------------------------------------------

    def _manifest_path(self, name: str, version: str) -> Path:
        return self.root / check_segment(name, "model") / f"{check_segment(version, 'version')}.json"

    def _commit(self, name: str, new: ModelState) -> None:
        states = {**self._states, name: new}
        data = {
            n: {"current": s.current, "previous": s.previous, "activated_at": s.activated_at, "blocked": s.blocked}
            for n, s in sorted(states.items())
        }
        write_atomic(self.root / STATE_FILE, (json.dumps(data, indent=2) + "\n").encode())
        self._states = states
        self._prune(name)

    def _prune(self, name: str) -> None:
        keep = self._states.get(name, ModelState()).referenced()
        model_dir = self.root / name
        if not model_dir.is_dir():
            return
        for entry in model_dir.iterdir():
            version = entry.name.removesuffix(".json") if entry.is_file() else entry.name
            if version in keep and not entry.name.startswith((_TRASH, _INCOMING)):
                continue
            if entry.is_file() and entry.name.endswith(".json"):
                entry.unlink(missing_ok=True)
        for entry in model_dir.iterdir():
            if entry.is_dir() and (entry.name not in keep or entry.name.startswith((_TRASH, _INCOMING))):
                self._discard(entry)

    def _discard(self, directory: Path) -> None:
        if not directory.name.startswith(_TRASH):
            trash = directory.with_name(f"{_TRASH}{uuid.uuid4().hex[:8]}")
            directory.rename(trash)
            directory = trash
        shutil.rmtree(directory, ignore_errors=True)

    def _load(self) -> dict[str, ModelState]:
        path = self.root / STATE_FILE
        if not path.exists():
            return {}
        try:
            raw: Any = json.loads(path.read_text())
            states = {check_segment(name, "model"): _parse_state(rec) for name, rec in raw.items()}
        except (OSError, ValueError, LookupError, AttributeError, TypeError, ValidationError) as exc:
            # Only a damaged file system gets here (the file is replaced atomically); the cloud re-delivers.
            logger.error("model store state %s is unreadable (%s); starting empty", path, exc)
            path.replace(path.with_name(f"{STATE_FILE}.corrupt-{int(time.time())}"))
            return {}
        return states

    def _recover(self) -> None:
        """Finish what a crash interrupted: drop temp files, trash, and versions no state names."""
        for tmp in self.root.glob(f"{STATE_FILE}.tmp-*"):
            tmp.unlink(missing_ok=True)
        for name, s in list(self._states.items()):
            on_disk = set(self.versions(name))
            if s.referenced() - on_disk:
                logger.error("model store: %s %s is named in the state but missing on disk", name, s.referenced())
                alive = [v for v in (s.current, s.previous) if v in on_disk]
                fixed = ModelState(alive[0] if alive else None, None, s.activated_at, s.blocked)
                self._commit(name, fixed)
        for model_dir in self.root.iterdir():
            if model_dir.is_dir():
                for tmp in model_dir.glob("*.tmp-*"):
                    tmp.unlink(missing_ok=True)
                self._prune(model_dir.name)


def _with_block(blocked: dict[str, float], version: str) -> dict[str, float]:
    kept = sorted({**blocked, version: time.time()}.items(), key=lambda item: item[1])[-MAX_BLOCKED:]
    return dict(kept)


def _parse_state(rec: dict[str, Any]) -> ModelState:
    current, previous, at, blocked = rec["current"], rec["previous"], rec.get("activated_at"), rec.get("blocked", {})
    if isinstance(blocked, list):  # written before blocks carried their time: they count from now
        blocked = dict.fromkeys(blocked, time.time())
    for version in (current, previous, *blocked):
        if version is not None:
            check_segment(version, "version")
    for value in (at, *blocked.values()):
        if value is not None and not isinstance(value, int | float):
            raise TypeError(f"a time in the state is {value!r}")
    return ModelState(current, previous, at, {v: float(t) for v, t in blocked.items()})


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    for path in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        fsync_dir(path)

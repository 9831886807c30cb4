"""The edge agent's durable outbox: usage records, telemetry and events waiting for delivery to the cloud.

Records live in one SQLite file (WAL, ``synchronous=FULL``): once ``put`` returns, the record survives
kill -9 and power loss. A sender reads ``batch()``, posts it, then ``ack``s what the cloud accepted or
``nack``s what it did not. Delivery is at-least-once; the cloud deduplicates by record id, so a batch
re-sent after a crash between post and ack is counted once.

Bound and drop policy (the bound is the sum of payload sizes in bytes, ``max_bytes``):

* Usage records are never dropped: they are what the tenant is billed for. A usage record that does not
  fit is stored anyway, over the bound, and a WARNING says the outbox is over its bound.
* To make room, the oldest telemetry goes first, then the oldest events. A telemetry sample only ever
  displaces older telemetry; an event displaces telemetry, then older events.
* A telemetry sample or event that cannot fit even so (the rest is usage) is dropped itself, so the bound
  is only ever exceeded by usage records.
* Drops are counted (``dropped_telemetry``, ``dropped_events`` in ``stats()``, kept in the file) and
  logged as one WARNING per burst of drops, with how many were dropped, when the burst ends (the next
  ``put`` that needs no drop, or ``close``).

No torch, no database server: stdlib ``sqlite3`` only, so it runs on a device.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Final

logger = logging.getLogger(__name__)

KINDS: Final = ("usage", "event", "telemetry")
# What a new record of each kind may displace when the outbox is full, in order.
_EVICTABLE: Final[dict[str, tuple[str, ...]]] = {
    "usage": ("telemetry", "event"),
    "event": ("telemetry", "event"),
    "telemetry": ("telemetry",),
}
_DROP_COUNTERS: Final = {"telemetry": "dropped_telemetry", "event": "dropped_events"}
SCHEMA_VERSION: Final = 1

# ``seq`` orders records: the device clock can jump (NTP, no RTC), so ``created_at`` is for ages only.
# Byte counts live in ``outbox_meta`` and are kept by triggers, so ``put`` checks the bound in O(1).
_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS outbox_record (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    kind TEXT NOT NULL,
    payload TEXT NOT NULL,
    size INTEGER NOT NULL,
    created_at REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS outbox_record_kind_seq ON outbox_record (kind, seq);
CREATE TABLE IF NOT EXISTS outbox_meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO outbox_meta (key, value) VALUES
    ('bytes:usage', 0), ('bytes:event', 0), ('bytes:telemetry', 0),
    ('dropped_telemetry', 0), ('dropped_events', 0);
CREATE TRIGGER IF NOT EXISTS outbox_record_added AFTER INSERT ON outbox_record BEGIN
    UPDATE outbox_meta SET value = value + NEW.size WHERE key = 'bytes:' || NEW.kind;
END;
CREATE TRIGGER IF NOT EXISTS outbox_record_removed AFTER DELETE ON outbox_record BEGIN
    UPDATE outbox_meta SET value = value - OLD.size WHERE key = 'bytes:' || OLD.kind;
END;
"""


@dataclass(frozen=True, slots=True)
class OutboxRecord:
    """One pending record, as ``batch`` hands it to the sender."""

    id: str
    kind: str
    payload: dict[str, Any]
    created_at: float
    attempts: int


class Outbox:
    """A durable, byte-bounded queue of records for the cloud, safe to call from any thread.

    Args:
        path: the SQLite file (created with mode 0600, its parent directory with 0700 when missing).
        max_bytes: bound on the sum of pending payload sizes (see the module docstring for what is dropped).
    """

    def __init__(self, path: Path, max_bytes: int = 64 * 2**20) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.path = path
        self.max_bytes = max_bytes
        # One connection behind one lock rather than one per thread: SQLite admits one writer at a time
        # anyway and every commit waits on fsync, so more connections add no throughput, only SQLITE_BUSY
        # retries and connections outliving their threads; and put's check-evict-insert must be atomic.
        self._lock = threading.Lock()
        self._burst: dict[str, int] = {"telemetry": 0, "event": 0}
        self._is_over_bound = False
        _create_private_file(path)
        db = sqlite3.connect(path, timeout=30.0, isolation_level=None, check_same_thread=False)
        try:
            if db.execute("PRAGMA journal_mode=WAL").fetchone()[0] != "wal":
                raise OSError(f"cannot put the outbox {path} in WAL mode")
            db.execute("PRAGMA synchronous=FULL")
            db.executescript(f"BEGIN IMMEDIATE; {_SCHEMA} PRAGMA user_version={SCHEMA_VERSION}; COMMIT;")
        except BaseException:
            db.close()
            raise
        self._db: sqlite3.Connection | None = db

    def __enter__(self) -> Outbox:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def put(self, kind: str, payload: dict[str, Any], record_id: str | None = None) -> str:
        """Store one record durably and return its id (a fresh uuid4 hex unless given).

        A record id already in the outbox is not stored again. A telemetry sample or event may be dropped
        instead of stored when the outbox is full of usage records (see the module docstring).

        Raises:
            ValueError: unknown kind, empty id, or a payload that is not a JSON object.
        """
        if kind not in KINDS:
            raise ValueError(f"unknown outbox record kind {kind!r}: expected one of {', '.join(KINDS)}")
        if record_id is None:
            record_id = uuid.uuid4().hex
        elif not record_id:
            raise ValueError("record_id must be a non-empty string")
        if not isinstance(payload, dict):
            raise ValueError(f"{kind} payload must be a JSON object, got {type(payload).__name__}")
        try:
            data = json.dumps(payload, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{kind} payload is not plain JSON: {exc}") from exc
        size = len(data.encode())
        dropped = {"telemetry": 0, "event": 0}
        with self._write() as db:
            if db.execute("SELECT 1 FROM outbox_record WHERE id = ?", (record_id,)).fetchone():
                return record_id
            sizes = _bytes_by_kind(db)
            over = sum(sizes.values()) + size - self.max_bytes
            is_stored = over <= 0 or kind == "usage" or over <= sum(sizes[k] for k in _EVICTABLE[kind])
            if is_stored:
                for victim in _EVICTABLE[kind]:
                    if over <= 0:
                        break
                    count, freed = _evict_oldest(db, victim, over)
                    dropped[victim] += count
                    over -= freed
                db.execute(
                    "INSERT INTO outbox_record (id, kind, payload, size, created_at) VALUES (?, ?, ?, ?, ?)",
                    (record_id, kind, data, size, time.time()),
                )
            else:
                dropped[kind] += 1
            for victim, count in dropped.items():
                if count:
                    db.execute(
                        "UPDATE outbox_meta SET value = value + ? WHERE key = ?", (count, _DROP_COUNTERS[victim])
                    )
            burst, is_newly_over, total = self._track_bound(dropped, sum(_bytes_by_kind(db).values()))
        if burst:
            _warn_dropped(burst, self.max_bytes)
        if is_newly_over:
            logger.warning(
                "outbox over its %d-byte bound (%d bytes): only undelivered usage records are left, "
                "and they are never dropped",
                self.max_bytes,
                total,
            )
        return record_id

    def batch(self, limit: int = 500, max_bytes: int = 1 << 20) -> list[OutboxRecord]:
        """The oldest pending records, up to ``limit`` records and ``max_bytes`` of payload (at least one
        record when any is pending, however large). Nothing is removed: ``ack`` what was delivered."""
        if limit < 1 or max_bytes < 1:
            raise ValueError(f"limit and max_bytes must be positive, got {limit} and {max_bytes}")
        records: list[OutboxRecord] = []
        total = 0
        with self._lock:
            rows = self._conn().execute(
                "SELECT id, kind, payload, size, created_at, attempts FROM outbox_record ORDER BY seq LIMIT ?",
                (limit,),
            )
            for record_id, kind, payload, size, created_at, attempts in rows:
                if records and total + size > max_bytes:
                    break
                total += size
                records.append(OutboxRecord(record_id, kind, json.loads(payload), created_at, attempts))
        return records

    def ack(self, ids: Iterable[str]) -> int:
        """Delete delivered records; returns how many were pending (unknown ids are ignored)."""
        with self._write() as db:
            return db.executemany("DELETE FROM outbox_record WHERE id = ?", ((i,) for i in ids)).rowcount

    def nack(self, ids: Iterable[str]) -> int:
        """Count one more failed delivery attempt on each record; returns how many were pending."""
        with self._write() as db:
            sql = "UPDATE outbox_record SET attempts = attempts + 1 WHERE id = ?"
            return db.executemany(sql, ((i,) for i in ids)).rowcount

    def stats(self) -> dict[str, Any]:
        """Pending records per kind, pending payload bytes, drops so far, and the oldest record's age
        in seconds (0.0 when nothing is pending)."""
        with self._lock:
            db = self._conn()
            pending = dict.fromkeys(KINDS, 0)
            pending.update(db.execute("SELECT kind, COUNT(*) FROM outbox_record GROUP BY kind").fetchall())
            meta = dict(db.execute("SELECT key, value FROM outbox_meta").fetchall())
            oldest = db.execute("SELECT created_at FROM outbox_record ORDER BY seq LIMIT 1").fetchone()
        return {
            "pending": pending,
            "bytes": sum(meta[f"bytes:{k}"] for k in KINDS),
            "max_bytes": self.max_bytes,
            "dropped_telemetry": meta["dropped_telemetry"],
            "dropped_events": meta["dropped_events"],
            "oldest_age_s": max(0.0, time.time() - oldest[0]) if oldest else 0.0,
        }

    def close(self) -> None:
        """Close the file (idempotent); logs a drop burst still in progress."""
        with self._lock:
            if self._db is None:
                return
            self._db.close()
            self._db = None
            burst, self._burst = self._burst, {"telemetry": 0, "event": 0}
        _warn_dropped(burst, self.max_bytes)

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError(f"the outbox {self.path} is closed")
        return self._db

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction under the lock (BEGIN IMMEDIATE: another process cannot interleave)."""
        with self._lock:
            db = self._conn()
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def _track_bound(self, dropped: dict[str, int], total: int) -> tuple[dict[str, int] | None, bool, int]:
        """Under the lock: (a finished drop burst to log, whether the bound was just exceeded, bytes)."""
        burst = None
        if any(dropped.values()):
            for kind, count in dropped.items():
                self._burst[kind] += count
        else:
            burst, self._burst = self._burst, {"telemetry": 0, "event": 0}
        is_newly_over = total > self.max_bytes and not self._is_over_bound
        self._is_over_bound = total > self.max_bytes
        return burst, is_newly_over, total


def _bytes_by_kind(db: sqlite3.Connection) -> dict[str, int]:
    rows = db.execute("SELECT key, value FROM outbox_meta WHERE key LIKE 'bytes:%'").fetchall()
    return {key.removeprefix("bytes:"): value for key, value in rows}


def _evict_oldest(db: sqlite3.Connection, kind: str, need: int) -> tuple[int, int]:
    """Delete the oldest records of ``kind`` until ``need`` bytes are freed (or none is left).

    Returns (records deleted, bytes freed)."""
    count = freed = 0
    last_seq = None
    for seq, size in db.execute("SELECT seq, size FROM outbox_record WHERE kind = ? ORDER BY seq", (kind,)):
        count, freed, last_seq = count + 1, freed + size, seq
        if freed >= need:
            break
    if last_seq is not None:
        db.execute("DELETE FROM outbox_record WHERE kind = ? AND seq <= ?", (kind, last_seq))
    return count, freed


def _warn_dropped(burst: dict[str, int], max_bytes: int) -> None:
    if any(burst.values()):
        logger.warning(
            "outbox full (%d-byte bound): dropped %d telemetry record(s) and %d event(s), oldest first",
            max_bytes,
            burst["telemetry"],
            burst["event"],
        )


def _create_private_file(path: Path) -> None:
    """Create ``path`` with mode 0600 (SQLite gives its -wal and -shm files the same mode)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        fd = os.open(path, os.O_RDWR)
        try:
            os.fchmod(fd, 0o600)
        finally:
            os.close(fd)
        return
    os.close(fd)
    # The new directory entry must reach the disk too, or a power cut can lose the whole file.
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)

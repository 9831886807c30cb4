"""The edge agent's durable outbox on real SQLite files: ordering, deduplication, the byte bound's drop policy,
durability across kill -9, and concurrent writers."""

from __future__ import annotations

import logging
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from edge_agent.outbox import Outbox

REPO = Path(__file__).resolve().parents[2]


def padded(n: int) -> dict[str, object]:
    """A payload of exactly ``n`` bytes of compact JSON."""
    return {"pad": "x" * (n - len('{"pad":""}'))}


def pending_ids(box: Outbox) -> list[str]:
    return [r.id for r in box.batch(limit=100_000, max_bytes=1 << 30)]


def test_records_come_out_oldest_first_until_acked(tmp_path: Path) -> None:
    with Outbox(tmp_path / "edge" / "outbox.db") as box:
        u = box.put("usage", {"tokens": 12, "model": "tierline/lm-edge"})
        t = box.put("telemetry", {"rss_mb": 88.5})
        e = box.put("event", {"type": "model_loaded"}, record_id="evt-1")
        assert e == "evt-1" and len(u) == 32

        first = box.batch()
        assert [(r.id, r.kind, r.payload) for r in first] == [
            (u, "usage", {"tokens": 12, "model": "tierline/lm-edge"}),
            (t, "telemetry", {"rss_mb": 88.5}),
            (e, "event", {"type": "model_loaded"}),
        ]
        assert first[0].created_at <= first[2].created_at and all(r.attempts == 0 for r in first)
        assert box.batch() == first  # reading does not remove

        assert box.nack([u, t]) == 2
        assert box.ack([u, "never-stored"]) == 1
        rest = box.batch()
        assert [(r.id, r.attempts) for r in rest] == [(t, 1), (e, 0)]
        stats = box.stats()
        assert stats["pending"] == {"usage": 0, "telemetry": 1, "event": 1}
        assert stats["oldest_age_s"] >= 0
        box.ack([t, e])
        assert box.batch() == [] and box.stats()["bytes"] == 0 and box.stats()["oldest_age_s"] == 0.0


def test_batch_respects_its_limits_but_always_makes_progress(tmp_path: Path) -> None:
    with Outbox(tmp_path / "outbox.db") as box:
        ids = [box.put("usage", padded(100)) for _ in range(5)]
        assert [r.id for r in box.batch(limit=2)] == ids[:2]
        assert [r.id for r in box.batch(max_bytes=250)] == ids[:2]
        assert [r.id for r in box.batch(max_bytes=10)] == ids[:1]  # one record bigger than the batch still goes


def test_a_record_id_put_twice_is_stored_once(tmp_path: Path) -> None:
    path = tmp_path / "outbox.db"
    with Outbox(path) as box:
        assert box.put("usage", {"tokens": 5}, record_id="req-42") == "req-42"
        assert box.put("usage", {"tokens": 5}, record_id="req-42") == "req-42"
    with Outbox(path) as box:  # after a restart too (a retried request re-records its usage)
        box.put("usage", {"tokens": 5}, record_id="req-42")
        assert pending_ids(box) == ["req-42"]
        assert box.stats()["pending"]["usage"] == 1


def test_full_outbox_drops_oldest_telemetry_then_events_and_never_usage(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "outbox.db"
    box = Outbox(path, max_bytes=1000)
    usage = [box.put("usage", padded(100)) for _ in range(2)]
    events = [box.put("event", padded(100)) for _ in range(2)]
    telemetry = [box.put("telemetry", padded(100)) for _ in range(6)]
    assert box.stats()["bytes"] == 1000 and not caplog.records

    with caplog.at_level(logging.WARNING, logger="edge_agent.outbox"):
        usage += [box.put("usage", padded(100)) for _ in range(3)]
        assert pending_ids(box) == usage[:2] + events + telemetry[3:] + usage[2:]
        assert not caplog.records  # the burst is still going on

        telemetry.append(box.put("telemetry", padded(100)))  # displaces older telemetry only
        assert pending_ids(box) == usage[:2] + events + telemetry[4:6] + usage[2:] + telemetry[6:]
        box.ack(usage[:2])
        box.put("event", padded(100))  # fits: the burst is over
        assert [r.getMessage() for r in caplog.records] == [
            "outbox full (1000-byte bound): dropped 4 telemetry record(s) and 0 event(s), oldest first"
        ]
        caplog.clear()

        usage += [box.put("usage", padded(100)) for _ in range(8)]  # telemetry, then events, then over the bound
        assert box.stats()["pending"] == {"usage": 11, "telemetry": 0, "event": 0}
        assert box.stats()["bytes"] == 1100
        assert box.put("telemetry", padded(50)) and box.put("event", padded(50))  # nothing to displace: dropped
        assert pending_ids(box) == usage[2:]
        assert [r.getMessage() for r in caplog.records] == [
            "outbox full (1000-byte bound): dropped 3 telemetry record(s) and 3 event(s), oldest first",
            "outbox over its 1000-byte bound (1100 bytes): only undelivered usage records are left, "
            "and they are never dropped",
        ]
        box.close()
        assert caplog.records[-1].getMessage() == (
            "outbox full (1000-byte bound): dropped 1 telemetry record(s) and 1 event(s), oldest first"
        )

    with Outbox(path, max_bytes=1000) as reopened:  # the drop counts are kept in the file
        stats = reopened.stats()
        assert stats["dropped_telemetry"] == 8 and stats["dropped_events"] == 4
        assert pending_ids(reopened) == usage[2:]


_KILLED_WRITER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from edge_agent.outbox import Outbox

    box = Outbox(Path(sys.argv[1]))
    for i in range(1_000_000):
        print(box.put("usage", {"request": i, "completion_tokens": 7}), flush=True)
    """
)


def test_every_acknowledged_usage_record_survives_kill_9(tmp_path: Path) -> None:
    path = tmp_path / "outbox.db"
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(path)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    printed: list[str] = []
    for line in proc.stdout:
        printed.append(line)
        if len(printed) == 200:
            os.kill(proc.pid, signal.SIGKILL)
            break
    printed += proc.stdout.readlines()  # whatever it printed before the signal landed
    proc.stdout.close()
    assert proc.wait(timeout=30) == -signal.SIGKILL

    acknowledged = [line.strip() for line in printed if line.endswith("\n")]
    assert len(acknowledged) >= 200
    with Outbox(path) as box:
        stored = set(pending_ids(box))
        assert set(acknowledged) <= stored
        assert len(stored) - len(acknowledged) <= 1  # at most the put in flight when it died


def test_concurrent_puts_from_eight_threads_lose_nothing(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "outbox.db")
    start = threading.Barrier(8)
    returned: list[list[str]] = [[] for _ in range(8)]
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            start.wait()
            for i in range(40):
                kind = ("usage", "telemetry", "event")[i % 3]
                returned[n].append(box.put(kind, {"thread": n, "i": i}))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    records = box.batch(limit=10_000)
    assert sorted(r.id for r in records) == sorted(i for ids in returned for i in ids)
    for n in range(8):  # each thread's records keep the order it put them in
        assert [r.payload["i"] for r in records if r.payload["thread"] == n] == list(range(40))
    assert sum(box.stats()["pending"].values()) == 320
    box.close()


def test_outbox_files_are_private(tmp_path: Path) -> None:
    path = tmp_path / "state" / "outbox.db"
    with Outbox(path) as box:
        box.put("usage", {"tokens": 1})
        for p in (path, path.with_name("outbox.db-wal")):
            assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    path.chmod(0o644)
    Outbox(path).close()  # an existing file is made private again
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_bad_input_gets_a_clear_error(tmp_path: Path) -> None:
    with Outbox(tmp_path / "outbox.db") as box:
        with pytest.raises(ValueError, match="unknown outbox record kind 'metrics': expected one of usage, event"):
            box.put("metrics", {"x": 1})
        with pytest.raises(ValueError, match="usage payload is not plain JSON"):
            box.put("usage", {"tokens": float("nan")})
        with pytest.raises(ValueError, match="record_id must be a non-empty string"):
            box.put("usage", {}, record_id="")
    with pytest.raises(RuntimeError, match="is closed"):
        box.put("usage", {})


def test_the_outbox_connection_syncs_every_commit_to_disk(tmp_path: Path) -> None:
    """``synchronous=FULL`` on the outbox's own connection (the setting is per connection): with WAL's NORMAL a
    power cut could undo an ``ack`` or a ``put`` that had already returned, losing or duplicating a batch."""
    path = tmp_path / "edge" / "outbox.db"
    for _ in ("new file", "reopened"):
        with Outbox(path) as box:
            db = box._conn()
            assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
            assert db.execute("PRAGMA synchronous").fetchone()[0] == 2  # 2 = FULL (1 = NORMAL)
            box.put("usage", {"tokens": 1})

"""The device's model store: versions switch atomically, roll back, survive kill -9 at any point; and the
health watch that rolls a bad new version back."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from edge_agent.model_store import ModelStore
from edge_agent.updater import HealthWatch
from shared.artifacts import Manifest, build_manifest, verify_files
from shared.errors import NotFoundError, ValidationError
from tests.conftest import REPO


def make_version(src: Path, version: str, name: str = "m") -> tuple[Path, Manifest]:
    d = src / f"{name}-{version}"
    d.mkdir(parents=True)
    (d / "weights.bin").write_bytes(version.encode() * 1000)
    (d / "sub").mkdir()
    (d / "sub" / "config.json").write_text(json.dumps({"version": version}))
    return d, build_manifest(d, name=name, version=version, kind="tensor", format="onnx")


def install(store: ModelStore, src: Path, version: str, name: str = "m") -> None:
    d, manifest = make_version(src, version, name)
    store.install(name, version, d, manifest)
    store.activate(name, version)


def version_dirs(store: ModelStore, name: str = "m") -> list[str]:
    return sorted(p.name for p in (store.root / name).iterdir())


def test_activate_keeps_current_and_previous_and_deletes_older(tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "state")
    assert store.current("m") is None and store.current_dir("m") is None
    for v in ("1", "2", "3"):
        install(store, tmp_path / "src", v)
    assert (store.current("m"), store.state("m").previous) == ("3", "2")
    assert store.versions("m") == ["2", "3"]
    assert version_dirs(store) == ["2", "2.json", "3", "3.json"]
    current = store.current_dir("m")
    assert current is not None and (current / "weights.bin").read_bytes() == b"3" * 1000
    verify_files(store.manifest("m", "3"), current)

    reopened = ModelStore(tmp_path / "state")
    assert (reopened.current("m"), reopened.state("m").previous) == ("3", "2")
    assert reopened.names() == ["m"]


def test_rollback_restores_previous_deletes_and_blocks_the_bad_version(tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "state")
    install(store, tmp_path / "src", "1")
    with pytest.raises(NotFoundError, match="no previous version"):
        store.rollback("m")
    install(store, tmp_path / "src", "2")
    assert store.rollback("m") == "1"
    assert (store.current("m"), store.state("m").previous) == ("1", None)
    assert store.versions("m") == ["1"] and store.is_blocked("m", "2")
    assert ModelStore(tmp_path / "state").is_blocked("m", "2")


def test_switching_back_to_previous_swaps_them(tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "state")
    install(store, tmp_path / "src", "1")
    install(store, tmp_path / "src", "2")
    store.activate("m", "1")
    assert (store.current("m"), store.state("m").previous) == ("1", "2")


def test_a_version_not_completely_installed_cannot_become_current(tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "state")
    install(store, tmp_path / "src", "1")
    # What a crash leaves: a directory renamed in without its manifest, a half copy, a half-written state.
    half = store.root / "m" / "2"
    half.mkdir()
    (half / "weights.bin").write_bytes(b"2" * 10)
    (store.root / "m" / ".incoming-3-abcd1234").mkdir()
    (store.root / "state.json.tmp-deadbeef").write_text('{"m": {"current": "2", "prev')
    assert store.versions("m") == ["1"]
    with pytest.raises(NotFoundError, match="not installed"):
        store.activate("m", "2")

    reopened = ModelStore(tmp_path / "state")
    assert reopened.current("m") == "1"
    assert version_dirs(reopened) == ["1", "1.json"]
    assert sorted(p.name for p in reopened.root.iterdir()) == ["m", "state.json"]


def test_unreadable_state_starts_empty_instead_of_failing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = ModelStore(tmp_path / "state")
    install(store, tmp_path / "src", "1")
    (store.root / "state.json").write_text("{not json")
    reopened = ModelStore(tmp_path / "state")
    assert reopened.current("m") is None and reopened.versions("m") == []
    assert "unreadable" in caplog.text


def test_names_and_versions_must_be_single_safe_segments(tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "state")
    d, manifest = make_version(tmp_path / "src", "1")
    for name, version in (("../etc", "1"), ("m", ".."), ("m", "a/b"), ("", "1")):
        with pytest.raises(ValidationError):
            store.install(name, version, d, manifest)


_CHURN = """
import sys
from pathlib import Path
from edge_agent.model_store import ModelStore
from shared.artifacts import build_manifest

store, src = ModelStore(Path(sys.argv[1])), Path(sys.argv[2])
i = int(store.current("m") or 0)
print("ready", flush=True)
while True:
    i += 1
    d = src / str(i)
    d.mkdir(parents=True, exist_ok=True)
    for k in range(3):
        (d / f"part{k}.bin").write_bytes(str(i).encode() * 20000)
    store.install("m", str(i), d, build_manifest(d, name="m", version=str(i), kind="tensor", format="onnx"))
    store.activate("m", str(i))
"""


def test_kill_9_at_any_point_reopens_consistent(tmp_path: Path) -> None:
    state_dir, seen = tmp_path / "state", []
    for i, delay in enumerate((0.05, 0.12, 0.2, 0.31, 0.45, 0.6)):
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHURN, str(state_dir), str(tmp_path / f"src{i}")],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()

        store = ModelStore(state_dir)
        state = store.state("m")
        seen.append(state.current)
        for version in state.referenced():
            directory = store.version_dir("m", version)
            verify_files(store.manifest("m", version), directory)
            assert (directory / "part0.bin").read_bytes() == version.encode() * 20000
        assert set(store.versions("m")) == state.referenced()
        leftovers = [p.name for p in store.root.rglob("*") if p.name.startswith(".") or ".tmp-" in p.name]
        assert leftovers == []
    assert len({v for v in seen if v is not None}) >= 3, f"the churn hardly ran: {seen}"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def two_versions(tmp_path: Path) -> ModelStore:
    store = ModelStore(tmp_path / "state")
    install(store, tmp_path / "src", "1")
    install(store, tmp_path / "src", "2")
    return store


def test_health_watch_rolls_back_a_failing_new_version_once(tmp_path: Path) -> None:
    store, events = two_versions(tmp_path), list[tuple[str, dict[str, Any]]]()
    watch = HealthWatch(store, lambda k, p: events.append((k, p)), max_error_rate=0.3, min_requests=10)
    outcomes = [watch.record("m", "2", ok=i % 2 == 0) for i in range(9)]  # 4 errors in 9: under min_requests
    assert not any(outcomes) and store.current("m") == "2"
    assert watch.record("m", "2", ok=False) is True  # 5 errors in 10
    assert store.current("m") == "1" and store.is_blocked("m", "2")
    assert events == [
        (
            "update.rolled_back",
            {"model": "m", "version": "2", "restored": "1", "requests": 10, "errors": 5, "error_rate": 0.5},
        )
    ]
    assert watch.record("m", "2", ok=False) is False  # stale requests on the old version change nothing
    assert watch.record("m", "1", ok=False) is False  # nothing before 1 to go back to


def test_health_watch_leaves_a_healthy_or_settled_version_alone(tmp_path: Path) -> None:
    store, clock = two_versions(tmp_path), Clock()
    watch = HealthWatch(store, lambda k, p: None, window_s=60, max_error_rate=0.2, min_requests=5, clock=clock)
    assert not any(watch.record("m", "2", ok=i != 0) for i in range(20))  # 1 error in 20
    clock.now += 61  # past the watch window: errors no longer roll back
    assert not any(watch.record("m", "2", ok=False) for _ in range(20))
    assert store.current("m") == "2"

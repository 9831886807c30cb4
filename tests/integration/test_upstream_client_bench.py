"""``python -m bench.lab.upstream_client_bench`` runs end to end on a tiny workload and reports the keys its JSON
promises, both clients having relayed every event of every stream (speed is what the benchmark measures, not what
tests assert)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.integration


def test_the_upstream_client_bench_measures_both_clients_on_whole_streams() -> None:
    args = ["--requests", "12", "--concurrency", "3", "--events", "5", "--rounds", "2", "--gap-ms", "0"]
    proc = subprocess.run(
        [sys.executable, "-m", "bench.lab.upstream_client_bench", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr  # a stream that lost an event fails the run
    report = json.loads(proc.stdout)
    assert report["requests"] == 12 and report["events_per_call"] == 7 and report["loop"] == "uvloop"
    for name in ("httpx", "lean"):
        assert len(report["per_round"][name]) == 2
        assert all(r["cpu_ms_per_call"] > 0 for r in report["per_round"][name])
    assert report["lean_over_httpx"] == pytest.approx(
        report["lean_cpu_ms_per_call"] / report["httpx_cpu_ms_per_call"], rel=0.01
    )

"""``python -m bench.lab.wake_cost``: a wake-up's CPU per loop and sleep length, as JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_each_sleep_length_reports_both_loops_cpu_per_wake() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.lab.wake_cost", "--wakes", "20", "--sleep-ms", "2,0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    report = json.loads(done.stdout)
    assert report["wakes"] == 20 and set(report["by_sleep_ms"]) == {"2.0", "0.0"}
    for point in report["by_sleep_ms"].values():
        # a wake-up costs something, and far less than the sleep it ends (2 ms): CPU, not wall time, is counted
        assert 0 < point["asyncio_cpu_us_per_wake"] < 2000 and 0 < point["uvloop_cpu_us_per_wake"] < 2000

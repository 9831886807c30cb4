"""``HostLoad``: the cores the host's other processes leave idle, from ``/proc/stat`` less this process's own CPU
time. On a written stat file (the arithmetic) and on this host's own, with a real busy process beside it."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cloud.engine.host_load import HostLoad
from tests.host_stat import Host


def test_an_idle_host_gives_a_step_every_core(tmp_path: Path) -> None:
    host = Host(tmp_path / "stat", 2)
    load = host.load({0, 1})
    host.run(1.0, [0.02, 0.0])
    assert load.other_cores() == pytest.approx(0.02, abs=0.011)
    assert load.threads(2) == 2
    assert load.threads(8) == 2  # never more threads than CPUs
    assert load.threads(1) == 1


def test_another_process_on_one_core_leaves_one_thread(tmp_path: Path) -> None:
    host = Host(tmp_path / "stat", 2)
    load = host.load({0, 1})
    host.run(1.0, [1.0, 0.05])
    assert load.other_cores() == pytest.approx(1.05, abs=0.011)
    assert load.threads(2) == 1
    host.run(1.0, [1.0, 1.0])  # both cores taken: still one thread, never none
    assert load.threads(2) == 1
    host.run(1.0, [0.0, 0.0])  # the other process ended: both again
    assert load.threads(2) == 2


def test_a_core_more_than_half_idle_counts_and_a_busier_one_does_not(tmp_path: Path) -> None:
    host = Host(tmp_path / "stat", 4)
    load = host.load({0, 1, 2, 3})
    host.run(1.0, [0.4, 0.0, 0.0, 0.0])
    assert load.threads(4) == 4
    host.run(1.0, [0.6, 0.0, 0.0, 0.0])
    assert load.threads(4) == 3
    host.run(1.0, [1.0, 1.0, 0.0, 0.0])
    assert load.threads(4) == 2


def test_this_processs_own_threads_are_not_other_load(tmp_path: Path) -> None:
    """An engine's own threads (a step's OpenMP workers spinning, the HTTP front in the same process) keep its
    cores busy: that is not a reason to give them up."""
    host = Host(tmp_path / "stat", 2)
    load = host.load({0, 1})
    host.run(1.0, [1.0, 1.0], own_cores=2.0)
    assert load.other_cores() == pytest.approx(0.0, abs=0.011)
    assert load.threads(2) == 2
    host.run(1.0, [1.0, 1.0], own_cores=1.0)
    assert load.threads(2) == 1


def test_only_this_processs_cpus_count(tmp_path: Path) -> None:
    """A process pinned to CPUs 2 and 3 (a container's cpuset) does not back off for work on CPUs 0 and 1."""
    host = Host(tmp_path / "stat", 4)
    load = host.load({2, 3})
    host.run(1.0, [1.0, 1.0, 0.0, 0.0])
    assert load.threads(2) == 2
    host.run(1.0, [0.0, 0.0, 1.0, 0.0])
    assert load.threads(2) == 1


def test_the_load_is_read_again_only_after_the_refresh_interval(tmp_path: Path) -> None:
    host = Host(tmp_path / "stat", 2)
    load = host.load({0, 1})
    host.run(1.0, [1.0, 0.0])
    assert load.threads(2) == 1
    host.run(load.refresh_seconds / 2, [0.0, 0.0])
    assert load.threads(2) == 1  # (the last reading, not yet a new one)
    host.run(load.refresh_seconds, [0.0, 0.0])
    assert load.threads(2) == 2  # over the time since the last reading


def test_without_a_readable_stat_the_load_is_unknown(tmp_path: Path) -> None:
    load = HostLoad(stat_path=tmp_path / "missing")
    assert math.isinf(load.other_cores())
    assert load.threads(2) is None  # (the runner then keeps its size rule)
    (tmp_path / "garbled").write_text("cpu0 1 2\n")
    assert HostLoad(stat_path=tmp_path / "garbled").threads(2) is None


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="no /proc/stat on this host (not Linux)")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU for this process: no second core to give up")
def test_a_real_busy_process_beside_this_one_takes_a_thread_away() -> None:
    """This host's own /proc/stat: a child spinning on a core shows as at least most of a core of other load (more
    where the host is busier still), and a step gets fewer threads than this process has CPUs."""
    load = HostLoad(refresh_seconds=0.5)
    cpus = len(load.cpus)
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        load.other_cores()
        time.sleep(0.2)  # (the child starting up)
        load._last = load._sample()
        time.sleep(0.8)
        assert load.other_cores() >= 0.7
        threads = load.threads(cpus)
        assert threads is not None and threads < cpus
    finally:
        child.kill()
        child.wait()

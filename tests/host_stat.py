"""A ``/proc/stat`` written by a test, with a clock and this process's CPU time: a host whose load a test sets,
for ``HostLoad`` (``cloud/engine/host_load.py``) and the runners that read it."""

from __future__ import annotations

import os
from pathlib import Path

from cloud.engine.host_load import HostLoad

TICKS = os.sysconf("SC_CLK_TCK")


class Host:
    """A ``/proc/stat`` to write: per CPU, cumulative busy and idle ticks; a clock and this process's CPU seconds."""

    def __init__(self, path: Path, cpus: int) -> None:
        self.path = path
        self.busy = [1000] * cpus
        self.idle = [5000] * cpus
        self.now = 100.0
        self.own = 3.0
        self.write()

    def write(self) -> None:
        total = [sum(self.busy), sum(self.idle)]
        lines = [f"cpu  {total[0]} 0 0 {total[1]} 0 0 0 0 0 0"]
        # user nice system idle iowait irq softirq steal guest guest_nice: busy split over user and system, and a
        # little I/O wait (idle) and steal (busy) so that each field is read for what it is
        lines += [
            f"cpu{i} {b - b // 4 - 2} 0 {b // 4} {i_ - 3} 3 0 0 2 0 0"
            for i, (b, i_) in enumerate(zip(self.busy, self.idle, strict=True))
        ]
        lines += ["intr 12345", "ctxt 999", "btime 1700000000", "processes 42"]
        self.path.write_text("\n".join(lines) + "\n")

    def run(self, seconds: float, busy_cores: list[float], own_cores: float = 0.0) -> None:
        """``seconds`` pass; CPU i is busy ``busy_cores[i]`` of them (this process's share included)."""
        for i, share in enumerate(busy_cores):
            self.busy[i] += round(share * seconds * TICKS)
            self.idle[i] += round((1 - share) * seconds * TICKS)
        self.now += seconds
        self.own += own_cores * seconds
        self.write()

    def load(self, cpus: set[int]) -> HostLoad:
        return HostLoad(clock=lambda: self.now, stat_path=self.path, own_cpu_seconds=lambda: self.own, cpus=cpus)


def idle_host(path: Path, cpus: int = 2) -> HostLoad:
    """A ``HostLoad`` that reads an idle host of ``cpus`` CPUs (none busy over the last second)."""
    host = Host(path, cpus)
    load = host.load(set(range(cpus)))
    host.run(1.0, [0.0] * cpus)
    return load


def busy_host(path: Path, cpus: int = 2, busy: int = 1) -> HostLoad:
    """A ``HostLoad`` that reads ``busy`` of ``cpus`` CPUs taken by other processes over the last second."""
    host = Host(path, cpus)
    load = host.load(set(range(cpus)))
    host.run(1.0, [1.0] * busy + [0.0] * (cpus - busy))
    return load

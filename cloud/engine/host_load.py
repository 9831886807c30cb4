"""How many of this process's CPUs the host's other work leaves idle, measured as the engine runs.

A fused CPU step (``FusedDecoder``) of one sequence is bound by reading the weights: the demo cloud LM's token took
1.40 ms on one core of a 2-core Xeon, 0.81 on two. But a parallel step's threads meet a few dozen times a step, and
where another process wants the second core each meeting waits for the thread the scheduler took off it: with the
other core busy, two threads cost 1.5x one (docs/engine.md#threads-of-a-small-step), and a large step through torch
too (a 158-token prompt of that LM: 25 ms on one thread, 36 on two; 23 on two with the core idle). So a step takes a
second thread only where the second core is idle: ``HostLoad`` reads the CPU time the CPUs in this process's
affinity spent busy (``/proc/stat``) less this process's own (``os.times``), over the last ``refresh_seconds``.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from pathlib import Path

STAT = Path("/proc/stat")


def _affinity() -> set[int]:
    getter = getattr(os, "sched_getaffinity", None)
    return set(getter(0)) if getter is not None else set(range(os.cpu_count() or 1))


class HostLoad:
    """``other_cores()``: CPU time the host's other processes used on this process's CPUs over the last window, in
    cores (0.0 on an idle host; 1.0 where one core's worth of other work runs); ``idle_cores()`` what that leaves.
    Where ``/proc/stat`` cannot be read (not Linux), ``threads`` says so (None) and the caller keeps its rule."""

    def __init__(
        self,
        refresh_seconds: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
        stat_path: Path = STAT,
        own_cpu_seconds: Callable[[], float] | None = None,
        cpus: set[int] | None = None,
    ) -> None:
        self.refresh_seconds = refresh_seconds
        self.clock = clock
        self.stat_path = stat_path
        self.own_cpu_seconds = own_cpu_seconds or (lambda: sum(os.times()[:2]))
        self.cpus = cpus if cpus is not None else _affinity()  # (default: this process's affinity)
        self._ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last = self._sample()
        self._other = math.inf if self._last is None else 0.0

    def _busy_seconds(self) -> float | None:
        """Seconds the CPUs in ``cpus`` have spent busy since boot (all but idle and I/O wait, steal included)."""
        try:
            lines = self.stat_path.read_text().splitlines()
        except OSError:
            return None
        ticks = 0
        seen = 0
        for line in lines:
            name, _, rest = line.partition(" ")
            if not name.startswith("cpu") or not name[3:].isdigit() or int(name[3:]) not in self.cpus:
                continue
            fields = [int(f) for f in rest.split()[:8]]
            if len(fields) < 5:
                return None
            ticks += sum(fields) - fields[3] - fields[4]  # user nice system idle iowait irq softirq steal
            seen += 1
        return ticks / self._ticks if seen else None

    def _sample(self) -> tuple[float, float, float] | None:
        busy = self._busy_seconds()
        return None if busy is None else (self.clock(), busy, self.own_cpu_seconds())

    def other_cores(self) -> float:
        """The other processes' load on this process's CPUs, in cores, as of at most ``refresh_seconds`` ago (inf
        when it cannot be read)."""
        if self._last is None:
            return math.inf
        if self.clock() - self._last[0] >= self.refresh_seconds:
            now = self._sample()
            if now is None:
                self._last, self._other = None, math.inf
                return self._other
            wall = now[0] - self._last[0]
            others = (now[1] - self._last[1]) - (now[2] - self._last[2])
            self._other = max(0.0, others / wall)
            self._last = now
        return self._other

    def idle_cores(self) -> float:
        """This process's CPUs less the other processes' load on them (this process's own threads count as idle)."""
        return max(0.0, len(self.cpus) - self.other_cores())

    def threads(self, wanted: int) -> int | None:
        """Up to ``wanted`` threads, one for each of this process's CPUs at least half idle (at least one); None
        where the load cannot be read."""
        if math.isinf(self.other_cores()):
            return None
        return max(1, min(wanted, int(self.idle_cores() + 0.5)))

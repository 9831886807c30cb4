"""The benches' CPU accounting of a process tree keeps the CPU of children that exited (a recycled worker)."""

from __future__ import annotations

import subprocess
import sys
import time

from bench.common import tree_cpu_seconds
from bench.scale_bench import _tree_cpu

PARENT = """
import subprocess, sys, time
subprocess.run([sys.executable, "-c", "x = 0\\nfor i in range(6 * 10**6): x += i"])
print("child done", flush=True)
time.sleep(30)
"""


def test_the_cpu_of_a_reaped_child_still_counts() -> None:
    proc = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "child done"
        time.sleep(0.05)
        # The child burned CPU and is gone; the parent only waited. Without cutime/cstime the tree's CPU would be
        # the parent's own few hundredths of a second.
        assert _tree_cpu(proc.pid) >= 0.15
    finally:
        proc.kill()
        proc.communicate()


BURNER = """
import sys, time
for line in sys.stdin:
    start = time.process_time()
    while time.process_time() - start < 0.005:
        pass
    print("burned", flush=True)
"""


def test_a_few_milliseconds_of_cpu_are_resolved() -> None:
    """A bench point of 8 requests costs a gateway ~25 ms of CPU; /proc's 10 ms ticks read that as 0.0 once (CI,
    stop 36). The tree's CPU comes from each process's CPU clock, to well under a millisecond."""
    proc = subprocess.Popen([sys.executable, "-c", BURNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        deltas = []
        for _ in range(4):  # the first round takes in the interpreter's start-up
            before = tree_cpu_seconds(proc.pid)
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "burned"
            deltas.append(tree_cpu_seconds(proc.pid) - before)
        # 5 ms burned (plus a pipe read and write): never 0 or a whole tick, as tick counting gives
        assert all(0.0045 <= d < 0.009 for d in deltas[1:]), deltas
    finally:
        proc.kill()
        proc.communicate()

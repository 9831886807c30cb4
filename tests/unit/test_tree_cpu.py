"""The benches' CPU accounting of a process tree keeps the CPU of children that exited (a recycled worker)."""

from __future__ import annotations

import subprocess
import sys
import time

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

"""What one wake-up of an idle event loop costs this process in CPU, by how long the loop slept first.

A gateway relaying one stream at a time sleeps between every event; on a virtual machine a wake-up after a long
sleep costs far more CPU than one after a short one, and that cost is charged to the process. This loop only
sleeps and wakes (``asyncio.sleep``, on asyncio and on uvloop) and reports the process's CPU microseconds per
wake-up: the floor under any per-event cost measured one stream at a time on the same host.

    python -m bench.lab.wake_cost --wakes 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import uvloop


async def _sleeps(wakes: int, sleep_s: float) -> float:
    started = time.process_time()
    for _ in range(wakes):
        await asyncio.sleep(sleep_s)
    return (time.process_time() - started) / wakes * 1e6


def run(wakes: int, sleeps_ms: list[float]) -> dict[str, Any]:
    points = {}
    for ms in sleeps_ms:
        points[str(ms)] = {
            "asyncio_cpu_us_per_wake": round(asyncio.run(_sleeps(wakes, ms / 1000)), 1),
            "uvloop_cpu_us_per_wake": round(uvloop.run(_sleeps(wakes, ms / 1000)), 1),
        }
    return {"wakes": wakes, "by_sleep_ms": points}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wakes", type=int, default=300)
    parser.add_argument("--sleep-ms", default="10,1,0", help="comma-separated: one point each")
    args = parser.parse_args()
    print(json.dumps(run(args.wakes, [float(v) for v in args.sleep_ms.split(",")]), indent=2))


if __name__ == "__main__":
    main()

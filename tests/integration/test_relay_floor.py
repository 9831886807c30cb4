"""``python -m bench.lab.relay_floor`` end to end, tiny: the gateway and the three floor relays on the platform of
``bench scale`` each relay every event of every stream (the bench refuses to report a path that does not), and
each path's CPU is split into a fixed part and a part per token."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PG_URL
from tests.integration.test_bench_scale import REDIS_URL, _redis_answers

pytestmark = [pytest.mark.integration, pytest.mark.postgres]

REPO = Path(__file__).resolve().parents[2]


def test_every_path_relays_every_event_and_is_split(tiny_zoo: Path, session_data_dir: Path) -> None:
    if not PG_URL:
        pytest.skip("PostgreSQL not configured: set TIERLINE_TEST_DATABASE_URL (the bench's gateway meters in it)")
    if not _redis_answers():
        pytest.skip(f"no Redis at {REDIS_URL}: the bench's gateway counts its rate limit there")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERLINE_")}
    env.update(
        {
            "TIERLINE_DATA_DIR": str(session_data_dir),
            "TIERLINE_BENCH_DATABASE_URL": PG_URL,
            "TIERLINE_BENCH_REDIS_URL": REDIS_URL,
        }
    )
    done = subprocess.run(
        [sys.executable, "-m", "bench.lab.relay_floor", "--rounds", "1", "--requests", "4", "--tokens", "2,8"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["tokens"] == [2, 8] and set(result["paths"]) == {"gateway", "litestar", "json", "raw"}
    for path, point in result["paths"].items():
        assert len(point["cpu_ms_per_request_at_2"]) == 1 and len(point["cpu_ms_per_request_at_8"]) == 1, path
        assert point["cpu_ms_per_request_at_2"][0] > 0 and point["cpu_ms_per_request_at_8"][0] > 0, (path, point)
        assert isinstance(point["fixed_ms"], float) and isinstance(point["per_token_us"], float), (path, point)

"""``tierline bench scale`` runs end to end, tiny: an engine server, two gateways on PostgreSQL + Redis behind the
bench's round-robin front, a kill -9 of one mid-load; and, where the LiteLLM proxy is installed (``make
bench-peers``), the side-by-side points. What it asserts is what the bench exists to show: after the kill no
usage record is lost or duplicated, the spend equals the records' cost and nothing stays reserved; only requests
on the killed gateway's connections fail."""

from __future__ import annotations

import os
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from bench.scale_bench import find_litellm, run_scale_bench
from tests.conftest import PG_URL

pytestmark = [pytest.mark.integration, pytest.mark.postgres]

REDIS_URL = os.environ.get("TIERLINE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def _redis_answers() -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(REDIS_URL, socket_timeout=2).ping())
    except redis.RedisError:
        return False


def _run(tiny_zoo: Path, session_data_dir: Path, **options: Any) -> dict[str, Any]:
    """A tiny run of the bench: 8 requests from 4 clients per path, on PostgreSQL and Redis (skipped without)."""
    if not PG_URL:
        pytest.skip("PostgreSQL not configured: set TIERLINE_TEST_DATABASE_URL (the bench's gateways share it)")
    if not _redis_answers():
        pytest.skip(f"no Redis at {REDIS_URL}: the bench's gateways share rate limits through it")
    return run_scale_bench(
        tiny_zoo, session_data_dir, db_url=PG_URL, redis_url=REDIS_URL, requests=8, concurrency=4, **options
    )


@pytest.fixture(scope="module")
def scale(tiny_zoo: Path, session_data_dir: Path) -> dict[str, Any]:
    """One tiny run of the bench (with LiteLLM when it is installed), shared by the tests below."""
    litellm = find_litellm()
    options = {"vs_litellm": litellm is not None, "peer_requests": {1: 3, 8: 8}, "rounds": 2}
    return _run(tiny_zoo, session_data_dir, max_tokens=8, duration=10.0, **options)


def test_one_and_two_gateways_serve_every_request(scale: dict[str, Any]) -> None:
    for path in ("direct", "one_gateway", "two_gateways"):
        point = scale["paths"][path]
        assert point["errors"] == 0 and point["requests"] == 8, (path, point)
        assert point["p50_ms"] > 0
    assert scale["paths"]["two_gateways"]["gateway_cpu_s_per_1000"] > 0


def test_a_killed_gateway_loses_and_duplicates_no_record(scale: dict[str, Any]) -> None:
    kill = scale["kill"]
    assert kill["served"] > 0
    assert kill["failed"] <= 4, kill  # at most the streams on the killed gateway's connections (4 clients)
    # each failure says why (a connection the kill broke: a transport error or a stream cut short)
    assert sum(kill["failed_reasons"].values()) == kill["failed"] and "?" not in kill["failed_reasons"], kill
    assert kill["records_lost"] == 0 and kill["records_of_unknown_requests"] == 0, kill
    # a prompt billed for a stream cut before its headers is a failed request's record, one at most each
    assert kill["records_of_failed_requests_cut_before_headers"] <= kill["failed"], kill
    assert kill["reservations_released_s_after_kill"] is not None, kill  # the dead gateway's holds were released
    assert Decimal(kill["spent_minus_records_cost"]) == 0, kill
    assert Decimal(kill["budget_overspend"]) == 0
    assert kill["survivor_requests_per_s"] > 0


def test_litellm_side_by_side(scale: dict[str, Any]) -> None:
    vs = scale.get("vs_litellm")
    if vs is None:
        pytest.skip("LiteLLM is not installed (make bench-peers makes .venv-peers): the side-by-side did not run")
    assert vs["litellm_version"] and vs["rounds"] == 2
    for c in ("1", "8"):
        point = vs["points"][c]
        assert point["litellm"]["errors"] == 0 and point["tierline"]["errors"] == 0, point
        assert point["tierline"]["spend_records_per_request"] == 1.0  # every request of both rounds has its record
        assert point["litellm"]["gateway_cpu_s_per_1000"] > 0
        assert point["tierline"]["gateway_cpu_s_per_1000"] > 0
        assert len(point["rounds"]) == 2  # alternated, each round's numbers kept
        cpu = [r["tierline_cpu_s_per_1000"] for r in point["rounds"]]
        assert point["tierline"]["gateway_cpu_s_per_1000"] == pytest.approx(sum(cpu) / 2, abs=0.01)
        ratio = point["tierline"]["gateway_cpu_s_per_1000"] / point["litellm"]["gateway_cpu_s_per_1000"]
        assert point["cpu_ratio_tierline_to_litellm"] == pytest.approx(ratio, abs=1e-3)


def test_a_paced_upstream_takes_the_model_servers_place(tiny_zoo: Path, session_data_dir: Path) -> None:
    """``--upstream paced``: the same bench in front of a model server that streams at a set pace (the gateway's
    overhead without a model server taking its cores); nothing else changes, the ledger checks included."""
    result = _run(tiny_zoo, session_data_dir, max_tokens=6, duration=6.0, pace=(20.0, 10.0))
    assert result["upstream"] == {"kind": "paced (bench.paced_upstream)", "ttft_ms": 20.0, "token_ms": 10.0}
    for path in ("direct", "one_gateway", "two_gateways"):
        point = result["paths"][path]
        assert point["errors"] == 0 and point["content_events_p50"] == 6, (path, point)
        assert point["p50_ms"] >= 20 + 5 * 10 * 0.9, "the stream takes the upstream's pace"
    kill = result["kill"]
    assert kill["records_lost"] == 0 and kill["records_of_unknown_requests"] == 0, kill
    assert Decimal(kill["spent_minus_records_cost"]) == 0, kill

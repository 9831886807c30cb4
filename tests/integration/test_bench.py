"""The benchmarks run end to end on the test zoo and report the keys the issues ask for (no speed asserted:
speed is what the benchmarks measure, on the demo zoo)."""

from __future__ import annotations

from pathlib import Path

from bench.engine_bench import bench_engine, bench_prefix, bench_spec
from bench.tensor_bench import run_tensor_bench


def test_engine_bench_reports_throughput_latency_and_baselines(tiny_zoo: Path) -> None:
    r = bench_engine(tiny_zoo, num_requests=6, max_num_seqs=4, rounds=2)
    # Every contender ran once a round; the rates reported are rounds' own (the median round's).
    for key in ("engine_tokens_per_s", "hf_sequential_tokens_per_s", "hf_static_batch_tokens_per_s"):
        assert len(r[f"{key}_runs"]) == 2 and r[key] in r[f"{key}_runs"], key
    for key in (
        "engine_tokens_per_s",
        "hf_sequential_tokens_per_s",
        "hf_static_batch_tokens_per_s",
        "speedup_vs_hf_sequential",
        "speedup_vs_hf_static_batch",
        "efficiency_vs_raw_forward",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "itl_p50_ms",
        "itl_p99_ms",
        "peak_rss_mb",
    ):
        assert r[key] > 0, key
    assert r["outputs_identical_to_hf"] == "6/6"
    assert 0 < r["engine_forward_share"] <= 1
    # The same work on the bare forward alone: the reference the engine's efficiency is read against.
    assert r["forward_only_tokens_per_s"] > 0 and r["forward_only_vs_raw_forward"] > 0
    ratio = r["engine_tokens_per_s"] / r["forward_only_tokens_per_s"]
    assert abs(r["efficiency_vs_forward_only"] - ratio) < 0.01


def test_spec_and_prefix_benches_report_their_keys(tiny_zoo: Path) -> None:
    spec = bench_spec(tiny_zoo, num_prompts=2, num_tokens=12, concurrency=(1, 16), rounds=1)  # keys, not speeds
    assert spec["outputs_identical"] is True
    for key in ("plain_tokens_per_s", "spec_tokens_per_s", "ngram_tokens_per_s", "hf_assisted_tokens_per_s"):
        assert spec[key] > 0, key
    assert 0 <= spec["acceptance_rate"] <= 1 and spec["spec_speedup_at_16"] > 0
    # The cost of a speculation round in forwards: the verification's and the draft's, each against a plain one.
    assert spec["target_verify_5_tokens_ms"] > 0 and spec["draft_forward_ms"] > 0
    plain_ms = spec["target_forward_ms"]
    ratio = spec["target_verify_5_tokens_ms"] / plain_ms
    # The report rounds the times to 3 decimals and the ratio (of the unrounded times) to 2: recomputed from the
    # rounded times it can differ by that rounding, which is large when a forward takes a tenth of a millisecond.
    slack = 0.005 + 0.0005 * (1 + ratio) / plain_ms
    assert abs(spec["verify_cost_ratio"] - ratio) <= slack
    assert spec["plain_step_ms"] > 0
    prefix = bench_prefix(tiny_zoo, num_requests=2, system_tokens=64)
    assert prefix["prefix_cache_hit_rate"] > 0.5 and prefix["ttft_speedup"] > 0


def test_tensor_bench_batches_and_agrees_with_unbatched(tiny_zoo: Path) -> None:
    r = run_tensor_bench(tiny_zoo, num_requests=200, concurrency=16)
    assert r["max_abs_diff_batched_vs_unbatched"] == 0.0
    assert r["mean_batch_size"] > 1 and r["batched_requests_per_s"] > 0
    load = r["registry_load"]  # a registry version of the model, verified and loaded on first use
    assert load["artifact_bytes"] > 0 and load["cold_load_ms_p50"] > 0 and load["cached_load_ms_p50"] > 0


def test_api_bench_streams_over_its_own_connections_and_matches_every_request(
    tiny_zoo: Path, session_data_dir: Path
) -> None:
    from bench.api_bench import run_api_bench

    r = run_api_bench(tiny_zoo, session_data_dir, duration_s=2.0, concurrency=4, max_tokens=4)
    assert r["errors"] == 0, r["errors_by_kind"]
    assert r["requests"] > 0 and r["connections_opened"] == 4  # keep-alive: one connection per client, reused
    # Every request the clients saw is matched to the server's record of the engine's own latency for it.
    assert r["matched_requests"] == r["requests"] and r["sequential_matched_requests"] > 0
    assert 0 < r["engine_latency_p50_ms"] <= r["latency_p50_ms"]
    assert r["ttft_p50_ms"] > 0 and r["isolated_engine_latency_p50_ms"] > 0

"""``tierline bench spec``: plain, draft and n-gram side by side at each concurrency, and the bench's own assertion
that speculation did not lose at batch 1 (speed itself is what it measures, on the demo zoo; here the test zoo)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from bench import engine_bench
from bench.cli import bench as bench_command
from bench.engine_bench import bench_spec


def test_the_sweep_reports_every_method_at_every_concurrency(tiny_zoo: Path) -> None:
    r = bench_spec(tiny_zoo, num_prompts=2, num_tokens=12, concurrency=(1, 4), rounds=2)
    for c in (1, 4):
        row = r[f"at_{c}_concurrent"]
        assert row["plain"] > 0 and row["draft"] > 0 and row["ngram"] > 0, row
        assert row["draft_x"] > 0 and row["ngram_x"] > 0 and row["outputs_identical"] is True
    assert r["outputs_identical"] is True and r["rounds"] == 2
    assert r["plain_tokens_per_s"] == r["at_1_concurrent"]["plain"] and r["speedup"] == r["at_1_concurrent"]["draft_x"]
    assert r["never_slower_at_batch_1"] == (min(r["speedup"], r["ngram_speedup"]) >= 0.98)
    assert r["target_verify_5_tokens_ms"] > 0 and r["verify_cost_ratio"] > 0


@pytest.mark.parametrize(("draft_x", "exit_code"), [(0.97, 1), (0.99, 0)])
def test_the_command_fails_when_speculation_lost_at_batch_1(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, draft_x: float, exit_code: int
) -> None:
    seen: dict[str, Any] = {}

    def fake(root: Path, num_prompts: int, num_tokens: int, **kwargs: Any) -> dict[str, Any]:
        seen.update(kwargs)
        row = {"plain": 100.0, "draft": 100.0 * draft_x, "ngram": 101.0, "draft_x": draft_x, "ngram_x": 1.01}
        return {"at_1_concurrent": row, "never_slower_at_batch_1": draft_x >= 0.98}

    monkeypatch.setattr(engine_bench, "bench_spec", fake)
    monkeypatch.setattr("bench.cli.zoo_root", lambda preset, zoo_dir: tmp_path)
    args = ["spec", "--json", "--concurrency", "4", "--concurrency", "1", "--rounds", "2"]
    result = CliRunner().invoke(bench_command, args)
    assert result.exit_code == exit_code, result.output
    assert json.loads(result.stdout[: result.stdout.rindex("}") + 1])["at_1_concurrent"]["draft_x"] == draft_x
    assert seen == {"concurrency": (1, 4), "rounds": 2}
    if exit_code:
        assert "below 0.98x plain decoding: draft 0.97x" in result.output
    assert CliRunner().invoke(bench_command, [*args, "--no-check"]).exit_code == 0

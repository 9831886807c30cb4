"""``tierline bench spec``: plain, draft and n-gram side by side at each concurrency, and the bench's own assertion
that speculation did not lose at any concurrency (speed itself is what it measures, on the demo zoo; here the test
zoo)."""

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
        assert row["plain_again"] > 0 and row["plain_again_x_range"][0] <= row["plain_again_x"]  # the A/A control
        for method in ("draft", "ngram"):
            low, high = row[f"{method}_x_range"]
            assert low <= row[f"{method}_x"] <= high
            done = row[f"{method}_last_round"]  # what it did once the controller had the earlier rounds
            assert 0 <= done["spec_steps"] <= done["steps"] and done["catch_up_tokens"] >= 0
        assert row["ngram_last_round"]["catch_up_tokens"] == 0  # (no draft to catch up)
    assert r["outputs_identical"] is True and r["rounds"] == 2
    assert r["plain_tokens_per_s"] == r["at_1_concurrent"]["plain"] and r["speedup"] == r["at_1_concurrent"]["draft_x"]
    assert r["never_slower_at_batch_1"] == (min(r["speedup"], r["ngram_speedup"]) >= 0.98)
    ratios = {(c, m): r[f"at_{c}_concurrent"][f"{m}_x"] for c in (1, 4) for m in ("draft", "ngram")}
    lost = {(s["concurrency"], s["method"]): s["x_plain"] for s in r["slower_than_plain"]}
    floor = {c: 0.98 * min(1.0, r[f"at_{c}_concurrent"]["plain_again_x"]) for c in (1, 4)}
    assert lost == {(c, m): x for (c, m), x in ratios.items() if x < floor[c]}
    assert r["never_slower"] == (not lost)
    assert r["target_verify_5_tokens_ms"] > 0 and r["verify_cost_ratio"] > 0


@pytest.mark.parametrize(
    ("draft_x", "ngram_x_at_4", "aa_x_at_4", "exit_code", "message"),
    [
        (0.97, 1.2, 1.0, 1, "below 0.98x plain decoding: draft 0.97x at 1"),
        (0.99, 0.95, 1.0, 1, "below 0.98x plain decoding: ngram 0.95x at 4"),
        (0.99, 0.95, 1.05, 1, "below 0.98x plain decoding: ngram 0.95x at 4"),  # an A/A above 1 raises nothing
        (0.99, 0.95, 0.96, 0, ""),  # two plain engines differed by as much: within the noise
        (0.99, 1.2, 1.0, 0, ""),
    ],
)
def test_the_command_fails_when_speculation_lost_at_any_concurrency(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    draft_x: float,
    ngram_x_at_4: float,
    aa_x_at_4: float,
    exit_code: int,
    message: str,
) -> None:
    seen: dict[str, Any] = {}

    def fake(root: Path, num_prompts: int, num_tokens: int, **kwargs: Any) -> dict[str, Any]:
        seen.update(kwargs)
        at_1 = {"plain": 100.0, "draft": 100.0 * draft_x, "ngram": 101.0, "draft_x": draft_x, "ngram_x": 1.01}
        at_4 = {"plain": 300.0, "draft": 330.0, "ngram": 300 * ngram_x_at_4, "draft_x": 1.1, "ngram_x": ngram_x_at_4}
        at_4["plain_again_x"] = aa_x_at_4
        return {"at_1_concurrent": at_1, "at_4_concurrent": at_4}

    monkeypatch.setattr(engine_bench, "bench_spec", fake)
    monkeypatch.setattr("bench.cli.zoo_root", lambda preset, zoo_dir: tmp_path)
    args = ["spec", "--json", "--concurrency", "4", "--concurrency", "1", "--rounds", "2"]
    result = CliRunner().invoke(bench_command, args)
    assert result.exit_code == exit_code, result.output
    assert json.loads(result.stdout[: result.stdout.rindex("}") + 1])["at_1_concurrent"]["draft_x"] == draft_x
    assert seen == {"concurrency": (1, 4), "rounds": 2}
    assert message in result.output
    assert CliRunner().invoke(bench_command, [*args, "--no-check"]).exit_code == 0

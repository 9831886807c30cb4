"""``tierline bench edge`` end to end on the test zoo: every figure the issue asks for is reported (speed is
not asserted: that is what the benchmark measures, on the demo zoo)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from bench.edge_bench import edge_command

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_edge_bench_reports_speed_agreement_sizes_and_agent_memory(tiny_zoo: Path, session_data_dir: Path) -> None:
    args = ["--preset", "tiny", "--zoo-dir", str(session_data_dir / "zoo"), "--json", "--tokens", "16"]
    result = CliRunner().invoke(
        edge_command, [*args, "--repeats", "1"], env={"TIERLINE_DATA_DIR": str(session_data_dir)}
    )
    assert result.exit_code == 0, result.output
    r = json.loads(result.stdout)
    for key in (
        "int8_tokens_per_s",
        "fp32_tokens_per_s",
        "torch_tokens_per_s",
        "tflite_tokens_per_s",
        "int8_size_bytes",
        "fp32_size_bytes",
        "fp32_vs_torch",
        "int8_vs_fp32",
        "agent_idle_rss_mb",
    ):
        assert r[key] > 0, key
    assert 0 <= r["agreement_int8_vs_fp32"] <= 1 and r["agreement_positions"] == 8 * 64
    assert r["int8_size_bytes"] < r["fp32_size_bytes"]
    assert r["agent_models"] >= 3  # the agent verified and served the zoo it was measured on
    assert r["threads"] == 1 and r["host"]["logical_cpus"] >= 1
    # The fp32 export is the same model as the transformers weights: greedy decoding agrees at the start.
    assert r["fp32_tokens_before_divergence_from_torch"] >= 1
    # What the agent serves tierline/lm-edge with (its runtime guard's choice), measured in the same rounds.
    serving = r["agent_serving"]
    assert serving["chosen"] == serving["runtime_guard"]["chosen"] and serving["tokens_per_s"] > 0
    assert isinstance(serving["outputs_identical_to_fp32"], bool)


def test_edge_bench_refuses_more_tokens_than_the_context_holds(tiny_zoo: Path, session_data_dir: Path) -> None:
    args = ["--preset", "tiny", "--zoo-dir", str(session_data_dir / "zoo"), "--tokens", "100000"]
    result = CliRunner().invoke(edge_command, args, env={"TIERLINE_DATA_DIR": str(session_data_dir)})
    assert result.exit_code != 0
    assert "must fit the edge LM's context of 256" in str(result.exception)

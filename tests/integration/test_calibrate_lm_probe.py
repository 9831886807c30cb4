"""``tierline edge calibrate --model-dir``: the LM hidden-state probe fitted on a device from validation rows that
carry the edge's mean logits, through the LM's unembedding (``pinv(E)`` of the tied embedding), exactly as
``bench cascade`` fits it. Real items: the tiny zoo's INT8 edge LM on the device runtime and the cloud LM on the
project's engine, on held-out code."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from edge_agent.calibrate import calibrate_command
from shared.calibration import (
    calibrate,
    fit_validation_probe,
    read_validation,
    tied_embedding_projection,
    validation_row,
)
from shared.errors import ConfigurationError
from shared.escalation import HIDDEN_PROBE, load_policy

pytestmark = pytest.mark.integration
NUM_ITEMS = 24
MODEL = "tierline/lm-edge"


@pytest.fixture(scope="module")
def lm_rows(tiny_zoo: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Validation rows of the edge LM with its mean logits as the probe input (what the agent's LM path builds)."""
    from tokenizers import Tokenizer

    from bench.cascade_tasks import NEXT_TOKENS, _cloud_next_tokens, _EdgeRun, _greedy, _match_share, token_items
    from edge_agent.runtime.lm import load_causal_lm
    from shared.zoo.corpus import held_out_files
    from shared.zoo.registry import ZooLayout

    layout = ZooLayout(tiny_zoo)
    edge_dir = layout.artifact_dir("lm-edge-onnx-int8")
    runtime = load_causal_lm(edge_dir, num_threads=1)
    tokenizer = Tokenizer.from_file(str(edge_dir / "tokenizer.json"))
    items = token_items(tokenizer, [f.text for f in held_out_files()], NUM_ITEMS, 7, runtime.max_context - NEXT_TOKENS)
    run = _EdgeRun(with_copy=True)
    for item in items:
        _greedy(runtime, item.prompt, NEXT_TOKENS, run)
    cloud = _cloud_next_tokens(layout.artifact_dir("lm-cloud"), items)
    agree = np.array([_match_share(e, c) for e, c in zip(run.outputs, cloud, strict=True)])
    # The router's target as a yes/no: the edge's 8 tokens agree with the cloud's at least as often as on the
    # median item (the tiny LMs agree on few tokens, so a fixed cut would leave one class); when more than half
    # the items tie at the median, above it (either way both classes have items).
    median = np.median(agree)
    agrees = agree >= median if (agree >= median).sum() < NUM_ITEMS else agree > median
    assert 0 < agrees.sum() < NUM_ITEMS
    rows = [
        validation_row(
            MODEL,
            signals,
            len(item.prompt),
            edge_good=_match_share(out, item.reference) >= 0.5,
            cloud_good=_match_share(c, item.reference) >= 0.5,
            agrees_with_cloud=bool(a),
            probe=("mean_logits", logits),
        )
        for item, signals, out, c, a, logits in zip(
            items, run.signals, run.outputs, cloud, agrees, run.mean_logits, strict=True
        )
    ]
    path = tmp_path_factory.mktemp("lm-probe") / "val.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"path": path, "mean_logits": np.stack(run.mean_logits), "agrees": agrees, "layout": layout}


def test_the_probe_is_fitted_on_the_hidden_state_as_the_bench_fits_it(lm_rows: dict[str, Any]) -> None:
    from bench.cascade_bench import fit_probe
    from bench.cascade_tasks import TaskResults
    from bench.cascade_tasks import tied_embedding_projection as bench_projection

    layout = lm_rows["layout"]
    projection = tied_embedding_projection(layout.artifact_dir("lm-edge"))
    np.testing.assert_allclose(projection, bench_projection(layout), rtol=0, atol=1e-12)
    data = read_validation(lm_rows["path"], "lm-edge")
    probe = fit_validation_probe(data, projection=projection)
    assert probe is not None and probe.input == "mean_logits"
    # Fitted on the 64-wide hidden state, shipped folded onto the 1,024 logits the runtime produces.
    assert probe.hidden_size == 64 and len(probe.weights) == 1024

    x = lm_rows["mean_logits"]
    n = len(x)
    results = TaskResults(
        task="lm-next8",
        edge_model=MODEL,
        cloud_model="tierline/lm-cloud",
        signals={},
        prompt_tokens=None,
        edge_good=data.edge_good,
        cloud_good=data.cloud_good,
        agrees=lm_rows["agrees"].astype(np.float64),
        signal_s=np.zeros(n),
        probe_input="mean_logits",
        probe_inputs=x,
        probe_projection=projection,
    )
    bench = fit_probe(results, np.arange(n))
    assert bench is not None
    np.testing.assert_allclose(probe.confidences(x), bench.confidences(x), rtol=1e-9, atol=1e-12)

    raw = fit_validation_probe(data)  # without the model: a probe on the raw logits, a different fit
    assert raw is not None and raw.hidden_size == 1024
    assert not np.allclose(raw.confidences(x), probe.confidences(x), atol=1e-3)


def test_calibrate_with_model_dir_ranks_the_projected_probe(lm_rows: dict[str, Any], tmp_path: Path) -> None:
    layout = lm_rows["layout"]
    model_dir = layout.artifact_dir("lm-edge")
    args = ["--model", "lm-edge", "--data", str(lm_rows["path"]), "--out-dir", str(tmp_path)]
    result = CliRunner().invoke(calibrate_command, [*args, "--model-dir", str(model_dir)])
    assert result.exit_code == 0, result.output
    policy = load_policy(tmp_path, MODEL)
    assert policy is not None
    _, expected = calibrate(read_validation(lm_rows["path"], "lm-edge"), 0.01, tied_embedding_projection(model_dir))
    by_signal = {c.signal: c for c in expected}
    got = policy.calibration["signals"][HIDDEN_PROBE]
    assert got["auc_gain"] == pytest.approx(by_signal[HIDDEN_PROBE].auc_gain)
    assert got["edge_share"] == pytest.approx(by_signal[HIDDEN_PROBE].edge_share)
    if policy.signal == HIDDEN_PROBE:
        assert policy.probe is not None and policy.probe.hidden_size == 64


def test_calibrate_names_a_model_dir_without_a_checkpoint(lm_rows: dict[str, Any], tmp_path: Path) -> None:
    onnx_dir = lm_rows["layout"].artifact_dir("lm-edge-onnx-int8")  # an export: no safetensors checkpoint
    args = ["--model", "lm-edge", "--data", str(lm_rows["path"]), "--out-dir", str(tmp_path / "policies")]
    result = CliRunner().invoke(calibrate_command, [*args, "--model-dir", str(onnx_dir)])
    assert result.exit_code == 1
    assert "--model-dir" in result.output and "no *.safetensors in" in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "policies").exists()


def test_a_projection_of_another_vocabulary_is_refused(lm_rows: dict[str, Any]) -> None:
    data = read_validation(lm_rows["path"], "lm-edge")
    with pytest.raises(ConfigurationError, match="1024 values but the model's embedding takes 4096"):
        fit_validation_probe(data, projection=np.zeros((64, 4096)))

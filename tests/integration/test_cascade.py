"""The cascade benchmark on the test zoo reports every number in range; its validation export calibrates into a
policy the agent loads, and that policy keeps quality within the bound on the data it was calibrated on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from bench.cascade_bench import MIN_GAIN_PROBE_ITEMS, ROUTER_GAIN, ROUTER_GAIN_PROBE, cascade_command
from bench.prompt_router import PROMPT_EMBEDDING
from edge_agent.calibrate import calibrate_command
from shared.escalation import (
    CLASSIFIER_SIGNALS,
    COPY_SIGNALS,
    HIDDEN_PROBE,
    LM_SIGNALS,
    ROUTER,
    EdgePolicy,
    load_policy,
    save_policy,
)
from shared.routing_eval import RANDOM_SAMPLE

pytestmark = pytest.mark.integration

NUM_LINES = 40
NUM_NEXT = 30
TASK_KEYS = {
    "edge_only_quality",
    "cloud_only_quality",
    "oracle_quality",
    "oracle_edge_share",
    "policy_points",
    "random_points",
    "edge_share_at_cloud_parity_minus_1pt",
    "auc_gain_vs_random",
    "decision_p95_ms",
    "router_decision_p95_ms",
    "signals",
    "winner",
    "n_validation",
    "n_test",
}


@pytest.fixture(scope="module")
def cascade(tiny_zoo: Path, session_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One run of ``tierline bench cascade`` on the tiny preset, with the validation export (and the plot)."""
    out = tmp_path_factory.mktemp("cascade")
    args = ["--preset", "tiny", "--json", "--lines", str(NUM_LINES), "--next-items", str(NUM_NEXT)]
    args += ["--export-validation", str(out / "val.jsonl")]
    args += ["--plot", str(out / "cascade.png")]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIERLINE_DATA_DIR", str(session_data_dir))  # the default --zoo-dir finds the built tiny zoo
        result = CliRunner().invoke(cascade_command, args)
    assert result.exit_code == 0, result.output
    return {"report": json.loads(result.stdout), "dir": out}


def _rows(path: Path, model: str) -> list[dict[str, Any]]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["model"] == model]


def _policy_inputs(policy: EdgePolicy, row: dict[str, Any]) -> dict[str, float]:
    """What the agent hands the policy for this item: its signals, the prompt's length and the probe's output."""
    probe = np.array(row["probe"]["values"]) if "probe" in row else None
    return {**row["signals"], "prompt_tokens": row["prompt_tokens"] or 0} | policy.probe_signal(probe)


def _calibrate(*args: str) -> Any:
    return CliRunner().invoke(calibrate_command, list(args))


def test_cascade_reports_every_number_in_range(cascade: dict[str, Any]) -> None:
    report = cascade["report"]
    expected_signals = {
        "digits": {*CLASSIFIER_SIGNALS, ROUTER, ROUTER_GAIN, HIDDEN_PROBE},
        "digits-micro": {*CLASSIFIER_SIGNALS, ROUTER, ROUTER_GAIN, HIDDEN_PROBE},
        # The prompt-side copy signals on both LM tasks: the agent computes them, calibration reads them.
        "lm": {*LM_SIGNALS, *COPY_SIGNALS, ROUTER, ROUTER_GAIN, HIDDEN_PROBE},
        "lm-next8": {*LM_SIGNALS, *COPY_SIGNALS, ROUTER, ROUTER_GAIN, HIDDEN_PROBE},
        "lm-micro-next8": {*LM_SIGNALS, *COPY_SIGNALS, ROUTER, ROUTER_GAIN, HIDDEN_PROBE},
    }
    assert set(report) == {*expected_signals, "seconds"}
    totals = {"digits": 540, "digits-micro": 540, "lm": NUM_LINES, "lm-next8": NUM_NEXT, "lm-micro-next8": NUM_NEXT}
    for task, total in totals.items():
        r = report[task]
        # The gain router stacked on the gain probe, where validation has the items to cross-fit the probe.
        if r["n_validation"] >= MIN_GAIN_PROBE_ITEMS:
            expected_signals[task].add(ROUTER_GAIN_PROBE)
        assert set(r) >= TASK_KEYS, TASK_KEYS - set(r)
        assert r["n_validation"] + r["n_test"] == total and r["n_validation"] > 0 and r["n_test"] > 0
        for key in ("edge_only_quality", "cloud_only_quality", "oracle_quality", "oracle_edge_share"):
            assert 0.0 <= r[key] <= 1.0, key
        assert r["oracle_quality"] >= max(r["edge_only_quality"], r["cloud_only_quality"])
        assert set(r["signals"]) == expected_signals[task] and r["winner"] in r["signals"]
        for name, s in r["signals"].items():
            assert 0.0 <= s["edge_share_at_cloud_parity_minus_1pt"] <= 1.0, name
            assert -1.0 <= s["auc_gain_vs_random"] <= 1.0, name
        assert (
            r["edge_share_at_cloud_parity_minus_1pt"]
            == r["signals"][r["winner"]]["edge_share_at_cloud_parity_minus_1pt"]
        )
        assert r["decision_p95_ms"] > 0 and r["router_decision_p95_ms"] > 0
        # Every signal a policy can ship has its decision overhead measured.
        assert set(r["decision_p95_ms_by_signal"]) == expected_signals[task]
        assert all(v > 0 for v in r["decision_p95_ms_by_signal"].values())
        gap = r["quality_gap"]
        assert gap["n"] == total and gap["gap_ci95"][0] <= gap["gap"] <= gap["gap_ci95"][1]

        shares = [p["edge_share"] for p in r["policy_points"]]
        assert shares == sorted(shares), "a lower threshold never answers fewer requests at the edge"
        assert shares[0] <= 0.1 and shares[-1] >= 0.9, "the sweep spans all-cloud to all-edge"
        assert all(0.0 <= p["quality"] <= 1.0 for p in r["policy_points"])
        for point, rand in zip(r["policy_points"], r["random_points"], strict=True):
            assert rand["edge_share"] == point["edge_share"]
            linear = point["edge_share"] * r["edge_only_quality"] + (1 - point["edge_share"]) * r["cloud_only_quality"]
            assert rand["quality"] == pytest.approx(linear, abs=1e-3)
    assert 0.0 <= report["lm"]["agreement_with_cloud"] <= 1.0
    # The small classifier answers most digits locally within a point of the large one's accuracy.
    assert report["digits"]["edge_share_at_cloud_parity_minus_1pt"] >= 0.7
    assert report["digits"]["parity_holds_on_test"] is True


def test_lm_next8_grades_each_request_and_evaluates_the_prompt_router(cascade: dict[str, Any]) -> None:
    """The graded LM task: per-request agreement with the file's next 8 tokens, both tiers in [0, 1]; the
    MiniLM prompt router is evaluated with RouteLLM's numbers on the text tasks only; the probe ships its input."""
    report = cascade["report"]
    r = report["lm-next8"]
    assert r["next_tokens"] == 8 and "next 8 tokens" in r["quality_measure"]
    assert 0 < r["median_prompt_tokens"] <= r["max_prompt_tokens"]
    by_length = r["gap_by_prompt_length"]
    assert by_length["short"]["n"] + by_length["long"]["n"] == NUM_NEXT
    window = r["within_training_window"]  # the same items, both prompts cut to the tiny LMs' 128-token training
    assert window["n"] == NUM_NEXT and window["max_prompt_tokens"] == 120
    assert 0.0 <= window["edge_quality"] <= 1.0 and 0.0 <= window["cloud_quality"] <= 1.0
    lo, hi = window["quality_gap"]["gap_ci95"]
    assert lo <= window["cloud_quality"] - window["edge_quality"] <= hi
    for task in ("lm", "lm-next8", "lm-micro-next8"):
        info = report[task]["prompt_router"]
        assert info["features"] == 384 and "MiniLM" in info["embedding_model"] and info["decision_p95_ms"] > 0
        assert PROMPT_EMBEDDING in report[task]["routing"]["routers"]
        assert PROMPT_EMBEDDING not in report[task]["signals"], "a pre-generation router is not an edge signal"
    for task in ("digits", "digits-micro"):
        assert "prompt_router" not in report[task]
        assert PROMPT_EMBEDDING not in report[task]["routing"]["routers"]
    assert report["digits-micro"]["probe"] == {"input": "pixels", "hidden_size": 64}
    assert r["probe"]["input"] == "mean_logits" and r["probe"]["hidden_size"] == 64  # the tiny edge LM's width
    assert not [
        row
        for row in map(json.loads, (cascade["dir"] / "val.jsonl").read_text().splitlines())
        if row["task"] in ("lm-next8", "lm-micro-next8")
    ]


def test_lm_micro_next8_runs_the_micro_lm_in_window_on_the_same_items(cascade: dict[str, Any]) -> None:
    """The LM pair with a real gap: lm-micro at the edge, graded like lm-next8 on the same items, every prompt
    inside the 128-token window the tiny LMs were trained on (cut to 120 so the 8 generated tokens fit)."""
    report = cascade["report"]
    r, full = report["lm-micro-next8"], report["lm-next8"]
    assert (r["edge_model"], r["cloud_model"]) == ("tierline/lm-micro", "tierline/lm-cloud")
    assert r["next_tokens"] == 8 and r["quality_measure"] == full["quality_measure"]
    assert r["training_window"] == 128 and r["max_prompt_tokens"] == 120
    assert 0 < r["median_prompt_tokens"] <= 120 < full["max_prompt_tokens"]
    # The same positions as lm-next8, with the prompts lm-next8 cuts to the window: the cloud gives the same
    # answers to them.
    window = full["within_training_window"]
    assert r["all_items"]["n"] == r["quality_gap"]["n"] == window["n"] == NUM_NEXT
    assert window["max_prompt_tokens"] == r["max_prompt_tokens"]
    assert r["all_items"]["cloud_quality"] == window["cloud_quality"]
    assert r["quality_gap"]["gap"] == pytest.approx(
        r["all_items"]["cloud_quality"] - r["all_items"]["edge_quality"], abs=1e-3
    )
    assert r["probe"] == {"input": "mean_logits", "hidden_size": 32}  # the tiny micro LM's width, not the edge's
    assert r["routing"]["routers"][HIDDEN_PROBE]["apgr"] is not None or r["routing"]["gap"] is None


@pytest.mark.parametrize(
    ("model", "model_id"), [("digits-small", "tierline/digits-small"), ("tierline/lm-edge", "tierline/lm-edge")]
)
def test_validation_export_calibrates_a_policy_within_the_bound(
    cascade: dict[str, Any], tmp_path: Path, model: str, model_id: str
) -> None:
    data = cascade["dir"] / "val.jsonl"
    rows = _rows(data, model_id)
    task = "digits" if "digits" in model_id else "lm"
    assert len(rows) == cascade["report"][task]["n_validation"]

    result = _calibrate("--model", model, "--max-quality-loss", "0.01", "--data", str(data), "--out-dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert len(result.output.strip().splitlines()) == 1 and model_id in result.output

    policy = load_policy(tmp_path, model_id)
    assert policy is not None and policy.model == model_id
    edge_good = np.array([r["edge_good"] for r in rows])
    cloud_good = np.array([r["cloud_good"] for r in rows])
    local = np.array([not policy.should_escalate(_policy_inputs(policy, r)) for r in rows])
    quality = np.where(local, edge_good, cloud_good).mean()
    assert quality >= cloud_good.mean() - 0.01 - 1e-9
    cal = policy.calibration
    assert cal["max_quality_loss"] == 0.01 and cal["num_items"] == len(rows) and cal["calibrated_at"]
    assert cal["edge_share"] == pytest.approx(local.mean())
    assert policy.signal in cal["signals"] and len(cal["curve"]) >= 2
    if task == "digits":
        assert local.mean() >= 0.7


def test_calibrate_keeps_operator_settings_and_defaults_to_the_agent_policy_dir(
    cascade: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIERLINE_EDGE_POLICY_DIR", str(tmp_path))
    save_policy(tmp_path, EdgePolicy("tierline/digits-small", mode="cloud-first", max_new_tokens=64))
    result = _calibrate("--model", "digits-small", "--data", str(cascade["dir"] / "val.jsonl"))
    assert result.exit_code == 0, result.output
    policy = load_policy(tmp_path, "tierline/digits-small")
    assert policy is not None and policy.calibration
    assert (policy.mode, policy.max_new_tokens) == ("cloud-first", 64)


_ROW = {
    "model": "tierline/lm-edge",
    "signals": {"mean_logprob": -1.0},
    "prompt_tokens": 12,
    "edge_good": True,
    "cloud_good": True,
    "agrees_with_cloud": True,
}


def _line(**changes: Any) -> str:
    return json.dumps({**_ROW, **changes}) + "\n"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json\n", "not JSON"),
        (_line(edge_good=1), "'edge_good'"),
        (_line(signals={"mean_logprob": "x"}), "'signals'"),
        (_line(prompt_tokens=-3), "'prompt_tokens'"),
        (_line(model="tierline/other"), "no items for model 'lm-edge' (models in the file: tierline/other)"),
        (_line() * 3, "only 3 items"),
        (_line(signals={"perplexity": 2.0}) * 12, "no item of tierline/lm-edge has a known signal"),
        ("", "no items for model"),
    ],
)
def test_calibrate_rejects_bad_data_in_one_line(tmp_path: Path, content: str, message: str) -> None:
    data = tmp_path / "val.jsonl"
    data.write_text(content)
    result = _calibrate("--model", "lm-edge", "--data", str(data), "--out-dir", str(tmp_path / "policies"))
    assert result.exit_code == 1
    assert message in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "policies").exists()


def test_calibrate_escalates_everything_when_no_threshold_keeps_quality(tmp_path: Path) -> None:
    data = tmp_path / "val.jsonl"
    rows = [_line(signals={"mean_logprob": -0.1 * i}, edge_good=False, agrees_with_cloud=False) for i in range(12)]
    data.write_text("".join(rows))
    result = _calibrate(
        "--model", "lm-edge", "--max-quality-loss", "0", "--data", str(data), "--out-dir", str(tmp_path)
    )
    assert result.exit_code == 0, result.output
    assert "every request escalates" in result.output
    policy = load_policy(tmp_path, "tierline/lm-edge")
    assert policy is not None and np.isfinite(policy.threshold)
    assert all(policy.should_escalate({"mean_logprob": -0.1 * i, "prompt_tokens": 12}) for i in range(12))


def test_plot_writes_a_png(cascade: dict[str, Any]) -> None:
    png = cascade["dir"] / "cascade.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000


def test_cascade_reports_routellm_metrics_for_every_signal(cascade: dict[str, Any]) -> None:
    report = cascade["report"]
    for task in ("digits", "digits-micro", "lm", "lm-next8", "lm-micro-next8"):
        routing = report[task]["routing"]
        text = {PROMPT_EMBEDDING} if task.startswith("lm") else set()
        assert set(routing["routers"]) == {*report[task]["signals"], RANDOM_SAMPLE, *text}, task
        assert routing["resamples"] == 1000
        assert routing["random_expected"]["apgr"] in (0.5, None)
        for name, r in routing["routers"].items():  # APGR over random routing's 0.5, with its paired interval
            if r["apgr"] is not None:
                lo, hi = r["apgr_gain_vs_random_ci95"]
                assert r["apgr_gain_vs_random"] == pytest.approx(r["apgr"] - 0.5, abs=1e-3), name
                assert lo <= r["apgr_gain_vs_random"] <= hi, name
    # The pair with a real gap: on the test half its 95 % interval excludes zero.
    routing = report["digits-micro"]["routing"]
    lo, hi = routing["gap_ci95"]
    assert 0 < lo <= routing["gap"] <= hi and routing["gap"] >= 0.05
    oracle = routing["oracle"]
    for name, r in routing["routers"].items():
        assert 0.0 <= r["apgr"] <= oracle["apgr"] + 1e-9, name  # nothing beats the oracle's curve
        assert r["apgr_ci95"][0] <= r["apgr"] <= r["apgr_ci95"][1], name
        assert len(r["pgr_at_call_share"]) == 21 and r["pgr_at_call_share"][0] == 0.0
        for key in ("cpt_50", "cpt_80", "cpt_95", "share_at_95pct_quality"):
            entry = r[key]
            assert 0.0 <= entry["test_curve"] <= 1.0 and 0.0 <= entry["call_share"] <= 1.0, (name, key)
            assert entry["call_share_ci95"][0] <= entry["call_share"] <= entry["call_share_ci95"][1]
        assert r["cpt_50"]["test_curve"] <= r["cpt_80"]["test_curve"] <= r["cpt_95"]["test_curve"], name
    assert oracle["cpt_80"]["test_curve"] <= min(r["cpt_80"]["test_curve"] for r in routing["routers"].values())
    # The edge's own confidence is worth far more than a coin: every signal beats random routing's 0.5 by its
    # whole interval, and needs fewer cloud calls for 80 % of the gap than the random router does.
    for name in (*CLASSIFIER_SIGNALS, ROUTER):
        r = routing["routers"][name]
        assert r["apgr_ci95"][0] > 0.5, name
        assert r["cpt_80"]["test_curve"] < routing["routers"][RANDOM_SAMPLE]["cpt_80"]["test_curve"], name


def test_zoo_holds_a_microcontroller_class_digits_model_with_a_real_gap(tiny_zoo: Path) -> None:
    digits = json.loads((tiny_zoo / "zoo.json").read_text())["digits"]
    assert digits["large_accuracy"] - digits["micro_accuracy"] >= 0.08
    manifest = json.loads((tiny_zoo / "manifests" / "digits-micro.json").read_text())
    assert "digits-micro" in json.dumps(manifest) and "onnx-int8" in json.dumps(manifest)
    model = tiny_zoo / "artifacts" / "digits-micro" / "model.onnx"
    assert model.stat().st_size < 8 * 1024, "a few KB: fits a microcontroller's flash"
    import onnx

    graph = onnx.load(str(model)).graph
    assert graph.input[0].name == "pixels" and graph.output[0].name == "logits"
    assert {init.data_type for init in graph.initializer if init.name.endswith("_quantized")} == {onnx.TensorProto.INT8}


def test_tasks_runs_only_the_named_tasks_and_names_an_unknown_one(
    tiny_zoo: Path, session_data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--tasks`` (what ``tierline up`` runs for its calibration data): only those tasks are run and exported."""
    monkeypatch.setenv("TIERLINE_DATA_DIR", str(session_data_dir))
    export = tmp_path / "val.jsonl"
    args = ["--preset", "tiny", "--json", "--lines", "8", "--tasks", "digits", "--export-validation", str(export)]
    result = CliRunner().invoke(cascade_command, args)
    assert result.exit_code == 0, result.output
    assert set(json.loads(result.stdout)) == {"digits", "seconds"}
    assert {row["model"] for row in map(json.loads, export.read_text().splitlines())} == {"tierline/digits-small"}

    result = CliRunner().invoke(cascade_command, ["--preset", "tiny", "--tasks", "digits,lm-nope"])
    assert result.exit_code == 2 and "lm-nope" in result.output and "lm-micro-next8" in result.output

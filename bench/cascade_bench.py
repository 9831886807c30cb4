"""``tierline bench cascade``: how much traffic the edge answers at (almost) cloud quality, per escalation signal.

For each task (``bench/cascade_tasks.py``) the held-out items are split at random into a validation half and a
test half. Everything that is chosen (each signal's thresholds, the learned router's weights, the winning signal)
is chosen on the validation half; every number reported is measured on the test half.

Per task:

- ``edge_only_quality`` / ``cloud_only_quality``: every item answered by one tier.
- ``oracle_quality`` / ``oracle_edge_share``: an oracle that escalates exactly the items the cloud gets right and
  the edge gets wrong (the largest edge share at the best possible quality).
- ``policy_points``: the winner's thresholds for validation edge shares 0, 5, ..., 100 %, each applied to the test
  half; ``random_points``: random routing at the same test edge shares (expected value).
- ``edge_share_at_cloud_parity_minus_1pt``: the threshold that keeps quality within 1 point of cloud-only on
  validation (``threshold_for_quality``), applied to the test half; ``quality_at_parity_threshold`` and
  ``parity_holds_on_test`` say whether the bound held there. ``edge_share_at_cloud_parity``: the same with no
  quality loss allowed.
- ``agreement_with_cloud``: how often the edge's answer is the cloud's.
- ``auc_gain_vs_random``: area under the test quality-vs-edge-share curve minus random routing's, over [0, 1].
- ``signals``: the same numbers per signal (router included), plus ``auroc_edge_good`` (how well the signal
  alone ranks right edge answers above wrong ones). ``router`` is the learned router over the signals (and the
  prompt length for the LM), fitted on validation to predict that the edge's answer is the cloud's.
  ``winner``: the best on validation (``rank_signals``).
- ``decision_p95_ms``: per test request, computing the signals and comparing the best simple signal with its
  threshold; ``router_decision_p95_ms``: the same with the learned router (signals, features, logistic).
- ``routing``: RouteLLM's evaluation (``shared.routing_eval.evaluate_routers``) of every signal, the router, a
  seeded random router (``random_sample``), random routing's expectation and the oracle: APGR, CPT(50/80/95 %)
  and the cloud-call share at 95 % of cloud quality, each for the test curve (``test_curve``) and for the
  threshold chosen on validation measured on test (``call_share``, ``pgr``), with 95 % bootstrap intervals
  over ``--resamples`` resamples of the test items.

Tasks: ``digits`` (digits-small, the near-equal pair), ``digits-micro`` (the INT8 micro model, a real gap) and
``lm``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import numpy as np

from bench.cascade_tasks import TaskResults, run_digits, run_lm
from bench.common import emit, zoo_root
from shared.calibration import PROMPT_TOKENS, validation_row
from shared.escalation import (
    ROUTER,
    EdgePolicy,
    LearnedRouter,
    SignalChoice,
    auc_gain_vs_random,
    fit_router,
    quality_curve,
    rank_signals,
    routed_quality,
    threshold_for_quality,
)
from shared.routing_eval import (
    DEFAULT_RESAMPLES,
    ORACLE,
    RANDOM_SAMPLE,
    Half,
    evaluate_routers,
    oracle_confidence,
    pgr_curves,
    random_scores,
)
from shared.zoo.registry import ZooLayout

MAX_QUALITY_LOSS = 0.01
SHARE_GRID = np.linspace(0.0, 1.0, 21)
DEFAULT_LINES = 300


@dataclass(slots=True)
class _Half:
    """One half of a task's items, with every signal's confidence (the router's included)."""

    rows: np.ndarray
    confidences: dict[str, np.ndarray]
    edge_good: np.ndarray
    cloud_good: np.ndarray


def _features(results: TaskResults, rows: np.ndarray) -> dict[str, np.ndarray]:
    table = {k: v[rows] for k, v in results.signals.items()}
    if results.prompt_tokens is not None:
        table[PROMPT_TOKENS] = results.prompt_tokens[rows]
    return table


def _half(results: TaskResults, rows: np.ndarray, router: LearnedRouter) -> _Half:
    confidences = {k: v[rows] for k, v in results.signals.items()}
    confidences[ROUTER] = router.confidences(_features(results, rows))
    return _Half(rows, confidences, results.edge_good[rows], results.cloud_good[rows])


def _threshold_for_share(confidence: np.ndarray, share: float) -> float:
    """The threshold that answers ``share`` of these items locally (ties may take a few more)."""
    ranked = np.sort(confidence)[::-1]
    k = round(share * len(ranked))
    return float(np.nextafter(ranked[0], np.inf)) if k == 0 else float(ranked[k - 1])


def _auroc(score: np.ndarray, positive: np.ndarray) -> float | None:
    """P(score of a positive > score of a negative), ties counted half; None without both classes."""
    pos, neg = score[positive], score[~positive]
    if len(pos) == 0 or len(neg) == 0:
        return None
    greater = (pos[:, None] > neg[None, :]).mean()
    ties = (pos[:, None] == neg[None, :]).mean()
    return round(float(greater + ties / 2), 4)


def _finite(value: float, digits: int = 6) -> float | None:
    """JSON has no infinity: an infinite threshold (nothing answered locally) is reported as null."""
    return round(value, digits) if np.isfinite(value) else None


def _p95_ms(seconds: np.ndarray) -> float:
    return round(float(np.percentile(seconds * 1000.0, 95)), 4)


def _decision_seconds(results: TaskResults, test: _Half, policy: EdgePolicy) -> np.ndarray:
    """Per test item: the edge's signal time plus building the policy's inputs and deciding."""
    names = list(results.signals)
    out = np.empty(len(test.rows))
    for j, i in enumerate(test.rows):
        started = time.perf_counter()
        values = {name: float(results.signals[name][i]) for name in names}
        if results.prompt_tokens is not None:
            values[PROMPT_TOKENS] = float(results.prompt_tokens[i])
        policy.should_escalate(values)
        out[j] = results.signal_s[i] + time.perf_counter() - started
    return out


@dataclass(slots=True)
class TaskEvaluation:
    """A task's report (test half), the winner's and the oracle's test curves, and the validation rows."""

    report: dict[str, Any]
    curve: tuple[np.ndarray, np.ndarray]
    oracle_curve: tuple[np.ndarray, np.ndarray]
    validation_rows: np.ndarray
    pgr_curves: dict[str, tuple[np.ndarray, np.ndarray]]  # router -> (cloud-call share, PGR) on the test half


def _signal_reports(ranking: list[SignalChoice], test: _Half) -> dict[str, dict[str, Any]]:
    """Each signal's validation-chosen parity threshold applied to the test half, and its test curve's gain."""
    cloud_q = float(test.cloud_good.mean())
    out: dict[str, dict[str, Any]] = {}
    for choice in ranking:
        conf = test.confidences[choice.signal]
        share, quality = routed_quality(conf, test.edge_good, test.cloud_good, choice.threshold)
        out[choice.signal] = {
            "edge_share_at_cloud_parity_minus_1pt": round(share, 4),
            "quality_at_parity_threshold": round(quality, 4),
            "parity_holds_on_test": quality >= cloud_q - MAX_QUALITY_LOSS - 1e-12,
            "auc_gain_vs_random": round(auc_gain_vs_random(conf, test.edge_good, test.cloud_good), 5),
            "auroc_edge_good": _auroc(conf, test.edge_good),
            "threshold": _finite(choice.threshold),
            "validation_edge_share": round(choice.edge_share, 4),
            "validation_auc_gain": round(choice.auc_gain, 5),
        }
    return out


def _zero_loss(signal: str, val: _Half, test: _Half) -> dict[str, float]:
    """The signal's threshold for no quality loss at all on validation, measured on test."""
    threshold, _ = threshold_for_quality(val.confidences[signal], val.edge_good, val.cloud_good, 0.0)
    share, quality = routed_quality(test.confidences[signal], test.edge_good, test.cloud_good, threshold)
    return {"edge_share_at_cloud_parity": round(share, 4), "quality_at_cloud_parity": round(quality, 4)}


def _sweep(signal: str, val: _Half, test: _Half) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """Policy points (thresholds for validation edge shares on ``SHARE_GRID``, measured on test) and random
    routing at the same test edge shares."""
    cloud_q, edge_q = float(test.cloud_good.mean()), float(test.edge_good.mean())
    points, random_points = [], []
    for target in SHARE_GRID:
        threshold = _threshold_for_share(val.confidences[signal], float(target))
        share, quality = routed_quality(test.confidences[signal], test.edge_good, test.cloud_good, threshold)
        points.append({"threshold": round(threshold, 6), "edge_share": round(share, 4), "quality": round(quality, 4)})
        random_points.append(
            {"edge_share": round(share, 4), "quality": round(share * edge_q + (1 - share) * cloud_q, 4)}
        )
    return points, random_points


def _routing(val: _Half, test: _Half, resamples: int, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """RouteLLM's evaluation of every signal and the router (``shared.routing_eval``), and the test curves to
    draw (the oracle's and the seeded random router's included)."""
    report = evaluate_routers(
        Half(val.confidences, val.edge_good, val.cloud_good),
        Half(test.confidences, test.edge_good, test.cloud_good),
        resamples=resamples,
        seed=seed,
    )
    curves: dict[str, Any] = {}
    if report["gap"] is not None and report["gap"] > 0:
        extra = {
            RANDOM_SAMPLE: random_scores(len(val.rows), len(test.rows), seed)[1],
            ORACLE: oracle_confidence(test.edge_good, test.cloud_good),
        }
        for name, conf in {**test.confidences, **extra}.items():
            c = pgr_curves(conf, test.edge_good, test.cloud_good)
            curves[name] = (c.call_share[0], c.pgr[0])
    return report, curves


def evaluate(results: TaskResults, seed: int, resamples: int = DEFAULT_RESAMPLES) -> TaskEvaluation:
    """Split the items, choose on the validation half, report on the test half."""
    n = len(results)
    order = np.random.default_rng(seed).permutation(n)
    val_rows, test_rows = np.sort(order[: n // 2]), np.sort(order[n // 2 :])
    features = _features(results, val_rows)
    router = fit_router(features, results.agrees[val_rows], list(features))
    val, test = _half(results, val_rows, router), _half(results, test_rows, router)
    ranking = rank_signals(val.confidences, val.edge_good, val.cloud_good, MAX_QUALITY_LOSS)
    by_signal = {c.signal: c for c in ranking}
    winner = ranking[0].signal
    signals = _signal_reports(ranking, test)
    points, random_points = _sweep(winner, val, test)
    simple = next(c for c in ranking if c.signal != ROUTER)
    decision = _decision_seconds(results, test, EdgePolicy(results.edge_model, simple.signal, simple.threshold))
    routed = _decision_seconds(
        results, test, EdgePolicy(results.edge_model, ROUTER, by_signal[ROUTER].threshold, router=router)
    )
    win = signals[winner]
    report: dict[str, Any] = {
        "edge_model": results.edge_model,
        "cloud_model": results.cloud_model,
        "n_validation": len(val_rows),
        "n_test": len(test_rows),
        "edge_only_quality": round(float(test.edge_good.mean()), 4),
        "cloud_only_quality": round(float(test.cloud_good.mean()), 4),
        "oracle_quality": round(float((test.edge_good | test.cloud_good).mean()), 4),
        "oracle_edge_share": round(float((test.edge_good >= test.cloud_good).mean()), 4),
        "agreement_with_cloud": round(float(results.agrees[test_rows].mean()), 4),
        **results.extra,
        "winner": winner,
        "edge_share_at_cloud_parity_minus_1pt": win["edge_share_at_cloud_parity_minus_1pt"],
        "quality_at_parity_threshold": win["quality_at_parity_threshold"],
        "parity_holds_on_test": win["parity_holds_on_test"],
        **_zero_loss(winner, val, test),
        "auc_gain_vs_random": win["auc_gain_vs_random"],
        "decision_signal": simple.signal,
        "decision_p95_ms": _p95_ms(decision),
        "router_decision_p95_ms": _p95_ms(routed),
        "signals": signals,
        "policy_points": points,
        "random_points": random_points,
    }
    report["routing"], routing_curves = _routing(val, test, resamples, seed)
    gain = test.edge_good.astype(np.float64) - test.cloud_good.astype(np.float64)
    return TaskEvaluation(
        report,
        quality_curve(test.confidences[winner], test.edge_good, test.cloud_good),
        quality_curve(gain, test.edge_good, test.cloud_good),  # the oracle ranks by what escalation gains
        val_rows,
        routing_curves,
    )


def export_validation(path: Path, tasks: list[tuple[TaskResults, np.ndarray]]) -> int:
    """Write the validation items of every task in ``tierline edge calibrate``'s ``--data`` format."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for results, rows in tasks:
        for i in rows:
            tokens = int(results.prompt_tokens[i]) if results.prompt_tokens is not None else None
            signals = {k: float(v[i]) for k, v in results.signals.items()}
            row = validation_row(
                results.edge_model,
                signals,
                tokens,
                edge_good=results.edge_good[i],
                cloud_good=results.cloud_good[i],
                agrees_with_cloud=results.agrees[i],
            )
            lines.append(json.dumps({**row, "task": results.task, "cloud_model": results.cloud_model}))
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise click.ClickException("--plot needs matplotlib (pip install matplotlib)") from exc


def plot_cascade(path: Path, evaluations: dict[str, TaskEvaluation]) -> None:
    """Quality vs edge share per task: the winner's curve, random routing, the oracle and cloud-only - 1 point."""
    _require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(evaluations), figsize=(6 * len(evaluations), 9), squeeze=False)
    for ax, (task, evaluation) in zip(axes[1], evaluations.items(), strict=True):
        _plot_pgr(ax, task, evaluation)
    for ax, (task, evaluation) in zip(axes[0], evaluations.items(), strict=True):
        report = evaluation.report
        shares, quality = evaluation.curve
        ax.plot(shares, quality, color="tab:blue", label=f"policy: {report['winner']} (test curve)")
        pts = report["policy_points"]
        ax.plot([p["edge_share"] for p in pts], [p["quality"] for p in pts], "o", ms=3, color="tab:blue")
        cloud_q, edge_q = report["cloud_only_quality"], report["edge_only_quality"]
        ax.plot([0, 1], [cloud_q, edge_q], "--", color="tab:gray", label="random routing")
        o_shares, o_quality = evaluation.oracle_curve
        ax.plot(o_shares, o_quality, ":", color="tab:green", label="oracle")
        ax.axhline(cloud_q - MAX_QUALITY_LOSS, color="tab:red", lw=0.8, label="cloud-only - 1 pt")
        share = report["edge_share_at_cloud_parity_minus_1pt"]
        ax.plot(
            [share],
            [report["quality_at_parity_threshold"]],
            "*",
            ms=11,
            color="tab:orange",
            label=f"parity threshold: {share:.0%} at the edge",
        )
        ax.set_title(f"{task}: {report['edge_model']} -> {report['cloud_model']} (n_test={report['n_test']})")
        ax.set_xlabel("edge share")
        ax.set_ylabel("exact line match" if task == "lm" else "accuracy")
        ax.set_xlim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_pgr(ax: Any, task: str, evaluation: TaskEvaluation) -> None:
    """RouteLLM's view: PGR against the cloud-call share per signal, random routing and the oracle (test half)."""
    routing = evaluation.report["routing"]
    ax.plot([0, 1], [0, 1], "--", color="tab:gray", label="random (expected), APGR 0.5")
    if not evaluation.pgr_curves:
        ax.text(0.5, 0.5, "no quality gap on test: PGR undefined", ha="center", transform=ax.transAxes)
    for name, (share, pgr) in evaluation.pgr_curves.items():
        r = routing["oracle"] if name == ORACLE else routing["routers"][name]
        style = {ORACLE: (":", "tab:green"), RANDOM_SAMPLE: ("-", "tab:gray")}.get(name, ("-", None))
        lw = 0.8 if name == RANDOM_SAMPLE else 1.4
        ax.plot(share, pgr, style[0], color=style[1], lw=lw, label=f"{name}: APGR {r['apgr']:.2f}")
    ax.axhline(0.8, color="tab:red", lw=0.6)
    ax.set_title(f"{task}: PGR vs cloud calls (gap {routing['gap']}, n_test={evaluation.report['n_test']})")
    ax.set_xlabel("cloud-call share")
    ax.set_ylabel("performance gap recovered")
    ax.set_xlim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")


def run_cascade_bench(
    zoo_root: Path,
    num_lines: int = DEFAULT_LINES,
    seed: int = 0,
    *,
    export_path: Path | None = None,
    plot_path: Path | None = None,
    resamples: int = DEFAULT_RESAMPLES,
) -> dict[str, Any]:
    """Every task on one built zoo preset; returns ``{"digits": ..., "digits-micro": ..., "lm": ...,
    "seconds": ...}``.

    Args:
        zoo_root: a built preset, ``<zoo dir>/<preset>``.
        num_lines: LM items (held-out line starts).
        seed: draws the LM items and both validation/test splits.
        export_path: write the validation items here (``tierline edge calibrate --data``).
        plot_path: draw quality vs edge share and PGR vs cloud calls for every task into this PNG.
        resamples: bootstrap resamples of the test items for the routing intervals.
    """
    started = time.perf_counter()
    layout = ZooLayout(zoo_root)
    evaluations: dict[str, TaskEvaluation] = {}
    exported = []
    if plot_path is not None:
        _require_matplotlib()
    runs = [lambda: run_digits(layout), lambda: run_digits(layout, "digits-micro")]
    for run in (*runs, lambda: run_lm(layout, num_lines, seed)):
        task_started = time.perf_counter()
        task = run()
        evaluation = evaluations[task.task] = evaluate(task, seed, resamples)
        evaluation.report["seconds"] = round(time.perf_counter() - task_started, 1)
        exported.append((task, evaluation.validation_rows))
    if export_path is not None:
        export_validation(export_path, exported)
    if plot_path is not None:
        plot_cascade(plot_path, evaluations)
    return {**{task: e.report for task, e in evaluations.items()}, "seconds": round(time.perf_counter() - started, 1)}


@click.command("cascade")
@click.option("--preset", type=click.Choice(["tiny", "demo"]), default="demo", show_default=True)
@click.option("--zoo-dir", type=click.Path(path_type=Path), default=None, help="default $TIERLINE_DATA_DIR/zoo")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.option(
    "--lines",
    "num_lines",
    type=click.IntRange(min=4),
    default=DEFAULT_LINES,
    show_default=True,
    help="LM items (held-out line starts)",
)
@click.option("--seed", type=int, default=0, show_default=True, help="draws the LM items, the splits, the resamples")
@click.option(
    "--resamples",
    type=click.IntRange(min=100),
    default=DEFAULT_RESAMPLES,
    show_default=True,
    help="bootstrap resamples of the test items for the routing intervals",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="draw quality vs edge share into this PNG (needs matplotlib)",
)
@click.option(
    "--export-validation",
    "export_path",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="write the validation items as JSON Lines for `tierline edge calibrate --data`",
)
def cascade_command(
    preset: str,
    zoo_dir: Path | None,
    as_json: bool,
    num_lines: int,
    seed: int,
    resamples: int,
    plot_path: Path | None,
    export_path: Path | None,
) -> None:
    """Edge/cloud cascade: quality vs edge share per escalation signal, thresholds chosen on a validation half
    of the held-out data and reported on the other half."""
    emit(
        run_cascade_bench(
            zoo_root(preset, zoo_dir),
            num_lines,
            seed,
            export_path=export_path,
            plot_path=plot_path,
            resamples=resamples,
        ),
        as_json,
    )

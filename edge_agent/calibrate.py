"""``tierline edge calibrate``: choose a model's escalation signal and threshold from validation data.

Numpy only (no torch): it runs on the device. The data comes from ``tierline bench cascade --export-validation``,
which ran the edge and the cloud model on held-out items and recorded, per item, the edge's signals and whether
each tier's answer was right.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click
import numpy as np

from shared.errors import ConfigurationError
from shared.escalation import (
    CLASSIFIER_SIGNALS,
    LM_SIGNALS,
    ROUTER,
    EdgePolicy,
    LearnedRouter,
    SignalChoice,
    fit_router,
    load_policy,
    quality_curve,
    rank_signals,
    save_policy,
)

PROMPT_TOKENS = "prompt_tokens"
MIN_ITEMS = 10
MAX_CURVE_POINTS = 51

DATA_FORMAT = f"""\b
--data is JSON Lines, one validation item per line, as `tierline bench cascade --export-validation FILE`
writes it (other keys are ignored):
  {{"model": "tierline/lm-edge", "prompt_tokens": 128, "edge_good": false, "cloud_good": true,
   "agrees_with_cloud": false, "signals": {{"mean_logprob": -0.41, "min_margin": 0.12, "norm_entropy": 0.83}}}}
\b
model              the served model id; --model matches it or its last part (lm-edge)
signals            the edge's confidence signals: {", ".join(LM_SIGNALS)} (LMs),
                   {", ".join(CLASSIFIER_SIGNALS)} (classifiers)
prompt_tokens      the prompt's length in tokens, or null (classifiers)
edge_good          whether the edge model's answer was right
cloud_good         whether the cloud model's answer was right
agrees_with_cloud  whether the edge's answer was the cloud's (what the learned router predicts)
\b
Every signal, and a learned router over all of them (plus prompt_tokens), is tried; the one that answers
the most items locally within the bound wins. At least {MIN_ITEMS} items of the model are needed."""


@dataclass(slots=True)
class ValidationSet:
    """The validation items of one edge model, as columns."""

    model: str
    signals: dict[str, np.ndarray]
    prompt_tokens: np.ndarray | None
    edge_good: np.ndarray
    cloud_good: np.ndarray
    agrees: np.ndarray

    def __len__(self) -> int:
        return len(self.edge_good)


def validation_row(
    model: str,
    signals: dict[str, float],
    prompt_tokens: int | None,
    *,
    edge_good: bool,
    cloud_good: bool,
    agrees_with_cloud: bool,
) -> dict[str, Any]:
    """One line of the ``--data`` format."""
    return {
        "model": model,
        "signals": {k: float(v) for k, v in signals.items()},
        PROMPT_TOKENS: prompt_tokens,
        "edge_good": bool(edge_good),
        "cloud_good": bool(cloud_good),
        "agrees_with_cloud": bool(agrees_with_cloud),
    }


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _parse_row(line: str, where: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigurationError(f"{where}: not JSON ({exc.msg})") from exc
    if not isinstance(row, dict):
        raise ConfigurationError(f"{where}: expected a JSON object")
    if not isinstance(row.get("model"), str):
        raise ConfigurationError(f"{where}: 'model' must be a string")
    signals = row.get("signals")
    if not isinstance(signals, dict) or not all(_is_number(v) for v in signals.values()):
        raise ConfigurationError(f"{where}: 'signals' must be an object of finite numbers")
    for key in ("edge_good", "cloud_good", "agrees_with_cloud"):
        if not isinstance(row.get(key), bool):
            raise ConfigurationError(f"{where}: '{key}' must be true or false")
    tokens = row.get(PROMPT_TOKENS)
    if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0):
        raise ConfigurationError(f"{where}: '{PROMPT_TOKENS}' must be a non-negative integer or null")
    return row


def read_validation(path: Path, model: str) -> ValidationSet:
    """The rows of ``model`` in ``path``: matched on the full id (``tierline/lm-edge``) or its last part
    (``lm-edge``). Raises ``ConfigurationError`` naming the file and line on anything malformed."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigurationError(f"cannot read {path}: {exc}") from exc
    rows = [_parse_row(line, f"{path}:{n}") for n, line in enumerate(lines, 1) if line.strip()]
    mine = [r for r in rows if model in (r["model"], r["model"].rsplit("/", 1)[-1])]
    ids = sorted({r["model"] for r in mine})
    if not ids:
        found = ", ".join(sorted({r["model"] for r in rows})) or "none"
        raise ConfigurationError(f"{path}: no items for model {model!r} (models in the file: {found})")
    if len(ids) > 1:
        raise ConfigurationError(f"{path}: {model!r} matches several models ({', '.join(ids)}); give the full id")
    if len(mine) < MIN_ITEMS:
        raise ConfigurationError(f"{path}: only {len(mine)} items for {ids[0]}; calibration needs {MIN_ITEMS}")
    known = [s for s in dict.fromkeys(LM_SIGNALS + CLASSIFIER_SIGNALS) if all(s in r["signals"] for r in mine)]
    if not known:
        raise ConfigurationError(f"{path}: no item of {ids[0]} has a known signal ({', '.join(LM_SIGNALS)}, ...)")
    tokens = [r.get(PROMPT_TOKENS) for r in mine]
    return ValidationSet(
        model=ids[0],
        signals={s: np.array([r["signals"][s] for r in mine], dtype=np.float64) for s in known},
        prompt_tokens=np.array(tokens, dtype=np.float64) if all(t is not None for t in tokens) else None,
        edge_good=np.array([r["edge_good"] for r in mine]),
        cloud_good=np.array([r["cloud_good"] for r in mine]),
        agrees=np.array([r["agrees_with_cloud"] for r in mine]),
    )


def router_inputs(data: ValidationSet) -> dict[str, np.ndarray]:
    """The router's features: every signal, plus ``prompt_tokens`` when the items have it."""
    table = dict(data.signals)
    if data.prompt_tokens is not None:
        table[PROMPT_TOKENS] = data.prompt_tokens
    return table


def fit_validation_router(data: ValidationSet) -> LearnedRouter:
    """The router, trained to predict that the edge's answer is the one the cloud would give. (Predicting "the
    edge is no worse than the cloud" instead ranks no better than chance on weak LMs: most such items are ones
    both tiers get wrong, and a linear model cannot separate them from the confident, right ones.)"""
    table = router_inputs(data)
    return fit_router(table, data.agrees, list(table))


def curve_points(
    confidence: np.ndarray, edge_good: np.ndarray, cloud_good: np.ndarray, max_points: int = MAX_CURVE_POINTS
) -> list[dict[str, float | None]]:
    """The quality-vs-edge-share curve with the threshold of each point (``None``: nothing answered locally)."""
    shares, quality = quality_curve(confidence, edge_good, cloud_good)
    ranked = np.sort(np.asarray(confidence, dtype=np.float64))[::-1]
    keep = np.unique(np.linspace(0, len(shares) - 1, min(max_points, len(shares))).round().astype(int))
    points: list[dict[str, float | None]] = []
    for i in keep:
        cut = round(float(shares[i]) * len(ranked))
        threshold = float(ranked[cut - 1]) if cut > 0 else None
        points.append({"threshold": threshold, "edge_share": float(shares[i]), "quality": float(quality[i])})
    return points


def calibrate(data: ValidationSet, max_quality_loss: float) -> tuple[EdgePolicy, list[SignalChoice]]:
    """The policy whose signal answers the most requests locally within the bound, and every signal's result."""
    router = fit_validation_router(data)
    confidences = {**data.signals, ROUTER: router.confidences(router_inputs(data))}
    ranking = rank_signals(confidences, data.edge_good, data.cloud_good, max_quality_loss)
    best = ranking[0]
    # No threshold qualifies: escalate everything, with a finite threshold (policies travel as strict JSON).
    threshold = (
        best.threshold if math.isfinite(best.threshold) else float(np.nextafter(confidences[best.signal].max(), np.inf))
    )
    calibration = {
        "max_quality_loss": max_quality_loss,
        "num_items": len(data),
        "calibrated_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "edge_share": best.edge_share,
        "quality": best.quality,
        "cloud_only_quality": float(data.cloud_good.mean()),
        "edge_only_quality": float(data.edge_good.mean()),
        "curve": curve_points(confidences[best.signal], data.edge_good, data.cloud_good),
        "signals": {
            c.signal: {**dataclasses.asdict(c), "threshold": c.threshold if math.isfinite(c.threshold) else None}
            for c in ranking
        },
    }
    policy = EdgePolicy(
        model=data.model,
        signal=best.signal,
        threshold=threshold,
        router=router if best.signal == ROUTER else None,
        calibration=calibration,
    )
    return policy, ranking


def _merge(existing: EdgePolicy | None, calibrated: EdgePolicy) -> EdgePolicy:
    """Keep what an operator set (mode, limits) and replace what calibration decides."""
    if existing is None:
        return calibrated
    return dataclasses.replace(
        existing,
        signal=calibrated.signal,
        threshold=calibrated.threshold,
        router=calibrated.router,
        calibration=calibrated.calibration,
    )


@click.command("calibrate", epilog=DATA_FORMAT)
@click.option("--model", required=True, help="the edge model, e.g. tierline/lm-edge (or lm-edge)")
@click.option(
    "--max-quality-loss",
    type=click.FloatRange(0.0, 1.0),
    default=0.01,
    show_default=True,
    help="largest allowed drop below cloud-only quality (0.01 = one point)",
)
@click.option(
    "--data",
    "data_file",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    required=True,
    help="validation items, JSON Lines (format below)",
)
@click.option(
    "--out-dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="where the policy goes (default: the agent's policy_dir)",
)
def calibrate_command(model: str, max_quality_loss: float, data_file: Path, out_dir: Path | None) -> None:
    """Pick the escalation signal and threshold that answer the most requests locally while quality stays within
    --max-quality-loss of cloud-only on the data; store the model's policy and print a one-line summary."""
    try:
        if out_dir is None:
            from edge_agent.settings import load_edge_settings, policy_dir

            out_dir = policy_dir(load_edge_settings(None))
        data = read_validation(data_file, model)
        policy, _ = calibrate(data, max_quality_loss)
        try:
            existing = load_policy(out_dir, policy.model)
        except ConfigurationError as exc:
            click.echo(f"replacing an unreadable policy: {exc.message}", err=True)
            existing = None
        path = save_policy(out_dir, _merge(existing, policy))
    except ConfigurationError as exc:
        raise click.ClickException(exc.message) from exc
    except OSError as exc:
        raise click.ClickException(f"cannot write the policy: {exc}") from exc
    cal = policy.calibration
    if cal["edge_share"] == 0.0:
        decision = "no threshold keeps quality within the bound, so every request escalates"
    else:
        decision = f"{policy.signal} >= {policy.threshold:.4g} answers {cal['edge_share']:.1%} locally"
    click.echo(
        f"{policy.model}: {decision}, quality {cal['quality']:.4f} vs cloud-only {cal['cloud_only_quality']:.4f} "
        f"(bound {max_quality_loss}, n={cal['num_items']}) -> {path}"
    )

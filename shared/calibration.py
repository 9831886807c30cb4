"""Calibration of an escalation policy: choose a model's signal and threshold from validation data.

Numpy only (no torch): it runs on a device (``tierline edge calibrate``) and in the control plane
(``tierline policies calibrate``). The data comes from ``tierline bench cascade --export-validation``, which ran
the edge and the cloud model on held-out items and recorded, per item, the edge's signals and whether each tier's
answer was right.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from shared.errors import ConfigurationError
from shared.escalation import (
    CLASSIFIER_SIGNALS,
    COPY_SIGNALS,
    HIDDEN_PROBE,
    LM_SIGNALS,
    PROBE_INPUTS,
    ROUTER,
    ROUTER_GAIN,
    EdgePolicy,
    LearnedRouter,
    LinearProbe,
    SignalChoice,
    fit_router,
    fold_hidden_probe,
    no_loss_target,
    quality_curve,
    rank_signals,
)

PROMPT_TOKENS = "prompt_tokens"
MIN_ITEMS = 10
MAX_CURVE_POINTS = 51


@dataclass(slots=True)
class ValidationSet:
    """The validation items of one edge model, as columns."""

    model: str
    signals: dict[str, np.ndarray]
    prompt_tokens: np.ndarray | None
    edge_good: np.ndarray
    cloud_good: np.ndarray
    agrees: np.ndarray
    # The hidden-state probe's input per item (``[n, k]``) and its kind (``LinearProbe.input``), when every
    # row carries one.
    probe_inputs: np.ndarray | None = None
    probe_input: str | None = None
    kinds: np.ndarray | None = None  # per item, the kind of request (rows' optional ``kind``), when every row has one

    def __len__(self) -> int:
        return len(self.edge_good)


def validation_row(
    model: str,
    signals: dict[str, float],
    prompt_tokens: int | None,
    *,
    edge_good: bool | float,
    cloud_good: bool | float,
    agrees_with_cloud: bool,
    probe: tuple[str, np.ndarray] | None = None,
) -> dict[str, Any]:
    """One line of the ``--data`` format; ``probe``: the hidden-state probe's input kind and values (optional).
    ``edge_good``/``cloud_good``: right or wrong, or a graded quality in [0, 1] (a float)."""
    row: dict[str, Any] = {
        "model": model,
        "signals": {k: float(v) for k, v in signals.items()},
        PROMPT_TOKENS: prompt_tokens,
        "edge_good": _good(edge_good),
        "cloud_good": _good(cloud_good),
        "agrees_with_cloud": bool(agrees_with_cloud),
    }
    if probe is not None:
        row["probe"] = {"input": probe[0], "values": [float(v) for v in np.asarray(probe[1]).reshape(-1)]}
    return row


def _good(value: bool | float | np.bool_ | np.floating[Any]) -> bool | float:
    """A tier's quality on an item as JSON: a bool stays a bool, a graded quality a float."""
    if isinstance(value, bool | np.bool_):
        return bool(value)
    return float(value)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _parse_row(line: str, where: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigurationError(f"{where}: not JSON ({exc.msg})") from exc
    if not isinstance(row, dict):
        raise ConfigurationError(f"{where}: expected a JSON object")
    if "signals" not in row and ("prompt" in row or "messages" in row):
        raise ConfigurationError(
            f"{where}: a prompt, not a validation item; prompts are run on both tiers where they are: "
            "tierline policies calibrate --model EDGE --data FILE --cloud-model CLOUD"
        )
    if not isinstance(row.get("model"), str):
        raise ConfigurationError(f"{where}: 'model' must be a string")
    signals = row.get("signals")
    if not isinstance(signals, dict) or not all(_is_number(v) for v in signals.values()):
        raise ConfigurationError(f"{where}: 'signals' must be an object of finite numbers")
    for key in ("edge_good", "cloud_good"):
        value = row.get(key)
        if not isinstance(value, bool) and not (isinstance(value, float) and _is_number(value) and 0 <= value <= 1):
            raise ConfigurationError(
                f"{where}: '{key}' must be true or false, or a graded quality from 0.0 to 1.0 (a number with a point)"
            )
    if not isinstance(row.get("agrees_with_cloud"), bool):
        raise ConfigurationError(f"{where}: 'agrees_with_cloud' must be true or false")
    if "kind" in row and not isinstance(row["kind"], str):
        raise ConfigurationError(f"{where}: 'kind' must be a string")
    tokens = row.get(PROMPT_TOKENS)
    if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0):
        raise ConfigurationError(f"{where}: '{PROMPT_TOKENS}' must be a non-negative integer or null")
    probe = row.get("probe")
    if probe is not None and (
        not isinstance(probe, dict)
        or probe.get("input") not in PROBE_INPUTS
        or not isinstance(probe.get("values"), list)
        or not probe["values"]
        or not all(_is_number(v) for v in probe["values"])
    ):
        raise ConfigurationError(
            f'{where}: \'probe\' must be {{"input": one of {", ".join(PROBE_INPUTS)}, "values": [numbers]}}'
        )
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
    known = [
        s for s in dict.fromkeys(LM_SIGNALS + COPY_SIGNALS + CLASSIFIER_SIGNALS) if all(s in r["signals"] for r in mine)
    ]
    if not known:
        raise ConfigurationError(f"{path}: no item of {ids[0]} has a known signal ({', '.join(LM_SIGNALS)}, ...)")
    tokens = [r.get(PROMPT_TOKENS) for r in mine]
    probes: list[dict[str, Any]] = [r["probe"] for r in mine if r.get("probe") is not None]
    same_probe = len(probes) == len(mine) and len({(p["input"], len(p["values"])) for p in probes}) == 1
    graded = any(not isinstance(r[k], bool) for r in mine for k in ("edge_good", "cloud_good"))
    kinds = [r.get("kind") for r in mine]
    return ValidationSet(
        model=ids[0],
        signals={s: np.array([r["signals"][s] for r in mine], dtype=np.float64) for s in known},
        prompt_tokens=np.array(tokens, dtype=np.float64) if all(t is not None for t in tokens) else None,
        edge_good=np.array([r["edge_good"] for r in mine], dtype=np.float64 if graded else bool),
        cloud_good=np.array([r["cloud_good"] for r in mine], dtype=np.float64 if graded else bool),
        agrees=np.array([r["agrees_with_cloud"] for r in mine]),
        probe_inputs=np.array([p["values"] for p in probes], dtype=np.float64) if same_probe else None,
        probe_input=probes[0]["input"] if same_probe else None,
        kinds=np.array(kinds, dtype=str) if all(isinstance(k, str) for k in kinds) else None,
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


def fit_gain_router(data: ValidationSet) -> LearnedRouter:
    """The same features fitted on what escalating gains (``no_loss_target``: that keeping the request local loses
    nothing against the cloud). It ranks where the cloud does better rather than where the tiers agree, which is
    what the quality curve rewards when the edge is confidently wrong on requests the cloud gets right (the demo
    LM pair on long prompts, ``docs/routing.md``). Competes with the agreement router; ships as signal ``router``.
    Its L2 strength stays fixed: ``bench cascade`` cross-validates it (``fit_router_cv``), but on the digits pair
    that choice made the calibrated policy promise more agreement than the test items give, and the quality
    monitor then raised false alerts on a correct policy (``bench monitor``: 22 % of streams against at most 10 %)."""
    table = router_inputs(data)
    return fit_router(table, no_loss_target(data.edge_good, data.cloud_good), list(table))


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


# The output embedding (logits = W h) under the names the supported layouts give it: an untied head first, then the
# tied input embedding of Llama/Qwen/Mistral/Gemma/Phi-3 and of GPT-2.
UNEMBEDDING_KEYS = ("lm_head.weight", "model.embed_tokens.weight", "transformer.wte.weight")


def tied_embedding_projection(model_dir: Path) -> np.ndarray:
    """``pinv(W)`` (``[d, V]``) of the output embedding ``W`` in ``model_dir``'s safetensors (a zoo LM such as
    ``artifacts/lm-edge``, or any Hugging Face checkpoint: its ``lm_head``, else its tied embedding): what takes an
    LM's mean logits back to its final normalised hidden state."""
    from safetensors import SafetensorError, safe_open

    paths = sorted(model_dir.glob("*.safetensors"))
    if not paths:
        raise ConfigurationError(f"--model-dir: no *.safetensors in {model_dir}")
    from shared.escalation import hidden_from_logits

    try:
        for key in UNEMBEDDING_KEYS:
            for path in paths:
                with safe_open(str(path), framework="numpy") as f:
                    if key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                        return hidden_from_logits(f.get_tensor(key).astype(np.float64))
    except (OSError, SafetensorError, TypeError, ValueError) as exc:  # bfloat16 has no numpy type: save it as float32
        raise ConfigurationError(f"--model-dir: cannot read {model_dir}: {exc}") from exc
    raise ConfigurationError(f"--model-dir: {model_dir} has no output embedding ({', '.join(UNEMBEDDING_KEYS)})")


def fit_validation_probe(
    data: ValidationSet, l2: float = 0.1, projection: np.ndarray | None = None
) -> LinearProbe | None:
    """The hidden-state probe on the items' probe inputs (target as the router's), or None without them. With
    ``projection`` (``[d, k]``, e.g. ``tied_embedding_projection``) it is fitted on the hidden states
    ``projection @ x`` and folded back onto the raw input, as ``bench cascade`` fits the LM probe."""
    if data.probe_inputs is None or data.probe_input is None:
        return None
    x = data.probe_inputs
    if projection is not None and projection.shape[1] != x.shape[1]:
        raise ConfigurationError(
            f"the items' probe inputs have {x.shape[1]} values but the model's embedding takes {projection.shape[1]}"
            " (a different model?)"
        )
    hidden = x if projection is None else x @ projection.T
    table = {f"h{j:03d}": hidden[:, j] for j in range(hidden.shape[1])}
    fitted = fit_router(table, np.asarray(data.agrees, dtype=np.float64), list(table), l2=l2)
    return fold_hidden_probe(fitted, projection, data.probe_input, hidden.shape[1])


def calibrate(
    data: ValidationSet, max_quality_loss: float, probe_projection: np.ndarray | None = None
) -> tuple[EdgePolicy, list[SignalChoice]]:
    """The policy whose signal answers the most requests locally within the bound, and every signal's result.
    With probe inputs the hidden-state probe competes too (fitted through ``probe_projection`` when given); its
    confidences join ``data.signals`` (as ``hidden_probe``), so a caller reads the winner's confidences there
    whichever it is."""
    routers = {ROUTER: fit_validation_router(data), ROUTER_GAIN: fit_gain_router(data)}
    probe = fit_validation_probe(data, projection=probe_projection)
    if probe is not None and data.probe_inputs is not None:
        data.signals[HIDDEN_PROBE] = probe.confidences(data.probe_inputs)
    inputs = router_inputs(data)
    confidences = {**data.signals, **{name: r.confidences(inputs) for name, r in routers.items()}}
    ranking = rank_signals(confidences, data.edge_good, data.cloud_good, max_quality_loss)
    best = ranking[0]
    # No threshold qualifies: escalate everything, with a finite threshold (policies travel as strict JSON).
    threshold = (
        best.threshold if math.isfinite(best.threshold) else float(np.nextafter(confidences[best.signal].max(), np.inf))
    )
    local = np.asarray(confidences[best.signal], dtype=np.float64) >= threshold
    calibration: dict[str, Any] = {
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
    if data.kinds is not None:  # the promise per kind of request: what a live rate per kind is checked against
        calibration["by_kind"] = {
            str(kind): {
                "num_items": int((data.kinds == kind).sum()),
                "edge_share": float(local[data.kinds == kind].mean()),
            }
            for kind in sorted(set(data.kinds.tolist()))
        }
    policy = EdgePolicy(
        model=data.model,
        signal=ROUTER if best.signal in routers else best.signal,
        threshold=threshold,
        router=routers.get(best.signal),
        probe=probe if best.signal == HIDDEN_PROBE else None,
        calibration=calibration,
    )
    return policy, ranking

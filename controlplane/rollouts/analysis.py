"""Rollout analysis: a pure function over per-arm aggregates (no I/O, no database).

:func:`analyse` judges one step of a rollout from :class:`Window` s (baseline and candidate aggregates of one
metrics source over the same window): ``rollback`` on any failed check, ``wait`` while data is thin, a check
has no data or the step is too young, else ``advance`` or ``promote``. A check is relative: candidate <=
baseline * factor + slack. No data is never a pass.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Final, Literal

from controlplane.rollouts.assignment import BASELINE, CANDIDATE

Action = Literal["wait", "advance", "promote", "rollback"]
Source = Literal["cloud", "edge", "policy"]

METRICS: Final = (
    "error_rate",
    "p95_latency_ms",
    "p95_ttft_ms",
    "escalation_rate",
    "cost_per_request",
    "disagreement_rate",
)
# The live quality monitor's shadow samples judge a policy version's answers: an arm's disagreement rate with the
# cloud is known once it has this many samples; with none in either arm (the monitor is off), it is not judged.
MIN_SHADOW_SAMPLES: Final = 30
DEFAULT_CHECKS: Final[dict[str, dict[str, float]]] = {
    "error_rate": {"factor": 1.2, "slack": 0.005},
    "p95_latency_ms": {"factor": 1.3, "slack": 0.0},
    "escalation_rate": {"factor": 1.2, "slack": 0.02},
}
# A policy version is judged on what it is for: how often it escalates, what a request then costs (edge and
# cloud tokens from the ledger) and how often the answers it keeps on the edge disagree with the cloud's (the
# live quality monitor's shadow samples), with errors and latency as guards.
POLICY_DEFAULT_CHECKS: Final[dict[str, dict[str, float]]] = {
    "error_rate": {"factor": 1.2, "slack": 0.005},
    "p95_latency_ms": {"factor": 1.3, "slack": 0.0},
    "escalation_rate": {"factor": 1.2, "slack": 0.02},
    "cost_per_request": {"factor": 1.1, "slack": 0.0},
    "disagreement_rate": {"factor": 1.0, "slack": 0.02},
}
# What each source can measure: the cloud has no escalations, telemetry has no TTFT or cost; a policy rollout's
# devices have telemetry (requests, escalations, errors, p95) and ledger cost.
SOURCE_METRICS: Final[dict[str, frozenset[str]]] = {
    "cloud": frozenset({"error_rate", "p95_latency_ms", "p95_ttft_ms", "cost_per_request"}),
    "edge": frozenset({"error_rate", "p95_latency_ms", "escalation_rate"}),
    "policy": frozenset({"error_rate", "p95_latency_ms", "escalation_rate", "cost_per_request", "disagreement_rate"}),
}


@dataclass(frozen=True, slots=True)
class ArmStats:
    """One arm's aggregates over a window. ``None`` means the source does not know (never zero)."""

    requests: int = 0
    errors: int = 0
    p95_latency_ms: float | None = None
    p95_ttft_ms: float | None = None
    escalations: int | None = None
    cost: Decimal | None = None
    num_priced: int = 0
    num_devices: int | None = None
    shadow_samples: int = 0
    shadow_disagreements: int = 0

    def value(self, metric: str) -> float | Decimal | None:
        if metric == "error_rate":
            return self.errors / self.requests if self.requests else None
        if metric == "escalation_rate":
            return self.escalations / self.requests if self.requests and self.escalations is not None else None
        if metric == "cost_per_request":
            return self.cost / self.num_priced if self.cost is not None and self.num_priced else None
        if metric == "p95_latency_ms":
            return self.p95_latency_ms
        if metric == "p95_ttft_ms":
            return self.p95_ttft_ms
        if metric == "disagreement_rate":
            if self.shadow_samples < MIN_SHADOW_SAMPLES:
                return None
            return self.shadow_disagreements / self.shadow_samples
        raise ValueError(f"unknown metric {metric!r}")

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"requests": self.requests, "errors": self.errors}
        for metric in METRICS:
            value = self.value(metric)
            if value is not None:
                out[metric] = str(value) if isinstance(value, Decimal) else round(value, 6)
        if self.num_devices is not None:
            out["devices"] = self.num_devices
        if self.shadow_samples:
            out["shadow_samples"] = self.shadow_samples
        return out


@dataclass(frozen=True, slots=True)
class Window:
    """Both arms of one metrics source over the same window."""

    source: Source
    baseline: ArmStats
    candidate: ArmStats


@dataclass(frozen=True, slots=True)
class CheckResult:
    source: Source
    metric: str
    baseline: float | Decimal | None
    candidate: float | Decimal | None
    limit: float | Decimal | None
    outcome: Literal["pass", "fail", "unknown"]

    def describe(self) -> str:
        if self.outcome == "unknown":
            side = "baseline" if self.baseline is None else "candidate"
            if self.metric == "disagreement_rate":
                return f"{self.source} {self.metric}: fewer than {MIN_SHADOW_SAMPLES} shadow samples for the {side}"
            return f"{self.source} {self.metric}: no data for the {side}"
        verb = "exceeds" if self.outcome == "fail" else "within"
        values = f"{_fmt(self.candidate)} {verb} limit {_fmt(self.limit)} (baseline {_fmt(self.baseline)})"
        return f"{self.source} {self.metric} {values}"

    def as_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "metric": self.metric,
            "baseline": _jsonable(self.baseline),
            "candidate": _jsonable(self.candidate),
            "limit": _jsonable(self.limit),
            "outcome": self.outcome,
        }


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    reason: str
    metrics: dict[str, Any]


def _fmt(value: float | Decimal | None) -> str:
    if value is None:
        return "n/a"
    return str(value) if isinstance(value, Decimal) else f"{value:.4g}"


def _jsonable(value: float | Decimal | None) -> Any:
    return str(value) if isinstance(value, Decimal) else value


def check(window: Window, metric: str, spec: Mapping[str, float]) -> CheckResult:
    """Candidate <= baseline * factor + slack, on one metric of one window."""
    base, cand = window.baseline.value(metric), window.candidate.value(metric)
    if base is None or cand is None:
        return CheckResult(window.source, metric, base, cand, None, "unknown")
    limit: float | Decimal
    if isinstance(base, Decimal) or isinstance(cand, Decimal):
        limit = Decimal(base) * Decimal(str(spec["factor"])) + Decimal(str(spec["slack"]))
        ok = Decimal(cand) <= limit
    else:
        limit = base * spec["factor"] + spec["slack"]
        ok = cand <= limit + 1e-12
    return CheckResult(window.source, metric, base, cand, limit, "pass" if ok else "fail")


def _judged(window: Window, metric: str) -> bool:
    """Every check is judged, but agreement where neither arm has a shadow sample: the live quality monitor is
    off for these devices (its share is 0), so there is nothing to wait for."""
    if metric != "disagreement_rate":
        return True
    return bool(window.baseline.shadow_samples or window.candidate.shadow_samples)


def analyse(
    windows: Sequence[Window],
    *,
    checks: Mapping[str, Mapping[str, float] | None],
    min_samples: int,
    min_step_s: float,
    step_elapsed_s: float,
    next_weight: float | None,
) -> Decision:
    """Judge one step: ``rollback`` on any failed check, ``wait`` while data is thin or a check has no data or
    the step is younger than ``min_step_s``, else ``advance`` (or ``promote`` when the next weight is 100 % or
    there is no next step).

    A window is judged only once both arms have ``min_samples`` requests (``min_samples`` ≥ 1), so an empty
    window can never pass. ``next_weight`` is the following step's weight, None on the last step.
    """
    assert min_samples >= 1, "min_samples is validated at creation"
    results: list[CheckResult] = []
    thin: list[str] = []
    for window in windows:
        short = [
            f"{window.source} {name} {stats.requests}/{min_samples} requests"
            for name, stats in ((BASELINE, window.baseline), (CANDIDATE, window.candidate))
            if stats.requests < min_samples
        ]
        if short:
            thin.extend(short)
            continue
        results.extend(
            check(window, metric, spec)
            for metric, spec in checks.items()
            if spec is not None and metric in SOURCE_METRICS[window.source] and _judged(window, metric)
        )
    metrics: dict[str, Any] = {
        "step_elapsed_s": round(step_elapsed_s, 3),
        "windows": {w.source: {BASELINE: w.baseline.as_json(), CANDIDATE: w.candidate.as_json()} for w in windows},
        "checks": [r.as_json() for r in results],
    }
    failed = [r for r in results if r.outcome == "fail"]
    if failed:
        return Decision("rollback", "check failed: " + "; ".join(r.describe() for r in failed), metrics)
    if not windows:
        return Decision("wait", "no metrics source for this rollout's scope", metrics)
    if thin:
        return Decision("wait", "waiting for data: " + ", ".join(thin), metrics)
    unknown = [r for r in results if r.outcome == "unknown"]
    if unknown:
        return Decision("wait", "waiting for data: " + "; ".join(r.describe() for r in unknown), metrics)
    if step_elapsed_s < min_step_s:
        return Decision("wait", f"checks pass; step has run {step_elapsed_s:.0f}s of {min_step_s:g}s", metrics)
    passed = "; ".join(r.describe() for r in results) or f"{min_samples}+ requests per arm"
    if next_weight is None or next_weight >= 100:
        return Decision("promote", f"every step passed: {passed}", metrics)
    return Decision("advance", f"step passed: {passed}", metrics)


@dataclass(frozen=True, slots=True)
class ShadowStats:
    """The shadow step's mirrored samples over a window: how many, and their mean token agreement."""

    samples: int = 0
    mean_agreement: float | None = None

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"samples": self.samples}
        if self.mean_agreement is not None:
            out["mean_agreement"] = round(self.mean_agreement, 6)
        return out


def token_agreement(baseline: Sequence[int], candidate: Sequence[int]) -> float | None:
    """The share of the baseline's generated positions where the candidate produced the same token (a shorter
    candidate disagrees on the positions it lacks); None for an empty baseline (nothing to compare)."""
    if not baseline:
        return None
    matches = sum(1 for b, c in zip(baseline, candidate, strict=False) if b == c)
    return matches / len(baseline)


def analyse_shadow(
    stats: ShadowStats,
    *,
    min_agreement: float,
    min_samples: int,
    min_step_s: float,
    step_elapsed_s: float,
    next_weight: float | None,
) -> Decision:
    """Judge the shadow step (step 0, weight 0): ``wait`` until ``min_samples`` mirrored samples, then
    ``rollback`` when their mean agreement is below ``min_agreement``; once the step has also run ``min_step_s``,
    ``advance`` to the first real step (``promote`` when that step is 100 %). No samples is never a pass."""
    assert min_samples >= 1, "min_samples is validated at creation"
    metrics: dict[str, Any] = {
        "step_elapsed_s": round(step_elapsed_s, 3),
        "shadow": {**stats.as_json(), "min_agreement": min_agreement},
    }
    if stats.samples < min_samples or stats.mean_agreement is None:
        return Decision("wait", f"waiting for data: shadow {stats.samples}/{min_samples} samples", metrics)
    agreement = f"shadow mean token agreement {stats.mean_agreement:.4g} over {stats.samples} samples"
    if stats.mean_agreement < min_agreement - 1e-12:
        return Decision("rollback", f"check failed: {agreement} is below {min_agreement:g}", metrics)
    if step_elapsed_s < min_step_s:
        return Decision("wait", f"{agreement} passes; step has run {step_elapsed_s:.0f}s of {min_step_s:g}s", metrics)
    if next_weight is None or next_weight >= 100:
        return Decision("promote", f"every step passed: {agreement} ≥ {min_agreement:g}", metrics)
    return Decision("advance", f"shadow step passed: {agreement} ≥ {min_agreement:g}", metrics)

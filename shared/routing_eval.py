"""RouteLLM's evaluation of a router between a weak (edge) and a strong (cloud) model (Ong et al., 2024).

Conventions: a router gives every item a *confidence* that the edge's answer will do; an item is sent to the
cloud when its confidence is below the threshold (``EdgePolicy``'s rule), so sweeping the threshold upwards
sends the least confident items first. Quality is per item right (1) or wrong (0) for each tier.

- **PGR** (performance gap recovered) at a threshold: ``(q(routed) - q(edge)) / (q(cloud) - q(edge))``; 0 when
  everything stays at the edge, 1 when everything goes to the cloud. It can exceed 1 where the edge is right
  and the cloud wrong on the items kept. Undefined (None) when the cloud is not better than the edge.
- **The PGR curve**: PGR against the cloud-call share at every threshold that can cut (items with equal
  confidence move together), joined linearly (a threshold that randomises among the tied items reaches every
  point in between, in expectation).
- **APGR**: the area under that curve over call share [0, 1]. Random routing's expected curve is the diagonal
  (APGR 0.5); the oracle's rises with slope ``1 / gap share`` to its peak, so it scores about ``1 - g / 2``
  where ``g`` is the share of items the cloud fixes.
- **CPT(x)**: the smallest call share whose PGR reaches ``x`` (random: ``x``).
- **Share at 95 % of cloud quality**: the smallest call share with ``q(routed) >= 0.95 q(cloud)``, i.e. CPT at
  ``(0.95 q(cloud) - q(edge)) / (q(cloud) - q(edge))`` (0 when the edge alone already reaches it).
- **APGR gain over random**: a router's APGR minus random routing's expectation (``RANDOM_APGR``, 0.5 in every
  resample with a positive gap), ``apgr_gain_vs_random``, and minus the seeded random router's APGR on the same
  items, ``apgr_gain_vs_random_sample``; each with a 95 % *paired* bootstrap interval: both APGRs are computed
  on the same resamples of the test items and the interval is that of their per-resample difference.

``evaluate_routers`` chooses each threshold on a validation half and measures it on a test half, and gives 95 %
bootstrap intervals (test items resampled with replacement, seeded).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

PGR_TARGETS = (0.5, 0.8, 0.95)
QUALITY_FRACTION = 0.95
DEFAULT_RESAMPLES = 1000
RANDOM_SAMPLE = "random_sample"
RANDOM_APGR = 0.5  # random routing's expected APGR: its expected PGR equals the call share
ORACLE = "oracle"
_EPS = 1e-12


def _as_float(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.float64)


@dataclass(frozen=True, slots=True)
class PGRCurves:
    """One router's curves on one set of items under ``B`` weightings (a bootstrap, or the plain items): row
    ``b`` holds the call share and the PGR at each vertex, from ``(0, 0)`` to ``(1, 1)``; the PGR row is NaN
    where that weighting has no positive gap."""

    call_share: np.ndarray  # (B, V)
    pgr: np.ndarray  # (B, V)


def pgr_curves(
    confidence: np.ndarray, edge_good: np.ndarray, cloud_good: np.ndarray, weights: np.ndarray | None = None
) -> PGRCurves:
    """PGR against cloud-call share at every distinct threshold, for each row of ``weights`` (shape ``(B, n)``,
    how often each item counts; default one row of ones)."""
    conf = _as_float(confidence)
    n = len(conf)
    if n == 0:
        raise ValueError("a PGR curve needs at least one item")
    gain = _as_float(cloud_good) - _as_float(edge_good)
    w = np.ones((1, n)) if weights is None else np.atleast_2d(_as_float(weights))
    order = np.argsort(conf, kind="stable")
    cuts = np.concatenate([[0], np.flatnonzero(np.diff(conf[order])) + 1, [n]])
    ws = w[:, order]
    zeros = np.zeros((len(w), 1))
    cum_w = np.concatenate([zeros, np.cumsum(ws, axis=1)], axis=1)[:, cuts]
    cum_g = np.concatenate([zeros, np.cumsum(ws * gain[order], axis=1)], axis=1)[:, cuts]
    total = cum_g[:, -1:]
    with np.errstate(invalid="ignore", divide="ignore"):
        pgr = np.where(total > _EPS, cum_g / np.where(total > _EPS, total, 1.0), np.nan)
    return PGRCurves(cum_w / cum_w[:, -1:], pgr)


def apgr(curves: PGRCurves) -> np.ndarray:
    """Area under each row's PGR curve over call share [0, 1] (NaN where PGR is undefined)."""
    widths = np.diff(curves.call_share, axis=1)
    return np.sum(widths * (curves.pgr[:, 1:] + curves.pgr[:, :-1]) / 2.0, axis=1)


def cpt(curves: PGRCurves, target: float | np.ndarray) -> np.ndarray:
    """Per row, the smallest call share at which the (linearly joined) PGR curve reaches ``target`` (a number,
    or one per row); 0 for a target <= 0, NaN where PGR is undefined."""
    share, pgr = curves.call_share, curves.pgr
    x = np.broadcast_to(np.asarray(target, dtype=np.float64), (len(pgr),))
    reached = pgr >= x[:, None] - _EPS
    j = reached.argmax(axis=1)
    rows = np.arange(len(pgr))
    prev = np.maximum(j - 1, 0)
    p0, p1 = pgr[rows, prev], pgr[rows, j]
    s0, s1 = share[rows, prev], share[rows, j]
    with np.errstate(invalid="ignore", divide="ignore"):
        frac = np.where(p1 > p0, (x - p0) / np.where(p1 > p0, p1 - p0, 1.0), 1.0)
    out = np.where(j == 0, share[rows, 0], s0 + np.clip(frac, 0.0, 1.0) * (s1 - s0))
    return np.where(reached.any(axis=1) & ~np.isnan(pgr[:, -1]), out, np.nan)


def pgr_for_quality(edge_quality: np.ndarray | float, cloud_quality: np.ndarray | float) -> np.ndarray:
    """The PGR at which routed quality is ``QUALITY_FRACTION`` of the cloud's (<= 0: the edge alone gets
    there; NaN without a positive gap)."""
    qe, qc = np.asarray(edge_quality, dtype=np.float64), np.asarray(cloud_quality, dtype=np.float64)
    gap = qc - qe
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(gap > _EPS, (QUALITY_FRACTION * qc - qe) / np.where(gap > _EPS, gap, 1.0), np.nan)


def threshold_for_pgr(confidence: np.ndarray, edge_good: np.ndarray, cloud_good: np.ndarray, target: float) -> float:
    """The threshold that reaches PGR ``target`` on these items with the fewest cloud calls (at a cut a
    threshold can make); ``-inf`` when nothing need go up, ``inf`` (all up) when the target is never reached,
    NaN when these items have no gap to recover."""
    conf = _as_float(confidence)
    curves = pgr_curves(conf, edge_good, cloud_good)
    pgr = curves.pgr[0]
    if np.isnan(pgr[-1]) or not np.isfinite(target):
        return float("nan")
    if target <= 0:
        return float("-inf")
    hits = np.flatnonzero(pgr >= target - _EPS)
    if len(hits) == 0:
        return float("inf")
    k = round(float(curves.call_share[0, hits[0]]) * len(conf))  # items escalated at that cut
    return float(np.sort(conf)[k]) if k < len(conf) else float("inf")


def routed_at(
    confidence: np.ndarray,
    edge_good: np.ndarray,
    cloud_good: np.ndarray,
    threshold: float,
    weights: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of ``weights``: the call share, the PGR and the routed quality when items with confidence
    below ``threshold`` go to the cloud."""
    up = (_as_float(confidence) < threshold).astype(np.float64)
    edge, cloud = _as_float(edge_good), _as_float(cloud_good)
    w = np.ones((1, len(up))) if weights is None else np.atleast_2d(_as_float(weights))
    total_w = w.sum(axis=1)
    gain = w @ (cloud - edge)
    quality = (w @ np.where(up > 0, cloud, edge)) / total_w
    with np.errstate(invalid="ignore", divide="ignore"):
        pgr = np.where(gain > _EPS, (w @ ((cloud - edge) * up)) / np.where(gain > _EPS, gain, 1.0), np.nan)
    return (w @ up) / total_w, pgr, quality


def bootstrap_weights(n: int, resamples: int, seed: int) -> np.ndarray:
    """``(resamples, n)`` counts: how often each item is drawn when ``n`` items are drawn with replacement."""
    return np.random.default_rng(seed).multinomial(n, np.full(n, 1.0 / n), size=resamples).astype(np.float64)


def _r(value: float | np.floating[Any], digits: int = 4) -> float | None:
    return round(float(value), digits) if np.isfinite(value) else None


def _ci(values: np.ndarray, digits: int = 4) -> list[float | None] | None:
    """The 95 % percentile interval of the defined values (None when none is)."""
    ok = values[np.isfinite(values)]
    if len(ok) == 0:
        return None
    lo, hi = np.percentile(ok, [2.5, 97.5])
    return [_r(lo, digits), _r(hi, digits)]


@dataclass(frozen=True, slots=True)
class Half:
    """One half's items: each router's confidence, and whether each tier was right."""

    confidences: dict[str, np.ndarray]
    edge_good: np.ndarray
    cloud_good: np.ndarray


def _target_key(target: float) -> str:
    return f"cpt_{round(target * 100)}"


def apgr_gain(
    point: float, boot: np.ndarray, baseline_point: float, baseline_boot: np.ndarray | float
) -> dict[str, Any]:
    """``point - baseline_point`` with the 95 % interval of the per-resample differences ``boot - baseline_boot``
    (the same resamples for both: a paired bootstrap), and whether that interval excludes zero."""
    diff = np.asarray(boot, dtype=np.float64) - np.asarray(baseline_boot, dtype=np.float64)
    ci = _ci(diff)
    return {
        "gain": _r(point - baseline_point),
        "ci95": ci,
        "excludes_zero": ci is not None and ci[0] is not None and ci[1] is not None and (ci[0] > 0 or ci[1] < 0),
    }


def _router_report(
    name: str, val: Half, test: Half, weights: np.ndarray, random_apgr: tuple[float, np.ndarray] | None = None
) -> dict[str, Any]:
    """APGR and the test curve's CPTs (with intervals), APGR's gain over random routing (its expectation and, given
    ``random_apgr`` (point, per resample), the seeded random router) with paired intervals, and each validation
    threshold measured on test."""
    conf = test.confidences[name]
    point = pgr_curves(conf, test.edge_good, test.cloud_good)
    boot = pgr_curves(conf, test.edge_good, test.cloud_good, weights)
    a_point, a_boot = float(apgr(point)[0]), apgr(boot)
    out: dict[str, Any] = {"apgr": _r(a_point), "apgr_ci95": _ci(a_boot)}
    # Random routing's expectation is RANDOM_APGR wherever the resample has a gap (NaN where it has none).
    vs_random = apgr_gain(a_point, a_boot, RANDOM_APGR, np.where(np.isnan(a_boot), np.nan, RANDOM_APGR))
    out["apgr_gain_vs_random"] = vs_random["gain"]
    out["apgr_gain_vs_random_ci95"] = vs_random["ci95"]
    out["apgr_gain_vs_random_excludes_zero"] = vs_random["excludes_zero"]
    if random_apgr is not None and name != RANDOM_SAMPLE:
        vs_sample = apgr_gain(a_point, a_boot, *random_apgr)
        out["apgr_gain_vs_random_sample"] = vs_sample["gain"]
        out["apgr_gain_vs_random_sample_ci95"] = vs_sample["ci95"]
    qe_b = weights @ _as_float(test.edge_good) / weights.sum(axis=1)
    qc_b = weights @ _as_float(test.cloud_good) / weights.sum(axis=1)
    qe_v, qc_v = float(np.mean(val.edge_good)), float(np.mean(val.cloud_good))
    targets: list[tuple[str, float, float | np.ndarray, float | np.ndarray]] = [
        (_target_key(t), t, t, t) for t in PGR_TARGETS
    ]
    test_q_target = pgr_for_quality(np.mean(test.edge_good), np.mean(test.cloud_good))
    targets.append(
        (
            "share_at_95pct_quality",
            float(pgr_for_quality(qe_v, qc_v)),
            float(test_q_target),
            pgr_for_quality(qe_b, qc_b),
        )
    )
    for key, val_target, test_target, boot_target in targets:
        entry: dict[str, Any] = {
            "test_curve": _r(cpt(point, test_target)[0]),
            "test_curve_ci95": _ci(cpt(boot, boot_target)),
        }
        threshold = float("nan")
        if name in val.confidences:  # the oracle has no threshold: it reads the labels
            threshold = threshold_for_pgr(val.confidences[name], val.edge_good, val.cloud_good, val_target)
        if not np.isnan(threshold):  # NaN: no gap on validation to choose a threshold by
            share, pgr, quality = routed_at(conf, test.edge_good, test.cloud_good, threshold)
            b_share, b_pgr, b_quality = routed_at(conf, test.edge_good, test.cloud_good, threshold, weights)
            entry |= {
                "threshold": _r(threshold, 6),
                "call_share": _r(share[0]),
                "call_share_ci95": _ci(b_share),
                "pgr": _r(pgr[0]),
                "pgr_ci95": _ci(b_pgr),
            }
            if key == "share_at_95pct_quality":
                qc = float(np.mean(test.cloud_good))
                entry["quality_ratio"] = _r(quality[0] / qc) if qc > 0 else None
                with np.errstate(invalid="ignore", divide="ignore"):
                    entry["quality_ratio_ci95"] = _ci(b_quality / qc_b)
        out[key] = entry
    grid = np.linspace(0.0, 1.0, 21)
    out["pgr_at_call_share"] = [_r(v) for v in np.interp(grid, point.call_share[0], point.pgr[0])]
    return out


def oracle_confidence(edge_good: np.ndarray, cloud_good: np.ndarray) -> np.ndarray:
    """The oracle router: sends first what the cloud fixes, keeps last what it would break."""
    return _as_float(edge_good) - _as_float(cloud_good)


def random_expected(edge_quality: float, cloud_quality: float) -> dict[str, Any]:
    """Random routing in expectation: PGR equals the call share (APGR 0.5, CPT(x) = x)."""
    x95 = float(pgr_for_quality(edge_quality, cloud_quality))
    out: dict[str, Any] = {"apgr": 0.5 if np.isfinite(x95) else None}
    for t in PGR_TARGETS:
        out[_target_key(t)] = {"call_share": t if np.isfinite(x95) else None}
    out["share_at_95pct_quality"] = {"call_share": _r(min(max(x95, 0.0), 1.0)) if np.isfinite(x95) else None}
    return out


def random_scores(n_val: int, n_test: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The seeded random router's confidences on each half (what ``evaluate_routers`` draws)."""
    rng = np.random.default_rng(seed)
    return rng.random(n_val), rng.random(n_test)


def evaluate_routers(val: Half, test: Half, *, resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> dict[str, Any]:
    """Every router of ``val``/``test`` (thresholds chosen on ``val``, measured on ``test``), a seeded random
    router (``random_sample``), random routing's expectation and the oracle on ``test``, each with 95 %
    bootstrap intervals from ``resamples`` resamples of the test items.
    """
    n_test = len(test.edge_good)
    val_random, test_random = random_scores(len(val.edge_good), n_test, seed)
    val = Half({**val.confidences, RANDOM_SAMPLE: val_random}, val.edge_good, val.cloud_good)
    test = Half(
        {**test.confidences, RANDOM_SAMPLE: test_random, ORACLE: oracle_confidence(test.edge_good, test.cloud_good)},
        test.edge_good,
        test.cloud_good,
    )
    weights = bootstrap_weights(n_test, resamples, seed)
    qe, qc = float(np.mean(test.edge_good)), float(np.mean(test.cloud_good))
    gap_b = weights @ (_as_float(test.cloud_good) - _as_float(test.edge_good)) / n_test
    sample = pgr_curves(test.confidences[RANDOM_SAMPLE], test.edge_good, test.cloud_good)
    random_apgr = (float(apgr(sample)[0]), apgr(pgr_curves(test_random, test.edge_good, test.cloud_good, weights)))
    routers = {
        name: _router_report(name, val, test, weights, random_apgr) for name in test.confidences if name != ORACLE
    }
    return {
        "edge_quality": _r(qe),
        "cloud_quality": _r(qc),
        "gap": _r(qc - qe),
        "gap_ci95": _ci(gap_b),
        "resamples": resamples,
        "resamples_without_gap": int(np.sum(gap_b <= _EPS)),
        "routers": routers,
        "random_expected": random_expected(qe, qc),
        "oracle": _router_report(ORACLE, val, test, weights, random_apgr),
    }

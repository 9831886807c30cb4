"""Calibration fits two learned routers and keeps the one that wins on validation: one trained to predict that the
edge agrees with the cloud, one on what escalating gains (``no_loss_target``). Where the edge is confidently wrong
on requests the cloud gets right (the demo LM pair on copyable text past its training length, docs/routing.md),
only the gain router sends those requests up first; it ships as signal ``router`` in an unchanged policy format,
and the exported rows' prompt-side copy signals are read as signals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from shared.calibration import calibrate, read_validation, validation_row
from shared.escalation import ROUTER, ROUTER_GAIN, EdgePolicy


def _rows(tmp_path: Path, n: int = 600, seed: int = 0) -> Path:
    """Three kinds of request: A both tiers right, the edge sure and the text not copyable-and-missed; B both wrong
    (different answers), the edge unsure; C only the cloud right, the edge sure but missing the copyable text."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        kind = rng.choice(["A", "B", "C"], p=[0.4, 0.3, 0.3])
        sure = kind != "B"
        signals = {
            "mean_logprob": float((-0.3 if sure else -2.5) + rng.normal(0, 0.3)),
            "min_margin": float(rng.random()),
            "norm_entropy": float(rng.random()),
            "prompt_novelty": float(rng.random()),
            "copy_kept": float((0.9 if kind == "A" else 0.3) + rng.normal(0, 0.1)),
        }
        row = validation_row(
            "tierline/lm-edge",
            signals,
            int(rng.integers(16, 500)),
            edge_good=kind == "A",
            cloud_good=kind != "B",
            agrees_with_cloud=kind == "A",
        )
        lines.append(json.dumps(row))
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_calibration_keeps_the_gain_router_when_it_wins(tmp_path: Path) -> None:
    data = read_validation(_rows(tmp_path), "lm-edge")
    assert {"prompt_novelty", "copy_kept"} <= set(data.signals)  # the copy signals are read from the rows
    policy, ranking = calibrate(data, 0.01)
    shares = {c.signal: c.edge_share for c in ranking}
    # The gain router keeps A and B on the device and sends C up (~70 %); the agreement router cannot tell B from
    # C (both disagree) and escalates B first, and no single signal separates C.
    assert shares[ROUTER_GAIN] > 0.6 and shares[ROUTER_GAIN] > shares[ROUTER] + 0.15, shares
    assert all(shares[ROUTER_GAIN] > shares[s] + 0.15 for s in shares if s != ROUTER_GAIN), shares
    assert policy.signal == ROUTER and policy.router is not None
    assert (
        policy.calibration is not None
        and policy.calibration["signals"][ROUTER_GAIN]["edge_share"] == shares[ROUTER_GAIN]
    )

    # The shipped policy (strict JSON round trip) decides on the rows as calibration measured.
    shipped = EdgePolicy.from_json(json.loads(json.dumps(policy.to_json())))
    assert data.prompt_tokens is not None
    table = {**data.signals, "prompt_tokens": data.prompt_tokens}
    rows = [{k: float(v[i]) for k, v in table.items()} for i in range(len(data))]
    local = np.array([not shipped.should_escalate(r) for r in rows])
    quality = np.where(local, data.edge_good, data.cloud_good).mean()
    assert quality >= data.cloud_good.mean() - 0.01 - 1e-9
    assert abs(local.mean() - shares[ROUTER_GAIN]) < 0.02

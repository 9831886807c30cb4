"""The acceptance check that the demo's LM policy keeps its promise live (issue 40): after ``tierline demo traffic``
has reached the ledger, ``tierline policies list --json`` puts the policy's promised edge share beside the live one
(``controlplane.policies.live``) and the live share lies within the stated tolerance of the promise:
``2 * sqrt(p (1 - p) (1 / n_cal + 1 / n_live)) + 0.05``. The traffic is of the calibration's kind: the demo
policy is calibrated on ``demo traffic``'s own generator (``bench cascade --tasks lm-traffic``)."""

from __future__ import annotations

import json
from typing import Any

from tests.forkserver import run_tierline

LM_POLICY = "tierline/lm-edge"


def lm_policy_keeps_its_promise(env: dict[str, str], summary: dict[str, Any]) -> dict[str, Any]:
    """Assert it for the traffic ``summary`` (``demo traffic --json``) once its usage is in the ledger; returns the
    live numbers (to print)."""
    proc = run_tierline("policies", "list", "--model", LM_POLICY, "--json", env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    newest = json.loads(proc.stdout)[0]
    live = newest["live"]
    # Every LM request of the traffic is counted: the ones the policy decided (all but quality-high) and the others
    # under their own reason (the window may hold a few more, sent before the traffic).
    lm = sum(n for kind in ("easy", "hard") for n in summary["by_kind"].get(kind, {}).values())
    high = summary["escalation_reasons"].get("quality-high", 0)
    assert live["decided_by_policy"] >= lm - high, (live, summary)
    assert live["by_reason"].get("quality-high", 0) >= high, (live, summary)
    assert live["promised_edge_share"] is not None and live["live_edge_share"] is not None, live
    gap = abs(live["live_edge_share"] - live["promised_edge_share"])
    assert live["within_promise"] is True and gap <= live["tolerance"], live
    return live

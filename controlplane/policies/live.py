"""A policy's promise beside what its devices did: the live edge share and the escalations per reason, from the
usage the devices and the cloud recorded (``usage_record``: tier, escalation reason, model).

- *Window*: the last ``WINDOW`` (15 minutes), from the newest policy version's creation at the earliest (traffic
  an older version decided is not this version's).
- *Requests*: the edge rows of the model's family (``tierline/lm-edge`` and its exports ``-onnx-int8``,
  ``-onnx``, ``-tflite``, ``-gguf``) and the escalations a device sent up to the model's cloud pair (cloud rows with
  a device and an escalation reason). Shadow replays (tier ``shadow``) are not requests.
- *Per reason*: ``edge`` (answered on the device, the policy kept it), ``low-confidence`` (the policy sent it up)
  and every other reason the agent gives before the policy is asked: ``quality-high`` (the request asked for the
  cloud), ``prompt-too-long``, ``max-tokens``, ``client-asked``, ``cloud-first``, ``cloud-feature``, a quota...
  An edge row with a reason was meant for the cloud but answered on the device because the cloud was unreachable:
  ``cloud-unreachable``.
- *Live edge share*: of the requests the policy decided (``edge`` plus ``low-confidence``), the share kept on the
  edge: what the calibration's ``edge_share`` promises. The others are the request's or the agent's decision, not
  the policy's, and are shown as their own reasons.
- *Tolerance*: the promise is an estimate on ``n_cal`` calibration items, the live share one on ``n_live``
  requests; ``tolerance = 2 * sqrt(p (1 - p) (1 / n_cal + 1 / n_live)) + 0.05`` around the promise ``p`` (two
  standard errors of the difference, plus 0.05 for the threshold chosen on the same items it is measured on; the
  variance's ``p`` is the promise with one item of each outcome added, so a 100 % promise has a spread too). The
  live share is *within the promise* when it lies inside; ``MIN_DECIDED`` requests before it is judged at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, func, or_
from sqlalchemy import select as sql_select
from sqlmodel import Session, col, select

from controlplane.storage.tables import EscalationPolicy, Model, UsageRecord

WINDOW = timedelta(minutes=15)
POLICY_REASON = "low-confidence"  # the one reason the policy gives
EDGE = "edge"
UNREACHABLE = "cloud-unreachable"
LOCAL_SUFFIXES = ("-onnx-int8", "-onnx", "-tflite", "-gguf")  # the exports an edge model is served as
SLACK = 0.05
MIN_DECIDED = 20


def tolerance(promised: float, n_cal: int, n_live: int) -> float:
    """How far a live edge share on ``n_live`` requests may lie from a promise measured on ``n_cal`` items. The
    variance takes the promise with one item of each outcome added (``(p n_cal + 1) / (n_cal + 2)``): a promise of
    100 % on n items is ~n / (n + 1) on new ones, not certain."""
    n_cal, n_live = max(n_cal, 1), max(n_live, 1)
    p = (min(max(promised, 0.0), 1.0) * n_cal + 1.0) / (n_cal + 2.0)
    return 2.0 * math.sqrt(p * (1.0 - p) * (1.0 / n_cal + 1.0 / n_live)) + SLACK


@dataclass(frozen=True, slots=True)
class LiveRate:
    """One model's policy: its promise and what the window's requests did."""

    model: str
    version: int | None
    since: datetime
    window_s: int
    promised: float | None  # the calibration's edge share
    calibration_items: int | None
    by_reason: dict[str, int] = field(default_factory=dict)  # ``edge`` and every escalation reason

    @property
    def total(self) -> int:
        return sum(self.by_reason.values())

    @property
    def decided(self) -> int:
        """Requests the policy decided: kept on the edge or sent up for low confidence."""
        return self.by_reason.get(EDGE, 0) + self.by_reason.get(POLICY_REASON, 0)

    @property
    def edge_share(self) -> float | None:
        return self.by_reason.get(EDGE, 0) / self.decided if self.decided else None

    @property
    def tolerance(self) -> float | None:
        if self.promised is None or not self.decided:
            return None
        return tolerance(self.promised, self.calibration_items or 0, self.decided)

    @property
    def within(self) -> bool | None:
        """Whether the live edge share keeps the promise (None: no promise, or too few requests to say)."""
        share, tol = self.edge_share, self.tolerance
        if share is None or tol is None or self.promised is None or self.decided < MIN_DECIDED:
            return None
        return abs(share - self.promised) <= tol

    def shares(self) -> list[tuple[str, int, float]]:
        """``(reason, requests, share of all requests)``, ``edge`` first, then by count."""
        total = self.total
        order = sorted(self.by_reason.items(), key=lambda kv: (kv[0] != EDGE, -kv[1], kv[0]))
        return [(reason, n, n / total if total else 0.0) for reason, n in order]

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "version": self.version,
            "since": self.since.isoformat(timespec="seconds"),
            "window_s": self.window_s,
            "promised_edge_share": self.promised,
            "calibration_items": self.calibration_items,
            "requests": self.total,
            "decided_by_policy": self.decided,
            "live_edge_share": self.edge_share,
            "tolerance": self.tolerance,
            "within_promise": self.within,
            "by_reason": dict(self.by_reason),
        }

    def line(self) -> str:
        """One line for the CLI: ``live (15 min): 81.0% on the edge of 120 decided (promised 84.5% ± 0.12) ...``."""
        minutes = round(self.window_s / 60)
        if not self.total:
            return f"live (last {minutes} min): no requests yet"
        share = "—" if self.edge_share is None else f"{self.edge_share:.1%}"
        head = f"live (last {minutes} min): {share} on the edge of {self.decided} the policy decided"
        if self.promised is not None and self.tolerance is not None:
            verdict = {True: "within", False: "OUTSIDE", None: "too few to judge"}[self.within]
            head += f" (promised {self.promised:.1%} ± {self.tolerance:.2f}: {verdict})"
        rest = ", ".join(f"{reason} {n} ({share:.0%})" for reason, n, share in self.shares())
        return f"{head}; {self.total} requests: {rest}"


def _family(model: str) -> list[str]:
    return [model, *(model + suffix for suffix in LOCAL_SUFFIXES)]


def _cloud_pair(session: Session, model: str) -> str | None:
    """The cloud model ``model``'s escalations go to: its registry pairing (by its last part, as the zoo names it)."""
    name = model.rsplit("/", 1)[-1]
    row = session.exec(select(Model).where(col(Model.name).in_([model, name]))).first()
    return row.cloud_model if row is not None else None


def live_rate(
    session: Session,
    model: str,
    *,
    window: timedelta = WINDOW,
    now: datetime | None = None,
    policy: EscalationPolicy | None = None,
) -> LiveRate:
    """``model``'s promise (its newest policy version, or ``policy``) and its requests over ``window``."""
    now = now or datetime.now(UTC)
    if policy is None:
        newest = select(EscalationPolicy).where(EscalationPolicy.model == model)
        policy = session.exec(newest.order_by(col(EscalationPolicy.version).desc())).first()
    since = now - window
    promised: float | None = None
    items: int | None = None
    if policy is not None:
        created = policy.created_at if policy.created_at.tzinfo else policy.created_at.replace(tzinfo=UTC)
        since = max(since, created)
        cal = policy.policy.get("calibration") or {}
        share = cal.get("edge_share")
        promised = float(share) if isinstance(share, int | float) else None
        items = int(cal["num_items"]) if isinstance(cal.get("num_items"), int) else policy.data_items
    edge_rows = (col(UsageRecord.tier) == "edge") & col(UsageRecord.model).in_(_family(model))
    where: ColumnElement[bool] = edge_rows
    pair = _cloud_pair(session, model)
    if pair is not None:
        escalated = (
            (col(UsageRecord.tier) == "cloud")
            & (col(UsageRecord.model) == pair)
            & col(UsageRecord.device_id).is_not(None)
            & col(UsageRecord.escalation_reason).is_not(None)
        )
        where = or_(edge_rows, escalated)
    query = (
        sql_select(col(UsageRecord.tier), col(UsageRecord.escalation_reason), func.count())
        .where(where, col(UsageRecord.occurred_at) >= since, col(UsageRecord.occurred_at) <= now)
        .group_by(col(UsageRecord.tier), col(UsageRecord.escalation_reason))
    )
    by_reason: dict[str, int] = {}
    for tier, reason, n in session.execute(query).all():
        key = EDGE if tier == "edge" and not reason else UNREACHABLE if tier == "edge" else str(reason)
        by_reason[key] = by_reason.get(key, 0) + int(n)
    return LiveRate(
        model=model,
        version=policy.version if policy is not None else None,
        since=since,
        window_s=int(window.total_seconds()),
        promised=promised,
        calibration_items=items,
        by_reason=by_reason,
    )

"""Calibrated escalation policies for the models pages: the control plane's versions (``escalation_policy``,
``tierline policies``), and the device-local JSON files ``tierline edge calibrate`` writes for a model the
registry has no policy of.

The files are read from ``TIERLINE_CONSOLE_POLICY_DIR``, by default ``$TIERLINE_DATA_DIR/edge/policies``:
where an edge agent on the same data directory (``tierline up``) keeps its overrides.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlmodel import Session

from console.pages.charts import CurveChart, quality_curve_chart
from controlplane.policies import live, service
from shared.errors import ConfigurationError
from shared.escalation import EdgePolicy, load_policy
from shared.settings import CoreSettings
from shared.targeting import describe

MAX_POLICIES = 50


class PolicySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TIERLINE_CONSOLE_", extra="ignore")

    policy_dir: Path | None = Field(
        None, description="calibrated escalation policies to draw (default $TIERLINE_DATA_DIR/edge/policies)"
    )


def policy_dir() -> Path:
    return PolicySettings().policy_dir or CoreSettings().data_dir / "edge" / "policies"


@dataclass(frozen=True, slots=True)
class PolicyView:
    """One policy file as the page shows it: the policy and its curve, or why it cannot be read."""

    model: str
    policy: EdgePolicy | None
    chart: CurveChart | None
    error: str = ""
    version: int | None = None  # the registry's version shown (None: a device-local file)
    target: str = ""  # the devices it goes to
    versions: tuple[dict[str, Any], ...] = ()  # the registry's versions, newest first (policy_json)
    live: live.LiveRate | None = None  # the newest version's promise beside what the devices did (registry only)

    @property
    def calibration(self) -> dict[str, Any]:
        return self.policy.calibration if self.policy else {}


def _chart(policy: EdgePolicy) -> CurveChart | None:
    cal = policy.calibration or {}
    return quality_curve_chart(
        cal.get("curve") or [],
        edge_share=cal.get("edge_share"),
        quality=cal.get("quality"),
        cloud_only_quality=cal.get("cloud_only_quality"),
        threshold=policy.threshold,
    )


def registry_view(session: Session, model: str) -> PolicyView | None:
    """The newest version of ``model``'s policy in the registry (full id or last part), with every version."""
    name = service.resolve_model(session, model)
    rows = service.versions_of(session, name)
    if not rows:
        return None
    latest = rows[0]
    try:
        policy = EdgePolicy.from_json(latest.policy)
    except ConfigurationError as exc:
        return PolicyView(name, None, None, exc.message, version=latest.version)
    return PolicyView(
        name,
        policy,
        _chart(policy),
        version=latest.version,
        target=describe(latest.target),
        versions=tuple({**service.policy_json(r), "target": describe(r.target)} for r in rows[:MAX_POLICIES]),
        live=live.live_rate(session, name, policy=latest),
    )


def registry_policies(session: Session) -> list[PolicyView]:
    return [v for m in service.models(session)[:MAX_POLICIES] if (v := registry_view(session, m)) is not None]


def _view(directory: Path, model: str) -> PolicyView | None:
    try:
        policy = load_policy(directory, model)
    except ConfigurationError as exc:
        return PolicyView(model, None, None, exc.message)
    if policy is None:
        return None
    cal = policy.calibration or {}
    chart = quality_curve_chart(
        cal.get("curve") or [],
        edge_share=cal.get("edge_share"),
        quality=cal.get("quality"),
        cloud_only_quality=cal.get("cloud_only_quality"),
        threshold=policy.threshold,
    )
    return PolicyView(policy.model, policy, chart)


def all_policies(directory: Path) -> list[PolicyView]:
    """Every policy in ``directory`` (one JSON file per model), by model name."""
    if not directory.is_dir():
        return []
    views = []
    for path in sorted(directory.glob("*.json"))[:MAX_POLICIES]:
        view = _view(directory, path.stem.replace("__", "/"))
        if view is not None:
            views.append(view)
    return views


def policy_for(directory: Path, model: str) -> PolicyView | None:
    """The policy of a registry model: named like it, or like it under a namespace (``tierline/<name>``)."""
    for view in all_policies(directory):
        if view.model == model or view.model.rsplit("/", 1)[-1] == model:
            return view
    return None

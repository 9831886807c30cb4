"""The live quality monitor in the console: per policy version and device group, how often the edge agreed with
the cloud on shadow samples against what the calibration promised; open alerts on the model page and the overview,
each with a proposed recalibrated threshold an admin accepts (the model's next policy version) or dismisses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from litestar import Request, post
from litestar.response import Redirect
from sqlalchemy.engine import Engine
from sqlmodel import Session

from console.auth import session_user
from console.pages.common import see_other, write_session
from controlplane.policies import monitor, service
from controlplane.registry.artifacts import platform_signing_key
from controlplane.storage.tables import QualityAlert


@dataclass(frozen=True, slots=True)
class QualityView:
    model: str
    groups: list[monitor.Agreement]
    alerts: list[QualityAlert]

    @property
    def open_alerts(self) -> list[QualityAlert]:
        return [a for a in self.alerts if a.status == monitor.OPEN]


def model_view(session: Session, name: str) -> QualityView | None:
    """The model page's monitor section (None: no shadow samples and no alerts yet)."""
    model = service.resolve_model(session, name)
    groups = monitor.agreement_table(session, model)
    alerts = monitor.alerts(session, model)
    if not groups and not alerts:
        return None
    for a in alerts:
        session.expunge(a)
    return QualityView(model, groups, alerts)


def open_alerts(db: Engine) -> list[dict[str, Any]]:
    """Every open alert, for the overview's banner."""
    with Session(db) as session:
        return [
            {**monitor.alert_json(a), "page": a.model.rsplit("/", 1)[-1]}
            for a in monitor.alerts(session, only_open=True)
        ]


@post("/models/{name:str}/quality-alerts/{alert_id:int}/accept", sync_to_thread=True)
def accept_alert(request: Request[Any, Any, Any], db: Engine, name: str, alert_id: int) -> Redirect:
    """The alert's proposed threshold becomes the model's next signed policy version (admins)."""
    user = session_user(request)
    with write_session(db) as session:
        monitor.accept(session, alert_id, actor=user.actor, key=platform_signing_key())
    return see_other(f"/models/{name}#quality")


@post("/models/{name:str}/quality-alerts/{alert_id:int}/dismiss", sync_to_thread=True)
def dismiss_alert(request: Request[Any, Any, Any], db: Engine, name: str, alert_id: int) -> Redirect:
    user = session_user(request)
    with write_session(db) as session:
        monitor.dismiss(session, alert_id, actor=user.actor)
    return see_other(f"/models/{name}#quality")


HANDLERS = [accept_alert, dismiss_alert]

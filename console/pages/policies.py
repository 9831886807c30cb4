"""Escalation policies from the model page: an admin moves the operating point (max quality loss, optionally for
a part of the fleet), which stores a new signed version read off the latest version's curve, or recalibrates on
the model's kept validation set."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from litestar import Request, post
from litestar.response import Redirect, Template
from sqlalchemy.engine import Engine

from console.auth import session_user
from console.pages.common import Form, optional_float, see_other, text, write_session
from console.pages.models import detail_page
from controlplane.policies import service
from controlplane.registry.artifacts import platform_signing_key
from shared.errors import ApplicationError, ValidationError


def target_terms(value: str) -> list[str] | None:
    """``ring=beta, device.memory_mb>=2048`` as terms; an empty field keeps the latest version's target."""
    terms = [t.strip() for t in value.split(",") if t.strip()]
    return terms or None


def _new_version(
    request: Request[Any, Any, Any], db: Engine, name: str, data: Form, make: Callable[..., Any]
) -> Template | Redirect:
    """A new policy version of ``name`` made by ``make`` (the service's move or calibrate) from the form's max
    quality loss and target; the model page again with the error under the form when refused."""
    user = session_user(request)
    try:
        loss = optional_float(data, "max_quality_loss", minimum=0.0, maximum=1.0)
        if loss is None:
            raise ValidationError("max_quality_loss: a number from 0 to 1", param="max_quality_loss")
        target = target_terms(text(data, "target", max_length=1000))
        with write_session(db) as session:
            make(session, name, max_quality_loss=loss, target=target, actor=user.actor, key=platform_signing_key())
    except ApplicationError as exc:
        return detail_page(request, db, name, policy_error=exc.message, status_code=exc.status_code)
    return see_other(f"/models/{name}#escalation")


@post("/models/{name:str}/policy", sync_to_thread=True)
def move_operating_point(request: Request[Any, Any, Any], db: Engine, name: str, data: Form) -> Template | Redirect:
    """A new policy version at another max quality loss (admins: a viewer's change is refused before this runs)."""
    return _new_version(request, db, name, data, service.move_operating_point)


@post("/models/{name:str}/policy/calibrate", sync_to_thread=True)
def recalibrate(request: Request[Any, Any, Any], db: Engine, name: str, data: Form) -> Template | Redirect:
    """Calibrate again on the model's kept validation set (a new version; admins)."""
    return _new_version(request, db, name, data, service.calibrate)


HANDLERS = [move_operating_point, recalibrate]

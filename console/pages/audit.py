"""Audit log: every change, newest first, with who made it and the record before and after."""

from __future__ import annotations

from typing import Any

from litestar import Request, get
from litestar.response import Template
from sqlalchemy import func, or_
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from console.pages.common import like, paginate, render
from controlplane.storage.tables import AuditLog


@get("/audit", sync_to_thread=True)
def audit_log(request: Request[Any, Any, Any], db: Engine, q: str = "", page: int = 1) -> Template:
    """``q`` searches actor, action and target."""
    q = q.strip()[:128]
    query = select(AuditLog).order_by(col(AuditLog.id).desc())
    if q:
        pattern = like(q)
        query = query.where(
            or_(
                func.lower(AuditLog.actor).like(pattern, escape="\\"),
                func.lower(AuditLog.action).like(pattern, escape="\\"),
                func.lower(AuditLog.target).like(pattern, escape="\\"),
            )
        )
    with Session(db) as session:
        rows, info = paginate(session, query, page, {"q": q}, size=50)
    return render(request, "audit.html.j2", rows=rows, page=info, q=q)


HANDLERS = [audit_log]

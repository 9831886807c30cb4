"""The audit log's one writer: who changed what, before and after, from the console, its API or the CLI."""

from __future__ import annotations

import getpass
from typing import Any

from sqlmodel import Session

from controlplane.storage.tables import AuditLog


def audit(
    session: Session,
    actor: str,
    action: str,
    target: str,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
) -> None:
    """One audit_log row in the caller's transaction: who, what, before and after (now is when). Never secrets."""
    session.add(AuditLog(actor=actor[:128], action=action, target=target[:256], before=before, after=after))


def cli_actor() -> str:
    """The actor of a change made from the CLI: ``cli:<os user>``."""
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):  # no passwd entry (containers)
        return "cli"

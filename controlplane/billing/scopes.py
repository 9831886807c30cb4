"""Budgets below the tenant: per API key, per project (a named group of keys), per end user, and the tenant's own
per day or in total; each per day, per calendar month (UTC) or in total, hard (refuses) or soft (counts).

A request is held against every budget that applies to it (``applicable``), in one transaction with the tenant's
monthly budget (``controlplane.billing.budgets.reserve``). Each budget's spend lives in a ``budget_window`` row per
window (the day, the month, or ``total``), and per end user when the budget is every end user's (``ref`` ``*``).

A device's traffic is attributed by its enrollment token's ``billing.*`` labels (``attribution_of``), which only
the operator sets: ``billing.key``, ``billing.project``, ``billing.user`` (its default end user) and
``billing.subjects=any`` (its requests may name other end users, with ``x-tierline-subject`` or ``user``).
``device_end_user`` is the one rule for whose end-user budgets a device's request counts against.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from sqlalchemy import or_
from sqlmodel import Session, col, select

from controlplane.storage.tables import ApiKey, Budget, BudgetWindow, Device, Project
from controlplane.storage.types import as_utc
from shared.errors import ValidationError

SCOPES = ("tenant", "key", "project", "user")
PERIODS = ("day", "month", "total")
EVERY_USER = "*"
MAX_SUBJECT_LEN = 256

# A device's billing attribution: labels its enrollment token gives it (an operator's choice, never the device's).
KEY_LABEL, PROJECT_LABEL, USER_LABEL = "billing.key", "billing.project", "billing.user"
SUBJECTS_LABEL, ANY_SUBJECT = "billing.subjects", "any"  # billing.subjects=any: requests may name their end user
ATTRIBUTION_LABELS = (KEY_LABEL, PROJECT_LABEL, USER_LABEL, SUBJECTS_LABEL)


@dataclass(frozen=True, slots=True)
class ScopedWindow:
    """One budget's window a request is held against: where its spend is counted and what limits it."""

    budget_id: int
    subject: str
    window: str
    limit: Decimal
    is_hard: bool
    label: str

    @property
    def key(self) -> tuple[int, str, str]:
        return (self.budget_id, self.subject, self.window)


def window_of(period: str, at: datetime) -> str:
    """The window of ``at`` for a budget of ``period``: ``YYYY-MM-DD``, ``YYYY-MM`` (UTC) or ``total``."""
    if period == "day":
        return as_utc(at).strftime("%Y-%m-%d")
    if period == "month":
        return as_utc(at).strftime("%Y-%m")
    return "total"


def describe(budget: Budget, project_name: str | None = None, subject: str = "") -> str:
    """How a budget is named in a 429 and in the console: ``the daily budget of API key 12``."""
    adjective = {"day": "daily", "month": "monthly", "total": "total"}[budget.period]
    owner = {
        "tenant": "the tenant",
        "key": f"API key {budget.ref}",
        "project": f"project '{project_name or budget.ref}'",
        "user": f"end user '{subject or budget.ref}'",
    }[budget.scope]
    return f"the {adjective} budget of {owner}"


def applicable(
    session: Session,
    tenant_id: int,
    at: datetime,
    *,
    key_id: int | None = None,
    project_id: int | None = None,
    subject: str | None = None,
) -> list[ScopedWindow]:
    """The budget windows a request of this tenant, key, project and end user counts against, in lock order."""
    scopes = [col(Budget.scope) == "tenant"]
    if key_id is not None:
        scopes.append((col(Budget.scope) == "key") & (col(Budget.ref) == str(key_id)))
    if project_id is not None:
        scopes.append((col(Budget.scope) == "project") & (col(Budget.ref) == str(project_id)))
    if subject:
        scopes.append((col(Budget.scope) == "user") & col(Budget.ref).in_([subject, EVERY_USER]))
    query = select(Budget, Project.name).where(col(Budget.tenant_id) == tenant_id, or_(*scopes))
    # The project's name (for the budget's label) in the same query: a request pays one query here, not two.
    is_project = (col(Budget.scope) == "project") & (col(Project.id) == (project_id or 0))
    rows = session.exec(query.outerjoin(Project, is_project)).all()
    if not rows:
        return []
    names = {b.ref: name for b, name in rows if name is not None}
    windows = []
    for b, _ in rows:
        per_user = b.scope == "user" and b.ref == EVERY_USER
        who = (subject or "") if per_user else ""
        windows.append(
            ScopedWindow(
                budget_id=b.id or 0,
                subject=who,
                window=window_of(b.period, at),
                limit=b.amount,
                is_hard=b.is_hard,
                label=describe(b, names.get(b.ref), who),
            )
        )
    return sorted(windows, key=lambda w: w.key)


def remaining_in(session: Session, window: ScopedWindow) -> Decimal:
    """What is left of one window now: its limit minus settled spend and open reservations, never below 0."""
    row = session.get(BudgetWindow, window.key)
    used = (row.spent + row.reserved) if row is not None else Decimal(0)
    return max(Decimal(0), window.limit - used)


@dataclass(frozen=True, slots=True)
class Attribution:
    """Whose budgets a device's traffic counts against below its tenant: an API key (and so the key's project),
    a project, an end user. Empty: the tenant's budgets only."""

    key_id: int | None = None
    project_id: int | None = None
    subject: str | None = None
    may_name_subjects: bool = False  # a device's requests may name an end user other than ``subject``


@dataclass(frozen=True, slots=True)
class EndUser:
    """Whose end-user budgets a device's request counts against, and whether the request named someone else."""

    subject: str | None
    is_refused: bool = False  # the request named an end user its device may not name: ``subject`` is the default

    def refusal(self, param: str) -> str:
        """Why a request naming another end user is refused, naming ``param`` (what named it)."""
        own = f"its own end user '{self.subject}'" if self.subject else "no end user (the tenant's budgets only)"
        return (
            f"{param}: this device may not name an end user: its requests count against {own}; to let them name "
            f"others, enroll it with a token labelled {SUBJECTS_LABEL}={ANY_SUBJECT}"
        )


def device_end_user(attribution: Attribution | None, named: str | None) -> EndUser:
    """The end user a device's request counts against: the one it names (``x-tierline-subject``, else its ``user``)
    if its enrollment allows (``billing.subjects=any``) or it names the device's own ``billing.user``; otherwise the
    device's ``billing.user`` (none: the tenant's budgets only), refused.

    The one rule for a device's traffic: the cloud refuses an escalation that names someone else (403) and books
    a synced record that does to the default (an outbox must drain); an agent that knows the rule (its sync's
    ``config["end_users"]``, ``end_users_config``) refuses such a request itself (400)."""
    who = attribution or Attribution()
    if not named or named == who.subject or who.may_name_subjects:
        return EndUser(named or who.subject)
    return EndUser(who.subject, is_refused=True)


def end_users_config(attribution: Attribution) -> dict[str, object]:
    """What an agent is told of ``device_end_user``'s rule at sync (``SyncResponse.config["end_users"]``)."""
    return {"default": attribution.subject, "may_name_others": attribution.may_name_subjects}


def check_attribution(session: Session, tenant_id: int, labels: dict[str, str]) -> Attribution:
    """The attribution the ``billing.*`` labels of an enrollment token name, checked against the tenant's keys and
    projects; ``ValidationError`` naming the label when one does not fit."""
    key_id = project_id = None
    if KEY_LABEL in labels:
        raw = labels[KEY_LABEL].strip()
        key = session.get(ApiKey, int(raw)) if raw.isascii() and raw.isdigit() and len(raw) < 10 else None
        if key is None or key.tenant_id != tenant_id:
            raise ValidationError(f"labels: {KEY_LABEL}={raw!r} is not an API key id of this tenant", param="labels")
        key_id, project_id = key.id, key.project_id
    if PROJECT_LABEL in labels:
        raw = labels[PROJECT_LABEL].strip()
        stmt = select(Project).where(col(Project.tenant_id) == tenant_id)
        project = session.exec(stmt.where(col(Project.name) == raw)).first()
        if project is None and raw.isascii() and raw.isdigit() and len(raw) < 10:
            project = session.exec(stmt.where(col(Project.id) == int(raw))).first()
        if project is None:
            raise ValidationError(f"labels: {PROJECT_LABEL}={raw!r} is not a project of this tenant", param="labels")
        if key_id is not None and project.id != project_id:
            raise ValidationError(
                f"labels: {KEY_LABEL} and {PROJECT_LABEL} disagree (the key is not in project {raw!r})", param="labels"
            )
        project_id = project.id
    subject = labels.get(USER_LABEL)
    if subject is not None and not (0 < len(subject) <= MAX_SUBJECT_LEN and subject != EVERY_USER):
        raise ValidationError(f"labels: {USER_LABEL} must be an end user id of 1 to 256 characters", param="labels")
    subjects = labels.get(SUBJECTS_LABEL)
    if subjects is not None and subjects != ANY_SUBJECT:
        raise ValidationError(
            f"labels: {SUBJECTS_LABEL}={subjects!r}: the only value is '{ANY_SUBJECT}' (requests may name any end "
            "user); leave it out to hold the device's requests to its billing.user",
            param="labels",
        )
    return Attribution(key_id, project_id, subject, subjects == ANY_SUBJECT)


def attribution_of(session: Session, device: Device) -> Attribution:
    """A device's attribution now: its key's current project (a key may move between projects), else its project
    label. A key or project deleted since enrollment no longer applies (the tenant's budgets still do)."""
    labels = device.labels or {}
    if not any(name in labels for name in ATTRIBUTION_LABELS):
        return Attribution()
    key_id = project_id = None
    raw_key = labels.get(KEY_LABEL, "")
    if raw_key.isascii() and raw_key.isdigit() and len(raw_key) < 10:
        key = session.get(ApiKey, int(raw_key))
        if key is not None and key.tenant_id == device.tenant_id:
            key_id, project_id = key.id, key.project_id
    raw_project = labels.get(PROJECT_LABEL)
    if project_id is None and raw_project:
        stmt = select(Project.id).where(col(Project.tenant_id) == device.tenant_id)
        found = session.exec(stmt.where(col(Project.name) == raw_project)).first()
        if found is None and raw_project.isascii() and raw_project.isdigit() and len(raw_project) < 10:
            found = session.exec(stmt.where(col(Project.id) == int(raw_project))).first()
        project_id = found
    return Attribution(key_id, project_id, labels.get(USER_LABEL) or None, labels.get(SUBJECTS_LABEL) == ANY_SUBJECT)

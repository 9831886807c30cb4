"""Prepaid credit: a tenant's balance as append-only ledger entries (top-ups +, draws -), drawn down as usage
settles.

A tenant with a credit account is **prepaid**. A request is held on its available credit (balance minus what
requests in flight hold) when that covers the request's worst case; when it does not, the tenant's monthly
budget applies as for any tenant, and a prepaid tenant with no monthly budget is refused: credit at zero means
no more service until a top-up. Settling draws the actual cost from the balance (one ``draw`` entry per request);
edge usage arriving at sync draws what is available and counts the rest against the month.

``credit_account.balance`` is always the sum of the tenant's entries: both change in one transaction, and only
here. Entries are never edited.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import BigInteger, func, insert, literal, update
from sqlmodel import Session, SQLModel, col, select

from controlplane.storage.audit import audit
from controlplane.storage.tables import CreditAccount, CreditEntry, Tenant
from controlplane.storage.types import from_micros, to_micros
from shared.errors import NotFoundError, ValidationError

TOP_UP = "top_up"
DRAW = "draw"

HELD, SHORT, NO_ACCOUNT = "held", "short", "none"


def _micros(amount: Decimal) -> Any:
    return literal(to_micros(amount), BigInteger)


def insert_row(session: Session, row: SQLModel) -> None:
    """INSERT one new row in the caller's transaction, now and without the ORM's unit of work (the hot path's
    rows are written once and never read back through the session)."""
    values = row.model_dump()
    if values.get("id") is None:
        values.pop("id", None)  # autoincrement
    session.connection().execute(insert(type(row)), [values])


def hold(session: Session, tenant_id: int, amount: Decimal) -> str:
    """Hold ``amount`` of the tenant's available credit, in the caller's transaction: ``HELD``, ``SHORT`` (a
    prepaid tenant whose available credit cannot cover it) or ``NO_ACCOUNT`` (not prepaid)."""
    available = col(CreditAccount.balance) - col(CreditAccount.reserved)
    result = session.connection().execute(
        update(CreditAccount)
        .where(col(CreditAccount.tenant_id) == tenant_id, available >= _micros(amount))
        .values(reserved=col(CreditAccount.reserved) + _micros(amount))
    )
    if result.rowcount == 1:
        return HELD
    return SHORT if session.get(CreditAccount, tenant_id) is not None else NO_ACCOUNT


def available(session: Session, tenant_id: int) -> Decimal | None:
    """Balance minus holds, never below 0; None when the tenant is not prepaid."""
    account = session.get(CreditAccount, tenant_id)
    return None if account is None else max(Decimal(0), account.balance - account.reserved)


def release(session: Session, tenant_id: int, amount: Decimal) -> None:
    """Give back a hold without drawing (a reservation whose process died)."""
    session.execute(
        update(CreditAccount)
        .where(col(CreditAccount.tenant_id) == tenant_id)
        .values(reserved=col(CreditAccount.reserved) - _micros(amount))
    )


def draw(
    session: Session, tenant_id: int, cost: Decimal, period: str, reference: str, *, held: Decimal = Decimal(0)
) -> Decimal:
    """Release ``held`` and draw ``cost`` from the balance, in the caller's transaction; what was drawn.

    A request drawing on its own hold draws all of it. Without a hold (edge usage, or a hold the sweeper already
    released), only the credit no other request holds is drawn; the caller counts the rest against the month.
    """
    # The first UPDATE takes the row's lock (PostgreSQL) or the database's (SQLite), so the read below is current.
    locked = session.connection().execute(
        update(CreditAccount)
        .where(col(CreditAccount.tenant_id) == tenant_id)
        .values(reserved=col(CreditAccount.reserved) - _micros(held))
    )
    if locked.rowcount != 1:
        return Decimal(0)
    # Columns, not the entity: read from the row now, whatever the session's identity map holds.
    balance, reserved = (
        session.connection()
        .execute(
            select(col(CreditAccount.balance), col(CreditAccount.reserved)).where(
                col(CreditAccount.tenant_id) == tenant_id
            )
        )
        .one()
    )
    free = balance if held else balance - reserved
    drawn = max(Decimal(0), min(cost, free))
    if drawn:
        session.connection().execute(
            update(CreditAccount)
            .where(col(CreditAccount.tenant_id) == tenant_id)
            .values(balance=col(CreditAccount.balance) - _micros(drawn))
        )
        entry = CreditEntry(tenant_id=tenant_id, kind=DRAW, amount=-drawn, period=period, reference=reference)
        insert_row(session, entry)
    return drawn


def top_up(session: Session, tenant: Tenant, amount: Decimal, *, note: str, actor: str) -> CreditEntry:
    """Add prepaid credit (the tenant becomes prepaid if it was not). Caller commits."""
    if amount <= 0:
        raise ValidationError("amount: a top-up must be positive", param="amount")
    if len(note) > 500:
        raise ValidationError("note: at most 500 characters", param="note")
    tenant_id = tenant.id or 0
    account = session.get(CreditAccount, tenant_id)
    if account is None:
        session.add(CreditAccount(tenant_id=tenant_id))
        session.flush()
    session.execute(
        update(CreditAccount)
        .where(col(CreditAccount.tenant_id) == tenant_id)
        .values(balance=col(CreditAccount.balance) + _micros(amount))
    )
    # Above the low-balance line again: the next fall below it alerts anew.
    session.execute(
        update(CreditAccount)
        .where(
            col(CreditAccount.tenant_id) == tenant_id,
            col(CreditAccount.low_balance).is_not(None),
            col(CreditAccount.balance) >= col(CreditAccount.low_balance),
        )
        .values(low_alerted_at=None)
    )
    now = datetime.now(UTC)
    entry = CreditEntry(
        tenant_id=tenant_id, kind=TOP_UP, amount=amount, period=now.strftime("%Y-%m"), note=note, created_by=actor[:128]
    )
    session.add(entry)
    session.flush()
    audit(session, actor, "credit.top_up", f"tenant/{tenant_id}", None, {"amount": str(amount), "note": note})
    return entry


def set_low_balance(session: Session, tenant: Tenant, threshold: Decimal | None, *, actor: str) -> CreditAccount:
    """Alert (webhook ``credit.low_balance``, console) when the balance falls below ``threshold`` (None: never)."""
    account = session.get(CreditAccount, tenant.id or 0)
    if account is None:
        raise NotFoundError(f"tenant {tenant.name!r} has no prepaid credit; top it up first", param="tenant")
    before = {"low_balance": None if account.low_balance is None else str(account.low_balance)}
    account.low_balance = threshold
    account.low_alerted_at = None
    session.add(account)
    after = {"low_balance": None if threshold is None else str(threshold)}
    audit(session, actor, "credit.low_balance", f"tenant/{tenant.id}", before, after)
    return account


def claim_low_alert(session: Session, tenant_id: int) -> CreditAccount | None:
    """Mark the low-balance alert fired when the balance is below the line and it has not fired since the last
    top-up; the account when this call fired it (once, whatever replicas race), else None.

    Called after every request that drew credit: a read decides first, so the usual answer (not low, or told
    already) takes no write lock (on SQLite, one writer at a time: a lock per request costs the others waits)."""
    account = session.get(CreditAccount, tenant_id)
    if (
        account is None
        or account.low_balance is None
        or account.low_alerted_at is not None
        or account.balance >= account.low_balance
    ):
        return None
    fired = session.connection().execute(
        update(CreditAccount)
        .where(
            col(CreditAccount.tenant_id) == tenant_id,
            col(CreditAccount.low_balance).is_not(None),
            col(CreditAccount.balance) < col(CreditAccount.low_balance),
            col(CreditAccount.low_alerted_at).is_(None),
        )
        .values(low_alerted_at=datetime.now(UTC))
    )
    if fired.rowcount != 1:
        return None  # another replica fired it (or a top-up came) meanwhile
    session.refresh(account)
    return account


def credit_used(session: Session, tenant_id: int, period: str) -> Decimal:
    """Prepaid credit drawn by the usage of ``period`` (a positive amount)."""
    total = session.exec(
        select(func.coalesce(func.sum(col(CreditEntry.amount)), 0)).where(
            col(CreditEntry.tenant_id) == tenant_id, col(CreditEntry.kind) == DRAW, col(CreditEntry.period) == period
        )
    ).one()
    return -Decimal(total) if isinstance(total, Decimal) else -from_micros(int(total))


def is_low(account: CreditAccount) -> bool:
    return account.low_balance is not None and account.balance < account.low_balance


def credit_view(session: Session, tenant: Tenant, limit: int = 50) -> dict[str, Any]:
    """The tenant's credit: balance, holds, the low-balance line and its latest entries (newest first)."""
    account = session.get(CreditAccount, tenant.id or 0)
    entries = session.exec(
        select(CreditEntry)
        .where(col(CreditEntry.tenant_id) == tenant.id)
        .order_by(col(CreditEntry.id).desc())
        .limit(limit)
    ).all()
    return {
        "object": "credit",
        "tenant": tenant.name,
        "currency": tenant.currency,
        "is_prepaid": account is not None,
        "balance": str(account.balance) if account else "0",
        "reserved": str(account.reserved) if account else "0",
        "low_balance": str(account.low_balance) if account and account.low_balance is not None else None,
        "is_low": bool(account and is_low(account)),
        "entries": [
            {
                "id": e.id,
                "kind": e.kind,
                "amount": str(e.amount),
                "period": e.period,
                "reference": e.reference,
                "note": e.note,
                "created_by": e.created_by,
                "created_at": e.created_at.isoformat(),
            }
            for e in entries
        ],
    }

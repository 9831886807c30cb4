"""Invoices and the price book in the database: draft, finalize, void, credit notes; add and list prices.

A **draft** is computed live from the ledger and never stored: it shows what finalizing now would bill. To
**finalize** a month is one transaction that holds the tenant's lock (every invoice change of a tenant is
serialized), stores the invoice, stamps ``usage_record.invoice_id`` on every record it bills, then builds the
lines from exactly the stamped records (amounts locked, sha256 of the canonical lines stored, a number
assigned). A record is billed exactly once:

* a record of the invoiced month is billed by that month's invoice;
* a late record (one whose month already has a finalized invoice when it arrives) is billed by the *next*
  invoice finalized for the tenant, as an ``adjustment`` line for its own month;
* **voiding** clears the stamps, so whatever invoice is finalized next for that month (or the next month,
  for the adjustments it carried) bills those records again.

**Credit notes** correct a finalized invoice without changing it: their sum (``credits``) never exceeds the
invoice's total, and ``balance = total - credits`` is what the tenant owes.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal, InvalidOperation
from typing import Any

from sqlalchemy import and_, or_, update
from sqlalchemy import select as sql_select
from sqlalchemy.sql.elements import ColumnElement
from sqlmodel import Session, col, select

from controlplane.billing import credit as prepaid
from controlplane.billing import invoices, plans
from controlplane.billing.ledger import cost_total, token_sums, unpriced_count, utc_format
from controlplane.billing.plans import price_json
from controlplane.billing.pricing import DEFAULT_PLAN, parse_period, period_bounds
from controlplane.storage.tables import (
    AuditLog,
    CreditNote,
    Invoice,
    InvoiceLine,
    Price,
    PricePlan,
    Tenant,
    UsageRecord,
)
from controlplane.storage.types import as_utc, from_micros, to_micros
from shared.errors import ConflictError, NotFoundError, ValidationError

FINALIZED = "finalized"
VOID = "void"


def resolve_tenant(session: Session, name_or_id: str) -> Tenant:
    """A tenant by name, or by id when the text is all digits."""
    tenant = None
    if _is_printable(name_or_id):
        tenant = session.exec(select(Tenant).where(Tenant.name == name_or_id)).first()
    if tenant is None and name_or_id.isascii() and name_or_id.isdigit() and int(name_or_id) < 2**31:
        tenant = session.get(Tenant, int(name_or_id))
    if tenant is None:
        raise NotFoundError(f"no tenant {name_or_id!r}", param="tenant")
    return tenant


def _is_printable(text: str) -> bool:
    """No control characters (PostgreSQL refuses NUL in text; no name or number has any)."""
    return text.isprintable()


def month(text: str, param: str = "month") -> str:
    try:
        return parse_period(text)
    except ValueError as exc:
        raise ValidationError(f"{param}: {exc}", param=param) from None


def _lock_tenant(session: Session, tenant_id: int) -> None:
    """Serialize invoice changes per tenant: a no-op UPDATE holds the row's lock (the database's on SQLite)."""
    session.execute(update(Tenant).where(col(Tenant.id) == tenant_id).values(name=col(Tenant.name)))


def _audit(session: Session, actor: str, action: str, target: str, after: dict[str, Any]) -> None:
    session.add(AuditLog(actor=actor[:128], action=action, target=target, after=after))


# --- building lines from the ledger -----------------------------------------------------------------------------


def _usage_totals(session: Session, *where: ColumnElement[bool]) -> list[invoices.UsageTotals]:
    period = utc_format(session, col(UsageRecord.occurred_at), "month")
    keys: tuple[Any, ...] = (
        period,
        col(UsageRecord.model),
        col(UsageRecord.model_version),
        col(UsageRecord.tier),
        col(Price.currency),
        col(UsageRecord.price_id),
    )
    query = (
        sql_select(*keys, *token_sums(), cost_total(), unpriced_count())
        .select_from(UsageRecord)
        .outerjoin(Price, col(Price.id) == col(UsageRecord.price_id))
        .where(*where)
        .group_by(*keys)
    )
    rows = session.execute(query).all()
    labels = _price_labels(session, {row[5] for row in rows if row[5] is not None})
    return [
        invoices.UsageTotals(
            usage_period=str(p),
            model=m,
            model_version=v,
            tier=t,
            requests=int(n),
            prompt_tokens=int(pt),
            completion_tokens=int(ct),
            cached_prompt_tokens=int(cc),
            unpriced_records=int(unpriced),
            cost=amount,
            currency=currency,
            price=labels.get(price_id) if price_id is not None else None,
        )
        for p, m, v, t, currency, price_id, n, pt, ct, cc, amount, unpriced in rows
    ]


def _plain(amount: Decimal) -> str:
    """``0.500000`` -> ``0.5``, ``1E+3`` -> ``1000``: the same text on SQLite and PostgreSQL."""
    return f"{Decimal(amount).normalize():f}"


def _price_labels(session: Session, price_ids: set[int]) -> dict[int, str]:
    """How each price shows on an invoice line: its rates, its plan (or the tenant's override), its start."""
    if not price_ids:
        return {}
    names = {p.id: p.name for p in session.exec(select(PricePlan))}
    labels = {}
    for p in session.exec(select(Price).where(col(Price.id).in_(sorted(price_ids)))):
        rates = "/".join(_plain(x) for x in (p.prompt_per_mtok, p.completion_per_mtok, p.cached_per_mtok))
        text = f"{rates} per Mtok prompt/completion/cached"
        if p.per_call:
            text += f" + {_plain(p.per_call)} per call"
        if p.per_row:
            text += f" + {_plain(p.per_row)} per row"
        owner = "tenant override" if p.tenant_id is not None else f"plan {names.get(p.plan_id, DEFAULT_PLAN)}"
        labels[p.id or 0] = f"{text} ({owner}, from {as_utc(p.effective_from):%Y-%m-%d %H:%M} UTC)"
    return labels


def _closed_periods(session: Session, tenant_id: int, before: str) -> list[str]:
    query = select(Invoice.period).where(
        Invoice.tenant_id == tenant_id, Invoice.status == FINALIZED, col(Invoice.period) < before
    )
    return sorted(set(session.exec(query).all()))


def _billable(session: Session, tenant: Tenant, period: str) -> ColumnElement[bool]:
    """Unbilled records of ``period``, and late ones of earlier months that already have an invoice."""
    ranges = [period_bounds(p) for p in (*_closed_periods(session, tenant.id or 0, period), period)]
    at = col(UsageRecord.occurred_at)
    return and_(
        col(UsageRecord.tenant_id) == tenant.id,
        col(UsageRecord.invoice_id).is_(None),
        or_(*(and_(at >= start, at < end) for start, end in ranges)),
    )


def _lines(
    session: Session, tenant: Tenant, period: str, where: ColumnElement[bool]
) -> tuple[list[invoices.Line], tuple[Decimal, Decimal]]:
    """The lines of the records ``where`` selects, and their exact sums (the month's own, late ones), from one
    read of the ledger: the lines and the exact figures they round always describe the same records."""
    totals = _usage_totals(session, where)
    try:
        return invoices.build_lines(totals, period, tenant.currency), invoices.exact_sums(totals, period)
    except invoices.CurrencyMismatchError as exc:
        raise ConflictError(f"{exc}; fix the price book, then invoice", param="currency") from None


def exact_billed(session: Session, invoice: Invoice) -> tuple[Decimal, Decimal]:
    """A stored invoice's exact sums (its month's own records, late ones) from the records stamped with it."""
    period = utc_format(session, col(UsageRecord.occurred_at), "month")
    query = sql_select(period, cost_total()).where(col(UsageRecord.invoice_id) == invoice.id).group_by(period)
    own = late = Decimal(0)
    for month_, amount in session.execute(query).all():
        if str(month_) == invoice.period:
            own += amount
        else:
            late += amount
    return own, late


# --- views ------------------------------------------------------------------------------------------------------


def _stored_lines(session: Session, invoice_id: int, currency: str) -> list[invoices.Line]:
    rows = session.exec(select(InvoiceLine).where(InvoiceLine.invoice_id == invoice_id).order_by(col(InvoiceLine.id)))
    return [
        invoices.Line(
            kind=r.kind,
            usage_period=r.usage_period,
            model=r.model,
            model_version=r.model_version,
            tier=r.tier,
            requests=r.requests,
            prompt_tokens=r.prompt_tokens,
            completion_tokens=r.completion_tokens,
            cached_prompt_tokens=r.cached_prompt_tokens,
            unpriced_records=r.unpriced_records,
            amount=invoices.round_line(r.amount, currency),
            description=r.description,
        )
        for r in rows
    ]


def _iso(ts: datetime | None) -> str | None:
    return None if ts is None else ts.isoformat()


def _exact(amount: Decimal) -> str:
    """An exact ledger sum as text at the ledger's scale (micros), the same on SQLite and PostgreSQL."""
    return str(from_micros(to_micros(amount)))


def _view(
    tenant: Tenant,
    period: str,
    lines: list[invoices.Line],
    invoice: Invoice | None,
    notes: list[CreditNote],
    exact: tuple[Decimal, Decimal],
) -> dict[str, Any]:
    currency = invoice.currency if invoice is not None else tenant.currency
    sums = invoices.amounts(lines, currency)
    credits = invoices.round_line(sum((n.amount for n in notes), Decimal(0)), currency)
    return {
        "object": "invoice",
        "number": invoice.number if invoice else None,
        "status": invoice.status if invoice else "draft",
        "tenant": tenant.name,
        "tenant_id": tenant.id,
        "period": period,
        "currency": currency,
        "subtotal": str(sums.subtotal),
        "adjustments": str(sums.adjustments),
        "rounding": str(sums.rounding),
        "total": str(sums.total),
        # The ledger's exact figures the amounts round: ``usage_exact`` is the month's own usage (shadow replays
        # included), the tenant page's and billing page's spend for the month; ``total_exact`` adds late usage.
        "usage_exact": _exact(exact[0]),
        "adjustments_exact": _exact(exact[1]),
        "total_exact": _exact(exact[0] + exact[1]),
        "credits": str(credits),
        "balance": str(sums.total - credits),
        "unpriced_records": sums.unpriced_records,
        "lines_hash": invoice.lines_hash if invoice else invoices.lines_hash(lines, currency),
        "lines": [ln.to_json() for ln in lines],
        "credit_notes": [credit_note_json(n) for n in notes],
        "finalized_at": _iso(invoice.finalized_at) if invoice else None,
        "voided_at": _iso(invoice.voided_at) if invoice else None,
        "void_reason": invoice.void_reason if invoice else None,
    }


def credit_note_json(note: CreditNote) -> dict[str, Any]:
    return {
        "object": "credit_note",
        "number": note.number,
        "amount": str(note.amount),
        "currency": note.currency,
        "reason": note.reason,
        "created_by": note.created_by,
        "created_at": _iso(note.created_at),
    }


def invoice_json(session: Session, invoice: Invoice) -> dict[str, Any]:
    """A stored (finalized or void) invoice with its lines and credit notes."""
    tenant = session.get(Tenant, invoice.tenant_id)
    assert tenant is not None and invoice.id is not None
    notes = list(
        session.exec(select(CreditNote).where(CreditNote.invoice_id == invoice.id).order_by(col(CreditNote.id)))
    )
    lines = _stored_lines(session, invoice.id, invoice.currency)
    view = _view(tenant, invoice.period, lines, invoice, notes, exact_billed(session, invoice))
    view["plan"] = invoice.plan
    # The amounts shown are the locked ones; ``lines_verified`` says the stored lines still hash to what was locked.
    locked = {
        k: invoices.round_line(getattr(invoice, k), invoice.currency) for k in ("subtotal", "adjustments", "total")
    }
    view.update({k: str(v) for k, v in locked.items()})
    view["balance"] = str(locked["total"] - invoices.round_line(invoice.credits, invoice.currency))
    view["lines_verified"] = invoices.lines_hash(lines, invoice.currency) == invoice.lines_hash
    return _with_credit(view, invoice.credit_used)


def month_invoice(session: Session, tenant: Tenant, period: str) -> dict[str, Any]:
    """The month's finalized invoice, or else its draft: what finalizing now would bill."""
    stored = session.exec(
        select(Invoice).where(Invoice.tenant_id == tenant.id, Invoice.period == period, Invoice.status == FINALIZED)
    ).first()
    if stored is not None:
        return invoice_json(session, stored)
    as_of = datetime.now(UTC)
    lines, exact = _lines(session, tenant, period, _billable(session, tenant, period))
    view = _view(tenant, period, lines, None, [], exact)
    view["as_of"] = as_of.isoformat(timespec="seconds")  # a draft moves with the ledger: when it was read
    view["plan"] = plans.plan_of(session, tenant, period_bounds(period)[1] - timedelta(microseconds=1))
    return _with_credit(view, prepaid.credit_used(session, tenant.id or 0, period))


def _with_credit(view: dict[str, Any], used: Decimal) -> dict[str, Any]:
    """Prepaid credit the month's usage drew (rounded like a line), and what is left to pay after it."""
    used = invoices.round_line(used, view["currency"])
    view["credit_used"] = str(used)
    view["amount_due"] = str(max(Decimal(view["balance"]) - used, invoices.round_line(Decimal(0), view["currency"])))
    return view


def list_invoices(session: Session, tenant: Tenant) -> list[Invoice]:
    """Stored invoices (finalized and void), newest month first."""
    query = select(Invoice).where(Invoice.tenant_id == tenant.id)
    return list(session.exec(query.order_by(col(Invoice.period).desc(), col(Invoice.id).desc())))


def get_invoice(session: Session, number: str) -> Invoice:
    invoice = session.exec(select(Invoice).where(Invoice.number == number)).first() if _is_printable(number) else None
    if invoice is None:
        raise NotFoundError(f"no invoice {number!r}", param="number")
    return invoice


# --- changes ----------------------------------------------------------------------------------------------------


def finalize(session: Session, tenant: Tenant, period: str, *, actor: str, now: datetime | None = None) -> Invoice:
    """Bill a month that has ended: store the invoice and its lines, stamp the records. The caller commits."""
    assert tenant.id is not None
    now = now or datetime.now(UTC)
    end = period_bounds(period)[1]
    if end > now:
        raise ValidationError(f"month: {period} has not ended yet; invoice it from {end:%Y-%m-%d} on", param="month")
    _lock_tenant(session, tenant.id)
    existing = session.exec(
        select(Invoice).where(Invoice.tenant_id == tenant.id, Invoice.period == period, Invoice.status == FINALIZED)
    ).first()
    if existing is not None:
        raise ConflictError(f"{period} is already invoiced as {existing.number}; void it first", param="month")
    plan = plans.plan_of(session, tenant, period_bounds(period)[1] - timedelta(microseconds=1))
    invoice = Invoice(
        tenant_id=tenant.id,
        period=period,
        status=FINALIZED,
        currency=tenant.currency,
        finalized_at=now,
        plan=plan,
        credit_used=prepaid.credit_used(session, tenant.id, period),
    )
    session.add(invoice)
    session.flush()
    assert invoice.id is not None
    # Stamp first, then build the lines from exactly the stamped records: a record committed meanwhile is
    # either stamped (and on the lines) or left for the next invoice, never half-billed.
    session.execute(update(UsageRecord).where(_billable(session, tenant, period)).values(invoice_id=invoice.id))
    lines, _ = _lines(session, tenant, period, col(UsageRecord.invoice_id) == invoice.id)
    sums = invoices.amounts(lines, invoice.currency)
    for ln in lines:
        session.add(InvoiceLine(invoice_id=invoice.id, **{**ln.to_json(), "amount": ln.amount}))
    invoice.number = f"INV-{period.replace('-', '')}-{invoice.id:06d}"
    invoice.subtotal, invoice.adjustments, invoice.total = sums.subtotal, sums.adjustments, sums.total
    invoice.lines_hash = invoices.lines_hash(lines, invoice.currency)
    session.add(invoice)
    _audit(session, actor, "invoice.finalize", f"invoice/{invoice.number}", {"total": str(sums.total)})
    session.flush()
    return invoice


def void(session: Session, number: str, *, reason: str, actor: str) -> Invoice:
    """Void a finalized invoice: its records are unbilled again (the next invoice bills them). Caller commits."""
    if not reason.strip():
        raise ValidationError("reason: say why the invoice is voided", param="reason")
    invoice = get_invoice(session, number)
    _lock_tenant(session, invoice.tenant_id)
    session.refresh(invoice)
    if invoice.status != FINALIZED:
        raise ConflictError(f"invoice {number} is {invoice.status}; only a finalized invoice can be voided")
    session.execute(update(UsageRecord).where(col(UsageRecord.invoice_id) == invoice.id).values(invoice_id=None))
    invoice.status, invoice.voided_at, invoice.void_reason = VOID, datetime.now(UTC), reason.strip()[:500]
    session.add(invoice)
    _audit(session, actor, "invoice.void", f"invoice/{number}", {"reason": invoice.void_reason})
    session.flush()
    return invoice


def parse_amount(text: str | Decimal | float | int, currency: str) -> Decimal:
    """A positive amount with no more decimals than ``currency`` has; ValidationError names ``amount``."""
    try:
        value = Decimal(str(text).strip())
    except InvalidOperation:
        raise ValidationError(f"amount: {text!r} is not an amount", param="amount") from None
    if not value.is_finite() or value <= 0:
        raise ValidationError("amount: must be a positive amount", param="amount")
    if value != invoices.round_line(value, currency):
        places = -int(invoices.minor_unit(currency).as_tuple().exponent)
        raise ValidationError(f"amount: {currency} amounts have at most {places} decimals", param="amount")
    return invoices.round_line(value, currency)


def credit(session: Session, number: str, amount: str | Decimal, *, reason: str, actor: str) -> CreditNote:
    """Issue a credit note against a finalized invoice (at most what is left of its total). Caller commits."""
    if not reason.strip():
        raise ValidationError("reason: say why the credit is given", param="reason")
    invoice = get_invoice(session, number)
    _lock_tenant(session, invoice.tenant_id)
    session.refresh(invoice)
    if invoice.status != FINALIZED:
        raise ConflictError(f"invoice {number} is {invoice.status}; credit notes need a finalized invoice")
    value = parse_amount(amount, invoice.currency)
    left = invoices.round_line(invoice.total - invoice.credits, invoice.currency)
    if value > left:
        raise ValidationError(f"amount: {value} is more than what is left to credit ({left})", param="amount")
    assert invoice.id is not None
    note = CreditNote(
        invoice_id=invoice.id,
        tenant_id=invoice.tenant_id,
        number=f"pending-{uuid.uuid4().hex[:20]}",
        amount=value,
        currency=invoice.currency,
        reason=reason.strip()[:1000],
        created_by=actor[:128],
    )
    session.add(note)
    session.flush()
    note.number = f"CN-{invoice.period.replace('-', '')}-{note.id:06d}"
    invoice.credits = invoice.credits + value
    session.add_all([note, invoice])
    _audit(session, actor, "invoice.credit", f"invoice/{number}", {"credit_note": note.number, "amount": str(value)})
    session.flush()
    return note


# --- the price book ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PriceSpec:
    model: str
    prompt_per_mtok: Decimal
    completion_per_mtok: Decimal
    cached_per_mtok: Decimal | None = None
    version: int | None = None
    tier: str | None = None
    currency: str = "USD"
    effective_from: datetime | None = None
    per_call: Decimal = Decimal(0)
    per_row: Decimal = Decimal(0)  # a fee per input row of a tensor-model call
    plan: str | None = None  # the plan it belongs to (None: the default plan)
    tenant: Tenant | None = None  # set: this tenant's own override (no plan)


def add_price(session: Session, spec: PriceSpec, *, actor: str) -> Price:
    """A new price row (history is kept: usage already rated keeps the price it had). Caller commits."""
    if not spec.model.strip() or not _is_printable(spec.model):
        raise ValidationError("model: must be a non-empty model id without control characters", param="model")
    if spec.version is not None and not 0 <= spec.version < 2**31:
        raise ValidationError("version: must be a model version number", param="version")
    if len(spec.currency) != 3 or not spec.currency.isalpha():
        raise ValidationError(f"currency: {spec.currency!r} is not a 3-letter currency code", param="currency")
    if spec.tier not in (None, "edge", "cloud"):
        raise ValidationError("tier: must be edge, cloud or omitted (both)", param="tier")
    if spec.plan is not None and spec.tenant is not None:
        raise ValidationError("plan: a tenant's override belongs to no plan; give plan or tenant", param="plan")
    plan = plans.get_plan(session, spec.plan) if spec.plan is not None else plans.default_plan(session)
    for name in ("prompt_per_mtok", "completion_per_mtok", "cached_per_mtok", "per_call", "per_row"):
        value = getattr(spec, name)
        if value is not None and (not value.is_finite() or value < 0):
            raise ValidationError(f"{name}: must be a non-negative amount", param=name)
    start = spec.effective_from or datetime.now(UTC)
    row = Price(
        model=spec.model.strip(),
        version=spec.version,
        tier=spec.tier,
        currency=spec.currency.upper(),
        prompt_per_mtok=spec.prompt_per_mtok,
        completion_per_mtok=spec.completion_per_mtok,
        cached_per_mtok=spec.cached_per_mtok if spec.cached_per_mtok is not None else spec.prompt_per_mtok,
        per_call=spec.per_call,
        per_row=spec.per_row,
        effective_from=as_utc(start),
        plan_id=None if spec.tenant is not None else plan.id,
        tenant_id=spec.tenant.id if spec.tenant is not None else None,
    )
    session.add(row)
    session.flush()
    _audit(session, actor, "price.add", f"price/{row.id}", price_json(row, None if spec.tenant else plan.name))
    return row


def list_prices(session: Session, model: str | None = None) -> list[Price]:
    """Prices by model, newest first."""
    query = select(Price).order_by(col(Price.model), col(Price.effective_from).desc(), col(Price.id).desc())
    if model is not None:
        query = query.where(Price.model == model)
    return list(session.exec(query))

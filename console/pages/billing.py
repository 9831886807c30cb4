"""Billing: usage over time by tenant, model or tier (a chart), each tenant's month-to-date spend (the ledger's one
figure), the price book, invoices."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from litestar import Request, Response, get, post
from litestar.response import Redirect, Template
from sqlalchemy import func
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from console.auth import session_user
from console.pages import changes
from console.pages.charts import stacked_columns
from console.pages.common import (
    Form,
    errors_of,
    optional_int,
    optional_money,
    paginate,
    render,
    see_other,
    text,
    write_session,
)
from controlplane.billing import invoices
from controlplane.billing import invoicing as billing_service
from controlplane.billing.ledger import MonthSpend, cost_total, month_spend, utc_format
from controlplane.billing.pricing import period_bounds, period_of
from controlplane.storage.tables import CreditNote, Invoice, InvoiceLine, Price, Tenant, UsageRecord
from controlplane.tenancy import service as tenancy
from shared.errors import ApplicationError, NotFoundError, ValidationError

GROUPS = ("tenant", "model", "tier")
METRICS = ("cost", "tokens", "requests")
DAYS = (7, 30, 90)


def usage_series(session: Session, group: str, metric: str, since: datetime) -> dict[str, dict[str, Decimal]]:
    """``{group value: {YYYY-MM-DD: amount}}`` of usage records since ``since``; costs are exact sums."""
    day = utc_format(session, col(UsageRecord.occurred_at), "day")
    key: Any = {"tenant": Tenant.name, "model": UsageRecord.model, "tier": UsageRecord.tier}[group]
    value: Any = {
        "cost": cost_total(),
        "tokens": func.coalesce(func.sum(UsageRecord.prompt_tokens + UsageRecord.completion_tokens), 0),
        "requests": func.count(),
    }[metric]
    query = (
        select(key, day, value)
        .select_from(UsageRecord)
        .join(Tenant, col(Tenant.id) == UsageRecord.tenant_id)
        .where(col(UsageRecord.occurred_at) >= since)
        .group_by(key, day)
    )
    series: dict[str, dict[str, Decimal]] = {}
    for name, d, amount in session.exec(query):
        series.setdefault(str(name), {})[str(d)] = Decimal(amount)
    return series


def month_to_date(session: Session, now: datetime) -> list[tuple[Tenant, MonthSpend]]:
    """Each tenant with usage this month and its month-to-date spend: ``month_spend``, the tenant page's figure."""
    start = period_bounds(period_of(now))[0]
    ids = select(UsageRecord.tenant_id).where(col(UsageRecord.occurred_at) >= start).distinct()
    tenants = session.exec(select(Tenant).where(col(Tenant.id).in_(ids)).order_by(Tenant.name)).all()
    return [(t, month_spend(session, t.id or 0, now=now)) for t in tenants]


@get("/billing", sync_to_thread=True)
def billing(
    request: Request[Any, Any, Any],
    db: Engine,
    group: str = "tenant",
    metric: str = "cost",
    days: int = 30,
    page: int = 1,
) -> Template:
    """Usage per day, the price book (newest first) and invoices."""
    group = group if group in GROUPS else GROUPS[0]
    metric = metric if metric in METRICS else METRICS[0]
    days = days if days in DAYS else 30
    now = datetime.now(UTC)
    start = (now - timedelta(days=days - 1)).replace(hour=0, minute=0, second=0, microsecond=0)
    x_labels = [(start + timedelta(days=i)).strftime("%Y-%m-%d") for i in range(days)]
    with Session(db) as session:
        series = usage_series(session, group, metric, start)
        spend = month_to_date(session, now)
        prices = list(session.exec(select(Price).order_by(Price.model, col(Price.effective_from).desc()).limit(200)))
        invoices, info = paginate(
            session,
            select(Invoice, Tenant).join(Tenant).order_by(col(Invoice.period).desc(), col(Invoice.id).desc()),  # type: ignore[arg-type]
            page,
            {"group": group, "metric": metric, "days": str(days)},
        )
    unit = {"cost": "", "tokens": "tokens", "requests": "requests"}[metric]
    totals = sorted(((s, sum(v.values(), Decimal(0))) for s, v in series.items()), key=lambda kv: -kv[1])
    heights = {s: {d: float(v) for d, v in days_.items()} for s, days_ in series.items()}  # pixels, not money
    return render(
        request,
        "billing.html.j2",
        chart=stacked_columns(heights, x_labels, unit=unit, display=lambda day: day[5:]),
        totals=totals,
        group=group,
        metric=metric,
        days=days,
        groups=GROUPS,
        metrics=METRICS,
        day_options=DAYS,
        prices=prices,
        invoices=invoices,
        page=info,
        now=now,
        spend=spend,
        period=period_of(now),
    )


@get("/billing/invoices/{invoice_id:int}", sync_to_thread=True)
def invoice_detail(request: Request[Any, Any, Any], db: Engine, invoice_id: int) -> Template:
    """An invoice with its lines and credit notes."""
    return invoice_page(request, db, invoice_id)


def invoice_page(
    request: Request[Any, Any, Any], db: Engine, invoice_id: int, status_code: int = 200, **extra: Any
) -> Template:
    """The invoice page; ``extra`` carries the credit note form's values and errors when it comes back."""
    extra.setdefault("credit_form", {})
    extra.setdefault("credit_errors", {})
    with Session(db) as session:
        invoice = session.get(Invoice, invoice_id)
        if invoice is None:
            raise NotFoundError(f"no invoice with id {invoice_id}", param="id")
        tenant = session.get(Tenant, invoice.tenant_id)
        lines = list(
            session.exec(select(InvoiceLine).where(InvoiceLine.invoice_id == invoice_id).order_by(col(InvoiceLine.id)))
        )
        credits = list(
            session.exec(select(CreditNote).where(CreditNote.invoice_id == invoice_id).order_by(col(CreditNote.id)))
        )
        billed = sum(billing_service.exact_billed(session, invoice), Decimal(0))
    return render(
        request,
        "invoice.html.j2",
        status_code,
        invoice=invoice,
        tenant=tenant,
        lines=lines,
        credit_notes=credits,
        credit_left=invoice.total - invoice.credits,
        rounding=invoice.total - invoice.subtotal - invoice.adjustments,
        billed_exact=billed,
        **extra,
    )


@get("/billing/invoices/{invoice_id:int}/csv", sync_to_thread=True)
def invoice_csv(db: Engine, invoice_id: int) -> Response[str]:
    """A finalized or void invoice as CSV (its lines, then the totals), for download."""
    with Session(db) as session:
        invoice = session.get(Invoice, invoice_id)
        if invoice is None or invoice.number is None:
            raise NotFoundError(f"no stored invoice with id {invoice_id}", param="id")
        body = invoices.to_csv(billing_service.invoice_json(session, invoice))
    return Response(
        body,
        media_type="text/csv; charset=utf-8",
        headers={"Content-Disposition": f'attachment; filename="{invoice.number}.csv"'},
    )


@get("/billing/finalize", sync_to_thread=True)
def finalize_confirm(request: Request[Any, Any, Any], db: Engine, tenant: str = "", month: str = "") -> Template:
    """What finalizing would bill (the draft), and the button that does it."""
    with Session(db) as session:
        tenants = changes.tenant_names(session)
        draft: dict[str, Any] | None = None
        errors: dict[str, str] = {}
        now = datetime.now(UTC)
        end = now
        if tenant or month:
            try:
                period = billing_service.month(month)
                draft = billing_service.month_invoice(session, tenancy.get_tenant(session, tenant), period)
                end = period_bounds(period)[1]
            except ApplicationError as exc:
                errors = errors_of(exc)
    return render(
        request,
        "finalize.html.j2",
        400 if errors else 200,
        tenants=tenants,
        tenant=tenant,
        month=month,
        draft=draft,
        errors=errors,
        taken_at=now,
        ended=end <= now,  # finalize refuses a month that has not ended: the page does not offer it
        ends_on=f"{end:%Y-%m-%d}",
    )


@post("/billing/finalize", sync_to_thread=True)
def finalize(request: Request[Any, Any, Any], db: Engine, data: Form) -> Redirect:
    """Finalize a tenant's ended month: the invoice is stored, numbered and its records stamped."""
    with write_session(db) as session:
        tenant = tenancy.get_tenant(session, text(data, "tenant", max_length=64, required=True))
        period = billing_service.month(text(data, "month", max_length=7, required=True))
        invoice = billing_service.finalize(session, tenant, period, actor=session_user(request).actor)
        invoice_id = invoice.id
    return see_other(f"/billing/invoices/{invoice_id}")


@post("/billing/prices", sync_to_thread=True)
def price_add(request: Request[Any, Any, Any], db: Engine, data: Form) -> Template | Redirect:
    """A new price from a moment on; earlier usage keeps the price it was rated with."""
    try:
        effective = text(data, "effective_from", max_length=32)
        try:
            start = datetime.fromisoformat(effective).replace(tzinfo=UTC) if effective else None
        except ValueError:
            raise ValidationError("effective from must be a date and time", param="effective_from") from None
        spec = billing_service.PriceSpec(
            model=text(data, "model", max_length=128, required=True),
            prompt_per_mtok=_required_money(data, "prompt_per_mtok"),
            completion_per_mtok=_required_money(data, "completion_per_mtok"),
            cached_per_mtok=optional_money(data, "cached_per_mtok"),
            version=optional_int(data, "version", minimum=1),
            tier=text(data, "tier", max_length=8) or None,
            currency=text(data, "currency", max_length=3) or "USD",
            effective_from=start,
        )
        with write_session(db) as session:
            billing_service.add_price(session, spec, actor=session_user(request).actor)
    except ApplicationError as exc:
        return render(request, "price_form.html.j2", 400, form=data, errors=errors_of(exc))
    return see_other("/billing#prices")


@get("/billing/prices/new", sync_to_thread=False)
def price_new(request: Request[Any, Any, Any]) -> Template:
    return render(request, "price_form.html.j2", form={"currency": "USD"}, errors={})


def _required_money(form: dict[str, str], name: str) -> Decimal:
    value = optional_money(form, name)
    if value is None:
        raise ValidationError(f"{name.replace('_', ' ')} is required", param=name)
    return value


HANDLERS = [billing, invoice_detail, invoice_csv, finalize_confirm, finalize, price_new, price_add]

"""Billing under ``/api``: prices, invoices, credit notes, tenant usage.

Every route takes a console API token (``Authorization: Bearer tlc-...``); changes need an admin. The usage
route is tenant-scoped too: a tenant's own cloud API key (``tl-...``) may read its own usage, and asking for
another tenant's answers 404, as if that tenant did not exist. Handlers validate, call one function of
``controlplane.billing.invoicing`` / ``controlplane.billing.ledger`` and return JSON (or CSV for an invoice with
``?format=csv``).
"""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Annotated, Any, Literal

from litestar import Request, Response, get, post
from litestar.params import Parameter, QueryParameter
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.engine import Engine
from sqlmodel import Session

from console.management_api import Operator, authenticate_token, management_router
from controlplane.billing import invoicing as billing
from controlplane.billing import ledger
from controlplane.billing.invoices import round_line, to_csv
from controlplane.billing.pricing import period_bounds
from controlplane.storage.session import session_scope
from controlplane.storage.tables import Invoice, Tenant
from controlplane.tenancy import service as tenancy
from shared.errors import AuthenticationError, NotFoundError, ValidationError

Format = Annotated[str | None, QueryParameter(name="format", description="json (default) or csv")]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PriceCreate(_Body):
    model: str = Field(min_length=1, max_length=128, description="model id, e.g. tierline/lm-cloud")
    prompt_per_mtok: Decimal = Field(ge=0, max_digits=18, decimal_places=6, description="per million prompt tokens")
    completion_per_mtok: Decimal = Field(ge=0, max_digits=18, decimal_places=6)
    cached_per_mtok: Decimal | None = Field(None, ge=0, max_digits=18, decimal_places=6, description="default: prompt")
    version: int | None = Field(None, ge=0, lt=2**31, description="only this model version (default: every version)")
    tier: Literal["edge", "cloud"] | None = Field(None, description="only this tier (default: both)")
    currency: str = Field("USD", pattern=r"^[A-Za-z]{3}$")
    effective_from: datetime | None = Field(None, description="default: now; earlier usage keeps earlier prices")
    per_call: Decimal = Field(Decimal(0), ge=0, max_digits=18, decimal_places=6, description="a fee per request")
    per_row: Decimal = Field(
        Decimal(0), ge=0, max_digits=18, decimal_places=6, description="a fee per input row of a tensor-model call"
    )
    plan: str | None = Field(None, max_length=64, description="the plan it belongs to (default: the default plan)")
    tenant: str | None = Field(None, max_length=64, description="instead of a plan: this tenant's own override")


class InvoiceCreate(_Body):
    month: str = Field(description="the calendar month (UTC) to finalize, YYYY-MM; it must have ended")


class VoidRequest(_Body):
    reason: str = Field(min_length=1, max_length=500)


class CreditNoteCreate(_Body):
    amount: Decimal = Field(gt=0, max_digits=18, description="at most what is left of the invoice's total")
    reason: str = Field(min_length=1, max_length=1000)


def _render(view: dict[str, Any], fmt: str | None, status_code: int = 200) -> Response[Any]:
    if fmt not in (None, "json", "csv"):
        raise ValidationError("format: must be json or csv", param="format")
    if fmt == "csv":
        name = view["number"] or f"{view['tenant']}-{view['period']}-draft"
        return Response(
            to_csv(view),
            media_type="text/csv; charset=utf-8",
            headers={"Content-Disposition": f'attachment; filename="{name}.csv"'},
            status_code=status_code,
        )
    return Response(view, status_code=status_code)


def _summary(invoice: Invoice) -> dict[str, Any]:
    return {
        "object": "invoice",
        "number": invoice.number,
        "status": invoice.status,
        "period": invoice.period,
        "currency": invoice.currency,
        "total": str(round_line(invoice.total, invoice.currency)),
        "credits": str(round_line(invoice.credits, invoice.currency)),
        "finalized_at": invoice.finalized_at.isoformat() if invoice.finalized_at else None,
        "voided_at": invoice.voided_at.isoformat() if invoice.voided_at else None,
    }


# --- prices -----------------------------------------------------------------------------------------------------


@get("/prices", sync_to_thread=True)
def list_prices(db: Engine, operator: Operator, model: str | None = None) -> dict[str, Any]:
    """The price book, by model, newest first (``?model=`` filters)."""
    with Session(db) as session:
        return {"object": "list", "data": [billing.price_json(p) for p in billing.list_prices(session, model)]}


@post("/prices", status_code=201, sync_to_thread=True)
def create_price(db: Engine, operator: Operator, data: PriceCreate) -> dict[str, Any]:
    """Add a price from ``effective_from`` on (history is kept: past usage keeps the price it was rated with)."""
    operator.require_admin()
    with session_scope(db) as session:
        fields = data.model_dump()
        owner = fields.pop("tenant")
        spec = billing.PriceSpec(**fields, tenant=billing.resolve_tenant(session, owner) if owner else None)
        row = billing.add_price(session, spec, actor=operator.actor)
        return billing.price_json(row)


# --- invoices ---------------------------------------------------------------------------------------------------


@get("/tenants/{tenant:str}/invoices", sync_to_thread=True)
def list_invoices(db: Engine, operator: Operator, tenant: str) -> dict[str, Any]:
    """A tenant's stored invoices (finalized and void), newest month first."""
    with Session(db) as session:
        row = billing.resolve_tenant(session, tenant)
        return {"object": "list", "data": [_summary(i) for i in billing.list_invoices(session, row)]}


@get("/tenants/{tenant:str}/invoices/{month:str}", sync_to_thread=True)
def month_invoice(db: Engine, operator: Operator, tenant: str, month: str, fmt: Format = None) -> Response[Any]:
    """A month's invoice: the finalized one, or else the live draft (what finalizing now would bill)."""
    with Session(db) as session:
        row = billing.resolve_tenant(session, tenant)
        return _render(billing.month_invoice(session, row, billing.month(month)), fmt)


@post("/tenants/{tenant:str}/invoices", status_code=201, sync_to_thread=True)
def finalize_invoice(db: Engine, operator: Operator, tenant: str, data: InvoiceCreate) -> dict[str, Any]:
    """Finalize a month that has ended: lock the amounts, hash the lines, number it, bill its records once."""
    operator.require_admin()
    with session_scope(db) as session:
        row = billing.resolve_tenant(session, tenant)
        invoice = billing.finalize(session, row, billing.month(data.month), actor=operator.actor)
        return billing.invoice_json(session, invoice)


@get("/invoices/{number:str}", sync_to_thread=True)
def get_invoice(db: Engine, operator: Operator, number: str, fmt: Format = None) -> Response[Any]:
    """One stored invoice with its lines and credit notes; ``?format=csv`` (or ``/invoices/NUMBER.csv``) as CSV."""
    if number.endswith(".csv"):
        number, fmt = number.removesuffix(".csv"), "csv"
    with Session(db) as session:
        return _render(billing.invoice_json(session, billing.get_invoice(session, number)), fmt)


@post("/invoices/{number:str}/void", status_code=200, sync_to_thread=True)
def void_invoice(db: Engine, operator: Operator, number: str, data: VoidRequest) -> dict[str, Any]:
    """Void a finalized invoice; its records are billed again by the next invoice finalized for them."""
    operator.require_admin()
    with session_scope(db) as session:
        invoice = billing.void(session, number, reason=data.reason, actor=operator.actor)
        return billing.invoice_json(session, invoice)


@post("/invoices/{number:str}/credit-notes", status_code=201, sync_to_thread=True)
def create_credit_note(db: Engine, operator: Operator, number: str, data: CreditNoteCreate) -> dict[str, Any]:
    """Issue a credit note against a finalized invoice: at most what is left of its total."""
    operator.require_admin()
    with session_scope(db) as session:
        note = billing.credit(session, number, data.amount, reason=data.reason, actor=operator.actor)
        return billing.credit_note_json(note)


# --- usage ------------------------------------------------------------------------------------------------------


def _moment(text: str | None, param: str, default: datetime) -> datetime:
    """A date (``to``: the whole day is included) or an ISO 8601 moment (naive means UTC)."""
    if text is None or not text.strip():
        return default
    try:
        if len(text.strip()) == 10:
            day = datetime.combine(date.fromisoformat(text.strip()), datetime.min.time(), UTC)
            return day + timedelta(days=1) if param == "to" else day
        moment = datetime.fromisoformat(text.strip())
    except (ValueError, OverflowError):
        raise ValidationError(f"{param}: {text!r} is not a date (YYYY-MM-DD) or ISO 8601 time", param=param) from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _caller_tenant(request: Request[Any, Any, Any], session: Session) -> Tenant | None:
    """The tenant a ``tl-`` key belongs to, or None for a console token (which may read every tenant)."""
    scheme, _, secret = request.headers.get("authorization", "").partition(" ")
    secret = secret.strip()
    if scheme.lower() != "bearer" or not secret:
        raise AuthenticationError("missing token (Authorization: Bearer tlc-... or a tenant's tl-... API key)")
    if secret.startswith(tenancy.KEY_PREFIX):
        return tenancy.authenticate(session, secret)[0]
    authenticate_token(session, secret)
    return None


@get("/tenants/{tenant:str}/usage", sync_to_thread=True)
def tenant_usage(
    request: Request[Any, Any, Any],
    db: Engine,
    tenant: str,
    start: Annotated[
        str | None, QueryParameter(name="from", description="date or ISO time; default: month start")
    ] = None,
    end: Annotated[
        str | None, QueryParameter(name="to", description="date (inclusive) or ISO time; default: now")
    ] = None,
    group_by: Annotated[str | None, Parameter(description="day, month, model, version, tier; comma-separated")] = None,
) -> dict[str, Any]:
    """Requests, tokens and cost of a tenant's usage records in ``[from, to)``, grouped for dashboards.

    A console token reads any tenant; a tenant's ``tl-`` API key reads only its own (another tenant: 404).
    """
    dims = ledger.parse_group_by(group_by)
    now = datetime.now(UTC)
    since = _moment(start, "from", period_bounds(now.strftime("%Y-%m"))[0])
    until = _moment(end, "to", now)
    if until <= since:
        raise ValidationError("to: must be after from", param="to")
    with Session(db) as session:
        caller = _caller_tenant(request, session)
        try:
            row = billing.resolve_tenant(session, tenant)
        except NotFoundError:
            row = None
        if row is None or (caller is not None and caller.id != row.id):
            raise NotFoundError(f"no tenant {tenant!r}", param="tenant")
        return {"object": "usage", "tenant": row.name, **ledger.usage_totals(session, row.id or 0, since, until, dims)}


BILLING_ROUTER = management_router(
    [
        list_prices,
        create_price,
        list_invoices,
        month_invoice,
        finalize_invoice,
        get_invoice,
        void_invoice,
        create_credit_note,
        tenant_usage,
    ],
    "billing",
)

"""Correcting a finalized invoice from its page: void it (after confirming, with a reason) or issue a credit note.

The rules and the audit rows are :func:`controlplane.billing.invoicing.void` and
:func:`controlplane.billing.invoicing.credit`'s; their messages
come back under the field they name.
"""

from __future__ import annotations

from typing import Any

from litestar import Request, get, post
from litestar.response import Redirect, Template
from sqlalchemy.engine import Engine
from sqlmodel import Session

from console.auth import session_user
from console.pages.billing import invoice_page
from console.pages.common import Form, errors_of, render, see_other, text, write_session
from controlplane.billing import invoicing as billing_service
from controlplane.storage.tables import Invoice
from shared.errors import ApplicationError, ConflictError, NotFoundError


def _number(session: Session, invoice_id: int) -> str:
    """The number of a finalized (or void) invoice; a draft has none and cannot be corrected."""
    invoice = session.get(Invoice, invoice_id)
    if invoice is None:
        raise NotFoundError(f"no invoice with id {invoice_id}", param="id")
    if invoice.number is None:
        raise ConflictError(f"invoice {invoice_id} is a {invoice.status}; only a finalized invoice can be corrected")
    return invoice.number


def _void_confirm(
    request: Request[Any, Any, Any], invoice_id: int, number: str, errors: dict[str, str], status_code: int = 200
) -> Template:
    return render(
        request,
        "confirm.html.j2",
        status_code,
        title=f"Void invoice {number}",
        message="A void invoice bills nothing: its usage records become unbilled again and go on the tenant's next "
        "invoice. This cannot be undone.",
        action=f"/billing/invoices/{invoice_id}/void",
        button="Void invoice",
        cancel=f"/billing/invoices/{invoice_id}",
        reason=True,
        reason_label="Reason (kept on the invoice and in the audit log)",
        errors=errors,
    )


@get("/billing/invoices/{invoice_id:int}/void", sync_to_thread=True)
def invoice_void_confirm(request: Request[Any, Any, Any], db: Engine, invoice_id: int) -> Template:
    """Asks for a reason before voiding."""
    with Session(db) as session:
        number = _number(session, invoice_id)
    return _void_confirm(request, invoice_id, number, {})


@post("/billing/invoices/{invoice_id:int}/void", sync_to_thread=True)
def invoice_void(request: Request[Any, Any, Any], db: Engine, invoice_id: int, data: Form) -> Template | Redirect:
    """Void a finalized invoice; a missing reason comes back under the field, a draft or void one is a 409."""
    with Session(db) as session:
        number = _number(session, invoice_id)
    try:
        with write_session(db) as session:
            billing_service.void(
                session, number, reason=text(data, "reason", max_length=500), actor=session_user(request).actor
            )
    except ApplicationError as exc:
        if exc.status_code != 400:
            raise
        return _void_confirm(request, invoice_id, number, errors_of(exc), 400)
    return see_other(f"/billing/invoices/{invoice_id}")


@post("/billing/invoices/{invoice_id:int}/credit-notes", sync_to_thread=True)
def credit_note_issue(request: Request[Any, Any, Any], db: Engine, invoice_id: int, data: Form) -> Template | Redirect:
    """Credit part of a finalized invoice's total (at most what is left of it), with a reason."""
    try:
        with write_session(db) as session:
            billing_service.credit(
                session,
                _number(session, invoice_id),
                text(data, "amount", max_length=32, required=True),
                reason=text(data, "reason", max_length=1000),
                actor=session_user(request).actor,
            )
    except ApplicationError as exc:
        if exc.status_code == 404:
            raise
        errors = errors_of(exc) if exc.param in ("amount", "reason") else {"_form": exc.message}
        return invoice_page(request, db, invoice_id, exc.status_code, credit_form=data, credit_errors=errors)
    return see_other(f"/billing/invoices/{invoice_id}#credit-notes")


HANDLERS = [invoice_void_confirm, invoice_void, credit_note_issue]

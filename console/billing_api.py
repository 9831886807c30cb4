"""Billing under ``/api``: prices, invoices, credit notes, tenant usage (issue 8)."""

from __future__ import annotations

from litestar import Router
from litestar.di import Provide

from console.api import require_operator

BILLING_ROUTER = Router(
    "/api",
    route_handlers=[],
    dependencies={"operator": Provide(require_operator, sync_to_thread=True)},
    security=[{"ConsoleToken": []}],
    tags=["billing"],
)

"""The web console (Litestar + Jinja + HTMX) and the management API under ``/api``.

Pages (``console.pages``) sign in with a session cookie; ``/api`` takes console API tokens
(``console.management_api``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from decimal import ROUND_HALF_EVEN, Decimal
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader
from litestar import Litestar, Request, Response
from litestar.exceptions import HTTPException
from litestar.plugins.jinja import JinjaTemplateEngine
from litestar.static_files import create_static_files_router
from litestar.template.config import TemplateConfig
from sqlalchemy.engine import Engine

from console.auth import security_headers
from console.billing_api import BILLING_ROUTER
from console.fleet_api import FLEET_ROUTER
from console.management_api import OPENAPI_CONFIG
from console.money_api import MONEY_ROUTER
from console.pages import LOGIN_ROUTER, PAGES_ROUTER
from console.pages.common import http_error_page
from console.policies_api import POLICIES_ROUTER
from console.registry_api import REGISTRY_ROUTER, derive_jobs
from console.rollout_controller import rollout_controller
from console.rollouts_api import ROLLOUTS_ROUTER
from console.session_cookie import ConsoleAuth, ConsoleAuthSettings
from console.state import ConsoleState
from controlplane.billing.invoices import minor_unit
from controlplane.registry.store import store_from_settings
from controlplane.storage.session import get_db
from shared.http import http_error_handler
from shared.service_app import create_service_app
from shared.settings import SecretSettings

HERE = Path(__file__).resolve().parent
TEMPLATES = HERE / "templates"
STATIC = HERE / "static"
JSON_PREFIXES = ("/api", "/schema", "/healthz")


def _when(ts: datetime | None) -> str:
    return "—" if ts is None else ts.strftime("%Y-%m-%d %H:%M:%S UTC")


def _ago(ts: datetime | None, now: datetime) -> str:
    if ts is None:
        return "never"
    seconds = max(0, int((now - ts).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds // size} {unit} ago"
    return f"{seconds} s ago"


def _money(value: Decimal | float | None, currency: str = "") -> str:
    """An amount at the ledger's precision (micros), never fewer decimals than the currency's minor unit:
    ``0.046321`` reads ``0.046321 USD`` and ``2.1`` reads ``2.10 USD``. One sum reads the same on every page,
    and a sub-cent spend never reads 0.00 (an invoice's amounts are rounded already, so they read as billed)."""
    if value is None:
        return "—"
    amount = Decimal(str(value)).quantize(Decimal("0.000001"), rounding=ROUND_HALF_EVEN)
    places = -int(minor_unit(currency or "USD").as_tuple().exponent)
    digits = max(places, -int(amount.normalize().as_tuple().exponent))
    return f"{amount:,.{digits}f} {currency}".strip()


def _number(value: Decimal | float | None) -> str:
    """A stored amount without the trailing zeros of its column's scale: ``0.500000`` reads ``0.5``."""
    if value is None:
        return "—"
    return format(Decimal(str(value)).normalize(), "f")


def _is_past(ts: datetime | None) -> bool:
    return ts is not None and ts <= datetime.now(UTC)


def _percent(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{100 * value:.{digits}f} %"


def template_engine() -> Environment:
    env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=True, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(when=_when, ago=_ago, money=_money, percent=_percent, is_past=_is_past, number=_number)
    return env


def routing_error(request: Request[Any, Any, Any], exc: HTTPException) -> Response[Any]:
    """An unknown URL or method: a page for the browser, the JSON error shape under ``/api`` and ``/schema``."""
    if request.url.path.startswith(JSON_PREFIXES):
        return http_error_handler(request, exc)
    return http_error_page(request, exc)


def create_app(db: Engine | None = None, auth_settings: ConsoleAuthSettings | None = None) -> Litestar:
    secret = SecretSettings()  # refuses a placeholder secret outside dev mode
    db = db or get_db()
    auth = ConsoleAuth.from_settings(secret.secret_key.get_secret_value(), auth_settings)

    @asynccontextmanager
    async def start() -> AsyncIterator[ConsoleState]:
        artifacts = store_from_settings()  # one per process, shared by the API and the pages
        async with rollout_controller(db), derive_jobs(db, artifacts) as derive_runner:
            yield ConsoleState(db=db, auth=auth, artifacts=artifacts, derive_runner=derive_runner)

    return create_service_app(
        route_handlers=[
            LOGIN_ROUTER,
            PAGES_ROUTER,
            ROLLOUTS_ROUTER,
            REGISTRY_ROUTER,
            BILLING_ROUTER,
            MONEY_ROUTER,
            POLICIES_ROUTER,
            FLEET_ROUTER,
            create_static_files_router("/static", directories=[STATIC], include_in_schema=False),
        ],
        start=start,
        state_type=ConsoleState,
        exception_handlers={HTTPException: routing_error},
        middleware=[security_headers],
        openapi_config=OPENAPI_CONFIG,
        template_config=TemplateConfig(engine=JinjaTemplateEngine.from_environment(template_engine())),
    )

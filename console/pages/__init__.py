"""The console's pages: server-rendered Jinja with HTMX for the parts that refresh or search as you type.

Every page but sign-in sits behind :func:`console.auth.require_console_user` (a session; on a change a CSRF token
and the admin role). Errors render as HTML pages; the ``/api`` routers keep their JSON errors.
"""

from __future__ import annotations

from litestar import Router
from litestar.plugins.htmx import HTMXRequest

from console.auth import require_console_user
from console.pages import (
    audit,
    billing,
    fleet,
    invoice_actions,
    keys,
    login,
    model_uploads,
    models,
    money,
    overview,
    policies,
    quality,
    rollouts,
    tenants,
    users,
)
from console.pages.common import PAGE_EXCEPTION_HANDLERS

PAGES_ROUTER = Router(
    "/",
    route_handlers=[
        *overview.HANDLERS,
        *tenants.HANDLERS,
        *keys.HANDLERS,
        *fleet.HANDLERS,
        *rollouts.HANDLERS,
        *models.HANDLERS,
        *model_uploads.HANDLERS,
        *policies.HANDLERS,
        *quality.HANDLERS,
        *billing.HANDLERS,
        *money.HANDLERS,
        *invoice_actions.HANDLERS,
        *audit.HANDLERS,
        *users.HANDLERS,
    ],
    guards=[require_console_user],
    exception_handlers=PAGE_EXCEPTION_HANDLERS,
    request_class=HTMXRequest,
    include_in_schema=False,
)

LOGIN_ROUTER = Router(
    "/",
    route_handlers=login.LOGIN_HANDLERS,
    exception_handlers=PAGE_EXCEPTION_HANDLERS,
    include_in_schema=False,
)

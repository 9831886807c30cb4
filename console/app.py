"""The web console (Litestar + Jinja + HTMX). Pages and auth grow with issue 9."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from litestar import Litestar, get
from litestar.contrib.jinja import JinjaTemplateEngine
from litestar.datastructures import State
from litestar.response import Template
from litestar.template.config import TemplateConfig
from sqlalchemy import func
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from console.api import API_ROUTER, OPENAPI_CONFIG
from console.billing_api import BILLING_ROUTER
from console.registry_api import REGISTRY_ROUTER
from console.rollout_controller import rollout_controller
from shared.http import EXCEPTION_HANDLERS, healthz
from shared.logs import request_id_middleware
from shared.settings import SecretSettings
from shared.storage.models import ApiKey, Device, Model, Tenant
from shared.storage.session import get_engine

TEMPLATES = Path(__file__).resolve().parent / "templates"


@get("/", sync_to_thread=True)
def overview(state: State) -> Template:
    with Session(state.engine) as session:
        counts: dict[str, Any] = {
            label: session.exec(select(func.count()).select_from(table)).one()
            for label, table in (("tenants", Tenant), ("API keys", ApiKey), ("models", Model), ("devices", Device))
        }
    return Template(template_name="overview.html.j2", context={"counts": counts})


def create_app(engine: Engine | None = None) -> Litestar:
    SecretSettings()  # refuses a placeholder secret outside dev mode
    return Litestar(
        logging_config=None,  # the process's logging (shared.logs) stays as configured: text or JSON
        route_handlers=[healthz, overview, API_ROUTER, REGISTRY_ROUTER, BILLING_ROUTER],
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=[rollout_controller],
        middleware=[request_id_middleware],
        openapi_config=OPENAPI_CONFIG,
        template_config=TemplateConfig(directory=TEMPLATES, engine=JinjaTemplateEngine),
        state=State({"engine": engine or get_engine()}),
    )

"""The cloud inference API (Litestar). Routes grow with issue 4; auth and errors are final here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from litestar import Litestar, Request, get
from litestar.datastructures import State
from litestar.di import Provide
from sqlalchemy.engine import Engine
from sqlmodel import Session

from cloud.models_catalog import ServedModel, find, load_catalog
from cloud.settings import CloudSettings
from shared.errors import AuthenticationError, ServiceUnavailableError
from shared.http import EXCEPTION_HANDLERS, healthz
from shared.settings import CoreSettings
from shared.storage.migrate import is_up_to_date
from shared.storage.models import Tenant
from shared.storage.session import get_engine
from shared.tenancy import authenticate


def _model_json(m: ServedModel) -> dict[str, Any]:
    return {"id": m.id, "object": "model", "created": m.created, "owned_by": "tierline"}


def require_tenant(request: Request[Any, Any, Any], state: State) -> Tenant:
    header = request.headers.get("authorization", "")
    scheme, _, secret = header.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise AuthenticationError("missing bearer API key (Authorization: Bearer tl-...)")
    with Session(state.engine) as session:
        tenant, _key = authenticate(session, secret.strip())
    return tenant


@get("/readyz", sync_to_thread=True, include_in_schema=False)
def readyz(state: State) -> dict[str, str]:
    """Readiness: the database answers and is migrated to this code's schema."""
    try:
        ok = is_up_to_date(state.engine)
    except Exception as exc:
        raise ServiceUnavailableError(f"database unavailable: {type(exc).__name__}") from exc
    if not ok:
        raise ServiceUnavailableError("database schema is behind; run `tierline db upgrade`")
    return {"status": "ready"}


@get("/v1/models", dependencies={"tenant": Provide(require_tenant, sync_to_thread=True)}, sync_to_thread=False)
def list_models(state: State, tenant: Tenant) -> dict[str, Any]:
    return {"object": "list", "data": [_model_json(m) for m in state.catalog]}


@get(
    "/v1/models/{model_id:path}",
    dependencies={"tenant": Provide(require_tenant, sync_to_thread=True)},
    sync_to_thread=False,
)
def get_model(state: State, tenant: Tenant, model_id: str) -> dict[str, Any]:
    return _model_json(find(state.catalog, model_id.lstrip("/")))


def create_app(engine: Engine | None = None, zoo_root: Path | None = None) -> Litestar:
    core = CoreSettings()
    root = zoo_root or core.zoo_dir / CloudSettings().zoo_preset
    return Litestar(
        route_handlers=[healthz, readyz, list_models, get_model],
        exception_handlers=EXCEPTION_HANDLERS,
        state=State({"engine": engine or get_engine(), "catalog": load_catalog(root)}),
    )

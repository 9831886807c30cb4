"""The model registry under ``/api/models``: models, versions, artifacts, aliases (issue 7)."""

from __future__ import annotations

from litestar import Router
from litestar.di import Provide

from console.api import require_operator

REGISTRY_ROUTER = Router(
    "/api",
    route_handlers=[],
    dependencies={"operator": Provide(require_operator, sync_to_thread=True)},
    security=[{"ConsoleToken": []}],
    tags=["registry"],
)

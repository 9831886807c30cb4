"""The Litestar set-up the three services share: errors, request ids, health, and typed state injected by name.

Each service describes what its handlers use as one dataclass (its *state*), built once at start-up by an async
context manager and never written during a request. Handlers ask for a field by naming it as a parameter
(``db: Engine``, ``completions: CompletionService``): every field is a Litestar dependency.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, TypeVar

from litestar import Litestar
from litestar.datastructures import State
from litestar.di import Provide
from litestar.types import ControllerRouterHandler, ExceptionHandlersMap, Middleware

from shared.errors import ServiceUnavailableError
from shared.http import EXCEPTION_HANDLERS, healthz
from shared.logs import request_id_middleware

T = TypeVar("T")
_STATE_KEY = "service_state"

StartServices = Callable[[], AbstractAsyncContextManager[object]]


def typed_state(state: State, kind: type[T]) -> T:
    """The service's state object, as its own type; a 503 before start-up has built it."""
    value = state.get(_STATE_KEY)
    if not isinstance(value, kind):
        raise ServiceUnavailableError("the service is still starting")
    return value


def state_dependencies(kind: type[Any]) -> dict[str, Provide]:
    """One dependency per field of the dataclass ``kind``, named as the field."""

    def provider(name: str) -> Provide:
        def provide(state: State) -> Any:
            return getattr(typed_state(state, kind), name)

        provide.__name__ = f"provide_{name}"
        return Provide(provide, sync_to_thread=False)

    return {field.name: provider(field.name) for field in dataclasses.fields(kind)}


def create_service_app(
    *,
    route_handlers: Sequence[ControllerRouterHandler],
    start: StartServices,
    state_type: type[Any],
    middleware: Sequence[Middleware] = (),
    on_response: Callable[[str, int], None] | None = None,
    exception_handlers: ExceptionHandlersMap | None = None,
    **options: Any,
) -> Litestar:
    """A Litestar app with what every tierline service has.

    - ``/healthz`` before the service's own routes;
    - the one error tree (``ApplicationError``), Litestar's 4xx and anything unexpected in the OpenAI error shape
      (``exception_handlers`` adds to or overrides that map);
    - a request id on every request, an access line and ``on_response(path, status)`` after each: outermost,
      around Litestar's router and its error handling, so that they see every response, the router's own 404
      and 405 included (Litestar runs ``middleware`` around route handlers only, after routing);
    - the process's logging left as configured (text or JSON);
    - ``start()`` entered at start-up: what it yields is the state (a ``state_type`` dataclass) whose fields the
      handlers take by name; it is exited at shutdown after the last request.
    """

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        async with start() as services:
            if not isinstance(services, state_type):
                raise TypeError(f"start() yielded a {type(services).__name__}, not a {state_type.__name__}")
            app.state[_STATE_KEY] = services
            yield

    app = Litestar(
        logging_config=None,
        route_handlers=[healthz, *route_handlers],
        dependencies=state_dependencies(state_type),
        exception_handlers={**EXCEPTION_HANDLERS, **(exception_handlers or {})},
        middleware=list(middleware),
        lifespan=[lifespan],
        **options,
    )
    app.asgi_handler = request_id_middleware(app.asgi_handler, on_response)
    return app

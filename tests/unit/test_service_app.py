"""The set-up the three services share: typed state injected by field name, errors, request ids, lifespan."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
from litestar import get
from litestar.datastructures import State
from litestar.testing import TestClient

from shared.errors import NotFoundError, ServiceUnavailableError
from shared.service_app import create_service_app, state_dependencies, typed_state

# The apps name their dependencies by parameter name, as Litestar 2 infers them (explicit markers come with 3.0).
pytestmark = pytest.mark.filterwarnings("ignore::litestar.exceptions.LitestarDeprecationWarning")


@dataclass
class Counter:
    hits: int = 0
    events: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoState:
    counter: Counter
    greeting: str


@get("/hit", sync_to_thread=False)
def hit(counter: Counter, greeting: str) -> dict[str, object]:
    counter.hits += 1
    return {"greeting": greeting, "hits": counter.hits}


@get("/missing", sync_to_thread=False)
def missing() -> None:
    raise NotFoundError("no such thing", param="thing")


def _app(counter: Counter) -> object:
    @asynccontextmanager
    async def start() -> AsyncIterator[DemoState]:
        counter.events.append("start")
        yield DemoState(counter=counter, greeting="hello")
        counter.events.append("stop")

    return create_service_app(route_handlers=[hit, missing], start=start, state_type=DemoState)


def test_handlers_take_the_start_up_state_by_field_name() -> None:
    counter = Counter()
    with TestClient(_app(counter)) as client:  # type: ignore[type-var]
        assert counter.events == ["start"]
        assert client.get("/hit").json() == {"greeting": "hello", "hits": 1}
        assert client.get("/hit").json() == {"greeting": "hello", "hits": 2}
    assert counter.events == ["start", "stop"]


def test_every_service_has_health_request_ids_and_openai_shaped_errors() -> None:
    with TestClient(_app(Counter())) as client:  # type: ignore[type-var]
        health = client.get("/healthz", headers={"x-request-id": "abc-123"})
        assert health.json() == {"status": "ok"}
        assert health.headers["x-request-id"] == "abc-123"
        error = client.get("/missing")
        assert error.status_code == 404
        assert error.json()["error"] == {
            "message": "no such thing",
            "type": "invalid_request_error",
            "param": "thing",
            "code": "not_found",
        }
        assert error.headers["x-request-id"]
        unknown = client.get("/nowhere")
        assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "invalid_request_error"


def test_state_read_before_start_up_is_a_503() -> None:
    with pytest.raises(ServiceUnavailableError, match="still starting"):
        typed_state(State(), DemoState)


def test_one_dependency_per_state_field() -> None:
    assert sorted(state_dependencies(DemoState)) == ["counter", "greeting"]


def test_start_must_yield_the_declared_state_type() -> None:
    @asynccontextmanager
    async def start() -> AsyncIterator[object]:
        yield Counter()

    app = create_service_app(route_handlers=[hit], start=start, state_type=DemoState)
    with pytest.raises(ExceptionGroup) as raised, TestClient(app):
        pass
    assert raised.group_contains(TypeError, match="not a DemoState")

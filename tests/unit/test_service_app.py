"""The set-up the three services share: typed state injected by field name, errors, request ids, lifespan."""

from __future__ import annotations

import logging
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


def _app(counter: Counter, responses: list[tuple[str, int]] | None = None) -> object:
    @asynccontextmanager
    async def start() -> AsyncIterator[DemoState]:
        counter.events.append("start")
        yield DemoState(counter=counter, greeting="hello")
        counter.events.append("stop")

    on_response = (lambda path, status: responses.append((path, status))) if responses is not None else None
    return create_service_app(route_handlers=[hit, missing], start=start, state_type=DemoState, on_response=on_response)


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
        assert unknown.headers["x-request-id"]  # the router's own answers carry one too


def test_every_response_is_logged_and_counted_the_routers_own_included(caplog: pytest.LogCaptureFixture) -> None:
    """The access line and ``on_response`` (the cloud's response counter) see every response: a route's, its
    errors, and what Litestar's router answers before any route (404 for an unknown path, 405 for a method the
    path does not take), which middleware given to Litestar never sees."""
    responses: list[tuple[str, int]] = []
    with caplog.at_level(logging.INFO, logger="tierline.access"), TestClient(_app(Counter(), responses)) as client:  # type: ignore[type-var]
        client.get("/hit")
        client.get("/missing")
        client.get("/no-such-route")
        client.post("/hit")
    assert responses == [("/hit", 200), ("/missing", 404), ("/no-such-route", 404), ("/hit", 405)]
    lines = [r.getMessage() for r in caplog.records if r.name == "tierline.access"]
    assert lines == ["GET /hit 200", "GET /missing 404", "GET /no-such-route 404", "POST /hit 405"]


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

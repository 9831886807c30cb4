"""JSON logs carry the request id that the response echoes; ids clients choose are only for correlation."""

from __future__ import annotations

import io
import json
import logging

from litestar import Litestar, get
from litestar.testing import TestClient

from shared.http import EXCEPTION_HANDLERS
from shared.logs import JsonFormatter, request_id_middleware, server_request_id

log = logging.getLogger("tierline.test")


@get("/work", sync_to_thread=False)
def work() -> dict[str, str]:
    log.info("working", extra={"model": "tierline/lm-cloud"})
    return {"usage_id": server_request_id()}


@get("/boom", sync_to_thread=False)
def boom() -> None:
    raise RuntimeError("kaput")


def _app() -> Litestar:
    return Litestar(
        [work, boom], middleware=[request_id_middleware], exception_handlers=EXCEPTION_HANDLERS, logging_config=None
    )


def _captured() -> tuple[io.StringIO, logging.Handler]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    return out, handler


def test_every_log_line_of_a_request_carries_its_id_as_json() -> None:
    out, handler = _captured()
    try:
        with TestClient(_app()) as client:
            r = client.get("/work", headers={"x-request-id": "corr-42"})
    finally:
        logging.getLogger().removeHandler(handler)
    assert r.status_code == 200 and r.headers["x-request-id"] == "corr-42"
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    mine = [line for line in lines if line.get("request_id") == "corr-42"]
    assert {line["logger"] for line in mine} >= {"tierline.test", "tierline.access"}
    working = next(line for line in mine if line["message"] == "working")
    assert working["model"] == "tierline/lm-cloud" and working["level"] == "INFO" and working["ts"].endswith("+00:00")
    access = next(line for line in mine if line["logger"] == "tierline.access")
    assert access["status"] == 200 and access["path"] == "/work" and access["duration_ms"] >= 0
    # The client chose the id, so the server bills under another one.
    assert r.json()["usage_id"] != "corr-42"


def test_an_id_is_made_when_the_client_sends_none_or_a_bad_one() -> None:
    with TestClient(_app()) as client:
        plain = client.get("/work")
        bad = client.get("/work", headers={"x-request-id": "has spaces and {braces}"})
        failing = client.get("/boom", headers={"x-request-id": "err-1"})
    assert len(plain.headers["x-request-id"]) == 32
    assert plain.json()["usage_id"] == plain.headers["x-request-id"]  # no client id: one id for both
    assert bad.headers["x-request-id"] != "has spaces and {braces}" and len(bad.headers["x-request-id"]) == 32
    assert failing.status_code == 500 and failing.headers["x-request-id"] == "err-1"

"""Logging for every tierline process: one JSON object per line (``TIERLINE_LOG_FORMAT=json``, the default in
production) or readable text, each record carrying the request id of the HTTP request it belongs to.

The request id is the client's ``x-request-id`` when it is a sane token (1-64 letters, digits, ``-`` or
``_``), otherwise a fresh one; the middleware echoes it on every response, errors included, and every log
line written while the request runs carries it. It is for correlation only: what a request is billed
under (``x-tierline-usage-id``) is always chosen by the server. Log records never carry secrets: keys, tokens and
passwords are not logged anywhere in the code base.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Callable
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (types only: a CLI command or an engine process need not import the web framework)
    from litestar.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID: ContextVar[str | None] = ContextVar("tierline_request_id", default=None)
CLIENT_CHOSE_ID: ContextVar[bool] = ContextVar("tierline_client_chose_request_id", default=False)
_SANE_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}
access_logger = logging.getLogger("tierline.access")


def request_id() -> str | None:
    return REQUEST_ID.get()


def server_request_id() -> str:
    """An id the server chose for this request: the middleware's when the client sent none, else a fresh
    one. Usage records are keyed by it: an id a client picks must never decide what is billed (a reused
    ``x-request-id`` would otherwise be skipped as a duplicate)."""
    rid = REQUEST_ID.get()
    return rid if rid is not None and not CLIENT_CHOSE_ID.get() else uuid.uuid4().hex


def sane_request_id(value: str | None) -> str:
    return value if value is not None and _SANE_ID.match(value) else uuid.uuid4().hex


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "message", "request_id", ...extra fields, "exc"}``, one per line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        rid = getattr(record, "request_id", None) or REQUEST_ID.get()
        if rid:
            out["request_id"] = rid
        for key, value in record.__dict__.items():
            if key not in _STANDARD and key not in out and not key.startswith("_"):
                out[key] = value if isinstance(value, str | int | float | bool | type(None)) else str(value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


class _TextWithRequestId(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        rid = REQUEST_ID.get()
        return f"{text} [request {rid}]" if rid else text


def configure(level: str, fmt: str) -> None:
    """Root logging for a tierline process: ``fmt`` is ``json`` or ``text``."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(_TextWithRequestId("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    if level.upper() != "DEBUG":
        for chatty in ("httpx", "alembic.runtime.plugins"):
            logging.getLogger(chatty).setLevel(logging.WARNING)


def request_id_middleware(app: ASGIApp, on_response: Callable[[str, int], None] | None = None) -> ASGIApp:
    """Give every HTTP request an id (the client's, if sane), echo it as ``x-request-id`` on the response,
    make it visible to logging, and write one access line per request; ``on_response(path, status)`` after each
    (a service's response counter: one wrapper of ``send`` for both, on the path of every streamed event)."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        given = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"x-request-id"), None)
        rid = sane_request_id(given)
        token = REQUEST_ID.set(rid)
        chose = CLIENT_CHOSE_ID.set(rid == given)
        started = time.perf_counter()
        status = {"code": 500}

        async def with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                headers = list(message.get("headers", []))
                if not any(k.lower() == b"x-request-id" for k, _ in headers):
                    message["headers"] = [*headers, (b"x-request-id", rid.encode())]
            await send(message)

        try:
            await app(scope, receive, with_id)
        finally:
            if on_response is not None:
                on_response(scope.get("path", ""), status["code"])
            access_logger.info(
                "%s %s %s",
                scope.get("method", ""),
                scope.get("path", ""),
                status["code"],
                extra={
                    "method": scope.get("method", ""),
                    "path": scope.get("path", ""),
                    "status": status["code"],
                    "duration_ms": round((time.perf_counter() - started) * 1000, 2),
                },
            )
            REQUEST_ID.reset(token)
            CLIENT_CHOSE_ID.reset(chose)

    return wrapped

"""What every tierline HTTP service shares: error mapping to the OpenAI shape, health routes, serving."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from litestar import Request, Response, get
from litestar.exceptions import HTTPException, SerializationException
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import OpenAPIMediaType, OpenAPIResponse, OpenAPIType, Operation, Schema
from litestar.response import Stream
from litestar.response.base import ASGIResponse
from litestar.response.streaming import ASGIStreamingResponse
from litestar.status_codes import HTTP_500_INTERNAL_SERVER_ERROR
from litestar.types import ExceptionHandlersMap, Receive, Send
from pydantic import BaseModel

from shared.errors import ApplicationError, default_code
from shared.openai_responses import SSE_DONE
from shared.openai_schema import UNSUPPORTED_MESSAGE, UNSUPPORTED_REASON, validation_code

logger = logging.getLogger(__name__)

_HTTP_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


SSE_MEDIA_TYPE = "text/event-stream"


class EventStream(Stream):
    """A server-sent event stream, sent with less work per event than Litestar's ``Stream``.

    Litestar runs each stream in an anyio task group (a second task listening for the client's disconnect, and a
    cancel scope torn down at the end): ~44 µs a response against ~7 µs here. Here the disconnect listener is a
    plain task whose answer cancels the streaming task, so a client that leaves stops its stream's generator at
    once, as there. And the event ``data: [DONE]`` goes out as the body's end (one write, not two): the client has
    its whole answer before the generator's clean-up after that event (usage metering) runs.
    """

    def to_asgi_response(self, *args: Any, **kwargs: Any) -> ASGIResponse:
        response = super().to_asgi_response(*args, **kwargs)
        assert type(response) is ASGIStreamingResponse
        response.__class__ = _ASGIEventStream  # the same object layout: only ``send_body`` differs
        return response


class _ASGIEventStream(ASGIStreamingResponse):
    __slots__ = ()

    async def send_body(self, send: Send, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None
        state = {"complete": False, "left": False}

        async def disconnected() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        def on_disconnect(listener: asyncio.Future[None]) -> None:
            if not listener.cancelled() and listener.exception() is None and not state["complete"]:
                state["left"] = True
                task.cancel()

        listener = asyncio.ensure_future(disconnected())
        listener.add_done_callback(on_disconnect)
        try:
            async for chunk in self.iterator:
                if state["complete"]:
                    continue  # nothing goes after the body's end
                body = chunk if isinstance(chunk, bytes) else chunk.encode(self.encoding)
                state["complete"] = body.endswith(SSE_DONE)
                await send({"type": "http.response.body", "body": body, "more_body": not state["complete"]})
            if not state["complete"]:
                state["complete"] = True
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if state["left"] and task.uncancel() == 0:
                return  # the client left: the stream ends here (its generator has run its clean-up)
            raise
        finally:
            state["complete"] = True
            listener.cancel()
            aclose = getattr(self.iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """What every error response carries: the OpenAI error shape."""

    error: ErrorDetail


def error_responses(*status_codes: int) -> dict[int, ResponseSpec]:
    """OpenAPI ``responses`` for a route's errors, each in the OpenAI shape (replaces Litestar's default 400)."""
    return {
        code: ResponseSpec(ErrorBody, description=HTTPStatus(code).phrase, generate_examples=False)
        for code in status_codes
    }


@dataclass
class StreamingOperation(Operation):
    """An operation whose 200 is JSON, or server-sent events when the request asked for ``stream: true``."""

    def __post_init__(self) -> None:
        ok = (self.responses or {}).get("200")
        if isinstance(ok, OpenAPIResponse):
            # The schema of one event (as OpenAPI tools read text/event-stream): its data is a JSON chunk, and
            # the last event's is ``[DONE]``.
            text = Schema(type=OpenAPIType.STRING)
            event = Schema(
                type=OpenAPIType.OBJECT,
                properties={"data": text, "event": text, "id": text},
                required=["data"],
                description="one server-sent event: `data` is a JSON chunk of the response; the last is [DONE]",
            )
            events = OpenAPIMediaType(schema=event)
            ok.content = {**(ok.content or {}), SSE_MEDIA_TYPE: events}


def application_error_handler(_: Request[Any, Any, Any], exc: ApplicationError) -> Response[dict[str, Any]]:
    retry_after: float | None = getattr(exc, "retry_after", None)  # 429s, and 409s that say when to retry
    headers = {"Retry-After": str(max(1, round(retry_after)))} if retry_after is not None else None
    return Response(exc.to_openai(), status_code=exc.status_code, headers=headers)


_NAMED_FIELD = re.compile(r"([a-z_][a-z0-9_.]*): (.+)", re.DOTALL)


def http_error_handler(_: Request[Any, Any, Any], exc: HTTPException) -> Response[dict[str, Any]]:
    """Litestar's own 4xx (bad JSON, body validation, unknown route, wrong method, body too large) in the OpenAI
    error shape, each with a ``code``.

    A body that fails validation names its first bad field: ``param`` is the field's path and the message
    starts with it; its ``code`` says how it failed (``unsupported_parameter``, ``missing_required_parameter``,
    ``invalid_type``, ``invalid_value``). A body that is not JSON is ``invalid_json``; any other status has
    ``shared.errors.default_code``'s.
    """
    message, param, code = exc.detail, None, default_code(exc.status_code)
    extra = getattr(exc, "extra", None)
    if isinstance(extra, list) and extra and isinstance(extra[0], dict) and "message" in extra[0]:
        # A field the schema does not know comes first: it is the error a client most needs to hear about.
        first = next((e for e in extra if e.get("message") == UNSUPPORTED_MESSAGE), extra[0])
        # The field's path, without the tags pydantic adds for a union's members (``literal['none','auto']``).
        param = ".".join(p for p in str(first.get("key") or "").split(".") if "[" not in p) or None
        reason = str(first["message"]).removeprefix("Value error, ")
        code = validation_code(reason)
        if reason == UNSUPPORTED_MESSAGE:
            reason = UNSUPPORTED_REASON
        elif param is None and (named := _NAMED_FIELD.match(reason)):  # a check across fields names its field
            param, reason = named[1], named[2]
        elif param == "data" and reason == "'data'":  # no body at all: Litestar's "missing data" error
            param, reason, code = None, "the request body is empty: a JSON object is expected", "invalid_json"
        message = f"{param}: {reason}" if param else reason
    elif extra:
        message = f"{message}: {extra}"
    elif isinstance(exc.__cause__, SerializationException):  # the body is not JSON (Litestar's own 400)
        code = "invalid_json"
        message = f"the request body is not valid JSON: {exc.__cause__}"
    body = {
        "error": {
            "message": message,
            "type": _HTTP_TYPES.get(
                exc.status_code, "invalid_request_error" if exc.status_code < 500 else "server_error"
            ),
            "param": param,
            "code": code,
        }
    }
    return Response(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))


def unexpected_error_handler(request: Request[Any, Any, Any], exc: Exception) -> Response[dict[str, Any]]:
    logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    body = {"error": {"message": "internal error", "type": "server_error", "param": None, "code": None}}
    return Response(body, status_code=HTTP_500_INTERNAL_SERVER_ERROR)


EXCEPTION_HANDLERS: ExceptionHandlersMap = {
    ApplicationError: application_error_handler,
    HTTPException: http_error_handler,
    Exception: unexpected_error_handler,
}


@get("/healthz", sync_to_thread=False, include_in_schema=False)
def healthz() -> dict[str, str]:
    """Liveness: the process answers."""
    return {"status": "ok"}


def serve(app: Any, host: str, port: int, *, log_level: str = "info") -> None:
    """Run ``app`` with uvicorn; SIGTERM drains in-flight requests, a second signal forces exit."""
    import uvicorn

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level.lower(),
        log_config=None,  # uvicorn's loggers propagate to the root handler tierline configured (text or JSON)
        access_log=False,
        timeout_graceful_shutdown=30,
        lifespan="on",
    )
    uvicorn.Server(config).run()

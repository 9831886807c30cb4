"""``POST /v1/responses`` on the cloud: OpenAI's Responses API as a chat completion (``shared.responses_api``).

The request is translated to chat and handed to ``CompletionService.chat``, so it is authenticated, limited,
budgeted, routed (canary), metered (one usage record, under ``x-tierline-usage-id``) exactly as a chat completion
is, and an ``Idempotency-Key`` replays the stored Response as it does chat's; the answer is translated back, with
``stream: true`` as the Responses API's server-sent events. No async jobs: ``background`` is refused.

The route is built by ``responses_route`` from what the app defines (its caller dependency, its state type and its
idempotent call), so this module does not import the app that registers it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any, Protocol, TypeAlias

from litestar import Request, Response, post
from litestar.di import Provide
from litestar.handlers import HTTPRouteHandler

from cloud.gateway.idempotency import IdempotencyStore
from cloud.serving.completions import Caller, CompletionService
from shared.http import StreamingOperation, error_responses
from shared.openai_schema import ChatCompletionRequest
from shared.responses_api import ResponsesRequest, to_response
from shared.responses_stream import stream_events
from shared.service_app import typed_state

Answer: TypeAlias = dict[str, Any] | AsyncIterator[bytes]
# The app's ``_idempotent``: run the call, or replay the stored answer of an earlier one with the same key.
Idempotent: TypeAlias = Callable[
    [
        Request[Any, Any, Any],
        IdempotencyStore,
        Caller,
        Callable[[], dict[str, Any]],
        bool,
        Callable[[], Awaitable[Answer]],
    ],
    Awaitable[Response[Any]],
]


class ChatState(Protocol):
    """The app's state, as far as this route reads it."""

    @property
    def completions(self) -> CompletionService: ...

    @property
    def idempotency(self) -> IdempotencyStore: ...


def responses_route(
    caller: dict[str, Provide], state_type: type[ChatState], idempotent: Idempotent
) -> HTTPRouteHandler:
    """The ``POST /v1/responses`` handler, its caller resolved by ``caller`` (the inference routes' dependency)."""

    @post(
        "/v1/responses",
        dependencies=caller,
        status_code=200,
        security=[{"BearerAuth": []}],
        responses=error_responses(400, 401, 403, 404, 409, 413, 422, 429),
        operation_class=StreamingOperation,
    )
    async def create_response(request: Request[Any, Any, Any], caller: Caller, data: ResponsesRequest) -> Response[Any]:
        """OpenAI's Responses API (stateless: ``store: false``), with ``stream: true`` as server-sent events."""
        state = typed_state(request.app.state, state_type)
        chat = data.to_chat(ChatCompletionRequest)

        async def call() -> Answer:
            result = await state.completions.chat(caller, chat)
            return to_response(data, result) if isinstance(result, dict) else stream_events(data, result)

        body = partial(data.model_dump, mode="json", by_alias=True, exclude_unset=True)
        return await idempotent(request, state.idempotency, caller, body, bool(data.stream), call)

    return create_response

"""``POST /v1/responses`` on the edge agent: OpenAI's Responses API as a chat completion (``shared.responses_api``).

The request is translated to chat and goes through the agent's tiering as a chat completion does: answered on the
device (a usage record in the outbox) or escalated to the cloud as chat (``x-tierline-tier`` says which, as for
chat); the answer is translated back, with ``stream: true`` as the Responses API's server-sent events. An error the
cloud answered an escalation with is relayed as it is.

The route is built by ``responses_route`` from what the app defines (its local-key guard and its chat request
type), so this module does not import the app that registers it.
"""

from __future__ import annotations

from typing import Any, TypeAlias

from litestar import Request, Response, post
from litestar.di import Provide
from litestar.handlers import HTTPRouteHandler
from litestar.params import SkipValidation

from edge_agent.tiering import Tiering
from shared.http import EventStream
from shared.openai_schema import ChatCompletionRequest
from shared.responses_api import ResponsesRequest, to_response
from shared.responses_stream import stream_events

# Passed to the handler as is: a dataclass holding a lock, which Litestar's signature model cannot describe.
TieringDependency: TypeAlias = SkipValidation[Tiering]


def responses_route(auth: dict[str, Provide], chat_type: type[ChatCompletionRequest]) -> HTTPRouteHandler:
    """The ``POST /v1/responses`` handler, guarded by ``auth`` (the ``_auth`` dependency of the local API), its
    request answered as a ``chat_type`` (the device's chat request)."""

    @post("/v1/responses", dependencies=auth, status_code=200)
    async def create_response(
        request: Request[Any, Any, Any], tiering: TieringDependency, _auth: None, data: ResponsesRequest
    ) -> Response[Any]:
        """OpenAI's Responses API (stateless: ``store: false``): answered on the device or escalated."""
        chat = data.to_chat(chat_type)
        subject = request.headers.get("x-tierline-subject")
        answer = await tiering.handle("chat.completions", chat, request.headers.get("x-tierline-tier"), subject)
        if not isinstance(answer.body, dict):
            body = stream_events(data, answer.body)
            return EventStream(
                body, media_type="text/event-stream", headers={**answer.headers, "Cache-Control": "no-cache"}
            )
        if answer.status_code != 200:  # the cloud refused the escalation: its OpenAI-shaped error as it is
            return Response(answer.body, status_code=answer.status_code, headers=answer.headers)
        return Response(to_response(data, answer.body), headers=answer.headers)

    return create_response

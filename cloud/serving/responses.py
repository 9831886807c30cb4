"""How the cloud answers an inference request: JSON, or server-sent events for streams."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from litestar import Response

from shared.http import EventStream

if TYPE_CHECKING:  # the engine (torch) loads only where requests are served, not for CLI commands
    from cloud.serving.completions import Caller

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def respond(caller: Caller, result: dict[str, Any] | AsyncIterator[bytes]) -> Response[Any]:
    headers = {"x-tierline-usage-id": caller.request_id, "x-tierline-tier": "cloud"}
    if caller.escalation_reason:
        headers["x-tierline-escalation-reason"] = caller.escalation_reason
    if caller.model_version:
        headers["x-tierline-model-version"] = caller.model_version
    if isinstance(result, dict):
        return Response(result, headers=headers)
    return EventStream(result, media_type="text/event-stream", headers={**headers, **SSE_HEADERS})

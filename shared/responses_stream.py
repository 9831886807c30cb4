r"""The Responses API's server-sent events (``POST /v1/responses`` with ``stream: true``), made from the chat
completion stream that answers the request (``shared.responses_api``).

Each event is ``event: <type>`` and ``data: <json>`` with its ``sequence_number``, in OpenAI's order:
``response.created``, ``response.in_progress``; per output item ``response.output_item.added``, then for the
message ``response.content_part.added``, ``response.output_text.delta``\ s, ``response.output_text.done``,
``response.content_part.done``, or for a function call ``response.function_call_arguments.delta``\ s and
``.done``; ``response.output_item.done``; last ``response.completed`` (or ``response.incomplete`` for a
``max_output_tokens`` cut) with the whole Response and its usage. A failure after the 200 went out is an ``error``
event and ``response.failed``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from shared.errors import ApplicationError
from shared.responses_api import (
    ResponsesRequest,
    call_item,
    envelope,
    id_suffix,
    incomplete_reason,
    message_item,
    status_of,
    usage,
)

logger = logging.getLogger(__name__)

_encode = msgspec.json.Encoder().encode


@dataclass(slots=True)
class _Item:
    """One output item being streamed: the message's text, or a call's name and arguments."""

    item_id: str
    kind: Literal["message", "function_call"]
    text: str = ""
    call_id: str = ""
    name: str = ""

    def body(self, status: str) -> dict[str, Any]:
        if self.kind == "message":
            return message_item(self.item_id, self.text, status)
        return call_item(self.item_id, self.call_id, self.name, self.text, status)


@dataclass(slots=True)
class _Translator:
    """Chat completion chunks in, Responses events out (each numbered by ``sequence_number``)."""

    req: ResponsesRequest
    response: dict[str, Any]
    suffix: str
    sequence_number: int = 0
    items: list[_Item] = field(default_factory=list)
    is_open: bool = False  # the last item is still streaming
    calls: dict[int, int] = field(default_factory=dict)  # a chat tool call's index -> its output index
    finish_reason: str | None = None

    def event(self, kind: str, **payload: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence_number, **payload}
        self.sequence_number += 1
        return b"event: " + kind.encode() + b"\ndata: " + _encode(data) + b"\n\n"

    def snapshot(self, status: str) -> dict[str, Any]:
        return {**self.response, "status": status}

    def open_message(self) -> list[bytes]:
        events = self.close()
        item = _Item(f"msg_{self.suffix}", "message")
        self.items.append(item)
        self.is_open = True
        index = len(self.items) - 1
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        events.append(self.event("response.output_item.added", output_index=index, item=item.body("in_progress")))
        events.append(
            self.event(
                "response.content_part.added", item_id=item.item_id, output_index=index, content_index=0, part=part
            )
        )
        return events

    def open_call(self, call_index: int, call_id: str, name: str) -> list[bytes]:
        events = self.close()
        item = _Item(f"fc_{self.suffix}_{call_index}", "function_call", call_id=call_id, name=name)
        self.items.append(item)
        self.is_open = True
        self.calls[call_index] = len(self.items) - 1
        events.append(
            self.event("response.output_item.added", output_index=len(self.items) - 1, item=item.body("in_progress"))
        )
        return events

    def close(self, status: str = "completed") -> list[bytes]:
        """The events that end the item still streaming, if one is."""
        if not self.is_open:
            return []
        self.is_open = False
        index, item = len(self.items) - 1, self.items[-1]
        events = []
        if item.kind == "message":
            part = {"type": "output_text", "text": item.text, "annotations": [], "logprobs": []}
            where = {"item_id": item.item_id, "output_index": index, "content_index": 0}
            events.append(self.event("response.output_text.done", **where, text=item.text, logprobs=[]))
            events.append(self.event("response.content_part.done", **where, part=part))
        else:
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item.item_id,
                    output_index=index,
                    name=item.name,
                    arguments=item.text,
                )
            )
        events.append(self.event("response.output_item.done", output_index=index, item=item.body(status)))
        return events

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        """The events one chat chunk makes (its text, its calls' pieces); its usage and finish_reason are kept."""
        events: list[bytes] = []
        if chunk.get("usage"):
            self.response["usage"] = usage(chunk["usage"])
        if chunk.get("model"):
            self.response["model"] = chunk["model"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            text = delta.get("content")
            if text:
                if not (self.is_open and self.items[-1].kind == "message"):
                    events += self.open_message()
                item = self.items[-1]
                item.text += text
                where = {"item_id": item.item_id, "output_index": len(self.items) - 1, "content_index": 0}
                events.append(self.event("response.output_text.delta", **where, delta=text, logprobs=[]))
            for call in delta.get("tool_calls") or []:
                fn = call.get("function") or {}
                if call["index"] not in self.calls:
                    events += self.open_call(call["index"], call.get("id") or "", fn.get("name") or "")
                output_index = self.calls[call["index"]]
                if fn.get("arguments"):
                    item = self.items[output_index]
                    item.text += fn["arguments"]
                    events.append(
                        self.event(
                            "response.function_call_arguments.delta",
                            item_id=item.item_id,
                            output_index=output_index,
                            delta=fn["arguments"],
                        )
                    )
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return events

    def finish(self) -> list[bytes]:
        """The events that end the stream: the last item closed, then ``response.completed`` (or ``incomplete``)."""
        status = status_of(self.finish_reason)
        events = [] if self.items else self.open_message()  # no text and no call: one empty message, as unstreamed
        events += self.close(status)
        self.response["output"] = [item.body(status if item.kind == "message" else "completed") for item in self.items]
        self.response["status"] = status
        if status == "completed":
            self.response["completed_at"] = int(time.time())
        else:
            self.response["incomplete_details"] = {"reason": incomplete_reason(self.finish_reason)}
        return [*events, self.event(f"response.{status}", response=self.response)]

    def fail(self, error: dict[str, Any]) -> list[bytes]:
        """An ``error`` event, then ``response.failed`` (the Response with its ``error``)."""
        message = str(error.get("message") or "the response failed")
        code = error.get("code") if isinstance(error.get("code"), str) else None
        events = [self.event("error", code=code, message=message, param=error.get("param"))]
        failed_code = "rate_limit_exceeded" if code == "rate_limit_exceeded" else "server_error"
        self.response["output"] = [item.body("incomplete") for item in self.items]
        self.response["status"] = "failed"
        self.response["error"] = {"code": failed_code, "message": message}
        events.append(self.event("response.failed", response=self.response))
        return events


def _sse_payloads(buffer: bytearray) -> list[str]:
    """The ``data:`` payloads of the whole events at the start of ``buffer`` (removed from it)."""
    payloads = []
    while (end := buffer.find(b"\n\n")) != -1:
        block = bytes(buffer[:end]).decode()
        del buffer[: end + 2]
        data = [line[5:].lstrip(" ") for line in block.split("\n") if line.startswith("data:")]
        if data:
            payloads.append("\n".join(data))
    return payloads


async def stream_events(req: ResponsesRequest, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A chat completion stream (the answer to ``req.to_chat``: SSE bytes, usage included) as the Responses API's
    events: ``response.created``, ``response.in_progress``, each item's added / delta / done events, and
    ``response.completed`` or ``response.incomplete`` with the whole Response. An error in the chat stream, one
    raised by it, or a stream that ends before its answer does, is an ``error`` event and ``response.failed``.

    The last event goes out when the chat stream's ``[DONE]`` arrives, before the chat path's clean-up (metering)
    that follows it; ``chunks`` is still read to its end. Closing this iterator closes ``chunks`` (the chat path
    meters what was generated, as for chat)."""
    created_at = int(time.time())
    buffer = bytearray()
    t: _Translator | None = None
    is_done = False
    failure: dict[str, Any]

    def started(chunk: dict[str, Any]) -> tuple[_Translator, list[bytes]]:
        suffix = id_suffix(chunk.get("id"))
        model = str(chunk.get("model") or req.model)
        new = _Translator(req, envelope(req, f"resp_{suffix}", created_at, model, "in_progress"), suffix)
        opening = {"response": new.snapshot("in_progress")}
        return new, [new.event("response.created", **opening), new.event("response.in_progress", **opening)]

    try:
        async for raw in chunks:
            buffer += raw
            events: list[bytes] = []
            for payload in _sse_payloads(buffer):
                if payload == "[DONE]" or is_done:
                    if t is not None and t.finish_reason is not None and not is_done:
                        events += t.finish()
                        is_done = True
                    continue
                chunk = json.loads(payload)
                if t is None:
                    t, events = started(chunk)
                if "error" in chunk:
                    error = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
                    yield b"".join([*events, *t.fail(error)])
                    return
                events += t.chunk(chunk)
            if events:
                yield b"".join(events)
        if is_done:
            return
        if t is not None and t.finish_reason is not None:  # a chat stream without [DONE]
            yield b"".join(t.finish())
            return
        failure = {"message": "the answer ended before it was complete", "code": "server_error"}
    except ApplicationError as exc:  # the answer failed after the 200 went out: say so, in the stream
        failure = exc.to_openai()["error"]
    except Exception:
        logger.exception("a streamed response failed")
        failure = {"message": "internal error", "code": "server_error"}
    finally:
        close = getattr(chunks, "aclose", None)
        if close is not None:
            await close()
    events = []
    if t is None:
        t, events = started({})
    yield b"".join([*events, *t.fail(failure)])

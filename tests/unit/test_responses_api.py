"""``shared.responses_api``: a Responses request as the chat request that answers it, and the chat answer (whole,
or a stream cut anywhere) as the Response and the events the openai SDK's own types accept."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from pydantic import ValidationError as PydanticValidationError

from shared.errors import ValidationError
from shared.openai_schema import ChatCompletionRequest, request_error
from shared.responses_api import ResponsesRequest, to_response
from shared.responses_stream import stream_events

EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10, "prompt_tokens_details": {"cached_tokens": 2}}


def _request(**body: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "tierline/lm-cloud", "input": "hi", **body})


def _refusal(**body: Any) -> ValidationError:
    """The 400 a body gets, whether pydantic refuses it (as the routes report it) or the conversion does."""
    try:
        _request(**body).to_chat(ChatCompletionRequest)
    except PydanticValidationError as exc:
        return request_error(exc)
    except ValidationError as exc:
        return exc
    raise AssertionError(f"accepted: {body}")


def test_a_string_input_is_a_user_message_after_the_instructions() -> None:
    chat = _request(instructions="Answer in French.", max_output_tokens=16, temperature=0).to_chat(
        ChatCompletionRequest
    )
    assert [(m.role, m.content) for m in chat.messages] == [("system", "Answer in French."), ("user", "hi")]
    assert chat.max_tokens == 16 and chat.temperature == 0 and not chat.stream


def test_input_items_become_the_chat_conversation_with_its_tool_round_trip() -> None:
    items = [
        {
            "role": "developer",
            "content": [{"type": "input_text", "text": "Be "}, {"type": "input_text", "text": "terse"}],
        },
        {"type": "message", "role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city":"Lyon"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "12C"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "9C"}]},
        {  # an earlier response's output item, sent back as it came
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Mild.", "annotations": [], "logprobs": []}],
        },
    ]
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}]
    chat = _request(input=items, tools=tools).to_chat(ChatCompletionRequest)
    roles = [m.role for m in chat.messages]
    assert roles == ["developer", "user", "assistant", "tool", "tool", "assistant"]
    assert chat.messages[0].content == "Be terse"
    calls = chat.messages[2].tool_calls or []  # consecutive calls are one assistant turn
    assert [(c.id, c.function.name, c.function.arguments) for c in calls] == [
        ("call_1", "get_weather", '{"city":"Paris"}'),
        ("call_2", "get_weather", '{"city":"Lyon"}'),
    ]
    assert [(m.tool_call_id, m.content) for m in chat.messages[3:5]] == [("call_1", "12C"), ("call_2", "9C")]
    assert chat.tools is not None and chat.tools[0].function.parameters == WEATHER


def test_tools_choice_and_text_format_map_to_their_chat_fields() -> None:
    req = _request(
        tools=[{"type": "function", "name": "get_weather", "description": "w", "parameters": WEATHER}],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        stream=True,
    )
    chat = req.to_chat(ChatCompletionRequest)
    assert chat.tool_mode == "named" and chat.parallel_tool_calls is False
    assert chat.stream and chat.include_usage  # a stream's usage arrives, for response.completed
    fmt = {"type": "json_schema", "name": "City", "schema": WEATHER, "strict": True}
    chat = _request(text={"format": fmt}).to_chat(ChatCompletionRequest)
    assert chat.response_format is not None and chat.response_format.json_schema is not None
    assert chat.response_format.json_schema.name == "City" and chat.response_format.json_schema.schema_ == WEATHER
    assert _request(text={"format": {"type": "json_object"}}).to_chat(ChatCompletionRequest).is_structured


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"seed": 1}, "seed", "unsupported_parameter"),  # not a Responses field
        ({"truncation": "auto"}, "truncation", "unsupported_parameter"),
        ({"store": True}, "store", "unsupported_parameter"),
        ({"previous_response_id": "resp_1"}, "previous_response_id", "unsupported_parameter"),
        ({"reasoning": {"effort": "low"}}, "reasoning", "unsupported_parameter"),
        ({"include": ["message.output_text.logprobs"]}, "include", "unsupported_parameter"),
        ({"background": True}, "background", "unsupported_parameter"),
        ({"max_output_tokens": 8}, "max_output_tokens", "invalid_value"),  # OpenAI's minimum is 16
        ({"tool_choice": "required"}, "tool_choice", "invalid_value"),  # no tools
        ({"tools": [{"type": "web_search"}]}, "tools.0.type", "invalid_value"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.items.0",
            "invalid_value",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input.items.0", "invalid_value"),
        ({"input": 5}, "input", "invalid_type"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "invalid_value"),
        ({"user": "u" * 300}, "user", "invalid_value"),
    ],
)
def test_what_is_not_implemented_is_a_400_naming_the_field(body: dict[str, Any], param: str, code: str) -> None:
    err = _refusal(**body)
    assert err.status_code == 400 and err.param is not None and err.param.startswith(param), err.message
    assert err.code == code and err.message.startswith(err.param)


def test_what_asks_for_nothing_is_accepted() -> None:
    body = {"store": False, "include": [], "reasoning": None, "background": False, "metadata": {"k": "v"}}
    assert _request(**body).to_chat(ChatCompletionRequest).messages[0].content == "hi"


def _chat(content: str | None, finish_reason: str, calls: list[tuple[str, str]] = ()) -> dict[str, Any]:  # type: ignore[assignment]
    tool_calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
        for i, (n, a) in enumerate(calls)
    ]
    message = {"role": "assistant", "content": content, **({"tool_calls": tool_calls} if tool_calls else {})}
    return {
        "id": "chatcmpl-abc123",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "tierline/lm-cloud",
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
        "usage": USAGE,
    }


def test_a_chat_answer_is_a_response_the_sdk_accepts() -> None:
    req = _request(instructions="be brief", max_output_tokens=32, metadata={"a": "b"})
    response = Response.model_validate(to_response(req, _chat("Bonjour", "stop")), strict=True)
    assert response.id == "resp_abc123" and response.status == "completed" and response.output_text == "Bonjour"
    assert response.incomplete_details is None and response.completed_at is not None
    assert response.usage is not None and response.usage.input_tokens == 7 and response.usage.output_tokens == 3
    assert response.usage.input_tokens_details.cached_tokens == 2 and response.usage.total_tokens == 10
    assert (response.instructions, response.max_output_tokens, response.metadata) == ("be brief", 32, {"a": "b"})
    assert response.tool_choice == "auto" and response.parallel_tool_calls and response.tools == []

    cut = Response.model_validate(to_response(req, _chat("Bonj", "length")), strict=True)
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    (message,) = cut.output
    assert message.type == "message" and message.status == "incomplete"
    assert cut.incomplete_details.reason == "max_output_tokens"


def test_tool_calls_are_function_call_items() -> None:
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    req = _request(tools=tools, tool_choice="required")
    body = to_response(req, _chat(None, "tool_calls", [("get_weather", '{"city":"Paris"}'), ("get_weather", "{}")]))
    response = Response.model_validate(body, strict=True)
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(c.call_id, c.name, c.arguments) for c in calls] == [
        ("call_0", "get_weather", '{"city":"Paris"}'),
        ("call_1", "get_weather", "{}"),
    ]
    assert len(response.output) == 2 and response.output_text == "" and response.status == "completed"
    assert response.tools[0].type == "function" and response.tool_choice == "required"


# -- streams -------------------------------------------------------------------------------------------------------
def _sse(payload: dict[str, Any] | str) -> bytes:
    return b"data: " + (payload if isinstance(payload, str) else json.dumps(payload)).encode() + b"\n\n"


def _chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
    return {"id": "chatcmpl-s1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [choice]}


def _text_stream(finish_reason: str = "stop") -> bytes:
    pieces = [_chunk({"role": "assistant", "content": ""}), _chunk({"content": "Bon"}), _chunk({"content": "jour"})]
    pieces.append(_chunk({}, finish_reason))
    pieces.append({"id": "chatcmpl-s1", "object": "chat.completion.chunk", "created": 1, "choices": [], "usage": USAGE})
    return b"".join(map(_sse, pieces)) + _sse("[DONE]")


def _call_stream() -> bytes:
    first = {"index": 0, "id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    pieces = [
        _chunk({"role": "assistant"}),
        _chunk({"tool_calls": [first]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}, "tool_calls"),
        {"id": "chatcmpl-s1", "object": "chat.completion.chunk", "created": 1, "choices": [], "usage": USAGE},
    ]
    return b"".join(map(_sse, pieces)) + _sse("[DONE]")


class _Source:
    """Chat SSE bytes cut into pieces of ``size`` bytes (events split anywhere); records being closed."""

    def __init__(self, data: bytes, size: int, fail: Exception | None = None) -> None:
        self.pieces = [data[i : i + size] for i in range(0, len(data), size)]
        self.fail = fail
        self.closed = False
        self.ended = False  # read to its end (the chat path's clean-up after [DONE] ran)

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        if not self.pieces:
            if self.fail is not None:
                raise self.fail
            self.ended = True
            raise StopAsyncIteration
        return self.pieces.pop(0)

    async def aclose(self) -> None:
        self.closed = True


def _events(req: ResponsesRequest, source: _Source) -> list[Any]:
    async def run() -> bytes:
        return b"".join([e async for e in stream_events(req, source)])

    raw = asyncio.run(run()).decode()
    events = []
    for block in raw.split("\n\n")[:-1]:
        kind, data = block.split("\n")
        event = EVENTS.validate_python(json.loads(data.removeprefix("data: ")), strict=True)
        assert kind == f"event: {event.type}"
        events.append(event)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert source.closed
    return events


@pytest.mark.parametrize("size", [1, 7, 10_000])
def test_a_text_stream_is_the_responses_events_in_order(size: int) -> None:
    events = _events(_request(stream=True), _Source(_text_stream(), size))
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == "Bonjour" == final.output_text == events[6].text
    assert final.id == "resp_s1" and final.status == "completed" and final.usage.output_tokens == 3
    assert events[0].response.status == "in_progress" and events[0].response.output == []


def test_a_cut_stream_ends_incomplete() -> None:
    events = _events(_request(stream=True, max_output_tokens=16), _Source(_text_stream("length"), 5))
    final = events[-1]
    assert final.type == "response.incomplete" and final.response.status == "incomplete"
    assert final.response.incomplete_details.reason == "max_output_tokens" and final.response.output_text == "Bonjour"


def test_a_streamed_call_is_a_function_call_item_with_its_argument_deltas() -> None:
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    events = _events(_request(stream=True, tools=tools), _Source(_call_stream(), 3))
    kinds = [e.type for e in events]
    assert kinds[2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = events[5]
    assert deltas == done.arguments == '{"city":"Paris"}' and done.name == "get_weather"
    (item,) = events[-1].response.output
    assert (item.type, item.call_id, item.name, item.arguments) == ("function_call", "call_a", "get_weather", deltas)


def test_an_error_in_the_chat_stream_is_an_error_event_and_a_failed_response() -> None:
    broken = _sse(_chunk({"content": "Bon"})) + _sse({"error": {"message": "deadline", "type": "x", "code": None}})
    events = _events(_request(stream=True), _Source(broken, 4))
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2].message == "deadline" and events[-1].response.error.code == "server_error"


@pytest.mark.parametrize("fail", [None, RuntimeError("runtime died"), ValidationError("nope")])
def test_a_stream_that_ends_early_or_raises_is_a_failed_response(fail: Exception | None) -> None:
    events = _events(_request(stream=True), _Source(_sse(_chunk({"content": "Bon"})), 100, fail))
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert "runtime died" not in events[-2].message  # what went wrong inside is logged, not sent


def test_the_last_event_goes_out_at_done_and_the_chat_stream_is_still_read_to_its_end() -> None:
    source = _Source(_text_stream(), 10_000)

    async def run() -> tuple[bool, bool]:
        stream = stream_events(_request(stream=True), source)
        last = b""
        while b"response.completed" not in last:
            last = await anext(stream)
        ended_at_completed = source.ended
        assert [e async for e in stream] == []
        return ended_at_completed, source.ended and source.closed

    ended_at_completed, ended = asyncio.run(run())
    assert not ended_at_completed and ended  # sent before the clean-up that follows [DONE], which still ran

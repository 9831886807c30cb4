"""Tool calling with the openai SDK against a real cloud server and a real edge agent (ONNX Runtime): ``required``
and named choices give calls whose arguments validate against the function's schema, sampled and greedy, streamed
and not; ``auto`` gives valid text or valid calls; parallel calls when allowed, one when not; a conversation with an
assistant's ``tool_calls`` and a ``tool`` message goes through the chat template; max_tokens cutting a call says
"length" and reports no call; bad tools are a 400 naming the field.

The zoo's LMs are tiny and near-random: the shape of the calls is what is guaranteed and tested."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionMessageFunctionToolCall, ChatCompletionMessageParam
from pydantic import BaseModel, Field

from shared.chat_tokenizer import ChatTokenizer
from shared.zoo.registry import ZooLayout
from tests.integration.test_structured_outputs import CLOUD_LM, EDGE_LMS, PROMPTS, cloud, edge

pytestmark = pytest.mark.integration
__all__ = ["cloud", "edge"]  # the structured-output tests' servers, started again for this module
EDGE_LM = EDGE_LMS[0]


class Weather(BaseModel):
    city: str = Field(max_length=8)
    days: int = Field(ge=1, le=7)


class Timer(BaseModel):
    minutes: int = Field(ge=1, le=60)


MODELS: dict[str, type[BaseModel]] = {"get_weather": Weather, "set_timer": Timer}
TOOLS = [
    openai.pydantic_function_tool(Weather, name="get_weather"),
    openai.pydantic_function_tool(Timer, name="set_timer"),
]
MAX_TOKENS = 100  # a call is at most ~40 tokens here


def _model(tier: str) -> str:
    return CLOUD_LM if tier == "cloud" else EDGE_LM


def _client(request: pytest.FixtureRequest, tier: str) -> openai.OpenAI:
    client: openai.OpenAI = request.getfixturevalue(tier)
    return client


def _sampling(i: int) -> dict[str, Any]:
    return {"temperature": 0} if i % 2 == 0 else {"temperature": 1.0, "top_p": 0.95, "seed": i}


def _assert_calls(calls: list[Any] | None, names: set[str]) -> list[BaseModel]:
    """Every call well formed, of one of ``names``, its arguments valid under its function's schema."""
    assert calls, "no tool_calls"
    parsed = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and len(call.id) > 10
        assert call.function.name in names, call
        parsed.append(MODELS[call.function.name].model_validate_json(call.function.arguments))
    assert len({c.id for c in calls}) == len(calls)
    return parsed


def _function_calls(calls: list[Any] | None) -> list[ChatCompletionMessageFunctionToolCall]:
    return [c for c in calls or [] if isinstance(c, ChatCompletionMessageFunctionToolCall)]


def _streamed(client: openai.OpenAI, **body: Any) -> tuple[ChatCompletion, list[dict[str, Any]]]:
    """A stream's chunks' tool-call deltas, and the completion the SDK's stream helper assembles from them."""
    with client.chat.completions.stream(**body) as stream:
        deltas = [
            c.model_dump()
            for event in stream
            if event.type == "chunk"
            for choice in event.chunk.choices
            for c in choice.delta.tool_calls or ()
        ]
        return stream.get_final_completion(), deltas


def _joined(client: openai.OpenAI, **body: Any) -> ChatCompletion:
    """A raw stream's deltas joined into a completion, as a client does (the SDK's helper refuses a "length" end
    when the tools have schemas)."""
    content: str | None = None
    calls: dict[int, dict[str, Any]] = {}
    finish, usage = None, None
    for chunk in client.chat.completions.create(**body, stream=True):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            content = (
                content + choice.delta.content if content and choice.delta.content else content or choice.delta.content
            )
            for d in choice.delta.tool_calls or ():
                assert (d.id is not None) == (d.index not in calls)  # a call's id, type and name come first, once
                call = calls.setdefault(d.index, {"id": d.id, "type": d.type, "function": {"arguments": ""}})
                if d.function and d.function.name:
                    call["function"]["name"] = d.function.name
                call["function"]["arguments"] += (d.function.arguments if d.function else None) or ""
            finish = choice.finish_reason or finish
    message = {"role": "assistant", "content": content, "tool_calls": [calls[i] for i in sorted(calls)] or None}
    choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
    return ChatCompletion.model_validate(
        {
            "id": "x",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [choice],
            "usage": usage,
        }
    )


@pytest.mark.parametrize("tier", ["cloud", "edge"])
def test_required_and_named_choices_give_calls_that_validate(request: pytest.FixtureRequest, tier: str) -> None:
    client, model = _client(request, tier), _model(tier)
    n = 8 if tier == "cloud" else 6
    for i in range(n):
        named = i % 3 == 1
        choice: Any = {"type": "function", "function": {"name": "set_timer"}} if named else "required"
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"{PROMPTS[i % len(PROMPTS)]} (call {i})"}],
            "tools": TOOLS,
            "tool_choice": choice,
            "parallel_tool_calls": False,
            "max_tokens": MAX_TOKENS,
            **_sampling(i),
        }
        names = {"set_timer"} if named else set(MODELS)
        if i % 4 >= 2:  # streamed: OpenAI's deltas, assembled by the SDK
            final, deltas = _streamed(client, **body)
            first = deltas[0]
            assert first["index"] == 0 and first["id"].startswith("call_") and first["function"]["name"] in names
            assert all(d["id"] is None and d["function"]["name"] is None for d in deltas[1:])  # then arguments only
            joined = "".join(d["function"]["arguments"] or "" for d in deltas)
            (whole,) = final.choices[0].message.tool_calls or []
            assert isinstance(whole, ChatCompletionMessageFunctionToolCall) and joined == whole.function.arguments
        else:
            final = client.chat.completions.create(**body)
        c = final.choices[0]
        assert c.finish_reason == "tool_calls", (i, c)
        assert not c.message.content
        calls = _assert_calls(c.message.tool_calls, names)
        assert len(calls) == 1  # parallel_tool_calls: false


@pytest.mark.parametrize("tier", ["cloud", "edge"])
def test_auto_gives_valid_text_or_valid_calls(request: pytest.FixtureRequest, tier: str) -> None:
    client, model = _client(request, tier), _model(tier)
    kinds = []
    for i in range(6):
        stream = i % 2 == 1
        body: dict[str, Any] = {
            "model": model,
            # an assistant that began a call in the history: near-random LMs then start some answers with one
            "messages": [{"role": "user", "content": PROMPTS[i]}],
            "tools": TOOLS,
            "max_tokens": 40,
            "temperature": 1.0,
            "seed": 100 + i,
        }
        c = (_joined(client, **body) if stream else client.chat.completions.create(**body)).choices[0]
        if c.message.tool_calls:
            assert c.finish_reason == "tool_calls" and not c.message.content
            _assert_calls(c.message.tool_calls, set(MODELS))
            kinds.append("calls")
        else:
            assert c.finish_reason in ("stop", "length")
            assert c.message.content and not c.message.content.startswith("<tool_call>")
            kinds.append("text")
    assert len(kinds) == 6


def test_cloud_parallel_calls_when_allowed_and_n_choices(cloud: openai.OpenAI) -> None:
    counts = []
    for i in range(6):
        r = cloud.chat.completions.create(
            model=CLOUD_LM,
            messages=[{"role": "user", "content": f"{PROMPTS[i]} (parallel {i})"}],
            tools=TOOLS,
            tool_choice="required",
            max_tokens=200,
            temperature=1.0,
            seed=i,
            n=2,
        )
        assert len(r.choices) == 2
        for c in r.choices:
            if c.finish_reason == "length":  # many calls in a row may run out of tokens: the complete ones stay
                assert c.message.content is None
                if c.message.tool_calls:
                    _assert_calls(c.message.tool_calls, set(MODELS))
                continue
            assert c.finish_reason == "tool_calls"
            counts.append(len(_assert_calls(c.message.tool_calls, set(MODELS))))
    assert counts and max(counts) > 1, counts  # calls in parallel happen, and each one validates
    assert max(counts) <= 8


@pytest.mark.parametrize("tier", ["cloud", "edge"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_round_trip_through_a_tool_message(
    request: pytest.FixtureRequest, tier: str, stream: bool, tiny_zoo: Path
) -> None:
    client, model = _client(request, tier), _model(tier)
    question: ChatCompletionMessageParam = {"role": "user", "content": "weather in Oslo?"}
    first = client.chat.completions.create(
        model=model,
        messages=[question],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    (call,) = first.choices[0].message.tool_calls or []
    assert isinstance(call, ChatCompletionMessageFunctionToolCall)
    weather = Weather.model_validate_json(call.function.arguments)
    messages: list[ChatCompletionMessageParam] = [
        question,
        first.choices[0].message.model_dump(exclude_none=True),  # type: ignore[list-item]
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"city": weather.city, "temp_c": 7})},
    ]
    body: dict[str, Any] = {"model": model, "messages": messages, "tools": TOOLS, "max_tokens": 12, "temperature": 0}
    if stream:
        final = _joined(client, **body, stream_options={"include_usage": True})
    else:
        final = client.chat.completions.create(**body)
    c = final.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls")
    assert c.message.content or c.message.tool_calls
    # The history went through the model's template, the call in the format the grammar generates (the zoo's
    # template does not render tool calls itself), the tool's answer as a message of role "tool".
    args = call.function.arguments
    tok = ChatTokenizer(ZooLayout(tiny_zoo).artifact_dir(model.split("/")[-1]))
    prompt = tok.apply_chat_template(
        [
            {"role": "user", "content": "weather in Oslo?"},
            {
                "role": "assistant",
                "content": '<tool_call>\n{"name": "get_weather", "arguments": ' + args + "}\n</tool_call>",
            },
            {"role": "tool", "content": messages[2]["content"]},
        ]
    )
    assert final.usage is not None and final.usage.prompt_tokens == len(tok.encode(prompt))


@pytest.mark.parametrize("tier", ["cloud", "edge"])
def test_a_call_max_tokens_cuts_says_length_and_is_not_shown(request: pytest.FixtureRequest, tier: str) -> None:
    client, model = _client(request, tier), _model(tier)
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "timer"}],
        "tools": TOOLS,
        "tool_choice": "required",
        "max_tokens": 16,  # inside the call: the tiny tokenizer spends ~10 tokens on its opening
        "temperature": 0,
    }
    r = client.chat.completions.create(**body)
    c = r.choices[0]
    # All or nothing: the cut call is neither a call nor text (it was returned as '<tool_call>...' content).
    assert c.finish_reason == "length" and c.message.tool_calls is None and c.message.content is None
    chunks = list(client.chat.completions.create(**body, stream=True))
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["length"]
    assert not any(ch.choices[0].delta.tool_calls or ch.choices[0].delta.content for ch in chunks if ch.choices)


@pytest.mark.parametrize("tier", ["cloud", "edge"])
def test_required_with_parallel_calls_keeps_the_complete_calls_when_max_tokens_cuts(
    request: pytest.FixtureRequest, tier: str
) -> None:
    """LangChain's tool_choice="any" sends required with parallel_tool_calls left at true: a small model adds calls
    until max_tokens cuts. The complete calls before the cut are the answer, streamed and not alike (non-streamed,
    even the complete first call was dropped and the raw text returned as content; streamed, the cut call's
    arguments leaked '}}\n</tool_call')."""
    client, model = _client(request, tier), _model(tier)
    answered = 0
    for i in range(4):
        body: dict[str, Any] = {
            "model": model,
            "messages": [{"role": "user", "content": f"{PROMPTS[i]} (any tool)"}],
            "tools": TOOLS,
            "tool_choice": "required",
            "max_tokens": 64,
            "temperature": 0,
        }
        whole = client.chat.completions.create(**body).choices[0]
        streamed = _joined(client, **body).choices[0]
        assert whole.message.content is None and streamed.message.content is None
        calls = [(c.function.name, c.function.arguments) for c in _function_calls(whole.message.tool_calls)]
        assert calls == [(c.function.name, c.function.arguments) for c in _function_calls(streamed.message.tool_calls)]
        assert whole.finish_reason == streamed.finish_reason
        if calls:
            _assert_calls(whole.message.tool_calls, set(MODELS))
            answered += 1
    assert answered, "no complete call was kept from any answer"


@pytest.mark.parametrize("tier", ["cloud", "edge"])
def test_bad_tools_are_a_400_naming_the_field(request: pytest.FixtureRequest, tier: str) -> None:
    client, model = _client(request, tier), _model(tier)
    weather = TOOLS[0]
    bad: list[tuple[dict[str, Any], str, str]] = [
        ({"tools": [{"type": "retrieval", "function": weather["function"]}]}, "tools.0.type", "function"),
        (
            {"tools": [weather, {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/nope"}}}]},
            "tools.1.function.parameters",
            "/nope",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools.0.function.parameters",
            "type 'object'",
        ),
        (
            {"tools": [weather], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "'nope' is not among the tools",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [weather, weather]}, "tools", "two tools are named 'get_weather'"),
        ({"tools": [weather], "stop": ["x"]}, "", "stop cannot be combined with tools"),
    ]
    for extra, param, words in bad:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as exc:
                client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": "x"}],
                    max_tokens=5,
                    stream=stream,
                    extra_body=extra,
                )
            body: Any = exc.value.body
            assert (body["param"] or "") == param and words in body["message"], (extra, body)
    with pytest.raises(openai.BadRequestError) as missing:
        client.chat.completions.create(
            model=model,
            messages=cast(Any, [{"role": "tool", "content": "7"}]),
            max_tokens=2,
        )
    assert "tool_call_id" in str(missing.value.body)


def test_tool_choice_none_generates_text_as_without_tools(cloud: openai.OpenAI) -> None:
    body: dict[str, Any] = {"model": CLOUD_LM, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    plain = cloud.chat.completions.create(**body, temperature=0)
    none = cloud.chat.completions.create(**body, temperature=0, tools=TOOLS, tool_choice="none")
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "length"


class Answer(BaseModel):
    ok: bool


def test_cloud_auto_with_a_response_format_gives_calls_or_that_format(cloud: openai.OpenAI) -> None:
    schema = {**Answer.model_json_schema(), "additionalProperties": False}
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "Answer", "schema": schema}}
    for i in range(4):
        r = cloud.chat.completions.create(
            model=CLOUD_LM,
            messages=[{"role": "user", "content": PROMPTS[i]}],
            tools=TOOLS,
            response_format=fmt,
            parallel_tool_calls=False,
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=i,
        )
        c = r.choices[0]
        if c.message.tool_calls:
            assert c.finish_reason == "tool_calls"
            _assert_calls(c.message.tool_calls, set(MODELS))
        else:
            assert c.finish_reason == "stop", c.message.content
            Answer.model_validate_json(c.message.content or "")

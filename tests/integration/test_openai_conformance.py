"""OpenAI conformance: every OpenAI route of both tiers answers in the ``openai`` SDK's own response types, strictly.

A real cloud and a real edge agent enrolled with it (ONNX Runtime, the tiny zoo), three ways in: the cloud
directly, the edge answering on the device, and the edge escalating to the cloud (``x-tierline-tier: cloud``) —
an escalated answer is relayed, and must conform too. For ``GET /v1/models[/{id}]``, ``POST /v1/completions``,
``POST /v1/chat/completions`` and ``POST /v1/responses``, with the options clients use (logprobs, echo with
``max_tokens: 0``, ``n``, ``response_format``, tools, ``stream`` with ``include_usage``), every body and every
streamed chunk or event is validated by the SDK's pydantic types in strict mode (``Completion``,
``ChatCompletion``, ``ChatCompletionChunk``, ``Model``, ``Response``, the ``ResponseStreamEvent`` union), and no
field may fall into a model's ``model_extra`` (where the SDK's models put what they do not know, silently)
except the tierline extensions listed in ``EXTENSIONS``. The SDK's own clients parse the same routes as well.

The zoo's LMs are tiny and near-random: the shapes are what is tested, not the text."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import httpx
import openai
import pytest
from openai.types import Completion, CompletionChoice, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion_choice import Logprobs
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, Field, TypeAdapter
from pydantic import ValidationError as PydanticValidationError

from tests.integration.test_edge_cloud import INT8, Fleet, fleet

# Two places where the SDK's types are narrower than what OpenAI's API itself sends (and vLLM, and the SDK's own
# stream parser accepts, as it builds objects without validating): the stream chunks of /v1/completions are typed as
# ``Completion``, whose ``finish_reason`` may not be null, though every chunk before the last has none; and with
# ``echo`` the first prompt token has no logprob (nothing precedes it: ``null`` in ``token_logprobs`` and
# ``top_logprobs``). These subclasses widen exactly those fields and nothing else (unknown fields still land in
# ``model_extra``, and every other field is the SDK's, validated strictly).


class EchoLogprobs(Logprobs):
    token_logprobs: list[float | None] | None = None  # type: ignore[assignment]
    top_logprobs: list[dict[str, float] | None] | None = None  # type: ignore[assignment]


class EchoChoice(CompletionChoice):
    logprobs: EchoLogprobs | None = None


class EchoCompletion(Completion):
    """A completion with ``echo``: the SDK's type, the first prompt token's logprob null."""

    choices: list[EchoChoice]  # type: ignore[assignment]


class CompletionChunkChoice(CompletionChoice):
    finish_reason: Literal["stop", "length", "content_filter"] | None  # type: ignore[assignment]


class CompletionChunk(Completion):
    """A chunk of a /v1/completions stream: the SDK's type, ``finish_reason`` null until the last."""

    choices: list[CompletionChunkChoice]  # type: ignore[assignment]


pytestmark = pytest.mark.integration
__all__ = ["fleet"]  # the edge-cloud tests' cloud and enrolled agent, started again for this module
CLOUD_LM = "tierline/lm-cloud"
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
PROMPT = "def fibonacci(n):"
MESSAGES: Any = [{"role": "user", "content": PROMPT}]

# The fields tierline's answers carry beyond the SDK's types, each by the path ``extra_fields`` reports and where it
# is documented. Anything else in a ``model_extra`` fails the test.
EXTENSIONS: dict[str, frozenset[str]] = {
    # docs/edge-agent.md ("GET /v1/models ... not_served") and docs/edge-runtimes.md (runtime_guard): what each
    # model on a device is (format, sha256, version of the verified artifact) and which runtime serves an alias.
    "edge.models": frozenset({"format", "sha256", "version", "runtime_guard"}),
    "edge.models.list": frozenset({"not_served"}),
    # docs/openai-api.md#responses-api-post-v1responses: a Response echoes the request's settings as OpenAI's API
    # does, ``store: false`` included; OpenAI's own responses carry ``store`` too, the SDK's type has no field for it.
    "responses": frozenset({"store"}),
    "responses.events": frozenset({"response.store"}),  # the events that carry the Response
}


@dataclass(frozen=True)
class Target:
    """One way into the OpenAI routes: a base URL, the headers it needs, its LM, and the tier that answers."""

    name: str
    url: str
    headers: dict[str, str]
    model: str
    tier: str

    def client(self) -> openai.OpenAI:
        key = self.headers.get("Authorization", "Bearer local").removeprefix("Bearer ")
        extra = {k: v for k, v in self.headers.items() if k != "Authorization"}
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, default_headers=extra, max_retries=0)


@pytest.fixture(scope="module")
def targets(fleet: Fleet) -> dict[str, Target]:
    key = fleet.cli("keys", "create", "--tenant", "acme")
    return {
        "cloud": Target("cloud", fleet.cloud_url, {"Authorization": f"Bearer {key}"}, CLOUD_LM, "cloud"),
        # INT8's policy never escalates on confidence: the device answers, except what only the cloud can do.
        "edge": Target("edge", fleet.edge_url, {}, INT8, "edge"),
        "escalated": Target("escalated", fleet.edge_url, {"x-tierline-tier": "cloud"}, INT8, "cloud"),
    }


TARGETS = ["cloud", "edge", "escalated"]


def extra_fields(value: Any, path: str = "") -> Iterator[str]:
    """The path of every field a parsed SDK object holds in a ``model_extra`` (the SDK's models accept unknown
    fields there without a word), recursively; list items are ``[]``. Dict values (``top_logprobs``'s token → logprob
    maps) are data, not fields: only models inside them are walked."""
    if isinstance(value, BaseModel):
        for name in value.model_extra or {}:
            yield f"{path}.{name}".lstrip(".")
        for name in type(value).model_fields:
            yield from extra_fields(getattr(value, name), f"{path}.{name}")
    elif isinstance(value, list | tuple):
        for item in value:
            yield from extra_fields(item, f"{path}[]")
    elif isinstance(value, dict):
        for item in value.values():
            yield from extra_fields(item, path)


def conform(kind: Any, body: Any, allowed: frozenset[str] = frozenset()) -> Any:
    """``body`` validated strictly as ``kind`` (a model class or a ``TypeAdapter``), with no field outside the SDK's
    types except ``allowed``.

    Strict mode refuses what lax mode would coerce (``"5"`` for an int, ``1`` for ``True``, a float for an int
    ``created``); an int where the SDK says ``float`` (a ``logprob`` of ``0``, a ``temperature`` of ``0``) is
    accepted by pydantic's strict mode as it is lossless. Where the SDK's types are narrower than OpenAI's API, the
    subclasses above (``EchoCompletion``, ``CompletionChunk``) widen the one field concerned."""
    parsed = kind.validate_python(body, strict=True) if isinstance(kind, TypeAdapter) else None
    if parsed is None:
        parsed = kind.model_validate(body, strict=True)
    unknown = sorted(set(extra_fields(parsed)) - allowed)
    assert not unknown, f"fields outside the SDK's {getattr(kind, '__name__', kind)}: {unknown} in {body}"
    return parsed


def _post(target: Target, path: str, body: dict[str, Any]) -> httpx.Response:
    r = httpx.post(f"{target.url}{path}", json=body, headers=target.headers, timeout=120)
    assert r.status_code == 200, r.text
    return r


def _stream(target: Target, path: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str], httpx.Headers]:
    """A stream's data events as JSON (``[DONE]`` checked last, for chat and completions), its ``event:`` names."""
    with httpx.stream(
        "POST", f"{target.url}{path}", json={**body, "stream": True}, headers=target.headers, timeout=120
    ) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
        headers = r.headers
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    if path != "/v1/responses":
        assert data[-1] == "[DONE]", data[-3:]
        data = data[:-1]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    return [json.loads(d) for d in data], names, headers


def _answered_by(target: Target, headers: httpx.Headers, cloud_feature: bool = False) -> None:
    """The tier that answered is the one asked for (a cloud feature on the edge goes up: ``cloud-feature``)."""
    if target.name != "cloud":
        assert headers["x-tierline-tier"] == ("cloud" if cloud_feature else target.tier), dict(headers)


@pytest.mark.parametrize("name", TARGETS)
def test_models_list_and_retrieve(targets: dict[str, Target], name: str) -> None:
    target = targets[name]
    allowed = EXTENSIONS["edge.models"] if target.name != "cloud" else frozenset()
    r = httpx.get(f"{target.url}/v1/models", headers=target.headers)
    assert r.status_code == 200, r.text
    listed = r.json()
    # A page has no SDK type of its own (the SDK's ``SyncPage`` takes any ``object``): its keys are checked here.
    envelope = set(listed) - (EXTENSIONS["edge.models.list"] if target.name != "cloud" else frozenset())
    assert listed["object"] == "list" and envelope == {"object", "data"}, sorted(listed)
    models = [conform(Model, m, allowed) for m in listed["data"]]
    assert target.model in {m.id for m in models}
    for model in models:
        one = httpx.get(f"{target.url}/v1/models/{model.id}", headers=target.headers)
        assert one.status_code == 200, one.text
        assert conform(Model, one.json(), allowed) == model
    via_sdk = target.client().models.list()
    assert [m.id for m in via_sdk] == [m.id for m in models]
    assert all(set(extra_fields(m)) <= allowed for m in via_sdk)


COMPLETIONS: list[tuple[str, dict[str, Any], bool]] = [
    # (case, body beyond model and prompt, a cloud feature: the edge sends it up)
    ("plain", {"max_tokens": 8, "temperature": 0}, False),
    ("logprobs", {"max_tokens": 6, "logprobs": 3, "temperature": 1.0, "seed": 5}, False),
    ("echo, max_tokens 0", {"max_tokens": 0, "echo": True, "logprobs": 2}, True),
    ("echo and generated", {"max_tokens": 3, "echo": True, "logprobs": 1, "temperature": 0}, True),
    ("n 2", {"max_tokens": 5, "n": 2, "temperature": 1.0, "seed": 3}, True),
    ("stop", {"max_tokens": 16, "stop": ["\n"], "temperature": 0}, False),
]


@pytest.mark.parametrize("name", TARGETS)
def test_completions_bodies_conform(targets: dict[str, Target], name: str) -> None:
    target = targets[name]
    for case, extra, cloud_feature in COMPLETIONS:
        r = _post(target, "/v1/completions", {"model": target.model, "prompt": PROMPT, **extra})
        _answered_by(target, r.headers, cloud_feature)
        body = r.json()
        if extra.get("echo"):
            for choice in body["choices"]:  # nothing precedes the first prompt token: it alone has no logprob
                logprobs = choice["logprobs"]
                assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None, case
                assert None not in logprobs["token_logprobs"][1:] + logprobs["top_logprobs"][1:], case
        completion: Completion = conform(EchoCompletion if extra.get("echo") else Completion, body)
        assert len(completion.choices) == extra.get("n", 1), case
        assert completion.usage is not None and completion.usage.total_tokens > 0, case
        for choice in completion.choices:
            if "logprobs" in extra:
                assert choice.logprobs is not None and choice.logprobs.tokens, case
                assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs or []), case
            if extra.get("echo"):
                assert choice.text.startswith(PROMPT), case
    # The SDK's client parses the same (it builds its objects without validating: nothing may be left over).
    for case, extra, _ in COMPLETIONS:
        via_sdk = target.client().completions.create(model=target.model, prompt=PROMPT, **extra)
        assert not set(extra_fields(via_sdk)) and len(via_sdk.choices) == extra.get("n", 1), case


@pytest.mark.parametrize("name", TARGETS)
def test_completions_streams_conform_chunk_by_chunk(targets: dict[str, Target], name: str) -> None:
    target = targets[name]
    body: dict[str, Any] = {
        "model": target.model,
        "prompt": PROMPT,
        "max_tokens": 8,
        "logprobs": 2,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    chunks, _, headers = _stream(target, "/v1/completions", body)
    _answered_by(target, headers)
    parsed: list[Completion] = [conform(CompletionChunk, c) for c in chunks]
    *deltas, usage = parsed
    assert [c.choices[0].finish_reason is None for c in deltas] == [True] * (len(deltas) - 1) + [False]
    assert usage.choices == [] and usage.usage is not None and usage.usage.completion_tokens > 0
    assert all(c.usage is None for c in deltas) and deltas[-1].choices[0].finish_reason in ("stop", "length")
    whole = conform(Completion, _post(target, "/v1/completions", {**body, "stream_options": None}).json())
    assert "".join(c.choices[0].text for c in deltas) == whole.choices[0].text
    via_sdk = list(target.client().completions.create(**body, stream=True))
    assert [c.model_dump() for c in via_sdk][-1]["usage"] == usage.model_dump()["usage"]
    assert all(not set(extra_fields(c)) for c in via_sdk)


class Pet(BaseModel):
    name: str = Field(max_length=8)
    kind: str = Field(pattern="^(cat|dog|fish)$")
    age: int = Field(ge=0, le=30)


class Weather(BaseModel):
    city: str = Field(max_length=8)
    days: int = Field(ge=1, le=7)


WEATHER = openai.pydantic_function_tool(Weather, name="get_weather")
PET_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "pet", "schema": Pet.model_json_schema() | {"additionalProperties": False}, "strict": True},
}
CHATS: list[tuple[str, dict[str, Any]]] = [
    ("plain", {"max_tokens": 8, "temperature": 0}),
    ("logprobs", {"max_tokens": 6, "logprobs": True, "top_logprobs": 3, "temperature": 1.0, "seed": 4}),
    ("json_schema", {"max_tokens": 80, "response_format": PET_FORMAT, "temperature": 0}),
    ("tools auto", {"max_tokens": 60, "tools": [WEATHER], "tool_choice": "auto", "temperature": 0}),
    (
        "tools required",
        {
            "max_tokens": 100,
            "tools": [WEATHER],
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "temperature": 0,
        },
    ),
]


def _top_logprobs_hold_the_token(token: Any, n: int) -> bool:
    """The ``n`` most likely tokens, and the sampled one where it is not among them (docs/openai-api.md)."""
    alternatives = [t.token for t in token.top_logprobs]
    return token.token in alternatives and len(alternatives) in (n, n + 1)


@pytest.mark.parametrize("name", TARGETS)
def test_chat_bodies_conform(targets: dict[str, Target], name: str) -> None:
    target = targets[name]
    for case, extra in CHATS:
        r = _post(target, "/v1/chat/completions", {"model": target.model, "messages": MESSAGES, **extra})
        _answered_by(target, r.headers)
        chat: ChatCompletion = conform(ChatCompletion, r.json())
        (choice,) = chat.choices
        assert chat.usage is not None and chat.usage.completion_tokens > 0, case
        if case == "logprobs":
            assert choice.logprobs is not None and choice.logprobs.content, case
            assert all(_top_logprobs_hold_the_token(t, 3) for t in choice.logprobs.content), case
        if case == "json_schema" and choice.finish_reason == "stop":
            Pet.model_validate_json(choice.message.content or "")
        if case == "tools required":
            assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, chat
            for call in choice.message.tool_calls:
                assert call.type == "function"
                Weather.model_validate_json(call.function.arguments)
        via_sdk = target.client().chat.completions.create(model=target.model, messages=MESSAGES, **extra)
        assert not set(extra_fields(via_sdk)) and via_sdk.choices[0].finish_reason == choice.finish_reason, case


@pytest.mark.parametrize("name", TARGETS)
def test_chat_streams_conform_chunk_by_chunk(targets: dict[str, Target], name: str) -> None:
    target = targets[name]
    usage = {"stream_options": {"include_usage": True}}
    for case, extra in CHATS:
        body = {"model": target.model, "messages": MESSAGES, **extra, **usage}
        chunks, _, headers = _stream(target, "/v1/chat/completions", body)
        _answered_by(target, headers)
        parsed: list[ChatCompletionChunk] = [conform(ChatCompletionChunk, c) for c in chunks]
        *deltas, last = parsed
        assert last.choices == [] and last.usage is not None and last.usage.completion_tokens > 0, case
        assert all(c.usage is None for c in deltas) and len({c.id for c in parsed}) == 1, case
        assert deltas[0].choices[0].delta.role == "assistant", case
        finish = [c.choices[0].finish_reason for c in deltas if c.choices[0].finish_reason]
        assert len(finish) == 1, case
        if case == "tools required":
            calls = [d for c in deltas for d in c.choices[0].delta.tool_calls or ()]
            assert finish == ["tool_calls"] and calls and calls[0].id and calls[0].function, case
            arguments = "".join(d.function.arguments or "" for d in calls if d.function and d.index == 0)
            Weather.model_validate_json(arguments)
        if case == "logprobs":
            tokens = [t for c in deltas if c.choices[0].logprobs for t in c.choices[0].logprobs.content or ()]
            assert tokens and all(_top_logprobs_hold_the_token(t, 3) for t in tokens), case
    # The SDK's own stream: it parses each chunk into the same types, with nothing left over.
    stream = target.client().chat.completions.create(
        model=target.model,
        messages=MESSAGES,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=100,
        stream=True,
        stream_options={"include_usage": True},
    )
    sdk_chunks = list(stream)
    assert sdk_chunks[-1].usage is not None and sdk_chunks[-1].choices == []
    assert all(not set(extra_fields(c)) for c in sdk_chunks)
    assert any(c.choices and c.choices[0].delta.tool_calls for c in sdk_chunks)


RESPONSES: list[tuple[str, dict[str, Any]]] = [
    ("text", {"input": PROMPT, "max_output_tokens": 16, "temperature": 0}),
    ("instructions", {"input": PROMPT, "instructions": "Answer in Python.", "max_output_tokens": 16}),
    (
        "function call",
        {
            "input": "What is the weather in Paris?",
            "tools": [{"type": "function", **WEATHER["function"]}],
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_output_tokens": 100,
            "temperature": 0,
        },
    ),
    (
        "json_schema",
        {
            "input": "a pet",
            "text": {"format": {"type": "json_schema", "name": "pet", **PET_FORMAT["json_schema"]}},  # type: ignore[dict-item]
            "max_output_tokens": 120,
            "temperature": 0,
        },
    ),
]


@pytest.mark.parametrize("name", TARGETS)
def test_responses_bodies_and_events_conform(targets: dict[str, Target], name: str) -> None:
    target = targets[name]
    for case, extra in RESPONSES:
        body = {"model": target.model, **extra}
        r = _post(target, "/v1/responses", body)
        _answered_by(target, r.headers)
        response: Response = conform(Response, r.json(), EXTENSIONS["responses"])
        assert response.usage is not None and response.usage.output_tokens > 0, case
        if case == "function call":
            (call,) = response.output
            assert call.type == "function_call"
            Weather.model_validate_json(call.arguments)
        events_json, names, headers = _stream(target, "/v1/responses", body)
        _answered_by(target, headers)
        events = [conform(EVENTS, e, EXTENSIONS["responses.events"]) for e in events_json]
        assert names == [e.type for e in events], case
        assert [e.sequence_number for e in events] == list(range(len(events))), case
        assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
        final: Response = events[-1].response
        assert final.usage is not None and final.usage.output_tokens > 0, case
        if case == "function call":
            done = [e for e in events if e.type == "response.function_call_arguments.done"]
            assert len(done) == 1, case
            Weather.model_validate_json(done[0].arguments)
    # The SDK's own clients: ``create`` and ``stream`` parse the same into their types, with nothing left over.
    client = target.client()
    created = client.responses.create(model=target.model, input=PROMPT, max_output_tokens=16)
    assert set(extra_fields(created)) <= EXTENSIONS["responses"] and created.output_text
    with client.responses.stream(model=target.model, input=PROMPT, max_output_tokens=16) as stream:
        sdk_events = list(stream)
    assert sdk_events and all(set(extra_fields(e)) <= EXTENSIONS["responses.events"] for e in sdk_events)


def test_the_checks_catch_unknown_and_mistyped_fields(targets: dict[str, Target]) -> None:
    """``conform`` itself: a field the SDK does not know, however deep, and a value of another JSON type fail."""
    target = targets["cloud"]
    chat = _post(target, "/v1/chat/completions", {"model": target.model, "messages": MESSAGES, "max_tokens": 4}).json()
    conform(ChatCompletion, chat)
    nested = json.loads(json.dumps(chat))
    nested["choices"][0]["message"]["surprise"] = 1
    with pytest.raises(AssertionError, match=r"choices\[\]\.message\.surprise"):
        conform(ChatCompletion, nested)
    mistyped = {**chat, "created": float(chat["created"])}
    with pytest.raises(PydanticValidationError):
        conform(ChatCompletion, mistyped)
    lax = {**chat, "usage": {k: str(v) if isinstance(v, int) else v for k, v in chat["usage"].items()}}
    ChatCompletion.model_validate(lax)  # lax mode takes "12" for 12: what strict mode is here for
    with pytest.raises(PydanticValidationError):
        conform(ChatCompletion, lax)

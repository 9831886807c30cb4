"""OpenAI's Responses API (``POST /v1/responses``) with the openai SDK against a real cloud server and a real,
enrolled edge agent (ONNX Runtime): ``responses.create`` and ``responses.stream`` give the chat path's tokens and
usage, in shapes the SDK's own types accept in strict mode; ``max_output_tokens`` cuts say ``incomplete``;
``instructions`` reach the prompt; function tools give ``function_call`` items whose arguments validate, and their
outputs go back as ``function_call_output`` items; ``text.format`` json_schema output parses; unknown fields and
``store: true`` are 400s naming them; each request is one usage record, as a chat completion is; an edge request
forced to the cloud is escalated and metered there.

The zoo's LMs are tiny and near-random: the shape of the output is what is guaranteed and tested."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, Field, TypeAdapter
from sqlalchemy import create_engine
from sqlmodel import Session, select

from controlplane.fleet.devices import device_usage_id
from controlplane.storage.tables import UsageRecord
from tests.integration.test_edge_cloud import INT8, Fleet, fleet

pytestmark = pytest.mark.integration
__all__ = ["fleet"]  # the edge-cloud tests' cloud and enrolled agent, started again for this module
CLOUD_LM = "tierline/lm-cloud"
MODELS = {"cloud": CLOUD_LM, "edge": INT8}
PROMPT = "def fibonacci(n):"
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


class Weather(BaseModel):
    city: str = Field(max_length=8)
    days: int = Field(ge=1, le=7)


class Pet(BaseModel):
    name: str = Field(max_length=8)
    kind: str = Field(pattern="^(cat|dog|fish)$")
    age: int = Field(ge=0, le=30)


# The strict schema (no additional properties) the SDK makes of the model, in the Responses API's flat tool shape.
WEATHER_TOOL = {"type": "function", **openai.pydantic_function_tool(Weather, name="get_weather")["function"]}


@pytest.fixture(scope="module")
def clients(fleet: Fleet) -> dict[str, openai.OpenAI]:
    key = fleet.cli("keys", "create", "--tenant", "acme")
    return {
        "cloud": openai.OpenAI(base_url=f"{fleet.cloud_url}/v1", api_key=key, max_retries=0),
        "edge": openai.OpenAI(base_url=f"{fleet.edge_url}/v1", api_key="local", max_retries=0),
    }


def _usage_record(fleet: Fleet, record_id: str) -> UsageRecord:
    """The usage record stored under ``record_id`` (waiting for the writer's flush, or the device's sync)."""
    engine = create_engine(fleet.db)
    deadline = time.monotonic() + 15
    try:
        while True:
            with Session(engine) as s:
                row = s.exec(select(UsageRecord).where(UsageRecord.id == record_id)).first()
            if row is not None or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        engine.dispose()
    assert row is not None, f"no usage record {record_id}"
    return row


def _stored_id(fleet: Fleet, tier: str, usage_id: str) -> str:
    """The id a request's usage record is stored under: the cloud's own, or the device's namespaced."""
    if tier == "cloud":
        return usage_id
    device = fleet.device()
    return device_usage_id(device.tenant_id, device.id, usage_id)


def _create(client: openai.OpenAI, **body: Any) -> tuple[Response, httpx.Headers]:
    """``responses.create``, its body also validated by the SDK's own type in strict mode."""
    raw = client.responses.with_raw_response.create(**body)
    strict = Response.model_validate(json.loads(raw.content), strict=True)
    response = raw.parse()
    assert strict.output_text == response.output_text
    return response, raw.headers


def _final(events: list[Any]) -> Response:
    """The Response the last event carries: ``response.completed``, or ``response.incomplete`` for a cut (the
    SDK's ``get_final_response`` waits for the first only, as against OpenAI)."""
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")
    response: Response = last.response
    return response


def _raw_events(client: openai.OpenAI, **body: Any) -> list[Any]:
    """A stream's events as the server sent them, each validated by the SDK's own types in strict mode."""
    return _raw_stream(client, **body)[0]


def _raw_stream(client: openai.OpenAI, **body: Any) -> tuple[list[Any], httpx.Headers]:
    """``_raw_events``, and the stream's headers."""
    with client.responses.with_streaming_response.create(stream=True, **body) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
        headers = resp.headers
    kinds = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    events = [EVENTS.validate_python(json.loads(line[6:]), strict=True) for line in lines if line.startswith("data: ")]
    assert kinds == [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events, headers


@pytest.mark.parametrize("tier", ["cloud", "edge"])
def test_create_answers_with_the_chat_paths_tokens_and_one_usage_record(
    clients: dict[str, openai.OpenAI], fleet: Fleet, tier: str
) -> None:
    client, model = clients[tier], MODELS[tier]
    response, headers = _create(client, model=model, input=PROMPT, temperature=0, max_output_tokens=24)
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], temperature=0, max_tokens=24
    )
    assert headers["x-tierline-tier"] == tier
    assert response.object == "response" and response.id.startswith("resp_") and response.model == chat.model
    assert response.output_text and response.output_text == chat.choices[0].message.content
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert response.usage is not None and chat.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
        chat.usage.total_tokens,
    )
    assert (response.temperature, response.max_output_tokens, response.tool_choice) == (0, 24, "auto")
    record = _usage_record(fleet, _stored_id(fleet, tier, headers["x-tierline-usage-id"]))
    assert (record.tier, record.model, record.status) == (tier, model, "ok")
    assert (record.prompt_tokens, record.completion_tokens) == (
        response.usage.input_tokens,
        response.usage.output_tokens,
    )


@pytest.mark.parametrize("tier", ["cloud", "edge"])
def test_max_output_tokens_cuts_the_answer_as_incomplete(clients: dict[str, openai.OpenAI], tier: str) -> None:
    client, model = clients[tier], MODELS[tier]
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], temperature=0, max_tokens=16
    )
    assert chat.choices[0].finish_reason == "length"  # the prompt's greedy answer is longer than 16 tokens
    response, _ = _create(client, model=model, input=PROMPT, temperature=0, max_output_tokens=16)
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 16
    assert response.output_text == chat.choices[0].message.content


@pytest.mark.parametrize("tier", ["cloud", "edge"])
def test_a_stream_is_the_same_answer_as_events_the_sdk_parses_and_one_usage_record(
    clients: dict[str, openai.OpenAI], fleet: Fleet, tier: str
) -> None:
    client, model = clients[tier], MODELS[tier]
    body: dict[str, Any] = {"model": model, "input": PROMPT, "temperature": 0, "max_output_tokens": 24}
    whole, _ = _create(client, **body)
    with client.responses.stream(**body) as stream:
        events = list(stream)
    final = _final(events)
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{whole.status}",
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text and final.status == whole.status
    assert final.usage is not None and whole.usage is not None
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens
    raw, headers = _raw_stream(client, **body)  # the same, each event validated strictly as it came
    assert _final(raw).output_text == whole.output_text and headers["x-tierline-tier"] == tier
    record = _usage_record(fleet, _stored_id(fleet, tier, headers["x-tierline-usage-id"]))
    assert (record.prompt_tokens, record.completion_tokens, record.status) == (
        whole.usage.input_tokens,
        whole.usage.output_tokens,
        "ok",
    )


@pytest.mark.parametrize("tier", ["cloud", "edge"])
def test_instructions_reach_the_prompt_as_a_system_message(clients: dict[str, openai.OpenAI], tier: str) -> None:
    client, model = clients[tier], MODELS[tier]
    instructions = "You are a terse assistant who answers in Python."
    plain, _ = _create(client, model=model, input=PROMPT, max_output_tokens=16, temperature=0)
    told, _ = _create(client, model=model, input=PROMPT, instructions=instructions, max_output_tokens=16, temperature=0)
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": instructions}, {"role": "user", "content": PROMPT}],
        max_tokens=16,
        temperature=0,
    )
    assert plain.usage is not None and told.usage is not None and chat.usage is not None
    assert told.usage.input_tokens > plain.usage.input_tokens
    assert told.usage.input_tokens == chat.usage.prompt_tokens and told.instructions == instructions


@pytest.mark.parametrize("tier", ["cloud", "edge"])
def test_a_forced_function_call_validates_and_its_output_goes_back(
    clients: dict[str, openai.OpenAI], tier: str
) -> None:
    client, model = clients[tier], MODELS[tier]
    first, _ = _create(
        client,
        model=model,
        input="What is the weather in Paris?",
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=100,
        temperature=0,
    )
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    Weather.model_validate_json(call.arguments)
    assert first.status == "completed" and first.output_text == ""
    output = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"celsius": 12})}
    second, _ = _create(
        client,
        model=model,
        input=[{"role": "user", "content": "What is the weather in Paris?"}, call, output],
        tools=[WEATHER_TOOL],
        max_output_tokens=16,
        temperature=0,
    )
    assert second.status in ("completed", "incomplete") and second.output
    assert first.usage is not None and second.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens  # the call and its output are in the prompt

    body: dict[str, Any] = {
        "model": model,
        "input": "Weather in Oslo?",
        "tools": [WEATHER_TOOL],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": 100,
        "temperature": 0,
    }
    with client.responses.stream(**body) as stream:
        final = stream.get_final_response()
    (streamed_call,) = final.output
    assert streamed_call.type == "function_call" and streamed_call.name == "get_weather"
    events = _raw_events(client, **body)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert len(done) == 1 and done[0].arguments == deltas and done[0].name == "get_weather"
    Weather.model_validate_json(done[0].arguments)
    assert events[-1].type == "response.completed" and _final(events).output[0].type == "function_call"


@pytest.mark.parametrize("tier", ["cloud", "edge"])
def test_text_format_json_schema_output_parses(clients: dict[str, openai.OpenAI], tier: str) -> None:
    client, model = clients[tier], MODELS[tier]
    for i, prompt in enumerate(["a pet", "another pet"]):
        parsed = client.responses.parse(
            model=model, input=prompt, text_format=Pet, max_output_tokens=120, temperature=0 if i == 0 else 1.0
        )
        assert parsed.status == "completed" and isinstance(parsed.output_parsed, Pet)


@pytest.mark.parametrize("tier", ["cloud", "edge"])
@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"seed": 1}, "seed"),
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
    ],
)
def test_unimplemented_fields_are_400s_naming_them(
    clients: dict[str, openai.OpenAI], tier: str, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        clients[tier].responses.create(model=MODELS[tier], input=PROMPT, extra_body=extra)
    error = exc.value.response.json()["error"]
    assert error["param"] == param and error["code"] == "unsupported_parameter" and param in error["message"]


@pytest.mark.parametrize("tier", ["cloud", "edge"])
def test_input_this_server_cannot_read_is_a_400_naming_its_place(clients: dict[str, openai.OpenAI], tier: str) -> None:
    image = {"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}]}
    for bad, param in (([image], "input.items.0.message.content.parts.0"), (5, "input")):
        with pytest.raises(openai.BadRequestError) as exc:
            clients[tier].responses.create(model=MODELS[tier], input=bad)  # type: ignore[arg-type]
        assert exc.value.response.json()["error"]["param"] == param


def test_an_idempotency_key_replays_the_stored_response_unbilled(
    clients: dict[str, openai.OpenAI], fleet: Fleet
) -> None:
    client = clients["cloud"]
    once = {"Idempotency-Key": f"responses-{time.time_ns()}"}
    body: dict[str, Any] = {"model": CLOUD_LM, "input": PROMPT, "max_output_tokens": 16, "extra_headers": once}
    first, headers = _create(client, **body)
    again, replay = _create(client, **body)
    assert replay["x-tierline-idempotent-replay"] == "true" and "x-tierline-idempotent-replay" not in headers
    assert again.model_dump() == first.model_dump()  # the same Response (id, text, usage), as stored
    assert replay["x-tierline-usage-id"] == headers["x-tierline-usage-id"]
    record = _usage_record(fleet, headers["x-tierline-usage-id"])  # one record, under the key's usage id
    assert first.usage is not None and record.completion_tokens == first.usage.output_tokens
    with pytest.raises(openai.BadRequestError) as exc:  # streams are not replayed, as for chat
        client.responses.create(**body, stream=True)
    assert exc.value.response.json()["error"]["param"] == "stream"


def test_the_cloud_route_wants_a_key_and_is_in_the_openapi_schema(fleet: Fleet) -> None:
    r = httpx.post(f"{fleet.cloud_url}/v1/responses", json={"model": CLOUD_LM, "input": PROMPT})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    schema = httpx.get(f"{fleet.cloud_url}/schema/openapi.json").json()
    operation = schema["paths"]["/v1/responses"]["post"]
    body_ref = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    props = schema["components"]["schemas"][body_ref]["properties"]
    assert {"model", "input", "instructions", "max_output_tokens", "tools", "text", "stream"} <= set(props)
    assert operation["security"] == [{"BearerAuth": []}]


def test_an_edge_request_forced_to_the_cloud_is_escalated_and_metered_there(
    clients: dict[str, openai.OpenAI], fleet: Fleet
) -> None:
    edge = clients["edge"]
    up = {"x-tierline-tier": "cloud"}
    response, headers = _create(edge, model=INT8, input=PROMPT, max_output_tokens=16, temperature=0, extra_headers=up)
    assert headers["x-tierline-tier"] == "cloud" and response.model == CLOUD_LM and response.output_text
    record = _usage_record(fleet, headers["x-tierline-usage-id"])
    assert record.tier == "cloud" and record.device_id == fleet.device().id
    assert response.usage is not None and record.completion_tokens == response.usage.output_tokens
    with edge.responses.stream(
        model=INT8, input=PROMPT, max_output_tokens=16, temperature=0, extra_headers=up
    ) as stream:
        events = list(stream)
    final = _final(events)
    assert final.output_text == response.output_text and final.model == CLOUD_LM

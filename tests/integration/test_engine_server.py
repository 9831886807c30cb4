"""``tierline engine serve``: the built-in engine as a standalone OpenAI-compatible server, driven by the real
``openai`` SDK against a subprocess on a free port (no database, no tenants)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from cloud.engine.llm import LLM
from cloud.engine.sampling_params import SamplingParams
from shared.zoo.registry import ZooLayout
from tests.conftest import base_env, free_port, server_process

PROMPT = "The quick brown fox"
KEY = "sk-engine-test"


@pytest.fixture(scope="module")
def lm_dir(tiny_zoo: Path) -> Path:
    return ZooLayout(tiny_zoo).artifact_dir("lm-cloud")


@pytest.fixture(scope="module")
def server(lm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    data = tmp_path_factory.mktemp("engine-server")
    key_file = data / "key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    env = base_env(data, TIERLINE_CLOUD_KV_CACHE_MB="32")
    args = ["engine", "serve", "--model", str(lm_dir), "--api-key-file", str(key_file)]
    with server_process(args, env, port, ready_path="/health", timeout=180):  # a loaded 2-core host: ~40 s
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def offline(lm_dir: Path) -> LLM:
    return LLM(lm_dir, kv_cache_bytes=32 << 20)


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["lm-cloud"]


def test_with_a_key_file_v1_needs_the_key_and_health_does_not(server: str) -> None:
    body = {"model": "lm-cloud", "prompt": PROMPT, "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
        refused = httpx.post(f"{server}/v1/completions", json=body, headers=headers)
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server}/health").status_code == 200


def test_completion_is_the_in_process_engines_greedy_output_with_exact_usage(
    client: openai.OpenAI, offline: LLM
) -> None:
    expected = offline.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12))[0]
    got = client.completions.create(model="lm-cloud", prompt=PROMPT, max_tokens=12, temperature=0)
    assert got.choices[0].text == expected.text
    assert got.choices[0].finish_reason == expected.finish_reason
    assert got.usage is not None
    assert got.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert got.usage.completion_tokens == len(expected.token_ids) == 12


def test_chat_stream_joins_to_the_in_process_answer_and_ends_with_usage(client: openai.OpenAI, offline: LLM) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say something about foxes."}]
    prompt = offline.tokenizer.apply_chat_template([dict(m) for m in messages], add_generation_prompt=True)
    expected = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=10))[0]
    chunks = list(
        client.chat.completions.create(
            model="lm-cloud",
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(expected.prompt_token_ids), 10)
    assert all(c.usage is None for c in chunks[:-1])


def test_a_stream_without_include_usage_sends_no_usage_chunk(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model="lm-cloud", prompt=PROMPT, max_tokens=3, stream=True))
    assert chunks and all(c.usage is None for c in chunks)
    assert "".join(c.choices[0].text for c in chunks)


def test_bad_requests_get_400_in_openais_error_shape(client: openai.OpenAI, server: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="lm-cloud", prompt=PROMPT, max_tokens=0)
    assert err.value.status_code == 400
    auth = {"Authorization": f"Bearer {KEY}"}
    body = httpx.post(
        f"{server}/v1/completions", headers=auth, json={"model": "lm-cloud", "prompt": PROMPT, "max_tokens": "8"}
    )
    assert body.status_code == 400
    assert body.json()["error"]["param"] == "max_tokens"
    assert set(body.json()["error"]) == {"message", "type", "param", "code"}
    too_long = httpx.post(f"{server}/v1/completions", headers=auth, json={"model": "lm-cloud", "prompt": "fox " * 400})
    assert too_long.status_code == 400, too_long.text
    assert too_long.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)


def test_health_and_metrics_count_what_was_generated(client: openai.OpenAI, server: str) -> None:
    def generated() -> float:
        for line in httpx.get(f"{server}/metrics").text.splitlines():
            if line.startswith('tierline_engine_generated_tokens_total{model="lm-cloud"}'):
                return float(line.split()[-1])
        return 0.0

    before = generated()
    client.completions.create(model="lm-cloud", prompt=PROMPT, max_tokens=7, temperature=0)
    assert generated() - before == 7
    text = httpx.get(f"{server}/metrics").text
    for gauge in ("waiting_sequences", "running_sequences", "kv_cache_usage_ratio"):
        assert f'tierline_engine_{gauge}{{model="lm-cloud"}}' in text
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}


def _samples(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] != "#"}


def test_metrics_carry_the_autoscaling_signals_under_vllms_names(client: openai.OpenAI, server: str) -> None:
    """Queue depth, running sequences, KV-cache use and time in queue, named and labelled as vLLM's (one autoscaling
    rule for both servers), equal to the engine's own gauges; time in queue counted once per prompt."""
    queued = 'vllm:request_queue_time_seconds_count{model_name="lm-cloud"}'
    before = _samples(httpx.get(f"{server}/metrics").text).get(queued, 0.0)
    client.completions.create(model="lm-cloud", prompt=[PROMPT, "Once upon", "A fox"], max_tokens=3, temperature=0)
    list(client.completions.create(model="lm-cloud", prompt=PROMPT, max_tokens=3, stream=True))
    samples = _samples(httpx.get(f"{server}/metrics").text)
    assert samples[queued] - before == 4
    assert 0 <= samples['vllm:request_queue_time_seconds_sum{model_name="lm-cloud"}'] < 60
    pairs = {
        "vllm:num_requests_waiting": "tierline_engine_waiting_sequences",
        "vllm:num_requests_running": "tierline_engine_running_sequences",
        "vllm:kv_cache_usage_perc": "tierline_engine_kv_cache_usage_ratio",
        "vllm:gpu_cache_usage_perc": "tierline_engine_kv_cache_usage_ratio",
    }
    for vllm, ours in pairs.items():
        assert samples[f'{vllm}{{model_name="lm-cloud"}}'] == samples[f'{ours}{{model="lm-cloud"}}'], vllm


def test_tool_calls_streamed_and_not_validate_and_a_tool_message_is_accepted(client: openai.OpenAI) -> None:
    """The server shares the gateway's tool calling (``shared.tools``): same grammar, same response shapes."""
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 8},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    tools: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": schema}}]
    body: Any = {
        "model": "lm-cloud",
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": tools,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 100,
        "temperature": 0,
    }
    whole = client.chat.completions.create(**body)
    c = whole.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None, c.message.content
    (call,) = c.message.tool_calls or []
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "days"} and isinstance(args["days"], int) and len(args["city"]) <= 8
    chunks = list(client.chat.completions.create(**body, stream=True))
    deltas = [d for ch in chunks for choice in ch.choices for d in choice.delta.tool_calls or ()]
    assert deltas[0].id and deltas[0].function and deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas if d.function) == call.function.arguments  # greedy
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == [
        "tool_calls"
    ]
    answer = client.chat.completions.create(
        model="lm-cloud",
        messages=[
            {"role": "user", "content": "weather?"},
            c.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 7}'},
        ],
        tools=tools,
        tool_choice="none",
        max_tokens=5,
    )
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length")

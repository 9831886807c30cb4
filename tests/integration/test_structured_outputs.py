"""``response_format`` with the openai SDK against a real cloud server and a real edge agent: the output is
generated under the grammar of the schema (constrained decoding), so ``parse`` returns an object on every prompt,
sampled and greedy, streamed and not; a max_tokens cut says "length"; a schema the engine cannot compile is a 400.

The zoo's LMs are tiny and near-random: the shape of the output is what is guaranteed and tested."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from shared.openai_schema import ChatCompletionRequest
from tests.conftest import base_env, free_port, migrated_sqlite, run_server, seed_data_dir
from tests.forkserver import run_tierline

pytestmark = pytest.mark.integration
CLOUD_LM = "tierline/lm-cloud"
EDGE_LMS = ["tierline/lm-edge-onnx-int8", "tierline/lm-edge-tflite"]
PROMPTS = ["def f():", "import os", "class A:", "x = 1", "print(", "for i in", "return", "# pet", "{", "if x:"]
MAX_TOKENS = 120  # a Pet is at most ~60 tokens: every string and number in its schema is bounded


class Pet(BaseModel):
    name: str = Field(max_length=8)
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)
    vaccinated: bool


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory, tiny_zoo: Path, session_data_dir: Path) -> Iterator[openai.OpenAI]:
    data = seed_data_dir(tmp_path_factory.mktemp("structured-cloud"), tiny_zoo, session_data_dir)
    env = base_env(
        data,
        TIERLINE_DATABASE_URL=migrated_sqlite(data),
        TIERLINE_CLOUD_ZOO_PRESET="tiny",
        TIERLINE_CLOUD_KV_CACHE_MB="16",
    )

    def cli(*args: str) -> str:
        return run_tierline(*args, env=env, check=True).stdout.strip()

    cli("tenants", "create", "acme")
    key = cli("keys", "create", "--tenant", "acme")
    with run_server(["cloud", "serve"], env, free_port(), timeout=120) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory, tiny_zoo: Path, session_data_dir: Path) -> Iterator[openai.OpenAI]:
    d = seed_data_dir(tmp_path_factory.mktemp("structured-edge"), tiny_zoo, session_data_dir)
    env = base_env(d, TIERLINE_EDGE_ZOO_DIR=str(d / "zoo" / "tiny"))
    with run_server(["edge", "run"], env, free_port()) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused-locally", max_retries=0)


def _parsed_pets(client: openai.OpenAI, model: str, n: int, **extra: Any) -> list[tuple[Pet | None, str | None]]:
    """``n`` prompts through ``parse`` and ``stream``: greedy and sampled (seeded and not), streamed and not."""
    results: list[tuple[Pet | None, str | None]] = []
    for i in range(n):
        messages: Any = [{"role": "user", "content": f"{PROMPTS[i % len(PROMPTS)]} (pet {i})"}]
        sampling: dict[str, Any] = {"temperature": 0} if i % 2 == 0 else {"temperature": 1.0, "top_p": 0.95}
        if i % 4 == 1:
            sampling["seed"] = i
        if i % 4 >= 2:  # streamed: the SDK assembles the deltas and parses the final message
            with client.chat.completions.stream(
                model=model, messages=messages, response_format=Pet, max_tokens=MAX_TOKENS, **sampling, **extra
            ) as stream:
                final = stream.get_final_completion()
        else:
            final = client.chat.completions.parse(
                model=model, messages=messages, response_format=Pet, max_tokens=MAX_TOKENS, **sampling, **extra
            )
        choice = final.choices[0]
        results.append((choice.message.parsed, choice.finish_reason))
    return results


def test_cloud_parse_returns_a_pet_on_every_prompt(cloud: openai.OpenAI) -> None:
    results = _parsed_pets(cloud, CLOUD_LM, 20)
    assert [r for r in results if not isinstance(r[0], Pet) or r[1] != "stop"] == []
    assert len({p.model_dump_json() for p, _ in results if p is not None}) > 1  # not one canned answer


def test_cloud_constrained_requests_asking_for_speculation_still_match(cloud: openai.OpenAI) -> None:
    # Drafts are checked against the grammar (test_structured_speculation.py: greedy equals plain decoding).
    results = _parsed_pets(cloud, CLOUD_LM, 4, extra_body={"speculation": "draft"})
    assert all(isinstance(p, Pet) and reason == "stop" for p, reason in results)


@pytest.mark.parametrize("model", EDGE_LMS)
def test_edge_parse_returns_a_pet_on_every_prompt(edge: openai.OpenAI, model: str) -> None:
    results = _parsed_pets(edge, model, 10)
    assert [r for r in results if not isinstance(r[0], Pet) or r[1] != "stop"] == []


@pytest.mark.parametrize("tier", ["cloud", "edge"])
def test_json_object_output_parses_whenever_it_says_stop(request: pytest.FixtureRequest, tier: str) -> None:
    client: openai.OpenAI = request.getfixturevalue(tier)
    model = CLOUD_LM if tier == "cloud" else EDGE_LMS[0]
    reasons = []
    for i in range(10):
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": PROMPTS[i]}],
            response_format={"type": "json_object"},
            max_tokens=150,
            temperature=0 if i % 2 else 0.8,
        )
        choice = r.choices[0]
        reasons.append(choice.finish_reason)
        assert choice.finish_reason in ("stop", "length")
        content = choice.message.content or ""
        assert content.startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(content), dict)
    # json_object never forces the object closed: whether the tiny zoo LMs close one within 150 tokens is the
    # models' doing, so "stop" is not required here (it is, under a schema, in the parse tests above).
    assert set(reasons) <= {"stop", "length"} and len(reasons) == 10


@pytest.mark.parametrize("tier", ["cloud", "edge"])
def test_a_max_tokens_cut_says_length_never_stop(request: pytest.FixtureRequest, tier: str) -> None:
    client: openai.OpenAI = request.getfixturevalue(tier)
    model = CLOUD_LM if tier == "cloud" else EDGE_LMS[0]
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "pet"}],
        response_format={"type": "json_schema", "json_schema": {"name": "Pet", "schema": Pet.model_json_schema()}},
        max_tokens=4,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 4
    with pytest.raises(ValueError):
        Pet.model_validate_json(r.choices[0].message.content or "")


def test_cloud_choice_and_regex_extensions_with_n(cloud: openai.OpenAI) -> None:
    r = cloud.chat.completions.create(
        model=CLOUD_LM,
        messages=[{"role": "user", "content": "yes or no?"}],
        extra_body={"response_format": {"type": "choice", "choice": ["yes", "no", "not sure"]}},  # an extension
        n=4,
        temperature=1.0,
        max_tokens=10,
    )
    assert len(r.choices) == 4
    assert all(c.message.content in ("yes", "no", "not sure") and c.finish_reason == "stop" for c in r.choices)
    r = cloud.chat.completions.create(
        model=CLOUD_LM,
        messages=[{"role": "user", "content": "a date"}],
        extra_body={"response_format": {"type": "regex", "regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"}},
        temperature=0.7,
        max_tokens=20,
    )
    content = r.choices[0].message.content or ""
    assert r.choices[0].finish_reason == "stop" and len(content) == 10 and content[:2] == "20" and content[4] == "-"


@pytest.mark.parametrize("tier", ["cloud", "edge"])
def test_a_format_the_engine_cannot_compile_is_a_400_naming_the_problem(
    request: pytest.FixtureRequest, tier: str
) -> None:
    client: openai.OpenAI = request.getfixturevalue(tier)
    model = CLOUD_LM if tier == "cloud" else EDGE_LMS[0]
    bad: list[tuple[dict[str, Any], str, str]] = [
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"properties": {"a": {"$ref": "#/nope"}}}}},
            "response_format",
            "/nope",
        ),
        ({"type": "regex", "regex": "(["}, "response_format", "unclosed character class"),
    ]
    for fmt, param, words in bad:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as exc:
                client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": "x"}],
                    extra_body={"response_format": fmt},
                    max_tokens=5,
                    stream=stream,
                )
            body: Any = exc.value.body
            assert body["param"] == param and words in body["message"], body
    with pytest.raises(openai.BadRequestError) as both:
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_object"},
            stop=["}"],
        )
    assert "stop cannot be combined" in str(both.value.body)


def test_an_async_job_keeps_its_response_format(cloud: openai.OpenAI) -> None:
    """The stored job is the request dumped by alias (``json_schema.schema``) and validated again when it runs."""
    url, headers = str(cloud.base_url).rstrip("/"), {"Authorization": f"Bearer {cloud.api_key}"}
    schema = {**Pet.model_json_schema(), "additionalProperties": False}  # else extra keys may run to max_tokens
    fmt = {"type": "json_schema", "json_schema": {"name": "Pet", "schema": schema, "strict": True}}
    body = {"model": CLOUD_LM, "messages": [{"role": "user", "content": "a pet"}], "response_format": fmt}
    submitted = httpx.post(
        f"{url}/chat/completions", json={**body, "max_tokens": MAX_TOKENS, "async": True}, headers=headers
    )
    assert submitted.status_code == 202, submitted.text
    deadline = time.monotonic() + 60
    while (job := httpx.get(f"{url}/jobs/{submitted.json()['id']}", headers=headers).json())["status"] not in (
        "succeeded",
        "failed",
    ):
        assert time.monotonic() < deadline, job
        time.sleep(0.2)
    assert job["status"] == "succeeded", job
    choice = job["result"]["choices"][0]
    assert choice["finish_reason"] == "stop"
    Pet.model_validate_json(choice["message"]["content"])


def test_a_request_dumped_for_the_cloud_validates_again() -> None:
    """What the edge forwards when it escalates (and a job stores) is the wire form: ``schema``, not ``schema_``."""
    fmt = {"type": "json_schema", "json_schema": {"name": "Pet", "schema": Pet.model_json_schema(), "strict": True}}
    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": fmt}
    )
    wire = req.model_dump(mode="json", by_alias=True, exclude_unset=True)
    assert wire["response_format"] == fmt
    assert ChatCompletionRequest.model_validate(wire) == req


@pytest.mark.parametrize("tier", ["cloud", "edge"])
def test_completions_take_a_response_format_too(request: pytest.FixtureRequest, tier: str) -> None:
    """``/v1/completions`` with ``response_format`` (an extension there, as on vLLM): the same grammars."""
    client: openai.OpenAI = request.getfixturevalue(tier)
    model = CLOUD_LM if tier == "cloud" else EDGE_LMS[0]
    schema = {**Pet.model_json_schema(), "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "Pet", "schema": schema}}
    for i in range(4):
        body: dict[str, Any] = {
            "model": model,
            "prompt": PROMPTS[i],
            "max_tokens": MAX_TOKENS,
            "temperature": 0 if i < 2 else 1.0,
            "seed": i,
            "extra_body": {"response_format": fmt},
        }
        if i % 2:
            chunks = list(client.completions.create(**body, stream=True))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        else:
            r = client.completions.create(**body)
            text, finish = r.choices[0].text, [r.choices[0].finish_reason]
        assert finish == ["stop"], text
        Pet.model_validate_json(text)
    if tier == "cloud":  # several prompts and n: a matcher per sequence
        r = client.completions.create(
            model=model,
            prompt=["yes or no?", "no or yes?"],
            n=2,
            max_tokens=8,
            temperature=1.0,
            extra_body={"response_format": {"type": "choice", "choice": ["yes", "no"]}},
        )
        assert len(r.choices) == 4 and all(c.text in ("yes", "no") and c.finish_reason == "stop" for c in r.choices)
    with pytest.raises(openai.BadRequestError) as both:
        client.completions.create(
            model=model, prompt="x", stop=["}"], extra_body={"response_format": {"type": "json_object"}}
        )
    assert "stop cannot be combined" in str(both.value.body)

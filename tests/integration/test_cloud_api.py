"""The cloud inference API over a real socket with the official openai SDK and httpx: chat and completions,
streaming with usage, OpenAI-shaped errors, and one usage record per request."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from sqlalchemy import create_engine
from sqlmodel import Session, select

from controlplane.storage.tables import Tenant, UsageRecord
from tests.conftest import (
    base_env,
    engine_processes,
    free_port,
    migrated_sqlite,
    run_server,
    seed_data_dir,
    server_process,
)
from tests.forkserver import run_tierline

pytestmark = pytest.mark.integration
MODEL = "tierline/lm-cloud"
# Every test here streams through merged engine updates (tests/integration/test_engine.py checks the merging
# itself: a stream's first tokens and its end at once, at least this many tokens an update in between).
STREAM_INTERVAL = 2


@pytest.fixture(scope="module")
def cloud_api(
    tmp_path_factory: pytest.TempPathFactory, tiny_zoo: Path, session_data_dir: Path
) -> Iterator[dict[str, str]]:
    data = seed_data_dir(tmp_path_factory.mktemp("cloud-api"), tiny_zoo, session_data_dir)
    db_url = migrated_sqlite(data)
    env = base_env(
        data,
        TIERLINE_DATABASE_URL=db_url,
        TIERLINE_CLOUD_ZOO_PRESET="tiny",
        TIERLINE_CLOUD_KV_CACHE_MB="16",
        TIERLINE_CLOUD_USAGE_FLUSH_MS="50",
        TIERLINE_CLOUD_STREAM_INTERVAL=str(STREAM_INTERVAL),
    )

    def cli(*args: str) -> str:
        proc = run_tierline(*args, env=env, check=True)
        return proc.stdout.strip()

    cli("tenants", "create", "acme")
    cli("tenants", "create", "globex")
    key = cli("keys", "create", "--tenant", "acme")
    other = cli("keys", "create", "--tenant", "globex")
    with run_server(["cloud", "serve"], env, free_port(), timeout=120) as url:
        yield {"url": url, "key": key, "other_key": other, "db": db_url}


@pytest.fixture
def client(cloud_api: dict[str, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cloud_api['url']}/v1", api_key=cloud_api["key"], max_retries=0)


def usage_rows(db_url: str, request_id: str, timeout: float = 5.0) -> list[UsageRecord]:
    engine = create_engine(db_url)
    deadline = time.monotonic() + timeout
    while True:
        with Session(engine) as s:
            rows = list(s.exec(select(UsageRecord).where(UsageRecord.id == request_id)))
        if rows or time.monotonic() > deadline:
            engine.dispose()
            return rows
        time.sleep(0.05)


def test_chat_completion_with_the_openai_sdk_is_metered_once(client: openai.OpenAI, cloud_api: dict[str, str]) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}],
        max_tokens=12,
        temperature=0,
        extra_headers={"x-request-id": "test-chat-1"},
    )
    assert raw.headers["x-request-id"] == "test-chat-1" and raw.headers["x-tierline-tier"] == "cloud"
    resp = raw.parse()
    assert resp.object == "chat.completion" and resp.model == MODEL
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert resp.usage is not None and resp.usage.completion_tokens <= 12 and resp.usage.prompt_tokens > 5
    # The client's id is echoed for correlation; what it is billed under is the server's choice.
    usage_id = raw.headers["x-tierline-usage-id"]
    assert usage_id != "test-chat-1"
    rows = usage_rows(cloud_api["db"], usage_id)
    assert len(rows) == 1
    row = rows[0]
    assert (row.prompt_tokens, row.completion_tokens) == (resp.usage.prompt_tokens, resp.usage.completion_tokens)
    assert row.model == MODEL and row.tier == "cloud" and row.status == "ok" and row.latency_ms and row.latency_ms > 0


def test_streamed_chat_equals_the_unstreamed_answer_and_reports_usage(client: openai.OpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "import os\n"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert text == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert usage is not None and full.usage is not None
    assert usage.completion_tokens == full.usage.completion_tokens


def test_completions_with_several_prompts_n_and_logprobs(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model=MODEL, prompt=["def f(x):\n", "class A:\n"], max_tokens=8, n=2, temperature=0.8, seed=3, logprobs=2
    )
    assert sorted(c.index for c in resp.choices) == [0, 1, 2, 3]
    for c in resp.choices:
        assert c.logprobs is not None and c.logprobs.token_logprobs is not None
        assert len(c.logprobs.token_logprobs) == len(c.logprobs.tokens or [])
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
        # The sampled token is always among the alternatives (added after the top 2 when drawn from outside).
        assert all(t in top for t, top in zip(c.logprobs.tokens or [], c.logprobs.top_logprobs or [], strict=True))
    assert resp.usage is not None and resp.usage.completion_tokens == sum(
        len(c.logprobs.tokens or []) for c in resp.choices if c.logprobs
    )
    streamed = "".join(
        (chunk.choices[0].text if chunk.choices else "")
        for chunk in client.completions.create(
            model=MODEL, prompt="for i in", max_tokens=10, temperature=0, stream=True
        )
    )
    again = client.completions.create(model=MODEL, prompt="for i in", max_tokens=10, temperature=0)
    assert streamed == again.choices[0].text


def test_errors_surface_as_the_sdks_exception_types(client: openai.OpenAI, cloud_api: dict[str, str]) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="no/such-model", messages=[{"role": "user", "content": "hi"}])
    assert nf.value.body["code"] == "model_not_found"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=3)
    assert bad.value.body["param"] == "temperature"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as empty:
        client.chat.completions.create(model=MODEL, messages=[])
    assert empty.value.body["param"] == "messages"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model=MODEL, prompt="x", max_tokens=100_000)
    assert long.value.body["code"] == "context_length_exceeded"  # type: ignore[index]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{cloud_api['url']}/v1", api_key="tl-wrong", max_retries=0).models.list()
    r = httpx.post(
        f"{cloud_api['url']}/v1/chat/completions",
        content=b"{not json",
        headers={"Authorization": f"Bearer {cloud_api['key']}", "Content-Type": "application/json"},
    )
    assert r.status_code == 400 and "error" in r.json()
    big = httpx.post(
        f"{cloud_api['url']}/v1/completions",
        content=json.dumps({"model": MODEL, "prompt": "x" * (5 << 20)}),
        headers={"Authorization": f"Bearer {cloud_api['key']}", "Content-Type": "application/json"},
    )
    assert big.status_code == 413


def test_an_abandoned_stream_stops_generating_and_is_billed_for_what_was_generated(
    cloud_api: dict[str, str],
) -> None:
    body = {"model": MODEL, "prompt": "import sys\n", "max_tokens": 200, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {cloud_api['key']}", "x-request-id": "abandoned-1"}
    with httpx.stream("POST", f"{cloud_api['url']}/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200 and r.headers["x-request-id"] == "abandoned-1"
        usage_id = r.headers["x-tierline-usage-id"]
        lines = 0
        for line in r.iter_lines():
            lines += line.startswith("data: ")
            if lines >= 3:
                break
    rows = usage_rows(cloud_api["db"], usage_id)
    assert len(rows) == 1
    assert rows[0].status == "abandoned" and 0 < rows[0].completion_tokens < 200


def test_metrics_expose_requests_tokens_and_engine_state_without_secrets(
    client: openai.OpenAI, cloud_api: dict[str, str]
) -> None:
    client.completions.create(model=MODEL, prompt="x = 1\n", max_tokens=4, temperature=0)
    text = httpx.get(f"{cloud_api['url']}/metrics").text
    assert 'tierline_requests_total{route="/v1/completions",status="200"}' in text
    assert 'tierline_tokens_total{direction="out",model="tierline/lm-cloud",tier="cloud",version=""}' in text
    assert "tierline_time_to_first_token_seconds_bucket" in text
    assert 'tierline_engine_kv_cache_usage_ratio{model="tierline/lm-cloud"' in text
    for vllm_name in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc"):  # vLLM's names too
        assert f'vllm:{vllm_name}{{model_name="tierline/lm-cloud"}}' in text
    assert cloud_api["key"] not in text and "acme" not in text


def test_rate_limited_tenant_gets_429_with_retry_after(client: openai.OpenAI, cloud_api: dict[str, str]) -> None:
    engine = create_engine(cloud_api["db"])
    with Session(engine) as s:
        globex = s.exec(select(Tenant).where(Tenant.name == "globex")).one()
        globex.requests_per_minute = 2
        s.add(globex)
        s.commit()
    engine.dispose()
    headers = {"Authorization": f"Bearer {cloud_api['other_key']}"}
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    codes = [httpx.post(f"{cloud_api['url']}/v1/completions", json=body, headers=headers) for _ in range(3)]
    assert [r.status_code for r in codes] == [200, 200, 429]
    limited = codes[-1]
    assert int(limited.headers["Retry-After"]) >= 1
    assert limited.json()["error"]["type"] == "rate_limit_error"
    # acme (another tenant) is unaffected
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=1).choices


def test_idempotency_key_replays_the_response_and_bills_once(cloud_api: dict[str, str]) -> None:
    url = f"{cloud_api['url']}/v1/completions"
    headers = {"Authorization": f"Bearer {cloud_api['key']}", "Idempotency-Key": "retry-me-1"}
    body = {"model": MODEL, "prompt": "def g():\n", "max_tokens": 8, "temperature": 1.0}
    first = httpx.post(url, json=body, headers=headers)
    again = httpx.post(url, json=body, headers=headers)
    assert first.status_code == again.status_code == 200
    assert again.json() == first.json() and again.headers["x-tierline-idempotent-replay"] == "true"
    rows = usage_rows(cloud_api["db"], first.headers["x-tierline-usage-id"])
    assert len(rows) == 1 and rows[0].completion_tokens == first.json()["usage"]["completion_tokens"]
    changed = httpx.post(url, json={**body, "max_tokens": 9}, headers=headers)
    assert changed.status_code == 422 and changed.json()["error"]["code"] == "idempotency_key_reused"
    streamed = httpx.post(url, json={**body, "stream": True}, headers={**headers, "Idempotency-Key": "s-1"})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "stream"
    # The key is the tenant's own: another tenant using the same key gets its own fresh answer.
    other = httpx.post(url, json=body, headers={**headers, "Authorization": f"Bearer {cloud_api['other_key']}"})
    assert other.status_code in (200, 429) and "x-tierline-idempotent-replay" not in other.headers


def test_openapi_schema_describes_the_inference_routes(cloud_api: dict[str, str]) -> None:
    schema = httpx.get(f"{cloud_api['url']}/schema/openapi.json").json()
    chat = schema["paths"]["/v1/chat/completions"]["post"]
    body_ref = chat["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    props = schema["components"]["schemas"][body_ref]["properties"]
    assert {"model", "messages", "temperature", "stream", "max_tokens"} <= set(props)
    assert chat["security"] == [{"BearerAuth": []}]
    assert schema["components"]["securitySchemes"]["BearerAuth"]["scheme"] == "bearer"
    assert "requestBody" in schema["paths"]["/v1/completions"]["post"]


def test_generic_inference_serves_tensor_models_in_batches_and_llms(cloud_api: dict[str, str], tiny_zoo: Path) -> None:
    import numpy as np

    from shared.zoo.registry import ZooLayout

    held = np.load(ZooLayout(tiny_zoo).artifact_dir("digits-held-out") / "digits-held-out.npz")
    x, y = held[held.files[0]], held[held.files[1]]
    url, headers = f"{cloud_api['url']}/v1/inference", {"Authorization": f"Bearer {cloud_api['key']}"}

    async def many() -> list[httpx.Response]:
        async with httpx.AsyncClient(headers=headers, timeout=60) as c:
            return list(
                await asyncio.gather(
                    *(
                        c.post(url, json={"model_id": "tierline/digits-large", "inputs": x[i : i + 4].tolist()})
                        for i in range(0, 64, 4)
                    )
                )
            )

    responses = asyncio.run(many())
    assert all(r.status_code == 200 for r in responses)
    labels = [label for r in responses for label in r.json()["labels"]]
    assert len(labels) == 64 and all(len(o) == 10 for r in responses for o in r.json()["outputs"])
    assert np.mean(np.asarray(labels) == y[:64]) > 0.8  # the classifier, not noise
    bad = httpx.post(url, json={"model_id": "tierline/digits-large", "inputs": [[0.0] * 63]}, headers=headers)
    assert bad.status_code == 400 and "64" in bad.json()["error"]["message"]
    llm = httpx.post(
        url,
        json={"model_id": MODEL, "inputs": ["def f():\n", "x = "], "parameters": {"max_tokens": 5, "temperature": 0}},
        headers=headers,
    )
    assert llm.status_code == 200 and len(llm.json()["outputs"]) == 2
    assert llm.json()["usage"]["completion_tokens"] <= 10
    unknown = httpx.post(url, json={"model_id": MODEL, "inputs": ["x"], "parameters": {"beam": 2}}, headers=headers)
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "parameters.beam"
    missing = httpx.post(url, json={"model_id": "nope", "inputs": [1]}, headers=headers)
    assert missing.status_code == 404


def test_a_key_limited_to_some_models_is_refused_the_others(cloud_api: dict[str, str]) -> None:
    from controlplane.tenancy.service import create_api_key

    engine = create_engine(cloud_api["db"])
    with Session(engine) as s:
        acme = s.exec(select(Tenant).where(Tenant.name == "acme")).one()
        issued = create_api_key(s, acme, name="lm-only", allowed_models=[MODEL])
        s.commit()
    engine.dispose()
    headers = {"Authorization": f"Bearer {issued.secret}"}
    url = cloud_api["url"]
    tensor = httpx.post(
        f"{url}/v1/inference", json={"model_id": "tierline/digits-large", "inputs": [[0.0] * 64]}, headers=headers
    )
    assert tensor.status_code == 403 and tensor.json()["error"]["param"] == "model_id"
    other = httpx.post(
        f"{url}/v1/completions", json={"model": "tierline/lm-edge", "prompt": "x", "max_tokens": 1}, headers=headers
    )
    assert other.status_code == 403 and other.json()["error"]["param"] == "model"
    ok = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}, headers=headers)
    assert ok.status_code == 200


def test_a_reused_request_id_is_billed_for_every_request(cloud_api: dict[str, str]) -> None:
    headers = {"Authorization": f"Bearer {cloud_api['key']}", "x-request-id": "same-id-twice"}
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    answers = [httpx.post(f"{cloud_api['url']}/v1/completions", json=body, headers=headers) for _ in range(2)]
    assert all(r.status_code == 200 and r.headers["x-request-id"] == "same-id-twice" for r in answers)
    usage_ids = {r.headers["x-tierline-usage-id"] for r in answers}
    assert len(usage_ids) == 2
    for usage_id in usage_ids:
        assert len(usage_rows(cloud_api["db"], usage_id)) == 1
    # Errors carry the request id too, for correlation with the server's logs.
    bad = httpx.post(f"{cloud_api['url']}/v1/completions", json={"model": MODEL}, headers=headers)
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "same-id-twice"


def test_an_engine_that_dies_mid_stream_ends_the_stream_with_an_error_and_the_cloud_is_not_ready(
    tmp_path_factory: pytest.TempPathFactory, tiny_zoo: Path, session_data_dir: Path
) -> None:
    data = seed_data_dir(tmp_path_factory.mktemp("engine-dies"), tiny_zoo, session_data_dir)
    db_url = migrated_sqlite(data)
    env = base_env(
        data,
        TIERLINE_DATABASE_URL=db_url,
        TIERLINE_CLOUD_ZOO_PRESET="tiny",
        TIERLINE_CLOUD_KV_CACHE_MB="16",
        TIERLINE_CLOUD_USAGE_FLUSH_MS="50",
        TIERLINE_CLOUD_SPECULATION="off",
        TIERLINE_CLOUD_ENGINE_RESTART_BACKOFF_S="60",  # the restarts wait: what this test sees is the gap
    )
    run = lambda *a: run_tierline(*a, env=env, check=True)  # noqa: E731
    run("tenants", "create", "acme")
    key = run("keys", "create", "--tenant", "acme").stdout.strip()
    port = free_port()
    url, headers = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {key}"}
    with server_process(["cloud", "serve"], env, port, ready_path="/readyz", timeout=120) as server:
        engines = engine_processes(server.pid)
        assert len(engines) == 2  # lm-cloud and lm-edge, each stepping in a process of its own
        body = {"model": MODEL, "prompt": "import sys\n", "max_tokens": 200, "ignore_eos": True, "stream": True}
        events: list[str] = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=60) as r:
            assert r.status_code == 200
            usage_id = r.headers["x-tierline-usage-id"]
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    if len(events) == 2:
                        for pid in engines:
                            os.kill(pid, signal.SIGKILL)
        # The stream ends with an OpenAI-shaped error event (no [DONE]), not a connection cut mid-chunk.
        error = json.loads(events[-1])["error"]
        assert error["code"] == "unavailable" and "exited" in error["message"], events[-1]
        assert "[DONE]" not in events
        later = httpx.post(f"{url}/v1/completions", json={**body, "stream": False}, headers=headers, timeout=60)
        assert later.status_code == 503 and later.json()["error"]["code"] == "engine_restarting"
        assert int(later.headers["retry-after"]) >= 1  # supervision restarts it (test_engine_supervision.py)
        ready = httpx.get(f"{url}/readyz")
        assert ready.status_code == 503 and "engine restarting" in ready.json()["error"]["message"]
    (row,) = usage_rows(db_url, usage_id)
    assert row.status == "error" and 0 < row.completion_tokens < 200  # billed for what was generated


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/completions", "max_tokens", "5"),
        ("/v1/completions", "max_tokens", True),
        ("/v1/completions", "max_tokens", 2.0),
        ("/v1/chat/completions", "max_tokens", "5"),
        ("/v1/chat/completions", "max_completion_tokens", True),
        ("/v1/chat/completions", "temperature", "0.5"),
        ("/v1/completions", "stream", "false"),
        ("/v1/completions", "seed", False),
        ("/v1/completions", "prompt", [1, True]),
    ],
)
def test_values_of_the_wrong_json_type_are_refused_naming_the_field(
    cloud_api: dict[str, str], path: str, field: str, value: Any
) -> None:
    """``"5"`` is not an integer and ``true`` is not 1: refused, not coerced (as /v1/inference does)."""
    body: dict[str, Any] = {"model": MODEL, field: value}
    if path == "/v1/chat/completions":
        body.setdefault("messages", [{"role": "user", "content": "hi"}])
    else:
        body.setdefault("prompt", "hi")
    r = httpx.post(f"{cloud_api['url']}{path}", json=body, headers={"Authorization": f"Bearer {cloud_api['key']}"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and r.json()["error"]["message"].startswith(field)
    fine = {**body, "temperature": 0, "max_tokens": 2}
    fine.pop("max_completion_tokens", None)
    if field == "prompt":
        fine["prompt"] = [1, 2]
    for name in ("stream", "seed"):
        fine.pop(name, None)
    ok = httpx.post(f"{cloud_api['url']}{path}", json=fine, headers={"Authorization": f"Bearer {cloud_api['key']}"})
    assert ok.status_code == 200, ok.text  # an integer where a number is wanted is still a number

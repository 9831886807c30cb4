"""A served model backed by two ``tierline engine serve`` processes behind a real ``tierline cloud serve`` (an
``openai`` backend): the openai SDK through the gateway, billing from the upstream's usage, errors passed
through, and a SIGKILL of one upstream under concurrent streams (failover, ejection, re-admission)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import create_engine
from sqlmodel import Session, col, select

from cloud.engine.llm import LLM
from cloud.engine.sampling_params import SamplingParams
from controlplane.storage.tables import UsageRecord
from shared.zoo.registry import ZooLayout
from tests.conftest import base_env, free_port, migrated_sqlite, seed_data_dir, server_process
from tests.forkserver import run_tierline

pytestmark = pytest.mark.integration
MODEL = "remote-lm"
DOWN_MODEL = "remote-lm-down"  # its only endpoint refuses connections: ejected after the first failure
RETRY_MODEL = "remote-lm-retry"  # one endpoint refuses every connection and is never ejected: each request retries
PROMPT = "The quick brown fox"
HALF = 16  # the SIGKILL test: this many streams run when one upstream is killed, this many more arrive after


class Upstream:
    """One ``tierline engine serve`` on a fixed port, which a test may SIGKILL and start again."""

    def __init__(self, lm_dir: Path, env: dict[str, str], log: Path, key_file: Path) -> None:
        self.lm_dir, self.env, self.log, self.key = lm_dir, env, log, str(key_file)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._stack = contextlib.ExitStack()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        # the upstream requires the key the gateway is configured with: every relayed request proves it is sent
        args = ["engine", "serve", "--model", str(self.lm_dir), "--name", "lm-cloud", "--api-key-file", self.key]
        self.proc = self._stack.enter_context(
            server_process(args, self.env, self.port, ready_path="/health", timeout=180, log=self.log)
        )

    def kill(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)  # a real SIGKILL: its engine child sees its pipe close and exits
        self.proc.wait()
        self._stack.close()
        self._stack = contextlib.ExitStack()

    def stop(self) -> None:
        self._stack.close()


@pytest.fixture(scope="module")
def lm_dir(tiny_zoo: Path) -> Path:
    return ZooLayout(tiny_zoo).artifact_dir("lm-cloud")


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, tiny_zoo: Path, session_data_dir: Path, lm_dir: Path
) -> Iterator[dict[str, Any]]:
    data = seed_data_dir(tmp_path_factory.mktemp("backends"), tiny_zoo, session_data_dir)
    upstream_env = base_env(data, TIERLINE_CLOUD_KV_CACHE_MB="32", TIERLINE_CLOUD_NUM_THREADS="1")
    key_file = data / "upstream.key"
    key_file.write_text("sk-upstream-secret\n")
    key_file.chmod(0o600)
    upstreams = [Upstream(lm_dir, upstream_env, data / f"upstream-{i}.log", key_file) for i in range(2)]
    backends = data / "backends.json"
    spec = {
        "type": "openai",
        "endpoints": [u.url for u in upstreams],
        "upstream_model": "lm-cloud",
        "tokenizer": str(lm_dir),
        "api_key_file": str(key_file),
        "max_concurrency": 32,
        "eject_after_failures": 2,
        "eject_s": 1.0,
        "probe_interval_s": 0.3,
    }
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there: every connection is refused
    never_ejected = {**spec, "endpoints": [dead, upstreams[1].url], "eject_after_failures": 1000}
    down = {**spec, "endpoints": [dead], "eject_after_failures": 1, "eject_s": 60.0}
    backends.write_text(json.dumps({"models": {MODEL: spec, RETRY_MODEL: never_ejected, DOWN_MODEL: down}}))
    db_url = migrated_sqlite(data)
    env = base_env(
        data,
        TIERLINE_DATABASE_URL=db_url,
        TIERLINE_CLOUD_ZOO_PRESET="none",  # a gateway only: no engine of its own
        TIERLINE_CLOUD_USAGE_FLUSH_MS="50",
        TIERLINE_CLOUD_BACKENDS=str(backends),
    )

    def cli(*args: str) -> str:
        proc = run_tierline(*args, env=env, check=True)
        return proc.stdout.strip()

    cli("tenants", "create", "acme")
    key = cli("keys", "create", "--tenant", "acme")
    try:
        for u in upstreams:
            u.start()
        port = free_port()
        with server_process(["cloud", "serve"], env, port, timeout=180, log=data / "gateway.log"):
            yield {
                "url": f"http://127.0.0.1:{port}",
                "key": key,
                "db": db_url,
                "upstreams": upstreams,
                "dead": dead,
            }
    finally:
        for u in upstreams:
            u.stop()


@pytest.fixture(scope="module")
def offline(lm_dir: Path) -> LLM:
    return LLM(lm_dir, kv_cache_bytes=32 << 20)


@pytest.fixture
def client(gateway: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway['url']}/v1", api_key=gateway["key"], max_retries=0)


def usage_rows(db_url: str, ids: list[str], timeout: float = 5.0) -> list[UsageRecord]:
    engine = create_engine(db_url)
    deadline = time.monotonic() + timeout
    try:
        while True:
            with Session(engine) as s:
                rows = list(s.exec(select(UsageRecord).where(col(UsageRecord.id).in_(ids))))
            if len(rows) >= len(ids) or time.monotonic() > deadline:
                return rows
            time.sleep(0.05)
    finally:
        engine.dispose()


def test_the_model_is_listed_and_a_chat_is_billed_once_from_the_upstreams_usage(
    client: openai.OpenAI, gateway: dict[str, Any], offline: LLM
) -> None:
    assert MODEL in [m.id for m in client.models.list()]
    messages = [{"role": "user", "content": "Say something about foxes."}]
    prompt = offline.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    expected = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=9))[0]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say something about foxes."}],
        max_tokens=9,
        temperature=0,
    )
    answer = raw.parse()
    assert answer.model == MODEL and answer.choices[0].message.content == expected.text
    assert answer.usage is not None
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(expected.prompt_token_ids), 9)
    usage_id = raw.headers["x-tierline-usage-id"]
    assert answer.id == f"chatcmpl-{usage_id}" and raw.headers["x-tierline-tier"] == "cloud"
    (row,) = usage_rows(gateway["db"], [usage_id])
    assert (row.model, row.status, row.usage_source) == (MODEL, "ok", "upstream")
    assert (row.prompt_tokens, row.completion_tokens) == (len(expected.prompt_token_ids), 9)


def test_tools_pass_through_to_the_upstream_and_its_calls_come_back(
    client: openai.OpenAI, gateway: dict[str, Any]
) -> None:
    """The upstream (``engine serve``) gets the client's tools and tool messages unchanged and generates the calls."""
    params = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
    tools: Any = [
        {"type": "function", "function": {"name": "pick", "parameters": {**params, "additionalProperties": False}}}
    ]
    body: Any = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "pick a number"}],
        "tools": tools,
        "tool_choice": {"type": "function", "function": {"name": "pick"}},
        "max_tokens": 60,
        "temperature": 0,
    }
    raw = client.chat.completions.with_raw_response.create(**body)
    answer = raw.parse()
    c = answer.choices[0]
    assert c.finish_reason == "tool_calls", c.message.content
    (call,) = c.message.tool_calls or []
    assert call.function.name == "pick"
    assert 0 <= json.loads(call.function.arguments)["n"] <= 9
    (row,) = usage_rows(gateway["db"], [raw.headers["x-tierline-usage-id"]])
    assert answer.usage is not None and row.completion_tokens == answer.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(**body, stream=True))
    deltas = [d for ch in chunks for choice in ch.choices for d in choice.delta.tool_calls or ()]
    assert deltas[0].function is not None and deltas[0].function.name == "pick"
    assert "".join(d.function.arguments or "" for d in deltas if d.function) == call.function.arguments
    history = [*body["messages"], c.message.model_dump(exclude_none=True)]
    history.append({"role": "tool", "tool_call_id": call.id, "content": "ok"})
    follow = client.chat.completions.create(model=MODEL, messages=history, tools=tools, max_tokens=4)
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_stream_relays_the_upstream_text_and_is_billed_even_when_the_client_wants_no_usage(
    client: openai.OpenAI, gateway: dict[str, Any], offline: LLM
) -> None:
    expected = offline.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=11))[0]
    with_usage = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=11,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in with_usage if c.choices) == expected.text
    assert with_usage[-1].usage is not None and with_usage[-1].usage.completion_tokens == 11
    assert with_usage[-1].usage.prompt_tokens == len(expected.prompt_token_ids)
    raw = httpx.post(
        f"{gateway['url']}/v1/completions",
        headers={"Authorization": f"Bearer {gateway['key']}"},
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 11, "temperature": 0, "stream": True},
    )
    events = [line[6:] for line in raw.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("usage" not in c and c["choices"] for c in chunks), "the client asked for no usage chunk"
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected.text
    (row,) = usage_rows(gateway["db"], [raw.headers["x-tierline-usage-id"]])
    assert (row.prompt_tokens, row.completion_tokens, row.usage_source) == (
        len(expected.prompt_token_ids),
        11,
        "upstream",
    )


def test_an_upstream_4xx_passes_through_with_its_message_and_bills_nothing(
    client: openai.OpenAI, gateway: dict[str, Any]
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=[10**7, 5], max_tokens=2)
    assert err.value.status_code == 400
    body = err.value.body
    assert isinstance(body, dict) and "token ids must be integers" in body["message"]
    assert body["param"] == "prompt"
    # refused by the gateway itself before any upstream call: the context is checked with the model's tokenizer
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="fox " * 400, max_tokens=2)


def test_a_large_prompt_is_counted_off_the_event_loop_which_keeps_answering_meanwhile(
    gateway: dict[str, Any],
) -> None:
    # ~1 MB (the limit is 1 MiB): 0.2-0.4 s of tokenising here (`tokenizers` spreads it over the cores)
    prompt = "the quick brown fox jumps " * 38_000
    answer: dict[str, Any] = {}

    def large() -> None:
        started = time.monotonic()
        response = httpx.post(
            f"{gateway['url']}/v1/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": 1},
            headers={"Authorization": f"Bearer {gateway['key']}"},
            timeout=120,
        )
        answer.update(status=response.status_code, body=response.json(), took=time.monotonic() - started)

    slowest = 0.0
    with httpx.Client(base_url=gateway["url"], timeout=120) as http:
        assert http.get("/healthz").status_code == 200  # connected before the large request starts
        thread = threading.Thread(target=large)
        thread.start()
        while thread.is_alive():
            started = time.monotonic()
            assert http.get("/healthz").status_code == 200
            slowest = max(slowest, time.monotonic() - started)
        thread.join()
    # refused after counting (its ~540k tokens are past the context), as before, and only then
    assert answer["status"] == 400 and "context" in answer["body"]["error"]["message"], answer
    # long enough to tell a blocked loop from a busy host (CI's faster host took 0.297 s)
    assert answer["took"] > 0.1, answer
    # counted on the event loop, a /healthz sent meanwhile waited for the whole count
    assert slowest < answer["took"] / 2, (slowest, answer["took"])


def test_an_idempotent_retry_is_replayed_and_billed_once(gateway: dict[str, Any]) -> None:
    headers = {"Authorization": f"Bearer {gateway['key']}", "Idempotency-Key": "backend-retry-1"}
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    first = httpx.post(f"{gateway['url']}/v1/completions", headers=headers, json=body)
    second = httpx.post(f"{gateway['url']}/v1/completions", headers=headers, json=body)
    assert first.status_code == second.status_code == 200
    assert second.headers["x-tierline-idempotent-replay"] == "true"
    assert first.json() == second.json()
    assert len(usage_rows(gateway["db"], [first.headers["x-tierline-usage-id"]])) == 1


def test_a_request_refused_by_one_endpoint_is_retried_on_another_before_any_byte(
    client: openai.OpenAI, gateway: dict[str, Any]
) -> None:
    """Half the picks land on the dead endpoint (least outstanding, then least recently used): each is retried."""
    for _ in range(4):
        answer = client.completions.create(model=RETRY_MODEL, prompt=PROMPT, max_tokens=3)
        assert answer.usage is not None and answer.usage.completion_tokens == 3
        chunks = list(client.completions.create(model=RETRY_MODEL, prompt=PROMPT, max_tokens=3, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices)
    metrics = httpx.get(f"{gateway['url']}/metrics").text
    assert _metric(metrics, "tierline_backend_failures_total", gateway["dead"], RETRY_MODEL) >= 3


def test_an_unreachable_upstream_is_502_then_503_with_retry_after_and_bills_nothing(
    gateway: dict[str, Any],
) -> None:
    headers = {"Authorization": f"Bearer {gateway['key']}"}
    body = {"model": DOWN_MODEL, "prompt": PROMPT, "max_tokens": 2}
    failed = httpx.post(f"{gateway['url']}/v1/completions", headers=headers, json=body)
    assert failed.status_code == 502, failed.text
    assert failed.json()["error"]["type"] == "server_error" and "upstream" in failed.json()["error"]["message"]
    assert int(failed.headers["retry-after"]) >= 1
    ejected = httpx.post(f"{gateway['url']}/v1/completions", headers=headers, json={**body, "stream": True})
    assert ejected.status_code == 503, ejected.text
    assert "no healthy upstream endpoint" in ejected.json()["error"]["message"]
    assert int(ejected.headers["retry-after"]) >= 1
    # /readyz names the degraded model and stays 200: the gateway still serves every other model.
    ready = httpx.get(f"{gateway['url']}/readyz")
    assert ready.status_code == 200, ready.text
    assert DOWN_MODEL in ready.json()["degraded"] and MODEL not in ready.json()["degraded"]
    assert ready.json()["upstreams"][DOWN_MODEL] == {"endpoints": 1, "admitted": 0}
    time.sleep(0.3)  # past the usage writer's flush interval
    engine = create_engine(gateway["db"])
    with Session(engine) as s:
        assert list(s.exec(select(UsageRecord).where(UsageRecord.model == DOWN_MODEL))) == []
    engine.dispose()


def test_the_upstream_refuses_a_request_without_the_key_the_gateway_sends(gateway: dict[str, Any]) -> None:
    body = {"model": "lm-cloud", "prompt": PROMPT, "max_tokens": 2}
    assert httpx.post(f"{gateway['upstreams'][0].url}/v1/completions", json=body).status_code == 401


def _upstream_abandoned(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("tierline_engine_requests_total") and 'status="abandoned"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_client_that_leaves_mid_stream_aborts_the_upstream_request_and_is_billed_for_what_it_got(
    gateway: dict[str, Any],
) -> None:
    upstreams = gateway["upstreams"]
    before = sum(_upstream_abandoned(u.url) for u in upstreams)
    headers = {"Authorization": f"Bearer {gateway['key']}"}
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    received = 0
    with httpx.stream("POST", f"{gateway['url']}/v1/completions", headers=headers, json=body) as response:
        usage_id = response.headers["x-tierline-usage-id"]
        for line in response.iter_lines():
            received += line.startswith("data: ")
            if received == 3:
                break  # and the connection closes
    deadline = time.monotonic() + 10
    while sum(_upstream_abandoned(u.url) for u in upstreams) == before:
        assert time.monotonic() < deadline, "the upstream request was not aborted"
        time.sleep(0.1)
    (row,) = usage_rows(gateway["db"], [usage_id])
    # counted by the gateway (the upstream's usage comes at the end): the text relayed, re-tokenised
    assert row.status == "abandoned" and row.usage_source == "gateway" and 1 <= row.completion_tokens < 200


def _metric(text: str, name: str, endpoint: str, model: str = MODEL) -> float:
    for line in text.splitlines():
        if line.startswith(name) and f'endpoint="{endpoint}"' in line and f'model="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} for {endpoint} not in /metrics")


async def _stream(
    http: httpx.AsyncClient, started: asyncio.Event | None = None
) -> tuple[str, str, list[dict[str, Any]]]:
    """One streamed completion: (usage id, how it ended: done | error, its chunks)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 120, "temperature": 0, "ignore_eos": True}
    body["stream_options"] = {"include_usage": True}  # (an event may carry several tokens: a decode burst)
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200, await response.aread()
        chunks: list[dict[str, Any]] = []
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return response.headers["x-tierline-usage-id"], "done", chunks
            event = json.loads(line[6:])
            if "error" in event:
                return response.headers["x-tierline-usage-id"], "error", chunks
            chunks.append(event)
            if started is not None:
                started.set()
        return response.headers["x-tierline-usage-id"], "cut", chunks


def test_sigkill_of_one_upstream_under_32_streams_fails_over_ejects_and_readmits(gateway: dict[str, Any]) -> None:
    a, b = gateway["upstreams"]
    url = gateway["url"]

    async def scenario() -> tuple[list[tuple[str, str, list[dict[str, Any]]]], list[tuple[str, str, Any]]]:
        headers = {"Authorization": f"Bearer {gateway['key']}"}
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as http:
            flags = [asyncio.Event() for _ in range(HALF)]
            started = [asyncio.create_task(_stream(http, f)) for f in flags]
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in flags)), 60)  # each has streamed a byte
            a.kill()
            fresh = [asyncio.create_task(_stream(http)) for _ in range(HALF)]  # none has streamed a byte yet
            return await asyncio.gather(*started), await asyncio.gather(*fresh)

    before = httpx.get(f"{url}/metrics").text
    assert _metric(before, "tierline_backend_endpoint_admitted", a.url) == 1.0
    started, fresh = asyncio.run(scenario())
    # Not one request that had not streamed a byte failed: those sent to the dead endpoint went to the other.
    assert [how for _, how, _ in fresh] == ["done"] * HALF
    assert all(chunks[-1]["usage"]["completion_tokens"] == 120 for _, _, chunks in fresh)
    ended = [how for _, how, _ in started]
    assert "error" in ended, "some started streams were on the killed upstream"
    assert set(ended) <= {"done", "error"}
    # A stream cut by the kill is settled as the gateway sees the upstream fail, which may be just after the client
    # sees its error: its record is waited for (a lost one never comes).
    ids = [rid for rid, _, _ in started + fresh]
    deadline = time.monotonic() + 15
    while len(rows := {r.id: r for r in usage_rows(gateway["db"], ids)}) < 2 * HALF and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(rows) == 2 * HALF, "one usage record per request"
    for rid, how, chunks in started:
        row = rows[rid]
        if how == "error":  # billed for what it was sent before the upstream died, counted by the gateway
            assert row.status == "error" and row.usage_source == "gateway"
            text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            assert 0 < row.completion_tokens <= len(text) and row.prompt_tokens > 0
        else:
            assert (row.status, row.completion_tokens, row.usage_source) == ("ok", 120, "upstream")
    for rid, _, _ in fresh:
        assert (rows[rid].status, rows[rid].completion_tokens) == ("ok", 120)
    metrics = httpx.get(f"{url}/metrics").text
    assert _metric(metrics, "tierline_backend_endpoint_admitted", a.url) == 0.0
    assert _metric(metrics, "tierline_backend_ejections_total", a.url) >= 1
    # While it is out, requests go to the other endpoint only.
    sent_b = _metric(metrics, "tierline_backend_requests_total", b.url)
    headers = {"Authorization": f"Bearer {gateway['key']}"}
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    assert httpx.post(f"{url}/v1/completions", headers=headers, json=body).status_code == 200
    assert _metric(httpx.get(f"{url}/metrics").text, "tierline_backend_requests_total", b.url) == sent_b + 1

    a.start()  # back: the active probe re-admits it
    deadline = time.monotonic() + 15
    while _metric(httpx.get(f"{url}/metrics").text, "tierline_backend_endpoint_admitted", a.url) != 1.0:
        assert time.monotonic() < deadline, "the restarted endpoint was not re-admitted"
        time.sleep(0.2)
    sent_a = _metric(httpx.get(f"{url}/metrics").text, "tierline_backend_requests_total", a.url)
    for _ in range(4):
        assert httpx.post(f"{url}/v1/completions", headers=headers, json=body).status_code == 200
    assert _metric(httpx.get(f"{url}/metrics").text, "tierline_backend_requests_total", a.url) > sent_a

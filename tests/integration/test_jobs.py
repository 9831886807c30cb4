"""Async jobs and webhooks on a real cloud server: 202 then poll, signed webhooks to a real receiver with
retries, tenant isolation, refusals naming the field, and jobs that survive restarts and are billed once."""

from __future__ import annotations

import hashlib
import hmac
import json
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai.types.chat import ChatCompletion
from sqlalchemy import create_engine
from sqlmodel import Session, col, select

from cloud.gateway.jobs import JobStore
from cloud.gateway.webhooks import is_valid_signature
from controlplane.storage.database import create_db
from controlplane.storage.tables import Job, UsageRecord, WebhookDelivery, utcnow
from controlplane.tenancy.service import create_api_key, create_tenant
from tests.conftest import base_env, free_port, migrated_sqlite, seed_data_dir, server_process

pytestmark = pytest.mark.integration
MODEL = "tierline/lm-cloud"


# -- a real webhook receiver -------------------------------------------------------------------------------------
class Receiver:
    """An HTTP server on 127.0.0.1 recording each POST; ``fail_first[path]`` answers 500 that many times first."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        self.fail_first: dict[str, int] = {}
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                with receiver.lock:
                    receiver.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                    failing = receiver.fail_first.get(self.path, 0)
                    receiver.fail_first[self.path] = max(0, failing - 1)
                self.send_response(500 if failing else 204)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def received(self, path: str, count: int, timeout: float = 20.0) -> list[tuple[dict[str, str], bytes]]:
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                got = [(h, b) for p, h, b in self.requests if p == path]
            if len(got) >= count or time.monotonic() > deadline:
                return got
            time.sleep(0.05)


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    r.thread.start()
    yield r
    r.server.shutdown()
    r.server.server_close()


# -- servers ---------------------------------------------------------------------------------------------------
def _env(data: Path, db_url: str, **extra: str) -> dict[str, str]:
    return base_env(
        data,
        TIERLINE_DATABASE_URL=db_url,
        TIERLINE_CLOUD_ZOO_PRESET="tiny",
        TIERLINE_CLOUD_KV_CACHE_MB="16",
        TIERLINE_CLOUD_USAGE_FLUSH_MS="50",
        TIERLINE_CLOUD_JOB_POLL_S="0.2",
        **extra,
    )


def _tenant_keys(db_url: str, *names: str) -> list[str]:
    """A tenant and an API key for each name."""
    engine = create_db(db_url)
    with Session(engine) as s:
        keys = [create_api_key(s, create_tenant(s, name)).secret for name in names]
        s.commit()
    engine.dispose()
    return keys


@contextmanager
def cloud_process(env: dict[str, str], port: int) -> Iterator[subprocess.Popen[bytes]]:
    """``tierline cloud serve`` until ready; SIGTERM at the end unless the test stopped it already."""
    with server_process(["cloud", "serve"], env, port, ready_path="/readyz", timeout=120, stop_timeout=60) as proc:
        yield proc


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory, tiny_zoo: Path, session_data_dir: Path) -> Iterator[dict[str, str]]:
    data = seed_data_dir(tmp_path_factory.mktemp("jobs"), tiny_zoo, session_data_dir)
    db_url = migrated_sqlite(data)
    env = _env(
        data,
        db_url,
        TIERLINE_CLOUD_WEBHOOK_BASE_DELAY_S="0.2",
        TIERLINE_CLOUD_WEBHOOK_TIMEOUT_S="5",
        TIERLINE_CLOUD_WEBHOOK_ALLOW_PRIVATE_NETWORKS="true",
    )
    key, other = _tenant_keys(db_url, "acme", "globex")
    port = free_port()
    with cloud_process(env, port):
        yield {"url": f"http://127.0.0.1:{port}", "key": key, "other_key": other, "db": db_url}


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def wait_for_job(url: str, key: str, job_id: str, timeout: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        job = httpx.get(f"{url}/v1/jobs/{job_id}", headers=_auth(key)).json()
        if job["status"] in ("succeeded", "failed") or time.monotonic() > deadline:
            return dict(job)
        time.sleep(0.1)


def usage_rows(db_url: str, ids: list[str]) -> list[UsageRecord]:
    engine = create_engine(db_url)
    with Session(engine) as s:
        rows = list(s.exec(select(UsageRecord).where(col(UsageRecord.id).in_(ids))))
    engine.dispose()
    return rows


# -- the API ---------------------------------------------------------------------------------------------------
def test_an_async_chat_is_accepted_then_polled_to_the_answer_a_sync_call_gives(cloud: dict[str, str]) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "def add(a, b):"}], "max_tokens": 8}
    body["temperature"] = 0
    accepted = httpx.post(
        f"{cloud['url']}/v1/chat/completions", json={**body, "async": True}, headers=_auth(cloud["key"])
    )
    assert accepted.status_code == 202
    job = accepted.json()
    assert job["object"] == "job" and job["id"].startswith("job_") and job["status"] in ("queued", "running")
    assert accepted.headers["location"] == f"/v1/jobs/{job['id']}"

    done = wait_for_job(cloud["url"], cloud["key"], job["id"])
    assert done["status"] == "succeeded" and done["error"] is None
    assert done["created_at"] <= done["started_at"] <= done["finished_at"]
    sync = httpx.post(f"{cloud['url']}/v1/chat/completions", json=body, headers=_auth(cloud["key"])).json()
    result = ChatCompletion.model_validate(done["result"])  # the OpenAI SDK's own type parses it
    assert result.id == f"chatcmpl-{job['id']}" and set(done["result"]) == set(sync)
    assert result.choices[0].message.content == sync["choices"][0]["message"]["content"]
    for field in ("prompt_tokens", "completion_tokens"):  # cached tokens differ: the job warmed the prefix cache
        assert done["result"]["usage"][field] == sync["usage"][field]
    (row,) = usage_rows(cloud["db"], [job["id"]])
    assert (row.prompt_tokens, row.completion_tokens) == (
        sync["usage"]["prompt_tokens"],
        sync["usage"]["completion_tokens"],
    )

    listed = httpx.get(f"{cloud['url']}/v1/jobs", params={"limit": 5}, headers=_auth(cloud["key"])).json()
    assert listed["data"][0] == done


def test_prefer_respond_async_queues_completions_and_inference(cloud: dict[str, str]) -> None:
    headers = {**_auth(cloud["key"]), "Prefer": "respond-async, wait=0"}
    completion = httpx.post(
        f"{cloud['url']}/v1/completions", json={"model": MODEL, "prompt": "x = ", "max_tokens": 4}, headers=headers
    )
    assert completion.status_code == 202 and completion.headers["preference-applied"] == "respond-async"
    inference = httpx.post(
        f"{cloud['url']}/v1/inference",
        json={"model_id": MODEL, "inputs": ["import os\n"], "parameters": {"max_tokens": 3}},
        headers=headers,
    )
    assert inference.status_code == 202
    text = wait_for_job(cloud["url"], cloud["key"], completion.json()["id"])["result"]
    assert text["object"] == "text_completion" and text["usage"]["completion_tokens"] <= 4
    infer = wait_for_job(cloud["url"], cloud["key"], inference.json()["id"])["result"]
    assert infer["model_id"] == MODEL and len(infer["outputs"]) == 1 and infer["usage"]["completion_tokens"] <= 3


def test_a_job_that_fails_carries_an_openai_error(cloud: dict[str, str]) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 100_000, "async": True}
    job = httpx.post(f"{cloud['url']}/v1/completions", json=body, headers=_auth(cloud["key"])).json()
    failed = wait_for_job(cloud["url"], cloud["key"], job["id"])
    assert failed["status"] == "failed" and failed["result"] is None
    assert failed["error"]["code"] == "context_length_exceeded" and failed["error"]["type"] == "invalid_request_error"


def test_the_webhook_is_signed_with_the_tenants_secret(cloud: dict[str, str], receiver: Receiver) -> None:
    created = httpx.post(f"{cloud['url']}/v1/webhook-secret", headers=_auth(cloud["key"]))
    assert created.status_code == 201
    secret = created.json()["secret"]
    body = {"model": MODEL, "prompt": "def f():", "max_tokens": 4, "async": True, "webhook_url": f"{receiver.url}/ok"}
    job = httpx.post(f"{cloud['url']}/v1/completions", json=body, headers=_auth(cloud["key"])).json()
    assert job["webhook_url"] == f"{receiver.url}/ok"

    ((headers, raw),) = receiver.received("/ok", 1)
    expected = "sha256=" + hmac.new(secret.encode(), raw, hashlib.sha256).hexdigest()
    assert hmac.compare_digest(headers["x-tierline-signature"], expected)
    assert headers["x-tierline-delivery"].startswith("whd_") and headers["content-type"] == "application/json"
    assert abs(int(headers["x-tierline-timestamp"]) - time.time()) < 120
    assert json.loads(raw) == wait_for_job(cloud["url"], cloud["key"], job["id"])
    assert json.loads(raw)["status"] == "succeeded"

    deliveries = httpx.get(f"{cloud['url']}/v1/jobs/{job['id']}/deliveries", headers=_auth(cloud["key"])).json()
    assert deliveries["delivery"]["status"] == "delivered"
    assert [(a["attempt"], a["status_code"]) for a in deliveries["data"]] == [(1, 204)]
    # A rotated secret signs from then on; the old one no longer verifies.
    rotated = httpx.post(f"{cloud['url']}/v1/webhook-secret", headers=_auth(cloud["key"])).json()["secret"]
    body["webhook_url"] = f"{receiver.url}/rotated"
    httpx.post(f"{cloud['url']}/v1/completions", json=body, headers=_auth(cloud["key"]))
    ((headers, raw),) = receiver.received("/rotated", 1)
    assert is_valid_signature(rotated, raw, headers["x-tierline-signature"])
    assert not is_valid_signature(secret, raw, headers["x-tierline-signature"])


def test_a_failing_receiver_is_retried_under_one_delivery_id(cloud: dict[str, str], receiver: Receiver) -> None:
    httpx.post(f"{cloud['url']}/v1/webhook-secret", headers=_auth(cloud["key"]))
    receiver.fail_first["/flaky"] = 2
    body = {"model": MODEL, "prompt": "y", "max_tokens": 2, "async": True, "webhook_url": f"{receiver.url}/flaky"}
    job = httpx.post(f"{cloud['url']}/v1/completions", json=body, headers=_auth(cloud["key"])).json()

    got = receiver.received("/flaky", 3)
    assert len(got) == 3
    assert len({h["x-tierline-delivery"] for h, _ in got}) == 1
    assert len({raw for _, raw in got}) == 1  # the same body (and signature) every time
    deadline = time.monotonic() + 10
    while True:
        deliveries = httpx.get(f"{cloud['url']}/v1/jobs/{job['id']}/deliveries", headers=_auth(cloud["key"])).json()
        if deliveries["delivery"]["status"] != "pending" or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert deliveries["delivery"]["status"] == "delivered" and deliveries["delivery"]["attempts"] == 3
    attempts = deliveries["data"]
    assert [(a["attempt"], a["status_code"]) for a in attempts] == [(1, 500), (2, 500), (3, 204)]
    assert {a["delivery_id"] for a in attempts} == {got[0][0]["x-tierline-delivery"]}
    assert attempts[0]["at"] < attempts[1]["at"] < attempts[2]["at"]


def test_another_tenant_cannot_see_the_job_or_its_deliveries(cloud: dict[str, str]) -> None:
    body = {"model": MODEL, "prompt": "z", "max_tokens": 2, "async": True}
    job = httpx.post(f"{cloud['url']}/v1/completions", json=body, headers=_auth(cloud["key"])).json()
    other = _auth(cloud["other_key"])
    for path in (f"/v1/jobs/{job['id']}", f"/v1/jobs/{job['id']}/deliveries"):
        foreign = httpx.get(f"{cloud['url']}{path}", headers=other)
        unknown = httpx.get(f"{cloud['url']}{path.replace(job['id'], 'job_' + '0' * 32)}", headers=other)
        assert foreign.status_code == unknown.status_code == 404
        assert foreign.json()["error"]["code"] == unknown.json()["error"]["code"] == "job_not_found"
    listed = httpx.get(f"{cloud['url']}/v1/jobs", headers=other).json()
    assert job["id"] not in {j["id"] for j in listed["data"]}
    assert httpx.get(f"{cloud['url']}/v1/jobs/{job['id']}").status_code == 401


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/chat/completions", {"stream": True}, "stream"),
        ("/v1/completions", {"stream": True}, "stream"),
        ("/v1/completions", {"webhook_url": "ftp://example.com/hook"}, "webhook_url"),
        ("/v1/completions", {"webhook_url": "not a url"}, "webhook_url"),
        ("/v1/completions", {"webhook_url": "https://user:pw@example.com/hook"}, "webhook_url"),
        ("/v1/completions", {"webhook_url": 42}, "webhook_url"),
        ("/v1/completions", {"webhook_url": "http://2130706433/hook"}, "webhook_url"),
        ("/v1/completions", {"webhook_url": "http://0177.0.0.1/hook"}, "webhook_url"),
        ("/v1/completions", {"webhook_url": "http://0/hook"}, "webhook_url"),
        ("/v1/completions", {"async": "yes"}, "async"),
        ("/v1/completions", {"model": "no/such-model"}, "model"),
        ("/v1/inference", {"model_id": "no/such-model"}, "model_id"),
    ],
)
def test_bad_async_requests_are_refused_naming_the_field(
    cloud: dict[str, str], path: str, extra: dict[str, Any], param: str
) -> None:
    base: dict[str, Any] = {"model": MODEL, "max_tokens": 2, "async": True}
    if path == "/v1/chat/completions":
        base["messages"] = [{"role": "user", "content": "hi"}]
    elif path == "/v1/completions":
        base["prompt"] = "hi"
    else:
        base = {"model_id": MODEL, "inputs": ["hi"], "async": True}
    r = httpx.post(f"{cloud['url']}{path}", json={**base, **extra}, headers=_auth(cloud["key"]))
    assert 400 <= r.status_code < 500 and r.json()["error"]["param"] == param, r.text
    assert r.json()["error"]["message"]


def test_webhooks_need_an_async_request_and_a_secret(cloud: dict[str, str], receiver: Receiver) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "webhook_url": f"{receiver.url}/ok"}
    sync = httpx.post(f"{cloud['url']}/v1/completions", json=body, headers=_auth(cloud["key"]))
    assert sync.status_code == 400 and sync.json()["error"]["param"] == "webhook_url"
    no_secret = httpx.post(
        f"{cloud['url']}/v1/completions", json={**body, "async": True}, headers=_auth(cloud["other_key"])
    )
    assert no_secret.status_code == 400 and "POST /v1/webhook-secret" in no_secret.json()["error"]["message"]
    bad_limit = httpx.get(f"{cloud['url']}/v1/jobs", params={"limit": 0}, headers=_auth(cloud["key"]))
    assert bad_limit.status_code == 400 and bad_limit.json()["error"]["param"] == "limit"


def test_an_idempotency_key_makes_a_retried_submission_the_same_job(cloud: dict[str, str]) -> None:
    headers = {**_auth(cloud["key"]), "Idempotency-Key": "async-retry-1"}
    body = {"model": MODEL, "prompt": "for", "max_tokens": 3, "async": True}
    first = httpx.post(f"{cloud['url']}/v1/completions", json=body, headers=headers)
    again = httpx.post(f"{cloud['url']}/v1/completions", json=body, headers=headers)
    assert first.status_code == again.status_code == 202
    assert again.json()["id"] == first.json()["id"] and again.headers["x-tierline-idempotent-replay"] == "true"
    changed = httpx.post(f"{cloud['url']}/v1/completions", json={**body, "max_tokens": 4}, headers=headers)
    assert changed.status_code == 422 and changed.json()["error"]["param"] == "Idempotency-Key"
    wait_for_job(cloud["url"], cloud["key"], first.json()["id"])
    assert len(usage_rows(cloud["db"], [first.json()["id"]])) == 1


# -- restarts --------------------------------------------------------------------------------------------------
def _statuses(db_url: str, ids: list[str]) -> dict[str, tuple[str, int]]:
    engine = create_engine(db_url)
    with Session(engine) as s:
        rows = {j.id: (j.status, j.attempts) for j in s.exec(select(Job).where(col(Job.id).in_(ids)))}
    engine.dispose()
    return rows


def _wait_until_running(db_url: str, ids: list[str], timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        running = [i for i, (status, _) in _statuses(db_url, ids).items() if status == "running"]
        if running:
            return running[0]
        time.sleep(0.05)
    raise AssertionError(f"no job started: {_statuses(db_url, ids)}")


@pytest.mark.slow
def test_jobs_survive_sigterm_and_a_crash_and_each_is_billed_once(
    tmp_path: Path, tiny_zoo: Path, session_data_dir: Path
) -> None:
    data = seed_data_dir(tmp_path / "data", tiny_zoo, session_data_dir)
    db_url = migrated_sqlite(data)
    env = _env(data, db_url, TIERLINE_CLOUD_JOB_WORKERS="1", TIERLINE_CLOUD_JOB_LEASE_S="1")
    (key,) = _tenant_keys(db_url, "acme")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # Long enough that a job is seen running: at 64 tokens each, all six ran between two polls of the test.
    body = {"model": MODEL, "prompt": "import sys\n", "max_tokens": 224, "ignore_eos": True, "async": True}

    with cloud_process(env, port) as first:
        ids = [httpx.post(f"{url}/v1/completions", json=body, headers=_auth(key)).json()["id"] for _ in range(6)]
        _wait_until_running(db_url, ids)
        first.send_signal(signal.SIGTERM)  # the running job finishes (drain); the queued ones wait
        assert first.wait(timeout=60) in (0, -signal.SIGTERM)
    after_sigterm = _statuses(db_url, ids)
    assert any(status == "queued" for status, _ in after_sigterm.values()), after_sigterm
    assert all(status in ("queued", "succeeded") for status, _ in after_sigterm.values())

    with cloud_process(env, port) as second:
        _wait_until_running(db_url, ids)
        second.kill()  # a crash: the running job's lease lapses and another process takes it again
        second.wait()
    after_crash = _statuses(db_url, ids)
    running = [i for i, (status, _) in after_crash.items() if status == "running"]
    assert len(running) == 1, after_crash  # one worker: the job it was running when killed
    interrupted = running[0]

    with cloud_process(env, port):
        jobs = [wait_for_job(url, key, job_id) for job_id in ids]
    assert [j["status"] for j in jobs] == ["succeeded"] * len(ids)
    assert next(j for j in jobs if j["id"] == interrupted)["attempts"] == 2
    rows = usage_rows(db_url, ids)
    assert sorted(r.id for r in rows) == sorted(ids)  # exactly one usage record per job
    by_id = {r.id: r for r in rows}
    for job in jobs:
        assert by_id[job["id"]].completion_tokens == job["result"]["usage"]["completion_tokens"] == 224


# -- the job store on each database ----------------------------------------------------------------------------
def test_replicas_never_claim_one_job_twice_and_a_lapsed_lease_is_retaken(migrated_db: str) -> None:
    engine = create_db(migrated_db)
    with Session(engine) as s:
        tenant_id = create_tenant(s, "acme").id or 0
        s.commit()
    replicas = [JobStore(create_db(migrated_db)) for _ in range(2)]
    ids = [
        replicas[0].create(Job(id=f"job_{i:02d}", tenant_id=tenant_id, endpoint="/v1/completions", model=MODEL))[0].id
        for i in range(12)
    ]

    def drain(store: JobStore) -> list[str]:
        claimed = []
        while (job := store.claim(lease_s=60)) is not None:
            claimed.append(job.id)
        return claimed

    with ThreadPoolExecutor(4) as pool:
        claims = [c for batch in pool.map(drain, replicas * 2) for c in batch]
    assert sorted(claims) == ids  # every job once, none twice

    # A worker that went silent: its lease lapses, the job is taken again, and the stale attempt cannot finish it.
    with Session(engine) as s:
        job = s.get(Job, ids[0])
        assert job is not None
        job.available_at = utcnow() - timedelta(seconds=1)
        s.add(job)
        s.commit()
    retaken = replicas[1].claim(lease_s=60)
    assert retaken is not None and (retaken.id, retaken.attempts) == (ids[0], 2)
    assert not replicas[0].finish(ids[0], 1, result={"stale": True})
    assert replicas[1].finish(ids[0], 2, result={"ok": True}, delivery_id="whd_1")
    assert replicas[0].get(tenant_id, ids[0]).result == {"ok": True}
    with Session(engine) as s:  # no webhook URL, so no delivery
        assert s.exec(select(WebhookDelivery)).first() is None
    for store in replicas:
        store.engine.dispose()
    engine.dispose()

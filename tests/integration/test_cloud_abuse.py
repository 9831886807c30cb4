"""A real cloud server against what a crash or a client can do to it: an Idempotency-Key claim left behind by a
dead process, a flood of async job submissions, and a prompt of megabytes sent beside health checks."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlmodel import Session, select

from cloud.gateway.idempotency import request_hash
from cloud.gateway.ids import CloudIds
from controlplane.storage.database import create_db
from controlplane.storage.tables import IdempotentResponse, UsageRecord
from controlplane.tenancy.service import create_api_key, create_tenant
from shared.openai_schema import CompletionRequest
from tests.conftest import base_env, free_port, migrated_sqlite, seed_data_dir, server_process

pytestmark = pytest.mark.integration
MODEL = "tierline/lm-cloud"
LEASE_S = 3.0
JOB_RPM = 3
# A prompt of code-like words (the tiny model's tokenizer splits them as it would real text), made once.
WORDS = ["def", "return", "import", "class", "self", "value", "print", "for", "in", "range"]


def _prompt(num_bytes: int) -> str:
    text = " ".join(WORDS[i % len(WORDS)] + str(i % 97) for i in range(num_bytes // 4))
    return text[:num_bytes]


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory, tiny_zoo: Path, session_data_dir: Path) -> Iterator[dict[str, Any]]:
    data = seed_data_dir(tmp_path_factory.mktemp("abuse"), tiny_zoo, session_data_dir)
    db_url = migrated_sqlite(data)
    engine = create_db(db_url)
    with Session(engine) as s:
        tenant = create_tenant(s, "acme")
        key = create_api_key(s, tenant).secret
        jobs_key = create_api_key(s, create_tenant(s, "jobs"))
        jobs_key.record.requests_per_minute = JOB_RPM
        s.add(jobs_key.record)
        s.commit()
        tenant_id = tenant.id
    env = base_env(
        data,
        TIERLINE_DATABASE_URL=db_url,
        TIERLINE_CLOUD_ZOO_PRESET="tiny",
        TIERLINE_CLOUD_KV_CACHE_MB="16",
        TIERLINE_CLOUD_USAGE_FLUSH_MS="50",
        TIERLINE_CLOUD_JOB_POLL_S="0.2",
        TIERLINE_CLOUD_IDEMPOTENCY_LEASE_S=str(LEASE_S),
    )
    port = free_port()
    with server_process(["cloud", "serve"], env, port, ready_path="/readyz", timeout=180, stop_timeout=60):
        yield {
            "url": f"http://127.0.0.1:{port}",
            "key": key,
            "jobs_key": jobs_key.secret,
            "engine": engine,
            "tenant_id": tenant_id,
            "ids": CloudIds.from_keys_dir(data / "keys"),
        }
    engine.dispose()


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# -- an Idempotency-Key claim left by a crashed process ----------------------------------------------------------
def test_a_claim_left_by_a_crashed_process_is_taken_over_after_its_lease(cloud: dict[str, Any]) -> None:
    body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 4}
    key = "crashed-mid-request"
    body_hash = request_hash(CompletionRequest.model_validate(body).model_dump(mode="json", exclude_unset=True))
    with Session(cloud["engine"]) as s:  # the row exactly as a process killed mid-request leaves it
        s.add(IdempotentResponse(tenant_id=cloud["tenant_id"], key=key, request_hash=body_hash))
        s.commit()
    left_at = time.monotonic()
    headers = {**_auth(cloud["key"]), "Idempotency-Key": key}
    url = f"{cloud['url']}/v1/completions"

    early = httpx.post(url, json=body, headers=headers, timeout=30)
    assert early.status_code == 409, early.text
    assert 1 <= int(early.headers["retry-after"]) <= LEASE_S
    assert early.json()["error"]["param"] == "Idempotency-Key"

    time.sleep(max(0.0, LEASE_S + 0.2 - (time.monotonic() - left_at)))
    served = httpx.post(url, json=body, headers=headers, timeout=60)
    assert served.status_code == 200, served.text
    assert served.json()["usage"]["completion_tokens"] > 0 and "x-tierline-idempotent-replay" not in served.headers
    replay = httpx.post(url, json=body, headers=headers, timeout=30)
    assert replay.status_code == 200 and replay.headers["x-tierline-idempotent-replay"] == "true"
    assert replay.json() == served.json()
    deadline = time.monotonic() + 10
    while True:  # billed once, under the key's usage id
        with Session(cloud["engine"]) as s:
            rows = s.exec(
                select(UsageRecord).where(UsageRecord.id == cloud["ids"].usage_id(cloud["tenant_id"], key))
            ).all()
        if rows or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(rows) == 1 and rows[0].completion_tokens == served.json()["usage"]["completion_tokens"]


# -- async job submissions count against requests/min ---------------------------------------------------------------
def test_async_submissions_are_throttled_by_the_keys_request_rate(cloud: dict[str, Any]) -> None:
    if time.time() % 60 > 45:  # all submissions in one rate window
        time.sleep(61 - time.time() % 60)
    url = f"{cloud['url']}/v1/completions"
    body = {"model": MODEL, "prompt": "import os\n", "max_tokens": 4, "async": True}
    accepted = [httpx.post(url, json=body, headers=_auth(cloud["jobs_key"]), timeout=30) for _ in range(JOB_RPM)]
    assert [r.status_code for r in accepted] == [202] * JOB_RPM, [r.text for r in accepted]
    refused = httpx.post(url, json=body, headers=_auth(cloud["jobs_key"]), timeout=30)
    assert refused.status_code == 429, refused.text
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert "request rate limit of 3/min" in refused.json()["error"]["message"]
    sync = httpx.post(url, json={**body, "async": False}, headers=_auth(cloud["jobs_key"]), timeout=30)
    assert sync.status_code == 429  # one counter for both
    # The accepted jobs run: their submission was their request, they are not refused a second time.
    deadline = time.monotonic() + 40
    statuses: list[str] = []
    while time.monotonic() < deadline:
        statuses = [
            httpx.get(f"{cloud['url']}/v1/jobs/{r.json()['id']}", headers=_auth(cloud["jobs_key"])).json()["status"]
            for r in accepted
        ]
        if all(s in ("succeeded", "failed") for s in statuses):
            break
        time.sleep(0.2)
    assert statuses == ["succeeded"] * JOB_RPM


# -- a prompt of megabytes beside health checks -----------------------------------------------------------------------
def _beside_health(url: str, send: Any) -> tuple[httpx.Response, list[float]]:
    """Run ``send()`` while /healthz is polled on its own connection; the health latencies seen meanwhile."""
    latencies: list[float] = []
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=url, timeout=30) as client:
            while not done.is_set():
                start = time.perf_counter()
                assert client.get("/healthz").status_code == 200
                latencies.append(time.perf_counter() - start)
                time.sleep(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.2)
    try:
        response = send()
    finally:
        done.set()
        poller.join()
    return response, latencies


def _refused_beside_health(url: str, send: Any, status: int, code: str, says: str) -> None:
    """``send()`` twice at most beside /healthz polls, each answered ``status`` with error ``code`` whose message has
    ``says``: passes when one attempt sees no health check of 0.1 s or more. Blocking the loop stalls every attempt;
    a shared host can stall one check by itself (0.55 s and 2.07 s seen once each in full runs, beside requests whose
    work takes ~0.2 s), so a second attempt is made before failing."""
    worst: list[list[float]] = []
    for _ in range(2):
        response, latencies = _beside_health(url, send)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["code"] == code and says in error["message"]
        assert len(latencies) >= 5
        if max(latencies) < 0.1:
            return
        worst.append(sorted(latencies)[-3:])
    raise AssertionError(f"health checks stalled in both attempts: {worst}")


def test_a_prompt_above_the_byte_limit_is_refused_and_health_keeps_answering(cloud: dict[str, Any]) -> None:
    big = _prompt(3_500_000)
    body = {"model": MODEL, "messages": [{"role": "user", "content": big}], "max_tokens": 4}
    send = partial(
        httpx.post, f"{cloud['url']}/v1/chat/completions", json=body, headers=_auth(cloud["key"]), timeout=120
    )
    _refused_beside_health(cloud["url"], send, 413, "prompt_too_large", "TIERLINE_CLOUD_MAX_PROMPT_BYTES")


def test_a_large_prompt_is_tokenised_off_the_event_loop(cloud: dict[str, Any]) -> None:
    big = _prompt(1_000_000)  # under the default limit (a quarter of the 4 MiB body): tokenised, real work
    body = {"model": MODEL, "prompt": big, "max_tokens": 4}
    # Tokenised on the loop, every attempt would hold a health check for the whole tokenisation (~0.2 s here).
    send = partial(httpx.post, f"{cloud['url']}/v1/completions", json=body, headers=_auth(cloud["key"]), timeout=120)
    _refused_beside_health(cloud["url"], send, 400, "context_length_exceeded", "maximum context length")

"""Two gateways behave as one: two ``tierline cloud serve`` processes, each with its own data dir (sharing only the
key files replicas share), on one PostgreSQL database, one Redis and one artifact store directory, in front of
one ``tierline engine serve`` model server (an ``openai`` backend). The ``openai`` SDK alternates between them:

- a key's requests-per-minute limit is counted across both (6/min: 6 answered, the rest 429);
- a monthly budget is never overspent with 50 concurrent requests split across both;
- an ``Idempotency-Key`` replayed on the other gateway returns the stored answer, billed once;
- a device enrolls through one, syncs through either, and downloads its artifacts (with Range) from either;
- a job leased by a gateway that is SIGKILLed mid-run is run by the other, and billed once.

Skipped, saying why, without PostgreSQL (TIERLINE_TEST_DATABASE_URL) or Redis (TIERLINE_TEST_REDIS_URL, default
redis://127.0.0.1:6379/0).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

import httpx
import openai
import pytest
from click.testing import CliRunner
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from cloud.edge.releases import publish_command
from cloud.gateway.ids import ID_SECRET_FILE, load_or_create_id_secret
from controlplane.fleet.devices import create_enrollment_token
from controlplane.storage.database import create_db
from controlplane.storage.migrate import upgrade
from controlplane.storage.tables import ApiKey, BudgetPeriod, Job, UsageRecord
from controlplane.tenancy.service import create_api_key, create_tenant, hash_api_key
from shared.artifacts import read_manifest
from tests.conftest import PG_URL, Pacer, _postgres_schema, base_env, free_port, server_process, signal_tree
from tests.forkserver import run_tierline

pytestmark = [pytest.mark.integration, pytest.mark.postgres]

REDIS_URL = os.environ.get("TIERLINE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
MODEL = "remote"


def _redis_answers(url: str) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_timeout=2).ping())
    except redis.RedisError:
        return False


@dataclass
class Pair:
    urls: list[str]
    procs: list[subprocess.Popen[bytes]]
    envs: list[dict[str, str]]
    db: Engine
    db_url: str
    artifacts: Path
    zoo: Path
    upstream: subprocess.Popen[bytes]  # the model server both gateways relay to

    def key(self, tenant: str, *, budget: Decimal | None = None, rpm: int | None = None) -> str:
        """A new tenant and API key (a request-per-minute limit on the key when given)."""
        with Session(self.db) as s:
            t = create_tenant(s, tenant, budget=budget)
            s.flush()
            issued = create_api_key(s, t)
            issued.record.requests_per_minute = rpm
            s.commit()
            secret = issued.secret
        return secret

    def clients(self, key: str) -> list[openai.OpenAI]:
        return [openai.OpenAI(base_url=f"{u}/v1", api_key=key, max_retries=0, timeout=60) for u in self.urls]

    def usage(self, ids: set[str], want: int | None = None) -> list[UsageRecord]:
        """The usage records with these ids, once ``want`` of them (default all) are written."""
        deadline = time.monotonic() + 20
        while True:
            with Session(self.db) as s:
                rows = list(s.exec(select(UsageRecord).where(col(UsageRecord.id).in_(ids))))
            if len(rows) >= (len(ids) if want is None else want) or time.monotonic() > deadline:
                return rows
            time.sleep(0.1)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, tiny_zoo: Path, session_data_dir: Path) -> Iterator[Pair]:
    if not PG_URL:
        pytest.skip("PostgreSQL not configured: set TIERLINE_TEST_DATABASE_URL (two gateways need a shared database)")
    if not _redis_answers(REDIS_URL):
        pytest.skip(f"no Redis at {REDIS_URL}: two gateways share rate limits through it")
    root = tmp_path_factory.mktemp("two-gateways")
    artifacts = root / "shared-artifacts"  # the artifact store both mount (s3:// works alike)
    model_dir = tiny_zoo / "artifacts" / "lm-cloud"
    upstream_port = free_port()
    backends = root / "backends.json"
    spec = {"type": "openai", "upstream_model": "lm-cloud", "tokenizer": str(model_dir)}
    backends.write_text(json.dumps({"models": {MODEL: {**spec, "endpoints": [f"http://127.0.0.1:{upstream_port}"]}}}))
    with _postgres_schema() as db_url, ExitStack() as stack:
        upgrade(db_url)
        keys = root / "keys"  # the key files replicas share: the signing key, and the secret of idempotent ids
        shutil.copytree(session_data_dir / "keys", keys)
        load_or_create_id_secret(keys / ID_SECRET_FILE)
        envs = []
        for name in ("a", "b"):
            data = root / name
            data.mkdir()
            shutil.copytree(keys, data / "keys")
            envs.append(
                base_env(
                    data,
                    TIERLINE_DATABASE_URL=db_url,
                    TIERLINE_REDIS_URL=REDIS_URL,
                    TIERLINE_ARTIFACT_STORE=str(artifacts),
                    TIERLINE_CLOUD_ZOO_PRESET="none",
                    TIERLINE_CLOUD_BACKENDS=str(backends),
                    TIERLINE_CLOUD_USAGE_FLUSH_MS="50",
                    TIERLINE_CLOUD_JOB_LEASE_S="3",  # the poll is the default's: a lapsed lease wakes the survivor
                )
            )
        # The price book is read at start-up (and every 30 s): priced before the gateways start.
        price = ["billing", "prices", "set", "--model", MODEL, "--prompt", "1000", "--completion", "2000"]
        run_tierline(*price, env=envs[0], check=True)
        upstream = stack.enter_context(
            server_process(
                ["engine", "serve", "--model", str(model_dir), "--name", "lm-cloud"],
                envs[0],
                upstream_port,
                ready_path="/health",
                timeout=120,
            )
        )
        ports = [free_port(), free_port()]
        procs = [
            stack.enter_context(server_process(["cloud", "serve"], env, port, ready_path="/readyz", timeout=120))
            for env, port in zip(envs, ports, strict=True)
        ]
        db = create_db(db_url)
        stack.callback(db.dispose)
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        yield Pair(urls, procs, envs, db, db_url, artifacts, tiny_zoo, upstream)


def _clear_limits(pair: Pair, key: str) -> None:
    """Forget Redis counters an earlier test left for the same key and tenant ids (ids restart per schema)."""
    import redis

    with Session(pair.db) as s:
        row = s.exec(select(ApiKey).where(ApiKey.key_hash == hash_api_key(key))).one()
        scopes = (f"key/{row.id}", f"tenant/{row.tenant_id}")
    client = redis.Redis.from_url(REDIS_URL)
    for scope in scopes:
        for found in client.scan_iter(match=f"*tierline/*/{scope}*"):
            client.delete(found)
    client.close()


def test_a_keys_request_rate_is_counted_across_both_gateways(pair: Pair) -> None:
    key = pair.key("paced", rpm=6)
    _clear_limits(pair, key)
    if 60 - time.time() % 60 < 10:  # a fixed one-minute window: start all requests inside one
        time.sleep(60 - time.time() % 60 + 0.5)
    clients = pair.clients(key)
    answered, limited = 0, 0
    for i in range(10):
        try:
            clients[i % 2].chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1
            )
            answered += 1
        except openai.RateLimitError as exc:
            assert "request rate limit of 6/min" in str(exc)
            limited += 1
    assert (answered, limited) == (6, 4)


def test_fifty_concurrent_requests_on_both_gateways_never_overspend_the_budget(pair: Pair) -> None:
    budget = Decimal("0.25")
    key = pair.key("thrifty", budget=budget)
    body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 8, "ignore_eos": True}

    async def fire() -> list[httpx.Response]:
        clients = [
            httpx.AsyncClient(base_url=u, headers={"Authorization": f"Bearer {key}"}, timeout=60) for u in pair.urls
        ]
        try:
            return list(await asyncio.gather(*(clients[i % 2].post("/v1/completions", json=body) for i in range(50))))
        finally:
            for c in clients:
                await c.aclose()

    responses = asyncio.run(fire())
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    assert ok and refused, [r.status_code for r in responses]
    for r in refused:
        assert r.status_code == 429 and r.json()["error"]["type"] == "insufficient_quota", r.text
    rows = pair.usage({r.headers["x-tierline-usage-id"] for r in ok})
    assert len(rows) == len(ok)
    with Session(pair.db) as s:
        tenant_id = rows[0].tenant_id
        period = s.exec(select(BudgetPeriod).where(BudgetPeriod.tenant_id == tenant_id)).one()
    total = sum((u.cost or Decimal(0) for u in rows), Decimal(0))
    assert period.reserved == 0 and period.spent == total <= budget


def test_an_idempotency_key_replayed_on_the_other_gateway_returns_the_stored_answer(pair: Pair) -> None:
    key = pair.key("retrying")
    a, b = pair.clients(key)
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": "count: 1 2 3"}], "max_tokens": 6}
    headers = {"Idempotency-Key": "order-42"}
    first = a.chat.completions.with_raw_response.create(**kwargs, extra_headers=headers)  # type: ignore[call-overload]
    replay = b.chat.completions.with_raw_response.create(**kwargs, extra_headers=headers)  # type: ignore[call-overload]
    assert replay.headers.get("x-tierline-idempotent-replay") == "true"
    assert first.headers.get("x-tierline-idempotent-replay") is None
    assert replay.parse().model_dump() == first.parse().model_dump()
    usage_id = first.headers["x-tierline-usage-id"]
    assert replay.headers["x-tierline-usage-id"] == usage_id
    assert len(pair.usage({usage_id})) == 1
    with pytest.raises(openai.UnprocessableEntityError):  # the key names that request, on either gateway
        b.chat.completions.create(**{**kwargs, "max_tokens": 7}, extra_headers=headers)  # type: ignore[call-overload]


def test_a_device_syncs_through_either_gateway_and_downloads_from_either(pair: Pair) -> None:
    with Session(pair.db) as s:
        tenant = create_tenant(s, "fleet")
        s.flush()
        token = create_enrollment_token(s, tenant).secret
        s.commit()
    enrolled = httpx.post(f"{pair.urls[0]}/v1/edge/enroll", json={"token": token, "name": "two-gw-1"})
    assert enrolled.status_code == 200, enrolled.text
    auth = {"Authorization": f"Bearer {enrolled.json()['device_token']}"}
    artifact = pair.zoo / "artifacts" / "digits-small"
    published = CliRunner().invoke(publish_command, [str(artifact), "--as-version", "gw1"], env=pair.envs[1])
    assert published.exit_code == 0, published.output
    manifest = read_manifest(pair.zoo / "manifests" / "digits-small.json")
    blob = (artifact / "model.onnx").read_bytes()

    for url in pair.urls:
        synced = httpx.post(f"{url}/v1/edge/sync", json={}, headers=auth)
        assert synced.status_code == 200, synced.text
        (desired,) = [d for d in synced.json()["desired"] if d["name"] == "digits-small"]
        assert desired["version"] == "gw1"
        got = httpx.get(f"{url}{desired['manifest_url']}", headers=auth)
        assert got.status_code == 200 and json.loads(got.content)["files"] == json.loads(manifest.to_json())["files"]
        base = f"{url}/v1/edge/artifacts/digits-small/gw1"
        whole = httpx.get(f"{base}/model.onnx", headers=auth)
        assert (whole.status_code, whole.content) == (200, blob)
        part = httpx.get(f"{base}/model.onnx", headers={**auth, "Range": "bytes=100-"})
        assert (part.status_code, part.content) == (206, blob[100:])
    for env in pair.envs:  # nothing of it is on either gateway's own disk
        assert not (Path(env["TIERLINE_DATA_DIR"]) / "edge-releases").exists()
        assert not (Path(env["TIERLINE_DATA_DIR"]) / "artifacts").exists()


def _outstanding(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("tierline_backend_outstanding_requests{")
    )


def test_a_job_leased_by_a_killed_gateway_is_run_by_the_other(pair: Pair) -> None:
    key = pair.key("batch")
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "write a long story"}],
        "max_tokens": 200,
        "ignore_eos": True,
        "async": True,
    }
    # The model server paced (``Pacer``) until the job's gateway is killed: unpaced, the tiny LM can make the 200
    # tokens between two looks at the gateways' metrics, and the job would end before it is cut off.
    with Pacer(signal_tree(pair.upstream)):
        submitted = httpx.post(
            f"{pair.urls[0]}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        )
        assert submitted.status_code == 202, submitted.text
        job_id = submitted.json()["id"]
        deadline = time.monotonic() + 30
        runner: int | None = None
        while runner is None:  # whichever gateway took the job has a request in flight to the model server
            assert time.monotonic() < deadline, "no gateway started the job"
            for i, url in enumerate(pair.urls):
                if _outstanding(url) > 0:
                    runner = i
            time.sleep(0.02)
        pair.procs[runner].send_signal(signal.SIGKILL)
        pair.procs[runner].wait()
    with Session(pair.db) as s:
        job = s.get(Job, job_id)
        assert job is not None and job.status == "running" and job.attempts == 1  # cut off mid-run
    survivor = pair.urls[1 - runner]
    deadline = time.monotonic() + 60
    while True:
        got = httpx.get(f"{survivor}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {key}"}).json()
        if got["status"] in ("succeeded", "failed") or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert got["status"] == "succeeded", got
    assert got["attempts"] == 2  # taken again after the dead gateway's lease lapsed
    assert got["result"]["usage"]["completion_tokens"] == 200
    assert len(pair.usage({job_id})) == 1  # billed once

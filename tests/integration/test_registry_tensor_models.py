"""Registry tensor models on the cloud: an ONNX model pushed with ``tierline models push`` while a real
``tierline cloud serve`` runs is served by ``/v1/inference`` without a restart, batched, metered per row through
the ledger (direct, async job and edge escalation), limited and budgeted like an LLM call, and unloaded
least-recently-used when the tensor memory budget needs room. SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from controlplane.fleet.devices import create_enrollment_token
from controlplane.storage.database import create_db
from controlplane.storage.tables import ApiKey, UsageRecord
from controlplane.tenancy.service import create_api_key, create_tenant
from tests.conftest import base_env, free_port, run_server, seed_data_dir
from tests.forkserver import run_tierline

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
NUM_IN, NUM_OUT = 300, 1000  # 1.2 MB of float32 weights: two such models do not fit a 2 MB budget
PER_CALL, PER_ROW = Decimal("0.01"), Decimal("0.001")


def make_onnx(path: Path, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A linear layer ``y = x W + b`` with a dynamic batch dimension, written as ONNX; its weights."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    w = rng.standard_normal((NUM_IN, NUM_OUT)).astype(np.float32)
    b = rng.standard_normal(NUM_OUT).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w", "b"], ["y"])],
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", NUM_IN])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", NUM_OUT])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return w, b


@dataclass
class Cloud:
    url: str
    http: httpx.Client
    db: Engine
    env: dict[str, str]
    key: str
    limited_key: str
    broke_key: str
    device_token: str
    models: Path

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        done = run_tierline(*args, env=self.env, timeout=120)
        assert done.returncode == 0, done.stderr
        return done

    def infer(self, model: str, rows: np.ndarray, key: str | None = None, **headers: str) -> httpx.Response:
        auth = {"Authorization": f"Bearer {key or self.key}", **headers}
        return self.http.post("/v1/inference", json={"model_id": model, "inputs": rows.tolist()}, headers=auth)

    def metrics(self) -> dict[str, float]:
        text = self.http.get("/metrics").text
        out = {}
        for line in text.splitlines():
            m = re.match(r"^(tierline_tensor_\w+)(\{[^}]*\})? (\S+)$", line)
            if m:
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
        return out

    def metric(self, name: str, model: str, version: int) -> float:
        return self.metrics().get(f'{name}{{model="{model}",version="{version}"}}', 0.0)

    def usage(self, ids: list[str], timeout: float = 15.0) -> dict[str, UsageRecord]:
        deadline = time.monotonic() + timeout
        while True:
            with Session(self.db) as s:
                rows = {r.id: r for r in s.exec(select(UsageRecord).where(col(UsageRecord.id).in_(ids)))}
            if len(rows) >= len(ids) or time.monotonic() > deadline:
                return rows
            time.sleep(0.1)

    def until(self, check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            assert time.monotonic() < deadline, f"never happened: {what}"
            time.sleep(0.2)


@pytest.fixture
def cloud(migrated_db: str, tmp_path: Path, tiny_zoo: Path, session_data_dir: Path) -> Iterator[Cloud]:
    data = seed_data_dir(tmp_path / "data", tiny_zoo, session_data_dir)
    db = create_db(migrated_db)
    with Session(db) as s:
        acme = create_tenant(s, "acme")
        key = create_api_key(s, acme).secret
        limited = create_api_key(s, acme, name="two-a-minute")
        broke = create_tenant(s, "broke", budget=Decimal("0.005"))  # below one call's per-call fee
        broke_key = create_api_key(s, broke).secret
        enrollment = create_enrollment_token(s, acme).secret
        s.commit()
        row = s.get(ApiKey, limited.record.id)
        assert row is not None
        row.requests_per_minute = 2
        s.add(row)
        s.commit()
    env = base_env(
        data,
        TIERLINE_DATABASE_URL=migrated_db,
        TIERLINE_CLOUD_ZOO_PRESET="tiny",
        TIERLINE_CLOUD_KV_CACHE_MB="8",
        TIERLINE_CLOUD_SPECULATION="off",
        TIERLINE_CLOUD_USAGE_FLUSH_MS="50",
        TIERLINE_CLOUD_CANARY_REFRESH_S="0.3",
        TIERLINE_CLOUD_JOB_POLL_S="0.2",
        TIERLINE_CLOUD_REGISTRY_MODELS="all",
        TIERLINE_CLOUD_TENSOR_MEMORY_MB="2",
        TIERLINE_CLOUD_TENSOR_MAX_QUEUE_DELAY_MS="100",  # wide, so concurrent calls batch on a loaded host
    )
    models = tmp_path / "models"
    models.mkdir()
    priced = run_tierline("billing", "prices", "set", "--model", "scorer", "--prompt", "0", "--completion", "0",
                     "--per-call", str(PER_CALL), "--per-row", str(PER_ROW), env=env, timeout=120)  # fmt: skip
    assert priced.returncode == 0, priced.stderr  # before the server starts: its price book is read at start
    with (
        run_server(["cloud", "serve"], env, free_port(), timeout=120) as url,
        httpx.Client(base_url=url, timeout=60) as http,
    ):
        device = http.post("/v1/edge/enroll", json={"token": enrollment, "name": "t-1"}).json()
        yield Cloud(url, http, db, env, key, limited.secret, broke_key, device["device_token"], models)
    db.dispose()


def _expect(rows: np.ndarray, w: np.ndarray, b: np.ndarray, resp: httpx.Response) -> None:
    assert resp.status_code == 200, resp.text
    np.testing.assert_allclose(np.asarray(resp.json()["outputs"]), rows @ w + b, rtol=1e-4, atol=1e-3)


def test_a_pushed_onnx_model_is_served_batched_billed_and_unloaded_for_room(cloud: Cloud) -> None:
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((2, NUM_IN)).astype(np.float32)
    assert cloud.infer("scorer", rows).status_code == 404  # not pushed yet

    # Pushed while the server runs: served by name once the registry refresh sees it (no restart).
    w1, b1 = make_onnx(cloud.models / "scorer-1.onnx", seed=1)
    cloud.cli("models", "push", str(cloud.models / "scorer-1.onnx"), "--name", "scorer", "--alias", "stable")
    cloud.until(lambda: cloud.infer("scorer", rows).status_code == 200, "scorer served")
    listed = cloud.http.get("/v1/models", headers={"Authorization": f"Bearer {cloud.key}"}).json()["data"]
    assert "scorer" in {m["id"] for m in listed}
    first = cloud.infer("scorer", rows)
    _expect(rows, w1, b1, first)
    assert first.headers["x-tierline-model-version"] == "1" and first.json()["usage"] == {"rows": 2}

    # Concurrent calls share batches (the batcher's own counts, on /metrics).
    batches_before = cloud.metric("tierline_tensor_batches_total", "scorer", 1)

    async def together() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=cloud.url, timeout=60) as c:
            auth = {"Authorization": f"Bearer {cloud.key}"}
            body = {"model_id": "scorer", "inputs": rows.tolist()}
            return list(await asyncio.gather(*(c.post("/v1/inference", json=body, headers=auth) for _ in range(16))))

    answers = asyncio.run(together())
    for resp in answers:
        _expect(rows, w1, b1, resp)
    batches = cloud.metric("tierline_tensor_batches_total", "scorer", 1) - batches_before
    assert 1 <= batches < 16, batches  # 16 calls ran in fewer batches
    assert cloud.metric("tierline_tensor_max_batch_rows", "scorer", 1) >= 4  # at least two calls' rows in one

    # One usage record per call, with its rows and the per-call + per-row cost, each exactly once.
    ids = [first.headers["x-tierline-usage-id"], *(r.headers["x-tierline-usage-id"] for r in answers)]
    assert len(set(ids)) == 17
    records = cloud.usage(ids)
    assert len(records) == 17
    for rec in records.values():
        assert (rec.model, rec.model_version, rec.tier, rec.rows, rec.status) == ("scorer", 1, "cloud", 2, "ok")
        assert rec.cost == PER_CALL + 2 * PER_ROW and rec.price_id is not None

    # Idempotency-Key: the retry replays the stored answer, unbilled.
    once = cloud.infer("scorer", rows, **{"Idempotency-Key": "retry-me"})
    again = cloud.infer("scorer", rows, **{"Idempotency-Key": "retry-me"})
    assert once.status_code == again.status_code == 200 and again.headers["x-tierline-idempotent-replay"] == "true"
    assert once.json() == again.json()
    assert len(cloud.usage([once.headers["x-tierline-usage-id"]])) == 1

    # An async job is billed once under the job's id.
    accepted = cloud.http.post(
        "/v1/inference",
        json={"model_id": "scorer", "inputs": rows[:1].tolist(), "async": True},
        headers={"Authorization": f"Bearer {cloud.key}"},
    )
    assert accepted.status_code == 202, accepted.text
    job_id = accepted.json()["id"]

    def job() -> dict[str, Any]:
        return dict(cloud.http.get(f"/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {cloud.key}"}).json())

    cloud.until(lambda: job()["status"] in ("succeeded", "failed"), "the job finished")
    assert job()["status"] == "succeeded" and job()["result"]["usage"] == {"rows": 1}
    job_record = cloud.usage([job_id])[job_id]
    assert job_record.rows == 1 and job_record.cost == PER_CALL + PER_ROW

    # An edge escalation is billed to the device's tenant, with the device named.
    escalated = cloud.http.post(
        "/v1/edge/escalate",
        json={
            "endpoint": "inference",
            "reason": "low-confidence",
            "body": {"model_id": "scorer", "inputs": rows.tolist()},
        },
        headers={"Authorization": f"Bearer {cloud.device_token}"},
    )
    _expect(rows, w1, b1, escalated)
    edge_id = escalated.headers["x-tierline-usage-id"]
    edge_record = cloud.usage([edge_id])[edge_id]
    assert edge_record.rows == 2 and edge_record.device_id is not None
    assert edge_record.escalation_reason == "low-confidence" and edge_record.cost == PER_CALL + 2 * PER_ROW

    # Over budget: refused 429 before any model work (no batch ran, nothing billed); over its rpm: 429.
    batches_before = cloud.metric("tierline_tensor_batches_total", "scorer", 1)
    refused = cloud.infer("scorer", rows, key=cloud.broke_key)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "insufficient_quota", refused.text
    assert cloud.metric("tierline_tensor_batches_total", "scorer", 1) == batches_before
    with Session(cloud.db) as s:
        others = select(UsageRecord).where(col(UsageRecord.tenant_id) != job_record.tenant_id)
        assert s.exec(others).first() is None  # the broke tenant was billed nothing
    # Two a minute: five calls see a 429 even if a minute boundary falls between them.
    limited = [cloud.infer("scorer", rows, key=cloud.limited_key).status_code for _ in range(5)]
    assert limited[:2] == [200, 200] and 429 in limited and limited.count(200) <= 4, limited

    # A second model does not fit beside the first in 2 MB: the first (idle) is unloaded, and reloaded on use.
    w2, b2 = make_onnx(cloud.models / "ranker-1.onnx", seed=2)
    cloud.cli("models", "push", str(cloud.models / "ranker-1.onnx"), "--name", "ranker", "--alias", "stable")
    cloud.until(lambda: cloud.infer("ranker", rows).status_code == 200, "ranker served")
    _expect(rows, w2, b2, cloud.infer("ranker", rows))
    assert cloud.metric("tierline_tensor_model_unloads_total", "scorer", 1) == 1
    assert cloud.metric("tierline_tensor_model_loaded", "scorer", 1) == 0
    assert cloud.metric("tierline_tensor_model_loaded", "ranker", 1) == 1
    _expect(rows, w1, b1, cloud.infer("scorer", rows))
    assert cloud.metric("tierline_tensor_model_loads_total", "scorer", 1) == 2
    assert cloud.metric("tierline_tensor_model_unloads_total", "ranker", 1) == 1
    assert cloud.metrics()["tierline_tensor_memory_bytes"] <= 2 << 20

    # A new version moved to stable serves the bare name without a restart; NAME@1 still pins the old one.
    w3, b3 = make_onnx(cloud.models / "scorer-2.onnx", seed=3)
    cloud.cli("models", "push", str(cloud.models / "scorer-2.onnx"), "--name", "scorer", "--alias", "stable")
    cloud.until(lambda: cloud.infer("scorer", rows).headers.get("x-tierline-model-version") == "2", "v2 served")
    _expect(rows, w3, b3, cloud.infer("scorer", rows))
    _expect(rows, w1, b1, cloud.infer("scorer@1", rows))


def test_every_load_checks_the_signature_and_the_bytes(tmp_path: Path) -> None:
    """In process, no server: a version is loaded only when its manifest is signed by a trusted key and every
    byte matches it, checked again on each load (a damaged cached copy is fetched anew)."""
    import json

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from cloud.serving.tensor_models import TensorPool, TensorVersion
    from controlplane.registry.store import LocalArtifactStore
    from shared.artifacts import build_manifest, sign_manifest
    from shared.errors import ServiceUnavailableError

    src = tmp_path / "src"
    src.mkdir()
    w, b = make_onnx(src / "model.onnx", seed=5)
    store = LocalArtifactStore(tmp_path / "store")
    blob = store.put_file(src / "model.onnx")
    trusted, stranger = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()

    def version(number: int, key: Ed25519PrivateKey) -> TensorVersion:
        manifest = build_manifest(src, name="m", version=str(number), kind="tensor", format="onnx")
        sign_manifest(manifest, key)
        return TensorVersion(number, "active", manifest.sha256, json.loads(manifest.to_json()), blob.size)

    pool = TensorPool({}, cache_dir=tmp_path / "cache", store=store, trusted_keys=[trusted.public_key()])
    rows = np.ones((3, NUM_IN), dtype=np.float32)

    async def load(v: TensorVersion) -> np.ndarray:
        served = await pool.acquire("m", v)
        try:
            return np.asarray((await pool._infer(served, rows))["outputs"])
        finally:
            pool.release(served)
            await pool.unload(("m", v.number, v.sha256), "test")

    async def refused(v: TensorVersion) -> str:
        with pytest.raises(ServiceUnavailableError) as caught:
            await pool.acquire("m", v)
        return caught.value.message

    async def scenario() -> None:
        await pool.start()
        good = version(1, trusted)
        np.testing.assert_allclose(await load(good), rows @ w + b, rtol=1e-4, atol=1e-3)
        assert "untrusted key" in await refused(version(2, stranger))
        cached = next((tmp_path / "cache" / "m").glob("1-*")) / "model.onnx"
        cached.write_bytes(cached.read_bytes()[:-1] + b"\x00")  # the cached copy is damaged: fetched anew
        np.testing.assert_allclose(await load(good), rows @ w + b, rtol=1e-4, atol=1e-3)
        path = store.path(blob.sha256)
        path.write_bytes(path.read_bytes()[:-1] + b"\x01")  # the store's bytes are damaged: refused
        for cached_dir in (tmp_path / "cache" / "m").glob("1-*"):
            (cached_dir / "model.onnx").write_bytes(b"x")
        assert "corrupt" in await refused(good)
        await pool.close()

    asyncio.run(scenario())


def test_a_version_with_a_call_in_flight_is_never_unloaded(tmp_path: Path) -> None:
    """In process: with room for one model, a second one waits its turn (503) while the first has a call in
    flight, and unloads it once idle."""
    import json

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from cloud.serving.tensor_models import TensorPool, TensorVersion
    from controlplane.registry.store import LocalArtifactStore
    from shared.artifacts import build_manifest, sign_manifest
    from shared.errors import ServiceUnavailableError

    key = Ed25519PrivateKey.generate()
    store = LocalArtifactStore(tmp_path / "store")
    versions = {}
    for name, seed in (("a", 6), ("b", 7)):
        src = tmp_path / name
        src.mkdir()
        make_onnx(src / "model.onnx", seed=seed)
        blob = store.put_file(src / "model.onnx")
        manifest = sign_manifest(build_manifest(src, name=name, version="1", kind="tensor", format="onnx"), key)
        versions[name] = TensorVersion(1, "active", manifest.sha256, json.loads(manifest.to_json()), blob.size)
    room = versions["a"].nbytes + versions["a"].nbytes // 2  # one model, not two
    pool = TensorPool(
        {}, memory_budget_bytes=room, cache_dir=tmp_path / "cache", store=store, trusted_keys=[key.public_key()]
    )

    async def scenario() -> None:
        await pool.start()
        a = await pool.acquire("a", versions["a"])  # a call to a is in flight
        with pytest.raises(ServiceUnavailableError, match="calls in flight"):
            await pool.acquire("b", versions["b"])
        assert pool.loaded == [("a", 1)]
        pool.release(a)
        b = await pool.acquire("b", versions["b"])
        assert pool.loaded == [("b", 1)] and pool.stats()[("a", 1)].unloads == 1
        pool.release(b)
        await pool.close()

    asyncio.run(scenario())

"""A device cannot plant usage under ids the cloud uses, nor date it out of the billing period.

One real cloud server, two tenants: a device of tenant A syncs records under the ids tenant B's idempotent
request and async job would be metered under, then B makes both; B is billed exactly once for each, A's
records live in A's namespace, a replay stores nothing, a changed payload under a used id is a conflict, and
a record dated 2100 is booked now and flagged.
"""

from __future__ import annotations

import hashlib
import stat
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlmodel import Session, select

from cloud.gateway.ids import ID_SECRET_FILE, CloudIds
from controlplane.fleet.devices import create_enrollment_token, device_usage_id
from controlplane.storage.database import create_db
from controlplane.storage.tables import UsageRecord
from controlplane.tenancy.service import create_api_key, create_tenant
from tests.conftest import base_env, free_port, migrated_sqlite, seed_data_dir, server_process

pytestmark = pytest.mark.integration

MODEL = "tierline/lm-cloud"
MAX_FUTURE_S = 420
MAX_AGE_DAYS = 2


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory, tiny_zoo: Path, session_data_dir: Path) -> Iterator[dict[str, Any]]:
    data = seed_data_dir(tmp_path_factory.mktemp("usage-ns"), tiny_zoo, session_data_dir)
    db_url = migrated_sqlite(data)
    engine = create_db(db_url)
    with Session(engine) as s:
        a, b = create_tenant(s, "tenant-a"), create_tenant(s, "tenant-b")
        key_b = create_api_key(s, b).secret
        enroll_token = create_enrollment_token(s, a).secret
        s.commit()
        ids = {"a": a.id, "b": b.id}
    env = base_env(
        data,
        TIERLINE_DATABASE_URL=db_url,
        TIERLINE_CLOUD_ZOO_PRESET="tiny",
        TIERLINE_CLOUD_KV_CACHE_MB="16",
        TIERLINE_CLOUD_USAGE_FLUSH_MS="50",
        TIERLINE_CLOUD_JOB_POLL_S="0.2",
        # the clamp window, set apart from its defaults (300 s, 35 days, 1 h) to show the settings apply
        TIERLINE_CLOUD_EDGE_USAGE_MAX_FUTURE_S=str(MAX_FUTURE_S),
        TIERLINE_CLOUD_EDGE_USAGE_MAX_AGE_DAYS=str(MAX_AGE_DAYS),
        TIERLINE_CLOUD_EDGE_USAGE_ENROLLMENT_MARGIN_S=str(3 * 86400),
    )
    port = free_port()
    with server_process(["cloud", "serve"], env, port, ready_path="/readyz", timeout=120, stop_timeout=60):
        url = f"http://127.0.0.1:{port}"
        enrolled = httpx.post(f"{url}/v1/edge/enroll", json={"token": enroll_token, "name": "a-1"}).json()
        yield {
            "url": url,
            "key_b": key_b,
            "engine": engine,
            "tenant": ids,
            "device": enrolled,
            "keys_dir": data / "keys",
        }
    engine.dispose()


def _sync(cloud: dict[str, Any], usage: list[dict[str, Any]]) -> dict[str, Any]:
    resp = httpx.post(
        f"{cloud['url']}/v1/edge/sync",
        json={"usage": usage},
        headers={"Authorization": f"Bearer {cloud['device']['device_token']}"},
    )
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def _metric(cloud: dict[str, Any], series: str) -> float:
    """One series' value from the server's /metrics (Prometheus text)."""
    text = httpx.get(f"{cloud['url']}/metrics").text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(series + " ")]
    assert len(values) == 1, f"{series} not in /metrics"
    return values[0]


def _records(cloud: dict[str, Any], tenant_id: int) -> list[UsageRecord]:
    with Session(cloud["engine"]) as s:
        return list(s.exec(select(UsageRecord).where(UsageRecord.tenant_id == tenant_id)))


def _planted(rid: str, *, completion_tokens: int = 0, occurred_at: float | None = None) -> dict[str, Any]:
    return {
        "id": rid,
        "model": MODEL,
        "tier": "cloud",
        "prompt_tokens": 0,
        "completion_tokens": completion_tokens,
        "occurred_at": time.time() if occurred_at is None else occurred_at,
    }


def test_a_device_cannot_make_another_tenants_usage_be_skipped(cloud: dict[str, Any]) -> None:
    a, b = cloud["tenant"]["a"], cloud["tenant"]["b"]
    # The worst case: the device somehow knows the ids (they are keyed with the server's secret, read here).
    ids = CloudIds.from_keys_dir(cloud["keys_dir"])
    idem_id, job_id = ids.usage_id(b, "pay-once"), ids.job_id(b, "job-once")
    batch = [_planted(idem_id), _planted(job_id)]
    first = _sync(cloud, batch)
    assert first["accepted"] == 2 and first["duplicates"] == 0

    auth = {"Authorization": f"Bearer {cloud['key_b']}"}
    body = {"model": MODEL, "prompt": "def f():", "max_tokens": 4, "temperature": 0}
    served = httpx.post(f"{cloud['url']}/v1/completions", json=body, headers={**auth, "Idempotency-Key": "pay-once"})
    assert served.status_code == 200, served.text
    job = httpx.post(
        f"{cloud['url']}/v1/completions", json={**body, "async": True}, headers={**auth, "Idempotency-Key": "job-once"}
    ).json()
    deadline = time.monotonic() + 60
    while httpx.get(f"{cloud['url']}/v1/jobs/{job['id']}", headers=auth).json()["status"] != "succeeded":
        assert time.monotonic() < deadline, "the job did not finish"
        time.sleep(0.2)

    usage_header = served.headers["x-tierline-usage-id"]
    deadline = time.monotonic() + 10
    while len(billed := _records(cloud, b)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    # B is billed exactly once for each, for what was generated, under ids the cloud chose.
    assert sorted(r.id for r in billed) == sorted([usage_header, job["id"]])
    assert all(r.completion_tokens > 0 and r.device_id is None for r in billed)

    device = cloud["device"]["device_id"]
    mine = _records(cloud, a)
    assert sorted(r.id for r in mine) == sorted(device_usage_id(a, device, rid) for rid in (idem_id, job_id))
    assert all(r.id.startswith("edge-") and r.device_id == device for r in mine)

    replay = _sync(cloud, batch)
    assert (replay["accepted"], replay["duplicates"], replay["conflicts"]) == (0, 2, 0)
    assert len(_records(cloud, a)) == 2

    before = _metric(cloud, 'tierline_usage_id_conflicts_total{source="edge"}')
    changed = _sync(cloud, [_planted(idem_id, completion_tokens=500)])
    assert (changed["accepted"], changed["conflicts"]) == (0, 1)
    assert _metric(cloud, 'tierline_usage_id_conflicts_total{source="edge"}') == before + 1  # surfaced, not silent
    assert all(r.completion_tokens == 0 for r in _records(cloud, a))


def test_a_far_future_record_is_booked_now_and_flagged(cloud: dict[str, Any]) -> None:
    a = cloud["tenant"]["a"]
    future = datetime(2100, 1, 1, tzinfo=UTC)
    answer = _sync(cloud, [_planted("future-0001", completion_tokens=3, occurred_at=future.timestamp())])
    assert answer["accepted"] == 1 and answer["clamped"] == 1
    with Session(cloud["engine"]) as s:
        row = s.get(UsageRecord, device_usage_id(a, cloud["device"]["device_id"], "future-0001"))
    assert row is not None
    assert abs(row.occurred_at - datetime.now(UTC)) < timedelta(minutes=10)
    assert row.reported_at == future
    assert _metric(cloud, "tierline_usage_clamped_total") >= 1
    # A replay is the same record, however much later it arrives.
    again = _sync(cloud, [_planted("future-0001", completion_tokens=3, occurred_at=future.timestamp())])
    assert (again["accepted"], again["duplicates"], again["conflicts"]) == (0, 1, 0)


def test_the_clouds_ids_cannot_be_derived_without_its_secret(cloud: dict[str, Any]) -> None:
    a, b = cloud["tenant"]["a"], cloud["tenant"]["b"]
    # What anyone could compute before: sha256 of tenant and key. A device plants records under those.
    old_idem = "idem-" + hashlib.sha256(f"{b}:guess-me".encode()).hexdigest()[:40]
    old_job = "job_" + hashlib.sha256(f"{b}:guess-job".encode()).hexdigest()[:32]
    planted = _sync(cloud, [_planted(old_idem), _planted(old_job)])
    assert planted["accepted"] == 2

    auth = {"Authorization": f"Bearer {cloud['key_b']}"}
    body = {"model": MODEL, "prompt": "def g():", "max_tokens": 3, "temperature": 0}
    served = httpx.post(f"{cloud['url']}/v1/completions", json=body, headers={**auth, "Idempotency-Key": "guess-me"})
    assert served.status_code == 200, served.text
    job = httpx.post(
        f"{cloud['url']}/v1/completions", json={**body, "async": True}, headers={**auth, "Idempotency-Key": "guess-job"}
    ).json()
    usage_header = served.headers["x-tierline-usage-id"]
    assert usage_header.startswith("idem-") and usage_header != old_idem
    assert job["id"].startswith("job_") and job["id"] != old_job

    secret = cloud["keys_dir"] / ID_SECRET_FILE
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    ids = CloudIds.from_keys_dir(cloud["keys_dir"])
    assert (ids.usage_id(b, "guess-me"), ids.job_id(b, "guess-job")) == (usage_header, job["id"])
    other = CloudIds(b"x" * 32)  # another secret (another deployment, an attacker's guess): other ids
    assert other.usage_id(b, "guess-me") != usage_header and other.job_id(b, "guess-job") != job["id"]

    deadline = time.monotonic() + 60
    while httpx.get(f"{cloud['url']}/v1/jobs/{job['id']}", headers=auth).json()["status"] != "succeeded":
        assert time.monotonic() < deadline, "the job did not finish"
        time.sleep(0.2)
    deadline = time.monotonic() + 10
    wanted = {usage_header, job["id"]}
    while not wanted <= {r.id for r in _records(cloud, b)} and time.monotonic() < deadline:
        time.sleep(0.1)
    billed = {r.id: r for r in _records(cloud, b) if r.id in wanted}
    assert set(billed) == wanted and all(r.completion_tokens > 0 and r.device_id is None for r in billed.values())
    device = cloud["device"]["device_id"]
    assert {device_usage_id(a, device, old_idem), device_usage_id(a, device, old_job)} <= {
        r.id for r in _records(cloud, a)
    }


def test_the_clamp_window_is_the_configured_one_at_its_edges(cloud: dict[str, Any]) -> None:
    a, device = cloud["tenant"]["a"], cloud["device"]["device_id"]
    now = time.time()
    day = 86400.0
    sent = {  # id -> the device's time: 20 s (or 0.1 day) inside and outside each edge of the window
        "edge-future-in": now + MAX_FUTURE_S - 20,
        "edge-future-out": now + MAX_FUTURE_S + 20,
        "edge-old-in": now - (MAX_AGE_DAYS - 0.1) * day,
        "edge-old-out": now - (MAX_AGE_DAYS + 0.1) * day,
    }
    clamped_before = _metric(cloud, "tierline_usage_clamped_total")
    answer = _sync(cloud, [_planted(rid, completion_tokens=1, occurred_at=ts) for rid, ts in sent.items()])
    assert (answer["accepted"], answer["clamped"]) == (4, 2)
    assert _metric(cloud, "tierline_usage_clamped_total") == clamped_before + 2
    with Session(cloud["engine"]) as s:
        rows = {rid: s.get(UsageRecord, device_usage_id(a, device, rid)) for rid in sent}
    booked = {rid: row.occurred_at.timestamp() for rid, row in rows.items() if row is not None}
    assert len(booked) == 4
    for rid in ("edge-future-in", "edge-old-in"):  # inside: booked at the device's time, not flagged
        assert abs(booked[rid] - sent[rid]) < 1 and rows[rid].reported_at is None  # type: ignore[union-attr]
    # outside: booked at the window's edge (as the server saw it), the device's time kept
    assert abs(booked["edge-future-out"] - (now + MAX_FUTURE_S)) < 15
    assert abs(booked["edge-old-out"] - (now - MAX_AGE_DAYS * day)) < 15
    assert rows["edge-future-out"].reported_at is not None  # type: ignore[union-attr]
    assert abs(rows["edge-old-out"].reported_at.timestamp() - sent["edge-old-out"]) < 1  # type: ignore[union-attr]

"""The cloud serves registry versions (``TIERLINE_CLOUD_REGISTRY_MODELS``) and routes a cloud canary rollout's
traffic between them: a real cloud server on a socket, the registry and rollouts written through their services."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from cloud.serving.engine_pool import EnginePool
from cloud.serving.registry_models import RegistryModels
from cloud.settings import CloudSettings
from controlplane.registry import service as registry
from controlplane.registry.artifacts import push_path
from controlplane.registry.store import LocalArtifactStore
from controlplane.rollouts import service as rollouts
from controlplane.storage.database import create_db
from controlplane.storage.tables import UsageRecord
from controlplane.tenancy.service import create_api_key, create_tenant
from shared.artifacts import load_or_create_signing_key
from shared.errors import ApplicationError
from tests.conftest import base_env, free_port, run_server, seed_data_dir

pytestmark = pytest.mark.integration
NAME = "tiny-lm"
ACTOR = "test"
SUBJECTS = [f"user-{i}" for i in range(160)]


@dataclass
class Cloud:
    http: httpx.Client
    db: Engine
    tenant_id: int
    data: Path
    last: dict[str, httpx.Response] = field(default_factory=dict)  # the latest versions() call's answers

    def complete(self, model: str = NAME, subject: str | None = None, user: str | None = None) -> httpx.Response:
        body: dict[str, object] = {"model": model, "prompt": "def f(x):", "max_tokens": 1, "temperature": 0}
        if user is not None:
            body["user"] = user
        headers = {"x-tierline-subject": subject} if subject is not None else {}
        return self.http.post("/v1/completions", json=body, headers=headers)

    def versions(self, subjects: list[str]) -> dict[str, int]:
        """Subject → the version that served it (``x-tierline-model-version``), with the usage id checked later."""

        def one(subject: str) -> tuple[str, httpx.Response]:
            return subject, self.complete(subject=subject)

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(one, subjects))
        for _, resp in answers:
            assert resp.status_code == 200, resp.text
        self.last = {s: r for s, r in answers}
        return {s: int(r.headers["x-tierline-model-version"]) for s, r in answers}

    def usage(self, ids: list[str], timeout: float = 10.0) -> dict[str, UsageRecord]:
        deadline = time.monotonic() + timeout
        while True:
            with Session(self.db) as s:
                rows = {r.id: r for r in s.exec(select(UsageRecord).where(col(UsageRecord.id).in_(ids)))}
            if len(rows) == len(ids) or time.monotonic() > deadline:
                return rows
            time.sleep(0.1)

    def until(self, check: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            assert time.monotonic() < deadline, f"never happened: {what}"
            time.sleep(0.2)


@pytest.fixture
def cloud(migrated_db: str, tmp_path: Path, tiny_zoo: Path, session_data_dir: Path) -> Iterator[Cloud]:
    """Versions 1 and 2 of ``tiny-lm`` (the tiny cloud LM pushed twice), stable → 1, a cloud rollout 1 → 2
    running at 50 %, and a cloud serving the registry model."""
    data = seed_data_dir(tmp_path / "data", tiny_zoo, session_data_dir)
    store = LocalArtifactStore(data / "artifacts")
    key = load_or_create_signing_key(data / "keys" / "artifact-signing.ed25519")
    checkpoint = data / "zoo" / "tiny" / "artifacts" / "lm-cloud"
    db = create_db(migrated_db)
    with Session(db) as s:
        for _ in range(2):
            push_path(s, store, checkpoint, name=NAME, actor=ACTOR, signing_key=key)
        registry.move_alias(s, registry.get_model(s, NAME), "stable", 1, actor=ACTOR)
        tenant = create_tenant(s, "acme")
        secret = create_api_key(s, tenant).secret
        spec = rollouts.RolloutSpec(NAME, "1", "2", scope="cloud", steps=[50.0, 100.0])
        rollout = rollouts.create_rollout(s, spec, actor=ACTOR)
        s.commit()
        rollouts.resume(s, rollout.id or 0, actor=ACTOR, reason="start")  # a pending rollout starts at step 0
        s.commit()
        tenant_id = tenant.id or 0
    env = base_env(
        data,
        TIERLINE_DATABASE_URL=migrated_db,
        TIERLINE_CLOUD_ZOO_PRESET="tiny",
        TIERLINE_CLOUD_KV_CACHE_MB="8",
        TIERLINE_CLOUD_SPECULATION="off",
        TIERLINE_CLOUD_USAGE_FLUSH_MS="50",
        TIERLINE_CLOUD_CANARY_REFRESH_S="0.3",
        TIERLINE_CLOUD_REGISTRY_MODELS=NAME,
    )
    with (
        run_server(["cloud", "serve"], env, free_port(), timeout=120) as url,
        httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {secret}"}) as http,
    ):
        yield Cloud(http, db, tenant_id, data)
    db.dispose()


def expected_versions(cloud: Cloud, subjects: list[str]) -> dict[str, int]:
    """What the pure assignment function says each subject gets under the current plans."""
    with Session(cloud.db) as s:
        plans = rollouts.load_plans(s, "cloud")
    out = {}
    for subject in subjects:
        route = rollouts.resolve_cloud_arm(plans, model=NAME, tenant_id=cloud.tenant_id, subject=subject)
        assert route is not None
        out[subject] = int(route.version)
    return out


def test_a_cloud_rollout_routes_requests_between_registry_versions(cloud: Cloud) -> None:
    listed = cloud.http.get("/v1/models").json()["data"]
    assert NAME in {m["id"] for m in listed}
    # Both versions were materialised from the artifact store into the cache under the data dir.
    assert sorted(p.name.split("-")[0] for p in (cloud.data / "cloud-models" / NAME).iterdir()) == ["1", "2"]

    served = cloud.versions(SUBJECTS)
    assert served == expected_versions(cloud, SUBJECTS)  # each subject gets the arm assignment picks for it
    share = sum(v == 2 for v in served.values()) / len(served)
    assert 0.35 <= share <= 0.65, share  # the candidate's weight is 50 %

    # Usage records carry the version that served and the arm it counts in.
    by_id = {r.headers["x-tierline-usage-id"]: s for s, r in cloud.last.items()}
    rows = cloud.usage(list(by_id))
    assert len(rows) == len(by_id)
    for usage_id, subject in by_id.items():
        row = rows[usage_id]
        assert row.model == NAME and row.model_version == served[subject]
        assert row.rollout_arm == ("candidate" if served[subject] == 2 else "baseline")

    # Sticky: the same subject gets the same version again, by header or by the request's `user` field.
    again = cloud.versions(SUBJECTS[:20])
    assert again == {s: served[s] for s in SUBJECTS[:20]}
    for subject in SUBJECTS[:6]:
        resp = cloud.complete(user=subject)
        assert int(resp.headers["x-tierline-model-version"]) == served[subject]

    # A request may pin a version (number or alias): served by it, counted in no arm; unknown ones are 404.
    pinned = cloud.complete(f"{NAME}@2", subject=next(s for s, v in served.items() if v == 1))
    assert pinned.status_code == 200 and pinned.headers["x-tierline-model-version"] == "2"
    assert pinned.json()["model"] == NAME
    row = cloud.usage([pinned.headers["x-tierline-usage-id"]])[pinned.headers["x-tierline-usage-id"]]
    assert row.model_version == 2 and row.rollout_arm is None
    assert cloud.complete(f"{NAME}@stable").headers["x-tierline-model-version"] == "1"
    for unknown in (f"{NAME}@7", f"{NAME}@canary", "no-such-model"):
        resp = cloud.complete(unknown)
        assert resp.status_code == 404, resp.text
        assert resp.json()["error"]["param"] == "model"

    # Aborted: after the next plan refresh everyone is back on version 1, counted in no arm.
    with Session(cloud.db) as s:
        rollout_id = rollouts.list_rollouts(s)[0].id or 0
        rollouts.abort(s, rollout_id, actor=ACTOR, reason="test")
        s.commit()
    candidates = [s for s, v in served.items() if v == 2]
    cloud.until(lambda: cloud.complete(subject=candidates[0]).headers["x-tierline-model-version"] == "1", "abort")
    assert set(cloud.versions(SUBJECTS).values()) == {1}
    rows = cloud.usage([r.headers["x-tierline-usage-id"] for r in cloud.last.values()])
    assert {(r.model_version, r.rollout_arm) for r in rows.values()} == {(1, None)}


def test_a_rollout_created_after_start_up_loads_its_candidate_in_the_background(cloud: Cloud) -> None:
    with Session(cloud.db) as s:
        rollouts.abort(s, rollouts.list_rollouts(s)[0].id or 0, actor=ACTOR, reason="make room")
        s.commit()
        push_path(
            s,
            LocalArtifactStore(cloud.data / "artifacts"),
            cloud.data / "zoo" / "tiny" / "artifacts" / "lm-cloud",
            name=NAME,
            actor=ACTOR,
            signing_key=load_or_create_signing_key(cloud.data / "keys" / "artifact-signing.ed25519"),
        )
        rollout = rollouts.create_rollout(
            s, rollouts.RolloutSpec(NAME, "1", "3", scope="cloud", steps=[100.0]), actor=ACTOR
        )
        s.commit()
        rollouts.resume(s, rollout.id or 0, actor=ACTOR, reason="start")
        s.commit()
    # Until version 3 is loaded requests go to the baseline, counted in no arm; then all go to 3 (weight 100).
    cloud.until(lambda: cloud.complete(subject="someone").headers["x-tierline-model-version"] == "3", "load v3")
    assert set(cloud.versions(SUBJECTS[:20]).values()) == {3}
    rows = cloud.usage([r.headers["x-tierline-usage-id"] for r in cloud.last.values()])
    assert {(r.model_version, r.rollout_arm) for r in rows.values()} == {(3, "candidate")}
    # Version 2 (the aborted rollout's candidate) is no longer needed: it is unloaded; the cache keeps its files.
    cloud.until(lambda: f"{NAME}@2" not in cloud.http.get("/readyz").json()["models"], "unload v2")
    assert [m for m in cloud.http.get("/readyz").json()["models"] if m.startswith(NAME)] == [f"{NAME}@1", f"{NAME}@3"]
    assert cloud.complete(f"{NAME}@2").status_code == 404
    assert len(list((cloud.data / "cloud-models" / NAME).iterdir())) == 3


def test_a_cached_checkpoint_is_checked_and_a_damaged_one_fetched_again(
    migrated_db: str, tmp_path: Path, tiny_zoo: Path
) -> None:
    store = LocalArtifactStore(tmp_path / "artifacts")
    key = load_or_create_signing_key(tmp_path / "keys" / "artifact-signing.ed25519")
    db = create_db(migrated_db)
    with Session(db) as s:
        push_path(s, store, tiny_zoo / "artifacts" / "lm-cloud", name=NAME, actor=ACTOR, signing_key=key)
        s.commit()
    models = RegistryModels(db, EnginePool({}), CloudSettings(), store, tmp_path / "cache")
    artifact = models.cloud_artifact(NAME, 1)
    assert artifact is not None
    first = models.materialize(NAME, 1, artifact)
    assert first.parent == tmp_path / "cache" / NAME and (first / "config.json").is_file()
    original = (first / "model.safetensors").read_bytes()

    (first / "model.safetensors").write_bytes(b"damaged")
    assert models.materialize(NAME, 1, artifact) == first
    assert (first / "model.safetensors").read_bytes() == original

    # A corrupt blob in the store is refused, and nothing half-written is left in the cache.
    shutil.rmtree(first)
    blob = store.path(next(f["sha256"] for f in artifact.manifest["files"] if f["path"] == "config.json"))
    blob.chmod(0o644)
    blob.write_bytes(b"{}")
    with pytest.raises(ApplicationError, match="corrupt"):
        models.materialize(NAME, 1, artifact)
    assert list((tmp_path / "cache" / NAME).iterdir()) == []
    db.dispose()

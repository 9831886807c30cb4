"""A cloud rollout's shadow step (step 0): a real cloud serving three registry versions of one model (1 and 2
identical, 3 with other weights), two tenants each with a rollout at its shadow step. Users get the baseline; a
sample of their greedy requests is mirrored to the candidate in the background, unbilled; the controller advances
the identical candidate and rolls back the different one, with the numbers in the events."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from console.management_api import create_token
from console.passwords import create_user
from controlplane.registry import service as registry
from controlplane.registry.artifacts import push_path
from controlplane.registry.store import LocalArtifactStore
from controlplane.rollouts import service as rollouts
from controlplane.storage.database import create_db
from controlplane.storage.tables import RolloutShadowSample, UsageRecord
from controlplane.tenancy.service import create_api_key, create_tenant
from shared.artifacts import load_or_create_signing_key
from tests.conftest import base_env, free_port, migrated_sqlite, run_server, seed_data_dir

pytestmark = pytest.mark.integration
NAME = "tiny-lm"
ACTOR = "test"
PROMPTS = ["def f(x):", "import os\n", "class A:", "for i in range(", "return x +", "# a comment"]


@dataclass
class Shadowed:
    db: Engine
    clients: dict[str, httpx.Client]  # tenant → client
    rollout_ids: dict[str, int]  # tenant → its rollout


def _different_weights(checkpoint: Path, dest: Path) -> Path:
    """A copy of ``checkpoint`` whose float weights are shuffled by a fixed seed: the same shapes, other tokens."""
    shutil.copytree(checkpoint, dest)
    weights = dest / "model.safetensors"
    tensors = load_file(str(weights))
    gen = torch.Generator().manual_seed(7)
    for name, t in tensors.items():
        if t.is_floating_point() and t.numel() > 1:
            flat = t.flatten()
            tensors[name] = flat[torch.randperm(flat.numel(), generator=gen)].reshape(t.shape).contiguous()
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return dest


@pytest.fixture
def shadowed(migrated_db: str, tmp_path: Path, tiny_zoo: Path, session_data_dir: Path) -> Iterator[Shadowed]:
    data = seed_data_dir(tmp_path / "data", tiny_zoo, session_data_dir)
    store = LocalArtifactStore(data / "artifacts")
    key = load_or_create_signing_key(data / "keys" / "artifact-signing.ed25519")
    checkpoint = data / "zoo" / "tiny" / "artifacts" / "lm-cloud"
    other = _different_weights(checkpoint, tmp_path / "lm-cloud-other")
    db = create_db(migrated_db)
    secrets: dict[str, str] = {}
    ids: dict[str, int] = {}
    with Session(db) as s:
        for path in (checkpoint, checkpoint, other):  # versions 1, 2 (identical to 1), 3 (other weights)
            push_path(s, store, path, name=NAME, actor=ACTOR, signing_key=key)
        registry.move_alias(s, registry.get_model(s, NAME), "stable", 1, actor=ACTOR)
        for tenant_name, candidate in (("same", "2"), ("other", "3")):
            tenant = create_tenant(s, tenant_name)
            secrets[tenant_name] = create_api_key(s, tenant).secret
            spec = rollouts.RolloutSpec(
                NAME,
                "1",
                candidate,
                scope="cloud",
                steps=[50.0, 100.0],
                min_step_s=0.0,
                min_samples=4,
                tenant=tenant_name,
                shadow_sample=100.0,
                shadow_min_agreement=0.99,
            )
            ids[tenant_name] = rollouts.create_rollout(s, spec, actor=ACTOR).id or 0
        s.commit()
    assert {r.action for r in rollouts.run_controller_pass(db)} == {"start"}  # both start at the shadow step
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
    with run_server(["cloud", "serve"], env, free_port(), timeout=120) as url:
        clients = {
            t: httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {secret}"})
            for t, secret in secrets.items()
        }
        try:
            yield Shadowed(db, clients, ids)
        finally:
            for client in clients.values():
                client.close()
    db.dispose()


def _samples(db: Engine, rollout_id: int) -> list[RolloutShadowSample]:
    with Session(db) as s:
        return list(s.exec(select(RolloutShadowSample).where(RolloutShadowSample.rollout_id == rollout_id)))


def _until_samples(db: Engine, rollout_id: int, n: int, timeout: float = 20.0) -> list[RolloutShadowSample]:
    deadline = time.monotonic() + timeout
    while len(rows := _samples(db, rollout_id)) < n:
        assert time.monotonic() < deadline, f"only {len(rows)} shadow samples of {n}"
        time.sleep(0.1)
    return rows


def test_the_shadow_step_mirrors_baseline_requests_and_judges_the_candidates_agreement(shadowed: Shadowed) -> None:
    usage_ids: dict[str, list[str]] = {t: [] for t in shadowed.clients}
    for tenant, client in shadowed.clients.items():
        for i, prompt in enumerate(PROMPTS):
            body = {"model": NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0, "user": f"u{i}"}
            resp = client.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            # Users get the baseline at the shadow step, whatever their subject.
            assert resp.headers["x-tierline-model-version"] == "1"
            usage_ids[tenant].append(resp.headers["x-tierline-usage-id"])
        # A streamed greedy request is mirrored once its answer is complete.
        body = {"model": NAME, "prompt": "while True:", "max_tokens": 8, "temperature": 0, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as streamed:
            assert streamed.status_code == 200 and streamed.headers["x-tierline-model-version"] == "1"
            assert "[DONE]" in streamed.read().decode()
            usage_ids[tenant].append(streamed.headers["x-tierline-usage-id"])
        # A sampled (not greedy) request is answered by the baseline but not mirrored.
        resp = client.post("/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 4, "temperature": 1})
        assert resp.status_code == 200 and resp.headers["x-tierline-model-version"] == "1"
        usage_ids[tenant].append(resp.headers["x-tierline-usage-id"])

    mirrored = len(PROMPTS) + 1
    same = _until_samples(shadowed.db, shadowed.rollout_ids["same"], mirrored)
    other = _until_samples(shadowed.db, shadowed.rollout_ids["other"], mirrored)
    time.sleep(0.5)  # a stray mirror of the sampled request would land by now
    assert len(_samples(shadowed.db, shadowed.rollout_ids["same"])) == mirrored
    assert {(r.positions, r.matches, r.agreement) for r in same} == {(8, 8, 1.0)}  # identical weights agree
    assert all(r.positions == 8 for r in other)
    mean_other = sum(r.agreement for r in other) / len(other)
    assert mean_other < 0.99, [r.agreement for r in other]

    # Only the users' requests were billed, all served by the baseline; the mirrors left no usage record.
    with Session(shadowed.db) as s:
        rows = list(s.exec(select(UsageRecord).where(col(UsageRecord.model) == NAME)))
    assert sorted(r.id for r in rows) == sorted(i for ids in usage_ids.values() for i in ids)
    assert {(r.model_version, r.rollout_arm) for r in rows} == {(1, "baseline")}

    # The controller's tick: the identical candidate advances to its first real step, the other rolls back.
    results = {r.rollout_id: r for r in rollouts.run_controller_pass(shadowed.db)}
    advanced = results[shadowed.rollout_ids["same"]]
    assert (advanced.action, advanced.status, advanced.step_index, advanced.weight) == ("advance", "running", 1, 50.0)
    rolled = results[shadowed.rollout_ids["other"]]
    assert (rolled.action, rolled.status, rolled.weight) == ("rollback", "rolled_back", 0.0)
    with Session(shadowed.db) as s:
        events = {t: rollouts.rollout_events(s, rid)[-1] for t, rid in shadowed.rollout_ids.items()}
    assert events["same"].kind == "advanced" and events["same"].metrics is not None
    assert events["same"].metrics["shadow"] == {"samples": mirrored, "mean_agreement": 1.0, "min_agreement": 0.99}
    assert events["other"].kind == "rolled_back" and events["other"].metrics is not None
    assert events["other"].metrics["shadow"]["mean_agreement"] == pytest.approx(mean_other, abs=1e-6)
    assert "below 0.99" in events["other"].reason


def test_the_management_api_creates_a_rollout_with_a_shadow_step_and_names_bad_fields(
    tmp_path: Path, tiny_zoo: Path, session_data_dir: Path
) -> None:
    data = seed_data_dir(tmp_path / "data", tiny_zoo, session_data_dir)
    db_url = migrated_sqlite(data)
    db = create_db(db_url)
    with Session(db) as s:
        create_user(s, "ops", "correct horse battery", "admin")
        token = create_token(s, "ops").secret
        s.commit()
    db.dispose()
    env = base_env(data, TIERLINE_DATABASE_URL=db_url, TIERLINE_CONSOLE_ROLLOUT_INTERVAL_S="600")
    base = {"model": NAME, "baseline_version": "1", "candidate_version": "2", "scope": "cloud"}
    with (
        run_server(["console", "serve"], env, free_port()) as url,
        httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {token}"}) as console,
    ):
        cases: list[tuple[dict[str, object], str]] = [
            ({"shadow_sample": 120}, "shadow_sample"),
            ({"shadow_sample": -5}, "shadow_sample"),
            ({"shadow_sample": 10, "shadow_min_agreement": 2}, "shadow_min_agreement"),
            ({"shadow_sample": 10, "scope": "edge"}, "shadow_sample"),
        ]
        for changes, param in cases:
            bad = console.post("/api/rollouts", json={**base, **changes})
            assert bad.status_code == 400, bad.text
            assert bad.json()["error"]["param"] == param
        made = console.post("/api/rollouts", json={**base, "steps": [10, 100], "shadow_sample": 25})
        assert made.status_code == 201, made.text
        body = made.json()
        assert body["steps"] == [0.0, 10.0, 100.0] and body["weight"] == 0.0
        assert (body["shadow_sample"], body["shadow_min_agreement"]) == (25.0, 0.9)

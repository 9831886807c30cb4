"""A team's own model on a device, end to end: a random-initialised Qwen2 checkpoint exported with the repo's
exporter to ONNX, carrying the checkpoint's reference answers (``reference.json``), signed and published under the
team's own name (``acme-qwen-edge-onnx``). A real agent learns it from a real cloud at sync, installs it and
answers under that name and under its alias (``acme-qwen-edge``, the runtime guard's pick); the registry's pairing,
sent at the same sync, routes a forced escalation to the paired cloud model; an edge model with no pairing answers
locally and says so; the runtime guard refuses an export whose answers differ from ``reference.json``."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from click.testing import CliRunner
from sqlalchemy import create_engine
from sqlmodel import Session, select

from cloud.edge.releases import publish_command
from controlplane.registry import service as registry
from controlplane.storage.tables import DeviceEvent
from edge_agent.model_store import ModelStore
from edge_agent.models import ServedModels
from edge_agent.updater import Updater
from shared.artifacts import (
    build_manifest,
    load_or_create_signing_key,
    load_public_key,
    public_path,
    read_manifest,
    write_signed_manifest,
)
from shared.edge_protocol import DesiredModel
from shared.reference_answers import REFERENCE_FILE, ReferenceAnswers
from shared.zoo.export_lm import export_onnx
from shared.zoo.registry import ZooLayout
from shared.zoo.verify import make_reference
from tests.conftest import base_env, free_port, migrated_sqlite, run_server, seed_data_dir
from tests.forkserver import run_tierline

pytestmark = pytest.mark.integration

TEAM = "acme-qwen-edge"  # the registry model, and the alias the device serves its formats under
RELEASE = f"{TEAM}-onnx"  # the name the team published its ONNX export under
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
PROMPT = "def main():\n"


def _checkpoint(directory: Path, tokenizer_from: Path) -> None:
    """A random Qwen2 checkpoint (hidden 64, 2 layers) on the zoo's tokenizer; norms and biases noised, so its
    next-token choices are clear-cut rather than near-ties."""
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab = len(json.loads((tokenizer_from / "tokenizer.json").read_text())["model"]["vocab"])
    torch.manual_seed(38)
    config = AutoConfig.for_model(
        "qwen2",
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.1,
        eos_token_id=None,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for _, param in model.named_parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(directory)
    for name in TOKENIZER_FILES:
        shutil.copy2(tokenizer_from / name, directory / name)


def _export(ckpt: Path, out: Path, source: dict[str, str]) -> Path:
    """The ONNX artifact as derive lays it out: the model, the checkpoint's config and tokenizer, edge_model.json
    and the source's reference answers."""
    out.mkdir(parents=True)
    export_onnx(ckpt, out / "model.onnx")
    config = json.loads((ckpt / "config.json").read_text())
    for name in ("config.json", *TOKENIZER_FILES):
        shutil.copy2(ckpt / name, out / name)
    meta = {
        "format": "onnx",
        "io": "growing-kv-cache/v1",
        "num_layers": config["num_hidden_layers"],
        "num_kv_heads": config["num_key_value_heads"],
        "head_dim": config["hidden_size"] // config["num_attention_heads"],
        "vocab_size": config["vocab_size"],
        "max_context": config["max_position_embeddings"],
    }
    (out / "edge_model.json").write_text(json.dumps(meta))
    (out / REFERENCE_FILE).write_text(make_reference(ckpt, source).to_json())
    return out


def _sign(artifact: Path, manifests: Path, name: str, source: dict[str, str], key_path: Path) -> Path:
    manifest = build_manifest(
        artifact,
        name=name,
        version="1",
        kind="causal-lm",
        format="onnx",
        derived_from=source,
        metadata={"target": "edge", "derived_by": "tests"},
    )
    path = manifests / f"{name}.json"
    manifests.mkdir(parents=True, exist_ok=True)
    write_signed_manifest(manifest, load_or_create_signing_key(key_path), path)
    return path


@dataclass
class World:
    data: Path
    state: Path
    cloud_url: str
    edge_url: str
    db: str
    team_artifact: Path

    def pair(self, cloud_model: str | None, resend: str = "as-sent") -> None:
        """``tierline models pair``, through the registry's own service, on the cloud's database."""
        engine = create_engine(self.db)
        with Session(engine) as session:
            model = registry.ensure_model(session, TEAM, "causal-lm", actor="test")
            registry.set_pairing(session, model, cloud_model, resend=resend, actor="test")
            session.commit()
        engine.dispose()

    def agent(self) -> dict[str, Any]:
        resp = httpx.get(f"{self.edge_url}/v1/agent", timeout=10)
        assert resp.status_code == 200, resp.text
        body: dict[str, Any] = resp.json()
        return body

    def wait_for(self, what: str, check: Any, timeout: float = 90.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            found = check()
            if found:
                return found
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; agent: {self.agent()}")
            time.sleep(0.3)

    def pairing(self, model: str) -> dict[str, Any] | None:
        found: dict[str, Any] | None = self.agent()["pairings"].get(model)
        return found

    def complete(self, model: str, tier: str | None = None, prompt: str | list[int] = PROMPT) -> httpx.Response:
        headers = {"x-tierline-tier": tier} if tier else {}
        body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
        return httpx.post(f"{self.edge_url}/v1/completions", json=body, headers=headers, timeout=60)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, tiny_zoo: Path, session_data_dir: Path) -> Iterator[World]:
    data = seed_data_dir(tmp_path_factory.mktemp("own-models"), tiny_zoo, session_data_dir)
    work = tmp_path_factory.mktemp("acme")
    _checkpoint(work / "checkpoint", ZooLayout(tiny_zoo).artifact_dir("lm-edge"))
    source = {"name": f"{TEAM}@1", "sha256": "0" * 64}
    artifact = _export(work / "checkpoint", work / "out" / "artifacts" / RELEASE, source)
    _sign(artifact, work / "out" / "manifests", RELEASE, source, data / "keys" / "artifact-signing.ed25519")
    db = migrated_sqlite(data)
    cloud_env = base_env(
        data,
        TIERLINE_DATABASE_URL=db,
        TIERLINE_CLOUD_ZOO_PRESET="tiny",
        TIERLINE_CLOUD_KV_CACHE_MB="16",
        TIERLINE_CLOUD_EDGE_SYNC_INTERVAL_S="0.5",
    )
    state = data / "agent-state"
    agent_env = base_env(data, TIERLINE_EDGE_ZOO_DIR=str(data / "zoo" / "tiny"), TIERLINE_EDGE_STATE_DIR=str(state))

    def cli(*args: str, env: dict[str, str]) -> str:
        proc = run_tierline(*args, env=env)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    cli("tenants", "create", "acme", env=cloud_env)
    token = cli("devices", "enrollment-token", "--tenant", "acme", env=cloud_env)
    cloud_port = free_port()
    with run_server(["cloud", "serve"], cloud_env, cloud_port, timeout=120) as cloud_url:
        cli("edge", "enroll", "--cloud", cloud_url, "--token", token, "--name", "acme-1", env=agent_env)
        checkpoint = ZooLayout(data / "zoo" / "tiny").artifact_dir("lm-edge")
        for release in (artifact, checkpoint):  # a checkpoint too: no device runtime reads it, none downloads it
            published = CliRunner().invoke(publish_command, [str(release)], env={"TIERLINE_DATA_DIR": str(data)})
            assert published.exit_code == 0, published.output
        w = World(data, state, cloud_url, "", db, artifact)
        w.pair("tierline/lm-cloud")
        with run_server(["edge", "run"], agent_env, free_port(), timeout=120) as edge_url:
            w.edge_url = edge_url
            yield w


def _models(w: World) -> dict[str, Any]:
    resp = httpx.get(f"{w.edge_url}/v1/models", timeout=10)
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


def test_a_team_release_is_installed_and_answered_under_its_name_and_alias(world: World) -> None:
    def both_listed() -> dict[str, Any] | None:
        listed = _models(world)
        return listed if {RELEASE, TEAM} <= _ids(listed) else None

    listed = world.wait_for("the team's model and its alias", both_listed)
    alias = next(m for m in listed["data"] if m["id"] == TEAM)
    guard = alias["runtime_guard"]
    assert guard["reference"] == f"{REFERENCE_FILE} ({TEAM}@1)" and guard["chosen"] == "onnx"
    (onnx,) = guard["candidates"]
    assert onnx["eligible"] and onnx["agreement"] == 1.0  # the export gives the checkpoint's own greedy answers
    for model in (RELEASE, TEAM):
        resp = world.complete(model, "local-only")
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-tierline-tier"] == "edge" and resp.json()["model"] == model
        assert resp.json()["usage"]["completion_tokens"] == 4
    # The zoo's models are served as before, under the same ids.
    assert {"tierline/lm-edge", "tierline/lm-edge-onnx", "tierline/lm-edge-onnx-int8"} <= _ids(listed)


def _ids(listed: dict[str, Any]) -> set[str]:
    return {m["id"] for m in listed["data"]}


def test_a_pairing_received_at_sync_routes_a_forced_escalation(world: World) -> None:
    paired = {"cloud_model": "tierline/lm-cloud", "resend": "as-sent"}
    world.wait_for("the pairing", lambda: world.pairing(RELEASE) == paired)
    for model in (RELEASE, TEAM):
        resp = world.complete(model, "cloud-only")
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-tierline-tier"] == "cloud" and resp.json()["model"] == "tierline/lm-cloud"
        assert "x-tierline-escalation" not in resp.headers
    saved = json.loads((world.state / "pairings.json").read_text())  # kept for a restart while offline
    assert {"model": RELEASE, **paired} in saved


def test_resend_text_sends_a_token_id_prompt_up_as_the_text_it_reads(world: World) -> None:
    """Token ids, one per character of "def main": as sent, the cloud reads eight tokens; as text, it encodes the
    text itself into the three it would choose."""
    tokenizer = json.loads((world.team_artifact / "tokenizer.json").read_text())["model"]["vocab"]
    ids = [tokenizer[c if c != " " else "Ġ"] for c in "def main"]
    world.wait_for("the pairing", lambda: world.pairing(RELEASE) is not None)
    as_sent = world.complete(TEAM, "cloud-only", ids)
    assert as_sent.status_code == 200 and as_sent.json()["usage"]["prompt_tokens"] == len(ids), as_sent.text
    world.pair("tierline/lm-cloud", resend="text")
    try:
        world.wait_for("resend text", lambda: (world.pairing(RELEASE) or {}).get("resend") == "text")
        as_text = world.complete(TEAM, "cloud-only", ids)
        assert as_text.status_code == 200, as_text.text
        assert as_text.headers["x-tierline-tier"] == "cloud" and as_text.json()["usage"]["prompt_tokens"] == 3
    finally:
        world.pair("tierline/lm-cloud")


def test_a_model_without_a_pair_answers_locally_and_says_so(world: World) -> None:
    # The zoo's LM is not a release this cloud sends a pairing for: it has none.
    resp = world.complete("tierline/lm-edge", "local-first")
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-tierline-tier"] == "edge" and resp.headers["x-tierline-escalation"] == "unpaired"
    refused = world.complete("tierline/lm-edge", "cloud-only")
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == "no_cloud_pair" and "tierline/lm-edge" in error["message"]
    # Unpaired in the registry: the next sync says so, and the team's model stops escalating too.
    world.pair(None)
    unpaired = {"cloud_model": None, "resend": "as-sent"}
    world.wait_for("the unpairing", lambda: world.pairing(RELEASE) == unpaired)
    resp = world.complete(TEAM)
    assert resp.status_code == 200 and resp.headers["x-tierline-escalation"] == "unpaired"
    assert world.complete(TEAM, "cloud-only").status_code == 400


def test_a_release_no_runtime_here_can_run_is_not_downloaded_and_says_why(world: World) -> None:
    def unrunnable() -> list[dict[str, Any]]:
        engine = create_engine(world.db)
        with Session(engine) as s:
            events = [e.payload for e in s.exec(select(DeviceEvent).where(DeviceEvent.kind == "event"))]
        engine.dispose()
        return [e for e in events if e.get("type") == "update.unrunnable" and e.get("model") == "lm-edge"]

    (event,) = world.wait_for("the device's word on the checkpoint release", unrunnable)
    assert "no runtime for a causal-lm model in hf-safetensors" in event["reason"]
    assert not (world.state / "staging" / "lm-edge").exists() and not (world.state / "models" / "lm-edge").exists()
    assert "hf-safetensors" in _models(world)["not_served"]["lm-edge"]


def test_an_export_that_differs_from_its_reference_answers_is_not_served(world: World, tmp_path: Path) -> None:
    """The same export, with reference answers the checkpoint did not give (each greedy token shifted by one):
    the runtime guard checks the fp32 export against them, refuses it, and serves nothing of the model."""
    altered = tmp_path / "artifact"
    shutil.copytree(world.team_artifact, altered)
    answers = ReferenceAnswers.read(altered)
    assert answers is not None
    vocab = json.loads((altered / "config.json").read_text())["vocab_size"]
    for p in answers.prompts:
        p.greedy[:] = [(t + 1) % vocab for t in p.greedy]
    (altered / REFERENCE_FILE).write_text(answers.to_json())
    key_path = world.data / "keys" / "artifact-signing.ed25519"
    manifest_path = _sign(altered, tmp_path / "manifests", RELEASE, {"name": f"{TEAM}@1", "sha256": "0" * 64}, key_path)
    store = ModelStore(tmp_path / "device")
    store.install(RELEASE, "1", altered, read_manifest(manifest_path))
    store.activate(RELEASE, "1")
    served = ServedModels(tmp_path / "no-zoo", store, [load_public_key(public_path(key_path))], 1)
    choice = served.guards[TEAM]
    assert choice.chosen is None and choice.reference == f"{REFERENCE_FILE} ({TEAM}@1)"
    (onnx,) = choice.candidates
    assert not onnx.eligible and onnx.agreement is not None and onnx.agreement < 1.0
    assert "below the bound" in (onnx.reason or "")
    assert not served.lms.has(RELEASE) and not served.lms.has(TEAM)
    refused = served.not_served()
    assert "runtime guard" in refused[TEAM] and "runtime guard" in refused[RELEASE]


def test_an_unsafe_name_is_refused_and_shown(world: World, tmp_path: Path) -> None:
    key_path = world.data / "keys" / "artifact-signing.ed25519"
    keys = [load_public_key(public_path(key_path))]
    store = ModelStore(tmp_path / "device")
    served = ServedModels(tmp_path / "no-zoo", store, keys, 1)
    with httpx.Client(base_url=world.cloud_url) as client:
        updater = Updater(client, store, tmp_path / "staging", keys, 1 << 30, lambda kind, payload: None)
        bad = DesiredModel(name="../evil", version="1", sha256="0" * 64, manifest_url="/v1/edge/x")
        assert updater.apply(bad) == "rejected"
    served.reject(bad.name, updater.reasons[bad.name])
    assert "letters, digits" in served.not_served()["../evil"]

"""A team's own checkpoints through the registry: what serves them is decided at push (CLI and API), an
architecture nothing here runs is refused naming the supported ones (unless an upstream serves it), a fresh data
dir is migrated by the CLI, the cloud serves every registry model by default and says why one failed to load,
``tierline engine serve`` refuses in one line, and an edge model's cloud pair reaches devices at sync."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from sqlmodel import Session, col, select

from cloud.edge.releases import ReleaseStore
from console.management_api import create_token
from controlplane.fleet.devices import create_enrollment_token
from controlplane.registry.artifacts import push_path
from controlplane.registry.store import LocalArtifactStore
from controlplane.storage.database import create_db
from controlplane.storage.tables import AuditLog, ModelArtifact
from controlplane.tenancy.service import create_api_key, create_tenant
from shared.architectures import supported_list
from shared.artifacts import FileEntry, Manifest, load_or_create_signing_key, sha256_file, sign_manifest
from tests.conftest import base_env, free_port, migrated_sqlite, run_server
from tests.forkserver import run_tierline
from tests.integration.console_support import Console, console_server
from tests.integration.test_registry import make_checkpoint

pytestmark = pytest.mark.integration

SUPPORTED = supported_list("engine")
SPEC = {"backend": "openai", "endpoints": ["http://10.0.0.9:9/v1"], "upstream_model": "neox-upstream"}


def random_checkpoint(out: Path, model_type: str, tokenizer_from: Path) -> Path:
    """A random-initialised transformers checkpoint of ``model_type`` (hidden 64, 2 layers), with a tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
    extra = {"num_key_value_heads": 2, "head_dim": 16} if model_type != "gpt_neox" else {}
    config = AutoConfig.for_model(model_type, vocab_size=320, max_position_embeddings=128, **shape, **extra)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, out / name)
    return out


@dataclass
class Checkpoints:
    llama: Path
    edge: Path
    qwen3: Path
    gemma2: Path
    neox: Path
    no_model_type: Path
    broken: Path  # a Llama checkpoint without its tokenizer: pushed fine, the engine cannot load it


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    tmp = tmp_path_factory.mktemp("own-models")
    llama = make_checkpoint(tmp / "llama")
    edge = make_checkpoint(tmp / "edge", seed=1)
    no_model_type = tmp / "no-model-type"
    shutil.copytree(llama, no_model_type)
    config = json.loads((no_model_type / "config.json").read_text())
    del config["model_type"]
    (no_model_type / "config.json").write_text(json.dumps(config))
    broken = tmp / "broken"
    shutil.copytree(llama, broken)
    (broken / "tokenizer.json").unlink()
    return Checkpoints(
        llama=llama,
        edge=edge,
        qwen3=random_checkpoint(tmp / "qwen3", "qwen3", llama),
        gemma2=random_checkpoint(tmp / "gemma2", "gemma2", llama),
        neox=random_checkpoint(tmp / "neox", "gpt_neox", llama),
        no_model_type=no_model_type,
        broken=broken,
    )


def run_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return run_tierline(*args, env=env)


def test_cli_push_on_a_fresh_data_dir_says_what_serves_it_and_refuses_what_nothing_serves(
    checkpoints: Checkpoints, tmp_path: Path
) -> None:
    env = base_env(tmp_path / "data")  # never migrated: the CLI migrates its embedded SQLite database itself

    qwen3 = run_cli(env, "models", "push", str(checkpoints.qwen3), "--name", "acme-qwen3")
    assert qwen3.returncode == 0, qwen3.stderr
    assert "migrated the database" in qwen3.stderr
    assert "qwen3: served by the engine; edge formats onnx, onnx-int8, tflite, gguf" in qwen3.stdout
    gemma2 = run_cli(env, "models", "push", str(checkpoints.gemma2), "--name", "acme-gemma2")
    assert gemma2.returncode == 0, gemma2.stderr
    assert "gemma2: served by the engine; edge formats onnx, onnx-int8, tflite, gguf" in gemma2.stdout
    assert "migrated" not in gemma2.stderr  # once is enough

    neox = run_cli(env, "models", "push", str(checkpoints.neox), "--name", "acme-neox")
    assert neox.returncode == 1
    lines = neox.stderr.strip().splitlines()
    assert len(lines) == 1, neox.stderr
    assert "architecture gpt_neox is not supported by the tierline engine" in lines[0]
    assert f"supported: {SUPPORTED}" in lines[0]
    missing = run_cli(env, "models", "push", str(checkpoints.no_model_type), "--name", "acme-unknown")
    assert missing.returncode == 1
    assert missing.stderr.strip().splitlines() == [
        f"error: config.json has no model_type; the tierline engine serves: {SUPPORTED}. To have an upstream "
        "OpenAI-compatible server answer it, push it with a serving spec"
    ]
    listed = run_cli(env, "models", "list")
    assert {line.split("\t")[0] for line in listed.stdout.splitlines()} == {"acme-qwen3", "acme-gemma2"}

    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SPEC))
    upstream = run_cli(env, "models", "push", str(checkpoints.neox), "--name", "acme-neox", "--serving", str(spec))
    assert upstream.returncode == 0, upstream.stderr
    assert "gpt_neox: served by its upstream only; edge formats none" in upstream.stdout
    shown = json.loads(run_cli(env, "models", "show", "acme-neox").stdout)
    assert shown["versions"][0]["servable_by"] == ["upstream"]
    qwen = json.loads(run_cli(env, "models", "show", "acme-qwen3").stdout)
    assert qwen["versions"][0]["servable_by"] == ["engine", "onnx", "onnx-int8", "tflite", "gguf"]


@pytest.mark.postgres
def test_cli_on_an_unmigrated_postgresql_database_names_the_command_in_one_line(tmp_path: Path) -> None:
    from tests.conftest import PG_URL, _postgres_schema

    if not PG_URL:
        pytest.skip("PostgreSQL not configured: set TIERLINE_TEST_DATABASE_URL")
    with _postgres_schema() as url:
        proc = run_cli(base_env(tmp_path, TIERLINE_DATABASE_URL=url), "models", "list")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].endswith("run `tierline db upgrade` first")


def test_engine_serve_on_an_unsupported_or_broken_checkpoint_exits_with_one_line(checkpoints: Checkpoints) -> None:
    env = base_env(checkpoints.neox.parent / "engine-data", TIERLINE_CLOUD_KV_CACHE_MB="8")
    port = str(free_port())
    neox = run_cli(env, "engine", "serve", "--model", str(checkpoints.neox), "--port", port)
    assert neox.returncode == 1
    assert neox.stderr.strip().splitlines() == [
        f"error: {checkpoints.neox}: architecture gpt_neox is not supported by the tierline engine; "
        f"supported: {SUPPORTED}"
    ]
    broken = run_cli(env, "engine", "serve", "--model", str(checkpoints.broken), "--port", port)
    assert broken.returncode == 1
    assert "Traceback" not in broken.stderr
    assert broken.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "tokenizer.json" in broken.stderr.strip().splitlines()[-1]


# --- the management API and the console ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def console(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Console, str]]:
    with console_server(tmp_path_factory.mktemp("own-models-console"), "sqlite") as running:
        with Session(running.engine) as s:
            from console.passwords import create_user

            create_user(s, "ops", "correct horse battery", "admin")
            token = create_token(s, "ops").secret
            s.commit()
        yield running, token


def push(console: tuple[Console, str], name: str, ckpt: Path, **data: str) -> httpx.Response:
    running, token = console
    files = [("file", (p.name, p.read_bytes())) for p in sorted(ckpt.iterdir())]
    return httpx.post(
        f"{running.url}/api/models/{name}/versions",
        files=files,
        data=data,
        headers={"Authorization": f"Bearer {token}"},
        timeout=60,
    )


def test_api_push_says_what_serves_a_version_and_refuses_an_unsupported_architecture(
    checkpoints: Checkpoints, console: tuple[Console, str]
) -> None:
    qwen3 = push(console, "api-qwen3", checkpoints.qwen3)
    assert qwen3.status_code == 201, qwen3.text
    assert qwen3.json()["servable_by"] == ["engine", "onnx", "onnx-int8", "tflite", "gguf"]
    assert qwen3.json()["served_by"] == "qwen3: served by the engine; edge formats onnx, onnx-int8, tflite, gguf"

    refused = push(console, "api-neox", checkpoints.neox)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert "architecture gpt_neox is not supported by the tierline engine" in error["message"]
    assert f"supported: {SUPPORTED}" in error["message"]
    assert error["param"] == "config.json"
    garbled = checkpoints.neox.parent / "garbled"
    shutil.copytree(checkpoints.llama, garbled)
    (garbled / "config.json").write_text("{not json")
    unparsable = push(console, "api-garbled", garbled)
    assert unparsable.status_code == 400
    assert unparsable.json()["error"]["message"].startswith("config.json is not JSON")

    upstream = push(console, "api-neox", checkpoints.neox, serving=json.dumps(SPEC))
    assert upstream.status_code == 201, upstream.text
    assert upstream.json()["served_by"] == "gpt_neox: served by its upstream only; edge formats none"
    assert upstream.json()["serving"]["upstream_model"] == "neox-upstream"


def test_pairing_through_the_api_shows_on_the_model_page(
    checkpoints: Checkpoints, console: tuple[Console, str]
) -> None:
    running, token = console
    assert push(console, "pair-cloud", checkpoints.llama).status_code == 201
    assert push(console, "pair-edge", checkpoints.edge).status_code == 201
    auth = {"Authorization": f"Bearer {token}"}
    with running.signed_in() as browser:
        assert "Answers locally (no cloud pair)" in browser.get("/models/pair-edge").text
        paired = httpx.put(
            f"{running.url}/api/models/pair-edge/pairing", json={"cloud_model": "pair-cloud"}, headers=auth
        )
        assert paired.status_code == 200, paired.text
        # Both checkpoints' tokenizers were trained on the same text: one vocabulary, so requests go up as sent.
        assert paired.json()["pairing"] == {"cloud_model": "pair-cloud", "resend": "as-sent"}
        assert "Escalates to: pair-cloud (resend: as-sent)" in browser.get("/models/pair-edge").text
        unknown = httpx.put(f"{running.url}/api/models/pair-edge/pairing", json={"cloud_model": "nope"}, headers=auth)
        assert unknown.status_code == 404
        assert "no registry model named 'nope'" in unknown.json()["error"]["message"]
        cleared = httpx.put(f"{running.url}/api/models/pair-edge/pairing", json={"cloud_model": None}, headers=auth)
        assert cleared.status_code == 200
        assert "Answers locally (no cloud pair)" in browser.get("/models/pair-edge").text
    with Session(running.engine) as s:
        rows = s.exec(
            select(AuditLog.after).where(
                col(AuditLog.target) == "model/pair-edge", col(AuditLog.action) == "model.pair"
            )
        ).all()
    assert rows == [{"cloud_model": "pair-cloud", "resend": "as-sent"}, {"cloud_model": None, "resend": None}]


# --- the cloud: every registry model by default; failures visible; pairings at sync --------------------------------


@dataclass
class Cloud:
    url: str
    env: dict[str, str]
    key: str
    device_token: str

    def complete(self, model: str) -> httpx.Response:
        body = {"model": model, "prompt": "def f(x):", "max_tokens": 2, "temperature": 0}
        return httpx.post(
            f"{self.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {self.key}"}, timeout=60
        )


def publish_edge_release(data: Path, db_url: str, name: str) -> None:
    """An edge release named ``name`` (its files stand in for an export; no device installs it here)."""
    release = data / "release" / name
    release.mkdir(parents=True)
    (release / "edge_model.json").write_text(json.dumps({"format": "onnx-int8"}))
    (release / "model.onnx").write_bytes(b"stand-in")
    files = [FileEntry(p.name, p.stat().st_size, sha256_file(p)) for p in sorted(release.iterdir())]
    manifest = Manifest(name=name, version="1", kind="causal-lm", format="onnx-int8", files=files)
    key = load_or_create_signing_key(data / "keys" / "artifact-signing.ed25519")
    sign_manifest(manifest, key)
    db = create_db(db_url)
    try:
        store = ReleaseStore(db, LocalArtifactStore(data / "artifacts"), trusted_keys=[key.public_key()])
        store.publish_manifest(release, manifest, actor="test")
    finally:
        db.dispose()


@pytest.fixture(scope="module")
def cloud(checkpoints: Checkpoints, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cloud]:
    data = tmp_path_factory.mktemp("own-models-cloud")
    db_url = migrated_sqlite(data)
    store = LocalArtifactStore(data / "artifacts")
    key = load_or_create_signing_key(data / "keys" / "artifact-signing.ed25519")
    db = create_db(db_url)
    with Session(db) as s:
        for name, ckpt in (("acme-cloud", checkpoints.llama), ("acme-edge", checkpoints.edge)):
            push_path(s, store, ckpt, name=name, alias="stable", actor="test", signing_key=key)
        push_path(s, store, checkpoints.broken, name="acme-broken", alias="stable", actor="test", signing_key=key)
        tenant = create_tenant(s, "acme")
        api_key = create_api_key(s, tenant).secret
        enrollment = create_enrollment_token(s, tenant, labels={}, ttl=timedelta(minutes=10)).secret
        s.commit()
    db.dispose()
    publish_edge_release(data, db_url, "acme-edge-onnx-int8")
    env = base_env(  # no TIERLINE_CLOUD_REGISTRY_MODELS: every registry model is served
        data,
        TIERLINE_DATABASE_URL=db_url,
        TIERLINE_CLOUD_KV_CACHE_MB="8",
        TIERLINE_CLOUD_SPECULATION="off",
        TIERLINE_CLOUD_CANARY_REFRESH_S="0.3",
    )
    with run_server(["cloud", "serve"], env, free_port(), timeout=120) as url:
        enrolled = httpx.post(f"{url}/v1/edge/enroll", json={"token": enrollment, "name": "own-models-1"})
        assert enrolled.status_code == 200, enrolled.text
        yield Cloud(url, env, api_key, enrolled.json()["device_token"])


def until_not_loading(cloud: Cloud, model: str, timeout: float = 180.0) -> httpx.Response:
    """The first answer that is not 503 ``model_loading`` (a version loads at its first request)."""
    deadline = time.monotonic() + timeout
    while True:
        resp = cloud.complete(model)
        if resp.status_code != 503 or resp.json()["error"]["code"] != "model_loading":
            return resp
        assert "retry-after" in resp.headers
        assert time.monotonic() < deadline, resp.text
        time.sleep(0.3)


def test_a_stable_version_is_served_without_naming_it(cloud: Cloud) -> None:
    listed = httpx.get(f"{cloud.url}/v1/models", headers={"Authorization": f"Bearer {cloud.key}"}).json()["data"]
    assert {"acme-cloud", "acme-edge"} <= {m["id"] for m in listed}
    answer = until_not_loading(cloud, "acme-cloud")
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-tierline-model-version"] == "1"
    assert answer.json()["usage"]["completion_tokens"] >= 1
    assert cloud.complete("acme-cloud@stable").status_code == 200  # an alias names the loaded version


def test_a_version_that_fails_to_load_is_degraded_and_answers_503_saying_why(cloud: Cloud) -> None:
    answer = until_not_loading(cloud, "acme-broken")
    assert answer.status_code == 503, answer.text
    error = answer.json()["error"]
    assert error["code"] == "model_unavailable"
    assert "failed to load" in error["message"] and "tokenizer.json" in error["message"]
    ready = httpx.get(f"{cloud.url}/readyz")
    assert ready.status_code == 200  # every other model still serves
    degraded = ready.json()["degraded"]
    assert len(degraded) == 1 and degraded[0].startswith("acme-broken@1: ") and "tokenizer.json" in degraded[0]
    assert "\n" not in degraded[0]
    assert cloud.complete("acme-nothing").status_code == 404  # a name nobody pushed is still a 404


def test_a_pairing_set_by_the_cli_reaches_the_devices_sync(cloud: Cloud) -> None:
    def pairings() -> list[dict[str, object]]:
        resp = httpx.post(
            f"{cloud.url}/v1/edge/sync", json={}, headers={"Authorization": f"Bearer {cloud.device_token}"}
        )
        assert resp.status_code == 200, resp.text
        assert "acme-edge-onnx-int8" in {d["name"] for d in resp.json()["desired"]}
        return list(resp.json()["pairings"])

    assert pairings() == [{"model": "acme-edge-onnx-int8", "cloud_model": None, "resend": "as-sent"}]
    paired = run_cli(cloud.env, "models", "pair", "acme-edge", "acme-cloud", "--resend", "text")
    assert paired.returncode == 0, paired.stderr
    assert paired.stdout.strip() == "acme-edge: Escalates to: acme-cloud (resend: text)"
    # the release sent, and every paired registry model (a device may hold one it was never sent)
    assert pairings() == [
        {"model": "acme-edge", "cloud_model": "acme-cloud", "resend": "text"},
        {"model": "acme-edge-onnx-int8", "cloud_model": "acme-cloud", "resend": "text"},
    ]
    by_default = run_cli(cloud.env, "models", "pair", "acme-edge", "acme-cloud")
    assert by_default.stdout.strip() == "acme-edge: Escalates to: acme-cloud (resend: as-sent)"  # one vocabulary
    assert run_cli(cloud.env, "models", "pair", "acme-edge", "--none").returncode == 0
    assert pairings() == [{"model": "acme-edge-onnx-int8", "cloud_model": None, "resend": "as-sent"}]
    wrong_kind = run_cli(cloud.env, "models", "pair", "acme-edge", "nope")
    assert wrong_kind.returncode == 1
    assert wrong_kind.stderr.strip().splitlines() == [
        "error: no registry model named 'nope' (a model of the built zoo is named tierline/NAME)"
    ]


def test_seeding_pairs_the_zoos_edge_models_once(
    checkpoints: Checkpoints, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from controlplane.registry import service as registry
    from controlplane.registry.artifacts import platform_signing_key
    from controlplane.registry.store import store_from_settings
    from controlplane.storage.session import session_scope
    from tierline.seed import Seeded, seed_pairings

    monkeypatch.setenv("TIERLINE_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("TIERLINE_DATABASE_URL", raising=False)
    monkeypatch.delenv("TIERLINE_ARTIFACT_STORE", raising=False)
    migrated_sqlite(tmp_path)
    store, key = store_from_settings(), platform_signing_key()
    with session_scope() as s:
        for name, ckpt in (("lm-cloud", checkpoints.llama), ("lm-edge", checkpoints.edge)):
            push_path(s, store, ckpt, name=name, alias="stable", actor="test", signing_key=key)
    first = Seeded()
    seed_pairings(first)
    assert first.created == ["pair lm-edge -> tierline/lm-cloud (as-sent)"]  # the zoo engine, one vocabulary
    with session_scope() as s:
        edge = registry.get_model(s, "lm-edge")
        assert registry.pairing_line(edge) == "Escalates to: tierline/lm-cloud (resend: as-sent)"
        registry.set_pairing(s, edge, None, resend="as-sent", actor="operator")  # an operator's choice stays
    again = Seeded()
    seed_pairings(again)
    assert again.created == []
    with session_scope() as s:
        assert registry.get_model(s, "lm-edge").cloud_model is None


def sentencepiece_only(llama: Path, out: Path) -> Path:
    """``llama`` with a SentencePiece ``tokenizer.model`` in place of its tokenizer.json (as many Llama, Mistral and
    Gemma checkpoints ship), trained here."""
    sentencepiece = pytest.importorskip("sentencepiece", reason="sentencepiece converts tokenizer.model here")
    shutil.copytree(llama, out)
    (out / "tokenizer.json").unlink()
    corpus = out.parent / f"{out.name}-corpus.txt"
    corpus.write_text("\n".join(f"line {i}: the quick brown fox jumps over {i * 7} lazy dogs" for i in range(400)))
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(out / "tokenizer"), vocab_size=320, model_type="bpe",
        byte_fallback=True, bos_id=1, eos_id=2, unk_id=0, minloglevel=2,
    )  # fmt: skip
    (out / "tokenizer.vocab").unlink()
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def test_a_sentencepiece_only_checkpoint_gets_the_tokenizer_json_transformers_converts(
    checkpoints: Checkpoints, console: tuple[Console, str], tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    from shared.chat_tokenizer import ChatTokenizer

    source = sentencepiece_only(checkpoints.llama, tmp_path / "sp-llama")
    pushed = push(console, "api-sp-llama", source)
    assert pushed.status_code == 201, pushed.text
    running, _ = console
    with Session(running.engine) as s:
        row = s.get(ModelArtifact, pushed.json()["artifacts"][0]["id"])
        assert row is not None and row.manifest is not None
        files = {f["path"]: f["sha256"] for f in row.manifest["files"]}
    assert {"tokenizer.model", "tokenizer.json"} <= set(files)
    assert not (source / "tokenizer.json").exists()  # converted beside the upload, the source left as it was
    sha = files["tokenizer.json"]
    blob = next(p for p in running.data_dir.rglob(sha) if p.is_file())  # the content-addressed store holds it
    probe = tmp_path / "probe"
    probe.mkdir()
    shutil.copy(blob, probe / "tokenizer.json")
    shutil.copy(source / "tokenizer_config.json", probe / "tokenizer_config.json")
    expected = AutoTokenizer.from_pretrained(str(source))  # transformers on the SentencePiece files alone
    tok = ChatTokenizer(probe)
    for text in ("the quick brown fox", "line 12: lazy dogs", "Zürich"):
        assert tok.encode(text) == expected(text)["input_ids"], text

"""The registry service on SQLite and PostgreSQL (numbers under concurrent pushes, atomic aliases, status, audit,
signed manifests in the artifact store) and ``tierline models`` as a user runs it."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from sqlmodel import Session, col, select

from controlplane.registry import artifacts as registry_artifacts
from controlplane.registry import service as registry
from controlplane.registry.cli import models
from controlplane.registry.store import LocalArtifactStore
from controlplane.storage.database import create_db
from controlplane.storage.session import session_scope
from controlplane.storage.tables import AuditLog
from shared.artifacts import FileEntry, Manifest, load_or_create_signing_key, verify_signature
from shared.errors import ConflictError, ValidationError
from tests.conftest import base_env, migrated_sqlite
from tests.forkserver import run_tierline

pytestmark = pytest.mark.integration

ACTOR = "test:ops"


def make_checkpoint(out: Path, *, crush_int8: bool = False, seed: int = 0) -> Path:
    """A tiny random Llama checkpoint in the HF layout (tokenizer included), made in well under a second.

    ``crush_int8``: one huge weight per matrix, so per-tensor INT8 rounds the others to nothing and INT8's
    next-token choices drift from fp32's.
    """
    import inspect

    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    from shared.zoo.presets import TINY, LMShape
    from shared.zoo.tokenizer import save_tokenizer, train_tokenizer
    from shared.zoo.train_lm import llama_config, save_lm

    tok_dir = out.with_name(out.name + "-tokenizer")
    save_tokenizer(train_tokenizer([inspect.getsource(json)] * 2, 300), tok_dir, 128)
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    torch.manual_seed(seed)
    preset = dataclasses.replace(TINY, vocab_size=tok.get_vocab_size(), max_position_embeddings=128)
    model = LlamaForCausalLM(llama_config(preset, LMShape(32, 2, 4, 2, 64), tok))
    if crush_int8:
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim == 2:
                    p[0, 0] = 100.0 * p.abs().max()
    save_lm(model, tok_dir, out, torch.float32)
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "lm")


def audit(engine_url: str, target_prefix: str) -> list[tuple[str, str]]:
    engine = create_db(engine_url)
    with Session(engine) as s:
        rows = s.exec(
            select(AuditLog.action, AuditLog.target)
            .where(col(AuditLog.target).startswith(target_prefix))
            .order_by(col(AuditLog.id))
        )
        out = [(a, t) for a, t in rows]
    engine.dispose()
    return out


def test_concurrent_pushes_get_consecutive_version_numbers(migrated_db: str) -> None:
    engine = create_db(migrated_db)
    with session_scope(engine) as s:
        registry.create_model(s, "race", "causal-lm", actor=ACTOR)
    errors: list[BaseException] = []
    barrier = threading.Barrier(6)

    def push() -> None:
        barrier.wait()
        for _ in range(4):
            try:
                with session_scope(engine) as s:
                    model = registry.get_model(s, "race")
                    registry.register_version(s, model, source="race", actor=ACTOR)
            except BaseException as exc:  # collected and asserted below
                errors.append(exc)

    threads = [threading.Thread(target=push) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with Session(engine) as s:
        numbers = [v.number for v in registry.list_versions(s, registry.get_model(s, "race"))]
    assert numbers == list(range(1, 25))
    registered = [a for a, _ in audit(migrated_db, "model/race/") if a == "model.version.register"]
    assert len(registered) == 24
    engine.dispose()


def test_an_alias_moves_in_one_step_and_readers_always_see_a_version(migrated_db: str) -> None:
    engine = create_db(migrated_db)
    with session_scope(engine) as s:
        model = registry.create_model(s, "aliased", "tensor", actor=ACTOR)
        for _ in range(3):
            registry.register_version(s, model, actor=ACTOR)
        registry.move_alias(s, model, "stable", 1, actor=ACTOR)
    seen: list[int | None] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            with Session(engine) as s:
                seen.append(registry.aliases_of(s, registry.get_model(s, "aliased")).get("stable"))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(30):
            with session_scope(engine) as s:
                registry.move_alias(s, registry.get_model(s, "aliased"), "stable", 1 + i % 2 + 1, actor=ACTOR)
    finally:
        done.set()
        reader.join()
    assert seen and set(seen) <= {1, 2, 3} and None not in seen
    with session_scope(engine) as s:
        model = registry.get_model(s, "aliased")
        assert registry.aliases_of(s, model) == {"stable": 3}
        registry.move_alias(s, model, "canary", 2, actor=ACTOR)
        assert registry.aliases_of(s, model) == {"canary": 2, "stable": 3}
        assert registry.resolve(s, "aliased", "canary").number == 2
        assert registry.resolve(s, "aliased", "1").number == 1
    with session_scope(engine) as s, pytest.raises(ValidationError) as bad:
        registry.move_alias(s, registry.get_model(s, "aliased"), "no spaces", 1, actor=ACTOR)
    assert bad.value.param == "alias"
    engine.dispose()
    moves = [a for a, _ in audit(migrated_db, "model/aliased") if a == "model.alias.move"]
    assert len(moves) == 32


def test_status_moves_forward_only_and_is_audited(migrated_db: str) -> None:
    engine = create_db(migrated_db)
    with session_scope(engine) as s:
        model = registry.create_model(s, "lifecycle", "causal-lm", actor=ACTOR)
        registry.register_version(s, model, label="rc1", tags=["nightly"], actor=ACTOR)
    with session_scope(engine) as s, pytest.raises(ConflictError) as skipped:
        registry.set_status(s, registry.get_model(s, "lifecycle"), 1, "active", actor=ACTOR)
    assert skipped.value.param == "status" and "registered; it cannot become active" in skipped.value.message
    with session_scope(engine) as s:
        model = registry.get_model(s, "lifecycle")
        for status in ("validated", "active"):
            registry.set_status(s, model, 1, status, actor=ACTOR, reason="benchmarks pass")
        registry.move_alias(s, model, "stable", 1, actor=ACTOR)
        v = registry.tag_version(s, model, 1, add=["prod"], remove=["nightly"], actor=ACTOR)
        assert v.tags == ["prod"]
        registry.set_status(s, model, 1, "retired", actor=ACTOR)
    with session_scope(engine) as s, pytest.raises(ConflictError, match="retired"):
        registry.move_alias(s, registry.get_model(s, "lifecycle"), "canary", 1, actor=ACTOR)
    with session_scope(engine) as s, pytest.raises(ConflictError):
        registry.create_model(s, "lifecycle", "tensor", actor=ACTOR)
    engine.dispose()
    assert [a for a, _ in audit(migrated_db, "model/lifecycle")] == [
        "model.create",
        "model.version.register",
        "model.version.status",
        "model.version.status",
        "model.alias.move",
        "model.version.tags",
        "model.version.status",
    ]


def test_a_pushed_checkpoint_is_stored_once_signed_and_comes_back_intact(
    migrated_db: str, checkpoint: Path, tmp_path: Path
) -> None:
    engine = create_db(migrated_db)
    store = LocalArtifactStore(tmp_path / "artifacts")
    key = load_or_create_signing_key(tmp_path / "keys" / "signing.ed25519")
    with session_scope(engine) as s:
        first = registry_artifacts.push_path(
            s, store, checkpoint, name="tiny-lm", label="rc1", tags=["a"], alias="canary", actor=ACTOR, signing_key=key
        )
        manifest = Manifest.from_json(json.dumps(first.artifact.manifest))
        assert (first.artifact.target, first.artifact.format, first.model.kind) == (
            "cloud",
            "hf-safetensors",
            "causal-lm",
        )
        assert first.artifact.sha256 == manifest.sha256 and first.artifact.size == manifest.size
        assert sorted(e.path for e in manifest.files) == sorted(p.name for p in checkpoint.iterdir())
    verify_signature(manifest, [key.public_key()])
    blobs = sum(1 for p in (store.root / "sha256").rglob("*") if p.is_file())
    with session_scope(engine) as s:  # the same bytes again: a new version, no new file blobs
        second = registry_artifacts.push_path(s, store, checkpoint, name="tiny-lm", actor=ACTOR, signing_key=key)
        assert second.version.number == 2 and second.artifact.sha256 == first.artifact.sha256
    assert sum(1 for p in (store.root / "sha256").rglob("*") if p.is_file()) == blobs + 1  # its manifest only
    out = registry_artifacts.materialize(store, first.artifact, tmp_path / "restored")
    for p in checkpoint.iterdir():
        assert (out / p.name).read_bytes() == p.read_bytes()

    onnx = tmp_path / "digits.onnx"
    onnx.write_bytes(b"not really onnx, but bytes all the same")
    with session_scope(engine) as s:
        pushed = registry_artifacts.push_path(s, store, onnx, name="digits", actor=ACTOR, signing_key=key)
        assert (pushed.model.kind, pushed.artifact.format) == ("tensor", "onnx")
    with session_scope(engine) as s, pytest.raises(ValidationError) as wrong_kind:
        registry_artifacts.push_path(s, store, onnx, name="tiny-lm", kind="tensor", actor=ACTOR, signing_key=key)
    assert wrong_kind.value.param == "kind"
    with session_scope(engine) as s:  # lineage: an edge version names the cloud version it came from
        model = registry.get_model(s, "tiny-lm")
        v1 = registry.get_version(s, model, 1)
        edge = registry.register_version(s, model, derived_from_id=v1.id, actor=ACTOR)
        assert [v.number for v in registry.lineage(s, edge)] == [1]
        body = registry.model_json(s, model)
        assert body["aliases"] == {"canary": 1}
        assert [(v["number"], v["derived_from"]) for v in body["versions"]] == [(1, None), (2, None), (3, 1)]
        assert body["versions"][0]["artifacts"][0]["signature_key_id"] == manifest.signature["key_id"]  # type: ignore[index]
    engine.dispose()


def test_the_models_commands(tmp_path: Path, checkpoint: Path) -> None:
    data = tmp_path / "data"
    env = base_env(data, TIERLINE_DATABASE_URL=migrated_sqlite(data))

    def run(*args: str, ok: bool = True) -> Result:
        result = CliRunner().invoke(models, list(args), env=env)
        assert (result.exit_code == 0) is ok, result.output
        return result

    pushed = run(
        "push", str(checkpoint), "--name", "tiny-lm", "--label", "rc1", "--tag", "nightly", "--alias", "canary"
    )
    assert pushed.stdout.startswith("registered tiny-lm version 1: cloud hf-safetensors")
    assert "alias canary -> 1" in pushed.stdout
    assert any((data / "artifacts" / "sha256").rglob("*"))  # the default store: the data dir
    run("push", str(checkpoint), "--name", "tiny-lm")
    run("alias", "tiny-lm", "stable", "2")
    run("status", "tiny-lm", "2", "validated", "--reason", "evals pass")
    versions = run("versions", "tiny-lm").stdout.splitlines()
    assert versions[0].startswith("1\tregistered\tcloud:hf-safetensors(ready)\tlabel rc1; aliases canary; tags nightly")
    assert versions[1].startswith("2\tvalidated\tcloud:hf-safetensors(ready)\taliases stable")
    shown = json.loads(run("show", "tiny-lm").stdout)
    assert shown["aliases"] == {"canary": 1, "stable": 2} and shown["latest_version"] == 2
    listed = run("list").stdout
    assert listed.startswith("tiny-lm\tcausal-lm\tversions 2 (latest 2)\tcanary=1,stable=2")

    assert "has no version 9" in str(run("alias", "tiny-lm", "stable", "9", ok=False).exception)
    assert "cannot become active" in str(run("status", "tiny-lm", "1", "active", ok=False).exception)
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "a.txt").write_text("a")
    (junk / "b.txt").write_text("b")
    assert "not an HF checkpoint" in str(run("push", str(junk), "--name", "x", ok=False).exception)
    # As a user sees an error: one line on stderr, exit code 1, no traceback.
    proc = run_tierline("models", "show", "nope", env=env)
    assert proc.returncode == 1 and "no model named 'nope'" in proc.stderr and "Traceback" not in proc.stderr


def test_an_exported_edge_artifact_publishes_to_the_fleet(tmp_path: Path) -> None:
    from cloud.edge.releases import publish_command

    data = tmp_path / "data"
    env = base_env(data, TIERLINE_DATABASE_URL=migrated_sqlite(data))
    edge = tmp_path / "lm-edge-onnx-int8"
    edge.mkdir()
    (edge / "model.onnx").write_bytes(b"int8 graph bytes" * 64)
    (edge / "tokenizer.json").write_text("{}")
    (edge / "edge_model.json").write_text('{"format": "onnx-int8", "io": "growing-kv-cache/v1"}')
    runner = CliRunner()
    pushed = runner.invoke(models, ["push", str(edge), "--name", "tiny-edge", "--alias", "stable"], env=env)
    assert pushed.exit_code == 0, pushed.output
    assert pushed.stdout.startswith("registered tiny-edge version 1: edge onnx-int8")

    out = tmp_path / "export"
    exported = runner.invoke(
        models, ["export", "tiny-edge", "stable", "--format", "onnx-int8", "--out", str(out)], env=env
    )
    assert exported.exit_code == 0, exported.output
    files = out / "artifacts" / "tiny-edge-onnx-int8"  # an LM's edge format is released as NAME-FORMAT
    assert sorted(p.name for p in files.iterdir()) == ["edge_model.json", "model.onnx", "tokenizer.json"]
    assert (files / "model.onnx").read_bytes() == (edge / "model.onnx").read_bytes()
    published = runner.invoke(publish_command, [str(files)], env=env)  # its signature checks with the platform key
    assert published.exit_code == 0, published.output
    assert published.stdout.startswith("published tiny-edge-onnx-int8 1 (3 files")
    from controlplane.registry.store import LocalArtifactStore
    from shared.artifacts import sha256_file

    stored = LocalArtifactStore(data / "artifacts")  # the release's bytes are blobs in the artifact store
    assert stored.read_bytes(sha256_file(files / "model.onnx")) == (edge / "model.onnx").read_bytes()

    again = runner.invoke(models, ["export", "tiny-edge", "1", "--format", "onnx-int8", "--out", str(out)], env=env)
    assert "exists; export somewhere new" in str(again.exception)
    missing = runner.invoke(
        models, ["export", "tiny-edge", "1", "--format", "tflite", "--out", str(tmp_path / "x")], env=env
    )
    assert "has no tflite artifact" in str(missing.exception)
    engine = create_db(env["TIERLINE_DATABASE_URL"])
    with session_scope(engine) as s:  # what the INT8 guard rejected never reaches devices
        model = registry.get_model(s, "tiny-edge")
        version = registry.register_version(s, model, actor=ACTOR)
        registry_artifacts.add_artifact(
            s,
            LocalArtifactStore(data / "artifacts"),
            model,
            version,
            target="edge",
            format="onnx-int8",
            files=[FileEntry("model.onnx", 1, "0" * 64)],
            signing_key=load_or_create_signing_key(data / "keys" / "artifact-signing.ed25519"),
            actor=ACTOR,
            status="rejected",
        )
    engine.dispose()
    rejected = runner.invoke(
        models, ["export", "tiny-edge", "2", "--format", "onnx-int8", "--out", str(tmp_path / "y")], env=env
    )
    assert "is rejected; only a ready one is exported" in str(rejected.exception)


def test_derive_jobs_left_pending_by_a_stopped_console_are_failed(migrated_db: str) -> None:
    from datetime import UTC, datetime, timedelta

    from controlplane.registry.edge_derive import fail_stale_jobs

    engine = create_db(migrated_db)
    with session_scope(engine) as s:
        model = registry.create_model(s, "stale", "causal-lm", actor=ACTOR)
        version = registry.register_version(s, model, actor=ACTOR)
        old = registry_artifacts.add_pending_artifact(s, version, target="edge", format="onnx")
        old.created_at = datetime.now(UTC) - timedelta(hours=2)
        s.add(old)
        registry_artifacts.add_pending_artifact(s, version, target="edge", format="onnx-int8")  # running now
    assert fail_stale_jobs(engine, 3600) == 1
    assert fail_stale_jobs(engine, 3600) == 0
    with Session(engine) as s:
        body = registry.model_json(s, registry.get_model(s, "stale"))
    artifacts = {a["format"]: a for a in body["versions"][0]["artifacts"]}
    assert (artifacts["onnx"]["status"], artifacts["onnx-int8"]["status"]) == ("failed", "pending")
    assert "derive again" in artifacts["onnx"]["error"]
    engine.dispose()
    assert ("model.artifact.fail", "model/stale/1") in audit(migrated_db, "model/stale")

"""The registry's HTTP API on a real console process, with its artifact store in S3 (moto's server on a real
socket): streamed multipart uploads with their size cap and hash check, aliases, status, audit, and edge
artifacts derived from a pushed checkpoint in the background with the INT8 quality guard."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import httpx
import numpy as np
import pytest
from moto.server import ThreadedMotoServer
from sqlmodel import Session, col, select

from console.management_api import create_token
from console.passwords import create_user
from controlplane.registry.store import S3ArtifactStore
from controlplane.storage.database import create_db
from controlplane.storage.tables import AuditLog, ModelArtifact
from shared.artifacts import FileEntry, Manifest, load_public_key, verify_signature
from tests.conftest import base_env, free_port, migrated_sqlite, run_server
from tests.integration.test_edge_derive import make_checkpoint

pytestmark = pytest.mark.integration

BUCKET = "registry"
PREFIX = "blobs"
CAP = 512 * 1024


@dataclass
class Console:
    client: httpx.Client
    token: str
    viewer_token: str
    db_url: str
    data_dir: Path
    store: S3ArtifactStore
    good: Path
    crushed: Path

    def api(self, method: str, path: str, *, token: str | None = "", **kw: Any) -> httpx.Response:
        headers = {} if token is None else {"Authorization": f"Bearer {token or self.token}"}
        headers.update(kw.pop("headers", {}))
        return self.client.request(method, f"/api{path}", headers=headers, **kw)

    def push(self, name: str, ckpt: Path, token: str | None = "", **data: Any) -> httpx.Response:
        files = [("file", (p.name, p.read_bytes())) for p in sorted(ckpt.iterdir())]
        return self.api("POST", f"/models/{name}/versions", token=token, files=files, data=data)

    def wait_derived(self, name: str, number: int, timeout: float = 90.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            body = self.api("GET", f"/models/{name}/versions/{number}").json()
            if all(a["status"] != "pending" for a in body["artifacts"]):
                return dict(body)
            assert time.monotonic() < deadline, body
            time.sleep(0.2)


@pytest.fixture(scope="module")
def console(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    tmp = tmp_path_factory.mktemp("registry-api")
    good = make_checkpoint(tmp / "good", "llama", std=0.05)  # narrow weights: INT8 keeps the greedy answers
    crushed = make_checkpoint(tmp / "crushed", "llama", crush_int8=True)
    data = tmp / "data"
    db_url = migrated_sqlite(data)
    engine = create_db(db_url)
    with Session(engine) as s:
        create_user(s, "ops", "correct horse battery", "admin")
        create_user(s, "auditor", "correct horse battery", "viewer")
        token, viewer = create_token(s, "ops").secret, create_token(s, "auditor").secret
        s.commit()
    engine.dispose()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    creds = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in creds.items():
            mp.setenv(k, v)
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=BUCKET)
        store = S3ArtifactStore(BUCKET, PREFIX, staging_dir=tmp / "staging", endpoint_url=endpoint)
        env = base_env(
            data,
            **creds,
            TIERLINE_DATABASE_URL=db_url,
            TIERLINE_ARTIFACT_STORE=f"s3://{BUCKET}/{PREFIX}",
            TIERLINE_ARTIFACT_STORE_ENDPOINT_URL=endpoint,
            TIERLINE_MAX_ARTIFACT_BYTES=str(CAP),
            TIERLINE_REGISTRY_DERIVE_TFLITE="false",
            TIERLINE_CONSOLE_ROLLOUT_INTERVAL_S="5",
        )
        with (
            run_server(["console", "serve"], env, free_port()) as url,
            httpx.Client(base_url=url, timeout=30) as client,
        ):
            yield Console(client, token, viewer, db_url, data, store, good, crushed)
    server.stop()


def s3_keys(console: Console) -> set[str]:
    listed = console.store.client.list_objects_v2(Bucket=BUCKET, Prefix=PREFIX + "/")
    return {o["Key"] for o in listed.get("Contents", [])}


def staged(console: Console) -> list[Path]:
    root = console.data_dir / "artifacts-staging"
    return [p for p in root.rglob("*") if p.is_file() and p.suffix == ".part"] if root.exists() else []


def test_a_checkpoint_upload_streams_into_s3_and_registers_a_version(console: Console) -> None:
    entries = [
        FileEntry(p.name, p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest()) for p in console.good.iterdir()
    ]
    digest = Manifest("", "", "", "", entries).sha256
    resp = console.push("tiny-lm", console.good, label="rc1", tag=["nightly", "eu"], alias="canary", sha256=digest)
    assert resp.status_code == 201, resp.text
    body = resp.json()
    assert (body["model"], body["number"], body["label"], body["tags"], body["aliases"]) == (
        "tiny-lm",
        1,
        "rc1",
        ["nightly", "eu"],
        ["canary"],
    )
    (artifact,) = body["artifacts"]
    assert (artifact["target"], artifact["format"], artifact["sha256"]) == ("cloud", "hf-safetensors", digest)
    assert artifact["size"] == sum(e.size for e in entries)
    assert artifact["uri"].startswith(f"s3://{BUCKET}/{PREFIX}/sha256/")
    keys = s3_keys(console)
    assert all(f"{PREFIX}/sha256/{e.sha256[:2]}/{e.sha256}" in keys for e in entries)
    for e in entries:
        assert hashlib.sha256(console.store.read_bytes(e.sha256)).hexdigest() == e.sha256
    assert staged(console) == []

    listed = console.api("GET", "/models", token=console.viewer_token).json()["data"]
    assert [(m["name"], m["kind"], m["latest_version"], m["aliases"]) for m in listed] == [
        ("tiny-lm", "causal-lm", 1, {"canary": 1})
    ]
    shown = console.api("GET", "/models/tiny-lm").json()
    assert shown["versions"][0]["artifacts"][0]["signature_key_id"]


def test_one_file_with_its_hash_and_a_wrong_hash(console: Console) -> None:
    data = b"\x08\x01" + b"onnx-ish bytes" * 100
    right = hashlib.sha256(data).hexdigest()
    ok = console.api(
        "POST",
        "/models/digits/versions",
        files={"file": ("model.onnx", data)},
        data={"kind": "tensor", "sha256": right},
    )
    assert ok.status_code == 201, ok.text
    assert (ok.json()["artifacts"][0]["format"], ok.json()["artifacts"][0]["target"]) == ("onnx", "cloud")
    before = s3_keys(console)
    bad = console.api(
        "POST", "/models/digits/versions", files={"file": ("model.onnx", data + b"!")}, data={"sha256": right}
    )
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == "sha256" and f"not the expected {right}" in bad.json()["error"]["message"]
    assert console.api("GET", "/models/digits").json()["num_versions"] == 1  # nothing registered
    assert s3_keys(console) == before and staged(console) == []  # nothing stored
    # A format only the edge has names the target.
    edge = console.api(
        "POST", "/models/digits/versions", files={"file": ("m.onnx", data)}, data={"format": "onnx-int8"}
    )
    assert edge.status_code == 201 and (edge.json()["number"], edge.json()["artifacts"][0]["target"]) == (2, "edge")


def test_an_upload_past_the_cap_is_refused_with_413(console: Console) -> None:
    big = b"\x00" * (CAP + 2 * 1024 * 1024)
    resp = console.api("POST", "/models/big/versions", files={"file": ("model.onnx", big)})
    assert resp.status_code == 413, resp.text
    assert f"exceeds the artifact size limit of {CAP} bytes" in resp.json()["error"]["message"]

    # No Content-Length (chunked): the cap is enforced on the bytes as they stream in.
    boundary = "tierline-test-boundary"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="model.onnx"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()

    def body() -> Iterator[bytes]:
        yield head
        for _ in range(CAP // 65536 + 2):
            yield b"\x01" * 65536
        yield f"\r\n--{boundary}--\r\n".encode()

    resp = console.api(
        "POST",
        "/models/big/versions",
        content=body(),
        headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
    )
    assert resp.status_code == 413, resp.text
    assert resp.json()["error"]["message"].startswith(f"artifact exceeds the size limit of {CAP} bytes")
    assert console.api("GET", "/models/big").status_code == 404
    assert staged(console) == []


def test_bad_requests_name_their_field(console: Console) -> None:
    onnx = {"file": ("model.onnx", b"x")}
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("/models/tiny-lm/versions", {"json": {"file": "x"}}, "file"),
        ("/models/tiny-lm/versions", {"files": onnx, "data": {"colour": "red"}}, "colour"),
        ("/models/tiny-lm/versions", {"files": {"file": ("../escape.onnx", b"x")}}, "file"),
        ("/models/tiny-lm/versions", {"files": {"weights": ("model.onnx", b"x")}}, "weights"),
        ("/models/tiny-lm/versions", {"files": {"file": ("notes.txt", b"x")}}, "format"),
        ("/models/tiny-lm/versions", {"files": onnx, "data": {"target": "edge", "format": "hf-safetensors"}}, "format"),
        ("/models/tiny-lm/versions", {"files": onnx, "data": {"kind": "tensor"}}, "kind"),
        ("/models/tiny-lm/versions", {"files": onnx, "data": {"tag": "two words"}}, "tags"),
        ("/models/bad name/versions", {"files": onnx}, "name"),
        ("/models/tiny-lm/versions/1/status", {"json": {"status": "shipped"}}, "status"),
        ("/models/tiny-lm/versions/1/derive", {"json": {"min_int8_agreement": 2}}, "min_int8_agreement"),
    ]
    for path, kw, param in cases:
        resp = console.api("POST", path, **kw)
        assert resp.status_code == 400, (path, kw, resp.text)
        assert resp.json()["error"]["param"] == param, (kw, resp.text)
    alias = console.api("PUT", "/models/tiny-lm/aliases/stable", json={"version": 0})
    assert alias.status_code == 400 and alias.json()["error"]["param"] == "version"
    assert console.api("PUT", "/models/tiny-lm/aliases/stable", json={"version": 99}).status_code == 404
    assert console.api("GET", "/models/nope").status_code == 404
    assert console.api("GET", "/models/tiny-lm/versions/99").status_code == 404
    assert console.api("GET", "/models", token=None).status_code == 401
    assert console.push("tiny-lm", console.good, token=console.viewer_token).status_code == 403
    assert console.api("POST", "/models/tiny-lm/versions/1/derive", token=console.viewer_token).status_code == 403
    assert staged(console) == []


def test_aliases_and_status_move_and_are_audited(console: Console) -> None:
    assert console.push("aliased", console.good).status_code == 201
    assert console.push("aliased", console.good).status_code == 201
    moved = console.api("PUT", "/models/aliased/aliases/stable", json={"version": 1})
    assert moved.status_code == 200 and moved.json()["aliases"] == {"stable": 1}
    moved = console.api("PUT", "/models/aliased/aliases/stable", json={"version": 2})
    assert moved.json()["aliases"] == {"stable": 2}
    skip = console.api("POST", "/models/aliased/versions/1/status", json={"status": "active"})
    assert skip.status_code == 409 and skip.json()["error"]["param"] == "status"
    for status in ("validated", "active"):
        resp = console.api("POST", "/models/aliased/versions/2/status", json={"status": status, "reason": "evals"})
        assert resp.status_code == 200 and resp.json()["status"] == status
    tagged = console.api("POST", "/models/aliased/versions/2/tags", json={"add": ["prod"]})
    assert tagged.json()["tags"] == ["prod"]
    engine = create_db(console.db_url)
    with Session(engine) as s:
        rows = s.exec(
            select(AuditLog.actor, AuditLog.action, AuditLog.before, AuditLog.after)
            .where(col(AuditLog.target).startswith("model/aliased"))
            .order_by(col(AuditLog.id))
        ).all()
    engine.dispose()
    assert {actor for actor, *_ in rows} == {"console:ops"}
    moves = [(before, after) for _, action, before, after in rows if action == "model.alias.move"]
    assert moves == [
        (None, {"alias": "stable", "version": 1}),
        ({"alias": "stable", "version": 1}, {"alias": "stable", "version": 2}),
    ]
    assert [a for _, a, *_ in rows].count("model.version.status") == 2


def test_edge_artifacts_are_derived_in_the_background_signed_and_guarded(console: Console, tmp_path: Path) -> None:
    import onnxruntime as ort

    good = console.push("edge-lm", console.good)
    crushed = console.push("edge-lm", console.crushed)
    assert good.status_code == crushed.status_code == 201
    started = [console.api("POST", f"/models/edge-lm/versions/{n}/derive", json={}) for n in (1, 2)]
    for resp in started:
        assert resp.status_code == 202, resp.text
        assert {a["format"]: a["status"] for a in resp.json()["artifacts"]} == {
            "onnx": "pending",
            "onnx-int8": "pending",
        }
    numbers = [r.json()["number"] for r in started]
    assert numbers == [3, 4] and [r.json()["derived_from"] for r in started] == [1, 2]

    healthy, guarded = (console.wait_derived("edge-lm", n) for n in numbers)
    assert {a["format"]: a["status"] for a in healthy["artifacts"]} == {"onnx": "ready", "onnx-int8": "ready"}
    assert {a["format"]: a["status"] for a in guarded["artifacts"]} == {"onnx": "ready", "onnx-int8": "rejected"}
    int8 = {a["format"]: a for a in guarded["artifacts"]}["onnx-int8"]
    # Checked against the source checkpoint's own greedy answers (reference.json), not against the fp32 export.
    assert int8["metadata"]["agreement"]["overall"] < int8["metadata"]["bound"] == 0.9
    assert {a["format"]: a for a in healthy["artifacts"]}["onnx-int8"]["metadata"]["agreement"]["overall"] >= 0.9
    assert healthy["tags"] == ["derived", "edge"] and all(a["target"] == "edge" for a in healthy["artifacts"])

    # Signed with the platform key, derived from the checkpoint's digest, and the bytes run.
    key = load_public_key(console.data_dir / "keys" / "artifact-signing.ed25519.pub")
    engine = create_db(console.db_url)
    with Session(engine) as s:
        rows = {
            a.format: a
            for a in s.exec(
                select(ModelArtifact).where(col(ModelArtifact.id).in_([a["id"] for a in healthy["artifacts"]]))
            )
        }
    engine.dispose()
    source_sha = console.api("GET", "/models/edge-lm/versions/1").json()["artifacts"][0]["sha256"]
    for fmt, row in rows.items():
        manifest = Manifest.from_json(json.dumps(row.manifest))
        verify_signature(manifest, [key])
        assert manifest.derived_from == {"name": "edge-lm@1", "sha256": source_sha}, fmt
        assert json.loads(console.store.read_bytes(row.uri.rsplit("/", 1)[-1])) == row.manifest
    from controlplane.registry.artifacts import materialize

    out = materialize(console.store, rows["onnx-int8"], tmp_path / "int8")
    meta = json.loads((out / "edge_model.json").read_text())
    assert meta["format"] == "onnx-int8" and meta["io"] == "growing-kv-cache/v1"
    sess = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    empty = np.zeros((meta["num_layers"], 1, meta["num_kv_heads"], 0, meta["head_dim"]), np.float32)
    (logits,) = sess.run(
        ["logits"], {"input_ids": np.array([[1, 2, 3]], np.int64), "past_keys": empty, "past_values": empty}
    )
    assert logits.shape == (1, 3, meta["vocab_size"])

    # Only a causal-lm cloud checkpoint derives.
    assert console.api("POST", "/models/edge-lm/versions/3/derive").json()["error"]["param"] == "version"
    assert console.api("POST", "/models/digits/versions/1/derive").json()["error"]["param"] == "name"


def test_a_serving_spec_is_set_checked_cleared_and_audited(console: Console, tmp_path: Path) -> None:
    tokenizer = tmp_path / "tokenizer"  # the checkpoint without its weights
    tokenizer.mkdir()
    for p in console.good.iterdir():
        if not p.name.endswith(".safetensors"):
            (tokenizer / p.name).write_bytes(p.read_bytes())
    pushed = console.push("served", tokenizer)
    assert pushed.status_code == 201, pushed.text
    assert [a["format"] for a in pushed.json()["artifacts"]] == ["hf-tokenizer"] and pushed.json()["serving"] is None
    spec = {"backend": "openai", "endpoints": ["http://10.0.0.7:8000"], "upstream_model": "m", "max_concurrency": 4}
    path = "/models/served/versions/1/serving"

    typo = console.api("PUT", path, json={"serving": {**spec, "max_concurent": 4}})
    assert typo.status_code == 400 and typo.json()["error"]["param"] == "serving.max_concurent", typo.text
    wrong = console.api("PUT", path, json={"serving": {**spec, "backend": "builtin"}})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "serving.backend"
    assert console.api("PUT", path, json={"serving": spec}, token=console.viewer_token).status_code == 403

    done = console.api("PUT", path, json={"serving": spec})
    assert done.status_code == 200, done.text
    assert done.json()["serving"] == spec
    assert console.api("GET", "/models/served/versions/1").json()["serving"] == spec
    cleared = console.api("PUT", path, json={"serving": None})
    assert cleared.status_code == 200 and cleared.json()["serving"] is None

    engine = create_db(console.db_url)
    with Session(engine) as s:
        rows = s.exec(
            select(AuditLog.action, AuditLog.before, AuditLog.after)
            .where(AuditLog.target == "model/served/1", AuditLog.action == "model.version.serving")
            .order_by(col(AuditLog.id))
        ).all()
    engine.dispose()
    assert [(before, after) for _, before, after in rows] == [
        ({"serving": None}, {"serving": spec}),
        ({"serving": spec}, {"serving": None}),
    ]

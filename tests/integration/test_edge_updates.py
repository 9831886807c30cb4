"""Model updates end to end against a real cloud process on the tiny zoo: an operator publishes an edge
artifact, an enrolled device learns it from /v1/edge/sync, downloads it over the device-authenticated
artifact route (resuming after kill -9), verifies and smoke-tests it, and switches; tampered, foreign-signed,
unsigned and oversized artifacts are refused; a version that fails on devices is rolled back."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import load_pem_public_key
from sqlalchemy import update
from sqlalchemy.engine import Engine
from sqlmodel import Session

from cloud.edge.releases import ReleaseStore, publish_command
from controlplane.registry.store import LocalArtifactStore
from controlplane.storage.database import create_db
from controlplane.storage.tables import EdgeRelease
from edge_agent.generation import LocalLM, LocalRequest
from edge_agent.model_store import ModelStore
from edge_agent.runtime.lm import load_causal_lm
from edge_agent.updater import HealthWatch, Updater
from shared.artifacts import (
    FileEntry,
    Manifest,
    load_or_create_signing_key,
    read_manifest,
    sign_manifest,
    verify_files,
)
from shared.chat_tokenizer import ChatTokenizer
from shared.edge_protocol import DesiredModel
from shared.errors import ArtifactVerificationError
from tests.conftest import REPO, base_env, free_port, migrated_sqlite, run_server, seed_data_dir
from tests.forkserver import run_tierline

pytestmark = pytest.mark.integration


@dataclass
class Cloud:
    url: str
    data: Path
    env: dict[str, str]
    device_token: str
    keys: list[Ed25519PublicKey]
    db: Engine

    @property
    def blobs(self) -> LocalArtifactStore:
        """The artifact store the cloud keeps release files in (the default: a directory in its data dir)."""
        return LocalArtifactStore(self.data / "artifacts")

    def store(self) -> ReleaseStore:
        return ReleaseStore(self.db, self.blobs, trusted_keys=self.keys)

    def manifest(self, name: str, version: str) -> Manifest:
        return self.store().manifest(name, version)

    def replace_manifest(self, manifest: Manifest) -> None:
        """Overwrite a published manifest where every gateway reads it (as an attacker with the database would)."""
        with Session(self.db) as session:
            session.exec(
                update(EdgeRelease)
                .where(EdgeRelease.name == manifest.name, EdgeRelease.version == manifest.version)  # type: ignore[arg-type]
                .values(manifest=manifest.to_json())
            )
            session.commit()

    def zoo_artifact(self, name: str) -> Path:
        return self.data / "zoo" / "tiny" / "artifacts" / name

    def publish(self, artifact: str, version: str) -> str:
        """``tierline devices publish ARTIFACT_DIR --as-version VERSION``, in this process (no torch import)."""
        args = [str(self.zoo_artifact(artifact)), "--as-version", version]
        result = CliRunner().invoke(publish_command, args, env={"TIERLINE_DATA_DIR": str(self.data)})
        assert result.exit_code == 0, result.output
        return result.output

    def desired(self, name: str) -> DesiredModel:
        resp = httpx.post(f"{self.url}/v1/edge/sync", json={}, headers=self.auth())
        assert resp.status_code == 200, resp.text
        return next(DesiredModel.model_validate(d) for d in resp.json()["desired"] if d["name"] == name)

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.device_token}"}


@dataclass
class Device:
    store: ModelStore
    updater: Updater
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def kinds(self) -> list[str]:
        return [k for k, _ in self.events]


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory, tiny_zoo: Path, session_data_dir: Path) -> Iterator[Cloud]:
    data = seed_data_dir(tmp_path_factory.mktemp("edge-updates"), tiny_zoo, session_data_dir)
    env = base_env(
        data,
        TIERLINE_DATABASE_URL=migrated_sqlite(data),
        TIERLINE_CLOUD_ZOO_PRESET="tiny",
        TIERLINE_CLOUD_KV_CACHE_MB="16",
    )

    def cli(*args: str) -> str:
        proc = run_tierline(*args, env=env, check=True)
        return proc.stdout.strip()

    cli("tenants", "create", "acme")
    token = cli("devices", "enrollment-token", "--tenant", "acme")
    with run_server(["cloud", "serve"], env, free_port(), timeout=120) as url:
        enrolled = httpx.post(f"{url}/v1/edge/enroll", json={"token": token, "name": "updates-1"})
        assert enrolled.status_code == 200, enrolled.text
        body = enrolled.json()
        keys = [load_pem_public_key(pem.encode()) for pem in body["signing_public_keys"]]
        assert keys and all(isinstance(k, Ed25519PublicKey) for k in keys)
        db = create_db(env["TIERLINE_DATABASE_URL"])
        yield Cloud(url, data, env, body["device_token"], keys, db)  # type: ignore[arg-type]
        db.dispose()


@pytest.fixture
def device(cloud: Cloud, tmp_path: Path) -> Iterator[Device]:
    with httpx.Client(base_url=cloud.url, headers=cloud.auth()) as client:
        store = ModelStore(tmp_path / "state")
        dev = Device(store, None)  # type: ignore[arg-type]
        dev.updater = Updater(
            client,
            store,
            tmp_path / "state" / "staging",
            cloud.keys,
            max_artifact_bytes=50 << 20,
            report=lambda kind, payload: dev.events.append((kind, payload)),
            retry_base_s=0.05,
        )
        yield dev


def staged_bytes(stage: Path, manifest: Manifest) -> int:
    total = 0
    for entry in manifest.files:
        for candidate in (stage / entry.path, stage / f"{entry.path}.part"):
            if candidate.is_file():
                total += candidate.stat().st_size
                break
    return total


def test_a_published_version_reaches_the_device_and_serves(cloud: Cloud, device: Device) -> None:
    out = cloud.publish("lm-edge-onnx-int8", "u1")
    assert "published lm-edge-onnx-int8 u1" in out
    desired = cloud.desired("lm-edge-onnx-int8")
    manifest = read_manifest(cloud.zoo_artifact("lm-edge-onnx-int8").parent.parent / "manifests/lm-edge-onnx-int8.json")
    assert desired.version == "u1" and desired.sha256 == manifest.sha256
    assert desired.manifest_url == "/v1/edge/artifacts/lm-edge-onnx-int8/u1/manifest.json"

    assert device.updater.apply(desired) == "installed"
    assert device.kinds() == ["update.downloaded", "update.smoke_tested", "update.activated"]
    downloaded = device.events[0][1]
    assert (downloaded["bytes_fetched"], downloaded["bytes_resumed"]) == (manifest.size, 0)
    assert device.store.current("lm-edge-onnx-int8") == "u1"
    current = device.store.current_dir("lm-edge-onnx-int8")
    assert current is not None
    verify_files(device.store.manifest("lm-edge-onnx-int8", "u1"), current)
    lm = LocalLM(current)
    steps = list(lm.generate(LocalRequest(lm.tokenizer.encode("def add(a, b):"), max_tokens=4, temperature=0)))
    assert len(steps) >= 1

    assert device.updater.apply(desired) == "already-current"
    assert not (device.store.root.parent / "staging" / "lm-edge-onnx-int8" / "u1").exists()


def test_publishing_an_older_version_again_rolls_the_fleet_back(cloud: Cloud) -> None:
    cloud.publish("digits-small", "r1")
    cloud.publish("digits-small", "r2")
    assert cloud.desired("digits-small").version == "r2"
    cloud.publish("digits-small", "r1")
    assert cloud.desired("digits-small").version == "r1"


_RESUMABLE = """
import json, sys
from pathlib import Path
import httpx
from edge_agent.model_store import ModelStore
from edge_agent.updater import Updater
from shared.artifacts import load_public_key
from shared.edge_protocol import DesiredModel

url, token, state, key, desired = sys.argv[1:6]
client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"})
report = lambda kind, payload: print(kind, json.dumps(payload), flush=True)
updater = Updater(client, ModelStore(Path(state)), Path(state) / "staging", [load_public_key(Path(key))], 1 << 30,
                  report, max_bytes_per_s=250_000)
print(updater.apply(DesiredModel.model_validate_json(desired)), flush=True)
"""


def test_a_download_killed_midway_resumes_where_it_stopped(cloud: Cloud, device: Device) -> None:
    cloud.publish("lm-edge-onnx", "big1")
    desired = cloud.desired("lm-edge-onnx")
    manifest_path = cloud.manifest("lm-edge-onnx", "big1")
    total = manifest_path.size
    stage = device.store.root.parent / "staging" / "lm-edge-onnx" / "big1"
    key = cloud.data / "keys" / "artifact-signing.ed25519.pub"
    args = [cloud.url, cloud.device_token, str(device.store.root.parent), str(key), desired.model_dump_json()]
    proc = subprocess.Popen([sys.executable, "-c", _RESUMABLE, *args], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while (stage.is_dir() and staged_bytes(stage, manifest_path)) < total // 3:
            assert proc.poll() is None, f"the throttled download ended early: {proc.stdout and proc.stdout.read()}"
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.stdout:
            proc.stdout.close()
    on_disk = staged_bytes(stage, manifest_path)
    assert total // 3 <= on_disk < total

    assert device.updater.apply(desired) == "installed"
    downloaded = dict(device.events)["update.downloaded"]
    assert downloaded["bytes_resumed"] == on_disk
    assert downloaded["bytes_fetched"] == total - on_disk
    current = device.store.current_dir("lm-edge-onnx")
    assert current is not None
    verify_files(manifest_path, current)


def test_a_tampered_file_is_rejected_and_the_current_version_stays(cloud: Cloud, device: Device) -> None:
    cloud.publish("digits-small", "t1")
    assert device.updater.apply(cloud.desired("digits-small")) == "installed"
    cloud.publish("digits-small", "t2")
    entry = next(e for e in cloud.manifest("digits-small", "t2").files if e.path == "model.onnx")
    published = cloud.blobs.path(entry.sha256)  # the stored bytes every gateway serves
    good = published.read_bytes()
    data = bytearray(good)
    data[len(data) // 2] ^= 0x01
    published.write_bytes(bytes(data))

    device.events.clear()
    try:
        assert device.updater.apply(cloud.desired("digits-small")) == "rejected"
    finally:
        published.write_bytes(good)  # the blob is shared by every version with these bytes
    assert device.kinds() == ["update.rejected"]
    assert "model.onnx: sha256 mismatch" in device.events[0][1]["reason"]
    assert device.store.current("digits-small") == "t1" and device.store.versions("digits-small") == ["t1"]
    assert not (device.store.root.parent / "staging" / "digits-small" / "t2").exists()


def resign(manifest: Manifest, key: Ed25519PrivateKey | None, **changes: Any) -> Manifest:
    for attr, value in changes.items():
        setattr(manifest, attr, value)
    if key is None:
        manifest.signature = None
    else:
        sign_manifest(manifest, key)
    return manifest


def test_foreign_signed_unsigned_unsafe_and_oversized_manifests_are_rejected(cloud: Cloud, device: Device) -> None:
    platform_key = load_or_create_signing_key(cloud.data / "keys" / "artifact-signing.ed25519")
    cases: list[tuple[str, Ed25519PrivateKey | None, bool, str]] = [
        ("s-foreign", Ed25519PrivateKey.generate(), False, "signed by untrusted key"),
        ("s-unsigned", None, False, "not signed"),
        ("s-traversal", platform_key, True, "unsafe or duplicate file path '../model.onnx'"),
    ]
    for version, key, unsafe, reason in cases:
        cloud.publish("digits-small", version)
        manifest = cloud.manifest("digits-small", version)
        files = manifest.files
        if unsafe:  # signed by the platform key, but a path that climbs out of the artifact
            files[1] = FileEntry("../model.onnx", files[1].size, files[1].sha256)
        cloud.replace_manifest(resign(manifest, key, files=files))
        desired = cloud.desired("digits-small")
        desired.sha256 = cloud.manifest("digits-small", version).sha256
        device.events.clear()
        assert device.updater.apply(desired) == "rejected", version
        assert reason in device.events[-1][1]["reason"]
        assert device.kinds() == ["update.rejected"] and device.store.current("digits-small") is None

    cloud.publish("digits-small", "s-ok")
    desired = cloud.desired("digits-small")
    wrong = desired.model_copy(update={"sha256": "0" * 64})
    assert device.updater.apply(wrong) == "rejected"
    assert "is not the desired" in device.events[-1][1]["reason"]
    for hostile in (
        desired.model_copy(update={"name": "../../keys"}),
        desired.model_copy(update={"manifest_url": "http://elsewhere.example/m.json"}),  # the token stays home
    ):
        assert device.updater.apply(hostile) == "rejected"
    device.updater.max_artifact_bytes = 1000
    assert device.updater.apply(desired) == "rejected"
    assert "over the limit of 1000" in device.events[-1][1]["reason"]
    # The cloud refuses to publish what its own key did not sign.
    foreign = cloud.data / "foreign.json"
    manifest = resign(cloud.manifest("digits-small", "s-foreign"), Ed25519PrivateKey.generate(), version="s-foreign-2")
    foreign.write_text(manifest.to_json())
    store = cloud.store()
    with pytest.raises(ArtifactVerificationError, match="untrusted key"):
        store.publish(cloud.zoo_artifact("digits-small"), foreign)


def test_golden_outputs_gate_the_switch(cloud: Cloud, device: Device) -> None:
    zoo_dir = cloud.zoo_artifact("lm-edge-onnx-int8")
    prompt = "import os\n"
    runtime = load_causal_lm(zoo_dir)
    golden = runtime.greedy(ChatTokenizer(zoo_dir).encode(prompt), 6)
    key = load_or_create_signing_key(cloud.data / "keys" / "artifact-signing.ed25519")
    store = cloud.store()
    for version, ids in (("g-bad", [(t + 1) % 1024 for t in golden]), ("g-ok", golden)):
        manifest = read_manifest(zoo_dir.parent.parent / "manifests" / "lm-edge-onnx-int8.json")
        manifest.version = version
        manifest.metadata = {**manifest.metadata, "golden": [{"prompt": prompt, "greedy_ids": ids}]}
        store.publish_manifest(zoo_dir, sign_manifest(manifest, key))
        outcome = device.updater.apply(cloud.desired("lm-edge-onnx-int8"))
        assert outcome == ("rejected" if version == "g-bad" else "installed"), device.events[-1]
    assert "golden prompt 'import os\\n' differs" in dict(device.events)["update.rejected"]["reason"]
    assert device.store.current("lm-edge-onnx-int8") == "g-ok" and device.store.is_blocked("lm-edge-onnx-int8", "g-bad")


def test_a_version_failing_on_the_device_is_rolled_back_and_not_reinstalled(cloud: Cloud, device: Device) -> None:
    cloud.publish("lm-edge-onnx-int8", "h1")
    assert device.updater.apply(cloud.desired("lm-edge-onnx-int8")) == "installed"
    cloud.publish("lm-edge-onnx-int8", "h2")
    bad = cloud.desired("lm-edge-onnx-int8")
    assert device.updater.apply(bad) == "installed"
    watch = HealthWatch(device.store, lambda k, p: device.events.append((k, p)), max_error_rate=0.5, min_requests=4)
    rolled = [watch.record("lm-edge-onnx-int8", "h2", ok=False) for _ in range(4)]
    assert rolled == [False, False, False, True]
    assert device.store.current("lm-edge-onnx-int8") == "h1"
    assert device.kinds()[-1] == "update.rolled_back"

    device.events.clear()
    assert device.updater.apply(bad) == "rejected"  # the cloud still wants h2; the device will not take it
    assert device.events == [
        (
            "update.rejected",
            {"model": "lm-edge-onnx-int8", "version": "h2", "reason": "version was rolled back on this device"},
        )
    ]
    assert device.updater.apply(bad) == "rejected" and len(device.events) == 1  # said once, not every sync


def test_a_block_expires_or_is_lifted_when_the_cloud_desires_the_version_anew(cloud: Cloud, device: Device) -> None:
    name = "lm-edge-onnx-int8"
    cloud.publish(name, "b1")
    assert device.updater.apply(cloud.desired(name)) == "installed"
    cloud.publish(name, "b2")
    b2 = cloud.desired(name)
    assert device.updater.apply(b2) == "installed"
    now = [time.time()]
    device.updater.block_s, device.updater.wall_clock = 600.0, lambda: now[0]

    assert device.store.rollback(name) == "b1"  # as the health watch does: b2 is blocked
    assert device.updater.apply(b2) == "rejected"
    now[0] += 599
    assert device.updater.apply(b2) == "rejected"  # not yet
    now[0] += 2
    assert device.updater.apply(b2) == "installed"  # the block expired: a device is not locked out for good
    assert ("update.unblocked", {"model": name, "version": "b2", "reason": "blocked for 600 s"}) in device.events

    now[0] = time.time()
    device.store.rollback(name)
    assert device.updater.apply(b2) == "rejected"
    cloud.publish(name, "b3")
    assert device.updater.apply(cloud.desired(name)) == "installed"
    assert device.store.is_blocked(name, "b2")  # moving on to another version lifts nothing
    cloud.publish(name, "b2")  # an operator sends b2 out again (fixed elsewhere): a new decision
    assert device.updater.apply(cloud.desired(name)) == "installed"
    reason = "the cloud desires it again, after b3"
    assert ("update.unblocked", {"model": name, "version": "b2", "reason": reason}) in device.events


def raw_get(url: str, path: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    """GET ``path`` exactly as written (httpx would normalise dot segments away)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def test_artifact_route_serves_ranges_to_devices_only(cloud: Cloud) -> None:
    cloud.publish("digits-small", "range1")
    blob = (cloud.zoo_artifact("digits-small") / "model.onnx").read_bytes()
    size = len(blob)
    base = "/v1/edge/artifacts/digits-small/range1"

    def get(path: str, range_: str | None = None, auth: bool = True) -> tuple[int, dict[str, str], bytes]:
        headers = cloud.auth() if auth else {}
        if range_ is not None:
            headers["Range"] = range_
        return raw_get(cloud.url, f"{base}/{path}", headers)

    status, headers, body = get("model.onnx")
    assert (status, body, headers["content-length"], headers["accept-ranges"]) == (200, blob, str(size), "bytes")
    assert headers["content-type"] == "application/octet-stream"
    for range_, (start, end) in {
        "bytes=0-9": (0, 9),
        "bytes=100-": (100, size - 1),
        "bytes=-16": (size - 16, size - 1),
        f"bytes=10-{size + 50}": (10, size - 1),
    }.items():
        status, headers, body = get("model.onnx", range_)
        assert status == 206, range_
        assert headers["content-range"] == f"bytes {start}-{end}/{size}"
        assert body == blob[start : end + 1] and headers["content-length"] == str(end - start + 1)
    for unsatisfiable in (f"bytes={size}-", "bytes=-0"):
        status, headers, body = get("model.onnx", unsatisfiable)
        assert (status, headers["content-range"]) == (416, f"bytes */{size}")
        assert json.loads(body)["error"]["code"] == "range_not_satisfiable"
    for ignored in ("bytes=9-2", "bytes=0-1,4-5", "items=0-3"):
        assert get("model.onnx", ignored)[0] == 200
    status, headers, body = get("manifest.json")
    assert status == 200 and json.loads(body)["version"] == "range1"

    assert get("model.onnx", auth=False)[0] == 401
    assert raw_get(cloud.url, f"{base}/model.onnx", {"Authorization": "Bearer tld-not-a-device"})[0] == 401
    assert get("../../../keys/artifact-signing.ed25519", auth=False)[0] == 401  # no probing without a credential

    (cloud.data / "artifacts" / "notes.txt").write_text("not in the manifest")
    for path in (
        "notes.txt",
        "../../../artifacts/notes.txt",
        "../../../keys/artifact-signing.ed25519",
        "%2e%2e/%2e%2e/%2e%2e/keys/artifact-signing.ed25519",
        "..%2f..%2f..%2fkeys%2fartifact-signing.ed25519",
        "/etc/passwd",
        "no-such-file",
    ):
        status, _, body = get(path)
        assert status == 404, path
        assert b"BEGIN" not in body
    for other in ("/v1/edge/artifacts/digits-small/nope/model.onnx", "/v1/edge/artifacts/..%2f..%2fkeys/x/y"):
        assert raw_get(cloud.url, other, cloud.auth())[0] == 404

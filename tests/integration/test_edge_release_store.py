"""Edge releases hold no state on one gateway: two release stores (two gateways, each its own database
connection and its own view of the artifact store) on one database and one artifact store, a local directory or
S3 (moto's server on a real socket), publish and serve the same releases, byte ranges included; releases
published on a host's disk before they moved into the database are imported once, in their order."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from moto.server import ThreadedMotoServer

from cloud.edge.releases import MANIFEST_FILE, ReleaseStore
from controlplane.registry.store import ArtifactStore, LocalArtifactStore, S3ArtifactStore
from controlplane.storage.database import create_db
from controlplane.storage.tables import Device
from shared.artifacts import Manifest, build_manifest, sign_manifest
from shared.errors import ConflictError, NotFoundError

pytestmark = pytest.mark.integration

BUCKET = "tierline-edge"
KEY = Ed25519PrivateKey.generate()


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    with pytest.MonkeyPatch.context() as mp:
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            mp.setenv(name, "testing")
        boto3.client("s3", endpoint_url=url, region_name="us-east-1").create_bucket(Bucket=BUCKET)
        yield url
    server.stop()


@pytest.fixture(params=["local", "s3"])
def blob_stores(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[ArtifactStore, ArtifactStore]:
    """The one artifact store as each of two gateways opens it (its own staging dir, its own S3 client)."""
    if request.param == "local":
        shared = tmp_path / "shared-artifacts"  # a directory both mount
        return LocalArtifactStore(shared), LocalArtifactStore(shared)
    endpoint = request.getfixturevalue("s3_endpoint")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, "testing")
    prefix = f"run-{tmp_path.name}"
    return (
        S3ArtifactStore(BUCKET, prefix, staging_dir=tmp_path / "a-staging", endpoint_url=endpoint),
        S3ArtifactStore(BUCKET, prefix, staging_dir=tmp_path / "b-staging", endpoint_url=endpoint),
    )


def artifact(root: Path, name: str, version: str, weights: bytes) -> tuple[Path, Manifest]:
    root.mkdir(parents=True)
    (root / "model.onnx").write_bytes(weights)
    (root / "edge_model.json").write_text('{"format": "onnx"}')
    manifest = build_manifest(root, name=name, version=version, kind="tensor", format="onnx")
    return root, sign_manifest(manifest, KEY)


def device() -> Device:
    return Device(id="dev-1", tenant_id=1, token_hash="x")


def test_two_gateways_publish_and_serve_the_same_releases(
    migrated_db: str, blob_stores: tuple[ArtifactStore, ArtifactStore], tmp_path: Path
) -> None:
    trusted = [KEY.public_key()]
    engine_a, engine_b = create_db(migrated_db), create_db(migrated_db)
    a = ReleaseStore(engine_a, blob_stores[0], trusted_keys=trusted)
    b = ReleaseStore(engine_b, blob_stores[1], trusted_keys=trusted)
    weights = os.urandom(300_000)
    src, v1 = artifact(tmp_path / "v1", "digits", "1", weights)
    a.publish_manifest(src, v1)
    src2, v2 = artifact(tmp_path / "v2", "digits", "2", weights[::-1])
    b.publish_manifest(src2, v2)

    for gateway in (a, b):
        assert [(r.name, r.version) for r in gateway.releases()] == [("digits", "1"), ("digits", "2")]
        (desired,) = gateway.desired(device())
        assert (desired.version, desired.sha256) == ("2", v2.sha256)
        served = gateway.locate("digits", "1", "model.onnx")
        entry = next(e for e in v1.files if e.path == "model.onnx")
        assert (served.size, served.etag) == (len(weights), f'"{entry.sha256}"')
        assert b"".join(served.chunks(0, served.size)) == weights
        assert b"".join(served.chunks(123_456, 1000)) == weights[123_456:124_456]
        manifest = gateway.locate("digits", "2", MANIFEST_FILE)
        assert Manifest.from_json(b"".join(manifest.chunks(0, manifest.size)).decode()).sha256 == v2.sha256
        for name, version, path in (("digits", "3", "model.onnx"), ("digits", "1", "nope"), ("x", "1", MANIFEST_FILE)):
            with pytest.raises(NotFoundError):
                gateway.locate(name, version, path)

    a.publish_manifest(src, v1)  # publishing 1 again on either gateway rolls the fleet back on both
    assert [d.version for d in b.desired(device())] == ["1"]
    _, other = artifact(tmp_path / "v1-other", "digits", "1", b"other bytes")
    with pytest.raises(ConflictError, match="already published with other content"):
        b.publish_manifest(tmp_path / "v1-other", other)
    assert [r.version for r in a.releases()] == ["1", "2", "1"]
    engine_a.dispose()
    engine_b.dispose()


def test_releases_on_a_hosts_disk_are_imported_once_in_their_order(migrated_db: str, tmp_path: Path) -> None:
    legacy = tmp_path / "edge-releases"
    log = []
    for version, stamp in (("r1", 1_700_000_000.0), ("r2", 1_700_000_100.0), ("r1", 1_700_000_200.0)):
        vdir = legacy / "digits" / version
        if not vdir.exists():
            _, manifest = artifact(vdir, "digits", version, version.encode() * 1000)
            (vdir / MANIFEST_FILE).write_text(manifest.to_json())
        log.append({"name": "digits", "version": version, "sha256": "", "published_at": stamp})
    (legacy / "releases.json").write_text(json.dumps({"releases": log}))
    engine = create_db(migrated_db)
    store = ReleaseStore(engine, LocalArtifactStore(tmp_path / "artifacts"), trusted_keys=[KEY.public_key()])

    assert store.import_legacy(legacy) == 3
    assert [(r.version, r.published_at) for r in store.releases()] == [
        ("r1", 1_700_000_000.0),
        ("r2", 1_700_000_100.0),
        ("r1", 1_700_000_200.0),
    ]
    assert [d.version for d in store.desired(device())] == ["r1"]
    served = store.locate("digits", "r2", "model.onnx")
    assert b"".join(served.chunks(0, served.size)) == b"r2" * 1000
    assert store.import_legacy(legacy) == 0  # the log is not empty any more: nothing is imported twice
    assert len(store.releases()) == 3
    engine.dispose()

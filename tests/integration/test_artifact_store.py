"""The artifact store's one interface, against the local filesystem and an S3 API (moto's server mode on a real
socket): content addressing, dedup, the size cap, the hash check, nothing half-written ever visible."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer

from controlplane.registry.store import (
    ArtifactStore,
    ArtifactStoreSettings,
    LocalArtifactStore,
    PayloadTooLargeError,
    S3ArtifactStore,
    store_from_settings,
)
from shared.errors import ApplicationError, ConfigurationError, NotFoundError, ValidationError

pytestmark = pytest.mark.integration

BUCKET = "tierline-artifacts"
CAP = 64 * 1024


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 on 127.0.0.1, a random port, with one bucket."""
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
def store(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ArtifactStore:
    if request.param == "local":
        return LocalArtifactStore(tmp_path / "artifacts", max_bytes=CAP)
    endpoint = request.getfixturevalue("s3_endpoint")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, "testing")
    prefix = f"run-{tmp_path.name}"  # one prefix per test: tests never see each other's blobs
    return S3ArtifactStore(BUCKET, prefix, staging_dir=tmp_path / "staging", max_bytes=CAP, endpoint_url=endpoint)


def blob_count(store: ArtifactStore) -> int:
    if isinstance(store, LocalArtifactStore):
        return (
            sum(1 for p in (store.root / "sha256").rglob("*") if p.is_file()) if (store.root / "sha256").exists() else 0
        )
    assert isinstance(store, S3ArtifactStore)
    listed = store.client.list_objects_v2(Bucket=store.bucket, Prefix=store.prefix + "/")
    return int(listed.get("KeyCount", 0))


def staged_files(store: ArtifactStore) -> list[Path]:
    return [p for p in store.staging_dir.rglob("*") if p.is_file()] if store.staging_dir.exists() else []


def test_a_blob_is_stored_under_its_sha256_and_read_back(store: ArtifactStore, tmp_path: Path) -> None:
    data = bytes(range(256)) * 100  # 25.6 kB, several chunks of a slow writer
    digest = hashlib.sha256(data).hexdigest()
    assert not store.exists(digest)
    with store.writer() as w:
        for i in range(0, len(data), 1000):
            w.write(data[i : i + 1000])
        assert blob_count(store) == 0  # staged, not visible
        blob = w.commit(digest)
    assert (blob.sha256, blob.size) == (digest, len(data))
    assert blob.uri.endswith(f"sha256/{digest[:2]}/{digest}")
    assert blob.uri.startswith("s3://" if isinstance(store, S3ArtifactStore) else "file://")
    assert store.exists(digest) and store.read_bytes(digest) == data
    store.fetch(digest, tmp_path / "out" / "copy.bin")
    assert (tmp_path / "out" / "copy.bin").read_bytes() == data
    assert staged_files(store) == []


def test_a_byte_range_of_a_blob_is_read_without_the_rest(store: ArtifactStore) -> None:
    data = bytes(range(256)) * 40  # 10,240 bytes
    blob = store.put_bytes(data)
    for start, length in ((0, 10), (100, 5000), (len(data) - 16, 16), (7, len(data) - 7), (5, 0)):
        assert b"".join(store.iter_range(blob.sha256, start, length, chunk=999)) == data[start : start + length]
    with pytest.raises(NotFoundError):
        list(store.iter_range("0" * 64, 0, 10))


def test_the_same_bytes_are_stored_once(store: ArtifactStore) -> None:
    first = store.put_bytes(b"weights" * 1000)
    second = store.put_stream(io.BytesIO(b"weights" * 1000))
    other = store.put_bytes(b"other weights")
    assert first == second and other.sha256 != first.sha256
    assert blob_count(store) == 2
    assert staged_files(store) == []


def test_past_the_size_cap_nothing_is_kept(store: ArtifactStore) -> None:
    with pytest.raises(PayloadTooLargeError) as caught, store.writer() as w:
        for _ in range(CAP // 4096 + 1):
            w.write(b"x" * 4096)
    assert caught.value.status_code == 413
    assert f"size limit of {CAP} bytes" in caught.value.message
    assert blob_count(store) == 0 and staged_files(store) == []
    store.put_bytes(b"y" * CAP)  # exactly the cap is fine


def test_a_hash_mismatch_is_refused_and_not_stored(store: ArtifactStore) -> None:
    with pytest.raises(ValidationError) as caught:
        store.put_stream(io.BytesIO(b"tampered"), expected_sha256=hashlib.sha256(b"original").hexdigest())
    assert caught.value.status_code == 400 and caught.value.param == "sha256"
    assert "not the expected" in caught.value.message
    assert blob_count(store) == 0 and staged_files(store) == []


def test_missing_and_malformed_names(store: ArtifactStore) -> None:
    with pytest.raises(NotFoundError):
        store.open("0" * 64)
    with pytest.raises(ValidationError):
        store.exists("../../etc/passwd")


def test_a_corrupted_local_blob_is_caught_on_fetch(tmp_path: Path) -> None:
    store = LocalArtifactStore(tmp_path / "a")
    blob = store.put_bytes(b"good bytes")
    store.path(blob.sha256).write_bytes(b"bad bytes!")
    with pytest.raises(ApplicationError, match="corrupt"):
        store.fetch(blob.sha256, tmp_path / "copy")
    assert not (tmp_path / "copy").exists()


def test_settings_choose_the_store(tmp_path: Path, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, "testing")
    local = store_from_settings(ArtifactStoreSettings(data_dir=tmp_path))
    assert isinstance(local, LocalArtifactStore) and local.root == tmp_path / "artifacts"
    monkeypatch.setenv("TIERLINE_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("TIERLINE_ARTIFACT_STORE", f"s3://{BUCKET}/from-env")
    monkeypatch.setenv("TIERLINE_ARTIFACT_STORE_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("TIERLINE_MAX_ARTIFACT_BYTES", "1000")
    s3 = store_from_settings()
    assert isinstance(s3, S3ArtifactStore) and (s3.bucket, s3.prefix, s3.max_bytes) == (BUCKET, "from-env", 1000)
    blob = s3.put_bytes(b"through the settings")
    assert blob.uri.startswith(f"s3://{BUCKET}/from-env/sha256/")
    with pytest.raises(ConfigurationError, match="no bucket"):
        store_from_settings(ArtifactStoreSettings(artifact_store="s3://"))
    with pytest.raises(ConfigurationError, match="s3://bucket/prefix or a directory"):
        store_from_settings(ArtifactStoreSettings(artifact_store="gs://bucket"))

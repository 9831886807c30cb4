from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from shared.artifacts import (
    Manifest,
    build_manifest,
    load_or_create_signing_key,
    public_path,
    read_manifest,
    verify_files,
    verify_signature,
    write_signed_manifest,
)
from shared.errors import ArtifactVerificationError


@pytest.fixture
def artifact(tmp_path: Path) -> Path:
    d = tmp_path / "art"
    (d / "sub").mkdir(parents=True)
    (d / "model.onnx").write_bytes(b"\x00model-bytes" * 100)
    (d / "sub" / "config.json").write_text('{"a": 1}')
    return d


@pytest.fixture
def key_path(tmp_path: Path) -> Path:
    return tmp_path / "keys" / "signing.ed25519"


def _signed(artifact: Path, key_path: Path) -> tuple[Manifest, Path]:
    key = load_or_create_signing_key(key_path)
    manifest = build_manifest(
        artifact,
        name="m",
        version="1",
        kind="tensor",
        format="onnx",
        derived_from={"name": "parent", "sha256": "ab" * 32},
    )
    path = artifact.parent / "m.json"
    write_signed_manifest(manifest, key, path)
    return manifest, path


def test_signing_key_is_private_and_reused(key_path: Path) -> None:
    first = load_or_create_signing_key(key_path)
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    assert public_path(key_path).is_file()
    second = load_or_create_signing_key(key_path)
    assert first.public_key().public_bytes_raw() == second.public_key().public_bytes_raw()


def test_round_trip_verifies(artifact: Path, key_path: Path) -> None:
    manifest, path = _signed(artifact, key_path)
    loaded = read_manifest(path)
    assert loaded.sha256 == manifest.sha256
    assert loaded.size == sum(p.stat().st_size for p in artifact.rglob("*") if p.is_file())
    assert {e.path for e in loaded.files} == {"model.onnx", "sub/config.json"}
    key = load_or_create_signing_key(key_path).public_key()
    verify_signature(loaded, [key])
    verify_files(loaded, artifact)


def test_changed_byte_names_the_file(artifact: Path, key_path: Path) -> None:
    _, path = _signed(artifact, key_path)
    data = bytearray((artifact / "model.onnx").read_bytes())
    data[5] ^= 1
    (artifact / "model.onnx").write_bytes(bytes(data))
    with pytest.raises(ArtifactVerificationError, match=r"model\.onnx: sha256 mismatch"):
        verify_files(read_manifest(path), artifact)


def test_extra_and_missing_files_fail(artifact: Path, key_path: Path) -> None:
    _, path = _signed(artifact, key_path)
    (artifact / "evil.so").write_bytes(b"x")
    with pytest.raises(ArtifactVerificationError, match=r"evil\.so: file not listed"):
        verify_files(read_manifest(path), artifact)
    (artifact / "evil.so").unlink()
    (artifact / "sub" / "config.json").unlink()
    with pytest.raises(ArtifactVerificationError, match=r"config\.json: missing"):
        verify_files(read_manifest(path), artifact)


def test_edited_manifest_fails_signature(artifact: Path, key_path: Path) -> None:
    _, path = _signed(artifact, key_path)
    data = json.loads(path.read_text())
    data["metadata"] = {"accuracy": 1.0}
    path.write_text(json.dumps(data))
    key = load_or_create_signing_key(key_path).public_key()
    with pytest.raises(ArtifactVerificationError, match="bad signature"):
        verify_signature(read_manifest(path), [key])


def test_untrusted_key_is_refused(artifact: Path, key_path: Path, tmp_path: Path) -> None:
    _, path = _signed(artifact, key_path)
    other = load_or_create_signing_key(tmp_path / "other.ed25519").public_key()
    with pytest.raises(ArtifactVerificationError, match="untrusted key"):
        verify_signature(read_manifest(path), [other])


def test_malformed_manifest_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "tierline.artifact/v1", "name": "x"}')
    with pytest.raises(ArtifactVerificationError, match="malformed manifest"):
        read_manifest(bad)

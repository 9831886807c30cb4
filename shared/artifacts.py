"""Model artifact manifests: sha256 of every file, signed with Ed25519.

An artifact is a directory of files (an HF checkpoint, an ONNX model with its tokenizer, a .tflite file).
Its manifest lists each file's path, size and sha256; the artifact digest is the sha256 of those lines, so
it names the whole directory. The signature covers the canonical JSON of the manifest without the
``signature`` field. Verification needs a trusted public key: a key carried inside the manifest would
prove nothing.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from shared.errors import ArtifactVerificationError, ConfigurationError

MANIFEST_SCHEMA = "tierline.artifact/v1"
SIGNATURE_ALG = "ed25519"
_CHUNK = 1 << 20
ARTIFACT_KINDS = ("causal-lm", "tensor", "dataset")
ARTIFACT_FORMATS = ("hf-safetensors", "onnx", "onnx-int8", "tflite", "gguf", "npz")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class FileEntry:
    path: str
    size: int
    sha256: str


@dataclass(slots=True)
class Manifest:
    """What an artifact is and what its bytes must hash to."""

    name: str
    version: str
    kind: str
    format: str
    files: list[FileEntry]
    derived_from: dict[str, str] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    signature: dict[str, str] | None = None

    @property
    def sha256(self) -> str:
        lines = "".join(f"{e.sha256}  {e.path}\n" for e in sorted(self.files, key=lambda e: e.path))
        return hashlib.sha256(lines.encode()).hexdigest()

    @property
    def size(self) -> int:
        return sum(e.size for e in self.files)

    def unsigned_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("signature")
        data["files"] = sorted(data["files"], key=lambda e: e["path"])
        data["schema"] = MANIFEST_SCHEMA
        data["sha256"] = self.sha256
        data["size"] = self.size
        return data

    def canonical_bytes(self) -> bytes:
        return json.dumps(self.unsigned_dict(), sort_keys=True, separators=(",", ":")).encode()

    def to_json(self) -> str:
        data = self.unsigned_dict()
        data["signature"] = self.signature
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        try:
            data = json.loads(text)
            if data.get("schema") != MANIFEST_SCHEMA:
                raise ValueError(f"schema is {data.get('schema')!r}, expected {MANIFEST_SCHEMA!r}")
            manifest = cls(
                name=data["name"],
                version=str(data["version"]),
                kind=data["kind"],
                format=data["format"],
                files=[FileEntry(f["path"], int(f["size"]), f["sha256"]) for f in data["files"]],
                derived_from=data.get("derived_from"),
                metadata=data.get("metadata") or {},
                signature=data.get("signature"),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ArtifactVerificationError(f"malformed manifest: {exc}") from exc
        if data.get("sha256") != manifest.sha256:
            raise ArtifactVerificationError("manifest sha256 does not match its file list")
        return manifest


def build_manifest(
    artifact_dir: Path,
    *,
    name: str,
    version: str,
    kind: str,
    format: str,
    derived_from: dict[str, str] | None = None,
    metadata: dict[str, Any] | None = None,
) -> Manifest:
    if kind not in ARTIFACT_KINDS:
        raise ValueError(f"unknown artifact kind {kind!r}")
    if format not in ARTIFACT_FORMATS:
        raise ValueError(f"unknown artifact format {format!r}")
    files = [
        FileEntry(p.relative_to(artifact_dir).as_posix(), p.stat().st_size, sha256_file(p))
        for p in sorted(artifact_dir.rglob("*"))
        if p.is_file()
    ]
    if not files:
        raise ValueError(f"artifact directory {artifact_dir} is empty")
    return Manifest(name, version, kind, format, files, derived_from, dict(metadata or {}))


# --- keys ---------------------------------------------------------------------------------------------


def key_id(public_key: Ed25519PublicKey) -> str:
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def load_or_create_signing_key(path: Path) -> Ed25519PrivateKey:
    """The private key at ``path`` (PEM, mode 0600), created on first use with its ``.pub`` beside it."""
    if path.exists():
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ConfigurationError(f"{path} is not an Ed25519 private key")
        return key
    path.parent.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    public_path(path).write_bytes(public_pem(key.public_key()))
    return key


def public_path(private_path: Path) -> Path:
    return private_path.with_name(private_path.name + ".pub")


def public_pem(public_key: Ed25519PublicKey) -> bytes:
    return public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def load_public_key(path: Path) -> Ed25519PublicKey:
    try:
        key = serialization.load_pem_public_key(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise ConfigurationError(f"cannot read public key {path}: {exc}") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise ConfigurationError(f"{path} is not an Ed25519 public key")
    return key


# --- sign and verify -------------------------------------------------------------------------------------


def sign_manifest(manifest: Manifest, key: Ed25519PrivateKey) -> Manifest:
    signature = key.sign(manifest.canonical_bytes())
    manifest.signature = {
        "alg": SIGNATURE_ALG,
        "key_id": key_id(key.public_key()),
        "value": base64.b64encode(signature).decode(),
    }
    return manifest


def verify_signature(manifest: Manifest, trusted_keys: Iterable[Ed25519PublicKey]) -> str:
    """Return the id of the trusted key that signed ``manifest``; raise when none did."""
    sig = manifest.signature
    if not sig or sig.get("alg") != SIGNATURE_ALG:
        raise ArtifactVerificationError(f"{manifest.name}: manifest is not signed with {SIGNATURE_ALG}")
    by_id = {key_id(k): k for k in trusted_keys}
    key = by_id.get(sig.get("key_id", ""))
    if key is None:
        raise ArtifactVerificationError(f"{manifest.name}: signed by untrusted key {sig.get('key_id')!r}")
    try:
        key.verify(base64.b64decode(sig["value"]), manifest.canonical_bytes())
    except (InvalidSignature, ValueError) as exc:
        raise ArtifactVerificationError(f"{manifest.name}: bad signature") from exc
    return sig["key_id"]


def verify_files(manifest: Manifest, artifact_dir: Path) -> None:
    """Check that ``artifact_dir`` holds exactly the manifest's files with the manifest's hashes."""
    listed = {e.path for e in manifest.files}
    present = {p.relative_to(artifact_dir).as_posix() for p in artifact_dir.rglob("*") if p.is_file()}
    extra = sorted(present - listed)
    if extra:
        raise ArtifactVerificationError(f"{artifact_dir / extra[0]}: file not listed in the manifest")
    for entry in manifest.files:
        path = artifact_dir / entry.path
        if not path.is_file():
            raise ArtifactVerificationError(f"{path}: missing")
        if path.stat().st_size != entry.size:
            raise ArtifactVerificationError(f"{path}: size {path.stat().st_size} != {entry.size}")
        if sha256_file(path) != entry.sha256:
            raise ArtifactVerificationError(f"{path}: sha256 mismatch")


def write_signed_manifest(manifest: Manifest, key: Ed25519PrivateKey, path: Path) -> Manifest:
    sign_manifest(manifest, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(manifest.to_json())
    return manifest


def read_manifest(path: Path) -> Manifest:
    try:
        return Manifest.from_json(path.read_text())
    except OSError as exc:
        raise ArtifactVerificationError(f"{path}: cannot read manifest: {exc}") from exc

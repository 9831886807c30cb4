"""The registry's artifacts: recording them (signed manifests, bytes in the artifact store), pushing a path
from disk, reading them back and exporting one for ``tierline cloud publish``.

An artifact's manifest (:class:`shared.artifacts.Manifest`) names the model and version, lists every file with
its sha256 and size, and is signed with the platform key; it is stored as a blob beside the files and kept in
``model_artifact.manifest``. The artifact's ``sha256`` is the manifest digest, so it names the whole file set.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlmodel import Session, select

from controlplane.registry.service import (
    ARTIFACT_STATUSES,
    EDGE_MODEL_FILE,
    MANIFEST_FILE,
    STABLE,
    TOKENIZER_FILES,
    UPSTREAM,
    Servability,
    _audit,
    aliases_of,
    artifacts_of,
    check_alias,
    check_checkpoint,
    check_kind,
    check_label,
    check_name,
    check_serving,
    check_tags,
    check_target_format,
    ensure_model,
    infer_format,
    is_safe_relpath,
    list_versions,
    move_alias,
    pair_target,
    read_checkpoint_config,
    register_version,
    resolve,
    set_serving,
)
from controlplane.registry.store import ArtifactStore, PayloadTooLargeError
from controlplane.storage.tables import Model, ModelArtifact, ModelVersion
from shared.architectures import model_type_of
from shared.artifacts import FileEntry, Manifest, load_or_create_signing_key, read_manifest, sign_manifest
from shared.errors import ArtifactVerificationError, ConflictError, NotFoundError, ValidationError
from shared.settings import CoreSettings


def platform_signing_key() -> Ed25519PrivateKey:
    """The key edge releases are signed with (``$TIERLINE_DATA_DIR/keys``), created on first use."""
    return load_or_create_signing_key(CoreSettings().signing_key_path)


def _check_files(files: Sequence[FileEntry]) -> None:
    if not files:
        raise ValidationError("an artifact needs at least one file", param="file")
    for entry in files:
        if not is_safe_relpath(entry.path) or entry.path == MANIFEST_FILE:
            raise ValidationError(f"file path {entry.path!r} is not allowed in an artifact", param="file")
    if len({e.path for e in files}) != len(files):
        raise ValidationError("two files of the artifact have the same path", param="file")


EDGE_LM_FORMATS = ("onnx", "onnx-int8", "tflite", "gguf")


def release_name(model: Model, target: str, format: str) -> str:
    """The name an artifact is signed (and published to devices) under: the model's, and for an LM's edge formats
    the model's with the format after it (``acme-edge-onnx-int8``), so a device can hold every format of one
    version side by side and its runtime guard serves the best under the model's name (``acme-edge``)."""
    if target != "edge" or model.kind != "causal-lm" or format not in EDGE_LM_FORMATS:
        return model.name
    suffix = f"-{format}"
    return model.name if model.name.endswith(suffix) else model.name + suffix


def _signed_manifest(
    store: ArtifactStore,
    model: Model,
    version: ModelVersion,
    *,
    target: str,
    format: str,
    files: Sequence[FileEntry],
    signing_key: Ed25519PrivateKey,
    derived_from: dict[str, str] | None,
    metadata: dict[str, Any] | None,
) -> tuple[Manifest, dict[str, Any], str]:
    """Sign the artifact's manifest and store it as a blob too: ``(manifest, its JSON, its blob's uri)``."""
    check_target_format(target, format)
    _check_files(files)
    manifest = Manifest(
        name=release_name(model, target, format),
        version=str(version.number),
        kind=model.kind,
        format=format,
        files=sorted(files, key=lambda e: e.path),
        derived_from=derived_from,
        metadata={"target": target, **(metadata or {})},
    )
    sign_manifest(manifest, signing_key)
    text = manifest.to_json()
    return manifest, json.loads(text), store.put_bytes(text.encode()).uri


def add_artifact(
    session: Session,
    store: ArtifactStore,
    model: Model,
    version: ModelVersion,
    *,
    target: str,
    format: str,
    files: list[FileEntry],
    signing_key: Ed25519PrivateKey,
    actor: str,
    derived_from: dict[str, str] | None = None,
    metadata: dict[str, Any] | None = None,
    status: str = "ready",
) -> ModelArtifact:
    """Record an artifact whose files are already blobs in ``store``: sign its manifest, store that too."""
    assert version.id is not None
    manifest, data, uri = _signed_manifest(
        store,
        model,
        version,
        target=target,
        format=format,
        files=files,
        signing_key=signing_key,
        derived_from=derived_from,
        metadata=metadata,
    )
    artifact = ModelArtifact(
        version_id=version.id,
        target=target,
        format=format,
        sha256=manifest.sha256,
        size=manifest.size,
        uri=uri,
        manifest=data,
        status=status,
    )
    session.add(artifact)
    session.flush()
    _audit(
        session, actor, "model.artifact.add", f"model/{model.name}/{version.number}", None, _artifact_audit(artifact)
    )
    return artifact


def _artifact_audit(a: ModelArtifact) -> dict[str, Any]:
    return {"target": a.target, "format": a.format, "sha256": a.sha256, "size": a.size, "status": a.status}


def add_pending_artifact(session: Session, version: ModelVersion, *, target: str, format: str) -> ModelArtifact:
    """A placeholder for an artifact a background job is making (``status`` pending, no bytes yet)."""
    assert version.id is not None
    check_target_format(target, format)
    artifact = ModelArtifact(
        version_id=version.id, target=target, format=format, sha256="", size=0, uri="", status="pending"
    )
    session.add(artifact)
    session.flush()
    return artifact


def complete_artifact(
    session: Session,
    store: ArtifactStore,
    model: Model,
    version: ModelVersion,
    artifact: ModelArtifact,
    *,
    files: list[FileEntry],
    signing_key: Ed25519PrivateKey,
    actor: str,
    status: str = "ready",
    derived_from: dict[str, str] | None = None,
    metadata: dict[str, Any] | None = None,
) -> ModelArtifact:
    """Fill a pending artifact with its files and signed manifest; ``status`` ready or rejected."""
    if status not in ARTIFACT_STATUSES:
        raise ValueError(f"unknown artifact status {status!r}")
    manifest, data, uri = _signed_manifest(
        store,
        model,
        version,
        target=artifact.target,
        format=artifact.format,
        files=files,
        signing_key=signing_key,
        derived_from=derived_from,
        metadata=metadata,
    )
    artifact.sha256, artifact.size, artifact.uri, artifact.manifest = manifest.sha256, manifest.size, uri, data
    artifact.status = status
    session.add(artifact)
    session.flush()
    _audit(
        session, actor, "model.artifact.add", f"model/{model.name}/{version.number}", None, _artifact_audit(artifact)
    )
    return artifact


def fail_artifact(
    session: Session, model: Model, version: ModelVersion, artifact: ModelArtifact, *, reason: str, actor: str
) -> None:
    """A pending artifact that could not be made: ``failed``, with the reason in its manifest."""
    artifact.status = "failed"
    artifact.manifest = {"error": reason[:2000]}
    session.add(artifact)
    session.flush()
    _audit(
        session,
        actor,
        "model.artifact.fail",
        f"model/{model.name}/{version.number}",
        None,
        {"target": artifact.target, "format": artifact.format, "error": reason[:500]},
    )


def materialize(store: ArtifactStore, artifact: ModelArtifact, dest: Path) -> Path:
    """Write ``artifact``'s files under ``dest`` from the store, each checked against its manifest hash."""
    manifest = Manifest.from_json(json.dumps(artifact.manifest))
    for entry in manifest.files:
        if not is_safe_relpath(entry.path):
            raise ArtifactVerificationError(f"manifest of artifact {artifact.id} lists an unsafe path {entry.path!r}")
        store.fetch(entry.sha256, dest / entry.path)
    return dest


# --- pushing a path ------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class LocalArtifact:
    """What a path on disk holds, as the registry will record it."""

    target: str
    format: str
    kind: str
    files: list[tuple[str, Path]]
    metadata: dict[str, Any] = field(default_factory=dict)


def inspect_path(path: Path) -> LocalArtifact:
    """Recognise an HF checkpoint dir, an ``.onnx`` (``.tflite``, TensorRT plan) file or an edge artifact dir."""
    if path.is_file():
        target, format = infer_format([path.name])
        kind = "causal-lm" if format == "tflite" else "tensor"
        return LocalArtifact(target, format, kind, [(path.name, path)])
    if not path.is_dir():
        raise ValidationError(f"{path}: no such file or directory", param="path")
    files = sorted((p.relative_to(path).as_posix(), p) for p in path.rglob("*") if p.is_file())
    if (path / EDGE_MODEL_FILE).is_file():
        try:
            format = str(json.loads((path / EDGE_MODEL_FILE).read_text())["format"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ValidationError(f"{path / EDGE_MODEL_FILE}: no format ({exc})", param="path") from None
        listed = [(rel, p) for rel, p in files if rel != MANIFEST_FILE]
        if (path / MANIFEST_FILE).is_file():
            _check_against_manifest(path, listed)
        check_target_format("edge", format)
        return LocalArtifact("edge", format, "causal-lm", listed)
    if (path / "config.json").is_file() and any(rel.endswith(".safetensors") for rel, _ in files):
        return LocalArtifact("cloud", "hf-safetensors", "causal-lm", files)
    if (path / "config.json").is_file() and any((path / n).is_file() for n in TOKENIZER_FILES):
        return LocalArtifact("cloud", "hf-tokenizer", "causal-lm", files)  # a tokenizer without weights
    if len(files) == 1:
        return inspect_path(files[0][1])
    raise ValidationError(
        f"{path}: not an HF checkpoint (config.json + *.safetensors), a tokenizer (config.json + tokenizer.json), "
        "an edge artifact (edge_model.json) or a single .onnx file",
        param="path",
    )


def _check_against_manifest(root: Path, files: list[tuple[str, Path]]) -> None:
    """An edge release directory carries its manifest: its bytes must still be what it says."""
    from shared.artifacts import sha256_file

    manifest = read_manifest(root / MANIFEST_FILE)
    expected = {e.path: e.sha256 for e in manifest.files}
    present = {rel: p for rel, p in files}
    if set(expected) != set(present):
        raise ArtifactVerificationError(f"{root}: files differ from its manifest.json")
    for rel, p in present.items():
        if sha256_file(p) != expected[rel]:
            raise ArtifactVerificationError(f"{p}: sha256 differs from its manifest.json")


def servability_of(format: str, config_json: bytes | None, *, has_serving: bool) -> Servability | None:
    """What serves a cloud artifact of ``format`` whose ``config.json`` holds ``config_json``: decided for a
    checkpoint (refused when nothing here serves it and no serving spec names an upstream), and for a tokenizer
    pushed with a serving spec; None for anything else."""
    if format == "hf-safetensors":
        if config_json is None:
            raise ValidationError("a checkpoint needs a config.json", param="config.json")
        return check_checkpoint(read_checkpoint_config(config_json), has_serving=has_serving)
    if format == "hf-tokenizer" and has_serving and config_json is not None:
        try:
            model_type = model_type_of(read_checkpoint_config(config_json))
        except ValidationError:
            model_type = ""
        return Servability(model_type, (UPSTREAM,))
    return None


@dataclass(frozen=True, slots=True)
class Pushed:
    model: Model
    version: ModelVersion
    artifact: ModelArtifact
    servability: Servability | None = None


def push_path(
    session: Session,
    store: ArtifactStore,
    path: Path,
    *,
    name: str,
    kind: str | None = None,
    label: str | None = None,
    tags: Iterable[str] = (),
    alias: str | None = None,
    actor: str,
    signing_key: Ed25519PrivateKey,
    serving: dict[str, Any] | None = None,
) -> Pushed:
    """Upload ``path``'s files to the store, then register a version holding them (and move ``alias``). With
    ``serving`` (a serving spec), an ``openai`` backend answers the version; ``path`` gives its tokenizer."""
    check_name(name)
    if serving is not None:
        check_serving(serving)  # refused before any upload
    if kind is not None:
        check_kind(kind)
    label, tag_list = check_label(label), check_tags(tags)
    if alias is not None:
        check_alias(alias)
    local = inspect_path(path)
    with tempfile.TemporaryDirectory(prefix="tierline-push-") as staging:
        _add_converted_tokenizer(local, Path(staging))
        return _push_local(
            session,
            store,
            path,
            local,
            name=name,
            kind=kind,
            label=label,
            tags=tag_list,
            alias=alias,
            actor=actor,
            signing_key=signing_key,
            serving=serving,
        )


def _add_converted_tokenizer(local: LocalArtifact, staging: Path) -> None:
    """A checkpoint with only a SentencePiece ``tokenizer.model`` gets the ``tokenizer.json`` transformers would
    convert it to (every tier reads tokenizer.json); without the packages to convert, the push is refused."""
    names = {rel for rel, _ in local.files}
    if local.format != "hf-safetensors" or "tokenizer.json" in names or "tokenizer.model" not in names:
        return
    from shared.errors import ConfigurationError
    from shared.zoo.tokenizer_convert import ensure_tokenizer_json

    source = dict(local.files)["tokenizer.model"].parent
    try:
        converted = ensure_tokenizer_json(source, out_dir=staging)
    except ConfigurationError as exc:
        raise ValidationError(exc.message, param="tokenizer.model") from None
    local.files.append(("tokenizer.json", converted))


def _push_local(
    session: Session,
    store: ArtifactStore,
    path: Path,
    local: LocalArtifact,
    *,
    name: str,
    kind: str | None,
    label: str | None,
    tags: list[str],
    alias: str | None,
    actor: str,
    signing_key: Ed25519PrivateKey,
    serving: dict[str, Any] | None,
) -> Pushed:
    tag_list = tags
    config = dict(local.files).get("config.json") if local.target == "cloud" else None
    servability = servability_of(
        local.format, config.read_bytes() if config is not None else None, has_serving=serving is not None
    )
    if servability is not None:
        local.metadata.update(servability.metadata())
    total = 0
    entries: list[FileEntry] = []
    for rel, p in local.files:
        total += p.stat().st_size
        if total > store.max_bytes:
            raise PayloadTooLargeError(f"{path} exceeds the size limit of {store.max_bytes} bytes")
        blob = store.put_file(p)
        entries.append(FileEntry(rel, blob.size, blob.sha256))
    model = ensure_model(session, name, kind or _default_kind(session, name, local.kind), actor=actor)
    version = register_version(
        session, model, label=label, source=str(path.resolve())[:500], tags=tag_list, actor=actor
    )
    artifact = add_artifact(
        session,
        store,
        model,
        version,
        target=local.target,
        format=local.format,
        files=entries,
        signing_key=signing_key,
        actor=actor,
        metadata=local.metadata,
    )
    if serving is not None:
        version = set_serving(session, model, version.number, serving, actor=actor)
    if alias is not None:
        move_alias(session, model, alias, version.number, actor=actor)
    return Pushed(model, version, artifact, servability)


def _default_kind(session: Session, name: str, guessed: str) -> str | None:
    """An existing model keeps its kind; a new one takes what its files suggest."""
    exists = session.exec(select(Model.id).where(Model.name == name)).first() is not None
    return None if exists else guessed


# --- pairing --------------------------------------------------------------------------------------------------


def tokenizer_vocabulary(session: Session, store: ArtifactStore, model: Model) -> str | None:
    """The vocabulary sha256 (``shared.edge_protocol.vocabulary_sha256``) of the ``tokenizer.json`` of ``model``'s
    ``stable`` version (else its newest version that has one); None when it has none."""
    from tokenizers import Tokenizer

    from shared.edge_protocol import vocabulary_sha256

    versions = list_versions(session, model)
    stable = aliases_of(session, model).get(STABLE)
    ordered = sorted(versions, key=lambda v: (v.number != stable, -v.number))
    arts = artifacts_of(session, [v.id for v in ordered if v.id is not None])
    for version in ordered:
        for artifact in arts.get(version.id or 0, []):
            if artifact.status != "ready":
                continue
            files = (artifact.manifest or {}).get("files") or []
            entry = next((f for f in files if isinstance(f, dict) and f.get("path") == "tokenizer.json"), None)
            if entry is None:
                continue
            try:
                return vocabulary_sha256(Tokenizer.from_str(store.read_bytes(str(entry["sha256"])).decode()))
            except Exception:  # an unreadable tokenizer compares as different
                return None
    return None


def default_resend(session: Session, store: ArtifactStore, edge: Model, cloud_model: str) -> str:
    """``as-sent`` when both models are in the registry and their tokenizers share a vocabulary, else ``text``."""
    target = pair_target(session, edge, cloud_model)
    if edge.kind != "causal-lm":
        return "as-sent"  # rows of numbers: nothing to re-tokenise
    if target is None:
        return "text"
    mine, theirs = tokenizer_vocabulary(session, store, edge), tokenizer_vocabulary(session, store, target)
    return "as-sent" if mine is not None and mine == theirs else "text"


# --- export for the fleet -------------------------------------------------------------------------------------


def export_artifact(
    session: Session, store: ArtifactStore, name: str, ref: str, format: str, out: Path
) -> tuple[Path, Path]:
    """Write a ready artifact of version ``ref`` (a number or an alias) laid out like a built zoo, under the name
    it is signed with (``release_name``: ``<name>-<format>`` for an LM's edge formats): ``out/artifacts/<release>/``
    (its files, hashes checked) and ``out/manifests/<release>.json`` (its signed manifest), so ``tierline cloud
    publish out/artifacts/<release>`` offers it to devices as ``<release>`` version ``<number>``. A rejected or
    failed artifact is refused."""
    version = resolve(session, name, ref)
    found = [a for a in artifacts_of(session, [version.id or 0])[version.id or 0] if a.format == format]
    if not found:
        raise NotFoundError(f"version {version.number} of {name} has no {format} artifact", param="format")
    artifact = found[-1]
    if artifact.status != "ready":
        raise ConflictError(
            f"the {format} artifact of {name} version {version.number} is {artifact.status}; only a ready one "
            "is exported",
            param="format",
        )
    manifest = Manifest.from_json(json.dumps(artifact.manifest))
    files_dir, manifest_path = out / "artifacts" / manifest.name, out / "manifests" / f"{manifest.name}.json"
    if files_dir.exists() or manifest_path.exists():
        raise ConflictError(f"{files_dir} or {manifest_path} exists; export somewhere new", param="out")
    materialize(store, artifact, files_dir)
    manifest_path.parent.mkdir(parents=True, exist_ok=True)
    manifest_path.write_text(manifest.to_json())
    return files_dir, manifest_path

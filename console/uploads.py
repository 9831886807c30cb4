"""Streamed multipart uploads into the artifact store, shared by ``POST /api/models/{name}/versions`` and the
Models page's upload form.

File parts stream into the store's staging area, hashed on the way and capped at the store's size limit (an
announced ``Content-Length`` past it is refused before a byte is read); text fields are small and kept in memory.
Nothing is visible in the store until the caller commits the staged blobs, and :meth:`StagedUpload.discard`
drops whatever was not committed.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio.to_thread
from litestar import Request
from multipart import MultipartError, MultipartSegment, PushMultipartParser, parse_options_header
from sqlalchemy.engine import Engine

from controlplane.registry import artifacts as registry_artifacts
from controlplane.registry import service as registry
from controlplane.registry.store import ArtifactStore, BlobWriter, PayloadTooLargeError
from controlplane.storage.session import session_scope
from shared.artifacts import FileEntry, Manifest
from shared.errors import ConfigurationError, ValidationError

MAX_FIELD_BYTES = 4096
MAX_PARTS = 1000
# Multipart framing (boundaries, part headers) on top of the artifact's bytes, allowed before the early 413.
FRAMING_SLACK_BYTES = 1 << 20


@dataclass(slots=True)
class StagedUpload:
    """A multipart upload as received: its text fields and its file parts, staged (not yet stored) by path."""

    fields: dict[str, list[str]] = field(default_factory=dict)
    files: list[tuple[str, BlobWriter]] = field(default_factory=list)

    def one(self, name: str) -> str | None:
        """The field's value, ``None`` when absent; sent twice is an error."""
        values = self.fields.get(name, [])
        if len(values) > 1:
            raise ValidationError(f"{name}: send it once", param=name)
        return values[0] if values else None

    def text(self, name: str) -> str | None:
        """The field's first value stripped, ``None`` when absent or blank (an HTML form sends every field)."""
        values = self.fields.get(name, [])
        return (values[0].strip() or None) if values else None

    def discard(self) -> None:
        for _, writer in self.files:
            writer.discard()


def too_large(store: ArtifactStore, size: int | None = None) -> PayloadTooLargeError:
    what = f"upload of {size} bytes" if size is not None else "artifact"
    return PayloadTooLargeError(
        f"{what} exceeds the artifact size limit of {store.max_bytes} bytes (TIERLINE_MAX_ARTIFACT_BYTES)",
        param="file",
    )


async def receive_upload(
    request: Request[Any, Any, Any],
    store: ArtifactStore,
    upload: StagedUpload,
    *,
    fields: Collection[str],
    ignore_unknown_fields: bool = False,
    base_names: bool = False,
) -> None:
    """Stream ``request``'s multipart body into ``upload``.

    Args:
        fields: the text fields kept; another one is an error, or dropped with ``ignore_unknown_fields`` (a
            browser form also sends its CSRF token and buttons).
        base_names: keep only a file's base name (browsers send that; old ones a client path). Otherwise a
            file name is a relative path inside the artifact. An empty file input is skipped either way.
    """
    content_type, options = parse_options_header(request.headers.get("content-type", ""))
    boundary = options.get("boundary")
    if content_type != "multipart/form-data" or not boundary:
        raise ValidationError("send the artifact as multipart/form-data with one or more 'file' parts", param="file")
    announced = request.headers.get("content-length", "")
    if announced.isascii() and announced.isdigit() and int(announced) > store.max_bytes + FRAMING_SLACK_BYTES:
        raise too_large(store, int(announced))
    total = 0
    part: MultipartSegment | None = None
    writer: BlobWriter | None = None
    value = bytearray()
    try:
        with PushMultipartParser(boundary, max_segment_count=MAX_PARTS) as parser:
            async for chunk in request.stream():
                for event in parser.parse(chunk):
                    if isinstance(event, MultipartSegment):
                        part, value = event, bytearray()
                        writer = _start_part(upload, store, event, total, fields, ignore_unknown_fields, base_names)
                    elif event is None:  # the end of a part
                        assert part is not None
                        if writer is not None:
                            total += writer.size
                            await anyio.to_thread.run_sync(writer.finish)
                        elif part.filename is None and part.name in fields:
                            upload.fields.setdefault(part.name, []).append(value.decode("utf-8", "replace"))
                        part, writer = None, None
                    elif writer is not None:
                        await anyio.to_thread.run_sync(writer.write, event)
                    elif part is not None and part.filename is None:
                        value += event
                        if len(value) > MAX_FIELD_BYTES:
                            raise ValidationError(f"{part.name}: longer than {MAX_FIELD_BYTES} bytes", param=part.name)
                if parser.closed:
                    break
    except MultipartError as exc:
        raise ValidationError(f"malformed multipart body: {exc}", param="file") from None
    if not upload.files:
        raise ValidationError("the upload holds no file: send one or more 'file' parts", param="file")


def _start_part(
    upload: StagedUpload,
    store: ArtifactStore,
    part: MultipartSegment,
    total: int,
    fields: Collection[str],
    ignore_unknown_fields: bool,
    base_names: bool,
) -> BlobWriter | None:
    if part.filename is None:
        if part.name not in fields and not ignore_unknown_fields:
            raise ValidationError(f"unknown form field {part.name!r}; expected {', '.join(fields)}", param=part.name)
        return None
    if part.name != "file":
        raise ValidationError(f"file parts are named 'file', not {part.name!r}", param=part.name)
    if part.filename == "":
        return None  # a file input left empty
    path = part.filename.replace("\\", "/").rsplit("/", 1)[-1] if base_names else part.filename
    if not registry.is_safe_relpath(path) or path == registry.MANIFEST_FILE:
        raise ValidationError(f"file name {path!r} is not a safe relative path inside an artifact", param="file")
    if any(existing == path for existing, _ in upload.files):
        raise ValidationError(f"file {path!r} is sent twice", param="file")
    writer = store.writer(max_bytes=store.max_bytes - total, what="artifact")
    upload.files.append((path, writer))
    return writer


@dataclass(frozen=True, slots=True)
class VersionUpload:
    """What an upload says about the version it registers (absent fields are ``None``)."""

    name: str
    kind: str | None = None
    label: str | None = None
    alias: str | None = None
    tags: tuple[str, ...] = ()
    target: str | None = None
    format: str | None = None
    description: str = ""
    sha256: str | None = None
    serving: dict[str, Any] | None = None  # a serving spec: an ``openai`` backend answers the version


def register_upload(
    engine: Engine, store: ArtifactStore, upload: StagedUpload, form: VersionUpload, actor: str
) -> dict[str, Any]:
    """Check the form and the staged files, store them and register the version (run it in a worker thread).

    ``form.sha256`` is the expected hash of the file (one file) or of the artifact's manifest digest (several).
    Returns the version as JSON with its model's name under ``model``.
    """
    name = registry.check_name(form.name)
    if form.kind is not None:
        registry.check_kind(form.kind)
    label = registry.check_label(form.label)
    if form.alias is not None:
        registry.check_alias(form.alias)
    tags = registry.check_tags(form.tags)
    target, format = form.target, form.format
    if format is None:
        inferred_target, format = registry.infer_format([p for p, _ in upload.files])
        target = target or inferred_target
    elif target is None:  # a format names its target unless it is onnx, which both have (cloud, then)
        target = "cloud" if format in registry.FORMATS["cloud"] else "edge"
    registry.check_target_format(target, format)
    if form.serving is not None:
        registry.check_serving(form.serving)
    entries = [FileEntry(path, w.size, w.finish()) for path, w in upload.files]
    config = next((w for path, w in upload.files if path == "config.json"), None) if target == "cloud" else None
    servability = registry_artifacts.servability_of(
        format, config.path.read_bytes() if config is not None else None, has_serving=form.serving is not None
    )
    if form.sha256 is not None:
        expected = form.sha256.strip().lower()
        digest = entries[0].sha256 if len(entries) == 1 else Manifest("", "", "", "", entries).sha256
        if expected != digest:
            what = "the file" if len(entries) == 1 else "the artifact (its manifest digest)"
            raise ValidationError(f"sha256 of {what} is {digest}, not the expected {expected}", param="sha256")
    converted = _converted_tokenizer(store, upload, format) if target == "cloud" else None
    for _, w in upload.files:
        w.commit()
    if converted is not None:
        entries.append(converted)
    key = registry_artifacts.platform_signing_key()
    with session_scope(engine) as session:
        model = registry.ensure_model(session, name, form.kind, description=form.description, actor=actor)
        version = registry.register_version(
            session, model, label=label, source=f"upload by {actor}", tags=tags, actor=actor
        )
        artifact = registry_artifacts.add_artifact(
            session,
            store,
            model,
            version,
            target=target,
            format=format,
            files=entries,
            signing_key=key,
            actor=actor,
            metadata=servability.metadata() if servability is not None else None,
        )
        if form.serving is not None:
            version = registry.set_serving(session, model, version.number, form.serving, actor=actor)
        if form.alias is not None:
            registry.move_alias(session, model, form.alias, version.number, actor=actor)
        body = registry.version_json(version, [artifact], [form.alias] if form.alias else [])
        return {
            "model": model.name,
            **body,
            "served_by": servability.summary() if servability is not None else None,
        }


def _converted_tokenizer(store: ArtifactStore, upload: StagedUpload, format: str) -> FileEntry | None:
    """A checkpoint uploaded with only a SentencePiece ``tokenizer.model`` gets the ``tokenizer.json`` transformers
    converts it to (every tier reads that file), stored, as ``tierline models push`` adds it; None when there is
    nothing to convert. A conversion that fails refuses the upload, naming the fix."""
    from shared.zoo.tokenizer_convert import ensure_tokenizer_json

    staged = {path: w.path for path, w in upload.files}
    if format != "hf-safetensors" or "tokenizer.json" in staged or "tokenizer.model" not in staged:
        return None
    with tempfile.TemporaryDirectory(prefix="tierline-tokenizer-") as tmp:
        for name in ("tokenizer.model", "tokenizer_config.json", "special_tokens_map.json", "config.json"):
            if name in staged:  # under their own names: the converter reads them by name
                shutil.copyfile(staged[name], Path(tmp) / name)
        try:
            blob = store.put_file(ensure_tokenizer_json(Path(tmp)))
        except ConfigurationError as exc:
            raise ValidationError(exc.message, param="tokenizer.model") from None
    return FileEntry("tokenizer.json", blob.size, blob.sha256)

"""The model registry under ``/api/models``: models, versions, artifacts, aliases (issue 7).

Reads need a console API token; changes need an admin. ``POST /api/models/{name}/versions`` takes a
``multipart/form-data`` upload and streams each file part into the artifact store (staged on disk, hashed on
the way, never held in memory), capped at ``TIERLINE_MAX_ARTIFACT_BYTES`` (413) and checked against the
``sha256`` field when the client sends one (400). Handlers are thin: the rules live in :mod:`shared.registry`
and :mod:`shared.edge_derive`, which also write the audit rows.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio.to_thread
from litestar import Litestar, Request, Router, get, post, put
from litestar.datastructures import State
from litestar.di import Provide
from multipart import MultipartError, MultipartSegment, PushMultipartParser, parse_options_header
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.engine import Engine
from sqlmodel import Session

from console.api import Operator, require_operator
from shared import registry, registry_artifacts
from shared.artifact_store import ArtifactStore, BlobWriter, PayloadTooLargeError, store_from_settings
from shared.artifacts import FileEntry, Manifest
from shared.edge_derive import DeriveRunner, DeriveSettings, fail_stale_jobs, start_derive
from shared.errors import NotFoundError, ServiceUnavailableError, ValidationError
from shared.storage.session import session_scope

logger = logging.getLogger(__name__)

UPLOAD_FIELDS = ("kind", "label", "tag", "alias", "sha256", "target", "format", "description")
MAX_FIELD_BYTES = 4096
MAX_PARTS = 1000
# Multipart framing (boundaries, part headers) on top of the artifact's bytes, allowed before the early 413.
FRAMING_SLACK_BYTES = 1 << 20


def _store(state: State) -> ArtifactStore:
    store = state.get("artifact_store")
    if store is None:
        store = state.artifact_store = store_from_settings()
    assert isinstance(store, ArtifactStore)
    return store


# --- the upload ------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Upload:
    """A parsed multipart upload: form fields, and file parts staged (not yet stored) by path."""

    fields: dict[str, list[str]] = field(default_factory=dict)
    files: list[tuple[str, BlobWriter]] = field(default_factory=list)

    def one(self, name: str) -> str | None:
        values = self.fields.get(name, [])
        if len(values) > 1:
            raise ValidationError(f"{name}: send it once", param=name)
        return values[0] if values else None

    def discard(self) -> None:
        for _, writer in self.files:
            writer.discard()


async def receive_upload(request: Request[Any, Any, Any], store: ArtifactStore) -> Upload:
    """Stream ``request``'s multipart body: fields into memory (small), file parts into staged blobs."""
    content_type, options = parse_options_header(request.headers.get("content-type", ""))
    boundary = options.get("boundary")
    if content_type != "multipart/form-data" or not boundary:
        raise ValidationError("send the artifact as multipart/form-data with one or more 'file' parts", param="file")
    announced = request.headers.get("content-length")
    if announced and announced.isdigit() and int(announced) > store.max_bytes + FRAMING_SLACK_BYTES:
        raise PayloadTooLargeError(
            f"upload of {announced} bytes exceeds the artifact size limit of {store.max_bytes} bytes "
            "(TIERLINE_MAX_ARTIFACT_BYTES)"
        )
    upload = Upload()
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
                        writer = _start_part(upload, store, event, total)
                    elif event is None:  # the end of a part
                        assert part is not None
                        if writer is not None:
                            total += writer.size
                            await anyio.to_thread.run_sync(writer.finish)
                        else:
                            upload.fields.setdefault(part.name, []).append(value.decode("utf-8", "replace"))
                        part, writer = None, None
                    elif writer is not None:
                        await anyio.to_thread.run_sync(writer.write, event)
                    else:
                        value += event
                        if len(value) > MAX_FIELD_BYTES:
                            raise ValidationError(f"{part and part.name}: longer than {MAX_FIELD_BYTES} bytes")
                if parser.closed:
                    break
    except MultipartError as exc:
        upload.discard()
        raise ValidationError(f"malformed multipart body: {exc}", param="file") from None
    except BaseException:
        upload.discard()
        raise
    if not upload.files:
        raise ValidationError("the upload holds no 'file' part", param="file")
    return upload


def _start_part(upload: Upload, store: ArtifactStore, part: MultipartSegment, total: int) -> BlobWriter | None:
    if part.filename is None:
        if part.name not in UPLOAD_FIELDS:
            raise ValidationError(
                f"unknown form field {part.name!r}; expected {', '.join(UPLOAD_FIELDS)}", param=part.name
            )
        return None
    if part.name != "file":
        raise ValidationError(f"file parts are named 'file', not {part.name!r}", param=part.name)
    path = part.filename
    if not registry.is_safe_relpath(path) or path == registry.MANIFEST_FILE:
        raise ValidationError(f"file name {path!r} is not a safe relative path inside an artifact", param="file")
    if any(existing == path for existing, _ in upload.files):
        raise ValidationError(f"file {path!r} is sent twice", param="file")
    writer = store.writer(max_bytes=store.max_bytes - total, what="artifact")
    upload.files.append((path, writer))
    return writer


def _register_upload(engine: Engine, store: ArtifactStore, name: str, upload: Upload, actor: str) -> dict[str, Any]:
    """Check the staged files, store them and register the version (a worker thread)."""
    kind, label, alias = upload.one("kind"), upload.one("label"), upload.one("alias")
    target, format, expected = upload.one("target"), upload.one("format"), upload.one("sha256")
    tags = registry.check_tags(upload.fields.get("tag", []))
    registry.check_label(label)
    if kind is not None:
        registry.check_kind(kind)
    if alias is not None:
        registry.check_alias(alias)
    paths = [p for p, _ in upload.files]
    if format is None:
        inferred_target, format = registry.infer_format(paths)
        target = target or inferred_target
    elif target is None:  # a format names its target unless it is onnx, which both have (cloud, then)
        target = "cloud" if format in registry.FORMATS["cloud"] else "edge"
    registry.check_target_format(target, format)
    entries = [FileEntry(path, w.size, w.finish()) for path, w in upload.files]
    if expected is not None:
        expected = expected.strip().lower()
        digest = entries[0].sha256 if len(entries) == 1 else Manifest("", "", "", "", entries).sha256
        if expected != digest:
            what = "the file" if len(entries) == 1 else "the artifact (its manifest digest)"
            raise ValidationError(f"sha256 of {what} is {digest}, not the expected {expected}", param="sha256")
    for _, w in upload.files:
        w.commit()
    key = registry_artifacts.platform_signing_key()
    with session_scope(engine) as session:
        model = registry.ensure_model(session, name, kind, description=upload.one("description") or "", actor=actor)
        version = registry.register_version(
            session, model, label=label, source=f"upload by {actor}", tags=tags, actor=actor
        )
        artifact = registry_artifacts.add_artifact(
            session, store, model, version, target=target, format=format, files=entries, signing_key=key, actor=actor
        )
        if alias is not None:
            registry.move_alias(session, model, alias, version.number, actor=actor)
        return {"model": model.name, **registry.version_json(version, [artifact], [alias] if alias else [])}


@post("/models/{name:str}/versions", status_code=201, request_max_body_size=None)
async def push_version(request: Request[Any, Any, Any], state: State, operator: Operator, name: str) -> dict[str, Any]:
    """Register a new version from a multipart upload.

    Form: one or more ``file`` parts (the file name is the path inside the artifact, e.g. ``config.json``),
    and optionally ``kind`` (for a new model), ``target`` and ``format`` (inferred from the file names when
    absent), ``label``, ``tag`` (repeatable), ``alias``, ``description`` and ``sha256``: the expected hash of the
    file (one file) or of the artifact's manifest digest (several).
    """
    operator.require_admin()
    registry.check_name(name)
    store = _store(state)
    upload = await receive_upload(request, store)
    try:
        body: dict[str, Any] = await anyio.to_thread.run_sync(
            _register_upload, state.engine, store, name, upload, operator.actor
        )
        return body
    finally:
        upload.discard()


# --- reading and changing --------------------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AliasMove(_Body):
    version: int = Field(ge=1, description="the version number the alias points at from now on")


class StatusChange(_Body):
    status: str = Field(description="validated | active | retired (forward only)")
    reason: str = Field("", max_length=500)


class TagsChange(_Body):
    add: list[str] = Field(default_factory=list)
    remove: list[str] = Field(default_factory=list)


class DeriveRequest(_Body):
    min_int8_agreement: float | None = Field(
        None, ge=0.0, le=1.0, description="INT8 below this agreement with fp32 is rejected (default: the setting)"
    )
    tflite: bool | None = Field(None, description="also convert to TFLite (default: when litert-torch is installed)")


@get("/models", sync_to_thread=True)
def list_models(state: State, operator: Operator) -> dict[str, Any]:
    """Registered models with their aliases and latest version."""
    with Session(state.engine) as session:
        rows = [registry.model_json(session, m, with_versions=False) for m in registry.list_models(session)]
    return {"object": "list", "data": rows}


@get("/models/{name:str}", sync_to_thread=True)
def get_model(state: State, operator: Operator, name: str) -> dict[str, Any]:
    """One model with every version, its artifacts (status, sha256, size, signature key) and aliases."""
    with Session(state.engine) as session:
        return registry.model_json(session, registry.get_model(session, name))


def _version_body(session: Session, name: str, number: int) -> dict[str, Any]:
    body = registry.model_json(session, registry.get_model(session, name))
    for v in body["versions"]:
        if v["number"] == number:
            return {"model": name, **v}
    raise NotFoundError(f"model {name!r} has no version {number}", param="version")


@get("/models/{name:str}/versions/{number:int}", sync_to_thread=True)
def get_version(state: State, operator: Operator, name: str, number: int) -> dict[str, Any]:
    """One version (poll it to follow a derive job: its artifacts go from pending to ready/rejected/failed)."""
    with Session(state.engine) as session:
        return _version_body(session, name, number)


@put("/models/{name:str}/aliases/{alias:str}", status_code=200, sync_to_thread=True)
def move_alias(state: State, operator: Operator, name: str, alias: str, data: AliasMove) -> dict[str, Any]:
    """Point an alias at a version, atomically."""
    operator.require_admin()
    with session_scope(state.engine) as session:
        model = registry.get_model(session, name)
        registry.move_alias(session, model, alias, data.version, actor=operator.actor)
        return {"model": name, "alias": alias, "version": data.version, "aliases": registry.aliases_of(session, model)}


@post("/models/{name:str}/versions/{number:int}/status", status_code=200, sync_to_thread=True)
def change_status(state: State, operator: Operator, name: str, number: int, data: StatusChange) -> dict[str, Any]:
    """Move a version forward: registered → validated → active → retired."""
    operator.require_admin()
    with session_scope(state.engine) as session:
        registry.set_status(
            session, registry.get_model(session, name), number, data.status, actor=operator.actor, reason=data.reason
        )
        return _version_body(session, name, number)


@post("/models/{name:str}/versions/{number:int}/tags", status_code=200, sync_to_thread=True)
def change_tags(state: State, operator: Operator, name: str, number: int, data: TagsChange) -> dict[str, Any]:
    """Add and remove tags of a version."""
    operator.require_admin()
    with session_scope(state.engine) as session:
        model = registry.get_model(session, name)
        registry.tag_version(session, model, number, add=data.add, remove=data.remove, actor=operator.actor)
        return _version_body(session, name, number)


@post("/models/{name:str}/versions/{number:int}/derive", status_code=202, sync_to_thread=True)
def derive(
    state: State, operator: Operator, name: str, number: int, data: DeriveRequest | None = None
) -> dict[str, Any]:
    """Derive edge artifacts (ONNX fp32, INT8, TFLite) of a cloud checkpoint version, in the background.

    Answers at once with the new version (artifacts ``pending``); poll ``GET .../versions/{new}``.
    """
    operator.require_admin()
    runner = state.get("derive_runner")
    if not isinstance(runner, DeriveRunner):
        raise ServiceUnavailableError("this console runs no derive jobs")
    body = data or DeriveRequest()
    with session_scope(state.engine) as session:
        job = start_derive(
            session,
            name,
            number,
            actor=operator.actor,
            min_int8_agreement=body.min_int8_agreement,
            tflite=body.tflite,
        )
    runner.submit(job)
    with Session(state.engine) as session:
        return {**_version_body(session, name, job.number), "poll": f"/api/models/{name}/versions/{job.number}"}


@asynccontextmanager
async def derive_jobs(app: Litestar) -> AsyncIterator[None]:
    """Lifespan: the derive job runner lives while the console serves; stopping waits for the job in flight.
    Starting fails jobs a stopped console left pending for longer than TIERLINE_REGISTRY_DERIVE_STALE_AFTER_S."""
    await anyio.to_thread.run_sync(fail_stale_jobs, app.state.engine, DeriveSettings().derive_stale_after_s)
    runner = DeriveRunner(app.state.engine, _store(app.state), registry_artifacts.platform_signing_key())
    app.state.derive_runner = runner
    try:
        yield
    finally:
        app.state.derive_runner = None
        try:
            await anyio.to_thread.run_sync(runner.close)
        except Exception:
            logger.exception("stopping the derive job runner failed")


REGISTRY_ROUTER = Router(
    "/api",
    route_handlers=[
        list_models,
        get_model,
        get_version,
        push_version,
        move_alias,
        change_status,
        change_tags,
        derive,
    ],
    dependencies={"operator": Provide(require_operator, sync_to_thread=True)},
    security=[{"ConsoleToken": []}],
    tags=["registry"],
)

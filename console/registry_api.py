"""The model registry under ``/api/models``: models, versions, artifacts, aliases.

Reads need a console API token; changes need an admin. ``POST /api/models/{name}/versions`` takes a
``multipart/form-data`` upload and streams each file part into the artifact store (staged on disk, hashed on
the way, never held in memory), capped at ``TIERLINE_MAX_ARTIFACT_BYTES`` (413) and checked against the
``sha256`` field when the client sends one (400). Handlers are thin: the rules live in
:mod:`controlplane.registry.service`
and :mod:`controlplane.registry.edge_derive`, which also write the audit rows.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

import anyio.to_thread
from litestar import Request, get, post, put
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.engine import Engine
from sqlmodel import Session

from console.management_api import Operator, management_router
from console.uploads import StagedUpload, VersionUpload, receive_upload, register_upload
from controlplane.registry import artifacts as registry_artifacts
from controlplane.registry import service as registry
from controlplane.registry.edge_derive import DeriveRunner, DeriveSettings, fail_stale_jobs, start_derive
from controlplane.registry.store import ArtifactStore
from controlplane.storage.session import session_scope
from shared.errors import NotFoundError, ValidationError

logger = logging.getLogger(__name__)

UPLOAD_FIELDS = ("kind", "label", "tag", "alias", "sha256", "target", "format", "description", "serving")


@post("/models/{name:str}/versions", status_code=201, request_max_body_size=None)
async def push_version(
    request: Request[Any, Any, Any], db: Engine, artifacts: ArtifactStore, operator: Operator, name: str
) -> dict[str, Any]:
    """Register a new version from a multipart upload.

    Form: one or more ``file`` parts (the file name is the path inside the artifact, e.g. ``config.json``),
    and optionally ``kind`` (for a new model), ``target`` and ``format`` (inferred from the file names when
    absent), ``label``, ``tag`` (repeatable), ``alias``, ``description``, ``sha256``: the expected hash of the
    file (one file) or of the artifact's manifest digest (several), and ``serving``: a JSON serving spec (an
    ``openai`` backend answers the version).

    A checkpoint's ``config.json`` decides what serves it (``servable_by``, and ``served_by`` in words): an
    architecture tierline's engine does not run is a 400 naming the supported ones, unless ``serving`` is sent.
    """
    operator.require_admin()
    registry.check_name(name)
    upload = StagedUpload()
    try:
        await receive_upload(request, artifacts, upload, fields=UPLOAD_FIELDS)
        form = VersionUpload(
            name=name,
            kind=upload.one("kind"),
            label=upload.one("label"),
            alias=upload.one("alias"),
            tags=tuple(upload.fields.get("tag", [])),
            target=upload.one("target"),
            format=upload.one("format"),
            description=upload.one("description") or "",
            sha256=upload.one("sha256"),
            serving=_serving_field(upload.one("serving")),
        )
        body: dict[str, Any] = await anyio.to_thread.run_sync(
            register_upload, db, artifacts, upload, form, operator.actor
        )
        return body
    finally:
        upload.discard()  # what was committed is in the store; the rest goes


def _serving_field(value: str | None) -> dict[str, Any] | None:
    if value is None:
        return None
    try:
        spec = json.loads(value)
    except ValueError as exc:
        raise ValidationError(f"serving: not JSON ({exc})", param="serving") from None
    if not isinstance(spec, dict):
        raise ValidationError("serving: a JSON object, please", param="serving")
    return spec


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


class ServingChange(_Body):
    serving: dict[str, Any] | None = Field(
        description='a serving spec ({"backend": "openai", "endpoints": [...], "upstream_model": ...}); '
        "null: the built-in engine serves the version"
    )


class PairingChange(_Body):
    cloud_model: str | None = Field(
        description="the cloud model the edge model escalates to (a registry model, or a zoo id tierline/NAME); "
        "null: it answers locally"
    )
    resend: Literal["as-sent", "text"] | None = Field(
        None, description="default: as-sent when both tokenizers share a vocabulary, else text"
    )


class DeriveRequest(_Body):
    min_int8_agreement: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="INT8 below this agreement with the source checkpoint is rejected (default: the setting)",
    )
    tflite: bool | None = Field(None, description="also convert to TFLite (default: when litert-torch is installed)")


@get("/models", sync_to_thread=True)
def list_models(db: Engine, operator: Operator) -> dict[str, Any]:
    """Registered models with their aliases and latest version."""
    with Session(db) as session:
        rows = [registry.model_json(session, m, with_versions=False) for m in registry.list_models(session)]
    return {"object": "list", "data": rows}


@get("/models/{name:str}", sync_to_thread=True)
def get_model(db: Engine, operator: Operator, name: str) -> dict[str, Any]:
    """One model with every version, its artifacts (status, sha256, size, signature key) and aliases."""
    with Session(db) as session:
        return registry.model_json(session, registry.get_model(session, name))


def _version_body(session: Session, name: str, number: int) -> dict[str, Any]:
    body = registry.model_json(session, registry.get_model(session, name))
    for v in body["versions"]:
        if v["number"] == number:
            return {"model": name, **v}
    raise NotFoundError(f"model {name!r} has no version {number}", param="version")


@get("/models/{name:str}/versions/{number:int}", sync_to_thread=True)
def get_version(db: Engine, operator: Operator, name: str, number: int) -> dict[str, Any]:
    """One version (poll it to follow a derive job: its artifacts go from pending to ready/rejected/failed)."""
    with Session(db) as session:
        return _version_body(session, name, number)


@put("/models/{name:str}/aliases/{alias:str}", status_code=200, sync_to_thread=True)
def move_alias(db: Engine, operator: Operator, name: str, alias: str, data: AliasMove) -> dict[str, Any]:
    """Point an alias at a version, atomically."""
    operator.require_admin()
    with session_scope(db) as session:
        model = registry.get_model(session, name)
        registry.move_alias(session, model, alias, data.version, actor=operator.actor)
        return {"model": name, "alias": alias, "version": data.version, "aliases": registry.aliases_of(session, model)}


@post("/models/{name:str}/versions/{number:int}/status", status_code=200, sync_to_thread=True)
def change_status(db: Engine, operator: Operator, name: str, number: int, data: StatusChange) -> dict[str, Any]:
    """Move a version forward: registered → validated → active → retired."""
    operator.require_admin()
    with session_scope(db) as session:
        registry.set_status(
            session, registry.get_model(session, name), number, data.status, actor=operator.actor, reason=data.reason
        )
        return _version_body(session, name, number)


@post("/models/{name:str}/versions/{number:int}/tags", status_code=200, sync_to_thread=True)
def change_tags(db: Engine, operator: Operator, name: str, number: int, data: TagsChange) -> dict[str, Any]:
    """Add and remove tags of a version."""
    operator.require_admin()
    with session_scope(db) as session:
        model = registry.get_model(session, name)
        registry.tag_version(session, model, number, add=data.add, remove=data.remove, actor=operator.actor)
        return _version_body(session, name, number)


@put("/models/{name:str}/versions/{number:int}/serving", status_code=200, sync_to_thread=True)
def change_serving(db: Engine, operator: Operator, name: str, number: int, data: ServingChange) -> dict[str, Any]:
    """Set (or clear) the version's serving spec: which upstream servers answer it. Gateways reload it without a
    restart: new endpoints join, removed ones drain."""
    operator.require_admin()
    with session_scope(db) as session:
        registry.set_serving(session, registry.get_model(session, name), number, data.serving, actor=operator.actor)
        return _version_body(session, name, number)


@put("/models/{name:str}/pairing", status_code=200, sync_to_thread=True)
def change_pairing(
    db: Engine, artifacts: ArtifactStore, operator: Operator, name: str, data: PairingChange
) -> dict[str, Any]:
    """Set (or clear) which cloud model this edge model escalates to; devices are told at their next sync."""
    operator.require_admin()
    with session_scope(db) as session:
        model = registry.get_model(session, name)
        resend: str = data.resend or "as-sent"
        if data.cloud_model is not None and data.resend is None:
            resend = registry_artifacts.default_resend(session, artifacts, model, data.cloud_model)
        registry.set_pairing(session, model, data.cloud_model, resend=resend, actor=operator.actor)
        return {"model": name, "pairing": registry.pairing_json(model), "summary": registry.pairing_line(model)}


@post("/models/{name:str}/versions/{number:int}/derive", status_code=202, sync_to_thread=True)
def derive(
    db: Engine,
    derive_runner: DeriveRunner,
    operator: Operator,
    name: str,
    number: int,
    data: DeriveRequest | None = None,
) -> dict[str, Any]:
    """Derive edge artifacts (ONNX fp32, INT8, TFLite) of a cloud checkpoint version, in the background.

    Answers at once with the new version (artifacts ``pending``); poll ``GET .../versions/{new}``.
    """
    operator.require_admin()
    body = data or DeriveRequest()
    with session_scope(db) as session:
        job = start_derive(
            session,
            name,
            number,
            actor=operator.actor,
            min_int8_agreement=body.min_int8_agreement,
            tflite=body.tflite,
        )
    derive_runner.submit(job)
    with Session(db) as session:
        return {**_version_body(session, name, job.number), "poll": f"/api/models/{name}/versions/{job.number}"}


@asynccontextmanager
async def derive_jobs(db: Engine, store: ArtifactStore) -> AsyncIterator[DeriveRunner]:
    """The derive job runner, while the console serves; stopping waits for the job in flight.
    Starting fails jobs a stopped console left pending for longer than TIERLINE_REGISTRY_DERIVE_STALE_AFTER_S."""
    await anyio.to_thread.run_sync(fail_stale_jobs, db, DeriveSettings().derive_stale_after_s)
    runner = DeriveRunner(db, store, registry_artifacts.platform_signing_key())
    try:
        yield runner
    finally:
        try:
            await anyio.to_thread.run_sync(runner.close)
        except Exception:
            logger.exception("stopping the derive job runner failed")


REGISTRY_ROUTER = management_router(
    [
        list_models,
        get_model,
        get_version,
        push_version,
        move_alias,
        change_status,
        change_tags,
        change_serving,
        change_pairing,
        derive,
    ],
    "registry",
)

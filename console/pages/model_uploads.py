"""Models from the browser: upload a version's files, and derive edge artifacts of a cloud checkpoint.

The upload form posts ``multipart/form-data`` through htmx (its CSRF token travels as ``X-CSRF-Token``, so the
sign-in guard never buffers the body): file parts stream into the artifact store's staging area, hashed on the
way and capped at ``TIERLINE_MAX_ARTIFACT_BYTES``; only once every field checks out are the blobs committed and the
version registered through :mod:`controlplane.registry.service` and :mod:`controlplane.registry.artifacts` (which
write the audit
rows). Deriving starts the same background job as ``POST /api/models/{name}/versions/{n}/derive``.
"""

from __future__ import annotations

from typing import Any

import anyio.to_thread
from litestar import Request, post
from litestar.plugins.htmx import ClientRedirect, HTMXRequest
from litestar.response import Redirect, Template
from sqlalchemy.engine import Engine

from console.auth import session_user
from console.pages.common import Form, optional_float, see_other, write_session
from console.pages.models import detail_page, list_page
from console.uploads import StagedUpload, VersionUpload, receive_upload, register_upload
from controlplane.registry.edge_derive import DeriveRunner, start_derive
from controlplane.registry.store import ArtifactStore
from shared.errors import ApplicationError

UPLOAD_FIELDS = ("name", "kind", "label", "tags", "alias", "description", "target", "format")


def _form_of(upload: StagedUpload) -> VersionUpload:
    tags = tuple(t.strip() for t in (upload.text("tags") or "").split(",") if t.strip())
    return VersionUpload(
        name=upload.text("name") or "",
        kind=upload.text("kind"),
        label=upload.text("label"),
        alias=upload.text("alias"),
        tags=tags,
        target=upload.text("target"),
        format=upload.text("format"),
        description=upload.text("description") or "",
    )


@post("/model-uploads", status_code=200, request_max_body_size=None)
async def version_upload(
    request: HTMXRequest, db: Engine, artifacts: ArtifactStore
) -> Template | Redirect | ClientRedirect:
    """Upload a new version's files (the model is created with its first version)."""
    actor = session_user(request).actor
    store = artifacts
    upload = StagedUpload()
    try:
        await receive_upload(request, store, upload, fields=UPLOAD_FIELDS, ignore_unknown_fields=True, base_names=True)
        version = await anyio.to_thread.run_sync(register_upload, db, store, upload, _form_of(upload), actor)
    except ApplicationError as exc:
        where = "file" if exc.param in (None, "sha256") else exc.param
        errors = {where if where in (*UPLOAD_FIELDS, "file") else "_form": exc.message}
        status_code = exc.status_code
        return await anyio.to_thread.run_sync(
            lambda: list_page(
                request,
                db,
                "",
                1,
                status_code=status_code,
                upload_form={k: v[0].strip() for k, v in upload.fields.items()},
                upload_errors=errors,
            )
        )
    finally:
        upload.discard()  # what was committed is in the store; the rest goes
    target = f"/models/{version['model']}#v{version['number']}"
    return ClientRedirect(target) if request.htmx else see_other(target)


@post("/models/{name:str}/versions/{number:int}/derive", sync_to_thread=True)
def version_derive(
    request: Request[Any, Any, Any], db: Engine, derive_runner: DeriveRunner, name: str, number: int, data: Form
) -> Template | Redirect:
    """Derive edge artifacts (ONNX fp32, INT8 behind the quality guard) of a cloud causal-lm checkpoint version;
    the new version's artifacts are pending until the background job finishes."""
    try:
        bound = optional_float(data, "min_int8_agreement", maximum=1.0)
        with write_session(db) as session:
            job = start_derive(session, name, number, actor=session_user(request).actor, min_int8_agreement=bound)
    except ApplicationError as exc:
        if exc.status_code == 404:  # no such model or version: the not-found page
            raise
        return detail_page(request, db, name, status_code=exc.status_code, derive_errors={number: exc.message})
    derive_runner.submit(job)
    return see_other(f"/models/{name}#v{job.number}")


HANDLERS = [version_upload, version_derive]

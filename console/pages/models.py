"""Models: the registry's models, versions with their lineage, artifacts with hashes, aliases, and the calibrated
escalation curves; registering a version, moving aliases, status changes (uploads and derive: ``model_uploads``)."""

from __future__ import annotations

from typing import Any

from litestar import Request, get, post
from litestar.response import Redirect, Template
from sqlalchemy import func, or_
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from console.auth import session_user
from console.pages import escalation
from console.pages.common import (
    Form,
    errors_of,
    like,
    optional_int,
    paginate,
    render,
    see_other,
    text,
    write_session,
)
from console.pages.quality import model_view
from controlplane.registry import service as registry
from controlplane.storage.tables import Model, ModelAlias, ModelArtifact, ModelVersion
from shared.errors import ApplicationError, NotFoundError, ValidationError


@get("/models", sync_to_thread=True)
def models_list(request: Request[Any, Any, Any], db: Engine, q: str = "", page: int = 1, upload: str = "") -> Template:
    """Models by name with their number of versions and their aliases; ``upload``: open the upload form for it."""
    return list_page(request, db, q.strip()[:128], page, upload_form={"name": upload[:128]} if upload else {})


def list_page(
    request: Request[Any, Any, Any], db: Engine, q: str, page: int, status_code: int = 200, **extra: Any
) -> Template:
    query = select(Model).order_by(Model.name)
    if q:
        query = query.where(
            or_(
                func.lower(Model.name).like(like(q), escape="\\"),
                func.lower(Model.description).like(like(q), escape="\\"),
            )
        )
    with Session(db) as session:
        rows, info = paginate(session, query, page, {"q": q})
        ids = [m.id for m in rows]
        counts = dict(
            session.exec(
                select(ModelVersion.model_id, func.count())
                .where(col(ModelVersion.model_id).in_(ids))
                .group_by(col(ModelVersion.model_id))
            ).all()
        )
        aliases: dict[int, list[tuple[str, int]]] = {}
        for alias, number in session.exec(
            select(ModelAlias, ModelVersion.number)
            .join(ModelVersion, col(ModelVersion.id) == ModelAlias.version_id)
            .where(col(ModelAlias.model_id).in_(ids))
            .order_by(ModelAlias.name)
        ):
            aliases.setdefault(alias.model_id, []).append((alias.name, number))
    extra.setdefault("form", {})
    extra.setdefault("errors", {})
    extra.setdefault("upload_form", {})
    extra.setdefault("upload_errors", {})
    directory = escalation.policy_dir()
    with Session(db) as session:
        policies = escalation.registry_policies(session)
    known = {p.model for p in policies}
    policies += [p for p in escalation.all_policies(directory) if p.model not in known]
    return render(
        request,
        "models.html.j2",
        status_code,
        models=rows,
        page=info,
        q=q,
        counts=counts,
        aliases=aliases,
        kinds=registry.KINDS,
        formats=[(t, f) for t in registry.TARGETS for f in registry.FORMATS[t]],
        policies=policies,
        policy_dir=directory,
        **extra,
    )


@post("/models", sync_to_thread=True)
def version_register(request: Request[Any, Any, Any], db: Engine, data: Form) -> Template | Redirect:
    """Register the next version of a model (the model is created on its first version); artifacts follow with
    ``tierline models push`` or the registry API."""
    actor = session_user(request).actor
    try:
        name = registry.check_name(text(data, "name", max_length=128, required=True))
        derived = optional_int(data, "derived_from", minimum=1)
        tags = [t.strip() for t in text(data, "tags", max_length=2000).split(",") if t.strip()]
        with write_session(db) as session:
            model = registry.ensure_model(
                session,
                name,
                text(data, "kind", max_length=16) or None,
                description=text(data, "description", max_length=2000),
                actor=actor,
            )
            parent_id = registry.get_version(session, model, derived).id if derived else None
            version = registry.register_version(
                session,
                model,
                label=text(data, "label", max_length=64) or None,
                source=text(data, "source", max_length=500),
                tags=tags,
                derived_from_id=parent_id,
                actor=actor,
            )
            number = version.number
    except ApplicationError as exc:
        if exc.param == "version":
            exc.param = "derived_from"
        return list_page(request, db, "", 1, status_code=400, form=data, errors=errors_of(exc))
    return see_other(f"/models/{name}#v{number}")


def detail_page(request: Request[Any, Any, Any], db: Engine, name: str, **extra: Any) -> Template:
    with Session(db) as session:
        model = session.exec(select(Model).where(Model.name == name)).first()
        if model is None:
            raise NotFoundError(f"no model named {name!r}", param="name")
        versions = list(
            session.exec(
                select(ModelVersion).where(ModelVersion.model_id == model.id).order_by(col(ModelVersion.number).desc())
            )
        )
        by_id = {v.id: v for v in versions}
        # Versions derived from another model's version are looked up once each.
        missing = {v.derived_from_id for v in versions if v.derived_from_id and v.derived_from_id not in by_id}
        parents: dict[int, str] = {}
        if missing:
            for v, m in session.exec(select(ModelVersion, Model).join(Model).where(col(ModelVersion.id).in_(missing))):
                parents[v.id or 0] = f"{m.name} v{v.number}"
        artifacts: dict[int, list[ModelArtifact]] = {}
        for a in session.exec(
            select(ModelArtifact).where(col(ModelArtifact.version_id).in_(list(by_id))).order_by(col(ModelArtifact.id))
        ):
            artifacts.setdefault(a.version_id, []).append(a)
        aliases = [
            (a.name, n, a.updated_by, a.updated_at)
            for a, n in session.exec(
                select(ModelAlias, ModelVersion.number)
                .join(ModelVersion, col(ModelVersion.id) == ModelAlias.version_id)
                .where(ModelAlias.model_id == model.id)
                .order_by(ModelAlias.name)
            )
        ]
        policy = escalation.registry_view(session, model.name)
        quality = model_view(session, model.name)
    lineage = {
        v.id: (
            f"v{by_id[v.derived_from_id].number}"
            if v.derived_from_id in by_id
            else parents.get(v.derived_from_id or 0, "")
        )
        for v in versions
        if v.derived_from_id
    }
    extra.setdefault("form", {})
    extra.setdefault("errors", {})
    extra.setdefault("derive_errors", {})
    status_code = extra.pop("status_code", 200)
    # A cloud causal-lm checkpoint (hf-safetensors, ready) can be derived into edge artifacts.
    derivable = {
        v.id
        for v in versions
        if model.kind == "causal-lm"
        and v.status != "retired"
        and any(
            a.target == "cloud" and a.format == "hf-safetensors" and a.status == "ready"
            for a in artifacts.get(v.id or 0, [])
        )
    }
    is_pending = any(a.status == "pending" for rows in artifacts.values() for a in rows)
    return render(
        request,
        "model.html.j2",
        status_code,
        model=model,
        versions=versions,
        artifacts=artifacts,
        aliases=aliases,
        lineage=lineage,
        next_statuses={v.id: [s for s in registry.STATUSES if registry.can_move_status(v.status, s)] for v in versions},
        derivable=derivable,
        is_pending=is_pending,
        pairing=registry.pairing_line(model),
        servable_by={v.id: registry.servable_by(artifacts.get(v.id or 0, [])) for v in versions},
        policy=policy or escalation.policy_for(escalation.policy_dir(), model.name),
        quality=quality,
        **extra,
    )


@get("/models/{name:str}", sync_to_thread=True)
def model_detail(request: Request[Any, Any, Any], db: Engine, name: str) -> Template:
    """One model: versions (newest first) with status, tags, lineage and artifacts; aliases."""
    return detail_page(request, db, name)


@post("/models/{name:str}/aliases", sync_to_thread=True)
def alias_move(request: Request[Any, Any, Any], db: Engine, name: str, data: Form) -> Template | Redirect:
    """Point an alias (``stable``, ``canary``...) at a version; created the first time."""
    try:
        alias = text(data, "alias", max_length=64, required=True)
        number = optional_int(data, "version", minimum=1)
        if number is None:
            raise ValidationError("version is required", param="version")
        with write_session(db) as session:
            registry.move_alias(
                session, registry.get_model(session, name), alias, number, actor=session_user(request).actor
            )
    except ApplicationError as exc:
        if exc.status_code == 404 and exc.param != "version":
            raise
        return detail_page(request, db, name, status_code=400, form=data, errors=errors_of(exc))
    return see_other(f"/models/{name}")


@get("/models/{name:str}/versions/{number:int}/retire", sync_to_thread=False)
def version_retire_confirm(request: Request[Any, Any, Any], name: str, number: int) -> Template:
    return render(
        request,
        "confirm.html.j2",
        title=f"Retire version {number} of {name}",
        message="A retired version is never served again and no alias can point at it. This cannot be undone.",
        action=f"/models/{name}/versions/{number}/status",
        button="Retire version",
        cancel=f"/models/{name}",
        fields={"status": "retired"},
        reason=True,
    )


@post("/models/{name:str}/versions/{number:int}/status", sync_to_thread=True)
def version_status(request: Request[Any, Any, Any], db: Engine, name: str, number: int, data: Form) -> Redirect:
    """Move a version forward: registered → validated → active, or retire it."""
    with write_session(db) as session:
        registry.set_status(
            session,
            registry.get_model(session, name),
            number,
            text(data, "status", max_length=16, required=True),
            actor=session_user(request).actor,
            reason=text(data, "reason", max_length=500),
        )
    return see_other(f"/models/{name}#v{number}")


HANDLERS = [models_list, version_register, model_detail, alias_move, version_retire_confirm, version_status]

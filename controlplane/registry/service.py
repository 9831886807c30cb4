"""The model registry: models, their numbered versions, each version's artifacts, aliases and tags.

A **model** has a name and a kind (``causal-lm`` | ``tensor``). A **version** has a number that only grows
(1, 2, 3... per model, never reused, even when two pushes race), an optional label, where it came from, tags,
a status (``registered → validated → active → retired``) and, for a derived version, the version it was
derived from. An **artifact** is one target's files (``cloud``: an HF checkpoint, ONNX, a TensorRT plan;
``edge``: ONNX fp32 / INT8, TFLite): its bytes are blobs in the artifact store (:mod:`controlplane.registry.store`)
and its signed manifest (:mod:`shared.artifacts`) lists them with their sha256. An **alias** (``stable``,
``canary``, any name) points at one version and moves with one row update.

Every change writes an ``audit_log`` row (target ``model/<name>`` or ``model/<name>/<number>``). Functions
take a session and leave the commit to the caller.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from pydantic import ValidationError as PydanticValidationError
from sqlalchemy import func, insert, update
from sqlalchemy import select as sa_select
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from controlplane.storage.tables import AuditLog, Model, ModelAlias, ModelArtifact, ModelVersion, utcnow
from shared.architectures import model_type_of, support_for, supported_list, unsupported_message
from shared.backend_spec import ServingSpec, UpstreamSettings, boundary_problem, load_upstream_settings
from shared.errors import ConflictError, NotFoundError, ValidationError

STABLE: Final = "stable"  # the alias that names the version served when no rollout says otherwise

KINDS: Final = ("causal-lm", "tensor")
TARGETS: Final = ("cloud", "edge")
FORMATS: Final[dict[str, tuple[str, ...]]] = {
    "cloud": ("hf-safetensors", "hf-tokenizer", "onnx", "tensorrt-plan"),
    "edge": ("onnx", "onnx-int8", "tflite", "gguf"),
}
STATUSES: Final = ("registered", "validated", "active", "retired")
# Forward only; retiring is allowed from any live status (a version nobody will ever serve).
_NEXT_STATUS: Final[dict[str, tuple[str, ...]]] = {
    "registered": ("validated", "retired"),
    "validated": ("active", "retired"),
    "active": ("retired",),
    "retired": (),
}
ARTIFACT_STATUSES: Final = ("ready", "pending", "rejected", "failed")
MAX_TAGS: Final = 32
# A tokenizer without weights (``hf-tokenizer``): what a version answered by an ``openai`` backend carries.
TOKENIZER_FILES: Final = frozenset({"tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"})
# Cloud artifacts a serving spec's version may take its tokenizer from.
TOKENIZER_FORMATS: Final = ("hf-tokenizer", "hf-safetensors")
MANIFEST_FILE: Final = "manifest.json"
EDGE_MODEL_FILE: Final = "edge_model.json"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")
_ALIAS_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:=/-]{0,63}$")
_LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$")
_VERSION_NUMBER_RETRIES: Final = 8


# --- validation (pure) -----------------------------------------------------------------------------------------


def check_name(name: str, param: str = "name") -> str:
    if not _NAME_RE.fullmatch(name):
        raise ValidationError(
            f"{param} {name!r}: 1-128 letters, digits or '._+-', starting with a letter or digit", param=param
        )
    return name


def check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValidationError(f"kind must be one of {', '.join(KINDS)}, not {kind!r}", param="kind")
    return kind


def check_alias(alias: str) -> str:
    if not _ALIAS_RE.fullmatch(alias):
        raise ValidationError(f"alias {alias!r}: 1-64 letters, digits or '._-'", param="alias")
    return alias


def check_label(label: str | None) -> str | None:
    if label is not None and not _LABEL_RE.fullmatch(label):
        raise ValidationError(f"label {label!r}: 1-64 letters, digits or '._+-'", param="label")
    return label


def check_tags(tags: Iterable[str]) -> list[str]:
    out: list[str] = []
    for tag in tags:
        if not _TAG_RE.fullmatch(tag):
            raise ValidationError(f"tag {tag!r}: 1-64 letters, digits or '._:=/-'", param="tags")
        if tag not in out:
            out.append(tag)
    if len(out) > MAX_TAGS:
        raise ValidationError(f"at most {MAX_TAGS} tags per version", param="tags")
    return out


def check_target_format(target: str, format: str) -> None:
    if target not in TARGETS:
        raise ValidationError(f"target must be one of {', '.join(TARGETS)}, not {target!r}", param="target")
    if format not in FORMATS[target]:
        raise ValidationError(
            f"format {format!r} is not a {target} format ({', '.join(FORMATS[target])})", param="format"
        )


def can_move_status(current: str, new: str) -> bool:
    """Whether a version in ``current`` may go to ``new`` (forward only)."""
    return new in _NEXT_STATUS.get(current, ())


def is_safe_relpath(path: str) -> bool:
    """A relative POSIX path inside an artifact: no ``..``, no absolute path, no empty segment."""
    if not path or len(path) > 500 or "\\" in path or "\x00" in path or path.startswith("/"):
        return False
    return all(part not in ("", ".", "..") for part in path.split("/"))


def infer_format(paths: Sequence[str]) -> tuple[str, str]:
    """``(target, format)`` of an upload from its file names; ValidationError when they say nothing."""
    names = {p.rsplit("/", 1)[-1] for p in paths}
    if "config.json" in names and any(n.endswith(".safetensors") for n in names):
        return "cloud", "hf-safetensors"
    if "config.json" in names and names & TOKENIZER_FILES:
        return "cloud", "hf-tokenizer"
    if any(n.endswith(".tflite") for n in names):
        return "edge", "tflite"
    if any(n.endswith((".plan", ".engine")) for n in names):
        return "cloud", "tensorrt-plan"
    if any(n.endswith(".onnx") for n in names):
        return "cloud", "onnx"
    raise ValidationError("cannot tell the artifact's format from its files; send target and format", param="format")


# --- what serves a checkpoint (pure) ---------------------------------------------------------------------------

UPSTREAM: Final = "upstream"  # in ``servable_by``: the version's serving spec (an ``openai`` backend) answers it
# A runtime of shared.architectures -> the registry's edge formats it makes.
_RUNTIME_FORMATS: Final[dict[str, tuple[str, ...]]] = {
    "onnx": ("onnx", "onnx-int8"),
    "tflite": ("tflite",),
    "gguf": ("gguf",),
}


@dataclass(frozen=True, slots=True)
class Servability:
    """What can serve a pushed checkpoint, decided from its ``config.json`` before anything loads.

    ``servable_by`` lists ``engine`` (tierline's engine), ``upstream`` (its serving spec) and the edge formats
    derive can export (``onnx``, ``onnx-int8``, ``tflite``, ``gguf``)."""

    model_type: str
    servable_by: tuple[str, ...]

    @property
    def edge_formats(self) -> tuple[str, ...]:
        return tuple(f for f in self.servable_by if f not in ("engine", UPSTREAM))

    def summary(self) -> str:
        """``qwen3: served by the engine; edge formats onnx, onnx-int8, tflite, gguf``."""
        by = "the engine" if "engine" in self.servable_by else "its upstream only"
        if "engine" in self.servable_by and UPSTREAM in self.servable_by:
            by = "its upstream (the engine could too)"
        edge = ", ".join(self.edge_formats) or "none"
        return f"{self.model_type or 'unknown architecture'}: served by {by}; edge formats {edge}"

    def metadata(self) -> dict[str, Any]:
        """What the artifact's manifest records of it."""
        return {"model_type": self.model_type, "servable_by": list(self.servable_by)}


def read_checkpoint_config(text: bytes | str) -> dict[str, Any]:
    """A checkpoint's ``config.json``, parsed; ValidationError when it is not a JSON object."""
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise ValidationError(f"config.json is not JSON ({exc})", param="config.json") from None
    if not isinstance(config, dict):
        raise ValidationError("config.json is not a JSON object", param="config.json")
    return config


def check_checkpoint(config: dict[str, Any], *, has_serving: bool) -> Servability:
    """What serves a causal-LM checkpoint whose ``config.json`` is ``config``.

    An architecture tierline's engine does not run (or no ``model_type`` at all) is refused with the list of those
    it does, unless ``has_serving``: an upstream server named by the version's serving spec answers it then."""
    support = support_for(config)
    edge = tuple(f for r in support.edge_formats for f in _RUNTIME_FORMATS.get(r, ()))
    if support.engine:
        return Servability(support.model_type, ("engine", *((UPSTREAM,) if has_serving else ()), *edge))
    if has_serving:
        return Servability(support.model_type, (UPSTREAM, *edge))
    if not model_type_of(config):
        message = f"config.json has no model_type; the tierline engine serves: {supported_list('engine')}"
    else:
        message = unsupported_message(config, "engine")
    raise ValidationError(
        f"{message}. To have an upstream OpenAI-compatible server answer it, push it with a serving spec",
        param="config.json",
    )


def servable_by(artifacts: Sequence[ModelArtifact]) -> list[str]:
    """What a version can be served by, as recorded at push on its checkpoint artifact (empty: not recorded)."""
    for a in artifacts:
        recorded = ((a.manifest or {}).get("metadata") or {}).get("servable_by")
        if isinstance(recorded, list):
            return [str(r) for r in recorded]
    return []


# --- audit ---------------------------------------------------------------------------------------------------------


def _audit(
    session: Session, actor: str, action: str, target: str, before: dict[str, Any] | None, after: dict[str, Any]
) -> None:
    session.add(AuditLog(actor=actor[:128], action=action, target=target[:256], before=before, after=after))


# --- models --------------------------------------------------------------------------------------------------------


def get_model(session: Session, name: str) -> Model:
    model = session.exec(select(Model).where(Model.name == name)).first()
    if model is None:
        raise NotFoundError(f"no model named {name!r}", param="name")
    return model


def list_models(session: Session) -> list[Model]:
    return list(session.exec(select(Model).order_by(Model.name)))


def create_model(session: Session, name: str, kind: str, *, description: str = "", actor: str) -> Model:
    check_name(name)
    check_kind(kind)
    if len(description) > 2000:
        raise ValidationError("description: at most 2000 characters", param="description")
    if session.exec(select(Model.id).where(Model.name == name)).first() is not None:
        raise ConflictError(f"a model named {name!r} exists", param="name")
    model = Model(name=name, kind=kind, description=description)
    session.add(model)
    session.flush()
    _audit(session, actor, "model.create", f"model/{name}", None, {"name": name, "kind": kind})
    return model


def ensure_model(session: Session, name: str, kind: str | None, *, description: str = "", actor: str) -> Model:
    """The model ``name``, created with ``kind`` (default ``causal-lm``) if new; its kind must match."""
    check_name(name)
    existing = session.exec(select(Model).where(Model.name == name)).first()
    if existing is None:
        try:
            with session.begin_nested():
                return create_model(session, name, kind or "causal-lm", description=description, actor=actor)
        except IntegrityError:  # created by a concurrent push meanwhile
            existing = get_model(session, name)
    if kind is not None and kind != existing.kind:
        raise ValidationError(f"model {name!r} is a {existing.kind} model, not {kind}", param="kind")
    return existing


# --- pairing: which cloud model an edge model escalates to -----------------------------------------------------

RESEND_MODES: Final = ("as-sent", "text")
ZOO_PREFIX: Final = "tierline/"  # a cloud model id of the built zoo (the cloud serves it without the registry)


def check_resend(resend: str) -> str:
    if resend not in RESEND_MODES:
        raise ValidationError(f"resend must be one of {', '.join(RESEND_MODES)}, not {resend!r}", param="resend")
    return resend


def pair_target(session: Session, edge: Model, cloud_model: str) -> Model | None:
    """The registry model ``cloud_model`` names (a zoo id ``tierline/NAME`` names registry model NAME when there
    is one); None for a zoo id without one. A name that is neither is a 404; another kind a 400."""
    is_zoo = cloud_model.startswith(ZOO_PREFIX)
    name = cloud_model.removeprefix(ZOO_PREFIX) if is_zoo else cloud_model
    target = session.exec(select(Model).where(Model.name == name)).first()
    if target is None:
        if is_zoo and _NAME_RE.fullmatch(name):
            return None
        raise NotFoundError(
            f"no registry model named {cloud_model!r} (a model of the built zoo is named {ZOO_PREFIX}NAME)",
            param="cloud_model",
        )
    if target.id == edge.id:
        raise ValidationError(f"model {edge.name!r} cannot escalate to itself", param="cloud_model")
    if target.kind != edge.kind:
        raise ValidationError(
            f"model {edge.name!r} is a {edge.kind} model; it cannot escalate to {cloud_model!r}, a {target.kind} model",
            param="cloud_model",
        )
    return target


def set_pairing(session: Session, edge: Model, cloud_model: str | None, *, resend: str, actor: str) -> Model:
    """Record that ``edge`` escalates to ``cloud_model`` (a registry model's name, or a zoo id), resending requests
    ``resend``; with None it answers locally. Devices are told at their next sync."""
    if cloud_model is not None:
        pair_target(session, edge, cloud_model)
        check_resend(resend)
    before = pairing_json(edge)
    values: dict[str, Any] = {"cloud_model": cloud_model, "resend": resend if cloud_model is not None else None}
    if {"cloud_model": edge.cloud_model, "resend": edge.resend} != values:
        session.execute(
            update(Model).where(col(Model.id) == edge.id).values(**values).execution_options(synchronize_session=False)
        )
        session.refresh(edge)
        _audit(session, actor, "model.pair", f"model/{edge.name}", before, pairing_json(edge))
    return edge


def pairing_json(model: Model) -> dict[str, Any]:
    return {"cloud_model": model.cloud_model, "resend": model.resend if model.cloud_model else None}


def pairing_line(model: Model) -> str:
    """``Escalates to: lm-cloud (resend: text)`` or ``Answers locally (no cloud pair)``."""
    if model.cloud_model is None:
        return "Answers locally (no cloud pair)"
    return f"Escalates to: {model.cloud_model} (resend: {model.resend or 'as-sent'})"


def release_model(release: str, names: Collection[str]) -> str | None:
    """The registry model an edge release was published from: its name (``tierline models export`` names the
    release after the model), or the name with a format suffix (``acme-edge-onnx-int8``, as the zoo names its
    exports); None when no registry model matches."""
    if release in names:
        return release
    for format in sorted(FORMATS["edge"], key=len, reverse=True):  # -onnx-int8 before -onnx
        base = release.removesuffix(f"-{format}")
        if base != release and base in names:
            return base
    return None


def pairings_for(session: Session, releases: Iterable[str]) -> dict[str, tuple[str | None, str]]:
    """Release name -> (cloud model, resend) for each release published from a registry model; an unpaired
    model's releases map to ``(None, "as-sent")`` (it answers locally)."""
    wanted = list(releases)
    if not wanted:
        return {}
    models = {m.name: m for m in session.exec(select(Model))}
    out: dict[str, tuple[str | None, str]] = {}
    for release in wanted:
        name = release_model(release, models)
        if name is not None:
            model = models[name]
            out[release] = (model.cloud_model, (model.resend or "as-sent") if model.cloud_model else "as-sent")
    return out


def paired_models(session: Session) -> dict[str, tuple[str, str]]:
    """Registry model -> (cloud model, resend) for every model that has a pair: devices get them all at sync, so
    a model a device holds without a release (the zoo's, built into its data dir) is paired too."""
    return {
        m.name: (m.cloud_model, m.resend or "as-sent")
        for m in session.exec(select(Model).where(col(Model.cloud_model).is_not(None)))
        if m.cloud_model
    }


# --- versions ------------------------------------------------------------------------------------------------------


def register_version(
    session: Session,
    model: Model,
    *,
    label: str | None = None,
    source: str = "",
    tags: Iterable[str] = (),
    derived_from_id: int | None = None,
    actor: str,
) -> ModelVersion:
    """Add the next version of ``model``: its number is one more than the highest, even under races.

    The model's row is locked first (``SELECT ... FOR UPDATE`` on PostgreSQL, held to commit), then the number is
    chosen and written by one ``INSERT ... SELECT max + 1`` (a single write, so SQLite serialises it too). The
    unique constraint stays the backstop: a clash is retried in a savepoint.
    """
    assert model.id is not None
    label = check_label(label)
    tag_list = check_tags(tags)
    next_number = (
        sa_select(func.coalesce(func.max(ModelVersion.number), 0) + 1)
        .where(col(ModelVersion.model_id) == model.id)
        .scalar_subquery()
    )
    values = {
        "model_id": model.id,
        "number": next_number,
        "label": label,
        "source": source[:500],
        "status": "registered",
        "derived_from_id": derived_from_id,
        "tags": tag_list,
        "created_at": utcnow(),
    }
    # Serialise numbering per model on PostgreSQL (a no-op on SQLite, whose writes are serial anyway).
    session.execute(sa_select(col(Model.id)).where(col(Model.id) == model.id).with_for_update())
    for attempt in range(_VERSION_NUMBER_RETRIES):
        try:
            with session.begin_nested():
                new_id = session.execute(
                    insert(ModelVersion).values(**values).returning(col(ModelVersion.id))
                ).scalar_one()
            break
        except IntegrityError:
            if attempt == _VERSION_NUMBER_RETRIES - 1:
                raise ConflictError(f"could not number a new version of {model.name}; try again") from None
    version = session.get(ModelVersion, new_id)
    assert version is not None
    _audit(
        session, actor, "model.version.register", f"model/{model.name}/{version.number}", None, version_json(version)
    )
    return version


def get_version(session: Session, model: Model, number: int) -> ModelVersion:
    version = session.exec(
        select(ModelVersion).where(ModelVersion.model_id == model.id, ModelVersion.number == number)
    ).first()
    if version is None:
        raise NotFoundError(f"model {model.name!r} has no version {number}", param="version")
    return version


def list_versions(session: Session, model: Model) -> list[ModelVersion]:
    return list(
        session.exec(select(ModelVersion).where(ModelVersion.model_id == model.id).order_by(col(ModelVersion.number)))
    )


def set_status(
    session: Session, model: Model, number: int, status: str, *, actor: str, reason: str = ""
) -> ModelVersion:
    """Move a version's status forward (``registered → validated → active → retired``) with one conditional UPDATE."""
    if status not in STATUSES:
        raise ValidationError(f"status must be one of {', '.join(STATUSES)}, not {status!r}", param="status")
    version = get_version(session, model, number)
    before = version.status
    if not can_move_status(before, status):
        raise ConflictError(f"version {number} of {model.name} is {before}; it cannot become {status}", param="status")
    result = session.execute(
        update(ModelVersion)
        .where(col(ModelVersion.id) == version.id, col(ModelVersion.status) == before)
        .values(status=status)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        raise ConflictError(f"version {number} of {model.name} changed meanwhile; read it again", param="status")
    session.refresh(version)
    after: dict[str, Any] = {"status": status} | ({"reason": reason[:500]} if reason else {})
    _audit(session, actor, "model.version.status", f"model/{model.name}/{number}", {"status": before}, after)
    return version


def tag_version(
    session: Session, model: Model, number: int, *, add: Iterable[str] = (), remove: Iterable[str] = (), actor: str
) -> ModelVersion:
    version = get_version(session, model, number)
    before = list(version.tags)
    dropped = set(remove)
    tags = check_tags([t for t in before if t not in dropped] + [t for t in add if t not in dropped])
    if tags != before:
        session.execute(
            update(ModelVersion)
            .where(col(ModelVersion.id) == version.id)
            .values(tags=tags)
            .execution_options(synchronize_session=False)
        )
        session.refresh(version)
        _audit(session, actor, "model.version.tags", f"model/{model.name}/{number}", {"tags": before}, {"tags": tags})
    return version


def check_serving(spec: dict[str, Any], upstream: UpstreamSettings | None = None) -> ServingSpec:
    """A serving spec, checked (the same rules as the gateway's backends file), its key held to the places the
    operator designates and its endpoints to the operator's egress policy (``upstream``: default from the
    environment, ``TIERLINE_CLOUD_UPSTREAM_*``); 400 naming the field and the rule otherwise."""
    try:
        checked = ServingSpec.model_validate(spec)
    except PydanticValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        param = f"serving.{where}" if where else "serving"
        raise ValidationError(f"{param}: {first['msg']}", param=param) from None
    upstream = upstream or load_upstream_settings()
    problem = boundary_problem(checked, upstream.key_sources(), upstream.egress(check_own_sockets=False))
    if problem is not None:
        param = f"serving.{problem[0]}"
        raise ValidationError(f"{param}: {problem[1]}", param=param)
    return checked


def set_serving(
    session: Session, model: Model, number: int, spec: dict[str, Any] | None, *, actor: str
) -> ModelVersion:
    """Declare (or, with None, remove) the ``openai`` backend that answers version ``number``.

    Only a ``causal-lm`` version with a ready cloud tokenizer (``hf-tokenizer``, or a checkpoint) may have one: the
    gateway counts and admits prompts with it. Its key and endpoints are held to the operator's designations
    (``check_serving``): whoever submits it does not hold the host's environment. A running gateway picks a change
    up at its next refresh: endpoints that joined take requests, those that left drain.
    """
    version = get_version(session, model, number)
    stored: dict[str, Any] | None = None
    if spec is not None:
        if model.kind != "causal-lm":
            raise ValidationError(
                f"model {model.name!r} is a {model.kind} model; only causal-lm versions have a serving spec",
                param="serving",
            )
        checked = check_serving(spec)
        stored = checked.model_dump(mode="json", exclude_defaults=True)
        stored["backend"] = "openai"
        stored["endpoints"] = checked.roots()  # as given: pydantic's URLs end with a '/'
        tokenizers = [
            a
            for a in artifacts_of(session, [version.id or 0])[version.id or 0]
            if a.target == "cloud" and a.format in TOKENIZER_FORMATS and a.status == "ready"
        ]
        if not tokenizers:
            raise ConflictError(
                f"version {number} of {model.name} has no ready cloud hf-tokenizer (or hf-safetensors) artifact; "
                "push the tokenizer with the spec (tierline models push TOKENIZER_DIR --serving FILE)",
                param="serving",
            )
    before = version.serving
    if stored != before:
        session.execute(
            update(ModelVersion)
            .where(col(ModelVersion.id) == version.id)
            .values(serving=stored)
            .execution_options(synchronize_session=False)
        )
        session.refresh(version)
        _audit(
            session,
            actor,
            "model.version.serving",
            f"model/{model.name}/{number}",
            {"serving": before},
            {"serving": stored},
        )
    return version


def lineage(session: Session, version: ModelVersion) -> list[ModelVersion]:
    """The versions ``version`` derives from, nearest first."""
    chain: list[ModelVersion] = []
    seen = {version.id}
    parent_id = version.derived_from_id
    while parent_id is not None and parent_id not in seen:
        parent = session.get(ModelVersion, parent_id)
        if parent is None:
            break
        chain.append(parent)
        seen.add(parent_id)
        parent_id = parent.derived_from_id
    return chain


# --- aliases -------------------------------------------------------------------------------------------------------


def move_alias(session: Session, model: Model, alias: str, number: int, *, actor: str) -> ModelAlias:
    """Point ``alias`` at version ``number``: one row update (readers see the old or the new version, never
    neither); the row is created the first time."""
    check_alias(alias)
    version = get_version(session, model, number)
    if version.status == "retired":
        raise ConflictError(
            f"version {number} of {model.name} is retired; an alias cannot point at it", param="version"
        )
    current = session.exec(select(ModelAlias).where(ModelAlias.model_id == model.id, ModelAlias.name == alias)).first()
    before = {"version": _number_of(session, current.version_id)} if current is not None else None
    values = {"version_id": version.id, "updated_by": actor[:128], "updated_at": utcnow()}
    moved = session.execute(
        update(ModelAlias)
        .where(col(ModelAlias.model_id) == model.id, col(ModelAlias.name) == alias)
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    if moved.rowcount == 0:  # type: ignore[attr-defined]
        try:
            with session.begin_nested():
                session.add(
                    ModelAlias(model_id=model.id or 0, name=alias, version_id=version.id or 0, updated_by=actor)
                )
        except IntegrityError:  # created concurrently: move it instead
            session.execute(
                update(ModelAlias)
                .where(col(ModelAlias.model_id) == model.id, col(ModelAlias.name) == alias)
                .values(**values)
                .execution_options(synchronize_session=False)
            )
    row = session.exec(
        select(ModelAlias)
        .where(ModelAlias.model_id == model.id, ModelAlias.name == alias)
        .execution_options(populate_existing=True)
    ).one()
    _audit(
        session,
        actor,
        "model.alias.move",
        f"model/{model.name}",
        before and {"alias": alias, **before},
        {"alias": alias, "version": number},
    )
    return row


def _number_of(session: Session, version_id: int) -> int | None:
    return session.exec(select(ModelVersion.number).where(ModelVersion.id == version_id)).first()


def aliases_of(session: Session, model: Model) -> dict[str, int]:
    """alias name -> version number."""
    rows = session.exec(
        select(ModelAlias.name, ModelVersion.number)
        .join(ModelVersion, col(ModelVersion.id) == col(ModelAlias.version_id))
        .where(ModelAlias.model_id == model.id)
        .order_by(col(ModelAlias.name))
    )
    return {name: number for name, number in rows}


def routing_aliases(session: Session, model: Model) -> tuple[dict[str, int], datetime | None]:
    """What routing reads of a model's aliases: alias name -> version number, and when ``stable`` last moved (a
    rollout's baseline is measured from then)."""
    aliases: dict[str, int] = {}
    stable_moved_at = None
    rows = session.exec(
        select(ModelAlias.name, ModelVersion.number, ModelAlias.updated_at)
        .join(ModelVersion, col(ModelVersion.id) == col(ModelAlias.version_id))
        .where(ModelAlias.model_id == model.id)
    )
    for alias, number, moved_at in rows:
        aliases[alias] = number
        if alias == STABLE:
            stable_moved_at = moved_at
    return aliases, stable_moved_at


def resolve(session: Session, name: str, ref: str) -> ModelVersion:
    """A version by number (``3``) or alias (``stable``)."""
    model = get_model(session, name)
    if ref.isascii() and ref.isdigit():
        return get_version(session, model, int(ref))
    number = aliases_of(session, model).get(ref)
    if number is None:
        raise NotFoundError(f"model {name!r} has no version or alias {ref!r}", param="version")
    return get_version(session, model, number)


# --- reading artifacts ---------------------------------------------------------------------------------------------


def artifacts_of(session: Session, version_ids: Iterable[int]) -> dict[int, list[ModelArtifact]]:
    ids = list(version_ids)
    out: dict[int, list[ModelArtifact]] = {i: [] for i in ids}
    if ids:
        rows = session.exec(
            select(ModelArtifact).where(col(ModelArtifact.version_id).in_(ids)).order_by(col(ModelArtifact.id))
        )
        for a in rows:
            out[a.version_id].append(a)
    return out


# --- JSON ----------------------------------------------------------------------------------------------------------


def artifact_json(a: ModelArtifact) -> dict[str, Any]:
    signature = (a.manifest or {}).get("signature") or {}
    return {
        "id": a.id,
        "target": a.target,
        "format": a.format,
        "status": a.status,
        "sha256": a.sha256,
        "size": a.size,
        "uri": a.uri,
        "signature_key_id": signature.get("key_id"),
        "metadata": (a.manifest or {}).get("metadata", {}),
        "error": (a.manifest or {}).get("error"),
        "created_at": a.created_at.isoformat(),
    }


def version_json(
    v: ModelVersion,
    artifacts: Sequence[ModelArtifact] = (),
    aliases: Sequence[str] = (),
    derived_from: int | None = None,
) -> dict[str, Any]:
    return {
        "number": v.number,
        "label": v.label,
        "source": v.source,
        "status": v.status,
        "tags": list(v.tags),
        "derived_from": derived_from,
        "aliases": list(aliases),
        "artifacts": [artifact_json(a) for a in artifacts],
        "serving": v.serving,
        "servable_by": servable_by(artifacts),
        "created_at": v.created_at.isoformat() if v.created_at else None,
    }


def model_json(session: Session, model: Model, *, with_versions: bool = True) -> dict[str, Any]:
    aliases = aliases_of(session, model)
    body: dict[str, Any] = {
        "name": model.name,
        "kind": model.kind,
        "description": model.description,
        "aliases": aliases,
        "pairing": pairing_json(model),
        "created_at": model.created_at.isoformat(),
    }
    versions = list_versions(session, model)
    body["num_versions"] = len(versions)
    body["latest_version"] = versions[-1].number if versions else None
    if with_versions:
        by_id = {v.id: v.number for v in versions}
        arts = artifacts_of(session, [v.id for v in versions if v.id is not None])
        body["versions"] = [
            version_json(
                v,
                arts.get(v.id or 0, []),
                [a for a, n in aliases.items() if n == v.number],
                by_id.get(v.derived_from_id) if v.derived_from_id is not None else None,
            )
            for v in versions
        ]
    return body

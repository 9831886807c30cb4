"""Derive a registered cloud LM checkpoint's edge artifacts as a background job.

:func:`start_derive` (in the caller's transaction) registers the new edge version — its ``derived_from`` is
the cloud version — with one ``pending`` artifact per edge format. :func:`run_derive` (a worker thread, or the
CLI in the foreground) fetches the checkpoint from the artifact store, exports it with the zoo's exporters
(:mod:`shared.zoo.export_lm`: ONNX fp32 with a growing KV cache, ONNX Runtime's dynamic INT8 quantization,
LiteRT with litert-torch when installed and asked for; :mod:`shared.zoo.export_gguf`: GGUF f32 + Q8_0 for
llama.cpp, through llama.cpp's own converter, when asked for) and fills each artifact with its files and signed
manifest.

Every export is checked against the checkpoint it came from, never against another export: transformers runs
the checkpoint (fp32, eager, greedy) on fixed prompts, one near its context length, and its answers go into
``reference.json`` in every artifact (:mod:`shared.reference_answers`, signed with the rest). Each export's own
runtime then answers the same prompts teacher-forced (:mod:`shared.zoo.verify`). An fp32 format (ONNX, LiteRT,
GGUF f32) is ``ready`` only when it gives the source's greedy tokens on every prompt; a quantized one (ONNX INT8,
GGUF Q8_0) when it agrees on at least its bound of next-token choices. Otherwise the artifact is ``rejected``
(its bytes are kept, for a look, but it must not be served) with the numbers in its reason.

Each artifact stands alone: one that cannot be made is ``failed`` with one line saying why (the traceback goes to
the log), and its siblings carry on. A format the architecture table (:mod:`shared.architectures`) says cannot
serve the checkpoint is failed up front with that line; the artifacts are still created at :func:`start_derive`,
so the version shows every format asked for and why one is missing.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from controlplane.registry import artifacts as registry_artifacts
from controlplane.registry import service as registry
from controlplane.registry.store import ArtifactStore, scratch_dir
from controlplane.storage.session import session_scope
from controlplane.storage.tables import Model, ModelArtifact, ModelVersion
from shared.architectures import support_for, unsupported_message
from shared.artifacts import FileEntry
from shared.errors import ApplicationError, ConflictError, ValidationError
from shared.reference_answers import REFERENCE_FILE, ReferenceAnswers
from shared.zoo.export_gguf import GgufExportError
from shared.zoo.verify import ExportCheck, verdict

logger = logging.getLogger(__name__)

SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)
EDGE_MODEL_FILE = "edge_model.json"
DERIVED_TAG = "derived"
SayFn = Callable[[str], None]


class DeriveSettings(BaseSettings):
    """Defaults of a derive job (a request may override them)."""

    model_config = SettingsConfigDict(env_prefix="TIERLINE_REGISTRY_", extra="ignore")

    min_int8_agreement: float = Field(
        0.9, ge=0.0, le=1.0, description="least INT8 next-token agreement with the source checkpoint; below it rejected"
    )
    derive_tflite: bool | None = Field(
        None, description="also convert to TFLite; default: when litert-torch is installed"
    )
    tflite_cache_len: int | None = Field(None, gt=0, description="TFLite KV cache length; default: the max context")
    derive_gguf: bool = Field(
        False, description="also export GGUF (Q8_0 and f32 in one artifact) for llama.cpp on devices"
    )
    min_q8_0_agreement: float = Field(
        0.9, ge=0.0, le=1.0, description="least GGUF Q8_0 next-token agreement with the source; below it rejected"
    )
    reference_max_tokens: int = Field(
        2048, ge=64, description="the long reference prompt fills the context up to this many tokens"
    )
    gguf_converter: Path | None = Field(
        None, description="directory of llama.cpp's convert_hf_to_gguf.py; default: where `make gguf-converter` puts it"
    )
    derive_stale_after_s: float = Field(
        3600.0, gt=0, description="a job pending this long when a console starts is taken as dead and failed"
    )


def tflite_available() -> bool:
    return importlib.util.find_spec("litert_torch") is not None


def int8_verdict(agreement: float, bound: float) -> str:
    """``ready`` when INT8 agrees with fp32 on at least ``bound`` of next-token choices, else ``rejected``."""
    return "ready" if agreement >= bound else "rejected"


@dataclass(frozen=True, slots=True)
class DeriveJob:
    model: str
    source_number: int
    number: int
    artifact_ids: dict[str, int]
    min_int8_agreement: float
    tflite_cache_len: int | None = None
    actor: str = "derive"
    min_q8_0_agreement: float = 0.9
    reference_max_tokens: int = 2048
    gguf_converter: Path | None = None


@dataclass(slots=True)
class DeriveResult:
    """What a job did: each format's status, and for those not ``ready`` the one line why; ``error`` only when
    the whole job stopped (no checkpoint, no reference answers)."""

    job: DeriveJob
    statuses: dict[str, str] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    checks: dict[str, dict[str, Any]] = field(default_factory=dict)
    int8_agreement: float | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _Made:
    """One format's export, checked: its directory, status (``ready``/``rejected``) and manifest metadata."""

    directory: Path
    status: str
    metadata: dict[str, Any]
    reason: str | None = None


def start_derive(
    session: Session,
    name: str,
    number: int,
    *,
    actor: str,
    min_int8_agreement: float | None = None,
    tflite: bool | None = None,
    gguf: bool | None = None,
) -> DeriveJob:
    """Register the edge version of cloud version ``number`` of ``name`` with its pending artifacts."""
    settings = DeriveSettings()
    bound = settings.min_int8_agreement if min_int8_agreement is None else min_int8_agreement
    if not 0.0 <= bound <= 1.0:
        raise ValidationError("min_int8_agreement must be within [0, 1]", param="min_int8_agreement")
    want_tflite = settings.derive_tflite if tflite is None else tflite
    if want_tflite is None:
        want_tflite = tflite_available()
    elif want_tflite and not tflite_available():
        raise ValidationError("TFLite needs litert-torch: pip install 'tierline[convert]'", param="tflite")
    model = registry.get_model(session, name)
    if model.kind != "causal-lm":
        raise ValidationError(
            f"model {name!r} is a {model.kind} model; only causal-lm checkpoints derive", param="name"
        )
    source = registry.get_version(session, model, number)
    if source.status == "retired":
        raise ConflictError(f"version {number} of {name} is retired", param="version")
    checkpoint_artifact(session, source)  # refuses early when there is nothing to derive from
    version = registry.register_version(
        session,
        model,
        source=f"derived from version {number}",
        tags=[DERIVED_TAG, "edge"],
        derived_from_id=source.id,
        actor=actor,
    )
    want_gguf = settings.derive_gguf if gguf is None else gguf
    formats = ["onnx", "onnx-int8"] + (["tflite"] if want_tflite else []) + (["gguf"] if want_gguf else [])
    ids = {
        f: registry_artifacts.add_pending_artifact(session, version, target="edge", format=f).id or 0 for f in formats
    }
    return DeriveJob(
        name,
        number,
        version.number,
        ids,
        bound,
        settings.tflite_cache_len,
        actor,
        min_q8_0_agreement=settings.min_q8_0_agreement,
        reference_max_tokens=settings.reference_max_tokens,
        gguf_converter=settings.gguf_converter,
    )


def checkpoint_artifact(session: Session, version: ModelVersion) -> ModelArtifact:
    row = session.exec(
        select(ModelArtifact)
        .where(
            ModelArtifact.version_id == version.id,
            ModelArtifact.target == "cloud",
            ModelArtifact.format == "hf-safetensors",
            ModelArtifact.status == "ready",
        )
        .order_by(col(ModelArtifact.id))
    ).first()
    if row is None:
        raise ValidationError(
            f"version {version.number} has no cloud hf-safetensors artifact to derive from", param="version"
        )
    return row


def run_derive(
    engine: Engine, store: ArtifactStore, job: DeriveJob, signing_key: Ed25519PrivateKey, say: SayFn | None = None
) -> DeriveResult:
    """Make the job's artifacts; never raises (an artifact that cannot be made is marked ``failed``)."""
    tell = say or (lambda msg: logger.info("derive %s v%s: %s", job.model, job.number, msg))
    result = DeriveResult(job)
    try:
        with scratch_dir(store, "derive-") as work:
            _derive(engine, store, job, signing_key, work, tell, result)
    except Exception as exc:
        logger.exception("deriving edge artifacts of %s version %s failed", job.model, job.source_number)
        result.error = one_line(exc)
        _fail_pending(engine, job, result.error)
        for fmt in job.artifact_ids:
            if result.statuses.get(fmt, "pending") == "pending":
                result.statuses[fmt] = "failed"
                result.reasons[fmt] = result.error
    return result


def one_line(exc: BaseException) -> str:
    """An exception as one line for a record (the traceback belongs in the log)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, (ApplicationError, GgufExportError)):
        return text[:500]
    return f"{type(exc).__name__}: {text}"[:500]


def _derive(
    engine: Engine,
    store: ArtifactStore,
    job: DeriveJob,
    signing_key: Ed25519PrivateKey,
    work: Path,
    say: SayFn,
    result: DeriveResult,
) -> None:
    from shared.zoo.verify import make_reference

    with Session(engine) as session:
        model = registry.get_model(session, job.model)
        source = checkpoint_artifact(session, registry.get_version(session, model, job.source_number))
        parent = {"name": f"{job.model}@{job.source_number}", "sha256": source.sha256}
        ckpt = registry_artifacts.materialize(store, source, work / "checkpoint")
    say(f"fetched the checkpoint ({source.size} bytes)")
    config = json.loads((ckpt / "config.json").read_text())
    support = support_for(config)
    failed: dict[str, str] = {}
    for fmt in job.artifact_ids:
        runtime = FORMAT_RUNTIME.get(fmt, fmt)
        if runtime not in support.runtimes:
            failed[fmt] = f"{fmt}: {unsupported_message(config, runtime)}"
            say(failed[fmt])
    todo = [fmt for fmt in job.artifact_ids if fmt not in failed]
    made: dict[str, _Made] = {}
    reference: ReferenceAnswers | None = None
    if todo:
        try:
            reference = make_reference(ckpt, parent, job.reference_max_tokens)
        except Exception as exc:
            logger.exception("transformers could not answer the reference prompts of %s", parent["name"])
            line = f"no reference answers from the source checkpoint (transformers): {one_line(exc)}"
            failed.update({fmt: f"{fmt}: {line}" for fmt in todo})
            say(line)
    if reference is not None:
        lengths = ", ".join(f"{p.name} {len(p.token_ids)}+{len(p.greedy)}" for p in reference.prompts)
        say(f"reference answers from {reference.produced_by}: {lengths} tokens")
        ctx = _Context(ckpt, config, reference, parent, job, work, say)
        for fmt in todo:
            if fmt == "onnx-int8" and "onnx" in failed:
                failed[fmt] = f"{fmt}: needs the ONNX fp32 export, which failed"
            else:
                try:
                    made[fmt] = MAKERS[fmt](ctx)
                except Exception as exc:
                    logger.exception("the %s export of %s failed", fmt, parent["name"])
                    failed[fmt] = f"{fmt}: {one_line(exc)}"
            if fmt in made:
                m = made[fmt]
                (m.directory / REFERENCE_FILE).write_text(reference.to_json())
                result.checks[fmt] = m.metadata
                say(f"{fmt}: {m.status}" + (f" ({m.reason})" if m.reason else ""))
            else:
                say(failed[fmt])
    if "onnx-int8" in made:
        result.int8_agreement = made["onnx-int8"].metadata["agreement"]["overall"]

    for fmt, artifact_id in job.artifact_ids.items():
        with session_scope(engine) as session:
            model = registry.get_model(session, job.model)
            version = registry.get_version(session, model, job.number)
            artifact = session.get(ModelArtifact, artifact_id)
            assert artifact is not None
            if fmt in failed:
                registry_artifacts.fail_artifact(session, model, version, artifact, reason=failed[fmt], actor=job.actor)
                result.statuses[fmt], result.reasons[fmt] = "failed", failed[fmt]
                continue
            m = made[fmt]
            registry_artifacts.complete_artifact(
                session,
                store,
                model,
                version,
                artifact,
                files=_upload_dir(store, m.directory),
                signing_key=signing_key,
                actor=job.actor,
                status=m.status,
                derived_from=parent,
                metadata=m.metadata,
            )
            result.statuses[fmt] = m.status
            if m.reason:
                result.reasons[fmt] = f"{fmt}: {m.reason}"
    say("signed and stored: " + ", ".join(f"{f} {s}" for f, s in result.statuses.items()))


@dataclass(frozen=True, slots=True)
class _Context:
    ckpt: Path
    config: dict[str, Any]
    reference: ReferenceAnswers
    parent: dict[str, str]
    job: DeriveJob
    work: Path
    say: SayFn


def _checked(ctx: _Context, directory: Path, check: ExportCheck, bound: float | None, **extra: Any) -> _Made:
    """The verdict on one export and the metadata its manifest carries."""
    status, reason = verdict(check, bound)
    metadata = {
        "derived_by": "tierline edge_derive",
        **extra,
        "verified_against": ctx.parent,
        **check.summary(),
        "bound": 1.0 if bound is None else bound,
        "verdict": status,
        **({"reason": reason} if reason else {}),
    }
    return _Made(directory, status, metadata, reason)


def _make_onnx(ctx: _Context) -> _Made:
    from shared.zoo.export_lm import export_onnx
    from shared.zoo.verify import OnnxRunner, check_export

    out = ctx.work / "onnx"
    meta = _edge_meta(ctx.config)
    export_onnx(ctx.ckpt, out / "model.onnx")
    _side_files(ctx.ckpt, out, {"format": "onnx", "io": "growing-kv-cache/v1", **meta})
    return _checked(ctx, out, check_export(OnnxRunner(out / "model.onnx", meta), ctx.reference), None)


def _make_onnx_int8(ctx: _Context) -> _Made:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from shared.zoo.export_lm import quiet_root_logger
    from shared.zoo.verify import OnnxRunner, check_export

    out = ctx.work / "onnx-int8"
    out.mkdir()
    meta = _edge_meta(ctx.config)
    with quiet_root_logger():
        quantize_dynamic(ctx.work / "onnx" / "model.onnx", out / "model.onnx", weight_type=QuantType.QInt8)
    _side_files(ctx.ckpt, out, {"format": "onnx-int8", "io": "growing-kv-cache/v1", **meta})
    check = check_export(OnnxRunner(out / "model.onnx", meta), ctx.reference)
    return _checked(ctx, out, check, ctx.job.min_int8_agreement)


def _make_tflite(ctx: _Context) -> _Made:
    from shared.zoo.export_lm import export_tflite
    from shared.zoo.verify import TfliteRunner, check_export

    out = ctx.work / "tflite"
    meta = _edge_meta(ctx.config)
    ctx.say("converting to TFLite (litert-torch)")
    io = export_tflite(ctx.ckpt, out / "model.tflite", ctx.job.tflite_cache_len)
    _side_files(ctx.ckpt, out, {"format": "tflite", **meta, **io})
    check = check_export(TfliteRunner(out / "model.tflite", io, meta), ctx.reference)
    return _checked(ctx, out, check, None, **io)


def _make_gguf(ctx: _Context) -> _Made:
    """GGUF f32 and Q8_0 in one artifact: ready when f32 gives the source's greedy tokens and Q8_0 agrees on at
    least its bound; the top-level numbers are f32's, each file's under ``variants``."""
    from shared.zoo.export_gguf import GGUF_FILES, export_gguf, find_converter
    from shared.zoo.verify import GgufRunner, check_export

    out = ctx.work / "gguf"
    converter = find_converter(ctx.job.gguf_converter)
    if ctx.job.gguf_converter is not None and converter is None:  # the operator's setting first: it is theirs to fix
        raise ValidationError(f"TIERLINE_REGISTRY_GGUF_CONVERTER={ctx.job.gguf_converter} has no convert_hf_to_gguf.py")
    missing = gguf_missing_reason()
    if missing is not None:
        raise ValidationError(f"cannot check GGUF files against the source: {missing}")
    ctx.say(f"exporting GGUF (Q8_0, f32) with {'llama.cpp' if converter else 'the Llama writer'}")
    written = {kind: export_gguf(ctx.ckpt, out / name, kind, converter) for kind, name in GGUF_FILES.items()}
    _side_files(ctx.ckpt, out, None)
    extra = {"runtime": "llama.cpp", "files": {kind: w["file"] for kind, w in written.items()}}
    extra["converter"] = written["f32"]["converter"]
    bounds: dict[str, float | None] = {"f32": None, "q8_0": ctx.job.min_q8_0_agreement}
    variants: dict[str, _Made] = {}
    n_ctx = max(len(p.token_ids) + len(p.greedy) for p in ctx.reference.prompts)  # the check's longest sequence
    for kind, name in GGUF_FILES.items():
        runner = GgufRunner(out / name, n_ctx, f32_cache=kind == "f32")
        try:
            variants[kind] = _checked(ctx, out, check_export(runner, ctx.reference), bounds[kind])
        finally:
            runner.close()
    f32 = variants["f32"]
    rejected = [f"{kind}: {v.reason}" for kind, v in variants.items() if v.status != "ready"]
    status = "rejected" if rejected else "ready"
    metadata = {
        **f32.metadata,
        **extra,
        "verdict": status,
        "variants": {
            kind: {k: v.metadata[k] for k in ("agreement", "first_divergence", "bound", "verdict")}
            for kind, v in variants.items()
        },
    }
    metadata.pop("reason", None)
    reason = "; ".join(rejected) or None
    if reason:
        metadata["reason"] = reason
    return _Made(out, status, metadata, reason)


MAKERS: dict[str, Callable[[_Context], _Made]] = {
    "onnx": _make_onnx,
    "onnx-int8": _make_onnx_int8,
    "tflite": _make_tflite,
    "gguf": _make_gguf,
}
FORMAT_RUNTIME = {"onnx-int8": "onnx"}  # the architecture table's column for each edge format


def gguf_missing_reason() -> str | None:
    """Why GGUF files cannot be run here (llama-cpp-python absent), or None."""
    try:
        found = importlib.util.find_spec("llama_cpp") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else "llama-cpp-python is not installed (pip install 'tierline[edge-gguf]')"


def _edge_meta(config: dict[str, Any]) -> dict[str, Any]:
    """The cache facts of ``edge_model.json`` (the exporter's reading of config.json: GPT-2's names, Gemma's and
    Qwen3's head_dim defaults); a config it cannot read is this artifact's one-line failure."""
    from shared.zoo.export_lm import edge_model_meta

    try:
        return edge_model_meta(config)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValidationError(f"config.json: {exc}") from None


def _side_files(ckpt: Path, dest: Path, edge_model: dict[str, Any] | None) -> None:
    """The checkpoint's config and tokenizer files, and ``edge_model.json`` (a GGUF artifact has none: its
    weight files say what they are)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in SIDE_FILES:
        if (ckpt / name).is_file():
            shutil.copy2(ckpt / name, dest / name)
    for template in sorted((ckpt / "additional_chat_templates").glob("*.jinja")):  # named templates (tool_use)
        (dest / "additional_chat_templates").mkdir(exist_ok=True)
        shutil.copy2(template, dest / "additional_chat_templates" / template.name)
    if edge_model is not None:
        (dest / EDGE_MODEL_FILE).write_text(json.dumps(edge_model, indent=2))


def _upload_dir(store: ArtifactStore, root: Path) -> list[FileEntry]:
    entries = []
    for p in sorted(root.rglob("*")):
        if p.is_file():
            blob = store.put_file(p)
            entries.append(FileEntry(p.relative_to(root).as_posix(), blob.size, blob.sha256))
    return entries


def _fail_pending(engine: Engine, job: DeriveJob, reason: str) -> None:
    try:
        with session_scope(engine) as session:
            model = registry.get_model(session, job.model)
            version = registry.get_version(session, model, job.number)
            for artifact_id in job.artifact_ids.values():
                artifact = session.get(ModelArtifact, artifact_id)
                if artifact is not None and artifact.status == "pending":
                    registry_artifacts.fail_artifact(session, model, version, artifact, reason=reason, actor=job.actor)
    except Exception:
        logger.exception("could not mark the artifacts of %s version %s failed", job.model, job.number)


def fail_stale_jobs(engine: Engine, older_than_s: float, now: datetime | None = None) -> int:
    """Mark artifacts still ``pending`` after ``older_than_s`` seconds ``failed``: their job died with its
    process (a console restart). Returns how many."""
    cutoff = (now or datetime.now(UTC)) - timedelta(seconds=older_than_s)
    with session_scope(engine) as session:
        rows = session.exec(
            select(ModelArtifact, ModelVersion, Model)
            .join(ModelVersion, col(ModelVersion.id) == col(ModelArtifact.version_id))
            .join(Model, col(Model.id) == col(ModelVersion.model_id))
            .where(ModelArtifact.status == "pending", col(ModelArtifact.created_at) < cutoff)
        ).all()
        for artifact, version, model in rows:
            reason = "the derive job stopped without finishing (its console restarted); derive again"
            registry_artifacts.fail_artifact(session, model, version, artifact, reason=reason, actor="derive")
    if rows:
        logger.warning("failed %d derived artifacts left pending by a stopped console", len(rows))
    return len(rows)


class DeriveRunner:
    """Runs derive jobs one at a time on a worker thread; :meth:`close` waits for the one in flight and marks
    jobs that never started ``failed``."""

    def __init__(self, engine: Engine, store: ArtifactStore, signing_key: Ed25519PrivateKey) -> None:
        self.engine = engine
        self.store = store
        self.signing_key = signing_key
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="derive")
        self._lock = threading.Lock()
        self._queued: dict[Future[DeriveResult], DeriveJob] = {}

    def submit(self, job: DeriveJob) -> Future[DeriveResult]:
        with self._lock:
            future = self._pool.submit(run_derive, self.engine, self.store, job, self.signing_key)
            self._queued[future] = job
        future.add_done_callback(self._forget)
        return future

    def _forget(self, future: Future[DeriveResult]) -> None:
        with self._lock:
            self._queued.pop(future, None)

    def close(self) -> None:
        with self._lock:
            waiting = [(f, j) for f, j in self._queued.items() if not f.running()]
        self._pool.shutdown(wait=True, cancel_futures=True)
        for future, job in waiting:
            if future.cancelled():
                _fail_pending(self.engine, job, "the console stopped before the job started; derive again")

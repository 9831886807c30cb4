"""Derive a registered cloud LM checkpoint's edge artifacts as a background job.

:func:`start_derive` (in the caller's transaction) registers the new edge version — its ``derived_from`` is
the cloud version — with one ``pending`` artifact per edge format. :func:`run_derive` (a worker thread, or the
CLI in the foreground) fetches the checkpoint from the artifact store, exports it with the zoo's exporter
(:mod:`shared.zoo.export_lm`: ONNX fp32 with a growing KV cache, ONNX Runtime's dynamic INT8 quantization,
TFLite with litert-torch when installed and asked for, GGUF Q8_0 + f32 for llama.cpp when asked for), checks
INT8 against fp32 and fills each artifact with its files and signed manifest.

Quality guard: INT8's next-token choices are compared with fp32's over held-out standard-library text (or
seeded random tokens when the checkpoint has no tokenizer); below ``min_int8_agreement`` the INT8 artifact is
recorded ``rejected`` (its bytes are kept, for a look, but it must not be served). A job that fails marks its
artifacts ``failed`` with the reason.
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

import numpy as np
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
from shared.artifacts import FileEntry
from shared.errors import ConflictError, ValidationError

logger = logging.getLogger(__name__)

SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
EDGE_MODEL_FILE = "edge_model.json"
NUM_CHECK_WINDOWS = 4
CHECK_WINDOW = 64
DERIVED_TAG = "derived"
SayFn = Callable[[str], None]


class DeriveSettings(BaseSettings):
    """Defaults of a derive job (a request may override them)."""

    model_config = SettingsConfigDict(env_prefix="TIERLINE_REGISTRY_", extra="ignore")

    min_int8_agreement: float = Field(
        0.9, ge=0.0, le=1.0, description="least INT8/fp32 next-token agreement; below it INT8 is rejected"
    )
    derive_tflite: bool | None = Field(
        None, description="also convert to TFLite; default: when litert-torch is installed"
    )
    tflite_cache_len: int | None = Field(None, gt=0, description="TFLite KV cache length; default: the max context")
    derive_gguf: bool = Field(
        False, description="also export GGUF (Q8_0 and f32 in one artifact) for llama.cpp on devices"
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


@dataclass(slots=True)
class DeriveResult:
    job: DeriveJob
    statuses: dict[str, str] = field(default_factory=dict)
    int8_agreement: float | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)


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
    return DeriveJob(name, number, version.number, ids, bound, settings.tflite_cache_len, actor)


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
    """Make the job's artifacts; never raises (a failure marks the artifacts ``failed``)."""
    tell = say or (lambda msg: logger.info("derive %s v%s: %s", job.model, job.number, msg))
    result = DeriveResult(job)
    try:
        with scratch_dir(store, "derive-") as work:
            _derive(engine, store, job, signing_key, work, tell, result)
    except Exception as exc:
        logger.exception("deriving edge artifacts of %s version %s failed", job.model, job.source_number)
        result.error = f"{type(exc).__name__}: {exc}"
        _fail_pending(engine, job, result.error)
        result.statuses = {f: "failed" for f in job.artifact_ids}
    return result


def _derive(
    engine: Engine,
    store: ArtifactStore,
    job: DeriveJob,
    signing_key: Ed25519PrivateKey,
    work: Path,
    say: SayFn,
    result: DeriveResult,
) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from shared.zoo.export_lm import export_onnx, export_tflite, quiet_root_logger

    with Session(engine) as session:
        model = registry.get_model(session, job.model)
        source = checkpoint_artifact(session, registry.get_version(session, model, job.source_number))
        parent = {"name": f"{job.model}@{job.source_number}", "sha256": source.sha256}
        ckpt = registry_artifacts.materialize(store, source, work / "checkpoint")
    say(f"fetched the checkpoint ({source.size} bytes)")
    meta = _edge_meta(json.loads((ckpt / "config.json").read_text()))
    dirs = {f: work / f for f in job.artifact_ids}
    export_onnx(ckpt, dirs["onnx"] / "model.onnx")
    dirs["onnx-int8"].mkdir()
    with quiet_root_logger():
        quantize_dynamic(dirs["onnx"] / "model.onnx", dirs["onnx-int8"] / "model.onnx", weight_type=QuantType.QInt8)
    for fmt in ("onnx", "onnx-int8"):
        _side_files(ckpt, dirs[fmt], {"format": fmt, "io": "growing-kv-cache/v1", **meta})
    agreement = int8_agreement(dirs["onnx"] / "model.onnx", dirs["onnx-int8"] / "model.onnx", ckpt, meta)
    result.int8_agreement = agreement
    verdict = int8_verdict(agreement, job.min_int8_agreement)
    bound = job.min_int8_agreement
    say(f"INT8 agrees with fp32 on {agreement:.1%} of next-token choices (bound {bound:.1%}): {verdict}")
    metadata: dict[str, dict[str, Any]] = {
        "onnx": {"derived_by": "tierline edge_derive"},
        "onnx-int8": {
            "derived_by": "tierline edge_derive",
            "agreement_with_fp32": round(agreement, 4),
            "min_agreement": job.min_int8_agreement,
        },
    }
    statuses = {"onnx": "ready", "onnx-int8": verdict}
    if "tflite" in dirs:
        say("converting to TFLite (litert-torch)")
        io = export_tflite(ckpt, dirs["tflite"] / "model.tflite", job.tflite_cache_len)
        _side_files(ckpt, dirs["tflite"], {"format": "tflite", **meta, **io})
        metadata["tflite"] = {"derived_by": "tierline edge_derive", **io}
        statuses["tflite"] = "ready"
    if "gguf" in dirs:
        from shared.zoo.export_gguf import GGUF_FILES, export_gguf

        say("exporting GGUF (Q8_0, f32) for llama.cpp")
        written = {kind: export_gguf(ckpt, dirs["gguf"] / name, kind) for kind, name in GGUF_FILES.items()}
        _side_files(ckpt, dirs["gguf"], None)
        metadata["gguf"] = {
            "derived_by": "tierline edge_derive",
            "runtime": "llama.cpp",
            "files": {kind: w["file"] for kind, w in written.items()},
        }
        statuses["gguf"] = "ready"
    uploaded = {fmt: _upload_dir(store, d) for fmt, d in dirs.items()}
    with session_scope(engine) as session:
        model = registry.get_model(session, job.model)
        version = registry.get_version(session, model, job.number)
        for fmt, artifact_id in job.artifact_ids.items():
            artifact = session.get(ModelArtifact, artifact_id)
            assert artifact is not None
            registry_artifacts.complete_artifact(
                session,
                store,
                model,
                version,
                artifact,
                files=uploaded[fmt],
                signing_key=signing_key,
                actor=job.actor,
                status=statuses[fmt],
                derived_from=parent,
                metadata=metadata[fmt],
            )
    result.statuses = statuses
    say("signed and stored: " + ", ".join(f"{f} {s}" for f, s in statuses.items()))


def _edge_meta(config: dict[str, Any]) -> dict[str, Any]:
    return {
        "num_layers": config["num_hidden_layers"],
        "num_kv_heads": config.get("num_key_value_heads") or config["num_attention_heads"],
        "head_dim": config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        "vocab_size": config["vocab_size"],
        "max_context": config.get("max_position_embeddings", 2048),
    }


def _side_files(ckpt: Path, dest: Path, edge_model: dict[str, Any] | None) -> None:
    """The checkpoint's config and tokenizer files, and ``edge_model.json`` (a GGUF artifact has none: its
    weight files say what they are)."""
    for name in SIDE_FILES:
        if (ckpt / name).is_file():
            shutil.copy2(ckpt / name, dest / name)
    if edge_model is not None:
        (dest / EDGE_MODEL_FILE).write_text(json.dumps(edge_model, indent=2))


def _upload_dir(store: ArtifactStore, root: Path) -> list[FileEntry]:
    entries = []
    for p in sorted(root.rglob("*")):
        if p.is_file():
            blob = store.put_file(p)
            entries.append(FileEntry(p.relative_to(root).as_posix(), blob.size, blob.sha256))
    return entries


def check_windows(ckpt: Path, meta: dict[str, Any]) -> np.ndarray:
    """Token windows for the INT8 check, int64 [N, W]: held-out stdlib text, or seeded random tokens."""
    width = min(CHECK_WINDOW, int(meta["max_context"]))
    need = NUM_CHECK_WINDOWS * width
    if (ckpt / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        from shared.zoo.corpus import held_out_files

        tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
        ids: list[int] = []
        for f in held_out_files():
            ids.extend(tok.encode(f.text).ids)
            if len(ids) >= need:
                return np.asarray(ids[:need], dtype=np.int64).reshape(NUM_CHECK_WINDOWS, width)
    rng = np.random.default_rng(0)
    return rng.integers(0, int(meta["vocab_size"]), size=(NUM_CHECK_WINDOWS, width), dtype=np.int64)


def int8_agreement(fp32_path: Path, int8_path: Path, ckpt: Path, meta: dict[str, Any]) -> float:
    """Share of positions where INT8's most likely next token is fp32's."""
    windows = check_windows(ckpt, meta)
    a = _logits(fp32_path, windows, meta)
    b = _logits(int8_path, windows, meta)
    return float((a.argmax(-1) == b.argmax(-1)).mean())


def _logits(model_path: Path, windows: np.ndarray, meta: dict[str, Any]) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    # past_keys / past_values: [L, B, KVH, 0, D] (an empty cache: the whole window is the prompt)
    empty = np.zeros((meta["num_layers"], len(windows), meta["num_kv_heads"], 0, meta["head_dim"]), np.float32)
    logits: np.ndarray = sess.run(["logits"], {"input_ids": windows, "past_keys": empty, "past_values": empty})[0]
    return logits


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

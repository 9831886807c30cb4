"""The tensor (non-LLM) models this cloud process serves, each behind a dynamic batcher, metered like LLM calls.

Two sources:

- the zoo's ONNX classifiers (``ZOO_TENSOR_MODELS``), loaded at start-up and always resident;
- registry models of kind ``tensor`` (``TIERLINE_CLOUD_REGISTRY_MODELS``: their names, or ``all``) with a ready
  ``cloud``/``onnx`` artifact. ``TensorRegistry.sync`` (a canary-refresh listener, in its worker thread) keeps a
  snapshot of their servable versions and aliases; a version is loaded on its first call (artifact fetched into
  the cache under the data dir, its manifest signature, digest and every file's sha256 checked before *every*
  load), on the best ONNX Runtime provider the host has (TensorRT, then CUDA, then CPU). Loaded versions share
  ``TIERLINE_CLOUD_TENSOR_MEMORY_MB`` (charged the artifact's bytes); a load that does not fit unloads the
  least-recently-used idle versions first, never one with a call in flight. The bare name is served by
  ``stable`` (else the highest ``active`` version) or by a cloud rollout's arm, like registry LLMs;
  ``NAME@REF`` pins a version number or alias.

Every call goes through ``CompletionService.reserve`` / ``_settle``: rate limits, budget hold, one usage record
with the call's input ``rows`` (priced per call and per row), whether it is direct, an async job or an edge
escalation.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import tempfile
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy.engine import Engine
from sqlmodel import Session

from cloud.serving.tensor import DynamicBatcher, OnnxRunner
from controlplane.billing.pricing import Tokens
from controlplane.registry.service import (
    STABLE,
    artifacts_of,
    is_safe_relpath,
    list_models,
    list_versions,
    routing_aliases,
)
from controlplane.registry.store import ArtifactStore
from shared.artifacts import Manifest, verify_files, verify_signature
from shared.errors import (
    ApplicationError,
    ArtifactVerificationError,
    NotFoundError,
    PermissionDeniedError,
    ServiceUnavailableError,
    ValidationError,
)
from shared.tensor_rows import tensor_rows
from shared.zoo.registry import ZooLayout

if TYPE_CHECKING:  # the engines (torch) load only where requests are served
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from cloud.serving.canary import CanaryRouter
    from cloud.serving.completions import Caller, CompletionService
    from controlplane.rollouts.service import RolloutPlan
    from shared.openai_schema import InferenceRequest

logger = logging.getLogger(__name__)

ZOO_TENSOR_MODELS = {"tierline/digits-large": "digits-large", "tierline/digits-small": "digits-small"}
PIN: Final = "@"
CACHE_DIR: Final = "cloud-tensor-models"


@dataclass(frozen=True, slots=True)
class BatchSettings:
    max_batch_size: int = 64
    max_queue_delay_ms: float = 2.0
    max_queue_size: int = 4096


@dataclass(slots=True, eq=False)
class ServedTensorModel:
    """One loaded model: a zoo classifier (``version`` None) or one registry version."""

    model_id: str  # what usage records name: the zoo id, or the registry model's name
    runner: OnnxRunner
    batcher: DynamicBatcher
    labels: list[Any] | None
    version: int | None = None
    nbytes: int = 0
    key: tuple[str, int, str] | None = None  # (name, version, artifact sha256) of a registry version
    in_flight: int = 0
    last_used: float = 0.0


@dataclass(frozen=True, slots=True)
class TensorVersion:
    """A servable registry version: its ready cloud ONNX artifact's signed manifest (as the registry holds it)."""

    number: int
    status: str
    sha256: str
    manifest: Mapping[str, Any]
    nbytes: int
    created: int = 0


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """What the cloud knows of one registry tensor model (the shape ``cloud.serving.canary.route`` routes on)."""

    name: str
    versions: Mapping[int, TensorVersion] = field(default_factory=dict)
    aliases: Mapping[str, int] = field(default_factory=dict)
    default: int | None = None
    stable_moved_at: datetime | None = None

    @property
    def loaded(self) -> frozenset[int]:
        """Every version that can serve a call (a tensor version loads on its first call)."""
        return frozenset(self.versions)


@dataclass(slots=True)
class _Counts:
    """Per registry version (name, number): what survives its unloads, for /metrics."""

    loads: int = 0
    unloads: int = 0
    batches: int = 0
    batch_rows: int = 0
    max_batch_rows: int = 0
    requests: int = 0


@dataclass(frozen=True, slots=True)
class _Target:
    """What billing needs before the model is loaded (``cloud.serving.engine_pool.Metered``)."""

    model_id: str
    version: int | None


def _retrieve(task: asyncio.Future[None]) -> None:
    """A load whose callers all left still has its failure looked at (no "exception never retrieved")."""
    if not task.cancelled():
        task.exception()


def _make_batcher(runner: OnnxRunner, batching: BatchSettings) -> DynamicBatcher:
    return DynamicBatcher(
        runner.run,
        batching.max_batch_size,
        batching.max_queue_delay_ms,
        batching.max_queue_size,
        validate=runner.check,
    )


class TensorPool:
    def __init__(
        self,
        models: dict[str, ServedTensorModel],
        *,
        memory_budget_bytes: int = 0,
        batching: BatchSettings | None = None,
        num_threads: int | None = None,
        cache_dir: Path | None = None,
        store: ArtifactStore | None = None,
        trusted_keys: list[Ed25519PublicKey] | None = None,
    ) -> None:
        self.models = models
        self.memory_budget_bytes = memory_budget_bytes  # 0: no budget
        self.batching = batching or BatchSettings()
        self.num_threads = num_threads
        self.cache_dir = cache_dir
        self.store = store
        self.trusted_keys = trusted_keys or []
        self.registry: dict[str, TensorEntry] = {}  # replaced whole by ``set_registry`` (a worker thread)
        self.service: CompletionService | None = None  # bills the calls; set once the service exists
        self.canary: CanaryRouter | None = None
        self._loaded: OrderedDict[tuple[str, int, str], ServedTensorModel] = OrderedDict()  # least recent first
        self._loading: dict[tuple[str, int, str], asyncio.Future[None]] = {}
        self._reserved_bytes = 0  # loads in progress
        self._counts: dict[tuple[str, int], _Counts] = {}
        self._is_started = False

    @classmethod
    def from_zoo(
        cls, zoo_root: Path, num_threads: int | None = None, batching: BatchSettings | None = None, **kwargs: Any
    ) -> TensorPool:
        layout = ZooLayout(zoo_root)
        batching = batching or BatchSettings()
        models = {}
        for model_id, name in ZOO_TENSOR_MODELS.items():
            d = layout.artifact_dir(name)
            if not (d / "model.onnx").is_file():
                continue
            meta = json.loads((d / "classifier.json").read_text()) if (d / "classifier.json").is_file() else {}
            runner = OnnxRunner(d / "model.onnx", num_threads=num_threads)
            models[model_id] = ServedTensorModel(model_id, runner, _make_batcher(runner, batching), meta.get("labels"))
        return cls(models, batching=batching, num_threads=num_threads, **kwargs)

    async def start(self) -> None:
        self._is_started = True
        for m in self.models.values():
            await m.batcher.start()

    async def close(self) -> None:
        self._is_started = False
        for m in self.models.values():
            await m.batcher.close()
        await asyncio.gather(*self._loading.values(), return_exceptions=True)  # loads under way land first
        for key in list(self._loaded):
            await self.unload(key, "shutdown")

    # -- what is served -----------------------------------------------------------------------------------------
    def set_registry(self, entries: dict[str, TensorEntry]) -> None:
        self.registry = entries  # one assignment: readers see the old snapshot or the new one

    def get(self, model_id: str) -> ServedTensorModel | None:
        """A zoo model (always loaded)."""
        return self.models.get(model_id)

    def serves(self, model_id: str) -> bool:
        """Whether ``model_id`` names a tensor model here: a zoo id, or a registry tensor model (``NAME[@REF]``)."""
        return model_id in self.models or model_id.partition(PIN)[0] in self.registry

    @property
    def loaded(self) -> list[tuple[str, int]]:
        """Registry versions loaded now, least recently used first."""
        return [(k[0], k[1]) for k in self._loaded]

    @property
    def used_bytes(self) -> int:
        return sum(m.nbytes for m in self._loaded.values()) + self._reserved_bytes

    def _resolve(self, caller: Caller, model_id: str) -> tuple[TensorEntry, TensorVersion]:
        name, sep, ref = model_id.partition(PIN)
        entry = self.registry.get(name)
        if entry is None:
            raise unknown_model(model_id)
        number: int | None
        if sep:
            number = entry.aliases.get(ref)
            if number is None and ref.isdigit():
                number = int(ref)
            if number is None or number not in entry.versions:
                raise NotFoundError(
                    f"The model '{name}' has no servable version or alias '{ref}' on this cloud",
                    param="model_id",
                    code="model_not_found",
                )
        else:
            number, arm = (
                self.canary.route(entry, caller.tenant.id or 0, caller.subject)
                if self.canary is not None
                else (entry.default, None)
            )
            if number is None or number not in entry.versions:
                raise NotFoundError(
                    f"The model '{name}' has no stable or active version with a ready ONNX artifact",
                    param="model_id",
                    code="model_not_found",
                )
            caller.rollout_arm = arm
        return entry, entry.versions[number]

    # -- metered calls ------------------------------------------------------------------------------------------
    async def inference(self, caller: Caller, req: InferenceRequest) -> dict[str, Any]:
        """``/v1/inference`` on a tensor model: rows in, one output per row (and labels for classifiers).

        Refused before any model work: a key not allowed the model, parameters, malformed rows, the rate limits
        and the budget (the call's cost is known in advance: per call + per row). Billed once, with its rows,
        when the outputs are ready; a call that fails is not billed.
        """
        model_id = req.model_id
        name = model_id.partition(PIN)[0]
        allowed = caller.key.allowed_models if caller.key is not None else None
        if allowed and model_id not in allowed and name not in allowed:
            raise PermissionDeniedError(f"this API key may not use model '{model_id}'", param="model_id")
        for param in req.parameters:  # a tensor model takes its inputs and nothing else
            raise ValidationError(
                f"parameters.{param}: unsupported parameter: tensor models take no parameters",
                param=f"parameters.{param}",
                code="unsupported_parameter",
            )
        zoo = self.models.get(model_id)
        version: TensorVersion | None = None
        if zoo is not None:
            target = _Target(model_id, None)
        else:
            entry, version = self._resolve(caller, model_id)
            target = _Target(entry.name, version.number)
            caller.model_version = str(version.number)
        rows = tensor_rows(req.inputs, model_id=model_id)
        if self.service is None:
            raise ServiceUnavailableError("tensor models are not billed yet; the server is starting")
        service = self.service
        meter = await service.reserve(caller, target, 0, Tokens(0, 0, rows=int(rows.shape[0])))
        status = "error"
        try:
            if version is None:
                assert zoo is not None
                result = await self._infer(zoo, rows)
            else:
                served = await self.acquire(target.model_id, version)
                try:
                    result = await self._infer(served, rows)
                finally:
                    self.release(served)
            meter.rows = int(rows.shape[0])
            status = "ok"
        except asyncio.CancelledError:
            status = "abandoned"
            raise
        finally:
            await service._settle(caller, target, meter, status)
        return {"model_id": model_id, **result, "usage": {"rows": meter.rows}}

    async def infer(self, model: ServedTensorModel, inputs: list[Any]) -> dict[str, Any]:
        """Rows in, one output per row, on a loaded model, unmetered (``inference`` is the metered call)."""
        return await self._infer(model, tensor_rows(inputs, model_id=model.model_id))

    async def _infer(self, model: ServedTensorModel, rows: np.ndarray) -> dict[str, Any]:
        out = await model.batcher.submit(rows)
        result: dict[str, Any] = {"outputs": out.tolist()}
        if model.labels is not None:
            result["labels"] = [model.labels[i] for i in np.argmax(out, axis=-1).tolist()]
        return result

    # -- loading and unloading ----------------------------------------------------------------------------------
    async def acquire(self, name: str, version: TensorVersion) -> ServedTensorModel:
        """The loaded version, loaded now if need be, counted in flight (so it is never unloaded under a call)."""
        key = (name, version.number, version.sha256)
        await self._drop_stale()
        while True:
            served = self._loaded.get(key)
            if served is not None:
                served.in_flight += 1
                served.last_used = time.monotonic()
                self._loaded.move_to_end(key)
                self._counts.setdefault(key[:2], _Counts()).requests += 1
                return served
            pending = self._loading.get(key)
            if pending is None:  # one load per version, in a task of its own: a caller leaving does not cancel it
                pending = asyncio.ensure_future(self._load_version(key, version))
                pending.add_done_callback(_retrieve)
                self._loading[key] = pending
            await asyncio.shield(pending)

    async def _load_version(self, key: tuple[str, int, str], version: TensorVersion) -> None:
        name = key[0]
        try:
            await self._make_room(name, version)
            self._reserved_bytes += version.nbytes
            try:
                served = await asyncio.to_thread(self._load, name, version)
                await served.batcher.start()
            finally:
                self._reserved_bytes -= version.nbytes
            self._loaded[key] = served
            self._counts.setdefault(key[:2], _Counts()).loads += 1
            logger.info(
                "loaded tensor model %s version %s on %s (%d bytes; %d of %s bytes in use)",
                name,
                version.number,
                served.runner.provider,
                served.nbytes,
                self.used_bytes,
                self.memory_budget_bytes or "unlimited",
            )
        finally:
            self._loading.pop(key, None)

    def release(self, served: ServedTensorModel) -> None:
        served.in_flight -= 1
        served.last_used = time.monotonic()

    async def _make_room(self, name: str, version: TensorVersion) -> None:
        budget = self.memory_budget_bytes
        if not budget:
            return
        if version.nbytes > budget:
            raise ServiceUnavailableError(
                f"the model '{name}' version {version.number} needs {version.nbytes} bytes, more than the tensor "
                f"memory budget of {budget} bytes (TIERLINE_CLOUD_TENSOR_MEMORY_MB)"
            )
        while self.used_bytes + version.nbytes > budget:
            idle = [k for k, m in self._loaded.items() if m.in_flight == 0]
            if not idle:
                raise ServiceUnavailableError(
                    f"no room to load '{name}' version {version.number}: the tensor memory budget is held by models "
                    "with calls in flight; retry shortly"
                )
            await self.unload(idle[0], f"least recently used; room for {name} version {version.number}")

    async def unload(self, key: tuple[str, int, str], why: str) -> None:
        served = self._loaded.pop(key)
        counts = self._counts.setdefault(key[:2], _Counts())
        counts.unloads += 1
        b = served.batcher
        counts.batches += b.num_batches
        counts.batch_rows += b.num_batch_rows
        counts.max_batch_rows = max(counts.max_batch_rows, b.max_batch_rows)
        await b.close()
        logger.info("unloaded tensor model %s version %s (%s)", key[0], key[1], why)

    async def _drop_stale(self) -> None:
        """Unload idle versions the registry no longer serves (retired, or their artifact replaced)."""
        for key, served in list(self._loaded.items()):
            entry = self.registry.get(key[0])
            version = entry.versions.get(key[1]) if entry is not None else None
            if served.in_flight == 0 and (version is None or version.sha256 != key[2]):
                await self.unload(key, "no longer served by the registry")

    def _load(self, name: str, version: TensorVersion) -> ServedTensorModel:
        """Fetch (or reuse) the version's files, verify them, and open an ONNX Runtime session (worker thread).

        Raises ``ServiceUnavailableError`` naming what is wrong (a bad signature, digest or file, an unreadable
        model): the caller's request is fine, the version cannot be served.
        """
        if self.store is None or self.cache_dir is None:
            raise ServiceUnavailableError("registry tensor models are not configured on this cloud")
        try:
            manifest = self.verified_manifest(name, version)
            model_dir = self._materialize(name, version, manifest)
            onnx = sorted(e.path for e in manifest.files if e.path.endswith(".onnx"))
            if not onnx:
                raise ArtifactVerificationError(f"{name} version {version.number}: the artifact holds no .onnx file")
            runner = OnnxRunner(model_dir / onnx[0], num_threads=self.num_threads)
        except ApplicationError as exc:
            logger.error("tensor model %s version %s cannot be loaded: %s", name, version.number, exc.message)
            raise ServiceUnavailableError(
                f"the model '{name}' version {version.number} cannot be loaded: {exc.message}"
            ) from exc
        if not runner.is_batchable:
            logger.warning("%s version %s has a fixed batch dimension; calls are not batched", name, version.number)
        labels = manifest.metadata.get("labels") if isinstance(manifest.metadata, dict) else None
        return ServedTensorModel(
            name,
            runner,
            _make_batcher(runner, self.batching if runner.is_batchable else BatchSettings(1, 0.0)),
            list(labels) if isinstance(labels, list) else None,
            version=version.number,
            nbytes=version.nbytes,
            key=(name, version.number, version.sha256),
        )

    def verified_manifest(self, name: str, version: TensorVersion) -> Manifest:
        """The version's manifest, its signature checked against the platform key and its digest against the
        artifact's sha256."""
        manifest = Manifest.from_json(json.dumps(dict(version.manifest)))
        verify_signature(manifest, self.trusted_keys)
        for entry in manifest.files:
            if not is_safe_relpath(entry.path):
                raise ArtifactVerificationError(f"{name} version {version.number}: unsafe path {entry.path!r}")
        if manifest.sha256 != version.sha256:
            raise ArtifactVerificationError(f"{name} version {version.number}: manifest does not match its sha256")
        if manifest.name != name or manifest.version != str(version.number):
            raise ArtifactVerificationError(
                f"{name} version {version.number}: the manifest is for {manifest.name} version {manifest.version}"
            )
        return manifest

    def _materialize(self, name: str, version: TensorVersion, manifest: Manifest) -> Path:
        """The version's files under the cache dir, every file checked against its sha256 on every load (a damaged
        cached copy is fetched anew)."""
        assert self.cache_dir is not None and self.store is not None
        parent = self.cache_dir / name
        dest = parent / f"{version.number}-{version.sha256[:16]}"
        if dest.is_dir():
            try:
                verify_files(manifest, dest)
                return dest
            except ArtifactVerificationError as exc:
                logger.warning("cached %s version %s is damaged (%s); fetching it again", name, version.number, exc)
                shutil.rmtree(dest)
        parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=parent, prefix=".partial-"))
        try:
            for entry in manifest.files:
                self.store.fetch(entry.sha256, staging / entry.path)
            verify_files(manifest, staging)
            try:
                staging.rename(dest)
            except OSError:  # another process put it in place meanwhile
                verify_files(manifest, dest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return dest

    # -- observability ------------------------------------------------------------------------------------------
    def catalog(self) -> list[tuple[str, str, int]]:
        """``(id, sha256, created)`` of the registry tensor models served by name."""
        out = []
        for entry in sorted(self.registry.values(), key=lambda e: e.name):
            if entry.default is not None and entry.default in entry.versions:
                v = entry.versions[entry.default]
                out.append((entry.name, v.sha256, v.created))
        return out

    def collector(self) -> Collector:
        return _TensorCollector(self)

    def stats(self) -> dict[tuple[str, int], _Counts]:
        """Per registry version: loads, unloads, batches and batch rows so far (loaded batchers included)."""
        out = {k: _Counts(**{f: getattr(c, f) for f in c.__slots__}) for k, c in self._counts.items()}
        for key, served in list(self._loaded.items()):
            c = out.setdefault(key[:2], _Counts())
            b = served.batcher
            c.batches += b.num_batches
            c.batch_rows += b.num_batch_rows
            c.max_batch_rows = max(c.max_batch_rows, b.max_batch_rows)
        return out


class _TensorCollector(Collector):
    def __init__(self, pool: TensorPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        by = ["model", "version"]
        loaded = GaugeMetricFamily("tierline_tensor_model_loaded", "1: the registry version is loaded", labels=by)
        loads = CounterMetricFamily("tierline_tensor_model_loads", "Loads of a registry tensor version", labels=by)
        unloads = CounterMetricFamily(
            "tierline_tensor_model_unloads", "Unloads of a registry tensor version (memory budget, retired)", labels=by
        )
        batches = CounterMetricFamily("tierline_tensor_batches", "Batches a tensor model ran", labels=by)
        rows = CounterMetricFamily("tierline_tensor_batch_rows", "Rows in the batches a tensor model ran", labels=by)
        biggest = GaugeMetricFamily("tierline_tensor_max_batch_rows", "The largest batch a tensor model ran", labels=by)
        is_loaded = set(self.pool.loaded)
        for (name, number), c in sorted(self.pool.stats().items()):
            lv = [name, str(number)]
            loaded.add_metric(lv, 1.0 if (name, number) in is_loaded else 0.0)
            loads.add_metric(lv, c.loads)
            unloads.add_metric(lv, c.unloads)
            batches.add_metric(lv, c.batches)
            rows.add_metric(lv, c.batch_rows)
            biggest.add_metric(lv, c.max_batch_rows)
        for model_id, m in sorted(self.pool.models.items()):
            lv = [model_id, ""]
            batches.add_metric(lv, m.batcher.num_batches)
            rows.add_metric(lv, m.batcher.num_batch_rows)
            biggest.add_metric(lv, m.batcher.max_batch_rows)
        used = GaugeMetricFamily("tierline_tensor_memory_bytes", "Bytes the loaded registry tensor versions hold")
        used.add_metric([], self.pool.used_bytes)
        budget = GaugeMetricFamily("tierline_tensor_memory_budget_bytes", "TIERLINE_CLOUD_TENSOR_MEMORY_MB (0: none)")
        budget.add_metric([], self.pool.memory_budget_bytes)
        yield from (loaded, loads, unloads, batches, rows, biggest, used, budget)


@dataclass(slots=True)
class _Read:
    name: str
    aliases: dict[str, int] = field(default_factory=dict)
    stable_moved_at: datetime | None = None
    versions: dict[int, TensorVersion] = field(default_factory=dict)


class TensorRegistry:
    """Keeps ``pool.registry`` in step with the registry's tensor models (run in the canary refresh's thread)."""

    def __init__(self, db: Engine, pool: TensorPool, names: frozenset[str] | None) -> None:
        self.db = db
        self.pool = pool
        self.names = names  # None: every tensor model

    def sync(self, _plans: list[RolloutPlan] | None = None) -> None:
        entries = {}
        for read in self._read():
            stable = read.aliases.get(STABLE)
            default = (
                stable
                if stable is not None and stable in read.versions
                else max((n for n, v in read.versions.items() if v.status == "active"), default=None)
            )
            entries[read.name] = TensorEntry(
                read.name,
                read.versions,
                {a: n for a, n in read.aliases.items() if n in read.versions},
                default,
                read.stable_moved_at,
            )
        before = self.pool.registry
        for name, entry in entries.items():
            old = before.get(name)
            if old is None or (old.default, sorted(old.versions)) != (entry.default, sorted(entry.versions)):
                logger.info(
                    "registry tensor model %s: versions %s, served by name: %s",
                    name,
                    sorted(entry.versions),
                    entry.default,
                )
        self.pool.set_registry(entries)

    def _read(self) -> list[_Read]:
        with Session(self.db) as session:
            models = [
                m for m in list_models(session) if m.kind == "tensor" and (self.names is None or m.name in self.names)
            ]
            out = []
            for model in models:
                read = _Read(model.name)
                versions = {v.id or 0: v for v in list_versions(session, model) if v.status != "retired"}
                by_version = artifacts_of(session, list(versions))
                for vid, version in versions.items():
                    ready = [
                        a
                        for a in by_version.get(vid, [])
                        if a.target == "cloud" and a.format == "onnx" and a.status == "ready"
                    ]
                    if not ready:
                        continue
                    a = ready[-1]
                    read.versions[version.number] = TensorVersion(
                        version.number,
                        version.status,
                        a.sha256,
                        dict(a.manifest),
                        int(a.size),
                        int(version.created_at.timestamp()) if version.created_at else 0,
                    )
                aliases, read.stable_moved_at = routing_aliases(session, model)
                read.aliases.update(aliases)
                out.append(read)
            return out


def unknown_model(model_id: str) -> NotFoundError:
    return NotFoundError(f"The model '{model_id}' does not exist", param="model_id", code="model_not_found")

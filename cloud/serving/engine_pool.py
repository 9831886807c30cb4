"""The LLM engines this cloud process serves: one engine (``start_engine``) per causal LM of the zoo, and one per loaded
version of each registry model (every one, or those ``TIERLINE_CLOUD_REGISTRY_MODELS`` lists, see
``cloud.serving.registry_models``). A registry version not loaded yet, or that failed to load, answers 503 saying so
(``model_loading`` with Retry-After, ``model_unavailable`` with the reason), never 404.

Model ids on the wire: a zoo model by its id (``tierline/lm-cloud``); a registry model by its name (``tiny-lm``:
whichever version routing picks), or pinned to a version with ``NAME@REF`` where REF is a version number or an
alias (``tiny-lm@2``, ``tiny-lm@stable``).

Supervision (``EnginePool.supervise``): a zoo engine whose child process dies is restarted with exponential
backoff; until its successor is ready, requests for its model get 503 with ``Retry-After`` and ``/readyz`` names
it as restarting. Its streams in flight have already ended with an error (``EngineProcess`` fails them when the
pipe closes) and are billed for what they got.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Protocol

from cloud.engine.async_engine import AsyncLLMEngine, EngineClient
from cloud.engine.config import EngineConfig
from cloud.settings import CloudSettings
from shared.errors import NotFoundError, ServiceUnavailableError
from shared.zoo.registry import ZooLayout

logger = logging.getLogger(__name__)


class Metered(Protocol):
    """What billing needs of the model that served a request: an engine here (``ServedLM``) or an upstream server
    (``cloud.serving.backends.upstream.RemoteLM``, which this module never imports: it sits above)."""

    @property
    def model_id(self) -> str: ...

    @property
    def version(self) -> int | None: ...


# model id → (artifact, draft artifact for speculative decoding)
ZOO_LMS = {"tierline/lm-cloud": ("lm-cloud", "lm-draft"), "tierline/lm-edge": ("lm-edge", None)}
PIN_SEPARATOR = "@"
SUPERVISE_INTERVAL_S = 0.5  # how often the supervisor looks at each engine
LOAD_ESTIMATE_S = 10.0  # Retry-After's guess of a model's load time before one restart has measured it


class ModelLoadingError(ServiceUnavailableError):
    """503 with Retry-After: the registry version is being loaded (at its first request); retry shortly."""

    code = "model_loading"

    def __init__(self, message: str, *, retry_after: float) -> None:
        super().__init__(message, param="model")
        self.retry_after = retry_after


class ModelUnavailableError(ServiceUnavailableError):
    """503: the registry version failed to load; the message says why (an operator fixes it, not a retry)."""

    code = "model_unavailable"


class EngineRestartingError(ServiceUnavailableError):
    """503 with Retry-After: the model's engine died and is being restarted."""

    code = "engine_restarting"

    def __init__(self, message: str, *, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def describe_exit(code: int | None) -> str:
    """``killed by SIGKILL`` / ``exit code 1`` / ``exit code unknown`` (an engine on a thread of this process)."""
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


@dataclass(slots=True)
class ServedLM:
    model_id: str
    version: int | None
    engine: EngineClient
    max_model_len: int


@dataclass(frozen=True, slots=True)
class RegistryEntry:
    """What the cloud knows of one registry model: its loaded versions and where its aliases point.

    ``default`` is the version a request for the bare name gets outside a rollout: ``stable`` when it is loaded,
    else the highest ``active`` loaded version. ``stable_moved_at`` lets a later alias move override a finished
    rollout (see ``cloud.serving.canary.route_registry``).
    """

    name: str
    versions: Mapping[int, ServedLM] = field(default_factory=dict)
    aliases: Mapping[str, int] = field(default_factory=dict)
    default: int | None = None
    stable_moved_at: datetime | None = None
    created: int = 0
    sha256: str = ""
    remote: Mapping[int, Metered] = field(default_factory=dict)  # versions an ``openai`` backend answers
    pending: frozenset[int] = frozenset()  # versions loaded at their first request (not yet asked for)
    failed: Mapping[int, str] = field(default_factory=dict)  # versions that failed to load → the one-line reason

    @property
    def loaded(self) -> frozenset[int]:
        """Every version that can serve a request: an engine's or an upstream's."""
        return frozenset(self.versions) | frozenset(self.remote)

    def number(self, ref: str | None) -> int | None:
        """The version ``ref`` names (a number or an alias); None: the default."""
        if ref is None:
            return self.default
        return int(ref) if ref.isascii() and ref.isdigit() else self.aliases.get(ref)


def split_model(model: str) -> tuple[str, str | None]:
    """``tiny-lm@2`` → (``tiny-lm``, ``2``); a name without a pin → (name, None)."""
    name, sep, ref = model.partition(PIN_SEPARATOR)
    return (name, ref) if sep else (model, None)


def engine_config(model_dir: Path, settings: CloudSettings, draft_dir: Path | None = None) -> EngineConfig:
    threads = settings.num_threads
    if threads is None and settings.engine_process and settings.device == "cpu":
        # A CPU engine in its own process leaves one core to the API process: with every core in torch's pool,
        # the HTTP loop waited for the engine's threads (313 vs 536 requests/s on 2 cores, bench/api_bench.py).
        threads = max(1, len(os.sched_getaffinity(0)) - 1)
    return EngineConfig(
        model_dir=model_dir,
        draft_model_dir=draft_dir,
        device=settings.device,
        kv_cache_bytes=settings.kv_cache_mb << 20,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=max(settings.max_num_batched_tokens, settings.max_num_seqs),
        max_num_queued_requests=settings.max_num_queued_requests,
        speculation="ngram" if settings.speculation == "ngram" else None,
        num_threads=threads,
        stream_interval=settings.stream_interval,
        decode_burst_ms=settings.decode_burst_ms,
        enforce_eager=settings.enforce_eager,
        cpu_weights=settings.cpu_weights,
        draft_cpu_weights=settings.draft_cpu_weights,
    )


def start_engine(config: EngineConfig, name: str, settings: CloudSettings) -> EngineClient:
    """An engine for ``config``: its step loop in a child process (``settings.engine_process``, the default), whose
    model is still loading when this returns (``wait_ready``), else on a thread of this process, loaded."""
    if settings.engine_process:
        from cloud.engine.process import EngineProcess
        from shared.settings import CoreSettings

        return EngineProcess(config, name, CoreSettings().log_level)
    return AsyncLLMEngine.from_config(config, name=name)


class ServedEngines(Mapping[str, ServedLM]):
    """Model id → engine. Iterating yields each engine once (zoo ids, and ``NAME@N`` per registry version);
    looking up also resolves a registry model's bare name (its default version) and ``NAME@ALIAS``."""

    def __init__(self, zoo: Mapping[str, ServedLM], registry: Mapping[str, RegistryEntry]) -> None:
        self._zoo = zoo
        self._registry = registry

    def __getitem__(self, model_id: str) -> ServedLM:
        served = self._zoo.get(model_id)
        if served is not None:
            return served
        name, ref = split_model(model_id)
        entry = self._registry.get(name)
        if entry is None:
            raise KeyError(model_id)
        number = entry.number(ref)
        if number is None or number not in entry.versions:
            raise KeyError(model_id)
        return entry.versions[number]

    def __iter__(self) -> Iterator[str]:
        yield from self._zoo
        for name, entry in self._registry.items():
            for number in sorted(entry.versions):
                yield f"{name}{PIN_SEPARATOR}{number}"

    def __len__(self) -> int:
        return len(self._zoo) + sum(len(e.versions) for e in self._registry.values())


class EnginePool:
    """Loads the engines and resolves a request's model id to one of them.

    Registry entries are replaced whole (``set_registry``), never mutated, so the event loop reads a consistent
    snapshot while a worker thread loads a new version.
    """

    def __init__(
        self,
        engines: dict[str, ServedLM],
        specs: Mapping[str, tuple[EngineConfig, str]] | None = None,
        settings: CloudSettings | None = None,
    ) -> None:
        self._zoo = engines
        self.registry: Mapping[str, RegistryEntry] = {}
        self.engines: Mapping[str, ServedLM] = ServedEngines(self._zoo, self.registry)
        # What supervision restarts: zoo model id → (config, name) its engine was started with.
        self._specs = dict(specs or {})
        self._settings = settings or CloudSettings()
        self._swap = threading.Lock()  # ``set_registry`` runs on a worker thread; a restart swaps ``_zoo``
        self._supervisor: asyncio.Task[None] | None = None
        self._restarts: dict[str, asyncio.Task[None]] = {}  # model id → its restart in progress
        self._ready_at: dict[str, float] = {}  # model id → when its successor should be up (Retry-After)
        self._failures: dict[str, int] = {}  # model id → restarts since it last stayed up for the maximum backoff
        self._started_at: dict[str, float] = {}
        self._load_s: dict[str, float] = {}
        self.restart_counts: dict[str, int] = {}  # model id → engines restarted (tierline_engine_restarts_total)
        self._closing = False
        # Told of a request for a registry version not loaded yet (``cloud.serving.registry_models`` loads it next
        # refresh).
        self.on_demand: Callable[[str, int], None] | None = None
        self.load_retry_after_s = LOAD_ESTIMATE_S

    @classmethod
    def from_zoo(cls, zoo_root: Path, settings: CloudSettings) -> EnginePool:
        layout = ZooLayout(zoo_root)
        started: dict[str, EngineClient] = {}
        specs: dict[str, tuple[EngineConfig, str]] = {}
        for model_id, (name, draft) in ZOO_LMS.items():
            model_dir = layout.artifact_dir(name)
            if not (model_dir / "config.json").is_file():
                continue
            draft_dir = layout.artifact_dir(draft) if draft and settings.speculation == "draft" else None
            if draft_dir is not None and not (draft_dir / "config.json").is_file():
                draft_dir = None
            specs[model_id] = (engine_config(model_dir, settings, draft_dir), name)
            started[model_id] = start_engine(specs[model_id][0], name, settings)
        engines: dict[str, ServedLM] = {}
        try:
            for model_id, engine in started.items():  # the children load in parallel
                engine.wait_ready()
                engines[model_id] = ServedLM(model_id, None, engine, engine.max_model_len)
                logger.info("serving %s (%s)", model_id, engine.name)
        except BaseException:
            for engine in started.values():
                engine.shutdown()
            raise
        return cls(engines, specs, settings)

    def set_registry(self, registry: Mapping[str, RegistryEntry]) -> None:
        with self._swap:
            self.registry = registry
            self.engines = ServedEngines(self._zoo, registry)

    # -- supervision ----------------------------------------------------------------------------------------------
    def supervise(self) -> None:
        """Watch the zoo engines on the running event loop and restart any that dies (until ``close``)."""
        if self._supervisor is None and self._specs:
            self._supervisor = asyncio.create_task(self._watch(), name="supervising the engines")

    def restarting(self) -> list[str]:
        """Zoo models whose engine is dead and being restarted (degraded)."""
        return sorted(m for m, served in self._zoo.items() if m in self._specs and not served.engine.alive)

    async def close(self) -> None:
        """Stop supervising: no restart after this (``shutdown`` then stops the engines)."""
        self._closing = True
        tasks = [t for t in (self._supervisor, *self._restarts.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._supervisor = None
        self._restarts.clear()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(SUPERVISE_INTERVAL_S)
            for model_id, served in self._zoo.items():
                if model_id in self._specs and model_id not in self._restarts and not served.engine.alive:
                    task = asyncio.create_task(self._restart(model_id, served.engine), name=f"restarting {model_id}")
                    self._restarts[model_id] = task
                    task.add_done_callback(functools.partial(self._restarted, model_id))

    def _restarted(self, model_id: str, _task: asyncio.Task[None]) -> None:
        self._restarts.pop(model_id, None)

    async def _restart(self, model_id: str, dead: EngineClient) -> None:
        settings = self._settings
        now = time.monotonic()
        logger.error("engine %s (%s) died (%s); restarting it", model_id, dead.name, describe_exit(dead.exitcode))
        dead.shutdown(timeout=1)  # fails the streams still waiting on it (if the pipe has not yet) and reaps it
        failures = self._failures.get(model_id, 0)
        if now - self._started_at.get(model_id, 0.0) >= settings.engine_restart_backoff_max_s:
            failures = 0  # it stayed up a while: this death starts a new series
        while True:
            delay = min(settings.engine_restart_backoff_max_s, settings.engine_restart_backoff_s * 2**failures)
            failures += 1
            self._ready_at[model_id] = time.monotonic() + delay + self._load_s.get(model_id, LOAD_ESTIMATE_S)
            await asyncio.sleep(delay)
            started = time.monotonic()
            try:
                engine = await asyncio.to_thread(self._start, model_id)
            except Exception:
                logger.exception("restarting engine %s failed; trying again", model_id)
                continue
            break
        self._load_s[model_id] = time.monotonic() - started
        self._failures[model_id] = failures
        self._started_at[model_id] = time.monotonic()
        with self._swap:  # one new mapping, swapped in whole: a reader sees the old engine or the new, never neither
            self._zoo = {**self._zoo, model_id: ServedLM(model_id, None, engine, engine.max_model_len)}
            self.engines = ServedEngines(self._zoo, self.registry)
        self.restart_counts[model_id] = self.restart_counts.get(model_id, 0) + 1
        logger.warning("engine %s restarted (%s, loaded in %.1fs)", model_id, engine.name, self._load_s[model_id])

    def _start(self, model_id: str) -> EngineClient:
        """A new engine for ``model_id``, loaded (on a worker thread: loading blocks)."""
        config, name = self._specs[model_id]
        engine = start_engine(config, name, self._settings)
        try:
            engine.wait_ready()
        except BaseException:
            engine.shutdown(timeout=5)
            raise
        if self._closing:  # the app stopped while it loaded
            engine.shutdown(timeout=5)
            raise ServiceUnavailableError(f"engine {name} started while the cloud stopped")
        return engine

    def remote_version(self, model_id: str) -> Metered | None:
        """The upstream-served registry version ``model_id`` names (bare name: the default version), if it is one."""
        name, ref = split_model(model_id)
        entry = self.registry.get(name)
        if entry is None or not entry.remote:
            return None
        number = entry.number(ref)
        return entry.remote.get(number) if number is not None else None

    def serves(self, model_id: str) -> bool:
        """An engine or an upstream of a registry version answers ``model_id``."""
        return model_id in self.engines or self.remote_version(model_id) is not None

    def get(self, model_id: str) -> ServedLM:
        served = self.engines.get(model_id)
        if served is None:
            name, ref = split_model(model_id)
            entry = self.registry.get(name)
            number = entry.number(ref) if entry is not None else None
            if entry is not None and number is not None:
                self._not_loaded(model_id, entry, number)
            if entry is not None:
                if ref is None:
                    raise NotFoundError(
                        f"The model '{name}' has no stable or active version loaded",
                        param="model",
                        code="model_not_found",
                    )
                raise NotFoundError(
                    f"The model '{name}' has no version or alias '{ref}' loaded on this cloud",
                    param="model",
                    code="model_not_found",
                )
            raise NotFoundError(f"The model '{model_id}' does not exist", param="model", code="model_not_found")
        if served.version is None and served.model_id in self._specs and not served.engine.alive:
            eta = self._ready_at.get(served.model_id, time.monotonic() + LOAD_ESTIMATE_S) - time.monotonic()
            raise EngineRestartingError(
                f"The model '{model_id}' is restarting (its engine stopped); retry later",
                retry_after=max(1.0, eta),
            )
        return served

    def _not_loaded(self, model_id: str, entry: RegistryEntry, number: int) -> None:
        """503 for a registry version that failed to load (why) or loads at this first request (Retry-After)."""
        reason = entry.failed.get(number)
        if reason is not None:
            raise ModelUnavailableError(
                f"The model '{model_id}' (version {number} of {entry.name}) failed to load: {reason}", param="model"
            )
        if number in entry.pending:
            if self.on_demand is not None:
                self.on_demand(entry.name, number)
            raise ModelLoadingError(
                f"The model '{model_id}' (version {number} of {entry.name}) is loading; retry shortly",
                retry_after=self.load_retry_after_s,
            )

    def failures(self) -> list[str]:
        """``NAME@N: why`` for each registry version that failed to load (``/readyz`` lists them as degraded)."""
        return [f"{e.name}@{n}: {why}" for e in self.registry.values() for n, why in sorted(e.failed.items())]

    def shutdown(self) -> None:
        for served in self.engines.values():
            served.engine.shutdown()

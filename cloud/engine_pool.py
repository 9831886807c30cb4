"""The LLM engines this cloud process serves: one engine (``start_engine``) per causal LM of the zoo, and one per loaded
version of each registry model the cloud is told to serve (``TIERLINE_CLOUD_REGISTRY_MODELS``, see
``cloud.registry_models``).

Model ids on the wire: a zoo model by its id (``tierline/lm-cloud``); a registry model by its name (``tiny-lm``:
whichever version routing picks), or pinned to a version with ``NAME@REF`` where REF is a version number or an
alias (``tiny-lm@2``, ``tiny-lm@stable``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from cloud.engine.async_engine import AsyncLLMEngine, EngineClient
from cloud.engine.config import EngineConfig
from cloud.settings import CloudSettings
from shared.errors import NotFoundError
from shared.zoo.registry import ZooLayout

logger = logging.getLogger(__name__)

# model id → (artifact, draft artifact for speculative decoding)
ZOO_LMS = {"tierline/lm-cloud": ("lm-cloud", "lm-draft"), "tierline/lm-edge": ("lm-edge", None)}
PIN_SEPARATOR = "@"


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
    rollout (see ``cloud.canary.route_registry``).
    """

    name: str
    versions: Mapping[int, ServedLM] = field(default_factory=dict)
    aliases: Mapping[str, int] = field(default_factory=dict)
    default: int | None = None
    stable_moved_at: datetime | None = None
    created: int = 0
    sha256: str = ""


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
        number = (
            entry.default if ref is None else int(ref) if ref.isascii() and ref.isdigit() else entry.aliases.get(ref)
        )
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

    def __init__(self, engines: dict[str, ServedLM]) -> None:
        self._zoo = engines
        self.registry: Mapping[str, RegistryEntry] = {}
        self.engines: Mapping[str, ServedLM] = ServedEngines(self._zoo, self.registry)

    @classmethod
    def from_zoo(cls, zoo_root: Path, settings: CloudSettings) -> EnginePool:
        layout = ZooLayout(zoo_root)
        started: dict[str, EngineClient] = {}
        for model_id, (name, draft) in ZOO_LMS.items():
            model_dir = layout.artifact_dir(name)
            if not (model_dir / "config.json").is_file():
                continue
            draft_dir = layout.artifact_dir(draft) if draft and settings.speculation == "draft" else None
            if draft_dir is not None and not (draft_dir / "config.json").is_file():
                draft_dir = None
            started[model_id] = start_engine(engine_config(model_dir, settings, draft_dir), name, settings)
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
        return cls(engines)

    def set_registry(self, registry: Mapping[str, RegistryEntry]) -> None:
        self.registry = registry
        self.engines = ServedEngines(self._zoo, registry)

    def get(self, model_id: str) -> ServedLM:
        served = self.engines.get(model_id)
        if served is None:
            name, ref = split_model(model_id)
            if name in self.registry:
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
        return served

    def shutdown(self) -> None:
        for served in self.engines.values():
            served.engine.shutdown()

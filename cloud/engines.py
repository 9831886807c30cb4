"""The LLM engines this cloud process serves: one ``AsyncLLMEngine`` per causal LM of the zoo."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from cloud.engine.async_engine import AsyncLLMEngine
from cloud.engine.config import EngineConfig
from cloud.settings import CloudSettings
from shared.errors import NotFoundError
from shared.zoo.registry import ZooLayout

logger = logging.getLogger(__name__)

# model id → (artifact, draft artifact for speculative decoding)
ZOO_LMS = {"tierline/lm-cloud": ("lm-cloud", "lm-edge"), "tierline/lm-edge": ("lm-edge", None)}


@dataclass(slots=True)
class ServedLM:
    model_id: str
    version: int | None
    engine: AsyncLLMEngine
    max_model_len: int


class EnginePool:
    """Loads the engines at start-up and resolves a request's model id to one of them."""

    def __init__(self, engines: dict[str, ServedLM]) -> None:
        self.engines = engines

    @classmethod
    def from_zoo(cls, zoo_root: Path, settings: CloudSettings) -> EnginePool:
        layout = ZooLayout(zoo_root)
        engines: dict[str, ServedLM] = {}
        for model_id, (name, draft) in ZOO_LMS.items():
            model_dir = layout.artifact_dir(name)
            if not (model_dir / "config.json").is_file():
                continue
            draft_dir = layout.artifact_dir(draft) if draft and settings.speculation == "draft" else None
            if draft_dir is not None and not (draft_dir / "config.json").is_file():
                draft_dir = None
            config = EngineConfig(
                model_dir=model_dir,
                draft_model_dir=draft_dir,
                device=settings.device,
                kv_cache_bytes=settings.kv_cache_mb << 20,
                max_num_seqs=settings.max_num_seqs,
                max_num_batched_tokens=max(settings.max_num_batched_tokens, settings.max_num_seqs),
                max_num_queued_requests=settings.max_num_queued_requests,
                speculation="ngram" if settings.speculation == "ngram" else None,
                num_threads=settings.num_threads,
            )
            engine = AsyncLLMEngine.from_config(config, name=name)
            engines[model_id] = ServedLM(model_id, None, engine, engine.engine.max_model_len)
            logger.info("serving %s from %s", model_id, model_dir)
        return cls(engines)

    def get(self, model_id: str) -> ServedLM:
        served = self.engines.get(model_id)
        if served is None:
            raise NotFoundError(f"The model '{model_id}' does not exist", param="model", code="model_not_found")
        return served

    def shutdown(self) -> None:
        for served in self.engines.values():
            served.engine.shutdown()

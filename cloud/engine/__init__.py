"""The cloud LLM engine: continuous batching over a paged KV cache with prefix caching and speculative decoding.

``LLM`` and ``SamplingParams`` are imported lazily so that ``cloud.engine.scheduler`` and the other pure
modules stay importable without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cloud.engine.async_engine import AsyncLLMEngine
    from cloud.engine.config import EngineConfig
    from cloud.engine.llm import LLM
    from cloud.engine.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncLLMEngine", "EngineConfig", "SamplingParams"]

_EXPORTS = {
    "LLM": "cloud.engine.llm",
    "AsyncLLMEngine": "cloud.engine.async_engine",
    "EngineConfig": "cloud.engine.config",
    "SamplingParams": "cloud.engine.sampling_params",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(name)

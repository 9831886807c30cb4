"""The offline API (vLLM's shape): ``LLM(model_dir).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from cloud.engine.config import EngineConfig
from cloud.engine.llm_engine import LLMEngine
from cloud.engine.outputs import RequestOutput
from cloud.engine.sampling_params import SamplingParams


class LLM:
    """Load a checkpoint (and optionally a draft) and generate for a list of prompts in one batch.

    Args:
        model_dir: a Hugging Face Llama / Qwen2 / Mistral checkpoint directory.
        draft_model_dir: a smaller checkpoint with the same tokenizer, for speculative decoding.
        device: ``cpu`` or ``cuda``.
        **kwargs: any other ``EngineConfig`` field (``kv_cache_bytes``, ``max_num_seqs``, ...).
    """

    def __init__(
        self, model_dir: str | Path, draft_model_dir: str | Path | None = None, device: str = "cpu", **kwargs: Any
    ) -> None:
        self.engine = LLMEngine(
            EngineConfig(
                model_dir=Path(model_dir),
                draft_model_dir=Path(draft_model_dir) if draft_model_dir is not None else None,
                device=device,
                **kwargs,
            )
        )
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """One finished output per prompt, in prompt order. Prompts are text or token id lists."""
        is_single = isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], int))
        items: list[str | list[int]] = [prompts] if is_single else list(prompts)  # type: ignore[list-item,arg-type]
        params = sampling_params if sampling_params is not None else SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(items)
        if len(per_prompt) != len(items):
            raise ValueError("sampling_params must be one object or one per prompt")
        ids = []
        try:
            for prompt, p in zip(items, per_prompt, strict=True):
                rid = f"offline-{next(self._ids)}"
                self.engine.add_request(rid, prompt, p, cache_salt=cache_salt)
                ids.append(rid)
            results: dict[str, RequestOutput] = {}
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return [results[rid] for rid in ids]

"""Causal-LM runtimes over the zoo's edge exports (see ``shared/zoo/export_lm.py`` for the I/O contract).

Each runtime holds one sequence's KV cache: ``reset()``, ``prefill(ids)`` then ``decode(token)`` repeatedly,
each returning the next-token logits ``[V]``. No torch: ONNX Runtime or LiteRT and numpy only.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import numpy as np

from shared.errors import ConfigurationError, ValidationError

EDGE_MODEL_FILE = "edge_model.json"


class CausalLMRuntime(ABC):
    """One sequence at a time; not thread-safe (the agent serialises calls per model)."""

    def __init__(self, model_dir: Path, meta: dict[str, Any]) -> None:
        self.model_dir = model_dir
        self.meta = meta
        self.format: str = meta["format"]
        self.max_context: int = int(meta.get("cache_len") or meta["max_context"])
        self.vocab_size: int | None = int(meta["vocab_size"]) if "vocab_size" in meta else None
        self.num_tokens = 0
        # Whether running several tokens in one ``prefill`` gives each the logits and cache one ``decode`` at a time
        # would (up to float rounding). Not with ONNX Runtime's dynamic INT8 quantization: a call quantizes its
        # activations with one scale for all its tokens, so the same token's numbers depend on its neighbours.
        self.exact_chunks = self.format != "onnx-int8"

    @abstractmethod
    def reset(self) -> None: ...

    @abstractmethod
    def prefill(self, ids: list[int]) -> np.ndarray: ...

    @abstractmethod
    def decode(self, token: int) -> np.ndarray: ...

    def _check_room(self, n: int) -> None:
        if self.num_tokens + n > self.max_context:
            raise ValidationError(
                f"sequence of {self.num_tokens + n} tokens exceeds the model's context of {self.max_context}"
            )

    def greedy(self, ids: list[int], max_new_tokens: int) -> list[int]:
        """Greedy continuation of ``ids`` (a fresh sequence)."""
        self.reset()
        logits = self.prefill(ids)
        out: list[int] = []
        for _ in range(max_new_tokens):
            token = int(np.argmax(logits))
            out.append(token)
            if len(out) == max_new_tokens:
                break
            logits = self.decode(token)
        return out


class OnnxCausalLM(CausalLMRuntime):
    def __init__(self, model_dir: Path, meta: dict[str, Any], num_threads: int = 1) -> None:
        super().__init__(model_dir, meta)
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = num_threads
        opts.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(model_dir / "model.onnx"), opts, providers=["CPUExecutionProvider"])
        self.reset()

    def reset(self) -> None:
        shape = (self.meta["num_layers"], 1, self.meta["num_kv_heads"], 0, self.meta["head_dim"])
        self._keys = np.zeros(shape, np.float32)
        self._values = np.zeros(shape, np.float32)
        self.num_tokens = 0

    def _run(self, ids: list[int]) -> np.ndarray:
        self._check_room(len(ids))
        logits, self._keys, self._values = self.session.run(
            None,
            {"input_ids": np.asarray([ids], np.int64), "past_keys": self._keys, "past_values": self._values},
        )
        self.num_tokens += len(ids)
        last: np.ndarray = logits[0, -1]
        return last

    def prefill(self, ids: list[int]) -> np.ndarray:
        return self._run(ids)

    def decode(self, token: int) -> np.ndarray:
        return self._run([token])


class TfliteCausalLM(CausalLMRuntime):
    def __init__(self, model_dir: Path, meta: dict[str, Any], num_threads: int = 1) -> None:
        super().__init__(model_dir, meta)
        from ai_edge_litert.interpreter import Interpreter, OpResolverType

        # Without the default XNNPACK delegate: same numbers, and no banner on stdout at every load.
        self.interpreter = Interpreter(
            model_path=str(model_dir / "model.tflite"),
            num_threads=num_threads,
            experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES,
        )
        self._prefill = self.interpreter.get_signature_runner("prefill")
        self._decode = self.interpreter.get_signature_runner("decode")
        self.chunk = int(meta["prefill_chunk"])
        self.reset()

    def reset(self) -> None:
        shape = (self.meta["num_layers"], 1, self.meta["num_kv_heads"], self.max_context, self.meta["head_dim"])
        self._k = np.zeros(shape, np.float32)
        self._v = np.zeros(shape, np.float32)
        self.num_tokens = 0

    def prefill(self, ids: list[int]) -> np.ndarray:
        if not ids:
            raise ValidationError("prompt is empty")
        self._check_room(len(ids))
        last = np.empty(0, np.float32)
        start = 0
        while start < len(ids):
            if self.num_tokens + self.chunk > self.max_context:
                # A padded chunk would run past the cache: finish token by token.
                for token in ids[start:]:
                    last = self.decode(token)
                return last
            part = ids[start : start + self.chunk]
            start += len(part)
            # Right-pad to the static chunk; padded slots sit past every real query and are overwritten later.
            padded = np.zeros((1, self.chunk), np.int32)
            padded[0, : len(part)] = part
            pos = np.arange(self.num_tokens, self.num_tokens + self.chunk, dtype=np.int32)
            out = self._prefill(input_ids=padded, input_pos=pos, k_cache=self._k, v_cache=self._v)
            self._k, self._v = out["k_cache"], out["v_cache"]
            self.num_tokens += len(part)
            last = out["logits"][0, len(part) - 1]
        return last

    def decode(self, token: int) -> np.ndarray:
        self._check_room(1)
        out = self._decode(
            input_ids=np.asarray([[token]], np.int32),
            input_pos=np.asarray([self.num_tokens], np.int32),
            k_cache=self._k,
            v_cache=self._v,
        )
        self._k, self._v = out["k_cache"], out["v_cache"]
        self.num_tokens += 1
        logits: np.ndarray = out["logits"][0, 0]
        return logits


def load_causal_lm(model_dir: Path, num_threads: int = 1) -> CausalLMRuntime:
    """The runtime for an edge LM artifact directory, chosen from its ``edge_model.json`` format."""
    try:
        meta = json.loads((model_dir / EDGE_MODEL_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigurationError(f"{model_dir} is not an edge LM artifact: {exc}") from exc
    fmt = meta.get("format")
    if fmt in ("onnx", "onnx-int8"):
        return OnnxCausalLM(model_dir, meta, num_threads)
    if fmt == "tflite":
        return TfliteCausalLM(model_dir, meta, num_threads)
    raise ConfigurationError(f"{model_dir}: unsupported edge LM format {fmt!r}")

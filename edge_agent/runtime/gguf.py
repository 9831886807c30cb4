"""llama.cpp as an edge runtime: the zoo's GGUF export of an LM (``shared/zoo/export_gguf.py``) run in process
through llama-cpp-python (``pip install 'tierline[edge-gguf]'``, compiled on the device).

A GGUF artifact directory holds one file per weight format (``model-q8_0.gguf``, ``model-f32.gguf``) beside the
checkpoint's ``config.json`` and tokenizer files; each file is its own runtime *variant*. The runtime keeps the
same contract as the ONNX and LiteRT ones (:class:`edge_agent.runtime.lm.CausalLMRuntime`): one sequence's KV
cache, ``prefill`` and ``decode`` each returning the next-token logits ``[V]`` as float32, so sampling, the
escalation signals and the structured-output masks work unchanged on top of it.

The caller verifies the artifact's files (signature, sha256) before constructing this: nothing here trusts them.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from edge_agent.runtime.lm import CausalLMRuntime
from shared.errors import ConfigurationError, ValidationError
from shared.native_output import quiet_stderr

GGUF_FILES = {"q8_0": "model-q8_0.gguf", "f32": "model-f32.gguf"}  # as shared.zoo.export_gguf writes them
INSTALL_HINT = "pip install 'tierline[edge-gguf]' (llama-cpp-python, compiled on the device)"


def missing_reason() -> str | None:
    """Why the GGUF runtime cannot run here, or None when it can."""
    try:
        found = importlib.util.find_spec("llama_cpp") is not None
    except (ImportError, ValueError):  # ValueError: blocked with sys.modules["llama_cpp"] = None
        found = False
    return None if found else f"llama-cpp-python is not installed: {INSTALL_HINT}"


def is_gguf_dir(model_dir: Path) -> bool:
    return any((model_dir / name).is_file() for name in GGUF_FILES.values())


def variants(model_dir: Path) -> list[str]:
    """The weight formats present in a GGUF artifact directory, Q8_0 first."""
    return [kind for kind, name in GGUF_FILES.items() if (model_dir / name).is_file()]


def _meta(model_dir: Path, variant: str) -> dict[str, Any]:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigurationError(f"{model_dir} is not a GGUF LM artifact: {exc}") from exc
    return {
        "format": f"gguf-{variant}",
        "max_context": int(config.get("max_position_embeddings", 2048)),
        "vocab_size": int(config["vocab_size"]),
    }


class GgufCausalLM(CausalLMRuntime):
    """One llama.cpp model and context of one sequence (``max_context`` tokens), logits as numpy arrays."""

    def __init__(self, model_dir: Path, variant: str | None = None, num_threads: int = 1) -> None:
        reason = missing_reason()
        if reason is not None:
            raise ConfigurationError(reason)
        present = variants(model_dir)
        variant = variant or (present[0] if present else "q8_0")
        if variant not in GGUF_FILES:
            raise ConfigurationError(f"GGUF variant {variant!r}: choose one of {', '.join(GGUF_FILES)}")
        if variant not in present:
            raise ConfigurationError(f"{model_dir}: no {GGUF_FILES[variant]}")
        super().__init__(model_dir, _meta(model_dir, variant))
        self.variant = variant
        import llama_cpp
        from llama_cpp._internals import LlamaContext, LlamaModel

        self._lib = llama_cpp
        quiet = logging.getLogger("llama-cpp-python")  # where llama-cpp-python's log callback sends llama.cpp's
        if quiet.level == logging.NOTSET:  # (unset: it prints every line) - errors only, unless someone chose
            quiet.setLevel(logging.ERROR)
        model_params = llama_cpp.llama_model_default_params()
        # llama.cpp's AMX kernels (a -march=native build on a CPU with AMX) crash on small Q8_0 matrices: such a
        # build runs without its extra buffer types, as bench/llamacpp.py does.
        model_params.use_extra_bufts = b"AMX_INT8 = 1" not in llama_cpp.llama_print_system_info()
        with quiet_stderr():
            path = str(model_dir / GGUF_FILES[variant])
            self._model = LlamaModel(path_model=path, params=model_params, verbose=False)
        n_vocab = int(self._model.n_vocab())
        if self.vocab_size is not None and n_vocab != self.vocab_size:
            raise ConfigurationError(f"{model_dir}: the GGUF has {n_vocab} tokens, config.json {self.vocab_size}")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = self.max_context
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = num_threads
        params.no_perf = True
        # Flash attention off ("auto" turns it on for the CPU): llama.cpp casts K and V to float16 for it, even
        # from an f32 cache (llama-graph.cpp), and its CPU kernel sums softmax * V over the whole context in a
        # float16 accumulator (ggml-cpu ops.cpp, VKQ16), an error that grows with the context. An f32 file left
        # transformers' greedy output at token 26 of a 2,000-token prompt with it on, and was exact with it off.
        # An f32 file also gets an f32 KV cache, so it computes what the checkpoint does; Q8_0 keeps float16.
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        if variant == "f32":
            params.type_k = params.type_v = llama_cpp.GGML_TYPE_F32
        with quiet_stderr():
            self._ctx = LlamaContext(model=self._model, params=params, verbose=False)
        self._batch = llama_cpp.llama_batch_init(self.max_context, 0, 1)
        for i in range(self.max_context):  # one sequence: every slot of the batch belongs to sequence 0, for good
            self._batch.n_seq_id[i] = 1
            self._batch.seq_id[i][0] = 0
        self._n_vocab = n_vocab
        # The per-token path, bound once: a decode step costs tens of microseconds, Python's share of it counts.
        self._c = self._ctx.ctx
        self._decode_fn = llama_cpp.llama_decode
        self._logits_fn = llama_cpp.llama_get_logits
        self._token, self._pos, self._want = self._batch.token, self._batch.pos, self._batch.logits
        self._logits_at: int | None = None  # the address the view below reads; llama.cpp may move its buffer
        self._logits_view = np.empty(0, np.float32)
        self.reset()

    def close(self) -> None:
        if getattr(self, "_batch", None) is not None:
            with quiet_stderr():  # (llama.cpp reports the freed buffers on file descriptor 2)
                self._lib.llama_batch_free(self._batch)
                self._batch = None
                self._ctx.close()
                self._model.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def reset(self) -> None:
        lib = self._lib
        lib.llama_memory_clear(lib.llama_get_memory(self._ctx.ctx), True)
        self.num_tokens = 0

    def _run(self, ids: list[int]) -> np.ndarray:
        self._check_room(len(ids))
        token, pos, want, start, last = self._token, self._pos, self._want, self.num_tokens, len(ids) - 1
        for i, t in enumerate(ids):
            token[i] = t
            pos[i] = start + i
            want[i] = i == last
        self._batch.n_tokens = len(ids)
        status = self._decode_fn(self._c, self._batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status}")
        self.num_tokens += len(ids)
        return self._logits()

    def _logits(self) -> np.ndarray:
        """The one output row's logits (only the last token of a batch asks for them), as a fresh float32 copy:
        llama.cpp reuses its buffer at the next decode, and callers keep the logits past it."""
        ptr = self._logits_fn(self._c)
        at = ctypes.cast(ptr, ctypes.c_void_p).value
        if at != self._logits_at:
            self._logits_view = np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))
            self._logits_at = at
        return self._logits_view.copy()

    def prefill(self, ids: list[int]) -> np.ndarray:
        if not ids:
            raise ValidationError("prompt is empty")
        return self._run(ids)

    def decode(self, token: int) -> np.ndarray:
        return self._run([token])

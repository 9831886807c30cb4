"""Causal-LM runtimes over the zoo's edge exports (see ``shared/zoo/export_lm.py`` for the I/O contract).

Each runtime holds one sequence's KV cache: ``reset()``, ``prefill(ids)`` then ``decode(token)`` repeatedly,
each returning the next-token logits ``[V]``. No torch: ONNX Runtime or LiteRT and numpy only.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
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


TFLITE_IO_V1, TFLITE_IO_V2 = "static-kv-cache/v1", "static-kv-cache/v2"
XNNPACK_BANNER = b"Created TensorFlow Lite XNNPACK delegate for CPU."
_STDERR_REDIRECT = threading.Lock()


@contextmanager
def _native_stderr_without(banner: bytes) -> Iterator[None]:
    """Route file descriptor 2 to a temporary file for the duration, then write back everything but ``banner``.

    LiteRT's C++ logger prints the XNNPACK delegate's INFO banner straight to fd 2 (no environment switch or
    Python logger controls it). Other threads' output during the window is delayed, never lost. Serialised: two
    overlapping redirects would restore each other's temporary file as fd 2."""
    with _STDERR_REDIRECT, tempfile.TemporaryFile() as captured:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().splitlines(keepends=True) if banner not in line]
            if kept:
                os.write(2, b"".join(kept))


class _Signature:
    """One signature of a LiteRT interpreter, driven through the interpreter wrapper by subgraph index.

    The public ``SignatureRunner`` resizes, re-allocates and copies every input and output on every call, and
    ``Interpreter.tensor()`` reaches the primary subgraph only; this holds numpy views of the signature's input
    buffers (written in place, no copy) and invokes the subgraph directly. Valid while nothing re-allocates the
    interpreter's tensors: shapes are static and nothing here resizes them."""

    def __init__(self, interpreter: Any, key: str) -> None:
        self._wrapper = interpreter._interpreter  # the pybind InterpreterWrapper (ai-edge-litert pinned)
        runner = interpreter.get_signature_runner(key)
        self.subgraph: int = self._wrapper.GetSubgraphIndexFromSignature(key)
        self.inputs: dict[str, int] = dict(runner._inputs)
        self.outputs: dict[str, int] = dict(runner._outputs)
        self._wrapper.AllocateTensors(self.subgraph)

    def view(self, name: str) -> np.ndarray:
        """A writable numpy view of input ``name``'s buffer inside the interpreter."""
        array: np.ndarray = self._wrapper.tensor(self._wrapper, self.inputs[name], self.subgraph)
        return array

    def invoke(self) -> None:
        self._wrapper.Invoke(self.subgraph)

    def output(self, name: str) -> np.ndarray:
        out: np.ndarray = self._wrapper.GetTensor(self.outputs[name], self.subgraph)
        return out


class TfliteCausalLM(CausalLMRuntime):
    """LiteRT with the XNNPACK delegate over the ``static-kv-cache/v2`` export: the KV cache lives in the
    interpreter's input buffers (one per signature) and each call writes only its new tokens' keys/values."""

    def __init__(self, model_dir: Path, meta: dict[str, Any], num_threads: int = 1) -> None:
        super().__init__(model_dir, meta)
        from ai_edge_litert.interpreter import Interpreter

        # The default op resolver applies the XNNPACK delegate when tensors are first allocated.
        self.interpreter = Interpreter(model_path=str(model_dir / "model.tflite"), num_threads=num_threads)
        with _native_stderr_without(XNNPACK_BANNER):
            self.interpreter.allocate_tensors()
            self._prefill = _Signature(self.interpreter, "prefill")
            self._decode = _Signature(self.interpreter, "decode")
        self.chunk = int(meta["prefill_chunk"])
        sigs = (self._prefill, self._decode)
        self._ids = [s.view("input_ids") for s in sigs]
        self._pos = [s.view("input_pos") for s in sigs]
        self._k = [s.view("k_cache") for s in sigs]
        self._v = [s.view("v_cache") for s in sigs]
        for cache in (*self._k, *self._v):
            cache.fill(0.0)  # the arena is uninitialised; masked slots must still be finite (0 * NaN is NaN)
        self._prefill_synced = 0  # how many cache slots of the prefill signature's copy are current
        self.reset()

    def reset(self) -> None:
        # Slots at or past the position of a call's first token are masked out, so old ones need no clearing.
        self.num_tokens = 0
        self._prefill_synced = 0

    def _store(self, sig: _Signature, copies: list[int], count: int) -> None:
        """Write the first ``count`` new tokens' keys/values of ``sig``'s last call into the caches ``copies``."""
        k, v = sig.output("k_new")[:, :, :, :count], sig.output("v_new")[:, :, :, :count]
        at = slice(self.num_tokens, self.num_tokens + count)
        for i in copies:
            self._k[i][:, :, :, at] = k
            self._v[i][:, :, :, at] = v

    def prefill(self, ids: list[int]) -> np.ndarray:
        if not ids:
            raise ValidationError("prompt is empty")
        self._check_room(len(ids))
        if self._prefill_synced < self.num_tokens:  # decoded since the last prefill: bring its copy up to date
            at = slice(self._prefill_synced, self.num_tokens)
            self._k[0][:, :, :, at] = self._k[1][:, :, :, at]
            self._v[0][:, :, :, at] = self._v[1][:, :, :, at]
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
            # Right-pad to the static chunk; only the real tokens' keys/values are stored.
            self._ids[0][0, : len(part)] = part
            self._ids[0][0, len(part) :] = 0
            self._pos[0][:] = np.arange(self.num_tokens, self.num_tokens + self.chunk, dtype=np.int32)
            self._prefill.invoke()
            self._store(self._prefill, [0, 1], len(part))
            self.num_tokens += len(part)
            self._prefill_synced = self.num_tokens
            last = self._prefill.output("logits")[0, len(part) - 1]
        return last

    def decode(self, token: int) -> np.ndarray:
        self._check_room(1)
        self._ids[1][0, 0] = token
        self._pos[1][0] = self.num_tokens
        self._decode.invoke()
        self._store(self._decode, [1], 1)
        self.num_tokens += 1
        logits: np.ndarray = self._decode.output("logits")[0, 0]
        return logits


class TfliteCopyingCausalLM(CausalLMRuntime):
    """The ``static-kv-cache/v1`` export (the whole cache in and out of every call), for artifacts derived before
    v2: correct, an order of magnitude slower. Re-derive the artifact to get :class:`TfliteCausalLM`."""

    def __init__(self, model_dir: Path, meta: dict[str, Any], num_threads: int = 1) -> None:
        super().__init__(model_dir, meta)
        from ai_edge_litert.interpreter import Interpreter

        self.interpreter = Interpreter(model_path=str(model_dir / "model.tflite"), num_threads=num_threads)
        with _native_stderr_without(XNNPACK_BANNER):
            self.interpreter.allocate_tensors()
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
                for token in ids[start:]:
                    last = self.decode(token)
                return last
            part = ids[start : start + self.chunk]
            start += len(part)
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
        io = meta.get("io", TFLITE_IO_V1)
        if io == TFLITE_IO_V2:
            return TfliteCausalLM(model_dir, meta, num_threads)
        if io == TFLITE_IO_V1:
            return TfliteCopyingCausalLM(model_dir, meta, num_threads)
        raise ConfigurationError(f"{model_dir}: unsupported TFLite I/O {io!r}")
    raise ConfigurationError(f"{model_dir}: unsupported edge LM format {fmt!r}")

"""llama.cpp, the peer users pick on CPUs and devices, run on the zoo's GGUF exports of the same weights.

In process through llama-cpp-python's bindings (``tierline[peers]``), greedy, on token-id prompts:
:class:`LlamaCppBatch` decodes any number of requests in one llama.cpp context the way ``llama-server`` does
(one slot per sequence in a unified KV cache; every step feeds each running slot's last token, then fills the
rest of the batch with waiting prompts), so batch 1 and 64 concurrent are the same code. And
:func:`llamacpp_server`: llama-cpp-python's OpenAI-compatible server (``python -m llama_cpp.server``) on a free
port, for the gateway tests.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import served
from shared.errors import ConfigurationError
from shared.native_output import quiet_stderr
from shared.zoo.export_gguf import GGUF_FILES
from shared.zoo.registry import ZooLayout

INSTALL_HINT = "make peers (or pip install 'tierline[peers]': llama-cpp-python, compiled from source)"
SERVER_START_TIMEOUT_S = 120.0


def missing_reason() -> str | None:
    """Why llama.cpp cannot run here, or None when it can."""
    if importlib.util.find_spec("llama_cpp") is None:
        return f"llama-cpp-python is not installed: {INSTALL_HINT}"
    return None


def has_amx() -> bool:
    """Whether this llama.cpp build has its AMX kernels."""
    import llama_cpp

    return b"AMX_INT8 = 1" in llama_cpp.llama_print_system_info()


def gguf_path(zoo_root: Path, lm: str, kind: str) -> Path:
    """``<zoo>/artifacts/<lm>-gguf/model-<kind>.gguf`` of a built zoo preset."""
    path = ZooLayout(zoo_root).artifact_dir(f"{lm}-gguf") / GGUF_FILES[kind]
    if not path.is_file():
        raise ConfigurationError(f"{path}: no GGUF export; rebuild the zoo (`tierline zoo build --force`)")
    return path


@dataclass(slots=True)
class _Slot:
    index: int
    prompt: list[int]
    num_tokens: int
    fed: int = 0  # prompt tokens already in the cache
    out: list[int] = field(default_factory=list)


class LlamaCppBatch:
    """One llama.cpp model and context with ``slots`` sequences, decoding greedily (argmax of the logits, as
    ``temperature=0``), never stopping early at an end-of-text token (``ignore_eos``, like the engine bench)."""

    def __init__(self, model_path: Path, slots: int, max_len: int, threads: int, batch_tokens: int = 2048) -> None:
        import llama_cpp
        from llama_cpp._internals import LlamaContext, LlamaModel

        self._lib = llama_cpp
        self.slots = slots
        self.batch_tokens = max(batch_tokens, slots)
        self.max_len = max_len
        model_params = llama_cpp.llama_model_default_params()
        # A build with llama.cpp's AMX kernels (``-march=native`` on a CPU with AMX) segfaults in them on the zoo's
        # small Q8_0 matrices: such a build runs without its extra buffer types (AMX, repacked weights).
        model_params.use_extra_bufts = not has_amx()
        with quiet_stderr():
            self._model = LlamaModel(path_model=str(model_path), params=model_params, verbose=False)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = slots * max_len
        params.n_batch = params.n_ubatch = self.batch_tokens
        params.n_seq_max = slots
        params.kv_unified = False  # a KV stream per slot, as llama-server: attention spans its own sequence only
        params.n_threads = params.n_threads_batch = threads
        params.no_perf = True
        with quiet_stderr():
            self._ctx = LlamaContext(model=self._model, params=params, verbose=False)
        self._batch = llama_cpp.llama_batch_init(self.batch_tokens, 0, 1)
        self.n_vocab = self._model.n_vocab()

    def close(self) -> None:
        with quiet_stderr():
            self._lib.llama_batch_free(self._batch)
            self._ctx.close()
            self._model.close()

    def _add(self, n: int, token: int, pos: int, seq: int, logits: bool) -> None:
        b = self._batch
        b.token[n] = token
        b.pos[n] = pos
        b.n_seq_id[n] = 1
        b.seq_id[n][0] = seq
        b.logits[n] = logits

    def prompt_logits(self, prompt: list[int]) -> np.ndarray:
        """The logits at every position of ``prompt`` (one forward, sequence 0): float32 [T, vocab]."""
        lib, ctx = self._lib, self._ctx.ctx
        if not 0 < len(prompt) <= min(self.max_len, self.batch_tokens):
            raise ValueError(f"a {len(prompt)}-token prompt does not fit one batch of {self.batch_tokens}")
        lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
        for i, token in enumerate(prompt):
            self._add(i, token, i, 0, True)
        self._batch.n_tokens = len(prompt)
        if lib.llama_decode(ctx, self._batch) != 0:
            raise RuntimeError("llama_decode failed")
        rows = [
            np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, i), shape=(self.n_vocab,)) for i in range(len(prompt))
        ]
        return np.stack(rows).astype(np.float32)

    def generate(self, work: list[tuple[list[int], int]]) -> list[list[int]]:
        """Greedy continuations of every ``(prompt ids, new tokens)``, at most ``slots`` at a time."""
        lib, ctx = self._lib, self._ctx.ctx
        lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
        for prompt, n in work:
            if len(prompt) + n > self.max_len or not prompt or n < 1:
                raise ValueError(f"a {len(prompt)}-token prompt and {n} new tokens do not fit {self.max_len}")
        waiting = list(enumerate(work))
        free = list(range(self.slots))
        running: dict[int, tuple[int, _Slot]] = {}  # slot -> (request index, state)
        results: dict[int, list[int]] = {}
        while waiting or running:
            while waiting and free:
                i, (prompt, n) = waiting.pop(0)
                slot = free.pop(0)
                running[slot] = (i, _Slot(slot, prompt, n))
            n_tok = 0
            rows: list[tuple[int, _Slot]] = []  # (batch row with logits, slot)
            for _, s in running.values():  # decoding slots first: one token each
                if s.fed == len(s.prompt):
                    self._add(n_tok, s.out[-1], len(s.prompt) + len(s.out) - 1, s.index, True)
                    rows.append((n_tok, s))
                    n_tok += 1
            for _, s in running.values():  # then prompt chunks while the batch has room
                if s.fed < len(s.prompt) and n_tok < self.batch_tokens:
                    take = min(len(s.prompt) - s.fed, self.batch_tokens - n_tok)
                    for j in range(take):
                        last = s.fed + j == len(s.prompt) - 1
                        self._add(n_tok, s.prompt[s.fed + j], s.fed + j, s.index, last)
                        if last:
                            rows.append((n_tok, s))
                        n_tok += 1
                    s.fed += take
            self._batch.n_tokens = n_tok
            if lib.llama_decode(ctx, self._batch) != 0:
                raise RuntimeError("llama_decode failed (KV cache full?)")
            for row, s in rows:
                if s.fed < len(s.prompt):
                    continue
                logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, row), shape=(self.n_vocab,))
                s.out.append(int(logits.argmax()))
            for slot, (i, s) in list(running.items()):
                if len(s.out) >= s.num_tokens:
                    results[i] = s.out
                    del running[slot]
                    lib.llama_memory_seq_rm(lib.llama_get_memory(ctx), slot, -1, -1)
                    free.append(slot)
        return [results[i] for i in range(len(work))]


def timed_generate(peer: LlamaCppBatch, work: list[tuple[list[int], int]], one_at_a_time: bool) -> dict[str, Any]:
    """Greedy outputs and tokens/s of ``work``: all at once (the context's slots), or one request after another."""
    started = time.perf_counter()
    outputs = [peer.generate([w])[0] for w in work] if one_at_a_time else peer.generate(work)
    seconds = time.perf_counter() - started
    tokens = sum(len(o) for o in outputs)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "outputs": outputs}


@contextlib.contextmanager
def llamacpp_server(
    model_path: Path,
    port: int,
    *,
    alias: str,
    n_ctx: int,
    threads: int = 1,
    api_key: str | None = None,
    log: Path | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """``python -m llama_cpp.server --model X.gguf --host 127.0.0.1 --port P`` until ``/v1/models`` answers; the
    key (when given) goes through the environment (``API_KEY``), never the command line. SIGTERM after."""
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(model_path), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--model_alias", alias, "--n_ctx", str(n_ctx), "--n_threads", str(threads)]
    cmd += ["--n_threads_batch", str(threads), "--verbose", "False"]
    env = {k: v for k, v in os.environ.items() if k != "API_KEY"}
    if api_key:
        env["API_KEY"] = api_key
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    ready = f"http://127.0.0.1:{port}/v1/models"
    what = f"llama_cpp.server on port {port}"
    try:
        with served(cmd, env, ready, what, headers=headers, log=log, start_timeout_s=SERVER_START_TIMEOUT_S) as proc:
            yield proc
    except RuntimeError as exc:
        raise ConfigurationError(str(exc)) from exc

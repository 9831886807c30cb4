"""Check an edge export against the source checkpoint it came from.

:func:`make_reference` runs the source checkpoint with transformers (fp32, eager attention, greedy) on a fixed
set of prompts and returns its answers (:class:`shared.reference_answers.ReferenceAnswers`). :func:`check_export`
runs an export's own runtime on the same prompts, teacher-forced: after the prompt and each prefix of the
reference's greedy tokens it asks for the export's most likely next token, through the runtime's KV cache (one
prefill, then one decode per token, as a device runs it).

A free-running greedy generation of the export leaves the reference exactly where the teacher-forced choices
first differ (up to that position both runs have fed the same tokens), so the first divergence is read off the
same pass instead of generating a second time.

Runners for each edge format live here, not in ``edge_agent``: the control plane imports ``shared`` only.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from shared.native_output import quiet_stderr
from shared.reference_answers import ReferenceAnswers, ReferencePrompt, first_divergence, greedy_agreement

NUM_GREEDY = 16
LONG_PROMPT = "long"
# Short prompts in the languages the zoo's LMs know (Python source) and plain text.
SHORT_PROMPTS = {
    "code-def": "def fibonacci(n):\n    ",
    "code-import": "import json\nfrom pathlib import Path\n\n\ndef load(path):\n",
    "code-class": "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "text": "The quick brown fox jumps over the lazy dog. The",
}
NUM_RANDOM_SHORT = 3
RANDOM_SHORT_LEN = 24


class StepRunner(Protocol):
    """One sequence through an export's runtime: each call returns the next-token logits ``[V]``."""

    max_tokens: int

    def reset(self) -> None: ...

    def prefill(self, ids: list[int]) -> np.ndarray: ...

    def decode(self, token: int) -> np.ndarray: ...


@dataclass(frozen=True, slots=True)
class ExportCheck:
    """How an export answered the reference prompts: teacher-forced agreement per prompt and over all positions
    (pooled), and where its free-running greedy output first leaves the reference (None: never)."""

    agreement: dict[str, float]
    overall: float
    long: float | None
    first_divergence: dict[str, int | None]
    skipped: list[str]

    @property
    def is_exact(self) -> bool:
        return all(a == 1.0 for a in self.agreement.values())

    def worst(self) -> tuple[str, float]:
        name = min(self.agreement, key=lambda n: self.agreement[n])
        return name, self.agreement[name]

    def summary(self) -> dict[str, Any]:
        """The numbers for an artifact's manifest metadata."""
        return {
            "agreement": {
                "overall": round(self.overall, 4),
                "long": None if self.long is None else round(self.long, 4),
                "per_prompt": {k: round(v, 4) for k, v in self.agreement.items()},
            },
            "first_divergence": self.first_divergence,
            **({"skipped_prompts": self.skipped} if self.skipped else {}),
        }


def verdict(check: ExportCheck, bound: float | None) -> tuple[str, str | None]:
    """(``ready`` | ``rejected``, the reason when rejected). ``bound`` None: an fp32 format, which must give the
    reference's greedy tokens on every prompt; else the least overall agreement of a quantized format."""
    if not check.agreement:
        return "rejected", "no reference prompt fits the export's context"
    name, worst = check.worst()
    if bound is None:
        if check.is_exact:
            return "ready", None
        at = check.first_divergence[name]
        return "rejected", (
            f"not the source's greedy output: prompt {name!r} agrees on {worst:.1%} of next tokens and diverges at "
            f"token {at} (overall {check.overall:.1%}; an fp32 export must agree on 100%)"
        )
    if check.overall >= bound:
        return "ready", None
    return "rejected", (
        f"agrees with the source on {check.overall:.1%} of next tokens, below the bound {bound:.1%} "
        f"(worst prompt {name!r}: {worst:.1%})"
    )


def check_export(runner: StepRunner, reference: ReferenceAnswers) -> ExportCheck:
    """Teacher-forced next-token choices of ``runner`` on every reference prompt that fits its context."""
    agreement: dict[str, float] = {}
    divergence: dict[str, int | None] = {}
    skipped: list[str] = []
    same = total = 0
    for prompt in reference.prompts:
        if len(prompt.token_ids) + len(prompt.greedy) > runner.max_tokens:
            skipped.append(prompt.name)
            continue
        predicted = _teacher_forced(runner, prompt)
        agreement[prompt.name] = greedy_agreement(prompt.greedy, predicted)
        divergence[prompt.name] = first_divergence(prompt.greedy, predicted)
        same += sum(1 for a, b in zip(prompt.greedy, predicted, strict=False) if a == b)
        total += len(prompt.greedy)
    long = [v for k, v in agreement.items() if k.startswith(LONG_PROMPT)]
    return ExportCheck(agreement, same / total if total else 0.0, min(long) if long else None, divergence, skipped)


def _teacher_forced(runner: StepRunner, prompt: ReferencePrompt) -> list[int]:
    runner.reset()
    logits = runner.prefill(prompt.token_ids)
    predicted = []
    for i, token in enumerate(prompt.greedy):
        predicted.append(int(np.argmax(logits)))
        if i + 1 < len(prompt.greedy):
            logits = runner.decode(token)
    return predicted


# --- the source's answers -------------------------------------------------------------------------------------


def _config(ckpt: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((ckpt / "config.json").read_text())
    return config


def max_context(config: dict[str, Any]) -> int:
    """The context length a checkpoint declares (GPT-2 calls it ``n_positions``)."""
    return int(config.get("max_position_embeddings") or config.get("n_positions") or 2048)


def _eos_ids(ckpt: Path, config: dict[str, Any]) -> set[int]:
    found: set[int] = set()
    sources = [config]
    if (ckpt / "generation_config.json").is_file():
        sources.append(json.loads((ckpt / "generation_config.json").read_text()))
    for source in sources:
        value = source.get("eos_token_id")
        found.update(v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int))
    return found


def reference_prompts(ckpt: Path, max_tokens: int, num_greedy: int = NUM_GREEDY) -> list[tuple[str, list[int]]]:
    """(name, token ids): the short prompts and one ``long`` prompt filling the context up to ``max_tokens``
    (and the model's own context), less room for ``num_greedy`` answer tokens. Tokenized with the checkpoint's
    tokenizer, or seeded random ids when it has none."""
    config = _config(ckpt)
    long_len = min(max_context(config), max_tokens) - num_greedy
    if long_len < 1:
        raise ValueError(f"a context of {min(max_context(config), max_tokens)} leaves no room for a prompt")
    vocab = int(config["vocab_size"])
    if not (ckpt / "tokenizer.json").is_file():
        rng = np.random.default_rng(0)
        shorts = [(f"random-{i}", rng.integers(0, vocab, RANDOM_SHORT_LEN).tolist()) for i in range(NUM_RANDOM_SHORT)]
        return [*shorts, (LONG_PROMPT, rng.integers(0, vocab, long_len).tolist())]
    from tokenizers import Tokenizer

    from shared.zoo.corpus import held_out_files

    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    encode = _encoder(ckpt, tok)
    prompts = [(name, encode(text)[:long_len]) for name, text in SHORT_PROMPTS.items()]
    ids: list[int] = encode("")  # the BOS the tokenizer adds, if any, once
    for f in held_out_files():
        ids.extend(tok.encode(f.text, add_special_tokens=False).ids)
        if len(ids) >= long_len:
            break
    if len(ids) < long_len:  # a tiny tokenizer's text is long enough; pad with seeded ids if not
        ids.extend(np.random.default_rng(0).integers(0, vocab, long_len - len(ids)).tolist())
    return [*prompts, (LONG_PROMPT, [i for i in ids[:long_len] if 0 <= i < vocab])]


def _encoder(ckpt: Path, tok: Any) -> Any:
    tok_config: dict[str, Any] = {}
    if (ckpt / "tokenizer_config.json").is_file():
        tok_config = json.loads((ckpt / "tokenizer_config.json").read_text())
    bos = tok_config.get("bos_token")
    bos_id = tok.token_to_id(bos) if isinstance(bos, str) and tok_config.get("add_bos_token") else None

    def encode(text: str) -> list[int]:
        ids: list[int] = list(tok.encode(text).ids) if text else []
        if bos_id is not None and (not ids or ids[0] != bos_id):
            ids.insert(0, bos_id)
        return ids

    return encode


def make_reference(
    ckpt: Path, source: dict[str, str], max_tokens: int = 2048, num_greedy: int = NUM_GREEDY
) -> ReferenceAnswers:
    """The checkpoint's greedy answers (transformers, fp32, eager attention) to :func:`reference_prompts`."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    config = _config(ckpt)
    eos = _eos_ids(ckpt, config)
    with _quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()
    prompts = []
    with torch.inference_mode():
        for name, ids in reference_prompts(ckpt, max_tokens, num_greedy):
            if not ids:
                continue
            out = model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
            greedy: list[int] = []
            while True:
                token = int(out.logits[0, -1].argmax())
                greedy.append(token)
                if token in eos or len(greedy) == num_greedy:
                    break
                out = model(torch.tensor([[token]]), cache=out.cache, use_cache=True)
            prompts.append(ReferencePrompt(name, ids, greedy))
    return ReferenceAnswers(
        source=dict(source),
        produced_by=f"transformers {transformers.__version__} fp32 eager greedy",
        max_context=max_context(config),
        prompts=prompts,
    )


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers reports load details (unused keys of a checkpoint it still loads) as warnings."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# --- runners ----------------------------------------------------------------------------------------------------


class OnnxRunner:
    """The ``growing-kv-cache/v1`` ONNX export (fp32 or INT8) under ONNX Runtime."""

    def __init__(self, model_path: Path, meta: dict[str, Any]) -> None:
        import onnxruntime as ort

        self.session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
        self.meta = meta
        self.max_tokens = int(meta["max_context"])
        self.reset()

    def reset(self) -> None:
        # past_keys / past_values: [L, B, KVH, P, D], empty at the start
        shape = (self.meta["num_layers"], 1, self.meta["num_kv_heads"], 0, self.meta["head_dim"])
        self._keys = self._values = np.zeros(shape, np.float32)

    def _run(self, ids: list[int]) -> np.ndarray:
        logits, self._keys, self._values = self.session.run(
            None, {"input_ids": np.asarray([ids], np.int64), "past_keys": self._keys, "past_values": self._values}
        )
        last: np.ndarray = logits[0, -1]
        return last

    def prefill(self, ids: list[int]) -> np.ndarray:
        return self._run(ids)

    def decode(self, token: int) -> np.ndarray:
        return self._run([token])


class TfliteRunner:
    """The ``static-kv-cache/v2`` LiteRT export: the cache is kept here and each call's ``k_new``/``v_new``
    written into it at the call's positions (prefill in right-padded chunks)."""

    def __init__(self, model_path: Path, io: dict[str, Any], meta: dict[str, Any]) -> None:
        from ai_edge_litert.interpreter import Interpreter

        interpreter = Interpreter(model_path=str(model_path))
        self._prefill = interpreter.get_signature_runner("prefill")
        self._decode = interpreter.get_signature_runner("decode")
        self.chunk = int(io["prefill_chunk"])
        self.max_tokens = int(io["cache_len"])
        self._shape = (meta["num_layers"], 1, meta["num_kv_heads"], self.max_tokens, meta["head_dim"])
        self.reset()

    def reset(self) -> None:
        self._k = np.zeros(self._shape, np.float32)
        self._v = np.zeros(self._shape, np.float32)
        self._num = 0

    def _call(self, runner: Any, ids: list[int], width: int) -> np.ndarray:
        padded = np.zeros((1, width), np.int32)
        padded[0, : len(ids)] = ids
        pos = np.arange(self._num, self._num + width, dtype=np.int32)
        out = runner(input_ids=padded, input_pos=pos, k_cache=self._k, v_cache=self._v)
        at = slice(self._num, self._num + len(ids))
        self._k[:, :, :, at] = out["k_new"][:, :, :, : len(ids)]
        self._v[:, :, :, at] = out["v_new"][:, :, :, : len(ids)]
        self._num += len(ids)
        last: np.ndarray = out["logits"][0, len(ids) - 1]
        return last

    def prefill(self, ids: list[int]) -> np.ndarray:
        logits = np.empty(0, np.float32)
        for start in range(0, len(ids), self.chunk):
            part = ids[start : start + self.chunk]
            if self._num + self.chunk > self.max_tokens:  # a padded chunk would run past the cache
                for token in part:
                    logits = self.decode(token)
            else:
                logits = self._call(self._prefill, part, self.chunk)
        return logits

    def decode(self, token: int) -> np.ndarray:
        return self._call(self._decode, [token], 1)


class GgufRunner:
    """A GGUF file under llama.cpp (llama-cpp-python's low-level API), set up as the device's runtime sets it up
    (``edge_agent/runtime/gguf.py``): one sequence, flash attention off, an f32 KV cache for an f32 file."""

    def __init__(self, model_path: Path, n_ctx: int, *, f32_cache: bool) -> None:
        import llama_cpp
        from llama_cpp._internals import LlamaBatch, LlamaContext, LlamaModel

        self._lib = llama_cpp
        quiet = logging.getLogger("llama-cpp-python")  # its log callback prints every llama.cpp line when unset
        if quiet.level == logging.NOTSET:
            quiet.setLevel(logging.ERROR)
        model_params = llama_cpp.llama_model_default_params()
        # As the device runtime: a -march=native build on a CPU with AMX crashes on small Q8_0 matrices with them.
        model_params.use_extra_bufts = b"AMX_INT8 = 1" not in llama_cpp.llama_print_system_info()
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = n_ctx
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = 1
        params.no_perf = True
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        if f32_cache:
            params.type_k = params.type_v = llama_cpp.GGML_TYPE_F32
        with quiet_stderr():
            self._model = LlamaModel(path_model=str(model_path), params=model_params, verbose=False)
            self._ctx = LlamaContext(model=self._model, params=params, verbose=False)
        self._batch = LlamaBatch(n_tokens=n_ctx, embd=0, n_seq_max=1, verbose=False)
        self._n_vocab = int(self._model.n_vocab())
        self.max_tokens = n_ctx
        self._num = 0

    def close(self) -> None:
        with quiet_stderr():
            self._batch.close()
            self._ctx.close()
            self._model.close()

    def reset(self) -> None:
        self._lib.llama_memory_clear(self._lib.llama_get_memory(self._ctx.ctx), True)
        self._num = 0

    def _run(self, ids: list[int]) -> np.ndarray:
        self._batch.set_batch(ids, n_past=self._num, logits_all=False)
        self._ctx.decode(self._batch)
        self._num += len(ids)
        ptr = self._lib.llama_get_logits_ith(self._ctx.ctx, len(ids) - 1)
        return np.ctypeslib.as_array(ptr, shape=(self._n_vocab,)).copy()

    def prefill(self, ids: list[int]) -> np.ndarray:
        return self._run(ids)

    def decode(self, token: int) -> np.ndarray:
        return self._run([token])

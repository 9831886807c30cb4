"""The runtime guard: a model is served by the fastest runtime this device has for it that still gives the
reference's answers.

A device may hold one model in several runtimes and formats: ONNX Runtime fp32 (the reference) and INT8,
LiteRT (TFLite), llama.cpp on GGUF Q8_0 and f32. Which is fastest depends on the host (ONNX Runtime's dynamic
INT8 kernels lose to fp32 on CPUs without VNNI; llama.cpp's whole token can cost less than ONNX Runtime's
per-call overhead on a small model), so at load the agent:

1. loads every candidate (each artifact's files verified again just before, like any load);
2. checks each against the reference answers by teacher forcing: its *agreement* is the share of positions
   where its most likely next token is the reference's, so 1.0 means the same greedy output on those prompts.
   The reference is the source checkpoint's own greedy answers when an artifact carries them
   (``reference.json``, :mod:`shared.reference_answers`: fixed prompts, one of them near the context length);
   then every candidate, the fp32 ONNX export included, is checked against them. An artifact derived before
   them has none: then the fp32 ONNX export's greedy continuation of a dozen fixed code prompts is the
   reference (it qualifies by definition), and the report says so (``reference: "onnx-fp32 (no
   reference.json)"``);
3. times every candidate on the same prefill + decode, alternating candidates over rounds (best of them);
4. serves the fastest whose agreement meets the bound (``min_agreement``, 1.0 by default: no change in outputs
   at greedy on the check prompts). None qualifies: nothing is served, and the report says why per candidate.

The choice and every candidate's numbers are shown in ``/v1/models`` and reported to the cloud in the sync's
``runtime["serving"]``. A candidate the device cannot run (its runtime is not installed, its artifact was
refused, it failed to load) is listed with ``eligible: false`` and the reason.

The guard only needs :class:`edge_agent.runtime.lm.CausalLMRuntime` (``reset``/``prefill``/``decode``) from a
runtime, so a new runtime is a new :class:`Candidate`, nothing more.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edge_agent.runtime.lm import CausalLMRuntime
from shared.reference_answers import REFERENCE_FILE, ReferenceAnswers

logger = logging.getLogger(__name__)

REFERENCE = "onnx"
FP32_REFERENCE = f"onnx-fp32 (no {REFERENCE_FILE})"  # how the report names the fallback reference
DEFAULT_MIN_AGREEMENT = 1.0
# Timing: the same work as the INT8 guard's (a 32-token prefill and 16 decode steps), per token.
PROMPT_TOKENS = 32
NEW_TOKENS = 16
ROUNDS = 9  # best of: on a busy device a burst can slow one candidate for several rounds
# Agreement: the reference's greedy continuation of these prompts, teacher-forced into each candidate.
# Short code openings of several kinds: a quantized format that flips a near-tie usually does so on one of them
# (on the tiny zoo, GGUF Q8_0 differs from fp32 on "import os\n" and on none of 21 other prompts).
CHECK_PROMPTS = (
    "def main():\n",
    "import os\n",
    "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path):\n",
    "    for i in range(len(items)):\n        if items[i] is None:\n",
    '# Copyright the authors. Licensed under the Apache License.\n"""Utilities for parsing',
    "from __future__ import annotations\n\nfrom typing import Any\n\n\ndef load(",
    'class Error(Exception):\n    """',
    '    return {"name": self.name, "value": ',
    'if __name__ == "__main__":\n    ',
    "        except (OSError, ValueError) as exc:\n            raise ",
    "x = [i * i for i in range(10)]\nprint(",
    "@property\ndef size(self) -> int:\n",
)
CHECK_TOKENS = 24


@dataclass(slots=True)
class Candidate:
    """One way this device can run the model: ``load()`` verifies the files and returns a fresh runtime;
    ``unavailable`` says why it cannot (then ``load`` is never called)."""

    runtime: str  # onnxruntime | litert | llama.cpp
    format: str  # onnx | onnx-int8 | tflite | gguf-q8_0 | gguf-f32
    load: Callable[[], CausalLMRuntime] | None = None
    unavailable: str | None = None
    model_id: str | None = None  # the artifact it comes from
    variant: str | None = None  # a weight file within the artifact (GGUF)


@dataclass(slots=True)
class Measured:
    runtime: str
    format: str
    ms_per_token: float | None
    agreement: float | None
    eligible: bool
    reason: str | None

    def as_json(self) -> dict[str, Any]:
        return {
            "runtime": self.runtime,
            "format": self.format,
            "ms_per_token": self.ms_per_token,
            "agreement": self.agreement,
            "eligible": self.eligible,
            "reason": self.reason,
        }


@dataclass(slots=True)
class RuntimeChoice:
    chosen: str | None  # the format served; None when no candidate could run
    reference: str | None
    min_agreement: float
    candidates: list[Measured] = field(default_factory=list)
    served: Candidate | None = None  # the chosen candidate
    reason: str | None = None  # why nothing is served, when nothing is

    def as_json(self) -> dict[str, Any]:
        return {
            "chosen": self.chosen,
            "reference": self.reference,
            "min_agreement": self.min_agreement,
            "candidates": [c.as_json() for c in self.candidates],
            **({"reason": self.reason} if self.reason else {}),
        }

    def by_format(self, fmt: str) -> Measured | None:
        return next((c for c in self.candidates if c.format == fmt), None)


def _check_prompts(encode: Callable[[str], list[int]] | None, vocab: int, max_context: int) -> list[list[int]]:
    if encode is not None:
        prompts = [encode(p) for p in CHECK_PROMPTS]
        prompts = [p for p in prompts if p and len(p) + CHECK_TOKENS < max_context]
        if prompts:
            return prompts
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(0, vocab, 16)] for _ in CHECK_PROMPTS]


def agreement(runtime: CausalLMRuntime, prompts: list[list[int]], expected: list[list[int]]) -> float:
    """Share of positions where ``runtime``'s argmax is the expected token, fed the expected tokens. A prompt and
    answer longer than the runtime's context is not run (a request that long is refused by it too)."""
    hits = total = 0
    for prompt, want in zip(prompts, expected, strict=True):
        if len(prompt) + len(want) > runtime.max_context:
            continue
        runtime.reset()
        logits = runtime.prefill(prompt)
        for i, token in enumerate(want):
            hits += int(np.argmax(logits)) == token
            total += 1
            if i + 1 < len(want):
                logits = runtime.decode(token)
    if not total and any(expected):
        raise ValueError(f"no check prompt fits its context of {runtime.max_context} tokens")
    return hits / total if total else 1.0


def _time_once(runtime: CausalLMRuntime, prompt: list[int]) -> float:
    started = time.perf_counter()
    runtime.greedy(prompt, NEW_TOKENS)
    return (time.perf_counter() - started) * 1000 / (len(prompt) + NEW_TOKENS)


def reference_label(answers: ReferenceAnswers) -> str:
    """How the report names a ``reference.json`` reference: the file and the checkpoint it comes from."""
    source = answers.source.get("name")
    return f"{REFERENCE_FILE} ({source})" if source else REFERENCE_FILE


def choose(
    candidates: list[Candidate],
    *,
    min_agreement: float = DEFAULT_MIN_AGREEMENT,
    encode: Callable[[str], list[int]] | None = None,
    rounds: int = ROUNDS,
    answers: ReferenceAnswers | None = None,
) -> RuntimeChoice:
    """Load, check and time ``candidates``; the fastest eligible one is ``chosen`` (see the module doc).
    ``answers``: the source checkpoint's reference answers, when the artifacts carry them."""
    measured = {id(c): Measured(c.runtime, c.format, None, None, False, c.unavailable) for c in candidates}
    loaded: list[tuple[Candidate, CausalLMRuntime]] = []
    for c in candidates:
        if c.unavailable is not None or c.load is None:
            continue
        try:
            loaded.append((c, c.load()))
        except Exception as exc:  # a verification failure or a runtime that cannot load it: not a candidate
            message = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
            measured[id(c)].reason = f"cannot load: {message}"
            logger.warning("runtime guard: %s %s cannot load: %s", c.runtime, c.format, message)
    reference = next(((c, r) for c, r in loaded if c.format == REFERENCE), None)
    label = reference_label(answers) if answers is not None else FP32_REFERENCE if reference is not None else None
    choice = RuntimeChoice(None, label, min_agreement)
    choice.candidates = [measured[id(c)] for c in candidates]
    choice.reason = "no candidate can run on this device"
    if not loaded:
        return choice
    if answers is None and reference is None:
        # Nothing to check agreement against: serve the first that loads (the export order says the preference).
        first, _ = loaded[0]
        m = measured[id(first)]
        m.eligible = True
        m.reason = f"unchecked: no {REFERENCE} reference on this device"
        choice.chosen, choice.served, choice.reason = first.format, first, None
        return choice
    if answers is not None:
        prompts = [p.token_ids for p in answers.prompts]
        expected = [p.greedy for p in answers.prompts]
        vocab = next((r.vocab_size for _, r in loaded if r.vocab_size), None) or 2
        checked_by: Candidate | None = None  # every candidate is checked, the fp32 export included
    else:
        assert reference is not None
        ref_runtime = reference[1]
        vocab = ref_runtime.vocab_size or 2
        prompts = _check_prompts(encode, vocab, ref_runtime.max_context)
        expected = [ref_runtime.greedy(p, CHECK_TOKENS) for p in prompts]
        checked_by = reference[0]
    checked: list[tuple[Candidate, CausalLMRuntime]] = []
    for c, runtime in loaded:
        m = measured[id(c)]
        try:
            m.agreement = 1.0 if c is checked_by else round(agreement(runtime, prompts, expected), 4)
        except Exception as exc:
            m.reason = f"failed the check: {type(exc).__name__}: {exc}"
            continue
        checked.append((c, runtime))
        if m.agreement < min_agreement:
            m.reason = f"agreement {m.agreement:.4f} with {label} is below the bound {min_agreement:g}"
        else:
            m.eligible = True
    if not checked:
        choice.reason = f"no candidate could be checked against {label}"
        return choice
    timing_prompt = [int(t) % vocab for t in range(10, 10 + PROMPT_TOKENS)]
    best: dict[int, float] = {}
    for _, runtime in checked:
        runtime.greedy(timing_prompt, 2)  # warm-up
    for r in range(rounds):  # alternate the candidates, in a rotating order, so drift hits them alike
        order = checked[r % len(checked) :] + checked[: r % len(checked)]
        for c, runtime in order:
            ms = _time_once(runtime, timing_prompt)
            best[id(c)] = min(best.get(id(c), float("inf")), ms)
    for c, _ in checked:
        measured[id(c)].ms_per_token = round(best[id(c)], 4)
    # Decide on the figures that are shown, so the choice never contradicts its numbers.
    eligible = [c for c, _ in checked if measured[id(c)].eligible]
    if eligible:
        winner = min(eligible, key=lambda c: measured[id(c)].ms_per_token or float("inf"))
        choice.chosen, choice.served, choice.reason = winner.format, winner, None
    else:
        choice.reason = f"no candidate reaches agreement {min_agreement:g} with {label}"
    for _, runtime in loaded:
        close = getattr(runtime, "close", None)
        if callable(close):
            close()
    return choice

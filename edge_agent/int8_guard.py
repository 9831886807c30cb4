"""The INT8 guard: INT8 is only worth serving where it is faster than fp32 on this host.

ONNX Runtime's dynamic INT8 kernels can be slower than fp32 on CPUs without VNNI. At start-up the agent
times both exports of the edge LM on the same prefill + decode and serves the faster one under the plain
model id; the measurement is shown in ``/v1/models``.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from edge_agent.runtime.lm import load_causal_lm

PROMPT_TOKENS = 32
NEW_TOKENS = 16
REPEATS = 3


@dataclass(frozen=True, slots=True)
class Int8Choice:
    chosen: str  # "onnx-int8" | "onnx"
    int8_ms_per_token: float
    fp32_ms_per_token: float

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def _ms_per_token(model_dir: Path, num_threads: int) -> float:
    runtime = load_causal_lm(model_dir, num_threads)
    prompt = list(range(10, 10 + PROMPT_TOKENS))
    runtime.greedy(prompt, 2)  # warm-up
    best = float("inf")
    for _ in range(REPEATS):
        started = time.perf_counter()
        runtime.greedy(prompt, NEW_TOKENS)
        best = min(best, time.perf_counter() - started)
    return best * 1000 / (PROMPT_TOKENS + NEW_TOKENS)


def choose(int8_dir: Path, fp32_dir: Path, num_threads: int) -> Int8Choice:
    """Time both exports; INT8 only when it is strictly faster."""
    # Decide on the figures that are shown, so /v1/models never reports a choice its numbers contradict.
    int8 = round(_ms_per_token(int8_dir, num_threads), 4)
    fp32 = round(_ms_per_token(fp32_dir, num_threads), 4)
    return Int8Choice("onnx-int8" if int8 < fp32 else "onnx", int8, fp32)

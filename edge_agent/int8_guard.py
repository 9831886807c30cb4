"""The INT8 guard, now a special case of the runtime guard (:mod:`edge_agent.runtime_guard`): of the two ONNX
exports of an LM, INT8 is served only where it is faster than fp32 on this host and agrees with it.

Kept for callers that only hold the two ONNX directories; the agent itself runs the runtime guard over every
runtime and format it has for a model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from edge_agent import runtime_guard
from edge_agent.runtime.lm import load_causal_lm


@dataclass(frozen=True, slots=True)
class Int8Choice:
    chosen: str  # "onnx-int8" | "onnx"
    int8_ms_per_token: float
    fp32_ms_per_token: float

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def choose(int8_dir: Path, fp32_dir: Path, num_threads: int, min_agreement: float = 0.0) -> Int8Choice:
    """Time both exports; INT8 only when it is strictly faster (and agrees with fp32 to ``min_agreement``)."""
    candidates = [
        runtime_guard.Candidate("onnxruntime", "onnx", lambda: load_causal_lm(fp32_dir, num_threads)),
        runtime_guard.Candidate("onnxruntime", "onnx-int8", lambda: load_causal_lm(int8_dir, num_threads)),
    ]
    choice = runtime_guard.choose(candidates, min_agreement=min_agreement)
    fp32, int8 = (choice.by_format(f) for f in ("onnx", "onnx-int8"))
    assert fp32 is not None and int8 is not None and choice.chosen is not None
    return Int8Choice(choice.chosen, int8.ms_per_token or 0.0, fp32.ms_per_token or 0.0)

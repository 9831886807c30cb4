"""Edge LM decode speed on this host: ONNX fp32, ONNX INT8 and TFLite beside transformers (same weights)."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np

from edge_agent.runtime.lm import load_causal_lm
from shared.zoo.registry import ZooLayout

PROMPT_TOKENS = 64


def _prompt_ids(layout: ZooLayout) -> list[int]:
    from tokenizers import Tokenizer

    from shared.zoo.corpus import held_out_files

    tok = Tokenizer.from_file(str(layout.artifact_dir("lm-edge") / "tokenizer.json"))
    return list(tok.encode(held_out_files()[0].text).ids[:PROMPT_TOKENS])


def _time(fn: Any, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _transformers_greedy(model_dir: Path, ids: list[int], num_tokens: int) -> tuple[list[int], float, int]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    inputs = torch.tensor([ids])

    def run() -> list[int]:
        with torch.no_grad():
            out = model.generate(
                inputs,
                max_new_tokens=num_tokens,
                min_new_tokens=num_tokens,
                do_sample=False,
                pad_token_id=model.config.pad_token_id,
            )
        return [int(t) for t in out[0, len(ids) :]]

    tokens = run()
    return tokens, _time(run, 1), len(tokens)


def run_zoo_bench(root: Path, num_tokens: int = 64, repeats: int = 3) -> dict[str, Any]:
    layout = ZooLayout(root)
    report = layout.report()
    ids = _prompt_ids(layout)
    results: dict[str, Any] = {}
    reference: list[int] | None = None
    for name in ("lm-edge-onnx", "lm-edge-onnx-int8", "lm-edge-tflite"):
        art = layout.artifact_dir(name)
        if not art.is_dir():
            continue
        runtime = load_causal_lm(art, num_threads=1)
        tokens = runtime.greedy(ids, num_tokens)
        seconds = _time(lambda runtime=runtime: runtime.greedy(ids, num_tokens), repeats)
        reference = reference or tokens
        results[name] = {
            "tokens_per_s": round(num_tokens / seconds, 1),
            "ms_per_token": round(1000 * seconds / num_tokens, 3),
            "greedy_agreement_with_onnx_fp32": round(float(np.mean(np.array(tokens) == np.array(reference))), 3),
        }
    hf_tokens, hf_seconds, n = _transformers_greedy(layout.artifact_dir("lm-edge"), ids, num_tokens)
    results["transformers-fp32"] = {
        "tokens_per_s": round(n / hf_seconds, 1),
        "ms_per_token": round(1000 * hf_seconds / n, 3),
        "greedy_agreement_with_onnx_fp32": round(
            float(np.mean(np.array(hf_tokens[:num_tokens]) == np.array(reference))) if reference else 0.0, 3
        ),
    }
    return {
        "bench": "zoo-edge-lm-decode",
        "preset": report.get("preset"),
        "host": {"machine": platform.machine(), "processor": platform.processor(), "threads": 1},
        "prompt_tokens": len(ids),
        "new_tokens": num_tokens,
        "results": results,
        "zoo": {k: report[k] for k in ("training", "edge_lm", "digits") if k in report},
    }


if __name__ == "__main__":
    import sys

    print(json.dumps(run_zoo_bench(Path(sys.argv[1])), indent=2))

"""Edge LM decode speed on this host: ONNX fp32, ONNX INT8 and TFLite beside transformers (same weights)."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any

from edge_agent.runtime.lm import load_causal_lm
from shared.zoo.registry import ZooLayout

PROMPT_TOKENS = 64


def _prompt_ids(layout: ZooLayout) -> list[int]:
    from tokenizers import Tokenizer

    from shared.zoo.corpus import held_out_files

    tok = Tokenizer.from_file(str(layout.artifact_dir("lm-edge") / "tokenizer.json"))
    return list(tok.encode(held_out_files()[0].text).ids[:PROMPT_TOKENS])


def _prefix_match(tokens: list[int], reference: list[int]) -> int:
    """Tokens generated before the first difference (free-running greedy sequences diverge for good after it)."""
    for i, (a, b) in enumerate(zip(tokens, reference, strict=False)):
        if a != b:
            return i
    return min(len(tokens), len(reference))


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


SAMPLE_PROMPTS = (
    "import os\n\n\ndef read_config(path):\n",
    "class Stack:\n    def __init__(self):\n",
    "    for i, line in enumerate(lines):\n        if ",
)


def _samples(layout: ZooLayout, num_tokens: int = 40) -> dict[str, Any]:
    """Greedy completions from both LMs (transformers), their agreement and how repetitive they are.

    How long edge and cloud greedy runs agree hints at speculative acceptance; distinct-2 near 0 means a loop.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out: dict[str, Any] = {}
    tokens: dict[str, list[list[int]]] = {}
    for role in ("edge", "cloud"):
        path = layout.artifact_dir(f"lm-{role}")
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        texts, ids_list = [], []
        for prompt in SAMPLE_PROMPTS:
            ids = tok(prompt, return_tensors="pt").input_ids
            with torch.no_grad():
                gen = model.generate(ids, max_new_tokens=num_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
            new = gen[0, ids.shape[1] :].tolist()
            ids_list.append(new)
            texts.append(prompt + str(tok.decode(new)))
        tokens[role] = ids_list
        bigrams = [tuple(t[i : i + 2]) for t in ids_list for i in range(len(t) - 1)]
        out[role] = {"completions": texts, "distinct_2": round(len(set(bigrams)) / max(1, len(bigrams)), 3)}
    out["greedy_tokens_before_divergence_edge_vs_cloud"] = [
        _prefix_match(e, c) for e, c in zip(tokens["edge"], tokens["cloud"], strict=True)
    ]
    return out


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
            "greedy_tokens_before_divergence_from_onnx_fp32": _prefix_match(tokens, reference),
        }
    hf_tokens, hf_seconds, n = _transformers_greedy(layout.artifact_dir("lm-edge"), ids, num_tokens)
    results["transformers-fp32"] = {
        "tokens_per_s": round(n / hf_seconds, 1),
        "ms_per_token": round(1000 * hf_seconds / n, 3),
        "greedy_tokens_before_divergence_from_onnx_fp32": _prefix_match(hf_tokens, reference or []),
    }
    return {
        "bench": "zoo-edge-lm-decode",
        "preset": report.get("preset"),
        "host": {"machine": platform.machine(), "processor": platform.processor(), "threads": 1},
        "prompt_tokens": len(ids),
        "new_tokens": num_tokens,
        "results": results,
        "samples": _samples(layout),
        "zoo": {k: report[k] for k in ("training", "edge_lm", "digits") if k in report},
    }


if __name__ == "__main__":
    import sys

    print(json.dumps(run_zoo_bench(Path(sys.argv[1])), indent=2))

"""Weight-only int8 beside fp32 on one LM: greedy batch-1 tokens/s in alternating rounds, and how far int8's greedy
output follows fp32's (docs/engine.md, "Weight-only int8 on CPU").

    python -m bench.lab.int8_agreement [LM_DIR] [--rounds 3] [--tokens 64] [--threads 1]

Prompts are code openings (the zoo's LMs are trained on Python); each is generated alone, one after another, by an
engine with ``cpu_weights`` fp32 and one with int8 (speculation off). Prints one JSON object: tok/s per round and
their median, sequences identical, the mean number of tokens before the first difference, and the share of positions
with the same token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.common import tokens_before_divergence
from cloud.engine.llm import LLM
from cloud.engine.sampling_params import SamplingParams
from shared.zoo.build import committed_weights
from shared.zoo.presets import DEMO

PROMPTS = [
    "import os\n",
    "def main():\n    ",
    "class Config:\n",
    "for i in range(",
    "# Licensed under",
    "if __name__ ==",
    "return self.",
    "with open(",
    "x = [",
    "print(",
    "from typing import",
    "try:\n    ",
    "async def ",
    "self.assertEqual(",
    "raise ValueError(",
    "while True:\n",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lm_dir", nargs="?", type=Path, default=committed_weights(DEMO) / "lm-cloud")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llms = {w: LLM(args.lm_dir, cpu_weights=w, kv_cache_bytes=64 << 20, speculation="off") for w in ("fp32", "int8")}
    greedy = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    rates: dict[str, list[float]] = {w: [] for w in llms}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(args.rounds):
        for weights, llm in llms.items():
            started, got = time.perf_counter(), []
            for prompt in PROMPTS:
                got.append(list(llm.generate(prompt, greedy)[0].outputs[0].token_ids))
            rates[weights].append(sum(map(len, got)) / (time.perf_counter() - started))
            outputs.setdefault(weights, got)
    pairs = list(zip(outputs["fp32"], outputs["int8"], strict=True))
    prefixes = [tokens_before_divergence(a, b) for a, b in pairs]
    same_positions = sum(x == y for a, b in pairs for x, y in zip(a, b, strict=True))
    result = {
        "lm": str(args.lm_dir),
        "threads": args.threads,
        "tokens_per_s_runs": {w: [round(v, 1) for v in rs] for w, rs in rates.items()},
        "tokens_per_s": {w: round(statistics.median(rs), 1) for w, rs in rates.items()},
        "int8_vs_fp32": round(statistics.median(rates["int8"]) / statistics.median(rates["fp32"]), 2),
        "identical_sequences": f"{sum(a == b for a, b in pairs)}/{len(pairs)}",
        "mean_tokens_before_first_difference": round(sum(prefixes) / len(prefixes), 1),
        "position_agreement": round(same_positions / sum(len(a) for a, _ in pairs), 3),
        "load": [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()

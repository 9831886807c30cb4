"""Draft speculation with the draft's weights in fp32 and in int8, and with k up to 4 and 8, beside plain decoding,
in the engine (docs/engine.md, "What a draft can buy at batch 1").

    python -m bench.lab.draft_weights [ZOO_OR_WEIGHTS_DIR] [--concurrency 1 --concurrency 16] [--rounds 3]
                                      [--threads 2]

``lm-cloud`` with ``lm-draft`` (adaptive controller), the prompts and workload of ``tierline bench spec``; every
engine once a round at each concurrency, in turn (``bench.engine_bench.spec_sweep``). Prints one JSON object: per
concurrency the tok/s of each engine, its ratio to plain (median of the rounds' ratios) and whether every output
equals plain's; the draft's acceptance per engine.
"""

from __future__ import annotations

import json

import torch

from bench.engine_bench import (
    KV_BYTES,
    _acceptance,
    _lm,
    _run_batches,
    _spec_workload,
    spec_prompts,
    spec_sweep,
)
from bench.lab import spec_lab_parser
from cloud.engine.config import EngineConfig
from cloud.engine.llm_engine import LLMEngine

# name -> (draft weights, the largest k the controller may pick)
VARIANTS = {"fp32_k4": ("fp32", 4), "int8_k4": ("int8", 4), "fp32_k8": ("fp32", 8), "int8_k8": ("int8", 8)}


def main() -> None:
    parser = spec_lab_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, draft = _lm(args.zoo, "lm-cloud"), _lm(args.zoo, "lm-draft")
    plain = LLMEngine(EngineConfig(target, kv_cache_bytes=KV_BYTES))
    concurrency = tuple(args.concurrency or (1,))
    prompts = spec_prompts(plain, max(8, *concurrency))
    engines = {"plain": plain} | {
        name: LLMEngine(
            EngineConfig(
                target,
                draft_model_dir=draft,
                kv_cache_bytes=KV_BYTES,
                draft_cpu_weights=weights,
                num_speculative_tokens=k,
            )
        )
        for name, (weights, k) in VARIANTS.items()
    }
    for engine in engines.values():  # warm up: the kernels, the allocator, the controller's first plain steps
        _run_batches(engine, _spec_workload(prompts[:1], 1, 8))
    sweep = spec_sweep(engines, prompts, args.tokens, concurrency, args.rounds)
    acceptance = {name: _acceptance(engines[name], "draft") for name in VARIANTS}
    print(json.dumps({"threads": args.threads, "rounds": args.rounds, "sweep": sweep, "acceptance": acceptance}))


if __name__ == "__main__":
    main()

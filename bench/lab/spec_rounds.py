"""Speculation against plain decoding round after round, with what the adaptive controller learnt: does it keep
speculating where it pays, and only there (docs/benchmarks.md, "bench spec")?

    python -m bench.lab.spec_rounds [ZOO_OR_WEIGHTS_DIR] [--concurrency 1] [--rounds 5] [--fixed-k K]
                                    [--method draft|ngram]

``lm-cloud`` plain and with ``lm-draft`` (or prompt-lookup n-grams), the prompts and workload of ``tierline bench
spec`` at each concurrency given (default 1), ``--rounds`` times in turn, plain first. ``--fixed-k``: the
speculating engine without the controller, k proposals every step (what speculation can give here). Prints one JSON
line per round: both engines' tokens a second and their ratio, the speculating engine's speculative steps against
all its steps, the controller's acceptance (and for n-grams hit rate and proposal fill) and its cost table for the
concurrency's bucket (milliseconds a sequence, measurements), as it stands after the round.
"""

from __future__ import annotations

import json

import torch

from bench.engine_bench import KV_BYTES, _lm, _run_batches, _spec_workload, spec_prompts
from bench.lab import spec_lab_parser
from cloud.engine.config import EngineConfig
from cloud.engine.llm_engine import LLMEngine
from cloud.engine.speculator import concurrency_bucket


def main() -> None:
    parser = spec_lab_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--fixed-k", type=int, default=0, help="k every step, the controller off (0: adaptive)")
    parser.add_argument("--method", choices=["draft", "ngram"], default="draft")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, draft = _lm(args.zoo, "lm-cloud"), _lm(args.zoo, "lm-draft")
    plain = LLMEngine(EngineConfig(target, kv_cache_bytes=KV_BYTES))
    options = {"adaptive_speculation": False, "num_speculative_tokens": args.fixed_k} if args.fixed_k else {}
    if args.method == "ngram":
        spec = LLMEngine(EngineConfig(target, speculation="ngram", kv_cache_bytes=KV_BYTES, **options))
    else:
        spec = LLMEngine(EngineConfig(target, draft_model_dir=draft, kv_cache_bytes=KV_BYTES, **options))
    method = args.method
    concurrency = args.concurrency or [1]
    prompts = spec_prompts(plain, max(8, *concurrency))
    for engine in (plain, spec):  # warm up: the kernels, the allocator
        _run_batches(engine, _spec_workload(prompts[:1], 1, 8))
    for c in concurrency:
        batches = _spec_workload(prompts, c, args.tokens)
        for r in range(args.rounds):
            _, plain_rate = _run_batches(plain, batches)
            steps, spec_steps = spec.stats.num_steps, spec.stats.spec_steps.get(method, 0)
            _, spec_rate = _run_batches(spec, batches)
            controller = spec.spec
            costs = {}
            if controller is not None:
                costs = {
                    f"{'plain' if m == 'plain' else 'k'}{k}": [round(cost.seconds * 1000, 3), cost.count]
                    for (m, bucket, k), cost in sorted(controller._costs.items(), key=lambda kv: kv[0][2])
                    if bucket == concurrency_bucket(c) and m in ("plain", method)
                }
            row = {
                "concurrency": c,
                "round": r,
                "plain_tokens_per_s": round(plain_rate, 1),
                f"{method}_tokens_per_s": round(spec_rate, 1),
                f"{method}_x_plain": round(spec_rate / plain_rate, 3),
                "speculative_steps": spec.stats.spec_steps.get(method, 0) - spec_steps,
                "steps": spec.stats.num_steps - steps,
                "acceptance": round(controller.acceptance(method), 3) if controller is not None else None,
                "hit_rate": round(controller.hit_rate(method), 3) if controller is not None else None,
                "proposal_fill": round(controller.proposal_fill(method), 3) if controller is not None else None,
                "costs_ms": costs,
            }
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

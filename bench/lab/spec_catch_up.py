"""Where draft speculation's time goes at each concurrency: the draft's catch-up on prompts against the gain, in the
engine (docs/engine.md, "What a draft can buy at batch 1").

    python -m bench.lab.spec_catch_up [ZOO_OR_WEIGHTS_DIR] [--concurrency 1 --concurrency 64 --concurrency 64]
                                      [--threads 2] [--tokens 96]

``lm-cloud`` plain and with ``lm-draft`` (adaptive controller), the prompts and workload of ``tierline bench spec``,
each concurrency in the order given (repeat one to see a bucket the controller has already measured), plain first.
Prints one JSON line per batch: both engines' seconds, the draft's proposing calls and seconds, the tokens it had to
catch up on first and the seconds that catch-up took (what the controller prices apart from a step's cost), and the
controller's estimate of a catch-up's seconds a token.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch

from bench.engine_bench import KV_BYTES, _lm, _run_batches, _spec_workload, spec_prompts
from bench.lab import spec_lab_parser
from cloud.engine.config import EngineConfig
from cloud.engine.llm_engine import LLMEngine
from cloud.engine.sequence import Sequence


def main() -> None:
    parser = spec_lab_parser(__doc__)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, draft = _lm(args.zoo, "lm-cloud"), _lm(args.zoo, "lm-draft")
    plain = LLMEngine(EngineConfig(target, kv_cache_bytes=KV_BYTES))
    spec = LLMEngine(EngineConfig(target, draft_model_dir=draft, kv_cache_bytes=KV_BYTES))
    assert spec.drafter is not None
    drafter = spec.drafter
    concurrency = args.concurrency or [1, 2, 4, 8, 16, 64, 64, 64]
    prompts = spec_prompts(plain, max(8, *concurrency))
    seen: dict[str, Any] = {"catch_up_tokens": 0, "propose_s": 0.0, "catch_up_s": 0.0, "propose_calls": 0}
    propose = drafter.propose

    def timed_propose(seqs: list[Sequence]) -> dict[int, torch.Tensor | None]:
        seen["catch_up_tokens"] += sum(drafter.lag(s) for s in seqs)
        started = time.perf_counter()
        try:
            return propose(seqs)
        finally:
            seen["propose_s"] += time.perf_counter() - started
            seen["catch_up_s"] += drafter.catch_up_seconds
            seen["propose_calls"] += 1

    drafter.propose = timed_propose  # type: ignore[method-assign]
    for engine in (plain, spec):  # warm up: the kernels, the allocator, the controller's first plain steps
        _run_batches(engine, _spec_workload(prompts[:1], 1, 8))
    for c in concurrency:
        batches = _spec_workload(prompts, c, args.tokens)
        seen.update(catch_up_tokens=0, propose_s=0.0, catch_up_s=0.0, propose_calls=0)
        started = time.perf_counter()
        _run_batches(plain, batches)
        plain_s = time.perf_counter() - started
        started = time.perf_counter()
        _run_batches(spec, batches)
        spec_s = time.perf_counter() - started
        row = {"concurrency": c, "plain_s": round(plain_s, 3), "draft_s": round(spec_s, 3)}
        row |= {"draft_x": round(plain_s / spec_s, 3), **{k: round(v, 3) for k, v in seen.items()}}
        assert spec.spec is not None
        row["catch_up_us_a_token"] = round(spec.spec.catch_up_cost(1_000_000), 1)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

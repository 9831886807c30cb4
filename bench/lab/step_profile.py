"""Where an engine step's time goes: ``python -m bench.lab.step_profile <lm dir> [--threads N] [--no-fused-decode]``.

Decodes greedy requests (100-token prompts, 120 new tokens) at batch 1 and at 64 concurrent through
``LLMEngine.step`` and splits each step's wall time into scheduling, input preparation (the runner's work before
and after the model), the model's forward, sampling, postprocessing (appending tokens, finishing) and output
processing (detokenisation, stop strings), by timing those calls, and the median step's wall and CPU time (a decode
step). ``--no-fused-decode`` runs every step through the torch model (``EngineConfig.fused_decode`` off). Prints one
JSON object: milliseconds per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cloud.engine.config import EngineConfig
from cloud.engine.llm_engine import LLMEngine
from cloud.engine.model_runner import Feed
from cloud.engine.sampling_params import SamplingParams


def _timed(totals: dict[str, float], cpu: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started, cpu_started = time.perf_counter(), time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - started
            cpu[name] += time.process_time() - cpu_started

    return wrapper


def profile_steps(engine: LLMEngine, batch: int, num_tokens: int = 120, salt: str = "") -> dict[str, Any]:
    """Milliseconds per step of each phase while ``batch`` requests decode together (prefill steps included)."""
    totals: dict[str, float] = defaultdict(float)
    cpu: dict[str, float] = defaultdict(float)
    runner = engine.runner
    patched = {
        (engine, "_schedule"): "schedule",
        (engine, "_sample"): "sample",
        (engine, "_postprocess"): "postprocess",
        (runner, "execute"): "runner",
        (runner.model, "forward"): "forward",
        (runner.model, "compute_logits"): "forward",
    }
    if runner.fused_decoder is not None:  # a small decode step's whole forward, one C call
        patched[(runner.fused_decoder, "run")] = "forward"
    if engine.output_processor is not None:
        patched[(engine.output_processor, "process")] = "output_processing"
    for (obj, attr), name in patched.items():
        setattr(obj, attr, _timed(totals, cpu, name, getattr(obj, attr)))
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{salt}{i}", list(range(5 + i % 50, 105 + i % 50)), params, cache_salt=salt)
    steps = 0
    step_wall: list[float] = []
    step_cpu: list[float] = []
    started, cpu_started = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        t, c = time.perf_counter(), time.process_time()
        engine.step()
        step_wall.append(time.perf_counter() - t)
        step_cpu.append(time.process_time() - c)
        steps += 1
    wall, cpu_total = time.perf_counter() - started, time.process_time() - cpu_started
    for obj, attr in patched:
        delattr(obj, attr)  # back to the class's method
    return {
        "batch": batch,
        "steps": steps,
        "tokens_per_s": round(batch * num_tokens / wall, 1),
        "ms_per_step": _per_step(totals, wall, steps),
        # The median step is a decode step (prefills are few) and shrugs off the host's bursts of other work.
        "median_step_ms": round(statistics.median(step_wall) * 1000, 3),
        "median_step_cpu_ms": round(statistics.median(step_cpu) * 1000, 3),
        # CPU time of the process (all its threads): on a busy host, closer than wall time to what a quiet one shows.
        "cpu_ms_per_step": _per_step(cpu, cpu_total, steps),
    }


def decode_forward_ms(engine: LLMEngine, batches: list[int], repeats: int = 100) -> list[dict[str, Any]]:
    """The runner's decode step alone (``execute``: one token per sequence at ~100-200 positions, on one thread),
    fused and through the torch model, alternately: best of three timings of ``repeats`` steps, in ms."""
    runner, fused = engine.runner, engine.runner.fused_decoder
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    runner.adapt_threads = False  # (a decode of 4+ sequences of the demo LM would otherwise take both threads)
    bs = runner.block_size
    rows = []
    try:
        for batch in batches:
            feeds = [Feed(list(range(b * 16, b * 16 + 16)), [7], 100 + 13 * b, 1) for b in range(batch)]
            assert max(f.start for f in feeds) < 16 * bs and 16 * batch <= runner.num_blocks
            row: dict[str, Any] = {"batch": batch}
            for name, decoder in (("torch", None), ("fused", fused)):
                if name == "fused" and decoder is None:
                    continue
                runner.fused_decoder = decoder
                for _ in range(10):
                    runner.execute(feeds)
                best = float("inf")
                for _ in range(3):
                    started = time.perf_counter()
                    for _ in range(repeats):
                        runner.execute(feeds)
                    best = min(best, (time.perf_counter() - started) / repeats)
                row[f"{name}_ms"] = round(best * 1000, 3)
            rows.append(row)
    finally:
        runner.fused_decoder, runner.adapt_threads = fused, True
        torch.set_num_threads(threads)
    return rows


def _per_step(totals: dict[str, float], total: float, steps: int) -> dict[str, float]:
    ms = {k: v / steps * 1000 for k, v in totals.items()}
    ms["input_preparation"] = ms.pop("runner") - ms["forward"]
    ms["step"] = total / steps * 1000
    ms["other_python"] = ms["step"] - sum(v for k, v in ms.items() if k != "step")
    return {k: round(v, 3) for k, v in ms.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--no-fused-decode", action="store_true", help="every step through the torch model")
    parser.add_argument(
        "--forward-batches", type=int, nargs="*", default=[], help="also time the decode forward alone at these batches"
    )
    args = parser.parse_args()
    engine = LLMEngine(
        EngineConfig(
            args.model_dir,
            kv_cache_bytes=256 << 20,
            max_num_batched_tokens=2048,
            num_threads=args.threads,
            fused_decode=not args.no_fused_decode,
        )
    )
    profile_steps(engine, 2, 16, "warm-up")
    results = [profile_steps(engine, b, salt=f"b{b}") for b in args.batches]
    print(
        json.dumps(
            {
                "model": str(args.model_dir),
                "threads": getattr(engine.runner, "max_threads", torch.get_num_threads()),
                "fused_decode": engine.runner.fused_decoder is not None,
                "runs": results,
                "decode_forward_ms": decode_forward_ms(engine, args.forward_batches),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()

"""LLM engine benchmarks on the demo zoo (CPU, one process, same weights for every contender).

- ``engine``: many requests with mixed prompt/output lengths arriving at once; this engine beside
  transformers ``generate`` one request at a time and in padded static batches, plus this engine's bare
  batched forward as the ceiling.
- ``spec``: greedy plain decoding, draft-model and n-gram speculation side by side at 1, 2, 4, 8, 16 and 64
  concurrent requests (alternating rounds, medians); at batch 1 also the edge LM as the draft and transformers
  assisted generation with the same draft; and whether speculation stayed within 2 % of plain at batch 1.
- ``prefix``: time to first token for requests sharing a long system prompt, with and without prefix caching.
- ``engine --vs llamacpp``: beside llama.cpp on the same weights, in process (llama-cpp-python) and then
  ``llama-server`` against ``tierline engine serve``, both over HTTP (``bench/llama_server.py``).
"""

from __future__ import annotations

import importlib.metadata
import itertools
import json
import math
import os
import random
import resource
import shlex
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cloud.engine.config import EngineConfig
from cloud.engine.llm_engine import LLMEngine
from cloud.engine.model_runner import Feed, ModelRunner, process_threads
from cloud.engine.sampling_params import SamplingParams
from cloud.engine.speculator import METHODS
from shared.zoo.corpus import held_out_files
from shared.zoo.registry import ZooLayout

KV_BYTES = 256 << 20


def _lm(zoo_root: Path, name: str) -> Path:
    """An LM of a built zoo, or a directory of checkpoints (such as the committed weights)."""
    built = ZooLayout(zoo_root).artifact_dir(name)
    return built if built.is_dir() else zoo_root / name


def _corpus_ids(engine: LLMEngine) -> list[int]:
    ids: list[int] = []
    for f in held_out_files():
        ids.extend(engine.tokenizer.encode(f.text))
    return ids


def _workload(
    corpus: list[int],
    num_requests: int,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
    seed: int,
    max_len: int | None = None,
) -> list[tuple[list[int], int]]:
    """Prompts cut from held-out text and output lengths, drawn uniformly; a model with a context shorter than
    the ranges (``max_len``) gets prompts of at most half of it and outputs that fit."""
    rng = random.Random(seed)
    lo, hi = prompt_range
    if max_len is not None:
        hi = max(lo, min(hi, max_len // 2))
    work = []
    for _ in range(num_requests):
        plen = rng.randint(lo, hi)
        start = rng.randrange(0, len(corpus) - plen)
        n = rng.randint(*output_range)
        if max_len is not None:
            n = max(1, min(n, max_len - plen))
        work.append((corpus[start : start + plen], n))
    return work


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000 if values else 0.0


def run_engine_workload(
    engine: LLMEngine,
    work: list[tuple[list[int], int]],
    params: dict[str, Any] | None = None,
    cache_salt: str | None = None,
) -> dict[str, Any]:
    """All requests arrive at once; returns throughput, TTFT, inter-token latency, and how much of the wall
    time the model forward took (the rest is scheduling, sampling and detokenization). A ``cache_salt`` of its
    own keeps a run from hitting the prefix cache that an earlier run of the same prompts filled."""
    forward_before = engine.runner.forward_seconds
    steps_before = engine.stats.num_steps
    started = time.monotonic()
    for i, (prompt, max_tokens) in enumerate(work):
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **(params or {}))
        engine.add_request(f"r{i}", prompt, sp, cache_salt=cache_salt, arrival_time=started)
    last_seen: dict[str, tuple[float, int]] = {}
    ttft: list[float] = []
    itl: list[float] = []
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.monotonic()
            n = len(out.token_ids)
            prev = last_seen.get(out.request_id)
            if prev is None and n:
                ttft.append(now - started)
            elif prev is not None and n > prev[1]:
                itl.extend([(now - prev[0]) / (n - prev[1])] * (n - prev[1]))
            if n:
                last_seen[out.request_id] = (now, n)
            if out.finished:
                outputs[out.request_id] = out.token_ids
    seconds = time.monotonic() - started
    num_tokens = sum(len(t) for t in outputs.values())
    return {
        "seconds": seconds,
        "forward_share": (engine.runner.forward_seconds - forward_before) / seconds,
        "num_steps": engine.stats.num_steps - steps_before,
        "tokens": num_tokens,
        "tokens_per_s": num_tokens / seconds,
        "ttft_p50_ms": _pct(ttft, 50),
        "ttft_p99_ms": _pct(ttft, 99),
        "itl_p50_ms": _pct(itl, 50),
        "itl_p99_ms": _pct(itl, 99),
        "outputs": [outputs[f"r{i}"] for i in range(len(work))],
    }


def raw_forward_seconds(engine: LLMEngine, batch: int, context: int, steps: int = 20) -> float:
    """Seconds per decode step of the bare model runner with ``batch`` sequences at ``context`` tokens."""
    runner = engine.runner
    bs = engine.config.block_size
    per_seq = -(-(context + steps) // bs)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    if batch * per_seq > runner.num_blocks:
        raise ValueError("KV budget too small for the raw-forward measurement")
    runner.execute([Feed(t, [1] * context, 0, 1) for t in tables])
    started = time.perf_counter()
    for s in range(steps):
        runner.execute([Feed(t, [1], context + s, 1) for t in tables])
    return (time.perf_counter() - started) / steps


def raw_forward_tokens_per_s(engine: LLMEngine, batch: int, context: int, steps: int = 20) -> float:
    """The bare model runner decoding ``batch`` sequences at ``context`` tokens: the ceiling for the engine."""
    return batch / raw_forward_seconds(engine, batch, context, steps)


def forward_only_seconds(engine: LLMEngine, work: list[tuple[list[int], int]], context: int) -> float:
    """The bare model runner doing this workload's forward work and nothing else: the prompts prefilled whole in
    steps of up to the engine's token budget, then one decode step per further generated token at the batch of
    requests still generating (at most ``max_num_seqs``; a step's time measured at batch sizes 1, 2, 4, ... and
    interpolated). What an engine with no scheduling, sampling or detokenization cost would take."""
    runner, cfg = engine.runner, engine.config
    steps: list[list[list[int]]] = [[]]  # the prompts, packed in order into steps of at most the token budget
    for prompt, _ in work:
        if steps[-1] and sum(map(len, steps[-1])) + len(prompt) > cfg.max_num_batched_tokens:
            steps.append([])
        steps[-1].append(prompt)
    prefill = 0.0
    for step in filter(None, steps):  # (none when there is no work)
        feeds, used = [], 0  # each prompt its own blocks, one after another
        for p in step:
            blocks = -(-len(p) // cfg.block_size)
            feeds.append(Feed(list(range(used, used + blocks)), p, 0, 1))
            used += blocks
        started = time.perf_counter()
        runner.execute(feeds)
        prefill += time.perf_counter() - started
    # Decode steps: every running request feeds one token; a finished one's place goes to the next waiting.
    remaining = [n - 1 for _, n in work if n > 1]
    active, waiting, batches = remaining[: cfg.max_num_seqs], remaining[cfg.max_num_seqs :], []
    while active:
        batches.append(len(active))
        active = [r - 1 for r in active if r > 1]
        while waiting and len(active) < cfg.max_num_seqs:
            active.append(waiting.pop(0))
    if not batches:
        return prefill
    sizes = sorted({min(2**e, max(batches)) for e in range(max(batches).bit_length() + 1)})
    cost = [raw_forward_seconds(engine, b, context) for b in sizes]
    return prefill + sum(float(np.interp(b, sizes, cost)) for b in batches)


def _hf_model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_sequential(model: Any, work: list[tuple[list[int], int]]) -> dict[str, Any]:
    started = time.perf_counter()
    outputs = []
    for prompt, max_tokens in work:
        ids = torch.tensor([prompt])
        out = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        outputs.append(out[0, len(prompt) :].tolist())
    seconds = time.perf_counter() - started
    tokens = sum(len(o) for o in outputs)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "outputs": outputs}


@torch.inference_mode()
def hf_static_batches(model: Any, work: list[tuple[list[int], int]], batch_size: int, pad_id: int) -> dict[str, Any]:
    """Left-padded batches in arrival order; each batch runs to its longest request (useful tokens counted)."""
    started = time.perf_counter()
    useful = 0
    for i in range(0, len(work), batch_size):
        chunk = work[i : i + batch_size]
        width = max(len(p) for p, _ in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, (prompt, _) in enumerate(chunk):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        longest = max(n for _, n in chunk)
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=longest,
            min_new_tokens=longest,
            do_sample=False,
            pad_token_id=pad_id,
        )
        useful += sum(n for _, n in chunk)
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "tokens": useful, "tokens_per_s": useful / seconds, "batch_size": batch_size}


def _median_ratio(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> float:
    ratios = [float(a["tokens_per_s"]) / float(b["tokens_per_s"]) for a, b in zip(ours, theirs, strict=True)]
    return round(statistics.median(ratios), 2)


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return sorted(runs, key=lambda r: float(r["tokens_per_s"]))[(len(runs) - 1) // 2]


def _rates(runs: list[dict[str, Any]]) -> list[float]:
    return [round(float(r["tokens_per_s"]), 1) for r in runs]


def bench_engine(
    zoo_root: Path,
    num_requests: int = 64,
    max_num_seqs: int = 64,
    skip_hf: bool = False,
    seed: int = 0,
    rounds: int = 1,
) -> dict[str, Any]:
    """This engine beside transformers on the same requests. With ``rounds`` > 1 every contender runs once a round,
    in turn, so a host whose speed drifts slows them alike; rates are the median round's, speedups the median of
    the rounds' own ratios, and ``*_runs`` lists every round."""
    model_dir = _lm(zoo_root, "lm-cloud")
    engine = LLMEngine(
        EngineConfig(model_dir, kv_cache_bytes=KV_BYTES, max_num_seqs=max_num_seqs, max_num_batched_tokens=2048)
    )
    work = _workload(_corpus_ids(engine), num_requests, (16, 256), (16, 128), seed, engine.max_model_len)
    run_engine_workload(engine, work[:4], cache_salt="warm-up")
    runs = [run_engine_workload(engine, work, cache_salt="round-0")]
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the engine's, before transformers
    model = None if skip_hf else _hf_model(model_dir)
    seq_runs: list[dict[str, Any]] = []
    static_runs: list[dict[str, Any]] = []
    for r in range(rounds):
        if r:
            runs.append(run_engine_workload(engine, work, cache_salt=f"round-{r}"))  # no hits from an earlier round
        if model is not None:
            seq_runs.append(hf_sequential(model, work))
            static_runs.append(hf_static_batches(model, work, max_num_seqs, engine.model_config.eos_token_ids[0]))
    ours = _median_run(runs)
    mean_ctx = int(statistics.mean(len(p) + n / 2 for p, n in work))
    raw = raw_forward_tokens_per_s(engine, min(max_num_seqs, num_requests), mean_ctx)
    forward_only = ours["tokens"] / forward_only_seconds(engine, work, mean_ctx)
    result: dict[str, Any] = {
        "model": str(model_dir),
        "num_requests": num_requests,
        "max_num_seqs": max_num_seqs,
        "torch_threads": process_threads(),
        "rounds": rounds,
        "engine_tokens_per_s": round(ours["tokens_per_s"], 1),
        "engine_tokens_per_s_runs": _rates(runs),
        "engine_seconds": round(ours["seconds"], 2),
        "raw_forward_tokens_per_s": round(raw, 1),
        "efficiency_vs_raw_forward": round(ours["tokens_per_s"] / raw, 3),
        # The same workload's prefill and decode steps on the bare forward, nothing else: how far the engine is from
        # its own kernels on this work, and the most efficiency_vs_raw_forward this workload allows.
        "forward_only_tokens_per_s": round(forward_only, 1),
        "efficiency_vs_forward_only": round(ours["tokens_per_s"] / forward_only, 3),
        "forward_only_vs_raw_forward": round(forward_only / raw, 3),
        "engine_forward_share": round(ours["forward_share"], 3),
        "engine_steps": ours["num_steps"],
        "mean_decode_batch": round(ours["tokens"] / ours["num_steps"], 1),
        "ttft_p50_ms": round(ours["ttft_p50_ms"], 1),
        "ttft_p99_ms": round(ours["ttft_p99_ms"], 1),
        "itl_p50_ms": round(ours["itl_p50_ms"], 1),
        "itl_p99_ms": round(ours["itl_p99_ms"], 1),
        "peak_rss_mb": round(peak_rss_mb, 1),
        "num_preemptions": engine.stats.num_preemptions,
    }
    if model is None:
        return result
    seq, static = _median_run(seq_runs), _median_run(static_runs)
    same = min(
        sum(a == b for a, b in zip(run["outputs"], hf["outputs"], strict=True))
        for run, hf in zip(runs, seq_runs, strict=True)
    )
    result.update(
        {
            "hf_sequential_tokens_per_s": round(seq["tokens_per_s"], 1),
            "hf_sequential_tokens_per_s_runs": _rates(seq_runs),
            "hf_static_batch_tokens_per_s": round(static["tokens_per_s"], 1),
            "hf_static_batch_tokens_per_s_runs": _rates(static_runs),
            "hf_static_batch_size": max_num_seqs,
            "speedup_vs_hf_sequential": _median_ratio(runs, seq_runs),
            "speedup_vs_hf_static_batch": _median_ratio(runs, static_runs),
            "outputs_identical_to_hf": f"{same}/{len(work)}",
        }
    )
    return result


def _greedy_batch1(engine: LLMEngine, prompts: list[list[int]], num_tokens: int) -> tuple[list[list[int]], float]:
    outputs = []
    started = time.perf_counter()
    for prompt in prompts:
        outputs.append(run_engine_workload(engine, [(prompt, num_tokens)])["outputs"][0])
    return outputs, time.perf_counter() - started


def _forward_ms(runner: ModelRunner, num_tokens: int, context: int = 128, repeats: int = 40) -> float:
    """Best time of one forward feeding ``num_tokens`` tokens of one sequence after ``context`` cached ones."""
    table = list(range(-(-(context + num_tokens) // runner.block_size)))
    runner.execute([Feed(table, [1] * context, 0, 1)])
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        runner.execute([Feed(table, [1] * num_tokens, context, num_tokens)])
        best = min(best, time.perf_counter() - started)
    return best * 1000


def _speculation_costs(engine: LLMEngine) -> dict[str, Any]:
    """What a round of draft speculation costs here, in forwards of the bare model: the target's at one token,
    at 5 (a verification of 4 proposals: ``verify_cost_ratio``, the yardstick issue 42 set) and at the engine's
    largest k + 1, and the draft's at one token. Speculation pays when a verification costs about one plain forward
    (the weights stream from memory either way); where the forward is compute-bound instead, its cost grows with the
    tokens verified and caps the speedup."""
    assert engine.draft_runner is not None
    k = engine.config.num_speculative_tokens
    plain = _forward_ms(engine.runner, 1)
    verify = {n: _forward_ms(engine.runner, n) for n in sorted({5, k + 1})}
    draft = _forward_ms(engine.draft_runner, 1)
    return {
        "target_forward_ms": round(plain, 3),
        **{f"target_verify_{n}_tokens_ms": round(ms, 3) for n, ms in verify.items()},
        "draft_forward_ms": round(draft, 3),
        "verify_cost_ratio": round(verify[5] / plain, 2),
        "draft_cost_ratio": round(draft / plain, 3),
    }


SPEC_CONCURRENCY = (1, 2, 4, 8, 16, 64)
# Speculation must not lose more than this against plain decoding at batch 1 (the controller's promise, with the
# bench's own noise): ``never_slower_at_batch_1`` is false, and ``tierline bench spec`` fails, below it.
NEVER_SLOWER_TOLERANCE = 0.98


def spec_prompts(engine: LLMEngine, pool: int, num_prompts: int = 8, seed: int = 1) -> list[list[int]]:
    """``bench spec``'s prompts: held-out text of 64-192 tokens, the first ``num_prompts`` of a pool of ``pool``."""
    work = _workload(_corpus_ids(engine), pool, (64, 192), (1, 1), seed, engine.max_model_len)
    return [p for p, _ in work][:num_prompts]


def _spec_workload(prompts: list[list[int]], concurrency: int, num_tokens: int) -> list[list[tuple[list[int], int]]]:
    """Batches of requests arriving together: at concurrency 1 each prompt alone, in turn; above, ``concurrency``
    requests at once (the prompts cycled)."""
    if concurrency == 1:
        return [[(p, num_tokens)] for p in prompts]
    return [[(prompts[i % len(prompts)], num_tokens) for i in range(concurrency)]]


_RUNS = itertools.count()


def _run_batches(
    engine: LLMEngine, batches: list[list[tuple[list[int], int]]], repeats: int = 1
) -> tuple[list[list[int]], float]:
    """Each batch after the last (its requests at once), ``repeats`` times; every output, and tokens a second over
    all. Each run has a prefix-cache salt of its own: a run does not reuse prompts an earlier run of the engine left
    in its cache (what it could keep would depend on its KV capacity, which a draft model shares, not on its
    decoding), while requests of one run share their prefixes as they would anywhere."""
    outputs: list[list[int]] = []
    tokens = 0
    started = time.perf_counter()
    for _ in range(repeats):
        salt = f"spec-run-{next(_RUNS)}"
        for work in batches:
            run = run_engine_workload(engine, work, cache_salt=salt)
            outputs += run["outputs"]
            tokens += run["tokens"]
    return outputs, tokens / (time.perf_counter() - started)


# A sweep cell's sample (one engine's run of it in a round) lasts at least about this long: a batch of 2-16 requests
# of 96 tokens takes 0.1-0.5 s on a CPU, and a host's hiccup is a large share of that (two identical plain engines
# differed by 0.58-1.22x a round at 8 concurrent); its batch is run again, as a fresh workload, until it does.
MIN_SAMPLE_SECONDS = 1.0


def spec_sweep(
    engines: dict[str, LLMEngine],
    prompts: list[list[int]],
    num_tokens: int,
    concurrency: tuple[int, ...] = SPEC_CONCURRENCY,
    rounds: int = 3,
) -> dict[int, dict[str, Any]]:
    """Tokens per second of each engine ("plain" first) at each concurrency: every engine once a round at each
    concurrency, in turn, the order reversed every other round (a host whose speed drifts within a round favours
    neither the first nor the last); medians over the rounds, the ratios against plain the median of the rounds' own
    ratios (and their range), and whether every output equals plain's (greedy). A cell's batch runs ``repeats``
    times in an engine's sample (``MIN_SAMPLE_SECONDS``). Per speculating engine also what it did in the last round,
    once its controller had learnt the earlier ones: its speculative steps against all its steps, and the tokens its
    draft caught up on."""
    rates: dict[tuple[int, str], list[float]] = {}
    identical: dict[tuple[int, str], bool] = {}
    last: dict[tuple[int, str], dict[str, int]] = {}
    repeats: dict[int, int] = {}
    for r in range(rounds):
        for c in concurrency:
            batches = _spec_workload(prompts, c, num_tokens)
            if c not in repeats:  # (sized on a plain run before the first round's)
                started = time.perf_counter()
                _run_batches(engines["plain"], batches)
                repeats[c] = max(1, math.ceil(MIN_SAMPLE_SECONDS / (time.perf_counter() - started)))
            outputs: dict[str, list[list[int]]] = {}
            for name in list(engines) if r % 2 == 0 else list(engines)[::-1]:
                stats = engines[name].stats
                before = (stats.num_steps, sum(stats.spec_steps.values()), stats.draft_catch_up_tokens)
                outputs[name], rate = _run_batches(engines[name], batches, repeats[c])
                rates.setdefault((c, name), []).append(rate)
                after = (stats.num_steps, sum(stats.spec_steps.values()), stats.draft_catch_up_tokens)
                steps, spec_steps, catch_up = (a - b for a, b in zip(after, before, strict=True))
                last[(c, name)] = {"steps": steps, "spec_steps": spec_steps, "catch_up_tokens": catch_up}
            for name in list(engines)[1:]:
                identical[(c, name)] = identical.get((c, name), True) and outputs[name] == outputs["plain"]
    sweep: dict[int, dict[str, Any]] = {}
    for c in concurrency:
        row: dict[str, Any] = {name: round(statistics.median(rates[(c, name)]), 1) for name in engines}
        for name in list(engines)[1:]:
            ratios = [a / b for a, b in zip(rates[(c, name)], rates[(c, "plain")], strict=True)]
            row[f"{name}_x"] = round(statistics.median(ratios), 3)
            row[f"{name}_x_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
            if name in METHODS:
                row[f"{name}_last_round"] = last[(c, name)]
        row["outputs_identical"] = all(identical[(c, name)] for name in list(engines)[1:])
        row["repeats"] = repeats[c]
        sweep[c] = row
    return sweep


def bench_spec(
    zoo_root: Path,
    num_prompts: int = 8,
    num_tokens: int = 96,
    seed: int = 1,
    concurrency: tuple[int, ...] = SPEC_CONCURRENCY,
    rounds: int = 5,
) -> dict[str, Any]:
    """Plain decoding, draft-model and n-gram speculation (adaptive) at each concurrency, side by side; at batch 1
    also the edge LM as the draft and transformers assisted generation; the cost of a verification in forwards."""
    target, draft = _lm(zoo_root, "lm-cloud"), _lm(zoo_root, "lm-draft")
    plain = LLMEngine(EngineConfig(target, kv_cache_bytes=KV_BYTES))
    prompts = spec_prompts(plain, max(num_prompts, max(concurrency)), num_prompts, seed)
    engines = {
        "plain": plain,
        "draft": LLMEngine(EngineConfig(target, draft_model_dir=draft, kv_cache_bytes=KV_BYTES)),
        "ngram": LLMEngine(EngineConfig(target, speculation="ngram", kv_cache_bytes=KV_BYTES)),
        # An A/A control: a second plain engine. Two identical engines doing the same work differ by what the host
        # and the memory each got make of them (up to ~10 % a round here); a method is judged against that.
        "plain_again": LLMEngine(EngineConfig(target, kv_cache_bytes=KV_BYTES)),
    }
    for engine in engines.values():  # warm up (the kernels, the allocator; the controller's first plain steps)
        _run_batches(engine, _spec_workload(prompts[:1], 1, 8))
    sweep = spec_sweep(engines, prompts, num_tokens, concurrency, rounds)
    draft_engine, ngram_engine = engines["draft"], engines["ngram"]
    batch1 = _spec_workload(prompts, 1, num_tokens)
    # The same with the edge LM as it is, before distillation towards the target, as the draft.
    edge_engine = LLMEngine(EngineConfig(target, draft_model_dir=_lm(zoo_root, "lm-edge"), kv_cache_bytes=KV_BYTES))
    _run_batches(edge_engine, _spec_workload(prompts[:1], 1, 8))
    edge_out, edge_rate = _run_batches(edge_engine, batch1)
    base, plain_rate = _run_batches(plain, batch1)
    edge_stats = edge_engine.stats
    del edge_engine
    hf_t = _hf_assisted(target, draft, prompts, num_tokens)
    one = sweep[concurrency[0]]
    result: dict[str, Any] = {
        "num_prompts": num_prompts,
        "tokens_per_prompt": num_tokens,
        "rounds": rounds,
        **{f"at_{c}_concurrent": row for c, row in sweep.items()},
        "plain_tokens_per_s": one["plain"],
        "spec_tokens_per_s": one["draft"],
        "ngram_tokens_per_s": one["ngram"],
        "hf_assisted_tokens_per_s": round(num_prompts * num_tokens / hf_t, 1),
        "acceptance_rate": _acceptance(draft_engine, "draft"),
        "ngram_acceptance_rate": _acceptance(ngram_engine, "ngram"),
        "speedup": one["draft_x"],
        "ngram_speedup": one["ngram_x"],
        "plain_step_ms": round(1000 / one["plain"], 3),  # the engine's whole step, forward and the rest
        **_speculation_costs(draft_engine),
        # The undistilled edge LM as the draft (one run, beside one more plain run): what distillation adds.
        "edge_draft_tokens_per_s": round(edge_rate, 1),
        "edge_draft_acceptance_rate": round(
            edge_stats.spec_accepted.get("draft", 0) / max(1, edge_stats.spec_proposed.get("draft", 0)), 3
        ),
        "edge_draft_speedup": round(edge_rate / plain_rate, 2),
        "outputs_identical": all(row["outputs_identical"] for row in sweep.values()) and edge_out == base,
    }
    if 16 in sweep:
        result["spec_speedup_at_16"] = sweep[16]["draft_x"]
    if 1 in sweep:
        worst = min(sweep[1]["draft_x"], sweep[1]["ngram_x"])
        result["never_slower_at_batch_1"] = worst >= NEVER_SLOWER_TOLERANCE
    result["slower_than_plain"] = slower_than_plain(result)
    result["never_slower"] = not result["slower_than_plain"]
    return result


def slower_than_plain(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Where ``bench spec``'s sweep broke the promise: a method more than 2 % slower than plain decoding at a
    concurrency (``NEVER_SLOWER_TOLERANCE``), and slower than the A/A control (a second plain engine, where the sweep
    ran one: ``plain_again_x``) by as much — what two identical engines differ by is not speculation's doing."""
    lost = []
    for key, row in result.items():
        if key.startswith("at_") and key.endswith("_concurrent"):
            floor = NEVER_SLOWER_TOLERANCE * min(1.0, row.get("plain_again_x", 1.0))
            for method in METHODS:
                if row[f"{method}_x"] < floor:
                    lost.append({"concurrency": int(key[3:-11]), "method": method, "x_plain": row[f"{method}_x"]})
    return sorted(lost, key=lambda x: (x["concurrency"], x["method"]))


def _acceptance(engine: LLMEngine, method: str) -> float:
    proposed = engine.stats.spec_proposed.get(method, 0)
    return round(engine.stats.spec_accepted.get(method, 0) / proposed, 3) if proposed else 0.0


@torch.inference_mode()
def _hf_assisted(target: Path, draft: Path, prompts: list[list[int]], num_tokens: int) -> float:
    model, assistant = _hf_model(target), _hf_model(draft)
    started = time.perf_counter()
    for prompt in prompts:
        ids = torch.tensor([prompt])
        model.generate(
            ids,
            assistant_model=assistant,
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return time.perf_counter() - started


def bench_prefix(zoo_root: Path, num_requests: int = 16, system_tokens: int = 448, seed: int = 2) -> dict[str, Any]:
    """Requests arrive one after another, each a shared system prompt plus its own short question."""
    model_dir = _lm(zoo_root, "lm-cloud")
    results: dict[str, Any] = {}
    for caching in (False, True):
        engine = LLMEngine(EngineConfig(model_dir, kv_cache_bytes=KV_BYTES, enable_prefix_caching=caching))
        corpus = _corpus_ids(engine)
        system_prompt = corpus[:system_tokens]
        suffixes = [p for p, _ in _workload(corpus, num_requests + 1, (8, 24), (1, 1), seed)]
        run_engine_workload(engine, [(system_prompt + suffixes[-1], 1)])  # warm-up (and, with caching, fill)
        ttfts = [run_engine_workload(engine, [(system_prompt + s, 1)])["ttft_p50_ms"] for s in suffixes[:-1]]
        results["with_cache" if caching else "without_cache"] = statistics.median(ttfts)
        if caching:
            results["prefix_cache_hit_rate"] = round(engine.block_manager.prefix_cache_hit_rate(), 3)
    return {
        "system_prompt_tokens": system_tokens,
        "num_requests": num_requests,
        "ttft_ms_without_prefix_cache": round(results["without_cache"], 2),
        "ttft_ms_with_prefix_cache": round(results["with_cache"], 2),
        "ttft_speedup": round(results["without_cache"] / results["with_cache"], 2),
        "prefix_cache_hit_rate": results["prefix_cache_hit_rate"],
    }


# bench engine --vs llamacpp over HTTP: the concurrency levels (llama-server's --parallel at each), tokens a request.
HTTP_LEVELS = (1, 16, 64)
HTTP_TOKENS = 128


def bench_engine_vs_llamacpp(
    zoo_root: Path,
    num_requests: int = 64,
    max_num_seqs: int = 64,
    seed: int = 0,
    rounds: int = 3,
    batch1_requests: int = 8,
    http_levels: tuple[int, ...] | None = HTTP_LEVELS,
    http_tokens: int = HTTP_TOKENS,
) -> dict[str, Any]:
    """This engine beside llama.cpp on lm-cloud's GGUF exports of the same weights: the same token-id requests
    (``bench engine``'s mix of prompt and output lengths), greedy, all ``num_requests`` at once (llama.cpp with a
    slot per request, as ``llama-server --parallel``, in process like the engine: no HTTP on either side) and the
    first ``batch1_requests`` one at a time. Contenders alternate within each round; rates are the median round's,
    ratios the median of the rounds' own ratios. llama.cpp's f32 outputs must be the engine's token for token.

    Then, unless ``http_levels`` is None, ``llama_server``: llama.cpp's own server against ``tierline engine
    serve``, both over HTTP (:func:`bench_http_vs_llama_server`), or why it was skipped."""
    from bench.llamacpp import LlamaCppBatch, gguf_path, timed_generate

    model_dir = _lm(zoo_root, "lm-cloud")
    threads = torch.get_num_threads()
    engine = LLMEngine(
        EngineConfig(model_dir, kv_cache_bytes=KV_BYTES, max_num_seqs=max_num_seqs, max_num_batched_tokens=2048)
    )
    max_len = engine.max_model_len
    work = _workload(_corpus_ids(engine), num_requests, (16, 256), (16, 128), seed, max_len)
    alone = work[:batch1_requests]
    peers = {
        "f32": LlamaCppBatch(gguf_path(zoo_root, "lm-cloud", "f32"), max_num_seqs, max_len, threads),
        "f32_1": LlamaCppBatch(gguf_path(zoo_root, "lm-cloud", "f32"), 1, max_len, threads),
        "q8_0_1": LlamaCppBatch(gguf_path(zoo_root, "lm-cloud", "q8_0"), 1, max_len, threads),
    }
    # The engine again with weight-only int8 (``cpu_weights``), batch 1 only: beside llama.cpp's Q8_0.
    int8 = LLMEngine(EngineConfig(model_dir, kv_cache_bytes=KV_BYTES, max_num_seqs=1, cpu_weights="int8"))
    run_engine_workload(engine, work[:4], cache_salt="warm-up")
    run_engine_workload(int8, work[:1], cache_salt="warm-up")
    for name, peer in peers.items():
        peer.generate(work[:4] if name == "f32" else work[:1])
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in ("ours", "ours_1", "int8_1", "f32", "f32_1", "q8_0_1")}
    for r in range(rounds):
        runs["ours"].append(run_engine_workload(engine, work, cache_salt=f"round-{r}"))
        runs["f32"].append(timed_generate(peers["f32"], work, one_at_a_time=False))
        started = time.perf_counter()
        outs = [run_engine_workload(engine, [w], cache_salt=f"round-{r}-1")["outputs"][0] for w in alone]
        seconds = time.perf_counter() - started
        tokens = sum(map(len, outs))
        runs["ours_1"].append({"tokens_per_s": tokens / seconds, "outputs": outs})
        runs["f32_1"].append(timed_generate(peers["f32_1"], alone, one_at_a_time=True))
        runs["q8_0_1"].append(timed_generate(peers["q8_0_1"], alone, one_at_a_time=True))
        started = time.perf_counter()
        outs = [run_engine_workload(int8, [w], cache_salt=f"round-{r}-1")["outputs"][0] for w in alone]
        runs["int8_1"].append({"tokens_per_s": sum(map(len, outs)) / (time.perf_counter() - started), "outputs": outs})
    for peer in peers.values():
        peer.close()
    ours = runs["ours"][0]["outputs"]
    same = min(sum(a == b for a, b in zip(run["outputs"], ours, strict=True)) for run in runs["f32"])
    same_1 = min(sum(a == b for a, b in zip(run["outputs"], ours, strict=False)) for run in runs["f32_1"])
    q8_same = sum(a == b for a, b in zip(runs["q8_0_1"][0]["outputs"], ours, strict=False))
    int8_same = sum(a == b for a, b in zip(runs["int8_1"][0]["outputs"], ours, strict=False))
    del int8
    prompt_tokens = sum(len(p) for p, _ in work)
    http: dict[str, Any] | None = None
    if http_levels is not None:
        del engine  # its KV cache and threads: the servers have the host to themselves
        prompts = [p for p, _ in work]
        http = bench_http_vs_llama_server(
            zoo_root, prompts, http_levels, http_tokens, rounds, threads, max_len, batch1_requests
        )
    result: dict[str, Any] = {
        "bench": "engine-vs-llamacpp",
        "model": str(model_dir),
        "peer": "llama.cpp via llama-cpp-python (in process, greedy), the zoo's GGUF exports",
        "threads": threads,
        "rounds": rounds,
        "concurrent": {
            "requests": num_requests,
            "slots": max_num_seqs,
            "prompt_tokens": prompt_tokens,
            "generated_tokens": sum(n for _, n in work),
            "tierline_tokens_per_s": round(_median_run(runs["ours"])["tokens_per_s"], 1),
            "tierline_tokens_per_s_runs": _rates(runs["ours"]),
            "llamacpp_f32_tokens_per_s": round(_median_run(runs["f32"])["tokens_per_s"], 1),
            "llamacpp_f32_tokens_per_s_runs": _rates(runs["f32"]),
            "ratio_vs_llamacpp_f32": _median_ratio(runs["ours"], runs["f32"]),
            "outputs_identical_f32": f"{same}/{len(work)}",
        },
        "batch1": {
            "requests": len(alone),
            "tierline_tokens_per_s": round(_median_run(runs["ours_1"])["tokens_per_s"], 1),
            "tierline_tokens_per_s_runs": _rates(runs["ours_1"]),
            "llamacpp_f32_tokens_per_s": round(_median_run(runs["f32_1"])["tokens_per_s"], 1),
            "llamacpp_f32_tokens_per_s_runs": _rates(runs["f32_1"]),
            "llamacpp_q8_0_tokens_per_s": round(_median_run(runs["q8_0_1"])["tokens_per_s"], 1),
            "llamacpp_q8_0_tokens_per_s_runs": _rates(runs["q8_0_1"]),
            "ratio_vs_llamacpp_f32": _median_ratio(runs["ours_1"], runs["f32_1"]),
            "ratio_vs_llamacpp_q8_0": _median_ratio(runs["ours_1"], runs["q8_0_1"]),
            "outputs_identical_f32": f"{same_1}/{len(alone)}",
            # Q8_0 rounds its weights: its greedy path may leave f32's at a near-tie.
            "outputs_identical_q8_0": f"{q8_same}/{len(alone)}",
            # The engine with cpu_weights=int8 (weight-only int8, one scale per output column) beside Q8_0.
            "tierline_int8_tokens_per_s": round(_median_run(runs["int8_1"])["tokens_per_s"], 1),
            "tierline_int8_tokens_per_s_runs": _rates(runs["int8_1"]),
            "int8_ratio_vs_llamacpp_q8_0": _median_ratio(runs["int8_1"], runs["q8_0_1"]),
            "int8_ratio_vs_tierline_fp32": _median_ratio(runs["int8_1"], runs["ours_1"]),
            "outputs_identical_int8_vs_fp32": f"{int8_same}/{len(alone)}",
        },
    }
    if http is not None:
        result["llama_server"] = http
    return result


def bench_http_vs_llama_server(
    zoo_root: Path,
    prompts: list[list[int]],
    levels: tuple[int, ...] = HTTP_LEVELS,
    num_tokens: int = HTTP_TOKENS,
    rounds: int = 3,
    threads: int | None = None,
    max_len: int | None = None,
    batch1_requests: int = 8,
) -> dict[str, Any]:
    """``llama-server`` (llama.cpp's C++ server, ``make llama-server``) on lm-cloud's f32 GGUF against ``tierline
    engine serve`` on lm-cloud, both over HTTP on 127.0.0.1 with ``threads`` compute threads each: the same
    token-id ``prompts``, ``num_tokens`` greedy tokens each (``ignore_eos``; fewer where the context ends first).
    At each level ``c`` of ``levels``: 1 is ``batch1_requests`` requests one after another, above ``c`` requests
    at once; llama-server runs with ``--parallel c`` (a server per level, continuous batching), the engine with
    ``max_num_seqs`` the largest level. Every level of both servers once a round, the order flipped each round;
    tokens/s from the answers' completion counts over each level's wall time, medians over rounds, ratios the
    median of the rounds' own. ``outputs_identical``: answers whose text is the same on both servers. Skipped,
    saying why, where llama-server is not built."""
    from bench.common import free_port, tierline_server
    from bench.llama_server import (
        llama_server,
        llama_server_binary,
        llama_server_command,
        llama_server_version,
        missing_reason,
        run_http_level,
    )
    from bench.llamacpp import gguf_path

    if (reason := missing_reason()) is not None:
        return {"skipped": reason}
    model_dir = _lm(zoo_root, "lm-cloud")
    threads = threads or torch.get_num_threads()
    if max_len is None:
        max_len = int(json.loads((model_dir / "config.json").read_text())["max_position_embeddings"])
    binary, gguf = llama_server_binary(), gguf_path(zoo_root, "lm-cloud", "f32")
    slots_len = max(len(p) for p in prompts) + num_tokens
    slots_len = min(max_len, -(-slots_len // 256) * 256)

    def level_work(c: int) -> list[tuple[list[int], int]]:
        chosen = prompts[:batch1_requests] if c == 1 else [prompts[i % len(prompts)] for i in range(c)]
        return [(p, max(1, min(num_tokens, max_len - len(p)))) for p in chosen]

    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERLINE_CLOUD_")}
    engine_env = {
        "TIERLINE_CLOUD_NUM_THREADS": str(threads),
        "TIERLINE_CLOUD_MAX_NUM_SEQS": str(max(levels)),
        "TIERLINE_CLOUD_MAX_NUM_BATCHED_TOKENS": "2048",
        "TIERLINE_CLOUD_KV_CACHE_MB": str(KV_BYTES >> 20),
        "TIERLINE_CLOUD_SPECULATION": "off",
        "TIERLINE_LOG_LEVEL": "WARNING",
    }
    engine_args = ["engine", "serve", "--model", str(model_dir), "--name", "lm-cloud"]
    tierline_args = ["tierline", *engine_args, "--port", "PORT"]
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    commands: dict[str, str] = {}
    load_before = os.getloadavg()[0]
    with ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="llama-server-")))
        eport = free_port()
        stack.enter_context(tierline_server(engine_args, env | engine_env, eport, "/health"))
        urls = {"tierline": f"http://127.0.0.1:{eport}"}
        for c in levels:
            port = free_port()
            cmd = llama_server_command(binary, gguf, port, c, slots_len, threads)
            stack.enter_context(llama_server(cmd, port, logs / f"np{c}.log"))
            commands[str(c)] = shlex.join(cmd)
            urls[f"llama-server-{c}"] = f"http://127.0.0.1:{port}"
        warm = level_work(1)[:1]
        run_http_level(urls["tierline"], "tierline", warm, 1, "lm-cloud", "warm-up")
        for c in levels:
            run_http_level(urls[f"llama-server-{c}"], "llama-server", warm, 1)
        for r in range(rounds):
            for c in levels:
                work = level_work(c)
                order = ["tierline", "llama-server"] if r % 2 == 0 else ["llama-server", "tierline"]
                for kind in order:
                    url = urls["tierline"] if kind == "tierline" else urls[f"llama-server-{c}"]
                    runs.setdefault((c, kind), []).append(
                        run_http_level(url, kind, work, c, "lm-cloud", salt=f"round-{r}-{c}")
                    )
    result: dict[str, Any] = {
        "peer": "llama-server (llama.cpp's C++ server, make llama-server), f32 GGUF, over HTTP (/completion)",
        "llama_server_version": llama_server_version(binary),
        # make llama-server compiles it from the vendored llama.cpp of the pinned llama-cpp-python's sdist
        "llama_server_sources": f"llama-cpp-python {importlib.metadata.version('llama-cpp-python')} vendor/llama.cpp",
        "llama_server_commands": commands,
        "tierline_command": " ".join([*(f"{k}={v}" for k, v in engine_env.items()), shlex.join(tierline_args)]),
        "threads": threads,
        "new_tokens": num_tokens,
        "rounds": rounds,
        "load_avg_1m_before": round(load_before, 2),
        "load_avg_1m_after": round(os.getloadavg()[0], 2),
    }
    for c in levels:
        ours, theirs = runs[(c, "tierline")], runs[(c, "llama-server")]
        pairs = zip(ours, theirs, strict=True)
        same = min(sum(a == b for a, b in zip(x["outputs"], y["outputs"], strict=True)) for x, y in pairs)
        result["at_1" if c == 1 else f"at_{c}_concurrent"] = {
            "requests": len(ours[0]["outputs"]),
            "generated_tokens": ours[0]["tokens"],
            "tierline_tokens_per_s": round(_median_run(ours)["tokens_per_s"], 1),
            "tierline_tokens_per_s_runs": _rates(ours),
            "llama_server_tokens_per_s": round(_median_run(theirs)["tokens_per_s"], 1),
            "llama_server_tokens_per_s_runs": _rates(theirs),
            "ratio_vs_llama_server": _median_ratio(ours, theirs),
            "outputs_identical": f"{same}/{len(ours[0]['outputs'])}",
        }
    return result

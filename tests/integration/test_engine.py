"""The LLM engine end to end on the test zoo's LMs: offline API, sampling, speculation, preemption,
prefix caching across tenants, the async engine, and bad input."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from cloud.engine import LLM, AsyncLLMEngine, EngineConfig, SamplingParams
from cloud.engine.llm_engine import LLMEngine
from cloud.engine.model_config import ModelConfig
from cloud.engine.model_runner import ModelRunner
from cloud.engine.outputs import RequestOutput
from cloud.engine.scheduler import QueueFull
from cloud.engine.tokenizer import ChatTokenizer, IncrementalDetokenizer
from shared.errors import ValidationError
from shared.zoo.registry import ZooLayout

PROMPTS = ["def main(argv):\n", "import os\n\n\nclass Config:\n    ", "    for i in range(len(", "# Copyright"]
KV = 16 << 20


@pytest.fixture(scope="module")
def lm_dirs(tiny_zoo: Path) -> tuple[Path, Path]:
    layout = ZooLayout(tiny_zoo)
    return layout.artifact_dir("lm-cloud"), layout.artifact_dir("lm-draft")


@pytest.fixture(scope="module")
def llm(lm_dirs: tuple[Path, Path]) -> LLM:
    return LLM(lm_dirs[0], kv_cache_bytes=KV)


def greedy(max_tokens: int = 24, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)  # type: ignore[arg-type]


def test_greedy_output_equals_transformers_generate(llm: LLM, lm_dirs: tuple[Path, Path]) -> None:
    outs = llm.generate(PROMPTS, greedy(24))
    hf = AutoModelForCausalLM.from_pretrained(lm_dirs[0], dtype=torch.float32).eval()
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = torch.tensor([llm.tokenizer.encode(prompt)])
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0)
        assert out.token_ids == ref[0, ids.shape[1] :].tolist()
        assert out.finish_reason == "length"
        assert out.text == llm.tokenizer.decode(out.token_ids)
        assert out.usage.prompt_tokens == ids.shape[1] and out.usage.completion_tokens == 24


def test_speculative_greedy_is_token_for_token_identical(llm: LLM, lm_dirs: tuple[Path, Path]) -> None:
    base = [o.token_ids for o in llm.generate(PROMPTS, greedy(40))]
    for kwargs in ({"draft_model_dir": lm_dirs[1]}, {"speculation": "ngram"}):
        spec = LLM(lm_dirs[0], kv_cache_bytes=KV, adaptive_speculation=False, **kwargs)
        outs = spec.generate(PROMPTS, greedy(40))
        assert [o.token_ids for o in outs] == base, kwargs
        stats = spec.engine.stats
        method = "draft" if "draft_model_dir" in kwargs else "ngram"
        assert stats.spec_proposed.get(method, 0) > 0, "speculation never ran"
        assert sum(o.outputs[0].num_spec_proposed for o in outs) == stats.spec_proposed[method]


def test_seeded_sampling_is_reproducible_and_n_outputs_differ(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=20, seed=7, n=3, ignore_eos=True)
    a = llm.generate(PROMPTS[:2], params)
    b = llm.generate(PROMPTS[:2], params)
    assert [[c.token_ids for c in o.outputs] for o in a] == [[c.token_ids for c in o.outputs] for o in b]
    first = a[0].outputs
    assert len(first) == 3 and len({tuple(c.token_ids) for c in first}) > 1
    assert a[0].usage.completion_tokens == 60
    other = llm.generate(PROMPTS[:1], SamplingParams(temperature=1.0, max_tokens=20, seed=8, ignore_eos=True))
    assert other[0].token_ids != first[0].token_ids


def test_stop_strings_stop_tokens_and_logprobs(llm: LLM) -> None:
    free = llm.generate(PROMPTS[0], greedy(30))[0]
    stop_text = free.text[5:8]
    assert stop_text
    cut = llm.generate(PROMPTS[0], greedy(30, stop=[stop_text]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.index(stop_text)]
    stop_id = free.token_ids[4]
    by_id = llm.generate(PROMPTS[0], greedy(30, stop_token_ids=[stop_id]))[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]
    with_lp = llm.generate(PROMPTS[0], greedy(10, logprobs=3))[0]
    lps = with_lp.outputs[0].logprobs
    assert lps is not None and len(lps) == 10
    for tok, lp in zip(with_lp.token_ids, lps, strict=True):
        assert lp.token_id == tok and lp.logprob <= 0.0
        assert len(lp.top) == 3 and lp.top[0][0] == tok  # greedy picks the top token
        assert lp.top[0][1] == pytest.approx(lp.logprob)


def test_bad_input_is_refused_with_the_field_named(llm: LLM) -> None:
    limit = llm.engine.max_model_len
    with pytest.raises(ValidationError, match="maximum context length") as exc:
        llm.generate([[5] * limit], greedy(1))
    assert exc.value.param == "prompt"
    with pytest.raises(ValidationError, match="maximum context length") as exc:
        llm.generate(PROMPTS[0], greedy(limit))
    assert exc.value.param == "max_tokens"
    for field, value in (("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("n", 0)):
        with pytest.raises(ValidationError) as exc:
            SamplingParams(**{field: value})  # type: ignore[arg-type]
        assert exc.value.param == field and field in exc.value.message
    with pytest.raises(ValidationError, match="token ids"):
        llm.generate([[10**9]], greedy(1))
    assert not llm.engine.has_unfinished_requests()


def test_preemption_under_a_small_kv_budget_loses_nothing(lm_dirs: tuple[Path, Path], llm: LLM) -> None:
    """Many long requests into a cache that holds a few: they queue, get preempted and recomputed, and
    every output equals the unconstrained engine's."""
    prompts = [p * 3 for p in PROMPTS] * 6
    expected = [o.token_ids for o in llm.generate(prompts, greedy(60))]
    block_bytes = ModelRunner.kv_bytes_per_block(ModelConfig.from_dir(lm_dirs[0]), 8, torch.float32)
    small = LLM(lm_dirs[0], kv_cache_bytes=48 * block_bytes, max_num_seqs=24, max_num_batched_tokens=256, block_size=8)
    assert small.engine.num_blocks == 48
    outs = small.generate(prompts, greedy(60))
    assert [o.token_ids for o in outs] == expected
    assert small.engine.stats.num_preemptions > 0
    assert small.engine.block_manager.num_free_blocks == small.engine.num_blocks


def test_prefix_cache_is_shared_within_a_tenant_but_not_across(llm: LLM) -> None:
    system = "You are a careful assistant that writes Python. " * 6
    first = llm.generate(system + "Q1", greedy(4), cache_salt="tenant-a")[0]
    same = llm.generate(system + "Q2", greedy(4), cache_salt="tenant-a")[0]
    other = llm.generate(system + "Q2", greedy(4), cache_salt="tenant-b")[0]
    assert first.usage.cached_tokens == 0
    assert same.usage.cached_tokens >= 32
    assert other.usage.cached_tokens == 0
    assert other.token_ids == same.token_ids


def test_five_hundred_concurrent_requests_fit_a_fixed_budget(lm_dirs: tuple[Path, Path]) -> None:
    engine = LLMEngine(EngineConfig(lm_dirs[0], kv_cache_bytes=2 << 20, max_num_seqs=64, block_size=8))
    for i in range(500):
        engine.add_request(f"r{i}", PROMPTS[i % 4] + str(i), greedy(8))
    finished = 0
    while engine.has_unfinished_requests():
        finished += sum(o.finished for o in engine.step())
        assert engine.block_manager.num_free_blocks >= 0
    assert finished == 500
    assert engine.block_manager.num_free_blocks == engine.num_blocks


def test_time_in_queue_is_arrival_to_first_scheduled(lm_dirs: tuple[Path, Path]) -> None:
    """One sequence at a time: the second request waits in the queue until the first has finished, so its time in
    queue covers the first's whole engine latency; the first was scheduled in the step it arrived for."""
    engine = LLMEngine(EngineConfig(lm_dirs[0], kv_cache_bytes=KV, max_num_seqs=1, block_size=8))
    arrival = time.monotonic()  # one arrival for both: the second's queue time then spans the first's latency
    engine.add_request("a", PROMPTS[0], greedy(6), arrival_time=arrival)
    engine.add_request("b", PROMPTS[1], greedy(6), arrival_time=arrival)
    first: dict[str, RequestOutput] = {}
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            first.setdefault(out.request_id, out)
            if out.finished:
                final[out.request_id] = out
    a, b = first["a"].queue_s, first["b"].queue_s
    assert a is not None and b is not None and final["a"].engine_s is not None
    assert a <= (first["a"].ttft_s or 0.0)
    assert b >= final["a"].engine_s > a
    assert all(o.queue_s == first[o.request_id].queue_s for o in final.values())  # a request's, on every update


def test_queue_bound_raises_queue_full(lm_dirs: tuple[Path, Path]) -> None:
    engine = LLMEngine(EngineConfig(lm_dirs[0], kv_cache_bytes=KV, max_num_queued_requests=3))
    for i in range(3):
        engine.add_request(f"r{i}", PROMPTS[0], greedy(4))
    with pytest.raises(QueueFull) as exc:
        engine.add_request("r3", PROMPTS[0], greedy(4))
    assert exc.value.status_code == 429 and exc.value.retry_after > 0
    assert engine.num_unfinished_requests == 3


def test_async_engine_streams_deltas_and_cancellation_frees_blocks(lm_dirs: tuple[Path, Path]) -> None:
    async def main() -> None:
        cloud = AsyncLLMEngine.from_config(EngineConfig(lm_dirs[0], kv_cache_bytes=KV))
        edge = AsyncLLMEngine.from_config(EngineConfig(lm_dirs[1], kv_cache_bytes=KV))
        try:

            async def collect(engine: AsyncLLMEngine, prompt: str) -> tuple[str, str, int]:
                parts, last = [], None
                async for out in engine.generate(prompt, greedy(20)):
                    parts.append(out.outputs[0].delta_text)
                    last = out
                assert last is not None and last.finished
                return "".join(parts), last.text, last.usage.completion_tokens

            results = await asyncio.gather(*(collect(e, p) for p in PROMPTS for e in (cloud, edge)))
            for streamed, final, n in results:
                assert streamed == final and n == 20

            stream = cloud.generate(PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True))
            async for _ in stream:
                break
            await stream.aclose()
            for _ in range(50):
                metrics = await cloud.metrics()
                if metrics["num_running"] == 0:
                    break
                await asyncio.sleep(0.02)
            assert metrics["num_running"] == 0 and metrics["kv_cache_usage"] == 0.0

            with pytest.raises(ValidationError):
                async for _ in cloud.generate("x", SamplingParams(max_tokens=10**6)):
                    pass
        finally:
            cloud.shutdown()
            edge.shutdown()

    asyncio.run(main())


@pytest.mark.parametrize("stop", [[], ["wörld"], ["日本"], ["never-there"]])
def test_incremental_detokenizer_emits_whole_characters_and_never_part_of_a_stop_string(
    lm_dirs: tuple[Path, Path], stop: list[str]
) -> None:
    tokenizer = ChatTokenizer(lm_dirs[0])
    text = "héllo wörld — ünïcode ✓ 日本語 done\n    x = 1"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, stop)
    emitted, stopped = [], False
    for i in range(1, len(ids) + 1):
        delta, stopped = detok.update(ids[:i], is_final=i == len(ids))
        assert "\ufffd" not in delta
        emitted.append(delta)
        if stopped:
            break
    expected = text[: text.index(stop[0])] if stop and stop[0] in text else text
    assert "".join(emitted) == expected == detok.text
    assert stopped == bool(stop and stop[0] in text)


def _stream(engine: LLMEngine, params: SamplingParams) -> list[object]:
    """Every update of one request, its first to its last, stepping the engine by hand."""
    engine.add_request("r", PROMPTS[1], params)
    updates: list[object] = []
    while engine.has_unfinished_requests():
        updates.extend(engine.step())
    return updates


@pytest.mark.parametrize("interval", [3, 5])
def test_a_stream_interval_sends_fewer_updates_carrying_every_token_text_and_logprob(
    lm_dirs: tuple[Path, Path], interval: int
) -> None:
    every = LLMEngine(EngineConfig(lm_dirs[0], kv_cache_bytes=KV))
    coarse = LLMEngine(EngineConfig(lm_dirs[0], kv_cache_bytes=KV, stream_interval=interval))
    free = _stream(every, greedy(40))[-1]
    assert isinstance(free, RequestOutput)
    # A stop string that first appears mid-way: it ends the answer wherever its tokens fall into updates.
    stop = next(
        free.text[i : i + 3] for i in range(15, len(free.text) - 3) if free.text.index(free.text[i : i + 3]) == i
    )
    cases = (
        greedy(23, logprobs=2),
        SamplingParams(temperature=0.8, seed=7, max_tokens=30, n=2, ignore_eos=True),
        greedy(40, stop=[stop]),
    )
    for params in cases:
        fine_updates, coarse_updates = _stream(every, params), _stream(coarse, params)
        fine, last = fine_updates[-1], coarse_updates[-1]
        assert isinstance(fine, RequestOutput) and isinstance(last, RequestOutput) and last.finished
        # The same answer, in fewer updates: the first at once (time to first token), the last at once.
        assert [(c.text, c.token_ids, c.finish_reason) for c in last.outputs] == [
            (c.text, c.token_ids, c.finish_reason) for c in fine.outputs
        ]
        assert len(coarse_updates) < len(fine_updates)
        first = coarse_updates[0]
        assert isinstance(first, RequestOutput) and first.ttft_s is not None
        for index, choice in enumerate(last.outputs):
            deltas = [u.outputs[index] for u in coarse_updates if isinstance(u, RequestOutput)]
            assert "".join(d.delta_text for d in deltas) == choice.text
            assert [t for d in deltas for t in d.delta_token_ids] == choice.token_ids
            if choice.logprobs is not None:
                assert [lp for d in deltas for lp in d.delta_logprobs] == choice.logprobs
            # Between the first update and the last, none carries fewer than ``interval`` new tokens.
            middle = [len(d.delta_token_ids) for d in deltas[1:-1] if d.delta_token_ids]
            assert all(n >= interval for n in middle), middle
    with pytest.raises(ValueError, match="stream_interval"):
        EngineConfig(lm_dirs[0], stream_interval=0)

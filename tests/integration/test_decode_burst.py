"""Decode bursts (``EngineConfig.decode_burst_ms``): where every running sequence decodes greedily with nothing else
deciding its tokens and nothing waits, a step decodes several tokens a sequence in one fused call. The demo cloud LM
on held-out text: the same tokens and finish reasons as step-by-step decoding, a stop token or a length limit inside
a burst ending the output where it would have, bursts in the plain steps of a speculating engine, no burst for a
request whose tokens need more than the argmax or while a request waits, and the burst's blocks published to the
prefix cache with the tokens they hold."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer

from cloud.engine import EngineConfig, SamplingParams
from cloud.engine.llm_engine import LLMEngine
from cloud.engine.outputs import RequestOutput
from shared.zoo.build import committed_weights
from shared.zoo.corpus import held_out_files
from shared.zoo.presets import DEMO

pytestmark = pytest.mark.integration
DEMO_LM = committed_weights(DEMO) / "lm-cloud"
BLOCK = 16


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tokenizer = Tokenizer.from_file(str(DEMO_LM / "tokenizer.json"))
    texts = [f.text for f in held_out_files()[:4]]
    ids = [tokenizer.encode(t).ids[: 37 + 21 * i] for i, t in enumerate(texts)]
    assert all(len(p) >= 37 for p in ids)
    return ids


def _engine(burst_ms: float) -> LLMEngine:
    # A budget far above a demo step's time: every burst is max_decode_burst long, whatever the host's speed.
    return LLMEngine(
        EngineConfig(DEMO_LM, kv_cache_bytes=32 << 20, num_threads=2, decode_burst_ms=burst_ms, max_decode_burst=8)
    )


def _run(engine: LLMEngine, work: list[tuple[str, list[int], SamplingParams]]) -> dict[str, RequestOutput]:
    for request_id, prompt, params in work:
        engine.add_request(request_id, prompt, params)
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return done


def _tokens(outs: dict[str, RequestOutput]) -> dict[str, tuple[list[int], str | None, int]]:
    return {k: (o.token_ids, o.outputs[0].finish_reason, o.usage.completion_tokens) for k, o in outs.items()}


def test_a_burst_gives_the_tokens_and_ends_of_step_by_step_decoding(
    two_threads: None, prompts: list[list[int]]
) -> None:
    """One request alone, then three together: greedy tokens, finish reasons and completion counts equal with
    bursts and without; a stop token met inside a burst and a max_tokens that is no multiple of the burst end the
    output where step-by-step decoding ends it; the bursts took most steps' place."""
    plain, burst = _engine(0.0), _engine(1000.0)
    long = SamplingParams(temperature=0.0, max_tokens=61, ignore_eos=True)
    reference = _tokens(_run(plain, [("alone", prompts[0], long)]))
    stop_at = reference["alone"][0][13]  # a token inside the second burst (8 a burst)
    first_stop = reference["alone"][0].index(stop_at)
    stopped = SamplingParams(temperature=0.0, max_tokens=61, ignore_eos=True, stop_token_ids=[stop_at])
    group = [
        ("a", prompts[1], long),
        ("b", prompts[2], SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True)),
        ("c", prompts[0], stopped),
    ]
    reference |= _tokens(_run(plain, group))
    steps_before = burst.stats.num_steps
    got = _tokens(_run(burst, [("alone", prompts[0], long)])) | _tokens(_run(burst, group))
    assert got == reference
    assert reference["alone"][1] == "length" and len(reference["alone"][0]) == 61 == reference["alone"][2]
    assert reference["c"][1] == "stop" and len(reference["c"][0]) == first_stop + 1
    assert plain.stats.decode_bursts == 0 and burst.stats.decode_bursts > 0
    # 61 tokens alone in bursts of 8: its first token from the prefill, then 60 in 8 bursts (the last cut to 4).
    assert burst.stats.num_steps - steps_before < plain.stats.num_steps / 3


@pytest.mark.parametrize(
    "params",
    [
        {"logprobs": 2},
        {"stop": ["\n"]},
        {"presence_penalty": 0.5},
        {"temperature": 0.8, "seed": 7},
    ],
    ids=["logprobs", "stop-string", "penalty", "sampled"],
)
def test_a_request_whose_tokens_need_more_than_the_argmax_is_not_burst(
    two_threads: None, prompts: list[list[int]], params: dict[str, Any]
) -> None:
    """Logprobs, a stop string (its tokens past the stop would be counted), penalties or sampling: one token a
    step, the same output as with bursts off."""
    fields: dict[str, Any] = {"temperature": 0.0, "max_tokens": 20, "ignore_eos": True} | params
    plain, burst = _engine(0.0), _engine(1000.0)
    work = [("r", prompts[1], SamplingParams(**fields))]
    assert _tokens(_run(burst, work)) == _tokens(_run(plain, work))
    assert burst.stats.decode_bursts == 0


def test_no_burst_runs_while_a_request_waits(two_threads: None, prompts: list[list[int]]) -> None:
    """A request that arrives while another decodes in bursts is prefilled at the next step, not after a burst."""
    engine = _engine(1000.0)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine.add_request("first", prompts[0], params)
    for _ in range(4):
        engine.step()
    assert engine.stats.decode_bursts >= 2
    before = engine.stats.decode_bursts
    engine.add_request("second", prompts[1], params)
    engine.step()
    assert engine.stats.decode_bursts == before  # the step that admitted "second" decoded one token a sequence
    (second,) = [s for s in engine.scheduler.running if s.request_id == "second"]
    assert second.num_computed_tokens == len(prompts[1])  # its prompt computed in that step


def test_a_bursts_blocks_are_cached_with_the_tokens_they_hold(two_threads: None, prompts: list[list[int]]) -> None:
    """A request whose prompt is an earlier one's prompt and output finds every full block of that earlier sequence
    it computed in the prefix cache: the blocks a burst filled are published once their tokens are appended (hashed
    before, a block would hold the burst's tokens but be hashed over fewer, and never match)."""
    engine = _engine(1000.0)
    first = _run(engine, [("first", prompts[0], SamplingParams(temperature=0.0, max_tokens=45, ignore_eos=True))])
    assert engine.stats.decode_bursts > 0
    output = first["first"].token_ids
    computed = len(prompts[0]) + len(output) - 1  # the last token was never fed
    again = _run(engine, [("again", prompts[0] + output, SamplingParams(temperature=0.0, max_tokens=4))])
    assert again["again"].usage.cached_tokens == computed // BLOCK * BLOCK
    assert computed // BLOCK * BLOCK > len(prompts[0])  # blocks of generated tokens among them


def test_a_speculating_engine_bursts_where_its_controller_decodes_plainly(
    two_threads: None, prompts: list[list[int]]
) -> None:
    """With n-gram speculation, the steps the adaptive controller runs plain are bursts (their seconds a token are
    what it compares speculating with); the tokens are plain greedy decoding's."""
    plain = _engine(0.0)
    spec = LLMEngine(
        EngineConfig(DEMO_LM, kv_cache_bytes=32 << 20, num_threads=2, speculation="ngram", decode_burst_ms=1000.0)
    )
    work = [
        (f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)) for i, p in enumerate(prompts)
    ]
    for i in range(3):  # alone, then together
        batch = work[:1] if i == 0 else work[1:]
        assert _tokens(_run(spec, batch)) == _tokens(_run(plain, batch))
    assert spec.stats.decode_bursts > 0
    assert spec.spec is not None and spec.spec.cost("ngram", 1, 0) is not None


def _burn(seconds: float) -> None:
    """This thread's CPU busy for ``seconds`` of its CPU time (what the engine's step clock counts on CPU)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_what_the_caller_does_between_steps_is_the_cost_of_the_step_before(
    two_threads: None, prompts: list[list[int]]
) -> None:
    """A step's outputs are detokenised, streamed or sent on once a step, after the step: the controller files a step's
    cost at the next step's start, with the caller's time in between (a burst pays it once for its tokens, a
    speculative step once for its few). Time spent admitting a request in between is not the step's."""
    engine = LLMEngine(
        EngineConfig(DEMO_LM, kv_cache_bytes=32 << 20, num_threads=2, speculation="ngram", decode_burst_ms=1000.0)
    )
    assert engine.spec is not None
    filed: list[tuple[str | None, int, int, float]] = []
    record = engine.spec.record_step

    def spy(method: str | None, k: int, num_seqs: int, seconds: float) -> None:
        filed.append((method, k, num_seqs, seconds))
        record(method, k, num_seqs, seconds)

    engine.spec.record_step = spy  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    engine.add_request("a", prompts[0], params)
    for _ in range(4):  # the prompt, then decode steps the controller is told about
        engine.step()
    burn, max_tokens = 0.4, engine.config.max_decode_burst
    filed.clear()
    engine.step()
    quiet = filed[-1][3]
    assert quiet < burn / max_tokens / 2  # a step of the demo LM: 1-3 ms a sequence (under half the bound)
    engine.step()
    _burn(burn)
    filed.clear()
    engine.step()
    assert filed and filed[-1][3] >= burn / max_tokens  # the burn, shared by the step's tokens at most
    engine.step()
    _burn(burn)
    engine.add_request("b", prompts[1], params)
    filed.clear()
    engine.step()
    assert filed and filed[-1][3] < burn / max_tokens / 2  # an admission in between: the step's own time alone

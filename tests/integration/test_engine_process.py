"""The engine in a process of its own (``EngineProcess``): the same answers as the engine in this process, errors
of the same types, and a clear ServiceUnavailableError — never a hang — when the child dies or is shut down."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from pathlib import Path

import pytest

from cloud.engine import AsyncLLMEngine, EngineConfig, SamplingParams
from cloud.engine.async_engine import EngineClient
from cloud.engine.outputs import RequestOutput
from cloud.engine.process import DELIVER_SLICE, EngineProcess
from cloud.engine.scheduler import QueueFull
from shared.errors import ConfigurationError, ServiceUnavailableError, ValidationError
from shared.zoo.registry import ZooLayout

pytestmark = pytest.mark.integration
PROMPTS = ["def main(argv):\n", "import os\n\n\nclass Config:\n    ", "    for i in range(len(", "# Copyright"]
KV = 16 << 20


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def lm_dir(tiny_zoo: Path) -> Path:
    return ZooLayout(tiny_zoo).artifact_dir("lm-cloud")


async def _collect(engine: EngineClient, prompt: str, max_tokens: int = 16) -> tuple[list[int], str, float | None]:
    parts, last = [], None
    async for out in engine.generate(prompt, greedy(max_tokens)):
        parts.append(out.outputs[0].delta_text)
        last = out
    assert last is not None and last.finished
    assert "".join(parts) == last.text
    return last.token_ids, last.text, last.engine_s


def test_a_child_process_engine_answers_as_the_in_process_engine(lm_dir: Path) -> None:
    async def main() -> None:
        child = EngineProcess.from_config(EngineConfig(lm_dir, kv_cache_bytes=KV), name="child")
        local = AsyncLLMEngine.from_config(EngineConfig(lm_dir, kv_cache_bytes=KV), name="local")
        try:
            assert child.pid != os.getpid() and child.max_model_len == local.max_model_len
            assert child.encode_prompt(PROMPTS[0]) == local.encode_prompt(PROMPTS[0])
            theirs = await asyncio.gather(*(_collect(child, p) for p in PROMPTS))
            ours = await asyncio.gather(*(_collect(local, p) for p in PROMPTS))
            assert [t[:2] for t in theirs] == [o[:2] for o in ours]
            assert all(t[2] is not None and t[2] > 0 for t in theirs)  # the engine's own latency, per request

            # Errors keep their type across the process boundary (the API maps them to 400 / 429).
            with pytest.raises(ValidationError, match="maximum context length"):
                async for _ in child.generate("x", SamplingParams(max_tokens=10**6)):
                    pass
            with pytest.raises(ValidationError, match="token ids"):
                async for _ in child.generate([10**9], greedy(2)):
                    pass

            # Leaving a stream early aborts the request in the child; its load drops back to idle.
            stream = child.generate(PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True))
            async for _ in stream:
                break
            await stream.aclose()
            for _ in range(100):
                metrics = await child.metrics()
                if metrics["num_running"] == 0:
                    break
                await asyncio.sleep(0.02)
            assert metrics["num_running"] == 0 and metrics["kv_cache_usage"] == 0.0
            await _collect(child, PROMPTS[1], 2)  # a step after the abort brings a fresh snapshot
            assert child.snapshot().idle
        finally:
            child.shutdown()
            local.shutdown()

    asyncio.run(main())


def _update(out: RequestOutput) -> tuple[object, ...]:
    """Everything an update says except the two timings."""
    return (
        out.request_id,
        out.prompt_token_ids,
        out.finished,
        out.usage,
        [dataclasses.astuple(c) for c in out.outputs],
    )


def test_every_update_crosses_the_pipe_as_the_in_process_engine_makes_it(lm_dir: Path) -> None:
    """Between a request's first and last update only the changes cross the pipe; what the API gets is the same."""
    cases = [
        (PROMPTS[0], greedy(12)),
        (PROMPTS[1], SamplingParams(n=2, temperature=0.9, seed=7, max_tokens=20, logprobs=2, ignore_eos=True)),
        (PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=40, stop=[")", "\n"])),
    ]

    async def updates(engine: EngineClient, prompt: str, params: SamplingParams) -> list[tuple[object, ...]]:
        return [_update(out) async for out in engine.generate(prompt, params, request_id="r")]

    async def main() -> None:
        # Decode bursts off: how many tokens a burst takes depends on the step's measured time, and the updates
        # are compared one by one.
        config = EngineConfig(lm_dir, kv_cache_bytes=KV, decode_burst_ms=0.0)
        child = EngineProcess.from_config(config, name="child")
        local = AsyncLLMEngine.from_config(config, name="local")
        try:
            for prompt, params in cases:
                theirs = await updates(child, prompt, params)
                ours = await updates(local, prompt, params)
                assert len(ours) > 2 and theirs == ours
        finally:
            child.shutdown()
            local.shutdown()

    asyncio.run(main())


def test_a_stop_string_found_in_the_api_process_ends_the_sequence_in_the_child(lm_dir: Path) -> None:
    """Stop strings are found where the text is made, in this process: the answer ends there, the child frees the
    sequence, and the same request id used again at once never receives the tokens the child made meanwhile."""

    async def main() -> None:
        child = EngineProcess.from_config(EngineConfig(lm_dir, kv_cache_bytes=KV), name="child")
        try:
            free = [o async for o in child.generate(PROMPTS[1], greedy(40))][-1]
            text = free.text
            stop = next(text[i : i + 3] for i in range(10, len(text) - 3) if text.index(text[i : i + 3]) == i)
            params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, stop=[stop])
            for _ in range(4):
                ids: list[int] = []
                async for out in child.generate(PROMPTS[1], params, request_id="same"):
                    (c,) = out.outputs
                    assert c.token_ids == ids + c.delta_token_ids
                    ids = c.token_ids
                assert out.finished and c.finish_reason == "stop" and c.text == text[: text.index(stop)]
                assert ids == free.token_ids[: len(ids)] and len(ids) < 40
            for _ in range(100):
                metrics = await child.metrics()
                if metrics["num_running"] == 0:
                    break
                await asyncio.sleep(0.02)
            assert metrics["num_running"] == 0 and metrics["kv_cache_usage"] == 0.0
            assert metrics["num_generated_tokens"] < 40 + 4 * 60  # stopped, not run on to max_tokens
        finally:
            child.shutdown()

    asyncio.run(main())


def test_many_streams_get_every_update_in_order_when_steps_are_delivered_in_slices(lm_dir: Path) -> None:
    """More streams than one delivery slice: every stream still gets each of its updates once, in order, and the
    changes it is given add up to its final answer (a delta applied out of order would not)."""
    assert DELIVER_SLICE < 40

    async def stream(engine: EngineClient, i: int) -> None:
        params = greedy(5 + i % 7)
        ids: list[int] = []
        text, updates = "", 0
        async for out in engine.generate(f"{PROMPTS[i % len(PROMPTS)]}{i}", params, request_id=f"s{i}"):
            (c,) = out.outputs
            assert c.token_ids == ids + c.delta_token_ids, f"stream {i}: update {updates} out of order"
            ids, text, updates = c.token_ids, text + c.delta_text, updates + 1
            if out.finished:
                assert text == c.text and len(ids) == params.max_tokens == out.usage.completion_tokens
                finished.append(i)
            else:
                assert i not in finished, f"stream {i}: an update after its last"
        assert i in finished

    finished: list[int] = []

    async def main() -> None:
        child = EngineProcess.from_config(EngineConfig(lm_dir, kv_cache_bytes=KV), name="child")
        try:
            await asyncio.gather(*(stream(child, i) for i in range(40)))
            await asyncio.gather(*(stream(child, i) for i in range(40, 60)))  # a second wave on the same loop
        finally:
            child.shutdown()

    asyncio.run(main())
    assert sorted(finished) == list(range(60))


def test_the_child_queue_bound_answers_queue_full(lm_dir: Path) -> None:
    async def main() -> None:
        cfg = EngineConfig(lm_dir, kv_cache_bytes=KV, max_num_seqs=1, max_num_queued_requests=1)
        child = EngineProcess.from_config(cfg)
        try:
            long = SamplingParams(max_tokens=200, ignore_eos=True)
            first = child.generate(PROMPTS[0], long)
            await first.__anext__()
            second = child.generate(PROMPTS[1], long)
            waiting = asyncio.ensure_future(second.__anext__())  # admitted, queued behind the first
            for _ in range(100):
                if child.snapshot().waiting or waiting.done():
                    break
                await asyncio.sleep(0.02)
            with pytest.raises(QueueFull) as exc:
                async for _ in child.generate(PROMPTS[2], long):
                    pass
            assert exc.value.status_code == 429
            waiting.cancel()
            await first.aclose()
        finally:
            child.shutdown()

    asyncio.run(main())


def test_a_killed_child_fails_open_streams_and_later_calls_with_service_unavailable(lm_dir: Path) -> None:
    async def main() -> None:
        child = EngineProcess.from_config(EngineConfig(lm_dir, kv_cache_bytes=KV))
        try:
            stream = child.generate(PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True))
            await stream.__anext__()
            os.kill(child.pid, signal.SIGKILL)
            with pytest.raises(ServiceUnavailableError, match="exited"):
                async with asyncio.timeout(30):
                    async for _ in stream:
                        pass
            with pytest.raises(ServiceUnavailableError):
                async for _ in child.generate(PROMPTS[1], greedy(2)):
                    pass
        finally:
            child.shutdown()

    asyncio.run(main())


def test_sigterm_leaves_the_child_to_its_parent_and_shutdown_fails_streams_in_flight(lm_dir: Path) -> None:
    async def main() -> None:
        child = EngineProcess.from_config(EngineConfig(lm_dir, kv_cache_bytes=KV))
        stream = child.generate(PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True))
        await stream.__anext__()
        os.kill(child.pid, signal.SIGTERM)  # systemd signals the whole cgroup: the child waits for its parent
        for _ in range(3):
            await stream.__anext__()
        child.shutdown()
        with pytest.raises(ServiceUnavailableError, match="shut down"):
            async with asyncio.timeout(30):
                async for _ in stream:
                    pass
        assert not child._process.is_alive()

    asyncio.run(main())


def test_a_model_that_cannot_load_is_reported_by_wait_ready(tmp_path: Path) -> None:
    with pytest.raises((ConfigurationError, FileNotFoundError, OSError, ValueError)):
        EngineProcess.from_config(EngineConfig(tmp_path / "no-such-model", kv_cache_bytes=KV))

"""The shadow step of a cloud rollout: which requests are mirrored, how agreement is measured, how the step is
judged, and that a full mirror queue drops mirrors instead of waiting."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, cast

import pytest
from sqlalchemy.engine import Engine

from cloud.engine.async_engine import AsyncLLMEngine
from cloud.serving.canary import shadow_target
from cloud.serving.engine_pool import RegistryEntry, ServedLM
from cloud.serving.shadow import Mirror, ShadowMirror
from controlplane.rollouts.analysis import ShadowStats, analyse_shadow, token_agreement
from controlplane.rollouts.service import RolloutPlan, RolloutSpec, validate_spec
from shared.errors import ValidationError

NAME = "lm"


def _plan(status: str = "running", weight: float = 0.0, step: int = 0, sample: float = 100.0, **kw: Any) -> RolloutPlan:
    fields: dict[str, Any] = {
        "id": 7,
        "model": NAME,
        "baseline_version": "1",
        "candidate_version": "2",
        "scope": "cloud",
        "status": status,
        "weight": weight,
        "tenant_id": None,
        "device_selector": {},
        "device_pins": {},
        "tenant_pins": {},
        "finished_at": None,
        "step_index": step,
        "shadow_sample": sample,
    }
    return RolloutPlan(**{**fields, **kw})


def _entry(*numbers: int) -> RegistryEntry:
    served = {n: ServedLM(NAME, n, cast(AsyncLLMEngine, None), 128) for n in numbers}
    return RegistryEntry(NAME, versions=served, default=numbers[0])


def test_agreement_is_the_share_of_the_baselines_positions_the_candidate_matched() -> None:
    assert token_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert token_agreement([1, 2, 3, 4], [1, 9, 3, 9]) == 0.5
    assert token_agreement([1, 2, 3, 4], [1, 2]) == 0.5  # a candidate that stopped early disagrees on the rest
    assert token_agreement([1, 2], [1, 2, 3, 4]) == 1.0  # only the baseline's positions count
    assert token_agreement([], [1]) is None


def test_only_the_baselines_requests_at_the_shadow_step_are_mirrored_within_the_sample() -> None:
    entry = _entry(1, 2)
    assert shadow_target([_plan()], entry, 1, 1) == (7, 2)
    assert shadow_target([_plan(sample=10.0)], entry, 1, 1, draw=lambda: 0.05) == (7, 2)
    assert shadow_target([_plan(sample=10.0)], entry, 1, 1, draw=lambda: 0.5) is None
    assert shadow_target([_plan()], entry, 1, 2) is None  # served by the candidate (a pinned tenant)
    assert shadow_target([_plan(sample=0.0)], entry, 1, 1) is None  # no shadow step
    assert shadow_target([_plan(step=1, weight=5.0)], entry, 1, 1) is None  # past the shadow step
    assert shadow_target([_plan(status="paused")], entry, 1, 1) is None
    assert shadow_target([_plan(tenant_pins={1: "excluded"})], entry, 1, 1) is None
    assert shadow_target([_plan()], _entry(1), 1, 1) is None  # the candidate is still loading
    assert shadow_target([], entry, 1, 1) is None


def _judge(samples: int, mean: float | None, elapsed: float = 60.0, nxt: float | None = 5.0) -> str:
    stats = ShadowStats(samples, mean)
    return analyse_shadow(
        stats, min_agreement=0.9, min_samples=4, min_step_s=30.0, step_elapsed_s=elapsed, next_weight=nxt
    ).action


def test_the_shadow_step_waits_for_samples_then_advances_or_rolls_back_on_agreement() -> None:
    assert _judge(0, None) == "wait"  # no data is never a pass
    assert _judge(3, 1.0) == "wait"
    assert _judge(4, 0.95) == "advance"
    assert _judge(4, 0.9) == "advance"
    assert _judge(4, 0.95, nxt=100.0) == "promote"
    assert _judge(4, 0.95, elapsed=10.0) == "wait"  # the step is too young
    assert _judge(4, 0.5, elapsed=10.0) == "rollback"  # a failing bound does not wait for the clock
    decision = analyse_shadow(
        ShadowStats(5, 0.4), min_agreement=0.9, min_samples=4, min_step_s=0, step_elapsed_s=1, next_weight=5
    )
    assert decision.metrics["shadow"] == {"samples": 5, "mean_agreement": 0.4, "min_agreement": 0.9}
    assert "0.4" in decision.reason and "0.9" in decision.reason


def test_a_shadow_step_is_step_0_at_weight_0_and_needs_cloud_scope() -> None:
    spec = validate_spec(RolloutSpec(NAME, "1", "2", steps=[25.0, 100.0], shadow_sample=10, shadow_min_agreement=0.8))
    assert spec.steps == [0.0, 25.0, 100.0] and spec.shadow_sample == 10.0 and spec.shadow_min_agreement == 0.8
    assert validate_spec(RolloutSpec(NAME, "1", "2", steps=[25.0, 100.0])).steps == [25.0, 100.0]
    bad: list[tuple[dict[str, Any], str]] = [
        ({"shadow_sample": 101}, "shadow_sample"),
        ({"shadow_sample": -1}, "shadow_sample"),
        ({"shadow_sample": True}, "shadow_sample"),
        ({"shadow_min_agreement": 1.5}, "shadow_min_agreement"),
        ({"shadow_sample": 10, "scope": "edge"}, "shadow_sample"),
    ]
    for fields, param in bad:
        with pytest.raises(ValidationError) as err:
            validate_spec(RolloutSpec(NAME, "1", "2", **fields))
        assert err.value.param == param


@dataclass
class _Out:
    finished: bool
    outputs: list[Any]


@dataclass
class _Choice:
    token_ids: list[int]


class _SlowEngine:
    """A candidate engine that answers [1, 2, 9] after a gate opens."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()

    async def generate(self, prompt: list[int], params: Any, **_: Any) -> AsyncGenerator[_Out, None]:
        await self.gate.wait()
        yield _Out(True, [_Choice([1, 2, 9][: params.max_tokens])])


def test_a_full_mirror_queue_drops_mirrors_and_never_waits() -> None:
    recorded: list[tuple[int, int, int, float]] = []

    class Recording(ShadowMirror):
        def _record(self, rollout_id: int, positions: int, matches: int, agreement: float) -> None:
            recorded.append((rollout_id, positions, matches, agreement))

    async def scenario() -> None:
        engine = _SlowEngine()
        mirror = Recording(cast(Engine, None), queue_size=2, workers=1)
        candidate = ServedLM(NAME, 2, cast(AsyncLLMEngine, engine), 128)
        accepted = [mirror.submit(Mirror(7, candidate, [5], [1, 2, 3])) for _ in range(5)]
        await asyncio.sleep(0)  # the worker takes one off the queue; it waits on the engine
        accepted.append(mirror.submit(Mirror(7, candidate, [5], [1, 2, 3])))
        assert accepted.count(False) == mirror.dropped >= 2
        engine.gate.set()
        for _ in range(50):
            await asyncio.sleep(0.01)
            if len(recorded) == accepted.count(True):
                break
        await mirror.close()

    asyncio.run(scenario())
    assert recorded and all(r == (7, 3, 2, 2 / 3) for r in recorded)

"""Which rollout arm a cloud request counts in (only the arm whose version actually serves it), and which loaded
version of a registry model serves it."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import cast

import pytest

from cloud.engine.async_engine import AsyncLLMEngine
from cloud.serving.canary import canary_arm, route_registry, routed_versions
from cloud.serving.engine_pool import EnginePool, RegistryEntry, ServedLM, split_model
from controlplane.rollouts.service import RolloutPlan
from shared.errors import NotFoundError

MODEL = "tierline/lm-cloud"


def _plan(status: str = "running", weight: float = 50.0, tenant_pins: dict[int, str] | None = None) -> RolloutPlan:
    return RolloutPlan(
        id=3,
        model=MODEL,
        baseline_version="4",
        candidate_version="5",
        scope="cloud",
        status=status,
        weight=weight,
        tenant_id=None,
        device_selector={},
        device_pins={},
        tenant_pins=tenant_pins or {},
        finished_at=None,
    )


def test_a_request_counts_in_the_arm_whose_version_serves_it() -> None:
    plans = [_plan(weight=100.0)]
    assert canary_arm(plans, MODEL, "5", 1, "alice") == "candidate"
    assert canary_arm([_plan(weight=0.0)], MODEL, "4", 1, "alice") == "baseline"


def test_a_request_served_by_another_version_counts_in_no_arm() -> None:
    # The candidate was picked but this cloud serves the baseline (or models without a version): counting the
    # answer as the candidate's would judge the candidate on the baseline's answers.
    assert canary_arm([_plan(weight=100.0)], MODEL, "4", 1, "alice") is None
    assert canary_arm([_plan(weight=100.0)], MODEL, None, 1, "alice") is None


def test_no_rollout_an_excluded_tenant_or_a_finished_rollout_counts_in_no_arm() -> None:
    assert canary_arm([], MODEL, "5", 1, "alice") is None
    assert canary_arm([_plan(weight=100.0)], "tierline/lm-edge", "5", 1, "alice") is None
    assert canary_arm([_plan(weight=100.0, tenant_pins={1: "excluded"})], MODEL, "4", 1, "alice") is None
    assert canary_arm([_plan(status="promoted")], MODEL, "5", 1, "alice") is None


def test_the_arm_is_sticky_by_tenant_and_subject() -> None:
    plans = [_plan(weight=50.0)]
    arms = {s: canary_arm(plans, MODEL, "5", 1, s) or canary_arm(plans, MODEL, "4", 1, s) for s in "abcdefgh"}
    assert set(arms.values()) == {"baseline", "candidate"}
    for s, first in arms.items():  # the same subject always lands in the same arm
        again = [canary_arm(plans, MODEL, "5", 1, s) or canary_arm(plans, MODEL, "4", 1, s) for _ in range(20)]
        assert set(again) == {first}


# --- registry models: the version that serves a request ------------------------------------------------------------

NAME = "tiny-lm"
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _served(number: int) -> ServedLM:
    return ServedLM(NAME, number, cast(AsyncLLMEngine, None), 128)


def _entry(
    loaded: tuple[int, ...] = (1, 2), default: int | None = 1, stable_moved_at: datetime | None = None
) -> RegistryEntry:
    return RegistryEntry(
        NAME,
        versions={n: _served(n) for n in loaded},
        aliases={"stable": 1} if 1 in loaded else {},
        default=default,
        stable_moved_at=stable_moved_at,
    )


def _registry_plan(status: str = "running", weight: float = 50.0, finished_at: datetime | None = None) -> RolloutPlan:
    return replace(
        _plan(status, weight), model=NAME, baseline_version="1", candidate_version="2", finished_at=finished_at
    )


def test_outside_a_rollout_the_default_version_serves_and_counts_in_no_arm() -> None:
    assert route_registry([], _entry(), 1, "alice") == (1, None)
    assert route_registry([replace(_registry_plan(), model="other")], _entry(), 1, "alice") == (1, None)


def test_a_running_rollout_sends_each_subject_to_its_arm_version() -> None:
    plans = [_registry_plan(weight=50.0)]
    routes = {s: route_registry(plans, _entry(), 1, s) for s in (f"s{i}" for i in range(200))}
    assert set(routes.values()) == {(1, "baseline"), (2, "candidate")}
    assert 70 <= sum(v == (2, "candidate") for v in routes.values()) <= 130
    assert all(route_registry(plans, _entry(), 1, s) == r for s, r in routes.items())  # sticky
    assert route_registry([_registry_plan(weight=100.0)], _entry(), 1, "x") == (2, "candidate")


def test_while_a_rollout_version_is_loading_the_baseline_serves_in_no_arm() -> None:
    assert route_registry([_registry_plan(weight=100.0)], _entry(loaded=(1,)), 1, "x") == (1, None)
    # Neither arm loaded: the default serves.
    entry = RegistryEntry(NAME, versions={3: _served(3)}, default=3)
    assert route_registry([_registry_plan(weight=100.0)], entry, 1, "x") == (3, None)


def test_finished_rollouts_serve_their_outcome_until_stable_moves_after_them() -> None:
    aborted = _registry_plan("aborted", weight=0.0, finished_at=T0)
    promoted = _registry_plan("promoted", weight=100.0, finished_at=T0)
    assert route_registry([aborted], _entry(default=2), 1, "x") == (1, None)
    assert route_registry([promoted], _entry(), 1, "x") == (2, None)
    later = _entry(stable_moved_at=T0 + timedelta(seconds=1))
    assert route_registry([promoted], later, 1, "x") == (1, None)
    assert route_registry([_registry_plan("pending")], _entry(default=2), 1, "x") == (1, None)
    excluded = replace(_registry_plan(weight=100.0), tenant_pins={1: "excluded"})
    assert route_registry([excluded], _entry(), 1, "x") == (1, None)


def test_the_versions_rollouts_may_route_to_are_the_ones_loaded() -> None:
    entry = _entry()
    assert routed_versions([_registry_plan()], entry) == {1, 2}
    assert routed_versions([_registry_plan("pending")], entry) == {1, 2}
    assert routed_versions([_registry_plan("aborted", finished_at=T0)], entry) == {1}
    assert routed_versions([_registry_plan("promoted", finished_at=T0)], entry) == {2}
    moved = _entry(stable_moved_at=T0 + timedelta(seconds=1))
    assert routed_versions([_registry_plan("promoted", finished_at=T0)], moved) == set()
    assert routed_versions([_plan()], entry) == set()  # another model's rollout


def test_a_registry_model_is_found_by_name_pinned_number_or_alias() -> None:
    pool = EnginePool({})
    pool.set_registry({NAME: _entry()})
    assert pool.get(NAME).version == 1
    assert pool.get(f"{NAME}@2").version == 2
    assert pool.get(f"{NAME}@stable").version == 1
    assert NAME in pool.engines and f"{NAME}@2" in pool.engines and f"{NAME}@9" not in pool.engines
    assert list(pool.engines) == [f"{NAME}@1", f"{NAME}@2"]  # each engine once
    for missing in (f"{NAME}@9", f"{NAME}@canary", "other"):
        with pytest.raises(NotFoundError) as err:
            pool.get(missing)
        assert err.value.param == "model"
    assert split_model("tiny-lm@3") == ("tiny-lm", "3") and split_model("tierline/lm-cloud") == (
        "tierline/lm-cloud",
        None,
    )

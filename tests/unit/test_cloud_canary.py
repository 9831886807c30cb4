"""Which rollout arm a cloud request counts in: only the arm whose version actually serves it."""

from __future__ import annotations

from cloud.canary import canary_arm
from shared.rollouts import RolloutPlan

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

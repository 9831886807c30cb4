"""Sticky canary assignment: stable per subject, the realised split matches the weight, raising it only adds."""

from __future__ import annotations

import pytest

from controlplane.rollouts.assignment import NUM_BUCKETS, arm, bucket, cloud_subject, fleet_subject

SUBJECTS = [f"user-{i}" for i in range(10_000)]


def test_buckets_are_in_range_and_depend_on_the_salt() -> None:
    values = [bucket("rollout-1", s) for s in SUBJECTS[:2000]]
    assert all(0 <= v < NUM_BUCKETS for v in values)
    assert len(set(values)) > 1500  # spread out, not clumped
    assert values != [bucket("rollout-2", s) for s in SUBJECTS[:2000]]


def test_the_same_subject_gets_the_same_arm_across_10k_calls() -> None:
    subject = cloud_subject("acme", "alice")
    first = arm(7, subject, 50)
    assert all(arm(7, subject, 50) == first for _ in range(10_000))
    assert {arm(7, s, 25) for s in ("a", "b", "c")} == {arm(7, s, 25) for s in ("a", "b", "c")}


@pytest.mark.parametrize("weight", [5, 25, 50])
def test_the_realised_split_is_within_two_points_of_the_weight(weight: float) -> None:
    candidates = sum(arm(42, fleet_subject(f"dev-{i:05d}"), weight) == "candidate" for i in range(10_000))
    assert abs(candidates / 100 - weight) <= 2.0


def test_raising_the_weight_only_moves_subjects_to_the_candidate() -> None:
    weights = [0, 0.5, 1, 5, 12.5, 25, 50, 75, 100]
    previous = dict.fromkeys(SUBJECTS, "baseline")
    for w in weights:
        current: dict[str, str] = {s: arm(3, s, w) for s in SUBJECTS}
        moved_back = [s for s in SUBJECTS if previous[s] == "candidate" and current[s] == "baseline"]
        assert moved_back == [], f"weight {w} moved {len(moved_back)} subjects back to the baseline"
        previous = current
    assert set(previous.values()) == {"candidate"}
    assert {arm(3, s, 0) for s in SUBJECTS} == {"baseline"}


def test_fractional_weights_are_honoured() -> None:
    share = sum(arm(9, s, 0.5) == "candidate" for s in SUBJECTS) / len(SUBJECTS)
    assert 0.002 <= share <= 0.009


def test_pins_force_an_arm_and_exclusion_keeps_the_baseline() -> None:
    subject = next(s for s in SUBJECTS if arm(1, s, 50) == "baseline")
    assert arm(1, subject, 50, {subject: "candidate"}) == "candidate"
    assert arm(1, subject, 0, {subject: "candidate"}) == "candidate"
    assert arm(1, subject, 100, {subject: "excluded"}) == "baseline"
    assert arm(1, subject, 100, {subject: "baseline"}) == "baseline"
    assert arm(1, subject, 100, {"someone-else": "baseline"}) == "candidate"


def test_cloud_subjects_keep_tenant_and_user_apart() -> None:
    assert cloud_subject("ab", "c") != cloud_subject("a", "bc")
    assert cloud_subject("acme", None) == cloud_subject("acme", "")

"""Rollout analysis and assignment of versions, as pure functions: thin data waits, no data never passes,
failed checks roll back with their reason, healthy steps advance and the last one promotes."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from controlplane.rollouts.assignment import arm, cloud_subject
from controlplane.rollouts.service import (
    DEFAULT_CHECKS,
    ArmStats,
    RolloutPlan,
    RolloutSpec,
    Window,
    analyse,
    edge_version,
    plans_for,
    resolve_cloud_arm,
    usage_arm,
    validate_spec,
)
from shared.errors import ValidationError

HEALTHY_BASE = ArmStats(requests=1000, errors=10, p95_latency_ms=100.0, escalations=100)
HEALTHY_CAND = ArmStats(requests=200, errors=2, p95_latency_ms=110.0, escalations=22)


def judge(*windows: Window, elapsed: float = 600.0, next_weight: float | None = 25.0, **kw: Any) -> Any:
    return analyse(
        windows,
        checks=kw.pop("checks", DEFAULT_CHECKS),
        min_samples=kw.pop("min_samples", 100),
        min_step_s=kw.pop("min_step_s", 300.0),
        step_elapsed_s=elapsed,
        next_weight=next_weight,
    )


def test_a_healthy_step_advances_and_the_last_one_promotes() -> None:
    edge = Window("edge", HEALTHY_BASE, HEALTHY_CAND)
    advance = judge(edge)
    assert advance.action == "advance"
    assert "edge error_rate 0.01 within limit 0.017" in advance.reason
    assert {c["metric"]: c["outcome"] for c in advance.metrics["checks"]} == {
        "error_rate": "pass",
        "p95_latency_ms": "pass",
        "escalation_rate": "pass",
    }
    assert judge(edge, next_weight=100).action == "promote"
    assert judge(edge, next_weight=None).action == "promote"


def test_checks_pass_but_a_young_step_waits() -> None:
    decision = judge(Window("edge", HEALTHY_BASE, HEALTHY_CAND), elapsed=12)
    assert decision.action == "wait"
    assert "step has run 12s of 300s" in decision.reason


@pytest.mark.parametrize(
    ("candidate", "baseline"),
    [
        (ArmStats(), HEALTHY_BASE),  # no candidate traffic at all
        (ArmStats(requests=99), HEALTHY_BASE),  # one short of the minimum
        (HEALTHY_CAND, ArmStats(requests=5)),  # a thin baseline proves nothing either
        (ArmStats(), ArmStats()),
    ],
)
def test_thin_or_missing_data_waits_however_long_the_step_ran(candidate: ArmStats, baseline: ArmStats) -> None:
    decision = judge(Window("edge", baseline, candidate), elapsed=10**9, next_weight=None)
    assert decision.action == "wait"
    assert decision.reason.startswith("waiting for data: ")
    assert f"/{100} requests" in decision.reason


def test_no_metrics_source_is_never_a_pass() -> None:
    decision = judge(elapsed=10**9, next_weight=None)
    assert decision.action == "wait"


def test_a_missing_metric_waits_instead_of_passing() -> None:
    candidate = ArmStats(requests=200, errors=0, p95_latency_ms=None, escalations=0)
    decision = judge(Window("edge", HEALTHY_BASE, candidate))
    assert decision.action == "wait"
    assert "edge p95_latency_ms: no data for the candidate" in decision.reason


def test_injected_errors_roll_back_with_the_reason_and_the_numbers() -> None:
    candidate = ArmStats(requests=200, errors=40, p95_latency_ms=100.0, escalations=20)
    decision = judge(Window("edge", HEALTHY_BASE, candidate), elapsed=1)  # young steps roll back too
    assert decision.action == "rollback"
    assert decision.reason == "check failed: edge error_rate 0.2 exceeds limit 0.017 (baseline 0.01)"
    failed = [c for c in decision.metrics["checks"] if c["outcome"] == "fail"]
    assert failed == [
        {
            "source": "edge",
            "metric": "error_rate",
            "baseline": 0.01,
            "candidate": 0.2,
            "limit": pytest.approx(0.017),
            "outcome": "fail",
        }
    ]
    assert decision.metrics["windows"]["edge"]["candidate"]["requests"] == 200


def test_thresholds_are_relative_with_slack() -> None:
    base = ArmStats(requests=1000, errors=10, p95_latency_ms=100.0, escalations=100)
    at_limit = ArmStats(requests=1000, errors=17, p95_latency_ms=130.0, escalations=140)  # 0.1*1.2+0.02
    assert judge(Window("edge", base, at_limit)).action == "advance"
    slow = ArmStats(requests=1000, errors=10, p95_latency_ms=131.0, escalations=100)
    assert judge(Window("edge", base, slow)).action == "rollback"
    escalating = ArmStats(requests=1000, errors=10, p95_latency_ms=100.0, escalations=141)
    assert "escalation_rate" in judge(Window("edge", base, escalating)).reason


def test_escalation_rate_is_judged_on_edge_traffic_only() -> None:
    base = ArmStats(requests=500, errors=5, p95_latency_ms=50.0, p95_ttft_ms=10.0)
    cand = ArmStats(requests=500, errors=5, p95_latency_ms=50.0, p95_ttft_ms=10.0)
    decision = judge(Window("cloud", base, cand))
    assert decision.action == "advance"
    assert {c["metric"] for c in decision.metrics["checks"]} == {"error_rate", "p95_latency_ms"}


def test_a_failing_source_rolls_back_even_while_another_is_thin() -> None:
    cloud = Window("cloud", ArmStats(requests=500, p95_latency_ms=50.0), ArmStats(requests=3, p95_latency_ms=50.0))
    edge = Window("edge", HEALTHY_BASE, ArmStats(requests=200, errors=100, p95_latency_ms=100.0, escalations=20))
    assert judge(cloud, edge).action == "rollback"
    assert judge(cloud, Window("edge", HEALTHY_BASE, HEALTHY_CAND)).action == "wait"


def test_checks_can_be_turned_off_and_cost_is_compared_in_decimal() -> None:
    checks = {"error_rate": None, "cost_per_request": {"factor": 1.1, "slack": 0.0}}
    base = ArmStats(requests=100, errors=50, cost=Decimal("1.000000"), num_priced=100)
    cheap = ArmStats(requests=100, errors=90, cost=Decimal("1.100000"), num_priced=100)
    dear = ArmStats(requests=100, errors=0, cost=Decimal("1.100100"), num_priced=100)
    assert judge(Window("cloud", base, cheap), checks=checks).action == "advance"
    decision = judge(Window("cloud", base, dear), checks=checks)
    assert decision.action == "rollback"
    assert "cost_per_request 0.011001 exceeds limit 0.0110" in decision.reason


def spec(**changes: Any) -> RolloutSpec:
    base: dict[str, Any] = {"model": "lm-edge-onnx-int8", "baseline_version": "b1", "candidate_version": "c1"}
    return RolloutSpec(**{"scope": "edge", **base, **changes})


def test_a_spec_gets_defaults() -> None:
    done = validate_spec(spec())
    assert done.steps == [5.0, 25.0, 50.0, 100.0]
    assert done.checks == DEFAULT_CHECKS
    tuned = validate_spec(spec(steps=[0.5, 10, 100], checks={"p95_latency_ms": None, "error_rate": {"factor": 2}}))
    assert tuned.steps == [0.5, 10.0, 100.0]
    assert tuned.checks is not None
    assert tuned.checks["p95_latency_ms"] is None
    assert tuned.checks["error_rate"] == {"factor": 2.0, "slack": 0.0}


@pytest.mark.parametrize(
    ("changes", "param", "message"),
    [
        ({"candidate_version": "b1"}, "candidate_version", "must differ"),
        ({"steps": [25, 5]}, "steps", "ascending"),
        ({"steps": [0, 50]}, "steps", "outside (0, 100]"),
        ({"steps": [50, 101]}, "steps", "outside (0, 100]"),
        ({"steps": []}, "steps", "1-20 weights"),
        ({"min_samples": 0}, "min_samples", "no data is never a pass"),
        ({"min_step_s": -1}, "min_step_s", "non-negative"),
        ({"scope": "fleet"}, "scope", "cloud, edge, both"),
        ({"scope": "cloud", "device_selector": {"ring": "beta"}}, "device_selector", "a cloud rollout"),
        ({"checks": {"accuracy": {"factor": 1}}}, "checks.accuracy", "unknown check"),
        ({"checks": {"error_rate": {"factor": -1}}}, "checks.error_rate.factor", "non-negative"),
        ({"baseline_version": "../etc"}, "baseline_version", "letters, digits"),
        ({"model": ""}, "model", "1-128"),
    ],
)
def test_bad_specs_are_refused_naming_the_field(changes: dict[str, Any], param: str, message: str) -> None:
    with pytest.raises(ValidationError) as caught:
        validate_spec(spec(**changes))
    assert caught.value.param == param
    assert message in caught.value.message


def plan(status: str = "running", weight: float = 50.0, **changes: Any) -> RolloutPlan:
    fields: dict[str, Any] = {
        "id": 11,
        "model": "lm-edge-onnx-int8",
        "baseline_version": "b1",
        "candidate_version": "c1",
        "scope": "both",
        "status": status,
        "weight": weight,
        "tenant_id": None,
        "device_selector": {"ring": "beta"},
        "device_pins": {},
        "tenant_pins": {},
        "finished_at": None,
        **changes,
    }
    return RolloutPlan(**fields)


def test_devices_get_their_sticky_arm_while_running_and_everyone_gets_the_outcome() -> None:
    beta = {"ring": "beta"}
    devices = [f"dev-{i:04d}" for i in range(400)]
    running = [edge_version(plan(), d, 1, beta) for d in devices]
    assert running == ["c1" if arm(11, d, 50) == "candidate" else "b1" for d in devices]
    assert 150 < running.count("c1") < 250
    assert {edge_version(plan(status="paused"), d, 1, beta) for d in devices} == set(running)
    assert {edge_version(plan(), d, 1, {"ring": "prod"}) for d in devices} == {"b1"}  # outside the selector
    assert {edge_version(plan(status="pending", weight=0), d, 1, beta) for d in devices} == {"b1"}
    assert {edge_version(plan(status="promoted", weight=100), d, 1, {}) for d in devices} == {"c1"}
    for final in ("rolled_back", "aborted"):
        assert {edge_version(plan(status=final, weight=0), d, 1, beta) for d in devices} == {"b1"}


def test_pins_hold_devices_and_tenants() -> None:
    beta = {"ring": "beta"}
    pinned = plan(weight=0.01, device_pins={"dev-a": "candidate"}, tenant_pins={7: "candidate"})
    assert edge_version(pinned, "dev-a", 1, beta) == "c1"
    assert edge_version(pinned, "dev-b", 7, beta) == "c1"
    held = plan(weight=100, device_pins={"dev-a": "excluded"}, tenant_pins={7: "baseline"})
    assert edge_version(held, "dev-a", 1, beta) == "b1"
    assert edge_version(held, "dev-b", 7, beta) == "b1"
    assert edge_version(held, "dev-c", 1, beta) == "c1"


def test_cloud_requests_are_routed_by_tenant_and_subject() -> None:
    plans = [plan(model="tierline/lm-cloud", baseline_version="1", candidate_version="2", device_selector={})]
    assert resolve_cloud_arm(plans, model="tierline/other", tenant_id=3, subject="u") is None
    users = [f"user-{i}" for i in range(300)]
    routes = [resolve_cloud_arm(plans, model="tierline/lm-cloud", tenant_id=3, subject=u) for u in users]
    assert all(r is not None and r.rollout_id == 11 for r in routes)
    expected = ["candidate" if arm(11, cloud_subject("3", u), 50) == "candidate" else "baseline" for u in users]
    assert [r.arm for r in routes if r is not None] == expected
    assert {(r.arm, r.version) for r in routes if r is not None} == {("candidate", "2"), ("baseline", "1")}
    excluded = [plan(model="lm-cloud", baseline_version="1", candidate_version="2", tenant_pins={3: "excluded"})]
    route = resolve_cloud_arm(excluded, model="tierline/lm-cloud", tenant_id=3, subject="u")
    assert route is not None and (route.arm, route.version) == (None, "1")
    promoted = [plan(model="lm-cloud", status="promoted", baseline_version="1", candidate_version="2")]
    route = resolve_cloud_arm(promoted, model="tierline/lm-cloud", tenant_id=3, subject=None)
    assert route is not None and (route.arm, route.version) == (None, "2")


def test_a_tenant_rollout_governs_only_its_tenant_and_the_newest_rollout_wins() -> None:
    plans = [
        plan(id=1, status="promoted", weight=100, tenant_id=None),
        plan(id=2, status="rolled_back", weight=0, tenant_id=5, candidate_version="c2"),
    ]
    assert edge_version(plans[0], "dev-x", 9, {"ring": "beta"}) == "c1"
    assert plans_for(plans, "tierline/lm-edge-onnx-int8", 9) is plans[0]
    assert plans_for(plans, "lm-edge-onnx-int8", 5) is plans[1]
    assert plans_for(plans, "lm-edge-onnx", 5) is None


def test_usage_records_are_stamped_by_the_version_that_served_them() -> None:
    plans = [plan(status="rolled_back", weight=0)]
    assert usage_arm(plans, model="tierline/lm-edge-onnx-int8", tenant_id=1, version="c1") == "candidate"
    assert usage_arm(plans, model="lm-edge-onnx-int8", tenant_id=1, version="b1") == "baseline"
    assert usage_arm(plans, model="lm-edge-onnx-int8", tenant_id=1, version="a0") is None
    assert usage_arm(plans, model="lm-edge-onnx-int8", tenant_id=1, version=None) is None
    assert usage_arm(plans, model="digits-small", tenant_id=1, version="c1") is None

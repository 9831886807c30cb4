"""A policy's promise beside what its devices did (``controlplane.policies.live``): the live edge share of the
requests the policy decided, and every other reason as its own, from the usage rows; and the quality monitor's
verdict per group, which says when there are too few shadow samples to judge (issue 40: 0.0 % against 20.3 %
promised, on fewer samples than an alert needs, raised nothing and said nothing)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session

from controlplane.policies import live
from controlplane.policies.monitor import MIN_SAMPLES, Agreement
from controlplane.storage.database import create_db
from controlplane.storage.migrate import upgrade
from controlplane.storage.tables import EscalationPolicy, Model, Tenant, UsageRecord

NOW = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)
LM = "tierline/lm-edge"


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Engine]:
    url = f"sqlite:///{tmp_path / 'live.db'}"
    upgrade(url)
    engine = create_db(url)
    with Session(engine) as s:
        s.add(Tenant(name="demo"))
        s.add(Model(name="lm-edge", kind="causal-lm", cloud_model="tierline/lm-cloud"))
        s.add(Model(name="digits-small", kind="tensor", cloud_model="tierline/digits-large"))
        s.add(_policy(1, NOW - timedelta(hours=2), 0.9))
        s.commit()
    yield engine
    engine.dispose()


def _policy(version: int, created: datetime, share: float) -> EscalationPolicy:
    return EscalationPolicy(
        model=LM,
        version=version,
        signal="router",
        threshold=0.4,
        max_quality_loss=0.01,
        policy={"calibration": {"edge_share": share, "num_items": 300}},
        data_sha256="0" * 64,
        data_items=300,
        signature="s",
        key_id="k",
        created_by="test",
        created_at=created,
    )


def _usage(
    s: Session, n: int, model: str, tier: str, reason: str | None, ago: timedelta, device: str | None = "d1"
) -> None:
    for _ in range(n):
        s.add(
            UsageRecord(
                id=f"r{s.info.setdefault('n', 0)}",
                tenant_id=1,
                device_id=device,
                model=model,
                tier=tier,
                escalation_reason=reason,
                occurred_at=NOW - ago,
            )
        )
        s.info["n"] += 1


def test_the_live_rate_counts_the_policy_s_decisions_apart_from_every_other_reason(db: Engine) -> None:
    minute = timedelta(minutes=1)
    with Session(db) as s:
        _usage(s, 80, "tierline/lm-edge-onnx-int8", "edge", None, minute)  # kept on the edge by the policy
        _usage(s, 12, "tierline/lm-cloud", "cloud", "low-confidence", minute)  # sent up by the policy
        _usage(s, 10, "tierline/lm-cloud", "cloud", "quality-high", minute)  # the request asked for the cloud
        _usage(s, 2, "tierline/lm-edge-onnx-int8", "edge", "low-confidence", minute)  # meant up, cloud unreachable
        _usage(s, 5, "tierline/lm-cloud", "cloud", None, minute, device=None)  # a direct cloud call: not the edge's
        _usage(s, 7, "tierline/lm-cloud", "shadow", "shadow", minute)  # the monitor's replays: not requests
        _usage(s, 9, "tierline/digits-small", "edge", None, minute)  # another model
        _usage(s, 4, "tierline/digits-large", "cloud", "low-confidence", minute)
        _usage(s, 30, "tierline/lm-edge-onnx-int8", "edge", None, timedelta(minutes=20))  # before the window
        s.commit()
        rate = live.live_rate(s, LM, now=NOW)
    assert rate.by_reason == {"edge": 80, "low-confidence": 12, "quality-high": 10, "cloud-unreachable": 2}
    assert rate.total == 104 and rate.decided == 92 and rate.edge_share == pytest.approx(80 / 92)
    assert rate.promised == 0.9 and rate.version == 1 and rate.window_s == 900
    assert rate.tolerance == pytest.approx(live.tolerance(0.9, 300, 92))
    assert rate.within is True  # 87.0 % against 90 % promised
    assert [r for r, _, _ in rate.shares()] == ["edge", "low-confidence", "quality-high", "cloud-unreachable"]
    line = rate.line()
    assert "87.0% on the edge of 92 the policy decided (promised 90.0% ± " in line and ": within)" in line
    assert rate.to_json()["by_reason"]["quality-high"] == 10


def test_a_live_share_far_from_the_promise_is_outside_it_and_a_new_version_starts_afresh(db: Engine) -> None:
    minute = timedelta(minutes=1)
    with Session(db) as s:
        _usage(s, 45, "tierline/lm-edge-onnx-int8", "edge", None, timedelta(minutes=10))
        _usage(s, 55, "tierline/lm-cloud", "cloud", "low-confidence", timedelta(minutes=10))
        s.commit()
        before = live.live_rate(s, LM, now=NOW)
        assert before.edge_share == pytest.approx(0.45) and before.within is False  # issue 40: 56 % against 92.5 %
        assert "OUTSIDE" in before.line()
        s.add(_policy(2, NOW - timedelta(minutes=5), 0.5))
        _usage(s, 3, "tierline/lm-edge-onnx-int8", "edge", None, minute)
        s.commit()
        after = live.live_rate(s, LM, now=NOW)
    assert after.version == 2 and after.by_reason == {"edge": 3}  # only what version 2 decided
    assert after.within is None  # too few requests to judge
    assert "too few to judge" in after.line()


def test_the_tolerance_is_two_standard_errors_of_the_difference_plus_slack() -> None:
    assert live.tolerance(0.5, 300, 150) == pytest.approx(
        2 * ((151 / 302) * (1 - 151 / 302) * (1 / 300 + 1 / 150)) ** 0.5 + 0.05
    )
    assert live.tolerance(1.0, 40, 40) > 0.1  # a 100 % promise on 40 items is not a certainty
    assert live.tolerance(0.8, 10_000, 10_000) == pytest.approx(0.05, abs=0.02)


def test_the_monitor_says_too_few_samples_until_an_alert_could_fire() -> None:
    # Issue 40's monitor: 0 agreements against 20.3 % promised on fewer samples than MIN_SAMPLES.
    few = Agreement(LM, 1, "dev", MIN_SAMPLES - 10, 0, 0.203)
    assert few.verdict == "too-few"
    enough = Agreement(LM, 1, "dev", MIN_SAMPLES, 0, 0.203)
    assert enough.verdict == "below"
    assert Agreement(LM, 1, "dev", 200, 40, 0.203).verdict == "consistent"
    assert Agreement(LM, 1, "dev", 200, 0, None).verdict == "no-promise"

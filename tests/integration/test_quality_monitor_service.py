"""The quality monitor's control-plane service on SQLite and PostgreSQL: a shadow batch is billed and counted once,
a group whose agreement falls below the promise gets one alert (with its audit entry and proposal), and an alert is
accepted or dismissed once."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import pytest
from sqlmodel import Session, select

from controlplane.billing import invoicing
from controlplane.billing.ledger import NewUsage
from controlplane.billing.pricing import period_of
from controlplane.policies import monitor, service
from controlplane.storage.database import create_db
from controlplane.storage.tables import AuditLog, Device, QualityAlert, ShadowSample, Tenant, UsageRecord
from shared.artifacts import load_or_create_signing_key
from shared.errors import ConflictError, NotFoundError
from tests.integration.test_quality_monitor import MICRO, micro_validation

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def validation(tiny_zoo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return micro_validation(tiny_zoo, tmp_path_factory.mktemp("validation") / "micro.jsonl")


@pytest.fixture
def session(migrated_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Session]:
    monkeypatch.setenv("TIERLINE_DATA_DIR", str(tmp_path / "data"))
    engine = create_db(migrated_db)
    with Session(engine) as s:
        yield s
    engine.dispose()


def _batch(
    tenant: Tenant, device: Device, batch: str, agree: int, disagree: int
) -> tuple[NewUsage, list[monitor.Sample]]:
    assert tenant.id is not None
    usage = NewUsage(
        id=f"edge-shadow-{batch}",
        tenant_id=tenant.id,
        model="tierline/digits-large",
        tier="shadow",
        occurred_at=datetime.now(UTC),
        rows=agree + disagree,
        device_id=device.id,
        rating=(None, Decimal("0.002")),
    )
    samples = [monitor.Sample(0.99, True)] * agree + [monitor.Sample(0.5 + i / 100, False) for i in range(disagree)]
    return usage, samples


def test_a_batch_counts_once_and_a_low_agreement_raises_one_alert(
    session: Session, validation: Path, tmp_path: Path
) -> None:
    key = load_or_create_signing_key(tmp_path / "signing.key")
    v1 = service.calibrate(session, MICRO, max_quality_loss=0.01, actor="test", key=key, data=validation)
    tenant = Tenant(name="acme")
    session.add(tenant)
    session.flush()
    assert tenant.id is not None
    device = Device(id="dev-1", tenant_id=tenant.id, labels={"ring": "beta"}, token_hash="h")
    session.add(device)
    session.flush()
    promised = monitor.promised_agreement(v1)
    assert promised is not None and 0.95 < promised <= 1.0

    def record(batch: str, agree: int, disagree: int) -> tuple[bool, QualityAlert | None]:
        usage, samples = _batch(tenant, device, batch, agree, disagree)
        result = monitor.record_batch(session, usage, model=MICRO, policy_version=1, group="beta", samples=samples)
        session.commit()
        return result

    assert record("a", 20, 0) == (True, None)
    assert record("a", 20, 0) == (False, None)  # the retry: nothing billed or counted again
    assert len(session.exec(select(ShadowSample)).all()) == 20
    (usage,) = session.exec(select(UsageRecord)).all()
    assert usage.tier == "shadow" and usage.rows == 20 and usage.cost == Decimal("0.002")

    # On the month's invoice the shadow work is its own line, labelled shadow.
    draft = invoicing.month_invoice(session, tenant, period_of(datetime.now(UTC)))
    (line,) = draft["lines"]
    assert line["tier"] == "shadow" and "(shadow)" in line["description"], line

    is_new, alert = record("b", 15, 5)  # 35 of 40 agree: below the promise with 99 % confidence
    assert is_new and alert is not None
    assert (alert.num_samples, alert.num_agreements, alert.device_group) == (40, 35, "beta")
    assert alert.upper_bound < promised and alert.proposed_threshold == pytest.approx(0.99)
    assert record("c", 0, 10) == (True, None)  # one alert per model, version and group
    (audit,) = session.exec(select(AuditLog).where(AuditLog.action == "quality_alert.raise")).all()
    assert audit.after is not None and audit.after["samples"] == 40
    (table,) = monitor.agreement_table(session, MICRO)
    assert (table.num_samples, table.num_agreements, table.promised) == (50, 35, promised)

    assert alert.id is not None
    monitor.dismiss(session, alert.id, actor="console:ops")
    session.commit()
    with pytest.raises(ConflictError):
        monitor.accept(session, alert.id, actor="console:ops", key=key)
    with pytest.raises(NotFoundError):
        monitor.dismiss(session, 9999, actor="console:ops")
    assert monitor.alerts(session, MICRO, only_open=True) == []
    assert [v.version for v in service.versions_of(session, MICRO)] == [1]  # dismissing makes no version

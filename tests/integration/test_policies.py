"""Escalation policies as registry objects (SQLite and PostgreSQL): calibrated in the control plane from a real
validation set of the tiny zoo's digits classifiers, signed, versioned; the operating point moved on the stored
curve; each device sent the newest version that targets it; release targets by labels and device facts."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from sqlmodel import Session, select

from controlplane.fleet.targets import release_targets, set_release_target, targets_device
from controlplane.policies import service
from controlplane.storage.database import create_db
from controlplane.storage.session import get_db
from controlplane.storage.tables import AuditLog, Device, EscalationPolicy, Tenant
from shared.artifacts import load_or_create_signing_key
from shared.errors import ArtifactVerificationError, NotFoundError, ValidationError
from shared.escalation import EdgePolicy
from shared.policy_signing import verify_policy
from shared.targeting import matches, parse_target

pytestmark = pytest.mark.integration
DIGITS = "tierline/digits-small"


def digits_validation(zoo: Path, dest: Path) -> Path:
    """The validation half of both digits classifiers on the held-out digits (what bench cascade exports)."""
    from bench.cascade_bench import evaluate, export_validation
    from bench.cascade_tasks import run_digits
    from shared.zoo.registry import ZooLayout

    task = run_digits(ZooLayout(zoo))
    export_validation(dest, [(task, evaluate(task, 0).validation_rows)])
    return dest


@pytest.fixture(scope="module")
def validation(tiny_zoo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return digits_validation(tiny_zoo, tmp_path_factory.mktemp("validation") / "digits.jsonl")


@pytest.fixture
def session(migrated_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Session]:
    monkeypatch.setenv("TIERLINE_DATA_DIR", str(tmp_path / "data"))
    engine = create_db(migrated_db)
    with Session(engine) as s:
        yield s
    engine.dispose()


def _device(session: Session, name: str, labels: dict[str, str], runtime: dict[str, object]) -> Device:
    tenant = session.exec(select(Tenant)).first()
    if tenant is None:
        tenant = Tenant(name="acme")
        session.add(tenant)
        session.flush()
    assert tenant.id is not None
    device = Device(id=f"dev-{name}", tenant_id=tenant.id, labels=labels, token_hash=f"h-{name}", runtime=runtime)
    session.add(device)
    session.flush()
    return device


def test_a_calibrated_policy_is_a_signed_version_with_its_curve_and_data(
    session: Session, validation: Path, tmp_path: Path
) -> None:
    key = load_or_create_signing_key(tmp_path / "signing.key")
    row = service.calibrate(session, "digits-small", max_quality_loss=0.01, data=validation, actor="t", key=key)
    assert (row.model, row.version, row.max_quality_loss) == (DIGITS, 1, 0.01)
    lines = [json.loads(line) for line in validation.read_text().splitlines()]
    assert row.data_items == len(lines) > 100
    cal = row.policy["calibration"]
    assert cal["curve"] and cal["quality"] >= cal["cloud_only_quality"] - 0.01
    assert 0.5 < cal["edge_share"] <= 1.0  # the digits classifiers are good: most rows stay local
    verify_policy([key.public_key()], row.model, row.version, row.target, row.policy, row.key_id, row.signature)
    tampered = {**row.policy, "threshold": row.threshold - 1}
    with pytest.raises(ArtifactVerificationError, match="bad signature"):
        verify_policy([key.public_key()], row.model, row.version, row.target, tampered, row.key_id, row.signature)
    other = load_or_create_signing_key(tmp_path / "other.key")
    with pytest.raises(ArtifactVerificationError, match="untrusted key"):
        verify_policy([other.public_key()], row.model, row.version, row.target, row.policy, row.key_id, row.signature)
    # The set is kept: recalibrating needs no file, and makes the next version.
    again = service.calibrate(session, DIGITS, max_quality_loss=0.05, actor="t", key=key)
    assert again.version == 2 and again.data_sha256 == row.data_sha256
    actions = session.exec(select(AuditLog.action).where(AuditLog.target == f"escalation_policy/{DIGITS}")).all()
    assert actions == ["escalation_policy.calibrate", "escalation_policy.calibrate"]


def test_moving_the_operating_point_reads_the_stored_curve(session: Session, validation: Path, tmp_path: Path) -> None:
    key = load_or_create_signing_key(tmp_path / "signing.key")
    first = service.calibrate(session, DIGITS, max_quality_loss=0.01, data=validation, actor="t", key=key)
    strict = service.move_operating_point(session, DIGITS, max_quality_loss=0.0, actor="admin", key=key)
    loose = service.move_operating_point(session, DIGITS, max_quality_loss=0.5, actor="admin", key=key)
    assert [strict.version, loose.version] == [2, 3] and strict.derived_from == 1 and loose.derived_from == 2
    assert strict.signal == loose.signal == first.signal
    shares = [v.policy["calibration"]["edge_share"] for v in (strict, first, loose)]
    assert shares[0] < shares[1] <= shares[2] == 1.0
    assert strict.threshold > first.threshold >= loose.threshold
    # The new threshold does what the curve says on the validation data it came from.
    from shared.calibration import read_validation, router_inputs

    data = read_validation(validation, DIGITS)
    policy = EdgePolicy.from_json(strict.policy)
    assert policy.router is not None
    conf = policy.router.confidences(router_inputs(data))
    assert float(np.mean(conf >= strict.threshold)) == pytest.approx(shares[0])
    quality = float(np.where(conf >= strict.threshold, data.edge_good, data.cloud_good).mean())
    assert quality >= float(data.cloud_good.mean()) - 1e-12
    with pytest.raises(ValidationError, match="max_quality_loss"):
        service.move_operating_point(session, DIGITS, max_quality_loss=2.0, actor="admin", key=key)
    with pytest.raises(NotFoundError):
        service.move_operating_point(session, "tierline/nothing", max_quality_loss=0.1, actor="admin", key=key)


def test_each_device_gets_the_newest_version_that_targets_it(
    session: Session, validation: Path, tmp_path: Path
) -> None:
    key = load_or_create_signing_key(tmp_path / "signing.key")
    arm = {"machine": "aarch64", "memory_mb": 2048, "runtimes": ["onnxruntime"], "cpus": 4}
    x86 = {"machine": "x86_64", "memory_mb": 16384, "runtimes": ["onnxruntime", "tflite"], "cpus": 8}
    beta = _device(session, "beta", {"ring": "beta"}, arm)
    dev = _device(session, "dev", {"ring": "dev"}, x86)
    service.calibrate(session, DIGITS, max_quality_loss=0.01, data=validation, actor="t", key=key)
    service.move_operating_point(session, DIGITS, max_quality_loss=0.0, target=["ring=beta"], actor="t", key=key)
    assert [(p.model, p.version) for p in service.desired_for(session, beta)] == [(DIGITS, 2)]
    assert [(p.model, p.version) for p in service.desired_for(session, dev)] == [(DIGITS, 1)]
    big = service.move_operating_point(
        session, DIGITS, max_quality_loss=0.02, target=["device.memory_mb>=4096"], actor="t", key=key
    )
    assert [p.version for p in service.desired_for(session, dev)] == [big.version]
    assert [p.version for p in service.desired_for(session, beta)] == [2]
    with pytest.raises(ValidationError, match=r"device\.colour"):
        service.move_operating_point(
            session, DIGITS, max_quality_loss=0.1, target=["device.colour=red"], actor="t", key=key
        )


def test_release_targets_select_by_labels_and_facts(session: Session) -> None:
    beta = _device(session, "b", {"ring": "beta", "site": "lab"}, {"machine": "aarch64", "runtimes": ["onnxruntime"]})
    dev = _device(session, "d", {"ring": "dev"}, {"machine": "x86_64", "runtimes": ["onnxruntime", "tflite"]})
    set_release_target(session, "lm-edge-onnx-int8", "b1", ["ring=beta"], actor="t")
    set_release_target(session, "lm-edge-tflite", "t1", ["device.runtime=tflite"], actor="t")
    targets = release_targets(session)
    assert targets_device(targets[("lm-edge-onnx-int8", "b1")], beta)
    assert not targets_device(targets[("lm-edge-onnx-int8", "b1")], dev)
    assert targets_device(targets[("lm-edge-tflite", "t1")], dev)
    assert not targets_device(targets[("lm-edge-tflite", "t1")], beta)
    assert targets_device(targets.get(("lm-edge-onnx", "x")), dev)  # no target: every device
    set_release_target(session, "lm-edge-onnx-int8", "b1", [], actor="t")  # cleared: every device again
    assert ("lm-edge-onnx-int8", "b1") not in release_targets(session)


@pytest.mark.parametrize(
    ("terms", "labels", "runtime", "expected"),
    [
        (["ring=beta"], {"ring": "beta"}, {}, True),
        (["ring!=beta"], {"ring": "dev"}, {}, True),
        (["ring!=beta"], {}, {}, False),  # an unknown label never matches, not even !=
        (["device.arch=x86_64", "device.memory_mb>=1024"], {}, {"machine": "x86_64", "memory_mb": 2048}, True),
        (["device.memory_mb<=1024"], {}, {"memory_mb": 2048}, False),
        (["device.runtime!=tflite"], {}, {"runtimes": ["onnxruntime"]}, True),
        (["device.cpus>=2"], {}, {}, False),
    ],
)
def test_target_terms(terms: list[str], labels: dict[str, str], runtime: dict[str, object], expected: bool) -> None:
    assert matches(parse_target(terms), labels, runtime) is expected


def test_a_bucket_target_is_a_sticky_share_of_the_fleet() -> None:
    ids = [f"dev-{i:04x}" for i in range(400)]
    first_fifth = parse_target(["device.bucket<=19"])
    rest = parse_target(["device.bucket>=20"])
    picked = [i for i in ids if matches(first_fifth, {}, {}, i)]
    assert 0.15 < len(picked) / len(ids) < 0.25  # 20 % of the fleet, give or take the hash
    assert picked == [i for i in ids if matches(first_fifth, {}, {}, i)]  # the same devices every time
    assert sorted(picked + [i for i in ids if matches(rest, {}, {}, i)]) == sorted(ids)  # and the rest is the rest
    assert not matches(first_fifth, {}, {})  # no id, no bucket: not targeted


@pytest.mark.parametrize("bad", ["ring", "ring>=2", "device.memory_mb>=lots", "=x", "device.gpu=yes"])
def test_bad_target_terms_are_refused_naming_the_term(bad: str) -> None:
    with pytest.raises(ValidationError) as info:
        parse_target([bad])
    assert info.value.param == "target"


def test_cli_calibrates_and_moves_and_lists(
    migrated_db: str, validation: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from controlplane.policies.cli import policies

    monkeypatch.setenv("TIERLINE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("TIERLINE_DATABASE_URL", migrated_db)
    runner = CliRunner()
    out = runner.invoke(policies, ["calibrate", "--model", DIGITS, "--data", str(validation)])
    assert out.exit_code == 0, out.output
    assert f"{DIGITS} v1:" in out.output and "for all devices" in out.output
    out = runner.invoke(policies, ["set-operating-point", "--model", "digits-small", "--max-quality-loss", "0"])
    assert out.exit_code == 0 and f"{DIGITS} v2:" in out.output, out.output
    listed = runner.invoke(policies, ["list", "--json"])
    assert [p["version"] for p in json.loads(listed.output)] == [2, 1]
    missing = runner.invoke(policies, ["calibrate", "--model", "tierline/lm-edge"])
    assert missing.exit_code != 0 and "no validation data" in str(missing.exception or missing.output)
    engine = create_db(migrated_db)
    with Session(engine) as s:
        assert len(s.exec(select(EscalationPolicy)).all()) == 2
    engine.dispose()
    get_db().dispose()  # the CLI's pooled connections, before the test's schema is dropped

"""What policy rollouts cost the control plane: the per-sync choice of a device's policy versions
(``controlplane.policies.service.desired_rows``) without and with a running policy rollout, and one controller
judgement of a policy rollout (``policy_window``) over a fleet's telemetry and ledger.

On two fresh SQLite files, identical but for a running policy rollout in the second: ``--devices`` devices,
``--models`` edge models with 3 policy versions each, ``--samples`` telemetry samples and 2 usage records per
device. The two ``desired_rows`` contenders alternate over ``--rounds`` rounds (each round: every device once);
medians and their ratio are reported.

    python -m bench.fleet_bench --devices 500 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

from sqlmodel import Session, select

from controlplane.policies import service as policies
from controlplane.rollouts.service import (
    RolloutSpec,
    create_rollout,
    get_rollout,
    policy_window,
    run_controller_pass,
)
from controlplane.storage.database import create_db
from controlplane.storage.migrate import upgrade
from controlplane.storage.tables import Device, DeviceEvent, Tenant, UsageRecord
from shared.artifacts import load_or_create_signing_key
from shared.escalation import EdgePolicy


def _seed(session: Session, devices: int, models: int, samples: int, key_path: Path) -> list[str]:
    tenant = Tenant(name="bench")
    session.add(tenant)
    session.flush()
    assert tenant.id is not None
    key = load_or_create_signing_key(key_path)
    names = [f"tierline/edge-{m}" for m in range(models)]
    for name in names:
        for threshold in (-3.0, -2.0, -1.0):
            policies._store(
                session,
                EdgePolicy(model=name, threshold=threshold),
                max_quality_loss=0.01,
                data_sha256="0" * 64,
                data_items=0,
                target=[],
                derived_from=None,
                actor="bench",
                key=key,
                action="escalation_policy.calibrate",
            )
    now = datetime.now(UTC)
    for i in range(devices):
        device_id = f"dev-{i:05d}"
        session.add(
            Device(
                id=device_id,
                tenant_id=tenant.id,
                labels={"ring": "beta" if i % 2 else "prod"},
                token_hash=f"h{i}",
                policies={n: "2" for n in names},
            )
        )
        for s in range(samples):
            metrics = {f"{names[0]}@v1": {"requests": 100 * (s + 1), "errors": 0, "escalations": 10 * (s + 1)}}
            session.add(
                DeviceEvent(
                    id=uuid.uuid4().hex,
                    device_id=device_id,
                    tenant_id=tenant.id,
                    kind="telemetry",
                    payload={"metrics": metrics},
                    occurred_at=now + timedelta(seconds=s + 1),
                )
            )
        for tier in ("edge", "cloud"):
            session.add(
                UsageRecord(
                    id=uuid.uuid4().hex,
                    tenant_id=tenant.id,
                    device_id=device_id,
                    model=names[0] if tier == "edge" else "tierline/lm-cloud",
                    tier=tier,
                    escalation_reason="low-confidence" if tier == "cloud" else None,
                    cost=Decimal("0.0001"),
                    price_id=1,
                    occurred_at=now + timedelta(seconds=1),
                )
            )
    session.commit()
    return names


def _desired_round(engine: Any) -> float:
    """Seconds to choose the policy versions of every device once (one session per device, as a sync)."""
    with Session(engine) as session:
        ids = list(session.exec(select(Device.id)))
    start = time.perf_counter()
    for device_id in ids:
        with Session(engine) as session:
            device = session.get(Device, device_id)
            assert device is not None
            policies.desired_rows(session, device)
    return time.perf_counter() - start


def run(devices: int, models: int, samples: int, rounds: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        engines = {}
        for which in ("no_rollout", "running_policy_rollout"):  # two identical fleets, a rollout in the second
            url = f"sqlite:///{Path(tmp) / which}.db"
            upgrade(url)
            engines[which] = create_db(url)
            with Session(engines[which]) as session:
                names = _seed(session, devices, models, samples, Path(tmp) / "signing.key")
        spec = RolloutSpec(
            model=names[0],
            baseline_version="2",
            candidate_version="3",
            kind="policy",
            device_selector={"ring": "beta"},
            steps=[50, 100],
            min_step_s=0,
            min_samples=1,
        )
        engine = engines["running_policy_rollout"]
        with Session(engine) as session:
            rollout_id = create_rollout(session, spec, actor="bench").id or 0
            session.commit()
        run_controller_pass(engine)  # running: beta devices are assigned by arm from now on
        with Session(engine) as session:  # every device reports running the version it is sent (converged)
            for device in session.exec(select(Device)).all():
                device.policies = {r.model: str(r.version) for r in policies.desired_rows(session, device)}
                session.add(device)
            session.commit()
        times: dict[str, list[float]] = {which: [] for which in engines}
        for _ in range(rounds):  # alternate the contenders so load changes hit both alike
            for which, eng in engines.items():
                times[which].append(1000 * _desired_round(eng) / devices)
        windows = []
        with Session(engine) as session:
            rollout = get_rollout(session, rollout_id)
            since = datetime.now(UTC) - timedelta(minutes=1)
            for _ in range(rounds):
                start = time.perf_counter()
                window = policy_window(session, rollout, since, datetime.now(UTC) + timedelta(hours=1))
                windows.append(time.perf_counter() - start)
        for eng in engines.values():
            eng.dispose()
    medians = {which: statistics.median(values) for which, values in times.items()}
    return {
        "bench": "fleet_policy_rollouts",
        "devices": devices,
        "models": models,
        "telemetry_samples_per_device": samples,
        "rounds": rounds,
        "db": "sqlite",
        "desired_rows_ms_per_sync_median": {
            **{which: round(value, 4) for which, value in medians.items()},
            "ratio": round(medians["running_policy_rollout"] / medians["no_rollout"], 3),
        },
        "policy_window_ms_median": round(1000 * statistics.median(windows), 2),
        "window_arms": {
            "baseline_requests": window.baseline.requests,
            "candidate_requests": window.candidate.requests,
            "devices": [window.baseline.num_devices, window.candidate.num_devices],
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=500)
    parser.add_argument("--models", type=int, default=2)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(json.dumps(run(args.devices, args.models, args.samples, args.rounds), indent=2))


if __name__ == "__main__":
    main()

"""What ``tierline up`` seeds so the embedded platform starts connected: the demo tenant (key, monthly budget),
the zoo's models in the registry (``stable`` aliases, edge exports derived from their checkpoint), a price book
where edge tokens cost less than cloud tokens, the local agent enrolled as a device, and a calibrated escalation
policy per edge model (a signed version in the control plane, delivered to the agent at its next sync).

Every step is idempotent (it looks before it creates) and goes through the control plane's own service
functions, audited with the CLI's actor, so a second ``tierline up`` on the same data directory creates nothing.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

logger = logging.getLogger(__name__)

DEMO_TENANT = "demo"
DEMO_BUDGET = Decimal("50.00")  # per month, in the tenant's currency
DEVICE_NAME = "local"
DEVICE_LABELS = {"site": "local", "ring": "dev"}
KEY_NAME = "tierline up"

# Per million tokens (prompt, completion). The edge's tokens run on the customer's device: ten times cheaper.
EDGE_PRICE = (Decimal("0.05"), Decimal("0.15"))
CLOUD_PRICE = (Decimal("0.50"), Decimal("1.50"))
EDGE_MODELS = (
    "tierline/lm-edge",
    "tierline/lm-edge-onnx",
    "tierline/lm-edge-onnx-int8",
    "tierline/lm-edge-tflite",
    "tierline/digits-small",
)
CLOUD_MODELS = ("tierline/lm-cloud", "tierline/digits-large")

# Registry: (registry name, zoo artifact dir) per cloud checkpoint or classifier; a model's edge exports become
# one version derived from its checkpoint's version.
REGISTRY_MODELS = (("lm-cloud", "lm-cloud"), ("lm-edge", "lm-edge"))
REGISTRY_CLASSIFIERS = (
    ("digits-large", "digits-large"),
    ("digits-small", "digits-small"),
    ("digits-micro", "digits-micro"),
)
# Edge registry model -> the cloud model its escalations go to (sent to devices at sync): the zoo's engines, as the
# agent's built-in table had it.
ZOO_PAIRS = {
    "lm-edge": "tierline/lm-cloud",
    "digits-small": "tierline/digits-large",
    "digits-micro": "tierline/digits-large",
}
EDGE_EXPORTS = {"lm-edge": ("lm-edge-onnx", "lm-edge-onnx-int8", "lm-edge-tflite")}
EDGE_ALIAS = "edge"
MAX_QUALITY_LOSS = 0.01  # the demo policies' bound: one point below cloud-only quality
# Demo LM requests for the calibration data, per preset (half of them are the validation half the policy is
# calibrated on): 300 demo validation items put two standard errors of the promised edge share at about 0.05, and
# the first start's calibration at about 4 minutes on a busy 2-core host (docs/routing.md).
VALIDATION_LINES = {"tiny": 60, "demo": 600}
# The cascade tasks whose validation items calibrate the policies of EDGE_MODELS: ``lm-traffic`` is the demo's own
# traffic (``tierline demo traffic``'s generator, run through the agent's code), so ``tierline/lm-edge``'s promise
# is about the requests it will decide (the graded next-token benchmarks export no rows, and digits-micro's pair is
# not served here). Running only these keeps the first start short.
VALIDATION_TASKS = ("digits", "lm-traffic")


@dataclass(slots=True)
class Seeded:
    """What one seeding pass created (empty lists on a second run)."""

    created: list[str] = field(default_factory=list)

    def add(self, what: str) -> None:
        self.created.append(what)
        logger.debug("seeded %s", what)


def _actor() -> str:
    from controlplane.storage.audit import cli_actor

    return cli_actor()


def seed_tenant(previous_key: str | None, seeded: Seeded, *, budget: bool) -> str:
    """The demo tenant's key: the one from the last run while it is still valid, else a new one. The tenant is
    created (with a monthly budget unless ``budget`` is False) when missing; one without a budget gets it."""
    from controlplane.storage.audit import audit
    from controlplane.storage.session import session_scope
    from controlplane.tenancy.service import authenticate, create_api_key, create_tenant, get_tenant, list_tenants
    from shared.errors import AuthenticationError

    actor = _actor()
    with session_scope() as session:
        if not any(t.name == DEMO_TENANT for t in list_tenants(session)):
            tenant = create_tenant(session, DEMO_TENANT, budget=DEMO_BUDGET if budget else None)
            after = {"name": tenant.name, "monthly_budget": str(tenant.monthly_budget), "currency": tenant.currency}
            audit(session, actor, "tenant.create", f"tenant/{tenant.name}", None, after)
            seeded.add(f"tenant {DEMO_TENANT}")
        tenant = get_tenant(session, DEMO_TENANT)
        if budget and tenant.monthly_budget is None:
            tenant.monthly_budget = DEMO_BUDGET
            session.add(tenant)
            after = {"monthly_budget": str(DEMO_BUDGET), "currency": tenant.currency}
            audit(session, actor, "tenant.update", f"tenant/{tenant.name}", {"monthly_budget": None}, after)
            seeded.add(f"budget {DEMO_BUDGET} {tenant.currency}/month")
        if previous_key is not None:
            try:
                owner, _ = authenticate(session, previous_key)
                if owner.name == DEMO_TENANT:
                    return previous_key
            except AuthenticationError:
                pass
        issued = create_api_key(session, tenant, name=KEY_NAME)
        after = {"tenant": DEMO_TENANT, "name": KEY_NAME, "prefix": issued.record.prefix}
        audit(session, actor, "api_key.create", f"api_key/{issued.record.id}", None, after)
        seeded.add("api key")
        return issued.secret


def seed_registry(zoo_root: Path, seeded: Seeded) -> None:
    """The zoo's models, each with a ``stable`` alias; a model's edge exports are a version derived from its
    checkpoint's (alias ``edge``). A model that already has ``stable`` is left as it is. Then the edge models'
    cloud pairs (``seed_pairings``)."""
    from controlplane.registry import artifacts as reg_artifacts
    from controlplane.registry import service as registry
    from controlplane.registry.store import store_from_settings
    from controlplane.storage.session import session_scope
    from shared.artifacts import FileEntry

    store = store_from_settings()
    key = reg_artifacts.platform_signing_key()
    actor = _actor()
    artifacts = zoo_root / "artifacts"
    for name, directory, kind in [
        *((n, d, "causal-lm") for n, d in REGISTRY_MODELS),
        *((n, d, "tensor") for n, d in REGISTRY_CLASSIFIERS),
    ]:
        path = artifacts / directory
        if not path.is_dir():
            continue
        with session_scope() as session:
            existing = [m for m in registry.list_models(session) if m.name == name]
            if existing and "stable" in registry.aliases_of(session, existing[0]):
                continue
            if kind == "tensor":  # a classifier is its one .onnx file
                path = path / "model.onnx"
            pushed = reg_artifacts.push_path(
                session, store, path, name=name, kind=kind, label="zoo", alias="stable", actor=actor, signing_key=key
            )
            seeded.add(f"registry {name} v{pushed.version.number} (stable)")
            exports = [
                artifacts / e for e in EDGE_EXPORTS.get(name, ()) if (artifacts / e / "edge_model.json").is_file()
            ]
            if not exports:
                continue
            source = pushed.version
            derived = registry.register_version(
                session,
                pushed.model,
                label="zoo-edge",
                source=f"derived from version {source.number}",
                tags=["derived", "edge"],
                derived_from_id=source.id,
                actor=actor,
            )
            parent = {"name": f"{name}@{source.number}", "sha256": pushed.artifact.sha256}
            for export in exports:
                local = reg_artifacts.inspect_path(export)
                files = []
                for rel, p in local.files:
                    blob = store.put_file(p)
                    files.append(FileEntry(rel, blob.size, blob.sha256))
                reg_artifacts.add_artifact(
                    session,
                    store,
                    pushed.model,
                    derived,
                    target=local.target,
                    format=local.format,
                    files=files,
                    signing_key=key,
                    actor=actor,
                    derived_from=parent,
                    metadata={**local.metadata, "derived_by": "tierline zoo build"},
                )
            registry.move_alias(session, pushed.model, EDGE_ALIAS, derived.number, actor=actor)
            seeded.add(f"registry {name} v{derived.number} ({len(exports)} edge artifacts, from v{source.number})")
    seed_pairings(seeded)


def seed_pairings(seeded: Seeded) -> None:
    """Pair the zoo's edge models with their cloud models (``ZOO_PAIRS``), unless a model was ever paired (or
    unpaired) by someone: what an operator chose stays."""
    from sqlmodel import col, select

    from controlplane.registry import artifacts as reg_artifacts
    from controlplane.registry import service as registry
    from controlplane.registry.store import store_from_settings
    from controlplane.storage.session import session_scope
    from controlplane.storage.tables import AuditLog

    store = store_from_settings()
    with session_scope() as session:
        for name, cloud_model in ZOO_PAIRS.items():
            model = next((m for m in registry.list_models(session) if m.name == name), None)
            if model is None:
                continue
            ever = session.exec(
                select(AuditLog.id).where(col(AuditLog.target) == f"model/{name}", col(AuditLog.action) == "model.pair")
            ).first()
            if ever is not None:
                continue
            resend = reg_artifacts.default_resend(session, store, model, cloud_model)
            registry.set_pairing(session, model, cloud_model, resend=resend, actor=_actor())
            seeded.add(f"pair {name} -> {cloud_model} ({resend})")


def seed_prices(seeded: Seeded) -> None:
    """Edge and cloud prices per model id, for any model that has none yet."""
    from controlplane.billing.invoicing import PriceSpec, add_price, list_prices
    from controlplane.storage.session import session_scope

    actor = _actor()
    with session_scope() as session:
        for models, tier, (prompt, completion) in (
            (EDGE_MODELS, "edge", EDGE_PRICE),
            (CLOUD_MODELS, "cloud", CLOUD_PRICE),
        ):
            for model in models:
                if list_prices(session, model):
                    continue
                spec = PriceSpec(model=model, prompt_per_mtok=prompt, completion_per_mtok=completion, tier=tier)
                add_price(session, spec, actor=actor)
                seeded.add(f"price {model} ({tier})")


def device_is_enrolled(home: Path) -> bool:
    """Whether the agent's stored credential is still a live device of the demo tenant."""
    from controlplane.fleet.devices import authenticate_device
    from controlplane.storage.session import session_scope
    from edge_agent.cloud_link import Credentials
    from shared.errors import ApplicationError

    try:
        creds = Credentials.load(home)
    except ApplicationError as exc:
        logger.warning("the agent's credentials are unreadable (%s); enrolling it again", exc.message)
        return False
    if creds is None:
        return False
    with session_scope() as session:
        try:
            _, tenant = authenticate_device(session, creds.device_token)
        except ApplicationError:
            return False
        return tenant.name == DEMO_TENANT


def enroll_agent(cloud_url: str, home: Path, seeded: Seeded) -> None:
    """Enroll the local agent as a device of the demo tenant (labels ``site=local``, ``ring=dev``) through the
    running cloud, as ``tierline edge enroll`` does; nothing when it already is."""
    from controlplane.fleet.devices import create_enrollment_token
    from controlplane.storage.audit import audit
    from controlplane.storage.session import session_scope
    from controlplane.tenancy.service import get_tenant
    from edge_agent.agent import runtime_summary
    from edge_agent.cloud_link import enroll

    if device_is_enrolled(home):
        return
    with session_scope() as session:
        issued = create_enrollment_token(
            session, get_tenant(session, DEMO_TENANT), labels=DEVICE_LABELS, ttl=timedelta(minutes=10)
        )
        after = {"tenant": DEMO_TENANT, "labels": DEVICE_LABELS, "ttl_hours": 1 / 6}
        audit(session, _actor(), "enrollment_token.create", f"enrollment_token/{issued.id}", None, after)
    creds = enroll(cloud_url, issued.secret, DEVICE_NAME, DEVICE_LABELS, runtime_summary())
    creds.save(home)
    seeded.add(f"device {creds.device_id} ({', '.join(f'{k}={v}' for k, v in DEVICE_LABELS.items())})")


def _policy_models(validation: Path) -> list[str]:
    """The edge models of the validation data that the local agent serves (the data also holds pairs the agent
    does not run, such as ``tierline/digits-micro``: those get no policy)."""
    models: list[str] = []
    for line in validation.read_text().splitlines():
        model = json.loads(line).get("model") if line.strip() else None
        if isinstance(model, str) and model in EDGE_MODELS and model not in models:
            models.append(model)
    return models


def validation_path(data_dir: Path, preset: str) -> Path:
    return data_dir / "demo" / f"validation-{preset}.jsonl"


def policies_ready(data_dir: Path, preset: str) -> bool:
    """Whether every edge model of the cached validation data has a policy in the control plane."""
    from controlplane.policies import service
    from controlplane.storage.session import session_scope

    validation = validation_path(data_dir, preset)
    try:
        if not validation.is_file():
            return False
        with session_scope() as session:
            return all(service.versions_of(session, m) for m in _policy_models(validation))
    except (OSError, ValueError):
        return False


def calibrate_policies(zoo_dir: Path, preset: str, data_dir: Path, log: Callable[[str], None]) -> list[str]:
    """A calibrated escalation policy per edge model in the control plane (a signed registry version the agent
    receives at its next sync), from validation items that ``tierline bench cascade --export-validation`` writes
    once per preset (cached in the data dir); a model that already has a policy keeps it. Returns the models
    calibrated now."""
    from controlplane.policies import service
    from controlplane.registry.artifacts import platform_signing_key
    from controlplane.storage.session import session_scope

    validation = validation_path(data_dir, preset)
    tierline = [sys.executable, "-m", "tierline.cli"]
    if not validation.is_file():
        log(f"calibration data: running both tiers on held-out items once ({validation})")
        validation.parent.mkdir(parents=True, exist_ok=True)
        partial = validation.with_suffix(".partial")
        cmd = [*tierline, "bench", "cascade", "--preset", preset, "--zoo-dir", str(zoo_dir), "--json"]
        cmd += ["--lines", str(VALIDATION_LINES.get(preset, 160)), "--export-validation", str(partial)]
        cmd += ["--tasks", ",".join(VALIDATION_TASKS)]
        _check(subprocess.run(cmd, capture_output=True, text=True, check=False), "tierline bench cascade")
        partial.rename(validation)
    done = []
    key = platform_signing_key()
    for model in _policy_models(validation):
        with session_scope() as session:
            if service.versions_of(session, model):
                continue
            row = service.calibrate(
                session, model, max_quality_loss=MAX_QUALITY_LOSS, data=validation, actor=_actor(), key=key
            )
            logger.debug("%s: policy v%s, %s < %.4g escalates", model, row.version, row.signal, row.threshold)
        done.append(model)
    return done


def _check(proc: subprocess.CompletedProcess[str], what: str) -> None:
    from shared.errors import ConfigurationError

    logger.debug("%s: %s", what, proc.stderr.strip()[-4000:])
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise ConfigurationError(f"{what} failed ({proc.returncode}): {tail[0]}")

"""``tierline devices``: enrollment tokens and the fleet's device records. Changes write an audit_log row."""

from __future__ import annotations

import click


def _labels(values: tuple[str, ...]) -> dict[str, str]:
    labels = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--label")
        labels[key] = value
    return labels


@click.group()
def devices() -> None:
    """Edge devices: enrollment tokens, list, revoke."""


@devices.command("enrollment-token")
@click.option("--tenant", "tenant_name", required=True, help="tenant the device will belong to")
@click.option(
    "--label",
    "labels",
    multiple=True,
    help="KEY=VALUE label given to the device (repeatable). Billing: billing.key=KEY_ID, billing.project=NAME, "
    "billing.user=END_USER (its default end user), billing.subjects=any (its requests may name other end users)",
)
@click.option("--ttl-hours", type=click.FloatRange(min=0, min_open=True), default=24.0, show_default=True)
def enrollment_token(tenant_name: str, labels: tuple[str, ...], ttl_hours: float) -> None:
    """Create a one-time enrollment token and print it once (only its hash is stored).

    On the device: tierline edge enroll --cloud URL --token TOKEN

    The billing.* labels say whose budgets the device's traffic counts against, and only the token gives them:
    billing.key, billing.project, and billing.user, the device's end user. A request on the device may name
    another end user (x-tierline-subject, or its user field) only with billing.subjects=any; without it the
    agent refuses such a request (400), the cloud refuses such an escalation (403) and books such a synced record
    to billing.user.
    """
    from datetime import timedelta

    from controlplane.fleet.devices import create_enrollment_token
    from controlplane.storage.audit import audit, cli_actor
    from controlplane.storage.session import session_scope
    from controlplane.tenancy.service import get_tenant

    parsed = _labels(labels)
    with session_scope() as session:
        issued = create_enrollment_token(
            session, get_tenant(session, tenant_name), labels=parsed, ttl=timedelta(hours=ttl_hours)
        )
        after = {"tenant": tenant_name, "labels": parsed, "ttl_hours": ttl_hours}
        audit(session, cli_actor(), "enrollment_token.create", f"enrollment_token/{issued.id}", None, after)
        note = f"enrollment token {issued.id} for tenant {tenant_name}, valid {ttl_hours:g} h (shown once):"
        click.echo(note, err=True)
        click.echo(issued.secret)


@devices.command("list")
@click.option("--tenant", "tenant_name", required=True, help="tenant name")
def devices_list(tenant_name: str) -> None:
    """List a tenant's devices: id, status, last seen, loaded model versions."""
    from sqlmodel import col, select

    from controlplane.storage.session import session_scope
    from controlplane.storage.tables import Device
    from controlplane.tenancy.service import get_tenant

    with session_scope() as session:
        tenant = get_tenant(session, tenant_name)
        rows = session.exec(select(Device).where(Device.tenant_id == tenant.id).order_by(col(Device.enrolled_at)))
        for d in rows:
            seen = d.last_seen_at.isoformat(timespec="seconds") if d.last_seen_at else "-"
            versions = ",".join(f"{k}={v}" for k, v in sorted(d.versions.items())) or "-"
            click.echo(f"{d.id}\t{d.status}\t{d.name or '-'}\tlast seen {seen}\t{versions}")


@devices.command("revoke")
@click.option("--tenant", "tenant_name", required=True, help="tenant name")
@click.argument("device_id")
def devices_revoke(tenant_name: str, device_id: str) -> None:
    """Revoke DEVICE_ID: its credential stops working at once."""
    from controlplane.fleet.devices import revoke_device
    from controlplane.storage.audit import audit, cli_actor
    from controlplane.storage.session import session_scope
    from controlplane.tenancy.service import get_tenant

    with session_scope() as session:
        device = revoke_device(session, get_tenant(session, tenant_name), device_id)
        after = {"tenant": tenant_name, "status": device.status}
        audit(session, cli_actor(), "device.revoke", f"device/{device_id}", None, after)
        click.echo(f"revoked device {device_id}")


@devices.command("target-release")
@click.argument("name")
@click.argument("version")
@click.option(
    "--target",
    "target",
    multiple=True,
    help="selector term (repeatable): ring=beta, site!=lab, device.arch=x86_64, device.memory_mb>=2048, "
    "device.runtime=tflite; none: every device",
)
def target_release(name: str, version: str, target: tuple[str, ...]) -> None:
    """Send edge release NAME VERSION only to the devices TARGET selects (set it before publishing)."""
    from controlplane.fleet.targets import set_release_target
    from controlplane.storage.audit import cli_actor
    from controlplane.storage.session import session_scope
    from shared.targeting import check_target, describe

    with session_scope() as session:
        set_release_target(session, name, version, target, actor=cli_actor())
    click.echo(f"{name} {version}: for {describe(check_target(list(target)))}")

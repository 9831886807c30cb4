"""``tierline tenants`` and ``tierline keys``. Each change writes an audit_log row (actor ``cli:<os user>``)."""

from __future__ import annotations

import click


@click.group()
def tenants() -> None:
    """Create and list tenants."""


@tenants.command("create")
@click.argument("name")
@click.option("--budget", default=None, help="monthly budget in the tenant's currency, e.g. 100.00")
def tenants_create(name: str, budget: str | None) -> None:
    """Create tenant NAME."""
    from controlplane.storage.audit import audit, cli_actor
    from controlplane.storage.session import session_scope
    from controlplane.tenancy.service import create_tenant, parse_budget

    with session_scope() as session:
        tenant = create_tenant(session, name, budget=parse_budget(budget))
        after = {"name": tenant.name, "monthly_budget": budget, "currency": tenant.currency}
        audit(session, cli_actor(), "tenant.create", f"tenant/{tenant.name}", None, after)
        click.echo(f"created tenant {tenant.name} (id {tenant.id})")


@tenants.command("shadow-share")
@click.argument("name")
@click.argument("share", required=False, type=click.FloatRange(0.0, 1.0))
@click.option("--default", "use_default", is_flag=True, help="follow the cloud's TIERLINE_CLOUD_EDGE_SHADOW_SHARE")
def tenants_shadow_share(name: str, share: float | None, use_default: bool) -> None:
    """Set the share of tenant NAME's edge answers the cloud answers again for the quality monitor (0: off)."""
    from controlplane.storage.audit import audit, cli_actor
    from controlplane.storage.session import session_scope
    from controlplane.tenancy.service import get_tenant

    if (share is None) == (not use_default):
        raise click.UsageError("give SHARE (0 to 1) or --default")
    with session_scope() as session:
        tenant = get_tenant(session, name)
        before = {"shadow_share": tenant.shadow_share}
        tenant.shadow_share = None if use_default else share
        session.add(tenant)
        audit(session, cli_actor(), "tenant.shadow_share", f"tenant/{tenant.name}", before, {"shadow_share": share})
    click.echo(f"tenant {name}: shadow share {'the cloud default' if use_default else share}")


@tenants.command("list")
def tenants_list() -> None:
    """List tenants."""
    from controlplane.storage.session import session_scope
    from controlplane.tenancy.service import list_tenants

    with session_scope() as session:
        for t in list_tenants(session):
            budget = "-" if t.monthly_budget is None else f"{t.monthly_budget:.2f} {t.currency}"
            click.echo(f"{t.id}\t{t.name}\t{'active' if t.is_active else 'disabled'}\tbudget {budget}")


@click.group()
def keys() -> None:
    """Create, list and revoke API keys."""


@keys.command("create")
@click.option("--tenant", "tenant_name", required=True, help="tenant name")
@click.option("--name", default="", help="a label for the key")
def keys_create(tenant_name: str, name: str) -> None:
    """Create a key for a tenant and print it once (only its hash is stored)."""
    from controlplane.storage.audit import audit, cli_actor
    from controlplane.storage.session import session_scope
    from controlplane.tenancy.service import create_api_key, get_tenant

    with session_scope() as session:
        issued = create_api_key(session, get_tenant(session, tenant_name), name=name)
        after = {"tenant": tenant_name, "name": name, "prefix": issued.record.prefix}  # the prefix, never the key
        audit(session, cli_actor(), "api_key.create", f"api_key/{issued.record.id}", None, after)
        click.echo(f"key id {issued.record.id} for tenant {tenant_name} (shown once):", err=True)
        click.echo(issued.secret)


@keys.command("list")
@click.option("--tenant", "tenant_name", required=True, help="tenant name")
def keys_list(tenant_name: str) -> None:
    """List a tenant's keys (prefixes only)."""
    from controlplane.storage.session import session_scope
    from controlplane.tenancy.service import get_tenant, list_api_keys

    with session_scope() as session:
        for k in list_api_keys(session, get_tenant(session, tenant_name)):
            state = "revoked" if k.revoked_at else "active"
            click.echo(f"{k.id}\t{k.prefix}…\t{state}\t{k.name}")


@keys.command("revoke")
@click.argument("key_id", type=int)
def keys_revoke(key_id: int) -> None:
    """Revoke key KEY_ID."""
    from controlplane.storage.audit import audit, cli_actor
    from controlplane.storage.session import session_scope
    from controlplane.tenancy.service import revoke_api_key

    with session_scope() as session:
        record = revoke_api_key(session, key_id)
        after = {"prefix": record.prefix, "revoked_at": record.revoked_at.isoformat() if record.revoked_at else None}
        audit(session, cli_actor(), "api_key.revoke", f"api_key/{key_id}", None, after)
        click.echo(f"revoked key {key_id}")

"""``tierline billing``: the price book, invoices, voids and credit notes, and quarantined device usage."""

from __future__ import annotations

from datetime import datetime

import click


def _actor() -> str:
    from controlplane.storage.audit import cli_actor

    return cli_actor()


def _month(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    from controlplane.billing.pricing import parse_period

    try:
        return parse_period(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _money(text: str, what: str) -> str:
    from decimal import Decimal, InvalidOperation

    try:
        value = Decimal(text)
    except InvalidOperation:
        raise click.BadParameter(f"{text!r} is not an amount", param_hint=what) from None
    if not value.is_finite() or value < 0:
        raise click.BadParameter("must be a non-negative amount", param_hint=what)
    if value >= 10**12 or value != value.quantize(Decimal("0.000001")):
        raise click.BadParameter("at most 12 digits before the decimal point and 6 after", param_hint=what)
    return text


@click.group()
def billing() -> None:
    """Prices, budgets and invoices."""


@billing.group()
def prices() -> None:
    """The price book: per model (optionally per version and tier), per million tokens."""


@prices.command("set")
@click.option("--model", required=True, help="model id, e.g. tierline/lm-cloud")
@click.option("--prompt", "prompt_price", required=True, help="price per million prompt tokens, e.g. 0.50")
@click.option("--completion", "completion_price", required=True, help="price per million completion tokens")
@click.option("--cached", "cached_price", default=None, help="per million cached prompt tokens (default: --prompt)")
@click.option("--version", type=int, default=None, help="only this model version")
@click.option("--tier", type=click.Choice(["edge", "cloud"]), default=None, help="only this tier")
@click.option("--currency", default="USD", show_default=True)
@click.option(
    "--from",
    "effective_from",
    type=click.DateTime(formats=["%Y-%m-%d", "%Y-%m-%dT%H:%M:%S"]),
    default=None,
    help="effective from (UTC; default now); earlier prices stay in force for earlier usage",
)
@click.option("--per-call", "per_call", default="0", show_default=True, help="a fee per request, e.g. 0.003")
@click.option(
    "--per-row", "per_row", default="0", show_default=True, help="a fee per input row of a tensor call, e.g. 0.0001"
)
@click.option("--plan", default=None, help="the price plan it belongs to (default: the plan named default)")
@click.option("--tenant", default=None, help="instead of a plan: this tenant's own override (name or id)")
def prices_set(
    model: str,
    prompt_price: str,
    completion_price: str,
    cached_price: str | None,
    version: int | None,
    tier: str | None,
    currency: str,
    effective_from: datetime | None,
    per_call: str,
    per_row: str,
    plan: str | None,
    tenant: str | None,
) -> None:
    """Add a price to a plan, or a tenant's override (a new row: history is kept, past usage keeps its price)."""
    import dataclasses
    from datetime import UTC
    from decimal import Decimal

    from controlplane.billing.invoicing import PriceSpec, add_price, resolve_tenant
    from controlplane.storage.session import session_scope

    if len(currency) != 3 or not currency.isalpha():
        raise click.BadParameter(f"{currency!r} is not a 3-letter currency code", param_hint="--currency")
    spec = PriceSpec(
        model=model,
        prompt_per_mtok=Decimal(_money(prompt_price, "--prompt")),
        completion_per_mtok=Decimal(_money(completion_price, "--completion")),
        cached_per_mtok=Decimal(_money(cached_price, "--cached")) if cached_price is not None else None,
        version=version,
        tier=tier,
        currency=currency,
        effective_from=effective_from.replace(tzinfo=UTC) if effective_from else None,
        per_call=Decimal(_money(per_call, "--per-call")),
        per_row=Decimal(_money(per_row, "--per-row")),
        plan=plan,
    )
    with session_scope() as session:
        if tenant is not None:
            spec = dataclasses.replace(spec, tenant=resolve_tenant(session, tenant))
        row = add_price(session, spec, actor=_actor())
        click.echo(f"price {row.id}: {model} {row.prompt_per_mtok}/{row.completion_per_mtok} {row.currency} per Mtok")


@prices.command("list")
@click.option("--model", default=None, help="only this model")
def prices_list(model: str | None) -> None:
    """List prices, newest first."""
    from controlplane.billing.invoicing import list_prices
    from controlplane.storage.session import session_scope

    with session_scope() as session:
        for p in list_prices(session, model):
            scope = f"v{p.version}" if p.version is not None else "all versions"
            owner = f"tenant {p.tenant_id}" if p.tenant_id is not None else f"plan {p.plan_id}"
            click.echo(
                f"{p.id}\t{p.model}\t{scope}\t{p.tier or 'both tiers'}\tprompt {p.prompt_per_mtok} "
                f"completion {p.completion_per_mtok} cached {p.cached_per_mtok} per call {p.per_call} "
                f"per row {p.per_row} {p.currency}\t"
                f"from {p.effective_from:%Y-%m-%d %H:%M}\t{owner}"
            )


@billing.command("invoice")
@click.option("--tenant", required=True, help="tenant name (or id)")
@click.option("--month", required=True, callback=_month, help="the calendar month (UTC) to bill, YYYY-MM")
@click.option("--finalize", is_flag=True, help="lock the month: store the lines, assign a number, bill the records")
@click.option("--format", "fmt", type=click.Choice(["json", "csv"]), default="json", show_default=True)
def invoice(tenant: str, month: str, finalize: bool, fmt: str) -> None:
    """Show a tenant's invoice for a month: the finalized one, or else the live draft.

    With --finalize, a month that has ended is invoiced: amounts are locked, a hash of the lines is stored,
    and every record billed is stamped so it is never billed again. Late records of an invoiced month
    land on the tenant's next invoice as adjustment lines.
    """
    import json

    from controlplane.billing import invoicing as service
    from controlplane.billing.invoices import to_csv
    from controlplane.storage.session import session_scope

    with session_scope() as session:
        row = service.resolve_tenant(session, tenant)
        if finalize:
            finalized = service.finalize(session, row, month, actor=_actor())
            view = service.invoice_json(session, finalized)
        else:
            view = service.month_invoice(session, row, month)
    click.echo(to_csv(view) if fmt == "csv" else json.dumps(view, indent=2), nl=fmt != "csv")


@billing.command("void")
@click.argument("number")
@click.option("--reason", required=True, help="why (kept on the invoice)")
def void(number: str, reason: str) -> None:
    """Void a finalized invoice; its records are billed again by the next invoice finalized for them."""
    from controlplane.billing import invoicing as service
    from controlplane.storage.session import session_scope

    with session_scope() as session:
        row = service.void(session, number, reason=reason, actor=_actor())
        click.echo(f"voided {row.number} ({row.period}): {reason}")


@billing.command("credit")
@click.argument("number")
@click.option("--amount", required=True, help="positive, at most what is left of the invoice's total, e.g. 12.50")
@click.option("--reason", required=True, help="why (printed on the credit note)")
def credit(number: str, amount: str, reason: str) -> None:
    """Issue a credit note against a finalized invoice (the invoice itself never changes)."""
    from controlplane.billing import invoicing as service
    from controlplane.storage.session import session_scope

    with session_scope() as session:
        note = service.credit(session, number, amount, reason=reason, actor=_actor())
        click.echo(f"{note.number}: {note.amount} {note.currency} against {number}")


@billing.group()
def projects() -> None:
    """Projects: named groups of a tenant's API keys, with budgets of their own."""


@projects.command("create")
@click.option("--tenant", required=True, help="tenant name (or id)")
@click.argument("name")
def projects_create(tenant: str, name: str) -> None:
    """Create project NAME in a tenant."""
    from controlplane.billing import budget_admin
    from controlplane.billing.invoicing import resolve_tenant
    from controlplane.storage.session import session_scope

    with session_scope() as session:
        project = budget_admin.create_project(session, resolve_tenant(session, tenant), name, _actor())
        click.echo(f"project {project.id}: {project.name}")


@projects.command("add-key")
@click.option("--tenant", required=True, help="tenant name (or id)")
@click.option("--project", required=True, help="project name (or id); 'none' takes the key out of its project")
@click.argument("key_id", type=int)
def projects_add_key(tenant: str, project: str, key_id: int) -> None:
    """Put API key KEY_ID in a project (a key is in at most one)."""
    from controlplane.billing import budget_admin
    from controlplane.billing.invoicing import resolve_tenant
    from controlplane.storage.session import session_scope

    with session_scope() as session:
        row = resolve_tenant(session, tenant)
        target = None if project == "none" else budget_admin.get_project(session, row, project)
        budget_admin.assign_key(session, row, key_id, target, _actor())
        click.echo(f"key {key_id} is in project {target.name if target else '(none)'}")


@projects.command("list")
@click.option("--tenant", required=True, help="tenant name (or id)")
def projects_list(tenant: str) -> None:
    """List a tenant's projects and their keys."""
    from controlplane.billing import budget_admin
    from controlplane.billing.invoicing import resolve_tenant
    from controlplane.storage.session import session_scope

    with session_scope() as session:
        for p in budget_admin.list_projects(session, resolve_tenant(session, tenant)):
            click.echo(f"{p['id']}\t{p['name']}\tkeys {', '.join(map(str, p['key_ids'])) or '-'}")


@billing.group()
def budgets() -> None:
    """Budgets per tenant, API key, project and end user; per day, month or in total; hard or soft."""


@budgets.command("set")
@click.option("--tenant", required=True, help="tenant name (or id)")
@click.option("--scope", type=click.Choice(["tenant", "key", "project", "user"]), required=True)
@click.option("--ref", default=None, help="key id, project name or id, end user id ('*': each end user); tenant: none")
@click.option("--period", type=click.Choice(["day", "month", "total"]), required=True)
@click.option("--amount", required=True, help="the limit in the tenant's currency, e.g. 5.00")
@click.option("--soft", is_flag=True, help="count and report only; never refuse a request")
def budgets_set(tenant: str, scope: str, ref: str | None, period: str, amount: str, soft: bool) -> None:
    """Create or change the budget of a scope and period (its spend so far stays)."""
    from decimal import Decimal

    from controlplane.billing import budget_admin
    from controlplane.billing.invoicing import resolve_tenant
    from controlplane.storage.session import session_scope

    with session_scope() as session:
        budget = budget_admin.set_budget(
            session,
            resolve_tenant(session, tenant),
            scope=scope,
            ref=ref,
            period=period,
            amount=Decimal(_money(amount, "--amount")),
            is_hard=not soft,
            actor=_actor(),
        )
        click.echo(f"budget {budget.id}: {scope} {budget.ref or '-'} {budget.amount} per {period}")


@budgets.command("list")
@click.option("--tenant", required=True, help="tenant name (or id)")
def budgets_list(tenant: str) -> None:
    """List a tenant's budgets with the current window's spend, as JSON."""
    import json

    from controlplane.billing import budget_admin
    from controlplane.billing.invoicing import resolve_tenant
    from controlplane.storage.session import session_scope

    with session_scope() as session:
        click.echo(json.dumps(budget_admin.list_budgets(session, resolve_tenant(session, tenant)), indent=2))


@budgets.command("delete")
@click.option("--tenant", required=True, help="tenant name (or id)")
@click.argument("budget_id", type=int)
def budgets_delete(tenant: str, budget_id: int) -> None:
    """Delete a budget (requests in flight settle without it)."""
    from controlplane.billing import budget_admin
    from controlplane.billing.invoicing import resolve_tenant
    from controlplane.storage.session import session_scope

    with session_scope() as session:
        budget_admin.delete_budget(session, resolve_tenant(session, tenant), budget_id, _actor())
        click.echo(f"deleted budget {budget_id}")


@billing.command("quarantined")
@click.option("--tenant", default=None, help="only this tenant's (name or id)")
@click.option("--limit", type=click.IntRange(1, 10_000), default=100, show_default=True)
def quarantined(tenant: str | None, limit: int) -> None:
    """List device usage records held out of billing (beyond what the device could have done), newest first, as
    JSON lines: the id it would have been billed as, its tenant, device, model, counts and the bound it broke."""
    import json

    from controlplane.billing.invoicing import resolve_tenant
    from controlplane.fleet.devices import quarantined as quarantined_records
    from controlplane.storage.session import session_scope

    with session_scope() as session:
        tenant_id = resolve_tenant(session, tenant).id if tenant is not None else None
        for r in quarantined_records(session, tenant_id, limit):
            row = {
                "id": r.id,
                "tenant_id": r.tenant_id,
                "device_id": r.device_id,
                "model": r.model,
                "model_version": r.model_version,
                "tier": r.tier,
                "prompt_tokens": r.prompt_tokens,
                "completion_tokens": r.completion_tokens,
                "status": r.status,
                "occurred_at": r.occurred_at.isoformat(),
                "received_at": r.received_at.isoformat(),
                "reason": r.reason,
            }
            click.echo(json.dumps(row))


@billing.group()
def plans() -> None:
    """Price plans: named, versioned sets of prices; tenants on a plan from a moment on."""


@plans.command("create")
@click.argument("name")
@click.option("--description", default="", help="what the plan is for")
def plans_create(name: str, description: str) -> None:
    """Create price plan NAME (add its prices with `prices set --plan NAME`)."""
    from controlplane.billing import plans as service
    from controlplane.storage.session import session_scope

    with session_scope() as session:
        plan = service.create_plan(session, name, description, _actor())
        click.echo(f"plan {plan.id}: {plan.name}")


@plans.command("list")
def plans_list() -> None:
    """The plans with their prices and versions, as JSON."""
    import json

    from controlplane.billing import plans as service
    from controlplane.storage.session import session_scope

    with session_scope() as session:
        click.echo(json.dumps(service.list_plans(session), indent=2))


@plans.command("assign")
@click.option("--tenant", required=True, help="tenant name (or id)")
@click.option("--plan", required=True, help="plan name")
@click.option(
    "--from",
    "effective_from",
    type=click.DateTime(formats=["%Y-%m-%d", "%Y-%m-%dT%H:%M:%S"]),
    default=None,
    help="from when (UTC; default now, never in the past): earlier usage keeps the plan it had",
)
def plans_assign(tenant: str, plan: str, effective_from: datetime | None) -> None:
    """Put a tenant on a plan."""
    from datetime import UTC

    from controlplane.billing import plans as service
    from controlplane.billing.invoicing import resolve_tenant
    from controlplane.storage.session import session_scope

    with session_scope() as session:
        row = resolve_tenant(session, tenant)
        start = effective_from.replace(tzinfo=UTC) if effective_from else None
        assigned = service.assign_plan(
            session, row, service.get_plan(session, plan), effective_from=start, actor=_actor()
        )
        click.echo(f"tenant {row.name} is on plan {plan} from {assigned.effective_from:%Y-%m-%d %H:%M} UTC")


@billing.group()
def prepaid() -> None:
    """Prepaid credit: top-ups, the balance and its entries, the low-balance alert."""


@prepaid.command("top-up")
@click.option("--tenant", required=True, help="tenant name (or id)")
@click.option("--amount", required=True, help="positive, in the tenant's currency, e.g. 100.00")
@click.option("--note", default="", help="kept on the entry (an order number, a reason)")
def prepaid_top_up(tenant: str, amount: str, note: str) -> None:
    """Add prepaid credit to a tenant (a new ledger entry; the tenant becomes prepaid)."""
    from decimal import Decimal

    from controlplane.billing import credit as service
    from controlplane.billing.invoicing import resolve_tenant
    from controlplane.storage.session import session_scope

    with session_scope() as session:
        row = resolve_tenant(session, tenant)
        entry = service.top_up(session, row, Decimal(_money(amount, "--amount")), note=note, actor=_actor())
        view = service.credit_view(session, row, limit=0)
        click.echo(f"credit entry {entry.id}: +{entry.amount}; balance {view['balance']} {view['currency']}")


@prepaid.command("show")
@click.option("--tenant", required=True, help="tenant name (or id)")
@click.option("--limit", type=click.IntRange(0, 1000), default=50, show_default=True, help="entries to list")
def prepaid_show(tenant: str, limit: int) -> None:
    """The tenant's balance, holds, low-balance line and latest entries, as JSON."""
    import json

    from controlplane.billing import credit as service
    from controlplane.billing.invoicing import resolve_tenant
    from controlplane.storage.session import session_scope

    with session_scope() as session:
        click.echo(json.dumps(service.credit_view(session, resolve_tenant(session, tenant), limit), indent=2))


@prepaid.command("alert")
@click.option("--tenant", required=True, help="tenant name (or id)")
@click.option("--below", required=True, help="alert when the balance falls below this amount; 'none' turns it off")
def prepaid_alert(tenant: str, below: str) -> None:
    """Set the low-balance line: a credit.low_balance webhook and a console alert when the balance falls below."""
    from decimal import Decimal

    from controlplane.billing import credit as service
    from controlplane.billing.invoicing import resolve_tenant
    from controlplane.storage.session import session_scope

    threshold = None if below == "none" else Decimal(_money(below, "--below"))
    with session_scope() as session:
        service.set_low_balance(session, resolve_tenant(session, tenant), threshold, actor=_actor())
        click.echo(f"low-balance alert {'off' if threshold is None else f'below {threshold}'}")

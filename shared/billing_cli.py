"""``tierline billing``: the price book (invoices arrive with issue #8)."""

from __future__ import annotations

from datetime import datetime

import click


def _money(text: str, what: str) -> str:
    from decimal import Decimal, InvalidOperation

    try:
        value = Decimal(text)
    except InvalidOperation:
        raise click.BadParameter(f"{text!r} is not an amount", param_hint=what) from None
    if not value.is_finite() or value < 0:
        raise click.BadParameter("must be a non-negative amount", param_hint=what)
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
def prices_set(
    model: str,
    prompt_price: str,
    completion_price: str,
    cached_price: str | None,
    version: int | None,
    tier: str | None,
    currency: str,
    effective_from: datetime | None,
) -> None:
    """Add a price (a new row: history is kept, past usage keeps the price it had)."""
    from datetime import UTC
    from decimal import Decimal

    from shared.storage.models import Price
    from shared.storage.session import session_scope

    if len(currency) != 3 or not currency.isalpha():
        raise click.BadParameter(f"{currency!r} is not a 3-letter currency code", param_hint="--currency")
    prompt = Decimal(_money(prompt_price, "--prompt"))
    row = Price(
        model=model,
        version=version,
        tier=tier,
        currency=currency.upper(),
        prompt_per_mtok=prompt,
        completion_per_mtok=Decimal(_money(completion_price, "--completion")),
        cached_per_mtok=Decimal(_money(cached_price, "--cached")) if cached_price is not None else prompt,
        effective_from=(effective_from.replace(tzinfo=UTC) if effective_from else datetime.now(UTC)),
    )
    with session_scope() as session:
        session.add(row)
        session.flush()
        click.echo(f"price {row.id}: {model} {row.prompt_per_mtok}/{row.completion_per_mtok} {row.currency} per Mtok")


@prices.command("list")
@click.option("--model", default=None, help="only this model")
def prices_list(model: str | None) -> None:
    """List prices, newest first."""
    from sqlmodel import col, select

    from shared.storage.models import Price
    from shared.storage.session import session_scope

    with session_scope() as session:
        query = select(Price).order_by(col(Price.model), col(Price.effective_from).desc())
        if model is not None:
            query = query.where(Price.model == model)
        for p in session.exec(query):
            scope = f"v{p.version}" if p.version is not None else "all versions"
            click.echo(
                f"{p.id}\t{p.model}\t{scope}\t{p.tier or 'both tiers'}\tprompt {p.prompt_per_mtok} "
                f"completion {p.completion_per_mtok} cached {p.cached_per_mtok} {p.currency}\t"
                f"from {p.effective_from:%Y-%m-%d %H:%M}"
            )

"""Prices and costs in Decimal, as pure functions both tiers and the console share.

A price is per million prompt, completion and cached-prompt tokens, for a model, optionally narrowed to a
version and a tier, effective from a moment. The price in force for a usage record is the most specific
match (version and tier > version > tier > model only) with the latest ``effective_from`` at or before the
record's time; a price change never rewrites the past because old rows stay in force for old times.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Protocol

MILLION = Decimal(1_000_000)
COST_QUANTUM = Decimal("0.000000001")  # costs are kept to 1e-9 of the currency unit; invoices round lines


class PriceLike(Protocol):
    model: str
    version: int | None
    tier: str | None
    currency: str
    prompt_per_mtok: Decimal
    completion_per_mtok: Decimal
    cached_per_mtok: Decimal
    effective_from: datetime


@dataclass(frozen=True, slots=True)
class Tokens:
    prompt: int
    completion: int
    cached: int = 0


def _specificity(p: PriceLike) -> int:
    return (2 if p.version is not None else 0) + (1 if p.tier is not None else 0)


def price_for(
    prices: Iterable[PriceLike], model: str, version: int | None, tier: str, at: datetime
) -> PriceLike | None:
    """The price in force for one usage record, or None (such a record is flagged, never dropped)."""
    best: PriceLike | None = None
    for p in prices:
        if p.model != model or _aware(p.effective_from) > _aware(at):
            continue
        if p.version is not None and p.version != version:
            continue
        if p.tier is not None and p.tier != tier:
            continue
        if best is None or (_specificity(p), _aware(p.effective_from)) > (
            _specificity(best),
            _aware(best.effective_from),
        ):
            best = p
    return best


def cost(price: PriceLike, tokens: Tokens) -> Decimal:
    """What ``tokens`` cost at ``price``: cached prompt tokens at the cached rate, the rest at the prompt rate."""
    cached = min(tokens.cached, tokens.prompt)
    total = (
        Decimal(tokens.prompt - cached) * price.prompt_per_mtok
        + Decimal(cached) * price.cached_per_mtok
        + Decimal(tokens.completion) * price.completion_per_mtok
    ) / MILLION
    return total.quantize(COST_QUANTUM, rounding=ROUND_HALF_EVEN)


def _aware(ts: datetime) -> datetime:
    from datetime import UTC

    return ts if ts.tzinfo else ts.replace(tzinfo=UTC)


def period_of(ts: datetime) -> str:
    """The billing period (calendar month, UTC) of a moment: ``YYYY-MM``."""
    from datetime import UTC

    return _aware(ts).astimezone(UTC).strftime("%Y-%m")

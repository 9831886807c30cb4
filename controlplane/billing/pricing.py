"""Prices and costs in Decimal, as pure functions both tiers and the console share.

A price is per million prompt, completion and cached-prompt tokens, for a model, optionally narrowed to a
version and a tier, effective from a moment. The price in force for a usage record is the most specific
match (version and tier > version > tier > model only) with the latest ``effective_from`` at or before the
record's time; a price change never rewrites the past because old rows stay in force for old times.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Protocol

from controlplane.storage.types import as_utc

MILLION = Decimal(1_000_000)
# A record's cost is kept to 1e-6 of the currency unit: the scale of the database's money columns (NUMERIC(18, 6)),
# so the cost a record is rated at is exactly the cost stored and summed. Invoices round lines, not records.
COST_QUANTUM = Decimal("0.000001")


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
        if p.model != model or as_utc(p.effective_from) > as_utc(at):
            continue
        if p.version is not None and p.version != version:
            continue
        if p.tier is not None and p.tier != tier:
            continue
        if best is None or (_specificity(p), as_utc(p.effective_from)) > (
            _specificity(best),
            as_utc(best.effective_from),
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


Rating = tuple[int | None, Decimal | None]
UNPRICED: Rating = (None, None)


class PriceLookup(Protocol):
    def lookup(self, model: str, version: int | None, tier: str, at: datetime) -> PriceLike | None: ...


def rate(prices: PriceLookup, model: str, version: int | None, tier: str, tokens: Tokens, at: datetime) -> Rating:
    """The one rating rule: ``(price id, cost)`` at the price in force at ``at``, or ``UNPRICED`` (flagged)."""
    price = prices.lookup(model, version, tier, at)
    if price is None:
        return UNPRICED
    return getattr(price, "id", None), cost(price, tokens)


def period_of(ts: datetime) -> str:
    """The billing period (calendar month, UTC) of a moment: ``YYYY-MM``."""
    return as_utc(ts).strftime("%Y-%m")


def parse_period(text: str) -> str:
    """``YYYY-MM`` checked and normalized; ``ValueError`` names what is wrong."""
    try:
        start = datetime.strptime(text.strip(), "%Y-%m")
    except ValueError:
        raise ValueError(f"{text!r} is not a month (YYYY-MM)") from None
    if not 1970 <= start.year < 9999:
        raise ValueError(f"{text!r} is not a month between 1970-01 and 9998-12")
    return start.strftime("%Y-%m")


def period_bounds(period: str) -> tuple[datetime, datetime]:
    """``[start, end)`` of a ``YYYY-MM`` period, as UTC moments."""
    start = datetime.strptime(period, "%Y-%m").replace(tzinfo=UTC)
    end = start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)
    return start, end


class PriceIndex:
    """Prices grouped by model, so rating a batch costs one scan of the model's few prices per record."""

    def __init__(self, prices: Iterable[PriceLike]) -> None:
        self._by_model: dict[str, list[PriceLike]] = {}
        for p in prices:
            self._by_model.setdefault(p.model, []).append(p)

    def lookup(self, model: str, version: int | None, tier: str, at: datetime) -> PriceLike | None:
        return price_for(self._by_model.get(model, ()), model, version, tier, at)

"""Prices and costs in Decimal, as pure functions both tiers and the console share.

Prices belong to a **plan** (a named set, versioned by its prices' effective dates) or are one tenant's own
**override**. A tenant is on a plan from a moment on; a record is rated with, in this order, the tenant's
override, the plan the tenant was on at the record's time, then the default plan (a plan need not list every
model). Within each of those, the rule below picks the price.

A price is per million prompt, completion and cached-prompt tokens (plus an optional fee per call and per input
row of a tensor-model call), for a model, optionally narrowed to a
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
DEFAULT_PLAN = "default"


class PriceLike(Protocol):
    model: str
    version: int | None
    tier: str | None
    currency: str
    prompt_per_mtok: Decimal
    completion_per_mtok: Decimal
    cached_per_mtok: Decimal
    effective_from: datetime


class PlanAssignment(Protocol):
    tenant_id: int
    plan_id: int
    effective_from: datetime


@dataclass(frozen=True, slots=True)
class Tokens:
    """What one request used: its tokens, ``calls`` (1: a request) for a price's per-call fee, and ``rows`` (the
    input rows of a tensor-model call) for its per-row fee."""

    prompt: int
    completion: int
    cached: int = 0
    calls: int = 1
    rows: int = 0


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
    """What ``tokens`` cost at ``price``: cached prompt tokens at the cached rate, the rest at the prompt rate, plus
    the per-call fee and the per-row fee for each input row."""
    cached = min(tokens.cached, tokens.prompt)
    total = (
        (
            Decimal(tokens.prompt - cached) * price.prompt_per_mtok
            + Decimal(cached) * price.cached_per_mtok
            + Decimal(tokens.completion) * price.completion_per_mtok
        )
        / MILLION
        + Decimal(tokens.calls) * getattr(price, "per_call", Decimal(0))
        + Decimal(tokens.rows) * getattr(price, "per_row", Decimal(0))
    )
    return total.quantize(COST_QUANTUM, rounding=ROUND_HALF_EVEN)


Rating = tuple[int | None, Decimal | None]
UNPRICED: Rating = (None, None)


class PriceLookup(Protocol):
    def lookup(
        self, model: str, version: int | None, tier: str, at: datetime, tenant_id: int | None = None
    ) -> PriceLike | None: ...


def rate(
    prices: PriceLookup,
    model: str,
    version: int | None,
    tier: str,
    tokens: Tokens,
    at: datetime,
    tenant_id: int | None = None,
) -> Rating:
    """The one rating rule: ``(price id, cost)`` at the price in force for the tenant at ``at`` (its override,
    else its plan's then, else the default plan's), or ``UNPRICED`` (flagged)."""
    price = prices.lookup(model, version, tier, at, tenant_id)
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
    """The price book in memory: prices grouped by model, plan and override, and the tenants' plan history, so
    rating a batch costs one scan of a model's few prices per record.

    A price with no plan and no tenant (written before plans existed) counts as the default plan's.
    """

    def __init__(
        self,
        prices: Iterable[PriceLike],
        assignments: Iterable[PlanAssignment] = (),
        default_plan_id: int | None = None,
    ) -> None:
        self.default_plan_id = default_plan_id
        self._by_model: dict[str, list[PriceLike]] = {}
        self._overrides: dict[tuple[str, int], list[PriceLike]] = {}
        self._by_plan: dict[tuple[str, int | None], list[PriceLike]] = {}
        for p in prices:
            tenant_id = getattr(p, "tenant_id", None)
            plan_id = getattr(p, "plan_id", None)
            if tenant_id is not None:
                self._overrides.setdefault((p.model, tenant_id), []).append(p)
                continue
            if plan_id is None or plan_id == default_plan_id:
                self._by_model.setdefault(p.model, []).append(p)
            else:
                self._by_plan.setdefault((p.model, plan_id), []).append(p)
        self._plans: dict[int, list[tuple[datetime, int]]] = {}
        for a in assignments:
            self._plans.setdefault(a.tenant_id, []).append((as_utc(a.effective_from), a.plan_id))
        for history in self._plans.values():
            history.sort()

    def plan_of(self, tenant_id: int, at: datetime) -> int | None:
        """The plan the tenant was on at ``at`` (None: the default plan)."""
        plan = None
        for start, plan_id in self._plans.get(tenant_id, ()):
            if start > as_utc(at):
                break
            plan = plan_id
        return plan

    def lookup(
        self, model: str, version: int | None, tier: str, at: datetime, tenant_id: int | None = None
    ) -> PriceLike | None:
        if tenant_id is not None:
            own = self._overrides.get((model, tenant_id))
            price = price_for(own, model, version, tier, at) if own else None
            if price is not None:
                return price
            plan = self.plan_of(tenant_id, at)
            if plan is not None and plan != self.default_plan_id:
                price = price_for(self._by_plan.get((model, plan), ()), model, version, tier, at)
                if price is not None:
                    return price
        return price_for(self._by_model.get(model, ()), model, version, tier, at)

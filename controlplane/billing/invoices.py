"""Invoice arithmetic as pure functions: lines from usage totals, one rounding rule, a canonical hash, exports.

The rounding rule: the invoice's total is the exact sum of the rated costs of every record it bills (the
ledger's figure, ``controlplane.billing.ledger.month_spend`` for the month's own usage), rounded **once** to the
currency's minor unit (cents for USD, whole yen for JPY) with ROUND_HALF_EVEN. Each line shows its own exact
sum rounded the same way, as a metered bill's line items do; what rounding the lines one by one adds or loses
against the total is one ``rounding`` line of its own (absent when zero), so the lines still add up to the total
printed under them, and a thousand sub-cent lines never bill 0.00 in total.

A line is the usage of one model / version / tier in one month at one price (a price change mid-month makes
two lines, each naming its price and plan). Records of the invoice's own month make ``usage`` lines, or
``shadow`` lines for the quality monitor's shadow replays (tier ``shadow``: billed at the shadow price, or the
cloud's, like any usage, and labelled as replays, not answers); late records of an earlier, already invoiced
month make ``adjustment`` lines. Records with no price in force are counted on their line
(``unpriced_records``) at cost 0, never dropped.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any

USAGE = "usage"
SHADOW = "shadow"
ADJUSTMENT = "adjustment"
ROUNDING = "rounding"
SHADOW_TIER = "shadow"  # the usage records of the quality monitor's shadow replays

# ISO 4217 currencies whose minor unit is not 1/100; every other currency rounds to cents.
_MINOR_UNITS = {
    "BIF": 0, "CLP": 0, "DJF": 0, "GNF": 0, "ISK": 0, "JPY": 0, "KMF": 0, "KRW": 0, "PYG": 0, "RWF": 0,
    "UGX": 0, "UYI": 0, "VND": 0, "VUV": 0, "XAF": 0, "XOF": 0, "XPF": 0,
    "BHD": 3, "IQD": 3, "JOD": 3, "KWD": 3, "LYD": 3, "OMR": 3, "TND": 3,
}  # fmt: skip

CSV_COLUMNS = (
    "kind",
    "usage_period",
    "model",
    "model_version",
    "tier",
    "requests",
    "prompt_tokens",
    "completion_tokens",
    "cached_prompt_tokens",
    "unpriced_records",
    "amount",
    "description",
)


class CurrencyMismatchError(ValueError):
    """Usage rated in a currency other than the invoice's (a price book mistake to fix before invoicing)."""


def minor_unit(currency: str) -> Decimal:
    """The smallest amount an invoice line shows in ``currency``: ``Decimal("0.01")`` for USD."""
    return Decimal(1).scaleb(-_MINOR_UNITS.get(currency.upper(), 2))


def round_line(amount: Decimal, currency: str) -> Decimal:
    """The one rounding rule: to the currency's minor unit, half to even."""
    return amount.quantize(minor_unit(currency), rounding=ROUND_HALF_EVEN)


@dataclass(frozen=True, slots=True)
class UsageTotals:
    """What the ledger holds for one group of unbilled records (one month, model, version, tier, currency)."""

    usage_period: str
    model: str
    model_version: int | None
    tier: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    unpriced_records: int
    cost: Decimal
    currency: str | None = None  # of the prices the records were rated with; None when all are unpriced
    price: str | None = None  # the price they were rated with, as the line shows it (None: unpriced)


@dataclass(frozen=True, slots=True)
class Line:
    kind: str
    usage_period: str
    model: str
    model_version: int | None
    tier: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    unpriced_records: int
    amount: Decimal
    description: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "usage_period": self.usage_period,
            "model": self.model,
            "model_version": self.model_version,
            "tier": self.tier,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "unpriced_records": self.unpriced_records,
            "amount": str(self.amount),
            "description": self.description,
        }


@dataclass(frozen=True, slots=True)
class Amounts:
    subtotal: Decimal  # the month's own lines (usage and shadow)
    adjustments: Decimal  # late usage of earlier months
    total: Decimal  # subtotal + adjustments + rounding
    unpriced_records: int = 0
    num_lines: int = field(default=0)
    rounding: Decimal = Decimal(0)


_KIND_ORDER = {USAGE: 0, SHADOW: 1, ADJUSTMENT: 2, ROUNDING: 3}


def _sort_key(line: Line) -> tuple[int, str, str, int, str, str]:
    version = -1 if line.model_version is None else line.model_version
    order = _KIND_ORDER.get(line.kind, 2)
    return (order, line.usage_period, line.model, version, line.tier, line.description)


def _describe(
    kind: str, usage_period: str, model: str, version: int | None, tier: str, unpriced: int, price: str | None = None
) -> str:
    text = f"{model}" + (f" v{version}" if version is not None else "") + f" ({tier})"
    if tier == SHADOW_TIER:
        text = f"shadow replays for the quality monitor (not answers): {text}"
    if price:
        text += f" at {price}"
    if kind == ADJUSTMENT:
        text += f", late usage of {usage_period}"
    if unpriced:
        text += f"; {unpriced} unpriced record{'s' if unpriced != 1 else ''} at 0"
    return text


def exact_sums(totals: Iterable[UsageTotals], period: str) -> tuple[Decimal, Decimal]:
    """The exact (unrounded) cost of ``period``'s own records and of late records of earlier months."""
    own = late = Decimal(0)
    for t in totals:
        if t.usage_period == period:
            own += t.cost
        else:
            late += t.cost
    return own, late


def build_lines(totals: Iterable[UsageTotals], period: str, currency: str) -> list[Line]:
    """Invoice lines for ``period`` (``YYYY-MM``) in ``currency``, in a canonical order.

    Groups of the same month, model, version, tier and price merge into one line (their exact costs add up before
    the line is rounded). A ``rounding`` line makes the lines add up to the exact sum of every group rounded once.
    Raises ``CurrencyMismatchError`` when a group was rated in another currency and ``ValueError`` for a group of
    a month after ``period``.
    """
    totals = list(totals)
    merged: dict[tuple[str, str, int | None, str, str | None], list[UsageTotals]] = {}
    for t in totals:
        if t.currency is not None and t.currency.upper() != currency.upper():
            raise CurrencyMismatchError(
                f"{t.requests} records of {t.model} in {t.usage_period} were rated in {t.currency}, "
                f"but the invoice is in {currency}"
            )
        if t.usage_period > period:
            raise ValueError(f"usage of {t.usage_period} cannot be billed on the invoice for {period}")
        merged.setdefault((t.usage_period, t.model, t.model_version, t.tier, t.price), []).append(t)
    lines = []
    for (usage_period, model, version, tier, price), group in merged.items():
        kind = (SHADOW if tier == SHADOW_TIER else USAGE) if usage_period == period else ADJUSTMENT
        unpriced = sum(t.unpriced_records for t in group)
        lines.append(
            Line(
                kind=kind,
                usage_period=usage_period,
                model=model,
                model_version=version,
                tier=tier,
                requests=sum(t.requests for t in group),
                prompt_tokens=sum(t.prompt_tokens for t in group),
                completion_tokens=sum(t.completion_tokens for t in group),
                cached_prompt_tokens=sum(t.cached_prompt_tokens for t in group),
                unpriced_records=unpriced,
                amount=round_line(sum((t.cost for t in group), Decimal(0)), currency),
                description=_describe(kind, usage_period, model, version, tier, unpriced, price),
            )
        )
    exact = sum(exact_sums(totals, period), Decimal(0))
    difference = round_line(exact, currency) - sum((ln.amount for ln in lines), Decimal(0))
    if difference:
        lines.append(_rounding_line(period, exact, difference, currency))
    return sorted(lines, key=_sort_key)


def _rounding_line(period: str, exact: Decimal, difference: Decimal, currency: str) -> Line:
    total = round_line(exact, currency)
    text = f"rounding: the exact sum {exact.normalize():f} {currency.upper()} rounded once is {total}"
    return Line(ROUNDING, period, "", None, "", 0, 0, 0, 0, 0, round_line(difference, currency), text)


def amounts(lines: Iterable[Line], currency: str) -> Amounts:
    """Subtotal (the month's usage and shadow lines), adjustments (late usage), rounding and total: sums of the
    rounded lines."""
    zero = round_line(Decimal(0), currency)
    items = list(lines)
    subtotal = sum((ln.amount for ln in items if ln.kind in (USAGE, SHADOW)), zero)
    adjustments = sum((ln.amount for ln in items if ln.kind == ADJUSTMENT), zero)
    rounding = sum((ln.amount for ln in items if ln.kind == ROUNDING), zero)
    return Amounts(
        subtotal=subtotal,
        adjustments=adjustments,
        rounding=rounding,
        total=subtotal + adjustments + rounding,
        unpriced_records=sum(ln.unpriced_records for ln in items),
        num_lines=len(items),
    )


def canonical_lines(lines: Iterable[Line], currency: str) -> bytes:
    """The bytes the lines hash is taken over: sorted lines, amounts as fixed-point strings, compact JSON."""
    unit = minor_unit(currency)
    rows = []
    for line in sorted(lines, key=_sort_key):
        row = line.to_json()
        row["amount"] = str(line.amount.quantize(unit))
        rows.append(row)
    return json.dumps({"currency": currency.upper(), "lines": rows}, sort_keys=True, separators=(",", ":")).encode()


def lines_hash(lines: Iterable[Line], currency: str) -> str:
    """sha256 (hex) of ``canonical_lines``: stored at finalize, so any later change to the lines shows."""
    return hashlib.sha256(canonical_lines(lines, currency)).hexdigest()


def to_csv(invoice: Mapping[str, Any]) -> str:
    """An invoice (as ``invoice_json`` gives it) as CSV: a header row, one row per line, then the totals."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for line in invoice["lines"]:
        writer.writerow(["" if line[c] is None else line[c] for c in CSV_COLUMNS])
    for label in ("subtotal", "adjustments", "total", "credits", "balance"):
        writer.writerow([label, *([""] * (len(CSV_COLUMNS) - 3)), invoice[label], invoice["currency"]])
    return out.getvalue()

"""Invoice arithmetic: lines rounded one by one, a total that is the exact sum rounded once (a rounding line
makes up the difference, so the lines still sum to the total), shadow lines, a canonical hash, exports;
and the rating it rests on (price in force at the record's time, cost at the storage scale)."""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from decimal import ROUND_HALF_EVEN, Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.billing.invoices import (
    ADJUSTMENT,
    ROUNDING,
    SHADOW,
    USAGE,
    CurrencyMismatchError,
    Line,
    UsageTotals,
    amounts,
    build_lines,
    lines_hash,
    minor_unit,
    round_line,
    to_csv,
)
from controlplane.billing.pricing import PriceIndex, Tokens, cost, parse_period, period_bounds, period_of, price_for


def totals(cost_: str, *, period: str = "2026-03", model: str = "m", version: int | None = 1, tier: str = "cloud",
           requests: int = 1, unpriced: int = 0, currency: str | None = "USD") -> UsageTotals:  # fmt: skip
    return UsageTotals(period, model, version, tier, requests, 10 * requests, 5 * requests, 0, unpriced,
                       Decimal(cost_), currency)  # fmt: skip


def test_each_line_rounds_half_even_to_the_minor_unit_and_the_total_is_the_sum_of_lines() -> None:
    lines = build_lines(
        [totals("0.125", version=1), totals("0.135", version=2), totals("0.125", version=3), totals("0.004999")],
        "2026-03",
        "USD",
    )
    assert [ln.amount for ln in lines] == [Decimal("0.13"), Decimal("0.14"), Decimal("0.12")]
    sums = amounts(lines, "USD")
    # The lines add up to the exact sum rounded once here (0.389999 -> 0.39): no rounding line.
    assert sums.subtotal == sums.total == Decimal("0.39")
    assert str(sums.total) == "0.39" and sums.adjustments == sums.rounding == Decimal("0.00")


def test_the_total_is_the_exact_sum_rounded_once_with_the_difference_on_a_rounding_line() -> None:
    # 0.125 + 0.125 is 0.25, where the lines rounded one by one show 0.12 + 0.12 = 0.24.
    lines = build_lines([totals("0.125", version=1), totals("0.125", version=2)], "2026-03", "USD")
    assert [(ln.kind, ln.amount) for ln in lines] == [(USAGE, Decimal("0.12")), (USAGE, Decimal("0.12")),
                                                      (ROUNDING, Decimal("0.01"))]  # fmt: skip
    assert "exact sum 0.25 USD rounded once is 0.25" in lines[-1].description
    sums = amounts(lines, "USD")
    assert (sums.subtotal, sums.rounding, sums.total) == (Decimal("0.24"), Decimal("0.01"), Decimal("0.25"))
    # Fifty sub-cent lines bill their sum, not 0.00.
    many = build_lines([totals("0.004", version=v) for v in range(50)], "2026-03", "USD")
    assert amounts(many, "USD").total == Decimal("0.20") and many[-1].kind == ROUNDING


def test_shadow_replays_are_shadow_lines_of_the_subtotal_labelled_as_replays() -> None:
    lines = build_lines([totals("1.00"), totals("0.30", tier="shadow")], "2026-03", "USD")
    assert [ln.kind for ln in lines] == [USAGE, SHADOW]
    assert lines[1].description.startswith("shadow replays for the quality monitor (not answers)")
    assert amounts(lines, "USD").subtotal == Decimal("1.30")
    late = build_lines([totals("0.30", tier="shadow", period="2026-02")], "2026-03", "USD")
    assert late[0].kind == ADJUSTMENT and "shadow replays" in late[0].description


def test_groups_of_one_line_add_exactly_before_rounding() -> None:
    # Two groups of the same line (priced in two halves of the month) are one line: 0.005 + 0.005 = 0.01,
    # where rounding each first would give 0.00 + 0.00.
    lines = build_lines([totals("0.005"), totals("0.005")], "2026-03", "USD")
    assert len(lines) == 1 and lines[0].amount == Decimal("0.01") and lines[0].requests == 2


def test_currencies_round_to_their_own_minor_unit() -> None:
    assert (
        minor_unit("USD") == Decimal("0.01")
        and minor_unit("jpy") == Decimal(1)
        and minor_unit("KWD") == Decimal("0.001")
    )
    assert round_line(Decimal("12.5"), "JPY") == Decimal(12) and round_line(Decimal("13.5"), "JPY") == Decimal(14)
    assert str(round_line(Decimal("1.0005"), "BHD")) == "1.000"


def test_late_usage_of_an_earlier_month_is_an_adjustment_line_after_the_usage_lines() -> None:
    lines = build_lines([totals("1.00", period="2026-02"), totals("2.00", period="2026-03")], "2026-03", "USD")
    assert [(ln.kind, ln.usage_period) for ln in lines] == [(USAGE, "2026-03"), (ADJUSTMENT, "2026-02")]
    assert "late usage of 2026-02" in lines[1].description
    sums = amounts(lines, "USD")
    assert (sums.subtotal, sums.adjustments, sums.total) == (Decimal("2.00"), Decimal("1.00"), Decimal("3.00"))
    with pytest.raises(ValueError, match="cannot be billed"):
        build_lines([totals("1", period="2026-04")], "2026-03", "USD")


def test_unpriced_records_are_counted_on_their_line_at_zero() -> None:
    (line,) = build_lines([totals("0", requests=4, unpriced=4, currency=None)], "2026-03", "USD")
    assert line.requests == 4 and line.unpriced_records == 4 and line.amount == Decimal("0.00")
    assert "4 unpriced records at 0" in line.description
    assert amounts([line], "USD").unpriced_records == 4


def test_usage_rated_in_another_currency_is_refused() -> None:
    with pytest.raises(CurrencyMismatchError, match="rated in EUR"):
        build_lines([totals("1", currency="EUR")], "2026-03", "USD")


def test_the_lines_hash_ignores_order_and_catches_any_change() -> None:
    lines = build_lines([totals("0.50", version=1), totals("0.70", version=2, tier="edge")], "2026-03", "USD")
    digest = lines_hash(lines, "USD")
    assert len(digest) == 64 and lines_hash(list(reversed(lines)), "USD") == digest
    # Trailing zeros from the database (NUMERIC(18, 6)) do not change the hash.
    assert lines_hash([replace(lines[0], amount=Decimal("0.500000")), lines[1]], "USD") == digest
    for change in ({"amount": Decimal("0.51")}, {"requests": 2}, {"model": "n"}, {"unpriced_records": 1}):
        assert lines_hash([replace(lines[0], **change), lines[1]], "USD") != digest, change
    assert lines_hash(lines, "EUR") != digest


def test_csv_export_has_a_row_per_line_and_the_totals() -> None:
    lines = build_lines([totals("1.234", model="a,b")], "2026-03", "USD")
    view = {
        "lines": [ln.to_json() for ln in lines],
        "currency": "USD",
        **{k: "1.23" for k in ("subtotal", "total", "balance")},
        **{k: "0.00" for k in ("adjustments", "credits")},
    }
    rows = list(csv.DictReader(io.StringIO(to_csv(view))))
    assert rows[0]["model"] == "a,b" and rows[0]["amount"] == "1.23" and rows[0]["model_version"] == "1"
    assert {r["kind"]: r["amount"] for r in rows[1:]} == {
        "subtotal": "1.23", "adjustments": "0.00", "total": "1.23", "credits": "0.00", "balance": "1.23",
    }  # fmt: skip


money = st.decimals(min_value=0, max_value=10_000, places=6, allow_nan=False, allow_infinity=False)


@given(st.lists(st.tuples(money, st.integers(1, 3), st.sampled_from(["2026-02", "2026-03"])), max_size=30))
def test_rounded_lines_stay_within_half_a_cent_and_the_total_is_the_exact_sum_rounded_once(
    groups: list[tuple[Decimal, int, str]],
) -> None:
    everything = build_lines([totals(str(c), version=v, period=p) for c, v, p in groups], "2026-03", "USD")
    lines = [ln for ln in everything if ln.kind != ROUNDING]
    exact: dict[tuple[str, int], Decimal] = {}
    for c, v, p in groups:
        exact[(p, v)] = exact.get((p, v), Decimal(0)) + c
    assert len(lines) == len(exact) and len(everything) - len(lines) <= 1
    for ln in lines:
        assert ln.model_version is not None
        want = exact[(ln.usage_period, ln.model_version)]
        assert ln.amount == want.quantize(Decimal("0.01"), rounding=ROUND_HALF_EVEN)
        assert abs(ln.amount - want) <= Decimal("0.005")
    sums = amounts(everything, "USD")
    assert sums.total == sum((ln.amount for ln in everything), Decimal(0))
    assert sums.total == sums.subtotal + sums.adjustments + sums.rounding
    assert sums.total == sum((c for c, _, _ in groups), Decimal(0)).quantize(Decimal("0.01"), ROUND_HALF_EVEN)


# --- rating -------------------------------------------------------------------------------------------------------


@dataclass
class P:
    model: str
    prompt_per_mtok: Decimal
    completion_per_mtok: Decimal
    effective_from: datetime
    version: int | None = None
    tier: str | None = None
    currency: str = "USD"
    cached_per_mtok: Decimal = Decimal(0)
    id: int = 0


def test_the_price_in_force_is_the_most_specific_then_the_latest_at_the_records_time() -> None:
    jan, feb, mar = (datetime(2026, m, 1, tzinfo=UTC) for m in (1, 2, 3))
    old = P("m", Decimal(1), Decimal(2), jan, id=1)
    new = P("m", Decimal(3), Decimal(4), feb, id=2)
    edge = P("m", Decimal("0.5"), Decimal(1), jan, tier="edge", id=3)
    v2 = P("m", Decimal(9), Decimal(9), mar, version=2, id=4)
    prices = [old, new, edge, v2]
    assert price_for(prices, "m", 1, "cloud", datetime(2026, 1, 15, tzinfo=UTC)) is old
    assert price_for(prices, "m", 1, "cloud", datetime(2026, 2, 15, tzinfo=UTC)) is new
    assert price_for(prices, "m", 1, "edge", datetime(2026, 2, 15, tzinfo=UTC)) is edge
    assert price_for(prices, "m", 2, "cloud", datetime(2026, 3, 2, tzinfo=UTC)) is v2
    assert price_for(prices, "m", 2, "cloud", datetime(2026, 2, 2, tzinfo=UTC)) is new
    assert price_for(prices, "other", 1, "cloud", mar) is None
    assert price_for(prices, "m", 1, "cloud", datetime(2025, 12, 31, tzinfo=UTC)) is None
    index = PriceIndex(prices)
    assert index.lookup("m", 2, "cloud", datetime(2026, 3, 2, tzinfo=UTC)) is v2
    assert index.lookup("nope", 2, "cloud", mar) is None


def test_a_records_cost_is_exact_at_the_storage_scale() -> None:
    price = P("m", Decimal("0.15"), Decimal("0.60"), datetime(2026, 1, 1, tzinfo=UTC), cached_per_mtok=Decimal("0.075"))
    assert cost(price, Tokens(prompt=1000, completion=200, cached=400)) == Decimal("0.000240")
    # 7 tokens at 0.15 per million is 0.00000105: kept to 1e-6 (the money columns' scale), half to even.
    assert cost(price, Tokens(prompt=7, completion=0)) == Decimal("0.000001")


def test_periods_are_utc_calendar_months() -> None:
    assert period_of(datetime(2026, 3, 31, 23, 59, tzinfo=UTC)) == "2026-03"
    assert period_of(datetime(2026, 12, 31, 23, 59)) == "2026-12"
    assert period_bounds("2026-12") == (datetime(2026, 12, 1, tzinfo=UTC), datetime(2027, 1, 1, tzinfo=UTC))
    assert parse_period(" 2026-03 ") == "2026-03"
    for bad in ("2026-13", "March", "2026/03", "", "9999-12", "0001-01"):
        with pytest.raises(ValueError, match="not a month"):
            parse_period(bad)


def test_line_json_round_trips_the_fields_a_line_has() -> None:
    line = Line(USAGE, "2026-03", "m", None, "edge", 1, 2, 3, 0, 0, Decimal("0.10"))
    assert line.to_json()["model_version"] is None and line.to_json()["amount"] == "0.10"

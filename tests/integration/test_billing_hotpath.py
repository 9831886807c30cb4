"""The billing hot path on PostgreSQL (``controlplane.billing.hotpath`` through ``cloud.gateway.metering.UsageWriter``,
each phase one statement awaited on the event loop) leaves the database as the general path (ORM transactions in
threads) does: month totals, reservations, checkpoints and records; a replayed settle writes nothing twice, a
conflicting one is counted, concurrent reserves never overspend, and a stale reservation's lease still expires.
PostgreSQL only: SQLite keeps the general path, which the other billing tests cover."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, TypeVar

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from cloud.gateway.metering import UsageWriter
from controlplane.billing import budgets, credit, ledger
from controlplane.billing.budget_admin import set_budget
from controlplane.billing.budgets import BudgetExceededError, BudgetHold, reclaim_expired
from controlplane.billing.ledger import NewUsage
from controlplane.billing.pricing import period_of
from controlplane.billing.scopes import Attribution
from controlplane.storage.database import create_db
from controlplane.storage.migrate import upgrade
from controlplane.storage.tables import BudgetPeriod, BudgetReservation, Tenant, UsageCheckpoint, UsageRecord
from controlplane.tenancy.service import create_tenant
from tests.conftest import PG_URL, _postgres_schema

pytestmark = [pytest.mark.integration, pytest.mark.postgres]

T = TypeVar("T")
LEASE_S = 60.0


@pytest.fixture
def engine() -> Iterator[Engine]:
    if not PG_URL or not PG_URL.startswith(("postgresql", "postgres")):
        pytest.skip("the one-statement billing path is PostgreSQL's: set TIERLINE_TEST_DATABASE_URL to a PostgreSQL")
    with _postgres_schema() as url:
        upgrade(url)
        db = create_db(url, pool_size=20)
        yield db
        db.dispose()


def _tenant(engine: Engine, name: str, budget: Decimal | None = Decimal(10)) -> int:
    with Session(engine) as s:
        tenant_id = create_tenant(s, name, budget=budget).id or 0
        s.commit()
    return tenant_id


def _month_row(engine: Engine, tenant_id: int) -> None:
    """The tenant's row of this month, as its first reservation creates it: the one-statement path applies."""
    with Session(engine) as s:
        s.add(BudgetPeriod(tenant_id=tenant_id, period=period_of(datetime.now(UTC))))
        s.commit()


def _usage(request_id: str, tenant_id: int, completion: int, cost: Decimal | None, **more: Any) -> NewUsage:
    return NewUsage(
        id=request_id,
        tenant_id=tenant_id,
        model="m",
        tier="cloud",
        occurred_at=datetime(2026, 12, 3, 8, 0, 0, 123456, tzinfo=UTC),
        prompt_tokens=7,
        completion_tokens=completion,
        cached_prompt_tokens=2,
        latency_ms=12.5,
        ttft_ms=3.25,
        rating=(None, cost),
        **more,
    )


def _run(writer: UsageWriter, work: Callable[[], Awaitable[T]]) -> T:
    """``work`` on a loop of its own, the writer's connections of that loop closed after."""

    async def main() -> T:
        try:
            return await work()
        finally:
            await writer.close()

    return asyncio.run(main())


def _state(engine: Engine, tenant_id: int) -> dict[str, Any]:
    """What a tenant's billing left stored, without the ids and clocks that differ between two runs."""
    with Session(engine) as s:
        month = s.get(BudgetPeriod, (tenant_id, period_of(datetime.now(UTC))))
        reservations = s.exec(select(BudgetReservation).where(col(BudgetReservation.tenant_id) == tenant_id)).all()
        checkpoints = s.exec(select(UsageCheckpoint).where(col(UsageCheckpoint.tenant_id) == tenant_id)).all()
        records = s.exec(select(UsageRecord).where(col(UsageRecord.tenant_id) == tenant_id)).all()
        volatile = {"id", "tenant_id", "ingested_at"}
        return {
            "month": (month.spent, month.reserved) if month is not None else None,
            "reservations": [(r.amount, r.period, r.windows, r.on_credit) for r in reservations],
            "checkpoints": len(checkpoints),
            "records": [{k: v for k, v in r.model_dump().items() if k not in volatile} for r in records],
        }


def test_fast_path_stores_what_the_general_path_stores(engine: Engine) -> None:
    fast, general = _tenant(engine, "fast"), _tenant(engine, "general")
    writer = UsageWriter(engine)
    seen: dict[str, Any] = {}

    async def requests() -> None:
        for i, cost in enumerate((Decimal("0.2"), Decimal("0.35"))):
            hold = await writer.reserve_request(fast, Decimal(10), Decimal("0.5"), Attribution(), lease_s=LEASE_S)
            assert hold is not None
            await writer.checkpoint(_usage(f"fast-{i}", fast, 3, None), hold, LEASE_S)
            seen[f"in flight {i}"] = _state(engine, fast)
            seen[f"spent {i}"] = await writer.settle_checkpointed(_usage(f"fast-{i}", fast, 9 + i, cost), hold)

    _run(writer, requests)
    # The month's row is created by the first reservation (the general path's job); everything else is one statement.
    assert writer.num_fast == 5
    period = period_of(datetime.now(UTC))
    assert seen["in flight 1"]["month"] == (Decimal("0.2"), Decimal("0.5"))
    assert seen["in flight 1"]["reservations"] == [(Decimal("0.5"), period, None, False)]
    assert seen["in flight 1"]["checkpoints"] == 1
    assert (seen["spent 0"], seen["spent 1"]) == (Decimal("0.2"), Decimal("0.55"))
    for i, cost in enumerate((Decimal("0.2"), Decimal("0.35"))):
        hold = budgets.reserve_request(engine, general, Decimal(10), Decimal("0.5"), Attribution(), lease_s=LEASE_S)
        with Session(engine) as s:
            ledger.checkpoint(s, _usage(f"general-{i}", general, 3, None), hold, LEASE_S)
            s.commit()
        if i == 1:
            assert _state(engine, general) == seen["in flight 1"]
        with Session(engine) as s:
            ledger.settle_checkpointed(s, _usage(f"general-{i}", general, 9 + i, cost), hold)
            s.commit()
    assert _state(engine, fast) == _state(engine, general)
    assert _state(engine, fast)["month"] == (Decimal("0.55"), Decimal(0))
    assert [r["completion_tokens"] for r in _state(engine, fast)["records"]] == [9, 10]


def test_a_request_without_a_budget_holds_nothing_and_is_recorded_once(engine: Engine) -> None:
    tenant_id = _tenant(engine, "unlimited", budget=None)
    writer = UsageWriter(engine)

    async def request() -> Decimal | None:
        hold = await writer.reserve_request(tenant_id, None, Decimal("0.5"), Attribution(), lease_s=LEASE_S)
        assert hold is None
        await writer.checkpoint(_usage("free-1", tenant_id, 3, None), None, LEASE_S)
        return await writer.settle_checkpointed(_usage("free-1", tenant_id, 9, Decimal("0.2")), None)

    assert _run(writer, request) is None
    state = _state(engine, tenant_id)
    assert state["checkpoints"] == 0 and state["reservations"] == []
    assert [(r["completion_tokens"], r["cost"]) for r in state["records"]] == [(9, Decimal("0.2"))]


def test_fallbacks_keep_the_general_paths_behaviour(engine: Engine) -> None:
    scoped, prepaid, full = _tenant(engine, "scoped"), _tenant(engine, "prepaid"), _tenant(engine, "full", Decimal(1))
    with Session(engine) as s:
        set_budget(
            s,
            s.get_one(Tenant, scoped),
            scope="tenant",
            ref=None,
            period="day",
            amount=Decimal(3),
            is_hard=True,
            actor="test",
        )
        credit.top_up(s, s.get_one(Tenant, prepaid), Decimal(5), note="", actor="test")
        s.commit()
    writer = UsageWriter(engine)
    errors: list[str] = []

    async def requests() -> tuple[BudgetHold | None, BudgetHold | None, BudgetHold | None]:
        on_window = await writer.reserve_request(scoped, Decimal(10), Decimal("0.5"), Attribution(), LEASE_S)
        on_credit = await writer.reserve_request(prepaid, Decimal(10), Decimal("0.5"), Attribution(), LEASE_S)
        no_row_yet = await writer.reserve_request(full, Decimal(1), Decimal("0.75"), Attribution(), LEASE_S)
        try:
            await writer.reserve_request(full, Decimal(1), Decimal("0.5"), Attribution(), LEASE_S)
        except BudgetExceededError as exc:
            errors.append(str(exc))
        for hold, request_id in ((on_window, "w"), (on_credit, "c"), (no_row_yet, "n")):
            assert hold is not None
            await writer.settle_checkpointed(_usage(request_id, hold.tenant_id, 4, Decimal("0.1")), hold)
        return on_window, on_credit, no_row_yet

    on_window, on_credit, no_row_yet = _run(writer, requests)
    assert on_window is not None and len(on_window.windows) == 1, "the scoped window is held too"
    assert on_credit is not None and on_credit.on_credit
    assert no_row_yet is not None and no_row_yet.amount == Decimal("0.75")
    assert errors == [
        "the tenant's monthly budget (1) cannot cover this request's worst case (0.5); lower max_tokens or raise the "
        "budget"
    ]
    assert writer.num_fast == 1, "only the month-only hold (n) settled in one statement"
    with Session(engine) as s:
        assert credit.available(s, prepaid) == Decimal("4.9")
    assert _state(engine, full)["month"] == (Decimal("0.1"), Decimal(0))
    assert _state(engine, scoped)["month"] == (Decimal("0.1"), Decimal(0))


def test_a_replayed_settle_writes_nothing_twice(engine: Engine) -> None:
    tenant_id = _tenant(engine, "replay")
    writer = UsageWriter(engine)

    async def request() -> None:
        hold = await writer.reserve_request(tenant_id, Decimal(10), Decimal("0.5"), Attribution(), LEASE_S)
        await writer.checkpoint(_usage("r-1", tenant_id, 3, None), hold, LEASE_S)
        final = _usage("r-1", tenant_id, 9, Decimal("0.2"))
        await writer.settle_checkpointed(final, hold)
        await writer.settle_checkpointed(final, hold)

    _run(writer, request)
    state = _state(engine, tenant_id)
    assert state["month"] == (Decimal("0.2"), Decimal(0)), "the cost counted once, the hold released once"
    assert len(state["records"]) == 1 and state["checkpoints"] == 0
    assert (writer.num_written, writer.num_duplicates, writer.num_conflicts) == (1, 1, 0)


def test_a_conflicting_settle_is_counted_and_stores_nothing(engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    tenant_id = _tenant(engine, "conflict")
    writer = UsageWriter(engine)
    told: list[int] = []
    writer.on_conflicts = told.append

    async def requests() -> None:
        first = await writer.reserve_request(tenant_id, Decimal(10), Decimal("0.5"), Attribution(), LEASE_S)
        await writer.settle_checkpointed(_usage("c-1", tenant_id, 9, Decimal("0.2")), first, checkpointed=False)
        second = await writer.reserve_request(tenant_id, Decimal(10), Decimal("0.5"), Attribution(), LEASE_S)
        await writer.settle_checkpointed(_usage("c-1", tenant_id, 30, Decimal("0.4")), second, checkpointed=False)

    with caplog.at_level(logging.WARNING, logger="controlplane.billing.hotpath"):
        _run(writer, requests)
    assert (writer.num_written, writer.num_conflicts, told) == (2 - 1, 1, [1])
    assert "reuse a stored id with a different payload" in caplog.text and "c-1" in caplog.text
    state = _state(engine, tenant_id)
    assert [r["completion_tokens"] for r in state["records"]] == [9], "the stored record is not overwritten"
    # The second request's hold settles as on the general path (released, its cost counted); only its record is not.
    assert state["month"] == (Decimal("0.6"), Decimal(0))


def test_concurrent_reserves_never_overspend(engine: Engine) -> None:
    tenant_id = _tenant(engine, "racing", budget=Decimal(1))
    _month_row(engine, tenant_id)
    writer = UsageWriter(engine, pool_size=8)

    async def one(i: int) -> bool:
        try:
            hold = await writer.reserve_request(tenant_id, Decimal(1), Decimal("0.15"), Attribution(), LEASE_S)
        except BudgetExceededError:
            return False
        await asyncio.sleep(0.01)
        await writer.settle_checkpointed(_usage(f"race-{i}", tenant_id, 5, Decimal("0.15")), hold, checkpointed=False)
        return True

    async def race() -> list[bool]:
        return list(await asyncio.gather(*(one(i) for i in range(50))))

    served = _run(writer, race)
    spent, reserved = _state(engine, tenant_id)["month"]
    assert reserved == 0
    assert spent == Decimal("0.15") * sum(served) <= Decimal(1)
    assert sum(served) == 6, "the budget's whole room was used, and no more"
    assert writer.num_fast >= 12


def test_a_stale_reservation_is_released_when_its_lease_runs_out(engine: Engine) -> None:
    tenant_id = _tenant(engine, "stale")
    _month_row(engine, tenant_id)
    writer = UsageWriter(engine)

    async def hold_briefly() -> BudgetHold | None:
        # (a lease long enough that a loaded host reaches the first check inside it: 50 ms was not, under the suite)
        return await writer.reserve_request(tenant_id, Decimal(10), Decimal("0.5"), Attribution(), lease_s=1.0)

    hold = _run(writer, hold_briefly)
    assert hold is not None and writer.num_fast == 1
    assert reclaim_expired(engine, tenant_id=tenant_id) == 0, "not before its lease runs out"
    time.sleep(1.1)
    assert reclaim_expired(engine, tenant_id=tenant_id) == 1
    assert _state(engine, tenant_id)["month"] == (Decimal(0), Decimal(0))

    async def settle_late() -> Decimal | None:  # its process was only slow: the cost still counts, released once
        return await writer.settle_checkpointed(_usage("late", tenant_id, 9, Decimal("0.2")), hold, checkpointed=False)

    assert _run(writer, settle_late) == Decimal("0.2")
    assert _state(engine, tenant_id)["month"] == (Decimal("0.2"), Decimal(0))


def test_a_streams_reservation_writes_its_first_checkpoint_in_the_same_statement(engine: Engine) -> None:
    """A stream's reservation carries its opening checkpoint (its prompt): the first bytes need no statement of their
    own, and a gateway that dies after the reservation leaves that checkpoint for the reconciler to bill."""
    monthly, unlimited, scoped, full = (
        _tenant(engine, "monthly"),
        _tenant(engine, "no-budget", budget=None),
        _tenant(engine, "scoped-open"),
        _tenant(engine, "full-open", Decimal(1)),
    )
    _month_row(engine, monthly)
    _month_row(engine, full)
    with Session(engine) as s:
        tenant = s.get_one(Tenant, scoped)
        set_budget(s, tenant, scope="tenant", ref=None, period="day", amount=Decimal(3), is_hard=True, actor="test")
        s.commit()
    writer = UsageWriter(engine)
    opened: dict[str, tuple[BudgetHold | None, bool]] = {}
    seen: dict[str, Any] = {}
    errors: list[str] = []

    def opening(request_id: str, tenant_id: int) -> NewUsage:
        return _usage(request_id, tenant_id, 0, None)

    async def requests() -> None:
        for name, tenant_id, budget in (
            ("m", monthly, Decimal(10)),
            ("u", unlimited, None),
            ("s", scoped, Decimal(10)),
        ):
            args = (tenant_id, budget, Decimal("0.5"), Attribution(), opening(f"open-{name}", tenant_id), LEASE_S)
            opened[name] = await writer.reserve_and_open(*args)
        seen["fast"] = writer.num_fast
        with Session(engine) as s:
            seen["rows"] = {cp.id: cp for cp in s.exec(select(UsageCheckpoint))}
        try:
            await writer.reserve_and_open(full, Decimal(1), Decimal(2), Attribution(), opening("open-f", full), LEASE_S)
        except BudgetExceededError as exc:
            errors.append(str(exc))
        again = await writer.reserve_and_open(
            monthly, Decimal(10), Decimal("0.5"), Attribution(), opening("open-m", monthly), LEASE_S
        )
        opened["m again"] = again
        for name, tenant_id in (("m", monthly), ("u", unlimited), ("s", scoped)):
            await writer.settle_checkpointed(_usage(f"open-{name}", tenant_id, 5, Decimal("0.1")), opened[name][0])
        await writer.settle_checkpointed(_usage("open-m2", monthly, 0, Decimal(0)), again[0], checkpointed=False)

    _run(writer, requests)
    month_hold, written = opened["m"]
    assert written and month_hold is not None and not month_hold.windows
    assert opened["u"] == (None, True), "no budget: nothing held, the checkpoint written all the same"
    scoped_hold, scoped_written = opened["s"]
    assert scoped_written and scoped_hold is not None and len(scoped_hold.windows) == 1, "the general path's"
    assert seen["fast"] == 2, "the month-only hold and the unbudgeted one took one statement each"
    rows = seen["rows"]
    assert set(rows) == {"open-m", "open-u", "open-s"}
    first = rows["open-m"]
    assert (first.prompt_tokens, first.completion_tokens, first.model) == (7, 0, "m")
    assert (first.reservation_id, first.reserved) == (month_hold.id, Decimal("0.5"))
    assert rows["open-u"].reservation_id is None and rows["open-s"].reservation_id == scoped_hold.id
    assert errors and "cannot cover" in errors[0], "a refused reservation writes no checkpoint"
    assert opened["m again"][1] is False, "an id already open is not overwritten: that stream checkpoints itself"
    for tenant_id in (monthly, unlimited, scoped, full):
        assert _state(engine, tenant_id)["checkpoints"] == 0, "each settle dropped its checkpoint"
    assert sorted(r["completion_tokens"] for r in _state(engine, monthly)["records"]) == [0, 5]

"""PostgreSQL round trips of one gateway request's billing: reserve, the first checkpoint, settle + record.

``general``: the ORM path (``budgets.reserve_request``, ``ledger.checkpoint``, ``ledger.settle_checkpointed``, as
SQLite still runs it), counted with SQLAlchemy's events (statements, BEGIN, COMMIT, ROLLBACK) and the pool's
pre-pings. ``hotpath``: what the gateway runs on PostgreSQL (``controlplane.billing.hotpath``, one autocommit
statement per phase), counted per statement sent on its psycopg connection (psycopg sends a statement's parse,
bind and execute together and waits once). On a fresh schema, for a tenant with a monthly budget; the first
request also creates the month's row and is left out. The requests follow each other at once, as under load: a
connection back in the pool a moment ago is not pinged (``controlplane.storage.database.PING_IDLE_S``).

    TIERLINE_TEST_DATABASE_URL=postgresql://postgres@127.0.0.1:5432/test python -m bench.lab.gateway_round_trips
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import psycopg
from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlmodel import Session

from bench.billing_bench import _postgres, _postgres_url
from cloud.gateway.pg_async import conninfo_of
from controlplane.billing import budgets, hotpath, ledger
from controlplane.billing.scopes import Attribution
from controlplane.storage.database import create_db
from controlplane.storage.migrate import upgrade
from controlplane.tenancy.service import create_tenant


def _usage(request_id: str, tenant_id: int) -> ledger.NewUsage:
    return ledger.NewUsage(
        id=request_id,
        tenant_id=tenant_id,
        model="m",
        tier="cloud",
        prompt_tokens=5,
        completion_tokens=3,
        occurred_at=datetime.now(UTC),
        rating=(None, Decimal("0.001")),
    )


def _phases(
    trips: list[int], reserve: Callable[[], Any], checkpoint: Callable[[Any], None], settle: Callable[[Any], None]
) -> dict[str, int]:
    steps: list[dict[str, int]] = []
    for _ in range(3):
        at = trips[0]
        hold = reserve()
        after_reserve = trips[0]
        checkpoint(hold)
        after_checkpoint = trips[0]
        settle(hold)
        steps.append(
            {
                "reserve": after_reserve - at,
                "first_checkpoint": after_checkpoint - after_reserve,
                "settle": trips[0] - after_checkpoint,
            }
        )
    return steps[-1]


def _general(engine: Engine, tenant_id: int) -> dict[str, int]:
    trips = [0]

    def count(*_: object) -> None:
        trips[0] += 1

    event.listen(engine, "before_cursor_execute", count)
    for name in ("begin", "commit", "rollback"):
        event.listen(engine, name, count)
    ping = engine.dialect.do_ping  # the pool's pre-ping, when it pings (a connection idle for a while)

    def counted_ping(dbapi_connection: Any) -> bool:
        count()
        return ping(dbapi_connection)

    engine.dialect.do_ping = counted_ping  # type: ignore[method-assign]
    ids = iter(range(100))

    def reserve() -> Any:
        return budgets.reserve_request(engine, tenant_id, Decimal(100), Decimal("0.01"), Attribution(), lease_s=60)

    def checkpoint(hold: Any) -> None:
        with Session(engine) as s:
            ledger.checkpoint(s, _usage(f"rt-{next(ids)}", tenant_id), hold, 60)
            s.commit()

    def settle(hold: Any) -> None:
        with Session(engine) as s:
            ledger.settle_checkpointed(s, _usage(f"rt-{next(ids) - 1}", tenant_id), hold)
            s.commit()

    try:
        return _phases(trips, reserve, checkpoint, settle)
    finally:
        event.remove(engine, "before_cursor_execute", count)
        for name in ("begin", "commit", "rollback"):
            event.remove(engine, name, count)
        engine.dialect.do_ping = ping  # type: ignore[method-assign]


class _Counted:
    """A psycopg connection that counts the statements sent on it (one round trip each)."""

    def __init__(self, connection: psycopg.Connection[Any], trips: list[int]) -> None:
        self.connection, self.trips = connection, trips

    def execute(self, sql: str, params: dict[str, Any]) -> psycopg.Cursor[Any]:
        self.trips[0] += 1
        return self.connection.execute(sql, params)


def _hotpath(engine: Engine, tenant_id: int) -> dict[str, int]:
    trips = [0]
    ids = iter(range(100, 200))
    with psycopg.connect(conninfo_of(engine), autocommit=True) as raw:
        connection = _Counted(raw, trips)

        def reserve() -> Any:
            prepared = hotpath.reservation(tenant_id, Decimal(100), Decimal("0.01"), Attribution(), lease_s=60)
            held = hotpath.reserve_blocking(connection, prepared)
            assert held is not hotpath.FALLBACK, "the month's row exists: the one-statement path applies"
            return held

        def checkpoint(hold: Any) -> None:
            hotpath.checkpoint_blocking(connection, _usage(f"rt-{next(ids)}", tenant_id), hold, 60)

        def settle(hold: Any) -> None:
            hotpath.settle_blocking(connection, _usage(f"rt-{next(ids) - 1}", tenant_id), hold, True)

        return _phases(trips, reserve, checkpoint, settle)


def main() -> None:
    url = _postgres_url()
    if url is None:
        raise SystemExit("set TIERLINE_BENCH_DATABASE_URL (or TIERLINE_TEST_DATABASE_URL)")
    with _postgres(url) as schema_url:
        upgrade(schema_url)
        engine = create_db(schema_url)
        with Session(engine) as s:
            tenant_id = create_tenant(s, "round-trips", budget=Decimal(100)).id or 0
            s.commit()
        general = _general(engine, tenant_id)
        fast = _hotpath(engine, tenant_id)
        engine.dispose()
    print(
        json.dumps(
            {
                "general": {"per_request": general, "total": sum(general.values())},
                "hotpath": {"per_request": fast, "total": sum(fast.values())},
                # kept for readers of the earlier output: what the gateway runs on PostgreSQL now
                "per_request": fast,
                "total": sum(fast.values()),
            }
        )
    )


if __name__ == "__main__":
    main()

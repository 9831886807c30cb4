"""PostgreSQL round trips of one gateway request's billing: reserve, the first checkpoint, settle + record.

Counted with SQLAlchemy's events (statements, BEGIN, COMMIT, ROLLBACK) and the pool's pre-pings on a fresh schema,
for a tenant with a monthly budget; the first request also creates the month's row and is left out. The requests
follow each other at once, as under load: a connection back in the pool a moment ago is not pinged
(``controlplane.storage.database.PING_IDLE_S``).

    TIERLINE_TEST_DATABASE_URL=postgresql://postgres@127.0.0.1:5432/test python -m bench.gateway_round_trips
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import event
from sqlmodel import Session

from bench.billing_bench import _postgres, _postgres_url
from controlplane.billing import budgets, ledger
from controlplane.billing.scopes import Attribution
from controlplane.storage.database import create_db
from controlplane.storage.migrate import upgrade
from controlplane.tenancy.service import create_tenant


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
        steps: list[dict[str, int]] = []
        for i in range(3):
            at = trips[0]
            hold = budgets.reserve_request(engine, tenant_id, Decimal(100), Decimal("0.01"), Attribution(), lease_s=60)
            reserve = trips[0] - at
            usage = ledger.NewUsage(
                id=f"rt-{i}",
                tenant_id=tenant_id,
                model="m",
                tier="cloud",
                prompt_tokens=5,
                completion_tokens=3,
                occurred_at=datetime.now(UTC),
                rating=(None, Decimal("0.001")),
            )
            at = trips[0]
            with Session(engine) as s:
                ledger.checkpoint(s, usage, hold, 60)
                s.commit()
            first_checkpoint = trips[0] - at
            at = trips[0]
            with Session(engine) as s:
                ledger.settle_checkpointed(s, usage, hold)
                s.commit()
            steps.append({"reserve": reserve, "first_checkpoint": first_checkpoint, "settle": trips[0] - at})
        engine.dispose()
    print(json.dumps({"per_request": steps[-1], "total": sum(steps[-1].values())}))


if __name__ == "__main__":
    main()

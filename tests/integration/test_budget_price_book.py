"""The price book in a server: loaded and refreshed in worker threads, never read from the database on the event
loop, and a price change is in force within one refresh."""

from __future__ import annotations

import asyncio
import threading
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from sqlalchemy import create_engine
from sqlmodel import Session

from controlplane.billing.budgets import PriceBook
from controlplane.billing.pricing import Tokens
from controlplane.storage.tables import Price

pytestmark = pytest.mark.integration
MODEL = "tierline/lm-cloud"


def _add_price(url: str, prompt: str, at: datetime) -> None:
    engine = create_engine(url)
    with Session(engine) as s:
        s.add(
            Price(
                model=MODEL,
                prompt_per_mtok=Decimal(prompt),
                completion_per_mtok=Decimal(prompt),
                cached_per_mtok=Decimal(prompt),
                effective_from=at,
            )
        )
        s.commit()
    engine.dispose()


def test_a_started_price_book_reads_the_database_only_off_the_event_loop(migrated_db: str) -> None:
    _add_price(migrated_db, "1", datetime.now(UTC) - timedelta(days=1))
    engine = create_engine(migrated_db)
    book = PriceBook(engine, ttl_s=0.05)
    refreshed_on: list[int] = []
    refresh = book.refresh

    def recording_refresh() -> None:
        refreshed_on.append(threading.get_ident())
        refresh()

    book.refresh = recording_refresh  # type: ignore[method-assign]

    async def serve() -> tuple[Decimal | None, Decimal | None]:
        await book.start()
        try:
            _, before = book.cost(MODEL, None, "cloud", Tokens(1_000_000, 0))
            await asyncio.to_thread(_add_price, migrated_db, "2", datetime.now(UTC) - timedelta(seconds=1))
            deadline = asyncio.get_running_loop().time() + 10
            while True:  # lookups on the loop while refreshes come and go: none of them may query
                _, after = book.cost(MODEL, None, "cloud", Tokens(1_000_000, 0))
                if after != before or asyncio.get_running_loop().time() > deadline:
                    return before, after
                await asyncio.sleep(0.01)
        finally:
            await book.close()

    loop_thread = threading.get_ident()
    before, after = asyncio.run(serve())
    engine.dispose()
    assert (before, after) == (Decimal(1), Decimal(2))
    assert len(refreshed_on) >= 2 and loop_thread not in refreshed_on

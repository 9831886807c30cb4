"""An idle webhook dispatcher looks at the store when a delivery falls due, not only at its next poll: a
delivery whose attempt a dispatcher claimed and then died on (its process killed) is retried once the claim
lapses. A real database, a real HTTP receiver on 127.0.0.1, the dispatcher in this process."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from cloud.gateway.jobs import JobSettings
from cloud.gateway.webhook_dispatcher import WebhookDispatcher
from controlplane.storage.database import create_db
from tests.conftest import migrated_sqlite
from tests.integration.webhook_support import queue_delivery

pytestmark = pytest.mark.integration


@pytest.fixture
def posts() -> Iterator[tuple[int, list[float]]]:
    """A receiver on 127.0.0.1 answering 204, and when each POST arrived."""
    times: list[float] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            times.append(time.monotonic())
            self.send_response(204)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield int(server.server_address[1]), times
    server.shutdown()
    server.server_close()


def test_a_claim_left_by_a_dead_dispatcher_is_retried_when_it_lapses(
    tmp_path: Path, posts: tuple[int, list[float]]
) -> None:
    port, times = posts
    engine = create_db(migrated_sqlite(tmp_path))
    store, delivery_id = queue_delivery(engine, f"http://127.0.0.1:{port}/hook")
    # Another process's dispatcher took the attempt for 0.6 s and died: nothing is due before then.
    assert store.claim(delivery_id, 0, hold_s=0.6) is not None
    claimed_at = time.monotonic()
    settings = JobSettings(job_poll_s=60, webhook_allow_private_networks=True, webhook_timeout_s=2.0)

    async def main() -> None:
        dispatcher = WebhookDispatcher(store, settings)
        await dispatcher.start()
        while not times and time.monotonic() - claimed_at < 20:
            await asyncio.sleep(0.02)
        await dispatcher.close()

    asyncio.run(main())
    engine.dispose()
    assert len(times) == 1, times
    # When the claim lapsed, not at the next poll 60 s on (a loaded host has taken 2.1 s to get the POST out).
    assert 0.55 <= times[0] - claimed_at < 15.0, times[0] - claimed_at

"""Webhook deliveries connect to the address that was checked: a receiver host that resolves to a public address
for the check and to loopback afterwards (DNS rebinding) never reaches the loopback server. The dispatcher runs
in this process on a real database, POSTing to a real HTTP server on 127.0.0.1; the attacker's DNS is a
stand-in for ``socket.getaddrinfo`` (the resolver both the check and httpx's connect go through)."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from sqlmodel import Session, select

from cloud.gateway import webhook_dispatcher
from cloud.gateway.jobs import JobSettings
from cloud.gateway.webhook_dispatcher import WebhookDispatcher
from cloud.gateway.webhooks import is_valid_signature
from controlplane.storage.database import create_db
from controlplane.storage.tables import WebhookAttempt, WebhookDelivery, WebhookSecret
from tests.integration.webhook_support import queue_delivery

pytestmark = pytest.mark.integration
PUBLIC = "93.184.215.14"  # a global address: from this test machine, unreachable or at least not the receiver
HOST = "hooks.rebind.test"


class Receiver:
    """An HTTP server on 127.0.0.1 (the "internal service"), recording each POST's path, headers and body."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                receiver.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                self.send_response(204)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    r.thread.start()
    yield r
    r.server.shutdown()
    r.server.server_close()


def _resolver(answers: list[str], lookups: list[str]) -> Any:
    """``socket.getaddrinfo`` answering ``HOST`` with ``answers`` in turn (the last one from then on)."""
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        name = host.decode() if isinstance(host, bytes) else host
        if name != HOST:
            return real(host, port, *args, **kwargs)
        lookups.append(name)
        address = answers[min(len(lookups), len(answers)) - 1]
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (address, int(port)))]

    return getaddrinfo


def _deliver(db_url: str, url: str) -> tuple[WebhookDelivery, list[WebhookAttempt]]:
    """Queue one tenant event to ``url``, let a dispatcher (private networks refused) make one attempt."""
    engine = create_db(db_url)
    store, delivery_id = queue_delivery(engine, url)
    settings = JobSettings(webhook_allow_private_networks=False, webhook_timeout_s=2.0, webhook_max_attempts=1)

    async def one_attempt() -> None:
        dispatcher = WebhookDispatcher(store, settings)
        claimed = store.claim(delivery_id, 0, hold_s=30)
        assert claimed is not None
        await dispatcher._attempt(claimed)
        await dispatcher.close()

    asyncio.run(one_attempt())
    with Session(engine) as s:
        delivery = s.exec(select(WebhookDelivery).where(WebhookDelivery.id == delivery_id)).one()
        attempts = list(s.exec(select(WebhookAttempt).where(WebhookAttempt.delivery_id == delivery_id)))
        s.expunge_all()
    engine.dispose()
    return delivery, attempts


def test_a_host_rebinding_to_loopback_after_the_check_never_reaches_loopback(
    migrated_db: str, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    lookups: list[str] = []
    monkeypatch.setattr(socket, "getaddrinfo", _resolver([PUBLIC, "127.0.0.1"], lookups))
    delivery, attempts = _deliver(migrated_db, f"http://{HOST}:{receiver.port}/internal-admin")
    assert receiver.requests == []  # the internal server was never POSTed to
    assert lookups == [HOST]  # resolved once, for the check; the connection went to the address checked
    assert delivery.status == "failed" and len(attempts) == 1 and attempts[0].status_code is None
    assert attempts[0].error


def test_a_host_resolving_to_loopback_is_refused_without_a_connection(
    migrated_db: str, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    lookups: list[str] = []
    monkeypatch.setattr(socket, "getaddrinfo", _resolver(["127.0.0.1"], lookups))
    delivery, attempts = _deliver(migrated_db, f"http://{HOST}:{receiver.port}/internal-admin")
    assert receiver.requests == [] and delivery.status == "failed"
    assert attempts[0].error == f"refused: {HOST} resolves to a non-public address"


def test_the_pinned_post_carries_the_urls_host_and_a_valid_signature(
    migrated_db: str, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The receiver on 127.0.0.1 stands in for a public host here: only the address check is told so."""
    lookups: list[str] = []
    monkeypatch.setattr(socket, "getaddrinfo", _resolver(["127.0.0.1"], lookups))
    monkeypatch.setattr(webhook_dispatcher, "is_public_address", lambda address: address == "127.0.0.1")
    delivery, attempts = _deliver(migrated_db, f"http://{HOST}:{receiver.port}/hook?x=1")
    assert delivery.status == "delivered" and [a.status_code for a in attempts] == [204]
    [(path, headers, body)] = receiver.requests
    assert path == "/hook?x=1" and headers["host"] == f"{HOST}:{receiver.port}"
    assert lookups == [HOST]
    engine = create_db(migrated_db)
    with Session(engine) as s:
        stored = s.exec(select(WebhookSecret)).one().secret
    engine.dispose()
    assert is_valid_signature(stored, body, headers["x-tierline-signature"])

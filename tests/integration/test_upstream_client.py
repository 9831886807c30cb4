"""The gateway's HTTP/1.1 client to its model servers (``cloud.serving.backends.http1``) against raw asyncio socket
servers on 127.0.0.1: every body framing a server may use, 1xx answers, keep-alive reuse, the one retry on a connection
the server closed before answering (and none once bytes arrived), and httpx's exception types for the failures
the failover and the endpoint breakers act on."""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
import uvloop
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from cloud.serving.backends.http1 import Http1Client, HttpxUpstream, upstream_client
from tests.conftest import free_port

pytestmark = pytest.mark.integration

Handler = Callable[["Conn"], Awaitable[None]]


@dataclass
class Seen:
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)  # each request's head and body
    closed_by_client: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Conn:
    """One accepted connection, as the handler sees it."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    seen: Seen
    index: int  # 0: the server's first connection

    async def request(self) -> bytes | None:
        """The next request (head and body), None when the client closed."""
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        request = head + await self.reader.readexactly(length)
        self.seen.requests.append(request)
        return request

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()


@asynccontextmanager
async def server(handler: Handler) -> AsyncIterator[tuple[str, Seen]]:
    seen = Seen()
    handlers: set[asyncio.Task[None]] = set()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handlers.add(asyncio.current_task())  # type: ignore[arg-type]
        seen.connections += 1
        conn = Conn(reader, writer, seen, seen.connections - 1)
        try:
            await handler(conn)
            if await reader.read() == b"":  # the handler is done: wait for the client to close its side
                seen.closed_by_client.set()
        except (ConnectionError, asyncio.IncompleteReadError):
            seen.closed_by_client.set()
        except asyncio.CancelledError:  # the test is over
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        srv.close()
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


async def keep_answering(conn: Conn) -> None:
    """Answers every request on the connection with its index there."""
    n = 0
    while await conn.request() is not None:
        await conn.send(ok(b"answer %d" % n))
        n += 1


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    """On asyncio's loop, then on uvloop's (the gateway's)."""
    for factory in (asyncio.new_event_loop, uvloop.new_event_loop):
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(asyncio.wait_for(scenario(), 30))


def test_a_sized_body_comes_whole_and_the_request_says_what_the_gateway_sends() -> None:
    async def scenario() -> None:
        async def handler(conn: Conn) -> None:
            await conn.request()
            await conn.send(ok(b'{"ok": true}', b"Retry-After: 3\r\nX-Twice: a\r\nX-Twice: b\r\n"))

        async with server(handler) as (url, seen):
            client = Http1Client(5.0)
            headers = {"Authorization": "Bearer sk-1", "Content-Type": "application/json"}
            response = await client.post(f"{url}/v1/chat/completions?x=1", b'{"model": "m"}', headers)
            assert response.status_code == 200
            assert response.headers["retry-after"] == "3" and response.headers["x-twice"] == "a, b"
            assert await response.aread() == b'{"ok": true}'
            await client.aclose()
        request = seen.requests[0]
        assert request.startswith(b"POST /v1/chat/completions?x=1 HTTP/1.1\r\n")
        for line in (b"Authorization: Bearer sk-1", b"Content-Length: 14", b"Accept-Encoding: identity", b"Host: "):
            assert line in request
        assert request.endswith(b'\r\n\r\n{"model": "m"}')

    run(scenario)


def test_a_chunked_body_comes_as_its_chunks_arrive_with_extensions_and_trailers_dropped() -> None:
    async def scenario() -> None:
        sent = asyncio.Event()

        async def handler(conn: Conn) -> None:
            await conn.request()
            await conn.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            await conn.send(b"6;ext=1\r\ndata: \r\n")
            await sent.wait()  # the first piece reached the client before the rest was sent
            await conn.send(b"b")  # a size line split across reads
            await conn.send(b"\r\nhello world\r\n0\r\nX-Trailer: t\r\n\r\n")

        async with server(handler) as (url, _):
            client = Http1Client(5.0)
            response = await client.post(url, b"", {})
            pieces = []
            async for piece in response.aiter_bytes():
                pieces.append(piece)
                sent.set()
            assert pieces[0] == b"data: " and b"".join(pieces) == b"data: hello world"
            await client.aclose()

    run(scenario)


def test_a_body_delimited_by_the_close_ends_there_and_its_connection_is_not_reused() -> None:
    async def scenario() -> None:
        async def handler(conn: Conn) -> None:
            await conn.request()
            await conn.send(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil ")
            await conn.send(b"the close")
            conn.writer.close()

        async with server(handler) as (url, seen):
            client = Http1Client(5.0)
            for _ in range(2):
                response = await client.post(url, b"", {})
                assert await response.aread() == b"until the close"
            assert seen.connections == 2 and client.connections_opened == 2
            await client.aclose()

    run(scenario)


def test_informational_answers_are_skipped() -> None:
    async def scenario() -> None:
        async def handler(conn: Conn) -> None:
            await conn.request()
            await conn.send(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n")
            await conn.send(ok(b"final"))

        async with server(handler) as (url, _):
            client = Http1Client(5.0)
            response = await client.post(url, b"x", {})
            assert response.status_code == 200 and "link" not in response.headers
            assert await response.aread() == b"final"
            await client.aclose()

    run(scenario)


def test_keep_alive_sends_requests_one_after_another_on_one_connection() -> None:
    async def scenario() -> None:
        async with server(keep_answering) as (url, seen):
            client = Http1Client(5.0)
            for n in range(3):
                response = await client.post(url, b"{}", {})
                assert await response.aread() == b"answer %d" % n  # the n-th request on the same connection
            # a stream read up to its end but not past it (the relay stops at [DONE]) is back in the pool too
            response = await client.post(url, b"{}", {})
            await response.aclose()
            response = await client.post(url, b"{}", {})
            assert await response.aread() == b"answer 4"
            assert seen.connections == 1 and client.connections_opened == 1
            await client.aclose()

    run(scenario)


def test_a_reused_connection_the_server_closed_unanswered_is_retried_once_on_a_new_one() -> None:
    async def scenario() -> None:
        async def handler(conn: Conn) -> None:
            if conn.index == 0:
                await conn.request()
                await conn.send(ok(b"first"))
                await conn.request()  # the server's keep-alive timeout races this request: closed unanswered
                conn.writer.close()
                return
            await keep_answering(conn)

        async with server(handler) as (url, seen):
            client = Http1Client(5.0)
            assert await (await client.post(url, b"1", {})).aread() == b"first"
            response = await client.post(url, b"2", {})
            assert await response.aread() == b"answer 0"
            assert seen.connections == 2 and [r[-1:] for r in seen.requests] == [b"1", b"2", b"2"]
            await client.aclose()

    run(scenario)


def test_no_retry_once_a_byte_of_the_answer_arrived_nor_on_a_new_connection() -> None:
    async def scenario() -> None:
        async def handler(conn: Conn) -> None:
            if conn.index == 0:
                await conn.request()
                await conn.send(ok(b"first"))
                await conn.request()
                await conn.send(b"HTTP/1.1 200 OK\r\nContent-Le")  # then the server dies
                conn.writer.close()
                return
            await conn.request()  # a new connection closed unanswered: not sent again either
            conn.writer.close()

        async with server(handler) as (url, seen):
            client = Http1Client(5.0)
            assert await (await client.post(url, b"1", {})).aread() == b"first"
            with pytest.raises(httpx.RemoteProtocolError):
                await client.post(url, b"2", {})
            assert seen.connections == 1 and len(seen.requests) == 2
            with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
                await client.post(url, b"3", {})
            assert seen.connections == 2 and len(seen.requests) == 3
            await client.aclose()

    run(scenario)


def test_a_body_cut_short_is_a_protocol_error_not_a_short_answer() -> None:
    async def scenario() -> None:
        async def handler(conn: Conn) -> None:
            await conn.request()
            await conn.send(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this")
            conn.writer.close()

        async with server(handler) as (url, _):
            client = Http1Client(5.0)
            response = await client.post(url, b"", {})
            with pytest.raises(httpx.RemoteProtocolError):
                await response.aread()
            await client.aclose()

    run(scenario)


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 OK\r\n\r\n",
        b"ICY 200 OK\r\n\r\n",
        b"HTTP/1.1 2000 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n",
    ],
)
def test_a_malformed_answer_is_a_remote_protocol_error(head: bytes) -> None:
    async def scenario() -> None:
        async def handler(conn: Conn) -> None:
            await conn.request()
            await conn.send(head)

        async with server(handler) as (url, _):
            client = Http1Client(5.0)
            with pytest.raises(httpx.RemoteProtocolError):
                await (await client.post(url, b"", {})).aread()
            await client.aclose()

    run(scenario)


def test_a_compressed_answer_is_refused_since_the_gateway_asks_for_identity() -> None:
    async def scenario() -> None:
        async def handler(conn: Conn) -> None:
            await conn.request()
            await conn.send(ok(b"\x1f\x8b", b"Content-Encoding: gzip\r\n"))

        async with server(handler) as (url, _):
            client = Http1Client(5.0)
            with pytest.raises(httpx.DecodingError, match="gzip"):
                await client.post(url, b"", {})
            await client.aclose()

    run(scenario)


def test_a_silent_server_is_a_read_timeout_before_and_during_the_body() -> None:
    async def scenario() -> None:
        async def handler(conn: Conn) -> None:
            await conn.request()
            if conn.index == 1:
                await conn.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
            await asyncio.sleep(10)

        async with server(handler) as (url, _):
            client = Http1Client(0.3)
            with pytest.raises(httpx.ReadTimeout):
                await client.post(url, b"", {})
            response = await client.post(url, b"", {})
            pieces = response.aiter_bytes()
            assert await anext(pieces) == b"hello"
            with pytest.raises(httpx.ReadTimeout):
                await anext(pieces)
            await response.aclose()
            await client.aclose()

    run(scenario)


def test_a_refused_connection_is_a_connect_error() -> None:
    async def scenario() -> None:
        client = Http1Client(5.0)
        with pytest.raises(httpx.ConnectError):
            await client.post(f"http://127.0.0.1:{free_port()}/v1/completions", b"", {})

    run(scenario)


def test_a_large_streamed_body_is_relayed_intact_while_the_reader_lags() -> None:
    body = os.urandom(8 << 20)

    async def scenario() -> None:
        async def handler(conn: Conn) -> None:
            await conn.request()
            await conn.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            at, size = 0, 1
            while at < len(body):  # chunk sizes from 1 byte to 256 KiB
                piece = body[at : at + size]
                await conn.send(b"%x\r\n%s\r\n" % (len(piece), piece))
                at, size = at + len(piece), size * 2 if size < 1 << 18 else 1
            await conn.send(b"0\r\n\r\n")
            await keep_answering(conn)

        async with server(handler) as (url, seen):
            client = Http1Client(5.0)
            response = await client.post(url, b"", {})
            got: list[bytes] = []
            async for piece in response.aiter_bytes():
                if len(got) < 4:
                    await asyncio.sleep(0.2)  # the server fills the socket and the client's buffer meanwhile
                got.append(piece)
            assert b"".join(got) == body and len(got) > 1
            assert await (await client.post(url, b"", {})).aread() == b"answer 0"  # the connection is reusable
            assert seen.connections == 1
            await client.aclose()

    run(scenario)


def test_closing_an_unfinished_answer_closes_the_connection_so_the_upstream_sees_the_client_leave() -> None:
    async def scenario() -> None:
        async def handler(conn: Conn) -> None:
            await conn.request()
            await conn.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
            # the handler returns: accept() waits for the client's close

        async with server(handler) as (url, seen):
            client = Http1Client(5.0)
            response = await client.post(url, b"", {})
            assert await anext(response.aiter_bytes()) == b"hello"
            await response.aclose()
            await asyncio.wait_for(seen.closed_by_client.wait(), 5)
            await client.aclose()

    run(scenario)


def test_a_header_that_would_inject_lines_is_refused_before_sending() -> None:
    async def scenario() -> None:
        async with server(keep_answering) as (url, seen):
            client = Http1Client(5.0)
            with pytest.raises(httpx.LocalProtocolError):
                await client.post(url, b"", {"Authorization": "Bearer x\r\nX-Admin: 1"})
            assert seen.connections == 0
            await client.aclose()

    run(scenario)


@pytest.mark.parametrize("variable", ["HTTPS_PROXY", "http_proxy", "ALL_PROXY"])
def test_a_configured_proxy_keeps_httpx_which_honours_it(monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    http = httpx.AsyncClient()
    assert isinstance(upstream_client(http, 5.0), Http1Client)
    monkeypatch.setenv(variable, "http://127.0.0.1:3128")
    assert isinstance(upstream_client(http, 5.0), HttpxUpstream)


def _tls_contexts(tmp_path: Path, name: str) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A server context with a self-signed certificate for ``name`` (no IP address in it), and a client context
    that trusts it."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert_file, key_file)
    client = ssl.create_default_context(cafile=str(cert_file))
    return server, client


def test_https_sends_the_host_name_as_sni_and_verifies_the_certificate_against_it(tmp_path: Path) -> None:
    name = "upstream.test"
    server_context, client_context = _tls_contexts(tmp_path, name)
    names: list[str | None] = []
    server_context.sni_callback = lambda _sock, server_name, _ctx: names.append(server_name)

    async def scenario() -> None:
        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            conn = Conn(reader, writer, Seen(), 0)
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
                await keep_answering(conn)
            writer.close()

        srv = await asyncio.start_server(accept, "127.0.0.1", 0, ssl=server_context)
        port = srv.sockets[0].getsockname()[1]
        try:
            client = Http1Client(5.0, ssl_context=client_context)
            # an endpoint resolved to its address (resolve_dns) sends the name in Host: that name is the SNI
            # and the one the certificate must match
            for n in range(2):
                response = await client.post(f"https://127.0.0.1:{port}/v1", b"{}", {"Host": f"{name}:{port}"})
                assert await response.aread() == b"answer %d" % n  # one TLS connection, kept alive
            await client.aclose()
            # without it, the address is what is checked, and this certificate names no address
            client = Http1Client(5.0, ssl_context=client_context)
            with pytest.raises(httpx.ConnectError, match="certificate"):
                await client.post(f"https://127.0.0.1:{port}/v1", b"{}", {})
        finally:
            srv.close()

    names.clear()
    with asyncio.Runner() as runner:
        runner.run(asyncio.wait_for(scenario(), 30))
    assert names[0] == name

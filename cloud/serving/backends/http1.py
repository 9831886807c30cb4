"""A lean HTTP/1.1 client for the gateway's requests to its model servers (``openai`` backends).

httpx was the largest CPU cost of a relayed stream after billing (its pool, h11's event machinery, its byte
streams: ~1.4 ms of CPU per streamed call). This client does only what the gateway → model-server path needs:

- **Keep-alive**: a pool of idle connections per origin (scheme, host, port, TLS server name), newest first;
  one idle for ``KEEPALIVE_EXPIRY_S`` (httpx's default) or closed by the server is dropped. A request that finds
  its reused connection closed by the server before any byte of the answer arrived (the server's keep-alive
  timeout raced the request) is sent once more on a new connection; once a byte arrived, never.
- **Bodies**: ``Content-Length``, ``chunked`` and close-delimited; ``1xx`` answers skipped. The response is parsed
  in ``data_received``'s buffer: one task wake-up per network read, and ``aiter_bytes`` yields what one read
  completed (the SSE relay then sends the events it carries in one write).
- **Timeouts**: connecting ``CONNECT_TIMEOUT_S``; each read and write waits at most the client's ``timeout`` (the
  gateway's request timeout), as with httpx's ``Timeout(request_timeout_s, connect=2.0)``.
- **https** with SNI and certificate checks from ``ssl.create_default_context()``; a ``Host`` header names the
  server to verify (an endpoint resolved to addresses sends its host name there).
- **Errors** are httpx's exception types (``ConnectError``, ``ConnectTimeout``, ``ReadTimeout``, ``ReadError``,
  ``WriteTimeout``, ``RemoteProtocolError``, ...), so failover and the endpoint breakers see the same failures.

Not supported: proxies (``upstream_client`` keeps httpx when ``HTTP_PROXY``, ``HTTPS_PROXY`` or ``ALL_PROXY``
is set), HTTP/2, compressed answers (requests say ``Accept-Encoding: identity``; a compressed answer is a
``DecodingError``).
"""

from __future__ import annotations

import asyncio
import os
import ssl
import time
from collections.abc import AsyncIterator, Mapping
from typing import Protocol, cast
from urllib.parse import urlsplit

import httpx

CONNECT_TIMEOUT_S = 2.0
KEEPALIVE_EXPIRY_S = 5.0
MAX_HEAD_BYTES = 64 << 10  # status line and headers
MAX_CHUNK_LINE = 4 << 10
HIGH_WATER = 1 << 20  # bytes buffered unread before the socket is paused
PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")

_Origin = tuple[str, str, int, str]  # scheme, host, port, TLS server name


class UpstreamResponse(Protocol):
    """What the gateway reads of an upstream's answer (an ``httpx.Response`` is one too)."""

    @property
    def status_code(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    def aiter_bytes(self) -> AsyncIterator[bytes]: ...

    async def aread(self) -> bytes: ...

    async def aclose(self) -> None: ...


class UpstreamClient(Protocol):
    """Sends a request to a model server; its answer's body is read as a stream."""

    async def post(self, url: str, content: bytes, headers: Mapping[str, str]) -> UpstreamResponse: ...

    async def aclose(self) -> None: ...


def proxied(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment names a proxy (upper or lower case), which only httpx honours."""
    return any(environ.get(name) or environ.get(name.lower()) for name in PROXY_VARIABLES)


def upstream_client(client: httpx.AsyncClient, timeout: float) -> UpstreamClient:
    """The lean client, else ``client`` (httpx) when a proxy is configured."""
    return HttpxUpstream(client) if proxied() else Http1Client(timeout)


class HttpxUpstream:
    """``UpstreamClient`` over an ``httpx.AsyncClient`` (proxies, NO_PROXY: all of httpx's environment)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def post(self, url: str, content: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        request = self.client.build_request("POST", url, content=content, headers=headers)
        return await self.client.send(request, stream=True)

    async def aclose(self) -> None:
        await self.client.aclose()


class _StaleConnectionError(Exception):
    """The server closed the connection before any byte of the answer: the request may be sent again."""


def _expire(waiter: asyncio.Future[None], timeout: float, write: bool) -> None:
    if not waiter.done():
        if write:
            waiter.set_exception(httpx.WriteTimeout(f"the upstream took nothing for {timeout:g}s"))
        else:
            waiter.set_exception(httpx.ReadTimeout(f"the upstream sent nothing for {timeout:g}s"))


class _Connection(asyncio.Protocol):
    """One TCP (or TLS) connection: what the server sent, buffered until the response parser takes it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.eof = False  # the server closed (or the connection was lost)
        self.error: BaseException | None = None
        self.received = False  # a byte arrived since the last request was sent
        self.idle_since = 0.0
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._write_paused = False
        self._drained: asyncio.Future[None] | None = None

    # -- asyncio.Protocol --------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio's classes

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self.received = True
        if len(self.buffer) > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self.error = exc
        self._wake()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- used by the client ------------------------------------------------------------------------------------
    @property
    def reusable(self) -> bool:
        """Open, and nothing unread: a server that sent bytes while the connection was idle is not trusted."""
        return not self.eof and not self.buffer and self.transport is not None and not self.transport.is_closing()

    async def fill(self, timeout: float) -> None:
        """Wait for the server's next bytes (or its close): ``httpx.ReadTimeout`` after ``timeout`` seconds."""
        if self.eof:
            return
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        waiter = self._waiter = self.loop.create_future()
        timer = self.loop.call_later(timeout, _expire, waiter, timeout, False)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    async def send(self, data: bytes, timeout: float) -> None:
        assert self.transport is not None
        self.received = False
        self.transport.write(data)
        if self._write_paused and not self.eof:
            drained = self._drained = self.loop.create_future()
            timer = self.loop.call_later(timeout, _expire, drained, timeout, True)
            try:
                await drained
            finally:
                timer.cancel()
                self._drained = None

    def close(self) -> None:
        self.eof = True
        if self.transport is not None:
            self.transport.close()


class Http1Response:
    """An upstream's answer: status and headers read, the body read as it arrives (``aiter_bytes`` or ``aread``,
    once). A body read to its end leaves the connection to the pool; ``aclose`` before then closes it (the
    upstream sees its client leave), unless the rest of the body is already buffered."""

    def __init__(
        self,
        client: Http1Client,
        conn: _Connection,
        origin: _Origin,
        status: int,
        headers: dict[str, str],
        keep_alive: bool,
        length: int | None,
        chunked: bool,
    ) -> None:
        self.status_code = status
        self.headers = headers
        self._client = client
        self._conn: _Connection | None = conn
        self._origin = origin
        self._keep_alive = keep_alive
        self._length = length  # a sized body's bytes still to come
        self._chunked = chunked
        self._chunk = -1  # chunked: bytes of the current chunk still to come (0: its CRLF; -1: a size line)
        self._trailers = False
        self._complete = False
        if status in (204, 304) or length == 0:
            self._complete = True
            self._release()

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body, in the pieces the network delivered (none empty)."""
        timeout = self._client.timeout
        while self._conn is not None:
            conn = self._conn
            data = self._take()
            if self._complete:
                self._release()
                if data:
                    yield data
                return
            if data:
                yield data
            elif conn.eof:
                self._drop()
                if isinstance(conn.error, OSError):
                    raise httpx.ReadError(f"the upstream connection failed mid-body: {conn.error}")
                raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")
            else:
                await conn.fill(timeout)

    async def aread(self) -> bytes:
        return b"".join([piece async for piece in self.aiter_bytes()])

    async def aclose(self) -> None:
        if self._conn is None:
            return
        if not self._complete:
            self._take()  # the rest of the body may be buffered already (a stream read up to its last event)
        if self._complete:
            self._release()
        else:
            self._drop()

    # -- framing -----------------------------------------------------------------------------------------------
    def _take(self) -> bytes:
        """The body bytes the buffer holds (taken out of it); ``_complete`` once the body ended."""
        assert self._conn is not None
        buf = self._conn.buffer
        if self._chunked:
            return self._take_chunks(buf)
        if self._length is None:  # delimited by the close
            data = bytes(buf)
            buf.clear()
            self._complete = self._conn.eof and self._conn.error is None  # a reset is no end
            return data
        n = min(len(buf), self._length)
        data = bytes(buf[:n])
        del buf[:n]
        self._length -= n
        self._complete = self._length == 0
        return data

    def _take_chunks(self, buf: bytearray) -> bytes:
        out: list[bytes] = []
        while buf:
            if self._trailers:
                end = buf.find(b"\r\n")
                if end < 0:
                    self._check_line(buf)
                    break
                del buf[: end + 2]
                if end == 0:  # the empty line after the trailers: the body ended
                    self._complete = True
                    break
            elif self._chunk > 0:
                n = min(len(buf), self._chunk)
                out.append(bytes(buf[:n]))
                del buf[:n]
                self._chunk -= n
            elif self._chunk == 0:
                if len(buf) < 2:
                    break
                if buf[:2] != b"\r\n":
                    raise httpx.RemoteProtocolError("malformed chunked body: no CRLF after a chunk")
                del buf[:2]
                self._chunk = -1
            else:
                end = buf.find(b"\r\n")
                if end < 0:
                    self._check_line(buf)
                    break
                line = bytes(buf[:end]).split(b";", 1)[0].strip()
                try:
                    size = int(line, 16)
                except ValueError:
                    raise httpx.RemoteProtocolError(f"malformed chunk size line: {line[:40]!r}") from None
                if size < 0:
                    raise httpx.RemoteProtocolError(f"malformed chunk size line: {line[:40]!r}")
                del buf[: end + 2]
                if size == 0:
                    self._trailers = True
                else:
                    self._chunk = size
        return b"".join(out)

    @staticmethod
    def _check_line(buf: bytearray) -> None:
        if len(buf) > MAX_CHUNK_LINE:
            raise httpx.RemoteProtocolError("a chunk size or trailer line is too long")

    def _release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            if self._keep_alive:
                self._client._checkin(self._origin, conn)
            else:
                conn.close()

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


class Http1Client:
    """HTTP/1.1 requests over a keep-alive pool; ``timeout``: the most any read or write waits (seconds);
    ``ssl_context``: for https (default: ``ssl.create_default_context()``, made at the first https request)."""

    def __init__(
        self,
        timeout: float,
        connect_timeout: float = CONNECT_TIMEOUT_S,
        max_idle_per_origin: int = 256,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.max_idle_per_origin = max_idle_per_origin
        self._idle: dict[_Origin, list[_Connection]] = {}
        self._targets: dict[str, tuple[_Origin, str, str]] = {}  # url -> origin, request target, Host
        self._ssl = ssl_context
        self.connections_opened = 0  # connections made so far (keep-alive reuse shows as fewer)

    async def post(self, url: str, content: bytes, headers: Mapping[str, str]) -> Http1Response:
        return await self.request("POST", url, content, headers)

    async def request(
        self, method: str, url: str, content: bytes = b"", headers: Mapping[str, str] | None = None
    ) -> Http1Response:
        """Send the request and read its answer's status line and headers (its body: the response's to read)."""
        origin, target, host = self._target(url)
        head = [f"{method} {target} HTTP/1.1\r\n"]
        for name, value in (headers or {}).items():
            if "\r" in name or "\n" in name or "\r" in value or "\n" in value or ":" in name:
                raise httpx.LocalProtocolError(f"header {name!r}: a name or value with CR, LF (or ':' in the name)")
            if name.lower() == "host":
                host = value
                origin = (*origin[:3], _hostname(value) if origin[0] == "https" else "")
            else:
                head.append(f"{name}: {value}\r\n")
        head.append(f"Host: {host}\r\nContent-Length: {len(content)}\r\nAccept-Encoding: identity\r\n\r\n")
        try:
            data = "".join(head).encode("latin-1") + content
        except UnicodeEncodeError as exc:
            raise httpx.LocalProtocolError(f"a header is not latin-1: {exc}") from None
        conn = self._checkout(origin)
        reused = conn is not None
        while True:
            if conn is None:
                conn = await self._connect(origin)
            try:
                await conn.send(data, self.timeout)
                return await self._read_head(conn, origin)
            except _StaleConnectionError:
                conn.close()
                if not reused:
                    raise httpx.RemoteProtocolError("Server disconnected without sending a response.") from None
                conn, reused = None, False  # once more, on a new connection
            except BaseException:
                conn.close()
                raise

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    # -- the pool ----------------------------------------------------------------------------------------------
    def _target(self, url: str) -> tuple[_Origin, str, str]:
        known = self._targets.get(url)
        if known is not None:
            return known
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise httpx.UnsupportedProtocol(f"not an http(s) URL: {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        server_name = parts.hostname if parts.scheme == "https" else ""
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        found = ((parts.scheme, parts.hostname, port, server_name), target, parts.netloc.rpartition("@")[2])
        if len(self._targets) < 4096:  # a gateway's upstream URLs: a few per endpoint
            self._targets[url] = found
        return found

    def _checkout(self, origin: _Origin) -> _Connection | None:
        conns = self._idle.get(origin)
        if not conns:
            return None
        now = time.monotonic()
        while conns:
            conn = conns.pop()  # the newest: the least likely to be closed by the server's keep-alive timeout
            if conn.reusable and now - conn.idle_since < KEEPALIVE_EXPIRY_S:
                return conn
            conn.close()
        return None

    def _checkin(self, origin: _Origin, conn: _Connection) -> None:
        if not conn.reusable:
            conn.close()
            return
        conns = self._idle.setdefault(origin, [])
        now = time.monotonic()
        while conns and now - conns[0].idle_since >= KEEPALIVE_EXPIRY_S:
            conns.pop(0).close()
        if len(conns) >= self.max_idle_per_origin:
            conn.close()
            return
        conn.idle_since = now
        conns.append(conn)

    async def _connect(self, origin: _Origin) -> _Connection:
        scheme, host, port, server_name = origin
        loop = asyncio.get_running_loop()
        context = None
        if scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(loop), host, port, ssl=context, server_hostname=server_name or None
                )
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {host}:{port} took over {self.connect_timeout:g}s") from None
        except (OSError, ssl.SSLError) as exc:
            raise httpx.ConnectError(f"connecting to {host}:{port}: {exc}") from None
        self.connections_opened += 1
        return conn

    async def _read_head(self, conn: _Connection, origin: _Origin) -> Http1Response:
        """The answer's status line and headers (``1xx`` skipped); ``_StaleConnectionError``: the server closed
        first."""
        buf = conn.buffer
        while True:
            end = buf.find(b"\r\n\r\n")
            while end < 0:
                if len(buf) > MAX_HEAD_BYTES:
                    raise httpx.RemoteProtocolError(f"the response head is over {MAX_HEAD_BYTES} bytes")
                if conn.eof:
                    if not conn.received:
                        raise _StaleConnectionError
                    if isinstance(conn.error, OSError):
                        raise httpx.ReadError(f"the upstream connection failed: {conn.error}")
                    raise httpx.RemoteProtocolError("peer closed connection in the middle of the response head")
                await conn.fill(self.timeout)
                end = buf.find(b"\r\n\r\n")
            lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
            del buf[: end + 4]
            status, version = _status_line(lines[0])
            if 100 <= status < 200:
                if status == 101:
                    raise httpx.RemoteProtocolError("the upstream switched protocols (101)")
                continue
            headers: dict[str, str] = {}
            for line in lines[1:]:
                name, colon, value = line.partition(":")
                if not colon or not name or name != name.strip():
                    raise httpx.RemoteProtocolError(f"malformed header line: {line[:80]!r}")
                name, value = name.lower(), value.strip()
                headers[name] = f"{headers[name]}, {value}" if name in headers else value
            return self._response(conn, origin, status, version, headers)

    def _response(
        self, conn: _Connection, origin: _Origin, status: int, version: str, headers: dict[str, str]
    ) -> Http1Response:
        connection = headers.get("connection", "").lower()
        keep_alive = version == "HTTP/1.1" and "close" not in connection
        encoding = headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("identity", ""):
            raise httpx.DecodingError(f"the upstream sent a {encoding} body (the gateway asks for identity)")
        length: int | None = None
        chunked = False
        if "transfer-encoding" in headers:
            chunked = headers["transfer-encoding"].lower().rsplit(",", 1)[-1].strip() == "chunked"
            keep_alive = keep_alive and chunked  # any other coding: the body ends at the close
        elif "content-length" in headers:
            values = {v.strip() for v in headers["content-length"].split(",")}
            if len(values) != 1 or not next(iter(values)).isdigit():
                raise httpx.RemoteProtocolError(f"malformed Content-Length: {headers['content-length'][:40]!r}")
            length = int(values.pop())
        elif status not in (204, 304):
            keep_alive = False  # the body ends at the close
        return Http1Response(self, conn, origin, status, headers, keep_alive, length, chunked)


def _status_line(line: str) -> tuple[int, str]:
    version, _, rest = line.partition(" ")
    code = rest[:3]
    if version not in ("HTTP/1.1", "HTTP/1.0") or len(code) != 3 or not code.isdigit() or rest[3:4] not in ("", " "):
        raise httpx.RemoteProtocolError(f"malformed status line: {line[:80]!r}")
    return int(code), version


def _hostname(host: str) -> str:
    """The name in a ``Host`` value (its port and an IPv6 address's brackets left out)."""
    if host.startswith("["):
        return host[1 : host.find("]")]
    return host.partition(":")[0]

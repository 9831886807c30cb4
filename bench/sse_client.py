"""A lean load-generating client: one persistent HTTP/1.1 connection per simulated client, streamed bodies read
as they arrive (chunked or sized), server-sent events split into lines.

Why not httpx for load: with 64 concurrent streams on a 2-core host, httpx's connection pool made requests wait
for a connection — the first request header went out more than a second after the call for one request in ten
(``http11.send_request_headers.started`` in httpx's trace) — so the benchmark measured the client library, not
the server. A client per connection, as load generators such as ``wrk`` work, has no pool to wait on.

Why a protocol, not streams: on a small host the load generator shares the cores with the server it measures, and
every cycle it spends is taken from the server. ``asyncio.StreamReader`` costs two awaits (two task wake-ups) per
chunk; here the response is parsed in ``data_received`` as bytes arrive, and the request's one await ends when the
response is complete.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit


class ProtocolError(Exception):
    """The server's answer is not the HTTP/1.1 this client reads."""


@dataclass(slots=True)
class StreamResult:
    status: int
    # The body's lines (SSE: ``data: ...`` and blank lines), each with the monotonic time its bytes arrived.
    lines: list[tuple[float, bytes]] = field(default_factory=list)


class _Response:
    """Incremental parser of one HTTP/1.1 response; ``feed`` returns True once the response is complete."""

    def __init__(self) -> None:
        self.result: StreamResult | None = None
        self.close = False  # the server closes the connection after this response
        self._buffer = b""
        self._pending = b""  # the body's last, unterminated line
        self._chunked = False
        self._length: int | None = None  # bytes of a sized body still to come
        self._chunk: int | None = None  # bytes (with CRLF) of the current chunk still to come
        self._until_eof = False

    def feed(self, data: bytes, now: float) -> bool:
        self._buffer += data
        if self.result is None:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                return False
            self._headers(self._buffer[:end])
            self._buffer = self._buffer[end + 4 :]
        if self._chunked:
            return self._chunks(now)
        if self._length is not None:
            take = self._buffer[: self._length]
            self._buffer = self._buffer[self._length :]
            self._length -= len(take)
            self._lines(take, now)
            if self._length == 0:
                self._lines(b"\n", now)
                return True
            return False
        self._lines(self._buffer, now)  # until the connection closes
        self._buffer = b""
        return False

    def eof(self, now: float) -> bool:
        """The connection closed: complete for a body that runs to the end of the connection, else cut short."""
        if self.result is not None and self._until_eof:
            self._lines(b"\n", now)
            return True
        return False

    def _headers(self, head: bytes) -> None:
        status_line, *headers = head.split(b"\r\n")
        parts = status_line.split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise ProtocolError(f"bad status line {status_line[:80]!r}")
        self.result = StreamResult(int(parts[1]))
        for line in headers:
            name, _, value = line.partition(b":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == b"transfer-encoding":
                self._chunked = b"chunked" in value
            elif name == b"content-length":
                self._length = int(value)
            elif name == b"connection":
                self.close = value == b"close"
        if not self._chunked and self._length is None:
            self._until_eof = self.close = True

    def _chunks(self, now: float) -> bool:
        buf, at = self._buffer, 0
        try:
            while True:
                if self._chunk is None:
                    eol = buf.find(b"\r\n", at)
                    if eol < 0:
                        return False
                    size = int(buf[at:eol].split(b";", 1)[0], 16)
                    if size == 0:  # the last chunk: an empty line ends it (no trailers are sent to us)
                        if len(buf) < eol + 4:
                            return False
                        self._lines(b"\n", now)
                        return True
                    self._chunk, at = size + 2, eol + 2
                if len(buf) - at < self._chunk:
                    return False
                self._lines(buf[at : at + self._chunk - 2], now)
                at += self._chunk
                self._chunk = None
        except ValueError:
            raise ProtocolError("bad chunk size in a chunked body") from None
        finally:
            self._buffer = buf[at:]

    def _lines(self, data: bytes, now: float) -> None:
        assert self.result is not None
        *complete, self._pending = (self._pending + data).split(b"\n")
        self.result.lines.extend((now, text) for text in complete)


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.response: _Response | None = None
        self.done: asyncio.Future[_Response] | None = None
        self.closed = False

    def data_received(self, data: bytes) -> None:
        if self.response is None or self.done is None or self.done.done():
            return  # nothing asked: a server speaking out of turn is ignored
        try:
            if self.response.feed(data, time.monotonic()):
                self.done.set_result(self.response)
        except ProtocolError as exc:
            self.done.set_exception(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.done is not None and not self.done.done() and self.response is not None:
            if self.response.eof(time.monotonic()):
                self.done.set_result(self.response)
            else:
                self.done.set_exception(exc or ConnectionResetError("the server closed the connection mid-response"))


class Connection:
    """One keep-alive connection; ``request`` reconnects when the server closed it."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or parts.hostname is None:
            raise ValueError(f"only http://host:port URLs are supported, not {url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self._headers = "".join(f"{k}: {v}\r\n" for k, v in {"Host": f"{self.host}:{self.port}", **headers}.items())
        self._transport: asyncio.Transport | None = None
        self._protocol: _Protocol | None = None
        self.connects = 0

    async def close(self) -> None:
        transport, self._transport, self._protocol = self._transport, None, None
        if transport is not None:
            transport.close()

    async def request(self, path: str, body: dict[str, object]) -> StreamResult:
        """POST ``body`` as JSON and read the whole response, noting when each line arrived."""
        if self._transport is None or self._protocol is None or self._protocol.closed:
            await self.close()
            loop = asyncio.get_running_loop()
            self._transport, self._protocol = await loop.create_connection(_Protocol, self.host, self.port)
            self.connects += 1
        protocol, transport = self._protocol, self._transport
        payload = json.dumps(body).encode()
        head = f"POST {path} HTTP/1.1\r\n{self._headers}Content-Type: application/json\r\n"
        protocol.response = _Response()
        protocol.done = asyncio.get_running_loop().create_future()
        transport.write(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        try:
            response = await protocol.done
        except BaseException:
            await self.close()  # a half-read response leaves the connection unusable
            raise
        finally:
            protocol.response = protocol.done = None
        if response.close:
            await self.close()
        assert response.result is not None
        return response.result

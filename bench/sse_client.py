"""A lean load-generating client: one persistent HTTP/1.1 connection per simulated client, streamed bodies read
as they arrive (chunked or sized), server-sent events split into lines.

Why not httpx for load: with 64 concurrent streams on a 2-core host, httpx's connection pool made requests wait
for a connection — the first request header went out more than a second after the call for one request in ten
(``http11.send_request_headers.started`` in httpx's trace) — so the benchmark measured the client library, not
the server. A client per connection, as load generators such as ``wrk`` work, has no pool to wait on.
"""

from __future__ import annotations

import asyncio
import contextlib
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


class Connection:
    """One keep-alive connection; ``request`` reconnects when the server closed it."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or parts.hostname is None:
            raise ValueError(f"only http://host:port URLs are supported, not {url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self._headers = "".join(f"{k}: {v}\r\n" for k, v in {"Host": f"{self.host}:{self.port}", **headers}.items())
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self.connects = 0

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(OSError):
                await self._writer.wait_closed()
        self._reader = self._writer = None

    async def request(self, path: str, body: dict[str, object]) -> StreamResult:
        """POST ``body`` as JSON and read the whole response, noting when each line arrived."""
        if self._writer is None or self._reader is None or self._reader.at_eof():
            await self.close()
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
            self.connects += 1
        reader, writer = self._reader, self._writer
        payload = json.dumps(body).encode()
        head = f"POST {path} HTTP/1.1\r\n{self._headers}Content-Type: application/json\r\n"
        writer.write(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        try:
            await writer.drain()
            return await self._response(reader)
        except BaseException:
            await self.close()  # a half-read response leaves the connection unusable
            raise

    async def _response(self, reader: asyncio.StreamReader) -> StreamResult:
        status_line = await reader.readline()
        parts = status_line.split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise ProtocolError(f"bad status line {status_line[:80]!r}")
        result = StreamResult(int(parts[1]))
        chunked, length, close = False, None, False
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.partition(b":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == b"transfer-encoding":
                chunked = b"chunked" in value
            elif name == b"content-length":
                length = int(value)
            elif name == b"connection":
                close = value == b"close"
        pending = b""

        def feed(data: bytes) -> None:
            nonlocal pending
            pending += data
            *complete, pending = pending.split(b"\n")
            now = time.monotonic()
            result.lines.extend((now, text) for text in complete)

        if chunked:
            while True:
                size_line = await reader.readline()
                if not size_line:
                    raise ProtocolError("connection closed inside a chunked body")
                size = int(size_line.split(b";", 1)[0], 16)
                if size == 0:
                    while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    break
                feed((await reader.readexactly(size + 2))[:-2])
        elif length is not None:
            feed(await reader.readexactly(length))
        else:
            feed(await reader.read())
            close = True
        if pending:
            feed(b"\n")
        if close:
            await self.close()
        return result

"""A pipelined Redis client for the rate limiter's two scripts (``EVALSHA``), one connection per event loop.

redis-py's asyncio client took the largest share of the rate limits' cost per request (its pool's lock, a
connection per concurrent call, a stream reader, command objects): ~65 to 125 µs of CPU per script call here. The
hot path only runs two Lua scripts whose answers are integers, so this client does only that:

- **One connection per event loop**, commands **pipelined** on it (Redis answers in order): a call writes its
  command and waits for its answer; the answers of concurrent calls arrive together in one read. A call
  cancelled while waiting leaves its answer to be read and dropped, so the order never slips.
- ``EVALSHA`` first; on ``NOSCRIPT`` (a restarted or flushed Redis) the call is sent again as ``EVAL``, which
  also loads the script.
- ``redis://[[user]:password@]host[:port][/db]`` URLs (``AUTH``, ``SELECT`` and ``CLIENT SETNAME`` on
  connecting); anything else (TLS, unix sockets, sentinel, cluster) keeps redis-py (``supports``).
- Errors are redis-py's: ``ConnectionError`` when the connection cannot be made or is lost (every waiting
  call gets it; the next call connects again), ``ResponseError`` for an error answer, ``TimeoutError`` when
  connecting takes more than ``CONNECT_TIMEOUT_S`` or an answer more than ``ANSWER_TIMEOUT_S`` (the connection is
  then dropped: answers after it could no longer be matched to their calls).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import deque
from typing import Any, cast
from urllib.parse import unquote, urlsplit

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

CONNECT_TIMEOUT_S = 2.0
ANSWER_TIMEOUT_S = 10.0
MAX_LINE = 64 << 10


def supports(url: str) -> bool:
    """Whether ``url`` is one this client speaks (plain TCP ``redis://``)."""
    return urlsplit(url).scheme == "redis"


def _command(*parts: bytes | str | int) -> bytes:
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        data = part if isinstance(part, bytes) else str(part).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


class _IncompleteError(Exception):
    """The buffer does not yet hold a whole answer."""


def _parse(buf: bytearray, pos: int) -> tuple[Any, int]:
    """One RESP2 answer at ``pos``: (value, position after it); an error answer is a ``ResponseError`` value."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        if len(buf) - pos > MAX_LINE:
            raise RedisConnectionError("Redis sent a line longer than 64 KiB")
        raise _IncompleteError
    kind, line = buf[pos : pos + 1], bytes(buf[pos + 1 : end])
    after = end + 2
    if kind == b":":
        return int(line), after
    if kind == b"+":
        return line.decode(), after
    if kind == b"-":
        return ResponseError(line.decode(errors="replace")), after
    if kind == b"$":
        size = int(line)
        if size < 0:
            return None, after
        if len(buf) < after + size + 2:
            raise _IncompleteError
        return bytes(buf[after : after + size]), after + size + 2
    if kind == b"*":
        count = int(line)
        if count < 0:
            return None, after
        items = []
        for _ in range(count):
            item, after = _parse(buf, after)
            items.append(item)
        return items, after
    raise RedisConnectionError(f"Redis sent an answer of unknown type {bytes(kind)!r}")


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiting: deque[asyncio.Future[Any]] = deque()
        self.buffer = bytearray()
        self.lost: Exception | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        buf = self.buffer
        buf += data
        pos = 0
        try:
            while pos < len(buf):
                value, pos = _parse(buf, pos)
                if not self.waiting:
                    raise RedisConnectionError("Redis sent an answer nobody asked for")
                waiter = self.waiting.popleft()
                if not waiter.done():  # a cancelled call's answer is read and dropped
                    waiter.set_result(value)
        except _IncompleteError:
            pass
        except (RedisConnectionError, ValueError) as exc:
            self.fail(exc if isinstance(exc, RedisConnectionError) else RedisConnectionError(str(exc)))
            return
        del buf[:pos]

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(RedisConnectionError(f"the connection to Redis was lost: {exc or 'closed by the server'}"))

    def fail(self, exc: Exception) -> None:
        if self.lost is None:
            self.lost = exc
        while self.waiting:
            waiter = self.waiting.popleft()
            if not waiter.done():
                waiter.set_exception(self.lost)
        if self.transport is not None:
            self.transport.abort()

    def send(self, command: bytes) -> asyncio.Future[Any]:
        if self.lost is not None or self.transport is None:
            raise self.lost or RedisConnectionError("not connected to Redis")
        waiter: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.waiting.append(waiter)
        self.transport.write(command)
        return waiter


class PipelinedScripts:
    """``EVALSHA`` of registered Lua scripts on one pipelined connection per event loop."""

    def __init__(self, url: str, name: str = "tierline-limits") -> None:
        parts = urlsplit(url)
        self.name = name  # CLIENT SETNAME: how the connection shows in CLIENT LIST
        if parts.scheme != "redis":
            raise ValueError(f"PipelinedScripts speaks redis:// only, not {parts.scheme}://")
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 6379
        path = parts.path.strip("/")
        self.db = int(path) if path else 0
        self.username = unquote(parts.username) if parts.username else None
        self.password = unquote(parts.password) if parts.password is not None else None
        self._connections: dict[asyncio.AbstractEventLoop, _Connection] = {}
        self._connecting: dict[asyncio.AbstractEventLoop, asyncio.Future[_Connection]] = {}
        self._shas: dict[str, str] = {}  # script -> its SHA-1, the name EVALSHA takes

    @staticmethod
    def sha(script: str) -> str:
        return hashlib.sha1(script.encode(), usedforsecurity=False).hexdigest()  # Redis names scripts by SHA-1

    async def _connection(self) -> _Connection:
        loop = asyncio.get_running_loop()
        conn = self._connections.get(loop)
        if conn is not None and conn.lost is None:
            return conn
        pending = self._connecting.get(loop)
        if pending is None:  # one connect per loop at a time; concurrent callers wait for it
            pending = self._connecting[loop] = asyncio.ensure_future(self._connect(loop))
            pending.add_done_callback(lambda _: self._connecting.pop(loop, None))
        return await asyncio.shield(pending)

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> _Connection:
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                _, conn = await loop.create_connection(_Connection, self.host, self.port)
                greetings = []
                if self.password is not None:
                    auth = (self.username, self.password) if self.username else (self.password,)
                    greetings.append(conn.send(_command("AUTH", *auth)))
                if self.db:
                    greetings.append(conn.send(_command("SELECT", self.db)))
                # The name is a courtesy: a user whose ACL refuses CLIENT still connects (its answer is not checked).
                named = conn.send(_command("CLIENT", "SETNAME", self.name))
                answers = await asyncio.gather(*greetings, named)
                for answer in answers[:-1]:
                    if isinstance(answer, ResponseError):
                        conn.fail(RedisConnectionError(f"Redis refused the connection's set-up: {answer}"))
                        raise answer
        except TimeoutError:
            raise RedisTimeoutError(f"connecting to Redis at {self.host}:{self.port} timed out") from None
        except OSError as exc:
            raise RedisConnectionError(f"cannot connect to Redis at {self.host}:{self.port}: {exc}") from None
        old = self._connections.get(loop)
        if old is not None and old.transport is not None:
            old.transport.abort()
        for gone in [other for other in self._connections if other.is_closed()]:  # loops closed since
            del self._connections[gone]
        self._connections[loop] = conn
        return conn

    async def _ask(self, command: bytes) -> Any:
        conn = await self._connection()
        waiter = conn.send(command)
        try:
            async with asyncio.timeout(ANSWER_TIMEOUT_S):
                answer = await waiter
        except TimeoutError:
            conn.fail(RedisTimeoutError(f"Redis did not answer within {ANSWER_TIMEOUT_S:.0f} s"))
            raise RedisTimeoutError(f"Redis did not answer within {ANSWER_TIMEOUT_S:.0f} s") from None
        if isinstance(answer, ResponseError):
            raise answer
        return answer

    async def run(self, script: str, keys: list[str], args: list[int]) -> Any:
        """The script's answer (``EVALSHA``, then ``EVAL`` when Redis does not hold it)."""
        sha = self._shas.get(script)
        if sha is None:
            sha = self._shas[script] = self.sha(script)
        try:
            return await self._ask(_command("EVALSHA", sha, len(keys), *keys, *args))
        except ResponseError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
        return await self._ask(_command("EVAL", script, len(keys), *keys, *args))

    async def close(self) -> None:
        """Close the connection of the running loop (others close with their loops)."""
        conn = self._connections.pop(asyncio.get_running_loop(), None)
        if conn is not None and conn.transport is not None:
            conn.transport.close()

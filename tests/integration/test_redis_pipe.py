"""The rate limiter's pipelined Redis client (``cloud.gateway.redis_pipe``) against a real Redis on 127.0.0.1:6379."""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import Iterator
from typing import Any, cast

import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from cloud.gateway.redis_pipe import PipelinedScripts, supports

REDIS_URL = "redis://127.0.0.1:6379/0"


def _redis_up() -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", 6379)) == 0


pytestmark = pytest.mark.skipif(not _redis_up(), reason="Redis not reachable on 127.0.0.1:6379")

ECHO = "return tonumber(ARGV[1]) * 10 + #KEYS"


def _connection_ids(admin: redis.Redis, name: str) -> list[int]:
    """The ids of the connections named ``name`` (CLIENT SETNAME)."""
    clients = cast(list[dict[str, Any]], admin.client_list())
    return [int(c["id"]) for c in clients if c["name"] == name]


@pytest.fixture
def admin() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL)
    yield client
    client.close()


def _unique_script(body: str) -> str:
    """A script Redis has never seen (a fresh comment gives it a fresh SHA-1)."""
    return f"-- {uuid.uuid4().hex}\n{body}"


def test_only_plain_tcp_urls_are_taken() -> None:
    assert supports("redis://127.0.0.1:6379/0")
    assert not supports("rediss://127.0.0.1:6380/0")
    assert not supports("unix:///run/redis.sock")
    with pytest.raises(ValueError, match="redis:// only"):
        PipelinedScripts("rediss://127.0.0.1:6380/0")


def test_concurrent_calls_each_get_their_own_answer_on_one_connection(admin: redis.Redis) -> None:
    name = f"tl-test-{uuid.uuid4().hex[:8]}"
    pipe = PipelinedScripts(REDIS_URL, name=name)

    async def main() -> list[int]:
        answers = await asyncio.gather(*(pipe.run(ECHO, ["a", "b"][: i % 3], [i]) for i in range(300)))
        connections = _connection_ids(admin, name)
        await pipe.close()
        assert len(connections) == 1, "every call shares one connection"
        return answers

    assert asyncio.run(main()) == [i * 10 + len(["a", "b"][: i % 3]) for i in range(300)]


def test_an_unknown_script_is_loaded_and_then_run_by_its_sha(admin: redis.Redis) -> None:
    script = _unique_script("return redis.call('incrby', KEYS[1], ARGV[1])")
    pipe = PipelinedScripts(REDIS_URL)
    key = f"tl-test/{uuid.uuid4().hex}"
    assert admin.script_exists(pipe.sha(script)) == [False]

    async def main() -> tuple[int, int]:
        first = await pipe.run(script, [key], [5])  # NOSCRIPT, then EVAL
        second = await pipe.run(script, [key], [2])
        await pipe.close()
        return first, second

    assert asyncio.run(main()) == (5, 7)
    assert admin.script_exists(pipe.sha(script)) == [True]
    admin.delete(key)


def test_an_error_answer_is_raised_and_the_calls_after_it_keep_their_order() -> None:
    failing = "return redis.error_reply('over the moon')"
    pipe = PipelinedScripts(REDIS_URL)

    async def main() -> list[object]:
        calls = [
            pipe.run(ECHO, [], [1]),
            pipe.run(failing, [], []),
            pipe.run(ECHO, [], [3]),
        ]
        out = await asyncio.gather(*calls, return_exceptions=True)
        await pipe.close()
        return out

    first, error, third = asyncio.run(main())
    assert first == 10 and third == 30
    assert isinstance(error, ResponseError) and "over the moon" in str(error)


def test_a_cancelled_call_does_not_shift_the_answers_of_later_calls() -> None:
    slow = _unique_script(
        "local t = redis.call('time'); local start = t[1] * 1000000 + t[2]\n"
        "repeat t = redis.call('time') until t[1] * 1000000 + t[2] - start > 50000\n"
        "return 999"
    )
    pipe = PipelinedScripts(REDIS_URL)

    async def main() -> int:
        await pipe.run(slow, [], [])  # loaded, so the next run is one EVALSHA
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(pipe.run(slow, [], []), 0.01)
        answer = await pipe.run(ECHO, [], [4])
        await pipe.close()
        return int(answer)

    assert asyncio.run(main()) == 40


def test_a_killed_connection_is_replaced_by_the_next_call(admin: redis.Redis) -> None:
    name = f"tl-test-{uuid.uuid4().hex[:8]}"
    pipe = PipelinedScripts(REDIS_URL, name=name)

    async def main() -> int:
        await pipe.run(ECHO, [], [1])
        (conn_id,) = _connection_ids(admin, name)
        admin.client_kill_filter(_id=str(conn_id))
        await asyncio.sleep(0.05)  # the close reaches the client
        answer = await pipe.run(ECHO, [], [6])
        (new_id,) = _connection_ids(admin, name)
        assert new_id != conn_id
        await pipe.close()
        return int(answer)

    assert asyncio.run(main()) == 60


def test_calls_waiting_on_a_connection_that_drops_fail_with_a_connection_error() -> None:
    """A peer that takes the commands and hangs up before answering (Redis cannot be made to, so a socket
    stands in for it): every waiting call fails, none waits forever."""

    async def main() -> list[BaseException | object]:
        async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"tierline-limits\r\n")  # AUTH/SELECT/SETNAME: answer the greeting
            writer.write(b"+OK\r\n")
            await reader.readuntil(b"EVALSHA")
            writer.close()

        server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pipe = PipelinedScripts(f"redis://127.0.0.1:{port}/0")
        out = await asyncio.gather(*(pipe.run(ECHO, [], [i]) for i in range(3)), return_exceptions=True)
        server.close()
        return out

    for outcome in asyncio.run(main()):
        assert isinstance(outcome, RedisConnectionError) and "lost" in str(outcome)


def test_the_url_selects_the_database(admin: redis.Redis) -> None:
    script = "return redis.call('set', KEYS[1], ARGV[1]) and 1"
    key = f"tl-test/{uuid.uuid4().hex}"
    pipe = PipelinedScripts("redis://127.0.0.1:6379/5")

    async def main() -> None:
        await pipe.run(script, [key], [42])
        await pipe.close()

    asyncio.run(main())
    db5 = redis.Redis.from_url("redis://127.0.0.1:6379/5")
    try:
        assert db5.get(key) == b"42" and admin.get(key) is None
    finally:
        db5.delete(key)
        db5.close()


def test_the_url_credentials_authenticate_and_wrong_ones_are_refused(admin: redis.Redis) -> None:
    user, password = f"tl-test-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    admin.acl_setuser(user, enabled=True, passwords=[f"+{password}"], keys=["*"], commands=["+@all"])
    try:

        async def run(url: str) -> int:
            pipe = PipelinedScripts(url)
            try:
                return int(await pipe.run(ECHO, [], [7]))
            finally:
                await pipe.close()

        assert asyncio.run(run(f"redis://{user}:{password}@127.0.0.1:6379/0")) == 70
        # A user allowed only the scripts (no CLIENT, no SELECT beyond its database) is served too.
        admin.acl_setuser(
            user, reset=True, enabled=True, passwords=[f"+{password}"], keys=["*"], commands=["+evalsha", "+eval"]
        )
        assert asyncio.run(run(f"redis://{user}:{password}@127.0.0.1:6379/0")) == 70
        with pytest.raises(ResponseError, match=r"WRONGPASS|invalid"):
            asyncio.run(run(f"redis://{user}:not-{password}@127.0.0.1:6379/0"))
    finally:
        admin.acl_deluser(user)


def test_an_unreachable_redis_is_a_connection_error_that_names_it() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pipe = PipelinedScripts(f"redis://127.0.0.1:{port}/0")
    with pytest.raises(RedisConnectionError, match=f"127.0.0.1:{port}"):
        asyncio.run(pipe.run(ECHO, [], [1]))

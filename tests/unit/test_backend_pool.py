"""The replica pool's choices and the backends file's checks, without any server: least outstanding requests,
the breaker, the concurrency bound, and a key file others can read."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from cloud.serving.backends.config import load_backends
from cloud.serving.backends.pool import Endpoint, PoolCollector, ReplicaPool, UpstreamUnavailableError
from shared.errors import ConfigurationError


def _pool(*bounds: int, eject_after: int = 2, queue_timeout_s: float = 0.2) -> ReplicaPool:
    return ReplicaPool(
        "m",
        [Endpoint(f"http://e{i}", b) for i, b in enumerate(bounds)],
        eject_after_failures=eject_after,
        queue_timeout_s=queue_timeout_s,
    )


def test_requests_go_to_the_endpoint_with_fewest_outstanding() -> None:
    async def run() -> list[str]:
        pool = _pool(8, 8)
        a = await pool.acquire()
        b = await pool.acquire()
        c = await pool.acquire()  # both have one: the one used longest ago
        pool.release(b, True)
        d = await pool.acquire()  # b has none now
        return [a.root, b.root, c.root, d.root]

    assert asyncio.run(run()) == ["http://e0", "http://e1", "http://e0", "http://e1"]


def test_consecutive_failures_eject_and_a_success_resets_the_count() -> None:
    async def run() -> None:
        pool = _pool(8, 8, eject_after=2)
        e0 = pool.endpoints[0]
        pool.release(await pool.acquire(), False)  # e0 fails once
        pool.release(await pool.acquire(exclude={"http://e1"}), True)  # then succeeds: count reset
        assert e0.admitted and e0.consecutive_failures == 0
        for _ in range(2):
            pool.release(await pool.acquire(exclude={"http://e1"}), False)
        assert not e0.admitted and e0.ejections == 1
        assert [(await pool.acquire()).root for _ in range(3)] == ["http://e1"] * 3
        with pytest.raises(UpstreamUnavailableError) as err:
            await pool.acquire(exclude={"http://e1"})
        assert err.value.retry_after >= 1

    asyncio.run(run())


def test_a_full_endpoint_makes_requests_wait_for_a_slot_then_503() -> None:
    async def run() -> None:
        pool = _pool(1, queue_timeout_s=0.2)
        held = await pool.acquire()
        waiter = asyncio.create_task(pool.acquire())
        await asyncio.sleep(0.05)
        assert not waiter.done()
        pool.release(held, True)
        assert (await asyncio.wait_for(waiter, 1)).root == "http://e0"
        with pytest.raises(UpstreamUnavailableError, match="concurrency bound"):
            await pool.acquire()

    asyncio.run(run())


def test_requests_waiting_for_a_slot_are_the_gateways_queue_depth_on_metrics() -> None:
    def waiting(pool: ReplicaPool) -> float:
        family = next(f for f in PoolCollector([pool]).collect() if f.name == "tierline_backend_waiting_requests")
        [sample] = family.samples
        assert sample.labels == {"model": "m"}
        return sample.value

    async def run() -> list[float]:
        pool = _pool(1, queue_timeout_s=5)
        held = await pool.acquire()
        seen = [waiting(pool)]
        pending = {asyncio.create_task(pool.acquire()) for _ in range(3)}
        await asyncio.sleep(0.05)
        seen.append(waiting(pool))
        for _ in range(3):
            pool.release(held, True)  # one waiter gets the slot; the others wait on
            done, pending = await asyncio.wait(pending, timeout=5, return_when=asyncio.FIRST_COMPLETED)
            held = done.pop().result()
            await asyncio.sleep(0.01)
            seen.append(waiting(pool))
        return seen

    assert asyncio.run(run()) == [0, 3, 2, 1, 0]


def _spec(tmp_path: Path, **fields: object) -> Path:
    model = {"type": "openai", "endpoints": ["http://127.0.0.1:9"], "upstream_model": "x", "tokenizer": str(tmp_path)}
    path = tmp_path / "backends.json"
    path.write_text(json.dumps({"models": {"m": {**model, **fields}}}))
    return path


def test_a_field_the_file_does_not_know_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"models\.m\.max_concurrancy"):
        load_backends(_spec(tmp_path, max_concurrancy=4))


def test_an_upstream_key_file_others_can_read_is_refused(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("sk-1\n")
    key.chmod(0o644)
    spec = load_backends(_spec(tmp_path, api_key_file=str(key))).models["m"]
    with pytest.raises(ConfigurationError, match="chmod 600"):
        spec.api_key()
    key.chmod(0o600)
    assert spec.api_key() == "sk-1"


def test_an_unset_key_variable_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TL_TEST_UPSTREAM_KEY", raising=False)
    spec = load_backends(_spec(tmp_path, api_key_env="TL_TEST_UPSTREAM_KEY")).models["m"]
    with pytest.raises(ConfigurationError, match="TL_TEST_UPSTREAM_KEY"):
        spec.api_key()
    monkeypatch.setenv("TL_TEST_UPSTREAM_KEY", "sk-2")
    assert spec.api_key() == "sk-2"


def test_a_prefix_key_keeps_its_endpoint_until_it_is_over_its_bounded_load() -> None:
    async def run() -> None:
        pool = _pool(8, 8, 8)
        firsts = set()
        for _ in range(5):  # idle pool: the same key always lands on the same endpoint
            e = await pool.acquire(key="tenant-1\x00shared prefix")
            firsts.add(e.root)
            pool.release(e, True)
        assert len(firsts) == 1 and sum(e.affinity_hits for e in pool.endpoints) == 5
        spread = set()
        for i in range(30):  # other prefixes spread over the endpoints
            e = await pool.acquire(key=f"tenant-1\x00prefix {i}")
            spread.add(e.root)
            pool.release(e, True)
        assert len(spread) == 3
        # held requests: the preferred one takes them while within 1.25 x the mean load, then others do
        held = [await pool.acquire(key="tenant-1\x00shared prefix") for _ in range(6)]
        preferred = firsts.pop()
        on_preferred = sum(e.root == preferred for e in held)
        assert 2 <= on_preferred < 6 and pool.affinity_misses == 6 - on_preferred
        assert max(e.outstanding for e in pool.endpoints) <= 3  # ceil(1.25 * 6 / 3) = 3

    asyncio.run(run())


def test_a_removed_endpoint_drains_its_requests_then_leaves() -> None:
    async def run() -> None:
        pool = _pool(8, 8)
        busy = await pool.acquire()  # on e0
        pool.set_endpoints([("http://e1", None), ("http://e2", None)], 8)
        assert [(e.root, e.draining) for e in pool.endpoints] == [
            ("http://e0", True),
            ("http://e1", False),
            ("http://e2", False),
        ]
        taken = [await pool.acquire() for _ in range(4)]
        assert {e.root for e in taken} == {"http://e1", "http://e2"}  # none on the draining one
        pool.release(busy, True)  # its last request ended: it leaves
        assert [e.root for e in pool.endpoints] == ["http://e1", "http://e2"]
        pool.set_endpoints([("http://e1", None)], 8)  # e2 has two in flight: it stays until they end
        assert [(e.root, e.draining) for e in pool.endpoints] == [("http://e1", False), ("http://e2", True)]
        pool.set_endpoints([("http://e1", None), ("http://e2", None)], 8)  # back before it left
        assert not any(e.draining for e in pool.endpoints)
        pool.drain_all()
        for e in taken:
            pool.release(e, True)
        assert pool.drained

    asyncio.run(run())


def test_host_names_are_resolved_again_at_each_round() -> None:
    async def run() -> None:
        pool = ReplicaPool("m", [], resolve_dns=True, sources=["http://localhost:8001"], endpoint_concurrency=4)
        await pool.resolve()
        assert [(e.root, e.host, e.max_concurrency) for e in pool.endpoints] == [
            ("http://127.0.0.1:8001", "localhost:8001", 4)
        ]
        pool.sources = ["http://localhost:8002", "http://127.0.0.1:8003", "http://[::1]:8004"]  # a new spec
        await pool.resolve()
        assert [(e.root, e.host) for e in pool.endpoints] == [
            ("http://127.0.0.1:8002", "localhost:8002"),
            ("http://127.0.0.1:8003", None),
            ("http://[::1]:8004", None),
        ]
        pool.sources = ["http://no-such-host.invalid:8000"]  # resolves to nothing: the last addresses stay
        await pool.resolve()
        assert len(pool.endpoints) == 3

    asyncio.run(run())

"""Rate limits (requests/min, tokens/min, in-flight) in memory and on a real Redis shared by two limiters."""

from __future__ import annotations

import asyncio
import socket
import uuid

import pytest

from cloud.gateway.limits import RateLimiter
from cloud.settings import CloudSettings
from controlplane.storage.tables import ApiKey, Tenant
from shared.errors import RateLimitError

REDIS_URL = "redis://127.0.0.1:6379/0"


def _redis_up() -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", 6379)) == 0


BACKENDS = [
    pytest.param(None, id="memory"),
    pytest.param(
        REDIS_URL,
        id="redis",
        marks=pytest.mark.skipif(not _redis_up(), reason="Redis not reachable on 127.0.0.1:6379"),
    ),
]


def tenant(max_concurrent: int | None = None) -> Tenant:
    # A fresh id per test keeps Redis counters of earlier runs out of the way.
    return Tenant(id=uuid.uuid4().int % 10**9, name="t", max_concurrent=max_concurrent)


@pytest.mark.parametrize("redis_url", BACKENDS)
def test_requests_per_minute_are_shared_by_replicas(redis_url: str | None) -> None:
    async def main() -> None:
        settings = CloudSettings(tenant_requests_per_minute=3)
        a = RateLimiter(settings, redis_url)
        b = RateLimiter(settings, redis_url) if redis_url else a  # two replicas on one Redis
        t = tenant()
        await a.acquire(t, None, 1)
        await b.acquire(t, None, 1)
        await a.acquire(t, None, 1)
        with pytest.raises(RateLimitError, match="request rate limit of 3/min") as exc:
            await b.acquire(t, None, 1)
        assert exc.value.status_code == 429 and 1 <= exc.value.retry_after <= 60
        other = tenant()
        await a.acquire(other, None, 1)  # another tenant is not affected
        await a.close()
        await b.close()

    asyncio.run(main())


@pytest.mark.parametrize("redis_url", BACKENDS)
def test_tokens_are_reserved_up_front_and_the_unused_part_given_back(redis_url: str | None) -> None:
    async def main() -> None:
        limiter = RateLimiter(CloudSettings(tenant_tokens_per_minute=1000), redis_url)
        t = tenant()
        first = await limiter.acquire(t, None, 600)
        with pytest.raises(RateLimitError, match="token rate limit"):
            await limiter.acquire(t, None, 600)
        await limiter.release(first, used_tokens=100)  # 500 of the 600 come back
        await limiter.acquire(t, None, 800)
        with pytest.raises(RateLimitError, match="lower max_tokens"):
            await limiter.acquire(t, None, 1001)  # could never fit the limit
        await limiter.close()

    asyncio.run(main())


@pytest.mark.parametrize("redis_url", BACKENDS)
def test_concurrency_cap_and_per_key_overrides(redis_url: str | None) -> None:
    async def main() -> None:
        limiter = RateLimiter(CloudSettings(key_max_concurrent=5), redis_url)
        t = tenant(max_concurrent=10)
        key = ApiKey(id=uuid.uuid4().int % 10**9, tenant_id=t.id or 0, prefix="tl-x", key_hash="h", max_concurrent=2)
        held = [await limiter.acquire(t, key, 1), await limiter.acquire(t, key, 1)]
        with pytest.raises(RateLimitError, match="key limit of 2 concurrent"):
            await limiter.acquire(t, key, 1)
        await limiter.release(held.pop(), used_tokens=1)
        held.append(await limiter.acquire(t, key, 1))
        for r in held:
            await limiter.release(r, used_tokens=1)
        await limiter.close()

    asyncio.run(main())


@pytest.mark.parametrize("redis_url", BACKENDS)
def test_a_refused_request_counts_against_no_scope(redis_url: str | None) -> None:
    """A key over its requests/min gives back what the tenant's counters took for that request: the tenant's
    other keys still get the tenant's whole limit."""

    async def main() -> None:
        limiter = RateLimiter(CloudSettings(tenant_requests_per_minute=4, key_requests_per_minute=1), redis_url)
        t = tenant(max_concurrent=10)

        def key() -> ApiKey:
            return ApiKey(id=uuid.uuid4().int % 10**9, tenant_id=t.id or 0, prefix="tl-x", key_hash="h")

        busy = key()
        await limiter.acquire(t, busy, 1)
        for _ in range(3):  # refused by the key's limit: the tenant's count, the slot and the tokens go back
            with pytest.raises(RateLimitError, match="key request rate limit of 1/min"):
                await limiter.acquire(t, busy, 1)
        for _ in range(3):
            await limiter.acquire(t, key(), 1)  # the tenant's 2nd to 4th request
        with pytest.raises(RateLimitError, match="tenant request rate limit of 4/min"):
            await limiter.acquire(t, key(), 1)
        await limiter.close()

    asyncio.run(main())


@pytest.mark.parametrize("redis_url", BACKENDS)
def test_shadow_inputs_are_bounded_per_device_across_replicas(redis_url: str | None) -> None:
    """The quality monitor's bound on a device's shadow inputs: counted in the limiter's storage, so two gateways
    on one Redis hold a device to one bound; a refused batch counts nothing."""
    from cloud.edge.quality_monitor import ShadowIntake

    async def main() -> None:
        settings = CloudSettings()
        a, b = RateLimiter(settings, redis_url), RateLimiter(settings, redis_url)
        if redis_url is None:
            b = a  # one process: its memory is the storage
        one = ShadowIntake(db=None, prices=None, limiter=a, rows_per_minute=100)  # type: ignore[arg-type]
        two = ShadowIntake(db=None, prices=None, limiter=b, rows_per_minute=100)  # type: ignore[arg-type]
        device, other = f"dev-{uuid.uuid4().hex}", f"dev-{uuid.uuid4().hex}"
        await one.take(device, 60)
        with pytest.raises(RateLimitError, match="shadow-inputs: at most 100 per minute") as exc:
            await two.take(device, 60)
        assert exc.value.status_code == 429
        await two.take(other, 60)  # per device
        await two.take(device, 40)  # the refused batch took nothing: 60 + 40 fit
        with pytest.raises(RateLimitError):
            await one.take(device, 1)
        await a.close()
        if b is not a:
            await b.close()

    asyncio.run(main())

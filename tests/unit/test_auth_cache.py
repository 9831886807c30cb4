"""The cloud's cache of verified API keys: bounded staleness, expiry honoured on every hit, bounded size."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta

import pytest

from cloud.gateway.auth_cache import AuthCache
from controlplane.storage.tables import ApiKey, Tenant
from shared.errors import AuthenticationError


def _pair(expires_at: datetime | None = None) -> tuple[Tenant, ApiKey]:
    return Tenant(id=1, name="acme"), ApiKey(id=2, tenant_id=1, key_hash="h", prefix="tl-x", expires_at=expires_at)


def test_a_hit_within_the_ttl_then_a_miss_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    cache = AuthCache(ttl_s=1.0)
    tenant, key = _pair()
    assert cache.get("d") is None
    cache.put("d", tenant, key)
    clock[0] += 0.9
    assert cache.get("d") == (tenant, key)
    clock[0] += 0.2  # revoked elsewhere in the meantime: the next request reads the database again
    assert cache.get("d") is None


def test_an_expired_key_is_not_served_from_the_cache() -> None:
    cache = AuthCache(ttl_s=60.0)
    tenant, key = _pair(expires_at=datetime.now(UTC) + timedelta(milliseconds=50))
    cache.put("d", tenant, key)
    assert cache.get("d") is not None
    time.sleep(0.06)
    assert cache.get("d") is None


def test_ttl_zero_disables_the_cache_and_size_is_bounded() -> None:
    off = AuthCache(ttl_s=0.0)
    off.put("d", *_pair())
    assert off.get("d") is None
    small = AuthCache(ttl_s=60.0, max_entries=4)
    for i in range(10):
        small.put(f"d{i}", *_pair())
    assert len(small._entries) <= 4 and small.get("d9") is not None


def test_misses_for_one_key_share_one_lookup_and_its_error() -> None:
    """A burst of requests arriving as an entry expires reads the database once, not once per request."""

    async def main() -> None:
        cache = AuthCache(ttl_s=60.0)
        calls = []

        async def lookup() -> tuple[Tenant, ApiKey | None]:
            calls.append(1)
            await asyncio.sleep(0.05)
            return _pair()

        answers = await asyncio.gather(*(cache.load("d", lookup) for _ in range(20)))
        assert len(calls) == 1 and all(a == answers[0] for a in answers)
        assert cache.get("d") == answers[0]  # and it is cached for the next requests

        async def refused() -> tuple[Tenant, ApiKey | None]:
            calls.append(1)
            await asyncio.sleep(0.01)
            raise AuthenticationError("invalid API key")

        results = await asyncio.gather(*(cache.load("bad", refused) for _ in range(5)), return_exceptions=True)
        assert len(calls) == 2 and all(isinstance(r, AuthenticationError) for r in results)
        assert cache.get("bad") is None
        with pytest.raises(AuthenticationError):  # an error is not remembered: the next request asks again
            await cache.load("bad", refused)
        assert len(calls) == 3

    asyncio.run(main())

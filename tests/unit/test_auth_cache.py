"""The cloud's cache of verified API keys: bounded staleness, expiry honoured on every hit, bounded size."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest

from cloud.auth_cache import AuthCache
from shared.storage.models import ApiKey, Tenant


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

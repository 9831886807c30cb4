"""API keys verified recently, so that a request needs no database read to authenticate."""

from __future__ import annotations

import time
from datetime import UTC, datetime

from shared.storage.models import ApiKey, Tenant
from shared.tenancy import aware


class AuthCache:
    """Verified API keys, by the sha256 of the secret (what the database stores), for ``ttl_s``.

    Authenticating every request with a database read cost more than a third of a core at 300 requests/s on the
    benchmark host; a hit costs a dict lookup. The price is bounded staleness: a key revoked, a tenant disabled or
    a limit changed elsewhere (CLI, console) takes effect within ``ttl_s``. Expiry dates are checked on every hit;
    unknown secrets are never cached. ``ttl_s = 0`` reads the database on every request.
    """

    def __init__(self, ttl_s: float, max_entries: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: dict[str, tuple[float, Tenant, ApiKey]] = {}

    def get(self, digest: str) -> tuple[Tenant, ApiKey] | None:
        entry = self._entries.get(digest)
        if entry is None:
            return None
        at, tenant, key = entry
        if time.monotonic() - at >= self.ttl_s or (
            key.expires_at is not None and aware(key.expires_at) <= datetime.now(UTC)
        ):
            self._entries.pop(digest, None)
            return None
        return tenant, key

    def put(self, digest: str, tenant: Tenant, key: ApiKey) -> None:
        if self.ttl_s <= 0:
            return
        if len(self._entries) >= self.max_entries:  # drop the oldest half rather than grow without bound
            for old in sorted(self._entries, key=lambda d: self._entries[d][0])[: self.max_entries // 2]:
                del self._entries[old]
        self._entries[digest] = (time.monotonic(), tenant, key)

"""API keys verified recently, so that a request needs no database read to authenticate."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

from controlplane.storage.tables import ApiKey, Tenant


class AuthCache:
    """Verified API keys, by the sha256 of the secret (what the database stores), for ``ttl_s``.

    Authenticating every request with a database read cost more than a third of a core at 300 requests/s on the
    benchmark host; a hit costs a dict lookup. The price is bounded staleness: a key revoked, a tenant disabled or
    a limit changed elsewhere (CLI, console) takes effect within ``ttl_s``. Expiry dates are checked on every hit;
    unknown secrets are never cached. ``ttl_s = 0`` caches nothing: every request reads the database, or shares
    a read in flight for its key.

    Misses are single-flight (``load``): when an entry expires under load, the requests for that key that arrive
    before its one lookup returns wait for it, instead of each reading the database in a thread of its own.
    """

    def __init__(self, ttl_s: float, max_entries: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: dict[str, tuple[float, Tenant, ApiKey]] = {}
        self._loading: dict[str, asyncio.Future[tuple[Tenant, ApiKey | None]]] = {}

    async def load(
        self, digest: str, lookup: Callable[[], Awaitable[tuple[Tenant, ApiKey | None]]]
    ) -> tuple[Tenant, ApiKey | None]:
        """``lookup()``'s answer for ``digest``, shared by every caller that asks while it runs; cached when it
        names a key. Its error (an invalid key) is every waiting caller's error."""

        async def lookup_and_cache() -> tuple[Tenant, ApiKey | None]:
            tenant, key = await lookup()
            if key is not None:
                self.put(digest, tenant, key)
            return tenant, key

        loading = self._loading.get(digest)
        if loading is None:
            loading = asyncio.ensure_future(lookup_and_cache())
            self._loading[digest] = loading
            loading.add_done_callback(lambda _: self._loading.pop(digest, None))
        return await asyncio.shield(loading)  # one caller leaving does not cancel the others' lookup

    def get(self, digest: str) -> tuple[Tenant, ApiKey] | None:
        entry = self._entries.get(digest)
        if entry is None:
            return None
        at, tenant, key = entry
        if time.monotonic() - at >= self.ttl_s or (key.expires_at is not None and key.expires_at <= datetime.now(UTC)):
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

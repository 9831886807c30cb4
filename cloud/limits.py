"""Rate limits on the hot path: requests/min, tokens/min and in-flight requests, per tenant and per key.

Counters live in the ``limits`` library's storage: Redis when ``TIERLINE_REDIS_URL`` is set (shared by all
replicas), process memory otherwise. Windows are fixed one-minute windows (``limits``' fixed-window
strategy; a burst can straddle a boundary). Tokens are reserved up front as prompt + max_tokens and the
unused part is given back when the request settles.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from limits.aio.storage import Storage
from limits.storage import storage_from_string

from cloud.settings import CloudSettings
from controlplane.storage.tables import ApiKey, Tenant
from shared.errors import RateLimitError

CONCURRENCY_TTL_S = 3600


@dataclass(frozen=True, slots=True)
class _Scope:
    kind: str  # tenant | key
    ident: str
    requests_per_minute: int
    tokens_per_minute: int
    max_concurrent: int


@dataclass(slots=True)
class RateLimitGrant:
    scopes: list[_Scope]
    reserved_tokens: int
    window: int
    token_keys: list[str] = field(default_factory=list)
    concurrency_keys: list[str] = field(default_factory=list)


def _pick(override: int | None, default: int) -> int:
    return default if override is None else override


class RateLimiter:
    def __init__(self, settings: CloudSettings, redis_url: str | None = None) -> None:
        self.settings = settings
        uri = ("async+" + redis_url) if redis_url else "async+memory://"
        options = {"implementation": "redispy"} if redis_url else {}
        storage = storage_from_string(uri, **options)
        assert isinstance(storage, Storage)
        self.storage = storage
        self.prefix = "tierline"

    def _scopes(self, tenant: Tenant, key: ApiKey | None) -> list[_Scope]:
        s = self.settings
        scopes = [
            _Scope(
                "tenant",
                str(tenant.id),
                _pick(tenant.requests_per_minute, s.tenant_requests_per_minute),
                _pick(tenant.tokens_per_minute, s.tenant_tokens_per_minute),
                _pick(tenant.max_concurrent, s.tenant_max_concurrent),
            )
        ]
        if key is not None:
            scopes.append(
                _Scope(
                    "key",
                    str(key.id),
                    _pick(key.requests_per_minute, s.key_requests_per_minute),
                    _pick(key.tokens_per_minute, s.key_tokens_per_minute),
                    _pick(key.max_concurrent, s.key_max_concurrent),
                )
            )
        return scopes

    def _key(self, what: str, scope: _Scope, window: int | None = None) -> str:
        suffix = f"/{window}" if window is not None else ""
        return f"{self.prefix}/{what}/{scope.kind}/{scope.ident}{suffix}"

    async def count_request(self, tenant: Tenant, key: ApiKey | None) -> None:
        """Count a request against the requests-per-minute limits only, or raise RateLimitError (429) and undo.

        For an async job's submission: its run holds tokens and an in-flight slot later, uncounted again.
        """
        now = time.time()
        window = int(now // 60)
        counted: list[str] = []
        for scope in self._scopes(tenant, key):
            if scope.requests_per_minute:
                k = self._key("rpm", scope, window)
                counted.append(k)
                if await self.storage.incr(k, 120) > scope.requests_per_minute:
                    for c in counted:
                        await self.storage.incr(c, 120, amount=-1)
                    raise RateLimitError(
                        f"{scope.kind} request rate limit of {scope.requests_per_minute}/min reached",
                        retry_after=max(1.0, 60 - now % 60),
                    )

    async def acquire(
        self, tenant: Tenant, key: ApiKey | None, reserved_tokens: int, *, is_counted: bool = False
    ) -> RateLimitGrant:
        """Count the request and reserve its tokens, or raise RateLimitError (429 with Retry-After) and undo.

        ``is_counted``: the request was counted already (``count_request``); only tokens and slots are taken.
        """
        now = time.time()
        window = int(now // 60)
        retry_after = max(1.0, 60 - now % 60)
        res = RateLimitGrant(self._scopes(tenant, key), reserved_tokens, window)
        try:
            for scope in res.scopes:
                if scope.requests_per_minute and not is_counted:
                    k = self._key("rpm", scope, window)
                    if await self.storage.incr(k, 120) > scope.requests_per_minute:
                        await self.storage.incr(k, 120, amount=-1)
                        raise RateLimitError(
                            f"{scope.kind} request rate limit of {scope.requests_per_minute}/min reached",
                            retry_after=retry_after,
                        )
                if scope.tokens_per_minute:
                    if reserved_tokens > scope.tokens_per_minute:
                        raise RateLimitError(
                            f"the request reserves {reserved_tokens} tokens (prompt + max_tokens), above the "
                            f"{scope.kind} limit of {scope.tokens_per_minute}/min; lower max_tokens",
                            retry_after=retry_after,
                            code="tokens_per_minute_exceeded",
                        )
                    k = self._key("tpm", scope, window)
                    if await self.storage.incr(k, 120, amount=reserved_tokens) > scope.tokens_per_minute:
                        await self.storage.incr(k, 120, amount=-reserved_tokens)
                        raise RateLimitError(
                            f"{scope.kind} token rate limit of {scope.tokens_per_minute}/min reached",
                            retry_after=retry_after,
                            code="tokens_per_minute_exceeded",
                        )
                    res.token_keys.append(k)
                if scope.max_concurrent:
                    k = self._key("inflight", scope)
                    if await self.storage.incr(k, CONCURRENCY_TTL_S) > scope.max_concurrent:
                        await self.storage.incr(k, CONCURRENCY_TTL_S, amount=-1)
                        raise RateLimitError(
                            f"{scope.kind} limit of {scope.max_concurrent} concurrent requests reached",
                            retry_after=1.0,
                            code="concurrency_limit_exceeded",
                        )
                    res.concurrency_keys.append(k)
        except RateLimitError:
            await self.release(res, used_tokens=0)
            raise
        return res

    async def release(self, res: RateLimitGrant, used_tokens: int) -> None:
        """Settle: give back the unused reserved tokens and the in-flight slot."""
        unused = max(0, res.reserved_tokens - used_tokens)
        if unused:
            for k in res.token_keys:
                await self.storage.incr(k, 120, amount=-unused)
        for k in res.concurrency_keys:
            await self.storage.incr(k, CONCURRENCY_TTL_S, amount=-1)
        res.token_keys.clear()
        res.concurrency_keys.clear()

    async def close(self) -> None:
        """Close the Redis connection pool (``limits`` exposes no close; its redis-py client is reached directly)."""
        client = getattr(getattr(self.storage, "bridge", None), "storage", None)
        if client is not None and hasattr(client, "aclose"):
            await client.aclose()

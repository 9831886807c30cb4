"""Rate limits on the hot path: requests/min, tokens/min and in-flight requests, per tenant and per key.

Counters live in the ``limits`` library's storage: Redis when ``TIERLINE_REDIS_URL`` is set (shared by all
replicas), process memory otherwise. Windows are fixed one-minute windows (``limits``' fixed-window
strategy; a burst can straddle a boundary). Tokens are reserved up front as prompt + max_tokens and the
unused part is given back when the request settles.

On Redis, a request's counters are taken in one script call (``_ACQUIRE``: every scope's requests, tokens and
slot, all or none) and given back in one (``_RELEASE``): two round trips a request instead of one per counter.
For ``redis://`` URLs both go through ``cloud.gateway.redis_pipe`` (one pipelined connection per event loop); other
URLs (TLS, unix sockets, sentinel) through redis-py's client.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from limits.aio.storage import Storage
from limits.storage import storage_from_string

from cloud.gateway import redis_pipe
from cloud.settings import CloudSettings
from controlplane.storage.tables import ApiKey, Tenant
from shared.errors import RateLimitError

CONCURRENCY_TTL_S = 3600

# KEYS: counters; ARGV: (amount, limit, expiry) per counter. Each is incremented in turn (a new counter gets its
# expiry, as ``limits``' own incr does); the first that goes over its limit undoes every increment so far and its
# 1-based index is returned; 0: all taken.
_ACQUIRE = """
for i, key in ipairs(KEYS) do
  local amount = tonumber(ARGV[3 * i - 2])
  local current = redis.call('incrby', key, amount)
  if current == amount then redis.call('expire', key, ARGV[3 * i]) end
  if current > tonumber(ARGV[3 * i - 1]) then
    for j = 1, i do redis.call('incrby', KEYS[j], -tonumber(ARGV[3 * j - 2])) end
    return i
  end
end
return 0
"""
# KEYS: counters; ARGV: (amount, expiry) per counter: add each amount (negative: give back).
_RELEASE = """
for i, key in ipairs(KEYS) do
  local amount = tonumber(ARGV[2 * i - 1])
  local current = redis.call('incrby', key, amount)
  if current == amount then redis.call('expire', key, ARGV[2 * i]) end
end
return 0
"""


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


def _over_limit(what: str, scope: _Scope, retry_after: float) -> RateLimitError:
    """The 429 of a request that ``scope``'s ``what`` counter (rpm, tpm, inflight) refused."""
    if what == "rpm":
        return RateLimitError(
            f"{scope.kind} request rate limit of {scope.requests_per_minute}/min reached", retry_after=retry_after
        )
    if what == "tpm":
        return RateLimitError(
            f"{scope.kind} token rate limit of {scope.tokens_per_minute}/min reached",
            retry_after=retry_after,
            code="tokens_per_minute_exceeded",
        )
    return RateLimitError(
        f"{scope.kind} limit of {scope.max_concurrent} concurrent requests reached",
        retry_after=1.0,
        code="concurrency_limit_exceeded",
    )


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
        # limits' Redis bridge (key prefix, client): the hot path's counters go through two scripts of ours.
        bridge = getattr(storage, "bridge", None)
        self._bridge: Any = bridge if redis_url and hasattr(bridge, "get_connection") else None
        self._scripts: dict[str, Any] = {}  # redis-py's registered scripts, by their text
        self._pipe = redis_pipe.PipelinedScripts(redis_url) if redis_url and redis_pipe.supports(redis_url) else None

    async def _run_script(self, script: str, keys: list[str], args: list[int]) -> Any:
        """``script`` (``_ACQUIRE`` or ``_RELEASE``) on Redis, over the pipelined client when it can."""
        keys = [self._bridge.prefixed_key(k) for k in keys]
        if self._pipe is not None:
            return await self._pipe.run(script, keys, args)
        if script not in self._scripts:
            self._scripts[script] = self._bridge.get_connection().register_script(script)
        return await self._scripts[script](keys=keys, args=args)

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

    async def take_per_minute(self, what: str, ident: str, amount: int, limit: int) -> None:
        """Count ``amount`` against ``limit`` per minute for ``ident`` (a fixed one-minute window in the limiter's
        storage, so Redis shares it among replicas), or raise RateLimitError (429) and count nothing."""
        now = time.time()
        k = f"{self.prefix}/{what}/{ident}/{int(now // 60)}"
        if await self.storage.incr(k, 120, amount=amount) > limit:
            await self.storage.incr(k, 120, amount=-amount)
            raise RateLimitError(f"{what}: at most {limit} per minute reached", retry_after=max(1.0, 60 - now % 60))

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
        # (counter, amount, limit, expiry, what it counts, its scope), in the order they are taken
        counters: list[tuple[str, int, int, int, str, _Scope]] = []
        for scope in res.scopes:
            if scope.requests_per_minute and not is_counted:
                counters.append((self._key("rpm", scope, window), 1, scope.requests_per_minute, 120, "rpm", scope))
            if scope.tokens_per_minute:
                if reserved_tokens > scope.tokens_per_minute:
                    raise RateLimitError(
                        f"the request reserves {reserved_tokens} tokens (prompt + max_tokens), above the "
                        f"{scope.kind} limit of {scope.tokens_per_minute}/min; lower max_tokens",
                        retry_after=retry_after,
                        code="tokens_per_minute_exceeded",
                    )
                k = self._key("tpm", scope, window)
                counters.append((k, reserved_tokens, scope.tokens_per_minute, 120, "tpm", scope))
                res.token_keys.append(k)
            if scope.max_concurrent:
                k = self._key("inflight", scope)
                counters.append((k, 1, scope.max_concurrent, CONCURRENCY_TTL_S, "inflight", scope))
                res.concurrency_keys.append(k)
        if not counters:
            return res
        over: tuple[str, int, int, int, str, _Scope] | None = None
        if self._bridge is not None:
            args: list[int] = []
            for _, amount, limit, expiry, _, _ in counters:
                args += (amount, limit, expiry)
            index = int(await self._run_script(_ACQUIRE, [c[0] for c in counters], args))
            over = counters[index - 1] if index else None
        else:
            taken: list[tuple[str, int, int]] = []
            for counter in counters:
                k, amount, limit, expiry, _, _ = counter
                taken.append((k, amount, expiry))
                if await self.storage.incr(k, expiry, amount=amount) > limit:
                    for undo, back, ttl in taken:
                        await self.storage.incr(undo, ttl, amount=-back)
                    over = counter
                    break
        if over is not None:
            res.token_keys.clear()
            res.concurrency_keys.clear()
            raise _over_limit(over[4], over[5], retry_after)
        return res

    async def release(self, res: RateLimitGrant, used_tokens: int) -> None:
        """Settle: give back the unused reserved tokens and the in-flight slot."""
        unused = max(0, res.reserved_tokens - used_tokens)
        back = [(k, -unused, 120) for k in res.token_keys] if unused else []
        back += [(k, -1, CONCURRENCY_TTL_S) for k in res.concurrency_keys]
        res.token_keys.clear()
        res.concurrency_keys.clear()
        if not back:
            return
        if self._bridge is not None:
            args: list[int] = []
            for _, amount, expiry in back:
                args += (amount, expiry)
            await self._run_script(_RELEASE, [k for k, _, _ in back], args)
            return
        for k, amount, expiry in back:
            await self.storage.incr(k, expiry, amount=amount)

    async def close(self) -> None:
        """Close the Redis connection pool (``limits`` exposes no close; its redis-py client is reached directly)."""
        client = getattr(getattr(self.storage, "bridge", None), "storage", None)
        if client is not None and hasattr(client, "aclose"):
            await client.aclose()
        if self._pipe is not None:
            await self._pipe.close()

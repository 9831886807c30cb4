"""Chat completions and completions on the LLM engines: OpenAI response and stream shapes, usage metering.

Every request that produced tokens writes exactly one usage record — including a stream the client
abandoned (billed for what was generated; generation stops at once) and a request cut by the deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import Any, Protocol, TypeVar, get_type_hints

from pydantic import TypeAdapter
from pydantic import ValidationError as PydanticValidationError
from sqlalchemy.engine import Engine

from cloud.engine.async_engine import generate_all
from cloud.engine.outputs import CompletionOutput, RequestOutput
from cloud.engine.prompts import check_context_length
from cloud.engine.sampling_params import SamplingParams
from cloud.engine.tokenizer import ChatTokenizer
from cloud.serving.canary import CanaryRouter
from cloud.serving.engine_pool import EnginePool, Metered, ServedLM, split_model
from cloud.serving.shadow import Mirror
from controlplane.billing.budgets import BudgetHold, PriceBook
from controlplane.billing.ledger import NewUsage
from controlplane.billing.pricing import Tokens
from controlplane.billing.scopes import Attribution
from controlplane.storage.tables import ApiKey, Tenant
from shared.errors import (
    ApplicationError,
    DeadlineExceededError,
    PermissionDeniedError,
    ServiceUnavailableError,
    ValidationError,
)
from shared.openai_responses import SSE_DONE, chat_logprob, completion_logprobs, prompt_logprobs, sse
from shared.openai_schema import MAX_INT32, ChatCompletionRequest, CompletionRequest, InferenceRequest
from shared.structured import grammar_of
from shared.tools import StreamParser, template_messages
from shared.tools import grammar as chat_grammar
from shared.tools import message as chat_message

# ``/v1/inference`` parameters: the SamplingParams fields a request may set, and the JSON types each takes. They are
# checked here, strictly (no bool for a number, no "1" for 1), because a wrong type that SamplingParams lets through
# would fail inside the engine's step, and with it every other request in flight.
_PARAMETER_TYPES: dict[str, TypeAdapter[Any]] = {
    name: TypeAdapter(str | list[str] if name == "stop" else hint)
    for name, hint in get_type_hints(SamplingParams).items()
    if name not in ("n", "speculation", "grammar", "prompt_logprobs")  # (prompt logprobs: /v1/completions only)
}


logger = logging.getLogger(__name__)
T = TypeVar("T")

MAX_INLINE_PROMPT_BYTES = 4 << 10  # prompts up to this are tokenised on the event loop (a thread hop costs more)


_FINISHING: set[asyncio.Future[Any]] = set()  # what run_to_end started: held here, or asyncio may drop it


async def run_to_end(work: Awaitable[T]) -> T:
    """Await ``work``, which runs to its end even if the caller is cancelled meanwhile.

    For a stream's last steps (its upstream response closed, its pool slot given back, its usage settled): a client
    that leaves cancels the response's task group, and that cancellation hits every later await of the stream, the
    ones in its ``finally`` too; awaited there directly, a rate-limit release or a settle would stop half-way and
    leave the record to the lease's sweeper (late) or unwritten. The caller still sees its cancellation.
    """
    task = asyncio.ensure_future(work)
    _FINISHING.add(task)
    task.add_done_callback(_FINISHING.discard)
    return await asyncio.shield(task)


class PromptTooLargeError(ApplicationError):
    status_code = 413
    error_type = "invalid_request_error"
    code = "prompt_too_large"


def _check_parameters(parameters: dict[str, Any]) -> None:
    for name, value in parameters.items():
        adapter = _PARAMETER_TYPES.get(name)
        if adapter is None:
            raise ValidationError(
                f"parameters.{name}: unsupported parameter (allowed: {', '.join(sorted(_PARAMETER_TYPES))})",
                param=f"parameters.{name}",
                code="unsupported_parameter",
            )
        try:
            adapter.validate_python(value, strict=True)
        except PydanticValidationError as exc:
            raise ValidationError(f"parameters.{name}: {exc.errors()[0]['msg']}", param=f"parameters.{name}") from None


def _is_token_ids(value: Any) -> bool:
    """A non-empty list of token ids as the engine takes them: integers (``type`` is: not booleans) in 32 bits."""
    return isinstance(value, list) and bool(value) and all(type(t) is int and 0 <= t <= MAX_INT32 for t in value)


@dataclass(slots=True)
class Caller:
    tenant: Tenant
    key: ApiKey | None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    started: float = field(default_factory=time.monotonic)
    device_id: str | None = None  # set on escalations from an edge agent
    escalation_reason: str | None = None
    subject: str | None = None  # x-tierline-subject: whom canary routing keeps sticky (else the request's user)
    model_version: str | None = None  # the version that serves the request (x-tierline-model-version)
    rollout_arm: str | None = None  # the rollout arm routing put a registry model's request in
    shadow: tuple[int, ServedLM] | None = None  # (rollout id, candidate) to mirror the answer to, when sampled
    is_job: bool = False  # an async job's run: counted against requests/min when it was submitted
    user: str | None = None  # the request's ``user`` field: the end user, unless x-tierline-subject names one
    attribution: Attribution | None = None  # an escalating device's key and project (its billing.* labels)

    @property
    def cache_salt(self) -> str:
        """The tenant's prefix-cache namespace: no tenant's requests hit another's cached prefix."""
        return f"tenant:{self.tenant.id}"

    @property
    def attribution_key_id(self) -> int | None:
        """The API key an escalating device's traffic is attributed to (its ``billing.key`` label), if any."""
        return self.attribution.key_id if self.attribution is not None else None

    @property
    def end_user(self) -> str | None:
        """Whose end-user budget the request counts against: x-tierline-subject, else the request's user (both are
        refused above ``MAX_END_USER_LEN`` characters, never cut)."""
        return self.subject or self.user or None


class RemoteModels(Protocol):
    """Served models that an upstream OpenAI-compatible server answers (``cloud.serving.backends.upstream.Backends``):
    the service hands their chat and completions requests over whole; they bill through ``reserve`` and ``_settle``."""

    def serves(self, model: str) -> bool: ...

    def model_ids(self) -> list[str]: ...

    def health(self) -> dict[str, dict[str, int]]: ...

    async def chat(
        self, caller: Caller, req: ChatCompletionRequest, remote: Metered | None = None
    ) -> dict[str, Any] | AsyncIterator[bytes]: ...

    async def completions(
        self, caller: Caller, req: CompletionRequest, remote: Metered | None = None
    ) -> dict[str, Any] | AsyncIterator[bytes]: ...


# What a request passes before and after serving, as this service calls it. The gateway's objects implement these
# (``cloud.gateway.limits.RateLimiter``, ``metering.UsageWriter``, ``budget_watch.BudgetAlerts``,
# ``observability.Metrics``); the serving room declares what it needs and never imports the gateway above it.
class Limiter(Protocol):
    """Rate limits: ``acquire`` counts a request and reserves its tokens (or raises a 429), ``release`` settles."""

    async def acquire(
        self, tenant: Tenant, key: ApiKey | None, reserved_tokens: int, *, is_counted: bool = False
    ) -> Any: ...

    async def release(self, res: Any, used_tokens: int) -> None: ...


class UsageLedger(Protocol):
    """Usage records and budget holds: reserved before a request runs, checkpointed while it streams, settled."""

    @property
    def engine(self) -> Engine: ...

    @property
    def checkpoints(self) -> bool: ...

    @staticmethod
    def record(id: str, tenant_id: int, model: str, tier: str, **columns: Any) -> NewUsage: ...

    def enqueue(self, usage: NewUsage) -> None: ...

    async def store(self, usage: NewUsage) -> None: ...

    def is_checkpoint_due(self, new_tokens: int, since_s: float) -> bool: ...

    async def reserve_request(
        self, tenant_id: int, budget: Decimal | None, amount: Decimal, who: Attribution, lease_s: float = ...
    ) -> BudgetHold | None: ...

    async def reserve_and_open(
        self,
        tenant_id: int,
        budget: Decimal | None,
        amount: Decimal,
        who: Attribution,
        opening: NewUsage,
        lease_s: float = ...,
    ) -> tuple[BudgetHold | None, bool]: ...

    async def checkpoint(self, usage: NewUsage, hold: BudgetHold | None, lease_s: float) -> None: ...

    async def settle_checkpointed(
        self, usage: NewUsage, hold: BudgetHold | None, *, checkpointed: bool = True
    ) -> Decimal | None: ...


class SpendAlerts(Protocol):
    """Budget and credit alerts, checked after a request settled."""

    async def after_credit(self, tenant_id: int) -> None: ...

    async def after_settle(self, tenant_id: int, period: str, spent: Decimal, budget: Decimal) -> None: ...


class RequestMetrics(Protocol):
    """The request metrics the gateway exports."""

    def observe_request(
        self,
        model: str,
        version: int | None,
        prompt: int,
        completion: int,
        latency_s: float,
        ttft_s: float | None,
        engine_s: float | None = None,
    ) -> None: ...


@dataclass(slots=True)
class _Meter:
    """Token counts seen so far for one API request (several engine requests when n or prompts > 1)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    rows: int = 0  # input rows of a tensor-model call (``cloud.serving.tensor_models``)
    first_token_at: float | None = None
    engine_s: float | None = None  # the engine's own latency: the slowest of the request's engine requests
    by_request: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    rate_limit: object | None = None  # the limiter's grant, handed back to it at the end
    budget: BudgetHold | None = None
    rollout_arm: str | None = None
    checkpointed: bool = False  # a checkpoint was written (or tried): the end settles it through the ledger
    checkpointed_in_stream: bool = False  # ... by the stream itself (not only with its reservation)
    checkpoint_at: float | None = None  # when the last one was written (None: never)
    checkpointed_tokens: int = 0  # completion tokens it held
    checkpoint_write: asyncio.Future[None] | None = None  # the last write, awaited before settling

    @property
    def served_nothing(self) -> bool:
        """No token and no row was served: no usage record is owed (but see ``_settle``'s rollout errors)."""
        return self.prompt_tokens == 0 and self.completion_tokens == 0 and self.rows == 0

    def checkpoint_age(self) -> float:
        """Seconds since the last checkpoint (infinite: none yet)."""
        return time.monotonic() - self.checkpoint_at if self.checkpoint_at is not None else float("inf")

    def update(self, out: RequestOutput) -> None:
        u = out.usage
        self.by_request[out.request_id] = (u.prompt_tokens, u.completion_tokens, u.cached_tokens)
        self.prompt_tokens = sum(v[0] for v in self.by_request.values())
        self.completion_tokens = sum(v[1] for v in self.by_request.values())
        self.cached_tokens = sum(v[2] for v in self.by_request.values())
        if self.first_token_at is None and u.completion_tokens:
            self.first_token_at = time.monotonic()
        if out.engine_s is not None:
            self.engine_s = max(self.engine_s or 0.0, out.engine_s)

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class CompletionService:
    def __init__(
        self,
        pool: EnginePool,
        usage: UsageLedger,
        limiter: Limiter,
        request_timeout_s: float,
        metrics: RequestMetrics,
        prices: PriceBook | None = None,
        alerts: SpendAlerts | None = None,
        budget_lease_s: float | None = None,
        canary: CanaryRouter | None = None,
        max_prompt_bytes: int = 1 << 20,
    ) -> None:
        self.pool = pool
        self.usage = usage
        self.limiter = limiter
        self.request_timeout_s = request_timeout_s
        self.metrics = metrics
        self.prices = prices or PriceBook(usage.engine)
        self.alerts = alerts
        self.budget_lease_s = budget_lease_s or request_timeout_s + 60.0
        self.canary = canary
        self.max_prompt_bytes = max_prompt_bytes
        self.remote: RemoteModels | None = None  # set by the backends that bill through this service

    async def _admit(
        self,
        caller: Caller,
        served: ServedLM,
        prompts: list[str | list[int]],
        params: SamplingParams,
        stream: bool = False,
    ) -> tuple[list[str | list[int]], _Meter]:
        """Tokenize, reserve prompt + max_tokens against the rate limits and the budget, and start the meter (a
        ``stream``'s with its first checkpoint)."""
        size = self._checked_size(p for p in prompts if isinstance(p, str))
        if size > MAX_INLINE_PROMPT_BYTES:  # seconds of work for a large prompt: off the event loop
            ids = await asyncio.to_thread(self._checked_prompts, served, prompts, params.max_tokens)
        else:
            ids = self._checked_prompts(served, prompts, params.max_tokens)
        caller.model_version = str(served.version) if served.version is not None else None
        reserved = prompt_worst = completion_worst = 0
        for p in ids:
            max_new = params.max_tokens if params.max_tokens is not None else max(1, served.max_model_len - len(p))
            reserved += len(p) + max_new * params.n
            prompt_worst += len(p) * params.n
            completion_worst += max_new * params.n
        opening = prompt_worst if stream else None
        return ids, await self.reserve(caller, served, reserved, Tokens(prompt_worst, completion_worst), opening)

    async def reserve(
        self, caller: Caller, served: Metered, reserved: int, worst_case: Tokens, opening: int | None = None
    ) -> _Meter:
        """Reserve ``reserved`` tokens against the rate limits and ``worst_case``'s cost against the budget (429 or
        402-type errors before any engine work); the meter that ``_settle`` gives back and bills.

        ``opening``: the request streams, and this many prompt tokens are its first checkpoint, written with the
        budget hold when checkpoints are on (one statement on PostgreSQL): the stream's first bytes then need
        none of their own. A gateway that dies after this bills the prompt (``interrupted``), as one that dies
        after the first bytes does.
        """
        meter = _Meter(rollout_arm=caller.rollout_arm)
        meter.rate_limit = await self.limiter.acquire(caller.tenant, caller.key, reserved, is_counted=caller.is_job)
        _, worst = self.prices.cost(served.model_id, served.version, "cloud", worst_case, tenant_id=caller.tenant.id)
        if worst is not None:
            try:
                if opening is not None and self.usage.checkpoints:
                    opened_at = time.monotonic()
                    record = self._record(
                        caller, served, replace(meter, prompt_tokens=opening), "ok", None, None, opened_at
                    )
                    meter.budget, opened = await self._reserve(caller, worst, record)
                    if opened:
                        meter.checkpointed, meter.checkpoint_at = True, opened_at
                else:
                    meter.budget, _ = await self._reserve(caller, worst)
            except BaseException:
                await self.limiter.release(meter.rate_limit, 0)
                meter.rate_limit = None
                raise
        return meter

    async def _reserve(
        self, caller: Caller, worst: Decimal, opening: NewUsage | None = None
    ) -> tuple[BudgetHold | None, bool]:
        """Hold ``worst`` on the tenant's monthly budget and on every scoped budget that applies to the caller's
        key, its project and its end user (an escalating device's: those of its attribution, its ``billing.user``
        label unless the request names a user), all at once, in one transaction; None when no budget applies
        (nothing to hold): one statement awaited on the event loop on PostgreSQL (``UsageWriter.reserve_request``).
        With ``opening``, the stream's first checkpoint is written with it; whether it was."""
        key = caller.key
        who = Attribution(key.id, key.project_id) if key is not None else caller.attribution or Attribution()
        who = replace(who, subject=caller.end_user)
        tenant_id, budget = caller.tenant.id or 0, caller.tenant.monthly_budget
        if opening is not None:
            return await self.usage.reserve_and_open(tenant_id, budget, worst, who, opening, self.budget_lease_s)
        return await self.usage.reserve_request(tenant_id, budget, worst, who, lease_s=self.budget_lease_s), False

    def _checked_size(self, texts: Iterable[str]) -> int:
        """The prompt's size in UTF-8 bytes, refused (413) above ``max_prompt_bytes`` before any tokenising."""
        size = sum(len(t.encode()) for t in texts)
        if size > self.max_prompt_bytes:
            raise PromptTooLargeError(
                f"prompt: {size} bytes, above the limit of {self.max_prompt_bytes} bytes "
                "(TIERLINE_CLOUD_MAX_PROMPT_BYTES)",
                param="prompt",
            )
        return size

    @staticmethod
    def _checked_prompts(
        served: ServedLM, prompts: list[str | list[int]], max_tokens: int | None
    ) -> list[str | list[int]]:
        """Every prompt's token ids, refusing what the engine would refuse for any one of them.

        A request's prompts run as one engine request each, started together: a prompt the engine refused on
        admission would leave its siblings cancelled half-admitted. Refused here, none of them starts.
        """
        engine = served.engine
        limit = served.max_model_len
        ids: list[str | list[int]] = []
        for prompt in prompts:
            if isinstance(prompt, str):  # counted in full, but only ids that can fit the context are listed
                prompt_ids, num_tokens = engine.tokenizer.encode_counted(prompt, limit)
            else:
                prompt_ids = engine.encode_prompt(prompt)
                num_tokens = len(prompt_ids)
            check_context_length(num_tokens, max_tokens, limit)
            ids.append(prompt_ids)
        return ids

    # -- shared -------------------------------------------------------------------------------------------------
    def _resolve(self, caller: Caller, model: str, user: str | None = None) -> ServedLM | Metered:
        """The engine (or, for a registry version with a serving spec, the upstream) that serves ``model`` for
        this caller.

        A registry model's bare name is routed: the version of the rollout arm the caller's tenant and subject
        (``x-tierline-subject``, else ``user``) fall in, else its default version; ``NAME@REF`` pins a version
        (number or alias) and bypasses routing. An API key limited to ``NAME`` may use every version of it.
        """
        caller.user = user or caller.user
        name, ref = split_model(model)
        allowed = caller.key.allowed_models if caller.key is not None else None
        if allowed and model not in allowed and name not in allowed:
            raise PermissionDeniedError(f"this API key may not use model '{model}'", param="model")
        entry = self.pool.registry.get(name)
        if entry is None or ref is not None or self.canary is None:
            return self.pool.remote_version(model) or self.pool.get(model)
        number, arm = self.canary.route(entry, caller.tenant.id or 0, caller.subject or user)
        served = (entry.versions.get(number) or entry.remote.get(number)) if number is not None else None
        if served is None:
            return self.pool.remote_version(model) or self.pool.get(model)
        caller.rollout_arm = arm
        target = self.canary.shadow(entry, caller.tenant.id or 0, number)
        candidate = entry.versions.get(target[1]) if target is not None else None
        if target is not None and candidate is not None:
            caller.shadow = (target[0], candidate)
        return served

    def _upstream(self) -> RemoteModels:
        if self.remote is None:
            raise ServiceUnavailableError("upstream backends are not running on this gateway")
        return self.remote

    def _mirror(
        self, caller: Caller, prompts: list[str | list[int]], params: SamplingParams, final: dict[int, list[int]]
    ) -> None:
        """Hand a sampled request's complete answer to the shadow mirror: plain greedy requests only (one prompt,
        one choice, no penalties), since the mirror replays the prompt greedily and compares token by token."""
        if caller.shadow is None or self.canary is None or len(prompts) != 1 or params.n != 1:
            return
        prompt, baseline = prompts[0], final.get(0)
        if not params.is_greedy or params.has_penalties or not isinstance(prompt, list) or not baseline:
            return
        rollout_id, candidate = caller.shadow
        self.canary.mirror.submit(Mirror(rollout_id, candidate, list(prompt), list(baseline)))

    @staticmethod
    def _params(
        tokenizer: ChatTokenizer,
        req: ChatCompletionRequest | CompletionRequest,
        max_tokens: int | None,
        logprobs: int | None,
    ) -> SamplingParams:
        """The request's sampling; a field it does not set takes the checkpoint's generation_config.json default
        where it has one (as vLLM's ``--generation-config auto``), else the API's."""
        choice = {**req.token_choice(), "repetition_penalty": req.repetition_penalty}
        choice = tokenizer.generation.apply(choice, req.model_fields_set)
        return SamplingParams(
            n=req.n,
            max_tokens=max_tokens,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            logprobs=logprobs,
            prompt_logprobs=req.num_prompt_logprobs if isinstance(req, CompletionRequest) else None,
            speculation=req.speculation,
            grammar=chat_grammar(req) if isinstance(req, ChatCompletionRequest) else grammar_of(req.response_format),
            **choice,
        )

    async def _settle(
        self,
        caller: Caller,
        served: Metered,
        meter: _Meter,
        status: str,
        usage_source: str | None = None,
        server_failure: bool = False,
    ) -> None:
        """Give back unused reservations, then meter the request (once, whatever its outcome). ``usage_source``: who
        counted the tokens when not this process's engine (``upstream``, or ``gateway``: the upstream sent none).
        A request that used no tokens leaves no usage record, except a ``server_failure`` (its upstream failed it)
        in a rollout arm: a zero-token ``error`` record, so the rollout's error rate sees it.

        A request that holds a budget reservation or wrote checkpoints settles in one transaction: its record
        stored, its hold settled, its checkpoint dropped. Others queue their record for the usage writer.
        """
        if meter.rate_limit is not None:
            await self.limiter.release(meter.rate_limit, meter.prompt_tokens + meter.completion_tokens)
            meter.rate_limit = None
        tokens = Tokens(meter.prompt_tokens, meter.completion_tokens, meter.cached_tokens, rows=meter.rows)
        price_id, cost = self.prices.cost(served.model_id, served.version, "cloud", tokens, tenant_id=caller.tenant.id)
        if meter.served_nothing and cost is not None:
            cost = Decimal(0)  # nothing was served, and no record is written: the hold is given back whole
        now = time.monotonic()
        record = self._record(caller, served, meter, status, price_id, cost, now, usage_source)
        write = meter.checkpoint_write
        if write is not None and not write.done():  # a write the client's leaving interrupted must land first
            await asyncio.wait([write])  # (on a finished write it would still cost a turn of the loop)
        written = False
        if meter.budget is not None or meter.checkpointed:
            reservation, meter.budget = meter.budget, None
            # The record is stored in the transaction that settles the hold (and drops a checkpoint): a crash
            # right after never leaves spend without its record, nor a record queued in a dead process's memory.
            spent = await self.usage.settle_checkpointed(record, reservation, checkpointed=meter.checkpointed)
            written = True
            if self.alerts is not None and reservation is not None and reservation.on_credit:
                await self.alerts.after_credit(reservation.tenant_id)
            elif (
                self.alerts is not None
                and reservation is not None
                and spent is not None
                and reservation.budget is not None
            ):
                await self.alerts.after_settle(reservation.tenant_id, reservation.period, spent, reservation.budget)
        if meter.served_nothing:
            if server_failure and meter.rollout_arm is not None and not meter.checkpointed_in_stream:
                self.usage.enqueue(record)
            return
        ttft_s = (meter.first_token_at - caller.started) if meter.first_token_at else None
        self.metrics.observe_request(
            served.model_id,
            served.version,
            meter.prompt_tokens,
            meter.completion_tokens,
            now - caller.started,
            ttft_s,
            meter.engine_s,
        )
        if not written:  # committed before the answer is sent: a kill -9 right after it loses no record
            await self.usage.store(record)

    def _record(
        self,
        caller: Caller,
        served: Metered,
        meter: _Meter,
        status: str,
        price_id: int | None,
        cost: Decimal | None,
        now: float,
        usage_source: str | None = None,
    ) -> NewUsage:
        ttft_s = (meter.first_token_at - caller.started) if meter.first_token_at else None
        return self.usage.record(
            caller.request_id,
            caller.tenant.id or 0,
            served.model_id,
            "cloud",
            api_key_id=caller.key.id if caller.key is not None else caller.attribution_key_id,
            device_id=caller.device_id,
            escalation_reason=caller.escalation_reason,
            price_id=price_id,
            cost=cost,
            model_version=served.version,
            rollout_arm=meter.rollout_arm,
            prompt_tokens=meter.prompt_tokens,
            completion_tokens=meter.completion_tokens,
            cached_prompt_tokens=meter.cached_tokens,
            rows=meter.rows,
            status=status,
            usage_source=usage_source,
            latency_ms=round((now - caller.started) * 1000, 2),
            ttft_ms=round(ttft_s * 1000, 2) if ttft_s is not None else None,
            engine_ms=round(meter.engine_s * 1000, 2) if meter.engine_s is not None else None,
        )

    async def _checkpoint(self, caller: Caller, served: Metered, meter: _Meter, *, due: bool | None = None) -> None:
        """Make a stream's usage so far durable before its next bytes go out, when a checkpoint is due
        (``TIERLINE_CLOUD_USAGE_CHECKPOINT_TOKENS`` / ``_MS``; ``due``: the caller decided): a crash then loses at
        most the tokens sent since.

        A failed write is logged and the stream goes on (billing falls back to the end-of-stream record).
        """
        if due is None:
            due = self.usage.is_checkpoint_due(
                meter.completion_tokens - meter.checkpointed_tokens, meter.checkpoint_age()
            )
        if not due:
            return
        record = self._record(caller, served, meter, "ok", None, None, time.monotonic())
        meter.checkpointed = meter.checkpointed_in_stream = True
        write = asyncio.ensure_future(self.usage.checkpoint(record, meter.budget, self.budget_lease_s))
        meter.checkpoint_write = write
        try:
            await asyncio.shield(write)  # the client leaving does not cancel the write: _settle waits for it
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("writing the usage checkpoint of request %s failed", caller.request_id)
        else:
            meter.checkpointed_tokens = meter.completion_tokens
        meter.checkpoint_at = time.monotonic()  # a failed write is retried an interval later, not on every event

    async def _collect(
        self, served: ServedLM, caller: Caller, prompts: list[str | list[int]], params: SamplingParams, meter: _Meter
    ) -> dict[int, RequestOutput]:
        final: dict[int, RequestOutput] = {}
        status = "error"
        try:
            async with asyncio.timeout(self.request_timeout_s):
                updates = generate_all(served.engine, prompts, params, caller.request_id, caller.cache_salt)
                async for i, out in updates:
                    meter.update(out)
                    if out.finished:
                        final[i] = out
            status = "ok"
        except TimeoutError:
            status = "deadline"
            raise DeadlineExceededError(f"the request ran past the {self.request_timeout_s:.0f}s deadline") from None
        except asyncio.CancelledError:
            status = "abandoned"
            raise
        finally:
            await self._settle(caller, served, meter, status)
        if caller.shadow is not None:
            self._mirror(
                caller, prompts, params, {i: list(o.outputs[0].token_ids) for i, o in final.items() if o.outputs}
            )
        return final

    async def _first(
        self,
        updates: AsyncGenerator[tuple[int, RequestOutput], None],
        caller: Caller,
        served: ServedLM,
        meter: _Meter,
    ) -> tuple[int, RequestOutput] | None:
        """The first update: admission errors (validation, QueueFull) are raised before any byte is streamed."""
        try:
            return await updates.__anext__()
        except StopAsyncIteration:
            return None
        except BaseException:
            await self._settle(caller, served, meter, "error")
            raise

    # -- chat ---------------------------------------------------------------------------------------------------
    def _chat_prompt(self, served: ServedLM, req: ChatCompletionRequest) -> str:
        tok = served.engine.tokenizer
        messages = template_messages(req, tok)
        self._checked_size(m["content"] for m in messages)  # before the template copies it
        tools = [t.model_dump(mode="json", exclude_none=True) for t in req.tools] if req.tools else None
        return tok.apply_chat_template(messages, add_generation_prompt=True, tools=tools)

    async def chat(self, caller: Caller, req: ChatCompletionRequest) -> dict[str, Any] | AsyncIterator[bytes]:
        if self.remote is not None and self.remote.serves(req.model):
            return await self.remote.chat(caller, req)
        served = self._resolve(caller, req.model, req.user)
        if not isinstance(served, ServedLM):  # a registry version that upstream servers answer
            return await self._upstream().chat(caller, req, served)
        params = self._params(served.engine.tokenizer, req, req.max_new_tokens, req.num_logprobs)
        (prompt,), meter = await self._admit(caller, served, [self._chat_prompt(served, req)], params, req.stream)
        if req.stream:
            return await self._chat_stream(served, caller, prompt, params, req, meter)
        final = (await self._collect(served, caller, [prompt], params, meter))[0]
        tok = served.engine.tokenizer
        choices = []
        for c in final.outputs:
            message, finish_reason = (
                chat_message(c.text, c.finish_reason)
                if req.calls_tools
                else ({"role": "assistant", "content": c.text}, c.finish_reason)
            )
            choice: dict[str, Any] = {
                "index": c.index,
                "message": message,
                "finish_reason": finish_reason,
                "logprobs": {"content": [chat_logprob(tok, lp) for lp in c.logprobs]}
                if c.logprobs is not None
                else None,
            }
            choices.append(choice)
        return {
            "id": f"chatcmpl-{caller.request_id}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": served.model_id,
            "choices": choices,
            "usage": meter.usage(),
        }

    async def _stream(
        self,
        served: ServedLM,
        caller: Caller,
        prompts: list[str | list[int]],
        params: SamplingParams,
        meter: _Meter,
        base: dict[str, Any],
        prologue: list[dict[str, Any]],
        render: Callable[[int, RequestOutput], list[dict[str, Any]]],
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        """Server-sent events: ``prologue`` choices, then ``render``'s choices per update, usage, ``[DONE]``.

        Admission (validation, queue bound) happens here, before the 200 goes out. Leaving early (client gone)
        or the deadline stops generation; the request is metered for what it generated either way.
        """
        updates = generate_all(served.engine, prompts, params, caller.request_id, caller.cache_salt)
        first = await self._first(updates, caller, served, meter)

        async def body() -> AsyncIterator[bytes]:
            status = "abandoned"
            done: dict[int, list[int]] = {}
            try:
                async with asyncio.timeout(self.request_timeout_s):
                    # One write per engine update, however many events it makes (the prologue goes with the
                    # first, usage and [DONE] with the last): each write is a send() on the socket.
                    events = [sse({**base, "choices": [choice]}) for choice in prologue]
                    item = first
                    while item is not None:  # the first update, then the rest (no generator layer per update)
                        i, out = item
                        meter.update(out)
                        if out.finished and out.outputs:
                            done[i] = list(out.outputs[0].token_ids)
                        events.extend(sse({**base, "choices": [choice]}) for choice in render(i, out))
                        if len(done) < len(prompts) and events:
                            await self._checkpoint(caller, served, meter)
                            yield b"".join(events)
                            events.clear()
                        item = await anext(updates, None)
                    if include_usage:
                        events.append(sse({**base, "choices": [], "usage": meter.usage()}))
                    events.append(SSE_DONE)
                    await self._checkpoint(caller, served, meter)
                    yield b"".join(events)
                    status = "ok"
                    self._mirror(caller, prompts, params, done)
            except TimeoutError:
                status = "deadline"
                err = DeadlineExceededError(f"the request ran past the {self.request_timeout_s:.0f}s deadline")
                yield sse(err.to_openai())
            except ServiceUnavailableError as exc:  # the engine failed or stopped mid-stream: say so, in the stream
                status = "error"
                yield sse(exc.to_openai())
            finally:

                async def finish() -> None:
                    await updates.aclose()
                    await self._settle(caller, served, meter, status)

                await run_to_end(finish())

        return body()

    async def _chat_stream(
        self,
        served: ServedLM,
        caller: Caller,
        prompt: str | list[int],
        params: SamplingParams,
        req: ChatCompletionRequest,
        meter: _Meter,
    ) -> AsyncIterator[bytes]:
        tok = served.engine.tokenizer
        base = {"id": f"chatcmpl-{caller.request_id}", "object": "chat.completion.chunk", "created": int(time.time())}
        base["model"] = served.model_id
        parsers = {i: StreamParser() for i in range(params.n)} if req.calls_tools else None
        opening = {"role": "assistant"} if parsers is not None else {"role": "assistant", "content": ""}
        prologue = [{"index": i, "delta": opening, "finish_reason": None} for i in range(params.n)]

        def render(_: int, out: RequestOutput) -> list[dict[str, Any]]:
            chunks = []
            for c in out.outputs:
                if not (c.delta_text or c.finish_reason or c.delta_logprobs):
                    continue
                if parsers is not None:  # tool calls: deltas of content or of tool_calls, held while undecided
                    calls = parsers[c.index].chunks(c.index, c.delta_text, c.finish_reason if out.finished else None)
                    if params.logprobs is not None and c.delta_logprobs:
                        calls = calls or [{"index": c.index, "delta": {}, "finish_reason": None}]
                        calls[0]["logprobs"] = {"content": [chat_logprob(tok, lp) for lp in c.delta_logprobs]}
                    chunks.extend(calls)
                    continue
                chunk: dict[str, Any] = {"index": c.index, "delta": {}, "finish_reason": None}
                if c.delta_text:
                    chunk["delta"]["content"] = c.delta_text
                if params.logprobs is not None:
                    chunk["logprobs"] = {"content": [chat_logprob(tok, lp) for lp in c.delta_logprobs]}
                if c.finish_reason and out.finished:
                    chunk["finish_reason"] = c.finish_reason
                chunks.append(chunk)
            return chunks

        return await self._stream(served, caller, [prompt], params, meter, base, prologue, render, req.include_usage)

    # -- generic inference ---------------------------------------------------------------------------------------
    async def inference(self, caller: Caller, req: InferenceRequest) -> dict[str, Any]:
        """``/v1/inference`` on an LLM: ``inputs`` are prompts, ``parameters`` are SamplingParams fields."""
        served = self._resolve(caller, req.model_id)
        if not isinstance(served, ServedLM):
            raise ValidationError(
                f"model '{req.model_id}' is answered by upstream servers: use /v1/chat/completions or /v1/completions",
                param="model_id",
            )
        _check_parameters(req.parameters)
        if not all(isinstance(p, str) or _is_token_ids(p) for p in req.inputs):
            raise ValidationError(
                f"inputs: each input must be a prompt string or a non-empty list of token ids (integers in "
                f"[0, {MAX_INT32}])",
                param="inputs",
            )
        try:
            params = SamplingParams(**req.parameters)
        except TypeError as exc:
            raise ValidationError(f"parameters: {exc}", param="parameters") from None
        except ValidationError as exc:  # named as the request names it: parameters.<field>
            raise ValidationError(f"parameters.{exc.message}", param=f"parameters.{exc.param}") from None
        if params.max_tokens == 0:  # (the engine's prefill-only mode serves echo on /v1/completions)
            raise ValidationError("parameters.max_tokens: must be >= 1", param="parameters.max_tokens")
        prompts, meter = await self._admit(caller, served, list(req.inputs), params)
        final = await self._collect(served, caller, prompts, params, meter)
        return {
            "model_id": served.model_id,
            "outputs": [
                {"text": final[i].text, "token_ids": final[i].token_ids, "finish_reason": final[i].finish_reason}
                for i in range(len(prompts))
            ],
            "usage": meter.usage(),
        }

    # -- completions --------------------------------------------------------------------------------------------
    async def completions(self, caller: Caller, req: CompletionRequest) -> dict[str, Any] | AsyncIterator[bytes]:
        if self.remote is not None and self.remote.serves(req.model):
            return await self.remote.completions(caller, req)
        served = self._resolve(caller, req.model, req.user)
        if not isinstance(served, ServedLM):
            return await self._upstream().completions(caller, req, served)
        params = self._params(served.engine.tokenizer, req, req.max_tokens, req.logprobs)
        prompts, meter = await self._admit(caller, served, req.prompts(), params, req.stream)
        if req.stream:
            return await self._completion_stream(served, caller, prompts, params, req, meter)
        final = await self._collect(served, caller, prompts, params, meter)
        tok = served.engine.tokenizer
        choices = [
            completion_choice(tok, req, i * params.n + c.index, final[i], c)
            for i in range(len(prompts))
            for c in final[i].outputs
        ]
        return {
            "id": f"cmpl-{caller.request_id}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": served.model_id,
            "choices": choices,
            "usage": meter.usage(),
        }

    async def _completion_stream(
        self,
        served: ServedLM,
        caller: Caller,
        prompts: list[str | list[int]],
        params: SamplingParams,
        req: CompletionRequest,
        meter: _Meter,
    ) -> AsyncIterator[bytes]:
        tok = served.engine.tokenizer
        base = {"id": f"cmpl-{caller.request_id}", "object": "text_completion", "created": int(time.time())}
        base["model"] = served.model_id

        def render(i: int, out: RequestOutput) -> list[dict[str, Any]]:
            return [
                {
                    "index": i * params.n + c.index,
                    "text": c.delta_text,
                    "finish_reason": c.finish_reason if out.finished else None,
                    "logprobs": completion_logprobs(tok, c.delta_logprobs) if params.logprobs is not None else None,
                }
                for c in out.outputs
                if c.delta_text or c.finish_reason
            ]

        return await self._stream(served, caller, prompts, params, meter, base, [], render, req.include_usage)


def completion_choice(
    tok: ChatTokenizer, req: CompletionRequest, index: int, out: RequestOutput, c: CompletionOutput
) -> dict[str, Any]:
    """One choice of a finished (non-streamed) completion, as vLLM answers it. ``echo``: the prompt's text before
    the output's and, with ``logprobs``, the prompt's tokens before the output's (the first one's logprob
    ``null``); ``prompt_logprobs``: vLLM's per-prompt-token maps. Both from the logits of the prefill."""
    prompt_lps = out.prompt_logprobs
    text, logprobs = c.text, None
    if req.echo:
        text = tok.decode(out.prompt_token_ids, skip_special_tokens=False) + text
    if c.logprobs is not None:
        echoed = out.prompt_token_ids if req.echo else None
        logprobs = completion_logprobs(tok, c.logprobs, echoed, prompt_lps if req.echo else None)
    choice: dict[str, Any] = {"index": index, "text": text, "finish_reason": c.finish_reason, "logprobs": logprobs}
    if req.prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs(tok, out.prompt_token_ids, prompt_lps or [])
    return choice

"""The cloud's half of the live quality monitor: edge-answered inputs a device sends in the background
(``POST /v1/edge/shadow``) are answered again by the cloud's model, compared with the edge's answers, billed as
``shadow`` usage and handed to the control plane's monitor (``controlplane.policies.monitor``).

- Classifier batches: the rows are run through the cloud's tensor model; a sample agrees when both predicted
  the same class.
- LM batches: each sample's prompt token ids are run through the cloud LM's engine (the pool the gateway serves
  from), greedily, for as many tokens as the edge generated; a sample agrees when the cloud's tokens are the
  edge's at every position (the calibration's ``agrees_with_cloud`` for LMs: the edge's answer *is* the cloud's),
  or at least at the share the policy's ``calibration.agreement_min_token_share`` names. Token ids are compared
  only when both models have the same vocabulary (``vocabulary_sha256``); otherwise the batch is refused (409)
  and the agent stops sampling that pair.

- Exactly once per batch: the usage record's id is derived from the device's batch id (namespaced by tenant and
  device, in a space the device's own usage ids cannot reach), and the record and the samples are stored in one
  transaction; a retried batch is answered ``duplicate`` without running the model again.
- Rate-bounded per device (``edge_shadow_rows_per_minute`` classifier rows, ``edge_shadow_tokens_per_minute`` LM
  tokens, prompts and generated; a one-minute window in the rate limiter's storage:
  Redis where the gateways have it, so every replica counts against the same bound): a device over it gets 429
  and its agent drops the batch (a sample is a sample).
- The tenant's shadow share is the cloud's rule, not only the agent's: a tenant whose share is 0 (``tierline
  tenants shadow-share TENANT 0``, or the cloud's default of 0) gets 403 ``shadow_disabled``, and nothing is billed.
  With a share ``s > 0``, a device may replay at most ``s`` of the edge work it reported: over the last
  ``share_window_s`` (an hour), the work of its shadow batches (stored ones and this one; a work unit is a
  classifier row or an LM token, prompt or generated) must stay within ``s`` x the work of the edge usage records
  it synced for that time (a classifier record's rows, an LM record's prompt and completion tokens) plus
  ``share_floor`` units (the batches a device sends before the sync that reports their requests); beyond, 429
  ``shadow_share_exceeded``.
- Spending like any other: before the cloud model runs, the batch's worst case (its rows, or its prompts and as
  many generated tokens as the edge's, at the shadow price, else the cloud's) is reserved against every hard budget
  the device's traffic counts against (the tenant's monthly budget or prepaid credit, and its key's, project's and
  end user's budgets: its ``billing.*`` labels), as a cloud request is (``budgets.reserve_request``); a batch that
  does not fit gets 429 ``insufficient_quota`` and nothing is billed. The hold settles at the batch's real cost in
  the transaction that stores its record and samples (released whole when the model fails or the batch was a
  duplicate). The agent drops a refused batch and pauses sampling (``edge_agent.shadow_sampler``).
- Never on a client's path: devices send these after answering, from a bounded background queue.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import numpy as np
from sqlalchemy import func
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from cloud.gateway.limits import RateLimiter
from cloud.serving.shadow import greedy_tokens
from cloud.serving.tensor_models import TensorPool
from controlplane.billing.budgets import BudgetHold, PriceBook, reserve_request, settle, settle_in
from controlplane.billing.ledger import NewUsage
from controlplane.billing.pricing import Rating, Tokens
from controlplane.billing.scopes import attribution_of
from controlplane.fleet.devices import device_usage_id
from controlplane.policies import monitor
from controlplane.rollouts.analysis import token_agreement
from controlplane.storage.tables import Device, EscalationPolicy, QualityAlert, Tenant, UsageRecord
from shared.edge_protocol import ShadowRequest, ShadowResponse, vocabulary_sha256
from shared.errors import ConflictError, NotFoundError, PermissionDeniedError, RateLimitError, ValidationError

if TYPE_CHECKING:  # the engines (torch) load only where requests are served
    from cloud.serving.engine_pool import EnginePool

logger = logging.getLogger(__name__)
SHADOW_TIER = "shadow"
SHADOW_REASON = "quality-monitor"
AGREEMENT_KEY = "agreement_min_token_share"  # an LM policy's calibration key: what "agrees" means (default 1.0)


def lm_agrees(edge_tokens: list[int], cloud_tokens: list[int], min_share: float = 1.0) -> tuple[bool, float]:
    """Whether an LM sample agrees (the share of the edge's positions where the cloud chose the same token is at
    least ``min_share``; 1.0: the same answer) and that share."""
    share = token_agreement(edge_tokens, cloud_tokens) or 0.0
    return share >= min_share - 1e-12, share


def min_token_share(policy: dict[str, Any] | None) -> float:
    """The token share at which an LM sample counts as agreeing under ``policy`` (its calibration's
    ``agreement_min_token_share``, in (0, 1]; else 1.0: every token the same)."""
    value = ((policy or {}).get("calibration") or {}).get(AGREEMENT_KEY)
    if isinstance(value, int | float) and not isinstance(value, bool) and 0.0 < float(value) <= 1.0:
        return float(value)
    return 1.0


def shadow_usage_id(tenant_id: int, device_id: str, batch_id: str) -> str:
    """``.`` is outside a device's usage-id alphabet, so no usage record a device sends can take this id."""
    return device_usage_id(tenant_id, device_id, f"{batch_id}.shadow")


@dataclass(slots=True)
class ShadowIntake:
    """Answers shadow batches: rate bound, cloud model, comparison, billing and the monitor's check."""

    db: Engine
    prices: PriceBook
    limiter: RateLimiter
    share: float = 0.0
    rows_per_minute: int = 600
    tokens_per_minute: int = 60_000
    share_window_s: float = 3600.0
    share_floor: int = 8192
    num_batches: int = 0
    num_alerts: int = 0
    _vocabularies: weakref.WeakKeyDictionary[Any, str] = field(default_factory=weakref.WeakKeyDictionary)

    def share_for(self, tenant: Tenant) -> float:
        """The share the tenant's devices sample: the tenant's own setting, else the cloud's."""
        return tenant.shadow_share if tenant.shadow_share is not None else self.share

    def check_enabled(self, tenant: Tenant) -> None:
        """Refuse (403 ``shadow_disabled``) a tenant whose shadow share is 0: its replays are off."""
        if self.share_for(tenant) <= 0:
            raise PermissionDeniedError(
                f"shadow replays are off for tenant '{tenant.name}' (its shadow share is 0): not answered, not billed",
                code="shadow_disabled",
            )

    async def take(self, device_id: str, rows: int) -> None:
        """Count a batch's inputs against the device's bound, or raise RateLimitError (429)."""
        await self.limiter.take_per_minute("shadow-inputs", device_id, rows, self.rows_per_minute)

    async def take_tokens(self, device_id: str, tokens: int) -> None:
        """Count an LM batch's tokens (prompts and generated) against the device's bound, or raise (429)."""
        await self.limiter.take_per_minute("shadow-tokens", device_id, tokens, self.tokens_per_minute)

    async def answer(
        self,
        tensors: TensorPool,
        device: Device,
        tenant: Tenant,
        data: ShadowRequest,
        engines: EnginePool | None = None,
    ) -> ShadowResponse:
        n = len(data.lm_samples) if data.is_lm else len(data.inputs)
        if not data.is_lm and (len(data.edge_answers) != n or len(data.confidences) != n):
            raise ValidationError("edge_answers and confidences: one per input", param="edge_answers")
        assert tenant.id is not None
        usage_id = shadow_usage_id(tenant.id, device.id, data.id)
        is_stored, policy = await asyncio.to_thread(self._lookup, usage_id, data.model, data.policy_version)
        if is_stored:
            return ShadowResponse(num_samples=n, num_agreements=0, duplicate=True)
        if policy is None:
            raise NotFoundError(
                f"no escalation policy version {data.policy_version} of '{data.model}'", param="policy_version"
            )
        self.check_enabled(tenant)
        if data.is_lm:
            return await self._answer_lm(engines, device, tenant, data, usage_id, policy)
        model = tensors.get(data.cloud_model)
        if model is None:
            raise NotFoundError(f"the cloud does not serve '{data.cloud_model}'", param="cloud_model")
        await self.take(device.id, n)
        rows = Tokens(0, 0, rows=n)
        hold = await asyncio.to_thread(self._admit, device, tenant, data, n, rows)
        try:
            started = time.monotonic()
            result = await tensors.infer(model, [list(row) for row in data.inputs])
            cloud_answers = np.argmax(np.asarray(result["outputs"], dtype=np.float64), axis=-1).tolist()
            samples = [
                monitor.Sample(confidence=c, agrees=int(a) == int(b))
                for c, a, b in zip(data.confidences, data.edge_answers, cloud_answers, strict=True)
            ]
            latency = round((time.monotonic() - started) * 1000, 2)
            is_new, alert = await asyncio.to_thread(
                self._record, device, tenant, data, usage_id, samples, latency, rows, hold
            )
        except BaseException:
            await self._release(hold)
            raise
        self._log_alert(alert)
        agreements = sum(s.agrees for s in samples)
        return ShadowResponse(num_samples=n, num_agreements=agreements, duplicate=not is_new)

    async def _answer_lm(
        self,
        engines: EnginePool | None,
        device: Device,
        tenant: Tenant,
        data: ShadowRequest,
        usage_id: str,
        policy: dict[str, Any],
    ) -> ShadowResponse:
        """An LM batch: each prompt answered greedily by the cloud LM for as many tokens as the edge generated."""
        if engines is None or not engines.serves(data.cloud_model):
            raise NotFoundError(f"the cloud does not serve '{data.cloud_model}'", param="cloud_model")
        if engines.remote_version(data.cloud_model) is not None:
            raise ConflictError(
                f"'{data.cloud_model}' is answered by an upstream backend here: its token ids cannot be compared"
            )
        served = engines.get(data.cloud_model)
        tokenizer = served.engine.tokenizer
        vocabulary = self._vocabularies.get(tokenizer)
        if vocabulary is None:
            vocabulary = await asyncio.to_thread(vocabulary_sha256, tokenizer.tokenizer)
            self._vocabularies[tokenizer] = vocabulary
        if vocabulary != data.vocabulary_sha256:
            raise ConflictError(
                f"'{data.model}' and '{data.cloud_model}' have different vocabularies: their token ids cannot be "
                "compared, so this pair is not monitored"
            )
        for i, sample in enumerate(data.lm_samples):
            if len(sample.prompt_ids) + len(sample.edge_tokens) > served.max_model_len:
                raise ValidationError(
                    f"lm_samples.{i}.prompt_ids: {len(sample.prompt_ids)} prompt tokens and "
                    f"{len(sample.edge_tokens)} generated exceed {data.cloud_model}'s context "
                    f"({served.max_model_len} tokens)",
                    param=f"lm_samples.{i}.prompt_ids",
                )
            served.engine.encode_prompt(sample.prompt_ids)  # ids outside the vocabulary: 400, naming the prompt
        prompt_tokens = sum(len(s.prompt_ids) for s in data.lm_samples)
        completion_tokens = sum(len(s.edge_tokens) for s in data.lm_samples)
        await self.take_tokens(device.id, prompt_tokens + completion_tokens)
        worst = Tokens(prompt_tokens, completion_tokens)  # the cloud generates as many tokens as the edge did, at most
        hold = await asyncio.to_thread(self._admit, device, tenant, data, prompt_tokens + completion_tokens, worst)
        try:
            started = time.monotonic()
            salt = f"tenant:{tenant.id}"  # the tenant's prefix-cache namespace, as its own requests
            answers = await asyncio.gather(
                *(greedy_tokens(served, s.prompt_ids, len(s.edge_tokens), "edge-shadow", salt) for s in data.lm_samples)
            )
            min_share = min_token_share(policy)
            samples, shares = [], []
            for sample, cloud_tokens in zip(data.lm_samples, answers, strict=True):
                agrees, share = lm_agrees(sample.edge_tokens, cloud_tokens, min_share)
                samples.append(monitor.Sample(confidence=sample.confidence, agrees=agrees, token_agreement=share))
                shares.append(share)
            latency = round((time.monotonic() - started) * 1000, 2)
            generated = sum(len(a) for a in answers)
            tokens = Tokens(prompt_tokens, generated)
            is_new, alert = await asyncio.to_thread(
                self._record, device, tenant, data, usage_id, samples, latency, tokens, hold
            )
        except BaseException:
            await self._release(hold)
            raise
        self._log_alert(alert)
        return ShadowResponse(
            num_samples=len(samples),
            num_agreements=sum(s.agrees for s in samples),
            duplicate=not is_new,
            token_agreement=round(sum(shares) / len(shares), 6),
        )

    def _admit(
        self, device: Device, tenant: Tenant, data: ShadowRequest, units: int, worst: Tokens
    ) -> BudgetHold | None:
        """Hold the batch against the tenant's shadow share (429 ``shadow_share_exceeded``) and reserve its worst
        case against every budget the device's traffic counts against (429 ``insufficient_quota``); the hold (None:
        nothing to hold: no budget applies, or no price)."""
        assert tenant.id is not None
        share = self.share_for(tenant)
        since = datetime.now(UTC) - timedelta(seconds=self.share_window_s)
        with Session(self.db) as session:
            volume = dict(
                session.exec(
                    select(
                        col(UsageRecord.tier),
                        func.coalesce(
                            func.sum(
                                col(UsageRecord.prompt_tokens)
                                + col(UsageRecord.completion_tokens)
                                + col(UsageRecord.rows)
                            ),
                            0,
                        ),
                    )
                    .where(
                        col(UsageRecord.tenant_id) == tenant.id,
                        col(UsageRecord.occurred_at) >= since,
                        col(UsageRecord.device_id) == device.id,
                        col(UsageRecord.tier).in_(["edge", SHADOW_TIER]),
                    )
                    .group_by(col(UsageRecord.tier))
                ).all()
            )
            who = attribution_of(session, device)
        reported, shadowed = int(volume.get("edge", 0)), int(volume.get(SHADOW_TIER, 0))
        allowed = share * reported + self.share_floor
        if shadowed + units > allowed:
            raise RateLimitError(
                f"shadow share: this batch ({units} rows or tokens) and the {shadowed} replayed in the last "
                f"{self.share_window_s:g}s exceed {share:g} of the {reported} this device reported (plus "
                f"{self.share_floor}); it is not answered, not billed",
                retry_after=60.0,
                code="shadow_share_exceeded",
            )
        _, cost = self._rate(data, tenant, worst)
        if cost is None:
            return None  # unpriced work: nothing to hold
        return reserve_request(self.db, tenant.id, tenant.monthly_budget, cost, who)

    async def _release(self, hold: BudgetHold | None) -> None:
        """Give a hold back whole (the batch failed before it was billed)."""
        if hold is None:
            return
        try:
            await asyncio.to_thread(settle, self.db, hold, Decimal(0))
        except Exception:  # its lease runs out and the sweeper releases it
            logger.exception("releasing shadow budget hold %s failed", hold.id)

    def _rate(self, data: ShadowRequest, tenant: Tenant, work: Tokens) -> Rating:
        """A price for the shadow tier wins; else the cloud's own price for the same work."""
        price = self.prices.lookup(data.cloud_model, None, SHADOW_TIER, tenant_id=tenant.id)
        tier = SHADOW_TIER if price is not None else "cloud"
        return self.prices.cost(data.cloud_model, None, tier, work, tenant_id=tenant.id)

    @staticmethod
    def _log_alert(alert: QualityAlert | None) -> None:
        if alert is not None:
            logger.warning(
                "quality alert %s: %s v%s group %r agrees with the cloud on %d/%d shadow samples (promised %.3f)",
                alert.id,
                alert.model,
                alert.policy_version,
                alert.device_group,
                alert.num_agreements,
                alert.num_samples,
                alert.promised,
            )

    def _lookup(self, usage_id: str, model: str, version: int) -> tuple[bool, dict[str, Any] | None]:
        """Whether the batch is stored already (a retry), and its policy version's JSON (None: no such version)."""
        with Session(self.db) as session:
            is_stored = session.exec(select(UsageRecord.id).where(UsageRecord.id == usage_id)).first() is not None
            policy = session.exec(
                select(EscalationPolicy.policy).where(
                    EscalationPolicy.model == model, EscalationPolicy.version == version
                )
            ).first()
            return is_stored, dict(policy) if policy is not None else None

    def _record(
        self,
        device: Device,
        tenant: Tenant,
        data: ShadowRequest,
        usage_id: str,
        samples: list[monitor.Sample],
        latency_ms: float,
        work: Tokens,
        hold: BudgetHold | None = None,
    ) -> tuple[bool, QualityAlert | None]:
        """Bill the batch and store its samples in one transaction: with a ``hold``, the hold settled at the batch's
        cost (its record then counts against no budget again); a duplicate (a concurrent retry stored it first)
        gives the hold back whole."""
        assert tenant.id is not None
        rating = self._rate(data, tenant, work)
        usage = NewUsage(
            id=usage_id,
            tenant_id=tenant.id,
            model=data.cloud_model,
            tier=SHADOW_TIER,
            occurred_at=datetime.now(UTC),
            prompt_tokens=work.prompt,
            completion_tokens=work.completion,
            rows=work.rows,
            device_id=device.id,
            latency_ms=latency_ms,
            escalation_reason=SHADOW_REASON,
            rating=rating,
            is_settled=hold is not None,
        )
        with Session(self.db) as session:
            if hold is not None:  # the hold's rows first, as a cloud request settles (one lock order)
                settle_in(session, hold, rating[1] or Decimal(0))
            is_new, alert = monitor.record_batch(
                session,
                usage,
                model=data.model,
                policy_version=data.policy_version,
                group=monitor.device_group(device.labels),
                samples=samples,
                prices=self.prices,
            )
            if not is_new:
                session.rollback()
                if hold is not None:
                    settle(self.db, hold, Decimal(0))
                return False, None
            session.commit()
            if alert is not None:
                session.refresh(alert)
                session.expunge(alert)
        self.num_batches += int(is_new)
        self.num_alerts += int(alert is not None)
        return is_new, alert

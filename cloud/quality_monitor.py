"""The cloud's half of the live quality monitor: edge-answered inputs a device sends in the background
(``POST /v1/edge/shadow``) are answered again by the cloud's model, compared with the edge's answers, billed as
``shadow`` usage and handed to the control plane's monitor (``controlplane.policies.monitor``).

- Exactly once per batch: the usage record's id is derived from the device's batch id (namespaced by tenant and
  device, in a space the device's own usage ids cannot reach), and the record and the samples are stored in one
  transaction; a retried batch is answered ``duplicate`` without running the model again.
- Rate-bounded per device (``edge_shadow_rows_per_minute``, a one-minute window in the rate limiter's storage:
  Redis where the gateways have it, so every replica counts against the same bound): a device over it gets 429
  and its agent drops the batch (a sample is a sample).
- Never on a client's path: devices send these after answering, from a bounded background queue.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from cloud.limits import RateLimiter
from cloud.tensor_models import TensorPool
from controlplane.billing.budgets import PriceBook
from controlplane.billing.ledger import NewUsage
from controlplane.billing.pricing import Tokens
from controlplane.fleet.devices import device_usage_id
from controlplane.policies import monitor
from controlplane.storage.tables import Device, EscalationPolicy, QualityAlert, Tenant, UsageRecord
from shared.edge_protocol import ShadowRequest, ShadowResponse
from shared.errors import NotFoundError, ValidationError

logger = logging.getLogger(__name__)
SHADOW_TIER = "shadow"
SHADOW_REASON = "quality-monitor"


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
    num_batches: int = 0
    num_alerts: int = 0

    def share_for(self, tenant: Tenant) -> float:
        """The share the tenant's devices sample: the tenant's own setting, else the cloud's."""
        return tenant.shadow_share if tenant.shadow_share is not None else self.share

    async def take(self, device_id: str, rows: int) -> None:
        """Count a batch's inputs against the device's bound, or raise RateLimitError (429)."""
        await self.limiter.take_per_minute("shadow-inputs", device_id, rows, self.rows_per_minute)

    async def answer(self, tensors: TensorPool, device: Device, tenant: Tenant, data: ShadowRequest) -> ShadowResponse:
        n = len(data.inputs)
        if len(data.edge_answers) != n or len(data.confidences) != n:
            raise ValidationError("edge_answers and confidences: one per input", param="edge_answers")
        assert tenant.id is not None
        usage_id = shadow_usage_id(tenant.id, device.id, data.id)
        is_stored, is_known = await asyncio.to_thread(self._lookup, usage_id, data.model, data.policy_version)
        if is_stored:
            return ShadowResponse(num_samples=n, num_agreements=0, duplicate=True)
        if not is_known:
            raise NotFoundError(
                f"no escalation policy version {data.policy_version} of '{data.model}'", param="policy_version"
            )
        model = tensors.get(data.cloud_model)
        if model is None:
            raise NotFoundError(f"the cloud does not serve '{data.cloud_model}'", param="cloud_model")
        await self.take(device.id, n)
        started = time.monotonic()
        result = await tensors.infer(model, [list(row) for row in data.inputs])
        cloud_answers = np.argmax(np.asarray(result["outputs"], dtype=np.float64), axis=-1).tolist()
        samples = [
            monitor.Sample(confidence=c, agrees=int(a) == int(b))
            for c, a, b in zip(data.confidences, data.edge_answers, cloud_answers, strict=True)
        ]
        latency = round((time.monotonic() - started) * 1000, 2)
        is_new, alert = await asyncio.to_thread(self._record, device, tenant, data, usage_id, samples, latency)
        agreements = sum(s.agrees for s in samples)
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
        return ShadowResponse(num_samples=n, num_agreements=agreements, duplicate=not is_new)

    def _lookup(self, usage_id: str, model: str, version: int) -> tuple[bool, bool]:
        """Whether the batch is stored already (a retry), and whether its policy version exists."""
        with Session(self.db) as session:
            is_stored = session.exec(select(UsageRecord.id).where(UsageRecord.id == usage_id)).first() is not None
            policy = session.exec(
                select(EscalationPolicy.id).where(EscalationPolicy.model == model, EscalationPolicy.version == version)
            ).first()
            return is_stored, policy is not None

    def _record(
        self,
        device: Device,
        tenant: Tenant,
        data: ShadowRequest,
        usage_id: str,
        samples: list[monitor.Sample],
        latency_ms: float,
    ) -> tuple[bool, QualityAlert | None]:
        assert tenant.id is not None
        rows = Tokens(0, 0, rows=len(samples))
        # A price for the shadow tier wins; else the cloud's own price for the same work.
        price = self.prices.lookup(data.cloud_model, None, SHADOW_TIER, tenant_id=tenant.id)
        rating = self.prices.cost(
            data.cloud_model, None, SHADOW_TIER if price is not None else "cloud", rows, tenant_id=tenant.id
        )
        usage = NewUsage(
            id=usage_id,
            tenant_id=tenant.id,
            model=data.cloud_model,
            tier=SHADOW_TIER,
            occurred_at=datetime.now(UTC),
            rows=len(samples),
            device_id=device.id,
            latency_ms=latency_ms,
            escalation_reason=SHADOW_REASON,
            rating=rating,
        )
        with Session(self.db) as session:
            is_new, alert = monitor.record_batch(
                session,
                usage,
                model=data.model,
                policy_version=data.policy_version,
                group=monitor.device_group(device.labels),
                samples=samples,
                prices=self.prices,
            )
            session.commit()
            if alert is not None:
                session.refresh(alert)
                session.expunge(alert)
        self.num_batches += int(is_new)
        self.num_alerts += int(alert is not None)
        return is_new, alert

"""The edge-facing gateway: devices enroll, sync (usage and telemetry up, desired state down) and escalate.

- ``POST /v1/edge/enroll``: a one-time enrollment token (``tierline devices enrollment-token``) becomes a
  device record and a device credential, returned once with the artifact-signing public key(s).
- ``POST /v1/edge/sync``: device-authenticated; stores the outbox batch idempotently by record id and
  answers the device's desired model versions and escalation policies (those targeting it). The batch is
  committed before the answer, so an agent that hears 200 may forget the batch. A usage record beyond what the
  device could have done (``controlplane.fleet.devices.UsageBounds``) is quarantined, not billed: counted in the
  answer (``quarantined``) and in ``tierline_usage_quarantined_total``, logged, and sent to the tenant's webhook
  as a ``usage.quarantined`` event.
- ``POST /v1/edge/escalate``: device-authenticated inference on the cloud's models, billed to the device's
  tenant (tier ``cloud``, the escalation reason recorded) under a usage id the cloud chooses and returns in
  ``x-tierline-usage-id``; the agent records no usage of its own for an escalated request.
- ``POST /v1/edge/shadow``: device-authenticated, rate-bounded, held against the tenant's shadow share and against
  every budget the device's traffic counts against; edge-answered inputs (classifier rows, or LM prompts and
  generated token ids) answered again by the cloud for the live quality monitor, billed as ``shadow`` usage
  (``cloud.edge.quality_monitor``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Protocol

from litestar import Request, Response, post
from litestar.di import Provide
from pydantic import ValidationError as PydanticValidationError
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session

from cloud.edge.quality_monitor import ShadowIntake
from cloud.gateway.budget_watch import BudgetAlerts
from cloud.gateway.webhooks import WebhookStore
from cloud.serving.responses import respond
from cloud.serving.tensor_models import TensorPool
from controlplane.billing import credit
from controlplane.billing.budgets import PriceBook, tightest
from controlplane.billing.pricing import period_of
from controlplane.billing.scopes import ATTRIBUTION_LABELS, Attribution, attribution_of, end_users_config
from controlplane.fleet.devices import SyncCounts, UsageBounds, UsageWindow, authenticate_device, enroll, ingest
from controlplane.policies.service import desired_for as desired_policies
from controlplane.registry.service import paired_models, pairings_for
from controlplane.storage.tables import BudgetAlert, BudgetPeriod, Device, Tenant
from shared.artifacts import load_public_key, public_path, public_pem
from shared.edge_protocol import (
    Allowance,
    DesiredModel,
    EnrollRequest,
    EnrollResponse,
    EscalateRequest,
    ModelPairing,
    ShadowRequest,
    ShadowResponse,
    SyncRequest,
    SyncResponse,
)
from shared.errors import AuthenticationError, NotFoundError, ValidationError
from shared.http import StreamingOperation, error_responses
from shared.openai_schema import ChatCompletionRequest, CompletionRequest, InferenceRequest, request_error
from shared.settings import CoreSettings

if TYPE_CHECKING:  # the app names it for Litestar (signature_namespace): importing it loads the engine (torch)
    from cloud.serving.completions import CompletionService

logger = logging.getLogger(__name__)
DEVICE_BEARER: list[dict[str, list[str]]] = [{"DeviceAuth": []}]
USAGE_QUARANTINED = "usage.quarantined"  # the tenant event for device usage records held out of billing


class DesiredState(Protocol):
    def desired(self, device: Device) -> list[DesiredModel]: ...


@dataclass(slots=True)
class DeviceCaller:
    device: Device
    tenant: Tenant


def require_device(request: Request[Any, Any, Any], db: Engine) -> DeviceCaller:
    scheme, _, secret = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise AuthenticationError("missing device credential (Authorization: Bearer tld-...)")
    with Session(db) as session:
        device, tenant = authenticate_device(session, secret.strip())
        session.expunge_all()
    return DeviceCaller(device, tenant)


DEVICE = {"device": Provide(require_device, sync_to_thread=True)}


def signing_public_keys() -> list[str]:
    path = public_path(CoreSettings().signing_key_path)
    return [public_pem(load_public_key(path)).decode()] if path.is_file() else []


@dataclass(frozen=True, slots=True)
class EdgeGateway:
    """Enrollment and sync: a device's records stored and rated, its desired versions and allowance answered."""

    db: Engine
    prices: PriceBook
    releases: DesiredState
    alerts: BudgetAlerts
    sync_interval_s: float
    on_sync: Callable[[SyncCounts], None] | None = None  # told each sync's counts (Metrics.count_edge_sync)
    window: UsageWindow | None = None  # when a device's usage may have occurred (None: UsageWindow's defaults)
    shadow: ShadowIntake | None = None  # the quality monitor's shadow samples (None: refused)
    bounds: UsageBounds | None = None  # what a device's usage may claim (None: UsageBounds's defaults)

    def enroll(self, data: EnrollRequest) -> EnrollResponse:
        with Session(self.db) as session:
            device, tenant, secret = enroll(
                session,
                data.token,
                name=data.name,
                labels=data.labels,
                agent_version=data.agent_version,
                runtime=data.runtime,
            )
            session.commit()
            device_id, tenant_name = device.id, tenant.name
        return EnrollResponse(
            device_id=device_id,
            device_token=secret,
            tenant=tenant_name,
            signing_public_keys=signing_public_keys(),
            sync_interval_s=self.sync_interval_s,
        )

    def _allowance(self, device_id: str) -> tuple[Allowance | None, list[BudgetAlert]]:
        """The device's allowance now (the tightest hard budget its traffic counts against: its tenant's, and its
        key's, project's and end user's where it is attributed to them), and the budget alerts the synced spend
        fired."""
        period = period_of(datetime.now(UTC))
        with Session(self.db) as session:
            device = session.get(Device, device_id)
            tenant = session.get(Tenant, device.tenant_id) if device is not None else None
            if device is None or tenant is None:
                return None, []
            tenant_id = device.tenant_id
            left, budget_name = tightest(session, tenant, attribution=attribution_of(session, device))
            if credit.available(session, tenant_id) is not None:
                try:
                    self.alerts.check_credit(tenant_id)
                except Exception:  # retried at the next sync
                    logger.exception("checking the credit balance of tenant %s failed", tenant_id)
            allowance = Allowance(remaining=left, currency=tenant.currency, period=period, budget=budget_name)
            budget = tenant.monthly_budget
            if budget is None:
                return allowance, []
            row = session.get(BudgetPeriod, (tenant_id, period))
            spent = row.spent if row is not None else Decimal(0)
        fired: list[BudgetAlert] = []
        try:
            fired = self.alerts.check(tenant_id, period, spent, budget)
        except Exception:  # the synced records are stored: an alert that failed is retried at the next sync
            logger.exception("recording budget alerts for tenant %s failed", tenant_id)
        return allowance, fired

    def attribution(self, device: Device) -> Attribution:
        """Whose budgets below the tenant the device's escalations are held against (its ``billing.*`` labels)."""
        if not any(name in (device.labels or {}) for name in ATTRIBUTION_LABELS):
            return Attribution()
        with Session(self.db) as session:
            return attribution_of(session, device)

    def sync(self, caller: DeviceCaller, data: SyncRequest) -> tuple[SyncResponse, list[BudgetAlert]]:
        device: Device | None = None
        for attempt in (1, 2):
            try:
                with Session(self.db) as session:
                    counts = ingest(
                        session,
                        caller.device,
                        data.usage,
                        data.events,
                        self.prices,
                        window=self.window,
                        policies=data.policies,
                        bounds=self.bounds,
                    )
                    device = session.get(Device, caller.device.id)
                    assert device is not None
                    device.last_seen_at = datetime.now(UTC)
                    device.agent_version = data.agent_version or device.agent_version
                    device.runtime = data.runtime or device.runtime
                    device.versions = data.models
                    device.metrics = data.metrics
                    device.policies = data.policies
                    session.add(device)
                    session.commit()
                    session.refresh(device)
                    policies = desired_policies(session, device)
                    session.expunge(device)
                    break
            except IntegrityError:
                # A concurrent retry of the same batch stored some ids first; the second pass skips them.
                if attempt == 2:
                    raise
        assert device is not None
        if self.on_sync is not None:
            self.on_sync(counts)
        if counts.quarantined_ids:
            self._alert_quarantined(caller, counts.quarantined_ids)
        allowance, fired = self._allowance(caller.device.id)
        desired = self.releases.desired(device)  # as updated now: the facts this sync reported count
        answer = SyncResponse(
            accepted=counts.accepted,
            duplicates=counts.duplicates,
            conflicts=counts.conflicts,
            clamped=counts.clamped,
            quarantined=counts.quarantined,
            desired=desired,
            policies=policies,
            pairings=self._pairings(desired),
            config={
                "sync_interval_s": self.sync_interval_s,
                "shadow_share": self.shadow.share_for(caller.tenant) if self.shadow is not None else 0.0,
                "end_users": end_users_config(self.attribution(device)),  # whom its requests may name
            },
            server_time=time.time(),
            allowance=allowance,
        )
        return answer, fired

    def _alert_quarantined(self, caller: DeviceCaller, ids: tuple[str, ...]) -> None:
        """Tell the tenant (its webhook, ``usage.quarantined``) that records of its device were held out of billing;
        the operator sees them in ``tierline billing quarantined`` and the metric. A failure is logged, never the
        sync's (its records are stored). The sync handler wakes the dispatcher."""
        tenant = caller.tenant
        if not tenant.webhook_url or tenant.id is None:
            return
        payload = {
            "id": f"uq_{ids[0]}",
            "type": USAGE_QUARANTINED,
            "created": int(time.time()),
            "data": {"tenant": tenant.name, "device": caller.device.id, "count": len(ids), "records": list(ids[:20])},
        }
        try:
            with Session(self.db) as session:
                WebhookStore.enqueue_event(session, tenant.id, tenant.webhook_url, USAGE_QUARANTINED, payload)
                session.commit()
        except Exception:
            logger.exception("queueing the usage.quarantined event of tenant %s failed", tenant.id)

    def _pairings(self, desired: list[DesiredModel]) -> list[ModelPairing]:
        """Which cloud model each edge model escalates to, from its registry model (``tierline models pair``):
        every paired registry model (a device may hold one it was never sent, such as the zoo's), and each release
        sent, paired or not (an unpaired one answers locally). A release no registry model published gets none."""
        with Session(self.db) as session:
            pairs: dict[str, tuple[str | None, str]] = dict(paired_models(session))
            pairs.update(pairings_for(session, [d.name for d in desired]))
        return [
            ModelPairing(model=name, cloud_model=cloud_model, resend="text" if resend == "text" else "as-sent")
            for name, (cloud_model, resend) in sorted(pairs.items())
        ]


@post("/v1/edge/enroll", status_code=200, sync_to_thread=True, responses=error_responses(400, 401, 413))
def enroll_device(edge: EdgeGateway, data: EnrollRequest) -> EnrollResponse:
    """Exchange a one-time enrollment token for a device credential and the artifact-signing keys."""
    return edge.enroll(data)


@post(
    "/v1/edge/sync",
    dependencies=DEVICE,
    status_code=200,
    security=DEVICE_BEARER,
    responses=error_responses(400, 401, 413),
)
async def sync(edge: EdgeGateway, device: DeviceCaller, data: SyncRequest) -> SyncResponse:
    """Heartbeat and outbox batch up (idempotent by record id); the device's desired state and its tenant's
    remaining allowance down."""
    answer, fired = await asyncio.to_thread(edge.sync, device, data)
    if (fired or answer.quarantined) and edge.alerts.notify is not None:
        edge.alerts.notify()
    return answer


@post(
    "/v1/edge/escalate",
    dependencies=DEVICE,
    status_code=200,
    security=DEVICE_BEARER,
    responses=error_responses(400, 401, 403, 404, 413, 429),
    operation_class=StreamingOperation,
)
async def escalate(
    edge: EdgeGateway, tensors: TensorPool, completions: CompletionService, device: DeviceCaller, data: EscalateRequest
) -> Response[Any]:
    """A request the device chose not to answer locally, served by the cloud and billed to its tenant; held
    against every budget a direct call would be: the tenant's and those of the device's attribution (its key,
    project and end user: the device's ``billing.user``; the request's ``user`` may name another end user only if
    the device's enrollment allows it, ``billing.subjects=any``, else 403)."""
    from cloud.serving.completions import Caller  # imports the engine (torch); the rest of this module does not
    from controlplane.billing.scopes import device_end_user
    from shared.errors import PermissionDeniedError

    if data.request_id is not None and not data.request_id.replace("-", "").replace("_", "").isalnum():
        raise ValidationError("request_id: letters, digits, '-' and '_' only", param="request_id")
    # Billed under an id the cloud chooses; the device's id is for correlation (logged) only.
    logger.info("escalation from %s (device request %s): %s", device.device.id, data.request_id, data.reason)
    attribution = await asyncio.to_thread(edge.attribution, device.device)
    named = data.body.get("user") if data.endpoint != "inference" else None
    end_user = device_end_user(attribution, named if isinstance(named, str) else None)
    if end_user.is_refused:
        raise PermissionDeniedError(end_user.refusal("body.user"), param="body.user", code="end_user_not_allowed")
    caller = Caller(
        tenant=device.tenant,
        key=None,
        request_id=uuid.uuid4().hex,
        device_id=device.device.id,
        escalation_reason=data.reason,
        attribution=attribution,
        user=attribution.subject,  # the default end user: the request's own ``user`` replaces it
    )
    result: dict[str, Any] | AsyncIterator[bytes]
    try:
        if data.endpoint == "inference":
            inference = InferenceRequest.model_validate(data.body)
            if tensors.serves(inference.model_id):  # metered, limited and budgeted like an LLM call
                result = await tensors.inference(caller, inference)
            else:
                result = await completions.inference(caller, inference)
        elif data.endpoint == "chat.completions":
            result = await completions.chat(caller, ChatCompletionRequest.model_validate(data.body))
        else:
            result = await completions.completions(caller, CompletionRequest.model_validate(data.body))
    except PydanticValidationError as exc:
        raise request_error(exc, "body.") from None
    return respond(caller, result)


@post(
    "/v1/edge/shadow",
    dependencies=DEVICE,
    status_code=200,
    security=DEVICE_BEARER,
    responses=error_responses(400, 401, 404, 409, 413, 429),
)
async def shadow(
    edge: EdgeGateway, tensors: TensorPool, completions: CompletionService, device: DeviceCaller, data: ShadowRequest
) -> ShadowResponse:
    """Edge-answered inputs (classifier rows, or LM prompts and generated tokens) answered again by the cloud for the
    quality monitor (never shown to a client), billed once per batch id as ``shadow`` usage."""
    if edge.shadow is None:
        raise NotFoundError("this cloud does not take shadow samples", param="id")
    return await edge.shadow.answer(tensors, device.device, device.tenant, data, completions.pool)


ROUTES = [enroll_device, sync, escalate, shadow]

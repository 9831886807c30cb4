"""The async side of the inference API.

- ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/inference`` with ``"async": true`` in the body or
  ``Prefer: respond-async``: 202 with the queued job and ``Location: /v1/jobs/{id}``. Optional
  ``webhook_url`` (http/https): the finished job is POSTed there, signed with the tenant's webhook secret.
  With an ``Idempotency-Key`` a retried submission answers the same job. A submission counts against the
  caller's requests-per-minute limits like a synchronous call (429 with Retry-After over them).
- ``GET /v1/jobs/{id}``, ``GET /v1/jobs?limit=``, ``GET /v1/jobs/{id}/deliveries``: the caller's tenant only.
- ``POST /v1/webhook-secret``: a new webhook secret for the tenant, shown once (it replaces the old one).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from litestar import Request, Response, get, post
from litestar.params import Parameter

from cloud.gateway.idempotency import MAX_KEY_LENGTH, IdempotencyMismatchError
from cloud.gateway.ids import CloudIds
from cloud.gateway.job_worker import JobWorker
from cloud.gateway.jobs import INFERENCE, MAX_LIST_LIMIT, JobSettings, JobStore, job_json
from cloud.gateway.limits import RateLimiter
from cloud.gateway.webhooks import WebhookStore, attempt_json, validate_webhook_url
from cloud.serving.completions import Caller
from cloud.serving.engine_pool import EnginePool, EngineRestartingError, split_model
from cloud.serving.tensor_models import TensorPool, unknown_model
from controlplane.storage.tables import Job
from shared.errors import PermissionDeniedError, ValidationError
from shared.http import error_responses

ASYNC_PREFERENCE = "respond-async"


def _prefers_async(request: Request[Any, Any, Any]) -> bool:
    """``Prefer: respond-async`` (RFC 7240), possibly among other preferences."""
    prefs = ",".join(request.headers.getall("prefer", []))
    return any(p.split(";")[0].strip().lower() == ASYNC_PREFERENCE for p in prefs.split(","))


@dataclass(frozen=True, slots=True)
class JobIntake:
    """Queues the inference requests a client asked to run asynchronously."""

    store: JobStore
    worker: JobWorker
    webhooks: WebhookStore
    settings: JobSettings
    pool: EnginePool
    tensors: TensorPool
    limiter: RateLimiter
    ids: CloudIds  # the server-keyed ids of jobs submitted with an Idempotency-Key
    remote_serves: Callable[[str], bool] | None = None  # models upstream servers answer (``openai`` backends)

    def _check_model(self, caller: Caller, endpoint: str, model: str) -> None:
        """Refuse now what the job would fail on at once: an unknown model, or one the key may not use."""
        if endpoint == INFERENCE:
            if not self.tensors.serves(model) and model not in self.pool.engines:
                if self.pool.registry.get(split_model(model)[0]) is None:
                    raise unknown_model(model)
                self.pool.get(model)  # a registry model still loading, or failed: 503 saying why
        elif self.pool.remote_version(model) is None and (self.remote_serves is None or not self.remote_serves(model)):
            with contextlib.suppress(EngineRestartingError):  # the worker waits for the restart (Retry-After)
                self.pool.get(model)
        allowed = caller.key.allowed_models if caller.key is not None else None
        if allowed and model not in allowed and split_model(model)[0] not in allowed:  # a key for NAME may use NAME@REF
            param = "model_id" if endpoint == INFERENCE else "model"
            raise PermissionDeniedError(f"this API key may not use model '{model}'", param=param)

    async def submit_if_async(
        self,
        request: Request[Any, Any, Any],
        caller: Caller,
        endpoint: str,
        model: str,
        body: Callable[[], dict[str, Any]],
        is_stream: bool,
    ) -> Response[Any] | None:
        """Queue the request as a job when the client asked for async (202); None for a synchronous request.

        ``async`` and ``webhook_url`` are read from the raw body (the cloud's request schemas validate them as
        ``AsyncJobFields``); ``body()`` (the validated request, dumped only for a job) is stored without them.
        """
        raw = await request.json()
        fields = raw if isinstance(raw, dict) else {}
        flag, webhook_url = fields.get("async"), fields.get("webhook_url")
        if flag is not None and not isinstance(flag, bool):
            raise ValidationError("async: must be true or false", param="async")
        prefers_async = _prefers_async(request)
        if not (flag or prefers_async):
            if webhook_url is not None:
                raise ValidationError(
                    'webhook_url: needs an async request ("async": true or Prefer: respond-async)', param="webhook_url"
                )
            return None
        if is_stream:
            raise ValidationError(
                "stream: an async request cannot stream; poll the job or use webhook_url", param="stream"
            )
        tenant_id = caller.tenant.id or 0
        if webhook_url is not None:
            webhook_url = validate_webhook_url(webhook_url, allow_private=self.settings.webhook_allow_private_networks)
            if not await asyncio.to_thread(self.webhooks.has_secret, tenant_id):
                raise ValidationError(
                    "webhook_url: the tenant has no webhook secret yet; create one with POST /v1/webhook-secret",
                    param="webhook_url",
                )
        self._check_model(caller, endpoint, model)
        validated = body()
        key = request.headers.get("idempotency-key")
        if key is not None and not 0 < len(key) <= MAX_KEY_LENGTH:
            raise ValidationError(f"Idempotency-Key must be 1 to {MAX_KEY_LENGTH} characters", param="Idempotency-Key")
        # A job holds tokens and an in-flight slot when it runs; its submission counts against requests/min now, so
        # queueing is throttled like synchronous calls (a retried submission too: it is a request all the same).
        await self.limiter.count_request(caller.tenant, caller.key)
        job = Job(
            id=self.ids.job_id(tenant_id, key),
            tenant_id=tenant_id,
            api_key_id=caller.key.id if caller.key is not None else None,
            endpoint=endpoint,
            model=model,
            request=validated,
            webhook_url=webhook_url,
        )
        stored, is_new = await asyncio.to_thread(self.store.create, job)
        headers = {"Location": f"/v1/jobs/{stored.id}", "x-tierline-usage-id": stored.id}
        if prefers_async:
            headers["Preference-Applied"] = ASYNC_PREFERENCE
        if is_new:
            self.worker.notify()
        else:
            if (stored.endpoint, stored.request, stored.webhook_url) != (endpoint, validated, webhook_url):
                raise IdempotencyMismatchError(
                    "this Idempotency-Key was used with a different request body", param="Idempotency-Key"
                )
            headers["x-tierline-idempotent-replay"] = "true"
        return Response(job_json(stored), status_code=202, headers=headers)


@get("/v1/jobs", sync_to_thread=True, responses=error_responses(400, 401))
def list_jobs(
    jobs: JobStore, caller: Caller, limit: int = Parameter(default=20, ge=1, le=MAX_LIST_LIMIT)
) -> dict[str, Any]:
    """The caller's tenant's most recent jobs, newest first."""
    return {"object": "list", "data": [job_json(j) for j in jobs.recent(caller.tenant.id or 0, limit)]}


@get("/v1/jobs/{job_id:str}", sync_to_thread=True, responses=error_responses(400, 401, 404))
def get_job(jobs: JobStore, caller: Caller, job_id: str) -> dict[str, Any]:
    """One job: its status, and its result (the synchronous call's JSON) or its error (OpenAI shape)."""
    return job_json(jobs.get(caller.tenant.id or 0, job_id))


@get("/v1/jobs/{job_id:str}/deliveries", sync_to_thread=True, responses=error_responses(400, 401, 404))
def list_deliveries(jobs: JobStore, webhooks: WebhookStore, caller: Caller, job_id: str) -> dict[str, Any]:
    """The job's webhook delivery and every attempt at it."""
    job = jobs.get(caller.tenant.id or 0, job_id)
    delivery, attempts = webhooks.for_job(job.id)
    return {
        "object": "list",
        "delivery": None
        if delivery is None
        else {
            "id": delivery.id,
            "url": delivery.url,
            "status": delivery.status,
            "attempts": delivery.attempts,
            "next_attempt_at": int(delivery.available_at.timestamp()) if delivery.status == "pending" else None,
        },
        "data": [
            {"object": "webhook_delivery_attempt", "delivery_id": a.delivery_id, **attempt_json(a)} for a in attempts
        ],
    }


@post("/v1/webhook-secret", status_code=201, sync_to_thread=True, responses=error_responses(401))
def rotate_webhook_secret(webhooks: WebhookStore, caller: Caller) -> dict[str, Any]:
    """A new webhook secret, returned only here; webhooks are signed with it from now on."""
    row = webhooks.rotate_secret(caller.tenant.id or 0)
    return {"object": "webhook_secret", "secret": row.secret, "created_at": int(row.created_at.timestamp())}


JOB_ROUTES = [list_jobs, get_job, list_deliveries, rotate_webhook_secret]

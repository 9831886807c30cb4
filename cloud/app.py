"""The cloud inference API (Litestar): OpenAI-compatible routes in front of the LLM engines.

Controllers stay thin: they parse and validate the body, resolve the caller, and hand over to
``CompletionService``. Errors use the OpenAI shape (``shared.http``).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

from litestar import Litestar, Request, Response, Router, get, post
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig, ResponseSpec
from litestar.openapi.spec import Components, SecurityScheme
from pydantic import BaseModel
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from cloud.edge.gateway import ROUTES as EDGE_ROUTES
from cloud.edge.gateway import EdgeGateway
from cloud.edge.quality_monitor import ShadowIntake
from cloud.edge.releases import ARTIFACT_ROUTES, LEGACY_DIR, ReleaseStore
from cloud.gateway.auth_cache import AuthCache
from cloud.gateway.budget_watch import BudgetAlerts, ReservationSweeper
from cloud.gateway.idempotency import IdempotencyStore, request_hash
from cloud.gateway.ids import CloudIds
from cloud.gateway.job_routes import JOB_ROUTES, JobIntake
from cloud.gateway.job_worker import running_jobs
from cloud.gateway.jobs import CHAT, COMPLETIONS, INFERENCE, JobSettings, JobStore
from cloud.gateway.jwt_auth import JwtVerifier, looks_like_jwt
from cloud.gateway.limits import RateLimiter
from cloud.gateway.metering import UsageWriter
from cloud.gateway.observability import Metrics
from cloud.gateway.responses_route import responses_route
from cloud.gateway.tenant_routes import TENANT_ROUTES
from cloud.gateway.webhooks import WebhookStore
from cloud.serving.backends.upstream import Backends
from cloud.serving.canary import CanaryRouter
from cloud.serving.completions import Caller, CompletionService
from cloud.serving.engine_pool import EnginePool, split_model
from cloud.serving.models_catalog import ServedModel, find, load_catalog, registry_catalog
from cloud.serving.registry_models import CACHE_DIR, RegistryModels, is_enabled, parse_names
from cloud.serving.responses import respond
from cloud.serving.tensor_models import CACHE_DIR as TENSOR_CACHE_DIR
from cloud.serving.tensor_models import BatchSettings, TensorPool, TensorRegistry, unknown_model
from cloud.settings import CloudSettings
from controlplane.billing.budgets import PriceBook
from controlplane.fleet.devices import UsageBounds, UsageWindow
from controlplane.registry.store import store_from_settings
from controlplane.storage.migrate import is_up_to_date
from controlplane.storage.session import get_db
from controlplane.storage.tables import ApiKey, Tenant
from controlplane.tenancy.service import KEY_PREFIX, authenticate, hash_api_key
from shared.artifacts import load_public_key, public_path
from shared.errors import AuthenticationError, ServiceUnavailableError
from shared.http import StreamingOperation, error_responses
from shared.logs import server_request_id
from shared.openai_schema import (
    JOB_FIELDS,
    AsyncJobFields,
    ChatCompletionRequest,
    CompletionRequest,
    InferenceRequest,
    check_end_user,
)
from shared.request_body import BoundedRequest
from shared.service_app import create_service_app, typed_state
from shared.settings import CoreSettings, DatabaseSettings


@dataclass(frozen=True, slots=True, kw_only=True)
class CloudState:
    """What the API's handlers use, built once at start-up; each field is a dependency of the same name."""

    db: Engine
    completions: CompletionService
    pool: EnginePool
    tensors: TensorPool
    catalog: list[ServedModel]
    # Not "metrics": a dependency's name must not be a body field's (the device's sync reports ``metrics``), or
    # Litestar answers that field's validation error as a server error (a failed dependency), a 500.
    observed: Metrics
    idempotency: IdempotencyStore
    jwt: JwtVerifier | None
    auth_cache: AuthCache
    jobs: JobStore
    job_intake: JobIntake
    webhooks: WebhookStore
    job_settings: JobSettings
    releases: ReleaseStore
    edge: EdgeGateway


def _model_json(m: ServedModel) -> dict[str, Any]:
    return {"id": m.id, "object": "model", "created": m.created, "owned_by": "tierline"}


def _catalog(
    catalog: list[ServedModel], pool: EnginePool, completions: CompletionService, tensors: TensorPool
) -> list[ServedModel]:
    """The zoo's models, the registry models served by name (LLMs, then tensor models), then those of upstream
    servers (``openai`` backends)."""
    remote = completions.remote
    upstream = [ServedModel(m, "causal-lm", "", 0) for m in remote.model_ids()] if remote is not None else []
    tensor = [ServedModel(name, "tensor", sha, created) for name, sha, created in tensors.catalog()]
    return [*catalog, *registry_catalog(pool.registry), *tensor, *upstream]


def _zoo_contexts(root: Path) -> dict[str, int]:
    """The context length of each of the zoo's LMs by model name (``tierline/<artifact>``), from its config.json:
    what a device's usage of them may claim (``UsageBounds``) when the registry does not describe them."""
    contexts: dict[str, int] = {}
    artifacts = root / "artifacts"
    for config in sorted(artifacts.glob("*/config.json")) if artifacts.is_dir() else []:
        try:
            length = int(json.loads(config.read_text())["max_position_embeddings"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        contexts[f"tierline/{config.parent.name}"] = length
    return contexts


def _lookup(db: Engine, verifier: JwtVerifier | None, secret: str) -> tuple[Tenant, ApiKey | None]:
    with Session(db) as session:
        if verifier is not None and looks_like_jwt(secret):
            name = verifier.tenant_name(secret)
            tenant = session.exec(select(Tenant).where(Tenant.name == name)).first()
            if tenant is None or not tenant.is_active:
                raise AuthenticationError(f"bearer token names an unknown or disabled tenant '{name}'")
            key = None
        else:
            tenant, key = authenticate(session, secret)
        session.expunge_all()
    return tenant, key


async def require_caller(
    request: Request[Any, Any, Any], db: Engine, auth_cache: AuthCache, jwt: JwtVerifier | None
) -> Caller:
    header = request.headers.get("authorization", "")
    scheme, _, secret = header.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise AuthenticationError("missing bearer API key (Authorization: Bearer tl-...)")
    secret = secret.strip()
    digest = hash_api_key(secret) if secret.startswith(KEY_PREFIX) else None
    hit = auth_cache.get(digest) if digest is not None else None
    key: ApiKey | None
    if hit is not None:
        tenant, key = hit
    elif digest is not None:
        tenant, key = await auth_cache.load(digest, partial(asyncio.to_thread, _lookup, db, jwt, secret))
    else:
        tenant, key = await asyncio.to_thread(_lookup, db, jwt, secret)
    subject = check_end_user(request.headers.get("x-tierline-subject"), "x-tierline-subject")
    return Caller(tenant=tenant, key=key, request_id=server_request_id(), subject=subject)


CALLER = {"caller": Provide(require_caller)}
BEARER: list[dict[str, list[str]]] = [{"BearerAuth": []}]
INFERENCE_RESPONSES = {
    202: ResponseSpec(
        dict[str, Any],
        description='Queued as a job ("async": true or Prefer: respond-async); Location: /v1/jobs/{id}',
        generate_examples=False,
    ),
    **error_responses(400, 401, 403, 404, 409, 413, 422, 429),
}


@get("/readyz", sync_to_thread=True, include_in_schema=False)
def readyz(db: Engine, pool: EnginePool, completions: CompletionService) -> dict[str, Any]:
    """Readiness: the database answers and is migrated, and the engines are loaded (503 naming what is not).

    Models that upstream servers answer are reported, not judged: per model its endpoints and how many the pool
    admits, and under ``degraded`` those with none admitted (their requests get 503 with Retry-After), then each
    registry version that failed to load as ``NAME@N: why`` (its requests get 503 ``model_unavailable``). The gateway
    stays ready meanwhile: it still serves every other model, and taking it out of a load balancer would not
    bring the upstream back."""
    try:
        ok = is_up_to_date(db)
    except Exception as exc:
        raise ServiceUnavailableError(f"database unavailable: {type(exc).__name__}") from None
    if not ok:
        raise ServiceUnavailableError("database schema is behind; run `tierline db upgrade`")
    restarting = pool.restarting()
    dead = sorted(m for m, served in pool.engines.items() if not served.engine.alive and m not in restarting)
    problems = [f"degraded, engine restarting: {', '.join(restarting)}"] if restarting else []
    problems += [f"engine not running: {', '.join(dead)}"] if dead else []
    if problems:
        raise ServiceUnavailableError("; ".join(problems))
    upstreams = completions.remote.health() if completions.remote is not None else {}
    degraded = sorted(m for m, u in upstreams.items() if u["admitted"] == 0) + pool.failures()
    return {"status": "ready", "models": sorted(pool.engines), "upstreams": upstreams, "degraded": degraded}


@get("/metrics", sync_to_thread=False, include_in_schema=False)
def render_metrics(observed: Metrics) -> Response[bytes]:
    """Prometheus exposition."""
    return Response(observed.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@get("/v1/models", dependencies=CALLER, sync_to_thread=False, security=BEARER, responses=error_responses(401))
def list_models(
    catalog: list[ServedModel], pool: EnginePool, completions: CompletionService, tensors: TensorPool, caller: Caller
) -> dict[str, Any]:
    return {"object": "list", "data": [_model_json(m) for m in _catalog(catalog, pool, completions, tensors)]}


@get(
    "/v1/models/{model_id:path}",
    dependencies=CALLER,
    sync_to_thread=False,
    security=BEARER,
    responses=error_responses(400, 401, 404),
)
def get_model(
    catalog: list[ServedModel],
    pool: EnginePool,
    completions: CompletionService,
    tensors: TensorPool,
    caller: Caller,
    model_id: str,
) -> dict[str, Any]:
    return _model_json(find(_catalog(catalog, pool, completions, tensors), model_id.lstrip("/")))


class CloudChatRequest(ChatCompletionRequest, AsyncJobFields):
    """A chat completion request as the cloud takes it: the OpenAI fields, plus ``async`` and ``webhook_url``."""


class CloudCompletionRequest(CompletionRequest, AsyncJobFields):
    """A completion request as the cloud takes it: the OpenAI fields, plus ``async`` and ``webhook_url``."""


class CloudInferenceRequest(InferenceRequest, AsyncJobFields):
    """An inference request as the cloud takes it, plus ``async`` and ``webhook_url``."""


def _dumper(data: BaseModel) -> Callable[[], dict[str, Any]]:
    """The validated request as a job stores it (and an idempotent call hashes it): set fields, no job fields;
    dumped only for a job or an idempotent call."""
    return partial(data.model_dump, mode="json", by_alias=True, exclude_unset=True, exclude=set(JOB_FIELDS))


async def _idempotent(
    request: Request[Any, Any, Any],
    store: IdempotencyStore,
    caller: Caller,
    body: Callable[[], dict[str, Any]],
    is_stream: bool,
    call: Callable[[], Awaitable[dict[str, Any] | AsyncIterator[bytes]]],
) -> Response[Any]:
    """Run ``call``; with an ``Idempotency-Key`` header, a retry gets the stored response, unbilled."""
    key = request.headers.get("idempotency-key")
    if key is None:
        return respond(caller, await call())
    tenant_id = caller.tenant.id or 0
    claim = await asyncio.to_thread(store.claim, tenant_id, key, request_hash(body()), is_stream)
    caller.request_id = store.ids.usage_id(tenant_id, key)
    if claim.response is not None:
        replay = {"x-tierline-usage-id": caller.request_id, "x-tierline-idempotent-replay": "true"}
        return Response(claim.response, headers=replay)
    try:
        result = await call()
    except BaseException:
        await asyncio.to_thread(store.release, tenant_id, key, claim.token)
        raise
    assert isinstance(result, dict)  # streams are refused by claim()
    await asyncio.to_thread(store.complete, tenant_id, key, claim.token, result)
    return respond(caller, result)


async def _request_caller(request: Request[Any, Any, Any]) -> Caller:
    """``require_caller`` with the services read from the app's state: the inference routes' only dependency."""
    state = typed_state(request.app.state, CloudState)
    return await require_caller(request, state.db, state.auth_cache, state.jwt)


# The inference routes (the hot path) take one dependency, the caller, and read the services from the state:
# dependencies at one level are resolved in an anyio task group (a task and a signature model each, per request),
# which for the six a route and require_caller would name cost more than any other step in the framework. The
# caller stays a dependency so that authentication still comes before the body's validation (401 before 400).
INFERENCE_CALLER = {"caller": Provide(_request_caller)}


@post(
    "/v1/chat/completions",
    dependencies=INFERENCE_CALLER,
    status_code=200,
    security=BEARER,
    responses=INFERENCE_RESPONSES,
    operation_class=StreamingOperation,
)
async def chat_completions(request: Request[Any, Any, Any], caller: Caller, data: CloudChatRequest) -> Response[Any]:
    """OpenAI chat completions, with ``stream: true`` as server-sent events (``"async": true``: a job, 202)."""
    state = typed_state(request.app.state, CloudState)
    body = _dumper(data)
    job = await state.job_intake.submit_if_async(request, caller, CHAT, data.model, body, data.stream)
    if job is not None:
        return job
    call = partial(state.completions.chat, caller, data)
    return await _idempotent(request, state.idempotency, caller, body, data.stream, call)


@post(
    "/v1/completions",
    dependencies=INFERENCE_CALLER,
    status_code=200,
    security=BEARER,
    responses=INFERENCE_RESPONSES,
    operation_class=StreamingOperation,
)
async def completions(request: Request[Any, Any, Any], caller: Caller, data: CloudCompletionRequest) -> Response[Any]:
    """OpenAI (legacy) completions, with ``stream: true`` as server-sent events (``"async": true``: a job, 202)."""
    state = typed_state(request.app.state, CloudState)
    body = _dumper(data)
    job = await state.job_intake.submit_if_async(request, caller, COMPLETIONS, data.model, body, data.stream)
    if job is not None:
        return job
    call = partial(state.completions.completions, caller, data)
    return await _idempotent(request, state.idempotency, caller, body, data.stream, call)


@post("/v1/inference", dependencies=INFERENCE_CALLER, status_code=200, security=BEARER, responses=INFERENCE_RESPONSES)
async def inference(request: Request[Any, Any, Any], caller: Caller, data: CloudInferenceRequest) -> Response[Any]:
    """Generic inference: prompts for an LLM, rows of numbers for a tensor model (concurrent calls batch)."""
    state = typed_state(request.app.state, CloudState)
    body = _dumper(data)
    job = await state.job_intake.submit_if_async(request, caller, INFERENCE, data.model_id, body, False)
    if job is not None:
        return job
    if state.tensors.serves(data.model_id):  # metered, limited and budgeted like an LLM call; Idempotency-Key too
        call = partial(state.tensors.inference, caller, data)
        return await _idempotent(request, state.idempotency, caller, body, False, call)
    if data.model_id not in state.pool.engines:
        if split_model(data.model_id)[0] in state.pool.registry:
            state.pool.get(data.model_id)  # 503 for a registry version loading or failed to load, 404 for no such
        raise unknown_model(data.model_id)
    return respond(caller, await state.completions.inference(caller, data))


def create_app(db: Engine | None = None, zoo_root: Path | None = None) -> Litestar:
    core = CoreSettings()
    settings = CloudSettings()
    root = zoo_root or core.zoo_dir / settings.zoo_preset
    db = db or get_db()
    observed = Metrics()
    verifier = (
        JwtVerifier.from_files(
            settings.jwt_issuer,
            settings.jwt_tenant_claim,
            settings.jwt_audience,
            settings.jwt_public_key_file,
            settings.jwt_jwks_file,
            verify_audience=settings.jwt_verify_audience,
        )
        if settings.jwt_issuer
        else None
    )
    catalog = load_catalog(root)
    idempotency = IdempotencyStore(db, settings.idempotency_lease(), CloudIds.from_keys_dir(core.keys_dir))
    auth_cache = AuthCache(settings.auth_cache_s)
    releases = ReleaseStore(db, store_from_settings())  # shared by every replica: database + artifact store
    jobs = JobStore(db)
    webhooks = WebhookStore(db)
    budget_alerts = BudgetAlerts(db)
    job_settings = JobSettings()

    @asynccontextmanager
    async def start() -> AsyncIterator[CloudState]:
        usage = UsageWriter(
            db,
            settings.usage_flush_ms / 1000,
            checkpoint_tokens=settings.usage_checkpoint_tokens,
            checkpoint_ms=settings.usage_checkpoint_ms,
            pool_size=DatabaseSettings().database_pool_size,
            durable=settings.usage_write_through,
        )
        usage.on_conflicts = observed.usage_id_conflicts.labels("cloud").inc
        await usage.start()
        try:  # a schema still behind is reported by /readyz, not a failed start
            await asyncio.to_thread(releases.import_legacy, core.data_dir / LEGACY_DIR)
        except Exception:
            logging.getLogger(__name__).exception("importing the edge releases on this host's disk failed")
        pool = EnginePool.from_zoo(root, settings)
        signing_public = public_path(core.signing_key_path)
        tensors = TensorPool.from_zoo(
            root,
            settings.num_threads,
            BatchSettings(
                settings.tensor_max_batch_size, settings.tensor_max_queue_delay_ms, settings.tensor_max_queue_size
            ),
            memory_budget_bytes=settings.tensor_memory_mb << 20,
            cache_dir=core.data_dir / TENSOR_CACHE_DIR,
            store=store_from_settings() if is_enabled(settings.registry_models) else None,
            trusted_keys=[load_public_key(signing_public)] if signing_public.is_file() else [],
        )
        await tensors.start()
        observed.registry.register(tensors.collector())
        observed.watch(pool)
        pool.supervise()
        limiter = RateLimiter(settings, core.redis_url)
        prices = PriceBook(db)
        await prices.start()  # the edge gateway rates synced usage with the same book
        sweeper = ReservationSweeper(db, settings.budget_sweep_interval_s, prices)
        await sweeper.start()
        canary = CanaryRouter(db, settings.canary_refresh_s)
        registry = None
        if is_enabled(settings.registry_models):  # loaded in the refresh's worker thread, at start-up and later
            registry = RegistryModels(db, pool, settings, store_from_settings(), core.data_dir / CACHE_DIR)
            canary.listeners.append(registry.sync)
            tensors.canary = canary
            canary.listeners.append(TensorRegistry(db, tensors, parse_names(settings.registry_models)).sync)
        completions = CompletionService(
            pool,
            usage,
            limiter,
            settings.request_timeout_s,
            observed,
            prices=prices,
            alerts=budget_alerts,
            budget_lease_s=settings.request_timeout_s + settings.budget_lease_margin_s,
            canary=canary,
            max_prompt_bytes=settings.prompt_byte_limit(),
        )
        tensors.service = completions  # tensor calls bill through the same reserve → settle
        backends = None
        if settings.backends is not None or registry is not None:  # upstream servers answer them, billed here
            backends = (
                Backends.from_file(settings.backends, completions, settings.request_timeout_s, set(pool.engines))
                if settings.backends is not None
                else Backends({}, completions, settings.request_timeout_s)
            )
            completions.remote = backends
            observed.registry.register(backends.collector)
            await backends.start()
            if registry is not None:  # registry versions with a serving spec
                registry.backends = backends
        await canary.start()  # its first refresh loads the registry versions routing needs
        # Start-up made ~280k objects (torch, transformers, the app) that live as long as the process; a full
        # collection walked them all in ~125 ms, a stall every few seconds under load (p99 latency 270 → 147 ms
        # at 64 streams with them frozen out of the collector's reach).
        gc.collect()
        gc.freeze()
        try:
            async with running_jobs(jobs, webhooks, job_settings, db, completions, tensors, usage) as worker:
                budget_alerts.notify = worker.dispatcher.notify
                yield CloudState(
                    db=db,
                    completions=completions,
                    pool=pool,
                    tensors=tensors,
                    catalog=catalog,
                    observed=observed,
                    idempotency=idempotency,
                    jwt=verifier,
                    auth_cache=auth_cache,
                    jobs=jobs,
                    job_intake=JobIntake(
                        jobs,
                        worker,
                        webhooks,
                        job_settings,
                        pool,
                        tensors,
                        limiter,
                        idempotency.ids,
                        backends.serves if backends is not None else None,
                    ),
                    webhooks=webhooks,
                    job_settings=job_settings,
                    releases=releases,
                    edge=EdgeGateway(
                        db,
                        prices,
                        releases,
                        budget_alerts,
                        settings.edge_sync_interval_s,
                        observed.count_edge_sync,
                        UsageWindow(
                            max_future=timedelta(seconds=settings.edge_usage_max_future_s),
                            max_age=timedelta(days=settings.edge_usage_max_age_days),
                            enrollment_margin=timedelta(seconds=settings.edge_usage_enrollment_margin_s),
                        ),
                        ShadowIntake(
                            db,
                            prices,
                            limiter,
                            settings.edge_shadow_share,
                            settings.edge_shadow_rows_per_minute,
                            settings.edge_shadow_tokens_per_minute,
                            share_window_s=settings.edge_shadow_share_window_s,
                            share_floor=settings.edge_shadow_share_floor,
                        ),
                        bounds=UsageBounds(
                            default_context=settings.edge_usage_default_context,
                            max_sequences=settings.edge_usage_max_sequences,
                            max_tokens_per_s=settings.edge_usage_max_tokens_per_s,
                            burst_tokens=settings.edge_usage_burst_tokens,
                            contexts=_zoo_contexts(root),
                        ),
                    ),
                )
        finally:
            if backends is not None:
                await backends.close()
            await canary.close()
            await sweeper.close()
            await prices.close()
            await tensors.close()
            await pool.close()
            pool.shutdown()
            await usage.close()
            await limiter.close()

    return create_service_app(
        route_handlers=[
            readyz,
            render_metrics,
            list_models,
            get_model,
            chat_completions,
            completions,
            inference,
            responses_route(INFERENCE_CALLER, CloudState, _idempotent),
            Router("/", route_handlers=[*JOB_ROUTES, *TENANT_ROUTES], dependencies=CALLER, security=BEARER),
            *EDGE_ROUTES,
            *ARTIFACT_ROUTES,
        ],
        start=start,
        state_type=CloudState,
        on_response=observed.count_response,
        signature_namespace={"CompletionService": CompletionService},  # named only for type checking there
        request_max_body_size=settings.max_body_bytes,
        request_class=BoundedRequest,
        openapi_config=OpenAPIConfig(
            title="tierline cloud API",
            version="1",
            components=Components(
                security_schemes={
                    "BearerAuth": SecurityScheme(type="http", scheme="bearer", description="tl- API key or JWT"),
                    "DeviceAuth": SecurityScheme(
                        type="http", scheme="bearer", description="tld- device credential from /v1/edge/enroll"
                    ),
                }
            ),
        ),
    )

"""The agent's local HTTP API: OpenAI-compatible routes on verified local models (each verified before it loads)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeAlias

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from litestar import Litestar, Request, Response, get, post
from litestar.di import Provide
from litestar.params import SkipValidation

from edge_agent.agent import Agent, AgentStats
from edge_agent.allowance import AllowanceGuard
from edge_agent.cloud_link import CREDENTIALS_FILE, CircuitBreaker, CloudLink, Credentials
from edge_agent.model_store import ModelStore
from edge_agent.models import PREFIX, ServedModels
from edge_agent.outbox import Outbox
from edge_agent.policies import PAIRINGS_FILE, PairingBook, PolicyBook
from edge_agent.responses_route import responses_route
from edge_agent.settings import EdgeSettings, policy_dir, state_dir
from edge_agent.shadow_sampler import ShadowSampler
from edge_agent.tiering import Answer, Tiering, family
from edge_agent.updater import HealthWatch, Updater
from shared.artifacts import load_public_key, public_path
from shared.edge_protocol import MAX_USAGE_SUBJECT, Allowance, DesiredModel
from shared.errors import AuthenticationError, ConfigurationError, NotFoundError
from shared.http import EventStream
from shared.openai_schema import ChatCompletionRequest, CompletionRequest, InferenceRequest
from shared.request_body import BoundedRequest
from shared.service_app import create_service_app
from shared.settings import CoreSettings

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class EdgeState:
    """What the agent's handlers use, built once at start-up; each field is a dependency of the same name."""

    served: ServedModels
    api_key: str | None
    agent: Agent
    tiering: Tiering


def _local_key_guard(api_key: str | None, request: Request[Any, Any, Any]) -> None:
    if api_key is None:
        return
    scheme, _, secret = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(secret.strip().encode(), api_key.encode()):
        raise AuthenticationError("missing or wrong local API key")


LOCAL_AUTH = {"_auth": Provide(_local_key_guard, sync_to_thread=False)}
# Passed to handlers as is: a dataclass holding a lock, which Litestar's signature model (msgspec) cannot describe.
TieringDependency: TypeAlias = SkipValidation[Tiering]


@get("/readyz", sync_to_thread=False, include_in_schema=False)
def readyz(served: ServedModels) -> dict[str, Any]:
    return {"status": "ready", "models": len(served.models)}


@get("/v1/models", dependencies=LOCAL_AUTH, sync_to_thread=False)
def list_models(served: ServedModels, _auth: None) -> dict[str, Any]:
    return {"object": "list", "data": _models(served), "not_served": served.not_served()}


@get("/v1/models/{model_id:path}", dependencies=LOCAL_AUTH, sync_to_thread=False)
def retrieve_model(served: ServedModels, _auth: None, model_id: str) -> dict[str, Any]:
    """One model the agent serves (OpenAI's ``models.retrieve``); 404 naming it otherwise."""
    wanted = model_id.lstrip("/")
    found = next((m for m in _models(served) if m["id"] == wanted), None)
    if found is None:
        raise NotFoundError(
            f"The model '{wanted}' does not exist or is not served here", param="model", code="model_not_found"
        )
    return found


def _models(served: ServedModels) -> list[dict[str, Any]]:
    return [
        {
            "id": m.id,
            "object": "model",
            "created": 0,
            "owned_by": "tierline-edge",
            "format": m.format,
            "sha256": m.sha256,
            "version": m.version,
        }
        for m in served.models.values()
        if served.lms.has(m.id) or m.id in served.classifiers
    ] + [
        {
            "id": alias,
            "object": "model",
            "created": 0,
            "owned_by": "tierline-edge",
            "format": served.served_format(alias),
            **({"runtime_guard": served.guards[alias].as_json()} if alias in served.guards else {}),
        }
        for alias, model_id in served.aliases.items()
    ]


class EdgeChatRequest(ChatCompletionRequest):
    """A chat request as a device takes it: its end user id fits the device's usage records."""

    max_end_user_len: ClassVar[int] = MAX_USAGE_SUBJECT


class EdgeCompletionRequest(CompletionRequest):
    """A completions request as a device takes it: its end user id fits the device's usage records."""

    max_end_user_len: ClassVar[int] = MAX_USAGE_SUBJECT


def _end_users(agent: Agent) -> dict[str, Any] | None:
    """The cloud's rule for the end users this device's requests may name, as its last sync said (None: unknown)."""
    rule = agent.last_sync.config.get("end_users") if agent.last_sync is not None else None
    return rule if isinstance(rule, dict) else None


def _respond(answer: Answer) -> Response[Any]:
    if isinstance(answer.body, dict):
        return Response(answer.body, status_code=answer.status_code, headers=answer.headers)
    headers = {**answer.headers, "Cache-Control": "no-cache"}
    return EventStream(answer.body, media_type="text/event-stream", headers=headers)


@post("/v1/chat/completions", dependencies=LOCAL_AUTH, status_code=200)
async def chat_completions(
    request: Request[Any, Any, Any], tiering: TieringDependency, _auth: None, data: EdgeChatRequest
) -> Response[Any]:
    """OpenAI chat completions: answered on the device or escalated (``x-tierline-tier`` says which)."""
    subject = request.headers.get("x-tierline-subject")
    return _respond(await tiering.handle("chat.completions", data, request.headers.get("x-tierline-tier"), subject))


@post("/v1/completions", dependencies=LOCAL_AUTH, status_code=200)
async def completions(
    request: Request[Any, Any, Any], tiering: TieringDependency, _auth: None, data: EdgeCompletionRequest
) -> Response[Any]:
    """OpenAI completions: answered on the device or escalated (``x-tierline-tier`` says which)."""
    subject = request.headers.get("x-tierline-subject")
    return _respond(await tiering.handle("completions", data, request.headers.get("x-tierline-tier"), subject))


@post("/v1/inference", dependencies=LOCAL_AUTH, status_code=200)
async def inference(
    request: Request[Any, Any, Any], tiering: TieringDependency, _auth: None, data: InferenceRequest
) -> Response[Any]:
    """Rows of numbers for a tensor model; low-confidence rows are escalated (``tiers`` says per row)."""
    return _respond(await tiering.infer(data, request.headers.get("x-tierline-tier")))


@get("/metrics", sync_to_thread=True, include_in_schema=False)
def metrics(agent: Agent) -> Response[str]:
    """Prometheus exposition: requests per model version and outcome, degraded answers, outbox depth."""
    link = agent.link
    text = agent.stats.prometheus(agent.outbox.stats(), link.breaker.state if link is not None else None)
    return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


@get("/v1/agent", dependencies=LOCAL_AUTH, sync_to_thread=True)
def agent_status(agent: Agent, tiering: TieringDependency, served: ServedModels, _auth: None) -> dict[str, Any]:
    """The agent's own state: enrollment, cloud link, outbox, per-version stats."""
    link = agent.link
    return {
        "pid": os.getpid(),
        "enrolled": link is not None,
        "device_id": link.creds.device_id if link is not None else None,
        "cloud_breaker": link.breaker.state if link is not None else None,
        "outbox": agent.outbox.stats(),
        "synced_records": agent.synced_records,
        "policies": agent.policy_sources(),
        "shadow": tiering.shadow.as_json() if tiering.shadow is not None else None,
        "allowance": tiering.allowance.allowance.model_dump(mode="json") if tiering.allowance.allowance else None,
        "models": agent.stats.snapshot(),
        "not_served": served.not_served(),
        "pairings": {model: p.model_dump(exclude={"model"}) for model, p in sorted(tiering.pairings.items())},
    }


def _cloud_version(sources: dict[str, str], model: str) -> int | None:
    """The cloud's policy version that runs for ``model`` (by id, else by family); None for an override or the
    default (no calibration to check)."""
    value = sources.get(model) or sources.get(family(model))
    return int(value) if value and value.isascii() and value.isdigit() else None


def create_app(settings: EdgeSettings) -> Litestar:
    core = CoreSettings()
    zoo_root = settings.zoo_dir or core.zoo_dir / "demo"
    home = state_dir(settings)
    creds = Credentials.load(home)
    key_files = settings.trusted_keys or [public_path(core.signing_key_path)]
    if creds is not None:
        key_files = [*key_files, *creds.key_files(home)]
    keys = [load_public_key(p) for p in key_files if p.is_file()]
    if not keys:
        raise ConfigurationError(f"none of the trusted public keys exists: {', '.join(map(str, key_files))}")
    store = ModelStore(home)
    served = ServedModels(zoo_root, store, keys, settings.num_threads, settings.min_runtime_agreement)
    logger.info("edge agent serving %d verified model(s) from %s and %s", len(served.models), zoo_root, home)
    api_key = settings.api_key.get_secret_value() if settings.api_key else None

    @asynccontextmanager
    async def start() -> AsyncIterator[EdgeState]:
        outbox = Outbox(home / "outbox.sqlite3", settings.outbox_max_bytes)
        agent = Agent(outbox, AgentStats(served.versions()), None, 30.0)
        guard = AllowanceGuard(settings.on_quota_exhausted)
        agent.on_allowance = guard.update  # and the shadow sampler, below
        agent.serving = served.serving
        tiering = Tiering(
            served.lms,
            None,
            {},
            agent.record,
            served.classifiers,
            families=served.families,
            aliases=served.aliases,
            allowance=guard,
        )
        pairings = PairingBook(home / PAIRINGS_FILE, tiering, settings.cloud_pairs)
        agent.on_pairings = pairings.apply
        book = PolicyBook(policy_dir(settings), [*served.ids(), *served.aliases], keys, tiering, agent.event)
        agent.on_policies = book.apply
        agent.policy_sources = book.sources
        sampler = ShadowSampler(
            lambda: tiering.link,
            lambda: float(agent.last_sync.config.get("shadow_share", 0.0)) if agent.last_sync is not None else 0.0,
            lambda model: _cloud_version(book.sources(), model),
        )
        tiering.shadow = sampler
        tiering.end_users = lambda: _end_users(agent)

        def on_allowance(allowance: Allowance | None) -> None:  # a sync with budget left ends a shadow pause
            guard.update(allowance)
            sampler.on_allowance(allowance)

        agent.on_allowance = on_allowance
        await sampler.start()
        enrollment = Enrollment(home, settings, served, agent, tiering, keys)
        if creds is not None:
            enrollment.connect(creds)
        watching = asyncio.create_task(enrollment.watch(), name="edge-enrollment")
        try:
            yield EdgeState(served=served, api_key=api_key, agent=agent, tiering=tiering)
        finally:
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching
            await sampler.close()
            await enrollment.close(drain_s=settings.shutdown_sync_s)
            outbox.close()

    return create_service_app(
        route_handlers=[
            readyz,
            metrics,
            agent_status,
            list_models,
            retrieve_model,
            chat_completions,
            completions,
            inference,
            responses_route(LOCAL_AUTH, EdgeChatRequest),
        ],
        start=start,
        state_type=EdgeState,
        request_class=BoundedRequest,
    )


class Enrollment:
    """The agent's cloud connection, following its credentials file: ``tierline edge enroll`` run while the agent
    is up takes effect within ``enrollment_poll_s`` (the link, the sync loop and the updates start, or are
    replaced by the new device's), with no restart."""

    def __init__(
        self,
        home: Path,
        settings: EdgeSettings,
        served: ServedModels,
        agent: Agent,
        tiering: Tiering,
        keys: list[Ed25519PublicKey],
    ) -> None:
        self.home = home
        self.settings = settings
        self.served = served
        self.agent = agent
        self.tiering = tiering
        self.keys = keys
        self.creds: Credentials | None = None
        self.updates: Updates | None = None
        self.syncing: asyncio.Task[None] | None = None
        self.seen = self._fingerprint()

    def _fingerprint(self) -> tuple[int, int, int] | None:
        try:
            st = (self.home / CREDENTIALS_FILE).stat()
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def connect(self, creds: Credentials) -> None:
        """Start the link, the sync loop and the updates for ``creds`` (called on the event loop)."""
        settings = self.settings
        link = CloudLink(
            creds, deadline_s=settings.cloud_deadline_s, breaker=CircuitBreaker(3, settings.breaker_reset_s)
        )
        for path in creds.key_files(self.home):
            if path.is_file():
                key = load_public_key(path)
                if all(key.public_bytes_raw() != k.public_bytes_raw() for k in self.keys):
                    self.keys.append(key)
        self.creds = creds
        self.agent.link = link
        self.agent.interval_s = creds.sync_interval_s
        self.tiering.link = link
        self.updates = Updates(self.served, self.agent, settings, creds, self.keys, self.home)
        self.syncing = asyncio.create_task(self.agent.run(), name="edge-sync")

    async def disconnect(self, drain_s: float = 0.0) -> None:
        """Stop the sync loop and the updates; a last sync of up to ``drain_s``; close the link."""
        if self.syncing is not None:
            self.syncing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.syncing
            self.syncing = None
        if self.updates is not None:
            await self.updates.close()
            self.updates = None
        link = self.agent.link
        if link is not None and drain_s > 0:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.agent.drain(), drain_s)
        self.agent.link = None
        self.tiering.link = None
        if link is not None:
            await link.aclose()

    async def check(self) -> bool:
        """Reconnect when the credentials file changed to another device's; True when it did."""
        seen = self._fingerprint()
        if seen == self.seen:
            return False
        self.seen = seen
        try:
            creds = await asyncio.to_thread(Credentials.load, self.home)
        except ConfigurationError as exc:
            logger.warning("ignoring the new device credentials: %s", exc.message)
            return False
        if creds is None or creds == self.creds:
            return False
        await self.disconnect()
        self.connect(creds)
        logger.info(
            "enrolled as device %s of tenant %s: syncing with %s", creds.device_id, creds.tenant, creds.cloud_url
        )
        return True

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(self.settings.enrollment_poll_s)
            try:
                await self.check()
            except Exception:
                logger.exception("could not apply the new device credentials")

    async def close(self, drain_s: float) -> None:
        await self.disconnect(drain_s)


class Updates:
    """Applies the desired versions the sync brings, one model after another, and swaps what installs; the
    health watch rolls a new version back when its error rate in its first minutes crosses the bound."""

    def __init__(
        self,
        served: ServedModels,
        agent: Agent,
        settings: EdgeSettings,
        creds: Credentials,
        keys: list[Ed25519PublicKey],
        home: Path,
    ) -> None:
        self.served = served
        self.agent = agent
        self.client = httpx.Client(
            base_url=creds.cloud_url,
            headers={"Authorization": f"Bearer {creds.device_token}"},
            timeout=httpx.Timeout(30.0, connect=5.0),
        )
        self.updater = Updater(
            self.client,
            served.store,
            home / "staging",
            keys,
            settings.max_artifact_bytes,
            agent.event,
            num_threads=settings.num_threads,
            max_bytes_per_s=settings.update_max_bytes_per_s,
            block_s=settings.rollback_block_s,
        )
        self.health = HealthWatch(
            served.store,
            agent.event,
            window_s=settings.rollback_window_s,
            max_error_rate=settings.rollback_max_error_rate,
            min_requests=settings.rollback_min_requests,
        )
        self.task: asyncio.Task[None] | None = None
        agent.on_desired = self.desired
        agent.on_outcome = self.outcome

    def desired(self, desired: list[DesiredModel]) -> None:
        """Every model the cloud desires is installed (the updater refuses an unsafe name, and does not download
        an artifact whose runtime this device lacks: ``not_served`` says why)."""
        if self.task is not None and not self.task.done():
            return  # one pass at a time; the next sync brings the list again
        self.task = asyncio.create_task(self._apply(desired), name="edge-updates")

    async def _apply(self, desired: list[DesiredModel]) -> None:
        for d in desired:
            outcome = await asyncio.to_thread(self.updater.apply, d)
            if outcome == "installed":
                await self._swap(d.name)
            elif outcome in ("rejected", "unrunnable") and d.name in self.updater.reasons:
                self.served.reject(d.name, self.updater.reasons[d.name])

    async def _swap(self, name: str) -> None:
        model = await asyncio.to_thread(self.served.swap, name)
        if model is not None:
            self.agent.stats.versions.update(self.served.versions())

    def outcome(self, model_id: str, version: str | None, ok: bool) -> None:
        name = model_id.removeprefix(PREFIX)
        if version is not None and self.health.record(name, version, ok):
            asyncio.get_running_loop().create_task(self._swap(name))

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        self.client.close()

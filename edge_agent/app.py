"""The agent's local HTTP API: OpenAI-compatible routes on verified local models (each verified before it loads)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from litestar import Litestar, Request, Response, get, post
from litestar.datastructures import State
from litestar.di import Provide
from litestar.response import Stream

from edge_agent import int8_guard, serving
from edge_agent.agent import Agent, AgentStats
from edge_agent.cloud_link import CircuitBreaker, CloudLink, Credentials
from edge_agent.outbox import Outbox
from edge_agent.settings import EdgeSettings, policy_dir, state_dir
from edge_agent.tensors import LocalClassifier
from edge_agent.tiering import Answer, Tiering, family
from shared.artifacts import load_public_key, public_path, verify_files, verify_signature
from shared.errors import ArtifactVerificationError, AuthenticationError, ConfigurationError
from shared.escalation import EdgePolicy, load_policy
from shared.http import EXCEPTION_HANDLERS, healthz
from shared.openai_schema import ChatCompletionRequest, CompletionRequest, InferenceRequest
from shared.settings import CoreSettings
from shared.zoo.registry import ZooLayout

logger = logging.getLogger(__name__)

EDGE_ARTIFACTS = ("lm-edge-onnx-int8", "lm-edge-onnx", "lm-edge-tflite", "digits-small")
EDGE_LM, EDGE_LM_INT8, EDGE_LM_FP32 = "tierline/lm-edge", "tierline/lm-edge-onnx-int8", "tierline/lm-edge-onnx"


@dataclass(frozen=True, slots=True)
class LocalModel:
    id: str
    format: str
    sha256: str
    path: Path
    version: str
    kind: str


def verified_local_models(zoo_root: Path, trusted_key_files: list[Path]) -> list[LocalModel]:
    """Every edge artifact under ``zoo_root`` whose signature and hashes check out; others are refused."""
    if not trusted_key_files:
        raise ConfigurationError("no trusted public key configured (TIERLINE_EDGE_TRUSTED_KEYS)")
    keys = [load_public_key(p) for p in trusted_key_files if p.is_file()]
    if not keys:
        raise ConfigurationError(f"none of the trusted public keys exists: {', '.join(map(str, trusted_key_files))}")
    layout = ZooLayout(zoo_root)
    models = []
    for name in EDGE_ARTIFACTS:
        if not layout.manifest_path(name).is_file():
            continue
        try:
            manifest = layout.manifest(name)
            verify_signature(manifest, keys)
            verify_files(manifest, layout.artifact_dir(name))
        except ArtifactVerificationError as exc:
            logger.error("refusing artifact %s: %s", name, exc.message)
            continue
        path = layout.artifact_dir(name)
        model_id = f"tierline/{name}"
        models.append(LocalModel(model_id, manifest.format, manifest.sha256, path, manifest.version, manifest.kind))
    return models


def _local_key_guard(state: State, request: Request[Any, Any, Any]) -> None:
    expected = state.api_key
    if expected is None:
        return
    scheme, _, secret = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or secret.strip() != expected:
        raise AuthenticationError("missing or wrong local API key")


@get("/readyz", sync_to_thread=False, include_in_schema=False)
def readyz(state: State) -> dict[str, Any]:
    return {"status": "ready", "models": len(state.models)}


@get("/v1/models", dependencies={"_auth": Provide(_local_key_guard, sync_to_thread=False)}, sync_to_thread=False)
def list_models(state: State, _auth: None) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": m.id,
                "object": "model",
                "created": 0,
                "owned_by": "tierline-edge",
                "format": m.format,
                "sha256": m.sha256,
            }
            for m in state.models
        ]
        + [
            {
                "id": alias,
                "object": "model",
                "created": 0,
                "owned_by": "tierline-edge",
                "format": choice.chosen,
                "int8_guard": choice.as_json(),
            }
            for alias, choice in state.guards.items()
        ],
    }


LOCAL_AUTH = {"_auth": Provide(_local_key_guard, sync_to_thread=False)}


def _respond(answer: Answer) -> Response[Any]:
    if isinstance(answer.body, dict):
        return Response(answer.body, status_code=answer.status_code, headers=answer.headers)
    headers = {**answer.headers, "Cache-Control": "no-cache"}
    return Stream(answer.body, media_type="text/event-stream", headers=headers)


@post("/v1/chat/completions", dependencies=LOCAL_AUTH, status_code=200)
async def chat_completions(
    request: Request[Any, Any, Any], state: State, _auth: None, data: ChatCompletionRequest
) -> Response[Any]:
    """OpenAI chat completions: answered on the device or escalated (``x-tierline-tier`` says which)."""
    return _respond(await state.tiering.handle("chat.completions", data, request.headers.get("x-tierline-tier")))


@post("/v1/completions", dependencies=LOCAL_AUTH, status_code=200)
async def completions(
    request: Request[Any, Any, Any], state: State, _auth: None, data: CompletionRequest
) -> Response[Any]:
    """OpenAI completions: answered on the device or escalated (``x-tierline-tier`` says which)."""
    return _respond(await state.tiering.handle("completions", data, request.headers.get("x-tierline-tier")))


@post("/v1/inference", dependencies=LOCAL_AUTH, status_code=200)
async def inference(
    request: Request[Any, Any, Any], state: State, _auth: None, data: InferenceRequest
) -> Response[Any]:
    """Rows of numbers for a tensor model; low-confidence rows are escalated (``tiers`` says per row)."""
    return _respond(await state.tiering.infer(data, request.headers.get("x-tierline-tier")))


@get("/metrics", sync_to_thread=True, include_in_schema=False)
def metrics(state: State) -> Response[str]:
    """Prometheus exposition: requests per model version and outcome, degraded answers, outbox depth."""
    agent: Agent = state.agent
    link: CloudLink | None = state.link
    text = agent.stats.prometheus(agent.outbox.stats(), link.breaker.state if link is not None else None)
    return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


@get("/v1/agent", dependencies=LOCAL_AUTH, sync_to_thread=True)
def agent_status(state: State, _auth: None) -> dict[str, Any]:
    """The agent's own state: enrollment, cloud link, outbox, per-version stats."""
    agent: Agent = state.agent
    link: CloudLink | None = state.link
    return {
        "enrolled": link is not None,
        "device_id": link.creds.device_id if link is not None else None,
        "cloud_breaker": link.breaker.state if link is not None else None,
        "outbox": agent.outbox.stats(),
        "synced_records": agent.synced_records,
        "models": agent.stats.snapshot(),
    }


def create_app(settings: EdgeSettings) -> Litestar:
    core = CoreSettings()
    zoo_root = settings.zoo_dir or core.zoo_dir / "demo"
    creds = Credentials.load(state_dir(settings))
    key_files = settings.trusted_keys or [public_path(core.signing_key_path)]
    if creds is not None:
        key_files = [*key_files, *creds.key_files(state_dir(settings))]
    models = verified_local_models(zoo_root, key_files)
    logger.info("edge agent serving %d verified model(s) from %s", len(models), zoo_root)
    api_key = settings.api_key.get_secret_value() if settings.api_key else None
    paths = {m.id: m.path for m in models if m.kind == "causal-lm" and m.format in serving.LM_FORMATS}
    classifiers = {
        m.id: LocalClassifier.load(m.id, m.path, settings.num_threads)
        for m in models
        if m.kind == "tensor" and m.format == "onnx"
    }
    guards: dict[str, int8_guard.Int8Choice] = {}
    int8, fp32 = paths.get(EDGE_LM_INT8), paths.get(EDGE_LM_FP32)
    if int8 is not None and fp32 is not None:
        choice = int8_guard.choose(int8, fp32, settings.num_threads)
        guards[EDGE_LM] = choice
        paths[EDGE_LM] = int8 if choice.chosen == "onnx-int8" else fp32
        logger.info(
            "INT8 guard: serving %s as %s (%.3f ms/token INT8, %.3f fp32)",
            EDGE_LM,
            choice.chosen,
            choice.int8_ms_per_token,
            choice.fp32_ms_per_token,
        )
    local = serving.LocalModels(paths, settings.num_threads)
    versions = {m.id: m.version for m in models}
    if EDGE_LM in guards:
        versions[EDGE_LM] = versions[EDGE_LM_INT8 if guards[EDGE_LM].chosen == "onnx-int8" else EDGE_LM_FP32]
    policies = _policies(policy_dir(settings), [*paths, *guards, *classifiers])
    home = state_dir(settings)

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        link = (
            CloudLink(creds, deadline_s=settings.cloud_deadline_s, breaker=CircuitBreaker(3, settings.breaker_reset_s))
            if creds is not None
            else None
        )
        outbox = Outbox(home / "outbox.sqlite3", settings.outbox_max_bytes)
        agent = Agent(outbox, AgentStats(versions), link, creds.sync_interval_s if creds else 30.0)
        app.state.agent = agent
        app.state.link = link
        app.state.tiering = Tiering(local, link, policies, agent.record, classifiers)
        syncing = asyncio.create_task(agent.run(), name="edge-sync") if link is not None else None
        try:
            yield
        finally:
            if syncing is not None:
                syncing.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await syncing
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(agent.drain(), settings.shutdown_sync_s)
            if link is not None:
                await link.aclose()
            outbox.close()

    return Litestar(
        route_handlers=[
            healthz,
            readyz,
            metrics,
            agent_status,
            list_models,
            chat_completions,
            completions,
            inference,
        ],
        exception_handlers=EXCEPTION_HANDLERS,
        state=State({"models": models, "api_key": api_key, "local": local, "guards": guards}),
        lifespan=[lifespan],
    )


def _policies(directory: Path, model_ids: list[str]) -> dict[str, EdgePolicy]:
    """Calibrated policies (``tierline edge calibrate``), by model id and by model family."""
    found: dict[str, EdgePolicy] = {}
    for model_id in {*model_ids, *(family(m) for m in model_ids)}:
        policy = load_policy(directory, model_id)
        if policy is not None:
            found[model_id] = policy
            logger.info("escalation policy for %s: %s < %s escalates", model_id, policy.signal, policy.threshold)
    return found

"""The agent's local HTTP API: OpenAI-compatible routes on verified local models (each verified before it loads)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from litestar import Litestar, Request, Response, get, post
from litestar.datastructures import State
from litestar.di import Provide
from litestar.response import Stream

from edge_agent import int8_guard, serving
from edge_agent.settings import EdgeSettings
from shared.artifacts import load_public_key, public_path, verify_files, verify_signature
from shared.errors import ArtifactVerificationError, AuthenticationError, ConfigurationError
from shared.http import EXCEPTION_HANDLERS, healthz
from shared.openai_schema import ChatCompletionRequest, CompletionRequest
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


def verified_local_models(zoo_root: Path, trusted_key_files: list[Path]) -> list[LocalModel]:
    """Every edge artifact under ``zoo_root`` whose signature and hashes check out; others are refused."""
    if not trusted_key_files:
        raise ConfigurationError("no trusted public key configured (TIERLINE_EDGE_TRUSTED_KEYS)")
    keys = [load_public_key(p) for p in trusted_key_files]
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
        models.append(LocalModel(f"tierline/{name}", manifest.format, manifest.sha256, layout.artifact_dir(name)))
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
EDGE_HEADERS = {"x-tierline-tier": "edge"}


def _respond(result: dict[str, Any] | AsyncIterator[bytes]) -> Response[Any]:
    if isinstance(result, dict):
        return Response(result, headers=EDGE_HEADERS)
    return Stream(result, media_type="text/event-stream", headers={**EDGE_HEADERS, "Cache-Control": "no-cache"})


@post("/v1/chat/completions", dependencies=LOCAL_AUTH, status_code=200)
async def chat_completions(state: State, _auth: None, data: ChatCompletionRequest) -> Response[Any]:
    """OpenAI chat completions on a local model."""
    return _respond(await serving.chat(state.local, data))


@post("/v1/completions", dependencies=LOCAL_AUTH, status_code=200)
async def completions(state: State, _auth: None, data: CompletionRequest) -> Response[Any]:
    """OpenAI completions on a local model."""
    return _respond(await serving.complete(state.local, data))


def create_app(settings: EdgeSettings) -> Litestar:
    core = CoreSettings()
    zoo_root = settings.zoo_dir or core.zoo_dir / "demo"
    key_files = settings.trusted_keys or [public_path(core.signing_key_path)]
    models = verified_local_models(zoo_root, key_files)
    logger.info("edge agent serving %d verified model(s) from %s", len(models), zoo_root)
    api_key = settings.api_key.get_secret_value() if settings.api_key else None
    paths = {m.id: m.path for m in models if m.format in serving.LM_FORMATS}
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
    return Litestar(
        route_handlers=[healthz, readyz, list_models, chat_completions, completions],
        exception_handlers=EXCEPTION_HANDLERS,
        state=State({"models": models, "api_key": api_key, "local": local, "guards": guards}),
    )

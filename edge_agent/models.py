"""The models a device serves: the built zoo's edge artifacts, overlaid by versions the updater installed.

Every artifact is verified (Ed25519 signature against the pinned keys, sha256 of every file) at start-up and
on every swap, and an LM's files are hashed again against the verified manifest when it is loaded on first
use. ``tierline/lm-edge`` names the runtime and format the runtime guard chose among those the device has
(``edge_agent.runtime_guard``: ONNX fp32/INT8, LiteRT, llama.cpp on GGUF Q8_0/f32): the fastest that gives the
fp32 ONNX reference's greedy answers. A swap loads the new version first and then switches the model id to it
under a lock: requests in flight keep the runtime object they started with and finish on the old version; no
request waits for a load or fails because of the swap. An artifact whose runtime is not installed here is
not served.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from edge_agent import runtime_guard, serving
from edge_agent.generation import LocalLM
from edge_agent.model_store import ModelStore
from edge_agent.runtime import FORMAT_RUNTIMES, CausalLMRuntime, can_run, gguf, load_runtime
from edge_agent.tensors import LocalClassifier
from shared.artifacts import Manifest, verify_files, verify_signature
from shared.chat_tokenizer import ChatTokenizer
from shared.errors import ArtifactVerificationError
from shared.zoo.registry import ZooLayout

logger = logging.getLogger(__name__)

EDGE_ARTIFACTS = (
    "lm-edge-onnx-int8",
    "lm-edge-onnx",
    "lm-edge-tflite",
    "lm-edge-gguf",
    "digits-small",
    "digits-micro",
)
EDGE_LM, EDGE_LM_INT8, EDGE_LM_FP32 = "tierline/lm-edge", "tierline/lm-edge-onnx-int8", "tierline/lm-edge-onnx"
EDGE_LM_TFLITE, EDGE_LM_GGUF = "tierline/lm-edge-tflite", "tierline/lm-edge-gguf"
# A plain model id -> the artifacts that hold it, in the order of preference when nothing can be checked.
FAMILIES = {EDGE_LM: (EDGE_LM_FP32, EDGE_LM_INT8, EDGE_LM_TFLITE, EDGE_LM_GGUF)}
PREFIX = "tierline/"


@dataclass(frozen=True, slots=True)
class LocalModel:
    id: str
    format: str
    sha256: str
    path: Path
    version: str
    kind: str
    source: str  # zoo | store
    manifest: Manifest = field(compare=False, repr=False)  # the verified one: the files are checked against it

    @property
    def name(self) -> str:
        return self.id.removeprefix(PREFIX)


def _verified(name: str, manifest: Manifest, directory: Path, keys: list[Ed25519PublicKey], source: str) -> LocalModel:
    verify_signature(manifest, keys)
    verify_files(manifest, directory)
    m = manifest
    return LocalModel(PREFIX + name, m.format, m.sha256, directory, m.version, m.kind, source, m)


def zoo_models(
    zoo_root: Path, keys: list[Ed25519PublicKey], refused: dict[str, str] | None = None
) -> dict[str, LocalModel]:
    """Every edge artifact under ``zoo_root`` whose signature and hashes check out; others are refused (their
    id and the reason go into ``refused`` when given)."""
    layout = ZooLayout(zoo_root)
    found = {}
    for name in EDGE_ARTIFACTS:
        if not layout.manifest_path(name).is_file():
            continue
        try:
            found[PREFIX + name] = _verified(name, layout.manifest(name), layout.artifact_dir(name), keys, "zoo")
        except ArtifactVerificationError as exc:
            logger.error("refusing artifact %s: %s", name, exc.message)
            if refused is not None:
                refused[PREFIX + name] = exc.message
    return found


def store_model(store: ModelStore, name: str, keys: list[Ed25519PublicKey]) -> LocalModel | None:
    """The store's current version of ``name``, verified; None when there is none or it fails verification."""
    version = store.current(name)
    directory = store.current_dir(name)
    if version is None or directory is None:
        return None
    try:
        return _verified(name, store.manifest(name, version), directory, keys, "store")
    except ArtifactVerificationError as exc:
        logger.error("refusing installed %s %s: %s", name, version, exc.message)
        return None


class ServedModels:
    """What the local API serves, swappable while serving."""

    def __init__(
        self,
        zoo_root: Path,
        store: ModelStore,
        keys: list[Ed25519PublicKey],
        num_threads: int,
        min_agreement: float = runtime_guard.DEFAULT_MIN_AGREEMENT,
    ) -> None:
        self.min_agreement = min_agreement
        self.store = store
        self.keys = keys
        self.num_threads = num_threads
        self.refused: dict[str, str] = {}  # model id -> why its artifact failed verification at start-up
        self.models = zoo_models(zoo_root, keys, self.refused)
        for name in store.names():
            installed = store_model(store, name, keys)
            if installed is not None:
                self.models[installed.id] = installed
                self.refused.pop(installed.id, None)
        # An artifact whose runtime is not installed here is not served (nor listed); the guard says why.
        self.unrunnable: dict[str, str] = {}  # model id -> the runtime it needs and how to install it
        for m in list(self.models.values()):
            missing = runtime_missing(m.format)
            if missing is not None:
                logger.warning("not serving %s: %s", m.id, missing)
                self.unrunnable[m.id] = missing
                del self.models[m.id]
        self.lms = serving.LocalModels(
            {m.id: (m.path, m.manifest) for m in self.models.values() if _is_lm(m)}, num_threads
        )
        self.classifiers = {
            m.id: LocalClassifier.load(m.id, m.path, num_threads) for m in self.models.values() if _is_classifier(m)
        }
        self.guards: dict[str, runtime_guard.RuntimeChoice] = {}
        self.aliases: dict[str, str] = {}  # a plain model id -> the id of the export served under it
        self.variants: dict[str, str | None] = {}  # a plain model id -> the weight file served (GGUF), if any
        self._lock = threading.Lock()
        for alias, members in FAMILIES.items():
            self._guard(alias, members)

    def _candidates(self, members: tuple[str, ...]) -> list[runtime_guard.Candidate]:
        out: list[runtime_guard.Candidate] = []
        for model_id in members:
            m = self.models.get(model_id)
            fmt = m.format if m is not None else model_id.removeprefix(PREFIX + "lm-edge-")
            if m is not None and m.kind != "causal-lm":
                continue
            variants = gguf.variants(m.path) if m is not None and fmt == "gguf" else list(gguf.GGUF_FILES)
            for fmt_name, variant in [(f"gguf-{v}", v) for v in variants] if fmt == "gguf" else [(fmt, None)]:
                runtime = RUNTIMES.get(fmt, fmt)
                if m is None:
                    if model_id in self.unrunnable:
                        reason = self.unrunnable[model_id]
                    elif model_id in self.refused:
                        reason = f"refused: {self.refused[model_id]}"
                    else:
                        continue  # the device does not have it: not a candidate, nothing to say
                    out.append(runtime_guard.Candidate(runtime, fmt_name, unavailable=reason, model_id=model_id))
                    continue
                missing = runtime_missing(fmt)
                if missing is None and not self.lms.has(m.id):  # refused since: a load found its files changed
                    missing = "refused: its files changed after they were verified"
                load = _loader(m, self.num_threads, variant) if missing is None else None
                out.append(runtime_guard.Candidate(runtime, fmt_name, load, missing, m.id, variant))
        return out

    def _guard(self, alias: str, members: tuple[str, ...]) -> None:
        candidates = self._candidates(members)
        if not any(c.load is not None for c in candidates):
            return
        ref = self.models.get(members[0])
        encode = ChatTokenizer(ref.path).encode if ref is not None else None
        choice = runtime_guard.choose(candidates, encode=encode, min_agreement=self.min_agreement)
        served = choice.served
        if served is None or served.model_id is None:
            logger.error("runtime guard: no runtime on this device can serve %s", alias)
            return
        self.guards[alias] = choice
        self._alias(alias, self.models[served.model_id], served.variant)
        numbers = ", ".join(
            f"{c.format} {c.ms_per_token} ms/token agreement {c.agreement}"
            for c in choice.candidates
            if c.ms_per_token is not None
        )
        logger.info("runtime guard: serving %s as %s (%s)", alias, choice.chosen, numbers)

    def serving(self) -> dict[str, Any]:
        """What the runtime guard chose per model, as the sync reports it (``runtime["serving"]``)."""
        return {alias: choice.as_json() for alias, choice in self.guards.items()}

    def served_format(self, alias: str) -> str:
        """The format a plain model id is served in (``gguf-q8_0`` rather than the artifact's ``gguf``)."""
        choice = self.guards.get(alias)
        if choice is not None and choice.chosen is not None:
            return choice.chosen
        return self.models[self.aliases[alias]].format

    def _alias(self, alias: str, model: LocalModel, variant: str | None = None) -> None:
        self.aliases[alias] = model.id
        self.variants[alias] = variant
        self.lms.alias(alias, model.id, variant)

    def versions(self) -> dict[str, str]:
        out = {m.id: m.version for m in self.models.values()}
        for alias, model_id in self.aliases.items():
            out[alias] = self.models[model_id].version
        return out

    def ids(self) -> list[str]:
        return [*self.lms.paths, *self.classifiers]

    def swap(self, name: str) -> LocalModel | None:
        """Serve the store's current version of ``name`` (after an install or a rollback). Blocking: it loads
        and verifies the new version before switching; returns the model now served, or None if unchanged."""
        new = store_model(self.store, name, self.keys)
        if new is None:
            return None
        if _is_lm(new):
            runtime = LocalLM(new.path, self.num_threads)  # load before the switch: no request waits for it
            aliases = [a for a, model_id in self.aliases.items() if model_id == new.id]
            # An alias served from one weight file of a GGUF artifact keeps that file in the new version.
            own = {a: LocalLM(new.path, self.num_threads, v) for a in aliases if (v := self.variants.get(a))}
            with self._lock:
                self.models[new.id] = new
                self.lms.replace(new.id, new.path, new.manifest, runtime)
                for alias in aliases:
                    self.lms.replace(alias, new.path, new.manifest, own.get(alias, runtime))
        elif _is_classifier(new):
            classifier = LocalClassifier.load(new.id, new.path, self.num_threads)
            with self._lock:
                self.models[new.id] = new
                self.classifiers[new.id] = classifier
        else:
            logger.warning("installed %s %s is %s, which this agent cannot serve", name, new.version, new.format)
            return None
        logger.info("now serving %s version %s", new.id, new.version)
        return new


RUNTIMES = {"onnx": "onnxruntime", "onnx-int8": "onnxruntime", "tflite": "litert", "gguf": "llama.cpp"}


def runtime_missing(fmt: str) -> str | None:
    """Why this device cannot run ``fmt`` (its runtime is not installed), or None."""
    if fmt == "gguf":
        return gguf.missing_reason()
    if fmt == "tflite" and not can_run(fmt):
        return "LiteRT is not installed: pip install ai-edge-litert"
    if fmt in FORMAT_RUNTIMES and not can_run(fmt):
        return f"{FORMAT_RUNTIMES[fmt]} is not installed"
    return None


def _loader(m: LocalModel, num_threads: int, variant: str | None) -> Callable[[], CausalLMRuntime]:
    def load() -> CausalLMRuntime:
        verify_files(m.manifest, m.path)  # every load reads verified files: changed since start-up is refused
        return load_runtime(m.path, num_threads, variant)

    return load


def _is_lm(m: LocalModel) -> bool:
    return m.kind == "causal-lm" and m.format in serving.LM_FORMATS


def _is_classifier(m: LocalModel) -> bool:
    return m.kind == "tensor" and m.format in ("onnx", "onnx-int8")

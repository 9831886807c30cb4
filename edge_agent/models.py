"""The models a device serves: the built zoo's edge artifacts, overlaid by versions the updater installed.

Every artifact is verified (Ed25519 signature against the pinned keys, sha256 of every file) at start-up and
on every swap, and an LM's files are hashed again against the verified manifest when it is loaded on first
use. ``tierline/lm-edge`` names the INT8 or the fp32 export: the faster where both verify, else the one that
does, else the TFLite export (a device with LiteRT only). An artifact whose runtime is not installed here is not
served. A swap loads the new version first and then switches the model id to it under a lock: requests in
flight keep the runtime object they started with and finish on the old version; no request waits for a load
or fails because of the swap.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from edge_agent import int8_guard, serving
from edge_agent.generation import LocalLM
from edge_agent.model_store import ModelStore
from edge_agent.runtime import FORMAT_RUNTIMES, can_run
from edge_agent.tensors import LocalClassifier
from shared.artifacts import Manifest, verify_files, verify_signature
from shared.errors import ArtifactVerificationError
from shared.zoo.registry import ZooLayout

logger = logging.getLogger(__name__)

EDGE_ARTIFACTS = ("lm-edge-onnx-int8", "lm-edge-onnx", "lm-edge-tflite", "digits-small")
EDGE_LM, EDGE_LM_INT8, EDGE_LM_FP32 = "tierline/lm-edge", "tierline/lm-edge-onnx-int8", "tierline/lm-edge-onnx"
EDGE_LM_TFLITE = "tierline/lm-edge-tflite"
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


def zoo_models(zoo_root: Path, keys: list[Ed25519PublicKey]) -> dict[str, LocalModel]:
    """Every edge artifact under ``zoo_root`` whose signature and hashes check out; others are refused."""
    layout = ZooLayout(zoo_root)
    found = {}
    for name in EDGE_ARTIFACTS:
        if not layout.manifest_path(name).is_file():
            continue
        try:
            found[PREFIX + name] = _verified(name, layout.manifest(name), layout.artifact_dir(name), keys, "zoo")
        except ArtifactVerificationError as exc:
            logger.error("refusing artifact %s: %s", name, exc.message)
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

    def __init__(self, zoo_root: Path, store: ModelStore, keys: list[Ed25519PublicKey], num_threads: int) -> None:
        self.store = store
        self.keys = keys
        self.num_threads = num_threads
        self.models = zoo_models(zoo_root, keys)
        for name in store.names():
            installed = store_model(store, name, keys)
            if installed is not None:
                self.models[installed.id] = installed
        for m in [m for m in self.models.values() if m.format in FORMAT_RUNTIMES and not can_run(m.format)]:
            logger.warning("not serving %s: no runtime for %s is installed here", m.id, m.format)
            del self.models[m.id]
        self.lms = serving.LocalModels(
            {m.id: (m.path, m.manifest) for m in self.models.values() if _is_lm(m)}, num_threads
        )
        self.classifiers = {
            m.id: LocalClassifier.load(m.id, m.path, num_threads) for m in self.models.values() if _is_classifier(m)
        }
        self.guards: dict[str, int8_guard.Int8Choice] = {}
        self.aliases: dict[str, str] = {}  # a plain model id -> the id of the export served under it
        self._lock = threading.Lock()
        int8, fp32 = (
            m if m is not None and _is_lm(m) else None for m in map(self.models.get, (EDGE_LM_INT8, EDGE_LM_FP32))
        )
        if int8 is not None and fp32 is not None:
            choice = int8_guard.choose(int8.path, fp32.path, num_threads)
            self.guards[EDGE_LM] = choice
            self._alias(EDGE_LM, int8 if choice.chosen == "onnx-int8" else fp32)
            logger.info(
                "INT8 guard: serving %s as %s (%.3f ms/token INT8, %.3f fp32)",
                EDGE_LM,
                choice.chosen,
                choice.int8_ms_per_token,
                choice.fp32_ms_per_token,
            )
        elif (only := int8 or fp32) is not None:
            self._alias(EDGE_LM, only)
            logger.info("serving %s as %s, the one export of it that verified", EDGE_LM, only.format)
        elif (tflite := self.models.get(EDGE_LM_TFLITE)) is not None and _is_lm(tflite):
            # A device with LiteRT only (or only its export verified): the plain id is served by it.
            self._alias(EDGE_LM, tflite)
            logger.info("serving %s as %s, the one export of it this device can run", EDGE_LM, tflite.format)

    def _alias(self, alias: str, model: LocalModel) -> None:
        self.aliases[alias] = model.id
        self.lms.alias(alias, model.id)

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
            with self._lock:
                self.models[new.id] = new
                self.lms.replace(new.id, new.path, new.manifest, runtime)
                for alias in [a for a, model_id in self.aliases.items() if model_id == new.id]:
                    self.lms.replace(alias, new.path, new.manifest, runtime)
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


def _is_lm(m: LocalModel) -> bool:
    return m.kind == "causal-lm" and m.format in serving.LM_FORMATS and can_run(m.format)


def _is_classifier(m: LocalModel) -> bool:
    return m.kind == "tensor" and m.format == "onnx" and can_run(m.format)

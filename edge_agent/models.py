"""The models a device serves: every signed edge artifact of the built zoo, overlaid by the versions the updater
installed (whatever name a team published them under).

Every artifact is verified (Ed25519 signature against the pinned keys, sha256 of every file) at start-up and
on every swap, and an LM's files are hashed again against the verified manifest when it is loaded on first
use. An artifact is served under its name: the zoo's in the ``tierline/`` namespace (``tierline/lm-edge-onnx``),
any other as it was published (``acme-qwen-edge-onnx``).

Artifacts that are formats of one model are grouped: by their manifest's ``derived_from`` source (followed
through the exports they derive from), else by the name without its format suffix (``-onnx``, ``-onnx-int8``,
``-tflite``, ``-gguf``). Each group is served under an *alias*, the name without the suffix
(``tierline/lm-edge``, ``acme-qwen-edge``), by the runtime and format the runtime guard chose among those the
device has (``edge_agent.runtime_guard``): the fastest that gives the reference answers, the source
checkpoint's own (``reference.json``) when the artifacts carry them. With them, an export that does not give
them is not served under its own name either. A swap loads the new version first and then switches the model
id to it under a lock: requests in flight keep the runtime object they started with and finish on the old
version; no request waits for a load or fails because of the swap. An artifact whose runtime is not installed
here is not served; every model not served is listed with the reason (``not_served``).
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
from edge_agent.model_store import ModelStore, check_segment
from edge_agent.runtime import FORMAT_RUNTIMES, CausalLMRuntime, can_run, gguf, load_runtime
from edge_agent.tensors import LocalClassifier
from shared.artifacts import Manifest, verify_files, verify_signature
from shared.chat_tokenizer import ChatTokenizer
from shared.errors import ApplicationError, ArtifactVerificationError
from shared.reference_answers import REFERENCE_FILE, ReferenceAnswers
from shared.zoo.registry import ZooLayout

logger = logging.getLogger(__name__)

EDGE_LM, EDGE_LM_INT8, EDGE_LM_FP32 = "tierline/lm-edge", "tierline/lm-edge-onnx-int8", "tierline/lm-edge-onnx"
EDGE_LM_TFLITE, EDGE_LM_GGUF = "tierline/lm-edge-tflite", "tierline/lm-edge-gguf"
PREFIX = "tierline/"
# The zoo's edge artifacts: named in the tierline/ namespace wherever they come from (the zoo dir or the cloud).
ZOO_NAMES = frozenset(
    {
        "lm-edge-onnx-int8",
        "lm-edge-onnx",
        "lm-edge-tflite",
        "lm-edge-gguf",
        "lm-micro-onnx",
        "lm-micro-onnx-int8",
        "digits-small",
        "digits-micro",
    }
)
# A format suffix of an artifact name, longest first; the order of preference when nothing can be checked.
FORMAT_SUFFIXES = ("-onnx-int8", "-onnx", "-tflite", "-gguf")
FORMAT_ORDER = ("onnx", "onnx-int8", "tflite", "gguf")
SERVED_KINDS = {"causal-lm": serving.LM_FORMATS, "tensor": ("onnx", "onnx-int8")}


def without_suffix(name: str) -> str:
    """``name`` without its format suffix (``acme-qwen-edge-onnx`` -> ``acme-qwen-edge``); unchanged without one."""
    for suffix in FORMAT_SUFFIXES:
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return name


def is_edge_artifact(manifest: Manifest) -> bool:
    """An artifact a device serves: an LM or tensor model in a device format, not made for the cloud."""
    role = manifest.metadata.get("role", "edge")
    return manifest.format in SERVED_KINDS.get(manifest.kind, ()) and role == "edge"


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


def _verified(
    model_id: str, manifest: Manifest, directory: Path, keys: list[Ed25519PublicKey], source: str
) -> LocalModel:
    verify_signature(manifest, keys)
    verify_files(manifest, directory)
    m = manifest
    return LocalModel(model_id, m.format, m.sha256, directory, m.version, m.kind, source, m)


def zoo_models(
    zoo_root: Path, keys: list[Ed25519PublicKey], refused: dict[str, str] | None = None
) -> dict[str, LocalModel]:
    """Every signed edge artifact under ``zoo_root`` whose signature and hashes check out; others are refused
    (their id and the reason go into ``refused`` when given)."""
    layout = ZooLayout(zoo_root)
    found = {}
    for name in layout.manifest_names():
        try:
            manifest = layout.manifest(name)
            if not is_edge_artifact(manifest):
                continue
            found[PREFIX + name] = _verified(PREFIX + name, manifest, layout.artifact_dir(name), keys, "zoo")
        except ArtifactVerificationError as exc:
            logger.error("refusing artifact %s: %s", name, exc.message)
            if refused is not None:
                refused[PREFIX + name] = exc.message
    return found


def store_model(store: ModelStore, name: str, keys: list[Ed25519PublicKey], model_id: str) -> LocalModel | None:
    """The store's current version of ``name``, verified; None when there is none or it fails verification."""
    version = store.current(name)
    directory = store.current_dir(name)
    if version is None or directory is None:
        return None
    try:
        return _verified(model_id, store.manifest(name, version), directory, keys, "store")
    except ArtifactVerificationError as exc:
        logger.error("refusing installed %s %s: %s", name, version, exc.message)
        return None


def reference_answers(m: LocalModel) -> ReferenceAnswers | None:
    """The source's reference answers ``m`` carries, when its verified manifest lists the file (one lying beside
    the files and not signed with them is ignored). ValueError when it is malformed."""
    if REFERENCE_FILE not in {e.path for e in m.manifest.files}:
        return None
    return ReferenceAnswers.read(m.path)


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
        self.zoo_names = (
            ZOO_NAMES | {m.name for m in self.models.values()} | {r.removeprefix(PREFIX) for r in self.refused}
        )
        for name in store.names():
            installed = store_model(store, name, keys, self.model_id(name))
            if installed is not None:
                self.models[installed.id] = installed
                self.refused.pop(installed.id, None)
        # An artifact whose runtime is not installed here is not served (nor listed); the guard says why.
        self.unrunnable: dict[str, str] = {}  # model id -> the runtime it needs and how to install it
        self.unrunnable_models: dict[str, LocalModel] = {}
        for m in list(self.models.values()):
            missing = runtime_missing(m.format)
            if missing is not None:
                logger.warning("not serving %s: %s", m.id, missing)
                self.unrunnable[m.id] = missing
                self.unrunnable_models[m.id] = m
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
        self.families: dict[str, str] = {}  # an export's id -> the plain model id of its group
        self.withdrawn: dict[str, str] = {}  # model id -> why the runtime guard does not serve it
        self.rejected: dict[str, str] = {}  # a desired model's name -> why the updater does not install it
        self._lock = threading.Lock()
        for alias, members in self.groups().items():
            self._guard(alias, members)

    def model_id(self, name: str) -> str:
        """The id an artifact named ``name`` is served under: the zoo's in the ``tierline/`` namespace."""
        return PREFIX + name if name in self.zoo_names else name

    # -- groups of formats ---------------------------------------------------------------------------------
    def _source(self, m: LocalModel, known: dict[str, LocalModel], depth: int = 0) -> str:
        """The model ``m`` is a format of: its manifest's ``derived_from`` source, followed through the exports it
        derives from (the zoo's INT8 from its fp32 ONNX), else its name without the format suffix."""
        derived = m.manifest.derived_from or {}
        parent = str(derived.get("name", "")).partition("@")[0]
        if not parent:
            return self.model_id(without_suffix(m.name))
        upstream = known.get(self.model_id(parent))
        if upstream is not None and upstream.id != m.id and depth < 8:
            return self._source(upstream, known, depth + 1)
        return self.model_id(parent)

    def groups(self) -> dict[str, tuple[str, ...]]:
        """Plain model id -> the ids of the LM artifacts that are formats of it, in the order of preference when
        nothing can be checked. The plain id is the name without the format suffix that the members share."""
        known = {**self.unrunnable_models, **self.models}
        lms = {i: m for i, m in known.items() if m.kind == "causal-lm"}
        by_source: dict[str, list[str]] = {}
        for m in lms.values():
            by_source.setdefault(self._source(m, known), []).append(m.id)
        for model_id in self.refused:  # no trusted manifest: grouped by its name alone
            if model_id != without_suffix(model_id):
                by_source.setdefault(without_suffix(model_id), []).append(model_id)
        grouped: dict[str, set[str]] = {}
        for source, members in sorted(by_source.items()):
            plain = {without_suffix(i) for i in members}
            grouped.setdefault(plain.pop() if len(plain) == 1 else source, set()).update(members)
        return {
            alias: tuple(sorted(members, key=lambda i: (_format_rank(i, lms), i))) for alias, members in grouped.items()
        }

    def _candidates(self, members: tuple[str, ...]) -> list[runtime_guard.Candidate]:
        out: list[runtime_guard.Candidate] = []
        for model_id in members:
            m = self.models.get(model_id) or self.unrunnable_models.get(model_id)
            fmt = m.format if m is not None else _suffix_format(model_id)
            if m is not None and m.kind != "causal-lm":
                continue
            variants = gguf.variants(m.path) if m is not None and fmt == "gguf" else list(gguf.GGUF_FILES)
            for fmt_name, variant in [(f"gguf-{v}", v) for v in variants] if fmt == "gguf" else [(fmt, None)]:
                runtime = RUNTIMES.get(fmt, fmt)
                if model_id not in self.models:
                    if model_id in self.unrunnable:
                        reason = self.unrunnable[model_id]
                    elif model_id in self.refused:
                        reason = f"refused: {self.refused[model_id]}"
                    else:
                        continue  # the device does not have it: not a candidate, nothing to say
                    out.append(runtime_guard.Candidate(runtime, fmt_name, unavailable=reason, model_id=model_id))
                    continue
                assert m is not None
                missing = runtime_missing(fmt)
                if missing is None and not self.lms.has(m.id):  # refused since: a load found its files changed
                    missing = "refused: its files changed after they were verified"
                load = _loader(m, self.num_threads, variant) if missing is None else None
                out.append(runtime_guard.Candidate(runtime, fmt_name, load, missing, m.id, variant))
        return out

    def _answers(self, members: tuple[str, ...]) -> tuple[ReferenceAnswers | None, str | None]:
        """The group's reference answers (the first member that carries them), or why they cannot be read."""
        for model_id in members:
            m = self.models.get(model_id)
            if m is None:
                continue
            try:
                answers = reference_answers(m)
            except (ValueError, OSError) as exc:
                return None, f"{model_id}: {exc}"
            if answers is not None:
                return answers, None
        return None, None

    def _guard(self, alias: str, members: tuple[str, ...]) -> None:
        """Run the runtime guard on one group and serve its choice under ``alias``."""
        for model_id in members:
            self.families[model_id] = alias
        candidates = self._candidates(members)
        if not any(c.load is not None for c in candidates):
            return
        answers, broken = self._answers(members)
        if broken is not None:
            logger.error("runtime guard: not serving %s: %s", alias, broken)
            self._withdraw([alias, *members], f"its {REFERENCE_FILE} cannot be read: {broken}")
            return
        ref = next((self.models[i] for i in members if i in self.models), None)
        encode = ChatTokenizer(ref.path).encode if ref is not None else None
        choice = runtime_guard.choose(candidates, encode=encode, min_agreement=self.min_agreement, answers=answers)
        self.guards[alias] = choice
        if answers is not None:  # an export that does not give the source's answers is not served at all
            self._withdraw_ineligible(members, candidates, choice)
        served = choice.served
        if served is None or served.model_id is None:
            logger.error("runtime guard: no runtime on this device can serve %s: %s", alias, choice.reason)
            self._withdraw([alias], f"runtime guard: {choice.reason}")
            return
        self.withdrawn.pop(alias, None)
        if alias not in members:
            self._alias(alias, self.models[served.model_id], served.variant)
        numbers = ", ".join(
            f"{c.format} {c.ms_per_token} ms/token agreement {c.agreement}"
            for c in choice.candidates
            if c.ms_per_token is not None
        )
        logger.info("runtime guard: serving %s as %s (%s)", alias, choice.chosen, numbers)

    def _withdraw_ineligible(
        self, members: tuple[str, ...], candidates: list[runtime_guard.Candidate], choice: runtime_guard.RuntimeChoice
    ) -> None:
        measured = dict(zip((id(c) for c in candidates), choice.candidates, strict=True))
        for model_id in members:
            mine = [(c, measured[id(c)]) for c in candidates if c.model_id == model_id and c.load is not None]
            if not mine:
                continue
            good = [c for c, m in mine if m.eligible]
            if not good:
                reasons = "; ".join(f"{m.format}: {m.reason}" for _, m in mine)
                logger.error("runtime guard: not serving %s: %s", model_id, reasons)
                self._withdraw([model_id], f"runtime guard: {reasons}")
            elif good[0].variant is not None and len(good) < len(mine):  # one GGUF weight file fails: the id
                self.lms.alias(model_id, model_id, good[0].variant)
                self.variants[model_id] = good[0].variant  # serves one that passes

    def _withdraw(self, model_ids: list[str], reason: str) -> None:
        for model_id in model_ids:
            self.withdrawn[model_id] = reason
            self.lms.withdraw(model_id)
            self.aliases.pop(model_id, None)

    def serving(self) -> dict[str, Any]:
        """How each served model runs, as the sync reports it (``runtime["serving"]``): for a plain id, what the
        runtime guard chose among its formats; for a model served under its artifact's own name
        (``lm-edge-onnx-int8``), the format that name fixes (``"fixed": true``, nothing weighed)."""
        out: dict[str, Any] = {alias: choice.as_json() for alias, choice in self.guards.items()}
        for model_id, model in sorted(self.models.items()):
            if model_id not in out and (self.lms.has(model_id) or model_id in self.classifiers):
                out[model_id] = {"chosen": model.format, "fixed": True, "candidates": []}
        return out

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

    def not_served(self) -> dict[str, str]:
        """Every model this device was given and does not serve, with the reason (for ``/v1/models``)."""
        out = {model_id: f"refused: {reason}" for model_id, reason in self.refused.items()}
        out.update(self.unrunnable)
        out.update(self.withdrawn)
        out.update(self.rejected)
        return dict(sorted(out.items()))

    def versions(self) -> dict[str, str]:
        out = {m.id: m.version for m in self.models.values() if m.id not in self.withdrawn}
        for alias, model_id in self.aliases.items():
            out[alias] = self.models[model_id].version
        return out

    def ids(self) -> list[str]:
        return [*self.lms.paths, *self.classifiers]

    def swap(self, name: str) -> LocalModel | None:
        """Serve the store's current version of ``name`` (after an install or a rollback). Blocking: it loads
        and verifies the new version before switching; returns the model now served, or None if unchanged. A
        model new to this device joins its group, and the runtime guard chooses again for the group."""
        new = store_model(self.store, name, self.keys, self.model_id(name))
        if new is None:
            return None
        self.rejected.pop(new.id, None)
        if _is_lm(new) and (new.id not in self.models or new.id in self.withdrawn):
            with self._lock:
                self.models[new.id] = new
                self.withdrawn.pop(new.id, None)
                self.lms.replace(new.id, new.path, new.manifest, LocalLM(new.path, self.num_threads))
            for alias, members in self.groups().items():
                if new.id in members:
                    self._guard(alias, members)
        elif _is_lm(new):
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
            self.rejected[name] = f"{new.kind} in {new.format}: this agent cannot serve it"
            return None
        logger.info("now serving %s version %s", new.id, new.version)
        return new

    def reject(self, name: str, reason: str) -> None:
        """Note that the desired model ``name`` is not installed here, and why (an unsafe name, no runtime)."""
        self.rejected[self.model_id(name) if _is_safe_name(name) else name] = reason


def _is_safe_name(name: str) -> bool:
    try:
        check_segment(name, "model")
    except ApplicationError:
        return False
    return True


def _format_rank(model_id: str, known: dict[str, LocalModel]) -> int:
    m = known.get(model_id)
    fmt = m.format if m is not None else _suffix_format(model_id)
    return FORMAT_ORDER.index(fmt) if fmt in FORMAT_ORDER else len(FORMAT_ORDER)


def _suffix_format(model_id: str) -> str:
    return next((s[1:] for s in FORMAT_SUFFIXES if model_id.endswith(s)), "")


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

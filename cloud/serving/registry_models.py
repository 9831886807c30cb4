"""Registry models on the cloud: the versions routing needs, materialised from the artifact store into a cache
under the data dir and served by one engine each.

Which models: every ``causal-lm`` model of the registry (``TIERLINE_CLOUD_REGISTRY_MODELS`` unset, ``*`` or
``all``), or only those it lists. Which versions: the one ``stable`` points at (else the highest ``active`` one),
served for the bare model name, and every version a cloud-scope rollout of the model may route to
(``cloud.serving.canary.routed_versions``). ``sync`` runs at start-up and after every plan refresh, in a worker
thread: a version a new rollout (or a moved ``stable``) needs is loaded there, and the pool's registry snapshot is
replaced once it is ready. A version no longer needed (a finished rollout's other arm, a former ``stable``) leaves the
snapshot at once and its engine is shut down once it is idle and two refresh intervals have passed, so a request
that picked it just before still finishes.

When every model is served (no list), a version is loaded at its first request, not at start-up
(``RegistryEntry.pending``): the request gets 503 ``model_loading`` with Retry-After and the next refresh loads it,
so a registry of many models costs no memory or start-up time until they are used. Models the list names, and
rollout arms, load at start-up as before. A version that fails to load is kept with its one-line reason
(``RegistryEntry.failed``): ``/readyz`` lists it as degraded and its requests get 503 ``model_unavailable``
saying why; it is tried again when its artifact changes.

A version with a serving spec (``ModelVersion.serving``: an ``openai`` backend) is not loaded into an engine: its
tokenizer artifact (``hf-tokenizer``, or a checkpoint) is materialised and a replica pool of its upstream servers
answers it (``cloud.serving.backends.upstream.Backends``). Its spec is read again at every refresh: a change of
endpoints only is applied to the running pool (new endpoints join, removed ones drain); any other change builds a new
backend and drains the old one, as does a version no longer needed.

A serving spec is a console admin's, not the operator's: before its backend is built or its endpoints applied, its
key must come from a place the operator designates and its endpoints must pass the egress policy
(``shared.backend_spec.boundary_problem``, ``TIERLINE_CLOUD_UPSTREAM_*``), and the pool checks its endpoints again
at every resolution. A spec that fails (one stored before these rules, or written to the database by hand) is not
served: the reason is logged, ``/readyz`` lists the version as degraded and its requests get 503
``model_unavailable`` saying why; a running backend of an earlier spec keeps serving.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Final

from sqlalchemy.engine import Engine
from sqlmodel import Session

from cloud.serving.backends.upstream import Backends, RemoteLM
from cloud.serving.canary import routed_versions
from cloud.serving.engine_pool import EnginePool, RegistryEntry, ServedLM, engine_config, start_engine
from cloud.settings import CloudSettings
from controlplane.registry.artifacts import materialize
from controlplane.registry.service import (
    STABLE,
    TOKENIZER_FORMATS,
    artifacts_of,
    get_model,
    get_version,
    list_models,
    list_versions,
    routing_aliases,
)
from controlplane.registry.store import ArtifactStore
from controlplane.rollouts.service import RolloutPlan
from controlplane.storage.tables import ModelArtifact
from shared.artifacts import Manifest, verify_files
from shared.backend_spec import ServingSpec, boundary_problem, load_upstream_settings
from shared.errors import ApplicationError, ArtifactVerificationError

logger = logging.getLogger(__name__)

ALL: Final = frozenset({"all", "*"})
CACHE_DIR: Final = "cloud-models"
REMOTE_RETRY_S: Final = 30.0  # a version whose backend failed to start is tried again at most this often


def parse_names(value: str | None) -> frozenset[str] | None:
    """``TIERLINE_CLOUD_REGISTRY_MODELS``: None (every registry model) when unset, ``*`` or ``all``, else the
    listed names (an empty value: none)."""
    if value is None:
        return None
    names = frozenset(n.strip() for n in value.split(",") if n.strip())
    return None if names & ALL else names


def is_enabled(value: str | None) -> bool:
    """Whether the cloud serves any registry model (``TIERLINE_CLOUD_REGISTRY_MODELS`` is not set empty)."""
    return parse_names(value) != frozenset()


def one_line(exc: BaseException) -> str:
    """An error as one line: an application error's message, else its type and first line."""
    if isinstance(exc, ApplicationError):
        text = exc.message
    else:
        first = str(exc).strip().splitlines()
        text = f"{type(exc).__name__}: {first[0]}" if first else type(exc).__name__
    return " ".join(text.split())[:500]


@dataclass(slots=True)
class _ModelState:
    """One registry model as last read from the database (plain values, no session attached)."""

    name: str
    aliases: dict[str, int] = field(default_factory=dict)
    stable_moved_at: datetime | None = None
    statuses: dict[int, str] = field(default_factory=dict)
    created: dict[int, int] = field(default_factory=dict)
    serving: dict[int, dict[str, Any]] = field(default_factory=dict)  # versions with a serving spec


class RegistryModels:
    """Keeps ``pool.registry`` in step with the registry and the rollout plans."""

    def __init__(
        self, db: Engine, pool: EnginePool, settings: CloudSettings, store: ArtifactStore, cache_dir: Path
    ) -> None:
        self.db = db
        self.pool = pool
        self.settings = settings
        self.store = store
        self.cache_dir = cache_dir
        self.names = parse_names(settings.registry_models)
        self.is_lazy = self.names is None  # every model: default versions load at their first request
        self._lock = threading.Lock()  # start-up and refreshes never load the same version twice
        self._sha256: dict[tuple[str, int], str] = {}
        self._failed: dict[tuple[str, int], str] = {}  # version → artifact sha256 that failed to load
        self._missing_reported: set[str] = set()
        self._retired: dict[tuple[str, int], tuple[float, ServedLM]] = {}  # left the snapshot at (monotonic)
        self._remote_failed: dict[tuple[str, int], str] = {}  # version → why its backend is not running
        # version → (not tried again before (monotonic), unless its spec is not this one)
        self._remote_retry_at: dict[tuple[str, int], tuple[float, ServingSpec | None]] = {}
        self.backends: Backends | None = None  # answers versions with a serving spec (set once it runs)
        self._errors: dict[tuple[str, int], str] = {}  # version → why it failed to load (one line)
        self._demanded: set[tuple[str, int]] = set()  # versions requested while pending: loaded from now on
        upstream = load_upstream_settings()  # what serving specs may reach: the operator's designations
        self.keys = upstream.key_sources()
        self.egress = upstream.egress(check_own_sockets=True)
        pool.on_demand = self.demand
        pool.load_retry_after_s = settings.canary_refresh_s + 5.0

    def demand(self, name: str, number: int) -> None:
        """A request asked for version ``number`` of ``name``, not loaded yet: the next refresh loads it."""
        self._demanded.add((name, number))

    def sync(self, plans: list[RolloutPlan]) -> None:
        """Read the registry, load the versions now needed, then publish the new snapshot to the pool."""
        with self._lock:
            states = self._read()
            entries = dict(self.pool.registry)
            for state in states:
                entry = entries.get(state.name) or RegistryEntry(state.name)
                needed = routed_versions(plans, RegistryEntry(state.name, stable_moved_at=state.stable_moved_at))
                live = {n for n, status in state.statuses.items() if status != "retired"}
                needed |= {n for m, n in self._demanded.copy() if m == state.name and n in live}
                wanted = self._default(state, state.statuses)
                if wanted is not None and (not self.is_lazy or wanted in state.serving):
                    needed.add(wanted)
                versions = dict(entry.versions)
                remotes = self._sync_remote(state, _upstream_served(entry), needed)
                for number in sorted(set(versions) & set(state.serving)):  # now answered upstream: engine goes
                    self._retired[(state.name, number)] = (time.monotonic(), versions.pop(number))
                for number in sorted(needed - set(versions) - set(state.serving)):
                    if number in state.statuses:
                        served = self._revive(state.name, number) or self._load(state.name, number)
                        if served is not None:
                            versions[number] = served
                failed = {
                    n: why
                    for (m, n), why in {**self._errors, **self._remote_failed}.items()
                    if m == state.name and n in needed and n not in versions and n not in remotes
                }
                # Every live version not loaded yet loads at its first request (by name, alias or NAME@N).
                pending = frozenset(live - needed - set(versions) - set(remotes)) if self.is_lazy else frozenset()
                known = set(versions) | set(remotes) | set(failed) | pending
                default = self._default(state, known)
                for number in sorted(set(versions) - needed - {default}):
                    logger.info("%s version %s is no longer needed; it is unloaded once idle", state.name, number)
                    self._retired[(state.name, number)] = (time.monotonic(), versions.pop(number))
                for number in sorted(set(remotes) - needed - {default}):
                    logger.info("%s version %s is no longer needed; its upstreams drain", state.name, number)
                    self._retire_remote(remotes.pop(number))
                entries[state.name] = RegistryEntry(
                    name=state.name,
                    versions=versions,
                    aliases={a: n for a, n in state.aliases.items() if n in known},
                    default=default,
                    stable_moved_at=state.stable_moved_at,
                    created=state.created.get(default, 0) if default is not None else 0,
                    sha256=self._sha256.get((state.name, default), "") if default is not None else "",
                    remote=remotes,
                    pending=pending,
                    failed=failed,
                )
            self.pool.set_registry(entries)
            self._shut_down_idle()

    # -- versions answered by upstream servers ----------------------------------------------------------------
    def _sync_remote(self, state: _ModelState, remotes: dict[int, RemoteLM], needed: set[int]) -> dict[int, RemoteLM]:
        """The model's upstream-served versions after this refresh: specs read again (endpoint lists applied,
        other changes rebuilt), versions whose spec went away drained, needed ones with a spec started."""
        for number in sorted(set(remotes) - set(state.serving)):  # spec removed: the built-in engine serves it
            self._retire_remote(remotes.pop(number))
        for number, raw in sorted(state.serving.items()):
            current = remotes.get(number)
            if current is None and number not in needed:
                continue
            try:
                spec = ServingSpec.model_validate(raw)
            except ValueError as exc:  # written by another release of the registry, or by hand
                self._report(state.name, number, f"its serving spec is invalid: {exc}")
                continue
            if current is not None and current.config == spec:
                continue
            refused = boundary_problem(spec, self.keys, self.egress)  # stored before the rules, or by hand
            if refused is not None:
                self._report(state.name, number, f"its serving spec is refused: serving.{refused[0]}: {refused[1]}")
                continue
            if current is not None:
                old = current.config
                if isinstance(old, ServingSpec) and old.without_endpoints() == spec.without_endpoints():
                    logger.warning("%s version %s: endpoints now %s", state.name, number, ", ".join(spec.roots()))
                    assert self.backends is not None
                    self.backends.update(current, spec)
                    self._remote_failed.pop((state.name, number), None)
                    continue
                logger.warning("%s version %s: serving spec changed; a new backend replaces it", state.name, number)
            remote = self._load_remote(state.name, number, spec)
            if remote is None:
                continue  # the old one (if any) keeps serving
            if current is not None:
                self._retire_remote(current)
            remotes[number] = remote
        return remotes

    def _retire_remote(self, remote: RemoteLM) -> None:
        if self.backends is not None:
            self.backends.retire(remote)

    def _report(self, name: str, number: int, why: str) -> None:
        key = (name, number)
        if self._remote_failed.get(key) != why:
            logger.error("%s version %s: %s; not served", name, number, why)
            self._remote_failed[key] = why

    def _load_remote(self, name: str, number: int, spec: ServingSpec) -> RemoteLM | None:
        """A backend for version ``number``: its tokenizer artifact materialised, its pool started."""
        if self.backends is None:
            self._report(name, number, "it has a serving spec, but this gateway runs no backends")
            return None
        key = (name, number)
        retry_at, tried = self._remote_retry_at.get(key, (0.0, None))
        if key in self._remote_failed and tried == spec and time.monotonic() < retry_at:
            return None  # this spec failed a moment ago: not again at every refresh
        self._remote_retry_at[key] = (time.monotonic() + REMOTE_RETRY_S, spec)
        artifact = self.cloud_artifact(name, number, TOKENIZER_FORMATS)
        if artifact is None:
            self._report(name, number, "it has a serving spec but no ready cloud hf-tokenizer artifact")
            return None
        from cloud.serving.backends.upstream import make_remote

        try:
            tokenizer_dir = self.materialize(name, number, artifact)
            remote = make_remote(name, spec, tokenizer_dir, version=number, keys=self.keys, egress=self.egress)
        except Exception as exc:  # a key file others can read, a name that does not resolve, a broken tokenizer
            self._report(name, number, f"starting its backend failed ({exc})")
            return None
        self._remote_failed.pop(key, None)
        self._sha256[(name, number)] = artifact.sha256
        self.backends.attach(remote)
        logger.info("serving %s version %s from upstreams %s", name, number, ", ".join(spec.roots()))
        return remote

    def _revive(self, name: str, number: int) -> ServedLM | None:
        """A version needed again before its engine was shut down serves again as it is."""
        retired = self._retired.pop((name, number), None)
        return retired[1] if retired is not None else None

    def _shut_down_idle(self) -> None:
        grace_s = 2 * self.settings.canary_refresh_s
        now = time.monotonic()
        for key, (since, served) in list(self._retired.items()):
            if now - since >= grace_s and served.engine.snapshot().idle:
                del self._retired[key]
                served.engine.shutdown()
                logger.info("unloaded %s version %s", *key)

    @staticmethod
    def _default(state: _ModelState, present: Iterable[int]) -> int | None:
        """Of the versions ``present``: ``stable``'s, else the highest ``active`` one."""
        numbers = set(present)
        stable = state.aliases.get(STABLE)
        if stable is not None and stable in numbers:
            return stable
        return max((n for n in numbers if state.statuses.get(n) == "active"), default=None)

    def _read(self) -> list[_ModelState]:
        with Session(self.db) as session:
            every = list_models(session)
            models = [m for m in every if m.kind == "causal-lm" and (self.names is None or m.name in self.names)]
            tensors = {m.name for m in every if m.kind == "tensor"}  # cloud.serving.tensor_models serves those
            unknown = (self.names or frozenset()) - {m.name for m in models} - tensors - self._missing_reported
            for name in sorted(unknown):
                logger.warning("registry model %r (TIERLINE_CLOUD_REGISTRY_MODELS) is not a causal-lm model", name)
                self._missing_reported.add(name)
            states = []
            for model in models:
                state = _ModelState(model.name)
                for v in list_versions(session, model):
                    state.statuses[v.number] = v.status
                    state.created[v.number] = int(v.created_at.timestamp()) if v.created_at else 0
                    if v.serving:
                        state.serving[v.number] = dict(v.serving)
                aliases, state.stable_moved_at = routing_aliases(session, model)
                state.aliases.update(aliases)
                states.append(state)
            return states

    def cloud_artifact(
        self, name: str, number: int, formats: tuple[str, ...] = ("hf-safetensors",)
    ) -> ModelArtifact | None:
        """The version's newest ready ``cloud`` artifact in one of ``formats``, detached from its session."""
        with Session(self.db) as session:
            version = get_version(session, get_model(session, name), number)
            found = [
                a
                for a in artifacts_of(session, [version.id or 0])[version.id or 0]
                if a.target == "cloud" and a.format in formats and a.status == "ready"
            ]
            session.expunge_all()
        return found[-1] if found else None

    def _load(self, name: str, number: int) -> ServedLM | None:
        """Materialise and start version ``number`` of ``name``; None (logged) when it cannot be served."""
        key = (name, number)
        artifact = self.cloud_artifact(name, number)
        if artifact is None:
            if key not in self._failed:
                logger.error("%s version %s has no ready cloud hf-safetensors artifact; not served", name, number)
                self._failed[key] = ""
                self._errors[key] = "it has no ready cloud hf-safetensors artifact"
            return None
        if self._failed.get(key) == artifact.sha256:  # tried already: not again every refresh
            return None
        try:
            model_dir = self.materialize(name, number, artifact)
            engine = start_engine(engine_config(model_dir, self.settings), f"{name}@{number}", self.settings)
            try:
                engine.wait_ready()
            except BaseException:
                engine.shutdown()
                raise
        except Exception as exc:
            why = one_line(exc)
            if isinstance(exc, ApplicationError):  # a checkpoint the engine refuses: its message says it all
                logger.error("loading %s version %s failed: %s; it is not served", name, number, why)
            else:
                logger.exception("loading %s version %s failed; it is not served", name, number)
            self._failed[key] = artifact.sha256
            self._errors[key] = why
            return None
        self._errors.pop(key, None)
        self._sha256[key] = artifact.sha256
        logger.info("serving %s version %s from %s", name, number, model_dir)
        return ServedLM(name, number, engine, engine.max_model_len)

    def materialize(self, name: str, number: int, artifact: ModelArtifact) -> Path:
        """The version's checkpoint under the cache dir, every file checked against its sha256 (a cached copy is
        checked again; a corrupt one is fetched anew)."""
        manifest = Manifest.from_json(json.dumps({**artifact.manifest, "signature": None}))
        if manifest.sha256 != artifact.sha256:
            raise ArtifactVerificationError(f"{name} version {number}: manifest does not match the artifact's sha256")
        parent = self.cache_dir / name
        dest = parent / f"{number}-{artifact.sha256[:16]}"
        if dest.is_dir():
            try:
                verify_files(manifest, dest)
                return dest
            except ArtifactVerificationError as exc:
                logger.warning("cached %s version %s is damaged (%s); fetching it again", name, number, exc)
                shutil.rmtree(dest)
        parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=parent, prefix=".partial-"))
        try:
            materialize(self.store, artifact, staging)
            try:
                staging.rename(dest)
            except OSError:  # another process put it in place meanwhile
                verify_files(manifest, dest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return dest


def _upstream_served(entry: RegistryEntry) -> dict[int, RemoteLM]:
    """The entry's upstream-served versions as this module made them (the pool, below it, holds them as ``Metered``)."""
    remotes = {number: remote for number, remote in entry.remote.items() if isinstance(remote, RemoteLM)}
    if len(remotes) != len(entry.remote):
        raise TypeError(f"{entry.name}: an upstream-served version is not a RemoteLM")
    return remotes

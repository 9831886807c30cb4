"""Model updates on the device: download, verify, smoke-test, install, activate; roll back on bad health.

``Updater.apply(desired)`` is blocking (run it off the event loop) and goes:

1. manifest: fetched from the cloud, signed by a pinned key, naming the desired model, version and sha256,
   with safe relative file paths and a total size within ``max_artifact_bytes``; an artifact whose runtime is
   not installed on this device (GGUF without llama.cpp) is not downloaded ("unrunnable", said once);
2. files: downloaded into ``<staging>/<name>/<version>/`` as ``.part`` files, resumed with HTTP Range from
   the part's size after any interruption (kill -9 included), each checked against its sha256;
3. smoke test: an LM loads, greedy-decodes 8 tokens from a fixed prompt with finite logits within a time
   bound, and reproduces the manifest's golden outputs if it has any
   (``metadata["golden"] = [{"prompt": str, "greedy_ids": [int, ...]}]``); a tensor model runs one zero input;
4. install and activate in the ``ModelStore`` (the old version stays as previous).

Every step is reported through ``report(kind, payload)``. Anything that fails verification is deleted and
answered "rejected" (the cloud's desired state will offer it again; a smoke-test failure or a health rollback
blocks the version); a network or disk problem is "failed" and resumes at the next call. A block is lifted
after ``block_s``, or at once when the cloud's desired version of the model changes to the blocked one (a new
decision of the control plane, such as an operator publishing it again after a fix).
Idempotent GETs have a timeout and are retried with full-jitter exponential backoff.

``HealthWatch`` rolls a model back to its previous version when the new one's error rate over its first
``window_s`` crosses ``max_error_rate`` with at least ``min_requests`` requests.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Literal, TypeVar

import httpx
import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from edge_agent.model_store import ModelStore, check_segment
from shared.artifacts import Manifest, sha256_file, verify_files, verify_signature
from shared.edge_protocol import DesiredModel
from shared.errors import ApplicationError

logger = logging.getLogger(__name__)

Outcome = Literal["already-current", "installed", "rejected", "unrunnable", "failed"]
Report = Callable[[str, dict[str, Any]], None]
T = TypeVar("T")

SMOKE_PROMPT = "def main():\n"
SMOKE_TOKENS = 8
MAX_MANIFEST_BYTES = 1 << 20
_LM_FORMATS = ("onnx", "onnx-int8", "tflite", "gguf")
_ORT_DTYPES = {"tensor(double)": np.float64, "tensor(float16)": np.float16, "tensor(int64)": np.int64}


class RejectedError(Exception):
    """The artifact must not be used (bad signature, hash, path, size or smoke test)."""

    def __init__(self, reason: str, *, block: bool = False) -> None:
        super().__init__(reason)
        self.reason, self.block = reason, block


class _RetryableError(Exception):
    pass


def is_safe_file_path(path: str) -> bool:
    if not path or "\\" in path or "\x00" in path or path.startswith("/") or path.endswith(".part"):
        return False
    return all(part not in ("", ".", "..") for part in path.split("/"))


class Updater:
    """Brings models to the versions the cloud desires; ``client`` carries the device credential.

    Not thread-safe: the agent calls ``apply`` from one worker, one desired model after another.
    """

    def __init__(
        self,
        client: httpx.Client,
        store: ModelStore,
        staging_dir: Path,
        trusted_keys: list[Ed25519PublicKey],
        max_artifact_bytes: int,
        report: Report,
        *,
        timeout_s: float = 30.0,
        max_attempts: int = 4,
        retry_base_s: float = 0.5,
        max_bytes_per_s: float | None = None,
        smoke_max_s: float = 30.0,
        num_threads: int = 1,
        block_s: float = 86400.0,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if not trusted_keys:
            raise ValueError("the updater needs at least one pinned signing key")
        self.client, self.store, self.staging_dir = client, store, staging_dir
        self.trusted_keys, self.max_artifact_bytes, self._report = trusted_keys, max_artifact_bytes, report
        self.timeout_s, self.max_attempts, self.retry_base_s = timeout_s, max_attempts, retry_base_s
        self.max_bytes_per_s, self.smoke_max_s, self.num_threads = max_bytes_per_s, smoke_max_s, num_threads
        self.block_s, self.wall_clock = block_s, wall_clock
        self._quiet: set[tuple[str, str]] = set()
        self._desired: dict[str, str] = {}  # model -> the version the cloud desired at the last call
        self.reasons: dict[str, str] = {}  # model -> why its desired version was last not installed
        self._fetched = 0

    def apply(self, desired: DesiredModel) -> Outcome:
        """Make ``desired`` the current version of its model, or say why not."""
        name, version = desired.name, desired.version
        info = {"model": name, "version": version}
        try:
            check_segment(name, "model")
            check_segment(version, "version")
        except ApplicationError as exc:
            if self.reasons.get(name) != exc.message:
                self.report("update.rejected", {**info, "reason": exc.message})
            self.reasons[name] = exc.message
            return "rejected"
        self.reasons.pop(name, None)
        try:
            self._lift_block(name, version)
            state = self.store.state(name)
            if state.current == version:
                if self.store.manifest(name, version).sha256 == desired.sha256:
                    return "already-current"
                raise RejectedError(f"{name} {version} is installed with another sha256; versions are immutable")
            if version in state.blocked:
                if (name, version) not in self._quiet:
                    self._quiet.add((name, version))
                    self.report("update.rejected", {**info, "reason": "version was rolled back on this device"})
                return "rejected"
            if version in self.store.versions(name):  # the previous version, still on disk
                manifest = self.store.manifest(name, version)
                self._check_manifest(manifest, desired)
                verify_files(manifest, self.store.version_dir(name, version))
            else:
                manifest = self._fetch_manifest(desired)
                missing = _runtime_missing(manifest)
                if missing is not None:
                    reason = f"{manifest.format}: {missing}"
                    if (name, version) not in self._quiet:
                        self._quiet.add((name, version))
                        self.report("update.unrunnable", {**info, "reason": reason})
                    self.reasons[name] = reason
                    return "unrunnable"
                staged = self._download(manifest)
                self._smoke_test(manifest, staged)
                self.store.install(name, version, staged, manifest)
            self.store.activate(name, version)
        except RejectedError as exc:
            shutil.rmtree(self.staging_dir / name / version, ignore_errors=True)
            if exc.block:
                self.store.block(name, version)
            self.report("update.rejected", {**info, "reason": exc.reason})
            self.reasons[name] = exc.reason
            return "rejected"
        except (ApplicationError, _RetryableError, httpx.HTTPError, OSError) as exc:
            reason = exc.message if isinstance(exc, ApplicationError) else str(exc) or type(exc).__name__
            self.report("update.failed", {**info, "reason": reason})
            return "failed"
        self.report("update.activated", {**info, "previous": state.current})
        return "installed"

    def _lift_block(self, name: str, desired: str) -> None:
        """Unblock ``desired`` when the cloud has just changed to it from another version, or its block expired."""
        before, self._desired[name] = self._desired.get(name), desired
        blocked_at = self.store.state(name).blocked.get(desired)
        if blocked_at is None:
            return
        if before is not None and before != desired:
            reason = f"the cloud desires it again, after {before}"
        elif self.wall_clock() - blocked_at >= self.block_s:
            reason = f"blocked for {self.block_s:g} s"
        else:
            return
        self.store.unblock(name, desired)
        self._quiet.discard((name, desired))
        self.report("update.unblocked", {"model": name, "version": desired, "reason": reason})

    def report(self, kind: str, payload: dict[str, Any]) -> None:
        level = logging.WARNING if kind in ("update.rejected", "update.failed", "update.unrunnable") else logging.INFO
        logger.log(level, "%s %s", kind, payload)
        try:
            self._report(kind, payload)
        except Exception:
            logger.exception("could not record %s", kind)

    # --- manifest ----------------------------------------------------------------------------------------

    def _fetch_manifest(self, desired: DesiredModel) -> Manifest:
        url = desired.manifest_url
        if not url.startswith("/") or url.startswith("//"):
            raise RejectedError(f"manifest_url {url!r} is not a path on the cloud")
        body = self._retrying(f"GET {url}", lambda: self._get_small(url))
        try:
            manifest = Manifest.from_json(body.decode())
        except (ApplicationError, UnicodeDecodeError) as exc:
            raise RejectedError(f"malformed manifest: {exc}") from None
        self._check_manifest(manifest, desired)
        return manifest

    def _get_small(self, url: str) -> bytes:
        with self.client.stream("GET", url, timeout=self.timeout_s) as resp:
            _check_status(resp, url, (200,))
            body = b""
            for chunk in resp.iter_bytes():
                body += chunk
                if len(body) > MAX_MANIFEST_BYTES:
                    raise RejectedError(f"manifest is larger than {MAX_MANIFEST_BYTES} bytes")
            return body

    def _check_manifest(self, manifest: Manifest, desired: DesiredModel) -> None:
        try:
            verify_signature(manifest, self.trusted_keys)
        except ApplicationError as exc:
            raise RejectedError(exc.message) from None
        if (manifest.name, manifest.version) != (desired.name, desired.version):
            raise RejectedError(f"manifest is for {manifest.name} {manifest.version}")
        if manifest.sha256 != desired.sha256:
            raise RejectedError(f"manifest sha256 {manifest.sha256} is not the desired {desired.sha256}")
        paths = [e.path for e in manifest.files]
        bad = next((p for p in paths if not is_safe_file_path(p)), None)
        if bad is not None or len(set(paths)) != len(paths):
            raise RejectedError(f"manifest lists an unsafe or duplicate file path {bad!r}")
        if manifest.size > self.max_artifact_bytes:
            raise RejectedError(f"artifact is {manifest.size} bytes, over the limit of {self.max_artifact_bytes}")

    # --- download ----------------------------------------------------------------------------------------

    def _download(self, manifest: Manifest) -> Path:
        stage = self.staging_dir / manifest.name / manifest.version
        for other in (self.staging_dir / manifest.name).glob("*"):
            if other.name != manifest.version:  # one staged version per model at a time
                shutil.rmtree(other, ignore_errors=True)
        stage.mkdir(parents=True, exist_ok=True)
        resumed = sum(_staged_bytes(stage, e.path, e.size) for e in manifest.files)
        if shutil.disk_usage(stage).free < manifest.size - resumed:
            raise OSError(f"not enough disk space in {stage} for {manifest.size - resumed} bytes")
        base = f"/v1/edge/artifacts/{manifest.name}/{manifest.version}/"
        self._fetched, started = 0, time.monotonic()
        for entry in manifest.files:
            final, part = stage / entry.path, stage / f"{entry.path}.part"
            if final.is_file() and final.stat().st_size == entry.size and sha256_file(final) == entry.sha256:
                continue
            final.unlink(missing_ok=True)
            part.parent.mkdir(parents=True, exist_ok=True)
            was_resumed = part.is_file() and part.stat().st_size > 0
            for attempt in (1, 2):
                self._retrying(
                    f"GET {base}{entry.path}", partial(self._fetch_part, base + entry.path, part, entry.size)
                )
                if sha256_file(part) == entry.sha256:
                    break
                part.unlink()
                if attempt == 2 or not was_resumed:  # a resumed part may hold stale bytes: one fresh try
                    raise RejectedError(f"{entry.path}: sha256 mismatch")
            part.replace(final)
        seconds = round(time.monotonic() - started, 3)
        info = {"model": manifest.name, "version": manifest.version, "bytes": manifest.size}
        self.report(
            "update.downloaded", {**info, "bytes_fetched": self._fetched, "bytes_resumed": resumed, "seconds": seconds}
        )
        return stage

    def _fetch_part(self, url: str, part: Path, size: int) -> None:
        offset = part.stat().st_size if part.is_file() else 0
        if offset > size:
            part.unlink()
            offset = 0
        if offset == size and size > 0:
            return
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        with self.client.stream("GET", url, headers=headers, timeout=self.timeout_s) as resp:
            if resp.status_code == 416:
                part.unlink(missing_ok=True)
                raise _RetryableError(f"GET {url}: range from {offset} not satisfiable; restarting")
            _check_status(resp, url, (200, 206))
            if resp.status_code == 206 and not resp.headers.get("content-range", "").startswith(f"bytes {offset}-"):
                raise _RetryableError(f"GET {url}: answered another range ({resp.headers.get('content-range')})")
            if resp.status_code == 200:
                offset = 0
            with part.open("r+b" if offset else "wb") as f:
                f.seek(offset)
                f.truncate()
                started, received = time.monotonic(), 0
                for chunk in resp.iter_bytes(64 * 1024):
                    if offset + received + len(chunk) > size:
                        raise RejectedError(f"{url}: the cloud sent more bytes than the manifest lists")
                    f.write(chunk)
                    received += len(chunk)
                    self._fetched += len(chunk)
                    if self.max_bytes_per_s:
                        ahead = received / self.max_bytes_per_s - (time.monotonic() - started)
                        if ahead > 0:
                            f.flush()
                            time.sleep(ahead)
                f.flush()
                os.fsync(f.fileno())
        if part.stat().st_size != size:
            raise _RetryableError(f"GET {url}: connection ended at {part.stat().st_size} of {size} bytes")

    def _retrying(self, what: str, call: Callable[[], T]) -> T:
        for attempt in range(1, self.max_attempts + 1):
            try:
                return call()
            except (httpx.TransportError, _RetryableError) as exc:
                if attempt == self.max_attempts:
                    raise _RetryableError(f"{what}: {exc or type(exc).__name__} (after {attempt} attempts)") from None
                delay = random.uniform(0, self.retry_base_s * 2 ** (attempt - 1))
                logger.info("%s: %s; retrying in %.2f s", what, exc, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    # --- smoke test --------------------------------------------------------------------------------------

    def _smoke_test(self, manifest: Manifest, staged: Path) -> None:
        started = time.monotonic()
        try:
            if manifest.kind == "causal-lm" and manifest.format in _LM_FORMATS:
                _smoke_lm(staged, manifest.metadata.get("golden") or [], self.num_threads)
            elif manifest.kind == "tensor" and manifest.format in ("onnx", "onnx-int8"):
                _smoke_onnx_tensor(staged, [e.path for e in manifest.files], self.num_threads)
            elif manifest.kind != "dataset":
                raise RejectedError(f"this device has no runtime for {manifest.kind} in {manifest.format}", block=True)
        except RejectedError:
            raise
        except Exception as exc:  # whatever the runtime raises on a broken model
            raise RejectedError(f"smoke test: {type(exc).__name__}: {exc}", block=True) from None
        seconds = time.monotonic() - started
        if seconds > self.smoke_max_s:
            raise RejectedError(
                f"smoke test took {seconds:.1f} s, over the bound of {self.smoke_max_s:g} s", block=True
            )
        self.report(
            "update.smoke_tested", {"model": manifest.name, "version": manifest.version, "seconds": round(seconds, 3)}
        )


def _runtime_missing(manifest: Manifest) -> str | None:
    """Why this device cannot run the artifact (its runtime is not installed), or None."""
    from edge_agent.models import SERVED_KINDS, runtime_missing

    if manifest.kind not in SERVED_KINDS:
        return None  # a dataset: nothing to run
    if manifest.format not in SERVED_KINDS[manifest.kind]:
        return f"this agent has no runtime for a {manifest.kind} model in {manifest.format}"
    return runtime_missing(manifest.format)


def _check_status(resp: httpx.Response, url: str, ok: tuple[int, ...]) -> None:
    if resp.status_code in ok:
        return
    message = f"GET {url}: HTTP {resp.status_code}"
    if resp.status_code >= 500 or resp.status_code == 429:
        raise _RetryableError(message)
    raise httpx.HTTPStatusError(message, request=resp.request, response=resp)


def _staged_bytes(stage: Path, path: str, size: int) -> int:
    for candidate in (stage / path, stage / f"{path}.part"):
        if candidate.is_file():
            return min(candidate.stat().st_size, size)
    return 0


def _smoke_lm(model_dir: Path, golden: Any, num_threads: int) -> None:
    from edge_agent.runtime import gguf, load_runtime
    from shared.chat_tokenizer import ChatTokenizer

    if not isinstance(golden, list) or not all(
        isinstance(g, dict) and isinstance(g.get("prompt"), str) and isinstance(g.get("greedy_ids"), list)
        for g in golden
    ):
        raise RejectedError('malformed metadata.golden: want [{"prompt": str, "greedy_ids": [int]}]', block=True)
    tokenizer = ChatTokenizer(model_dir)
    # A GGUF artifact holds one weight file per format: each is a runtime the device may serve, each is tested.
    for variant in gguf.variants(model_dir) if gguf.is_gguf_dir(model_dir) else [None]:
        runtime = load_runtime(model_dir, num_threads, variant)
        for prompt, expected in [(SMOKE_PROMPT, None), *((g["prompt"], g["greedy_ids"]) for g in golden)]:
            runtime.reset()
            logits, out = runtime.prefill(tokenizer.encode(prompt)), list[int]()
            for _ in range(SMOKE_TOKENS if expected is None else len(expected)):
                if not np.isfinite(logits).all():
                    raise RejectedError(f"smoke test: non-finite logits after {len(out)} tokens", block=True)
                out.append(int(np.argmax(logits)))
                logits = runtime.decode(out[-1])
            if expected is not None and out != expected:
                raise RejectedError(f"smoke test: greedy output for golden prompt {prompt!r} differs", block=True)


def _smoke_onnx_tensor(model_dir: Path, paths: list[str], num_threads: int) -> None:
    import onnxruntime as ort

    model = next((p for p in paths if p.endswith(".onnx")), None)
    if model is None:
        raise RejectedError("tensor artifact has no .onnx file", block=True)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = num_threads
    session = ort.InferenceSession(str(model_dir / model), opts, providers=["CPUExecutionProvider"])
    feeds = {
        i.name: np.zeros(
            [d if isinstance(d, int) and d > 0 else 1 for d in i.shape], _ORT_DTYPES.get(i.type, np.float32)
        )
        for i in session.get_inputs()
    }
    for out in session.run(None, feeds):
        if np.issubdtype(np.asarray(out).dtype, np.floating) and not np.isfinite(out).all():
            raise RejectedError("smoke test: non-finite output on a zero input", block=True)


class HealthWatch:
    """Rolls a freshly activated version back when its error rate crosses ``max_error_rate`` in its first window.

    The window starts at the version's first recorded request in this process and also ends ``window_s`` after
    its activation by the wall clock (so a restart does not watch an old version again); there must be a
    previous version to go back to, and at least ``min_requests`` outcomes.
    """

    def __init__(
        self,
        store: ModelStore,
        report: Report,
        *,
        window_s: float = 300.0,
        max_error_rate: float = 0.2,
        min_requests: int = 20,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.store, self.report = store, report
        self.window_s, self.max_error_rate, self.min_requests = window_s, max_error_rate, min_requests
        self.clock, self.wall_clock = clock, wall_clock
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], tuple[float, int, int]] = {}  # -> (first seen, requests, errors)

    def record(self, name: str, version: str, ok: bool) -> bool:
        """Count one request's outcome; True if this call rolled ``name`` back to its previous version."""
        with self._lock:
            state = self.store.state(name)
            if version != state.current or state.previous is None:
                return False
            since_activation = self.wall_clock() - (state.activated_at or self.wall_clock())
            first, requests, errors = self._counts.get((name, version), (self.clock(), 0, 0))
            if self.clock() - first > self.window_s or since_activation > self.window_s:
                return False
            requests, errors = requests + 1, errors + (not ok)
            self._counts[(name, version)] = (first, requests, errors)
            if requests < self.min_requests or errors / requests <= self.max_error_rate:
                return False
            restored = self.store.rollback(name)
            del self._counts[(name, version)]
        payload = {
            "model": name,
            "version": version,
            "restored": restored,
            "requests": requests,
            "errors": errors,
            "error_rate": round(errors / requests, 4),
        }
        logger.warning("update.rolled_back %s", payload)
        try:
            self.report("update.rolled_back", payload)
        except Exception:
            logger.exception("could not record update.rolled_back")
        return True

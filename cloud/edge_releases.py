"""Edge releases: model artifacts published for devices, and the device-authenticated download route.

Layout under ``$TIERLINE_DATA_DIR/edge-releases``::

    releases.json                      publish log, oldest first: [{name, version, sha256, published_at}]
    <name>/<version>/manifest.json     the signed manifest
    <name>/<version>/<file>...         exactly the files the manifest lists

A published version is immutable: publishing the same name and version with other bytes is refused. Every
device is told the most recently *published* version of each model, not the highest version string, so
publishing an existing version again makes it the newest: that is how the fleet is rolled back by hand.

A rollout (``controlplane.rollouts.service``) whose scope covers the edge overrides that rule for its model (the
rollout's
model is the artifact name): while it is pending, running or paused, each device gets its sticky arm's
version (baseline outside the selector); once promoted, the candidate; once rolled back or aborted, the
baseline. A publish of the model after the rollout finished makes today's rule apply again. A version the
rollout names but nobody published is left out of the answer, so devices keep what they run.

``GET /v1/edge/artifacts/{name}/{version}/{path}`` serves ``manifest.json`` or a file the manifest lists, to
enrolled devices only, with single-range HTTP Range support so that an interrupted download resumes. Devices
verify the signature and every hash themselves; this side only refuses to publish what its own key did not
sign.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

import click
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from litestar import Response, get
from litestar.openapi.spec import OpenAPIFormat, OpenAPIMediaType, OpenAPIResponse, OpenAPIType, Operation, Schema
from litestar.params import HeaderParameter
from litestar.response import Stream
from sqlalchemy.engine import Engine
from sqlmodel import Session

from cloud.edge_gateway import DEVICE, DEVICE_BEARER, DeviceCaller
from controlplane.fleet.targets import release_targets, targets_device
from controlplane.rollouts.service import FINAL, edge_version, load_plans, plans_for
from controlplane.storage.session import get_db
from controlplane.storage.tables import Device
from shared.artifacts import (
    FileEntry,
    Manifest,
    load_or_create_signing_key,
    load_public_key,
    public_path,
    read_manifest,
    sign_manifest,
    verify_signature,
)
from shared.atomic import write_atomic
from shared.edge_protocol import DesiredModel
from shared.errors import ArtifactVerificationError, ConflictError, NotFoundError
from shared.http import error_responses
from shared.settings import CoreSettings

logger = logging.getLogger(__name__)

RELEASES_DIR = "edge-releases"
INDEX_FILE = "releases.json"
MANIFEST_FILE = "manifest.json"
CHUNK_BYTES = 64 * 1024
_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")
_RANGE = re.compile(r"^\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*$", re.IGNORECASE)


def is_safe_file_path(path: str) -> bool:
    """A relative POSIX path inside the artifact: no ``..``, no absolute path, no empty or odd segment."""
    if not path or "\\" in path or "\x00" in path or path.startswith("/"):
        return False
    return all(part not in ("", ".", "..") for part in path.split("/"))


@dataclass(frozen=True, slots=True)
class Release:
    name: str
    version: str
    sha256: str
    published_at: float


@dataclass(frozen=True, slots=True)
class ServedFile:
    path: Path
    size: int
    etag: str
    media_type: str


class ReleaseStore:
    """Published edge artifacts on the cloud's disk. ``trusted_keys`` default to the platform's signing key;
    ``engine`` (where rollouts are read) defaults to the process's database."""

    def __init__(
        self, root: Path, trusted_keys: list[Ed25519PublicKey] | None = None, engine: Engine | None = None
    ) -> None:
        self.root = root
        self._trusted_keys = trusted_keys
        self._engine = engine
        self._index_cache: tuple[tuple[int, int], list[Release]] | None = None
        self._warned: set[tuple[int, str]] = set()

    @classmethod
    def from_settings(cls) -> ReleaseStore:
        return cls(CoreSettings().data_dir / RELEASES_DIR)

    def trusted_keys(self) -> list[Ed25519PublicKey]:
        if self._trusted_keys is not None:
            return self._trusted_keys
        return [load_public_key(public_path(CoreSettings().signing_key_path))]

    def version_dir(self, name: str, version: str) -> Path:
        if not (_SEGMENT.fullmatch(name) and _SEGMENT.fullmatch(version)):
            raise NotFoundError(f"no published artifact {name!r} version {version!r}")
        return self.root / name / version

    # --- publishing -----------------------------------------------------------------------------------------

    def publish(self, artifact_dir: Path, manifest_path: Path) -> Manifest:
        """Publish the artifact in ``artifact_dir`` described by the signed manifest at ``manifest_path``."""
        return self.publish_manifest(artifact_dir, read_manifest(manifest_path))

    def publish_manifest(self, artifact_dir: Path, manifest: Manifest) -> Manifest:
        """Verify ``manifest`` (trusted signature, safe paths, every file's hash) and publish a copy atomically."""
        for value, what in ((manifest.name, "name"), (manifest.version, "version")):
            if not _SEGMENT.fullmatch(value):
                raise ArtifactVerificationError(f"manifest {what} {value!r}: letters, digits and '._+-' only")
        verify_signature(manifest, self.trusted_keys())
        for entry in manifest.files:
            if not is_safe_file_path(entry.path) or entry.path == MANIFEST_FILE:
                raise ArtifactVerificationError(f"{manifest.name}: file path {entry.path!r} is not allowed")
        target = self.version_dir(manifest.name, manifest.version)
        with self._locked():
            if (target / MANIFEST_FILE).is_file():
                existing = read_manifest(target / MANIFEST_FILE)
                if existing.sha256 != manifest.sha256:
                    raise ConflictError(
                        f"{manifest.name} {manifest.version} is already published with other content; "
                        "publish it under a new version"
                    )
            else:
                self._copy_in(artifact_dir, manifest, target)
            releases = self._read_index()
            releases.append(Release(manifest.name, manifest.version, manifest.sha256, time.time()))
            body = json.dumps({"releases": [asdict(r) for r in releases]}, indent=2) + "\n"
            write_atomic(self.root / INDEX_FILE, body.encode())
        return manifest

    def _copy_in(self, artifact_dir: Path, manifest: Manifest, target: Path) -> None:
        for stale in target.parent.glob(".tmp-*"):  # crashed publishes (we hold the lock: none is running)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = target.with_name(f".tmp-{target.name}-{uuid.uuid4().hex[:8]}")
        try:
            for entry in manifest.files:
                _copy_checked(artifact_dir / entry.path, tmp / entry.path, entry)
            (tmp / MANIFEST_FILE).write_text(manifest.to_json())
            for path in tmp.rglob("*"):
                if path.is_file():
                    with path.open("rb") as f:
                        os.fsync(f.fileno())
            if target.exists():  # a directory without its manifest: a crashed publish, never served
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with (self.root / ".lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    # --- reading ---------------------------------------------------------------------------------------------

    def releases(self) -> list[Release]:
        """Every publish, oldest first."""
        return list(self._read_index())

    def _read_index(self) -> list[Release]:
        path = self.root / INDEX_FILE
        try:
            st = path.stat()
        except FileNotFoundError:
            return []
        stamp = (st.st_mtime_ns, st.st_size)
        if self._index_cache is not None and self._index_cache[0] == stamp:
            return list(self._index_cache[1])
        releases = [Release(**r) for r in json.loads(path.read_text())["releases"]]
        self._index_cache = (stamp, releases)
        return list(releases)

    def desired(self, device: Device) -> list[DesiredModel]:
        """Per model: the version a rollout assigns this device, else the most recently published one that
        targets it (``controlplane.fleet.targets``: a release with a target only goes to the devices it selects)."""
        releases = self._read_index()
        if not releases:
            return []
        with Session(self._engine or get_db()) as session:
            plans = load_plans(session, "edge")
            targets = release_targets(session)
        newest: dict[str, Release] = {}
        published: dict[tuple[str, str], Release] = {}
        for release in releases:
            published[(release.name, release.version)] = release
            if not targets_device(targets.get((release.name, release.version)), device):
                continue
            newest.pop(release.name, None)
            newest[release.name] = release
        if not newest:
            return []
        chosen: list[Release] = []
        for name, release in sorted(newest.items()):
            plan = plans_for(plans, name, device.tenant_id)
            published_after_end = (
                plan is not None
                and plan.status in FINAL
                and plan.finished_at is not None
                and release.published_at > plan.finished_at.timestamp()
            )
            if plan is None or published_after_end:
                chosen.append(release)
                continue
            version = edge_version(plan, device.id, device.tenant_id, device.labels)
            assigned = published.get((name, version))
            if assigned is not None:
                chosen.append(assigned)
            elif (plan.id, version) not in self._warned:
                self._warned.add((plan.id, version))
                logger.warning(
                    "rollout %s assigns %s %s, which is not published; devices keep theirs", plan.id, name, version
                )
        return [
            DesiredModel(
                name=r.name,
                version=r.version,
                sha256=r.sha256,
                manifest_url=f"/v1/edge/artifacts/{r.name}/{r.version}/{MANIFEST_FILE}",
            )
            for r in chosen
        ]

    def locate(self, name: str, version: str, path: str) -> ServedFile:
        """The manifest or a listed file of a published version; anything else (or escaping it) is a 404."""
        missing = NotFoundError(f"no artifact file {name}/{version}/{path}")
        try:
            vdir = self.version_dir(name, version).resolve(strict=True)
            manifest = read_manifest(vdir / MANIFEST_FILE)
        except (OSError, ArtifactVerificationError):
            raise missing from None
        if not vdir.is_relative_to(self.root.resolve()):
            raise missing
        if path == MANIFEST_FILE:
            return ServedFile(vdir / MANIFEST_FILE, (vdir / MANIFEST_FILE).stat().st_size, "", "application/json")
        entry = next((e for e in manifest.files if e.path == path), None)
        if entry is None or not is_safe_file_path(path):
            raise missing
        try:
            real = (vdir / path).resolve(strict=True)
        except OSError:
            raise missing from None
        if not real.is_relative_to(vdir) or not real.is_file():
            raise missing
        return ServedFile(real, real.stat().st_size, f'"{entry.sha256}"', "application/octet-stream")


def _copy_checked(src: Path, dest: Path, entry: FileEntry) -> None:
    if not src.is_file():
        raise ArtifactVerificationError(f"{src}: missing")
    dest.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with src.open("rb") as fin, dest.open("wb") as fout:
        while chunk := fin.read(1 << 20):
            digest.update(chunk)
            fout.write(chunk)
    if dest.stat().st_size != entry.size:
        raise ArtifactVerificationError(f"{src}: size {dest.stat().st_size} != {entry.size}")
    if digest.hexdigest() != entry.sha256:
        raise ArtifactVerificationError(f"{src}: sha256 mismatch")


# --- HTTP -----------------------------------------------------------------------------------------------------


class RangeNotSatisfiableError(Exception):
    pass


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The inclusive byte range a ``Range`` header asks for, or None for the whole file.

    Headers this server does not honour (several ranges, bad syntax, last < first) are ignored, as RFC 9110
    allows; a well-formed range that starts past the end raises RangeNotSatisfiableError.
    """
    match = _RANGE.match(header or "")
    if match is None or match.groups() == ("", ""):
        return None
    first, last = match.groups()
    if first == "":
        suffix = int(last)
        if suffix == 0 or size == 0:
            raise RangeNotSatisfiableError
        return max(0, size - suffix), size - 1
    start = int(first)
    if last and int(last) < start:
        return None
    if start >= size:
        raise RangeNotSatisfiableError
    return start, min(int(last), size - 1) if last else size - 1


def _read(path: Path, start: int, length: int) -> Iterator[bytes]:
    with path.open("rb") as f:
        f.seek(start)
        while length > 0:
            chunk = f.read(min(CHUNK_BYTES, length))
            if not chunk:
                return
            length -= len(chunk)
            yield chunk


def range_response(served: ServedFile, range_header: str | None, if_range: str | None) -> Response[Any]:
    headers = {"Accept-Ranges": "bytes"}
    if served.etag:
        headers["ETag"] = served.etag
        if if_range is not None and if_range.strip() != served.etag:
            range_header = None  # the client's partial copy is of other bytes: send them all
    try:
        span = parse_range(range_header, served.size)
    except RangeNotSatisfiableError:
        error = {"message": "requested range not satisfiable", "type": "invalid_request_error", "param": "Range"}
        return Response(
            {"error": {**error, "code": "range_not_satisfiable"}},
            status_code=416,
            headers={**headers, "Content-Range": f"bytes */{served.size}"},
        )
    status, (start, end) = (200, (0, served.size - 1)) if span is None else (206, span)
    length = end - start + 1
    headers["Content-Length"] = str(length)
    if status == 206:
        headers["Content-Range"] = f"bytes {start}-{end}/{served.size}"
    return Stream(_read(served.path, start, length), status_code=status, media_type=served.media_type, headers=headers)


@dataclass
class _ArtifactOperation(Operation):
    """200 carries the manifest (JSON) or a file's bytes, 206 part of a file: not the JSON Litestar assumes."""

    def __post_init__(self) -> None:
        binary = Schema(type=OpenAPIType.STRING, format=OpenAPIFormat.BINARY)
        file = {"application/octet-stream": OpenAPIMediaType(schema=binary)}
        whole = {"application/json": OpenAPIMediaType(schema=Schema()), **file}
        self.responses = {
            **(self.responses or {}),
            "200": OpenAPIResponse(description="The manifest (JSON) or the whole file", content=whole),
            "206": OpenAPIResponse(description="The part of a file the Range header asked for", content=file),
        }


@get(
    "/v1/edge/artifacts/{name:str}/{version:str}/{path:path}",
    dependencies=DEVICE,
    security=DEVICE_BEARER,
    responses=error_responses(400, 401, 404, 416),
    operation_class=_ArtifactOperation,
)
async def download_artifact(
    releases: ReleaseStore,
    device: DeviceCaller,
    name: str,
    version: str,
    path: str,
    range_header: Annotated[str | None, HeaderParameter(name="range", description="bytes=FIRST-LAST")] = None,
    if_range: Annotated[str | None, HeaderParameter(name="if-range", description="the partial copy's ETag")] = None,
) -> Response[Any]:
    """A published artifact's manifest or one of its files, for enrolled devices; files support ``Range: bytes=``."""
    path = path.lstrip("/")
    served = await asyncio.to_thread(releases.locate, name, version, path)
    if path == MANIFEST_FILE:
        range_header = None  # a small JSON document, always sent whole: a byte range of it would not be JSON
    return range_response(served, range_header, if_range)


ARTIFACT_ROUTES = [download_artifact]


# --- CLI --------------------------------------------------------------------------------------------------------


@click.command("publish")
@click.argument("artifact_dir", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option(
    "--manifest",
    "manifest_path",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="signed manifest (default: ARTIFACT_DIR/../../manifests/<dir name>.json, as in a built zoo)",
)
@click.option("--as-version", default=None, help="publish under this version, re-signed with the platform key")
def publish_command(artifact_dir: Path, manifest_path: Path | None, as_version: str | None) -> None:
    """Publish an edge artifact for devices: they install it at their next sync.

    Publishing a version that is already published makes it the newest again, which rolls devices back.
    """
    store = ReleaseStore.from_settings()
    path = manifest_path or artifact_dir.parent.parent / "manifests" / f"{artifact_dir.name}.json"
    manifest = read_manifest(path)
    if as_version is not None:
        verify_signature(manifest, store.trusted_keys())  # never launder an artifact the platform did not sign
        manifest.metadata = {**manifest.metadata, "published_from_version": manifest.version}
        manifest.version = as_version
        sign_manifest(manifest, load_or_create_signing_key(CoreSettings().signing_key_path))
    store.publish_manifest(artifact_dir, manifest)
    click.echo(
        f"published {manifest.name} {manifest.version} ({len(manifest.files)} files, {manifest.size} bytes, "
        f"sha256 {manifest.sha256}); devices install it at their next sync"
    )

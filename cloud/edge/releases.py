"""Edge releases: model artifacts published for devices, and the device-authenticated download route.

Nothing of it lives on one gateway: every replica reads the same state.

- the database holds each published version's signed manifest (``edge_release``, one row per name and
  version) and the publish log (``edge_publish``, oldest first);
- the artifact store (``controlplane.registry.store``: ``TIERLINE_ARTIFACT_STORE``, a directory every replica
  mounts or ``s3://bucket/prefix``) holds the files' bytes, each a blob named by its sha256 (the registry's
  models and the edge's artifacts share blobs with the same bytes).

A published version is immutable: publishing the same name and version with other bytes is refused. Every
device is told the most recently *published* version of each model, not the highest version string, so
publishing an existing version again makes it the newest: that is how the fleet is rolled back by hand.

A rollout (``controlplane.rollouts.service``) whose scope covers the edge overrides that rule for its model (the
rollout's model is the artifact name): while it is pending, running or paused, each device gets its sticky
arm's version (baseline outside the selector); once promoted, the candidate; once rolled back or aborted, the
baseline. A publish of the model after the rollout finished makes today's rule apply again. A version the
rollout names but nobody published is left out of the answer, so devices keep what they run.

``GET /v1/edge/artifacts/{name}/{version}/{path}`` serves ``manifest.json`` or a file the manifest lists, to
enrolled devices only, with single-range HTTP Range support so that an interrupted download resumes (a ranged
read of the blob: a seek on disk, a ranged GET on S3). Devices verify the signature and every hash
themselves; this side only refuses to publish what its own key did not sign.

Releases published before they moved into the database (``$TIERLINE_DATA_DIR/edge-releases/releases.json``
and its directories) are imported once, at the first start of a gateway that finds the publish log empty.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import click
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from litestar import Response, get
from litestar.openapi.spec import OpenAPIFormat, OpenAPIMediaType, OpenAPIResponse, OpenAPIType, Operation, Schema
from litestar.params import HeaderParameter
from litestar.response import Stream
from sqlalchemy import func
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from cloud.edge.gateway import DEVICE, DEVICE_BEARER, DeviceCaller
from controlplane.fleet.releases import Release, desired_releases, published_releases
from controlplane.fleet.targets import set_release_target
from controlplane.registry.store import ArtifactStore, store_from_settings
from controlplane.storage.audit import audit
from controlplane.storage.session import get_db
from controlplane.storage.tables import Device, EdgePublish, EdgeRelease, Rollout
from shared.artifacts import (
    Manifest,
    load_or_create_signing_key,
    load_public_key,
    public_path,
    read_manifest,
    sign_manifest,
    verify_signature,
)
from shared.edge_protocol import DesiredModel
from shared.errors import ArtifactVerificationError, ConflictError, NotFoundError, ValidationError
from shared.http import error_responses
from shared.settings import CoreSettings
from shared.targeting import check_target, describe

logger = logging.getLogger(__name__)

LEGACY_DIR = "edge-releases"  # where releases lived before the database held them: imported once
LEGACY_INDEX = "releases.json"
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
class ServedFile:
    size: int
    etag: str
    media_type: str
    chunks: Callable[[int, int], Iterator[bytes]]  # (start, length) -> the bytes, in chunks


class ReleaseStore:
    """Published edge artifacts: manifests and the publish log in the database, bytes in the artifact store.

    ``engine`` defaults to the process's database, ``blobs`` to the store ``TIERLINE_ARTIFACT_STORE`` names,
    ``trusted_keys`` to the platform's signing key."""

    def __init__(
        self,
        engine: Engine | None = None,
        blobs: ArtifactStore | None = None,
        trusted_keys: list[Ed25519PublicKey] | None = None,
    ) -> None:
        self._engine = engine
        self._blobs = blobs
        self._trusted_keys = trusted_keys
        self._warned: set[tuple[int, str]] = set()

    @classmethod
    def from_settings(cls) -> ReleaseStore:
        return cls()

    @property
    def engine(self) -> Engine:
        return self._engine or get_db()

    @property
    def blobs(self) -> ArtifactStore:
        if self._blobs is None:
            self._blobs = store_from_settings()
        return self._blobs

    def trusted_keys(self) -> list[Ed25519PublicKey]:
        if self._trusted_keys is not None:
            return self._trusted_keys
        return [load_public_key(public_path(CoreSettings().signing_key_path))]

    # --- publishing -----------------------------------------------------------------------------------------

    def publish(self, artifact_dir: Path, manifest_path: Path) -> Manifest:
        """Publish the artifact in ``artifact_dir`` described by the signed manifest at ``manifest_path``."""
        return self.publish_manifest(artifact_dir, read_manifest(manifest_path))

    def publish_manifest(
        self,
        artifact_dir: Path,
        manifest: Manifest,
        *,
        published_at: datetime | None = None,
        target: list[str] | None = None,
        actor: str = "",
    ) -> Manifest:
        """Verify ``manifest`` (trusted signature, safe paths, every file's hash), store the files' bytes, then
        record the version and its publish in one transaction (a reader sees all of it or nothing). ``target``
        (selector terms, ``controlplane.fleet.targets``) is set in that same transaction, so no device outside it
        ever hears of the version; None leaves the version's target as it is."""
        if target is not None:
            check_target(target)  # a bad term is refused before any byte is stored
        for value, what in ((manifest.name, "name"), (manifest.version, "version")):
            if not _SEGMENT.fullmatch(value):
                raise ArtifactVerificationError(f"manifest {what} {value!r}: letters, digits and '._+-' only")
        verify_signature(manifest, self.trusted_keys())
        for entry in manifest.files:
            if not is_safe_file_path(entry.path) or entry.path == MANIFEST_FILE:
                raise ArtifactVerificationError(f"{manifest.name}: file path {entry.path!r} is not allowed")
        existing = self._release(manifest.name, manifest.version)
        if existing is not None and existing.sha256 != manifest.sha256:
            raise self._conflict(manifest)
        if existing is None:
            for entry in manifest.files:  # bytes first: a version is recorded only once all its bytes are stored
                self._store_file(artifact_dir / entry.path, entry.sha256, entry.size)
        for attempt in range(2):
            with Session(self.engine) as session:
                if attempt or existing is None:
                    row = session.exec(
                        select(EdgeRelease).where(
                            EdgeRelease.name == manifest.name, EdgeRelease.version == manifest.version
                        )
                    ).first()
                    if row is not None and row.sha256 != manifest.sha256:
                        raise self._conflict(manifest)
                    if row is None:
                        session.add(
                            EdgeRelease(
                                name=manifest.name,
                                version=manifest.version,
                                sha256=manifest.sha256,
                                manifest=manifest.to_json(),
                            )
                        )
                stamp = published_at or datetime.now(UTC)
                if target is not None:
                    set_release_target(session, manifest.name, manifest.version, target, actor=actor or "publish")
                session.add(EdgePublish(name=manifest.name, version=manifest.version, published_at=stamp))
                audit(  # in the publish's transaction: a publish is never without its audit row
                    session,
                    actor or "system:publish",
                    "release.publish",
                    f"release/{manifest.name}/{manifest.version}",
                    None,
                    {
                        "sha256": manifest.sha256,
                        "files": len(manifest.files),
                        "bytes": manifest.size,
                        "published_at": stamp.isoformat(),
                        **({"target": target} if target is not None else {}),
                        **{k: v for k, v in manifest.metadata.items() if k == "published_from_version"},
                    },
                )
                try:
                    session.commit()
                    return manifest
                except IntegrityError:  # another replica recorded this version at the same moment: look again
                    session.rollback()
        raise ConflictError(f"{manifest.name} {manifest.version}: concurrent publishes; try again")

    @staticmethod
    def _conflict(manifest: Manifest) -> ConflictError:
        return ConflictError(
            f"{manifest.name} {manifest.version} is already published with other content; "
            "publish it under a new version"
        )

    def _store_file(self, src: Path, sha256: str, size: int) -> None:
        if not src.is_file():
            raise ArtifactVerificationError(f"{src}: missing")
        if src.stat().st_size != size:
            raise ArtifactVerificationError(f"{src}: size {src.stat().st_size} != {size}")
        try:
            self.blobs.put_file(src, expected_sha256=sha256)
        except ValidationError:
            raise ArtifactVerificationError(f"{src}: sha256 mismatch") from None

    def import_legacy(self, root: Path) -> int:
        """Import the releases published on this host's disk before the database held them (``root`` is
        ``$TIERLINE_DATA_DIR/edge-releases``), in their order, when the publish log is still empty; the number
        of publishes imported. A version whose files are gone is skipped with a warning."""
        index = root / LEGACY_INDEX
        if not index.is_file():
            return 0
        with Session(self.engine) as session:
            if session.exec(select(func.count()).select_from(EdgePublish)).one():
                return 0
        imported = 0
        for entry in json.loads(index.read_text())["releases"]:
            name, version = str(entry["name"]), str(entry["version"])
            vdir = root / name / version
            try:
                manifest = read_manifest(vdir / MANIFEST_FILE)
                stamp = datetime.fromtimestamp(float(entry["published_at"]), UTC)
                self.publish_manifest(vdir, manifest, published_at=stamp, actor="system:import")
            except (OSError, ArtifactVerificationError, ConflictError) as exc:
                logger.warning("edge release %s %s not imported from %s: %s", name, version, root, exc)
                continue
            imported += 1
        if imported:
            logger.info("imported %d edge release publishes from %s into the database", imported, root)
        return imported

    # --- reading ---------------------------------------------------------------------------------------------

    def governing_rollout(self, name: str) -> Rollout | None:
        """The active rollout (pending, running or paused) of the edge artifact ``name`` on devices, if any: while
        one runs, it, not the newest publish, decides which version a device installs."""
        with Session(self.engine) as session:
            row = session.exec(
                select(Rollout)
                .where(
                    Rollout.model == name,
                    col(Rollout.scope).in_(("edge", "both")),
                    col(Rollout.status).in_(("pending", "running", "paused")),
                )
                .order_by(col(Rollout.id).desc())
            ).first()
            if row is not None:
                session.expunge(row)
            return row

    def _release(self, name: str, version: str) -> EdgeRelease | None:
        with Session(self.engine) as session:
            row = session.exec(
                select(EdgeRelease).where(EdgeRelease.name == name, EdgeRelease.version == version)
            ).first()
            if row is not None:
                session.expunge(row)
            return row

    def releases(self) -> list[Release]:
        """Every publish, oldest first."""
        with Session(self.engine) as session:
            return published_releases(session)

    def manifest(self, name: str, version: str) -> Manifest:
        """The published manifest of ``name`` ``version``; NotFoundError when it is not published."""
        row = self._release(name, version)
        if row is None:
            raise NotFoundError(f"no published artifact {name!r} version {version!r}")
        return Manifest.from_json(row.manifest)

    def desired(self, device: Device) -> list[DesiredModel]:
        """Per model: the version a rollout assigns this device, else the most recently published one that
        targets it (``controlplane.fleet.releases``)."""

        def unpublished(plan_id: int, name: str, version: str) -> None:
            if (plan_id, version) not in self._warned:
                self._warned.add((plan_id, version))
                logger.warning(
                    "rollout %s assigns %s %s, which is not published; devices keep theirs", plan_id, name, version
                )

        with Session(self.engine) as session:
            chosen = desired_releases(session, device, unpublished)
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
        """The manifest or a listed file of a published version; anything else is a 404."""
        missing = NotFoundError(f"no artifact file {name}/{version}/{path}")
        if not (_SEGMENT.fullmatch(name) and _SEGMENT.fullmatch(version)):
            raise missing
        row = self._release(name, version)
        if row is None:
            raise missing
        if path == MANIFEST_FILE:
            body = row.manifest.encode()
            return ServedFile(len(body), "", "application/json", lambda start, length: iter([body[start:][:length]]))
        try:
            manifest = Manifest.from_json(row.manifest)
        except ArtifactVerificationError:
            raise missing from None
        entry = next((e for e in manifest.files if e.path == path), None)
        if entry is None or not is_safe_file_path(path):
            raise missing
        blobs, sha256 = self.blobs, entry.sha256

        def chunks(start: int, length: int) -> Iterator[bytes]:
            return blobs.iter_range(sha256, start, length, CHUNK_BYTES)

        return ServedFile(entry.size, f'"{entry.sha256}"', "application/octet-stream", chunks)


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
    return Stream(served.chunks(start, length), status_code=status, media_type=served.media_type, headers=headers)


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
@click.option(
    "--target",
    "target",
    multiple=True,
    help="send it only to the devices this selects (repeatable, all must hold): ring=beta, site!=lab, "
    "device.arch=x86_64, device.memory_mb>=2048, device.runtime=tflite, device.bucket<=19; set in the same "
    "transaction as the publish [default: the version's target as it is, every device if none]",
)
def publish_command(
    artifact_dir: Path, manifest_path: Path | None, as_version: str | None, target: tuple[str, ...]
) -> None:
    """Publish an edge artifact for devices: they install it at their next sync.

    Publishing a version that is already published makes it the newest again, which rolls devices back.
    """
    from controlplane.storage.audit import cli_actor

    store = ReleaseStore.from_settings()
    path = manifest_path or artifact_dir.parent.parent / "manifests" / f"{artifact_dir.name}.json"
    manifest = read_manifest(path)
    if as_version is not None:
        verify_signature(manifest, store.trusted_keys())  # never launder an artifact the platform did not sign
        manifest.metadata = {**manifest.metadata, "published_from_version": manifest.version}
        manifest.version = as_version
        sign_manifest(manifest, load_or_create_signing_key(CoreSettings().signing_key_path))
    terms = list(target) if target else None
    try:
        store.publish_manifest(artifact_dir, manifest, target=terms, actor=cli_actor())
    except ValidationError as exc:
        raise click.BadParameter(exc.message, param_hint="--target") from None
    who = f"the devices {describe(check_target(terms))} selects" if terms else "devices"
    governing = store.governing_rollout(manifest.name)
    when = (
        f"rollout {governing.id} ({governing.status}, {governing.baseline_version} → {governing.candidate_version} "
        f"at {governing.weight:g} %) decides which devices get which version: see `tierline rollouts get "
        f"{governing.id}`"
        if governing is not None
        else f"{who} install it at their next sync"
    )
    click.echo(
        f"published {manifest.name} {manifest.version} ({len(manifest.files)} files, {manifest.size} bytes, "
        f"sha256 {manifest.sha256}); {when}"
    )

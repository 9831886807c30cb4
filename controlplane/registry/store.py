"""Where the registry keeps artifact bytes: content-addressed blobs, on the local disk or in S3.

Every file of an artifact is one blob named by its sha256, so the same bytes are stored once however many
versions hold them. A write streams into a staging file while it hashes and counts (constant memory, a size
cap), is checked against the hash the caller expects, and only then becomes visible under its hash:

- :class:`LocalArtifactStore` (the default): ``<root>/sha256/ab/abcdef...``; staged in ``<root>/tmp``, fsynced,
  then renamed into place (a reader never sees half a blob).
- :class:`S3ArtifactStore`: ``s3://bucket/prefix/sha256/ab/abcdef...`` through boto3, any S3-compatible
  endpoint (``TIERLINE_ARTIFACT_STORE_ENDPOINT_URL``); staged on local disk, then uploaded unless the key
  already exists.

:func:`store_from_settings` picks one: ``TIERLINE_ARTIFACT_STORE=s3://bucket/prefix`` or a directory
(default ``$TIERLINE_DATA_DIR/artifacts``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.errors import ApplicationError, ConfigurationError, NotFoundError, ValidationError

CHUNK_BYTES = 1 << 20
DEFAULT_MAX_ARTIFACT_BYTES = 4 << 30
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class PayloadTooLargeError(ApplicationError):
    """An upload ran past the artifact size cap; nothing of it was kept."""

    status_code = 413
    error_type = "invalid_request_error"
    code = "payload_too_large"


class ArtifactStoreSettings(BaseSettings):
    """Where artifact bytes go, and how large one artifact may be."""

    model_config = SettingsConfigDict(env_prefix="TIERLINE_", extra="ignore")

    data_dir: Path = Path("./var")
    artifact_store: str | None = Field(
        None, description="s3://bucket/prefix, or a directory; default $TIERLINE_DATA_DIR/artifacts"
    )
    artifact_store_endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, moto, R2)")
    artifact_store_region: str = Field("us-east-1", description="S3 region")
    max_artifact_bytes: int = Field(
        DEFAULT_MAX_ARTIFACT_BYTES, gt=0, description="largest artifact (all its files together) accepted"
    )


def is_sha256(value: str) -> bool:
    return bool(_SHA256.fullmatch(value))


def blob_key(sha256: str) -> str:
    """The relative key of a blob: ``sha256/ab/abcdef...``."""
    if not is_sha256(sha256):
        raise ValidationError(f"{sha256!r} is not a lowercase hex sha256", param="sha256")
    return f"sha256/{sha256[:2]}/{sha256}"


class BlobReader(Protocol):
    """What :meth:`ArtifactStore.open` returns: ``read`` in chunks, used as a context manager."""

    def read(self, n: int = -1, /) -> bytes: ...

    def close(self) -> None: ...

    def __enter__(self) -> Any: ...

    def __exit__(self, *args: Any) -> Any: ...


@dataclass(frozen=True, slots=True)
class StoredBlob:
    sha256: str
    size: int
    uri: str


class BlobWriter:
    """Staged bytes of one blob: ``write`` chunks, then ``commit`` (or ``discard``). The cap counts from
    ``max_bytes``; past it the staging file is removed and :class:`PayloadTooLargeError` raised."""

    def __init__(self, store: ArtifactStore, staging_dir: Path, max_bytes: int, what: str = "artifact") -> None:
        staging_dir.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=staging_dir, prefix="blob-", suffix=".part")
        self._file: IO[bytes] | None = os.fdopen(fd, "wb")
        self.path = Path(name)
        self._store = store
        self._hash = hashlib.sha256()
        self._max_bytes = max_bytes
        self._what = what
        self.size = 0

    def write(self, chunk: bytes) -> None:
        if self._file is None:
            raise RuntimeError("blob writer is closed")
        self.size += len(chunk)
        if self.size > self._max_bytes:
            self.discard()
            raise PayloadTooLargeError(
                f"{self._what} exceeds the size limit of {self._max_bytes} bytes (TIERLINE_MAX_ARTIFACT_BYTES)"
            )
        self._hash.update(chunk)
        self._file.write(chunk)

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()

    def finish(self) -> str:
        """Flush and fsync the staging file; return its sha256 (the blob is not stored yet)."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
        return self.sha256

    def commit(self, expected_sha256: str | None = None, *, param: str = "sha256") -> StoredBlob:
        """Store the staged bytes under their hash; refuse (400, naming ``param``) when they hash otherwise."""
        digest = self.finish()
        try:
            if expected_sha256 is not None and expected_sha256.lower() != digest:
                raise ValidationError(
                    f"{self._what} has sha256 {digest}, not the expected {expected_sha256}", param=param
                )
            return self._store._adopt(self.path, digest, self.size)
        finally:
            self.discard()

    def discard(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> BlobWriter:
        return self

    def __exit__(self, *_: object) -> None:
        self.discard()


class ArtifactStore(ABC):
    """Content-addressed blob storage. Subclasses implement :meth:`_adopt`, :meth:`exists`, :meth:`open`."""

    def __init__(self, staging_dir: Path, max_bytes: int) -> None:
        self.staging_dir = staging_dir
        self.max_bytes = max_bytes

    @abstractmethod
    def uri(self, sha256: str) -> str:
        """Where the blob named ``sha256`` lives, for records and people."""

    @abstractmethod
    def exists(self, sha256: str) -> bool: ...

    @abstractmethod
    def open(self, sha256: str) -> BlobReader:
        """A binary stream of the blob; :class:`NotFoundError` when absent."""

    @abstractmethod
    def _adopt(self, staged: Path, sha256: str, size: int) -> StoredBlob:
        """Make the fsynced staging file ``staged`` the blob ``sha256`` (the caller removes ``staged`` after)."""

    def writer(self, *, max_bytes: int | None = None, what: str = "artifact") -> BlobWriter:
        return BlobWriter(self, self.staging_dir, self.max_bytes if max_bytes is None else max_bytes, what)

    def put_stream(
        self, stream: IO[bytes], *, expected_sha256: str | None = None, what: str = "artifact"
    ) -> StoredBlob:
        with self.writer(what=what) as w:
            while chunk := stream.read(CHUNK_BYTES):
                w.write(chunk)
            return w.commit(expected_sha256)

    def put_file(self, path: Path, *, expected_sha256: str | None = None) -> StoredBlob:
        with path.open("rb") as f:
            return self.put_stream(f, expected_sha256=expected_sha256, what=str(path))

    def put_bytes(self, data: bytes) -> StoredBlob:
        with self.writer() as w:
            w.write(data)
            return w.commit()

    def read_bytes(self, sha256: str) -> bytes:
        with self.open(sha256) as f:
            return f.read()

    def iter_range(self, sha256: str, start: int, length: int, chunk: int = CHUNK_BYTES) -> Iterator[bytes]:
        """``length`` bytes of the blob from offset ``start``, in chunks (an HTTP Range response streams these).
        The generic way reads past the first ``start`` bytes; the stores below seek or ask for the range."""
        with self.open(sha256) as f:
            skip = start
            while skip > 0 and (data := f.read(min(chunk, skip))):
                skip -= len(data)
            yield from _chunks(f, length, chunk)

    def fetch(self, sha256: str, dest: Path) -> None:
        """Copy the blob to ``dest`` and check its hash on the way."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        h = hashlib.sha256()
        with self.open(sha256) as src, dest.open("wb") as out:
            while chunk := src.read(CHUNK_BYTES):
                h.update(chunk)
                out.write(chunk)
        if h.hexdigest() != sha256:
            dest.unlink(missing_ok=True)
            raise ApplicationError(f"blob {sha256} in {self.uri(sha256)} is corrupt (hashes to {h.hexdigest()})")


class LocalArtifactStore(ArtifactStore):
    """Blobs under ``root/sha256/``; staging under ``root/tmp`` (same filesystem, so the rename is atomic)."""

    def __init__(self, root: Path, max_bytes: int = DEFAULT_MAX_ARTIFACT_BYTES) -> None:
        super().__init__(root / "tmp", max_bytes)
        self.root = root

    def path(self, sha256: str) -> Path:
        return self.root / blob_key(sha256)

    def uri(self, sha256: str) -> str:
        return self.path(sha256).resolve().as_uri()

    def exists(self, sha256: str) -> bool:
        return self.path(sha256).is_file()

    def open(self, sha256: str) -> BlobReader:
        try:
            return self.path(sha256).open("rb")
        except FileNotFoundError:
            raise NotFoundError(f"no blob {sha256} in the artifact store", param="sha256") from None

    def iter_range(self, sha256: str, start: int, length: int, chunk: int = CHUNK_BYTES) -> Iterator[bytes]:
        with self.open(sha256) as f:
            f.seek(start)
            yield from _chunks(f, length, chunk)

    def _adopt(self, staged: Path, sha256: str, size: int) -> StoredBlob:
        target = self.path(sha256)
        if not target.is_file():  # same bytes already stored: keep the one copy
            target.parent.mkdir(parents=True, exist_ok=True)
            staged.replace(target)
            _fsync_dir(target.parent)
        return StoredBlob(sha256, size, self.uri(sha256))


def _chunks(f: BlobReader, length: int, chunk: int) -> Iterator[bytes]:
    while length > 0:
        data = f.read(min(chunk, length))
        if not data:
            return
        length -= len(data)
        yield data


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class S3ArtifactStore(ArtifactStore):
    """Blobs in an S3-compatible bucket under ``prefix``, through boto3 (the ``s3`` extra)."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        staging_dir: Path,
        max_bytes: int = DEFAULT_MAX_ARTIFACT_BYTES,
        endpoint_url: str | None = None,
        region: str = "us-east-1",
        client: Any = None,
    ) -> None:
        super().__init__(staging_dir, max_bytes)
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        if client is None:
            try:
                import boto3
            except ImportError as exc:  # pragma: no cover - the s3 extra is installed in dev
                raise ConfigurationError("an s3:// artifact store needs boto3: pip install 'tierline[s3]'") from exc
            client = boto3.client("s3", endpoint_url=endpoint_url, region_name=region)
        self.client = client

    def key(self, sha256: str) -> str:
        return f"{self.prefix}/{blob_key(sha256)}" if self.prefix else blob_key(sha256)

    def uri(self, sha256: str) -> str:
        return f"s3://{self.bucket}/{self.key(sha256)}"

    def exists(self, sha256: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self.key(sha256))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise
        return True

    def open(self, sha256: str) -> BlobReader:
        from botocore.exceptions import ClientError

        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self.key(sha256))["Body"]
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                raise NotFoundError(f"no blob {sha256} in the artifact store", param="sha256") from None
            raise
        return _Readable(body)

    def iter_range(self, sha256: str, start: int, length: int, chunk: int = CHUNK_BYTES) -> Iterator[bytes]:
        """One ranged GET: only the bytes asked for cross the network."""
        from botocore.exceptions import ClientError

        if length <= 0:
            return
        try:
            body = self.client.get_object(
                Bucket=self.bucket, Key=self.key(sha256), Range=f"bytes={start}-{start + length - 1}"
            )["Body"]
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                raise NotFoundError(f"no blob {sha256} in the artifact store", param="sha256") from None
            raise
        with _Readable(body) as f:
            yield from _chunks(f, length, chunk)

    def _adopt(self, staged: Path, sha256: str, size: int) -> StoredBlob:
        if not self.exists(sha256):
            with staged.open("rb") as f:
                self.client.upload_fileobj(f, self.bucket, self.key(sha256))
        return StoredBlob(sha256, size, self.uri(sha256))


class _Readable:
    """A botocore StreamingBody as a :class:`BlobReader`."""

    def __init__(self, body: Any) -> None:
        self._body = body

    def read(self, n: int = -1) -> bytes:
        data: bytes = self._body.read(None if n < 0 else n)
        return data

    def close(self) -> None:
        self._body.close()

    def __enter__(self) -> _Readable:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def store_from_settings(settings: ArtifactStoreSettings | None = None) -> ArtifactStore:
    """The store ``TIERLINE_ARTIFACT_STORE`` names (default: a directory in the data dir)."""
    s = settings or ArtifactStoreSettings()
    where = s.artifact_store
    if where and where.startswith("s3://"):
        bucket, _, prefix = where.removeprefix("s3://").partition("/")
        if not bucket:
            raise ConfigurationError(f"TIERLINE_ARTIFACT_STORE={where!r} names no bucket (s3://bucket/prefix)")
        return S3ArtifactStore(
            bucket,
            prefix,
            staging_dir=s.data_dir / "artifacts-staging",
            max_bytes=s.max_artifact_bytes,
            endpoint_url=s.artifact_store_endpoint_url,
            region=s.artifact_store_region,
        )
    if where and "://" in where:
        raise ConfigurationError(f"TIERLINE_ARTIFACT_STORE={where!r}: use s3://bucket/prefix or a directory")
    return LocalArtifactStore(Path(where) if where else s.data_dir / "artifacts", s.max_artifact_bytes)


@contextlib.contextmanager
def scratch_dir(store: ArtifactStore, prefix: str) -> Iterator[Path]:
    """A temporary directory beside the store's staging area, removed afterwards."""
    store.staging_dir.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(dir=store.staging_dir, prefix=prefix))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)

"""The cloud's own ids of idempotent requests and async jobs, keyed with a server secret.

An idempotent request's usage record and a job submitted with an ``Idempotency-Key`` get ids that every retry
(and every replica) derives alike, so a retry is billed and queued once. They are HMAC-SHA256 of the tenant and
the key under a secret that never leaves the server (``$TIERLINE_DATA_DIR/keys/cloud-ids.key``, mode 0600, made
on first start; replicas share it as they share the signing key): nobody else (a device, another tenant, a
client who knows the key) can compute one in advance and occupy it. A job without a key gets a random id.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import uuid
from pathlib import Path

from shared.errors import ConfigurationError

ID_SECRET_FILE = "cloud-ids.key"  # noqa: S105 (a file name)
SECRET_BYTES = 32


def load_or_create_id_secret(path: Path) -> bytes:
    """The secret at ``path`` (hex, mode 0600), created on first use; refused when others may read it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(SECRET_BYTES) + "\n")
            f.flush()
            os.fsync(f.fileno())
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise ConfigurationError(f"{path}: the cloud's id secret must be readable by its owner only (mode {mode:o})")
    text = path.read_text().strip()
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise ConfigurationError(f"{path}: not a hex secret") from None
    if len(secret) < SECRET_BYTES:
        raise ConfigurationError(f"{path}: the secret must be at least {SECRET_BYTES} bytes")
    return secret


class CloudIds:
    def __init__(self, secret: bytes) -> None:
        if len(secret) < SECRET_BYTES:
            raise ValueError(f"the id secret must be at least {SECRET_BYTES} bytes")
        self._secret = secret

    @classmethod
    def from_keys_dir(cls, keys_dir: Path) -> CloudIds:
        return cls(load_or_create_id_secret(keys_dir / ID_SECRET_FILE))

    def _mac(self, kind: str, tenant_id: int, key: str) -> str:
        return hmac.new(self._secret, f"{kind}\0{tenant_id}\0{key}".encode(), hashlib.sha256).hexdigest()

    def usage_id(self, tenant_id: int, key: str) -> str:
        """The usage-record id of an idempotent request: the same for every retry, so metering dedups too."""
        return "idem-" + self._mac("usage", tenant_id, key)[:40]

    def job_id(self, tenant_id: int, idempotency_key: str | None = None) -> str:
        """A new job's id: random, or derived from the submission's ``Idempotency-Key`` (a retry finds its job)."""
        if idempotency_key is None:
            return f"job_{uuid.uuid4().hex}"
        return "job_" + self._mac("job", tenant_id, idempotency_key)[:32]

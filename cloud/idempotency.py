"""``Idempotency-Key``: a client retry returns the stored response and is not billed twice.

The first request with a key claims it (a row ``in_progress``, unique per tenant and key); a concurrent
duplicate gets 409 while it runs; a later one gets the stored response. The key is scoped to the tenant, and
reusing it with a different body is refused (422). A request that fails releases its claim so it can be
retried. Streams are not stored and cannot carry a key.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session

from controlplane.storage.tables import IdempotentResponse
from shared.errors import ApplicationError, ConflictError, ValidationError

MAX_KEY_LENGTH = 255


class IdempotencyMismatchError(ApplicationError):
    status_code = 422
    error_type = "invalid_request_error"
    code = "idempotency_key_reused"


def request_hash(body: Any) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def usage_id(tenant_id: int, key: str) -> str:
    """The usage-record id of an idempotent request: the same for every retry, so metering dedups too."""
    return "idem-" + hashlib.sha256(f"{tenant_id}:{key}".encode()).hexdigest()[:40]


class IdempotencyStore:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def claim(self, tenant_id: int, key: str, body_hash: str, is_stream: bool) -> dict[str, Any] | None:
        """Claim the key for this request; returns the stored response when it was already answered."""
        if not key or len(key) > MAX_KEY_LENGTH:
            raise ValidationError(f"Idempotency-Key must be 1 to {MAX_KEY_LENGTH} characters", param="Idempotency-Key")
        if is_stream:
            raise ValidationError("Idempotency-Key is supported on non-streaming requests only", param="stream")
        with Session(self.engine) as session:
            row = session.get(IdempotentResponse, (tenant_id, key))
            if row is None:
                session.add(IdempotentResponse(tenant_id=tenant_id, key=key, request_hash=body_hash))
                try:
                    session.commit()
                    return None
                except IntegrityError:
                    session.rollback()
                    row = session.get(IdempotentResponse, (tenant_id, key))
                    if row is None:  # released meanwhile
                        raise ConflictError("a request with this Idempotency-Key is in progress; retry") from None
            if row.request_hash != body_hash:
                raise IdempotencyMismatchError(
                    "this Idempotency-Key was used with a different request body", param="Idempotency-Key"
                )
            if row.status != "done" or row.response is None:
                raise ConflictError("a request with this Idempotency-Key is in progress; retry later")
            return dict(row.response)

    def complete(self, tenant_id: int, key: str, response: dict[str, Any]) -> None:
        with Session(self.engine) as session:
            row = session.get(IdempotentResponse, (tenant_id, key))
            if row is not None:
                row.status = "done"
                row.response = response
                session.add(row)
                session.commit()

    def release(self, tenant_id: int, key: str) -> None:
        with Session(self.engine) as session:
            row = session.get(IdempotentResponse, (tenant_id, key))
            if row is not None and row.status != "done":
                session.delete(row)
                session.commit()

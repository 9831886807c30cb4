"""``Idempotency-Key``: a client retry returns the stored response and is not billed twice.

The first request with a key claims it (a row ``in_progress``, unique per tenant and key); a concurrent
duplicate gets 409 with Retry-After while it runs; a later one gets the stored response. The key is scoped to
the tenant, and reusing it with a different body is refused (422). A request that fails releases its claim so
it can be retried. Streams are not stored and cannot carry a key.

A claim holds a lease (``claimed_at`` + ``lease_s``, longer than the request deadline): a process that died
mid-request leaves its claim behind, and the first retry after the lease takes it over with one conditional
UPDATE on the claim's token, so two retries never both run. The token also fences the old holder: a claim
taken over can no longer be completed or released by the request that made it.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import delete, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col

from cloud.gateway.ids import SECRET_BYTES, CloudIds
from controlplane.storage.tables import IdempotentResponse, utcnow
from shared.errors import ApplicationError, ConflictError, ValidationError

MAX_KEY_LENGTH = 255
MAX_RETRY_AFTER_S = 5.0  # a live request usually answers well before its claim's lease ends


class IdempotencyMismatchError(ApplicationError):
    status_code = 422
    error_type = "invalid_request_error"
    code = "idempotency_key_reused"


class IdempotencyInProgressError(ConflictError):
    """409: another request holds the key; ``retry_after`` (the Retry-After header) says when to look again."""

    def __init__(self, message: str, *, retry_after: float) -> None:
        super().__init__(message, param="Idempotency-Key")
        self.retry_after = retry_after


@dataclass(frozen=True, slots=True)
class Claim:
    """The right to run a keyed request (``response`` None), or the stored answer of an earlier one."""

    token: str
    response: dict[str, Any] | None = None


def request_hash(body: Any) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _in_progress(retry_after: float) -> IdempotencyInProgressError:
    return IdempotencyInProgressError(
        "a request with this Idempotency-Key is in progress; retry later",
        retry_after=max(1.0, min(retry_after, MAX_RETRY_AFTER_S)),
    )


class IdempotencyStore:
    def __init__(self, engine: Engine, lease_s: float, ids: CloudIds | None = None) -> None:
        """``ids`` derive the usage ids of keyed requests (``cloud.gateway.ids``; a random secret when None: tests)."""
        self.engine = engine
        self.lease_s = lease_s
        self.ids = ids or CloudIds(secrets.token_bytes(SECRET_BYTES))

    def claim(self, tenant_id: int, key: str, body_hash: str, is_stream: bool) -> Claim:
        """Claim the key for this request, or take over a claim whose lease ended; the stored response when the
        key was already answered. Raises 409 (Retry-After) while another request holds the key."""
        if not key or len(key) > MAX_KEY_LENGTH:
            raise ValidationError(f"Idempotency-Key must be 1 to {MAX_KEY_LENGTH} characters", param="Idempotency-Key")
        if is_stream:
            raise ValidationError("Idempotency-Key is supported on non-streaming requests only", param="stream")
        token, now = uuid.uuid4().hex, utcnow()
        with Session(self.engine) as session:
            session.add(
                IdempotentResponse(
                    tenant_id=tenant_id, key=key, request_hash=body_hash, claimed_at=now, claim_token=token
                )
            )
            try:
                session.commit()
                return Claim(token)
            except IntegrityError:
                session.rollback()
            row = session.get(IdempotentResponse, (tenant_id, key))
            if row is None:  # released between our insert and this read
                raise _in_progress(1.0)
            if row.request_hash != body_hash:
                raise IdempotencyMismatchError(
                    "this Idempotency-Key was used with a different request body", param="Idempotency-Key"
                )
            if row.status == "done" and row.response is not None:
                return Claim(row.claim_token, dict(row.response))
            remaining = (row.claimed_at + timedelta(seconds=self.lease_s) - now).total_seconds()
            if remaining > 0:
                raise _in_progress(remaining)
            taken = session.exec(
                update(IdempotentResponse)
                .where(
                    col(IdempotentResponse.tenant_id) == tenant_id,
                    col(IdempotentResponse.key) == key,
                    col(IdempotentResponse.status) == "in_progress",
                    col(IdempotentResponse.claim_token) == row.claim_token,
                )
                .values(claimed_at=now, claim_token=token)
            )
            session.commit()
            if taken.rowcount != 1:  # another retry took it over first
                raise _in_progress(1.0)
            return Claim(token)

    def complete(self, tenant_id: int, key: str, token: str, response: dict[str, Any]) -> None:
        """Store the answer, unless the claim was taken over meanwhile (the new holder's answer counts)."""
        with Session(self.engine) as session:
            session.exec(
                update(IdempotentResponse)
                .where(
                    col(IdempotentResponse.tenant_id) == tenant_id,
                    col(IdempotentResponse.key) == key,
                    col(IdempotentResponse.claim_token) == token,
                )
                .values(status="done", response=response)
            )
            session.commit()

    def release(self, tenant_id: int, key: str, token: str) -> None:
        """Drop a failed request's claim so the key can be retried; a claim taken over is not ours to drop."""
        with Session(self.engine) as session:
            session.exec(
                delete(IdempotentResponse).where(
                    col(IdempotentResponse.tenant_id) == tenant_id,
                    col(IdempotentResponse.key) == key,
                    col(IdempotentResponse.claim_token) == token,
                    col(IdempotentResponse.status) != "done",
                )
            )
            session.commit()

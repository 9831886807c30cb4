"""Signing and verifying escalation policies: the cloud signs each policy version with the registry's Ed25519 key,
the device verifies it against its trusted keys before using it. Device-safe (cryptography only)."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from shared.artifacts import key_id
from shared.errors import ArtifactVerificationError

DOMAIN = "tierline.escalation-policy/v1"


def canonical_bytes(model: str, version: int, target: list[dict[str, str]], policy: dict[str, Any]) -> bytes:
    """What the signature covers: the model, the version, its target and the whole policy, as sorted JSON."""
    body = {"domain": DOMAIN, "model": model, "version": version, "target": target, "policy": policy}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def sign_policy(
    key: Ed25519PrivateKey, model: str, version: int, target: list[dict[str, str]], policy: dict[str, Any]
) -> tuple[str, str]:
    """``(key_id, base64 signature)``."""
    signature = key.sign(canonical_bytes(model, version, target, policy))
    return key_id(key.public_key()), base64.b64encode(signature).decode()


def verify_policy(
    trusted: Iterable[Ed25519PublicKey],
    model: str,
    version: int,
    target: list[dict[str, str]],
    policy: dict[str, Any],
    signer: str,
    signature: str,
) -> None:
    """Raise ArtifactVerificationError unless a trusted key signed exactly this policy version."""
    key = {key_id(k): k for k in trusted}.get(signer)
    if key is None:
        raise ArtifactVerificationError(f"escalation policy {model} v{version}: signed by untrusted key {signer!r}")
    try:
        key.verify(base64.b64decode(signature, validate=True), canonical_bytes(model, version, target, policy))
    except (InvalidSignature, ValueError) as exc:
        raise ArtifactVerificationError(f"escalation policy {model} v{version}: bad signature") from exc

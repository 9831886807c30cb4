"""Sticky canary assignment: which arm of a rollout a subject (a cloud user, a device) is in.

A subject is hashed, with a key per rollout, into one of ``NUM_BUCKETS`` buckets; the candidate arm is the
buckets below ``weight_pct * NUM_BUCKETS / 100``. So the same subject always gets the same arm for a given
weight, and raising the weight only moves subjects from the baseline to the candidate (never back), which
keeps a user's experience stable as a rollout advances. Different rollouts use different keys, so being an
early canary once does not make a subject an early canary every time.

Pure functions: no I/O, used by the cloud (request routing), the edge gateway (desired versions) and the
console (analysis), which must all agree.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Final, Literal

Arm = Literal["baseline", "candidate"]
PinValue = Literal["baseline", "candidate", "excluded"]

BASELINE: Final = "baseline"
CANDIDATE: Final = "candidate"
EXCLUDED: Final = "excluded"
ARMS: Final = (BASELINE, CANDIDATE)
PIN_VALUES: Final = (BASELINE, CANDIDATE, EXCLUDED)
NUM_BUCKETS: Final = 10_000
_SUBJECT_SEPARATOR: Final = "\x1f"  # cannot appear in a tenant name, so "a" + "b/c" never equals "a/b" + "c"


def bucket(salt: str, subject: str) -> int:
    """The subject's bucket in ``[0, NUM_BUCKETS)``: a keyed BLAKE2b of the subject, stable across processes."""
    key = hashlib.blake2b(salt.encode(), digest_size=32).digest()  # any salt length fits blake2b's 64-byte key
    digest = hashlib.blake2b(subject.encode(), key=key, digest_size=8).digest()
    return int.from_bytes(digest, "big") % NUM_BUCKETS


def rollout_salt(rollout_id: int | str) -> str:
    return f"tierline-rollout-{rollout_id}"


def cloud_subject(tenant: str, user: str | None) -> str:
    """The subject of a cloud request: its tenant plus the request's ``user`` (or ``x-tierline-subject``).

    Requests without a user share the tenant's arm, which keeps a tenant's anonymous traffic consistent.
    """
    return f"{tenant}{_SUBJECT_SEPARATOR}{user or ''}"


def fleet_subject(device_id: str) -> str:
    """The subject of a device in a fleet rollout: its id."""
    return device_id


def arm(rollout_id: int | str, subject: str, weight_pct: float, pins: Mapping[str, str] | None = None) -> Arm:
    """The arm ``subject`` is in while the candidate has ``weight_pct`` percent (0-100, fractions allowed).

    ``pins`` maps subjects to a forced arm (``baseline`` / ``candidate``) or ``excluded``; an excluded subject
    stays on the baseline (and analysis leaves it out).
    """
    pinned = (pins or {}).get(subject)
    if pinned == CANDIDATE:
        return CANDIDATE
    if pinned in (BASELINE, EXCLUDED):
        return BASELINE
    threshold = round(max(0.0, min(100.0, weight_pct)) * NUM_BUCKETS / 100)
    return CANDIDATE if bucket(rollout_salt(rollout_id), subject) < threshold else BASELINE

"""Fleet targeting: which devices a model release or an escalation policy is for.

A target is a list of terms, every one of which must hold (an empty target is the whole fleet). A term is
``KEY=VALUE``, ``KEY!=VALUE``, ``KEY>=NUMBER`` or ``KEY<=NUMBER``. ``KEY`` is a device label (``ring``,
``site``, set at enrollment) or one of the facts the agent reports at every sync, under the ``device.`` prefix:

- ``device.arch``: the CPU architecture (``x86_64``, ``aarch64``, ...);
- ``device.memory_mb``: the host's memory in MiB;
- ``device.cpus``: logical CPUs;
- ``device.runtime``: an inference runtime the agent can run (``onnxruntime``, ``tflite``); ``=`` holds when the
  device has it, ``!=`` when it has not;
- ``device.system``: the operating system (``Linux``, ...);
- ``device.bucket``: a number from 0 to 99 fixed per device (from a hash of its id), so ``device.bucket<=19`` is a
  sticky 20 % of the fleet: a policy or release tried on a share of the devices before all of them.

A term on a label or fact the device does not report does not hold (``!=`` included): a device is only sent what
provably targets it. Pure Python, shared by the cloud (choosing) and the CLI/console (validating).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from typing import Any

from shared.errors import ValidationError

FACT_PREFIX = "device."
FACTS = ("arch", "memory_mb", "cpus", "runtime", "system", "bucket")
NUMERIC_FACTS = ("memory_mb", "cpus", "bucket")
BUCKETS = 100
_TERM = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._/-]{0,63})\s*(!=|>=|<=|=)\s*([^\s=<>!][^=<>!]{0,127}?)\s*$")
MAX_TERMS = 16


def parse_term(text: str, param: str = "target") -> dict[str, str]:
    """One ``KEY<op>VALUE`` term as ``{"key", "op", "value"}``; a ValidationError naming the term otherwise."""
    match = _TERM.match(text)
    if match is None:
        raise ValidationError(f"{param}: {text!r} is not KEY=VALUE, KEY!=VALUE, KEY>=N or KEY<=N", param=param)
    key, op, value = match.groups()
    if key.startswith(FACT_PREFIX) and key[len(FACT_PREFIX) :] not in FACTS:
        known = ", ".join(FACT_PREFIX + f for f in FACTS)
        raise ValidationError(f"{param}: unknown device fact {key!r} (facts: {known})", param=param)
    if op in (">=", "<="):
        if key[len(FACT_PREFIX) :] not in NUMERIC_FACTS or not key.startswith(FACT_PREFIX):
            numeric = ", ".join(FACT_PREFIX + f for f in NUMERIC_FACTS)
            raise ValidationError(f"{param}: {op} compares numbers: only {numeric}", param=param)
        try:
            float(value)
        except ValueError:
            raise ValidationError(f"{param}: {text!r}: {value!r} is not a number", param=param) from None
    return {"key": key, "op": op, "value": value}


def parse_target(terms: Iterable[str], param: str = "target") -> list[dict[str, str]]:
    parsed = [parse_term(t, param) for t in terms if t.strip()]
    if len(parsed) > MAX_TERMS:
        raise ValidationError(f"{param}: at most {MAX_TERMS} terms", param=param)
    return parsed


def check_target(target: Any, param: str = "target") -> list[dict[str, str]]:
    """A stored or posted target (a list of terms as strings or as ``{"key", "op", "value"}``), normalised."""
    if target is None:
        return []
    if not isinstance(target, list):
        raise ValidationError(f"{param}: a list of terms such as 'ring=beta'", param=param)
    texts = []
    for term in target:
        if isinstance(term, str):
            texts.append(term)
        elif isinstance(term, dict) and {"key", "op", "value"} <= set(term):
            texts.append(f"{term['key']}{term['op']}{term['value']}")
        else:
            raise ValidationError(f"{param}: {term!r} is not a term such as 'ring=beta'", param=param)
    return parse_target(texts, param)


def describe(target: list[dict[str, str]]) -> str:
    """``ring=beta, device.memory_mb>=2048`` or ``all devices``."""
    return ", ".join(f"{t['key']}{t['op']}{t['value']}" for t in target) or "all devices"


def bucket(device_id: str) -> int:
    """The device's fixed bucket, 0..99: the first 8 bytes of sha256 of its id, modulo 100."""
    return int.from_bytes(hashlib.sha256(device_id.encode()).digest()[:8], "big") % BUCKETS


def device_facts(runtime: Mapping[str, Any], device_id: str | None = None) -> dict[str, Any]:
    """The facts of a device from the runtime summary its agent reports (``edge_agent.agent.runtime_summary``)."""
    runtimes = runtime.get("runtimes")
    return {
        "arch": runtime.get("machine"),
        "memory_mb": runtime.get("memory_mb"),
        "cpus": runtime.get("cpus"),
        "runtime": list(runtimes) if isinstance(runtimes, list) else None,
        "system": runtime.get("system"),
        "bucket": bucket(device_id) if device_id else None,
    }


def _holds(term: Mapping[str, str], labels: Mapping[str, str], facts: Mapping[str, Any]) -> bool:
    key, op, want = term["key"], term["op"], term["value"]
    have = facts.get(key[len(FACT_PREFIX) :]) if key.startswith(FACT_PREFIX) else labels.get(key)
    if have is None:
        return False
    if isinstance(have, list):  # device.runtime: the runtimes the device has
        return (want in have) == (op == "=")
    if op in (">=", "<="):
        try:
            number = float(have)
        except (TypeError, ValueError):
            return False
        return number >= float(want) if op == ">=" else number <= float(want)
    return (str(have) == want) == (op == "=")


def matches(
    target: Iterable[Mapping[str, str]],
    labels: Mapping[str, str],
    runtime: Mapping[str, Any],
    device_id: str | None = None,
) -> bool:
    """Whether a device with these labels, this reported runtime summary and this id is targeted."""
    facts = device_facts(runtime, device_id)
    return all(_holds(t, labels, facts) for t in target)

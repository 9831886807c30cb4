"""The escalation policies the agent runs: the cloud's, delivered at each sync and hot-reloaded, unless the device
has its own.

- The cloud sends, per edge model, the newest policy version that targets this device, signed with the registry's
  key. The agent verifies the signature against its trusted keys (those it verifies artifacts with) before using
  it; a policy that fails is refused (an event says so) and the one in use stays.
- A device-local override wins: a policy file in the agent's policy dir (``tierline edge calibrate``,
  ``TIERLINE_EDGE_POLICY_DIR``) for a model id or family. The dir is read again at every sync, so an override
  added or removed takes effect without a restart too.
- A model the cloud stops sending (its version no longer targets the device) falls back to the default.

Every sync reports, per model, what runs: the version number, ``override`` or nothing (the default).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from edge_agent.tiering import Tiering, family
from shared.edge_protocol import DesiredPolicy
from shared.errors import ApplicationError, ConfigurationError
from shared.escalation import EdgePolicy, load_policy
from shared.policy_signing import verify_policy

logger = logging.getLogger(__name__)
OVERRIDE = "override"


def local_policies(directory: Path, model_ids: list[str]) -> dict[str, EdgePolicy]:
    """Policy files (``tierline edge calibrate``) by model id and by model family; unreadable ones are skipped."""
    found: dict[str, EdgePolicy] = {}
    for model_id in sorted({*model_ids, *(family(m) for m in model_ids)}):
        try:
            policy = load_policy(directory, model_id)
        except ConfigurationError as exc:
            logger.warning("ignoring the local escalation policy for %s: %s", model_id, exc.message)
            continue
        if policy is not None:
            found[model_id] = policy
    return found


class PolicyBook:
    """Keeps ``tiering.policies`` = the cloud's verified policies overlaid with the device's own files."""

    def __init__(
        self,
        directory: Path,
        model_ids: list[str],
        keys: list[Ed25519PublicKey],
        tiering: Tiering,
        report: Callable[[str, dict[str, Any]], None] | None = None,
    ) -> None:
        self.directory = directory
        self.model_ids = model_ids
        self.keys = keys  # shared with the enrollment: keys learnt at enrollment count
        self.tiering = tiering
        self.report = report
        self.delivered: dict[str, tuple[int, EdgePolicy]] = {}
        self.overrides: dict[str, EdgePolicy] = {}
        self.refused: set[tuple[str, int]] = set()
        self.reload()
        for model, policy in self.overrides.items():
            logger.info(
                "escalation policy for %s (local file): %s < %s escalates", model, policy.signal, policy.threshold
            )

    def reload(self) -> None:
        """Read the override files again and rebuild what the tiering uses (one reference swap)."""
        self.overrides = local_policies(self.directory, self.model_ids)
        merged = {model: policy for model, (_, policy) in self.delivered.items()}
        merged.update(self.overrides)
        self.tiering.policies = merged

    def _event(self, kind: str, payload: dict[str, Any]) -> None:
        if self.report is not None:
            self.report(kind, payload)

    def apply(self, desired: list[DesiredPolicy]) -> None:
        """The policies of one sync answer: verified ones replace what runs; models left out fall back."""
        delivered: dict[str, tuple[int, EdgePolicy]] = {}
        for item in desired:
            current = self.delivered.get(item.model)
            if current is not None and current[0] == item.version:
                delivered[item.model] = current
                continue
            try:
                verify_policy(
                    self.keys, item.model, item.version, item.target, item.policy, item.key_id, item.signature
                )
                policy = EdgePolicy.from_json(item.policy)
            except ApplicationError as exc:
                if (item.model, item.version) not in self.refused:
                    self.refused.add((item.model, item.version))
                    logger.warning("refused escalation policy %s v%s: %s", item.model, item.version, exc.message)
                    self._event("policy.refused", {"model": item.model, "version": item.version, "error": exc.message})
                if current is not None:
                    delivered[item.model] = current
                continue
            delivered[item.model] = (item.version, policy)
            before = current[0] if current is not None else None
            logger.info(
                "escalation policy for %s: cloud v%s (%s < %.6g escalates)",
                item.model,
                item.version,
                policy.signal,
                policy.threshold,
            )
            self._event("policy.applied", {"model": item.model, "version": item.version, "previous": before})
        self.delivered = delivered
        self.reload()

    def sources(self) -> dict[str, str]:
        """Per model: the cloud's version in use, or ``override`` where a local file wins."""
        out = {model: str(version) for model, (version, _) in self.delivered.items()}
        out.update({model: OVERRIDE for model in self.overrides})
        return dict(sorted(out.items()))

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

The *pairings* (which cloud model each edge model escalates to, ``shared.edge_protocol.ModelPairing``) come with
the same sync; :class:`PairingBook` keeps the latest in ``<state_dir>/pairings.json``, beside the policies, so an
agent restarted while the cloud is unreachable still escalates where it did. Pairings in the device's settings
(``TIERLINE_EDGE_CLOUD_PAIRS``) win over the cloud's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from pydantic import TypeAdapter, ValidationError

from edge_agent.tiering import Tiering, family
from shared.atomic import write_atomic
from shared.edge_protocol import DesiredPolicy, ModelPairing
from shared.errors import ApplicationError, ConfigurationError
from shared.escalation import EdgePolicy, load_policy
from shared.policy_signing import verify_policy

logger = logging.getLogger(__name__)
OVERRIDE = "override"
PAIRINGS_FILE = "pairings.json"
_PAIRINGS = TypeAdapter(list[ModelPairing])


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


class PairingBook:
    """Keeps ``tiering.pairings`` = the cloud's latest pairings (persisted in ``path``) overlaid with the device's
    own (``local``: edge model -> cloud model, None: answer locally)."""

    def __init__(self, path: Path, tiering: Tiering, local: dict[str, str | None] | None = None) -> None:
        self.path = path
        self.tiering = tiering
        self.local = [ModelPairing(model=m, cloud_model=c) for m, c in sorted((local or {}).items())]
        self.delivered = self._load()
        self._publish()

    def _load(self) -> list[ModelPairing]:
        try:
            return _PAIRINGS.validate_json(self.path.read_bytes())
        except FileNotFoundError:
            return []
        except (OSError, ValidationError) as exc:
            logger.warning("ignoring the saved model pairings in %s: %s", self.path, exc)
            return []

    def _publish(self) -> None:
        self.tiering.pairings = {p.model: p for p in [*self.delivered, *self.local]}

    def apply(self, pairings: list[ModelPairing]) -> None:
        """The pairings of one sync answer: they replace the previous ones, and are saved when they changed."""
        if pairings == self.delivered:
            return
        self.delivered = list(pairings)
        self._publish()
        data = json.dumps([p.model_dump(mode="json") for p in pairings], indent=1, sort_keys=True)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, data.encode() + b"\n")
        except OSError as exc:  # the pairings apply anyway; only a restart while offline would miss them
            logger.warning("could not save the model pairings to %s: %s", self.path, exc)
        logger.info(
            "model pairings: %s",
            ", ".join(f"{p.model} -> {p.cloud_model or 'local only'}" for p in pairings) or "none",
        )

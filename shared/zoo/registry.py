"""Where a built zoo keeps things, and how to find and verify them (no torch; usable on every side)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from shared.artifacts import Manifest, read_manifest, verify_files, verify_signature
from shared.errors import ArtifactVerificationError, NotFoundError

ARTIFACTS_DIR = "artifacts"
MANIFESTS_DIR = "manifests"
ZOO_REPORT = "zoo.json"


@dataclass(frozen=True, slots=True)
class ZooLayout:
    """Paths inside one built preset, ``<zoo_dir>/<preset>``."""

    root: Path

    @property
    def report_path(self) -> Path:
        return self.root / ZOO_REPORT

    def artifact_dir(self, name: str) -> Path:
        if name == "digits-held-out":
            return self.root / "data"
        return self.root / ARTIFACTS_DIR / name

    def manifest_path(self, name: str) -> Path:
        return self.root / MANIFESTS_DIR / f"{name}.json"

    def manifest_names(self) -> list[str]:
        return sorted(p.stem for p in (self.root / MANIFESTS_DIR).glob("*.json"))

    def report(self) -> dict[str, Any]:
        try:
            return dict(json.loads(self.report_path.read_text()))
        except OSError as exc:
            raise NotFoundError(f"no built zoo at {self.root}; run `tierline zoo build`") from exc

    def manifest(self, name: str) -> Manifest:
        path = self.manifest_path(name)
        if not path.is_file():
            raise NotFoundError(f"artifact {name!r} is not in the zoo at {self.root}")
        return read_manifest(path)


def verify_zoo(root: Path, trusted_keys: list[Ed25519PublicKey]) -> list[tuple[str, str | None]]:
    """Verify every artifact under ``root`` (a preset dir, or a zoo dir holding several presets).

    Returns ``(artifact path, error or None)`` per artifact, so a caller can name each failure.
    """
    if (root / MANIFESTS_DIR).is_dir():
        layouts = [ZooLayout(root)]
    elif root.is_dir():
        layouts = [ZooLayout(p) for p in sorted(root.iterdir()) if (p / MANIFESTS_DIR).is_dir()]
    else:
        layouts = []
    if not layouts:
        raise NotFoundError(f"no zoo manifests under {root}")
    results: list[tuple[str, str | None]] = []
    for layout in layouts:
        for name in layout.manifest_names():
            target = layout.artifact_dir(name)
            try:
                manifest = layout.manifest(name)
                verify_signature(manifest, trusted_keys)
                verify_files(manifest, target)
            except ArtifactVerificationError as exc:
                results.append((str(target), exc.message))
            else:
                results.append((str(target), None))
    return results

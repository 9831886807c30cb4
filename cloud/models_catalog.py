"""The models the cloud serves, read from the built zoo (the registry takes over in issue 7)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shared.errors import NotFoundError
from shared.zoo.registry import ZooLayout

CLOUD_ARTIFACTS = ("lm-cloud", "lm-edge", "digits-large", "digits-small")


@dataclass(frozen=True, slots=True)
class ServedModel:
    id: str
    kind: str
    sha256: str
    created: int


def load_catalog(zoo_root: Path) -> list[ServedModel]:
    layout = ZooLayout(zoo_root)
    if not layout.report_path.is_file():
        return []
    created = int(layout.report_path.stat().st_mtime)
    served = []
    for name in CLOUD_ARTIFACTS:
        if layout.manifest_path(name).is_file():
            manifest = layout.manifest(name)
            served.append(
                ServedModel(id=f"tierline/{name}", kind=manifest.kind, sha256=manifest.sha256, created=created)
            )
    return served


def find(catalog: list[ServedModel], model_id: str) -> ServedModel:
    for m in catalog:
        if m.id == model_id:
            return m
    raise NotFoundError(f"The model '{model_id}' does not exist", param="model", code="model_not_found")

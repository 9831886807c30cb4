"""The models the cloud lists: those of the built zoo, and the registry models it serves by name."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from shared.errors import NotFoundError
from shared.zoo.registry import ZooLayout

if TYPE_CHECKING:  # the engines (torch) load only where requests are served
    from cloud.serving.engine_pool import RegistryEntry

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


def registry_catalog(entries: Mapping[str, RegistryEntry]) -> list[ServedModel]:
    """Registry models that have a version to serve by name (``stable``, else the highest active one)."""
    return [
        ServedModel(id=e.name, kind="causal-lm", sha256=e.sha256, created=e.created)
        for e in sorted(entries.values(), key=lambda e: e.name)
        if e.default is not None
    ]


def find(catalog: Iterable[ServedModel], model_id: str) -> ServedModel:
    for m in catalog:
        if m.id == model_id:
            return m
    raise NotFoundError(f"The model '{model_id}' does not exist", param="model", code="model_not_found")

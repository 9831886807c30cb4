"""What the console's pages and API use, built once at start-up; each field is a dependency of the same name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: console.auth reads this state in its guard and stays light to import
    from sqlalchemy.engine import Engine

    from console.session_cookie import ConsoleAuth
    from controlplane.registry.edge_derive import DeriveRunner
    from controlplane.registry.store import ArtifactStore


@dataclass(frozen=True, slots=True, kw_only=True)
class ConsoleState:
    db: Engine
    auth: ConsoleAuth
    artifacts: ArtifactStore
    derive_runner: DeriveRunner

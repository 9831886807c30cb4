"""The deploy files name only settings that exist, and the agent's example config loads."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from cloud.settings import CloudSettings
from console.session_cookie import ConsoleAuthSettings
from edge_agent.settings import EdgeSettings
from shared.backend_spec import UpstreamSettings
from shared.settings import CoreSettings, DatabaseSettings, SecretSettings, ServiceSettings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _known_env_names() -> set[str]:
    names: set[str] = set()
    for cls in (
        CoreSettings,
        DatabaseSettings,
        SecretSettings,
        ServiceSettings,
        CloudSettings,
        EdgeSettings,
        ConsoleAuthSettings,
        UpstreamSettings,
    ):
        prefix = cls.model_config.get("env_prefix", "")
        names.update(f"{prefix}{field}".upper() for field in cls.model_fields)
    return names


def test_deploy_files_use_real_settings() -> None:
    known = _known_env_names()
    for path in DEPLOY.rglob("*"):
        # (build inputs, and bytecode where something imported deploy/requirements.py)
        if path.is_file() and not {"wheels", "certs", "__pycache__"} & set(path.relative_to(DEPLOY).parts):
            used = set(re.findall(r"\bTIERLINE_[A-Z_]+\b", path.read_text()))
            assert used <= known, f"{path.name} uses unknown settings {sorted(used - known)}"


def test_example_edge_config_is_valid() -> None:
    values = tomllib.loads((DEPLOY / "systemd" / "edge.toml").read_text())
    settings = EdgeSettings(**values)
    assert settings.port == 8402 and settings.trusted_keys


def test_dockerfile_copies_every_installed_package() -> None:
    pyproject = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = set(re.findall(r"^COPY (\w+) \./\1$", (DEPLOY / "Dockerfile").read_text(), flags=re.M))
    assert packages <= copied, f"deploy/Dockerfile does not copy {sorted(packages - copied)}"

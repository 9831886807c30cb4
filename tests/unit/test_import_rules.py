"""The package import rules of ARCHITECTURE.md, checked by walking every module's imports."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("shared", "cloud", "console", "edge_agent")
# package -> top-level project packages it must never import
FORBIDDEN = {
    "shared": {"cloud", "console", "edge_agent", "bench"},
    "cloud": {"console", "edge_agent", "bench"},
    "console": {"cloud", "edge_agent", "bench"},
    "edge_agent": {"cloud", "console", "bench"},
}


def imported_top_levels(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def violations(package: str) -> list[str]:
    found: list[str] = []
    for path in sorted((REPO / package).rglob("*.py")):
        bad = imported_top_levels(path) & FORBIDDEN[package]
        found.extend(f"{path.relative_to(REPO)} imports {name}" for name in sorted(bad))
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_package_respects_import_direction(package: str) -> None:
    assert violations(package) == []


def test_rule_checker_catches_a_forbidden_import(tmp_path: Path) -> None:
    bad = tmp_path / "mod.py"
    bad.write_text("from console.app import create_app\nimport cloud.engine\n")
    assert imported_top_levels(bad) & FORBIDDEN["shared"] == {"console", "cloud"}


# Runs in a fresh interpreter where `import torch` (and the database stack) fails, as on a device.
_EDGE_PROBE = r"""
import importlib, importlib.abc, json, pkgutil, sys

BLOCKED = ("torch", "sqlalchemy", "sqlmodel", "alembic", "psycopg", "transformers")

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not installed on this device")
        return None

sys.meta_path.insert(0, Block())
import edge_agent
names = ["edge_agent"]
for info in pkgutil.walk_packages(edge_agent.__path__, "edge_agent."):
    importlib.import_module(info.name)
    names.append(info.name)
from tierline.cli import cli
from click.testing import CliRunner
result = CliRunner().invoke(cli, ["edge", "run", "--help"])
print(json.dumps({"modules": names, "help_exit": result.exit_code,
                  "loaded": sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)}))
"""


def test_edge_agent_imports_without_torch_or_database() -> None:
    proc = subprocess.run([sys.executable, "-c", _EDGE_PROBE], cwd=REPO, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["loaded"] == []
    assert report["help_exit"] == 0
    assert {"edge_agent.app", "edge_agent.cli", "edge_agent.runtime.lm"} <= set(report["modules"])

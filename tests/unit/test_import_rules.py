"""The package import rules of docs/architecture.md, checked by walking every module's imports.

Over the project's own modules: each top-level package imports only the packages its layer allows, ``shared``
outside its zoo needs nothing a device lacks, and no two files import each other, directly or around a longer
circle. Inside ``cloud/`` each room imports only the rooms below it. Imports inside functions count, and so do imports
under ``if TYPE_CHECKING:``: a type still ties two files (read one, you must read the other), so a type-only circle
is a circle. The edge agent is also imported for real with torch and the database stack blocked.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("shared", "controlplane", "cloud", "console", "edge_agent", "tierline", "bench")
# package -> the other project packages it may import (docs/architecture.md)
ALLOWED: dict[str, frozenset[str]] = {
    "shared": frozenset(),
    "controlplane": frozenset({"shared"}),
    "edge_agent": frozenset({"shared"}),
    "cloud": frozenset({"controlplane", "shared"}),
    "console": frozenset({"controlplane", "shared"}),
    "tierline": frozenset(PACKAGES) - {"tierline"},
    "bench": frozenset(PACKAGES) - {"bench"},
}

# The rooms of cloud/ (docs/architecture.md): room -> the rooms it may import. Modules directly in cloud/ other than
# its settings (the app that wires the rooms together, the CLI) are imported by no room.
ROOMS: dict[str, frozenset[str]] = {
    "cloud.engine": frozenset(),
    "cloud.serving": frozenset({"cloud.engine"}),
    "cloud.gateway": frozenset({"cloud.serving", "cloud.engine"}),
    "cloud.edge": frozenset({"cloud.gateway", "cloud.serving", "cloud.engine"}),
}
ROOM_COMMONS = frozenset({"cloud", "cloud.settings"})  # what every room may read

# What a device does not install: only shared/zoo/ (build-time tooling) in shared/ may import these.
SERVER_STACK = frozenset({"torch", "transformers", "sqlalchemy", "sqlmodel", "alembic", "psycopg"})


@dataclass(frozen=True, slots=True)
class Import:
    """One import statement's target, resolved to a module name (``pkg.name`` when ``name`` is a module)."""

    source: str  # the importing module
    target: str
    line: int


def module_names(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Every module of ``packages`` under ``root``: dotted name -> file (a package is its ``__init__.py``)."""
    found: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _statements(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under ``tree`` at any depth: in functions and under ``if TYPE_CHECKING:`` too."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """The imports of one file, each resolved to the most specific module of the project it names.

    Names outside the project (the standard library, third-party packages) are kept as written, so the layer
    rules can still see them; only project modules become edges of the circle check.
    """
    is_package = path.name == "__init__.py"
    project = {name.split(".")[0] for name in modules}
    found: list[Import] = []
    for node in _statements(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
                if alias.name != "*"
            ] or [base]
        for target in targets:
            while target not in modules and "." in target and target.split(".")[0] in project:
                target = target.rsplit(".", 1)[0]
            found.append(Import(module, target, node.lineno))
    return found


def import_graph(root: Path, packages: tuple[str, ...] = PACKAGES) -> tuple[dict[str, Path], list[Import]]:
    modules = module_names(root, packages)
    edges = [imp for name, path in modules.items() for imp in imports_of(name, path, modules)]
    return modules, edges


def layer_violations(root: Path, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """``file:line imports package`` for every import of a project package the importer's layer forbids."""
    modules, edges = import_graph(root, packages)
    found: list[str] = []
    for imp in edges:
        source_top, target_top = imp.source.split(".")[0], imp.target.split(".")[0]
        if target_top in packages and target_top != source_top and target_top not in ALLOWED[source_top]:
            where = modules[imp.source].relative_to(root)
            found.append(f"{where}:{imp.line} imports {imp.target} ({source_top} may import {_allowed(source_top)})")
    return found


def _room(module: str) -> str | None:
    return next((room for room in ROOMS if module == room or module.startswith(room + ".")), None)


def room_violations(root: Path) -> list[str]:
    """``file:line imports module`` for every import between the rooms of ``cloud/`` that ``ROOMS`` forbids."""
    modules, edges = import_graph(root)
    found: set[str] = set()
    for imp in edges:
        source, target = _room(imp.source), _room(imp.target)
        if source is None or target == source or imp.target.split(".")[0] != "cloud":
            continue
        if target in ROOMS[source] or (target is None and imp.target in ROOM_COMMONS):
            continue
        allowed = "the rooms " + (", ".join(sorted(ROOMS[source])) or "none") + " and cloud.settings"
        where = modules[imp.source].relative_to(root)
        found.add(f"{where}:{imp.line} imports {imp.target} ({source} may import {allowed})")
    return sorted(found)


def server_stack_in_shared(root: Path) -> list[str]:
    """``file:line imports name`` for every import of the server stack in ``shared`` outside ``shared/zoo``."""
    modules, edges = import_graph(root)
    return [
        f"{modules[imp.source].relative_to(root)}:{imp.line} imports {imp.target}"
        for imp in edges
        if imp.source.split(".")[0] == "shared"
        and not imp.source.startswith("shared.zoo")
        and imp.target.split(".")[0] in SERVER_STACK
    ]


def _allowed(package: str) -> str:
    return ", ".join(sorted(ALLOWED[package])) or "no other project package"


def strongly_connected(nodes: list[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively (no recursion limit on a deep import chain)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for start in nodes:
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def import_circles(root: Path, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """One line per circle: its files, and the import lines that close it."""
    modules, imports = import_graph(root, packages)
    edges: dict[str, set[str]] = {}
    lines: dict[tuple[str, str], int] = {}
    for imp in imports:
        if imp.target not in modules or imp.target == imp.source:
            continue
        edges.setdefault(imp.source, set()).add(imp.target)
        lines.setdefault((imp.source, imp.target), imp.line)
    circles: list[str] = []
    for component in strongly_connected(sorted(modules), edges):
        if len(component) < 2:
            continue
        members = set(component)
        links = [
            f"{modules[a].relative_to(root)}:{lines[a, b]} -> {b}"
            for a in component
            for b in sorted(edges.get(a, set()) & members)
        ]
        files = ", ".join(str(modules[m].relative_to(root)) for m in component)
        circles.append(f"circle between {files}: " + "; ".join(links))
    return circles


def test_packages_import_only_what_their_layer_allows() -> None:
    found = layer_violations(REPO)
    assert not found, "imports against docs/architecture.md:\n" + "\n".join(found)


def test_cloud_rooms_import_only_the_rooms_below() -> None:
    found = room_violations(REPO)
    assert not found, "imports between the rooms of cloud/ against docs/architecture.md:\n" + "\n".join(found)


def test_room_checker_catches_an_import_upwards(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "cloud/engine/model.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cloud.gateway import app\n"
            ),
            "cloud/serving/pool.py": (
                "from cloud.engine import model\nfrom cloud import settings\nfrom cloud.edge import sync\n"
            ),
            "cloud/gateway/app.py": "from cloud.serving import pool\n",
            "cloud/edge/sync.py": "from cloud.gateway import app\nfrom cloud.serving.pool import x\nimport cloud.cli\n",
            "cloud/settings.py": "",
            "cloud/cli.py": "from cloud.edge import sync\n",
        },
    )
    assert sorted(room_violations(root)) == [
        "cloud/edge/sync.py:3 imports cloud.cli (cloud.edge may import the rooms cloud.engine, cloud.gateway, "
        "cloud.serving and cloud.settings)",
        "cloud/engine/model.py:3 imports cloud.gateway.app (cloud.engine may import the rooms none and cloud.settings)",
        "cloud/serving/pool.py:3 imports cloud.edge.sync (cloud.serving may import the rooms cloud.engine and "
        "cloud.settings)",
    ]


def test_shared_outside_the_zoo_needs_no_server_stack() -> None:
    found = server_stack_in_shared(REPO)
    assert not found, "shared/ must import on a device (docs/architecture.md):\n" + "\n".join(found)


def test_no_import_circles_between_files() -> None:
    circles = import_circles(REPO)
    assert not circles, "import circles (docs/architecture.md):\n" + "\n".join(circles)


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for package in PACKAGES:
        (root / package).mkdir(exist_ok=True)
        (root / package / "__init__.py").touch()
    return root


@pytest.mark.parametrize(
    ("importer", "line", "target"),
    [
        ("shared/zoo/build.py", "from controlplane.storage import tables\n", "controlplane.storage"),
        ("shared/errors.py", "def f() -> None:\n    import cloud.app\n", "cloud.app"),
        ("edge_agent/agent.py", "from controlplane import fleet\n", "controlplane"),
        ("edge_agent/agent.py", "from tierline.cli import cli\n", "tierline.cli"),
        ("controlplane/fleet.py", "from cloud import app\n", "cloud.app"),
        ("cloud/app.py", "from console.app import create_app\n", "console.app"),
        ("cloud/app.py", "import edge_agent.tensors\n", "edge_agent.tensors"),
        ("console/app.py", "from bench.cli import cli\n", "bench.cli"),
    ],
)
def test_layer_checker_catches_a_forbidden_import(tmp_path: Path, importer: str, line: str, target: str) -> None:
    files = {importer: line}
    if "." in target:
        files[target.replace(".", "/") + ".py"] = ""
    root = _tree(tmp_path, files)
    found = layer_violations(root)
    assert len(found) == 1 and found[0].startswith(f"{importer}:") and f"imports {target} " in found[0], found


def test_layer_checker_allows_what_the_rules_allow(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "cloud/app.py": "from controlplane.storage import tables\nfrom shared import errors\n",
            "console/app.py": "import controlplane.fleet\n",
            "edge_agent/agent.py": "from shared.errors import ValidationError\nimport numpy\n",
            "tierline/cli.py": "from cloud import app\nfrom console import app as c\nfrom edge_agent import agent\n",
            "bench/cli.py": "from cloud import app\nfrom edge_agent import agent\n",
        },
    )
    assert layer_violations(root) == []


def test_server_stack_checker_catches_torch_in_shared_but_not_in_the_zoo(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "shared/sampling.py": "def f() -> None:\n    import torch.nn\n",
            "shared/db.py": "from sqlmodel import Session\n",
            "shared/zoo/train.py": "import torch\n",
            "cloud/engine.py": "import torch\n",
        },
    )
    assert sorted(server_stack_in_shared(root)) == [
        "shared/db.py:1 imports sqlmodel",
        "shared/sampling.py:2 imports torch.nn",
    ]


def test_circle_checker_finds_a_circle_through_a_function_level_import(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "cloud/a.py": "from cloud.b import g\n",
            "cloud/b.py": "def g() -> None:\n    from cloud import c\n",
            "cloud/c.py": "from . import a\n",
            "cloud/d.py": "from cloud import a\n",
        },
    )
    circles = import_circles(root)
    assert len(circles) == 1, circles
    assert circles[0].startswith("circle between cloud/a.py, cloud/b.py, cloud/c.py:")
    assert "cloud/b.py:2 -> cloud.c" in circles[0] and "cloud/d.py" not in circles[0]


def test_circle_checker_finds_a_type_only_circle(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "cloud/a.py": "from cloud import b\n",
            "cloud/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cloud.a import X\n",
        },
    )
    circles = import_circles(root)
    assert len(circles) == 1 and "cloud/b.py:3 -> cloud.a" in circles[0], circles
    (root / "cloud/b.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    pass\nelse:\n    import cloud.a\n")
    assert len(import_circles(root)) == 1
    (root / "cloud/b.py").write_text("X = 1\n")
    assert import_circles(root) == []


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

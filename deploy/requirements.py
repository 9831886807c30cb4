"""Print the requirements of tierline's core and the given extras, one a line, from pyproject.toml: the image
installs its dependencies from this list before it copies the code, so a code change rebuilds only the code layer.
Self-references (``tierline[storage]``) are expanded.   python3 requirements.py pyproject.toml cloud console"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path


def requirements(project: dict[str, object], extras: list[str]) -> list[str]:
    optional = project.get("optional-dependencies", {})
    assert isinstance(optional, dict)
    name = str(project["name"])
    out: list[str] = list(project.get("dependencies", []))  # type: ignore[call-overload]
    seen: set[str] = set()
    todo = list(extras)
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        if extra not in optional:
            raise SystemExit(f"{name} has no extra {extra!r}")
        seen.add(extra)
        for req in optional[extra]:
            own = re.fullmatch(rf"{re.escape(name)}\[([\w,\s-]+)\]", req.strip())
            if own:
                todo += [e.strip() for e in own.group(1).split(",")]
            elif req not in out:
                out.append(req)
    return out


if __name__ == "__main__":
    pyproject = tomllib.loads(Path(sys.argv[1]).read_text())
    print("\n".join(requirements(pyproject["project"], sys.argv[2:])))

"""The engine's scheduling core is pure Python: importing it never loads torch (it runs and is tested without)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PURE_MODULES = (
    "cloud.engine.scheduler",
    "cloud.engine.block_manager",
    "cloud.engine.sequence",
    "cloud.engine.sampling_params",
    "cloud.engine.config",
    "cloud.engine.protocol",
    "cloud.engine.prompts",
    "cloud.engine.output_processor",
)

_PROBE = r"""
import importlib, json, sys
loaded = {}
for name in sys.argv[1:]:
    importlib.import_module(name)
    loaded[name] = "torch" in sys.modules
print(json.dumps(loaded))
"""


def torch_loaded_after_import(*modules: str) -> dict[str, bool]:
    """Import ``modules`` in order in a fresh interpreter; for each, whether torch was loaded by then."""
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, *modules], cwd=REPO, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    loaded: dict[str, bool] = json.loads(result.stdout)
    return loaded


@pytest.mark.parametrize("module", PURE_MODULES)
def test_importing_a_pure_engine_module_does_not_load_torch(module: str) -> None:
    assert torch_loaded_after_import(module) == {module: False}


def test_importing_all_pure_engine_modules_together_does_not_load_torch() -> None:
    assert torch_loaded_after_import(*PURE_MODULES) == dict.fromkeys(PURE_MODULES, False)


def test_the_probe_sees_torch_when_a_torch_module_is_imported() -> None:
    assert torch_loaded_after_import("cloud.engine.sampler") == {"cloud.engine.sampler": True}

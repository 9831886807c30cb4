"""Local runtimes for edge artifacts: ONNX Runtime and LiteRT, chosen from the artifact's format.

A device may have either runtime or both (``tierline[edge]`` installs both; a device image may carry one):
:func:`installed_runtimes` says which are importable here and :func:`can_run` whether an artifact format is.
"""

from __future__ import annotations

import importlib.util

from edge_agent.runtime.lm import CausalLMRuntime, load_causal_lm

# runtime name (as devices report it in device.runtime) -> the module that provides it
RUNTIME_MODULES = {"onnxruntime": "onnxruntime", "tflite": "ai_edge_litert"}
FORMAT_RUNTIMES = {"onnx": "onnxruntime", "onnx-int8": "onnxruntime", "tflite": "tflite"}


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: blocked with sys.modules[module] = None
        return False


def installed_runtimes() -> list[str]:
    """The inference runtimes importable in this process, in ``RUNTIME_MODULES`` order."""
    return [name for name, module in RUNTIME_MODULES.items() if _importable(module)]


def can_run(fmt: str) -> bool:
    """Whether an artifact of format ``fmt`` has its runtime installed here."""
    runtime = FORMAT_RUNTIMES.get(fmt)
    return runtime is not None and _importable(RUNTIME_MODULES[runtime])


__all__ = ["CausalLMRuntime", "can_run", "installed_runtimes", "load_causal_lm"]

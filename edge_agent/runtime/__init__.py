"""Local runtimes for edge artifacts: ONNX Runtime, LiteRT and llama.cpp (GGUF), chosen from the artifact's format.

A device may have any of them (``tierline[edge]`` installs ONNX Runtime and LiteRT, ``tierline[edge-gguf]``
llama.cpp; a device image may carry one): :func:`installed_runtimes` says which are importable here and
:func:`can_run` whether an ONNX or TFLite artifact format is (GGUF is the runtime guard's: ``gguf.missing_reason``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from edge_agent.runtime.lm import EDGE_MODEL_FILE, CausalLMRuntime, load_causal_lm

# runtime name (as devices report it in device.runtime) -> the module that provides it
RUNTIME_MODULES = {"onnxruntime": "onnxruntime", "tflite": "ai_edge_litert", "llama.cpp": "llama_cpp"}
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


def load_runtime(model_dir: Path, num_threads: int = 1, variant: str | None = None) -> CausalLMRuntime:
    """The runtime for an edge LM artifact directory: a GGUF one (``variant`` picks its weight file, default
    Q8_0) or one described by its ``edge_model.json`` (ONNX, ONNX INT8, TFLite)."""
    from edge_agent.runtime import gguf

    if variant is not None or (not (model_dir / EDGE_MODEL_FILE).is_file() and gguf.is_gguf_dir(model_dir)):
        return gguf.GgufCausalLM(model_dir, variant, num_threads)
    return load_causal_lm(model_dir, num_threads)


__all__ = ["CausalLMRuntime", "can_run", "installed_runtimes", "load_causal_lm", "load_runtime"]

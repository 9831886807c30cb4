"""Which runtimes serve which causal-LM architecture: one table, read at push, at load and at derive.

A checkpoint's ``config.json`` names its architecture (``model_type``, and ``architectures`` such as
``Qwen3ForCausalLM``). :func:`support_for` looks it up before anything loads, so an architecture nothing here can
run is refused at ``models push`` with the list of those that can, rather than failing later in a load or a derive
(vLLM's ``model_executor/models/registry.py`` does the same for its engine).

The columns:

- ``engine``: tierline's own LLM engine (``cloud/engine``), paged KV, prefix cache, speculation, structured output;
- ``onnx``: the edge export to ONNX fp32 with a growing KV cache (and its dynamic INT8 quantization);
- ``tflite``: the edge export to LiteRT (static KV cache), when litert-torch is installed;
- ``gguf``: GGUF f32/Q8_0 for llama.cpp (on devices, and as the cloud's llama.cpp peer).

Pure data and plain Python: devices import it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

RUNTIMES = ("engine", "onnx", "tflite", "gguf")

# model_type -> the runtimes that serve it. Each column is kept true by its runtime's oracle tests against
# transformers on a small random-initialised config of that architecture (tests/*/test_*architectures*).
ENGINE_ARCHITECTURES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "gpt2"})
ONNX_ARCHITECTURES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "gpt2"})
TFLITE_ARCHITECTURES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3"})
GGUF_ARCHITECTURES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "gpt2"})

_COLUMNS = {
    "engine": ENGINE_ARCHITECTURES,
    "onnx": ONNX_ARCHITECTURES,
    "tflite": TFLITE_ARCHITECTURES,
    "gguf": GGUF_ARCHITECTURES,
}

# Names people know the families by, for messages and the docs' table.
FAMILY_NAMES = {
    "llama": "Llama (1-3.x), SmolLM2, TinyLlama",
    "mistral": "Mistral",
    "qwen2": "Qwen2, Qwen2.5",
    "qwen3": "Qwen3 (dense)",
    "gemma2": "Gemma 2",
    "gemma3_text": "Gemma 3 (text)",
    "phi3": "Phi-3, Phi-3.5, Phi-4-mini",
    "gpt2": "GPT-2",
}


@dataclass(frozen=True, slots=True)
class ArchitectureSupport:
    """What can serve one checkpoint: ``runtimes`` (a subset of ``RUNTIMES``), empty when nothing here can."""

    model_type: str
    runtimes: tuple[str, ...]

    @property
    def is_known(self) -> bool:
        return bool(self.runtimes)

    @property
    def engine(self) -> bool:
        return "engine" in self.runtimes

    @property
    def edge_formats(self) -> tuple[str, ...]:
        return tuple(r for r in self.runtimes if r != "engine")

    def summary(self) -> str:
        """One line for a CLI or an API answer."""
        if not self.runtimes:
            return f"architecture {self.model_type!r} has no runtime here"
        return f"{self.model_type}: " + ", ".join(self.runtimes)


def model_type_of(config: dict[str, Any]) -> str:
    """The architecture a ``config.json`` declares: its ``model_type`` (lower case), or ''."""
    value = config.get("model_type")
    return value.strip().lower() if isinstance(value, str) else ""


def support_for(config: dict[str, Any]) -> ArchitectureSupport:
    """The runtimes that can serve the checkpoint whose ``config.json`` is ``config``."""
    model_type = model_type_of(config)
    return ArchitectureSupport(model_type, tuple(r for r in RUNTIMES if model_type in _COLUMNS[r]))


def supported_list(runtime: str = "engine") -> str:
    """``'gemma2, gemma3_text, …'``: the architectures ``runtime`` serves, for an error message."""
    return ", ".join(sorted(_COLUMNS[runtime]))


def unsupported_message(config: dict[str, Any], runtime: str = "engine") -> str:
    """Why ``runtime`` refuses this checkpoint, naming what it supports."""
    model_type = model_type_of(config) or "(none: config.json has no model_type)"
    name = {"engine": "the tierline engine", "onnx": "the ONNX export", "tflite": "the LiteRT export"}.get(
        runtime, "the GGUF export"
    )
    return f"architecture {model_type} is not supported by {name}; supported: {supported_list(runtime)}"


def table_rows() -> list[tuple[str, str, dict[str, bool]]]:
    """(model_type, family names, runtime -> supported) for every architecture any runtime serves."""
    known = sorted(set().union(*_COLUMNS.values()))
    return [(m, FAMILY_NAMES.get(m, m), {r: m in _COLUMNS[r] for r in RUNTIMES}) for m in known]

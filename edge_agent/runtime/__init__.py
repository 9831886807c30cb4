"""Local runtimes for edge artifacts: ONNX Runtime, LiteRT and llama.cpp (GGUF), chosen from the artifact."""

from pathlib import Path

from edge_agent.runtime.lm import EDGE_MODEL_FILE, CausalLMRuntime, load_causal_lm


def load_runtime(model_dir: Path, num_threads: int = 1, variant: str | None = None) -> CausalLMRuntime:
    """The runtime for an edge LM artifact directory: a GGUF one (``variant`` picks its weight file, default
    Q8_0) or one described by its ``edge_model.json`` (ONNX, ONNX INT8, TFLite)."""
    from edge_agent.runtime import gguf

    if variant is not None or (not (model_dir / EDGE_MODEL_FILE).is_file() and gguf.is_gguf_dir(model_dir)):
        return gguf.GgufCausalLM(model_dir, variant, num_threads)
    return load_causal_lm(model_dir, num_threads)


__all__ = ["CausalLMRuntime", "load_causal_lm", "load_runtime"]

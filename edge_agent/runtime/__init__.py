"""Local runtimes for edge artifacts: ONNX Runtime and LiteRT, chosen from the artifact's format."""

from edge_agent.runtime.lm import CausalLMRuntime, load_causal_lm

__all__ = ["CausalLMRuntime", "load_causal_lm"]

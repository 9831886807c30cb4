"""The parts of a Hugging Face ``config.json`` the engine needs, for Llama-family checkpoints."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.errors import ConfigurationError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str
    rope_factor: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    torch_dtype: str
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        path = model_dir / "config.json"
        if not path.is_file():
            raise ConfigurationError(f"{model_dir} is not a Hugging Face checkpoint: no config.json")
        try:
            raw: dict[str, Any] = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigurationError(f"{path}: invalid JSON ({exc.msg} at line {exc.lineno})") from None
        gen_path = model_dir / "generation_config.json"
        generation = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        return cls.from_dict(raw, generation, source=str(path))

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None, source: str = "config"
    ) -> ModelConfig:
        model_type = raw.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigurationError(
                f"{source}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigurationError(f"{source}: hidden_act {act!r} is not supported (only silu)")
        try:
            hidden = int(raw["hidden_size"])
            num_heads = int(raw["num_attention_heads"])
            head_dim = int(raw.get("head_dim") or hidden // num_heads)
            rope = _rope(raw)
            eos = (generation or {}).get("eos_token_id", raw.get("eos_token_id"))
            eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
            return cls(
                model_type=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                head_dim=head_dim,
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=rope[0],
                rope_type=rope[1],
                rope_factor=rope[2],
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
                mlp_bias=bool(raw.get("mlp_bias", False)),
                torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
                eos_token_ids=eos_ids,
                bos_token_id=raw.get("bos_token_id"),
            )
        except KeyError as exc:
            raise ConfigurationError(f"{source}: missing required key {exc.args[0]!r}") from None

    def kv_bytes_per_token(self, element_size: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size


def _rope(raw: dict[str, Any]) -> tuple[float, str, float]:
    """(theta, type, factor) from ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling``."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigurationError(f"rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    factor = float(merged.get("factor", 1.0)) if rope_type != "default" else 1.0
    return theta, rope_type, factor

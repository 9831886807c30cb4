"""The parts of a Hugging Face ``config.json`` the engine needs, read into one ``ModelConfig`` for every family.

Like vLLM's model registry, one table (``_FAMILIES``) says which ``model_type`` the engine builds and what each
family's checkpoints mean by the keys they leave out (the defaults of that family's transformers config class).
Whatever a config asks for that the engine does not compute (an unknown RoPE type, an activation, experts,
bidirectional attention) is refused here with a ``ConfigurationError`` naming the key, before anything loads.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.architectures import support_for, unsupported_message
from shared.errors import ConfigurationError

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "longrope", "llama3", "yarn")
SUPPORTED_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "gelu_new")
LAYER_TYPES = ("full_attention", "sliding_attention")

# model_type -> the defaults its transformers config class gives the keys a checkpoint may leave out.
_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0},
    "mistral": {"max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "sliding_window": 4096},
    "qwen2": {
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_bias": True,
        "max_window_layers": 28,
    },
    "qwen3": {
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "head_dim": 128,
        "max_window_layers": 28,
    },
    "gemma2": {
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "head_dim": 256,
        "num_key_value_heads": 4,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
        "max_position_embeddings": 8192,
    },
    "gemma3_text": {
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10000.0,
        "head_dim": 256,
        "num_key_value_heads": 4,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
        "max_position_embeddings": 131072,
    },
    "phi3": {"rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096},
    "gpt2": {
        "n_positions": 1024,
        "layer_norm_epsilon": 1e-5,
        "activation_function": "gelu_new",
        "tie_word_embeddings": True,
    },
}
SUPPORTED_MODEL_TYPES = tuple(_FAMILIES)
# Keys whose null means "off" rather than "the default".
_NULLABLE = ("sliding_window", "attn_logit_softcapping", "final_logit_softcapping")
_GEMMA = ("gemma2", "gemma3_text")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """One decoder-only transformer, whatever its family: the Llama layout plus the options the others need.

    ``rms_norm_eps`` is the epsilon of every norm (RMSNorm, or LayerNorm where ``norm == "layer"``). A layer
    attends the last ``sliding_window`` positions (itself included) when its ``layer_types`` entry is
    ``sliding_attention``, and its whole context otherwise; ``layer_windows`` gives each layer's window (0: none).
    """

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
    o_proj_bias: bool = False
    norm: str = "rms"  # "rms" | "layer" (LayerNorm with bias)
    norm_offset: bool = False  # Gemma: RMSNorm weights stored as offsets, applied as x * (1 + w)
    activation: str = "silu"
    is_gated_mlp: bool = True  # down(act(gate) * up); else down(act(up)) (GPT-2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # norms after attention and around the MLP too (Gemma 2/3)
    embedding_scale: float | None = None  # embeddings times this, rounded to the model dtype (Gemma)
    attention_scale: float | None = None  # None: head_dim ** -0.5
    scale_attn_by_inverse_layer_idx: bool = False  # GPT-2 option: layer i's scale divided by i + 1
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # empty: every layer full attention
    position_embedding: str = "rope"  # "rope" | "learned" (GPT-2's wpe)
    rope_local_theta: float | None = None  # RoPE base of sliding layers when it differs (Gemma 3)
    partial_rotary_factor: float = 1.0  # the first head_dim * factor dims are rotated (Phi-4-mini)
    rope_original_max_positions: int = 0  # the pretraining context (longrope: the long factors apply past it)
    rope_short_factor: tuple[float, ...] = ()
    rope_long_factor: tuple[float, ...] = ()
    rope_attention_factor: float = 1.0  # longrope, yarn: cos and sin scaled by this
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths past original / low are divided by the factor
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below original / high are kept (smoothed between)
    rope_beta_fast: float = 32.0  # yarn: the rotations bounding the ramp from extrapolation to interpolation
    rope_beta_slow: float = 1.0
    rope_truncate: bool = True  # yarn: the ramp's bounds rounded to whole dims

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's sliding window (0: the whole context)."""
        window = self.sliding_window or 0
        types = self.layer_types or ("full_attention",) * self.num_layers
        return tuple(window if t == "sliding_attention" else 0 for t in types)

    def layer_attention_scale(self, layer: int) -> float:
        scale = self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5
        return scale / (layer + 1) if self.scale_attn_by_inverse_layer_idx else scale

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
        if not isinstance(raw, dict):
            raise ConfigurationError(f"{source}: config.json must be a JSON object")
        model_type = raw.get("model_type", "")
        if not isinstance(model_type, str) or model_type not in _FAMILIES or not support_for(raw).engine:
            raise ConfigurationError(f"{source}: {unsupported_message(raw)}")
        cfg = {**_FAMILIES[model_type], **{k: v for k, v in raw.items() if v is not None or k in _NULLABLE}}
        try:
            return cls._read(model_type, cfg, generation or {})
        except KeyError as exc:
            raise ConfigurationError(f"{source}: missing required key {exc.args[0]!r}") from None
        except ConfigurationError as exc:
            raise ConfigurationError(f"{source}: {exc}") from None
        except (TypeError, ValueError, AttributeError) as exc:  # (e.g. a number where a list or mapping belongs)
            raise ConfigurationError(f"{source}: a value has the wrong type ({exc})") from None

    @classmethod
    def _read(cls, model_type: str, raw: dict[str, Any], generation: dict[str, Any]) -> ModelConfig:
        _refuse_unsupported(model_type, raw)
        is_gpt2, is_gemma = model_type == "gpt2", model_type in _GEMMA
        hidden = int(raw["n_embd" if is_gpt2 else "hidden_size"])
        num_heads = int(raw["n_head" if is_gpt2 else "num_attention_heads"])
        num_layers = int(raw["n_layer" if is_gpt2 else "num_hidden_layers"])
        head_dim = int(raw.get("head_dim") or hidden // num_heads)
        max_positions = int(raw["n_positions" if is_gpt2 else "max_position_embeddings"])
        act_key = "activation_function" if is_gpt2 else "hidden_activation" if is_gemma else "hidden_act"
        activation = {"swish": "silu"}.get(str(raw.get(act_key, "silu")), str(raw.get(act_key, "silu")))
        if activation not in SUPPORTED_ACTIVATIONS:
            raise ConfigurationError(f"{act_key} {activation!r} is not supported; supported: {SUPPORTED_ACTIVATIONS}")
        eos = generation.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
        attention_bias = is_gpt2 or (model_type not in ("mistral", "phi3") and bool(raw.get("attention_bias", False)))
        intermediate = int(raw.get("n_inner") or 4 * hidden) if is_gpt2 else int(raw["intermediate_size"])
        rope = _rope(model_type, raw, head_dim, max_positions) if not is_gpt2 else _Rope()
        layer_types = _layer_types(model_type, raw, num_layers)
        window = raw.get("sliding_window")
        if model_type in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
            window = None
        softcaps = [raw.get("attn_logit_softcapping"), raw.get("final_logit_softcapping")] if is_gemma else [None] * 2
        if model_type == "gemma3_text":
            softcaps[0] = None  # (transformers' Gemma 3 attention never reads attn_logit_softcapping)
        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(raw["layer_norm_epsilon" if is_gpt2 else "rms_norm_eps"]),
            rope_theta=rope.theta,
            rope_type=rope.type,
            rope_factor=rope.factor,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)) or is_gpt2,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            o_proj_bias=attention_bias and model_type != "qwen2",
            norm="layer" if is_gpt2 else "rms",
            norm_offset=is_gemma,
            activation=activation,
            is_gated_mlp=not is_gpt2,
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            sandwich_norms=is_gemma,
            embedding_scale=hidden**0.5 if is_gemma else None,
            attention_scale=float(raw["query_pre_attn_scalar"]) ** -0.5 if is_gemma else None,
            scale_attn_by_inverse_layer_idx=is_gpt2 and bool(raw.get("scale_attn_by_inverse_layer_idx", False)),
            attn_logit_softcap=float(softcaps[0]) if softcaps[0] else None,
            final_logit_softcap=float(softcaps[1]) if softcaps[1] else None,
            sliding_window=int(window) if window else None,
            layer_types=layer_types,
            position_embedding="learned" if is_gpt2 else "rope",
            rope_local_theta=rope.local_theta,
            partial_rotary_factor=rope.partial,
            rope_original_max_positions=rope.original_max,
            rope_short_factor=rope.short,
            rope_long_factor=rope.long,
            rope_attention_factor=rope.attention_factor,
            rope_low_freq_factor=rope.low_freq,
            rope_high_freq_factor=rope.high_freq,
            rope_beta_fast=rope.beta_fast,
            rope_beta_slow=rope.beta_slow,
            rope_truncate=rope.truncate,
        )

    def kv_bytes_per_token(self, element_size: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size


def _refuse_unsupported(model_type: str, raw: dict[str, Any]) -> None:
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if raw.get(key):
            raise ConfigurationError(f"{key} {raw[key]!r}: mixture-of-experts models are not supported")
    for key in ("use_bidirectional_attention", "add_cross_attention", "attention_sinks"):
        if raw.get(key):
            raise ConfigurationError(f"{key} is set: not supported by the engine (only causal self-attention)")
    if model_type == "gpt2" and not raw.get("scale_attn_weights", True):
        raise ConfigurationError("scale_attn_weights false is not supported (GPT-2 attention is scaled)")


def _layer_types(model_type: str, raw: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """Each layer's attention: the config's ``layer_types`` (transformers 5), else the family's pattern."""
    types = raw.get("layer_types")
    if types is None:
        if model_type == "gemma2":
            types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
        elif model_type == "gemma3_text":
            pattern = int(raw["sliding_window_pattern"])
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
        elif model_type in ("qwen2", "qwen3"):
            first = int(raw["max_window_layers"])
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        elif model_type in ("mistral", "phi3"):
            types = ["sliding_attention"] * num_layers
        else:
            types = ["full_attention"] * num_layers
    if not isinstance(types, list) or len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise ConfigurationError(f"layer_types must list one of {LAYER_TYPES} for each of the {num_layers} layers")
    return tuple(types)


@dataclass(frozen=True, slots=True)
class _Rope:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    local_theta: float | None = None
    partial: float = 1.0
    original_max: int = 0
    short: tuple[float, ...] = ()
    long: tuple[float, ...] = ()
    attention_factor: float = 1.0
    low_freq: float = 1.0
    high_freq: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


def _rope(model_type: str, raw: dict[str, Any], head_dim: int, max_positions: int) -> _Rope:
    """RoPE from ``rope_parameters`` (transformers 5; per layer type for Gemma 3) or ``rope_theta`` +
    ``rope_scaling`` (+ ``rope_local_base_freq``), as the family's transformers config reads them."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    local_theta: float | None = None
    if model_type == "gemma3_text":
        local = params.get("sliding_attention") or {}
        params = params.get("full_attention") or ({} if "sliding_attention" in params else params)
        if local.get("rope_type", "default") != "default":
            raise ConfigurationError(
                f"rope type {local['rope_type']!r} on sliding layers is not supported; supported: ('default',)"
            )
        local_theta = float(local.get("rope_theta", raw["rope_local_base_freq"]))
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", raw["rope_theta"]))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if model_type == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # (transformers' Phi-3 reads the old names so)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigurationError(f"rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    partial = float(merged.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    if model_type != "phi3":
        partial = 1.0  # (only Phi-3's transformers code reads it among these families)
    if not 0.0 < partial <= 1.0 or int(head_dim * partial) % 2:
        raise ConfigurationError(f"partial_rotary_factor {partial} must leave an even number of rotated dims")
    if rope_type not in ("longrope", "llama3", "yarn"):
        factor = float(merged.get("factor", 1.0)) if rope_type != "default" else 1.0
        return _Rope(theta, rope_type, factor, local_theta, partial)
    # (transformers moves a top-level original_max_position_embeddings into the RoPE parameters, over theirs, except
    # where they are per layer type; else the parameters' own, else max_position_embeddings)
    top = raw.get("original_max_position_embeddings") if model_type != "gemma3_text" else None
    original = int(top or merged.get("original_max_position_embeddings") or 0) or max_positions
    if rope_type == "llama3":
        factor, low, high = (float(merged[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
        return _Rope(theta, "llama3", factor, local_theta, partial, original, low_freq=low, high_freq=high)
    if rope_type == "yarn":
        return _yarn(merged, theta, local_theta, partial, original, max_positions, model_type == "gemma3_text")
    half = int(head_dim * partial) // 2
    short, long = tuple(map(float, merged["short_factor"])), tuple(map(float, merged["long_factor"]))
    if len(short) != half or len(long) != half:
        raise ConfigurationError(f"rope short_factor and long_factor must each have {half} values")
    factor = float(merged.get("factor") or max_positions / original)
    attention = merged.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return _Rope(theta, "longrope", factor, local_theta, partial, original, short, long, float(attention))


def _yarn(
    params: dict[str, Any],
    theta: float,
    local_theta: float | None,
    partial: float,
    original: int,
    max_positions: int,
    is_nested: bool,
) -> _Rope:
    """YaRN's parameters as transformers reads them: the factor (else max / original positions), the attention
    factor (else from the factor, and ``mscale`` over ``mscale_all_dim`` where both are set), beta_fast and
    beta_slow (32 and 1 where unset or zero), ``truncate`` (read from the top of the RoPE parameters: always true
    where they are per layer type)."""
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_positions / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, float(m)) / mscale(factor, float(m_all)) if m and m_all else mscale(factor)
    beta_fast, beta_slow = float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)
    truncate = True if is_nested else bool(params.get("truncate", True))
    return _Rope(
        theta,
        "yarn",
        factor,
        local_theta,
        partial,
        original,
        attention_factor=float(attention),
        beta_fast=beta_fast,
        beta_slow=beta_slow,
        truncate=truncate,
    )

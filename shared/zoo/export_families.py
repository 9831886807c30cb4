"""What the edge exports need to know about a decoder checkpoint, read from its ``config.json`` alone.

:func:`decoder_spec` turns a config into a :class:`DecoderSpec`: the knobs on which the supported families
(llama, mistral, qwen2, qwen3, gemma2, gemma3_text, phi3, and gpt2 for ONNX) differ, each with the default
transformers' own config class gives it when ``config.json`` leaves it out. It accepts configs written by
transformers 4 (``rope_theta``, ``rope_scaling``) and 5 (``rope_parameters``, ``layer_types``). Anything it does
not implement (an architecture, a RoPE type, an activation, a layer type) is refused with a ``ValueError`` naming
it, before any weight loads.

The numerics follow ``transformers.models.<family>.modeling_*`` (5.x); :mod:`shared.zoo.export_lm` runs them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from shared.architectures import model_type_of, support_for, unsupported_message

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "gpt2")
ROPE_TYPES = ("default", "linear", "llama3", "longrope")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu_new")
_GEMMA = ("gemma2", "gemma3_text")
# transformers' config-class defaults where they differ from hidden_size // num_attention_heads.
_DEFAULT_HEAD_DIM = {"gemma2": 256, "gemma3_text": 256, "qwen3": 128}
FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """One rotary embedding: inverse frequencies for the first ``rotary_dim`` channels of each head.

    ``long_inv_freq`` is set for LongRoPE only: transformers uses it for a forward whose positions reach past
    ``original_max_position_embeddings`` (the total length, cache included), ``inv_freq`` (short factors) otherwise.
    """

    rotary_dim: int
    inv_freq: tuple[float, ...]
    long_inv_freq: tuple[float, ...] | None = None
    original_max_position_embeddings: int = 0
    attention_scaling: float = 1.0


@dataclass(frozen=True, slots=True)
class DecoderSpec:
    """A decoder-only transformer as the exports compute it; per-layer tuples have ``num_layers`` entries."""

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    hidden_size: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    norm_eps: float
    activation: str
    norm_offset: bool  # Gemma's RMSNorm scales by (1 + weight)
    embed_scale: float | None  # Gemma multiplies the embeddings by sqrt(hidden_size)
    sandwich_norms: bool  # Gemma: norms after attention and around the MLP
    qk_norm: bool  # Qwen3, Gemma 3: RMSNorm of each query/key head before RoPE
    attn_scale: float
    attn_softcap: float | None
    final_softcap: float | None
    windows: tuple[int | None, ...]  # sliding window per layer (None: full causal attention)
    ropes: tuple[RopeSpec, ...]  # per layer; empty with learned positions
    layer_norm: bool = False  # GPT-2: LayerNorm (mean and bias) instead of RMSNorm
    gated_mlp: bool = True  # down(act(gate) * up); GPT-2: down(act(up))
    learned_positions: bool = False  # GPT-2: a position embedding table instead of RoPE


def _refuse(config: dict[str, Any], what: str, value: object, supported: str) -> ValueError:
    return ValueError(f"{model_type_of(config)}: {what} {value!r} is not supported by the edge export; {supported}")


def decoder_spec(config: dict[str, Any], runtime: str = "onnx") -> DecoderSpec:
    """The :class:`DecoderSpec` of ``config`` (a parsed ``config.json``); ``ValueError`` when the export cannot
    compute it exactly (``runtime`` names the export in that message: ``onnx`` or ``tflite``)."""
    model_type = model_type_of(config)
    if model_type not in FAMILIES or runtime not in support_for(config).runtimes:
        raise ValueError(unsupported_message(config, runtime))
    if model_type == "gpt2":
        return _gpt2_spec(config)
    gemma = model_type in _GEMMA
    if config.get("use_bidirectional_attention"):
        raise _refuse(config, "use_bidirectional_attention", True, "decoders are causal here")
    try:
        num_layers = int(config["num_hidden_layers"])
        num_heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        vocab = int(config["vocab_size"])
    except KeyError as exc:
        raise ValueError(f"{model_type}: config.json has no {exc.args[0]!r}") from None
    head_dim = int(config.get("head_dim", _DEFAULT_HEAD_DIM.get(model_type)) or hidden // num_heads)
    act_key = "hidden_activation" if gemma and config.get("hidden_activation") else "hidden_act"
    activation = str(config.get(act_key) or ("gelu_pytorch_tanh" if gemma else "silu"))
    if activation not in ACTIVATIONS:
        raise _refuse(config, act_key, activation, f"supported: {', '.join(ACTIVATIONS)}")
    layer_types = _layer_types(config, model_type, num_layers)
    window = _sliding_window(config, model_type)
    ropes = _ropes(config, model_type, head_dim, num_heads, hidden)
    scalar = config.get("query_pre_attn_scalar", 256) if gemma else None
    return DecoderSpec(
        model_type=model_type,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        hidden_size=hidden,
        head_dim=head_dim,
        vocab_size=vocab,
        max_position_embeddings=int(config.get("max_position_embeddings") or 2048),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        activation=activation,
        norm_offset=gemma,
        embed_scale=hidden**0.5 if gemma else None,
        sandwich_norms=gemma,
        qk_norm=model_type in ("qwen3", "gemma3_text"),
        attn_scale=float(scalar) ** -0.5 if scalar is not None else head_dim**-0.5,
        attn_softcap=_optional_float(config, "attn_logit_softcapping", 50.0 if model_type == "gemma2" else None),
        final_softcap=_optional_float(config, "final_logit_softcapping", 30.0 if model_type == "gemma2" else None),
        windows=tuple(window if t == SLIDING else None for t in layer_types),
        ropes=tuple(ropes[t] if t in ropes else ropes[FULL] for t in layer_types),
    )


def _gpt2_spec(config: dict[str, Any]) -> DecoderSpec:
    """GPT-2 (``transformers.models.gpt2``): learned positions, LayerNorm, a plain GELU MLP, Conv1D weights."""
    for option in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        if config.get(option):
            raise _refuse(config, option, True, "GPT-2 is exported without it")
    activation = str(config.get("activation_function") or "gelu_new")
    if activation not in ACTIVATIONS:
        raise _refuse(config, "activation_function", activation, f"supported: {', '.join(ACTIVATIONS)}")
    try:
        num_layers, num_heads, hidden = int(config["n_layer"]), int(config["n_head"]), int(config["n_embd"])
        vocab = int(config["vocab_size"])
    except KeyError as exc:
        raise ValueError(f"gpt2: config.json has no {exc.args[0]!r}") from None
    head_dim = hidden // num_heads
    return DecoderSpec(
        model_type="gpt2",
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_heads,
        hidden_size=hidden,
        head_dim=head_dim,
        vocab_size=vocab,
        max_position_embeddings=int(config.get("n_positions") or 1024),
        norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
        activation=activation,
        norm_offset=False,
        embed_scale=None,
        sandwich_norms=False,
        qk_norm=False,
        attn_scale=head_dim**-0.5 if config.get("scale_attn_weights", True) else 1.0,
        attn_softcap=None,
        final_softcap=None,
        windows=(None,) * num_layers,
        ropes=(),
        layer_norm=True,
        gated_mlp=False,
        learned_positions=True,
    )


def _optional_float(config: dict[str, Any], key: str, default: float | None) -> float | None:
    value = config.get(key, default)
    return float(value) if value is not None else None


def _sliding_window(config: dict[str, Any], model_type: str) -> int | None:
    if model_type == "llama":
        return None
    if model_type in ("qwen2", "qwen3") and not config.get("use_sliding_window", False):
        return None
    window = config.get("sliding_window", 4096 if model_type in _GEMMA else None)
    return int(window) if window is not None else None


def _layer_types(config: dict[str, Any], model_type: str, num_layers: int) -> list[str]:
    """Each layer's attention (full or sliding), as the family's config class fills ``layer_types`` in."""
    given = config.get("layer_types")
    if model_type in ("llama", "mistral", "phi3") or not given:
        # Mistral and Phi-3 apply their sliding_window (when set) to every layer; they ignore layer_types.
        if model_type in ("mistral", "phi3") and _sliding_window(config, model_type) is not None:
            return [SLIDING] * num_layers
        if model_type in ("qwen2", "qwen3") and _sliding_window(config, model_type) is not None:
            first = int(config.get("max_window_layers", 28))
            return [SLIDING if i >= first else FULL for i in range(num_layers)]
        if model_type == "gemma2":
            return [SLIDING if (i + 1) % 2 else FULL for i in range(num_layers)]
        if model_type == "gemma3_text":
            pattern = int(config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6)
            return [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
        return [FULL] * num_layers
    types = [str(t) for t in given]
    if len(types) != num_layers:
        raise ValueError(f"{model_type}: layer_types has {len(types)} entries for {num_layers} layers")
    for t in types:
        if t not in (FULL, SLIDING):
            raise _refuse(config, "layer type", t, f"supported: {FULL}, {SLIDING}")
    return types


def _ropes(config: dict[str, Any], model_type: str, head_dim: int, num_heads: int, hidden: int) -> dict[str, RopeSpec]:
    """RoPE per layer type (Gemma 3 gives its sliding layers their own base); one entry under ``FULL`` otherwise."""
    given = config.get("rope_parameters") or {}
    legacy = config.get("rope_scaling") or {}
    if model_type == "gemma3_text":
        if FULL in given or SLIDING in given:
            full = dict(given.get(FULL) or {})
            local = dict(given.get(SLIDING) or {})
        else:  # transformers 4: rope_theta (global), rope_local_base_freq, rope_scaling on the global layers
            full = {**legacy, **given}
            local = {}
        full.setdefault("rope_theta", config.get("rope_theta", 1_000_000.0))
        local.setdefault("rope_theta", config.get("rope_local_base_freq", 10_000.0))
        return {FULL: _rope(config, full, head_dim), SLIDING: _rope(config, local, head_dim)}
    params = {**legacy, **given}
    params.setdefault("rope_theta", config.get("rope_theta", 10_000.0))
    if "partial_rotary_factor" in config:
        params.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    return {FULL: _rope(config, params, head_dim)}


def _rope(config: dict[str, Any], params: dict[str, Any], head_dim: int) -> RopeSpec:
    """``transformers.modeling_rope_utils``'s inverse frequencies for ``params`` (one standardised rope dict)."""
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type not in ROPE_TYPES:
        raise _refuse(config, "rope type", rope_type, f"supported: {', '.join(ROPE_TYPES)}")
    theta = float(params["rope_theta"])
    dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (theta**exponents)
    max_positions = int(config.get("max_position_embeddings") or 2048)
    # Phi-3 keeps its pretraining length outside the rope dict; transformers gives that one priority.
    original = int(
        config.get("original_max_position_embeddings") or params.get("original_max_position_embeddings") or 0
    )
    original = original or max_positions
    if rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3(inv_freq, params, original)
    elif rope_type == "longrope":
        factor = float(params.get("factor") or max_positions / original)
        scaling = params.get("attention_factor")
        if scaling is None:
            scaling = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        base = theta**exponents
        short = 1.0 / (torch.tensor(params["short_factor"], dtype=torch.float32) * base)
        long = 1.0 / (torch.tensor(params["long_factor"], dtype=torch.float32) * base)
        if short.shape != exponents.shape or long.shape != exponents.shape:
            raise ValueError(f"{model_type_of(config)}: longrope factors need {dim // 2} entries each")
        return RopeSpec(dim, tuple(short.tolist()), tuple(long.tolist()), original, float(scaling))
    return RopeSpec(dim, tuple(inv_freq.tolist()))


def _llama3(inv_freq: torch.Tensor, params: dict[str, Any], original: int) -> torch.Tensor:
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)

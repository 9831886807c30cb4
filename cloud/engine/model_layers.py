"""The building blocks ``model.py`` assembles: projections in the CPU layout, norms, activations and RoPE.

Numerics follow transformers family by family: RMSNorm in fp32 (Llama casts before the weight, Gemma after its
``1 + w``), RoPE computed in fp32 (rotate-half; partial rotation, Phi-3's longrope, Llama 3.1's llama3 and YaRN as
transformers does them, op for op, so the tables are its bits).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812 (the torch convention)
from torch import nn

from cloud.engine.model_config import ModelConfig


class TransposedLinear(nn.Module):
    """A linear layer whose weight is kept as [in, out], contiguous: ``x @ weight_t``.

    On CPU, BLAS multiplies a few rows by a wide weight streamed from memory two to three times faster in this
    layout than in nn.Linear's [out, in] (measured on AMD EPYC, twelve distinct weights: 256x1536 at one row 50 µs
    vs 170 µs, the 256x4096 LM head 178 µs vs 518 µs; 768x256 at one row 29 µs vs 20 µs; at 16 to 256 rows
    within 15 % either way), and decoding, a few rows per sequence, is exactly that: the whole forward of the
    demo cloud LM at one to five tokens is 13-21 % faster.
    """

    def __init__(self, weight_t: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(weight_t, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> TransposedLinear:
        return cls(linear.weight.detach().t().contiguous(), linear.bias.detach() if linear.bias is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return x @ self.weight_t
        if x.dim() != 2:
            return x @ self.weight_t + self.bias
        return torch.addmm(self.bias, x, self.weight_t)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim; ``offset``: the weight is stored as an offset from 1 (Gemma's ``x * (1 + w)``,
    multiplied in fp32 before the cast back, as transformers' Gemma does; Llama casts first)."""

    def __init__(self, dim: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if self.offset:
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
            return (h * (1.0 + self.weight.float())).to(dtype)
        if dtype == torch.float32:  # no conversions to dispatch (each costs a step about as much as a small op)
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def make_norm(config: ModelConfig, dim: int) -> nn.Module:
    if config.norm == "layer":
        return nn.LayerNorm(dim, eps=config.rms_norm_eps)
    return RMSNorm(dim, config.rms_norm_eps, offset=config.norm_offset)


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    # transformers' NewGELUActivation, written out (its rounding differs from torch's tanh GELU).
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation ``ModelConfig.activation`` names (one of ``SUPPORTED_ACTIVATIONS``)."""
    functions: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "silu": F.silu,
        "gelu": F.gelu,
        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "gelu_new": _gelu_new,
    }
    return functions[name]


class RotaryEmbedding(nn.Module):
    """cos/sin per position for the first ``rotary_dim`` dims of a head. ``dynamic`` NTK scaling recomputes the
    base from each sequence's length; ``longrope`` switches to its long factors for a sequence longer than the
    original context (as transformers does for a forward whose last position is past it). ``llama3`` and ``yarn``
    change the frequencies only, the same at every length (yarn's attention factor is in the tables), so the
    tables are all there is to them. ``local``: the RoPE of sliding layers where it has its own base (Gemma 3)."""

    inv_freq: torch.Tensor
    cos_table: torch.Tensor
    sin_table: torch.Tensor
    long_cos_table: torch.Tensor
    long_sin_table: torch.Tensor

    def __init__(self, config: ModelConfig, max_positions: int, local: bool = False) -> None:
        super().__init__()
        self.config = config
        self.rope_type = "default" if local else config.rope_type
        theta = config.rope_local_theta if local and config.rope_local_theta is not None else config.rope_theta
        self.theta = theta
        dim = config.rotary_dim
        self.exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        inv_freq = 1.0 / (theta**self.exponents)
        if self.rope_type == "linear":
            inv_freq = inv_freq / config.rope_factor
        elif self.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, config)
        elif self.rope_type == "yarn":
            inv_freq = _yarn_inv_freq(theta**self.exponents, config)
        positions = torch.arange(max(max_positions, 1), dtype=torch.float32)
        if self.rope_type == "longrope":
            short = torch.tensor(config.rope_short_factor, dtype=torch.float32)
            long = torch.tensor(config.rope_long_factor, dtype=torch.float32)
            inv_freq = 1.0 / (short * theta**self.exponents)
            long_freqs = positions[:, None] * (1.0 / (long * theta**self.exponents))[None, :]
            scale = config.rope_attention_factor
            self.register_buffer("long_cos_table", long_freqs.cos() * scale, persistent=False)
            self.register_buffer("long_sin_table", long_freqs.sin() * scale, persistent=False)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        freqs = positions[:, None] * inv_freq[None, :]
        scale = config.rope_attention_factor if self.rope_type in ("longrope", "yarn") else 1.0
        self.register_buffer("cos_table", freqs.cos() * scale if scale != 1.0 else freqs.cos(), persistent=False)
        self.register_buffer("sin_table", freqs.sin() * scale if scale != 1.0 else freqs.sin(), persistent=False)

    @property
    def needs_seq_lens(self) -> bool:
        return self.rope_type in ("dynamic", "longrope")

    def forward(
        self, positions: torch.Tensor, seq_lens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions, seq_lens: [T]. Returns cos, sin: [T, rotary_dim/2] in fp32."""
        cfg = self.config
        if self.rope_type == "longrope" and seq_lens is not None:
            is_long = (seq_lens > cfg.rope_original_max_positions)[:, None]
            cos = torch.where(is_long, self.long_cos_table[positions], self.cos_table[positions])
            return cos, torch.where(is_long, self.long_sin_table[positions], self.sin_table[positions])
        if (
            self.rope_type == "dynamic"
            and seq_lens is not None
            and bool((seq_lens > cfg.max_position_embeddings).any())
        ):
            # transformers' dynamic NTK: base grows with the current length once past the trained context.
            length = seq_lens.clamp(min=cfg.max_position_embeddings).float()
            factor, dim = cfg.rope_factor, cfg.rotary_dim
            base = self.theta * ((factor * length / cfg.max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
            inv_freq = 1.0 / (base[:, None] ** self.exponents.to(base.device)[None, :])
            freqs = positions.float()[:, None] * inv_freq
            return freqs.cos(), freqs.sin()
        return self.cos_table[positions], self.sin_table[positions]


def _llama3_inv_freq(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Llama 3.1's frequencies: wavelengths longer than original / low_freq_factor divided by the factor, shorter
    than original / high_freq_factor kept, those between smoothly interpolated (transformers' op order)."""
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    original = cfg.rope_original_max_positions
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(pos_freqs: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """YaRN's frequencies: extrapolated (the base ones) for the dims rotating more than beta_fast times over the
    original context, interpolated (divided by the factor) for those rotating fewer than beta_slow times, a linear
    ramp between (transformers' op order; the attention factor is applied to cos and sin by the caller)."""
    dim, base, original = cfg.rotary_dim, cfg.rope_theta, cfg.rope_original_max_positions

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(cfg.rope_beta_fast), correction_dim(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (transformers' guard against a zero-width ramp)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (cfg.rope_factor * pos_freqs)
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def rotary_factors(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, D/2] → the factors ``apply_rotary`` takes, [T, 1, D]: (cos, cos) and (-sin, sin). Built once a
    step rather than once a layer."""
    return torch.cat((cos, cos), dim=-1)[:, None, :], torch.cat((-sin, sin), dim=-1)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: from ``rotary_factors``. Rotate-half RoPE, (x1 c - x2 s, x2 c + x1 s), as
    x * (c, c) + (x2, x1) * (-s, s): four ops instead of seven, and the same numbers (a - b is a + (-b) in IEEE).
    When cos covers fewer dims than a head (partial rotary), the rest pass through."""
    dtype = x.dtype
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)
    if dtype != torch.float32:
        x = x.float()
    half = x.shape[-1] // 2
    out = x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin
    return out if dtype == torch.float32 else out.to(dtype)

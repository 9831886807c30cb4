"""A Llama-family decoder (Llama, Qwen2, Mistral) over a paged KV cache.

Projections are fused (q/k/v into one matmul, gate/up into another) because on small batches the
number of kernel launches, not FLOPs, bounds a step. Numerics follow transformers: RMSNorm in fp32,
rotate-half RoPE computed in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 (the torch convention)
from torch import nn

from cloud.engine.attention import AttentionMetadata, paged_attention
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
        return torch.addmm(self.bias, x, self.weight_t)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:  # no conversions to dispatch (each costs a step about as much as a small op)
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin per position; ``dynamic`` NTK scaling recomputes the base from each sequence's length."""

    inv_freq: torch.Tensor
    cos_table: torch.Tensor
    sin_table: torch.Tensor

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        dim = config.head_dim
        self.exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        inv_freq = 1.0 / (config.rope_theta**self.exponents)
        if config.rope_type == "linear":
            inv_freq = inv_freq / config.rope_factor
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        positions = torch.arange(max(max_positions, 1), dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        self.register_buffer("cos_table", freqs.cos(), persistent=False)
        self.register_buffer("sin_table", freqs.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, seq_lens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions, seq_lens: [T]. Returns cos, sin: [T, D/2] in fp32."""
        cfg = self.config
        if cfg.rope_type == "dynamic" and seq_lens is not None and bool((seq_lens > cfg.max_position_embeddings).any()):
            # transformers' dynamic NTK: base grows with the current length once past the trained context.
            length = seq_lens.clamp(min=cfg.max_position_embeddings).float()
            factor, dim = cfg.rope_factor, cfg.head_dim
            base = cfg.rope_theta * ((factor * length / cfg.max_position_embeddings) - (factor - 1)) ** (
                dim / (dim - 2)
            )
            inv_freq = 1.0 / (base[:, None] ** self.exponents.to(base.device)[None, :])
            freqs = positions.float()[:, None] * inv_freq
            return freqs.cos(), freqs.sin()
        return self.cos_table[positions], self.sin_table[positions]


def rotary_factors(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, D/2] → the factors ``apply_rotary`` takes, [T, 1, D]: (cos, cos) and (-sin, sin). Built once a
    step rather than once a layer."""
    return torch.cat((cos, cos), dim=-1)[:, None, :], torch.cat((-sin, sin), dim=-1)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: from ``rotary_factors``. Rotate-half RoPE, (x1 c - x2 s, x2 c + x1 s), as
    x * (c, c) + (x2, x1) * (-s, s): four ops instead of seven, and the same numbers (a - b is a + (-b) in IEEE)."""
    dtype = x.dtype
    if dtype != torch.float32:
        x = x.float()
    half = x.shape[-1] // 2
    out = x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin
    return out if dtype == torch.float32 else out.to(dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        # q and k rotated as one [T, H + KVH, D] tensor: half the ops of rotating each (the same numbers).
        qk = apply_rotary(
            qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin
        )
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        o = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    """Token ids in, hidden states out; ``compute_logits`` projects the rows that need sampling."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: nn.Module = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(config, max_positions)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        seq_lens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] → hidden states [T, hidden]."""
        cos, sin = rotary_factors(*self.rotary(positions, seq_lens))
        x = self.embed_tokens(input_ids)
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def transpose_linear_weights(self) -> None:
        """Keep every projection's weight as [in, out] (see ``TransposedLinear``: faster on CPU). A tied
        embedding shares the LM head's transposed tensor through a view, so no weight is held twice."""
        for module in list(self.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(module, name, TransposedLinear.from_linear(child))
        if self.config.tie_word_embeddings:
            head = self.lm_head
            assert isinstance(head, TransposedLinear)
            self.embed_tokens.weight = nn.Parameter(head.weight_t.t(), requires_grad=False)

"""A decoder-only transformer over a paged KV cache: Llama, Qwen2/3, Mistral, Gemma 2/3, Phi-3 and GPT-2.

One decoder with options read from ``ModelConfig`` (q/k norms, sandwich norms, LayerNorm, learned positions,
soft-capping, sliding windows, per-layer RoPE); with none of them it is exactly the Llama computation, which
``is_llama_layout`` tells the fused C decode step. Projections are fused (q/k/v into one matmul, gate/up into
another) because on small batches the number of kernel launches, not FLOPs, bounds a step.
"""

from __future__ import annotations

import torch
from torch import nn

from cloud.engine.attention import AttentionMetadata, paged_attention
from cloud.engine.model_config import ModelConfig
from cloud.engine.model_layers import (
    RMSNorm,
    RotaryEmbedding,
    TransposedLinear,
    activation,
    apply_rotary,
    make_norm,
    rotary_factors,
)

__all__ = ["CausalLM", "RotaryEmbedding", "TransposedLinear", "apply_rotary", "rotary_factors"]

Rotary = tuple[torch.Tensor, torch.Tensor] | None  # rotary_factors' (cos, sin), or None without RoPE


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.scale = config.layer_attention_scale(layer)
        self.window = config.layer_windows[layer]
        self.softcap = config.attn_logit_softcap or 0.0
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, offset=config.norm_offset)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, offset=config.norm_offset)

    def forward(
        self, x: torch.Tensor, rotary: Rotary, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        qk_end = self.q_size + self.kv_size
        v = qkv[:, qk_end:].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is None and self.k_norm is None:
            # q and k as one [T, H + KVH, D] tensor: half the ops of rotating each (the same numbers).
            qk = qkv[:, :qk_end].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
            if rotary is not None:
                qk = apply_rotary(qk, *rotary)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        else:
            assert self.q_norm is not None and self.k_norm is not None
            q = self.q_norm(qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size : qk_end].view(t, self.num_kv_heads, self.head_dim))
            if rotary is not None:
                q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        o = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.window, self.softcap)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    """down(act(gate) * up), gate and up as one matmul; or, not gated (GPT-2), down(act(up))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.act = activation(config.activation)
        self.is_gated = config.is_gated_mlp
        width = 2 * config.intermediate_size if self.is_gated else config.intermediate_size
        if self.is_gated:
            self.gate_up_proj = nn.Linear(config.hidden_size, width, bias=config.mlp_bias)
        else:
            self.up_proj = nn.Linear(config.hidden_size, width, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.is_gated:
            return self.down_proj(self.act(self.up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = make_norm(config, config.hidden_size)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = make_norm(config, config.hidden_size)
        self.mlp = MLP(config)
        self.is_sandwich = config.sandwich_norms
        if self.is_sandwich:  # Gemma: post_attention_layernorm normalises the attention output instead
            self.pre_feedforward_layernorm = make_norm(config, config.hidden_size)
            self.post_feedforward_layernorm = make_norm(config, config.hidden_size)
        is_sliding = bool(config.layer_types) and config.layer_types[layer] == "sliding_attention"
        self.is_local = is_sliding and config.rope_local_theta is not None

    def forward(
        self, x: torch.Tensor, rotary: Rotary, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), rotary, kv_cache, meta)
        if not self.is_sandwich:
            x = x + h
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


def _embedding(num: int, dim: int) -> nn.Embedding:
    """An embedding whose weight is allocated, not initialised: the loader fills it. (``nn.Embedding``'s own
    initialisation is a ``normal_``, which on the meta device the loader builds on imports torch's compiler stack,
    ~1.4 s of every engine start.)"""
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))


class CausalLM(nn.Module):
    """Token ids in, hidden states out; ``compute_logits`` projects the rows that need sampling."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = _embedding(config.vocab_size, config.hidden_size)
        self.embed_positions: nn.Embedding | None = None
        if config.position_embedding == "learned":
            self.embed_positions = _embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = make_norm(config, config.hidden_size)
        self.lm_head: nn.Module = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.max_positions = max_positions
        self.rotary: RotaryEmbedding | None = None
        self.rotary_local: RotaryEmbedding | None = None
        self.build_rotary()

    def build_rotary(self) -> None:
        """(Re)compute the RoPE tables (buffers computed, not loaded) on the embedding's device."""
        cfg, device = self.config, self.embed_tokens.weight.device
        if cfg.position_embedding != "rope":
            return
        if device.type == "meta":  # (built for real once the loader has materialised the model)
            return
        self.rotary = RotaryEmbedding(cfg, self.max_positions).to(device)
        if cfg.rope_local_theta is not None:
            self.rotary_local = RotaryEmbedding(cfg, self.max_positions, local=True).to(device)

    @property
    def needs_seq_lens(self) -> bool:
        """Whether ``forward`` needs each token's sequence length (RoPE that depends on it)."""
        return self.rotary is not None and self.rotary.needs_seq_lens

    @property
    def is_llama_layout(self) -> bool:
        """Exactly the Llama computation (what the fused C decode step does): none of the other families'
        options, and no sliding window that can matter within ``max_positions``."""
        cfg = self.config
        return (
            cfg.position_embedding == "rope"
            and cfg.norm == "rms"
            and not cfg.norm_offset
            and cfg.activation == "silu"
            and cfg.is_gated_mlp
            and not cfg.qk_norm
            and not cfg.sandwich_norms
            and cfg.embedding_scale is None
            and cfg.attention_scale is None
            and not cfg.scale_attn_by_inverse_layer_idx
            and cfg.attn_logit_softcap is None
            and cfg.final_logit_softcap is None
            and cfg.rope_type in ("default", "linear", "llama3", "yarn")  # (the same tables at every length)
            and cfg.rotary_dim == cfg.head_dim
            and cfg.rope_local_theta is None
            and not cfg.o_proj_bias
            and all(w == 0 or w >= self.max_positions for w in cfg.layer_windows)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        seq_lens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] → hidden states [T, hidden]."""
        rotary: Rotary = rotary_factors(*self.rotary(positions, seq_lens)) if self.rotary is not None else None
        local: Rotary = rotary_factors(*self.rotary_local(positions)) if self.rotary_local is not None else None
        x = self.embed_tokens(input_ids)
        if self.config.embedding_scale is not None:  # (rounded to the model dtype first, as transformers does)
            # (a 0-dim host tensor is a scalar to a device op: no copy to the device, which a CUDA graph's capture
            # refuses)
            x = x * torch.tensor(self.config.embedding_scale, dtype=x.dtype)
        if self.embed_positions is not None:
            x = x + self.embed_positions(positions)
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x = layer(x, local if layer.is_local else rotary, kv, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

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

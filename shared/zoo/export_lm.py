"""Export of a Hugging Face Llama checkpoint to edge formats with an explicit KV cache.

ONNX (one graph serves prefill and decode; the cache grows)::

    inputs   input_ids    int64   [B, T]
             past_keys    float32 [L, B, KVH, P, D]    (P = 0 on the first call)
             past_values  float32 [L, B, KVH, P, D]
    outputs  logits          float32 [B, T, V]
             present_keys    float32 [L, B, KVH, P + T, D]
             present_values  float32 [L, B, KVH, P + T, D]

TFLite needs static shapes, so its cache has a fixed length S and a position input; two signatures,
``prefill`` (T = PREFILL_CHUNK, right-padded) and ``decode`` (T = 1) (``static-kv-cache/v2``)::

    inputs   input_ids int32 [1, T], input_pos int32 [T] (consecutive), k_cache / v_cache float32 [L, 1, KVH, S, D]
    outputs  logits float32 [1, T, V], k_new / v_new float32 [L, 1, KVH, T, D] (the keys/values of the T tokens)

The cache is read only: slot j holds the token at position j and is seen only when j < input_pos[0], so the
graph never copies it (no scatter, no concatenation with it). The runtime keeps it in the interpreter's own
input buffers and writes each call's ``k_new``/``v_new`` into them at ``input_pos``: a token costs a few KB of
writes however long the context. Padding is safe: a query at position p sees the new keys at positions <= p
only, and the runtime writes only the real tokens' keys. (v1 took the cache in and returned the whole updated
cache, a scatter and two full copies in and out per token: 27x slower than ONNX Runtime.)
The Llama forward is written with plain tensor ops so exporters see a simple graph.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

INPUT_NAMES = ["input_ids", "past_keys", "past_values"]
OUTPUT_NAMES = ["logits", "present_keys", "present_values"]
PREFILL_CHUNK = 32
TFLITE_IO = "static-kv-cache/v2"
# Finite, so a fully masked row (a padded query) cannot produce NaN.
MASKED = -1e9

KVFn = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# (layer, queries [B, H, T, D], new keys and values [B, KVH, T, D]) -> attention output [B, H, T, D]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class ExportLlama(nn.Module):
    """Llama weights (fp32) and the forward pass, with the KV cache handled by a callback."""

    params: nn.ParameterDict
    inv_freq: torch.Tensor

    def __init__(self, config: dict[str, Any], state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.num_layers = int(config["num_hidden_layers"])
        self.num_heads = int(config["num_attention_heads"])
        self.num_kv_heads = int(config.get("num_key_value_heads") or self.num_heads)
        self.hidden_size = int(config["hidden_size"])
        self.head_dim = int(config.get("head_dim") or self.hidden_size // self.num_heads)
        self.max_position_embeddings = int(config.get("max_position_embeddings", 2048))
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        # transformers 5 writes rope_parameters; older checkpoints have a top-level rope_theta.
        theta = float(config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.params = nn.ParameterDict(
            {k.replace(".", "__"): nn.Parameter(v.float(), requires_grad=False) for k, v in state.items()}
        )
        if "lm_head.weight" not in state:
            self.params["lm_head__weight"] = self.params["model__embed_tokens__weight"]

    def _p(self, name: str) -> torch.Tensor:
        return self.params[name.replace(".", "__")]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        """Logits for ``input_ids`` at ``positions``; ``attend`` turns each layer's queries and the new tokens'
        keys/values into the attention output (and owns the cache)."""
        bsz, seq = input_ids.shape
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]  # [1, 1, T, D]
        hidden = nn.functional.embedding(input_ids.long(), self._p("model.embed_tokens.weight"))
        for i in range(self.num_layers):
            pre = f"model.layers.{i}."
            x = _rms_norm(hidden, self._p(pre + "input_layernorm.weight"), self.eps)
            q = (x @ self._p(pre + "self_attn.q_proj.weight").T).view(bsz, seq, self.num_heads, self.head_dim)
            k = (x @ self._p(pre + "self_attn.k_proj.weight").T).view(bsz, seq, self.num_kv_heads, self.head_dim)
            v = (x @ self._p(pre + "self_attn.v_proj.weight").T).view(bsz, seq, self.num_kv_heads, self.head_dim)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D]
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            attn = attend(i, q, k, v).transpose(1, 2).reshape(bsz, seq, -1)  # [B, H, T, D] -> [B, T, H * D]
            hidden = hidden + attn @ self._p(pre + "self_attn.o_proj.weight").T
            x = _rms_norm(hidden, self._p(pre + "post_attention_layernorm.weight"), self.eps)
            gate = x @ self._p(pre + "mlp.gate_proj.weight").T
            up = x @ self._p(pre + "mlp.up_proj.weight").T
            hidden = hidden + (nn.functional.silu(gate) * up) @ self._p(pre + "mlp.down_proj.weight").T
        hidden = _rms_norm(hidden, self._p("model.norm.weight"), self.eps)
        return hidden @ self._p("lm_head.weight").T

    def masked_attention(self, positions: torch.Tensor, key_positions: torch.Tensor, kv: KVFn) -> AttendFn:
        """Attention over the keys ``kv`` returns (at ``key_positions``), causal by position."""
        mask = torch.where(key_positions.float()[None, :] <= positions.float()[:, None], 0.0, MASKED)  # [T, K]
        groups = self.num_heads // self.num_kv_heads

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k, v = kv(i, k, v)  # [B, KVH, K, D]
            if groups > 1:
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            scores = (q @ k.transpose(-1, -2)) / (self.head_dim**0.5) + mask  # [B, H, T, K]
            return torch.softmax(scores, dim=-1) @ v

        return attend


class GrowingCacheLM(nn.Module):
    """The ONNX interface: past keys/values in, presents (past + new) out."""

    def __init__(self, llama: ExportLlama) -> None:
        super().__init__()
        self.llama = llama

    def forward(
        self, input_ids: torch.Tensor, past_keys: torch.Tensor, past_values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        past, seq = past_keys.shape[3], input_ids.shape[1]
        positions = torch.arange(seq) + past
        new_k: list[torch.Tensor] = []
        new_v: list[torch.Tensor] = []

        def kv(i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            new_k.append(torch.cat((past_keys[i], k), dim=2))
            new_v.append(torch.cat((past_values[i], v), dim=2))
            return new_k[-1], new_v[-1]

        attend = self.llama.masked_attention(positions, torch.arange(past + seq), kv)
        logits = self.llama.run(input_ids, positions, attend)
        return logits, torch.stack(new_k), torch.stack(new_v)


class StaticCacheLM(nn.Module):
    """The TFLite interface: a fixed-length cache the graph only reads; the new tokens' keys/values out."""

    def __init__(self, llama: ExportLlama, cache_len: int) -> None:
        super().__init__()
        self.llama = llama
        self.cache_len = cache_len

    def forward(
        self, input_ids: torch.Tensor, input_pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        llama = self.llama
        kvh, groups, dim = llama.num_kv_heads, llama.num_heads // llama.num_kv_heads, llama.head_dim
        seq = input_ids.shape[1]
        # Cache slot j is visible iff it was written before this call (j < input_pos[0]); the new tokens see each
        # other causally. Both masks are [T, .] rows, repeated per query group below.
        cached = torch.where(
            torch.arange(self.cache_len, dtype=input_pos.dtype)[None, :] < input_pos[:1, None], 0.0, MASKED
        ).expand(seq, self.cache_len)
        causal = torch.where(input_pos[None, :] <= input_pos[:, None], 0.0, MASKED)
        mask = torch.cat((cached, causal), dim=-1).repeat(groups, 1)  # [G * T, S + T]
        scale = 1.0 / dim**0.5
        new_k: list[torch.Tensor] = []
        new_v: list[torch.Tensor] = []

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            new_k.append(k)
            new_v.append(v)
            bsz = q.shape[0]
            # Query heads h = kv * G + g share KV head kv: fold the group into the rows instead of repeating the
            # cache (no copy of it), then attend to the cache and to the new tokens separately.
            qg = q.reshape(bsz, kvh, groups * seq, dim) * scale
            scores = torch.cat((qg @ k_cache[i].transpose(-1, -2), qg @ k.transpose(-1, -2)), dim=-1) + mask
            weights = torch.softmax(scores, dim=-1)  # [B, KVH, G * T, S + T]
            out = weights[..., : self.cache_len] @ v_cache[i] + weights[..., self.cache_len :] @ v
            return out.reshape(bsz, kvh * groups, seq, dim)

        logits = llama.run(input_ids, input_pos, attend)
        return {"logits": logits, "k_new": torch.stack(new_k), "v_new": torch.stack(new_v)}


def load_export_llama(model_dir: Path) -> ExportLlama:
    config = json.loads((model_dir / "config.json").read_text())
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(shard)))
    return ExportLlama(config, state).eval()


def cache_shape(llama: ExportLlama, length: int, batch: int = 1) -> tuple[int, int, int, int, int]:
    return (llama.num_layers, batch, llama.num_kv_heads, length, llama.head_dim)


def export_onnx(model_dir: Path, out_path: Path) -> None:
    """Export ``model_dir`` (HF Llama layout) to one ONNX file at ``out_path``."""
    module = GrowingCacheLM(load_export_llama(model_dir)).eval()
    shape = cache_shape(module.llama, 3)
    example = (torch.tensor([[1, 2]], dtype=torch.int64), torch.zeros(shape), torch.zeros(shape))
    dynamic_axes = {
        "input_ids": {0: "batch", 1: "seq"},
        "past_keys": {1: "batch", 3: "past"},
        "past_values": {1: "batch", 3: "past"},
        "logits": {0: "batch", 1: "seq"},
        "present_keys": {1: "batch", 3: "total"},
        "present_values": {1: "batch", 3: "total"},
    }
    legacy_onnx_export(module, example, out_path, INPUT_NAMES, OUTPUT_NAMES, dynamic_axes)


def legacy_onnx_export(
    module: nn.Module,
    example: tuple[torch.Tensor, ...],
    out_path: Path,
    input_names: list[str],
    output_names: list[str],
    dynamic_axes: dict[str, dict[int, str]],
) -> None:
    """torch.onnx's TorchScript exporter: it handles these plain graphs with dynamic axes in a second and
    needs no onnxscript. torch deprecates it in favour of the dynamo exporter; the warning is silenced here
    only, and the tests compare every export against transformers so a behaviour change cannot pass."""
    import warnings

    out_path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad(), warnings.catch_warnings():
        # The exporter's own deprecation notices (it warns about itself at several places) and tracer notes.
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        torch.onnx.export(
            module,
            example,
            str(out_path),
            input_names=input_names,
            output_names=output_names,
            dynamic_axes=dynamic_axes,
            opset_version=17,
            dynamo=False,
        )


def export_tflite(model_dir: Path, out_path: Path, cache_len: int | None = None) -> dict[str, Any]:
    """Export ``prefill`` and ``decode`` signatures to ``out_path`` with litert-torch; return the I/O facts."""
    import os
    import warnings

    os.environ.setdefault("LITERT_TORCH_SHOW_PROGRESS", "0")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    with warnings.catch_warnings(), quiet_root_logger():
        warnings.simplefilter("ignore")
        return _convert_tflite(model_dir, out_path, cache_len)


@contextmanager
def quiet_root_logger() -> Iterator[None]:
    """litert-torch and ONNX Runtime's quantizer log every step at INFO on the root logger."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        root.setLevel(level)


def _convert_tflite(model_dir: Path, out_path: Path, cache_len: int | None) -> dict[str, Any]:
    import litert_torch

    llama = load_export_llama(model_dir)
    length = cache_len or llama.max_position_embeddings
    module = StaticCacheLM(llama, length).eval()
    cache = torch.zeros(cache_shape(llama, length))
    prefill = {
        "input_ids": torch.zeros(1, PREFILL_CHUNK, dtype=torch.int32),
        "input_pos": torch.arange(PREFILL_CHUNK, dtype=torch.int32),
        "k_cache": cache,
        "v_cache": cache.clone(),
    }
    decode = {
        "input_ids": torch.zeros(1, 1, dtype=torch.int32),
        "input_pos": torch.tensor([0], dtype=torch.int32),
        "k_cache": cache,
        "v_cache": cache.clone(),
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    (
        litert_torch.signature("prefill", module, sample_kwargs=prefill)
        .signature("decode", module, sample_kwargs=decode)
        .convert()
        .export(str(out_path))
    )
    return {"cache_len": length, "prefill_chunk": PREFILL_CHUNK, "signatures": ["prefill", "decode"], "io": TFLITE_IO}

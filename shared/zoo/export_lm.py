"""Export of a Hugging Face decoder checkpoint to edge formats with an explicit KV cache.

Families: llama, mistral, qwen2, qwen3, gemma2, gemma3_text, phi3, and gpt2 for ONNX only
(:mod:`shared.zoo.export_families` reads their configs and refuses anything else with a ``ValueError`` before any
work). Sliding-window layers attend to
the last ``sliding_window`` positions through the mask; the cache keeps every token, so the I/O is the same for
every family.

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
The forward is written with plain tensor ops so exporters see a simple graph.

Phi-3's LongRoPE picks its factor set per forward by the total length (cache included), as transformers does:
the ONNX graph switches to the long factors once a call's last position passes ``original_max_position_embeddings``
(the keys already cached keep the rotation they got, as in transformers' cache). transformers' ``generate`` goes
further: when the sequence first passes that length it drops its cache and recomputes the whole sequence with the
long factors; a runtime matches it by re-prefilling the whole sequence at that step (with an empty past the graph
uses the long factors for every position). The LiteRT graph cannot see the real length of a padded prefill, so it
serves such models with a cache no longer than that length (the default), where the short factors are exact; a
longer ``cache_len`` is refused.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from shared.zoo.export_families import DecoderSpec, decoder_spec

INPUT_NAMES = ["input_ids", "past_keys", "past_values"]
OUTPUT_NAMES = ["logits", "present_keys", "present_values"]
PREFILL_CHUNK = 32
TFLITE_IO = "static-kv-cache/v2"
# Finite, so a fully masked row (a padded query) cannot produce NaN.
MASKED = -1e9

KVFn = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# (layer, queries [B, H, T, D], new keys and values [B, KVH, T, D]) -> attention output [B, H, T, D]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class ExportDecoder(nn.Module):
    """A decoder checkpoint's weights (fp32) and forward pass, with the KV cache handled by a callback.

    One forward for every family :func:`decoder_spec` accepts; ``spec`` says where they differ. Fused tensors
    (Phi-3's ``qkv_proj`` and ``gate_up_proj``) are split at load so every family has the same graph shape.
    ``max_total`` bounds the sequence length the export will see: a LongRoPE model whose bound stays within its
    pretraining length never needs the long factors, and its graph has no switch.
    """

    params: nn.ParameterDict
    embed_scale: torch.Tensor

    def __init__(self, spec: DecoderSpec, state: dict[str, torch.Tensor], max_total: int | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.num_layers = spec.num_layers
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.max_position_embeddings = spec.max_position_embeddings
        self.params = nn.ParameterDict(
            {
                k.replace(".", "__"): nn.Parameter(v.float(), requires_grad=False)
                for k, v in _canonical(spec, state).items()
            }
        )
        if "lm_head__weight" not in self.params:
            self.params["lm_head__weight"] = self.params["model__embed_tokens__weight"]
        self._ropes = list(dict.fromkeys(spec.ropes))  # the distinct rotary embeddings, in layer order
        for n, rope in enumerate(self._ropes):
            self.register_buffer(f"inv_freq_{n}", torch.tensor(rope.inv_freq, dtype=torch.float32), persistent=False)
            if rope.long_inv_freq is not None and (
                max_total is None or max_total > rope.original_max_position_embeddings
            ):
                self.register_buffer(f"long_inv_freq_{n}", torch.tensor(rope.long_inv_freq), persistent=False)
        if spec.embed_scale is not None:
            # transformers keeps the scale as an fp32 tensor; a Python float would multiply in double.
            self.register_buffer("embed_scale", torch.tensor(spec.embed_scale, dtype=torch.float32), persistent=False)

    def _p(self, name: str) -> torch.Tensor:
        return self.params[name.replace(".", "__")]

    def _has(self, name: str) -> bool:
        return name.replace(".", "__") in self.params

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        out = x @ self._p(name + ".weight").T
        return out + self._p(name + ".bias") if self._has(name + ".bias") else out

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        weight = self._p(name)
        if self.spec.layer_norm:
            bias = self._p(name[: -len("weight")] + "bias")
            x = x - x.mean(-1, keepdim=True)
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.spec.norm_eps) * weight + bias
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.spec.norm_eps)
        return x * (1.0 + weight) if self.spec.norm_offset else weight * x

    def _rotary(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """cos, sin [1, 1, T, R] of each distinct rotary embedding."""
        out = []
        for n, rope in enumerate(self._ropes):
            inv_freq: torch.Tensor = getattr(self, f"inv_freq_{n}")
            if hasattr(self, f"long_inv_freq_{n}"):
                # transformers picks the factor set per forward by its total length (the last position + 1).
                is_long = positions.max() + 1 > rope.original_max_position_embeddings
                inv_freq = torch.where(is_long, getattr(self, f"long_inv_freq_{n}"), inv_freq)
            freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, R/2]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
            if rope.attention_scaling != 1.0:
                cos, sin = cos * rope.attention_scaling, sin * rope.attention_scaling
            out.append((cos[None, None], sin[None, None]))
        return out

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        dim = cos.shape[-1]
        if dim == self.head_dim:
            return x * cos + _rotate_half(x) * sin
        rot, rest = x[..., :dim], x[..., dim:]  # partial rotary: the tail channels pass through
        return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)

    def _act(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.activation == "silu":
            return nn.functional.silu(x)
        if self.spec.activation == "gelu_new":  # transformers' NewGELUActivation, term by term
            return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
        return nn.functional.gelu(x, approximate="tanh")

    def _mlp(self, x: torch.Tensor, pre: str) -> torch.Tensor:
        up = self._linear(x, pre + "mlp.up_proj")
        if not self.spec.gated_mlp:
            return self._linear(self._act(up), pre + "mlp.down_proj")
        return self._linear(self._act(self._linear(x, pre + "mlp.gate_proj")) * up, pre + "mlp.down_proj")

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        """Logits for ``input_ids`` at ``positions``; ``attend`` turns each layer's queries and the new tokens'
        keys/values into the attention output (and owns the cache)."""
        spec = self.spec
        bsz, seq = input_ids.shape
        rotary = self._rotary(positions)
        hidden = nn.functional.embedding(input_ids.long(), self._p("model.embed_tokens.weight"))
        if spec.embed_scale is not None:
            hidden = hidden * self.embed_scale
        if spec.learned_positions:
            hidden = hidden + nn.functional.embedding(positions.long(), self._p("model.embed_positions.weight"))
        for i in range(self.num_layers):
            pre = f"model.layers.{i}."
            x = self._norm(hidden, pre + "input_layernorm.weight")
            q = self._linear(x, pre + "self_attn.q_proj").view(bsz, seq, self.num_heads, self.head_dim)
            k = self._linear(x, pre + "self_attn.k_proj").view(bsz, seq, self.num_kv_heads, self.head_dim)
            v = self._linear(x, pre + "self_attn.v_proj").view(bsz, seq, self.num_kv_heads, self.head_dim)
            if spec.qk_norm:
                q = self._norm(q, pre + "self_attn.q_norm.weight")
                k = self._norm(k, pre + "self_attn.k_norm.weight")
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D]
            if rotary:
                cos, sin = rotary[self._ropes.index(spec.ropes[i])]
                q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            attn = attend(i, q, k, v).transpose(1, 2).reshape(bsz, seq, -1)  # [B, H, T, D] -> [B, T, H * D]
            attn = self._linear(attn, pre + "self_attn.o_proj")
            if spec.sandwich_norms:
                hidden = hidden + self._norm(attn, pre + "post_attention_layernorm.weight")
                x = self._norm(hidden, pre + "pre_feedforward_layernorm.weight")
                hidden = hidden + self._norm(self._mlp(x, pre), pre + "post_feedforward_layernorm.weight")
            else:
                hidden = hidden + attn
                hidden = hidden + self._mlp(self._norm(hidden, pre + "post_attention_layernorm.weight"), pre)
        hidden = self._norm(hidden, "model.norm.weight")
        logits = self._linear(hidden, "lm_head")
        if spec.final_softcap is not None:
            logits = torch.tanh(logits / spec.final_softcap) * spec.final_softcap
        return logits

    def scores(self, i: int, scores: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s attention scores (already scaled) after the family's soft-cap, before the mask."""
        cap = self.spec.attn_softcap
        return torch.tanh(scores / cap) * cap if cap is not None else scores

    def windows(self) -> list[int | None]:
        """The distinct sliding windows of the layers (None: full causal attention)."""
        return list(dict.fromkeys(self.spec.windows))

    def masked_attention(self, positions: torch.Tensor, key_positions: torch.Tensor, kv: KVFn) -> AttendFn:
        """Attention over the keys ``kv`` returns (at ``key_positions``), causal by position, within each
        layer's sliding window (a key is seen by a query fewer than ``window`` positions after it)."""
        qpos, kpos = positions.float()[:, None], key_positions.float()[None, :]
        masks = {}
        for window in self.windows():
            visible = kpos <= qpos
            if window is not None:
                visible = visible & (kpos > qpos - window)
            masks[window] = torch.where(visible, 0.0, MASKED)  # [T, K]
        groups = self.num_heads // self.num_kv_heads

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k, v = kv(i, k, v)  # [B, KVH, K, D]
            if groups > 1:
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            scores = self.scores(i, (q @ k.transpose(-1, -2)) * self.spec.attn_scale) + masks[self.spec.windows[i]]
            return torch.softmax(scores, dim=-1) @ v  # [B, H, T, D]

        return attend


ExportLlama = ExportDecoder  # the name before the other families


def _canonical(spec: DecoderSpec, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` under the Llama names: Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` split, GPT-2's Conv1D
    weights (stored [in, out]) transposed and renamed."""
    if spec.model_type == "gpt2":
        return _gpt2_state(spec, state)
    out = dict(state)
    q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    for name in list(state):
        if name.endswith("self_attn.qkv_proj.weight"):
            pre = name[: -len("qkv_proj.weight")]
            q, k, v = out.pop(name).split([q_size, kv_size, kv_size], dim=0)
            out[pre + "q_proj.weight"], out[pre + "k_proj.weight"], out[pre + "v_proj.weight"] = q, k, v
        elif name.endswith("mlp.gate_up_proj.weight"):
            pre = name[: -len("gate_up_proj.weight")]
            out[pre + "gate_proj.weight"], out[pre + "up_proj.weight"] = out.pop(name).chunk(2, dim=0)
    return out


_GPT2_NAMES = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm"}
_GPT2_CONV1D = {"attn.c_proj": "self_attn.o_proj", "mlp.c_fc": "mlp.up_proj", "mlp.c_proj": "mlp.down_proj"}


def _gpt2_state(spec: DecoderSpec, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # Hub GPT-2 checkpoints name the weights with or without the "transformer." prefix.
    src = {k.removeprefix("transformer."): v for k, v in state.items()}
    out = {"model.embed_tokens.weight": src["wte.weight"], "model.embed_positions.weight": src["wpe.weight"]}
    for kind in ("weight", "bias"):
        out[f"model.norm.{kind}"] = src[f"ln_f.{kind}"]
    if "lm_head.weight" in src:
        out["lm_head.weight"] = src["lm_head.weight"]
    for i in range(spec.num_layers):
        old, new = f"h.{i}.", f"model.layers.{i}."
        for a, b in _GPT2_NAMES.items():
            out[f"{new}{b}.weight"], out[f"{new}{b}.bias"] = src[f"{old}{a}.weight"], src[f"{old}{a}.bias"]
        for a, b in _GPT2_CONV1D.items():
            out[f"{new}{b}.weight"], out[f"{new}{b}.bias"] = src[f"{old}{a}.weight"].T, src[f"{old}{a}.bias"]
        weights = src[f"{old}attn.c_attn.weight"].T.chunk(3, dim=0)
        biases = src[f"{old}attn.c_attn.bias"].chunk(3, dim=0)
        for proj, weight, bias in zip(("q_proj", "k_proj", "v_proj"), weights, biases, strict=True):
            out[f"{new}self_attn.{proj}.weight"], out[f"{new}self_attn.{proj}.bias"] = weight, bias
    return out


class GrowingCacheLM(nn.Module):
    """The ONNX interface: past keys/values in, presents (past + new) out."""

    def __init__(self, llama: ExportDecoder) -> None:
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

    def __init__(self, llama: ExportDecoder, cache_len: int) -> None:
        super().__init__()
        self.llama = llama
        self.cache_len = cache_len

    def forward(
        self, input_ids: torch.Tensor, input_pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        llama = self.llama
        kvh, groups, dim = llama.num_kv_heads, llama.num_heads // llama.num_kv_heads, llama.head_dim
        seq = input_ids.shape[1]
        # Cache slot j is visible iff it was written before this call (j < input_pos[0]) and lies within the
        # layer's window; the new tokens see each other causally. The masks are [T, .] rows, repeated per query
        # group below.
        slots = torch.arange(self.cache_len, dtype=input_pos.dtype)[None, :]
        qpos = input_pos[:, None]
        masks = {}
        for window in llama.windows():
            cached = (slots < input_pos[:1, None]).expand(seq, self.cache_len)
            causal = input_pos[None, :] <= qpos
            if window is not None:
                cached = cached & (slots > qpos - window)
                causal = causal & (input_pos[None, :] > qpos - window)
            mask = torch.cat((torch.where(cached, 0.0, MASKED), torch.where(causal, 0.0, MASKED)), dim=-1)
            masks[window] = mask.repeat(groups, 1)  # [G * T, S + T]
        scale = llama.spec.attn_scale
        new_k: list[torch.Tensor] = []
        new_v: list[torch.Tensor] = []

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            new_k.append(k)
            new_v.append(v)
            bsz = q.shape[0]
            # Query heads h = kv * G + g share KV head kv: fold the group into the rows instead of repeating the
            # cache (no copy of it), then attend to the cache and to the new tokens separately.
            qg = q.reshape(bsz, kvh, groups * seq, dim) * scale
            scores = torch.cat((qg @ k_cache[i].transpose(-1, -2), qg @ k.transpose(-1, -2)), dim=-1)
            weights = torch.softmax(
                llama.scores(i, scores) + masks[llama.spec.windows[i]], dim=-1
            )  # [B, KVH, G*T, S+T]
            out = weights[..., : self.cache_len] @ v_cache[i] + weights[..., self.cache_len :] @ v
            return out.reshape(bsz, kvh * groups, seq, dim)

        logits = llama.run(input_ids, input_pos, attend)
        return {"logits": logits, "k_new": torch.stack(new_k), "v_new": torch.stack(new_v)}


def read_config(model_dir: Path) -> dict[str, Any]:
    """``model_dir``'s parsed ``config.json``."""
    config: dict[str, Any] = json.loads((model_dir / "config.json").read_text())
    return config


def load_export_decoder(
    model_dir: Path, spec: DecoderSpec | None = None, max_total: int | None = None
) -> ExportDecoder:
    """The checkpoint in ``model_dir`` as an :class:`ExportDecoder` (``ValueError`` for one it cannot export)."""
    spec = spec or decoder_spec(read_config(model_dir))
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(shard)))
    return ExportDecoder(spec, state, max_total).eval()


load_export_llama = load_export_decoder  # the name before the other families


def edge_model_meta(config: dict[str, Any]) -> dict[str, Any]:
    """The cache facts an ``edge_model.json`` gives the device runtimes, for the checkpoint whose ``config.json``
    is ``config`` (GPT-2 names them differently; Gemma and Qwen3 have their own head_dim defaults)."""
    spec = decoder_spec(config)
    return {
        "num_layers": spec.num_layers,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "max_context": spec.max_position_embeddings,
    }


def cache_shape(llama: ExportDecoder, length: int, batch: int = 1) -> tuple[int, int, int, int, int]:
    return (llama.num_layers, batch, llama.num_kv_heads, length, llama.head_dim)


def export_onnx(model_dir: Path, out_path: Path) -> None:
    """Export ``model_dir`` (a Hugging Face checkpoint of a family :func:`decoder_spec` accepts) to one ONNX file
    at ``out_path``; ``ValueError`` naming what is not supported, before any weight loads."""
    spec = decoder_spec(read_config(model_dir), "onnx")
    module = GrowingCacheLM(load_export_decoder(model_dir, spec)).eval()
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
    """Export ``prefill`` and ``decode`` signatures to ``out_path`` with litert-torch; return the I/O facts.

    ``ValueError`` (before any work) for a checkpoint or ``cache_len`` the static export cannot serve exactly."""
    tflite_spec(read_config(model_dir), cache_len)
    import os
    import warnings

    os.environ.setdefault("LITERT_TORCH_SHOW_PROGRESS", "0")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    with warnings.catch_warnings(), quiet_root_logger():
        warnings.simplefilter("ignore")
        return _convert_tflite(model_dir, out_path, cache_len)


def default_cache_len(spec: DecoderSpec) -> int:
    """The LiteRT cache length when none is asked for: the context, or a LongRoPE model's pretraining length."""
    originals = [r.original_max_position_embeddings for r in spec.ropes if r.long_inv_freq is not None]
    return min([spec.max_position_embeddings, *originals])


def tflite_spec(config: dict[str, Any], cache_len: int | None) -> DecoderSpec:
    """The spec of a checkpoint the LiteRT export can serve with a cache of ``cache_len``, else ``ValueError``.

    LongRoPE switches factor sets when the total length passes ``original_max_position_embeddings``. The static
    graph's prefill positions include right padding, so it cannot tell the real length of a call near the switch:
    the export therefore serves LongRoPE models only within the short-factor regime (``cache_len`` at most that
    length, which is also the default), where it is exact."""
    spec = decoder_spec(config, "tflite")
    limit = default_cache_len(spec)
    has_switch = any(r.long_inv_freq is not None for r in spec.ropes)
    if has_switch and cache_len is not None and cache_len > limit:
        raise ValueError(
            f"{spec.model_type}: cache_len {cache_len} is past the LongRoPE switch at {limit} tokens, which the "
            f"LiteRT export does not support; use cache_len <= {limit}"
        )
    return spec


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

    spec = tflite_spec(read_config(model_dir), cache_len)
    length = cache_len or default_cache_len(spec)
    llama = load_export_decoder(model_dir, spec, max_total=length)
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

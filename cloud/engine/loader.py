"""Load a Hugging Face checkpoint directory (safetensors, sharded or not) into ``CausalLM``.

Tensor names are mapped family by family: the Llama layout (``model.layers.N.self_attn.q_proj`` ...) with q/k/v
and gate/up fused into one parameter each as they load; Phi-3's already fused ``qkv_proj`` / ``gate_up_proj``;
GPT-2's ``transformer.h.N`` (or ``h.N``) with its Conv1D weights stored [in, out], transposed here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import cast

import torch
from safetensors import safe_open
from torch import nn

from cloud.engine.model import CausalLM
from cloud.engine.model_config import ModelConfig
from shared.errors import ConfigurationError

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_GPT2_LAYER = re.compile(r"^(?:transformer\.)?h\.(\d+)\.(.+)$")
_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
_GATE_UP = {"gate_proj": 0, "up_proj": 1}
_GPT2_NAMES = {
    "ln_1": "input_layernorm",
    "ln_2": "post_attention_layernorm",
    "attn.c_attn": "self_attn.qkv_proj",
    "attn.c_proj": "self_attn.o_proj",
    "mlp.c_fc": "mlp.up_proj",
    "mlp.c_proj": "mlp.down_proj",
}
_GPT2_TOP = {"wte.weight": "embed_tokens.weight", "wpe.weight": "embed_positions.weight"}
_GPT2_TOP.update({"ln_f.weight": "norm.weight", "ln_f.bias": "norm.bias"})


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigurationError(f"{model_dir}: no *.safetensors weights (PyTorch .bin checkpoints are not loaded)")
    return files


def resolve_dtype(config: ModelConfig, device: torch.device, dtype: str) -> torch.dtype:
    """``auto``: fp32 on CPU; the checkpoint's half type on CUDA (bf16 unless it was saved in fp16)."""
    if dtype != "auto":
        try:
            return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
        except KeyError:
            raise ConfigurationError(f"dtype must be auto, float32, float16 or bfloat16, got {dtype!r}") from None
    if device.type == "cpu":
        return torch.float32
    return torch.float16 if config.torch_dtype == "float16" else torch.bfloat16


def _materialise(model: nn.Module, device: torch.device) -> None:
    """Every parameter and buffer of a model built on the meta device allocated (uninitialised) on ``device``, tied
    ones once. (``Module.to_empty`` does the same through ``empty_like``, whose meta path imports torch's symbolic
    shapes and sympy: ~0.4 s of every engine start.)"""
    made: dict[int, torch.Tensor] = {}

    def allocated(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            new = torch.empty(t.shape, dtype=t.dtype, device=device)
            made[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
        return made[id(t)]

    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                module._parameters[name] = cast(nn.Parameter, allocated(param))
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = allocated(buffer)


def load_model(model_dir: Path, device: torch.device, dtype: torch.dtype, max_positions: int) -> CausalLM:
    config = ModelConfig.from_dir(model_dir)
    if config.position_embedding == "learned" and max_positions > config.max_position_embeddings:
        raise ConfigurationError(
            f"{model_dir}: max_model_len {max_positions} is longer than the {config.max_position_embeddings} "
            f"positions {config.model_type} learned (n_positions)"
        )
    with torch.device("meta"):
        model = CausalLM(config, max_positions)
    _materialise(model, device)
    model.build_rotary()
    params = dict(model.named_parameters())
    parts = _parts(model, config)
    loaded: set[str] = set()
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                target, offset, size, transpose = _map_name(config, name, parts)
                if target is None:
                    continue
                if target not in params:
                    raise ConfigurationError(f"{path.name}: unexpected tensor {name}")
                tensor = f.get_tensor(name)
                if transpose:
                    tensor = tensor.t()
                param = params[target]
                with torch.no_grad():
                    if size is None:
                        if param.shape != tensor.shape:
                            raise ConfigurationError(
                                f"{path.name}: {name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                            )
                        param.copy_(tensor.to(param.dtype))
                        loaded.update(f"{target}@{o}" for o in parts.get(target.rpartition(".")[0], [0]))
                    else:
                        if tensor.shape[0] != size or param.shape[1:] != tensor.shape[1:]:
                            raise ConfigurationError(f"{path.name}: {name} has shape {tuple(tensor.shape)}")
                        param[offset : offset + size].copy_(tensor.to(param.dtype))
                        loaded.add(f"{target}@{offset}")
    if config.tie_word_embeddings:
        loaded.add("lm_head.weight@0")
    expected = _expected_keys(model, parts)
    missing = sorted(expected - loaded)
    if missing:
        raise ConfigurationError(f"{model_dir}: checkpoint lacks {len(missing)} tensors, e.g. {missing[0]}")
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model = model.to(dtype).eval()  # (RoPE tables too: transformers rounds cos/sin to the model's dtype)
    if device.type == "cpu":
        model.transpose_linear_weights()
    return model


def _parts(model: CausalLM, config: ModelConfig) -> dict[str, list[int]]:
    """Fused module name → the row offsets of the checkpoint tensors it is loaded from, one at a time."""
    hd, nh, nkv, inter = config.head_dim, config.num_heads, config.num_kv_heads, config.intermediate_size
    parts: dict[str, list[int]] = {}
    for name, _ in model.named_modules():
        if name.endswith(".qkv_proj"):
            parts[name] = [0, nh * hd, (nh + nkv) * hd]
        elif name.endswith(".gate_up_proj"):
            parts[name] = [0, inter]
    return parts


def _map_name(config: ModelConfig, name: str, parts: dict[str, list[int]]) -> tuple[str | None, int, int | None, bool]:
    """HF tensor name → (our parameter, row offset, rows, transpose): rows is None for a whole-tensor copy."""
    if name.endswith(("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")):
        return None, 0, None, False  # (buffers some checkpoints carry: computed here)
    if config.model_type == "gpt2":
        return _map_gpt2(name)
    if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        return name.removeprefix("model."), 0, None, False
    m = _LAYER.match(name)
    if not m:
        return name, 0, None, False
    prefix, rest = f"layers.{m.group(1)}.", m.group(2)
    module, _, kind = rest.rpartition(".")
    leaf = module.rpartition(".")[2]
    if leaf in _QKV:
        fused = f"{prefix}self_attn.qkv_proj"
        offsets = parts[fused] + [parts[fused][-1] + config.num_kv_heads * config.head_dim]
        i = _QKV[leaf]
        return f"{fused}.{kind}", offsets[i], offsets[i + 1] - offsets[i], False
    if leaf in _GATE_UP:
        i = _GATE_UP[leaf]
        size = config.intermediate_size
        return f"{prefix}mlp.gate_up_proj.{kind}", i * size, size, False
    return prefix + rest, 0, None, False


def _map_gpt2(name: str) -> tuple[str | None, int, int | None, bool]:
    top = name.removeprefix("transformer.")
    if top in _GPT2_TOP:
        return _GPT2_TOP[top], 0, None, False
    if name == "lm_head.weight":
        return name, 0, None, False
    m = _GPT2_LAYER.match(name)
    if not m:
        return name, 0, None, False
    module, _, kind = m.group(2).rpartition(".")
    ours = _GPT2_NAMES.get(module, module)
    is_conv1d = module.startswith(("attn.", "mlp.")) and kind == "weight"
    return f"layers.{m.group(1)}.{ours}.{kind}", 0, None, is_conv1d


def _expected_keys(model: CausalLM, parts: dict[str, list[int]]) -> set[str]:
    keys: set[str] = set()
    for name, _ in model.named_parameters(remove_duplicate=False):
        keys.update(f"{name}@{o}" for o in parts.get(name.rpartition(".")[0], [0]))
    return keys

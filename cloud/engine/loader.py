"""Load a Hugging Face Llama-family checkpoint directory (safetensors, sharded or not) into ``CausalLM``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from cloud.engine.model import CausalLM, RotaryEmbedding
from cloud.engine.model_config import ModelConfig
from shared.errors import ConfigurationError

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
_GATE_UP = {"gate_proj": 0, "up_proj": 1}


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


def load_model(model_dir: Path, device: torch.device, dtype: torch.dtype, max_positions: int) -> CausalLM:
    config = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = CausalLM(config, max_positions)
    model = model.to_empty(device=device)
    model.rotary = RotaryEmbedding(config, max_positions).to(device)  # buffers are computed, not loaded
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    hd, nh, nkv = config.head_dim, config.num_heads, config.num_kv_heads
    qkv_sizes = [nh * hd, nkv * hd, nkv * hd]
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensor = f.get_tensor(name)
                target, offset, size = _map_name(name, qkv_sizes, config.intermediate_size)
                if target is None:
                    continue
                if target not in params:
                    raise ConfigurationError(f"{path.name}: unexpected tensor {name}")
                param = params[target]
                with torch.no_grad():
                    if size is None:
                        if param.shape != tensor.shape:
                            raise ConfigurationError(
                                f"{path.name}: {name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                            )
                        param.copy_(tensor.to(param.dtype))
                    else:
                        param[offset : offset + size].copy_(tensor.to(param.dtype))
                loaded.add(f"{target}@{offset}")
    if config.tie_word_embeddings:
        loaded.add("lm_head.weight@0")
    expected = _expected_keys(model, qkv_sizes, config.intermediate_size)
    missing = sorted(expected - loaded)
    if missing:
        raise ConfigurationError(f"{model_dir}: checkpoint lacks {len(missing)} tensors, e.g. {missing[0]}")
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model = model.to(dtype).eval()
    if device.type == "cpu":
        model.transpose_linear_weights()
    return model


def _map_name(name: str, qkv_sizes: list[int], intermediate: int) -> tuple[str | None, int, int | None]:
    """HF tensor name → (our parameter, row offset, rows) — rows is None for a whole-tensor copy."""
    if name.endswith("rotary_emb.inv_freq"):
        return None, 0, None
    if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        return name.removeprefix("model."), 0, None
    m = _LAYER.match(name)
    if not m:
        return name, 0, None
    prefix, rest = f"layers.{m.group(1)}.", m.group(2)
    module, _, kind = rest.rpartition(".")
    leaf = module.rpartition(".")[2]
    if leaf in _QKV:
        i = _QKV[leaf]
        return f"{prefix}self_attn.qkv_proj.{kind}", sum(qkv_sizes[:i]), qkv_sizes[i]
    if leaf in _GATE_UP:
        return f"{prefix}mlp.gate_up_proj.{kind}", _GATE_UP[leaf] * intermediate, intermediate
    return prefix + rest, 0, None


def _expected_keys(model: CausalLM, qkv_sizes: list[int], intermediate: int) -> set[str]:
    keys: set[str] = set()
    for name, _ in model.named_parameters(remove_duplicate=False):
        if ".qkv_proj." in name:
            keys.update(f"{name}@{sum(qkv_sizes[:i])}" for i in range(3))
        elif ".gate_up_proj." in name:
            keys.update(f"{name}@{i * intermediate}" for i in range(2))
        else:
            keys.add(f"{name}@0")
    return keys

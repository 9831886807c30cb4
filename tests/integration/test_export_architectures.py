"""The edge exports against transformers, family by family: a small random checkpoint of each architecture the
exports claim (``shared.architectures``), exported to ONNX and run by the device's own runtime through its KV
cache, answers with transformers' logits and greedy tokens; LiteRT too for a family with biases (qwen2) and one
with q/k norms (qwen3). Anything the exports do not implement is refused before any work."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from edge_agent.runtime.lm import OnnxCausalLM, TfliteCausalLM
from shared.architectures import ONNX_ARCHITECTURES, TFLITE_ARCHITECTURES
from shared.zoo.export_lm import (
    PREFILL_CHUNK,
    TFLITE_IO,
    StaticCacheLM,
    cache_shape,
    default_cache_len,
    edge_model_meta,
    export_onnx,
    export_tflite,
    load_export_decoder,
    tflite_spec,
)

pytestmark = pytest.mark.integration

VOCAB = 256
NEW_TOKENS = 16
WINDOW = 8
# A short prompt, and one longer than every sliding window here and than Phi-3's LongRoPE pretraining length
# minus the new tokens (so its decode crosses the factor switch at 32 tokens).
SHORT, LONG = 5, 24
ATOL = 1e-4

_BASE: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "initializer_range": 0.1,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": None,  # greedy runs the full length, as the device runtime's does
}

CONFIGS: dict[str, dict[str, Any]] = {
    "gpt2": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128},
    "llama": {
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        "tie_word_embeddings": True,
    },
    "mistral": {"sliding_window": WINDOW, "head_dim": 16},
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1, "num_hidden_layers": 3},
    "qwen3": {"head_dim": 32, "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}},
    "gemma2": {
        "num_hidden_layers": 4,
        "head_dim": 16,
        "sliding_window": WINDOW,
        "query_pre_attn_scalar": 24,
        "attn_logit_softcapping": 5.0,
        "final_logit_softcapping": 3.0,
    },
    "gemma3_text": {
        "num_hidden_layers": 4,
        "head_dim": 16,
        "sliding_window": WINDOW,
        "query_pre_attn_scalar": 24,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    },
    "phi3": {
        "max_position_embeddings": 128,
        "original_max_position_embeddings": 32,
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.3, 1.9, 2.6],
            "long_factor": [1.5, 3.0, 7.0, 11.0],
        },
        "pad_token_id": 0,
    },
}


def _checkpoint(model_type: str, directory: Path) -> Any:
    """A random checkpoint of ``model_type`` saved in ``directory``: norms and biases noised too, so a forward
    that ignores any of them answers differently."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(sum(map(ord, model_type)))
    base = {k: v for k, v in _BASE.items() if model_type != "gpt2" or k in ("vocab_size", "initializer_range")}
    config = AutoConfig.for_model(model_type, **{**base, **CONFIGS[model_type]})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for _, param in model.named_parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(directory)
    return model


def _meta(directory: Path, fmt: str) -> dict[str, Any]:
    return {"format": fmt, **edge_model_meta(json.loads((directory / "config.json").read_text()))}


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(38)
    return [rng.integers(3, VOCAB, size=n).tolist() for n in (SHORT, LONG)]


def _expected(model: Any, ids: list[int]) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    tokens: list[int] = out[0, len(ids) :].tolist()
    return tokens


def _hf_steps(model: torch.nn.Module, ids: list[int], steps: list[int]) -> list[np.ndarray]:
    """transformers' logits for a prefill of ``ids`` then one cached forward per token of ``steps``."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        seen = [out.logits[0].numpy()]
        for token in steps:
            out = model(torch.tensor([[token]]), cache=out.cache, use_cache=True)
            seen.append(out.logits[0].numpy())
    return seen


def _onnx_steps(runtime: OnnxCausalLM, ids: list[int], steps: list[int]) -> list[np.ndarray]:
    """The export's logits for the same calls as :func:`_hf_steps`, its presents fed back as past keys/values."""
    runtime.reset()
    keys, values = runtime._keys, runtime._values
    seen = []
    for chunk in [ids, *([t] for t in steps)]:
        feed = {"input_ids": np.asarray([chunk], np.int64), "past_keys": keys, "past_values": values}
        logits, keys, values = runtime.session.run(None, feed)
        seen.append(logits[0])
    assert keys.shape[3] == len(ids) + len(steps)
    return seen


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_onnx_export_answers_like_transformers(model_type: str, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    model = _checkpoint(model_type, ckpt)
    export_onnx(ckpt, ckpt / "model.onnx")
    runtime = OnnxCausalLM(ckpt, _meta(ckpt, "onnx"))
    for ids in _prompts():
        expected = _expected(model, ids)
        # Logits of the prefill and of each cached decode step (past Phi-3's switch for the long prompt).
        want = _hf_steps(model, ids, expected[:12])
        got = _onnx_steps(runtime, ids, expected[:12])
        for step, (a, b) in enumerate(zip(got, want, strict=True)):
            np.testing.assert_allclose(a, b, atol=ATOL, rtol=0, err_msg=f"{len(ids)}-token prompt, call {step}")
        assert _greedy(runtime, ids, model.config) == expected, f"{len(ids)}-token prompt"


def _greedy(runtime: OnnxCausalLM, ids: list[int], config: Any) -> list[int]:
    """Greedy tokens through the device runtime's cache, as ``generate`` decodes. Phi-3's ``generate`` drops its
    cache when the sequence first passes ``original_max_position_embeddings`` and recomputes it with the long
    factors; a runtime does the same with a fresh prefill of the whole sequence (the graph then picks the long
    factors for every position)."""
    switch = getattr(config, "original_max_position_embeddings", None) if config.model_type == "phi3" else None
    if switch is None or len(ids) + NEW_TOKENS <= switch:
        return runtime.greedy(ids, NEW_TOKENS)
    runtime.reset()
    logits = runtime.prefill(ids)
    out: list[int] = []
    while True:
        out.append(int(np.argmax(logits)))
        if len(out) == NEW_TOKENS:
            return out
        if runtime.num_tokens == switch:
            runtime.reset()
            logits = runtime.prefill(ids + out)
        else:
            logits = runtime.decode(out[-1])


def test_the_tables_claim_exactly_the_families_tested_here() -> None:
    assert set(CONFIGS) == ONNX_ARCHITECTURES
    assert ONNX_ARCHITECTURES - {"gpt2"} == TFLITE_ARCHITECTURES  # GPT-2's LiteRT conversion decodes wrongly


class _StaticCacheDriver:
    """The LiteRT runtime's protocol (``static-kv-cache/v2``: right-padded prefill chunks, one-token decodes, the
    new keys/values written into the cache at their positions) over the static-cache module run by torch."""

    def __init__(self, module: StaticCacheLM) -> None:
        self.module = module
        self.cache = (
            torch.zeros(cache_shape(module.llama, module.cache_len)),
            torch.zeros(cache_shape(module.llama, module.cache_len)),
        )
        self.num_tokens = 0

    def _call(self, ids: list[int], width: int) -> torch.Tensor:
        padded = torch.zeros(1, width, dtype=torch.int32)
        padded[0, : len(ids)] = torch.tensor(ids)
        pos = torch.arange(self.num_tokens, self.num_tokens + width, dtype=torch.int32)
        with torch.no_grad():
            out = self.module(padded, pos, *self.cache)
        at = slice(self.num_tokens, self.num_tokens + len(ids))
        self.cache[0][:, :, :, at] = out["k_new"][:, :, :, : len(ids)]
        self.cache[1][:, :, :, at] = out["v_new"][:, :, :, : len(ids)]
        self.num_tokens += len(ids)
        logits: torch.Tensor = out["logits"][0, len(ids) - 1]
        return logits

    def greedy(self, ids: list[int]) -> list[int]:
        self.num_tokens = 0
        for start in range(0, len(ids), PREFILL_CHUNK):
            logits = self._call(ids[start : start + PREFILL_CHUNK], PREFILL_CHUNK)
        out: list[int] = []
        while len(out) < NEW_TOKENS:
            out.append(int(logits.argmax()))
            logits = self._call([out[-1]], 1)
        return out


@pytest.mark.parametrize("model_type", sorted(TFLITE_ARCHITECTURES))
def test_static_cache_graph_answers_like_transformers(model_type: str, tmp_path: Path) -> None:
    """The module LiteRT converts, run by torch the way the device's LiteRT runtime drives it: greedy tokens equal
    transformers' for every family (the conversion itself is checked below on two families)."""
    ckpt = tmp_path / "ckpt"
    model = _checkpoint(model_type, ckpt)
    spec = tflite_spec(json.loads((ckpt / "config.json").read_text()), None)
    length = default_cache_len(spec)
    driver = _StaticCacheDriver(StaticCacheLM(load_export_decoder(ckpt, spec, length), length).eval())
    # Phi-3's LiteRT export stays within its short-factor regime: 32 tokens of context here.
    long = LONG if model_type != "phi3" else length - NEW_TOKENS
    for ids in (_prompts()[0], (_prompts()[1] * 3)[:long]):
        if model_type != "phi3":
            ids = (ids * 9)[: max(len(ids), PREFILL_CHUNK + 8)]  # past one prefill chunk too
        assert driver.greedy(ids) == _expected(model, ids), f"{len(ids)}-token prompt"


def test_a_dropped_bias_or_norm_changes_the_answer(tmp_path: Path) -> None:
    """The oracle tests can fail: the random checkpoints' q/k/v biases (qwen2) and q/k norms (qwen3) are far from
    neutral, and removing them moves the logits far past the tolerance."""
    ids = _prompts()[1]
    for model_type, suffixes in (
        ("qwen2", ("q_proj.bias", "k_proj.bias", "v_proj.bias")),
        ("qwen3", ("q_norm.weight",)),
    ):
        model = _checkpoint(model_type, tmp_path / model_type)
        with torch.no_grad():
            before = model(torch.tensor([ids])).logits
            for name, param in model.named_parameters():
                if name.endswith(suffixes):
                    assert param.abs().mean() > 0.05, name
                    param.fill_(1.0 if name.endswith("norm.weight") else 0.0)
            after = model(torch.tensor([ids])).logits
        assert (before - after).abs().max() > 100 * ATOL, model_type


def _config_only(tmp_path: Path, **config: Any) -> Path:
    """A checkpoint directory with a config.json and no weights: a refusal must come before any load."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({**_BASE, **config}))
    return tmp_path


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"model_type": "falcon"}, "architecture falcon is not supported by the ONNX export; supported: gemma2,"),
        ({"model_type": "gpt_neox"}, "architecture gpt_neox is not supported by the ONNX export"),
        ({"model_type": "llama", "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
        ({"model_type": "llama", "hidden_act": "relu"}, "hidden_act 'relu' is not supported"),
        ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"model_type": "qwen2", "layer_types": ["chunked_attention"] * 2}, "layer type 'chunked_attention'"),
    ],
)
def test_unsupported_checkpoints_are_refused_before_any_work(
    config: dict[str, Any], message: str, tmp_path: Path
) -> None:
    ckpt = _config_only(tmp_path / "ckpt", **config)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")) as err:
        export_onnx(ckpt, tmp_path / "model.onnx")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "model.onnx").exists()


def test_litert_refuses_a_cache_past_the_longrope_switch(tmp_path: Path) -> None:
    ckpt = _config_only(tmp_path / "ckpt", model_type="phi3", **CONFIGS["phi3"])
    with pytest.raises(ValueError, match="cache_len 64 is past the LongRoPE switch at 32 tokens"):
        export_tflite(ckpt, tmp_path / "model.tflite", 64)
    for model_type in ("falcon", "gpt2"):
        with pytest.raises(ValueError, match=f"architecture {model_type} is not supported by the LiteRT export"):
            export_tflite(_config_only(tmp_path / model_type, model_type=model_type), tmp_path / "model.tflite", 64)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_litert_export_decodes_like_transformers(model_type: str, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    model = _checkpoint(model_type, ckpt)
    io = export_tflite(ckpt, ckpt / "model.tflite", 64)
    assert io["io"] == TFLITE_IO and io["cache_len"] == 64
    runtime = TfliteCausalLM(ckpt, {**_meta(ckpt, "tflite"), **io})
    for ids in (_prompts()[0], (_prompts()[1] * 2)[:40]):  # the second spans two prefill chunks
        assert runtime.greedy(ids, NEW_TOKENS) == _expected(model, ids), f"{len(ids)}-token prompt"

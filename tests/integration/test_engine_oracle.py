"""The engine's model against transformers on randomly initialised checkpoints (fp32, atol 1e-4), every family it
serves, each through every attention path. Sliding windows are set small (``WINDOW``) so that prompts cross them;
soft-caps small enough to bend the logits of a random model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from cloud.engine.loader import load_model
from cloud.engine.model import TransposedLinear
from cloud.engine.model_runner import Feed, ModelRunner
from shared.errors import ConfigurationError

ATOL = 1e-4
BLOCK = 8
PROMPT_LENGTHS = (1, 7, 8, 23, 40)
SMALL = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2}
WINDOW = 6
GQA = {"num_attention_heads": 4, "num_key_value_heads": 2}
TOKENS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}  # (within the small vocabulary)
# Larger random weights than the default: the scores and logits get large enough for the soft-caps to matter.
GEMMA2 = {**GQA, "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": WINDOW, "initializer_range": 0.2}
GEMMA3 = {**GQA, "head_dim": 32, "query_pre_attn_scalar": 16, "sliding_window": WINDOW, "initializer_range": 0.2}
# Llama 3.1's scaling over an original context of 32 positions (the longer prompts cross it): of the 8 frequencies of
# a 16-dim head, the wavelength under 8 kept (2 pi), the one between 8 and 32 smoothed, the longer divided by 8.
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
# YaRN over 16 original positions on 32-dim heads: the ramp spans dims 0 to 2 (one extrapolated, one half-way, the
# rest interpolated), cos and sin scaled by 0.1 ln 4 + 1.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.1, 1.3, 1.7, 2.0, 3.0],
    "long_factor": [1.5, 2.0, 3.0, 4.0, 6.0, 8.0],
}

CASES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "llama-gqa": (LlamaForCausalLM, LlamaConfig, GQA),
    "llama-mha-untied": (LlamaForCausalLM, LlamaConfig, {"num_attention_heads": 4, "tie_word_embeddings": False}),
    "qwen2-tied-bias": (
        Qwen2ForCausalLM,
        Qwen2Config,
        {"num_attention_heads": 4, "num_key_value_heads": 1, "tie_word_embeddings": True, "rope_theta": 1e6},
    ),
    "mistral": (MistralForCausalLM, MistralConfig, {"num_attention_heads": 4, "num_key_value_heads": 2}),
    "llama-rope-linear": (
        LlamaForCausalLM,
        LlamaConfig,
        {"num_attention_heads": 4, "num_key_value_heads": 2, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    ),
    "llama-rope-dynamic": (
        LlamaForCausalLM,
        LlamaConfig,
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 16,
            "rope_scaling": {"rope_type": "dynamic", "factor": 2.0},
        },
    ),
    "llama-rope-llama3": (
        LlamaForCausalLM,
        LlamaConfig,
        {**GQA, "rope_theta": 10000.0, "rope_scaling": LLAMA3},  # (the rope_scaling form of Llama 3.1's configs)
    ),
    "qwen2-rope-yarn": (
        Qwen2ForCausalLM,
        Qwen2Config,
        {"num_attention_heads": 2, "num_key_value_heads": 1, "rope_parameters": YARN},
    ),
    "mistral-window": (MistralForCausalLM, MistralConfig, {**GQA, "sliding_window": WINDOW}),
    "qwen2-window": (
        Qwen2ForCausalLM,
        Qwen2Config,
        {**GQA, "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    ),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config, {**GQA, "head_dim": 32, "initializer_range": 0.1}),
    "qwen3-bias-window": (
        Qwen3ForCausalLM,
        Qwen3Config,
        {**GQA, "attention_bias": True, "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    ),
    "gemma2-softcaps": (
        Gemma2ForCausalLM,
        Gemma2Config,
        {**GEMMA2, "attn_logit_softcapping": 0.5, "final_logit_softcapping": 2.0},
    ),
    "gemma2-defaults": (Gemma2ForCausalLM, Gemma2Config, {**GEMMA2, "num_hidden_layers": 3}),
    "gemma3": (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        {
            **GEMMA3,
            "num_hidden_layers": 3,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "rope_local_base_freq": 100.0,
            "rope_scaling": {"rope_type": "linear", "factor": 4.0},
        },
    ),
    "gemma3-softcap-mha": (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        {**GEMMA3, "num_key_value_heads": 4, "attn_logit_softcapping": 0.5, "final_logit_softcapping": 2.0},
    ),
    "phi3": (Phi3ForCausalLM, Phi3Config, {**GQA, **TOKENS}),
    "phi3-longrope-partial-window": (
        Phi3ForCausalLM,
        Phi3Config,
        {
            **GQA,
            **TOKENS,
            "rope_scaling": LONGROPE,
            "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 16,
            "max_position_embeddings": 64,
            "sliding_window": WINDOW,
        },
    ),
    "gpt2": (GPT2LMHeadModel, GPT2Config, {**TOKENS, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128}),
    "gpt2-layer-scaled": (
        GPT2LMHeadModel,
        GPT2Config,
        {**TOKENS, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_inner": 80, "scale_attn_by_inverse_layer_idx": True},
    ),
}
# Cases that are exactly the Llama computation: their decode steps run as one fused C call.
FUSED_CASES = {
    "llama-gqa",
    "llama-mha-untied",
    "llama-rope-linear",
    "llama-rope-llama3",
    "qwen2-rope-yarn",
    "qwen2-tied-bias",
    "mistral",
    "phi3",
}


def _save(tmp_path: Path, case: str, max_shard_size: str | None = None) -> tuple[Any, Path]:
    model_cls, config_cls, extra = CASES[case]
    torch.manual_seed(0)
    small = {"vocab_size": SMALL["vocab_size"]} if "n_embd" in extra else SMALL
    model = model_cls(config_cls(**{**small, **extra})).eval()
    out = tmp_path / case
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    return model, out


def _runner(path: Path, attention: str = "kernel") -> ModelRunner:
    """``fused``: small decode steps as one C call (``FusedDecoder``, the default where the model qualifies:
    ``FUSED_CASES``; the others take the kernel path); ``kernel``: the torch model with the C paged-attention
    kernel; ``torch``: torch's gather and SDPA (or written-out attention where soft-capped)."""
    runner = ModelRunner(path, torch.device("cpu"), torch.float32, BLOCK, num_blocks=64, max_model_len=128)
    if attention == "fused":
        is_fused = path.name in FUSED_CASES
        assert (runner.fused_decoder is not None) == is_fused, "fused decode step: built for the wrong models"
        if runner.fused_decoder is not None:  # every decode step must take it
            forward = runner.model.forward

            def prefill_only(ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
                assert ids.numel() > 1, "a one-token decode step ran the torch model"
                return forward(ids, *args, **kwargs)

            runner.model.forward = prefill_only  # type: ignore[method-assign,assignment]
        return runner
    runner.fused_decoder = None
    if attention == "kernel":
        assert runner.attention_kernel is not None, "the CPU paged-attention kernel did not build (see the log)"
    else:
        runner.attention_kernel = None  # torch's gather and SDPA
    return runner


@pytest.mark.parametrize("case", sorted(CASES))
def test_prefill_logits_match_transformers(tmp_path: Path, case: str) -> None:
    hf, path = _save(tmp_path, case)
    runner = _runner(path)
    gen = torch.Generator().manual_seed(1)
    for n in PROMPT_LENGTHS:
        ids = torch.randint(0, SMALL["vocab_size"], (1, n), generator=gen)
        with torch.no_grad():
            expected = hf(ids).logits[0]
        got = runner.execute([Feed(list(range(8)), ids[0].tolist(), 0, n)])
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("attention", ["fused", "kernel", "torch"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_step_by_step_decode_through_paged_cache_matches_transformers(
    tmp_path: Path, case: str, attention: str
) -> None:
    """A chunked prefill then one token at a time, through scattered (non-contiguous) blocks, against
    transformers' own incremental decoding with its KV cache; each decode step as one fused C call, or through the
    torch model reading the cache with the CPU kernel or with torch's gather."""
    hf, path = _save(tmp_path, case)
    runner = _runner(path, attention)
    ids = torch.randint(0, SMALL["vocab_size"], (1, 30), generator=torch.Generator().manual_seed(2))
    table = [13, 2, 40, 7, 21]  # deliberately out of order
    with torch.no_grad():
        out = hf(ids[:, :11], use_cache=True)
        cache, expected = out.cache, [out.logits[0, -1]]
        for p in range(11, 30):
            out = hf(ids[:, p : p + 1], cache=cache, use_cache=True)
            cache = out.cache
            expected.append(out.logits[0, -1])
    got = [runner.execute([Feed(table, ids[0, :11].tolist(), 0, 1)])[0]]
    for p in range(11, 30):
        got.append(runner.execute([Feed(table, [int(ids[0, p])], p, 1)])[0])
    torch.testing.assert_close(torch.stack(got), torch.stack(expected), atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("attention", "group_cost_blocks"),
    [("fused", 0.0), ("kernel", 0.0), ("torch", 0.0), ("torch", 1e9)],
    ids=["fused", "kernel", "torch-a-group-per-length", "torch-one-padded-group"],
)
@pytest.mark.parametrize("case", sorted(CASES))
def test_batched_decode_of_different_lengths_matches_single_sequences(
    tmp_path: Path, case: str, attention: str, group_cost_blocks: float
) -> None:
    """Sequences of different context lengths decoded in one batch give the logits each gets alone: in one fused C
    call, read in place by the kernel, or gathered by torch into one group padded to the longest or into groups
    split by length (then computed out of feed order, the rows still come back in it)."""
    hf, path = _save(tmp_path, case)
    runner = _runner(path, attention)
    runner.group_cost_blocks = group_cost_blocks
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (33, 5, 17, 6)]
    tables = [[20, 21, 22, 23, 24, 25], [0, 1, 2, 3, 4], [10, 11, 12, 13, 14], [30, 31]]
    runner.execute([Feed(t, p[:-1], 0, 0) for t, p in zip(tables, prompts, strict=True)] or [])
    batched = runner.execute([Feed(t, p[-1:], len(p) - 1, 1) for t, p in zip(tables, prompts, strict=True)])
    with torch.no_grad():
        for row, p in zip(batched, prompts, strict=True):
            # The prompt then its last token, as the engine fed them: longrope picks its factors per forward by the
            # length so far, so a sequence crossing the original context between the two differs from one forward.
            cache = hf(torch.tensor([p[:-1]]), use_cache=True).cache
            expected = hf(torch.tensor([p[-1:]]), cache=cache, use_cache=True).logits[0, -1]
            torch.testing.assert_close(row, expected, atol=ATOL, rtol=0)


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path: Path) -> None:
    hf, path = _save(tmp_path, "llama-gqa", max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file()
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(4))
    got = _runner(path).execute([Feed(list(range(4)), ids[0].tolist(), 0, 12)])
    with torch.no_grad():
        torch.testing.assert_close(got, hf(ids).logits[0], atol=ATOL, rtol=0)


def test_on_cpu_projections_are_held_transposed_and_a_tied_embedding_is_held_once(tmp_path: Path) -> None:
    """CPU decoding multiplies by [in, out] weights; the tied embedding is a view of the LM head's tensor, so the
    model holds as many weight bytes as the checkpoint (the logits tests above check the numbers)."""
    hf, path = _save(tmp_path, "qwen2-tied-bias")
    model = load_model(path, torch.device("cpu"), torch.float32, 16)
    assert isinstance(model.lm_head, TransposedLinear)
    head = model.lm_head.weight_t
    assert head.shape == (SMALL["hidden_size"], SMALL["vocab_size"]) and head.is_contiguous()
    assert model.embed_tokens.weight.untyped_storage().data_ptr() == head.untyped_storage().data_ptr()
    torch.testing.assert_close(model.embed_tokens.weight, hf.model.embed_tokens.weight, atol=0, rtol=0)

    def weight_bytes(m: torch.nn.Module) -> int:
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in m.parameters()}
        return sum(storages.values())

    assert weight_bytes(model) == weight_bytes(hf)


def test_unsupported_or_broken_checkpoints_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"no config\.json"):
        load_model(tmp_path, torch.device("cpu"), torch.float32, 16)
    _, path = _save(tmp_path, "llama-gqa")
    config = (path / "config.json").read_text()
    (path / "config.json").write_text(config.replace('"model_type": "llama"', '"model_type": "mamba"'))
    with pytest.raises(ConfigurationError, match="architecture mamba is not supported by the tierline engine"):
        load_model(path, torch.device("cpu"), torch.float32, 16)
    (path / "config.json").write_text(config)
    (path / "model.safetensors").unlink()
    with pytest.raises(ConfigurationError, match=r"no \*\.safetensors"):
        load_model(path, torch.device("cpu"), torch.float32, 16)

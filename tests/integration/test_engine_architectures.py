"""Every family the engine serves generates what transformers generates (greedy, alone and batched in one step),
runs in bf16 on CPU, reads the configs checkpoints on the Hub carry, and refuses what it cannot compute by name.

The per-step logits of each family on each attention path are checked in ``test_engine_oracle.py`` (its ``CASES``,
reused here)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from cloud.engine.attention import AttentionMetadata, build_group, paged_attention
from cloud.engine.cpu_kernels import paged_attention_kernel
from cloud.engine.loader import load_model
from cloud.engine.model_config import SUPPORTED_MODEL_TYPES, ModelConfig
from cloud.engine.model_layers import RotaryEmbedding
from cloud.engine.model_runner import Feed, ModelRunner
from shared.architectures import ENGINE_ARCHITECTURES
from shared.errors import ConfigurationError
from tests.integration.test_engine_oracle import BLOCK, CASES, FUSED_CASES, _save

NEW_TOKENS = 20
# (Llama 3.1's RoPE is its own checkpoints' default, so it generates here too; linear and dynamic only in the oracle)
FAMILY_CASES = sorted(c for c in CASES if not c.startswith("llama-rope") or c == "llama-rope-llama3")


def _engine_greedy(runner: ModelRunner, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """Each prompt prefilled (all in one step), then every sequence decoded one token a step, all in each step."""
    blocks_each = -(-(max(map(len, prompts)) + num_tokens) // BLOCK)
    tables = [list(range(i * blocks_each, (i + 1) * blocks_each))[::-1] for i in range(len(prompts))]
    logits = runner.execute([Feed(t, p, 0, 1) for t, p in zip(tables, prompts, strict=True)])
    outputs: list[list[int]] = [[int(row.argmax())] for row in logits]
    for _ in range(num_tokens - 1):
        feeds = [
            Feed(t, [out[-1]], len(p) + len(out) - 1, 1) for t, p, out in zip(tables, prompts, outputs, strict=True)
        ]
        for out, row in zip(outputs, runner.execute(feeds), strict=True):
            out.append(int(row.argmax()))
    return outputs


def _hf_greedy(hf: Any, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy decoding with transformers' own KV cache (``generate`` without sampling, written out)."""
    out: list[int] = []
    with torch.no_grad():
        step = hf(torch.tensor([prompt]), use_cache=True)
        for _ in range(num_tokens):
            out.append(int(step.logits[0, -1].argmax()))
            step = hf(torch.tensor([[out[-1]]]), cache=step.cache, use_cache=True)
    return out


def _prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("attention", ["default", "torch"])
@pytest.mark.parametrize("case", FAMILY_CASES)
def test_greedy_generation_alone_and_batched_matches_transformers(tmp_path: Path, case: str, attention: str) -> None:
    """Twenty greedy tokens after prompts longer than the sliding window (and, for longrope, than the original
    context), the same whether a sequence decodes alone or in one batch with others of different lengths."""
    hf, path = _save(tmp_path, case)
    runner = ModelRunner(path, torch.device("cpu"), torch.float32, BLOCK, num_blocks=64, max_model_len=128)
    if attention == "torch":
        runner.fused_decoder, runner.attention_kernel = None, None
    prompts = _prompts((21, 9, 30), seed=7)
    expected = [_hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert _engine_greedy(runner, prompts, NEW_TOKENS) == expected
    assert _engine_greedy(runner, prompts[:1], NEW_TOKENS) == expected[:1]


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_a_decode_burst_gives_transformers_greedy_tokens(tmp_path: Path, case: str) -> None:
    """A decode burst (``LLMEngine._run_burst``: ``ModelRunner.propose_greedy`` on the target, every token after the
    first in one fused call, alone and for three sequences of different lengths together) gives transformers' greedy
    tokens; where the fused step does not take the family, the runner refuses a burst and the engine decodes a token a
    step (the path ``test_greedy_generation_alone_and_batched_matches_transformers`` checks)."""
    hf, path = _save(tmp_path, case)
    runner = ModelRunner(path, torch.device("cpu"), torch.float32, BLOCK, num_blocks=64, max_model_len=128)
    prompts = _prompts((21, 9, 30), seed=7)
    expected = [_hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    for group in (prompts, prompts[:1]):
        blocks_each = -(-(max(map(len, group)) + NEW_TOKENS) // BLOCK)
        tables = [list(range(i * blocks_each, (i + 1) * blocks_each))[::-1] for i in range(len(group))]
        firsts = [
            int(r.argmax()) for r in runner.execute([Feed(t, p, 0, 1) for t, p in zip(tables, group, strict=True)])
        ]
        feeds = [Feed(t, [f], len(p), 1) for t, p, f in zip(tables, group, firsts, strict=True)]
        burst = runner.propose_greedy(feeds, [NEW_TOKENS - 1] * len(group))
        if case not in FUSED_CASES:
            assert burst is None
            continue
        assert burst is not None
        assert [[f, *b] for f, b in zip(firsts, burst, strict=True)] == expected[: len(group)]


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_bf16_on_cpu_runs_and_agrees_with_transformers_in_bf16(tmp_path: Path, case: str) -> None:
    hf, path = _save(tmp_path, case)
    hf = hf.to(torch.bfloat16)
    runner = ModelRunner(path, torch.device("cpu"), torch.bfloat16, BLOCK, num_blocks=64, max_model_len=128)
    assert runner.fused_decoder is None and runner.attention_kernel is None  # (both are fp32 only)
    prompt = _prompts((10,), seed=8)[0]
    got = runner.execute([Feed(list(range(4)), prompt, 0, len(prompt))])
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].float()
    assert got.dtype == torch.float32 and bool(torch.isfinite(got).all())
    tolerance = 0.05 * float(expected.abs().max())
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=0)
    # Greedy tokens: each one the engine picks is, for transformers in bf16 on the same text, within the tolerance
    # of its best (random models have near ties that bf16 rounding may break either way).
    tokens = _engine_greedy(runner, [prompt], 8)[0]
    with torch.no_grad():
        rows = hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :].float()
    picked = rows.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert bool((picked >= rows.max(dim=1).values - tolerance).all()), (tokens, rows.argmax(dim=1).tolist())


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_fused_decode_step_is_taken_only_for_the_llama_computation(tmp_path: Path, case: str) -> None:
    _, path = _save(tmp_path, case)
    runner = ModelRunner(path, torch.device("cpu"), torch.float32, BLOCK, num_blocks=16, max_model_len=64)
    assert (runner.fused_decoder is not None) == (case in FUSED_CASES)


def test_a_mistral_window_wider_than_the_context_keeps_the_fused_step(tmp_path: Path) -> None:
    _, path = _save(tmp_path, "mistral-window")
    narrow = ModelRunner(path, torch.device("cpu"), torch.float32, BLOCK, num_blocks=16, max_model_len=64)
    assert narrow.fused_decoder is None  # window 6 < 64 positions: honoured on the torch path
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "sliding_window": 64}))
    wide = ModelRunner(path, torch.device("cpu"), torch.float32, BLOCK, num_blocks=16, max_model_len=64)
    assert wide.fused_decoder is not None


def test_engine_architectures_are_what_the_engine_builds() -> None:
    assert set(SUPPORTED_MODEL_TYPES) == ENGINE_ARCHITECTURES


def test_gpt2_weights_without_the_transformer_prefix_load(tmp_path: Path) -> None:
    """Original GPT-2 checkpoints name their tensors ``h.N...``, ``wte``, ``ln_f`` (and carry attention-mask
    buffers); the engine reads them like ``transformer.h.N...``."""
    hf, path = _save(tmp_path, "gpt2")
    tensors = load_file(path / "model.safetensors")
    renamed = {k.removeprefix("transformer."): v for k, v in tensors.items() if k != "lm_head.weight"}
    renamed["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 128, 128))
    save_file(renamed, path / "model.safetensors")
    ids = _prompts((12,), seed=9)[0]
    model = ModelRunner(path, torch.device("cpu"), torch.float32, BLOCK, num_blocks=16, max_model_len=64)
    got = model.execute([Feed(list(range(2)), ids, 0, len(ids))])
    with torch.no_grad():
        torch.testing.assert_close(got, hf(torch.tensor([ids])).logits[0], atol=1e-4, rtol=0)


LLAMA31 = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}
QWEN25_YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64}
_GEMMA3_LOCAL = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
_HEAD_128 = {"hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1}
ROPE_TABLE_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3.1-rope_scaling": ("llama", {**_HEAD_128, "rope_theta": 5e5, "rope_scaling": LLAMA31}),
    "llama3-rope_parameters": (
        "llama",
        {"rope_parameters": {**LLAMA31, "rope_theta": 1e4, "original_max_position_embeddings": 32, "factor": 32}},
    ),
    "yarn-qwen2.5-rope_scaling": ("qwen2", {**_HEAD_128, "rope_theta": 1e6, "rope_scaling": QWEN25_YARN}),
    "yarn-betas-untruncated-attention-factor": (
        "llama",
        {"rope_parameters": {**YARN, "beta_fast": 8, "beta_slow": 0.5, "truncate": False, "attention_factor": 1.3}},
    ),
    "yarn-mscale-factor-from-lengths": (
        "qwen2",
        {
            **_HEAD_128,
            "max_position_embeddings": 65536,
            "rope_parameters": {
                **YARN,
                "factor": None,
                "original_max_position_embeddings": 16384,
                "mscale": 1.0,
                "mscale_all_dim": 0.707,
            },
        },
    ),
    "yarn-top-level-original-context": ("llama", {"original_max_position_embeddings": 256, "rope_parameters": YARN}),
    "gemma3-yarn-per-layer-type": (
        "gemma3_text",
        {
            "head_dim": 16,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {"full_attention": {**YARN, "truncate": False}, **_GEMMA3_LOCAL},
        },
    ),
    "gemma3-llama3-per-layer-type": (
        "gemma3_text",
        {
            "head_dim": 16,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {"full_attention": {**LLAMA31, "rope_theta": 1e6, "factor": 4.0}, **_GEMMA3_LOCAL},
        },
    ),
}


@pytest.mark.parametrize("case", sorted(ROPE_TABLE_CASES))
def test_llama3_and_yarn_rope_tables_are_the_bits_transformers_computes(case: str) -> None:
    """Llama 3.1's and YaRN's cos/sin (yarn's scaled by its attention factor), from both config forms and each
    optional key, bit for bit what the family's transformers rotary embedding gives at every position; the fused C
    decode step reads these same tables."""
    model_type, extra = ROPE_TABLE_CASES[case]
    raw = {**_hub(model_type, num_hidden_layers=2, num_key_value_heads=2), **copy.deepcopy(extra)}
    config = ModelConfig.from_dict(copy.deepcopy(raw))
    assert config.rope_type in ("llama3", "yarn")
    ours = RotaryEmbedding(config, 512)
    hf_config = AutoConfig.for_model(**raw)
    rotary_class = {
        "llama": LlamaRotaryEmbedding,
        "qwen2": Qwen2RotaryEmbedding,
        "gemma3_text": Gemma3RotaryEmbedding,
    }[model_type]
    hf = rotary_class(hf_config)
    kwargs = {"layer_type": "full_attention"} if model_type == "gemma3_text" else {}
    x = torch.zeros(1, 1, 512, config.head_dim)
    cos, sin = hf(x, torch.arange(512)[None], **kwargs)
    half = config.head_dim // 2
    assert torch.equal(ours.cos_table, cos[0, :, :half]) and torch.equal(ours.cos_table, cos[0, :, half:])
    assert torch.equal(ours.sin_table, sin[0, :, :half]) and torch.equal(ours.sin_table, sin[0, :, half:])


def _hub(model_type: str, **extra: Any) -> dict[str, Any]:
    base = {"model_type": model_type, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96}
    return {**base, "num_hidden_layers": 4, "num_attention_heads": 4, **extra}


def test_hub_style_configs_read_as_transformers_reads_them() -> None:
    """Configs written before transformers 5: Gemma 3's ``rope_local_base_freq`` and ``sliding_window_pattern``,
    Phi-3.5's ``rope_scaling`` of type ``su``, Qwen's ``use_sliding_window: false`` with a window given."""
    gemma3 = ModelConfig.from_dict(
        _hub(
            "gemma3_text",
            rope_theta=1e6,
            rope_local_base_freq=1e4,
            sliding_window=512,
            sliding_window_pattern=2,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
        )
    )
    assert gemma3.layer_windows == (512, 0, 512, 0)
    assert (gemma3.rope_theta, gemma3.rope_local_theta, gemma3.rope_type, gemma3.rope_factor) == (1e6, 1e4, "linear", 8)
    assert gemma3.attention_scale == 256**-0.5 and gemma3.head_dim == 256 and gemma3.tie_word_embeddings
    assert gemma3.final_logit_softcap is None and gemma3.norm_offset and gemma3.qk_norm

    gemma2 = ModelConfig.from_dict(_hub("gemma2", head_dim=16))
    assert gemma2.attn_logit_softcap == 50.0 and gemma2.final_logit_softcap == 30.0
    assert gemma2.layer_windows == (4096, 0, 4096, 0) and gemma2.activation == "gelu_pytorch_tanh"

    factors = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    phi = ModelConfig.from_dict(
        _hub(
            "phi3",
            rope_scaling={"type": "su", **factors},
            max_position_embeddings=131072,
            original_max_position_embeddings=4096,
            sliding_window=262144,
        )
    )
    assert phi.rope_type == "longrope" and phi.rope_original_max_positions == 4096
    assert phi.rope_attention_factor == pytest.approx((1 + torch.log(torch.tensor(32.0)).item() / 8.317766) ** 0.5)

    llama31 = ModelConfig.from_dict(_hub("llama", max_position_embeddings=131072, rope_theta=5e5, rope_scaling=LLAMA31))
    assert (llama31.rope_type, llama31.rope_factor, llama31.rope_original_max_positions) == ("llama3", 8.0, 8192)
    assert (llama31.rope_low_freq_factor, llama31.rope_high_freq_factor, llama31.rope_theta) == (1.0, 4.0, 5e5)
    qwen25 = ModelConfig.from_dict(_hub("qwen2", rope_theta=1e6, rope_scaling=QWEN25_YARN))
    assert (qwen25.rope_type, qwen25.rope_factor, qwen25.rope_original_max_positions) == ("yarn", 4.0, 32768)
    assert qwen25.rope_attention_factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    assert (qwen25.rope_beta_fast, qwen25.rope_beta_slow, qwen25.rope_truncate) == (32.0, 1.0, True)

    qwen = ModelConfig.from_dict(_hub("qwen2", use_sliding_window=False, sliding_window=32768))
    assert qwen.layer_windows == (0, 0, 0, 0) and qwen.attention_bias and not qwen.o_proj_bias
    gpt2 = ModelConfig.from_dict({"model_type": "gpt2", "vocab_size": 256, "n_embd": 64, "n_layer": 2, "n_head": 4})
    assert (gpt2.hidden_size, gpt2.intermediate_size, gpt2.max_position_embeddings) == (64, 256, 1024)
    assert gpt2.position_embedding == "learned" and gpt2.norm == "layer" and gpt2.activation == "gelu_new"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "mamba"}, r"architecture mamba is not supported by the tierline engine; supported: gemma2"),
        ({"model_type": "qwen3", "hidden_act": "relu"}, r"hidden_act 'relu' is not supported; supported: \('silu'"),
        ({"model_type": "gemma2", "hidden_activation": "relu"}, r"hidden_activation 'relu' is not supported"),
        ({"rope_scaling": {"rope_type": "proportional", "factor": 4.0}}, r"rope type 'proportional' is not supported"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}}, r"'high_freq_factor'"),
        ({"model_type": "qwen3", "num_experts": 8}, r"num_experts 8: mixture-of-experts models are not supported"),
        ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, r"use_bidirectional_attention is set"),
        ({"layer_types": ["full_attention", "chunked_attention"]}, r"layer_types must list one of"),
        ({"model_type": "phi3", "rope_scaling": {"type": "longrope", "short_factor": [1.0]}}, r"'long_factor'"),
        ({"hidden_size": "wide"}, r"a value has the wrong type"),
        ({"rope_parameters": [10000.0]}, r"a value has the wrong type"),
    ],
)
def test_what_the_engine_cannot_compute_is_refused_by_name(change: dict[str, Any], message: str) -> None:
    raw = {**_hub("llama"), "num_hidden_layers": 2, **change}
    with pytest.raises(ConfigurationError, match=message):
        ModelConfig.from_dict(raw)


def test_a_checkpoint_missing_a_family_tensor_is_named(tmp_path: Path) -> None:
    _, path = _save(tmp_path, "gemma3")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ConfigurationError, match=r"lacks 1 tensors, e\.g\. layers\.1\.self_attn\.k_norm\.weight"):
        load_model(path, torch.device("cpu"), torch.float32, 16)


def test_a_context_longer_than_gpt2_learned_positions_is_refused(tmp_path: Path) -> None:
    _, path = _save(tmp_path, "gpt2")  # n_positions 128
    with pytest.raises(ConfigurationError, match=r"max_model_len 256 is longer than the 128 positions gpt2 learned"):
        load_model(path, torch.device("cpu"), torch.float32, 256)


@pytest.mark.parametrize(("window", "softcap"), [(3, 0.0), (0, 0.7), (5, 0.7), (200, 0.0)])
def test_both_paged_attention_paths_apply_windows_and_softcaps_like_written_out_attention(
    window: int, softcap: float
) -> None:
    """The C kernel and the torch path against attention written out per query (GQA, 3 new tokens a sequence,
    contexts shorter and longer than the window, scattered blocks)."""
    gen = torch.Generator().manual_seed(window + int(10 * softcap))
    num_blocks, block_size, num_heads, num_kv_heads, head_dim, q_len = 32, 4, 4, 2, 8, 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    contexts = [3, 4, 9, 22]
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[order.pop() for _ in range(-(-c // block_size))] for c in contexts]
    q = torch.randn(len(contexts) * q_len, num_heads, head_dim, generator=gen) * 3
    k = torch.randn(len(contexts) * q_len, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(len(contexts) * q_len, num_kv_heads, head_dim, generator=gen)
    slots = [
        t[p // block_size] * block_size + p % block_size
        for t, c in zip(tables, contexts, strict=True)
        for p in range(c - 3, c)
    ]
    kernel = paged_attention_kernel()
    assert kernel is not None
    outputs = []
    for for_kernel in (False, True):
        group = build_group(0, q_len, contexts, tables, block_size, torch.device("cpu"), for_kernel=for_kernel)
        meta = AttentionMetadata(torch.tensor(slots), [group], kernel if for_kernel else None)
        outputs.append(paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.3, window, softcap))
    flat_k, flat_v = k_cache.view(-1, num_kv_heads, head_dim).clone(), v_cache.view(-1, num_kv_heads, head_dim).clone()
    flat_k[slots], flat_v[slots] = k, v
    expected = torch.empty_like(q)
    for s, (table, ctx) in enumerate(zip(tables, contexts, strict=True)):
        keys_at = [table[p // block_size] * block_size + p % block_size for p in range(ctx)]
        for i in range(q_len):
            row, last = s * q_len + i, ctx - q_len + i
            first = max(0, last - window + 1) if window else 0
            for h in range(num_heads):
                kvh = h // (num_heads // num_kv_heads)
                scores = flat_k[keys_at[first : last + 1], kvh] @ q[row, h] * 0.3
                if softcap:
                    scores = softcap * torch.tanh(scores / softcap)
                expected[row, h] = torch.softmax(scores, 0) @ flat_v[keys_at[first : last + 1], kvh]
    for got in outputs:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)

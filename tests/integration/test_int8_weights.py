"""Weight-only int8 on the CPU's fused step (``EngineConfig.cpu_weights = "int8"``, ``TIERLINE_CLOUD_CPU_WEIGHTS``):
what a team opting in is promised. On the committed demo cloud LM (a real checkpoint, trained) and on randomly
initialised Llama and Qwen2 checkpoints: each projection is within its quantization step of the fp32 one, greedy
decoding mostly agrees with fp32 (the agreement docs/engine.md states, with a margin), speculation changes no
output under int8, and a value the setting does not know is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from bench.common import tokens_before_divergence
from bench.lab.int8_agreement import PROMPTS as INT8_PROMPTS
from cloud.engine import EngineConfig, SamplingParams
from cloud.engine.fused_decoder import quantize_int8
from cloud.engine.llm import LLM
from cloud.engine.model_runner import ModelRunner
from cloud.settings import CloudSettings
from shared.zoo.build import committed_weights
from shared.zoo.presets import DEMO

DEMO_LM = committed_weights(DEMO) / "lm-cloud"
DEMO_DRAFT = committed_weights(DEMO) / "lm-draft"
PROMPTS = INT8_PROMPTS[:8]  # code openings: the zoo's LMs are trained on Python
GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


def _generate(llm: LLM) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, GREEDY)]


def test_quantization_is_within_half_a_step_of_each_weight() -> None:
    torch.manual_seed(0)
    weight = torch.randn(96, 40) * torch.linspace(0.01, 3.0, 40)  # columns of very different ranges
    q, scale = quantize_int8(weight)
    assert q.dtype == torch.int8 and scale.shape == (40,) and int(q.abs().max()) <= 127
    error = (q.float() * scale - weight).abs()
    assert bool((error <= scale / 2 + 1e-7).all())
    assert bool((q.abs().amax(dim=0) == 127).all())  # each column uses its whole range


@pytest.mark.parametrize(
    ("model_cls", "config_cls", "tied"),
    [(LlamaForCausalLM, LlamaConfig, True), (Qwen2ForCausalLM, Qwen2Config, False)],
    ids=["llama", "qwen2-bias"],
)
def test_int8_logits_follow_fp32_on_random_checkpoints(
    tmp_path: Path, model_cls: type, config_cls: type, tied: bool
) -> None:
    """The int8 step is the fp32 step with quantized projections: logits close to fp32's on a checkpoint the team
    brings (random weights, GQA, Qwen2's q/k/v biases), rows of a verification included."""
    torch.manual_seed(0)
    config = config_cls(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    model_cls(config).eval().save_pretrained(tmp_path / "m")
    logits = {}
    for int8 in (False, True):
        runner = ModelRunner(
            tmp_path / "m", torch.device("cpu"), torch.float32, 8, num_blocks=8, max_model_len=64, int8_weights=int8
        )
        fused = runner.fused_decoder
        assert fused is not None and fused.int8_weights == int8
        prompt = list(range(3, 20))
        fused.run(prompt, list(range(len(prompt))), [[0, 1, 2]], [0] * len(prompt), [len(prompt) - 1])
        logits[int8] = fused.run([7, 9, 11], [17, 18, 19], [[0, 1, 2]], [0, 0, 0], [0, 1, 2])
    gap = (logits[True] - logits[False]).abs().max().item()
    spread = logits[False].abs().max().item()
    assert 0 < gap < 0.05 * spread, (gap, spread)  # quantized (not the fp32 path), and close to it


def test_int8_greedy_agrees_with_fp32_on_the_demo_lm() -> None:
    """The agreement docs/engine.md states (16 prompts, 64 tokens: 11 identical, 0.76 of positions) with a margin
    for 8 prompts of 48 tokens: half the sequences identical at least, the same first 24 tokens on average (a
    near-tie may flip at any token, the first included)."""
    fp32 = _generate(LLM(DEMO_LM, kv_cache_bytes=32 << 20, speculation="off"))
    int8 = _generate(LLM(DEMO_LM, kv_cache_bytes=32 << 20, speculation="off", cpu_weights="int8"))
    identical = sum(a == b for a, b in zip(fp32, int8, strict=True))
    prefixes = [tokens_before_divergence(a, b) for a, b in zip(fp32, int8, strict=True)]
    assert identical >= 4, (identical, prefixes)
    assert sum(prefixes) / len(prefixes) >= 24, prefixes


def test_speculation_changes_no_int8_output() -> None:
    """Under int8 a verification's rows and a decode step's row run the same kernel: greedy outputs are the same with
    speculation off, by the draft, and by n-grams."""
    outputs = {
        method: _generate(
            LLM(
                DEMO_LM,
                draft_model_dir=DEMO_DRAFT if method == "draft" else None,
                kv_cache_bytes=32 << 20,
                speculation=method,
                cpu_weights="int8",
                adaptive_speculation=False,
            )
        )
        for method in ("off", "draft", "ngram")
    }
    assert outputs["draft"] == outputs["off"] and outputs["ngram"] == outputs["off"]


def test_an_int8_draft_proposes_and_the_fp32_target_decides() -> None:
    """The draft's weights are int8 by default (``draft_cpu_weights``) and the target's stay fp32: the draft only
    proposes, so greedy outputs are exactly plain fp32 decoding's, and its proposals are accepted about as often as
    the fp32 draft's (the same k every round)."""
    plain = _generate(LLM(DEMO_LM, kv_cache_bytes=32 << 20, speculation="off"))
    acceptance = {}
    for weights in ("int8", "fp32"):
        kwargs = {} if weights == "int8" else {"draft_cpu_weights": "fp32"}  # int8: the default
        llm = LLM(DEMO_LM, draft_model_dir=DEMO_DRAFT, kv_cache_bytes=32 << 20, adaptive_speculation=False, **kwargs)
        engine = llm.engine
        assert engine.draft_runner is not None and engine.draft_runner.fused_decoder is not None
        assert engine.runner.fused_decoder is not None and not engine.runner.fused_decoder.int8_weights
        assert engine.draft_runner.fused_decoder.int8_weights == (weights == "int8")
        assert _generate(llm) == plain
        proposed, accepted = engine.stats.spec_proposed["draft"], engine.stats.spec_accepted["draft"]
        assert proposed > 0
        acceptance[weights] = accepted / proposed
    assert acceptance["int8"] > 0.9 * acceptance["fp32"] and acceptance["int8"] > 0.3, acceptance


def test_an_unknown_weight_format_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="cpu_weights must be one of"):
        EngineConfig(model_dir=DEMO_LM, cpu_weights="int4")
    monkeypatch.setenv("TIERLINE_CLOUD_CPU_WEIGHTS", "int4")
    with pytest.raises(ValueError, match="cpu_weights"):
        CloudSettings()
    monkeypatch.setenv("TIERLINE_CLOUD_CPU_WEIGHTS", "int8")
    assert CloudSettings().cpu_weights == "int8"
    with pytest.raises(ValueError, match="draft_cpu_weights must be one of"):
        EngineConfig(model_dir=DEMO_LM, draft_cpu_weights="int4")
    assert CloudSettings().draft_cpu_weights == "int8"

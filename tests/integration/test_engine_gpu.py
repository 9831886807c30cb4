"""The engine on CUDA (half precision). Skipped, with the reason, on hosts without a CUDA device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cloud.engine import LLM, SamplingParams
from shared.zoo.registry import ZooLayout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this host"),
]


def test_cuda_bf16_engine_agrees_with_cpu_fp32(tiny_zoo: Path) -> None:
    model_dir = ZooLayout(tiny_zoo).artifact_dir("lm-cloud")
    prompts = ["def main(argv):\n", "import os\n"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    cpu = LLM(model_dir, kv_cache_bytes=16 << 20).generate(prompts, params)
    gpu_llm = LLM(model_dir, device="cuda", dtype="bfloat16", kv_cache_bytes=16 << 20)
    gpu = gpu_llm.generate(prompts, params)
    assert gpu_llm.engine.runner.kv_cache.is_cuda
    for a, b in zip(cpu, gpu, strict=True):
        # Half precision may flip a near-tie late in a greedy run; the first tokens must agree.
        assert a.token_ids[:4] == b.token_ids[:4]
        assert a.outputs[0].logprobs is not None and b.outputs[0].logprobs is not None
        assert abs(a.outputs[0].logprobs[0].logprob - b.outputs[0].logprobs[0].logprob) < 0.1


def test_cuda_speculative_greedy_is_identical_to_plain(tiny_zoo: Path) -> None:
    layout = ZooLayout(tiny_zoo)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = LLM(layout.artifact_dir("lm-cloud"), device="cuda", dtype="float32", kv_cache_bytes=16 << 20)
    spec = LLM(
        layout.artifact_dir("lm-cloud"),
        draft_model_dir=layout.artifact_dir("lm-draft"),
        device="cuda",
        dtype="float32",
        kv_cache_bytes=16 << 20,
        adaptive_speculation=False,
    )
    prompts = ["class A:\n", "for x in"]
    assert [o.token_ids for o in spec.generate(prompts, params)] == [
        o.token_ids for o in plain.generate(prompts, params)
    ]

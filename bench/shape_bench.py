"""The engine beside llama.cpp on a model of a real size: random weights in a real configuration.

The zoo's models are a few million parameters; a team's are hundreds of millions. ``SHAPES`` holds the published
configurations of models people run on CPUs and devices (layer count, widths, heads, vocabulary); the checkpoint is
randomly initialised by transformers in that configuration (seeded, written once into a cache directory with a small
byte-level BPE tokenizer: the prompts are token ids, so the vocabulary's text does not matter) and exported to GGUF
f32 and Q8_0 with the project's exporter. Random weights cost what trained ones cost: the same matrices, the same
bytes streamed per token.

Every contender runs in a child process of its own (``python -m bench.shape_bench worker``), so each one's peak RSS
is its own; contenders alternate within each round; rates are the median round's. Greedy, ``ignore_eos``, the same
token-id prompts for all: batch 1 (requests one after another) and ``concurrent`` requests at once.
"""

from __future__ import annotations

import json
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# Published configurations (config.json of each model's release), random weights.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
    "smollm2-360m": {
        "model_type": "llama",
        "hidden_size": 960,
        "intermediate_size": 2560,
        "num_hidden_layers": 32,
        "num_attention_heads": 15,
        "num_key_value_heads": 5,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
    },
    # A few-MB stand-in of the same family: what the tests run, so the code path is checked in CI.
    "test-qwen2": {
        "model_type": "qwen2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1024,
        "max_position_embeddings": 1024,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
}
CONTENDERS = ("tierline", "llamacpp-f32", "llamacpp-q8_0")
TOKENIZER_VOCAB = 512
MAX_LEN = 512


def shape_dir(cache: Path, shape: str) -> Path:
    """The cached checkpoint (HF safetensors + tokenizer) and its GGUF files of ``shape``, made when missing."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    out = cache / shape
    if (out / "ready").is_file():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from shared.zoo.export_gguf import GGUF_FILES, export_gguf, find_converter

    spec = dict(SHAPES[shape])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    del model
    _write_tokenizer(out)
    for kind, name in GGUF_FILES.items():
        export_gguf(out, out / name, kind, converter=find_converter())
    (out / "ready").write_text("1\n")
    return out


def _write_tokenizer(out: Path) -> None:
    """A small byte-level BPE (GPT-2 pre-tokenization) trained on the held-out corpus: the engine and the GGUF
    export need a tokenizer file; the benchmark's prompts are token ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from shared.zoo.corpus import held_out_files

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((f.text for f in held_out_files()), trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "add_bos_token": False}))


def workload(vocab: int, num_requests: int, prompt_tokens: int, new_tokens: int, seed: int) -> list[list[int]]:
    """Seeded random token-id prompts of ``prompt_tokens`` each (ids below the tokenizer's vocabulary)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(prompt_tokens)] for _ in range(num_requests)]


def _peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def run_worker(
    contender: str, model_dir: Path, prompts: list[list[int]], new_tokens: int, concurrent: int
) -> dict[str, Any]:
    """One contender in this process: load, warm up, then batch 1 (each prompt alone) and all prompts at once."""
    import torch

    threads = torch.get_num_threads()
    work = [(p, new_tokens) for p in prompts]
    alone = work[: max(1, len(work) // 4)]
    if contender == "tierline":
        from bench.engine_bench import run_engine_workload
        from cloud.engine.config import EngineConfig
        from cloud.engine.llm_engine import LLMEngine

        engine = LLMEngine(
            EngineConfig(model_dir, kv_cache_bytes=512 << 20, max_num_seqs=concurrent, max_model_len=MAX_LEN)
        )
        run_engine_workload(engine, work[:2], cache_salt="warm-up")
        started = time.perf_counter()
        outs1 = [run_engine_workload(engine, [w], cache_salt=f"b1-{i}")["outputs"][0] for i, w in enumerate(alone)]
        batch1: dict[str, Any] = {
            "tokens_per_s": sum(map(len, outs1)) / (time.perf_counter() - started),
            "outputs": outs1,
        }
        many = run_engine_workload(engine, work, cache_salt="many")
    else:
        from bench.llamacpp import LlamaCppBatch, timed_generate
        from shared.zoo.export_gguf import GGUF_FILES

        path = model_dir / GGUF_FILES[contender.removeprefix("llamacpp-")]
        one = LlamaCppBatch(path, 1, MAX_LEN, threads)
        one.generate(work[:1])
        batch1 = timed_generate(one, alone, one_at_a_time=True)
        one.close()
        peer = LlamaCppBatch(path, concurrent, MAX_LEN, threads)
        peer.generate(work[:2])
        many = timed_generate(peer, work, one_at_a_time=False)
        peer.close()
    return {
        "contender": contender,
        "threads": threads,
        "batch1_tokens_per_s": round(batch1["tokens_per_s"], 2),
        "concurrent_tokens_per_s": round(many["tokens_per_s"], 2),
        "peak_rss_mb": _peak_rss_mb(),
        "batch1_outputs": batch1["outputs"],
        "concurrent_outputs": many["outputs"],
    }


def bench_shape(
    shape: str,
    cache: Path,
    rounds: int = 3,
    concurrent: int = 16,
    prompt_tokens: int = 64,
    new_tokens: int = 32,
    seed: int = 0,
) -> dict[str, Any]:
    """The engine beside llama.cpp f32 and Q8_0 on ``shape``: tokens/s at batch 1 and ``concurrent`` at once,
    peak RSS, and how many greedy outputs equal the engine's."""
    model_dir = shape_dir(cache, shape)
    prompts = workload(TOKENIZER_VOCAB, concurrent, prompt_tokens, new_tokens, seed)
    work_file = model_dir / f"work-{seed}-{concurrent}-{prompt_tokens}.json"
    work_file.write_text(json.dumps(prompts))
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CONTENDERS}
    for r in range(rounds):
        order = CONTENDERS if r % 2 == 0 else CONTENDERS[::-1]
        for contender in order:
            cmd = [sys.executable, "-m", "bench.shape_bench", contender, str(model_dir), str(work_file)]
            cmd += [str(new_tokens), str(concurrent)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=3600)
            if done.returncode != 0:
                raise RuntimeError(f"{contender} failed: {done.stderr.strip().splitlines()[-1:]}")
            runs[contender].append(json.loads(done.stdout.strip().splitlines()[-1]))
    ours = runs["tierline"][0]

    def same(contender: str, key: str) -> str:
        theirs = runs[contender][0][key]
        return f"{sum(a == b for a, b in zip(theirs, ours[key], strict=True))}/{len(theirs)}"

    def median(contender: str, key: str) -> float:
        return round(statistics.median(run[key] for run in runs[contender]), 2)

    result: dict[str, Any] = {
        "bench": "engine-vs-llamacpp-shape",
        "shape": shape,
        "config": SHAPES[shape],
        "rounds": rounds,
        "threads": ours["threads"],
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "concurrent": concurrent,
    }
    for c in CONTENDERS:
        result[c] = {
            "batch1_tokens_per_s": median(c, "batch1_tokens_per_s"),
            "concurrent_tokens_per_s": median(c, "concurrent_tokens_per_s"),
            "batch1_runs": [run["batch1_tokens_per_s"] for run in runs[c]],
            "concurrent_runs": [run["concurrent_tokens_per_s"] for run in runs[c]],
            "peak_rss_mb": max(run["peak_rss_mb"] for run in runs[c]),
        }
        if c != "tierline":
            result[c]["outputs_identical_batch1"] = same(c, "batch1_outputs")
            result[c]["outputs_identical_concurrent"] = same(c, "concurrent_outputs")
    return result


if __name__ == "__main__":  # the worker: python -m bench.shape_bench CONTENDER MODEL_DIR WORK_FILE NEW CONCURRENT
    _contender, _model_dir, _work, _new, _concurrent = sys.argv[1:6]
    _prompts = json.loads(Path(_work).read_text())
    print(json.dumps(run_worker(_contender, Path(_model_dir), _prompts, int(_new), int(_concurrent))))

"""What a draft could buy at batch 1: the arithmetic of speculative decoding on this CPU, measured.

``python -m bench.lab.spec_probe [--lm-dir DIR] [--max-k K] [--head-steps N]`` prints one JSON object; DIR holds
``lm-cloud`` and ``lm-draft`` (a built zoo's ``artifacts/``, or the committed ``shared/zoo/weights/demo``):

1. The target's own greedy continuations (the engine, ``ignore_eos``) of held-out prompts: what speculation sees.
2. Tokens per verification round for k = 1 .. ``max_k`` proposals of the distilled draft ``lm-draft``, by walking
   those continuations as greedy speculation does (teacher forcing: a proposal counts while every one before it
   in the round was right, and each round adds the target's own token).
3. The same for Medusa-style heads (k residual SiLU blocks on the target's last hidden state, each followed by the
   target's own frozen LM head, proposing the tokens 2 .. k + 1 ahead), trained for ``head_steps`` steps on the
   target's greedy continuations of training-text prompts: a proposer that costs no forward of its own.
4. The bare forwards' costs (best of 40, wall clock): a plain step, a verification of k + 1 tokens, a draft step;
   ``forward_bound_speedup`` = tokens a round x plain / (verification + k draft steps), the most speculation with
   that proposer can give over plain decoding with no engine overhead at all (Medusa's heads counted as free);
   ``oracle_forward_bound_speedup`` = (k + 1) x plain / verification, the same for a proposer that is always right
   and free (``oracle_bound_speedup``: the best k's), and ``verified_row_ms``, what a verified row adds (the slope
   of the verification's time over its rows), against a plain forward: the ceiling of speculation on this host.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.engine_bench import KV_BYTES, _forward_ms, run_engine_workload
from cloud.engine.config import EngineConfig
from cloud.engine.llm_engine import LLMEngine
from shared.zoo.corpus import SourceFile, held_out_files, iter_stdlib_files, split_corpus

PROMPT, GENERATED = 64, 160


def _prompts(engine: LLMEngine, files: list[SourceFile], n: int, rng: random.Random) -> list[list[int]]:
    ids: list[int] = []
    for f in rng.sample(files, min(len(files), 2 * n)):
        ids.extend(engine.tokenizer.encode(f.text))
        if len(ids) > 400 * n:
            break
    return [ids[s : s + PROMPT] for s in (rng.randrange(0, len(ids) - PROMPT) for _ in range(n))]


def _continuations(engine: LLMEngine, prompts: list[list[int]]) -> torch.Tensor:
    out = run_engine_workload(engine, [(p, GENERATED) for p in prompts])["outputs"]
    return torch.tensor([p + o for p, o in zip(prompts, out, strict=True)])


@torch.inference_mode()
def _hf_pass(model_dir: Path, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(last hidden states [B, T, H], argmax tokens [B, T]) of a transformers model over ``x``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hidden, argmax = [], []
    for i in range(0, len(x), 16):
        out = model(x[i : i + 16], output_hidden_states=True)
        hidden.append(out.hidden_states[-1])
        argmax.append(out.logits.argmax(-1))
    return torch.cat(hidden), torch.cat(argmax)


def _walk(x: torch.Tensor, k: int, proposal_right: Any) -> float:
    """Tokens per round of greedy speculation with k proposals over the generated part of each row of ``x``;
    ``proposal_right(b, s, j)``: whether the j-th proposal (0-based) of a round whose last known token is x[b, s]
    is x[b, s + j + 1]."""
    rounds = tokens = 0
    for b in range(len(x)):
        s = PROMPT
        while s < PROMPT + GENERATED - 1 - k:
            a = 0
            while a < k and proposal_right(b, s, a):
                a += 1
            rounds += 1
            tokens += a + 1
            s += a + 1
    return tokens / rounds


class MedusaHeads(torch.nn.Module):
    """k heads: h + SiLU(W_i h + b_i) (zero-initialised, so each starts as the LM head itself), then ``lm_head``."""

    def __init__(self, k: int, lm_head: torch.Tensor) -> None:
        super().__init__()
        self.lm_head = lm_head
        blocks = [torch.nn.Linear(lm_head.shape[1], lm_head.shape[1]) for _ in range(k)]
        for block in blocks:
            torch.nn.init.zeros_(block.weight)
            torch.nn.init.zeros_(block.bias)
        self.blocks = torch.nn.ModuleList(blocks)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [N, H] -> [k, N, V]
        return torch.stack([(h + torch.nn.functional.silu(b(h))) @ self.lm_head.T for b in self.blocks])


def _train_heads(
    hidden: torch.Tensor, x: torch.Tensor, k: int, lm_head: torch.Tensor, steps: int, batch: int
) -> MedusaHeads:
    positions = range(PROMPT - 1, PROMPT + GENERATED - k - 1)
    h = torch.cat([hidden[:, t] for t in positions])
    y = torch.cat([x[:, t + 2 : t + k + 2] for t in positions])
    heads = MedusaHeads(k, lm_head)
    opt = torch.optim.AdamW(heads.blocks.parameters(), lr=2e-3, weight_decay=0.0)
    for _ in range(steps):
        idx = torch.randint(0, len(h), (batch,))
        logits = heads(h[idx])
        loss = sum(torch.nn.functional.cross_entropy(logits[i], y[idx, i]) * 0.8**i for i in range(k))
        opt.zero_grad()
        loss.backward()  # type: ignore[union-attr]
        opt.step()
    return heads


def probe(
    lm_dir: Path,
    max_k: int = 8,
    head_k: int = 4,
    head_steps: int = 300,
    seed: int = 0,
    eval_prompts: int = 64,
    train_prompts: int = 384,
) -> dict[str, Any]:
    """The draft's (and, with ``head_steps``, Medusa heads') tokens per round and the forward costs, at batch 1."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    threads = torch.get_num_threads()
    target_dir, draft_dir = lm_dir / "lm-cloud", lm_dir / "lm-draft"
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    plain = LLMEngine(EngineConfig(target_dir, kv_cache_bytes=KV_BYTES))
    train_files, _ = split_corpus(iter_stdlib_files())
    x_eval = _continuations(plain, _prompts(plain, held_out_files(), eval_prompts, rng))
    x_train = _continuations(plain, _prompts(plain, train_files, train_prompts, rng)) if head_steps else None
    _, draft_argmax = _hf_pass(draft_dir, x_eval)
    hidden_eval, target_argmax = _hf_pass(target_dir, x_eval)
    generated = slice(PROMPT - 1, PROMPT + GENERATED - 1)
    same = bool((target_argmax[:, generated] == x_eval[:, PROMPT:]).all())

    def draft_right(b: int, s: int, j: int) -> bool:  # the draft's next token after x[b, :s + j + 1]
        return bool(draft_argmax[b, s + j] == x_eval[b, s + j + 1])

    # Forward costs on the engines' own runners (the fused CPU step when it applies), at context 128.
    draft_engine = LLMEngine(EngineConfig(target_dir, draft_model_dir=draft_dir, kv_cache_bytes=KV_BYTES))
    assert draft_engine.draft_runner is not None
    plain_ms = _forward_ms(plain.runner, 1)
    verify_ms = {k: _forward_ms(plain.runner, k + 1) for k in range(1, max_k + 1)}
    draft_ms = _forward_ms(draft_engine.draft_runner, 1)
    rows: dict[str, Any] = {}
    for k in range(1, max_k + 1):
        tokens = _walk(x_eval, k, draft_right)
        cost = verify_ms[k] + k * draft_ms
        rows[str(k)] = {
            "draft_tokens_per_round": round(tokens, 3),
            "verify_ms": round(verify_ms[k], 3),
            "verify_cost_ratio": round(verify_ms[k] / plain_ms, 2),
            "draft_round_forward_ms": round(cost, 3),
            "draft_forward_bound_speedup": round(tokens * plain_ms / cost, 2),
            # every proposal right and proposing free: what no proposer can beat with k here
            "oracle_forward_bound_speedup": round((k + 1) * plain_ms / verify_ms[k], 2),
        }
    # A verified row's own cost: the least-squares slope of the verification's time over its rows (k + 1). Where it
    # is near a plain forward's, a verification is bound by its arithmetic, not by reading the weights once, and
    # speculation's ceiling is low whatever the proposer.
    ks = list(range(1, max_k + 1))
    mean_k, mean_ms = statistics.fmean(ks), statistics.fmean(verify_ms[k] for k in ks)
    spread = sum((k - mean_k) ** 2 for k in ks)
    row_ms = sum((k - mean_k) * (verify_ms[k] - mean_ms) for k in ks) / spread if spread else float("nan")
    result: dict[str, Any] = {
        "lm_dir": str(lm_dir),
        "threads": threads,
        "eval_sequences": len(x_eval),
        "prompt_tokens": PROMPT,
        "generated_tokens": GENERATED,
        "target_argmax_is_engine_greedy": same,
        "plain_forward_ms": round(plain_ms, 3),
        "draft_forward_ms": round(draft_ms, 3),
        "draft_cost_ratio": round(draft_ms / plain_ms, 3),
        "verified_row_ms": round(row_ms, 3),
        "verified_row_cost_ratio": round(row_ms / plain_ms, 2),
        "oracle_bound_speedup": max(row["oracle_forward_bound_speedup"] for row in rows.values()),
        "draft_bound_speedup": max(row["draft_forward_bound_speedup"] for row in rows.values()),
        "per_k": rows,
    }
    if x_train is not None:
        hidden_train, _ = _hf_pass(target_dir, x_train)
        from transformers import AutoModelForCausalLM

        lm_head = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).lm_head.weight.detach()
        heads = _train_heads(hidden_train, x_train, head_k, lm_head, head_steps, 1024)
        with torch.inference_mode():
            guess = heads(hidden_eval.reshape(-1, hidden_eval.shape[-1])).argmax(-1).reshape(head_k, *x_eval.shape)

        def head_right(b: int, s: int, j: int) -> bool:  # head j on the hidden state whose LM head gave x[b, s]
            return bool(guess[j, b, s - 1] == x_eval[b, s + j + 1])

        positions = range(PROMPT - 1, PROMPT + GENERATED - head_k - 1)
        accuracy = [
            float(torch.cat([guess[j, :, t] == x_eval[:, t + j + 2] for t in positions]).float().mean())
            for j in range(head_k)
        ]
        result["medusa"] = {
            "heads": head_k,
            "train_steps": head_steps,
            "train_sequences": len(x_train),
            "head_top1_accuracy": [round(a, 3) for a in accuracy],
        }
        for k in range(1, head_k + 1):
            tokens = _walk(x_eval, k, head_right)
            rows[str(k)]["medusa_tokens_per_round"] = round(tokens, 3)
            rows[str(k)]["medusa_forward_bound_speedup"] = round(tokens * plain_ms / verify_ms[k], 2)
    result["load_avg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lm-dir", type=Path, default=Path("shared/zoo/weights/demo"), help="holds lm-cloud, lm-draft")
    parser.add_argument("--max-k", type=int, default=8)
    parser.add_argument("--head-steps", type=int, default=300, help="Medusa heads' training steps (0: no heads)")
    args = parser.parse_args()
    print(json.dumps(probe(args.lm_dir, args.max_k, head_steps=args.head_steps), indent=2))


if __name__ == "__main__":
    main()

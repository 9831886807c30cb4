"""The fused C step (``FusedDecoder``) beyond one token a sequence: a speculative verification (k + 1 tokens of each
of a few sequences), a draft catching up, on randomly initialised Llama and Qwen2 checkpoints, against the torch
model's verification of the same tokens through the same paged cache and against transformers (fp32, atol 1e-4)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from cloud.engine.model_runner import FUSED_MAX_ROWS, Feed, ModelRunner

ATOL = 1e-4
BLOCK = 8
SMALL = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2}
GQA = {"num_attention_heads": 4, "num_key_value_heads": 2, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
CASES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "llama-gqa": (LlamaForCausalLM, LlamaConfig, {**GQA, "tie_word_embeddings": True}),
    "qwen2-bias": (Qwen2ForCausalLM, Qwen2Config, {**GQA, "tie_word_embeddings": False}),
}
# Three sequences of different lengths in scattered blocks, each then fed k + 1 tokens (its next token and k
# proposals) in one step.
PROMPT_LENGTHS = (21, 6, 13)
TABLES = [[20, 3, 22, 9, 24], [0, 31, 2], [10, 11, 5, 13]]


def _save(tmp_path: Path, case: str) -> tuple[Any, Path]:
    model_cls, config_cls, extra = CASES[case]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**SMALL, **extra})).eval()
    out = tmp_path / case
    model.save_pretrained(out)
    return model, out


def _runner(path: Path, fused: bool) -> ModelRunner:
    runner = ModelRunner(path, torch.device("cpu"), torch.float32, BLOCK, num_blocks=40, max_model_len=128)
    assert runner.fused_decoder is not None, "the fused decode step did not build (see the log)"
    if not fused:
        runner.fused_decoder = None
        return runner
    forward = runner.model.forward

    def prompts_only(ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        assert ids.numel() > 16, "a verification ran the torch model, not the fused step"
        return forward(ids, *args, **kwargs)

    runner.model.forward = prompts_only  # type: ignore[method-assign,assignment]
    return runner


def _verify_logits(runner: ModelRunner, prompts: list[list[int]], fed: list[list[int]]) -> torch.Tensor:
    runner.execute([Feed(t, p, 0, 1) for t, p in zip(TABLES, prompts, strict=True)])
    feeds = [Feed(t, f, len(p), len(f)) for t, p, f in zip(TABLES, prompts, fed, strict=True)]
    return runner.execute(feeds)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("k", [1, 4])
def test_a_fused_verification_gives_the_torch_models_logits_and_transformers(tmp_path: Path, case: str, k: int) -> None:
    hf, path = _save(tmp_path, case)
    gen = torch.Generator().manual_seed(k)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    fed = [torch.randint(3, 256, (k + 1,), generator=gen).tolist() for _ in PROMPT_LENGTHS]
    fused = _verify_logits(_runner(path, fused=True), prompts, fed)
    reference = _verify_logits(_runner(path, fused=False), prompts, fed)
    assert fused.shape == (len(PROMPT_LENGTHS) * (k + 1), SMALL["vocab_size"])
    torch.testing.assert_close(fused, reference, atol=ATOL, rtol=0)
    with torch.no_grad():
        rows = [hf(torch.tensor([p + f])).logits[0, len(p) :] for p, f in zip(prompts, fed, strict=True)]
    torch.testing.assert_close(fused, torch.cat(rows), atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_fused_step_writes_the_cache_a_later_step_reads(tmp_path: Path, case: str) -> None:
    """Rows of one sequence fed together leave the same K/V in the cache as the torch model: a draft catching up on
    two tokens (logits for the last only), then one more token, gives transformers' logits."""
    hf, path = _save(tmp_path, case)
    runner = _runner(path, fused=True)
    ids = torch.randint(3, 256, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    table = TABLES[0]
    runner.execute([Feed(table, ids[:20], 0, 1)])
    caught_up = runner.execute([Feed(table, ids[20:22], 20, 1)])
    step = runner.execute([Feed(table, ids[22:23], 22, 1)])
    with torch.no_grad():
        expected = hf(torch.tensor([ids[:23]])).logits[0]
    torch.testing.assert_close(caught_up[0], expected[21], atol=ATOL, rtol=0)
    torch.testing.assert_close(step[0], expected[22], atol=ATOL, rtol=0)


def test_what_the_fused_step_takes_and_refuses(tmp_path: Path) -> None:
    """Verifications of a few sequences fuse (on one thread, whatever the engine's threads); more rows than
    ``FUSED_MAX_ROWS``, a feed without logits or longer than a verification go to the torch model; bad rows are
    refused, not read out of bounds."""
    _, path = _save(tmp_path, "llama-gqa")
    runner = _runner(path, fused=True)
    assert runner.fuses([Feed([0, 1], [5] * 5, 3, 5) for _ in range(3)])
    assert not runner.fuses([Feed([0, 1], [5] * 5, 3, 5) for _ in range(FUSED_MAX_ROWS // 5 + 1)])
    assert not runner.fuses([Feed([0, 1], [5] * 5, 3, 0)])
    assert not runner.fuses([Feed([0, 1, 2], [5] * 17, 3, 17)])
    fused = runner.fused_decoder
    assert fused is not None
    assert fused.run([5, 6], [3, 4], [[0]], [0, 0], [1]).shape == (1, SMALL["vocab_size"])
    with pytest.raises(ValueError, match="sequence with a block table"):
        fused.run([5, 6], [3, 4], [[0]], [0, 1], [1])
    with pytest.raises(ValueError, match="logit rows"):
        fused.run([5, 6], [3, 4], [[0]], [0, 0], [2])
    with pytest.raises(ValueError, match="does not cover"):
        fused.run([5, 6], [7, 8], [[0]], [0, 0], [1])


@pytest.mark.parametrize("int8", [False, True], ids=["fp32", "int8"])
def test_a_token_verified_among_others_gets_the_bits_it_gets_decoded_alone(tmp_path: Path, int8: bool) -> None:
    """Greedy speculation returns exactly plain decoding's tokens only if a token's logits do not depend on how many
    rows share the step: fed 1 to 12 tokens at once (each weight read once for up to eight rows), every row's logits
    equal, bit for bit, those of the same token decoded alone; on a model whose widths are no multiple of a vector
    (72 hidden, 100 intermediate, a 250-token vocabulary: the kernel's column tails), in fp32 and int8. The fused
    step against the torch model, on the same odd widths, stays within the oracle's tolerance."""
    torch.manual_seed(0)
    odd: dict[str, Any] = {**GQA, "vocab_size": 250, "hidden_size": 72, "intermediate_size": 100}
    config = LlamaConfig(**odd, num_hidden_layers=2)
    LlamaForCausalLM(config).eval().save_pretrained(tmp_path / "odd")
    runner = ModelRunner(
        tmp_path / "odd", torch.device("cpu"), torch.float32, BLOCK, num_blocks=40, max_model_len=128, int8_weights=int8
    )
    fused = runner.fused_decoder
    assert fused is not None and fused.int8_weights == int8
    ids = torch.randint(3, 250, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    table = TABLES[0]
    runner.execute([Feed(table, ids[:20], 0, 1)])  # the prompt, through the torch model
    alone = torch.cat([fused.run([ids[p]], [p], [table]) for p in range(20, 32)])  # decoded one by one
    for rows in range(1, 13):
        together = fused.run(ids[20 : 20 + rows], list(range(20, 20 + rows)), [table], [0] * rows, list(range(rows)))
        assert torch.equal(together, alone[:rows]), f"{rows} rows at once differ from decoding them one by one"
    runner.fused_decoder = None
    reference = runner.execute([Feed(table, ids[20:32], 20, 12)])
    torch.testing.assert_close(alone, reference, atol=ATOL, rtol=0)


@pytest.mark.parametrize("int8", [False, True], ids=["fp32", "int8"])
def test_a_step_gives_the_same_bits_on_one_thread_as_on_two(tmp_path: Path, int8: bool) -> None:
    """A step takes a second thread when the host has an idle core for it (``HostLoad``) and not when it has none:
    that must not change a token. The threads split each projection's columns, never an output's sum, so a decode
    and a verification give the same logits bit for bit on one thread as on two (on the odd widths: a chunk of
    columns and a tail on each thread)."""
    torch.manual_seed(0)
    odd: dict[str, Any] = {**GQA, "vocab_size": 250, "hidden_size": 72, "intermediate_size": 100}
    LlamaForCausalLM(LlamaConfig(**odd, num_hidden_layers=2)).eval().save_pretrained(tmp_path / "odd")
    runner = ModelRunner(
        tmp_path / "odd", torch.device("cpu"), torch.float32, BLOCK, num_blocks=40, max_model_len=128, int8_weights=int8
    )
    fused = runner.fused_decoder
    assert fused is not None
    ids = torch.randint(3, 250, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    table = TABLES[0]
    runner.execute([Feed(table, ids[:20], 0, 1)])
    before = torch.get_num_threads()
    logits: dict[int, list[torch.Tensor]] = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert torch.get_num_threads() == threads
            logits[threads] = [
                fused.run([ids[20]], [20], [table]),
                fused.run(ids[20:25], list(range(20, 25)), [table], [0] * 5, list(range(5))),
                fused.run(ids[20:29], [20] * 9, [table] * 9),  # nine sequences' decodes: rows past one tile
            ]
    finally:
        torch.set_num_threads(before)
    for one, two in zip(logits[1], logits[2], strict=True):
        assert torch.equal(one, two)


@pytest.mark.parametrize("int8", [False, True], ids=["fp32", "int8"])
def test_a_drafts_greedy_proposals_in_one_call_are_its_steps_argmaxes(tmp_path: Path, int8: bool) -> None:
    """``propose_greedy`` (every draft step of a round in one C call) proposes what stepping the draft one call at a
    time and taking ``torch.argmax`` of each step's logits does, on a cache of its own (two runners, the same
    prompts), and leaves the same K/V: two sequences, one feeding one unseen token and one three, proposing 4 and 2
    tokens."""
    _, path = _save(tmp_path, "llama-gqa")
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (21, 13)]
    tables = [TABLES[0], TABLES[2]]
    unseen = [1, 3]  # tokens of each prompt the draft has not read yet
    ks = [4, 2]
    runners = []
    for _ in range(2):
        runner = ModelRunner(
            path, torch.device("cpu"), torch.float32, BLOCK, num_blocks=40, max_model_len=128, int8_weights=int8
        )
        assert runner.fused_decoder is not None and runner.fused_decoder.greedy_fn is not None
        for table, prompt, u in zip(tables, prompts, unseen, strict=True):
            runner.execute([Feed(table, prompt[:-u], 0, 1)])
        runners.append(runner)
    stepped = runners[1].fused_decoder
    assert stepped is not None
    expected: list[list[int]] = []
    for table, prompt, u, k in zip(tables, prompts, unseen, ks, strict=True):
        tokens, ids, pos = [], prompt[-u:], len(prompt) - u
        for _ in range(k):
            logits = stepped.run(ids, list(range(pos, pos + len(ids))), [table], [0] * len(ids), [len(ids) - 1])
            tokens.append(int(torch.argmax(logits[0])))
            pos, ids = pos + len(ids), [tokens[-1]]
        expected.append(tokens)
    feeds = [Feed(t, p[-u:], len(p) - u, 1) for t, p, u in zip(tables, prompts, unseen, strict=True)]
    assert runners[0].propose_greedy(feeds, ks) == expected
    # and it wrote the K/V the steps did, at the same positions (all but each sequence's last proposal)
    assert torch.equal(runners[0].kv_cache, runners[1].kv_cache)


def test_a_step_of_a_prompt_and_decodes_runs_each_part_on_its_path(tmp_path: Path) -> None:
    """Continuous batching: a step with a prompt (more tokens than a fused feed takes) beside sequences decoding runs
    the prompt through the torch model and the decodes fused, and returns every feed's logits in feed order — the
    logits each part gives run alone."""
    _, path = _save(tmp_path, "llama-gqa")
    runners = [_runner(path, fused=True), _runner(path, fused=True)]
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (21, 6, 13)]
    for runner in runners:
        for table, prompt in zip(TABLES[1:], prompts[1:], strict=True):
            runner.execute([Feed(table, prompt, 0, 1)])
    decodes = [Feed(TABLES[1], [7], len(prompts[1]), 1), Feed(TABLES[2], [9, 11], len(prompts[2]), 2)]
    long_prompt = Feed(TABLES[0], prompts[0], 0, 1)
    mixed = runners[0].execute([decodes[0], long_prompt, decodes[1]])  # the prompt between the decodes
    assert mixed.shape == (4, SMALL["vocab_size"])
    alone_prompt = runners[1].execute([long_prompt])
    alone_decodes = runners[1].execute(decodes)
    assert torch.equal(mixed[0], alone_decodes[0]) and torch.equal(mixed[2:], alone_decodes[1:])
    assert torch.equal(mixed[1], alone_prompt[0])

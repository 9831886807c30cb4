"""The batched grammar masks of the cloud engine's sampler: filled for a whole batch into one reused bitmask
buffer (on a thread, while the forward runs), unpacked in one vectorised op and applied to the constrained rows
only. They must be exactly each sequence's own mask, and decoding must pick exactly what it picked one sequence at
a time."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cloud.engine import LLM, SamplingParams
from cloud.engine.model_config import ModelConfig
from cloud.engine.sampler import Sampler
from cloud.engine.sequence import Sequence
from cloud.engine.tokenizer import ChatTokenizer
from shared.errors import ValidationError
from shared.openai_schema import ResponseFormat
from shared.structured import Constraint, GrammarTokenizer, fill_bitmasks, forbidden_of, grammar_of
from shared.zoo.registry import ZooLayout

PET = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _grammar(fmt: dict[str, object]) -> str:
    grammar = grammar_of(ResponseFormat.model_validate(fmt))
    assert grammar is not None
    return grammar


GRAMMARS = [
    _grammar({"type": "json_schema", "json_schema": {"name": "Pet", "schema": PET}}),
    _grammar({"type": "choice", "choice": ["cat", "dog", "goldfish"]}),
    _grammar({"type": "regex", "regex": "[0-9]{2,6}-[a-z]{1,4}"}),
]


@pytest.fixture(scope="module")
def lm_dir(tiny_zoo: Path) -> Path:
    return ZooLayout(tiny_zoo).artifact_dir("lm-cloud")


@pytest.fixture(scope="module")
def grammar_tokenizer(lm_dir: Path) -> GrammarTokenizer:
    config = ModelConfig.from_dir(lm_dir)
    return GrammarTokenizer(ChatTokenizer(lm_dir), config.vocab_size, config.eos_token_ids)


def _seq(seq_id: int, constraint: Constraint | None) -> Sequence:
    seq = Sequence(
        seq_id=seq_id,
        request_id=f"r{seq_id}",
        token_ids=[0],
        num_prompt_tokens=1,
        params=SamplingParams(temperature=0.0),
        arrival_time=0.0,
    )
    seq.constraint = constraint
    return seq


def test_batched_bitmasks_are_each_sequences_own_mask_at_every_step(grammar_tokenizer: GrammarTokenizer) -> None:
    vocab = grammar_tokenizer.vocab_size
    constraints = [grammar_tokenizer.constraint(g) for g in GRAMMARS]
    bits = np.zeros((len(constraints), constraints[0].num_words), dtype=np.int32)
    rng = np.random.default_rng(7)
    steps = 0
    while any(not c.done for c in constraints) and steps < 40:
        live = [c for c in constraints if not c.done]
        fill_bitmasks(live, bits)
        batched = ~forbidden_of(bits[: len(live)], grammar_tokenizer.eos_token_ids)[:, :vocab]
        own = np.stack([c.mask(vocab) for c in live])
        assert (batched == own).all(), f"step {steps}: the batched masks differ from the per-sequence ones"
        for c, allowed in zip(live, own, strict=True):
            c.accept(int(rng.choice(np.flatnonzero(allowed))))  # a random path the grammar allows
        steps += 1
    assert steps >= 3 and all(c.done for c in constraints[1:]), "the walk should reach the end of the short grammars"


def test_a_row_that_allows_nothing_allows_only_the_eos_ids() -> None:
    forbidden = forbidden_of(np.array([[0, 0], [-1, 0]], dtype=np.int32), [2, 40])
    assert np.flatnonzero(~forbidden[0]).tolist() == [2, 40]
    assert np.flatnonzero(~forbidden[1]).tolist() == list(range(32))  # a row that allows something is as it is


def test_the_sampler_masks_constrained_rows_only_and_the_background_masks_equal_inline(
    grammar_tokenizer: GrammarTokenizer,
) -> None:
    vocab = grammar_tokenizer.vocab_size
    sampler = Sampler(torch.device("cpu"))
    seqs = [
        _seq(0, grammar_tokenizer.constraint(GRAMMARS[0])),
        _seq(1, None),
        _seq(2, grammar_tokenizer.constraint(GRAMMARS[1])),
        _seq(3, None),
    ]
    logits = torch.randn(len(seqs), vocab, generator=torch.Generator().manual_seed(3))
    before = logits.clone()
    for _ in range(3):  # the bitmask buffer is reused from step to step
        masks = sampler.prepare_masks(seqs, background=True)  # on the mask thread, as beside a forward
        assert masks is not None and masks.rows == [0, 2]
        background = sampler.constrain(logits, seqs, masks)
        inline = sampler.constrain(logits, seqs)
        assert torch.equal(background, inline)
        assert torch.equal(logits, before), "the caller's logits are not modified"
        for i, seq in enumerate(seqs):
            if seq.constraint is None:
                assert torch.equal(background[i], logits[i])
            else:
                allowed = torch.from_numpy(seq.constraint.mask(vocab))
                assert torch.equal(background[i], logits[i].masked_fill(~allowed, float("-inf")))
        tokens = sampler.sample(logits, seqs, sampler.prepare_masks(seqs))
        for seq, token in zip(seqs, tokens, strict=True):
            if seq.constraint is not None:
                seq.constraint.accept(token)
    assert sampler.prepare_masks([_seq(9, None)]) is None


def test_mixed_batches_decode_as_each_request_alone(lm_dir: Path) -> None:
    """Constrained and free requests in the same steps (masks computed beside the forward) give, at greedy, what
    each gives decoded on its own."""
    llm = LLM(lm_dir, kv_cache_bytes=16 << 20)
    prompts = ['{"name":"Rex","age":3}\n', "def f():", "pets: ", "x = [", "1234-abc 99-"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, grammar=GRAMMARS[0]),
        SamplingParams(temperature=0.0, max_tokens=24),
        SamplingParams(temperature=0.0, max_tokens=40, grammar=GRAMMARS[1]),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, grammar=GRAMMARS[2]),
    ]
    alone = [llm.generate(p, sp)[0].token_ids for p, sp in zip(prompts, params, strict=True)]
    together = llm.generate(prompts, params)
    assert [o.token_ids for o in together] == alone
    assert together[2].text in ("cat", "dog", "goldfish") and together[2].finish_reason == "stop"
    assert together[0].finish_reason in ("stop", "length")


def test_matchers_of_one_compiled_grammar_move_independently(grammar_tokenizer: GrammarTokenizer) -> None:
    vocab = grammar_tokenizer.vocab_size
    first = grammar_tokenizer.constraint(GRAMMARS[1])
    start = first.mask(vocab)
    token = int(np.flatnonzero(start)[0])
    first.accept(token)
    second = grammar_tokenizer.constraint(GRAMMARS[1])  # copied from the compiled grammar, not from ``first``
    assert (second.mask(vocab) == start).all() and not (first.mask(vocab) == start).all()
    second.accept(token)
    assert (second.mask(vocab) == first.mask(vocab)).all()
    with pytest.raises(ValidationError, match="response_format"):
        grammar_tokenizer.constraint("start: (")  # a grammar that does not compile is still a 400, cached or not

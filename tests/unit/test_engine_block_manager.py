"""The paged KV block manager: allocation accounting, the salted prefix cache, LRU eviction, sharing, trimming."""

from __future__ import annotations

import pytest

from cloud.engine.block_manager import BlockManager
from cloud.engine.sampling_params import SamplingParams
from cloud.engine.sequence import Sequence

BLOCK_SIZE = 4


def make_seq(seq_id: int, token_ids: list[int], cache_salt: str | None = None) -> Sequence:
    return Sequence(
        seq_id=seq_id,
        request_id=f"req-{seq_id}",
        token_ids=list(token_ids),
        num_prompt_tokens=len(token_ids),
        params=SamplingParams(),
        arrival_time=float(seq_id),
        cache_salt=cache_salt,
    )


def tokens(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def compute_prompt(bm: BlockManager, seq: Sequence) -> int:
    """Admit ``seq`` as the scheduler does (cached prefix, then blocks for the rest), mark it computed and
    publish its full blocks; returns the tokens the cache covered."""
    cached = bm.allocate_cached_prefix(seq)
    seq.num_computed_tokens = cached
    bm.allocate(seq, seq.num_tokens - cached)
    seq.num_computed_tokens = seq.num_tokens
    bm.register_full_blocks(seq)
    return cached


# -- allocation accounting --------------------------------------------------------------------------------------
def test_allocate_takes_ceil_blocks_and_free_returns_them_all() -> None:
    bm = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    a, b = make_seq(0, tokens(0, 10)), make_seq(1, tokens(100, 4))
    bm.allocate(a, 10)
    bm.allocate(b, 4)
    assert len(a.block_table) == 3
    assert len(b.block_table) == 1
    assert not set(a.block_table) & set(b.block_table)
    assert bm.num_free_blocks == 4
    assert bm.usage() == pytest.approx(0.5)

    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == bm.num_blocks
    assert a.block_table == [] and b.block_table == []
    assert all(block.ref_count == 0 for block in bm.blocks)


def test_allocate_grows_the_table_only_by_what_new_tokens_need() -> None:
    bm = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    seq = make_seq(0, tokens(0, 5))
    bm.allocate(seq, 5)
    first = list(seq.block_table)
    seq.num_computed_tokens = 5
    bm.allocate(seq, 3)  # 8 tokens still fit in two blocks
    assert seq.block_table == first
    bm.allocate(seq, 4)  # 9 tokens need a third
    assert seq.block_table[:2] == first and len(seq.block_table) == 3


def test_allocating_more_than_is_free_raises_and_can_allocate_says_so() -> None:
    bm = BlockManager(num_blocks=2, block_size=BLOCK_SIZE)
    seq = make_seq(0, tokens(0, 9))
    assert not bm.can_allocate(seq, 9)
    assert bm.can_allocate(seq, 8)
    assert not bm.can_allocate(seq, 8, reserve=1)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate(seq, 9)
    assert bm.num_free_blocks == 2


def test_freeing_the_same_blocks_twice_asserts() -> None:
    bm = BlockManager(num_blocks=4, block_size=BLOCK_SIZE)
    seq = make_seq(0, tokens(0, 8))
    bm.allocate(seq, 8)
    table = list(seq.block_table)
    bm.free(seq)
    seq.block_table = table
    with pytest.raises(AssertionError, match="freed twice"):
        bm.free(seq)


def test_block_manager_rejects_empty_geometry() -> None:
    with pytest.raises(ValueError, match="positive"):
        BlockManager(num_blocks=0, block_size=BLOCK_SIZE)
    with pytest.raises(ValueError, match="positive"):
        BlockManager(num_blocks=4, block_size=0)


# -- prefix cache -----------------------------------------------------------------------------------------------
def test_same_prompt_and_salt_reuses_the_cached_full_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    prompt = tokens(0, 10)
    first = make_seq(0, prompt, cache_salt="tenant-a")
    assert compute_prompt(bm, first) == 0

    second = make_seq(1, prompt, cache_salt="tenant-a")
    assert bm.allocate_cached_prefix(second) == 8
    assert second.block_table == first.block_table[:2]
    assert [bm.blocks[b].ref_count for b in second.block_table] == [2, 2]
    assert bm.num_hit_tokens == 8
    assert bm.num_queried_tokens == 20
    assert bm.prefix_cache_hit_rate() == pytest.approx(8 / 20)


def test_cached_blocks_are_found_after_the_first_sequence_is_freed() -> None:
    bm = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    prompt = tokens(0, 12)
    first = make_seq(0, prompt)
    compute_prompt(bm, first)
    table = list(first.block_table)
    bm.free(first)
    assert bm.num_free_blocks == 8

    second = make_seq(1, [*prompt, 99])
    assert bm.allocate_cached_prefix(second) == 12
    assert second.block_table == table
    assert bm.num_free_blocks == 5  # cached free blocks leave the free queue while in use


def test_a_different_salt_never_hits_another_tenants_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    prompt = tokens(0, 12)
    compute_prompt(bm, make_seq(0, prompt, cache_salt="tenant-a"))

    other = make_seq(1, prompt, cache_salt="tenant-b")
    unsalted = make_seq(2, prompt)
    assert bm.allocate_cached_prefix(other) == 0
    assert bm.allocate_cached_prefix(unsalted) == 0
    assert other.block_table == [] and unsalted.block_table == []
    assert bm.num_hit_tokens == 0


def test_a_different_first_block_misses_even_if_later_blocks_match() -> None:
    bm = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    compute_prompt(bm, make_seq(0, tokens(0, 12)))
    changed = make_seq(1, [999, *tokens(1, 11)])
    assert bm.allocate_cached_prefix(changed) == 0


def test_a_fully_cached_prompt_still_leaves_a_token_to_compute() -> None:
    bm = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    prompt = tokens(0, 8)  # exactly two full blocks
    compute_prompt(bm, make_seq(0, prompt))

    again = make_seq(1, prompt)
    cached = bm.allocate_cached_prefix(again)
    assert cached == 4
    assert again.num_tokens - cached >= 1
    assert len(again.block_table) == 1


def test_prefix_caching_disabled_never_hits() -> None:
    bm = BlockManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    prompt = tokens(0, 12)
    compute_prompt(bm, make_seq(0, prompt))
    assert bm.allocate_cached_prefix(make_seq(1, prompt)) == 0
    assert bm.prefix_cache_hit_rate() == 0.0


def test_reset_prefix_cache_forgets_every_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    prompt = tokens(0, 12)
    compute_prompt(bm, make_seq(0, prompt))
    bm.reset_prefix_cache()
    assert bm.allocate_cached_prefix(make_seq(1, prompt)) == 0


def test_only_fully_computed_blocks_are_published() -> None:
    bm = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    prompt = tokens(0, 12)
    seq = make_seq(0, prompt)
    bm.allocate(seq, 12)
    seq.num_computed_tokens = 6  # a chunked prefill halfway through the second block
    bm.register_full_blocks(seq)
    assert bm.allocate_cached_prefix(make_seq(1, prompt)) == 4


def test_hit_rate_never_exceeds_one_when_a_preempted_sequence_returns() -> None:
    bm = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    seq = make_seq(0, tokens(0, 4))
    compute_prompt(bm, seq)
    seq.token_ids += tokens(50, 9)  # 9 generated tokens, 8 of them computed
    bm.allocate(seq, 9)
    seq.num_computed_tokens = 12
    bm.register_full_blocks(seq)
    bm.free(seq)  # preempted by recompute
    seq.num_computed_tokens = 0

    bm.allocate_cached_prefix(seq)
    assert 0.0 <= bm.prefix_cache_hit_rate() <= 1.0


# -- LRU eviction -----------------------------------------------------------------------------------------------
def test_free_blocks_are_reused_least_recently_freed_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=BLOCK_SIZE)
    old, new = make_seq(0, tokens(0, 8)), make_seq(1, tokens(100, 8))
    compute_prompt(bm, old)
    compute_prompt(bm, new)
    old_blocks = list(old.block_table)
    bm.free(old)
    bm.free(new)

    filler = make_seq(2, tokens(200, 8))
    bm.allocate(filler, 8)
    assert sorted(filler.block_table) == sorted(old_blocks)
    assert bm.allocate_cached_prefix(make_seq(3, [*tokens(100, 8), 7])) == 8
    assert bm.allocate_cached_prefix(make_seq(4, [*tokens(0, 8), 7])) == 0


def test_a_reused_block_loses_its_hash() -> None:
    bm = BlockManager(num_blocks=2, block_size=BLOCK_SIZE)
    prompt = tokens(0, 8)
    first = make_seq(0, prompt)
    compute_prompt(bm, first)
    bm.free(first)

    other = make_seq(1, tokens(100, 8))
    bm.allocate(other, 8)  # takes both cached blocks
    assert all(bm.blocks[b].hash is None for b in other.block_table)
    bm.free(other)
    assert bm.allocate_cached_prefix(make_seq(2, [*prompt, 7])) == 0


def test_the_end_of_a_prompt_is_evicted_before_its_beginning() -> None:
    bm = BlockManager(num_blocks=3, block_size=BLOCK_SIZE)
    prompt = tokens(0, 12)
    first = make_seq(0, prompt)
    compute_prompt(bm, first)
    head, middle, tail = first.block_table
    bm.free(first)

    one = make_seq(1, tokens(100, 4))
    bm.allocate(one, 4)
    assert one.block_table == [tail]
    probe = make_seq(2, [*prompt, 7])
    assert bm.allocate_cached_prefix(probe) == 8
    bm.free(probe)

    two = make_seq(3, tokens(200, 4))
    bm.allocate(two, 4)
    assert two.block_table == [middle]
    probe = make_seq(4, [*prompt, 7])
    assert bm.allocate_cached_prefix(probe) == 4
    assert probe.block_table == [head]


# -- sharing and trimming ---------------------------------------------------------------------------------------
def test_share_counts_references_and_blocks_return_only_when_both_are_freed() -> None:
    bm = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    parent = make_seq(0, tokens(0, 10))
    compute_prompt(bm, parent)
    child = make_seq(1, tokens(0, 10))
    bm.share(parent, child, 2)
    assert child.block_table == parent.block_table[:2]
    assert [bm.blocks[b].ref_count for b in parent.block_table] == [2, 2, 1]
    assert bm.num_free_blocks == 5

    bm.free(parent)
    assert [bm.blocks[b].ref_count for b in child.block_table] == [1, 1]
    assert bm.num_free_blocks == 6
    bm.free(child)
    assert bm.num_free_blocks == 8
    assert all(block.ref_count == 0 for block in bm.blocks)


def test_trim_frees_blocks_reserved_for_rejected_speculative_tokens() -> None:
    bm = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    seq = make_seq(0, tokens(0, 8))
    compute_prompt(bm, seq)
    seq.token_ids.append(42)
    bm.allocate(seq, 1 + 4)  # the last token plus four proposals: 13 tokens, four blocks
    assert len(seq.block_table) == 4
    kept = seq.block_table[:3]

    seq.num_computed_tokens = 8 + 1 + 1  # one proposal accepted
    bm.trim(seq)
    assert seq.block_table == kept
    assert bm.num_free_blocks == 5

    seq.num_computed_tokens = 8
    bm.trim(seq)
    assert seq.block_table == kept[:2]
    bm.free(seq)
    assert bm.num_free_blocks == 8

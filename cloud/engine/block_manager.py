"""Paged KV blocks: allocation, reference counts and the hash-chained prefix cache (pure Python)."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from cloud.engine.sequence import Sequence


def block_hash(parent: bytes | None, token_ids: list[int], salt: str | None) -> bytes:
    """Hash of one full block, chained to its parent so a hit implies the whole prefix matches.

    The salt (the tenant by default) enters the first block, so two tenants never share a cache entry and
    cannot time each other's prompts (the side channel behind vLLM's CVE-2025-46570).
    """
    h = hashlib.blake2b(digest_size=16)
    if parent is None:
        h.update(b"salt:" + (salt or "").encode() + b"\x00")
    else:
        h.update(parent)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None


class BlockManager:
    """Fixed-size KV blocks shared by all sequences.

    Free blocks sit in an LRU queue; a free block that still holds a cached full block keeps its hash until it
    is reused, so a later request with the same prefix (and salt) finds it again. Blocks are freed tail-first
    so the end of a prompt is evicted before its beginning.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self.num_hit_tokens = 0
        self.num_queried_tokens = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------------------------------
    def _full_block_hashes(self, seq: Sequence) -> list[bytes]:
        hashes: list[bytes] = []
        parent: bytes | None = None
        bs = self.block_size
        for i in range(seq.num_tokens // bs):
            parent = block_hash(parent, seq.token_ids[i * bs : (i + 1) * bs], seq.cache_salt)
            hashes.append(parent)
        return hashes

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks holding the longest cached prefix of a sequence without blocks (no side effects).

        At least one token is always left to compute, since its logits are needed to sample. A sequence
        preempted earlier finds its own output blocks again if they were not evicted meanwhile.
        """
        assert not seq.block_table, "sequence already has blocks"
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for h in self._full_block_hashes(seq):
            block_id = self._cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        if hits and len(hits) * self.block_size >= seq.num_tokens:
            hits.pop()
        return hits

    def num_free_among(self, block_ids: list[int]) -> int:
        """How many of these (cached) blocks sit in the free queue, i.e. taking them uses up free blocks."""
        return sum(1 for b in block_ids if self.blocks[b].ref_count == 0)

    def allocate_cached_prefix(self, seq: Sequence, hits: list[int] | None = None) -> int:
        """Give a sequence without blocks its cached prefix blocks (``hits`` from ``find_cached_prefix``);
        returns the tokens they cover. Hit-rate counters count each request's prompt once, at first admission.
        """
        if hits is None:
            hits = self.find_cached_prefix(seq)
        for block_id in hits:
            self._take(block_id)
        seq.block_table.extend(hits)
        if self.enable_prefix_caching:
            seq.block_hashes = self._full_block_hashes(seq)[: len(hits)]
        num = len(hits) * self.block_size
        if self.enable_prefix_caching and seq.num_preemptions == 0:
            self.num_queried_tokens += seq.num_prompt_tokens
            self.num_hit_tokens += min(num, seq.num_prompt_tokens)
        return num

    def register_full_blocks(self, seq: Sequence) -> None:
        """Publish the blocks that are now fully computed so later requests can reuse them: those whose tokens
        are all computed and in ``seq.token_ids`` (a step counts accepted proposals computed before the engine
        appends them; a block hashed then would be hashed over fewer tokens than it holds, and never match)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(min(seq.num_computed_tokens, len(seq.token_ids)) // bs, len(seq.block_table))
        while len(seq.block_hashes) < num_full:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(block_hash(parent, seq.token_ids[i * bs : (i + 1) * bs], seq.cache_salt))
        for i in range(num_full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                h = seq.block_hashes[i]
                if h not in self._cached:
                    block.hash = h
                    self._cached[h] = block.block_id

    def reset_prefix_cache(self) -> None:
        for h, block_id in list(self._cached.items()):
            self.blocks[block_id].hash = None
            del self._cached[h]

    # -- allocation ---------------------------------------------------------------------------------------------
    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            del self._cached[block.hash]
            block.hash = None
        block.ref_count = 1
        return block_id

    def can_allocate(self, seq: Sequence, num_new_tokens: int, reserve: int = 0) -> bool:
        """Whether ``num_new_tokens`` more tokens fit, keeping ``reserve`` blocks free for running sequences."""
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return need <= self.num_free_blocks - reserve

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Extend the block table to hold ``num_computed_tokens + num_new_tokens`` tokens."""
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need > self.num_free_blocks:
            raise RuntimeError("out of KV blocks; the scheduler should have preempted")
        for _ in range(need):
            seq.block_table.append(self._pop_free())

    def share(self, parent: Sequence, child: Sequence, num_blocks: int) -> None:
        """Let ``child`` reuse the first ``num_blocks`` of ``parent`` (n > 1 shares the prompt's full blocks)."""
        for block_id in parent.block_table[:num_blocks]:
            self._take(block_id)
            child.block_table.append(block_id)

    def trim(self, seq: Sequence) -> None:
        """Free blocks beyond what ``num_computed_tokens`` needs (after rejected speculative tokens)."""
        keep = self.blocks_needed(seq.num_computed_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table.clear()
        seq.block_hashes.clear()

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            self._free[block_id] = None

    def prefix_cache_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

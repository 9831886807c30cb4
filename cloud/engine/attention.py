"""Paged attention in plain torch: K/V written to cache slots, read back through block tables.

Tokens of one step are laid out flat ([T, ...]) and split into groups. A group is either several
sequences feeding the same small number of tokens each (decodes, Q = 1; speculative verification,
Q = k + 1), computed as one batched attention over their gathered blocks, or one sequence's prefill
chunk. A chunk whose whole context is new needs no gather and runs as plain causal attention.

A batched group is padded to its longest context, so sequences of very different lengths are split into
groups of similar lengths (``split_by_context``) when the padding saved outweighs a group's fixed cost. On CPU in
fp32 a batched group is instead computed by ``cpu_kernels``' kernel, which reads each sequence's blocks in place:
no gather, no padding (and so no split).

A layer may attend only the last ``window`` positions (sliding-window attention; 0: the whole context) and
soft-cap its attention logits (``cap * tanh(s / cap)``, Gemma 2; 0: off). SDPA has no soft-capping, so a capped
layer's scores are computed explicitly, as transformers' eager attention does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F  # noqa: N812 (the torch convention)

from cloud.engine.cpu_kernels import PagedAttention


@dataclass(slots=True)
class AttentionGroup:
    start: int
    num_seqs: int
    q_len: int
    block_tables: torch.Tensor | None  # [B, max_blocks] (None when is_fresh)
    mask: torch.Tensor | None  # [B, 1, Q, L] bool: True = attend (None when is_fresh or for the kernel)
    is_fresh: bool
    context_lens: torch.Tensor | None = None  # [B] (for the kernel)
    query_pos: torch.Tensor | None = None  # [B, Q] each query's position (for windowed masks)
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> mask, built once a step

    def windowed_mask(self, window: int) -> torch.Tensor | None:
        """``mask`` narrowed to each query's last ``window`` positions (itself included)."""
        if window <= 0 or self.mask is None:
            return self.mask
        if window not in self.window_masks:
            assert self.query_pos is not None
            key_pos = torch.arange(self.mask.shape[-1], device=self.mask.device)
            recent = key_pos[None, None, :] > self.query_pos[:, :, None] - window  # [B, Q, L]
            self.window_masks[window] = self.mask & recent[:, None]
        return self.window_masks[window]

    @property
    def end(self) -> int:
        return self.start + self.num_seqs * self.q_len


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache slot of each new token
    groups: list[AttentionGroup]
    kernel: PagedAttention | None = None  # batched groups read the cache in place (``cpu_kernels``)


def cache_slots(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """The flat cache slots of a sequence's positions ``start .. end`` through its block table."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def build_group(
    start: int,
    q_len: int,
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    for_kernel: bool = False,
) -> AttentionGroup:
    """A group of sequences each feeding ``q_len`` tokens that end their contexts of ``context_lens``; for the
    in-place kernel (``for_kernel``) with the context lengths instead of a mask."""
    if len(context_lens) == 1 and context_lens[0] == q_len:
        return AttentionGroup(start, 1, q_len, None, None, True)
    max_blocks = max(-(-c // block_size) for c in context_lens)
    # One tensor from padded lists: a tensor per table cost a decode step of 64 sequences 64 small allocations.
    tables = torch.tensor(
        [table[:max_blocks] + [0] * (max_blocks - len(table[:max_blocks])) for table in block_tables], dtype=torch.long
    )
    ctx = torch.tensor(context_lens, dtype=torch.long)
    if for_kernel:
        return AttentionGroup(start, len(context_lens), q_len, tables.to(device), None, False, ctx.to(device))
    key_pos = torch.arange(max_blocks * block_size)  # [L]
    query_pos = ctx[:, None] - q_len + torch.arange(q_len)[None, :]  # [B, Q]
    mask = key_pos[None, None, :] <= query_pos[:, :, None]  # [B, Q, L]
    return AttentionGroup(
        start, len(context_lens), q_len, tables.to(device), mask[:, None].to(device), False, None, query_pos.to(device)
    )


def split_by_context(num_blocks: list[int], group_cost_blocks: float, max_points: int = 48) -> list[list[int]]:
    """Partition sequences (given each one's context in blocks) into groups that minimise the padded work,
    ``sum(len(group) * max(group)) + group_cost_blocks * len(groups)``: a batched attention gathers and attends
    every sequence of a group over the group's longest context, and each group costs a fixed number of op
    launches, expressed in blocks of padded work. Returns groups of indices into ``num_blocks``, longest last.

    Exact dynamic programme over the sorted lengths, with split points only where the length changes; when
    there are more than ``max_points`` distinct lengths, lengths are rounded up to ``max_points`` levels for
    the choice of split points only."""
    n = len(num_blocks)
    order = sorted(range(n), key=num_blocks.__getitem__)
    if n < 2:
        return [order] if order else []
    lengths = [num_blocks[i] for i in order]
    step = max(1, -(-lengths[-1] // max_points))
    levels = [-(-b // step) for b in lengths]
    ends = [j for j in range(1, n + 1) if j == n or levels[j] != levels[j - 1]]  # a group may end after j items
    best = {0: 0.0}
    cut = {0: 0}
    starts = [0]
    for j in ends:
        padded = lengths[j - 1]
        best[j], cut[j] = min((best[i] + group_cost_blocks + (j - i) * padded, i) for i in starts)
        starts.append(j)
    groups: list[list[int]] = []
    j = n
    while j:
        i = cut[j]
        groups.append(order[i:j])
        j = i
    groups.reverse()
    return groups


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D]; caches: [num_blocks, block_size, KVH, D]. Returns [T, H, D]. ``window``:
    each query attends its last ``window`` positions only (0: all); ``softcap``: attention logits soft-capped."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    flat_k = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_v = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_k.index_copy_(0, meta.slot_mapping, k)
    flat_v.index_copy_(0, meta.slot_mapping, v)
    num_heads = q.shape[1]
    if len(meta.groups) == 1 and meta.groups[0].end == q.shape[0]:
        return _group_attention(
            q, k, v, k_cache, v_cache, meta.groups[0], scale, num_heads, meta.kernel, window, softcap
        )
    out = torch.empty_like(q)
    for g in meta.groups:
        out[g.start : g.end] = _group_attention(
            q[g.start : g.end],
            k[g.start : g.end],
            v[g.start : g.end],
            k_cache,
            v_cache,
            g,
            scale,
            num_heads,
            meta.kernel,
            window,
            softcap,
        )
    return out


def _group_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    g: AttentionGroup,
    scale: float,
    num_heads: int,
    kernel: PagedAttention | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    head_dim = q.shape[-1]
    if g.is_fresh and ((window and window < g.q_len) or softcap):
        positions = torch.arange(g.q_len, device=q.device)
        mask = positions[None, :] <= positions[:, None]  # [Q, L]
        if window:
            mask &= positions[None, :] > positions[:, None] - window
        o = _attend(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, scale, softcap)
        return o[0].transpose(0, 1)
    if g.is_fresh:
        # One sequence, whole context new: [1, H, Q, D] against its own K/V.
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )
        return o[0].transpose(0, 1)
    assert g.block_tables is not None
    if g.context_lens is not None and kernel is not None:
        return kernel(q, k_cache, v_cache, g.block_tables, g.context_lens, g.q_len, scale, window, softcap)
    b, nb = g.block_tables.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    # index_select on the flat table is ~2x faster on CPU than advanced indexing with the 2-D table.
    flat = g.block_tables.view(-1)
    keys = (
        k_cache.index_select(0, flat).view(b, nb * block_size, num_kv_heads, head_dim).transpose(1, 2)
    )  # [B, KVH, L, D]
    values = v_cache.index_select(0, flat).view(b, nb * block_size, num_kv_heads, head_dim).transpose(1, 2)
    queries = q.view(b, g.q_len, num_heads, head_dim).transpose(1, 2)  # [B, H, Q, D]
    o = _attend(queries, keys, values, g.windowed_mask(window), scale, softcap)
    return o.transpose(1, 2).reshape(b * g.q_len, num_heads, head_dim)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, softcap: float
) -> torch.Tensor:
    """q: [B, H, Q, D]; k, v: [B, KVH, L, D]; mask broadcastable to [B, H, Q, L], True = attend. SDPA, or with
    ``softcap`` the scores written out: scaled, capped, masked, softmax in fp32 (transformers' eager order)."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.tanh((q @ k.transpose(-1, -2)) * scale / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v

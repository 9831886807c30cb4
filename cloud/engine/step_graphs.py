"""Decode and verification steps replayed from captured CUDA graphs.

A decode step of a small model on a GPU is bound by launching its kernels (~30 a layer), not by computing them; a
verification of k + 1 tokens a sequence launches the same kernels. vLLM and SGLang capture such steps as CUDA graphs
and replay them: one launch a step. ``StepGraphs`` does that for the engine's torch model: a step whose feeds all
feed the same number of tokens Q (1: a decode; k + 1: a verification of k proposals), at most ``block_size``, runs
padded to a captured shape — the sequences to a bucket (``SEQ_BUCKETS``), each context to a power of two of blocks —
on static input tensors that every step overwrites (one host-to-device copy), and the graph's hidden states come back
for the rows the feeds want logits for (the LM head runs outside the graph, on those rows only: a graph's output
stays [rows, hidden], not [rows, vocab]). Everything a step computes from its inputs (rotary factors, the attention
mask, each layer's window) is inside the graph, recomputed at every replay from the static tensors.

Padding rows are whole dummy sequences of Q tokens (token 0 at positions 0 .. Q - 1) in the ``pad_block``, a KV
block no sequence owns (the runner allocates one past the block manager's): they write their K/V there, attend only
it, and their values stay finite, so a real sequence's table padded with the pad block (masked out) multiplies
finite values by zero. A real sequence's rows compute exactly what the padded torch path computes for them.

A shape is captured the first time a step takes it (after two warm-up runs on a side stream), up to ``MAX_GRAPHS``
shapes; a step of another shape, or once that many are held, runs eagerly. Models whose forward reads a tensor's
value on the host (dynamic NTK RoPE) are not captured. With ``capture`` False (no CUDA) the same padded step runs
eagerly: what the tests check against transformers on CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from cloud.engine.attention import AttentionGroup, AttentionMetadata, cache_slots

if TYPE_CHECKING:
    from cloud.engine.model import CausalLM


class Feed(Protocol):
    """What a step feeds for one sequence (``model_runner.Feed``, which imports this module)."""

    @property
    def block_table(self) -> list[int]: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def start(self) -> int: ...
    @property
    def num_logits(self) -> int: ...


SEQ_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MAX_GRAPHS = 64  # captured shapes held at once (each keeps its static tensors; the graphs share one memory pool)


def supports(model: CausalLM) -> bool:
    """Whether ``model``'s forward can be captured: nothing in it reads a tensor's value on the host."""
    rotary = model.rotary
    return rotary is None or rotary.rope_type != "dynamic"


@dataclass(slots=True)
class _Shape:
    num_seqs: int  # padded (a ``SEQ_BUCKETS`` entry)
    q_len: int
    num_blocks: int  # blocks of every (padded) table: a power of two
    inputs: torch.Tensor  # int64 [4 * rows + num_seqs + num_seqs * num_blocks]: every input, one copy a step
    hidden: torch.Tensor | None = None  # the forward's output [rows, hidden], static once captured
    graph: torch.cuda.CUDAGraph | None = None

    @property
    def rows(self) -> int:
        return self.num_seqs * self.q_len


class StepGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        pad_block: int,
        max_blocks: int,
        max_seqs: int,
        capture: bool,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.pad_block = pad_block
        self.max_blocks = max_blocks  # blocks of the longest sequence the engine serves
        # the largest bucket captured: the engine's max_num_seqs, rounded up to a bucket
        self.max_bucket = next((b for b in SEQ_BUCKETS if b >= max_seqs), SEQ_BUCKETS[-1])
        self.capture = capture
        self.device = kv_caches[0][0].device
        self.needs_seq_lens = model.needs_seq_lens
        self._shapes: dict[tuple[int, int, int], _Shape] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.num_replays = 0  # steps that ran from a captured graph
        self.num_captures = 0

    def shape_of(self, feeds: Sequence[Feed]) -> tuple[int, int, int] | None:
        """The padded (sequences, Q, blocks) a step of ``feeds`` runs as, or None where it is not of a graph's kind:
        not every feed the same Q, a Q over a block, more sequences or blocks than the largest bucket."""
        if not feeds:
            return None
        q = len(feeds[0].token_ids)
        if not 1 <= q <= self.block_size or any(len(f.token_ids) != q or f.num_logits > q for f in feeds):
            return None
        seqs = next((b for b in SEQ_BUCKETS if b >= len(feeds)), None)
        if seqs is None or seqs > self.max_bucket:
            return None
        blocks = max(-(-(f.start + q) // self.block_size) for f in feeds)
        padded = 1 << (blocks - 1).bit_length()
        if padded > self.max_blocks:
            padded = blocks if blocks <= self.max_blocks else 0
        return (seqs, q, padded) if padded else None

    def run(self, feeds: Sequence[Feed]) -> torch.Tensor | None:
        """Logits [sum of num_logits, vocab] in feed order, or None where the step is not of a graph's kind (the
        caller runs it eagerly)."""
        key = self.shape_of(feeds)
        if key is None:
            return None
        shape = self._shapes.get(key)
        if shape is None:
            if len(self._shapes) >= MAX_GRAPHS:
                return None
            shape = self._new_shape(*key)
        self._fill(shape, feeds)
        if shape.graph is not None:
            shape.graph.replay()
            self.num_replays += 1
            hidden = shape.hidden
        elif self.capture:
            hidden = self._capture(shape)
        else:
            hidden = self._forward(shape)
        assert hidden is not None
        q = shape.q_len
        rows = [i * q + r for i, f in enumerate(feeds) for r in range(q - f.num_logits, q)]
        index = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
        return self.model.compute_logits(hidden.index_select(0, index))

    def _new_shape(self, num_seqs: int, q_len: int, num_blocks: int) -> _Shape:
        rows = num_seqs * q_len
        size = 4 * rows + num_seqs + num_seqs * num_blocks
        shape = _Shape(num_seqs, q_len, num_blocks, torch.zeros(size, dtype=torch.long, device=self.device))
        self._shapes[(num_seqs, q_len, num_blocks)] = shape
        return shape

    def _fill(self, shape: _Shape, feeds: Sequence[Feed]) -> None:
        """The step's inputs, padded, into the shape's static tensor (one copy): token ids, positions, cache slots,
        each row's context (its sequence's, for RoPE scaled by length) [rows each]; each sequence's context length
        [num_seqs]; the block tables [num_seqs, num_blocks]."""
        q, bs, nb, pad = shape.q_len, self.block_size, shape.num_blocks, self.pad_block
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        row_ctx: list[int] = []
        ctx: list[int] = []
        tables: list[int] = []
        for f in feeds:
            end = f.start + q
            ids += f.token_ids
            positions += range(f.start, end)
            table = f.block_table
            slots += cache_slots(table, f.start, end, bs)
            row_ctx += [end] * q
            ctx.append(end)
            used = -(-end // bs)
            tables += table[:used]
            tables += [pad] * (nb - used)
        for _ in range(shape.num_seqs - len(feeds)):  # dummy sequences: Q tokens at 0 .. Q - 1 in the pad block
            ids += [0] * q
            positions += range(q)
            slots += cache_slots([pad], 0, q, bs)
            row_ctx += [q] * q
            ctx.append(q)
            tables += [pad] * nb
        host = torch.tensor(ids + positions + slots + row_ctx + ctx + tables, dtype=torch.long)
        shape.inputs.copy_(host, non_blocking=False)

    def _forward(self, shape: _Shape) -> torch.Tensor:
        """The model on the shape's static inputs: every tensor the step needs computed from them on the device."""
        rows, q, b = shape.rows, shape.q_len, shape.num_seqs
        ids, positions, slots, row_ctx = shape.inputs[: 4 * rows].view(4, rows)
        ctx = shape.inputs[4 * rows : 4 * rows + b]
        tables = shape.inputs[4 * rows + b :].view(b, shape.num_blocks)
        steps = torch.arange(q, device=self.device)
        query_pos = ctx[:, None] - q + steps[None, :]  # [B, Q]
        key_pos = torch.arange(shape.num_blocks * self.block_size, device=self.device)
        mask = key_pos[None, None, :] <= query_pos[:, :, None]  # [B, Q, L]
        group = AttentionGroup(0, b, q, tables, mask[:, None], False, None, query_pos)
        meta = AttentionMetadata(slots, [group])
        return self.model(ids, positions, self.kv_caches, meta, row_ctx if self.needs_seq_lens else None)

    def _capture(self, shape: _Shape) -> torch.Tensor:
        """Warm up on a side stream (the allocator, lazy inits), capture the forward, replay it for this step."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # (the step's own inputs: writing its K/V twice writes the same values)
                self._forward(shape)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            shape.hidden = self._forward(shape)
        shape.graph = graph
        self.num_captures += 1
        graph.replay()
        self.num_replays += 1
        return shape.hidden

"""Runs the model for one step: lays the step's tokens out flat, builds paged-attention metadata, and
returns the logits of the positions that need them."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from cloud.engine import step_graphs
from cloud.engine.attention import AttentionGroup, AttentionMetadata, build_group, cache_slots, split_by_context
from cloud.engine.cpu_kernels import decode_step_function, draft_greedy_function, paged_attention_kernel
from cloud.engine.fused_decoder import FusedDecoder, dequantize_in_place
from cloud.engine.host_load import HostLoad
from cloud.engine.loader import load_model
from cloud.engine.model_config import ModelConfig

logger = logging.getLogger(__name__)

# Sequences feeding at most this many tokens in a step are batched together by token count.
MAX_BATCHED_Q_LEN = 16

# What one more attention group costs a step, in KV blocks of padded work (see ``split_by_context``): on CPU a
# group's ~8 ops per layer cost about as much as gathering and attending GROUP_COST_TOKENS_CPU padded positions
# (measured on the demo cloud LM, 2-core AMD EPYC). On CUDA padding is cheap next to a launch; not measured here.
GROUP_COST_TOKENS_CPU = 384
GROUP_COST_TOKENS_CUDA = 8192

# On CPU a torch step of fewer multiply-adds than this runs on one thread (a larger one on the cores the host leaves
# idle: ``use_threads_for``). Each parallel op hands work to the other threads and waits for them; a small step's
# ops (a decode of one or a few sequences) are each worth a few microseconds of work, less than that hand-off on a
# quiet host and far less than it when the host's other cores are busy (the waiting thread must first be
# scheduled: milliseconds). Measured on the demo cloud LM, 2 cores under load (docs/engine-step.md): batch 1 at 2
# threads 248 ms a step, at 1 thread 22 ms.
PARALLEL_MIN_MACS = 32 << 20

# A fused step (``FusedDecoder``: one C call, a few dozen thread meetings a step, not ~30 torch ops a layer) of at
# least this many multiply-adds runs on as many threads as the host has idle cores for (``HostLoad``), up to the
# engine's: reading the weights bounds a small step, and two cores read them faster than one. Measured on the demo
# cloud LM (8 M multiply-adds a token; 2-core Xeon, idle host): one token 1.40 ms on one thread, 0.81 on two; with
# the other core busy, two threads cost 1.5x one, so a busy host keeps one (docs/engine.md#threads-of-a-small-step).
FUSED_PARALLEL_MIN_MACS = 1 << 20

# A ``FusedDecoder`` call feeds at most this many tokens a sequence (a decode: one; a verification of up to 15
# proposals; a draft catching up; a short prompt) and this many rows in all (64 sequences verifying 7 proposals each).
# Within those it runs every such step, whatever the batch: on the demo cloud LM (2-core AMD EPYC with AVX-512,
# 2026-12-07) a decode of 64 sequences took 14.0 ms fused against 26.1 through the torch model, a verification of
# 5 tokens for each of 16 sequences 11.7 against 21.0, and every smaller step less in proportion
# (docs/engine.md#paged-attention-on-cpu, its tables).
FUSED_MAX_FEED_TOKENS = 16
FUSED_MAX_ROWS = 512


@dataclass(slots=True)
class Feed:
    """Tokens one sequence feeds in a step: ``token_ids`` at positions ``start ..``; logits for the last
    ``num_logits`` of them."""

    block_table: list[int]
    token_ids: list[int]
    start: int
    num_logits: int


# torch's thread count is the process's: a runner that went to one thread for a small step leaves it so. What it
# was before any runner adapted it is kept here, so that a runner built afterwards (another engine in the process: a
# bench's contenders, tests) still gets the process's threads for its large steps, not the one a step left.
_threads_before_adapting: int | None = None


def adapt_threads(threads: int) -> None:
    """Set torch's threads for a step (a runner adapting them to the step's size)."""
    global _threads_before_adapting
    current = torch.get_num_threads()
    if current != threads:
        if _threads_before_adapting is None:
            _threads_before_adapting = current
        torch.set_num_threads(threads)


def set_process_threads(threads: int) -> None:
    """The threads the process's runners use for large steps from now on (an engine's ``num_threads``)."""
    global _threads_before_adapting
    _threads_before_adapting = None
    torch.set_num_threads(threads)


def process_threads() -> int:
    """The threads a runner built now uses for its large steps: torch's, unless a runner adapted them, then what
    they were before."""
    return _threads_before_adapting or torch.get_num_threads()


def zeroed_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The KV cache, all zeros. On CPU from ``calloc`` (numpy's zeros): the OS maps zero pages and commits each on
    first write, so a cache sized to a quarter of RAM costs neither the seconds of writing it nor its RSS until
    sequences fill it (``torch.zeros`` writes every byte: ~0.5 s and 5 GiB resident for the default budget here)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    raw = torch.from_numpy(np.zeros(math.prod(shape) * dtype.itemsize, dtype=np.uint8))
    return raw.view(dtype).view(shape)


class ModelRunner:
    def __init__(
        self,
        model_dir: Path,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        num_blocks: int,
        max_model_len: int,
        fused_decode: bool = True,
        int8_weights: bool = False,
        cuda_graphs: bool = True,
        max_num_seqs: int = 256,
    ) -> None:
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.model = load_model(model_dir, device, dtype, max_model_len)
        self.config: ModelConfig = self.model.config
        cfg = self.config
        # On CUDA, decode and verification steps replay captured graphs (``step_graphs``); their padding rows write
        # to one block past the block manager's, which no sequence owns.
        graphs = cuda_graphs and device.type == "cuda" and step_graphs.supports(self.model)
        shape = (cfg.num_layers, 2, num_blocks + int(graphs), block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_cache = zeroed_cache(shape, dtype, device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(cfg.num_layers)]
        self.graphs: step_graphs.StepGraphs | None = None
        if graphs:
            max_blocks = -(-max_model_len // block_size)
            self.graphs = step_graphs.StepGraphs(
                self.model, self.kv_caches, block_size, num_blocks, max_blocks, max_num_seqs, capture=True
            )
        cost_tokens = GROUP_COST_TOKENS_CUDA if device.type == "cuda" else GROUP_COST_TOKENS_CPU
        self.group_cost_blocks = cost_tokens / block_size
        # On CPU in fp32 batched groups read the cache in place (no padding: one group per token count).
        self.attention_kernel = paged_attention_kernel() if device.type == "cpu" and dtype == torch.float32 else None
        # Small steps (decodes on one thread, verifications, a draft catching up: ``fuses``) run the whole forward
        # in one C call (``FusedDecoder``) when it builds; with ``int8_weights``, on weight-only int8 projections.
        self.fused_decoder: FusedDecoder | None = None
        if fused_decode and FusedDecoder.supports(self.model, self.kv_cache):
            fn = decode_step_function()
            if fn is not None and int8_weights:
                # The torch model (larger steps) computes with the same int8 values, dequantized: one model whatever
                # path a step takes, so batching and speculation change no output.
                dequantize_in_place(self.model)
            self.fused_decoder = (
                FusedDecoder(fn, self.model, self.kv_cache, int8_weights, draft_greedy_function())
                if fn is not None
                else None
            )
        elif int8_weights:
            logger.warning("int8 weights need the fused CPU step (fp32, a Llama-layout model): serving fp32")
        self.forward_seconds = 0.0
        self.num_forwards = 0
        # Threads a large step uses (the engine's ``num_threads``, set before the runner is built); small steps use 1.
        self.max_threads = process_threads()
        self.parallel_min_macs = PARALLEL_MIN_MACS  # (a draft model's runner raises it)
        self.adapt_threads = device.type == "cpu"
        # Steps large enough for several threads take the cores the host leaves idle (``use_threads_for``).
        self.host_load = HostLoad() if self.adapt_threads else None
        h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        mlp_matrices = 3 if cfg.is_gated_mlp else 2
        self.macs_per_token = cfg.num_layers * (h * (q + 2 * kv) + q * h + mlp_matrices * h * cfg.intermediate_size)
        self.macs_per_token += h * cfg.vocab_size
        self.attention_macs_per_pair = cfg.num_layers * 2 * q  # per (query token, context token) pair

    @staticmethod
    def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        return config.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size()) * block_size

    def step_macs(self, feeds: list[Feed]) -> int:
        """Multiply-adds of a forward over ``feeds`` (projections, LM head for every token, attention)."""
        num_tokens = pairs = 0
        for f in feeds:
            n = len(f.token_ids)
            num_tokens += n
            pairs += n * (f.start + n)
        return num_tokens * self.macs_per_token + pairs * self.attention_macs_per_pair

    def use_threads_for(self, feeds: list[Feed], fused: bool = False) -> int:
        """Set (on CPU) and return the threads a forward over ``feeds`` runs on: 1 below ``parallel_min_macs``
        (through the torch model) or ``FUSED_PARALLEL_MIN_MACS`` (a ``fused`` step); above, one for each core the
        host leaves at least half idle (``HostLoad``), up to the engine's (all of the engine's where the host's load
        cannot be read, through the torch model; 1 for a fused step below ``parallel_min_macs`` then)."""
        if not self.adapt_threads:
            return torch.get_num_threads()
        macs = self.step_macs(feeds)
        idle = self.host_load.threads(self.max_threads) if self.host_load is not None else None
        if idle is None:
            threads = self.max_threads if macs >= self.parallel_min_macs else 1
        else:
            threads = idle if macs >= (FUSED_PARALLEL_MIN_MACS if fused else self.parallel_min_macs) else 1
        adapt_threads(threads)
        return threads

    def fuses(self, feeds: list[Feed]) -> bool:
        """Whether a forward over ``feeds`` runs as one ``FusedDecoder`` call: every feed a few tokens (at most
        ``FUSED_MAX_FEED_TOKENS``: a decode, a speculative verification, a draft catching up, a short prompt) with
        logits wanted, at most ``FUSED_MAX_ROWS`` rows in all. Up to eight rows share each weight read and a row
        costs no op dispatch, where the torch model pays ~30 ops a layer: measured on the demo cloud LM (2 cores),
        the fused step was faster at every batch from 1 to 64 sequences, decoding or verifying."""
        return (
            self.fused_decoder is not None
            and bool(feeds)
            and all(self._fusable(f) for f in feeds)
            and sum(len(f.token_ids) for f in feeds) <= FUSED_MAX_ROWS
        )

    @staticmethod
    def _fusable(feed: Feed) -> bool:
        return 0 < feed.num_logits <= len(feed.token_ids) <= FUSED_MAX_FEED_TOKENS

    @staticmethod
    def _run_fused(fused: FusedDecoder, feeds: list[Feed]) -> torch.Tensor:
        token_ids: list[int] = []
        positions: list[int] = []
        row_seqs: list[int] = []
        logit_rows: list[int] = []
        for s, f in enumerate(feeds):
            n = len(f.token_ids)
            logit_rows.extend(range(len(token_ids) + n - f.num_logits, len(token_ids) + n))
            token_ids.extend(f.token_ids)
            positions.extend(range(f.start, f.start + n))
            row_seqs.extend([s] * n)
        if len(token_ids) == len(feeds):  # one token a sequence: a decode step (the defaults)
            return fused.run(token_ids, positions, [f.block_table for f in feeds])
        return fused.run(token_ids, positions, [f.block_table for f in feeds], row_seqs, logit_rows)

    def propose_greedy(self, feeds: list[Feed], num_proposals: list[int]) -> list[list[int]] | None:
        """A draft's greedy proposals for each feed's sequence in one fused call (``FusedDecoder.propose_greedy``):
        ``num_proposals[i]`` tokens after feed i's, each fed back at the next position. None where the fused step
        does not take the feeds (the caller steps the draft itself)."""
        fused = self.fused_decoder
        if fused is None or fused.greedy_fn is None or not self.fuses(feeds) or any(f.num_logits != 1 for f in feeds):
            return None
        started = time.perf_counter()
        token_ids: list[int] = []
        positions: list[int] = []
        row_seqs: list[int] = []
        for s, f in enumerate(feeds):
            token_ids.extend(f.token_ids)
            positions.extend(range(f.start, f.start + len(f.token_ids)))
            row_seqs.extend([s] * len(f.token_ids))
        self.use_threads_for(feeds, fused=True)  # (its first step's size: the rest are one row a sequence)
        proposals = fused.propose_greedy(token_ids, positions, [f.block_table for f in feeds], row_seqs, num_proposals)
        self.forward_seconds += time.perf_counter() - started
        self.num_forwards += max(num_proposals)
        return proposals

    @torch.inference_mode()
    def execute(self, feeds: list[Feed]) -> torch.Tensor:
        """Run one forward over all feeds; returns logits [sum(num_logits), V] in feed order."""
        started = time.perf_counter()
        fused = self.fused_decoder
        if fused is not None:
            if self.fuses(feeds):
                self.use_threads_for(feeds, fused=True)
                logits = self._run_fused(fused, feeds)
                self.forward_seconds += time.perf_counter() - started
                self.num_forwards += 1
                return logits
            small = [i for i, f in enumerate(feeds) if self._fusable(f)]
            if small and len(small) < len(feeds) and self.fuses([feeds[i] for i in small]):
                # A step of prompts and decodes (continuous batching): the prompts through the torch model, the
                # rest fused; logits back in feed order.
                return self._execute_split(feeds, small)
        if self.graphs is not None:  # (a step with prompt tokens in it runs eagerly, below)
            replayed = self.graphs.run(feeds)
            if replayed is not None:
                self.forward_seconds += time.perf_counter() - started
                self.num_forwards += 1
                return replayed
        return self._execute_torch(feeds, started)

    def _execute_split(self, feeds: list[Feed], small: list[int]) -> torch.Tensor:
        fused = set(small)
        rest = [i for i in range(len(feeds)) if i not in fused]
        parts = {
            tuple(small): self.execute([feeds[i] for i in small]),
            tuple(rest): self.execute([feeds[i] for i in rest]),
        }
        chunks: dict[int, torch.Tensor] = {}
        for idxs, logits in parts.items():
            row = 0
            for i in idxs:
                chunks[i] = logits[row : row + feeds[i].num_logits]
                row += feeds[i].num_logits
        return torch.cat([chunks[i] for i in range(len(feeds))])

    def _execute_torch(self, feeds: list[Feed], started: float) -> torch.Tensor:
        self.use_threads_for(feeds)
        # Group small feeds by length so each group is one batched attention; large ones (prefill) go alone.
        by_len: dict[int, list[int]] = {}
        singles: list[int] = []
        for i, f in enumerate(feeds):
            n = len(f.token_ids)
            if n <= MAX_BATCHED_Q_LEN:
                by_len.setdefault(n, []).append(i)
            else:
                singles.append(i)
        kernel = self.attention_kernel
        order: list[list[int]] = []
        for n, idxs in sorted(by_len.items()):
            if kernel is not None:
                order.append(idxs)
                continue
            # Padded to the longest context in the group: sequences of very different lengths go in several groups.
            contexts = [-(-(feeds[i].start + n) // self.block_size) for i in idxs]
            order.extend([idxs[j] for j in part] for part in split_by_context(contexts, self.group_cost_blocks))
        num_batched = len(order)
        order += [[i] for i in singles]
        ids: list[int] = []
        positions: list[int] = []
        seq_lens: list[int] = []
        slots: list[int] = []
        groups: list[AttentionGroup] = []
        flat_start: dict[int, int] = {}
        for g, idxs in enumerate(order):
            q_len = len(feeds[idxs[0]].token_ids)
            groups.append(
                build_group(
                    len(ids),
                    q_len,
                    [feeds[i].start + q_len for i in idxs],
                    [feeds[i].block_table for i in idxs],
                    self.block_size,
                    self.device,
                    for_kernel=kernel is not None and g < num_batched,
                )
            )
            for i in idxs:
                f = feeds[i]
                flat_start[i] = len(ids)
                ids.extend(f.token_ids)
                positions.extend(range(f.start, f.start + q_len))
                seq_lens.extend([f.start + q_len] * q_len)
                slots.extend(cache_slots(f.block_table, f.start, f.start + q_len, self.block_size))
        meta = AttentionMetadata(torch.tensor(slots, dtype=torch.long, device=self.device), groups, kernel)
        hidden = self.model(
            torch.tensor(ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            self.kv_caches,
            meta,
            torch.tensor(seq_lens, dtype=torch.long, device=self.device) if self.model.needs_seq_lens else None,
        )
        rows: list[int] = []
        for i, f in enumerate(feeds):
            end = flat_start[i] + len(f.token_ids)
            rows.extend(range(end - f.num_logits, end))
        if rows != list(range(len(ids))):  # (a decode step wants every row, in order: no copy)
            hidden = hidden[torch.tensor(rows, dtype=torch.long, device=self.device)]
        logits = self.model.compute_logits(hidden)
        self.forward_seconds += time.perf_counter() - started
        self.num_forwards += 1
        return logits

"""Token selection: penalties, temperature, top-k / top-p / min-p, seeded sampling, logprobs, and the
speculative-decoding acceptance rules."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from cloud.engine.sampling_params import SamplingParams
from cloud.engine.sequence import Logprob, Sequence
from shared.structured import Constraint, fill_bitmasks, forbidden_of


class GrammarMasks:
    """The grammar masks of one batch's constrained rows, being computed (on the sampler's mask thread, while the
    forward runs) or done: ``rows`` (indices into the batch) and, from ``bits()``, int32[len(rows), num_words]
    bitmasks (``forbidden()``: the same unpacked, bool[len(rows), 32 * num_words], True where forbidden)."""

    __slots__ = ("_bits", "_future", "eos_token_ids", "rows")

    def __init__(
        self, rows: list[int], bits: np.ndarray, eos_token_ids: list[int], future: Future[None] | None
    ) -> None:
        self.rows = rows
        self.eos_token_ids = eos_token_ids
        self._bits = bits
        self._future = future

    def bits(self) -> np.ndarray:
        if self._future is not None:
            self._future.result()
            self._future = None
        return self._bits

    def forbidden(self) -> np.ndarray:
        return forbidden_of(self.bits(), self.eos_token_ids)


class Sampler:
    """Holds one ``torch.Generator`` per seeded sequence so a seeded request is reproducible."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._generators: dict[int, torch.Generator] = {}
        # Grammar masks: one bitmask buffer per number of constrained rows (allocated once, reused every step) and
        # one thread that fills them while the forward runs (llguidance drops the GIL; so does most of torch).
        self._bitmasks: dict[tuple[int, int], np.ndarray] = {}
        self._mask_thread: ThreadPoolExecutor | None = None
        # Overlap only on an accelerator, where the CPU waits on the forward. On a CPU device the hand-off to the
        # thread cost more than it hid, even with a core left free (tiny zoo, 32 concurrent, torch on 1 of 2
        # cores: 7,547 tok/s with the thread, 8,098 inline; docs/benchmarks.md, "bench structured").
        self.overlap_masks = device.type != "cpu"

    def generator(self, seq: Sequence) -> torch.Generator | None:
        if seq.params.seed is None:
            return None
        g = self._generators.get(seq.seq_id)
        if g is None:
            g = torch.Generator(device=self.device)
            # Siblings of an n > 1 request draw different streams from the same seed.
            g.manual_seed((seq.params.seed * 1_000_003 + seq.sibling_index) % (1 << 63))
            self._generators[seq.seq_id] = g
        return g

    def release(self, seq: Sequence) -> None:
        self._generators.pop(seq.seq_id, None)

    # -- distributions ------------------------------------------------------------------------------------------
    def apply_penalties(self, logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
        """logits: [V] for one position; OpenAI presence/frequency over the output, HF repetition over all."""
        p = seq.params
        if not p.has_penalties:
            return logits
        logits = logits.clone()
        vocab = logits.shape[-1]
        if p.presence_penalty or p.frequency_penalty:
            out = seq.output_token_ids
            if out:
                counts = torch.bincount(torch.tensor(out, device=logits.device), minlength=vocab)[:vocab].float()
                logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)), device=logits.device, dtype=torch.long)
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        return logits

    @staticmethod
    def probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """logits: [..., V] (penalties applied) → the distribution sampling draws from, [..., V]."""
        logits = logits / max(params.temperature, 1e-5)
        if params.top_k > 0 and params.top_k < logits.shape[-1]:
            kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the top token is always kept).
            drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= params.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        if params.min_p > 0.0:
            cutoff = params.min_p * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < cutoff, 0.0)
        return probs / probs.sum(dim=-1, keepdim=True)

    def draw(self, probs: torch.Tensor, generator: torch.Generator | None) -> int:
        """One token from probs [V] (exponential race: argmax p / E, E ~ Exp(1))."""
        noise = torch.empty_like(probs).exponential_(generator=generator)
        return int(torch.argmax(probs / noise))

    def uniform(self, generator: torch.Generator | None) -> float:
        return float(torch.rand((), generator=generator, device=self.device))

    # -- plain sampling -----------------------------------------------------------------------------------------
    def prepare_masks(self, seqs: list[Sequence], background: bool | None = None) -> GrammarMasks | None:
        """Start computing the next-token masks of the constrained ``seqs`` (None when there are none). Call it
        before the forward whose logits they mask; until ``forbidden()`` returns, nothing may move their matchers.
        ``background``: on the mask thread (default: ``overlap_masks``), else here, now."""
        if background is None:
            background = self.overlap_masks
        rows = [i for i, s in enumerate(seqs) if s.constraint is not None]
        if not rows:
            return None
        constraints: list[Constraint] = [seqs[i].constraint for i in rows]  # type: ignore[misc]
        key = (len(rows), constraints[0].num_words)
        bits = self._bitmasks.get(key)
        if bits is None:
            bits = self._bitmasks[key] = np.zeros(key, dtype=np.int32)
        eos = constraints[0].eos_token_ids
        if not background:
            fill_bitmasks(constraints, bits)
            return GrammarMasks(rows, bits, eos, None)
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return GrammarMasks(rows, bits, eos, self._mask_thread.submit(fill_bitmasks, constraints, bits))

    def constrain(
        self, logits: torch.Tensor, seqs: list[Sequence], masks: GrammarMasks | None = None, *, inplace: bool = False
    ) -> torch.Tensor:
        """logits [N, V] with every token a sequence's grammar forbids at -inf (rows without one as they are).
        ``masks``: from ``prepare_masks(seqs)`` (computed now when not given); ``inplace``: mask ``logits`` itself
        (the caller's copy) rather than a clone."""
        if masks is None:
            masks = self.prepare_masks(seqs, background=False)
            if masks is None:
                return logits
        bits = masks.bits()
        n, vocab = logits.shape
        width = min(vocab, 32 * bits.shape[1])
        # One vectorised unpack of the batch's bitmasks: bool[len(rows), width], True where forbidden.
        forbidden = np.unpackbits(bits.view(np.uint8), axis=1, count=width, bitorder="little") == 0
        stuck = ~bits.any(axis=1)
        if stuck.any():  # a row that allows nothing (an error state, never expected) allows the EOS ids
            eos = np.array([t for t in masks.eos_token_ids if t < width], dtype=np.intp)
            forbidden[np.ix_(np.flatnonzero(stuck), eos)] = False
        if not inplace:
            logits = logits.clone()
        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            # numpy views, no torch op (a torch op wakes its thread pool): every row constrained (the usual case)
            # is one masked copy; a mixed batch masks its constrained rows one by one.
            array = logits.numpy()
            if len(masks.rows) == n:
                np.copyto(array[:, :width], -np.inf, where=forbidden)
            else:
                for j, row in enumerate(masks.rows):
                    np.copyto(array[row, :width], -np.inf, where=forbidden[j])
            if width < vocab:  # ids past the grammar's vocabulary
                array[masks.rows, width:] = -np.inf
            return logits
        full = np.zeros((n, vocab), dtype=bool)  # unconstrained rows: nothing forbidden
        full[masks.rows, :width] = forbidden
        full[masks.rows, width:] = True
        logits.masked_fill_(torch.from_numpy(full).to(logits.device), float("-inf"))
        return logits

    @staticmethod
    def constrain_along(logits: torch.Tensor, seq: Sequence, proposals: list[int]) -> torch.Tensor:
        """Verification's logits [k+1, V] with row i masked by the grammar's state after ``proposals[:i]`` (the
        proposals are a valid prefix): the target picks as plain constrained decoding would, token for token."""
        if seq.constraint is None:
            return logits
        allowed = torch.from_numpy(seq.constraint.masks_along(proposals, logits.shape[-1])).to(logits.device)
        return logits.masked_fill(~allowed, float("-inf"))

    def sample(
        self, logits: torch.Tensor, seqs: list[Sequence], masks: GrammarMasks | None = None, *, inplace: bool = False
    ) -> list[int]:
        """logits: [N, V], one row per sequence → one token per sequence (within its grammar, if it has one;
        ``masks``: from ``prepare_masks(seqs)``, else computed here; ``inplace``: the grammar may mask ``logits``
        itself)."""
        logits = self.constrain(logits, seqs, masks, inplace=inplace)
        if all(s.params.is_greedy and not s.params.has_penalties for s in seqs):
            return torch.argmax(logits, dim=-1).tolist()
        tokens: list[int] = []
        for row, seq in zip(logits, seqs, strict=True):
            row = self.apply_penalties(row, seq)
            if seq.params.is_greedy:
                tokens.append(int(torch.argmax(row)))
            else:
                tokens.append(self.draw(self.probs(row, seq.params), self.generator(seq)))
        return tokens

    @staticmethod
    def logprobs(logits: torch.Tensor, tokens: list[int], num_top: int, ranks: bool = False) -> list[Logprob]:
        """Raw model log-probabilities of ``tokens`` (one per row of logits [N, V]) and the top ``num_top``
        (``ranks``: each token's rank too; computed in float32 whatever the model's dtype)."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        chosen_t = lp.gather(-1, torch.tensor(tokens, device=lp.device)[:, None])
        chosen = chosen_t[:, 0].tolist()
        if num_top > 0:
            top_v, top_i = torch.topk(lp, num_top, dim=-1)
            tops = [list(zip(i, v, strict=True)) for i, v in zip(top_i.tolist(), top_v.tolist(), strict=True)]
        else:
            tops = [[] for _ in tokens]
        rank_of: list[int | None] = [None] * len(tokens)
        if ranks:
            rank_of = [int(r) + 1 for r in (lp > chosen_t).sum(dim=-1).tolist()]
        return [Logprob(t, c, top, r) for t, c, top, r in zip(tokens, chosen, tops, rank_of, strict=True)]

    # -- speculative verification -------------------------------------------------------------------------------
    def verify(
        self,
        target_logits: torch.Tensor,
        seq: Sequence,
        draft_tokens: list[int],
        draft_probs: torch.Tensor | None,
    ) -> list[int]:
        """Tokens to append after verifying ``draft_tokens`` (k of them); always 1 to k + 1 tokens.

        target_logits: [k+1, V], the target's logits after the last accepted token and after each draft.
        draft_probs: [k, V], the draft's sampling distribution per proposal (None for n-gram proposals,
        which are point masses).

        Greedy: accept drafts while they equal the target's argmax, then append the target's argmax —
        the output is exactly what plain greedy decoding produces.
        Sampled (Leviathan et al., 2023): accept draft x_i with probability min(1, p_i(x_i) / q_i(x_i));
        at the first rejection sample from norm(max(0, p_i - q_i)) and stop; if all k are accepted,
        sample a bonus token from p_{k+1}. The result is distributed exactly as sampling from p.
        """
        k = len(draft_tokens)
        if seq.params.is_greedy:
            best = torch.argmax(target_logits, dim=-1).tolist()  # [k+1]
            out = []
            for i in range(k):
                if draft_tokens[i] != best[i]:
                    break
                out.append(draft_tokens[i])
            out.append(best[len(out)])
            return out
        p = self.probs(target_logits, seq.params)  # [k+1, V]
        g = self.generator(seq)
        out = []
        for i, x in enumerate(draft_tokens):
            q_x = float(draft_probs[i, x]) if draft_probs is not None else 1.0
            p_x = float(p[i, x])
            if q_x > 0 and self.uniform(g) < min(1.0, p_x / q_x):
                out.append(x)
                continue
            if draft_probs is not None:
                residual = (p[i] - draft_probs[i]).clamp(min=0.0)
            else:
                residual = p[i].clone()
                residual[x] = 0.0
            total = float(residual.sum())
            out.append(self.draw(residual / total, g) if total > 0 else self.draw(p[i], g))
            return out
        out.append(self.draw(p[k], g))
        return out

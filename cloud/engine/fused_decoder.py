"""The fused CPU decode step: a small step of the model as one C call (``cpu_kernels.DECODE_SOURCE``), and the
weight-only int8 layout it can read.

``cpu_kernels`` compiles the C and knows nothing of the model; this module lays a loaded ``CausalLM``'s tensors out
for it and calls it.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, cast

import torch

from cloud.engine.cpu_kernels import panel_width, sub_panel_width

if TYPE_CHECKING:
    from cloud.engine.model import CausalLM, DecoderLayer


class FusedDecoder:
    """A small step of ``model`` as one C call (``DECODE_SOURCE``): sequences feeding a few tokens each (one to
    decode, k + 1 to verify k speculative proposals, a draft model's catch-up), the whole forward (embedding, every
    layer with its cache writes and attention, the final norm and the LM head) without a torch op. At batch 1 the
    torch forward is ~30 ops a layer, each a few microseconds of dispatch around less work than that; this is the
    same arithmetic with none of it (the sums ordered differently, so logits agree to float rounding, not bitwise).
    A step's rows share every weight read (``matmul`` takes up to eight at once), so verifying k + 1 tokens costs
    little more than decoding one where reading the weights bounds the step. For the CPU in fp32, with the CPU
    layout (``TransposedLinear``), for models that are exactly the Llama computation (``CausalLM.is_llama_layout``:
    no soft-caps, sliding windows that matter, q/k norms, GELU, learned positions or partial rotary), with RoPE from
    the model's tables (not ``dynamic``); ``supports`` says whether a model qualifies.

    ``int8_weights``: every projection and the LM head as weight-only int8 (``quantize_int8``: symmetric, one scale
    per output column), a quarter of the bytes a step reads; activations, norms and the KV cache stay fp32. The
    matrices the step reads (int8 ones, and fp32 ones up to ``PACK_FP32_MAX_BYTES`` in all: a copy) are packed in
    column panels (``pack_panels``), so that each thread's share of a matrix is one run of memory.
    ``ModelRunner`` first gives the torch model the same values (``dequantize_in_place``), so its larger steps
    compute the same model."""

    DIMS = 13  # the D_ fields of DECODE_SOURCE
    # fp32 matrices up to this many bytes in all get a copy packed in panels (``pack_panels``): one row through the demo
    # LM's matrices, 2-core EPYC, 2 threads, a C microbenchmark: 0.55 ms best (0.66-0.80 mean) as the torch layout,
    # 0.41-0.42 (0.52-0.59) packed. A larger model reads the torch model's own tensors (a second copy would double it).
    PACK_FP32_MAX_BYTES = 1 << 30
    MAX_BLOCKS = 9
    MATRIX_FIELDS = (1, 3, 5, 7)  # L_QKV, L_O, L_GATE_UP, L_DOWN of a layer's L_FIELDS
    LM_HEAD, LAYERS, LAYER_FIELDS = 2, 5, 9  # W_LM_HEAD, W_LAYERS, L_FIELDS

    def __init__(
        self,
        fn: ctypes._NamedFuncPointer,
        model: CausalLM,
        kv_cache: torch.Tensor,
        int8_weights: bool = False,
        greedy_fn: ctypes._NamedFuncPointer | None = None,
    ) -> None:
        cfg = model.config
        self.fn = fn
        self.greedy_fn = greedy_fn  # ``tl_draft_greedy``: ``propose_greedy``
        self.vocab_size = cfg.vocab_size
        self.kv_cache = kv_cache
        self.num_blocks = kv_cache.shape[2]  # [layers, 2 (k, v), blocks, block size, kv heads, head dim]
        assert model.rotary is not None
        self.max_positions = model.rotary.cos_table.shape[0]
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.head_dim**-0.5
        embed = model.embed_tokens.weight
        tensors: list[torch.Tensor | None] = [
            embed,
            _norm_weight(model.norm),
            _weight_t(model.lm_head),
            model.rotary.cos_table,
            model.rotary.sin_table,
        ]
        layers = cast("list[DecoderLayer]", list(model.layers))
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            tensors += [
                _norm_weight(layer.input_layernorm),
                _weight_t(attn.qkv_proj),
                _bias(attn.qkv_proj),
                _weight_t(attn.o_proj),
                _norm_weight(layer.post_attention_layernorm),
                _weight_t(mlp.gate_up_proj),
                _bias(mlp.gate_up_proj),
                _weight_t(mlp.down_proj),
                _bias(mlp.down_proj),
            ]
        for t in tensors[1:]:
            if t is not None and not (t.is_contiguous() and t.dtype == torch.float32 and t.device.type == "cpu"):
                raise ValueError("FusedDecoder needs contiguous fp32 CPU weights")
        if _bias(model.lm_head) is not None or any(_bias(layer.self_attn.o_proj) is not None for layer in layers):
            raise ValueError("FusedDecoder: the LM head and o_proj have no bias in this model family")
        self.int8_weights = int8_weights
        scales: list[torch.Tensor | None] = [None] * len(tensors)
        matrices = [self.LM_HEAD] + [
            self.LAYERS + layer * self.LAYER_FIELDS + f for layer in range(len(layers)) for f in self.MATRIX_FIELDS
        ]
        width = panel_width()
        fp32_bytes = sum(cast("torch.Tensor", tensors[i]).nbytes for i in matrices)
        self.packed = int8_weights or fp32_bytes <= self.PACK_FP32_MAX_BYTES
        for i in matrices:
            weight = tensors[i]
            assert weight is not None
            if int8_weights:
                q, scales[i] = quantize_int8(weight)
                tensors[i] = pack_panels(q, width, sub_panel_width(int8=True))
            elif self.packed:
                tensors[i] = pack_panels(weight, width, sub_panel_width(int8=False))
        self._tensors = tensors  # the pointers below stay valid while these live
        self._scales = scales
        self.weights = (ctypes.c_void_p * len(tensors))(*[t.data_ptr() if t is not None else None for t in tensors])
        self.scales = (ctypes.c_void_p * len(scales))(*[t.data_ptr() if t is not None else None for t in scales])
        self.dims = (ctypes.c_int64 * self.DIMS)(
            cfg.num_layers,
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            cfg.vocab_size,
            kv_cache.shape[3],
            kv_cache.shape[2],
            0,
            embed.stride(0),
            embed.stride(1),
            int(self.packed),
        )
        assert kv_cache.is_contiguous() and kv_cache.shape[1] == 2 and kv_cache.dtype == torch.float32

    @staticmethod
    def supports(model: CausalLM, kv_cache: torch.Tensor) -> bool:
        cfg = model.config
        return (
            kv_cache.device.type == "cpu"
            and kv_cache.dtype == torch.float32
            and model.is_llama_layout
            and model.rotary is not None
            and cfg.rope_type != "dynamic"
            and cfg.head_dim % 2 == 0
            and cfg.num_heads % cfg.num_kv_heads == 0
            and hasattr(model.lm_head, "weight_t")  # the CPU layout: every projection transposed
            and not any(isinstance(m, torch.nn.Linear) for m in model.modules())
        )

    def run(
        self,
        token_ids: list[int],
        positions: list[int],
        block_tables: list[list[int]],
        row_seqs: list[int] | None = None,
        logit_rows: list[int] | None = None,
    ) -> torch.Tensor:
        """Tokens (rows) at their positions → logits [len(logit_rows), vocab] in fp32. Row r belongs to sequence
        ``row_seqs[r]`` (default: row r is sequence r, one token each: a decode step) and attends that sequence's
        positions up to its own: those before the step's rows in the cache, the step's rows of the same sequence at
        earlier positions computed with it (a verification of k proposals is k + 1 rows of one sequence).
        ``logit_rows`` (default: every row) are the rows whose logits come back, in that order."""
        n = len(token_ids)
        seqs = list(range(n)) if row_seqs is None else row_seqs
        wanted = list(range(n)) if logit_rows is None else logit_rows
        if not wanted or not all(0 <= r < n for r in wanted):
            raise ValueError(f"logit rows must be in [0, {n}), got {wanted}")
        flat = self._checked_tables(token_ids, positions, block_tables, seqs)
        logits = torch.empty(len(wanted), self.vocab_size, dtype=torch.float32)
        rc = self.fn(
            *self._rows_args(token_ids, positions, seqs, flat),
            (ctypes.c_int64 * len(wanted))(*wanted),
            len(wanted),
            logits.data_ptr(),
            self.eps,
            self.scale,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise MemoryError("fused decode step: out of memory for its activations")
        return logits

    def _checked_tables(
        self, token_ids: list[int], positions: list[int], block_tables: list[list[int]], seqs: list[int]
    ) -> list[int]:
        """The block tables flattened (padded to the longest, which ``dims`` records), after refusing what the C code
        would read out of bounds: what the torch model would refuse with an IndexError is refused here."""
        n = len(token_ids)
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.vocab_size}), got {token_ids}")
        if max(positions) >= self.max_positions:
            raise ValueError(f"position {max(positions)} is past the model's {self.max_positions} positions")
        if len(positions) != n or len(seqs) != n or not all(0 <= s < len(block_tables) for s in seqs):
            raise ValueError("every row needs a position and a sequence with a block table")
        block_size = self.dims[7]
        if any(p < 0 or len(block_tables[s]) * block_size <= p for p, s in zip(positions, seqs, strict=True)):
            raise ValueError("a block table does not cover its sequence's position")
        if any(b < 0 or b >= self.num_blocks for t in block_tables for b in t):
            raise ValueError(f"block ids must be in [0, {self.num_blocks}), got {block_tables}")
        max_blocks = max(len(t) for t in block_tables)
        flat: list[int] = []
        for t in block_tables:
            flat += t
            flat += [0] * (max_blocks - len(t))
        self.dims[self.MAX_BLOCKS] = max_blocks
        return flat

    def _rows_args(
        self, token_ids: list[int], positions: list[int], row_seqs: list[int], flat: list[int]
    ) -> tuple[object, ...]:
        """The arguments both C functions open with: the model (dims, weights, scales, the cache) and the rows."""
        n = len(token_ids)
        rows = [(ctypes.c_int64 * n)(*values) for values in (token_ids, positions, row_seqs)]
        return (
            self.dims,
            self.weights,
            self.scales,
            self.kv_cache.data_ptr(),
            *rows,
            (ctypes.c_int64 * len(flat))(*flat),
            n,
        )

    def propose_greedy(
        self,
        token_ids: list[int],
        positions: list[int],
        block_tables: list[list[int]],
        row_seqs: list[int],
        num_proposals: list[int],
    ) -> list[list[int]]:
        """A draft model's greedy proposals, all in one C call (``tl_draft_greedy``): the rows as in ``run`` (each
        sequence's unseen tokens, its last row last), then sequence s proposes ``num_proposals[s]`` tokens, each
        the argmax of the logits after the one before (fed at the next position, its K/V written as a step's). The
        same tokens as ``run`` a step at a time with ``torch.argmax`` (the same logits, the lowest id of equal
        maxima), without a return to Python between them."""
        assert self.greedy_fn is not None
        num_seqs = len(block_tables)
        last_rows = [-1] * num_seqs
        for r, s in enumerate(row_seqs):
            last_rows[s] = r
        if min(last_rows) < 0 or len(num_proposals) != num_seqs or min(num_proposals) < 1:
            raise ValueError("every sequence needs a row and at least one proposal")
        # The proposals' positions, too, must be in the model and the block tables.
        last_positions = [positions[r] + k - 1 for r, k in zip(last_rows, num_proposals, strict=True)]
        flat = self._checked_tables(
            token_ids + [0] * num_seqs, positions + last_positions, block_tables, row_seqs + list(range(num_seqs))
        )
        max_k = max(num_proposals)
        out = (ctypes.c_int64 * (num_seqs * max_k))()
        rc = self.greedy_fn(
            *self._rows_args(token_ids, positions, row_seqs, flat),
            (ctypes.c_int64 * num_seqs)(*last_rows),
            num_seqs,
            (ctypes.c_int64 * num_seqs)(*num_proposals),
            max_k,
            out,
            self.eps,
            self.scale,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise MemoryError("fused draft proposals: out of memory for their activations")
        return [list(out[s * max_k : s * max_k + k]) for s, k in enumerate(num_proposals)]


def quantize_int8(weight_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A transposed weight [n_in, n_out] as int8 and one fp32 scale per output column: ``q * scale`` approximates
    it, ``scale = max |column| / 127`` (symmetric, as llama.cpp's Q8_0 but per column instead of per 32 values)."""
    scale = (weight_t.abs().amax(dim=0).clamp(min=1e-12) / 127.0).to(torch.float32).contiguous()
    q = torch.round(weight_t / scale).clamp(-127, 127).to(torch.int8).contiguous()
    return q, scale


def pack_panels(weight_t: torch.Tensor, width: int, sub_width: int | None = None) -> torch.Tensor:
    """A transposed weight [n_in, n_out] as the fused step reads a packed matrix (``matmul``): panels of ``width``
    columns one after another (the last may be narrower), each [n_in, its width] row-major, flat; a full panel in
    sub-panels of ``sub_width`` columns (default: whole), each [n_in, sub_width] row-major, one after another."""
    sub_width = width if sub_width is None else sub_width
    if width <= 0 or sub_width <= 0 or width % sub_width:
        raise ValueError(f"panel width {width} must be positive, a multiple of {sub_width} (is the kernel built?)")
    n_out = weight_t.shape[1]
    parts = []
    for j in range(0, n_out, width):
        step = sub_width if j + width <= n_out else width  # the last, narrower panel stays whole
        parts += [weight_t[:, s : min(s + step, n_out)].reshape(-1) for s in range(j, min(j + width, n_out), step)]
    return torch.cat(parts)


def dequantize_in_place(model: torch.nn.Module) -> None:
    """Every projection's fp32 weight (``TransposedLinear.weight_t``) replaced by its int8 values times their scales:
    the torch model then computes what the int8 fused step does (``quantize_int8`` of the result gives the same int8
    back), and a tied embedding, a view of the LM head, reads the same values in both."""
    with torch.no_grad():
        for module in model.modules():
            weight = getattr(module, "weight_t", None)
            if isinstance(weight, torch.Tensor) and weight.dtype == torch.float32:
                q, scale = quantize_int8(weight)
                weight.copy_(q.to(torch.float32) * scale)


def _weight_t(module: torch.nn.Module) -> torch.Tensor:
    weight = getattr(module, "weight_t", None)
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"FusedDecoder needs the CPU layout (TransposedLinear), got {type(module).__name__}")
    return weight


def _norm_weight(module: torch.nn.Module) -> torch.Tensor:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"FusedDecoder needs an RMSNorm weight, got {type(module).__name__}")
    return weight


def _bias(module: torch.nn.Module) -> torch.Tensor | None:
    bias = getattr(module, "bias", None)
    return bias if isinstance(bias, torch.Tensor) else None

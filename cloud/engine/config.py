"""Engine configuration: a small validated dataclass (components copy only the fields they need)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SPECULATION_METHODS = ("off", "draft", "ngram")
CPU_WEIGHTS = ("fp32", "int8")


@dataclass(slots=True)
class EngineConfig:
    """How one model is served.

    The KV budget is ``kv_cache_bytes`` when given, else ``kv_cache_fraction`` of free device memory (CUDA)
    or of available RAM (CPU). ``speculation`` is the model's default mode (``draft`` needs
    ``draft_model_dir``); ``num_speculative_tokens`` is the largest k the adaptive controller may pick.
    ``stream_interval``: a request's tokens are handed out in updates of at least this many (its first tokens
    and its last update at once), as SGLang's and vLLM's ``--stream-interval``: fewer, larger stream events.
    ``grammar_jump_forward``: a token a request's grammar forces is appended without sampling and computed in the
    next forward together with the token before it (off: one forward per token, as unconstrained decoding).
    ``fused_decode``: on CPU in fp32, a step of a few tokens a sequence (a decode at any batch size, a verification,
    a draft's catch-up) runs the whole forward as one compiled C call instead of ~30 torch ops a layer
    (``fused_decoder.FusedDecoder``; the same greedy tokens, logits equal to float rounding). Off, or without a C
    compiler, every step runs the torch model. ``num_speculative_tokens`` (6): on the demo LM with its int8 draft, a
    largest k of 6 gave 1.84x plain at batch 1 against 1.57x for 4, and the same at 4 and 16 concurrent.
    ``cpu_weights``: ``int8`` runs those fused steps on weight-only int8 projections (one scale per output column;
    a quarter of the bytes a batch-1 step reads), and the torch model's larger steps on the same values dequantized:
    faster at batch 1, logits no longer equal to fp32's (docs/engine.md states the greedy agreement). ``fp32``
    (default): the checkpoint's own weights. ``draft_cpu_weights``: the same for the draft model, ``int8`` by
    default: a draft only proposes tokens the target then verifies, so its weights change how many are accepted,
    never the output, and a cheaper draft step is what speculation at batch 1 pays for. ``warm_up``: where the
    adaptive speculation controller times steps, each forward path runs once at load, so that first calls' one-off
    costs are not taken for what speculating costs.
    ``decode_burst_ms``: where every running sequence decodes greedily with nothing a token's logits are wanted for
    (no logprobs, penalties, grammar or stop strings; speculation off for it), no request waits and the fused step
    takes the batch, a step decodes several tokens a sequence in one C call (``tl_draft_greedy`` on the target: the
    tokens step-by-step greedy decoding gives, each K/V written as a step's): its tokens after the first as many as
    fit this many milliseconds at the measured time a token, up to ``max_decode_burst`` in all: the step's Python
    (scheduling, sampling, appending, ~0.2-0.3 ms a step of the demo LM) is paid once a burst, as vLLM's multi-step
    scheduling does. A request that arrives meanwhile waits for the burst's end: at most this long beyond the step it
    would have waited for anyway. 0 turns bursts off.
    ``enforce_eager``: on CUDA, decode and verification steps replay captured CUDA graphs (``step_graphs``: one
    launch a step instead of ~30 kernels a layer) unless this is set, as vLLM's ``enforce_eager``; no effect on CPU.
    """

    model_dir: Path
    draft_model_dir: Path | None = None
    device: str = "cpu"
    dtype: str = "auto"
    block_size: int = 16
    kv_cache_bytes: int | None = None
    kv_cache_fraction: float = 0.25
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_num_queued_requests: int = 1024
    max_num_queued_tokens: int = 1_048_576
    enable_prefix_caching: bool = True
    speculation: str | None = None
    num_speculative_tokens: int = 6
    adaptive_speculation: bool = True
    num_threads: int | None = None
    stream_interval: int = 1
    grammar_jump_forward: bool = True
    fused_decode: bool = True
    cpu_weights: str = "fp32"
    draft_cpu_weights: str = "int8"
    warm_up: bool = True
    decode_burst_ms: float = 6.0
    max_decode_burst: int = 8
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        self.model_dir = Path(self.model_dir)
        if self.draft_model_dir is not None:
            self.draft_model_dir = Path(self.draft_model_dir)
        if self.speculation is None:
            self.speculation = "draft" if self.draft_model_dir is not None else "off"
        if self.cpu_weights not in CPU_WEIGHTS:
            raise ValueError(f"cpu_weights must be one of {CPU_WEIGHTS}, got {self.cpu_weights!r}")
        if self.draft_cpu_weights not in CPU_WEIGHTS:
            raise ValueError(f"draft_cpu_weights must be one of {CPU_WEIGHTS}, got {self.draft_cpu_weights!r}")
        if self.speculation not in SPECULATION_METHODS:
            raise ValueError(f"speculation must be one of {SPECULATION_METHODS}, got {self.speculation!r}")
        if self.speculation == "draft" and self.draft_model_dir is None:
            raise ValueError("speculation='draft' needs draft_model_dir")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError("kv_cache_bytes must be positive")
        if not 0.0 < self.kv_cache_fraction <= 0.95:
            raise ValueError("kv_cache_fraction must be in (0, 0.95]")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be in [1, 16]")
        if self.decode_burst_ms < 0 or not 1 <= self.max_decode_burst <= 64:
            raise ValueError("decode_burst_ms must be >= 0 and max_decode_burst in [1, 64]")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (every running sequence decodes)")

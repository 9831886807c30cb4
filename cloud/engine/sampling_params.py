"""Per-request sampling settings (the vLLM shape), validated when built."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.errors import ValidationError
from shared.openai_schema import MAX_INT32, MAX_SEED, MIN_SEED

MAX_LOGPROBS = 20


def _fail(param: str, message: str) -> None:
    raise ValidationError(f"{param}: {message}", param=param)


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens for one request.

    ``temperature == 0`` is greedy. ``seed`` makes a sampled request reproducible. ``stop`` strings are
    cut from the returned text; ``stop_token_ids`` end generation too (the model's EOS ids always do unless
    ``ignore_eos``). ``logprobs`` returns the chosen token's log-probability at every step plus that many
    top alternatives (0 = chosen token only, None = off); values are the model's raw distribution, before
    temperature and penalties. ``prompt_logprobs`` does the same for the prompt (vLLM's field): the log-probability
    of each prompt token after the first given the tokens before it, and that many top alternatives, computed from
    the logits of every prompt position in the prefill (such a request does not reuse the prefix cache for the
    prompt). ``max_tokens == 0`` generates nothing: the request ends after its prefill (``echo`` with prompt
    logprobs). ``speculation`` overrides the model's speculative mode for this request
    (``"off"``, ``"draft"`` or ``"ngram"``); requests with penalties, and seeded sampled requests (so they stay
    reproducible whatever the load), always decode without speculation. ``grammar`` constrains the output
    (``response_format``): each step's logits are masked to the tokens the grammar allows, and the output ends
    ("stop") when the grammar is complete; with speculation, proposals are cut before the first token the grammar
    refuses and each verified position is masked by the grammar's state there (greedy output is unchanged).
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    speculation: str | None = None
    grammar: str | None = None  # llguidance grammar the output must match (shared.structured.grammar_of)
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.n, int) or self.n < 1:
            _fail("n", f"must be an integer >= 1, got {self.n!r}")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or not 0 <= self.max_tokens <= MAX_INT32
        ):
            _fail("max_tokens", f"must be an integer in [0, {MAX_INT32}], got {self.max_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not MIN_SEED <= self.seed <= MAX_SEED):
            _fail("seed", f"must be a 64-bit integer, in [{MIN_SEED}, {MAX_SEED}]")
        if not 0.0 <= self.temperature <= 100.0:
            _fail("temperature", f"must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            _fail("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= MAX_INT32:
            _fail("top_k", f"must be an integer in [0, {MAX_INT32}] (0 = off), got {self.top_k!r}")
        if any(not isinstance(t, int) or not 0 <= t <= MAX_INT32 for t in self.stop_token_ids):
            _fail("stop_token_ids", f"token ids are integers in [0, {MAX_INT32}]")
        if not 0.0 <= self.min_p <= 1.0:
            _fail("min_p", f"must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                _fail(name, f"must be in [-2, 2], got {getattr(self, name)!r}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            _fail("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            _fail("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            _fail("prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            _fail("stop", "stop sequences must be non-empty strings")
        if len(self.stop) > 4:
            _fail("stop", f"at most 4 stop sequences, got {len(self.stop)}")
        if self.speculation not in (None, "off", "draft", "ngram"):
            _fail("speculation", f"must be one of off, draft, ngram; got {self.speculation!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def needs_processing(self) -> bool:
        """Anything beyond greedy argmax or plain temperature sampling."""
        return self.has_penalties or self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

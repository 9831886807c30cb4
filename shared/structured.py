"""Constrained decoding for ``response_format``, shared by both tiers: a request's format as a grammar, and a
per-sequence matcher whose token mask the sampler applies before it picks a token.

The grammar engine is llguidance (numpy only, no torch: the same code runs in the cloud engine and on a device).
It is an optional import: without it this module still imports, plain requests are served, and a structured
request is refused with a clear 400 (``structured_output_unavailable``). ``pip install 'tierline[structured]'``.

Grammar, then tokenizer: ``grammar_of`` turns the request's format into llguidance's grammar text (a JSON schema,
``{"type": "object"}`` for ``json_object``, a regex, a choice of strings); ``GrammarTokenizer`` binds a model's
tokenizer (``tokenizer.json``, its vocabulary size and its EOS ids) and checks a grammar against it (a schema the
engine cannot compile is a 400 naming the problem); ``Constraint`` follows one sequence: ``mask()`` says which
token ids may come next (an EOS id once the output is complete), ``forced_token()`` the one token it allows, if
only one (jump-forward: both tiers append such a token without sampling it), ``accept(token)`` advances it,
``done`` says the grammar can take nothing more.
"""

from __future__ import annotations

import importlib
import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from shared.errors import ValidationError

llguidance: Any
try:
    llguidance = importlib.import_module("llguidance")
except ImportError:  # a device without the extra: structured requests get a 400, everything else works
    llguidance = None

if TYPE_CHECKING:
    from shared.chat_tokenizer import ChatTokenizer
    from shared.openai_schema import ResponseFormat

PARAM = "response_format"
# Compact JSON (no free whitespace between tokens): a small model cannot spend its tokens on blank lines, and the
# output is what ``json.loads`` and the openai SDK's ``parse`` read either way.
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}
MAX_COMPILED_GRAMMARS = 64  # per model: compiled grammars kept for the next request with the same format


def compile_error(param: str, error: str) -> ValidationError:
    """A 400 naming ``param`` for a grammar the engine refused, in our words: the engine's own diagnostic of a
    schema or regex (``Invalid type: foo``, a regex parse error with its caret), never its internals (a panic's
    assertion and backtrace: what a schema too large for it gets)."""
    text = error.strip() or "unknown error"
    if text.startswith("panic") or "assertion failed" in text or "backtrace" in text:
        reason = (
            "the schema is too large or too complex for the grammar engine to constrain the output to "
            "(split it, or make it smaller: fewer properties, alternatives and nesting levels)"
        )
    else:
        reason = f"the grammar engine cannot compile it: {text[:1000]}"
    return ValidationError(f"{param}: {reason}", param=param)


class StructuredOutputUnavailableError(ValidationError):
    code = "structured_output_unavailable"


def available() -> bool:
    return llguidance is not None


def _require() -> Any:
    if llguidance is None:
        raise StructuredOutputUnavailableError(
            "response_format: structured output needs the grammar engine, which is not installed here "
            "(pip install 'tierline[structured]'); send the request to the cloud tier",
            param=PARAM,
        )
    return llguidance


def grammar_of(fmt: ResponseFormat | None) -> str | None:
    """The llguidance grammar of a request's ``response_format``; None for free text."""
    if fmt is None or fmt.type == "text":
        return None
    llg = _require()
    matcher = llg.LLMatcher
    if fmt.type == "json_object":
        return str(matcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS))
    if fmt.type == "json_schema":
        assert fmt.json_schema is not None
        try:
            return str(matcher.grammar_from_json_schema(fmt.json_schema.schema_ or {}, defaults=_JSON_OPTIONS))
        except (ValueError, TypeError) as exc:
            raise compile_error(f"{PARAM}.json_schema.schema", str(exc)) from None
    if fmt.type == "regex":
        assert fmt.regex is not None
        return str(matcher.grammar_from_regex(fmt.regex))
    assert fmt.type == "choice" and fmt.choice is not None
    # A Lark rule of string literals (JSON string syntax is Lark's): exactly one of them, nothing else.
    return str(matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in fmt.choice)))


class GrammarTokenizer:
    """llguidance's view of one model's tokenizer: built once per model (tens of milliseconds), shared by all of
    its requests."""

    def __init__(self, tokenizer: ChatTokenizer, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        llg = _require()
        eos = sorted(set(eos_token_ids)) or [t for t in (tokenizer.token_id(tokenizer.eos_token),) if t is not None]
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)
        self.eos_token_ids = eos
        self.tokenizer = llg.LLTokenizer(tokenizer.tokenizer.to_str(), n_vocab=self.vocab_size, eos_token=eos or None)
        # Compiled grammars, most recently used last: a request's matchers are copies of one (a copy takes about a
        # microsecond, compiling and checking a schema about 0.5 ms on the tiny zoo's tokenizer).
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, grammar: str) -> None:
        """Refuse (400, naming the problem) a grammar the engine cannot compile for this model. Compiled here
        (and kept for the request's matchers): a schema too large for the engine fails only when compiled, and
        must be refused before a stream starts."""
        assert llguidance is not None
        with self._lock:
            if grammar in self._compiled:
                return
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise compile_error(PARAM, error)
        self._compile(grammar)

    def matcher(self, grammar: str) -> Any:
        """A fresh matcher at the start of ``grammar`` (a copy of the compiled one)."""
        compiled = self._compile(grammar)
        with self._lock:
            return compiled.deep_copy()

    def _compile(self, grammar: str) -> Any:
        assert llguidance is not None
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
                return compiled
        compiled = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if compiled.is_error():
            raise compile_error(PARAM, compiled.get_error())
        with self._lock:
            self._compiled[grammar] = compiled
            while len(self._compiled) > MAX_COMPILED_GRAMMARS:
                self._compiled.popitem(last=False)
        return compiled

    def constraint(self, grammar: str) -> Constraint:
        return Constraint(self, grammar)


class Constraint:
    """One sequence's place in its grammar.

    The mask of the current state is computed at most once: ``forced_token`` (jump-forward, asked right after a
    token is accepted) leaves it in ``_bits`` and ``fill_bitmasks`` copies it from there instead of computing it
    again; anything that moves the matcher marks it stale."""

    __slots__ = ("_addr", "_bits", "_fresh", "_matcher", "_vocab_size", "eos_token_ids")

    def __init__(self, tokenizer: GrammarTokenizer, grammar: str) -> None:
        self._matcher = tokenizer.matcher(grammar)
        self._vocab_size = tokenizer.vocab_size
        self._bits = np.zeros((self._vocab_size + 31) // 32, dtype=np.int32)
        self._addr = self._bits.ctypes.data  # ``ndarray.ctypes`` costs microseconds a call: take the address once
        self._fresh = False  # _bits holds the mask of the matcher's current state
        self.eos_token_ids = tokenizer.eos_token_ids

    def bits(self) -> np.ndarray:
        """int32[num_words]: the next-token bitmask (32 token ids a word, little-endian bits); do not modify it."""
        if not self._fresh:
            self._matcher.unsafe_compute_mask_ptr(self._addr, self._bits.nbytes)
            self._fresh = True
        return self._bits

    def mask(self, size: int | None = None) -> np.ndarray:
        """bool[size] (default: the vocabulary): True where a token may come next."""
        bits = self.bits()
        # ``count`` past the bitmask's end pads with zeros: ids past the grammar's vocabulary are forbidden.
        allowed = np.unpackbits(bits.view(np.uint8), count=size or self._vocab_size, bitorder="little").view(bool)
        if not bits.any():  # an error state (never expected): end the output rather than sample from nothing
            allowed[[t for t in self.eos_token_ids if t < allowed.shape[0]]] = True
        return allowed

    def forced_token(self) -> int | None:
        """The one token the grammar allows next, if it allows exactly one (jump-forward: it can be appended
        without sampling, whatever the logits); None otherwise. An EOS id is never forced (``done`` ends first)."""
        bits = self.bits()
        words = np.flatnonzero(bits)
        if words.shape[0] != 1:
            return None
        word = int(bits[words[0]]) & 0xFFFFFFFF
        if word & (word - 1):  # more than one bit
            return None
        token = int(words[0]) * 32 + word.bit_length() - 1
        return None if token in self.eos_token_ids else token

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens`` (a speculative draft) the grammar takes in a row from here, stopping before an
        EOS id (nothing follows one). The matcher does not move."""
        n = int(self._matcher.validate_tokens(tokens)) if tokens else 0
        return next((i for i, t in enumerate(tokens[:n]) if t in self.eos_token_ids), n)

    def masks_along(self, tokens: list[int], size: int | None = None) -> np.ndarray:
        """bool[len(tokens) + 1, size]: the mask here and after each of ``tokens`` (a ``valid_prefix``), as plain
        decoding would compute them one step at a time; the matcher is left where it was."""
        masks = [self.mask(size)]
        for token in tokens:
            self._matcher.consume_token(token)
            self._fresh = False
            masks.append(self.mask(size))
        if tokens:
            self._matcher.rollback(len(tokens))
            self._fresh = False
        return np.stack(masks)

    def accept(self, token: int) -> None:
        """Advance past a sampled token (one the mask allowed)."""
        self._matcher.consume_token(token)
        self._fresh = False

    @property
    def num_words(self) -> int:
        """int32 words of one bitmask row (32 token ids a word, little-endian bits)."""
        return int(self._bits.shape[0])

    @property
    def done(self) -> bool:
        """Nothing more can follow: the output is complete (or the matcher failed, which ends it as well)."""
        return bool(self._matcher.is_stopped() or self._matcher.is_error())


def fill_bitmasks(constraints: Sequence[Constraint], bits: np.ndarray) -> None:
    """Row i of ``bits`` (int32[>= len(constraints), num_words], C-contiguous) := constraint i's next-token bitmask
    (copied where jump-forward already computed it). llguidance drops the GIL while it computes, so this can run
    on a thread beside the model's forward; nothing else may move these matchers meanwhile."""
    row_bytes = bits.shape[1] * bits.itemsize
    addr = bits.ctypes.data
    for i, constraint in enumerate(constraints):
        if constraint._fresh:
            bits[i] = constraint._bits
        else:
            constraint._matcher.unsafe_compute_mask_ptr(addr + i * row_bytes, row_bytes)


def forbidden_of(bits: np.ndarray, eos_token_ids: Iterable[int]) -> np.ndarray:
    """bool[N, 32 * num_words]: True where a bitmask row forbids a token (one vectorised unpack for the batch). A
    row that allows nothing (an error state, never expected) allows the EOS ids, as ``Constraint.mask`` does."""
    forbidden = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little") == 0
    stuck = forbidden.all(axis=1)
    if stuck.any():
        eos = np.array([t for t in eos_token_ids if t < forbidden.shape[1]], dtype=np.intp)
        forbidden[np.ix_(np.flatnonzero(stuck), eos)] = False
    return forbidden

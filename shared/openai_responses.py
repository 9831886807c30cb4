"""OpenAI response pieces shared by the cloud API and the edge agent: SSE framing and logprob shapes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

SSE_DONE = b"data: [DONE]\n\n"


@dataclass(slots=True)
class Logprob:
    """The chosen token's log-probability and the top alternatives at one step."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


_encode = msgspec.json.Encoder().encode


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event in the OpenAI framing (compact JSON, UTF-8; msgspec: several times json.dumps's
    speed, on the path of every streamed token)."""
    return b"data: " + _encode(payload) + b"\n\n"


def token_text(tokenizer: Decoder, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def with_sampled(lp: Logprob) -> list[tuple[int, float]]:
    """``lp``'s top alternatives with the sampled token among them, as OpenAI and vLLM answer: a token drawn from
    outside the top N (at a high temperature) is added after them, so a client always finds the chosen token's
    entry. None asked for (``lp.top`` empty): none given."""
    if not lp.top or any(tid == lp.token_id for tid, _ in lp.top):
        return lp.top
    return [*lp.top, (lp.token_id, lp.logprob)]


def chat_logprob(tokenizer: Decoder, lp: Logprob) -> dict[str, Any]:
    """One entry of ``choices[].logprobs.content`` (chat completions)."""
    token = token_text(tokenizer, lp.token_id)
    return {
        "token": token,
        "logprob": lp.logprob,
        "bytes": list(token.encode()),
        "top_logprobs": [
            {"token": (t := token_text(tokenizer, tid)), "logprob": v, "bytes": list(t.encode())}
            for tid, v in with_sampled(lp)
        ],
    }


def completion_logprobs(tokenizer: Decoder, lps: list[Logprob]) -> dict[str, Any]:
    """``choices[].logprobs`` of (legacy) completions."""
    tokens = [token_text(tokenizer, lp.token_id) for lp in lps]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{token_text(tokenizer, tid): v for tid, v in with_sampled(lp)} for lp in lps],
        "text_offset": offsets,
    }

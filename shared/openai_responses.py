"""OpenAI response pieces shared by the cloud API and the edge agent: SSE framing and logprob shapes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

SSE_DONE = b"data: [DONE]\n\n"


@dataclass(slots=True)
class Logprob:
    """The chosen token's log-probability and the top alternatives at one step (``rank``: the chosen token's rank
    in the distribution, 1 = the most likely; set for prompt tokens, whose vLLM shape carries it)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None


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


def completion_logprobs(
    tokenizer: Decoder,
    lps: list[Logprob],
    prompt_ids: list[int] | None = None,
    prompt_lps: list[Logprob] | None = None,
    offset: int = 0,
) -> dict[str, Any]:
    """``choices[].logprobs`` of (legacy) completions.

    With ``echo`` (``prompt_ids`` and their ``prompt_lps``, one fewer: the first token has no prefix to be
    predicted from), the prompt's tokens come first, as vLLM answers: the first with ``null`` logprob and
    ``null`` top logprobs, then each prompt token's logprob given the tokens before it, then the generated ones.
    ``text_offset`` counts characters of the returned text from ``offset`` (a stream's text so far), over the
    echoed prompt too: each token's text starts where the ones before it end.
    """
    entries: list[tuple[str, float | None, dict[str, float] | None]] = []
    if prompt_ids is not None:
        if prompt_lps is None or len(prompt_lps) != len(prompt_ids) - 1:
            raise ValueError("echoed logprobs need every prompt token's logprob but the first")
        entries.append((token_text(tokenizer, prompt_ids[0]), None, None))
    for lp in [*(prompt_lps or []), *lps]:
        top = {token_text(tokenizer, tid): v for tid, v in with_sampled(lp)}
        entries.append((token_text(tokenizer, lp.token_id), lp.logprob, top))
    offsets, pos = [], offset
    for text, _, _ in entries:
        offsets.append(pos)
        pos += len(text)
    return {
        "tokens": [e[0] for e in entries],
        "token_logprobs": [e[1] for e in entries],
        "top_logprobs": [e[2] for e in entries],
        "text_offset": offsets,
    }


def prompt_logprobs(tokenizer: Decoder, prompt_ids: list[int], lps: list[Logprob]) -> list[dict[str, Any] | None]:
    """``choices[].prompt_logprobs`` in vLLM's shape: ``null`` for the first prompt token, then for each one a map
    from token id to ``{logprob, rank, decoded_token}`` holding the prompt token and the top alternatives asked for
    (rank 1 = the most likely)."""
    out: list[dict[str, Any] | None] = [None]
    for lp in lps:
        entry: dict[str, Any] = {}
        for rank, (tid, v) in enumerate(lp.top, start=1):
            entry[str(tid)] = {"logprob": v, "rank": rank, "decoded_token": token_text(tokenizer, tid)}
        if str(lp.token_id) not in entry:
            entry[str(lp.token_id)] = {
                "logprob": lp.logprob,
                "rank": lp.rank,
                "decoded_token": token_text(tokenizer, lp.token_id),
            }
        out.append(entry)
    if len(out) != len(prompt_ids):
        raise ValueError("prompt logprobs need every prompt token's logprob but the first")
    return out

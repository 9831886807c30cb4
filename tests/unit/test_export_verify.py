"""The verdict on an export from its teacher-forced answers to the source's reference prompts."""

from __future__ import annotations

import numpy as np

from shared.reference_answers import ReferenceAnswers, ReferencePrompt
from shared.zoo.verify import ExportCheck, check_export, verdict

VOCAB = 8


class BigramRunner:
    """A stand-in runtime whose next token is ``table[last token]``: enough to walk the check's bookkeeping."""

    def __init__(self, table: list[int], max_tokens: int = 64) -> None:
        self.table = table
        self.max_tokens = max_tokens
        self.calls: list[list[int]] = []

    def _logits(self, token: int) -> np.ndarray:
        out = np.zeros(VOCAB, np.float32)
        out[self.table[token]] = 1.0
        return out

    def reset(self) -> None:
        self.calls.append([])

    def prefill(self, ids: list[int]) -> np.ndarray:
        self.calls[-1].extend(ids)
        return self._logits(ids[-1])

    def decode(self, token: int) -> np.ndarray:
        self.calls[-1].append(token)
        return self._logits(token)


def _reference(*prompts: ReferencePrompt) -> ReferenceAnswers:
    return ReferenceAnswers({"name": "m@1", "sha256": "0" * 64}, "test", 64, list(prompts))


SOURCE_TABLE = [1, 2, 3, 4, 5, 6, 7, 0]  # the "source": each token is followed by the next one


def test_an_export_with_the_sources_answers_is_exact_and_ready() -> None:
    ref = _reference(ReferencePrompt("short", [0], [1, 2, 3]), ReferencePrompt("long", [0, 1, 2, 3], [4, 5, 6, 7]))
    runner = BigramRunner(SOURCE_TABLE)
    check = check_export(runner, ref)
    assert check.agreement == {"short": 1.0, "long": 1.0} and check.overall == check.long == 1.0
    assert check.first_divergence == {"short": None, "long": None}
    assert verdict(check, None) == ("ready", None)
    # Teacher-forced: the reference's tokens are fed, each through the cache one at a time after the prompt.
    assert runner.calls == [[0, 1, 2], [0, 1, 2, 3, 4, 5, 6]]


def test_one_wrong_choice_rejects_an_fp32_export_and_says_where() -> None:
    table = list(SOURCE_TABLE)
    table[5] = 0  # after token 5 the export answers 0, the source 6
    ref = _reference(ReferencePrompt("short", [0], [1, 2, 3]), ReferencePrompt("long", [0, 1, 2, 3], [4, 5, 6, 7]))
    check = check_export(BigramRunner(table), ref)
    assert check.agreement == {"short": 1.0, "long": 0.75}
    assert check.first_divergence["long"] == 2 and check.overall == 6 / 7
    status, reason = verdict(check, None)
    assert status == "rejected" and reason is not None
    assert "prompt 'long' agrees on 75.0%" in reason and "diverges at token 2" in reason
    # The same numbers pass a quantized format's bound of 0.85, and not one of 0.9.
    assert verdict(check, 0.85) == ("ready", None)
    status, reason = verdict(check, 0.9)
    assert status == "rejected" and reason is not None and "85.7%" in reason and "90.0%" in reason


def test_a_prompt_longer_than_the_exports_context_is_skipped_not_failed() -> None:
    ref = _reference(ReferencePrompt("short", [0], [1]), ReferencePrompt("long", list(range(8)) * 4, [1]))
    check = check_export(BigramRunner(SOURCE_TABLE, max_tokens=16), ref)
    assert check.skipped == ["long"] and check.long is None and check.agreement == {"short": 1.0}
    assert verdict(ExportCheck({}, 0.0, None, {}, ["long"]), None)[0] == "rejected"

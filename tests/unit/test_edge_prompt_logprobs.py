"""The edge runtimes' prefill gives the last position's logits only: a completion that wants the prompt's logprobs
(``echo`` with ``logprobs``, ``prompt_logprobs``, ``max_tokens: 0``) is refused locally with a code naming the
field, which the tiering reads as a cloud-only feature and sends up (as it does ``n > 1``)."""

from __future__ import annotations

from typing import Any

import pytest

from edge_agent.serving import _request
from edge_agent.tiering import Tiering
from shared.errors import ValidationError
from shared.openai_schema import CompletionRequest


@pytest.mark.parametrize(
    "fields",
    [
        {"echo": True, "logprobs": 1, "max_tokens": 1},
        {"echo": True, "logprobs": 0, "max_tokens": 0},
        {"echo": True, "max_tokens": 0},
        {"prompt_logprobs": 2},
    ],
)
def test_prompt_logprobs_on_the_edge_escalate_as_a_cloud_feature(fields: dict[str, Any]) -> None:
    req = CompletionRequest.model_validate({"model": "m", "prompt": "import os\nimport sys", **fields})
    with pytest.raises(ValidationError) as refused:
        _request(object(), [1, 2, 3], req, req.max_tokens, req.logprobs)  # type: ignore[arg-type]
    assert refused.value.code == "unsupported_parameter" and refused.value.param == "prompt_logprobs"
    assert "cloud tier" in refused.value.message
    assert Tiering._pre_signal_of(refused.value) == "cloud-feature"


def test_plain_logprobs_are_not_sent_up() -> None:
    req = CompletionRequest.model_validate({"model": "m", "prompt": "x", "logprobs": 1})
    assert not req.wants_prompt_logprobs  # generated tokens' logprobs: the edge computes them

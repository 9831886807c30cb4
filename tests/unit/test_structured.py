"""shared.structured: the device-safe grammar glue. Importable without llguidance (a device without the extra),
where a structured request is a clear 400; and the request schema's response_format checks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from pydantic import ValidationError

from shared.openai_schema import ChatCompletionRequest, ResponseFormat
from tests.conftest import REPO

WITHOUT_LLGUIDANCE = """
import sys
sys.modules["llguidance"] = None  # import llguidance now raises ImportError, as on a device without the extra
import json
from shared.errors import ApplicationError
from shared.openai_schema import ResponseFormat
from shared import structured
assert not structured.available()
assert structured.grammar_of(None) is None and structured.grammar_of(ResponseFormat(type="text")) is None
try:
    structured.grammar_of(ResponseFormat(type="json_object"))
except ApplicationError as exc:
    print(json.dumps({"status": exc.status_code, **exc.to_openai()["error"]}))
"""


def test_without_the_grammar_engine_a_structured_request_is_a_clear_400() -> None:
    out = subprocess.run(
        [sys.executable, "-c", WITHOUT_LLGUIDANCE], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    error = json.loads(out)
    assert error["status"] == 400 and error["code"] == "structured_output_unavailable"
    assert error["param"] == "response_format" and "tierline[structured]" in error["message"]


def _chat(**fields: object) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": "x"}], **fields}


@pytest.mark.parametrize(
    ("fmt", "words"),
    [
        ({"type": "json_schema"}, "needs the field json_schema"),
        ({"type": "json_object", "regex": "a"}, "regex goes with type 'regex'"),
        ({"type": "choice", "choice": []}, "at least 1 item"),
        ({"type": "yaml"}, "Input should be"),
        ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}, "should match pattern"),
        ({"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "x": 1}}, "Extra inputs"),
    ],
)
def test_a_malformed_response_format_is_refused(fmt: dict[str, object], words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        ChatCompletionRequest.model_validate(_chat(response_format=fmt))


def test_formats_that_could_end_early_are_refused_and_text_is_plain() -> None:
    for extra in ({"stop": ["}"]}, {"ignore_eos": True}):
        with pytest.raises(ValidationError, match="cannot be combined"):
            ChatCompletionRequest.model_validate(_chat(response_format={"type": "json_object"}, **extra))
    assert not ChatCompletionRequest.model_validate(_chat(response_format={"type": "text"}, stop=["x"])).is_structured
    fmt = ResponseFormat.model_validate(
        {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}}}
    )
    assert fmt.json_schema is not None and fmt.json_schema.schema_ == {"type": "object"}

"""The pure cores behind "no 500 on input that parses" and end-user attribution: the iterative JSON bound, the
request schemas' integer and schema limits, the grammar engine's errors in our words, the engine's sampling
bounds, and the one rule for whose end-user budgets a device's request counts against."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError as PydanticValidationError

from cloud.engine.sampling_params import SamplingParams
from controlplane.billing.scopes import Attribution, device_end_user, end_users_config
from shared.edge_protocol import SyncRequest, UsageItem, version_number
from shared.errors import ValidationError
from shared.json_bounds import check_json
from shared.openai_schema import MAX_SCHEMA_VALUES, ChatCompletionRequest, CompletionRequest, check_end_user
from shared.structured import compile_error


def _nested(levels: int) -> Any:
    value: Any = []
    for _ in range(levels - 1):
        value = [value]
    return value


def test_check_json_counts_values_and_refuses_depth_without_recursing() -> None:
    assert check_json(1) == 1
    assert check_json({"a": [1, 2, {"b": None}]}) == 6
    assert check_json(_nested(64)) == 64
    for levels in (65, 100_000):  # far past Python's recursion limit: still a ValueError, not a RecursionError
        with pytest.raises(ValueError, match="more than 64 levels"):
            check_json(_nested(levels))
    with pytest.raises(ValueError, match="more than 10 values"):
        check_json(list(range(10)), max_nodes=10)


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "x"}], **fields}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"seed": 2**100}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"top_k": 2**31}, "top_k"),
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"max_completion_tokens": 2**64}, "max_completion_tokens"),
        ({"user": "u" * 257}, "user"),
    ],
)
def test_integers_and_end_users_past_the_limits_are_refused_naming_them(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(PydanticValidationError) as refused:
        ChatCompletionRequest.model_validate(_chat(**fields))
    assert refused.value.errors()[0]["loc"] == (param,)


def test_values_at_the_limits_are_taken() -> None:
    for seed in (2**63 - 1, -(2**63)):
        assert ChatCompletionRequest.model_validate(_chat(seed=seed, user="u" * 256)).seed == seed
    assert CompletionRequest.model_validate({"model": "m", "prompt": [[0, 2**31 - 1]]}).prompts() == [[0, 2**31 - 1]]
    with pytest.raises(PydanticValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": [2**31]})


def test_tool_schemas_together_are_bounded() -> None:
    properties = {f"p{j}": {"type": "string"} for j in range(100)}
    parameters = {"type": "object", "properties": properties}
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": parameters}} for i in range(128)]
    with pytest.raises(PydanticValidationError) as refused:
        ChatCompletionRequest.model_validate(_chat(tools=tools))
    error = refused.value.errors()[0]
    assert error["loc"] == ("tools",) and str(MAX_SCHEMA_VALUES) in error["msg"]
    assert ChatCompletionRequest.model_validate(_chat(tools=tools[:16])).tools is not None


def test_the_subject_header_gets_the_fields_refusal() -> None:
    assert check_end_user(None, "x-tierline-subject") is None
    assert check_end_user("", "x-tierline-subject") is None
    assert check_end_user("u" * 256, "x-tierline-subject") == "u" * 256
    with pytest.raises(ValidationError, match=r"^x-tierline-subject: an end user id is at most 128 characters"):
        check_end_user("u" * 129, "x-tierline-subject", 128)


def test_grammar_engine_errors_are_told_in_our_words() -> None:
    panic = "panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10\n<backtrace>\n   0: <unknown>"
    error = compile_error("tools", panic)
    assert error.param == "tools" and error.status_code == 400
    assert "too large or too complex" in error.message
    assert "panic" not in error.message and "assert" not in error.message and "u16" not in error.message
    diagnostic = compile_error("response_format", "Invalid type: foo")
    assert diagnostic.message == "response_format: the grammar engine cannot compile it: Invalid type: foo"


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"seed": 2**64}, "seed"), ({"top_k": 2**31}, "top_k"), ({"stop_token_ids": [2**40]}, "stop_token_ids")],
)
def test_the_engine_refuses_what_its_messages_cannot_carry(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ValidationError) as refused:
        SamplingParams(**fields)
    assert refused.value.param == param


def test_device_records_are_bounded_to_what_the_database_holds() -> None:
    base = {"id": "rec-00001", "model": "m", "occurred_at": 1.7e9}
    for fields in ({"latency_ms": 1e300}, {"ttft_ms": float("inf")}, {"occurred_at": float("nan")}):
        with pytest.raises(PydanticValidationError):
            UsageItem.model_validate({**base, **fields})
    with pytest.raises(PydanticValidationError, match="runtime"):
        SyncRequest.model_validate({"runtime": {"x": _nested(100)}})
    assert version_number("9" * 30) is None and version_number("2147483647") == 2**31 - 1
    assert version_number("2147483648") is None


def test_a_device_names_another_end_user_only_if_its_enrollment_allows() -> None:
    dave = Attribution(subject="dave")
    assert device_end_user(dave, None).subject == "dave"
    assert device_end_user(dave, "dave").subject == "dave" and not device_end_user(dave, "dave").is_refused
    refused = device_end_user(dave, "erin")
    assert refused.subject == "dave" and refused.is_refused
    assert "billing.subjects=any" in refused.refusal("body.user")
    anyone = Attribution(subject="dave", may_name_subjects=True)
    assert device_end_user(anyone, "erin").subject == "erin" and not device_end_user(anyone, "erin").is_refused
    nobody = device_end_user(None, "erin")  # an unattributed device: the tenant's budgets only
    assert nobody.subject is None and nobody.is_refused
    assert end_users_config(dave) == {"default": "dave", "may_name_others": False}

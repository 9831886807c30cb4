"""Input that parses is never a 500: a real cloud and a real edge agent on localhost against integers past what
the code behind them holds, JSON nested thousands of levels deep, tool schemas too large for the grammar engine,
device records with numbers no database column holds, and end user ids longer than the limit.

Each answer is a 400 naming the field (``param``) and the limit; values at the limit are served.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from shared.edge_protocol import MAX_USAGE_SUBJECT
from shared.json_bounds import MAX_JSON_DEPTH
from shared.openai_schema import MAX_END_USER_LEN, MAX_SCHEMA_VALUES
from tests.integration.bounds_support import (
    CLOUD_LM,
    EDGE_LM,
    Cloud,
    nested_array,
    nested_schema,
    running_cloud,
    running_edge,
)

pytestmark = pytest.mark.integration
CHAT = {"messages": [{"role": "user", "content": "def f():"}], "max_tokens": 2}
COMPLETION = {"prompt": "def f():", "max_tokens": 2}
DEEP = 500  # levels: decoded, then refused where the value is read, before anything recurses over it
DEEP_SCHEMA = DEEP // 3  # objects: each nests three levels (the object, its properties, the property)
TOO_DEEP = (2000, 100_000)  # levels: past Python's recursion limit, where the JSON decoder itself stops


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory, tiny_zoo: Path, session_data_dir: Path) -> Iterator[Cloud]:
    with running_cloud(tmp_path_factory.mktemp("bounds-cloud"), tiny_zoo, session_data_dir) as c:
        yield c


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory, tiny_zoo: Path, session_data_dir: Path) -> Iterator[str]:
    with running_edge(tmp_path_factory.mktemp("bounds-edge"), tiny_zoo, session_data_dir) as url:
        yield url


def _tiers(cloud: Cloud, edge: str) -> list[tuple[str, str, dict[str, str]]]:
    """(base URL, LM, headers) of each tier."""
    return [(cloud.url, CLOUD_LM, cloud.auth), (edge, EDGE_LM, {})]


def _refused(r: httpx.Response, param: str, *words: str) -> dict[str, Any]:
    assert r.status_code == 400, (r.status_code, r.text[:500])
    error: dict[str, Any] = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert error["message"].startswith(f"{param}: "), error
    for word in words:
        assert word in error["message"], error
    return error


def _post_text(url: str, text: str, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(url, content=text, headers={**headers, "content-type": "application/json"}, timeout=60)


# -- integers ----------------------------------------------------------------------------------------------------
BIG_INTEGERS = [
    ("/v1/completions", {**COMPLETION, "seed": 2**100}, "seed"),
    ("/v1/chat/completions", {**CHAT, "seed": 2**100}, "seed"),
    ("/v1/chat/completions", {**CHAT, "seed": -(2**63) - 1}, "seed"),
    ("/v1/completions", {**COMPLETION, "top_k": 2**100}, "top_k"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 2**64}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 2**63}, "max_completion_tokens"),
]


@pytest.mark.parametrize(("path", "body", "param"), BIG_INTEGERS)
def test_an_integer_past_what_the_code_holds_is_a_400_naming_it_on_both_tiers(
    cloud: Cloud, edge: str, path: str, body: dict[str, Any], param: str
) -> None:
    for url, model, headers in _tiers(cloud, edge):
        r = httpx.post(f"{url}{path}", json={"model": model, **body}, headers=headers, timeout=60)
        _refused(r, param, "less than or equal" if body.get(param, 0) > 0 else "greater than or equal")


def test_a_token_id_past_32_bits_is_a_400_naming_the_prompt_on_both_tiers(cloud: Cloud, edge: str) -> None:
    for url, model, headers in _tiers(cloud, edge):
        for prompt in ([1, 2**100], [[3, 2**64]]):
            r = httpx.post(
                f"{url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1}, headers=headers
            )
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"].startswith("prompt"), r.text


def test_a_seed_anywhere_in_64_bits_is_served_on_both_tiers(cloud: Cloud, edge: str) -> None:
    for url, model, headers in _tiers(cloud, edge):
        for seed in (2**63 - 1, -(2**63), -1):
            for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
                r = httpx.post(
                    f"{url}{path}", json={"model": model, **body, "seed": seed, "temperature": 1.0}, headers=headers
                )
                assert r.status_code == 200, (seed, r.text)


def test_inference_token_ids_that_are_not_32_bit_integers_are_a_400_not_an_engine_crash(cloud: Cloud) -> None:
    bad: list[list[Any]] = [[[True]], [[1, 2**40]], [[1.5]], [[]], [None]]
    for inputs in bad:
        body = {"model_id": CLOUD_LM, "inputs": inputs, "parameters": {"max_tokens": 1}}
        _refused(httpx.post(f"{cloud.url}/v1/inference", json=body, headers=cloud.auth, timeout=60), "inputs")
    body = {"model_id": CLOUD_LM, "inputs": [[1, 2, 3]], "parameters": {"max_tokens": 1}}
    assert httpx.post(f"{cloud.url}/v1/inference", json=body, headers=cloud.auth, timeout=60).status_code == 200


def test_inference_parameters_are_bounded_like_the_openai_fields(cloud: Cloud) -> None:
    for parameters, param in (
        ({"seed": 2**100}, "parameters.seed"),
        ({"top_k": 2**70}, "parameters.top_k"),
        ({"stop_token_ids": [2**100]}, "parameters.stop_token_ids"),
    ):
        body = {"model_id": CLOUD_LM, "inputs": ["def f():"], "parameters": {"max_tokens": 1, **parameters}}
        r = httpx.post(f"{cloud.url}/v1/inference", json=body, headers=cloud.auth, timeout=60)
        _refused(r, param)


# -- nesting -----------------------------------------------------------------------------------------------------
def test_a_json_schema_nested_hundreds_deep_is_a_400_naming_the_field_and_limit_on_both_tiers(
    cloud: Cloud, edge: str
) -> None:
    for url, model, headers in _tiers(cloud, edge):
        fmt = '{"type":"json_schema","json_schema":{"name":"deep","schema":' + nested_schema(DEEP_SCHEMA) + "}}"
        chat = json.dumps({"model": model, **CHAT})[:-1] + ',"response_format":' + fmt + "}"
        _refused(
            _post_text(f"{url}/v1/chat/completions", chat, headers),
            "response_format.json_schema.schema",
            f"{MAX_JSON_DEPTH} levels",
        )
        completion = json.dumps({"model": model, **COMPLETION})[:-1] + ',"response_format":' + fmt + "}"
        _refused(
            _post_text(f"{url}/v1/completions", completion, headers),
            "response_format.json_schema.schema",
            f"{MAX_JSON_DEPTH} levels",
        )
        tool = '{"type":"function","function":{"name":"deep","parameters":' + nested_schema(DEEP_SCHEMA) + "}}"
        tools = json.dumps({"model": model, **CHAT})[:-1] + ',"tools":[' + tool + "]}"
        _refused(
            _post_text(f"{url}/v1/chat/completions", tools, headers),
            "tools.0.function.parameters",
            f"{MAX_JSON_DEPTH} levels",
        )


def _too_deep(r: httpx.Response) -> None:
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "body_too_deep", error
    assert f"{MAX_JSON_DEPTH} levels" in error["message"]


def test_a_body_nested_past_the_json_decoder_is_a_400_on_both_tiers(cloud: Cloud, edge: str) -> None:
    for url, model, headers in _tiers(cloud, edge):
        for levels in TOO_DEEP:
            fmt = '{"type":"json_schema","json_schema":{"name":"deep","schema":' + nested_schema(levels) + "}}"
            chat = json.dumps({"model": model, **CHAT})[:-1] + ',"response_format":' + fmt + "}"
            _too_deep(_post_text(f"{url}/v1/chat/completions", chat, headers))
            body = json.dumps({"model": model, "max_tokens": 1})[:-1] + ',"prompt":' + nested_array(levels) + "}"
            _too_deep(_post_text(f"{url}/v1/completions", body, headers))
            _too_deep(_post_text(f"{url}/v1/chat/completions", nested_array(levels), headers))
    for levels in TOO_DEEP:
        sync = '{"runtime":{"x":' + nested_array(levels) + "}}"
        _too_deep(_post_text(f"{cloud.url}/v1/edge/sync", sync, cloud.device_auth))
        escalate = '{"endpoint":"completions","reason":"x","body":{"prompt":' + nested_array(levels) + "}}"
        _too_deep(_post_text(f"{cloud.url}/v1/edge/escalate", escalate, cloud.device_auth))


def test_inference_inputs_nested_hundreds_deep_are_a_400(cloud: Cloud) -> None:
    body = '{"model_id":"' + CLOUD_LM + '","inputs":[' + nested_array(DEEP) + "]}"
    _refused(_post_text(f"{cloud.url}/v1/inference", body, cloud.auth), "inputs", f"{MAX_JSON_DEPTH} levels")


# -- grammar -----------------------------------------------------------------------------------------------------
def _tools(num_tools: int, num_properties: int) -> list[dict[str, Any]]:
    properties = {f"p{j}": {"type": "string"} for j in range(num_properties)}
    return [
        {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object", "properties": properties}}}
        for i in range(num_tools)
    ]


def test_tools_too_large_for_the_grammar_engine_are_a_400_in_our_words_on_both_tiers(cloud: Cloud, edge: str) -> None:
    for url, model, headers in _tiers(cloud, edge):
        body = {"model": model, **CHAT, "tools": _tools(128, 100)}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)
        error = _refused(r, "tools", "too large", str(MAX_SCHEMA_VALUES))
        assert "panic" not in error["message"] and "assert" not in error["message"]


def test_tools_within_the_limit_are_served(cloud: Cloud, edge: str) -> None:
    for url, model, headers in _tiers(cloud, edge):
        body = {"model": model, **CHAT, "max_tokens": 4, "tools": _tools(16, 20)}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text


# -- the device protocol -----------------------------------------------------------------------------------------
def _usage(**fields: Any) -> dict[str, Any]:
    return {"id": "bounds-0001", "model": "tierline/lm-edge", "occurred_at": 1.0e9, **fields}


DEVICE_CASES = [
    ("/v1/edge/sync", {"usage": [_usage(latency_ms=1e300)]}, "usage.0.latency_ms"),
    ("/v1/edge/sync", {"usage": [_usage(ttft_ms=-1.0)]}, "usage.0.ttft_ms"),
    ("/v1/edge/sync", {"usage": [_usage(occurred_at=1e300)]}, "usage.0.occurred_at"),
    ("/v1/edge/sync", {"usage": [_usage(prompt_tokens=2**63)]}, "usage.0.prompt_tokens"),
    (
        "/v1/edge/shadow",
        {
            "id": "batch-0001",
            "model": "tierline/digits-small",
            "cloud_model": "tierline/digits-large",
            "policy_version": 2**63,
            "inputs": [[0.0]],
            "edge_answers": [1],
            "confidences": [0.5],
            "occurred_at": 1.0e9,
        },
        "policy_version",
    ),
    (
        "/v1/edge/shadow",
        {
            "id": "batch-0002",
            "model": "tierline/lm-edge",
            "cloud_model": CLOUD_LM,
            "policy_version": 1,
            "lm_samples": [{"prompt_ids": [2**100], "edge_tokens": [1], "confidence": 0.5}],
            "vocabulary_sha256": "0" * 64,
            "occurred_at": 1.0e9,
        },
        "lm_samples.0.prompt_ids.0",
    ),
    (
        "/v1/edge/escalate",
        {"endpoint": "completions", "reason": "x", "body": {"model": CLOUD_LM, **COMPLETION, "seed": 2**100}},
        "body.seed",
    ),
]


@pytest.mark.parametrize(("path", "body", "param"), DEVICE_CASES)
def test_a_device_number_past_what_the_cloud_holds_is_a_400_naming_it(
    cloud: Cloud, path: str, body: dict[str, Any], param: str | None
) -> None:
    r = httpx.post(f"{cloud.url}{path}", json=body, headers=cloud.device_auth, timeout=60)
    assert r.status_code == 400, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param, r.text


def test_a_device_number_past_a_float_is_a_400(cloud: Cloud) -> None:
    sync = '{"usage":[{"id":"bounds-inf","model":"m","occurred_at":1e400}]}'
    r = _post_text(f"{cloud.url}/v1/edge/sync", sync, cloud.device_auth)
    assert r.status_code == 400, r.text


def test_a_device_version_number_past_32_bits_is_stored_as_a_name_not_a_500(cloud: Cloud) -> None:
    sync = {"usage": [_usage(id="bounds-version", model_version="9" * 30, occurred_at=1.9e9)]}
    r = httpx.post(f"{cloud.url}/v1/edge/sync", json=sync, headers=cloud.device_auth, timeout=60)
    assert r.status_code == 200, r.text


def test_free_form_device_json_nested_hundreds_deep_is_a_400_naming_it(cloud: Cloud) -> None:
    deep = nested_array(DEEP)
    cases = [
        ("/v1/edge/sync", '{"runtime":{"x":' + deep + "}}", "runtime"),
        ("/v1/edge/sync", '{"metrics":{"x":' + deep + "}}", "metrics"),
        (
            "/v1/edge/sync",
            '{"events":[{"id":"event-deep","kind":"event","occurred_at":1.0,"payload":{"x":' + deep + "}}]}",
            "events.0.payload",
        ),
        ("/v1/edge/escalate", '{"endpoint":"completions","reason":"x","body":{"prompt":' + deep + "}}", "body"),
    ]
    for path, text, param in cases:
        _refused(_post_text(f"{cloud.url}{path}", text, cloud.device_auth), param, f"{MAX_JSON_DEPTH} levels")
    enroll = '{"token":"' + cloud.spare_tokens[0] + '","runtime":{"x":' + deep + "}}"
    _refused(_post_text(f"{cloud.url}/v1/edge/enroll", enroll, {}), "runtime", f"{MAX_JSON_DEPTH} levels")


# -- end user ids ------------------------------------------------------------------------------------------------
def test_the_subject_header_and_the_user_field_share_one_limit_and_one_refusal(cloud: Cloud, edge: str) -> None:
    for url, model, headers, limit in ((cloud.url, CLOUD_LM, cloud.auth, MAX_END_USER_LEN), (edge, EDGE_LM, {}, 128)):
        assert limit == (MAX_END_USER_LEN if url == cloud.url else MAX_USAGE_SUBJECT)
        body = {"model": model, **COMPLETION}
        at_limit = "u" * limit
        for extra_body, extra_headers in (({"user": at_limit}, {}), ({}, {"x-tierline-subject": at_limit})):
            r = httpx.post(
                f"{url}/v1/completions", json={**body, **extra_body}, headers={**headers, **extra_headers}, timeout=60
            )
            assert r.status_code == 200, r.text
        too_long = "u" * 5000
        by_field = httpx.post(f"{url}/v1/completions", json={**body, "user": too_long}, headers=headers, timeout=60)
        by_header = httpx.post(
            f"{url}/v1/completions", json=body, headers={**headers, "x-tierline-subject": too_long}, timeout=60
        )
        reason = f"an end user id is at most {limit} characters, got 5000"
        assert _refused(by_field, "user")["message"] == f"user: {reason}"
        assert _refused(by_header, "x-tierline-subject")["message"] == f"x-tierline-subject: {reason}"

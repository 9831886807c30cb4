"""OpenAI error codes on every 4xx: each kind of client error either tier answers on its OpenAI routes is in
OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` with a ``code`` a client can branch on.

A real cloud and a real edge agent enrolled with it (and a second agent with a local API key, for its 401). Each
case is provoked over HTTP and its ``code`` is the one docs/cloud-api.md#error-codes lists for it; the framework's
own answers (a body that is not JSON, an unknown route or method, a body too large) included, and a 4xx the cloud
gives an escalated request, relayed by the agent as it is. Before issue 41 the 404s, 405s and 413s, bad JSON, field
validation failures and most 400s of the request paths answered ``code: null``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import base_env, free_port, run_server, seed_data_dir
from tests.integration.test_edge_cloud import INT8, Fleet, fleet

pytestmark = pytest.mark.integration
__all__ = ["fleet"]  # the edge-cloud tests' cloud and enrolled agent, started again for this module
CLOUD_LM = "tierline/lm-cloud"
# OpenAI's error types (openai-python's ``_exceptions`` map statuses to classes; the API's ``type`` is one of these).
OPENAI_TYPES = {
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "rate_limit_error",
    "insufficient_quota",
    "server_error",
}


@dataclass(frozen=True)
class Case:
    """One client error: the request, and the status, ``code`` and ``param`` it must get."""

    name: str
    method: str
    path: str
    status: int
    code: str
    param: str | None = None
    body: Any = None  # JSON, or ``bytes`` sent as they are
    headers: dict[str, str] = field(default_factory=dict)
    auth: bool = True  # send the tier's credentials


def _chat(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}


def _common(model: str) -> list[Case]:
    """The kinds of client error both tiers answer alike."""
    huge = b'{"model": "m", "prompt": "' + b"x" * (11 << 20) + b'"}'  # past both tiers' body limits
    return [
        Case("not JSON", "POST", "/v1/chat/completions", 400, "invalid_json", body=b'{"model": '),
        Case("not JSON, completions", "POST", "/v1/completions", 400, "invalid_json", body=b"[1, 2"),
        Case("empty body", "POST", "/v1/responses", 400, "invalid_json", body=b""),
        Case("unknown field", "POST", "/v1/chat/completions", 400, "unsupported_parameter", "foo", _chat(model, foo=1)),
        Case(
            "nested unknown field",
            "POST",
            "/v1/chat/completions",
            400,
            "unsupported_parameter",
            "stream_options.x",
            _chat(model, stream=True, stream_options={"x": 1}),
        ),
        Case(
            "unimplemented field",
            "POST",
            "/v1/chat/completions",
            400,
            "unsupported_parameter",
            "logit_bias",
            _chat(model, logit_bias={"1": 1}),
        ),
        Case(
            "wrong type",
            "POST",
            "/v1/chat/completions",
            400,
            "invalid_type",
            "max_tokens",
            _chat(model, max_tokens="5"),
        ),
        Case(
            "boolean for an integer",
            "POST",
            "/v1/completions",
            400,
            "invalid_type",
            "max_tokens",
            {"model": model, "prompt": "x", "max_tokens": True},
        ),
        Case(
            "out of range",
            "POST",
            "/v1/chat/completions",
            400,
            "invalid_value",
            "temperature",
            _chat(model, temperature=5),
        ),
        Case(
            "not one of the values",
            "POST",
            "/v1/chat/completions",
            400,
            "invalid_value",
            "tool_choice",
            _chat(model, tool_choice="sometimes"),
        ),
        Case(
            "missing field",
            "POST",
            "/v1/chat/completions",
            400,
            "missing_required_parameter",
            "messages",
            {"model": model},
        ),
        Case("store true", "POST", "/v1/chat/completions", 400, "invalid_value", "store", _chat(model, store=True)),
        Case(
            "max_tokens 0 without echo",
            "POST",
            "/v1/completions",
            400,
            "invalid_value",
            "max_tokens",
            {"model": model, "prompt": "x", "max_tokens": 0},
        ),
        Case(
            "required tool choice without tools",
            "POST",
            "/v1/chat/completions",
            400,
            "invalid_value",
            "tool_choice",
            _chat(model, tool_choice="required"),
        ),
        Case(
            "responses: unimplemented field",
            "POST",
            "/v1/responses",
            400,
            "unsupported_parameter",
            "seed",
            {"model": model, "input": "x", "seed": 1},
        ),
        Case(
            "responses: wrong input",
            "POST",
            "/v1/responses",
            400,
            "invalid_type",
            "input",
            {"model": model, "input": 5},
        ),
        Case(
            "context length",
            "POST",
            "/v1/completions",
            400,
            "context_length_exceeded",
            "max_tokens",
            {"model": model, "prompt": "x", "max_tokens": 100_000},
        ),
        Case(
            "subject too long",
            "POST",
            "/v1/chat/completions",
            400,
            "invalid_value",
            "x-tierline-subject",
            _chat(model),
            {"x-tierline-subject": "s" * 5000},
        ),
        Case(
            "unknown model",
            "POST",
            "/v1/chat/completions",
            404,
            "model_not_found",
            "model",
            _chat("tierline/no-such-model"),
        ),
        Case("retrieve unknown model", "GET", "/v1/models/tierline/no-such-model", 404, "model_not_found", "model"),
        Case("unknown route", "POST", "/v1/embeddings", 404, "not_found", body={"model": model, "input": "x"}),
        Case("unknown route, GET", "GET", "/v1/nothing/here", 404, "not_found"),
        Case("wrong method", "GET", "/v1/chat/completions", 405, "method_not_allowed"),
        Case("wrong method on models", "DELETE", "/v1/models", 405, "method_not_allowed"),
        Case("body too large", "POST", "/v1/completions", 413, "request_too_large", body=huge),
    ]


def _cloud_cases() -> list[Case]:
    return [
        *_common(CLOUD_LM),
        Case("no API key", "POST", "/v1/chat/completions", 401, "invalid_api_key", body=_chat(CLOUD_LM), auth=False),
        Case(
            "wrong API key",
            "POST",
            "/v1/completions",
            401,
            "invalid_api_key",
            body={"model": CLOUD_LM, "prompt": "x"},
            headers={"Authorization": "Bearer tl-wrong"},
            auth=False,
        ),
        Case("no API key, models", "GET", "/v1/models", 401, "invalid_api_key", auth=False),
        Case(
            "no API key, responses",
            "POST",
            "/v1/responses",
            401,
            "invalid_api_key",
            body={"model": CLOUD_LM, "input": "x"},
            auth=False,
        ),
        Case(
            "idempotency key on a stream",
            "POST",
            "/v1/chat/completions",
            400,
            "invalid_value",
            "stream",
            _chat(CLOUD_LM, stream=True),
            {"Idempotency-Key": "k-1"},
        ),
    ]


def _edge_cases() -> list[Case]:
    local = {"x-tierline-tier": "edge"}
    return [
        *_common(INT8),
        Case(
            "n above 1 on the device",
            "POST",
            "/v1/completions",
            400,
            "unsupported_value",
            "n",
            {"model": INT8, "prompt": "x", "max_tokens": 4, "n": 2},
            local,
        ),
        Case(
            "a cloud-only field",
            "POST",
            "/v1/chat/completions",
            400,
            "unsupported_parameter",
            "async",
            _chat(INT8, **{"async": True}),
        ),
        Case(
            "unknown tier",
            "POST",
            "/v1/completions",
            400,
            "invalid_value",
            "tier",
            {"model": INT8, "prompt": "x"},
            {"x-tierline-tier": "moon"},
        ),
        Case(
            "unknown model on the device only",
            "POST",
            "/v1/chat/completions",
            404,
            "model_not_found",
            "model",
            _chat("tierline/no-such-model"),
            local,
        ),
        # The cloud's 400 for an escalated request, relayed by the agent as the cloud wrote it.
        Case(
            "escalated context length",
            "POST",
            "/v1/completions",
            400,
            "context_length_exceeded",
            "max_tokens",
            {"model": INT8, "prompt": "x", "max_tokens": 100_000},
            {"x-tierline-tier": "cloud"},
        ),
        Case(
            "escalated unknown model",
            "POST",
            "/v1/chat/completions",
            404,
            "model_not_found",
            "model",
            _chat("tierline/no-such-model"),
            {"x-tierline-tier": "cloud"},
        ),
    ]


def _send(url: str, case: Case, auth: dict[str, str]) -> httpx.Response:
    headers = {**(auth if case.auth else {}), **case.headers}
    if isinstance(case.body, bytes):
        content, headers = case.body, {"content-type": "application/json", **headers}
        return httpx.request(case.method, f"{url}{case.path}", content=content, headers=headers, timeout=60)
    return httpx.request(case.method, f"{url}{case.path}", json=case.body, headers=headers, timeout=60)


def assert_openai_error(r: httpx.Response, case: Case) -> dict[str, Any]:
    """``r`` is ``case``'s status in OpenAI's error shape, with its code (and param, where one is named)."""
    shown = f"{case.name}: {r.status_code} {r.text[:400]}"
    assert r.status_code == case.status, shown
    assert r.headers["content-type"].startswith("application/json"), shown
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, shown
    error: dict[str, Any] = body["error"]
    assert isinstance(error["code"], str) and error["code"] == case.code, shown
    assert error["type"] in OPENAI_TYPES and isinstance(error["message"], str) and error["message"], shown
    if case.param is not None:
        assert error["param"] == case.param, shown
    return error


@pytest.fixture(scope="module")
def cloud_key(fleet: Fleet) -> str:
    return fleet.cli("keys", "create", "--tenant", "acme")


CLOUD_CASES = _cloud_cases()
EDGE_CASES = _edge_cases()


@pytest.mark.parametrize("case", CLOUD_CASES, ids=[c.name for c in CLOUD_CASES])
def test_every_cloud_4xx_has_an_openai_code(fleet: Fleet, cloud_key: str, case: Case) -> None:
    assert_openai_error(_send(fleet.cloud_url, case, {"Authorization": f"Bearer {cloud_key}"}), case)


@pytest.mark.parametrize("case", EDGE_CASES, ids=[c.name for c in EDGE_CASES])
def test_every_edge_4xx_has_an_openai_code(fleet: Fleet, case: Case) -> None:
    assert_openai_error(_send(fleet.edge_url, case, {}), case)


@pytest.fixture(scope="module")
def keyed_edge(tmp_path_factory: pytest.TempPathFactory, tiny_zoo: Path, session_data_dir: Path) -> Iterator[str]:
    """An agent with a local API key (not enrolled: it answers on the device)."""
    data = seed_data_dir(tmp_path_factory.mktemp("keyed-edge"), tiny_zoo, session_data_dir)
    env = base_env(data, TIERLINE_EDGE_ZOO_DIR=str(data / "zoo" / "tiny"), TIERLINE_EDGE_API_KEY="local-secret")
    with run_server(["edge", "run"], env, free_port(), timeout=120) as url:
        yield url


@pytest.mark.parametrize(
    "case",
    [
        Case("no local key", "POST", "/v1/chat/completions", 401, "invalid_api_key", body=_chat(INT8), auth=False),
        Case(
            "wrong local key",
            "GET",
            "/v1/models",
            401,
            "invalid_api_key",
            headers={"Authorization": "Bearer nope"},
            auth=False,
        ),
        Case(
            "no local key, responses",
            "POST",
            "/v1/responses",
            401,
            "invalid_api_key",
            body={"model": INT8, "input": "x"},
            auth=False,
        ),
    ],
    ids=lambda c: c.name,
)
def test_a_keyed_edge_answers_a_missing_or_wrong_key_with_its_code(keyed_edge: str, case: Case) -> None:
    assert_openai_error(_send(keyed_edge, case, {}), case)
    ok = httpx.get(f"{keyed_edge}/v1/models", headers={"Authorization": "Bearer local-secret"})
    assert ok.status_code == 200


@pytest.mark.parametrize("tier", ["cloud", "edge"])
def test_the_sdk_raises_its_typed_errors_with_the_code(fleet: Fleet, cloud_key: str, tier: str) -> None:
    """What a client sees: the SDK's exception class for the status, with ``code`` and ``param`` read from the body."""
    url, key, model = (fleet.cloud_url, cloud_key, CLOUD_LM) if tier == "cloud" else (fleet.edge_url, "local", INT8)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], temperature=9)
    assert (bad.value.code, bad.value.param, bad.value.type) == (
        "invalid_value",
        "temperature",
        "invalid_request_error",
    )
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("tierline/no-such-model")
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as route:
        client.embeddings.create(model=model, input="x")
    assert route.value.code == "not_found"
    with pytest.raises(openai.BadRequestError) as extra:
        client.completions.create(model=model, prompt="x", extra_body={"best_of": 2})
    assert (extra.value.code, extra.value.param) == ("unsupported_parameter", "best_of")


@pytest.mark.parametrize("tier", ["cloud", "edge"])
def test_no_415_a_body_is_read_as_json_whatever_its_content_type(fleet: Fleet, cloud_key: str, tier: str) -> None:
    """Neither tier checks ``content-type`` on its OpenAI routes (a client that sends ``text/plain`` gets its answer),
    so no 415 exists to give a code to; a body that is not JSON is ``invalid_json`` whatever it says it is."""
    url, auth, model = (
        (fleet.cloud_url, {"Authorization": f"Bearer {cloud_key}"}, CLOUD_LM)
        if tier == "cloud"
        else (fleet.edge_url, {}, INT8)
    )
    body = json.dumps({"model": model, "prompt": "x", "max_tokens": 2}).encode()
    r = httpx.post(f"{url}/v1/completions", content=body, headers={**auth, "content-type": "text/plain"}, timeout=60)
    assert r.status_code == 200, r.text
    form = Case("form body", "POST", "/v1/completions", 400, "invalid_json", body=b"model=x&prompt=y")
    headers = {**auth, "content-type": "application/x-www-form-urlencoded"}
    assert_openai_error(httpx.post(f"{url}{form.path}", content=form.body, headers=headers, timeout=60), form)


def test_the_error_code_table_in_the_docs_lists_every_code_tested() -> None:
    docs = (Path(__file__).resolve().parents[2] / "docs" / "cloud-api.md").read_text()
    table = docs.split("## Error codes", 1)[1].split("\n## ", 1)[0]
    codes = {c.code for c in [*CLOUD_CASES, *EDGE_CASES]}
    missing = sorted(c for c in codes if f"`{c}`" not in table)
    assert not missing, f"codes tested but not in docs/cloud-api.md's table: {missing}"

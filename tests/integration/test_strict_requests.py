"""Strict requests over real sockets: a field the API does not implement is a 400 ``unsupported_parameter`` naming
it, on the cloud and on the edge agent, never a 200 that silently ignored what the client asked for. The OpenAI
fields documented as no-ops (``NO_OP_FIELDS``) are accepted."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from shared.openai_schema import NO_OP_FIELDS
from tests.conftest import base_env, free_port, migrated_sqlite, run_server, seed_data_dir
from tests.forkserver import run_tierline

pytestmark = pytest.mark.integration
CLOUD_LM = "tierline/lm-cloud"
EDGE_LM = "tierline/lm-edge-onnx-int8"
CHAT = {"messages": [{"role": "user", "content": "def f():"}], "max_tokens": 2}
COMPLETION = {"prompt": "def f():", "max_tokens": 2}


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory, tiny_zoo: Path, session_data_dir: Path) -> Iterator[dict[str, str]]:
    data = seed_data_dir(tmp_path_factory.mktemp("strict-cloud"), tiny_zoo, session_data_dir)
    env = base_env(
        data,
        TIERLINE_DATABASE_URL=migrated_sqlite(data),
        TIERLINE_CLOUD_ZOO_PRESET="tiny",
        TIERLINE_CLOUD_KV_CACHE_MB="16",
    )

    def cli(*args: str) -> str:
        return run_tierline(*args, env=env, check=True).stdout.strip()

    cli("tenants", "create", "acme")
    key = cli("keys", "create", "--tenant", "acme")
    with run_server(["cloud", "serve"], env, free_port(), timeout=120) as url:
        yield {"url": url, "key": key}


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory, tiny_zoo: Path, session_data_dir: Path) -> Iterator[str]:
    d = seed_data_dir(tmp_path_factory.mktemp("strict-edge"), tiny_zoo, session_data_dir)
    env = base_env(d, TIERLINE_EDGE_ZOO_DIR=str(d / "zoo" / "tiny"))
    with run_server(["edge", "run"], env, free_port()) as url:
        yield url


def _post(url: str, path: str, body: dict[str, Any], key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=60)


def _assert_unsupported(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "unsupported_parameter"
    assert error["param"] == param
    assert error["message"].startswith(f"{param}: unsupported parameter")


CASES = [
    ("/v1/chat/completions", {"model": CLOUD_LM, **CHAT, "logit_bias": {"5": 10}}, "logit_bias"),
    ("/v1/chat/completions", {"model": CLOUD_LM, **CHAT, "audio": {"voice": "alloy"}}, "audio"),
    (
        "/v1/chat/completions",
        {"model": CLOUD_LM, "messages": [{"role": "user", "content": "x", "function_call": {}}], "max_tokens": 2},
        "messages.0.function_call",
    ),
    (
        "/v1/chat/completions",
        {"model": CLOUD_LM, **CHAT, "stream": True, "stream_options": {"x": 1}},
        "stream_options.x",
    ),
    ("/v1/completions", {"model": CLOUD_LM, **COMPLETION, "best_of": 2}, "best_of"),
    ("/v1/inference", {"model_id": CLOUD_LM, "inputs": ["x"], "beam_width": 2}, "beam_width"),
    ("/v1/inference", {"model_id": CLOUD_LM, "inputs": ["x"], "parameters": {"beam": 2}}, "parameters.beam"),
]


@pytest.mark.parametrize(("path", "body", "param"), CASES)
def test_cloud_refuses_a_field_it_does_not_implement(
    cloud: dict[str, str], path: str, body: dict[str, Any], param: str
) -> None:
    _assert_unsupported(_post(cloud["url"], path, body, cloud["key"]), param)


def test_cloud_accepts_the_documented_no_op_fields_and_the_job_fields(cloud: dict[str, str]) -> None:
    assert set(NO_OP_FIELDS) == {"user", "metadata", "store"}
    no_ops = {"user": "u-1", "metadata": {"team": "a"}, "store": False}
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        r = _post(cloud["url"], path, {"model": CLOUD_LM, **body, **no_ops}, cloud["key"])
        assert r.status_code == 200, r.text
    stored = _post(cloud["url"], "/v1/chat/completions", {"model": CLOUD_LM, **CHAT, "store": True}, cloud["key"])
    assert stored.status_code == 400 and stored.json()["error"]["param"] == "store"
    job = _post(cloud["url"], "/v1/completions", {"model": CLOUD_LM, **COMPLETION, "async": True}, cloud["key"])
    assert job.status_code == 202, job.text


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"model": EDGE_LM, **CHAT, "logit_bias": {"5": 10}}, "logit_bias"),
        ("/v1/chat/completions", {"model": EDGE_LM, **CHAT, "functions": []}, "functions"),
        ("/v1/completions", {"model": EDGE_LM, **COMPLETION, "best_of": 2}, "best_of"),
        ("/v1/completions", {"model": EDGE_LM, **COMPLETION, "async": True}, "async"),  # jobs are the cloud's
        (
            "/v1/inference",
            {"model_id": "tierline/clf", "inputs": [[1.0]], "parameters": {"beam": 2}},
            "parameters.beam",
        ),
    ],
)
def test_edge_refuses_a_field_it_does_not_implement(edge: str, path: str, body: dict[str, Any], param: str) -> None:
    _assert_unsupported(_post(edge, path, body), param)


def test_edge_accepts_the_documented_no_op_fields(edge: str) -> None:
    r = _post(edge, "/v1/chat/completions", {"model": EDGE_LM, **CHAT, "user": "u", "metadata": {"a": "b"}})
    assert r.status_code == 200, r.text

"""An ``openai`` backend whose upstream cannot return the prompt's logprobs (an OpenAI-compatible server that
ignores ``echo`` for logprobs and ``prompt_logprobs``) is a clear 400 through ``tierline cloud serve``, billed
nothing, never an answer with generated-only lists (which an evaluation harness would score without an error)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from shared.zoo.registry import ZooLayout
from tests.conftest import base_env, free_port, migrated_sqlite, seed_data_dir, server_process
from tests.forkserver import run_tierline

pytestmark = pytest.mark.integration
MODEL = "remote-plain"


class _PlainUpstream(BaseHTTPRequestHandler):
    """Answers every completion with one generated token's logprobs only, as a server without prompt logprobs."""

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._send({"object": "list", "data": [{"id": "plain", "object": "model"}]})

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["content-length"])))
        logprobs = None
        if request.get("logprobs") is not None:
            logprobs = {"tokens": ["\n"], "token_logprobs": [-0.5], "top_logprobs": [{"\n": -0.5}], "text_offset": [0]}
        choice = {"index": 0, "text": "\n", "finish_reason": "length", "logprobs": logprobs}
        usage = {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}
        self._send({"id": "x", "object": "text_completion", "model": "plain", "choices": [choice], "usage": usage})


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, tiny_zoo: Path, session_data_dir: Path
) -> Iterator[dict[str, str]]:
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), _PlainUpstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    data = seed_data_dir(tmp_path_factory.mktemp("upstream-prompt-logprobs"), tiny_zoo, session_data_dir)
    key_file = data / "upstream.key"
    key_file.write_text("sk-upstream\n")
    key_file.chmod(0o600)
    spec = {
        "type": "openai",
        "endpoints": [f"http://127.0.0.1:{upstream.server_address[1]}"],
        "upstream_model": "plain",
        "tokenizer": str(ZooLayout(tiny_zoo).artifact_dir("lm-cloud")),
        "api_key_file": str(key_file),
    }
    backends = data / "backends.json"
    backends.write_text(json.dumps({"models": {MODEL: spec}}))
    env = base_env(
        data,
        TIERLINE_DATABASE_URL=migrated_sqlite(data),
        TIERLINE_CLOUD_ZOO_PRESET="none",
        TIERLINE_CLOUD_BACKENDS=str(backends),
    )

    def cli(*args: str) -> str:
        proc = run_tierline(*args, env=env, check=True)
        return proc.stdout.strip()

    cli("tenants", "create", "acme")
    key = cli("keys", "create", "--tenant", "acme")
    port = free_port()
    try:
        with server_process(["cloud", "serve"], env, port, timeout=180, log=data / "gateway.log"):
            yield {"url": f"http://127.0.0.1:{port}", "key": key}
    finally:
        upstream.shutdown()
        upstream.server_close()


def _complete(gateway: dict[str, str], **body: Any) -> httpx.Response:
    return httpx.post(
        f"{gateway['url']}/v1/completions",
        json={"model": MODEL, "prompt": "import os\nimport sys", **body},
        headers={"Authorization": f"Bearer {gateway['key']}"},
        timeout=30,
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": 1, "logprobs": 1, "echo": True}, "echo"),
        ({"max_tokens": 0, "logprobs": 1, "echo": True}, "echo"),
        ({"max_tokens": 1, "prompt_logprobs": 1}, "prompt_logprobs"),
    ],
)
def test_an_upstream_without_prompt_logprobs_is_a_400_naming_the_field(
    gateway: dict[str, str], body: dict[str, Any], param: str
) -> None:
    r = _complete(gateway, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == "unsupported_parameter"
    assert "prompt's logprobs" in error["message"]


def test_the_same_upstream_still_answers_plain_logprobs(gateway: dict[str, str]) -> None:
    r = _complete(gateway, max_tokens=1, logprobs=1)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"]["tokens"] == ["\n"]

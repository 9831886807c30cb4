"""``bench.paced_upstream``, the model server of ``bench scale --upstream paced`` (and of the billing test of a
gateway killed before its upstream's first token): OpenAI shapes, one event per token at the set pace, usage when
asked, keep-alive, on a real socket."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from bench.common import served
from tests.conftest import free_port

pytestmark = pytest.mark.integration

TTFT_MS, TOKEN_MS = 60.0, 25.0


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "bench.paced_upstream", "--port", str(port)]
    with served(
        [*cmd, "--ttft-ms", str(TTFT_MS), "--token-ms", str(TOKEN_MS)], dict(os.environ), f"{url}/health", "paced"
    ):
        yield url


def test_a_stream_sends_one_event_per_token_at_the_pace_then_usage_and_done(upstream: str) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
    body["stream_options"] = {"include_usage": True}
    with httpx.Client(base_url=upstream) as client:
        for _ in range(2):  # the second on the same connection
            started, arrivals, events = time.monotonic(), [], []
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        arrivals.append(time.monotonic() - started)
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            tokens = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
            assert len(tokens) == 5 and tokens[-1]["choices"][0]["finish_reason"] == "length"
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
            first = arrivals[1]  # the role chunk goes at once, the first token after the TTFT
            assert first >= TTFT_MS / 1000 * 0.9
            assert arrivals[5] - first >= 4 * TOKEN_MS / 1000 * 0.9, "then one token every TOKEN_MS"


def test_a_plain_request_gets_the_whole_answer_and_an_unknown_path_a_404(upstream: str) -> None:
    answer = httpx.post(f"{upstream}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 3}).json()
    assert answer["choices"][0]["text"] == " word" * 3 and answer["usage"]["completion_tokens"] == 3
    assert httpx.get(f"{upstream}/v1/nothing").status_code == 404

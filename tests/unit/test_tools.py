"""``shared.tools``: calls read back from the generated text, whole and as a stream cut anywhere."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest

from shared.openai_schema import ChatCompletionRequest
from shared.tools import StreamParser, call_text, message, parse_calls

CALLS = [("get_weather", '{"city":"a}\\"b","days":{"n":[1,{}]}}'), ("now", "{}")]
TEXT = "\n".join(call_text(name, args) for name, args in CALLS)


def _stream(text: str, cuts: list[int], finish: str) -> tuple[list[dict[str, Any]], str | None]:
    parser, chunks = StreamParser(), []
    bounds = [0, *cuts, len(text)]
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        chunks += parser.chunks(0, text[a:b], finish if i == len(bounds) - 2 else None)
    return chunks, chunks[-1]["finish_reason"] if chunks else None


def _joined(chunks: list[dict[str, Any]]) -> tuple[str, list[tuple[str, str]], list[str]]:
    content, calls, ids = "", {}, []
    for chunk in chunks:
        delta = chunk["delta"]
        content += delta.get("content", "")
        for d in delta.get("tool_calls", ()):
            if "id" in d:
                ids.append(d["id"])
                calls[d["index"]] = [d["function"]["name"], ""]
            calls[d["index"]][1] += d["function"]["arguments"]
    return content, [(n, a) for n, a in (calls[i] for i in sorted(calls))], ids


def test_whole_calls_are_read_back_exactly() -> None:
    assert parse_calls(TEXT) == CALLS
    msg, finish = message(TEXT, "stop")
    assert finish == "tool_calls" and msg["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == CALLS
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in msg["tool_calls"])


@pytest.mark.parametrize("text", [TEXT[:-3], TEXT + "x", "<tool_call>hi", "hello", TEXT.replace("\n<tool", "<tool")])
def test_anything_else_is_not_calls(text: str) -> None:
    assert parse_calls(text) is None
    assert message(text, "stop") == ({"role": "assistant", "content": text}, "stop")


def test_a_cut_call_is_content_and_length() -> None:
    assert message(TEXT[:40], "length") == ({"role": "assistant", "content": TEXT[:40]}, "length")
    assert message(TEXT, "length")[1] == "length"  # complete text, but max_tokens ended it: not reported as calls


def test_a_stream_cut_anywhere_gives_the_same_calls_ids_first_and_tool_calls_last() -> None:
    rng = random.Random(7)
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, len(TEXT)), rng.randint(0, 30)))
        chunks, finish = _stream(TEXT, cuts, "stop")
        content, calls, ids = _joined(chunks)
        assert (content, calls, finish) == ("", CALLS, "tool_calls"), cuts
        assert len(set(ids)) == 2
        assert all(c["finish_reason"] is None for c in chunks[:-1])
    every_char = _stream(TEXT, list(range(1, len(TEXT))), "stop")
    assert _joined(every_char[0])[1] == CALLS


def test_a_stream_of_text_holds_back_only_what_may_open_a_call() -> None:
    parser = StreamParser()
    assert parser.chunks(0, "<tool", None) == []
    assert parser.chunks(0, "box> hi", None) == [
        {"index": 0, "delta": {"content": "<toolbox> hi"}, "finish_reason": None}
    ]
    assert _joined(_stream("plain text", [1, 5], "length")[0])[0] == "plain text"
    assert _stream("<tool", [2], "stop") == (
        [{"index": 0, "delta": {"content": "<tool"}, "finish_reason": "stop"}],
        "stop",
    )


def test_a_stream_cut_inside_a_call_says_length() -> None:
    chunks, finish = _stream(TEXT[:60], [20, 50], "length")
    assert finish == "length"
    _, calls, _ = _joined(chunks)
    assert calls[0][0] == "get_weather" and TEXT[:60].endswith(calls[0][1])


def test_tool_mode_follows_openais_defaults() -> None:
    tool = {"type": "function", "function": {"name": "f"}}
    base = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    for extra, mode in (
        ({}, "none"),
        ({"tools": [tool]}, "auto"),
        ({"tools": [tool], "tool_choice": "none"}, "none"),
        ({"tools": [tool], "tool_choice": "required"}, "required"),
        ({"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "named"),
    ):
        assert ChatCompletionRequest.model_validate({**base, **extra}).tool_mode == mode

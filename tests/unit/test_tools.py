"""``shared.tools``: calls read back from the generated text, whole and as a stream cut anywhere."""

from __future__ import annotations

import itertools
import json
import random
from typing import Any

import pytest

from shared.openai_schema import ChatCompletionRequest
from shared.tools import CLOSE, StreamParser, call_text, message, parse_calls

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
def test_anything_else_is_not_a_whole_calls_output(text: str) -> None:
    assert parse_calls(text) is None


def test_text_is_content_and_calls_are_never_wrapper_text() -> None:
    assert message("hello", "stop") == ({"role": "assistant", "content": "hello"}, "stop")
    for text in (TEXT[:-3], TEXT + "x", "<tool_call>hi", TEXT.replace("\n<tool", "<tool")):
        msg, _ = message(text, "stop")
        assert msg["content"] is None  # never '<tool_call>...' as content


def _calls(msg: dict[str, Any]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", ())]


def test_a_call_max_tokens_cuts_is_dropped_and_the_complete_ones_before_it_kept() -> None:
    """All or nothing (issue 41): a cut call never shows, neither as arguments nor as content; a call whose
    arguments are complete counts even when its closing wrapper did not fit."""
    second = TEXT.index('\n<tool_call>\n{"name": "now"')
    assert message(TEXT[:40], "length") == ({"role": "assistant", "content": None}, "length")
    assert _calls(message(TEXT[: second + 30], "length")[0]) == CALLS[:1]
    msg, finish = message(TEXT, "length")
    assert _calls(msg) == CALLS and finish == "length"
    for cut in range(1, len(CLOSE) + 2):  # arguments complete, "}\n</tool_call>" cut anywhere
        assert _calls(message(TEXT[:-cut], "length")[0]) == CALLS
    leaked = call_text("get_weather", '{"city":"city","unit":"c"}')[:-1]  # ...}}\n</tool_call
    assert _calls(message(leaked, "length")[0]) == [("get_weather", '{"city":"city","unit":"c"}')]


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


def test_a_stream_sends_each_call_whole_and_never_a_cut_one() -> None:
    chunks, finish = _stream(TEXT[:60], [20, 50], "length")
    assert finish == "length" and _joined(chunks) == ("", [], [])  # cut inside the first call: nothing
    second = TEXT.index('\n<tool_call>\n{"name": "now"')
    rng = random.Random(3)
    for _ in range(100):
        cuts = sorted(rng.sample(range(1, second + 30), rng.randint(0, 10)))
        chunks, finish = _stream(TEXT[: second + 30], cuts, "length")
        content, calls, ids = _joined(chunks)
        assert (content, calls, finish, len(ids)) == ("", CALLS[:1], "length", 1), cuts
        for chunk in chunks:  # each call in one delta, its arguments complete
            for d in chunk["delta"].get("tool_calls", ()):
                assert json.loads(d["function"]["arguments"]) is not None and "id" in d
    leaked = call_text("get_weather", '{"city":"city","unit":"c"}')[:-1]
    chunks, finish = _stream(leaked, [len(leaked) - 5], "length")
    assert _joined(chunks)[1] == [("get_weather", '{"city":"city","unit":"c"}')] and finish == "length"
    assert "</tool_call" not in json.dumps([c["delta"] for c in chunks])  # the wrapper never leaks


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

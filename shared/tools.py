"""Tool calling (``tools``, ``tool_choice``, ``parallel_tool_calls``), shared by both tiers and ``engine serve``:
the grammar a request's calls are generated under, the conversation as the chat template sees it, and the
generated text read back as OpenAI's ``tool_calls`` (whole, or as a stream's deltas).

The call format is Hermes's (Qwen2.5, Hermes 2/3, and most small open models with tool use), one block per call::

    <tool_call>
    {"name": "get_weather", "arguments": {"city":"Paris"}}
    </tool_call>

several calls (``parallel_tool_calls``, the default) separated by a newline, at most ``MAX_PARALLEL_CALLS``.
``required`` generates one call or more, a named choice exactly one call of that function, ``auto`` either text
that does not start with ``<tool_call>`` (under the request's ``response_format`` if it has one) or calls; the
arguments of each call are generated under the grammar of its function's ``parameters`` schema (compact JSON).
``none`` generates text as without tools. The output is a call iff it starts with ``<tool_call>``.

Templates: ``tools`` go to the chat template as ``tools`` (Hugging Face's convention: a template that renders them
shows the model its functions; one that does not, like the tiny zoo's ChatML, leaves them out of the prompt, and
the grammar alone shapes the calls). An assistant message's ``tool_calls`` go to a template that knows
``tool_calls`` as they are (``arguments`` parsed into an object), else into the message's content in the format
above; a ``tool`` message goes with its ``tool_call_id``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shared.errors import ValidationError
from shared.structured import _JSON_OPTIONS, _require, compile_error, grammar_of

if TYPE_CHECKING:
    from shared.chat_tokenizer import ChatTokenizer
    from shared.openai_schema import ChatCompletionRequest, ResponseFormat, Tool

MAX_PARALLEL_CALLS = 8
OPEN = "<tool_call>\n"
CLOSE = "\n</tool_call>"
_NAME_PREFIX = OPEN + '{"name": "'
_ARGS_MARK = '", "arguments": '
_CALL_END = "}" + CLOSE
_MARKER = "<tool_call>"  # an output is calls iff it starts with it
_SEPARATOR = "\n"
# No arguments: exactly ``{}`` (an open object would let a small model add keys until max_tokens).
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def call_text(name: str, arguments: str) -> str:
    """One call in the format the grammar generates (and a template without tool support is shown)."""
    return f"{_NAME_PREFIX}{name}{_ARGS_MARK}{arguments}{_CALL_END}"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# -- grammar -----------------------------------------------------------------------------------------------------
def _schema(tool: Tool, index: int) -> dict[str, Any]:
    params = tool.function.parameters
    if params is None:
        return {"x-guidance": _JSON_OPTIONS, **_NO_PARAMETERS}
    if params.get("type", "object") != "object":
        raise ValidationError(
            f"tools.{index}.function.parameters: must be a JSON schema of type 'object' (the arguments are an "
            f"object), not {json.dumps(params.get('type'))}",
            param=f"tools.{index}.function.parameters",
        )
    return {"x-guidance": _JSON_OPTIONS, **params, "type": "object"}


def _text_rule(fmt: ResponseFormat | None) -> str:
    """The Lark rule of ``auto``'s text answer: free text, or the response_format's, never starting like a call."""
    not_a_call = "~(/<tool_call>(.|\\n)*/)"
    if fmt is None or fmt.type == "text":
        return f"TEXT: /(.|\\n)+/ & {not_a_call}"
    if fmt.type in ("json_object", "json_schema"):
        schema = {"type": "object"} if fmt.type == "json_object" else (fmt.json_schema and fmt.json_schema.schema_)
        return f"text: %json {json.dumps({'x-guidance': _JSON_OPTIONS, **(schema or {})})}"
    if fmt.type == "regex":
        assert fmt.regex is not None
        return "TEXT: /" + fmt.regex.replace("/", "\\/") + f"/ & {not_a_call}"
    assert fmt.choice is not None
    return "text: " + " | ".join(json.dumps(c) for c in fmt.choice)


def grammar(req: ChatCompletionRequest) -> str | None:
    """The llguidance grammar of a chat request's output: its tools' calls (and, for ``auto``, text), else its
    ``response_format``'s; None for free text. A function whose schema the engine cannot compile is a 400 naming it."""
    mode = req.tool_mode
    if mode == "none":
        return grammar_of(req.response_format)
    llg = _require()
    assert req.tools is not None
    rules, calls = [], []
    for i, tool in enumerate(req.tools):
        schema = json.dumps(_schema(tool, i))
        error = llg.LLMatcher.validate_grammar(llg.LLMatcher.grammar_from_lark(f"start: %json {schema}"))
        if error:
            raise compile_error(f"tools.{i}.function.parameters", error)
        name = tool.function.name
        rules.append(f"call_{i}: {json.dumps(_NAME_PREFIX + name + _ARGS_MARK)} args_{i} {json.dumps(_CALL_END)}")
        rules.append(f"args_{i}: %json {schema}")
        calls.append(f"call_{i}")
    if mode == "named":
        assert req.tool_choice is not None and not isinstance(req.tool_choice, str)
        names = [t.function.name for t in req.tools]
        start = f"start: call_{names.index(req.tool_choice.function.name)}"
    else:
        more = (
            f" ({json.dumps(_SEPARATOR)} call){{0,{MAX_PARALLEL_CALLS - 1}}}"
            if req.parallel_tool_calls is not False
            else ""
        )
        start = f"start: call{more}"
        if mode == "auto":
            text = _text_rule(req.response_format)
            start = f"start: {text.split(':', 1)[0]} | calls\ncalls: call{more}\n{text}"
    lark = "\n".join([start, "call: " + " | ".join(calls), *rules])
    return str(llg.LLMatcher.grammar_from_lark(lark))


# -- prompts -----------------------------------------------------------------------------------------------------
def template_messages(req: ChatCompletionRequest, tokenizer: ChatTokenizer) -> list[dict[str, Any]]:
    """The request's messages as the model's chat template takes them (see the module's docstring)."""
    native = "tool_calls" in tokenizer.template_for(has_tools=bool(req.tools))
    messages: list[dict[str, Any]] = []
    for m in req.messages:
        message: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            if native:
                message["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": c.type,
                        "function": {"name": c.function.name, "arguments": _loaded(c.function.arguments)},
                    }
                    for c in m.tool_calls
                ]
            else:
                calls = _SEPARATOR.join(call_text(c.function.name, c.function.arguments) for c in m.tool_calls)
                message["content"] = f"{message['content']}\n{calls}" if message["content"] else calls
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None and m.role == "tool":
            message["name"] = m.name
        messages.append(message)
    return messages


def _loaded(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # sent as it came: the template shows what the model said


def chat_prompt(req: ChatCompletionRequest, tokenizer: ChatTokenizer) -> str:
    """The prompt text of a chat request: its messages (and tools) through the model's chat template."""
    tools = [t.model_dump(mode="json", exclude_none=True) for t in req.tools] if req.tools else None
    return tokenizer.apply_chat_template(template_messages(req, tokenizer), add_generation_prompt=True, tools=tools)


# -- outputs -----------------------------------------------------------------------------------------------------
def parse_calls(text: str) -> list[tuple[str, str]] | None:
    """``(name, arguments)`` of each call when ``text`` is calls in the format and nothing else; else None."""
    calls, pos = [], 0
    while True:
        if not text.startswith(_NAME_PREFIX, pos):
            return None
        end = text.find(CLOSE, pos)
        if end == -1:
            return None
        body = text[pos + len(OPEN) : end]
        name_end = body.find(_ARGS_MARK)
        if name_end == -1 or not body.endswith("}"):
            return None
        name, arguments = body[len(_NAME_PREFIX) - len(OPEN) : name_end], body[name_end + len(_ARGS_MARK) : -1]
        try:
            if json.loads(body).get("name") != name or not isinstance(json.loads(arguments), dict):
                return None
        except ValueError:
            return None
        calls.append((name, arguments))
        pos = end + len(CLOSE)
        if pos == len(text):
            return calls
        if not text.startswith(_SEPARATOR, pos):
            return None
        pos += len(_SEPARATOR)


def message(text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
    """A whole answer's ``message`` and ``finish_reason``: complete calls are ``tool_calls`` (content null,
    "tool_calls"); text, or calls that max_tokens cut ("length"), stay content."""
    calls = parse_calls(text) if finish_reason == "stop" else None
    if calls is None:
        return {"role": "assistant", "content": text}, finish_reason
    tool_calls = [
        {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
        for name, arguments in calls
    ]
    return {"role": "assistant", "content": None, "tool_calls": tool_calls}, "tool_calls"


def _held(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker``."""
    for k in range(min(len(marker), len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


@dataclass(slots=True)
class StreamParser:
    """One choice's streamed text turned into OpenAI's deltas: ``content``, or ``tool_calls`` entries (index, id,
    type and name first, then fragments of ``arguments``). Text that may still become a call is held back.

    Only for outputs generated under ``grammar`` (``calls_tools``): an output that starts with ``<tool_call>`` is
    calls in the format, whole or cut by max_tokens."""

    is_text: bool | None = None  # undecided until the output starts with a call's opening, or cannot
    buffer: str = ""
    calls: int = 0  # calls started
    in_args: bool = False  # inside a call's arguments (the last call started is not closed yet)

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas (``{"content": ...}`` or ``{"tool_calls": [...]}``) that ``text`` completes."""
        self.buffer += text
        if self.is_text is None:
            if _MARKER.startswith(self.buffer):
                return []  # "<tool_c...": may become a call
            self.is_text = not self.buffer.startswith(_MARKER)
        deltas: list[dict[str, Any]] = []
        if self.is_text:
            deltas, self.buffer = [{"content": self.buffer}] if self.buffer else [], ""
            return deltas
        while self.buffer:
            if not self.in_args:  # a call's opening (after a separator, past the first), up to its name's end
                mark = self.buffer.find(_ARGS_MARK)
                if mark == -1:
                    break
                opening = (_SEPARATOR if self.calls else "") + _NAME_PREFIX
                call: dict[str, Any] = {"index": self.calls, "id": new_call_id(), "type": "function"}
                call["function"] = {"name": self.buffer[len(opening) : mark], "arguments": ""}
                deltas.append({"tool_calls": [call]})
                self.calls, self.in_args = self.calls + 1, True
                self.buffer = self.buffer[mark + len(_ARGS_MARK) :]
            end = self.buffer.find(_CALL_END)  # arguments cannot hold a raw newline: the first end is the end
            upto = end if end != -1 else len(self.buffer) - _held(self.buffer, _CALL_END)
            if upto > 0:
                fragment: dict[str, Any] = {"index": self.calls - 1, "function": {"arguments": self.buffer[:upto]}}
                deltas.append({"tool_calls": [fragment]})
            if end == -1:
                self.buffer = self.buffer[upto:]
                break
            self.buffer, self.in_args = self.buffer[end + len(_CALL_END) :], False
        return deltas

    def finish(self, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The deltas held back at the end, and the choice's ``finish_reason`` ("tool_calls" for complete calls;
        a cut call says "length": its fragments went out, and its arguments are incomplete)."""
        if not self.is_text and self.is_text is not None:
            is_whole = finish_reason == "stop" and self.calls and not self.in_args and not self.buffer
            held: list[dict[str, Any]] = []
            if self.in_args and self.buffer:  # a cut call's last characters, held in case they closed it
                held.append({"tool_calls": [{"index": self.calls - 1, "function": {"arguments": self.buffer}}]})
            self.buffer = ""
            return held, "tool_calls" if is_whole else finish_reason
        deltas, self.buffer = [{"content": self.buffer}] if self.buffer else [], ""
        return deltas, finish_reason

    def chunks(self, index: int, text: str, finish_reason: str | None) -> list[dict[str, Any]]:
        """A stream's ``choices`` entries for one step of choice ``index`` (its new text; its finish_reason on its
        last step): a delta each, the last one carrying the finish_reason."""
        deltas = self.feed(text) if text else []
        finish = None
        if finish_reason is not None:
            held, finish = self.finish(finish_reason)
            deltas += held
        chunks: list[dict[str, Any]] = [{"index": index, "delta": d, "finish_reason": None} for d in deltas]
        if finish is not None:
            if not chunks:
                chunks.append({"index": index, "delta": {}, "finish_reason": None})
            chunks[-1]["finish_reason"] = finish
        return chunks

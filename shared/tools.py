"""Tool calling (``tools``, ``tool_choice``, ``parallel_tool_calls``), shared by both tiers and ``engine serve``:
the grammar a request's calls are generated under, the conversation as the chat template sees it, and the
generated text read back as OpenAI's ``tool_calls`` (whole, or as a stream's deltas), all or nothing: a call
appears only once its arguments are a complete JSON object, and a call max_tokens cuts is dropped (``finish_reason``
"length", the complete calls before it kept), never shown as wrapper text.

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


_DECODER = json.JSONDecoder()


def _arguments_end(text: str, start: int) -> int | None:
    """Where the complete JSON object at ``text[start:]`` (a call's arguments) ends; None while it is incomplete
    (no prefix of an object parses as one) or when it is not an object."""
    try:
        value, end = _DECODER.raw_decode(text, start)
    except ValueError:
        return None
    return end if isinstance(value, dict) else None


def leading_calls(text: str) -> tuple[list[tuple[str, str]], int]:
    """The complete calls a calls output begins with, and how much of ``text`` they take. A call is complete once
    its arguments are a complete JSON object (the grammar made them valid for its schema): the closing
    ``}\n</tool_call>`` need not have fitted. What follows the last complete call (a call cut by max_tokens) is
    not a call and is never shown."""
    calls: list[tuple[str, str]] = []
    pos = 0
    while True:
        opening = (_SEPARATOR if calls else "") + _NAME_PREFIX
        if not text.startswith(opening, pos):
            return calls, pos
        mark = text.find(_ARGS_MARK, pos + len(opening))
        if mark == -1:
            return calls, pos
        start = mark + len(_ARGS_MARK)
        end = _arguments_end(text, start)
        if end is None:
            return calls, pos
        calls.append((text[pos + len(opening) : mark], text[start:end]))
        rest = text[end : end + len(_CALL_END)]
        if not _CALL_END.startswith(rest):  # not the format: the call stands, nothing after it is read
            return calls, end
        pos = end + len(rest)


def message(text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
    """A whole answer's ``message`` and ``finish_reason``. Text is ``content``. Calls are all or nothing: each
    complete call is a ``tool_calls`` entry ("tool_calls" when the output ended by itself); a call max_tokens cut
    is dropped ("length", the complete calls before it kept), and the wrapper text never reaches ``content``."""
    if not text.startswith(_MARKER):
        return {"role": "assistant", "content": text}, finish_reason
    calls, _ = leading_calls(text)
    msg: dict[str, Any] = {"role": "assistant", "content": None}
    if calls:
        msg["tool_calls"] = [
            {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
            for name, arguments in calls
        ]
    return msg, ("tool_calls" if calls else finish_reason) if finish_reason == "stop" else finish_reason


@dataclass(slots=True)
class StreamParser:
    """One choice's streamed text turned into OpenAI's deltas: ``content``, or ``tool_calls`` entries. Text that
    may still become a call is held back. A call is sent whole (index, id, type, name and its complete arguments in
    one delta) once its arguments are complete: a call max_tokens cuts is never sent, and the wrapper text never
    is (all or nothing, as ``message``).

    Only for outputs generated under ``grammar`` (``calls_tools``): an output that starts with ``<tool_call>`` is
    calls in the format, whole or cut by max_tokens."""

    is_text: bool | None = None  # undecided until the output starts with a call's opening, or cannot
    buffer: str = ""  # text: what is held back; calls: the whole output so far
    calls: int = 0  # calls sent

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas (``{"content": ...}`` or ``{"tool_calls": [...]}``) that ``text`` completes."""
        self.buffer += text
        if self.is_text is None:
            if _MARKER.startswith(self.buffer):
                return []  # "<tool_c...": may become a call
            self.is_text = not self.buffer.startswith(_MARKER)
        if self.is_text:
            content, self.buffer = self.buffer, ""
            return [{"content": content}] if content else []
        calls, _ = leading_calls(self.buffer)  # outputs are short: reading them again per step is cheap
        deltas: list[dict[str, Any]] = [
            {
                "tool_calls": [
                    {
                        "index": i,
                        "id": new_call_id(),
                        "type": "function",
                        "function": {"name": name, "arguments": arguments},
                    }
                ]
            }
            for i, (name, arguments) in enumerate(calls[self.calls :], start=self.calls)
        ]
        self.calls = len(calls)
        return deltas

    def finish(self, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The deltas held back at the end, and the choice's ``finish_reason``: "tool_calls" when the calls ended
        by themselves; "length" when max_tokens cut (the complete calls were sent, the cut one never is)."""
        if self.is_text is False:
            self.buffer = ""
            return [], ("tool_calls" if self.calls else finish_reason) if finish_reason == "stop" else finish_reason
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

"""OpenAI's Responses API (``POST /v1/responses``) on both tiers, as a translation of the chat completion path.

A Responses request becomes a chat completion request (``ResponsesRequest.to_chat``) and goes down the path chat
takes on each tier, so it is metered, limited, budgeted, routed and escalated exactly as chat is; the chat answer
is translated back (``to_response``, or ``shared.responses_stream`` for a stream's server-sent events).
Stateless: nothing is stored, so ``store: true`` and ``previous_response_id`` are refused (400
``unsupported_parameter``) and the conversation travels as ``input`` items.

The mapping: ``instructions`` is a system message first; an input message is a chat message of its role (text
parts joined); consecutive ``function_call`` items are one assistant message's ``tool_calls`` (``call_id`` is the
call's id); a ``function_call_output`` item is a ``tool`` message; ``max_output_tokens`` is ``max_tokens``;
``tools`` (flat function tools) and ``tool_choice`` are chat's; ``text.format`` is ``response_format``. Back: the
text is one ``message`` output item of ``output_text``, each tool call a ``function_call`` item; ``finish_reason:
"length"`` is ``status: "incomplete"`` with ``incomplete_details.reason: "max_output_tokens"``.

Strict like every request schema here (``shared.openai_schema``): a field this server does not implement is a 400
``unsupported_parameter`` naming it, and so are the fields OpenAI has that need what this server lacks (stored
responses, reasoning models, background runs, ``include``d extras).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, TypeVar

from pydantic import Discriminator, Field, Tag, model_validator
from pydantic import ValidationError as PydanticValidationError

from shared.errors import ValidationError
from shared.openai_schema import (
    _BOOLEAN,
    _FREE_JSON,
    _INTEGER,
    _NUMBER,
    _SCHEMA,
    MAX_INT32,
    ChatCompletionRequest,
    _Request,
)

Chat = TypeVar("Chat", bound=ChatCompletionRequest)
MIN_OUTPUT_TOKENS = 16  # OpenAI's lower bound on max_output_tokens
MAX_INPUT_ITEMS = 4096
_UNSUPPORTED = "unsupported_parameter"


# -- the request ---------------------------------------------------------------------------------------------------
class InputText(_Request):
    type: Literal["input_text"]
    text: str


class OutputText(_Request):
    """An assistant message's text, as this server's output items carry it (sent back in a conversation)."""

    type: Literal["output_text"]
    text: str
    annotations: Annotated[list[Any] | None, _FREE_JSON] = None  # accepted, not read
    logprobs: Annotated[list[Any] | None, _FREE_JSON] = None  # accepted, not read


def _text_or(tag: str, what: str) -> Discriminator:
    """A field that is a string or a list: validated as the one the value is (a bad list item is refused naming
    its place, ``input.items.0...``, not first as "not a string"; OpenAPI shows both)."""

    def kind(value: Any) -> str | None:
        return "text" if isinstance(value, str) else tag if isinstance(value, list) else None

    return Discriminator(
        kind, custom_error_type="string_or_list", custom_error_message=f"expected a string or a list of {what}"
    )


def _joined(value: str | list[Any]) -> str:
    return value if isinstance(value, str) else "".join(p.text for p in value)


_Part = Annotated[InputText | OutputText, Field(discriminator="type")]
_ItemStatus = Literal["in_progress", "completed", "incomplete"]


class MessageItem(_Request):
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: Annotated[
        Annotated[str, Tag("text")] | Annotated[list[_Part], Tag("parts")], _text_or("parts", "content parts")
    ]
    id: str | None = Field(None, max_length=256)
    status: _ItemStatus | None = None


class FunctionCallItem(_Request):
    """A call the model made (an earlier response's ``function_call`` output item)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=64)
    arguments: str = Field(max_length=1 << 20)
    id: str | None = Field(None, max_length=256)
    status: _ItemStatus | None = None


class FunctionCallOutputItem(_Request):
    """What the caller's function returned for the call ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: Annotated[
        Annotated[str, Tag("text")] | Annotated[list[InputText], Tag("parts")], _text_or("parts", "content parts")
    ]
    id: str | None = Field(None, max_length=256)
    status: _ItemStatus | None = None


def _item_type(value: Any) -> str | None:
    """An input item's kind: its ``type``, and a message when it has none (OpenAI's "easy" input message)."""
    if isinstance(value, dict):
        kind = value.get("type", "message")
        return kind if isinstance(kind, str) else None
    return getattr(value, "type", None) or "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(
        _item_type,
        custom_error_type="input_item_type",
        custom_error_message="an input item is a message, a function_call or a function_call_output",
    ),
]


class FunctionTool(_Request):
    """``tools[]``: a function the model may call (the Responses API's flat shape)."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = Field(None, max_length=8192)
    parameters: Annotated[dict[str, Any] | None, _SCHEMA] = None
    strict: Annotated[bool | None, _BOOLEAN] = None


class FunctionChoice(_Request):
    """``tool_choice: {"type": "function", "name": ...}``: call exactly this function."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)


class TextFormat(_Request):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with its ``name`` and ``schema``."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    schema_: Annotated[dict[str, Any] | None, _SCHEMA] = Field(None, alias="schema")
    description: str | None = None
    strict: Annotated[bool | None, _BOOLEAN] = None

    @model_validator(mode="after")
    def _check(self) -> TextFormat:
        given = [k for k in ("name", "schema_", "description", "strict") if getattr(self, k) is not None]
        if self.type != "json_schema" and given:
            raise ValueError(f"{given[0].rstrip('_')} goes with type 'json_schema', not '{self.type}'")
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("type 'json_schema' needs name and schema")
        return self


class TextConfig(_Request):
    format: TextFormat | None = None


class ResponsesRequest(_Request):
    """``POST /v1/responses``: OpenAI's fields this server implements, and those it refuses by name."""

    model: str = Field(min_length=1, max_length=256)
    input: Annotated[
        Annotated[str, Tag("text")] | Annotated[list[InputItem], Tag("items"), Field(max_length=MAX_INPUT_ITEMS)],
        _text_or("items", "input items"),
    ]
    instructions: str | None = None
    max_output_tokens: Annotated[int | None, _INTEGER] = Field(None, ge=MIN_OUTPUT_TOKENS, le=MAX_INT32)
    temperature: Annotated[float | None, _NUMBER] = Field(None, ge=0.0, le=2.0)
    top_p: Annotated[float | None, _NUMBER] = Field(None, gt=0.0, le=1.0)
    stream: Annotated[bool | None, _BOOLEAN] = None
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: Annotated[bool | None, _BOOLEAN] = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = None
    # OpenAI's, refused unless they ask for nothing (``check``): nothing is stored, no model reasons.
    store: Annotated[bool | None, _BOOLEAN] = None
    previous_response_id: str | None = None
    reasoning: Annotated[dict[str, Any] | None, _FREE_JSON] = None
    include: list[str] | None = Field(None, max_length=16)
    background: Annotated[bool | None, _BOOLEAN] = None

    def check(self) -> None:
        """Refuse (400 ``unsupported_parameter``, naming the field) what needs state or models this server lacks."""
        refusals = [
            (self.store, "store", "stored responses are not supported; send store: false"),
            (
                self.previous_response_id is not None,
                "previous_response_id",
                "responses are not stored, so none can be continued; send the conversation as input items",
            ),
            (self.reasoning is not None, "reasoning", "no reasoning model is served; leave reasoning out"),
            (bool(self.include), "include", "no extra output data is available; leave include out"),
            (self.background, "background", "background responses are not supported; leave background out"),
        ]
        for refused, param, reason in refusals:
            if refused:
                raise ValidationError(f"{param}: {reason}", param=param, code=_UNSUPPORTED)

    def to_chat(self, chat_type: type[Chat]) -> Chat:
        """The chat completion request that answers this one (streamed with usage when this one streams)."""
        self.check()
        body: dict[str, Any] = {"model": self.model, "messages": self._messages()}
        if self.max_output_tokens is not None:
            body["max_tokens"] = self.max_output_tokens
        for name in ("temperature", "top_p", "parallel_tool_calls", "user"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        if self.tools:
            body["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in self.tools
            ]
        if isinstance(self.tool_choice, FunctionChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None:
            body["response_format"] = _response_format(fmt)
        try:
            return chat_type.model_validate(body)
        except PydanticValidationError as exc:
            raise _named_as_responses(exc) from None

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        for item in self.input:
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": _joined(item.content)})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _joined(item.output)})
            else:  # a call: joins the assistant message before it when that one is the turn it belongs to
                function = {"name": item.name, "arguments": item.arguments}
                call = {"id": item.call_id, "type": "function", "function": function}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        return messages

    def settings(self) -> dict[str, Any]:
        """The request's settings as a Response echoes them (OpenAI's defaults where it sent none)."""
        fmt = self.text.format if self.text is not None and self.text.format is not None else None
        choice: Any = self.tool_choice.model_dump() if isinstance(self.tool_choice, FunctionChoice) else None
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {},
            "parallel_tool_calls": self.parallel_tool_calls if self.parallel_tool_calls is not None else True,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "temperature": self.temperature if self.temperature is not None else 1.0,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": choice or self.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in self.tools or []],
            "top_p": self.top_p if self.top_p is not None else 1.0,
            "truncation": "disabled",
            "user": self.user,
        }


def _response_format(fmt: TextFormat) -> dict[str, Any]:
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    schema = {"name": fmt.name, "schema": fmt.schema_, "description": fmt.description, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


# Where a chat field's error lands in the Responses request: the field the client sent.
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


def _named_as_responses(exc: PydanticValidationError) -> ValidationError:
    """A chat request's validation error, naming the Responses field it came from."""
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"]]
    if loc and loc[0] in _PARAMS:
        loc = [_PARAMS[loc[0]]]
    elif loc[:1] == ["tools"]:
        loc = [p for p in loc if p != "function"]
    param = ".".join(loc) or None
    reason = str(err["msg"]).removeprefix("Value error, ")
    return ValidationError(f"{param}: {reason}" if param else reason, param=param)


# -- the answer ----------------------------------------------------------------------------------------------------
def id_suffix(chat_id: Any) -> str:
    """The id a chat answer carries, less its ``chatcmpl-`` prefix: the Response's and its items' ids end in it."""
    text = str(chat_id or "")
    return text.partition("-")[2] or text or uuid.uuid4().hex


def usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """A chat completion's ``usage`` in the Responses API's shape."""
    if chat_usage is None:
        return None
    details = chat_usage.get("prompt_tokens_details") or {}
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": details.get("cached_tokens") or 0},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part]}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def envelope(req: ResponsesRequest, response_id: str, created_at: int, model: str, status: str) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": None,
        "incomplete_details": None,
        "model": model,
        "output": [],
        "usage": None,
        **req.settings(),
    }


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason in ("length", "content_filter") else "completed"


def incomplete_reason(finish_reason: str | None) -> str:
    return "content_filter" if finish_reason == "content_filter" else "max_output_tokens"


def to_response(req: ResponsesRequest, chat: dict[str, Any]) -> dict[str, Any]:
    """A chat completion (the answer to ``req.to_chat``) as a Response object."""
    suffix = id_suffix(chat.get("id"))
    choice = chat["choices"][0]
    message, finish_reason = choice["message"], choice.get("finish_reason")
    status = status_of(finish_reason)
    response = envelope(req, f"resp_{suffix}", int(chat.get("created") or time.time()), chat["model"], status)
    response["incomplete_details"] = {"reason": incomplete_reason(finish_reason)} if status == "incomplete" else None
    output: list[dict[str, Any]] = []
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        output.append(message_item(f"msg_{suffix}", message.get("content") or "", status))
    for i, call in enumerate(calls):
        fn = call["function"]
        output.append(call_item(f"fc_{suffix}_{i}", call["id"], fn["name"], fn["arguments"], "completed"))
    response["output"] = output
    response["usage"] = usage(chat.get("usage"))
    return response

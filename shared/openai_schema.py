"""OpenAI-compatible request schemas shared by the cloud API and the edge agent's local API.

Strict: a field this server does not implement is refused (400, ``code: unsupported_parameter``, ``param`` names
it), never silently dropped — a client that asks for something gets it or an error. The OpenAI fields accepted
as no-ops are ``NO_OP_FIELDS`` (listed in docs/cloud-api.md). Known fields are validated strictly, JSON types
included (``"5"`` and ``true`` are not integers, ``"0.5"`` is not a number, an integer is), and ``shared.http``
turns a failure into the OpenAI error shape naming the field (``param``).

Every integer is bounded to what the code behind it holds (``seed`` to 64 bits, counts and token ids to 32), and
every free-form JSON value (a ``response_format`` schema, a tool's ``parameters``, ``/v1/inference`` inputs) is
checked for depth and size before anything walks it (``shared.json_bounds``): input that parses is answered with a
400 naming the field and the limit, never a 500. The limits are listed in docs/cloud-api.md.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic import ValidationError as PydanticValidationError

from shared.errors import ValidationError
from shared.json_bounds import MAX_JSON_DEPTH, check_json

MAX_STOP_SEQUENCES = 4
# Integer bounds: a seed is 64 bits (OpenAI's range), every count and token id fits 32 (what the engines' tensors,
# msgspec messages and the database's columns hold).
MIN_SEED, MAX_SEED = -(1 << 63), (1 << 63) - 1
MAX_INT32 = (1 << 31) - 1
# JSON schemas (response_format's, and all of a request's tool parameters together): what the grammar engine
# compiles in well under a second; beyond, llguidance runs out of grammar symbols (about 65,000).
MAX_SCHEMA_DEPTH = MAX_JSON_DEPTH  # levels of objects and arrays (an object property is two: properties, name)
MAX_SCHEMA_VALUES = 10_000
# An end user id (``user``, or the ``x-tierline-subject`` header in its place): one limit and one refusal for both.
MAX_END_USER_LEN = 256


def _json_type(value: Any) -> str:
    for kind, name in ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string")):
        if isinstance(value, kind):
            return name
    if isinstance(value, list):
        return "an array"
    return "an object" if isinstance(value, dict) else type(value).__name__


def _exactly(what: str, *kinds: type) -> BeforeValidator:
    """Refuse a value of another JSON type before pydantic's lax mode (which Litestar validates bodies in, whatever
    the model's config says) turns ``"5"`` or ``true`` into 5 or 1; null is left to the field's own type."""

    def check(value: Any) -> Any:
        if value is None or (isinstance(value, kinds) and (bool in kinds or not isinstance(value, bool))):
            return value
        raise ValueError(f"expected {what}, got {_json_type(value)}")

    return BeforeValidator(check)


_INTEGER = _exactly("an integer", int)
# A token id fits 32 bits here; whether it is in the model's vocabulary (a negative one is not) is the model's
# check, with its own 400 (``invalid_token_id`` on a device, naming the vocabulary's range).
_TOKEN_ID = Annotated[int, Field(ge=-MAX_INT32 - 1, le=MAX_INT32)]
_NUMBER = _exactly("a number", int, float)
_BOOLEAN = _exactly("a boolean", bool)


def _bounded_json(max_depth: int, max_nodes: int | None = None) -> BeforeValidator:
    """Refuse a free-form value nested deeper than ``max_depth`` (or holding more than ``max_nodes`` values)
    before pydantic or anything after it walks it (``shared.json_bounds.check_json``, iterative)."""

    def check(value: Any) -> Any:
        check_json(value, max_depth=max_depth, max_nodes=max_nodes)
        return value

    return BeforeValidator(check)


_SCHEMA = _bounded_json(MAX_SCHEMA_DEPTH, MAX_SCHEMA_VALUES)
_FREE_JSON = _bounded_json(MAX_JSON_DEPTH)


# OpenAI request fields accepted and ignored on purpose: they change nothing this server computes (``user`` is an
# end-user id for abuse tracking, which canary routing also uses as a sticky subject; ``metadata`` tags a stored
# completion; ``store: false`` asks for what happens anyway). ``store: true`` is refused: nothing is stored.
NO_OP_FIELDS = ("user", "metadata", "store")


def end_user_problem(value: str, max_len: int = MAX_END_USER_LEN) -> str | None:
    """Why ``value`` cannot be an end user id (too long), or None: the one rule for ``user`` and the header."""
    if len(value) > max_len:
        return f"an end user id is at most {max_len} characters, got {len(value)}"
    return None


def check_end_user(value: str | None, param: str, max_len: int = MAX_END_USER_LEN) -> str | None:
    """``value`` (None when empty: no one named), or a 400 naming ``param`` when it is too long to be an end user id."""
    problem = end_user_problem(value, max_len) if value else None
    if problem is not None:
        raise ValidationError(f"{param}: {problem}", param=param)
    return value or None


UNSUPPORTED_MESSAGE = "Extra inputs are not permitted"  # pydantic's message for a field a model forbids
UNSUPPORTED_REASON = "unsupported parameter: this server does not implement it (see docs/cloud-api.md)"


def validation_code(reason: str) -> str:
    """The OpenAI ``code`` of a field that failed validation, from pydantic's (or this module's validators') message:
    the one mapping for the routes (``shared.http``) and for bodies validated outside them (``request_error``)."""
    if reason == UNSUPPORTED_MESSAGE:
        return "unsupported_parameter"
    if reason == "Field required":
        return "missing_required_parameter"
    if reason.startswith(("Input should be a valid", "expected ")):  # a JSON type other than the field's
        return "invalid_type"
    return "invalid_value"


def request_error(exc: PydanticValidationError, prefix: str = "") -> ValidationError:
    """A body validated outside the HTTP layer (an escalation's, a stored job's) failing as the route would:
    an unknown field first, as ``unsupported_parameter``, else the first error, each naming the field."""
    errors = exc.errors()
    err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    loc = prefix + ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        return ValidationError(f"{loc}: {UNSUPPORTED_REASON}", param=loc, code="unsupported_parameter")
    reason = str(err["msg"]).removeprefix("Value error, ")
    return ValidationError(f"{loc}: {reason}", param=loc, code=validation_code(reason))


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=False)


class StreamOptions(_Request):
    include_usage: Annotated[bool, _BOOLEAN] = False


class ContentPart(_Request):
    type: str
    text: str | None = None


class FunctionCall(_Request):
    name: str = Field(min_length=1, max_length=64)
    arguments: str = Field(max_length=1 << 20)  # a JSON object, as a string (what the model generated)


class ToolCall(_Request):
    """A call an assistant message made (sent back in a conversation's history)."""

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, min_length=1, max_length=128)  # role assistant only
    tool_call_id: str | None = Field(None, min_length=1, max_length=256)  # role tool: the call this answers

    @field_validator("tool_calls")
    @classmethod
    def _tool_calls(cls, v: list[ToolCall] | None, info: ValidationInfo) -> list[ToolCall] | None:
        if v is not None and info.data.get("role") != "assistant":
            raise ValueError("tool_calls goes with role 'assistant'")
        return v

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None and info.data.get("role") != "tool":
            raise ValueError("tool_call_id goes with role 'tool'")
        return v

    @model_validator(mode="after")
    def _tool_message(self) -> ChatMessage:
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a message of role 'tool' needs tool_call_id (the id of the call it answers)")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        if any(p.type != "text" for p in self.content):
            raise ValidationError("messages: only text content parts are supported", param="messages")
        return "".join(p.text or "" for p in self.content)


class FunctionDefinition(_Request):
    """``tools[].function``: a function the model may call. ``parameters`` is the JSON schema of its arguments
    (an object; none: no arguments); ``strict`` is accepted either way: arguments are always generated under the
    schema's grammar."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = Field(None, max_length=8192)
    parameters: Annotated[dict[str, Any] | None, _SCHEMA] = None
    strict: Annotated[bool | None, _BOOLEAN] = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str = Field(min_length=1, max_length=64)


class NamedToolChoice(_Request):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: call exactly this function."""

    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Request):
    """``response_format.json_schema``: the schema the output must match (``strict`` is accepted either way: the
    output is always generated under the schema's grammar)."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: Annotated[dict[str, Any] | None, _SCHEMA] = Field(None, alias="schema")
    strict: Annotated[bool | None, _BOOLEAN] = None


class ResponseFormat(_Request):
    """``text``, ``json_object``, ``json_schema`` (OpenAI's), and tierline's extensions ``regex`` (the output
    matches the regular expression in full) and ``choice`` (the output is exactly one of the strings)."""

    type: Literal["text", "json_object", "json_schema", "regex", "choice"]
    json_schema: JsonSchemaFormat | None = None
    regex: str | None = Field(None, min_length=1, max_length=4096)
    choice: list[Annotated[str, Field(min_length=1, max_length=1024)]] | None = Field(
        None, min_length=1, max_length=256
    )

    @model_validator(mode="after")
    def _check(self) -> ResponseFormat:
        for name in ("json_schema", "regex", "choice"):
            given = getattr(self, name) is not None
            if given and self.type != name:
                raise ValueError(f"{name} goes with type '{name}', not '{self.type}'")
            if not given and self.type == name:
                raise ValueError(f"type '{name}' needs the field {name}")
        return self


class _Sampling(_Request):
    """Fields the chat and completions requests share (OpenAI's, then tierline's extensions)."""

    model: str = Field(min_length=1, max_length=256)
    temperature: Annotated[float, _NUMBER] = Field(1.0, ge=0.0, le=2.0)
    top_p: Annotated[float, _NUMBER] = Field(1.0, gt=0.0, le=1.0)
    n: Annotated[int, _INTEGER] = Field(1, ge=1, le=16)
    stream: Annotated[bool, _BOOLEAN] = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int | None, _INTEGER] = Field(None, ge=MIN_SEED, le=MAX_SEED)
    presence_penalty: Annotated[float, _NUMBER] = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: Annotated[float, _NUMBER] = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    store: Annotated[bool | None, _BOOLEAN] = None
    # tierline extensions
    top_k: Annotated[int, _INTEGER] = Field(0, ge=0, le=MAX_INT32)
    min_p: Annotated[float, _NUMBER] = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: Annotated[float, _NUMBER] = Field(1.0, gt=0.0, le=10.0)
    ignore_eos: Annotated[bool, _BOOLEAN] = False
    speculation: Literal["off", "draft", "ngram"] | None = None
    tier: Literal["edge", "cloud", "local-first", "cloud-first", "local-only", "cloud-only"] | None = None
    quality: Literal["standard", "high"] | None = None

    # The longest end user id this tier takes (``user``, and its x-tierline-subject header): a device's is shorter.
    max_end_user_len: ClassVar[int] = MAX_END_USER_LEN

    @field_validator("user")
    @classmethod
    def _user(cls, v: str | None) -> str | None:
        problem = end_user_problem(v, cls.max_end_user_len) if v else None
        if problem is not None:
            raise ValueError(problem)
        return v

    @field_validator("store")
    @classmethod
    def _store(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("stored completions are not implemented (send false or leave it out)")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops

    @property
    def stop_list(self) -> list[str]:
        return list(self.stop or [])

    def token_choice(self) -> dict[str, Any]:
        """The fields both tiers' samplers take as they are: temperature, top-p/k, min-p, seed, stop, ignore_eos."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "stop": self.stop_list,
            "ignore_eos": self.ignore_eos,
        }

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Annotated[int | None, _INTEGER] = Field(None, ge=1, le=MAX_INT32)
    max_completion_tokens: Annotated[int | None, _INTEGER] = Field(None, ge=1, le=MAX_INT32)
    logprobs: Annotated[bool, _BOOLEAN] = False
    top_logprobs: Annotated[int | None, _INTEGER] = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(None, min_length=1, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Annotated[bool | None, _BOOLEAN] = None

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list[Tool] | None, info: ValidationInfo) -> list[Tool] | None:
        names = [t.function.name for t in v or []]
        duplicate = next((n for n in names if names.count(n) > 1), None)
        if duplicate is not None:
            raise ValueError(f"two tools are named '{duplicate}'")
        # The calls' grammar holds every tool's schema (and the response_format's, for auto's text answer).
        schemas = [t.function.parameters for t in v or [] if t.function.parameters is not None]
        fmt: ResponseFormat | None = info.data.get("response_format")
        if fmt is not None and fmt.json_schema is not None and fmt.json_schema.schema_ is not None:
            schemas.append(fmt.json_schema.schema_)
        if len(schemas) > 1 and sum(check_json(s) for s in schemas) > MAX_SCHEMA_VALUES:
            raise ValueError(
                "the combined tool schemas are too large to constrain the output to (the limit is "
                f"{MAX_SCHEMA_VALUES} JSON values in all of a request's tool parameters and response_format schema)"
            )
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: str | NamedToolChoice | None, info: ValidationInfo) -> str | NamedToolChoice | None:
        tools: list[Tool] | None = info.data.get("tools")
        if v is None or v == "none":
            return v
        if not tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(v, NamedToolChoice) and v.function.name not in {t.function.name for t in tools}:
            raise ValueError(f"function '{v.function.name}' is not among the tools")
        return v

    @field_validator("parallel_tool_calls")
    @classmethod
    def _parallel(cls, v: bool | None, info: ValidationInfo) -> bool | None:
        if v is not None and not info.data.get("tools"):
            raise ValueError("parallel_tool_calls needs tools")
        return v

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        what = "a structured response_format" if self.is_structured else "tools" if self.calls_tools else None
        if what is not None:
            # Either would let the output end before the grammar does: it would not parse, and say "stop".
            if self.ignore_eos:
                raise ValueError(f"ignore_eos cannot be combined with {what}")
            if self.stop:
                raise ValueError(f"stop cannot be combined with {what}")
        return self

    @property
    def is_structured(self) -> bool:
        return self.response_format is not None and self.response_format.type != "text"

    @property
    def tool_mode(self) -> str:
        """``none``, ``auto``, ``required`` or ``named``: OpenAI's default is ``auto`` with tools, else ``none``."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    @property
    def calls_tools(self) -> bool:
        """The model may (or must) answer with tool calls: the output is generated under their grammar."""
        return self.tool_mode != "none"

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[_TOKEN_ID] | list[list[_TOKEN_ID]]
    # 0 with ``echo``: the prompt only (its logprobs with ``logprobs``), as OpenAI and vLLM answer
    max_tokens: Annotated[int | None, _INTEGER] = Field(16, ge=0, le=MAX_INT32)
    logprobs: Annotated[int | None, _INTEGER] = Field(None, ge=0, le=5)
    echo: Annotated[bool, _BOOLEAN] = False
    # vLLM's extension: the prompt tokens' logprobs and this many alternatives, in ``choices[].prompt_logprobs``
    prompt_logprobs: Annotated[int | None, _INTEGER] = Field(None, ge=0, le=20)
    suffix: str | None = None
    response_format: ResponseFormat | None = None  # an extension here (vLLM's too): the chat's formats

    @field_validator("prompt", mode="before")
    @classmethod
    def _token_ids(cls, v: Any) -> Any:
        for item in v if isinstance(v, list) else []:
            for token in item if isinstance(item, list) else [item]:
                if isinstance(token, bool | float):
                    raise ValueError(f"token ids must be integers, got {_json_type(token)}")
                if isinstance(token, int) and not -MAX_INT32 - 1 <= token <= MAX_INT32:
                    raise ValueError(f"token id {token} does not fit 32 bits: it is in no model's vocabulary")
        return v

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        return v

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix (insertion) is not supported")
        if self.echo and self.stream:
            raise ValueError("echo is not supported with stream")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not supported with stream")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 returns the prompt only and needs echo: true; otherwise it must be >= 1")
        if self.response_format is not None and self.response_format.type != "text":
            if self.ignore_eos:
                raise ValueError("ignore_eos cannot be combined with a structured response_format")
            if self.stop:
                raise ValueError("stop cannot be combined with a structured response_format")
        return self

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token the engine computes: ``prompt_logprobs``, else ``logprobs`` with ``echo``
        (the echoed prompt's tokens carry logprobs, as vLLM's do); None: no prompt logprobs."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Logits at every prompt position are needed (``prompt_logprobs``, or ``echo`` with ``logprobs``)."""
        return self.num_prompt_logprobs is not None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]
        return list(p)  # type: ignore[arg-type]


class AsyncJobFields(BaseModel):
    """The cloud's async-job fields (``"async": true`` queues a job, ``webhook_url`` gets its result; read by
    ``cloud/gateway/job_routes.py``). Only the cloud's routes accept them; a stored job's request is dumped without
    them."""

    async_: Annotated[bool | None, _BOOLEAN] = Field(None, alias="async")
    webhook_url: str | None = Field(None, max_length=2048)


JOB_FIELDS = frozenset(AsyncJobFields.model_fields)


class InferenceRequest(_Request):
    """``POST /v1/inference``: prompts for an LLM, or rows of numbers for a tensor model."""

    model_id: str = Field(min_length=1, max_length=256)
    inputs: Annotated[list[Any], _FREE_JSON] = Field(min_length=1, max_length=4096)
    parameters: Annotated[dict[str, Any], _FREE_JSON] = Field(default_factory=dict)

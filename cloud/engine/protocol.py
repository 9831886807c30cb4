"""What crosses the boundary of the engine core (its step loop), typed: one struct per message, tagged with its type.

Requests go to the core (``EngineCoreRequest``); the core answers with ``EngineCoreResponse``. In one process
(``AsyncLLMEngine``) the structs are handed over as they are; between processes (``EngineProcess``) they are encoded
with msgpack, each struct as an array whose first item is its type's tag, so decoding picks the struct by its tag
and a message of an unknown type (or of the wrong shape) raises ``msgspec.ValidationError``.

The core sends token ids, never text: detokenisation and stop strings happen in ``OutputProcessor``, on the far side.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from cloud.engine.sampling_params import SamplingParams
from shared.errors import (
    ApplicationError,
    ConfigurationError,
    ConflictError,
    NotFoundError,
    RateLimitError,
    ServiceUnavailableError,
    ValidationError,
)
from shared.openai_responses import Logprob


class EngineCoreRequestType(enum.IntEnum):
    """What is asked of the core."""

    ADD = 0
    ABORT = 1
    STOP_SEQUENCES = 2
    METRICS = 3
    SHUTDOWN = 4


class EngineCoreResponseType(enum.IntEnum):
    """What the core sends back."""

    READY = 0
    RESULT = 1
    OUTPUTS = 2
    STEP_FAILED = 3


_OPTS: dict[str, Any] = {"array_like": True, "tag_field": "type"}


# -- requests ---------------------------------------------------------------------------------------------------------
class AddRequest(msgspec.Struct, tag=int(EngineCoreRequestType.ADD), **_OPTS):
    """Queue one request; its result is None or the error that refused it (too long, QueueFull, ...)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    arrival_time: float = 0.0  # time.monotonic(), one clock for every process on the host
    call_id: int | None = None


class AbortRequest(msgspec.Struct, tag=int(EngineCoreRequestType.ABORT), **_OPTS):
    """Stop requests at once and free their blocks (the client is gone); unknown ids are ignored."""

    request_ids: list[str]
    call_id: int | None = None


class StopSequences(msgspec.Struct, tag=int(EngineCoreRequestType.STOP_SEQUENCES), **_OPTS):
    """Finish sequences (request id, output index) that a stop string ended: the output processor found it."""

    sequences: list[tuple[str, int]]
    call_id: int | None = None


class MetricsRequest(msgspec.Struct, tag=int(EngineCoreRequestType.METRICS), **_OPTS):
    """The core's counters (``LLMEngine.metrics``)."""

    call_id: int | None = None


class ShutdownRequest(msgspec.Struct, tag=int(EngineCoreRequestType.SHUTDOWN), **_OPTS):
    call_id: int | None = None


EngineCoreRequest = AddRequest | AbortRequest | StopSequences | MetricsRequest | ShutdownRequest


# -- responses --------------------------------------------------------------------------------------------------------
class EngineSnapshot(msgspec.Struct, frozen=True, array_like=True):
    """The engine's load, for metrics and for unloading idle engines."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prefix_hit_rate: float = 0.0
    spec_proposed: dict[str, int] = msgspec.field(default_factory=dict)
    spec_accepted: dict[str, int] = msgspec.field(default_factory=dict)

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting


class SequenceOutput(msgspec.Struct, array_like=True, gc=False):
    """What one output of a request gained in a step."""

    index: int
    new_token_ids: list[int]
    new_logprobs: list[Logprob] | None  # None: logprobs not asked for
    finish_reason: str | None  # set by the core: EOS, a stop token, the length limit
    num_spec_proposed: int  # so far, in all
    num_spec_accepted: int
    prompt_logprobs: list[Logprob] | None = None  # with the first tokens, when the request asked for them


class EngineCoreOutput(msgspec.Struct, array_like=True, gc=False):
    """One request's progress in a step: only the outputs that gained tokens."""

    request_id: str
    sequences: list[SequenceOutput]
    num_cached_tokens: int
    first_scheduled_time: float | None = None  # when the request first left the waiting queue (time in queue)


class EngineCoreOutputs(msgspec.Struct, tag=int(EngineCoreResponseType.OUTPUTS), **_OPTS):
    """A step's progress. ``token_time``: when its tokens were sampled (a request's first token then sets its time to
    first token); ``timestamp``: when the step ended (a finished request's engine latency ends there)."""

    outputs: list[EngineCoreOutput]
    token_time: float
    timestamp: float
    snapshot: EngineSnapshot | None = None  # sent by a core in a process of its own


class ErrorInfo(msgspec.Struct, array_like=True):
    """An exception that crosses the pipe: application errors keep their type, status and fields."""

    type: str
    message: str
    param: str | None = None
    code: str | None = None
    retry_after: float | None = None


class Ready(msgspec.Struct, tag=int(EngineCoreResponseType.READY), **_OPTS):
    max_model_len: int = 0
    vocab_size: int = 0
    error: ErrorInfo | None = None


class CallResult(msgspec.Struct, tag=int(EngineCoreResponseType.RESULT), **_OPTS):
    call_id: int
    value: dict[str, Any] | None = None
    error: ErrorInfo | None = None


class StepFailed(msgspec.Struct, tag=int(EngineCoreResponseType.STEP_FAILED), **_OPTS):
    request_ids: list[str]
    message: str


EngineCoreResponse = Ready | CallResult | EngineCoreOutputs | StepFailed


# -- errors -----------------------------------------------------------------------------------------------------------
def _error_types() -> dict[str, type[ApplicationError]]:
    from cloud.engine.scheduler import QueueFull

    kinds: tuple[type[ApplicationError], ...] = (
        ValidationError,
        QueueFull,
        RateLimitError,
        ConfigurationError,
        ServiceUnavailableError,
        NotFoundError,
        ConflictError,
    )
    return {k.__name__: k for k in kinds}


def error_info(exc: BaseException) -> ErrorInfo:
    if isinstance(exc, ApplicationError):
        return ErrorInfo(type(exc).__name__, exc.message, exc.param, exc.code, getattr(exc, "retry_after", None))
    return ErrorInfo(type(exc).__name__, str(exc))


def error_from(info: ErrorInfo) -> Exception:
    """The exception ``info`` describes: an application error of its own type; anything else (a bug in the core)
    as a RuntimeError that names the original type."""
    kind = _error_types().get(info.type)
    if kind is None:
        return RuntimeError(f"{info.type}: {info.message}")
    if issubclass(kind, RateLimitError):
        return kind(info.message, retry_after=info.retry_after or 1.0, code=info.code)
    return kind(info.message, param=info.param, code=info.code)


# -- encoding ---------------------------------------------------------------------------------------------------------
def _enc_hook(obj: Any) -> Any:
    raise NotImplementedError(f"cannot send a {type(obj).__name__} to or from the engine core")


class RequestCodec:
    """Requests to bytes (the API process's side) and back (the core's side)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        self._decoder = msgspec.msgpack.Decoder(EngineCoreRequest)

    def encode(self, request: EngineCoreRequest) -> bytes:
        return self._encoder.encode(request)

    def decode(self, data: bytes | bytearray | memoryview) -> EngineCoreRequest:
        result: EngineCoreRequest = self._decoder.decode(data)
        return result


class ResponseCodec:
    """Responses to bytes (the core's side) and back (the API process's side)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        self._decoder = msgspec.msgpack.Decoder(EngineCoreResponse)

    def encode(self, response: EngineCoreResponse) -> bytes:
        return self._encoder.encode(response)

    def decode(self, data: bytes | bytearray | memoryview) -> EngineCoreResponse:
        result: EngineCoreResponse = self._decoder.decode(data)
        return result

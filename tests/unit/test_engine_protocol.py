"""What crosses the engine core's process boundary: typed messages that survive encoding whole, errors that keep
their type and fields, and a loud failure for a message of a type the other side does not know."""

from __future__ import annotations

import msgspec
import pytest

from cloud.engine.prompts import check_context_length
from cloud.engine.protocol import (
    AbortRequest,
    AddRequest,
    CallResult,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequestType,
    EngineSnapshot,
    MetricsRequest,
    Ready,
    RequestCodec,
    ResponseCodec,
    SequenceOutput,
    ShutdownRequest,
    StepFailed,
    StopSequences,
    error_from,
    error_info,
)
from cloud.engine.sampling_params import SamplingParams
from cloud.engine.scheduler import QueueFull
from shared.errors import ValidationError
from shared.openai_responses import Logprob


@pytest.mark.parametrize(
    "request_",
    [
        AddRequest(
            "r1",
            [1, 2, 3],
            SamplingParams(n=2, temperature=0.5, stop=["\n"], logprobs=2, seed=3),
            priority=1,
            cache_salt="tenant-a",
            arrival_time=12.5,
            call_id=7,
        ),
        AbortRequest(["r1", "r2"], call_id=8),
        StopSequences([("r1", 0), ("r1", 1)]),
        MetricsRequest(call_id=9),
        ShutdownRequest(),
    ],
)
def test_every_request_type_survives_the_pipe_whole(request_: object) -> None:
    codec = RequestCodec()
    assert codec.decode(codec.encode(request_)) == request_  # type: ignore[arg-type]


def test_every_response_type_survives_the_pipe_whole() -> None:
    codec = ResponseCodec()
    step = EngineCoreOutputs(
        [
            EngineCoreOutput(
                "r1",
                [
                    SequenceOutput(
                        0, [5, 6], [Logprob(5, -0.25, [(5, -0.25), (9, -2.0)]), Logprob(6, -1.0)], None, 3, 1
                    ),
                    SequenceOutput(1, [7], None, "length", 0, 0),
                ],
                16,
            )
        ],
        token_time=1.5,
        timestamp=1.75,
        snapshot=EngineSnapshot(running=2, kv_usage=0.5, spec_proposed={"ngram": 3}),
    )
    for response in (
        step,
        Ready(max_model_len=512, vocab_size=1000),
        CallResult(3, {"num_running": 0, "spec_acceptance": {"ngram": 0.5}}),
        StepFailed(["r1"], "engine lm failed: RuntimeError"),
    ):
        assert codec.decode(codec.encode(response)) == response
    decoded = codec.decode(codec.encode(step))
    assert isinstance(decoded, EngineCoreOutputs)
    logprobs = decoded.outputs[0].sequences[0].new_logprobs
    assert logprobs is not None and logprobs[0].top == [(5, -0.25), (9, -2.0)]


def test_a_message_of_an_unknown_type_or_shape_fails_loudly() -> None:
    codec = RequestCodec()
    unknown = msgspec.msgpack.encode([max(EngineCoreRequestType) + 1, "r1"])
    with pytest.raises(msgspec.ValidationError, match="Invalid value"):
        codec.decode(unknown)
    wrong_shape = msgspec.msgpack.encode([int(EngineCoreRequestType.ABORT), "not a list"])
    with pytest.raises(msgspec.ValidationError):
        codec.decode(wrong_shape)
    with pytest.raises(NotImplementedError, match="cannot send a object"):
        RequestCodec().encode(AbortRequest([object()]))  # type: ignore[list-item]


def test_sampling_params_are_validated_again_where_they_are_decoded() -> None:
    codec = RequestCodec()
    data = codec.encode(AddRequest("r1", [1], SamplingParams()))
    bad = data.replace(msgspec.msgpack.encode(1.0), msgspec.msgpack.encode(-1.0), 1)  # temperature
    with pytest.raises(ValidationError, match="temperature"):
        codec.decode(bad)


def test_errors_keep_their_type_status_and_fields_across_the_pipe() -> None:
    codec = ResponseCodec()

    def across(exc: BaseException) -> Exception:
        result = codec.decode(codec.encode(CallResult(1, error=error_info(exc))))
        assert isinstance(result, CallResult) and result.error is not None
        return error_from(result.error)

    refused = across(ValidationError("too long", param="max_tokens", code="context_length_exceeded"))
    assert isinstance(refused, ValidationError)
    assert (refused.message, refused.param, refused.code, refused.status_code) == (
        "too long",
        "max_tokens",
        "context_length_exceeded",
        400,
    )
    full = across(QueueFull("queue is full", retry_after=2.5))
    assert isinstance(full, QueueFull) and full.retry_after == 2.5 and full.status_code == 429
    bug = across(KeyError("seq 3"))
    assert type(bug) is RuntimeError and "KeyError" in str(bug)


def test_the_context_length_check_names_the_field_that_does_not_fit() -> None:
    assert check_context_length(10, None, 64) == 54
    assert check_context_length(10, 54, 64) == 54
    for prompt, max_tokens, param in ((0, 4, "prompt"), (64, None, "prompt"), (10, 55, "max_tokens")):
        with pytest.raises(ValidationError) as exc:
            check_context_length(prompt, max_tokens, 64)
        assert exc.value.param == param
    with pytest.raises(ValidationError, match="you requested 65 tokens") as exc:
        check_context_length(10, 55, 64)
    assert exc.value.code == "context_length_exceeded"

"""Property-based: no request body that parses gets a 5xx, on either tier or from the device protocol.

Bodies are generated field by field from the request models' own JSON schemas (``model_json_schema()``), mixing
values the schema allows with what it does not: integers at and past 32 and 64 bits, huge and tiny floats,
strings that look like numbers or markup, long strings, objects and arrays nested deep, JSON schemas for
``response_format`` and tools built from real keywords with wild values, and now and then a field the API does
not know. They are posted to a real cloud (tiny zoo, SQLite; an API key, an enrolled device) and a real edge agent:
``/v1/completions`` and ``/v1/chat/completions`` of both, the cloud's ``/v1/inference``, and the device protocol's
``/v1/edge/sync``, ``/v1/edge/shadow`` and ``/v1/edge/escalate``. Any status but a 5xx passes, and the one 503
the agent documents: ``tier: cloud`` on a device that is not enrolled.

Generation stays cheap: ``max_tokens`` is lowered to ``MAX_TOKENS`` (or set, where the request leaves it to the
context length), ``n`` to ``MAX_N``, prompts and inputs to ``MAX_PROMPTS``, after generation (values of the wrong
type are left alone, so they still reach the server).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from shared.edge_protocol import EscalateRequest, ShadowRequest, SyncRequest
from shared.openai_schema import ChatCompletionRequest, CompletionRequest, InferenceRequest
from tests.integration.bounds_support import CLOUD_LM, EDGE_LM, Cloud, running_cloud, running_edge

pytestmark = pytest.mark.integration
MAX_EXAMPLES = 120
MAX_TOKENS = 3
MAX_N = 2
MAX_PROMPTS = 3
BOUNDARY_INTS = [0, 1, -1, 2**31 - 1, 2**31, -(2**31) - 1, 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 2**100, -(2**100)]
ODD_FLOATS = [0.0, -0.0, 0.5, 1e-308, 5e-324, 1e308, -1e308, 1.7976931348623157e308, 2.0000001, 1e15]
ODD_STRINGS = ["", " ", "NaN", "nan", "Infinity", "-inf", "1e999", "null", "{", "<tool_call>", "\u0000", "é" * 300]
LONG_STRINGS = ["x" * 5000, "\n" * 2000]
TENSOR_MODELS = ["tierline/digits-large", "tierline/digits-small"]
SCHEMA_TYPES = ["object", "string", "integer", "number", "boolean", "array", "null", "nope"]

SETTINGS = settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    database=None,  # nothing written into the checkout
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory, tiny_zoo: Path, session_data_dir: Path) -> Iterator[Cloud]:
    with running_cloud(tmp_path_factory.mktemp("fuzz-cloud"), tiny_zoo, session_data_dir) as c:
        yield c


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory, tiny_zoo: Path, session_data_dir: Path) -> Iterator[str]:
    with running_edge(tmp_path_factory.mktemp("fuzz-edge"), tiny_zoo, session_data_dir) as url:
        yield url


# -- values ------------------------------------------------------------------------------------------------------
def _nested(levels: int) -> Any:
    value: Any = "leaf"
    for i in range(levels):
        value = [value] if i % 2 else {"k": value}
    return value


SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from(BOUNDARY_INTS),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(ODD_FLOATS),
    st.text(max_size=12),
    st.sampled_from(ODD_STRINGS),
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=12,
)
ANYTHING = st.one_of(JSON_VALUES, st.integers(1, 300).map(_nested), st.sampled_from(LONG_STRINGS))


def _schema_like() -> st.SearchStrategy[dict[str, Any]]:
    """JSON schemas built from real keywords with wild values (what response_format and tools carry)."""
    leaf = st.fixed_dictionaries(
        {"type": st.sampled_from(SCHEMA_TYPES)},
        optional={
            "enum": st.lists(SCALARS, min_size=1, max_size=3),
            "minimum": st.sampled_from(BOUNDARY_INTS),
            "maxLength": st.sampled_from(BOUNDARY_INTS),
            "minItems": st.sampled_from(BOUNDARY_INTS),
            "pattern": st.sampled_from(["^[a-z]+$", "(", "a{1000000}", ".*"]),
            "format": st.sampled_from(["date-time", "email", "uuid", "bogus"]),
        },
    )
    return st.recursive(
        leaf,
        lambda inner: st.one_of(
            st.fixed_dictionaries(
                {"type": st.just("object"), "properties": st.dictionaries(st.text(max_size=6), inner, max_size=4)},
                optional={"required": st.lists(st.text(max_size=6), max_size=3), "additionalProperties": st.booleans()},
            ),
            st.fixed_dictionaries({"type": st.just("array"), "items": inner}),
            st.fixed_dictionaries({"anyOf": st.lists(inner, min_size=1, max_size=3)}),
            st.fixed_dictionaries({"$ref": st.sampled_from(["#/$defs/x", "#", "http://example.com/s"])}),
        ),
        max_leaves=8,
    )


SCHEMAS = _schema_like()


def _strategy(schema: dict[str, Any], defs: dict[str, Any], name: str = "") -> st.SearchStrategy[Any]:
    """Values of one field as its JSON schema describes it (bounds, lengths, patterns, enums), boundaries included.
    Free-form JSON schemas (``schema``, ``parameters``) are built from real keywords with wild values."""
    if "$ref" in schema:
        return st.deferred(lambda: _strategy(defs[schema["$ref"].rsplit("/", 1)[-1]], defs, name))
    if name in ("schema", "parameters"):  # a JSON schema the grammar engine compiles
        return st.one_of(SCHEMAS, SCHEMAS, SCHEMAS, st.integers(1, 200).map(_nested))
    if "anyOf" in schema or "oneOf" in schema:
        return st.one_of([_strategy(s, defs, name) for s in schema.get("anyOf", schema.get("oneOf", []))])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    if kind == "integer":
        low = schema.get("minimum", schema.get("exclusiveMinimum", -(2**101)) + 1)
        high = schema.get("maximum", schema.get("exclusiveMaximum", 2**101) - 1)
        edges = [v for v in (*BOUNDARY_INTS, low, high) if low <= v <= high]
        return st.one_of(st.integers(max(low, -(2**40)), min(high, 2**40)), st.sampled_from(edges))
    if kind == "number":
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        high = schema.get("maximum", schema.get("exclusiveMaximum"))
        edges = [v for v in ODD_FLOATS if (low is None or v >= low) and (high is None or v <= high)]
        floats = st.floats(low, high, allow_nan=False, allow_infinity=False)
        return st.one_of(floats, st.sampled_from(edges)) if edges else floats
    if kind == "string":
        sizes = {"min_size": schema.get("minLength", 0), "max_size": min(schema.get("maxLength", 24), 24)}
        one_class = re.fullmatch(r"\^\[([^\]]+)\]\+\$", schema.get("pattern", ""))
        if one_class:  # ^[...]+$ with a length: characters of the class
            alphabet = st.from_regex(f"[{one_class[1]}]", fullmatch=True)
            text = st.text(alphabet, min_size=max(1, sizes["min_size"]), max_size=sizes["max_size"])
        elif "pattern" in schema:
            text = st.from_regex(schema["pattern"], fullmatch=True)
        else:
            text = st.text(**sizes)
        odd = [v for v in ODD_STRINGS if _fits(v, schema)]
        return st.one_of(text, text, text, st.sampled_from(odd)) if odd else text
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        items = _strategy(schema.get("items", {}), defs)
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=min(schema.get("maxItems", 3), 3))
    if kind == "object" and "properties" in schema:
        return _object(schema, defs)
    if kind == "object":
        values = schema.get("additionalProperties")
        return st.dictionaries(
            st.text(max_size=8), _strategy(values, defs) if isinstance(values, dict) else JSON_VALUES, max_size=3
        )
    return JSON_VALUES


def _fits(text: str, schema: dict[str, Any]) -> bool:
    pattern = schema.get("pattern")
    within = schema.get("minLength", 0) <= len(text) <= schema.get("maxLength", len(text))
    return within and (pattern is None or re.search(pattern, text) is not None)


def _object(schema: dict[str, Any], defs: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    properties: dict[str, Any] = schema["properties"]
    required = set(schema.get("required", []))
    fields = {k: _strategy(v, defs, k) for k, v in properties.items()}
    optional = {k: s for k, s in fields.items() if k not in required}
    return st.fixed_dictionaries({k: s for k, s in fields.items() if k in required}, optional=optional)


WILD = st.one_of(ANYTHING, st.sampled_from(BOUNDARY_INTS), st.sampled_from(ODD_FLOATS), st.sampled_from(ODD_STRINGS))


@st.composite
def _mutated(draw: st.DrawFn, body: st.SearchStrategy[dict[str, Any]]) -> dict[str, Any]:
    """A body as its schema describes it, half of the time with one field (or one field of a nested object)
    replaced by a wild value, or a field the API does not know added."""
    value = draw(body)
    how = draw(st.sampled_from(["as-is", "as-is", "field", "nested", "unknown"]))
    target = value
    if how == "nested":
        nested = [v for v in value.values() if isinstance(v, dict) and v]
        target = draw(st.sampled_from(nested)) if nested else value
    if how in ("field", "nested") and target:
        target[draw(st.sampled_from(sorted(target)))] = draw(WILD)
    elif how == "unknown":
        value["x_not_a_field"] = draw(JSON_VALUES)
    return value


def bodies(model: type[BaseModel]) -> st.SearchStrategy[dict[str, Any]]:
    schema = model.model_json_schema()
    return _mutated(_object(schema, schema.get("$defs", {})))


# -- cheap generation ------------------------------------------------------------------------------------------
def _cap(body: dict[str, Any], model: str, key: str = "model") -> dict[str, Any]:
    """``body`` with its generation made cheap, and a real model most of the time (see the module's docstring)."""
    if isinstance(body.get(key), str) and not body[key].startswith("tierline/"):
        body[key] = model
    for name in ("max_tokens", "max_completion_tokens"):
        if name in body and (body[name] is None or (isinstance(body[name], int) and body[name] > MAX_TOKENS)):
            body[name] = MAX_TOKENS
    if "messages" in body and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS  # not up to the context length
    if isinstance(body.get("n"), int) and body["n"] > MAX_N:
        body["n"] = MAX_N
    for name in ("prompt", "inputs"):
        if isinstance(body.get(name), list):
            body[name] = body[name][:MAX_PROMPTS]
    parameters = body.get("parameters")
    if isinstance(parameters, dict):
        parameters["max_tokens"] = MAX_TOKENS
    return body


def _asks_for_the_cloud(body: dict[str, Any]) -> bool:
    parameters = body.get("parameters")
    tier = parameters.get("tier") if isinstance(parameters, dict) and "model_id" in body else body.get("tier")
    return tier in ("cloud", "cloud-only")


def _fuzz(
    url: str, headers: dict[str, str], strategy: st.SearchStrategy[dict[str, Any]], *, enrolled: bool = True
) -> None:
    """Post every generated body: none gets a 5xx, except the one documented 503 of an agent that is not enrolled
    (``tier: cloud`` on a device without a cloud is ``unavailable``: enrolling it is the fix)."""
    with httpx.Client(headers=headers, timeout=60) as client:

        @SETTINGS
        @given(strategy)
        def run(body: dict[str, Any]) -> None:
            r = client.post(url, json=body)
            shown = f"{r.status_code} for {json.dumps(body)[:2000]}: {r.text[:500]}"
            if not enrolled and r.status_code == 503:
                assert _asks_for_the_cloud(body), shown
                assert r.json()["error"]["code"] == "unavailable", shown
                assert "not enrolled" in r.json()["error"]["message"], shown
                return
            assert r.status_code < 500, shown

        run()


# -- tests -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "model"),
    [("/v1/completions", CompletionRequest), ("/v1/chat/completions", ChatCompletionRequest)],
)
def test_no_generated_openai_request_gets_a_5xx_on_either_tier(
    cloud: Cloud, edge: str, path: str, model: type[BaseModel]
) -> None:
    _fuzz(f"{cloud.url}{path}", cloud.auth, bodies(model).map(lambda b: _cap(b, CLOUD_LM)))
    _fuzz(f"{edge}{path}", {}, bodies(model).map(lambda b: _cap(b, EDGE_LM)), enrolled=False)


def test_no_generated_inference_request_gets_a_5xx_on_either_tier(cloud: Cloud, edge: str) -> None:
    models = st.sampled_from([CLOUD_LM, *TENSOR_MODELS])
    strategy = st.tuples(bodies(InferenceRequest), models).map(lambda p: _cap(p[0], p[1], key="model_id"))
    _fuzz(f"{cloud.url}/v1/inference", cloud.auth, strategy)
    strategy = bodies(InferenceRequest).map(lambda b: _cap(b, "tierline/digits-small", key="model_id"))
    _fuzz(f"{edge}/v1/inference", {}, strategy, enrolled=False)


@st.composite
def _shadow_batches(draw: st.DrawFn) -> dict[str, Any]:
    """Shadow batches of one kind each, rows and answers in step (the schema alone rarely gets them so)."""
    n = draw(st.integers(1, 3))
    number = st.one_of(st.floats(-1e6, 1e6), st.sampled_from(ODD_FLOATS))
    token = st.one_of(st.integers(0, 300), st.sampled_from([2**31 - 1, 2**31, 2**63]))
    batch: dict[str, Any] = {
        "id": draw(st.from_regex(r"[a-z0-9]{8,16}", fullmatch=True)),
        "policy_version": draw(st.sampled_from([1, 2, 2**31 - 1, 2**31])),
        "occurred_at": draw(st.sampled_from([1.7e9, 0.0, 1e300])),
    }
    if draw(st.booleans()):
        width = draw(st.sampled_from([1, 64, 65]))
        batch |= {"model": "tierline/digits-small", "cloud_model": draw(st.sampled_from(TENSOR_MODELS))}
        batch["inputs"] = [draw(st.lists(number, min_size=width, max_size=width)) for _ in range(n)]
        batch["edge_answers"] = draw(st.lists(st.integers(0, 12), min_size=n, max_size=n))
        batch["confidences"] = draw(st.lists(number, min_size=n, max_size=n))
    else:
        batch |= {"model": "tierline/lm-edge", "cloud_model": draw(st.sampled_from([CLOUD_LM, "tierline/lm-edge"]))}
        sample = st.fixed_dictionaries(
            {
                "prompt_ids": st.lists(token, min_size=1, max_size=8),
                "edge_tokens": st.lists(token, min_size=1, max_size=4),
                "confidence": number,
            }
        )
        batch["lm_samples"] = draw(st.lists(sample, min_size=1, max_size=n))
        batch["vocabulary_sha256"] = draw(st.sampled_from(["0" * 64, "f" * 64]))
    return batch


@pytest.mark.parametrize(("path", "model"), [("/v1/edge/sync", SyncRequest), ("/v1/edge/shadow", ShadowRequest)])
def test_no_generated_device_request_gets_a_5xx(cloud: Cloud, path: str, model: type[BaseModel]) -> None:
    strategy = st.one_of(bodies(model), _shadow_batches()) if model is ShadowRequest else bodies(model)
    _fuzz(f"{cloud.url}{path}", cloud.device_auth, strategy)


def _escalation(endpoint: str, inner: dict[str, Any], outer: dict[str, Any]) -> dict[str, Any]:
    return {**outer, "endpoint": endpoint, "reason": "fuzz", "body": _cap(inner, CLOUD_LM)}


def test_no_generated_escalation_gets_a_5xx(cloud: Cloud) -> None:
    inner = st.one_of(
        st.tuples(st.just("completions"), bodies(CompletionRequest)),
        st.tuples(st.just("chat.completions"), bodies(ChatCompletionRequest)),
    )
    strategy = st.one_of(
        st.builds(lambda pair, outer: _escalation(pair[0], pair[1], outer), inner, st.just({})),
        bodies(EscalateRequest),  # the envelope itself, fuzzed
    )
    _fuzz(f"{cloud.url}/v1/edge/escalate", cloud.device_auth, strategy)

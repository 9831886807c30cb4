"""Property-based fuzzing of the cloud API from its own OpenAPI schema (schemathesis).

The real server (tiny zoo, SQLite) is started once; schemathesis loads ``/schema/openapi.json`` from it and
generates requests for every operation it lists, schema-valid ones and schema-violating ones, with an API key on
the inference routes and an enrolled device's credential on ``/v1/edge/*`` (the negative cases also drop them).
Every answer must not be a 5xx, and its status code, content type and body must be ones the schema declares.

Random strings rarely name a model, a job or a published artifact, so most cases get real ones drawn in
(``_with_known_values``), inference calls get inputs of the model's kind, escalations get an inner body generated
from the schema of the route they stand for, and some inference calls are sent as async jobs (``"async": true``
or ``Prefer: respond-async``; the schema describes the first, not the header).

Calls stay cheap on a loaded host because ``_cap_generation`` lowers, before sending, what makes generation
slow: ``max_tokens`` and ``max_completion_tokens`` (and ``parameters.max_tokens`` of ``/v1/inference``) above
``MAX_TOKENS`` or null, which means "up to the context length", are set to it, as is ``max_tokens`` on a chat
request that sets neither; ``n`` above ``MAX_N`` and more than ``MAX_PROMPTS`` prompts or inputs are cut. Values
of the wrong type are left as generated, so schema-violating cases still reach the server.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import schemathesis
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import APIOperation, Case, GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.failures import FailureGroup
from schemathesis.core.result import Err
from schemathesis.schemas import BaseSchema
from sqlmodel import Session

from controlplane.fleet.devices import create_enrollment_token
from controlplane.storage.database import create_db
from controlplane.tenancy.service import create_api_key, create_tenant
from tests.conftest import base_env, free_port, migrated_sqlite, seed_data_dir, server_process

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_EXAMPLES = 30
MAX_TOKENS = 4
MAX_N = 2
MAX_PROMPTS = 4
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
MODES = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
LLMS = ("tierline/lm-cloud", "tierline/lm-edge")
TENSOR_MODELS = ("tierline/digits-large", "tierline/digits-small")
ARTIFACT, ARTIFACT_VERSION = "digits-small", "fuzz-1"
ARTIFACT_FILES = ("manifest.json", "classifier.json", "model.onnx")
ESCALATED = {"chat.completions": "/v1/chat/completions", "completions": "/v1/completions", "inference": "/v1/inference"}


@contextmanager
def _logged_server(env: dict[str, str], log: Path) -> Iterator[str]:
    """``tierline cloud serve`` until ready, its output in ``log`` (a failure report quotes its end)."""
    port = free_port()
    with server_process(["cloud", "serve"], env, port, ready_path="/readyz", timeout=120, stop_timeout=30, log=log):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def fuzz_api(
    tmp_path_factory: pytest.TempPathFactory, tiny_zoo: Path, session_data_dir: Path
) -> Iterator[dict[str, str]]:
    """The cloud server on the tiny zoo with a published edge artifact, an API key, an enrolled device's
    credential and one finished async job."""
    from cloud.edge.releases import publish_command

    data = seed_data_dir(tmp_path_factory.mktemp("api-fuzz"), tiny_zoo, session_data_dir)
    env = base_env(
        data,
        TIERLINE_DATABASE_URL=migrated_sqlite(data),
        TIERLINE_CLOUD_ZOO_PRESET="tiny",
        TIERLINE_CLOUD_KV_CACHE_MB="16",
        TIERLINE_CLOUD_USAGE_FLUSH_MS="50",
    )

    engine = create_db(env["TIERLINE_DATABASE_URL"])
    with Session(engine) as session:  # in-process: a CLI subprocess per secret would cost seconds
        tenant = create_tenant(session, "acme")
        key = create_api_key(session, tenant).secret
        enrollment = create_enrollment_token(session, tenant).secret
        session.commit()
    engine.dispose()
    artifact_dir = data / "zoo" / "tiny" / "artifacts" / ARTIFACT
    published = CliRunner().invoke(
        publish_command, [str(artifact_dir), "--as-version", ARTIFACT_VERSION], env={"TIERLINE_DATA_DIR": str(data)}
    )
    assert published.exit_code == 0, published.output
    with _logged_server(env, data / "cloud.log") as url:
        enrolled = httpx.post(f"{url}/v1/edge/enroll", json={"token": enrollment}, timeout=30)
        assert enrolled.status_code == 200, enrolled.text
        job = httpx.post(
            f"{url}/v1/completions",
            json={"model": LLMS[0], "prompt": "x", "max_tokens": 2, "async": True},
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        )
        assert job.status_code == 202, job.text
        yield {
            "url": url,
            "key": key,
            "device_token": enrolled.json()["device_token"],
            "job_id": job.json()["id"],
            "log": str(data / "cloud.log"),
        }


@pytest.fixture(scope="module")
def api_schema(fuzz_api: dict[str, str]) -> BaseSchema:
    config = schemathesis.Config.from_dict(
        {
            "generation": {"max-examples": MAX_EXAMPLES, "deterministic": True, "database": "none"},
            "auth": {
                "openapi": {
                    "BearerAuth": {"bearer": fuzz_api["key"]},
                    "DeviceAuth": {"bearer": fuzz_api["device_token"]},
                }
            },
        }
    )
    return schemathesis.openapi.from_url(f"{fuzz_api['url']}/schema/openapi.json", config=config)


def _cap(value: Any, limit: int) -> Any:
    """``limit`` for a number above it or for null (which means "up to the context length"); else as generated."""
    if value is None:
        return limit
    return min(value, limit) if isinstance(value, int) and not isinstance(value, bool) else value


def _cap_generation(path: str, body: Any) -> None:
    """Lower the fields that make a call generate for long, in place; see the module docstring."""
    if not isinstance(body, dict):
        return
    if path == "/v1/edge/escalate":
        path, body = ESCALATED.get(body.get("endpoint"), ""), body.get("body")  # type: ignore[arg-type]
        if not isinstance(body, dict):
            return
    if path in ("/v1/chat/completions", "/v1/completions"):
        for name in ("max_tokens", "max_completion_tokens"):
            if name in body:
                body[name] = _cap(body[name], MAX_TOKENS)
        if path == "/v1/chat/completions" and "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = MAX_TOKENS
        if "n" in body:
            body["n"] = _cap(body["n"], MAX_N)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):  # several prompts
            body["prompt"] = prompt[:MAX_PROMPTS]
    if path == "/v1/responses":  # OpenAI's least is 16; absent or null means up to the context length
        capped = _cap(body.get("max_output_tokens"), 16)
        body["max_output_tokens"] = 16 if isinstance(capped, int) and not isinstance(capped, bool) else capped
    if path == "/v1/inference":
        if isinstance(body.get("inputs"), list):
            body["inputs"] = body["inputs"][:MAX_PROMPTS]
        params = body.get("parameters")
        if isinstance(params, dict):
            params["max_tokens"] = _cap(params.get("max_tokens"), MAX_TOKENS)


def _with_known_values(case: Case, data: st.DataObject, schema: BaseSchema, fuzz_api: dict[str, str]) -> None:
    """Most of the time, name a real model, job or artifact where the case names one, so requests get past
    lookups; give inference calls inputs of the model's kind, artifact downloads a byte range, and ask for some
    requests to run as jobs."""
    if data.draw(st.integers(0, 3), label="keep generated values") == 0:
        return
    params, body = case.path_parameters, cast(Any, case.body)
    if case.path == "/v1/models/{model_id}" and params:
        params["model_id"] = data.draw(st.sampled_from(LLMS + TENSOR_MODELS))
    elif case.path.startswith("/v1/jobs/{job_id}") and params:
        params["job_id"] = fuzz_api["job_id"]
    elif case.path.startswith("/v1/edge/artifacts/") and params:
        params.update(name=ARTIFACT, version=ARTIFACT_VERSION, path=data.draw(st.sampled_from(ARTIFACT_FILES)))
        byte_range = data.draw(st.none() | st.from_regex(r"bytes=[0-9]{0,4}-[0-9]{0,4}", fullmatch=True))
        if byte_range is not None:
            case.headers["range"] = byte_range
    if not isinstance(body, dict):
        return
    path = case.path
    if path == "/v1/edge/escalate":
        endpoint = data.draw(st.sampled_from(sorted(ESCALATED)))
        path = ESCALATED[endpoint]
        body.update(endpoint=endpoint, body=data.draw(schema[path]["POST"].as_strategy(), label="escalated").body)
        body = body["body"]
    elif path in ESCALATED.values():
        how = data.draw(st.sampled_from(["sync", "async", "prefer"]), label="as a job")
        if how == "async":
            body["async"] = True
        elif how == "prefer":
            case.headers["Prefer"] = "respond-async"
    if not isinstance(body, dict):
        return
    if path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        body["model"] = data.draw(st.sampled_from(LLMS))
    elif path == "/v1/inference":
        body["model_id"] = model = data.draw(st.sampled_from(LLMS + TENSOR_MODELS))
        if model in TENSOR_MODELS:
            row = st.lists(st.floats(-16, 16), min_size=64, max_size=64)
            body["inputs"] = data.draw(st.lists(row, min_size=1, max_size=MAX_PROMPTS), label="rows")
        else:
            body["inputs"] = data.draw(
                st.lists(st.text(max_size=16), min_size=1, max_size=MAX_PROMPTS), label="prompts"
            )


def _fuzz(operation: APIOperation, mode: GenerationMode, schema: BaseSchema, fuzz_api: dict[str, str]) -> None:
    @given(case=operation.as_strategy(generation_mode=mode), data=st.data())
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def run(case: Case, data: st.DataObject) -> None:
        _with_known_values(case, data, schema, fuzz_api)
        _cap_generation(case.path, case.body)
        case.call_and_validate(base_url=fuzz_api["url"], checks=CHECKS, timeout=60)

    run()


def test_api_answers_every_generated_request_as_its_schema_says(
    api_schema: BaseSchema, fuzz_api: dict[str, str]
) -> None:
    """No 5xx, and every answer (status, content type, body) is one the schema declares for the operation.

    schemathesis' pytest plugin (``from_fixture``/``parametrize``) does not run under this project's pytest, so
    the operations are fuzzed here one by one with Hypothesis and every failure is reported together.
    """
    failures: dict[str, str] = {}
    labels = []
    for result in api_schema.get_all_operations():
        if isinstance(result, Err):
            failures[f"schema error {result.err().path}"] = str(result.err())
            continue
        operation = result.ok()
        labels.append(operation.label)
        for mode in MODES:
            try:
                _fuzz(operation, mode, api_schema, fuzz_api)
            except (Exception, FailureGroup) as exc:
                failures[f"{operation.label} ({mode.value})"] = str(exc)
    assert {
        "POST /v1/chat/completions",
        "POST /v1/inference",
        "GET /v1/jobs/{job_id}",
        "POST /v1/edge/sync",
        "POST /v1/edge/escalate",
        "GET /v1/edge/artifacts/{name}/{version}/{path}",
        "PUT /v1/webhook",
        "GET /v1/webhook-deliveries",
        "GET /v1/budget",
    } <= set(labels)
    server_log = Path(fuzz_api["log"]).read_text(errors="replace")[-6000:]
    report = "\n\n".join(f"== {label}\n{text}" for label, text in failures.items())
    assert not failures, f"{report}\n\n== the server's log (end)\n{server_log}"


def test_what_the_fuzzer_found_gets_a_clear_4xx_or_a_declared_answer(
    api_schema: BaseSchema, fuzz_api: dict[str, str]
) -> None:
    url, auth = fuzz_api["url"], {"Authorization": f"Bearer {fuzz_api['key']}"}
    device = {"Authorization": f"Bearer {fuzz_api['device_token']}"}
    # An escalation reason is echoed in a response header: a non-ASCII one, or one ending in a space (which h11
    # refuses to send), was a 500 after the response had started.
    chat = {"model": LLMS[0], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for reason in ("ü", "; ", " low"):
        escalation = {"endpoint": "chat.completions", "reason": reason, "body": chat}
        r = httpx.post(f"{url}/v1/edge/escalate", json=escalation, headers=device)
        assert r.status_code == 400 and r.json()["error"]["param"] == "reason", r.text
    escalation = {"endpoint": "chat.completions", "reason": "low confidence", "body": chat}
    r = httpx.post(f"{url}/v1/edge/escalate", json=escalation, headers=device, timeout=60)
    assert r.status_code == 200 and r.headers["x-tierline-escalation-reason"] == "low confidence"
    # /v1/inference parameters of the wrong type reached the engine's step and failed every request in flight (503).
    for name, value in (("seed", "x"), ("stop_token_ids", ["a"]), ("stop_token_ids", 5), ("temperature", None)):
        body = {"model_id": LLMS[0], "inputs": ["x"], "parameters": {name: value, "max_tokens": 2}}
        r = httpx.post(f"{url}/v1/inference", json=body, headers=auth, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == f"parameters.{name}", r.text
    # One bad prompt among several was refused by the engine after its siblings had started: they were cancelled
    # half-admitted, which killed the engine's thread (every later request on the model hung until its deadline).
    body = {"model_id": LLMS[1], "inputs": ["abc", ".", ""], "parameters": {"max_tokens": 2}}
    for _ in range(5):
        r = httpx.post(f"{url}/v1/inference", json=body, headers=auth, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["message"] == "prompt: must not be empty", r.text
    body = {"model_id": LLMS[1], "inputs": ["abc", "."], "parameters": {"max_tokens": 2}}
    assert httpx.post(f"{url}/v1/inference", json=body, headers=auth, timeout=60).status_code == 200
    # A byte range of the manifest was served as application/json that is not JSON; it is always sent whole.
    manifest = f"{url}/v1/edge/artifacts/{ARTIFACT}/{ARTIFACT_VERSION}/manifest.json"
    r = httpx.get(manifest, headers={**device, "Range": "bytes=5-"})
    assert r.status_code == 200 and r.json()["version"] == ARTIFACT_VERSION
    # Every error the API answers is declared, in the OpenAI shape; streams and jobs are declared too.
    raw = api_schema.raw_schema
    chat_op = raw["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"200", "202", "400", "401", "403", "404", "409", "413", "422", "429"} <= set(chat_op)
    assert set(chat_op["200"]["content"]) == {"application/json", "text/event-stream"}
    error = chat_op["401"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    assert set(raw["components"]["schemas"][error]["properties"]) == {"error"}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": LLMS[0], "prompt": ["a", "b"], "max_tokens": 3, "n": 2, "stream": True}),
        (
            "/v1/chat/completions",
            {
                "model": LLMS[1],
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ),
    ],
)
def test_streamed_answers_are_events_the_schema_declares(
    api_schema: BaseSchema, fuzz_api: dict[str, str], path: str, body: dict[str, Any]
) -> None:
    """A stream, sent on purpose rather than left to the generator: every event must match the schema."""
    case = api_schema[path]["POST"].Case(body=body, headers={"Authorization": f"Bearer {fuzz_api['key']}"})
    response = case.call_and_validate(base_url=fuzz_api["url"], checks=CHECKS, timeout=60)
    assert response.status_code == 200
    assert response.headers["content-type"][0].startswith("text/event-stream")
    assert response.text.rstrip().endswith("data: [DONE]")

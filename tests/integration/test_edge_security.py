"""What a local caller, or a changed file, can do to the edge agent, on real agent (and cloud) processes: token
ids outside the vocabulary are a 400 that never counts towards rolling a fresh model version back; model files
are verified again when first loaded; the plain model id survives a refused INT8 export; the local API key is
compared in constant time; request fields of the wrong JSON type are refused naming the field."""

from __future__ import annotations

import hmac
import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine
from sqlmodel import Session, select

from controlplane.storage.tables import DeviceEvent
from edge_agent.app import _local_key_guard
from shared.errors import AuthenticationError
from tests.conftest import base_env, free_port, migrated_sqlite, run_server, seed_data_dir
from tests.forkserver import run_tierline
from tests.integration.edge_support import ZOO_PAIRS_ENV

pytestmark = pytest.mark.integration
PLAIN, INT8, FP32 = "tierline/lm-edge", "tierline/lm-edge-onnx-int8", "tierline/lm-edge-onnx"
LOCAL_KEY = "edge-local-key-0123456789"
OUT_OF_VOCABULARY = 99_999


def _models(url: str, headers: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    return {m["id"]: m for m in httpx.get(f"{url}/v1/models", headers=headers).json()["data"]}


# -- a local agent whose INT8 export fails verification, behind a local API key -----------------------------------
@dataclass
class LocalAgent:
    url: str
    zoo: Path
    pristine_zoo: Path

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {LOCAL_KEY}"}

    def complete(self, model: str, **extra: Any) -> httpx.Response:
        body = {"model": model, "prompt": "def f(", "max_tokens": 3, "temperature": 0, **extra}
        return httpx.post(f"{self.url}/v1/completions", json=body, headers=self.auth, timeout=60)


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory, tiny_zoo: Path, session_data_dir: Path) -> Iterator[LocalAgent]:
    data = seed_data_dir(tmp_path_factory.mktemp("edge-security"), tiny_zoo, session_data_dir)
    zoo = data / "zoo" / "tiny"
    int8_file = zoo / "artifacts" / "lm-edge-onnx-int8" / "model.onnx"
    int8_file.write_bytes(int8_file.read_bytes() + b"\0")  # no longer the signed bytes: refused at start-up
    env = base_env(
        data,
        TIERLINE_EDGE_ZOO_DIR=str(zoo),
        TIERLINE_EDGE_STATE_DIR=str(data / "agent"),
        TIERLINE_EDGE_API_KEY=LOCAL_KEY,
    )
    with run_server(["edge", "run"], env, free_port()) as url:
        yield LocalAgent(url, zoo, tiny_zoo)


def test_a_refused_int8_export_leaves_the_plain_id_on_the_fp32_one(local: LocalAgent) -> None:
    models = _models(local.url, local.auth)
    assert INT8 not in models and models[FP32]["format"] == "onnx"
    guard = models[PLAIN]["runtime_guard"]
    int8 = next(c for c in guard["candidates"] if c["format"] == "onnx-int8")
    assert not int8["eligible"] and int8["ms_per_token"] is None and int8["reason"].startswith("refused: ")
    assert models[PLAIN]["format"] == guard["chosen"] != "onnx-int8"
    via_plain = local.complete(PLAIN)  # (the fp32 id itself stays unloaded for the next test)
    assert via_plain.status_code == 200 and via_plain.headers["x-tierline-tier"] == "edge", via_plain.text


def test_a_model_file_changed_after_start_up_is_refused_when_it_loads(local: LocalAgent) -> None:
    """Start-up verified the fp32 export; its file is replaced (by another valid ONNX model) before first use."""
    fp32_file = local.zoo / "artifacts" / "lm-edge-onnx" / "model.onnx"
    swapped_in = local.pristine_zoo / "artifacts" / "lm-edge-onnx-int8" / "model.onnx"
    original = fp32_file.read_bytes()
    shutil.copyfile(swapped_in, fp32_file)
    try:
        r = local.complete(FP32)
        assert r.status_code == 404, r.text
        assert (
            r.json()["error"]["message"] == f"The model '{FP32}' failed verification on this device and is not served"
        )
        assert local.complete(FP32).status_code == 404  # refused for good, not re-read on the next request
    finally:
        fp32_file.write_bytes(original)


def test_the_local_api_key_is_required_and_compared_in_constant_time(
    local: LocalAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert httpx.get(f"{local.url}/v1/models").status_code == 401
    assert httpx.get(f"{local.url}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(f"{local.url}/v1/models", headers={b"Authorization": "Bearer é".encode()}).status_code == 401
    assert httpx.get(f"{local.url}/v1/models", headers=local.auth).status_code == 200

    compared: list[tuple[Any, Any]] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)

    class _Request:
        def __init__(self, authorization: str) -> None:
            self.headers = {"authorization": authorization}

    _local_key_guard(LOCAL_KEY, _Request(f"Bearer {LOCAL_KEY}"))  # type: ignore[arg-type]
    with pytest.raises(AuthenticationError):
        _local_key_guard(LOCAL_KEY, _Request("Bearer x" + LOCAL_KEY[1:]))  # type: ignore[arg-type]
    assert len(compared) == 2  # both answers came from hmac.compare_digest, not from ==


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/completions", "max_tokens", "5"),
        ("/v1/completions", "max_tokens", True),
        ("/v1/chat/completions", "max_tokens", "5"),
        ("/v1/chat/completions", "temperature", "0"),
        ("/v1/completions", "stream", 0),
    ],
)
def test_values_of_the_wrong_json_type_are_refused_naming_the_field(
    local: LocalAgent, path: str, field: str, value: Any
) -> None:
    body: dict[str, Any] = {"model": FP32, field: value}
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    r = httpx.post(f"{local.url}{path}", json=body, headers=local.auth, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and r.json()["error"]["message"].startswith(field)


# -- an enrolled agent with a freshly installed model version ------------------------------------------------------
@dataclass
class Fleet:
    cloud_url: str
    edge_url: str
    db: str
    state: Path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, tiny_zoo: Path, session_data_dir: Path) -> Iterator[Fleet]:
    data = seed_data_dir(tmp_path_factory.mktemp("edge-rollback"), tiny_zoo, session_data_dir)
    cloud_env = base_env(
        data,
        TIERLINE_DATABASE_URL=migrated_sqlite(data),
        TIERLINE_CLOUD_ZOO_PRESET="tiny",
        TIERLINE_CLOUD_KV_CACHE_MB="16",
        TIERLINE_CLOUD_EDGE_SYNC_INTERVAL_S="0.5",
    )
    state = data / "agent-state"
    agent_env = base_env(
        data,
        TIERLINE_EDGE_ZOO_DIR=str(data / "zoo" / "tiny"),
        TIERLINE_EDGE_STATE_DIR=str(state),
        TIERLINE_EDGE_ROLLBACK_MIN_REQUESTS="5",
        TIERLINE_EDGE_ROLLBACK_MAX_ERROR_RATE="0.2",
        **ZOO_PAIRS_ENV,
    )

    def cli(*args: str, env: dict[str, str] = cloud_env) -> str:
        proc = run_tierline(*args, env=env)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    cli("tenants", "create", "acme")
    token = cli("devices", "enrollment-token", "--tenant", "acme")
    int8_dir = str(data / "zoo" / "tiny" / "artifacts" / "lm-edge-onnx-int8")
    cloud_port = free_port()
    with run_server(["cloud", "serve"], cloud_env, cloud_port, timeout=120) as cloud_url:
        cli("edge", "enroll", "--cloud", cloud_url, "--token", token, "--name", "sec-1", env=agent_env)
        with run_server(["edge", "run"], agent_env, free_port()) as edge_url:
            # Two versions, so the second has a previous one to roll back to and is under the health watch.
            for version in ("sec-2", "sec-3"):
                cli("cloud", "publish", int8_dir, "--as-version", version)
                deadline = time.monotonic() + 90
                while _models(edge_url)[INT8]["version"] != version:
                    assert time.monotonic() < deadline, f"the agent did not switch to {version}"
                    time.sleep(0.2)
            yield Fleet(cloud_url, edge_url, cloud_env["TIERLINE_DATABASE_URL"], state)


def test_a_flood_of_bad_token_ids_is_refused_and_never_rolls_the_new_version_back(fleet: Fleet) -> None:
    refused: list[httpx.Response] = []
    with httpx.Client(base_url=fleet.edge_url, timeout=60) as http:
        for i in range(30):
            bad = [5, OUT_OF_VOCABULARY] if i % 2 else [-1]
            body = {"model": INT8, "prompt": bad, "max_tokens": 2, "echo": i % 4 < 2}  # echo decodes the prompt
            refused.append(http.post("/v1/completions", json=body))
        good = {"model": INT8, "prompt": [5, 6, 7], "max_tokens": 2}
        ok = http.post("/v1/completions", json=good, headers={"x-tierline-tier": "local-only"})
    assert [r.status_code for r in refused] == [400] * 30
    errors = [r.json()["error"] for r in refused]
    assert all(e["param"] == "prompt" and e["code"] == "invalid_token_id" for e in errors)
    assert f"token id {OUT_OF_VOCABULARY} is outside" in errors[1]["message"] and "token id -1" in errors[0]["message"]
    assert ok.status_code == 200 and ok.headers["x-tierline-tier"] == "edge"
    time.sleep(2.0)  # several syncs: a rollback would have happened and been reported by now
    assert _models(fleet.edge_url)[INT8]["version"] == "sec-3"
    stored = json.loads((fleet.state / "models" / "state.json").read_text())["lm-edge-onnx-int8"]
    assert stored["current"] == "sec-3" and stored["blocked"] == {}
    stats = httpx.get(f"{fleet.edge_url}/v1/agent").json()["models"]
    assert stats[f"{INT8}@sec-3"]["errors"] == 0
    engine = create_engine(fleet.db)
    with Session(engine) as s:
        kinds = [e.payload.get("type") for e in s.exec(select(DeviceEvent).where(DeviceEvent.kind == "event"))]
    engine.dispose()
    assert "update.activated" in kinds and "update.rolled_back" not in kinds

"""The boundary between a console admin and the host (issue 39, item 1): a registry version's serving spec reads its
upstream key only from where the operator designates, and reaches only the endpoints the operator's egress policy
allows, checked when the spec is submitted (console API, CLI) and again by the gateway, so a spec stored before the
rules (written straight to the database here) is not served either.

Real processes: a console and a gateway (``tierline cloud serve``) on one SQLite database; two listeners in this test
process on real sockets record every request and its ``Authorization``: one on ``127.0.0.1`` (loopback, which the
operator does not allow) and one on ``127.0.0.2``, which the operator's allow-list names
(``TIERLINE_CLOUD_UPSTREAM_ALLOW=127.0.0.2/32``).
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, update
from sqlalchemy.engine import Engine
from sqlmodel import Session, col

from console.management_api import create_token
from console.passwords import create_user
from controlplane.registry import service as registry
from controlplane.registry.artifacts import push_path
from controlplane.registry.store import LocalArtifactStore
from controlplane.storage.tables import ModelVersion
from controlplane.tenancy.service import create_api_key, create_tenant
from shared.artifacts import load_or_create_signing_key
from shared.zoo.registry import ZooLayout
from tests.conftest import base_env, free_port, migrated_sqlite, seed_data_dir, server_process
from tests.forkserver import run_tierline

pytestmark = pytest.mark.integration
ACTOR = "test"
CLOUD_SECRET = "cloud-secret-key-that-signs-console-sessions-0123456789"
UPSTREAM_KEY = "sk-upstream-x-designated"
FILE_SECRET = "sk-a-file-outside-the-secrets-dir"
TOKENIZER_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
GOOD, STOLEN_ENV, STOLEN_FILE, LOOPBACK_NAME, FILE_KEY = "good", "stolen-env", "stolen-file", "by-name", "file-key"


@dataclass
class Listener:
    """An OpenAI-compatible server that records each request's path and Authorization header."""

    host: str
    seen: list[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        listener = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _answer(self, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                listener.seen.append((self.path, self.headers.get("authorization", "")))
                self._answer({"status": "ok"})

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length") or 0))
                listener.seen.append((self.path, self.headers.get("authorization", "")))
                self._answer(
                    {
                        "id": "cmpl-1",
                        "object": "chat.completion",
                        "created": 0,
                        "model": "x",
                        "choices": [
                            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
                        ],
                        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
                    }
                )

        self._server = ThreadingHTTPServer((self.host, 0), Handler)
        self.port = self._server.server_address[1]
        self.url = f"http://{self.host}:{self.port}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@dataclass
class Platform:
    gateway: str
    console: str
    admin_token: str
    api_key: str
    db: Engine
    data: Path
    env: dict[str, str]
    loopback: Listener  # 127.0.0.1: not allowed
    allowed: Listener  # 127.0.0.2: in the operator's allow-list

    def console_put(self, name: str, spec: dict[str, Any] | None) -> httpx.Response:
        return httpx.put(
            f"{self.console}/api/models/{name}/versions/1/serving",
            json={"serving": spec},
            headers={"Authorization": f"Bearer {self.admin_token}"},
            timeout=30,
        )

    def chat(self, model: str) -> httpx.Response:
        body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        headers = {"Authorization": f"Bearer {self.api_key}"}
        return httpx.post(f"{self.gateway}/v1/chat/completions", json=body, headers=headers, timeout=30)


def until(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.1)


def spec(*endpoints: str, **extra: Any) -> dict[str, Any]:
    return {"backend": "openai", "endpoints": list(endpoints), "upstream_model": "x", **extra}


def store_directly(db: Engine, name: str, serving: dict[str, Any]) -> None:
    """A spec as a release before the rules stored it (or as someone with database access writes it)."""
    with Session(db) as s:
        version = registry.get_version(s, registry.get_model(s, name), 1)
        s.execute(update(ModelVersion).where(col(ModelVersion.id) == version.id).values(serving=serving))
        s.commit()


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory, tiny_zoo: Path, session_data_dir: Path) -> Iterator[Platform]:
    data = seed_data_dir(tmp_path_factory.mktemp("serving-boundary"), tiny_zoo, session_data_dir)
    lm_dir = ZooLayout(tiny_zoo).artifact_dir("lm-cloud")
    tokenizer = data / "tokenizer"
    tokenizer.mkdir()
    for name in TOKENIZER_FILES:
        shutil.copy(lm_dir / name, tokenizer / name)
    secrets = data / "upstream-keys"
    secrets.mkdir()
    (secrets / "x.key").write_text(UPSTREAM_KEY + "\n")
    (secrets / "x.key").chmod(0o600)
    outside = data / "outside.key"  # mode 0600, but outside the secrets directory
    outside.write_text(FILE_SECRET + "\n")
    outside.chmod(0o600)
    db_url = migrated_sqlite(data)
    loopback, allowed = Listener("127.0.0.1"), Listener("127.0.0.2")
    env = base_env(
        data,
        TIERLINE_DATABASE_URL=db_url,
        TIERLINE_SECRET_KEY=CLOUD_SECRET,
        TIERLINE_UPSTREAM_KEY_X=UPSTREAM_KEY,
        TIERLINE_CLOUD_UPSTREAM_SECRETS_DIR=str(secrets),
        TIERLINE_CLOUD_UPSTREAM_ALLOW="127.0.0.2/32",
        TIERLINE_CLOUD_ZOO_PRESET="none",
        TIERLINE_CLOUD_USAGE_FLUSH_MS="50",
        TIERLINE_CLOUD_CANARY_REFRESH_S="0.3",
        TIERLINE_CLOUD_REGISTRY_MODELS=",".join((GOOD, STOLEN_ENV, STOLEN_FILE, LOOPBACK_NAME, FILE_KEY)),
    )
    db = create_engine(db_url)
    store = LocalArtifactStore(data / "artifacts")
    signing = load_or_create_signing_key(data / "keys" / "artifact-signing.ed25519")
    with Session(db) as s:
        for name in (GOOD, STOLEN_ENV, STOLEN_FILE, LOOPBACK_NAME, FILE_KEY):
            push_path(s, store, tokenizer, name=name, alias="stable", actor=ACTOR, signing_key=signing)
        create_user(s, "ops", "correct horse battery", "admin")
        admin_token = create_token(s, "ops").secret
        api_key = create_api_key(s, create_tenant(s, "acme")).secret
        s.commit()
    # Specs stored before the rules: the cloud's secret, a file outside the secrets directory (to an allowed
    # address), and a host name that resolves to loopback.
    store_directly(db, STOLEN_ENV, spec(loopback.url, api_key_env="TIERLINE_SECRET_KEY"))
    store_directly(db, STOLEN_FILE, spec(allowed.url, api_key_file=str(outside)))
    store_directly(db, LOOPBACK_NAME, spec(f"http://localhost:{loopback.port}", api_key_env="TIERLINE_UPSTREAM_KEY_X"))
    gateway_port, console_port = free_port(), free_port()
    try:
        with (
            server_process(["cloud", "serve"], env, gateway_port, timeout=180, log=data / "gateway.log"),
            server_process(["console", "serve"], env, console_port, timeout=60, log=data / "console.log"),
        ):
            yield Platform(
                f"http://127.0.0.1:{gateway_port}",
                f"http://127.0.0.1:{console_port}",
                admin_token,
                api_key,
                db,
                data,
                env,
                loopback,
                allowed,
            )
    finally:
        loopback.close()
        allowed.close()
        db.dispose()


@pytest.mark.parametrize(
    ("serving", "param", "rule"),
    [
        (
            spec("http://127.0.0.2:9", api_key_env="TIERLINE_SECRET_KEY"),
            "serving.api_key_env",
            "TIERLINE_UPSTREAM_KEY_",
        ),
        (
            spec("http://127.0.0.2:9", api_key_env="TIERLINE_DATABASE_URL"),
            "serving.api_key_env",
            "TIERLINE_UPSTREAM_KEY_",
        ),
        (spec("http://127.0.0.2:9", api_key_file="/etc/passwd"), "serving.api_key_file", "bare name"),
        (spec("http://127.0.0.2:9", api_key_file="../outside.key"), "serving.api_key_file", "bare name"),
        (spec("http://169.254.169.254/latest"), "serving.endpoints.0", "link-local or cloud metadata"),
        (spec("http://metadata.google.internal"), "serving.endpoints.0", "cloud metadata host"),
        (spec("http://0.0.0.0:8000"), "serving.endpoints.0", "unspecified"),
        (spec("http://[::1]:8000"), "serving.endpoints.0", "loopback"),
        (spec("http://127.0.0.1:8000"), "serving.endpoints.0", "loopback"),
        # read as the resolver reads it (WHATWG): 127.0.0.1
        (spec("http://127.0.0.2:8000", "http://2130706433:8000"), "serving.endpoints.1", "127.0.0.1 is a loopback"),
        (spec("http://localhost:8000"), "serving.endpoints.0", "loopback"),
        (spec("http://10.0.0.7:8000"), "serving.endpoints.0", "not in the operator's allow-list"),
    ],
)
def test_the_console_refuses_a_spec_that_reaches_past_the_operators_designations(
    platform: Platform, serving: dict[str, Any], param: str, rule: str
) -> None:
    answer = platform.console_put(GOOD, serving)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and rule in error["message"] and error["message"].startswith(param)
    with Session(platform.db) as s:
        stored = registry.get_version(s, registry.get_model(s, GOOD), 1).serving
    assert stored is None or stored.get("endpoints") == [platform.allowed.url]  # unchanged


def test_the_cli_refuses_the_clouds_secret_as_an_upstream_key(platform: Platform) -> None:
    bad = platform.data / "bad.json"
    bad.write_text(json.dumps(spec(platform.allowed.url, api_key_env="TIERLINE_SECRET_KEY")))
    proc = run_tierline("models", "serving", FILE_KEY, "1", str(bad), env=platform.env)
    assert proc.returncode != 0
    assert "serving.api_key_env: 'TIERLINE_SECRET_KEY' is not an upstream key variable" in proc.stderr
    assert "TIERLINE_UPSTREAM_KEY_" in proc.stderr and CLOUD_SECRET not in proc.stderr + proc.stdout


def test_a_spec_with_a_designated_key_reaches_an_allowed_upstream_with_that_key(platform: Platform) -> None:
    answer = platform.console_put(GOOD, spec(platform.allowed.url, api_key_env="TIERLINE_UPSTREAM_KEY_X"))
    assert answer.status_code == 200, answer.text
    until(lambda: platform.chat(GOOD).status_code == 200, "the good version is served")
    posts = [auth for path, auth in platform.allowed.seen if path == "/v1/chat/completions"]
    assert posts and set(posts) == {f"Bearer {UPSTREAM_KEY}"}
    # A key file by its bare name in the secrets directory, through the CLI.
    good_file = platform.data / "file.json"
    good_file.write_text(json.dumps(spec(platform.allowed.url, api_key_file="x.key")))
    proc = run_tierline("models", "serving", FILE_KEY, "1", str(good_file), env=platform.env)
    assert proc.returncode == 0, proc.stderr
    until(lambda: platform.chat(FILE_KEY).status_code == 200, "the file-key version is served")


@pytest.mark.parametrize(
    ("model", "why"),
    [
        (STOLEN_ENV, "serving.api_key_env: 'TIERLINE_SECRET_KEY' is not an upstream key variable"),
        (STOLEN_FILE, "serving.api_key_file: '/"),
        (LOOPBACK_NAME, "serving.endpoints.0: http://localhost:"),
    ],
)
def test_a_spec_stored_before_the_rules_is_not_served_and_nothing_reaches_its_listener(
    platform: Platform, model: str, why: str
) -> None:
    answer = platform.chat(model)
    assert answer.status_code == 503, answer.text
    error = answer.json()["error"]
    assert error["code"] == "model_unavailable" and why in error["message"], error
    ready = httpx.get(f"{platform.gateway}/readyz", timeout=10).json()
    assert any(entry.startswith(f"{model}@1") and why in entry for entry in ready["degraded"]), ready
    assert why in (platform.data / "gateway.log").read_text()
    assert platform.loopback.seen == []  # the listener on 127.0.0.1 got no request at all
    seen = [auth for _, auth in platform.allowed.seen]
    assert not any(CLOUD_SECRET in a or FILE_SECRET in a for a in seen), seen  # no secret anywhere

"""The cloud API, console and edge agent as real processes on real sockets, with real clients."""

from __future__ import annotations

import importlib.util
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from controlplane.storage.migrate import upgrade
from controlplane.storage.session import session_scope
from tests.conftest import base_env, free_port, run_server, seed_data_dir
from tests.forkserver import run_tierline

pytestmark = pytest.mark.integration


@pytest.fixture
def data_dir(tmp_path: Path, tiny_zoo: Path, session_data_dir: Path) -> Path:
    """A data dir holding the session's tiny zoo and the key that signed it."""
    return seed_data_dir(tmp_path / "data", tiny_zoo, session_data_dir)


@pytest.fixture
def cloud_env(data_dir: Path, db_url: str) -> dict[str, str]:
    upgrade(db_url)
    return base_env(data_dir, TIERLINE_DATABASE_URL=db_url, TIERLINE_CLOUD_ZOO_PRESET="tiny")


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return run_tierline(*args, env=env)


@pytest.fixture
def cloud(cloud_env: dict[str, str]) -> Iterator[str]:
    with run_server(["cloud", "serve"], cloud_env, free_port()) as url:
        yield url


def test_cloud_requires_a_key_and_answers_in_the_openai_shape(cloud: str, cloud_env: dict[str, str]) -> None:
    r = httpx.get(f"{cloud}/v1/models")
    assert r.status_code == 401
    err = r.json()["error"]
    assert err["type"] == "authentication_error" and "bearer" in err["message"].lower()
    r = httpx.get(f"{cloud}/v1/models", headers={"Authorization": "Bearer tl-not-a-real-key"})
    assert r.status_code == 401
    ready = httpx.get(f"{cloud}/readyz").json()
    assert ready["status"] == "ready" and "tierline/lm-cloud" in ready["models"]


def test_cli_key_works_with_the_openai_sdk_until_revoked(cloud: str, cloud_env: dict[str, str]) -> None:
    assert _cli(cloud_env, "tenants", "create", "acme", "--budget", "25").returncode == 0
    created = _cli(cloud_env, "keys", "create", "--tenant", "acme")
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip()
    assert key.startswith("tl-")
    client = openai.OpenAI(base_url=f"{cloud}/v1", api_key=key)
    ids = {m.id for m in client.models.list()}
    assert {"tierline/lm-cloud", "tierline/digits-large"} <= ids
    assert client.models.retrieve("tierline/lm-cloud").owned_by == "tierline"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("tierline/no-such-model")
    key_id = created.stderr.split("key id ")[1].split()[0]
    assert _cli(cloud_env, "keys", "revoke", key_id).returncode == 0
    # The cloud trusts a verified key for TIERLINE_CLOUD_AUTH_CACHE_S (1 s) without a database read: a revoked
    # key stops working within that.
    revoked = time.monotonic()
    while True:
        try:
            client.models.list()
        except openai.AuthenticationError:
            break
        assert time.monotonic() - revoked < 1.5, "the revoked key still works after the auth cache's 1 s"
        time.sleep(0.05)


def test_cli_bad_input_is_one_line_not_a_traceback(cloud_env: dict[str, str]) -> None:
    for args in (
        ("tenants", "create", "Bad Name"),
        ("tenants", "create", "x", "--budget", "lots"),
        ("keys", "create", "--tenant", "nobody"),
        ("keys", "revoke", "999"),
    ):
        proc = _cli(cloud_env, *args)
        assert proc.returncode == 1, args
        assert proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


def test_console_overview_renders(data_dir: Path, db_url: str) -> None:
    upgrade(db_url)
    env = base_env(data_dir, TIERLINE_DATABASE_URL=db_url)
    with run_server(["console", "serve"], env, free_port()) as url:
        home = httpx.get(url + "/")
        assert home.status_code == 303 and home.headers["location"].startswith("/login")
        r = httpx.get(url + "/login")
        assert r.status_code == 200
        assert "tierline" in r.text and 'name="password"' in r.text


def test_console_create_admin_stores_an_argon2id_hash(data_dir: Path, db_url: str) -> None:
    from sqlmodel import select

    from controlplane.storage.database import create_db
    from controlplane.storage.tables import ConsoleUser

    upgrade(db_url)
    env = base_env(data_dir, TIERLINE_DATABASE_URL=db_url)
    proc = run_tierline(
        "console", "create-admin", "--username", "ops", "--password-stdin", env=env, input="correct horse battery\n"
    )
    assert proc.returncode == 0, proc.stderr
    short = run_tierline("console", "create-admin", "--username", "x", "--password-stdin", env=env, input="short\n")
    assert short.returncode == 1 and "at least 12 characters" in short.stderr
    engine = create_db(db_url)
    with session_scope(engine) as s:
        user = s.exec(select(ConsoleUser).where(ConsoleUser.username == "ops")).one()
        assert user.password_hash.startswith("$argon2id$")
        assert "correct horse" not in user.password_hash
    engine.dispose()


def _edge_env(data_dir: Path) -> dict[str, str]:
    return base_env(
        data_dir,
        TIERLINE_EDGE_ZOO_DIR=str(data_dir / "zoo" / "tiny"),
        TIERLINE_EDGE_TRUSTED_KEYS=f'["{data_dir / "keys" / "artifact-signing.ed25519.pub"}"]',
    )


def test_edge_agent_serves_only_verified_models(data_dir: Path) -> None:
    with run_server(["edge", "run"], _edge_env(data_dir), free_port()) as url:
        models = {m["id"]: m for m in httpx.get(f"{url}/v1/models").json()["data"]}
    # llama.cpp's GGUF export is served where llama-cpp-python is installed (tierline[edge-gguf]), else not listed.
    gguf = {"tierline/lm-edge-gguf"} if importlib.util.find_spec("llama_cpp") is not None else set()
    assert {
        "tierline/lm-edge",  # the runtime guard's pick among the exports
        "tierline/lm-edge-onnx",
        "tierline/lm-edge-onnx-int8",
        "tierline/lm-edge-tflite",
        "tierline/lm-micro",  # every signed edge artifact of the zoo is served, the micro LM's exports too
        "tierline/lm-micro-onnx",
        "tierline/lm-micro-onnx-int8",
        "tierline/digits-small",
        "tierline/digits-micro",
        *gguf,
    } == set(models)
    # Tamper with one artifact: the agent refuses it and serves the rest.
    target = data_dir / "zoo" / "tiny" / "artifacts" / "lm-edge-onnx-int8" / "model.onnx"
    target.write_bytes(target.read_bytes() + b"\x00")
    with run_server(["edge", "run"], _edge_env(data_dir), free_port()) as url:
        ids = {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]}
    assert "tierline/lm-edge-onnx-int8" not in ids and "tierline/lm-edge-onnx" in ids


def test_edge_local_api_key(data_dir: Path) -> None:
    env = {**_edge_env(data_dir), "TIERLINE_EDGE_API_KEY": "local-secret-123"}
    with run_server(["edge", "run"], env, free_port()) as url:
        assert httpx.get(f"{url}/v1/models").status_code == 401
        ok = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer local-secret-123"})
        assert ok.status_code == 200


def test_edge_config_file_errors_are_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "edge.toml"
    bad.write_text("port = 'not a port'\n")
    proc = run_tierline("edge", "run", "--config", str(bad), env=base_env(tmp_path))
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: invalid edge config") and "Traceback" not in proc.stderr

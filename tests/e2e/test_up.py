"""`tierline up --bare`: three processes, seeded tenant and admin, up.json for scripts, clean Ctrl-C. (The
connected default: test_up_connected.py.)"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO, base_env, free_port
from tests.forkserver import tierline_cmd

pytestmark = pytest.mark.e2e


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _start_up(
    env: dict[str, str],
    up_json: Path,
    previous_pids: dict[str, int] | None,
    *args: str,
    timeout: float = 300,  # the shared test host can be slow to start a cloud
    zoo: str = "tiny",
) -> tuple[subprocess.Popen[str], dict]:
    """Start `tierline up` (on the ``zoo`` preset) and wait until it writes an up.json with new pids."""
    proc = subprocess.Popen(
        tierline_cmd("up", "--zoo", zoo, *args),
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + timeout
    while True:
        if up_json.exists():
            info = json.loads(up_json.read_text())
            if info["pids"] != previous_pids:
                return proc, info
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"tierline up did not come up:\n{proc.communicate()[0]}")
        time.sleep(0.2)


def test_up_serves_everything_and_stops_cleanly(tmp_path: Path, tiny_zoo: Path, session_data_dir: Path) -> None:
    data = tmp_path / "data"
    shutil.copytree(session_data_dir / "keys", data / "keys")
    shutil.copytree(tiny_zoo, data / "zoo" / "tiny")
    ports = {name: str(free_port()) for name in ("CLOUD", "CONSOLE", "EDGE")}
    env = base_env(data, **{f"TIERLINE_{n}_PORT": p for n, p in ports.items()})
    up_json = data / "up.json"
    proc, info = _start_up(env, up_json, None, "--bare")
    try:
        assert stat.S_IMODE(up_json.stat().st_mode) == 0o600
        assert info["cloud_url"].endswith(ports["CLOUD"])
        models = httpx.get(
            f"{info['cloud_url']}/v1/models", headers={"Authorization": f"Bearer {info['api_key']}"}
        ).json()
        assert "tierline/lm-cloud" in {m["id"] for m in models["data"]}
        edge = httpx.get(f"{info['edge_url']}/v1/models").json()
        assert "tierline/lm-edge-onnx-int8" in {m["id"] for m in edge["data"]}
        console_home = httpx.get(info["console_url"] + "/")
        assert console_home.status_code == 303 and console_home.headers["location"].startswith("/login")
        assert httpx.get(info["console_url"] + "/login").status_code == 200
        assert info["console_admin"] == "admin" and len(info["console_admin_password"]) >= 16
        assert info["api_key"] in info["curl_cloud"]
        chat = subprocess.run(info["curl_cloud"], shell=True, capture_output=True, text=True, timeout=120, check=True)
        answer = json.loads(chat.stdout)
        assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["content"]
        local = subprocess.run(info["curl_edge"], shell=True, capture_output=True, text=True, timeout=120, check=True)
        assert json.loads(local.stdout)["choices"][0]["text"]
        children = list(info["pids"].values())
        assert all(_pid_alive(pid) for pid in children)
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "tierline is up" in out and info["api_key"] in out
    assert not any(_pid_alive(pid) for pid in children)

    # A second run reuses the key and the admin; SIGTERM (a service manager's stop) is as clean as Ctrl-C.
    proc, again = _start_up(env, up_json, info["pids"], "--bare")
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert again["api_key"] == info["api_key"]
    assert again["console_admin_password"] == info["console_admin_password"]
    assert not any(_pid_alive(pid) for pid in again["pids"].values())
    assert not (data / "edge" / "credentials.json").exists()  # --bare: no device, no registry, no prices
    assert not (data / "edge" / "policies").exists() and again["seeded"] == []

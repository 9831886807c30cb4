"""``tierline up``: the embedded all-in-one on localhost.

Builds the zoo if needed, migrates the SQLite database, seeds a demo tenant with an API key and a console
admin, then runs the cloud API, the console and one edge agent as separate processes until Ctrl-C.
What it prints is also written to ``$TIERLINE_DATA_DIR/up.json`` (mode 0600) for scripts.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click
import httpx

from shared.errors import ConfigurationError

logger = logging.getLogger(__name__)

DEMO_TENANT = "demo"
ADMIN_USER = "admin"
STARTUP_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 20.0


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    path.chmod(0o600)


def _read_previous(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


def _seed_tenant_key(previous: dict[str, Any]) -> str:
    """The demo tenant's key: the one from the last run while it is still valid, else a new one."""
    from controlplane.storage.session import session_scope
    from controlplane.tenancy.service import authenticate, create_api_key, create_tenant, get_tenant, list_tenants
    from shared.errors import AuthenticationError

    with session_scope() as session:
        old = previous.get("api_key")
        if isinstance(old, str):
            try:
                tenant, _ = authenticate(session, old)
                if tenant.name == DEMO_TENANT:
                    return old
            except AuthenticationError:
                pass
        exists = any(t.name == DEMO_TENANT for t in list_tenants(session))
        tenant = get_tenant(session, DEMO_TENANT) if exists else create_tenant(session, DEMO_TENANT)
        return create_api_key(session, tenant, name="tierline up").secret


def _tierline(*args: str) -> list[str]:
    return [sys.executable, "-m", "tierline.cli", *args]


def _seed_admin(previous: dict[str, Any], env: dict[str, str]) -> str | None:
    """Create the console admin on first run; return its password (None when it existed before)."""
    password = previous.get("console_admin_password")
    new_password = secrets.token_urlsafe(18)
    proc = subprocess.run(
        _tierline("console", "create-admin", "--username", ADMIN_USER, "--if-missing", "--password-stdin"),
        input=new_password + "\n",
        text=True,
        capture_output=True,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        raise ConfigurationError(f"could not create the console admin: {proc.stderr.strip().splitlines()[-1:]}")
    return new_password if "created" in proc.stdout else password


def _wait_healthy(name: str, url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ConfigurationError(f"{name} exited with code {proc.returncode} during start-up (see its log above)")
        try:
            if httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise ConfigurationError(f"{name} did not answer {url}/healthz within {STARTUP_TIMEOUT_S:.0f}s")


def _stop(procs: dict[str, subprocess.Popen[bytes]]) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for name, proc in procs.items():
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop in time; killing it", name)
            proc.kill()
            proc.wait()


def _raise_interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


@click.command()
@click.option(
    "--zoo",
    "zoo_preset",
    type=click.Choice(["tiny", "demo"]),
    default="demo",
    show_default=True,
    help="which zoo preset to serve (built on first run)",
)
def up(zoo_preset: str) -> None:
    """Run the whole platform on localhost: cloud API, console and one edge agent (Ctrl-C stops all)."""
    from controlplane.storage.migrate import upgrade
    from shared.artifacts import load_or_create_signing_key, public_path
    from shared.settings import CoreSettings, DatabaseSettings, ServiceSettings
    from shared.zoo.build import build_zoo
    from shared.zoo.presets import get_preset

    core, svc = CoreSettings(), ServiceSettings()
    data_dir = core.data_dir.resolve()
    key = load_or_create_signing_key(core.signing_key_path)
    click.echo(f"[up] zoo {zoo_preset}: building if needed (first run of demo takes a few minutes)", err=True)
    build_zoo(get_preset(zoo_preset), core.zoo_dir, key, step=lambda m: click.echo(f"[zoo] {m}", err=True))
    upgrade(DatabaseSettings().url)

    up_path = data_dir / "up.json"
    previous = _read_previous(up_path)
    env = {
        **os.environ,
        "TIERLINE_DATA_DIR": str(data_dir),
        "TIERLINE_CLOUD_ZOO_PRESET": zoo_preset,
        "TIERLINE_EDGE_ZOO_DIR": str(core.zoo_dir.resolve() / zoo_preset),
        "TIERLINE_EDGE_TRUSTED_KEYS": json.dumps([str(public_path(core.signing_key_path).resolve())]),
        "TIERLINE_EDGE_CLOUD_URL": svc.resolved_cloud_url,
    }
    api_key = _seed_tenant_key(previous)
    admin_password = _seed_admin(previous, env)

    cloud_url = svc.resolved_cloud_url
    console_url = f"http://{svc.console_host}:{svc.console_port}"
    edge_url = f"http://{svc.edge_host}:{svc.edge_port}"
    commands = {
        "cloud": (_tierline("cloud", "serve", "--host", svc.cloud_host, "--port", str(svc.cloud_port)), cloud_url),
        "console": (
            _tierline("console", "serve", "--host", svc.console_host, "--port", str(svc.console_port)),
            console_url,
        ),
        "edge": (_tierline("edge", "run", "--host", svc.edge_host, "--port", str(svc.edge_port)), edge_url),
    }
    procs: dict[str, subprocess.Popen[bytes]] = {}
    # Ctrl-C and a service manager's stop mean the same; set SIGINT too, as a shell may start us with it ignored.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, _raise_interrupt)
    try:
        for name, (cmd, _url) in commands.items():
            procs[name] = subprocess.Popen(cmd, env=env)
        for name, (_cmd, url) in commands.items():
            _wait_healthy(name, url, procs[name])
        info = {
            "cloud_url": cloud_url,
            "console_url": console_url,
            "edge_url": edge_url,
            "tenant": DEMO_TENANT,
            "api_key": api_key,
            "console_admin": ADMIN_USER,
            "console_admin_password": admin_password,
            "zoo": str(core.zoo_dir.resolve() / zoo_preset),
            "curl_cloud": (
                f"curl -s {cloud_url}/v1/chat/completions -H 'Authorization: Bearer {api_key}' "
                '-H \'Content-Type: application/json\' -d \'{"model": "tierline/lm-cloud", "max_tokens": 48, '
                '"messages": [{"role": "user", "content": "def fibonacci(n):"}]}\''
            ),
            "curl_edge": (
                f"curl -s {edge_url}/v1/completions -H 'Content-Type: application/json' "
                '-d \'{"model": "tierline/lm-edge-onnx-int8", "prompt": "import os\\n", "max_tokens": 32}\''
            ),
            "pids": {name: p.pid for name, p in procs.items()},
        }
        _write_private(up_path, json.dumps(info, indent=2) + "\n")
        click.echo(
            "\ntierline is up\n"
            f"  cloud API  {cloud_url}\n  console    {console_url}  (user {ADMIN_USER}, password "
            f"{admin_password or 'set on an earlier run'})\n  edge agent {edge_url}\n"
            f"  tenant {DEMO_TENANT}, API key {api_key}\n\n"
            f"  {info['curl_cloud']}\n  {info['curl_edge']}\n\n"
            f"  (also in {up_path}, mode 0600)  Ctrl-C stops everything.\n"
        )
        while all(p.poll() is None for p in procs.values()):
            time.sleep(0.5)
        dead = [n for n, p in procs.items() if p.poll() is not None]
        raise ConfigurationError(f"{', '.join(dead)} exited unexpectedly; stopping the rest")
    except KeyboardInterrupt:
        click.echo("\n[up] stopping", err=True)
    finally:
        _stop(procs)

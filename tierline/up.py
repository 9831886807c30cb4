"""``tierline up``: the embedded all-in-one on localhost.

Builds the zoo if needed, migrates the SQLite database, seeds a demo tenant with an API key, a monthly budget
and a console admin, the zoo's models in the registry, a price book and a calibrated escalation policy per edge
model (``tierline.seed``; ``--bare`` seeds only the tenant, key and admin), then runs the cloud API, the console
and one edge agent as separate processes until Ctrl-C; the agent is enrolled as a device of the demo tenant
once the cloud answers. Being one host, it lets registry serving specs name model servers on loopback
(``TIERLINE_CLOUD_UPSTREAM_ALLOW_LOOPBACK=true``, their keys in ``$TIERLINE_DATA_DIR/upstream-keys/``) unless the
environment says otherwise. What it prints is also written to ``$TIERLINE_DATA_DIR/up.json`` (mode 0600) for
scripts. The terminal gets the URLs, the key, the password and the services' access lines (and their errors);
everything else (migrations, third-party warnings, the services' own logs) goes to
``$TIERLINE_DATA_DIR/logs/up.log``.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

import click
import httpx

from shared.errors import ConfigurationError
from tierline import seed

logger = logging.getLogger(__name__)

DEMO_TENANT = seed.DEMO_TENANT
ADMIN_USER = "admin"
STARTUP_TIMEOUT_S = 300.0  # a loaded laptop (or CI box) starting the cloud beside a first calibration
STOP_TIMEOUT_S = 20.0
LOG_FILE = "logs/up.log"
# Of edge-answered requests, answered again by the cloud (docs/quality-monitor.md): at the demo's ~2 requests/s, 20 %
# gives the monitor the 30 LM samples an alert needs within about two minutes (5 % took ~10 minutes, longer than
# the tour reads, so an LM policy below its promise went unreported).
DEMO_SHADOW_SHARE = "0.2"
SECRETS_FILE = "demo/up-secrets.json"  # the key and password, kept as soon as they exist (0600)
PROBES = ("/healthz", "/readyz")  # access lines of health probes go to the log only
SERVICE_LOGGER = "tierline.service"  # the children's lines, re-logged per service: tierline.service.cloud, ...


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


class _TerminalFilter(logging.Filter):
    """What reaches the terminal: the services' access lines and errors, and tierline's own warnings."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith(SERVICE_LOGGER + "."):
            path = getattr(record, "path", "")
            return (getattr(record, "access", False) and path not in PROBES) or record.levelno >= logging.ERROR
        return record.name.startswith(("tierline", "__main__")) and record.levelno >= logging.WARNING


def _configure_logging(log_path: Path) -> None:
    """Everything to ``log_path`` (DEBUG, rotated); the terminal only what :class:`_TerminalFilter` lets pass.
    Python warnings (torchao's, for one) become DEBUG records in the log."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    to_file = logging.handlers.RotatingFileHandler(log_path, maxBytes=20 << 20, backupCount=3)
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    to_file.setLevel(logging.DEBUG)
    terminal = logging.StreamHandler(sys.stderr)
    terminal.setFormatter(logging.Formatter("%(message)s"))
    terminal.addFilter(_TerminalFilter())
    root = logging.getLogger()
    root.handlers[:] = [to_file, terminal]
    root.setLevel(logging.DEBUG)
    for chatty in ("httpx", "httpcore", "alembic.runtime.plugins", "urllib3", "filelock", "matplotlib"):
        logging.getLogger(chatty).setLevel(logging.INFO)

    def to_debug(
        message: Warning | str, category: type[Warning], filename: str, lineno: int, *_: object, **__: object
    ) -> None:
        logging.getLogger("py.warnings").debug("%s:%d: %s: %s", filename, lineno, category.__name__, message)

    warnings.showwarning = to_debug


def _relay(name: str, stream: IO[bytes]) -> None:
    """Re-log a child's output line by line: its JSON records at their level (access lines marked), anything
    else (a third-party library printing to stderr, a traceback) at DEBUG."""
    log = logging.getLogger(f"{SERVICE_LOGGER}.{name}")
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or "message" not in record:
            log.debug("%s", line)
            continue
        level = logging.getLevelName(str(record.get("level", "INFO")))
        if record.get("logger") == "tierline.access":
            ms = record.get("duration_ms")
            log.info(
                "[%s] %s%s",
                name,
                record["message"],
                f" {ms:.0f} ms" if isinstance(ms, int | float) else "",
                extra={"access": True, "path": record.get("path", "")},
            )
        else:
            exc = f"\n{record['exc']}" if record.get("exc") else ""
            log.log(
                level if isinstance(level, int) else logging.INFO,
                "[%s] %s: %s%s",
                name,
                record.get("logger", "?"),
                record["message"],
                exc,
            )
    stream.close()


def _start(name: str, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    threading.Thread(target=_relay, args=(name, proc.stdout), name=f"relay-{name}", daemon=True).start()
    return proc


def _wait_healthy(name: str, url: str, proc: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    with httpx.Client(timeout=1.0) as client:  # one client for every poll: each new one loads the CA bundle
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ConfigurationError(f"{name} exited with code {proc.returncode} during start-up (see {log_path})")
            try:
                if client.get(f"{url}/healthz").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    raise ConfigurationError(f"{name} did not answer {url}/healthz within {STARTUP_TIMEOUT_S:.0f}s (see {log_path})")


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


def _say(message: str) -> None:
    click.echo(f"[up] {message}", err=True)
    logger.info("%s", message)


@click.command()
@click.option(
    "--zoo",
    "zoo_preset",
    type=click.Choice(["tiny", "demo"]),
    default="demo",
    show_default=True,
    help="which zoo preset to serve (built on first run)",
)
@click.option(
    "--bare",
    is_flag=True,
    help="an empty platform: only the demo tenant, its key and the console admin (no registry models, prices, "
    "budget, device or escalation policies)",
)
@click.option("--new-key", is_flag=True, help="issue a new API key for the demo tenant (the old one stays valid)")
def up(zoo_preset: str, bare: bool, new_key: bool) -> None:
    """Run the whole platform on localhost, already connected: cloud API, console and one enrolled edge agent
    (Ctrl-C stops all)."""
    from controlplane.storage.migrate import upgrade
    from edge_agent.settings import load_edge_settings, state_dir
    from shared.artifacts import load_or_create_signing_key, public_path
    from shared.settings import CoreSettings, DatabaseSettings, ServiceSettings
    from shared.zoo.build import build_zoo
    from shared.zoo.presets import get_preset

    started = time.monotonic()
    core, svc = CoreSettings(), ServiceSettings()
    data_dir = core.data_dir.resolve()
    log_path = data_dir / LOG_FILE
    _configure_logging(log_path)
    _say(f"starting (log: {log_path})")
    key = load_or_create_signing_key(core.signing_key_path)
    zoo_root = core.zoo_dir.resolve() / zoo_preset
    if not (zoo_root / "zoo.json").is_file():
        _say(f"building the {zoo_preset} zoo (the first run of demo takes a few minutes)")
    build_zoo(get_preset(zoo_preset), core.zoo_dir, key, step=lambda m: logger.info("zoo: %s", m))
    upgrade(DatabaseSettings().url)

    up_path, secrets_path = data_dir / "up.json", data_dir / SECRETS_FILE
    previous = {**_read_previous(up_path), **_read_previous(secrets_path)}
    env = {
        **os.environ,
        "TIERLINE_DATA_DIR": str(data_dir),
        "TIERLINE_LOG_FORMAT": "json",  # parsed by _relay
        "TIERLINE_CLOUD_ZOO_PRESET": zoo_preset,
        "TIERLINE_EDGE_ZOO_DIR": str(zoo_root),
        "TIERLINE_EDGE_TRUSTED_KEYS": json.dumps([str(public_path(core.signing_key_path).resolve())]),
        "TIERLINE_EDGE_CLOUD_URL": svc.resolved_cloud_url,
    }
    # The demo runs the live quality monitor at a small share (production's default is off).
    env.setdefault("TIERLINE_CLOUD_EDGE_SHADOW_SHARE", DEMO_SHADOW_SHARE)
    # One host: a serving spec may name a model server on loopback (the cloud's own database, Redis and listeners
    # stay refused), and its key file by name in the data dir's upstream-keys/ (docs/registry.md#serving-specs).
    env.setdefault("TIERLINE_CLOUD_UPSTREAM_ALLOW_LOOPBACK", "true")
    env.setdefault("TIERLINE_CLOUD_UPSTREAM_SECRETS_DIR", str(data_dir / "upstream-keys"))
    seeded = seed.Seeded()
    old_key = previous.get("api_key") if not new_key else None
    api_key = seed.seed_tenant(old_key if isinstance(old_key, str) else None, seeded, budget=not bare)
    admin_password = _seed_admin(previous, env)
    # Kept at once: a start-up that fails later must not lose the new admin's password.
    _write_private(secrets_path, json.dumps({"api_key": api_key, "console_admin_password": admin_password}) + "\n")
    edge_settings = load_edge_settings(None)
    edge_home = state_dir(edge_settings).resolve()
    if not bare:
        seed.seed_registry(zoo_root, seeded)
        seed.seed_prices(seeded)

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
    pool = ThreadPoolExecutor(1, thread_name_prefix="calibrate")
    try:
        # Policies are control-plane objects the agent receives at each sync (hot-reloaded): every service starts
        # at once, the missing policies are calibrated meanwhile, and the agent picks up its enrollment live.
        for name in ("cloud", "console", "edge"):
            procs[name] = _start(name, commands[name][0], env)
        calibrated: Future[list[str]] | None = None
        if not bare and not seed.policies_ready(data_dir, zoo_preset):
            calibrated = pool.submit(seed.calibrate_policies, core.zoo_dir.resolve(), zoo_preset, data_dir, _say)
        _wait_healthy("cloud", cloud_url, procs["cloud"], log_path)
        enrolled_now = False
        if not bare:
            before = len(seeded.created)
            seed.enroll_agent(cloud_url, edge_home, seeded)
            enrolled_now = len(seeded.created) > before
        if calibrated is not None:
            for model in calibrated.result():
                seeded.add(f"escalation policy {model}")
        for name in ("console", "edge"):
            _wait_healthy(name, commands[name][1], procs[name], log_path)
        if enrolled_now:
            _wait_enrolled(edge_url, edge_settings.api_key.get_secret_value() if edge_settings.api_key else None)
        ready_s = time.monotonic() - started
        logger.info("all ready in %.1f s; seeded: %s", ready_s, ", ".join(seeded.created) or "nothing new")
        info = {
            "cloud_url": cloud_url,
            "console_url": console_url,
            "edge_url": edge_url,
            "tenant": DEMO_TENANT,
            "api_key": api_key,
            "console_admin": ADMIN_USER,
            "console_admin_password": admin_password,
            "zoo": str(zoo_root),
            "bare": bare,
            "seeded": seeded.created,
            "ready_s": round(ready_s, 1),
            "log": str(log_path),
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
        seeded_line = f"  seeded now: {', '.join(seeded.created)}\n" if seeded.created else ""
        connected = (
            ""
            if bare
            else f"  the edge agent is device {_device_id(edge_home)} of tenant {DEMO_TENANT} (site=local, ring=dev): "
            "what it answers reaches the cloud's ledger at its next sync\n"
        )
        click.echo(
            f"\ntierline is up ({ready_s:.0f} s)\n"
            f"  cloud API  {cloud_url}\n  console    {console_url}  (user {ADMIN_USER}, password "
            f"{admin_password or 'set on an earlier run'})\n  edge agent {edge_url}\n"
            f"  tenant {DEMO_TENANT}, API key {api_key}\n{connected}{seeded_line}\n"
            "  try next:\n"
            f"  {info['curl_edge']}\n  {info['curl_cloud']}\n"
            + ("" if bare else f"  tierline devices list --tenant {DEMO_TENANT}\n")
            + f"\n  (also in {up_path}, mode 0600; logs in {log_path})  Ctrl-C stops everything.\n"
        )
        while all(p.poll() is None for p in procs.values()):
            time.sleep(0.5)
        dead = [n for n, p in procs.items() if p.poll() is not None]
        raise ConfigurationError(f"{', '.join(dead)} exited unexpectedly (see {log_path}); stopping the rest")
    except KeyboardInterrupt:
        click.echo("\n[up] stopping", err=True)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        _stop(procs)


def _wait_enrolled(edge_url: str, api_key: str | None, timeout_s: float = 30.0) -> None:
    """Until the running agent has picked up the enrollment made while it ran (``enrollment_poll_s``)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{edge_url}/v1/agent", headers=headers, timeout=2.0).json().get("enrolled"):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    logger.warning("the edge agent has not picked up its enrollment after %.0f s", timeout_s)


def _device_id(home: Path) -> str:
    from edge_agent.cloud_link import Credentials

    creds = Credentials.load(home)
    return creds.device_id if creds is not None else "?"

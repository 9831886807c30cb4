"""Shared fixtures: a tiny zoo built once per session, databases (SQLite, and PostgreSQL when configured),
and real servers started as subprocesses on free ports."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

# The suite runs several workers, each with its servers, on few cores: OpenMP threads (torch's) that spin while they
# wait for work burn the CPU the other processes need (a tiny zoo build beside two busy cores: 88 s of CPU spinning,
# 41 s waiting passively, the same weights either way). Set before torch loads OpenMP, here and in every process the
# tests start (they copy this environment).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from shared.artifacts import load_or_create_signing_key
from tests.forkserver import start_tierline

if TYPE_CHECKING:
    from shared.zoo.presets import Preset

REPO = Path(__file__).resolve().parent.parent
PG_URL = os.environ.get("TIERLINE_TEST_DATABASE_URL")


# `make test` runs files on several xdist workers (--dist loadfile hands them out in collection order). The
# longest go first, so that no worker is left alone with a long file at the end while the others idle: by the
# seconds each file took in the last run here (pytest's cache), else by folder (end to end, integration, unit).
_FILE_SECONDS = "tierline/file-seconds"
_FOLDER_ORDER = {"e2e": 0, "integration": 1, "unit": 2}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seconds: dict[str, float] = config.cache.get(_FILE_SECONDS, {}) if config.cache is not None else {}

    def key(item: pytest.Item) -> tuple[int, float]:
        return (_FOLDER_ORDER.get(item.path.parent.name, 1), -seconds.get(item.nodeid.split("::")[0], 0.0))

    items.sort(key=key)  # stable: a file's tests stay together and in their order


_seconds: dict[str, float] = {}  # this run's seconds per file


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Seconds per file (setup, call and teardown), gathered where the reports arrive: the xdist controller, or
    the one process without xdist."""
    path = report.nodeid.split("::")[0]
    _seconds[path] = _seconds.get(path, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    cache = session.config.cache
    if _seconds and cache is not None and not hasattr(session.config, "workerinput"):
        known: dict[str, float] = cache.get(_FILE_SECONDS, {})
        cache.set(_FILE_SECONDS, known | {path: round(s, 1) for path, s in _seconds.items()})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def session_data_dir(request: pytest.FixtureRequest) -> Path:
    """Kept in pytest's cache dir: the zoo build is fingerprinted by preset and code, so reuse is safe."""
    return Path(request.config.cache.mkdir("tierline-data"))


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """``path`` held as an exclusive lock: the suite's xdist workers share pytest's cache dir."""
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _built_zoo(session_data_dir: Path, preset: Preset) -> Path:
    """``preset`` built (or found, by its fingerprint) with the session's signing key: one worker builds it while
    the others wait; the presets build side by side (each in a folder of its own)."""
    from shared.zoo.build import build_zoo

    with _locked(session_data_dir / ".keys.lock"):
        key = load_or_create_signing_key(session_data_dir / "keys" / "artifact-signing.ed25519")
    with _locked(session_data_dir / f".build-{preset.name}.lock"):
        build_zoo(preset, session_data_dir / "zoo", key)
    return session_data_dir / "zoo" / preset.name


@pytest.fixture(scope="session")
def tiny_zoo(session_data_dir: Path) -> Path:
    """The tiny preset, built once per test session with the session's signing key."""
    from shared.zoo.presets import TINY

    return _built_zoo(session_data_dir, TINY)


@pytest.fixture(scope="session")
def demo_zoo(session_data_dir: Path) -> Path:
    """The demo preset (``make demo``'s zoo), built beside the tiny one with the session's signing key: minutes on
    the first use, then cached in pytest's cache dir until the zoo's code or preset changes (its fingerprint)."""
    from shared.zoo.presets import DEMO

    return _built_zoo(session_data_dir, DEMO)


@pytest.fixture(scope="session")
def tiny_zoo_public_key(tiny_zoo: Path, session_data_dir: Path) -> Path:
    return session_data_dir / "keys" / "artifact-signing.ed25519.pub"


def _pg_schema_url(base: str, schema: str) -> str:
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}options=-csearch_path%3D{schema}"


@contextmanager
def _postgres_schema() -> Iterator[str]:
    """A fresh schema per test, dropped afterwards, so tests never see each other's rows."""
    from sqlalchemy import text

    from controlplane.storage.database import create_db

    assert PG_URL
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_db(PG_URL)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield _pg_schema_url(PG_URL, schema)
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


DB_BACKENDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]


@pytest.fixture(params=DB_BACKENDS)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database: a SQLite file, and PostgreSQL when TIERLINE_TEST_DATABASE_URL is set."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'test.db'}"
        return
    if not PG_URL:
        pytest.skip("PostgreSQL not configured: set TIERLINE_TEST_DATABASE_URL (CI sets it when :5432 answers)")
    with _postgres_schema() as url:
        yield url


@pytest.fixture
def migrated_db(db_url: str) -> str:
    from controlplane.storage.migrate import upgrade

    upgrade(db_url)
    return db_url


def engine_processes(server_pid: int) -> list[int]:
    """The engine processes of a cloud (or ``engine serve``) running as ``server_pid``, oldest first: the children of
    its multiprocessing fork server, which starts each engine as a fork of itself (``cloud.engine.process``)."""
    procs: dict[int, tuple[int, int, bytes]] = {}  # pid -> (parent, start time, command line)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state ppid ... starttime is field 22
        if fields[0] != "Z":
            procs[int(entry.name)] = (int(fields[1]), int(fields[19]), cmdline)
    servers = {pid for pid, (parent, _, cmd) in procs.items() if parent == server_pid and b"forkserver" in cmd}
    engines = [(started, pid) for pid, (parent, started, _) in procs.items() if parent in servers]
    return [pid for _, pid in sorted(engines)]


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (``/proc/<pid>/task/<tid>/children``): a server and the engines it forked."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        for children in Path(f"/proc/{p}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                todo += [int(c) for c in children.read_text().split()]
    return found


def signal_tree(proc: subprocess.Popen[bytes]) -> Callable[[signal.Signals], None]:
    """A ``Pacer``'s ``send`` for ``proc`` and the descendants it has now; ProcessLookupError once ``proc`` ended."""
    tree = process_tree(proc.pid)

    def send(sig: signal.Signals) -> None:
        if proc.poll() is not None:
            raise ProcessLookupError
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    return send


class Pacer:
    """A process that makes tokens, slowed down by signals: ``send(SIGSTOP)`` most of the time, ``send(SIGCONT)`` for
    ``run_s`` in every ``stop_s``. A fast engine would otherwise write a whole stream into its socket before a client
    on a loaded host has read its first events, and a test that must act in the middle of a stream (kill the server,
    stop the engine) would act after its end. ``finish(sig)`` ends the pacing and leaves the process in ``sig``'s
    state (SIGSTOP: it cannot move on before the test's next step); leaving the ``with`` block finishes with SIGCONT.
    ``send`` raises ProcessLookupError once the process is gone, which ends the pacing."""

    def __init__(self, send: Callable[[signal.Signals], None], run_s: float = 0.002, stop_s: float = 0.03) -> None:
        self._send, self._run_s, self._stop_s = send, run_s, stop_s
        self._done, self._lock = threading.Event(), threading.Lock()
        self._thread = threading.Thread(target=self._pace, daemon=True)

    def _signal(self, sig: signal.Signals) -> bool:
        with self._lock:  # never a SIGCONT of the pacer after finish's SIGSTOP
            if self._done.is_set():
                return False
            self._send(sig)
            return True

    def _pace(self) -> None:
        while True:
            for sig, pause in ((signal.SIGSTOP, self._stop_s), (signal.SIGCONT, self._run_s)):
                try:
                    if not self._signal(sig):
                        return
                except ProcessLookupError:
                    return
                self._done.wait(pause)

    def __enter__(self) -> Pacer:
        self._thread.start()
        return self

    def finish(self, sig: signal.Signals = signal.SIGCONT) -> None:
        with self._lock:
            if self._done.is_set():
                return
            self._done.set()
            with contextlib.suppress(ProcessLookupError):
                self._send(sig)
        self._thread.join()

    def __exit__(self, *exc: object) -> None:
        self.finish(signal.SIGCONT)


def seed_data_dir(dest: Path, tiny_zoo: Path, session_data_dir: Path) -> Path:
    """A data dir holding the session's tiny zoo and the key that signed it (servers start on it as they are)."""
    shutil.copytree(session_data_dir / "keys", dest / "keys")
    shutil.copytree(tiny_zoo, dest / "zoo" / "tiny")
    return dest


def migrated_sqlite(data_dir: Path) -> str:
    """The URL of a SQLite file in ``data_dir``, migrated to head."""
    from controlplane.storage.migrate import upgrade

    url = f"sqlite:///{data_dir / 'tierline.db'}"
    upgrade(url)
    return url


def base_env(data_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERLINE_")}
    env.update({"TIERLINE_DATA_DIR": str(data_dir), "TIERLINE_LOG_LEVEL": "WARNING", **extra})
    return env


@contextmanager
def server_process(
    args: list[str],
    env: dict[str, str],
    port: int,
    *,
    ready_path: str = "/healthz",
    timeout: float = 60.0,
    stop_timeout: float = 20.0,
    log: Path | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """Start ``tierline <args>`` on ``port``, wait until ``ready_path`` answers 200, yield the process, then SIGTERM
    it (unless the test stopped it already).

    The server's output goes to ``log`` (or a temporary file), never to an unread pipe: a server that logs more
    than a pipe holds would block on its next write and hang the test instead of failing it.
    """
    with log.open("w+b") if log is not None else tempfile.TemporaryFile() as out:
        proc = start_tierline([*args, "--host", "127.0.0.1", "--port", str(port)], env, out)

        def output() -> str:
            out.flush()
            out.seek(0)
            return out.read()[-20000:].decode(errors="replace")

        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + timeout
            with httpx.Client(timeout=1) as poll:  # one client for every poll: each new one loads the CA bundle
                while True:
                    if proc.poll() is not None:
                        raise AssertionError(f"server exited with {proc.returncode}:\n{output()}")
                    try:
                        if poll.get(f"{url}{ready_path}").status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    if time.monotonic() > deadline:
                        raise AssertionError(f"server on {url} did not become ready:\n{output()}")
                    time.sleep(0.1)
            yield proc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=stop_timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


@contextmanager
def run_server(args: list[str], env: dict[str, str], port: int, timeout: float = 60.0) -> Iterator[str]:
    """``server_process`` until /healthz answers; yields the base URL."""
    with server_process(args, env, port, timeout=timeout):
        yield f"http://127.0.0.1:{port}"

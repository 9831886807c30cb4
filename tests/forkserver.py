"""``tierline`` processes for tests, forked from a server process that imported tierline once.

A fresh ``python -m tierline.cli`` spends most of its CPU importing before it does what a test asked: ~0.8 s for a
CLI command that then works for milliseconds (the suite runs ~300 of them to set up tenants, keys, prices and
devices), 1.5-2.5 s for a cloud gateway or console, on a 2-core host where the suite is CPU-bound. Here each such
process is forked from one that imported the CLI, its commands and the servers' apps (as gunicorn's ``--preload``
or multiprocessing's fork server do): it still is a process of its own running ``tierline.cli.main()`` with the
test's arguments, environment, working directory and standard streams, exits with the command's status, serves on
its own socket and is signalled like any server. Settings are read when a command runs (``shared.settings``), never
at import, so nothing the fork server imported carries another test's environment.

- ``run_tierline(*args, env=...)`` runs a command to its end: ``subprocess.run(..., capture_output=True, text=True)``.
- ``start_tierline(args, env, stdout)`` starts a server and returns a ``subprocess.Popen`` of it: the server is
  forked twice and handed to the calling process (Linux's child subreaper), so it is that process's child and
  ``poll``/``wait``/``send_signal`` behave as for any subprocess.

The fork server runs no Python thread beside its own (no lock held by another thread is copied into a child; it
checks that the imports started none, else callers start a fresh interpreter), one per pytest process, started on
first use and stopped at exit. A process whose environment changes how an interpreter starts (PYTHONPATH) starts
fresh, as does every one under ``TIERLINE_TEST_FRESH_PROCESSES=1``. The CLI's own tests (tests/unit/test_cli.py)
and the end-to-end runs of ``tierline up`` always start fresh interpreters.
Run as ``python -m tests.forkserver FD``: requests and answers are JSON messages on the SOCK_SEQPACKET socket FD,
with the child's stdin, stdout and stderr passed as file descriptors.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parent.parent
FRESH = os.environ.get("TIERLINE_TEST_FRESH_PROCESSES") == "1"

# What the server imports before it forks: the entry point, the commands tests run, the modules those import when
# they run, and the servers' apps.
PRELOAD = (
    "tierline.cli",
    "controlplane.tenancy.cli",
    "controlplane.fleet.cli",
    "controlplane.registry.cli",
    "controlplane.billing.cli",
    "controlplane.policies.cli",
    "controlplane.storage.cli",
    "controlplane.storage.session",
    "controlplane.storage.tables",
    "controlplane.storage.audit",
    "controlplane.storage.migrate",
    "controlplane.tenancy.service",
    "controlplane.accounts.users",
    "controlplane.billing",
    "controlplane.billing.invoicing",
    "controlplane.registry",
    "controlplane.registry.store",
    "controlplane.registry.artifacts",
    "controlplane.rollouts.service",
    "controlplane.policies",
    "controlplane.fleet.devices",
    "sqlalchemy.dialects.sqlite",
    "sqlalchemy.dialects.postgresql",
    "psycopg",
    "shared.http",
    "cloud.cli",
    "cloud.app",
    "console.cli",
    "console.app",
    "edge_agent.cli",
    "edge_agent.app",
)
_STARTUP_PREFIXES = ("PYTHON", "LD_", "OMP_", "OPENBLAS_")  # read as an interpreter or a library it loaded starts
_PR_SET_CHILD_SUBREAPER = 36
_MAX_MESSAGE = 1 << 20


def _become(request: Mapping[str, Any], fds: Sequence[int], sock: socket.socket) -> None:
    """In a forked child: become the command's process and run it; exits with its status, never returns."""
    code = 1
    try:
        sock.close()
        if request.get("new_session"):
            os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        # Python's text streams over the new descriptors, as a fresh interpreter opens them.
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own streams, closed at exit
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        import tierline.cli

        # As `python -m tierline.cli` sets them: multiprocessing's spawned children import __main__ by this name.
        sys.modules["__main__"] = tierline.cli
        sys.argv = [tierline.cli.__file__, *request["args"]]
        try:
            tierline.cli.main()
            code = 0
        except SystemExit as exc:
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                code = exc.code
            else:  # as the interpreter does: the message on stderr, status 1
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:  # uncaught: the traceback on stderr, status 1, as the interpreter does
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _send(sock: socket.socket, message: Mapping[str, Any]) -> None:
    sock.send(json.dumps(message).encode())


def serve(fd: int) -> None:
    """The fork server: import, then per request fork the command's process and answer its pid (and, for a command
    run to its end, its status)."""
    sock = socket.socket(fileno=fd)
    for module in PRELOAD:
        importlib.import_module(module)
    # No Python thread may run beside the forking one. Native pools are safe: OpenBLAS (numpy's, one thread per
    # core, started at import) stops and restarts its threads around fork() itself (pthread_atfork).
    threads = threading.active_count()
    _send(sock, {"ready": threads == 1, "threads": threads})
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 3)
        except ConnectionResetError:
            return
        if not data:
            return
        request = json.loads(data)
        if request["mode"] == "run":
            pid = os.fork()
            if pid == 0:
                _become(request, fds, sock)
            for opened in fds:
                os.close(opened)
            _send(sock, {"pid": pid})
            _, status = os.waitpid(pid, 0)
            _send(sock, {"returncode": os.waitstatus_to_exitcode(status)})
        else:  # "start": forked twice, so that the server is handed to the caller (a child subreaper)
            read, write = os.pipe()
            middle = os.fork()
            if middle == 0:
                os.close(read)
                server = os.fork()
                if server == 0:
                    os.close(write)
                    _become(request, fds, sock)
                os.write(write, str(server).encode())
                os._exit(0)
            os.close(write)
            for opened in fds:
                os.close(opened)
            with os.fdopen(read) as pipe:
                server = int(pipe.read())
            os.waitpid(middle, 0)
            _send(sock, {"pid": server})


def tierline_cmd(*args: str) -> list[str]:
    """The command line of a fresh ``tierline`` process."""
    return [sys.executable, "-m", "tierline.cli", *args]


def _startup(env: Mapping[str, str]) -> dict[str, str]:
    """The variables read as an interpreter starts (PYTHONPATH, the loader's) or as the fork server's imports load
    a native library (numpy's OpenBLAS): a process whose own differ starts fresh."""
    return {k: v for k, v in env.items() if k.startswith(_STARTUP_PREFIXES)}


class _ForkServer:
    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIERLINE_")}
        self.startup = _startup(env)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.forkserver", str(theirs.fileno())],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            pass_fds=(theirs.fileno(),),
            env=env,
        )
        theirs.close()
        hello = self.answer()
        self.usable = bool(hello["ready"])
        atexit.register(self.close)

    def answer(self) -> dict[str, Any]:
        data = self.sock.recv(_MAX_MESSAGE)
        if not data:
            raise RuntimeError(f"the tierline fork server exited with {self.proc.wait()}")
        answer: dict[str, Any] = json.loads(data)
        return answer

    def request(self, request: Mapping[str, Any], fds: Sequence[int]) -> int:
        socket.send_fds(self.sock, [json.dumps(request).encode()], list(fds))
        return int(self.answer()["pid"])

    def close(self) -> None:
        self.sock.close()
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


_server: _ForkServer | None = None
_lock = threading.Lock()


def _fork_server(env: Mapping[str, str]) -> _ForkServer | None:
    """This process's fork server (started on first use), or None where a process for ``env`` starts fresh: when
    asked, off Linux, or when ``env`` changes what an interpreter does as it starts (a test's PYTHONPATH)."""
    global _server
    if FRESH or not sys.platform.startswith("linux"):
        return None
    if _server is None or _server.proc.poll() is not None:
        _server = _ForkServer()
    return _server if _server.usable and _server.startup == _startup(env) else None


def _request(args: Sequence[str], env: Mapping[str, str], cwd: str | os.PathLike[str], mode: str) -> dict[str, Any]:
    return {"mode": mode, "args": list(args), "env": dict(env), "cwd": str(cwd)}


def _text(stream: IO[bytes]) -> str:
    stream.seek(0)  # decoded with universal newlines, as subprocess.run(text=True) does
    return stream.read().decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")


def run_tierline(
    *args: str,
    env: Mapping[str, str],
    cwd: str | os.PathLike[str] = REPO,
    input: str | None = None,
    timeout: float | None = None,
    check: bool = False,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(["tierline", *args], env=env, cwd=cwd, input=input, capture_output=True, text=True,
    timeout=timeout, check=check)``, run in a process forked from the fork server."""
    with _lock:
        server = _fork_server(env)
        if server is None:
            return subprocess.run(
                tierline_cmd(*args),
                env=env,
                cwd=cwd,
                input=input,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=check,
            )
        with tempfile.TemporaryFile() as stdin, tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
            stdin.write((input or "").encode())
            stdin.flush()
            stdin.seek(0)
            pid = server.request(_request(args, env, cwd, "run"), [stdin.fileno(), stdout.fileno(), stderr.fileno()])
            killed: list[bool] = []

            def kill() -> None:
                killed.append(True)
                os.kill(pid, signal.SIGKILL)

            timer = threading.Timer(timeout, kill) if timeout is not None else None
            if timer is not None:
                timer.start()
            try:
                returncode = int(server.answer()["returncode"])
            finally:
                if timer is not None:
                    timer.cancel()
            command = ["tierline", *args]
            if killed:
                raise subprocess.TimeoutExpired(command, timeout or 0.0, _text(stdout), _text(stderr))
            result = subprocess.CompletedProcess(command, returncode, _text(stdout), _text(stderr))
    if check:
        result.check_returncode()
    return result


class _Handed(subprocess.Popen[bytes]):
    """A ``Popen`` of a process this one did not start but was handed as its child: ``poll``, ``wait``,
    ``send_signal``, ``terminate`` and ``kill`` work as for any subprocess (no pipes)."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.args = args
        self.stdin = self.stdout = self.stderr = None
        self.pid = pid
        self.returncode = None
        self.text_mode = False
        self.encoding = self.errors = None
        self.pipesize = -1
        self._child_created = True
        self._waitpid_lock = threading.Lock()
        self._sigint_wait_secs = 0.25
        self._communication_started = False
        self._input = None
        self._closed_child_pipe_fds = True


def start_tierline(
    args: Sequence[str],
    env: Mapping[str, str],
    stdout: IO[bytes],
    cwd: str | os.PathLike[str] = REPO,
    *,
    start_new_session: bool = False,
) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(["tierline", *args], env=env, cwd=cwd, stdout=stdout, stderr=subprocess.STDOUT,
    start_new_session=start_new_session)``, the process forked from the fork server and handed to this one as its
    child."""
    with _lock:
        server = _fork_server(env)
        if server is None:
            return subprocess.Popen(
                tierline_cmd(*args),
                env=env,
                cwd=cwd,
                stdout=stdout,
                stderr=subprocess.STDOUT,
                start_new_session=start_new_session,
            )
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
        try:
            with open(os.devnull, "rb") as stdin:
                request = {**_request(args, env, cwd, "start"), "new_session": start_new_session}
                pid = server.request(request, [stdin.fileno(), stdout.fileno(), stdout.fileno()])
        finally:  # only the server just started is handed here; later orphans go where they always went
            libc.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        return _Handed(pid, ["tierline", *args])


if __name__ == "__main__":
    serve(int(sys.argv[1]))

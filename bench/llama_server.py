"""llama.cpp's own C++ server, ``llama-server``, beside ``tierline engine serve``: both over HTTP, the peer at its best.

``make llama-server`` compiles it with cmake from the vendored llama.cpp of the pinned llama-cpp-python sdist (the
sources ``tierline[peers]`` is built from), with the same flags, once per CPU into
``~/.cache/tierline-wheels/llama-server-<machine>-<cpu flags hash>/`` (``$TIERLINE_LLAMA_SERVER`` names another
binary). :func:`llama_server_command` is the command line the bench runs and reports: one slot per concurrent
request (``--parallel``, continuous batching, a KV stream per slot as the in-process peer's), the prompt caches
off (each round's requests are prefilled anew, as the engine's are under a fresh ``cache_salt``), the bench's
thread count for decoding and prefill. :func:`run_http_level` sends token-id prompts, greedy and ``ignore_eos``,
all of a level at once, and counts tokens from each answer's completion count.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import platform
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from bench.common import served
from shared.errors import ConfigurationError

LLAMA_SERVER_ENV = "TIERLINE_LLAMA_SERVER"
BUILD_HINT = "make llama-server (cmake, from the vendored llama.cpp of llama-cpp-python's sdist; ~6 min on 2 cores)"
START_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 900.0


def cpu_flags_hash() -> str:
    """The Makefile's ``grep -m1 '^flags' /proc/cpuinfo | md5sum | cut -c1-8``: builds are per instruction set."""
    line = ""
    with contextlib.suppress(OSError):
        line = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    return hashlib.md5(f"{line}\n".encode() if line else b"").hexdigest()[:8]


def llama_server_binary() -> Path:
    """``$TIERLINE_LLAMA_SERVER``, else where ``make llama-server`` installs it for this CPU."""
    if env := os.environ.get(LLAMA_SERVER_ENV):
        return Path(env)
    cache = Path.home() / ".cache" / "tierline-wheels" / f"llama-server-{platform.machine()}-{cpu_flags_hash()}"
    return cache / "llama-server"


def missing_reason() -> str | None:
    """Why llama-server cannot run here, or None when it can."""
    path = llama_server_binary()
    if not (path.is_file() and os.access(path, os.X_OK)):
        return f"llama-server is not built at {path}: {BUILD_HINT}"
    return None


def llama_server_version(binary: Path) -> str:
    """``llama-server --version``'s line naming the build (``version: N (commit)``)."""
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60, check=False)
    lines = [ln for ln in (done.stdout + done.stderr).splitlines() if ln.startswith("version")]
    return lines[0] if lines else "unknown"


def llama_server_command(binary: Path, model: Path, port: int, slots: int, max_len: int, threads: int) -> list[str]:
    """``llama-server`` serving ``model`` with ``slots`` slots of ``max_len`` tokens each."""
    return [
        str(binary),
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--parallel",
        str(slots),
        "--cont-batching",
        "--no-kv-unified",
        "--ctx-size",
        str(slots * max_len),
        "--batch-size",
        "2048",
        "--threads",
        str(threads),
        "--threads-batch",
        str(threads),
        "--cache-ram",
        "0",
        "--no-webui",
    ]


@contextlib.contextmanager
def llama_server(cmd: list[str], port: int, log: Path | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """``cmd`` (a :func:`llama_server_command`) until ``/health`` answers 200; SIGTERM after. Its output goes to
    ``log`` (else a temporary file), whose tail a failed start quotes."""
    ready = f"http://127.0.0.1:{port}/health"
    try:
        with served(cmd, None, ready, f"llama-server on port {port}", log=log, start_timeout_s=START_TIMEOUT_S) as proc:
            yield proc
    except RuntimeError as exc:
        raise ConfigurationError(str(exc)) from exc


def _request(kind: str, prompt: list[int], num_tokens: int, model: str, salt: str) -> tuple[str, dict[str, Any]]:
    """The path and body of one greedy completion of ``num_tokens`` tokens after the token ids ``prompt``."""
    if kind == "llama-server":  # its own completion endpoint: the ids it generated come back too
        body = {"prompt": prompt, "n_predict": num_tokens, "temperature": 0.0, "top_k": 1, "ignore_eos": True}
        return "/completion", body | {"cache_prompt": False, "return_tokens": True}
    body = {"model": model, "prompt": prompt, "max_tokens": num_tokens, "temperature": 0.0, "ignore_eos": True}
    return "/v1/completions", body | {"cache_salt": salt}


def _answer(kind: str, data: dict[str, Any]) -> tuple[int, str]:
    """(completion tokens, text) of an answer."""
    if kind == "llama-server":
        return int(data["tokens_predicted"]), str(data["content"])
    return int(data["usage"]["completion_tokens"]), str(data["choices"][0]["text"])


async def _level(
    base_url: str, kind: str, work: list[tuple[list[int], int]], concurrency: int, model: str, salt: str
) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        gate = asyncio.Semaphore(concurrency)

        async def one(prompt: list[int], n: int) -> tuple[int, str]:
            path, body = _request(kind, prompt, n, model, salt)
            async with gate:
                resp = await client.post(path, json=body)
            if resp.status_code != 200:
                raise RuntimeError(f"{kind} {path}: HTTP {resp.status_code}: {resp.text[:500]}")
            return _answer(kind, resp.json())

        started = time.perf_counter()
        answers = await asyncio.gather(*(one(p, n) for p, n in work))
        seconds = time.perf_counter() - started
    tokens = sum(n for n, _ in answers)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "outputs": [t for _, t in answers]}


def run_http_level(
    base_url: str, kind: str, work: list[tuple[list[int], int]], concurrency: int, model: str = "", salt: str = "bench"
) -> dict[str, Any]:
    """``work`` (token-id prompt, new tokens) sent to ``kind`` ("llama-server" or "tierline") at ``base_url``, at
    most ``concurrency`` in flight (1: one after another); tokens/s from the answers' completion counts over the
    wall time of the whole level, and each answer's text."""
    return asyncio.run(_level(base_url, kind, work, concurrency, model, salt))

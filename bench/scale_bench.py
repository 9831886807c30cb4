"""``bench scale``: two gateways on PostgreSQL + Redis behave as one, and what a gateway costs beside LiteLLM's.

Real processes on 127.0.0.1: one ``tierline engine serve`` model server (the zoo's ``lm-cloud``), two
``tierline cloud serve`` gateways in front of it (an ``openai`` backend; separate data dirs sharing only the key
files; one PostgreSQL schema made for the run and dropped after; one Redis), and a tiny round-robin TCP front in a
process of the bench's (each new client connection goes to the next gateway that accepts it). The tenant has a
rate limit (high enough never to refuse), a monthly budget and a price, so limits, budget reservations and
exactly-once metering are all on the hot path.

Streamed chat completions (greedy, ``ignore_eos``) from ``concurrency`` clients:

- ``direct``: the clients on the model server itself (the baseline of every overhead);
- ``one_gateway`` / ``two_gateways``: through the front to gateway A alone, then to A and B: requests/s,
  latency and TTFT p50/p99, overhead over ``direct``, gateway CPU-seconds per 1,000 requests;
- ``kill``: ``duration`` seconds of load through the front to A and B; after a third of it gateway A is
  SIGKILLed. Reported: requests failed (and how many of those had started before the kill: only requests on
  A's connections may fail), records lost (served requests without a usage record) and unaccounted (records of
  no request a client sent: a duplicate; a prompt-only ``interrupted`` record counts as a failed request's, up to
  one per request cut before its response's headers, whose id its client never saw), the budget's spend against
  the sum of the records' costs (drift) and what A still held reserved when it died (released by a survivor's
  sweeper when the lease ends), and the survivor's requests/s from 5 s after the kill to the end of the load
  (requests that ended in that window) against B's alone under the same load over the same window, measured
  right before (``one_gateway_same_window``).

``--vs litellm`` adds the LiteLLM proxy (no-database mode: its spend tracking needs Prisma engine binaries
that cannot be downloaded here; ``--num_workers 2`` with ``--run_gunicorn``, a master key) in front of the same
model server, and runs ``direct``, ``tierline`` (one gateway) and ``litellm`` at 1, 8 and 64 concurrent streams:
overhead p50/p99 over ``direct``, requests/s, gateway CPU-seconds per 1,000 requests (the proxy's process tree,
from /proc) and spend records written per request served.

``--upstream paced`` puts ``bench.paced_upstream`` in the model server's place: it streams at a set pace (first
token after ``ttft_ms``, then one every ``token_ms``) and spends almost no CPU, as a model server on a GPU host of
its own would. Over the zoo's LM the model server takes the two cores the gateways, the databases and the
clients share, so a gateway's overhead there is mostly the CPU it takes from the model server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.common import free_port, served, tierline_server, tree_cpu_seconds

CLI = [sys.executable, "-m", "tierline.cli"]
MODEL = "lm-cloud"
_EMPTY = re.compile(r'"content":\s*(""|null)')
PROMPTS = ("def parse(line):\n", "import os\n\n\nclass ", "    for key, value in ", "# Copyright", "return ")
REQUEST_TIMEOUT_S = 20.0
SETTLE_S = 5.0  # the survivor's rate is taken from this long after the kill (the target: within 5 s)
LITELLM_KEY = "sk-tierline-bench"  # the throwaway master key of a proxy living one run


# --- the round-robin front ------------------------------------------------------------------------------------


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def _front(port: int, backends: list[int]) -> None:
    turn = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal turn
        for _ in range(len(backends)):
            target = backends[turn % len(backends)]
            turn += 1
            try:
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target)
            except OSError:
                continue  # a dead gateway: the next one
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
            return
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


def _front_main(port: int, backends: list[int]) -> None:
    asyncio.run(_front(port, backends))


@contextlib.contextmanager
def round_robin_front(backends: list[int]) -> Iterator[str]:
    """A TCP front on a free port relaying each new connection to the next of ``backends`` that accepts it."""
    port = free_port()
    proc = multiprocessing.get_context("spawn").Process(target=_front_main, args=(port, backends), daemon=True)
    proc.start()
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if time.monotonic() > deadline or not proc.is_alive():
                raise RuntimeError("the round-robin front did not start")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.join(5)


# --- load ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Outcome:
    started: float
    ended: float
    ttft: float | None
    ok: bool
    usage_id: str | None
    events: int = 0  # content events received: the same work on every path (a proxy dropping ignore_eos would not)
    error: str | None = None  # why it failed: "HTTP 503", the error event's message, or the exception's name


async def _stream(http: httpx.AsyncClient, i: int, max_tokens: int) -> Outcome:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    started = time.monotonic()
    first: float | None = None
    ok = False
    usage_id: str | None = None
    events = 0
    error: str | None = None
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            usage_id = response.headers.get("x-tierline-usage-id")
            if response.status_code != 200:
                said = (await response.aread())[:200].decode(errors="replace")
                error = f"HTTP {response.status_code}: {said}"
                return Outcome(started, time.monotonic(), None, False, usage_id, error=error)
            async for line in response.aiter_lines():
                if '"content":' in line and not _EMPTY.search(line):
                    events += 1
                    if first is None:
                        first = time.monotonic() - started
                if line == "data: [DONE]":
                    ok = True
                elif line.startswith('data: {"error"'):
                    error = line[6:206]
                    break
    except httpx.HTTPError as exc:
        ok, error = False, f"{type(exc).__name__}: {exc}"[:200]
    if not ok and error is None:
        error = "the stream ended without [DONE]"
    return Outcome(started, time.monotonic(), first, ok, usage_id, events, error)


async def _load(
    url: str,
    key: str | None,
    requests: int | None,
    concurrency: int,
    max_tokens: int,
    *,
    duration: float | None = None,
    at: tuple[float, Callable[[], None]] | None = None,
    cpu_pids: tuple[int, ...] = (),
) -> tuple[list[Outcome], float, float, list[str], float]:
    """``requests`` streams (or as many as ``duration`` seconds hold) from ``concurrency`` clients; ``at``: call
    a function that many seconds in. Returns the outcomes, the start, the elapsed time, the warm-up's usage
    ids and the CPU seconds ``cpu_pids`` (and their descendants) used in the timed part."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120, limits=limits) as http:
        # Warm connections; counted among the outcomes' usage ids (they are billed too) but not in the timings.
        warm = await asyncio.gather(*(_stream(http, i, 2) for i in range(min(concurrency, 8))))
        outcomes: list[Outcome] = []
        counter = iter(range(10**9))
        cpu0 = sum(_tree_cpu(p) for p in cpu_pids)
        began = time.monotonic()

        async def client() -> None:
            for i in counter:
                if requests is not None and i >= requests:
                    return
                if duration is not None and time.monotonic() - began > duration:
                    return
                outcomes.append(await _stream(http, i, max_tokens))

        async def trigger() -> None:
            if at is not None:
                await asyncio.sleep(at[0])
                at[1]()

        await asyncio.gather(trigger(), *(client() for _ in range(concurrency)))
    elapsed = time.monotonic() - began
    cpu = sum(_tree_cpu(p) for p in cpu_pids) - cpu0
    return outcomes, began, elapsed, [o.usage_id for o in warm if o.usage_id], cpu


def _ms(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1000, 2) if values else None


def _summary(outcomes: list[Outcome], elapsed: float) -> dict[str, Any]:
    good = [o for o in outcomes if o.ok]
    latencies = [o.ended - o.started for o in good]
    ttfts = [o.ttft for o in good if o.ttft is not None]
    return {
        "requests": len(outcomes),
        "errors": len(outcomes) - len(good),
        "requests_per_s": round(len(good) / elapsed, 2) if elapsed else None,
        "p50_ms": _ms(latencies, 50),
        "p99_ms": _ms(latencies, 99),
        "ttft_p50_ms": _ms(ttfts, 50),
        "ttft_p99_ms": _ms(ttfts, 99),
        "content_events_p50": float(np.percentile([o.events for o in good], 50)) if good else None,
        # the failures by reason (the first 200 characters of the status and body, error event or exception)
        "error_reasons": dict(Counter(o.error or "?" for o in outcomes if not o.ok)),
    }


def _overhead(path: dict[str, Any], direct: dict[str, Any]) -> dict[str, float | None]:
    return {
        q: round(path[q] - direct[q], 2) if path[q] is not None and direct[q] is not None else None
        for q in ("p50_ms", "p99_ms", "ttft_p50_ms")
    }


# --- CPU of a process tree, from /proc ------------------------------------------------------------------------


def _tree_cpu(pid: int) -> float:
    """CPU seconds of ``pid`` and every descendant, live or reaped (``bench.common.tree_cpu_seconds``)."""
    return tree_cpu_seconds(pid)


def _measured(
    url: str, key: str | None, pids: list[int], requests: int, concurrency: int, max_tokens: int
) -> dict[str, Any]:
    outcomes, _, elapsed, warm, cpu = asyncio.run(
        _load(url, key, requests, concurrency, max_tokens, cpu_pids=tuple(pids))
    )
    result = _summary(outcomes, elapsed)
    served = requests - result["errors"]
    if pids:
        result["gateway_cpu_s_per_1000"] = round(cpu / served * 1000, 2) if served else None
    result["_usage_ids"] = warm + [o.usage_id for o in outcomes if o.ok and o.usage_id]
    return result


# --- the platform -----------------------------------------------------------------------------------------------


@dataclass
class _Platform:
    env: dict[str, str]
    envs: list[dict[str, str]]
    db_url: str
    key: str
    budget: Decimal
    upstream: str  # the model server's URL


def _setup(tmp: Path, zoo: Path, data_dir: Path, db_url: str, redis_url: str, upstream: str) -> _Platform:
    from sqlmodel import Session

    from cloud.gateway.ids import ID_SECRET_FILE, load_or_create_id_secret
    from controlplane.storage.database import create_db
    from controlplane.storage.migrate import upgrade
    from controlplane.tenancy.service import create_api_key, create_tenant

    keys = tmp / "keys"  # the key files replicas share
    shutil.copytree(data_dir / "keys", keys)
    load_or_create_id_secret(keys / ID_SECRET_FILE)
    upgrade(db_url)
    budget = Decimal("1000000")
    engine = create_db(db_url)
    with Session(engine) as s:
        tenant = create_tenant(s, "bench", budget=budget)
        s.flush()
        issued = create_api_key(s, tenant)
        issued.record.requests_per_minute = 1_000_000  # counted in Redis on every request; never refuses
        issued.record.tokens_per_minute = 1_000_000_000
        s.commit()
        secret = issued.secret
    engine.dispose()
    backends = tmp / "backends.json"
    spec: dict[str, Any] = {"type": "openai", "upstream_model": MODEL, "tokenizer": str(zoo / "artifacts" / MODEL)}
    spec |= {"max_concurrency": 256, "endpoints": [upstream]}
    backends.write_text(json.dumps({"models": {MODEL: spec}}))
    base = {k: v for k, v in os.environ.items() if not k.startswith("TIERLINE_")}
    base |= {
        "TIERLINE_DATABASE_URL": db_url,
        "TIERLINE_REDIS_URL": redis_url,
        "TIERLINE_LOG_LEVEL": "WARNING",
        "TIERLINE_ARTIFACT_STORE": str(tmp / "artifacts"),
        "TIERLINE_CLOUD_ZOO_PRESET": "none",
        "TIERLINE_CLOUD_BACKENDS": str(backends),
        "TIERLINE_CLOUD_SPECULATION": "off",
        "TIERLINE_CLOUD_DECODE_BURST_MS": "0",  # an event a token from the model server: the relays' worst case
        # A killed gateway's reservations are released when their lease (deadline + margin) ends: short here.
        "TIERLINE_CLOUD_REQUEST_TIMEOUT_S": str(REQUEST_TIMEOUT_S),
        "TIERLINE_CLOUD_BUDGET_LEASE_MARGIN_S": "5",
        "TIERLINE_CLOUD_BUDGET_SWEEP_INTERVAL_S": "2",
    }
    envs = []
    for name in ("a", "b"):
        (tmp / name).mkdir()
        shutil.copytree(keys, tmp / name / "keys")
        envs.append({**base, "TIERLINE_DATA_DIR": str(tmp / name)})
    env = {**base, "TIERLINE_DATA_DIR": str(tmp / "a")}
    price = ["billing", "prices", "set", "--model", MODEL, "--prompt", "100", "--completion", "200"]
    subprocess.run([*CLI, *price], env=env, check=True, capture_output=True)
    return _Platform(env, envs, db_url, secret, budget, upstream)


def _records(db_url: str) -> dict[str, Decimal]:
    """Every usage record's id and cost."""
    from sqlmodel import Session, select

    from controlplane.storage.database import create_db
    from controlplane.storage.tables import UsageRecord

    engine = create_db(db_url)
    with Session(engine) as s:
        rows = s.exec(select(UsageRecord)).all()
        costs = {str(r.id): r.cost or Decimal(0) for r in rows}
    engine.dispose()
    return costs


def _prompt_only(db_url: str, ids: set[str]) -> set[str]:
    """Those of ``ids`` whose record bills a prompt and nothing else, ``interrupted``: a stream whose gateway died
    after its reservation wrote its opening checkpoint and before it sent a byte."""
    from sqlmodel import Session, col, select

    from controlplane.storage.database import create_db
    from controlplane.storage.tables import UsageRecord

    if not ids:
        return set()
    engine = create_db(db_url)
    with Session(engine) as s:
        rows = s.exec(select(UsageRecord).where(col(UsageRecord.id).in_(ids))).all()
        found = {str(r.id) for r in rows if r.status == "interrupted" and r.completion_tokens == 0}
    engine.dispose()
    return found


def _budget(db_url: str) -> tuple[Decimal, Decimal]:
    """The tenant's spend and what is still reserved, this month."""
    from sqlmodel import Session, select

    from controlplane.storage.database import create_db
    from controlplane.storage.tables import BudgetPeriod

    engine = create_db(db_url)
    with Session(engine) as s:
        periods = list(s.exec(select(BudgetPeriod)))
    engine.dispose()
    return sum((p.spent for p in periods), Decimal(0)), sum((p.reserved for p in periods), Decimal(0))


def _open_checkpoints(db_url: str) -> int:
    """Usage checkpoints not settled yet (a dead gateway's, until a survivor bills them)."""
    from sqlalchemy import func
    from sqlmodel import Session, select

    from controlplane.storage.database import create_db
    from controlplane.storage.tables import UsageCheckpoint

    engine = create_db(db_url)
    with Session(engine) as s:
        count = s.exec(select(func.count()).select_from(UsageCheckpoint)).one()
    engine.dispose()
    return int(count)


def _kill_phase(
    platform: _Platform, ports: list[int], procs: list[subprocess.Popen[bytes]], args: dict[str, Any]
) -> dict[str, Any]:
    duration, concurrency, max_tokens = args["duration"], args["concurrency"], args["max_tokens"]
    time.sleep(1.0)  # earlier phases' last records, queued for the usage writer, are written by now
    known = set(_records(platform.db_url))
    killed_at: list[float] = []

    def kill() -> None:
        killed_at.append(time.monotonic())
        os.kill(procs[0].pid, signal.SIGKILL)

    with round_robin_front(ports) as url:
        outcomes, began, _, warm, _ = asyncio.run(
            _load(url, platform.key, None, concurrency, max_tokens, duration=duration, at=(duration / 3, kill))
        )
    procs[0].wait()
    kill_t = killed_at[0]
    failed = [o for o in outcomes if not o.ok]
    served = {o.usage_id for o in outcomes if o.ok and o.usage_id}
    sent = {o.usage_id for o in outcomes if o.usage_id} | set(warm)
    # The dead gateway's budget reservations are released (its streams' checkpoints billed) by the survivor's
    # sweeper once their lease ends: wait for that, then compare the spend with the records.
    released_in: float | None = None
    deadline = time.monotonic() + args["lease_s"] + 30
    while time.monotonic() < deadline:
        # Settled only when no checkpoint is left either: the dead gateway's streams are billed from theirs (a
        # record and its spend) after their reservations are released. Read in this order: once nothing is
        # checkpointed or reserved, nothing can add spend, so the records read last are all of it (read first,
        # a stream billed between the reads counted its spend without its record).
        is_open = _open_checkpoints(platform.db_url) > 0
        spent, reserved = _budget(platform.db_url)
        records = _records(platform.db_url)
        if reserved == 0 and served <= set(records) and not is_open:
            released_in = round(time.monotonic() - kill_t, 1)
            break
        time.sleep(0.5)
    else:
        print(f"bench scale: still reserved {reserved}, {len(served - set(records))} records missing", file=sys.stderr)
    new = set(records) - known
    # A stream cut before its response's headers never told its client its id, but its reservation's opening
    # checkpoint bills its prompt: such records are those failed requests', up to one each. Any other record of
    # no id a client saw, or more of those than requests cut that early, would be a duplicate.
    unheard = sum(1 for o in failed if not o.usage_id)
    cut_early = min(len(_prompt_only(platform.db_url, new - sent)), unheard)
    load_end = began + duration  # no client starts a request after it: the rest is the drain
    return {
        "duration_s": duration,
        "concurrency": concurrency,
        "killed_after_s": round(kill_t - began, 2),
        "requests": len(outcomes),
        "served": len(served),
        "failed": len(failed),
        "failed_started_before_kill": sum(o.started < kill_t for o in failed),
        "failed_started_after_kill": sum(o.started >= kill_t for o in failed),
        "failed_reasons": dict(Counter(o.error or "?" for o in failed)),
        "records_lost": len(served - set(records)),
        "records_of_failed_requests": len(new & (sent - served)) + cut_early,
        "records_of_failed_requests_cut_before_headers": cut_early,
        "records_of_unknown_requests": len(new - sent) - cut_early,
        "reservations_released_s_after_kill": released_in,
        "spent_minus_records_cost": str(spent - sum(records.values(), Decimal(0))),
        "budget_overspend": str(max(Decimal(0), spent - platform.budget)),
        "survivor_requests_per_s": _rate(outcomes, kill_t + SETTLE_S, load_end),
        "survivor_requests_per_s_by_second": _per_second(outcomes, kill_t, load_end),
    }


def _rate(outcomes: list[Outcome], start: float, end: float) -> float | None:
    """Requests/s served in ``[start, end)``: those that ended in it. ``end`` is when clients stop starting
    requests, so the window never holds the drain (fewer clients at work), which would read as a slower gateway."""
    if end <= start:
        return None
    return round(sum(1 for o in outcomes if o.ok and start <= o.ended < end) / (end - start), 2)


def _per_second(outcomes: list[Outcome], start: float, end: float) -> list[int]:
    """Requests served in each whole second from ``start`` to ``end``: how fast the rate came back."""
    return [sum(1 for o in outcomes if o.ok and start + s <= o.ended < start + s + 1) for s in range(int(end - start))]


def _one_gateway_window(platform: _Platform, port: int, args: dict[str, Any]) -> dict[str, Any]:
    """The kill phase's reference: the same load (clients, duration) through the front to the gateway that will
    survive, alone, its rate taken over the same window as the survivor's (from the kill's time + ``SETTLE_S`` to
    the end of the load), right before the kill phase: a like-for-like single gateway, not the shorter
    ``one_gateway`` point with its own ramp and drain."""
    duration = args["duration"]
    with round_robin_front([port]) as url:
        outcomes, began, _, _, _ = asyncio.run(
            _load(url, platform.key, None, args["concurrency"], args["max_tokens"], duration=duration)
        )
    at = began + duration / 3
    return {
        "requests_per_s": _rate(outcomes, at + SETTLE_S, began + duration),
        "requests_per_s_by_second": _per_second(outcomes, at, began + duration),
        "errors": sum(1 for o in outcomes if not o.ok),
    }


# --- LiteLLM --------------------------------------------------------------------------------------------------


def find_litellm(explicit: str | None = None) -> str | None:
    """The ``litellm`` executable: ``explicit``, $TIERLINE_BENCH_LITELLM, the repo's ``.venv-peers``, or PATH."""
    for candidate in (
        explicit,
        os.environ.get("TIERLINE_BENCH_LITELLM"),
        str(Path(__file__).resolve().parent.parent / ".venv-peers" / "bin" / "litellm"),
        shutil.which("litellm"),
    ):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


@contextlib.contextmanager
def litellm_proxy(exe: str, upstream: str, tmp: Path, workers: int) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """The LiteLLM proxy (no database) in front of ``upstream``, until its liveness probe answers."""
    config = tmp / "litellm.yaml"
    config.write_text(
        json.dumps(  # YAML is a superset of JSON
            {
                "model_list": [
                    {
                        "model_name": MODEL,
                        "litellm_params": {"model": f"openai/{MODEL}", "api_base": f"{upstream}/v1", "api_key": "none"},
                    }
                ],
                "litellm_settings": {"drop_params": False},
                "general_settings": {"master_key": LITELLM_KEY},
            }
        )
    )
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TIERLINE_", "DATABASE_URL"))}
    env |= {"LITELLM_LOG": "ERROR", "LITELLM_LOCAL_MODEL_COST_MAP": "True", "NO_DOCS": "True"}
    log = (tmp / "litellm.log").open("wb")
    cmd = [exe, "--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--num_workers", str(workers)]
    # Under gunicorn (the app loaded once, then forked): uvicorn's own supervisor kills a worker that is not
    # ready within 5 s, which on a loaded 2-core host is every worker, forever.
    cmd += ["--run_gunicorn"] if workers > 1 else []
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"litellm exited with {proc.returncode}: {(tmp / 'litellm.log').read_text()[-2000:]}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health/liveliness", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("litellm did not start")
            time.sleep(0.3)
        yield url, proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def litellm_version(exe: str) -> str | None:
    python = Path(exe).parent / "python"
    if not python.is_file():
        return None
    out = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.strip() or None


# --- the run ----------------------------------------------------------------------------------------------------


def run_scale_bench(
    zoo: Path,
    data_dir: Path,
    *,
    db_url: str,
    redis_url: str,
    requests: int = 64,
    concurrency: int = 16,
    max_tokens: int = 16,
    duration: float = 20.0,
    vs_litellm: bool = False,
    litellm: str | None = None,
    peer_requests: dict[int, int] | None = None,
    rounds: int = 1,
    pace: tuple[float, float] | None = None,
) -> dict[str, Any]:
    """``pace``: (ttft ms, ms a token) of a paced upstream (``bench.paced_upstream``) instead of the zoo's LM on
    ``tierline engine serve``."""
    from bench.billing_bench import _postgres

    peer_requests = peer_requests or {1: 40, 8: 160, 64: 320}
    result: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "host_cores": os.cpu_count(),
        "requests": requests,
        "concurrency": concurrency,
    }
    exe = find_litellm(litellm) if vs_litellm else None
    with tempfile.TemporaryDirectory(prefix="tierline-bench-scale-") as tmp_name, _postgres(db_url) as schema_url:
        tmp = Path(tmp_name)
        up_port = free_port()
        upstream = f"http://127.0.0.1:{up_port}"
        platform = _setup(tmp, zoo, data_dir, schema_url, redis_url, upstream)
        with _upstream(zoo, platform, up_port, pace) as result["upstream"]:
            ports = [free_port(), free_port()]
            with contextlib.ExitStack() as stack:
                procs = [
                    stack.enter_context(tierline_server(["cloud", "serve"], env, port, "/readyz"))
                    for env, port in zip(platform.envs, ports, strict=True)
                ]
                pids = [p.pid for p in procs]
                direct = _measured(upstream, None, [], requests, concurrency, max_tokens)
                with round_robin_front(ports[:1]) as url:
                    one = _measured(url, platform.key, pids[:1], requests, concurrency, max_tokens)
                with round_robin_front(ports) as url:
                    two = _measured(url, platform.key, pids, requests, concurrency, max_tokens)
                result["paths"] = {"direct": direct, "one_gateway": one, "two_gateways": two}
                result["overhead_ms"] = {"one_gateway": _overhead(one, direct), "two_gateways": _overhead(two, direct)}
                if vs_litellm:
                    result["vs_litellm"] = _vs_litellm(
                        exe, upstream, tmp, platform, pids[1], ports[1], peer_requests, max_tokens, rounds
                    )
                args = {"duration": duration, "concurrency": concurrency, "max_tokens": max_tokens}
                args["lease_s"] = REQUEST_TIMEOUT_S + 5
                reference = _one_gateway_window(platform, ports[1], args)
                kill = _kill_phase(platform, ports, procs, args)
                survivor = kill["survivor_requests_per_s"]
                single = reference["requests_per_s"]
                kill["one_gateway_same_window"] = reference
                kill["survivor_vs_one_gateway"] = round(survivor / single, 2) if survivor and single else None
                point = one["requests_per_s"]  # the ratio as first reported: against the short one_gateway point
                kill["survivor_vs_one_gateway_point"] = round(survivor / point, 2) if survivor and point else None
                result["kill"] = kill
    _drop_ids(result)
    return result


@contextlib.contextmanager
def _upstream(zoo: Path, platform: _Platform, port: int, pace: tuple[float, float] | None) -> Iterator[dict[str, Any]]:
    """The model server on ``port`` until the block ends; what it is, for the report."""
    if pace is None:
        serve = ["engine", "serve", "--model", str(zoo / "artifacts" / MODEL), "--name", MODEL]
        with tierline_server(serve, platform.env, port, "/health"):
            yield {"kind": "tierline engine serve", "model": MODEL}
        return
    ttft_ms, token_ms = pace
    cmd = [sys.executable, "-m", "bench.paced_upstream", "--port", str(port)]
    cmd += ["--ttft-ms", str(ttft_ms), "--token-ms", str(token_ms)]
    with served(cmd, platform.env, f"http://127.0.0.1:{port}/health", "the paced upstream"):
        yield {"kind": "paced (bench.paced_upstream)", "ttft_ms": ttft_ms, "token_ms": token_ms}


def _drop_ids(value: Any) -> None:
    """The usage ids a point kept for the ledger checks are not part of the report."""
    if isinstance(value, dict):
        value.pop("_usage_ids", None)
        for v in value.values():
            _drop_ids(v)


def _vs_litellm(
    exe: str | None,
    upstream: str,
    tmp: Path,
    platform: _Platform,
    gateway_pid: int,
    gateway_port: int,
    peer_requests: dict[int, int],
    tokens: int,
    rounds: int = 1,
) -> dict[str, Any]:
    if exe is None:
        return {
            "skipped": "no litellm executable: make bench-peers (a separate virtualenv, .venv-peers), or set "
            "TIERLINE_BENCH_LITELLM"
        }
    out: dict[str, Any] = {
        "litellm_version": litellm_version(exe),
        "litellm_mode": "no database (spend tracking off: its Prisma engines cannot be downloaded here), "
        "--num_workers 2 under gunicorn (--run_gunicorn), master key auth",
        "tierline_mode": "one gateway: tenants, API key auth, rate limits in Redis, budget reservations, "
        "exactly-once usage records in PostgreSQL",
    }
    gateway = f"http://127.0.0.1:{gateway_port}"
    points: dict[str, Any] = {}
    with litellm_proxy(exe, upstream, tmp, workers=2) as (proxy, proc):
        for c, n in sorted(peer_requests.items()):
            runs = []
            for _ in range(rounds):  # alternating: upstream alone, tierline, LiteLLM, then again
                direct = _measured(upstream, None, [], n, c, tokens)
                ours = _measured(gateway, platform.key, [gateway_pid], n, c, tokens)
                theirs = _measured(proxy, LITELLM_KEY, [proc.pid], n, c, tokens)
                runs.append((direct, ours, theirs))
            direct, ours, theirs = runs[-1]
            # the served requests (the warm-ups' too) of every round: each must have its record
            ids = {i for _, o, _ in runs for i in o["_usage_ids"]}
            deadline = time.monotonic() + 20
            while len(written := ids & set(_records(platform.db_url))) < len(ids) and time.monotonic() < deadline:
                time.sleep(0.2)
            ours["spend_records_per_request"] = round(len(written) / max(1, len(ids)), 3)
            theirs["spend_records_per_request"] = 0.0  # no database: it writes none
            point: dict[str, Any] = {
                "direct": direct,
                "tierline": ours,
                "litellm": theirs,
                "overhead_ms": {"tierline": _overhead(ours, direct), "litellm": _overhead(theirs, direct)},
            }
            if rounds > 1:  # each side's CPU over every round; overhead: the median round's
                per_round = [
                    {
                        "tierline_cpu_s_per_1000": o.get("gateway_cpu_s_per_1000"),
                        "litellm_cpu_s_per_1000": t.get("gateway_cpu_s_per_1000"),
                        "tierline_overhead_p50_ms": _overhead(o, d)["p50_ms"],
                        "litellm_overhead_p50_ms": _overhead(t, d)["p50_ms"],
                    }
                    for d, o, t in runs
                ]
                point["rounds"] = per_round
                for side in ("tierline", "litellm"):
                    cpu = [r[f"{side}_cpu_s_per_1000"] for r in per_round]
                    if all(v is not None for v in cpu):
                        point[side]["gateway_cpu_s_per_1000"] = round(statistics.fmean(float(v or 0) for v in cpu), 2)
                    overheads = [r[f"{side}_overhead_p50_ms"] for r in per_round]
                    if all(v is not None for v in overheads):
                        median = statistics.median(float(v or 0) for v in overheads)
                        point["overhead_ms"][side]["p50_ms"] = round(median, 2)
            ratio = [point[s_]["gateway_cpu_s_per_1000"] for s_ in ("tierline", "litellm")]
            if all(ratio):
                point["cpu_ratio_tierline_to_litellm"] = round(ratio[0] / ratio[1], 3)
            points[str(c)] = point
    out["max_tokens"] = tokens
    out["rounds"] = rounds
    out["points"] = points
    return out

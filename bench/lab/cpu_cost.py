"""CPU seconds of fixed work, for comparing two checkouts on a host whose speed cannot be trusted.

Wall-clock rates swing several-fold on a shared 2-core host; the CPU time a fixed piece of work costs moves far less.
Run from each checkout in turn (``PYTHONPATH=<checkout> python -m bench.lab.cpu_cost engine|api ...``), alternating,
and compare the medians (docs/benchmarks.md has the loop):

- ``engine ZOO_PRESET_DIR {inproc,process} [N]``: N mixed requests (``bench engine``'s workload, greedy) through the
  ``LLMEngine`` in this process, or through the engine child process (``EngineProcess``), on one torch thread;
  CPU seconds of this process and of its children during the run only.
- ``api ZOO_PRESET_DIR KEYS_DIR [N] [CONCURRENCY] [plain|money]``: N streamed chat completions (16 tokens)
  against a real ``tierline cloud serve``; CPU milliseconds per request of the API process itself and of its
  engine children, and wall milliseconds per request at that concurrency. The model is priced in both; ``money``
  also puts the key in a project with a daily key budget and a monthly project budget, and makes the tenant
  prepaid, so each request is held on its credit and two budget windows and settles all three (issue 27).
- ``hold {plain,money} [N] [DATABASE_URL]``: the budget work of N requests in this process, one after the other,
  without a server: what the cloud runs per request (the applicable budgets, the hold, the settle, the credit
  alert check), against a fresh SQLite file or a given (empty) database; CPU and wall milliseconds per request.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import free_port, tierline_server, tree_cpu_seconds


def _proc_cpu(pid: int, *, children: bool) -> float:
    """CPU seconds of ``pid`` itself, or of its descendants (live, to the nanosecond, and reaped)."""
    return tree_cpu_seconds(pid, root=not children, descendants=children)


def engine_cost(zoo: Path, mode: str, num_requests: int = 64) -> dict[str, Any]:
    import torch

    from bench.engine_bench import KV_BYTES, _corpus_ids, _lm, _workload, run_engine_workload
    from cloud.engine.config import EngineConfig
    from cloud.engine.llm_engine import LLMEngine
    from cloud.engine.sampling_params import SamplingParams

    torch.set_num_threads(1)  # no spin-waiting threads inflating the CPU time
    options: dict[str, Any] = {"kv_cache_bytes": KV_BYTES, "max_num_seqs": 64, "max_num_batched_tokens": 2048}
    model_dir = _lm(zoo, "lm-cloud")
    engine = LLMEngine(EngineConfig(model_dir, **options))
    work = _workload(_corpus_ids(engine), num_requests, (16, 256), (16, 128), 0, engine.max_model_len)
    tokens = sum(m for _, m in work)
    if mode == "inproc":
        run_engine_workload(engine, work[:4], cache_salt="warm-up")
        cpu0, wall0 = time.process_time(), time.perf_counter()
        run_engine_workload(engine, work, cache_salt="measured")
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        return {"mode": mode, "tokens": tokens, "cpu_s": round(cpu, 3), "cpu_tokens_per_s": round(tokens / cpu, 1)}
    from cloud.engine.process import EngineProcess

    del engine
    client = EngineProcess.from_config(EngineConfig(model_dir, **options))

    async def run(batch: list[tuple[list[int], int]], salt: str) -> None:
        async def one(i: int, prompt: list[int], max_tokens: int) -> None:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            async for _ in client.generate(prompt, params, request_id=f"{salt}-{i}", cache_salt=salt):
                pass

        await asyncio.gather(*(one(i, p, m) for i, (p, m) in enumerate(batch)))

    try:
        asyncio.run(run(work[:4], "warm-up"))
        own0 = resource.getrusage(resource.RUSAGE_SELF)
        child0, wall0 = _proc_cpu(os.getpid(), children=True), time.perf_counter()
        asyncio.run(run(work, "measured"))
        own1 = resource.getrusage(resource.RUSAGE_SELF)
        child1, wall = _proc_cpu(os.getpid(), children=True), time.perf_counter() - wall0
    finally:
        client.shutdown()
    own = (own1.ru_utime + own1.ru_stime) - (own0.ru_utime + own0.ru_stime)
    cpu = own + child1 - child0
    return {
        "mode": mode,
        "tokens": tokens,
        "cpu_s": round(cpu, 3),
        "client_cpu_s": round(own, 3),
        "engine_child_cpu_s": round(child1 - child0, 3),
        "cpu_tokens_per_s": round(tokens / cpu, 1),
        "wall_s": round(wall, 2),
    }


def _money_controls(cli: list[str], env: dict[str, str], key_id: str) -> None:
    """A project holding the key, a key budget per day, a project budget per month, prepaid credit: all ample."""
    billing = [*cli, "billing"]
    for args in (
        ["projects", "create", "--tenant", "bench", "bench-project"],
        ["projects", "add-key", "--tenant", "bench", "--project", "bench-project", key_id],
        ["budgets", "set", "--tenant", "bench", "--scope", "key", "--ref", key_id, "--period", "day"],
        ["budgets", "set", "--tenant", "bench", "--scope", "project", "--ref", "bench-project", "--period", "month"],
        ["prepaid", "top-up", "--tenant", "bench", "--amount", "1000000"],
    ):
        amount = ["--amount", "1000000"] if args[0] == "budgets" else []
        subprocess.run([*billing, *args, *amount], env=env, check=True, capture_output=True)


def api_cost(
    zoo: Path, keys: Path, num_requests: int = 300, concurrency: int = 16, money: str = "plain"
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tierline-cpu-cost-") as tmp:
        data = Path(tmp)
        shutil.copytree(keys, data / "keys")
        shutil.copytree(zoo, data / "zoo" / zoo.name)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIERLINE_")}
        env.update(
            TIERLINE_DATA_DIR=str(data),
            TIERLINE_DATABASE_URL=f"sqlite:///{data / 'tierline.db'}",
            TIERLINE_CLOUD_ZOO_PRESET=zoo.name,
            TIERLINE_LOG_LEVEL="WARNING",
        )
        cli = [sys.executable, "-m", "tierline.cli"]
        price = ["billing", "prices", "set", "--model", "tierline/lm-cloud", "--prompt", "0.5", "--completion", "1.5"]
        for args in (["db", "upgrade"], ["tenants", "create", "bench"], price):
            subprocess.run([*cli, *args], env=env, check=True, capture_output=True)
        made = subprocess.run(
            [*cli, "keys", "create", "--tenant", "bench"], env=env, check=True, capture_output=True, text=True
        )
        key = made.stdout.strip()
        if money == "money":
            _money_controls(cli, env, made.stderr.split("key id ", 1)[1].split()[0])
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with tierline_server(["cloud", "serve"], env, port, "/readyz") as server:

            async def load(count: int) -> int:
                gate, ok = asyncio.Semaphore(concurrency), 0
                headers = {"authorization": f"Bearer {key}"}
                async with httpx.AsyncClient(timeout=120, headers=headers) as client:

                    async def one(i: int) -> None:
                        nonlocal ok
                        body = {
                            "model": "tierline/lm-cloud",
                            "messages": [{"role": "user", "content": f"def f{i}(x):"}],
                            "max_tokens": 16,
                            "temperature": 0,
                            "stream": True,
                        }
                        async with gate, client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                            async for _ in r.aiter_bytes():
                                pass
                            ok += r.status_code == 200

                    await asyncio.gather(*(one(i) for i in range(count)))
                return ok

            asyncio.run(load(20))
            api0, engine0 = _proc_cpu(server.pid, children=False), _proc_cpu(server.pid, children=True)
            wall0 = time.perf_counter()
            ok = asyncio.run(load(num_requests))
            wall = time.perf_counter() - wall0
            api1, engine1 = _proc_cpu(server.pid, children=False), _proc_cpu(server.pid, children=True)
    return {
        "money": money,
        "requests": num_requests,
        "concurrency": concurrency,
        "ok": ok,
        "wall_ms_per_request": round(1000 * wall / num_requests, 2),
        "api_cpu_ms_per_request": round(1000 * (api1 - api0) / num_requests, 2),
        "engine_cpu_ms_per_request": round(1000 * (engine1 - engine0) / num_requests, 2),
    }


def hold_cost(money: str, num_requests: int = 300, url: str | None = None) -> dict[str, Any]:
    from datetime import UTC, datetime
    from decimal import Decimal

    from sqlmodel import Session

    from controlplane.billing import budget_admin, credit
    from controlplane.billing.budgets import reserve, settle
    from controlplane.billing.scopes import applicable
    from controlplane.storage.database import create_db
    from controlplane.storage.migrate import upgrade
    from controlplane.tenancy.service import create_api_key, create_tenant

    with tempfile.TemporaryDirectory(prefix="tierline-hold-cost-") as tmp:
        url = url or f"sqlite:///{tmp}/hold.db"
        upgrade(url)
        engine = create_db(url)
        ample = Decimal(10**6)
        with Session(engine) as s:
            tenant = create_tenant(s, f"hold-{os.getpid()}")
            key = create_api_key(s, tenant).record
            if money == "money":
                project = budget_admin.create_project(s, tenant, "p", "bench")
                budget_admin.assign_key(s, tenant, key.id or 0, project, "bench")
                for scope, ref, period in (("key", str(key.id), "day"), ("project", "p", "month")):
                    budget_admin.set_budget(
                        s, tenant, scope=scope, ref=ref, period=period, amount=ample, is_hard=True, actor="bench"
                    )
                credit.top_up(s, tenant, ample, note="", actor="bench")
            s.commit()
            tenant_id, key_id, project_id = tenant.id or 0, key.id, key.project_id

        def one() -> None:  # as cloud.serving.completions does per request: _reserve, _settle, after_credit
            now = datetime.now(UTC)
            with Session(engine) as s:
                windows = applicable(s, tenant_id, now, key_id=key_id, project_id=project_id)
                prepaid = credit.available(s, tenant_id) is not None
            if not windows and not prepaid:
                return
            held = reserve(engine, tenant_id, None, Decimal("0.01"), at=now, windows=windows)
            settle(engine, held, Decimal("0.005"))
            if held.on_credit:
                with Session(engine) as s:
                    credit.claim_low_alert(s, tenant_id)
                    s.rollback()

        for _ in range(20):
            one()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for _ in range(num_requests):
            one()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        engine.dispose()
    return {
        "mode": "hold",
        "money": money,
        "database": url.split(":", 1)[0],
        "requests": num_requests,
        "cpu_ms_per_request": round(1000 * cpu / num_requests, 2),
        "wall_ms_per_request": round(1000 * wall / num_requests, 2),
    }


def main(argv: list[str]) -> None:
    usage = (
        "usage: python -m bench.lab.cpu_cost engine ZOO {inproc,process} [N]"
        " | api ZOO KEYS [N] [CONCURRENCY] [plain|money] | hold {plain,money} [N] [DATABASE_URL]"
    )
    if argv[:1] == ["hold"] and argv[1:2] in (["plain"], ["money"]):
        count = int(argv[2]) if len(argv) > 2 else 300
        print(json.dumps(hold_cost(argv[1], count, argv[3] if len(argv) > 3 else None)))
        return
    if (
        len(argv) < 3
        or argv[0] not in ("engine", "api")
        or (argv[0] == "engine" and argv[2] not in ("inproc", "process"))
        or (argv[0] == "api" and argv[5:6] not in ([], ["plain"], ["money"]))
    ):
        raise SystemExit(usage)
    if argv[0] == "engine":
        result = engine_cost(Path(argv[1]), argv[2], *(int(a) for a in argv[3:4]))
    else:
        sizes = dict(zip(("num_requests", "concurrency"), (int(a) for a in argv[3:5]), strict=False))
        result = api_cost(Path(argv[1]), Path(argv[2]), **sizes, money=argv[5] if len(argv) > 5 else "plain")
    print(json.dumps(result))


if __name__ == "__main__":  # the engine child is spawned: nothing may run on import
    main(sys.argv[1:])

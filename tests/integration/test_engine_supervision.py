"""Supervision of the built-in engine children of a real ``tierline cloud serve`` (issue 20, item 4).

The engine children are found under the server's pid in /proc and killed with a real SIGKILL. Each model's child
is paced (``Pacer``) until its stream's first event has been read and stopped (SIGSTOP) then, so the stream is
still in flight, deterministically, when one child is killed and the other resumed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine
from sqlmodel import Session, select

from cloud.engine.sampling_params import SamplingParams
from cloud.serving.engine_pool import EnginePool, EngineRestartingError, ServedLM, engine_config, start_engine
from cloud.settings import CloudSettings
from controlplane.storage.tables import UsageRecord
from shared.zoo.registry import ZooLayout
from tests.conftest import (
    Pacer,
    base_env,
    engine_processes,
    free_port,
    migrated_sqlite,
    seed_data_dir,
    server_process,
)
from tests.forkserver import run_tierline

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KILLED, SPARED = "tierline/lm-cloud", "tierline/lm-edge"  # the pool starts lm-cloud's child first
RESTART_DEADLINE_S = 120.0
BACKOFF_S = 2.0  # long enough that a request right after the kill deterministically meets the restart


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def metric(text: str, name: str, model: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(f'{name}{{model="{model}"}} '):
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.fixture
def cloud(tmp_path_factory: pytest.TempPathFactory, tiny_zoo: Path, session_data_dir: Path) -> Iterator[dict[str, str]]:
    data = seed_data_dir(tmp_path_factory.mktemp("supervision"), tiny_zoo, session_data_dir)
    env = base_env(
        data,
        TIERLINE_DATABASE_URL=migrated_sqlite(data),
        TIERLINE_CLOUD_ZOO_PRESET="tiny",
        TIERLINE_CLOUD_KV_CACHE_MB="16",
        TIERLINE_CLOUD_USAGE_FLUSH_MS="50",
        TIERLINE_CLOUD_NUM_THREADS="1",
        TIERLINE_CLOUD_ENGINE_RESTART_BACKOFF_S=str(BACKOFF_S),
    )
    run_tierline("tenants", "create", "acme", env=env, check=True)
    key = run_tierline("keys", "create", "--tenant", "acme", env=env, check=True).stdout.strip()
    port = free_port()
    log = data / "cloud.log"
    with server_process(["cloud", "serve"], env, port, ready_path="/readyz", timeout=120, log=log) as proc:
        yield {"url": f"http://127.0.0.1:{port}", "key": key, "db": env["TIERLINE_DATABASE_URL"], "pid": str(proc.pid)}


def usage_row(db_url: str, usage_id: str, timeout: float = 10.0) -> UsageRecord | None:
    engine = create_engine(db_url)
    deadline = time.monotonic() + timeout
    try:
        while True:
            with Session(engine) as s:
                row = s.exec(select(UsageRecord).where(UsageRecord.id == usage_id)).first()
            if row is not None or time.monotonic() > deadline:
                return row
            time.sleep(0.1)
    finally:
        engine.dispose()


def test_a_sigkilled_engine_child_is_restarted_and_serves_again(cloud: dict[str, str]) -> None:
    url, headers = cloud["url"], {"Authorization": f"Bearer {cloud['key']}"}
    children = engine_processes(int(cloud["pid"]))
    assert len(children) == 2, children
    pids = dict(zip((KILLED, SPARED), children, strict=True))
    # ignore_eos: a sampled end of text cannot end a stream before the kill.
    chat = {
        "messages": [{"role": "user", "content": "def main(argv):\n"}],
        "max_tokens": 200,
        "temperature": 1.0,
        "ignore_eos": True,
    }

    def to(model: str) -> Callable[[signal.Signals], None]:
        return lambda sig: os.kill(pids[model], sig)

    with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
        # Both children paced until their stream's first event has been read, then stopped: a child left to run
        # could make all 200 tokens before a loaded host's client reads the first.
        with (
            Pacer(to(KILLED)) as killed_pace,
            Pacer(to(SPARED)) as spared_pace,
            http.stream("POST", "/v1/chat/completions", json={**chat, "model": KILLED, "stream": True}) as killed,
            http.stream("POST", "/v1/chat/completions", json={**chat, "model": SPARED, "stream": True}) as spared,
        ):
            assert killed.status_code == spared.status_code == 200
            killed_lines, spared_lines = killed.iter_lines(), spared.iter_lines()
            first_killed = next(line for line in killed_lines if line.startswith("data: "))
            killed_pace.finish(signal.SIGSTOP)  # in flight: it cannot finish before the kill
            first_spared = next(line for line in spared_lines if line.startswith("data: "))
            spared_pace.finish(signal.SIGSTOP)
            assert '"finish_reason":null' in first_killed.replace(" ", "")
            assert '"finish_reason":null' in first_spared.replace(" ", "")

            os.kill(pids[KILLED], signal.SIGKILL)
            deadline = time.monotonic() + 10
            while not gone(pids[KILLED]):
                assert time.monotonic() < deadline, "the killed child did not die"
                time.sleep(0.01)
            os.kill(pids[SPARED], signal.SIGCONT)

            # The stream on the killed child ends with an error event, not a hang; the other one is unharmed.
            rest = [line for line in killed_lines if line.startswith("data: ")]
            events = [json.loads(line[6:]) for line in rest if line != "data: [DONE]"]
            assert events and "error" in events[-1], rest[-3:]
            assert events[-1]["error"]["type"] == "server_error"
            killed_usage = killed.headers["x-tierline-usage-id"]
            spared_rest = [line for line in spared_lines if line.startswith("data: ")]
            assert spared_rest[-1] == "data: [DONE]"

        # Meanwhile: 503 with Retry-After (the restart waits BACKOFF_S first), and /readyz names the model.
        during = http.post("/v1/chat/completions", json={**chat, "model": KILLED, "max_tokens": 4})
        assert during.status_code == 503, during.text
        assert int(during.headers["retry-after"]) >= 1
        assert during.json()["error"]["code"] == "engine_restarting"
        ready = http.get("/readyz")
        assert ready.status_code == 503
        assert f"engine restarting: {KILLED}" in ready.json()["error"]["message"]
        assert SPARED not in ready.json()["error"]["message"]
        assert http.post("/v1/chat/completions", json={**chat, "model": SPARED, "max_tokens": 4}).status_code == 200
        # An async job that meets the restart waits for it (requeued after Retry-After), rather than failing.
        job = http.post("/v1/chat/completions", json={**chat, "model": KILLED, "max_tokens": 4, "async": True})
        assert job.status_code == 202, job.text

        # The stream is billed for what it got before the kill.
        row = usage_row(cloud["db"], killed_usage)
        assert row is not None and row.status == "error" and row.model == KILLED
        assert row.completion_tokens >= 1 and row.prompt_tokens > 0

        # Within a bounded time the model serves again, on a new child.
        deadline = time.monotonic() + RESTART_DEADLINE_S
        while True:
            answer = http.post("/v1/chat/completions", json={**chat, "model": KILLED, "max_tokens": 4})
            if answer.status_code == 200:
                break
            assert answer.status_code == 503 and "retry-after" in answer.headers, answer.text
            assert time.monotonic() < deadline, "the engine was not restarted in time"
            time.sleep(0.5)
        assert answer.json()["choices"][0]["message"]["role"] == "assistant"
        assert http.get("/readyz").status_code == 200
        now = engine_processes(int(cloud["pid"]))
        assert pids[SPARED] in now and pids[KILLED] not in now and len(now) == 2
        deadline = time.monotonic() + RESTART_DEADLINE_S
        while (done := http.get(f"/v1/jobs/{job.json()['id']}").json())["status"] not in ("succeeded", "failed"):
            assert time.monotonic() < deadline, done
            time.sleep(0.5)
        assert done["status"] == "succeeded" and done["attempts"] >= 2, done
        metrics = http.get("/metrics").text
        assert metric(metrics, "tierline_engine_restarts_total", KILLED) == 1.0
        assert metric(metrics, "tierline_engine_restarts_total", SPARED) is None


def test_a_restart_that_fails_is_retried_with_a_doubling_wait(
    tiny_zoo: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """In process (engines on threads): the model's files are gone while it restarts, so attempts fail and are
    retried, each after twice the wait of the one before, until the files are back."""
    model_dir = tmp_path / "lm-edge"
    shutil.copytree(ZooLayout(tiny_zoo).artifact_dir("lm-edge"), model_dir)
    settings = CloudSettings(
        engine_process=False, kv_cache_mb=16, engine_restart_backoff_s=0.1, engine_restart_backoff_max_s=0.4
    )
    config = engine_config(model_dir, settings)
    first = start_engine(config, "lm-edge", settings)
    pool = EnginePool({"m": ServedLM("m", None, first, first.max_model_len)}, {"m": (config, "lm-edge")}, settings)
    failed = "restarting engine m failed"

    async def until(check: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 60
        while not check():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.02)

    async def main() -> None:
        pool.supervise()
        hidden = model_dir.rename(tmp_path / "hidden")
        first.shutdown()
        with pytest.raises(EngineRestartingError) as err:
            pool.get("m")
        assert err.value.status_code == 503 and err.value.retry_after >= 1
        assert pool.restarting() == ["m"]
        await until(lambda: sum(failed in r.getMessage() for r in caplog.records) >= 3, "three failed restarts")
        hidden.rename(model_dir)
        await until(lambda: pool.restart_counts.get("m") == 1, "a restart once the files are back")
        attempts = [r.created for r in caplog.records if failed in r.getMessage()]
        # waits 0.1, 0.2, 0.4, 0.4 s (capped) before the attempts: the gaps between failures are at least those
        assert attempts[1] - attempts[0] >= 0.19 and attempts[2] - attempts[1] >= 0.39
        served = pool.get("m")
        assert served.engine is not first and served.engine.alive and pool.restarting() == []
        outs = [o async for o in served.engine.generate("def f(x):", SamplingParams(max_tokens=3, temperature=0))]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
        await pool.close()
        pool.shutdown()

    with caplog.at_level(logging.INFO, logger="cloud.serving.engine_pool"):
        asyncio.run(main())

"""Tokens streamed before a crash are billed: a real cloud server is SIGKILLed (its whole process group) mid-stream,
restarted on the same database, and the ledger then holds a record of what the client received, within one
checkpoint interval, with the budget reservation released. A stream that ends normally leaves exactly one record
with its exact counts and no checkpoint. SQLite and PostgreSQL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from bench.common import served
from controlplane.billing.budgets import reserve
from controlplane.billing.ledger import NewUsage, checkpoint, reconcile_checkpoints, settle_checkpointed
from controlplane.storage.database import create_db
from controlplane.storage.tables import BudgetPeriod, BudgetReservation, Price, Tenant, UsageCheckpoint, UsageRecord
from controlplane.tenancy.service import create_api_key, create_tenant
from shared.zoo.registry import ZooLayout
from tests.conftest import Pacer, base_env, free_port, seed_data_dir, server_process, signal_tree
from tests.forkserver import start_tierline

pytestmark = pytest.mark.integration
MODEL = "tierline/lm-cloud"
EVERY_TOKENS = 8  # TIERLINE_CLOUD_USAGE_CHECKPOINT_TOKENS: the most a crash may leave unbilled
REQUEST_TIMEOUT_S = 15.0
LEASE_MARGIN_S = 1.0  # a checkpoint (and its reservation) of a dead process is reconciled this long past the deadline
BUDGET = Decimal("1000")


@contextmanager
def _cloud(env: dict[str, str], port: int, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``tierline cloud serve`` in a process group of its own (the engine processes are its children), ready."""
    with log.open("ab") as out:
        proc = start_tierline(
            ["cloud", "serve", "--host", "127.0.0.1", "--port", str(port)], env, out, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"cloud exited with {proc.returncode}:\n{log.read_text()[-5000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"cloud not ready:\n{log.read_text()[-5000:]}"
            time.sleep(0.2)
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _setup(db_url: str) -> tuple[Engine, int, str]:
    engine = create_db(db_url)
    with Session(engine) as s:
        tenant = create_tenant(s, "streamer")
        tenant.monthly_budget = BUDGET
        s.add(tenant)
        s.add(
            Price(
                model=MODEL,
                tier="cloud",
                prompt_per_mtok=Decimal("1000"),
                completion_per_mtok=Decimal("3000"),
                cached_per_mtok=Decimal("100"),
                effective_from=datetime.now(UTC) - timedelta(days=1),
            )
        )
        s.commit()
        key = create_api_key(s, tenant).secret
        s.commit()
        assert tenant.id is not None
        return engine, tenant.id, key


def _events(response: httpx.Response) -> Iterator[dict[str, Any] | str]:
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            yield data if data == "[DONE]" else json.loads(data)


def _tokens(event: dict[str, Any] | str) -> int:
    if isinstance(event, str):
        return 0
    return sum(len((c.get("logprobs") or {}).get("tokens", [])) for c in event.get("choices", []))


def _budget(engine: Engine, tenant_id: int) -> BudgetPeriod:
    with Session(engine) as s:
        rows = s.exec(select(BudgetPeriod).where(col(BudgetPeriod.tenant_id) == tenant_id)).all()
    assert len(rows) == 1
    return rows[0]


def _records(engine: Engine, record_id: str) -> list[UsageRecord]:
    with Session(engine) as s:
        return list(s.exec(select(UsageRecord).where(col(UsageRecord.id) == record_id)))


def _checkpoints(engine: Engine) -> list[UsageCheckpoint]:
    with Session(engine) as s:
        return list(s.exec(select(UsageCheckpoint)))


def _wait_for(what: str, probe: Any, timeout: float) -> Any:
    """``probe()``'s first truthy answer, polled until ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        found = probe()
        if found or time.monotonic() > deadline:
            assert found, f"{what}: not within {timeout:.0f}s"
            return found
        time.sleep(0.2)


BODY = {
    "model": MODEL,
    "prompt": "def fibonacci(n):",
    "stream": True,
    "logprobs": 0,  # each event lists the tokens it carries: the client counts what it received
    "temperature": 0,
    "ignore_eos": True,
    "stream_options": {"include_usage": True},
}


def _paced(proc: subprocess.Popen[bytes], group: bool) -> Pacer:
    """The server making the tokens paced (``Pacer``): ``proc``'s process group where ``group``, else it and its
    descendants, the engine process among them. The tiny LM's context is 256 tokens: unpaced, a fast engine writes the
    whole stream before a client on a loaded host has read the first 27, and the kill lands after the end."""
    if not group:
        return Pacer(signal_tree(proc))
    return Pacer(lambda sig: os.killpg(proc.pid, sig))


def _stream_until_killed(
    url: str, headers: dict[str, str], proc: subprocess.Popen[bytes], paced: Pacer
) -> tuple[str, int]:
    """A long stream, its tokens ``paced`` (see ``_paced``), whose server process group is SIGKILLed once the client
    received 3 checkpoint intervals and a bit: (the request's id, the tokens the client received)."""
    received, finished, killed_id = 0, False, ""
    with (
        paced,
        httpx.stream("POST", url, json={**BODY, "max_tokens": 240}, headers=headers, timeout=60) as r,
    ):
        assert r.status_code == 200, r.read()
        try:
            for event in _events(r):
                if event == "[DONE]":
                    finished = True
                if isinstance(event, dict) and event.get("choices"):
                    killed_id = event["id"].removeprefix("cmpl-")
                received += _tokens(event)
                if received >= 3 * EVERY_TOKENS + 3 and proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                # what the server wrote before it died is still read: every token the client got counts
        except httpx.HTTPError:
            pass
    assert not finished, "the stream finished before the kill: pace the server slower"
    assert received >= 3 * EVERY_TOKENS + 3 and killed_id
    return killed_id, received


def test_tokens_streamed_before_a_kill_are_billed_after_the_restart(
    migrated_db: str, tiny_zoo: Path, session_data_dir: Path, tmp_path: Path
) -> None:
    engine, tenant_id, key = _setup(migrated_db)
    data = seed_data_dir(tmp_path / "data", tiny_zoo, session_data_dir)
    env = base_env(
        data,
        TIERLINE_DATABASE_URL=migrated_db,
        TIERLINE_CLOUD_ZOO_PRESET="tiny",
        TIERLINE_CLOUD_KV_CACHE_MB="16",
        TIERLINE_CLOUD_USAGE_FLUSH_MS="50",
        TIERLINE_CLOUD_USAGE_CHECKPOINT_TOKENS=str(EVERY_TOKENS),
        TIERLINE_CLOUD_USAGE_CHECKPOINT_MS="0",
        TIERLINE_CLOUD_REQUEST_TIMEOUT_S=str(REQUEST_TIMEOUT_S),
        TIERLINE_CLOUD_BUDGET_LEASE_MARGIN_S=str(LEASE_MARGIN_S),
        TIERLINE_CLOUD_BUDGET_SWEEP_INTERVAL_S="0.5",
        TIERLINE_CLOUD_SPECULATION="off",
    )
    headers = {"Authorization": f"Bearer {key}"}
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1/completions"
    log = tmp_path / "cloud.log"

    with _cloud(env, port, log) as proc:
        # A stream that ends: one record, its exact counts, no checkpoint left behind, nothing reserved.
        with httpx.stream("POST", url, json={**BODY, "max_tokens": 40}, headers=headers, timeout=60) as r:
            assert r.status_code == 200, r.read()
            events = list(_events(r))
        first, last = events[0], events[-2]
        assert isinstance(first, dict) and isinstance(last, dict)
        usage: dict[str, int] = last["usage"]
        request_id = first["id"].removeprefix("cmpl-")
        assert events[-1] == "[DONE]" and sum(_tokens(e) for e in events) == usage["completion_tokens"] == 40
        (normal,) = _wait_for("the normal stream's record", lambda: _records(engine, request_id), 10)
        assert (normal.prompt_tokens, normal.completion_tokens, normal.status) == (usage["prompt_tokens"], 40, "ok")
        assert _checkpoints(engine) == []
        before = _budget(engine, tenant_id)
        assert before.reserved == 0 and before.spent == normal.cost and normal.cost > 0

        # A long stream, killed (SIGKILL to the server's process group) after the client received some tokens.
        killed_id, received = _stream_until_killed(url, headers, proc, _paced(proc, group=True))
        killed_at = time.monotonic()
        assert _records(engine, killed_id) == []  # the process died before its end-of-stream record
        assert _budget(engine, tenant_id).reserved > 0  # and before settling its hold

    # Restarted on the same database: the dead stream's checkpoint is billed once its lease ran out.
    with _cloud(env, free_port(), log):
        wait_s = max(0.0, REQUEST_TIMEOUT_S + LEASE_MARGIN_S - (time.monotonic() - killed_at)) + 30
        (billed,) = _wait_for("the killed stream's record", lambda: _records(engine, killed_id), wait_s)
        assert billed.status == "interrupted" and billed.prompt_tokens == usage["prompt_tokens"]
        # Billed: every token received except at most the tail since the last checkpoint; never more than one
        # checkpoint's worth beyond what arrived (a checkpoint is written before its tokens are sent).
        assert received - EVERY_TOKENS < billed.completion_tokens <= received + EVERY_TOKENS, (
            received,
            billed.completion_tokens,
        )
        assert billed.cost is not None and billed.cost > 0
        print(f"received {received} tokens before the kill; billed {billed.completion_tokens} completion tokens")
        period = _wait_for(
            "the reservation released", lambda: (b := _budget(engine, tenant_id)).reserved == 0 and b, 10
        )
        assert period.spent == normal.cost + billed.cost  # the cost counted once, the rest of the hold given back
        assert _checkpoints(engine) == []
        with Session(engine) as s:
            assert s.exec(select(BudgetReservation)).all() == []
    engine.dispose()


def _relay_env(data: Path, db_url: str, lm_dir: Path, upstream_port: int) -> dict[str, str]:
    """A gateway only, relaying ``MODEL`` to an ``openai`` backend on ``upstream_port``, checkpointing every
    ``EVERY_TOKENS`` tokens (by tokens only), its dead streams reconciled soon after their lease."""
    backends = data / "backends.json"
    spec = {"type": "openai", "endpoints": [f"http://127.0.0.1:{upstream_port}"], "upstream_model": "lm-cloud"}
    backends.write_text(json.dumps({"models": {MODEL: {**spec, "tokenizer": str(lm_dir)}}}))
    return base_env(
        data,
        TIERLINE_DATABASE_URL=db_url,
        TIERLINE_CLOUD_ZOO_PRESET="none",
        TIERLINE_CLOUD_BACKENDS=str(backends),
        TIERLINE_CLOUD_USAGE_FLUSH_MS="50",
        TIERLINE_CLOUD_USAGE_CHECKPOINT_TOKENS=str(EVERY_TOKENS),
        TIERLINE_CLOUD_USAGE_CHECKPOINT_MS="0",
        TIERLINE_CLOUD_REQUEST_TIMEOUT_S=str(REQUEST_TIMEOUT_S),
        TIERLINE_CLOUD_BUDGET_LEASE_MARGIN_S=str(LEASE_MARGIN_S),
        TIERLINE_CLOUD_BUDGET_SWEEP_INTERVAL_S="0.5",
    )


def test_tokens_relayed_from_an_upstream_before_a_gateway_kill_are_billed(
    migrated_db: str, tiny_zoo: Path, session_data_dir: Path, tmp_path: Path
) -> None:
    """The same guarantee for a model an upstream server answers (an ``openai`` backend): the upstream tells usage
    only at the end of its stream, so the gateway checkpoints what it relayed, counted with the model's tokenizer.
    The gateway is killed, the upstream (``tierline engine serve``) lives on."""
    engine, tenant_id, key = _setup(migrated_db)
    data = seed_data_dir(tmp_path / "data", tiny_zoo, session_data_dir)
    lm_dir = ZooLayout(tiny_zoo).artifact_dir("lm-cloud")
    upstream_port = free_port()
    env = _relay_env(data, migrated_db, lm_dir, upstream_port)
    # An event a token (no decode bursts): the gateway checkpoints before it relays an event, so a kill between the
    # two bills that event's tokens unsent, and the bound below is one checkpoint interval.
    upstream_env = base_env(
        data, TIERLINE_CLOUD_KV_CACHE_MB="16", TIERLINE_CLOUD_SPECULATION="off", TIERLINE_CLOUD_DECODE_BURST_MS="0"
    )
    headers = {"Authorization": f"Bearer {key}"}
    log = tmp_path / "gateway.log"
    upstream = ["engine", "serve", "--model", str(lm_dir), "--name", "lm-cloud"]
    with server_process(upstream, upstream_env, upstream_port, ready_path="/health", timeout=180) as up:
        port = free_port()
        with _cloud(env, port, log) as proc:
            # The upstream is paced, not the gateway: a gateway stopped while its upstream streams on relays what
            # piled up in one write, checkpointed before it, and a kill between the two bills a batch unsent.
            url = f"http://127.0.0.1:{port}/v1/completions"
            killed_id, received = _stream_until_killed(url, headers, proc, _paced(up, group=False))
            killed_at = time.monotonic()
            assert _records(engine, killed_id) == []
            assert _budget(engine, tenant_id).reserved > 0
        with _cloud(env, free_port(), log):
            wait_s = max(0.0, REQUEST_TIMEOUT_S + LEASE_MARGIN_S - (time.monotonic() - killed_at)) + 30
            (billed,) = _wait_for("the killed relay's record", lambda: _records(engine, killed_id), wait_s)
            print(f"relayed {received} tokens before the kill; billed {billed.completion_tokens} completion tokens")
            assert billed.status == "interrupted" and billed.prompt_tokens > 0
            assert received - EVERY_TOKENS < billed.completion_tokens <= received + EVERY_TOKENS
            period = _wait_for(
                "the reservation released", lambda: (b := _budget(engine, tenant_id)).reserved == 0 and b, 10
            )
            assert billed.cost is not None and period.spent == billed.cost
            assert _checkpoints(engine) == []
    engine.dispose()


def test_a_gateway_killed_before_the_first_byte_bills_the_prompt_it_sent_upstream(
    migrated_db: str, tiny_zoo: Path, session_data_dir: Path, tmp_path: Path
) -> None:
    """A stream's reservation writes its first checkpoint (its prompt): a gateway killed while its upstream is still
    before the first token (here one that answers a minute later) is billed for the prompt it sent, as
    ``interrupted``, with its hold released; the stream needed no checkpoint statement of its own before then."""
    engine, tenant_id, key = _setup(migrated_db)
    data = seed_data_dir(tmp_path / "data", tiny_zoo, session_data_dir)
    upstream_port = free_port()
    env = _relay_env(data, migrated_db, ZooLayout(tiny_zoo).artifact_dir("lm-cloud"), upstream_port)
    slow = [sys.executable, "-m", "bench.paced_upstream", "--port", str(upstream_port), "--ttft-ms", "60000"]
    client_error: list[BaseException] = []

    def stream(url: str) -> None:
        try:
            body = {**BODY, "max_tokens": 16}
            with httpx.stream("POST", url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=90) as r:
                r.read()
        except httpx.HTTPError as exc:
            client_error.append(exc)

    log = tmp_path / "gateway.log"
    with served(slow, {**os.environ}, f"http://127.0.0.1:{upstream_port}/health", "the slow upstream"):
        port = free_port()
        with _cloud(env, port, log) as proc:
            client = threading.Thread(target=stream, args=(f"http://127.0.0.1:{port}/v1/completions",))
            client.start()
            (opening,) = _wait_for("the stream's opening checkpoint", lambda: _checkpoints(engine), 30)
            assert (opening.completion_tokens, opening.reservation_id is not None) == (0, True)
            assert opening.prompt_tokens > 0
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            killed_at = time.monotonic()
            client.join(timeout=30)
            assert client_error, "the client saw its stream cut before any byte"
        with _cloud(env, free_port(), log):
            wait_s = max(0.0, REQUEST_TIMEOUT_S + LEASE_MARGIN_S - (time.monotonic() - killed_at)) + 30
            (billed,) = _wait_for("the killed stream's record", lambda: _records(engine, opening.id), wait_s)
            assert billed.status == "interrupted"
            assert (billed.prompt_tokens, billed.completion_tokens) == (opening.prompt_tokens, 0)
            period = _wait_for(
                "the reservation released", lambda: (b := _budget(engine, tenant_id)).reserved == 0 and b, 10
            )
            assert billed.cost is not None and billed.cost > 0 and period.spent == billed.cost
            assert _checkpoints(engine) == []
    engine.dispose()


# -- the ledger's side: a checkpoint is settled or reconciled exactly once ----------------------------------------
def _usage(record_id: str, tenant_id: int, completion: int, **kw: Any) -> NewUsage:
    return NewUsage(
        id=record_id,
        tenant_id=tenant_id,
        model=MODEL,
        tier="cloud",
        occurred_at=datetime.now(UTC),
        prompt_tokens=5,
        completion_tokens=completion,
        **kw,
    )


def test_a_settled_checkpoint_is_replaced_by_its_record_and_never_reconciled(migrated_db: str) -> None:
    engine, tenant_id, _ = _setup(migrated_db)
    hold = reserve(engine, tenant_id, BUDGET, Decimal("1.0"))
    with Session(engine) as s:
        checkpoint(s, _usage("req-settled", tenant_id, 8), hold, lease_s=0.0)
        s.commit()
    with Session(engine) as s:
        checkpoint(s, _usage("req-settled", tenant_id, 16), hold, lease_s=0.0)  # updated, not added
        s.commit()
    (cp,) = _checkpoints(engine)
    assert cp.completion_tokens == 16 and cp.reservation_id == hold.id
    with Session(engine) as s:
        spent = settle_checkpointed(s, _usage("req-settled", tenant_id, 20, rating=(None, Decimal("0.25"))), hold)
        s.commit()
    assert spent == Decimal("0.25")
    assert reconcile_checkpoints(engine, now=datetime.now(UTC) + timedelta(hours=1)) == 0
    (record,) = _records(engine, "req-settled")
    assert (record.completion_tokens, record.status, record.cost) == (20, "ok", Decimal("0.25"))
    period = _budget(engine, tenant_id)
    assert (period.spent, period.reserved) == (Decimal("0.25"), 0)
    engine.dispose()


def test_a_dead_streams_checkpoint_is_billed_once_and_its_hold_released(migrated_db: str) -> None:
    engine, tenant_id, _ = _setup(migrated_db)
    hold = reserve(engine, tenant_id, BUDGET, Decimal("1.0"))
    with Session(engine) as s:
        checkpoint(s, _usage("req-dead", tenant_id, 24), hold, lease_s=60.0)
        s.commit()
    assert reconcile_checkpoints(engine) == 0  # its lease runs: the stream may be alive
    later = datetime.now(UTC) + timedelta(minutes=5)
    assert reconcile_checkpoints(engine, now=later) == 1
    assert reconcile_checkpoints(engine, now=later) == 0
    (record,) = _records(engine, "req-dead")
    # 5 prompt tokens at 1000/Mtok + 24 completion at 3000/Mtok
    assert (record.prompt_tokens, record.completion_tokens, record.status) == (5, 24, "interrupted")
    assert record.cost == Decimal("0.077")
    period = _budget(engine, tenant_id)
    assert (period.spent, period.reserved) == (Decimal("0.077"), 0)
    with Session(engine) as s:
        assert s.exec(select(BudgetReservation)).all() == [] and s.get(Tenant, tenant_id) is not None
    engine.dispose()


def test_a_checkpoint_left_behind_by_a_settled_stream_adds_nothing(migrated_db: str) -> None:
    engine, tenant_id, _ = _setup(migrated_db)
    hold = reserve(engine, tenant_id, BUDGET, Decimal("1.0"))
    with Session(engine) as s:
        settle_checkpointed(s, _usage("req-late", tenant_id, 20, rating=(None, Decimal("0.25"))), hold)
        s.commit()
    with Session(engine) as s:  # a checkpoint write that landed after the stream settled
        checkpoint(s, _usage("req-late", tenant_id, 16), hold, lease_s=0.0)
        s.commit()
    assert reconcile_checkpoints(engine, now=datetime.now(UTC) + timedelta(hours=1)) == 0
    assert _checkpoints(engine) == []
    (record,) = _records(engine, "req-late")
    assert (record.completion_tokens, record.status) == (20, "ok")
    period = _budget(engine, tenant_id)
    assert (period.spent, period.reserved) == (Decimal("0.25"), 0)  # not billed twice
    engine.dispose()


def test_a_reconciled_checkpoint_draws_credit_and_releases_its_scoped_windows(migrated_db: str) -> None:
    """A dead stream held on prepaid credit and on a scoped budget window: reconciling its checkpoint draws the
    cost from the credit and gives back both holds (neither the credit's nor the window's reserved amount leaks)."""
    from controlplane.billing import budget_admin, credit
    from controlplane.billing.scopes import applicable
    from controlplane.storage.tables import BudgetWindow, CreditAccount

    engine, tenant_id, _ = _setup(migrated_db)
    with Session(engine) as s:
        tenant = s.get(Tenant, tenant_id)
        assert tenant is not None
        credit.top_up(s, tenant, Decimal("1.00"), note="test", actor="test")
        budget_admin.set_budget(
            s, tenant, scope="tenant", ref=None, period="day", amount=Decimal("10"), is_hard=True, actor="test"
        )
        s.commit()
        windows = applicable(s, tenant_id, datetime.now(UTC))
    assert windows
    hold = reserve(engine, tenant_id, BUDGET, Decimal("0.5"), windows=windows)
    assert hold.on_credit and hold.windows
    with Session(engine) as s:
        checkpoint(s, _usage("req-credit", tenant_id, 24), hold, lease_s=0.0)
        s.commit()
    assert reconcile_checkpoints(engine, now=datetime.now(UTC) + timedelta(minutes=5)) == 1
    (record,) = _records(engine, "req-credit")
    assert record.status == "interrupted" and record.cost == Decimal("0.077")
    with Session(engine) as s:
        account = s.get(CreditAccount, tenant_id)
        assert account is not None
        assert (account.balance, account.reserved) == (Decimal("0.923"), 0)
        (window,) = s.exec(select(BudgetWindow)).all()
        assert (window.spent, window.reserved) == (Decimal("0.077"), 0)
        assert s.exec(select(BudgetReservation)).all() == []
    engine.dispose()

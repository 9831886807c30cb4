"""Shadow replays are spending like any other, and the tenant's shadow share is the cloud's rule: a real cloud (the
tiny zoo's ``digits-large`` answers the replays), devices posting shadow batches to it, on SQLite and PostgreSQL.

Before the fix, a device of a tenant with a 0.0001 monthly hard budget had 4 batches accepted (257x the limit), and
a tenant whose shadow share was 0 still had its batches answered and billed. Now each batch's worst case is
reserved against every budget the device's traffic counts against (the tenant's month, its prepaid credit, its
end user's budget) before the cloud model runs: the batch that does not fit is refused with 429
``insufficient_quota`` and nothing past the limit is billed. A tenant whose share is 0 (``tierline tenants
shadow-share T 0``) gets 403 ``shadow_disabled``, billed nothing. A share above 0 bounds a device's replays by the
edge work it reported. And the agent's sampler drops a refused batch and pauses: it does not send the next one
until its pause ends or a sync says the allowance is back.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from cloud.edge.quality_monitor import ShadowIntake
from controlplane.billing import budget_admin, credit
from controlplane.billing.budgets import PriceBook
from controlplane.billing.invoicing import PriceSpec, add_price
from controlplane.billing.pricing import period_of
from controlplane.fleet.devices import create_enrollment_token, enroll, ingest
from controlplane.storage.database import create_db
from controlplane.storage.tables import (
    BudgetPeriod,
    BudgetWindow,
    CreditAccount,
    Device,
    EscalationPolicy,
    ShadowSample,
    Tenant,
    UsageRecord,
)
from controlplane.tenancy.service import create_tenant
from edge_agent.shadow_sampler import ShadowSampler
from shared.edge_protocol import Allowance, ShadowRequest, UsageItem
from shared.errors import RateLimitError
from tests.conftest import base_env, free_port, run_server, seed_data_dir
from tests.forkserver import run_tierline

pytestmark = pytest.mark.integration

EDGE_MODEL, CLOUD_MODEL = "tierline/digits-small", "tierline/digits-large"
PER_ROW = Decimal("0.00003")  # a 2-row batch: 0.00006; two of them: 0.00012, over a 0.0001 budget
LIMIT = Decimal("0.0001")


def _policy(engine: Engine) -> None:
    """Version 1 of the edge model's escalation policy (what a shadow batch names); no calibration promise."""
    with Session(engine) as s:
        s.add(
            EscalationPolicy(
                model=EDGE_MODEL,
                version=1,
                signal="max_prob",
                threshold=0.5,
                max_quality_loss=0.01,
                policy={},
                data_sha256="0" * 64,
                data_items=0,
                signature="x",
                key_id="x",
                created_by="test",
            )
        )
        s.commit()


def _batch(rows: int = 2, batch_id: str | None = None) -> dict[str, Any]:
    return {
        "id": batch_id or uuid.uuid4().hex,
        "model": EDGE_MODEL,
        "cloud_model": CLOUD_MODEL,
        "policy_version": 1,
        "inputs": [[float(i % 16) for i in range(64)] for _ in range(rows)],
        "edge_answers": [1] * rows,
        "confidences": [0.9] * rows,
        "occurred_at": time.time(),
    }


def _shadow_billed(engine: Engine, tenant_id: int) -> tuple[int, Decimal]:
    with Session(engine) as s:
        records = s.exec(
            select(UsageRecord).where(col(UsageRecord.tenant_id) == tenant_id, col(UsageRecord.tier) == "shadow")
        ).all()
        return len(records), sum((r.cost or Decimal(0) for r in records), Decimal(0))


def _month_spent(engine: Engine, tenant_id: int) -> Decimal:
    with Session(engine) as s:
        row = s.get(BudgetPeriod, (tenant_id, period_of(datetime.now(UTC))))
        assert row is not None
        assert row.reserved == 0  # no hold is left behind, refused or settled
        return row.spent


def test_shadow_batches_are_held_against_every_budget_and_the_share(
    migrated_db: str, tmp_path: Path, tiny_zoo: Path, session_data_dir: Path
) -> None:
    engine = create_db(migrated_db)
    tokens: dict[str, str] = {}
    with Session(engine) as s:
        add_price(s, PriceSpec(CLOUD_MODEL, Decimal(0), Decimal(0), tier="cloud", per_row=PER_ROW), actor="t")
        tight = create_tenant(s, "tight", budget=LIMIT)  # the tenant's monthly hard budget
        roomy = create_tenant(s, "roomy", budget=Decimal("100"))  # its end user's budget is the tight one
        budget_admin.set_budget(
            s, roomy, scope="user", ref="alice", period="month", amount=LIMIT, is_hard=True, actor="t"
        )
        prepaid = create_tenant(s, "prepaid")  # prepaid credit, no monthly budget
        credit.top_up(s, prepaid, LIMIT, note="test", actor="t")
        quiet = create_tenant(s, "quiet", budget=Decimal("100"))  # replays turned off below
        for tenant in (tight, prepaid, quiet):
            tokens[tenant.name] = create_enrollment_token(s, tenant).secret
        tokens["roomy"] = create_enrollment_token(s, roomy, labels={"billing.user": "alice"}).secret
        s.commit()
        ids = {t.name: t.id or 0 for t in (tight, roomy, prepaid, quiet)}
    _policy(engine)

    data = seed_data_dir(tmp_path / "data", tiny_zoo, session_data_dir)
    env = base_env(
        data,
        TIERLINE_DATABASE_URL=migrated_db,
        TIERLINE_CLOUD_ZOO_PRESET="tiny",
        TIERLINE_CLOUD_KV_CACHE_MB="16",
        TIERLINE_CLOUD_SPECULATION="off",
        TIERLINE_CLOUD_EDGE_SHADOW_SHARE="1.0",
    )
    off = run_tierline("tenants", "shadow-share", "quiet", "0", env=env)
    assert off.returncode == 0, off.stderr
    with run_server(["cloud", "serve"], env, free_port(), timeout=180) as url:
        auth = {}
        for name, token in tokens.items():
            device = httpx.post(f"{url}/v1/edge/enroll", json={"token": token, "name": name}, timeout=30).json()
            auth[name] = {"Authorization": f"Bearer {device['device_token']}"}

        def post(name: str, batch: dict[str, Any]) -> httpx.Response:
            return httpx.post(f"{url}/v1/edge/shadow", json=batch, headers=auth[name], timeout=60)

        # The tenant's hard budget, its end user's, its prepaid credit: the first batch fits, the next ones do not.
        firsts = {}
        for name in ("tight", "roomy", "prepaid"):
            firsts[name] = _batch()
            first = post(name, firsts[name])
            assert first.status_code == 200, first.text
            for refused in [post(name, _batch()) for _ in range(3)]:
                assert refused.status_code == 429, refused.text
                assert refused.json()["error"]["code"] == "insufficient_quota"
            num, billed = _shadow_billed(engine, ids[name])
            assert num == 1 and billed == 2 * PER_ROW <= LIMIT, name
        assert _month_spent(engine, ids["tight"]) == 2 * PER_ROW
        with Session(engine) as s:
            [alice] = s.exec(select(BudgetWindow)).all()
            assert alice.spent == 2 * PER_ROW and alice.reserved == 0
            account = s.get(CreditAccount, ids["prepaid"])
            assert account is not None and account.balance == LIMIT - 2 * PER_ROW and account.reserved == 0

        # A retry of a batch the cloud billed already is answered as such, and billed nothing more.
        retry = post("tight", firsts["tight"])
        assert retry.status_code == 200 and retry.json()["duplicate"] is True, retry.text
        assert _shadow_billed(engine, ids["tight"])[0] == 1

        # Replays turned off for the tenant: refused, not answered, not billed.
        muted = post("quiet", _batch())
        assert muted.status_code == 403, muted.text
        assert muted.json()["error"]["code"] == "shadow_disabled"
        assert _shadow_billed(engine, ids["quiet"]) == (0, Decimal(0))
        with Session(engine) as s:
            assert s.exec(select(ShadowSample).where(col(ShadowSample.tenant_id) == ids["quiet"])).first() is None
    engine.dispose()


class _Tensors:
    """The cloud's tensor pool as the intake uses it: one model that predicts class 1 for every row."""

    def get(self, name: str) -> object | None:
        return object() if name == CLOUD_MODEL else None

    async def infer(self, model: object, rows: list[list[float]]) -> dict[str, Any]:
        return {"outputs": [[0.0, 1.0, 0.0] for _ in rows]}


class _Limiter:
    async def take_per_minute(self, what: str, ident: str, amount: int, limit: int) -> None:
        return None


def test_a_devices_replays_are_bounded_by_its_share_of_the_edge_work_it_reported(migrated_db: str) -> None:
    engine = create_db(migrated_db)
    with Session(engine) as s:
        tenant = create_tenant(s, "sampled")
        tenant.shadow_share = 0.5
        s.add(tenant)
        token = create_enrollment_token(s, tenant).secret
        device, _, _ = enroll(s, token, name="d", labels={}, agent_version="", runtime={})
        s.commit()
        device_id, tenant_id = device.id, tenant.id or 0
    _policy(engine)
    intake = ShadowIntake(engine, PriceBook(engine), _Limiter(), share_floor=10)  # type: ignore[arg-type]

    def report(rows: int) -> tuple[Device, Tenant]:
        """The device syncs one edge record of ``rows`` classifier rows."""
        with Session(engine) as s:
            d, t = s.get(Device, device_id), s.get(Tenant, tenant_id)
            assert d is not None and t is not None
            item = UsageItem(id=uuid.uuid4().hex, model=EDGE_MODEL, prompt_tokens=rows, occurred_at=time.time())
            ingest(s, d, [item], [])
            s.commit()
            s.refresh(d)
            s.refresh(t)
            s.expunge_all()
            return d, t

    def replay(d: Device, t: Tenant, batch: dict[str, Any]) -> Any:
        return asyncio.run(intake.answer(_Tensors(), d, t, ShadowRequest.model_validate(batch)))  # type: ignore[arg-type]

    d, t = report(20)  # 0.5 x 20 + 10: 20 rows may be replayed
    assert replay(d, t, _batch(12)).num_samples == 12
    over = _batch(12, "over-" + uuid.uuid4().hex[:12])
    with pytest.raises(RateLimitError) as refused:
        replay(d, t, over)
    assert refused.value.code == "shadow_share_exceeded"
    assert _shadow_billed(engine, tenant_id)[0] == 1
    d, t = report(20)  # 0.5 x 40 + 10: 30; the same batch now fits
    assert replay(d, t, over).num_samples == 12
    assert _shadow_billed(engine, tenant_id)[0] == 2
    engine.dispose()


class _RefusingLink:
    """A cloud link whose every shadow batch is refused for want of budget."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    async def shadow(self, batch: dict[str, Any]) -> int:
        self.sent.append(batch)
        return 429


def test_the_agent_does_not_loop_on_a_refused_batch() -> None:
    link = _RefusingLink()
    now = [0.0]
    sampler = ShadowSampler(lambda: link, lambda: 1.0, lambda m: 1, clock=lambda: now[0])  # type: ignore[arg-type,return-value]

    def offer() -> bool:
        return sampler.offer(EDGE_MODEL, CLOUD_MODEL, np.ones((2, 64)), np.tile([0.0, 1.0], (2, 1)), np.ones(2), 1.0)

    async def drained(refused: int) -> None:
        """Until the sampler heard ``refused`` refusals and emptied its queue (sending or dropping each batch)."""
        for _ in range(500):
            if sampler.stats.refused >= refused and sampler._queue.empty():
                await asyncio.sleep(0)  # the batch taken last is dropped or sent by now
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the sampler did not drain")

    async def run() -> None:
        await sampler.start()
        assert offer() and offer() and offer()  # queued before the first answer
        await drained(1)
        for _ in range(500):  # the two queued behind the refusal: dropped unsent
            if sampler.stats.dropped == 2:
                break
            await asyncio.sleep(0.01)
        assert len(link.sent) == 1 and sampler.stats.refused == 1  # the queued ones are not sent into the refusal
        assert sampler.is_paused and not offer()  # nothing is sampled while paused
        sampler.on_allowance(Allowance(remaining=Decimal(0), currency="USD", period="2026-12"))
        assert sampler.is_paused  # a sync that says the budget is still used up does not end the pause
        sampler.on_allowance(Allowance(remaining=Decimal("5"), currency="USD", period="2026-12"))
        assert not sampler.is_paused and offer()  # the allowance is back: sampling resumes
        await drained(2)
        assert len(link.sent) == 2 and sampler.is_paused  # refused again: paused again, for longer
        await sampler.close()

    asyncio.run(run())
    now[0] += 10_000.0  # a pause ends on its own, too (doubled each time, capped)
    assert not sampler.is_paused

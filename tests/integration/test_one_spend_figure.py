"""One spend figure (issue 40): with cloud, device and shadow records in the month, several of them sub-cent, the
tenant page, the billing page's month to date, the invoice draft (console preview and ``tierline billing
invoice``) and the ledger's own sum all show the same exact amount, each saying when it was read; the invoice's
total is that sum rounded once, its shadow replays are a ``shadow`` line, not usage. A real console server and
the real CLI, on SQLite and PostgreSQL."""

from __future__ import annotations

import html
import json
import re
import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_EVEN, Decimal
from pathlib import Path

import pytest
from sqlmodel import Session

from controlplane.billing.ledger import month_spend
from controlplane.billing.pricing import period_bounds, period_of
from controlplane.storage.session import session_scope
from controlplane.storage.tables import BudgetPeriod, UsageRecord
from controlplane.tenancy.service import create_tenant
from tests.conftest import base_env
from tests.integration.console_support import console_server

pytestmark = pytest.mark.integration

# (tier, cost, device): the cloud's own requests, a device's edge answers and escalations, shadow replays.
RECORDS = [
    ("cloud", "0.004", None),
    ("cloud", "0.004", None),
    ("cloud", "0.004", None),
    ("cloud", "0.012345", None),
    ("edge", "0.0021", "dev-1"),
    ("edge", "0.0021", "dev-1"),
    ("cloud", "0.003", "dev-1"),
    ("shadow", "0.0021", "dev-1"),
    ("shadow", "0.0021", "dev-1"),
]
# 0.035745 in all (0.04 rounded once), where the lines rounded one by one show 0.03 + 0.00 + 0.00.
EXACT = sum((Decimal(c) for _, c, _ in RECORDS), Decimal(0))


def _text(page: str) -> str:
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", page)).split())


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_every_page_the_invoice_and_the_ledger_show_one_spend_figure(tmp_path: Path, backend: str) -> None:
    now = datetime.now(UTC)
    period = period_of(now)
    start = period_bounds(period)[0]
    with console_server(tmp_path, backend) as console:
        with session_scope(console.engine) as s:
            tenant = create_tenant(s, "acme")
            tenant.monthly_budget = Decimal(100)
            s.add(tenant)
            s.flush()
            tid = tenant.id or 0
            for tier, cost, device in RECORDS:
                s.add(
                    UsageRecord(
                        id=uuid.uuid4().hex,
                        tenant_id=tid,
                        device_id=device,
                        model="acme/lm",
                        tier=tier,
                        prompt_tokens=10,
                        completion_tokens=5,
                        cost=Decimal(cost),
                        occurred_at=start + timedelta(seconds=1),
                    )
                )
            # Last month's usage is not this month's spend; the budget's counter trails the ledger (a cloud request
            # without a hold is not counted into it): neither may be shown as the month's spend.
            s.add(
                UsageRecord(
                    id=uuid.uuid4().hex,
                    tenant_id=tid,
                    model="acme/lm",
                    tier="cloud",
                    cost=Decimal("5"),
                    occurred_at=start - timedelta(days=1),
                )
            )
            s.add(BudgetPeriod(tenant_id=tid, period=period, spent=Decimal("0.01")))
        with Session(console.engine) as s:
            ledger = month_spend(s, tid, period)
        assert ledger.amount == EXACT and ledger.requests == len(RECORDS)
        shown = f"{EXACT} USD"  # 0.035745 USD: the ledger's precision, not 0.04
        rounded = EXACT.quantize(Decimal("0.01"), ROUND_HALF_EVEN)

        with console.signed_in("admin") as admin:
            tenant_page = admin.get("/tenants/acme")
            assert tenant_page.status_code == 200
            spent = re.search(r'<dd id="month-spend">(.*?)</dd>', tenant_page.text, re.S)
            assert spent is not None and shown in _text(spent.group(1))
            assert re.search(r"as of \d\d:\d\d:\d\d UTC", _text(spent.group(1)))
            # The budget's counter is shown only as what enforcement counted, labelled so.
            assert "Counted by the budget 0.01 USD" in _text(tenant_page.text)

            billing = admin.get("/billing")
            assert billing.status_code == 200
            mtd = re.search(r'<section class="card" id="month-to-date">(.*?)</section>', billing.text, re.S)
            assert mtd is not None
            assert f"acme {len(RECORDS)} {shown}" in _text(mtd.group(1))
            assert re.search(r"As of \d\d:\d\d:\d\d UTC", _text(mtd.group(1)))

            preview = admin.get(f"/billing/finalize?tenant=acme&month={period}")
            assert preview.status_code == 200
            usage = re.search(r'<dd id="usage-exact">(.*?)</dd>', preview.text, re.S)
            assert usage is not None and shown in _text(usage.group(1))
            page = _text(preview.text)
            assert f"Total {rounded} USD {shown} rounded once" in page
            assert re.search(r"As of \d\d:\d\d:\d\d UTC", page)
            kinds = re.findall(
                r'<td data-label="Kind">(\w+)(<br><small class="muted">[^<]*</small>)?</td>', preview.text
            )
            assert sorted(k for k, _ in kinds) == ["rounding", "shadow", "usage", "usage"]  # shadow is not usage
            assert "replays" in dict(kinds)["shadow"]  # and says what it is

        env = base_env(tmp_path, TIERLINE_DATABASE_URL=console.engine.url.render_as_string(hide_password=False))
        tierline = str(Path(sys.executable).with_name("tierline"))
        out = subprocess.run(
            [tierline, "billing", "invoice", "--tenant", "acme", "--month", period],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert out.returncode == 0, out.stderr
        draft = json.loads(out.stdout)
        assert Decimal(draft["usage_exact"]) == Decimal(draft["total_exact"]) == EXACT
        assert Decimal(draft["total"]) == rounded and draft["as_of"]
        # The lines add up to the total; the shadow replays are their own kind of line.
        assert sum((Decimal(ln["amount"]) for ln in draft["lines"]), Decimal(0)) == rounded
        shadow = [ln for ln in draft["lines"] if ln["kind"] == "shadow"]
        assert len(shadow) == 1 and shadow[0]["requests"] == 2 and "shadow replays" in shadow[0]["description"]

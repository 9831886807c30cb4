"""Invoices on SQLite and PostgreSQL: draft, finalize (locked, hashed, numbered, each record billed once), late
records as adjustments on the next invoice, void, credit notes; the CLI's one-line errors."""

from __future__ import annotations

import csv
import io
import json
import logging
import sys
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from sqlmodel import Session, col, select

from controlplane.billing import invoicing as billing
from controlplane.billing.ledger import NewUsage, ingest_usage
from controlplane.storage.database import create_db
from controlplane.storage.session import get_db
from controlplane.storage.tables import Invoice, InvoiceLine, UsageRecord
from controlplane.tenancy.service import create_tenant
from shared.errors import ConflictError, ValidationError
from tests.conftest import migrated_sqlite
from tierline.cli import main

pytestmark = [pytest.mark.integration, pytest.mark.postgres]

JAN = datetime(2026, 1, 1, tzinfo=UTC)
FEB = datetime(2026, 2, 1, tzinfo=UTC)
MAR = datetime(2026, 3, 1, tzinfo=UTC)


def usage(tenant_id: int, at: datetime, *, model: str = "acme/lm", version: int | None = 1, tier: str = "cloud",
          prompt: int = 1000, completion: int = 500) -> NewUsage:  # fmt: skip
    return NewUsage(
        id=uuid.uuid4().hex,
        tenant_id=tenant_id,
        model=model,
        model_version=version,
        tier=tier,
        occurred_at=at,
        prompt_tokens=prompt,
        completion_tokens=completion,
    )


def add_prices(session: Session) -> None:
    """acme/lm: 2.00 / 6.00 per Mtok from 2025; 4.00 / 12.00 from Feb 15 2026; the edge tier is cheaper."""
    for start, prompt, completion, tier in (
        (datetime(2025, 1, 1, tzinfo=UTC), "2.00", "6.00", None),
        (datetime(2026, 2, 15, tzinfo=UTC), "4.00", "12.00", None),
        (datetime(2025, 1, 1, tzinfo=UTC), "0.50", "1.50", "edge"),
    ):
        billing.add_price(
            session,
            billing.PriceSpec("acme/lm", Decimal(prompt), Decimal(completion), tier=tier, effective_from=start),
            actor="test",
        )


def test_an_invoice_bills_every_record_once_through_late_records_voids_and_credits(migrated_db: str) -> None:
    engine = create_db(migrated_db)
    with Session(engine, expire_on_commit=False) as s:
        add_prices(s)
        tenant = create_tenant(s, "acme")
        other = create_tenant(s, "globex")
        tid = tenant.id or 0
        jan = [usage(tid, JAN + timedelta(hours=3 * i)) for i in range(40)]  # 1000*2 + 500*6 = 0.005 each
        jan += [usage(tid, JAN + timedelta(days=2, hours=i), tier="edge") for i in range(7)]  # 0.00125 each
        jan += [usage(tid, JAN + timedelta(days=3), model="acme/unpriced") for _ in range(3)]
        jan += [usage(other.id or 0, JAN + timedelta(days=1))]  # another tenant's: never on acme's invoice
        ingest_usage(s, jan)
        s.commit()

        draft = billing.month_invoice(s, tenant, "2026-01")
        assert draft["status"] == "draft" and draft["number"] is None
        # 40 x 0.005 = 0.20 and 7 x 0.00125 = 0.00875 -> 0.01 (half-even per line); unpriced at 0, flagged.
        lines = {(ln["model"], ln["tier"]): ln for ln in draft["lines"]}
        assert lines[("acme/lm", "cloud")]["amount"] == "0.20" and lines[("acme/lm", "cloud")]["requests"] == 40
        assert lines[("acme/lm", "edge")]["amount"] == "0.01"
        assert lines[("acme/unpriced", "cloud")]["unpriced_records"] == 3
        assert lines[("acme/unpriced", "cloud")]["amount"] == "0.00"
        assert draft["total"] == "0.21" and draft["unpriced_records"] == 3
        assert sum(ln["requests"] for ln in draft["lines"]) == 50

        with pytest.raises(ValidationError, match="has not ended"):
            billing.finalize(s, tenant, datetime.now(UTC).strftime("%Y-%m"), actor="test")
        s.rollback()
        jan_invoice = billing.finalize(s, tenant, "2026-01", actor="test")
        s.commit()
        locked = billing.invoice_json(s, jan_invoice)
        assert locked["status"] == "finalized" and locked["number"] == jan_invoice.number
        assert locked["number"].startswith("INV-202601-")
        assert locked["lines"] == draft["lines"] and locked["total"] == draft["total"]
        assert locked["lines_hash"] == draft["lines_hash"] and locked["lines_verified"] is True
        stamped = s.exec(select(UsageRecord.id).where(UsageRecord.invoice_id == jan_invoice.id)).all()
        assert len(stamped) == 50
        with pytest.raises(ConflictError, match="already invoiced"):
            billing.finalize(s, tenant, "2026-01", actor="test")
        s.rollback()

        # A device that was offline delivers January usage in February: January stays as it was locked,
        # and the record lands on the next invoice (February's) as an adjustment line for January.
        late = usage(tid, JAN + timedelta(days=20), prompt=10_000, completion=10_000)  # 0.08
        feb = [usage(tid, FEB + timedelta(days=d)) for d in (1, 16)]  # before and after the price rise
        ingest_usage(s, [late, *feb])
        s.commit()
        assert billing.month_invoice(s, tenant, "2026-01")["total"] == "0.21"
        feb_invoice = billing.finalize(s, tenant, "2026-02", actor="test")
        s.commit()
        feb_view = billing.invoice_json(s, feb_invoice)
        kinds = {(ln["kind"], ln["usage_period"]): ln for ln in feb_view["lines"]}
        assert kinds[("adjustment", "2026-01")]["amount"] == "0.08"
        # 0.005 before Feb 15 + 0.010 after: the price rise did not rewrite the earlier record. Each price is a
        # line of its own, rounded once (half-even): 0.005 -> 0.00, 0.010 -> 0.01.
        feb_lines = sorted((ln for ln in feb_view["lines"] if ln["kind"] == "usage"), key=lambda ln: ln["amount"])
        assert [(ln["requests"], ln["amount"]) for ln in feb_lines] == [(1, "0.00"), (1, "0.01")]
        assert "from 2026-02-15" in feb_lines[1]["description"] and "plan default" in feb_lines[1]["description"]
        # The total is the exact sum rounded once: 0.005 + 0.010 + 0.08 = 0.095 -> 0.10 (half-even), where the
        # lines rounded one by one add up to 0.09; the difference is a rounding line, so the lines still add up.
        assert (feb_view["subtotal"], feb_view["adjustments"], feb_view["total"]) == ("0.01", "0.08", "0.10")
        assert feb_view["rounding"] == "0.01" and feb_view["total_exact"] == "0.095000"
        assert kinds[("rounding", "2026-02")]["amount"] == "0.01"
        assert feb_view["lines_verified"] is True

        # Credit notes: at most what is left; the invoice itself never changes.
        note = billing.credit(s, jan_invoice.number or "", "0.15", reason="goodwill", actor="test")
        s.commit()
        assert note.number.startswith("CN-202601-")
        with pytest.raises(ValidationError, match="left to credit"):
            billing.credit(s, jan_invoice.number or "", "0.07", reason="too much", actor="test")
        s.rollback()
        with pytest.raises(ValidationError, match="at most 2 decimals"):
            billing.credit(s, jan_invoice.number or "", "0.001", reason="dust", actor="test")
        s.rollback()
        after = billing.invoice_json(s, jan_invoice)
        assert (after["total"], after["credits"], after["balance"]) == ("0.21", "0.15", "0.06")
        assert after["lines_hash"] == locked["lines_hash"]

        # Voiding January unbills its 50 records; re-issuing bills exactly them again (the late record stays
        # on February's invoice).
        billing.void(s, jan_invoice.number or "", reason="wrong tenant address", actor="test")
        s.commit()
        assert s.exec(select(UsageRecord.id).where(UsageRecord.invoice_id == jan_invoice.id)).all() == []
        with pytest.raises(ConflictError, match="void"):
            billing.credit(s, jan_invoice.number or "", "0.01", reason="x", actor="test")
        s.rollback()
        reissued = billing.finalize(s, tenant, "2026-01", actor="test")
        s.commit()
        assert reissued.number != jan_invoice.number
        assert billing.invoice_json(s, reissued)["total"] == "0.21"
        billed = s.exec(select(UsageRecord.invoice_id).where(UsageRecord.tenant_id == tid)).all()
        assert len(billed) == 53 and None not in billed
        assert [i.status for i in billing.list_invoices(s, tenant)] == ["finalized", "finalized", "void"]

        # The stored lines are what the hash covers: tampering with one shows.
        line = s.exec(select(InvoiceLine).where(InvoiceLine.invoice_id == reissued.id)).first()
        assert line is not None
        line.amount = line.amount + Decimal("0.01")
        s.add(line)
        s.commit()
        assert billing.invoice_json(s, reissued)["lines_verified"] is False
    engine.dispose()


def test_a_price_in_another_currency_is_refused_at_finalize(migrated_db: str) -> None:
    engine = create_db(migrated_db)
    with Session(engine, expire_on_commit=False) as s:
        billing.add_price(
            s,
            billing.PriceSpec("acme/lm", Decimal(1), Decimal(1), currency="eur", effective_from=JAN),
            actor="test",
        )
        tenant = create_tenant(s, "acme")
        ingest_usage(s, [usage(tenant.id or 0, JAN + timedelta(days=1))])
        s.commit()
        with pytest.raises(ConflictError, match="rated in EUR"):
            billing.finalize(s, tenant, "2026-01", actor="test")
        s.rollback()
        assert s.exec(select(Invoice)).all() == []
        assert s.exec(select(UsageRecord.invoice_id)).all() == [None]
    engine.dispose()


def test_the_cli_invoices_exports_and_refuses_bad_input_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    migrated_db = migrated_sqlite(tmp_path)  # the CLI runs the same service code on either database
    engine = create_db(migrated_db)
    with Session(engine) as s:
        add_prices(s)
        tenant = create_tenant(s, "acme")
        ingest_usage(s, [usage(tenant.id or 0, JAN + timedelta(days=d)) for d in range(10)])
        s.commit()
    monkeypatch.setenv("TIERLINE_DATABASE_URL", migrated_db)
    monkeypatch.setenv("TIERLINE_DATA_DIR", str(tmp_path))

    root = logging.getLogger()

    def cli(*args: str) -> tuple[int, str, str]:
        """``tierline ARGS`` through its real entry point (one-line errors, exit codes), in this process."""
        monkeypatch.setattr(sys, "argv", ["tierline", *args])
        handlers, level = root.handlers[:], root.level
        code = 0
        try:
            main()
        except SystemExit as exc:
            code = int(exc.code or 0)
        finally:  # the CLI points root logging at this test's captured stderr; later tests must not log there
            root.handlers[:] = handlers
            root.setLevel(level)
        out = capsys.readouterr()
        return code, out.out, out.err

    code, out, err = cli("billing", "invoice", "--tenant", "acme", "--month", "2026-01", "--finalize")
    assert code == 0, err
    invoice = json.loads(out)
    assert invoice["status"] == "finalized" and invoice["total"] == "0.05"
    _, exported, _ = cli("billing", "invoice", "--tenant", "acme", "--month", "2026-01", "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(exported)))
    assert rows[0]["model"] == "acme/lm" and rows[0]["requests"] == "10" and rows[0]["amount"] == "0.05"
    assert {r["kind"]: r["amount"] for r in rows[1:]}["total"] == "0.05"
    code, out, err = cli("billing", "credit", invoice["number"], "--amount", "0.02", "--reason", "outage")
    assert code == 0 and "CN-202601-" in out, err
    for args, needle in (
        (("billing", "invoice", "--tenant", "acme", "--month", "2026-1x"), "'2026-1x' is not a month"),
        (("billing", "invoice", "--tenant", "nobody", "--month", "2026-01"), "no tenant 'nobody'"),
        (("billing", "invoice", "--tenant", "acme", "--month", "2026-01", "--finalize"), "already invoiced"),
        (("billing", "credit", invoice["number"], "--amount", "1", "--reason", "x"), "left to credit (0.03)"),
        (("billing", "credit", invoice["number"], "--amount", "x", "--reason", "x"), "'x' is not an amount"),
        (("billing", "void", "INV-000", "--reason", "x"), "no invoice 'INV-000'"),
    ):
        code, _, err = cli(*args)
        assert code != 0 and needle in err, (args, err)
        assert "Traceback" not in err
        if code == 1:  # an application error: one line, no usage text
            assert len(err.strip().splitlines()) == 1, err
    code, _, err = cli("billing", "void", invoice["number"], "--reason", "re-issue")
    assert code == 0, err
    with Session(engine) as s:
        assert s.exec(select(UsageRecord).where(col(UsageRecord.invoice_id).is_not(None))).all() == []
    engine.dispose()
    get_db().dispose()


def test_racing_finalizers_of_one_month_issue_one_invoice(migrated_db: str) -> None:
    engine = create_db(migrated_db)
    with Session(engine, expire_on_commit=False) as s:
        add_prices(s)
        tenant = create_tenant(s, "acme")
        ingest_usage(s, [usage(tenant.id or 0, JAN + timedelta(hours=h)) for h in range(100)])
        s.commit()
    start = threading.Barrier(4)

    def finalize() -> str:
        start.wait()
        try:
            with Session(engine, expire_on_commit=False) as s:
                invoice = billing.finalize(s, tenant, "2026-01", actor="test")
                s.commit()
                return invoice.number or ""
        except ConflictError:
            return "conflict"

    with ThreadPoolExecutor(4) as pool:
        outcomes = list(pool.map(lambda _: finalize(), range(4)))
    assert outcomes.count("conflict") == 3 and any(o.startswith("INV-202601-") for o in outcomes), outcomes
    with Session(engine) as s:
        assert len(s.exec(select(Invoice)).all()) == 1
        assert None not in s.exec(select(UsageRecord.invoice_id)).all()
        assert len(s.exec(select(InvoiceLine)).all()) == 1
    engine.dispose()

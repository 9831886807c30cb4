"""The console in a real browser: Debian's headless Chromium driven by Playwright (never a browser download).

``tierline console create-admin`` and ``tierline console serve`` run as processes on a fresh SQLite database; the
browser signs in, creates a tenant and an API key (seen once, copied), searches tenants as it types (HTMX), uploads
two versions of a model through the upload form, creates a rollout of them and starts it (pending → running, its
live part refreshing), opens billing, and looks at a tenant at phone width. No page may log a console error or a
Content-Security-Policy violation. A screenshot of each page is saved under ``$TIERLINE_TEST_ARTIFACTS_DIR``
(default ``<repo>/test-artifacts/console/``).
"""

from __future__ import annotations

import os
import uuid
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import REPO, base_env, free_port, migrated_sqlite, run_server
from tests.forkserver import run_tierline

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking"]
PASSWORD = "a long browser password"


def _artifacts() -> Path:
    out = Path(os.environ.get("TIERLINE_TEST_ARTIFACTS_DIR") or REPO / "test-artifacts" / "console")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _calibrated_policy(directory: Path) -> None:
    """A policy as ``tierline edge calibrate`` writes it, with its quality-vs-edge-share curve."""
    from shared.calibration import curve_points
    from shared.escalation import EdgePolicy, save_policy

    rng = np.random.default_rng(0)
    confidence = rng.normal(size=400)
    edge_good = (rng.random(400) < 1 / (1 + np.exp(-2 * confidence))).astype(float)  # confident: more often right
    cloud_good = (rng.random(400) < 0.85).astype(float)
    curve = curve_points(confidence, edge_good, cloud_good)
    chosen = curve[len(curve) // 3]
    calibration = {
        "curve": curve,
        "edge_share": chosen["edge_share"],
        "quality": chosen["quality"],
        "cloud_only_quality": float(cloud_good.mean()),
        "max_quality_loss": 0.05,
        "num_items": 400,
        "calibrated_at": "2026-11-30T12:00:00+00:00",
    }
    threshold = chosen["threshold"] if chosen["threshold"] is not None else 0.0
    save_policy(directory, EdgePolicy(model="tierline/tiny-chat", threshold=threshold, calibration=calibration))


def _january_usage(db_url: str, tenant: str) -> None:
    """Two cloud requests of ``tenant`` in January 2026 (2.00 USD), to invoice."""
    from sqlmodel import select

    from controlplane.storage.database import create_db
    from controlplane.storage.session import session_scope
    from controlplane.storage.tables import Tenant, UsageRecord

    engine = create_db(db_url)
    try:
        with session_scope(engine) as session:
            tenant_id = session.exec(select(Tenant.id).where(Tenant.name == tenant)).one()
            for _ in range(2):
                session.add(
                    UsageRecord(
                        id=uuid.uuid4().hex,
                        tenant_id=tenant_id or 0,
                        model="tiny-chat",
                        tier="cloud",
                        prompt_tokens=100,
                        completion_tokens=10,
                        cost=Decimal("1.00"),
                        occurred_at=datetime(2026, 1, 15, tzinfo=UTC),
                    )
                )
    finally:
        engine.dispose()


@pytest.mark.skipif(
    not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium (apt-get install -y chromium)"
)
def test_console_in_headless_chromium(tmp_path: Path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs Playwright for Python")
    shots = _artifacts()
    db_url = migrated_sqlite(tmp_path)
    env = base_env(tmp_path, TIERLINE_DATABASE_URL=db_url)
    run_tierline(
        "console",
        "create-admin",
        "--username",
        "ops",
        "--password-stdin",
        env=env,
        input=f"{PASSWORD}\n",
        timeout=60,
        check=True,
    )
    _calibrated_policy(tmp_path / "edge" / "policies")  # where `tierline up`'s agent keeps them
    tenant = f"browser-{uuid.uuid4().hex[:6]}"
    problems: list[str] = []

    with run_server(["console", "serve"], env, free_port()) as base, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 900}, base_url=base)
            context.grant_permissions(["clipboard-read", "clipboard-write"], origin=base)
            page = context.new_page()
            page.set_default_timeout(10_000)
            page.on(
                "console",
                lambda msg: (
                    problems.append(f"console {msg.type}: {msg.text}") if msg.type in ("error", "warning") else None
                ),
            )
            page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
            page.add_init_script(
                "document.addEventListener('securitypolicyviolation', e => "
                "console.error('CSP violation: ' + e.violatedDirective + ' ' + e.blockedURI));"
            )

            def shot(name: str) -> None:
                page.screenshot(path=str(shots / f"{name}.png"), full_page=True)

            # Signing in: the overview asks for a session first.
            page.goto("/")
            assert page.url.endswith("/login?next=%2F")
            shot("01-login")
            page.fill("#username", "ops")
            page.fill("#password", PASSWORD)
            page.click("button[type=submit]")
            page.wait_for_url(f"{base}/")
            assert page.locator("h1").inner_text() == "Overview"
            assert page.locator(".tile").count() == 4
            shot("02-overview")

            # A tenant, then a key for it: shown once, copied with the button.
            page.click("text=Tenants")
            page.click("text=New tenant")
            page.fill("#f-name", tenant)
            page.fill("#f-monthly_budget", "250")
            page.click("button:has-text('Create tenant')")
            page.wait_for_url(f"{base}/tenants/{tenant}")
            shot("03-tenant")
            page.fill("#key-name", "production")
            page.click("button:has-text('Create key')")
            secret = page.input_value("#new-secret")
            assert secret.startswith("tl-") and len(secret) > 40
            page.click("button[data-copy]")
            page.wait_for_selector("button[data-copy]:has-text('Copied')")
            assert page.evaluate("navigator.clipboard.readText()") == secret
            shot("04-key-shown-once")
            page.goto(f"/keys?tenant={tenant}")
            assert secret not in page.content() and "production" in page.content()

            # Search as you type: HTMX swaps the rows in without reloading the page.
            page.goto("/tenants")
            marker = page.evaluate("window.__stay = Math.random()")
            with page.expect_response(
                lambda r: "/tenants?q=" in r.url and r.request.headers.get("hx-request") == "true"
            ):
                page.fill("#q", tenant[:12])
            page.wait_for_selector(f"#tenant-rows a:has-text('{tenant}')")
            assert page.evaluate("window.__stay") == marker  # the same document: a partial swap
            shot("05-tenant-search")

            # Two versions of a model, each uploaded through the form (multipart, through htmx).
            page.goto("/models")
            # A bad name comes back under its field (htmx swaps the 400's form in; the rest of the page stays).
            page.click("summary:has-text('Upload a version')")
            page.fill("#u-name", "no spaces allowed")
            page.set_input_files(
                "#u-file", files=[{"name": "model.onnx", "mimeType": "application/octet-stream", "buffer": b"x"}]
            )
            page.click("button:has-text('Upload version')")
            page.wait_for_selector("#u-e-name")
            assert page.input_value("#u-name") == "no spaces allowed"
            # Chromium reports the deliberate 400 itself; nothing else may show up.
            problems[:] = [p for p in problems if "status of 400" not in p]
            page.goto("/models")
            for number in (1, 2):
                page.click("summary:has-text('Upload a version')")
                page.fill("#u-name", "tiny-chat")
                page.fill("#u-label", f"build-{number}")
                page.set_input_files(
                    "#u-file",
                    files=[
                        {"name": "model.onnx", "mimeType": "application/octet-stream", "buffer": bytes([number]) * 4096}
                    ],
                )
                if number == 1:
                    shot("06-model-upload-form")
                with page.expect_navigation(url=f"**/models/tiny-chat#v{number}"):
                    page.click("button:has-text('Upload version')")
                if number == 1:
                    page.goto("/models")
            assert page.locator("article.version").count() == 2 and "upload by console:ops" in page.content()
            assert page.locator("code.hash").first.inner_text() != ""
            # The calibrated escalation curve of tierline/tiny-chat: quality against edge share, the chosen point.
            assert page.locator("#escalation svg.curve polyline").count() == 1
            assert page.locator("#escalation svg.curve circle.chosen").count() == 1
            shot("07-model-versions")

            # Rollouts: create one of the two versions, start it now, watch its live part poll every 5 s.
            page.click("text=Rollouts")
            assert "No rollouts yet" in page.content()
            page.click("text=New rollout")
            page.fill("#f-model", "tiny-chat")
            page.fill("#f-baseline_version", "1")
            page.fill("#f-candidate_version", "2")
            page.click("button:has-text('Create rollout')")
            page.wait_for_url("**/rollouts/*")
            assert page.locator("#rollout-live .status").first.inner_text() == "pending"
            page.click("button:has-text('Start now')")
            page.wait_for_selector("#rollout-live .status.s-running")
            with page.expect_response(lambda r: r.url.endswith("/live"), timeout=9000) as polled:
                pass
            assert polled.value.status == 200
            assert page.locator("#rollout-live .status").first.inner_text() == "running"
            shot("08-rollout-running")

            # Billing: finalize the tenant's January, credit part of it, then void it (after confirming).
            _january_usage(db_url, tenant)
            page.goto("/billing")
            shot("09-billing")
            page.goto(f"/billing/finalize?tenant={tenant}&month=2026-01")
            page.click("button:has-text('Finalize 2026-01')")
            page.wait_for_url("**/billing/invoices/*")
            page.fill("#f-amount", "9")
            page.fill("#f-reason", "goodwill")
            page.click("button:has-text('Issue credit note')")
            page.wait_for_selector("#e-amount:has-text('more than what is left')")  # a plain form: a 400 page
            problems[:] = [p for p in problems if "status of 400" not in p]
            page.fill("#f-amount", "0.50")
            page.click("button:has-text('Issue credit note')")
            page.wait_for_selector("#credit-notes li:has-text('0.50 USD — goodwill')")
            shot("10-invoice-credited")
            page.click("text=Void…")
            page.fill("#reason", "billed twice")
            page.click("button:has-text('Void invoice')")
            page.wait_for_selector(".status.s-void")
            assert "billed twice" in page.content()

            # Money: a budget for each end user of the tenant, set through its form.
            page.goto(f"/tenants/{tenant}/money")
            page.select_option("#b-scope", "user")
            page.fill("#b-ref", "*")
            page.select_option("#b-period", "day")
            page.fill("#b-amount", "0.50")
            page.click("button:has-text('Set budget')")
            page.wait_for_selector("td:has-text(\"the daily budget of end user '*'\")")
            shot("10b-money")

            for path, name in (
                ("/fleet", "11-fleet"),
                ("/billing", "12-billing"),
                ("/audit", "13-audit"),
            ):
                assert page.goto(path).status == 200
                shot(name)
            audit = page.content()
            actions = (
                "tenant.create",
                "api_key.create",
                "model.artifact.add",
                "rollout.resume",
                "invoice.void",
                "budget.set",
            )
            assert all(a in audit for a in actions), audit

            # Phone width: still readable (tables stack), nothing wider than the screen.
            page.set_viewport_size({"width": 390, "height": 844})
            for path, name in (
                (f"/tenants/{tenant}", "14-tenant-phone"),
                ("/models/tiny-chat", "15-model-phone"),
                (f"/tenants/{tenant}/money", "16-money-phone"),
            ):
                page.goto(path)
                overflow: Any = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
                assert overflow <= 0, f"{path} is {overflow}px wider than a phone"
                shot(name)
        finally:
            browser.close()

    assert problems == [], "\n".join(problems)

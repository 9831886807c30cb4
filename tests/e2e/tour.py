"""The tour's first steps on a running connected ``tierline up`` (called from test_up_connected.py, which starts
it once): ``tierline demo traffic --duration 20``, then the cloud ledger, the fleet and the console's overview
in a real browser (Debian's Chromium through Playwright, as test_console_browser.py drives it).

Screenshots go to ``$TIERLINE_TEST_ARTIFACTS_DIR/tour-tiny`` (default ``<repo>/test-artifacts/tour-tiny/``).
docs/tour.md's are the demo zoo's: test_demo_acceptance.py writes them (to ``.../tour/``, and to ``docs/tour/`` with
``TIERLINE_TOUR_SCREENSHOTS=1``).
"""

from __future__ import annotations

import json
import os
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine
from sqlmodel import Session, col, select

from controlplane.billing.pricing import Tokens, cost
from controlplane.storage.tables import Device, Price, UsageRecord
from tests.conftest import REPO
from tests.e2e.promise import lm_policy_keeps_its_promise
from tests.forkserver import run_tierline

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking"]
TOUR_DOCS = REPO / "docs" / "tour"


def sign_in(page: Any, base: str, info: dict[str, Any]) -> None:
    """Sign in to the console of ``tierline up`` (its up.json ``info``) as its admin; on the overview after."""
    page.goto("/login")
    page.fill("#username", info["console_admin"])
    page.fill("#password", info["console_admin_password"])
    page.click("button[type=submit]")
    page.wait_for_url(f"{base}/")


def _shot_dirs(*, docs: bool = False) -> list[Path]:
    """Where screenshots go: the test's artifacts, and ``docs/tour/`` for a ``docs`` run with
    ``TIERLINE_TOUR_SCREENSHOTS=1``."""
    base = Path(os.environ.get("TIERLINE_TEST_ARTIFACTS_DIR") or REPO / "test-artifacts")
    dirs = [base / ("tour" if docs else "tour-tiny")]
    if docs and os.environ.get("TIERLINE_TOUR_SCREENSHOTS") == "1":
        dirs.append(TOUR_DOCS)
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    return dirs


def _ledger(db: str, since: datetime) -> tuple[list[UsageRecord], dict[int, Price]]:
    engine = create_engine(db)
    try:
        with Session(engine) as s:
            rows = list(s.exec(select(UsageRecord).where(col(UsageRecord.ingested_at) >= since)))
            prices = {p.id: p for p in s.exec(select(Price)) if p.id is not None}
    finally:
        engine.dispose()
    return rows, prices


def demo_traffic_reaches_ledger_and_console(env: dict[str, str], info: dict[str, Any], db: str, device: str) -> None:
    since = datetime.now(UTC)
    proc = run_tierline("demo", "traffic", "--duration", "20", "--rate", "2/s", "--json", env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    print("demo traffic:", json.dumps(summary))
    assert summary["errors"] == {} and summary["sent"] >= 10, summary
    assert summary["answered"] == summary["sent"]
    assert summary["tiers"]["edge"]["requests"] > 0 and summary["tiers"]["cloud"]["requests"] > 0, summary
    assert summary["escalation_reasons"], summary
    assert set(summary["by_kind"]) == {"easy", "hard", "digits"}, summary
    assert "sent " in proc.stderr and "p95" in proc.stderr  # the progress line (plain, as stderr is no TTY)

    # The cloud's ledger: the device's own answers (at its next sync) and the escalations, with their reasons,
    # each rated with the demo price book (edge tokens cheaper than cloud tokens).
    escalated = sum(summary["escalation_reasons"].values())
    deadline = time.monotonic() + 60
    while True:
        rows, prices = _ledger(db, since)
        edge = [r for r in rows if r.tier == "edge" and r.device_id == device]
        cloud = [r for r in rows if r.tier == "cloud" and r.escalation_reason]
        if len(edge) >= summary["tiers"]["edge"]["requests"] and len(cloud) >= escalated:
            break
        assert time.monotonic() < deadline, f"ledger: {len(edge)} edge, {len(cloud)} escalated rows; {summary}"
        time.sleep(1.0)
    assert {r.escalation_reason for r in cloud} == set(summary["escalation_reasons"])
    assert all(r.device_id == device for r in cloud)
    assert {r.model for r in cloud} >= {"tierline/lm-cloud"}
    for r in rows:
        assert r.price_id is not None, f"unpriced usage {r.id} ({r.model}, {r.tier})"
        price = prices[r.price_id]
        # The quality monitor's shadow work is rated at a shadow price of its model, else at the cloud's own.
        tiers = ("shadow", "cloud") if r.tier == "shadow" else (r.tier,)
        assert price.model == r.model and price.tier in tiers, (r.model, r.tier, price.model, price.tier)
        assert r.cost == cost(price, Tokens(r.prompt_tokens, r.completion_tokens, r.cached_prompt_tokens))
    print("lm policy live:", json.dumps(lm_policy_keeps_its_promise(env, summary)))
    edge_price = next(p for p in prices.values() if p.model == "tierline/lm-edge-onnx-int8")
    cloud_price = next(p for p in prices.values() if p.model == "tierline/lm-cloud")
    assert edge_price.completion_per_mtok < cloud_price.completion_per_mtok

    _console(env, info, db, device)


def _console(env: dict[str, str], info: dict[str, Any], db: str, device: str) -> None:
    from playwright import sync_api

    assert CHROMIUM.exists(), "needs Debian's chromium at /usr/bin/chromium"
    dirs = _shot_dirs()
    base = info["console_url"]
    problems: list[str] = []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_context(viewport={"width": 1280, "height": 900}, base_url=base).new_page()
            page.set_default_timeout(15_000)
            page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
            page.on("console", lambda m: problems.append(f"console: {m.text}") if m.type == "error" else None)

            def shot(name: str) -> None:
                for d in dirs:
                    page.screenshot(path=str(d / f"{name}.png"), full_page=True)

            sign_in(page, base, info)
            tile = page.locator(".tile:has(.label:text-is('Answered on the edge')) .value")
            share = float(tile.inner_text().rstrip(" %"))
            assert share > 0, f"the overview shows {share} % answered on the edge"
            assert page.locator("#overview-stats td:text-is('edge')").count() == 1
            assert page.locator("#overview-stats td:text-is('cloud')").count() == 1
            shot("01-overview")

            # The device: desired == actual for every model and policy it is sent (within a sync or two).
            deadline = time.monotonic() + 60
            while True:
                page.goto(f"/fleet?q={device}")
                devices = page.locator("section.card", has=page.locator("h2:text-is('Devices')"))
                row = devices.locator("tbody tr", has=page.locator(f"code:text-is('{device}')"))
                synced = row.locator(".desired-actual .model, .desired-actual .policy").count()
                behind = row.locator(".out-of-sync").count()
                if synced > 0 and behind == 0:
                    break
                assert time.monotonic() < deadline, f"device {device}: {behind} of {synced} out of sync"
                time.sleep(2)
            assert "ring=dev" in row.inner_text()
            # The device's own page, linked from its row: the same desired == actual, its facts and its usage.
            row.locator("a.device-link").click()
            page.wait_for_url(f"{base}/tenants/demo/devices/{device}")
            assert page.locator("#desired-actual .out-of-sync").count() == 0
            assert page.locator("#desired-actual tr.model, #desired-actual tr.policy").count() == synced
            assert page.locator("#device-state .tag:text-is('ring=dev')").count() == 1
            assert page.locator("#device-facts dt:text-is('device.bucket')").count() == 1
            usage = page.locator("#recent-usage")
            edge = int(usage.locator("dt:text-is('Answered on the edge') + dd").inner_text().split()[0])
            cloud = int(usage.locator("dt:text-is('Escalated to the cloud') + dd").inner_text())
            assert edge > 0 and cloud > 0, f"the device page shows {edge} edge and {cloud} cloud requests"
            assert usage.locator("dt:text-is('Escalation reasons') + dd .tag").count() >= 1
            if page.locator("#runtime-choice").count():  # when the agent reports its runtime choice
                assert page.locator("#runtime-choice h3 code").count() >= 1
            shot("02-device")

            page.goto("/models/lm-edge")
            assert page.locator("#escalation svg.curve polyline").count() >= 1
            shot("03-model-policy")

            rollout = _canary(env, info, db, device)
            page.goto(f"/rollouts/{rollout}")
            assert page.locator("#rollout-live .status").first.inner_text() == "running"
            assert "20" in page.locator("#rollout-live").inner_text()
            shot("05-canary-running")
            _cli(env, "rollouts", "promote", str(rollout), "--reason", "the tour: candidate looks good")
            page.goto(f"/rollouts/{rollout}")
            assert page.locator("#rollout-live .status").first.inner_text() == "promoted"
            shot("06-canary-promoted")
            # Desired == actual for the promoted model too (it had no desired version before the first publish).
            candidate = _device_version(db, device, "lm-edge-onnx-int8")
            page.goto(f"/fleet?q={device}")
            promoted = page.locator(".desired-actual .model", has=page.locator("small:text-is('lm-edge-onnx-int8')"))
            assert promoted.locator("code").all_inner_texts() == [candidate, candidate]
            assert page.locator(".desired-actual .out-of-sync").count() == 0

            month = datetime.now(UTC).strftime("%Y-%m")
            draft = json.loads(_cli(env, "billing", "invoice", "--tenant", "demo", "--month", month))
            assert draft["lines"] and "tierline/lm-cloud" in json.dumps(draft["lines"]), draft
            assert draft["unpriced_records"] == 0, draft
            page.goto(f"/billing/finalize?tenant=demo&month={month}")
            assert page.locator("h2:text-is('Draft for demo, " + month + "')").count() == 1
            assert page.locator("td[data-label='Kind']").count() == len(draft["lines"])  # the preview lists its lines
            shot("07-invoice-preview")
        finally:
            browser.close()
    assert problems == [], "\n".join(problems)


def _cli(env: dict[str, str], *args: str) -> str:
    proc = run_tierline(*args, env=env, timeout=180)
    assert proc.returncode == 0, f"tierline {' '.join(args)}: {proc.stderr}"
    print(f"$ tierline {' '.join(args)}\n{proc.stdout.strip()}")
    return proc.stdout


def _device_version(db: str, device: str, name: str) -> str | None:
    engine = create_engine(db)
    try:
        with Session(engine) as s:
            row = s.exec(select(Device).where(Device.id == device)).one()
            return (row.versions or {}).get(f"tierline/{name}")
    finally:
        engine.dispose()


def _canary(env: dict[str, str], info: dict[str, Any], db: str, device: str) -> int:
    """The tour's release steps: publish what the device runs as the baseline, create a rollout to 20 % of the
    fleet, publish the candidate, hold the (only) local device on the candidate, start it; the device installs
    the candidate at a sync. Returns the rollout's id."""
    artifact = str(Path(info["zoo"]) / "artifacts" / "lm-edge-onnx-int8")
    baseline = _device_version(db, device, "lm-edge-onnx-int8")
    assert baseline, "the device reports no lm-edge-onnx-int8 version"
    candidate = f"{baseline}-tour"
    _cli(env, "cloud", "publish", artifact)
    created = _cli(
        env,
        "rollouts",
        "create",
        "--model",
        "lm-edge-onnx-int8",
        "--baseline",
        baseline,
        "--candidate",
        candidate,
        "--scope",
        "edge",
        "--steps",
        "20,100",
        "--min-step-s",
        "60",
        "--min-samples",
        "20",
    )
    rollout = int(created.split("created rollout ", 1)[1].split(":", 1)[0])
    _cli(env, "cloud", "publish", artifact, "--as-version", candidate)
    _cli(env, "rollouts", "pin", str(rollout), "--device", device, "--arm", "candidate")
    if "pending" in _cli(env, "rollouts", "get", str(rollout)).splitlines()[0]:  # else the controller started it
        # The controller may start it between the read and the resume; then resume refuses, and that is fine.
        proc = run_tierline("rollouts", "resume", str(rollout), env=env, timeout=180)
        assert proc.returncode == 0 or f"rollout {rollout} is running" in proc.stderr, proc.stderr
    deadline = time.monotonic() + 90
    while _device_version(db, device, "lm-edge-onnx-int8") != candidate:
        assert time.monotonic() < deadline, f"the device never installed {candidate}"
        time.sleep(1.0)
    _cli(env, "demo", "traffic", "--duration", "8", "--mix", "easy=1")
    # The other way to a 20 % canary: a plain release targeted at a sticky fifth of the fleet.
    targeted = _cli(
        env, "devices", "target-release", "lm-edge-onnx-int8", f"{baseline}-fifth", "--target", "device.bucket<=19"
    )
    assert "device.bucket<=19" in targeted
    shown = _cli(env, "rollouts", "get", str(rollout))
    assert "running" in shown and candidate in shown
    return rollout

"""The console in a real browser: Debian's headless Chromium driven by Playwright (never a browser download).

``tierline console create-admin`` and ``tierline console serve`` run as processes on a fresh SQLite database; the
browser signs in, creates a tenant and an API key (seen once, copied), searches tenants as it types (HTMX), creates
two versions of a model, a rollout of them and watches its live part refresh, opens billing, and looks at a
tenant at phone width. No page may log a console error or a Content-Security-Policy violation. A screenshot of
each page is saved under ``$TIERLINE_TEST_ARTIFACTS`` (default: the test's temporary directory).
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, base_env, free_port, migrated_sqlite, run_server, tierline_cmd

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking"]
PASSWORD = "a long browser password"


def _artifacts(tmp_path: Path) -> Path:
    root = Path(os.environ.get("TIERLINE_TEST_ARTIFACTS", tmp_path))
    out = root / "console-browser"
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.mark.skipif(
    not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium (apt-get install -y chromium)"
)
def test_console_in_headless_chromium(tmp_path: Path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs Playwright for Python")
    shots = _artifacts(tmp_path)
    db_url = migrated_sqlite(tmp_path)
    env = base_env(tmp_path, TIERLINE_DATABASE_URL=db_url)
    subprocess.run(
        tierline_cmd("console", "create-admin", "--username", "ops", "--password-stdin"),
        input=f"{PASSWORD}\n",
        env=env,
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
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

            # Two versions of a model, the second derived from the first.
            for label in ("base", "int8"):
                page.goto("/models")
                page.click("summary:has-text('Register a version')")
                page.fill("#f-name", "tiny-chat")
                page.fill("#f-label", label)
                if label == "int8":
                    page.fill("#f-derived_from", "1")
                page.click("button:has-text('Register version')")
                page.wait_for_url("**/models/tiny-chat#v*")
            assert "derived from" in page.content()
            shot("06-model-versions")

            # Rollouts: the page opens, a rollout is created, its live part polls every 5 s.
            page.click("text=Rollouts")
            assert "No rollouts yet" in page.content()
            page.click("text=New rollout")
            page.fill("#f-model", "tiny-chat")
            page.fill("#f-baseline_version", "1")
            page.fill("#f-candidate_version", "2")
            page.click("button:has-text('Create rollout')")
            page.wait_for_url("**/rollouts/*")
            with page.expect_response(lambda r: r.url.endswith("/live"), timeout=9000) as polled:
                pass
            assert polled.value.status == 200
            shot("07-rollout")

            for path, name in (
                ("/fleet", "08-fleet"),
                ("/billing", "09-billing"),
                ("/audit", "10-audit"),
            ):
                assert page.goto(path).status == 200
                shot(name)
            assert "tenant.create" in page.content() and "api_key.create" in page.content()

            # Phone width: still readable (tables stack), nothing wider than the screen.
            page.set_viewport_size({"width": 390, "height": 844})
            page.goto(f"/tenants/{tenant}")
            overflow: Any = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
            assert overflow <= 0, f"page is {overflow}px wider than a phone"
            shot("11-tenant-phone")
        finally:
            browser.close()

    assert problems == [], "\n".join(problems)

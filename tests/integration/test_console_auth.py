"""Console sign-in and what guards every change, against a real ``tierline console serve`` on SQLite and
PostgreSQL: sessions, cookie flags, CSRF, roles, login rate limiting, security headers, the audit log, and the
``/api`` bearer tokens still working beside the pages."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func
from sqlmodel import Session, col, select

from console.management_api import create_token
from console.pages import PAGES_ROUTER
from console.pages.rollouts import ACTIONS
from controlplane.storage.session import session_scope
from controlplane.storage.tables import AuditLog, ConsoleUser, Tenant
from tests.conftest import DB_BACKENDS
from tests.integration.console_support import PASSWORD, Console, console_server, csrf_of, login, post_form

pytestmark = pytest.mark.integration

PAGES = [
    "/",
    "/tenants",
    "/tenants/new",
    "/keys",
    "/fleet",
    "/rollouts",
    "/rollouts/new",
    "/models",
    "/billing",
    "/audit",
]


@pytest.fixture(scope="module", params=DB_BACKENDS)
def console(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    with console_server(Path(tmp_path_factory.mktemp("console")), request.param) as running:
        yield running


def change_routes() -> list[str]:
    """Every POST route of the console's pages, with placeholder path parameters (each rollout action)."""
    paths = []
    for route in PAGES_ROUTER.routes:
        if "POST" not in route.methods:
            continue
        for action in ACTIONS if "{action:str}" in route.path else [""]:
            path = route.path.replace("{action:str}", action)
            paths.append(re.sub(r"\{(\w+):(int|str|path)\}", lambda m: "1" if m.group(2) == "int" else "x", path))
    return sorted(set(paths))


def num_audit_rows(console: Console) -> int:
    with Session(console.engine) as session:
        return int(session.exec(select(func.count()).select_from(AuditLog)).one())


def test_every_page_needs_a_session(console: Console) -> None:
    with console.browser() as browser:
        for path in PAGES:
            resp = browser.get(path)
            assert resp.status_code == 303, path
            assert resp.headers["location"].startswith("/login?next="), path
        # An HTMX poll whose session ended sends the whole page to the sign-in form.
        resp = browser.get("/overview/stats", headers={"HX-Request": "true"})
        assert resp.headers["hx-redirect"].startswith("/login")
        # A forged cookie is no session.
        browser.cookies.set("tierline_console", "eyJzaWQiOiJ4IiwidWlkIjoxLCJpYXQiOjk5OTk5OTk5OTl9.AAAA")
        assert browser.get("/tenants").status_code == 303


def test_sign_in_sets_a_hardened_session_and_goes_where_asked(console: Console) -> None:
    name = console.user("admin")
    with console.browser() as browser:
        resp = login(browser, name, PASSWORD, next_path="/rollouts")
        assert resp.status_code == 303 and resp.headers["location"] == "/rollouts"
        cookie = resp.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=lax" in cookie
        assert "Secure" not in cookie  # plain HTTP here; HTTPS or TIERLINE_CONSOLE_SECURE_COOKIES marks it Secure
        page = browser.get("/rollouts")
        assert page.status_code == 200 and name in page.text
        # Sign-out clears the session.
        resp = browser.post("/logout", data={"_csrf": csrf_of(page.text)})
        assert resp.status_code == 303 and resp.headers["location"] == "/login"
        assert browser.get("/rollouts").status_code == 303
    with Session(console.engine) as session:
        user = session.exec(select(ConsoleUser).where(ConsoleUser.username == name)).one()
        assert user.last_login_at is not None


def test_sign_in_refuses_wrong_passwords_and_foreign_redirects(console: Console) -> None:
    name = console.user("admin")
    with console.browser() as browser:
        resp = login(browser, name, "not the password at all")
        assert resp.status_code == 401 and "Wrong username or password" in resp.text
        resp = login(browser, "nobody-" + name, PASSWORD)
        assert resp.status_code == 401 and "Wrong username or password" in resp.text
        resp = login(browser, name, PASSWORD, next_path="//evil.example/steal")
        assert resp.status_code == 303 and resp.headers["location"] == "/"


def test_sign_in_without_its_csrf_token_is_refused(console: Console) -> None:
    name = console.user("admin")
    with console.browser() as browser:
        browser.get("/login")
        resp = browser.post("/login", data={"username": name, "password": PASSWORD})
        assert resp.status_code == 403
        assert browser.get("/").status_code == 303  # not signed in


def test_failed_sign_ins_are_rate_limited_per_username_and_address(console: Console) -> None:
    name = console.user("admin")
    with console.browser() as browser:
        for _ in range(5):
            assert login(browser, name, "wrong password here").status_code == 401
        resp = login(browser, name, PASSWORD)  # even the right password waits now
        assert resp.status_code == 429
        assert int(resp.headers["retry-after"]) >= 1
        assert "Too many failed sign-ins" in resp.text
        # Another user from the same address is not held up.
        assert login(browser, console.user("admin"), PASSWORD).status_code == 303


def test_pages_carry_a_csp_without_inline_script(console: Console) -> None:
    with console.signed_in("admin") as browser:
        for path in [*PAGES, "/login"]:
            resp = browser.get(path)
            assert resp.status_code == 200, path
            csp = resp.headers["content-security-policy"]
            assert "script-src 'self'" in csp and "'unsafe-inline'" not in csp and "'unsafe-eval'" not in csp
            assert resp.headers["x-frame-options"] == "DENY"
            html = resp.text
            assert re.findall(r"<script(?![^>]*\ssrc=)[^>]*>", html) == [], path
            assert not re.search(r"\son[a-z]+\s*=", html), f"inline event handler on {path}"
            assert not re.search(r"\sstyle\s*=", html), f"inline style on {path}"
        assert browser.get("/static/vendor/htmx/htmx.min.js").status_code == 200
        assert "Zero-Clause BSD" in browser.get("/static/vendor/htmx/LICENSE").text


def test_a_change_without_a_csrf_token_is_refused(console: Console) -> None:
    name = "nocsrf-" + console.user("admin")[-8:]
    with console.signed_in("admin") as browser:
        before = num_audit_rows(console)
        resp = browser.post("/tenants", data={"name": name})
        assert resp.status_code == 403 and "CSRF" in resp.text
        resp = browser.post("/tenants", data={"name": name, "_csrf": "forged"})
        assert resp.status_code == 403
        resp = browser.post("/tenants", data={"name": name}, headers={"X-CSRF-Token": "forged"})
        assert resp.status_code == 403
        # The token of another session does not fit this one.
        with console.signed_in("admin") as other:
            foreign = csrf_of(other.get("/tenants/new").text)
        assert browser.post("/tenants", data={"name": name, "_csrf": foreign}).status_code == 403
        # The same post with this page's token (form field or HTMX header) works.
        token = csrf_of(browser.get("/tenants/new").text)
        assert browser.post("/tenants", data={"name": name}, headers={"X-CSRF-Token": token}).status_code == 303
    with Session(console.engine) as session:
        assert session.exec(select(Tenant).where(Tenant.name == name)).one()
    assert num_audit_rows(console) == before + 1


def test_a_viewer_sees_every_page_and_is_refused_every_change(console: Console) -> None:
    routes = change_routes()
    assert (
        len(routes) >= 12
    )  # 4 rollout actions, tenants, keys, fleet, rollouts: if a route is added it is covered here too
    with console.signed_in("viewer") as viewer:
        for path in PAGES:
            resp = viewer.get(path)
            assert resp.status_code == 200, path
            assert "viewer" in resp.text
        assert "New tenant" not in viewer.get("/tenants").text  # no buttons for what it may not do
        before = num_audit_rows(console)
        token = csrf_of(viewer.get("/").text)
        for path in routes:
            resp = viewer.post(path, data={"_csrf": token, "name": "viewer-made", "tenant": "viewer-made"})
            assert resp.status_code == 403, path
            assert "only an admin can change anything" in resp.text, path
    assert num_audit_rows(console) == before
    with Session(console.engine) as session:
        assert session.exec(select(Tenant).where(Tenant.name == "viewer-made")).first() is None


def test_a_password_change_ends_the_users_sessions(console: Console) -> None:
    from console.passwords import hash_password

    name = console.user("admin")
    with console.browser() as browser:
        assert login(browser, name, PASSWORD).status_code == 303
        assert browser.get("/").status_code == 200
        with session_scope(console.engine) as session:
            user = session.exec(select(ConsoleUser).where(ConsoleUser.username == name)).one()
            user.password_hash = hash_password("another long password")
            session.add(user)
        assert browser.get("/").status_code == 303


def test_the_management_api_keeps_its_bearer_tokens(console: Console) -> None:
    name = console.user("admin")
    with session_scope(console.engine) as session:
        secret = create_token(session, name).secret
    with httpx.Client(base_url=console.url) as api:
        assert api.get("/api/rollouts").status_code == 401
        resp = api.get("/api/rollouts", headers={"Authorization": f"Bearer {secret}"})
        assert resp.status_code == 200 and resp.json()["object"] == "list"
    # A browser session is no API token, and the API takes no cookies.
    with console.signed_in("admin") as browser:
        assert browser.get("/api/rollouts").status_code == 401


def test_every_change_lands_in_the_audit_log(console: Console) -> None:
    with console.signed_in("admin") as browser:
        name = "audited-" + console.user("viewer")[-8:]
        assert (
            post_form(browser, "/tenants", {"name": name, "monthly_budget": "10"}, page="/tenants/new").status_code
            == 303
        )
        resp = post_form(browser, f"/tenants/{name}/edit", {"monthly_budget": "25", "is_active": "on"}, page="/")
        assert resp.status_code == 303
        page = browser.get(f"/audit?q={name}")
        assert "tenant.update" in page.text and "tenant.create" in page.text
    with Session(console.engine) as session:
        rows = session.exec(
            select(AuditLog).where(AuditLog.target == f"tenant/{name}").order_by(col(AuditLog.id))
        ).all()
    assert [r.action for r in rows] == ["tenant.create", "tenant.update"]
    assert rows[1].actor.startswith("console:admin-")
    assert rows[1].before is not None and rows[1].before["monthly_budget"] == "10"
    assert rows[1].after is not None and rows[1].after["monthly_budget"] == "25"


# Built in this process, the app meets Litestar 2.25's deprecation warnings about the parameter style every
# route of the project uses (inferred query and path parameters); the served app is the same without them.
@pytest.mark.filterwarnings("ignore::litestar.exceptions.LitestarDeprecationWarning")
@pytest.mark.filterwarnings("ignore:Deprecated 'query' parameter:DeprecationWarning")
@pytest.mark.parametrize(
    ("base_url", "secure_setting", "is_secure"),
    [("https://console.test", False, True), ("http://console.test", True, True), ("http://console.test", False, False)],
)
def test_the_session_cookie_is_secure_behind_tls_or_when_configured(
    tmp_path: Path, base_url: str, secure_setting: bool, is_secure: bool
) -> None:
    from litestar.testing import TestClient

    from console.app import create_app
    from console.auth import ConsoleAuthSettings
    from console.passwords import create_user
    from controlplane.storage.database import create_db
    from controlplane.storage.migrate import upgrade

    url = f"sqlite:///{tmp_path / 'console.db'}"
    upgrade(url)
    engine = create_db(url)
    with session_scope(engine) as session:
        create_user(session, "tls-admin", PASSWORD, "admin")
    app = create_app(engine, ConsoleAuthSettings(secure_cookies=secure_setting))
    try:
        with TestClient(app, base_url=base_url) as client:
            resp = client.get("/login")
            assert ("; Secure" in resp.headers["set-cookie"]) is is_secure
            if is_secure and base_url.startswith("http:"):
                return  # a browser keeps a Secure cookie off plain HTTP; behind a TLS proxy it comes back on HTTPS
            resp = client.post(
                "/login",
                data={"username": "tls-admin", "password": PASSWORD, "_csrf": csrf_of(resp.text)},
                follow_redirects=False,
            )
            assert resp.status_code == 303
            cookie = resp.headers["set-cookie"]
            assert ("; Secure" in cookie) is is_secure and "HttpOnly" in cookie and "SameSite=lax" in cookie
    finally:
        engine.dispose()

"""Console sign-in and what guards every change, against a real ``tierline console serve`` on SQLite and
PostgreSQL: sessions, cookie flags, CSRF, roles, login rate limiting, security headers, the audit log, and the
``/api`` bearer tokens still working beside the pages."""

from __future__ import annotations

import os
import re
import subprocess
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, update
from sqlmodel import Session, col, select

from console.management_api import create_token
from console.pages import PAGES_ROUTER
from console.pages.rollouts import ACTIONS
from controlplane.storage.session import session_scope
from controlplane.storage.tables import AuditLog, ConsoleSession, ConsoleUser, Tenant
from tests.conftest import DB_BACKENDS, base_env, free_port, run_server
from tests.forkserver import run_tierline
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
    from console.passwords import create_user
    from console.session_cookie import ConsoleAuthSettings
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


# --- revocable sessions, user management, a sign-in limit that holds under concurrency ---------------------------

NEW_PASSWORD = "a brand new long password"
LOGIN_LIMIT = 5  # ConsoleAuthSettings.login_attempts_per_minute's default


def user_id_of(console: Console, username: str) -> int:
    with Session(console.engine) as session:
        user = session.exec(select(ConsoleUser).where(ConsoleUser.username == username)).one()
    assert user.id is not None
    return user.id


def audit_actions(console: Console, target: str) -> list[str]:
    with Session(console.engine) as session:
        rows = session.exec(select(AuditLog).where(AuditLog.target == target).order_by(col(AuditLog.id))).all()
    return [r.action for r in rows]


def copy_session(source: httpx.Client, dest: httpx.Client) -> None:
    """What a thief does with a cookie read off a shared machine or a proxy log."""
    dest.cookies.set("tierline_console", source.cookies["tierline_console"])


def cli(console: Console, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    """``tierline console ...`` as an operator runs it, against the console's database."""
    env = base_env(console.data_dir, TIERLINE_DATABASE_URL=console.engine.url.render_as_string(hide_password=False))
    return run_tierline("console", *args, env=env, input=stdin, timeout=120)


def test_a_stolen_cookie_is_refused_after_sign_out(console: Console) -> None:
    name = console.user("admin")
    with console.browser() as browser, console.browser() as thief:
        assert login(browser, name, PASSWORD).status_code == 303
        copy_session(browser, thief)
        assert thief.get("/tenants").status_code == 200
        page = browser.get("/")
        assert browser.post("/logout", data={"_csrf": csrf_of(page.text)}).status_code == 303
        resp = thief.get("/tenants")
        assert resp.status_code == 303 and resp.headers["location"].startswith("/login")
        resp = thief.post("/tenants", data={"name": "stolen-" + name[-8:], "_csrf": csrf_of(page.text)})
        assert resp.status_code == 303 and resp.headers["location"] == "/login"
    with Session(console.engine) as session:
        assert session.exec(select(Tenant).where(Tenant.name == "stolen-" + name[-8:])).first() is None


def test_a_password_reset_ends_every_session_of_the_user(console: Console) -> None:
    name = console.user("viewer")
    uid = user_id_of(console, name)
    with console.signed_in("admin") as admin, console.browser() as victim, console.browser() as thief:
        assert login(victim, name, PASSWORD).status_code == 303
        copy_session(victim, thief)
        assert thief.get("/").status_code == 200
        resp = post_form(admin, f"/users/{uid}/password", {"password": NEW_PASSWORD}, page=f"/users/{uid}")
        assert resp.status_code == 303, resp.text
        assert victim.get("/").status_code == 303
        assert thief.get("/").status_code == 303
        assert login(victim, name, PASSWORD).status_code == 401
        assert login(victim, name, NEW_PASSWORD).status_code == 303
        # Too short a password is refused with the reason, and changes nothing.
        resp = post_form(admin, f"/users/{uid}/password", {"password": "short"}, page=f"/users/{uid}")
        assert resp.status_code == 400 and "at least 12 characters" in resp.text
        assert victim.get("/").status_code == 200
    assert audit_actions(console, f"console_user/{name}") == ["console_user.password_reset"]
    with Session(console.engine) as session:
        row = session.exec(select(AuditLog).where(AuditLog.target == f"console_user/{name}")).one()
    assert "argon2" not in str(row.before) + str(row.after)  # no hash in the audit log


def test_a_revoked_console_api_token_gets_401(console: Console) -> None:
    name = console.user("admin")
    with session_scope(console.engine) as session:
        by_cli = create_token(session, name, name="ci")
        by_page = create_token(session, name, name="laptop")
    assert by_cli.record.id is not None and by_page.record.id is not None
    with httpx.Client(base_url=console.url) as api:
        for issued in (by_cli, by_page):
            assert api.get("/api/rollouts", headers={"Authorization": f"Bearer {issued.secret}"}).status_code == 200
        done = cli(console, "revoke-token", str(by_cli.record.id))
        assert done.returncode == 0, done.stderr
        assert by_cli.record.prefix in done.stdout
        resp = api.get("/api/rollouts", headers={"Authorization": f"Bearer {by_cli.secret}"})
        assert resp.status_code == 401 and "revoked" in resp.json()["error"]["message"]
        assert api.get("/api/rollouts", headers={"Authorization": f"Bearer {by_page.secret}"}).status_code == 200
        with console.signed_in("admin") as admin:
            uid = user_id_of(console, name)
            page = admin.get(f"/users/{uid}")
            assert page.status_code == 200 and by_page.record.prefix in page.text
            resp = post_form(admin, f"/users/{uid}/tokens/{by_page.record.id}/revoke", {}, page=f"/users/{uid}")
            assert resp.status_code == 303
        assert api.get("/api/rollouts", headers={"Authorization": f"Bearer {by_page.secret}"}).status_code == 401
    assert audit_actions(console, f"console_token/{by_cli.record.id}") == ["console_token.revoke"]
    assert audit_actions(console, f"console_token/{by_page.record.id}") == ["console_token.revoke"]
    assert cli(console, "revoke-token", "999999").returncode != 0


def test_an_admin_manages_console_users_from_the_console(console: Console) -> None:
    name = "managed-" + console.user("viewer")[-8:]
    with console.signed_in("admin") as admin:
        resp = post_form(admin, "/users", {"username": name, "password": PASSWORD, "role": "viewer"}, page="/users")
        assert resp.status_code == 303, resp.text
        assert name in admin.get("/users").text
        resp = post_form(admin, "/users", {"username": name, "password": PASSWORD, "role": "viewer"}, page="/users")
        assert resp.status_code == 409 and "already exists" in resp.text
        resp = post_form(admin, "/users", {"username": "x" + name, "password": PASSWORD, "role": "root"}, page="/users")
        assert resp.status_code == 400 and "role must be one of" in resp.text
        uid = user_id_of(console, name)
        with console.browser() as user:
            assert login(user, name, PASSWORD).status_code == 303
            token = csrf_of(user.get("/tenants/new").text)
            assert user.post("/tenants", data={"name": "by-" + name, "_csrf": token}).status_code == 403
            # A role change takes effect on the user's next request.
            assert post_form(admin, f"/users/{uid}/role", {"role": "admin"}, page=f"/users/{uid}").status_code == 303
            assert user.post("/tenants", data={"name": "by-" + name, "_csrf": token}).status_code == 303
            with session_scope(console.engine) as session:
                secret = create_token(session, name).secret
            # Disabling signs the user out everywhere, refuses sign-in and its API tokens.
            assert post_form(admin, f"/users/{uid}/disable", {}, page=f"/users/{uid}").status_code == 303
            assert user.get("/").status_code == 303
            assert login(user, name, PASSWORD).status_code == 401
            with httpx.Client(base_url=console.url) as api:
                assert api.get("/api/rollouts", headers={"Authorization": f"Bearer {secret}"}).status_code == 401
            assert "disabled" in admin.get(f"/users/{uid}").text
            assert post_form(admin, f"/users/{uid}/enable", {}, page=f"/users/{uid}").status_code == 303
            assert login(user, name, PASSWORD).status_code == 303
            # An admin can end every session of a user without touching the password.
            assert post_form(admin, f"/users/{uid}/sessions/revoke", {}, page=f"/users/{uid}").status_code == 303
            assert user.get("/").status_code == 303
    assert audit_actions(console, f"console_user/{name}") == [
        "console_user.create",
        "console_user.role",
        "console_user.disable",
        "console_user.enable",
        "console_user.revoke_sessions",
    ]


def test_the_users_page_is_for_admins_only(console: Console) -> None:
    with console.signed_in("viewer") as viewer:
        assert viewer.get("/users").status_code == 403
        assert 'href="/users"' not in viewer.get("/").text
    with console.signed_in("admin") as admin:
        assert 'href="/users"' in admin.get("/").text


def test_an_admin_cannot_lock_themselves_out(console: Console) -> None:
    with console.signed_in("admin") as admin:
        match = re.search(r'class="who".*?<span>([\w-]+) ', admin.get("/").text, re.S)
        assert match
        uid = user_id_of(console, match.group(1))
        for path, form in [(f"/users/{uid}/disable", {}), (f"/users/{uid}/role", {"role": "viewer"})]:
            resp = post_form(admin, path, form, page=f"/users/{uid}")
            assert resp.status_code == 409 and "your own" in resp.text, path
        assert admin.get("/users").status_code == 200


def _concurrent_sign_ins(urls: list[str], username: str, password: str, count: int) -> list[int]:
    """``count`` sign-ins sent at once, spread over ``urls`` (each from a client that loaded its form first)."""
    clients = [httpx.Client(base_url=urls[i % len(urls)], timeout=60) for i in range(count)]
    try:
        tokens = [csrf_of(c.get("/login").text) for c in clients]
        barrier = threading.Barrier(count)

        def attempt(i: int) -> int:
            barrier.wait()
            form = {"username": username, "password": password, "_csrf": tokens[i], "next": "/"}
            return clients[i].post("/login", data=form).status_code

        with ThreadPoolExecutor(count) as pool:
            return list(pool.map(attempt, range(count)))
    finally:
        for c in clients:
            c.close()


def test_concurrent_wrong_sign_ins_cannot_pass_the_limit(console: Console) -> None:
    name = console.user("admin")
    statuses = _concurrent_sign_ins([console.url], name, "wrong password, in parallel", 16)
    assert sorted(statuses) == [401] * LOGIN_LIMIT + [429] * (16 - LOGIN_LIMIT), statuses
    with console.browser() as browser:
        assert login(browser, name, PASSWORD).status_code == 429


@pytest.mark.parametrize(
    ("backend", "use_redis"),
    [("sqlite", False), pytest.param("postgresql", False, marks=pytest.mark.postgres), ("sqlite", True)],
)
def test_the_sign_in_limit_holds_across_console_replicas(tmp_path: Path, backend: str, use_redis: bool) -> None:
    redis_url = os.environ.get("TIERLINE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    extra = {"TIERLINE_REDIS_URL": redis_url} if use_redis else {}
    if use_redis and not _redis_answers(redis_url):
        pytest.skip(f"no Redis at {redis_url}")
    with console_server(tmp_path / "a", backend, **extra) as first:
        db_url = first.engine.url.render_as_string(hide_password=False)
        env = base_env(tmp_path / "b", TIERLINE_DATABASE_URL=db_url, TIERLINE_SECRET_KEY="replica-b", **extra)
        with run_server(["console", "serve"], env, free_port()) as second:
            name = first.user("admin")
            statuses = _concurrent_sign_ins([first.url, second], name, "wrong password, two replicas", 16)
    assert sorted(statuses) == [401] * LOGIN_LIMIT + [429] * (16 - LOGIN_LIMIT), statuses


def _redis_answers(url: str) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_timeout=2).ping())
    except redis.RedisError:
        return False


def test_a_session_not_seen_for_a_while_still_loads_every_page(console: Console) -> None:
    """A session whose last use is older than the last-seen granularity has that time written on its next request:
    the page still answers 200 (it was a 500, ``DetachedInstanceError`` from ``_load_user``, once per session
    every five minutes under traffic)."""
    name = console.user("viewer")
    with console.browser() as browser:
        assert login(browser, name, PASSWORD).status_code == 303
        for page in PAGES:
            with Session(console.engine) as session:
                session.execute(
                    update(ConsoleSession)
                    .where(col(ConsoleSession.user_id) == user_id_of(console, name))
                    .values(last_seen_at=datetime.now(UTC) - timedelta(hours=1))
                )
                session.commit()
            assert browser.get(page).status_code == 200, page
        with Session(console.engine) as session:
            seen = session.exec(
                select(ConsoleSession.last_seen_at).where(ConsoleSession.user_id == user_id_of(console, name))
            ).all()
        assert seen and all(
            (t if t.tzinfo else t.replace(tzinfo=UTC)) > datetime.now(UTC) - timedelta(minutes=1) for t in seen
        )

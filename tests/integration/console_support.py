"""What the console tests share: a real ``tierline console serve`` on a fresh database, signed-in browsers."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from sqlalchemy.engine import Engine

from console.passwords import create_user
from controlplane.storage.database import create_db
from controlplane.storage.migrate import upgrade
from controlplane.storage.session import session_scope
from tests.conftest import PG_URL, _postgres_schema, base_env, free_port, run_server

PASSWORD = "correct horse battery staple"
_CSRF = re.compile(r'name="_csrf" value="([^"]+)"')


@dataclass
class Console:
    """A running console and its database."""

    url: str
    engine: Engine
    data_dir: Path

    def browser(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, follow_redirects=False, timeout=30)

    def user(self, role: str = "admin") -> str:
        """A new console user with ``role``; returns the username."""
        name = f"{role}-{uuid.uuid4().hex[:8]}"
        with session_scope(self.engine) as session:
            create_user(session, name, PASSWORD, role)
        return name

    @contextmanager
    def signed_in(self, role: str = "admin") -> Iterator[httpx.Client]:
        """A browser signed in as a new user with ``role``."""
        with self.browser() as client:
            resp = login(client, self.user(role), PASSWORD)
            assert resp.status_code == 303, resp.text
            yield client


def csrf_of(html: str) -> str:
    match = _CSRF.search(html)
    assert match, "the page has a form with a CSRF token"
    return match.group(1)


def login(client: httpx.Client, username: str, password: str, next_path: str = "/") -> httpx.Response:
    token = csrf_of(client.get("/login").text)
    return client.post("/login", data={"username": username, "password": password, "_csrf": token, "next": next_path})


def post_form(client: httpx.Client, path: str, data: dict[str, str], *, page: str = "/") -> httpx.Response:
    """Submit a form as the browser does: with the CSRF token of a page it loaded."""
    token = csrf_of(client.get(page).text)
    return client.post(path, data={**data, "_csrf": token})


def errors_in(html: str) -> list[str]:
    return re.findall(r'class="error[^"]*"[^>]*>([^<]+)<', html)


@contextmanager
def console_server(tmp: Path, backend: str, **settings: str) -> Iterator[Console]:
    """``tierline console serve`` on a fresh, migrated SQLite file or PostgreSQL schema (``settings``: more env)."""
    with _database(tmp, backend) as url:
        upgrade(url)
        engine = create_db(url)
        env = base_env(tmp, TIERLINE_DATABASE_URL=url, TIERLINE_SECRET_KEY="test-" + uuid.uuid4().hex, **settings)
        port = free_port()
        try:
            with run_server(["console", "serve"], env, port) as base:
                yield Console(base, engine, tmp)
        finally:
            engine.dispose()


@contextmanager
def _database(tmp: Path, backend: str) -> Iterator[str]:
    if backend == "sqlite":
        yield f"sqlite:///{tmp / 'console.db'}"
        return
    if not PG_URL:
        pytest.skip("PostgreSQL not configured: set TIERLINE_TEST_DATABASE_URL")
    with _postgres_schema() as url:
        yield url

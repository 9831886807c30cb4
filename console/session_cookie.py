"""The console's session cookie: what it carries, how it is signed, and the sign-in settings and throttle.

The cookie is signed (HMAC-SHA256 with a key derived from ``TIERLINE_SECRET_KEY``) and carries a random session
id, the user id, when it was issued and a fingerprint of the user's password hash. The CSRF token is an HMAC of the
session id. ``console.auth`` holds the guards that read it; ``ConsoleState.auth`` is the ``ConsoleAuth`` built here.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

from litestar.connection import ASGIConnection
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from controlplane.accounts.login_throttle import LoginThrottle, login_throttle
from shared.settings import CoreSettings


class ConsoleAuthSettings(BaseSettings):
    """How console sessions and sign-in behave (env prefix ``TIERLINE_CONSOLE_``)."""

    model_config = SettingsConfigDict(env_prefix="TIERLINE_CONSOLE_", extra="ignore")

    secure_cookies: bool = Field(
        False, description="always mark the session cookie Secure (it is whenever the request came over HTTPS)"
    )
    session_max_age_s: int = Field(12 * 3600, ge=60, description="a session ends this long after sign-in")
    login_attempts_per_minute: int = Field(
        5, ge=1, description="sign-in attempts per username and address a minute (a successful one clears them)"
    )


@dataclass(frozen=True, slots=True)
class SessionData:
    sid: str
    user_id: int | None
    issued_at: float
    fingerprint: str = ""


def password_fingerprint(password_hash: str) -> str:
    return hashlib.sha256(password_hash.encode()).hexdigest()[:16]


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class SessionCodec:
    """Signs and reads session cookies and derives CSRF tokens; the secret never leaves this object."""

    def __init__(self, secret: str, max_age_s: int) -> None:
        self._session_key = hashlib.sha256(b"tierline-console-session\0" + secret.encode()).digest()
        self._csrf_key = hashlib.sha256(b"tierline-console-csrf\0" + secret.encode()).digest()
        self.max_age_s = max_age_s

    def encode(self, data: SessionData) -> str:
        payload = json.dumps(
            {"sid": data.sid, "uid": data.user_id, "iat": data.issued_at, "fp": data.fingerprint},
            separators=(",", ":"),
        ).encode()
        mac = hmac.new(self._session_key, payload, hashlib.sha256).digest()
        return f"{_b64(payload)}.{_b64(mac)}"

    def decode(self, value: str | None, *, now: float | None = None) -> SessionData | None:
        """The session in a cookie, or None when it is missing, forged, malformed or too old."""
        if not value or "." not in value:
            return None
        body, _, sig = value.partition(".")
        try:
            payload, mac = _unb64(body), _unb64(sig)
            if not hmac.compare_digest(mac, hmac.new(self._session_key, payload, hashlib.sha256).digest()):
                return None
            raw = json.loads(payload)
            data = SessionData(str(raw["sid"]), raw["uid"], float(raw["iat"]), str(raw.get("fp", "")))
        except (ValueError, KeyError, TypeError):
            return None
        if data.user_id is not None and not isinstance(data.user_id, int):
            return None
        if (now or time.time()) - data.issued_at > self.max_age_s:
            return None
        return data

    def csrf_token(self, sid: str) -> str:
        return _b64(hmac.new(self._csrf_key, sid.encode(), hashlib.sha256).digest())

    def is_valid_csrf(self, sid: str, token: str | None) -> bool:
        return bool(token) and hmac.compare_digest(self.csrf_token(sid), str(token))


def new_session(user_id: int | None = None, fingerprint: str = "") -> SessionData:
    return SessionData(secrets.token_urlsafe(18), user_id, time.time(), fingerprint)


@dataclass(slots=True)
class ConsoleAuth:
    """What the console's sign-in needs at run time (``ConsoleState.auth``)."""

    codec: SessionCodec
    throttle: LoginThrottle
    settings: ConsoleAuthSettings

    @classmethod
    def from_settings(cls, secret: str, settings: ConsoleAuthSettings | None = None) -> ConsoleAuth:
        settings = settings or ConsoleAuthSettings()
        return cls(
            SessionCodec(secret, settings.session_max_age_s),
            login_throttle(settings.login_attempts_per_minute, CoreSettings().redis_url),
            settings,
        )

    def cookie_is_secure(self, request: ASGIConnection[Any, Any, Any, Any]) -> bool:
        return self.settings.secure_cookies or request.url.scheme == "https"

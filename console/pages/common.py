"""What every console page shares: rendering with the signed-in user, forms, pagination, audit rows, errors."""

from __future__ import annotations

import logging
import math
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any
from urllib.parse import urlencode

from litestar import Request, Response
from litestar.enums import RequestEncodingType
from litestar.exceptions import HTTPException
from litestar.params import Body
from litestar.plugins.htmx import ClientRedirect, HTMXRequest
from litestar.response import Redirect, Template
from litestar.types import ExceptionHandlersMap
from sqlalchemy import func
from sqlalchemy.engine import Engine
from sqlmodel import Session, select
from sqlmodel.sql.expression import SelectOfScalar

from console.auth import LoginRequiredError, session_user
from controlplane.storage.audit import audit as audit
from controlplane.storage.session import session_scope
from shared.errors import ApplicationError, ValidationError

logger = logging.getLogger(__name__)

PAGE_SIZE = 25
# A form body: field -> value (the last one wins when a field repeats).
Form = Annotated[dict[str, str], Body(media_type=RequestEncodingType.URL_ENCODED)]


def render(request: Request[Any, Any, Any], template: str, status_code: int = 200, **context: Any) -> Template:
    """A page (or partial) with the signed-in user and its CSRF token in the context."""
    user = session_user(request)
    return Template(
        template_name=template,
        context={"user": user, "csrf": user.csrf_token, "path": request.url.path, **context},
        status_code=status_code,
    )


def write_session(db: Engine) -> AbstractContextManager[Session]:
    """A session that commits when the block succeeds and rolls back when it raises."""
    return session_scope(db)


def see_other(path: str) -> Redirect:
    """Post/redirect/get: after a change the browser loads the result page with GET."""
    return Redirect(path, status_code=303)


def jsonable(value: Any) -> Any:
    if isinstance(value, Decimal):
        return format(value.normalize(), "f")
    if isinstance(value, datetime):
        return value.isoformat()
    return value


# --- form fields --------------------------------------------------------------------------------------------------


def text(form: dict[str, str], name: str, *, max_length: int = 200, required: bool = False) -> str:
    value = form.get(name, "").strip()
    if required and not value:
        raise ValidationError(f"{name.replace('_', ' ')} is required", param=name)
    if len(value) > max_length:
        raise ValidationError(f"{name.replace('_', ' ')} must be at most {max_length} characters", param=name)
    return value


def optional_int(form: dict[str, str], name: str, *, minimum: int = 0, maximum: int = 10**9) -> int | None:
    raw = form.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValidationError(f"{name.replace('_', ' ')} must be a whole number", param=name) from None
    if not minimum <= value <= maximum:
        raise ValidationError(f"{name.replace('_', ' ')} must be between {minimum} and {maximum}", param=name)
    return value


def optional_float(form: dict[str, str], name: str, *, minimum: float = 0.0, maximum: float = 1e12) -> float | None:
    raw = form.get(name, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValidationError(f"{name.replace('_', ' ')} must be a number", param=name) from None
    if not math.isfinite(value) or not minimum <= value <= maximum:
        raise ValidationError(f"{name.replace('_', ' ')} must be between {minimum:g} and {maximum:g}", param=name)
    return value


def optional_money(form: dict[str, str], name: str) -> Decimal | None:
    raw = form.get(name, "").strip()
    if not raw:
        return None
    try:
        value = Decimal(raw)
    except InvalidOperation:
        raise ValidationError(f"{name.replace('_', ' ')} {raw!r} is not an amount", param=name) from None
    if not value.is_finite() or value < 0 or value >= Decimal(10) ** 12:
        raise ValidationError(f"{name.replace('_', ' ')} must be a non-negative amount", param=name)
    return value


def labels(form: dict[str, str], name: str) -> dict[str, str]:
    """``key=value`` pairs separated by commas or new lines."""
    out: dict[str, str] = {}
    for part in form.get(name, "").replace("\n", ",").split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep or not key.strip() or len(key.strip()) > 64 or len(value.strip()) > 128:
            raise ValidationError(f"{name.replace('_', ' ')}: write key=value pairs separated by commas", param=name)
        out[key.strip()] = value.strip()
    return out


def errors_of(exc: ApplicationError) -> dict[str, str]:
    """Inline form errors: the message under the field it names (or at the top of the form)."""
    return {exc.param or "_form": exc.message}


# --- lists --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Page:
    """One page of a list; ``query`` holds the list's other parameters (search, filters) for the links."""

    number: int
    size: int
    total: int
    query: dict[str, str]

    @property
    def num_pages(self) -> int:
        return max(1, math.ceil(self.total / self.size))

    @property
    def offset(self) -> int:
        return (self.number - 1) * self.size

    def link(self, number: int) -> str:
        return "?" + urlencode({**{k: v for k, v in self.query.items() if v}, "page": number})

    @property
    def has_prev(self) -> bool:
        return self.number > 1

    @property
    def has_next(self) -> bool:
        return self.number < self.num_pages


def paginate(
    session: Session, query: SelectOfScalar[Any], page: int, query_args: dict[str, str], size: int = PAGE_SIZE
) -> tuple[list[Any], Page]:
    total = session.exec(select(func.count()).select_from(query.subquery())).one()
    number = min(max(1, page), max(1, math.ceil(total / size)))
    info = Page(number, size, int(total), query_args)
    return list(session.exec(query.offset(info.offset).limit(size))), info


def like(term: str) -> str:
    escaped = term.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped.lower()}%"


# --- errors as pages --------------------------------------------------------------------------------------------


def _error_page(request: Request[Any, Any, Any], status: int, message: str) -> Response[Any]:
    headers = {"Retry-After": "60"} if status == 429 else None
    user = request.scope.get("user")
    return Template(
        template_name="error.html.j2",
        context={"user": user, "csrf": getattr(user, "csrf_token", ""), "status": status, "message": message},
        status_code=status,
        headers=headers,
    )


def application_error_page(request: Request[Any, Any, Any], exc: ApplicationError) -> Response[Any]:
    return _error_page(request, exc.status_code, exc.message)


def http_error_page(request: Request[Any, Any, Any], exc: HTTPException) -> Response[Any]:
    return _error_page(request, exc.status_code, str(exc.detail))


def unexpected_error_page(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return _error_page(request, 500, "Something went wrong on the server; the error has been logged.")


def login_redirect(request: Request[Any, Any, Any], _: LoginRequiredError) -> Response[Any]:
    """To the sign-in page, back here afterwards (HTMX requests are redirected by the browser as a whole)."""
    target = "/login?" + urlencode({"next": request.url.path}) if request.method == "GET" else "/login"
    if HTMXRequest(request.scope).htmx:  # exception handlers get a plain Request
        return ClientRedirect(target)
    return Redirect(target, status_code=303)


PAGE_EXCEPTION_HANDLERS: ExceptionHandlersMap = {
    LoginRequiredError: login_redirect,
    ApplicationError: application_error_page,
    HTTPException: http_error_page,
    Exception: unexpected_error_page,
}

"""The one error tree. Each error carries the HTTP status, OpenAI error type and ``code`` it maps to.

Every 4xx has a non-null ``code`` (a client branches on it; docs/cloud-api.md#error-codes lists them): a class
names its own, and an error of a status without one (an upstream's relayed 4xx) gets ``default_code``'s.
"""

from __future__ import annotations

from http import HTTPStatus

# The code of a 4xx whose raiser names none, by status; any other status: its phrase in snake case.
_DEFAULT_CODES = {
    400: "invalid_request",
    401: "invalid_api_key",
    403: "permission_denied",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "request_too_large",
    415: "unsupported_media_type",
    422: "unprocessable_entity",
    429: "rate_limit_exceeded",
}


def default_code(status: int) -> str | None:
    """The ``code`` of a 4xx that names none (``None`` for other statuses: a 5xx says ``type: server_error``)."""
    if not 400 <= status < 500:
        return None
    if status in _DEFAULT_CODES:
        return _DEFAULT_CODES[status]
    try:
        return HTTPStatus(status).phrase.lower().replace(" ", "_").replace("-", "_")
    except ValueError:
        return f"http_{status}"


class ApplicationError(Exception):
    """Base of every error tierline raises on purpose."""

    status_code: int = 500
    error_type: str = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def to_openai(self) -> dict[str, dict[str, str | None]]:
        """The OpenAI error shape ``{"error": {"message", "type", "param", "code"}}``."""
        code = self.code if self.code is not None else default_code(self.status_code)
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": code}}


class ConfigurationError(ApplicationError):
    """Settings or files on disk are wrong; the process cannot start as configured."""


class ValidationError(ApplicationError):
    """A request field's value is wrong (``param`` names it); a raiser with a more precise code passes it."""

    status_code = 400
    error_type = "invalid_request_error"
    code = "invalid_value"


class AuthenticationError(ApplicationError):
    status_code = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class PermissionDeniedError(ApplicationError):
    status_code = 403
    error_type = "permission_error"
    code = "permission_denied"


class NotFoundError(ApplicationError):
    status_code = 404
    error_type = "invalid_request_error"
    code = "not_found"


class ConflictError(ApplicationError):
    status_code = 409
    error_type = "invalid_request_error"
    code = "conflict"


class RateLimitError(ApplicationError):
    status_code = 429
    error_type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after: float = 1.0, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after = retry_after


class ServiceUnavailableError(ApplicationError):
    status_code = 503
    error_type = "server_error"
    code = "unavailable"


class ArtifactVerificationError(ApplicationError):
    """An artifact's bytes, manifest or signature do not check out; it must not be used."""

    status_code = 422
    error_type = "invalid_request_error"
    code = "artifact_verification_failed"


class DeadlineExceededError(ApplicationError):
    """The request ran past the server-side deadline; generation was stopped."""

    status_code = 504
    error_type = "timeout"
    code = "deadline_exceeded"

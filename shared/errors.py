"""The one error tree. Each error carries the HTTP status and OpenAI error type it maps to."""

from __future__ import annotations


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
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


class ConfigurationError(ApplicationError):
    """Settings or files on disk are wrong; the process cannot start as configured."""


class ValidationError(ApplicationError):
    status_code = 400
    error_type = "invalid_request_error"


class AuthenticationError(ApplicationError):
    status_code = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class PermissionDeniedError(ApplicationError):
    status_code = 403
    error_type = "permission_error"


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

"""Errors a client sees: one line, in OpenAI's error shape, with the HTTP status that says whose fault."""
from __future__ import annotations

from typing import Any

# OpenAI's error types by status (what its clients map to exception classes)
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error", 415: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error", 502: "api_error", 503: "api_error",
          504: "api_error"}


class ApiError(Exception):
    """A request the server refuses or cannot answer: status, one-line message, the parameter at fault."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers      # e.g. Retry-After on a 429

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """{"error": {"message", "type", "param", "code"}} as OpenAI's API returns it."""
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}

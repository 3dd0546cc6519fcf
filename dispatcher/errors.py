"""Errors the dispatcher answers with, in the OpenAI error format::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "slo.ttft_ms", "code": 400}}
"""

from __future__ import annotations

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error", 502: "upstream_error", 503: "service_unavailable", 504: "timeout"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str | None = None, param: str | None = None,
                 code: str | int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "error")
        self.param = param
        self.code = code if code is not None else status

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class UpstreamError(Exception):
    """A worker failed (connection refused or reset, 5xx, timeout, died mid-stream)."""

    def __init__(self, worker: str, message: str, status: int | None = None, retryable: bool = True):
        super().__init__(f"{worker}: {message}")
        self.worker = worker
        self.status = status
        self.retryable = retryable

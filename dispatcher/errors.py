"""Errors the dispatcher answers with, in the OpenAI error format::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "slo.ttft_ms", "code": 400}}

Every error the dispatcher sends is in this format, including the ones no
route produced (unknown route 404, wrong method 405, an unexpected exception
500, and uvicorn's own 400 for a malformed HTTP request).
"""

from __future__ import annotations

import json

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 408: "timeout", 413: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error", 500: "internal_error", 502: "upstream_error",
          503: "service_unavailable", 504: "timeout"}


def error_body(status: int, message: str, type: str | None = None, param: str | None = None,
               code: str | int | None = None) -> dict:
    """The OpenAI-style error object for ``status``."""
    return {"error": {"message": message, "type": type or _TYPES.get(status, "error"), "param": param,
                      "code": code if code is not None else status}}


class ApiError(Exception):
    """An error answered to the client with ``status``; ``headers`` go with it (e.g. ``Retry-After``)."""

    def __init__(self, status: int, message: str, type: str | None = None, param: str | None = None,
                 code: str | int | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "error")
        self.param = param
        self.code = code if code is not None else status
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class UpstreamError(Exception):
    """A worker failed (connection refused or reset, 5xx, timeout, died mid-stream).

    ``timeout`` is True when the worker was merely slow (a stream went silent for
    longer than ``stream_idle_timeout_s``): it stays in the candidate set, and a
    request that ends on such an error is answered 504 rather than 502.
    """

    def __init__(self, worker: str, message: str, status: int | None = None, timeout: bool = False):
        super().__init__(f"{worker}: {message}")
        self.worker = worker
        self.status = status
        self.timeout = timeout


#: characters of a worker's error message passed on (to a client, into a log line)
MAX_WORKER_MESSAGE = 500


def worker_error_message(content: bytes) -> str:
    """The message of a worker's error body (OpenAI / FastAPI JSON, else the raw text),
    at most MAX_WORKER_MESSAGE characters: a worker's error never sizes the client's."""
    try:
        data = json.loads(content)
    except (ValueError, RecursionError):
        return _clip(content[:MAX_WORKER_MESSAGE].decode("utf-8", "replace"))
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            return _clip(str(err.get("message") or err.get("detail") or err))
        return _clip(str(err))
    return _clip(str(data))


def _clip(text: str) -> str:
    return text if len(text) <= MAX_WORKER_MESSAGE else text[:MAX_WORKER_MESSAGE - 1] + "…"

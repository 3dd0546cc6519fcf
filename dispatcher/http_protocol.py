"""uvicorn's HTTP protocol with a request-header timeout.

uvicorn (0.54) closes idle keep-alive connections but has no limit on how long
a client may take to send a request's headers: a client that opens a
connection and sends half a request line holds it forever (slowloris). The
protocol classes here start a timer when the connection is made (and when the
first byte of each later request on a keep-alive connection arrives) and
cancel it once the request's headers are complete; if it fires, the
connection is closed and ``on_header_timeout()`` is called (the dispatcher
counts it). The body has its own limit (``body_timeout_s``, in the app: 408).

They also answer uvicorn's own "Invalid HTTP request" 400 in the OpenAI error
format instead of plain text.

Use :func:`http_protocol` as ``uvicorn.Config(..., http=http_protocol(...))``;
``proserve.dispatcher.server.uvicorn_config`` does.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import error_body

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:   # pragma: no cover - uvicorn without httptools
    HttpToolsProtocol = None

_BAD_REQUEST = json.dumps(error_body(400, "Invalid HTTP request received.")).encode()


def _bad_request_bytes() -> bytes:
    return (b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(_BAD_REQUEST)).encode() + b"\r\nconnection: close\r\n\r\n"
            + _BAD_REQUEST)


class _HeaderTimer:
    """The timer part, shared by both protocol classes (a mixin, first in their
    MRO: it starts the timer when a connection is made and stops it when lost)."""

    header_timeout_s: float = 10.0
    on_header_timeout: Callable[[], None] | None = None
    _header_timer: asyncio.TimerHandle | None = None

    def _start_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timed_out)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._start_header_timer()

    def connection_lost(self, exc) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
            if self.on_header_timeout is not None:
                self.on_header_timeout()


def _httptools_class():
    class HeaderTimeoutHttpToolsProtocol(_HeaderTimer, HttpToolsProtocol):
        def on_message_begin(self) -> None:       # the first byte of a request
            super().on_message_begin()
            self._start_header_timer()

        def on_headers_complete(self) -> None:
            self._stop_header_timer()
            super().on_headers_complete()

        def send_400_response(self, msg: str) -> None:
            self.transport.write(_bad_request_bytes())
            self.transport.close()

    return HeaderTimeoutHttpToolsProtocol


class HeaderTimeoutH11Protocol(_HeaderTimer, H11Protocol):
    """h11 has no parser callbacks: the timer runs while the peer's side of the
    connection is IDLE (no complete request line and headers yet)."""

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:
            self._start_header_timer()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._stop_header_timer()

    def send_400_response(self, msg: str) -> None:
        self.transport.write(_bad_request_bytes())
        self.transport.close()


HeaderTimeoutHttpToolsProtocol = _httptools_class() if HttpToolsProtocol is not None else None


def http_protocol(header_timeout_s: float, on_header_timeout: Callable[[], None] | None = None,
                  impl: str = "auto") -> type[asyncio.Protocol]:
    """A protocol class for ``uvicorn.Config(http=...)``; ``impl``: auto (httptools when
    installed, as uvicorn's own auto), httptools or h11."""
    if impl == "auto":
        impl = "httptools" if HeaderTimeoutHttpToolsProtocol is not None else "h11"
    if impl == "httptools":
        if HeaderTimeoutHttpToolsProtocol is None:
            raise ValueError("httptools is not installed")
        base = HeaderTimeoutHttpToolsProtocol
    elif impl == "h11":
        base = HeaderTimeoutH11Protocol
    else:
        raise ValueError(f"unknown HTTP implementation {impl!r} (auto, httptools, h11)")
    return type(base.__name__, (base,), {"header_timeout_s": float(header_timeout_s),
                                         "on_header_timeout": staticmethod(on_header_timeout)
                                         if on_header_timeout else None})

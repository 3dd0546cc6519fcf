"""Admission limits: how many requests the dispatcher serves at once, overall
and per client.

A request holds a slot from admission (right after its API key was checked,
before its body is read) to the end of its response, so slow uploads and long
streams count too. Over either limit the request is answered at once with 429,
``Retry-After`` and an OpenAI-style ``rate_limit_error``; nothing waits in a
queue here (the engines' schedulers queue, the dispatcher only protects itself).

Per client means per ``client`` of the keys file (a client's keys share its
limit); with open access (no keys file) only the overall limit applies.
Both checks are O(1) per request. The count is
:class:`proserve.scheduler.admission.ConcurrencyCount`, the one the simulator's
``--max-concurrent``/``--max-concurrent-per-class`` use.

The other 429 (``slo_unreachable``, ``queue_full``) comes later, once the request's
class and prompt are known: admission control (:mod:`proserve.scheduler.admission`,
applied in ``Dispatcher.events``).
"""

from __future__ import annotations

from proserve.scheduler.admission import OVERLOADED, ConcurrencyCount

from .errors import ApiError

#: seconds a client is told to wait before retrying (Retry-After)
RETRY_AFTER_S = 1


class Slot:
    """One admitted request's place; :meth:`release` gives it back (idempotent)."""

    __slots__ = ("_limiter", "client")

    def __init__(self, limiter: ConcurrencyLimiter, client: str | None):
        self._limiter = limiter
        self.client = client

    def release(self) -> None:
        lim, self._limiter = self._limiter, None
        if lim is not None:
            lim._release(self.client)


class ConcurrencyLimiter:
    def __init__(self, max_total: int, max_per_client: int):
        self.count = ConcurrencyCount(max_total, max_per_client)

    @property
    def max_total(self) -> int:
        return self.count.max_total

    @property
    def max_per_client(self) -> int:
        return self.count.max_per_client

    @property
    def total(self) -> int:
        return self.count.total

    @property
    def per_client(self) -> dict[str, int]:
        return self.count.per_client

    def acquire(self, client: str | None) -> Slot:
        """A slot for one request of ``client`` (None: open access, no per-client limit),
        or ApiError 429 (``code`` says which limit)."""
        why = self.count.acquire(client)
        if why == OVERLOADED:
            raise ApiError(429, f"the dispatcher is serving its maximum of {self.max_total} concurrent "
                                f"requests; retry after {RETRY_AFTER_S} s", code="too_many_concurrent_requests",
                           headers={"retry-after": str(RETRY_AFTER_S)})
        if why is not None:
            raise ApiError(429, f"this API key's client has {self.per_client.get(client, 0)} requests in "
                                f"progress, the most it may have at once ({self.max_per_client}); retry after "
                                f"{RETRY_AFTER_S} s", code="too_many_concurrent_requests_for_key",
                           headers={"retry-after": str(RETRY_AFTER_S)})
        return Slot(self, client)

    def _release(self, client: str | None) -> None:
        self.count.release(client)

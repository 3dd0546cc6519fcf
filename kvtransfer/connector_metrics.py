"""Prometheus metrics of the KV connector, served on the worker's own ``/metrics``.

The connector's worker side runs in vLLM's engine process, the HTTP server in
another; the worker launcher (``prefill/worker.py``) sets
``PROMETHEUS_MULTIPROC_DIR`` so vLLM's ``/metrics`` collects these beside its
own (see ``prefill/sched_metrics.py`` for the same arrangement). Without
``prometheus_client`` (or outside a worker) they are no-ops.

==============================================  =========================================
metric                                          meaning
==============================================  =========================================
``proserve:kv_sent_bytes_total``                KV payload bytes handed to the transport
``proserve:kv_send_failures_total{dest,reason}``  producer transfers that failed, by destination
``proserve:kv_destination_up{dest}``            1 while a destination's circuit breaker is
                                                closed, 0 while it is open
``proserve:kv_received_transfers_total``        consumer transfers checked and injected
``proserve:kv_received_bytes_total``            their payload bytes
``proserve:kv_load_failures_total{reason}``     consumer loads that failed (timeout,
                                                transfer_failed, rejected, inject_error):
                                                the prompt was recomputed (or the request
                                                failed with ``--kv-failure fail``)
==============================================  =========================================
"""

from __future__ import annotations

_METRICS: "ConnectorMetrics | None" = None


class ConnectorMetrics:
    def __init__(self) -> None:
        try:
            from prometheus_client import Counter, Gauge
        except ImportError:  # pragma: no cover - prometheus_client comes with vLLM
            self._m = None
            return
        self._m = {
            "sent": Counter("proserve:kv_sent_bytes", "KV payload bytes handed to the transport"),
            "send_failed": Counter("proserve:kv_send_failures", "KV transfers that failed on the producer",
                                   ["dest", "reason"]),
            "up": Gauge("proserve:kv_destination_up", "1 while the destination's circuit breaker is closed",
                        ["dest"], multiprocess_mode="mostrecent"),
            "received": Counter("proserve:kv_received_transfers", "KV transfers checked and injected"),
            "received_bytes": Counter("proserve:kv_received_bytes", "Payload bytes of injected KV transfers"),
            "load_failed": Counter("proserve:kv_load_failures", "KV loads that failed on the consumer",
                                   ["reason"]),
        }

    def sent(self, nbytes: int) -> None:
        if self._m:
            self._m["sent"].inc(nbytes)

    def send_failed(self, dest: str, reason: str) -> None:
        if self._m:
            self._m["send_failed"].labels(dest, reason).inc()

    def destination(self, dest: str, up: bool) -> None:
        if self._m:
            self._m["up"].labels(dest).set(1 if up else 0)

    def received(self, nbytes: int) -> None:
        if self._m:
            self._m["received"].inc()
            self._m["received_bytes"].inc(nbytes)

    def load_failed(self, reason: str) -> None:
        if self._m:
            self._m["load_failed"].labels(reason).inc()


def get() -> ConnectorMetrics:
    """The process's metrics (Prometheus allows each name once per process)."""
    global _METRICS
    if _METRICS is None:
        _METRICS = ConnectorMetrics()
    return _METRICS

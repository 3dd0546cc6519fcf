"""The dispatcher's Prometheus metrics (``GET /metrics``), named like the
workers' (``proserve:...``; vLLM's are ``vllm:...``).

Per priority class: requests by outcome, TTFT and TPOT histograms (as the
client sees them: measured at the dispatcher, from arrival to the token leaving
it), TDG gained and missed (Eq. 3, with the dispatcher's gain weights; a
non-streamed response delivers all its tokens at once, and is scored so).
Per instance: routing decisions, the PrefillQueueMap length, β, free KV
blocks, health. Routing decision time, and GoRouting's branch (Alg. 2 lines
13/15/17/19) per decision.

Admission control (``proserve.scheduler.admission``, when configured): every decision
per class the request came in, ``admission{priority, decision, reason}`` with decision
admit, queue (no instance meets its TTFT SLO: queued anyway), downgrade (served in a
lower class; its other metrics count in that class) or reject (429), and reason ``-``,
slo_unreachable or queue_full.

Hardening: requests refused before routing by reason (``rejected``: auth,
body_too_large, body_timeout, header_timeout, overloaded, client_overloaded,
bad_json, and admission control's slo_unreachable, queue_full; admin_auth), timeouts by
kind (header, body, stream_idle, request), health checks per instance by
result (ok, timeout_progressing, timeout, refused, bad_status, unauthorized,
bad_answer), failed /metrics scrapes, KV fallbacks
(decode legs sent without the pushed KV), the stream queues' back-pressure
waits and high-water mark, requests a client abandoned (upstream cancelled).

Membership (issue 15): workers added, drained, resumed and removed at run time
(``membership_changes{role, action, source}``, source admin or discover), a gauge of the
draining ones, and failed DNS resolutions (``discovery_errors{host, reason}``: timeout,
error, empty, too_many). A removed worker's gauges leave the page once its last request
ends; its counters stay.

KV-cache events (issue 14, prefill workers with ``kv_events``): events per instance by
result (``kv_events{instance, result}``: applied, ignored, malformed) and the times its
event-driven prefix index was cleared (``kv_event_resets{instance, reason}``: gap,
restart, reconnect, lost, malformed).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
_ROUTE_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("proserve:dispatcher_requests", "Requests that ended, by class and outcome "
                                "(ok, client_error, auth_error, rejected (429: concurrency limits, class '-'; "
                                "admission control, the class asked for), upstream_error, timeout, "
                                "cancelled (the client went away), internal_error)",
                                ["priority", "outcome"], registry=r)
        self.retries = Counter("proserve:dispatcher_retries", "Requests retried on another instance",
                               ["role"], registry=r)
        self.in_flight = Gauge("proserve:dispatcher_requests_in_flight", "Requests being served", registry=r)
        self.ttft = Histogram("proserve:dispatcher_ttft_seconds", "Time to first token at the dispatcher",
                              ["priority"], buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("proserve:dispatcher_tpot_seconds", "Mean time per output token after the first",
                              ["priority"], buckets=_TPOT_BUCKETS, registry=r)
        self.tokens = Counter("proserve:dispatcher_output_tokens", "Output tokens delivered",
                              ["priority"], registry=r)
        self.tdg_gained = Counter("proserve:dispatcher_tdg_gained", "TDG gained (Eq. 3)", ["priority"], registry=r)
        self.tdg_missed = Counter("proserve:dispatcher_tdg_missed", "TDG missed: ideal gain of the delivered "
                                  "tokens minus the gain they earned", ["priority"], registry=r)
        self.slo_met = Counter("proserve:dispatcher_slo_attained", "Requests with TTFT and TPOT both under SLO",
                               ["priority"], registry=r)
        self.routed = Counter("proserve:dispatcher_routed", "Routing decisions per instance",
                              ["role", "instance"], registry=r)
        self.branch = Counter("proserve:dispatcher_route_branch", "GoRouting branch taken (Alg. 2; scored: choose=scorers)",
                              ["branch"], registry=r)
        self.route_time = Histogram("proserve:dispatcher_route_seconds", "Routing decision time",
                                    buckets=_ROUTE_BUCKETS, registry=r)
        self.queue = Gauge("proserve:dispatcher_prefill_queue", "Requests in PrefillQueueMap[p]",
                           ["instance"], registry=r)
        self.beta = Gauge("proserve:dispatcher_instance_beta", "Online correction beta reported by a prefill "
                          "instance", ["instance"], registry=r)
        self.free_blocks = Gauge("proserve:dispatcher_decode_free_kv_blocks", "Free KV blocks of a decode "
                                 "instance (last poll, minus dispatched since)", ["instance"], registry=r)
        self.healthy = Gauge("proserve:dispatcher_instance_healthy", "1 if the instance is in the candidate set",
                             ["role", "instance"], registry=r)
        self.rejected = Counter("proserve:dispatcher_rejected", "Requests refused before routing, by reason "
                                "(auth 401, body_too_large 413, body_timeout 408, header_timeout (connection "
                                "closed), overloaded / client_overloaded 429, bad_json 400: unparsable body, "
                                "slo_unreachable / queue_full 429: admission control, admin_auth: an admin API call without "
                                "the admin key, 401/403)",
                                ["reason"], registry=r)
        self.admission = Counter("proserve:dispatcher_admission", "Admission decisions per class the request "
                                 "came in (when admission control is configured): admit, queue (no instance can "
                                 "meet its TTFT SLO; queued anyway), downgrade (served in a lower class), reject "
                                 "(429); reason: - (met in time), slo_unreachable, queue_full",
                                 ["priority", "decision", "reason"], registry=r)
        self.timeouts = Counter("proserve:dispatcher_timeouts", "Timeouts by kind: header, body (client side); "
                                "stream_idle, request (towards the workers)", ["kind"], registry=r)
        self.health_checks = Counter("proserve:dispatcher_health_checks", "Health checks by result: ok, "
                                     "timeout_progressing (slow /health while requests progress: not a failure), "
                                     "timeout, refused, bad_status, unauthorized, bad_answer",
                                     ["instance", "result"], registry=r)
        self.broken_connections = Counter("proserve:dispatcher_broken_connections", "Established connections "
                                          "to a worker that broke during a request (that request failed or was "
                                          "retried; the worker was checked at once)", ["instance"], registry=r)
        self.scrape_failures = Counter("proserve:dispatcher_scrape_failures", "Failed /metrics scrapes (the "
                                       "previous stats are kept; never a health failure)", ["instance", "reason"],
                                       registry=r)
        self.kv_fallbacks = Counter("proserve:dispatcher_kv_fallbacks", "Decode legs sent without the KV "
                                    "because the prefill worker reported a failed push (the decode worker "
                                    "recomputes the prompt)", ["decode", "reason"], registry=r)
        self.backpressure = Counter("proserve:dispatcher_stream_backpressure", "Times an upstream stream's "
                                    "read waited for the client (its queue was full)", registry=r)
        self.membership = Counter("proserve:dispatcher_membership_changes", "Workers added, drained, resumed "
                                  "and removed at run time (source: admin API or DNS discovery)",
                                  ["role", "action", "source"], registry=r)
        self.discovery_errors = Counter("proserve:dispatcher_discovery_errors", "DNS discovery resolutions that "
                                        "failed (the current workers are kept), by reason: timeout, error, empty "
                                        "(no address), too_many", ["host", "reason"], registry=r)
        self.draining = Gauge("proserve:dispatcher_instance_draining", "1 if the instance is draining (takes no "
                              "new requests)", ["role", "instance"], registry=r)
        self.queue_peak = Gauge("proserve:dispatcher_stream_queue_peak_events", "Most events any stream's "
                                "queue held at once since start (bounded by stream_queue_events)", registry=r)
        # the precise prefix index (issue 14, proserve.dispatcher.kv_events)
        self.kv_events = Counter("proserve:dispatcher_kv_events", "KV-cache events of a prefill worker "
                                 "(its --kv-events-port) by result: applied (to its prefix index), ignored "
                                 "(well-formed but not indexable: LoRA or extra-key blocks, another medium or "
                                 "KV group, a parent never seen, no index yet), malformed (dropped; an "
                                 "undecodable batch counts once)", ["instance", "result"], registry=r)
        self.kv_event_resets = Counter("proserve:dispatcher_kv_event_resets", "Times a prefill worker's "
                                       "event-driven prefix index was cleared as no longer trustworthy, by "
                                       "reason: gap (batches skipped), restart (numbering went back), reconnect, "
                                       "lost (an undecodable batch), malformed (an event that could not be "
                                       "applied)", ["instance", "reason"], registry=r)
        # several dispatchers (issue 15, proserve.dispatcher.publication)
        self.publications = Counter("proserve:dispatcher_publications", "Queue publications of a prefill "
                                    "worker (several dispatchers) by result: ok (applied to the router's view), "
                                    "malformed (dropped), stale (none for publication_stale_intervals: the "
                                    "dispatcher's own view of the worker again)", ["instance", "result"], registry=r)
        self.publication_foreign = Counter("proserve:dispatcher_publication_foreign_requests", "Requests other "
                                           "dispatchers sent to a prefill worker, first seen in its queue "
                                           "publications", ["instance"], registry=r)
        self.publication_fresh = Gauge("proserve:dispatcher_publication_fresh", "1 while a prefill worker's queue "
                                       "publications arrive in time (the router's view of it is the publication "
                                       "plus this dispatcher's own dispatches)", ["instance"], registry=r)
        #: the high-water mark itself, a plain int (updated per event; exported on render)
        self.stream_queue_peak = 0

    def render(self, registry) -> bytes:
        for w in registry.prefill:
            self.queue.labels(w.name).set(len(w.state.queue))
            self.beta.labels(w.name).set(w.beta)
            self.healthy.labels(w.role, w.name).set(1 if w.healthy else 0)
            self.draining.labels(w.role, w.name).set(1 if w.draining else 0)
        for w in registry.decode:
            self.free_blocks.labels(w.name).set(w.state.free_blocks)
            self.healthy.labels(w.role, w.name).set(1 if w.healthy else 0)
            self.draining.labels(w.role, w.name).set(1 if w.draining else 0)
        self.queue_peak.set(self.stream_queue_peak)
        return generate_latest(self.registry)

    def forget(self, w) -> None:
        """Worker ``w`` left: its series leave the page, gauges and per-instance counters alike
        (under DNS discovery pods come and go: kept, they would grow the page without bound)."""
        for gauge, labels in ((self.queue, (w.name,)), (self.beta, (w.name,)), (self.free_blocks, (w.name,)),
                              (self.healthy, (w.role, w.name)), (self.draining, (w.role, w.name))):
            try:
                gauge.remove(*labels)
            except KeyError:
                pass
        for counter in (self.routed, self.broken_connections, self.health_checks, self.scrape_failures,
                        self.kv_events, self.kv_event_resets):
            names = counter._labelnames          # prometheus_client keeps no public label-set list
            at = names.index("instance")
            for labels in [k for k in list(counter._metrics) if k[at] == w.name]:
                try:
                    counter.remove(*labels)
                except KeyError:
                    pass

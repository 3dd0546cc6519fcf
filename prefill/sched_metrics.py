"""Prometheus metrics of the scheduler plugin, served on the worker's own ``/metrics``.

The plugin runs in vLLM's engine-core process, the HTTP server in another. The
worker launcher sets ``PROMETHEUS_MULTIPROC_DIR`` (a fresh directory per
launch), which makes vLLM's ``/metrics`` collect every process's samples, so
these appear beside vLLM's own ``vllm:*`` metrics. Without it (an engine
started some other way) they are still kept, in the engine process's registry.

=========================================  =========================================
metric                                     meaning
=========================================  =========================================
``proserve:beta``                          online correction factor β (§4.1)
``proserve:step_offset_seconds``           the correction's per-step offset δ (0 under
                                           the scale-only correction): a step is
                                           estimated at β·T_pd + δ
``proserve:t_budget_seconds``              latency budget of the latest plan (Alg. 1 l.7)
``proserve:urgent_requests``               URGENT requests in the latest plan
``proserve:normal_requests``               NORMAL requests in the latest plan
``proserve:last_step_estimate_seconds``    β·T_pd of the latest executed batch
``proserve:last_step_seconds``             its measured time
``proserve:steps_total``                   executed steps
``proserve:step_seconds_total``            sum of measured step times
``proserve:schedule_seconds_total``        sum of time spent in ``schedule()`` (policy
                                           + vLLM); over ``step_seconds_total`` it is
                                           the scheduling overhead
=========================================  =========================================
"""

from __future__ import annotations

import math

from prometheus_client import Counter, Gauge

_FAMILIES: dict | None = None


def _families() -> dict:
    """The metric families, registered once per process (Prometheus allows no duplicates)."""
    global _FAMILIES
    if _FAMILIES is None:
        def gauge(name, doc):
            return Gauge(name, doc, ["policy"], multiprocess_mode="mostrecent")

        _FAMILIES = {
            "beta": gauge("proserve:beta", "Online latency-correction factor beta (PROSERVE §4.1)"),
            "delta": gauge("proserve:step_offset_seconds",
                           "Per-step offset delta of the online latency correction (beta*T_pd + delta)"),
            "t_budget": gauge("proserve:t_budget_seconds", "Latency budget of the latest batch plan"),
            "urgent": gauge("proserve:urgent_requests", "URGENT requests in the latest batch plan"),
            "normal": gauge("proserve:normal_requests", "NORMAL requests in the latest batch plan"),
            "est": gauge("proserve:last_step_estimate_seconds", "Corrected estimate of the latest batch's time"),
            "real": gauge("proserve:last_step_seconds", "Measured time of the latest batch"),
            "steps": Counter("proserve:steps", "Executed engine steps", ["policy"]),
            "step_total": Counter("proserve:step_seconds", "Sum of measured step times", ["policy"]),
            "sched_total": Counter("proserve:schedule_seconds", "Sum of time spent in schedule()", ["policy"]),
        }
    return _FAMILIES


def for_policy(policy: str, estimator=None) -> "SchedulerMetrics":
    return SchedulerMetrics(policy, estimator)


class SchedulerMetrics:
    """The metrics of one engine, labelled with its local policy. Given the engine's
    :class:`~proserve.scheduler.estimator.Estimator`, it also reports the correction's offset δ."""

    def __init__(self, policy: str, estimator=None):
        for key, family in _families().items():
            setattr(self, key, family.labels(policy=policy))
        self._estimator = estimator
        self.beta.set(1.0)
        self.delta.set(0.0)

    def plan(self, info, beta: float) -> None:
        if not math.isnan(info.t_budget):
            self.t_budget.set(info.t_budget)
        self.urgent.set(info.n_urgent)
        self.normal.set(info.n_normal)
        self.beta.set(beta)

    def step(self, t_real: float, t_est: float, beta: float, sched_s: float) -> None:
        self.beta.set(beta)
        if self._estimator is not None:
            self.delta.set(self._estimator.delta)
        self.est.set(t_est)
        self.real.set(t_real)
        self.steps.inc()
        self.step_total.inc(t_real)
        self.sched_total.inc(sched_s)

"""Admission control: what happens to a request that no instance can serve within its
TTFT SLO, or that finds every queue over a cap. One rule, pure (no I/O), called by the
dispatcher before it routes a request and by the simulator at the same point, so both
take the same decision from the same state (tests/test_admission_dispatcher.py).

**The overload test.** ``Δ_p`` of Algorithm 2 (lines 2-7: ``ESTIMATEGAIN(Q ∪ {req}) −
ESTIMATEGAIN(Q)``, :func:`proserve.scheduler.routing.estimates.evaluate`) for every
instance the request may go to. ``Δ_max > 0``: some instance gains from serving it (it
meets its TTFT SLO there without pushing more weight of queued requests past theirs);
the request is admitted. ``Δ_max ≤ 0`` is GoRouting's fallback branch (line 19): no
instance can serve it in time, and its class's ``on_overload`` action decides:

* ``queue`` (the default, what every class did before admission control existed): it
  is routed anyway and waits;
* ``reject``: it is refused before any prefill work is spent (the dispatcher answers
  HTTP 429 with ``Retry-After``; the simulator ends it with an error);
* ``downgrade``: it is served in the next class down by weight (that class's weight and
  SLOs), and the test is run again there: admitted when the lower class's SLOs can be
  met, else the lower class's own ``on_overload`` applies (a downgraded request may be
  downgraded again, queued, or rejected).

The test reads the same estimate whatever the routing policy, so it works under
Min-Load or round robin too; under GoRouting it agrees with the branch the router will
take (the router sees the same instances, state and time).

**Caps (optional).** ``max_queued_requests`` and ``max_queued_tokens`` bound, per
prefill (or co-located) instance, the requests in ``PrefillQueueMap[p]`` and their
queued prompt tokens (as known at dispatch). An instance at a cap takes no new
request; the request is routed among the others. An instance under the caps takes a
request even if it goes over them (one long prompt; or the parts of one client request
the dispatcher split, ``n`` > 1 or a prompt list, which it decides for all at once,
before any is queued: see ``proserve.dispatcher.fanout``). When every instance is at a cap the
request is refused (reason ``queue_full``) whatever its class: queueing would pass the
cap, and a lower class would queue in the same full queues, so no action can fit it.

**Decisions** (for the metrics): ``admit``, ``queue`` (Δ_max ≤ 0, routed anyway),
``reject`` (with a reason: ``slo_unreachable`` or ``queue_full``), ``downgrade``
(served in a lower class). The dispatcher's concurrency limits (``max_concurrent``,
``max_concurrent_per_key``) answer 429 earlier, before the request's class is read;
:class:`ConcurrencyCount` is their count, shared with the simulator's
``--max-concurrent``/``--max-concurrent-per-class`` so that a simulated overload ends
the requests the real one ends (reasons ``overloaded`` and ``client_overloaded``).

Scoring convention (simulator and load generator alike): a refused request is one of
the workload's requests that got no token, so it adds its ideal gain to the
denominator of TDG_Ratio, nothing to the numerator, and misses its SLO; a downgraded
request is scored in the class it came in (its weight and SLOs), as the client sees
it. The dispatcher's own per-class serving metrics count a downgraded request in the
class it was served in; ``admission{decision="downgrade"}`` counts it in its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from . import validate
from .request import ConfigError, PriorityClass, Request
from .routing.base import PrefillInstance
from .routing.estimates import DEADLINE, evaluate, order_of, queued_work, resolve_eta, resolve_order
from .tdg import GainConfig

#: what a class does when no instance can meet a request's TTFT SLO
QUEUE, REJECT, DOWNGRADE = "queue", "reject", "downgrade"
ACTIONS = (QUEUE, REJECT, DOWNGRADE)
#: decision labels (metrics): ``queue`` means "overloaded, routed anyway"
ADMIT = "admit"
DECISIONS = (ADMIT, QUEUE, REJECT, DOWNGRADE)
#: why a request was refused, or queued although overloaded
SLO_UNREACHABLE = "slo_unreachable"
QUEUE_FULL = "queue_full"
OVERLOADED = "overloaded"                 # the overall concurrency limit
CLIENT_OVERLOADED = "client_overloaded"   # a client's (key's; in the simulator, a class's) limit
#: bounds of the Retry-After hint, seconds
MIN_RETRY_AFTER_S, MAX_RETRY_AFTER_S = 1, 60


@dataclass(frozen=True)
class AdmissionConfig:
    """Per-class ``on_overload`` actions (a class not named queues) and the per-instance caps."""

    on_overload: Mapping[str, str] = field(default_factory=dict)
    max_queued_requests: int | None = None
    max_queued_tokens: int | None = None

    def action(self, cls: str) -> str:
        return self.on_overload.get(cls, QUEUE)

    @property
    def capped(self) -> bool:
        return self.max_queued_requests is not None or self.max_queued_tokens is not None

    @property
    def active(self) -> bool:
        """Whether the rule can change anything: off, nothing is computed per request."""
        return self.capped or any(a != QUEUE for a in self.on_overload.values())

    def check(self, classes: Mapping[str, PriorityClass], where: str = "admission") -> "AdmissionConfig":
        """Validate against the configured classes; returns ``self``."""
        if not isinstance(self.on_overload, Mapping):
            validate.fail(where, "on_overload", "a mapping of class name to action", self.on_overload)
        for name, action in self.on_overload.items():
            if name not in classes:
                validate.fail(where, "on_overload", f"keyed by configured classes ({', '.join(classes)})", name)
            validate.one_of(where, f"{name}.on_overload", action, ACTIONS)
            if action == DOWNGRADE and lower_class(classes, name) is None:
                raise ConfigError(f"{where}: {name}.on_overload = \"downgrade\" needs a class of lower weight "
                                  f"than {name!r} (weight {classes[name].weight:g}) to serve it in")
        for k in ("max_queued_requests", "max_queued_tokens"):
            v = getattr(self, k)
            if v is not None:
                validate.integer(where, k, v)
        return self


def lower_class(classes: Mapping[str, PriorityClass], name: str) -> PriorityClass | None:
    """The next class down by weight from ``name`` (the heaviest class lighter than it;
    ties by name), or None if ``name`` is the lightest."""
    w = classes[name].weight
    below = [c for c in classes.values() if c.weight < w]
    return max(below, key=lambda c: (c.weight, c.name)) if below else None


def parse_actions(items: Iterable[str] | None, where: str = "--on-overload") -> dict[str, str]:
    """``["low=reject", "mid=downgrade,high=queue"]`` (a repeatable flag, each item
    comma-separated) as ``{class: action}``; the classes are checked by :meth:`AdmissionConfig.check`."""
    out: dict[str, str] = {}
    for item in items or []:
        for part in str(item).split(","):
            part = part.strip()
            if not part:
                continue
            name, sep, action = part.partition("=")
            if not sep or not name.strip():
                raise ConfigError(f"{where} expects CLASS=ACTION (ACTION one of {', '.join(ACTIONS)}), got {part!r}")
            out[name.strip()] = validate.one_of(where, name.strip(), action.strip(), ACTIONS)
    return out


@dataclass
class AdmissionDecision:
    """What to do with one request."""

    decision: str                      # admit | queue | reject | downgrade
    asked: str                         # the class the request came in
    served: PriorityClass | None       # the class it is served in (None: refused, or unknown class)
    reason: str | None = None          # None (admitted in time), slo_unreachable, queue_full
    instances: list = field(default_factory=list)   # where it may be routed (under the caps)
    retry_after_s: int | None = None   # refused: a hint for Retry-After, seconds
    delta_max: float = math.nan        # Δ_max of the last test run (NaN: not run)

    @property
    def refused(self) -> bool:
        return self.decision == REJECT


class Admission:
    """The admission rule of one body (the dispatcher, or a simulated cluster).

    ``gain``, ``deployment``, ``eta`` and ``order`` are the router's (``eta``: the co-located
    t_budget floor, default the tightest class TPOT SLO, as GoRouting's; ``order``: the local
    queue order its ESTIMATEGAIN assumes, default the paper's), so that the test reads the
    estimate the router reads.
    """

    def __init__(self, config: AdmissionConfig, classes: Mapping[str, PriorityClass], gain: GainConfig,
                 deployment: str, eta: float | None = None, order: str = DEADLINE):
        self.config = config.check(classes)
        self.classes = dict(classes)
        self.gain = gain
        self.deployment = deployment
        self.eta = resolve_eta(eta, self.classes, "admission")
        self.order = resolve_order(order, "admission")

    # -- caps --------------------------------------------------------------------------------
    def has_room(self, p: PrefillInstance) -> bool:
        """Whether ``p`` is under both caps (a request may take it over them)."""
        c = self.config
        if c.max_queued_requests is not None and len(p.queue) >= c.max_queued_requests:
            return False
        if c.max_queued_tokens is not None and queued_tokens(p) >= c.max_queued_tokens:
            return False
        return True

    # -- the decision ------------------------------------------------------------------------------
    def decide(self, req: Request, prefills: Sequence[PrefillInstance], now: float) -> AdmissionDecision:
        """Admit, queue, downgrade or refuse ``req`` arriving at ``now``, given the instances it
        could be routed to (at least one)."""
        asked = req.priority
        room = [p for p in prefills if self.has_room(p)] if self.config.capped else list(prefills)
        if not room:
            ests = [evaluate(p, req, now, self.gain, self.deployment, self.eta, with_gain=False) for p in prefills]
            return AdmissionDecision(REJECT, asked, None, QUEUE_FULL, [], _retry_after(ests))
        cls = self.classes.get(asked)
        probe = req
        while True:
            ests = [evaluate(p, probe, now, self.gain, self.deployment, self.eta,
                             order=order_of(self.order, p)) for p in room]
            delta_max = max(e.delta for e in ests)
            moved = cls is not None and cls.name != asked
            if delta_max > 0:                                   # Alg. 2 line 9: some instance meets it
                return AdmissionDecision(DOWNGRADE if moved else ADMIT, asked, cls, None, room,
                                         delta_max=delta_max)
            action = self.config.action(cls.name) if cls is not None else QUEUE
            if action == QUEUE:
                return AdmissionDecision(DOWNGRADE if moved else QUEUE, asked, cls, SLO_UNREACHABLE, room,
                                         delta_max=delta_max)
            if action == REJECT:
                return AdmissionDecision(REJECT, asked, None, SLO_UNREACHABLE, [], _retry_after(ests), delta_max)
            cls = lower_class(self.classes, cls.name)           # downgrade: validated to exist
            probe = as_class(req, cls)


def queued_tokens(p: PrefillInstance) -> int:
    """Prompt tokens still to prefill in ``PrefillQueueMap[p]``, as known at dispatch."""
    return sum(queued_work(p, r)[0] for r in p.queue)


def as_class(req: Request, cls: PriorityClass) -> Request:
    """A copy of a not yet routed ``req`` in class ``cls`` (its weight and SLOs), to test."""
    return Request(id=req.id, priority=cls.name, weight=cls.weight, ttft_slo=cls.ttft_slo, tpot_slo=cls.tpot_slo,
                   arrival=req.arrival, prompt_len=req.prompt_len, output_len=req.output_len,
                   prefill_len=req.prefill_len, prefilled=req.prefilled, kv_len=req.kv_len)


def serve_in(req: Request, cls: PriorityClass) -> None:
    """Move ``req`` into class ``cls`` (a downgrade): its weight and SLOs become the class's."""
    req.priority, req.weight, req.ttft_slo, req.tpot_slo = cls.name, cls.weight, cls.ttft_slo, cls.tpot_slo


def _retry_after(ests) -> int:
    """Seconds until the least loaded instance has worked off its current backlog
    (ESTIMATEEXEC), rounded up, within [MIN_RETRY_AFTER_S, MAX_RETRY_AFTER_S]."""
    wait = min((e.exec for e in ests), default=0.0)
    if not math.isfinite(wait):
        return MAX_RETRY_AFTER_S
    return int(min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, math.ceil(wait))))


class ConcurrencyCount:
    """Requests in progress, overall and per client, against two limits (None: no limit).

    The dispatcher's concurrency limits (``proserve.dispatcher.limits``) count with it,
    one client per API key's client; the simulator counts with it too, one client per
    priority class (a load generator sends each class with one key)."""

    __slots__ = ("max_total", "max_per_client", "total", "per_client")

    def __init__(self, max_total: int | None = None, max_per_client: int | None = None):
        self.max_total = max_total
        self.max_per_client = max_per_client
        self.total = 0
        self.per_client: dict[str, int] = {}

    def refusal(self, client: str | None) -> str | None:
        """Why a new request of ``client`` (None: no client, only the overall limit) would be
        refused now (``overloaded``, ``client_overloaded``), or None."""
        if self.max_total is not None and self.total >= self.max_total:
            return OVERLOADED
        if client is not None and self.max_per_client is not None \
                and self.per_client.get(client, 0) >= self.max_per_client:
            return CLIENT_OVERLOADED
        return None

    def acquire(self, client: str | None) -> str | None:
        """Count a new request in, or say why not (as :meth:`refusal`; nothing counted then)."""
        why = self.refusal(client)
        if why is None:
            self.total += 1
            if client is not None:
                self.per_client[client] = self.per_client.get(client, 0) + 1
        return why

    def release(self, client: str | None) -> None:
        self.total -= 1
        if client is not None:
            n = self.per_client[client] - 1
            if n:
                self.per_client[client] = n
            else:
                del self.per_client[client]

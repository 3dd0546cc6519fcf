"""The interface every local (engine-level) batch policy implements.

Each step the body (the simulator's instance, or the vLLM scheduler plugin)
hands the policy an :class:`InstanceView` — the requests waiting for prefill
(including partially prefilled ones), the requests decoding, the free KV
blocks — and gets back a :class:`BatchPlan`: per-request prefill chunk sizes,
the decode requests to run, and :class:`ScheduleInfo` saying why (latency
budget, urgent/normal counts) for logs and plots.

Policies never mutate request state; what they compute about each request in a
step stays with the policy (``BatchPlan.terms`` shows it); the body applies
the plan through the ``Request`` methods. What every body does around a plan
(the view with its admission reserve, the tokens each request runs, β, the
policy's notifications) is :class:`proserve.scheduler.host.LocalHost`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Mapping

from ..estimator import Estimator
from ..request import PriorityClass, Request
from ..tdg import GainConfig

COLOCATED = "colocated"        # PD co-located: prefill chunks and decodes share a batch
PREFILL_ONLY = "prefill_only"  # PD disaggregated prefill instance
MODES = (COLOCATED, PREFILL_ONLY)


@dataclass
class InstanceView:
    now: float
    waiting: list[Request]       # need prefill; partially prefilled ones hold KV already
    decoding: list[Request] = field(default_factory=list)
    free_blocks: int = 1 << 30
    block_size: int = 16
    mode: str = COLOCATED
    #: blocks a *new* request may not take: headroom for running requests to grow
    #: (vLLM keeps a watermark for the same reason; without one, admitting prompts
    #: until memory is full makes every decode step preempt)
    reserve_blocks: int = 0


@dataclass
class ScheduleInfo:
    t_budget: float = float("nan")   # latency budget (Alg. 1 line 7), or NaN for token-budget policies
    token_budget: int = 0            # token budget, 0 when the policy uses a latency budget
    n_urgent: int = 0
    n_normal: int = 0
    est_time: float = 0.0            # β-corrected estimate of the batch's time


@dataclass
class StepTerms:
    """What a policy computed about each queued request for one step (Alg. 1 lines 3-12):
    ``exec``, ``remain``, ``density`` and URGENT, as parallel lists over ``requests``.
    It belongs to the policy's decision, not to the requests: bodies read it only to
    record or show why a plan came out as it did."""

    requests: list[Request]
    exec: list[float]
    remain: list[float]
    density: list[float]
    urgent: list[bool]

    def of(self) -> dict[str, tuple[float, float, float, bool]]:
        """request id -> (exec, remain, density, urgent)."""
        return {r.id: t for r, t in zip(self.requests, zip(self.exec, self.remain, self.density, self.urgent))}

    def urgent_ids(self) -> set[str]:
        return {r.id for r, u in zip(self.requests, self.urgent) if u}


@dataclass
class BatchPlan:
    prefill: list[tuple[Request, int]] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)
    info: ScheduleInfo = field(default_factory=ScheduleInfo)
    #: the per-request terms behind the decision, for policies that compute them (else None)
    terms: StepTerms | None = None
    #: ids a policy without terms marks (UniBoost: the MemGuard-pinned requests)
    marked: set[str] | None = None

    def urgent_ids(self) -> set[str]:
        """The requests the policy set apart this step: URGENT (SlideBatching), the
        running group (GMAX), pinned (UniBoost); empty for the others."""
        if self.terms is not None:
            return self.terms.urgent_ids()
        return set(self.marked or ())

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.prefill) + len(self.decode)


def admission_reserve(n_decoding: int, total_blocks: int, idle: bool = False) -> int:
    """``InstanceView.reserve_blocks`` as every body sets it: one block of growth per
    running decode plus 1 % of the cache, kept from new requests so that admitting
    prompts does not make the next decode steps preempt; none on an ``idle`` instance
    (nothing holds KV), so that any request that fits the cache can start there (vLLM
    applies its watermark only while something is scheduled, for the same reason)."""
    if idle:
        return 0
    return n_decoding + total_blocks // 100


def blocks_for(req: Request, n_tokens: int, block_size: int) -> int:
    """New KV blocks ``req`` needs to grow by ``n_tokens``."""
    return math.ceil((req.kv_len + n_tokens) / block_size) - math.ceil(req.kv_len / block_size)


class BatchBuilder:
    """Accumulates a batch while tracking estimated time, tokens and KV blocks."""

    def __init__(self, view: InstanceView, est: Estimator):
        self.view = view
        self.est = est
        self.plan = BatchPlan()
        self.time = est.t_c          # Alg. 1 line 14: t_batch ← t_c
        self.tokens = 0
        self.free_blocks = view.free_blocks

    def add_decode(self, req: Request) -> bool:
        need = blocks_for(req, 1, self.view.block_size)
        if need > self.free_blocks:
            return False
        self.free_blocks -= need
        self.plan.decode.append(req)
        self.time += self.est.decode(req.kv_len)
        self.tokens += 1
        return True

    def available_blocks(self, req: Request) -> int:
        """Blocks ``req`` may take: all free ones if it already holds KV, else those above the reserve."""
        return self.free_blocks if req.holds_kv else self.free_blocks - self.view.reserve_blocks

    def admissible(self, req: Request) -> bool:
        """May ``req`` take KV blocks this step? One that holds KV already may; a new one
        (or one preempted back to the start) only if its whole prefill fits in the blocks
        above the reserve — vLLM's admission rule (``scheduler_reserve_full_isl``, on by
        default): a prompt admitted chunk by chunk into memory it cannot finish in would
        push running requests out, which then push it out (recompute thrash)."""
        if req.holds_kv:
            return True
        return blocks_for(req, req.remaining_prefill, self.view.block_size) <= self.available_blocks(req)

    def can_fit(self, req: Request, n_tokens: int) -> bool:
        return self.admissible(req) and blocks_for(req, n_tokens, self.view.block_size) <= self.available_blocks(req)

    def add_prefill(self, req: Request, n_tokens: int) -> int:
        """Add up to ``n_tokens`` of ``req``'s prompt, fewer if memory is short. Returns tokens added."""
        if not self.admissible(req):
            return 0
        n = min(n_tokens, req.remaining_prefill)
        bs = self.view.block_size
        avail = self.available_blocks(req)
        if n > 0 and blocks_for(req, n, bs) > avail:
            # largest chunk that fits the available blocks
            n = min(n, avail * bs + (-req.kv_len) % bs)
        if n <= 0:
            return 0
        self.free_blocks -= blocks_for(req, n, bs)
        self.plan.prefill.append((req, n))
        self.time += self.est.prefill(n, req.kv_len)
        self.tokens += n
        return n

    def grow_prefill(self, req: Request, left: float) -> int:
        """Grow ``req``'s chunk already in the batch (in place) by what ``left`` more
        seconds and the free blocks allow (GETMAXCHUNK on the whole chunk). Returns the
        tokens added."""
        for k, (r, n) in enumerate(self.plan.prefill):
            if r is req:
                bs = self.view.block_size
                old_cost = self.est.prefill(n, req.kv_len)
                m = min(self.est.get_max_chunk(req.kv_len, req.remaining_prefill, old_cost + left),
                        req.remaining_prefill)
                # the chunk's blocks are taken already; the growth must fit what req may take
                # (above the reserve if it holds no KV yet: add_prefill's rule)
                while m > n and blocks_for(req, m, bs) - blocks_for(req, n, bs) > self.available_blocks(req):
                    m = n + (m - n) // 2     # memory short: a smaller growth
                if m <= n:
                    return 0
                self.free_blocks -= blocks_for(req, m, bs) - blocks_for(req, n, bs)
                self.plan.prefill[k] = (req, m)
                self.time += self.est.prefill(m, req.kv_len) - old_cost
                self.tokens += m - n
                return m - n
        return 0

    def fill_tokens(self, ordered, budget: int) -> None:
        """Take requests in order until ``budget`` tokens: a prefill as many tokens as
        are left, a decode one; a request memory cannot hold is skipped."""
        for r in ordered:
            left = budget - self.tokens
            if left <= 0:
                break
            if r.needs_prefill:
                self.add_prefill(r, left)
            else:
                self.add_decode(r)

    def memory_left(self, req: Request) -> bool:
        return blocks_for(req, 1, self.view.block_size) <= self.free_blocks

    def finish(self, **info) -> BatchPlan:
        self.plan.info = ScheduleInfo(est_time=self.time, **info)
        return self.plan


class LocalPolicy(ABC):
    """Base class of the local policies; subclasses set ``name`` and implement ``schedule``."""

    name: ClassVar[str] = ""
    #: one-line description for --help listings
    summary: ClassVar[str] = ""
    #: the order this policy serves its queue in, as the global router models it
    #: (scheduler.routing.estimates.ORDERS): "deadline" (remain ascending, the paper's
    #: ESTIMATEGAIN and the default for any policy), "slide" (SlideBatching). Sarathi-FCFS
    #: keeps the default: "fcfs" measured no better for it (docs/results.md §2.1)
    router_order: ClassVar[str] = "deadline"

    def __init__(self, estimator: Estimator, gain: GainConfig | None = None,
                 classes: Mapping[str, PriorityClass] | None = None):
        from ..config import default_classes

        self.est = estimator
        self.gain = gain or GainConfig()
        self.classes = dict(classes or default_classes())

    @abstractmethod
    def schedule(self, view: InstanceView) -> BatchPlan:
        """Form the next batch."""

    def on_batch_done(self, plan: BatchPlan, now: float) -> None:
        """Called by the body after a planned batch ran (stateful policies override)."""

    def on_request_finished(self, req: Request, now: float) -> None:
        """Called by the body once ``req`` has emitted its last token or failed
        (``req.error`` set), on the policy of the instance that prefilled it.
        Policies that learn from completed requests (output-length quantiles,
        latency tails) override this; ``req.num_emitted`` is its true length."""

    # -- helpers shared by policies ---------------------------------------------
    def min_tpot_slo(self) -> float:
        return min(c.tpot_slo for c in self.classes.values())

    def tbt_token_budget(self) -> int:
        """Sarathi-Serve's profiled token budget: the largest prefill chunk
        whose batch (chunk + t_c) fits within the tightest TPOT SLO."""
        b = self.est.get_max_chunk(0, 1 << 20, self.min_tpot_slo() - self.est.t_c)
        return max(b, 16)

    def exec_time(self, r: Request) -> float:
        """exec (Alg. 1 line 3): T~_pd of the request's next work, without t_c."""
        return self.est.costs().next_work(r)

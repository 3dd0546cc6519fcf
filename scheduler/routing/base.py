"""The interface every global (service-level) routing policy implements, and
the PrefillQueueMap the global scheduler keeps (§4.3).

The global scheduler does not see the engines' internal state. It keeps, per
prefill instance, the list of requests it dispatched there whose prefill has
not finished yet (``PrefillQueueMap[p]``), the time of the last change to that
list (``ts_p``, for timestamp lag compensation), and in the co-located setting
the number of requests decoding there (``n_d``). Decode instances report their
free KV blocks.

Where the instances cache prefixes, the map also keeps an approximate index of
each one's cache (issue 14): the prefix blocks of the requests dispatched there,
LRU, as many as its KV memory holds (``PrefillInstance.prefix``); the work it
records for a request is net of the prefix it expects there
(:func:`expected_hit`). Approximate: blocks count as cached from dispatch on,
not from the end of the prefill, and evictions follow the router's view of
the traffic, not the engine's.

Bodies (the simulator, the dispatcher) do not call :class:`PrefillQueueMap`
themselves: they report events (dispatched, prefill finished, requeued,
released, finished) to :class:`proserve.scheduler.host.RouterHost`, which moves the map.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Mapping, Sequence

from .. import validate
from ..estimator import Estimator
from ..prefix import BlockLRU, cached_tokens
from ..request import PriorityClass, Request
from ..tdg import GainConfig

DISAGGREGATED = "disaggregated"
COLOCATED = "colocated"
DEPLOYMENTS = (DISAGGREGATED, COLOCATED)


@dataclass
class PrefillInstance:
    """What the global scheduler knows of one prefill (or co-located) instance."""

    id: int
    estimator: Estimator
    queue: list[Request] = field(default_factory=list)  # PrefillQueueMap[p]
    ts: float = 0.0                                     # ts_p: time of last queue update
    n_decode: int = 0                                   # n_d (co-located only)
    #: co-located: the mean KV length of the decodes running there, for b_d = T~_d(avg_decode_kv)
    #: (Eq. 8's n_d·b_d); kept by :meth:`PrefillQueueMap.decode_started` / ``decode_finished``
    #: from each decode's prompt length, this value until the first decode is reported
    avg_decode_kv: float = 1024.0
    decode_kv: float = 0.0         # co-located: the KV tokens of the decodes running there (sum)
    healthy: bool = True
    #: the order its local policy serves its queue in, as the router models it (LocalPolicy.router_order;
    #: routing.estimates.ORDERS): what a schedule-aware ESTIMATEGAIN assumes; "deadline" is the paper's
    order: str = "deadline"
    #: the router's approximate index of the instance's prefix cache (issue 14): the prefix blocks
    #: of the requests dispatched there, LRU, as many as ``cache_tokens`` hold; None: not kept
    prefix: BlockLRU | None = None
    cache_tokens: int = 0          # KV tokens the instance can cache (0: no index)
    block_size: int = 16           # its KV block size (hits are whole blocks)
    #: fraction of its KV blocks in use as last reported (vLLM's ``vllm:kv_cache_usage_perc``);
    #: None: not reported. Read by the cache-aware baselines that score KV utilisation.
    kv_usage: float | None = None
    #: its KV memory in tokens (num_gpu_blocks × block_size), with or without a prefix index;
    #: 0: unknown (then ``cache_tokens`` stands in). Read by :func:`kv_room`.
    kv_tokens: int = 0
    # (l_q, l_kv) of each queued request's prefill as known at dispatch, keyed by request id:
    # the global scheduler sees dispatches and completions, not chunk progress (§4.3), so
    # its work estimate is frozen here and timestamp lag compensation accounts for progress.
    dispatched: dict = field(default_factory=dict, repr=False, compare=False)
    version: int = field(default=0, repr=False, compare=False)  # bumped on every queue update
    cache: object = field(default=None, init=False, repr=False, compare=False)  # routing.estimates


#: seconds a decode instance's blocks stay promised to a request after its dispatch (unless its
#: prefill ends sooner): long enough to spread a burst routed before any of its KV lands, short
#: enough that requests queued for seconds in prefill, whose landing time nobody knows, do not
#: steer the choice (measured in the simulator, docs/results.md §7.1: no expiry lost 0.016
#: TDG_Ratio at 4P+8D, 50 req/s; 0.3 s and 1 s are level with each other)
PROMISE_S = 0.3


@dataclass
class DecodeInstance:
    id: int
    free_blocks: int = 0            # as last reported (the simulator: exact; the dispatcher: scraped)
    healthy: bool = True
    #: KV blocks promised to requests routed here whose prefill has not ended, by request id:
    #: ``(blocks, until)``. Their KV is not here yet, so the reported ``free_blocks`` does not
    #: count them (:meth:`RouterHost.dispatched` promises, ``prefill_finished``/``released``
    #: end a promise; it also lapses at ``until``)
    reserved: dict = field(default_factory=dict, repr=False, compare=False)

    def room(self, now: float) -> int:
        """Free blocks net of those promised at ``now``: the load LOADBALANCE(D) compares
        (Alg. 2 line 20). Lapsed promises are dropped here."""
        promised = 0
        for rid, (blocks, until) in list(self.reserved.items()):
            if until > now:
                promised += blocks
            else:
                del self.reserved[rid]
        return self.free_blocks - promised

    def reserve(self, rid: str, blocks: int, until: float) -> None:
        self.reserved[rid] = (blocks, until)

    def release(self, rid: str) -> None:
        self.reserved.pop(rid, None)


def decode_blocks(prompt_len: int, max_tokens: int | None, block_size: int) -> int:
    """KV blocks a request will hold on its decode instance: its prompt and at most
    ``max_tokens`` output tokens (16 when the client set no cap), whole blocks."""
    return -(-(prompt_len + (max_tokens or 16)) // max(1, block_size))   # ceil, exact for any int


def expected_hit(p: PrefillInstance, req: Request) -> int:
    """Prompt tokens of ``req`` the router expects ``p``'s prefix cache to hold: its longest
    run of leading blocks in ``p``'s index (0 without an index, for a request that has
    started, or one with no prefix blocks)."""
    if p.prefix is None or not req.prefix_blocks or req.prefilled or req.token_times:
        return 0
    return cached_tokens(req, p.prefix.peek(req.prefix_blocks), p.block_size)


def _index(p: PrefillInstance, req: Request) -> None:
    """``req``'s prefix blocks join ``p``'s index (made on first use, as many blocks of
    ``req``'s size as ``cache_tokens`` hold); nothing without an index or blocks."""
    if p.cache_tokens and req.prefix_blocks:
        if p.prefix is None:
            p.prefix = BlockLRU(p.cache_tokens // req.prefix_block_tokens)
        p.prefix.insert(req.prefix_blocks)


def kv_capacity(p: PrefillInstance) -> int:
    """``p``'s KV memory in tokens as the router knows it: ``kv_tokens``, else the prefix
    index's ``cache_tokens``; 0 when neither is known."""
    return p.kv_tokens or p.cache_tokens


def kv_room(p: PrefillInstance) -> float:
    """KV tokens ``p`` has left for new prefills, as the router sees it: its free KV memory
    (``kv_usage`` as last reported, of ``kv_tokens``, else ``cache_tokens``) less the prefill
    tokens still queued there (recorded at dispatch, net of their expected hits); ∞ where
    either is unknown. Approximate: a queued request partly prefilled counts twice (in the
    usage and the queue)."""
    capacity = kv_capacity(p)
    if p.kv_usage is None or not capacity or p.kv_usage != p.kv_usage:   # unknown, or NaN
        return math.inf
    return capacity * (1.0 - p.kv_usage) - sum(lq for lq, _ in p.dispatched.values())


class PrefillQueueMap:
    """PrefillQueueMap of §4.3 over a list of :class:`PrefillInstance`."""

    def __init__(self, instances: Sequence[PrefillInstance]):
        self.instances = list(instances)
        self._by_id = {p.id: p for p in self.instances}

    def __getitem__(self, inst_id: int) -> PrefillInstance:
        return self._by_id[inst_id]

    def add(self, inst_id: int, req: Request, now: float) -> None:
        """On dispatch: PrefillQueueMap[p].add(r). With a prefix index, the work recorded is
        what is left after the prefix ``p`` is expected to hold (:func:`expected_hit`), and
        ``r``'s blocks join the index."""
        p = self._by_id[inst_id]
        p.queue.append(req)
        hit = expected_hit(p, req)
        p.dispatched[req.id] = (req.remaining_prefill - hit, req.kv_len + hit)
        _index(p, req)
        p.version += 1
        p.ts = now

    def remove(self, inst_id: int, req: Request, now: float) -> None:
        """On the asynchronous prefill-completion signal: PrefillQueueMap[p].remove(r).

        In the co-located setting the first token also means the request starts
        decoding there: n_d += 1.
        """
        p = self._by_id[inst_id]
        try:
            p.queue.remove(req)
        except ValueError:
            return
        p.dispatched.pop(req.id, None)
        p.version += 1
        p.ts = now

    def decode_started(self, inst_id: int, kv: float | None = None) -> None:
        """Co-located: a request starts decoding on ``inst_id`` with ``kv`` tokens of KV (its
        prompt; None: the instance's current mean). ``n_d += 1``, and the mean KV length of its
        decodes, which prices b_d in Eq. 8, follows: with long prompts (the Mooncake trace's
        15k tokens) a fixed b_d at 1,024 tokens made an instance's decodes look ~10× lighter
        than they are (docs/results.md §2.3)."""
        p = self._by_id[inst_id]
        p.n_decode += 1
        p.decode_kv += p.avg_decode_kv if kv is None else kv
        p.avg_decode_kv = p.decode_kv / p.n_decode

    def decode_finished(self, inst_id: int, kv: float | None = None) -> None:
        """Co-located: a decode on ``inst_id`` ended (``kv`` as reported when it started)."""
        p = self._by_id[inst_id]
        if p.n_decode <= 0:
            return
        p.n_decode -= 1
        p.decode_kv = max(0.0, p.decode_kv - (p.avg_decode_kv if kv is None else kv))
        if p.n_decode:
            p.avg_decode_kv = p.decode_kv / p.n_decode
        else:
            p.decode_kv = 0.0

    def published(self, inst_id: int, queued: Sequence[tuple[Request, int, int]], ts: float,
                  keep: Sequence[Request] = (), n_decode: int | None = None,
                  decode_kv: float | None = None) -> None:
        """Several dispatchers in front of the same instances (issue 15): replace the view of
        ``inst_id`` by what the instance published, plus this dispatcher's own dispatches the
        publication does not hold yet.

        ``queued``: the instance's queued prefill work as its engine knows it at ``ts``, one
        ``(request, l_q, l_kv)`` per request waiting for prefill (its remaining prefill and KV
        length, net of the prefix it found cached), in the engine's queue order, whichever
        dispatcher sent it; ``keep``: this dispatcher's own dispatches to ``inst_id`` that the
        publication does not list (still on their way to the instance), which keep the work
        recorded at their dispatch and go after the published ones. Co-located, ``n_decode``
        and ``decode_kv`` (the KV tokens of its decodes, each counted as its prompt, as
        :meth:`decode_started` counts it) replace ``n_d`` and its mean KV length.

        ``ts`` becomes ``ts_p``: the published work is as of ``ts``, so timestamp lag
        compensation counts the progress since then; ``version`` is bumped, so the snapshot
        cache of ``routing.estimates`` is rebuilt. With a prefix index, the prefix blocks of
        requests this view had not seen before (other dispatchers' dispatches) join it.
        The queue list and the work dict are updated in place."""
        p = self._by_id[inst_id]
        old = p.dispatched
        work: dict = {}
        queue: list[Request] = []
        for r, l_q, l_kv in queued:
            if r.id in work:
                continue
            queue.append(r)
            work[r.id] = (l_q, l_kv)
            if r.id not in old:
                _index(p, r)
        for r in keep:
            if r.id in work:
                continue
            queue.append(r)
            w = old.get(r.id)
            work[r.id] = w if w is not None else (r.remaining_prefill, r.kv_len)
        p.queue[:] = queue
        old.clear()
        old.update(work)
        if n_decode is not None:
            p.n_decode = max(0, int(n_decode))
            if p.n_decode:
                p.decode_kv = float(decode_kv) if decode_kv is not None else p.avg_decode_kv * p.n_decode
                p.avg_decode_kv = p.decode_kv / p.n_decode
            else:
                p.decode_kv = 0.0
        p.version += 1
        p.ts = ts


class GlobalPolicy(ABC):
    """Base of the routing policies: pick a prefill instance, then a decode instance."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""

    def __init__(self, gain: GainConfig | None = None, classes: Mapping[str, PriorityClass] | None = None,
                 deployment: str = DISAGGREGATED, seed: int = 0):
        validate.one_of(self.name, "deployment", deployment, DEPLOYMENTS)
        self.gain = gain or GainConfig()
        self.classes = dict(classes or {})
        self.deployment = deployment
        self.rng = random.Random(seed)

    @abstractmethod
    def select_prefill(self, req: Request, prefills: Sequence[PrefillInstance], now: float) -> PrefillInstance:
        """Choose the prefill (or co-located) instance for ``req``."""

    def on_request_finished(self, req: Request, now: float) -> None:
        """Called once ``req`` has emitted its last token or failed; routers that learn
        from completed requests override this."""

    def select_decode(self, req: Request, decodes: Sequence[DecodeInstance], now: float = 0.0) -> DecodeInstance:
        """LOADBALANCE(D) of Alg. 2 line 20: the decode instance with the most free blocks,
        net of those promised to requests routed there in the last :data:`PROMISE_S` and
        still in prefill (:meth:`DecodeInstance.room`). Without that, every request arriving
        before the first one's KV lands sees the same free blocks and goes to the same
        instance (measured in the simulator, 16P+16D at 140 req/s: runs of 11 consecutive
        requests, up to 57, on one decode instance; docs/results.md §7.1)."""
        return max(decodes, key=lambda d: d.room(now))

    def route(self, req: Request, prefills: Sequence[PrefillInstance],
              decodes: Sequence[DecodeInstance] = (), now: float = 0.0):
        """Return ``(prefill_instance, decode_instance_or_None)``; unhealthy instances are skipped."""
        ps = [p for p in prefills if p.healthy]
        if not ps:
            raise RuntimeError("no healthy prefill instance")
        p = self.select_prefill(req, ps, now)
        ds = [d for d in decodes if d.healthy]
        d = self.select_decode(req, ds, now) if ds else None
        return p, d

"""Discrete-event simulator of a serving cluster.

Two deployments, the ones the paper evaluates:

* ``colocated``: N instances, each running chunked prefill and decodes in the
  same batches, batches formed by a local policy from ``proserve.scheduler.local``;
  requests routed by a global policy from ``proserve.scheduler.routing``.
* ``disaggregated``: P prefill instances (local policy in prefill-only mode)
  and D decode instances (continuous batching of every running decode). A
  finished prefill emits the first token, then its KV cache moves to the decode
  instance chosen at dispatch, taking ``kv_len · kv_bytes_per_token /
  kv_bandwidth`` seconds, once that instance has blocks for it. With
  ``first_token="decode"`` (what ProServe's dispatcher and vLLM do) the decode
  instance emits every output token instead, and KV that reaches it while it
  steps loads during its next step (vLLM's asynchronous KV load).

What the real cluster adds around the engines (HTTP hops before the queue, the
hand-off between prefill and decode, the way back to the client) is
``dispatch_delay``, ``handoff_delay`` and ``stream_delay``;
``scripts/bench_fidelity.py`` measures them (docs/fidelity.md).

Admission control, as the dispatcher applies it (off by default): each arrival first
takes a slot under ``max_concurrent`` / ``max_concurrent_per_class`` (the dispatcher's
``max_concurrent`` / ``max_concurrent_per_key`` with one key per class, held until the
request's last token), then passes :class:`proserve.scheduler.admission.Admission`
(per-class ``on_overload`` and the per-instance queue caps of ``admission``), the same
code the dispatcher runs. A refused request ends at once with an error and no token,
as the load generator scores a 429 (zero gain, its ideal gain counted, SLO missed). A
downgraded request runs in the lower class (its weight and SLOs, as the policies see
it) and gets its own class back when it ends, so that it is scored as the load
generator scores it: in the class the client sent it in. ``SimResult.admission``
counts every decision per class; ``Simulator.downgraded`` maps each downgraded
request to the class it was served in.

Several dispatchers (issue 15; ``dispatchers``, default 1): arrivals are spread over N
dispatchers (round-robin, or at random, as a load balancer in front of them would), each
with its own routing policy object and its own view of the instances (PrefillInstance
list and :class:`~proserve.scheduler.host.RouterHost`), moved by the events of the
requests it dispatched. ``dispatcher_sync`` says what else a dispatcher sees:

* ``"blind"``: nothing: it routes blind to the others' dispatches (each dispatcher's own
  PrefillQueueMap, as N dispatchers of today would);
* ``"publish"`` (the default with N > 1): every ``publish_interval_s`` each instance
  publishes its queued prefill work (each waiting request with its remaining prefill and
  KV length as the engine knows it, as of the start of the step in progress; co-located
  also its decodes), and every dispatcher's view of it becomes that publication plus its
  own dispatches the publication does not hold yet (``RouterHost.published``): its own
  dispatches are never lost, the others' appear within one interval;
* ``"shared"``: one PrefillQueueMap for all (dispatchers that share every dispatch at
  once: the upper bound), each still with its own policy object (its own random fallback).

With one dispatcher (and ``dispatcher_sync`` left at None) the simulator is what it was.
``Simulator.router``, ``.p_states`` and ``.router_host`` are dispatcher 0's;
``Simulator.dispatchers`` lists them all.

Step times come from a latency model (Eq. 4-7), optionally with multiplicative
log-normal noise, and optionally from a *different* "true" model than the one
the policies estimate with, so that the online correction β has something to
correct. The same policy objects run here and in the engines: the simulator
only applies their plans.

Speed: a pure-decode stretch (nothing waiting for prefill, the policy chose
every running decode) is simulated as one macro-step of up to
``max_macro_steps`` identical-shape steps, cut short when a request finishes,
memory runs out, or new work arrives. ``fast_forward=False`` turns this off;
tests check both give the same result.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from proserve.scheduler import validate
from proserve.scheduler.admission import REJECT, Admission, AdmissionConfig, ConcurrencyCount, serve_in
from proserve.scheduler.estimator import Estimator, LatencyModel, OnlineCorrector
from proserve.scheduler.host import LocalHost, RouterHost
from proserve.scheduler.local.base import COLOCATED, PREFILL_ONLY, BatchPlan, blocks_for
from proserve.scheduler.prefix import BlockLRU, cached_tokens
from proserve.scheduler.registry import make_global, make_local
from proserve.scheduler.request import ConfigError, Phase, PriorityClass, Request
from proserve.scheduler.routing.base import DISAGGREGATED, DecodeInstance, PrefillInstance, decode_blocks
from proserve.scheduler.tdg import GainConfig

DEPLOYMENTS = (COLOCATED, DISAGGREGATED)
FIRST_TOKEN = ("prefill", "decode")

# event kinds, ordered so that simultaneous events resolve deterministically
_STEP_DONE, _KV_ARRIVED, _ARRIVAL, _ENQUEUE, _PUBLISH = 0, 1, 2, 3, 4
# several dispatchers (issue 15): what a dispatcher sees of the others' dispatches, and how
# arrivals are spread over the dispatchers
DISPATCHER_SYNC = ("blind", "publish", "shared")
DISPATCHER_SPREAD = ("round_robin", "random")


@dataclass
class SimConfig:
    deployment: str = COLOCATED
    instances: int = 1               # co-located instances
    prefill_instances: int = 1       # disaggregated
    decode_instances: int = 1        # disaggregated
    local_policy: str = "slide_batching"
    local_params: dict = field(default_factory=dict)
    global_policy: str = "go_routing"
    global_params: dict = field(default_factory=dict)
    noise_cv: float = 0.0            # log-normal step-time noise (coefficient of variation)
    true_model: LatencyModel | None = None  # defaults to the estimator's model
    decode_true_model: LatencyModel | None = None  # disaggregated decode instances (default: true_model)
    kv_bandwidth: float = 25e9       # bytes/s between prefill and decode instances
    num_kv_blocks: int | None = None # per instance; default from the model's metadata
    block_size: int | None = None
    kv_bytes_per_token: int | None = None
    theta: float = 0.8
    window_s: float = 1.0
    fast_forward: bool = True
    max_macro_steps: int = 64
    record_timeline: bool = False
    seed: int = 0
    # What the real cluster adds around the engines (measured by scripts/bench_fidelity.py):
    # "prefill": the prefill step's token is the first token (the paper, §4.3); "decode": the
    # decode instance emits every output token, the first one in its first step after the KV
    # arrived (vLLM's disaggregated serving and ProServe's dispatcher; Request.hand_off)
    first_token: str = "prefill"
    dispatch_delay: float = 0.0      # s from a request's arrival to its instance's queue (HTTP hops)
    handoff_delay: float = 0.0       # s from a prefill's end to its KV transfer start (disaggregated)
    stream_delay: float = 0.0        # s from a token's step end to the client
    # Admission control as the dispatcher applies it (proserve.scheduler.admission); off by default
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)  # per-class on_overload, queue caps
    max_concurrent: int | None = None            # requests in progress at once, overall (else refused: 429)
    max_concurrent_per_class: int | None = None  # ... per class (the dispatcher's per-key limit, a key per class)
    # Prefix caching (scheduler.prefix; vLLM's default is on): a request with prefix blocks skips the
    # prefill of its longest run of leading blocks held by the instance it is queued at
    prefix_cache: bool = True
    # ... and the router keeps an approximate index of each instance's cache (routing.base.expected_hit)
    prefix_index: bool = True
    # Several dispatchers (issue 15; module doc): N dispatchers, each routing the arrivals a load
    # balancer gives it (``dispatcher_spread``), with what it sees of the others' dispatches:
    # "blind", "publish" (instances publish their queued prefill work every publish_interval_s)
    # or "shared"; None: "publish" with N > 1, and with N = 1 the single dispatcher of old
    dispatchers: int = 1
    dispatcher_sync: str | None = None
    publish_interval_s: float = 0.05
    dispatcher_spread: str = "round_robin"

    @property
    def sync_mode(self) -> str:
        """``dispatcher_sync`` resolved: "publish" with several dispatchers, "shared" (one map:
        today's single dispatcher) with one."""
        if self.dispatcher_sync is not None:
            return self.dispatcher_sync
        return "publish" if self.dispatchers > 1 else "shared"

    def validate(self) -> None:
        W = "simulator"
        validate.one_of(W, "deployment", self.deployment, DEPLOYMENTS)
        for k in ("instances", "prefill_instances", "decode_instances", "max_macro_steps", "dispatchers"):
            validate.integer(W, k, getattr(self, k))
        validate.non_negative(W, "noise_cv", self.noise_cv)
        validate.positive(W, "kv_bandwidth", self.kv_bandwidth)
        validate.one_of(W, "first_token", self.first_token, FIRST_TOKEN)
        for k in ("dispatch_delay", "handoff_delay", "stream_delay"):
            validate.non_negative(W, k, getattr(self, k))
        for k in ("num_kv_blocks", "block_size", "kv_bytes_per_token", "max_concurrent",
                  "max_concurrent_per_class"):
            if getattr(self, k) is not None:
                validate.integer(W, k, getattr(self, k))
        if self.dispatcher_sync is not None:
            validate.one_of(W, "dispatcher_sync", self.dispatcher_sync, DISPATCHER_SYNC)
        validate.positive(W, "publish_interval_s", self.publish_interval_s)
        validate.one_of(W, "dispatcher_spread", self.dispatcher_spread, DISPATCHER_SPREAD)


@dataclass
class TimelinePoint:
    t: float
    instance: int
    n_urgent: int
    n_normal: int
    t_budget: float
    waiting: int
    decoding: int


@dataclass
class SimResult:
    requests: list[Request]
    duration: float
    timeline: list[TimelinePoint]
    steps: int
    betas: list[float]
    preemptions: int = 0   # recompute preemptions (and decode-side swaps) over the run
    # admission decisions per class the requests came in: {class: {admit, queue, downgrade,
    # reject, "reject:<reason>"...: count}}; empty when admission control is off
    admission: dict = field(default_factory=dict)
    # prefix cache: prompt tokens of requests with prefix blocks as they reached a prefill (or
    # co-located) instance, and how many of them were found cached there
    prefix_prompt_tokens: int = 0
    prefix_hit_tokens: int = 0


@dataclass
class Dispatcher:
    """One dispatcher (issue 15): its routing policy object and its view of the instances."""

    index: int
    router: object                 # a GlobalPolicy
    p_states: list[PrefillInstance]
    host: RouterHost
    d_states: list[DecodeInstance]   # disaggregated: its view of the decode instances


class _Instance:
    """One simulated engine instance."""

    def __init__(self, idx: int, mode: str, policy, est: Estimator, truth: LatencyModel,
                 blocks: int, block_size: int, rng: np.random.Generator, noise_cv: float):
        self.id = idx
        self.mode = mode                # COLOCATED, PREFILL_ONLY or "decode"
        self.policy = policy
        self.est = est
        self.truth = truth
        self.total_blocks = blocks
        self.free_blocks = blocks
        self.block_size = block_size
        self.rng = rng
        self.noise_cv = noise_cv
        self.waiting: list[Request] = []    # need prefill (incl. preempted)
        self.decoding: list[Request] = []
        self.pending_kv: list[Request] = [] # decode instance: KV waiting for blocks
        self.loading: list[Request] = []    # decode instance: KV arrived, loaded during the next step
        self.loads: list[Request] = []      # ... loaded during the step in progress
        self.busy = False
        self.version = 0
        self.plan: BatchPlan | None = None
        self.macro_times: np.ndarray | None = None  # end times of a macro-step's steps
        self.macro_k = 0
        self.step_start = 0.0
        self.admitted: dict[str, int] = {}  # request id -> admission sequence number (vLLM's running order)
        self.admit_seq = 0
        # prefix cache (scheduler.prefix), in blocks of the requests' prefix blocks: as many as
        # the KV memory holds tokens, set on the first request that has prefix blocks
        self.cache: BlockLRU | None = None
        # what every body does with the policy's plans and the measured step times (scheduler.host)
        self.host = LocalHost(policy, est, mode, block_size, blocks)

    def blocks_held(self, r: Request) -> int:
        """KV blocks ``r`` holds here: its KV less the prefix-cache blocks it shares."""
        return math.ceil(r.kv_len / self.block_size) - r.cached // self.block_size

    def noise(self) -> float:
        if self.noise_cv <= 0:
            return 1.0
        s2 = math.log(1 + self.noise_cv ** 2)
        return float(self.rng.lognormal(-s2 / 2, math.sqrt(s2)))


class Simulator:
    def __init__(self, model: LatencyModel, config: SimConfig, gain: GainConfig | None = None,
                 classes: dict[str, PriorityClass] | None = None):
        config.validate()
        self.cfg = config
        self.model = model
        self.truth = config.true_model or model
        self.gain = gain or GainConfig()
        from proserve.scheduler.config import default_classes
        self.classes = classes or default_classes()
        md = model.metadata
        self.block_size = int(config.block_size or md.get("block_size", 16))
        self.num_blocks = int(config.num_kv_blocks or md.get("num_kv_blocks", 1 << 20))
        self.kv_bytes = int(config.kv_bytes_per_token or md.get("kv_bytes_per_token", 0))
        # build the policies once here so that bad names/params fail at start-up
        rng = np.random.default_rng(config.seed)
        dep = config.deployment
        n_front = config.instances if dep == COLOCATED else config.prefill_instances
        front_mode = COLOCATED if dep == COLOCATED else PREFILL_ONLY
        self.front: list[_Instance] = []
        for i in range(n_front):
            est = Estimator(model, OnlineCorrector(config.theta, config.window_s))
            pol = make_local(config.local_policy, est, self.gain, self.classes, **config.local_params)
            self.front.append(_Instance(i, front_mode, pol, est, self.truth, self.num_blocks, self.block_size,
                                        np.random.default_rng(rng.integers(1 << 62)), config.noise_cv))
        self.decoders: list[_Instance] = []
        if dep == DISAGGREGATED:
            for j in range(config.decode_instances):
                est = Estimator(model, OnlineCorrector(config.theta, config.window_s))
                self.decoders.append(_Instance(j, "decode", None, est, config.decode_true_model or self.truth,
                                               self.num_blocks, self.block_size,
                                               np.random.default_rng(rng.integers(1 << 62)), config.noise_cv))
        self.router = make_global(config.global_policy, gain=self.gain, classes=self.classes,
                                  deployment=dep, seed=config.seed, **config.global_params)
        # the router's view; with prefix caching, an approximate index of each instance's cache
        self.p_states = self._views()
        self.d_states = [DecodeInstance(d.id, d.free_blocks) for d in self.decoders]
        # the global side: PrefillQueueMap updates and router notifications, from events
        self.router_host = RouterHost(self.router, self.p_states)
        # several dispatchers (issue 15): dispatcher 0 is the one above; each other has its own
        # policy object (its own seed) and, unless "shared", its own view and RouterHost
        self.sync = config.sync_mode
        self.dispatchers = [Dispatcher(0, self.router, self.p_states, self.router_host, self.d_states)]
        for k in range(1, config.dispatchers):
            seed_k = int(np.random.SeedSequence([config.seed, k]).generate_state(1)[0])
            router = make_global(config.global_policy, gain=self.gain, classes=self.classes,
                                 deployment=dep, seed=seed_k, **config.global_params)
            if self.sync == "shared":
                self.dispatchers.append(Dispatcher(k, router, self.p_states, self.router_host, self.d_states))
            else:
                # its own decode view too: it knows the blocks promised by its own dispatches only
                views = self._views()
                d_views = [DecodeInstance(d.id, d.free_blocks) for d in self.decoders]
                self.dispatchers.append(Dispatcher(k, router, views, RouterHost(router, views), d_views))
        self._disp_of: dict[str, int] = {}   # request id -> the dispatcher it arrived at (N > 1)
        self._arrivals = 0
        self._spread_rng = np.random.default_rng([config.seed, 15]) \
            if config.dispatchers > 1 and config.dispatcher_spread == "random" else None
        self.publications = 0
        # admission control: the dispatcher's rule (scheduler.admission) on the router's estimate
        adm = config.admission.check(self.classes, "simulator")
        self.admission = Admission(adm, self.classes, self.gain, dep, getattr(self.router, "eta", None),
                                   getattr(self.router, "order", "deadline")) \
            if adm.active else None
        self.concurrency = ConcurrencyCount(config.max_concurrent, config.max_concurrent_per_class) \
            if config.max_concurrent is not None or config.max_concurrent_per_class is not None else None
        self.admission_counts: dict[str, dict[str, int]] = {}
        self._slot: dict[str, str] = {}       # request id -> the class whose concurrency slot it holds
        self._refused: set[str] = set()       # refused requests not yet handed to _finished
        self._asked: dict[str, tuple] = {}    # downgraded, running: id -> (class, weight, TTFT, TPOT SLO) asked
        self.downgraded: dict[str, str] = {}  # request id -> the class it was served in
        self._events: list = []
        self._seq = 0
        self.timeline: list[TimelinePoint] = []
        self.steps = 0
        self.preemptions = 0
        self.prefix_prompt_tokens = 0   # prompt tokens of requests with prefix blocks at their instance
        self.prefix_hit_tokens = 0      # ... of them found in its prefix cache
        self._decode_target: dict[str, int] = {}
        self._kv_source: dict[str, _Instance] = {}

    def _views(self) -> list[PrefillInstance]:
        """A dispatcher's view of the prefill (or co-located) instances."""
        cfg = self.cfg
        cache_tokens = self.num_blocks * self.block_size if cfg.prefix_cache and cfg.prefix_index else 0
        return [PrefillInstance(i.id, i.est, order=type(i.policy).router_order, cache_tokens=cache_tokens,
                                block_size=self.block_size, kv_tokens=self.num_blocks * self.block_size)
                for i in self.front]

    # -- event plumbing ------------------------------------------------------------
    def _push(self, t: float, kind: int, payload) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, kind, self._seq, payload))

    def run(self, requests: Sequence[Request]) -> SimResult:
        if not requests:
            raise ConfigError("the workload contains no requests")
        reqs = sorted(requests, key=lambda r: r.arrival)
        for r in reqs:
            self._push(r.arrival, _ARRIVAL, r)
        now = reqs[0].arrival
        interval = self.cfg.publish_interval_s
        if self.sync == "publish":
            self._push(now + interval, _PUBLISH, None)
        while self._events:
            now, kind, _, payload = heapq.heappop(self._events)
            if kind == _ARRIVAL:
                self._on_arrival(payload, now)
            elif kind == _ENQUEUE:
                self._enqueue(*payload, now)
            elif kind == _STEP_DONE:
                inst, version = payload
                if version == inst.version:
                    self._on_step_done(inst, now)
            elif kind == _PUBLISH:
                self._publish(now)
                if self._events:      # more to simulate: publish again an interval on
                    self._push(now + interval, _PUBLISH, None)
            else:
                self._on_kv_arrived(*payload, now)
        end = max((r.token_times[-1] for r in reqs if r.token_times), default=now)
        betas = [i.est.beta for i in self.front + self.decoders]
        return SimResult(list(reqs), end - reqs[0].arrival, self.timeline, self.steps, betas, self.preemptions,
                         self.admission_counts, self.prefix_prompt_tokens, self.prefix_hit_tokens)

    # -- several dispatchers (issue 15) -------------------------------------------------
    def _dispatcher_for(self, r: Request) -> Dispatcher:
        """The dispatcher the load balancer gives the arrival ``r`` (round-robin or seeded random)."""
        n = len(self.dispatchers)
        if n == 1:
            return self.dispatchers[0]
        if self._spread_rng is not None:
            k = int(self._spread_rng.integers(n))
        else:
            k = self._arrivals % n
        self._arrivals += 1
        self._disp_of[r.id] = k
        return self.dispatchers[k]

    def _rhost(self, r: Request) -> RouterHost:
        """The RouterHost that hears of ``r``'s events: that of the dispatcher it came through."""
        if len(self.dispatchers) == 1:
            return self.router_host
        return self.dispatchers[self._disp_of.get(r.id, 0)].host

    def _publish(self, now: float) -> None:
        """Every instance publishes its queued prefill work to every dispatcher ("publish"):
        each waiting request with its remaining prefill and KV length as the engine knows it,
        which is as of the start of the step in progress when that step runs a prefill (the
        simulator advances a prefill when its step ends), else as of now; co-located also its
        decodes (n_d and their KV, each counted as its prompt as RouterHost counts it)."""
        self.publications += 1
        colocated = self.cfg.deployment == COLOCATED
        hosts = list({id(d.host): d.host for d in self.dispatchers}.values())
        for inst in self.front:
            ts = inst.step_start if inst.busy and inst.plan is not None and inst.plan.prefill else now
            queued = [(r, r.remaining_prefill, r.kv_len) for r in inst.waiting]
            n_d = kv = None
            if colocated:
                n_d = len(inst.decoding)
                kv = float(sum(r.prompt_len for r in inst.decoding))
            for host in hosts:
                host.published(inst.id, queued, ts, n_d, kv)

    # -- arrivals and routing ----------------------------------------------------------
    def _on_arrival(self, r: Request, now: float) -> None:
        disp = self._dispatcher_for(r)
        prefills = disp.p_states
        if self.concurrency is not None or self.admission is not None:
            prefills = self._admit(r, now, disp.p_states)
            if prefills is None:
                return
        for d, st in zip(self.decoders, disp.d_states):
            st.free_blocks = d.free_blocks
        for inst, st in zip(self.front, disp.p_states):   # what vLLM's kv_cache_usage_perc reports
            st.kv_usage = 1.0 - inst.free_blocks / inst.total_blocks
        p, d = disp.router.route(r, prefills, disp.d_states, now)
        inst = self.front[p.id]
        need = math.ceil((r.prompt_len + 1) / self.block_size)
        if need > inst.total_blocks:
            self._fail(r, f"prompt of {r.prompt_len} tokens exceeds the KV capacity of an instance", now)
            return
        r.instance = p.id
        # disaggregated: the blocks r will hold on d are promised until its prefill ends
        disp.host.dispatched(r, p.id, now, d, decode_blocks(r.prompt_len, r.output_len, self.block_size)
                             if d is not None else 0)
        if d is not None:
            self._decode_target[r.id] = d.id
        if self.cfg.dispatch_delay:
            self._push(now + self.cfg.dispatch_delay, _ENQUEUE, (inst, r))
        else:
            self._enqueue(inst, r, now)

    def _admit(self, r: Request, now: float,
               p_states: list[PrefillInstance] | None = None) -> list[PrefillInstance] | None:
        """The dispatcher's checks before routing, in its order: a concurrency slot, then
        the admission rule (on ``p_states``, the view of the dispatcher ``r`` came through;
        default dispatcher 0's). The instances ``r`` may be routed to, or None if refused."""
        if p_states is None:
            p_states = self.p_states
        asked = r.priority
        if self.concurrency is not None:
            why = self.concurrency.acquire(asked)
            if why is not None:
                self._count(asked, REJECT, why)
                self._refuse(r, why, now)
                return None
            self._slot[r.id] = asked
        if self.admission is None:
            return p_states
        dec = self.admission.decide(r, p_states, now)
        self._count(asked, dec.decision, dec.reason)
        if dec.refused:
            self._refuse(r, dec.reason, now)
            return None
        if dec.served is not None and dec.served.name != asked:
            # a downgrade: the lower class's weight and SLOs until it ends (see _finished)
            self._asked[r.id] = (r.priority, r.weight, r.ttft_slo, r.tpot_slo)
            self.downgraded[r.id] = dec.served.name
            serve_in(r, dec.served)
        return dec.instances

    def _count(self, cls: str, decision: str, reason: str | None) -> None:
        c = self.admission_counts.setdefault(cls, {"admit": 0, "queue": 0, "downgrade": 0, "reject": 0})
        c[decision] += 1
        if decision == REJECT:
            c[f"reject:{reason}"] = c.get(f"reject:{reason}", 0) + 1

    def _refuse(self, r: Request, reason: str, now: float) -> None:
        """``r`` is refused before routing (the dispatcher's 429): it ends now, with an error and
        no token, not finished, as the load generator scores a 429 (bench/loadgen/scoring.py);
        no router or instance heard of it."""
        r.error = f"rejected (HTTP 429: {reason})"
        self._refused.add(r.id)
        self._finished(r, now)

    def _enqueue(self, inst: _Instance, r: Request, now: float) -> None:
        if r.prefix_blocks and self.cfg.prefix_cache and r.prefilled == 0 and not r.token_times:
            self._prefix_hit(inst, r)
        inst.waiting.append(r)
        self._wake(inst, now)

    def _prefix_hit(self, inst: _Instance, r: Request) -> None:
        """The longest run of ``r``'s leading prefix blocks ``inst`` holds: its prefill
        starts after them (l_q down, l_kv up: Eq. 5), sharing their KV blocks."""
        if inst.cache is None:
            inst.cache = BlockLRU(inst.total_blocks * inst.block_size // r.prefix_block_tokens)
        hit = cached_tokens(r, inst.cache.match(r.prefix_blocks), inst.block_size)
        self.prefix_prompt_tokens += r.prompt_len
        self.prefix_hit_tokens += hit
        r.prefilled = r.kv_len = r.cached = hit

    def _fail(self, r: Request, why: str, now: float) -> None:
        r.fail(why)
        self._finished(r, now)

    def _finished(self, r: Request, now: float) -> None:
        """``r`` emitted its last token (or failed): tell the policies that learn from it."""
        if r.instance is not None:
            inst = self.front[r.instance]
            inst.admitted.pop(r.id, None)
            inst.host.finished(r, now)
        if self._slot:
            cls = self._slot.pop(r.id, None)
            if cls is not None:
                self.concurrency.release(cls)
        if self._refused and r.id in self._refused:
            self._refused.discard(r.id)       # never routed: no router heard of it (nor does the dispatcher's)
            if self._disp_of:
                self._disp_of.pop(r.id, None)
        elif len(self.dispatchers) == 1:
            self.router_host.finished(r, now)   # also out of PrefillQueueMap / n_d, wherever it still counts
        else:   # the dispatcher it came through: out of its view, and its policy told
            disp = self.dispatchers[self._disp_of.pop(r.id, 0)]
            disp.host.released(r, now)
            disp.router.on_request_finished(r, now)
        if self._asked:
            asked = self._asked.pop(r.id, None)
            if asked is not None:   # scored in the class it came in, as the load generator scores it
                r.priority, r.weight, r.ttft_slo, r.tpot_slo = asked
        r.delay_tokens(self.cfg.stream_delay)  # from here on, the times the client saw

    def _wake(self, inst: _Instance, now: float) -> None:
        """New work for ``inst``: start a step if idle, or cut a macro-step short."""
        if not inst.busy:
            self._start_step(inst, now)
        elif inst.macro_times is not None and inst.macro_k > 1:
            # let the step in progress finish, drop the rest of the macro-step
            j = int(np.searchsorted(inst.macro_times[:inst.macro_k], now, side="right"))
            k = min(j + 1, inst.macro_k)
            if k < inst.macro_k:
                # give back the KV blocks reserved for the dropped steps
                inst.free_blocks += _growth_blocks(inst.plan.decode, inst.macro_k, self.block_size) \
                    - _growth_blocks(inst.plan.decode, k, self.block_size)
                inst.macro_k = k
                inst.version += 1
                self._push(float(inst.macro_times[k - 1]), _STEP_DONE, (inst, inst.version))

    # -- stepping -------------------------------------------------------------------------
    def _ensure_decode_memory(self, inst: _Instance, now: float) -> None:
        """vLLM-style recompute preemption (co-located): if running decodes cannot all
        grow by a token, preempt the most recently admitted running request — a decode or
        a partial prefill, as vLLM's scheduler takes ``running[-1]`` — back to the waiting
        queue, until they can."""
        bs = self.block_size
        need = sum(1 for r in inst.decoding if r.kv_len % bs == 0)
        while need > inst.free_blocks and inst.decoding:
            victim = max((r for r in inst.decoding + inst.waiting if r.holds_kv),
                         key=lambda r: inst.admitted.get(r.id, -1))
            inst.free_blocks += inst.blocks_held(victim)
            if victim.phase is Phase.DECODING:
                inst.decoding.remove(victim)
                if victim.kv_len % bs == 0:
                    need -= 1
                victim.preempt()
                self._rhost(victim).requeued(victim, now)
                inst.waiting.insert(0, victim)
            else:
                victim.preempt()   # a partial prefill: already queued, starts over
            inst.admitted.pop(victim.id, None)
            self.preemptions += 1

    def _start_step(self, inst: _Instance, now: float) -> None:
        """Plan and start ``inst``'s next step; while the policy plans nothing, free what
        holds memory (:meth:`_unstick`) and plan again (a loop, not recursion: a long
        queue of requests that can never run would otherwise overflow the stack)."""
        while self._try_step(inst, now):
            pass

    def _try_step(self, inst: _Instance, now: float) -> bool:
        """One attempt; True if it should be retried (the plan was empty and something changed)."""
        inst.busy = False
        inst.macro_times = None
        if inst.mode == "decode":
            self._admit_kv(inst, now)
            if inst.loading and not inst.decoding:
                inst.decoding += inst.loading   # nothing else runs: loaded at once (in handoff_delay)
                inst.loading = []
        if not inst.waiting and not inst.decoding:
            return False
        bs = self.block_size
        if inst.mode == COLOCATED:
            self._ensure_decode_memory(inst, now)
        if inst.mode == "decode":
            # continuous batching of every running decode that can grow; the rest stall a step
            plan = BatchPlan()
            free = inst.free_blocks
            for r in inst.decoding:
                need = 1 if r.kv_len % bs == 0 else 0
                if need <= free:
                    free -= need
                    plan.decode.append(r)
        else:
            host = inst.host
            view = host.view(now, inst.waiting, inst.decoding, inst.free_blocks,
                             idle=inst.free_blocks == inst.total_blocks)
            plan = host.plan(view)
            if self.cfg.record_timeline:
                i = plan.info
                self.timeline.append(TimelinePoint(now, inst.id, i.n_urgent, i.n_normal, i.t_budget,
                                                   len(inst.waiting), len(inst.decoding)))
        if inst.mode == "decode" and inst.loading:
            if plan.decode:
                inst.loads, inst.loading = inst.loading, []   # loaded while this step runs
            else:
                inst.decoding += inst.loading   # nothing else runs: loaded at once (in handoff_delay)
                inst.loading = []
                return True
        if plan.empty:
            return self._unstick(inst, now, None if inst.mode == "decode" else view)
        # allocate KV blocks for the step
        for r, n in plan.prefill:
            if r.id not in inst.admitted:
                inst.admit_seq += 1
                inst.admitted[r.id] = inst.admit_seq   # admission order, for preemption
            inst.free_blocks -= blocks_for(r, n, bs)
        k = 1
        if self.cfg.fast_forward and not plan.prefill and not inst.waiting and not inst.pending_kv \
                and not inst.loads and len(plan.decode) == len(inst.decoding):
            k = self._macro_len(inst, plan.decode)
        prefills = [(n, r.kv_len) for r, n in plan.prefill]
        if k == 1:
            for r in plan.decode:
                inst.free_blocks -= blocks_for(r, 1, bs)
            kvs = [r.kv_len for r in plan.decode]
            dur = inst.truth.batch_time(prefills, kvs) * inst.noise()
            inst.host.observe(dur, prefills, kvs, now + dur)
            inst.macro_times = np.array([now + dur])
        else:
            inst.free_blocks -= _growth_blocks(plan.decode, k, bs)
            durs = self._macro_durations(inst, plan.decode, k)
            inst.macro_times = now + np.cumsum(durs)
        inst.macro_k = k
        inst.plan = plan
        inst.busy = True
        inst.step_start = now
        inst.version += 1
        self._push(float(inst.macro_times[k - 1]), _STEP_DONE, (inst, inst.version))
        return False

    def _unstick(self, inst: _Instance, now: float, view) -> bool:
        """The policy planned nothing although work is queued: KV memory is held by
        requests the policy will not run now. Free some, as vLLM would (which request:
        ``LocalHost.unstick``, the rule the engine plugin follows too); True if the step
        should be planned again."""
        if inst.mode == "decode":
            # every running decode sits at a block boundary and no block is free: swap the
            # newest one out (its KV leaves the device) and back in when blocks free up,
            # paying the transfer time again
            victim = inst.decoding.pop()
            inst.free_blocks += inst.blocks_held(victim)
            inst.pending_kv.insert(0, victim)
            self.preemptions += 1
            return True
        what = inst.host.unstick(view, idle=inst.free_blocks == inst.total_blocks)
        victim = what.preempt
        if victim is not None:
            inst.free_blocks += inst.blocks_held(victim)
            if victim.phase is Phase.DECODING:
                inst.decoding.remove(victim)   # recompute-preempt a decode: back to prefill, first
                victim.preempt()
                self._rhost(victim).requeued(victim, now)
                inst.waiting.insert(0, victim)
            else:
                victim.preempt()               # a partial prefill: already queued, starts over
            inst.admitted.pop(victim.id, None)
            self.preemptions += 1
            return True
        # a prefill-only instance whose blocks hold finished prefills waiting for their KV
        # transfer waits (_on_kv_arrived wakes it); else fail what can never fit
        for r in what.fail:
            inst.waiting.remove(r)
            self._fail(r, "request does not fit in KV memory", now)
        return not what.wait

    def _macro_len(self, inst: _Instance, decodes: list[Request]) -> int:
        k = min(self.cfg.max_macro_steps, min(r.output_len - r.num_emitted for r in decodes))
        bs = self.block_size
        while k > 1 and _growth_blocks(decodes, k, bs) > inst.free_blocks:
            k //= 2
        return max(k, 1)

    def _macro_durations(self, inst: _Instance, decodes: list[Request], k: int) -> np.ndarray:
        n = len(decodes)
        kv_sum = sum(r.kv_len for r in decodes)
        durs = inst.truth.unit.decode_run(kv_sum, n, k)
        if inst.noise_cv > 0:
            durs = durs * np.array([inst.noise() for _ in range(k)])
        est_total = inst.est.model.unit.decode_run_total(kv_sum, n, k)
        inst.host.observe_run(float(durs.sum()), est_total, inst.step_start + float(durs.sum()), steps=k)
        return durs

    def _on_step_done(self, inst: _Instance, now: float) -> None:
        plan, k = inst.plan, inst.macro_k
        times = inst.macro_times[:k]
        self.steps += k
        for r, n in plan.prefill:
            if r.advance_prefill(n, now):
                self._prefill_done(inst, r, now)
        finished = []
        steps = times.tolist()
        for r in plan.decode:
            if k == 1:
                r.decode_step(now)
            else:
                r.decode_steps(steps)
            if r.phase is Phase.DONE:
                finished.append(r)
        for r in finished:
            inst.decoding.remove(r)
            inst.free_blocks += inst.blocks_held(r)
            self._finished(r, now)
        inst.host.batch_done(plan, now)
        if inst.loads:
            inst.decoding += inst.loads
            inst.loads = []
        self._start_step(inst, now)

    def _prefill_done(self, inst: _Instance, r: Request, now: float) -> None:
        inst.waiting.remove(r)
        if inst.cache is not None and r.prefix_blocks:
            inst.cache.insert(r.prefix_blocks)   # its prompt's KV is computed here now
        # the asynchronous completion signal (§4.3); co-located, r now decodes here (n_d)
        self._rhost(r).prefill_finished(r, now)
        if inst.mode == COLOCATED:
            if r.phase is Phase.DONE:
                inst.free_blocks += inst.blocks_held(r)
                self._finished(r, now)
            else:
                inst.decoding.append(r)
            return
        # disaggregated: KV moves to the decode instance picked at dispatch
        held = inst.blocks_held(r)   # before a hand-off shortens kv_len: these are what r holds here
        r.cached = 0                 # the decode side receives (and holds) all of its KV
        if self.cfg.first_token == "decode":
            r.hand_off()   # the decode instance emits every output token
        if r.phase is Phase.DONE:
            inst.free_blocks += held
            self._finished(r, now)
            return
        inst.admitted.pop(r.id, None)
        dec = self.decoders[self._decode_target[r.id]]
        self._kv_source[r.id] = (inst, held)  # freed once the decode side has the KV
        dec.pending_kv.append(r)
        self._admit_kv(dec, now)

    def _admit_kv(self, dec: _Instance, now: float) -> None:
        """Start KV transfers for pending requests while the decode instance has blocks."""
        while dec.pending_kv:
            r = dec.pending_kv[0]
            need = math.ceil((r.kv_len + 1) / self.block_size)
            # keep one block of growth headroom per running decode
            if need + len(dec.decoding) > dec.free_blocks:
                if not dec.decoding and need > dec.total_blocks:
                    dec.pending_kv.pop(0)
                    self._release_source(r, now)
                    self._fail(r, "KV cache larger than a decode instance", now)
                    continue
                break
            dec.pending_kv.pop(0)
            dec.free_blocks -= math.ceil(r.kv_len / self.block_size)
            dt = r.kv_len * self.kv_bytes / self.cfg.kv_bandwidth if self.kv_bytes else 0.0
            dt += self.cfg.handoff_delay
            self._push(now + dt, _KV_ARRIVED, (dec, r))

    def _release_source(self, r: Request, now: float) -> None:
        """The prefill instance that held ``r``'s KV for the transfer gets its blocks back."""
        src = self._kv_source.pop(r.id, None)
        if src is not None:
            inst, held = src
            inst.free_blocks += held
            if inst.waiting:
                self._wake(inst, now)

    def _on_kv_arrived(self, dec: _Instance, r: Request, now: float) -> None:
        self._release_source(r, now)
        if self.cfg.first_token == "decode" and dec.busy:
            # vLLM loads received KV asynchronously: during the decode instance's next step,
            # and the request computes (its first token) in the step after
            dec.loading.append(r)
        else:
            dec.decoding.append(r)
        self._wake(dec, now)


def _growth_blocks(decodes: Sequence[Request], k: int, bs: int) -> int:
    """KV blocks the decodes need to grow by ``k`` tokens each."""
    return sum((r.kv_len + k + bs - 1) // bs - (r.kv_len + bs - 1) // bs for r in decodes)


def simulate(requests: Sequence[Request], model: LatencyModel, config: SimConfig | None = None,
             gain: GainConfig | None = None, classes=None) -> SimResult:
    """Run ``requests`` through a simulated cluster; returns the requests with their token times."""
    return Simulator(model, config or SimConfig(), gain, classes).run(requests)

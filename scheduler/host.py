"""What a body does with the scheduler's decisions, written once for every body.

Two bodies run the policies of this package (DESIGN: "one brain, two bodies"):
the simulator (``sim/``) and the real cluster — the vLLM scheduler plugin
(``prefill/engine_scheduler.py``) on each engine and the dispatcher
(``dispatcher/server.py``) in front. Each sees the same events — a request is
dispatched, a step ends, a prefill finishes, a request ends — and must do the
same things with them. Those things live here, so that a body only translates
its own state into these calls:

* :class:`LocalHost`, one engine instance: the :class:`InstanceView` a policy
  sees (with the admission reserve), the plan, the tokens each request runs in
  the step, the online correction β (§4.1) and the policy's notifications
  (``on_batch_done``, ``on_request_finished``);
* :meth:`LocalHost.unstick`, what to free when the plan is empty although work is
  queued (which request to preempt or fail), so that no body waits for ever;
* :class:`ViewOrder`, the order in which an instance lists its requests to the
  policy (which ties between equal requests follow);
* :class:`RouterHost`, the global side: routing, and the PrefillQueueMap of
  §4.3 (``PrefillQueueMap[p]``, ``ts_p``, ``n_d``) updated from events, never
  by hand, and the router told of every request that ends.

``tests/test_host_equivalence.py`` checks that the simulator and the plugin,
driven by one event sequence, decide alike.

Pure like the rest of ``scheduler/``: no engine, network or file I/O. Times are
seconds on the body's clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .estimator import Estimator
from .local.base import (
    COLOCATED,
    PREFILL_ONLY,
    BatchPlan,
    InstanceView,
    LocalPolicy,
    admission_reserve,
)
from .request import Request
from .routing.base import PROMISE_S, DecodeInstance, GlobalPolicy, PrefillInstance, PrefillQueueMap

# -- one engine instance ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Unstick:
    """What frees an instance whose policy planned nothing although work is queued
    (:meth:`LocalHost.unstick`): recompute-preempt ``preempt``, or fail the requests of
    ``fail`` (they can never fit the empty cache), or, with neither, wait (memory held by
    finished prefills waiting for their KV transfer frees itself)."""

    preempt: Request | None = None
    fail: tuple[Request, ...] = ()

    @property
    def wait(self) -> bool:
        return self.preempt is None and not self.fail



class LocalHost:
    """An engine instance's side of the scheduler: its policy and its estimator.

    The body calls, in this order for every step:

    1. :meth:`view` with its queues (requests still needing prefill, requests
       decoding, in :class:`ViewOrder`'s order), its free KV blocks and whether
       it holds no KV at all;
    2. :meth:`plan` on that view; :meth:`tokens` says what each request runs;
    3. :meth:`observe` (or :meth:`observe_run` for a run of steps) with the
       step's measured time, then :meth:`batch_done` once the step's tokens
       are in; :meth:`finished` for every request that ended.

    ``policy`` may be None (an instance that runs no policy: vLLM's own
    decisions, a simulated decode instance); then only β is kept.
    """

    def __init__(self, policy: LocalPolicy | None, estimator: Estimator, mode: str,
                 block_size: int, total_blocks: int):
        self.policy = policy
        self.est = estimator
        self.mode = mode
        self.block_size = block_size
        self.total_blocks = total_blocks

    # -- deciding a step ----------------------------------------------------------------------
    def view(self, now: float, waiting: list[Request], decoding: list[Request], free_blocks: int,
             idle: bool) -> InstanceView:
        """What the policy sees: ``idle`` when nothing holds KV (then no admission reserve,
        so that any request that fits the empty cache can start)."""
        return InstanceView(now, waiting, decoding, free_blocks, self.block_size, self.mode,
                            admission_reserve(len(decoding), self.total_blocks, idle))

    def plan(self, view: InstanceView) -> BatchPlan:
        """The policy's batch for ``view``; with nothing queued an empty one, without asking
        the policy (an engine steps once more after its last request, to hand it back)."""
        if not view.waiting and not view.decoding:
            return BatchPlan()
        return self.policy.schedule(view)

    def unstick(self, view: InstanceView, idle: bool) -> Unstick:
        """The plan for ``view`` came out empty although requests are queued: KV memory is
        held by requests the policy will not run now, and an engine that only waits would
        wait for ever. Free some, as vLLM would: recompute-preempt the most recently started
        partial prefill, else the newest decode; with nothing holding KV (``idle``), fail the
        requests that cannot fit even the empty cache (a re-prefill after preemption can
        outgrow it), or, if there are none, the policy declined them all and the oldest goes.
        Not idle with nothing to preempt (a prefill-only instance whose blocks hold finished
        prefills waiting for their KV transfer): wait. The body applies the decision, then
        plans again."""
        partial = [r for r in view.waiting if r.holds_kv]
        if partial:
            return Unstick(preempt=partial[-1])
        if view.decoding:
            return Unstick(preempt=view.decoding[-1])
        if not idle or not view.waiting:
            return Unstick()
        # idle: every block is free, so view.free_blocks is the capacity of the empty cache
        bs = view.block_size
        never = [r for r in view.waiting if -(-(r.prefill_len + 1) // bs) > view.free_blocks]
        return Unstick(fail=tuple(never or view.waiting[:1]))

    def tokens(self, plan: BatchPlan, view: InstanceView) -> dict[str, int]:
        """Request id -> tokens it runs this step, in plan order: each planned prefill its
        chunk, each planned decode one token; on a prefill-only instance also one token for
        every request still decoding there (φ_p plans prefills only; a request sent with
        more than one output token rides along). A request not listed runs nothing."""
        caps = {r.id: n for r, n in plan.prefill}
        for r in plan.decode:
            caps[r.id] = 1
        if self.mode == PREFILL_ONLY:
            for r in view.decoding:
                caps.setdefault(r.id, 1)
        return caps

    # -- after a step ----------------------------------------------------------------------------
    def observe(self, t_real: float, prefills: Iterable[tuple[int, int]], decodes: Iterable[int],
                end: float) -> float:
        """The step that ran ``prefills`` ((l_q, l_kv) chunks) and ``decodes`` (l_kv each) took
        ``t_real`` seconds, ending at ``end``: the online correction of §4.1
        (β ← θ·β + (1-θ)·mean(T_real/T_pd)); returns β."""
        return self.est.observe(t_real, prefills, decodes, end)

    def observe_run(self, t_real: float, t_model: float, end: float, steps: int = 1) -> float:
        """A run of ``steps`` steps (one engine step, or a simulator macro-step) took ``t_real``
        seconds where the uncorrected model predicts ``t_model``; returns β."""
        return self.est.observe_time(t_real, t_model, end, steps)

    def batch_done(self, plan: BatchPlan, now: float) -> None:
        """The planned batch ran and its tokens are recorded (stateful policies count here)."""
        if self.policy is not None:
            self.policy.on_batch_done(plan, now)

    def finished(self, req: Request, now: float) -> None:
        """``req`` ended here (last token, failure, abort, hand-off: ``req.error`` says which)."""
        if self.policy is not None:
            self.policy.on_request_finished(req, now)


class ViewOrder:
    """The order in which a body lists its requests in the :class:`InstanceView`, which
    policies that break ties by position read (a stable sort, the first of equals):

    * ``waiting``: in arrival order, with the requests preempted while decoding ahead of
      them, the most recently preempted first; a partial prefill keeps its place, also
      when it is preempted;
    * ``decoding``: in the order their prefills finished (plan order within one step).

    The simulator's instance keeps its lists in this order as it goes (append on arrival,
    insert at the front on preemption, append on the first token). A body whose engine
    keeps queues of its own in another order (vLLM: running requests in admission order,
    then the waiting queue) reports the same events here and sorts with :meth:`sort`.
    """

    __slots__ = ("_decoding", "_seq", "_waiting")

    def __init__(self) -> None:
        self._waiting: dict[str, int] = {}
        self._decoding: dict[str, int] = {}
        self._seq = 0

    def arrived(self, rid: str) -> None:
        self._seq += 1
        self._waiting[rid] = self._seq

    def prefilled(self, rid: str) -> None:
        """``rid``'s prefill finished: it decodes, behind the ones already decoding."""
        self._seq += 1
        self._decoding[rid] = self._seq

    def preempted(self, rid: str) -> None:
        """``rid`` was preempted while decoding: back to prefill, ahead of every waiting request."""
        self._seq += 1
        self._waiting[rid] = -self._seq
        self._decoding.pop(rid, None)

    def forget(self, rid: str) -> None:
        self._waiting.pop(rid, None)
        self._decoding.pop(rid, None)

    def sort(self, waiting: list[Request], decoding: list[Request]) -> None:
        """Put ``waiting`` and ``decoding`` (in place) in this order."""
        w, d = self._waiting, self._decoding
        waiting.sort(key=lambda r: w.get(r.id, 0))
        decoding.sort(key=lambda r: d.get(r.id, 0))


# -- the global side ---------------------------------------------------------------------------------


class RouterHost:
    """The global scheduler's state, moved by the events a body sees (§4.3).

    ``PrefillQueueMap[p]`` holds the requests dispatched to ``p`` whose prefill has not
    finished; co-located, ``n_d`` counts the requests decoding on ``p``. The body reports:

    * :meth:`dispatched` — the request was sent to ``p`` (``PrefillQueueMap[p].add(r)``);
    * :meth:`prefill_finished` — the asynchronous completion signal (first token, KV
      handed off): ``PrefillQueueMap[p].remove(r)``; co-located, it now decodes on ``p``;
    * :meth:`requeued` — preempted on ``p`` while decoding, back to prefill there;
    * :meth:`released` — the request no longer occupies ``p`` (its attempt there ended:
      done, failed, or retried elsewhere);
    * :meth:`finished` — the request ended for good (released, and the router told);
    * :meth:`published` — with several dispatchers, an instance's publication of its queued
      prefill work: the view becomes it plus this dispatcher's own dispatches not in it yet.

    Every event may come more than once or out of place (a failure path repeating a
    release): the host remembers where each request is and ignores what no longer applies.
    """

    def __init__(self, policy: GlobalPolicy, prefills: Sequence[PrefillInstance], promise_s: float = PROMISE_S):
        self.policy = policy
        self.promise_s = promise_s        # how long a decode instance's blocks stay promised at most
        self.qmap = PrefillQueueMap(prefills)
        self.colocated = policy.deployment == COLOCATED
        self._at: dict[str, list] = {}   # request id -> [instance id, decoding there, the request]
        self._decode: dict[str, DecodeInstance] = {}   # request id -> where blocks are promised to it

    def _unreserve(self, req: Request) -> None:
        d = self._decode.pop(req.id, None)
        if d is not None:
            d.release(req.id)

    def route(self, req: Request, prefills: Sequence[PrefillInstance], decodes: Sequence[DecodeInstance] = (),
              now: float = 0.0):
        """The policy's ``(prefill instance, decode instance or None)`` for ``req``; nothing
        is dispatched until :meth:`dispatched`."""
        return self.policy.route(req, prefills, decodes, now)

    def dispatched(self, req: Request, inst_id: int, now: float,
                   decode: DecodeInstance | None = None, blocks: int = 0) -> None:
        """``req`` was sent to instance ``inst_id``: it joins ``PrefillQueueMap[p]``.
        Disaggregated, ``decode`` is the decode instance picked for it: ``blocks`` of it are
        promised to ``req`` until its prefill finishes, for at most ``promise_s``
        (:attr:`DecodeInstance.reserved`)."""
        if req.id in self._at:
            self.released(req, now)
        self._at[req.id] = [inst_id, False, req]
        self.qmap.add(inst_id, req, now)
        if decode is not None:
            decode.reserve(req.id, blocks, now + self.promise_s)
            self._decode[req.id] = decode

    def prefill_finished(self, req: Request, now: float) -> None:
        """``req``'s prefill finished (its first token, or its KV handed off)."""
        self._unreserve(req)              # its KV is on its way: the decode side will report it
        at = self._at.get(req.id)
        if at is None or at[1]:
            return
        self.qmap.remove(at[0], req, now)
        if self.colocated:
            at[1] = True                      # it decodes where it was prefilled: n_d += 1
            self.qmap.decode_started(at[0], req.prompt_len)
        else:
            del self._at[req.id]              # its KV moved to a decode instance

    def requeued(self, req: Request, now: float) -> None:
        """``req`` was preempted where it decoded and waits to be prefilled again there
        (a partial prefill preempted is still queued: nothing changes)."""
        at = self._at.get(req.id)
        if at is None:
            return
        if at[1]:
            at[1] = False
            self.qmap.decode_finished(at[0], req.prompt_len)
            self.qmap.add(at[0], req, now)

    def released(self, req: Request, now: float) -> None:
        """``req`` no longer occupies the instance it was dispatched to."""
        self._unreserve(req)
        at = self._at.pop(req.id, None)
        if at is None:
            return
        if at[1]:
            self.qmap.decode_finished(at[0], req.prompt_len)
        else:
            self.qmap.remove(at[0], req, now)

    def published(self, inst_id: int, queued: Sequence[tuple[Request, int, int]], ts: float,
                  n_decode: int | None = None, decode_kv: float | None = None) -> None:
        """Instance ``inst_id`` published its queued prefill work (several dispatchers, issue 15):
        ``queued`` = ``(request, l_q, l_kv)`` per request waiting for prefill there as its engine
        knows it at ``ts`` (every dispatcher's), co-located also ``n_decode`` and ``decode_kv``.
        This dispatcher's view of it becomes the publication plus its own dispatches there the
        publication does not list yet (:meth:`PrefillQueueMap.published`); the requests it
        dispatched keep moving the map by their events as before, and those of other
        dispatchers are seen from one publication to the next."""
        listed = {r.id for r, _, _ in queued}
        at = self._at
        keep = []
        for r in self.qmap[inst_id].queue:
            if r.id in listed:
                continue
            a = at.get(r.id)
            if a is not None and a[0] == inst_id and not a[1]:
                keep.append(r)
        self.qmap.published(inst_id, queued, ts, keep, n_decode, decode_kv)

    def finished(self, req: Request, now: float) -> None:
        """``req`` ended (its last token, a failure, an abort): released, and the router told."""
        self.released(req, now)
        self.policy.on_request_finished(req, now)

    def own_decodes(self, inst_id: int) -> tuple[int, float]:
        """Co-located: how many of this router's own requests decode on ``inst_id`` and their KV
        (each counted as its prompt, as :meth:`PrefillQueueMap.decode_started` counts it): the
        n_d a dispatcher falls back to when the instance's publications stop."""
        mine = [at[2] for at in self._at.values() if at[0] == inst_id and at[1]]
        return len(mine), float(sum(r.prompt_len for r in mine))

    def placed(self, rid: str) -> bool:
        """Whether request ``rid`` is on an instance by this router's events (dispatched and
        not released): a request of this dispatcher's, not another's (several dispatchers)."""
        return rid in self._at

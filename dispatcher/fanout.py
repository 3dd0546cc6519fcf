"""``n > 1`` and lists of prompts, answered as vLLM's OpenAI server answers them.

The dispatcher routes, schedules and accounts one completion per request (one
prefill, one decode, one TDG score). A request that asks for more -- ``n``
completions of a prompt, or a ``/v1/completions`` ``prompt`` that is a list of
P prompts (strings or token-id lists), or both -- is split into ``P × n``
requests of one completion each, and each goes the normal way: its own
concurrency slot (of ``max_concurrent`` and the client's
``max_concurrent_per_key``), the key's class and SLOs, its own routing, retry
and record. The answers are merged in vLLM's order and form:

* **choice index** ``i·n + j`` for sample ``j`` of prompt ``i`` (vLLM:
  ``output.index + prompt_idx * num_choices`` in
  ``entrypoints/openai/completion/serving.py``); unstreamed, the choices are in
  that order;
* **usage**: ``completion_tokens`` summed over all choices, ``prompt_tokens``
  counted once per prompt (not once per sample), as vLLM counts them;
  ``total_tokens`` their sum;
* **streamed**: the sub-streams' chunks are passed on as they come, each with
  its choice's index, all under one ``id`` and ``created``; the sub-streams'
  usage chunks are held back and one summed usage chunk ends the stream (when
  the client asked for ``stream_options.include_usage``); per-chunk
  ``continuous_usage_stats`` pass through per choice, as vLLM sends them;
* **seed**: sub-request ``j`` gets ``seed + j``, which is what vLLM itself does
  with ``n > 1`` (its V1 engine splits the request into n child requests,
  ``vllm/v1/engine/parallel_sampling.py``: ``child_sampling_params.seed = seed + index``),
  so a seeded request gives n different samples, the same for every prompt of a list;
* **admission control** (when configured) decides every part before any is
  routed, each on the cluster as it is (not queued behind its own siblings,
  which would refuse an ``n`` larger than the queue caps, or than fits the TTFT
  SLO back to back, on an idle cluster for ever); a part refused refuses the
  whole request (429) before any prefill work;
* **failure**: the first sub-request that fails fails the whole request (its
  status and message, or an SSE ``error`` event once chunks were sent); the
  others are cancelled upstream, and every sub-request ends (its record, its
  slot); a client that goes away cancels them all.

Checks, before any work (400): ``n`` an integer >= 1; at most
:data:`MAX_FANOUT` completions per request (``n`` × prompts; vLLM's own caps are
``VLLM_MAX_N_SEQUENCES`` = 16384 and ``VLLM_MAX_COMPLETION_PROMPTS`` = 1024, but
it runs them in one engine request, where the dispatcher runs a routed request
each), and no more than the client's concurrency limits (``max_concurrent``,
``max_concurrent_per_key``) can ever hold at once (a 429 would be retried for
ever); ``n > 1`` with greedy sampling (``temperature`` 0) refused with vLLM
0.32's message; ``n > 1`` with ``use_beam_search`` refused (vLLM's beam width is
``n``: one request, which cannot be split); a ``seed`` that is not an integer,
or whose ``seed + n - 1`` passes 2⁶³-1. ``best_of`` is passed on untouched:
vLLM 0.32 ignores it (no such field any more; unknown fields are ignored). A
list of P prompts with ``n`` = 1 and a single prompt with ``n`` > 1 both take
this path; a one-element list with ``n`` = 1 is a plain request.

Costs of splitting rather than batching: each sub-request is prefilled on its
own (disaggregated: one prefill leg each, so the n samples of one prompt share
no prefill unless they land on the same instance, where vLLM's prefix cache
serves them), and a text prompt is counted (``/tokenize``) once per sub-request.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from .errors import ApiError
from .requests import CHAT, COMPLETIONS, Job, split_prompts

if TYPE_CHECKING:
    from .config import KeyEntry
    from .limits import Slot
    from .server import Dispatcher

#: most completions (n × prompts) one request may ask for: each is a routed request
#: holding a concurrency slot (below max_concurrent_per_key's default of 256)
MAX_FANOUT = 128
#: temperatures below this are greedy sampling (vLLM's _SAMPLING_EPS)
_GREEDY_EPS = 1e-5
_INT64_MAX = 2**63 - 1


def _n(body: dict) -> int:
    n = body.get("n")
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int):
        raise ApiError(400, f"n must be an integer, got {n!r:.40}", param="n")
    if n < 1:
        raise ApiError(400, f"n must be at least 1, got {n}.", param="n")   # vLLM's wording
    return n


def split(path: str, body: Any) -> tuple[int, list[dict]] | None:
    """``(n, bodies)``: the bodies of the one-completion requests ``body`` stands for,
    in choice-index order (prompt-major: index ``i·n + j``), or None when it asks for
    one completion (a plain request; also when ``body`` is not an object: the caller
    answers that). 400 (:class:`ApiError`) for the checks in the module's docstring."""
    if not isinstance(body, dict):
        return None
    n = _n(body)
    prompts: list | None = None
    if path == COMPLETIONS and "prompt" in body:
        prompts = split_prompts(body["prompt"])
    count = n * (len(prompts) if prompts else 1)
    if count == 1:
        return None
    if count > MAX_FANOUT:
        what = f"n = {n}" if not prompts or len(prompts) == 1 else f"{len(prompts)} prompts × n = {n}"
        raise ApiError(400, f"{what} asks for {count} completions; the dispatcher serves at most {MAX_FANOUT} "
                            f"per request (send several requests)", param="n" if n > 1 else "prompt")
    seed = body.get("seed")
    if n > 1:
        t = body.get("temperature")
        if isinstance(t, (int, float)) and not isinstance(t, bool) and t < _GREEDY_EPS:
            raise ApiError(400, f"n must be 1 when using greedy sampling, got {n}.", param="n")   # vLLM 0.32's check
        if body.get("use_beam_search"):
            raise ApiError(400, f"use_beam_search with n = {n} is not supported by the dispatcher (vLLM's beam "
                                f"width is n: one request it cannot split); send n = 1", param="use_beam_search")
        if seed is not None:
            if isinstance(seed, bool) or not isinstance(seed, int):
                raise ApiError(400, f"seed must be an integer, got {seed!r:.40}", param="seed")
            if seed + n - 1 > _INT64_MAX:
                raise ApiError(400, f"seed + n - 1 must be at most 2**63 - 1 (sample j is drawn with seed + j), "
                                    f"got seed {seed} and n {n}", param="seed")
    subs = []
    for p in prompts or [None]:
        for j in range(n):
            b = dict(body)
            b.pop("n", None)
            if p is not None:
                b["prompt"] = p
            if n > 1 and seed is not None:
                b["seed"] = seed + j      # as vLLM's parallel sampling seeds its child requests
            subs.append(b)
    return n, subs


# -- merging -----------------------------------------------------------------------------------------
def _usage_sum(usages: list[dict | None], n: int) -> dict | None:
    """vLLM's usage of the whole request from its sub-requests' (index order, n per
    prompt): prompt tokens once per prompt (the first sample's figure), completion
    tokens (and reasoning tokens, where given) summed. None when a sub-request gave none."""
    if not usages or any(not isinstance(u, dict) for u in usages):
        return None
    prompt = sum(_count(usages[i].get("prompt_tokens")) for i in range(0, len(usages), n))
    completion = sum(_count(u.get("completion_tokens")) for u in usages)
    out: dict = {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}
    details = [u.get("completion_tokens_details") for u in usages]
    if any(isinstance(d, dict) and "reasoning_tokens" in d for d in details):
        out["completion_tokens_details"] = {
            "reasoning_tokens": sum(_count(d.get("reasoning_tokens")) for d in details if isinstance(d, dict))}
    if isinstance(usages[0].get("prompt_tokens_details"), dict):
        out["prompt_tokens_details"] = usages[0]["prompt_tokens_details"]   # the first sample's (cached tokens)
    return out


def _count(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


def merge_answers(answers: list[dict], n: int) -> dict:
    """One unstreamed answer from the sub-requests' (in index order, ``n`` per prompt):
    the first's envelope (id, created, model...), every choice renumbered, usage summed."""
    out = dict(answers[0])
    choices = []
    for k, a in enumerate(answers):
        for c in a.get("choices") or ():
            choices.append({**c, "index": k})
    out["choices"] = choices
    usage = _usage_sum([a.get("usage") for a in answers], n)
    if usage is not None:
        out["usage"] = usage
    else:
        out.pop("usage", None)
    return out


class StreamMerge:
    """Renumbers the chunks of ``count`` sub-streams (``n`` per prompt) into one
    vLLM stream: :meth:`chunk` gives what to send for a sub-stream's chunk (None for
    a usage chunk, held back), :meth:`final_usage` the summed usage chunk."""

    def __init__(self, count: int, n: int):
        self.n = n
        self.id: Any = None
        self.created: Any = None
        self.usage: list[dict | None] = [None] * count
        self._template: dict | None = None

    def chunk(self, k: int, chunk: dict) -> dict | None:
        if self.id is None:          # the whole stream goes under its first chunk's id and time
            self.id, self.created = chunk.get("id"), chunk.get("created")
        for key, v in (("id", self.id), ("created", self.created)):
            if v is not None and key in chunk:
                chunk[key] = v
        choices = chunk.get("choices")
        if not choices and "usage" in chunk:
            self.usage[k] = chunk["usage"]
            if self._template is None:
                self._template = chunk
            return None
        for c in choices or ():
            c["index"] = k
        return chunk

    def final_usage(self) -> dict | None:
        usage = _usage_sum(self.usage, self.n)
        if usage is None:
            return None
        return {**self._template, "choices": [], "usage": usage}


# -- running -----------------------------------------------------------------------------------------
class _Slots:
    """The concurrency slots of a fanned-out request's sub-requests; :meth:`release`
    gives them all back (idempotent, as Slot.release)."""

    def __init__(self, slots: list[Slot]):
        self.slots = slots
        self.client = slots[0].client

    def release(self) -> None:
        for s in self.slots:
            s.release()


_DONE = object()


class FanOut:
    """One client request run as sub-requests (``jobs``, in choice-index order).
    The request entry (``serve`` in :mod:`proserve.dispatcher.server`) drives it as it
    drives a Job with the Dispatcher: it is the job, the runner (:meth:`events`,
    :meth:`finish`, :meth:`count_tokens`, same signatures as the Dispatcher's) and the
    slot (:meth:`release`)."""

    def __init__(self, dispatcher: Dispatcher, path: str, jobs: list[Job], n: int, slots: _Slots):
        self.d = dispatcher
        self.path = path
        self.jobs = jobs
        self.n = n
        self._slots = slots
        self.id = f"proserve-{uuid.uuid4().hex}"
        first = jobs[0]
        self.stream = first.stream
        self.want_usage = first.want_usage
        self.want_token_ids = first.want_token_ids
        self.grant = first.grant                        # (read for the response headers)
        self.record: dict = {}                          # each sub-request keeps its own record
        self.failed: int | None = None                 # the sub-request whose failure ended the request
        self.streamed: list[bool] = [False] * len(jobs)   # streams that ended with all their chunks sent
        for k, j in enumerate(jobs):
            j.record["fanout"] = {"id": self.id, "index": k, "of": len(jobs)}
        dispatcher.metrics.in_flight.inc(len(jobs) - 1)   # the request entry counts the first

    @property
    def is_chat(self) -> bool:
        return self.path == CHAT

    @classmethod
    async def admit(cls, d: Dispatcher, path: str, split: tuple[int, list[dict]], entry: KeyEntry | None,
                    arrival: float, slot: Slot) -> FanOut:
        """Each sub-request admitted as a request of its own: a concurrency slot beyond
        the client's first (429 when they are not all free: nothing starts) and the
        Dispatcher's checks (auth, body, prompt count, context)."""
        n, subs = split
        lim = d.limiter
        most = lim.max_total if slot.client is None else min(lim.max_total, lim.max_per_client)
        if len(subs) > most:
            # more slots than the limits ever grant at once: a 429 would be retried for ever
            raise ApiError(400, f"this request asks for {len(subs)} completions, each a request of its own, and "
                                f"at most {most} may be in progress at once for this client (the dispatcher's "
                                f"concurrency limit); send fewer (n × prompts)",
                           param="n" if n > 1 else "prompt")
        slots = [slot]
        try:
            for _ in subs[1:]:
                try:
                    slots.append(d.limiter.acquire(slot.client))
                except ApiError as e:
                    d.metrics.rejected.labels("client_overloaded" if e.code == "too_many_concurrent_requests_for_key"
                                              else "overloaded").inc()
                    raise ApiError(e.status, f"{e.message} (this request asks for {len(subs)} completions, each "
                                             f"a request of its own)", code=e.code, headers=e.headers) from None
            jobs = [await d.admit(path, b, entry, arrival) for b in subs]
        except BaseException:
            for s in slots[1:]:      # the first is the request entry's to give back
                s.release()
            raise
        return cls(d, path, jobs, n, _Slots(slots))

    def release(self) -> None:
        self._slots.release()

    # -- the Dispatcher's interface, over the sub-requests ---------------------------------------------
    def count_tokens(self, job: Any, t: float, chunk: dict) -> None:
        """Nothing: :meth:`events` counts each sub-request's tokens itself."""

    def finish(self, job: Any, outcome: str, error: str | None = None) -> None:
        """End every sub-request: with the request's outcome, except that when one
        sub-request's failure ended it, the others were cancelled (or, streamed to
        their end already, ok)."""
        for k, j in enumerate(self.jobs):
            if self.streamed[k]:
                self.d.finish(j, "ok")
            elif self.failed is None or k == self.failed:
                self.d.finish(j, outcome, error)
            else:
                self.d.finish(j, "cancelled", f"sub-request {self.failed} of its fan-out failed: {error}")
        self.d.metrics.in_flight.dec(len(self.jobs) - 1)

    async def events(self, job: Any = None) -> AsyncIterator[tuple[float, dict]]:
        """(time, chunk) for the client: the merged answer (unstreamed), or the
        sub-streams' chunks as they come, renumbered, then the summed usage chunk.
        Raises the first sub-request's error; closing it cancels every sub-request."""
        d, jobs = self.d, self.jobs
        # admission control for every part at once, before any is routed: each is judged
        # on the cluster as it is, not behind its own siblings (else an n larger than the
        # queue caps, or than what fits the TTFT SLO back to back, would be refused on an
        # idle cluster for ever), and a refusal comes before any prefill work
        now = time.time()
        for k, j in enumerate(jobs):
            try:
                d._admit(j, now)
            except ApiError:
                self.failed = k
                raise
        # one bounded queue for all sub-streams: a slow client slows them all (back-pressure)
        queue: asyncio.Queue = asyncio.Queue(max(d.cfg.stream_queue_events, len(jobs)))

        async def pump(k: int) -> None:
            agen = d.events(jobs[k])
            try:
                sent = False
                async for t, chunk in agen:
                    sent = True
                    await queue.put((k, t, chunk))
                if not sent:                # as a plain request's empty answer: 502, not a missing choice
                    raise ApiError(502, f"the worker sent no response (sub-request {k})")
                await queue.put((k, 0.0, _DONE))
            except Exception as e:          # the sub-request failed: ApiError, UpstreamError...
                await queue.put((k, 0.0, e))
            finally:
                await agen.aclose()

        tasks = [asyncio.ensure_future(pump(k)) for k in range(len(jobs))]
        try:
            merge = StreamMerge(len(jobs), self.n)
            answers: list[dict | None] = [None] * len(jobs)
            left = len(jobs)
            while left:
                k, t, item = await queue.get()
                if item is _DONE:
                    left -= 1
                    if self.stream:
                        self.streamed[k] = True
                    continue
                if isinstance(item, Exception):
                    self.failed = k
                    raise item
                if not self.stream:
                    answers[k] = item
                    continue
                d.count_tokens(jobs[k], t, item)
                out = merge.chunk(k, item)
                if out is not None:
                    yield t, out
            if self.stream:
                usage = merge.final_usage()
                if usage is not None:
                    yield time.time(), usage
                return
            missing = [k for k, a in enumerate(answers) if a is None]
            if missing:
                self.failed = missing[0]
                raise ApiError(502, f"the worker sent no response (sub-request {missing[0]})")
            now = time.time()                # all the tokens reach the client now
            for k, a in enumerate(answers):
                d.count_tokens(jobs[k], now, a)
            yield now, merge_answers(answers, self.n)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


"""HTTP load generator: replay a workload against an OpenAI-compatible
``/v1/completions`` endpoint and score it with the simulator's metrics.

    python -m bench.loadgen --url http://127.0.0.1:8100 --rate 2 --num-requests 200 --out out/lg

What one run does:

1. **Workload** (:func:`make_workload`): the same pipeline as the simulator
   (:func:`bench.workloads.build_workload`) — trace (bundled Azure
   conversation trace by default), first ``--num-requests`` rows,
   :func:`~bench.workloads.scale_to_rate`, seeded 50/50
   :func:`~bench.workloads.tag_priorities` with the class SLOs — plus an
   optional length shaping step (:func:`shape_lengths`: divide prompt / output
   lengths, clip prompts) for engines much faster or slower than the trace's.
2. **Prompts**: random token ids in ``[--token-low, --vocab)`` of each
   request's prompt length, seeded per request (request ``r7`` gets the same
   prompt whatever the rate or the order of sends). ``max_tokens`` is the
   output length and ``ignore_eos`` is set, so every request must return
   exactly that many tokens.
3. **Sends** at the workload's arrival times (offsets from the run start, one
   asyncio task per request, no client-side concurrency limit), streaming
   (``"stream": true``). Each request carries its class and SLOs in
   ``vllm_xargs`` (``priority_class``, ``weight``, ``ttft_slo``, ``tpot_slo``,
   ``arrival_time`` = the scheduled send time in Unix seconds, so the engine's
   deadlines count from the same instant as the client's); ``--no-xargs``
   leaves them out. ``--class-body CLASS=JSON`` merges extra fields into the
   body of one class's requests (e.g. vLLM's own ``{"priority": 0}``),
   ``--body JSON`` into every request's.
4. **Timestamps**: every SSE chunk is stamped when it is read; a chunk carries
   ``len(choices[0].token_ids)`` tokens (vLLM with ``return_token_ids``; the
   default, since token-id prompts without a tokenizer stream empty text), or,
   without token ids, one token per non-empty ``text`` (``--no-token-ids``,
   for servers that reject ``return_token_ids``). All tokens of a chunk get the
   chunk's time.
5. **Results**: every request ends with a :class:`Result` — its token times,
   or an error (HTTP status and the server's message, a transport exception,
   a stream that ended early, an error event, or a token count that differs
   from ``max_tokens`` or from the final ``usage``). Note that vLLM answers a
   *streamed* request whose parameters it rejects with HTTP 200 and an error
   event carrying the 400 (``error event: (400) vllm_xargs...``); unstreamed,
   the same request gets HTTP 400. Nothing is dropped: errors
   are counted per class in the summary. Malformed SSE data lines are counted
   per request; they make the request an error only if tokens went missing.
6. **Metrics**: results become :class:`scheduler.request.Request` objects
   (:func:`to_request`; arrival = scheduled send time, token times on the same
   clock) scored by :func:`scheduler.tdg.summarize` with
   :meth:`~scheduler.tdg.GainConfig.from_workload` weights — the very code the
   simulator's tables use. A request that ended in an error keeps the tokens
   it got (they count for TDG if on time) but is not finished, so it fails
   its SLO.

Client health: the summary reports the send lag (actual − scheduled send)
and the client's own event-loop stalls longer than 50 ms. Both should be ~0;
if not, the client was starved of CPU and its timestamps measure itself, not
the server. Measured here: with the kernel's autogroup scheduling, a client
sharing a core with a vLLM server started in *another session* (e.g. with
``setsid``) stalled for up to 0.3-0.6 s at a time; in the same session it did
not.

Times: the run clock is ``time.perf_counter()`` minus the run start; ``arrival``
and ``token_times`` in the JSONL are seconds from the run start, and the
summary records the run start in Unix seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from scheduler.config import classes_from_dicts, default_classes
from scheduler.request import ConfigError, Phase, PriorityClass, Request
from scheduler.tdg import GainConfig, slo_attained, summarize

from .traces import TraceRecord, load_trace
from .workloads import scale_to_rate, synthetic, tag_priorities

BUNDLED_TRACE = Path(__file__).resolve().parent / "data" / "azure_conv_2023.csv"
DEFAULT_VOCAB = 1024      # the bundled tiny Llama
DEFAULT_TOKEN_LOW = 3     # skip ids 0-2 (pad/bos/eos of Llama-style vocabularies)
_SALT_PROMPT = 0x9807     # seed salt of the prompt token streams


# --- workload ---------------------------------------------------------------------

def shape_lengths(records: Sequence[TraceRecord], prompt_div: float = 1.0, output_div: float = 1.0,
                  max_prompt: int | None = None) -> list[TraceRecord]:
    """Scale a trace's token counts to an engine: ``prompt / prompt_div`` and
    ``output / output_div`` (rounded, at least 1), prompts clipped to
    ``max_prompt``. Arrivals are untouched. Identity with the defaults."""
    for name, v in (("prompt_div", prompt_div), ("output_div", output_div)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ConfigError(f"shape_lengths: {name} must be a finite number > 0, got {v!r}")
    if max_prompt is not None and (not isinstance(max_prompt, int) or max_prompt < 1):
        raise ConfigError(f"shape_lengths: max_prompt must be a positive integer, got {max_prompt!r}")
    out = []
    for r in records:
        p = max(1, int(round(r.prompt_len / prompt_div)))
        if max_prompt is not None:
            p = min(p, max_prompt)
        o = max(1, int(round(r.output_len / output_div)))
        out.append(replace(r, prompt_len=p, output_len=o))
    return out


def make_workload(trace: str = "azure", rate: float | None = None, num_requests: int | None = None,
                  seed: int = 0, classes: Mapping[str, PriorityClass] | None = None,
                  fmt: str | None = None, prompt_div: float = 1.0, output_div: float = 1.0,
                  max_prompt: int | None = None, max_model_len: int | None = None) -> list[Request]:
    """The simulator's pipeline (:func:`bench.workloads.build_workload`) with
    :func:`shape_lengths` between rate scaling and priority tagging.

    ``trace``: ``"azure"`` (bundled), ``"synthetic"`` (default lengths, Poisson
    at ``rate``), or a trace file. The priorities depend only on ``seed``
    and the request's position, not on the rate.
    """
    if trace == "synthetic":
        records = synthetic(num_requests or 1000, rate or 1.0, seed=seed)
    else:
        path = BUNDLED_TRACE if trace == "azure" else trace
        records = load_trace(path, "azure" if trace == "azure" else fmt, limit=num_requests)
        if rate is not None:
            records = scale_to_rate(records, rate, seed)
    records = shape_lengths(records, prompt_div, output_div, max_prompt)
    return tag_priorities(records, classes, None, seed, max_model_len)


def workload_gain(reqs: Sequence[Request], w_p: float | None = None, w_d: float = 1.0) -> GainConfig:
    """TDG weights as the simulator picks them: w_p/w_d = mean prompt / mean output (§5.1) unless given."""
    if w_p is None:
        g = GainConfig.from_workload([r.prompt_len for r in reqs], [r.output_len for r in reqs])
        return GainConfig(g.w_p * w_d, w_d)
    return GainConfig(w_p, w_d)


def send_offsets(reqs: Sequence[Request]) -> list[float]:
    """When each request is sent, in seconds from the run start: its arrival
    minus the earliest arrival (so a workload need not start at 0)."""
    if not reqs:
        return []
    first = min(r.arrival for r in reqs)
    return [r.arrival - first for r in reqs]


def prompt_tokens(seed: int, index: int, length: int, vocab: int = DEFAULT_VOCAB,
                  low: int = DEFAULT_TOKEN_LOW) -> list[int]:
    """``length`` random token ids in ``[low, vocab)``, a function of (seed, index) only."""
    if not 0 <= low < vocab:
        raise ConfigError(f"prompt tokens: need 0 <= token_low < vocab, got {low} and {vocab}")
    rng = np.random.default_rng([int(seed), _SALT_PROMPT, int(index)])
    return rng.integers(low, vocab, size=int(length)).tolist()


def request_index(req: Request, default: int) -> int:
    """The position encoded in the workload's ids (``r17`` → 17), else ``default``."""
    rid = req.id
    if rid.startswith("r") and rid[1:].isdigit():
        return int(rid[1:])
    return default


# --- the request body ---------------------------------------------------------------

def deep_merge(base: dict, extra: Mapping) -> dict:
    """Merge ``extra`` into ``base`` in place; nested objects merge, other values replace."""
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(base.get(k), dict):
            deep_merge(base[k], v)
        else:
            base[k] = json.loads(json.dumps(v)) if isinstance(v, (dict, list)) else v
    return base


@dataclass
class ClientConfig:
    """How requests are sent (everything that is not the workload)."""

    base_url: str
    model: str | None = None            # None: the first model the server lists
    api_key: str | None = None          # sent as "Authorization: Bearer <key>"
    vocab: int = DEFAULT_VOCAB
    token_low: int = DEFAULT_TOKEN_LOW
    seed: int = 0                       # prompt token seed
    send_xargs: bool = True             # class/SLOs/arrival in vllm_xargs
    return_token_ids: bool = True       # count tokens by token_ids (vLLM); else one per text chunk
    body: dict = field(default_factory=dict)               # extra fields of every request
    class_body: dict = field(default_factory=dict)         # class -> extra fields
    request_timeout: float = 600.0      # seconds, whole request
    start_delay: float = 0.5            # seconds between preparing and the first send

    def completions_url(self) -> str:
        return api_url(self.base_url, "completions")


def api_url(base: str, path: str) -> str:
    """``http://host:port`` or ``http://host:port/v1`` + ``/v1/<path>``."""
    b = base.rstrip("/")
    if not b.endswith("/v1"):
        b += "/v1"
    return f"{b}/{path}"


def request_body(req: Request, prompt: list[int], model: str, cfg: ClientConfig,
                 arrival_unix: float | None = None) -> dict:
    body: dict[str, Any] = {
        "model": model, "prompt": prompt, "max_tokens": req.output_len, "ignore_eos": True,
        "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
    }
    if cfg.return_token_ids:
        body["return_token_ids"] = True
    if cfg.send_xargs:
        xa = {"priority_class": req.priority, "weight": req.weight, "ttft_slo": req.ttft_slo,
              "tpot_slo": req.tpot_slo}
        if arrival_unix is not None:
            xa["arrival_time"] = arrival_unix
        body["vllm_xargs"] = xa
    deep_merge(body, cfg.body)
    deep_merge(body, cfg.class_body.get(req.priority, {}))
    return body


# --- SSE -------------------------------------------------------------------------------

class SSEParser:
    """Incremental ``text/event-stream`` parser: bytes in, event data out.

    Lines end in LF or CRLF and may be split across reads; ``data:`` lines of
    one event are joined with LF; an empty line ends the event; comments
    (``:...``) and other fields (``event``, ``id``, ``retry``) are ignored.
    :meth:`close` returns an event left open at the end of the stream (the SSE
    spec would drop it; a load generator must not lose a chunk's tokens).
    """

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buf += chunk
        events: list[str] = []
        while True:
            i = self._buf.find(b"\n")
            if i < 0:
                return events
            line, self._buf = self._buf[:i], self._buf[i + 1:]
            self._line(line, events)

    def close(self) -> list[str]:
        events: list[str] = []
        if self._buf:
            line, self._buf = self._buf, b""
            self._line(line, events)
        if self._data:
            events.append("\n".join(self._data))
            self._data = []
        return events

    def _line(self, line: bytes, events: list[str]) -> None:
        if line.endswith(b"\r"):
            line = line[:-1]
        if not line:
            if self._data:
                events.append("\n".join(self._data))
                self._data = []
            return
        if line.startswith(b":"):
            return
        name, sep, value = line.partition(b":")
        if not sep:
            return
        if value.startswith(b" "):
            value = value[1:]
        if name == b"data":
            self._data.append(value.decode("utf-8", "replace"))


@dataclass
class Chunk:
    """What one SSE data payload says."""

    tokens: int = 0
    done: bool = False                 # the [DONE] sentinel
    finish_reason: str | None = None
    usage_tokens: int | None = None    # usage.completion_tokens, if reported
    error: str | None = None           # an error event's message
    malformed: str | None = None       # why the payload could not be read


def parse_chunk(data: str, token_ids: bool = True) -> Chunk:
    """Read one completion stream payload (OpenAI ``text_completion`` chunk)."""
    if data.strip() == "[DONE]":
        return Chunk(done=True)
    try:
        obj = json.loads(data)
    except json.JSONDecodeError as e:
        return Chunk(malformed=f"not JSON ({e.msg}): {data[:80]!r}")
    if not isinstance(obj, dict):
        return Chunk(malformed=f"not a JSON object: {data[:80]!r}")
    if "error" in obj and obj["error"]:
        err = obj["error"]
        msg = err.get("message", json.dumps(err)) if isinstance(err, dict) else str(err)
        code = err.get("code") if isinstance(err, dict) else None
        return Chunk(error=f"({code}) {msg}" if code is not None else str(msg))
    out = Chunk()
    usage = obj.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        out.usage_tokens = usage["completion_tokens"]
    choices = obj.get("choices")
    if choices is None:
        if out.usage_tokens is None:
            out.malformed = f"no choices: {data[:80]!r}"
        return out
    if not isinstance(choices, list):
        out.malformed = f"choices is not a list: {data[:80]!r}"
        return out
    for ch in choices:
        if not isinstance(ch, dict) or ch.get("index", 0) != 0:
            continue
        ids = ch.get("token_ids")
        if token_ids and isinstance(ids, list):
            out.tokens += len(ids)
        elif not token_ids or ids is None:
            text = ch.get("text")
            if isinstance(text, str) and text:
                out.tokens += 1
        if ch.get("finish_reason"):
            out.finish_reason = str(ch["finish_reason"])
    return out


# --- results ---------------------------------------------------------------------------

@dataclass
class Result:
    """How one request ended. Times are seconds on the run clock (0 = run start)."""

    id: str
    priority: str
    arrival: float                      # scheduled send time
    expected_tokens: int
    sent: float | None = None           # actual send time
    token_times: list[float] = field(default_factory=list)
    status: int | None = None           # HTTP status (None: no response)
    error: str | None = None
    finish_reason: str | None = None
    usage_tokens: int | None = None
    malformed: int = 0                  # SSE data payloads that could not be read
    done: bool = False                  # saw [DONE]

    @property
    def ok(self) -> bool:
        return self.error is None

    def finish(self) -> "Result":
        """Decide whether the stream delivered what was asked; set ``error`` if not."""
        if self.error is not None:
            return self
        n = len(self.token_times)
        if self.status != 200:
            self.error = f"HTTP {self.status}"
        elif self.usage_tokens is not None and self.usage_tokens != n:
            self.error = f"usage reports {self.usage_tokens} tokens, the stream carried {n}"
        elif n != self.expected_tokens:
            self.error = f"got {n} of {self.expected_tokens} tokens (finish_reason={self.finish_reason})"
        elif not self.done:
            self.error = "stream ended without [DONE]"
        return self


def to_request(req: Request, res: Result) -> Request:
    """The workload request with the measured token times, for :func:`scheduler.tdg.summarize`.

    Arrival is the scheduled send time on the run clock. A request that ended
    in an error keeps the tokens it got but is not finished (it fails its SLO
    and stays out of the TPOT percentiles).
    """
    if res.id != req.id:
        raise ValueError(f"result {res.id} does not belong to request {req.id}")
    out = Request(id=req.id, priority=req.priority, weight=req.weight, ttft_slo=req.ttft_slo,
                  tpot_slo=req.tpot_slo, arrival=res.arrival, prompt_len=req.prompt_len,
                  output_len=req.output_len)
    out.token_times = list(res.token_times)
    out.error = res.error
    if res.error is None:
        out.phase = Phase.DONE
    elif out.token_times:
        out.phase = Phase.DECODING
    return out


def error_counts(results: Iterable[Result]) -> dict[str, dict]:
    """Per class (and ``all``): requests, errors, and errors by message."""
    out: dict[str, dict] = {}
    for r in results:
        for key in ("all", r.priority):
            c = out.setdefault(key, {"requests": 0, "errors": 0, "by_error": {}})
            c["requests"] += 1
            if r.error is not None:
                c["errors"] += 1
                kind = r.error if len(r.error) <= 120 else r.error[:117] + "..."
                c["by_error"][kind] = c["by_error"].get(kind, 0) + 1
    return out


def summarize_run(reqs: Sequence[Request], results: Sequence[Result], gain: GainConfig,
                  stalls: Sequence[float] = ()) -> dict:
    """Metrics per class (``summarize``), error counts, send lag, malformed chunks and the
    client's own event-loop stalls (``Run.stalls``)."""
    by_id = {r.id: r for r in results}
    missing = [q.id for q in reqs if q.id not in by_id]
    if missing:
        raise ValueError(f"{len(missing)} requests have no result (first: {missing[0]})")
    converted = [to_request(q, by_id[q.id]) for q in reqs]
    metrics = {k: v.as_dict() for k, v in summarize(converted, gain).items()}
    errs = error_counts(by_id[q.id] for q in reqs)
    for k, m in metrics.items():
        m["errors"] = errs.get(k, {}).get("errors", 0)
    lags = [r.sent - r.arrival for r in results if r.sent is not None]
    return {
        "metrics": metrics, "errors": errs,
        "gain": {"w_p": gain.w_p, "w_d": gain.w_d, "deadline": gain.deadline},
        "send_lag_s": {"p50": _pct(lags, 50), "p99": _pct(lags, 99), "max": max(lags) if lags else None},
        "malformed_chunks": sum(r.malformed for r in results),
        "client_stalls": {"count": len(stalls), "max_s": max(stalls) if stalls else 0.0,
                          "over_s": STALL_S},
    }


def _pct(v: list[float], q: float) -> float | None:
    return float(np.percentile(v, q)) if v else None


def result_records(reqs: Sequence[Request], results: Sequence[Result], gain: GainConfig) -> list[dict]:
    """One JSON-able dict per request (what ``requests.jsonl`` holds)."""
    by_id = {r.id: r for r in results}
    out = []
    for q in reqs:
        res = by_id[q.id]
        r = to_request(q, res)
        rec = {"id": q.id, "priority": q.priority, "weight": q.weight, "ttft_slo": q.ttft_slo,
               "tpot_slo": q.tpot_slo, "prompt_len": q.prompt_len, "output_len": q.output_len}
        rec.update({k: v for k, v in asdict(res).items() if k not in ("id", "priority")})
        rec.update({"tokens": r.num_emitted, "ttft": r.ttft, "tpot": r.tpot, "tdg": gain.tdg(r),
                    "ideal_gain": gain.ideal_gain(r), "slo_met": slo_attained(r)})
        out.append(rec)
    return out


# --- sending -----------------------------------------------------------------------------

async def _error_message(resp) -> str:
    text = await resp.text(errors="replace")
    try:
        obj = json.loads(text)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        msg = err.get("message", text) if isinstance(err, dict) else str(err)
    except (json.JSONDecodeError, AttributeError):
        msg = text
    msg = " ".join(str(msg).split())
    return msg[:300]


async def _one(session, url: str, headers: dict, payload: bytes, res: Result, clock, token_ids: bool,
               timeout: float) -> Result:
    import aiohttp
    res.sent = clock()
    try:
        async with session.post(url, data=payload, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            res.status = resp.status
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {await _error_message(resp)}"
                return res
            parser = SSEParser()
            async for data in resp.content.iter_any():
                now = clock()
                for ev in parser.feed(data):
                    _apply(res, parse_chunk(ev, token_ids), now)
            now = clock()
            for ev in parser.close():
                _apply(res, parse_chunk(ev, token_ids), now)
    except asyncio.TimeoutError:
        res.error = f"timeout after {timeout:g} s ({len(res.token_times)} tokens received)"
    except Exception as e:   # transport errors end this request, never the run
        res.error = f"{type(e).__name__}: {e}"
    return res.finish()


def _apply(res: Result, ch: Chunk, now: float) -> None:
    if ch.malformed:
        res.malformed += 1
        return
    if ch.done:
        res.done = True
        return
    if ch.error is not None and res.error is None:
        res.error = f"error event: {ch.error}"
    res.token_times.extend([now] * ch.tokens)
    if ch.finish_reason:
        res.finish_reason = ch.finish_reason
    if ch.usage_tokens is not None:
        res.usage_tokens = ch.usage_tokens


async def fetch_model(base_url: str, api_key: str | None = None, timeout: float = 10.0) -> str:
    """The first model id of ``GET /v1/models``."""
    import aiohttp
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
        async with s.get(api_url(base_url, "models"), headers=headers) as r:
            if r.status != 200:
                raise ConfigError(f"GET {api_url(base_url, 'models')}: HTTP {r.status}: {await _error_message(r)}")
            data = (await r.json()).get("data") or []
    if not data:
        raise ConfigError(f"{base_url} lists no models; pass --model")
    return str(data[0]["id"])


@dataclass
class Run:
    results: list[Result]
    t0_unix: float      # Unix time of the run clock's 0
    wall_s: float       # first send → last result
    stalls: list[float] = field(default_factory=list)   # event-loop stalls > STALL_S (s), see _watch_loop


#: an event-loop stall longer than this is recorded: the client itself was late, so
#: send times and token timestamps around it are the client's, not the server's
STALL_S = 0.05


async def _watch_loop(stop: asyncio.Event, stalls: list[float], period: float = 0.01) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(period)
        late = time.perf_counter() - t - period
        if late > STALL_S:
            stalls.append(late)


async def replay(reqs: Sequence[Request], cfg: ClientConfig, progress=None) -> Run:
    """Send every request at its offset; return one :class:`Result` per request, in workload order."""
    import aiohttp
    model = cfg.model or await fetch_model(cfg.base_url, cfg.api_key)
    offsets = send_offsets(reqs)
    # everything heavy happens before the clock starts
    prompts = [prompt_tokens(cfg.seed, request_index(q, i), q.prompt_len, cfg.vocab, cfg.token_low)
               for i, q in enumerate(reqs)]
    perf0 = time.perf_counter() + cfg.start_delay
    t0_unix = time.time() + cfg.start_delay
    payloads = [json.dumps(request_body(q, p, model, cfg, t0_unix + off)).encode()
                for q, p, off in zip(reqs, prompts, offsets)]
    headers = {"content-type": "application/json"}
    if cfg.api_key:
        headers["Authorization"] = f"Bearer {cfg.api_key}"
    url = cfg.completions_url()

    def clock() -> float:
        return time.perf_counter() - perf0

    done = 0

    async def send(i: int) -> Result:
        nonlocal done
        q = reqs[i]
        res = Result(id=q.id, priority=q.priority, arrival=offsets[i], expected_tokens=q.output_len)
        delay = offsets[i] - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        try:
            await _one(session, url, headers, payloads[i], res, clock, cfg.return_token_ids, cfg.request_timeout)
        except BaseException as e:   # cancelled: still a result
            if res.error is None:
                res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            done += 1
            if progress is not None:
                progress(done, len(reqs), res)
        return res

    # a fresh connection per request. With keep-alive reuse, 1 of 456 requests at 7.6 req/s
    # got "Connection reset by peer" right at its send, with nothing in the server log: most
    # likely a pooled connection the server (uvicorn: 5 s keep-alive) was closing meanwhile.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    stop, stalls = asyncio.Event(), []
    watcher = asyncio.create_task(_watch_loop(stop, stalls))
    try:
        async with aiohttp.ClientSession(connector=connector) as session:
            results = await asyncio.gather(*(send(i) for i in range(len(reqs))))
    finally:
        stop.set()
        await watcher
    wall = clock() - (offsets[0] if offsets else 0.0)
    return Run(list(results), t0_unix, wall, stalls)


# --- tables ------------------------------------------------------------------------------

def format_summary(summary: dict) -> str:
    cols = [("class", None, "{}"), ("reqs", "requests", "{:d}"), ("errors", "errors", "{:d}"),
            ("TDG", "tdg_ratio", "{:.3f}"), ("SLO", "slo_attainment", "{:.3f}"),
            ("TTFT_p50", "ttft_p50", "{:.3f}"), ("TTFT_p90", "ttft_p90", "{:.3f}"),
            ("TTFT_p99", "ttft_p99", "{:.3f}"), ("TPOT_p50", "tpot_p50", "{:.4f}"),
            ("TPOT_p90", "tpot_p90", "{:.4f}"), ("TPOT_p99", "tpot_p99", "{:.4f}"),
            ("tok/s", "throughput_tokens_s", "{:.0f}"), ("req/s", "throughput_req_s", "{:.2f}")]
    rows = [[c[0] for c in cols]]
    for name, m in summary["metrics"].items():
        row = [name]
        for _, key, fmt in cols[1:]:
            v = m.get(key)
            row.append("-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else fmt.format(v))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lag = summary["send_lag_s"]
    st = summary.get("client_stalls", {})
    lines.append(f"send lag p50 {_ms(lag['p50'])} p99 {_ms(lag['p99'])} max {_ms(lag['max'])}; "
                 f"client event-loop stalls > {_ms(st.get('over_s', STALL_S))}: {st.get('count', 0)} "
                 f"(max {_ms(st.get('max_s', 0.0))}); malformed SSE chunks: {summary['malformed_chunks']}")
    for name, e in summary["errors"].items():
        if name != "all" and e["errors"]:
            lines.append(f"errors[{name}]: " + "; ".join(f"{n}× {k}" for k, n in e["by_error"].items()))
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f} ms"


def clean_json(x):
    """JSON has no NaN/inf: null instead."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: clean_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean_json(v) for v in x]
    return x


def write_outputs(out_dir: str | Path, reqs: Sequence[Request], run: Run, gain: GainConfig,
                  summary: dict, meta: dict | None = None) -> None:
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "requests.jsonl", "w") as f:
        for rec in result_records(reqs, run.results, gain):
            f.write(json.dumps(clean_json(rec)) + "\n")
    doc = dict(meta or {})
    doc.update({"t0_unix": run.t0_unix, "wall_s": run.wall_s, **summary})
    (d / "summary.json").write_text(json.dumps(clean_json(doc), indent=1) + "\n")


# --- command line -------------------------------------------------------------------------

def _json_arg(text: str, what: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{what}: not valid JSON ({e.msg}): {text!r}") from None


def load_classes(path: str | None, ttft: float | None = None, tpot: float | None = None) -> dict[str, PriorityClass]:
    """Classes from a ``--classes`` JSON file (the prefill worker's format) or the defaults,
    with every class's SLOs overridden by ``ttft``/``tpot`` where given."""
    if path:
        try:
            raw = json.loads(Path(path).read_text())
        except OSError as e:
            raise ConfigError(f"--classes {path}: cannot read ({e.strerror})") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"--classes {path}: not valid JSON (line {e.lineno}): {e.msg}") from None
        classes = classes_from_dicts(raw, f"--classes {path}")
    else:
        classes = default_classes()
    return {n: PriorityClass(n, c.weight, ttft if ttft is not None else c.ttft_slo,
                             tpot if tpot is not None else c.tpot_slo) for n, c in classes.items()}


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    w = ap.add_argument_group("workload")
    w.add_argument("--trace", default="azure",
                   help="'azure' (bundled Azure 2023 conversation trace), 'synthetic', or a trace file")
    w.add_argument("--format", dest="trace_format", choices=["azure", "burstgpt", "mooncake", "sharegpt"],
                   help="trace file format (default: sniffed)")
    w.add_argument("--num-requests", type=int, default=200, help="first N requests of the trace (default 200)")
    w.add_argument("--seed", type=int, default=0, help="priority tags and prompt tokens (default 0)")
    w.add_argument("--classes", default=None,
                   help="JSON file [{name, weight, ttft_slo, tpot_slo}, ...] (default high w=2 / low w=1)")
    w.add_argument("--ttft-slo", type=float, default=None, help="TTFT SLO of every class, seconds")
    w.add_argument("--tpot-slo", type=float, default=None, help="TPOT SLO of every class, seconds")
    w.add_argument("--prompt-div", type=float, default=1.0, help="divide every prompt length by this")
    w.add_argument("--output-div", type=float, default=1.0, help="divide every output length by this")
    w.add_argument("--max-prompt", type=int, default=None, help="clip prompt lengths to this")
    w.add_argument("--max-model-len", type=int, default=2048,
                   help="fit prompt + output into this (output cut first; default 2048, the tiny model's)")
    w.add_argument("--w-p", type=float, default=None,
                   help="TDG first-token weight (default: mean prompt / mean output, as the simulator)")
    w.add_argument("--w-d", type=float, default=1.0, help="TDG decode-token weight (default 1)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench.loadgen",
        description="Replay a workload against an OpenAI-compatible /v1/completions endpoint (streaming), "
                    "timestamp every token, and report TDG_Ratio, SLO attainment, TTFT/TPOT percentiles and "
                    "errors per priority class (scheduler.tdg.summarize, as the simulator). Exit status: 0, "
                    "1 if any request ended in an error, 2 for a bad flag.")
    ap.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8100 (or .../v1)")
    ap.add_argument("--model", default=None, help="model name (default: the first one GET /v1/models lists)")
    ap.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    ap.add_argument("--rate", type=float, default=None,
                    help="scale arrivals to this mean rate, req/s (default: the trace's own timing)")
    add_workload_args(ap)
    c = ap.add_argument_group("requests")
    c.add_argument("--vocab", type=int, default=DEFAULT_VOCAB,
                   help=f"prompt token ids are drawn below this (default {DEFAULT_VOCAB}, the tiny model)")
    c.add_argument("--token-low", type=int, default=DEFAULT_TOKEN_LOW,
                   help=f"lowest prompt token id (default {DEFAULT_TOKEN_LOW}: skips pad/bos/eos)")
    c.add_argument("--no-xargs", action="store_true",
                   help="do not send vllm_xargs (priority_class, weight, SLOs, arrival_time)")
    c.add_argument("--no-token-ids", action="store_true",
                   help="do not ask for token_ids; count one token per non-empty text chunk")
    c.add_argument("--body", default=None, metavar="JSON", help="extra fields merged into every request body")
    c.add_argument("--class-body", action="append", default=[], metavar="CLASS=JSON",
                   help="extra body fields of one class's requests, e.g. high='{\"priority\": 0}' (repeatable)")
    c.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds (default 600)")
    ap.add_argument("--out", default=None, help="directory for requests.jsonl and summary.json")
    ap.add_argument("--quiet", action="store_true", help="no progress line")
    return ap


def client_config(args) -> ClientConfig:
    class_body: dict[str, dict] = {}
    for item in args.class_body:
        name, sep, text = item.partition("=")
        if not sep or not name:
            raise ConfigError(f"--class-body expects CLASS=JSON, got {item!r}")
        v = _json_arg(text, f"--class-body {name}")
        if not isinstance(v, dict):
            raise ConfigError(f"--class-body {name}: must be a JSON object")
        deep_merge(class_body.setdefault(name, {}), v)
    body = _json_arg(args.body, "--body") if args.body else {}
    if not isinstance(body, dict):
        raise ConfigError("--body must be a JSON object")
    if args.timeout <= 0:
        raise ConfigError(f"--timeout must be > 0, got {args.timeout}")
    return ClientConfig(base_url=args.url, model=args.model, api_key=args.api_key, vocab=args.vocab,
                        token_low=args.token_low, seed=args.seed, send_xargs=not args.no_xargs,
                        return_token_ids=not args.no_token_ids, body=body, class_body=class_body,
                        request_timeout=args.timeout)


def workload_from_args(args, rate: float | None) -> list[Request]:
    classes = load_classes(args.classes, args.ttft_slo, args.tpot_slo)
    return make_workload(args.trace, rate, args.num_requests, args.seed, classes, args.trace_format,
                         args.prompt_div, args.output_div, args.max_prompt, args.max_model_len)


def _progress(done: int, total: int, res: Result) -> None:
    if done == total or done % 20 == 0:
        print(f"\r{done}/{total} done", end="\n" if done == total else "", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = client_config(args)
        reqs = workload_from_args(args, args.rate)
        unknown = sorted(set(cfg.class_body) - {r.priority for r in reqs} - set(load_classes(args.classes)))
        if unknown:
            raise ConfigError(f"--class-body: unknown class(es) {', '.join(unknown)}")
        gain = workload_gain(reqs, args.w_p, args.w_d)
        run = asyncio.run(replay(reqs, cfg, None if args.quiet else _progress))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = summarize_run(reqs, run.results, gain, run.stalls)
    print(format_summary(summary))
    print(f"{len(reqs)} requests in {run.wall_s:.1f} s")
    if args.out:
        meta = {"url": args.url, "rate": args.rate, "argv": sys.argv[1:] if argv is None else argv}
        write_outputs(args.out, reqs, run, gain, summary, meta)
        print(f"wrote {args.out}/requests.jsonl and summary.json")
    return 1 if summary["metrics"]["all"]["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())

"""HTTP load generator: replay a workload against an OpenAI-compatible
``/v1/completions`` endpoint and score it with the simulator's metrics.

    python -m bench.loadgen --url http://127.0.0.1:8100 --rate 2 --num-requests 200 --out out/lg
    python -m bench.loadgen --api proserve --keys keys.toml --url http://127.0.0.1:8000 \
        --rate 4 --arrivals poisson --stream-fraction 0.5 --out out/lg-proserve
    python -m bench.loadgen --from-records out/lg/requests.jsonl      # re-score a run, no sends

What one run does:

1. **Workload** (:func:`make_workload`): the same pipeline as the simulator
   (:func:`bench.workloads.build_workload`) — trace (bundled Azure
   conversation trace by default; BurstGPT, Mooncake, ShareGPT files, or
   ``synthetic``), first ``--num-requests`` rows, arrivals, seeded 50/50
   :func:`~bench.workloads.tag_priorities` with the class SLOs — plus an
   optional length shaping step (:func:`shape_lengths`: divide prompt / output
   lengths, clip prompts) for engines much faster or slower than the trace's.
   Arrivals (``--arrivals``): ``trace`` (default) keeps the trace's timestamps,
   scaled to ``--rate`` with :func:`~bench.workloads.scale_to_rate`;
   ``poisson`` replaces them with exponential gaps of mean ``1/--rate``
   (:func:`~bench.workloads.poisson_arrivals`, seeded by ``--seed``), the
   lengths still coming from the trace rows in order.
2. **Prompts**: random token ids in ``[--token-low, --vocab)`` of each
   request's prompt length, seeded per request (request ``r7`` gets the same
   prompt whatever the rate or the order of sends). ``max_tokens`` is the
   output length and ``ignore_eos`` is set, so every request must return
   exactly that many tokens.
3. **Sends** at the workload's arrival times (offsets from the run start, one
   asyncio task per request, no client-side concurrency limit), streaming
   (``"stream": true``) — or, for a seeded ``1 - --stream-fraction`` of the
   requests (:func:`stream_flags`: exactly ``round(F·n)`` streamed), not
   (``"stream": false``). How a request names its class and SLOs depends on
   ``--api``:

   * ``vllm`` (default; a plain vLLM server or a ProServe prefill/decode
     worker): ``vllm_xargs`` with ``priority_class``, ``weight``,
     ``ttft_slo``, ``tpot_slo``, ``arrival_time`` = the scheduled send time in
     Unix seconds, so the engine's deadlines count from the same instant as
     the client's; ``--no-xargs`` leaves them out (stock vLLM scheduling, the
     same client). ``--api-key`` is sent with every request.
   * ``proserve`` (the ProServe dispatcher, :mod:`dispatcher`):
     ``"priority": "<class>"`` and ``"slo": {"ttft_ms": ..., "tpot_ms": ...}``
     (the class's SLOs), no ``vllm_xargs`` (the dispatcher sets them), and
     the class's API key as ``Authorization: Bearer KEY``: ``--class-key
     CLASS=KEY``, else the first ``[[keys]]`` entry of that class in the
     dispatcher's ``--keys`` file (TOML or JSON), else ``--api-key``; a class
     of the workload with none of these is an error before anything is sent.

   ``--class-body CLASS=JSON`` merges extra fields into the body of one
   class's requests (e.g. vLLM's own ``{"priority": 0}``), ``--body JSON``
   into every request's. ``return_token_ids`` is asked for in both APIs (the
   dispatcher passes it through).
4. **Timestamps**: every SSE chunk is stamped when it is read; a chunk carries
   ``len(choices[0].token_ids)`` tokens (vLLM with ``return_token_ids``; the
   default, since token-id prompts without a tokenizer stream empty text), or,
   without token ids, one token per non-empty ``text`` (``--no-token-ids``,
   for servers that reject ``return_token_ids``). All tokens of a chunk get the
   chunk's time. An unstreamed response delivers all its tokens when it has
   been read, so all its token times are that instant (TTFT = the whole
   response time, TPOT = 0); its token count is ``len(choices[0].token_ids)``,
   else ``usage.completion_tokens`` (:func:`parse_response`).
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
7. **Report**: one table (rows ``all`` and each class; requests, errors,
   TDG_Ratio, SLO attainment, TTFT and TPOT P50/P90/P99 in seconds,
   throughput in output tokens/s and finished requests/s over first arrival →
   last token), and with ``--out``: ``requests.jsonl`` (one record per
   request, with ``stream`` true/false and its token times), ``summary.json``
   (the table's numbers and more) and, with matplotlib (``--plots``, on by
   default when it imports; ``--no-plots``), ``ttft_cdf.png``,
   ``tpot_cdf.png`` (CDFs per class) and ``classes.png`` (TDG_Ratio and SLO
   attainment per class). :func:`report_from_records` recomputes the summary
   from ``requests.jsonl`` alone (``--from-records``), so the report can be
   checked against the per-request records.

While it runs, a progress bar (tqdm when it imports, else a one-line
count on stderr; ``--quiet``: none) shows finished requests and errors.

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
import tomllib
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from scheduler.config import classes_from_dicts, default_classes
from scheduler.request import ConfigError, Phase, PriorityClass, Request
from scheduler.tdg import GainConfig, slo_attained, summarize

from .traces import TraceRecord, load_trace
from .workloads import poisson_arrivals, scale_to_rate, synthetic, tag_priorities

BUNDLED_TRACE = Path(__file__).resolve().parent / "data" / "azure_conv_2023.csv"
DEFAULT_VOCAB = 1024      # the bundled tiny Llama
DEFAULT_TOKEN_LOW = 3     # skip ids 0-2 (pad/bos/eos of Llama-style vocabularies)
_SALT_PROMPT = 0x9807     # seed salt of the prompt token streams
_SALT_STREAM = 0x57E4     # seed salt of the streamed/unstreamed choice
APIS = ("vllm", "proserve")
ARRIVAL_MODES = ("trace", "poisson")


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
                  max_prompt: int | None = None, max_model_len: int | None = None,
                  arrivals: str = "trace") -> list[Request]:
    """The simulator's pipeline (:func:`bench.workloads.build_workload`) with
    :func:`shape_lengths` between rate scaling and priority tagging.

    ``trace``: ``"azure"`` (bundled), ``"synthetic"`` (default lengths, Poisson
    at ``rate``), or a trace file. ``arrivals``: ``"trace"`` scales the
    trace's timestamps to ``rate`` (if given); ``"poisson"`` replaces them by
    seeded Poisson arrivals at ``rate`` (required), keeping the rows' order
    and lengths. The priorities depend only on ``seed`` and the request's
    position, not on the rate or the arrivals.
    """
    if arrivals not in ARRIVAL_MODES:
        raise ConfigError(f"arrivals must be one of {', '.join(ARRIVAL_MODES)}, got {arrivals!r}")
    if arrivals == "poisson" and rate is None:
        raise ConfigError("--arrivals poisson needs --rate (the mean arrival rate, req/s)")
    if trace == "synthetic":
        records = synthetic(num_requests or 1000, rate or 1.0, seed=seed)
    else:
        path = BUNDLED_TRACE if trace == "azure" else trace
        records = load_trace(path, "azure" if trace == "azure" else fmt, limit=num_requests)
        if rate is not None and arrivals == "trace":
            records = scale_to_rate(records, rate, seed)
    if arrivals == "poisson":
        records = poisson_arrivals(records, rate, seed)
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


def stream_flags(n: int, fraction: float = 1.0, seed: int = 0) -> list[bool]:
    """Which of ``n`` requests are streamed: exactly ``round(fraction · n)`` of
    them, chosen by a seeded permutation (a function of ``seed`` and ``n`` only)."""
    check_fraction(fraction, "stream_fraction")
    k = int(math.floor(fraction * n + 0.5))
    if k >= n:
        return [True] * n
    flags = [False] * n
    for i in np.random.default_rng([int(seed), _SALT_STREAM]).permutation(n)[:k]:
        flags[int(i)] = True
    return flags


def check_fraction(v, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v <= 1:
        raise ConfigError(f"{name} must be a number in [0, 1], got {v!r}")
    return float(v)


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
    api_key: str | None = None          # sent as "Authorization: Bearer <key>" (proserve: classes without a key)
    api: str = "vllm"                   # "vllm": class/SLOs in vllm_xargs; "proserve": priority + slo + class key
    class_keys: dict = field(default_factory=dict)         # class -> API key (api="proserve")
    stream_fraction: float = 1.0        # share of requests sent with "stream": true (stream_flags)
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

    def key_for(self, cls: str) -> str | None:
        """The API key of one class's requests: its own key, else ``api_key``."""
        return self.class_keys.get(cls) or self.api_key

    def check(self, classes: Iterable[str]) -> None:
        """Raise :class:`ConfigError` for settings that cannot work with a workload of these classes."""
        if self.api not in APIS:
            raise ConfigError(f"--api must be one of {', '.join(APIS)}, got {self.api!r}")
        check_fraction(self.stream_fraction, "--stream-fraction")
        if self.api != "proserve":
            if self.class_keys:
                raise ConfigError("--class-key/--keys apply only to --api proserve (a vLLM server takes "
                                  "one --api-key)")
            return
        if not self.send_xargs:
            raise ConfigError("--no-xargs applies only to --api vllm (with --api proserve the dispatcher "
                              "sets vllm_xargs)")
        missing = sorted(c for c in set(classes) if not self.key_for(c))
        if missing:
            raise ConfigError(
                "--api proserve: no API key for class(es) " + ", ".join(repr(c) for c in missing)
                + ": pass --class-key CLASS=KEY, a --keys file with a [[keys]] entry of that class, "
                  "or --api-key KEY (any key works for a dispatcher without a keys file)")

    def headers_for(self, cls: str) -> dict:
        h = {"content-type": "application/json"}
        key = self.key_for(cls) if self.api == "proserve" else self.api_key
        if key:
            h["Authorization"] = f"Bearer {key}"
        return h


def api_url(base: str, path: str) -> str:
    """``http://host:port`` or ``http://host:port/v1`` + ``/v1/<path>``."""
    b = base.rstrip("/")
    if not b.endswith("/v1"):
        b += "/v1"
    return f"{b}/{path}"


def request_body(req: Request, prompt: list[int], model: str, cfg: ClientConfig,
                 arrival_unix: float | None = None, stream: bool = True) -> dict:
    """One request's JSON body (see the module docstring, step 3)."""
    body: dict[str, Any] = {
        "model": model, "prompt": prompt, "max_tokens": req.output_len, "ignore_eos": True,
        "temperature": 0.0, "stream": bool(stream),
    }
    if stream:   # vLLM rejects stream_options on an unstreamed request
        body["stream_options"] = {"include_usage": True}
    if cfg.return_token_ids:
        body["return_token_ids"] = True
    if cfg.api == "proserve":
        body["priority"] = req.priority
        body["slo"] = {"ttft_ms": req.ttft_slo * 1000.0, "tpot_ms": req.tpot_slo * 1000.0}
    elif cfg.send_xargs:
        xa = {"priority_class": req.priority, "weight": req.weight, "ttft_slo": req.ttft_slo,
              "tpot_slo": req.tpot_slo}
        if arrival_unix is not None:
            xa["arrival_time"] = arrival_unix
        body["vllm_xargs"] = xa
    deep_merge(body, cfg.body)
    deep_merge(body, cfg.class_body.get(req.priority, {}))
    return body


def read_keys_file(path: str | Path) -> dict[str, str]:
    """Class -> API key from the dispatcher's keys file (``--keys``: TOML, or JSON by
    its ``.json`` suffix; ``[[keys]]`` entries with ``key``, ``client``, ``class``):
    for each class the first entry of that class."""
    p = Path(path)
    where = f"--keys {p}"
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"{where}: cannot read ({e.strerror})") from None
    if p.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not valid JSON (line {e.lineno}): {e.msg}") from None
    else:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{where}: not valid TOML: {e}") from None
    items = data.get("keys") if isinstance(data, dict) else None
    if not isinstance(items, list) or not items:
        raise ConfigError(f"{where}: needs a non-empty list 'keys' ([[keys]] in TOML)")
    out: dict[str, str] = {}
    for i, k in enumerate(items):
        if not isinstance(k, dict) or not isinstance(k.get("key"), str) or not k["key"] \
                or not isinstance(k.get("class"), str):
            raise ConfigError(f"{where}: keys[{i}] needs a string 'key' and a string 'class'")
        out.setdefault(k["class"], k["key"])
    return out


def parse_class_keys(items: Iterable[str], keys_file: str | None = None) -> dict[str, str]:
    """``--class-key CLASS=KEY`` items over the ``--keys`` file's choice."""
    out = read_keys_file(keys_file) if keys_file else {}
    for item in items:
        name, sep, key = item.partition("=")
        if not sep or not name or not key:
            raise ConfigError(f"--class-key expects CLASS=KEY, got {item!r}")
        out[name] = key
    return out


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


def parse_response(data: bytes | str, token_ids: bool = True) -> Chunk:
    """Read an unstreamed completion response: all its tokens at once.

    The count is ``len(choices[0].token_ids)`` (when asked for and present),
    else ``usage.completion_tokens``; a response with neither is malformed
    (its tokens cannot be counted). ``done`` is set: the response is whole.
    """
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return Chunk(malformed=f"not JSON ({e.msg}): {text[:80]!r}")
    if not isinstance(obj, dict):
        return Chunk(malformed=f"not a JSON object: {text[:80]!r}")
    if obj.get("error"):
        return parse_chunk(text, token_ids)   # same wording as an error event
    out = Chunk(done=True)
    usage = obj.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        out.usage_tokens = usage["completion_tokens"]
    choices = obj.get("choices")
    first = next((c for c in choices if isinstance(c, dict) and c.get("index", 0) == 0), None) \
        if isinstance(choices, list) else None
    ids = first.get("token_ids") if first else None
    if token_ids and isinstance(ids, list):
        out.tokens = len(ids)
    elif out.usage_tokens is not None:
        out.tokens = out.usage_tokens
    else:
        out.malformed = f"neither choices[0].token_ids nor usage.completion_tokens: {text[:80]!r}"
    if first and first.get("finish_reason"):
        out.finish_reason = str(first["finish_reason"])
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
    malformed: int = 0                  # SSE data payloads (or an unstreamed body) that could not be read
    done: bool = False                  # saw [DONE] (unstreamed: read the whole response)
    stream: bool = True                 # sent with "stream": true

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
    unstreamed: dict[str, int] = {}
    for q in reqs:
        if not by_id[q.id].stream:
            for key in ("all", q.priority):
                unstreamed[key] = unstreamed.get(key, 0) + 1
    for k, m in metrics.items():
        m["errors"] = errs.get(k, {}).get("errors", 0)
        m["unstreamed"] = unstreamed.get(k, 0)
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
            if not res.stream:
                raw = await resp.read()
                now = clock()   # every token arrives with the whole response
                ch = parse_response(raw, token_ids)
                if ch.malformed:
                    res.malformed += 1
                    res.error = f"unreadable response: {ch.malformed}"
                elif ch.error is not None:
                    res.error = f"error response: {ch.error}"
                else:
                    res.token_times.extend([now] * ch.tokens)
                    res.finish_reason, res.usage_tokens, res.done = ch.finish_reason, ch.usage_tokens, ch.done
                return res.finish()
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
    """Send every request at its offset; return one :class:`Result` per request, in workload order.

    ``progress(done, total, result)`` is called as each request ends."""
    import aiohttp
    cfg.check(q.priority for q in reqs)
    model = cfg.model or await fetch_model(cfg.base_url, cfg.key_for(reqs[0].priority) if reqs else cfg.api_key)
    offsets = send_offsets(reqs)
    # everything heavy happens before the clock starts
    prompts = [prompt_tokens(cfg.seed, request_index(q, i), q.prompt_len, cfg.vocab, cfg.token_low)
               for i, q in enumerate(reqs)]
    perf0 = time.perf_counter() + cfg.start_delay
    t0_unix = time.time() + cfg.start_delay
    streams = stream_flags(len(reqs), cfg.stream_fraction, cfg.seed)
    payloads = [json.dumps(request_body(q, p, model, cfg, t0_unix + off, st)).encode()
                for q, p, off, st in zip(reqs, prompts, offsets, streams)]
    headers = {c: cfg.headers_for(c) for c in {q.priority for q in reqs}}
    url = cfg.completions_url()

    def clock() -> float:
        return time.perf_counter() - perf0

    done = 0

    async def send(i: int) -> Result:
        nonlocal done
        q = reqs[i]
        res = Result(id=q.id, priority=q.priority, arrival=offsets[i], expected_tokens=q.output_len,
                     stream=streams[i])
        delay = offsets[i] - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        try:
            await _one(session, url, headers[q.priority], payloads[i], res, clock, cfg.return_token_ids,
                       cfg.request_timeout)
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


# --- report: table, records, plots ------------------------------------------------------

#: the table's columns: header, summary key, format (times in seconds)
TABLE_COLUMNS = [("class", None, "{}"), ("reqs", "requests", "{:d}"), ("errors", "errors", "{:d}"),
                 ("TDG_Ratio", "tdg_ratio", "{:.3f}"), ("SLO_att", "slo_attainment", "{:.3f}"),
                 ("TTFT_p50", "ttft_p50", "{:.3f}"), ("TTFT_p90", "ttft_p90", "{:.3f}"),
                 ("TTFT_p99", "ttft_p99", "{:.3f}"), ("TPOT_p50", "tpot_p50", "{:.4f}"),
                 ("TPOT_p90", "tpot_p90", "{:.4f}"), ("TPOT_p99", "tpot_p99", "{:.4f}"),
                 ("req/s", "throughput_req_s", "{:.2f}"), ("out_tok/s", "throughput_tokens_s", "{:.0f}")]


def format_summary(summary: dict) -> str:
    """The run's table: rows ``all`` and each class, then client health and errors."""
    cols = TABLE_COLUMNS
    rows = [[c[0] for c in cols]]
    for name, m in summary["metrics"].items():
        row = [name]
        for _, key, fmt in cols[1:]:
            v = m.get(key)
            row.append("-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else fmt.format(v))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.append("TTFT/TPOT in seconds; req/s = finished requests, out_tok/s = output tokens, "
                 "per second from the first arrival to the last token")
    n_un = summary["metrics"].get("all", {}).get("unstreamed", 0)
    if n_un:
        lines.append(f"unstreamed: {n_un} of {summary['metrics']['all']['requests']} requests "
                     f"(all tokens at the response time: TTFT = whole response, TPOT = 0)")
    lag = summary["send_lag_s"]
    st = summary.get("client_stalls")
    health = f"send lag p50 {_ms(lag['p50'])} p99 {_ms(lag['p99'])} max {_ms(lag['max'])}; "
    if st is not None:
        health += (f"client event-loop stalls > {_ms(st.get('over_s', STALL_S))}: {st.get('count', 0)} "
                   f"(max {_ms(st.get('max_s', 0.0))}); ")
    lines.append(health + f"malformed SSE chunks: {summary['malformed_chunks']}")
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
                  summary: dict, meta: dict | None = None) -> list[dict]:
    """``requests.jsonl`` and ``summary.json`` in ``out_dir``; returns the records written."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    records = [clean_json(rec) for rec in result_records(reqs, run.results, gain)]
    with open(d / "requests.jsonl", "w") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    doc = dict(meta or {})
    doc.update({"t0_unix": run.t0_unix, "wall_s": run.wall_s, **summary})
    (d / "summary.json").write_text(json.dumps(clean_json(doc), indent=1) + "\n")
    return records


_REQUEST_FIELDS = ("id", "priority", "weight", "ttft_slo", "tpot_slo", "prompt_len", "output_len", "arrival")
_RESULT_FIELDS = tuple(f for f in Result.__dataclass_fields__)


def load_records(path: str | Path) -> tuple[list[Request], list[Result], list[dict]]:
    """Read a run's ``requests.jsonl`` (or the directory holding it): the workload
    requests, their results and the raw records, in file order."""
    p = Path(path)
    if p.is_dir():
        p = p / "requests.jsonl"
    try:
        lines = p.read_text().splitlines()
    except OSError as e:
        raise ConfigError(f"{p}: cannot read ({e.strerror})") from None
    reqs, results, records = [], [], []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}:{n}: not valid JSON: {e.msg}") from None
        missing = [k for k in _REQUEST_FIELDS + ("expected_tokens", "token_times") if k not in rec] \
            if isinstance(rec, dict) else ["(not an object)"]
        if missing:
            raise ConfigError(f"{p}:{n}: not a load generator record (missing {', '.join(missing)})")
        reqs.append(Request(**{k: rec[k] for k in _REQUEST_FIELDS}))
        results.append(Result(**{k: rec[k] for k in _RESULT_FIELDS if k in rec}))
        records.append(rec)
    if not reqs:
        raise ConfigError(f"{p}: no records")
    return reqs, results, records


def report_from_records(path: str | Path, gain: GainConfig | None = None) -> dict:
    """The run's summary recomputed from ``requests.jsonl`` alone (JSON-clean, as in
    ``summary.json``): ``metrics``, ``errors``, ``gain``, ``send_lag_s``,
    ``malformed_chunks``. ``gain``: default the CLI's (w_p = mean prompt / mean
    output of the records, w_d = 1); pass ``GainConfig(**summary["gain"])`` for a
    run with ``--w-p``/``--w-d``. The client's event-loop stalls are not in the
    records, so ``client_stalls`` is left out. On a run's own output every value
    equals ``summary.json``'s.
    """
    reqs, results, _ = load_records(path)
    summary = summarize_run(reqs, results, gain or workload_gain(reqs))
    summary.pop("client_stalls")
    return clean_json(summary)


def have_matplotlib() -> bool:
    import importlib.util
    return importlib.util.find_spec("matplotlib") is not None


PLOT_FILES = ("ttft_cdf.png", "tpot_cdf.png", "classes.png")


def write_plots(out_dir: str | Path, records: Sequence[Mapping], summary: Mapping) -> list[Path]:
    """PNG plots of one run in ``out_dir`` (see :data:`PLOT_FILES`): TTFT and TPOT
    CDFs per class (the same requests the percentiles use; dotted lines: the
    class SLOs) and TDG_Ratio / SLO attainment per class. Needs matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("plots need matplotlib: pip install 'proserve[plot]' (or pass --no-plots)") from None
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    classes = sorted({r["priority"] for r in records})
    colors = {c: f"C{i}" for i, c in enumerate(classes)}
    out = []
    # summarize()'s sets: TTFT of every request with a token, TPOT of finished ones with > 1 token
    series = {
        "ttft": ("TTFT (s)", "ttft_slo", lambda r: r.get("ttft") is not None),
        "tpot": ("TPOT (s; unstreamed requests: 0)", "tpot_slo",
                 lambda r: r.get("error") is None and (r.get("tokens") or 0) > 1 and r.get("tpot") is not None),
    }
    for key, (label, slo_key, keep) in series.items():
        fig = Figure(figsize=(6, 4))
        ax = fig.add_subplot()
        for c in classes:
            v = np.sort([r[key] for r in records if r["priority"] == c and keep(r)])
            if len(v):
                ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", color=colors[c],
                        label=f"{c} (n={len(v)})")
            for slo in sorted({r[slo_key] for r in records if r["priority"] == c}):
                ax.axvline(slo, color=colors[c], linestyle=":", linewidth=1)
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if classes:
            ax.legend(loc="lower right")
        ax.set_title(f"{key.upper()} CDF per class (dotted: SLO)")
        fig.tight_layout()
        path = d / f"{key}_cdf.png"
        fig.savefig(path, dpi=100)
        out.append(path)
    names = list(summary["metrics"])
    fig = Figure(figsize=(7, 3.5))
    for i, (mkey, title) in enumerate((("tdg_ratio", "TDG_Ratio"), ("slo_attainment", "SLO attainment"))):
        ax = fig.add_subplot(1, 2, i + 1)
        vals = [summary["metrics"][n].get(mkey) for n in names]
        vals = [v if isinstance(v, (int, float)) and math.isfinite(v) else 0.0 for v in vals]
        bars = ax.bar(names, vals, color=["0.5" if n == "all" else colors.get(n, "C9") for n in names])
        for b, v in zip(bars, vals):
            ax.annotate(f"{v:.2f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=8)
        ax.set_ylim(0, 1.1)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path = d / "classes.png"
    fig.savefig(path, dpi=100)
    out.append(path)
    return out


class Progress:
    """Progress of a run (``replay(progress=...)``): a tqdm bar on stderr when tqdm
    imports (``use_tqdm=None``), else a one-line ``done/total`` count rewritten at
    most every ``interval`` seconds. Call :meth:`close` at the end."""

    def __init__(self, total: int, use_tqdm: bool | None = None, file=None, interval: float = 0.5):
        self.total, self.file, self.interval = total, file or sys.stderr, interval
        self.errors, self.done, self._last = 0, 0, -math.inf
        self._t0 = time.monotonic()
        self.bar = None
        if use_tqdm is not False:
            try:
                from tqdm import tqdm
            except ImportError:
                if use_tqdm:
                    raise
            else:
                self.bar = tqdm(total=total, unit="req", desc="requests", file=self.file, dynamic_ncols=True,
                                smoothing=0.1, mininterval=0.2)
                self.bar.set_postfix(errors=0, refresh=False)

    def __call__(self, done: int, total: int, res: Result) -> None:
        self.done = done
        if not res.ok:
            self.errors += 1
        if self.bar is not None:
            if not res.ok:
                self.bar.set_postfix(errors=self.errors, refresh=False)
            self.bar.update(1)
            return
        now = time.monotonic()
        if done == total or now - self._last >= self.interval:
            self._last = now
            print(f"\r{done}/{total} requests done, {self.errors} errors, {now - self._t0:.0f} s",
                  end="", file=self.file, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.done:
            print(file=self.file, flush=True)


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
    w.add_argument("--seed", type=int, default=0,
                   help="priority tags, prompt tokens, Poisson arrivals, unstreamed picks (default 0)")
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
        description="Replay a workload (Azure, BurstGPT, Mooncake, ShareGPT or synthetic) against an "
                    "OpenAI-compatible /v1/completions endpoint — a plain vLLM server, a ProServe worker, "
                    "or the ProServe dispatcher (--api proserve) — streaming and timestamping every "
                    "token, and report TDG_Ratio, SLO attainment, TTFT/TPOT percentiles, throughput and "
                    "errors per priority class (scheduler.tdg.summarize, as the simulator) as a table, "
                    "requests.jsonl + summary.json and PNG plots. Exit status: 0, 1 if any request ended "
                    "in an error, 2 for a bad flag.")
    ap.add_argument("--url", default=None,
                    help="base URL, e.g. http://127.0.0.1:8100 (or .../v1); required unless --from-records")
    ap.add_argument("--api", choices=APIS, default="vllm",
                    help="how requests name their class and SLOs: 'vllm' (default): vllm_xargs, for a plain "
                         "vLLM server or a ProServe worker; 'proserve': the dispatcher's 'priority' and "
                         "'slo' {ttft_ms, tpot_ms} fields with the class's API key")
    ap.add_argument("--model", default=None, help="model name (default: the first one GET /v1/models lists)")
    ap.add_argument("--api-key", default=None,
                    help="sent as 'Authorization: Bearer KEY' (--api proserve: for classes without a "
                         "--class-key / --keys entry)")
    ap.add_argument("--class-key", action="append", default=[], metavar="CLASS=KEY",
                    help="--api proserve: the API key of one class's requests (repeatable; over --keys)")
    ap.add_argument("--keys", default=None, metavar="FILE",
                    help="--api proserve: the dispatcher's keys file (TOML, or .json; [[keys]] key, client, "
                         "class): each class uses the first key of that class")
    ap.add_argument("--rate", type=float, default=None,
                    help="mean arrival rate, req/s (default: the trace's own timing)")
    ap.add_argument("--arrivals", choices=ARRIVAL_MODES, default="trace",
                    help="'trace' (default): the trace's timestamps, scaled to --rate; 'poisson': seeded "
                         "exponential gaps of mean 1/--rate (needs --rate), lengths from the trace rows")
    add_workload_args(ap)
    c = ap.add_argument_group("requests")
    c.add_argument("--stream-fraction", type=float, default=1.0, metavar="F",
                   help="fraction of requests sent streamed, in [0, 1] (default 1); the others, chosen by "
                        "--seed, are sent with \"stream\": false and all their tokens are timestamped when "
                        "the response arrives")
    c.add_argument("--vocab", type=int, default=DEFAULT_VOCAB,
                   help=f"prompt token ids are drawn below this (default {DEFAULT_VOCAB}, the tiny model)")
    c.add_argument("--token-low", type=int, default=DEFAULT_TOKEN_LOW,
                   help=f"lowest prompt token id (default {DEFAULT_TOKEN_LOW}: skips pad/bos/eos)")
    c.add_argument("--no-xargs", action="store_true",
                   help="--api vllm: do not send vllm_xargs (priority_class, weight, SLOs, arrival_time), "
                        "e.g. for stock vLLM scheduling")
    c.add_argument("--no-token-ids", action="store_true",
                   help="do not ask for token_ids; count one token per non-empty text chunk "
                        "(unstreamed: usage.completion_tokens)")
    c.add_argument("--body", default=None, metavar="JSON", help="extra fields merged into every request body")
    c.add_argument("--class-body", action="append", default=[], metavar="CLASS=JSON",
                   help="extra body fields of one class's requests, e.g. high='{\"priority\": 0}' (repeatable)")
    c.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds (default 600)")
    o = ap.add_argument_group("output")
    o.add_argument("--out", default=None, help="directory for requests.jsonl, summary.json and the plots")
    o.add_argument("--plots", action=argparse.BooleanOptionalAction, default=None,
                   help="write ttft_cdf.png, tpot_cdf.png and classes.png into --out (default: on when "
                        "matplotlib imports and --out is given)")
    o.add_argument("--from-records", default=None, metavar="PATH",
                   help="send nothing: re-score a run's requests.jsonl (or its directory) and print its "
                        "table (plots into --out if given); --w-p/--w-d as for the run")
    o.add_argument("--quiet", action="store_true", help="no progress bar")
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
    check_fraction(args.stream_fraction, "--stream-fraction")
    return ClientConfig(base_url=args.url, model=args.model, api_key=args.api_key, vocab=args.vocab,
                        token_low=args.token_low, seed=args.seed, send_xargs=not args.no_xargs,
                        return_token_ids=not args.no_token_ids, body=body, class_body=class_body,
                        request_timeout=args.timeout, api=args.api,
                        class_keys=parse_class_keys(args.class_key, args.keys),
                        stream_fraction=args.stream_fraction)


def workload_from_args(args, rate: float | None) -> list[Request]:
    classes = load_classes(args.classes, args.ttft_slo, args.tpot_slo)
    return make_workload(args.trace, rate, args.num_requests, args.seed, classes, args.trace_format,
                         args.prompt_div, args.output_div, args.max_prompt, args.max_model_len,
                         args.arrivals)


def want_plots(args) -> bool:
    """``--plots`` / ``--no-plots`` / default (on with matplotlib and --out)."""
    if args.plots is False:
        return False
    if args.plots is None:
        return args.out is not None and have_matplotlib()
    if not args.out:
        raise ConfigError("--plots writes PNG files into --out: pass --out DIR")
    if not have_matplotlib():
        raise ConfigError("--plots needs matplotlib (pip install 'proserve[plot]'); or pass --no-plots")
    return True


def _rescore(args, plots: bool) -> int:
    reqs, _, records = load_records(args.from_records)
    summary = report_from_records(args.from_records, workload_gain(reqs, args.w_p, args.w_d))
    print(format_summary(summary))
    if plots:
        paths = write_plots(args.out, records, summary)
        print(f"wrote {', '.join(str(p) for p in paths)}")
    return 1 if summary["metrics"]["all"]["errors"] else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        plots = want_plots(args)
        if args.from_records:
            return _rescore(args, plots)
        if not args.url:
            raise ConfigError("--url is required (or --from-records PATH to re-score a run)")
        if args.rate is not None and not (math.isfinite(args.rate) and args.rate > 0):
            raise ConfigError(f"--rate must be a number > 0 (req/s), got {args.rate}")
        cfg = client_config(args)
        reqs = workload_from_args(args, args.rate)
        known = {r.priority for r in reqs} | set(load_classes(args.classes))
        for flag, names in (("--class-body", cfg.class_body),
                            ("--class-key", [i.partition("=")[0] for i in args.class_key])):
            unknown = sorted(set(names) - known)
            if unknown:
                raise ConfigError(f"{flag}: unknown class(es) {', '.join(unknown)} "
                                  f"(classes: {', '.join(sorted(known))})")
        cfg.check(r.priority for r in reqs)
        gain = workload_gain(reqs, args.w_p, args.w_d)
        progress = None if args.quiet else Progress(len(reqs))
        try:
            run = asyncio.run(replay(reqs, cfg, progress))
        finally:
            if progress is not None:
                progress.close()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = summarize_run(reqs, run.results, gain, run.stalls)
    print(format_summary(summary))
    print(f"{len(reqs)} requests in {run.wall_s:.1f} s")
    if args.out:
        meta = {"url": args.url, "api": args.api, "rate": args.rate, "arrivals": args.arrivals,
                "stream_fraction": args.stream_fraction, "trace": args.trace,
                "argv": sys.argv[1:] if argv is None else argv}
        records = write_outputs(args.out, reqs, run, gain, summary, meta)
        print(f"wrote {args.out}/requests.jsonl and summary.json")
        if plots:
            try:
                paths = write_plots(args.out, records, clean_json(summary))
                print(f"wrote {', '.join(p.name for p in paths)}")
            except Exception as e:   # a plot must not lose a run whose results are written
                print(f"error: plots not written: {type(e).__name__}: {e}", file=sys.stderr)
    return 1 if summary["metrics"]["all"]["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())

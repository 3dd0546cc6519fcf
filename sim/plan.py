"""Capacity planning on the simulator (``python -m proserve.sim plan``).

Two questions, each answered by simulating candidate points (a deployment at a
request rate, every seed of ``--seeds``) until a search closes:

* **cheapest deployment at a rate** (:meth:`Planner.cheapest`): the fewest
  instances, co-located ``N`` or disaggregated ``P:D`` (cost = ``N`` or
  ``P + D``), whose every seed meets every target;
* **highest rate of a deployment** (:meth:`Planner.highest_rate`): the highest
  request rate at which it still meets every target, to a relative tolerance.

A target is a per-class bound on a metric of :func:`proserve.scheduler.tdg.summarize`,
written ``CLASS:METRIC>=VALUE[,METRIC<=VALUE...]`` (:func:`parse_targets`), e.g.
``high:tdg_ratio>=0.95,slo>=0.9`` or ``all:ttft_p99<=2``. A point passes when
every seed meets every target; the table shows the worst seed.

The searches assume monotonicity; each assumption is named where it is used:

* **co-located N** (M1): at a fixed rate, adding an instance never makes a
  passing deployment fail. Search: galloping (N = 1, 2, 4, 8, ...) up to the
  first pass, then bisection between the last failure and that pass, so about
  ``2·log2(N)`` points instead of N.
* **disaggregated P:D** (M2): at a fixed rate, adding a prefill instance or a
  decode instance never makes a passing deployment fail. The splits of one
  size are *not* ordered (too few prefill or too few decode instances both
  fail), so for each P = 1, 2, ... the planner checks the largest D the cost
  bound still allows; by M2, if that fails no smaller D passes at this P;
  if it passes, bisection finds the smallest D. Each pass lowers the bound
  (only cheaper splits are tried after it), and the scan ends when P + 1
  exceeds the bound. The bound starts at the co-located answer (a split of
  equal cost is still searched for, and reported), else ``--max-instances``.
* **rate** (M3): a deployment that fails at a rate fails at every higher
  rate. Search: galloping (×2 or ÷2 from the starting rate) to bracket the
  boundary, then bisection until ``(fail - pass) / pass <= --rate-tol``.

A monotonicity violation seen during a search (a point that passes below one
that fails, where the assumption says it cannot) is reported under the table
(seed noise with few requests, or GoRouting's random fallback, can cause it).

Every point is simulated with every seed; seeds and, when there are more
``--jobs`` than seeds, several points of a bisection run in parallel processes
(a k-ary search instead of a binary one).
"""

from __future__ import annotations

import math
import re
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TextIO

from proserve.scheduler.request import ConfigError

COLOCATED, DISAGGREGATED = "colocated", "disaggregated"

# metrics a target may bound: the numeric fields of scheduler.tdg.ClassMetrics
METRICS = ("tdg_ratio", "miss_tdg_ratio", "first_token_tdg_ratio", "slo_attainment",
           "ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p90", "tpot_p99",
           "throughput_tokens_s", "throughput_req_s")
ALIASES = {"tdg": "tdg_ratio", "slo": "slo_attainment", "tdg1": "first_token_tdg_ratio",
           "first_token_tdg": "first_token_tdg_ratio", "miss_tdg": "miss_tdg_ratio"}
FRACTIONS = frozenset({"tdg_ratio", "miss_tdg_ratio", "first_token_tdg_ratio", "slo_attainment"})
SHORT = {"tdg_ratio": "TDG", "slo_attainment": "SLO", "first_token_tdg_ratio": "TDG1",
         "miss_tdg_ratio": "missTDG"}
OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b, "<": lambda a, b: a < b}
TARGET_SYNTAX = "CLASS:METRIC>=VALUE[,METRIC<=VALUE...], e.g. high:tdg_ratio>=0.95,slo>=0.9"
_BOUND = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*(>=|<=|>|<|=>|=<|==|=)\s*(\S.*?)\s*$")

RATE_MIN, RATE_MAX = 1e-3, 1e6   # the rate search gives up outside these (req/s)


# -- targets ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """``metric(cls) op value`` must hold on every seed."""

    cls: str
    metric: str
    op: str
    value: float

    def holds(self, metrics: dict) -> bool:
        """``metrics``: class -> metric -> value (``summarize`` output as dicts). A class
        with no requests, or a NaN value, does not meet the target."""
        v = metric_value(metrics, self.cls, self.metric)
        return not math.isnan(v) and OPS[self.op](v, self.value)

    @property
    def higher_is_better(self) -> bool:
        return self.op in (">=", ">")

    def __str__(self) -> str:
        return f"{self.cls}:{self.metric}{self.op}{self.value:g}"


def metric_value(metrics: dict, cls: str, metric: str) -> float:
    v = (metrics.get(cls) or {}).get(metric)
    return float("nan") if v is None else float(v)


def parse_targets(texts: Iterable[str], classes: Iterable[str]) -> list[Target]:
    """Targets from ``--target`` flags (see :data:`TARGET_SYNTAX`); ``all`` names every request.

    Raises :class:`ConfigError` naming the flag's text and what is wrong: no class,
    an unknown class or metric, a missing or unknown operator, a value that is not a
    number (or outside [0, 1] for a ratio), the same bound given twice.
    """
    names = list(classes)
    known = ["all"] + names
    out: list[Target] = []
    seen: set[tuple[str, str, str]] = set()
    texts = list(texts or [])
    if not texts:
        raise ConfigError(f"give at least one --target ({TARGET_SYNTAX})")
    for text in texts:
        where = f"--target {text!r}"
        cls, sep, rest = text.partition(":")
        cls = cls.strip()
        if not sep or not cls or not rest.strip():
            raise ConfigError(f"{where}: expected {TARGET_SYNTAX}")
        if cls not in known:
            raise ConfigError(f"{where}: unknown class {cls!r} (classes: {', '.join(known)})")
        for part in rest.split(","):
            if not part.strip():
                raise ConfigError(f"{where}: empty bound (a stray comma?)")
            m = _BOUND.fullmatch(part)
            if m is None:
                raise ConfigError(f"{where}: cannot read {part.strip()!r}: expected METRIC>=VALUE or "
                                  f"METRIC<=VALUE (operators: {', '.join(OPS)})")
            name, op, raw = m.groups()
            if op not in OPS:
                raise ConfigError(f"{where}: operator {op!r} in {part.strip()!r}: use one of {', '.join(OPS)}")
            metric = ALIASES.get(name, name)
            if metric not in METRICS:
                raise ConfigError(f"{where}: unknown metric {name!r} (metrics: {', '.join(METRICS)}; "
                                  f"short names: {', '.join(f'{k}={v}' for k, v in ALIASES.items())})")
            try:
                value = float(raw)
            except ValueError:
                raise ConfigError(f"{where}: {metric} bound {raw!r} is not a number") from None
            if not math.isfinite(value):
                raise ConfigError(f"{where}: {metric} bound must be finite, got {raw!r}")
            if metric in FRACTIONS and not 0.0 <= value <= 1.0:
                raise ConfigError(f"{where}: {metric} is a fraction, its bound must be in [0, 1], got {value:g}")
            if metric not in FRACTIONS and value < 0:
                raise ConfigError(f"{where}: {metric} bound must be >= 0, got {value:g}")
            key = (cls, metric, op)
            if key in seen:
                raise ConfigError(f"{where}: {cls}:{metric}{op} is given twice")
            seen.add(key)
            out.append(Target(cls, metric, op, value))
    return out


# -- deployments --------------------------------------------------------------------------------
@dataclass(frozen=True, order=True)
class Deployment:
    """Co-located ``n`` instances, or disaggregated ``p`` prefill + ``d`` decode instances."""

    kind: str
    p: int          # co-located: the number of instances
    d: int = 0      # disaggregated only

    @property
    def cost(self) -> int:
        return self.p + self.d

    def __str__(self) -> str:
        return f"colocated:{self.p}" if self.kind == COLOCATED else f"disagg:{self.p}:{self.d}"

    def apply(self, sim):
        """``sim`` (a :class:`proserve.sim.cluster.SimConfig`) with this deployment."""
        if self.kind == COLOCATED:
            return replace(sim, deployment=COLOCATED, instances=self.p)
        return replace(sim, deployment=DISAGGREGATED, prefill_instances=self.p, decode_instances=self.d)


def colocated(n: int) -> Deployment:
    return Deployment(COLOCATED, n)


def disagg(p: int, d: int) -> Deployment:
    return Deployment(DISAGGREGATED, p, d)


def parse_deployment(text: str) -> Deployment:
    """``colocated:N`` or ``disagg:P:D`` (also ``disaggregated:P:D``)."""
    parts = [s.strip() for s in text.split(":")]
    kind = parts[0].lower()
    try:
        nums = [int(x) for x in parts[1:]]
    except ValueError:
        nums = None
    if kind == "colocated" and nums is not None and len(nums) == 1 and nums[0] >= 1:
        return colocated(nums[0])
    if kind in ("disagg", "disaggregated") and nums is not None and len(nums) == 2 and min(nums) >= 1:
        return disagg(*nums)
    raise ConfigError(f"--deployment {text!r}: expected colocated:N or disagg:P:D with positive integers "
                      f"(e.g. colocated:4, disagg:2:6)")


# -- one simulated point ----------------------------------------------------------------------
@dataclass
class Trial:
    """One point (deployment, rate) over every seed."""

    deployment: Deployment
    rate: float
    runs: list[dict] = field(default_factory=list)    # run_spec outputs, one per seed
    passed: bool = False
    failed: list[str] = field(default_factory=list)   # "seed 1: high:slo_attainment=0.87 < 0.9"
    index: int = 0                                    # order of completion, 1-based
    phase: str = ""                                   # which search step asked for it

    @property
    def wall_s(self) -> float:
        return sum(r["wall_s"] for r in self.runs)

    def worst(self, cls: str, metric: str, higher_is_better: bool = True) -> float:
        vals = [metric_value(r["metrics"], cls, metric) for r in self.runs]
        vals = [v for v in vals if not math.isnan(v)]
        if len(vals) < len(self.runs) or not vals:
            return float("nan")
        return min(vals) if higher_is_better else max(vals)

    def judge(self, targets: Sequence[Target]) -> None:
        self.failed = []
        for r in self.runs:
            for t in targets:
                if not t.holds(r["metrics"]):
                    v = metric_value(r["metrics"], t.cls, t.metric)
                    self.failed.append(f"seed {r['seed']}: {t.cls}:{t.metric}={v:.3g}, needs {t.op}{t.value:g}")
        self.passed = not self.failed

    def as_dict(self) -> dict:
        return {"deployment": str(self.deployment), "instances": self.deployment.cost, "rate": self.rate,
                "passed": self.passed, "failed": self.failed, "wall_s": self.wall_s, "phase": self.phase,
                "seeds": [{"seed": r["seed"], "wall_s": r["wall_s"], "requests": r["requests"],
                           "duration_s": r["duration_s"], "metrics": r["metrics"]} for r in self.runs]}


# -- progress bar -------------------------------------------------------------------------------
class Progress:
    """A one-line progress bar on a terminal (stdlib only, tqdm-like).

    Off (writes nothing) when ``stream`` is not a terminal or ``enabled=False``
    (``--quiet``). ``add(n)`` announces ``n`` more simulations (a search does not
    know its total in advance), ``done(note)`` counts one finished.
    """

    WIDTH = 24

    def __init__(self, stream: TextIO | None = None, enabled: bool | None = None, label: str = "plan"):
        self.stream = sys.stderr if stream is None else stream
        isatty = getattr(self.stream, "isatty", None)
        tty = bool(isatty()) if callable(isatty) else False
        self.enabled = tty if enabled is None else (enabled and tty)
        self.label = label
        self.total = 0
        self.count = 0
        self.note = ""
        self.t0 = time.monotonic()
        self._last = 0.0

    def add(self, n: int) -> None:
        self.total += n
        self._draw()

    def done(self, note: str = "") -> None:
        self.count += 1
        self.note = note or self.note
        self._draw(force=self.count == self.total)

    def show(self, note: str) -> None:
        """Say what runs now."""
        self.note = note
        self._draw(force=True)

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < 0.1:
            return
        self._last = now
        frac = self.count / self.total if self.total else 0.0
        fill = round(frac * self.WIDTH)
        el = int(now - self.t0)
        line = (f"\r{self.label} [{'#' * fill}{'.' * (self.WIDTH - fill)}] {self.count}/{self.total} sims "
                f"{el // 60}:{el % 60:02d}  {self.note}")
        self.stream.write(line[:150].ljust(100))
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(force=True)
            self.stream.write("\n")
            self.stream.flush()


# -- the planner --------------------------------------------------------------------------------
@dataclass
class PlanResult:
    mode: str                                 # "cheapest" or "highest_rate"
    trials: list[Trial]
    answer: Trial | None                      # the chosen passing point (None: nothing passes)
    best: dict[str, Trial | None]             # cheapest: per kind; highest_rate: "pass"/"fail"
    notes: list[str] = field(default_factory=list)
    bounds: dict[str, int] = field(default_factory=dict)  # cheapest: the largest size searched per kind

    def as_dict(self) -> dict:
        return {"mode": self.mode, "answer": None if self.answer is None else self.answer.as_dict(),
                "best": {k: None if t is None else {"deployment": str(t.deployment), "rate": t.rate}
                         for k, t in self.best.items()},
                "notes": self.notes, "trials": [t.as_dict() for t in self.trials]}


class Planner:
    """Simulates points on demand, caching each (deployment, rate).

    ``base``: a :class:`proserve.sim.__main__.RunSpec` (workload, model, policies, SimConfig)
    whose deployment, rate and seed the planner sets per run; ``run``: the function
    that simulates one spec and returns ``run_spec``'s dict (picklable, it goes to
    worker processes when ``jobs > 1``).
    """

    def __init__(self, base, run: Callable, targets: Sequence[Target], seeds: Sequence[int] = (0,),
                 jobs: int = 1, progress: Progress | None = None, executor: Executor | None = None):
        if not seeds:
            raise ConfigError("--seeds: give at least one seed")
        if jobs < 1:
            raise ConfigError(f"--jobs must be >= 1, got {jobs}")
        self.base, self.run, self.targets = base, run, list(targets)
        self.seeds = list(seeds)
        self.jobs = jobs
        self.progress = progress or Progress(enabled=False)
        self._executor = executor
        self._own_executor = False
        self.trials: dict[tuple[Deployment, float], Trial] = {}
        self.order: list[Trial] = []
        self.notes: list[str] = []
        self._noted: set = set()

    # points evaluated at once by a k-ary search: the spare workers after the seeds
    @property
    def width(self) -> int:
        return max(1, self.jobs // len(self.seeds))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        if self._own_executor and self._executor is not None:
            self._executor.shutdown(cancel_futures=True)
            self._executor = None
        self.progress.close()

    def _pool(self) -> Executor | None:
        if self.jobs == 1:
            return None
        if self._executor is None:
            self._executor = ProcessPoolExecutor(self.jobs)
            self._own_executor = True
        return self._executor

    def spec(self, dep: Deployment, rate: float, seed: int):
        return replace(self.base, rate=rate, seed=seed, sim=replace(dep.apply(self.base.sim), seed=seed))

    def evaluate(self, points: Sequence[tuple[Deployment, float]], phase: str = "") -> list[Trial]:
        """Simulate every seed of every point not simulated before; return the trials in order."""
        todo = []
        for dep, rate in points:
            if (dep, rate) not in self.trials and (dep, rate) not in [(d, r) for d, r, _ in todo]:
                todo.append((dep, rate, Trial(dep, rate, phase=phase)))
        jobs = [(t, self.spec(dep, rate, s)) for dep, rate, t in todo for s in self.seeds]
        self.progress.add(len(jobs))
        pool = self._pool()
        if pool is None:
            for t, sp in jobs:
                self.progress.show(f"{t.deployment} @ {t.rate:g} req/s")
                t.runs.append(self.run(sp))
                self.progress.done()
        else:
            futs = {pool.submit(self.run, sp): t for t, sp in jobs}
            for f in as_completed(futs):
                t = futs[f]
                t.runs.append(f.result())
                self.progress.done(f"{t.deployment} @ {t.rate:g} req/s")
        for dep, rate, t in todo:
            t.runs.sort(key=lambda r: r["seed"])
            t.judge(self.targets)
            self.trials[(dep, rate)] = t
            self.order.append(t)
            t.index = len(self.order)
        return [self.trials[p] for p in points]

    # -- searches -------------------------------------------------------------------------
    def _boundary(self, seen: dict, phase: str, fail_below: bool) -> tuple:
        """(last fail, first pass) along a search axis from ``seen`` (x -> passed).

        ``fail_below``: failures are expected below passes (instances: few fail, many
        pass); else above them (rates). The boundary is taken on the safe side: the
        pass nearest the boundary that has *no* failure beyond it (more instances,
        or a lower rate), so the answer is never a pass with a failure on its safe
        side. Such an inversion violates the monotonicity the search assumes and is
        noted under the table."""
        fails = [x for x, ok in seen.items() if not ok]
        passes = [x for x, ok in seen.items() if ok]
        if fail_below:
            last_fail = max(fails, default=None)
            ok = [x for x in passes if last_fail is None or x > last_fail]
            first_pass = min(ok, default=None)
            bad = [x for x in passes if last_fail is not None and x < last_fail]
        else:
            last_fail = min(fails, default=None)
            ok = [x for x in passes if last_fail is None or x < last_fail]
            first_pass = max(ok, default=None)
            bad = [x for x in passes if last_fail is not None and x > last_fail]
        for x in bad:
            if (phase, x) not in self._noted:      # once per inverted pass
                self._noted.add((phase, x))
                self.notes.append(f"monotonicity violated in {phase}: {x:g} passes but {last_fail:g} "
                                  f"{'above' if fail_below else 'below'} it fails; the answer takes the safe side")
        return last_fail, first_pass

    def _first_pass(self, candidates: Sequence[int], point: Callable, phase: str,
                    known_pass: int | None = None) -> int | None:
        """The least candidate that passes, assuming fail...fail pass...pass along the
        increasing integers ``candidates`` (``point(c)`` gives its (deployment, rate));
        None if the largest fails. Galloping (1st, 2nd, 4th, 8th, ... candidate) to the
        first pass, then a k-ary bisection, ``width`` points per round.
        ``known_pass``: a candidate already known to pass (skips the galloping)."""
        seen: dict[int, bool] = {}

        def run(xs: list[int]) -> None:
            for x, t in zip(xs, self.evaluate([point(x) for x in xs], phase + step)):
                seen[x] = t.passed

        step = " (gallop)"
        if known_pass is not None:
            seen[known_pass] = self.trials[point(known_pass)].passed
        else:
            order = [candidates[i] for i in _gallop_indices(len(candidates))]
            k = 0
            while k < len(order) and not any(seen.values()):
                run(order[k:k + self.width])
                k += self.width
        step = " (bisect)"
        while True:
            last_fail, first_pass = self._boundary(seen, phase, fail_below=True)
            if first_pass is None:
                # nothing passes above the last failure: try what is left above it, if anything
                rest = [c for c in candidates if last_fail is None or c > last_fail]
                rest = [c for c in rest if c not in seen]
                if not rest:
                    return None
                run(rest[-1:])
                continue
            inside = [c for c in candidates if (last_fail is None or c > last_fail) and c < first_pass]
            if not inside:
                return first_pass
            run(_spread(inside, self.width))
    def cheapest(self, rate: float, max_instances: int,
                 kinds: Sequence[str] = (COLOCATED, DISAGGREGATED)) -> PlanResult:
        """The fewest instances meeting every target at ``rate`` (see the module docstring)."""
        if not rate > 0 or not math.isfinite(rate):
            raise ConfigError(f"--rate must be a finite number > 0, got {rate!r}")
        if max_instances < 1:
            raise ConfigError(f"--max-instances must be >= 1, got {max_instances}")
        best: dict[str, Trial | None] = {}
        bounds: dict[str, int] = {}
        bound = max_instances
        if COLOCATED in kinds:
            # M1: pass is monotone in N
            ns = list(range(1, max_instances + 1))
            n = self._first_pass(ns, lambda n: (colocated(n), rate), "co-located N")
            best[COLOCATED] = None if n is None else self.trials[(colocated(n), rate)]
            bounds[COLOCATED] = max_instances
            if n is not None:
                bound = n      # a split must cost at most this (equal cost still searched)
        if DISAGGREGATED in kinds:
            bounds[DISAGGREGATED] = bound
            best[DISAGGREGATED] = self._cheapest_split(rate, bound) if bound >= 2 else None
        passing = [t for t in best.values() if t is not None]
        # the cheapest; on a tie the co-located one (fewer moving parts: no KV transfer)
        answer = min(passing, key=lambda t: (t.deployment.cost, t.deployment.kind != COLOCATED), default=None)
        return PlanResult("cheapest", list(self.order), answer, best, list(self.notes), bounds)

    def _cheapest_split(self, rate: float, bound: int) -> Trial | None:
        """Disaggregated P:D of least P + D <= ``bound`` (M2: pass is monotone in P and in D)."""
        found: Trial | None = None
        p = 1
        while p + 1 <= bound:
            dcap = bound - p
            t = self.evaluate([(disagg(p, dcap), rate)], f"disagg P={p}, largest D")[0]
            if t.passed:
                d = self._first_pass(list(range(1, dcap + 1)), lambda d, p=p: (disagg(p, d), rate),
                                     f"disagg P={p}, D", known_pass=dcap)
                found = self.trials[(disagg(p, d), rate)]
                bound = found.deployment.cost - 1       # only strictly cheaper splits from here
            p += 1
        return found

    def highest_rate(self, dep: Deployment, start: float | None = None, tol: float = 0.02) -> PlanResult:
        """The highest rate ``dep`` sustains (M3), to relative tolerance ``tol``."""
        if not 0 < tol < 1:
            raise ConfigError(f"--rate-tol must be in (0, 1), got {tol!r}")
        r = _round_rate(start if start is not None else float(dep.cost))
        if not r > 0:
            raise ConfigError(f"--rate-start must be > 0, got {start!r}")
        seen: dict[float, bool] = {}

        def run(xs: list[float], phase: str) -> None:
            for x, t in zip(xs, self.evaluate([(dep, x) for x in xs], phase)):
                seen[x] = t.passed

        # gallop: ×2 while passing, ÷2 while failing, `width` rates per round
        run([r], "rate (gallop)")
        while True:
            fail, ok = self._boundary(seen, "the rate search", fail_below=False)
            if fail is not None and ok is not None:
                break
            if fail is None:
                xs = [_round_rate(ok * 2 ** (j + 1)) for j in range(self.width)]
            else:
                xs = [_round_rate(fail / 2 ** (j + 1)) for j in range(self.width)]
            xs = [x for x in xs if RATE_MIN <= x <= RATE_MAX and x not in seen]
            if not xs:
                break
            run(xs, "rate (gallop)")
        # bisection: `width` rates spread over (pass, fail) per round
        while fail is not None and ok is not None and (fail - ok) / ok > tol:
            m = self.width
            xs = sorted({_round_rate(ok + (fail - ok) * (j + 1) / (m + 1)) for j in range(m)})
            xs = [x for x in xs if ok < x < fail and x not in seen]
            if not xs:
                break       # the rounding cannot split the interval further
            run(xs, "rate (bisect)")
            fail, ok = self._boundary(seen, "the rate search", fail_below=False)
        notes = list(self.notes)
        order = list(self.order)
        if ok is None:
            return PlanResult("highest_rate", order, None, {"pass": None, "fail": self.trials[(dep, fail)]}, notes)
        best = {"pass": self.trials[(dep, ok)], "fail": None if fail is None else self.trials[(dep, fail)]}
        return PlanResult("highest_rate", order, best["pass"], best, notes)


def _gallop_indices(n: int) -> list[int]:
    """0, 1, 3, 7, 15, ... below ``n``, and ``n - 1``: candidates 1, 2, 4, 8, ... of 1..n."""
    out, i = [], 0
    while i < n:
        out.append(i)
        i = 2 * i + 1
    if out and out[-1] != n - 1:
        out.append(n - 1)
    return out


def _spread(xs: list, k: int) -> list:
    """``min(k, len(xs))`` elements of the sorted ``xs`` that cut it into equal parts
    (k = 1: the middle one; a k-ary search's probes)."""
    m = min(k, len(xs))
    return sorted({xs[(len(xs) * (j + 1)) // (m + 1)] for j in range(m)})


def _round_rate(x: float) -> float:
    """Rates to 4 significant digits: what the table prints is what was simulated."""
    return float(f"{x:.4g}")


# -- output -------------------------------------------------------------------------------------
def table_columns(targets: Sequence[Target]) -> list[tuple[str, str, str, bool]]:
    """(header, class, metric, higher_is_better): TDG_Ratio and SLO attainment of every
    class named in a target, then every other targeted metric."""
    cols: list[tuple[str, str, str, bool]] = []
    seen = set()
    for t in targets:
        for metric in ("tdg_ratio", "slo_attainment"):
            if (t.cls, metric) not in seen:
                seen.add((t.cls, metric))
                cols.append((f"{SHORT[metric]}_{t.cls}", t.cls, metric, True))
    for t in targets:
        if (t.cls, t.metric) not in seen:
            seen.add((t.cls, t.metric))
            cols.append((f"{SHORT.get(t.metric, t.metric)}_{t.cls}", t.cls, t.metric, t.higher_is_better))
    return cols


def format_trials(result: PlanResult, targets: Sequence[Target]) -> str:
    """The table of every point tried, in the order they finished; ``*`` marks the answer."""
    cols = table_columns(targets)
    head = ["#", "deployment", "inst", "rate"] + [c[0] for c in cols] + ["pass", "wall_s", "search step"]
    rows = []
    for t in result.trials:
        mark = "*" if result.answer is t else ""
        cells = [f"{t.index}{mark}", str(t.deployment), str(t.deployment.cost), f"{t.rate:g}"]
        for _, cls, metric, hib in cols:
            v = t.worst(cls, metric, hib)
            cells.append("-" if math.isnan(v) else (f"{v:.3f}" if metric in FRACTIONS else f"{v:.3g}"))
        cells += ["PASS" if t.passed else "fail", f"{t.wall_s:.1f}", t.phase]
        rows.append(cells)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    left = {1, len(head) - 1}
    def fmt(cells):
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    lines = [fmt(head), "  ".join("-" * w for w in widths)]
    lines += [fmt(r) for r in rows]
    return "\n".join(lines)


def describe(result: PlanResult, targets: Sequence[Target], rate: float | None = None,
             max_instances: int | None = None, tol: float | None = None) -> str:
    """The answer in words, under the table."""
    lines = []
    if result.mode == "cheapest":
        for kind in (COLOCATED, DISAGGREGATED):
            if kind not in result.best:
                continue
            t = result.best[kind]
            b = result.bounds.get(kind, max_instances)
            why = "" if b == max_instances else " (the co-located answer's cost: no larger one can win)"
            lines.append(f"cheapest {kind}: " + (f"{t.deployment} ({t.deployment.cost} instances)" if t else
                                                 f"none of at most {b} instances{why}"))
        a = result.answer
        lines.append(f"answer at {rate:g} req/s: " + (f"{a.deployment} ({a.deployment.cost} instances)"
                                                      if a else f"no deployment of at most {max_instances} "
                                                      f"instances meets {', '.join(map(str, targets))}"))
    else:
        p, f = result.best.get("pass"), result.best.get("fail")
        dep = (p or f).deployment
        if p and f:
            lines.append(f"highest rate {dep} sustains: {p.rate:g} req/s (passes); {f.rate:g} req/s fails "
                         f"(tolerance {tol:g})")
        elif p:
            lines.append(f"{dep} passes at every rate tried, up to {p.rate:g} req/s")
        else:
            lines.append(f"{dep} meets the targets at no rate tried (down to {f.rate:g} req/s)")
    n_sims = sum(len(t.runs) for t in result.trials)
    lines.append(f"{len(result.trials)} points, {n_sims} simulations, "
                 f"{sum(t.wall_s for t in result.trials):.1f} s of simulation wall time")
    lines += [f"note: {n}" for n in dict.fromkeys(result.notes)]
    return "\n".join(lines)


def plot_plan(result: PlanResult, targets: Sequence[Target], path: str | Path, title: str = "") -> None:
    """One panel per target: the worst seed's value of each point tried against
    instances (cheapest mode) or rate (highest-rate mode); filled = pass, hollow =
    fail, the target as a dashed line, the answer circled."""
    from .report import _pyplot, _save
    plt = _pyplot()
    n = len(targets)
    fig, axes = plt.subplots(1, n, figsize=(4.4 * n, 3.6), squeeze=False)
    by_rate = result.mode == "highest_rate"
    styles = {COLOCATED: ("tab:blue", "o"), DISAGGREGATED: ("tab:orange", "s")}
    for ax, tg in zip(axes[0], targets):
        for kind, (color, marker) in styles.items():
            pts = [t for t in result.trials if t.deployment.kind == kind]
            if not pts:
                continue
            for ok in (True, False):
                sel = [t for t in pts if t.passed is ok]
                if not sel:
                    continue
                xs = [t.rate if by_rate else t.deployment.cost for t in sel]
                ys = [t.worst(tg.cls, tg.metric, tg.higher_is_better) for t in sel]
                ax.scatter(xs, ys, marker=marker, s=36, color=color if ok else "none", edgecolors=color,
                           label=f"{kind} {'pass' if ok else 'fail'}", zorder=3)
            if by_rate:
                srt = sorted(pts, key=lambda t: t.rate)
                ax.plot([t.rate for t in srt], [t.worst(tg.cls, tg.metric, tg.higher_is_better) for t in srt],
                        color=color, lw=0.8, alpha=0.6)
        ax.axhline(tg.value, ls="--", color="gray", lw=1)
        if result.answer is not None:
            a = result.answer
            ax.scatter([a.rate if by_rate else a.deployment.cost], [a.worst(tg.cls, tg.metric, tg.higher_is_better)],
                       s=160, facecolors="none", edgecolors="red", lw=1.5, zorder=4, label="answer")
        if not by_rate:
            from matplotlib.ticker import MaxNLocator
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            for t in result.trials:      # name the split of every disaggregated point
                if t.deployment.kind == DISAGGREGATED:
                    ax.annotate(f"{t.deployment.p}:{t.deployment.d}",
                                (t.deployment.cost, t.worst(tg.cls, tg.metric, tg.higher_is_better)),
                                textcoords="offset points", xytext=(5, -3), fontsize=6, color="tab:orange")
        ax.set_xlabel("request rate (req/s)" if by_rate else "instances (N or P+D)")
        ax.set_ylabel(f"{tg.metric} ({tg.cls}), worst seed")
        ax.set_title(str(tg), fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    _save(plt, fig, path)

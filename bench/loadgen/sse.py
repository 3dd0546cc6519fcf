"""Reading responses: the incremental SSE parser (:class:`SSEParser`) and what one
stream chunk (:func:`parse_chunk`) or one unstreamed response
(:func:`parse_response`) says, as a :class:`Chunk`."""

from __future__ import annotations

import json
from dataclasses import dataclass

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

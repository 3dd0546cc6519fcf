"""Who is asking, and what they may ask for: API key → client, priority class, SLOs.

A request names its priority class in ``priority`` and may ask for SLOs in
``slo: {"ttft_ms": ..., "tpot_ms": ...}``; both are optional. With a keys file:

* no key, or a key not in the file → 401;
* ``priority`` above the key's class (a larger weight) → 403; an equal or lower
  class is allowed (a client may downgrade a batch job);
* an SLO outside the range the key allows → 403.

Without a keys file access is open (the dispatcher warns at start): any class
may be asked for, and requests that name none get the default class.

Malformed values — an unknown class, a non-numeric, negative or absurd SLO
(over an hour) — are input errors (400) either way, checked before the key's
limits so that the message says what is wrong with the request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from proserve.scheduler.request import PriorityClass

from .config import MAX_SLO_MS, KeyEntry
from .errors import ApiError


@dataclass(frozen=True)
class Grant:
    """The resolved identity and scheduling parameters of one request."""

    client: str
    cls: PriorityClass
    ttft_slo: float   # seconds
    tpot_slo: float   # seconds


def bearer_key(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization")
    if auth:
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
        return auth.strip()   # malformed header: treated as a key that will not match
    return headers.get("x-api-key")


def _slo_ms(slo: Mapping[str, Any], key: str) -> float | None:
    if key not in slo or slo[key] is None:
        return None
    v = slo[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ApiError(400, f"slo.{key} must be a number of milliseconds, got {v!r}", param=f"slo.{key}")
    v = float(v)
    if not math.isfinite(v) or v <= 0:
        raise ApiError(400, f"slo.{key} must be a positive number of milliseconds, got {v!r}", param=f"slo.{key}")
    if v > MAX_SLO_MS:
        raise ApiError(400, f"slo.{key} of {v:g} ms is over the limit of {MAX_SLO_MS:g} ms (one hour)",
                       param=f"slo.{key}")
    return v


class Authorizer:
    def __init__(self, classes: Mapping[str, PriorityClass], default_class: str,
                 keys: Mapping[str, KeyEntry] | None):
        self.classes = dict(classes)
        self.default_class = default_class
        self.keys = dict(keys) if keys else None

    @property
    def open_access(self) -> bool:
        return self.keys is None

    def authenticate(self, headers: Mapping[str, str]) -> KeyEntry | None:
        """The key's entry (None with open access); 401 when a key is needed and missing or unknown."""
        if self.keys is None:
            return None
        key = bearer_key(headers)
        if not key:
            raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'",
                           type="authentication_error", code="missing_api_key")
        entry = self.keys.get(key)
        if entry is None:
            raise ApiError(401, "invalid API key", type="authentication_error", code="invalid_api_key")
        return entry

    def grant(self, entry: KeyEntry | None, body: Mapping[str, Any]) -> Grant:
        """Resolve priority class and SLOs from the body within what ``entry`` allows."""
        name = body.get("priority")
        if name is None:
            name = entry.cls if entry else self.default_class
        if not isinstance(name, str) or name not in self.classes:
            raise ApiError(400, f"priority: unknown class {name!r}; configured classes: "
                                f"{', '.join(self.classes)}", param="priority")
        slo = body.get("slo") or {}
        if not isinstance(slo, dict):
            raise ApiError(400, f"slo must be an object like {{\"ttft_ms\": 500, \"tpot_ms\": 50}}, got {slo!r}",
                           param="slo")
        unknown = set(slo) - {"ttft_ms", "tpot_ms"}
        if unknown:
            raise ApiError(400, f"slo: unknown field(s) {', '.join(sorted(unknown))}; expected ttft_ms, tpot_ms",
                           param="slo")
        ttft_ms, tpot_ms = _slo_ms(slo, "ttft_ms"), _slo_ms(slo, "tpot_ms")
        pc = self.classes[name]
        if entry is not None:
            own = self.classes[entry.cls]
            if pc.weight > own.weight:
                raise ApiError(403, f"priority {name!r} is above what this key allows ({entry.cls!r})",
                               type="permission_error", param="priority")
            for v, rng, field in ((ttft_ms, entry.ttft_ms, "ttft_ms"), (tpot_ms, entry.tpot_ms, "tpot_ms")):
                if v is not None and rng is not None and not (rng[0] <= v <= rng[1]):
                    raise ApiError(403, f"slo.{field} = {v:g} is outside what this key allows "
                                        f"[{rng[0]:g}, {rng[1]:g}] ms", type="permission_error",
                                   param=f"slo.{field}")
        client = entry.client if entry else "anonymous"
        return Grant(client, pc, ttft_ms / 1000.0 if ttft_ms is not None else pc.ttft_slo,
                     tpot_ms / 1000.0 if tpot_ms is not None else pc.tpot_slo)

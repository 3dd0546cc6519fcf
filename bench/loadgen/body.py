"""The request side of the client: :class:`ClientConfig` (how requests are sent),
the JSON body of one request (:func:`request_body`, ``--api vllm`` or
``proserve``), URLs, and the dispatcher's per-class API keys (``--keys``,
``--class-key``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from proserve.dispatcher.config import read_file
from proserve.scheduler import validate
from proserve.scheduler.request import ConfigError, Request

from .workload import DEFAULT_TOKEN_LOW, DEFAULT_VOCAB

APIS = ("vllm", "proserve")


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
        validate.one_of("", "--api", self.api, APIS)
        validate.fraction("", "--stream-fraction", self.stream_fraction)
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
    """One request's JSON body (see the :mod:`proserve.bench.loadgen` docstring, step 3)."""
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
    where = f"--keys {Path(path)}"
    try:
        data = read_file(path)
    except ConfigError as e:
        raise ConfigError(f"--keys {e}") from None
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

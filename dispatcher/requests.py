"""Checking an OpenAI-API request body and turning it into a :class:`Job`.

The dispatcher forwards the client's body to the workers (vLLM's OpenAI
servers), so every sampling parameter vLLM knows keeps working; it only

* checks what it must read itself (``prompt``/``messages``, ``max_tokens``,
  ``stream``, ``n``, ``model``) and answers 400 naming the field (``n`` > 1 and
  lists of prompts are split into one request per completion before this, by
  :mod:`proserve.dispatcher.fanout`);
* removes what only it may set: ``priority`` and ``slo`` (resolved by
  :mod:`proserve.dispatcher.auth`), ``kv_transfer_params``, and the scheduling keys of
  ``vllm_xargs`` (a client must not raise its own priority by writing them);
* adds the scheduling parameters (``vllm_xargs``: class, weight, SLOs, arrival)
  and, per leg, the KV transfer parameters.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from proserve.scheduler.prefix import block_ids
from proserve.scheduler.request import Request

from .auth import Grant
from .errors import ApiError

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
#: vllm_xargs keys the dispatcher owns (see prefill.params)
SCHED_KEYS = ("priority_class", "weight", "ttft_slo", "tpot_slo", "arrival_time",
              "dispatch_id")   # the request's id, as the workers' queue publications name it (issue 15)
_OWN = ("priority", "slo", "kv_transfer_params")


@dataclass
class Job:
    id: str
    path: str                       # COMPLETIONS or CHAT
    body: dict                      # what goes upstream (before per-leg changes)
    grant: Grant
    arrival: float                  # time.time() when the request reached the dispatcher
    stream: bool
    max_tokens: int | None
    prompt_ids: list[int] | None    # token-id prompt, if the client sent one
    want_token_ids: bool            # the client asked for return_token_ids
    want_usage: bool                # streamed: the client asked for a usage chunk
    prompt_len: int = 0
    #: the prompt's token ids as the engines see them (the client's, or the workers' /tokenize),
    #: for its prefix blocks; None: not known. Dropped once the scheduler's view is built
    tokens: list[int] | None = None
    sreq: Request | None = None     # the scheduler's view (PrefillQueueMap entry, TDG scoring)
    record: dict = field(default_factory=dict)
    #: admission control's decision, once taken (Dispatcher._admit): the ids of the instances
    #: it may go to (None: any). A fan-out takes it for all its parts before any is routed
    admitted: bool = False
    allowed: set[int] | None = None

    @property
    def is_chat(self) -> bool:
        return self.path == CHAT

    def xargs(self) -> dict:
        g = self.grant
        return {"priority_class": g.cls.name, "weight": g.cls.weight, "ttft_slo": g.ttft_slo,
                "tpot_slo": g.tpot_slo, "arrival_time": self.arrival, "dispatch_id": self.id}


def _int(body: dict, key: str, lo: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"{key} must be an integer, got {v!r}", param=key)
    if v < lo:
        raise ApiError(400, f"{key} must be >= {lo}, got {v}", param=key)
    return v


def _token_ids(v: list, where: str) -> list[int]:
    if not v:
        raise ApiError(400, f"{where} is empty", param="prompt")
    for i, t in enumerate(v):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ApiError(400, f"{where}[{i}] must be a non-negative token id, got {t!r}", param="prompt")
    return v


def split_prompts(prompt: Any) -> list:
    """The prompts of a /v1/completions ``prompt`` field, in order, each a string or a
    token-id list, in vLLM's forms: a string, a token-id list, a list of strings or a list
    of token-id lists (not a mix). 400 for anything else, an empty list or an empty prompt."""
    if isinstance(prompt, str):
        parse_prompt(prompt)
        return [prompt]
    if not isinstance(prompt, list):
        raise ApiError(400, f"prompt must be a string or a list of token ids, got {type(prompt).__name__}",
                       param="prompt")
    if not prompt:
        raise ApiError(400, "prompt is empty", param="prompt")
    if all(isinstance(x, str) for x in prompt) or all(isinstance(x, list) for x in prompt):
        for i, x in enumerate(prompt):
            if isinstance(x, str):
                if not x:
                    raise ApiError(400, f"prompt[{i}] is empty", param="prompt")
            else:
                _token_ids(x, f"prompt[{i}]")
        return list(prompt)
    if any(isinstance(x, (str, list)) for x in prompt):
        raise ApiError(400, "prompt must be a string, a list of token ids, a list of strings or a list of "
                            "token-id lists (not a mix)", param="prompt")
    return [_token_ids(prompt, "prompt")]


def parse_prompt(prompt: Any) -> list[int] | None:
    """Token ids of a token-id prompt, None for a text prompt; 400 for anything else.
    One prompt: several (a list of strings or of token-id lists) are split into one
    request each before this, by :mod:`proserve.dispatcher.fanout`."""
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "prompt is empty", param="prompt")
        return None
    if isinstance(prompt, list) and prompt and all(isinstance(x, (str, list)) for x in prompt):
        if len(prompt) != 1:
            raise ApiError(400, f"prompt holds {len(prompt)} prompts where one was expected", param="prompt")
        return parse_prompt(prompt[0])
    if isinstance(prompt, list):
        return _token_ids(prompt, "prompt")
    raise ApiError(400, f"prompt must be a string or a list of token ids, got {type(prompt).__name__}",
                   param="prompt")


def make_job(path: str, body: dict, grant: Grant, arrival: float, model: str | None) -> Job:
    body = dict(body)   # the caller checked it is an object (auth reads it first)
    for k in _OWN:
        body.pop(k, None)
    asked = body.get("model")
    if asked is not None and not isinstance(asked, str):
        raise ApiError(400, f"model must be a string, got {asked!r}", param="model")
    if model is not None:
        if asked is not None and asked != model:
            raise ApiError(404, f"The model `{asked}` does not exist. Served: {model}", param="model",
                           type="NotFoundError")
        body["model"] = model
    prompt_ids = None
    if path == CHAT:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError(400, "messages must be a non-empty list of {\"role\", \"content\"} objects",
                           param="messages")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError(400, f"messages[{i}] must be an object with a string 'role'", param="messages")
        max_tokens = _int(body, "max_completion_tokens", 1)
        if max_tokens is None:
            max_tokens = _int(body, "max_tokens", 1)
    else:
        if "prompt" not in body:
            raise ApiError(400, "missing field 'prompt'", param="prompt")
        prompt_ids = parse_prompt(body["prompt"])
        max_tokens = _int(body, "max_tokens", 1)
    n = _int(body, "n", 1)
    if n not in (None, 1):   # fanout.split turns n > 1 into n requests before this
        raise ApiError(400, f"n = {n} where one completion was expected", param="n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, f"stream must be true or false, got {stream!r}", param="stream")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise ApiError(400, f"stream_options must be an object, got {so!r}", param="stream_options")
    want_usage = bool(stream and so and so.get("include_usage"))
    xa = body.get("vllm_xargs")
    if xa is not None:
        if not isinstance(xa, dict):
            raise ApiError(400, f"vllm_xargs must be an object, got {xa!r}", param="vllm_xargs")
        xa = {k: v for k, v in xa.items() if k not in SCHED_KEYS}
        if xa:
            body["vllm_xargs"] = xa
        else:
            body.pop("vllm_xargs")
    job = Job(id=f"proserve-{uuid.uuid4().hex}", path=path, body=body, grant=grant, arrival=arrival,
              stream=stream, max_tokens=max_tokens, prompt_ids=prompt_ids,
              want_token_ids=bool(body.get("return_token_ids")), want_usage=want_usage)
    if prompt_ids is not None:
        job.prompt_len = len(prompt_ids)
        job.tokens = prompt_ids
    return job


def check_context(job: Job, max_model_len: int | None) -> None:
    """400 when prompt + completion cannot fit the model's context (vLLM's wording)."""
    if not max_model_len:
        return
    want = job.prompt_len + (job.max_tokens or 0)
    if job.prompt_len >= max_model_len or want > max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                            f"requested {want} tokens ({job.prompt_len} in the "
                            f"{'messages' if job.is_chat else 'prompt'}, {job.max_tokens or 0} for the "
                            f"completion). Please reduce the length of the prompt or completion.",
                       param="messages" if job.is_chat else "prompt", code="context_length_exceeded")


def scheduler_request(job: Job, block_tokens: int = 0) -> Request:
    """The scheduler's view of ``job``. With ``block_tokens`` (the prefill workers' KV block
    size, :meth:`Registry.prefix_block_tokens`; 0: no prefix index) and the prompt's token ids
    known, it carries the prompt's prefix block ids (:func:`proserve.scheduler.prefix.block_ids`,
    vLLM's hash chain over full blocks), for the router's prefix-cache index."""
    g = job.grant
    blocks: tuple[int, ...] = ()
    if block_tokens > 0 and job.tokens:
        try:
            blocks = block_ids(job.tokens, block_tokens)
        except ValueError:   # an id outside [0, 2**64): the engine rejects it; no prefix to index
            blocks = ()
    return Request(id=job.id, priority=g.cls.name, weight=g.cls.weight, ttft_slo=g.ttft_slo,
                   tpot_slo=g.tpot_slo, arrival=job.arrival, prompt_len=max(1, job.prompt_len),
                   output_len=max(1, job.max_tokens or 1),
                   prefix_blocks=blocks, prefix_block_tokens=block_tokens if blocks else 0)


def prefill_body(job: Job, xfer: dict | None) -> dict:
    """The prefill leg: the client's body capped at one token, not streamed, with the KV hand-off."""
    b = dict(job.body)
    for k in ("stream", "stream_options", "max_completion_tokens", "min_tokens", "echo", "logprobs",
              "top_logprobs", "prompt_logprobs"):
        b.pop(k, None)
    b["max_tokens"] = 1
    b["stream"] = False
    b["vllm_xargs"] = {**b.get("vllm_xargs", {}), **job.xargs()}
    if xfer is not None:
        b["kv_transfer_params"] = xfer
    return b


def serve_body(job: Job, xfer: dict | None, stream: bool) -> dict:
    """The leg that produces the client's tokens (decode worker, or the co-located instance)."""
    b = dict(job.body)
    b["stream"] = stream
    if stream:
        b["stream_options"] = {**(b.get("stream_options") or {}), "include_usage": True}
        b["return_token_ids"] = True   # to count the tokens of each chunk exactly
    b["vllm_xargs"] = {**b.get("vllm_xargs", {}), **job.xargs()}
    if xfer is not None:
        b["kv_transfer_params"] = xfer
    return b

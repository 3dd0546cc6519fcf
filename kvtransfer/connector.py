"""ProServe's vLLM KV connector: push KV blocks from a prefill engine to a decode
engine over the ZeroMQ transport (:mod:`proserve.kvtransfer.transport`).

Loaded without patching vLLM::

    kv_transfer_config = {
        "kv_connector": "ProServeConnector",
        "kv_connector_module_path": "proserve.kvtransfer.connector",
        "kv_role": "kv_producer" | "kv_consumer",
        "kv_load_failure_policy": "recompute",       # decode falls back to recomputing
        "kv_connector_extra_config": {
            "listen": "tcp://127.0.0.1:15600",       # consumer: where KV is received
            "timeout_s": 30,                          # what a transfer may spend waiting, in all
            "keys_dir": "/etc/proserve/kv-keys",      # CURVE keys (kvtransfer.auth); see below
        },
    }

Protocol, per request, keyed by a transfer id the *caller* issues (never the
engine's internal request id, which vLLM suffixes per engine; one id per
attempt: an id already in use on this engine is refused):

1. The caller sends the prompt to a prefill engine with ``max_tokens=1`` and
   ``kv_transfer_params = {"do_remote_decode": true, "xfer_id": X,
   "remote_addr": <decode engine's listen address>}``.
2. Producer: every step, after each attention layer, ``save_kv_layer`` stages
   the blocks that step wrote for the request (one gather of the layer; on an
   accelerator a copy to pinned host memory on a side stream, after an event
   recorded on the forward stream) and returns: the sending is done by the
   pusher's thread for that destination (:mod:`proserve.kvtransfer.pusher`), so
   the forward pass waits neither for the network nor for flow-control credit. Each layer goes
   out as piece ``(step, layer)`` of the transfer (the wire's ``step`` field;
   the blocks are logical positions in the request). Large layers go out at
   once (pipelined per layer and per prefill chunk); small ones are packed and
   the pack is sent at the end of the step. When the request finishes,
   ``request_finished`` keeps its blocks and the pusher sends "done" (with a
   digest of the prompt's token ids) after the request's layers and collects
   the consumer's ack; only then does ``get_finished`` report the request so
   vLLM frees the blocks. A transfer may spend ``timeout_s`` waiting on its
   receiver, all its layers and the ack together (not per layer); a
   destination that does not answer opens a circuit breaker
   (:class:`proserve.kvtransfer.sender.KVSender`) and later transfers to it
   fail at once. The prefill response's ``kv_transfer_params`` then carries
   ``error`` (and ``kv_failed_dest`` when the destination is at fault) so
   the dispatcher sends the decode leg elsewhere or lets it recompute.
3. The caller sends the same prompt to the decode engine with
   ``kv_transfer_params = {"do_remote_prefill": true, "xfer_id": X}``.
   Consumer: ``get_num_new_matched_tokens`` claims the prompt as loaded
   asynchronously; once transfer X is complete in the receiver, the loader's
   thread (:mod:`proserve.kvtransfer.loader`) checks it against this request
   and this engine's cache -- the digest of the prompt's token ids, the layer
   count, dtype, block shape and block coverage -- and only then writes it
   into the blocks vLLM allocated, straight from the received frames into
   views of the cache (:mod:`proserve.kvtransfer.kvcache`; an accelerator's
   cache through one pinned buffer per transfer, on a stream of its own); the
   engine's step never waits for it. A transfer that fails any check, fails
   on the wire or never arrives within ``timeout_s`` is a load failure
   (``failed_recving``; vLLM 0.23/0.27, which lack it: the blocks it left
   unwritten, ``get_block_ids_with_load_errors``): with ``kv_load_failure_policy="recompute"`` vLLM
   recomputes the prompt locally, with ``"fail"`` the request ends with an
   error. Never an engine crash.

Parallelism (:mod:`proserve.kvtransfer.layout`): with tensor parallelism every
rank moves its own shard, rank r of the prefill engine to rank r of the decode
engine, whose rank r listens on ``listen``'s port + r; each rank's ``hello``
carries its layout and a decode rank refuses a prefill rank it cannot take
(another tensor-parallel size, block size, model or cache dtype) with the
reason, which the prefill response then carries. Pipeline parallelism is
refused at start-up.

CUDA graphs: a producer needs every layer's ``save_kv_layer`` to run, so it
asks vLLM for piecewise graphs (:meth:`ProServeConnector.requires_piecewise_for_cudagraph`);
a consumer (``layerwise_save: false``, set by the decode worker) keeps full graphs.

Cache layouts: one tensor per layer (vLLM: ``[blocks, ...]`` or ``[2, blocks, ...]``)
or a tuple of ``[blocks, ...]`` tensors per layer (vllm-ascend: ``(k, v)``, or MLA's
``(nope, rope)``); :func:`proserve.kvtransfer.layout.flatten_caches` numbers the
tensors for the wire, and both sides must split their layers alike.

Security: with ``keys_dir`` the KV sockets use ZeroMQ CURVE (the consumer's
receiver admits only the client keys in ``keys_dir/clients``; the producer
needs ``client.key_secret`` and ``server.key``). Without keys, the receiver
binds only loopback/ipc addresses and the sender sends only to them, unless
``insecure: true`` is set explicitly.

Extra config keys: ``listen``, ``timeout_s``, ``connect_timeout_s``,
``keys_dir``, ``insecure``, ``layerwise_save``; producer ``max_staged_mib``
(layers staged for one destination and not yet with ZeroMQ, default 512); consumer memory caps
``max_open_transfers``, ``max_held_mib``, ``max_peer_mib`` (default: from
this rank's KV bytes per token and ``max_model_len``, see
:func:`proserve.kvtransfer.layout.receiver_caps`), ``prefill_peers``,
``max_message_mib``, ``result_ttl_s``, ``stale_after_s``;
``heartbeat_path`` (the receiver's liveness file, read by the worker's
``/health``); test hooks ``debug_dump_dir``, ``debug_corrupt``.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

try:   # vLLM 0.32+: a failed load is reported per request (failed_recving)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    REPORTS_FAILED_RECVING = True
except ImportError:   # vLLM 0.23/0.27: vLLM calls get_finished, and learns of a failed load from
    # get_block_ids_with_load_errors (the blocks left unwritten), which it then recomputes or fails
    # by kv_load_failure_policy as 0.32 does with failed_recving
    REPORTS_FAILED_RECVING = False

    @dataclass
    class KVConnectorTransferResults:    # the fields of vLLM 0.32's
        finished_sending: set[str] | None = None
        finished_recving: set[str] | None = None
        failed_recving: set[str] = field(default_factory=set)

from . import connector_metrics
from .auth import ClientKeys, ServerKeys
from .common import unpinned
from .layout import (
    EXPECTED_PREFILL_PEERS,
    Layout,
    bytes_per_token,
    cache_parts,
    check_sender,
    flatten_caches,
    rank_address,
    rank_path,
    receiver_caps,
)
from .layout import describe as layout_of
from .loader import KVLoader
from .pusher import FAILED_KEPT, KVPusher, Save
from .receiver import KVReceiver
from .sender import DestinationUnavailable, KVSender

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("proserve.kvtransfer")

XFER_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
ADDR_RE = re.compile(r"^(tcp://[A-Za-z0-9.\-\[\]:]+:\d{1,5}|ipc://[\w./-]{1,200})$")
MIB = 1 << 20
#: scheduler side: ids used before and refused again; more than the pusher remembers as
#: failed (pusher.FAILED_KEPT), so an id still remembered as failed can never start a new
#: transfer whose layers would be skipped
USED_XFERS_KEPT = 4 * FAILED_KEPT
#: worker side: what a step that computes nothing may wait for the connector's threads (s)
IDLE_WAIT_S = 0.005


class TransferParamsError(ValueError):
    pass


@dataclass
class RequestKV:
    """Scheduler-side state of one request's KV transfer, from its ``kv_transfer_params``."""
    #: "produce" (this prefill engine pushes the request's KV), "consume" (this decode engine
    #: loads it) or "invalid" (malformed params: served without a transfer, the response says why)
    role: str
    #: the transfer id the caller issued ("" when invalid)
    xfer: str = ""
    #: producer: the decode engine's KV address (tcp://host:port or ipc://path)
    addr: str = ""
    #: producer: prompt_digest of the prompt, sent in 'done' and in the response
    digest: str = ""
    #: invalid: what is wrong with the params
    error: str = ""
    #: producer: why the transfer failed or will not be tried (no more layers are sent; the
    #: response reports it); None while it is fine
    failed: str | None = None
    #: consumer: the prompt was claimed as loaded from outside (a LoadSpec was issued)
    claimed: bool = False


def parse_params(params: dict | None) -> RequestKV | None:
    """Validate the ProServe fields of ``kv_transfer_params``; None when it asks for
    no transfer, :class:`TransferParamsError` when they are malformed."""
    if not params:
        return None
    if not isinstance(params, dict):
        raise TransferParamsError(f"kv_transfer_params must be an object, got {type(params).__name__}")
    if params.get("do_remote_decode"):
        role = "produce"
        addr = params.get("remote_addr")
        if not isinstance(addr, str) or not ADDR_RE.match(addr):
            raise TransferParamsError(f"kv_transfer_params.remote_addr must be tcp://host:port or "
                                      f"ipc://path, got {addr!r}")
    elif params.get("do_remote_prefill"):
        role, addr = "consume", ""
    else:
        return None
    xfer = params.get("xfer_id")
    if not isinstance(xfer, str) or not XFER_ID_RE.match(xfer):
        raise TransferParamsError(f"kv_transfer_params.xfer_id must be 1-128 characters of "
                                  f"[A-Za-z0-9._:-], got {xfer!r}")
    return RequestKV(role, xfer, addr)


def prompt_digest(token_ids) -> str:
    """What binds a transfer to its request: a digest of the prompt's token ids.
    The producer sends it in "done"; the consumer compares it with its own
    request's prompt before it injects anything."""
    ids = np.asarray(list(token_ids or ()), dtype="<i8")
    return hashlib.blake2b(ids.tobytes(), digest_size=16).hexdigest()


def _extra(cfg, key: str, default, kind=float):
    """A typed kv_connector_extra_config value (``--kv-extra`` passes strings)."""
    v = cfg.get_from_extra_config(key, default)
    if v is None or kind is None:
        return v
    if kind is bool:
        return v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes", "on")
    try:
        return kind(v)
    except (TypeError, ValueError):
        raise ValueError(f"kv_connector_extra_config.{key}: expected {kind.__name__}, got {v!r}") from None


# -- metadata passed from the scheduler-side connector to the worker ---------------------
@dataclass
class SaveSpec:
    req_id: str
    xfer: str
    addr: str
    block_ids: list[int]      # physical blocks written this step
    first_block: int          # their logical index within the request


@dataclass
class FinishSpec:
    req_id: str
    xfer: str
    addr: str
    num_tokens: int
    digest: str


@dataclass
class LoadSpec:
    req_id: str
    xfer: str
    block_ids: list[int]      # physical destination blocks, logical index 0..
    skip_blocks: int          # leading blocks already computed locally (prefix cache)
    digest: str               # prompt_digest of the request's prompt


@dataclass
class ProServeConnectorMetadata(KVConnectorMetadata):
    saves: list[SaveSpec] = field(default_factory=list)
    finishes: list[FinishSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    discards: list[str] = field(default_factory=list)  # consumer: transfers no request will load
    aborts: list[tuple[str, str]] = field(default_factory=list)  # producer: (xfer, dest) that will not finish
    idle: bool = False     # the step computes nothing (the engine steps only to move KV)


# -- metadata passed back from the worker to the scheduler side --------------------------
@dataclass
class ProServeWorkerMetadata(KVConnectorWorkerMetadata):
    """Producer: transfers that failed this step (xfer -> (dest, error)) and
    destinations whose circuit breaker changed (dest -> seconds it stays open,
    0 once it works again; error)."""
    failed: dict[str, tuple[str, str]] = field(default_factory=dict)
    dests: dict[str, tuple[float, str]] = field(default_factory=dict)

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KVConnectorWorkerMetadata":
        """vLLM merges the tensor-parallel ranks' metadata with this: a transfer or a
        destination that failed on several ranks keeps every rank's reason (a refusal
        by rank 0's receiver and a timeout on rank 1's say different things), and a
        destination stays out for the longest of the ranks' cool-downs."""
        if isinstance(other, ProServeWorkerMetadata):
            for x, (dest, err) in other.failed.items():
                mine = self.failed.get(x)
                self.failed[x] = (dest, err) if mine is None else (mine[0], _join(mine[1], err))
            for d, (open_s, err) in other.dests.items():
                mine = self.dests.get(d)
                self.dests[d] = (open_s, err) if mine is None else (max(mine[0], open_s), _join(mine[1], err))
        return self


def _join(a: str, b: str, limit: int = 2000) -> str:
    if not a:
        return b[:limit]
    return a if not b or b in a else f"{a}; {b}"[:limit]


class ProServeConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        self.block_size = vllm_config.cache_config.block_size
        self.is_producer = cfg.is_kv_producer
        self.timeout_s = _extra(cfg, "timeout_s", 30.0)
        self.connect_timeout_s = _extra(cfg, "connect_timeout_s", 2.0)
        self.listen = cfg.get_from_extra_config("listen", f"tcp://127.0.0.1:{cfg.kv_port}")
        self.keys_dir = cfg.get_from_extra_config("keys_dir", None) or None
        self.insecure = _extra(cfg, "insecure", False, bool)
        # test hooks: dump what was sent / injected, or corrupt what is injected
        self.debug_dir = cfg.get_from_extra_config("debug_dump_dir", None)
        self.debug_corrupt = cfg.get_from_extra_config("debug_corrupt", None)  # None | "flip" | "swap"
        # scheduler side
        self._params: dict[str, RequestKV] = {}        # req_id -> its transfer
        self._xfers: dict[str, str] = {}               # xfer id -> req_id, while the id is in use here
        # ids used before on this engine (the worker side remembers failed ids, so a reused
        # one would be skipped silently): one id per attempt, as the dispatcher sends them
        self._used_xfers: collections.OrderedDict = collections.OrderedDict()
        self._blocks: dict[str, list[int]] = {}        # producer: physical blocks per request
        self._pending_finish: list[FinishSpec] = []
        self._unacked: set[str] = set()
        self._pending_load: list[LoadSpec] = []
        self._pending_discard: list[str] = []
        self._pending_abort: list[tuple[str, str]] = []
        self._sending: dict[str, str] = {}             # producer: req_id -> xfer, until the worker is done
        self._dest_open: dict[str, tuple[float, str]] = {}   # dest -> (monotonic open-until, error)
        # worker side
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layer_index: dict[str, int] = {}
        self._block_dim = 0
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.tp_rank = 0
        self.layout: Layout | None = None
        self._max_model_len = vllm_config.model_config.max_model_len if vllm_config.model_config else 0
        self._pusher: KVPusher | None = None
        self._loader: KVLoader | None = None
        self._receiver: KVReceiver | None = None
        self._done_sending: set[str] = set()
        self._finishing: dict[str, str] = {}            # xfer -> req_id: 'done' queued, outcome awaited
        self._meta_failed: dict[str, tuple[str, str]] = {}
        self._dest_reported: dict[str, float | None] = {}  # dest -> open_until last told (None: usable)
        self._step = 0                                  # producer: steps with saves, orders chunks
        self._loads: dict[str, tuple[LoadSpec, float]] = {}   # req_id -> (load, deadline), not yet arrived
        self._loading: dict[str, LoadSpec] = {}         # req_id -> load, with the loader thread
        self._error_blocks: set[int] = set()   # vLLM 0.23/0.27: blocks failed loads left unwritten
        self._applied: ProServeConnectorMetadata | None = None   # the last step whose bookkeeping ran
        self.metrics = connector_metrics.get()
        pp = vllm_config.parallel_config.pipeline_parallel_size
        if pp > 1:
            raise ValueError(f"ProServeConnector: pipeline parallelism ({pp} stages) is not supported: each "
                             f"stage would send its own layers, which the decode side does not assemble yet. "
                             f"Use --tensor-parallel-size instead")
        if self.is_producer and not _extra(cfg, "layerwise_save", True, bool):
            raise ValueError("kv_connector_extra_config.layerwise_save: a KV producer sends each layer as it is "
                             "computed (save_kv_layer); it cannot be false on a producer")

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """A producer sends each layer from ``save_kv_layer``, which vLLM calls in the
        Python wrapper of the attention op (``maybe_transfer_kv_layer``,
        vllm/model_executor/layers/attention/kv_transfer_utils.py). A full CUDA graph
        replays the attention kernels without that wrapper: model runner V2 replays the
        full graph for a batch whose requests each have exactly one new token
        (``uniform_decode``, vllm/v1/worker/gpu/model_runner.py), as a prefill's last
        token after a prefix-cache hit does, and the layers of that step would never
        be sent. Piecewise graphs run attention eagerly between the graph pieces, so
        every layer's ``save_kv_layer`` runs; vLLM switches a FULL_AND_PIECEWISE
        default to PIECEWISE when this returns True (vllm/config/vllm.py). A consumer
        loads between steps and keeps full graphs: the decode worker launcher sets
        ``layerwise_save: false``."""
        v = (extra_config or {}).get("layerwise_save", True)
        return v if isinstance(v, bool) else str(v).lower() not in ("0", "false", "no", "off")

    # ================================ scheduler side ===================================
    def on_new_request(self, request: "Request") -> None:
        rid = request.request_id
        try:
            p = parse_params(request.kv_transfer_params)
            if p is not None and p.xfer in self._xfers:
                raise TransferParamsError(f"kv_transfer_params.xfer_id {p.xfer!r} is already in use by "
                                          f"another request on this engine (one id per attempt)")
            if p is not None and p.xfer in self._used_xfers:
                raise TransferParamsError(f"kv_transfer_params.xfer_id {p.xfer!r} was used by an earlier "
                                          f"request on this engine (one id per attempt)")
        except TransferParamsError as e:
            log.error("request %s: %s; served without KV transfer", rid, e)
            self._params[rid] = RequestKV("invalid", error=str(e))
            return
        if p is None:
            return
        if p.role == "produce" and not self.is_producer:
            log.error("request %s asks a consumer engine to produce KV; ignored", rid)
            return
        if p.role == "produce":
            p.digest = prompt_digest(request.prompt_token_ids)
            down = self._dest_open.get(p.addr)
            if down is not None and down[0] > time.monotonic():
                # the breaker is open: do not even try (the response says why)
                p.failed = f"KV destination {p.addr} unavailable: {down[1]}"
        self._params[rid] = p
        self._xfers[p.xfer] = rid
        self._used_xfers[p.xfer] = None
        while len(self._used_xfers) > USED_XFERS_KEPT:
            self._used_xfers.popitem(last=False)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int):
        p = self._params.get(request.request_id)
        if p is None or p.role != "consume" or p.claimed:
            return 0, False
        count = len(request.prompt_token_ids or []) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        p = self._params.get(request.request_id)
        if p is None or p.role != "consume" or p.claimed or num_external_tokens <= 0:
            return
        p.claimed = True
        block_ids = list(blocks.get_block_ids()[0])
        # the leading blocks this engine found in its own prefix cache: they may be shared with
        # running requests, so the load must not write them (nor a failed load report them).
        # vLLM sets request.num_computed_tokens only after this call; the local hit is the
        # prompt's tokens beyond those the transfer brings (get_num_new_matched_tokens)
        local = len(request.prompt_token_ids or []) - num_external_tokens
        skip = max(0, local) // self.block_size
        self._pending_load.append(LoadSpec(request.request_id, p.xfer, block_ids, skip,
                                           prompt_digest(request.prompt_token_ids)))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = ProServeConnectorMetadata(finishes=self._pending_finish, loads=self._pending_load,
                                         discards=self._pending_discard, aborts=self._pending_abort,
                                         idle=scheduler_output.total_num_scheduled_tokens == 0)
        self._pending_finish, self._pending_load, self._pending_discard, self._pending_abort = [], [], [], []
        if not self.is_producer:
            return meta
        bs = self.block_size
        n_sched = scheduler_output.num_scheduled_tokens

        def add_save(req_id: str, computed: int, start: int | None = None) -> None:
            """Send the blocks of tokens [start, computed + this step's tokens)."""
            p = self._params.get(req_id)
            if p is None or p.role != "produce" or p.failed:
                return
            n = n_sched.get(req_id, 0)
            if n <= 0:
                return
            first, last = (computed if start is None else start) // bs, (computed + n - 1) // bs
            blocks = self._blocks[req_id][first:last + 1]
            meta.saves.append(SaveSpec(req_id, p.xfer, p.addr, blocks, first))

        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self._params:
                self._blocks[new.req_id] = list(new.block_ids[0])
                # from block 0: blocks this engine had in its prefix cache are part of the
                # prompt's KV too, and the decode engine does not have them
                add_save(new.req_id, new.num_computed_tokens, start=0)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id not in self._params:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in getattr(cached, "resumed_req_ids", ()):   # vLLM 0.34: resumed ones come as new
                self._blocks[req_id] = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                self._blocks.setdefault(req_id, []).extend(new_blocks[0])
            add_save(req_id, cached.num_computed_tokens[i])
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        p = self._params.pop(request.request_id, None)
        self._blocks.pop(request.request_id, None)
        if p is None:
            return False, None
        if p.role == "invalid":
            return False, {"error": p.error}
        if p.role == "consume":
            self._release_xfer(p.xfer, request.request_id)
            if not p.claimed:
                # nothing was loaded (e.g. a one-token prompt, which vLLM computes itself):
                # drop the transfer from the receiver instead of holding it until its TTL
                self._pending_discard.append(p.xfer)
            return False, None
        from vllm.v1.request import RequestStatus
        if p.failed:
            self._release_xfer(p.xfer, request.request_id)
            return False, {"xfer_id": p.xfer, "error": p.failed, "kv_failed_dest": p.addr}
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            self._release_xfer(p.xfer, request.request_id)
            self._pending_abort.append((p.xfer, p.addr))   # the receiver drops what it got
            return False, {"xfer_id": p.xfer, "error": f"prefill ended with {request.status.name}"}
        self._pending_finish.append(FinishSpec(request.request_id, p.xfer, p.addr,
                                               request.num_computed_tokens, p.digest))
        self._unacked.add(request.request_id)
        self._sending[request.request_id] = p.xfer   # the id stays in use until the worker is done
        return True, {"do_remote_prefill": True, "do_remote_decode": False, "xfer_id": p.xfer,
                      "num_tokens": request.num_computed_tokens, "prompt_digest": p.digest}

    def _release_xfer(self, xfer: str, req_id: str) -> None:
        if self._xfers.get(xfer) == req_id:
            del self._xfers[xfer]

    def has_pending_push_work(self) -> bool:
        return bool(self._unacked or self._pending_finish)

    def update_connector_output(self, connector_output) -> None:
        for req_id in connector_output.finished_sending or ():
            self._unacked.discard(req_id)
            xfer = self._sending.pop(req_id, None)
            if xfer is not None:
                self._release_xfer(xfer, req_id)
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, ProServeWorkerMetadata):
            return
        now = time.monotonic()
        for dest, (open_s, err) in meta.dests.items():
            if open_s > 0:
                self._dest_open[dest] = (now + open_s, err)
            else:
                self._dest_open.pop(dest, None)
        for xfer, (dest, err) in meta.failed.items():
            p = self._params.get(self._xfers.get(xfer, ""))
            if p is not None and p.role == "produce" and not p.failed:
                # still being prefilled: stop sending; its response reports the failure
                p.failed = f"KV transfer to {dest} failed: {err}"

    # ================================== worker side =====================================
    def register_kv_caches(self, kv_caches: "dict[str, torch.Tensor | tuple]"):
        self._kv_caches = kv_caches
        num_blocks = self._kv_cache_config.num_blocks if self._kv_cache_config else None
        # one tensor per layer ([blocks, ...] on CPU, FlashInfer, MLA; [2, blocks, ...] for
        # FlashAttention) or vllm-ascend's (k, v) tuple: the wire numbers the tensors
        table = flatten_caches(kv_caches, num_blocks)
        caches = table.tensors
        self._layer_index = table.first
        self._block_dim = table.block_dim
        self.tp_rank = _tp_rank() if self.tp_size > 1 else 0
        self.layout = layout_of(caches, self._block_dim, self.block_size, self.tp_size, self.tp_rank, table.parts)
        if self.is_producer:
            self._start_pusher()
        elif self._receiver is None:
            self._start_receiver(caches)

    def _new_sender(self, addr: str) -> KVSender:
        """A sender to ``addr``'s receiver of this rank (the pusher's thread calls it)."""
        curve = ClientKeys.load(self.keys_dir) if self.keys_dir else None
        return KVSender(rank_address(addr, self.tp_rank), timeout=self.timeout_s,
                        connect_timeout=self.connect_timeout_s, curve=curve, allow_insecure_remote=self.insecure,
                        layout=self.layout.encode())

    def _start_pusher(self) -> None:
        cfg = self._kv_transfer_config
        dump = self._dumper()
        self._pusher = unpinned(lambda: KVPusher(
            self._new_sender, timeout_s=self.timeout_s,
            max_staged_bytes=int(_extra(cfg, "max_staged_mib", 512.0) * MIB),
            on_sent=self.metrics.sent, on_failed=self._count_failure, dump=dump,
            name=f"kvpusher-r{self.tp_rank}"))

    def _ranked(self, err: str) -> str:
        """An error as the scheduler side reports it: which rank, when there are several."""
        return f"rank {self.tp_rank}: {err}" if self.tp_size > 1 and err else err

    def _dumper(self):
        """Test hook (``debug_dump_dir``): raw bytes of what is sent / loaded, rank r > 0 under
        ``DIR.r<r>``."""
        if not self.debug_dir:
            return None
        root = rank_path(self.debug_dir, self.tp_rank)
        return lambda xfer, name, t: _dump(root, xfer, name, t)

    def _count_failure(self, addr: str, e: BaseException) -> None:
        self.metrics.send_failed(addr, "destination_unavailable" if isinstance(e, DestinationUnavailable)
                                 else type(e).__name__)

    def _start_receiver(self, caches: list) -> None:
        cfg = self._kv_transfer_config
        curve = ServerKeys.load(self.keys_dir) if self.keys_dir else None
        heartbeat = cfg.get_from_extra_config("heartbeat_path", None) or None
        given = {k: (None if cfg.get_from_extra_config(k, None) is None else _extra(cfg, k, 0.0))
                 for k in ("max_peer_mib", "max_held_mib")}
        per_token = bytes_per_token(caches, self._block_dim, self.block_size)
        caps = receiver_caps(per_token, self._max_model_len, given,
                             _extra(cfg, "prefill_peers", EXPECTED_PREFILL_PEERS, int))
        listen = rank_address(self.listen, self.tp_rank)
        kw = dict(curve=curve, allow_insecure=self.insecure,
                  heartbeat_path=rank_path(heartbeat, self.tp_rank) if heartbeat else None,
                  check_layout=check_sender(self.layout),
                  # /kv/status shows the layout a sender must match, and the caps in force
                  info={"layout": self.layout.encode(), "tp_rank": self.tp_rank,
                        "caps_mib": {k: round(v, 1) for k, v in caps.items()}},
                  max_open_transfers=_extra(cfg, "max_open_transfers", 1024, int),
                  max_held_bytes=int(caps["max_held_mib"] * MIB),
                  max_peer_bytes=int(caps["max_peer_mib"] * MIB),
                  max_message_bytes=int(_extra(cfg, "max_message_mib", 64.0) * MIB),
                  result_ttl_s=_extra(cfg, "result_ttl_s", max(120.0, 2 * self.timeout_s)),
                  # a long prompt's chunks can come far apart on a busy prefill engine
                  stale_after_s=_extra(cfg, "stale_after_s", max(120.0, 4 * self.timeout_s)),
                  name=f"kvreceiver-r{self.tp_rank}")
        self._receiver = unpinned(lambda: KVReceiver(listen, **kw))
        dump = self._dumper()
        self._loader = unpinned(lambda: KVLoader(caches, self._block_dim, self.debug_corrupt, dump,
                                                  name=f"kvloader-r{self.tp_rank}"))
        log.info("ProServe KV receiver of rank %d/%d listening on %s (%s); caps: %.0f MiB per peer, %.0f MiB in "
                 "all (the longest prompt, %d tokens, is %.0f MiB of this rank's KV)", self.tp_rank, self.tp_size,
                 listen, "CURVE" if curve else "no authentication: loopback only", caps["max_peer_mib"],
                 caps["max_held_mib"], self._max_model_len, caps["longest_prompt_mib"])

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # vLLM calls this before every forward pass (both model runners): the forward
        # stream waits, on the device, for the KV copies of the steps before, so that a
        # block freed after its transfer (finished, failed or preempted) is never
        # overwritten while a copy may still read it
        if self._pusher is not None:
            self._pusher.order_forward_after_copies()

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor | tuple", attn_metadata, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, ProServeConnectorMetadata) or not meta.saves or self._pusher is None:
            return
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        # a request's prompt may be computed over several steps (chunked prefill), so the
        # same layer is sent once per step: (step, layer) names the piece on the wire; the
        # blocks sent are logical indices in the request
        saves = [Save(s.xfer, s.addr, s.block_ids, s.first_block) for s in meta.saves]
        for i, part in enumerate(cache_parts(kv_layer)):     # (k, v) on vllm-ascend
            self._pusher.save_layer(layer + i, part, self._block_dim, saves, self._step)

    def wait_for_save(self):
        # nothing waits here: the pusher's thread sends what save_kv_layer staged
        meta = self._get_connector_metadata()
        if isinstance(meta, ProServeConnectorMetadata):
            self._apply_step(meta)

    def _apply_step(self, meta: ProServeConnectorMetadata) -> None:
        """The step's bookkeeping, once per step: flush what its layers staged, then its
        finishes, aborts, discards and loads. Runs from ``wait_for_save``, after the forward
        pass; a step without one (nothing scheduled) runs it from ``get_finished``, since
        vLLM 0.23/0.27 do not call ``wait_for_save`` on such steps (0.32+ do)."""
        if self._applied is meta:
            return
        self._applied = meta
        pusher = self._pusher
        if meta.saves and pusher is not None:
            self._step += 1
            # small layers were packed: send this step's pack now, while the next step runs
            for xfer, addr in dict.fromkeys((s.xfer, s.addr) for s in meta.saves):
                pusher.flush(xfer, addr)
        for f in meta.finishes:
            if pusher is None or pusher.is_failed(f.xfer):
                self._done_sending.add(f.req_id)   # nothing to wait for: vLLM may free the blocks
                continue
            pusher.finish(f.xfer, f.addr, f.digest)   # "done" after its layers; the ack comes back later
            self._finishing[f.xfer] = f.req_id
        for xfer, addr in meta.aborts:
            if pusher is not None:
                pusher.abort(xfer, addr, "the prefill request did not finish")
        for xfer in meta.discards:
            if self._receiver is not None:
                self._receiver.discard(xfer)
        now = time.monotonic()
        for ld in meta.loads:
            self._loads[ld.req_id] = (ld, now + self.timeout_s)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return (r.finished_sending or None), (r.finished_recving or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        meta = self._connector_metadata
        if isinstance(meta, ProServeConnectorMetadata) and meta.idle:
            self._apply_step(meta)       # no forward pass: vLLM 0.23/0.27 skipped wait_for_save
        self._let_threads_run()
        if self._pusher is not None:
            for xfer, (dest, err) in self._pusher.failures().items():
                self._meta_failed[xfer] = (dest, self._ranked(err))
            for xfer, _error in self._pusher.outcomes().items():
                req_id = self._finishing.pop(xfer, None)
                if req_id is not None:
                    self._done_sending.add(req_id)   # acked or failed: vLLM may free the blocks
        sending, self._done_sending = self._done_sending, set()
        recving: set[str] = set()
        failed: set[str] = set()
        if self._loads:
            self._check_arrivals(recving, failed)
        if self._loader is not None and self._loading:
            for req_id, (error, reason, nbytes) in self._loader.done().items():
                ld = self._loading.pop(req_id, None)
                if ld is None:
                    continue
                if error is None:
                    self.metrics.received(nbytes)
                else:
                    self._load_failed(ld, error, reason, failed)
                recving.add(req_id)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def _let_threads_run(self) -> None:
        """A step that computes nothing (the engine keeps stepping only because KV is
        being pushed or awaited) blocks here, the interpreter released, until the
        connector's threads have made progress, at most IDLE_WAIT_S. Without it the
        worker's loop -- this step, then vLLM's busy wait for the next one, which
        releases and retakes the interpreter around every sched_yield -- can starve
        the receiver, pusher and loader threads of it for many seconds on a loaded
        host. A step with work does not wait: its kernels release the interpreter."""
        meta = self._connector_metadata
        if not isinstance(meta, ProServeConnectorMetadata) or not meta.idle:
            return
        if self._pusher is not None and self._pusher.busy():
            self._pusher.wait_progress(IDLE_WAIT_S)
        elif self._loading and self._loader is not None:
            self._loader.wait_any(IDLE_WAIT_S)
        elif self._loads and self._receiver is not None:
            self._receiver.wait_any([ld.xfer for ld, _ in self._loads.values()], IDLE_WAIT_S)

    def _check_arrivals(self, recving: set[str], failed: set[str]) -> None:
        """Hand the transfers that arrived whole to the loader; fail those that failed on
        the wire or did not arrive in time. Never waits."""
        now = time.monotonic()
        rx, loader = self._receiver, self._loader
        for req_id, (ld, deadline) in list(self._loads.items()):
            result = rx.take(ld.xfer) if rx is not None else None
            if result is not None and result.ok and loader is not None and loader.alive:
                loader.submit(req_id, ld.xfer, ld.digest, ld.block_ids, ld.skip_blocks, result)
                self._loading[req_id] = ld
                del self._loads[req_id]
                continue
            if result is not None and result.ok:
                why, reason = "the KV loader is not running", "inject_error"
            elif result is not None:
                why, reason = result.error, "transfer_failed"
            elif now > deadline or rx is None or not rx.alive:
                why = f"no KV within {self.timeout_s:g} s" if rx is not None and rx.alive else \
                    "the KV receiver is not running"
                reason = "timeout"
                if rx is not None:
                    rx.discard(ld.xfer)
            else:
                continue
            self._load_failed(ld, why, reason, failed)
            del self._loads[req_id]
            recving.add(req_id)

    def _load_failed(self, ld: LoadSpec, why: str, reason: str, failed: set[str]) -> None:
        log.error("KV transfer %s failed (%s); the decode engine %s", ld.xfer, why,
                  "recomputes the prompt" if self._kv_transfer_config.kv_load_failure_policy
                  == "recompute" else "fails the request")
        self.metrics.load_failed(reason)
        failed.add(ld.req_id)
        if not REPORTS_FAILED_RECVING:
            self._error_blocks.update(ld.block_ids[ld.skip_blocks:])

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self.is_producer or self._pusher is None:
            return None
        meta = ProServeWorkerMetadata(failed=self._meta_failed)
        self._meta_failed = {}
        now = time.monotonic()
        for addr, st in self._pusher.destinations().items():
            ok = st["state"] == "closed"
            # told again when the breaker re-opens (a failed half-open probe): a new open_until.
            # While it is open, told every step: vLLM merges only the ranks that report in a
            # step, so a rank that recovers must never be the only voice about a destination
            # another rank still refuses (aggregate keeps the longest cool-down)
            told = None if ok else st["open_until"]
            still_open = not ok and st["open_until"] > now
            changed = self._dest_reported.get(addr) != told
            if changed or still_open:
                self._dest_reported[addr] = told
                meta.dests[addr] = (0.0 if ok else max(0.0, st["open_until"] - now),
                                    self._ranked(st.get("last_error") or ""))
                if changed:
                    self.metrics.destination(addr, ok)
        return meta if (meta.failed or meta.dests) else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        # vLLM 0.32+: failures are reported per request (failed_recving). Older vLLMs ask for
        # the blocks a failed load left unwritten, right after get_finished
        out, self._error_blocks = self._error_blocks, set()
        return out

    def shutdown(self):
        if self._pusher is not None:
            self._pusher.close()
        if self._loader is not None:
            self._loader.close()
        if self._receiver is not None:
            self._receiver.close()


def _tp_rank() -> int:
    """This worker's tensor-parallel rank (vLLM's process groups, set up before the
    KV caches are registered; NixlConnector reads it the same way)."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
    return get_tensor_model_parallel_rank()


def _dump(root: str, xfer: str, name: str, t: torch.Tensor) -> None:
    """Test hook: raw bytes of ``t`` (block-major) to ``root/xfer/name.bin``."""
    d = os.path.join(root, xfer)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name + ".bin"), "wb") as f:
        f.write(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())

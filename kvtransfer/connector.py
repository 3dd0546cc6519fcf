"""ProServe's vLLM KV connector: push KV blocks from a prefill engine to a decode
engine over the ZeroMQ transport (:mod:`kvtransfer.transport`).

Loaded without patching vLLM::

    kv_transfer_config = {
        "kv_connector": "ProServeConnector",
        "kv_connector_module_path": "kvtransfer.connector",
        "kv_role": "kv_producer" | "kv_consumer",
        "kv_load_failure_policy": "recompute",       # decode falls back to recomputing
        "kv_connector_extra_config": {
            "listen": "tcp://127.0.0.1:15600",       # consumer: where KV is received
            "timeout_s": 30,                          # every wait is bounded
        },
    }

Protocol, per request, keyed by a transfer id the *caller* issues (never the
engine's internal request id, which vLLM suffixes per engine):

1. The caller sends the prompt to a prefill engine with ``max_tokens=1`` and
   ``kv_transfer_params = {"do_remote_decode": true, "xfer_id": X,
   "remote_addr": <decode engine's listen address>}``.
2. Producer: every step, after each attention layer, ``save_kv_layer`` pushes
   the blocks that step wrote for the request (pipelined per layer and per
   prefill chunk). When the request finishes, ``request_finished`` keeps its
   blocks and the worker sends "done" and waits (in the background, bounded)
   for the consumer's ack; only then does ``get_finished`` report the request
   so vLLM frees the blocks. A missing ack (decode dead) frees them too after
   ``timeout_s``, with an error logged.
3. The caller sends the same prompt to the decode engine with
   ``kv_transfer_params = {"do_remote_prefill": true, "xfer_id": X}``.
   Consumer: ``get_num_new_matched_tokens`` claims the prompt as loaded
   asynchronously; once transfer X is complete in the receiver, the worker
   copies it into the blocks vLLM allocated and reports the request; vLLM
   recomputes only the last prompt token to sample the next one. KV that
   never arrives within ``timeout_s`` is reported as a load error: with
   ``kv_load_failure_policy="recompute"`` vLLM recomputes the prompt locally.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from .receiver import KVReceiver
from .sender import KVSender

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


class TransferParamsError(ValueError):
    pass


def parse_params(params: dict | None) -> dict | None:
    """Validate the ProServe fields of ``kv_transfer_params``; return them or None."""
    if not params:
        return None
    out = {}
    if params.get("do_remote_decode"):
        out["role"] = "produce"
        addr = params.get("remote_addr")
        if not isinstance(addr, str) or not ADDR_RE.match(addr):
            raise TransferParamsError(f"kv_transfer_params.remote_addr must be tcp://host:port or "
                                      f"ipc://path, got {addr!r}")
        out["addr"] = addr
    elif params.get("do_remote_prefill"):
        out["role"] = "consume"
    else:
        return None
    xfer = params.get("xfer_id")
    if not isinstance(xfer, str) or not XFER_ID_RE.match(xfer):
        raise TransferParamsError(f"kv_transfer_params.xfer_id must be 1-128 characters of "
                                  f"[A-Za-z0-9._:-], got {xfer!r}")
    out["xfer"] = xfer
    return out


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


@dataclass
class LoadSpec:
    req_id: str
    xfer: str
    block_ids: list[int]      # physical destination blocks, logical index 0..
    skip_blocks: int          # leading blocks already computed locally (prefix cache)


@dataclass
class ProServeConnectorMetadata(KVConnectorMetadata):
    saves: list[SaveSpec] = field(default_factory=list)
    finishes: list[FinishSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    discards: list[str] = field(default_factory=list)  # consumer: transfers no request will load


class ProServeConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        self.block_size = vllm_config.cache_config.block_size
        self.is_producer = cfg.is_kv_producer
        self.timeout_s = float(cfg.get_from_extra_config("timeout_s", 30.0))
        self.listen = cfg.get_from_extra_config("listen", f"tcp://127.0.0.1:{cfg.kv_port}")
        # test hooks: dump what was sent / injected, or corrupt what is injected
        self.debug_dir = cfg.get_from_extra_config("debug_dump_dir", None)
        self.debug_corrupt = cfg.get_from_extra_config("debug_corrupt", None)  # None | "flip" | "swap"
        # scheduler side
        self._params: dict[str, dict] = {}             # req_id -> parsed params
        self._blocks: dict[str, list[int]] = {}        # producer: physical blocks per request
        self._pending_finish: list[FinishSpec] = []
        self._unacked: set[str] = set()
        self._pending_load: list[LoadSpec] = []
        self._pending_discard: list[str] = []
        # worker side
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layer_index: dict[str, int] = {}
        self._block_dim = 0
        self._senders: dict[str, KVSender] = {}
        self._receiver: KVReceiver | None = None
        self._done_sending: set[str] = set()
        self._finishing: dict[str, tuple[str, str]] = {}  # xfer -> (req_id, addr), awaiting ack
        self._step = 0                                  # producer: steps with saves, orders chunks
        self._loads: dict[str, tuple[LoadSpec, float]] = {}
        self._load_errors: set[int] = set()
        self.stats = {"sent_bytes": 0, "received_xfers": 0, "failed_sends": 0, "failed_loads": 0}

    # ================================ scheduler side ===================================
    def on_new_request(self, request: "Request") -> None:
        try:
            p = parse_params(request.kv_transfer_params)
        except TransferParamsError as e:
            log.error("request %s: %s; served without KV transfer", request.request_id, e)
            self._params[request.request_id] = {"role": "invalid", "error": str(e)}
            return
        if p is None:
            return
        if p["role"] == "produce" and not self.is_producer:
            log.error("request %s asks a consumer engine to produce KV; ignored", request.request_id)
            return
        self._params[request.request_id] = p

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int):
        p = self._params.get(request.request_id)
        if p is None or p["role"] != "consume" or p.get("claimed"):
            return 0, False
        count = len(request.prompt_token_ids or []) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        p = self._params.get(request.request_id)
        if p is None or p["role"] != "consume" or p.get("claimed") or num_external_tokens <= 0:
            return
        p["claimed"] = True
        block_ids = list(blocks.get_block_ids()[0])
        skip = request.num_computed_tokens // self.block_size
        self._pending_load.append(LoadSpec(request.request_id, p["xfer"], block_ids, skip))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = ProServeConnectorMetadata(finishes=self._pending_finish, loads=self._pending_load,
                                         discards=self._pending_discard)
        self._pending_finish, self._pending_load, self._pending_discard = [], [], []
        if not self.is_producer:
            return meta
        bs = self.block_size
        n_sched = scheduler_output.num_scheduled_tokens

        def add_save(req_id: str, computed: int) -> None:
            p = self._params.get(req_id)
            if p is None or p["role"] != "produce":
                return
            n = n_sched.get(req_id, 0)
            if n <= 0:
                return
            first, last = computed // bs, (computed + n - 1) // bs
            blocks = self._blocks[req_id][first:last + 1]
            meta.saves.append(SaveSpec(req_id, p["xfer"], p["addr"], blocks, first))

        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self._params:
                self._blocks[new.req_id] = list(new.block_ids[0])
                add_save(new.req_id, new.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id not in self._params:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self._blocks[req_id] = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                self._blocks[req_id].extend(new_blocks[0])
            add_save(req_id, cached.num_computed_tokens[i])
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        p = self._params.pop(request.request_id, None)
        self._blocks.pop(request.request_id, None)
        if p is not None and p["role"] == "consume" and not p.get("claimed"):
            # nothing was loaded (e.g. a one-token prompt, which vLLM computes itself):
            # drop the transfer from the receiver instead of holding it until its TTL
            self._pending_discard.append(p["xfer"])
        if p is not None and p["role"] == "invalid":
            return False, {"error": p["error"]}
        if p is None or p["role"] != "produce":
            return False, None
        from vllm.v1.request import RequestStatus
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, {"xfer_id": p["xfer"], "error": f"prefill ended with {request.status.name}"}
        self._pending_finish.append(FinishSpec(request.request_id, p["xfer"], p["addr"], request.num_computed_tokens))
        self._unacked.add(request.request_id)
        return True, {"do_remote_prefill": True, "do_remote_decode": False, "xfer_id": p["xfer"],
                      "num_tokens": request.num_computed_tokens}

    def has_pending_push_work(self) -> bool:
        return bool(self._unacked or self._pending_finish)

    def update_connector_output(self, connector_output) -> None:
        for req_id in connector_output.finished_sending or ():
            self._unacked.discard(req_id)

    # ================================== worker side =====================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._kv_caches = kv_caches
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        num_blocks = self._kv_cache_config.num_blocks if self._kv_cache_config else None
        first = next(iter(kv_caches.values()))
        # block dimension: 0 on CPU ([blocks, heads, block_size, 2*head]), 1 on CUDA ([2, blocks, ...])
        self._block_dim = 0 if num_blocks is None or first.shape[0] == num_blocks else 1
        if not self.is_producer and self._receiver is None:
            # vLLM's CPU worker pins its main thread to one core and busy-polls there; a
            # thread started from it would inherit that pin and starve. Start the
            # receiver thread with every core allowed, then restore the pin.
            pinned = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
            try:
                if pinned is not None:
                    os.sched_setaffinity(0, range(os.cpu_count() or 1))
                self._receiver = KVReceiver(self.listen)
            finally:
                if pinned is not None:
                    os.sched_setaffinity(0, pinned)
            log.info("ProServe KV receiver listening on %s", self.listen)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def _sender(self, addr: str) -> KVSender:
        s = self._senders.get(addr)
        if s is None:
            s = self._senders[addr] = KVSender(addr, timeout=self.timeout_s)
        return s

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, ProServeConnectorMetadata) or not meta.saves:
            return
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        # a request's prompt may be computed over several steps (chunked prefill), so the
        # same layer is sent once per step: the wire "layer" is step·L + layer, which keeps
        # the pieces distinct and ordered; the blocks sent are logical indices in the request
        wire_layer = self._step * len(self._layer_index) + layer
        for s in meta.saves:
            idx = torch.tensor(s.block_ids, dtype=torch.long, device=kv_layer.device)
            data = kv_layer.index_select(self._block_dim, idx)
            if self._block_dim != 0:
                data = data.movedim(self._block_dim, 0)
            data = data.contiguous()
            if self.debug_dir:
                _dump(self.debug_dir, s.xfer, f"sent_l{layer}_b{s.first_block}_n{data.shape[0]}", data)
            try:
                self._sender(s.addr).send_layer(s.xfer, wire_layer,
                                                list(range(s.first_block, s.first_block + data.shape[0])), data)
                self.stats["sent_bytes"] += data.numel() * data.element_size()
            except Exception as e:  # a dead peer must not take the engine down
                log.error("KV transfer %s: sending layer %d failed: %s", s.xfer, layer, e)

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        if not isinstance(meta, ProServeConnectorMetadata):
            return
        if meta.saves:
            self._step += 1
        for f in meta.finishes:
            # "done" now; the ack is collected by get_finished (no extra thread)
            try:
                self._sender(f.addr).finish_async(f.xfer, timeout=self.timeout_s)
                self._finishing[f.xfer] = (f.req_id, f.addr)
            except Exception as e:
                self._send_failed(f.xfer, f.addr, e)
                self._done_sending.add(f.req_id)
        for xfer in meta.discards:
            if self._receiver is not None:
                self._receiver.discard(xfer)
        now = time.monotonic()
        for ld in meta.loads:
            self._loads[ld.req_id] = (ld, now + self.timeout_s)

    def _send_failed(self, xfer: str, addr: str, e: Exception) -> None:
        self.stats["failed_sends"] += 1
        log.error("KV transfer %s to %s failed: %s; freeing its blocks", xfer, addr, e)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._finishing:
            for sender in self._senders.values():
                for xfer, outcome in sender.poll_finished().items():
                    entry = self._finishing.pop(xfer, None)
                    if entry is None:
                        continue
                    if isinstance(outcome, Exception):
                        self._send_failed(xfer, entry[1], outcome)
                    self._done_sending.add(entry[0])   # acked or failed: vLLM may free the blocks
        sending, self._done_sending = self._done_sending, set()
        recving: set[str] = set()
        if self._loads:
            # the engine steps back to back while a request waits for its KV; give the
            # receiver thread the interpreter for a moment so it can take the data in
            time.sleep(0.002)
            now = time.monotonic()
            for req_id, (ld, deadline) in list(self._loads.items()):
                result = self._receiver.wait(ld.xfer, timeout=0) if self._receiver.ready(ld.xfer) else None
                if result is not None and result.ok:
                    self._inject(ld, result)
                    self.stats["received_xfers"] += 1
                elif (result is not None and not result.ok) or now > deadline:
                    why = result.error if result is not None else f"no KV within {self.timeout_s:g} s"
                    log.error("KV transfer %s failed (%s); the decode engine recomputes the prompt", ld.xfer, why)
                    self.stats["failed_loads"] += 1
                    self._load_errors.update(ld.block_ids[ld.skip_blocks:])
                    if result is None:
                        self._receiver.discard(ld.xfer)
                else:
                    continue
                del self._loads[req_id]
                recving.add(req_id)
        return (sending or None), (recving or None)

    def _inject(self, ld: LoadSpec, result) -> None:
        """Copy received blocks into the paged cache at the blocks vLLM allocated."""
        names = list(self._kv_caches)
        L = len(names)
        chunks = []
        for wire_layer in sorted(result.layers):        # step order: later pieces win
            ld_ = result.layers[wire_layer]
            blocks = ld_.blocks
            chunks.append((wire_layer % L, blocks[0], ld_.tensor().reshape(len(blocks), *ld_.shape[1:])))
        if self.debug_corrupt and chunks:
            chunks[0] = _corrupt(chunks[0], self.debug_corrupt)
        for layer, first_block, data in chunks:
            dst = self._kv_caches[names[layer]]
            n = data.shape[0]
            lo = max(first_block, ld.skip_blocks)
            hi = min(first_block + n, len(ld.block_ids))
            if lo >= hi:
                continue
            src = data[lo - first_block:hi - first_block].to(dst.device)
            idx = torch.tensor(ld.block_ids[lo:hi], dtype=torch.long, device=dst.device)
            if self._block_dim != 0:
                src = src.movedim(0, self._block_dim)
            dst.index_copy_(self._block_dim, idx, src)
        if self.debug_dir:
            for layer, name in enumerate(names):
                dst = self._kv_caches[name]
                idx = torch.tensor(ld.block_ids[ld.skip_blocks:], dtype=torch.long, device=dst.device)
                got = dst.index_select(self._block_dim, idx)
                if self._block_dim != 0:
                    got = got.movedim(self._block_dim, 0)
                _dump(self.debug_dir, ld.xfer, f"recv_l{layer}_b{ld.skip_blocks}_n{len(idx)}", got.contiguous())

    def get_block_ids_with_load_errors(self) -> set[int]:
        errs, self._load_errors = self._load_errors, set()
        return errs

    def shutdown(self):
        for s in self._senders.values():
            s.close()
        if self._receiver is not None:
            self._receiver.close()


def _dump(root: str, xfer: str, name: str, t: torch.Tensor) -> None:
    """Test hook: raw bytes of ``t`` (block-major) to ``root/xfer/name.bin``."""
    import os
    d = os.path.join(root, xfer)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name + ".bin"), "wb") as f:
        f.write(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())


def _corrupt(chunk, how: str):
    """Test hook: swap the first two blocks ("swap"), or negate every value of the
    first block ("flip")."""
    layer, first_block, data = chunk
    data = data.clone()
    if how == "swap" and data.shape[0] >= 2:
        data[[0, 1]] = data[[1, 0]]
    else:
        data[0] = -data[0]
    return layer, first_block, data

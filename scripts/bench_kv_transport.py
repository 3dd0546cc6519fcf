#!/usr/bin/env python3
"""KV transport throughput beside raw ZeroMQ, across processes.

A sender process and a receiver process (multiprocessing, spawn). For each
transport (tcp loopback, ipc) and KV payload per request (1 MB, 16 MB, 256 MB by
default) it measures, alternating within the same processes and run (so machine
noise hits all columns alike):

* ``raw``: ZeroMQ PUSH/PULL, zero-copy send and receive, of the very same bytes
  (the layer arrays), one message per layer (layers larger than
  ``--chunk-bytes`` cut into messages of that size), ended by one confirmation
  message back from the receiver: what pushing each layer as it is computed
  costs without a transport;
* ``raw/req``: the same bytes as PUSH/PULL messages of the whole request size
  (1 message = 1 request: what "16 MB messages" would mean without a transport);
* ``kv``: ``kvtransfer`` -- each request sent as ``--layers`` layers
  (``send_layer``: layers of at most ``--pack-layer-bytes`` are packed into
  messages of up to ``--pack-bytes``, larger ones chunked to
  ``--chunk-bytes``), closed with ``finish_async``, acks collected with
  ``poll_finished`` (how the connector uses it: the forward pass never waits
  on an ack); the receiver hands every part to an ``on_chunk`` callback
  (which, like the raw receiver, does nothing with it) and its main thread
  ``wait``s for every request. With the defaults, a 1 MB request of 32
  layers goes out as one message (the ``raw`` column sends 32), a 16 MB one
  as 32 (512 KB layers are not packed);
* ``kv sync``: the same with a blocking ``finish`` per request (the pipeline
  drains and an ack round trip is paid for every request);
* ``kv acc``: like ``kv``, but the receiver accumulates the chunks and ``wait``
  hands them over (then they are dropped): this one pays for fresh memory on the
  receiver (page faults), which the raw receiver, freeing each message, doesn't;
* ``kv curve`` (with ``--curve``): like ``kv``, over a CURVE-encrypted and
  authenticated connection (``KVReceiver(curve=ServerKeys)``,
  ``KVSender(curve=ClientKeys)``, keys generated for the run): the cost of
  encryption, measured in the same run as the rest.

Each timing runs from the sender's first send to the last confirmation it
receives; every cell is the median of ``--reps`` repetitions (after one warm-up);
ratios are against ``raw``: the median over repetitions of raw time / kv time
of the same repetition; ``kv/req`` is ``kv`` against ``raw/req`` likewise.
Target: ``kv`` >= 80 % of raw at 1 MB and at 16 MB and above. ``--pack-bytes
0`` measures the transport without packing.

    python scripts/bench_kv_transport.py [--reps 5] [--sizes-mb 1 16 256] [--transports tcp ipc] [--curve]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MB = 1 << 20


def _plan(size: int, layers: int, chunk: int, min_total: int) -> dict:
    layer_bytes = size // layers
    msg = min(layer_bytes, chunk)
    msgs_per_layer = -(-layer_bytes // chunk)
    requests = max(1, min_total // size)
    return dict(size=size, layers=layers, layer_bytes=layer_bytes, msg=msg,
                msgs=requests * layers * msgs_per_layer, requests=requests,
                total=requests * layers * layer_bytes)


MODES = ["raw", "rawreq", "kv", "sync", "acc"]
CURVE_MODE = "curve"


def _modes(modes: list[str], reps: int) -> list[str]:
    return modes * (reps + 1)  # the first round is the warm-up


def receiver_main(addrs: dict, plan: dict, reps: int, credit: int, modes: list[str], keys: str | None, q) -> None:
    import zmq

    from proserve.kvtransfer.transport import KVReceiver, ServerKeys
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(addrs["raw"])
    back = ctx.socket(zmq.PUSH)
    back.connect(addrs["raw_ack"])
    rx = KVReceiver(addrs["kv"], credit_bytes=credit, ctx=ctx, on_chunk=lambda *chunk: None)
    rx_acc = KVReceiver(addrs["kv_acc"], credit_bytes=credit, ctx=ctx)
    # CURVE needs the receiver's own context (ZAP is per context)
    rx_curve = (KVReceiver(addrs["kv_curve"], credit_bytes=credit, on_chunk=lambda *chunk: None,
                           curve=ServerKeys.load(keys)) if keys else None)
    q.put("ready")
    for i, mode in enumerate(_modes(modes, reps)):
        if mode in ("raw", "rawreq"):
            for _ in range(plan["msgs"] if mode == "raw" else plan["requests"]):
                pull.recv(copy=False)
            back.send(b"ok")
        else:
            r_ = {"acc": rx_acc, CURVE_MODE: rx_curve}.get(mode, rx)
            for r in range(plan["requests"]):
                res = r_.wait(f"{mode}-{i}-{r}", timeout=120)
                assert res.ok and res.nbytes == plan["layers"] * plan["layer_bytes"], res.error
                del res
    q.put({"kv": rx.stats.snapshot(), "acc": rx_acc.stats.snapshot(),
           "curve": rx_curve.stats.snapshot() if rx_curve else {"rejected_total": 0}})
    rx.close()
    rx_acc.close()
    if rx_curve:
        rx_curve.close()
    pull.close(0)
    back.close(0)
    ctx.term()


def sender_main(addrs: dict, plan: dict, reps: int, chunk: int, pack: dict, modes: list[str], keys: str | None,
                q) -> None:
    import numpy as np
    import zmq

    from proserve.kvtransfer.transport import ClientKeys, KVSender
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(addrs["raw"])
    back = ctx.socket(zmq.PULL)
    back.bind(addrs["raw_ack"])
    tx = KVSender(addrs["kv"], chunk_bytes=chunk, timeout=120, ctx=ctx, **pack)
    tx_curve = (KVSender(addrs["kv_curve"], chunk_bytes=chunk, timeout=120, ctx=ctx, curve=ClientKeys.load(keys),
                         **pack) if keys else None)
    # the "KV cache": one fp16 array per layer, [blocks, 2, 16, 8, 128]-like rows
    row = 2 * 16 * 8 * 128 * 2
    lb = plan["layer_bytes"]
    if lb % row == 0:
        kv = [np.random.default_rng(l).integers(0, 255, lb, dtype=np.uint8).view(np.float16)
              .reshape(lb // row, 2, 16, 8, 128) for l in range(plan["layers"])]
    else:
        kv = [np.random.default_rng(l).integers(0, 255, lb, dtype=np.uint8) for l in range(plan["layers"])]
    # raw ZeroMQ sends the very same bytes (the layer arrays) cut into the same message sizes
    raw_msgs = []
    for a in kv:
        flat = memoryview(a.reshape(-1).view(np.uint8))
        raw_msgs += [flat[o:o + plan["msg"]] for o in range(0, flat.nbytes, plan["msg"])]
    assert len(raw_msgs) * plan["requests"] == plan["msgs"]
    whole = np.concatenate([a.reshape(-1).view(np.uint8) for a in kv])  # one request as one message
    times: dict[str, list[float]] = {m: [] for m in modes}
    tx.connect(addrs["kv"])
    tx.connect(addrs["kv_acc"])
    if tx_curve:
        tx_curve.connect()
    for i, mode in enumerate(_modes(modes, reps)):
        t0 = time.perf_counter()
        if mode == "raw":
            for _ in range(plan["requests"]):
                for m in raw_msgs:
                    push.send(m, copy=False)
            back.recv()
        elif mode == "rawreq":
            for _ in range(plan["requests"]):
                push.send(whole, copy=False)
            back.recv()
        else:
            dest = addrs["kv_acc"] if mode == "acc" else addrs["kv"]
            sender = tx_curve if mode == CURVE_MODE else tx
            if mode == CURVE_MODE:
                dest = None
            for r in range(plan["requests"]):
                x = f"{mode}-{i}-{r}"
                for l, a in enumerate(kv):
                    sender.send_layer(x, l, range(a.shape[0]) if a.ndim > 1 else [], a, dest=dest)
                if mode == "sync":
                    sender.finish(x, timeout=120)
                else:
                    sender.finish_async(x, timeout=120)
            if mode != "sync":
                pending = plan["requests"]
                while pending:
                    for x, out in sender.poll_finished().items():
                        if isinstance(out, Exception):
                            raise out
                        pending -= 1
                    if pending:
                        time.sleep(0.0002)
        dt = time.perf_counter() - t0
        if i >= len(modes):
            times[mode].append(dt)
    q.put((times, tx.stats.snapshot()))
    tx.close()
    if tx_curve:
        tx_curve.close()
    push.close(0)
    back.close(0)
    ctx.term()


def run_case(transport: str, size: int, args, tmp: str, modes: list[str], keys: str | None) -> dict:
    from proserve.kvtransfer.transport import free_port
    plan = _plan(size, args.layers, args.chunk_bytes, args.min_total_mb * MB)
    names = ("raw", "raw_ack", "kv", "kv_acc", "kv_curve")
    if transport == "tcp":
        addrs = {k: f"tcp://127.0.0.1:{free_port()}" for k in names}
    else:
        addrs = {k: f"ipc://{tmp}/{k}-{size}.sock" for k in names}
    spawn = mp.get_context("spawn")
    q_rx, q_tx = spawn.Queue(), spawn.Queue()
    rxp = spawn.Process(target=receiver_main, args=(addrs, plan, args.reps, args.credit_mb * MB, modes, keys, q_rx))
    rxp.start()
    assert q_rx.get(timeout=60) == "ready"
    pack = {"pack_bytes": args.pack_bytes, "pack_layer_bytes": args.pack_layer_bytes}
    txp = spawn.Process(target=sender_main, args=(addrs, plan, args.reps, args.chunk_bytes, pack, modes, keys, q_tx))
    txp.start()
    times, tx_stats = q_tx.get(timeout=1800)
    rx_stats = q_rx.get(timeout=60)
    txp.join(30)
    rxp.join(30)
    med = {k: statistics.median(v) for k, v in times.items()}
    gbs = {k: plan["total"] / v / 1e9 for k, v in med.items()}
    # ratio vs raw: median over repetitions of the paired ratio (raw and kv of the
    # same repetition ran back to back), robust to drifting machine load
    ratio = {k: statistics.median(r / t for r, t in zip(times["raw"], v)) for k, v in times.items()}
    ratio["kv/req"] = statistics.median(r / t for r, t in zip(times["rawreq"], times["kv"]))
    return dict(plan=plan, gbs=gbs, ratio=ratio, times=times, tx=tx_stats, rx=rx_stats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 16, 256])
    ap.add_argument("--transports", nargs="+", default=["tcp", "ipc"], choices=["tcp", "ipc"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=32, help="layers per request (default 32)")
    ap.add_argument("--chunk-bytes", type=int, default=None, help="kv chunk size (default: the transport's)")
    ap.add_argument("--chunk-mb", type=float, default=None)
    ap.add_argument("--credit-mb", type=int, default=None, help="receiver credit window (default: transport's)")
    ap.add_argument("--pack-bytes", type=int, default=None,
                    help="largest pack of small layers (default: the transport's, 1 MiB; 0: no packing)")
    ap.add_argument("--pack-layer-bytes", type=int, default=None,
                    help="layers up to this size are packed (default: the transport's, 64 KiB)")
    ap.add_argument("--min-total-mb", type=int, default=512,
                    help="bytes per repetition: requests are repeated up to this (default 512)")
    ap.add_argument("--curve", action="store_true",
                    help="also measure kvtransfer over CURVE (encrypted, authenticated) in the same run")
    args = ap.parse_args()
    from proserve.kvtransfer import transport as T
    if args.chunk_mb:
        args.chunk_bytes = int(args.chunk_mb * MB)
    args.chunk_bytes = args.chunk_bytes or T.DEFAULT_CHUNK_BYTES
    args.chunk_mb = None
    args.credit_mb = args.credit_mb or T.DEFAULT_CREDIT_BYTES // MB
    args.pack_bytes = T.DEFAULT_PACK_BYTES if args.pack_bytes is None else args.pack_bytes
    args.pack_layer_bytes = T.DEFAULT_PACK_LAYER_BYTES if args.pack_layer_bytes is None else args.pack_layer_bytes
    print(f"kvtransfer vs raw ZeroMQ PUSH/PULL; {os.cpu_count()} CPUs; chunk {args.chunk_bytes / MB:g} MiB, "
          f"credit {args.credit_mb} MiB, packs of {args.pack_bytes >> 10} KiB (layers <= "
          f"{args.pack_layer_bytes >> 10} KiB), {args.layers} layers/request, median of {args.reps} reps")
    modes = MODES + ([CURVE_MODE] if args.curve else [])
    hdr = (f"{'transport':9} {'request':>8} {'msg':>7} {'reqs':>5} {'raw GB/s':>8} {'raw/req':>7} "
           f"{'kv':>6} {'ratio':>6} {'kv/req':>6} {'kv sync':>7} {'ratio':>6} {'kv acc':>6} {'ratio':>6}"
           + (f" {'kv curve':>8} {'ratio':>6} {'vs kv':>6}" if args.curve else ""))
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvbench") as tmp:
        keys = None
        if args.curve:
            from proserve.kvtransfer.auth import generate_keys
            keys = os.path.join(tmp, "keys")
            generate_keys(keys)
        for transport in args.transports:
            for smb in args.sizes_mb:
                r = run_case(transport, int(smb * MB), args, tmp, modes, keys)
                p, g = r["plan"], r["gbs"]
                rows.append((transport, smb, p, g, r["ratio"], r["times"]))
                rejected = sum(r["rx"][k]["rejected_total"] for k in ("kv", "acc", "curve"))
                print(f"  ... {transport} {smb:g} MB: " + ", ".join(f"{m} {g[m]:.2f}" for m in modes) +
                      f" GB/s (rx rejected {rejected}, sender credit waits {r['tx']['credit_waits']})", flush=True)
    print()
    print(hdr)
    print("-" * len(hdr))
    ok = True
    for transport, smb, p, g, ra, times in rows:
        msg = f"{p['msg'] / MB:g}MB" if p["msg"] >= MB else f"{p['msg'] // 1024}KB"
        line = (f"{transport:9} {smb:>6g}MB {msg:>7} {p['requests']:>5} {g['raw']:>8.2f} {g['rawreq']:>7.2f} "
                f"{g['kv']:>6.2f} {ra['kv']:>6.0%} {ra['kv/req']:>6.0%} {g['sync']:>7.2f} {ra['sync']:>6.0%} "
                f"{g['acc']:>6.2f} {ra['acc']:>6.0%}")
        if args.curve:
            # CURVE vs plain kvtransfer: paired per repetition like the raw ratios
            vs_kv = statistics.median(k / c for k, c in zip(times["kv"], times[CURVE_MODE]))
            line += f" {g[CURVE_MODE]:>8.2f} {ra[CURVE_MODE]:>6.0%} {vs_kv:>6.0%}"
        print(line)
        if (smb == 1 or smb >= 16) and ra["kv"] < 0.8:
            ok = False
    print()
    print("target (kv >= 80% of raw ZeroMQ sending the same layers, at 1 MB and >= 16 MB):", "met" if ok else "NOT met")


if __name__ == "__main__":
    main()

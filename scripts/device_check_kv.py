#!/usr/bin/env python3
"""Checks ProServe's KV path on an accelerator: staging, strided caches, synchronisation.

The device code of the KV connector (``kvtransfer.pusher.KVPusher._copy_to_host``
and ``order_forward_after_copies`` on the producer; ``kvtransfer.loader.inject`` ->
``kvcache._write_device`` on the consumer) is written against torch's stream API
and otherwise only runs on CPU tensors through ``torch.cpu``'s stand-ins. This
script runs it on a GPU, with torch alone (no vLLM), in vLLM 0.32's cache
layouts: NHD ``[2, blocks, block_size, heads, head]`` (block axis 1) and HND as
vLLM exposes it, a strided view of ``[blocks, 2, heads, block_size, head]``
(block axis 0, non-contiguous); dtypes bfloat16 and float8_e4m3fn (compared as
bytes). Each check runs on its own; one failing does not stop the others.

1. producer staging sees the kernel's writes: on the forward stream a long
   kernel (``torch.cuda._sleep``), then a kernel writing known blocks; at once
   ``_copy_to_host`` (the forward thread's part of ``save_layer``): the host copy
   must equal the written bytes, and the call must return before the GPU got
   there (it does not block the host). Also: after ``order_forward_after_copies``
   the forward stream may overwrite the blocks (a freed block reused) while the
   side stream's copy still lags, and the copy still holds the old bytes.
2. the same with the synchronisation removed must fail: the side stream does
   not wait on the forward stream's event (resp. the forward stream does not
   wait for the copies): the copy must now be stale (resp. overwritten). This
   proves check 1 can fail; "warn" when the race did not show (after one retry
   with a longer sleep).
3. consumer writes bit-exact, blocks outside untouched: a real KVSender ->
   KVReceiver (tcp loopback) transfer of two layers over two prefill steps (a
   block re-sent by the later step), whole blocks and blocks split into rows,
   injected with ``skip`` = 1 into non-consecutive destination blocks, on a side
   stream delayed by ``_sleep``; also once through ``KVLoader``'s thread.
   Every written block must be bit-exact and every other block keep its sentinel.
4. consumer staging race must be caught: ``kvcache._release_stage`` swapped for
   one that overwrites the staging buffer at once instead of waiting for the
   copies: check 3's comparison must now fail ("warn" where it does not; the
   figures count the blocks that came out wrong).
5. throughput: a 32 MiB bf16 layer GPU -> host (the pusher's side-stream copy)
   -> ZeroMQ (tcp loopback) -> GPU (``inject``), plain and CURVE, median GB/s,
   beside a plain pinned device-to-host (and host-to-device) copy of 32 MiB; and
   ``save_layer``'s return time (the forward thread's cost, measured while the
   forward stream is busy) against the device-to-host copy: it must be smaller
   (it does not wait for the copy).

On the device machine (no vLLM, no network; ProServe is not installed: this
script imports ``proserve.kvtransfer`` from the checkout itself)::

    pip install --no-index ./wheels/pyzmq-*.whl && \\
        timeout 480 python scripts/device_check_kv.py --out $OUT

Here (smoke mode, CPU tensors, same code paths; checks 2 and 4 skipped: no
asynchronous streams on CPU)::

    python scripts/device_check_kv.py --device cpu --quick --out /tmp/dck

Writes ``OUT/device_check_kv.json`` and ``OUT/device_check_kv.md`` (after every
check, so a hang still leaves the earlier results) and prints the table; exits
1 if any check FAILed or raised. Every wait is bounded; ``--budget-s`` (default
420) ends a hung run with a stack dump.
"""
from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
DIGEST = hashlib.sha256(b"device_check_kv").hexdigest()
WAIT_S = 60.0          # bound on every wait (receiver, acks, events)


# ------------------------------------------------------------------------------------ import
def import_proserve() -> dict:
    """Make ``import proserve.kvtransfer`` work from this checkout without installing it:
    a temporary ``proserve/`` (a regular package, so it wins over any installed one)
    with symlinks to the repository's ``kvtransfer`` and ``scheduler`` (kvtransfer
    imports ``proserve.scheduler.validate``)."""
    tmp = Path(tempfile.mkdtemp(prefix="proserve-import-"))
    pkg = tmp / "proserve"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('"""ProServe, imported from a checkout by scripts/device_check_kv.py."""\n')
    for name in ("kvtransfer", "scheduler"):
        (pkg / name).symlink_to(ROOT / name, target_is_directory=True)
    sys.path.insert(0, str(tmp))
    import atexit
    atexit.register(shutil.rmtree, tmp, True)
    import proserve
    import proserve.kvtransfer as kv
    got = Path(kv.__file__).resolve().parent
    if Path(proserve.__file__).parent != pkg or got != (ROOT / "kvtransfer").resolve():
        raise RuntimeError(f"proserve came from {proserve.__file__} / {kv.__file__}, not this checkout")
    return {"proserve": str(proserve.__file__), "kvtransfer": str(got)}


# ------------------------------------------------------------------------------------ helpers
class Env:
    """The device, its stream API, the sizes, and a GPU-side sleep."""

    def __init__(self, device: str, quick: bool):
        import torch
        self.torch = torch
        dev = torch.device(device)
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("--device cuda: torch.cuda.is_available() is False")
            dev = torch.device("cuda", torch.cuda.current_device())
        self.dev = dev
        self.accel = dev.type != "cpu"
        from proserve.kvtransfer.common import device_api, new_stream
        self.api = device_api(dev)
        self.new_stream = lambda: new_stream(self.api, dev)
        self.quick = quick
        # one block = [2, block_size, heads, head]
        self.geo = (4, 2, 16) if quick else (16, 8, 128)
        self.nb = 24 if quick else 64
        self.sleep_ms = 20.0 if quick else 50.0
        self.cycles_per_ms = self._calibrate() if dev.type == "cuda" else 0.0
        self.can_race = self.cycles_per_ms > 0

    def _calibrate(self) -> float:
        torch = self.torch
        torch.cuda._sleep(1000)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(20_000_000)
        b.record()
        b.synchronize()
        return 20_000_000 / max(a.elapsed_time(b), 1e-3)

    def sleep(self, ms: float, stream=None) -> None:
        """Queue a kernel that spins ``ms`` on ``stream`` (default: the current one)."""
        if not self.can_race:
            return
        if stream is None:
            self.torch.cuda._sleep(int(ms * self.cycles_per_ms))
        else:
            with self.api.stream(stream):
                self.torch.cuda._sleep(int(ms * self.cycles_per_ms))

    def sync(self) -> None:
        if self.accel:
            self.api.synchronize()

    def dtypes(self) -> list:
        out = [self.torch.bfloat16]
        fp8 = getattr(self.torch, "float8_e4m3fn", None)
        if fp8 is not None:
            out.append(fp8)
        return out


def bits(t):
    """The tensor's bits as an integer tensor of the same shape (bit-exact comparisons)."""
    import torch
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def sentinel(t) -> int:
    return {1: 0x11, 2: 0x1111, 4: 0x11111111}[t.element_size()]


def make_cache(env: Env, layout: str, dtype, nb: int | None = None):
    """A layer's cache filled with the sentinel; -> (tensor, block_dim). NHD is vLLM's
    FlashAttention ``[2, blocks, bs, heads, head]``; HND the strided view vLLM exposes."""
    torch = env.torch
    nb = nb or env.nb
    bs, h, d = env.geo
    if layout == "NHD":
        t, block_dim = torch.empty(2, nb, bs, h, d, dtype=dtype, device=env.dev), 1
    else:
        t, block_dim = torch.empty(nb, 2, h, bs, d, dtype=dtype, device=env.dev).permute(0, 1, 3, 2, 4), 0
        assert not t.is_contiguous()
    bits(t).fill_(sentinel(t))
    return t, block_dim


def random_blocks(env: Env, n: int, dtype, seed: int):
    """``n`` blocks of random bits (block-major, on the host), as ``dtype``."""
    torch = env.torch
    g = torch.Generator().manual_seed(seed)
    esize = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n, 2, *env.geo, esize), dtype=torch.uint8, generator=g)
    return raw.view(dtype).squeeze(-1)


def blocks_of(cache, block_dim: int):
    """The cache's bits on the host, block-major."""
    return bits(cache).movedim(block_dim, 0).cpu()


def wait_event(ev, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not ev.query():
        if time.monotonic() > deadline:
            raise TimeoutError(f"event not reached within {timeout:g} s")
        time.sleep(0.0005)


def dtype_name(dt) -> str:
    return {"bfloat16": "bf16", "float8_e4m3fn": "fp8"}.get(str(dt).removeprefix("torch."), str(dt))


def ms(t: float) -> str:
    return f"{t * 1e3:.3g} ms"


# ------------------------------------------------------------------------------------ check 1/2
def producer_case(env: Env, layout: str, dtype, sleep_ms: float, wait: bool = True) -> dict:
    """Forward stream: sleep, then write known blocks; at once ``_copy_to_host``.
    -> {'exact': host copy == written bytes, 'return_s': the call's duration}."""
    from proserve.kvtransfer.pusher import KVPusher
    torch = env.torch
    cache, bd = make_cache(env, layout, dtype)
    written = [5, 2, 9, 3]
    ids = written + [7]                                   # and one block nobody wrote
    vals = random_blocks(env, len(written), dtype, seed=1)
    vals_dev, idx_dev = bits(vals).to(env.dev), torch.tensor(written, device=env.dev)
    p = KVPusher(lambda addr: None, name="kvpusher-check")
    try:
        host, ev = p._copy_to_host(cache, bd, ids, step=0)   # warm-up: stream, index, pinned blocks
        wait_event(ev)
        del host
        if not wait:
            without_wait_event(p._stream)                     # the race: no ordering after the layer
        env.sync()
        env.sleep(sleep_ms)                                   # a long attention kernel...
        bits(cache).index_copy_(bd, idx_dev, vals_dev.movedim(0, bd))   # ...then the layer's KV writes
        t0 = time.perf_counter()
        host, ev = p._copy_to_host(cache, bd, ids, step=1)
        ret = time.perf_counter() - t0
        wait_event(ev)
        want = torch.cat([bits(vals), torch.full_like(bits(vals[:1]), sentinel(cache))])
        return {"exact": torch.equal(bits(host), want), "return_s": ret, "dtype_kept": host.dtype == dtype}
    finally:
        env.sync()
        p.close()


def without_wait_event(stream) -> None:
    """Make ``stream.wait_event`` a no-op (this stream object only)."""
    try:
        stream.wait_event = lambda event: None
    except AttributeError:      # a stream type without an instance dict: a subclass that skips the wait
        class NoWait(type(stream)):
            def wait_event(self, event):
                return None
        stream.__class__ = NoWait


def reuse_case(env: Env, sleep_ms: float, order: bool = True) -> dict:
    """The side stream's copy lags (it sleeps first); ``order_forward_after_copies`` and
    the forward stream overwrites the copied blocks at once (freed, reused): the copy
    must still hold the bytes from before the overwrite."""
    from proserve.kvtransfer.pusher import KVPusher
    torch = env.torch
    cache, bd = make_cache(env, "NHD", torch.bfloat16)
    ids = [4, 1, 8]
    old, new = (bits(random_blocks(env, len(ids), torch.bfloat16, seed=s)) for s in (2, 3))
    idx_dev = torch.tensor(ids, device=env.dev)
    old_dev, new_dev = old.to(env.dev), new.to(env.dev)
    bits(cache).index_copy_(bd, idx_dev, old_dev.movedim(0, bd))
    p = KVPusher(lambda addr: None, name="kvpusher-check")
    try:
        host, ev = p._copy_to_host(cache, bd, ids, step=0)
        wait_event(ev)
        del host
        env.sync()
        env.sleep(sleep_ms, p._stream)                        # earlier copies still queued
        host, ev = p._copy_to_host(cache, bd, ids, step=1)
        if order:
            p.order_forward_after_copies()
        bits(cache).index_copy_(bd, idx_dev, new_dev.movedim(0, bd))   # the next forward pass
        wait_event(ev)
        return {"exact": torch.equal(bits(host), old)}
    finally:
        env.sync()
        p.close()


def check_producer(env: Env) -> dict:
    cases, bad = {}, []
    for layout in ("NHD", "HND"):
        for dt in env.dtypes():
            name = f"{layout}/{dtype_name(dt)}"
            try:
                r = producer_case(env, layout, dt, env.sleep_ms)
            except Exception as e:  # noqa: BLE001  (e.g. fp8 refused by this torch)
                cases[name] = f"error: {type(e).__name__}: {e}"
                bad.append(name)
                continue
            cases[name] = r
            # the call must not wait for the GPU: it returns while the forward stream still sleeps
            slow = env.can_race and r["return_s"] * 1e3 > env.sleep_ms / 2
            if not r["exact"] or not r["dtype_kept"] or slow:
                bad.append(name)
    r = reuse_case(env, env.sleep_ms)
    cases["reuse after order_forward_after_copies"] = r
    probe = fp8_index_select(env)
    if not r["exact"]:
        bad.append("reuse")
    rets = [c["return_s"] for c in cases.values() if isinstance(c, dict) and "return_s" in c]
    figures = (f"{sum(1 for c in cases.values() if isinstance(c, dict) and c.get('exact'))}/{len(cases)} cases "
               f"bit-exact; _copy_to_host returned in <= {ms(max(rets))}"
               + (f" while the forward stream slept {env.sleep_ms:g} ms" if env.can_race else "")
               + (f"; bad: {', '.join(bad)}" if bad else "") + f"; fp8 index_select: {probe}")
    return {"result": "FAIL" if bad else "pass", "figures": figures, "cases": cases, "fp8_index_select": probe}


def fp8_index_select(env: Env) -> str:
    """Whether this torch gathers float8 directly on the device (the pusher gathers bytes
    instead; loader.inject's debug dump hook does not)."""
    fp8 = getattr(env.torch, "float8_e4m3fn", None)
    if fp8 is None:
        return "no float8 in this torch"
    try:
        c = env.torch.zeros(2, 4, 8, dtype=fp8, device=env.dev)
        c.index_select(1, env.torch.tensor([1, 2], device=env.dev))
        return "ok"
    except Exception as e:  # noqa: BLE001
        return f"refused ({type(e).__name__}: {str(e).splitlines()[0][:80]})"


def check_producer_race(env: Env) -> dict:
    if not env.can_race:
        return {"result": "skip", "figures": "skipped (no asynchronous streams on "
                f"{env.dev.type}{'' if env.dev.type == 'cpu' else ' without torch.cuda._sleep'})"}
    out = {}
    for what, run in (("no wait on the layer's event", lambda s: producer_case(env, "NHD", env.torch.bfloat16,
                                                                                 s, wait=False)),
                      ("no order_forward_after_copies", lambda s: reuse_case(env, s, order=False))):
        tries = []
        for sleep_ms in (env.sleep_ms, env.sleep_ms * 4):
            r = run(sleep_ms)
            tries.append({"sleep_ms": sleep_ms, "exact": r["exact"]})
            if not r["exact"]:
                break
        out[what] = {"can_fail": not tries[-1]["exact"], "tries": tries}
    can = all(v["can_fail"] for v in out.values())
    figures = "; ".join(f"{k}: the check can fail: {'yes' if v['can_fail'] else 'NO'} "
                        f"(sleep {v['tries'][-1]['sleep_ms']:g} ms)" for k, v in out.items())
    return {"result": "pass" if can else "warn", "figures": figures, "cases": out}


# ------------------------------------------------------------------------------------ check 3/4
def send_transfer(env: Env, xfer: str, layers: list, sender_kw: dict):
    """Two prefill steps per layer, as the pusher sends them: step 0 positions 0..2
    (position 2 not final yet), step 1 positions 2..5. -> the receiver's result."""
    from proserve.kvtransfer.receiver import KVReceiver
    from proserve.kvtransfer.sender import KVSender
    rx = KVReceiver()
    tx = KVSender(rx.address, timeout=WAIT_S, **sender_kw)
    try:
        for layer, final in enumerate(layers):
            early = final[:3].clone()
            bits(early[2]).fill_(0x22)
            tx.send_layer(xfer, layer, [0, 1, 2], early, step=0)
        for layer, final in enumerate(layers):
            tx.send_layer(xfer, layer, [2, 3, 4, 5], final[2:].contiguous(), step=1)
        tx.finish(xfer, timeout=WAIT_S, digest=DIGEST)
        res = rx.wait(xfer, timeout=WAIT_S)
        res.raise_for_error()
        return res
    finally:
        tx.close()
        rx.close()


def consumer_case(env: Env, layout: str, dtype, sender_kw: dict, how: str = "inject") -> dict:
    """-> {'written_wrong': blocks written != sent, 'others_wrong': other blocks != sentinel, ...}."""
    from proserve.kvtransfer import kvcache
    from proserve.kvtransfer.loader import KVLoader, inject
    torch = env.torch
    layers = [random_blocks(env, 6, dtype, seed=10 + l) for l in range(2)]
    res = send_transfer(env, f"c-{layout}-{dtype_name(dtype)}-{how}", layers, sender_kw)
    caches, bd = [], 0
    for _ in layers:
        c, bd = make_cache(env, layout, dtype)
        caches.append(c)
    dst, skip = [14, 0, 6, 7, 8, 3], 1               # scattered, a run of three; position 0 cached locally
    env.sync()
    t0 = time.perf_counter()
    if how == "loader":
        ld = KVLoader(caches, bd, name="kvloader-check")
        try:
            ld.submit("r", res.xfer_id, DIGEST, dst, skip, res)
            deadline = time.monotonic() + WAIT_S
            done = {}
            while "r" not in done and time.monotonic() < deadline:
                done.update(ld.done())
                time.sleep(0.001)
            if "r" not in done:
                raise TimeoutError("KVLoader did not finish within the bound")
            if done["r"][0] is not None:
                raise RuntimeError(f"KVLoader: {done['r'][0]}")
        finally:
            ld.close()
    elif how == "write_device":                       # CPU only: the staging path on torch.cpu's stand-ins
        copies = kvcache.plan_load(res.pieces, caches, bd, dst, skip)
        kvcache._write_device(copies, caches, bd, dst, skip, env.new_stream())
    else:
        stream = env.new_stream()
        env.sleep(env.sleep_ms, stream)               # the load stream lags behind the host
        inject(res.xfer_id, DIGEST, dst, skip, res, caches, bd, stream)
    took = time.perf_counter() - t0
    env.sync()
    written_wrong = others_wrong = 0
    for layer, c in enumerate(caches):
        got = blocks_of(c, bd)
        want = {dst[p]: bits(layers[layer][p]) for p in range(skip, len(dst))}
        for b in range(got.shape[0]):
            if b in want:
                written_wrong += not torch.equal(got[b], want[b])
            else:
                others_wrong += not bool((got[b] == sentinel(c)).all())
    return {"written_wrong": written_wrong, "others_wrong": others_wrong, "written": 2 * (len(dst) - skip),
            "inject_s": took}


def sender_configs(env: Env) -> dict:
    bs, h, d = env.geo
    block_bf16 = 2 * bs * h * d * 2
    # default: each piece as it comes (packed when small: --quick); "packed": pieces share
    # messages; "rows": a message smaller than a block, so blocks arrive in rows (kvcache's
    # row-by-row path)
    return {"blocks": {}, "packed": {"pack_bytes": 4 * MIB, "pack_layer_bytes": MIB},
            "rows": {"pack_bytes": 0, "chunk_bytes": max(64, block_bf16 // 8)}}


def check_consumer(env: Env) -> dict:
    cases, bad = {}, []
    runs = [(lay, dt, cfg, "inject") for lay in ("NHD", "HND") for dt in env.dtypes() for cfg in sender_configs(env)]
    runs.append(("NHD", env.torch.bfloat16, "blocks", "loader"))
    if not env.accel:
        runs += [(lay, env.torch.bfloat16, "blocks", "write_device") for lay in ("NHD", "HND")]
    for lay, dt, cfg, how in runs:
        name = f"{lay}/{dtype_name(dt)}/{cfg}/{how}"
        try:
            r = consumer_case(env, lay, dt, sender_configs(env)[cfg], how)
        except Exception as e:  # noqa: BLE001
            cases[name] = f"error: {type(e).__name__}: {e}"
            bad.append(name)
            continue
        cases[name] = r
        if r["written_wrong"] or r["others_wrong"]:
            bad.append(name)
    ok = [c for c in cases.values() if isinstance(c, dict)]
    figures = (f"{len(runs) - len(bad)}/{len(runs)} cases bit-exact, others untouched "
               f"({sum(c['written'] for c in ok)} blocks written, skip=1, dst [14,0,6,7,8,3]"
               + (f", load stream delayed {env.sleep_ms:g} ms" if env.can_race else "") + ")"
               + (f"; bad: {', '.join(bad)}" if bad else ""))
    return {"result": "FAIL" if bad else "pass", "figures": figures, "cases": cases}


def check_consumer_race(env: Env) -> dict:
    if not env.can_race:
        return {"result": "skip", "figures": "skipped (no asynchronous streams on "
                f"{env.dev.type}{'' if env.dev.type == 'cpu' else ' without torch.cuda._sleep'})"}
    from proserve.kvtransfer import kvcache
    real = kvcache._release_stage

    def release_at_once(done, stage):                 # the bug: reuse the stage before the copies ran
        stage.fill_(0xA5)
    cases = {}
    kvcache._release_stage = release_at_once
    try:
        for lay in ("NHD", "HND"):
            for dt in env.dtypes():
                name = f"{lay}/{dtype_name(dt)}"
                try:
                    r = consumer_case(env, lay, dt, {})
                    cases[name] = {"caught": bool(r["written_wrong"]), **r}
                except Exception as e:  # noqa: BLE001
                    cases[name] = {"caught": False, "error": f"{type(e).__name__}: {e}"}
    finally:
        kvcache._release_stage = real
    missed = [k for k, v in cases.items() if not v["caught"]]
    figures = (f"the check can fail: {'yes' if not missed else 'NO in ' + ', '.join(missed)}; blocks wrong: "
               + ", ".join(f"{k} {v.get('written_wrong', '?')}/{v.get('written', '?')} "
                           f"(inject returned in {ms(v['inject_s']) if 'inject_s' in v else '?'})"
                           for k, v in cases.items()))
    return {"result": "warn" if missed else "pass", "figures": figures, "cases": cases}


# ------------------------------------------------------------------------------------ check 5
def median_s(fn, reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def runs_of(ids: list[int], run: int, seed: int) -> list[int]:
    """``ids`` in shuffled runs of ``run`` consecutive blocks (a fragmented block table)."""
    chunks = [ids[i:i + run] for i in range(0, len(ids), run)]
    random.Random(seed).shuffle(chunks)
    return [b for c in chunks for b in c]


class Pipe:
    """One producer (a KVPusher, as the connector runs it) and one consumer (a KVReceiver,
    then ``inject``), plain or CURVE."""

    def __init__(self, env: Env, server_keys, client_keys, nbytes: int, source, dests, load_stream, name: str):
        from proserve.kvtransfer.pusher import KVPusher
        from proserve.kvtransfer.receiver import KVReceiver
        from proserve.kvtransfer.sender import KVSender
        self.env, self.load_stream = env, load_stream
        self.src, self.bd, self.src_ids = source
        self.dsts, self.dst_ids = dests
        cap = 8 * nbytes + (1 << 30)
        self.rx = KVReceiver(curve=server_keys, max_held_bytes=cap, max_peer_bytes=cap)
        self.p = KVPusher(lambda addr: KVSender(addr, timeout=WAIT_S, connect_timeout=10, curve=client_keys),
                          timeout_s=WAIT_S, max_staged_bytes=4 * nbytes, name=f"kvpusher-{name}")
        self.seen: dict = {}

    def transfer(self, x: str, step: int, busy_ms: float = 0.0) -> dict:
        """One layer end to end; -> seconds: save_layer's return ('ret'), received ('rx'),
        injected into the NHD cache ('all'), and a second inject into the HND cache."""
        from proserve.kvtransfer.loader import inject
        from proserve.kvtransfer.pusher import Save
        p, addr = self.p, self.rx.address
        self.env.sync()
        self.env.sleep(busy_ms)                         # the forward stream still busy (return-time loop)
        t0 = time.perf_counter()
        p.save_layer(0, self.src, self.bd, [Save(x, addr, self.src_ids, 0)], step)
        t_ret = time.perf_counter() - t0
        p.flush(x, addr)
        p.finish(x, addr, DIGEST)
        res = self.rx.wait(x, timeout=WAIT_S)
        res.raise_for_error()
        t_rx = time.perf_counter() - t0
        c, cbd = self.dsts["NHD"]
        inject(x, DIGEST, self.dst_ids, 0, res, [c], cbd, self.load_stream)
        t_all = time.perf_counter() - t0
        c, cbd = self.dsts["HND"]
        inject(x, DIGEST, self.dst_ids, 0, res, [c], cbd, self.load_stream)
        t_hnd = time.perf_counter() - t0 - t_all
        deadline = time.monotonic() + WAIT_S
        while x not in self.seen and time.monotonic() < deadline:
            self.seen.update(p.outcomes())
            time.sleep(0.001)
        if self.seen.get(x, "no ack in time") is not None:
            raise RuntimeError(f"transfer {x}: {self.seen.get(x, 'no ack in time')}")
        return {"ret": t_ret, "rx": t_rx, "all": t_all, "inject_nhd": t_all - t_rx, "inject_hnd": t_hnd}

    def close(self) -> None:
        self.p.close()
        self.rx.close()


def check_throughput(env: Env, keys_dir: Path) -> dict:
    from proserve.kvtransfer.auth import ClientKeys, ServerKeys, generate_keys
    from proserve.kvtransfer.pusher import host_tensor
    torch = env.torch
    bf16 = torch.bfloat16
    layer_mib = 4 if env.quick else 32
    reps = 3 if env.quick else 5
    nbytes = layer_mib * MIB
    bs, h, d = env.geo = (16, 8, 128)                   # 64 KiB blocks of bf16
    n = nbytes // (2 * bs * h * d * 2)
    total = n + 32
    src, bd = make_cache(env, "NHD", bf16, total)
    bits(src).copy_(torch.randint(-2 ** 15, 2 ** 15, src.shape, dtype=torch.int16).to(env.dev))
    src_ids = runs_of(list(range(16, 16 + n)), 16, seed=1)
    dst_ids = runs_of(list(range(8, 8 + n)), 16, seed=2)
    dsts = {lay: make_cache(env, lay, bf16, total) for lay in ("NHD", "HND")}
    want = bits(src).index_select(bd, torch.tensor(src_ids, device=env.dev)).movedim(bd, 0).cpu()

    # baselines: a plain copy of the same bytes between device and pinned host memory
    dev_buf = torch.ones(nbytes, dtype=torch.uint8, device=env.dev)
    host_buf = host_tensor((nbytes,), torch.uint8)
    host_buf.fill_(2)

    def d2h():
        host_buf.copy_(dev_buf, non_blocking=True)
        env.sync()

    def h2d():
        dev_buf.copy_(host_buf, non_blocking=True)
        env.sync()
    d2h_s, h2d_s = median_s(d2h, reps), median_s(h2d, reps)
    fig = {"layer_MiB": layer_mib, "reps": reps, "pinned": host_buf.is_pinned(),
           "d2h_GBps": nbytes / d2h_s / 1e9, "h2d_GBps": nbytes / h2d_s / 1e9, "d2h_ms": d2h_s * 1e3}

    generate_keys(keys_dir)
    problems = []
    load_stream = env.new_stream() if env.accel else None
    for mode in ("plain", "curve"):
        curve = mode == "curve"
        pipe = Pipe(env, ServerKeys.load(keys_dir) if curve else None, ClientKeys.load(keys_dir) if curve else None,
                    nbytes, (src, bd, src_ids), (dsts, dst_ids), load_stream, mode)
        try:
            for i in range(2):                          # warm-up: sockets, pinned blocks, allocators
                pipe.transfer(f"{mode}-warm{i}", 1000 + i)
            rows = [pipe.transfer(f"{mode}-{i}", 1 + i) for i in range(reps)]
            for lay, (c, cbd) in dsts.items():
                got = bits(c).index_select(cbd, torch.tensor(dst_ids, device=env.dev)).movedim(cbd, 0).cpu()
                if not torch.equal(got, want):
                    problems.append(f"{mode}: {lay} destination differs from the source")
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            fig[f"{mode}_GBps"] = nbytes / med["all"] / 1e9
            fig[f"{mode}_ms"] = {k: round(v * 1e3, 3) for k, v in med.items()}
            if mode == "plain":
                busy = 20.0 if env.can_race else 0.0
                rets = [pipe.transfer(f"ret-{i}", 100 + i, busy)["ret"] for i in range(reps)]
                fig["save_layer_return_ms"] = statistics.median(rets) * 1e3
                fig["forward_busy_ms"] = busy
        finally:
            pipe.close()
    fig["inject_nhd_GBps"] = nbytes / (fig["plain_ms"]["inject_nhd"] / 1e3) / 1e9
    fig["inject_hnd_GBps"] = nbytes / (fig["plain_ms"]["inject_hnd"] / 1e3) / 1e9
    ret, d2h_ms = fig["save_layer_return_ms"], fig["d2h_ms"]
    if env.accel and not ret < d2h_ms:
        problems.append(f"save_layer returned in {ret:.3g} ms, not less than the {d2h_ms:.3g} ms D2H copy")
    figures = (f"{layer_mib} MiB bf16: plain {fig['plain_GBps']:.2f} GB/s, CURVE {fig['curve_GBps']:.2f} GB/s "
               f"end to end; pinned D2H {fig['d2h_GBps']:.2f}, H2D {fig['h2d_GBps']:.2f} GB/s; inject alone NHD "
               f"{fig['inject_nhd_GBps']:.2f}, HND {fig['inject_hnd_GBps']:.2f} GB/s; save_layer returns in "
               f"{ret:.3g} ms vs D2H {d2h_ms:.3g} ms"
               + (f" (forward stream busy {fig['forward_busy_ms']:g} ms)" if env.can_race else
                  " (CPU: the copy is synchronous by design; not compared)")
               + (f"; PROBLEMS: {'; '.join(problems)}" if problems else ""))
    return {"result": "FAIL" if problems else "pass", "figures": figures, "details": fig}


# ------------------------------------------------------------------------------------ main
CHECKS = [
    (1, "producer staging sees the kernel's writes", check_producer),
    (2, "producer: without the synchronisation the check fails", check_producer_race),
    (3, "consumer writes bit-exact, other blocks untouched", check_consumer),
    (4, "consumer: staging race is caught", check_consumer_race),
    (5, "throughput GPU -> host -> ZeroMQ -> GPU", None),
]


def table(report: dict) -> str:
    lines = ["| # | check | result | figures |", "|---|---|---|---|"]
    for c in report["checks"]:
        fig = str(c.get("figures", "")).replace("|", "/").replace("\n", " ")
        lines.append(f"| {c['id']} | {c['name']} | {c['result']} | {fig} |")
    return "\n".join(lines)


def write(out: Path, report: dict) -> None:
    (out / "device_check_kv.json").write_text(json.dumps(report, indent=1, default=str))
    head = (f"# ProServe KV device check\n\ndevice: {report['device']} ({report.get('device_name', '')}); "
            f"torch {report['torch']}; quick: {report['quick']}; ok: {report['ok']}\n\n")
    (out / "device_check_kv.md").write_text(head + table(report) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), or cpu for a smoke run")
    ap.add_argument("--out", default=str(ROOT / "out" / "device_check_kv"))
    ap.add_argument("--quick", action="store_true", help="small sizes, few repetitions (a smoke run)")
    ap.add_argument("--only", default="", help="comma-separated check numbers to run (default: all)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="dump stacks and exit after this long")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    faulthandler.dump_traceback_later(args.budget_s, exit=True)
    t_start = time.monotonic()
    report: dict = {"device": args.device, "torch": "?", "quick": args.quick, "ok": False, "checks": []}
    try:
        report["import"] = import_proserve()
        import torch
        report["torch"] = torch.__version__
        env = Env(args.device, args.quick)
        report["device"] = str(env.dev)
        if env.dev.type == "cuda":
            report["device_name"] = torch.cuda.get_device_name(env.dev)
            report["sleep_cycles_per_ms"] = round(env.cycles_per_ms)
    except Exception:  # noqa: BLE001
        report["error"] = traceback.format_exc()
        write(out, report)
        print(report["error"], file=sys.stderr)
        return 2
    only = {int(x) for x in args.only.split(",") if x.strip()}
    keys = Path(tempfile.mkdtemp(prefix="kvkeys-"))
    try:
        for cid, name, fn in CHECKS:
            if only and cid not in only:
                continue
            entry = {"id": cid, "name": name, "result": "running", "figures": ""}
            report["checks"].append(entry)
            write(out, report)
            t0 = time.monotonic()
            geo = env.geo
            try:
                entry.update(fn(env) if fn else check_throughput(env, keys / "k"))
            except Exception as e:  # noqa: BLE001  (one check's failure does not stop the others)
                entry.update(result="error", figures=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
            finally:
                env.geo = geo
                try:
                    env.sync()
                except Exception as e:  # noqa: BLE001
                    entry.setdefault("sync_error", repr(e))
            entry["seconds"] = round(time.monotonic() - t0, 2)
            print(f"[{time.monotonic() - t_start:6.1f}s] check {cid}: {entry['result']}: {entry['figures']}",
                  flush=True)
            write(out, report)
    finally:
        shutil.rmtree(keys, ignore_errors=True)
    report["ok"] = all(c["result"] in ("pass", "skip", "warn") for c in report["checks"])
    report["seconds"] = round(time.monotonic() - t_start, 2)
    write(out, report)
    faulthandler.cancel_dump_traceback_later()
    print()
    print(table(report))
    print(f"\nok: {report['ok']} ({report['seconds']} s); wrote {out / 'device_check_kv.json'} and .md")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

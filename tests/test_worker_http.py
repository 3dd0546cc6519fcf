"""The workers' HTTP guard (prefill.worker_http): the KV receiver's heartbeat is
part of /health, and every route but /health and /metrics needs the API key."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from proserve.prefill import worker_http


def call(guard, path: str, headers: dict | None = None, method: str = "GET") -> tuple[int, dict | None, bool]:
    """(status, JSON body or None, whether the wrapped app was reached)."""
    reached = []

    async def app(scope, receive, send):
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    guard.app = app
    sent = []

    async def send(msg):
        sent.append(msg)

    async def receive():
        return {"type": "http.request", "body": b""}

    scope = {"type": "http", "path": path, "method": method,
             "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]}
    asyncio.run(guard(scope, receive, send))
    status = sent[0]["status"]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return status, (json.loads(body) if body else None), bool(reached)


def make_guard(monkeypatch, heartbeat=None, key=None, ranks=None) -> worker_http.WorkerGuard:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.delenv(worker_http.HEARTBEAT_ENV, raising=False)
    monkeypatch.delenv(worker_http.RANKS_ENV, raising=False)
    if heartbeat:
        monkeypatch.setenv(worker_http.HEARTBEAT_ENV, str(heartbeat))
    if ranks is not None:
        monkeypatch.setenv(worker_http.RANKS_ENV, str(ranks))
    if key:
        monkeypatch.setenv("VLLM_API_KEY", key)
    monkeypatch.setenv(worker_http.HEARTBEAT_MAX_AGE_ENV, "5")
    return worker_http.WorkerGuard(None)


def test_health_follows_the_receiver_heartbeat(tmp_path, monkeypatch):
    hb = tmp_path / "kv.heartbeat"
    g = make_guard(monkeypatch, heartbeat=hb)
    status, body, reached = call(g, "/health")
    assert status == 503 and "missing" in body["error"]["message"] and not reached
    hb.write_text(json.dumps({"time": time.time(), "stats": {"transfers_completed": 3}}))
    assert call(g, "/health")[0] == 200 and call(g, "/health")[2]
    old = time.time() - 60
    os.utime(hb, (old, old))
    status, body, _ = call(g, "/health")
    assert status == 503 and "old" in body["error"]["message"]
    # a fresh heartbeat of a closed receiver (the engine shutting down) is not alive either
    hb.write_text(json.dumps({"time": time.time(), "closed": True, "stats": {}}))
    status, body, _ = call(g, "/health")
    assert status == 503 and "closed" in body["error"]["message"]
    # a receiver whose thread ended (or whose ZAP handler died) says so: 503 at once, with its reason
    hb.write_text(json.dumps({"time": time.time(), "closed": False, "stopped": "receiver thread ended: boom"}))
    status, body, _ = call(g, "/health")
    assert status == 503 and "receiver thread ended: boom" in body["error"]["message"]
    hb.write_text(json.dumps(["not", "an", "object"]))      # the age alone decides then
    assert call(g, "/health")[0] == 200


def test_a_heartbeat_path_that_is_not_the_receivers_file_never_blocks_or_raises(tmp_path, monkeypatch):
    """Found by an adversarial pass (2026-11-28): /health read the whole heartbeat file on
    the server's event loop, so a FIFO at the path blocked it and a deeply nested file
    raised RecursionError (a 500 instead of an answer). Now: not a regular file is a
    503 with that reason; a file too big or too deep to parse is judged by its age."""
    hb = tmp_path / "kv.heartbeat"
    g = make_guard(monkeypatch, heartbeat=hb)
    os.mkfifo(hb)
    status, body, _ = call(g, "/health")
    assert status == 503 and "not a regular file" in body["error"]["message"]
    assert call(g, "/kv/status")[0] == 503
    os.remove(hb)
    hb.write_text("[" * 100_000 + "]" * 100_000)
    assert call(g, "/health")[0] == 200          # fresh: its age says alive
    assert call(g, "/kv/status")[0] == 503
    hb.write_text(json.dumps({"closed": True, "pad": "x" * (worker_http.MAX_HEARTBEAT_BYTES + 1)}))
    assert call(g, "/health")[0] == 200          # not read: its age decides
    status, body, _ = call(g, "/kv/status")
    assert status == 503 and "bytes" in body["error"]["message"]
    old = time.time() - 60
    os.utime(hb, (old, old))
    assert call(g, "/health")[0] == 503


def test_a_live_receiver_left_unscheduled_for_seconds_stays_healthy_by_default(tmp_path, monkeypatch):
    """The CI failure of 2026-11-28: a decode worker serving on a loaded 2-core host
    answered 503 for a few seconds (heartbeat over the old 5 s default), and the
    dispatcher took the only surviving decode worker out. A dead receiver now says so
    in the file; the age only catches a hung thread, at 20 s by default."""
    hb = tmp_path / "kv.heartbeat"
    hb.write_text(json.dumps({"time": time.time(), "closed": False, "stopped": None}))
    monkeypatch.delenv(worker_http.HEARTBEAT_MAX_AGE_ENV, raising=False)
    monkeypatch.setenv(worker_http.HEARTBEAT_ENV, str(hb))
    g = worker_http.WorkerGuard(None)
    assert g.max_age == worker_http.DEFAULT_HEARTBEAT_MAX_AGE_S == 20.0
    old = time.time() - 10
    os.utime(hb, (old, old))
    assert call(g, "/health")[0] == 200
    old = time.time() - 25
    os.utime(hb, (old, old))
    status, body, _ = call(g, "/health")
    assert status == 503 and "25" in body["error"]["message"] and "hung" in body["error"]["message"]


def test_every_tensor_parallel_ranks_receiver_is_part_of_health(tmp_path, monkeypatch):
    """A decode worker with TP 2 runs a receiver per rank, each with its own heartbeat file
    (rank 1's at PATH.r1): a transfer needs both shards, so /health needs both receivers
    alive and names the rank at fault; /kv/status lists the ranks."""
    hb = tmp_path / "kv.heartbeat"
    g = make_guard(monkeypatch, heartbeat=hb, ranks=2)
    hb.write_text(json.dumps({"time": time.time(), "stats": {"acks_sent": 1}}))
    status, body, _ = call(g, "/health")
    assert status == 503 and "rank 1" in body["error"]["message"] and "missing" in body["error"]["message"]
    r1 = tmp_path / "kv.heartbeat.r1"
    r1.write_text(json.dumps({"time": time.time(), "stopped": "receiver thread ended: boom", "stats": {}}))
    status, body, _ = call(g, "/health")
    assert status == 503 and "rank 1" in body["error"]["message"] and "boom" in body["error"]["message"]
    r1.write_text(json.dumps({"time": time.time(), "stats": {"acks_sent": 2}}))
    assert call(g, "/health")[0] == 200
    status, body, _ = call(g, "/kv/status")
    assert status == 200 and [r["stats"]["acks_sent"] for r in body["ranks"]] == [1, 2]
    monkeypatch.setenv(worker_http.RANKS_ENV, "junk")          # a bad value: one rank, as before
    assert worker_http.WorkerGuard(None).heartbeats == [str(hb)]


def test_no_receiver_means_plain_vllm_health(monkeypatch):
    g = make_guard(monkeypatch)
    assert call(g, "/health") == (200, None, True)
    assert call(g, "/kv/status")[0] == 404


def test_api_key_guards_every_route_but_health_and_metrics(tmp_path, monkeypatch):
    hb = tmp_path / "kv.heartbeat"
    hb.write_text(json.dumps({"time": time.time(), "stats": {"acks_sent": 1}}))
    g = make_guard(monkeypatch, heartbeat=hb, key="sk-worker-secret")
    for path in ("/tokenize", "/detokenize", "/kv/status", "/reset_prefix_cache"):
        status, body, reached = call(g, path)
        assert status == 401 and body["error"]["type"] == "authentication_error" and not reached, path
        assert call(g, path, {"Authorization": "Bearer wrong"})[0] == 401
    assert call(g, "/tokenize", {"Authorization": "Bearer sk-worker-secret"})[2]
    status, body, _ = call(g, "/kv/status", {"Authorization": "Bearer sk-worker-secret"})
    assert status == 200 and body["stats"]["acks_sent"] == 1
    # /health and /metrics stay open for probes; /v1/* is vLLM's own --api-key check
    assert call(g, "/health")[2] and call(g, "/metrics")[2] and call(g, "/v1/completions")[2]


@pytest.mark.parametrize("host,loopback", [("127.0.0.1", True), ("localhost", True), ("::1", True),
                                           ("[::1]", True), ("0.0.0.0", False), ("10.0.0.5", False),
                                           ("example.com", False)])
def test_loopback_hosts(host, loopback):
    from proserve.prefill.worker import is_loopback_host
    assert is_loopback_host(host) is loopback


@pytest.mark.parametrize("ranks, age", [("abc", None), ("0", None), ("-3", None), ("2.5", None),
                                        ("99999999999", None), ("٣", None), ("2", "nan"), ("2", "-1")])
def test_a_misconfigured_guard_fails_closed(tmp_path, monkeypatch, ranks, age):
    """Junk in the variables the launcher sets makes /health say so (503), instead of
    watching fewer ranks than there are, or none."""
    hb = tmp_path / "kv.heartbeat"
    hb.write_text(json.dumps({"time": time.time(), "stats": {}}))
    (tmp_path / "kv.heartbeat.r1").write_text(json.dumps({"time": time.time(), "stats": {}}))
    g = make_guard(monkeypatch, heartbeat=hb, ranks=ranks)
    if age is not None:
        monkeypatch.setenv(worker_http.HEARTBEAT_MAX_AGE_ENV, age)
        g = worker_http.WorkerGuard(None)
    status, body, _ = call(g, "/health")
    assert status == 503 and "misconfigured" in body["error"]["message"]

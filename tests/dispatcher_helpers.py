"""Run the dispatcher (real uvicorn server, real HTTP) in front of fake workers
(bench.fake_worker) inside one event loop, for fast tests."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

import pytest

for _mod in ("httpx", "uvicorn", "fastapi", "aiohttp", "prometheus_client"):
    pytest.importorskip(_mod, reason="the dispatcher's tests need the [serve] extra: pip install -e '.[serve,test]'")

import httpx  # noqa: E402
import uvicorn  # noqa: E402
from pd_helpers import free_port  # noqa: E402

from proserve.bench.fake_worker import FakeWorker  # noqa: E402
from proserve.dispatcher.config import DecodeSpec, DispatcherConfig, PrefillSpec, keys_from_dict  # noqa: E402
from proserve.dispatcher.server import Dispatcher, create_app, uvicorn_config  # noqa: E402

KEYS = {"keys": [
    {"key": "sk-high-000001", "client": "acme", "class": "high", "ttft_ms": [100, 10000], "tpot_ms": [10, 1000]},
    {"key": "sk-low-0000001", "client": "batchco", "class": "low"},
]}


class Harness:
    def __init__(self, prefills: list[FakeWorker], decodes: list[FakeWorker], dispatcher: Dispatcher, url: str):
        self.prefills, self.decodes, self.d, self.url = prefills, decodes, dispatcher, url
        self.http = httpx.AsyncClient(base_url=url, timeout=30)

    async def post(self, path: str, body, key: str | None = "sk-high-000001", raw: bytes | None = None):
        headers = {"authorization": f"Bearer {key}"} if key else {}
        if raw is not None:
            return await self.http.post(path, content=raw, headers={**headers, "content-type": "application/json"})
        return await self.http.post(path, json=body, headers=headers)

    async def stream(self, path: str, body, key: str | None = "sk-high-000001") -> tuple[int, list]:
        """(status, events): parsed JSON of every `data:` line, '[DONE]' kept as a string."""
        headers = {"authorization": f"Bearer {key}"} if key else {}
        events = []
        async with self.http.stream("POST", path, json={**body, "stream": True}, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                return r.status_code, [r.json()]
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    data = line[5:].strip()
                    events.append(data if data == "[DONE]" else json.loads(data))
        return 200, events

    async def metrics(self) -> str:
        return (await self.http.get("/metrics")).text


@asynccontextmanager
async def harness(n_prefill: int = 1, n_decode: int = 1, keys: dict | None = KEYS, colocated: bool = False,
                  worker_kw: dict | None = None, uvicorn_kw: dict | None = None, **cfg_kw):
    """The dispatcher (``cfg_kw``: DispatcherConfig fields) in front of fake workers
    (``worker_kw``: FakeWorker fields); ``uvicorn_kw`` goes to
    :func:`proserve.dispatcher.server.uvicorn_config` (e.g. ``http_impl="h11"``)."""
    kw = worker_kw or {}
    prefills = [await FakeWorker(**kw).start() for _ in range(n_prefill)]
    decodes = [] if colocated else [await FakeWorker(**kw).start() for _ in range(n_decode)]
    cfg = DispatcherConfig(
        port=free_port(), deployment="colocated" if colocated else "disaggregated",
        prefill=[PrefillSpec(w.url) for w in prefills],
        decode=[DecodeSpec(w.url, f"tcp://127.0.0.1:{16000 + i}") for i, w in enumerate(decodes)],
        health_interval_s=cfg_kw.pop("health_interval_s", 0.1),
        shutdown_timeout_s=cfg_kw.pop("shutdown_timeout_s", 5.0),   # bounded even if a test left a stream open
        **cfg_kw)
    d = Dispatcher(cfg, keys_from_dict(keys, cfg.classes) if keys else None)
    server = uvicorn.Server(uvicorn_config(d, create_app(d, wait_s=5), log_level="warning", **(uvicorn_kw or {})))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    h = Harness(prefills, decodes, d, f"http://127.0.0.1:{cfg.port}")
    try:
        yield h
    finally:
        await h.http.aclose()
        server.should_exit = True
        await task
        for w in prefills + decodes:
            await w.stop()


def run(coro):
    return asyncio.run(coro)


def metric(text: str, name: str, **labels) -> float:
    """Sum of the samples of ``name`` (e.g. ``proserve:dispatcher_rejected_total``) in a
    /metrics page whose labels include ``labels``; 0 when there are none."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        got_name, _, rest = head.partition("{")
        if got_name != name:
            continue
        got = dict(kv.split("=", 1) for kv in rest.rstrip("}").split(",") if kv) if rest else {}
        if all(got.get(k) == f'"{v}"' for k, v in labels.items()):
            total += float(value)
    return total


async def until(cond, timeout: float = 10.0, what: str = "condition") -> None:
    """Wait (bounded) until ``cond()`` is true."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(0.02)


class RawConn:
    """HTTP/1.1 by hand over one socket, for requests no client library would send:
    stalled headers, a body that never ends, a client that reads nothing."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, url: str, rcvbuf: int | None = None) -> "RawConn":
        import socket
        host, port = url.rsplit("//", 1)[1].split(":")
        if rcvbuf is None:
            return cls(*await asyncio.open_connection(host, int(port)))
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)   # before connecting: no autotuning
        s.setblocking(False)
        await asyncio.get_running_loop().sock_connect(s, (host, int(port)))
        return cls(*await asyncio.open_connection(sock=s, limit=1 << 20))

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def response(self, timeout: float = 10.0) -> tuple[int, dict, bytes]:
        """(status, headers, body) of the next response (Content-Length or chunked)."""
        async def read():
            head = await self.reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1])
            headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)}
            if "content-length" in headers:
                return status, headers, await self.reader.readexactly(int(headers["content-length"]))
            if headers.get("transfer-encoding") == "chunked":
                parts = []
                while True:
                    size = int((await self.reader.readuntil(b"\r\n")).strip(), 16)
                    data = await self.reader.readexactly(size + 2)
                    if size == 0:
                        return status, headers, b"".join(parts)
                    parts.append(data[:-2])
            return status, headers, await self.reader.read()
        return await asyncio.wait_for(read(), timeout)

    async def closed_by_peer(self, timeout: float = 10.0) -> bool:
        """True when the server closes the connection within ``timeout`` (anything it sent is dropped)."""
        try:
            while await asyncio.wait_for(self.reader.read(65536), timeout):
                pass
            return True
        except asyncio.TimeoutError:
            return False
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.writer.close()


def post_head(path: str, key: str | None, length: int | None = None, chunked: bool = False) -> bytes:
    """The request line and headers of a JSON POST (the body is the caller's to send)."""
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    if key:
        lines.append(f"Authorization: Bearer {key}")
    if length is not None:
        lines.append(f"Content-Length: {length}")
    if chunked:
        lines.append("Transfer-Encoding: chunked")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()

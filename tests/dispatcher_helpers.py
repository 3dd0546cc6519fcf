"""Run the dispatcher (real uvicorn server, real HTTP) in front of fake workers
(bench.fake_worker) inside one event loop, for fast tests."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

import httpx
import uvicorn

from bench.fake_worker import FakeWorker
from dispatcher.config import DecodeSpec, DispatcherConfig, PrefillSpec, keys_from_dict
from dispatcher.server import Dispatcher, create_app
from pd_helpers import free_port

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
                  worker_kw: dict | None = None, **cfg_kw):
    kw = worker_kw or {}
    prefills = [await FakeWorker(**kw).start() for _ in range(n_prefill)]
    decodes = [] if colocated else [await FakeWorker(**kw).start() for _ in range(n_decode)]
    cfg = DispatcherConfig(
        port=free_port(), deployment="colocated" if colocated else "disaggregated",
        prefill=[PrefillSpec(w.url) for w in prefills],
        decode=[DecodeSpec(w.url, f"tcp://127.0.0.1:{16000 + i}") for i, w in enumerate(decodes)],
        health_interval_s=cfg_kw.pop("health_interval_s", 0.1), **cfg_kw)
    d = Dispatcher(cfg, keys_from_dict(keys, cfg.classes) if keys else None)
    server = uvicorn.Server(uvicorn.Config(create_app(d, wait_s=5), host="127.0.0.1", port=cfg.port,
                                           log_level="warning", lifespan="on"))
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

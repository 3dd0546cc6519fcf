"""Prefix structure in the load generator and the workloads (issue 14): prompts made of
shared token blocks from block ids (Mooncake ``hash_ids``), block scaling, multi-turn
conversations (ShareGPT and synthetic) with their prefix blocks for the simulator, and
multi-turn sends against bench.fake_worker (each turn after the previous answer).

Nothing here depends on wall-clock speed: the end-to-end checks are causal (a turn is
sent after the previous turn's last token), not timings.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from proserve.bench import loadgen as lg
from proserve.bench.traces import (
    MOONCAKE_BLOCK_TOKENS,
    Conversation,
    TraceError,
    TraceRecord,
    load_sharegpt,
    load_sharegpt_conversations,
    load_trace,
)
from proserve.bench.workloads import (
    LengthDist,
    conversation_requests,
    load_conversations,
    synthetic_conversations,
    tag_priorities,
    with_think_times,
)
from proserve.scheduler.request import ConfigError, Request

MOONCAKE = Path(__file__).resolve().parents[2] / "shared" / "data" / "mooncake_synthetic_trace.jsonl"


def _req(i, prompt, blocks=(), block_tokens=0):
    return Request(f"r{i}", "high", 2.0, 1.0, 0.1, 0.0, prompt, 4, prefix_blocks=tuple(blocks),
                   prefix_block_tokens=block_tokens)


# --- token blocks from block ids --------------------------------------------------------

def test_equal_block_ids_equal_tokens_different_ids_different():
    a = lg.block_token_ids(0, 7, 16, vocab=1024, low=3)
    assert a == lg.block_token_ids(0, 7, 16, vocab=1024, low=3)
    assert a != lg.block_token_ids(0, 8, 16) and a != lg.block_token_ids(1, 7, 16)
    # in prompts: the block's tokens whatever the request or the block's position
    reqs = [_req(0, 48, [5, 6, 7], 16), _req(1, 48, [5, 6, 9], 16), _req(2, 48, [9, 5, 6], 16)]
    p0, p1, p2 = lg.request_prompts(reqs, seed=0)
    assert p0[:32] == p1[:32] and p0[32:] != p1[32:]
    assert p2[16:48] == p0[:32] and p2[:16] == p1[32:]
    assert p0[32:] == lg.block_token_ids(0, 7, 16)


def test_block_tokens_within_vocab():
    for vocab, low in ((1024, 3), (50, 0), (5, 4)):
        toks = [t for b in range(200) for t in lg.block_token_ids(3, b, 32, vocab, low)]
        assert min(toks) >= low and max(toks) < vocab
    with pytest.raises(ConfigError):
        lg.block_token_ids(0, 0, 4, vocab=3, low=3)
    prompts = lg.request_prompts([_req(0, 40, [1, 2], 16), _req(1, 30)], seed=2, vocab=77, low=3)
    assert all(3 <= t < 77 for p in prompts for t in p)


def test_partial_last_block_and_own_tail():
    # a block the prompt covers in part: its first tokens (a repeated partial block repeats)
    full, part = lg.request_prompts([_req(0, 32, [1, 2], 16), _req(1, 20, [1, 2], 16)], seed=0)
    assert part == full[:20]
    # tokens past the named blocks are the request's own
    a, b = lg.request_prompts([_req(0, 40, [1], 16), _req(1, 40, [1], 16)], seed=0)
    assert a[:16] == b[:16] and a[16:] != b[16:]
    assert a[16:] == lg.prompt_tokens(0, 0, 40)[16:]
    # no blocks: the old random prompt, unchanged
    assert lg.request_prompts([_req(4, 25)], seed=1) == [lg.prompt_tokens(1, 4, 25)]


def test_shape_lengths_scales_blocks():
    rec = TraceRecord(0.0, 2 * 512 + 100, 7, (4, 5, 6), MOONCAKE_BLOCK_TOKENS)
    plain = TraceRecord(1.0, 1000, 10)
    r, p = lg.shape_lengths([rec, plain], block_tokens=16)
    assert (r.prompt_len, r.block_tokens, r.hash_ids, r.output_len) == (32 + 3, 16, (4, 5, 6), 7)
    assert p == plain                      # a record without blocks is not scaled by B
    # --prompt-div on a block trace scales the blocks: 512 / 32 = 16 tokens per block
    assert lg.shape_lengths([rec], prompt_div=32)[0] == r
    # clipped prompts name fewer blocks
    assert lg.shape_lengths([rec], block_tokens=16, max_prompt=20)[0].hash_ids == (4, 5)
    # a block shorter than the prompt's remainder: at least 1 token
    assert lg.shape_lengths([TraceRecord(0.0, 10, 1, (1,), 512)], block_tokens=16)[0].prompt_len == 1
    with pytest.raises(ConfigError, match="pass one of them"):
        lg.shape_lengths([rec], prompt_div=2, block_tokens=16)
    with pytest.raises(ConfigError):
        lg.shape_lengths([rec], block_tokens=0)
    # the requests keep the blocks the (context-fitted) prompt covers
    q = tag_priorities([r, TraceRecord(0.0, 40, 30, (1, 2, 3), 16)], max_model_len=20)
    assert (q[0].prompt_len, q[0].prefix_blocks, q[0].prefix_block_tokens) == (19, (4, 5), 16)
    assert (q[1].prompt_len, q[1].prefix_blocks) == (19, (1, 2))


def test_prefix_block_tokens_needs_a_block_trace():
    with pytest.raises(ConfigError, match="no prefix blocks"):
        lg.make_workload("azure", rate=1.0, num_requests=5, block_tokens=16)


@pytest.mark.skipif(not MOONCAKE.exists(), reason="reference Mooncake trace not beside the checkout")
def test_mooncake_shared_blocks_become_shared_token_prefixes():
    recs = load_trace(MOONCAKE)
    reqs = lg.make_workload(str(MOONCAKE), num_requests=None, seed=0, block_tokens=16, max_model_len=100_000)
    assert all(q.prefix_block_tokens == 16 for q in reqs)
    assert [q.prompt_len for q in reqs] == [max(1, r.prompt_len * 16 // 512) for r in recs]
    prompts = lg.request_prompts(reqs, seed=0)
    by_id = {}
    pairs = 0
    for q, p in zip(reqs, prompts):
        first = q.prefix_blocks[0]
        if first in by_id:   # a request sharing its first block with an earlier one
            q0, p0 = by_id[first]
            n = 0
            while n < min(len(q.prefix_blocks), len(q0.prefix_blocks)) and q.prefix_blocks[n] == q0.prefix_blocks[n]:
                n += 1
            shared = min(n * 16, q.prompt_len, q0.prompt_len)
            assert p[:shared] == p0[:shared]
            if n * 16 < min(q.prompt_len, q0.prompt_len):   # the first different block differs
                assert p[n * 16:n * 16 + 16] != p0[n * 16:n * 16 + 16]
            pairs += 1
        else:
            by_id[first] = (q, p)
    assert pairs > 500


# --- conversations -------------------------------------------------------------------------

SHAREGPT = [
    {"id": "a", "conversations": [{"from": "system", "value": "be nice"},
                                  {"from": "human", "value": "x" * 40}, {"from": "gpt", "value": "y" * 80},
                                  {"from": "human", "value": "x" * 8}, {"from": "gpt", "value": "y" * 12},
                                  {"from": "human", "value": "unanswered"}]},
    {"id": "b", "conversations": [{"from": "gpt", "value": "hello"}]},                 # no pair: skipped
    {"id": 7, "conversations": [{"from": "user", "value": "q" * 4}, {"from": "assistant", "value": "a"},
                                {"from": "gpt", "value": "breaks the alternation"},
                                {"from": "human", "value": "not a turn"}, {"from": "gpt", "value": "no"}]},
]


def test_sharegpt_conversations_keep_turns(tmp_path):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(SHAREGPT))
    convs = load_sharegpt_conversations(path)
    assert [(c.id, c.turns) for c in convs] == [("a", ((10, 20), (2, 3))), ("7", ((1, 1),))]
    assert all(c.arrival == 0.0 and c.think_s == () for c in convs)
    # the single-turn loader's record is the first turn
    assert [(r.prompt_len, r.output_len) for r in load_sharegpt(path)] == [(10, 20), (1, 1)]
    assert load_sharegpt_conversations(path, limit=1)[0].id == "a"
    assert load_sharegpt_conversations(path, tokenizer=lambda t: [0] * len(t))[0].turns == ((40, 80), (8, 12))
    bad = SHAREGPT + [{"id": "z", "conversations": [{"from": "human"}]}]
    path.write_text(json.dumps(bad))
    with pytest.raises(TraceError, match=r"record 3: \(id 'z'\) conversations\[0\]"):
        load_sharegpt_conversations(path)
    path.write_text(json.dumps([SHAREGPT[1]]))
    with pytest.raises(TraceError, match="contains no requests"):
        load_sharegpt_conversations(path)


def test_synthetic_conversations_seeded():
    kw = {"turns": LengthDist.uniform(2, 4), "message": LengthDist.uniform(5, 50),
          "answer": LengthDist.uniform(5, 50), "think_time": 1.5}
    a = synthetic_conversations(20, 2.0, seed=3, **kw)
    assert a == synthetic_conversations(20, 2.0, seed=3, **kw) != synthetic_conversations(20, 2.0, seed=4, **kw)
    assert [c.id for c in a] == [f"c{i}" for i in range(20)] and a[0].arrival == 0.0
    assert all(2 <= len(c.turns) <= 4 and len(c.think_s) == len(c.turns) - 1 for c in a)
    assert all(5 <= m <= 50 and 5 <= n <= 50 for c in a for m, n in c.turns)
    assert all(x >= 0 for c in a for x in c.think_s) and any(x > 0 for c in a for x in c.think_s)
    assert all(x == 0 for c in synthetic_conversations(5, 1.0, think_time=0.0) for x in c.think_s)
    t = with_think_times(a, 0.5, seed=1)
    assert [c.turns for c in t] == [c.turns for c in a] and t[0].think_s != a[0].think_s
    with pytest.raises(ConfigError):
        synthetic_conversations(3, 1.0, think_time=-1)
    with pytest.raises(ConfigError, match="only to 'synthetic'"):
        load_conversations("x.json", 3, turns=LengthDist.fixed(2))


def _conv_workload(n=6, seed=0, **kw):
    convs = synthetic_conversations(n, 1.0, turns=LengthDist.uniform(2, 5), message=LengthDist.uniform(3, 40),
                                    answer=LengthDist.uniform(3, 40), think_time=0.3, seed=seed)
    return convs, *conversation_requests(convs, seed=seed, **kw)


def test_turn_prompt_starts_with_previous_prompt_and_answer():
    convs, reqs, links = _conv_workload(block_tokens=16)
    prompts = lg.request_prompts(reqs, seed=5, links=links)
    assert len(reqs) == sum(len(c.turns) for c in convs)
    for i, (q, link, p) in enumerate(zip(reqs, links, prompts)):
        assert len(p) == q.prompt_len
        m, a = convs[int(link.conversation[1:])].turns[link.turn]
        assert q.output_len == a
        if link.prev is None:
            assert link.turn == 0 and q.prompt_len == m
            continue
        prev, pl = reqs[link.prev], links[link.prev]
        assert link.prev < i and pl.conversation == link.conversation and pl.turn == link.turn - 1
        assert q.prompt_len == prev.prompt_len + prev.output_len + m
        assert p[:prev.prompt_len] == prompts[link.prev]     # turn k's full prompt, partial block included
        assert q.priority == prev.priority                   # one class per conversation
        assert q.arrival > prev.arrival
    # different conversations share no tokens blocks
    firsts = [p[:16] for p, link in zip(prompts, links) if link.turn == 0 and len(p) >= 16]
    assert len({tuple(f) for f in firsts}) == len(firsts)
    assert prompts == lg.request_prompts(reqs, seed=5, links=links)


def test_conversation_requests_share_leading_prefix_blocks():
    _, reqs, links = _conv_workload(block_tokens=8)
    seen: dict[str, set] = {}
    for q, link in zip(reqs, links):
        assert q.prefix_blocks == link.blocks[:q.prompt_len // 8]          # full blocks only
        assert q.prefix_block_tokens == (8 if q.prefix_blocks else 0)
        if link.prev is not None:
            prev = reqs[link.prev]
            assert q.prefix_blocks[:len(prev.prefix_blocks)] == prev.prefix_blocks
        seen.setdefault(link.conversation, set()).update(q.prefix_blocks)
    blocks = list(seen.values())
    for i in range(len(blocks)):
        for j in range(i + 1, len(blocks)):
            assert not blocks[i] & blocks[j]
    # the simulator's arrival of a later turn: the previous one + its answer at the SLOs + think
    for q, link in zip(reqs, links):
        if link.prev is not None:
            p = reqs[link.prev]
            assert q.arrival == pytest.approx(p.arrival + p.ttft_slo + (p.output_len - 1) * p.tpot_slo
                                              + link.think_s)


def test_simulator_hits_the_earlier_turns_prefix():
    """The same workload in the simulator: a later turn finds the previous turn's full
    blocks in its instance's prefix cache (one instance: always the same one)."""
    from proserve.scheduler import GainConfig, LatencyModel
    from proserve.sim.cluster import SimConfig, Simulator
    model = LatencyModel(a_p=0.0, b_p=0.0, c_p=1e-3, a_d=0.0, b_d=1e-3, t_c=0.01,
                         metadata={"block_size": 16, "num_kv_blocks": 4096})
    convs = synthetic_conversations(10, 0.5, turns=LengthDist.fixed(3), seed=2)

    def hits(prefix_cache):
        reqs, links = conversation_requests(convs, seed=2, max_model_len=4096)
        res = Simulator(model, SimConfig(prefix_cache=prefix_cache), GainConfig()).run(reqs)
        return res.prefix_hit_tokens, reqs, links

    hit, reqs, links = hits(True)
    assert hits(False)[0] == 0
    # every later turn reuses its previous turn's prompt, in whole 16-token blocks
    want = sum(reqs[link.prev].prompt_len // 16 * 16 for link in links if link.prev is not None)
    assert hit == want > 0


def test_conversation_limits_drop_later_turns():
    convs = [Conversation("x", ((100, 50), (30, 20), (10, 10))), Conversation("y", ((3000, 10), (5, 5)))]
    reqs, links = conversation_requests(convs, max_model_len=215)
    by_conv = {}
    for q, link in zip(reqs, links):
        by_conv.setdefault(link.conversation, []).append(q)
    assert [(q.prompt_len, q.output_len) for q in by_conv["x"]] == [(100, 50), (180, 20)]
    assert [(q.prompt_len, q.output_len) for q in by_conv["y"]] == [(214, 1)]   # a first turn is cut
    reqs, _ = conversation_requests(convs, max_prompt=150)
    assert sorted(q.prompt_len for q in reqs) == [100, 150]
    with pytest.raises(ConfigError, match="think times"):
        conversation_requests([Conversation("z", ((1, 1), (1, 1)), think_s=(1.0, 2.0))])
    with pytest.raises(ConfigError, match="turn 0"):
        conversation_requests([Conversation("z", ((0, 1),))])


def test_shape_conversations():
    convs = [Conversation("a", ((100, 41), (3, 9)), 2.0, (0.5,))]
    assert lg.shape_conversations(convs, 10, 4) == [Conversation("a", ((10, 10), (1, 2)), 2.0, (0.5,))]


# --- sending -------------------------------------------------------------------------------

def test_replay_multi_turn_in_order_after_each_answer():
    from proserve.bench.fake_worker import FakeWorker
    convs = synthetic_conversations(4, 50.0, turns=LengthDist.fixed(3), message=LengthDist.uniform(3, 20),
                                    answer=LengthDist.uniform(2, 6), think_time=0.02, seed=1)
    reqs, links = conversation_requests(convs, seed=1, block_tokens=4)

    async def go():
        w = await FakeWorker(decode_s=0.002).start()
        try:
            return w, await lg.replay(reqs, lg.ClientConfig(w.url, seed=9, stream_fraction=0.5), links=links)
        finally:
            await w.stop()

    w, run = asyncio.run(go())
    prompts = lg.request_prompts(reqs, seed=9, links=links)
    assert len(w.received) == 12
    order = [prompts.index(b["prompt"]) for b in w.received]      # which request each body was
    for i, (res, link) in enumerate(zip(run.results, links)):
        assert res.ok, res.error
        if link.prev is None:
            continue
        prev = run.results[link.prev]
        # sent only after the previous turn's answer (its last token) plus the think time
        assert res.arrival >= prev.token_times[-1] + link.think_s
        assert res.sent >= res.arrival - 1e-3
        assert order.index(i) > order.index(link.prev)
        assert prompts[i][:len(prompts[link.prev])] == prompts[link.prev]
    # the dependent turns' bodies carry the moment they became due as their arrival_time
    for b, i in zip(w.received, order):
        assert b["vllm_xargs"]["arrival_time"] == pytest.approx(run.t0_unix + run.results[i].arrival, abs=1e-6)


def test_replay_rejects_bad_links():
    reqs, links = conversation_requests([Conversation("a", ((2, 2), (2, 2)))])
    bad = [links[1], links[0]]
    with pytest.raises(ConfigError, match="earlier request"):
        asyncio.run(lg.replay(reqs, lg.ClientConfig("http://127.0.0.1:1", model="m"), links=bad))
    with pytest.raises(ConfigError, match="1 turn links for 2"):
        asyncio.run(lg.replay(reqs, lg.ClientConfig("http://127.0.0.1:1", model="m"), links=links[:1]))


def _cli(argv):
    from proserve.bench.fake_worker import FakeWorker

    async def go():
        w = await FakeWorker(decode_s=0.001).start()
        try:
            return w, await asyncio.to_thread(lg.main, ["--url", w.url, "--quiet", "--no-plots", *argv])
        finally:
            await w.stop()

    return asyncio.run(go())


def test_cli_multi_turn_synthetic(tmp_path, capsys):
    out = tmp_path / "run"
    w, rc = _cli(["--multi-turn", "--trace", "synthetic", "--conversations", "5", "--turns", "fixed:3",
                  "--message-len", "uniform:4:30", "--answer-len", "uniform:2:8", "--rate", "20",
                  "--think-time", "0.01", "--vocab", "1024", "--out", str(out)])
    assert rc == 0, capsys.readouterr()
    recs = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert len(recs) == 15 and all(r["error"] is None for r in recs)
    assert sorted((r["conversation"], r["turn"]) for r in recs) == [(f"c{i}", k) for i in range(5) for k in range(3)]
    assert lg.report_from_records(out)["metrics"]["all"]["requests"] == 15
    assert json.loads((out / "summary.json").read_text())["multi_turn"] is True
    # every later prompt extends an earlier one of the same conversation
    prompts = [b["prompt"] for b in w.received]
    assert all(0 < t < 1024 for p in prompts for t in p)
    longer = sum(any(len(q) < len(p) and p[:len(q)] == q for q in prompts) for p in prompts)
    assert longer == 10


@pytest.mark.skipif(not MOONCAKE.exists(), reason="reference Mooncake trace not beside the checkout")
def test_cli_mooncake_scaled_blocks_sends_shared_prefixes(tmp_path):
    w, rc = _cli(["--trace", str(MOONCAKE), "--num-requests", "30", "--rate", "200",
                  "--prefix-block-tokens", "16", "--output-div", "50"])
    assert rc == 0
    reqs = lg.make_workload(str(MOONCAKE), rate=200, num_requests=30, block_tokens=16, output_div=50,
                            max_model_len=2048)
    want = lg.request_prompts(reqs, seed=0)
    assert sorted(map(tuple, (b["prompt"] for b in w.received))) == sorted(map(tuple, want))


@pytest.mark.parametrize("argv,msg", [
    (["--multi-turn", "--num-requests", "5"], "--conversations"),
    (["--conversations", "5"], "only with --multi-turn"),
    (["--think-time", "1"], "only with --multi-turn"),
    (["--multi-turn", "--trace", "synthetic", "--arrivals", "poisson", "--rate", "1"], "--arrivals"),
    (["--multi-turn"], "ShareGPT"),
    (["--multi-turn", "--trace", "synthetic", "--turns", "bogus:1"], "--turns"),
    (["--multi-turn", "--trace", "synthetic", "--prefix-block-tokens", "0"], "--prefix-block-tokens"),
    (["--prefix-block-tokens", "16"], "no prefix blocks"),
])
def test_cli_bad_prefix_arguments(argv, msg, capsys):
    assert lg.main(["--url", "http://127.0.0.1:1", *argv]) == 2
    assert msg in capsys.readouterr().err

"""n > 1 and lists of prompts (dispatcher.fanout): split into one routed request per
completion and merged as vLLM's OpenAI server answers (choice index prompt_i * n + j,
prompt tokens once per prompt, completion tokens summed, one usage chunk at the end
of a stream); a failing sub-request or a client that goes away ends them all, and
every slot comes back. The dispatcher runs in front of fake workers (bench.fake_worker)."""

from __future__ import annotations

import json

import pytest
from dispatcher_helpers import harness, metric, run, until

from proserve.dispatcher import fanout
from proserve.dispatcher.errors import ApiError
from proserve.dispatcher.requests import CHAT, COMPLETIONS

KEY = "sk-high-000001"
PROMPT = list(range(1, 41))


def body(**kw):
    return {"prompt": PROMPT, "max_tokens": 5, **kw}


def in_flight(h) -> float:
    return metric(h.d.metrics.render(h.d.registry).decode(), "proserve:dispatcher_requests_in_flight")


def all_received(h) -> list[dict]:
    """Every generation body the workers got (decode legs: the ones without max_tokens 1)."""
    return [b for w in h.prefills + h.decodes for b in w.received]


def decode_legs(h) -> list[dict]:
    return [b for w in h.decodes for b in w.received]


async def settled(h) -> None:
    """Every sub-request ended: no slot held, nothing in flight."""
    await until(lambda: h.d.limiter.total == 0, what="the slots to be given back")
    await until(lambda: in_flight(h) == 0, what="in_flight to drop to 0")


# -- splitting (pure) --------------------------------------------------------------------------------
def test_split_n_gives_n_bodies_with_vllms_child_seeds():
    n, subs = fanout.split(COMPLETIONS, body(n=3, seed=7, best_of=5))
    assert n == 3 and len(subs) == 3
    assert [b["seed"] for b in subs] == [7, 8, 9]           # vLLM's parallel sampling: seed + index
    assert all("n" not in b and b["prompt"] == PROMPT for b in subs)
    assert all(b["best_of"] == 5 for b in subs)             # passed on: vLLM 0.32 ignores it
    # no seed: none invented
    _, subs = fanout.split(COMPLETIONS, body(n=2))
    assert all("seed" not in b for b in subs)


def test_split_prompt_list_is_prompt_major():
    prompts = [[1, 2, 3], [4, 5]]
    n, subs = fanout.split(COMPLETIONS, body(prompt=prompts, n=2, seed=0))
    assert n == 2
    assert [(b["prompt"], b["seed"]) for b in subs] == [([1, 2, 3], 0), ([1, 2, 3], 1), ([4, 5], 0), ([4, 5], 1)]
    # strings too, and the same seed for every prompt with n = 1 (as vLLM: one sampling params)
    n, subs = fanout.split(COMPLETIONS, body(prompt=["a b", "c"], seed=4))
    assert n == 1 and [(b["prompt"], b["seed"]) for b in subs] == [("a b", 4), ("c", 4)]


def test_split_leaves_one_completion_alone():
    assert fanout.split(COMPLETIONS, body()) is None
    assert fanout.split(COMPLETIONS, body(n=1, prompt=[[1, 2]])) is None     # one prompt in a list
    assert fanout.split(COMPLETIONS, body(prompt="hi")) is None
    assert fanout.split(CHAT, {"messages": [{"role": "user", "content": "x"}]}) is None
    assert fanout.split(COMPLETIONS, [1, 2]) is None                          # not an object: admit answers
    n, subs = fanout.split(CHAT, {"messages": [{"role": "user", "content": "x"}], "n": 2})
    assert n == 2 and [b["messages"] for b in subs] == [[{"role": "user", "content": "x"}]] * 2


@pytest.mark.parametrize("b, msg", [
    (body(n=0), "n must be at least 1, got 0."),
    (body(n=-3), "n must be at least 1"),
    (body(n="2"), "n must be an integer"),
    (body(n=2.0), "n must be an integer"),
    (body(n=True), "n must be an integer"),
    (body(n=fanout.MAX_FANOUT + 1), f"at most {fanout.MAX_FANOUT} per request"),
    (body(prompt=[[1]] * 65, n=2), "65 prompts × n = 2 asks for 130 completions"),
    (body(prompt=["x"] * (fanout.MAX_FANOUT + 1)), "asks for 129 completions"),
    (body(n=2, temperature=0), "n must be 1 when using greedy sampling, got 2."),
    (body(n=2, use_beam_search=True), "use_beam_search with n = 2"),
    (body(n=2, seed="7"), "seed must be an integer"),
    (body(n=3, seed=2**63 - 2), "seed + n - 1 must be at most 2**63 - 1"),
    (body(prompt=[]), "prompt is empty"),
    (body(prompt=["a", ""]), "prompt[1] is empty"),
    (body(prompt=[[1, 2], []]), "prompt[1] is empty"),
    (body(prompt=[[1, 2], [3, -1]]), "prompt[1][1] must be a non-negative token id"),
    (body(prompt=[[1, 2], "x"]), "not a mix"),
    (body(prompt=[1, [2]]), "not a mix"),
    (body(prompt={"a": 1}), "prompt must be a string or a list of token ids"),
])
def test_split_refuses_with_400(b, msg):
    with pytest.raises(ApiError) as e:
        fanout.split(COMPLETIONS, b)
    assert e.value.status == 400 and msg in e.value.message, e.value.message


def test_greedy_check_only_for_n_above_1():
    # a list of prompts at temperature 0 is fine (vLLM checks n, not the prompt count)
    n, subs = fanout.split(COMPLETIONS, body(prompt=[[1], [2]], temperature=0))
    assert n == 1 and len(subs) == 2


def test_merge_counts_prompt_tokens_once_per_prompt():
    def ans(k, p, c):
        return {"id": f"cmpl-{k}", "object": "text_completion", "created": 5, "model": "m",
                "choices": [{"index": 0, "text": f"x{k}", "finish_reason": "length"}],
                "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}}
    # 2 prompts (3 and 5 tokens) x n = 2
    out = fanout.merge_answers([ans(0, 3, 4), ans(1, 3, 2), ans(2, 5, 1), ans(3, 5, 7)], n=2)
    assert [(c["index"], c["text"]) for c in out["choices"]] == [(0, "x0"), (1, "x1"), (2, "x2"), (3, "x3")]
    assert out["usage"] == {"prompt_tokens": 8, "completion_tokens": 14, "total_tokens": 22}
    assert out["id"] == "cmpl-0"


# -- over HTTP --------------------------------------------------------------------------------------
def test_n3_unstreamed_three_samples_in_order_usage_summed():
    async def go():
        async with harness() as h:
            r = await h.post("/v1/completions", body(n=3, seed=7))
            assert r.status_code == 200, r.text
            out = r.json()
            assert [c["index"] for c in out["choices"]] == [0, 1, 2]
            assert [c["text"] for c in out["choices"]] == [" ".join(f"s{s}t{i}" for i in range(1, 6))
                                                           for s in (7, 8, 9)]
            # vLLM counts the prompt once for n samples
            assert out["usage"] == {"prompt_tokens": 40, "completion_tokens": 15, "total_tokens": 55}
            # three routed requests, each a full prefill/decode pair, none with n
            legs = decode_legs(h)
            assert sorted(b["seed"] for b in legs) == [7, 8, 9] and all("n" not in b for b in legs)
            assert len(h.prefills[0].received) == 3
            await settled(h)
            m = await h.metrics()
            assert metric(m, "proserve:dispatcher_requests_total", outcome="ok") == 3
            assert h.d.registry.prefill[0].state.queue == []
    run(go())


def test_n3_streamed_chunks_carry_their_index_and_one_usage_chunk_ends_it():
    async def go():
        async with harness() as h:
            status, ev = await h.stream("/v1/completions", body(n=3, seed=1, stream_options={"include_usage": True}))
            assert status == 200 and ev[-1] == "[DONE]"
            chunks = ev[:-1]
            usage = chunks[-1]
            assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 40, "completion_tokens": 15,
                                                                 "total_tokens": 55}
            text: dict[int, str] = {}
            for c in chunks[:-1]:
                (ch,) = c["choices"]
                text[ch["index"]] = text.get(ch["index"], "") + ch["text"]
                assert "token_ids" not in ch and "usage" not in c     # not asked for
            assert text == {k: "".join(f" s{1 + k}t{i}" for i in range(1, 6)) for k in range(3)}
            assert len({c["id"] for c in chunks}) == 1                # one response id
            # no usage asked for: no usage chunk at all
            status, ev = await h.stream("/v1/completions", body(n=2))
            assert status == 200 and all(c["choices"] for c in ev[:-1])
            assert len(ev) == 2 * 5 + 1
            await settled(h)
    run(go())


def test_two_prompts_times_n2_indices_order_and_usage():
    prompts = [[11, 12, 13], [21, 22, 23, 24, 25]]

    async def go():
        async with harness(n_decode=2) as h:
            r = await h.post("/v1/completions", body(prompt=prompts, n=2, seed=3, return_token_ids=True))
            assert r.status_code == 200, r.text
            out = r.json()
            got = [(c["index"], c["prompt_token_ids"], c["text"].split()[0]) for c in out["choices"]]
            assert got == [(0, prompts[0], "s3t1"), (1, prompts[0], "s4t1"),
                           (2, prompts[1], "s3t1"), (3, prompts[1], "s4t1")]
            assert out["usage"] == {"prompt_tokens": 3 + 5, "completion_tokens": 4 * 5, "total_tokens": 28}
            # streamed: the same indices (prompt_token_ids on each choice's first chunk)
            status, ev = await h.stream("/v1/completions", body(prompt=prompts, n=2, seed=3, return_token_ids=True,
                                                                stream_options={"include_usage": True}))
            assert status == 200 and ev[-1] == "[DONE]"
            firsts = {}
            tokens: dict[int, list] = {}
            for c in ev[:-2]:
                (ch,) = c["choices"]
                if "prompt_token_ids" in ch:
                    firsts[ch["index"]] = (ch["prompt_token_ids"], ch["text"].strip())
                tokens.setdefault(ch["index"], []).extend(ch["token_ids"])
            assert firsts == {0: (prompts[0], "s3t1"), 1: (prompts[0], "s4t1"),
                              2: (prompts[1], "s3t1"), 3: (prompts[1], "s4t1")}
            assert tokens == {k: [1, 2, 3, 4, 5] for k in range(4)}
            assert ev[-2]["usage"] == {"prompt_tokens": 8, "completion_tokens": 20, "total_tokens": 28}
            await settled(h)
            m = await h.metrics()
            assert metric(m, "proserve:dispatcher_requests_total", outcome="ok") == 8
    run(go())


def test_chat_n2_streamed_and_not():
    msgs = [{"role": "user", "content": "one two three"}]

    async def go():
        async with harness(colocated=True) as h:
            r = await h.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 3, "n": 2, "seed": 0})
            assert r.status_code == 200, r.text
            out = r.json()
            assert [(c["index"], c["message"]["content"]) for c in out["choices"]] == [
                (0, "s0t1 s0t2 s0t3"), (1, "s1t1 s1t2 s1t3")]
            # the prompt once (the fake worker counts a chat prompt as 1 token), the completions summed
            assert out["usage"] == {"prompt_tokens": 1, "completion_tokens": 6, "total_tokens": 7}
            status, ev = await h.stream("/v1/chat/completions", {"messages": msgs, "max_tokens": 3, "n": 2})
            assert status == 200 and ev[-1] == "[DONE]"
            assert sorted(c["choices"][0]["index"] for c in ev[:-1]) == [0, 0, 0, 1, 1, 1]
            await settled(h)
    run(go())


def test_over_the_cap_400_and_nothing_reaches_a_worker():
    async def go():
        async with harness() as h:
            r = await h.post("/v1/completions", body(n=fanout.MAX_FANOUT + 1))
            assert r.status_code == 400 and r.json()["error"]["param"] == "n"
            st, ev = await h.stream("/v1/completions", body(prompt=[[1]] * 65, n=2))
            assert st == 400 and "130 completions" in ev[0]["error"]["message"]
            r = await h.post("/v1/completions", body(n=0))
            assert r.status_code == 400 and r.json()["error"]["message"] == "n must be at least 1, got 0."
            assert all_received(h) == [] and h.d.limiter.total == 0 and in_flight(h) == 0
    run(go())


def test_a_sub_request_that_does_not_fit_fails_the_request_before_any_work():
    async def go():
        async with harness() as h:      # max_model_len 2048
            r = await h.post("/v1/completions", body(prompt=[[1] * 10, [2] * 2046], max_tokens=5))
            assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
            assert all_received(h) == [] and h.d.limiter.total == 0 and in_flight(h) == 0
    run(go())


def test_every_sub_request_takes_a_slot_429_when_they_are_not_all_free():
    async def go():
        async with harness(max_concurrent_per_key=3) as h:
            held = h.d.limiter.acquire("acme")       # one of the client's 3 slots is taken
            r = await h.post("/v1/completions", body(n=3))
            err = r.json()["error"]
            assert r.status_code == 429 and err["code"] == "too_many_concurrent_requests_for_key"
            assert "asks for 3 completions" in err["message"] and r.headers["retry-after"] == "1"
            assert all_received(h) == [] and h.d.limiter.per_client == {"acme": 1}
            held.release()
            assert h.d.limiter.total == 0 and h.d.limiter.per_client == {}
            m = await h.metrics()
            assert metric(m, "proserve:dispatcher_rejected_total", reason="client_overloaded") == 1
            assert metric(m, "proserve:dispatcher_requests_total", outcome="rejected") == 1
            r = await h.post("/v1/completions", body(n=2))
            assert r.status_code == 200 and len(r.json()["choices"]) == 2
            await settled(h)
    run(go())


async def _one_failed_two_cancelled(h, workers) -> None:
    """One sub-request of three failed, the two others were cancelled upstream, and
    nothing is left held: the metrics say so and every instance's queue is empty."""
    await until(lambda: sum(w.cancelled for w in workers) == 2, what="the two others to be cancelled")
    await settled(h)
    m = await h.metrics()
    assert metric(m, "proserve:dispatcher_requests_total", outcome="upstream_error") == 1
    assert metric(m, "proserve:dispatcher_requests_total", outcome="cancelled") == 2
    assert all(w.state.queue == [] and w.state.n_decode == 0 for w in h.d.registry.prefill)


def test_a_failing_sub_request_fails_the_request_and_cancels_the_others():
    """Unstreamed: the sub-request with seed 1 fails on both decode workers (a 500, retried
    once); the two others would take ~20 s and are cancelled upstream at once."""
    async def go():
        async with harness(n_decode=2, worker_kw={"decode_s": 0.2}) as h:
            for w in h.decodes:
                w.fail, w.fail_if = "500", (lambda b: b.get("seed") == 1)
            r = await h.post("/v1/completions", body(n=3, seed=0, max_tokens=100))
            assert r.status_code == 502, r.text
            assert "failed on two instances" in r.json()["error"]["message"]
            await _one_failed_two_cancelled(h, h.decodes)
    run(go())


def test_a_sub_stream_that_breaks_ends_the_stream_with_one_error_and_cancels_the_others():
    async def go():
        async with harness(colocated=True, n_prefill=2, worker_kw={"decode_s": 0.2}) as h:
            for w in h.prefills:
                w.fail, w.fail_after_tokens, w.fail_if = "drop", 2, (lambda b: b.get("seed") == 12)
            status, ev = await h.stream("/v1/completions", body(n=3, seed=10, max_tokens=100))
            assert status == 200 and ev[-1] == "[DONE]"
            errors = [e for e in ev[:-1] if "error" in e]
            assert len(errors) == 1 and errors[0]["error"]["code"] == 502
            assert ev[-2] is errors[0]                          # nothing after the error
            assert {e["choices"][0]["index"] for e in ev[:-2]} <= {0, 1, 2}
            await _one_failed_two_cancelled(h, h.prefills)
    run(go())


def test_a_client_that_goes_away_mid_stream_cancels_every_sub_request():
    async def go():
        async with harness(worker_kw={"decode_s": 0.2}) as h:
            seen = 0
            async with h.http.stream("POST", "/v1/completions", json=body(n=3, max_tokens=100, stream=True),
                                     headers={"authorization": f"Bearer {KEY}"}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        json.loads(line[5:])
                        seen += 1
                        if seen == 2:
                            break                    # leaving the block closes the connection
            await until(lambda: h.decodes[0].cancelled == 3, what="the three decode legs to be cancelled")
            await settled(h)
            m = await h.metrics()
            assert metric(m, "proserve:dispatcher_requests_total", outcome="cancelled") == 3
            assert h.d.registry.prefill[0].state.queue == []
    run(go())

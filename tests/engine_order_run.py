"""Drive one real vLLM engine with the ProServe scheduler plugin through the
admission-order scenarios of ``test_engine_scheduler.py`` and print what it did.

Run as a subprocess (vLLM spawns processes; the engine core runs in-process here,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so that every request of a scenario is
queued before the first step is scheduled)::

    python tests/engine_order_run.py SPEC.json RECORD.jsonl LATENCY_MODEL.json

SPEC.json: ``{"proserve": {...}, "scenarios": [{"name", "requests": [{"tag",
"prompt_len", "priority_class", "ttft_slo", "age"}]}]}``. ``proserve`` is the
plugin's configuration (``additional_config["proserve"]``) without
``latency_model`` and ``record_steps``, which come from the command line;
``age`` is how many seconds before submission the request "arrived" (sent as
``vllm_xargs.arrival_time``). The scenarios run one after the other, each to
completion.

Prints one JSON line ``{"engine": {"proserve": the plugin's configuration as
used, "max_num_batched_tokens", "max_num_seqs"}}``, then one per scenario:
``{"name", "submitted_at": Unix time of submission (the arrival times count
back from it), "ids": {tag: request id}}``. vLLM's engine ids are these ids
with a random suffix (``<id>-<8 characters>``). The plugin's step records (the
view each plan was made from, the plan, what vLLM scheduled) go to RECORD.jsonl.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

MAX_NUM_BATCHED_TOKENS = 16384
MAX_NUM_SEQS = 64


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(sys.argv[1]) as f:
        spec = json.load(f)
    record, model = sys.argv[2], sys.argv[3]
    proserve = dict(spec["proserve"], latency_model=model, record_steps=record)
    tiny = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "prefill", "models", "tiny-llama")
    llm = LLM(model=tiny, load_format="dummy", skip_tokenizer_init=True, max_model_len=2048, block_size=32,
              dtype="bfloat16", enforce_eager=True, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
              max_num_seqs=MAX_NUM_SEQS, enable_prefix_caching=False,
              scheduler_cls="proserve.prefill.engine_scheduler.ProServeScheduler",
              logits_processors=["proserve.prefill.params:ParamsValidator"],
              additional_config={"proserve": proserve})
    print(json.dumps({"engine": {"proserve": proserve, "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
                                 "max_num_seqs": MAX_NUM_SEQS}}), flush=True)
    rng = random.Random(0)
    for sc in spec["scenarios"]:
        reqs = sc["requests"]
        prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(1, 1000) for _ in range(r["prompt_len"])])
                   for r in reqs]
        now = time.time()
        params = [SamplingParams(max_tokens=1, ignore_eos=True, extra_args={
            "priority_class": r["priority_class"], "ttft_slo": r["ttft_slo"], "arrival_time": now - r["age"]})
            for r in reqs]
        outs = llm.generate(prompts, params, use_tqdm=False)
        ids = {r["tag"]: o.request_id for r, o in zip(reqs, outs)}
        print(json.dumps({"name": sc["name"], "submitted_at": now, "ids": ids}), flush=True)


if __name__ == "__main__":
    main()

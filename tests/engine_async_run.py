"""Run a vLLM CPU engine with ProServe's scheduler plugin, synchronously or under vLLM's
async scheduling, and print its greedy tokens (``tests/test_engine_scheduler_async.py``).

    python tests/engine_async_run.py sync|async CHECKPOINT RECORD

vLLM's CPU platform turns async scheduling off while it builds the config
(``CpuPlatform.check_and_update_config`` in ``vllm/platforms/cpu.py``: "async scheduling
is not required on CPU"). For ``async`` this process wraps that method to turn it back on,
so that the engine runs as it does on CUDA: ``EngineCore.step_with_batch_queue`` with two
steps in flight, the plugin as its ``AsyncScheduler`` variant. The engine runs in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), where the wrapper applies.

Prints one JSON line ``{"scheduler", "batch_queue_size", "async_scheduling"}`` and then one
``{"tokens": [...]}`` with every request's output token ids, in submission order.
"""

from __future__ import annotations

import json
import os
import random
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

MAX_NUM_BATCHED_TOKENS = 256   # small: long prompts are prefilled in chunks over several steps
#: prompt lengths and output lengths: chunked prefills, decodes, and requests that end with their
#: first token (max_tokens=1: vLLM skips them while that token is in flight)
REQUESTS = [(600, 12), (40, 1), (300, 9), (25, 16), (450, 1), (90, 5), (700, 3), (12, 20)]


def main() -> None:
    mode, checkpoint, record = sys.argv[1], sys.argv[2], sys.argv[3]
    use_async = mode == "async"
    from vllm.platforms.cpu import CpuPlatform

    cpu_check = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):
        cpu_check(cls, vllm_config)
        if use_async:
            vllm_config.scheduler_config.async_scheduling = True

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from proserve.profiler import modelfile
    proserve = {"local_policy": "slide_batching", "mode": "colocated", "record_steps": record,
                "latency_model": str(modelfile.CPU_TINY)}
    llm = LLM(model=checkpoint, skip_tokenizer_init=True, max_model_len=2048, block_size=32, dtype="bfloat16",
              enforce_eager=True, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_num_seqs=16,
              enable_prefix_caching=False, seed=0, async_scheduling=use_async,
              scheduler_cls="proserve.prefill.engine_scheduler.ProServeScheduler",
              additional_config={"proserve": proserve})
    core = llm.llm_engine.engine_core.engine_core     # the in-process EngineCore
    print(json.dumps({"scheduler": type(core.scheduler).__name__, "batch_queue_size": core.batch_queue_size,
                      "async_scheduling": bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling)}),
          flush=True)
    rng = random.Random(0)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(1, 1000) for _ in range(n)]) for n, _ in REQUESTS]
    params = [SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0) for _, m in REQUESTS]
    outs = llm.generate(prompts, params, use_tqdm=False)
    print(json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs]}), flush=True)


if __name__ == "__main__":
    main()

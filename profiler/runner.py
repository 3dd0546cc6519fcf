"""Drive a real vLLM engine through the grid and collect its measured step times.

The engine is vLLM's offline ``LLM`` with ProServe's scheduler plugin in
``stock`` mode (vLLM's own batching decisions) and ``record_steps`` on, so
every executed step is appended to a JSONL record with its batch composition
and measured time; :mod:`proserve.profiler.record` reads and checks it. The engine runs
in vLLM's default multi-process layout (front end, engine core, worker), the
layout the serving workers run in, so the times are the ones the serving
engine's online correction will see.

How the grid's batches are made (vLLM decides, the profiler arranges):

* **Only the intended requests in a step.** The front end adds requests one by
  one while the engine core is already stepping, so the first request of a
  batch could start alone. A multi-request batch is therefore preceded by a
  one-token *blocker* request: the batch's requests are added while the
  blocker's step runs and are all waiting when the next step is scheduled.
* **Cached prefixes (l_kv > 0).** A prompt of ``l_kv`` random tokens (a
  multiple of the block size) is run alone first, once per round; the grid's
  request is that prompt plus ``l_q`` fresh random tokens, so vLLM's prefix
  cache supplies ``l_kv`` tokens and the step computes ``l_q``.
* **Every prompt is fresh random token ids** (except a reused prefix), so
  nothing else hits the prefix cache.
* **Mixed batches.** The decoding requests start first; the prefill request is
  added once each of them has two output tokens.

Each submission's steps are checked against the grid point
(:func:`proserve.profiler.record.classify`); a submission that did not produce the
intended batches is retried (up to ``retries`` times).
"""

from __future__ import annotations

import os
import platform
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .grid import MIXED_AFTER, Point
from .record import Measurement, RecordReader, classify

BLOCKER_LEN = 256          # prompt tokens of the blocker request before calibration (warm_up)
BLOCKER_TARGET_S = 0.06    # the blocker's step should last this long: the batch is added meanwhile
BLOCKER_SETTLE_S = 0.01    # let the engine core start the blocker's step before the batch is added


@dataclass
class EngineSettings:
    model: str
    load_format: str = "dummy"
    device: str = "cpu"
    dtype: str = "bfloat16"
    block_size: int = 128
    max_model_len: int = 2048
    enforce_eager: bool = False
    skip_tokenizer_init: bool = True
    kv_cache_gib: int = 1
    gpu_memory_utilization: float | None = None
    cpu_bind: str | None = None
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 64
    seed: int = 0
    latency_model: str | None = None   # what the plugin loads (its estimates are not used here)
    extra: dict = field(default_factory=dict)


class EngineError(RuntimeError):
    pass


def _set_env(s: EngineSettings, verbose: bool) -> None:
    """Environment the engine's processes inherit; must be set before vLLM is imported."""
    if not verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if s.device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(s.kv_cache_gib))
        if s.cpu_bind:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = s.cpu_bind
    # vLLM's processes must be able to import the plugin
    root = str(Path(__file__).resolve().parent.parent)
    paths = os.environ.get("PYTHONPATH", "")
    if root not in paths.split(os.pathsep):
        os.environ["PYTHONPATH"] = root + (os.pathsep + paths if paths else "")


class Runner:
    """One vLLM engine with the recording plugin; :meth:`run_point` runs one grid point once."""

    def __init__(self, settings: EngineSettings, record_path: str | Path, verbose: bool = False,
                 retries: int = 2, log: Callable[[str], None] = print):
        self.s = settings
        self.retries = retries
        self.log = log
        self.rng = random.Random(settings.seed)
        self._ids = 0
        self._prefixes: dict[tuple[int, int], list[int]] = {}
        self.blocker_len = BLOCKER_LEN   # re-sized for this engine by warm_up (_calibrate_blocker)
        record_path = Path(record_path)
        record_path.parent.mkdir(parents=True, exist_ok=True)
        record_path.write_text("")
        self.reader = RecordReader(record_path)
        _set_env(settings, verbose)
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.platforms import current_platform

        if current_platform.device_type != settings.device:
            raise EngineError(f"--device {settings.device}, but the vLLM installed here runs on "
                              f"'{current_platform.device_type}'")
        self._SamplingParams, self._TokensPrompt = SamplingParams, TokensPrompt
        from proserve.profiler.modelfile import BUNDLED
        kwargs = dict(model=settings.model, load_format=settings.load_format, dtype=settings.dtype,
                      skip_tokenizer_init=settings.skip_tokenizer_init, max_model_len=settings.max_model_len,
                      block_size=settings.block_size, enforce_eager=settings.enforce_eager,
                      max_num_batched_tokens=settings.max_num_batched_tokens, max_num_seqs=settings.max_num_seqs,
                      enable_prefix_caching=True, seed=settings.seed,
                      # one batch at a time: a profiled step's time must be that batch's alone. Under
                      # async scheduling (vLLM's default on CUDA) the engine schedules the next step
                      # while this one runs, and the plugin measures overlapped steps (from the
                      # previous step's result, see prefill/engine_scheduler.py): not the isolated
                      # batch time Eq. 5-7 are fitted to
                      async_scheduling=False,
                      scheduler_cls="proserve.prefill.engine_scheduler.ProServeScheduler",
                      additional_config={"proserve": {
                          "local_policy": "stock", "record_steps": str(record_path),
                          "latency_model": str(settings.latency_model or BUNDLED)}})
        if settings.gpu_memory_utilization is not None:
            kwargs["gpu_memory_utilization"] = settings.gpu_memory_utilization
        kwargs.update(settings.extra)
        self.llm = LLM(**kwargs)
        self.engine = self.llm.llm_engine
        self.vocab = self.engine.model_config.get_vocab_size()
        if self.vocab < 16:
            raise EngineError(f"vocabulary of {self.vocab} tokens is too small to draw random prompts from")

    # -- environment facts for the model file's metadata ---------------------------------------
    def facts(self) -> dict:
        import torch
        import vllm
        from vllm.platforms import current_platform

        facts = {"vllm_version": vllm.__version__, "torch_version": torch.__version__,
                 "platform": current_platform.device_type, "python": platform.python_version(),
                 "host_cpu": _cpu_name(), "host_cpus": os.cpu_count()}
        if current_platform.device_type == "cuda":
            facts["gpu"] = torch.cuda.get_device_name(0)
        for var in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_ENABLE_V1_MULTIPROCESSING"):
            if var in os.environ:
                facts[var] = os.environ[var]
        facts.update(self._kv_facts())
        return facts

    def _kv_facts(self) -> dict:
        """KV memory of this engine, in the metadata keys the simulator reads
        (``kv_bytes_per_token`` for KV transfer times, ``num_kv_blocks`` per instance)."""
        import torch

        cfg = self.engine.vllm_config
        mc, pc, cc = cfg.model_config, cfg.parallel_config, cfg.cache_config
        out: dict = {}
        try:
            dtype = mc.dtype if cc.cache_dtype in (None, "auto") else getattr(torch, str(cc.cache_dtype), mc.dtype)
            per_token = (2 * mc.get_num_layers(pc) * mc.get_num_kv_heads(pc) * mc.get_head_size()
                         * torch.empty((), dtype=dtype).element_size())
            out["kv_bytes_per_token"] = int(per_token)
        except Exception as e:  # noqa: BLE001 - a fact for the metadata, not needed to profile
            self.log(f"warning: KV bytes per token unknown ({e})")
            return out
        blocks = cc.num_gpu_blocks
        if not blocks and self.s.device == "cpu":
            blocks = int(float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", self.s.kv_cache_gib)) * 2**30
                         // (per_token * self.s.block_size))
        if blocks:
            out["num_kv_blocks"] = int(blocks)
        return out

    # -- requests ---------------------------------------------------------------------------------
    def _tokens(self, n: int) -> list[int]:
        # ids 3.. avoid the usual special tokens (0 pad/unk, 1 bos, 2 eos)
        return [self.rng.randrange(3, self.vocab) for _ in range(n)]

    def _add(self, prompt: list[int], max_tokens: int) -> str:
        self._ids += 1
        rid = f"prof-{self._ids}"
        params = self._SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        self.engine.add_request(rid, self._TokensPrompt(prompt_token_ids=prompt), params)
        return rid

    def _prompt(self, l_q: int, l_kv: int, slot: int) -> list[int]:
        if l_kv == 0:
            return self._tokens(l_q)
        return self._prefixes[(l_kv, slot)] + self._tokens(l_q)

    def _slots(self, prefills) -> list[tuple[int, int, int]]:
        """(l_q, l_kv, slot): requests of one batch with equal l_kv get distinct prefixes."""
        count: dict[int, int] = {}
        out = []
        for q, k in prefills:
            out.append((q, k, count.get(k, 0)))
            count[k] = count.get(k, 0) + 1
        return out

    def new_round(self) -> None:
        """Forget the primed prefixes: each round primes its own (cache eviction cannot
        carry over, and no prefix is reused for more than one round)."""
        self._prefixes.clear()

    def _prime(self, prefills) -> list:
        """Run the missing cached prefixes of a batch; returns their steps (setup)."""
        need = [(k, slot) for _, k, slot in self._slots(prefills) if k and (k, slot) not in self._prefixes]
        if not need:
            return []
        for k, slot in need:
            self._prefixes[(k, slot)] = self._tokens(k)
            self._add(self._prefixes[(k, slot)], 1)
        self._drain()
        return self.reader.read_new()

    def _drain(self, on_output: Callable[[list], None] | None = None) -> None:
        while self.engine.has_unfinished_requests():
            outs = self.engine.step()
            if on_output is not None and outs:
                on_output(outs)

    def _submit(self, point: Point) -> list:
        """Submit one repeat of ``point``; return the steps the engine recorded for it."""
        stray = self.reader.read_new()
        if stray:
            self.log(f"warning: {len(stray)} step(s) recorded between grid points were ignored")
        blocker = self._needs_blocker(point)
        slots = self._slots(point.prefills)
        # every prompt is made before the blocker goes in: drawing thousands of random token
        # ids takes milliseconds, as long as the blocker's whole step on a fast CPU, and the
        # batch must be complete before that step ends
        prompts = [self._prompt(q, k, slot) for q, k, slot in slots]
        decode_prompts = [self._tokens(point.prompt) for _ in range(point.batch)] if point.kind != "prefill" else []
        if blocker:
            self._add(self._tokens(blocker), 1)
            time.sleep(BLOCKER_SETTLE_S)
        if point.kind == "prefill":
            for prompt in prompts:
                self._add(prompt, 1)
            self._drain()
        elif point.kind == "decode":
            for prompt in decode_prompts:
                self._add(prompt, point.tokens)
            self._drain()
        else:  # mixed: the prefills arrive while the batch decodes
            decoding = {self._add(prompt, point.tokens) for prompt in decode_prompts}
            counts: dict[str, int] = {}
            added = False

            def on_output(outs) -> None:
                nonlocal added
                for o in outs:
                    counts[o.request_id] = len(o.outputs[0].token_ids) if o.outputs else 0
                if not added and all(counts.get(r, 0) >= MIXED_AFTER for r in decoding):
                    added = True
                    for prompt in prompts:
                        self._add(prompt, 1)

            self._drain(on_output)
            if not added:
                raise EngineError(f"grid point {point.id}: the decoding requests finished before the "
                                  f"prefill could be added (request ids in outputs: {sorted(counts)[:3]})")
        return self.reader.read_new()

    def _needs_blocker(self, point: Point) -> int:
        n = len(point.prefills) if point.kind == "prefill" else point.batch
        return min(self.blocker_len, self.s.max_model_len - 1) if n > 1 else 0

    def run_point(self, point: Point, repeat: int) -> tuple[list[Measurement], bool]:
        """Run one repeat of ``point`` (priming its prefixes first), retrying a submission
        whose steps were not the intended batches; returns all classified measurements."""
        out: list[Measurement] = []
        for _ in range(1 + self.retries):
            for s in self._prime(point.prefills):
                out.append(Measurement.of(point.id, repeat, s, "setup"))
            steps = self._submit(point)
            labels, complete = classify(point, steps, blocker=self._needs_blocker(point))
            out += [Measurement.of(point.id, repeat, s, lab) for s, lab in labels]
            if complete:
                return out, True
            # a retry with the same prefixes: if one was evicted, prime it again
            self._prefixes = {key: v for key, v in self._prefixes.items()
                              if not any(k == key[0] for _, k in point.prefills)}
        return out, False

    def warm_up(self, points: list[Point]) -> int:
        """Run a few small batches of each kind and discard their steps; returns the step count."""
        n = 0
        picks = {}
        for p in sorted(points, key=lambda p: p.cost):
            picks.setdefault((p.kind, len(p.prefills) > 1, any(k for _, k in p.prefills)), p)
        for p in list(picks.values()) * 2:
            self._prime(p.prefills)
            n += len(self._submit(p))
        self.new_round()
        self.reader.read_new()
        self._calibrate_blocker()
        return n

    def _calibrate_blocker(self) -> None:
        """Size the blocker so that its step lasts about BLOCKER_TARGET_S on this engine:
        256 tokens took ~75 ms on a CPU without AVX-512 but ~7 ms with it, less than adding
        a 64-request batch takes, which then reached the engine over several steps."""
        times = []
        for _ in range(3):
            self._add(self._tokens(BLOCKER_LEN), 1)
            self._drain()
            times += [st.time for st in self.reader.read_new() if sum(q for q, _ in st.prefills) == BLOCKER_LEN]
        if times:
            t = sorted(times)[len(times) // 2]
            self.blocker_len = max(BLOCKER_LEN, min(self.s.max_model_len - 1, self.s.max_num_batched_tokens,
                                                    int(BLOCKER_LEN * BLOCKER_TARGET_S / max(t, 1e-4))))
            self.log(f"blocker: {BLOCKER_LEN} tokens took {1e3 * t:.1f} ms; using {self.blocker_len} tokens")

    def close(self) -> None:
        core = getattr(self.engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            try:
                core.shutdown()
            except Exception as e:  # noqa: BLE001 - best effort at exit
                print(f"warning: engine shutdown: {e}", file=sys.stderr)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"

"""Helpers for tests that run real vLLM workers: a seeded random-init checkpoint,
starting `python -m proserve.prefill` / `python -m proserve.decode`, and OpenAI-API calls."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from proserve.bench.local_cluster import free_port  # noqa: F401  (tests import it from here)

ROOT = Path(__file__).resolve().parent.parent
TINY_CONFIG = ROOT / "prefill" / "models" / "tiny-llama" / "config.json"


def make_checkpoint(dest: Path, seed: int = 0) -> Path:
    """A tiny Llama with normal(0, 0.02) weights saved as safetensors (a few MB):
    unlike load_format=dummy, its greedy outputs do not fall into short cycles."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = json.loads(TINY_CONFIG.read_text())
    conf = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")})
    torch.manual_seed(seed)
    LlamaForCausalLM(conf).save_pretrained(dest, safe_serialization=True)
    return dest


class Worker:
    """A `python -m proserve.prefill|decode` subprocess with its log file."""

    def __init__(self, role: str, port: int, log: Path, extra: list[str], env: dict | None = None):
        self.role, self.port, self.log_path = role, port, log
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log, "w")
        e = dict(os.environ)
        e.update(env or {})
        self.proc = subprocess.Popen([sys.executable, "-m", role, "--port", str(port), *extra],
                                     stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT, env=e,
                                     start_new_session=True)

    def wait_healthy(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.role} worker exited ({self.proc.returncode}); log:\n{self.log()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        raise TimeoutError(f"{self.role} worker not healthy in {timeout} s; log:\n{self.log()[-4000:]}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def complete(url: str, model: str, prompt: list[int], max_tokens: int, kv: dict | None = None,
             timeout: float = 120) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}
    if kv is not None:
        body["kv_transfer_params"] = kv
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def pd_generate(prefill: Worker, decode: Worker, model: str, prompt: list[int], max_tokens: int,
                xfer_id: str, kv_listen: str) -> tuple[list[int], dict]:
    """Prefill on one worker, KV over ZeroMQ, decode on the other (what the dispatcher will do)."""
    first = complete(prefill.url, model, prompt, 1,
                     {"do_remote_decode": True, "xfer_id": xfer_id, "remote_addr": kv_listen})
    params = first.get("kv_transfer_params") or {}
    out = complete(decode.url, model, prompt, max_tokens, {"do_remote_prefill": True, "xfer_id": xfer_id})
    return out["choices"][0]["token_ids"], params


def vllm_scheduler(proserve: dict, blocks: int, block_size: int = 16, async_scheduling: bool = False,
                   cls=None):
    """ProServe's scheduler plugin on a real vLLM scheduler over the embedded tiny model (no
    engine, no weights: the tests drive ``schedule()`` and ``update_from_output()`` themselves),
    with ``blocks`` KV blocks and ``additional_config = {"proserve": proserve}``.

    ``async_scheduling``: build it as under vLLM's async scheduling (the plugin then is its
    ``AsyncScheduler`` variant). vLLM's CPU platform turns the setting off while the config is
    built (``CpuPlatform.check_and_update_config``), so it is set on the built config. ``cls``: the
    class to build (default ``ProServeScheduler``), as vLLM builds its ``scheduler_cls``."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from proserve.prefill.engine_scheduler import ProServeScheduler
    tiny = Path(__file__).resolve().parent.parent / "prefill" / "models" / "tiny-llama"
    model_config = ModelConfig(model=str(tiny), skip_tokenizer_init=True, max_model_len=2048, dtype="bfloat16",
                               enforce_eager=True)
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=False)
    cache.num_gpu_blocks = blocks
    sched_cfg = SchedulerConfig(max_num_batched_tokens=16384, max_num_seqs=128, max_model_len=2048,
                                is_encoder_decoder=False, async_scheduling=False)
    vc = VllmConfig(model_config=model_config, cache_config=cache, scheduler_config=sched_cfg,
                    additional_config={"proserve": proserve})
    vc.scheduler_config.async_scheduling = async_scheduling
    kv = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["layer"], FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=64, dtype=torch.bfloat16))])
    return (cls or ProServeScheduler)(vc, kv, StructuredOutputManager(vc), block_size=block_size)

"""Free KV blocks of a decode worker, for the dispatcher's decode pick (§4.3).

A decode worker is a vLLM server, whose Prometheus ``/metrics`` already carries
what is needed: ``vllm:cache_config_info{num_gpu_blocks="N"}`` (the block pool
size; "gpu" is vLLM's name for the accelerator pool, the CPU backend included)
and ``vllm:kv_cache_usage_perc`` (the used fraction). Free blocks =
round((1 - usage) · N).

    python -m proserve.decode.status http://127.0.0.1:8200      # prints the free block count
"""

from __future__ import annotations

import re
import sys
import urllib.request

_USAGE = re.compile(r"^vllm:kv_cache_usage_perc(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.M)
_BLOCKS = re.compile(r'^vllm:cache_config_info\{[^}]*\bnum_gpu_blocks="(\d+)"', re.M)


class StatusError(RuntimeError):
    pass


def free_kv_blocks(metrics_text: str) -> int:
    """Parse free KV blocks from a vLLM ``/metrics`` page."""
    blocks = _BLOCKS.search(metrics_text)
    usage = _USAGE.search(metrics_text)
    if blocks is None or usage is None:
        missing = "num_gpu_blocks" if blocks is None else "vllm:kv_cache_usage_perc"
        raise StatusError(f"metrics page lacks {missing}: is this a vLLM server?")
    total = int(blocks.group(1))
    used = min(max(float(usage.group(1)), 0.0), 1.0)
    return int(round((1.0 - used) * total))


def fetch_free_kv_blocks(base_url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=timeout) as r:
            text = r.read().decode("utf-8", "replace")
    except OSError as e:
        raise StatusError(f"{base_url}: cannot read /metrics ({e})") from None
    return free_kv_blocks(text)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        print(fetch_free_kv_blocks(argv[0]))
    except StatusError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

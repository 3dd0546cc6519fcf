"""The benchmarks' "scaled" model: the bundled tiny Llama made ~30x heavier in compute.

On an AMX host one core prefills the bundled tiny Llama (2 layers, hidden 256) at ~9
us/token and steps it in ~3-15 ms, so the HTTP/SSE path and the scheduler's own
``schedule()`` time, not the engine, bound a benchmark, unlike a real model on a real
accelerator (steps of tens of ms). This shape (4 layers, hidden 1024, random weights,
served with ``--load-format dummy``) prefills at ~0.12 ms/token there and keeps the
engine the bottleneck. Same tokenizer and vocabulary as the tiny model, so the load
generator's prompts are the same token ids. Its latency model is profiled with
``scripts/profile.sh --model DIR`` on the host that runs the benchmark.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "prefill" / "models" / "tiny-llama"

SCALED_MODEL = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 4,
                "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64}


def make_scaled_model(dest: Path) -> Path:
    """Write the scaled random-weight model (config + the tiny model's tokenizer) to ``dest``."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for f in TINY.glob("tokenizer*"):
        shutil.copy(f, dest / f.name)
    config = json.loads((TINY / "config.json").read_text())
    config.update(SCALED_MODEL)
    (dest / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return dest


def has_weights(model_dir: Path) -> bool:
    """Whether a local model directory holds weight files (else it is served with dummy weights)."""
    d = Path(model_dir)
    return any(d.glob("*.safetensors")) or any(d.glob("*.bin")) or any(d.glob("*.pt"))

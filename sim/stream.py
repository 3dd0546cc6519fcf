"""The memory-light way to run the simulator over millions of requests.

:func:`simulate_stream` runs the same :class:`proserve.sim.cluster.Simulator` (the same
events in the same order, so the same decisions and token times) with two
differences that keep memory flat over a day of arrivals:

* arrivals are read lazily from an iterable already in arrival order (e.g.
  ``bench.workloads.iter_tagged(repeat_arrivals(...))``): one arrival ahead is
  in the event queue instead of all of them;
* each request, when it ends (finished or failed), goes to a
  :class:`proserve.sim.report.MetricsAccumulator` and to an optional callback, and the
  simulator keeps no reference to it, so its token timeline is freed.

Only the metrics come back (per class, as ``summarize`` gives them), not the
requests. tests/test_sim_stream.py checks that the metrics, steps and
preemptions equal a plain :func:`proserve.sim.cluster.simulate` of the same requests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from proserve.scheduler.estimator import LatencyModel
from proserve.scheduler.request import ConfigError, PriorityClass, Request
from proserve.scheduler.tdg import ClassMetrics, GainConfig

from .cluster import _ARRIVAL, SimConfig, Simulator
from .report import MetricsAccumulator


@dataclass
class StreamResult:
    metrics: dict[str, ClassMetrics]   # "all" and each class, as scheduler.tdg.summarize
    requests: int                      # requests that arrived
    first_arrival: float
    last_token: float
    duration: float                    # first arrival -> last token, simulated seconds
    steps: int
    preemptions: int
    betas: list[float]
    unended: int = 0                   # arrived but never finished nor failed (0 unless a bug)


class _StreamingSimulator(Simulator):
    """Feeds arrivals one ahead and hands ended requests on instead of keeping them."""

    def __init__(self, model, config, gain, classes, source: Iterable[Request],
                 on_end: Callable[[Request], None]):
        super().__init__(model, config, gain, classes)
        self._source = iter(source)
        self._on_end = on_end
        self.arrived = 0
        self.last_token = float("-inf")

    def first(self) -> Request:
        r = next(self._source, None)
        if r is None:
            raise ConfigError("the workload contains no requests")
        return r

    def _on_arrival(self, r: Request, now: float) -> None:
        # queue the next arrival before handling this one: arrivals keep their order among
        # themselves, and events of equal time still resolve by kind, as with all queued at once
        nxt = next(self._source, None)
        if nxt is not None:
            if nxt.arrival < r.arrival:
                raise ConfigError(f"streamed requests must come in arrival order: {nxt.id} arrives at "
                                  f"{nxt.arrival} after {r.id} at {r.arrival}")
            self._push(nxt.arrival, _ARRIVAL, nxt)
        self.arrived += 1
        super()._on_arrival(r, now)

    def _finished(self, r: Request, now: float) -> None:
        super()._finished(r, now)
        self._decode_target.pop(r.id, None)   # the simulator keeps this per request until the end
        if r.token_times:
            self.last_token = max(self.last_token, r.token_times[-1])
        self._on_end(r)


def simulate_stream(requests: Iterable[Request], model: LatencyModel, config: SimConfig | None = None,
                    gain: GainConfig | None = None, classes: dict[str, PriorityClass] | None = None,
                    on_end: Callable[[Request], None] | None = None) -> StreamResult:
    """Simulate ``requests`` (any iterable, in arrival order) keeping only metrics.

    ``on_end(r)``, if given, sees each request when it ends, after the metrics took it.
    """
    gain = gain or GainConfig()
    acc = MetricsAccumulator(gain)

    def end(r: Request) -> None:
        acc.add(r)
        if on_end is not None:
            on_end(r)

    sim = _StreamingSimulator(model, config or SimConfig(), gain, classes, requests, end)
    first = sim.first()
    res = sim.run([first])          # the rest follow through _on_arrival
    last = sim.last_token if acc.count and sim.last_token > float("-inf") else first.arrival
    duration = last - first.arrival
    return StreamResult(acc.result(duration), sim.arrived, first.arrival, last, duration, res.steps,
                        res.preemptions, res.betas, sim.arrived - acc.count)

"""Clairvoyant references (issue 13, "how far from the limit"): policies that know each
request's true output length, which no engine knows. They run only in the simulator, where
``Request.output_len`` is the true length (``registry.is_clairvoyant``; an engine refuses
them), and measure what the missing length information costs.

* ``slide_batching_oracle``: SlideBatching whose density of a request that has not yet
  emitted its first token is the gain its *whole* output can still earn per second of the
  work it needs (Alg. 1 line 5 with the request's full gain instead of its next token's):
  ``w_r·(w_p + (L−1)·w_d) / (exec + (L−1)·decode(l_kv))``, ``L`` its true output length and
  ``decode`` Eq. 6 at the context halfway through its output. Everything else (budget,
  URGENT, order, fill, headroom, aging) is SlideBatching's. With the true length a long
  answer's prefill is worth more than its first token, a one-token answer's is not.
* ``jitserve_gmax_oracle`` (:mod:`proserve.scheduler.alternatives.jitserve.gmax_oracle`):
  JITServe GMAX with its length predictor made perfect.
"""

from __future__ import annotations

from ..registry import register_local
from .slide_batching import SlideBatching


@register_local
class SlideBatchingOracle(SlideBatching):
    name = "slide_batching_oracle"
    summary = "simulator only: SlideBatching that knows each request's true output length (whole-request density)"
    clairvoyant = True

    def _annotate(self, Q, now: float):
        execs, remains, dens = super()._annotate(Q, now)
        c = self.est.costs()
        w_p, w_d = self.gain.w_p, self.gain.w_d
        for i, r in enumerate(Q):
            if r.token_times:
                continue                      # decoding: its next token's density, as Alg. 1
            rest = max(r.output_len - 1, 0)
            work = execs[i] + rest * c.decode(r.prefill_len + rest / 2)
            dens[i] = r.weight * (w_p + rest * w_d) / work
        return execs, remains, dens

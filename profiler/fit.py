"""From measured steps to a latency model: aggregate, split, fit Eq. 5-7, report, plot.

* :func:`aggregate` turns the ``used`` measurements into one sample per
  (grid point, batch composition): the **median** of its repeats. A step that
  another process slowed down moves a median of three by nothing, a mean by a
  third of the slow-down; the fit is least squares, so one such outlier would
  otherwise bend the coefficients.
* :func:`split` holds out whole grid points (seeded, stratified by kind);
  :func:`fit` fits on the rest with ``LatencyModel.fit`` (NNLS on relative
  error) and scores MAPE on both sides. The model written is the one fitted on
  the training points, so its held-out MAPE is an honest estimate of its error
  on batches it has not seen.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from proserve.scheduler import validate
from proserve.scheduler.estimator import COEFFS, BatchSample, LatencyModel

from .record import Measurement

KINDS = ("prefill", "decode", "mixed")


class FitError(ValueError):
    pass


@dataclass(frozen=True)
class Sample:
    """The median step time of one batch composition of one grid point."""

    point: str
    prefills: tuple[tuple[int, int], ...]
    decodes: tuple[int, ...]
    time: float
    times: tuple[float, ...]

    @property
    def kind(self) -> str:
        if self.prefills and self.decodes:
            return "mixed"
        return "prefill" if self.prefills else "decode"

    def batch(self) -> BatchSample:
        return BatchSample.of(self.prefills, self.decodes, self.time)


def aggregate(measurements: Iterable[Measurement]) -> list[Sample]:
    groups: dict[tuple, list[float]] = {}
    for m in measurements:
        if m.status == "used":
            groups.setdefault(m.key, []).append(m.time)
    return [Sample(p, pf, dec, statistics.median(ts), tuple(ts)) for (p, pf, dec), ts in groups.items()]


def point_kinds(samples: Iterable[Sample]) -> dict[str, str]:
    """Kind of each grid point from its samples: mixed if it has a mixed batch, else
    decode if it has a decode batch, else prefill (a decode point's own prefill
    step does not make it a prefill point)."""
    rank = {k: i for i, k in enumerate(KINDS)}
    out: dict[str, str] = {}
    for s in samples:
        if s.point not in out or rank[s.kind] > rank[out[s.point]]:
            out[s.point] = s.kind
    return out


def split(kinds: dict[str, str], holdout: float, seed: int) -> tuple[set[str], set[str]]:
    """Seeded random split of grid points (id -> kind) into (train ids, held-out ids).

    Whole points are held out, not single steps, so that no held-out batch has
    a near twin (its other repeats, the next decode step) in training. The
    split is stratified by kind, so prefill, decode and mixed batches are all
    tested; every kind keeps at least one point in training.
    """
    validate.number("", "--holdout", holdout, 0, 1, lo_open=True, hi_open=True, error=FitError)
    if len(kinds) < 2:
        raise FitError(f"a held-out split needs at least 2 grid points with data, got {len(kinds)}")
    rng = random.Random(seed)
    train: set[str] = set()
    test: set[str] = set()
    for kind in KINDS:
        ids = sorted(i for i, k in kinds.items() if k == kind)
        rng.shuffle(ids)
        n_test = min(len(ids) - 1, max(1, round(holdout * len(ids)))) if len(ids) >= 2 else 0
        test.update(ids[:n_test])
        train.update(ids[n_test:])
    return train, test


def mape(model: LatencyModel, samples: Sequence[Sample]) -> float:
    return model.mape([s.batch() for s in samples])


def noise(samples: Sequence[Sample]) -> float:
    """Repeat-to-repeat noise: median over samples of the mean |t - median| / median."""
    devs = [statistics.fmean(abs(t - s.time) / s.time for t in s.times) for s in samples if len(s.times) > 1]
    return statistics.median(devs) if devs else float("nan")


@dataclass
class FitResult:
    model: LatencyModel
    train: list[Sample]
    test: list[Sample]
    train_points: set[str] = field(default_factory=set)
    test_points: set[str] = field(default_factory=set)

    def mape(self, side: str, kind: str | None = None) -> float:
        samples = self.train if side == "train" else self.test
        if kind:
            samples = [s for s in samples if s.kind == kind]
        return mape(self.model, samples) if samples else float("nan")

    def summary(self) -> dict:
        """MAPE figures for the model file's metadata (fractions, not %)."""
        out = {"train_mape": self.mape("train"), "holdout_mape": self.mape("test"),
               "n_train_samples": len(self.train), "n_holdout_samples": len(self.test),
               "n_train_points": len(self.train_points), "n_holdout_points": len(self.test_points),
               "repeat_noise": noise(self.train + self.test)}
        by_kind = {}
        for kind in KINDS:
            n_tr = sum(s.kind == kind for s in self.train)
            n_te = sum(s.kind == kind for s in self.test)
            if n_tr or n_te:
                by_kind[kind] = {"train_mape": self.mape("train", kind), "holdout_mape": self.mape("test", kind),
                                 "n_train": n_tr, "n_holdout": n_te}
        out["by_kind"] = by_kind
        return _round(out)


def _round(x):
    if isinstance(x, float):
        return round(x, 5)
    if isinstance(x, dict):
        return {k: _round(v) for k, v in x.items()}
    return x


def fit(samples: Sequence[Sample], holdout: float = 0.2, seed: int = 0, metadata: dict | None = None) -> FitResult:
    train_ids, test_ids = split(point_kinds(samples), holdout, seed)
    train = [s for s in samples if s.point in train_ids]
    test = [s for s in samples if s.point in test_ids]
    if len(train) < len(COEFFS):
        raise FitError(f"only {len(train)} training samples; Eq. 5-7 has {len(COEFFS)} coefficients "
                       f"(use a bigger grid or a smaller --holdout)")
    model = LatencyModel.fit([s.batch() for s in train], metadata)
    return FitResult(model, train, test, train_ids, test_ids)


# -- report ------------------------------------------------------------------------------------
_UNITS = {"a_p": "s/token^2", "b_p": "s/token^2", "c_p": "s/token", "a_d": "s/token", "b_d": "s/request",
          "t_c": "s/batch"}


def _pct(x: float) -> str:
    return "   -   " if x != x else f"{100 * x:6.2f}%"


def format_report(result: FitResult, worst: int = 5) -> str:
    m = result.model
    lines = [f"latency model (Eq. 5-7) fitted on {len(result.train)} batches from {len(result.train_points)} "
             f"grid points; {len(result.test)} batches from {len(result.test_points)} points held out",
             "  prefill  a_p*l_q^2 + b_p*l_q*l_kv + c_p*l_q   decode  a_d*l_kv + b_d   batch  sum + t_c"]
    for name in COEFFS:
        lines.append(f"  {name} = {getattr(m, name):.4g} {_UNITS[name]}")
    lines.append(f"  {'MAPE':<9}{'train':>10}{'n':>6}{'held-out':>11}{'n':>6}")
    for kind in KINDS + (None,):
        n_tr = sum(1 for s in result.train if kind is None or s.kind == kind)
        n_te = sum(1 for s in result.test if kind is None or s.kind == kind)
        if n_tr or n_te:
            lines.append(f"  {kind or 'all':<9}{_pct(result.mape('train', kind)):>10}{n_tr:>6}"
                         f"{_pct(result.mape('test', kind)):>11}{n_te:>6}")
    lines.append(f"  repeat-to-repeat noise (median relative deviation from the median): "
                 f"{_pct(noise(result.train + result.test)).strip()}")
    if result.test and worst:
        lines.append("  worst held-out batches:")
        errs = sorted(result.test, key=lambda s: -abs(m.predict(s.batch()) - s.time) / s.time)
        for s in errs[:worst]:
            pred = m.predict(s.batch())
            lines.append(f"    {s.point} {describe(s):<40} measured {1e3 * s.time:9.2f} ms  "
                         f"predicted {1e3 * pred:9.2f} ms  ({100 * (pred - s.time) / s.time:+.1f}%)")
    return "\n".join(lines)


def describe(s: Sample) -> str:
    parts = []
    if s.prefills:
        pf = ",".join(f"{q}" if k == 0 else f"{q}@{k}" for q, k in s.prefills[:4])
        parts.append(f"prefill[{pf}{',...' if len(s.prefills) > 4 else ''}]")
    if s.decodes:
        parts.append(f"decode[{len(s.decodes)}x~{round(statistics.fmean(s.decodes))}]")
    return " ".join(parts)


# -- plots -------------------------------------------------------------------------------------
def plot(result: FitResult, out_dir: str | Path, title: str = "") -> list[Path]:
    """Predicted vs measured step time, one scatter per batch kind (log-log, y = x and ±10 %)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    except ImportError as e:  # pragma: no cover - depends on the extra
        raise FitError("plots need matplotlib: pip install 'proserve[plot]'") from e
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    m = result.model
    paths = []
    for kind in KINDS:
        tr = [s for s in result.train if s.kind == kind]
        te = [s for s in result.test if s.kind == kind]
        if not tr and not te:
            continue
        fig, ax = plt.subplots(figsize=(4.6, 4.4))
        for group, label, style in ((tr, "train", dict(marker="o", facecolors="none", edgecolors="tab:blue")),
                                    (te, "held-out", dict(marker="^", color="tab:red"))):
            if group:
                xs = [1e3 * s.time for s in group]
                ys = [1e3 * m.predict(s.batch()) for s in group]
                ax.scatter(xs, ys, s=18, lw=0.9, label=f"{label} (MAPE {100 * mape(m, group):.1f}%, n={len(group)})",
                           **style)
        vals = [1e3 * s.time for s in tr + te] + [1e3 * m.predict(s.batch()) for s in tr + te]
        lo, hi = min(vals) / 1.3, max(vals) * 1.3
        ax.plot([lo, hi], [lo, hi], color="black", lw=1, label="y = x")
        ax.plot([lo, hi], [1.1 * lo, 1.1 * hi], color="gray", lw=0.7, ls="--", label="±10 %")
        ax.plot([lo, hi], [lo / 1.1, hi / 1.1], color="gray", lw=0.7, ls="--")
        ax.set_xscale("log")
        ax.set_yscale("log")
        subs = (1.0, 2.0, 3.0, 5.0) if hi / lo < 30 else (1.0, 2.0, 5.0) if hi / lo < 300 else (1.0, 3.0)
        for axis in (ax.xaxis, ax.yaxis):   # plain numbers, no crowded minor labels
            axis.set_major_locator(LogLocator(base=10, subs=subs))
            axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            axis.set_minor_formatter(NullFormatter())
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_xlabel("measured step time (ms)")
        ax.set_ylabel("predicted, Eq. 5-7 (ms)")
        ax.set_title(f"{kind} batches" + (f"\n{title}" if title else ""), fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="upper left")
        fig.tight_layout()
        path = out / f"{kind}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths

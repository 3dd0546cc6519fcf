#!/usr/bin/env python3
"""One engine configuration against the others, paired by seed, over several
``python -m proserve.bench.engine_policies --seed S`` runs (issue 13; docs/results.md §4.6).

Each run's ``--seed`` tags the same stretch of trace with other priorities (and prompt
text), so a set of seeds varies which requests are high class. Reads the ``results.json``
of every ``--out`` given (the seed from the run's own argv), and prints per configuration
the mean ± sd over seeds of TDG_Ratio and SLO attainment, overall and per class, then the
reference configuration (``--ref``, a prefix of the policy name; default SlideBatching)
minus each other one, paired by seed: mean ± standard error and in how many seeds it is
ahead / level / behind. Runs that share a seed but come from different ``--out``
directories are paired too (a configuration run later on the same host).

    python scripts/engine_paired_seeds.py out/x19/seed* out/x19/stretch_seed*
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

METRICS = (("tdg", "all", "tdg_ratio"), ("slo", "all", "slo_attainment"),
           ("hi_tdg", "high", "tdg_ratio"), ("hi_slo", "high", "slo_attainment"),
           ("lo_tdg", "low", "tdg_ratio"), ("lo_slo", "low", "slo_attainment"))


def seed_of(argv: list[str]) -> int:
    """The ``--seed`` a run was given (engine_policies' default 0)."""
    for i, a in enumerate(argv):
        if a == "--seed" and i + 1 < len(argv):
            return int(argv[i + 1])
        if a.startswith("--seed="):
            return int(a.split("=", 1)[1])
    return 0


def load(dirs: list[Path]) -> dict[tuple[str, int], dict[str, float]]:
    """(policy, seed) -> metric -> value, from each directory's results.json (one rate each)."""
    vals: dict[tuple[str, int], dict[str, float]] = {}
    for d in dirs:
        path = d / "results.json" if d.is_dir() else d
        res = json.loads(path.read_text())
        seed = seed_of(res.get("argv", []))
        rates = res.get("rates", [])
        if len(rates) != 1:
            sys.exit(f"{path}: {len(rates)} rates; pair runs of one rate each")
        for row in res["rows"]:
            key = (row["policy"], seed)
            if key in vals:
                sys.exit(f"{path}: {row['policy']} seed {seed} appears twice")
            m = row["metrics"]
            vals[key] = {name: m[cls][field] for name, cls, field in METRICS if cls in m}
    return vals


def mean_sd_se(xs: list[float]) -> tuple[float, float, float]:
    m = statistics.fmean(xs)
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return m, sd, sd / math.sqrt(len(xs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="engine_policies --out directories (or results.json files)")
    ap.add_argument("--ref", default="slide_batching", help="the reference configuration: a prefix of its name")
    args = ap.parse_args(argv)
    vals = load(args.runs)
    policies = sorted({p for p, _ in vals})
    refs = [p for p in policies if p.startswith(args.ref)]
    if not refs:
        sys.exit(f"no configuration named {args.ref}*; have: {', '.join(policies)}")
    seeds = sorted({s for _, s in vals})
    names = [n for n, _, _ in METRICS]
    print(f"# seeds {', '.join(map(str, seeds))}; mean ± sd over seeds (n)")
    width = max(len(p) for p in policies)
    print(f"{'configuration':{width}}  " + "  ".join(f"{n:>15}" for n in names))
    for p in policies:
        ss = [s for s in seeds if (p, s) in vals]
        cells = []
        for n in names:
            xs = [vals[(p, s)][n] for s in ss if n in vals[(p, s)]]
            if xs:
                m, sd, _ = mean_sd_se(xs)
                cells.append(f"{m:.4f} ± {sd:.4f}")
            else:
                cells.append("-")
        print(f"{p:{width}}  " + "  ".join(f"{c:>15}" for c in cells) + f"  ({len(ss)})")
    for ref in refs:
        print(f"\n# {ref}\n#   minus each, paired by seed: mean ± standard error (seeds ahead/level/behind)")
        for p in policies:
            if p == ref:
                continue
            ss = [s for s in seeds if (p, s) in vals and (ref, s) in vals]
            if not ss:
                continue
            cells = []
            for n in names:
                d = [vals[(ref, s)][n] - vals[(p, s)][n] for s in ss if n in vals[(ref, s)] and n in vals[(p, s)]]
                if not d:
                    continue
                m, _, se = mean_sd_se(d)
                ahead, behind = sum(x > 1e-9 for x in d), sum(x < -1e-9 for x in d)
                cells.append(f"{n} {m:+.4f} ± {se:.4f} ({ahead}/{len(d) - ahead - behind}/{behind})")
            print(f"  {p}: " + "; ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())

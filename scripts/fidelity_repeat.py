#!/usr/bin/env python3
"""The real cluster against itself: two `scripts/bench_fidelity.py` output directories with
the same configurations, compared the way the simulator is judged (docs/fidelity.md,
"Repeatability"): per deployment × policy × rate, run B's TTFT/TPOT P50/P90 relative to
run A's and the TDG_Ratio difference, and how many rows (classes all/high/low) are within
the fidelity target (≤ 10 % on P50 and P90, TDG_Ratio within 0.03).

    python scripts/fidelity_repeat.py out/fidelity out/fidelity-rep
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

KEYS = ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90")


def _rows(out: str) -> dict:
    # rows.json holds [real, sim, err] per figure; the real figures are the same in every variant
    rows = json.loads((Path(out) / "rows.json").read_text())["served"]
    return {(r["deployment"], r["policy"], r["rate"]): r["classes"] for r in rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/fidelity_repeat.py", description=__doc__.split("\n\n")[0])
    p.add_argument("run_a", help="bench_fidelity.py --out of the first real runs")
    p.add_argument("run_b", help="... of the repeat")
    args = p.parse_args(argv)
    a_rows, b_rows = _rows(args.run_a), _rows(args.run_b)
    print("| deployment | policy | req/s | TTFT P50 A / B ms (diff) | TTFT P90 diff | TPOT P50 A / B ms (diff) "
          "| TPOT P90 diff | TDG_Ratio A / B | SLO att. A / B |")
    print("|---|---|---|---|---|---|---|---|---|")
    within = total = 0
    for k in sorted(set(a_rows) & set(b_rows)):
        for cls in ("all", "high", "low"):
            a, b = a_rows[k][cls], b_rows[k][cls]
            if a["errors"] or b["errors"]:
                continue
            d = {m: (b[m][0] - a[m][0]) / a[m][0] for m in KEYS}
            tdg = b["tdg_ratio"][0] - a["tdg_ratio"][0]
            total += 1
            within += all(abs(v) <= 0.10 for v in d.values()) and abs(tdg) <= 0.03
            if cls != "all":
                continue
            print(f"| {k[0]} | {k[1]} | {k[2]:g} | {a['ttft_p50'][0] * 1e3:.0f} / {b['ttft_p50'][0] * 1e3:.0f} "
                  f"({d['ttft_p50']:+.0%}) | {d['ttft_p90']:+.0%} | {a['tpot_p50'][0] * 1e3:.1f} / "
                  f"{b['tpot_p50'][0] * 1e3:.1f} ({d['tpot_p50']:+.0%}) | {d['tpot_p90']:+.0%} | "
                  f"{a['tdg_ratio'][0]:.3f} / {b['tdg_ratio'][0]:.3f} | "
                  f"{a['slo_attainment'][0]:.3f} / {b['slo_attainment'][0]:.3f} |")
    print(f"\nrows (classes all/high/low, no errors) where B is within the fidelity target of A: {within}/{total}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

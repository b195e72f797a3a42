"""Where taylor_net's certificate loses the margin (issue #55, item 4; docs/results.md, "Accurate ViTs"):
from one or more ``certify --json`` outputs, per model and ε, the median over the correctly classified
images of each loss's share of the clean margin at the class closest to failing (first order, kinks,
each block's remainders, LayerProject's and attention's summed per block), the median unstable neurons
and straddling tokens per block, and the certified share, as a Markdown table:

    python -m bench certify --model zoo/NAME.safetensors --dataset DATA --eps 0.01,0.02 \\
        --bounds taylor_net --limit 40 --json > run.json
    python tools/margin_shares.py run.json [more.json ...] [--label after]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path


def _median(values: list[float]) -> float:
    kept = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(kept) if kept else math.nan


def rows(run: dict, label: str) -> list[str]:
    """The table's rows of one ``certify --json`` output."""
    model = Path(run["meta"]["model"]).stem
    correct = run["samples"]["correct"]
    out = []
    for eps, diag in run["samples"]["diagnostics"].get("taylor_net", {}).items():
        keep = [i for i, ok in enumerate(correct) if ok]
        share = lambda col, keep=keep, diag=diag: _median([diag[col][i] / diag["margin"][i] for i in keep
                                                           if diag[col][i] is not None])
        blocks = sorted({int(m.group(1)) for k in diag if (m := re.fullmatch(r"unstable_(\d+)", k))})
        rem = []
        for b in blocks:  # each block's remainders: LayerProject's (with its groups) and attention's
            cols = [k for k in diag if re.fullmatch(rf"remainder_(project|attention){b}(_\w+)?", k)]
            sums = [sum(diag[k][i] or 0.0 for k in cols) / diag["margin"][i] for i in keep]
            rem.append(f"{_median(sums):.2f}")
        unstable = " / ".join(f"{_median([diag[f'unstable_{b}'][i] for i in keep]):.0f}" for b in blocks)
        straddling = " / ".join(f"{_median([diag[f'straddling_{b}'][i] for i in keep]):.0f}" for b in blocks)
        certified = run["certified_accuracy"]["taylor_net"][eps]
        out.append(f"| `{model}` | {label} | {eps} | {share('first_order'):.2f} | {share('kinks'):.2f} | "
                   f"{' / '.join(rem)} | {unstable} | {straddling} | {certified:.3f} |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="certify --json outputs")
    ap.add_argument("--label", default="", help="a label for the rows (e.g. the commit)")
    args = ap.parse_args(argv)
    table = []
    for path in args.runs:  # every file read and tabled before anything is printed: no half table
        try:
            table += rows(json.loads(Path(path).read_text()), args.label)
        except (OSError, json.JSONDecodeError) as e:
            print(f"error: {path}: {e}", file=sys.stderr)
            return 2
        except (KeyError, TypeError, ZeroDivisionError) as e:
            print(f"error: {path} is not a certify --json output with taylor_net's diagnostics ({e!r})",
                  file=sys.stderr)
            return 2
    print("| model | code | ε | first order | kinks | remainders per block | unstable per block | "
          "straddling per block | certified |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())

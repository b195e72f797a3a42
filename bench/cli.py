"""``python -m bench``: point, run, report, compare, baseline.

Bad input ends with one line on stderr and exit code 2: argparse's own errors, and every
InputError raised by the library (shapes, values, files, kinds).
"""

from __future__ import annotations

import argparse
import sys

from models import InputError

from .env import set_threads


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not argparse's usage block
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {s!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="torch CPU threads (default $BENCH_THREADS or 1)")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    pt = sub.add_parser("point", help="every bound of one layer at one input and ε, against PGD")
    pt.add_argument("--layer", required=True, help="layer or stack file (.safetensors)")
    pt.add_argument("--input", required=True, help="input file holding X [n,d] or [B,n,d]")
    pt.add_argument("--eps", required=True, type=float, help="radius of the Frobenius ball")
    pt.add_argument("--bounds", default="", help="comma-separated bound names (default: all that apply)")
    pt.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    pt.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    pt.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    pt.add_argument("--pgd-steps", type=_positive_int, default=100)
    pt.add_argument("--pgd-restarts", type=_positive_int, default=8)
    pt.add_argument("--seed", type=_positive_int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    set_threads(args.threads)
    try:
        if args.command == "point":
            from .point import run

            return run(args)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 2

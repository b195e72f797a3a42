"""Where taylor_net's unit ranges go (docs/results.md, "Accurate ViTs"): for every refinement of the
second pass (the units whose range the backward pass bounds before a kink: a block's FFN neurons, a
token's radial change at LayerProject), the median over units and directions of the backward pass's
bound on a unit's move, and the median share of it taken by the first order, the kinks and each
stage's remainder. With ``--tune-steps N``, also the certified count and the unstable units on the
first ``--limit`` images when every refinement tunes its ReLUs' lower slopes per unit by N projected
Adam steps (α-CROWN's slopes on the ranges, not only on the margins); every slope in [0, 1] gives a
sound range, and each keeps its best iterate. A measurement, not a registered bound.

    python tools/range_shares.py zoo/digits-d32-b3-h2-c0.5-q2.safetensors --eps 0.05 --images 0-7
    python tools/range_shares.py zoo/digits-d32-b2-h2-c0.5-q1.safetensors --eps 0.05 --tune-steps 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict

import torch

from bench.nets.accuracy import load_model, select_images
from bounds.network.backward import Losses, backward
from bounds.network.slopes import optimized_backward
from bounds.network.taylor_net import ROUND, TaylorNet
from models import InputError, check_eps


class Measured(TaylorNet):
    """taylor_net whose refinements record their bounds' parts, or tune their slopes (``steps`` > 0)."""

    def __init__(self, *args, steps: int = 0):
        super().__init__(*args)
        self.steps = steps
        self.calls: list[tuple[str, int, float, dict[str, float]]] = []

    def _refiner(self, log: list, eps: float):
        def refine(units, lo, hi):
            Lam = torch.cat([units, -units], 1)
            if self.steps:
                both, mag = optimized_backward(log, Lam, self.embed, eps, ROUND, steps=self.steps)
            else:
                parts = Losses()
                both, mag = backward(log, Lam, self.embed, eps, losses=parts)
                move = -both  # the bound on each unit's move, per direction
                shares = {"first order": parts.first_order, "kinks": parts.kinks, **parts.remainders}
                last = log[-1]
                after = f"{len(log)} stages ({getattr(last, 'name', None) or type(last).__name__} last)"
                self.calls.append((after, units.shape[1], float(move.median()),
                                   {k: float((v / move).median()) for k, v in shares.items()}))
            both = both - ROUND * mag
            k = units.shape[1]
            return torch.maximum(lo, both[:, :k]), torch.minimum(hi, -both[:, k:])
        return refine


def indices(text: str) -> list[int]:
    """'0-7' or '0,3,5' as a list of indices."""
    out = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b) + 1)) if b else [int(a)]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--dataset", default="digits")
    p.add_argument("--eps", type=float, default=0.05)
    p.add_argument("--images", default="0-7", help="test images for the shares: '0-7' or '0,3,5'")
    p.add_argument("--tune-steps", type=int, default=0)
    p.add_argument("--limit", type=int, default=30, help="images certified with --tune-steps")
    a = p.parse_args()
    torch.set_num_threads(1)
    try:  # what needs no work first
        check_eps(a.eps)
        try:
            which = indices(a.images)
        except ValueError:
            raise InputError(f"--images must be indices such as 0-7 or 0,3,5, got {a.images!r}") from None
        if a.tune_steps < 0 or a.limit < 1:
            raise InputError("--tune-steps must be at least 0 and --limit at least 1")
        net = load_model(a.model)[0]
        X, y, _ = select_images(a.dataset, net, max(which) + 1 if not a.tune_steps else a.limit)
    except InputError as e:
        print(f"error: {e}".replace("\n", " "), file=sys.stderr)
        sys.exit(2)
    if a.tune_steps:
        for steps in (0, a.tune_steps):
            c = Measured(net, X, y, steps=steps).certify(a.eps)
            unstable = [int(u.sum()) for u in c.diagnostics.unstable]
            print(f"slopes tuned by {steps} steps: certified {int(c.certified.sum())} of {len(y)}, "
                  f"unstable units per block (summed over images) {unstable}")
        return
    rows: dict[str, list] = defaultdict(list)
    for i in which:
        T = Measured(net, X[i:i + 1], y[i:i + 1])
        T.one_pass(a.eps, slice(None), "taylor", refine=True)
        for at, units, move, shares in T.calls:
            rows[at].append((units, move, shares))
    med = statistics.median
    for at, got in rows.items():
        names = dict.fromkeys(k for _, _, s in got for k in s)
        parts = ", ".join(f"{k} {100 * med(s.get(k, 0.0) for _, _, s in got):.0f} %" for k in names)
        print(f"units after {at}: {med(u for u, _, _ in got):g} units, move "
              f"{med(m for _, m, _ in got):.4f}: {parts}")


if __name__ == "__main__":
    main()

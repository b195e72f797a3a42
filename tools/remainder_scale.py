"""Which remainder is the lever (docs/results.md, "Accurate ViTs"): taylor_net's certified count on the
first ``--limit`` test images when attention's remainder, in every form it takes (the ball, the rows,
the rows along a functional, the second order on the set), is multiplied by each ``--scales`` factor.
A factor below 1 is NOT sound: this measures how much a tighter remainder would buy, never a
certificate.

    python tools/remainder_scale.py zoo/digits-d32-b3-h2-c0.5-q2.safetensors --eps 0.05 --scales 1,0.5,0.3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import bounds.network.stages.attention as attention
from bench.nets.accuracy import load_model, select_images
from bounds.network.taylor_net import TaylorNet
from models import InputError, check_eps

# attention's remainder, as the stage reads it from bounds.remainder and its own set readings
FORMS = ("remainder", "set_remainder", "row_bound", "second_order_rows", "functional_rows")


def scaled(scale: dict[str, float]) -> None:
    """Every form in FORMS multiplied by scale['s'] (read at each call)."""
    for name in FORMS:
        original = getattr(attention, name)

        def times(*args, _f=original, **kwargs):
            out = _f(*args, **kwargs)
            if isinstance(out, tuple):
                return tuple(o * scale["s"] if torch.is_tensor(o) else o for o in out)
            return out * scale["s"]

        setattr(attention, name, times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--dataset", default="digits")
    p.add_argument("--eps", type=float, default=0.05)
    p.add_argument("--limit", type=int, default=30)
    p.add_argument("--scales", default="1,0.5,0.3")
    a = p.parse_args()
    torch.set_num_threads(1)
    try:  # what needs no work first
        check_eps(a.eps)
        try:
            factors = [float(s) for s in a.scales.split(",")]
        except ValueError:
            raise InputError(f"--scales must be numbers such as 1,0.5, got {a.scales!r}") from None
        if a.limit < 1 or any(f < 0 for f in factors):
            raise InputError("--limit must be at least 1 and every scale at least 0")
        net = load_model(a.model)[0]
        X, y, _ = select_images(a.dataset, net, a.limit)
    except InputError as e:
        print(f"error: {e}".replace("\n", " "), file=sys.stderr)
        sys.exit(2)
    scale = {"s": 1.0}
    scaled(scale)
    for f in factors:
        scale["s"] = f
        start = time.perf_counter()
        c = TaylorNet(net, X, y).certify(a.eps)
        d = c.diagnostics
        losses = {k: round(statistics.median(v.tolist()), 3) for k, v in d.remainders.items()}
        print(f"attention's remainder × {f:g}: certified {int(c.certified.sum())} of {len(y)} "
              f"({time.perf_counter() - start:.0f} s); median remainders (margins) {losses}")


if __name__ == "__main__":
    main()

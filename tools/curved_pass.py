"""What the curved pass buys (docs/results.md, "Accurate ViTs"): taylor_net on the first ``--limit`` test
images with and without attention's second order exactly along the margins the second pass leaves short
(docs/bounds.md §5.1, "Attention's remainder along a functional, its second order exact"), image by
image, with seconds an image. Both runs are certificates; the second is the suite before the pass.

    python tools/curved_pass.py zoo/digits-d32-b3-h2-c0.5-q2.safetensors --eps 0.05
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import bounds.network.stages.attention as attention
from bench.nets.accuracy import load_model, select_images
from bounds.network.taylor_net import TaylorNet
from models import InputError, check_eps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--dataset", default="digits")
    p.add_argument("--eps", type=float, default=0.05)
    p.add_argument("--limit", type=int, default=30)
    a = p.parse_args()
    torch.set_num_threads(1)
    try:  # what needs no work first
        check_eps(a.eps)
        if a.limit < 1:
            raise InputError(f"--limit must be at least 1, got {a.limit}")
        net = load_model(a.model)[0]
        X, y, _ = select_images(a.dataset, net, a.limit)
    except InputError as e:
        print(f"error: {e}".replace("\n", " "), file=sys.stderr)
        sys.exit(2)
    verdicts = {}
    for name, cap in (("with the curved pass", attention.CURVED_MAX), ("without it", 0)):
        attention.CURVED_MAX = cap  # 0: no step takes a Hessian, as before the pass
        start = time.perf_counter()
        c = TaylorNet(net, X, y).certify(a.eps)
        verdicts[name] = c.certified
        print(f"{name}: certified {int(c.certified.sum())} of {len(y)}, "
              f"{(time.perf_counter() - start) / len(y):.2f} s an image")
    on, off = verdicts.values()
    print(f"images only with it: {(on & ~off).nonzero()[:, 0].tolist()}; "
          f"only without it: {(off & ~on).nonzero()[:, 0].tolist()}")


if __name__ == "__main__":
    main()

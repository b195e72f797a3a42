"""The parts of taylor_net's deviation set after every stage, for one model, ε and a few test images
(docs/bounds.md §5.1; docs/results.md, "Where that input radius comes from"): the first-order part
ε‖G‖₂, the symbols' share, the shift, the remainder balls E (their sum and per source) and the set's
radius, with each stage's relaxed units. Shows which part a later remainder's radius is made of.

    python tools/taylor_net_sets.py zoo/MODEL.safetensors --dataset fashion-mnist --eps 0.01 --images 0
        [--refine]   # the second pass's set (every unit's range refined by the backward pass)
        [--all]      # every stage, where the pass would stop at a set LayerNorm refuses
        [--second-order]  # attention's second order on the set's generator formed at every layer,
                          # past FORM_ENTRIES (d·P² entries a row: 315 MB at d 64, P 784; minutes)
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from bench.nets.accuracy import load_model
from bounds.network.stages.second_order import FORM_ENTRIES
from bounds.network.taylor_net import TaylorNet
from bounds.norms import gram_norm
from models import InputError, check_eps
from models.data import load_dataset


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--dataset", default="digits")
    p.add_argument("--eps", type=float, default=0.01)
    p.add_argument("--images", default="0", help="comma-separated test image indices")
    p.add_argument("--refine", action="store_true")
    p.add_argument("--all", action="store_true", help="every stage, past a refusal")
    p.add_argument("--second-order", action="store_true",
                   help="form attention's second order on the set at every layer (second pass only)")
    a = p.parse_args()
    torch.set_num_threads(1)
    try:  # what needs no work first: the indices, ε, then the model and data
        idx = [int(i) for i in a.images.split(",")]
        check_eps(a.eps)
        net, _ = load_model(a.model)
        _, _, tx, ty = load_dataset(a.dataset)
        if not all(0 <= i < len(ty) for i in idx):
            raise InputError(f"--images must be indices below {len(ty)}, got {a.images!r}")
    except ValueError as e:  # InputError is one; int() of a bad index is another
        print(f"error: {e}".replace("\n", " "), file=sys.stderr)
        sys.exit(2)
    tn = TaylorNet(net, tx[idx], ty[idx], form_entries=math.inf if a.second_order else FORM_ENTRIES)
    with torch.inference_mode():
        stages = tn.stages(a.eps, slice(None), [], refine=a.refine, form=True, refuse=not a.all)
    for name, S, units in stages:
        B, n, d, P = S.G.shape
        G = S.G.reshape(B, n * d, P)
        first = a.eps * gram_norm(G.mT @ G)
        balls = {s: S.rho[:, i].tolist() for i, s in enumerate(S.sources)}
        print(f"{name:<12} units {None if units is None else units.tolist()}  first {first.tolist()}  "
              f"symbols {S.box_norms()[1].tolist()}  shift {S.c.flatten(1).norm(dim=-1).tolist()}  "
              f"balls {S.ball().tolist()}  radius {S.radius(a.eps).tolist()}  per source {balls}")


if __name__ == "__main__":
    main()

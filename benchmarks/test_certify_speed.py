"""Seconds per image of whole-network certification (docs/bounds.md §5) side by side: this suite's
LoFAST (‖M‖), Taylor, best and taylor_net (§5.1) against CROWN and α-CROWN (auto_LiRPA) on the same
model, the same first test images and ε = 0.02, as LoFAST's Table 1 reports s/sample.

    pytest benchmarks/test_certify_speed.py --benchmark-enable --benchmark-only \\
        --benchmark-group-by=param:model --benchmark-columns=mean

Each round certifies the images from scratch (the clean trace and every certified norm), so a
bound's time is its cost on its own; ``extra_info`` holds seconds per image and the share certified.
The Fashion-MNIST model needs Debian's dataset-fashion-mnist. α-CROWN beyond the 1-block model needs
``BENCH_HEAVY=1``: on the 3-block digits model one image ran out of 20 GB (CROWN alone takes ≈ 90 s
an image on the Fashion-MNIST one). README "CROWN" has the numbers.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from bench.core.env import keep_freed_memory
from bench.nets.accuracy import first_test_images, load_model
from bounds import crown
from bounds.certificates import reuse
from bounds.network import Certifier
from bounds.network.netcrown import METHODS, TracedViT, verify
from bounds.network.taylor_net import TaylorNet
from models import InputError

torch.set_num_threads(1)
keep_freed_memory()  # as python -m bench does: auto_LiRPA's large tensors are reused, not remapped

ZOO = Path(__file__).resolve().parents[1] / "zoo"
EPS = 0.02
# (file stem, dataset, images): α-CROWN costs ≈ 16 s and 8 GB an image on the 1-block digits model
MODELS = {"digits-d32-b1": ("digits-d32-b1-h2-c0.5-q1-m0.003", "digits", 8),
          "digits-d32-b3": ("digits-d32-b3-h2-c0.5-q1-m0.003", "digits", 8),
          "fashion-d128-b3": ("fashion-mnist-d128-b3-h4-p7-c0.5-q1-m0.01", "fashion-mnist", 2)}
# where α-CROWN fits in this box's 23 GB: on the 3-block digits model one image ran out of 20 GB
ALPHA_FITS = {"digits-d32-b1"}
SUITE = ["lofast_M", "taylor", "best", "taylor_net"]


def _images(model: str):
    stem, dataset, n = MODELS[model]
    net, _ = load_model(ZOO / f"{stem}.safetensors")
    try:
        X, y = first_test_images(dataset, net, n)
    except InputError as e:  # Fashion-MNIST is a Debian package, not a dependency
        pytest.skip(str(e))
    return net, X.double(), y


def _suite(net, X, y, name: str) -> torch.Tensor:
    if name == "taylor_net":  # its clean trace and every stage from scratch
        return TaylorNet(net, X, y).certify(EPS).certified
    with reuse():  # a fresh cache: the certified norms are computed, not taken from another round
        return Certifier(net, X, y).certify(name, EPS).pairwise


def _crown(net, X, y, name: str) -> torch.Tensor:
    return verify(net, X, y, EPS, name, TracedViT(net)).certified


@pytest.mark.parametrize("method", [*SUITE, *METHODS])
@pytest.mark.parametrize("model", list(MODELS))
def test_certify_speed(benchmark, model, method):
    if method in METHODS:
        if not crown.available():
            pytest.skip(crown.INSTALL)
        if method == "alpha_crown" and model not in ALPHA_FITS and os.environ.get("BENCH_HEAVY") != "1":
            pytest.skip("α-CROWN needs > 20 GB an image on this model: set BENCH_HEAVY=1")
    net, X, y = _images(model)
    run = _crown if method in METHODS else _suite
    certified = benchmark.pedantic(run, args=(net, X, y, method), rounds=1, iterations=1)
    benchmark.extra_info.update(images=len(X), eps=EPS, certified=float(certified.double().mean()),
                                seconds_per_image=benchmark.stats.stats.mean / len(X))

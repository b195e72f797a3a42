"""Seconds per image of whole-network certification (docs/bounds.md §5) side by side: this suite's
LoFAST (‖M‖), Taylor, best and taylor_net (§5.1) against CROWN and α-CROWN (auto_LiRPA) on the same
model, the same first test images and ε = 0.02, as LoFAST's Table 1 reports s/sample.

    pytest benchmarks/test_certify_speed.py --benchmark-enable --benchmark-only \\
        --benchmark-group-by=param:model --benchmark-columns=median

Each round certifies the images from scratch (the clean trace and every certified norm), so a
bound's time is its cost on its own, after one untimed round for the suite's methods (torch's lazy
set-up on a process's first call, which a sweep pays once), whose time is the median of the rounds
that fill about ``SUITE_SECONDS`` (CROWN's, seconds an image, one round); ``extra_info`` holds seconds
per image, the share certified and the ratio to one forward + backward pass of the model on the same
images (the input gradient of the cross-entropy in float64, as the certifier computes: one PGD step),
timed right after the method so that both see the same load. At the end of the module a table lists every
method's s/image and that ratio, one run for all. The Fashion-MNIST model needs Debian's
dataset-fashion-mnist. α-CROWN beyond the 1-block model needs ``BENCH_HEAVY=1``: on the 3-block
digits model one image ran out of 20 GB (CROWN alone takes ≈ 90 s an image on the Fashion-MNIST
one). docs/crown.md has the numbers. ``BENCH_DEVICE=cuda`` times every method on the GPU (the model,
images and certificates there, float64; each round ends with a synchronize).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bench.core.env import keep_freed_memory
from bench.nets.accuracy import first_test_images, load_model
from bounds import crown
from bounds.network import Certifier
from bounds.network.netcrown import METHODS, TracedViT, verify
from bounds.network.taylor_net import TaylorNet
from models import InputError

torch.set_num_threads(1)
keep_freed_memory()  # as python -m bench does: auto_LiRPA's large tensors are reused, not remapped

ZOO = Path(__file__).resolve().parents[1] / "zoo"
DEVICE = torch.device(os.environ.get("BENCH_DEVICE", "cpu"))
EPS = 0.02
# (file stem, dataset, images): α-CROWN costs ≈ 16 s and 8 GB an image on the 1-block digits model
MODELS = {"digits-d32-b1": ("digits-d32-b1-h2-c0.5-q1-m0.003", "digits", 8),
          "digits-d32-b3": ("digits-d32-b3-h2-c0.5-q1-m0.003", "digits", 8),
          "fashion-d128-b3": ("fashion-mnist-d128-b3-h4-p7-c0.5-q1-m0.01", "fashion-mnist", 2),
          # trained without a margin (#55): where the second pass does the work
          "digits-d32-b3-q2": ("digits-d32-b3-h2-c0.5-q2", "digits", 8),
          "fashion-d128-b3-q1": ("fashion-mnist-d128-b3-h4-p7-c0.5-q1", "fashion-mnist", 2),
          # the accurate Fashion-MNIST models (0.8825 and 0.8873, #55)
          "fashion-d128-b3-f2q2": ("fashion-mnist-d128-b3-h4-p7-c0.5-f2-q2", "fashion-mnist", 2),
          "fashion-d128-b4-f2q2": ("fashion-mnist-d128-b4-h4-p7-c0.5-f2-q2", "fashion-mnist", 2),
          # the standard pre-LayerNorm GELU ViTs with a class token (#56): the capped digits one and
          # the 0.8838 Fashion-MNIST one of Table 1
          "digits-d32-b2-standard-q1": ("digits-d32-b2-h2-standard-q1-gelu", "digits", 8),
          "fashion-d64-b3-standard": ("fashion-mnist-d64-b3-h4-p7-standard-gelu", "fashion-mnist", 2)}
# where α-CROWN fits in this box's 23 GB: on the 3-block digits model one image ran out of 20 GB
ALPHA_FITS = {"digits-d32-b1"}
SUITE = ["lofast_M", "taylor", "best", "taylor_net"]
FWD_BWD_REPEATS = 5  # the forward + backward pass is milliseconds: the median of a few
# the suite's methods are timed over rounds filling about SUITE_SECONDS (at most SUITE_ROUNDS), their
# median taken: a round of the 1-block model is ≈ 40 ms, and this box's load moved five consecutive
# ones between 31 and 56 ms; CROWN's one round is seconds, long enough to average the load itself
SUITE_SECONDS = 2.0
SUITE_ROUNDS = 50
# (model, method) → (s/image, forward + backward s/image, share certified), for the closing table
RESULTS: dict[tuple[str, str], tuple[float, float, float]] = {}


@pytest.fixture(scope="module", autouse=True)
def _table(request):
    """After the module: every method's s/image and its ratio to one forward + backward pass."""
    yield
    if not RESULTS:
        return
    threads = f"{torch.get_num_threads()} thread(s)"
    where = torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else threads
    w = max(len(m) for m, _ in RESULTS) + 2  # the model column fits the longest name
    lines = [f"certify speed at ε = {EPS} (s/image of the whole batch; {where})",
             f"{'model':<{w}}{'method':<13}{'s/image':>10}{'fwd+bwd s':>12}{'× fwd+bwd':>11}{'certified':>11}"
             f"{'CROWN ÷ it':>12}"]
    # the speed-up over CROWN on the same model, images and run (#55's aim: ≥ 30× for taylor_net)
    crown_s = {model: per for (model, method), (per, _, _) in RESULTS.items() if method == "crown"}
    lines += [f"{model:<{w}}{method:<13}{per:>10.4f}{base:>12.5f}{per / base:>11.1f}{share:>11.2f}"
              f"{crown_s[model] / per if model in crown_s else math.nan:>12.1f}"
              for (model, method), (per, base, share) in RESULTS.items()]
    plugins = request.config.pluginmanager
    # a teardown's output is captured (at the file descriptor): let the table through
    with plugins.get_plugin("capturemanager").global_and_fixture_disabled():
        write = plugins.get_plugin("terminalreporter").write_line
        for line in ["", *lines]:
            write(line)


def _images(model: str):
    stem, dataset, n = MODELS[model]
    # BENCH_IMAGES: a larger batch, where a GPU's unit of work is the batch rather than one image
    raw = os.environ.get("BENCH_IMAGES", str(n))
    if not (raw.isdigit() and int(raw) > 0):
        pytest.fail(f"error: BENCH_IMAGES must be a positive integer, not {raw!r}", pytrace=False)
    n = int(raw)
    net, _ = load_model(ZOO / f"{stem}.safetensors")
    try:
        X, y = first_test_images(dataset, net, n)
    except InputError as e:  # Fashion-MNIST is a Debian package, not a dependency
        pytest.skip(str(e))
    return net.to(DEVICE), X.to(DEVICE, torch.float64), y.to(DEVICE)


def _suite(net, X, y, name: str) -> torch.Tensor:
    if name == "taylor_net":  # its clean trace and every stage from scratch
        return TaylorNet(net, X, y).certify(EPS).certified.cpu()
    # a fresh cache: the certified norms are computed, not taken from another round
    return Certifier(net, X, y).certify(name, EPS, {}).pairwise.cpu()


def _crown(net, X, y, name: str) -> torch.Tensor:
    return verify(net, X, y, EPS, name, TracedViT(net)).certified.cpu()


def forward_backward(net, X, y) -> float:
    """Seconds per image of one forward + backward pass: the gradient of the cross-entropy with
    respect to the images (one PGD step), in the certifier's float64; the median of a few."""
    times = []
    for _ in range(FWD_BWD_REPEATS):
        start = time.perf_counter()
        images = X.clone().requires_grad_(True)
        torch.autograd.grad(F.cross_entropy(net(images), y), images)
        if images.is_cuda:
            torch.cuda.synchronize(images.device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) / len(X)


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
    # one untimed round first for the suite's methods: their first call in a process pays torch's lazy
    # set-up (≈ 6 ms an image on the 1-block model, about half of a round), which a sweep pays once
    # over all its images; CROWN's rounds are seconds an image, and its set-up is part of each
    rounds = 1
    if method in SUITE:  # the untimed round; then rounds over ≈ SUITE_SECONDS, their median taken
        start = time.perf_counter()
        run(net, X, y, method)
        rounds = max(3, min(SUITE_ROUNDS, math.ceil(SUITE_SECONDS / (time.perf_counter() - start))))
    certified = benchmark.pedantic(run, args=(net, X, y, method), rounds=rounds, iterations=1)
    per, base = benchmark.stats.stats.median / len(X), forward_backward(net, X, y)
    share = float(certified.double().mean())
    benchmark.extra_info.update(images=len(X), eps=EPS, certified=share, seconds_per_image=per,
                                fwd_bwd_seconds_per_image=base, ratio_to_fwd_bwd=per / base)
    RESULTS[model, method] = per, base, share

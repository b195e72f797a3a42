"""pytest-benchmark targets of issue #9 (`tox -e perf`): ζ and δ₂ of one ViT-B layer, the certified
bounds against the PGD that checks them at the quick profile's sizes, and the batched certification
of a 3-block d=128 ViT. Saved with --benchmark-autosave, compared with --benchmark-compare."""

from __future__ import annotations

import pytest
import torch

import bounds
from attacks import attack
from bench.nets.accuracy import chunk_size
from bench.sweep.cases import LayerCell, make_cell
from bounds import lofast as lf
from bounds.network import Certifier
from models.vit import ViT, ViTConfig

torch.set_num_threads(1)

VIT_B = make_cell(n=197, d=768, h=12)
QUICK = {"n16-d64-h4": make_cell(n=16, d=64, h=4), "n32-d64-h4": make_cell(n=32, d=64, h=4),
         "n50-d192-h12": make_cell(n=50, d=192, h=12)}
QUICK_PGD = {"steps": 60, "restarts": 6}  # bench/profiles/quick.toml's [run]
CERTIFIED = ["naive", "lofast_xi", "lofast_M", "lofast_M_half", "taylor", "best"]


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _f64(cell: LayerCell):
    """The cell's layer and inputs in float64 on the GPU where there is one."""
    layer, X = cell.build()
    X = X.double().to(DEVICE)
    return layer.to(X), X


def _synced(fn):
    """``fn`` and then a wait for the GPU's queue, so that a round times the work, not its launch."""
    def run():
        out = fn()
        if DEVICE.type == "cuda":
            torch.cuda.synchronize(DEVICE)
        return out
    return run


@pytest.mark.parametrize("part", ["zeta", "M", "xi"])
def test_vit_b_layer(benchmark, part):
    """ζ, ‖M_l‖ and ξ_l of one ViT-B layer (n=197, d=768, h=12): the parts of ζ and δ₂."""
    layer, X = _f64(VIT_B)
    fn = {"zeta": lf.zeta, "M": lf.m_norms, "xi": lf.xi}[part]
    benchmark.pedantic(_synced(lambda: fn(layer, X)), rounds=1, iterations=1)


@pytest.mark.parametrize("size", list(QUICK))
@pytest.mark.parametrize("name", CERTIFIED)
def test_quick_bound(benchmark, size, name):
    layer, X = _f64(QUICK[size])
    benchmark.pedantic(_synced(lambda: bounds.evaluate(name, layer, X, 0.05)), rounds=3, iterations=1)


@pytest.mark.parametrize("size", list(QUICK))
def test_quick_pgd(benchmark, size):
    """The PGD of the output that checks the bounds above, at the quick profile's settings."""
    layer, X = _f64(QUICK[size])
    benchmark.pedantic(_synced(lambda: attack(layer, X, 0.05, "output", **QUICK_PGD)), rounds=3, iterations=1)


@pytest.mark.parametrize("name", ["lofast_M", "best"])
def test_network_certification(benchmark, name):
    """A random 3-block d=128 lofast ViT on digit-sized (8×8) images certified as one batch: one
    chunk of `bench certify` on this device (32 on the CPU, 256 on a GPU). Time per sample =
    the time / extra_info["samples"] (the issue's GPU target: ≤ 5 ms)."""
    torch.manual_seed(0)
    net = ViT(ViTConfig(image=8, classes=10, d=128, depth=3, heads=4, ffn=256)).double().eval()
    net, samples = net.to(DEVICE), chunk_size(DEVICE)
    images = torch.rand(samples, 8, 8, dtype=torch.float64, device=DEVICE)
    labels = torch.randint(0, 10, (samples,), device=DEVICE)
    cert = Certifier(net, images, labels)
    benchmark.pedantic(_synced(lambda: cert.certify(name, 0.01)), rounds=2, iterations=1)
    benchmark.extra_info["samples"] = samples

"""The whole-network certificates on a GPU (docs/bounds.md §5, §2.4): in float64 on CUDA every
network bound, taylor_net among them, gives the CPU's verdicts and bounds, no image it certifies is
broken by the attack run there, and `python -m bench certify --device cuda` says where it ran.
Skipped without a CUDA device (tests/bounds/test_dtypes.py holds the single-layer bounds' CUDA test)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import ROOT, main_inprocess

from bench.nets.accuracy import first_test_images, load_model, run_certify
from bounds.network import network_bounds
from bounds.network.taylor_net import TaylorNet

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ZOO = ROOT / "zoo"
# a margin model (taylor_net's home ground) and one trained without a margin, where the splits differ
STEMS = ["digits-d32-b1-h2-c0.5-q1-m0.003", "digits-d32-b2-h2-c0.5-q2"]
EPS = [0.02, 0.1]
IMAGES = 12


def _pair(stem: str):
    """The model twice (run_certify moves its net to the device) and its first test images."""
    net, _ = load_model(ZOO / f"{stem}.safetensors")
    again, _ = load_model(ZOO / f"{stem}.safetensors")
    X, y = first_test_images("digits", net, IMAGES)
    return net, again, X.double(), y


@pytest.mark.parametrize("stem", STEMS)
def test_every_network_bound_on_cuda_matches_the_cpu(stem):
    net, again, X, y = _pair(stem)
    names = [b.name for b in network_bounds()]
    cpu = run_certify(net, X, y, EPS, names, steps=20, restarts=2)
    gpu = run_certify(again, X, y, EPS, names, steps=20, restarts=2, device="cuda")
    assert next(again.parameters()).is_cuda  # it ran there; its rows come back to the CPU
    assert cpu.certificates.keys() == gpu.certificates.keys() and len(cpu.certificates) == len(names) * 2
    for key in cpu.certificates:
        assert torch.equal(cpu.pairwise[key], gpu.pairwise[key].cpu()), key
        assert torch.equal(cpu.prop1[key], gpu.prop1[key].cpu()), key
        a, b = cpu.delta[key], gpu.delta[key].cpu()
        finite = torch.isfinite(a)
        assert torch.equal(finite, torch.isfinite(b)), key
        assert torch.allclose(a[finite], b[finite], rtol=1e-7, atol=0), (key, a, b)
    for e in EPS:  # the attack there breaks no image a certificate there holds
        for name in names:
            assert not (gpu.pairwise[name, e] & gpu.pgd_broken[e]).any(), (name, e)


@pytest.mark.parametrize("stem", STEMS)
def test_taylor_net_bounds_and_diagnostics_on_cuda_match_the_cpu(stem):
    net, again, X, y = _pair(stem)
    cpu = TaylorNet(net, X, y).certify(0.05)
    gpu = TaylorNet(again.cuda(), X.cuda(), y.cuda()).certify(0.05)
    assert torch.equal(cpu.certified, gpu.certified.cpu())
    lo, hi = cpu.lower, gpu.lower.cpu()
    finite = torch.isfinite(lo)
    assert torch.equal(finite, torch.isfinite(hi))
    assert torch.allclose(lo[finite], hi[finite], rtol=1e-7, atol=1e-12)
    assert torch.equal(cpu.verified, gpu.verified.cpu())
    a, b = cpu.diagnostics, gpu.diagnostics
    pairs = [("margin", a.margin, b.margin), ("first_order", a.first_order, b.first_order),
             ("kinks", a.kinks, b.kinks)] + [(k, v, b.remainders[k]) for k, v in a.remainders.items()]
    assert a.remainders.keys() == b.remainders.keys()
    for name, want, got in pairs:
        assert torch.allclose(want, got.cpu(), rtol=1e-6, atol=1e-12, equal_nan=True), name
    for want, got in zip(a.unstable + a.straddling, b.unstable + b.straddling, strict=True):
        assert torch.equal(want, got.cpu())


def test_certify_cli_on_cuda(capsys):
    code, out, err = main_inprocess(capsys, "certify", "--model", ZOO / f"{STEMS[0]}.safetensors",
                                    "--limit", 6, "--eps", "0.02", "--bounds", "taylor_net,lofast_M",
                                    "--pgd-steps", 10, "--pgd-restarts", 1, "--device", "cuda", "--json")
    assert code == 0, err
    got = json.loads(out)
    meta = got["meta"]
    assert meta["device"] == "cuda" and meta["device_name"] == torch.cuda.get_device_name(0)
    assert got["violations"] == 0
    assert set(got["certified_accuracy"]) == {"taylor_net", "lofast_M"}


def test_branches_on_cuda_are_never_below_the_pass_and_hold_the_attack():
    """taylor_net_bab on the GPU, the second pass's images branched together: every margin at least
    the plain pass's there, and no image it certifies broken by the attack run there."""
    _, again, X, y = _pair(STEMS[1])
    tn = TaylorNet(again.cuda(), X.cuda(), y.cuda(), branch_budget=2000)
    plain, branched = tn.certify(0.1), tn.certify(0.1, "taylor+bab")
    finite = torch.isfinite(plain.lower)
    assert (branched.lower[finite] >= plain.lower[finite] - 1e-6).all()
    assert (branched.certified >= plain.certified).all()
    rows = run_certify(again, X, y, [0.1], ["taylor_net_bab"], steps=50, restarts=4, device="cuda")
    assert not (rows.pairwise["taylor_net_bab", 0.1] & rows.pgd_broken[0.1]).any()

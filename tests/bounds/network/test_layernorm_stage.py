"""LayerNorm as a stage of taylor_net (#56, docs/bounds.md §5.1 "LayerNorm"): its Jacobian equals
torch.func's of nn.LayerNorm in float64, its remainder holds sampled and attacked deviations (tokens
near σ = 0, a single token, d = 2, random γ), and on pre-LayerNorm ViTs (the vanilla variant) every
stage holds the sampled deviations and no certified image is broken by an independent attack."""

from __future__ import annotations

import math

import pytest
import torch
from test_taylor_net import ZOO, check_stages, pgd, survives_attack
from torch import nn

from bench.nets.accuracy import first_test_images
from bounds.network.stages.layernorm import norm_jacobian, norm_remainder
from bounds.network.taylor_net import TaylorNet
from models.vit import ViT, ViTConfig
from models.vit_io import load_vit

VANILLA = ZOO / "digits-d32-b2-h2-vanilla.safetensors"


def layer_norm(d: int, eps: float, seed: int) -> nn.LayerNorm:
    torch.manual_seed(seed)
    norm = nn.LayerNorm(d, eps=eps).double()
    with torch.no_grad():
        norm.weight.uniform_(-2, 2)
        norm.bias.uniform_(-1, 1)
    return norm


def tokens(d: int, n: int, seed: int) -> torch.Tensor:
    """[1, n, d]: tokens of centred norms from 1e-4 (σ near 0) to 10, each around a random offset."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, n, d, generator=gen, dtype=torch.float64)
    z = x - x.mean(-1, keepdim=True)
    scale = torch.logspace(-4, 1, n, dtype=torch.float64)
    return z / z.norm(dim=-1, keepdim=True) * scale[:, None] + torch.randn(1, n, 1, generator=gen,
                                                                           dtype=torch.float64)


@pytest.mark.parametrize("d,eps", [(2, 1e-5), (8, 1e-5), (16, 0.0), (32, 1e-3)])
def test_the_jacobian_is_torch_funcs(d, eps):
    norm = layer_norm(d, eps, 0)
    X = tokens(d, 7, 1)[0]
    X = X[X.sub(X.mean(-1, keepdim=True)).norm(dim=-1) > 1e-3]  # where eps = 0 the Jacobian needs σ > 0
    want = torch.stack([torch.func.jacrev(norm)(x) for x in X])
    got = norm_jacobian(norm, X[None])[0]
    assert torch.allclose(got, want.detach(), rtol=1e-12, atol=1e-12 * float(want.detach().abs().max()))


def errors(norm: nn.LayerNorm, X: torch.Tensor, dev: torch.Tensor) -> torch.Tensor:
    """‖LN(x + Δ) − LN(x) − JΔ‖ per token, J by torch.func (independent of the stage's own)."""
    J = torch.stack([torch.func.jacrev(norm)(x) for x in X[0]])[None]
    return (norm(X + dev) - norm(X) - torch.einsum("bnde,bne->bnd", J, dev)).norm(dim=-1)


@pytest.mark.parametrize("d,eps", [(2, 1e-5), (8, 1e-5), (16, 1e-5), (16, 0.0), (64, 1e-3)])
@pytest.mark.parametrize("share", [0.05, 0.5, 0.99, 3.0])
def test_the_remainder_holds_sampled_and_attacked_deviations(d, eps, share):
    """r = share·‖z₀‖ per token: inside the centred sphere (≤ 0.99) and reaching past σ = 0 (3), where
    with eps = 0 the bound is +inf. Deviations on the sphere of radius r, inside it, and the point an
    ascent on ‖e‖ reaches."""
    norm = layer_norm(d, eps, d)
    X = tokens(d, 9, d + 1)
    r = share * (X - X.mean(-1, keepdim=True)).norm(dim=-1)
    bound, _, _, _ = norm_remainder(norm, X, r)
    if eps == 0 and share >= 1:
        assert torch.isinf(bound).all()
        return
    assert torch.isfinite(bound).all()
    gen = torch.Generator().manual_seed(7)
    worst = torch.zeros_like(bound)
    for k in range(64):
        v = torch.randn(X.shape, generator=gen, dtype=X.dtype)
        v = v / v.norm(dim=-1, keepdim=True) * r[..., None] * (1.0 if k % 2 else torch.rand(1, generator=gen,
                                                                                            dtype=X.dtype))
        worst = torch.maximum(worst, errors(norm, X, v))
    v = torch.randn(X.shape, generator=gen, dtype=X.dtype)
    for _ in range(150):  # projected ascent on each token's error
        v = v.detach().requires_grad_(True)
        e = errors(norm, X, v)
        (g,) = torch.autograd.grad(e.sum(), v)
        with torch.no_grad():
            v = v + 0.1 * r[..., None] * g / g.norm(dim=-1, keepdim=True).clamp_min(1e-300)
            v = v * (r / v.norm(dim=-1).clamp_min(1e-300)).clamp(max=1.0)[..., None]
            worst = torch.maximum(worst, errors(norm, X, v))
    assert (worst <= bound * (1 + 1e-9) + 1e-15).all(), float((worst / bound).max())
    assert (worst > 0.2 * bound).any()  # the bound is not vacuous somewhere


def vanilla_vit(seed: int, depth: int = 2, qk: float = 1.0) -> ViT:
    """An untrained float64 pre-LayerNorm ViT on 8×8 images, LayerNorm's γ and β random, its query
    and key weights scaled by ``qk``."""
    torch.manual_seed(seed)
    cfg = ViTConfig(image=8, classes=4, d=8, depth=depth, heads=2, patch=2, ffn=16, variant="vanilla",
                    constraint=None, ffn_constraint=None)
    net = ViT(cfg, constrained=False).double()
    with torch.no_grad():
        for block in net.blocks:
            block.attn.W_q.mul_(qk)
            block.attn.W_k.mul_(qk)
            block.ffn.up.bias.uniform_(-0.5, 0.5)
            block.norm.weight.uniform_(0.5, 1.5)
            block.norm.bias.uniform_(-0.3, 0.3)
    return net


@pytest.mark.parametrize("refine", [False, True], ids=["first", "second"])
@pytest.mark.parametrize("seed,qk,eps", [(0, 1.0, 0.01), (1, 4.0, 0.05), (2, 0.3, 0.3)])
def test_every_stage_holds_the_sampled_deviations_on_pre_layernorm_vits(seed, qk, eps, refine):
    net = vanilla_vit(seed, qk=qk)
    x = torch.rand(5, 8, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    y = torch.arange(5) % 4
    assert check_stages(net, x, y, eps, refine=refine) > 0


@pytest.mark.parametrize("which,eps", [("random", 0.01), ("random", 0.05), ("zoo", 0.001)])
def test_no_pre_layernorm_image_it_certifies_is_broken_by_an_independent_attack(which, eps):
    if which == "zoo":
        net, _ = load_vit(VANILLA)
        x, y = first_test_images("digits", net, 20)
        x = x.double()
    else:
        net = vanilla_vit(3, depth=2)
        x = torch.rand(30, 8, 8, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
        with torch.no_grad():
            y = net(x).argmax(-1)
    cert = survives_attack(net, x, y, eps)
    assert {f"norm{k}" for k in range(net.cfg.depth)} <= set(cert.diagnostics.remainders)


def test_a_ball_that_reaches_sigma_zero_certifies_nothing_and_raises_nothing():
    """LayerNorm with eps = 0 is not Lipschitz at σ = 0: a token whose ball reaches it makes the bound
    +inf, and the image is not certified (no NaN, no error)."""
    net = vanilla_vit(5, depth=1)
    with torch.no_grad():
        net.blocks[0].norm.eps = 0.0
    x = torch.rand(3, 8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad():
        y = net(x).argmax(-1)
    cert = TaylorNet(net, x, y).certify(50.0)
    assert not cert.certified.any()
    assert not torch.isnan(cert.lower).any()
    assert (cert.lower == -math.inf).any()  # the images whose ball reaches σ = 0


def test_certify_takes_a_vanilla_vit_with_the_bounds_that_can_and_refuses_the_rest(capsys):
    """``certify`` on a pre-LayerNorm zoo model: taylor_net's rows by default; a norm-route bound, or
    the cascade without taylor_net (its first there), is refused in one error line before any work."""
    from helpers import main_inprocess

    model = ZOO / "digits-d16-b2-h1-vanilla.safetensors"
    code, out, err = main_inprocess(capsys, "certify", "--model", model, "--limit", 3, "--eps", "1e-3",
                                    "--pgd-steps", 2, "--pgd-restarts", 1, "--json")
    assert code == 0, err
    import json

    names = set(json.loads(out)["certified_accuracy"])
    assert "taylor_net" in names and "naive" not in names
    for args, words in ((("--bounds", "naive,taylor_net"), "naive cannot certify a 'vanilla' ViT"),
                        (("--cascade", "--bounds", "taylor_net_lofast"), "starts from taylor_net")):
        code, out, err = main_inprocess(capsys, "certify", "--model", model, "--limit", 3, "--eps", "1e-3",
                                        *args)
        assert code == 2 and err.startswith("error:") and words in err and err.count("\n") == 1


def test_crown_takes_the_layernorm_of_a_vanilla_vit():
    """The traced network auto_LiRPA bounds computes the vanilla ViT's own logits (LayerNorm written
    from a mean, products, sqrt and a division), and no image CROWN certifies is broken."""
    from bounds import crown
    from bounds.network.netcrown import TracedViT, verify

    if not crown.available():
        pytest.skip("auto_LiRPA is not installed")
    net = vanilla_vit(3, depth=1)
    x = torch.rand(6, 8, 8, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    with torch.no_grad():
        y = net(x).argmax(-1)
        traced = TracedViT(net)
        assert torch.allclose(traced(x.reshape(6, -1)), net(x), rtol=1e-12, atol=1e-12)
    v = verify(net, x, y, 0.01, "crown", traced)
    assert v.certified.any()
    assert not (v.certified & (pgd(net, x, y, 0.01) <= 0)).any()


def test_the_normalisations_second_derivative_is_within_two_over_root_three_and_reaches_it():
    """‖D²h(z)[v, v]‖ ≤ (2/√3)‖v‖²/ρ(z)² for h(z) = z/(‖z‖² + κ)^½, against dense float64 Hessians
    (torch.func.hessian) at random z, v and κ; and the ratio comes within 1e-3 of 2/√3 where κ = 0 and
    v is at α² = 1/3 from z (docs/bounds.md §5.1)."""
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for kappa in (0.0, 1e-3, 0.5, 10.0):
        h = lambda z, k=kappa: z / (z @ z + k).sqrt()
        for _ in range(20):
            d = int(torch.randint(2, 9, (1,), generator=gen))
            z = torch.randn(d, generator=gen, dtype=torch.float64) * 3
            v = torch.randn(d, generator=gen, dtype=torch.float64)
            v = v / v.norm()
            H = torch.func.hessian(h)(z)  # [d, d, d]: H[i] is the Hessian of h_i
            ratio = float(torch.einsum("ijk,j,k->i", H, v, v).norm() * (z @ z + kappa))
            assert ratio <= 2 / math.sqrt(3) * (1 + 1e-12)
            worst = max(worst, ratio)
    z = torch.tensor([1.0, 0.0], dtype=torch.float64)
    v = torch.tensor([math.sqrt(1 / 3), math.sqrt(2 / 3)], dtype=torch.float64)
    H = torch.func.hessian(lambda z: z / (z @ z).sqrt())(z)
    assert abs(float(torch.einsum("ijk,j,k->i", H, v, v).norm()) - 2 / math.sqrt(3)) < 1e-3
    assert worst > 0.5  # the random cases reach a good part of it


@pytest.mark.parametrize("d,eps", [(2, 1e-5), (8, 1e-5), (16, 0.0), (32, 1e-3)])
@pytest.mark.parametrize("share", [0.1, 0.5, 0.9])
def test_the_error_through_the_symmetry_holds_sampled_errors_and_ratios(d, eps, share):
    """norm_error's E ≥ ‖e‖ and K ≥ ‖e‖/‖Δ‖² (γ = 1, so that max|γ| is no slack) for deviations on and
    inside the ball, e from nn.LayerNorm and torch.func's Jacobian; and E within 6 % of the largest
    error on the ball's sphere (in z₀'s plane) where r ≤ ‖z₀‖/2."""
    from bounds.network.stages.layernorm import norm_error

    norm = nn.LayerNorm(d, eps=eps, elementwise_affine=False).double()
    X = tokens(d, 9, d + 3)
    m = (X - X.mean(-1, keepdim=True)).norm(dim=-1)
    r = share * m
    E, K = norm_error(m, d * eps, math.sqrt(d), r)
    gen = torch.Generator().manual_seed(11)
    worst, ratio = torch.zeros_like(E), torch.zeros_like(E)
    for k in range(200):
        v = torch.randn(X.shape, generator=gen, dtype=X.dtype)
        v = v - v.mean(-1, keepdim=True)  # the centred directions: C removes the rest
        size = r * (1.0 if k % 2 else torch.rand(1, generator=gen, dtype=X.dtype))
        v = v / v.norm(dim=-1, keepdim=True) * size[..., None]
        e = errors(norm, X, v) - 1e-13  # the sample's own rounding
        if k % 2:
            worst = torch.maximum(worst, e)
        ratio = torch.maximum(ratio, e / v.norm(dim=-1).square())
    assert (worst <= E).all() and (ratio <= K).all()
    if d == 2:  # the centred directions are one line: no w ⊥ z₀
        return
    # on the sphere in the plane of z₀ and one centred direction w ⊥ z₀, 400 angles: near the top
    z = X - X.mean(-1, keepdim=True)
    zhat = z / m[..., None]
    w = torch.randn(X.shape, generator=gen, dtype=X.dtype)
    w = w - w.mean(-1, keepdim=True)
    w = w - (w * zhat).sum(-1, keepdim=True) * zhat
    w = w / w.norm(dim=-1, keepdim=True)
    for theta in torch.linspace(0, math.pi, 400, dtype=X.dtype):
        v = r[..., None] * (theta.cos() * zhat + theta.sin() * w)
        e = errors(norm, X, v) - 1e-13
        worst = torch.maximum(worst, e)
        ratio = torch.maximum(ratio, e / r.square())
    assert (worst <= E).all() and (ratio <= K).all()
    if share <= 0.5:  # nearer σ = 0 the error bends faster than 96 cells follow (0.9: 16 % above)
        clear = (m - r) > 10 * math.sqrt(d * eps + 1e-300)
        assert (E[clear] <= 1.06 * worst[clear] + 1e-12).all()


def error_vectors(norm: nn.LayerNorm, X: torch.Tensor, dev: torch.Tensor) -> torch.Tensor:
    """LN(x + Δ) − LN(x) − JΔ per token [1, n, d], J by torch.func."""
    J = torch.stack([torch.func.jacrev(norm)(x) for x in X[0]])[None]
    return norm(X + dev) - norm(X) - torch.einsum("bnde,bne->bnd", J, dev)


@pytest.mark.parametrize("d,eps", [(8, 1e-5), (16, 0.0), (32, 1e-3)])
@pytest.mark.parametrize("share,cut", [(0.1, 1.0), (0.5, 1.0), (0.5, 0.1), (0.9, 0.3)])
def test_the_errors_parts_hold_sampled_errors_on_a_cut_ball(d, eps, share, cut):
    """norm_error's parts (γ = 1, g = √d): |ẑ₀ᵀe| ≤ along, ‖e − (ẑ₀ᵀe)ẑ₀‖ ≤ across, and their ratios to ‖Δ‖²,
    for deviations on and inside the ball with a = ẑ₀ᵀΔ cut to [−cut·r, 0.7·cut·r], e from nn.LayerNorm
    and torch.func; the whole error's bound on the cut ball holds them too and is not above the uncut."""
    from bounds.network.stages.layernorm import norm_error

    norm = nn.LayerNorm(d, eps=eps, elementwise_affine=False).double()
    X = tokens(d, 9, d + 5)
    z = X - X.mean(-1, keepdim=True)
    m = z.norm(dim=-1)
    zhat = z / m[..., None]
    r = share * m
    lo, hi = -cut * r, 0.7 * cut * r
    g = math.sqrt(d)
    bounds = {part: norm_error(m, d * eps, g, r, lo, hi, part) for part in ("norm", "along", "across")}
    assert (bounds["norm"][0] <= norm_error(m, d * eps, g, r)[0]).all()
    gen = torch.Generator().manual_seed(d)
    worst = {part: torch.zeros_like(m) for part in bounds}
    ratio = {part: torch.zeros_like(m) for part in bounds}
    for k in range(200):
        v = torch.randn(X.shape, generator=gen, dtype=X.dtype)
        v = v - v.mean(-1, keepdim=True)
        size = r * (1.0 if k % 2 else torch.rand(1, generator=gen, dtype=X.dtype))
        v = v / v.norm(dim=-1, keepdim=True) * size[..., None]
        a = (v * zhat).sum(-1)  # into the cut: a's part moved to the nearest end
        v = v + (a.clamp(lo, hi) - a)[..., None] * zhat
        e = error_vectors(norm, X, v)
        along = (e * zhat).sum(-1)
        across = (e - along[..., None] * zhat).norm(dim=-1)
        got = {"norm": e.norm(dim=-1), "along": along.abs(), "across": across}
        for part, value in got.items():
            value = value - 1e-13  # the sample's own rounding
            worst[part] = torch.maximum(worst[part], value)
            ratio[part] = torch.maximum(ratio[part], value / v.norm(dim=-1).square())
    for part, (E, K) in bounds.items():
        assert (worst[part] <= E).all() and (ratio[part] <= K).all(), part


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_charge_holds_the_attacked_error_and_gains_from_gamma(seed):
    """NormRecord.charge ≥ ⟨Λ, e⟩ at the deviations an ascent on it reaches over one token's ball
    {εp : ‖p‖ ≤ 1} (e from nn.LayerNorm and torch.func, random γ; 4 starts a sign of Λ, 300 steps),
    within 2.5× of it, and below the charge at max|γ|·√d·‖Λ‖ that it replaced."""
    from bounds.network.stages.layernorm import NormRecord
    from bounds.network.stages.layernorm import layer_norm as stage
    from bounds.network.zonotope import DeviationSet

    d, eps = 8, 0.3
    norm = layer_norm(d, 1e-5, seed).requires_grad_(False)
    X = tokens(d, 9, seed)[:, -2:-1]  # one token, centred norm 2.4: r = 0.13·‖z₀‖
    gen = torch.Generator().manual_seed(seed)
    G = torch.eye(d, dtype=torch.float64).expand(1, 1, d, d)
    S = DeviationSet.ball_of(G, torch.tensor([eps], dtype=torch.float64))
    log: list = []
    stage(S, X, norm, eps, 0, log)
    rec = log[-1]
    assert isinstance(rec, NormRecord)
    Lam = torch.randn(1, 4, 1, d, generator=gen, dtype=torch.float64)
    charge = rec.charge(Lam)
    old = (Lam.norm(dim=-1) * rec.err[:, None]).sum(-1)
    assert (charge <= old).all() and (charge < 0.9 * old).any()
    J = torch.func.jacrev(norm)(X[0, 0])
    error = lambda p: norm(X[0, 0] + eps * p) - norm(X[0, 0]) - J @ (eps * p)
    for c in range(Lam.shape[1]):
        best = 0.0
        for sign in (1.0, -1.0) * 4:
            p = torch.randn(d, generator=gen, dtype=torch.float64)
            p = (p / p.norm()).requires_grad_(True)
            opt = torch.optim.Adam([p], lr=0.05)
            for _ in range(300):
                opt.zero_grad()
                (-sign * (Lam[0, c, 0] @ error(p))).backward()
                opt.step()
                with torch.no_grad():
                    p /= p.norm().clamp_min(1.0)
            with torch.no_grad():
                best = max(best, sign * float(Lam[0, c, 0] @ error(p)) - 1e-12)
        assert best <= float(charge[0, c]) <= 2.5 * best


def test_a_layernorm_with_zero_gamma_is_charged_nothing():
    """γ ≡ 0 makes LayerNorm constant: its errors and their charge are 0, not 0/0."""
    from bounds.network.stages.layernorm import layer_norm as stage
    from bounds.network.zonotope import DeviationSet

    d, n = 8, 3
    norm = nn.LayerNorm(d).double().requires_grad_(False)
    with torch.no_grad():
        norm.weight.zero_()
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(1, n, d, generator=gen, dtype=torch.float64)
    G = torch.randn(1, n, d, 5, generator=gen, dtype=torch.float64)
    log: list = []
    S = DeviationSet.ball_of(G, 0.1 * torch.linalg.matrix_norm(G.reshape(1, n * d, 5), 2))
    stage(S, X, norm, 0.1, 0, log)
    assert torch.equal(log[-1].charge(torch.randn(1, 2, n, d, generator=gen, dtype=torch.float64)),
                       torch.zeros(1, 2, dtype=torch.float64))

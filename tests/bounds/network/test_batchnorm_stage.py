"""The standard ViT's options for networks brought from elsewhere (#56): BatchNorm in place of LayerNorm
(VNN-COMP's ViTs; affine in eval), biases on the attention's queries, keys, values and output, and
mean pooling in place of the class token. The forward pass equals an independent float64 construction
from the weights; every margin bound of taylor_net is below sampled and attacked margin changes; the
BatchNorm stage's backward step is its exact transpose; no image taylor_net or CROWN certifies is
broken by an independent attack; a card round-trips and a card without the options is unchanged."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from test_taylor_net import perturbations, sampled_margins_hold, survives_attack

from bounds.network.stages.batchnorm import ScaleRecord, batch_norm
from bounds.network.taylor_net import TaylorNet
from bounds.network.zonotope import DeviationSet
from models import InputError
from models.vit import ViT, ViTConfig
from models.vit_io import load_vit, save_vit

OPTIONS = [("batch", "cls", True), ("batch", "mean", False), ("layer", "mean", True), ("batch", "cls", False)]


def bn_vit(seed: int, norm: str = "batch", pool: str = "cls", bias: bool = True, qk: float = 0.5,
           activation: str = "relu", depth: int = 2) -> ViT:
    torch.manual_seed(seed)
    cfg = ViTConfig(image=8, classes=4, d=8, depth=depth, heads=2, patch=2, ffn=16, variant="standard",
                    constraint=None, ffn_constraint=None, activation=activation, norm=norm, pool=pool,
                    bias=bias)
    net = ViT(cfg, constrained=False).double()
    with torch.no_grad():
        for block in net.blocks:
            block.attn.W_q.mul_(qk)
            block.attn.W_k.mul_(qk)
            block.ffn.up.bias.uniform_(-1.0, 1.0)
            for p in block.attn.biases().values():
                p.normal_(0, 0.5)
        for m in net.modules():
            if hasattr(m, "running_mean"):  # statistics as training leaves them, not 0 and 1
                m.running_mean.normal_(0, 0.5)
                m.running_var.uniform_(0.3, 3.0)
            if isinstance(m, torch.nn.modules.batchnorm._NormBase | torch.nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.3, 0.3)
    return net.eval()


def dense_logits(net: ViT, x: torch.Tensor) -> torch.Tensor:
    """The logits from the weights alone (einsums; BatchNorm from its running statistics by hand)."""
    cfg = net.cfg
    p, g = cfg.patch, cfg.image // cfg.patch
    patches = x.reshape(len(x), g, p, g, p).permute(0, 1, 3, 2, 4).reshape(len(x), g * g, p * p)
    X = patches @ net.embed.weight.T
    if net.cls is not None:
        X = torch.cat([net.cls.expand(len(x), 1, -1), X], 1)
    X = X + net.pos

    def norm(X, m):
        if cfg.norm == "batch":
            return (X - m.running_mean) / (m.running_var + m.eps).sqrt() * m.weight + m.bias
        z = X - X.mean(-1, keepdim=True)
        return z / ((z * z).mean(-1, keepdim=True) + m.eps).sqrt() * m.weight + m.bias

    for b in net.blocks:
        Y = norm(X, b.norm)
        bias = b.attn.biases() or {k: torch.zeros(1, 1) for k in ("b_q", "b_k", "b_v")} | {"b_o": 0}
        Q, K, V = (torch.einsum("bnd,hde->bhne", Y, getattr(b.attn, w)) + bias[v][:, None]
                   for w, v in (("W_q", "b_q"), ("W_k", "b_k"), ("W_v", "b_v")))
        P = torch.softmax(Q @ K.mT / math.sqrt(Q.shape[-1]), -1)
        X = X + torch.einsum("bhne,hed->bnd", P @ V, b.attn.W_o) + bias["b_o"]
        h = norm(X, b.norm2) @ b.ffn.up.weight.T + b.ffn.up.bias
        X = X + torch.relu(h) @ b.ffn.down.weight.T + b.ffn.down.bias
    feats = norm(X, net.norm)
    feats = feats[:, 0] if cfg.pool == "cls" else feats.mean(1)
    return feats @ net.head.weight.T + net.head.bias


@pytest.mark.parametrize("norm,pool,bias", OPTIONS)
def test_the_forward_pass_is_the_dense_construction(norm, pool, bias):
    net = bn_vit(0, norm, pool, bias)
    x = torch.rand(3, 8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad():
        assert torch.allclose(net(x), dense_logits(net, x), rtol=1e-12, atol=1e-12)
    assert net.cfg.n_tokens == 16 + (pool == "cls")


def test_the_batchnorm_step_is_the_transpose_of_its_map():
    """⟨Λ, diag(a)Δ⟩ = ⟨step(Λ), Δ⟩ and the set's centre moves as the map does, against the module."""
    net = bn_vit(1)
    norm = net.blocks[0].norm
    gen = torch.Generator().manual_seed(1)
    G = torch.randn(2, 5, 8, 3, generator=gen, dtype=torch.float64)
    S = DeviationSet.ball_of(G, torch.ones(2, dtype=torch.float64))
    log: list = []
    out, _ = batch_norm(S, norm, log)
    with torch.no_grad():  # the module on deviations: a ⊙ (x + Δ) + b − (a ⊙ x + b)
        x = torch.randn(2, 5, 8, generator=gen, dtype=torch.float64)
        want = norm(x[..., None].mT + G.mT).mT - norm(x)[..., None]
    assert torch.allclose(out.G, want, atol=1e-12)
    Lam = torch.randn(2, 4, 5, 8, generator=gen, dtype=torch.float64)
    (rec,) = log
    assert isinstance(rec, ScaleRecord)
    lhs = torch.einsum("bcnd,bndp->bcp", Lam, out.G)
    rhs = torch.einsum("bcnd,bndp->bcp", rec.step(Lam).Lam, G)
    assert torch.allclose(lhs, rhs, atol=1e-12)


def test_a_batchnorm_in_training_mode_is_refused():
    net = bn_vit(2).train()
    S = DeviationSet.ball_of(torch.zeros(1, 5, 8, 2, dtype=torch.float64), torch.ones(1, dtype=torch.float64))
    with pytest.raises(ValueError, match="training mode"):
        batch_norm(S, net.blocks[0].norm)


@pytest.mark.parametrize("norm,pool,bias", OPTIONS)
@pytest.mark.parametrize("eps", [0.01, 0.05])
def test_every_margin_change_is_above_its_lower_bound(norm, pool, bias, eps):
    net = bn_vit(3, norm, pool, bias)
    x = torch.rand(8, 8, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    with torch.no_grad():
        y = net(x).argmax(-1)
    assert torch.isfinite(sampled_margins_hold(net, x, y, eps, 24)).all()


@pytest.mark.parametrize("norm,pool,bias,eps,qk", [(*o, 0.003, 0.5) for o in OPTIONS[:3]]
                         + [(*OPTIONS[0], 0.01, 0.5), (*OPTIONS[0], 3e-4, 3.0)])
def test_no_image_taylor_net_or_crown_certifies_is_broken_by_an_independent_attack(norm, pool, bias, eps, qk):
    net = bn_vit(4, norm, pool, bias, qk=qk)
    x = torch.rand(30, 8, 8, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    with torch.no_grad():
        y = net(x).argmax(-1)
    survives_attack(net, x, y, eps, crown=True)


def test_a_card_round_trips_and_old_cards_are_unchanged(tmp_path):
    net = bn_vit(5, "batch", "mean", True)
    path = tmp_path / "bn.safetensors"
    save_vit(path, net.float(), {"architecture": net.cfg.to_dict()})
    back, card = load_vit(path)
    assert card["architecture"]["norm"] == "batch" and card["architecture"]["pool"] == "mean"
    x = torch.rand(2, 8, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    with torch.no_grad():
        assert torch.allclose(back(x), net.double()(x), rtol=1e-6, atol=1e-6)
    plain = ViTConfig(image=8, classes=4, variant="standard", constraint=None, ffn_constraint=None)
    assert not {"norm", "norm_eps", "pool", "bias"} & set(plain.to_dict())
    with pytest.raises(InputError, match="options of the standard variant"):
        ViTConfig(image=8, classes=4, norm="batch")


def test_train_takes_the_options_and_its_command_gives_them_back():
    """``train --variant standard --norm batch --pool mean --bias``: the model's name and the retraining
    command of its card carry all three (a card's command must rebuild the same architecture)."""
    from bench.cli.main import build_parser
    from bench.cli.train_cmd import config_from_args
    from bench.nets.train import command, model_name

    args = build_parser().parse_args(["train", "--variant", "standard", "--norm", "batch", "--pool", "mean",
                                      "--bias", "--constraint", "none", "--ffn-constraint", "none"])
    cfg = config_from_args(args)
    assert (cfg.norm, cfg.pool, cfg.bias) == ("batch", "mean", True)
    assert model_name("digits", cfg).endswith("-standard-bn-mean-bias")
    card = {"dataset": "digits", "epochs": 1, "batch_size": 64, "lr": 0.01, "head_lr_scale": 10.0, "seed": 0,
            "threads": 1}
    again = build_parser().parse_args(command(cfg, card, "x.safetensors").split()[3:])
    assert config_from_args(again) == cfg


def attention_inputs(net: ViT, x: torch.Tensor) -> list[torch.Tensor]:
    """Each block's attention input norm₁(X_k), from the modules' forward."""
    out, X = [], net.tokens(x)
    for b in net.blocks:
        out.append(b.norm(X))
        X = X + b.attn(out[-1])
        X = X + b.ffn.branch(b.norm2(X))
    return out


@pytest.mark.parametrize("refine", [False, True], ids=["first", "second"])
@pytest.mark.parametrize("norm,qk,eps", [("batch", 0.5, 0.01), ("layer", 2.0, 0.05), ("batch", 3.0, 0.002)])
def test_the_logit_change_on_the_set_holds_every_sampled_deviation(norm, qk, eps, refine):
    """logit_change(S) ≥ ‖Γ W^Q Kᵀ + Q (Γ W^K)ᵀ‖_F per head for the true deviation Γ of each block's
    attention input at sampled perturbations (Γ lies in the set: the stage tests), and never above
    ξ_l times the set's radius, the bound over the whole ball, at some block."""
    from bounds.lofast import xi
    from bounds.network.stages.attention import attention_parts
    from bounds.network.stages.logits import logit_change

    net = bn_vit(6, norm, "cls", True, qk=qk)
    x = torch.rand(4, 8, 8, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    with torch.no_grad():
        y = net(x).argmax(-1)
        tn = TaylorNet(net, x, y)
        stages = dict((name, S) for name, S, _ in tn.stages(eps, log=[] if refine else None, refine=refine))
        clean = attention_inputs(net, x)
        tighter = False
        for k, layer in enumerate(tn.layers):
            S = stages[f"norm{k}"]
            parts = dataclasses.replace(attention_parts(layer, clean[k]), xi=xi(layer, clean[k]))
            bound = logit_change(S, layer, parts, eps)  # [B, h]
            assert torch.isfinite(bound).all()
            Q, K = layer.queries_keys(clean[k])
            for delta in perturbations(x, eps, 16, torch.Generator().manual_seed(7)):
                G = attention_inputs(net, x + delta)[k] - clean[k]
                GQ = torch.einsum("bnd,hde->bhne", G, layer.W_q)
                GK = torch.einsum("bnd,hde->bhne", G, layer.W_k)
                true = (GQ @ K.mT + Q @ GK.mT).flatten(2).norm(dim=-1)
                assert (true <= bound * (1 + 1e-9) + 1e-12).all(), (k, float((true - bound).max()))
            tighter = tighter or bool((bound < xi(layer, clean[k]) * S.route[:, None]).any())
    assert tighter  # what it is for: below ξ_l times the radius, the ball's bound, somewhere


@pytest.mark.parametrize("refine", [False, True], ids=["first", "second"])
@pytest.mark.parametrize("qk,eps", [(0.5, 0.01), (3.0, 0.002), (1.0, 0.05)])
def test_the_radius_attention_reads_after_batchnorm_holds_every_sampled_deviation(qk, eps, refine):
    """The route after each block's BatchNorm (the radius attention's remainder reads) is at least
    ‖Γ‖_F of the true deviation Γ of attention's input at sampled perturbations, never above the
    scaled set's own radius, and below the residual stream's route times max|a| at some block (what
    reading the set's radius is for: that route adds every branch's product of norms)."""
    net = bn_vit(8, "batch", "cls", True, qk=qk, depth=3)
    x = torch.rand(4, 8, 8, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    with torch.no_grad():
        y = net(x).argmax(-1)
        tn = TaylorNet(net, x, y)
        stages = tn.stages(eps, log=[] if refine else None, refine=refine)
        at = {name: i for i, (name, _, _) in enumerate(stages)}
        clean = attention_inputs(net, x)
        gen = torch.Generator().manual_seed(9)
        moved = [attention_inputs(net, x + d) for d in perturbations(x, eps, 16, gen)]
        tighter = False
        for k, block in enumerate(net.blocks):
            S = stages[at[f"norm{k}"]][1]
            for inputs in moved:
                true = (inputs[k] - clean[k]).flatten(1).norm(dim=-1)
                assert (true <= S.route * (1 + 1e-9) + 1e-12).all(), (k, float((true - S.route).max()))
            assert (S.route <= S.radius(eps) * (1 + 1e-12)).all()
            if k:  # the stream before it: the previous block's output
                stream = stages[at[f"ffn{k - 1}"]][1]
                top = block.norm.scale_shift()[0].abs().max()
                tighter = tighter or bool((S.route < stream.route * top * (1 - 1e-6)).any())
    assert tighter

"""Attention's logits and remainder on the deviation set (docs/bounds.md §5.1, "Attention's remainder
on the set"): softmax's entrywise box holds every sampled logit change and is attained at its
corners; every logit's change at points of the set and at the true deviations of sampled
perturbations lies in the logit box; the remainders on the set (row by row from softmax's box, and
§2.3's with each row's span read on the set) are at least ‖F(X + Γ) − F(X) − J Γ‖_F there, and each
output token's bound at least that token's row of it (J from torch.autograd, not the suite's
Jacobian), on LayerProject, LayerNorm and BatchNorm ViTs up to saturated attention, in both passes;
and they are below the ball's remainder somewhere. The second order on the set's first generator is
the autograd second derivative, and its rows' bound holds the same deviations."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import pytest
import torch
from test_batchnorm_stage import attention_inputs, bn_vit
from test_taylor_net import perturbations, random_vit, true_stages

from bounds.lofast import xi
from bounds.network.stages import second_order
from bounds.network.stages.attention import attention_parts
from bounds.network.stages.logits import logit_box, set_remainder, set_rows, softmax_box
from bounds.network.stages.second_order import fits, row_forms, second_order_rows
from bounds.network.taylor_net import TaylorNet
from bounds.remainder import functional_rows, remainder, row_bound, row_factors, row_remainders


@pytest.mark.parametrize("n,width,seed", [(1, 3.0, 0), (5, 0.1, 1), (9, 4.0, 2), (17, 20.0, 3)])
def test_softmax_box_holds_every_sampled_change_and_its_corners_attain_it(n, width, seed):
    gen = torch.Generator().manual_seed(seed)
    s = torch.randn(6, n, generator=gen, dtype=torch.float64) * 4
    P = s.softmax(-1)
    lo = -torch.rand(6, n, generator=gen, dtype=torch.float64) * width
    hi = torch.rand(6, n, generator=gen, dtype=torch.float64) * width
    low, high = softmax_box(P, lo, hi)
    for _ in range(200):
        t = torch.rand(6, n, generator=gen, dtype=torch.float64)
        t = torch.where(torch.rand(6, n, generator=gen, dtype=torch.float64) < 0.3, t.round(), t)
        moved = (s + lo + t * (hi - lo)).softmax(-1)
        assert (moved >= low - 1e-14).all() and (moved <= high + 1e-14).all()
    for j in range(n):  # the corner (δ_j = lo_j, the rest at hi) is p'_j's least value
        corner = hi.clone()
        corner[:, j] = lo[:, j]
        assert torch.allclose((s + corner).softmax(-1)[:, j], low[:, j], rtol=1e-12, atol=1e-300)


@pytest.mark.parametrize("n,seed", [(2, 0), (5, 1), (17, 2)])
def test_the_moved_mass_is_at_most_tanh_of_a_quarter_span_and_two_keys_attain_it(n, seed):
    """½‖softmax(L + u) − softmax(L)‖₁ ≤ tanh(s/4), s = max u − min u (docs/bounds.md §5.1, "At large
    logit spans"), on random rows and shifts up to saturation; and two keys attain it: p = (q, 1 − q)
    with q = 1/(e^{s/2} + 1) and u = (s, 0), so that no smaller function of s bounds the mass."""
    gen = torch.Generator().manual_seed(seed)
    for scale in (0.1, 1.0, 4.0, 30.0):
        L = torch.randn(500, n, generator=gen, dtype=torch.float64) * 3
        u = torch.randn(500, n, generator=gen, dtype=torch.float64) * scale
        u = torch.where(torch.rand(500, n, generator=gen, dtype=torch.float64) < 0.3, u.sign() * scale, u)
        moved = 0.5 * ((L + u).softmax(-1) - L.softmax(-1)).abs().sum(-1)
        s = u.amax(-1) - u.amin(-1)
        assert (moved <= torch.tanh(s / 4) + 1e-15).all()
    for s in (0.01, 0.5, 2.0, 8.0):
        q = 1 / (math.exp(s / 2) + 1)
        p = torch.tensor([q, 1 - q], dtype=torch.float64)
        moved = (p.log() + torch.tensor([s, 0.0], dtype=torch.float64)).softmax(-1) - p
        assert abs(0.5 * float(moved.abs().sum()) - math.tanh(s / 4)) < 1e-12
        assert math.tanh(s / 4) < min(1.0, s / 4)  # below the bound it replaces


def set_points(S, eps: float, count: int, gen: torch.Generator) -> torch.Tensor:
    """[count, B, n, d]: points c + Gδ + Aζ of the set (‖δ‖ = ε or less, ζ at corners of the box or
    inside it; the groups and balls at 0, which the set allows)."""
    out = []
    for i in range(count):
        delta = torch.randn(*S.G.shape[:1], S.G.shape[-1], generator=gen, dtype=S.G.dtype)
        scale = eps if i % 2 == 0 else eps * float(torch.rand(1, generator=gen))
        delta = delta / delta.norm(dim=-1, keepdim=True) * scale
        zeta = torch.rand(*S.A.shape[:1], S.A.shape[-1], generator=gen, dtype=S.A.dtype) * 2 - 1
        if i % 3:
            zeta = zeta.sign()
        out.append(S.c + torch.einsum("bndp,bp->bnd", S.G, delta) + torch.einsum("bndm,bm->bnd", S.A, zeta))
    return torch.stack(out)


def remainder_rows(layer, X: torch.Tensor, dev: torch.Tensor) -> torch.Tensor:
    """F(X + Γ) − F(X) − J_F(X)[Γ] per image [B, n, d], J from torch.autograd on the layer's forward."""
    out = []
    for b in range(X.shape[0]):
        J = torch.autograd.functional.jacobian(lambda Z: layer(Z[None])[0], X[b])  # [n, d, n, d]
        lin = torch.einsum("ndme,me->nd", J, dev[b])
        out.append(layer((X[b] + dev[b])[None])[0] - layer(X[b][None])[0] - lin)
    return torch.stack(out)


def remainder_norm(layer, X: torch.Tensor, dev: torch.Tensor) -> torch.Tensor:
    """‖F(X + Γ) − F(X) − J_F(X)[Γ]‖ per image and output token [B, n]."""
    return remainder_rows(layer, X, dev).norm(dim=-1)


# (norm, seed, q/k scale, ε, whether the set's bound is below the ball's somewhere, whether the second
# order's rows are below the other rows' somewhere, whether its third order under the clean row is
# below the cumulant's somewhere): where attention is soft and the ball small the quadratic form at the
# clean point (§2.3.2) is the tighter; where it saturates at a large ε, the rows from softmax's box;
# where q/k are sharp, the clean row's third order
CASES = [("project", 1, 1.0, 0.05, False, True, False), ("project", 2, 4.0, 0.2, True, False, True),
         ("batch", 6, 0.5, 0.01, True, True, False), ("batch", 7, 3.0, 0.005, True, True, True),
         ("layer", 8, 2.0, 0.02, True, True, True)]


def inputs(kind: str, seed: int, qk: float):
    gen = torch.Generator().manual_seed(seed)
    if kind == "project":
        net = random_vit(seed, depth=2, qk=qk)
        x = torch.rand(3, net.cfg.image, net.cfg.image, generator=gen, dtype=torch.float64)
        return net, x, lambda z: true_stages(net, z)[0::3], "project"
    net = bn_vit(seed, kind, "cls", True, qk=qk)
    x = torch.rand(3, 8, 8, generator=gen, dtype=torch.float64)
    return net, x, lambda z: attention_inputs(net, z), "norm"


def staged(kind: str, seed: int, qk: float, eps: float):
    """(taylor_net on :func:`inputs`' network and images, its stages' sets by name, attention's clean
    inputs per block, the name of the stage before attention) at ``eps``, first pass."""
    net, x, attn_in, before = inputs(kind, seed, qk)
    with torch.no_grad():
        tn = TaylorNet(net, x, net(x).argmax(-1))
        return tn, dict((name, S) for name, S, _ in tn.stages(eps, refuse=False)), attn_in(x), before


def staged_moves(kind: str, seed: int, qk: float, eps: float, salt: int):
    """:func:`staged`, with attention's inputs at 6 sampled perturbations of the images (each block's)
    and the generator that drew them (seeded ``seed + salt``), to draw more."""
    _, x, attn_in, _ = inputs(kind, seed, qk)
    tn, stages, clean, before = staged(kind, seed, qk, eps)
    gen = torch.Generator().manual_seed(seed + salt)
    with torch.no_grad():
        moved = [attn_in(x + d) for d in perturbations(x, eps, 6, gen)]
    return tn, stages, clean, before, moved, gen


def read_on_set(S, layer, X: torch.Tensor, eps: float):
    """(attention's parts with ξ, the set's radius, its logit box, its rows' readings) at block input X."""
    parts = dataclasses.replace(attention_parts(layer, X), xi=xi(layer, X))
    box = logit_box(S, layer, parts, eps, S.route)
    return parts, S.route, box, set_rows(S, layer, parts, eps, box)


@pytest.mark.parametrize("refine", [False, True], ids=["first", "second"])
@pytest.mark.parametrize("kind,seed,qk,eps,below,second_below,clean_below", CASES)
def test_the_remainders_on_the_set_hold_its_points_and_the_true_deviations(kind, seed, qk, eps, below,
                                                                          second_below, clean_below, refine):
    net, x, attn_in, before = inputs(kind, seed, qk)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        y = net(x).argmax(-1)
        tn = TaylorNet(net, x, y)
        stages = tn.stages(eps, log=[] if refine else None, refine=refine, refuse=False)
        stages = dict((name, S) for name, S, _ in stages)
        clean = attn_in(x)
        moved = [attn_in(x + d) for d in perturbations(x, eps, 8, gen)]
    tighter = narrower = sharper = cleaner = per_key = False
    for k, layer in enumerate(tn.layers):
        S, X = stages[f"{before}{k}"], clean[k]
        parts, r, box, readings = read_on_set(S, layer, X, eps)
        spread, row_spans = readings.spread, readings.spans
        rows, set_tokens = set_remainder(layer, parts, box, r, S.token_radii(eps), spread, row_spans)
        # the spans' total variation (tanh(s/4)) only lowers the box's moved mass
        plain_rows, plain_tokens = set_remainder(layer, parts, box, r, S.token_radii(eps), spread)
        assert (rows <= plain_rows).all() and (set_tokens <= plain_tokens).all()
        spans = remainder(layer, X, r, core=parts.xi, spans=row_spans)
        tokens = row_remainders(layer, X, r, row_spans, S.token_radii(eps), spread)  # [B, n]
        # each key on its own too (docs/bounds.md §5.1, "The logits' part per key")
        keyed = row_bound(*row_factors(layer, X, r, row_spans, S.token_radii(eps), spread,
                                       keyed=(readings.excess, readings.moved)))
        assert (keyed <= tokens).all()
        per_key = per_key or bool((keyed < tokens * (1 - 1e-6)).any())
        narrower = narrower or bool((spread < box.spread(parts.P) * (1 - 1e-6)).any())
        assert fits(layer, S)
        second = second_order_rows(S, layer, parts, eps, box, readings, S.token_radii(eps))
        assert not second.isnan().any()
        # each route of the third order alone holds the truth too; the clean row's is the tighter somewhere
        alone = [second_order_rows(S, layer, parts, eps, box, readings, S.token_radii(eps), routes=(route,))
                 for route in ("cumulant", "clean")]
        assert (second <= torch.minimum(*alone) * (1 + 1e-12)).all()
        cleaner = cleaner or bool((alone[1] < alone[0] * (1 - 1e-6)).any())
        sharper = sharper or bool((second < torch.minimum(tokens, set_tokens) * (1 - 1e-6)).any())
        assert torch.isfinite(rows).all() and torch.isfinite(spans).all() and not tokens.isnan().any()
        Q, K = layer.queries_keys(X)
        devs = [m[k] - X for m in moved] + list(set_points(S, eps, 8, gen))
        for dev in devs:
            assert (dev.flatten(1).norm(dim=-1) <= r * (1 + 1e-9)).all()
            Qm, Km = layer.queries_keys(X + dev)
            whole = (Qm @ Km.mT - Q @ K.mT) / layer.d_h**0.5
            lin = (torch.einsum("bnd,hde->bhne", dev, layer.W_q) @ K.mT
                   + Q @ torch.einsum("bnd,hde->bhne", dev, layer.W_k).mT) / layer.d_h**0.5
            slack = 1e-9 * (1 + box.centre.abs())
            assert ((lin - box.centre).abs() <= box.linear + slack).all(), (k, "linear logits")
            assert ((whole - box.centre).abs() <= box.whole + slack).all(), (k, "logits")
            P = parts.P
            std = (P * (lin - (P * lin).sum(-1, keepdim=True)).square()).sum(-1).sqrt()
            assert (std <= spread * (1 + 1e-9) + 1e-12).all(), (k, "spread")
            span = whole.amax(-1) - whole.amin(-1)
            assert (span <= row_spans * (1 + 1e-9) + 1e-12).all(), (k, "span")
            with torch.enable_grad():
                per_token = remainder_norm(layer, X, dev)
            for bound in (tokens, keyed, set_tokens, second, *alone):
                assert (per_token <= bound * (1 + 1e-9) + 1e-12).all(), (k, "per token")
            true = per_token.norm(dim=-1)
            for bound in (rows, spans):
                assert (true <= bound * (1 + 1e-9) + 1e-12).all(), (k, float((true - bound).max()))
        ball = remainder(layer, X, r, core=parts.xi)
        tighter = tighter or bool((torch.minimum(rows, spans) < ball * (1 - 1e-6)).any())
    assert tighter or not below
    assert narrower  # the set's rows see what the box cannot, in every case
    # and the keys, one at a time, what the rows' statistics cannot: everywhere but the softest attention
    # (q/k at half scale), where the second-order forms are the smaller at every token
    assert per_key or qk < 1
    assert sharper or not second_below
    assert cleaner == clean_below


@pytest.mark.parametrize("kind,seed,qk,eps", [("project", 15, 2.0, 0.05), ("batch", 17, 8.0, 0.1)])
def test_the_spans_pair_by_pair_are_a_dense_construction_and_below_twice_the_largest_entry(kind, seed, qk,
                                                                                          eps):
    """pair_spans against its bound assembled key pair by key pair from the mapped parts (the G part's
    distance from G's columns themselves, every symbol's difference at its sign, each group's
    difference under the budget, the quadratic part at both entries), to 1e-9; the spans never above
    the form that pays every part but G and the shift at twice its largest entry, and below it
    somewhere (docs/bounds.md §5.1, "The logits' rows on the set")."""
    from bounds.network.stages.logits import map_logits, pair_spans

    tn, stages, clean, before = staged(kind, seed, qk, eps)
    lower = False
    with torch.no_grad():
        for k, layer in enumerate(tn.layers):
            S, X = stages[f"{before}{k}"], clean[k]
            parts, _, box, readings = read_on_set(S, layer, X, eps)
            M = map_logits(S, layer, parts)
            root = math.sqrt(layer.d_h)
            quad = (box.whole - box.linear).clamp_min(0)
            shift_pairs = M.shift[..., :, None] - M.shift[..., None, :]
            n = M.shift.shape[-1]
            want = torch.full_like(M.shift[..., 0], -math.inf)  # [B, h, i]
            twice = torch.zeros_like(M.shift[..., 0])
            for j, kk in itertools.product(range(n), range(n)):
                g = eps * (M.G[..., j, :] - M.G[..., kk, :]).norm(dim=-1) + shift_pairs[..., j, kk]
                a = (M.A[..., j, :] - M.A[..., kk, :]).abs().sum(-1)
                q = S.grouped((M.Q[..., j, :, :] - M.Q[..., kk, :, :]).norm(dim=-1))
                total = (g + a + q) / root + quad[..., j] + quad[..., kk]
                want = torch.maximum(want, total)
                twice = torch.maximum(twice, g / root)
            entry = (M.A.abs().sum(-1) + S.grouped(M.Q.norm(dim=-1))) / root + quad
            twice = twice + 2 * entry.amax(-1)
            pairs = eps * (M.G[..., :, None, :] - M.G[..., None, :, :]).norm(dim=-1) + shift_pairs
            got = pair_spans(S, M, pairs, quad, root)
            assert torch.allclose(got, want, rtol=1e-9, atol=1e-12), k
            # the G part's pair term uses the centred Gram there; both bound the same differences
            assert (got <= twice * (1 + 1e-9) + 1e-12).all(), k
            lower = lower or bool((readings.spans < twice * 0.95).any())
    assert lower


def functionals(B: int, n: int, d: int, layer, gen: torch.Generator) -> torch.Tensor:
    """[B, 8, n, d]: Gaussian functionals on every token, one on a single token, one along a head's
    output directions (the rows of W^O: where the values do spread) and one against them."""
    gauss = torch.randn(B, 5, n, d, generator=gen, dtype=torch.float64)
    one = torch.zeros(B, 1, n, d, dtype=torch.float64)
    one[:, 0, n // 2] = torch.randn(B, d, generator=gen, dtype=torch.float64)
    Wo = layer.W_o[0].detach()  # [d_h, d]
    along = (torch.randn(B, n, Wo.shape[0], generator=gen, dtype=torch.float64) @ Wo)[:, None]
    basis = torch.linalg.qr(layer.W_o.detach().reshape(-1, d).mT).Q  # [d, h·d_h]
    rest = torch.randn(B, 1, n, d, generator=gen, dtype=torch.float64)
    against = rest - (rest @ basis) @ basis.mT  # W^O's rows' complement: R reads 0 there, if h·d_h < d
    return torch.cat([gauss, one, along, against], 1)


@pytest.mark.parametrize("kind,seed,qk,eps,below,second_below,clean_below", CASES)
def test_the_remainder_along_a_functional_holds_the_true_deviations_and_never_exceeds_the_rows(
        kind, seed, qk, eps, below, second_below, clean_below):
    """|⟨Λ_i, R(Γ)_i⟩| ≤ functional_rows on the set's points and sampled perturbations, with the set's
    own radii, spans and spread (docs/bounds.md §5.1, "Attention's remainder along a functional"); the
    bound is at most ‖Λ_i‖ times the row's (row_remainders), and below it for some functional."""
    tn, stages, clean, before, moved, gen = staged_moves(kind, seed, qk, eps, 200)
    below_rows = False
    for k, layer in enumerate(tn.layers):
        S, X = stages[f"{before}{k}"], clean[k]
        _, r, _, readings = read_on_set(S, layer, X, eps)
        own = S.token_radii(eps)
        stats, factors, v = row_factors(layer, X, r, readings.spans, own, readings.spread)
        rows = row_bound(stats, factors, v)
        assert torch.equal(rows, row_remainders(layer, X, r, readings.spans, own, readings.spread))
        Lam = functionals(*X.shape[:1], *X.shape[1:], layer, gen)
        along = functional_rows(layer, X, stats, factors, Lam)  # [B, C, n]
        norm = Lam.norm(dim=-1)
        scaled = torch.where(norm > 0, norm * rows[:, None], 0.0)  # a row read by nothing costs nothing
        assert (along <= scaled * (1 + 1e-9) + 1e-15).all(), k
        below_rows = below_rows or bool((along < scaled * 0.5).any())
        for dev in [m[k] - X for m in moved] + list(set_points(S, eps, 6, gen)):
            with torch.enable_grad():
                R = remainder_rows(layer, X, dev)  # [B, n, d]
            true = torch.einsum("bcnd,bnd->bcn", Lam, R).abs()
            assert (true <= along * (1 + 1e-9) + 1e-12).all(), (k, float((true - along).max()))
    assert below_rows


@pytest.mark.parametrize("kind,seed,qk,eps,below,second_below,clean_below", CASES)
def test_the_values_along_a_functional_read_on_the_set_hold_the_true_deviations(kind, seed, qk, eps, below,
                                                                               second_below, clean_below):
    """value_ranges: std_{p_i}(z) and the span over the keys of z_k = Γ_kC_lΛ_i (C_l = W^V_l W^O_l formed
    densely) at the set's points and at the true deviations of sampled perturbations are within its
    bounds; they are below the keys' radii's forms somewhere; and functional_rows with them is never
    above it without them, below it somewhere, and holds |⟨Λ_i, R(Γ)_i⟩| at the same deviations
    (docs/bounds.md §5.1, "The values along a functional, on the set")."""
    from bounds.network.stages.attention import value_ranges

    tn, stages, clean, before, moved, gen = staged_moves(kind, seed, qk, eps, 300)
    tighter = lower = False
    for k, layer in enumerate(tn.layers):
        S, X = stages[f"{before}{k}"], clean[k]
        parts, r, _, readings = read_on_set(S, layer, X, eps)
        own = S.token_radii(eps)
        stats, factors, _ = row_factors(layer, X, r, readings.spans, own, readings.spread)
        keyed = row_factors(layer, X, r, readings.spans, own, readings.spread,
                            keyed=(readings.excess, readings.moved))[1]
        Lam = functionals(X.shape[0], *X.shape[1:], layer, gen)
        # and units' functionals: one row each, the same two rows at every token (one per neuron)
        units = torch.zeros(X.shape[0], 2 * X.shape[1], *X.shape[1:], dtype=X.dtype)
        rows = torch.randn(X.shape[0], 2, X.shape[-1], generator=gen, dtype=X.dtype)
        for t in range(X.shape[1]):
            units[:, 2 * t, t], units[:, 2 * t + 1, t] = rows[:, 0], rows[:, 1]
        Lam = torch.cat([Lam, units], 1)
        with torch.no_grad():
            spread, span, middles, halves = value_ranges(layer, S, eps, parts.P, Lam)  # [B, C, h, i(, k)]
            plain = functional_rows(layer, X, stats, factors, Lam)
            ranged = functional_rows(layer, X, stats, factors, Lam, (spread, span))
            # each key on its own too (docs/bounds.md §5.1, "The logits' part per key")
            per_key = functional_rows(layer, X, stats, keyed, Lam, (spread, span, middles, halves))
        assert (ranged <= plain).all(), k
        assert (per_key <= ranged).all(), k
        lower = lower or bool((ranged < plain * (1 - 1e-6)).any())
        C = torch.einsum("hde,hef->hdf", layer.W_v, layer.W_o)  # [h, d, d]
        w = torch.einsum("hdf,bcif->bchid", C, Lam)
        radius_form = factors.reach[:, None] * w.norm(dim=-1)
        tighter = tighter or bool((span < radius_form * 0.9).any())
        # the assembly, one functional, head and row at a time, from the set's per-token supports
        last = X.shape[1] - 1
        picks = ((0, 0), (5, 0), (7, last), (8, 0), (9, 0), (8 + 2 * last, last), (9 + 2 * last, last))
        for b, (c, i), h in itertools.product(range(X.shape[0]), picks, range(layer.h)):
            v = w[b, c, h, i]
            mid, half = S.ranges(v.expand(X.shape[0], 1, X.shape[1], -1).contiguous(), eps)
            mid, half, p = mid[b, 0], half[b, 0], parts.P[b, h, i]
            want_spread = (p * ((mid - (p * mid).sum()).abs() + half).square()).sum().sqrt()
            want_span = (mid + half).max() - (mid - half).min()
            assert torch.allclose(spread[b, c, h, i], want_spread, rtol=1e-9, atol=1e-13), (k, b, c, h, i)
            assert torch.allclose(span[b, c, h, i], want_span, rtol=1e-9, atol=1e-13), (k, b, c, h, i)
        P = parts.P[:, None]  # [B, 1, h, i, k]
        for dev in [m[k] - X for m in moved] + list(set_points(S, eps, 6, gen)):
            z = torch.einsum("bkd,bchid->bchik", dev, w)
            std = (P * (z - (P * z).sum(-1, keepdim=True)).square()).sum(-1).sqrt()
            assert (std <= spread * (1 + 1e-9) + 1e-12).all(), (k, "spread")
            assert (z.amax(-1) - z.amin(-1) <= span * (1 + 1e-9) + 1e-12).all(), (k, "span")
            live = (Lam != 0).any(-1)[:, :, None, :, None]  # each key's range, on the rows read
            off = ((z - middles).abs() - halves).where(live, -1.0)
            assert (off <= 1e-9 * halves + 1e-12).all(), (k, "key")
            with torch.enable_grad():
                R = remainder_rows(layer, X, dev)  # [B, n, d]
            true = torch.einsum("bcnd,bnd->bcn", Lam, R).abs()
            assert (true <= ranged * (1 + 1e-9) + 1e-12).all(), (k, float((true - ranged).max()))
            assert (true <= per_key * (1 + 1e-9) + 1e-12).all(), (k, float((true - per_key).max()))
    assert tighter and lower


def test_the_values_are_read_per_image_and_kept_to_the_radii_over_the_limits(monkeypatch):
    """value_ranges on a batch equals it on each image alone, bit for bit (a unit-like functional's
    duplicated rows read once); an image whose distinct rows exceed VALUE_ROWS, or whose supports
    exceed VALUE_WORK, keeps the keys' radii's forms (∞ here, and functional_rows as without them);
    with no image within the limits, None."""
    import bounds.network.stages.attention as attention
    from bounds.network.stages.attention import value_ranges

    tn, stages, clean, before = staged("project", 15, 2.0, 0.05)
    S, X, layer = stages[f"{before}1"], clean[1], tn.layers[1]
    parts, r, _, readings = read_on_set(S, layer, X, 0.05)
    gen = torch.Generator().manual_seed(3)
    Lam = functionals(X.shape[0], *X.shape[1:], layer, gen)
    Lam[1, :, 1:] = 0  # image 1: one row a functional, 8 distinct rows; image 0: 8·n
    with torch.no_grad():
        whole = value_ranges(layer, S, 0.05, parts.P, Lam)
        for b in range(X.shape[0]):
            alone = tn.stages(0.05, images=torch.tensor([b]), refuse=False)
            Sb = dict((name, T) for name, T, _ in alone)[f"{before}1"]
            one = value_ranges(layer, Sb, 0.05, parts.P[b:b + 1], Lam[b:b + 1])
            for got, want in zip(one, whole, strict=True):
                assert torch.equal(got[0], want[b]), b
        monkeypatch.setattr(attention, "VALUE_ROWS", 8)
        spread, span = value_ranges(layer, S, 0.05, parts.P, Lam)[:2]
        assert torch.isinf(spread[0]).all() and torch.isinf(span[0]).all()
        assert torch.equal(spread[1], whole[0][1]) and torch.equal(span[1], whole[1][1])
        stats, factors, _ = row_factors(layer, X, r, readings.spans, S.token_radii(0.05), readings.spread)
        plain = functional_rows(layer, X, stats, factors, Lam)
        assert torch.equal(functional_rows(layer, X, stats, factors, Lam, (spread, span))[0], plain[0])
        monkeypatch.setattr(attention, "VALUE_ROWS", 256)
        monkeypatch.setattr(attention, "VALUE_WORK", 0)
        assert value_ranges(layer, S, 0.05, parts.P, Lam) is None


# (norm, seed, q/k scale, ε, whether the first-order form is the smaller at some head and row): soft
# attention pays the second-order form everywhere; saturated attention (q/k sharp, ε large) the first
@pytest.mark.parametrize("kind,seed,qk,eps,saturated", [("project", 15, 2.0, 0.05, False),
                                                        ("layer", 16, 1.0, 0.02, False),
                                                        ("batch", 17, 8.0, 0.1, True)])
def test_the_remainder_along_a_functional_reads_the_values_as_a_dense_construction_does(kind, seed, qk, eps,
                                                                                       saturated):
    """functional_rows against the same row bound assembled from dense float64 quantities (C_l = W^V_l W^O_l
    formed, σ_i(λ) from pairwise differences, ‖C_lλ‖ and the span of X C_l λ directly), each head and row
    apart, its logits' part and its values' part each the smaller of its second-order and first-order
    forms, to 1e-9."""
    from bounds.remainder.row_bounds import curve_g1, curve_g2, curve_h2

    tn, stages, clean, before = staged(kind, seed, qk, eps)
    gen = torch.Generator().manual_seed(seed)
    took_first = False
    with torch.no_grad():
        for k, layer in enumerate(tn.layers):
            S, X = stages[f"{before}{k}"], clean[k]
            own = S.token_radii(eps)
            stats, f, _ = row_factors(layer, X, S.route, None, own)
            Lam = functionals(X.shape[0], *X.shape[1:], layer, gen)
            got = functional_rows(layer, X, stats, f, Lam)
            want = torch.zeros_like(got)
            # the first-order form's reach per image: ‖Γ_j‖ + ‖Γ_k‖ ≤ the two largest token radii (and
            # ≤ √2 times the ball's radius)
            radii = torch.minimum(own, S.route[:, None]).sort(dim=-1, descending=True).values
            reach = [min(float(radii[b, :2].sum()), math.sqrt(2) * float(S.route[b])) for b in range(len(X))]
            for b, c, i in itertools.product(*map(range, got.shape)):
                lam = Lam[b, c, i]
                for head in range(layer.h):
                    C = layer.W_v[head] @ layer.W_o[head]  # [d, d]
                    yk, p = X[b] @ C @ lam, stats.P[b, head, i]  # [n]: (X C λ)_k
                    sigma = (0.5 * (p[:, None] * p[None] * (yk[:, None] - yk[None]).square()).sum()).sqrt()
                    s, sq, su = f.s[b, head, i], f.sq[b, head, i], f.su[b, head, i]
                    span = yk.max() - yk.min()
                    logits = torch.minimum(sigma * curve_g2(s) * su, curve_h2(s) * span * su**2)
                    keys = f.keys[b, head, i] * (C @ lam).norm()
                    # ½‖p' − p‖₁ ≤ tanh(s/4) where the logits' change spans at most s
                    tv = math.tanh(float(s) / 4)
                    # the logits' part and the values' part, each the smaller of its two forms; where
                    # e^s overflows the second-order form is ∞·0 (NaN): the first-order form alone
                    parts = [(sigma * sq + logits, tv * span + su * sigma),
                             (keys * curve_g1(s) * su, tv * reach[b] * (C @ lam).norm())]
                    for second, first in parts:
                        want[b, c, i] += torch.fmin(second, first)
                        took_first = took_first or not bool(second <= first)
            assert torch.allclose(got, want, rtol=2e-9, atol=1e-14), (k, float((got - want).abs().max()))
    assert took_first == saturated


def test_the_remainder_along_functionals_in_chunks_is_the_same_bit_for_bit(monkeypatch):
    """functional_rows over many functionals, a few at a time (its memory cap), equals one pass."""
    import bounds.remainder.row_bounds as row_bounds

    tn, stages, clean, before = staged("project", 15, 2.0, 0.05)
    S, X = stages[f"{before}0"], clean[0]
    with torch.no_grad():
        stats, f, _ = row_factors(tn.layers[0], X, S.route, None, S.token_radii(0.05))
        Lam = torch.randn(X.shape[0], 50, *X.shape[1:], generator=torch.Generator().manual_seed(0),
                          dtype=torch.float64)
        whole = functional_rows(tn.layers[0], X, stats, f, Lam)
        monkeypatch.setattr(row_bounds, "FUNCTIONALS", 7)
        assert torch.equal(functional_rows(tn.layers[0], X, stats, f, Lam), whole)


def ascend(value, X: torch.Tensor, r: float, gen: torch.Generator, steps: int) -> float:
    """The largest value(Γ) found by projected Adam over ‖Γ‖_F ≤ r from a random start (one image)."""
    G = torch.randn(X.shape, generator=gen, dtype=torch.float64)
    G = (G * r / G.norm()).requires_grad_()
    opt = torch.optim.Adam([G], lr=r / 10)
    best = -float("inf")
    for _ in range(steps):
        v = value(G)
        best = max(best, float(v.detach()))
        opt.zero_grad()
        (-v).backward()
        opt.step()
        with torch.no_grad():
            G.mul_(torch.clamp(r / G.norm(), max=1.0))
    return best


def remainder_of(layer, X: torch.Tensor):
    """Γ ↦ R(Γ) = F(X + Γ) − F(X) − J_F(X)[Γ] for one image X [n, d], J from torch.autograd."""
    J = torch.autograd.functional.jacobian(lambda Z: layer(Z[None])[0], X)  # [n, d, n, d]
    clean = layer(X[None])[0].detach()
    return lambda G: layer((X + G)[None])[0] - clean - torch.einsum("ndme,me->nd", J, G)


def ascend_along(layer, X: torch.Tensor, lam: torch.Tensor, i: int, r: float, gen: torch.Generator,
                 steps: int = 50) -> float:
    """The largest |⟨λ, R(Γ)_i⟩| found by projected Adam over ‖Γ‖_F ≤ r from a random start (one image,
    X [n, d]), R from the layer's forward and its autograd Jacobian at X."""
    R = remainder_of(layer, X)
    return ascend(lambda G: (lam * R(G)[i]).sum().abs(), X, r, gen, steps)


@pytest.mark.parametrize("kind,seed,qk,eps", [("project", 11, 1.0, 0.05), ("project", 12, 4.0, 0.1),
                                               ("batch", 13, 2.0, 0.01), ("layer", 14, 3.0, 0.02),
                                               ("batch", 17, 8.0, 0.1)])
def test_the_remainder_along_a_functional_holds_an_ascent_on_the_ball(kind, seed, qk, eps):
    """An independent attack: Adam ascent on |⟨Λ_i, R(Γ)_i⟩| over the whole ball ‖Γ‖_F ≤ r (the
    factors taken without the set's readings), the remainder from an autograd Jacobian of the layer,
    never above functional_rows."""
    rows_hold_an_ascent(kind, seed, qk, eps, functional_rows, ascend_along)


def rows_hold_an_ascent(kind: str, seed: int, qk: float, eps: float, bound, ascent) -> None:
    """Asserts ``ascent``(layer, X_b, Λ_bci, i, r_b, gen) ≤ ``bound``(layer, X, stats, factors, Λ)[b, c, i]
    on every block of :func:`staged`'s network, for three functionals and a random row each, with the
    row factors of the whole ball (without the set's readings)."""
    tn, stages, clean, before = staged(kind, seed, qk, eps)
    gen = torch.Generator().manual_seed(seed)
    for k, layer in enumerate(tn.layers):
        X, r = clean[k], stages[f"{before}{k}"].route
        stats, factors, _ = row_factors(layer, X, r)
        Lam = functionals(X.shape[0], *X.shape[1:], layer, gen)[:, [0, 5, 6]]
        values = bound(layer, X, stats, factors, Lam)  # [B, 3, n]
        for b in range(X.shape[0]):
            for c in range(Lam.shape[1]):
                i = int(torch.randint(X.shape[1], (1,), generator=gen))
                best = ascent(layer, X[b], Lam[b, c, i], i, float(r[b]), gen)
                assert best <= float(values[b, c, i]) * (1 + 1e-9) + 1e-12, (k, b, c, best)


@pytest.mark.parametrize("kind,seed,qk", [("project", 3, 2.0), ("batch", 4, 1.0), ("layer", 5, 3.0)])
def test_the_second_order_forms_are_the_autograd_second_derivative_on_the_first_generator(kind, seed, qk):
    """δᵀM_{i,c}δ = ½ d²/dt² F(X + tGδ)_{i,c} at t = 0 (torch.func's jvp twice, not the suite's forms), at
    random δ, every row and output coordinate; the forms of a few rows at a time are the rows of the
    whole."""
    net, x, attn_in, before = inputs(kind, seed, qk)
    with torch.no_grad():
        y = net(x).argmax(-1)
        tn = TaylorNet(net, x, y)
        stages = dict((name, S) for name, S, _ in tn.stages(0.01, refuse=False))
        clean = attn_in(x)
    gen = torch.Generator().manual_seed(seed)
    for k, layer in enumerate(tn.layers):
        S, X = stages[f"{before}{k}"], clean[k]
        parts = attention_parts(layer, X)
        for b in range(X.shape[0]):
            M = row_forms(S, layer, parts, b)  # [n, d, P, P]
            # formed two rows at a time (as second_order_rows does where memory is short): the same forms
            rows = torch.cat([row_forms(S, layer, parts, b, slice(i, i + 2)) for i in range(0, len(M), 2)])
            assert torch.allclose(rows, M, rtol=1e-12, atol=1e-14 * float(M.abs().max()))
            for _ in range(3):
                delta = torch.randn(S.G.shape[-1], generator=gen, dtype=torch.float64)
                line = (S.G[b] @ delta)[..., None]  # [n, d, 1]: the direction Gδ as a one-column generator
                second = second_derivative(functools.partial(on_set, layer, X[b], line))
                form = torch.einsum("p,icpq,q->ic", delta, M, delta)
                assert torch.allclose(form, 0.5 * second, rtol=1e-9, atol=1e-9 * float(second.abs().max()))


@pytest.mark.parametrize("kind,seed,qk,eps", [("batch", 9, 2.0, 0.01), ("layer", 10, 1.0, 0.02)])
def test_the_second_order_rows_hold_an_ascent_on_each_rows_remainder(kind, seed, qk, eps):
    """An independent attack: Adam ascent on ‖R_i(Gδ)‖ over ‖δ‖ ≤ ε (a part of the set) for every row i,
    the remainder from torch.func's jvp of the layer, never above the second order's row bound."""
    net, x, attn_in, before = inputs(kind, seed, qk)
    with torch.no_grad():
        y = net(x).argmax(-1)
        tn = TaylorNet(net, x, y)
        stages = dict((name, S) for name, S, _ in tn.stages(eps, refuse=False))
        clean = attn_in(x)
    for k, layer in enumerate(tn.layers):
        S, X = stages[f"{before}{k}"], clean[k]
        parts = attention_parts(layer, X)
        box = logit_box(S, layer, parts, eps, S.route)
        bound = second_order_rows(S, layer, parts, eps, box, set_rows(S, layer, parts, eps, box),
                                  S.token_radii(eps))
        # the third order by either route alone (docs/bounds.md §5.1): the ascent below holds both
        alone = [second_order_rows(S, layer, parts, eps, box, set_rows(S, layer, parts, eps, box),
                                   S.token_radii(eps), routes=(route,)) for route in ("cumulant", "clean")]
        assert (bound <= torch.minimum(*alone) * (1 + 1e-12)).all()
        for wrong in ((), ("diameter",)):  # no route, or one it does not know: refused, never +∞ silently
            with pytest.raises(ValueError, match="routes"):
                second_order_rows(S, layer, parts, eps, box, set_rows(S, layer, parts, eps, box),
                                  S.token_radii(eps), routes=wrong)
        # its forms one row at a time (where memory is short): the same bound
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(second_order, "FORM_CHUNK", 1)
            one = second_order_rows(S, layer, parts, eps, box, set_rows(S, layer, parts, eps, box),
                                    S.token_radii(eps))
        assert torch.allclose(one, bound, rtol=1e-12, atol=0)
        for b in range(X.shape[0]):
            rem = functools.partial(row_remainder, functools.partial(on_set, layer, X[b], S.G[b]))
            gen = torch.Generator().manual_seed(seed + b)
            dl = torch.randn(S.G.shape[-1], generator=gen, dtype=torch.float64)
            dl = (dl * eps / dl.norm()).requires_grad_()
            opt = torch.optim.Adam([dl], lr=eps / 10)
            best = torch.zeros(X.shape[1], dtype=torch.float64)
            for _ in range(60):
                R = rem(dl).norm(dim=-1)  # [n], at a point of the ball
                best = torch.maximum(best, R.detach())
                opt.zero_grad()
                (-R.sum()).backward()
                opt.step()
                with torch.no_grad():
                    dl.mul_(torch.clamp(eps / dl.norm(), max=1.0))
            assert float(dl.norm()) <= eps * (1 + 1e-12)
            for each in (bound, *alone):
                assert (best <= each[b] * (1 + 1e-9)).all(), (k, b, float((best / each[b]).max()))


def on_set(layer, X: torch.Tensor, G: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """The layer at X + Gδ (one image: X [n, d], G [n, d, P]), [n, d]."""
    return layer((X + G @ delta)[None])[0]


def second_derivative(f) -> torch.Tensor:
    """d²/dt² f(t) at t = 0 for f of t [1], by torch.func's jvp twice."""
    first = lambda t: torch.func.jvp(f, (t,), (torch.ones_like(t),))[1]
    zero = torch.zeros(1, dtype=torch.float64)
    return torch.func.jvp(first, (zero,), (torch.ones_like(zero),))[1]


def row_remainder(f, delta: torch.Tensor) -> torch.Tensor:
    """f(δ) − f(0) − Df(0)[δ] (torch.func's jvp), [n, d]."""
    zero = torch.zeros_like(delta)
    return f(delta) - f(zero) - torch.func.jvp(f, (zero,), (delta,))[1]


@pytest.mark.parametrize("kind,seed,qk,eps", [("project", 1, 1.0, 0.05), ("layer", 8, 2.0, 0.02)])
def test_the_second_order_is_formed_where_taylor_net_is_told(kind, seed, qk, eps):
    """``form_entries`` is TaylorNet's own option: at 0 the second pass forms no second order on the
    set, and every attention remainder is the same or wider than with ``math.inf`` (these small
    layers' forms fit the default too), wider somewhere; the forms' bound holds the true deviations
    (above)."""
    net, x, _, _ = inputs(kind, seed, qk)
    balls = {}
    with torch.no_grad():
        y = net(x).argmax(-1)
        for limit in (0, math.inf):
            stages = TaylorNet(net, x, y, form_entries=limit).stages(eps, log=[], refine=True, refuse=False)
            balls[limit] = torch.stack([S.rho[:, S.sources.index(name)] for name, S, _ in stages
                                        if name.startswith("attention")])
    assert (balls[math.inf] <= balls[0] * (1 + 1e-12)).all()
    assert (balls[math.inf] < balls[0] * (1 - 1e-6)).any()

"""The clean point's forms of attention's Taylor remainder and their certified norms (docs/bounds.md
§2.3.2): every one is an eigenproblem on a side whose size does not grow with the input's width n·d
squared, certified from above by a Cholesky factorisation (bounds.norms.verified_gram_norm,
docs/bounds.md §2.4) and raised for float64 rounding; the value pair above side
PAIR_PROBABILISTIC_ABOVE, as σ̄_J there, by Lanczos and a probabilistic certificate instead.

* :func:`logit_form_norm`: ‖𝒜‖, the pure-logit second-order term, and √Λ, the logits' linear spread;
* :func:`value_form_norm`: ‖𝓑‖, the value term dP[Γ]ΓC as the bilinear form it is;
* :func:`cubic_form_norm`: ‖𝒞‖, the pure-logit third-order term, and :func:`value_cubic_norm`, ‖𝓑₂‖,
  the value side's; :func:`value_pair_norm`, the two value forms bounded at once;
* :func:`spectral_spread`: σ₂, the values' spread along their widest direction, per head and row;
* the heads sharing Γ (λ_max(Σ_l w_li F_l F_lᵀ) per row): :mod:`bounds.heads`.

Beside them, estimates from *below* (:func:`ritz_below`, :func:`spread_estimate`,
:func:`value_side_below`, :func:`bounds.heads.heads_below`) that never enter a bound: they tell the
remainder which eigenproblems cannot matter (docs/bounds.md §2.3.4, "Eigenproblems left out").
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property

import torch
from torch import Tensor

from models import DotMHA
from models.operators import JACOBIAN_LIMIT

from .certificates import Certificate
from .norms import gram_norm, lanczos_upper, verified_gram_norm

# relative slack for the float64 rounding of sums, products and eigenvalues (docs/bounds.md §2.3.1)
ROUND_REL = 1e-9
# the forms' eigenvalue guesses are raised by this much before the Cholesky check confirms them
# (bounds.norms.verified_gram_norm's tau), their Lanczos run stopped at 1/100 of it: a form
# enters the remainder, itself ≥ 1.1× what an attack attains, so 1e-6 of it is nothing, and the
# remainder takes 10–30% less time on the wide layers (MiniLM, the benchmark's d 384) than at 1e-9
FORM_TAU = 1e-6
# the side up to which a form's λ_max is an eigendecomposition (LAPACK's, batched) rather than the
# guess and its Cholesky check: the guess's block Krylov loop is a few dozen small torch calls and
# eigenproblems of its own, which small sides do not repay (docs/scale.md, "The thresholds in the code")
FORM_EIGH_MAX = 384


def logit_gram(layer: DotMHA, X: Tensor, P: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(G, P): G [B, n·h·n, n·h·n] the Gram of the centred logit functionals f̂_α, α = (i, l, k) in
    this order (δ_lik − δ̄_li = f̂_αᵀ vec Γ), in closed form from the Grams of U_l = K_l W^Q_lᵀ,
    V_l = Q_l W^K_lᵀ and the e_k − p_li (docs/bounds.md §2.3.2); P [B, h, n, n] the attention."""
    B, n, _ = X.shape
    h = layer.h
    P = layer.attention(X) if P is None else P  # [B, h, n, n]
    Q, K = layer.queries_keys(X)
    U = K @ layer.W_q.mT  # [B, h, n, d]: U_l = K_l W^Q_lᵀ
    V = Q @ layer.W_k.mT  # V_l = Q_l W^K_lᵀ
    Ut = U[:, :, None] - (P @ U)[:, :, :, None]  # [B, h, i, k, d]: U_lk − ū_li
    eye = torch.eye(n, dtype=X.dtype, device=X.device)
    E = eye[None, None, None] - P[..., None, :]  # [B, h, i, k, n]: e_k − p_li
    # α = (i, l, k) in this order, so that N below is block-diagonal over rows i
    Ut = Ut.permute(0, 2, 1, 3, 4)  # [B, i, h, k, d]
    E = E.permute(0, 2, 1, 3, 4)  # [B, i, h, k, n]
    Vi = V.permute(0, 2, 1, 3)  # [B, i, h, d]: V_li
    m = h * n
    # ⟨f̂_α, f̂_β⟩·d_h = δ_ii'⟨Ũ_α, Ũ_β⟩ + (e_k' − p_l'i')_i ⟨Ũ_α, V_l'i'⟩ + (its transpose)
    #                   + ⟨e_k − p_li, e_k' − p_l'i'⟩⟨V_li, V_l'i'⟩
    EE = torch.einsum("bihkx,bjgqx->bihkjgq", E, E)
    VV = torch.einsum("bihd,bjgd->bihjg", Vi, Vi)
    G = EE.mul_(VV[:, :, :, None, :, :, None]).reshape(B, n * m, n * m)
    UV = torch.einsum("bihkd,bjgd->bihkjg", Ut, Vi)  # [B, i, h, k, i', l']
    T2 = torch.einsum("bihkjg,bjgqi->bihkjgq", UV, E).reshape(B, n * m, n * m)  # × (e_k' − p_l'i')_i
    G += T2
    G += T2.mT
    # the row-diagonal blocks i = i', added in place through a view of them
    UU = torch.einsum("bihkd,bigjd->bihkgj", Ut, Ut).reshape(B, n, m, m)
    torch.diagonal(G.view(B, n, m, n, m), dim1=1, dim2=3).add_(UU.permute(0, 2, 3, 1))
    return G.div_(layer.d_h), P


def top_eig(S: Tensor, vector: bool = False, start: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """λ_max of each [B, D, D] PSD matrix from above: a Cholesky factorisation of μI − S confirms
    a guess μ (bounds.norms.verified_gram_norm, docs/bounds.md §2.4: D³/3 flops where an
    eigendecomposition costs ≈ 4D³/3 and more), an eigendecomposition where it does not, and up to
    side FORM_EIGH_MAX an eigendecomposition alone (bounds.norms.gram_norm). Both read
    S's lower triangle: S is symmetric but for the rounding of its two halves' formation, which
    every caller's slack covers as it covers any entry's, so no symmetrised copy is made.
    ``vector``: with an approximate top eigenvector [B, D] (a start for :func:`spread_estimate`).
    ``start`` [B, D, 4]: the guess's first block, where the caller has directions near the top one."""
    if not vector:
        if S.shape[-1] <= FORM_EIGH_MAX:
            return gram_norm(S).square()
        return verified_gram_norm(S, FORM_TAU, start=start)[0].square()
    if S.shape[-1] <= FORM_EIGH_MAX:
        values, vectors = torch.linalg.eigh(S.to(torch.float64))
        lam = values[..., -1].clamp_min(0) * (1 + 4 * S.shape[-1] * torch.finfo(torch.float64).eps)
        return lam, vectors[..., -1]  # gram_norm's rounding margin, squared no further
    value, _, x = verified_gram_norm(S, FORM_TAU, vector=True)
    return value.square(), x


def weighted_gram(G: Tensor, P: Tensor, w: Tensor | None) -> tuple[Tensor, Tensor]:
    """(D, finite): D = diag(√(w p)) G diag(√(w p)) [B, D, D], zero where it is not finite."""
    B = P.shape[0]
    wp = P if w is None else P * (w if w.dim() == 4 else w[..., None])
    wp = wp.permute(0, 2, 1, 3)  # [B, i, h, k]
    root = wp.reshape(B, -1).clamp_min(0).sqrt()
    D = G * root[:, None, :]
    D.mul_(root[:, :, None])
    # a finite sum says every entry is finite (an ∞ or NaN entry makes it ∞ or NaN), in one pass and
    # without a mask of D's size; only where it does not is each entry asked
    finite = torch.isfinite(D.sum((-2, -1)))
    if bool(finite.all()):
        return D, finite
    finite = torch.isfinite(D).flatten(1).all(-1)
    return torch.where(finite[:, None, None], D, torch.zeros_like(D)), finite


def weighted_spread(G: Tensor, P: Tensor, w: Tensor | None = None,
                    vector: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """λ_max(Σ_α w_α p_α f̂_α f̂_αᵀ) = λ_max(D^½ G D^½), D = diag(w_α p_α), rounded up, [B]: for
    every ‖Γ‖_F = 1 it bounds Σ_{l,i} w_li Var_{p_li}(δ_li), the (weighted) energy of every head's
    and row's linear logit spread at once (docs/bounds.md §2.3.2). ``w`` [B, h, n] per (head, row)
    or [B, h, n, n] per (head, row, key), default 1; P [B, h, n, n]. ``vector``: with an
    approximate top eigenvector [B, D] of D, a start for :func:`spread_estimate`."""
    # weights that overflowed (e^s at a saturating scale) bound nothing: +inf, never an eigensolver
    # failure; the other bounds of the remainder serve there
    D, finite = weighted_gram(G, P, w)
    top, x = top_eig(D, vector=True) if vector else (top_eig(D), None)
    # rounding: far below 1e-10 of ‖D‖_F ≥ λ_max
    top = top * (1 + ROUND_REL) + 1e-10 * D.flatten(1).norm(dim=-1)
    top = torch.where(finite, top, torch.full_like(top, torch.inf))
    return (top, x) if vector else top


# steps of :func:`spread_estimate`'s block Krylov space (4 columns each)
ESTIMATE_STEPS = 2


def spread_estimate(G: Tensor, P: Tensor, w: Tensor, x: Tensor) -> Tensor:
    """λ_max(D_w) of :func:`weighted_spread` from *below*, [B], and cheaply: the top Ritz value of a
    small block Krylov space (ESTIMATE_STEPS steps) started at x, √w∘x and w∘x, with x the top
    eigenvector of the unweighted D (``weighted_spread(..., vector=True)``). Not a certificate: it
    only tells the remainder whether a weighted spread is worth certifying (bounds.remainder,
    SPREAD_SLACK). +inf where the weights are not finite."""
    B, N, _ = G.shape
    wa = torch.broadcast_to(w if w.dim() == 4 else w[..., None], P.shape).permute(0, 2, 1, 3).reshape(B, N)
    each = torch.isfinite(wa)
    finite = each.all(-1)
    wa = torch.where(each, wa, torch.zeros_like(wa)).clamp_min(0)
    # D_w Q through G itself, never D_w formed: a product overflowing there gives a Ritz value that
    # is not finite, which ritz_below reports as 0, an estimate from below still
    root = (wa * P.permute(0, 2, 1, 3).reshape(B, N)).clamp_min(0).sqrt()[..., None]
    start = torch.stack([x, wa.sqrt() * x, wa * x, torch.ones_like(x)], -1)  # [B, N, 4]
    top = ritz_below(lambda Q: root * (G @ (root * Q)), start, ESTIMATE_STEPS)
    return torch.where(finite, top, torch.full_like(top, torch.inf))


def ritz_below(apply: Callable[[Tensor], Tensor], start: Tensor, steps: int,
               vectors: int = 0) -> Tensor | tuple[Tensor, Tensor]:
    """The top Ritz value of the symmetric operator ``apply`` ([B, D, k] → [B, D, k]) on the block
    Krylov space of ``steps`` blocks from ``start`` [B, D, k], [B]: an estimate from *below*, never a
    bound. A Ritz value is at most λ_max on an orthonormal basis; a basis that lost orthogonality (a
    space invariant early, its new columns rounding noise) can give more
    (bounds.norms.ORTHO_TOL), so there it is 0: a caller then certifies what it would skip.
    ``vectors``: with the top ``vectors`` Ritz vectors [B, D, vectors] (a start for a guess)."""
    Q = torch.linalg.qr(start).Q
    basis, images = [Q], [apply(Q)]
    for _ in range(steps - 1):
        W, V = images[-1], torch.cat(basis, -1)
        for _ in range(2):
            W = W - V @ (V.mT @ W)
        Q = torch.linalg.qr(W).Q
        basis.append(Q)
        images.append(apply(Q))
    V = torch.cat(basis, -1)
    T = V.mT @ torch.cat(images, -1)
    T = 0.5 * (T + T.mT)
    # an overflowed product (inf, NaN) makes eigh fail outright: such a space's value is 0 below
    finite = torch.isfinite(T).flatten(1).all(-1)
    T = torch.where(finite[:, None, None], T, torch.zeros_like(T))
    if vectors:
        values, ritz = torch.linalg.eigh(T)
    else:  # the vectors are not asked: the values alone
        values = torch.linalg.eigvalsh(T)
    top = torch.where(finite, values[..., -1].clamp_min(0), torch.zeros_like(values[..., -1]))
    eye = torch.eye(V.shape[-1], dtype=V.dtype, device=V.device)
    orthonormal = (V.mT @ V - eye).abs().flatten(1).amax(-1) <= 1e-10
    top = torch.where(orthonormal & torch.isfinite(top), top, torch.zeros_like(top))
    return (top, V @ ritz[..., -vectors:]) if vectors else top


def logit_form_norm(layer: DotMHA, X: Tensor) -> tuple[Tensor, Tensor]:
    """‖𝒜‖ and √Λ, [B] each (docs/bounds.md §2.3.2).

    ‖𝒜‖ bounds the pure-logit second-order term, all heads and rows at once: with δ the linear
    logit change and Y_l = X C_l, row i of L(Γ) = Σ_l ½ Σ_k p_lik (δ_lik − δ̄_li)² (Y_lk − ȳ_li), and
    ‖L(Γ)‖_F ≤ ‖𝒜‖‖Γ‖_F². ‖𝒜‖² = ¼ λ_max(N^½ (G∘G) N^½) on the h·n² pairs α = (i, l, k): G the Gram of
    the centred logit functionals f̂_α (:func:`logit_gram`), N = ΩΩᵀ block-diagonal over rows,
    N_αβ = p_α p_β ⟨Ỹ_α, Ỹ_β⟩. The (nd)²-wide side is never formed. Λ = λ_max(Σ_α p_α f̂_α f̂_αᵀ) ≥
    Σ_{l,i} Var_{p_li}(δ_li) for every ‖Γ‖_F = 1 (:func:`weighted_spread`)."""
    G, P = logit_gram(layer, X)
    return form_norm(layer, X, G, P), weighted_spread(G, P).sqrt()


def _values(layer: DotMHA, X: Tensor) -> Tensor:
    """Y_l = X C_l = (X W^V_l) W^O_l, [B, h, n, d]: through the d_h-wide factors, h·n·d·d_h·2
    operations where C_l itself takes h·d²·d_h (MiniLM: 0.5 against 113 MFLOP)."""
    return (X[:, None] @ layer.W_v) @ layer.W_o


def _value_rows(layer: DotMHA, X: Tensor, P: Tensor, power: float = 1.0) -> Tensor:
    """p_α Ỹ_α per row i (p_α^``power`` Ỹ_α), [B, n, h·n, d]: Ỹ_α = Y_lk − ȳ_li, Y_l = X C_l,
    α = (i, l, k)."""
    B, n, d = X.shape
    Y = _values(layer, X)
    Yt = (Y[:, :, None] - (P @ Y)[:, :, :, None]).permute(0, 2, 1, 3, 4)  # [B, i, h, k, d]
    weight = P.permute(0, 2, 1, 3)[..., None]
    return (Yt * (weight if power == 1.0 else weight**power)).reshape(B, n, layer.h * n, d)


def value_root(layer: DotMHA, X: Tensor, P: Tensor) -> tuple[Tensor, Tensor]:
    """(N_i^½ [B, n, h·n, h·n], max_i λ_max(N_i) [B]) for N = ΩΩᵀ of :func:`_flattened`, block-diagonal
    over rows, N_i = M_i M_iᵀ with M_i = (p_α Ỹ_α)_α: what ‖𝒜‖ and ‖𝒞‖ share."""
    M = _value_rows(layer, X, P)
    mu, W = torch.linalg.eigh(M @ M.mT)  # [B, n, m, m]
    return (W * mu.clamp_min(0).sqrt()[..., None, :]) @ W.mT, mu.amax((-1, -2)).clamp_min(0)


def _flattened(layer: DotMHA, X: Tensor, K: Tensor, P: Tensor, scale: Tensor, deferred: bool = False,
               root: tuple[Tensor, Tensor] | Callable[[], tuple[Tensor, Tensor]] | None = None
               ) -> Tensor | Deferred:
    """λ_max(N^½ K N^½) rounded up, [B]: the squared norm of a form whose row (i, c) is
    Σ_{α∈i} p_α Ỹ_α[c] a_α, given the Gram K [B, h·n², h·n²] of its atoms a_α (docs/bounds.md §2.3.2);
    N = ΩΩᵀ is block-diagonal over rows, N_αβ = p_α p_β ⟨Ỹ_α, Ỹ_β⟩. ``scale`` [B] bounds the
    magnitude of K's entries and their rounding errors; the slack is 1e-10 of ‖N‖·scale.
    ``deferred``: the matrix, formed where first asked, and its eigenproblem left for when it is asked
    (:class:`Deferred`). ``root``: :func:`value_root`'s, if at hand, or a function that gives it."""
    B, n, _ = X.shape
    m = layer.h * n

    def formed() -> tuple[Tensor, Tensor]:
        N, top_n = value_root(layer, X, P) if root is None else root() if callable(root) else root
        S = torch.einsum("biax,bixjy,bjyc->biajc", N, K.reshape(B, n, m, n, m), N).reshape(B, n * m, n * m)
        return S, 1e-10 * top_n * scale

    if deferred:
        return Deferred(formed)
    S, slack = formed()
    return top_eig(S) * (1 + ROUND_REL) + slack


# block Krylov steps of :class:`Deferred`'s estimate from below (4 columns each, a fixed start)
DEFERRED_ESTIMATE_STEPS = 3


class Deferred:
    """λ_max of a symmetric S [B, D, D], rounded up as :func:`_flattened` rounds it, with S and its
    slack [B] from ``formed()`` at the first use that needs them; four ways: ``cheap``, a bound from
    above without S where the form has one (else None: :func:`logit_form_cheap`); ``upper``, from
    ‖S‖_F (certified, no eigenproblem: |λ| ≤ ‖S‖_F for a symmetric S); ``below``, a Ritz estimate
    (:func:`ritz_below`), never a bound; ``value()``, certified (:func:`top_eig`). Each computed at
    its first use and kept."""

    def __init__(self, formed: Callable[[], tuple[Tensor, Tensor]], cheap: Tensor | None = None) -> None:
        self._formed, self.cheap, self._value = formed, cheap, None

    @cached_property
    def _matrix(self) -> tuple[Tensor, Tensor]:
        return self._formed()

    @property
    def S(self) -> Tensor:
        return self._matrix[0]

    @property
    def slack(self) -> Tensor:
        return self._matrix[1]

    @cached_property
    def upper(self) -> Tensor:
        # the norm's own rounding is below D²·u relative, far under ROUND_REL
        return self.S.flatten(1).norm(dim=-1) * (1 + ROUND_REL) + self.slack

    @cached_property
    def below(self) -> Tensor:
        S = self.S
        g = torch.Generator().manual_seed(0)
        start = torch.randn(S.shape[-1], 4, generator=g, dtype=torch.float64).to(S.device)
        return ritz_below(lambda Q: S @ Q, start.expand(S.shape[0], -1, 4), DEFERRED_ESTIMATE_STEPS)

    def value(self) -> Tensor:
        if self._value is None:
            self._value = top_eig(self.S) * (1 + ROUND_REL) + self.slack
        return self._value


# power steps of :func:`logit_form_cheap`'s Collatz–Wielandt bound, and the positive floor its vector
# keeps: on the zoo's ViTs, MiniLM and the benchmark's cells 5 steps bring it within 0.3–3.7 % of the
# λ_max it bounds (1.6 % at 10, 1.14–1.63× at one step)
CHEAP_STEPS = 5
CHEAP_FLOOR = 1e-6


def logit_form_cheap(layer: DotMHA, X: Tensor, GG: Tensor, P: Tensor,
                     GG_norm: Tensor | None = None) -> Tensor:
    """(2‖𝒜‖)² = λ_max(N^½ (G∘G) N^½) from above without forming that matrix, [B] (docs/bounds.md
    §2.3.4, rule 4): N_i = D_i Ỹ_i Ỹ_iᵀ D_i ⪯ s_i D_i with D = diag(p) and s_i = ‖D_i^½ Ỹ_i‖² (an
    (h·n)-square eigenvalue per row), so with W = diag(s_i p_α) and G∘G PSD (Schur's product
    theorem) λ_max(N^½(G∘G)N^½) = λ_max((G∘G)^½ N (G∘G)^½) ≤ λ_max(W^½(G∘G)W^½). That matrix is
    entrywise nonnegative, so for any positive v its λ_max (its Perron root) is at most
    max_α (W^½(G∘G)W^½ v)_α / v_α (Collatz–Wielandt): v after CHEAP_STEPS power steps from 1, each
    kept ≥ CHEAP_FLOOR of its largest entry so that it stays positive. Rounding: the products' (D·u
    relative), s_i's eigenvalue (below D·u of its trace) and the entries' (1e-10 of max w·‖G∘G‖_F,
    as :func:`form_norm`'s slack). ``GG``: G∘G, ``GG_norm`` its Frobenius norm if at hand; each
    product goes through them, W^½(G∘G)W^½ is never formed."""
    B, n, _ = X.shape
    Mr = _value_rows(layer, X, P, 0.5)  # √p_α Ỹ_α per row i, [B, n, h·n, d]
    Gr = Mr @ Mr.mT  # D_i^½ Ỹ_i Ỹ_iᵀ D_i^½
    trace = Gr.diagonal(dim1=-2, dim2=-1).sum(-1)
    s = torch.linalg.eigvalsh(Gr)[..., -1] * (1 + ROUND_REL) + ROUND_REL * trace
    p = P.permute(0, 2, 1, 3).reshape(B, n, -1)  # α = (i, l, k)
    w = (s.clamp_min(0)[..., None] * p).reshape(B, -1)
    GG_norm = GG.flatten(1).norm(dim=-1) if GG_norm is None else GG_norm
    slack = 1e-10 * w.amax(-1) * GG_norm
    w = w.sqrt()

    def apply(v: Tensor) -> Tensor:  # W^½(G∘G)W^½ v
        return w * (GG @ (w * v)[..., None])[..., 0]

    v = torch.ones_like(w)
    for _ in range(CHEAP_STEPS):
        Kv = apply(v)
        top = Kv.amax(-1, keepdim=True)
        v = torch.where(top > 0, Kv / top.clamp_min(torch.finfo(w.dtype).tiny), v).clamp_min(CHEAP_FLOOR)
    ratio = (apply(v) / v).amax(-1) * (1 + ROUND_REL)
    return nan_inf(ratio + slack)


def form_norm(layer: DotMHA, X: Tensor, G: Tensor, P: Tensor,
              root: tuple[Tensor, Tensor] | Callable[[], tuple[Tensor, Tensor]] | None = None,
              deferred: bool = False) -> Tensor | Deferred:
    """‖𝒜‖ from the Gram G and the attention P (:func:`logit_form_norm`), [B]: the atoms are
    ½ f̂_α ⊗ f̂_α, whose Gram is ¼ G∘G (PSD by Schur's product theorem); S's entries carry errors far
    below 1e-10 of ‖N‖·‖G∘G‖_F ≥ λ_max(S) (§2.3.2). ``root`` as in :func:`_flattened`.
    ``deferred``: (2‖𝒜‖)² as a :class:`Deferred` with :func:`logit_form_cheap`'s bound, whose caller
    takes ½ of the root of the value it uses."""
    Kp = G.square()
    scale = Kp.flatten(1).norm(dim=-1)
    out = _flattened(layer, X, Kp, P, scale, deferred=deferred, root=root)
    if deferred:
        out.cheap = logit_form_cheap(layer, X, Kp, P, scale)
        return out
    return 0.5 * out.sqrt()


def cubic_form_norm(layer: DotMHA, X: Tensor, G: Tensor, P: Tensor, deferred: bool = False,
                    root: tuple[Tensor, Tensor] | Callable[[], tuple[Tensor, Tensor]] | None = None
                    ) -> Tensor | Deferred:
    """‖𝒞‖, [B] (docs/bounds.md §2.3.4): with δ the linear logit change, row i of the pure-logit third
    order is C(Γ)_i = Σ_l [(1/6) E_p[δ̃³ Ỹ] − ½ E_p[δ̃²] E_p[δ̃ Ỹ]] (every moment under the clean row
    p_li, δ̃ = δ − E_p δ), and ‖C(Γ)‖_F ≤ ‖𝒞‖‖Γ‖_F³. Its atoms are a_α = (1/6) f̂_α^{⊗3} −
    ½ b_{li} ⊗ f̂_α with b_li = Σ_{β∈(l,i)} p_β f̂_β^{⊗2}, so their Gram is
    K = G∘G∘G/36 − (S_{α,(l',i')} + S_{β,(l,i)})·G/12 + T_{(l,i),(l',i')}·G/4 with S_{α,b} =
    Σ_{β∈b} p_β G_αβ² and T_{b,b'} = Σ_{α∈b} p_α S_{α,b'}; ‖𝒞‖² = λ_max(N^½ K N^½) as for ‖𝒜‖.
    ``deferred``: ‖𝒞‖² as a :class:`Deferred`, whose caller takes the root of the value it uses.
    ``root`` as in :func:`_flattened`."""
    B, Nn, _ = G.shape
    n = X.shape[-2]
    nb = Nn // n  # the (i, l) blocks, each of n consecutive α = (i, l, k)
    p = P.permute(0, 2, 1, 3).reshape(B, nb, n)  # α = (i, l, k) as (block, k)
    G5 = G.reshape(B, nb, n, nb, n)
    G2 = G5.square()
    S = (G2 * p[:, None, None]).sum(-1)  # [B, block α, k, block]: S_{α, block}
    T = (S * p[..., None]).sum(2)  # [B, block, block]
    # K = G∘(G²/36 − (S_{α,blk β} + S_{β,blk α})/12 + T_{blk α, blk β}/4), by broadcasting in place
    K = G2.div_(36)
    K.sub_(S[..., None] / 12).sub_(S.permute(0, 3, 1, 2)[:, :, None] / 12).add_(T[:, :, None, :, None] / 4)
    K = K.mul_(G5).reshape(B, Nn, Nn)
    # every term is at most max|G|³ in size (the p sum to 1 over a block), so K's entries carry
    # errors far below 1e-12·max|G|³ and ‖ΔK‖₂ ≤ h·n²·max|ΔK| (as form_norm's slack, G's own rounding
    # is taken relative to G's largest entry)
    scale = Nn * G.abs().flatten(1).amax(-1) ** 3
    if deferred:
        return _flattened(layer, X, K, P, scale, deferred=True, root=root)
    return _flattened(layer, X, K, P, scale, root=root).clamp_min(0).sqrt()


def value_form_parts(layer: DotMHA, X: Tensor, G: Tensor, P: Tensor) -> tuple[Tensor, Tensor]:
    """(M, |M|'s bound) of ‖𝓑‖ for :func:`_value_side`, [B, i, l, i', l'] each (docs/bounds.md
    §2.3.2): the value term V(Γ) = Σ_l dP_l[Γ] Γ C_l is the bilinear form B(Γ, Γ) with row i of
    B(Γ, Γ') = Σ_{l,k} p_lik (f̂_αᵀ vec Γ) Γ'_k C_l, and ‖V(Γ)‖_F ≤ ‖𝓑‖‖Γ‖_F² with ‖𝓑‖ the norm of its
    (n·d) × (n·d)² flattening, whose output-side Gram takes M^{ll'}_{ii'} = Σ_k p_lik p_l'i'k
    G_{(i,l,k),(i',l',k)}; the same sum on √(G_αα G_ββ) ≥ |G_αβ| bounds M's entries and their
    rounding errors."""
    B, n, _ = X.shape
    h = layer.h
    Gd = torch.diagonal(G.reshape(B, n, h, n, n, h, n), dim1=3, dim2=6)  # [B, i, l, i', l', k]: k = k'
    p = P.permute(0, 2, 1, 3)  # [B, i, l, k]
    M = torch.einsum("bilk,bjgk,biljgk->biljg", p, p, Gd)
    sd = torch.diagonal(G, dim1=-2, dim2=-1).clamp_min(0).sqrt().reshape(B, n, h, n) * p
    return M, torch.einsum("bilk,bjgk->biljg", sd, sd)


def value_cubic_parts(layer: DotMHA, X: Tensor, G: Tensor, P: Tensor) -> tuple[Tensor, Tensor]:
    """(M, |M|'s bound) of ‖𝓑₂‖ for :func:`_value_side`, as :func:`value_form_parts` (docs/bounds.md
    §2.3.4): the value side's third order, row i of which is Σ_l ½ E_p[δ̃² Z̃] = Σ_{l,k} ½ p_lik
    (f̂_αᵀγ)² (Γ_k − γ̄_li) C_l (Z = ΓC_l centred under the clean row), ≤ ‖𝓑₂‖‖Γ‖_F³. Its atoms are
    ½ f̂_α^{⊗2} ⊗ (e_k − p_li) ⊗ C_l e_c, so M^{ll'}_{ii'} = ¼ Σ_{k,k'} p_α p_β G_αβ² ⟨e_k − p_li,
    e_k' − p_l'i'⟩ (α = (i,l,k), β = (i',l',k')); |⟨e_k − p_li, e_k' − p_l'i'⟩| ≤ 4 and
    G_αβ² ≤ G_αα G_ββ bound its entries by (Σ_k p_α G_αα)(Σ_k' p_β G_ββ)."""
    B, n, _ = X.shape
    h = layer.h
    p = P.permute(0, 2, 1, 3)  # [B, i, l, k]
    pf = p.reshape(B, -1)
    W2 = (pf[:, :, None] * G.square() * pf[:, None, :]).reshape(B, n, h, n, n, h, n)
    # ⟨e_k − p_li, e_k' − p_l'i'⟩ = [k = k'] − p_l'i'[k] − p_li[k'] + ⟨p_li, p_l'i'⟩
    M = (torch.diagonal(W2, dim1=3, dim2=6).sum(-1)
         - torch.einsum("bilkjgq,bjgk->biljg", W2, p)
         - torch.einsum("bilkjgq,bilq->biljg", W2, p)
         + W2.sum((3, 6)) * torch.einsum("bilk,bjgk->biljg", p, p))
    sd = torch.diagonal(G, dim1=-2, dim2=-1).clamp_min(0).reshape(B, n, h, n) * p
    return 0.25 * M, torch.einsum("bil,bjg->biljg", sd.sum(-1), sd.sum(-1))


def value_form_norm(layer: DotMHA, X: Tensor, G: Tensor, P: Tensor, below: bool = False) -> Tensor:
    """‖𝓑‖, [B] (:func:`value_form_parts`). ``below``: an estimate of ‖𝓑‖ from below instead
    (:func:`value_side_below`), to tell whether it is worth certifying."""
    M, Mabs = value_form_parts(layer, X, G, P)
    return value_side_below(layer, M) if below else _value_side(layer, M, Mabs)


def value_cubic_norm(layer: DotMHA, X: Tensor, G: Tensor, P: Tensor, below: bool = False) -> Tensor:
    """‖𝓑₂‖, [B] (:func:`value_cubic_parts`); ``below`` as in :func:`value_form_norm`."""
    M, Mabs = value_cubic_parts(layer, X, G, P)
    return value_side_below(layer, M) if below else _value_side(layer, M, Mabs)


# the side n·min(d, h·d_h) of the value pair's Gram above which :func:`value_pair_norm` certifies its
# λ_max probabilistically (Lanczos through the Gram's factors, docs/bounds.md §2.4) instead of forming
# it and checking a guess by Cholesky: the Jacobian's limit, so that wherever the pair is
# probabilistic σ̄_J, whose side n·d is no smaller, is too, and ``taylor``'s certificate is no weaker
# than it was; forming it costs more than Lanczos above that side anyway (docs/scale.md)
PAIR_PROBABILISTIC_ABOVE = JACOBIAN_LIMIT


def value_pair_norm(layer: DotMHA, form: tuple[Tensor, Tensor], cubic: tuple[Tensor, Tensor],
                    a: Tensor, c: Tensor, start: Tensor | None = None,
                    probabilistic: bool | None = None) -> tuple[Tensor, Certificate | None]:
    """(‖[√a·𝓑, √c·𝓑₂]‖ rounded up [B], its certificate) for a, c ≥ 0 [B] and the parts of
    :func:`value_form_parts` and :func:`value_cubic_parts` (docs/bounds.md §2.3.4, "The value forms
    as one"): the two flattenings side by side have the output-side Gram a·S_𝓑 + c·S_𝓑₂, which is
    :func:`_value_side`'s of a·M_𝓑 + c·M_𝓑₂, so one n·min(d, h·d_h)-square eigenproblem bounds both
    forms at once. Up to side PAIR_PROBABILISTIC_ABOVE (``probabilistic`` None) or where
    ``probabilistic`` is False it is formed and checked by Cholesky like every other form (certificate
    None: nothing to record); above it, or where ``probabilistic`` is True, it is certified by
    :func:`_value_side_probabilistic` without being formed, and the certificate says so.
    ``start`` as in :func:`_value_side`."""
    a5, c5 = a[:, None, None, None, None], c[:, None, None, None, None]
    M, Mabs = a5 * form[0] + c5 * cubic[0], a5 * form[1] + c5 * cubic[1]
    factors = _value_factors(layer)
    if probabilistic is None:
        probabilistic = M.shape[1] * factors[1].shape[0] > PAIR_PROBABILISTIC_ABOVE  # the side n·r
    if probabilistic:
        return _value_side_probabilistic(layer, M, Mabs, factors)
    return _value_side(layer, M, Mabs, start, factors), None


def _value_factors(layer: DotMHA) -> tuple[Tensor, Tensor]:
    """(W^V_lᵀ W^V_l' as [h, d_h, h, d_h], R of Ŵ^Oᵀ = [W^O_1; …; W^O_h]ᵀ = Q R): the value side's
    factors, for :func:`_value_side` and :func:`value_side_below`."""
    h, dh, d = layer.h, layer.d_h, layer.W_v.shape[1]
    Wv = layer.W_v.permute(1, 0, 2).reshape(d, h * dh)  # [W^V_1 … W^V_h]
    return (Wv.mT @ Wv).reshape(h, dh, h, dh), torch.linalg.qr(layer.W_o.reshape(h * dh, d).mT, mode="r").R


def _value_side(layer: DotMHA, M: Tensor, Mabs: Tensor, start: Tensor | None = None,
                factors: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """√λ_max(Σ_{l,l'} M^{ll'} ⊗ C_lᵀC_l'), rounded up, [B], for M [B, i, l, i', l'] (the output-side
    Gram of a form whose atoms end in ⊗ C_l e_c, docs/bounds.md §2.3.2): with C_l = W^V_l W^O_l and
    Ŵ^Oᵀ = [W^O_1; …; W^O_h]ᵀ = Q R it is that of (I ⊗ R) K̂ (I ⊗ Rᵀ), K̂_{(i,l,a),(i',l',b)} =
    M^{ll'}_{ii'} (W^V_lᵀ W^V_l')_{ab}: an n·min(d, h·d_h)-square eigenproblem. ``Mabs`` bounds the
    size of M's entries and of their rounding errors. ``start`` [B, n·r, 4]: the first block of the
    guess that the certificate checks (:func:`top_eig`), e.g. :func:`value_side_below`'s vectors.
    ``factors``: :func:`_value_factors`', if at hand."""
    B, n = M.shape[:2]
    h, dh = layer.h, layer.d_h
    WW, R = _value_factors(layer) if factors is None else factors
    m, r = h * dh, R.shape[0]
    # S's blocks R K̂_ii' Rᵀ for i ≥ i' only, the others their transposes (S is symmetric): about
    # half the products (docs/scale.md)
    rows, cols = torch.tril_indices(n, n, device=M.device)
    Kp = (M[:, rows, :, cols, :].transpose(0, 1)[:, :, :, None, :, None] * WW).reshape(B, -1, m, m)
    Sp = (R @ Kp @ R.mT).transpose(0, 1)  # [pairs, B, r, r]
    S = M.new_empty(B, n, r, n, r)
    S[:, cols, :, rows, :] = Sp.mT
    S[:, rows, :, cols, :] = Sp
    D = n * r
    lam = top_eig(S.reshape(B, D, D), start=start)
    return (lam * (1 + ROUND_REL) + _value_slack(WW, R, Mabs)).clamp_min(0).sqrt()


def _value_slack(WW: Tensor, R: Tensor, Mabs: Tensor) -> Tensor:
    """η ≥ ‖S(M̂) − S(M)‖ + the rounding of S's products, [B], for :func:`_value_factors`' WW and R:
    M's computed entries err by far less than 1e-10 of the bound ``Mabs`` on them, and
    ‖(I ⊗ R) K̂(E) (I ⊗ Rᵀ)‖ ≤ ‖R‖_F² ‖WW‖_F ‖E‖_F."""
    return 1e-10 * R.square().sum() * WW.flatten().norm() * Mabs.flatten(1).norm(dim=-1)


def _value_side_probabilistic(layer: DotMHA, M: Tensor, Mabs: Tensor,
                              factors: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Certificate]:
    """:func:`_value_side`'s √λ_max without forming S, with its certificate, [B]: unrestarted Lanczos
    from a fresh random start on S's products through its factors (:func:`_value_apply`), bounded by
    Kuczyński–Woźniakowski (bounds.norms.lanczos_upper, docs/bounds.md §2.4: ≈ 0.5 % above
    λ_max's root, failure probability 1e-9 an input). S of the computed M, Ŝ, is within η of S's
    (:func:`_value_slack`) and may miss being PSD by as much: KW holds for Ŝ + ηI, whose Krylov space
    is Ŝ's and whose top Ritz value is θ + η, so λ_max(S) ≤ λ_max(Ŝ) + η ≤ (θ + η)/(1 − δ), at most
    the bound's square plus 2η (δ ≤ ½). ``factors`` as in :func:`_value_side`."""
    B, n = M.shape[:2]
    WW, R = factors = _value_factors(layer) if factors is None else factors
    apply = _value_apply(layer, M, factors)
    bound = lanczos_upper(lambda v: apply(v[..., None])[..., 0], (B,), n * R.shape[0], M)
    lam = bound.value.square() * (1 + ROUND_REL) + 2 * _value_slack(WW, R, Mabs)
    return lam.clamp_min(0).sqrt(), bound.certificate


def _value_apply(layer: DotMHA, M: Tensor,
                 factors: tuple[Tensor, Tensor] | None = None) -> Callable[[Tensor], Tensor]:
    """Q [B, n·r, k] ↦ S Q for :func:`_value_side`'s S = (I ⊗ R) K̂ (I ⊗ Rᵀ) without forming it, each
    product through its factors (:func:`_value_factors`, or ``factors``): n²h²d_h + 2n·r·h·d_h +
    n·(h·d_h)² operations a column, where forming S takes n²·h·d_h·d·(h·d_h)."""
    B, n = M.shape[:2]
    h, dh = layer.h, layer.d_h
    WW, R = _value_factors(layer) if factors is None else factors  # [l, a, l', c], [r, h·d_h]
    r = R.shape[0]

    def apply(Q: Tensor) -> Tensor:
        k = Q.shape[-1]
        u = (Q.reshape(B, n, r, k).transpose(-1, -2) @ R).reshape(B, n, k, h, dh)  # (I ⊗ Rᵀ) Q
        t = torch.einsum("layc,bjkyc->bjkyla", WW, u)
        w = torch.einsum("biljy,bjkyla->bikla", M, t).reshape(B, n, k, h * dh)  # K̂ ·
        return (w @ R.mT).transpose(-1, -2).reshape(B, n * r, k)  # (I ⊗ R) ·

    return apply


# block Krylov steps (4 columns each, from a fixed random start) of :func:`value_side_below`
VALUE_ESTIMATE_STEPS = 4


def value_side_below(layer: DotMHA, M: Tensor, vectors: int = 0) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`_value_side`'s √λ_max from *below*, [B], without forming its n·min(d, h·d_h)-square
    matrix S = (I ⊗ R) K̂ (I ⊗ Rᵀ): the top Ritz value of a few block Krylov steps
    (:func:`ritz_below`), each product with S through its factors (:func:`_value_apply`). An
    estimate, never a bound: it tells the remainder that the form cannot beat its Cauchy–Schwarz
    alternative, so that the form is not certified for nothing.
    ``vectors``: with the top ``vectors`` Ritz vectors [B, n·r, vectors] (:func:`ritz_below`), in S's
    coordinates: a start for its certificate's guess."""
    B, n = M.shape[:2]
    factors = _value_factors(layer)
    r = factors[1].shape[0]
    apply = _value_apply(layer, M, factors)
    g = torch.Generator().manual_seed(0)
    start = torch.randn(n * r, 4, generator=g, dtype=torch.float64).to(M.device).expand(B, n * r, 4)
    if vectors:
        top, x = ritz_below(apply, start, VALUE_ESTIMATE_STEPS, vectors)
        return top.sqrt(), x
    return ritz_below(apply, start, VALUE_ESTIMATE_STEPS).sqrt()


def spectral_spread(layer: DotMHA, X: Tensor, P: Tensor, sigma: Tensor) -> Tensor:
    """σ₂_li = ‖diag(√p_li)(Y_l − 1ȳ_liᵀ)‖₂ ≥ ‖E_p[a Ỹ]‖/std_p(a) for every scalar a over the keys
    (Cauchy–Schwarz through the matrix: E_p[aỸ] = Ỹᵀ diag(p) ã), [B, h, n], rounded up and never
    above ``sigma`` (σ_li, its Frobenius counterpart, which also bounds it). Y_l in any orthonormal
    coordinates of C_l's row space gives the same value; rounding of the centring is covered by 1e-9
    of √(Σ_k p_k‖Y_k‖²) (docs/bounds.md §2.3.4)."""
    Y = _values(layer, X)
    Ms = (Y[:, :, None] - (P @ Y)[:, :, :, None]) * P[..., None].sqrt()  # [B, h, i, k, d]
    Gm = Ms @ Ms.mT  # [B, h, i, k, k]
    top = top_eig(Gm.flatten(0, 2)).reshape(Gm.shape[:3])
    raw = (P * Y.square().sum(-1)[:, :, None]).sum(-1).sqrt()  # √(Σ_k p_k ‖Y_k‖²)
    return torch.minimum((top * (1 + ROUND_REL)).clamp_min(0).sqrt() + 1e-9 * raw, sigma)


def nan_inf(t: Tensor) -> Tensor:
    """NaN (an overflowed factor times a zero) as +inf: such a bound bounds nothing."""
    return torch.where(torch.isnan(t), torch.full_like(t, torch.inf), t)

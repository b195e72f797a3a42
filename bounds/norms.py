"""Spectral norms that a certified bound may use, each with its certificate (docs/bounds.md §2.4).

A Ritz value of Lanczos or power iteration is a value from below: never a certificate by itself.
A certified norm here is one of

* ``exact``: the top eigenvalue of the dense Gram matrix in float64 (small operators);
* ``deterministic``: the same Gram's top eigenvalue bounded by a Cholesky factorisation of
  ``μI − G`` that runs to completion, μ a block-Krylov guess just above it, with the rounding of the
  factorisation accounted for (:func:`verified_gram_norm`; larger Grams on the CPU);
* ``probabilistic``: unrestarted Lanczos with full reorthogonalisation on T*T from a start drawn
  uniformly on the sphere with fresh randomness (its seed is recorded, so the run can be replayed),
  turned into an upper bound by the Kuczyński–Woźniakowski inequality: for a PSD N×N matrix with
  top eigenvalue λ and k-step top Ritz value θ_k, ``P(θ_k < (1−δ)λ) ≤ 1.648·√N·exp(−√δ·(2k−1))``,
  so ``‖T‖ ≤ √(θ_k/(1−δ))`` except with probability p when ``√δ·(2k−1) ≥ ln(1.648√N/p)``.

Closed forms (norms of d×d, n×d and n×n factors) are exact SVDs and are not recorded. Each certified
computation records its :class:`bounds.certificates.Certificate` in the
:class:`bounds.certificates.Ledger` passed to it, and is computed once per ledger cache
(:func:`certified_norm`).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from models.operators import DENSE_LIMIT, VERIFY_MIN
from models.spectral import LinearOperator

from .certificates import Certificate, Ledger, book

DEFAULT_P = 1e-9  # failure probability of one probabilistic norm
# relative slack of θ: the norm's bound √(θ_k/(1−δ)) is at most 1/√(1−δ) − 1 ≈ 0.5 % above the truth.
# k ∝ 1/√δ: 126 steps at N = 2048, p = 1e-9, where 2e-3 took 281 (≈ 0.1 % above) and ran 2.5× longer.
# On the Fashion-MNIST 3-block ViT (ζ probabilistic in every block, 10 images) δ_features grew by
# 1.20 %, the three blocks' 1/√(1−δ) factors: the Ritz values had converged at 126 steps as at 281.
# It can cost a certificate on the edge: best at ε = 0.1 lost 1 of those 10 images (5e-3 kept it:
# 178 steps, +0.45 %)
DEFAULT_DELTA = 1e-2
KW_CONSTANT = 1.648
SYNC_EVERY = 8  # Lanczos steps between the checks whether every batch element has stopped
VERIFY_TAU = 1e-9  # relative raise of the guess that the Cholesky check must confirm
_EPS = torch.finfo(torch.float64).eps
_U = _EPS / 2  # the unit roundoff of float64



def kw_log_term(N: int, p: float) -> float:
    return math.log(KW_CONSTANT * math.sqrt(N) / p)


def kw_steps(N: int, p: float = DEFAULT_P, delta: float = DEFAULT_DELTA) -> int:
    """The fewest Lanczos steps k with √δ(2k−1) ≥ ln(1.648√N/p)."""
    return math.ceil((kw_log_term(N, p) / math.sqrt(delta) + 1) / 2)


def kw_delta(N: int, k: int, p: float = DEFAULT_P) -> float:
    """The δ that k steps certify at failure probability p: (ln(1.648√N/p)/(2k−1))²."""
    return (kw_log_term(N, p) / (2 * k - 1)) ** 2


@dataclass(frozen=True)
class NormBound:
    value: Tensor  # [*batch], an upper bound of ‖T‖ for each batch element
    certificate: Certificate
    ritz: Tensor  # [*batch], √θ_k: the value from below that the bound was built on
    steps: int


def _unit_rows(v: Tensor) -> Tensor:
    return v / v.norm(dim=-1, keepdim=True).clamp_min(1e-300)


def reorthogonalise(w: Tensor, basis: Tensor) -> None:
    """w_b −= Q_bᵀ(Q_b w_b) in place for each batch element b of w [Bt, N], basis Q [Bt, j, N].

    Two matrix–vector products per element rather than two ``bmm`` over the batch: the same sums up
    to rounding, and faster on a CPU (docs/scale.md, "The thresholds in the code"): MKL's bmm with a
    one-column right-hand side is slow, and one element's basis stays in cache between its two reads
    where the whole batch's does not. On a GPU the loop would be Bt small launches: one bmm there.
    """
    if w.is_cuda:
        w -= torch.bmm(torch.bmm(basis, w[:, :, None]).mT, basis)[:, 0]
        return
    for b in range(w.shape[0]):
        w[b].addmv_(basis[b].T, torch.mv(basis[b], w[b]), alpha=-1)


def lanczos_upper(A: Callable[[Tensor], Tensor], batch: tuple[int, ...], N: int, like: Tensor, *,
                  p: float = DEFAULT_P, delta: float = DEFAULT_DELTA,
                  seed: int | None = None) -> NormBound:
    """A probabilistic upper bound of √λ_max(A) for the PSD map A = T*T on [Bt, N] (Bt = ∏ batch).

    Unrestarted: KW's inequality is about the Krylov space of one random start, which a restart
    from a Ritz vector would leave. ``seed=None`` draws fresh randomness (recorded); pass a recorded
    seed to replay. Computed in float64 whatever ``like``'s dtype (docs/bounds.md §2.4).
    """
    seed = secrets.randbits(63) if seed is None else int(seed)
    k = min(kw_steps(N, p, delta), N)
    Bt = math.prod(batch)
    gen = torch.Generator().manual_seed(seed)
    v = _unit_rows(torch.randn(Bt, N, generator=gen, dtype=torch.float64)).to(like.device)
    Q = torch.empty(Bt, k, N, dtype=torch.float64, device=like.device)  # basis vectors as rows
    Q[:, 0] = v
    alpha = torch.zeros(k, Bt, dtype=torch.float64, device=like.device)
    beta = torch.zeros(k, Bt, dtype=torch.float64, device=like.device)
    alive = torch.ones(Bt, dtype=torch.bool, device=like.device)
    scale = torch.zeros(Bt, dtype=torch.float64, device=like.device)
    eps = torch.finfo(torch.float64).eps
    steps = 0
    with torch.no_grad():
        for j in range(k):
            q = Q[:, j]
            w = A(q)
            # orthogonalised twice (Kahan's "twice is enough"): first by the three-term recurrence
            # against q_j and q_{j−1}, then by one full Gram–Schmidt pass against the whole basis
            alpha[j] = (q * w).sum(-1)
            w = w - alpha[j][:, None] * q
            if j > 0:
                w = w - beta[j - 1][:, None] * Q[:, j - 1]
            reorthogonalise(w, Q[:, : j + 1])
            steps = j + 1
            scale = torch.maximum(scale, alpha[j].abs())
            b = w.norm(dim=-1)
            # an element whose Krylov space is invariant stops: its θ is then the same for every
            # later k, and continuing would build the basis from rounding noise
            alive = alive & (b > 100 * eps * scale)
            # asked every SYNC_EVERY steps only: on a GPU each ask is a host sync. Meanwhile a
            # stopped element carries zero vectors, which append zero rows to its tridiagonal
            # matrix and leave its top Ritz value alone (T*T is PSD)
            if j == k - 1 or (j % SYNC_EVERY == SYNC_EVERY - 1 and not bool(alive.any())):
                break
            beta[j] = torch.where(alive, b, torch.zeros_like(b))
            Q[:, j + 1] = torch.where(alive[:, None], w / b.clamp_min(1e-300)[:, None], torch.zeros_like(w))
        Tm = torch.diag_embed(alpha[:steps].T)
        if steps > 1:
            off = torch.diag_embed(beta[: steps - 1].T, offset=1)
            Tm = Tm + off + off.transpose(-1, -2)
        theta = torch.linalg.eigvalsh(Tm)[:, -1].clamp_min(0)
    # KW holds in exact arithmetic; the margin covers rounding in the k products and the
    # reorthogonalisation, and a breakdown declared at 100·eps·scale instead of at 0
    margin = (100 + 8 * steps) * eps * scale
    # k = N steps span the whole space (the start has a component along every eigenvector with
    # probability 1), so θ is λ_max up to the rounding the margin covers
    delta = 0.0 if k >= N else kw_delta(N, k, p)
    upper = ((theta + margin) / (1 - delta)).sqrt()
    # one value (an input's bound) may rest on every norm of its batch row, e.g. all h heads of
    # ‖M_l‖ in δ₂: a union bound over them
    per_value = Bt // batch[0] if batch else 1
    cert = Certificate("probabilistic", p * per_value, (seed,))
    return NormBound(upper.reshape(batch), cert, theta.sqrt().reshape(batch), steps)


def exact_norm(M: Tensor) -> Tensor:
    """The spectral norm of each trailing matrix, exactly: the top eigenvalue of MᵀM in float64
    (faster than an SVD and as accurate for the top singular value), plus a rounding margin."""
    return gram_norm(_gram_of(M))


def _gram_of(M: Tensor) -> Tensor:
    M = M.to(torch.float64)
    return M.mT @ M if M.shape[-2] >= M.shape[-1] else M @ M.mT


def dense_certified_norm(G: Tensor) -> tuple[Tensor, Certificate]:
    """‖M‖ from its Gram G: verified by Cholesky from VERIFY_MIN on (CPU), else exact."""
    if G.shape[-1] >= VERIFY_MIN and not G.is_cuda:
        value, exact = verified_gram_norm(G)
        return value, Certificate("exact" if exact else "deterministic")
    return gram_norm(G), Certificate("exact")


def gram_norm(G: Tensor) -> Tensor:
    """√λ_max of each trailing PSD Gram matrix G = MᵀM (or MMᵀ) in float64, plus a rounding margin:
    ‖M‖ exactly when G was formed from M's structure rather than from M (models.structured)."""
    G = G.to(torch.float64)
    lam = torch.linalg.eigvalsh(G)[..., -1].clamp_min(0)
    return (lam * (1 + 4 * G.shape[-1] * torch.finfo(torch.float64).eps)).sqrt()


# the guess of :func:`verified_gram_norm`: a block Krylov space of this many columns a step, grown
# until its top Ritz value moves by at most GUESS_RTOL relative (or the space is invariant, or
# GUESS_STEPS); far cheaper than ARPACK or eigvalsh on the remainder's forms (docs/scale.md)
GUESS_BLOCK = 4
GUESS_STEPS = 64
GUESS_RTOL = 1e-13
# the largest |vᵀq| of a new Krylov column q against the basis so far that counts as orthogonal (a
# column built properly is ~1e-16 off; one left from rounding noise is O(1e-3) to O(1))
ORTHO_TOL = 1e-10


def top_estimate(G: Tensor, rtol: float = GUESS_RTOL, vector: bool = False,
                  apply: Callable[[Tensor], Tensor] | None = None,
                  start: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """λ_max of each [Bt, D, D] symmetric G from below, to where rounding stops it: the top Ritz value
    of a block Krylov space (block Lanczos with full reorthogonalisation, from a fixed start so that
    a value is the same bits on every run). Only a guess for :func:`verified_gram_norm` to check;
    nothing certified rests on it (a start blind to the top direction, or a space stopped short,
    only sends that element to the fallback). ``vector``: with its Ritz vector, [Bt, D], a start for
    estimates of nearby problems (bounds.forms.spread_estimate). ``apply``: the products G @ Q
    [Bt, D, k] computed another way (bounds.heads.heads_top's, through a factor every element shares).
    ``start`` [Bt, D, GUESS_BLOCK]: the first block, where a caller has directions near the top one
    (a start blind to it only costs steps: the guess is checked)."""
    Bt, D, _ = G.shape
    # a NaN or ∞ element gets no guess (NaN below); its sum says so in one pass over G (a finite G
    # whose sum overflows only loses its guess, and takes the fallback)
    finite = torch.isfinite(G.sum((-2, -1)))
    if not bool(finite.all()):
        G = torch.where(torch.isfinite(G).flatten(1).all(-1)[:, None, None], G, 0.0)
    b = min(GUESS_BLOCK, D)
    if start is None:
        start = torch.randn(D, b, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        start = start.to(G.device).expand(Bt, D, b)
    Q = torch.linalg.qr(start[..., :b]).Q
    basis, images = [], []
    theta = torch.full((Bt,), math.nan, dtype=torch.float64, device=G.device)
    frozen = torch.zeros(Bt, dtype=torch.bool, device=G.device)
    scale = G.diagonal(dim1=-2, dim2=-1).abs().amax(-1)[:, None]
    for step in range(GUESS_STEPS):
        W = G @ Q if apply is None else apply(Q)
        basis.append(Q)
        images.append(W)
        V = torch.cat(basis, -1)
        T = V.mT @ torch.cat(images, -1)
        if vector:
            values, vectors = torch.linalg.eigh(0.5 * (T + T.mT))
            new, top = values[..., -1], vectors[..., -1:]
        else:
            new = torch.linalg.eigvalsh(0.5 * (T + T.mT))[..., -1]
        settled = ((new - theta).abs() <= rtol * new.abs()) | frozen
        theta = torch.where(frozen, theta, new)
        if vector:  # a frozen element's vector is whatever the last space gave: an estimate's start only
            x = (V @ top)[..., 0]
        room = D - V.shape[-1]  # the last block fills the space: θ is then exact
        if bool(settled.all()) or room == 0:
            break
        for _ in range(2):  # twice is enough (Giraud et al. 2005), once is not in float64
            W = W - V @ (V.mT @ W)
        if bool((W.norm(dim=-2) <= 1e-12 * scale).all()):  # the space is invariant: θ is exact
            break
        Q = torch.linalg.qr(W).Q[..., :room]
        # a column of W that was (numerically) in span(V) — the space invariant there, as where G's
        # rank is below the block's width — leaves the QR as normalised rounding noise, no longer
        # orthogonal to V, and a Ritz value on such a basis can exceed λ_max (44× on a rank-7 Gram
        # of side 300, which the check then confirmed: sound, and that loose). Such a column takes a
        # fixed random direction orthogonalised against V; an element still not orthogonal keeps
        # the Ritz value it had (the check or the fallback judges it)
        lost = (V.mT @ Q).abs().amax(-2) > ORTHO_TOL  # [Bt, b]
        if bool(lost.any()):
            gen = torch.Generator().manual_seed(1 + step)
            Z = torch.randn(D, Q.shape[-1], generator=gen, dtype=torch.float64).to(G.device).expand_as(Q)
            for _ in range(2):
                Z = Z - V @ (V.mT @ Z)
            Q = torch.linalg.qr(torch.where(lost[:, None, :], Z, Q)).Q
            frozen = frozen | ((V.mT @ Q).abs().amax((-2, -1)) > ORTHO_TOL)
    theta = torch.where(finite, theta, math.nan)
    return (theta, x) if vector else theta


def _gamma(m: int) -> float:
    return m * _U / (1 - m * _U)


def cholesky_check(G: Tensor, mu: Tensor) -> tuple[Tensor, Tensor]:
    """Whether λ_max(G) ≤ μ is confirmed for each [Bt, D, D] symmetric G, and the upper bound of
    λ_max(G) that a confirmation proves (:func:`verified_gram_norm`'s docstring; G as given, its
    own formation aside)."""
    D = G.shape[-1]
    A = -G
    A.diagonal(dim1=-2, dim2=-1).add_(mu[:, None])
    ok = torch.linalg.cholesky_ex(A).info == 0
    diag = G.diagonal(dim1=-2, dim2=-1)
    # tr|Â| from above: the sum's own rounding is at most (D+1)u of it
    trace = (mu[:, None] - diag).abs().sum(-1) * (1 + (D + 1) * _U)
    g = _gamma(D + 1)
    lam = mu + g / (1 - g) * trace + _U * (mu + diag.abs().amax(-1))
    return ok, lam * (1 + 8 * _U)  # and the few roundings of the line above


def verified_gram_norm(G: Tensor, tau: float = VERIFY_TAU, vector: bool = False,
                       apply: Callable[[Tensor], Tensor] | None = None,
                       start: Tensor | None = None, rtol: float | None = None) -> tuple:
    """√λ_max of each trailing PSD Gram matrix, certified by a Cholesky factorisation rather than
    an eigendecomposition (docs/bounds.md §2.4, "deterministic"), and whether every element took
    the exact fallback.

    A guess θ from below (:func:`top_estimate`, its run stopped once it moves by ≤ τ/100) is raised
    to μ = θ(1 + τ), τ = ``tau`` (VERIFY_TAU by default; the remainder's forms take 1e-6,
    bounds.forms.FORM_TAU); if the floating-point
    Cholesky factorisation of Â = fl(μI − G) runs to completion, then Â + ΔA = R̂ᵀR̂ ⪰ 0 with
    ‖ΔA‖₂ ≤ γ_{D+1}/(1 − γ_{D+1})·tr|Â| (Demmel 1989; Higham, *Accuracy and Stability*, Thm 10.3,
    for any order of the inner products), so λ_max(G) ≤ μ + γ'·tr|Â| + u·max(μ + |G_ii|). An
    element whose factorisation breaks down (θ was not the top eigenvalue, or there was none) takes
    :func:`gram_norm`'s eigendecomposition instead. Cholesky costs D³/3 flops against the ≈ 4D³/3
    and the memory-bound tridiagonal reduction of ``eigvalsh``. ``vector``: a third item, the guess's
    Ritz vector [*batch, D] (an approximation, nothing certified rests on it). ``apply``: the guess's
    products with G another way, ``start`` its first block (:func:`top_estimate`), ``rtol`` where its
    run stops (default τ/100); the check is on G itself.
    """
    G = G.to(torch.float64)
    batch, D = G.shape[:-2], G.shape[-1]
    Gf = G.reshape(-1, D, D)
    rtol = max(GUESS_RTOL, tau / 100) if rtol is None else rtol
    theta, x = (top_estimate(Gf, rtol, vector=True, apply=apply, start=start) if vector
                else (top_estimate(Gf, rtol, apply=apply, start=start), None))
    top_diag = Gf.diagonal(dim1=-2, dim2=-1).abs().amax(-1)
    mu = theta.clamp_min(0) * (1 + tau) + tau * top_diag
    guessed = torch.isfinite(mu) & (mu > 0)
    ok, lam = cholesky_check(Gf, torch.where(guessed, mu, torch.ones_like(mu)))
    ok = ok & guessed
    # G's own formation, as in gram_norm
    value = (lam * (1 + 4 * D * _EPS)).sqrt()
    failed = ~ok
    if bool(failed.any()):  # only those elements pay for the eigendecomposition
        value[failed] = gram_norm(Gf[failed])
    if vector:
        return value.reshape(batch), not bool(ok.any()), x.reshape(*batch, D)
    return value.reshape(batch), not bool(ok.any())


def _gram(op: LinearOperator, batch: tuple[int, ...], shape: tuple[int, ...]):
    return lambda v: op.Tt(op.T(v.reshape(*batch, *shape))).reshape(-1, math.prod(shape))


def certified_norm(key: tuple, tensors: tuple[Tensor, ...], dense: Callable[[], Tensor],
                   operator: Callable[[], LinearOperator], batch: tuple[int, ...],
                   shape: tuple[int, ...], like: Tensor, probabilistic: bool = False, *,
                   gram: bool = False, dense_dim: int | None = None,
                   limit: int = DENSE_LIMIT, ledger: Ledger | None = None) -> Tensor:
    """An upper bound of ‖T‖ for each batch element, certified as docs/bounds.md §2.4 allows.

    ``dense()`` builds the matrices [*batch, m, N] (or, with ``gram``, their Gram matrices
    [*batch, D, D] formed from structure), used when ``dense_dim`` (the side D of the Gram that
    is eigendecomposed; default N = ∏shape) is at most ``limit``: exact. ``operator()`` gives T
    and its adjoint on [*batch, *shape] (used above: probabilistic). ``key`` and ``tensors`` name
    the operator for reuse on ``ledger``'s cache, where its certificate is recorded. ``probabilistic``
    takes the Lanczos certificate even where the dense one fits (to measure and test it).
    """
    N = math.prod(shape)

    def compute() -> tuple[Tensor, Certificate]:
        if (N if dense_dim is None else dense_dim) <= limit and not probabilistic:
            return dense_certified_norm(dense() if gram else _gram_of(dense()))
        nb = lanczos_upper(_gram(operator(), batch, shape), batch, N, like)
        return nb.value, nb.certificate

    return book(ledger).certified((key, probabilistic), tensors, compute, like)

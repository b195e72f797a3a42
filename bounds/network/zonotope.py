"""The set ``taylor_net`` pushes through a ViT (docs/bounds.md §5.1): every deviation of a stage's
tokens from their clean values, as a zonotope whose first generator is the input's ℓ2 ball, and the
ReLU relaxation that adds its symbols. The stages themselves are in :mod:`bounds.network.taylor_net`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from ..norms import dense_certified_norm, gram_norm
from .budget import shared

# the largest N·min(N, P)² (flops of the Gram of G, N = n·d) for which the set's radius takes the exact
# ‖G‖₂ (the joint first order) rather than the tokens' own (Σ_t ε²‖G_t‖²)^½: it covers Fashion-MNIST's
# 28×28 images (N = 2048, P = 784: 1.3·10⁹), where the per-token radius was up to 1.5× the joint one
# and the remainders it fed dominated the margins (docs/results.md)
GRAM_LIMIT = 2 * 10**9



def top_norm(G: Tensor) -> Tensor:
    """√λ_max of each Gram G, rounded up: of a large one (side ≥ ``VERIFY_MIN``, on a CPU) certified
    by a Cholesky factorisation at about half an eigendecomposition's time (the whole set's Grams
    reach 2,048 on Fashion-MNIST, and were 30 % of a second pass there), else its exact eigenvalue
    (docs/bounds.md §2.4: both deterministic, as every norm of ``taylor_net``'s certificate)."""
    return dense_certified_norm(G)[0]


@dataclass
class DeviationSet:
    """``Δ = G δ + A ζ + Σ_j Q_j η_j + c + E`` over tokens: G [B, n, d, P] (‖δ‖₂ ≤ ε), A [B, n, d, m]
    (ζ ∈ [−1, 1]^m), Q [B, n, d, k, g] (k groups of g columns, each η_j in the unit ℓ2 ball: a
    token's own error ball, with the budget of :meth:`grouped`), c [B, n, d], and the Frobenius
    radii of E per source, ρ [B, S]. ``sources`` names E's radii, ``groups`` the source of each group.

    ``tok`` [B, n] bounds ‖E_t‖ per token where known (None: E's Frobenius radius alone): a remainder
    born per token (LayerProject's) has its own size there, and per-token maps keep it per token, so
    that a token's radius is not charged the whole ball (docs/bounds.md §5.1).
    ``gram`` [B, n, d, d] holds G_t G_tᵀ per token where known (a per-token linear map L_t updates it
    as L_t·gram·L_tᵀ, at d³ instead of d²P), and ``route`` [B] an upper bound of ‖Δ‖_F propagated as
    the norm route does (docs/bounds.md §5): the smaller of it and (Σ_t r_t²)^½ is the set's radius.
    """

    G: Tensor
    A: Tensor
    Q: Tensor
    c: Tensor
    rho: Tensor
    route: Tensor
    sources: list[str] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)
    # group j's radius is K_j‖Δ_j‖² ≤ K_j·caps[:, j] with Σ_j ‖Δ_j‖² ≤ budgets[source]: LayerProject's
    # errors of one block share the budget of the ball they come from (docs/bounds.md §5.1)
    caps: Tensor | None = None
    budgets: dict[str, Tensor] = field(default_factory=dict)
    gram: Tensor | None = None
    tok: Tensor | None = None
    # [B] bool where a stage is undefined somewhere in the image's ball (LayerNorm without eps whose
    # ball reaches σ = 0): that image's set is emptied so that later stages stay finite, and its
    # margins are bounded by −∞ (None: every image defined)
    void: Tensor | None = None
    # E once more, as columns: E = W v over ‖v‖₂ ≤ 1, W [B, n, d, K] (None: not carried). Every map
    # applies to W what it applies to G, so that a remainder born at stage s reaches stage m at
    # ‖J_{s→m}‖₂ρ_s where ρ crosses each stage at its norm, Π_k ‖J_k‖₂·ρ_s (docs/bounds.md §5.1, "The
    # balls as columns"). Both bound the same E: every support, radius and token radius takes the smaller
    W: Tensor | None = None
    # since a residual's fork (:meth:`fork`), where every map was per token: E's map M_t [B, n, d, d] from
    # the fork, and ``fresh`` [B, n] bounding the part of E_t born after it, so that the join bounds
    # ‖E_t + M_tE_t + F_t‖ by ‖I + M_t‖₂‖E_t‖ + fresh_t (docs/bounds.md §5.1, "E across a residual")
    emap: Tensor | None = None
    fresh: Tensor | None = None
    # box_norms' value, formed at first use (``replace`` resets it: every map makes a new set)
    _box: tuple[Tensor, Tensor] | None = field(default=None, init=False, repr=False, compare=False)
    _cross: tuple[Tensor, Tensor] | None = field(default=None, init=False, repr=False, compare=False)
    _wnorm: Tensor | None = field(default=None, init=False, repr=False, compare=False)
    _wtok: Tensor | None = field(default=None, init=False, repr=False, compare=False)
    _wgram: Tensor | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def ball_of(cls, G: Tensor, radius: Tensor) -> DeviationSet:
        """The set {Gδ : ‖δ‖₂ ≤ ε}, G [B, n, d, P], whose Frobenius radius is ≤ ``radius`` [B]."""
        B, n, d, _ = G.shape
        return cls(G, G.new_zeros(B, n, d, 0), G.new_zeros(B, n, d, 0, d), G.new_zeros(B, n, d),
                   G.new_zeros(B, 0), radius, tok=G.new_zeros(B, n))

    def grouped(self, v: Tensor) -> Tensor:
        """The largest Σ_j (s_j/caps_j)·v_j over the groups' radii, from their supports v [B, ..., k]
        (each at the group's largest radius): per source Σ_j v_j, or, where its groups share a budget,
        that program's optimum (:func:`.budget.shared`; at most budget·max_j v_j/caps_j)."""
        if not self.groups:
            return v.sum(-1)
        shape = (v.shape[0],) + (1,) * (v.dim() - 2) + (v.shape[-1],)
        caps = self.caps.reshape(shape)
        total = 0
        for name in dict.fromkeys(self.groups):
            idx = [j for j, g in enumerate(self.groups) if g == name]
            plain = v[..., idx].sum(-1)
            if name in self.budgets:
                budget = self.budgets[name].reshape(shape[:-1])
                plain = torch.minimum(plain, shared(v[..., idx], caps[..., idx], budget))
            total = total + plain
        return total

    def grouped_norm(self, v: Tensor) -> Tensor:
        """An upper bound of ‖Σ_j Q_j η_j‖_F over the groups' radii, [B], from each group's ‖Q_j‖₂,
        v [B, k]: per source :meth:`grouped`'s sum, or, where that source's groups each lie in one
        token and no two in the same (LayerProject's, until attention mixes them), their orthogonal
        sum: with t_j ∈ [0, 1] the share of group j's largest radius, Σ_j t_j caps_j ≤ budget,
        ``‖Σ_j t_j Q_j η_j‖² = Σ_j t_j² ‖Q_j η_j‖² ≤ Σ_j t_j v_j²``, whose largest value is the
        budget's program with values v_j² (:func:`.budget.shared`) (docs/bounds.md §5.1, "Groups in a
        radius")."""
        if not self.groups:
            return v.sum(-1)
        # [B, n, k]: the tokens each group moves (a zero stays an exact zero under per-token maps)
        moves = self.Q.abs().amax((2, 4)) > 0
        total = 0
        for name in dict.fromkeys(self.groups):
            idx = [j for j, g in enumerate(self.groups) if g == name]
            plain = self.only(name).grouped(v[:, idx])
            own = moves[..., idx]
            apart = (own.sum(1) <= 1).all(-1) & (own.sum(-1) <= 1).all(-1)  # [B]
            square = v[:, idx].square().sum(-1)
            if name in self.budgets:
                caps = self.caps[:, idx]
                square = torch.minimum(square, shared(v[:, idx].square(), caps, self.budgets[name]))
            # each square, sum and root off by a few ulps: a relative 1e-12 covers them
            orthogonal = square.sqrt() * (1 + 1e-12)
            total = total + torch.where(apart, torch.minimum(plain, orthogonal), plain)
        return total

    def only(self, name: str) -> DeviationSet:
        """The set's bookkeeping of the groups of source ``name`` alone (for :meth:`grouped`)."""
        keep = [j for j, g in enumerate(self.groups) if g == name]
        if self.caps is None:  # no groups at all (a network without LayerProject)
            return replace(self, groups=[])
        return replace(self, groups=[name] * len(keep), caps=self.caps[:, keep])

    def ball(self) -> Tensor:
        """An upper bound of ‖E‖_F, [B]: Σ_s ρ_s, or ‖W‖₂ where the columns are carried and smaller."""
        total = self.rho.sum(-1)
        if self.W is None or not self.W.shape[-1]:
            return total
        if self._wnorm is None:
            B, n, d, K = self.W.shape
            W = self.W.reshape(B, n * d, K)
            self._wnorm = top_norm(W.mT @ W if K <= n * d else W @ W.mT)
        return torch.minimum(total, self._wnorm)

    def token_ball(self) -> Tensor:
        """An upper bound of ‖E_t‖ per token, [B, n]: the smallest of ``tok``, Σ_s ρ_s and ‖W_t‖₂. Not
        :meth:`ball`'s ‖W‖₂: W_t is some of W's rows, so ‖W_t‖₂ ≤ ‖W‖₂, and that n·d-wide Gram (its
        formation and its norm, 0.7 s on Fashion-MNIST) would buy nothing but rounding."""
        whole = self.rho.sum(-1)[:, None].expand(*self.c.shape[:2])
        out = whole if self.tok is None else torch.minimum(whole, self.tok)
        if self.W is not None and self.W.shape[-1]:
            if self._wtok is None:
                self._wtok = gram_norm(self.ball_grams())
            out = torch.minimum(out, self._wtok)
        return out

    def ball_grams(self) -> Tensor:
        """W_tW_tᵀ per token, [B, n, d, d] (formed once)."""
        if self._wgram is None:
            self._wgram = self.W @ self.W.mT
        return self._wgram

    def token_ball_along(self, U: Tensor) -> Tensor:
        """Upper bounds of |⟨u, E_t⟩| for functionals U [B, n, k, d] on each token, [B, n, k]:
        ‖u‖·:meth:`token_ball`, or (u W_tW_tᵀ u)^½ where the columns are carried and it is smaller
        (each Gram's rounding covered by a relative 1e-12, as the first order's)."""
        out = U.norm(dim=-1) * self.token_ball()[..., None]
        if self.W is not None and self.W.shape[-1]:
            along = ((U @ self.ball_grams()) * U).sum(-1).clamp_min(0).sqrt()
            out = torch.minimum(out, along * (1 + 1e-12))
        return out

    def along_range(self, u: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        """The range of u_tᵀΔ_t over the set for one functional u [B, n, d] a token: its centre and
        half-width [B, n] (:meth:`ranges` with C = 1)."""
        mid, half = self.ranges(u[:, None], eps)
        return mid[:, 0], half[:, 0]

    def support_width(self) -> int:
        """The columns a support along one functional and token reads (G's, the symbols', the groups',
        and d for E): its multiply-adds are d times this."""
        return self.G.shape[-1] + self.A.shape[-1] + self.Q.shape[-2] * self.Q.shape[-1] + self.c.shape[-1]

    def ranges(self, V: Tensor, eps: float, chunk: int | None = None) -> tuple[Tensor, Tensor]:
        """The ranges of v_tᵀΔ_t over the set for C functionals V [B, C, n, d], one a token each: their
        centres and half-widths [B, C, n], from each part's support (the first order's, the symbols',
        the groups' over their budgets, and the balls'). With ``chunk``, a few functionals at a time,
        holding at most that many entries at once (one functional at least): each functional's range
        is its own, so the chunks' are the whole's, bit for bit."""
        if chunk is not None:
            B, C, n = V.shape[:3]
            step = max(1, chunk // (B * n * self.support_width()))
            if step < C:
                parts = [self.ranges(V[:, i:i + step], eps) for i in range(0, C, step)]
                return tuple(torch.cat(part, 1) for part in zip(*parts, strict=True))
        G = self.G
        if G.dim() > 3 and G.shape[0] > 1 and G.stride(0) == 0:  # one set of columns for every image
            first = torch.einsum("bcnd,ndp->bcnp", V, G[0])
        else:
            first = torch.einsum("bcnd,bndp->bcnp", V, G)
        half = (eps * first.norm(dim=-1)
                + torch.einsum("bcnd,bndm->bcnm", V, self.A).abs().sum(-1)
                + self.grouped(torch.einsum("bcnd,bndkg->bcnkg", V, self.Q).norm(dim=-1))
                + self.token_ball_along(V.transpose(1, 2)).transpose(1, 2))
        return (V * self.c[:, None]).sum(-1), half

    def ball_support(self, c: Tensor) -> Tensor:
        """An upper bound of ⟨c, E⟩ for functionals c [B, ..., n, d], [B, ...]: ‖c‖_F·Σ_s ρ_s, or
        ‖Wᵀc‖ where the columns are carried and it is smaller."""
        total = c.flatten(-2).norm(dim=-1) * self.rho.sum(-1).reshape(-1, *[1] * (c.dim() - 3))
        columns = self.column_support(c)
        return total if columns is None else torch.minimum(total, columns)

    def column_support(self, c: Tensor) -> Tensor | None:
        """max ⟨c, Wv⟩ = ‖Wᵀc‖ over ‖v‖ ≤ 1 for functionals c [B, ..., n, d], [B, ...] (None where the
        columns are not carried): the columns' part of :meth:`ball_support` alone."""
        if self.W is None or not self.W.shape[-1]:
            return None
        B, n, d, K = self.W.shape
        flat = c.reshape(B, -1, n * d) @ self.W.reshape(B, n * d, K)  # [B, C, K]
        return flat.norm(dim=-1).reshape(c.shape[:-2])

    def carry_balls(self) -> DeviationSet:
        """The set with E also carried as columns (:attr:`W`), from here on: the remainders added later
        (:meth:`add_ball`) join them; E so far stays in ρ alone."""
        B, n, d = self.c.shape
        return replace(self, W=self.c.new_zeros(B, n, d, 0))

    def token_grams(self) -> Tensor:
        """G_t G_tᵀ per token, [B, n, d, d] (formed once, then kept by per-token maps)."""
        if self.gram is None:
            self.gram = self.G @ self.G.mT
        return self.gram

    def token_radii(self, eps: float) -> Tensor:
        """An upper bound of ‖Δ_t‖ per token, [B, n]: the joint bound of ‖G_tδ + A_tζ + c_t‖
        (:func:`joint_norm`, at most ‖c_t‖ + ε‖G_t‖₂ + ‖A_t‖_box) + Σ_j ‖Q_{t,j}‖₂ (grouped) + ‖E_t‖, every
        spectral norm from an exact float64 Gram eigenvalue rounded up (docs/bounds.md §2.4) and
        ‖A_t‖_box ≥ max over the box of ‖A_tζ‖₂ (:meth:`box_norms`)."""
        Qt = self.Q.transpose(2, 3)  # [B, n, k, d, g]: the smaller of the two Grams
        groups = (gram_norm(Qt.mT @ Qt if Qt.shape[-1] < Qt.shape[-2] else Qt @ Qt.mT) if self.Q.shape[-2]
                  else self.Q.new_zeros(*self.Q.shape[:2], 0))
        first = eps * gram_norm(self.token_grams())
        # ‖G_tδ + A_tζ + c_t‖ jointly (:func:`joint_norm`): the cross terms through each token's G_tᵀA_t,
        # G_tᵀc_t and A_tᵀc_t, each with its products' rounding
        return (joint_norm(eps, first, self.box_norms()[0], self.cross_norms()[0],
                           *shift_terms(self.G, self.A, self.c))
                + self.grouped(groups) + self.token_ball())

    def box_norms(self) -> tuple[Tensor, Tensor]:
        """Upper bounds of max_{ζ ∈ [−1, 1]^m} ‖A_tζ‖₂ per token [B, n] and of ‖Aζ‖_F over all tokens
        [B] (docs/bounds.md §5.1, "The symbols' share of a radius"): each the smaller of ‖|A|·1‖₂ (every
        coordinate of Aζ is at most its row's sum of |entries|) and (1ᵀ|AᵀA|·1)^½ (‖Aζ‖² = ζᵀAᵀAζ
        ≤ Σ_jk |(AᵀA)_jk|), the Gram's rounding added; computed once and kept, as the set is not
        changed in place."""
        if self._box is None:
            self._box = box_norms(self.A)
        return self._box

    def cross_norms(self) -> tuple[Tensor, Tensor]:
        """Upper bounds of max_{ζ ∈ [−1, 1]^m} ‖G_tᵀA_tζ‖₂ per token [B, n] and of ‖GᵀAζ‖ over all
        tokens [B] (:func:`cross_norms`), formed once and kept."""
        if self._cross is None:
            self._cross = cross_norms(self.G, self.A)
        return self._cross

    def radius(self, eps: float, tokens: Tensor | None = None) -> Tensor:
        """An upper bound of ‖Δ‖_F, [B]: the smallest of the route, (Σ_t r_t²)^½ and, where its Gram
        is small enough (:data:`GRAM_LIMIT`), the norm of the parts with ‖G‖₂ from its Gram
        (:func:`top_norm`)."""
        tokens = self.token_radii(eps) if tokens is None else tokens
        out = torch.minimum(self.route, tokens.norm(dim=-1))
        B, n, d, P = self.G.shape
        if n * d * min(n * d, P) ** 2 <= GRAM_LIMIT:
            G = self.G.reshape(B, n * d, P)
            k, g = self.Q.shape[-2:]
            Q = self.Q.permute(0, 3, 1, 2, 4).reshape(B, k, n * d, g)
            gram = G.mT @ G if P <= n * d else G @ G.mT
            shifts = shift_terms(G, self.A.reshape(B, n * d, -1), self.c.reshape(B, n * d))
            whole = (joint_norm(eps, eps * top_norm(gram), self.box_norms()[1], self.cross_norms()[1],
                                *shifts)
                     + self.grouped_norm(top_norm(Q.mT @ Q)) + self.ball())
            out = torch.minimum(out, whole)
        return out

    def support(self, c: Tensor, eps: float) -> Tensor:
        """An upper bound of ⟨c, Δ⟩ over the set for c [B, n, d], [B]."""
        return ((c * self.c).sum((-1, -2)) + eps * torch.einsum("bnd,bndp->bp", c, self.G).norm(dim=-1)
                + torch.einsum("bnd,bndm->bm", c, self.A).abs().sum(-1)
                + self.grouped(torch.einsum("bnd,bndkg->bkg", c, self.Q).norm(dim=-1))
                + self.ball_support(c[:, None])[:, 0])

    def per_token(self, L: Tensor, shift: Tensor | None = None) -> DeviationSet:
        """The image under Δ_t ↦ L_t Δ_t (+ shift_t), L [B, n, d, d]; E's radii are the caller's."""
        c = torch.einsum("bnde,bne->bnd", L, self.c) + (0 if shift is None else shift)
        gram = None if self.gram is None else L @ self.gram @ L.mT
        return replace(self, G=L @ self.G, A=L @ self.A, Q=torch.einsum("bnde,bnekg->bndkg", L, self.Q),
                       c=c, gram=gram, W=None if self.W is None else L @ self.W,
                       emap=None if self.emap is None else L @ self.emap)

    def rank_one(self, scale: Tensor, coef: Tensor, u: Tensor, shift: Tensor) -> DeviationSet:
        """:meth:`per_token` for L_t = scale_t·I + coef_t·u_t u_tᵀ (scale, coef [B, n], u [B, n, d]), as
        LayerProject's forms are: L_tM = scale_t·M + coef_t·u_t(u_tᵀM) in O(d) a column where a d×d
        product costs O(d²), and the Gram as s²g + sc(u wᵀ + w uᵀ) + c²(uᵀw)uuᵀ with w = g u."""
        s, c = scale[..., None], coef[..., None]

        def apply(M: Tensor) -> Tensor:  # M [B, n, d, ...]
            at = (..., *(None,) * (M.dim() - 3))  # [B, n, d] against M's trailing columns
            along = along_u(u, M)
            return s[at] * M + c[at] * u[at] * along[:, :, None]

        gram = None
        if self.gram is not None:
            w = self.gram @ u[..., None]  # [B, n, d, 1]
            uw = u[..., None] * w.mT
            gram = (s[..., None] ** 2 * self.gram + (s * c)[..., None] * (uw + uw.mT)
                    + (c**2 * (u[..., None, :] @ w)[..., 0])[..., None] * u[..., None] * u[..., None, :])
        c_new = apply(self.c[..., None])[..., 0] + shift
        return replace(self, G=apply(self.G), A=apply(self.A), Q=apply(self.Q), c=c_new, gram=gram,
                       W=None if self.W is None else apply(self.W),
                       emap=None if self.emap is None else apply(self.emap))

    def mixed(self, fn: Callable[[Tensor], Tensor],
              sparse: Callable[[Tensor, Tensor], Tensor] | None = None) -> DeviationSet:
        """The image under a linear map ``fn`` of [B, n, d, K] (K sets of tokens as columns: those of
        G, A and Q, and c) that mixes tokens; E's radii are the caller's. Given ``sparse`` (the same
        map for directions that each move one token: their d-vectors [B, d, K'] and tokens [B, K'] →
        [B, n, d, K']), the columns of G, A and Q after the last that moves two tokens in some image go
        that way: the pixels' columns, a ReLU's symbol and LayerProject's groups are in one token until
        a map mixes them, per-token maps keep them there, and new ones are appended after old ones.
        Where every column moves one token (the first block), c goes that way too, as the sum of its
        tokens' one-token vectors, and ``fn`` is not called."""
        B, n, d, k, g = self.Q.shape
        comps = [self.G, self.A, self.Q.reshape(B, n, d, k * g)] + ([] if self.W is None else [self.W])
        cut = [0] * len(comps)  # per part, how many of its last columns move one token
        # [B, n, K]: the tokens each column moves (|x| > 0 iff x ≠ 0, and NaN ≠ 0 counts as moved;
        # faster than ``ne(0).any``)
        moved = [~(M.abs().amax(2) == 0) for M in comps] if sparse is not None else []
        for i, m in enumerate(moved):
            if m.shape[-1]:
                one = (m.sum(1) <= 1).all(0)  # [K]
                cut[i] = int(one.flip(0).cumprod(0).sum())
        widths = [M.shape[-1] - c for M, c in zip(comps, cut, strict=True)]  # the columns that mix
        # c is the sum of its tokens' one-token vectors: where every other column moves one token it
        # takes the closed form too (n columns, summed), and ``fn`` is not called at all
        alone = sparse is not None and not any(widths)
        if alone:
            outs = [M[..., :0] for M in comps] + [None]
        else:
            many = torch.cat([M[..., :w] for M, w in zip(comps, widths, strict=True)]
                             + [self.c[..., None]], -1)
            outs = list(fn(many).split([*widths, 1], -1))
        if any(cut) or alone:  # every one-token column in one call; each part a view of its output
            gamma = [M[..., w:].sum(1) for M, w in zip(comps, widths, strict=True)]  # its vector there
            tokens = [m[..., w:].to(torch.uint8).argmax(1) for m, w in zip(moved, widths, strict=True)]
            if alone:
                gamma.append(self.c.mT)
                tokens.append(torch.arange(n, device=self.c.device).expand(B, n))
            mapped = sparse(torch.cat(gamma, -1), torch.cat(tokens, -1)).split([*cut, n][:len(gamma)], -1)
            parts = len(comps)
            for i in range(parts):
                outs[i] = torch.cat([outs[i], mapped[i]], -1) if outs[i].shape[-1] else mapped[i]
            if alone:
                outs[parts] = mapped[parts].sum(-1, keepdim=True)
        G, A, Q, *W, c = outs
        # E's per-token bounds do not survive a map that mixes tokens: the caller sets them anew
        return replace(self, G=G, A=A, Q=Q.reshape(B, n, d, k, g), c=c[..., 0], gram=None, tok=None,
                       W=W[0] if W else None, emap=None, fresh=None)

    def plus(self, branch: DeviationSet) -> DeviationSet:
        """The set of Δ + B(Δ) (a residual around a branch) from this set and ``branch``, the branch's
        set made from this one: its symbols, groups and sources begin with these (every map keeps
        their order and appends its own), so the shared parts add column by column; E's radii add
        per source (‖E + E_B‖ ≤ Σρ + Σρ_B), and so do the per-token bounds and the routes."""
        m, (k, g) = self.A.shape[-1], self.Q.shape[-2:]
        A = branch.A.clone()
        A[..., :m] += self.A
        Q = branch.Q.clone()
        if k:
            Q[..., :k, :g] += self.Q
        rho = branch.rho.clone()
        rho[:, :self.rho.shape[1]] += self.rho
        tok = None if self.tok is None or branch.tok is None else self.tok + branch.tok
        if tok is not None and branch.emap is not None and branch.fresh is not None:
            # E_t + M_tE_t + F_t: the branch's map of this E and what it added (docs/bounds.md §5.1)
            eye = torch.eye(branch.emap.shape[-1], dtype=tok.dtype, device=tok.device)
            I_M = eye + branch.emap
            joint = gram_norm(I_M.mT @ I_M) * (1 + 1e-12) * self.tok + branch.fresh
            tok = torch.minimum(tok, joint)
        voids = [v for v in (self.void, branch.void) if v is not None]
        void = voids[0] | voids[-1] if voids else None
        W = None
        if self.W is not None and branch.W is not None:  # two ellipsoids whose sum is one (merge_balls)
            W = merge_balls(self.W, branch.W)
        return replace(branch, G=self.G + branch.G, A=A, Q=Q, c=self.c + branch.c, rho=rho, tok=tok,
                       route=self.route + branch.route, gram=None, void=void, W=W, emap=None, fresh=None)

    def fork(self) -> DeviationSet:
        """The set at a residual's fork, E's map from here (the identity) and its part born after
        (none) tracked until :meth:`plus` joins the branch (where the per-token bounds are known)."""
        if self.tok is None:
            return self
        B, n, d = self.c.shape
        eye = torch.eye(d, dtype=self.c.dtype, device=self.c.device).expand(B, n, d, d)
        return replace(self, emap=eye, fresh=torch.zeros_like(self.tok))

    def token(self, t: int) -> DeviationSet:
        """The set of token t's deviation alone, as a set of one token."""
        keep = slice(t, t + 1)
        return replace(self, G=self.G[:, keep], A=self.A[:, keep], Q=self.Q[:, keep], c=self.c[:, keep],
                       tok=None if self.tok is None else self.tok[:, keep], gram=None,
                       W=None if self.W is None else self.W[:, keep])

    def with_symbols(self, columns: Tensor) -> DeviationSet:
        """The set plus new symbol columns [B, n, d, k]."""
        return replace(self, A=torch.cat([self.A, columns], -1))

    def with_groups(self, name: str, columns: Tensor, caps: Tensor,
                    budget: Tensor | None = None) -> DeviationSet:
        """The set plus new groups [B, n, d, k, g] from source ``name``, their caps [B, k] and, if they
        share one, their budget [B] (:meth:`grouped`). A group's g columns may be fewer than d; groups
        of another width are padded with zero columns (which move nothing)."""
        old = self.caps if self.caps is not None else caps.new_ones(caps.shape[0], 0)
        budgets = self.budgets | ({name: budget} if budget is not None else {})
        Q, g = self.Q, columns.shape[-1]
        if not Q.shape[-2]:  # groups may be narrower than d (taylor_net.error_frame): the new width
            Q = Q.new_zeros(*Q.shape[:-1], g)
        elif Q.shape[-1] != g:  # groups of two widths: the narrower padded with zero columns
            w = max(Q.shape[-1], g)
            Q, columns = (torch.nn.functional.pad(t, (0, w - t.shape[-1])) for t in (Q, columns))
        return replace(self, Q=torch.cat([Q, columns], -2), caps=torch.cat([old, caps], -1),
                       groups=[*self.groups, *[name] * columns.shape[-2]], budgets=budgets)

    def add_ball(self, name: str, rho: Tensor, per_token: Tensor | None = None) -> DeviationSet:
        """The set plus a remainder ball of source ``name``, Frobenius radius ``rho`` [B], and where
        known its bound per token ``per_token`` [B, n] (else ``rho`` at every token)."""
        new = rho[:, None] if per_token is None else per_token
        tok = None if self.tok is None else self.tok + new
        fresh = None if self.fresh is None else self.fresh + new
        W = self.W
        if W is not None and bool((rho > 0).any()):  # the ball ρ·I joins the columns (merge_balls)
            W = merge_balls(W, rho=rho)
        return replace(self, rho=torch.cat([self.rho, rho[:, None]], -1), sources=[*self.sources, name],
                       tok=tok, W=W, fresh=fresh)


def merge_balls(W1: Tensor, W2: Tensor | None = None, *, rho: Tensor | None = None) -> Tensor:
    """Columns W [B, n, d, K] with {Wv : ‖v‖₂ ≤ 1} ⊇ {W₁v₁ + W₂v₂ : ‖v₁‖₂, ‖v₂‖₂ ≤ 1} (docs/bounds.md
    §5.1, "The balls as columns"), for W₁ [B, n, d, K₁] and W₂ [B, n, d, K₂], or W₂ = ρ·I_{n·d} for
    ``rho`` [B] (a new remainder's ball: its Gram ρ²I and its norm ρ are known, so neither is computed).

    For any p > 0, W₁v₁ + W₂v₂ = [aW₁, bW₂]w with w = (v₁/a, v₂/b), a² = 1 + 1/p, b² = 1 + p, and
    ‖w‖² ≤ 1/a² + 1/b² = 1; p = s₁/s₂ (s_i an estimate of ‖W_i‖₂, 20 power steps: any p is sound)
    makes the support exact along the top direction where both share it. Where the n·d rows are fewer
    than the K₁ + K₂ columns, the columns are compressed to n·d with the same set up to rounding: a
    computed Cholesky factor L of M = fl(a²W₁W₁ᵀ + b²W₂W₂ᵀ) + τI has LLᵀ = M + ΔM with ‖ΔM‖₂ ≤
    γ_{N+1}‖L‖_F² (Higham, Thm 10.3), and fl(·) is off from the exact sum by at most γ_{K+2}(‖aW₁‖_F² +
    ‖bW₂‖_F²) (Thm 3.5), so τ at twice their sum makes LLᵀ ⪰ a²W₁W₁ᵀ + b²W₂W₂ᵀ, whose ellipsoid holds
    that of [aW₁, bW₂]. Where a factorisation fails (in any image: the columns' count is the batch's)
    the columns stay side by side."""
    B, n, d = W1.shape[:3]
    N = n * d
    if not W1.shape[-1]:
        return W2 if W2 is not None else rho[:, None, None, None] * torch.eye(
            N, dtype=rho.dtype, device=rho.device).reshape(n, d, N)
    flat1 = W1.reshape(B, N, W1.shape[-1])
    s1 = _top_singular(flat1)
    s2 = rho if W2 is None else _top_singular(W2.reshape(B, N, W2.shape[-1]))
    # where one part is zero the other is taken as it is (a or b = 1)
    both = (s1 > 0) & (s2 > 0)
    p = torch.where(both, s1 / torch.where(both, s2, 1.0), 1.0)
    a = torch.where(both, (1 + 1 / p).sqrt(), 1.0)
    b = torch.where(both, (1 + p).sqrt(), 1.0)
    side1 = flat1 * a[:, None, None]
    side2 = None if W2 is None else W2.reshape(B, N, -1) * b[:, None, None]  # ρ·I's: formed only if returned
    K = W1.shape[-1] + (N if side2 is None else side2.shape[-1])
    if K <= N:  # (never with ρ·I, whose N columns come on top of W₁'s)
        return torch.cat([side1, side2], -1).reshape(B, n, d, K)
    eye = torch.eye(N, dtype=W1.dtype, device=W1.device)
    if side2 is None:  # a²W₁W₁ᵀ + b²ρ²I: the identity's half of the product is known (each entry's error
        # still within γ_{K+2} of its products' magnitudes: one scaling and one sum more than W₁W₁ᵀ's)
        M = side1 @ side1.mT
        M.diagonal(dim1=-2, dim2=-1).add_((b * rho).square()[:, None])
        fro = side1.square().sum((-1, -2)) + N * (b * rho).square()
    else:
        side = torch.cat([side1, side2], -1)  # [B, N, K]
        M = side @ side.mT
        fro = side.square().sum((-1, -2))
    trace = M.diagonal(dim1=-2, dim2=-1).sum(-1)
    # ‖L‖_F² = tr(M + τI + ΔM) ≤ 1.01·(tr M + Nτ), and Nτ ≤ 1e-6·N·‖side‖_F² for any τ this makes
    tau = 2 * (rounding(K + 2, M.dtype) * fro + rounding(N + 1, M.dtype) * 1.01 * (trace + N * fro * 1e-6))
    tau = tau + torch.finfo(M.dtype).tiny
    L, info = torch.linalg.cholesky_ex(M + tau[:, None, None] * eye)
    if bool((info != 0).any()):  # side by side: the same set, more columns
        side2 = (b * rho)[:, None, None] * eye if side2 is None else side2
        return torch.cat([side1, side2], -1).reshape(B, n, d, K)
    return L.reshape(B, n, d, N)


def _top_singular(W: Tensor, steps: int = 20) -> Tensor:
    """An estimate of ‖W‖₂ per image for W [B, N, K] (power steps on WᵀW from a fixed start): only a
    weight of :func:`merge_balls`, nothing certified rests on it."""
    v = torch.ones(W.shape[0], W.shape[-1], 1, dtype=W.dtype, device=W.device)
    for _ in range(steps):
        v = W.mT @ (W @ v)
        v = v / v.norm(dim=1, keepdim=True).clamp_min(torch.finfo(W.dtype).tiny)
    return (W @ v).norm(dim=(1, 2))


# the most entries of one image's symbols' per-token Grams A_tᵀA_t formed at once (200 MB in
# float64); beyond it they are formed a token at a time
BOX_GRAM_ENTRIES = 25 * 10**6


def box_norms(A: Tensor) -> tuple[Tensor, Tensor]:
    """Upper bounds of max_{ζ ∈ [−1, 1]^m} ‖A_tζ‖₂ per token, [B, n], and of ‖Aζ‖_F over every token,
    [B], for symbol columns A [B, n, d, m] (:meth:`DeviationSet.box_norms`; docs/bounds.md §5.1).

    Each is the smaller of the box's ‖|A|·1‖₂ and the Gram's (1ᵀ|M|·1)^½, M = AᵀA (M = Σ_t A_tᵀA_t
    for all tokens): the second is never larger (Σ_jk |M_jk| ≤ Σ_jk (|A|ᵀ|A|)_jk = ‖|A|·1‖²) and much
    smaller where the columns are nearly orthogonal, as symbols of different neurons and tokens are.
    Rounding: each computed entry of M is off by at most γ·Σ_i |A_ij||A_ik| (γ = k·u/(1 − k·u) for
    a sum of k products, Higham Thm 3.5), which adds γ‖|A|·1‖² to the sum; the sum of m² terms and
    the square root are covered by a relative (1 + 2(m² + 2)u)."""
    B, n, d, m = A.shape
    box = A.abs().sum(-1)  # [B, n, d]
    tok_box, all_box = box.norm(dim=-1), box.flatten(1).norm(dim=-1)
    if m == 0:
        return tok_box, all_box
    u = torch.finfo(A.dtype).eps / 2
    per, total, width = A.new_zeros(B, n), A.new_zeros(B), [0] * B
    # image by image, on its own nonzero columns: a chunk pads every image's symbols to the largest
    # count in it, and the padding would change the sums' rounding (and cost m² for nothing)
    for b in range(B):
        own = A[b][..., A[b].abs().amax((0, 1)) > 0]  # [n, d, m_b]
        width[b] = m_b = own.shape[-1]
        if n * m_b * m_b <= BOX_GRAM_ENTRIES:
            M = own.mT @ own  # [n, m_b, m_b]
            per[b] = M.abs().sum((-1, -2))
            total[b] = M.sum(0).abs().sum()
        else:  # a token at a time, on the columns nonzero in it (:func:`token_columns`)
            whole = A.new_zeros(m_b, m_b)
            for t in range(n):
                idx = token_columns(own[t])
                At = own[t] if idx is None else own[t][:, idx]
                M = At.mT @ At
                per[b, t] = M.abs().sum()
                if idx is None:
                    whole += M
                else:
                    whole[idx[:, None], idx] += M
            total[b] = whole.abs().sum()
    grow = 1 + 2 * (torch.tensor(width, dtype=A.dtype, device=A.device) ** 2 + 2) * u  # [B]
    tok = ((per + rounding(d, A.dtype) * tok_box**2) * grow[:, None]).sqrt() * grow[:, None]
    # the whole sum adds n per-token Grams: each entry a sum of n·d products
    every = ((total + rounding(n * d, A.dtype) * all_box**2) * grow).sqrt() * grow
    return torch.minimum(tok_box, tok), torch.minimum(all_box, every)


def token_columns(At: Tensor) -> Tensor | None:
    """The indices of the columns nonzero in one token's symbols At [d, m], where they are at most half
    of them; None (take all) otherwise. A ReLU's symbol lives in its own token until attention mixes
    it (after an FFN, 835 of an image's 5,224 columns a token on the 4-block Fashion-MNIST ViT at
    ε 0.1), and a zero column adds exact zeros to any product with it; once most are nonzero, as after
    attention, scattering the token's products back into the image's costs more than it saves."""
    idx = (At.abs().amax(0) > 0).nonzero()[:, 0]
    return None if 2 * len(idx) > At.shape[-1] else idx


def rounding(k: int, dtype: torch.dtype) -> float:
    """γ_k = k·u/(1 − k·u): a computed sum of k products is off by at most γ_k times the sum of their
    magnitudes (Higham, Thm 3.5)."""
    u = torch.finfo(dtype).eps / 2
    return k * u / (1 - k * u)


def rounded_box(M: Tensor, mags: Tensor, k: int) -> Tensor:
    """‖|M|·1‖₂ over the trailing [p, m] of a computed product M whose entries are sums of k products,
    rounding included: ``mags`` [..., p] bounds each row's Σ_j of the products' magnitudes."""
    return M.abs().sum(-1).norm(dim=-1) + rounding(k, M.dtype) * mags.norm(dim=-1)


def cross_norms(G: Tensor, A: Tensor) -> tuple[Tensor, Tensor]:
    """Upper bounds of max_{ζ ∈ [−1, 1]^m} ‖G_tᵀA_tζ‖₂ per token, [B, n], and of ‖GᵀAζ‖₂ over all
    tokens, [B], for G [B, n, d, P] and symbol columns A [B, n, d, m] (:func:`joint_norm`'s cross
    term): per token the box of the computed G_tᵀA_t, for all tokens :func:`box_norms` of the computed
    GᵀA = Σ_t G_tᵀA_t, each plus its rounding (:func:`rounded_box`). Image by image on its own nonzero
    columns, as :func:`box_norms`, so that a chunk's padding changes no bit."""
    B, n, d, P = G.shape
    tok, whole = A.new_zeros(B, n), A.new_zeros(B)
    for b in range(B):
        own = A[b][..., A[b].abs().amax((0, 1)) > 0]  # [n, d, m_b]
        m_b = own.shape[-1]
        if not m_b:
            continue
        mags = G[b].abs().mT @ own.abs().sum(-1)[..., None]  # [n, P, 1]
        if n * P * m_b <= BOX_GRAM_ENTRIES:
            GA = G[b].mT @ own  # [n, P, m_b]
            tok[b] = rounded_box(GA, mags[..., 0], d)
            total = GA.sum(0)  # [P, m_b]: a sum of n·d products an entry
        else:  # a token at a time, on the columns nonzero in it (:func:`token_columns`)
            total = A.new_zeros(P, m_b)
            for t in range(n):
                idx = token_columns(own[t])
                GA = G[b, t].mT @ (own[t] if idx is None else own[t][:, idx])  # [P, m_t]
                if idx is None:
                    total += GA
                else:
                    total.index_add_(1, idx, GA)
                tok[b, t] = rounded_box(GA, mags[t, :, 0], d)
        whole[b] = box_norms(total[None, None])[1][0] + rounding(n * d, A.dtype) * mags.sum(0)[..., 0].norm()
    return tok, whole


def shift_terms(G: Tensor, A: Tensor, c: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`joint_norm`'s shift terms over the trailing coordinates N of G [..., N, P], symbol columns
    A [..., N, m] and a shift c [..., N] (one token's, or every token's flattened): ‖c‖, ‖Gᵀc‖ and
    ‖Aᵀc‖₁, each product with its rounding (γ_N times the products' magnitudes, :func:`rounding`)."""
    err = rounding(c.shape[-1], c.dtype)
    times = lambda M, v: (M.mT @ v[..., None])[..., 0]  # Mᵀv
    first = times(G, c).norm(dim=-1) + err * times(G.abs(), c.abs()).norm(dim=-1)
    symbols = times(A, c).abs().sum(-1) + err * times(A.abs(), c.abs()).sum(-1)
    return c.norm(dim=-1), first, symbols


def joint_norm(eps: float, first: Tensor, symbols: Tensor, cross: Tensor, shift: Tensor | None = None,
               shift_first: Tensor | None = None, shift_symbols: Tensor | None = None) -> Tensor:
    """An upper bound of ‖Gδ + Aζ + c‖ over ‖δ‖₂ ≤ ε and ζ ∈ [−1, 1]^m (docs/bounds.md §5.1, "The
    symbols' share of a radius") from ``first`` ≥ ε‖G‖₂, ``symbols`` ≥ max ‖Aζ‖, ``cross`` ≥
    max ‖GᵀAζ‖ and, where a shift c is given, ``shift`` = ‖c‖, ``shift_first`` ≥ ‖Gᵀc‖ and
    ``shift_symbols`` ≥ ‖Aᵀc‖₁: the square expands into its three squares and three cross terms,

        ‖Gδ + Aζ + c‖² ≤ first² + symbols² + ‖c‖² + 2ε·cross + 2ε‖Gᵀc‖ + 2‖Aᵀc‖₁,

    as ⟨δ, GᵀAζ⟩ ≤ ε‖GᵀAζ‖, ⟨δ, Gᵀc⟩ ≤ ε‖Gᵀc‖ and ⟨Aζ, c⟩ = Σ_j ζ_j (Aᵀc)_j ≤ ‖Aᵀc‖₁. With each cross
    term taken at most the product of its two norms it is never above first + symbols + ‖c‖, which it
    takes where it is smaller, so the square root's rounding cannot lift it above the triangle's sum."""
    if shift is None:
        shift = shift_first = shift_symbols = torch.zeros_like(first)
    if eps > 0:
        cross = torch.minimum(cross, first / eps * symbols)
        shift_first = torch.minimum(shift_first, first / eps * shift)
    shift_symbols = torch.minimum(shift_symbols, symbols * shift)
    square = (first**2 + symbols**2 + shift**2 + 2 * eps * cross + 2 * eps * shift_first
              + 2 * shift_symbols)
    joint = square.sqrt() * (1 + 8 * torch.finfo(first.dtype).eps)
    return torch.minimum(joint, first + symbols + shift)


def along_u(u: Tensor, M: Tensor) -> Tensor:
    """u_tᵀM_t per image and token: u [B, n, d], M [B, n, d, ...] → [B, n, ...]; where M is one set of
    columns shared by every image (expanded, as the first block's pixels-to-tokens map is), through
    that one set rather than B copies of it."""
    if M.dim() > 3 and M.shape[0] > 1 and M.stride(0) == 0:
        return torch.einsum("bnd,nd...->bn...", u, M[0])
    return torch.einsum("bnd,bnd...->bn...", u, M)


def relu_relaxation(z0: Tensor, lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(λ, β, μ) with ``relu(z) − relu(z0) ∈ λ(z − z0) + β + μ[−1, 1]`` for every z ∈ [lo, hi]: 1, 0, 0
    where lo ≥ 0; 0, 0, 0 where hi ≤ 0; else the parallelogram of least area between λz and λz − λ·lo,
    λ = hi/(hi − lo) (DeepZ, Singh et al. 2018; docs/bounds.md §5.1)."""
    unstable = (lo < 0) & (hi > 0)
    lam = torch.where(hi <= 0, 0.0, torch.where(unstable, hi / torch.where(unstable, hi - lo, 1.0), 1.0))
    half = torch.where(unstable, -lam * lo / 2, 0.0)
    beta = torch.where(unstable, lam * z0 - torch.relu(z0) + half, 0.0)
    return lam.to(z0.dtype), beta, half


def symbols(mask: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
    """The units of ``mask`` [B, U] as columns: indices [B, k] (k the largest count in the batch) and
    their ``values`` [B, k], 0 where an image has fewer units (a zero column is no symbol)."""
    k = int(mask.sum(-1).max()) if mask.numel() else 0
    order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)[:, :k]
    return order, values.gather(-1, order) * mask.gather(-1, order)


def columns(idx: Tensor, coef: Tensor, n: int, d: int) -> Tensor:
    """Symbol columns [B, n, d, k, ...] from per-unit token indices ``idx`` [B, k] and blocks ``coef``
    [B, k, d, ...] (unit j's block is coef[:, j] in token idx[:, j], zero elsewhere)."""
    B, k = idx.shape
    rest = coef.shape[3:]
    out = coef.new_zeros(B, n, k, d, *rest)
    index = idx.reshape(B, 1, k, *([1] * (1 + len(rest)))).expand(B, 1, k, d, *rest)
    out.scatter_(1, index, coef[:, None])
    return out.transpose(2, 3)

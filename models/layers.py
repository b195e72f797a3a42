"""The layers of docs/bounds.md §1 as plain tensor containers with a batched forward.

Every function takes inputs of shape ``[..., n, d]``: leading dimensions are batch dimensions, so
restarts, inputs and heads of an attack can all be evaluated in one call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from .spectral import LinearOperator, LogitOperator, product_norm

ACTIVATIONS = {"relu": torch.relu, "tanh": torch.tanh}  # 1-Lipschitz, as OLSA's Theorem 4.1 assumes


class _Tensors:
    """Moves every tensor field to the device and dtype of a reference tensor."""

    def to(self, like: Tensor):
        moved = {
            f.name: getattr(self, f.name).to(device=like.device, dtype=like.dtype)
            for f in fields(self)
            if isinstance(getattr(self, f.name), Tensor)
        }
        return replace(self, **moved)

    @property
    def h(self) -> int:
        return self.W_q.shape[0]

    @property
    def d(self) -> int:
        return self.W_q.shape[1]  # W_q is [h, d, d_h]; OLSA's [h, d_h, d] overrides both

    @property
    def d_h(self) -> int:
        return self.W_q.shape[2]

    @property
    def H_norm(self) -> float:
        """Spectral norm of H: 1 for the residual layer, 0 for bare attention."""
        return 1.0 if self.residual else 0.0


@dataclass(frozen=True)
class DotMHA(_Tensors):
    """Dot-product multi-head attention, docs/bounds.md §1.1: ``F(X) = HX + Σ_l P_l(X) X C_l``, with
    optional biases (docs/bounds.md §1.5).

    With biases, per head ``Q_l = X W^Q_l + 1 b_{q,l}ᵀ``, ``K_l = X W^K_l + 1 b_{k,l}ᵀ``, values
    ``X W^V_l + 1 b_{v,l}ᵀ`` and an output bias ``b_o``:

        P_l(X) = softmax_rows(Q_l K_lᵀ / √d_h)
        F(X)   = HX + Σ_l P_l(X) (X W^V_l + 1 b_{v,l}ᵀ) W^O_l + 1 b_oᵀ .

    Why the bounds of §2 survive (the algebra, with X' = X + Γ): ``b_o`` cancels in F(X') − F(X);
    ``b_v`` cancels because ``(P_l(X') − P_l(X))·1 = 0`` (both row-stochastic), so

        F(X') − F(X) = HΓ + Σ_l P_l(X) Γ C_l + Σ_l (P_l(X') − P_l(X)) X' C_l = Δ₁ + Δ₂

    with ``C_l = W^V_l W^O_l`` and the biased P_l. In the logits ``Q_l' = Q_l + Γ W^Q_l`` and
    ``K_l' = K_l + Γ W^K_l``, so ``√d_h (S_l' − S_l) = Γ W^Q_l K_lᵀ + Q_l W^K_lᵀ Γᵀ + Γ A_l Γᵀ``:
    the linear part is ``Γ Uᵀ + V Γᵀ`` with ``U = K_l W^Q_lᵀ = X A_lᵀ + 1 (W^Q_l b_{k,l})ᵀ`` and
    ``V = Q_l W^K_lᵀ = X A_l + 1 (W^K_l b_{q,l})ᵀ``; the quadratic part is unchanged.

    A bias left at None is absent. Each bias is *added* to the bias-free computation, so a zero bias
    gives bit for bit the values of the layer without it (x + 0.0 == x in IEEE arithmetic).
    """

    W_q: Tensor  # [h, d, d_h]
    W_k: Tensor  # [h, d, d_h]
    W_v: Tensor  # [h, d, d_h]
    W_o: Tensor  # [h, d_h, d]
    residual: bool = True
    b_q: Tensor | None = None  # [h, d_h]
    b_k: Tensor | None = None  # [h, d_h]
    b_v: Tensor | None = None  # [h, d_h]
    b_o: Tensor | None = None  # [d]
    kind = "dot"

    def biases(self) -> tuple[Tensor | None, ...]:
        """``(b_q, b_k, b_v, b_o)``, None where absent."""
        return (self.b_q, self.b_k, self.b_v, self.b_o)

    @property
    def has_biases(self) -> bool:
        """Whether some bias is present and nonzero. A zero bias changes no value (see the class
        docstring), so a layer whose biases are all zero is the bias-free layer and every bound of
        docs/bounds.md applies to it unchanged."""
        return any(b is not None and bool((b != 0).any()) for b in self.biases())

    def A(self) -> Tensor:
        """``A_l = W^Q_l W^K_lᵀ``, shape [h, d, d]."""
        return self.W_q @ self.W_k.transpose(-1, -2)

    def C(self) -> Tensor:
        """``C_l = W^V_l W^O_l``, shape [h, d, d]."""
        return self.W_v @ self.W_o

    def stacked_weights(self) -> tuple[Tensor, Tensor]:
        """Every head's weights as the two matrices of one product each: ``[W^Q_1 … W^Q_h | W^K_1 …
        W^K_h | W^V_1 … W^V_h]`` as [d, 3·h·d_h] and ``[W^O_1; …; W^O_h]`` as [h·d_h, d] (the
        closed-form Jacobian, ``models.structured.dot_jacobian_operator``, and taylor_net's)."""
        h, d, e = self.W_q.shape
        qkv = torch.cat([self.W_q, self.W_k, self.W_v], 0).permute(1, 0, 2).reshape(d, 3 * h * e)
        return qkv, self.W_o.reshape(h * e, d)

    # The norms of the rank-≤d_h products A_l, C_l, X C_l, U and V through their d_h-wide factors
    # (models.spectral.product_norm: ‖L R‖ = ‖R_L R_Rᵀ‖ from the QRs of L and Rᵀ), never forming the
    # d×d or n×d product. Not cached: they are recomputed from the weights on each call (a cache on a
    # frozen layer that .to() copies between devices and dtypes would go stale or be lost), and at
    # d_h ≪ d they cost less than a millisecond; :class:`KeptNormsMHA` keeps them for a holder of
    # weights that do not change.

    def A_norm(self) -> Tensor:
        """``‖A_l‖ = ‖W^Q_l W^K_lᵀ‖`` per head, shape [h]."""
        return product_norm(self.W_q, self.W_k.mT)

    def C_norm(self) -> Tensor:
        """``‖C_l‖ = ‖W^V_l W^O_l‖`` per head, shape [h]."""
        return product_norm(self.W_v, self.W_o)

    def XC_norm(self, X: Tensor) -> Tensor:
        """``‖X C_l‖ = ‖(X W^V_l) W^O_l‖`` per input and head, shape [..., h] for X [..., n, d]."""
        return product_norm(torch.einsum("...nd,hde->...hne", X, self.W_v), self.W_o)

    def queries_keys(self, X: Tensor, own: bool = False) -> tuple[Tensor, Tensor]:
        """``(Q_l, K_l)`` with ``Q_l = X W^Q_l (+ 1 b_{q,l}ᵀ)``, ``K_l = X W^K_l (+ 1 b_{k,l}ᵀ)``
        (docs/bounds.md §1.5), each shape [..., h, n, d_h]; a bias is added to the bias-free product,
        so a zero bias changes no bit (class docstring). With ``own``, X is [..., h, n, d], one input
        per head, and head l reads its own (the per-head attacks' copies)."""
        spec = "...lnd,lde->...lne" if own else "...nd,hde->...hne"
        Q = torch.einsum(spec, X, self.W_q)
        K = torch.einsum(spec, X, self.W_k)
        if self.b_q is not None:
            Q = Q + self.b_q[:, None, :]
        if self.b_k is not None:
            K = K + self.b_k[:, None, :]
        return Q, K

    def logit_factor_norms(self, X: Tensor) -> tuple[Tensor, Tensor]:
        """``(‖U‖, ‖V‖)`` for the factors of :meth:`logit_operator`, ``U = K_l W^Q_lᵀ`` and
        ``V = Q_l W^K_lᵀ`` (X A_lᵀ and X A_l without biases), through their n×d_h and d_h×d factors;
        each shape [..., h] for X [..., n, d]. Their sum is ξ_l (LoFAST eq. 26)."""
        Q, K = self.queries_keys(X)
        return product_norm(K, self.W_q.mT), product_norm(Q, self.W_k.mT)

    def attention(self, X: Tensor, own: bool = False) -> Tensor:
        """``P_l(X) = softmax_rows(Q_l K_lᵀ / √d_h)``, ``Q_l = X W^Q_l (+ 1 b_{q,l}ᵀ)``, ``K_l = X W^K_l
        (+ 1 b_{k,l}ᵀ)`` (docs/bounds.md §1.1, §1.5); shape [..., h, n, n]. ``own`` as in
        :meth:`queries_keys`: head l of its own input X[..., l, :, :] alone (h heads, not h²)."""
        Q, K = self.queries_keys(X, own)
        return torch.softmax(Q @ K.transpose(-1, -2) / math.sqrt(self.d_h), dim=-1)

    def forward(self, X: Tensor) -> Tensor:
        V = torch.einsum("...nd,hde->...hne", X, self.W_v)
        if self.b_v is not None:
            V = V + self.b_v[:, None, :]
        out = torch.einsum("...hne,hef->...nf", self.attention(X) @ V, self.W_o)
        if self.b_o is not None:
            out = out + self.b_o
        return out + X if self.residual else out

    __call__ = forward

    def delta1_operator(self, X: Tensor) -> LinearOperator:
        """Δ₁, the change of F at fixed attention P_l(X), as a map of Γ (LoFAST eq. 15, docs/bounds.md
        §2): ``T(Γ) = HΓ + Σ_l P_l Γ C_l``, ``T*(Y) = HᵀY + Σ_l P_lᵀ Y C_lᵀ``; ζ(X) = ‖T‖.

        With biases (§1.5) only P_l changes: b_v and b_o cancel from F(X') − F(X).
        Γ is [..., B, n, d]: extra leading dimensions (attack restarts) broadcast against X's batch.
        """
        P, H = self.attention(X), self.H_norm
        if self.h > 1:
            # through the factors C_l = W^V_l W^O_l: 4nd² + 2n²d flops per product instead of
            # h(nd² + n²d) with the d×d C_l (6.7× fewer at ViT-B's n=197, d=768, h=12), every head's
            # W^V_l (and W^O_l) in one product as [d, h·d_h], faster than one einsum per factor
            h, d, e = self.W_v.shape
            Wv = self.W_v.permute(1, 0, 2).reshape(d, h * e)
            Wo = self.W_o.reshape(h * e, d)
            Wvt, Wot, Pt = Wv.mT.contiguous(), Wo.mT.contiguous(), P.transpose(-1, -2)

            def T(G: Tensor) -> Tensor:
                GV = (G @ Wv).unflatten(-1, (h, e)).transpose(-2, -3)  # [..., h, n, d_h]
                return H * G + (P @ GV).transpose(-2, -3).flatten(-2) @ Wo

            def Tt(Y: Tensor) -> Tensor:
                YO = (Y @ Wot).unflatten(-1, (h, e)).transpose(-2, -3)
                return H * Y + (Pt @ YO).transpose(-2, -3).flatten(-2) @ Wvt

            return LinearOperator(T, Tt)
        C = self.C()

        def T1(G: Tensor) -> Tensor:
            return H * G + torch.einsum("...hne,hef->...nf", P @ G.unsqueeze(-3), C)

        def Tt1(Y: Tensor) -> Tensor:
            return H * Y + torch.einsum("...hne,hfe->...nf", P.transpose(-1, -2) @ Y.unsqueeze(-3), C)

        return LinearOperator(T1, Tt1)

    def logit_operator(self, X: Tensor) -> LogitOperator:
        """The part of each head's logit change linear in Γ (LoFAST eq. 25, Lemma 2; docs/bounds.md
        §2.1, §1.5): ``T(Γ) = Γ Uᵀ + V Γᵀ`` and ``T*(Z) = Z U + Zᵀ V`` with U = K_l W^Q_lᵀ and
        V = Q_l W^K_lᵀ, which are X A_lᵀ and X A_l without biases; ‖M_l(X)‖ = ‖T‖ per head.
        Γ is [B, h, n, d], X is [B, n, d].
        """
        A = self.A()
        U = torch.einsum("bnd,hed->bhne", X, A)
        V = torch.einsum("bnd,hde->bhne", X, A)
        # K_l W^Q_lᵀ = X A_lᵀ + 1 (W^Q_l b_k)ᵀ: the bias term is added to the bias-free U, so that
        # a zero bias leaves U bit for bit as it was; likewise V = X A_l + 1 (W^K_l b_q)ᵀ
        if self.b_k is not None:
            U = U + torch.einsum("hde,he->hd", self.W_q, self.b_k)[:, None, :]
        if self.b_q is not None:
            V = V + torch.einsum("hde,he->hd", self.W_k, self.b_q)[:, None, :]

        def T(G: Tensor) -> Tensor:
            return G @ U.transpose(-1, -2) + V @ G.transpose(-1, -2)

        def Tt(Z: Tensor) -> Tensor:
            return Z @ U + Z.transpose(-1, -2) @ V

        return LogitOperator(T, Tt, U, V)


@dataclass(frozen=True)
class KeptNormsMHA(DotMHA):
    """A :class:`DotMHA` whose weight-only norms ‖A_l‖ and ‖C_l‖ are computed on first use and kept,
    for a holder of its own copy of the weights that never changes them (``taylor_net`` asks for them
    at every image: 7 of the 14 product norms of a pass on the 1-block digits model). ``.to()`` and
    ``dataclasses.replace`` make a new layer, whose norms are computed anew."""

    @classmethod
    def of(cls, layer: DotMHA) -> KeptNormsMHA:
        return cls(**{f.name: getattr(layer, f.name) for f in fields(layer)})

    def _kept(self, name: str, compute) -> Tensor:
        # a frozen dataclass refuses setattr; its __dict__ takes what no field names
        if name not in self.__dict__:
            self.__dict__[name] = compute()
        return self.__dict__[name]

    def A_norm(self) -> Tensor:
        return self._kept("_A_norm", super().A_norm)

    def C_norm(self) -> Tensor:
        return self._kept("_C_norm", super().C_norm)


@dataclass(frozen=True)
class L2MHA(_Tensors):
    """L2 multi-head attention with tied keys (Kim et al. 2021), docs/bounds.md §1.2."""

    W_q: Tensor  # [h, d, d_h]; keys are tied: W^K_l = W^Q_l
    W_v: Tensor  # [h, d, d_h]
    W_o: Tensor  # [h, d_h, d]
    residual: bool = True
    kind = "l2"

    def attention(self, X: Tensor) -> Tensor:
        """``softmax_rows(−‖x_iᵀW^Q_l − x_jᵀW^Q_l‖² / √d_h)``, shape [..., h, n, n]."""
        Q = torch.einsum("...nd,hde->...hne", X, self.W_q)
        sq = (Q * Q).sum(-1)
        dist2 = sq.unsqueeze(-1) + sq.unsqueeze(-2) - 2 * Q @ Q.transpose(-1, -2)
        return torch.softmax(-dist2 / math.sqrt(self.d_h), dim=-1)

    def forward(self, X: Tensor) -> Tensor:
        # X A_l = (X W^Q_l) W^Q_lᵀ / √d_h, never forming the d×d matrix A_l
        Q = torch.einsum("...nd,hde->...hne", X, self.W_q)
        XA = torch.einsum("...hne,hde->...hnd", Q, self.W_q) / math.sqrt(self.d_h)
        V = torch.einsum("...hnd,hde->...hne", XA, self.W_v)
        out = torch.einsum("...hne,hef->...nf", self.attention(X) @ V, self.W_o)
        return out + X if self.residual else out

    __call__ = forward


@dataclass(frozen=True)
class OLSA(_Tensors):
    """The OLSA layer of Xu et al. (seed 002), docs/bounds.md §1.3."""

    W_q: Tensor  # [h, d_h, d]
    W_k: Tensor  # [h, d_h, d]
    W_v: Tensor  # [h, d_h, d]
    w_s: Tensor  # [h, d_h]
    alpha1: float
    alpha2: float
    activation: str = "relu"
    residual: bool = False
    kind = "olsa"

    @property
    def d(self) -> int:
        return self.W_q.shape[2]

    @property
    def d_h(self) -> int:
        return self.W_q.shape[1]

    def attention(self, X: Tensor) -> Tensor:
        """``p_l[i,j] = softmax_j((1/α1) w^S_l σ((W^Q_l x_i + W^K_l x_j)/2))``, shape [..., h, n, n]."""
        Q = torch.einsum("...nd,hed->...hne", X, self.W_q)
        K = torch.einsum("...nd,hed->...hne", X, self.W_k)
        pre = (Q.unsqueeze(-2) + K.unsqueeze(-3)) / 2  # [..., h, n, n, d_h]
        s = torch.einsum("...hije,he->...hij", ACTIVATIONS[self.activation](pre), self.w_s)
        return torch.softmax(s / self.alpha1, dim=-1)

    def forward(self, X: Tensor) -> Tensor:
        V = torch.einsum("...nd,hed->...hne", X, self.W_v)
        Y = (self.attention(X) @ V) / self.alpha2  # [..., h, n, d_h]
        out = Y.transpose(-3, -2).flatten(-2)  # Concat_l, head-major
        return out + X if self.residual else out

    __call__ = forward


def layer_project(X: Tensor, R: float) -> Tensor:
    """LayerProject (LoFAST eq. 29): rows with ‖x‖₂ > R are scaled to norm R, others left alone."""
    norms = X.norm(dim=-1, keepdim=True)
    return X * torch.clamp(R / norms, max=1.0)


Layer = DotMHA | L2MHA | OLSA


@dataclass(frozen=True)
class Stack:
    """N blocks, docs/bounds.md §1.4: ``X_{k+1} = f_k(Proj_R(X_k))``; ``R=None`` skips the projection."""

    blocks: tuple[Layer, ...]
    R: float | None = 1.0
    kind = "stack"

    @property
    def d(self) -> int:
        return self.blocks[0].d

    @property
    def block_kind(self) -> str:
        return self.blocks[0].kind

    def to(self, like: Tensor) -> Stack:
        return replace(self, blocks=tuple(b.to(like) for b in self.blocks))

    def project(self, X: Tensor) -> Tensor:
        return X if self.R is None else layer_project(X, self.R)

    def trajectory(self, X: Tensor) -> list[Tensor]:
        """The projected input of every block, then the output: ``[Proj(X_0), …, Proj(X_{N-1}), X_N]``."""
        states = []
        for block in self.blocks:
            X = self.project(X)
            states.append(X)
            X = block(X)
        return [*states, X]

    def forward(self, X: Tensor) -> Tensor:
        return self.trajectory(X)[-1]

    __call__ = forward

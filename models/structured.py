"""Cheaper exact forms of the two LoFAST norms, from the structure of their operators
(docs/bounds.md §2.1): the Gram matrix of ζ's Kronecker sum without the (nd)³ product, and ‖M_l‖
on the 2·d_h-dimensional subspace that its logit map actually sees.

* ζ: ``K = H⊗I_d + Σ_l P_l⊗C_lᵀ`` (row-major vec), so
  ``KᵀK = H²I + H(K + Kᵀ) + Σ_{l,m} (P_lᵀP_m)⊗(C_l C_mᵀ)``: one product of inner size h² instead
  of a product of inner size nd.
* ‖M_l‖: ``T(Γ) = Γ Uᵀ + V Γᵀ`` with ``U = K_l W^Q_lᵀ`` and ``V = Q_l W^K_lᵀ`` depends on Γ only
  through ``Γ [W^Q_l, W^K_l]``. With Q an orthonormal basis (d×r, r ≤ 2d_h) of that span,
  ``T(Γ) = T(Γ QQᵀ)`` and ``Γ ↦ ΓQ`` is an isometry of the subspace, so ‖T‖ = ‖T̃‖ for
  ``T̃(Y) = Y Ũᵀ + Ṽ Yᵀ`` on n×r matrices, ``Ũ = UQ``, ``Ṽ = VQ``. Q is computed, so it is
  orthonormal and spans the range only up to rounding: :func:`reduced_logit` returns the
  ``slack`` that makes ``‖T‖ ≤ ‖T̃‖·√(1 + η) + ρ`` rigorous (η = ‖QᵀQ − I‖_F,
  ρ = ‖U − UQQᵀ‖_F + ‖V − VQQᵀ‖_F).
* The Gram of M̃_l in the n²-dimensional output space needs only the n×n products ŨŨᵀ, ṼṼᵀ, ŨṼᵀ:
  ``(MMᵀ)[(i,j),(i',j')] = δ_ii'(ŨŨᵀ)_jj' + δ_ij'(ŨṼᵀ)_ji' + δ_ji'(ṼŨᵀ)_ij' + δ_jj'(ṼṼᵀ)_ii'``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .spectral import LinearOperator

if TYPE_CHECKING:
    from .layers import DotMHA


def zeta_gram(layer: DotMHA, X: Tensor) -> Tensor:
    """KᵀK for ζ's K = H⊗I_d + Σ_l P_l⊗C_lᵀ, as [B, nd, nd] (row-major vec, index (k, a)).

    Every term is a sum of products f[k, q]·g[a, e] at entry ((k,a),(q,e)): (P_hᵀP_g)⊗(C_hC_gᵀ), and
    for H ≠ 0 also H·K (P_l[k,q]·C_l[e,a]) and H·Kᵀ (P_l[q,k]·C_l[a,e]). So the whole Gram is one
    product of inner size h² + 2h and one reordering, then H² on the diagonal."""
    B, n, d = X.shape
    P, C, H = layer.attention(X), layer.C(), layer.H_norm
    left = [torch.einsum("bhik,bgiq->bkqhg", P, P).reshape(B, n * n, -1)]  # (P_hᵀ P_g)[k, q]
    right = [torch.einsum("hac,gec->hgae", C, C).reshape(-1, d * d)]  # (C_h C_gᵀ)[a, e]
    if H:
        left += [H * P.permute(0, 2, 3, 1).reshape(B, n * n, -1),
                 H * P.permute(0, 3, 2, 1).reshape(B, n * n, -1)]
        right += [C.transpose(-1, -2).reshape(-1, d * d), C.reshape(-1, d * d)]
    G = (torch.cat(left, -1) @ torch.cat(right, 0)).reshape(B, n, n, d, d)
    G = G.transpose(2, 3).reshape(B, n * d, n * d)
    if H:
        G.diagonal(dim1=-2, dim2=-1).add_(H * H)
    return G


@dataclass(frozen=True)
class ReducedLogit:
    U: Tensor  # [B, h, n, r], Ũ = U Q
    V: Tensor  # [B, h, n, r], Ṽ = V Q
    scale: Tensor  # [h], √(1 + η) ≥ ‖Q‖
    slack: Tensor  # [B, h], ρ: what T does off the computed subspace

    @property
    def operator(self) -> LinearOperator:
        U, V = self.U, self.V
        return LinearOperator(lambda G: G @ U.mT + V @ G.mT, lambda Z: Z @ U + Z.mT @ V)

    def bound(self, reduced_norm: Tensor) -> Tensor:
        """An upper bound of ‖M_l‖ from an upper bound of ‖T̃‖ (module docstring)."""
        return reduced_norm * self.scale + self.slack


def reduced_logit(layer: DotMHA, X: Tensor) -> ReducedLogit:
    """The logit map of every head on the span of [W^Q_l, W^K_l] (module docstring); r = min(d, 2d_h)."""
    op = layer.logit_operator(X)
    d = layer.d
    if 2 * layer.d_h >= d:  # no smaller subspace: Q = I exactly, nothing to account for
        zero = torch.zeros(op.U.shape[:2], dtype=X.dtype, device=X.device)
        return ReducedLogit(op.U, op.V, torch.ones(layer.h, dtype=X.dtype, device=X.device), zero)
    Q = torch.linalg.qr(torch.cat([layer.W_q, layer.W_k], dim=-1)).Q  # [h, d, 2d_h]
    eye = torch.eye(Q.shape[-1], dtype=X.dtype, device=X.device)
    eta = torch.linalg.matrix_norm(Q.mT @ Q - eye)
    U, V = op.U @ Q, op.V @ Q  # [B, h, n, r]
    QQ = Q @ Q.mT
    rho = torch.linalg.matrix_norm(op.U - op.U @ QQ) + torch.linalg.matrix_norm(op.V - op.V @ QQ)
    # the slack's own rounding is of the order of ρ's ulps: doubling it covers that
    return ReducedLogit(U, V, (1 + eta).sqrt(), 2 * rho)


def logit_gram(red: ReducedLogit) -> Tensor:
    """M̃_l M̃_lᵀ as [B, h, n², n²] (module docstring), index (i, j) = row i, column j of T̃(Y)."""
    U, V = red.U, red.V
    n = U.shape[-2]
    eye = torch.eye(n, dtype=U.dtype, device=U.device)
    UU, VV, UV = U @ U.mT, V @ V.mT, U @ V.mT
    G = (torch.einsum("ip,bhjq->bhijpq", eye, UU) + torch.einsum("jq,bhip->bhijpq", eye, VV)
         + torch.einsum("iq,bhjp->bhijpq", eye, UV) + torch.einsum("jp,bhqi->bhijpq", eye, UV))
    return G.reshape(*U.shape[:2], n * n, n * n)


def logit_gram_cols(red: ReducedLogit) -> Tensor:
    """M̃_lᵀM̃_l as [B, h, nr, nr], for n > r where it is the smaller Gram: index (k, a),
    ``(M̃ᵀM̃)[(k,a),(q,e)] = δ_kq(ŨᵀŨ + ṼᵀṼ)_ae + Ũ_qa Ṽ_ke + Ṽ_qa Ũ_ke``."""
    U, V = red.U, red.V
    B, h, n, r = U.shape
    eye = torch.eye(n, dtype=U.dtype, device=U.device)
    G = torch.einsum("kq,bhae->bhkaqe", eye, U.mT @ U + V.mT @ V)
    G = G + torch.einsum("bhqa,bhke->bhkaqe", U, V) + torch.einsum("bhqa,bhke->bhkaqe", V, U)
    return G.reshape(B, h, n * r, n * r)


def reduced_logit_matrix(red: ReducedLogit) -> Tensor:
    """M̃_l as [B, h, n², n·r] (row (i,j): δ_ik Ũ_ja + δ_jk Ṽ_ia), for n > r where M̃ᵀM̃ is the smaller Gram."""
    U, V = red.U, red.V
    B, h, n, r = U.shape
    eye = torch.eye(n, dtype=U.dtype, device=U.device)
    M = torch.einsum("ik,bhja->bhijka", eye, U) + torch.einsum("jk,bhia->bhijka", eye, V)
    return M.reshape(B, h, n * n, n * r)


def dot_jacobian(layer: DotMHA, X: Tensor) -> Tensor:
    """The Jacobian J_F(X) of a dot layer as [B, nd, nd] (rows: output entries, row-major), in closed
    form instead of nd backward passes (docs/bounds.md §2.3: J[Γ] = HΓ + Σ_l (P_l Γ + dP_l[Γ] X) C_l).

    With Z_l = X C_l (b_v W^O_l is a constant row, which dP_l's zero row sums cancel), the softmax
    Jacobian diag(p) − ppᵀ of row i, and ∂S_l[i,m]/∂X[k,a] = (δ_ik U_l[m,a] + δ_mk V_l[i,a])/√d_h
    (U, V of the logit operator, §1.5):

        J[(i,c),(k,a)] = H δ_ik δ_ac + Σ_l P_l[i,k] C_l[a,c]
                         + Σ_l (δ_ik (R_l[i] U_l)[c,a] + R_l[i,c,k] V_l[i,a]) / √d_h,
        R_l[i,c,m] = P_l[i,m] (Z_l[m,c] − (P_l Z_l)[i,c]).
    """
    B, n, d = X.shape
    P, C = layer.attention(X), layer.C()
    op = layer.logit_operator(X)
    Z = torch.einsum("bnd,hde->bhne", X, C)
    R = P[:, :, :, None, :] * (Z.transpose(-1, -2)[:, :, None] - (P @ Z)[..., None])  # [B,h,i,c,m]
    scale = 1 / layer.d_h**0.5
    diag = torch.einsum("bhicm,bhma->bica", R, op.U) * scale  # the δ_ik part, [B, i, c, a]
    J = torch.einsum("bhick,bhia->bicka", R, op.V) * scale
    J = J + torch.einsum("bhik,hac->bicka", P, C)
    J.diagonal(dim1=1, dim2=3).add_(diag.permute(0, 2, 3, 1))  # i = k
    J = J.reshape(B, n * d, n * d)
    if layer.H_norm:
        J.diagonal(dim1=-2, dim2=-1).add_(layer.H_norm)
    return J


def dot_jacobian_operator(layer: DotMHA, X: Tensor) -> LinearOperator:
    """J_F(X) of a dot layer and its adjoint as maps on [B, n, d], in closed form (the products of
    :func:`dot_jacobian` without forming it): with P_l, Q_l, K_l at X (biases included) and
    s = 1/√d_h,

        J[Γ]  = HΓ + Σ_l (P_l Γ W^V_l + dP_l V_l) W^O_l,  dP_l = P_l ∘ (dS − rowsum(P_l ∘ dS)),
                dS = s (Γ W^Q_l K_lᵀ + Q_l (Γ W^K_l)ᵀ),  V_l = X W^V_l;
        Jᵀ[Y] = HY + Σ_l (P_lᵀ Z_l W^V_lᵀ + s (Ē K_l W^Q_lᵀ + Ēᵀ Q_l W^K_lᵀ)),  Z_l = Y W^O_lᵀ,
                Ē = P_l ∘ (E − rowsum(P_l ∘ E)),  E = Z_l V_lᵀ

    (softmax's Jacobian diag p − ppᵀ is symmetric, so the adjoint of dS ↦ dP is the same map; a
    value bias adds a constant to each row of dS's partner, which the centring removes). Every
    head's W^Q, W^K, W^V are applied in one product, as [d, 3·h·d_h]: 2–3× faster a product than the
    double backward of ``models.operators.jacobian_operator`` on the Fashion-MNIST blocks (0.18–0.21
    against 0.58–0.65 ms a pair at one image, 0.43–0.46 against 0.91–0.94 at four), which the
    probabilistic σ̄_J repeats at each Lanczos step."""
    B, n, _ = X.shape
    h, _, e = layer.W_q.shape
    P = layer.attention(X)
    Q, K = layer.queries_keys(X)
    s = 1 / e**0.5
    Qs, Ks = Q * s, K * s
    V = torch.einsum("bnd,hde->bhne", X, layer.W_v)
    W, Wo = layer.stacked_weights()
    Wt, Wot = W.mT.contiguous(), Wo.mT.contiguous()
    H = layer.H_norm

    def centred(M: Tensor) -> Tensor:  # (diag p_i − p_i p_iᵀ) applied to every row i of M
        return P * (M - (P * M).sum(-1, keepdim=True))

    def T(G: Tensor) -> Tensor:
        g = (G @ W).reshape(B, n, 3, h, e).permute(2, 0, 3, 1, 4)  # Γ W^Q, Γ W^K, Γ W^V: [B, h, n, e]
        dP = centred(g[0] @ Ks.mT + Qs @ g[1].mT)
        out = (P @ g[2] + dP @ V).transpose(1, 2).reshape(B, n, h * e) @ Wo
        return out + H * G if H else out

    def Tt(Y: Tensor) -> Tensor:
        Z = (Y @ Wot).reshape(B, n, h, e).transpose(1, 2)  # [B, h, n, e]
        E = centred(Z @ V.mT)
        parts = torch.stack([E @ Ks, E.mT @ Qs, P.mT @ Z])  # against W^Q, W^K, W^V: [3, B, h, n, e]
        out = parts.permute(1, 3, 0, 2, 4).reshape(B, n, 3 * h * e) @ Wt
        return out + H * Y if H else out

    return LinearOperator(T, Tt)

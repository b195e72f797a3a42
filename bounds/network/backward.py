"""The backward pass of ``taylor_net`` (docs/bounds.md §5.1): lower bounds of functionals of the last
tokens, by one pass back through the logged stages to the pixels."""

from __future__ import annotations

import torch
from torch import Tensor

from .activations import gelu_bounds
from .attention import delta1_transpose, transpose_apply
from .ffn import relu_bounds
from .layernorm import NormRecord


def backward(log: list[dict], Lam: Tensor, embed: Tensor, eps: float,
             split: dict[str, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """Lower bounds of ⟨Λ_j, Δ_N⟩ for C functionals Λ [B, C, n, d] on the last tokens, by one pass
    back through the stages of ``log`` (docs/bounds.md §5.1, "the backward pass"): every smooth stage
    by its exact Jacobian (transposed) with its remainder charged at its own coefficients, every
    kink by :func:`relu_bounds` on the ranges of the forward set. Returns (bounds [B, C], the sum
    of the magnitudes of their terms, for the rounding slack); ``split`` (a dict) receives what the
    bound loses where: ``first_order``, ``kinks`` (net of the relaxations' offsets) and each stage's
    remainder by its source's name, each [B, C] (the diagnostics where this bound is the better)."""
    B, C = Lam.shape[:2]
    const = Lam.new_zeros(B, C)
    mag = Lam.new_zeros(B, C)
    if split is not None:
        split["kinks"] = Lam.new_zeros(B, C)
    skips: list[Tensor] = []  # the functionals on a residual's input, from its join to its fork
    for rec in reversed(log):
        if isinstance(rec, dict) and rec["kind"] == "join":  # out = x + branch(x): Λ reaches x both ways
            skips.append(Lam)
        elif isinstance(rec, dict) and rec["kind"] == "fork":
            # a fork whose join is not in the log (a unit inside the branch, refined) has no skip
            Lam = Lam + skips.pop() if skips else Lam
        elif isinstance(rec, NormRecord):
            Lam, charge = rec.step(Lam)
            const, mag = const - charge, mag + charge
            if split is not None:
                split[rec.name] = charge
        elif rec["kind"] == "ffn":
            g = Lam @ rec["W2"]  # [B, C, n, w]
            bounds_of = relu_bounds if rec["act"] == "relu" else gelu_bounds
            s, b = bounds_of(g, *(rec[f][:, None] for f in ("z0", "lo", "hi")))
            const = const + (g * b).sum((-1, -2))
            if split is not None:
                split["kinks"] = split["kinks"] - (g * b).sum((-1, -2))
            mag = mag + (g * b).abs().sum((-1, -2))
            Lam = Lam + (g * s) @ rec["W1"] if rec["residual"] else (g * s) @ rec["W1"]
        elif rec["kind"] == "attention":
            charge = Lam.flatten(2).norm(dim=-1) * rec["rho"][:, None]
            const, mag = const - charge, mag + charge
            if split is not None:
                split[rec["name"]] = charge
            if rec["split"] == "taylor":
                Lam = transpose_apply(rec["layer"], rec["X"], rec["J"], Lam, rec["parts"])
            else:
                Lam = delta1_transpose(rec["layer"], rec["parts"], Lam)
        elif rec["kind"] == "project":
            u = rec["u"][:, None]  # [B, 1, n, d]
            gam = -(Lam * u).sum(-1)  # the coefficient of q − q₀ (q = w or v), [B, C, n]
            s, b = relu_bounds(gam, *(rec[f][:, None] for f in ("z0", "lo", "hi")))
            on = rec["relu"][:, None]
            s, b = torch.where(on, s, 0.0), torch.where(on, b, 0.0)
            norms = Lam.norm(dim=-1)  # ‖Λ_t‖
            second = norms * rec["second"][:, None]
            # the tokens' second-order errors share the ball's budget (DeviationSet.grouped's argument)
            shared = torch.minimum(second.sum(-1), rec["budget"][:, None]
                                   * (second / rec["caps"][:, None]).amax(-1))
            charge = shared + (norms * (rec["first"] + rec["wild"])[:, None]).sum(-1)
            const = const + (gam * b).sum(-1) - charge
            if split is not None:
                split["kinks"] = split["kinks"] - (gam * b).sum(-1)
                split[rec["name"]] = charge
            mag = mag + (gam * b).abs().sum(-1) + charge
            radial = (gam * s * rec["sign"][:, None])[..., None] * u
            # L_tᵀΛ_t = base_t·(Λ_t − [tangential]·u_t(u_tᵀΛ_t)), and u_tᵀΛ_t = −γ_t
            along = (rec["tangent"][:, None] * gam)[..., None] * u
            Lam = rec["base"][:, None, :, None] * (Lam + along) + radial
        else:  # a stage this pass does not know has no backward step: crossing it as another would be unsound
            kind = rec.get("kind") if isinstance(rec, dict) else type(rec).__name__
            raise ValueError(f"backward: unknown stage record {kind!r}")
    first = eps * torch.einsum("bcnd,ndp->bcp", Lam, embed).norm(dim=-1)
    if split is not None:
        split["first_order"] = first
    return const - first, mag + first


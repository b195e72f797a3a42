"""Search for a witness that OLSA's Theorem 4.1 (Xu et al.) is not a Lipschitz bound (docs/bounds.md §3.3).

The theorem states ``Lip(F) ≤ (1/α₂)(1 + c√n/(4α₁))`` on the ball ‖X‖_F ≤ c, for an OLSA layer with
orthogonal stacked W^Q, W^K, W^V, a unit score vector w^S and a 1-Lipschitz σ. This script maximises,
jointly over an input X ∈ R^{2×4} with ‖X‖_F = c and over the weights satisfying those assumptions,

    ratio = σ_max(J_F(X)) / ((1/α₂)(1 + c√n/(4α₁)))      (n = 2, d = 4, h = 1, relu, α₁ = α₂ = 1)

where σ_max is exact: the SVD of the dense 8×8 Jacobian. A ratio above 1 at a point of the ball means
the layer's local Lipschitz constant there exceeds the theorem's constant for that ball.

The assumptions hold by construction: each weight is ``matrix_exp`` of a skew-symmetric matrix
(orthogonal), w^S and X are normalised. The search is seeded and deterministic (float64, CPU, one
thread); it prints the best ratio and the witness as Python literals (``repr`` of float64, so the
values round-trip exactly) to paste into tests/bounds/test_findings.py.

    python tools/olsa_witness_search.py [--restarts 12] [--steps 300] [--seed 0]
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch import Tensor

from models import OLSA

N, D = 2, 4
C_NORM = 32.0  # ‖X‖_F, the audit's radius; larger c makes the proof's ¼ (not ½) cost more
ALPHA1 = ALPHA2 = 1.0


def lipschitz_constant(c: float, n: int = N) -> float:
    """Theorem 4.1's constant ``(1/α₂)(1 + c√n/(4α₁))`` (bounds.lipschitz.olsa.olsa_lipschitz, as a float)."""
    return (1 + c * math.sqrt(n) / (4 * ALPHA1)) / ALPHA2


def orthogonal(raw: Tensor) -> Tensor:
    """An orthogonal D×D matrix: the exponential of the skew-symmetric part of ``raw``."""
    return torch.linalg.matrix_exp(raw - raw.transpose(-1, -2))


def unpack(params: dict[str, Tensor]) -> tuple[Tensor, OLSA]:
    """The normalised input X [N, D] and the layer, from unconstrained parameters."""
    X = C_NORM * params["X"] / params["X"].norm()
    w_s = params["w"] / params["w"].norm()
    layer = OLSA(W_q=orthogonal(params["q"])[None], W_k=orthogonal(params["k"])[None],
                 W_v=orthogonal(params["v"])[None], w_s=w_s[None], alpha1=ALPHA1, alpha2=ALPHA2,
                 activation="relu", residual=False)
    return X, layer


def jacobian(layer: OLSA, X: Tensor) -> Tensor:
    """The dense (N·D)×(N·D) Jacobian of F at X, row-major vec (docs/bounds.md notation)."""
    f = lambda v: layer(v.reshape(N, D)).reshape(-1)
    return torch.func.jacrev(f)(X.reshape(-1))


def ratio(params: dict[str, Tensor]) -> Tensor:
    X, layer = unpack(params)
    return torch.linalg.svdvals(jacobian(layer, X))[0] / lipschitz_constant(C_NORM)


def start(gen: torch.Generator, structured: bool) -> dict[str, Tensor]:
    """Random parameters; ``structured`` starts from the shape the audit described: the two tokens
    nearly opposite (which puts both logits of a row close together, attention ≈ ½–½, where the
    softmax Jacobian reaches ½ rather than the proof's ¼)."""
    p = {k: torch.randn(D, D, generator=gen, dtype=torch.float64) for k in ("q", "k", "v")}
    p["w"] = torch.randn(D, generator=gen, dtype=torch.float64)
    X = torch.randn(N, D, generator=gen, dtype=torch.float64)
    if structured:
        X[1] = -X[0] + 0.05 * torch.randn(D, generator=gen, dtype=torch.float64)
    p["X"] = X
    return p


def search(restarts: int, steps: int, seed: int, lr: float = 0.02) -> tuple[float, dict[str, Tensor]]:
    """Adam ascent on the ratio from ``restarts`` starts (half structured, half random); the best
    iterate ever seen is kept (relu makes the objective non-smooth, so the last one may be worse)."""
    gen = torch.Generator().manual_seed(seed)
    best, best_p = -math.inf, {}
    for r in range(restarts):
        p = {k: v.requires_grad_(True) for k, v in start(gen, structured=r % 2 == 0).items()}
        opt = torch.optim.Adam(p.values(), lr=lr)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
        run_best = -math.inf
        for _ in range(steps):
            value = ratio(p)
            v = float(value.detach())
            run_best = max(run_best, v)
            if v > best:
                best, best_p = v, {k: t.detach().clone() for k, t in p.items()}
            opt.zero_grad()
            (-value).backward()
            opt.step()
            sched.step()
        print(f"restart {r:2d} ({'structured' if r % 2 == 0 else 'random'}): best ratio {run_best:.6f}")
    return best, best_p


def literal(t: Tensor) -> str:
    """A nested Python list of float64 reprs: exact round trip through ``torch.tensor(…)``."""
    if t.dim() == 0:
        return repr(float(t))
    return "[" + ", ".join(literal(row) for row in t) + "]"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--restarts", type=int, default=12)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # deterministic and independent of the machine's core count
    t0 = time.perf_counter()
    best, p = search(args.restarts, args.steps, args.seed)
    with torch.no_grad():
        X, layer = unpack(p)
        J = jacobian(layer, X)
        sigma = float(torch.linalg.svdvals(J)[0])
        P = layer.attention(X)[0]
    lip = lipschitz_constant(C_NORM)
    print(f"\nbest ratio σ_max(J)/Lip = {best:.6f}  (σ_max = {sigma:.6f}, Lip(c={C_NORM:g}) = {lip:.6f})")
    print(f"attention rows: {P.tolist()}")
    print(f"search took {time.perf_counter() - t0:.1f} s\n")
    print(f"X = {literal(X)}")
    print(f"W_q = {literal(layer.W_q[0])}")
    print(f"W_k = {literal(layer.W_k[0])}")
    print(f"W_v = {literal(layer.W_v[0])}")
    print(f"w_s = {literal(layer.w_s[0])}")


if __name__ == "__main__":
    main()

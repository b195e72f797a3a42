"""Block k's LayerProject on one test image (docs/results.md, "Accurate ViTs", "Where the slack lives at
ε 0.1"): what the second pass's last backward pass charges for its errors along each margin's
functional Λ, against an attack on the true error along the same Λ, ⟨Λ, p(X + Δ) − p(X) − JΔ⟩ with Δ
the true deviation of the block's input over ‖δ‖ ≤ ε (both signs: the one that lowers the margin is
what the charge pays for). Also the token radii of the set entering it against an attack on each
token's true deviation. A lower bound from an attack, never a certificate.

    python tools/project_along.py zoo/digits-d32-b2-h2-c0.5-q1.safetensors --dataset digits \\
        --eps 0.1 --image 15 --block 1
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from radius_attack import attack, case, starts  # this script's folder is on the path as a script

from bounds.network.stages.project import ProjectRecord
from bounds.network.taylor_net import TaylorNet
from models import InputError
from models.vit import layer_project


@contextmanager
def charges_of(name: str, out: list):
    """Every (Λ, charge) the backward passes give the record ``name`` while the block runs: the step is
    wrapped for the pass alone, so the tool reads what the certificate pays without a second code path."""
    step = ProjectRecord.step

    def wrapped(self, Lam, alpha=None, phase=None):
        result = step(self, Lam, alpha, phase)
        if self.name == name:
            out.append((Lam.detach().clone(), result.charge.detach().clone()))
        return result

    ProjectRecord.step = wrapped
    try:
        yield
    finally:
        ProjectRecord.step = step


def main() -> None:
    def has_project(net, a) -> None:
        if net.blocks[a.block].R is None:
            raise InputError(f"block {a.block} has no LayerProject (a {net.cfg.variant} block)")

    a, net, images, labels = case(__doc__.splitlines()[0], eps=0.1, block=1, steps=100, check=has_project)
    x, y, k, eps = images[a.image:a.image + 1].double(), labels[a.image:a.image + 1], a.block, a.eps
    tn = TaylorNet(net, x, y)
    seen: list = []
    with charges_of(f"project{k}", seen):
        low = tn.one_pass(eps, slice(None), "taylor", refine=True)[0]
    if not seen:
        print(f"{a.model} image {a.image}: no backward pass reached project{k} (the pass stopped before)")
        return
    Lam, charge = seen[-1]  # the margins' last backward pass
    R = net.cfg.R

    def raw(z: torch.Tensor) -> torch.Tensor:  # block k's input before LayerProject
        X = net.tokens(z)
        for block in net.blocks[:k]:
            X = block(X)
        return X[0]

    clean = raw(x)
    p0 = layer_project(clean, R)
    J = torch.func.vmap(torch.func.jacrev(lambda t: layer_project(t, R)))(clean)  # [n, d, d] per token

    def error(d: torch.Tensor) -> torch.Tensor:
        D = raw(x + d) - clean
        return layer_project(clean + D, R) - p0 - torch.einsum("nde,ne->nd", J, D)

    begin = starts(raw, x, eps, 4)[0]
    others = [j for j in range(low.shape[1]) if j != int(y[0])]
    print(f"{a.model} image {a.image}, ε {eps}, project{k} (R = {R}):")
    print("  margin  charged  attacked: lowering  raising")
    for c, j in enumerate(others):
        L = Lam[0, c]
        down = attack(lambda d, L=L: -(L * error(d)).sum(), eps, begin, a.steps)
        up = attack(lambda d, L=L: (L * error(d)).sum(), eps, begin, a.steps)
        print(f"  {y[0].item()}−{j}  {float(charge[0, c]):8.4g}  {down:10.4g}  {up:8.4g}")
    print("  token radii entering it (the set's, then an attack on each token's true deviation):")
    stages = tn.stages(eps, slice(None), [], refine=True, refuse=False)
    names = [name for name, _, _ in stages]
    at = names.index(f"project{k}")
    if at:  # the set the stage reads (block 0's is the pixels' ball through the embedding)
        radii = stages[at - 1][1].token_radii(eps)[0]
        for t in range(clean.shape[0]):
            reached = attack(lambda d, t=t: (raw(x + d)[t] - clean[t]).norm(), eps, begin, a.steps)
            norm = float(clean[t].norm())
            print(f"  token {t:2d}: {float(radii[t]):.4g}  {reached:.4g}  (‖x_t‖ {norm:.4g})")


if __name__ == "__main__":
    main()

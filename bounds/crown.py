"""CROWN and α-CROWN through auto_LiRPA, the field's yardstick beside this suite's bounds
(docs/bounds.md §2.5).

CROWN (Zhang et al. 2018) bounds every output of a network by linear functions of its input,
built backwards from linear relaxations of each nonlinearity; auto_LiRPA (Xu et al. 2020) does so
for any traced PyTorch graph, softmax and the product of two perturbed matrices included, and
α-CROWN (Xu et al. 2021) optimises the relaxations' free slopes by gradient steps. Over the joint
ball ‖Γ‖_F ≤ ε on all n·d inputs (auto_LiRPA's ``PerturbationLpNorm(norm=2)`` takes the dual norm
of each output's coefficients over the whole flattened input) it gives, per output entry, an
interval [lb, ub] ∋ F(X+Γ). The change of that entry is then at most max(ub − f, f − lb) with
f = F(X), and

    crown(X, ε) = √(Σ max(ub − f, f − lb)²) ≥ δ*(X, ε).

Its certificate is ``relaxation``: sound in exact arithmetic, evaluated in float64 by auto_LiRPA
without directed rounding. auto_LiRPA is an optional dependency (the ``crown`` extra, docs/crown.md).
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
import warnings
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from models import DotMHA, InputError

from .base import radius
from .certificates import Certificate, Ledger, book

INSTALL = ("auto_LiRPA is not installed (needed by the crown and alpha_crown bounds): "
           "pip install 'attnbounds[crown]' --find-links ../shared/wheels here, elsewhere "
           "pip install --no-deps 'auto_LiRPA @ git+https://github.com/Verified-Intelligence/auto_LiRPA' "
           "(docs/crown.md)")
RELAXATION = Certificate("relaxation")


def check() -> None:
    """Raises InputError naming the install when auto_LiRPA cannot be imported."""
    lirpa_module()


def available() -> bool:
    """Whether auto_LiRPA can be imported here."""
    try:
        lirpa_module()
    except InputError:
        return False
    return True


def lirpa_module():
    try:
        # its import warns about torch.jit.script, not about us; recorded and dropped, as a module it
        # imports puts its own filter before an "ignore" of ours
        with warnings.catch_warnings(record=True), _root_logger_kept():
            import auto_LiRPA
    except ImportError:
        raise InputError(INSTALL) from None
    return auto_LiRPA


@contextlib.contextmanager
def _root_logger_kept() -> Iterator[None]:
    """auto_LiRPA's import calls ``logging.basicConfig(level=INFO)``: the root logger then prints every
    library's INFO lines on stdout (the Dask scheduler's 240 a quick run, and into ``certify --json``).
    Its level and handlers are put back as they were."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        yield
    finally:
        for handler in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(handler)
        root.setLevel(level)


class Traced(nn.Module):
    """A dot layer (docs/bounds.md §1.1, §1.5) as plain matrix products on the flattened input
    [B, n·d], the form auto_LiRPA traces; heads are a loop so that every product is 2-D.

    The row softmax is written as exp(S − s₀) / Σ exp(S − s₀) with s₀ the row maxima of S at the
    centre X, a constant (a row shift leaves softmax unchanged; it keeps exp from overflowing). Not
    ``torch.softmax``: auto_LiRPA's relaxation of that op adds 1e-8 to denominators and so moves its
    probability bounds inwards, measured 1.2e-7 relative below an attained output change on a layer
    whose attention is constant (docs/bounds.md §2.5); through exp, sum and division the bounds
    there are exact to 1e-15.
    """

    def __init__(self, layer: DotMHA, X: Tensor):
        super().__init__()
        (self.n, self.d), self.h, self.residual = X.shape, layer.h, bool(layer.residual)
        self.scale = 1 / math.sqrt(layer.d_h)
        for name in ("W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o"):
            value = getattr(layer, name)
            self.register_buffer(name, None if value is None else value.detach().clone())
        Q, K = layer.queries_keys(X)
        self.register_buffer("shift", (Q @ K.mT * self.scale).amax(-1, keepdim=True).detach())

    def forward(self, x: Tensor) -> Tensor:
        X = x.reshape(-1, self.n, self.d)
        out = None
        for head in range(self.h):
            Q, K, V = X.matmul(self.W_q[head]), X.matmul(self.W_k[head]), X.matmul(self.W_v[head])
            if self.b_q is not None:
                Q = Q + self.b_q[head]
            if self.b_k is not None:
                K = K + self.b_k[head]
            if self.b_v is not None:
                V = V + self.b_v[head]
            E = torch.exp(Q.matmul(K.transpose(1, 2)) * self.scale - self.shift[head])
            P = E / E.sum(-1, keepdim=True)
            term = P.matmul(V).matmul(self.W_o[head])
            out = term if out is None else out + term
        if self.b_o is not None:
            out = out + self.b_o
        if self.residual:
            out = out + X
        return out.reshape(x.shape[0], -1)


@contextlib.contextmanager
def float64_lirpa() -> Iterator[None]:
    """auto_LiRPA makes some of its constants in the default dtype, and a float32 constant meets
    float64 bounds with an error; so float64 is made the default while it runs, and restored. Its
    prints (``[Interval Warning] NaN detected …`` where a relaxation overflows) go to stderr: on stdout
    they came before ``certify --json``'s object and made it unreadable."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        # its optimiser's scheduler warnings are not ours either
        with warnings.catch_warnings(record=True), contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        torch.set_default_dtype(before)


def nan_as(bound: Tensor, fill: float) -> Tensor:
    """``bound`` with its NaNs (an overflow inside a relaxation: a bound of nothing) as ``fill`` and
    its ±inf kept (``torch.nan_to_num`` alone would clip them to the dtype's finite extremes)."""
    return torch.nan_to_num(bound, nan=fill, posinf=math.inf, neginf=-math.inf)


def intersect(crown_bound: Tensor, optimised: Tensor, lower: bool) -> Tensor:
    """α-CROWN's bound intersected with CROWN's, both sound: the larger lower (or smaller upper)
    bound. A NaN of the optimisation (met on the 1-block digits model) bounds nothing and is dropped,
    not carried through the maximum over CROWN's bound."""
    if lower:
        return torch.maximum(crown_bound, nan_as(optimised, -math.inf))
    return torch.minimum(crown_bound, nan_as(optimised, math.inf))


def intervals(layer: DotMHA, X: Tensor, eps, method: str) -> tuple[Tensor, Tensor, Tensor]:
    """(lb, ub, f), each [B, n·d]: auto_LiRPA's bounds on every output entry of F(X + Γ) over
    ‖Γ‖_F ≤ ε (one joint L2 ball per input), and f = F(X). ``method``: ``CROWN`` or
    ``alpha-CROWN`` (auto_LiRPA's "CROWN-Optimized", its default options: 20 Adam steps per side);
    α-CROWN's intervals are intersected with CROWN's, both being sound, so it is never looser."""
    if method not in ("CROWN", "alpha-CROWN"):
        raise ValueError(f"unknown method {method!r}")
    lirpa = lirpa_module()
    from auto_LiRPA.perturbations import PerturbationLpNorm

    B, n, d = X.shape
    X = X.to(torch.float64)
    layer = layer.to(X)
    e = radius(eps, X)
    lbs, ubs = [], []
    with float64_lirpa():
        for b in range(B):  # one ball per input, each with its own radius and centre
            x = X[b].reshape(1, n * d)
            model = Traced(layer, X[b]).to(X.device)
            bounded = lirpa.BoundedModule(model, torch.zeros_like(x), device=X.device, verbose=0)
            xb = lirpa.BoundedTensor(x, PerturbationLpNorm(norm=2, eps=float(e[b])))
            with torch.no_grad():
                lb, ub = bounded.compute_bounds(x=(xb,), method="CROWN")
            if method == "alpha-CROWN":
                with torch.enable_grad():
                    lo, up = bounded.compute_bounds(x=(xb,), method="CROWN-Optimized")
                lb, ub = intersect(lb, lo.detach(), lower=True), intersect(ub, up.detach(), lower=False)
            lbs.append(lb.detach())
            ubs.append(ub.detach())
    f = layer.forward(X).reshape(B, n * d)
    return torch.cat(lbs), torch.cat(ubs), f


def _value(layer: DotMHA, X: Tensor, eps, method: str, ledger: Ledger | None) -> Tensor:
    start = time.perf_counter()
    lb, ub, f = intervals(layer, X, eps, method)
    value = torch.maximum(ub - f, f - lb).square().sum(-1).sqrt()
    # a NaN interval (an overflow inside the relaxation) bounds nothing: report the trivial bound
    value = torch.nan_to_num(value, nan=math.inf)
    book(ledger).record(RELAXATION, time.perf_counter() - start)
    return value.to(X.dtype)


def crown(layer: DotMHA, X: Tensor, eps, *, ledger: Ledger | None = None) -> Tensor:
    """``√(Σ max(ub − f, f − lb)²)`` with CROWN's per-output bounds (Zhang et al. 2018, through
    auto_LiRPA, Xu et al. 2020) over the joint ball ‖Γ‖_F ≤ ε; docs/bounds.md §2.5. [B]."""
    return _value(layer, X, eps, "CROWN", ledger)


def alpha_crown(layer: DotMHA, X: Tensor, eps, *, ledger: Ledger | None = None) -> Tensor:
    """:func:`crown` with α-CROWN's optimised relaxations (Xu et al. 2021), intersected with
    CROWN's; docs/bounds.md §2.5. [B]."""
    return _value(layer, X, eps, "alpha-CROWN", ledger)

"""Every applicable bound and its PGD reference on one (layer, X, ε): the unit of work of both
``point`` and the runner."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

import bounds
from attacks import attack
from bounds.certificates import Certificate
from bounds.registry import PluginError
from models import InputError, Stack, as_batch, check_eps

from ..core.env import timed


@dataclass
class Evaluation:
    values: dict[str, Tensor] = field(default_factory=dict)  # [B] or [B, h], on the CPU
    certificates: dict[str, Certificate] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)  # what each bound costs on its own
    pgd: dict[str, Tensor] = field(default_factory=dict)  # objective -> [B] or [B, h]
    pgd_seconds: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # bound -> why it was not computed

    def reference(self, name: str) -> Tensor | None:
        """The PGD value a bound is compared with (its objective's), or None."""
        objective = bounds.get(name).objective
        return self.pgd.get(objective) if objective else None


def select(layer, names: list[str] | None, extra: tuple[str, ...] = ()) -> list[bounds.Bound]:
    """The bounds to run: the named ones (each must apply: InputError otherwise), else all that apply
    and the opt-in ``extra`` that apply."""
    if not names:
        return bounds.applicable(layer) + [b for b in map(bounds.get, extra) if bounds.applies(b, layer)]
    chosen = [bounds.get(n) for n in names]
    for b in chosen:
        bounds.require(b, layer)
    return chosen


def evaluate(layer, X: Tensor, eps: float, *, names: list[str] | None = None,
             extra: tuple[str, ...] = (), device: torch.device | None = None,
             dtype: torch.dtype = torch.float64,
             pgd_steps: int = 100, pgd_restarts: int = 8, seed: int = 0) -> Evaluation:
    """Bounds and PGD values of every objective they refer to, timed one by one.

    A bound that refuses this instance (InputError, e.g. the dense Jacobian above its size limit)
    is recorded in ``skipped`` when it was not asked for by name; asked for by name, it raises.
    ``extra`` names opt-in bounds computed beside the applicable ones where ``names`` is empty.
    Certified bounds compute in float64 from the float64 input whatever ``dtype`` says; estimates
    use ``dtype``, and PGD searches in it but measures its values in float64 on the same layer and
    input as the certified bounds (attacks.attack), so that they are attained whatever ``dtype``; a
    certified norm shared by several bounds is computed once, and its
    time is counted in each bound's ``seconds``, so that a bound's time is its cost on its own.
    """
    eps = check_eps(eps)
    device = device or torch.device("cpu")
    if pgd_steps < 0 or pgd_restarts < 1:
        raise InputError(f"need pgd steps >= 0 and restarts >= 1, got {pgd_steps}, {pgd_restarts}")
    X64 = as_batch(X, layer.d).to(device=device, dtype=torch.float64)
    X = X64.to(dtype)
    layer64 = layer.to(X64)
    layer = layer.to(X)
    out = Evaluation()
    chosen = select(layer, names, extra)
    norms: dict = {}  # the certified norms the bounds share (bounds.certificates.Ledger)
    for b in chosen:
        Xb, lb = (X64, layer64) if b.certified else (X, layer)
        try:
            v, s = timed(lambda b=b, Xb=Xb, lb=lb: bounds.evaluate_certified(b, lb, Xb, eps, cache=norms),
                         device)
        except InputError as e:
            if names or isinstance(e, PluginError):  # a plugin that fails is never a skip
                raise
            out.skipped[b.name] = str(e)
            continue
        except torch.linalg.LinAlgError as e:  # never a skip: the instance is what is wrong
            raise _overflow(b.name, X64, eps, str(e).splitlines()[0]) from None
        out.values[b.name] = v.value.detach().cpu().double()
        if not bool(torch.isfinite(out.values[b.name]).all()):
            raise _overflow(b.name, X64, eps, f"its value is {out.values[b.name].max().item()}")
        out.certificates[b.name] = v.certificate
        out.seconds[b.name] = s + v.reused_seconds
    objectives = ["output"] + ([] if isinstance(layer, Stack) else
                               sorted({b.objective for b in chosen if b.objective} - {"output"}))
    for obj in objectives:
        v, s = timed(lambda obj=obj: attack(layer64, X64, eps, obj, steps=pgd_steps, restarts=pgd_restarts,
                                            seed=seed, dtype=dtype), device)
        out.pgd[obj], out.pgd_seconds[obj] = v.detach().cpu().double(), s
        if not bool(torch.isfinite(out.pgd[obj]).all()):
            raise _overflow(f"PGD ({obj})", X, eps, f"its value is {out.pgd[obj].max().item()} "
                                                         f"(searched in {dtype})")
    return out


def _overflow(what: str, X: Tensor, eps: float, why: str) -> InputError:
    """A value that overflowed is refused, never printed or stored: an inf bound next to a finite
    PGD value reads as a sound but loose bound, and a NaN compares as neither."""
    norm = X.double().flatten(1).norm(dim=-1).max().item()
    return InputError(f"{what} cannot be computed at this input: {why} (max ‖X‖_F = {norm:.3g}, "
                      f"eps = {eps:g}); the input, the weights or eps are too large for floating point")

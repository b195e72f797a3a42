"""Cells: one (layer, input, ε) of a sweep, rebuilt bit-identically from its parameters alone; or one
(trained zoo model, its first test images, ε) for the whole-network tasks (docs/bounds.md §5)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
from torch import Tensor

from models import (
    InputError,
    Stack,
    check_eps,
    check_heads,
    projected_input,
    random_input,
    random_layer,
    random_stack,
)
from models.build import with_spectral_norm
from models.data import DATASETS

from .env import ROOT

KINDS = ("dot", "l2", "olsa")
INPUTS = ("gauss", "fro", "proj")
PERTURB = ("none", "W_q", "W_k", "W_v", "W_o", "X")
TASKS = ("bounds", "lofast", "totals", "scaling", "cauchy", "certify", "cauchy_model", "cost")
MODEL_TASKS = ("certify", "cauchy_model")  # the tasks that read ``model`` and ``dataset``
ZOO = ROOT / "zoo"


@dataclass(frozen=True)
class Cell:
    """A case (kind, n, d, h, H, weights, input, seed) at one ε, with what to compute on it.

    ``w_qk`` is the per-head spectral norm of W^Q and W^K, ``w_vo`` that of W^V and W^O (OLSA is
    orthogonal and ignores both). ``x = gauss``: Gaussian X rescaled to spectral norm ``x_norm``;
    ``x = fro``: the same Gaussian X rescaled to Frobenius norm ``x_norm``; ``x = proj``: Gaussian
    rows of norm about 3 through LayerProject(R = x_norm). ``samples`` inputs
    are drawn as one batch. ``perturb``/``noise`` add Gaussian noise of spectral norm ``noise`` to
    one weight family (or X), drawn with ``seed`` (LoFAST Fig. 3). ``task``: ``bounds`` (every
    bound and PGD), ``lofast`` (LoFAST and naive only), ``totals`` (the certified end-to-end
    bounds: LoFAST, its halves, naive, Taylor and best), ``scaling`` (timings of the matrix-free,
    certified and dense solvers), ``cost`` (seconds and peak memory of the certified bounds and their
    PGD, with the machine's matmul rate: bench/cost.py) or ``cauchy`` (per-block Jacobian norms of a
    stack).

    The whole-network tasks read a trained ``model`` (a file stem under zoo/), its ``dataset`` and
    its first ``samples`` test images, and ignore the layer fields: ``certify`` (every network bound
    at ε with both certification tests, and PGD on the margin) and ``cauchy_model`` (per-block
    Jacobian σ_max, clean and PGD-20 robust accuracy at ε).
    """

    kind: str = "dot"
    n: int = 16
    d: int = 64
    h: int = 4
    residual: bool = True
    w_qk: float = 1.0
    w_vo: float = 1.0
    x: str = "gauss"
    x_norm: float = 1.0
    depth: int = 1
    R: float = 1.0
    eps: float = 0.05
    perturb: str = "none"
    noise: float = 0.0
    samples: int = 1
    seed: int = 0
    task: str = "bounds"
    model: str = ""
    dataset: str = "digits"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InputError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.x not in INPUTS:
            raise InputError(f"x must be one of {INPUTS}, got {self.x!r}")
        if self.perturb not in PERTURB:
            raise InputError(f"perturb must be one of {PERTURB}, got {self.perturb!r}")
        if self.task not in TASKS:
            raise InputError(f"task must be one of {TASKS}, got {self.task!r}")
        check_heads(self.d, self.h)
        check_eps(self.eps)
        for name in ("n", "depth", "samples"):
            if getattr(self, name) < 1:
                raise InputError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("w_qk", "w_vo", "x_norm", "R"):
            v = getattr(self, name)
            if not math.isfinite(v) or v <= 0:
                raise InputError(f"{name} must be finite and > 0, got {v}")
        if not math.isfinite(self.noise) or self.noise < 0:
            raise InputError(f"noise must be finite and >= 0, got {self.noise}")
        self._check_model()

    def _check_model(self) -> None:
        """A model cell names a zoo file with its card, trained on the cell's dataset, with at least
        ``samples`` test images; any other cell names none (checked before a run writes anything)."""
        if self.dataset not in DATASETS:
            raise InputError(f"dataset must be one of {tuple(DATASETS)}, got {self.dataset!r}")
        if (self.task in MODEL_TASKS) != bool(self.model):
            raise InputError(f"the tasks {MODEL_TASKS} need a model and no other task takes one "
                             f"(task {self.task!r}, model {self.model!r})")
        if not self.model and self.dataset == "digits":
            return
        if not self.model:
            raise InputError(f"dataset is read only by the tasks {MODEL_TASKS}")
        if any(ch in self.model for ch in ",=[]/\\:") or self.model.startswith("."):
            raise InputError(f"model must be a file stem under zoo/, got {self.model!r}")
        card = self.model_path.with_suffix(".json")
        if not (self.model_path.is_file() and card.is_file()):
            raise InputError(f"model {self.model!r}: no {self.model_path.name} with its card in {ZOO}")
        try:
            info = json.loads(card.read_text())
        except (OSError, ValueError) as e:
            raise InputError(f"model {self.model!r}: unreadable card ({e})") from None
        if info.get("dataset") != self.dataset:
            raise InputError(f"model {self.model!r} was trained on {info.get('dataset')!r}, not "
                             f"{self.dataset!r}")
        if self.samples > int(info.get("n_test", 0)):
            raise InputError(f"model {self.model!r}: {self.dataset} has {info.get('n_test')} test "
                             f"images, fewer than samples = {self.samples}")

    @property
    def model_path(self) -> Path:
        return ZOO / f"{self.model}.safetensors"

    @property
    def id(self) -> str:
        """``dot[n=16,d=64,h=4,H=I,wqk=1,wvo=1,x=gauss:1,depth=1,eps=0.05,seed=0]``, plus the
        non-default extras (perturbation, samples, task, model, dataset)."""
        parts = [f"n={self.n}", f"d={self.d}", f"h={self.h}", f"H={'I' if self.residual else '0'}",
                 f"wqk={_num(self.w_qk)}", f"wvo={_num(self.w_vo)}", f"x={self.x}:{_num(self.x_norm)}",
                 f"depth={self.depth}"]
        if self.depth > 1:
            parts.append(f"R={_num(self.R)}")
        parts += [f"eps={_num(self.eps)}", f"seed={self.seed}"]
        if self.perturb != "none":
            parts.append(f"perturb={self.perturb}:{_num(self.noise)}")
        if self.samples != 1:
            parts.append(f"samples={self.samples}")
        if self.task != "bounds":
            parts.append(f"task={self.task}")
        if self.model:
            parts.append(f"model={self.model}")
        if self.dataset != "digits":
            parts.append(f"dataset={self.dataset}")
        return f"{self.kind}[{','.join(parts)}]"

    @classmethod
    def from_id(cls, cell_id: str) -> Cell:
        """The cell an id names: ``Cell.from_id(c.id) == c`` for every cell."""
        try:
            kind, rest = cell_id.split("[", 1)
            items = dict(p.split("=", 1) for p in rest.rstrip("]").split(","))
            x, x_norm = items.pop("x").split(":")
            kw = {"kind": kind, "n": int(items.pop("n")), "d": int(items.pop("d")),
                  "h": int(items.pop("h")), "residual": items.pop("H") == "I",
                  "w_qk": float(items.pop("wqk")), "w_vo": float(items.pop("wvo")), "x": x,
                  "x_norm": float(x_norm), "depth": int(items.pop("depth")),
                  "eps": float(items.pop("eps")), "seed": int(items.pop("seed"))}
            if "R" in items:
                kw["R"] = float(items.pop("R"))
            if "perturb" in items:
                target, noise = items.pop("perturb").split(":")
                kw.update(perturb=target, noise=float(noise))
            if "samples" in items:
                kw["samples"] = int(items.pop("samples"))
            for key in ("task", "model", "dataset"):
                if key in items:
                    kw[key] = items.pop(key)
        except (ValueError, KeyError):
            raise InputError(f"not a cell id: {cell_id!r}") from None
        if items:
            raise InputError(f"not a cell id: {cell_id!r} (unknown keys {sorted(items)})")
        return cls(**kw)

    def params(self) -> dict:
        return asdict(self)

    def network(self):
        """(ViT, card, the first ``samples`` test images [B, H, W], their labels) of a model cell."""
        from .accuracy import first_test_images, load_model  # torch-heavy; only model cells need it

        net, card = load_model(self.model_path)
        return (net, card, *first_test_images(self.dataset, net, self.samples))

    def build(self):
        """(layer or stack, X [samples, n, d]) in float64 on the CPU, the same bits on every call."""
        c = self.x_norm  # sets OLSA's default alpha2; its bound re-takes c = ‖X‖_F + ε per input
        kw = {"weight_norm": 1.0, "residual": self.residual, "n": self.n, "c": c}
        if self.depth == 1:
            layer = random_layer(self.kind, self.d, self.h, seed=self.seed, **kw)
        else:
            layer = random_stack(self.kind, self.depth, self.d, self.h, seed=self.seed, R=self.R, **kw)
        layer = _scale(layer, self)
        if self.x in ("gauss", "fro"):
            X = random_input(self.n, self.d, norm=self.x_norm, seed=self.seed + 10_000,
                             batch=self.samples)
            if self.x == "fro":  # the same draw, so a gauss and a fro cell differ by a scale only
                X = X * (self.x_norm / X.flatten(1).norm(dim=-1))[:, None, None]
        else:
            X = projected_input(self.n, self.d, R=self.x_norm, seed=self.seed + 10_000,
                                batch=self.samples)
        if self.perturb == "X":
            X = X + _noise(X.shape, self.noise, self.seed + 20_000)
        return layer, X


def _num(v: float) -> str:
    """The shortest text that reads back as the same float (0.05, 1, 1e-05)."""
    return repr(float(v)).removesuffix(".0")


def _noise(shape: tuple[int, ...], norm: float, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return with_spectral_norm(torch.randn(*shape, generator=g, dtype=torch.float64), norm)


def _scale(layer, cell: Cell):
    """Sets the per-head weight norms of the cell and adds its weight perturbation."""
    if isinstance(layer, Stack):
        return replace(layer, blocks=tuple(_scale(b, cell) for b in layer.blocks))
    if layer.kind == "olsa":
        return layer  # orthogonal by construction; the theorem needs it so
    new = {}
    for f in fields(layer):
        W = getattr(layer, f.name)
        if not isinstance(W, Tensor):
            continue
        W = with_spectral_norm(W, cell.w_qk if f.name in ("W_q", "W_k") else cell.w_vo)
        if f.name == cell.perturb:
            W = W + _noise(tuple(W.shape), cell.noise, cell.seed + 20_000)
        new[f.name] = W
    return replace(layer, **new)

"""What a cell computes, by its ``task``: a dict from task name to a function returning rows
(as auto_LiRPA's ``bound_op_map``), so that the runner is only the run loop."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from attacks.margin import attack_margin
from bounds import jacobian as jac
from bounds import lofast as lf
from bounds.network import check_network, default_bounds, network_bounds
from bounds.network.netcrown import BatchStore
from bounds.registry import CASCADE, CASCADE_FIRST, TAYLOR_NET, unavailable
from bounds.taylor import sigma_J
from models import InputError, Stack
from models.operators import DENSE_LIMIT, jacobian_lanczos, jacobian_matrix
from models.spectral import spectral
from models.vit import ViT

from ..core.env import timed
from ..nets.accuracy import block_sigmas, load_model, run_certify
from . import imported as import_dirs
from .cases import Cell, ImportedCell, LayerCell, ModelCell, NetworkFileCell, PretrainedCell
from .cost import cost_task
from .evaluate import evaluate
from .rows import (
    accuracy_rows,
    imported_rows,
    measured,
    network_rows,
    pretrained_rows,
    unroll,
    with_file,
    with_model,
)

LOFAST_ONLY = ["lofast_M", "lofast_xi", "lofast_M_half", "lofast_xi_half", "naive"]
CAUCHY_PGD_STEPS = 20  # the Cauchy paper's Table 1 reports PGD-20 robust accuracy
TOTALS = [*LOFAST_ONLY, "taylor", "best"]
# CROWN beside this suite's bounds (docs/bounds.md §2.5); α-CROWN costs minutes at n=16, d=32 on a CPU
CROWN_TASKS = {"crown": ["crown", "taylor", "lofast_xi", "best"],
               "alpha_crown": ["crown", "alpha_crown", "taylor", "lofast_xi", "best"],
               # whole-network CROWN beside every network bound, and LoFAST Table 2's cascade
               "certify_crown": ["crown", CASCADE], "certify_alpha_crown": ["crown", "alpha_crown", CASCADE],
               "crown_cascade": ["crown", CASCADE],
               # a network file's: CROWN beside its network bounds (naive, the cascade's first, does not
               # take a standard ViT)
               "certify_file_crown": ["crown"]}
# a task whose network bounds are only those its cascades start from (bounds.registry: CASCADE_FIRST
# and TAYLOR_NET), for CROWN on a subset of the images a `certify` sweep certifies with every bound
FIRSTS_ONLY = {"crown_cascade": [CASCADE_FIRST, TAYLOR_NET]}

Task = Callable[[Cell, dict, torch.device, torch.dtype], list[dict]]
# attention's Taylor remainder against an attack on the remainder itself, the one taylor pays beside
# §2.3's global one (docs/bounds.md §2.3.1–2.3.2): on trained and pretrained layers, where sharp
# attention makes the remainder the gap (the attack costs several of the others: not on random layers)
REMAINDER = ("taylor_remainder", "taylor_remainder_global")


def bounds_task(cell: LayerCell, run: dict, device: torch.device, dtype: torch.dtype,
                names: list[str] | None = None) -> list[dict]:
    """Every applicable bound (or ``names``) and the PGD value of each objective they refer to."""
    layer, X = cell.build()
    extra = REMAINDER if cell.model else ()
    ev = evaluate(layer, X, cell.eps, names=names, extra=extra, device=device, dtype=dtype,
                  pgd_steps=run["pgd_steps"], pgd_restarts=run["pgd_restarts"], seed=run["seed"])
    return unroll(ev)


def lofast_task(cell: LayerCell, run: dict, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """LoFAST's totals and naive only (the ablation of LoFAST Fig. 3)."""
    return bounds_task(cell, run, device, dtype, names=LOFAST_ONLY)


def totals_task(cell: LayerCell, run: dict, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """The certified end-to-end bounds of a dot layer: where each wins along ε (docs/bounds.md §2.3)."""
    return bounds_task(cell, run, device, dtype, names=TOTALS)


def crown_task(cell: LayerCell, run: dict, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """CROWN (and α-CROWN for task ``alpha_crown``) beside Taylor, LoFAST (ξ) and best; without
    auto_LiRPA the CROWN rows are left out (the runner says so once)."""
    names = CROWN_TASKS[cell.task]
    missing = unavailable()
    names = [n for n in names if n not in missing]
    return bounds_task(cell, run, device, dtype, names=names)


def _on(cell: LayerCell, device: torch.device, dtype: torch.dtype):
    layer, X = cell.build()
    X = X.to(device=device, dtype=dtype)
    return layer.to(X), X


def _time(rows: list, name: str, fn, device: torch.device, role: str = "timing",
          block: int = -1, certificate: str = "estimate") -> None:
    values, seconds = timed(fn, device)
    rows += measured(role, name, values, seconds, block, certificate)


def scaling_task(cell: LayerCell, run: dict, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Seconds of each way to get ζ, ‖M_l‖ and σ_max(J): the restarted-Lanczos estimate, the
    probabilistic certificate (docs/bounds.md §2.4, in float64) and, where they fit, the dense SVD."""
    layer, X = _on(cell, device, dtype)
    rows: list[dict] = []
    dense = not isinstance(layer, Stack) and cell.n * cell.d <= DENSE_LIMIT
    X64, layer64 = X.to(torch.float64), layer.to(X.to(torch.float64))
    if layer.kind == "dot":
        _time(rows, "zeta_lanczos", lambda: lf.zeta(layer, X, method="lanczos"), device)
        _time(rows, "M_lanczos", lambda: lf.m_norms(layer, X, method="lanczos"), device)
        _time(rows, "zeta_probabilistic", lambda: lf.zeta(layer64, X64, method="probabilistic"),
              device, certificate="probabilistic")
        _time(rows, "M_probabilistic", lambda: lf.m_norms(layer64, X64, method="probabilistic"),
              device, certificate="probabilistic")
        if dense:
            _time(rows, "zeta_dense", lambda: lf.zeta(layer64, X64, method="dense"), device,
                  certificate="exact")
            _time(rows, "M_dense", lambda: lf.m_norms(layer64, X64, method="dense"), device,
                  certificate="exact")
    _time(rows, "jacobian_lanczos", lambda: jacobian_lanczos(layer.forward, X).sigma, device)
    if not isinstance(layer, Stack):
        _time(rows, "jacobian_probabilistic", lambda: sigma_J(layer64, X64, probabilistic=True),
              device, certificate="probabilistic")
    if dense:
        _time(rows, "jacobian_dense", lambda: jac.sigma_exact(layer64, X64), device,
              certificate="exact")
    return rows


def cauchy_task(cell: LayerCell, run: dict, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Per block k of a stack: σ_max(J_{f_k}(X_k)) (matrix-free, and exact where it fits) and the
    surrogate √(‖J‖₁‖J‖∞), the Cauchy view's per-layer quantities (docs/bounds.md §3.4)."""
    stack, X = _on(cell, device, dtype)
    if not isinstance(stack, Stack):
        stack = Stack((stack,), R=None)
    rows: list[dict] = []
    for k, (block, Xk) in enumerate(zip(stack.blocks, stack.trajectory(X), strict=False)):
        f = block.forward
        _time(rows, "block_sigma", lambda f=f, x=Xk: jacobian_lanczos(f, x).sigma, device,
              "block", k)
        if cell.n * cell.d <= DENSE_LIMIT:
            _time(rows, "block_sigma_exact",
                  lambda f=f, x=Xk: spectral(jacobian_matrix(f, x)), device, "block", k, "exact")
            _time(rows, "block_l1linf", lambda b=block, x=Xk: jac.jacobian_l1linf(b, x, 1.0), device,
                  "block", k)
    return rows


class CertifyMemo:
    """The certified norms of the last certify cell's network and images, for the next cell at another
    ε (a sweep's cells are the product of its axes in the order written, so ε varies fastest when it
    comes after model): the norms do not depend on ε, and each bound's seconds still count them. Owned
    by whoever runs cells one after another: the runner in a serial run, each Dask worker for the
    chains of cells it is given (bench/sweep/distributed.py); passed to :func:`run_cell`."""

    def __init__(self, store: BatchStore | None = None) -> None:
        self.key: tuple | None = None
        self.memo: dict = {}
        # where CROWN's bounds are kept batch by batch (bench/core/partial.py), so that a cell cut
        # short resumes where it stopped; None: nowhere
        self.store = store

    def for_key(self, key: tuple) -> dict:
        """The memo of ``key`` (a network file, its images, the device): the one held if the last
        cell had that key, else a fresh one in its place (the last network's norms are dropped)."""
        if self.key != key:
            self.key, self.memo = key, {}
        return self.memo


def memo_group(cell: Cell) -> tuple | None:
    """What the cells that can share a :class:`CertifyMemo` have in common (the model, its images and
    the dataset; None for a cell of another task): on Dask they run one after another on one worker
    (bench/sweep/distributed.py), as they do in a serial run."""
    if cell.task not in MEMO_TASKS:
        return None
    if isinstance(cell, NetworkFileCell):
        return cell.network_sha256, cell.data_sha256, cell.mean, cell.std, cell.samples
    return cell.model, cell.dataset, cell.samples


def certify_names(task: str, net: ViT) -> tuple[list[str] | None, bool]:
    """The network bounds a model cell of ``task`` runs on ``net`` (None: every one that takes it),
    and whether the cascades run. Without auto_LiRPA a CROWN task's are the certify task's (the
    runner prints a note). On a vanilla or standard ViT the bounds are those that take it, and the
    cascade is taylor_net's alone (bounds.network.check_network)."""
    if task not in CROWN_TASKS:
        return None, False
    extra = [n for n in CROWN_TASKS[task] if n not in unavailable()]
    takes = {b.name for b in default_bounds(net)}
    first = [n for n in FIRSTS_ONLY.get(task, [b.name for b in network_bounds()]) if n in takes]
    return first + [n for n in extra if n != CASCADE], CASCADE in extra


def check_model_cells(cells: list[Cell]) -> None:
    """Refuses, before any cell runs, a model cell whose task cannot certify its model (a stage
    taylor_net has no rule for, a bound named that does not take it): reads each model's card and
    weights once, not its data."""
    seen = set()
    for cell in cells:
        if not isinstance(cell, ModelCell) or cell.task not in MEMO_TASKS or (cell.model, cell.task) in seen:
            continue
        seen.add((cell.model, cell.task))
        net, _ = load_model(cell.model_path)
        try:
            check_network(net, *certify_names(cell.task, net))
        except InputError as e:
            raise InputError(f"{cell.model} ({cell.task}): {e}") from None


def certify_task(cell: ModelCell, run: dict, device: torch.device, dtype: torch.dtype,
                 memo: CertifyMemo | None = None) -> list[dict]:
    """A zoo model's first test images at the cell's ε: every network bound with both certification
    tests, and PGD on the margin (docs/bounds.md §5); tasks ``certify_crown`` and
    ``certify_alpha_crown`` add whole-network CROWN (and α-CROWN) and the cascade. Certified values
    are float64 whatever ``dtype``; the margin attack searches in ``dtype`` and measures in float64.
    ``memo``: the norms of the previous cell, shared where it had this cell's network and images
    (None: nothing shared)."""
    net, card, images, labels = cell.network()
    stat = os.stat(cell.model_path)
    key = (os.path.realpath(cell.model_path), stat.st_mtime_ns, stat.st_size, cell.dataset,
           cell.samples, str(device))
    memo = CertifyMemo() if memo is None else memo
    held = memo.for_key(key)
    names, cascade = certify_names(cell.task, net)
    res = run_certify(net, images, labels, [cell.eps], names, steps=run["pgd_steps"],
                      restarts=run["pgd_restarts"], seed=run["seed"], device=device,
                      memo=held, cascade=cascade, dtype=dtype, store=memo.store)
    return with_model(network_rows(res), card)


def certify_file_task(cell: NetworkFileCell, run: dict, device: torch.device, dtype: torch.dtype,
                      memo: CertifyMemo | None = None) -> list[dict]:
    """A user's ViT from a file (ONNX, torch.export) on the first images of its data file: as
    :func:`certify_task`, every network bound that takes it (``certify_file_crown``: with CROWN beside,
    where auto_LiRPA is installed), PGD on the margin and the accuracies; the rows
    say the files' hashes, the normalization and how well the recovered network reproduces the
    runtime's logits (``max_rel_err``)."""
    net, card, images, labels = cell.load()
    memo = CertifyMemo() if memo is None else memo
    held = memo.for_key((*memo_group(cell), str(device)))
    extra = [n for n in CROWN_TASKS.get(cell.task, []) if n not in unavailable()]
    names = [b.name for b in default_bounds(net)] + extra if extra else None
    res = run_certify(net, images, labels, [cell.eps], names, steps=run["pgd_steps"],
                      restarts=run["pgd_restarts"], seed=run["seed"], device=device, memo=held, dtype=dtype,
                      store=memo.store)
    return with_file(network_rows(res), card, net.cfg.to_dict(), cell.file_columns())


def cauchy_model_task(cell: ModelCell, run: dict, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """The Cauchy paper's Table 1 and violin for a zoo model (vanilla or lofast) over its first test
    images: per block k the σ_max of the block's Jacobian at the block's input (exact where
    n·d ≤ DENSE_LIMIT, docs/bounds.md §3.4), clean accuracy and PGD-20 robust accuracy at ε."""
    net, card, images, labels = cell.network()
    net, images, labels = net.to(device), images.to(device), labels.to(device)
    sigmas, seconds, kind = block_sigmas(net, images)
    rows: list[dict] = []
    for k, (values, s) in enumerate(zip(sigmas, seconds, strict=True)):
        name = "block_sigma_exact" if kind == "exact" else "block_sigma"
        rows += measured("block", name, values, s, k, kind)
    attack = attack_margin(net, images, labels, cell.eps, steps=CAUCHY_PGD_STEPS,
                           restarts=run["pgd_restarts"], seed=run["seed"], dtype=dtype)
    with torch.no_grad():
        correct = net(images).argmax(-1) == labels
    return with_model(rows + accuracy_rows(correct.cpu(), attack.broken.cpu(), CAUCHY_PGD_STEPS), card)


def attention_entropy(P: torch.Tensor) -> float:
    """Mean over heads and query tokens of −Σ_j p_ij ln p_ij (nats; 0·ln 0 = 0), of P [..., n, n]."""
    return float(-(P * torch.log(P.clamp_min(torch.finfo(P.dtype).tiny))).sum(-1).mean())


def _at_relative_radius(cell: Cell, run: dict, device: torch.device, dtype: torch.dtype):
    """A layer with its one input (a pretrained or imported cell): every bound and PGD at radius
    ``cell.eps`` × the median token norm, with ‖X‖_F, that norm and the mean attention entropy;
    returns (the evaluation, X, the radius, those quantities)."""
    layer, X = cell.build()
    tokens = X[0].norm(dim=-1)
    radius = cell.eps * float(tokens.median())
    ev = evaluate(layer, X, radius, extra=REMAINDER, device=device, dtype=dtype, pgd_steps=run["pgd_steps"],
                  pgd_restarts=run["pgd_restarts"], seed=run["seed"])
    quantities = {"x_fro": float(X.norm()), "median_token_norm": float(tokens.median()),
                  "attention_entropy": attention_entropy(layer.attention(X))}
    return ev, X, radius, quantities


def pretrained_task(cell: PretrainedCell, run: dict, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """One attention sub-layer of all-MiniLM-L6-v2 at a real sentence (docs/bounds.md §1.6): every
    bound that applies to a layer with biases and PGD at radius ε = ``cell.eps`` × the median token
    norm ‖x_i‖ (so one relative ε means the same across layers, whose input norms differ), with
    ‖X‖_F, the median token norm and the mean attention entropy of the layer at that input."""
    from models.pretrained import model_version  # the extras: only this task needs them

    ev, X, radius, quantities = _at_relative_radius(cell, run, device, dtype)
    columns = {"model_version": model_version(), "tokens": X.shape[1], "radius": radius}
    return pretrained_rows(ev, cell.layer_index, quantities, columns)


def imported_task(cell: ImportedCell, run: dict, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """One attention layer of a user's model, as ``python -m bench import`` wrote it, at one of its
    captured inputs (docs/guide/import.md): as :func:`pretrained_task`, every bound that applies to a
    layer with biases and PGD at radius ε = ``cell.eps`` × the median token norm ‖x_i‖ (the model's
    layers see inputs of unrelated scales: a LayerNorm's output, a residual stream), with ‖X‖_F, the
    median token norm and the mean attention entropy of the layer at that input."""
    ev, _, radius, quantities = _at_relative_radius(cell, run, device, dtype)
    node = import_dirs.entry(cell.imported, cell.imported_layer)["node"]
    return imported_rows(ev, cell.imported_layer, quantities, {"radius": radius, "imported_node": node})


TASKS: dict[str, Task] = {"bounds": bounds_task, "lofast": lofast_task, "totals": totals_task,
                          "scaling": scaling_task, "cauchy": cauchy_task, "certify": certify_task,
                          "cauchy_model": cauchy_model_task, "pretrained": pretrained_task,
                          "imported": imported_task,
                          "cost": cost_task, "crown": crown_task, "alpha_crown": crown_task,
                          "certify_crown": certify_task, "certify_alpha_crown": certify_task,
                          "crown_cascade": certify_task,
                          "certify_file": certify_file_task, "certify_file_crown": certify_file_task}
# the tasks whose cells share a CertifyMemo (memo_group)
MEMO_TASKS = tuple(name for name, task in TASKS.items() if task in (certify_task, certify_file_task))


def run_cell(cell: Cell, run: dict, device: torch.device, dtype: torch.dtype,
             memo: CertifyMemo | None = None) -> list[dict]:
    """A cell's rows, by its task (:data:`TASKS`); a certify cell (:data:`MEMO_TASKS`) also takes
    ``memo``, the :class:`CertifyMemo` of whoever runs it and the cells before it."""
    task = TASKS[cell.task]
    if cell.task in MEMO_TASKS:
        return task(cell, run, device, dtype, memo)
    return task(cell, run, device, dtype)

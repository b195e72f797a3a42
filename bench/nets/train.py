"""``python -m bench train``: a tiny ViT (models/vit.py) on bundled data, saved with its card.

Training is deterministic for a seed on the CPU: the initialisation comes from ``torch.manual_seed``,
the batch order from its own ``torch.Generator``, and torch's deterministic algorithms are on, so a
card's command retrains bit-identical weights on the same machine and torch build (and thread count,
which the card records).
"""

from __future__ import annotations

import math
import os
import shlex
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils import parametrize
from tqdm import tqdm

from models import InputError
from models.data import load_dataset
from models.vit import ViT, ViTConfig

from .. import __version__
from ..core.env import ROOT, cpu_kernels, device_name, git_state, resolve_device

# Per dataset: patch side (digits 8×8 → 16 tokens of 2×2; fashion-mnist 28×28 → 49 tokens of 4×4)
# and epochs that reach the accuracy the zoo reports.
DEFAULTS = {"digits": {"patch": 2, "epochs": 60}, "fashion-mnist": {"patch": 4, "epochs": 10}}
BATCH_SIZE, LR = 64, 1e-2
# Behind LayerProject (R = 1) the pooled features have norm ≲ 1, so the head needs entries of ~10 to
# give confident logits; Adam moves each weight by ~lr a step, and at the common lr the head is the
# bottleneck (digits: 89% instead of 97% test accuracy at 60 epochs, c = 0.5).
HEAD_LR_SCALE = 10.0


def model_name(dataset: str, cfg: ViTConfig, margin_eps: float = 0.0) -> str:
    """``digits-d32-b2-h2-c0.5``, then ``-q1`` for a cap on the logit weights and ``-m0.003`` for
    Lipschitz-margin training; vanilla models end in ``-vanilla`` instead of the caps."""
    tail = "vanilla" if cfg.variant == "vanilla" else f"c{cfg.constraint if cfg.constraint else 'none'}"
    if cfg.variant == "standard":  # caps optional: named after the variant, then any cap it has
        tail = "standard" + (f"-c{cfg.constraint:g}" if cfg.constraint else "")
    if cfg.qk_constraint is not None:
        tail += f"-q{cfg.qk_constraint:g}"
    if margin_eps:
        tail += f"-m{margin_eps:g}"
    if cfg.activation != "relu":
        tail += f"-{cfg.activation.replace('_', '-')}"
    if cfg.variant == "standard":  # the options a card without them lacks, in the name only where set
        tail += "-bn" * (cfg.norm == "batch") + "-mean" * (cfg.pool == "mean") + "-bias" * cfg.bias
    return f"{dataset}-d{cfg.d}-b{cfg.depth}-h{cfg.heads}-{tail}"


@contextmanager
def deterministic(device: torch.device):
    """torch's deterministic algorithms for the duration (warn-only on CUDA, where a few kernels have
    none), then the caller's setting back."""
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it to be reproducible
    torch.use_deterministic_algorithms(True, warn_only=device.type == "cuda")
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def lipschitz_surrogate(net: ViT) -> Tensor:
    """A differentiable stand-in for the features' Lipschitz constant over the image, for training
    only (it certifies nothing): ``‖E‖ · pool · Π_k Lip(FFN_k) · (1 + Σ_h ‖W^V_h‖‖W^O_h‖(1 +
    2R²‖W^Q_h W^K_hᵀ‖/√d_h))``, the attention factor being the shape of LoFAST's ζ and ‖M_l‖ terms
    for tokens of norm ≤ R (docs/bounds.md §2)."""
    norm = lambda W: torch.linalg.matrix_norm(W, ord=2)
    R = net.cfg.R
    L = norm(net.embed.weight) * net.pool_lipschitz
    for block in net.blocks:
        a = block.attn
        logits = norm(a.W_q @ a.W_k.transpose(-1, -2)) / math.sqrt(a.W_q.shape[-1])
        L = L * (1 + (norm(a.W_v) * norm(a.W_o) * (1 + 2 * R * R * logits)).sum())
        L = L * (1 + norm(block.ffn.up.weight) * norm(block.ffn.down.weight))
    return L


def margin_loss(net: ViT, X: Tensor, y: Tensor, margin_eps: float) -> Tensor:
    """Cross-entropy on Lipschitz-margin logits (Tsuzuku et al. 2018, pairwise form): every wrong
    logit j is raised by ``margin_eps · L · ‖w_y − w_j‖``, what it could gain in an ℓ2 ball of
    radius margin_eps if the features were L-Lipschitz (docs/bounds.md §5's pairwise test)."""
    logits = net(X)
    if margin_eps == 0:
        return F.cross_entropy(logits, y)
    W = net.head.weight
    gaps = torch.linalg.vector_norm(W[y][:, None, :] - W[None], dim=-1)  # [B, C], 0 at j = y
    return F.cross_entropy(logits + margin_eps * lipschitz_surrogate(net) * gaps, y)


@torch.no_grad()
def accuracy(net: ViT, X: Tensor, y: Tensor, batch: int = 2048) -> float:
    net.eval()
    with parametrize.cached():  # one SVD per capped tensor, not one per batch
        hits = sum(int((net(X[i:i + batch]).argmax(-1) == y[i:i + batch]).sum())
                   for i in range(0, len(X), batch))
    return hits / len(X)


def checkpoint_path(out: str | Path) -> Path:
    """Where a training run into ``out`` keeps its state between epochs: ``<out>.ckpt`` beside it."""
    out = Path(out)
    return out.with_name(out.name + ".ckpt")


def _save_state(path: Path, state: dict) -> None:
    """torch.save through a temporary file and a rename: an interrupted save leaves the previous
    epoch's checkpoint whole."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)


def _resume(path: Path | None, recipe: dict) -> dict | None:
    """The state of an interrupted run of the same recipe, or None; a checkpoint of another recipe is
    refused by name (resuming it would train a model the card does not describe)."""
    if path is None or not path.exists():
        return None
    try:
        state = torch.load(path, weights_only=False)
    except Exception as e:  # a truncated or foreign file: say which, never train from it
        raise InputError(f"checkpoint {path} cannot be read ({type(e).__name__}); remove it to "
                         f"start over") from None
    if state.get("recipe") != recipe:
        diff = sorted(k for k in recipe if state.get("recipe", {}).get(k) != recipe[k])
        raise InputError(f"checkpoint {path} is of another recipe (differs in {', '.join(diff)}); "
                         f"remove it to start over, or train with its recipe")
    return state


def train(cfg: ViTConfig, dataset: str, *, seed: int = 0, epochs: int = 30, batch_size: int = BATCH_SIZE,
          lr: float = LR, head_lr_scale: float = HEAD_LR_SCALE, margin_eps: float = 0.0,
          device: str = "cpu", progress: bool = True,
          checkpoint: str | Path | None = None) -> tuple[ViT, dict]:
    """Adam with a cosine schedule on the cross-entropy, in float64 (the weights certified later are
    exactly the trained ones; these networks are small enough that float64 costs little). Returns the
    network (eval mode) and its card (without the file fields that ``save_vit`` adds).

    With ``checkpoint``, the whole state (weights, optimizer, schedule, batch order, per-epoch test
    accuracy) is saved there after every epoch and a run of the same recipe resumes from it, with
    the bits an uninterrupted run would have; the file is removed once training ends."""
    for name, v in (("epochs", epochs), ("batch size", batch_size)):
        if v < 1:
            raise InputError(f"{name} must be at least 1, got {v}")
    if seed < 0:
        raise InputError(f"seed must be >= 0, got {seed}")
    for name, v in (("lr", lr), ("head lr scale", head_lr_scale)):
        if not (math.isfinite(v) and v > 0):
            raise InputError(f"{name} must be finite and > 0, got {v}")
    if not (math.isfinite(margin_eps) and margin_eps >= 0):
        raise InputError(f"margin eps must be finite and >= 0, got {margin_eps}")
    if margin_eps and cfg.variant != "lofast":
        raise InputError("Lipschitz-margin training needs the lofast variant (its Lipschitz constant "
                         "is what the margin is measured against)")
    dev = resolve_device(device)
    X_tr, y_tr, X_te, y_te = load_dataset(dataset)
    if X_tr.shape[1:] != (cfg.image, cfg.image) or int(y_tr.max()) >= cfg.classes:
        raise InputError(f"{dataset} images are {list(X_tr.shape[1:])} with {int(y_tr.max()) + 1} classes, "
                         f"the architecture expects {cfg.image}×{cfg.image} and {cfg.classes}")
    X_tr, y_tr, X_te, y_te = (t.to(dev) for t in (X_tr, y_tr, X_te, y_te))
    recipe = {"architecture": cfg.to_dict(), "dataset": dataset, "seed": seed, "epochs": epochs,
              "batch_size": batch_size, "lr": lr, "head_lr_scale": head_lr_scale, "margin_eps": margin_eps}
    checkpoint = None if checkpoint is None else Path(checkpoint)
    state = _resume(checkpoint, recipe)
    with deterministic(dev):
        torch.manual_seed(seed)
        net = ViT(cfg).to(device=dev, dtype=torch.float64)  # drawn on the CPU, so the same on every device
        order = torch.Generator().manual_seed(seed)
        steps = -(-len(X_tr) // batch_size)
        head = [p for n, p in net.named_parameters() if n.startswith("head.")]
        rest = [p for n, p in net.named_parameters() if not n.startswith("head.")]
        opt = torch.optim.Adam([{"params": rest}, {"params": head, "lr": lr * head_lr_scale}], lr=lr)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs * steps)
        history: list[float] = []  # test accuracy after each epoch: how far more epochs would take it
        done, spent = 0, 0.0
        if state is not None:
            net.load_state_dict(state["net"])
            opt.load_state_dict(state["opt"])
            schedule.load_state_dict(state["schedule"])
            order.set_state(state["order"])
            done, spent, history = state["epoch"], state["seconds"], state["history"]
        bar = tqdm(range(done, epochs), desc=model_name(dataset, cfg, margin_eps), file=sys.stderr,
                   disable=not progress, initial=done, total=epochs)
        start = time.perf_counter() - spent
        for epoch in bar:
            net.train()
            perm = torch.randperm(len(X_tr), generator=order).to(dev)
            total = 0.0
            for i in range(0, len(X_tr), batch_size):
                idx = perm[i:i + batch_size]
                loss = margin_loss(net, X_tr[idx], y_tr[idx], margin_eps)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                schedule.step()
                total += float(loss.detach()) * len(idx)
            if checkpoint is not None:  # the test pass is paid only by runs that keep a history
                tick = time.perf_counter()
                history.append(accuracy(net, X_te, y_te))
                start += time.perf_counter() - tick  # train_seconds counts training only
                _save_state(checkpoint, {"recipe": recipe, "epoch": epoch + 1, "net": net.state_dict(),
                                         "opt": opt.state_dict(), "schedule": schedule.state_dict(),
                                         "order": order.get_state(), "history": history,
                                         "seconds": time.perf_counter() - start})
            bar.set_postfix(loss=f"{total / len(X_tr):.4f}",
                            **({"test": f"{history[-1]:.4f}"} if history else {}))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        seconds = time.perf_counter() - start
        test_acc, train_acc = accuracy(net, X_te, y_te), accuracy(net, X_tr, y_tr)
    commit, dirty = git_state()
    card = {"dataset": dataset, "variant": cfg.variant, "constraint": cfg.constraint,
            "ffn_constraint": cfg.ffn_constraint, "qk_constraint": cfg.qk_constraint,
            "margin_eps": margin_eps, "seed": seed, "epochs": epochs, "batch_size": batch_size,
            "lr": lr, "head_lr_scale": head_lr_scale, "dtype": "float64",
            "optimizer": "Adam (the head's lr times head_lr_scale), cosine schedule per step, "
                         + ("cross-entropy" if not margin_eps else
                            "cross-entropy on Lipschitz-margin logits (bench/nets/train.py: margin_loss)"),
            "test_accuracy": test_acc, "train_accuracy": train_acc, "n_test": len(X_te),
            **({"epoch_test_accuracy": [round(a, 4) for a in history]} if history else {}),
            "train_seconds": round(seconds, 3), "device": dev.type, "device_name": device_name(dev),
            "cpu_kernels": cpu_kernels(), "threads": torch.get_num_threads(), "suite_version": __version__,
            "torch_version": torch.__version__,
            "git_commit": commit, "git_dirty": dirty}
    return net.cpu().eval(), card


def command(cfg: ViTConfig, card: dict, out: str | Path) -> str:
    """The ``python -m bench train`` line that retrains the model of a card into ``out`` (a path
    inside the checkout is written relative to it: the line runs from the checkout's root)."""
    a = cfg.to_dict()
    out = Path(out).resolve()
    out = out.relative_to(ROOT) if out.is_relative_to(ROOT) else out
    cap = lambda c: "none" if c is None else repr(c)
    parts = ["python", "-m", "bench", "train", "--dataset", card["dataset"], "--variant", a["variant"],
             "--d", a["d"], "--depth", a["depth"], "--heads", a["heads"], "--patch", a["patch"],
             "--ffn", a["ffn"],
             "--constraint", cap(a["constraint"]), "--ffn-constraint", cap(a["ffn_constraint"]),
             *(["--qk-constraint", cap(a["qk_constraint"])] if a["qk_constraint"] is not None else []),
             *(["--margin-eps", repr(card["margin_eps"])] if card.get("margin_eps") else []),
             *(["--activation", a["activation"]] if "activation" in a else []),
             *(["--norm", a["norm"]] if "norm" in a else []), *(["--pool", a["pool"]] if "pool" in a else []),
             *(["--bias"] if a.get("bias") else []),
             "--epochs", card["epochs"], "--batch-size", card["batch_size"], "--lr", repr(card["lr"]),
             "--head-lr-scale", repr(card["head_lr_scale"]),
             "--seed", card["seed"], "--device", card.get("device", "cpu"), "--threads", card["threads"],
             "--out", out]
    return shlex.join(map(str, parts))


def train_from_card(card: dict, device: str | None = None, progress: bool = False) -> tuple[ViT, dict]:
    """Retrains the model a card describes, on the card's device unless ``device`` says otherwise (set
    torch's threads to ``card['threads']`` first to get the same bits on the CPU; the bits of a CUDA
    training are those of the same GPU and torch)."""
    device = device or card.get("device", "cpu")
    cfg = ViTConfig.from_dict(card["architecture"])
    return train(cfg, card["dataset"], seed=card["seed"], epochs=card["epochs"],
                 batch_size=card["batch_size"], lr=card["lr"], head_lr_scale=card["head_lr_scale"],
                 margin_eps=card.get("margin_eps", 0.0), device=device, progress=progress)

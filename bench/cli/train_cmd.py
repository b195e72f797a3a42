"""``python -m bench train``'s options and what it runs: one model (bench.nets.train), or the whole zoo
(bench.nets.zoo).

Apart from bench.nets.train so that the training code and the zoo, which trains through it, import each
other in one direction only.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from models import InputError
from models.data import DATASETS, SHAPES
from models.vit import ACTIVATIONS, NORMS, POOLS, ViTConfig
from models.vit_io import card_path, save_vit

from ..core.env import ROOT, set_threads
from ..nets.train import BATCH_SIZE, DEFAULTS, HEAD_LR_SCALE, LR, checkpoint_path, command, model_name, train
from ..nets.zoo import train_zoo

# where a single model goes by default: git-ignored, so that trying README's commands leaves the
# committed zoo/ alone (``--zoo`` rewrites zoo/ on purpose)
OUT_DIR = ROOT / "results" / "latest" / "zoo"


def parse_cap(s: str | None, variant: str, default: float | None) -> float | None:
    """A cap from the command line: a number > 0, ``none``, or absent (``default``; none for vanilla
    and standard, which are trained uncapped as their recipes are)."""
    if s is None:
        return None if variant in ("vanilla", "standard") else default
    if s.strip().lower() == "none":
        return None
    try:
        return float(s)
    except ValueError:
        raise InputError(f"a constraint must be a number > 0 or none, got {s!r}") from None


def config_from_args(args: argparse.Namespace) -> ViTConfig:
    if args.dataset not in DATASETS:
        raise InputError(f"unknown dataset {args.dataset!r}; expected one of {', '.join(DATASETS)}")
    image, classes = SHAPES[args.dataset]
    return ViTConfig(image=image, classes=classes, d=args.d, depth=args.depth, heads=args.heads,
                     # `is None`, not `or`: an explicit 0 must reach ViTConfig's check, not the default
                     patch=DEFAULTS[args.dataset]["patch"] if args.patch is None else args.patch,
                     ffn=2 * args.d if args.ffn is None else args.ffn,
                     variant=args.variant,
                     constraint=parse_cap(args.constraint, args.variant, 0.5),
                     ffn_constraint=parse_cap(args.ffn_constraint, args.variant, 1.0),
                     qk_constraint=parse_cap(args.qk_constraint, args.variant, None),
                     activation=args.activation, norm=args.norm, pool=args.pool, bias=args.bias)


def add_parser(subparsers) -> argparse.ArgumentParser:
    tr = subparsers.add_parser("train", help="train a small ViT on bundled data (digits, fashion-mnist)")
    tr.add_argument("--dataset", default="digits", help="digits (default) or fashion-mnist")
    tr.add_argument("--variant", default="lofast", help="lofast (LayerProject, capped; default), vanilla "
                    "(LayerNorm in its place) or standard (pre-norm residual blocks, as a ViT is written)")
    tr.add_argument("--d", type=int, default=32, help="token width (default 32)")
    tr.add_argument("--depth", type=int, default=2, help="number of blocks (default 2)")
    tr.add_argument("--heads", type=int, default=2, help="attention heads (default 2)")
    tr.add_argument("--patch", type=int, default=None, help="patch side (default: digits 2, fashion-mnist 4)")
    tr.add_argument("--ffn", type=int, default=None, help="FFN hidden width (default 2d)")
    tr.add_argument("--constraint", default=None, metavar="C|none",
                    help="cap on every per-head ‖W^V_l‖₂, ‖W^O_l‖₂ (default 0.5; none for vanilla)")
    tr.add_argument("--ffn-constraint", default=None, metavar="C|none",
                    help="cap on the FFN's ‖W₁‖₂, ‖W₂‖₂ (default 1; none for vanilla)")
    tr.add_argument("--qk-constraint", default=None, metavar="C|none",
                    help="cap on every per-head ‖W^Q_l‖₂, ‖W^K_l‖₂ (default none, as LoFAST)")
    tr.add_argument("--activation", default="relu", choices=ACTIVATIONS,
                    help="the FFN's activation (default relu; gelu, or gelu_tanh: its tanh approximation)")
    tr.add_argument("--norm", default="layer", choices=NORMS,
                    help="standard variant: LayerNorm (default) or BatchNorm (VNN-COMP's ViTs)")
    tr.add_argument("--pool", default="cls", choices=POOLS,
                    help="standard variant: the class token (default) or the mean of the normalized tokens")
    tr.add_argument("--bias", action="store_true",
                    help="standard variant: biases on the attention's queries, keys, values and output")
    tr.add_argument("--margin-eps", type=float, default=0.0, metavar="EPS",
                    help="Lipschitz-margin training at this image radius (default 0: plain cross-entropy)")
    tr.add_argument("--epochs", type=int, default=None, help="default: digits 60, fashion-mnist 10")
    tr.add_argument("--batch-size", type=int, default=BATCH_SIZE)
    tr.add_argument("--lr", type=float, default=LR)
    tr.add_argument("--head-lr-scale", type=float, default=HEAD_LR_SCALE,
                    help="the head's learning rate over --lr (default 10)")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--out", default=None, help="weights file (default results/latest/zoo/<name>."
                    "safetensors, git-ignored); the card goes beside it as <name>.json; an "
                    "interrupted run resumes from <out>.ckpt, kept there after every epoch")
    tr.add_argument("--force", action="store_true",
                    help="overwrite --out and its card if they exist (refused otherwise)")
    tr.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    tr.add_argument("--threads", dest="train_threads", type=int, default=None, metavar="N",
                    help="torch CPU threads (default: the global --threads, else 1)")
    tr.add_argument("--zoo", action="store_true",
                    help="retrain every model of zoo/README.md into --out (a directory, default zoo/, "
                         "whose models it replaces)")
    tr.set_defaults(single_defaults={k: tr.get_default(k) for k in SINGLE})
    return tr


# the options that describe one model: --zoo trains the zoo's own recipes and takes none of them
SINGLE = ("dataset", "variant", "d", "depth", "heads", "patch", "ffn", "constraint", "ffn_constraint",
          "qk_constraint", "activation", "norm", "pool", "bias", "margin_eps", "epochs", "batch_size", "lr",
          "head_lr_scale", "seed", "force")


def check_zoo_options(args: argparse.Namespace) -> None:
    """--zoo with an option of a single model is refused, naming it: the zoo's recipes would ignore
    it, and a run that ignores what it was told is a silently wrong answer."""
    given = [f"--{k.replace('_', '-')}" for k, default in getattr(args, "single_defaults", {}).items()
             if getattr(args, k, default) != default]
    if given:
        raise InputError(f"--zoo retrains every model of zoo/README.md with its own recipe; "
                         f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to one model "
                         f"only: drop {'it' if len(given) == 1 else 'them'}, or train one model without "
                         f"--zoo")


def check_writable(path: Path, what: str) -> None:
    """Says in one InputError why ``path`` cannot become a directory we write into, before any
    work: its nearest existing ancestor must be a directory where a file can be created (a probe,
    removed at once; nothing else is created here)."""
    base = path
    while not base.exists():
        base = base.parent
    if not base.is_dir():
        raise InputError(f"{what}: {base} is a file, not a directory")
    probe = base / f".probe.{os.getpid()}"
    try:
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise InputError(f"{what}: cannot write in {base} ({e.strerror or e})") from None


def check_out(out: Path, force: bool) -> None:
    """A single model's --out, checked before training: a .safetensors path that is writable, and
    that neither it nor its card exists unless ``force``."""
    if out.suffix != ".safetensors":
        raise InputError(f"--out must end in .safetensors (the card goes beside it), got {out}")
    for path in (out, card_path(out)):
        if path.is_dir():
            raise InputError(f"--out {out}: {path} is a directory")
        if path.exists() and not force:
            raise InputError(f"--out {out}: {path} exists; pass --force to overwrite it, or choose "
                             f"another --out")
    check_writable(out.parent, f"--out {out}")


def run(args: argparse.Namespace) -> int:
    if args.train_threads is not None:
        if args.train_threads < 1:
            raise InputError(f"--threads must be at least 1, got {args.train_threads}")
        set_threads(args.train_threads)
    if args.out is not None and not args.out.strip():
        raise InputError("--out: expected a path, got an empty string")
    if args.zoo:
        check_zoo_options(args)
        out_dir = Path(args.out) if args.out is not None else ROOT / "zoo"
        check_writable(out_dir, f"--out {out_dir}")
        print(f"zoo: {train_zoo(out_dir, args.device)}")
        return 0
    cfg = config_from_args(args)
    name = model_name(args.dataset, cfg, args.margin_eps)
    out = Path(args.out) if args.out is not None else OUT_DIR / f"{name}.safetensors"
    check_out(out, args.force)
    epochs = args.epochs if args.epochs is not None else DEFAULTS[args.dataset]["epochs"]
    net, card = train(cfg, args.dataset, seed=args.seed, epochs=epochs, batch_size=args.batch_size,
                      lr=args.lr, head_lr_scale=args.head_lr_scale, margin_eps=args.margin_eps,
                      device=args.device, checkpoint=checkpoint_path(out))
    card = save_vit(out, net, {**card, "command": command(cfg, card, out)})
    checkpoint_path(out).unlink(missing_ok=True)  # the model is whole: nothing left to resume
    print(f"model: {out} (test accuracy {card['test_accuracy']:.4f}, {card['train_seconds']:.1f} s on "
          f"{card['device_name']})")
    return 0

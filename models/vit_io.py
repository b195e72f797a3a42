"""A trained ViT as two files: ``NAME.safetensors`` (the capped weights, no pickle) and ``NAME.json``,
its card (dataset, architecture, training settings, accuracy, time, suite version and commit)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from .errors import InputError, check_finite, check_float
from .io import read_file, save_tensors, write_atomic
from .vit import ViT, ViTConfig

FORMAT = "attnbounds-vit/1"


def card_path(path: str | Path) -> Path:
    """The card beside a weights file: ``x.safetensors`` → ``x.json``."""
    return Path(path).with_suffix(".json")


def sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def save_vit(path: str | Path, net: ViT, card: dict) -> dict:
    """Writes the weights and the card (``card`` plus format, architecture, file name and sha256);
    returns the card as written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.cpu().contiguous() for k, v in net.weights().items()}
    save_tensors(path, tensors, {"format": FORMAT})
    card = {"format": FORMAT, **card, "architecture": net.cfg.to_dict(), "weights": path.name,
            "sha256": sha256(path)}
    write_atomic(card_path(path), json.dumps(card, indent=2) + "\n")
    return card


def load_card(path: str | Path) -> dict:
    where = card_path(path)
    try:
        card = json.loads(where.read_text())
    except FileNotFoundError:
        raise InputError(f"{where}: no card beside {Path(path).name}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{where}: not a readable JSON card ({e})") from None
    if not isinstance(card, dict) or card.get("format") != FORMAT:
        raise InputError(f"{where}: not a ViT card (format must be {FORMAT!r})")
    if not isinstance(card.get("architecture"), dict):
        raise InputError(f"{where}: missing 'architecture'")
    return card


def load_vit(path: str | Path) -> tuple[ViT, dict]:
    """The network (float64, eval mode, the stored weights as plain parameters) and its card."""
    card = load_card(path)
    cfg = ViTConfig.from_dict(card["architecture"])
    if "sha256" in card and Path(path).is_file() and sha256(path) != card["sha256"]:
        raise InputError(f"{path}: the weights do not match the sha256 of their card")
    tensors, _ = read_file(path)
    for name, t in tensors.items():
        check_float(f"{path}: {name}", t)
        check_finite(f"{path}: {name}", t)
    with torch.random.fork_rng(devices=[]):  # building draws an initialisation we then overwrite
        net = ViT(cfg, constrained=False).double()
    try:
        net.load_state_dict({k: v.double() for k, v in tensors.items()}, strict=True)
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        raise InputError(f"{path}: tensors do not fit the card's architecture "
                         f"({' '.join(s.strip() for s in first[:3])})") from None
    return net.eval(), card

"""A network from a file another framework wrote (``certify --model FILE.onnx|FILE.pt2 --data FILE.pt``):
its images and labels read and checked, and the network recovered as the suite's standard ViT
(models/imported/network.py), before any bound runs."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import Tensor

from models import InputError
from models.imported.importer import SOURCES, check_source, digest, load
from models.imported.network import Network, recover_network


def is_network_file(path: str | Path) -> bool:
    """Whether ``--model`` names a network file (``.onnx``, ``.pt2``) rather than a ViT card's weights."""
    return Path(path).suffix in SOURCES


DATA_SUFFIXES = (".pt", ".pth")  # a data file is torch.save's


def check_data_path(path: str | Path, where: str | None = None) -> Path:
    """``path`` as a data file (its suffix, and there); ``where`` names it in errors (default
    ``--data PATH``, certify's flag; a profile says its key)."""
    path = Path(path)
    where = where or f"--data {path}"
    if path.suffix not in DATA_SUFFIXES:
        raise InputError(f"{where}: expected a .pt file of (images, labels) or {{'images': …, 'labels': …}}")
    if not path.is_file():
        raise InputError(f"{where}: no such file")
    return path


def check_normalization(mean: float, std: float) -> None:
    if not math.isfinite(mean) or not (math.isfinite(std) and std > 0):
        raise InputError(f"--mean must be finite and --std finite and > 0, got {mean} and {std}")


def read_data(path: str | Path, where: str | None = None) -> tuple[Tensor, Tensor]:
    """(images [N, H, H] float64 in [0, 1], labels [N] long) of a data file: a tuple or list
    ``(images, labels)`` or a dict with ``images`` and ``labels``; images [N, H, H] or [N, 1, H, H].
    ``where`` as in :func:`check_data_path`."""
    path = check_data_path(path, where)
    where = where or f"--data {path}"
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch.load raises many kinds for a file that is not a tensor file
        raise InputError(f"{where}: not a readable .pt file ({type(e).__name__})") from None
    if isinstance(obj, dict) and {"images", "labels"} <= set(obj):
        images, labels = obj["images"], obj["labels"]
    elif isinstance(obj, tuple | list) and len(obj) == 2:
        images, labels = obj
    else:
        raise InputError(f"{where}: expected (images, labels) or {{'images': …, 'labels': …}}")
    if not isinstance(images, Tensor) or not isinstance(labels, Tensor):
        raise InputError(f"{where}: images and labels must be tensors")
    if images.dim() == 4 and images.shape[1] == 1:
        images = images[:, 0]
    if images.dim() != 3 or images.shape[1] != images.shape[2] or not images.is_floating_point():
        raise InputError(f"{where}: images must be floats [N, H, H] or [N, 1, H, H] (one channel, "
                         f"square), got {str(images.dtype).removeprefix('torch.')} {list(images.shape)}")
    if not bool(torch.isfinite(images).all()) or images.min() < 0 or images.max() > 1:
        raise InputError(f"{where}: images must lie in [0, 1] (ε is a radius over such pixels; "
                         f"give the model's normalization as --mean and --std)")
    if labels.shape != images.shape[:1] or labels.is_floating_point() or labels.dtype == torch.bool:
        raise InputError(f"{where}: labels must be integers [N] for images [N, …], got "
                         f"{str(labels.dtype).removeprefix('torch.')} {list(labels.shape)}")
    if len(labels) == 0 or int(labels.min()) < 0:
        raise InputError(f"{where}: no images, or a negative label")
    return images.double(), labels.long()


def load_network(path: str | Path, images: Tensor, labels: Tensor, mean: float, std: float,
                 where: str = "--data") -> tuple:
    """(the network, a card for the JSON's meta: source, sha256 and how well it reproduces the runtime)
    of a network file, recovered on ``images``; InputError where a label is not one of its classes
    (naming the data as ``where``)."""
    path = check_source(path)
    found: Network = recover_network(load(path), images, mean, std)
    classes = found.net.cfg.classes
    if int(labels.max()) >= classes:
        raise InputError(f"{where}: a label {int(labels.max())} is not one of the model's {classes} classes")
    card = {"source": str(path), "format": SOURCES[path.suffix],
            "sha256": digest(path), "mean": mean, "std": std,
            "dtype": "float64" if found.float64 else "model", "max_rel_err": found.max_rel_err,
            "variant": "standard"}
    return found.net, card

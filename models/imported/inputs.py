"""The user's batch of model inputs (``--inputs FILE``): a tensor file (.pt, .npy, .safetensors) fitted
to the graph's inputs. A model of one input takes one tensor; a model of several takes a .safetensors
file or a .pt dict with one tensor per input name. The batch is the first axis; token ids (integer
tensors) go to the model as they are."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..errors import InputError
from .graph import Graph

SUFFIXES = (".pt", ".pth", ".npy", ".safetensors")


def check_path(path: str | Path) -> Path:
    """The inputs file's path, refused before any work when it cannot be one."""
    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise InputError(f"--inputs {path}: expected a tensor file ({', '.join(SUFFIXES)})")
    if not path.is_file():
        raise InputError(f"--inputs {path}: no such file")
    return path


def read(path: str | Path) -> dict[str, Tensor] | Tensor:
    """The tensor (or named tensors) in the file."""
    path = check_path(path)
    try:
        if path.suffix == ".npy":
            return torch.from_numpy(np.load(path, allow_pickle=False))
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # each reader raises its own error types for a file that is not its format
        raise InputError(f"--inputs {path}: not a readable {path.suffix} tensor file "
                         f"({type(e).__name__})") from None
    if isinstance(obj, Tensor) or (isinstance(obj, dict)
                                   and all(isinstance(v, Tensor) for v in obj.values())):
        return obj
    raise InputError(f"--inputs {path}: holds a {type(obj).__name__}, not a tensor or a dict of tensors")


def fit(graph: Graph, given: dict[str, Tensor] | Tensor, where: str) -> tuple[dict[str, Tensor], int, int]:
    """(the inputs by graph input name, the batch size B, the batch size of one run) after checking
    each against the graph input's shape and kind (float or integer)."""
    names = list(graph.inputs)
    if isinstance(given, Tensor) or (len(given) == 1 and len(names) == 1):
        t = given if isinstance(given, Tensor) else next(iter(given.values()))
        if len(names) != 1:
            raise InputError(f"--inputs {where}: the model takes {len(names)} inputs ({', '.join(names)}); "
                             f"give a .safetensors file or a .pt dict with one tensor per name")
        given = {names[0]: t}
    missing = [n for n in names if n not in given]
    if missing:
        raise InputError(f"--inputs {where}: no tensor for the model's input {missing[0]!r} "
                         f"(it holds {', '.join(sorted(given))})")
    out, batch, step = {}, None, 1
    for name in names:
        shape, dtype = graph.inputs[name]
        t = given[name]
        if t.is_floating_point() != dtype.is_floating_point or t.is_complex() or t.dtype == torch.bool:
            kind = "floats" if dtype.is_floating_point else "integers (token ids)"
            raise InputError(f"--inputs {where}: {name} has dtype {str(t.dtype).removeprefix('torch.')}; "
                             f"the model's input takes {kind}")
        fits = t.dim() == len(shape) and all(s is None or s == g for s, g in zip(shape[1:], t.shape[1:],
                                                                                  strict=True))
        run = shape[0] if shape and shape[0] is not None else 1
        if not fits or t.shape[0] == 0 or t.shape[0] % run:
            want = ["B" if i == 0 else ("?" if s is None else s) for i, s in enumerate(shape)]
            raise InputError(f"--inputs {where}: {name} has shape {list(t.shape)}; the model takes "
                             f"{want} (B a multiple of {run}, the batch along the first axis)")
        if batch is not None and t.shape[0] != batch:
            raise InputError(f"--inputs {where}: the inputs disagree on the batch size "
                             f"({batch}, {t.shape[0]})")
        batch, step = t.shape[0], max(step, run)
        out[name] = t.to(dtype)
    return out, batch, step

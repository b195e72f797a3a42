"""A cell's peak memory, estimated from its sizes alone, so that ``run`` refuses a cell that cannot
fit before the first cell runs (one error line within seconds, not the OOM killer an hour in).

The estimate counts only the dominant tensors, each of which certainly exists at some point of a
cell: the n×n attention of every head for PGD's restarts (one batch through every block, kept for
the backward pass), the dense Jacobian (nd)² and its Gram where the code forms them (n·d at most
DENSE_LIMIT, models/operators.py; above, the operators are matrix-free), the dense logit map of the
``scaling`` task, and the Lanczos vectors. It leaves out the library's temporaries and auto_LiRPA's
relaxations, so the real peak is higher: a cell it refuses cannot run here, and one it passes may
still not (the CLI's out-of-memory line is the net under that).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch

from models import InputError
from models.operators import DENSE_LIMIT
from models.spectral import KRYLOV_DIM

from ..nets.accuracy import CHUNK
from .cases import Cell, NetworkFileCell

BYTES = 8  # the certified bounds compute in float64 whatever the run's dtype
GiB = 1 << 30


def _sizes(cell: Cell) -> tuple[int, int, int, int, int] | None:
    """(batch, n, d, h, depth) the cell computes on; None for a pretrained cell (a shipped sentence's
    few dozen tokens through one MiniLM layer: small by construction, and its n needs the tokenizer)
    and for a network file's (its shape is known only once the network is recovered from the file)."""
    if cell.task == "pretrained" or isinstance(cell, NetworkFileCell):
        return None
    if cell.task == "imported":  # its manifest's shape: one input of one layer
        p = cell.params()
        return 1, p["n"], p["d"], p["h"], 1
    if not cell.model:
        return cell.samples, cell.n, cell.d, cell.h, cell.depth
    arch = json.loads(cell.model_path.with_suffix(".json").read_text()).get("architecture", {})
    n = (int(arch.get("image", 0)) // max(int(arch.get("patch", 1)), 1)) ** 2
    # a model cell's images go through the network in chunks of at most CHUNK (bench/nets/accuracy.py)
    return (min(cell.samples, CHUNK), n, int(arch.get("d", 0)), int(arch.get("heads", 1)),
            int(arch.get("depth", 1)))


def cell_bytes(cell: Cell, restarts: int) -> tuple[int, str]:
    """(bytes, what dominates) of ``cell`` with PGD's ``restarts``: a floor of its peak (module doc)."""
    sizes = _sizes(cell)
    if sizes is None:
        return 0, "nothing estimated"
    B, n, d, h, depth = sizes
    nd = n * d
    # per input and block: scores and probabilities (2·h·n²) and Q, K, V and the output (4·n·d)
    terms = {"the n×n attention of every head over PGD's restarts":
             (restarts + 1) * B * depth * (2 * h * n * n + 4 * nd),
             "the Lanczos vectors": (KRYLOV_DIM + 2) * B * h * nd}
    if nd <= DENSE_LIMIT:
        terms["the dense (nd)² Jacobian and its Gram"] = 2 * B * nd * nd
        if cell.task == "scaling" and depth == 1 and cell.kind == "dot":  # logit_matrix and its SVD
            terms["the dense logit map (n²·nd per head)"] = 2 * B * h * n * n * nd
    what = max(terms, key=terms.get)
    return BYTES * terms[what], what


def available_bytes(device: torch.device | None) -> int | None:
    """Memory free for a cell on ``device``: a GPU's free memory, else the machine's available RAM
    (/proc/meminfo's MemAvailable, else the physical total); None where it cannot be told."""
    if device is not None and device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with contextlib.suppress(OSError, ValueError, StopIteration):
        lines = Path("/proc/meminfo").read_text().splitlines()
        kib = next(line.split()[1] for line in lines if line.startswith("MemAvailable:"))
        return int(kib) * 1024
    with contextlib.suppress(AttributeError, OSError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return None


def check_memory(cells: list[tuple[str, Cell]], restarts: int, device: torch.device | None) -> None:
    """Refuses the run if any cell's estimate exceeds the memory available on ``device``, naming the
    largest such cell and its estimate."""
    free = available_bytes(device)
    if free is None:
        return
    worst = max(((cell_bytes(c, restarts), s, c) for s, c in cells), key=lambda t: t[0][0], default=None)
    if worst is None:
        return
    (need, what), sweep, cell = worst
    if need > free:
        where = "GPU" if device is not None and device.type == "cuda" else "RAM"
        raise InputError(f"sweep {sweep!r} cell {cell.id} needs at least {need / GiB:.3g} GiB ({what}), "
                         f"more than the {free / GiB:.3g} GiB of {where} available; make n, d, h, "
                         f"depth or samples smaller")

"""The ``cost`` task: seconds and peak memory of every certified end-to-end bound, of its parts (ζ,
‖M_l‖, ξ_l) and of the PGD that checks it, with the machine's measured float64 matmul rate and the
matmul-bound estimate of ζ and δ₂, all as rows, so the report rebuilds from the results alone.

The matmul-bound estimate of ζ + ‖M_l‖ is (operator products) × (flops per product) ÷ (the measured
matmul rate): on the probabilistic path k = kw_steps(N) products with T*T (docs/bounds.md §2.4), on
the dense path the structured Gram and the decomposition of its side D: on the CPU from VERIFY_MIN
on the Cholesky check (D³/3 flops, plus ≈ 20 products of the guess), below it or on a GPU the
eigendecomposition (≈ 4/3·D³).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import torch

import bounds
from attacks import attack
from bounds import lofast as lf
from bounds.certificates import Certificate, Ledger
from bounds.norms import kw_steps
from models.operators import M_GRAM_LIMIT, VERIFY_MIN, ZETA_GRAM_LIMIT

from ..core.env import glibc
from .cases import LayerCell
from .rows import row

COST_BOUNDS = ["naive", "specformer", "lofast_xi", "lofast_M", "lofast_M_half", "taylor", "best"]
PARTS = {"zeta": lambda layer, X, ledger: lf.zeta(layer, X, ledger=ledger),
         "M": lambda layer, X, ledger: lf.m_norms(layer, X, ledger=ledger),
         "xi": lambda layer, X, ledger: lf.xi(layer, X)}
MATMUL_SIDE = 1024  # float64 matmul whose rate is measured (GPU: 4096, enough to fill it)
SAMPLE_S = 0.002  # RSS sampling interval on the CPU


def matmul_rate(device: torch.device, repeats: int = 3) -> tuple[float, float]:
    """(flop/s, seconds per matmul) of a square float64 matmul on ``device``, the best of ``repeats``."""
    side = MATMUL_SIDE if device.type == "cpu" else 4 * MATMUL_SIDE
    A = torch.randn(side, side, dtype=torch.float64, device=device)
    best = float("inf")
    for _ in range(repeats + 1):  # the first is a warm-up
        _sync(device)
        t = time.perf_counter()
        A @ A
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * side**3 / best, best


def decomposition_flops(D: int, cuda: bool = False) -> float:
    """Flops of certifying the top eigenvalue of a formed D×D Gram (module docstring)."""
    return 4 / 3 * D**3 if cuda or D < VERIFY_MIN else D**3 / 3 + 40 * D * D


def zeta_flops(n: int, d: int, h: int, cuda: bool = False) -> float:
    """Flops of the certified ζ on the path certified_norm takes (module docstring)."""
    N = n * d
    if N <= ZETA_GRAM_LIMIT:
        return 2 * n * n * d * d * h * h + decomposition_flops(N, cuda)
    per = 8 * n * d * d + 4 * n * n * d if h > 1 else 4 * n * n * d + 4 * n * d * d
    return kw_steps(N) * per


def m_flops(n: int, d: int, h: int, cuda: bool = False) -> float:
    """Flops of the certified ‖M_l‖ of all heads (on the 2d_h-dimensional span, models.structured)."""
    r = min(d, 2 * d // h)
    D = min(n * n, n * r)
    if D <= M_GRAM_LIMIT:
        return h * (decomposition_flops(D, cuda) + 2 * D * D * (r if D == n * r else 1))
    return kw_steps(n * r) * h * 8 * n * n * r


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _trim() -> None:
    """Returns freed heap to the system (glibc), so the next peak is measured from a low floor."""
    libc = glibc()
    if libc is not None:
        libc.malloc_trim(0)


def measure(fn: Callable, device: torch.device):
    """(result, seconds, peak MiB above the start). GPU: torch.cuda.max_memory_allocated; CPU: the
    resident set sampled every 2 ms by a thread (torch's CPU allocations are invisible to
    tracemalloc), after returning freed heap to the system; NaN where /proc is absent."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        _trim()
        try:
            base = _rss()
        except OSError:
            base = None
    peak, stop = [base or 0], threading.Event()

    def sample():
        while not stop.wait(SAMPLE_S):
            peak[0] = max(peak[0], _rss())

    sampler = threading.Thread(target=sample, daemon=True) if device.type == "cpu" and base else None
    if sampler:
        sampler.start()
    _sync(device)
    t = time.perf_counter()
    out = fn()
    _sync(device)
    seconds = time.perf_counter() - t
    if sampler:
        stop.set()
        sampler.join()
        peak[0] = max(peak[0], _rss())
    if device.type == "cuda":
        used = torch.cuda.max_memory_allocated(device) - base
    else:
        used = peak[0] - base if base else float("nan")
    return out, seconds, used / 2**20


def cost_task(cell: LayerCell, run: dict, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Rows (role ``timing``) ``cost_<bound>``, ``cost_<part>`` and ``cost_pgd`` with seconds per
    sample and ``peak_mib``; ``matmul`` (value: GFLOP/s) and ``matmul_bound`` (value: the estimated
    seconds per sample of ζ + ‖M_l‖). Certified values compute in float64 whatever ``dtype``."""
    layer, X = cell.build()
    X = X.to(device=device, dtype=torch.float64)
    layer = layer.to(X)
    B = X.shape[0]
    rows: list[dict] = []
    rate, mm_s = matmul_rate(device)
    rows.append(row("timing", "matmul", -1, rate / 1e9, certificate="estimate", seconds=mm_s))
    cuda = device.type == "cuda"
    flops = zeta_flops(cell.n, cell.d, cell.h, cuda) + m_flops(cell.n, cell.d, cell.h, cuda)
    rows.append(row("timing", "matmul_bound", -1, flops / rate, seconds=flops / rate))

    def add(name: str, fn: Callable) -> None:
        (values, cert), seconds, mib = measure(fn, device)
        v = float(values.reshape(B, -1).amax(-1).max())
        rows.append(row("timing", name, -1, v, certificate=cert, seconds=seconds / B,
                        extra={"peak_mib": mib}))

    def part(fn: Callable):
        book = Ledger()
        values = fn(layer, X, ledger=book)
        return values, book.certificate if book.entries else Certificate("exact")

    for name, fn in PARTS.items():
        add(f"cost_{name}", lambda fn=fn: part(fn))
    for name in COST_BOUNDS:
        if bounds.applies(bounds.get(name), layer):
            add(f"cost_{name}", lambda name=name: _certified(name, layer, X, cell.eps))
    # PGD searches in the run's dtype and measures its value in float64 (attacks.attack)
    add("cost_pgd", lambda: (attack(layer, X, cell.eps, "output", steps=run["pgd_steps"],
                                    restarts=run["pgd_restarts"], seed=run["seed"], dtype=dtype), "attained"))
    return rows


def _certified(name: str, layer, X: torch.Tensor, eps: float):
    v = bounds.evaluate_certified(name, layer, X, eps)
    return v.value, v.certificate

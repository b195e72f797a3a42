"""Where a computation runs (device, dtype, threads) and what it ran with (versions, commit)."""

from __future__ import annotations

import contextlib
import math
import os
import platform
import subprocess
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from models import InputError

from .. import __version__

DTYPES = {"float32": torch.float32, "float64": torch.float64}
ROOT = Path(__file__).resolve().parents[2]  # bench/core/env.py → the checkout
THREADS_ENV = "BENCH_THREADS"
ALLOCATOR_ENV = "BENCH_MALLOC"  # "system" leaves glibc's defaults; unset or empty: keep_freed_memory's
ALLOCATORS = ("system",)
TIMEOUT_ENV = "BENCH_DASK_WORKER_TIMEOUT"  # read by bench/sweep/distributed.py
WORKER_TIMEOUT_S = 120.0  # its default: SLURM jobs may queue a while, so minutes, never forever


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS, Windows
        return os.cpu_count() or 1


def check_environment() -> None:
    """Every $BENCH_* variable, checked before any work (the CLI calls it first): a typo in one is
    refused with one line rather than ignored, or met as a crash halfway through a run."""
    env_threads()
    env_allocator()
    env_worker_timeout()


def _check_count(n: int, what: str) -> int:
    """Refuses more threads than CPUs: torch takes any count, and far above the machine's its
    thread pool crashes the process at the first parallel kernel (99999: a segmentation fault);
    below that, a count over the cores only oversubscribes them, which skews every timing the suite
    records, so it is refused too rather than capped behind the user's back."""
    cpus = available_cpus()
    if n > cpus:
        raise InputError(f"{what}{n} is more threads than the {cpus} CPUs this process may use; "
                         f"give at most {cpus}")
    return n


def env_threads() -> int | None:
    """$BENCH_THREADS as an integer in 1..available_cpus(), or None when unset or empty."""
    text = os.environ.get(THREADS_ENV, "").strip()
    if not text:
        return None
    try:
        n = int(text)
    except ValueError:
        raise InputError(f"${THREADS_ENV} must be an integer >= 1, got {text!r}") from None
    if n < 1:
        raise InputError(f"${THREADS_ENV} must be an integer >= 1, got {text!r}")
    return _check_count(n, f"${THREADS_ENV}=")


def set_threads(n: int | None) -> int:
    """torch's intra-op threads: ``n``, else $BENCH_THREADS, else 1 (the bench's problems are small,
    and on a busy 2-core box a second thread costs more in synchronisation than it gains)."""
    if n is None:
        n = env_threads() or 1
    elif isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InputError(f"--threads must be an integer >= 1, got {n!r}")
    else:
        _check_count(n, "--threads ")
    torch.set_num_threads(n)
    return n


def env_allocator() -> str:
    """$BENCH_MALLOC: "" (the suite's setting, :func:`keep_freed_memory`) or one of ALLOCATORS; any
    other name is refused, since ignoring it would measure another allocator than the one asked for."""
    text = os.environ.get(ALLOCATOR_ENV, "")
    name = text.strip().lower()
    if name and name not in ALLOCATORS:
        raise InputError(f"${ALLOCATOR_ENV} must be unset (the suite's: keep freed memory) or "
                         f"{' or '.join(map(repr, ALLOCATORS))} (glibc's defaults), got {text!r}")
    return name


def env_worker_timeout() -> float:
    """$BENCH_DASK_WORKER_TIMEOUT: finite seconds > 0 (default WORKER_TIMEOUT_S)."""
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    try:
        value = float(text) if text else WORKER_TIMEOUT_S
    except ValueError:
        raise InputError(f"${TIMEOUT_ENV} must be a number of seconds, got {text!r}") from None
    if not 0 < value < math.inf:
        raise InputError(f"${TIMEOUT_ENV} must be a finite number of seconds > 0, got {text!r}")
    return value


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
KEEP_HEAP = 1 << 30  # bytes of freed heap glibc may keep before it returns memory to the system


def keep_freed_memory() -> bool:
    """On glibc, serve every allocation from the heap and keep up to :data:`KEEP_HEAP` of it freed:
    a process of this suite allocates and frees the same large tensors many times (auto_LiRPA's
    relaxations, the dense Jacobians), and glibc maps each one above its mmap threshold afresh, zeroed
    by the kernel. Measured on the 1-block digits model (12 images, one thread): whole-network CROWN
    0.52 s/image against 0.69 with the defaults, peak resident memory 576 MB against 537; what is
    freed is kept for the next allocation. One arena for every thread: a thread other than the main
    one (a Dask worker runs its tasks in one) otherwise gets an arena of its own, made of mmapped
    heaps that glibc shrinks with madvise whatever the two settings above say, so its large tensors
    are faulted in afresh each time. Measured in the paper run's Dask workers (Fashion-MNIST, CROWN
    and taylor_net): 1.0e9 minor page faults and 41–47 % of the task thread's time in the kernel,
    against 6 % in a serial run; CROWN and taylor_net on the 3-block digits model (4 images) in a
    thread: 714,685 faults and 1.4 s of system time against 46 faults and 0 s with one arena.
    ``$BENCH_MALLOC=system`` opts out; elsewhere (macOS, musl) nothing is done. Returns whether the
    setting was made."""
    libc = glibc()
    if env_allocator() == "system" or libc is None:
        return False
    return (bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, KEEP_HEAP))
            and bool(libc.mallopt(_M_ARENA_MAX, 1)))


def glibc():
    """The C library through ctypes where it is glibc (mallopt, malloc_trim), else None."""
    if platform.libc_ver()[0] != "glibc":
        return None
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda: no CUDA device is available (torch.cuda.is_available() is False)")
    if name not in ("cpu", "cuda"):
        raise InputError(f"unknown device {name!r}; expected auto, cpu or cuda")
    if name == "cuda":
        # autograd's CUDA worker thread starts without a current context, and cuBLAS says so on
        # stderr before it takes the primary one (seen on torch 2.11, an H100): a notice, not a fault,
        # that would be the one line besides a command's own on a GPU
        warnings.filterwarnings("ignore", message="Attempting to run cuBLAS, but there was no current CUDA")
    return torch.device(name)


def resolve_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise InputError(f"unknown dtype {name!r}; expected float32 or float64") from None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def cpu_kernels() -> str:
    """The CPU model and the instruction set torch's kernels use (e.g. ``AMD EPYC (AVX2)``): float64
    training is bit-reproducible only where both match, since vectorised kernels round differently."""
    model = ""
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    model = model or platform.processor() or platform.machine()
    return f"{model} ({torch.backends.cpu.get_cpu_capability()})"


def timed(fn: Callable, device: torch.device):
    """(result, seconds), synchronising CUDA so that the time is the kernels', not the launch's."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t


def git_state() -> tuple[str, bool]:
    """(commit, dirty) of the checkout, or ("unknown", False) outside git."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip() != ""
        return (commit or "unknown"), dirty
    except (OSError, subprocess.SubprocessError):
        return "unknown", False


def versions() -> dict[str, str]:
    return {"suite": __version__, "torch": torch.__version__, "python": platform.python_version()}

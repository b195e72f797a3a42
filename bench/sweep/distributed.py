"""Cells as Dask tasks: ``run --workers N`` (a LocalCluster here) or ``run --scheduler ADDRESS`` (a
running Dask cluster, e.g. started by dask-jobqueue on SLURM).

A worker gets a cell's id and the run options, rebuilds the cell (``cell_from_id`` is bit for bit),
resolves ``--device`` itself and returns the task's rows: it needs no file system of the client's.
The client writes every finished cell as today, so the lock, resume and the manifest are the
runner's alone. Dask is an optional dependency, imported only here and only when asked for.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from models import InputError

from ..core.env import (
    TIMEOUT_ENV,
    device_name,
    env_worker_timeout,
    git_state,
    keep_freed_memory,
    resolve_device,
    resolve_dtype,
)
from ..core.partial import DiskStore, code_salt
from ..core.plugins import PluginFile, using
from ..core.schema import FILE_TASKS
from .cases import MODEL_TASKS, Cell, cell_from_id
from .tasks import CertifyMemo, memo_group, run_cell

if TYPE_CHECKING:
    from distributed import Client

# how long a --scheduler address may take to answer: an unreachable one is a typo or a cluster that
# is not up yet, and either should be said within seconds, not after distributed's 30 s default
CONNECT_TIMEOUT_S = 10.0
POLL_S = 2.0  # seconds between the checks for a worker while no task finishes
INSTALL = "pip install 'attnbounds[dask]'"


def _distributed():
    try:
        import distributed
    except ImportError:
        raise InputError(f"--workers and --scheduler need Dask's distributed scheduler: {INSTALL}") from None
    return distributed


@dataclass
class Cluster:
    """A connected Dask client and the words for the progress bar."""

    client: Client
    where: str

    def rows(self, todo: list[tuple[int, str, Cell]], run: dict, device_arg: str, threads: int,
             commit: str, models: dict[str, str] | None = None, plugins: Sequence[PluginFile] = (),
             partial: str | None = None) -> Iterator[tuple[int, str, Cell, list[dict], dict]]:
        """(index, sweep, cell, rows, worker env) of every cell in ``todo``, as each finishes;
        ``models``: the run's zoo fingerprints by model (run.json's), which a worker's own zoo file of
        a cell's model must match (another machine's worker reads its own zoo/);
        ``plugins`` go with each cell as text (bench/core/plugins.py), registered by the worker;
        ``partial``: the run's folder of partial results, where a worker that sees it keeps what a
        cell cut short would otherwise compute again (bench/core/partial.py).

        A task's exception (an InputError, say) is raised here, after the cells finished before it
        were yielded; the cells still queued are cancelled.
        """
        from distributed import wait

        # pure=False: two sweeps may hold the same cell id, and each needs its own future. A cell
        # that can reuse its predecessor's certified norms (tasks.memo_group) waits for it, and Dask
        # runs a task where its input is: the same worker, whose memo holds the norms. Unchained,
        # the cells of one model alternate between workers, and each recomputes them (docs/scale.md)
        futures, last = {}, {}
        rank = priorities([cell for _, _, cell in todo])
        # submitted in that order too: an idle worker starts the first task it is given, whatever
        # comes after it (a stable sort keeps each chain's order)
        order = sorted(range(len(todo)), key=lambda j: -rank[j])
        for (i, sweep, cell), priority in ((todo[j], rank[j]) for j in order):
            group = memo_group(cell)
            after = last.get(group) if group is not None else None
            future = self.client.submit(compute, cell.id, run, device_arg, threads, after, tuple(plugins),
                                        partial, (models or {}).get(getattr(cell, "model", "")),
                                        pure=False, priority=priority)
            futures[future] = (i, sweep, cell)
            if group is not None:
                last[group] = future
        pending, idle_since = set(futures), None
        try:
            while pending:
                try:
                    done, pending = wait(pending, timeout=POLL_S, return_when="FIRST_COMPLETED")
                except TimeoutError:  # nothing finished: fine while some worker is there to run it
                    idle_since = self._check_workers(idle_since)
                    continue
                idle_since = None
                for future in done:
                    rows, env = _result(future, futures[future][2])
                    theirs = env.pop("git_commit")
                    if "unknown" not in (theirs, commit) and theirs != commit:
                        raise InputError(f"a Dask worker runs commit {theirs[:12]}, this checkout "
                                         f"{commit[:12]}: give every worker a checkout of the same commit")
                    yield (*futures[future], rows, env)
        finally:
            self.client.cancel(list(futures))

    def _check_workers(self, idle_since: float | None) -> float | None:
        """None while the cluster has a worker; else since when it has none, until that has lasted
        :func:`worker_timeout` seconds: then an InputError (queued tasks would wait forever)."""
        if self.client.nthreads():
            return None
        now = time.monotonic()
        if idle_since is None:
            print(f"waiting for a Dask worker at {self.where} (up to {worker_timeout():g} s, "
                  f"${TIMEOUT_ENV})", file=sys.stderr)
            return now
        if now - idle_since > worker_timeout():
            raise InputError(f"{self.where}: no Dask worker for {worker_timeout():g} s, and cells are "
                             f"still queued; start workers (`dask worker ADDRESS`) or raise ${TIMEOUT_ENV}")
        return idle_since


# tasks whose cells take minutes on a CPU (a zoo model's or a network file's images, MiniLM's layers)
# where the others take seconds
HEAVY = (*MODEL_TASKS, *FILE_TASKS, "pretrained")


def priorities(cells: list[Cell]) -> list[int]:
    """Dask priorities (higher first): the long cells before the short ones, and among them the longer
    chains of cells that share a model's norms first, so that the short cells fill the workers at the
    end of a run instead of one worker finishing a chain alone (longest processing time first). In
    `tox -e bench` the 2-block margin model's three certify cells, queued last, ran alone for their
    last ≈ 65 s of a 504 s run. A cell's rows do not depend on when it runs."""
    groups = [memo_group(c) for c in cells]
    size = Counter(groups)
    return [0 if c.task not in HEAVY else 1 + (size[g] if g is not None else 1)
            for c, g in zip(cells, groups, strict=True)]


def _result(future, cell: Cell):
    """A finished task's value; its failure as one InputError: a worker killed while running it
    (distributed's KilledWorker), or any exception of the task that is not an InputError."""
    try:
        return future.result()
    except InputError:
        raise
    except Exception as e:
        raise InputError(f"cell {cell.id} failed on a Dask worker: {type(e).__name__}: {e}") from None


def worker_timeout() -> float:
    """Seconds a run waits while its cluster has no worker at all (a scheduler started without
    workers, or every worker gone): ${TIMEOUT_ENV}, checked with the other $BENCH_* variables
    before the run starts (bench/core/env.py)."""
    return env_worker_timeout()


@contextlib.contextmanager
def cluster(workers: int | None = None, scheduler: str | None = None) -> Iterator[Cluster]:
    """A LocalCluster of ``workers`` processes (one thread each), or a client of ``scheduler``;
    closed on exit, also on error."""
    if workers is not None and scheduler is not None:
        raise InputError("--workers and --scheduler exclude each other: a local cluster or a running one")
    distributed = _distributed()
    if workers is not None:
        if workers < 1:
            raise InputError(f"--workers must be >= 1, got {workers}")
        # processes, not threads: the GIL would serialise much of a cell's Python; one Dask thread
        # each, since a cell sets its own torch thread count. The workers' logs are silenced: a
        # task's exception reaches the client and is said there once, as one error line. The
        # scheduler's HTTP server always starts; on any free local port, since a second run here (or
        # anything else on Dask's 8787) would draw a warning about the port
        with _local_config(), \
                distributed.LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                         dashboard_address="127.0.0.1:0",
                                         silence_logs=logging.CRITICAL) as local, \
                distributed.Client(local) as client:
            yield Cluster(client, f"{workers} local Dask workers")
        return
    try:
        client = distributed.Client(scheduler, timeout=CONNECT_TIMEOUT_S)
    # refused, timed out, not an address, or another server's bytes misread as a handshake (a
    # MemoryError from numpy, seen with a non-Dask port): whatever fails here, no scheduler is there
    except Exception as e:
        raise InputError(f"--scheduler {scheduler}: no Dask scheduler there "
                         f"({type(e).__name__}: {e})") from None
    with client:
        yield Cluster(client, f"Dask at {scheduler}")


def _local_config():
    """Dask's settings for the workers we start, each measured on the quick profile's cells: no
    statistical profiler (it samples the running task's stack every 10 ms: 10–20 % more CPU time),
    and glibc's own malloc trimming (Dask's MALLOC_TRIM_THRESHOLD_ turns off glibc's adaptive mmap
    threshold, so torch's tensors are mapped and unmapped afresh: three times the system time)."""
    import dask

    return dask.config.set({"distributed.worker.profile.enabled": False,
                            "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None,
                            "distributed.worker.preload": [__name__]})


def dask_setup(worker) -> None:
    """Run by each worker of ``--workers`` once it has started (Dask's preload, set above): Ctrl-C
    in a terminal reaches the whole process group, and each worker would die of it with a traceback
    of its own; the client alone stops a run, and closing the cluster stops the workers. Workers of
    a ``--scheduler`` cluster are not ours and keep their signals. Their allocator is set as the
    client's (:func:`bench.core.env.keep_freed_memory`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    keep_freed_memory()


def compute(cell_id: str, run: dict, device_arg: str, threads: int, after: object = None,
            plugins: Sequence[PluginFile] = (), partial: str | None = None,
            fingerprint: str | None = None) -> tuple[list[dict], dict]:
    """On a worker: the rows of one cell, and where they were computed. ``after`` (the result of the
    cell this one waits for, or None) is not read: it only orders the two on one worker. ``plugins``
    (the run's plugin files, as text) are registered for this cell alone. ``partial``: the run's
    folder of partial results, used where this worker sees it (a local one; another machine's
    worker keeps nothing, and its cells start over when cut short). ``fingerprint``: the client's of
    the cell's zoo model, which this worker's zoo file must have (None: no zoo model, nothing to check)."""
    torch.set_num_threads(threads)  # the client's count, so that a cell runs as it would serially
    device = resolve_device(device_arg)  # the worker's own: auto is its GPU if it has one
    cell = cell_from_id(cell_id)
    here = cell.model_fingerprint() if fingerprint is not None else None
    if here != fingerprint:
        raise InputError(f"a Dask worker's zoo file of {cell.model} is not the client's (fingerprint "
                         f"{here[:12]} there, {fingerprint[:12]} here): give every worker the same zoo/")
    state = _worker_state()
    seen = partial is not None and Path(partial).parent.is_dir()
    state.memo.store = DiskStore(Path(partial), code_salt()) if seen else None
    with using(plugins):
        rows = run_cell(cell, run, device, resolve_dtype(run["dtype"]), state.memo)
    return rows, {"torch_version": torch.__version__, "device": device.type,
                  "device_name": device_name(device), "git_commit": state.commit}


@dataclass
class WorkerState:
    """What a worker keeps between its cells, on the dask worker itself (no module-level state)."""

    memo: CertifyMemo  # each certify cell shares the norms of the one before it, as in a serial run
    commit: str  # the worker's checkout, asked once (git is a subprocess)


def _worker_state() -> WorkerState:
    """The :class:`WorkerState` of the worker this runs on, made by its first cell: the cells of one
    model run one after another on one worker (:meth:`Cluster.rows`), and each shares the norms of
    the one before it (:class:`bench.sweep.tasks.CertifyMemo`)."""
    from distributed import get_worker

    worker = get_worker()
    state = getattr(worker, "bench_state", None)
    if state is None:
        state = worker.bench_state = WorkerState(CertifyMemo(), git_state()[0])
    return state

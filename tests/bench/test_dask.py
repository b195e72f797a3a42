"""Sweeps on Dask (bench/sweep/distributed.py): a distributed run's table equals a serial run's, and every
bad option, a task's error, an unreachable scheduler and a missing Dask are one ``error:`` line."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
from helpers import cli, main_inprocess
from test_hardening import ONE, one_error
from test_runs import TINY

from bench.core.store import READ, load
from bench.sweep import distributed as bd
from bench.sweep import tasks
from bench.sweep.profiles import load_profile
from bench.sweep.runner import run_profile
from models import InputError

distributed = pytest.importorskip("distributed")
# what only the clock or the calendar decides; device_name stays, both runs are on this machine
TIMING = ["seconds", "pgd_seconds", "date"]


def _table(out: Path) -> pd.DataFrame:
    return pd.read_csv(out / "results.csv", **READ).drop(columns=TIMING)


@pytest.fixture(scope="module")
def serial(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("serial")
    (d / "tiny.toml").write_text(TINY)
    run_profile(load_profile(str(d / "tiny.toml")), d / "run", "cpu")
    return d


def test_local_workers_equal_the_serial_run(serial, capsys):
    out = serial / "dask"
    code, stdout, err = main_inprocess(capsys, "run", "--profile", serial / "tiny.toml", "--out", out,
                                       "--device", "cpu", "--workers", "2")
    assert code == 0 and "results:" in stdout, err
    assert "2 local Dask workers" in err
    # exact: the same code on the same bits, one thread each, and the same run order after
    # consolidation although the cells finished in any order
    pd.testing.assert_frame_equal(_table(serial / "run"), _table(out), check_exact=True)


@pytest.fixture(scope="module")
def scheduler():
    """A running cluster of one worker process, as `dask scheduler` + `dask worker` would be."""
    cluster = distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                                       dashboard_address="127.0.0.1:0", silence_logs=logging.CRITICAL)
    try:
        yield cluster.scheduler_address
    finally:
        cluster.close()


def test_scheduler_resumes_a_serial_run_and_equals_it(scheduler, profile, tmp_path, capsys):
    """A serial run less one cell, finished on a running cluster: the finished cell is not
    recomputed, and the table equals the serial run's."""
    out = tmp_path / "r"
    run_profile(load_profile(str(profile)), out, "cpu")
    serial = _table(out)
    cells = sorted((out / "cells").glob("*.csv"))
    cells[0].unlink()
    kept = cells[1].stat().st_mtime_ns
    code, _, err = main_inprocess(capsys, "run", "--profile", profile, "--out", out, "--scheduler",
                                  scheduler)
    assert code == 0, err
    assert cells[0].exists() and cells[1].stat().st_mtime_ns == kept
    pd.testing.assert_frame_equal(serial, _table(out), check_exact=True)
    assert set(load(out)["device"]) == {"cpu"}  # the worker's own, not a placeholder


@pytest.fixture
def profile(tmp_path) -> Path:
    (tmp_path / "one.toml").write_text(ONE)
    return tmp_path / "one.toml"


def test_task_error_on_a_worker_is_one_line(scheduler, profile, tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA: the worker's --device cuda must fail")
    code, _, err = main_inprocess(capsys, "run", "--profile", profile, "--out", tmp_path / "r",
                                  "--device", "cuda", "--scheduler", scheduler)
    one_error(code, err, "no CUDA device is available")


def test_task_error_keeps_the_finished_cells(profile, tmp_path, capsys, monkeypatch):
    """The second cell fails: the first is written, the error is one line, and a rerun resumes."""
    fail = "eps=0.1,"
    bounds = tasks.TASKS["bounds"]

    def failing(cell, *args):
        if fail in cell.id:
            raise InputError("planted failure")
        return bounds(cell, *args)

    _threads(monkeypatch)
    monkeypatch.setitem(tasks.TASKS, "bounds", failing)
    out = tmp_path / "r"
    code, _, err = main_inprocess(capsys, "run", "--profile", profile, "--out", out, "--workers", "1")
    one_error(code, err, "planted failure")
    assert len(list((out / "cells").glob("*.csv"))) == 1
    fail = "no cell has this"
    code, _, err = main_inprocess(capsys, "run", "--profile", profile, "--out", out, "--workers", "1")
    assert code == 0, err
    assert load(out)["cell_id"].nunique() == 2


def _threads(monkeypatch):
    """Local workers as threads, so that a task planted in this process is the one they run."""
    local = distributed.LocalCluster
    monkeypatch.setattr(distributed, "LocalCluster", lambda **kw: local(**(kw | {"processes": False})))


@pytest.mark.parametrize("error,words", [
    (lambda: RuntimeError("planted crash"), "RuntimeError: planted crash"),
    (lambda: distributed.KilledWorker("compute-1", SimpleNamespace(address="tcp://127.0.0.1:1"), 3),
     "KilledWorker"),
])
def test_worker_failure_is_one_line(error, words, profile, tmp_path, capsys, monkeypatch):
    """Any failure of a task on a worker (an exception of the task, a worker killed under it:
    KilledWorker) ends the run with one error line naming the cell, and exit code 2."""
    def failing(cell, *args):
        raise error()

    _threads(monkeypatch)
    monkeypatch.setitem(tasks.TASKS, "bounds", failing)
    code, _, err = main_inprocess(capsys, "run", "--profile", profile, "--out", tmp_path / "r",
                                  "--workers", "1")
    one_error(code, err, "failed on a Dask worker")
    assert words in err


def test_scheduler_without_workers_times_out(profile, tmp_path, capsys, monkeypatch):
    """A scheduler with no worker: said at once on stderr, then one error line after the timeout."""
    monkeypatch.setenv(bd.TIMEOUT_ENV, "1")
    monkeypatch.setattr(bd, "POLL_S", 0.2)
    with distributed.LocalCluster(n_workers=0, processes=False, dashboard_address="127.0.0.1:0",
                                  silence_logs=logging.CRITICAL) as empty:
        code, _, err = main_inprocess(capsys, "run", "--profile", profile, "--out", tmp_path / "r",
                                      "--scheduler", empty.scheduler_address)
    one_error(code, err, "no Dask worker for 1 s")
    assert "waiting for a Dask worker" in err


@pytest.mark.parametrize("value", ["soon", "0", "-3"])
def test_bad_worker_timeout(value, monkeypatch):
    monkeypatch.setenv(bd.TIMEOUT_ENV, value)
    with pytest.raises(InputError, match=bd.TIMEOUT_ENV):
        bd.worker_timeout()


@pytest.mark.parametrize("args,words", [
    (["--workers", "0"], "expected an integer >= 1, got '0'"),
    (["--workers", "-2"], "expected an integer >= 1, got '-2'"),
    (["--workers", "two"], "expected an integer, got 'two'"),
    (["--workers", "2", "--scheduler", "tcp://127.0.0.1:8786"], "not allowed with argument"),
])
def test_bad_dask_options(args, words, profile, tmp_path, capsys):
    code, _, err = main_inprocess(capsys, "run", "--profile", profile, "--out", tmp_path / "r", *args)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:9", "nonsense"])
def test_unreachable_scheduler(address, profile, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bd, "CONNECT_TIMEOUT_S", 2.0)
    code, _, err = main_inprocess(capsys, "run", "--profile", profile, "--out", tmp_path / "r",
                                  "--scheduler", address)
    one_error(code, err, f"--scheduler {address}: no Dask scheduler there")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("option", [["--workers", "2"], ["--scheduler", "tcp://127.0.0.1:8786"]])
def test_missing_dask_names_the_extra(option, profile, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "distributed", None)  # what `import distributed` then raises
    code, _, err = main_inprocess(capsys, "run", "--profile", profile, "--out", tmp_path / "r", *option)
    one_error(code, err, "pip install 'attnbounds[dask]'")
    assert not (tmp_path / "r").exists()



def test_local_workers_say_nothing_but_the_bar_and_the_result(tmp_path):
    """The scheduler lives in the client's process and logs at INFO (its start, its ports, one line
    per cell it lets go of); with auto_LiRPA imported (a CROWN cell), whose import set the root
    logger to INFO on stdout, those lines reached the terminal. stderr keeps to the bar."""
    (tmp_path / "p.toml").write_text('[run]\npgd_steps = 2\npgd_restarts = 1\n[[sweep]]\nname = "c"\n'
                                     'task = "crown"\nn = 3\nd = 4\nh = 2\neps = [0.01, 0.1]\n')
    done = cli("run", "--profile", tmp_path / "p.toml", "--out", tmp_path / "r", "--workers", "2",
               cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    output = done.stdout + done.stderr
    assert "INFO" not in output and "Scheduler" not in output, output
    assert "results:" in done.stdout


CERTIFY = """
[run]
pgd_steps = 3
pgd_restarts = 1
[[sweep]]
name = "certify"
task = "certify"
dataset = "digits"
model = ["digits-d32-b1-h2-c0.5-q1-m0.003", "digits-d32-b2-h1-c0.5-q1-m0.003"]
eps = [0.01, 0.02, 0.05]
samples = 2
"""


def test_certify_cells_of_a_model_run_in_order_on_one_worker(tmp_path, capsys, monkeypatch):
    """The cells that share a model's certified norms (tasks.memo_group) run one after another on
    one worker, in the profile's order, so that its memo serves the later ε; the other model's
    cells run beside them on the other worker."""
    ran: list[tuple[str, str, float]] = []
    memos: dict[str, set[int]] = {}
    certify = tasks.TASKS["certify"]

    def recording(cell, *args):
        ran.append((cell.model, distributed.get_worker().address, cell.eps))
        memos.setdefault(cell.model, set()).add(id(args[-1]))  # the worker's CertifyMemo
        return certify(cell, *args)

    _threads(monkeypatch)
    monkeypatch.setitem(tasks.TASKS, "certify", recording)
    (tmp_path / "c.toml").write_text(CERTIFY)
    code, _, err = main_inprocess(capsys, "run", "--profile", str(tmp_path / "c.toml"), "--out",
                                  tmp_path / "r", "--workers", "2")
    assert code == 0, err
    assert len(ran) == 6
    for model in {m for m, _, _ in ran}:
        assert len({w for m, w, _ in ran if m == model}) == 1, ran
        assert [e for m, _, e in ran if m == model] == [0.01, 0.02, 0.05], ran
    assert load(tmp_path / "r")["cell_id"].nunique() == 6
    assert all(len(ids) == 1 for ids in memos.values()), memos  # one memo serves each model's chain
    assert [tasks.memo_group(c) is not None for _, c in load_profile(str(tmp_path / "c.toml")).cells()] \
        == [True] * 6


LIGHT_THEN_HEAVY = """
[run]
pgd_steps = 3
pgd_restarts = 1
[[sweep]]
name = "light"
kind = "dot"
n = 4
d = 8
h = 2
eps = [0.01, 0.03, 0.05, 0.1]
[[sweep]]
name = "certify"
task = "certify"
dataset = "digits"
model = "digits-d32-b1-h2-c0.5-q1-m0.003"
eps = [0.01, 0.02]
samples = 2
"""


def test_the_long_cells_are_queued_first(tmp_path, capsys, monkeypatch):
    """On one worker, a certify chain listed after four layer cells starts first and is done before
    the last of them (Dask priorities, bd.priorities; a worker holds one queued task beside the running
    one, so a short cell may run between the chain's two), so that the short cells fill the end of a
    run; the chain keeps its order. Submitted in the profile's order, the chain ran last."""
    ran: list[str] = []

    def recording(real):
        def task(cell, *args):
            ran.append(f"{cell.task} {cell.eps}")
            return real(cell, *args)
        return task

    for name in ("certify", "bounds"):
        monkeypatch.setitem(tasks.TASKS, name, recording(tasks.TASKS[name]))
    _threads(monkeypatch)
    (tmp_path / "p.toml").write_text(LIGHT_THEN_HEAVY)
    code, _, err = main_inprocess(capsys, "run", "--profile", str(tmp_path / "p.toml"), "--out",
                                  tmp_path / "r", "--workers", "1")
    assert code == 0, err
    assert len(ran) == 6 and ran[0] == "certify 0.01", ran
    assert ran.index("certify 0.02") < 3 and ran[-1].startswith("bounds"), ran


def test_priorities_rank_chains_then_long_cells_then_the_rest():
    cells = [c for _, c in load_profile("quick").cells()]
    rank = dict(zip((c.id for c in cells), bd.priorities(cells), strict=True))
    heavy = [rank[c.id] for c in cells if c.task in bd.HEAVY]
    light = [rank[c.id] for c in cells if c.task not in bd.HEAVY]
    assert min(heavy) > max(light) == 0
    chained = [rank[c.id] for c in cells if c.task == "certify" and c.model.endswith("q1-m0.003")]
    single = [rank[c.id] for c in cells if c.task == "pretrained"]
    assert min(chained) > max(single)


def test_a_serial_run_shares_a_models_norms_between_its_cells(tmp_path, monkeypatch):
    """The runner's CertifyMemo (tasks.run_cell): the cells of one model share one memo dict, which
    holds the norms after the first; another model's cell starts a fresh one."""
    import torch

    (tmp_path / "c.toml").write_text(CERTIFY)
    cells = [c for _, c in load_profile(str(tmp_path / "c.toml")).cells()]
    held: list[dict] = []
    real = tasks.run_certify

    def recording(*args, **kwargs):
        held.append(kwargs["memo"])
        return real(*args, **kwargs)

    monkeypatch.setattr(tasks, "run_certify", recording)
    memo = tasks.CertifyMemo()
    run = {"pgd_steps": 3, "pgd_restarts": 1, "seed": 0}
    for cell in (cells[0], cells[1], cells[3]):
        tasks.run_cell(cell, run, torch.device("cpu"), torch.float64, memo)
    assert cells[0].model == cells[1].model != cells[3].model
    assert held[0] is held[1] and held[2] is not held[0] and held[0]


def test_a_worker_whose_zoo_file_is_not_the_clients_refuses_the_cell(tmp_path, monkeypatch):
    """Another machine's worker reads its own zoo/: a cell of a model whose file there is not the one
    the client's run.json names (its fingerprint) is refused before it runs; the same file runs."""
    from test_hardening import TRAINED

    (tmp_path / "t.toml").write_text(TRAINED)
    (_, cell), = load_profile(str(tmp_path / "t.toml")).cells()
    run = {"pgd_steps": 3, "pgd_restarts": 1, "dtype": "float64", "seed": 0}
    with pytest.raises(InputError, match=r"worker's zoo file of digits-d32-b2-h2-c0.5 is not the client's"):
        bd.compute(cell.id, run, "cpu", 1, fingerprint="0" * 64)
    # outside a worker: the state a worker would make for itself
    monkeypatch.setattr(bd, "_worker_state", lambda: bd.WorkerState(tasks.CertifyMemo(), "unknown"))
    rows, env = bd.compute(cell.id, run, "cpu", 1, fingerprint=cell.model_fingerprint())
    assert rows and env["device"] == "cpu"

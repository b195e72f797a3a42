"""Issue #25, item 1, "one place that checks the inputs at the edge": a thread count the machine
cannot give, an unknown $BENCH_* value, a profile axis with a value twice or of the wrong TOML type,
and a cell too large for this machine's memory are each refused with one ``error:`` line and exit
code 2 before any work, and nothing is written.

In process but for the thread count that crashed the interpreter (a subprocess with a timeout).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ONE, ROOT, main_inprocess, one_error

import bench.core.env
import bench.sweep.runner
import bench.sweep.tasks
from bench.sweep.profiles import load_profile
from models import InputError

GiB = 1 << 30


@pytest.fixture(autouse=True)
def threads_kept():
    """The in-process runs set torch's threads: the next test gets the count this one found."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def profile(tmp_path) -> Path:
    (tmp_path / "one.toml").write_text(ONE)
    return tmp_path / "one.toml"


@pytest.fixture
def no_cells(monkeypatch):
    """Cells that fail the test if they run: every refusal here must come before the first."""
    def task(*args, **kwargs):
        raise AssertionError("a cell ran before the refusal")

    for name in list(bench.sweep.tasks.TASKS):  # run_cell looks a cell's task up there
        monkeypatch.setitem(bench.sweep.tasks.TASKS, name, task)


def refused(capsys, tmp_path: Path, *args, words: str) -> str:
    """One error line holding ``words``, exit 2, no stdout, nothing written under ``tmp_path``."""
    before = set(tmp_path.rglob("*"))
    code, out, err = main_inprocess(capsys, *args)
    one_error(code, err, words)
    assert len(err.splitlines()) == 1 and out == "", err
    assert set(tmp_path.rglob("*")) == before, "a refused command wrote or removed files"
    return err.strip()


# --- threads --------------------------------------------------------------------------------------

def test_a_huge_bench_threads_is_refused_not_a_segfault(profile, tmp_path):
    """BENCH_THREADS=99999 ended the process with SIGSEGV at torch's first parallel kernel."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), BENCH_THREADS="99999")
    done = subprocess.run([sys.executable, "-m", "bench", "run", "--profile", profile, "--out", "out"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, (done.returncode, done.stderr)
    one_error(done.returncode, done.stderr, "$BENCH_THREADS=99999 is more threads than the")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", [
    ["run", "--profile", "PROFILE", "--list"],
    ["point", "--layer", "missing.safetensors", "--input", "missing.safetensors", "--eps", "0.1"],
])
def test_bench_threads_above_the_cpus_is_refused(command, profile, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench.core.env, "available_cpus", lambda: 1)
    monkeypatch.setenv("BENCH_THREADS", "2")
    command = [str(profile) if c == "PROFILE" else c for c in command]
    refused(capsys, tmp_path, *command, words="$BENCH_THREADS=2 is more threads than the 1 CPUs")


@pytest.mark.parametrize("command", [
    ["--threads", "2", "run", "--profile", "PROFILE", "--list"],
    ["certify", "--threads", "2", "--model", "missing.safetensors"],
    ["train", "--threads", "2", "--d", "8", "--depth", "1", "--heads", "1", "--out", "OUT"],
])
def test_threads_flags_above_the_cpus_are_refused(command, profile, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench.core.env, "available_cpus", lambda: 1)
    paths = {"PROFILE": str(profile), "OUT": str(tmp_path / "m.safetensors")}
    command = [paths.get(c, c) for c in command]
    refused(capsys, tmp_path, *command, words="--threads 2 is more threads than the 1 CPUs")


def test_threads_up_to_the_cpus_are_taken(profile, capsys, monkeypatch):
    monkeypatch.setattr(bench.core.env, "available_cpus", lambda: 2)
    for value in ("1", "2", " 2 ", ""):
        monkeypatch.setenv("BENCH_THREADS", value)
        code, _, err = main_inprocess(capsys, "run", "--profile", profile, "--list")
        assert code == 0, err
    assert bench.core.env.set_threads(None) == 1  # $BENCH_THREADS empty: the default


# --- the other $BENCH_* variables -----------------------------------------------------------------

@pytest.mark.parametrize("var, value, words", [
    ("BENCH_MALLOC", "xyz", "$BENCH_MALLOC must be unset (the suite's: keep freed memory) or 'system'"),
    ("BENCH_MALLOC", "jemalloc", "got 'jemalloc'"),
    ("BENCH_DASK_WORKER_TIMEOUT", "soon", "$BENCH_DASK_WORKER_TIMEOUT must be a number of seconds"),
    ("BENCH_DASK_WORKER_TIMEOUT", "-3", "must be a finite number of seconds > 0, got '-3'"),
    ("BENCH_DASK_WORKER_TIMEOUT", "inf", "must be a finite number of seconds > 0, got 'inf'"),
    ("BENCH_DASK_WORKER_TIMEOUT", "nan", "got 'nan'"),
])
def test_bench_env_values_are_checked_up_front(var, value, words, profile, tmp_path, capsys, monkeypatch):
    """Checked by every command before any work, also where the variable would be read only later
    (the Dask timeout, when a cluster has no worker) or never (a serial run)."""
    monkeypatch.setenv(var, value)
    refused(capsys, tmp_path, "run", "--profile", profile, "--list", words=words)


@pytest.mark.parametrize("value", ["system", "SYSTEM", " system ", ""])
def test_known_allocator_names_are_taken(value, profile, capsys, monkeypatch):
    monkeypatch.setenv("BENCH_MALLOC", value)
    code, _, err = main_inprocess(capsys, "run", "--profile", profile, "--list")
    assert code == 0, err


# --- profile axes: as the command line's lists ---------------------------------------------------

def _profile_with(line: str, tmp_path) -> str:
    """ONE with ``line`` in place of its own line for the same key, written to p.toml; the key."""
    key = line.split()[0]
    text = "\n".join(ln for ln in ONE.splitlines() if not ln.startswith(f"{key} ")) + f"\n{line}\n"
    (tmp_path / "p.toml").write_text(text)
    return key


@pytest.mark.parametrize("line, words", [
    ("eps = [0.01, 0.01]", "axis eps lists 0.01 twice"),
    ("h = [2, 2]", "axis h lists 2 twice"),
    ('kind = ["dot", "l2", "dot"]', "axis kind lists 'dot' twice"),
    ("x_norm = [1, 1.0]", "axis x_norm lists 1.0 twice"),
    ("residual = [true, true]", "axis residual lists True twice"),
    ("seed = [0, 1, 0]", "axis seed lists 0 twice"),
])
def test_a_profile_axis_may_not_list_a_value_twice(line, words, tmp_path, capsys):
    key = _profile_with(line, tmp_path)
    err = refused(capsys, tmp_path, "run", "--profile", tmp_path / "p.toml", "--out", tmp_path / "out",
                  words=words)
    assert f"profile {tmp_path / 'p.toml'}: sweep 'one': axis {key}" in err


@pytest.mark.parametrize("line, words", [
    ('n = "16"', "n = '16' is not a valid int: expected an unquoted integer"),
    ("n = 16.0", "n = 16.0 is not a valid int"),
    ("n = 16.5", "n = 16.5 is not a valid int"),  # refused before as well, by another path
    ("d = [4, 8.0]", "d = 8.0 is not a valid int"),
    ('samples = "2"', "samples = '2' is not a valid int"),
    ("depth = true", "depth = True is not a valid int"),
    ('seed = "1"', "seed = '1' is not a valid int"),
    ('sentence = "0"', "sentence = '0' is not a valid int"),
    ('eps = "0.01"', "eps = '0.01' is not a valid float: expected an unquoted number"),
    ("w_vo = true", "w_vo = True is not a valid float"),
    ('residual = "yes"', "residual = 'yes' is not a valid bool: expected true or false"),
])
def test_a_profile_value_must_have_its_fields_toml_type(line, words, tmp_path, capsys):
    _profile_with(line, tmp_path)
    err = refused(capsys, tmp_path, "run", "--profile", tmp_path / "p.toml", "--list", words=words)
    assert f"profile {tmp_path / 'p.toml'}: sweep 'one'" in err


def test_a_float_axis_takes_toml_integers(tmp_path):
    (tmp_path / "p.toml").write_text(ONE + "x_norm = [1, 2]\nw_vo = 1\n")
    cells = [c for _, c in load_profile(str(tmp_path / "p.toml")).cells()]
    assert {c.x_norm for c in cells} == {1.0, 2.0} and all(isinstance(c.x_norm, float) for c in cells)


@pytest.mark.parametrize("flag, value", [("--n", "16.0"), ("--samples", "1e1"), ("--depth", "2.5")])
def test_integer_flags_take_integers_only(flag, value, profile, tmp_path, capsys):
    refused(capsys, tmp_path, "run", "--profile", profile, "--list", flag, value,
            words=f"{flag}: {flag[2:]} = '{value}' is not a valid int")


# --- memory: an impossible cell is refused before the first cell runs ----------------------------

def test_an_impossible_cell_is_refused_within_seconds(profile, no_cells, tmp_path, capsys):
    """``--n 100000000`` ran until the OOM killer ended it: 10¹⁶ attention entries per head."""
    err = refused(capsys, tmp_path, "run", "--profile", profile, "--out", tmp_path / "out",
                  "--n", "100000000", words="sweep 'one' cell dot[n=100000000,d=4,h=2,")
    assert "needs at least 5.96e+08 GiB (the n×n attention of every head over PGD's restarts)" in err
    # the memory a run would use: a GPU's where --device auto finds one (a lent H100 said "of GPU")
    assert f"GiB of {'GPU' if torch.cuda.is_available() else 'RAM'} available" in err


def test_the_largest_cell_over_the_memory_is_named(profile, no_cells, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("bench.sweep.memory.available_bytes", lambda device: GiB)
    refused(capsys, tmp_path, "run", "--profile", profile, "--out", tmp_path / "out",
            "--n", "16,8192", "--d", "32", "--heads", "2", words="cell dot[n=8192,d=32,h=2,")


def test_check_memory_compares_each_cell_with_what_is_available(monkeypatch):
    from bench.sweep.memory import cell_bytes, check_memory

    cells = load_profile("quick").cells()
    need = max(cell_bytes(c, 6)[0] for _, c in cells)
    monkeypatch.setattr("bench.sweep.memory.available_bytes", lambda device: need)
    check_memory(cells, 6, None)
    monkeypatch.setattr("bench.sweep.memory.available_bytes", lambda device: need - 1)
    with pytest.raises(InputError, match="more than the"):
        check_memory(cells, 6, None)
    monkeypatch.setattr("bench.sweep.memory.available_bytes", lambda device: None)
    check_memory(cells, 6, None)  # a machine that cannot tell: not refused


@pytest.mark.parametrize("name", ["quick", "crown", "paper"])
def test_the_shipped_profiles_fit_in_24_gib(name):
    """Each cell as the runner builds it (load_profile, the profile's restarts), never run."""
    from bench.sweep.memory import cell_bytes

    p = load_profile(name)
    sizes = {c.id: cell_bytes(c, p.run["pgd_restarts"]) for _, c in p.cells()}
    worst = max(sizes, key=lambda k: sizes[k][0])
    assert sizes[worst][0] < 24 * GiB, (worst, sizes[worst])
    assert sizes[worst][0] > 0  # the estimate sees something in every profile

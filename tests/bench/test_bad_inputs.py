"""Issue #15, "every bad input one line": each input a user tried that gave a traceback, or was
silently accepted, now gives exactly one ``error:`` line on stderr, exit code 2 and nothing written;
Ctrl-C during ``run`` gives one ``interrupted:`` line naming the resume command, exit code 130.

The refusals are checked in process (fast); a train case also proves it refused before training, by
a trainer that fails the test if it is called.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import ONE, ROOT, main_inprocess
from safetensors.torch import save_file

import bench.cli.train_cmd
import bench.nets.accuracy
import bench.nets.train
import bench.nets.zoo
import bounds
import models
from bench.core import store

# the CLI's two prefixes: argparse's ("python -m bench train: error: ...") and the library's
ERROR = re.compile(r"^(python -m bench( [a-z]+)?: )?error: ")


def files_under(path: Path) -> set[Path]:
    return {p for p in path.rglob("*")}


def refused(capsys, tmp_path: Path, *args, words: str = "") -> str:
    """Runs the CLI in process; asserts exit 2, one stderr line with the error prefix, no stdout,
    and not a file created or removed under ``tmp_path``; returns the line."""
    before = files_under(tmp_path)
    code, out, err = main_inprocess(capsys, *args)
    lines = err.splitlines()
    assert code == 2, err
    assert len(lines) == 1 and ERROR.match(lines[0]), err
    assert words in lines[0], err
    assert out == "" and "Traceback" not in err
    assert files_under(tmp_path) == before, "a refused command wrote or removed files"
    return lines[0]


@pytest.fixture
def files(tmp_path) -> dict[str, Path]:
    """A tiny layer and input, and the bad variants of the issue, in ``tmp_path/in``."""
    d = tmp_path / "in"
    d.mkdir()
    layer = models.random_dot(4, 2, seed=0, residual=True)
    X = models.random_input(3, 4, norm=1.0, seed=1)[0]
    models.save_layer(d / "layer.safetensors", layer)
    models.save_input(d / "x.safetensors", X)
    models.save_input(d / "x1e200.safetensors", X * 1e200)
    t, meta = models.io.layer_to_tensors(layer)
    save_file({**t, "W_q": (t["W_q"] * 10).to(torch.int32)}, str(d / "int32.safetensors"), metadata=meta)
    save_file({**t, "extra": torch.zeros(2)}, str(d / "extra.safetensors"), metadata=meta)
    stack = models.random_stack("dot", 2, 4, 2, seed=3, R=1.0)
    models.save_layer(d / "stack.safetensors", stack)
    st, sm = models.io.read_file(d / "stack.safetensors")
    save_file({**st, "blocks.1.W_v": st["blocks.1.W_v"].to(torch.int64)}, str(d / "stack_int.safetensors"),
              metadata=sm)
    save_file({"X": torch.arange(12).reshape(3, 4)}, str(d / "x_int64.safetensors"))
    save_file({"X": X.clone(), "Y": X.clone()}, str(d / "x_extra.safetensors"))
    return {p.stem: p for p in d.iterdir()}


def point(files, *args, layer="layer", x="x", eps="0.05") -> list[str]:
    return ["point", "--layer", files[layer], "--input", files[x], "--eps", eps, "--pgd-steps", "2",
            "--pgd-restarts", "1", *args]


# --- point: files, ε, overflow, bound lists -------------------------------------------------------

@pytest.mark.parametrize("case, kw, args, words", [
    ("input scaled by 1e200", {"x": "x1e200"}, [], "X has an entry of magnitude 7.17e+199, beyond the 1e+12"),
    ("eps 1e308", {"eps": "1e308"}, [], "eps = 1e+308 is beyond 1e+12"),
    ("eps inf", {"eps": "inf"}, [], "finite"),
    ("int32 weights", {"layer": "int32"}, [], "W_q has dtype int32"),
    ("int64 block of a stack", {"layer": "stack_int"}, [], "block 1: W_v has dtype int64"),
    ("an unknown extra tensor", {"layer": "extra"}, [], "unknown tensor 'extra'"),
    ("int64 X", {"x": "x_int64"}, [], "X has dtype int64"),
    ("a second tensor in an input file", {"x": "x_extra"}, [], "unknown tensor 'Y'"),
    ("--bounds ,", {}, ["--bounds", ","], "--bounds must be a comma-separated list, got an empty list"),
    ("--bounds ''", {}, ["--bounds", ""], "got an empty list ''"),
    ("--bounds naive,", {}, ["--bounds", "naive,"], "without empty items"),
    ("--bounds naive,naive", {}, ["--bounds", "naive,naive"], "lists 'naive' twice"),
])
def test_point_refuses(case, kw, args, words, files, tmp_path, capsys):
    refused(capsys, tmp_path, *point(files, *args, **kw), words=words)


def test_point_refuses_a_value_that_overflows_after_the_work(files, tmp_path, capsys, monkeypatch):
    """The net under the limits: an inf bound is never printed next to a finite PGD value."""
    real = bounds.evaluate_certified

    def overflowing(bound, layer, X, eps, **options):
        v = real(bound, layer, X, eps, **options)
        return type(v)(v.value * math.inf, v.certificate, v.reused_seconds)

    monkeypatch.setattr(bounds, "evaluate_certified", overflowing)
    refused(capsys, tmp_path, *point(files), words="cannot be computed at this input: its value is inf")


def test_point_turns_a_linalg_failure_into_one_line(files, tmp_path, capsys, monkeypatch):
    def failing(bound, layer, X, eps, **options):
        raise torch.linalg.LinAlgError("linalg.svd: The algorithm failed to converge")

    monkeypatch.setattr(bounds, "evaluate_certified", failing)
    refused(capsys, tmp_path, *point(files), words="failed to converge")


def test_limits_hold_for_the_files_the_suite_ships(tmp_path):
    """The new checks refuse nothing the suite writes: the zoo's models, a layer with biases, a
    stack (the pretrained export: tests/models/test_pretrained.py round-trips it)."""
    for path in sorted((ROOT / "zoo").glob("*.safetensors")):
        models.vit_io.load_vit(path)
    for layer in (models.random_dot(8, 2, seed=0, bias_norm=0.5),
                  models.random_stack("olsa", 2, 6, 3, seed=4, R=None, n=4, c=1.0)):
        models.save_layer(tmp_path / "l.safetensors", layer)
        assert models.load_layer(tmp_path / "l.safetensors").kind == layer.kind


# --- threads --------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["abc", "0", "-3", "1.5"])
def test_bench_threads_env_is_checked(value, files, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("BENCH_THREADS", value)
    refused(capsys, tmp_path, *point(files), words="$BENCH_THREADS must be an integer >= 1")


@pytest.mark.parametrize("value", ["0", "-1"])
def test_global_threads_must_be_at_least_1(value, files, tmp_path, capsys):
    refused(capsys, tmp_path, "--threads", value, *point(files), words="expected an integer >= 1")


# --- run: comma lists, profiles, --out -------------------------------------------------------------

@pytest.fixture
def profile(tmp_path) -> Path:
    (tmp_path / "one.toml").write_text(ONE)
    return tmp_path / "one.toml"


@pytest.mark.parametrize("flag, value, words", [
    ("--eps", "0.01,,0.02", "without empty items"),
    ("--eps", "0.01,", "without empty items"),
    ("--eps", "0.05,0.050", "lists a value twice"),
    ("--heads", "", "empty list"),
])
def test_run_comma_lists_follow_one_rule(flag, value, words, profile, tmp_path, capsys):
    refused(capsys, tmp_path, "run", "--profile", profile, "--out", tmp_path / "out", flag, value,
            words=words)


@pytest.mark.parametrize("sweep, words", [
    ('kind = "dot"\nn = 3\nd = 4\nh = 2', "sweep #1 has no name"),
    ('name = 5\nkind = "dot"', "name must be a non-empty string, got 5"),
    ('name = ""\nkind = "dot"', "name must be a non-empty string"),
    ('name = "a"\nkind = "dot"\nn = 3\nd = 4\nh = 2\nseed = -1', "seed must be >= 0, got -1"),
    ('name = "a"\nkind = "dot"\nn = 3\nd = 4\nh = 2\nx_norm = 1e200', "x_norm = 1e+200 is beyond"),
    ('name = "a"\nkind = "dot"\nn = 3\nd = 4\nh = 2\neps = 1e300', "eps = 1e+300 is beyond"),
])
def test_run_refuses_a_bad_sweep(sweep, words, tmp_path, capsys):
    (tmp_path / "p.toml").write_text(f"[[sweep]]\n{sweep}\n")
    refused(capsys, tmp_path, "run", "--profile", tmp_path / "p.toml", "--out", tmp_path / "out",
            words=words)


def test_run_out_must_be_a_run_directory(profile, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("x")
    for extra in ([], ["--fresh"]):
        refused(capsys, tmp_path, "run", "--profile", profile, "--out", mine, *extra,
                words="is not a run directory: it holds thesis.tex")
    assert sorted(p.name for p in mine.iterdir()) == ["thesis.tex"]


@pytest.mark.parametrize("command", [["run", "--profile", "one.toml", "--out", ""],
                                     ["report", "results", "--out", ""],
                                     ["train", "--out", ""]])
def test_an_empty_path_is_not_a_default(command, profile, tmp_path, capsys):
    command = [str(profile) if c == "one.toml" else c for c in command]
    refused(capsys, tmp_path, *command, words="empty string")


# --- train: checked before any training ----------------------------------------------------------

@pytest.fixture
def no_training(monkeypatch):
    """Training that fails the test: every refusal here must come before it."""
    def trainer(*args, **kwargs):
        raise AssertionError("trained before refusing")

    monkeypatch.setattr(bench.cli.train_cmd, "train", trainer)
    monkeypatch.setattr(bench.nets.zoo, "train", trainer)


TRAIN = ["train", "--d", "8", "--depth", "1", "--heads", "1", "--epochs", "1"]


@pytest.mark.parametrize("args, words", [
    (["--patch", "0"], "patch must be a positive integer, got 0"),
    (["--ffn", "0"], "ffn must be a positive integer, got 0"),
    (["--qk-constraint", ""], "a constraint must be a number > 0 or none, got ''"),
])
def test_train_refuses_bad_options(args, words, no_training, tmp_path, capsys):
    refused(capsys, tmp_path, *TRAIN, *args, "--out", tmp_path / "m.safetensors", words=words)


def test_train_refuses_a_negative_seed_before_loading_data(tmp_path, capsys, monkeypatch):
    def no_data(name):
        raise AssertionError("loaded the data before refusing")

    monkeypatch.setattr(bench.nets.train, "load_dataset", no_data)
    refused(capsys, tmp_path, *TRAIN, "--seed", "-1", "--out", tmp_path / "m.safetensors",
            words="seed must be >= 0")


def test_train_out_that_cannot_be_written(no_training, tmp_path, capsys):
    if not Path("/proc").is_dir():
        pytest.skip("no /proc here")
    refused(capsys, tmp_path, *TRAIN, "--out", "/proc/x.safetensors", words="cannot write in /proc")


def test_train_out_under_a_file(no_training, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    refused(capsys, tmp_path, *TRAIN, "--out", tmp_path / "afile" / "m.safetensors",
            words="is a file, not a directory")


@pytest.mark.parametrize("existing", ["m.safetensors", "m.json"])
def test_train_does_not_overwrite_without_force(existing, no_training, tmp_path, capsys):
    (tmp_path / existing).write_text("mine")
    refused(capsys, tmp_path, *TRAIN, "--out", tmp_path / "m.safetensors", words="pass --force")
    assert (tmp_path / existing).read_text() == "mine"


def test_train_force_overwrites(tmp_path, capsys, monkeypatch):
    calls = []

    def trainer(cfg, dataset, **kw):
        calls.append(kw)
        raise models.InputError("stopped after the checks")

    monkeypatch.setattr(bench.cli.train_cmd, "train", trainer)
    (tmp_path / "m.safetensors").write_text("mine")
    refused(capsys, tmp_path, *TRAIN, "--out", tmp_path / "m.safetensors", "--force",
            words="stopped after the checks")
    assert len(calls) == 1  # the checks passed: training was reached


def test_train_zoo_out_that_is_a_file(no_training, tmp_path, capsys):
    (tmp_path / "existing.safetensors").write_text("mine")
    refused(capsys, tmp_path, "train", "--zoo", "--out", tmp_path / "existing.safetensors",
            words="is a file, not a directory")


def test_train_default_out_is_git_ignored_and_zoo_stays(tmp_path, capsys, monkeypatch):
    seen = {}

    def trainer(cfg, dataset, **kw):
        raise models.InputError("stopped after the checks")

    def check_out(out, force):
        seen["out"] = out

    monkeypatch.setattr(bench.cli.train_cmd, "train", trainer)
    monkeypatch.setattr(bench.cli.train_cmd, "check_out", check_out)
    code, _, _ = main_inprocess(capsys, *TRAIN)
    assert code == 2
    assert seen["out"].parent == ROOT / "results" / "latest" / "zoo"
    ignored = subprocess.run(["git", "check-ignore", "-q", str(seen["out"])], cwd=ROOT)
    if ignored.returncode == 128:
        pytest.skip("not a git checkout")
    assert ignored.returncode == 0, f"{seen['out']} is not git-ignored"
    assert bench.cli.train_cmd.OUT_DIR != ROOT / "zoo"


# --- certify --------------------------------------------------------------------------------------

TINY_MODEL = ROOT / "zoo" / "tiny-digits-d16-b1-h1-c0.5.safetensors"


@pytest.mark.parametrize("bounds_arg, words", [("", "got an empty list ''"), (",", "got an empty list"),
                                               ("naive,,taylor", "without empty items")])
def test_certify_bounds_list(bounds_arg, words, tmp_path, capsys):
    refused(capsys, tmp_path, "certify", "--model", TINY_MODEL, "--limit", "1", "--bounds", bounds_arg,
            words=words)


def test_certify_seed(tmp_path, capsys):
    refused(capsys, tmp_path, "certify", "--model", TINY_MODEL, "--limit", "1", "--seed", "-1",
            words="--seed must be >= 0")


# --- Ctrl-C during run ----------------------------------------------------------------------------

INTERRUPTIBLE = ONE.replace("eps = [0.01, 0.1]", "eps = [0.01, 0.02, 0.03, 0.04, 0.05, 0.06]")


def _interrupt(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    """Starts a run in its own process group, waits for its first finished cell, then sends SIGINT
    to the whole group, as Ctrl-C in a terminal does (Dask workers included)."""
    (tmp_path / "p.toml").write_text(INTERRUPTIBLE)
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(ROOT), BENCH_THREADS="1")
    p = subprocess.Popen([sys.executable, "-m", "bench", "run", "--profile", "p.toml", "--out", "out",
                          *extra], cwd=tmp_path, env=env, start_new_session=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         # a shell without job control (CI's, nohup's) starts background jobs with
                         # SIGINT ignored, and an ignored signal stays ignored across exec: give the
                         # run the terminal's default, as a user pressing Ctrl-C has it
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 240
    try:
        while not any((out / "cells").glob("*.csv")):
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline, "no cell finished in 240 s"
            time.sleep(0.02)
        os.killpg(p.pid, signal.SIGINT)
        stdout, stderr = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr), out


def _check_interrupted(r: subprocess.CompletedProcess, out: Path) -> str:
    assert r.returncode == 130, r.stderr
    assert "Traceback" not in r.stderr and "error:" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if "%|" not in line and line.strip()]
    assert len(lines) == 1 and lines[0].startswith("interrupted: "), r.stderr  # the bar aside
    kept = len(list((out / "cells").glob("*.csv")))
    assert 1 <= kept < 6 and f"{kept} of 6 cells kept in" in lines[0], r.stderr
    assert "--fresh" not in lines[0]
    assert not list(out.glob(".*.tmp")) and not list((out / "cells").glob(".*.tmp"))
    with store.lock(out):  # released: a second run could start
        pass
    return lines[0].split("resume with: ", 1)[1]


def test_ctrl_c_keeps_finished_cells_and_names_the_resume_command(tmp_path):
    r, out = _interrupt(tmp_path)
    command = _check_interrupted(r, out)
    argv = shlex.split(command)
    assert argv[:4] == ["python", "-m", "bench", "run"] and str(out.resolve()) in argv
    env = dict(os.environ, PYTHONPATH=str(ROOT), BENCH_THREADS="1")
    again = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300)  # from another directory: the paths are absolute
    assert again.returncode == 0, again.stderr
    assert len(list((out / "cells").glob("*.csv"))) == 6


def test_ctrl_c_with_dask_workers(tmp_path):
    pytest.importorskip("distributed")
    r, out = _interrupt(tmp_path, "--workers", "2")
    assert "--workers 2" in _check_interrupted(r, out)


TINY_MODEL = ROOT / "zoo" / "tiny-digits-d16-b1-h1-c0.5.safetensors"
ALLOCATOR = "[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: 134217728 bytes"


@pytest.mark.parametrize("error", [RuntimeError(ALLOCATOR), MemoryError()])
def test_out_of_memory_is_one_error_line(capsys, monkeypatch, error):
    # whole-network α-CROWN needs > 20 GB an image on the 3-block digits model: the CLI says so in one line
    def exhausted(*args, **kwargs):
        raise error

    monkeypatch.setattr(bench.nets.accuracy.Certifier, "__init__", exhausted)
    code, out, err = main_inprocess(capsys, "certify", "--model", TINY_MODEL, "--limit", "2", "--eps", "0.01",
                                    "--bounds", "naive")
    assert code == 2 and out == ""
    (line,) = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("certify:")]  # (the bar)
    assert line.startswith("error: out of memory during certify")


def test_other_runtime_errors_are_not_called_out_of_memory(capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(bench.nets.accuracy.Certifier, "__init__", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main_inprocess(capsys, "certify", "--model", TINY_MODEL, "--limit", "2", "--eps", "0.01",
                       "--bounds", "naive")


def test_a_second_ctrl_c_during_the_cleanup_prints_no_traceback(tmp_path, monkeypatch, capsys):
    """Ctrl-C twice (an impatient user): the cleanup of the first runs to its end, one line, 130."""
    import bench.sweep.runner as runner

    real = runner.remove_stale_temps
    calls = []

    def slow_cleanup(out):  # the second Ctrl-C lands inside the cleanup, as it would on a slow disk
        calls.append(out)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
        return real(out)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    (tmp_path / "p.toml").write_text(INTERRUPTIBLE)
    monkeypatch.setattr(runner, "remove_stale_temps", slow_cleanup)
    monkeypatch.setattr(runner, "run_cells", interrupted)
    monkeypatch.chdir(tmp_path)
    before = signal.getsignal(signal.SIGINT)
    code, _, err = main_inprocess(capsys, "run", "--profile", "p.toml", "--out", "out")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 130 and len(calls) == 2, err
    # the first Ctrl-C's own message, with the resume command: its cleanup was not cut short
    assert len(lines) == 1 and lines[0].startswith("interrupted: ") and "resume with: " in lines[0], err
    assert signal.getsignal(signal.SIGINT) is before  # restored once the cleanup is done

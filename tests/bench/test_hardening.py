"""Every bad input the hardening issue listed: one ``error:`` line on stderr, exit 2, nothing left
behind; and regression tracking that a missing or empty table cannot fool."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from helpers import ONE, ROOT, cli, main_inprocess, one_error

from bench.cli import baseline
from bench.core import store
from bench.sweep import tasks
from bench.sweep.profiles import load_profile

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
# root writes through chmod 555; /sys refuses even root, where it exists
UNWRITABLE = Path("/sys/kernel") if Path("/sys/kernel").is_dir() else None


@pytest.fixture
def profile(tmp_path) -> Path:
    (tmp_path / "one.toml").write_text(ONE)
    return tmp_path / "one.toml"


# --- where results go -------------------------------------------------------------------------

def _out_cases(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    (tmp_path / "afile").write_text("x")
    cases = {"file": (tmp_path / "afile", "is a file, not a directory"),
             "under-file": (tmp_path / "afile" / "sub", "afile is a file, not a directory")}
    if UNWRITABLE is not None:
        cases["unwritable"] = (UNWRITABLE, "not a writable directory")
        cases["under-unwritable"] = (UNWRITABLE / "bench-out", "not a writable directory")
    return cases


@pytest.mark.parametrize("case", ["file", "under-file", "unwritable", "under-unwritable"])
def test_run_out_that_cannot_hold_results(case, profile, tmp_path, capsys):
    cases = _out_cases(tmp_path)
    if case not in cases:
        pytest.skip("no directory here that even root cannot write")
    out, words = cases[case]
    code, _, err = main_inprocess(capsys, "run", "--profile", profile, "--out", out)
    one_error(code, err, words)
    assert (tmp_path / "afile").read_text() == "x"


@pytest.mark.parametrize("case", ["file", "under-file", "unwritable", "under-unwritable"])
def test_report_out_that_cannot_hold_a_report(case, finished, tmp_path, capsys):
    cases = _out_cases(tmp_path)
    if case not in cases:
        pytest.skip("no directory here that even root cannot write")
    out, words = cases[case]
    code, _, err = main_inprocess(capsys, "report", finished, "--out", out)
    one_error(code, err, words)
    assert (tmp_path / "afile").read_text() == "x"


@pytest.mark.skipif(IS_ROOT, reason="root writes into a read-only directory")
def test_run_and_report_into_read_only_directory(profile, finished, tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        code, _, err = main_inprocess(capsys, "run", "--profile", profile, "--out", ro)
        one_error(code, err, "not a writable directory")
        code, _, err = main_inprocess(capsys, "report", finished, "--out", ro)
        one_error(code, err, "")
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o755)


# --- profiles: checked before anything is written -----------------------------------------------

@pytest.mark.parametrize("text,words", [
    ('[run]\npgd_steps = "many"\n[[sweep]]\nname = "a"\n', "pgd_steps must be an integer >= 0"),
    ("[run]\npgd_restarts = 0\n[[sweep]]\nname = 'a'\n", "pgd_restarts must be an integer >= 1"),
    ("[run]\ndtype = 'float16'\n[[sweep]]\nname = 'a'\n", "dtype must be one of"),
    ("[run]\nseed = 1.5\n[[sweep]]\nname = 'a'\n", "seed must be an integer >= 0"),
    ("run = 3\n[[sweep]]\nname = 'a'\n", "[run] must be a table"),
    ("sweep = 3\n", "'sweep' must be an array of tables"),
    ("[[sweep]]\nname = 'a'\nflavour = 1\n", "unknown keys ['flavour']"),
])
def test_bad_profile_writes_nothing(text, words, tmp_path, capsys):
    (tmp_path / "p.toml").write_text(text)
    code, _, err = main_inprocess(capsys, "run", "--profile", tmp_path / "p.toml", "--out",
                                  tmp_path / "out")
    one_error(code, err, words)
    assert not (tmp_path / "out").exists(), "nothing may be written for a bad profile"


def test_corrected_rerun_after_a_bad_profile_just_runs(tmp_path, capsys):
    (tmp_path / "p.toml").write_text(ONE.replace("pgd_steps = 3", 'pgd_steps = "many"'))
    code, _, _ = main_inprocess(capsys, "run", "--profile", tmp_path / "p.toml", "--out",
                                tmp_path / "out")
    assert code == 2
    (tmp_path / "p.toml").write_text(ONE)
    code, out, err = main_inprocess(capsys, "run", "--profile", tmp_path / "p.toml", "--out",
                                    tmp_path / "out")
    assert code == 0 and "results:" in out, err


# --- runs that know what they are ----------------------------------------------------------------

def test_manifest_names_schema_version_commit_and_every_cell(finished):
    import json

    m = json.loads((finished / "run.json").read_text())
    assert m["schema_version"] == store.SCHEMA_VERSION
    assert m["suite_version"] and m["git_commit"]
    ids = [c.id for _, c in load_profile(str(finished.parent / "one.toml")).cells()]
    assert [cid for _, cid in m["cells"]] == ids


@pytest.mark.parametrize("change,what", [
    (lambda t: t.replace('name = "one"', 'name = "other"'), "other cells"),
    (lambda t: t.replace("eps = [0.01, 0.1]", "eps = [0.01, 0.2]"), "other cells"),
    (lambda t: t.replace("pgd_steps = 3", "pgd_steps = 4"), "other options"),
])
def test_resume_into_another_run_is_refused_naming_fresh(change, what, finished, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    (tmp_path / "one.toml").write_text(change(ONE))  # the same profile name, edited
    before = sorted((run / "cells").iterdir())
    code, _, err = main_inprocess(capsys, "run", "--profile", tmp_path / "one.toml", "--out", run)
    one_error(code, err, what)
    assert "--fresh" in err
    assert sorted((run / "cells").iterdir()) == before
    code, _, err = main_inprocess(capsys, "run", "--profile", tmp_path / "one.toml", "--out", run,
                                  "--fresh")
    assert code == 0, err
    df = store.load(run)
    assert df["cell_index"].groupby(df["cell_id"]).nunique().max() == 1
    assert df["cell_id"].nunique() == 2


def _as_another_commit(run: Path, commit: str) -> None:
    """Rewrites a finished run as if it had been made at ``commit``: its manifest and every row."""
    import json

    m = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps(m | {"git_commit": commit}))
    for f in (run / "cells").glob("*.csv"):
        pd.read_csv(f).assign(git_commit=commit).to_csv(f, index=False)


def test_adopt_takes_another_commits_cells_as_they_are(finished, tmp_path, capsys):
    """--adopt DIR: the finished cells of a run of the same profile and options at another commit are
    taken first, each row keeping its commit; only the others are computed; DIR is left as it was."""
    old, new = tmp_path / "old", tmp_path / "new"
    shutil.copytree(finished, old)
    other = "12345678" * 5  # all digits: read back as text, not a number
    _as_another_commit(old, other)
    first, second = sorted((old / "cells").glob("*.csv"))
    second.unlink()
    kept = first.read_bytes()
    code, _, err = main_inprocess(capsys, "run", "--profile", finished.parent / "one.toml", "--out", new,
                                  "--adopt", old)
    assert code == 0, err
    assert f"adopted 1 finished cell(s) of commit {other[:12]} from {old}" in err
    df = store.load(new)
    commits = df.groupby("cell_id")["git_commit"].first()
    assert sorted(commits == other) == [False, True]  # one adopted, one computed at this checkout
    assert first.read_bytes() == kept and sorted((old / "cells").glob("*.csv")) == [first]
    assert (new / "cells" / first.name).read_bytes() == kept


def test_adopted_cells_take_their_place_in_this_run(finished, tmp_path, capsys):
    """A run of some of the profile's cells (the same profile name and options: the standard ViT's
    CROWN cells of the paper run, say) numbers them its own way; adopted, a cell's rows take its
    index in this run, which orders the table. --adopt of --out itself is refused (with --fresh it
    would discard what it adopts)."""
    part = tmp_path / "part"
    part.mkdir()
    (part / "one.toml").write_text(ONE.replace("eps = [0.01, 0.1]", "eps = [0.1]"))
    code, _, err = main_inprocess(capsys, "run", "--profile", part / "one.toml", "--out", part / "run")
    assert code == 0, err
    assert set(store.load(part / "run")["cell_index"]) == {0}
    new = tmp_path / "new"
    code, _, err = main_inprocess(capsys, "run", "--profile", finished.parent / "one.toml", "--out", new,
                                  "--adopt", part / "run")
    assert code == 0, err
    df = store.load(new)
    places = {c.id: i for i, (_, c) in enumerate(load_profile(str(finished.parent / "one.toml")).cells())}
    assert df.groupby("cell_id")["cell_index"].first().to_dict() == places
    before = sorted((new / "cells").iterdir())
    code, _, err = main_inprocess(capsys, "run", "--profile", finished.parent / "one.toml", "--out", new,
                                  "--adopt", new, "--fresh")
    one_error(code, err, "is --out itself")
    assert sorted((new / "cells").iterdir()) == before


@pytest.mark.parametrize("edit,words", [
    (lambda run: (run / "run.json").unlink(), "not a run directory"),
    (lambda run: (run / "run.json").write_text("{"), "run.json is unreadable"),
    (lambda run: (run / "run.json").write_text(
        (run / "run.json").read_text().replace('"pgd_steps": 3', '"pgd_steps": 4')), "other options"),
])
def test_adopt_refuses_a_run_it_cannot_take_before_any_work(edit, words, finished, tmp_path, capsys):
    old, new = tmp_path / "old", tmp_path / "new"
    shutil.copytree(finished, old)
    edit(old)
    code, _, err = main_inprocess(capsys, "run", "--profile", finished.parent / "one.toml", "--out", new,
                                  "--adopt", old)
    one_error(code, err, words)
    assert not new.exists()


def test_another_schema_version_is_refused(finished, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    import json

    m = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps(m | {"schema_version": 1}))
    code, _, err = main_inprocess(capsys, "run", "--profile", finished.parent / "one.toml",
                                  "--out", run)
    one_error(code, err, "other results schema version")
    df = pd.read_csv(run / "results.csv")
    df["schema_version"] = 1
    df.to_csv(tmp_path / "old.csv", index=False)
    code, _, err = main_inprocess(capsys, "report", tmp_path / "old.csv", "--out", tmp_path / "r")
    one_error(code, err, "results schema version ['1'], this suite reads 2")


def test_a_second_run_on_the_same_out_is_refused_naming_the_holder(profile, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with store.lock(out):
        for extra in ([], ["--fresh"]):
            r = cli("run", "--profile", profile, "--out", out, *extra, cwd=tmp_path)
            assert r.returncode == 2, r.stderr
            assert f"in use by another run (pid {os.getpid()})" in r.stderr
            assert r.stderr.count("\n") == 1
        assert not (out / "cells").exists(), "the refused run wrote cells"
    r = cli("run", "--profile", profile, "--out", out, cwd=tmp_path)
    assert r.returncode == 0, r.stderr


def test_leftover_temp_files_are_removed(finished, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    stale = [run / "cells" / ".0123.csv.4242.tmp", run / ".results.csv.4242.tmp"]
    for f in stale:
        f.write_text("half a row,")
    code, _, err = main_inprocess(capsys, "run", "--profile", finished.parent / "one.toml",
                                  "--out", run)
    assert code == 0, err
    assert not any(f.exists() for f in stale)


def test_error_during_a_run_stands_on_its_own_line(profile, tmp_path, capsys, monkeypatch):
    from models import InputError

    calls = []

    def failing(cell, run, device, dtype):
        calls.append(cell)
        if len(calls) == 2:
            raise InputError("the second cell broke")
        return tasks.bounds_task(cell, run, device, dtype)

    monkeypatch.setitem(tasks.TASKS, "bounds", failing)
    code, _, err = main_inprocess(capsys, "run", "--profile", profile, "--out", tmp_path / "out")
    one_error(code, err, "the second cell broke")
    assert len(list((tmp_path / "out" / "cells").glob("*.csv"))) == 1  # the finished one is kept


# --- compare, report and baseline refuse what is not a complete table -----------------------------

@pytest.fixture
def header_only(finished, tmp_path) -> Path:
    path = tmp_path / "header.csv"
    path.write_text((finished / "results.csv").read_text().split("\n", 1)[0] + "\n")
    return path


def test_compare_fails_on_missing_rows(finished, tmp_path, capsys):
    df = store.load(finished)
    part = tmp_path / "part"
    part.mkdir()
    df[df["eps"] == 0.01].to_csv(part / "results.csv", index=False)
    code, out, _ = main_inprocess(capsys, "compare", finished, part)
    assert code == 1 and "FAILED: missing in NEW" in out, out
    assert "| ! |" in out
    code, out, _ = main_inprocess(capsys, "compare", finished, part, "--allow-missing")
    assert code == 0 and "OK" in out


def test_compare_and_report_refuse_an_empty_table(finished, header_only, tmp_path, capsys):
    for args in (("compare", finished, header_only), ("compare", header_only, finished),
                 ("report", header_only, "--out", tmp_path / "rep")):
        code, _, err = main_inprocess(capsys, *args)
        one_error(code, err, "has no rows")
    assert not (tmp_path / "rep").exists()


@pytest.mark.parametrize("col,value", [("value", "big"), ("ratio", "n/a"), ("violation", "maybe")])
def test_compare_and_report_refuse_non_numeric_values(col, value, finished, tmp_path, capsys):
    df = pd.read_csv(finished / "results.csv")
    df[col] = df[col].astype(object)
    df.loc[3, col] = value
    df.to_csv(tmp_path / "bad.csv", index=False)
    for args in (("compare", finished, tmp_path / "bad.csv"),
                 ("report", tmp_path / "bad.csv", "--out", tmp_path / "rep")):
        code, _, err = main_inprocess(capsys, *args)
        one_error(code, err, f"column {col!r} holds a non-")
    assert not (tmp_path / "rep").exists()


def test_compare_when_compare_md_cannot_be_written(finished, tmp_path, capsys):
    new = tmp_path / "new"
    shutil.copytree(finished, new)
    (new / "compare.md").mkdir()
    code, out, err = main_inprocess(capsys, "compare", finished, new)
    one_error(code, err, "compare.md")
    assert out == "" and not list(new.glob(".*.tmp"))


@pytest.mark.skipif(IS_ROOT, reason="root writes into a read-only directory")
def test_compare_into_read_only_new(finished, tmp_path, capsys):
    new = tmp_path / "new"
    shutil.copytree(finished, new)
    new.chmod(0o555)
    try:
        code, _, err = main_inprocess(capsys, "compare", finished, new)
        one_error(code, err, "compare.md")
    finally:
        new.chmod(0o755)


@pytest.fixture
def sandbox_baseline(tmp_path, monkeypatch) -> Path:
    """The baseline and reports paths moved into tmp: these tests must never touch the real ones."""
    base = tmp_path / "baseline"
    monkeypatch.setattr(baseline, "BASELINE", base)
    monkeypatch.setattr(baseline, "REPORTS", tmp_path / "reports")
    return base


def test_baseline_update_refuses_empty_garbage_and_violations(finished, header_only, tmp_path,
                                                              sandbox_baseline, capsys):
    (tmp_path / "garbage.csv").write_bytes(b"\x00\xffnot,a\ntable")
    df = pd.read_csv(finished / "results.csv")
    i = df.index[(df["role"] == "bound") & df["certified"] & ~df["finding"]][0]
    # a violation stated honestly (value below PGD, flags as rows.py sets them), and flags alone
    df.loc[i, ["value", "ratio", "violation", "sound"]] = [df.loc[i, "pgd"] / 2, 0.5, True, False]
    df.to_csv(tmp_path / "violation.csv", index=False)
    df.loc[i, ["value", "ratio"]] = [df.loc[i, "pgd"] * 2, 2.0]
    df.to_csv(tmp_path / "flags.csv", index=False)
    for source, words in ((header_only, "has no rows"), (tmp_path / "garbage.csv", ""),
                          (tmp_path / "violation.csv", "1 soundness violation(s)"),
                          (tmp_path / "flags.csv", "1 row(s) whose stored violation contradicts")):
        code, _, err = main_inprocess(capsys, "baseline", "--update", "--from", source)
        one_error(code, err, words)
        assert not sandbox_baseline.exists()


def test_baseline_update_writes_table_and_its_report(finished, sandbox_baseline, capsys):
    code, _, err = main_inprocess(capsys, "baseline", "--update", "--from", finished,
                                  "--allow-dirty")  # the run's rows: dirty where the checkout is
    assert code == 0, err
    assert (sandbox_baseline / "results.csv").read_bytes() == (finished / "results.csv").read_bytes()
    assert (sandbox_baseline.parent / "reports" / "README.md").exists()


# --- tox -e bench leaves the checkout clean ------------------------------------------------------

def test_bench_env_writes_only_git_ignored_paths():
    """What `tox -e bench` writes (its run, report and comparison) is under results/latest, which
    git ignores, as is tox's own `.venv` pointer: the checkout stays clean."""
    import configparser

    ini = configparser.ConfigParser(interpolation=None)
    ini.read(ROOT / "tox.ini")
    commands = ini["testenv:bench"]["commands"]
    assert "{toxinidir}/reports" not in commands
    assert "results/latest" in commands
    if shutil.which("git") and (ROOT / ".git").exists():
        for path in ("results/latest/results.csv", "results/latest/report/README.md", ".venv"):
            r = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT)
            assert r.returncode == 0, f"{path} is not git-ignored"


def test_cli_errors_from_a_real_shell(finished, tmp_path):
    (tmp_path / "afile").write_text("x")
    r = cli("report", finished, "--out", tmp_path / "afile", cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr.startswith("error:") and r.stderr.count("\n") == 1, r.stderr
    r = subprocess.run([sys.executable, "-m", "bench", "compare", str(tmp_path / "afile"),
                        str(tmp_path / "afile")], cwd=tmp_path, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error:"), r.stderr


# a run whose one cell reads a zoo file: the first attention layer of a trained model (seconds)
TRAINED = ONE.replace("n = 3\nd = 4\n", 'model = "digits-d32-b2-h2-c0.5"\nx = "data"\nn = 16\nd = 32\n'
                      'samples = 1\n').replace("eps = [0.01, 0.1]", "eps = 0.01")


def test_a_run_made_with_another_zoo_file_of_a_model_is_not_resumed_and_its_cells_not_adopted(tmp_path,
                                                                                                capsys):
    """A cell's id names its zoo model, not the file: a model retrained (or its card's architecture
    edited) under the same name would pass every other check. run.json keeps each model's fingerprint
    (the weights file's sha256 and the card's architecture); a resume of a run made with another is
    refused naming the model, and --adopt leaves that model's cells to compute, with a note. A
    run.json from before the fingerprints is resumed and adopted with a note; an unreadable one is
    refused in one line."""
    import hashlib
    import json

    from bench.sweep.cases import ZOO

    (tmp_path / "t.toml").write_text(TRAINED)
    old = tmp_path / "old"
    code, _, err = main_inprocess(capsys, "run", "--profile", tmp_path / "t.toml", "--out", old)
    assert code == 0, err
    name = "digits-d32-b2-h2-c0.5"
    weights = hashlib.sha256((ZOO / f"{name}.safetensors").read_bytes()).hexdigest()
    arch = json.loads((ZOO / f"{name}.json").read_text())["architecture"]
    digest = hashlib.sha256(f"{weights}|{json.dumps(arch, sort_keys=True)}".encode()).hexdigest()
    manifest = json.loads((old / "run.json").read_text())
    assert manifest["models"] == {name: digest}
    code, _, err = main_inprocess(capsys, "run", "--profile", tmp_path / "t.toml", "--out", old)
    assert code == 0 and "note:" not in err, err  # the same files: resumed, nothing to say
    write = lambda m: (old / "run.json").write_text(json.dumps(m))
    write({k: v for k, v in manifest.items() if k != "models"})
    code, _, err = main_inprocess(capsys, "run", "--profile", tmp_path / "t.toml", "--out", old)
    assert code == 0 and "predates the zoo files' fingerprints" in err, err

    write(manifest | {"models": {name: "0" * 64}})
    code, _, err = main_inprocess(capsys, "run", "--profile", tmp_path / "t.toml", "--out", old)
    one_error(code, err, f"another zoo file of {name} (fingerprint 000000000000 there, {digest[:12]} in zoo/")
    other = "12345678" * 5
    _as_another_commit(old, other)
    new = tmp_path / "new"
    code, _, err = main_inprocess(capsys, "run", "--profile", tmp_path / "t.toml", "--out", new,
                                  "--adopt", old)
    assert code == 0, err
    assert f"not taking the cells of {name}" in err and "adopted" not in err
    assert other not in set(store.load(new)["git_commit"])  # computed here, not taken

    for bad in ([1, 2], {name: 3}):
        write(manifest | {"git_commit": other, "models": bad})
        code, _, err = main_inprocess(capsys, "run", "--profile", tmp_path / "t.toml", "--out",
                                      tmp_path / "other", "--adopt", old)
        one_error(code, err, "the models of its run.json are unreadable")
    write({k: v for k, v in manifest.items() if k != "models"} | {"git_commit": other})
    code, _, err = main_inprocess(capsys, "run", "--profile", tmp_path / "t.toml", "--out",
                                  tmp_path / "fresh", "--adopt", old)
    assert code == 0, err
    assert "predates the zoo files' fingerprints" in err
    assert f"adopted 1 finished cell(s) of commit {other[:12]}" in err

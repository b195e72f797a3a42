"""``python -m bench history`` (issue #23 item 2) over a throwaway git repository whose baseline
changes from commit to commit: the table's numbers (median and worst value/PGD, certified accuracy)
recomputed here from the rows themselves, the figure written, an unreadable version skipped with a
note naming its commit, and every bad input one ``error:`` line with nothing written."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pandas as pd
import pytest
from helpers import ROOT, main_inprocess, one_error

from bench.core.gate import derive
from bench.core.store import READ
from bench.report import history
from bench.report.tables import fmt

EPS_CELL = "dot[n=16,d=64,h=1,H=I,wqk=1,wvo=0.5,x=gauss:0.5,depth=1,eps=0.01,seed=0]"
TABLE = Path("results/baseline/results.csv")


@pytest.fixture(scope="module")
def small() -> pd.DataFrame:
    """A one-head dot cell and the first network certify cell of the committed baseline."""
    df = pd.read_csv(ROOT / TABLE, **READ)
    certify = df.loc[df["role"] == "certify", "cell_id"].iloc[0]
    return df[df["cell_id"].isin([EPS_CELL, certify])].reset_index(drop=True)


def _honest(df: pd.DataFrame) -> pd.DataFrame:
    d = derive(df)
    return df.assign(ratio=d["ratio"], sound=d["sound"], violation=d["violation"])


def _git(repo: Path, *args: str) -> str:
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.org", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@example.org", GIT_AUTHOR_DATE="2030-01-02T00:00:00+00:00",
               GIT_COMMITTER_DATE="2030-01-02T00:00:00+00:00")
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


def _commit(repo: Path, df: pd.DataFrame | None, message: str, other: str | None = None) -> str:
    if df is not None:
        (repo / TABLE).parent.mkdir(parents=True, exist_ok=True)
        df.to_csv(repo / TABLE, index=False)
    if other is not None:
        (repo / "NOTES").write_text(other)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", message)
    return _git(repo, "rev-parse", "HEAD")


def _looser(df: pd.DataFrame) -> pd.DataFrame:
    df = df.copy()
    df.loc[(df["role"] == "bound") & (df["bound"] == "lofast_M") & (df["sample"] == 0), "value"] *= 1.5
    return _honest(df)


def _fewer_certified(df: pd.DataFrame) -> pd.DataFrame:
    """One image LoFAST certified no longer certified (by either test): always sound."""
    df = df.copy()
    yes = df.index[(df["role"] == "certify") & (df["bound"] == "lofast_M") & df["certified_pairwise"]]
    df.loc[yes[0], ["certified_pairwise", "certified_prop1"]] = [False, False]
    return df


@pytest.fixture
def repo(tmp_path, monkeypatch) -> Path:
    r = tmp_path / "repo"
    r.mkdir()
    _git(r, "init", "-q")
    monkeypatch.setattr(history, "ROOT", r)
    return r


def _row(md: str, first: str) -> list[str]:
    """The cells of the Markdown table row that starts with ``first`` (the first such row)."""
    line = next(x for x in md.splitlines() if x.startswith(f"| {first} |"))
    return [c.strip() for c in line.strip("|").split("|")][1:]


def _expected(df: pd.DataFrame) -> tuple[float, float, float]:
    """lofast_M's median and worst value/PGD, and its certified accuracy, straight from the rows."""
    b = df[(df["role"] == "bound") & (df["bound"] == "lofast_M")]
    ratio = b["value"] / b["pgd"]
    c = df[(df["role"] == "certify") & (df["bound"] == "lofast_M")]
    return ratio.median(), ratio.max(), c["certified_pairwise"].astype(bool).mean()


def test_history_over_three_versions(small, repo, tmp_path, capsys):
    old = _commit(repo, small.assign(schema_version=1), "an older schema")
    versions = [small, _looser(small), _fewer_certified(_looser(small))]
    shas = [_commit(repo, versions[0], "v1"), _commit(repo, None, "elsewhere", other="x"),
            _commit(repo, versions[1], "v2"), _commit(repo, versions[2], "v3")]
    shas = [shas[0], *shas[2:]]  # the commit that left the baseline alone is not in its history
    out = tmp_path / "out"
    code, stdout, err = main_inprocess(capsys, "history", "--out", out)
    assert code == 0, err
    assert err == f"note: {old[:7]}: skipped, the loader refuses it: {TABLE}: results schema version " \
                  f"['1'], this suite reads 2; rerun the profile with --fresh\n", err
    assert stdout == f"history: {out / 'history.md'} (3 version(s)), figure {out / 'history.png'}\n"
    md = (out / "history.md").read_text()
    assert (out / "history.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [line.split("`")[1] for line in md.splitlines() if line.startswith("| `")][:3] == \
        [s[:7] for s in shas], md
    assert _row(md, "bound") == [s[:7] for s in shas]
    model = small.loc[small["role"] == "certify", "model"].iloc[0]
    got = {"median": _row(md, "`lofast_M`"), "accuracy": _row(md, f"`{model}` | `lofast_M`")[1:]}
    worst = md[md.index("## Worst"):]
    got["worst"] = _row(worst, "`lofast_M`")
    want = [_expected(df) for df in versions]
    assert got["median"] == [fmt(w[0]) for w in want]
    assert got["worst"] == [fmt(w[1]) for w in want]
    assert got["accuracy"] == [fmt(w[2], 3) for w in want]
    # what the versions changed shows: looser from v1 to v2, one image fewer from v2 to v3
    assert want[1][0] > want[0][0] and want[2][2] < want[1][2] == want[0][2]
    assert "Skipped:" in md and old[:7] in md
    assert "![history](history.png)" in md


def test_history_bad_inputs(small, repo, tmp_path, monkeypatch, capsys):
    """Each one error line, exit 2, nothing written."""
    out = tmp_path / "out"

    def refused(words: str, *args: str) -> None:
        code, _, err = main_inprocess(capsys, "history", "--out", out, *args)
        one_error(code, err, words)
        assert not out.exists()

    refused("changed results/baseline/results.csv: no history to show")  # no commit at all
    _commit(repo, None, "no baseline", other="x")
    refused("changed results/baseline/results.csv: no history to show")
    _commit(repo, small.assign(schema_version=1), "only an older schema")
    refused("none of the 1 commit(s) that changed results/baseline/results.csv holds a table")
    _commit(repo, small, "v1")
    (tmp_path / "afile").write_text("x")
    code, _, err = main_inprocess(capsys, "history", "--out", tmp_path / "afile")
    one_error(code, err, "is a file, not a directory")
    assert (tmp_path / "afile").read_text() == "x"
    code, _, err = main_inprocess(capsys, "history", "--out", tmp_path / "afile" / "under")
    one_error(code, err, "is a file, not a directory")
    plain = tmp_path / "plain"
    plain.mkdir()
    monkeypatch.setattr(history, "ROOT", plain)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # git must not find a repository above
    refused("is not a git checkout")
    monkeypatch.setattr(history, "ROOT", repo)
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    refused("no git is on PATH")


def test_history_of_this_checkout_names_its_commits(tmp_path, capsys):
    """The real history, when this checkout has one (a source tarball has no .git)."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    shas = subprocess.run(["git", "log", "--format=%h", "--", str(TABLE)], cwd=ROOT, capture_output=True,
                          text=True).stdout.split()
    if not shas:
        pytest.skip("no commit changed the baseline")
    code, _, err = main_inprocess(capsys, "history", "--out", tmp_path / "h")
    assert code == 0, err
    assert f"| `{shas[0][:7]}` (" in (tmp_path / "h" / "history.md").read_text()

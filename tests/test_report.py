"""The report is rebuilt from a real (tiny) stored run: every figure and table is written, and
bad input ends in InputError (library) or exit code 2 with one stderr line (CLI)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import store
from bench.report import build
from bench.report_figures import FIGURES
from bench.report_tables import TABLES
from bench.runner import run_profile
from bench.sweeps import load_profile
from models import InputError

ROOT = Path(__file__).resolve().parents[1]

# one tiny cell (or a handful) per sweep the figures read, so the run takes seconds
TINY = """
[run]
pgd_steps = 2
pgd_restarts = 1
seed = 0

[[sweep]]
name = "eps"
kind = "dot"
n = 4
d = 8
h = [1, 2]
x_norm = [0.5, 1.0]
eps = [0.01, 0.1]

[[sweep]]
name = "heads"
kind = "dot"
n = 4
d = 8
h = [1, 2]

[[sweep]]
name = "input_norm"
kind = ["dot", "l2"]
n = 4
d = 8
h = 2
x_norm = [0.5, 2.0]

[[sweep]]
name = "olsa_vs_kim"
kind = ["l2", "olsa"]
residual = false
n = [4, 8]
d = 8
h = 2

[[sweep]]
name = "depth"
kind = ["dot", "l2"]
depth = 2
n = 4
d = 8
h = 2

[[sweep]]
name = "ablation"
task = "lofast"
kind = "dot"
n = 4
d = 8
h = 2
perturb = ["W_q", "X"]
noise = [0.0, 0.5]
seed = [0, 1]
eps = 0.1

[[sweep]]
name = "scaling"
task = "scaling"
n = [4, 8]
d = 8
h = 2

[[sweep]]
name = "scaling_d"
task = "scaling"
n = 4
d = [8, 16]
h = 2

[[sweep]]
name = "scaling_h"
task = "scaling"
n = 4
d = 8
h = [1, 2]

[[sweep]]
name = "scaling_depth"
task = "scaling"
n = 4
d = 8
h = 2
depth = [2, 3]

[[sweep]]
name = "cauchy"
task = "cauchy"
depth = 2
n = 4
d = 8
h = 2
samples = 3
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("report")
    toml = tmp / "tiny.toml"
    toml.write_text(TINY)
    run_profile(load_profile(str(toml)), tmp / "run", "cpu")
    return tmp / "run"


@pytest.fixture(scope="module")
def report(run_dir: Path) -> Path:
    return build(str(run_dir), str(run_dir.parent / "rep"))


def test_build_writes_every_figure_and_table(report: Path):
    readme = report
    out = readme.parent
    assert readme == out / "README.md"
    text = readme.read_text()
    for stem in FIGURES:
        for ext in ("png", "pdf"):
            f = out / f"{stem}.{ext}"
            assert f.exists() and f.stat().st_size > 0, f
        assert f"]({stem}.png)" in text, stem
    for stem in TABLES:
        for ext in ("md", "tex"):
            f = out / f"{stem}.{ext}"
            assert f.exists() and f.stat().st_size > 0, f
    assert "Skipped" not in text
    assert "No soundness violations" in text
    assert "| LoFAST (‖M‖) |" in (out / "summary.md").read_text()
    assert r"\begin{tabular}" in (out / "table3_lofast.tex").read_text()


def test_build_is_deterministic(run_dir: Path, report: Path, tmp_path: Path):
    a = report.parent
    b = build(str(run_dir), str(tmp_path / "b")).parent
    for f in sorted(a.iterdir()):
        if f.suffix in (".md", ".tex", ".pdf"):
            assert f.read_bytes() == (b / f.name).read_bytes(), f.name


def test_missing_sweeps_are_skipped_and_named(run_dir: Path, tmp_path: Path):
    df = store.load(run_dir)
    part = tmp_path / "part.csv"
    df[df["sweep"] == "eps"].to_csv(part, index=False)
    text = build(str(part), str(tmp_path / "rep")).read_text()
    assert "## Skipped" in text and "`cauchy_violin`" in text
    assert (tmp_path / "rep" / "fig1_lofast.png").exists()
    assert not (tmp_path / "rep" / "scaling.png").exists()


def test_violation_is_reported_at_the_top(run_dir: Path, tmp_path: Path):
    df = store.load(run_dir)
    df = df[df["sweep"] == "eps"].copy()  # only the README's header matters here
    i = df.index[df["bound"] == "lofast_M"][0]
    df.loc[i, "violation"] = True
    bad = tmp_path / "bad.csv"
    df.to_csv(bad, index=False)
    text = build(str(bad), str(tmp_path / "rep")).read_text()
    assert "SOUNDNESS VIOLATIONS: 1 rows" in text.split("## ")[0]


def test_load_garbage_raises_input_error(tmp_path: Path):
    junk = tmp_path / "junk.csv"
    junk.write_bytes(b"\x00\xff\xfe garbage\n1,2\n")
    with pytest.raises(InputError):
        store.load(junk)
    with pytest.raises(InputError):
        store.load(tmp_path / "nonexistent")


def test_cli_report_on_missing_results_exits_2(tmp_path: Path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "bench", "report", str(tmp_path / "nonexistent"),
                        "--out", str(tmp_path / "rep")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "error" in p.stderr

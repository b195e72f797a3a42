"""The cost task (bench/sweep/cost.py): its rows, their peak memory and matmul rate, and the figure and
table the report draws from them alone."""

from __future__ import annotations

import math

import pandas as pd
import torch

from bench.core.schema import COLUMNS
from bench.report.studies.cost_study import figure, table
from bench.sweep.cases import make_cell
from bench.sweep.cost import COST_BOUNDS, PARTS, m_flops, matmul_rate, measure, zeta_flops
from bench.sweep.tasks import TASKS
from models.operators import ZETA_GRAM_LIMIT


def test_cost_rows_and_report():
    cell = make_cell(n=4, d=8, h=2, task="cost")
    run = {"pgd_steps": 3, "pgd_restarts": 2, "seed": 0}
    rows = TASKS["cost"](cell, run, torch.device("cpu"), torch.float64)
    df = pd.DataFrame(rows)
    assert set(COLUMNS) <= set(df.columns)
    names = set(df["bound"])
    assert {"matmul", "matmul_bound", "cost_pgd", *(f"cost_{p}" for p in PARTS)} <= names
    assert {f"cost_{b}" for b in COST_BOUNDS} <= names
    assert (df["role"] == "timing").all() and (df["seconds"] > 0).all()
    timed = df[df["bound"].str.startswith("cost_")]
    assert timed["peak_mib"].notna().all()
    assert set(timed["certificate"]) <= {"exact", "attained"}
    # the report needs nothing but the rows (and the cell's columns the runner adds)
    df = df.assign(n=4, d=8, h=2, sweep="cost", device_name="cpu")
    plot = figure(df)
    assert "matmul bound of ζ + ‖M_l‖" in {t.label for t in plot.panels[0].traces}
    tab, caption = table(df)
    assert len(tab) == 1 and "20×" in caption


def test_flop_counts_follow_the_path():
    # dense path: Gram formation + the eigendecomposition (small, or on a GPU) or the Cholesky check
    # and its guess (CPU, from VERIFY_MIN on); probabilistic: k products with T*T
    assert zeta_flops(4, 8, 2) == 2 * 16 * 64 * 4 + 4 / 3 * 32**3
    assert zeta_flops(16, 32, 2) == 2 * 256 * 1024 * 4 + 512**3 / 3 + 40 * 512**2
    assert zeta_flops(16, 32, 2, cuda=True) == 2 * 256 * 1024 * 4 + 4 / 3 * 512**3
    n, d, h = 197, 768, 12
    assert n * d > ZETA_GRAM_LIMIT
    assert 1e11 < zeta_flops(n, d, h) < 5e11 and 5e10 < m_flops(n, d, h) < 3e11


def test_measure_and_rate():
    rate, seconds = matmul_rate(torch.device("cpu"), repeats=1)
    assert rate > 1e6 and seconds > 0
    out, seconds, mib = measure(lambda: torch.ones(2**22, dtype=torch.float64).sum(), torch.device("cpu"))
    assert float(out) == 2**22 and seconds > 0 and (math.isnan(mib) or mib >= 0)

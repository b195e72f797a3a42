"""The regression gate (bench/core/gate.py) judges what it recomputes, never the stored flags: tables
tampered from a few cells of the committed baseline are refused by ``compare``, ``baseline
--update`` and ``report`` with one ``error:`` line and nothing written, or (a violation the table
states honestly) fail ``compare`` with ``x``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers import ROOT, cli, main_inprocess, one_error

from bench.cli import baseline
from bench.core.gate import SOUND_RTOL, derive
from bench.core.store import READ

BASELINE = ROOT / "results" / "baseline" / "results.csv"
EPS_CELL = "dot[n=16,d=64,h=1,H=I,wqk=1,wvo=0.5,x=gauss:0.5,depth=1,eps=0.01,seed=0]"
HEADS_CELL = "dot[n=16,d=64,h=4,H=I,wqk=1,wvo=1,x=gauss:1,depth=1,eps=0.05,seed=0]"
CERTIFY_SWEEP = "certify"


@pytest.fixture(scope="module")
def small() -> pd.DataFrame:
    """Three cells of the committed baseline: a one-head dot layer, a four-head one (per-head
    bounds) and the first network certify cell (certify, pgd_margin and accuracy rows)."""
    df = pd.read_csv(BASELINE, **READ)
    certify = df.loc[df["sweep"] == CERTIFY_SWEEP, "cell_id"].iloc[0]
    out = df[df["cell_id"].isin([EPS_CELL, HEADS_CELL, certify])].reset_index(drop=True)
    assert set(out["role"]) == {"bound", "pgd", "certify", "accuracy"} and (out["head"] == 3).any()
    return out


@pytest.fixture
def base(small, tmp_path) -> Path:
    path = tmp_path / "base.csv"
    small.to_csv(path, index=False)
    return path


@pytest.fixture
def sandbox(tmp_path, monkeypatch) -> Path:
    """``baseline --update`` writes here, never into the committed results/baseline or reports/."""
    monkeypatch.setattr(baseline, "BASELINE", tmp_path / "sandbox" / "baseline")
    monkeypatch.setattr(baseline, "REPORTS", tmp_path / "sandbox" / "reports")
    return tmp_path / "sandbox"


def _honest(df: pd.DataFrame) -> pd.DataFrame:
    """Ratio, sound and violation stored as rows.py stores them for these values."""
    d = derive(df)
    return df.assign(ratio=d["ratio"], sound=d["sound"], violation=d["violation"])


def _row(df: pd.DataFrame, role: str, bound: str, **where) -> int:
    mask = (df["role"] == role) & (df["bound"] == bound)
    for col, v in where.items():
        mask &= df[col] == v
    return int(df.index[mask][0])


def _new(df: pd.DataFrame, tmp_path: Path) -> Path:
    """NEW as a run directory, so that a compare that went on would write compare.md into it."""
    new = tmp_path / "new"
    new.mkdir(parents=True)
    df.to_csv(new / "results.csv", index=False)
    return new


def _refused_everywhere(capsys, base: Path, new: Path, sandbox: Path, words: str) -> None:
    """compare, baseline --update and report each refuse NEW with one error line, writing nothing."""
    code, out, err = main_inprocess(capsys, "compare", base, new)
    one_error(code, err, words)
    assert out == "" and not (new / "compare.md").exists()
    code, _, err = main_inprocess(capsys, "baseline", "--update", "--from", new)
    one_error(code, err, words)
    assert not sandbox.exists()
    code, _, err = main_inprocess(capsys, "report", new, "--out", new.parent / "rep")
    one_error(code, err, words)
    assert not (new.parent / "rep").exists()


def test_the_untouched_subset_passes(small, base, tmp_path, sandbox, capsys):
    new = _new(small, tmp_path)
    code, out, err = main_inprocess(capsys, "compare", base, new)
    assert code == 0 and out.rstrip().endswith("OK"), out + err
    assert " 0 rows" not in out and "`x` soundness violation: 0" in out
    code, _, err = main_inprocess(capsys, "baseline", "--update", "--from", new)
    assert code == 0, err
    assert (sandbox / "baseline" / "results.csv").read_text() == (new / "results.csv").read_text()


def test_a_certified_value_at_half_its_pgd_with_flags_untouched_is_refused(small, base, tmp_path,
                                                                            sandbox, capsys):
    df = small.copy()
    i = _row(df, "bound", "lofast_M", cell_id=EPS_CELL)
    df.loc[i, "value"] = 0.5 * df.loc[i, "pgd"]
    _refused_everywhere(capsys, base, _new(df, tmp_path), sandbox,
                        "1 row(s) whose stored violation contradicts value, pgd and the registry "
                        "(first: bound row lofast_M")


def test_a_violation_stated_honestly_fails_compare_and_baseline(small, base, tmp_path, sandbox, capsys):
    df = small.copy()
    i = _row(df, "bound", "delta21_M", cell_id=HEADS_CELL, head=3)
    df.loc[i, "value"] = df.loc[i, "pgd"] * (1 - 10 * SOUND_RTOL)  # just beyond the tolerance
    new = _new(_honest(df), tmp_path)
    code, out, _ = main_inprocess(capsys, "compare", base, new)
    assert code == 1 and "`x` soundness violation: 1" in out and "| x | delta21_M |" in out, out
    assert "FAILED: soundness violation" in out
    code, _, err = main_inprocess(capsys, "baseline", "--update", "--from", new)
    one_error(code, err, "1 soundness violation(s) (first: delta21_M")
    assert not sandbox.exists()


@pytest.mark.parametrize("below,code,marked", [(0.5, 0, 0), (2.0, 1, 1)])
def test_the_tolerance_is_rows_py_s(below, code, marked, small, base, tmp_path, capsys):
    """value = pgd·(1 − k·1e-6): within the rounding tolerance at k = ½, a violation at k = 2."""
    df = small.copy()
    i = _row(df, "bound", "lofast_M", cell_id=EPS_CELL)
    df.loc[i, "value"] = df.loc[i, "pgd"] * (1 - below * SOUND_RTOL)
    got, out, err = main_inprocess(capsys, "compare", base, _new(_honest(df), tmp_path))
    assert got == code and f"`x` soundness violation: {marked}" in out, out + err


def test_an_image_a_network_bound_no_longer_certifies_fails_compare(small, base, tmp_path, capsys):
    """A network certify row is judged by its verdicts: taylor_net losing one image of the
    baseline's (its two tests both False, nothing else changed) is ``+`` and fails; the norm route's
    taylor gaining one that PGD does not break is ``-`` and passes."""
    df = small.copy()
    cert = df[(df["role"] == "certify") & (df["bound"] == "taylor_net")
              & df["certified_pairwise"].eq(True)]
    i = int(cert.index[0])
    df.loc[i, ["certified_pairwise", "certified_prop1"]] = False
    code, out, err = main_inprocess(capsys, "compare", base, _new(df, tmp_path))
    assert code == 1 and "`+` worse: 1" in out and "FAILED: worse" in out, out + err
    assert f"| + | taylor_net | `{df.loc[i, 'cell_id']}` | {df.loc[i, 'sample']} |" in out
    assert "| pairwise, prop1 | not certified |" in out
    df = small.copy()
    gain = df[(df["role"] == "certify") & (df["bound"] == "taylor")
              & df["certified_pairwise"].eq(False) & df["pgd_broken"].eq(False)]
    df.loc[int(gain.index[0]), "certified_pairwise"] = True
    code, out, err = main_inprocess(capsys, "compare", base, _new(df, tmp_path / "gain"))
    assert code == 0 and "`-` better: 1" in out and out.rstrip().endswith("OK"), out + err


@pytest.mark.parametrize("value,words", [(np.nan, "1 row(s) hold a NaN value"),
                                         (np.inf, "1 row(s) hold an infinite value"),
                                         (-np.inf, "1 row(s) hold an infinite value")])
def test_a_non_finite_certified_value_is_refused(value, words, small, base, tmp_path, sandbox, capsys):
    df = small.copy()
    df.loc[_row(df, "bound", "taylor", cell_id=EPS_CELL), "value"] = value
    _refused_everywhere(capsys, base, _new(_honest(df), tmp_path), sandbox, words)


def test_nan_certify_value_and_nan_pgd_row_are_refused(small, base, tmp_path, sandbox, capsys):
    df = small.copy()
    df.loc[_row(df, "certify", "lofast_M", sample=3), "value"] = np.nan
    _refused_everywhere(capsys, base, _new(df, tmp_path), sandbox, "hold a NaN value (first: certify row")
    df = small.copy()
    df.loc[_row(df, "pgd", "pgd_output", cell_id=EPS_CELL), "value"] = np.nan
    code, _, err = main_inprocess(capsys, "compare", base, _new(df, tmp_path / "x"))
    one_error(code, err, "hold a NaN value (first: pgd row pgd_output")


def test_an_infinite_published_formula_with_a_finding_is_accepted(small, base, tmp_path, capsys):
    df = small.copy()
    # a published formula evaluated as written may overflow: +inf claims nothing false
    df.loc[_row(df, "bound", "specformer", cell_id=EPS_CELL), "value"] = np.inf
    code, out, err = main_inprocess(capsys, "compare", base, _new(_honest(df), tmp_path))
    assert code == 0 and "OK" in out, out + err


@pytest.mark.parametrize("pgd,words", [(np.nan, "need a PGD value > 0"), (0.0, "need a PGD value > 0"),
                                       (-1.0, "need a PGD value > 0"), (np.inf, "need a PGD value > 0")])
def test_a_bound_without_a_usable_pgd_is_refused(pgd, words, small, base, tmp_path, sandbox, capsys):
    df = small.copy()
    df.loc[_row(df, "bound", "lofast_M", cell_id=EPS_CELL), "pgd"] = pgd
    _refused_everywhere(capsys, base, _new(_honest(df), tmp_path), sandbox, words)


def test_value_and_pgd_lowered_together_are_refused(small, base, tmp_path, sandbox, capsys):
    """Halving a bound's value and its PGD column keeps value ≥ pgd: the PGD row still says otherwise."""
    df = small.copy()
    i = _row(df, "bound", "lofast_M", cell_id=EPS_CELL)
    df.loc[i, ["value", "pgd"]] = [df.loc[i, "pgd"] * 0.5, df.loc[i, "pgd"] * 0.4]
    _refused_everywhere(capsys, base, _new(_honest(df), tmp_path), sandbox,
                        "1 row(s) hold a PGD value that is not their objective's pgd_<objective> row's")


def test_zeta_without_pgd_is_fine_but_zeta_with_one_is_not(small, base, tmp_path, sandbox, capsys):
    df = small.copy()
    i = _row(df, "bound", "zeta", cell_id=EPS_CELL)
    assert np.isnan(df.loc[i, "pgd"])  # zeta has no PGD objective: compare delta1 = ζε with PGD
    df.loc[i, "pgd"] = df.loc[i, "value"] * 3
    _refused_everywhere(capsys, base, _new(_honest(df), tmp_path), sandbox,
                        "hold a PGD value for a bound without a PGD objective")


def test_duplicated_keys_are_refused(small, base, tmp_path, sandbox, capsys):
    df = pd.concat([small, small.iloc[:100]], ignore_index=True)
    _refused_everywhere(capsys, base, _new(df, tmp_path), sandbox,
                        "100 row(s) repeat the key of an earlier row (first: bound row")
    # a second PGD value of one objective, told apart only by its block: which one a bound meets?
    df = pd.concat([small, small[small["bound"] == "pgd_output"].head(1).assign(block=5)])
    code, _, err = main_inprocess(capsys, "compare", base, _new(df, tmp_path / "pgd"))
    one_error(code, err, "1 row(s) of PGD repeat another's objective, cell, sample and head")


@pytest.mark.parametrize("col,value,words", [
    ("certified", False, "1 row(s) whose stored certified contradicts bounds/registry.py"),
    ("finding", True, "1 row(s) whose stored finding contradicts bounds/registry.py"),
    ("certificate", "estimate", "1 row(s) of a certified bound with a certificate not in"),
])
def test_a_flipped_registry_column_is_refused(col, value, words, small, base, tmp_path, sandbox, capsys):
    """The flags that excuse a value below PGD (not certified, a finding, an estimate) come from the
    registry: the row is also planted below its PGD, so that honouring the flip would hide it."""
    df = small.copy()
    i = _row(df, "bound", "lofast_xi", cell_id=EPS_CELL)
    df.loc[i, "value"] = df.loc[i, "pgd"] * 0.5
    df.loc[i, ["ratio", "sound", "violation", col]] = [0.5, False, False, value]
    _refused_everywhere(capsys, base, _new(df, tmp_path), sandbox, words)


def test_a_finding_flipped_on_a_certify_row_is_refused(small, base, tmp_path, sandbox, capsys):
    df = small.copy()
    df.loc[_row(df, "certify", "specformer", sample=0), "finding"] = False
    _refused_everywhere(capsys, base, _new(df, tmp_path), sandbox,
                        "whose stored finding contradicts bounds/registry.py (first: certify row specformer")


def test_a_tampered_ratio_is_refused(small, base, tmp_path, sandbox, capsys):
    df = small.copy()
    df.loc[_row(df, "bound", "lofast_xi", cell_id=HEADS_CELL), "ratio"] *= 0.5
    _refused_everywhere(capsys, base, _new(df, tmp_path), sandbox, "whose stored ratio is not value/pgd")


def _certified_sample(df: pd.DataFrame) -> tuple[int, pd.Series]:
    """A sample certified by lofast_M (pairwise) that PGD did not break, and the mask of its rows."""
    flag = lambda col: df[col].astype("boolean").fillna(False)
    rows = df[(df["role"] == "certify") & (df["bound"] == "lofast_M") & flag("certified_pairwise")
              & ~flag("pgd_broken")]
    s = int(rows["sample"].iloc[0])
    return s, (df["sweep"] == CERTIFY_SWEEP) & (df["sample"] == s) & df["role"].isin(["certify", "pgd"])


def _break(df: pd.DataFrame) -> int:
    """Forges, consistently, PGD breaking a certified image: pgd_margin < 0 on all its rows, the
    margin drop of its attack row and the cell's robust accuracy to match. Returns the image."""
    s, rows = _certified_sample(df)
    df.loc[rows, ["pgd_margin", "pgd_broken"]] = [-0.5, True]
    drop = rows & (df["role"] == "pgd")
    df.loc[drop, "value"] = df.loc[drop, "margin"] + 0.5
    robust = df[(df["role"] == "pgd") & (df["bound"] == "pgd_margin")]
    df.loc[_row(df, "accuracy", "pgd_margin"), "value"] = float((robust["pgd_margin"] > 0).mean())
    return s


def test_a_certified_image_marked_broken_with_flags_untouched_is_refused(small, base, tmp_path,
                                                                          sandbox, capsys):
    df = small.copy()
    _, rows = _certified_sample(df)
    df.loc[rows, "pgd_broken"] = True  # pgd_margin still > 0: the columns disagree
    _refused_everywhere(capsys, base, _new(df, tmp_path), sandbox,
                        "whose stored pgd_broken contradicts pgd_margin ≤ 0")


def test_a_certified_image_pgd_breaks_is_a_violation(small, base, tmp_path, sandbox, capsys):
    """The attack's columns forged consistently (pgd_margin < 0 on every row of the image, the
    margin drop to match): the stored violation=False of lofast_M's row contradicts them."""
    df = small.copy()
    _break(df)
    _refused_everywhere(capsys, base, _new(df, tmp_path), sandbox,
                        "whose stored violation contradicts value, pgd and the registry (first: certify row")
    # stated honestly it is judged: x in compare (specformer's row, a finding, is not)
    new = _new(_honest(df), tmp_path / "honest")
    code, out, _ = main_inprocess(capsys, "compare", base, new)
    assert code == 1 and "| x | lofast_M |" in out and "| x | specformer |" not in out, out
    code, _, err = main_inprocess(capsys, "baseline", "--update", "--from", new)
    one_error(code, err, "soundness violation(s)")
    assert not sandbox.exists()


def test_prop1_alone_counts_as_certified(small, base, tmp_path, capsys):
    """An image certified by Proposition 1 but (inconsistently) not by the pairwise test, then broken
    by PGD, is still a certified image broken: a violation, never excused by the other column."""
    df = small.copy()
    i = _row(df, "certify", "lofast_M", sample=_break(df))
    df.loc[i, ["certified_pairwise", "certified_prop1"]] = [False, True]
    assert derive(df).loc[i, "violation"]
    code, _, err = main_inprocess(capsys, "compare", base, _new(df, tmp_path))
    one_error(code, err, "whose stored violation contradicts")


def test_the_committed_baseline_passes_against_itself(tmp_path):
    """NEW as the CSV, not the directory: compare writes compare.md into a NEW directory."""
    before = sorted(BASELINE.parent.iterdir())
    r = cli("compare", BASELINE.parent, BASELINE, cwd=tmp_path)
    assert sorted(BASELINE.parent.iterdir()) == before
    assert r.returncode == 0 and r.stdout.rstrip().endswith("OK") and r.stderr == "", r.stderr
    assert "`x` soundness violation: 0" in r.stdout and "`!` missing in NEW: 0" in r.stdout


@pytest.mark.parametrize("tamper,words", [
    ("label", "whose per-sample columns (label, correct, margin, pgd_margin, pgd_broken) differ"),
    ("drop", "of the margin attack whose value is not margin − pgd_margin"),
    ("accuracy", "of accuracy that is not the share of the cell's images"),
])
def test_network_columns_that_disagree_are_refused(tamper, words, small, base, tmp_path, sandbox, capsys):
    df = small.copy()
    if tamper == "label":  # one bound's row of an image names another class
        i = _row(df, "certify", "taylor", sample=2)
        df.loc[i, "label"] = df.loc[i, "label"] + 1
    elif tamper == "drop":  # a stronger attack claimed than its own margins show
        df.loc[_row(df, "pgd", "pgd_margin", sample=2), "value"] *= 2
    else:  # robust accuracy raised without the images to show for it
        df.loc[_row(df, "accuracy", "pgd_margin"), "value"] += 0.02
    _refused_everywhere(capsys, base, _new(df, tmp_path), sandbox, words)


def test_crown_rows_missing_where_auto_lirpa_is_absent_are_skipped_not_failed(monkeypatch):
    """A run without auto_LiRPA leaves the CROWN rows out (with a note): compare marks them ``s``
    and passes; where auto_LiRPA is importable the same gap is ``!`` and fails."""
    from bench.report import compare
    from bounds import crown
    from models import InputError

    df = pd.read_csv(BASELINE, **READ)
    base = df[df["sweep"].isin(["crown", "alpha_crown"])]
    assert {"crown", "alpha_crown"} <= set(base["bound"])
    new = base[~base["bound"].isin(["crown", "alpha_crown"])]

    def absent():
        raise InputError("auto_LiRPA is not installed")

    monkeypatch.setattr(crown, "lirpa_module", absent)  # what every bound's check asks
    j = compare.compare(base, new)
    assert set(j.loc[j["bound"].isin(["crown", "alpha_crown"]), "marker"]) == {"s"}
    assert compare.failures(j) == []
    monkeypatch.undo()
    if crown.available():
        j = compare.compare(base, new)
        assert set(j.loc[j["bound"].isin(["crown", "alpha_crown"]), "marker"]) == {"!"}
        assert compare.failures(j) == ["!"]


def test_a_remainder_bound_below_the_attacked_remainder_fails_compare(tmp_path, capsys):
    """Attention's Taylor remainder (docs/bounds.md §2.3.1–2.3.2) is judged like every certified
    bound: against the attack on the remainder itself (objective ``remainder``, its pgd_remainder
    row); just below it, compare marks it ``x`` and fails."""
    df = pd.read_csv(BASELINE, **READ)
    cell = df.loc[df["bound"] == "taylor_remainder", "cell_id"].iloc[0]
    sub = df[df["cell_id"] == cell].reset_index(drop=True)
    assert not derive(sub)["violation"].any()
    i = _row(sub, "bound", "taylor_remainder", sample=0)
    assert sub.loc[i, "pgd"] == sub.loc[_row(sub, "pgd", "pgd_remainder", sample=0), "value"]
    base = tmp_path / "base.csv"
    sub.to_csv(base, index=False)
    sub.loc[i, "value"] = sub.loc[i, "pgd"] * (1 - 10 * SOUND_RTOL)
    assert derive(sub).loc[i, "violation"]
    code, out, _ = main_inprocess(capsys, "compare", base, _new(_honest(sub), tmp_path))
    assert code == 1 and "| x | taylor_remainder |" in out, out


# --- baseline --update against the baseline it replaces (issue #23) -------------------------------

JUDGED = ["bound", "pgd", "certify"]


@pytest.fixture
def previous(small, sandbox) -> Path:
    """A baseline to replace: the small table, as an earlier update would have left it."""
    (sandbox / "baseline").mkdir(parents=True)
    small.to_csv(sandbox / "baseline" / "results.csv", index=False)
    return sandbox / "baseline"


def _looser(df: pd.DataFrame) -> pd.DataFrame:
    """lofast_M of the one-head cell 1.5× its value: its value/PGD rises beyond any tolerance."""
    df.loc[_row(df, "bound", "lofast_M", cell_id=EPS_CELL), "value"] *= 1.5
    return df


def _weaker(df: pd.DataFrame) -> pd.DataFrame:
    """PGD on δ₂ 10 % lower, on its row and on the two bounds it is the PGD value of (whose ratios
    rise with it: looser, too)."""
    at = (df["cell_id"] == EPS_CELL) & (df["sample"] == 0)
    i = _row(df, "pgd", "pgd_delta2", cell_id=EPS_CELL, sample=0)
    df.loc[i, "value"] *= 0.9
    df.loc[at & (df["role"] == "bound") & (df["objective"] == "delta2"), "pgd"] = df.loc[i, "value"]
    return df


def _finding(df: pd.DataFrame) -> pd.DataFrame:
    """SpecFormer's published statement (a finding) broken: its value below PGD, no violation."""
    i = _row(df, "bound", "specformer", cell_id=EPS_CELL, sample=0)
    df.loc[i, "value"] = 0.5 * df.loc[i, "pgd"]
    return df


def _removed(df: pd.DataFrame) -> pd.DataFrame:
    return df.drop(index=[_row(df, "bound", b, cell_id=EPS_CELL) for b in ("naive", "lofast_xi")])


@pytest.mark.parametrize("change,words,names", [
    (_removed, "removed 2", "removed"),
    (_looser, "looser 1", "looser"),
    (_weaker, "looser 2; weaker 1", "looser,weaker"),
    (_finding, "finding 1 (specformer)", "finding"),
])
def test_update_refuses_each_class_with_its_counts(change, words, names, small, previous, sandbox,
                                                   tmp_path, capsys):
    before = {p.name: p.read_bytes() for p in previous.iterdir()}
    new = _new(_honest(change(small.copy())), tmp_path)
    code, _, err = main_inprocess(capsys, "baseline", "--update", "--from", new)
    one_error(code, err, f"baseline --update refused against {previous / 'results.csv'}: ")
    assert words in err and f"accept by name with --accept {names}" in err, err
    assert {p.name: p.read_bytes() for p in previous.iterdir()} == before
    assert not (sandbox / "reports").exists()
    if "," in names:  # one name is not enough when two classes are refused
        code, _, err = main_inprocess(capsys, "baseline", "--update", "--from", new,
                                      "--accept", names.split(",")[0])
        one_error(code, err, words.split("; ")[1])


def test_accepted_by_name_the_update_goes_through_and_says_so_in_changes(small, previous, sandbox,
                                                                          tmp_path, capsys):
    df = _removed(_looser(small.copy())).assign(date="2031-02-03T04:05:06+00:00")
    new = _new(_honest(df), tmp_path)
    code, _, err = main_inprocess(capsys, "baseline", "--update", "--from", new,
                                  "--accept", "removed", "--accept", "looser")
    assert code == 0, err
    assert (previous / "results.csv").read_bytes() == (new / "results.csv").read_bytes()
    assert (sandbox / "reports" / "README.md").exists()
    text = (previous / "CHANGES.md").read_text()
    compared = int(small["role"].isin(JUDGED).sum()) - 2
    commit = small["git_commit"].iloc[0]
    assert text.startswith("# Changes of the committed baseline\n"), text
    assert text.endswith(f"\n## 2031-02-03: rows of {commit}\n\n"
                         f"- rows {len(df)}, compared {compared} (tol 0.02): better 0, worse 1, removed 2, "
                         f"added 0\n- accepted: removed 2; looser 1\n"), text


def test_first_update_and_the_next_append_their_entries(small, sandbox, tmp_path, capsys):
    """With no baseline yet the entry is written without a comparison; the next one is appended."""
    code, _, err = main_inprocess(capsys, "baseline", "--update", "--from", _new(small, tmp_path / "a"))
    assert code == 0, err
    log = sandbox / "baseline" / "CHANGES.md"
    first = log.read_text()
    assert f"- rows {len(small)}; the first baseline recorded here, compared with none\n" in first
    assert first.endswith("- accepted: nothing\n"), first
    new = _new(_honest(_finding(small.copy())), tmp_path / "b")
    code, _, err = main_inprocess(capsys, "baseline", "--update", "--from", new, "--accept", "finding")
    assert code == 0, err
    second = log.read_text()
    assert second.startswith(first) and second.count("\n## ") == 2, second
    assert "better 1, worse 0, removed 0, added 0" in second and "accepted: finding 1 (specformer)" in second


@pytest.mark.parametrize("column,value,words", [
    ("git_dirty", True, "3 row(s) from a dirty tree (git_dirty not False)"),
    ("git_commit", "", "3 row(s) without a git_commit"),
])
def test_rows_from_a_dirty_tree_need_allow_dirty(column, value, words, small, previous, sandbox, tmp_path,
                                                 capsys):
    df = small.copy()
    df[column] = df[column].astype(object)
    df.loc[:2, column] = value
    new = _new(df, tmp_path)
    code, _, err = main_inprocess(capsys, "baseline", "--update", "--from", new)
    one_error(code, err, words)
    assert "accept by name with --allow-dirty" in err and not (previous / "CHANGES.md").exists()
    code, _, err = main_inprocess(capsys, "baseline", "--update", "--from", new, "--allow-dirty")
    assert code == 0, err
    assert f"- accepted: {words} (--allow-dirty)\n" in (previous / "CHANGES.md").read_text()


@pytest.mark.parametrize("old", ["no row in common", "older schema"])
def test_a_previous_baseline_that_cannot_be_compared_needs_accepting(old, small, previous, tmp_path, capsys):
    other = small.assign(sweep=small["sweep"] + "_old") if old == "no row in common" else \
        small.assign(schema_version=1)
    other.to_csv(previous / "results.csv", index=False)
    new = _new(small, tmp_path)
    code, _, err = main_inprocess(capsys, "baseline", "--update", "--from", new)
    one_error(code, err, "incomparable (")
    assert ("no row in common" if old == "no row in common" else "results schema version") in err
    code, _, err = main_inprocess(capsys, "baseline", "--update", "--from", new, "--accept", "incomparable")
    assert code == 0, err
    assert "not compared with the previous baseline" in (previous / "CHANGES.md").read_text()


@pytest.mark.parametrize("names,words", [
    ("removed,bogus", "--accept: unknown name 'bogus' (known: removed, looser, weaker, finding"),
    ("violation", "--accept violation: a soundness violation is never accepted"),
    (",", "--accept needs names"),
])
def test_unknown_accept_names_are_refused_before_any_work(names, words, small, previous, tmp_path, capsys):
    before = (previous / "results.csv").read_bytes()
    code, _, err = main_inprocess(capsys, "baseline", "--update", "--from", _new(_removed(small.copy()),
                                                                                tmp_path), "--accept", names)
    one_error(code, err, words)
    assert (previous / "results.csv").read_bytes() == before and not (previous / "CHANGES.md").exists()

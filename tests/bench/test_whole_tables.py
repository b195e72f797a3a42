"""Issue #25 and #23: tables that know when they are whole (a run seals its results.csv in run.json;
a cut copy is refused as cut by report, compare and baseline --update, pointing at the intact cells,
never at --fresh), compare with no row in common, and JSON output that strict parsers read."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import pandas as pd
import pytest
from helpers import ROOT, main_inprocess, one_error

from bench.cli import baseline, certify_cmd, point
from bench.core import store, whole
from bounds import crown

TINY = ROOT / "zoo" / "tiny-digits-d16-b1-h1-c0.5.safetensors"


@pytest.fixture
def copy(finished, tmp_path) -> Path:
    shutil.copytree(finished, tmp_path / "run")
    return tmp_path / "run"


@pytest.fixture
def sandbox(tmp_path, monkeypatch) -> Path:
    """``baseline --update`` writes here, never into the committed results/baseline or reports/."""
    monkeypatch.setattr(baseline, "BASELINE", tmp_path / "sandbox" / "baseline")
    monkeypatch.setattr(baseline, "REPORTS", tmp_path / "sandbox" / "reports")
    return tmp_path / "sandbox"


def _cut(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def _rows(path: Path) -> int:
    return len(pd.read_csv(path))


def _refused_as_cut(capsys, finished: Path, cut: Path, sandbox: Path, words: str) -> str:
    """report, compare (either side) and baseline --update each refuse ``cut`` with one error line
    holding ``words``, never naming --fresh, writing nothing."""
    lines = []
    for args in (("report", cut, "--out", cut.parent / "rep"), ("compare", finished, cut),
                 ("compare", cut, finished), ("baseline", "--update", "--from", cut)):
        code, out, err = main_inprocess(capsys, *args)
        one_error(code, err, words)
        assert "--fresh" not in err and out == "", err
        lines.append(err)
    assert not (cut.parent / "rep").exists() and not sandbox.exists()
    assert not (finished / "compare.md").exists() and not (cut.parent / "compare.md").exists()
    return lines[0]


# --- A run seals its table --------------------------------------------------------------------------

def test_a_finished_run_seals_its_table_in_run_json(finished):
    seal = json.loads((finished / "run.json").read_text())["table"]
    raw = (finished / "results.csv").read_bytes()
    assert seal == {"rows": _rows(finished / "results.csv"), "sha256": hashlib.sha256(raw).hexdigest()}
    assert len(store.load(finished)) == seal["rows"]


@pytest.mark.parametrize("where", ["40 bytes before the end", "at half", "at a row's end"])
def test_a_cut_run_table_is_refused_naming_the_intact_rows_and_resume(where, finished, copy, sandbox,
                                                                         capsys):
    table = copy / "results.csv"
    raw, rows = table.read_bytes(), _rows(table)
    keep = {"40 bytes before the end": len(raw) - 40, "at half": len(raw) // 2,
            "at a row's end": raw.rstrip(b"\n").rindex(b"\n") + 1}[where]
    _cut(table, keep)
    intact = raw[:keep].count(b"\n") - 1  # every row here fits on one line
    err = _refused_as_cut(capsys, finished, copy, sandbox, f"is cut: {intact} of the {rows} rows")
    assert "2 finished cells are kept" in err and "resume the run" in err and "profile one" in err
    # resuming (no --fresh) gathers the intact cells again: the table is whole and loads
    code, _, err = main_inprocess(capsys, "run", "--profile", finished.parent / "one.toml", "--out", copy)
    assert code == 0, err
    assert table.read_bytes() == raw
    code, out, err = main_inprocess(capsys, "compare", finished, copy)
    assert code == 0 and out.endswith("OK\n"), err


def test_a_sealed_table_changed_after_the_run_is_refused(finished, copy, sandbox, capsys):
    table = copy / "results.csv"
    df = pd.read_csv(table)
    df.loc[0, "seconds"] = df.loc[0, "seconds"] + 1  # a column the gate does not judge
    df.to_csv(table, index=False)
    _refused_as_cut(capsys, finished, copy, sandbox, "does not match its run.json")


def test_the_table_named_as_a_file_is_checked_against_its_run_json(finished, copy, capsys):
    _cut(copy / "results.csv", (copy / "results.csv").stat().st_size - 40)
    code, _, err = main_inprocess(capsys, "compare", finished, copy / "results.csv")
    one_error(code, err, "is cut")


def test_an_unreadable_run_json_beside_the_table_is_one_error(finished, copy, capsys):
    _cut(copy / "run.json", 30)
    code, _, err = main_inprocess(capsys, "report", copy, "--out", copy / "rep")
    one_error(code, err, "run.json is unreadable")


def test_a_run_without_a_seal_still_loads_and_its_cut_end_is_refused(finished, copy, sandbox, capsys):
    """A run directory written before seals: whole, it loads; cut mid-row, it is refused as cut."""
    m = json.loads((copy / "run.json").read_text())
    m.pop("table", None)
    (copy / "run.json").write_text(json.dumps(m))
    code, out, err = main_inprocess(capsys, "compare", finished, copy)
    assert code == 0 and out.endswith("OK\n"), err
    (copy / "compare.md").unlink()
    _cut(copy / "results.csv", (copy / "results.csv").stat().st_size - 40)
    err = _refused_as_cut(capsys, finished, copy, sandbox, "is cut: its last row has")
    assert "resume the run" in err


# --- bare tables (no run.json): the shape of their end ------------------------------------------------

@pytest.mark.parametrize("cut,words", [(40, "is cut: its last row has"), ("half", "is cut: its last"),
                                       (1, "is cut: its last line ends without a newline")])
def test_a_bare_csv_cut_mid_row_is_refused(cut, words, finished, tmp_path, sandbox, capsys):
    bare = tmp_path / "bare" / "table.csv"
    bare.parent.mkdir()
    raw = (finished / "results.csv").read_bytes()
    bare.write_bytes(raw[:len(raw) // 2] if cut == "half" else raw[:-cut])
    err = _refused_as_cut(capsys, finished, bare, sandbox, words)
    assert "copy the whole table again" in err


def test_a_bare_csv_with_a_short_row_inside_is_refused(finished, tmp_path, capsys):
    lines = (finished / "results.csv").read_text().split("\n")
    lines[2] = ",".join(lines[2].split(",")[:-3])
    (tmp_path / "short.csv").write_text("\n".join(lines))
    code, _, err = main_inprocess(capsys, "compare", finished, tmp_path / "short.csv")
    one_error(code, err, "is not a whole table: row 2 has")


def test_the_committed_baseline_has_a_whole_shape():
    """results/baseline has no run.json (yet): it is read as a bare table, whose end is whole."""
    table = ROOT / "results" / "baseline" / "results.csv"
    seal = whole.seal_of(table)
    if seal is None:
        whole.check_shape(table, table.read_bytes())
    else:  # regenerated by baseline --update, which seals it
        whole.check_seal(table, table.read_bytes(), seal)


def test_baseline_update_seals_the_baseline(finished, sandbox, capsys):
    code, _, err = main_inprocess(capsys, "baseline", "--update", "--from", finished,
                                  "--allow-dirty")  # the run's rows: dirty where the checkout is
    assert code == 0, err
    base = sandbox / "baseline"
    m = json.loads((base / "run.json").read_text())
    assert m["table"] == json.loads((finished / "run.json").read_text())["table"]
    assert m["cells"] and m["git_commit"] == json.loads((finished / "run.json").read_text())["git_commit"]
    _cut(base / "results.csv", (base / "results.csv").stat().st_size // 2)
    code, _, err = main_inprocess(capsys, "report", base, "--out", sandbox / "rep")
    one_error(code, err, "is cut")
    assert "copy the whole table again" in err and "--fresh" not in err


def test_the_paper_profile_has_its_own_table_and_report_inside_reports(finished, tmp_path, sandbox,
                                                                        monkeypatch, capsys):
    """--profile paper-cpu writes results/paper and reports/paper (moved here), leaves the quick
    baseline alone, and survives a rebuild of reports/; rows of one committed profile never replace
    the other's table."""
    monkeypatch.setattr(baseline, "PAPER", sandbox / "paper")
    monkeypatch.setattr(baseline, "PAPER_REPORTS", sandbox / "reports" / "paper")
    paper = tmp_path / "paper-run"
    shutil.copytree(finished, paper)
    df = pd.read_csv(paper / "results.csv")
    df.assign(profile="paper-cpu").to_csv(paper / "bare.csv", index=False)
    args = ("baseline", "--update", "--allow-dirty", "--from")
    code, _, err = main_inprocess(capsys, *args, paper / "bare.csv")
    one_error(code, err, "rows are of profile paper-cpu")
    assert "--profile paper-cpu" in err and not (sandbox / "baseline").exists()
    code, _, err = main_inprocess(capsys, *args, paper / "bare.csv", "--profile", "paper-cpu")
    assert code == 0, err
    assert (sandbox / "paper" / "results.csv").is_file() and (sandbox / "paper" / "CHANGES.md").is_file()
    inner = (sandbox / "reports" / "paper" / "README.md").read_bytes()
    code, _, err = main_inprocess(capsys, *args, finished)
    assert code == 0, err
    assert (sandbox / "reports" / "paper" / "README.md").read_bytes() == inner
    assert (sandbox / "reports" / "README.md").is_file()


def test_baseline_update_from_a_bare_csv_seals_it(finished, tmp_path, sandbox, capsys):
    shutil.copy(finished / "results.csv", tmp_path / "bare.csv")
    code, _, err = main_inprocess(capsys, "baseline", "--update", "--from", tmp_path / "bare.csv",
                                  "--allow-dirty")  # the run's rows: dirty where the checkout is
    assert code == 0, err
    assert json.loads((sandbox / "baseline" / "run.json").read_text()) == {
        "table": whole.record((finished / "results.csv").read_bytes(), _rows(finished / "results.csv"))}


# --- compare with no row in common ------------------------------------------------------------------

@pytest.mark.parametrize("extra", [[], ["--allow-missing"]])
def test_compare_with_no_row_in_common_is_an_error(extra, finished, tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    df = pd.read_csv(finished / "results.csv")
    df["sweep"] = "another"
    df.to_csv(other / "results.csv", index=False)
    code, out, err = main_inprocess(capsys, "compare", finished, other, *extra)
    one_error(code, err, "no row in common")
    assert out == "" and not (other / "compare.md").exists()


# --- JSON that strict parsers read ------------------------------------------------------------------

def _strict(text: str):
    def refuse(constant: str):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_certify_json_writes_non_finite_numbers_as_null(monkeypatch, capsys):
    real = certify_cmd.per_sample
    monkeypatch.setattr(certify_cmd, "per_sample",
                        lambda res, index: real(res, index)
                        | {"delta": {"x": [math.nan, math.inf, -math.inf, 1.0]}})
    code, out, err = main_inprocess(capsys, "certify", "--model", TINY, "--limit", 2, "--eps", "0.01",
                                    "--bounds", "lofast_M", "--pgd-steps", 2, "--pgd-restarts", 1, "--json")
    assert code == 0, err
    assert _strict(out)["samples"]["delta"]["x"] == [None, None, None, 1.0]


@pytest.mark.skipif(not crown.available(), reason="auto_LiRPA is not installed (the crown extra)")
def test_certify_json_with_crown_is_strict_json(capsys):
    """CROWN's δ is NaN (it certifies the margins directly): issue #23's case, end to end."""
    code, out, err = main_inprocess(capsys, "certify", "--model", TINY, "--limit", 2, "--eps", "0.01",
                                    "--bounds", "crown", "--pgd-steps", 2, "--pgd-restarts", 1, "--json")
    assert code == 0, err
    parsed = _strict(out)
    assert parsed["samples"]["delta"]["crown"]["0.01"] == [None, None]
    assert "verifies the margins directly" in parsed["nulls"]["crown"]  # the null's reason


def test_certify_json_says_why_taylor_net_has_no_delta(capsys):
    code, out, err = main_inprocess(capsys, "certify", "--model", TINY, "--limit", 2, "--eps", "0.01",
                                    "--bounds", "taylor_net,lofast_M", "--pgd-steps", 2, "--pgd-restarts", 1,
                                    "--json")
    assert code == 0, err
    parsed = _strict(out)
    assert set(parsed["nulls"]) == {"taylor_net"}, parsed["nulls"]


def test_point_json_writes_non_finite_numbers_as_null(tmp_path, monkeypatch, capsys):
    import models

    models.save_layer(tmp_path / "layer.safetensors", models.random_dot(4, 2, seed=1))
    models.save_input(tmp_path / "x.safetensors", models.random_input(3, 4, norm=1.0, seed=2)[0])
    real = point.to_json
    monkeypatch.setattr(point, "to_json", lambda *a: real(*a) | {"overflowed": math.inf, "nan": [math.nan]})
    code, out, err = main_inprocess(capsys, "point", "--layer", tmp_path / "layer.safetensors", "--input",
                                    tmp_path / "x.safetensors", "--eps", "0.05", "--bounds", "lofast_M",
                                    "--pgd-steps", 2, "--pgd-restarts", 1, "--json")
    assert code == 0, err
    got = _strict(out)
    assert got["overflowed"] is None and got["nan"] == [None] and got["lofast_M"] > 0


def test_dumps_cleans_at_any_depth():
    from bench.core.jsonout import dumps

    assert dumps({"a": (1.0, [math.nan, {"b": -math.inf}])}) == '{"a": [1.0, [null, {"b": null}]]}'

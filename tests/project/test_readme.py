"""README and docs/ (issue #22 item 6): README is short, every page of docs/ is reachable from it, and
every relative link resolves; the numbers the pages print are the committed baseline's (issue #25:
numbers typed by hand went stale): the Taylor-vs-ε table, the taylor_net table and its row count of
docs/results.md, recomputed here from results/baseline/results.csv; the README tour's profile is
cells of that baseline, so its `compare` finds them."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pandas as pd
import pytest
from helpers import ROOT

from bench.core.store import READ
from bench.sweep.profiles import load_profile

README = ROOT / "README.md"
RESULTS = (ROOT / "docs" / "results.md").read_text()
BASELINE = ROOT / "results" / "baseline" / "results.csv"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]

FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


@pytest.fixture(scope="module")
def base() -> pd.DataFrame:
    return pd.read_csv(BASELINE, **READ)


# --- README's size and the links of README and docs/ -----------------------------------------------

def test_readme_is_at_most_15_kib():
    assert README.stat().st_size <= 15 * 1024, README.stat().st_size


def test_readme_keeps_the_two_commands_ci_runs():
    # .ci/run runs "exactly README's test command"
    text = README.read_text()
    assert "python -m pip install tox && tox -e py      # the tests" in text
    assert "python -m pip install tox && tox -e bench" in text
    assert "tox -e py" in (ROOT / ".ci" / "run").read_text()


def _prose(text: str) -> str:
    """The text outside fenced code blocks and code spans: what GitHub renders links and headings from."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text (link targets and formatting dropped), lower case, every
    character but letters, digits, marks, '_', '-' and ' ' removed, then each space made a '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    kept = "".join(c for c in text if c.isalnum() or c in "_- " or unicodedata.category(c).startswith("M"))
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a page, with GitHub's -1, -2 … for repeated headings."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        s = slug(heading)
        out.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return out


def links(page: Path) -> list[str]:
    """The relative link targets of a page (not web addresses)."""
    return [t for t in LINK.findall(_prose(page.read_text())) if not re.match(r"[a-z]+:", t)]


def test_the_slug_is_githubs():
    assert slug("`taylor_net`: certified as far as the attack reaches") == \
        "taylor_net-certified-as-far-as-the-attack-reaches"
    assert slug("`baseline --update`") == "baseline---update"
    assert slug("The Taylor bound: exact as ε → 0") == "the-taylor-bound-exact-as-ε--0"
    assert slug("One layer: `python -m bench point`") == "one-layer-python--m-bench-point"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, broken


def test_every_page_of_docs_is_reachable_from_readme():
    seen, todo = set(), [README.resolve()]
    while todo:
        page = todo.pop()
        if page in seen:
            continue
        seen.add(page)
        for target in links(page):
            dest = (page.parent / target.partition("#")[0]).resolve()
            if dest.suffix == ".md" and dest.is_file() and (ROOT / "docs") in dest.parents:
                todo.append(dest)
    assert [p for p in PAGES if p.resolve() not in seen] == []


# --- the tour -----------------------------------------------------------------------------------------

def test_the_tours_cells_are_the_baselines(base):
    """README's tour runs docs/tour.toml and compares it with the baseline: every cell of it is a
    baseline cell of the same sweep, PGD and seed, so the comparison finds its rows."""
    profile = load_profile(str(ROOT / "docs" / "tour.toml"))
    assert profile.cells()
    for sweep, cell in profile.cells():
        rows = base[(base["sweep"] == sweep) & (base["cell_id"] == cell.id)]
        assert len(rows), (sweep, cell.id)
        assert set(rows["pgd_steps"]) == {profile.run["pgd_steps"]}
        assert set(rows["pgd_restarts"]) == {profile.run["pgd_restarts"]}
        assert set(rows["run_seed"]) == {profile.run["seed"]}


# --- docs/results.md's numbers are the baseline's ----------------------------------------------------

def _table_after(marker: str) -> list[list[str]]:
    """The rows (cells stripped) of the first Markdown table after ``marker`` in docs/results.md."""
    text = RESULTS[RESULTS.index(marker):]
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    start = text.splitlines().index(lines[0])
    rows = []
    for ln in text.splitlines()[start:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip("|").split("|")])
    return rows[2:]  # header and rule


def _shown(printed: str, value: float) -> bool:
    """Whether ``value`` prints as ``printed`` at the printed number of decimals."""
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    return f"{value:.{decimals}f}" == printed


def test_the_taylor_eps_table_is_the_baselines(base):
    rows = _table_after("Measured on the quick\nprofile's sweep `taylor_eps`")
    cells = base[(base["sweep"] == "taylor_eps") & (base["role"] == "bound") & (base["x_norm"] == 5)]
    names = {"Taylor": "taylor", "LoFAST (‖M‖)": "lofast_M", "LoFAST ½ (‖M‖) (this suite)": "lofast_M_half",
             "best": "best"}
    eps = [1e-4, 1e-3, 1e-2, 0.1, 1.0]
    assert [r[0] for r in rows] == list(names)
    for r in rows:
        got = cells[cells["bound"] == names[r[0]]].set_index("eps")["ratio"]
        for printed, e in zip(r[1:], eps, strict=True):
            assert _shown(printed, float(got.loc[e])), (r[0], e, printed, float(got.loc[e]))


def _certified(base: pd.DataFrame, model: str, eps: float, bound: str) -> float:
    rows = base[(base["role"] == "certify") & (base["model"] == model) & (base["eps"] == eps)
                & (base["bound"] == bound)]
    return float(rows["certified_pairwise"].astype(bool).mean()) if len(rows) else float("nan")


def _robust(base: pd.DataFrame, model: str, eps: float) -> float:
    rows = base[(base["role"] == "pgd") & (base["bound"] == "pgd_margin") & (base["model"] == model)
                & (base["eps"] == eps)]
    return float((rows["pgd_margin"] > 0).mean())


def test_the_taylor_net_table_is_the_baselines(base):
    head = "taylor_net's verdicts are their own), 0 violations over "
    assert f"{head}{len(base):,} rows" in RESULTS
    rows = _table_after(head)
    columns = ["PGD", "taylor_net", "taylor_net_best", "taylor_net_lofast_half", "taylor_net_lofast", "crown",
               "best"]
    model = None
    checked = 0
    for r in rows:
        model = r[0].strip("`").split("`")[0] or model
        for k, e in enumerate(r[1].split(" / ")):
            for col, cell in zip(columns, r[2:], strict=True):
                if cell in ("–", "the same"):
                    continue
                printed = cell.split(" / ")[k].strip("*")
                want = (_robust(base, model, float(e)) if col == "PGD"
                        else _certified(base, model, float(e), col))
                assert printed == ("0" if want == 0 else f"{want:.2f}"), (model, e, col, printed, want)
                checked += 1
    assert checked > 40


def test_the_certified_accuracy_table_is_the_baselines(base):
    """The first table of docs/results.md: PGD, CROWN, best, LoFAST, naive and the cascade with the
    share it sent to CROWN (its s/image rows are timings, not checked)."""
    rows = _table_after("and seconds per image (the median of\neach ε's cell")
    columns = ["PGD", "crown", "best", "lofast_M", "naive", "cascade_crown"]
    model = None
    checked = 0
    for r in rows:
        model = r[0].strip("`") or model
        if r[1] == "s/image":
            continue
        e = float(r[1])
        for col, cell in zip(columns, r[2:], strict=True):
            if cell == "–":
                continue
            printed, _, share = cell.strip("*").partition(" (")
            want = _robust(base, model, e) if col == "PGD" else _certified(base, model, e, col)
            assert printed == ("0" if want == 0 else f"{want:.2f}"), (model, e, col, printed, want)
            if share:
                sent = base[(base["role"] == "certify") & (base["model"] == model) & (base["eps"] == e)
                            & (base["bound"] == col)]["sent_to_crown"].astype(float).mean()
                assert share.rstrip(")") == f"{sent:.2f}", (model, e, share, sent)
            checked += 1
    assert checked >= 30

"""The report of whole-network certification (LoFAST Fig. 2, Table 1, the cascade's Table 2), on
synthetic rows whose certified counts are known: Wilson intervals, curves merged only when equal at
every ε, a shared y axis, a column for every bound present, Table 2 only when a cascade ran."""

from __future__ import annotations

import itertools
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import pytest

from bench.core.store import load
from bench.report.draw import draw, theme
from bench.report.figures import FIGURES
from bench.report.panels import Skip
from bench.report.studies import certify_study as rc
from bench.report.studies.trained_study import PGD_REF, SENT, counts, name_of, wilson
from bench.report.tables import TABLES, to_latex, to_markdown

BASELINE = Path(__file__).resolve().parents[1] / "results" / "baseline" / "results.csv"
N = 10
EPS = [0.01, 0.1]
ARCH = {"A": {"vit_depth": 1, "vit_heads": 2}, "B": {"vit_depth": 2, "vit_heads": 4}}


def rows(certified: dict, pgd: float = 0.9, sweep: str = "certify", sent: dict | None = None,
         n: int = N) -> pd.DataFrame:
    """Network rows of models A and B at EPS over N images: ``certified[bound][(model, eps)]`` images
    certified (the first ones); ``sent[bound]``: how many images a cascade passed on to CROWN."""
    out = []
    for model, e in itertools.product(ARCH, EPS):
        cols = {"sweep": sweep, "model": model, "eps": e, "dataset": "digits", "git_commit": "abcdef1234567",
                "samples": n, "vit_d": 32, "vit_c": 0.5, "vit_qk": 1.0, "vit_margin_eps": 0.003,
                "vit_test_accuracy": 0.9, **ARCH[model]}
        for bound, k in certified.items():
            for i in range(n):
                r = cols | {"role": "certify", "bound": bound, "sample": i, "seconds": 0.01 * (1 + i % 2),
                            "certified_pairwise": i < k[(model, e)], "certified_prop1": False}
                if sent and bound in sent:
                    r[SENT] = i < sent[bound]
                out.append(r)
        out += [cols | {"role": "accuracy", "bound": "clean", "sample": -1, "value": 0.95},
                cols | {"role": "accuracy", "bound": "pgd_margin", "sample": -1, "value": pgd}]
    return pd.DataFrame(out)


def at(a: int, b: int, c: int, d: int) -> dict:
    """Counts per (model, ε) in the order (A, 0.01), (A, 0.1), (B, 0.01), (B, 0.1)."""
    return dict(zip(itertools.product(ARCH, EPS), (a, b, c, d), strict=True))


def test_wilson_interval_is_the_hand_computed_one():
    # k = 7, n = 10, z = 1.959964: centre (0.7 + z²/20)/(1 + z²/10) = 0.644494, half-width
    # z/(1 + z²/10)·√(0.021 + z²/400) = 0.247716
    assert wilson(7, 10) == pytest.approx((0.396778, 0.892209), abs=1e-6)
    assert wilson(0, 50) == pytest.approx((0.0, 3.841459 / 53.841459), abs=1e-6)  # z²/(n + z²)
    c = counts(rows({"naive": at(7, 0, 10, 5)}))
    assert (c.loc[("A", 0.01, "naive"), ["k", "n", "lo", "hi"]].tolist()
            == pytest.approx([7, 10, 0.396778, 0.892209], abs=1e-6))


def test_equal_curves_share_one_line_and_unequal_ones_do_not():
    # naive and LoFAST (‖M‖) equal at every ε of both models; Taylor equal to them at one ε of A only,
    # and at every ε of B
    df = rows({"naive": at(6, 2, 5, 1), "lofast_M": at(6, 2, 5, 1), "taylor": at(6, 3, 5, 1)})
    plot = rc.figure(df)
    a, b = plot.panels
    # one short line per curve: the first name and how many it stands for; the caption names them
    assert [t.label for t in a.traces] == [f"{name_of('naive')} (+1 equal)", name_of("taylor"), PGD_REF]
    assert [t.label for t in b.traces] == [f"{name_of('naive')} (+2 equal)", PGD_REF]
    assert a.traces[0].also == (name_of("lofast_M"),)
    assert b.traces[0].also == (name_of("lofast_M"), name_of("taylor"))
    assert f"{name_of('naive')} also stands for {name_of('lofast_M')}, {name_of('taylor')}" in plot.caption
    line = a.traces[0]
    assert line.x == EPS and line.y == [0.6, 0.2] and line.lo[0] == pytest.approx(wilson(6, 10)[0])
    assert a.traces[-1].style == "reference" and a.traces[-1].y == [0.9, 0.9]


def test_panels_share_their_y_axis():
    df = rows({"naive": at(10, 9, 1, 0), "taylor": at(2, 1, 0, 0)})
    plot = rc.figure(df)
    assert plot.sharey is True and all(p.xscale == "log" for p in plot.panels)
    theme()
    fig = draw(plot)
    try:
        fig.canvas.draw()
        axes = [ax for ax in fig.axes if ax.axison]
        assert len(axes) == 2 and axes[0].get_shared_y_axes().joined(axes[0], axes[1])
        assert axes[0].get_ylim() == axes[1].get_ylim()
        assert all(ax.get_legend() is not None for ax in axes)  # each panel names its own merges
    finally:
        plt.close(fig)


def test_table1_has_every_bound_present_and_recounts_the_rows():
    df = rows({"naive": at(6, 2, 5, 1), "crown": at(8, 4, 7, 3), "alpha_crown": at(9, 5, 7, 3),
               "cascade": at(9, 5, 8, 3)})
    t, caption = TABLES["table1_certified"](df)
    assert len(t) == 2 and t["model"].str.contains("digits").all()
    assert "1 block × 2 heads" in t["model"].iloc[0] and "ε_t=0.003" in t["model"].iloc[0]
    assert "clean 0.950" in t["model"].iloc[0]
    for bound in ("naive", "crown", "alpha_crown", "cascade"):
        for e in EPS:
            assert f"{name_of(bound)} ε={e:g}" in t.columns, bound
        assert t[f"{name_of(bound)} s/sample"].tolist() == ["0.015", "0.015"]
    assert t[f"{name_of('crown')} ε=0.1"].tolist() == ["0.400", "0.300"]
    assert t[f"PGD robust ε={EPS[0]:g}"].tolist() == ["0.900", "0.900"]
    assert "first 10 test images" in caption and "abcdef1234" in caption
    assert to_markdown(t).count("\n") == 4 and "\\begin{tabular}" in to_latex(t, caption)
    c = t.columns.tolist()  # the registry's bounds, CROWN, α-CROWN, the cascade, then any other
    first = [c.index(f"{name_of(b)} ε=0.01") for b in ("naive", "crown", "alpha_crown", "cascade")]
    assert first == sorted(first)
    t, _ = TABLES["table1_certified"](rows({"zz_new": at(1, 1, 1, 1), "crown": at(2, 2, 2, 2)}))
    assert t.columns.tolist()[-3:] == ["zz_new ε=0.01", "zz_new ε=0.1", "zz_new s/sample"]


def test_table2_exists_iff_cascade_rows_do():
    plain = rows({"naive": at(6, 2, 5, 1), "crown": at(8, 4, 7, 3)})
    with pytest.raises(Skip, match="cascade"):
        TABLES["table2_cascade"](plain)
    cascade = rows({"cascade": at(8, 4, 7, 4)}, sweep="cascade", sent={"cascade": 4})
    t, caption = TABLES["table2_cascade"](pd.concat([plain, cascade], ignore_index=True))
    assert len(t) == len(ARCH) * len(EPS)
    crown, cas = name_of("crown"), name_of("cascade")
    assert t[f"{crown} alone: certified acc."].tolist() == ["0.800", "0.400", "0.700", "0.300"]
    assert t[f"{cas}: certified acc."].tolist() == ["0.800", "0.400", "0.700", "0.400"]
    assert t[f"{cas}: share of images sent to {crown}"].tolist() == ["0.400"] * 4
    assert "CROWN alone" in caption and "`certify`, `cascade`" in caption


def test_a_cascade_without_its_share_or_crown_says_so():
    t, _ = TABLES["table2_cascade"](rows({"naive": at(1, 1, 1, 1), "cascade_crown": at(2, 2, 2, 2)}))
    crown, cas = name_of("crown"), name_of("cascade_crown").replace(" (cascade)", "")
    assert set(t[f"{cas}: share of images sent to {crown}"]) == {"–"}
    assert set(t[f"{crown} alone: certified acc."]) == {"–"}
    plot = FIGURES["fig2_certified_accuracy"](rows({"cascade_crown": at(2, 2, 2, 2)}))
    assert plot.panels[0].traces[0].label == name_of("cascade_crown") != "cascade_crown"
    assert name_of("some_new_bound") == "some_new_bound"  # the fallback: its code name


def test_fig2_and_table1_on_the_baseline_recount_the_pairwise_verdicts():
    df = load(BASELINE)
    # the `certify` sweep's models alone (others, e.g. certify_disagree, add panels of their own)
    df = df[~df["role"].isin(["certify", "accuracy"]) | (df["sweep"] == "certify")]
    cert = df[(df["sweep"] == "certify") & (df["role"] == "certify")]
    plot = rc.figure(df)
    assert len(plot.panels) == cert["model"].nunique()
    names = {n: name_of(n) for n in cert["bound"].unique()}
    t, _ = rc.table1(df)
    for (_, bound, eps), g in cert.groupby(["model", "bound", "eps"]):
        row = t[t["model"].str.contains(f"{int(g['vit_depth'].iloc[0])} block")
                & t["model"].str.contains(f"ε_t={g['vit_margin_eps'].iloc[0]:g};")]
        assert float(row[f"{names[bound]} ε={eps:g}"].iloc[0]) == pytest.approx(
            g["certified_pairwise"].mean(), abs=5e-4)
    for p in plot.panels:  # every bound on every panel, once, merged or not
        labels = [n for t in p.traces[:-1] for n in (t.label.split(" (+")[0], *t.also)]
        assert sorted(labels) == sorted(names.values())
        for t in p.traces[:-1]:
            assert all(lo <= y <= hi for lo, y, hi in zip(t.lo, t.y, t.hi, strict=True)), t.label


def test_a_verdict_recorded_in_prop1_alone_is_read_from_there():
    df = rows({"crown": at(3, 3, 3, 3)})
    df["certified_prop1"] = df["certified_pairwise"]
    df["certified_pairwise"] = pd.array([pd.NA] * len(df), dtype="boolean")
    assert counts(df)["k"].tolist() == [3, 3, 3, 3]


def test_pgd_reference_is_the_strongest_attack_on_the_most_images():
    base = rows({"naive": at(1, 1, 1, 1)}, pgd=0.9)
    again = rows({"crown": at(2, 2, 2, 2)}, pgd=0.8, sweep="crown")  # the same 10 images, stronger
    fewer = rows({"cascade": at(1, 1, 1, 1)}, pgd=0.5, sweep="cascade", n=5)  # 5 images only
    plot = rc.figure(pd.concat([base, again, fewer], ignore_index=True))
    assert plot.panels[0].traces[-1].label == PGD_REF and plot.panels[0].traces[-1].y == [0.8, 0.8]


def test_a_certified_accuracy_above_pgd_is_named_in_the_caption():
    assert "and none does" in rc.figure(rows({"naive": at(9, 9, 9, 9)})).caption
    caption = rc.figure(rows({"naive": at(9, 9, 9, 10)})).caption  # 1.0 > PGD's 0.9 on B at ε=0.1
    assert f"{name_of('naive')} on B at ε=0.1 (1.000 > 0.900)" in caption and "and none does" not in caption


def caption(df: pd.DataFrame) -> str:
    """Table 1's sentence on where the bounds disagree, of these rows."""
    return rc.disagreements(counts(df), df.drop_duplicates("model").set_index("model")["vit_margin_eps"])


def test_table1_names_the_models_where_the_bounds_disagree():
    # A: CROWN certifies 1 image of 10 more than LoFAST at ε = 0.01 (10 points); B: within 0 points
    df = rows({"lofast_M": at(5, 0, 3, 1), "best": at(5, 0, 3, 1), "crown": at(6, 0, 3, 1)})
    text = caption(df)
    assert text.startswith(" The bounds disagree by ≥ 5% of the images on `A` (CROWN 0.60 vs ")
    assert "at ε=0.01)" in text and "agree within 5% on `B`: margin training" in text
    assert text in rc.table1(df)[1]
    # nothing certified anywhere is said as such, and a model without margin training is not
    # explained by it
    none = rows({"lofast_M": at(0, 0, 0, 0), "best": at(0, 0, 0, 0)}).assign(vit_margin_eps=0.0)
    assert caption(none) == " They agree within 5% on `A`, `B`: none of them certifies an image at these ε."
    assert caption(rows({"naive": at(1, 1, 1, 1)})) == ""  # no LoFAST (‖M‖) to rank against

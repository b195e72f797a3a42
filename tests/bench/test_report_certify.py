"""The report of whole-network certification (LoFAST Fig. 2, Table 1, the cascade's Table 2), on
synthetic rows whose certified counts are known: Wilson intervals, curves merged only when equal at
every ε, a shared y axis; Tables 1 and 2 in LoFAST's layout (a row per method, two columns per model
at the ε of record, at most 14 columns a part) with every ε in the full CSV; Table 2 only when a
cascade ran."""

from __future__ import annotations

import itertools
import re

import matplotlib.pyplot as plt
import pandas as pd
import pytest
from helpers import ROOT

from bench.core.store import load
from bench.report.draw import draw, theme
from bench.report.figures import FIGURES
from bench.report.panels import Parts, Skip
from bench.report.studies import certify_study as rc
from bench.report.studies import certify_tables as ct
from bench.report.studies.trained_study import PGD_REF, SENT, counts, name_of, wilson
from bench.report.tables import TABLES, to_latex, to_markdown

BASELINE = ROOT / "results" / "baseline" / "results.csv"
N = 10
EPS = [0.01, 0.1]
ARCH = {"A": {"vit_depth": 1, "vit_heads": 2}, "B": {"vit_depth": 2, "vit_heads": 4}}


def rows(certified: dict, pgd: float = 0.9, sweep: str = "certify", sent: dict | None = None,
         n: int = N, eps: list[float] = EPS) -> pd.DataFrame:
    """Network rows of models A and B at EPS over N images: ``certified[bound][(model, eps)]`` images
    certified (the first ones); ``sent[bound]``: how many images a cascade passed on to CROWN."""
    out = []
    for model, e in itertools.product(ARCH, eps):
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


def one(made: Parts) -> tuple[pd.DataFrame, str]:
    """The table and caption of a study that made one part."""
    assert isinstance(made, Parts) and len(made.parts) == 1, made
    return made.parts[0][1], made.parts[0][2]


def test_table1_is_one_row_per_method_and_two_columns_per_model():
    df = rows({"naive": at(6, 2, 5, 1), "crown": at(8, 4, 7, 3), "alpha_crown": at(9, 5, 7, 3),
               "cascade": at(9, 5, 8, 3)})
    made = TABLES["table1_certified"](df)
    assert made.parts[0][0] == "_digits"
    t, caption = one(made)
    assert t.columns.tolist() == ["method", "certificate", "A: certified", "A: s/image", "B: certified",
                                  "B: s/image"]
    # the references first, then the registry's bounds, CROWN, α-CROWN, the cascade
    assert t["method"].tolist() == ["clean accuracy", "PGD robust accuracy",
                                    *(name_of(b) for b in ("naive", "crown", "alpha_crown", "cascade"))]
    assert to_markdown(t).count("\n") == 8 and "\\begin{tabular}" in to_latex(t, caption)
    t = t.set_index("method")
    # no 0.02 in these rows: the ε of record is the median radius, of 0.01 and 0.1 the lower
    assert t.loc[name_of("crown"), ["A: certified", "B: certified"]].tolist() == ["0.800", "0.700"]
    assert t.loc[name_of("naive"), ["A: certified", "B: certified"]].tolist() == ["0.600", "0.500"]
    assert t.loc[name_of("naive"), ["A: s/image", "B: s/image"]].tolist() == ["0.015", "0.015"]
    assert t.loc["clean accuracy", ["A: certified", "A: s/image"]].tolist() == ["0.950", "–"]
    assert t.loc["PGD robust accuracy", "B: certified"] == "0.900"
    assert set(t["certificate"].iloc[2:]) == {"–"}  # these rows record no certificate
    assert "at ε = 0.01" in caption and "median" in caption and "The other ε (0.1)" in caption
    assert ("`A` = A (digits, 1 block × 2 heads; d=32, c=0.5, q=1, ε_t=0.003; test accuracy 0.900; "
            "10 images)") in caption
    assert "first 10 test images" in caption and "abcdef1234" in caption
    t, _ = one(TABLES["table1_certified"](rows({"zz_new": at(1, 1, 1, 1), "crown": at(2, 2, 2, 2)})))
    assert t["method"].tolist()[-2:] == [name_of("crown"), "zz_new"]  # unknown names last


def test_table1_is_at_0_02_where_the_rows_hold_it_and_names_another_eps_in_its_header():
    e3 = [0.01, 0.02, 0.1]
    df = rows({"lofast_M": dict(zip(itertools.product(ARCH, e3), (1, 2, 3, 4, 5, 6), strict=True))}, eps=e3)
    df = df[(df["model"] == "A") | (df["eps"] != 0.02)]  # B has no rows at 0.02: its median is 0.01
    t, caption = one(TABLES["table1_certified"](df))
    assert t.columns.tolist()[2:] == ["A: certified", "A: s/image", "B: certified at ε=0.01", "B: s/image"]
    assert t.set_index("method").loc[name_of("lofast_M")].tolist()[1:] == ["0.200", "0.015", "0.400", "0.015"]
    assert "at ε = 0.02 (ℓ2 over the image, pixels in [0, 1]), LoFAST's ε of record;" in caption
    assert "The other ε (0.01, 0.1)" in caption


def test_certificate_kinds_are_the_rows_strongest_first_with_p():
    df = rows({"naive": at(1, 1, 1, 1), "lofast_M": at(1, 1, 1, 1), "crown": at(1, 1, 1, 1)})
    kind = {"naive": "exact", "lofast_M": "deterministic", "crown": "relaxation"}
    df["certificate"] = df["bound"].map(kind)
    df["certificate_p"] = 0.0
    prob = (df["bound"] == "lofast_M") & (df["model"] == "B")
    df.loc[prob, "certificate"], df.loc[prob, "certificate_p"] = "probabilistic", 3.2e-9
    t, _ = one(TABLES["table1_certified"](df))
    kinds = dict(zip(t["method"], t["certificate"], strict=True))
    assert kinds[name_of("naive")] == "exact" and kinds[name_of("crown")] == "relaxation"
    assert kinds[name_of("lofast_M")] == "deterministic / probabilistic (p ≤ 3.2e-09)"
    assert kinds["PGD robust accuracy"].startswith("attack")


def test_short_labels_are_the_tokens_that_differ():
    names = ["digits-d32-b2-h2-c0.5", "digits-d32-b2-h2-c0.5-q1-m0.003", "digits-d32-b3-h2-c0.5-q1-m0.003",
             "digits-d32-b2-h2-c0.5-q2"]
    assert list(ct.short_labels(names).values()) == ["b2", "b2-q1-m0.003", "b3-q1-m0.003", "b2-q2"]
    assert ct.short_labels(["x-a-b", "x-b-a"]) == {"x-a-b": "x-a-b", "x-b-a": "x-b-a"}  # alike: whole names
    assert ct.short_labels(["solo"]) == {"solo": "solo"}


def many(k: int, fashion: int = 0) -> pd.DataFrame:
    """k copies of the rows of A and B under other model names, the last ``fashion`` copies a second
    dataset's."""
    base = rows({"naive": at(6, 2, 5, 1), "crown": at(8, 4, 7, 3)})
    return pd.concat([base.assign(model=base["model"] + f"-m{i}",
                                  dataset="fashion" if i >= k - fashion else "digits") for i in range(k)],
                     ignore_index=True)


def test_table1_splits_many_models_into_parts_of_at_most_14_columns():
    df = many(8, fashion=1)  # 14 digits models, 2 fashion-MNIST ones
    made = TABLES["table1_certified"](df)
    assert [p[0] for p in made.parts] == ["_digits", "_digits_2", "_digits_3", "_fashion"]
    assert [len(t.columns) for _, t, _ in made.parts] == [12, 12, 10, 6]  # 5 + 5 + 4 models, 2
    shown = [c.split(":")[0] for _, t, _ in made.parts[:3] for c in t.columns[2::2]]
    assert sorted(shown) == sorted(df.loc[df["dataset"] == "digits", "model"].unique())  # each once
    # labels are per dataset: the fashion models share the token m7, so A and B tell them apart
    assert made.parts[3][1].columns.tolist()[2::2] == ["A: certified", "B: certified"]
    assert "`A` = A-m7 (fashion, 1 block" in made.parts[3][2]
    assert "on digits, part 2 of 3:" in made.parts[1][2] and "on fashion:" in made.parts[3][2]
    crown = made.parts[3][1].set_index("method").loc[name_of("crown")]
    assert crown.tolist()[1:] == ["0.800", "0.015", "0.700", "0.015"]


def recount(df: pd.DataFrame) -> pd.DataFrame:
    """Per (model, ε, bound): images certified (pairwise verdicts, an image once) and images."""
    cert = df[df["role"] == "certify"].drop_duplicates(["model", "eps", "bound", "sample"])
    return cert.groupby(["model", "eps", "bound"])["certified_pairwise"].agg(["sum", "size"])


def test_the_full_csv_holds_every_model_eps_and_method_with_the_same_numbers():
    df = load(BASELINE)
    made = TABLES["table1_certified"](df)
    full = made.full.set_index(["model", "eps", "method"])
    want = recount(df)
    got = full[~full.index.get_level_values("method").isin(["clean", "pgd_margin"])]
    assert len(got) == len(want)
    for (model, e, bound), (k, n) in want.iterrows():
        r = got.loc[(model, f"{e:g}", bound)]
        assert (int(r["k"]), int(r["n"])) == (k, n)
        assert float(r["certified_accuracy"]) == pytest.approx(k / n, abs=1e-6)
        assert (float(r["wilson_lo"]), float(r["wilson_hi"])) == pytest.approx(wilson(k, n), abs=1e-6)
    sweeps = df.loc[df["role"] == "certify", "sweep"].unique()
    acc = df[(df["role"] == "accuracy") & df["sweep"].isin(sweeps)]
    assert len(full) - len(got) == len(acc.drop_duplicates(["model", "eps", "bound"]))
    # the same text whatever the rows' order; sorted by dataset, model, ε
    assert made.full.equals(TABLES["table1_certified"](df.sample(frac=1, random_state=0)).full)
    keys = list(zip(made.full["model"], made.full["eps"].astype(float), strict=True))
    assert keys == sorted(keys)


def test_every_table1_and_table2_part_of_the_baseline_fits_14_columns_and_recounts_the_rows():
    df = load(BASELINE)
    want = recount(df)
    models = list(df.loc[df["role"] == "certify", "model"].unique())
    code = {name_of(b): b for b in want.index.get_level_values("bound")}
    checked = 0
    for stem in ("table1_certified", "table2_cascade"):
        for _, t, caption in TABLES[stem](df).parts:
            assert len(t.columns) <= 14, stem
            # each table's short labels are those of its own models, spelled out in its caption
            by_label = dict(re.findall(r"`([^`]+)` = (\S+) \(", caption))
            assert set(by_label.values()) <= set(models)
            for col in t.columns[2::2]:
                label, _, other = col.partition(": certified")
                model, e = by_label[label], float(other.split("=")[1]) if other else 0.02
                for method, cell in zip(t["method"], t[col], strict=True):
                    b = code.get(method.removesuffix(" alone"))
                    if b is None or (model, e, b) not in want.index:
                        assert b is not None or method in ("clean accuracy", "PGD robust accuracy")
                        continue
                    k, n = want.loc[(model, e, b)]
                    assert float(cell.split(" ")[0]) == pytest.approx(k / n, abs=5e-4), (stem, col, method)
                    checked += 1
            assert "commit" in caption and "full CSV" in caption
    # every count at a shown (model, ε) is in a cell: Table 1 every bound, Table 2 CROWN and the cascades
    radii = {m: sorted(set(want.loc[m].index.get_level_values("eps"))) for m in models}
    firsts = {(m, 0.02 if 0.02 in r else r[(len(r) - 1) // 2]) for m, r in radii.items()}
    crownish = want.index.get_level_values("bound").str.contains("crown")
    assert checked == sum(int(k in firsts) * (1 + c) for k, c in zip(want.index.droplevel("bound"), crownish,
                                                                          strict=True))


def test_table2_exists_iff_cascade_rows_do():
    plain = rows({"naive": at(6, 2, 5, 1), "crown": at(8, 4, 7, 3)})
    with pytest.raises(Skip, match="cascade"):
        TABLES["table2_cascade"](plain)
    cascade = rows({"cascade": at(8, 4, 7, 4)}, sweep="cascade", sent={"cascade": 4})
    made = TABLES["table2_cascade"](pd.concat([plain, cascade], ignore_index=True))
    t, caption = one(made)
    crown, cas = name_of("crown"), name_of("cascade")
    assert t["method"].tolist() == [f"{crown} alone", cas]
    assert t.columns.tolist() == ["method", "certificate", "A: certified", "A: s/image", "B: certified",
                                  "B: s/image"]
    assert t["A: certified"].tolist() == ["0.800", "0.800 (40% sent)"]
    assert t["B: certified"].tolist() == ["0.700", "0.700 (40% sent)"]
    assert r"cascade (suite $\to$ CROWN) & -- & 0.800 (40\% sent)" in to_latex(t, caption)  # LaTeX's arrow
    assert "CROWN alone" in caption and "`certify`, `cascade`" in caption and "sent on to CROWN" in caption
    assert set(made.full["method"]) == {"crown", "cascade"} and len(made.full) == len(ARCH) * len(EPS) * 2


def test_a_cascade_without_its_share_or_crown_says_so():
    t, _ = one(TABLES["table2_cascade"](rows({"naive": at(1, 1, 1, 1), "cascade_crown": at(2, 2, 2, 2)})))
    t = t.set_index("method")
    assert t.loc[f"{name_of('crown')} alone", ["A: certified", "B: s/image"]].tolist() == ["–", "–"]
    assert t.loc[name_of("cascade_crown"), "A: certified"] == "0.200"  # no share recorded: none shown
    plot = FIGURES["fig2_certified_accuracy"](rows({"cascade_crown": at(2, 2, 2, 2)}))
    assert plot.panels[0].traces[0].label == name_of("cascade_crown") != "cascade_crown"
    assert name_of("some_new_bound") == "some_new_bound"  # the fallback: its code name


def test_fig2_on_the_baseline_recounts_the_pairwise_verdicts():
    df = load(BASELINE)
    # the `certify` sweep's models alone (others, e.g. certify_disagree, add panels of their own)
    df = df[~df["role"].isin(["certify", "accuracy"]) | (df["sweep"] == "certify")]
    cert = df[(df["sweep"] == "certify") & (df["role"] == "certify")]
    plot = rc.figure(df)
    assert len(plot.panels) == cert["model"].nunique()
    # a merged curve's label may drop its lead's "(this suite)" tag to fit one line (its caption and
    # ``also`` keep every full name)
    bare = lambda name: name.removesuffix(" (this suite)")
    names = {n: bare(name_of(n)) for n in cert["bound"].unique()}
    for p in plot.panels:  # every bound on every panel, once, merged or not
        labels = [bare(n) for t in p.traces[:-1] for n in (t.label.split(" (+")[0], *t.also)]
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
    return ct.disagreements(counts(df), df.drop_duplicates("model").set_index("model")["vit_margin_eps"])


def test_table1_names_the_models_where_the_bounds_disagree():
    # A: CROWN certifies 1 image of 10 more than LoFAST at ε = 0.01 (10 points); B: within 0 points
    df = rows({"lofast_M": at(5, 0, 3, 1), "best": at(5, 0, 3, 1), "crown": at(6, 0, 3, 1)})
    text = caption(df)
    assert text.startswith(f" Of {name_of('lofast_M')}, {name_of('best')} and CROWN, the certified "
                           "accuracies differ by ≥ 5% of the images on `A` (CROWN 0.60 vs ")
    # B: CROWN ties LoFAST there, which margin training does not explain (CROWN is no norm product)
    assert "at ε=0.01)" in text and "CROWN agree within 5% on `B`: measured so." in text
    assert text in one(ct.table1(df))[1]
    # where only the norm route's best ties LoFAST, margin training is the reason given
    norm = rows({"lofast_M": at(5, 0, 3, 1), "best": at(5, 0, 3, 1)})
    assert caption(norm) == (f" {name_of('lofast_M')} and {name_of('best')} agree within 5% on `A`, "
                             "`B`: margin training (ε_t > 0) drives the attention logits toward 0, so "
                             "attention is nearly linear on the data and the bounds reduce to about "
                             "the same Lipschitz product (docs/bounds.md §5).")
    # nothing certified anywhere is said as such, and a model without margin training is not
    # explained by it
    none = rows({"lofast_M": at(0, 0, 0, 0), "best": at(0, 0, 0, 0)}).assign(vit_margin_eps=0.0)
    assert caption(none) == (f" {name_of('lofast_M')} and {name_of('best')} agree within 5% on `A`, `B`: "
                             "none of them certifies an image at these ε.")
    assert caption(rows({"naive": at(1, 1, 1, 1)})) == ""  # no LoFAST (‖M‖) to rank against


def test_table1_ranks_taylor_net_and_never_explains_its_tie_by_margin_training():
    # taylor_net certifies 3 images of 10 more than LoFAST (‖M‖) on A at ε = 0.01: 30 points, where the
    # norm route's best ties; on B it ties too, which is measured, not margin training's doing
    df = rows({"lofast_M": at(5, 0, 3, 1), "best": at(5, 0, 3, 1), "taylor_net": at(8, 0, 3, 1)})
    text = caption(df)
    assert f"`A` ({name_of('taylor_net')} 0.80 vs {name_of('lofast_M')} 0.50 at ε=0.01)" in text
    assert text.endswith(f"{name_of('taylor_net')} agree within 5% on `B`: measured so.")
    assert "margin training" not in text


def test_an_accuracy_over_fewer_images_says_how_many():
    """CROWN over the first 5 images where naive has 10: Table 1 writes "(of 5)" after CROWN's
    accuracy, and nothing after naive's; Table 2, whose methods all have 5, writes none."""
    many = rows({"naive": at(6, 2, 5, 1)})
    few = rows({"crown": at(4, 2, 3, 1), "cascade": at(4, 2, 3, 1)}, sent={"cascade": 2}, n=5)
    df = pd.concat([many, few[few["role"] == "certify"]], ignore_index=True)
    t = one(TABLES["table1_certified"](df))[0].set_index("method")
    got = t.loc[name_of("crown"), ["A: certified", "B: certified"]].tolist()
    assert got == ["0.800 (of 5)", "0.600 (of 5)"]
    assert t.loc[name_of("naive"), ["A: certified", "B: certified"]].tolist() == ["0.600", "0.500"]
    t2 = one(TABLES["table2_cascade"](df))[0].set_index("method")
    assert not t2.apply(lambda col: col.astype(str).str.contains("of 5")).any().any()


def test_a_merged_curve_too_long_for_one_line_takes_its_shortest_name():
    """Equal curves are drawn once under the first bound's name and "(+k equal)"; where that runs past
    one legend line the shortest name leads, and where even that does, without its "(this suite)"
    tag: the baseline's 2-block margin model, where taylor_net's three other splits tie."""
    from bench.report.studies.certify_study import LEGEND_CHARS, group_label, group_lead

    group = ["taylor_net_lofast", "taylor_net_lofast_half", "taylor_net_best"]
    assert len(name_of(group[0]) + " (+2 equal)") > LEGEND_CHARS
    led = group_lead(group)
    assert led[0] == "taylor_net_best" and sorted(led) == sorted(group)
    assert group_label(led) == "taylor_net, best split (+2 equal)"
    assert group_label(["naive", "lofast_M"]) == f"{name_of('naive')} (+1 equal)"  # fits: unchanged
    assert group_lead(["naive", "lofast_M"]) == ["naive", "lofast_M"]


def test_two_models_of_one_shape_and_recipe_are_told_apart_by_name():
    """A LayerNorm and a BatchNorm ViT share every architecture column: their panels name the models."""
    df = rows({"taylor_net": at(3, 1, 3, 1)})
    same = df.assign(vit_depth=2, vit_heads=2)
    same["model"] = same["model"].map({"A": "digits-d32-b2-h2-vanilla", "B": "digits-d32-b2-h2-standard-bn"})
    titles = [p.title for p in rc.figure(same).panels]
    assert sorted(t.splitlines()[-1] for t in titles) == ["standard-bn", "vanilla"]
    assert all(len(p.title.splitlines()) == 2 for p in rc.figure(df).panels)  # told apart by shape

"""LoFAST's Tables 1 and 2 (docs/bounds.md §5) in the paper's layout: per dataset, one row per method
with its certificate kind, and per model two columns, the certified accuracy at the ε of record and
the seconds per image there; at most :data:`MOST` columns to a table, a dataset's models split over
several parts when they need more. Every other ε is in Fig. 2 and in the long table beside the parts
(:func:`full`, written as ``<stem>_full.csv``). Every number is recounted from the stored rows
(:func:`bench.report.studies.trained_study.counts`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable

import pandas as pd

from ..panels import Parts, Skip, certificates
from . import trained_study as tr
from .certify_study import arch, origin
from .trained_study import CASCADE, LEVEL, counts, eg, name_of, network, short_labels

RECORD = 0.02  # LoFAST's ε of record; a dataset whose rows lack it is shown at its median ε
MOST = 14  # columns of one table at most: what a Markdown page or a LaTeX page shows legibly
FIXED = ("method", "certificate")
PER_PART = (MOST - len(FIXED)) // 2  # models of one table: each takes two columns
DISAGREE = 0.05  # a difference in certified accuracy that ranks two bounds (LoFAST Table 1's models)
# the caption ranks these against LoFAST (‖M‖): the norm route's best and the network certificates
BASE, RIVALS = "lofast_M", ("best", "crown", "alpha_crown", "taylor_net")
NORM_ROUTE = {"best"}  # rivals that, like BASE, propagate a norm: margin training makes them tie
# the reference rows: code name in the rows, the method's name and what it is instead of a certificate
REFERENCES = {"clean": ("clean accuracy", "reference: unperturbed images"),
              "pgd_margin": ("PGD robust accuracy", "attack: an upper bound")}
FULL = ["dataset", "model", "method", "label", "certificate", "eps", "k", "n", "certified_accuracy",
        "wilson_lo", "wilson_hi", "s_per_image", "sent_share"]

Cell = Callable[[str, float], tuple[str, str]]  # (model, ε) → (certified accuracy, s/image) as text


def num(v: float, digits: int = 3) -> str:
    return "–" if v is None or math.isnan(v) else f"{v:.{digits}f}"


def secs(v: float) -> str:
    return "–" if v is None or math.isnan(v) else f"{v:.3g}"


def record(eps: Iterable[float]) -> float:
    """The ε of record of a set of radii: :data:`RECORD` where present, else their median (the lower
    middle one of an even count, so it is a radius the rows hold)."""
    vals = sorted({float(e) for e in eps})
    near = [e for e in vals if math.isclose(e, RECORD)]
    return near[0] if near else vals[(len(vals) - 1) // 2]


def chunks(models: list[str], most: int = PER_PART) -> list[list[str]]:
    """The models in parts of at most ``most``, as even as can be (7: 4 + 3, not 6 + 1)."""
    parts = -(-len(models) // most)
    size = -(-len(models) // parts) if parts else 0
    return [models[i:i + size] for i in range(0, len(models), size)] if size else []


def suffix(dataset: str, i: int) -> str:
    """The stem suffix of a dataset's i-th part: ``_digits``, ``_digits_2``, …"""
    safe = re.sub(r"[^A-Za-z0-9]+", "-", str(dataset)).strip("-") or "data"
    return f"_{safe}" + (f"_{i + 1}" if i else "")


def _unique(names: list[str]) -> dict[str, str]:
    """Display names, each once (a repeated label gets its code name)."""
    seen = [name_of(b) for b in names]
    return {b: s if seen.count(s) == 1 else f"{s} [{b}]" for b, s in zip(names, seen, strict=True)}


def _refs(df: pd.DataFrame) -> pd.DataFrame:
    """Per (model, ε): clean and PGD robust accuracy (:func:`~trained_study.references`) and the
    number of images they are over; empty where the rows hold no accuracy rows."""
    try:
        ref = tr.references(df)
    except Skip:
        return pd.DataFrame({"clean": [], "pgd": [], "n": []},
                            index=pd.MultiIndex.from_tuples([], names=["model", "eps"]))
    acc = network(df)
    acc = acc[acc["role"] == "accuracy"]
    return ref.assign(n=acc.groupby(["model", "eps"])["samples"].max())


class _Data:
    """What the tables of one results table are chosen from: the network rows, their counts, the
    references, the models in report order, each bound's certificate kinds."""

    def __init__(self, df: pd.DataFrame) -> None:
        self.sub, self.c, self.ref = network(df), counts(df), _refs(df)
        self.models = tr.model_order(self.sub)
        self.cert = self.sub[self.sub["role"] == "certify"]

    def eps_of(self, model: str, bounds: list[str]) -> list[float]:
        at = self.c.xs(model, level="model")
        return sorted({e for e, b in at.index if b in bounds})

    def kind(self, bound: str, models: list[str]) -> str:
        rows = self.cert[(self.cert["bound"] == bound) & self.cert["model"].isin(models)]
        return certificates(rows)

    def datasets(self, bounds: Callable[[list[str]], list[str]]) -> list[tuple[str, list[str], list[str]]]:
        """Per dataset (by name): its models that have rows of the bounds ``bounds`` picks from the
        dataset's bounds, in report order, and those bounds; datasets without any left out."""
        have = self.c.index.get_level_values("model")
        out = []
        for dataset in sorted(set(self.models["dataset"])):
            ms = [m for m in self.models.index if self.models.loc[m, "dataset"] == dataset and m in have]
            present = tr.order(self.c[self.c.index.get_level_values("model").isin(ms)]
                               .index.get_level_values("bound"))
            picked = bounds(present)
            ms = [m for m in ms if self.eps_of(m, picked)]
            if ms and picked:
                out.append((dataset, ms, picked))
        return out

    def images(self, model: str, e: float, bounds: list[str]) -> str:
        """How many images a model's counts at ε are over; the methods over fewer named."""
        n = {b: int(self.c.loc[(model, e, b), "n"]) for b in bounds if (model, e, b) in self.c.index}
        top = max(n.values())
        fewer = [f"{name_of(b)} {k}" for b, k in n.items() if k < top]
        return f"{top} images" + (f" ({', '.join(fewer)})" if fewer else "")


def _at(d: _Data, ms: list[str], bounds: list[str]) -> tuple[float, dict[str, float]]:
    """The dataset's ε of record, and each model's: the dataset's where its rows hold it, else its
    own (:func:`record` of its radii)."""
    e = record(x for m in ms for x in d.eps_of(m, bounds))
    return e, {m: e if e in d.eps_of(m, bounds) else record(d.eps_of(m, bounds)) for m in ms}


def _table(methods: list[tuple[str, str, Cell]], ms: list[str], at: dict[str, float], e: float,
           labels: dict[str, str]) -> pd.DataFrame:
    rows = []
    for name, kind, cell in methods:
        row = {"method": name, "certificate": kind}
        for m in ms:
            acc, s = cell(m, at[m])
            row[f"{labels[m]}: certified" + ("" if at[m] == e else f" at ε={eg(at[m])}")] = acc
            row[f"{labels[m]}: s/image"] = s
        rows.append(row)
    return pd.DataFrame(rows)


def _count_cell(c: pd.DataFrame, bound: str, among: list[str], sent: bool = False) -> Cell:
    """A bound's certified accuracy and s/image; "(of k)" after an accuracy over fewer images than
    another of the table's bounds ``among`` at that model and ε (CROWN on the first 30 where the rest
    have 100), so that a reader does not rank two accuracies over different images."""
    def cell(model: str, e: float) -> tuple[str, str]:
        key = (model, e, bound)
        if key not in c.index:
            return "–", "–"
        r = c.loc[key]
        share = f" ({r['sent']:.0%} sent)" if sent and not math.isnan(r["sent"]) else ""
        most = max(c.loc[(model, e, b), "n"] for b in among if (model, e, b) in c.index)
        fewer = f" (of {int(r['n'])})" if r["n"] < most else ""
        return num(r["accuracy"]) + fewer + share, secs(r["seconds"])
    return cell


def _ref_cell(ref: pd.DataFrame, col: str) -> Cell:
    def cell(model: str, e: float) -> tuple[str, str]:
        return (num(ref.loc[(model, e), col]) if (model, e) in ref.index else "–"), "–"
    return cell


def _where(d: _Data, dataset: str, ms: list[str], at: dict[str, float], e: float, bounds: list[str],
           labels: dict[str, str]) -> str:
    """The caption's sentences on the ε shown and on the models' labels."""
    every = sorted({x for m in ms for x in d.eps_of(m, bounds)})
    if math.isclose(e, RECORD):
        text = f"at ε = {eg(e)} (ℓ2 over the image, pixels in [0, 1]), LoFAST's ε of record"
    else:
        text = (f"at ε = {eg(e)} (ℓ2 over the image, pixels in [0, 1]), the median of the radii certified "
                f"on {dataset}, whose rows lack LoFAST's ε of record {eg(RECORD)}")
    other = [m for m in ms if at[m] != e]
    if other:
        text += (f"; a header naming another ε: the model has no rows at ε = {eg(e)}, and is shown at "
                 f"its own ({eg(RECORD)} where it has it, else its median radius)")
    models = []
    for m in ms:
        row = d.models.loc[m]
        test = row["vit_test_accuracy"]
        test = f"; test accuracy {test:.3f}" if isinstance(test, float) and math.isfinite(test) else ""
        models.append(f"`{labels[m]}` = {m} ({'; '.join(arch(row))}{test}; "
                      f"{d.images(m, at[m], bounds)})")
    rest = [x for x in every if x != e]
    return (f"{text}. Models: {'; '.join(models)}. "
            + (f"The other ε ({', '.join(map(eg, rest))}) are" if rest else "Every ε is")
            + f" in Fig. 2 (`fig2_certified_accuracy`) and in the full CSV beside this table (per model, "
              f"ε and method: k of n images certified, the accuracy and its {LEVEL:.0%} Wilson interval, "
              f"s/image, the share a cascade sent on).")


def _parts(d: _Data, pick: Callable[[list[str]], list[str]],
           methods: Callable[[list[str], list[str]], list[tuple[str, str, Cell]]],
           caption: Callable[[str, str, list[str], list[str]], str]) -> tuple:
    out = []
    for dataset, all_models, bounds in d.datasets(pick):
        labels = short_labels(all_models)
        e, at = _at(d, all_models, bounds)
        groups = chunks(all_models)
        for i, ms in enumerate(groups):
            part = f", part {i + 1} of {len(groups)}" if len(groups) > 1 else ""
            t = _table(methods(ms, bounds), ms, at, e, labels)
            text = caption(f"on {dataset}{part}", _where(d, dataset, ms, at, e, bounds, labels), ms, bounds)
            out.append((suffix(dataset, i), t, text))
    return tuple(out)


def table1(df: pd.DataFrame) -> Parts:
    """LoFAST Table 1, per dataset: clean and PGD robust accuracy, then every bound present (registry
    order), each with its certificate; per model its certified accuracy at the ε of record and its
    seconds per image there."""
    d = _Data(df)

    def methods(ms: list[str], bounds: list[str]) -> list[tuple[str, str, Cell]]:
        names = _unique(bounds)
        refs = [(text, what, _ref_cell(d.ref, col))
                for col, (text, what) in zip(("clean", "pgd"), REFERENCES.values(), strict=True)]
        return refs + [(names[b], d.kind(b, ms), _count_cell(d.c, b, bounds)) for b in bounds]

    def caption(head: str, where: str, ms: list[str], bounds: list[str]) -> str:
        c = d.c[d.c.index.get_level_values("model").isin(ms)]
        sub = d.sub[d.sub["model"].isin(ms)]
        return (f"LoFAST Table 1 (docs/bounds.md §5), {head}: one row per method, first the references "
                f"(clean accuracy; PGD robust accuracy, an attack: an upper bound of the true robust "
                f"accuracy) over the same images, then every bound in registry order, with its "
                f"certificate (how its value is known, docs/bounds.md §2.4: exact, deterministic, "
                f"relaxation, probabilistic with its failure probability p); per model the certified "
                f"accuracy (the pairwise-head test) and the seconds per image, its certificate included, "
                f"{where}{disagreements(c, d.models['vit_margin_eps'])} {origin(sub, c)}.")

    return Parts(_parts(d, lambda present: present, methods, caption), full(df))


def _alone(cascade: str, present: set[str]) -> str:
    """The bound a cascade ends in, run alone: ``cascade_<bound>``'s bound, else CROWN."""
    tail = cascade[len(CASCADE):].lstrip("_")
    return tail if tail in present else "crown"


def _cascades(present: list[str]) -> list[str]:
    """A dataset's Table 2 methods: the bound each cascade ends in, alone, then every cascade."""
    cascades = [b for b in present if b.startswith(CASCADE)]
    ends = dict.fromkeys(_alone(b, set(present)) for b in cascades)
    return [*ends, *cascades] if cascades else []


def table2(df: pd.DataFrame) -> Parts:
    """Table 2, per dataset: CROWN alone (the bound each cascade ends in) and every cascade, each with
    its certificate; per model the certified accuracy at the ε of record, with the share of the
    images a cascade sent on, and the seconds per image."""
    d = _Data(df)
    if not any(b.startswith(CASCADE) for b in d.c.index.get_level_values("bound")):
        raise Skip("no cascade rows (a bound named `cascade…`) in the network certification rows")

    def methods(ms: list[str], bounds: list[str]) -> list[tuple[str, str, Cell]]:
        return [(name_of(b) + ("" if b.startswith(CASCADE) else " alone"), d.kind(b, ms),
                 _count_cell(d.c, b, bounds, sent=True)) for b in bounds]

    def caption(head: str, where: str, ms: list[str], bounds: list[str]) -> str:
        c, sub = d.c[d.c.index.get_level_values("model").isin(ms)], d.sub[d.sub["model"].isin(ms)]
        return (f"Table 2 (docs/bounds.md §5), {head}: CROWN alone against each cascade (the suite's bound "
                f"named first, then CROWN only on the images it leaves), one row each with its "
                f"certificate; per model the certified accuracy (the pairwise-head test) with, in "
                f"brackets, the share of the images the cascade sent on to CROWN (none where its rows do "
                f"not record it), and the seconds per image, {where} {origin(sub, c)}.")

    parts = _parts(d, _cascades, methods, caption)
    keep = {b for _, _, bounds in d.datasets(_cascades) for b in bounds}
    f = full(df)
    return Parts(parts, f[f["method"].isin(keep)].reset_index(drop=True))


def full(df: pd.DataFrame) -> pd.DataFrame:
    """Every (model, ε, method) of the network rows, one per row, as text: the references (clean and
    PGD robust accuracy over their images, no k or interval) and each bound's k of n images certified,
    certified accuracy, its Wilson interval, seconds per image and, for a cascade whose rows record it,
    the share of images sent on; sorted by dataset, model, ε and method (references first, then
    registry order), so the file depends on the data alone."""
    d = _Data(df)
    dataset = d.models["dataset"]
    kinds = {key: certificates(g) for key, g in d.cert.groupby(["model", "eps", "bound"])}
    rank = {b: i for i, b in enumerate([*REFERENCES, *tr.order(d.c.index.get_level_values("bound"))])}
    rows = []
    for (m, e), r in d.ref.iterrows():
        for col, (code, (text, what)) in zip(("clean", "pgd"), REFERENCES.items(), strict=True):
            if not math.isnan(r[col]):
                rows.append((dataset[m], m, code, text, what, e, "", int(r["n"]), f"{r[col]:.6f}", "", "",
                             "", ""))
    for (m, e, b), r in d.c.iterrows():
        sent = "" if math.isnan(r["sent"]) else f"{r['sent']:.6f}"
        rows.append((dataset[m], m, b, name_of(b), kinds.get((m, e, b), "–"), e, str(int(r["k"])),
                     int(r["n"]), f"{r['accuracy']:.6f}", f"{r['lo']:.6f}", f"{r['hi']:.6f}",
                     f"{r['seconds']:.6g}", sent))
    out = pd.DataFrame(rows, columns=FULL)
    out = out.assign(_rank=out["method"].map(rank)).sort_values(["dataset", "model", "eps", "_rank"])
    return out.drop(columns="_rank").assign(eps=lambda t: t["eps"].map(eg),
                                            n=lambda t: t["n"].astype(str)).reset_index(drop=True)


def _listed(names: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def disagreements(c: pd.DataFrame, margin: pd.Series, gap: float = DISAGREE) -> str:
    """The caption's word on where the bounds rank: per model, the largest difference in certified
    accuracy between LoFAST (‖M‖) and each of :data:`RIVALS` present at one ε where either certifies
    something, the models where it reaches ``gap`` named with it, the others said to tie, naming the
    methods compared (docs/bounds.md §5). Margin training explains a tie of norm-route bounds only: a
    network certificate tying LoFAST is said to be measured so.
    ``c``: :func:`~bench.report.studies.trained_study.counts`; ``margin``: each model's training
    radius ε_t."""
    present = set(c.index.get_level_values("bound"))
    rivals = [b for b in RIVALS if b in present]
    if BASE not in present or not rivals:
        return ""
    acc = c["accuracy"].unstack("bound")
    found, tie = [], []
    for model, at in acc.groupby(level="model"):
        best_gap, where = 0.0, ""
        for (_, e), r in at.iterrows():
            for b in rivals:
                d = abs(r[b] - r[BASE]) if pd.notna(r[b]) and pd.notna(r[BASE]) else 0.0
                if d > best_gap + 1e-12:
                    where = f"{name_of(b)} {r[b]:.2f} vs {name_of(BASE)} {r[BASE]:.2f} at ε={eg(e)}"
                    best_gap = d
        if best_gap >= gap - 1e-12:
            found.append(f"`{model}` ({where})")
        else:
            ran = [b for b in rivals if at[b].notna().any()]  # the rivals run on this model
            if not ran:
                continue
            none = not (at[[BASE, *ran]].fillna(0) > 0).to_numpy().any()
            reason = ("none" if none else "margin" if set(ran) <= NORM_ROUTE and margin.get(model, 0) > 0
                      else "other")
            tie.append((model, reason, _listed([name_of(b) for b in (BASE, *ran)])))
    out = ""
    if found:
        compared = _listed([name_of(b) for b in (BASE, *rivals)])
        out += (f" Of {compared}, the certified accuracies differ by ≥ {gap:.0%} of the images on "
                + "; ".join(found) + ".")
    why = {"margin": "margin training (ε_t > 0) drives the attention logits toward 0, so attention is "
                     "nearly linear on the data and the bounds reduce to about the same Lipschitz "
                     "product (docs/bounds.md §5)",
           "none": "none of them certifies an image at these ε", "other": "measured so"}
    for reason, text in why.items():
        for compared in dict.fromkeys(names for _, r, names in tie if r == reason):
            models = [f"`{m}`" for m, r, names in tie if r == reason and names == compared]
            out += f" {compared} agree within {gap:.0%} on {', '.join(models)}: {text}."
    return out

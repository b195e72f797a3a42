"""A user's own models. The imported layers (task ``imported``, docs/guide/import.md): per attention layer
of a user's model, as ``python -m bench import`` wrote it, and per ε, each end-to-end bound's value ÷ PGD
beside σ_max(J)·ε ÷ PGD (the ``jacobian`` estimate), as a figure (:func:`figure`) and a table
(:func:`table`); rows of task ``imported`` whatever their sweep's name, means over the captured inputs of
a (directory, layer, ε). And whole networks from files (tasks ``certify_file``, ``certify_file_crown``,
docs/guide/certify.md): per network and ε, each bound's certified accuracy (:func:`network_table`),
recounted by :func:`bench.report.studies.trained_study.counts`; the zoo models' Fig. 2 and Tables 1–2
do not take these rows, whose models have no card.
"""

from __future__ import annotations

from pathlib import PurePath

import pandas as pd

from ...core.schema import FILE_TASKS
from ..panels import Panel, Plot, Skip, bound_trace, certificates, commits, label, letter
from . import trained_study as tr
from .trained_study import eg, name_of

# as the pretrained study: LoFAST's two, their halves, ours, the minimum, naive, and the estimate
NAMES = ["lofast_M", "lofast_xi", "lofast_M_half", "lofast_xi_half", "taylor", "best", "naive",
         "castin", "yudin", "jacobian"]
CAP = 1e4  # as the other tightness figures: a ratio above is drawn off scale, with its number
EPS = "ε (× median‖x_i‖)"
WHY = ("ε is relative, as task `pretrained`'s: the radius is the cell's eps × the median token norm "
       "‖x_i‖ of each input (column `radius`), since a model's layers see inputs of unrelated scales "
       "(a LayerNorm's output, a residual stream that grows with depth)")


def _rows(df: pd.DataFrame) -> pd.DataFrame:
    if "task" not in df.columns or "imported" not in df.columns or not (df["task"] == "imported").any():
        raise Skip("no rows of task `imported`", listed=False)  # the user's own models: none is no gap
    sub = df[df["task"] == "imported"]
    return sub


def _ends(sub: pd.DataFrame) -> pd.DataFrame:
    ends = sub[(sub["role"] == "bound") & (sub["objective"] == "output") & (sub["head"] == -1)
               & sub["bound"].isin(NAMES)]
    if ends.empty:
        raise Skip("no end-to-end bound rows of task `imported`")
    return ends


def _name(directory: str) -> str:
    return PurePath(str(directory)).name or str(directory)


def _models(sub: pd.DataFrame) -> str:
    """Each directory with its model's sha256 (first 12 digits), layers and inputs."""
    parts = []
    for directory, g in sub.groupby("imported", sort=True):
        shas = "/".join(sorted({str(s)[:12] for s in g["imported_sha256"]}))
        layers = g["imported_layer"].nunique()
        inputs = g["imported_input"].nunique()
        parts.append(f"{directory} (model sha256 {shas}…; {layers} layer{'s' if layers != 1 else ''}, "
                     f"{inputs} input{'s' if inputs != 1 else ''})")
    return "; ".join(parts)


def _setting(sub: pd.DataFrame) -> str:
    return (f"the attention layers of a user's model as `python -m bench import` read them, each with its "
            f"biases, residual (H = I, docs/bounds.md §1.5) where the block adds the attention's own "
            f"input X, else bare, at the inputs it captured: {_models(sub)}; {WHY}")


def figure(df: pd.DataFrame) -> Plot:
    sub = _rows(df)
    ends = _ends(sub)
    rows, count = [], 0
    for directory, of_dir in ends.groupby("imported", sort=True):  # a row per model, a column per ε
        row = []
        for eps, at in of_dir.groupby("eps", sort=True):
            traces = [t for t in (bound_trace(at, "imported_layer", n, "ratio") for n in NAMES) if t]
            row.append(Panel(f"{letter(count)} {_name(directory)}, ε = {eps:g}", "imported layer k",
                             "bound / PGD" if not row else "", traces, ref=1.0, ceiling=CAP))
            count += 1
        rows.append(row)
    return Plot(rows,
                f"Imported attention (docs/guide/import.md), task `imported`: {_setting(sub)}. A row per "
                f"directory, a column per ε (× the median token norm), each end-to-end bound's value / "
                f"PGD lower bound of the output per layer (mean over the inputs; {label('jacobian')} = "
                f"σ_max(J)·ε is an estimate, dashed; dotted at 1; a ratio above {CAP:g} drawn as ▲ with "
                f"its value).",
                (7.0, 2.4 * len(rows) + 0.6), sharey=True)


def table(df: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """Rows directory × layer × ε: each bound's mean value/PGD over the inputs."""
    sub = _rows(df)
    ends = _ends(sub)
    keys = ["imported", "imported_layer", "eps"]
    piv = ends.pivot_table(index=keys, columns="bound", values="ratio", aggfunc="mean")
    names = [n for n in NAMES if n in piv.columns]
    first = ends.groupby(keys)[["imported_node", "residual", "n", "d", "h"]].first()
    inputs = ends.groupby(keys)["imported_input"].nunique()
    out = []
    for key, r in piv.iterrows():
        directory, layer, eps = key
        f = first.loc[key]
        row = {"model": _name(directory), "layer": str(int(layer)), "node": str(f["imported_node"]),
               "H": "I" if bool(f["residual"]) else "0",
               "n, d, h": f"{int(f['n'])}, {int(f['d'])}, {int(f['h'])}",
               EPS: f"{eps:g}", "inputs": str(int(inputs.loc[key]))}
        row.update({label(n): f"{float(r[n]):.4g}" if pd.notna(r[n]) else "–" for n in names})
        out.append(row)
    return pd.DataFrame(out), (
        f"Imported attention (docs/guide/import.md), task `imported`: {_setting(sub)}. Per layer and ε: "
        f"each end-to-end bound's value / PGD lower bound of the output (mean over the inputs; "
        f"{label('jacobian')} = σ_max(J)·ε is an estimate, the others certified); H = I: residual.")


NETWORK_EPS = "ε (ℓ2, image in [0, 1])"
# what makes two network cells the same network on the same images: their rows' model (the file's path)
# alone does not, since one path can be swept over data files and normalizations, or re-exported
FILE_KEY = ["model", "network_sha256", "dataset", "data_sha256", "input_mean", "input_std"]


def _keyed(df: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, str], dict[str, pd.Series]]:
    """(the network-file rows with ``model`` their whole :data:`FILE_KEY`, each key's label, each key's
    columns): the label is the path, with the data file, normalization and hash where one path has
    several keys."""
    rows = df[df["task"].isin(FILE_TASKS)] if "task" in df else df.iloc[0:0]
    missing = [c for c in FILE_KEY if c not in rows]
    if rows.empty or missing:  # the user's own files: a report without them says nothing of them
        raise Skip(f"no rows of a network file (task `certify_file`) with the columns {FILE_KEY}",
                   listed=False)
    key = rows[FILE_KEY].astype(str).agg(" | ".join, axis=1)
    first = rows.assign(key=key).drop_duplicates("key").set_index("key")
    paths = first["model"].value_counts()
    labels = {}
    for k, f in first.iterrows():
        labels[k] = str(f["model"]) if paths[f["model"]] == 1 else (
            f"{f['model']} (data {f['dataset']}, (x − {float(f['input_mean']):g})/{float(f['input_std']):g}, "
            f"sha256 {f['network_sha256']}…)")
    return rows.assign(model=key), labels, {k: f for k, f in first.iterrows()}


def _network_files(cols: dict[str, pd.Series]) -> str:
    """Each network with its sha256 (16 digits), its data file, normalization and recovery error."""
    return "; ".join(f"{f['model']} (sha256 {f['network_sha256']}…; data {f['dataset']}, sha256 "
                     f"{f['data_sha256']}…; (x − {float(f['input_mean']):g})/{float(f['input_std']):g}; "
                     f"logits within {float(f['max_rel_err']):.2g} of the runtime's)"
                     for f in cols.values())


def network_table(df: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """Rows network × ε: images, clean and PGD robust accuracy, and per bound its certified accuracy
    (s/image); a network is its file, data file and normalization (:data:`FILE_KEY`)."""
    keyed, labels, cols = _keyed(df)
    sub = tr.network(keyed, files=True)
    c, ref = tr.counts(keyed, files=True), tr.references(keyed, files=True)
    names = tr.order(c.index.get_level_values("bound"))
    out, above = [], []
    for (model, eps), r in ref.iterrows():
        row = {"network": labels[model], NETWORK_EPS: eg(eps)}
        held = (model, eps) in c.droplevel("bound").index
        at = c.xs((model, eps), level=("model", "eps")) if held else None
        row["images"] = str(int(at["n"].max())) if at is not None else "–"
        row["clean"], row["PGD robust"] = f"{r['clean']:.3f}", f"{r['pgd']:.3f}"
        for b in names:
            if at is None or b not in at.index:
                row[name_of(b)] = "–"
                continue
            k = at.loc[b]
            row[name_of(b)] = f"{k['accuracy']:.3f} ({k['seconds']:.3g} s)"
            if k["accuracy"] > r["pgd"] + 1e-12:
                above.append(f"{name_of(b)} on {labels[model]} at ε={eg(eps)}")
        out.append(row)
    cert = sub[sub["role"] == "certify"]
    kinds = "; ".join(f"{name_of(b)}: {certificates(cert[cert['bound'] == b])}" for b in names)
    said = ("; above it, a soundness violation or a finding (docs/bounds.md §6): " + ", ".join(above)
            if above else ", and none does")
    return pd.DataFrame(out), (
        f"Your own ViTs (docs/guide/certify.md, \"A network from a file\"), task(s) "
        f"{', '.join(f'`{t}`' for t in dict.fromkeys(sub['task']))}: each network recovered from its file as "
        f"a chain of the stages `taylor_net` knows and checked against the runtime's logits, on the first "
        f"images of its data file: {_network_files(cols)}. Per network and ε (the ℓ2 radius over the image "
        f"in [0, 1], before the model's normalization): the certified accuracy of each bound with its "
        f"seconds per image ({kinds}); PGD robust accuracy is an upper bound of every certified one"
        f"{said}. Sweep(s) {tr.sweeps(sub)}; commit {commits(sub)}.")

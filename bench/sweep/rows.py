"""The one place where results become rows of the long table (as asv's ``unroll_result``).

Every row names its ``role``, so no module parses names to know what a row is:

* ``bound``: a bound's value (certified or an estimate) with the PGD value of its own objective;
* ``pgd``: a PGD lower bound itself (``bound`` = ``pgd_<objective>``);
* ``timing``: a solver timed by the scaling task (``value`` is the norm it computed);
* ``block``: a per-block quantity of a stack or network (the Cauchy tasks), ``block`` = k;
* ``certify``: one bound certifying one test image of a trained network at the cell's ε
  (docs/bounds.md §5): ``value`` = δ_features, ``pgd`` = the feature change ‖φ(x + γ) − φ(x)‖ at
  the margin attack's worst γ (attained, so a lower bound of the true δ_features), and the columns
  of :data:`CERTIFY_COLUMNS`; ``violation`` also when a finding-free bound certifies a sample the
  attack breaks;
* ``block`` also holds the per-layer quantities of the pretrained study (docs/bounds.md §1.6), ``block``
  = layer index − 1: ``x_fro`` (‖X‖_F), ``median_token_norm`` and ``attention_entropy`` (the mean over
  heads and query tokens of −Σ_j p_ij ln p_ij, in nats); every row of that study (bound, pgd, block)
  also carries the columns of :data:`PRETRAINED_COLUMNS`; the imported layers' rows (task
  ``imported``) the same quantities at ``block`` = the layer's index k, with :data:`IMPORTED_COLUMNS`;
* ``accuracy``: a network's clean (``bound`` = ``clean``) or PGD robust (``pgd_margin``) accuracy
  over the cell's test images, ``sample`` = −1.

Role ``pgd`` also holds PGD on a network's margin (``bound`` = ``pgd_margin``, objective ``margin``):
its value is the margin drop it attained, ``margin − pgd_margin`` (larger = a stronger attack, as
for every other PGD value).

Every row says how its value is known (``certificate``, docs/bounds.md §2.4): ``exact``,
``deterministic`` or ``probabilistic`` for certified bounds (with the failure probability
``certificate_p`` and the recorded start seeds ``certificate_seeds`` that replay it), ``estimate``
for estimates and solver timings, ``attained`` for PGD values (reached at an explicit perturbation).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from torch import Tensor

import bounds
from bounds.certificates import Certificate
from bounds.registry import PLUGIN_SHA256

from ..core import gate
from ..core.gate import below_pgd, ratio, violation
from ..core.schema import (
    EXTRA_COLUMNS,
    IMPORTED_COLUMNS,
    PRETRAINED_COLUMNS,
    ROLES,
)
from ..nets.accuracy import CertifyRun
from .evaluate import Evaluation


def _entries(values: Tensor) -> Iterator[tuple[int, int, float]]:
    """(sample, head, value) of a [B] or [B, h] tensor; head −1 when there are no heads."""
    per_head = values.dim() == 2
    for b in range(values.shape[0]):
        for head in range(values.shape[1]) if per_head else [-1]:
            yield b, head, float(values[b, head] if per_head else values[b])


def row(role: str, name: str, sample: int, value: float, *, head: int = -1, block: int = -1,
        certified: bool = False, certificate: Certificate | str = "estimate", finding: bool = False,
        objective: str | None = None, pgd: float = math.nan, seconds: float = 0.0,
        pgd_seconds: float = 0.0, refuted: bool = False, extra: dict | None = None) -> dict:
    """One row; ``ratio``, ``sound`` and ``violation`` follow from value, pgd and certified.

    ``finding`` marks a bound whose published statement this suite found unsound: its violations
    are findings, shown apart from ``violation`` (the suite's own bounds must never have one).
    ``refuted``: an attack contradicts the value in another way (a certificate it breaks).
    ``extra``: columns of :data:`EXTRA_COLUMNS`.
    """
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}")
    unknown = set(extra or {}) - set(EXTRA_COLUMNS)
    if unknown:
        raise ValueError(f"unknown extra columns {sorted(unknown)}")
    cert = certificate if isinstance(certificate, Certificate) else None
    sound = not below_pgd(value, pgd) and not refuted
    plugin = PLUGIN_SHA256.get(name) if role in gate.NAMED else None
    extra = (extra or {}) | ({"plugin_sha256": plugin} if plugin else {})
    return {"role": role, "bound": name, "sample": sample, "head": head, "block": block,
            "certified": certified, "certificate": cert.kind if cert else certificate,
            "certificate_p": cert.p if cert else math.nan,
            "certificate_seeds": ";".join(map(str, cert.seeds)) if cert else "",
            "finding": finding, "objective": objective or "", "value": value, "pgd": pgd,
            "ratio": float(ratio(value, pgd)), "sound": sound,
            "violation": bool(violation(certified, sound, finding)),
            "seconds": seconds, "pgd_seconds": pgd_seconds, **extra}


def unroll(ev: Evaluation) -> list[dict]:
    """Every bound value of an evaluation (per sample and head) and every PGD value, as rows.

    Seconds are per sample: a batched call's time divided by the batch size.
    """
    rows = []
    for name, values in ev.values.items():
        b = bounds.get(name)
        ref = ev.reference(name)
        B = values.shape[0]
        pgd_s = ev.pgd_seconds.get(b.objective or "", 0.0) / B
        for sample, head, v in _entries(values):
            p = math.nan if ref is None else float(ref[sample, head] if head >= 0 else ref[sample])
            rows.append(row("bound", name, sample, v, head=head, certified=b.certified,
                            certificate=ev.certificates[name], finding=bool(b.finding),
                            objective=b.objective, pgd=p, seconds=ev.seconds[name] / B,
                            pgd_seconds=pgd_s))
    for obj, values in ev.pgd.items():
        B = values.shape[0]
        rows += [row("pgd", f"pgd_{obj}", sample, v, head=head, certificate="attained", objective=obj,
                     seconds=ev.pgd_seconds[obj] / B) for sample, head, v in _entries(values)]
    return rows


def measured(role: str, name: str, values: Tensor, seconds: float, block: int = -1,
             certificate: str = "estimate") -> list[dict]:
    """Rows of a timed quantity [B] (or [B, ...], reduced to its largest entry per sample)."""
    values = values.reshape(values.shape[0], -1).amax(-1)
    return [row(role, name, b, v, block=block, certificate=certificate,
                seconds=seconds / len(values)) for b, v in enumerate(values.tolist())]


def summed_diagnostics(columns: dict[str, Tensor], i: int) -> dict[str, float]:
    """Sample i's :data:`DIAGNOSTICS` from ``bounds.network.taylor_net.Diagnostics.columns``."""
    total = lambda prefix: float(sum(float(v[i]) for f, v in columns.items() if f.startswith(prefix)))
    out = {"tn_first_order": float(columns["first_order"][i]), "tn_kinks": float(columns["kinks"][i]),
           "tn_attention": total("remainder_attention"), "tn_project": total("remainder_project"),
           "tn_unstable": total("unstable_"), "tn_straddling": total("straddling_")}
    if math.isnan(out["tn_first_order"]):  # not computed (a misclassified image): no losses, no counts
        return dict.fromkeys(out, math.nan) | {"tn_backward": False}
    return out | {"tn_backward": bool(columns["backward"][i])}


def network_rows(res: CertifyRun) -> list[dict]:
    """A ``certify`` run at one ε (docs/bounds.md §5) as rows: per (bound, sample) a ``certify``
    row, per sample a ``pgd`` row of the margin attack, and the ``accuracy`` rows."""
    (eps,) = res.eps
    n, rows = res.n, []
    per = [{"label": int(res.labels[i]), "correct": bool(res.correct[i]), "margin": float(res.margin[i]),
            "pgd_margin": float(res.pgd_margin[eps][i]), "pgd_broken": bool(res.pgd_broken[eps][i])}
           for i in range(n)]
    pgd_s = res.pgd_seconds[eps] / n
    for name in res.bounds:
        b, key = bounds.get(name), (name, eps)
        for i in range(n):
            pairwise, prop1 = bool(res.pairwise[key][i]), bool(res.prop1[key][i])
            attacked = bool(gate.refuted(pairwise, prop1, per[i]["pgd_broken"]))
            rows.append(row("certify", name, i, float(res.delta[key][i]), certified=b.certified,
                            certificate=res.certificates[key], finding=bool(b.finding), objective="margin",
                            pgd=float(res.pgd_features[eps][i]), seconds=res.seconds[key] / n,
                            pgd_seconds=pgd_s, refuted=attacked,
                            extra=per[i] | {"certified_prop1": prop1, "certified_pairwise": pairwise}
                            | ({"sent_to_crown": bool(res.sent[key][i])} if key in res.sent else {})
                            | (summed_diagnostics(res.diagnostics[key], i)
                               if key in res.diagnostics else {})))
    rows += [row("pgd", "pgd_margin", i, per[i]["margin"] - per[i]["pgd_margin"], certificate="attained",
                 objective="margin", seconds=pgd_s, extra=per[i]) for i in range(n)]
    return rows + accuracy_rows(res.correct, res.pgd_broken[eps], None)


def with_model(rows: list[dict], card: dict) -> list[dict]:
    """The rows of a model task with the :data:`MODEL_COLUMNS` of its model's card."""
    a = card["architecture"]
    nan = lambda v: math.nan if v is None else float(v)
    cols = {"vit_depth": a["depth"], "vit_heads": a["heads"], "vit_d": a["d"], "vit_c": nan(a["constraint"]),
            "vit_qk": nan(a.get("qk_constraint")), "vit_margin_eps": float(card.get("margin_eps", 0.0)),
            "vit_test_accuracy": float(card["test_accuracy"])}
    return [r | cols for r in rows]


def with_file(rows: list[dict], card: dict, architecture: dict, columns: dict) -> list[dict]:
    """The rows of a network file's task with its shape in the :data:`MODEL_COLUMNS` (no caps, no
    margin training, no card's test accuracy: NaN), how well the recovered network reproduces the
    runtime (``max_rel_err``) and ``columns`` (its cell's :data:`FILE_COLUMNS`)."""
    a = architecture
    cols = {"vit_depth": a["depth"], "vit_heads": a["heads"], "vit_d": a["d"], "vit_c": math.nan,
            "vit_qk": math.nan, "vit_margin_eps": 0.0, "vit_test_accuracy": math.nan,
            "max_rel_err": float(card["max_rel_err"])}
    return [r | cols | columns for r in rows]


def accuracy_rows(correct: Tensor, broken: Tensor, steps: int | None) -> list[dict]:
    """Clean and PGD robust accuracy over the samples (a broken sample counts as not robust)."""
    extra = {} if steps is None else {"attack_steps": steps}
    return [row("accuracy", "clean", -1, float(correct.double().mean()), certificate="exact", extra=extra),
            row("accuracy", "pgd_margin", -1, float((~broken).double().mean()), certificate="attained",
                objective="margin", extra=extra)]


def pretrained_rows(ev: Evaluation, layer_index: int, quantities: dict[str, float],
                    columns: dict) -> list[dict]:
    """The pretrained study's rows of one (layer, sentence, ε): every bound and PGD value of ``ev``,
    and one ``block`` row per exact per-layer quantity, each row with ``columns``
    (:data:`PRETRAINED_COLUMNS`)."""
    return _layer_rows(ev, layer_index - 1, quantities, columns, PRETRAINED_COLUMNS)


def imported_rows(ev: Evaluation, layer: int, quantities: dict[str, float], columns: dict) -> list[dict]:
    """An imported cell's rows, as :func:`pretrained_rows` (``block`` = the imported layer's index k),
    with ``columns`` of :data:`IMPORTED_COLUMNS`."""
    return _layer_rows(ev, layer, quantities, columns, IMPORTED_COLUMNS)


def _layer_rows(ev: Evaluation, block: int, quantities: dict[str, float], columns: dict,
                known: dict) -> list[dict]:
    unknown = set(columns) - set(known)
    if unknown:
        raise ValueError(f"unknown columns {sorted(unknown)}")
    rows = [row("block", name, 0, v, block=block, certificate="exact") for name, v in quantities.items()]
    return [r | columns for r in unroll(ev) + rows]

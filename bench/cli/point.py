"""``python -m bench point``: every bound of one layer file at one input file and one ε."""

from __future__ import annotations

import math
from argparse import Namespace

from torch import Tensor

import bounds
from bounds.registry import PLUGIN_SHA256
from models import Stack, load_input, load_layer

from ..core.arglists import split_list
from ..core.env import device_name, resolve_device, resolve_dtype, versions
from ..core.jsonout import dumps
from ..sweep.evaluate import Evaluation, evaluate
from ..sweep.rows import unroll

POINT_EXTRA = ("taylor_remainder",)  # opt-in bounds point computes without --bounds, where they apply


def _plain(t: Tensor, batched: bool):
    """A number, a per-head list, or (batched) a list of those per input."""
    v = t.tolist()
    return v if batched else v[0]


def describe(layer) -> dict:
    block = layer.blocks[0] if isinstance(layer, Stack) else layer
    meta = {"kind": layer.kind, "d": block.d, "h": block.h, "d_h": block.d_h,
            "residual": bool(block.residual)}
    if isinstance(layer, Stack):
        meta.update(depth=len(layer.blocks), block_kind=layer.block_kind, R=layer.R)
    return meta


def to_json(ev: Evaluation, meta: dict, batched: bool) -> dict:
    out: dict = {name: _plain(v, batched) for name, v in ev.values.items()}
    out["pgd"] = _plain(ev.pgd["output"], batched)
    out.update({f"pgd_{k}": _plain(v, batched) for k, v in ev.pgd.items() if k != "output"})
    out["meta"] = meta
    return out


def _fmt(x: float) -> str:
    return "—" if math.isnan(x) else f"{x:.6g}"


CERT_WIDTH = 28  # "probabilistic (p=1.0e-09) (!)"


def to_table(ev: Evaluation, batch: int) -> str:
    head = (f"{'bound':<22} {'value':>12} {'PGD':>12} {'value/PGD':>10}  {'certificate':<{CERT_WIDTH}} "
            f"{'seconds':>8}")
    rows = [r for r in unroll(ev) if r["role"] == "bound"]
    lines = []
    for b in range(batch):
        if batch > 1:
            lines.append(f"input {b}")
        lines += [head, "-" * len(head)]
        for r in (r for r in rows if r["sample"] == b):
            bound = bounds.get(r["bound"])
            label = f"{r['bound']}[l={r['head']}]" if r["head"] >= 0 else r["bound"]
            cert = str(ev.certificates[r["bound"]]) + (" (!)" if bound.finding else "")
            lines.append(f"{label:<22} {_fmt(r['value']):>12} {_fmt(r['pgd']):>12} "
                         f"{_fmt(r['ratio']):>10}  {cert:<{CERT_WIDTH}} {ev.seconds[r['bound']]:>8.4f}")
        for name, why in ev.skipped.items():
            lines.append(f"{name:<22} skipped: {why}")
        lines.append("")
    for name in ev.values:
        if bounds.get(name).finding:
            lines.append(f"(!) {name}: published as a bound, but {bounds.get(name).finding}")
    lines.append("PGD column: best PGD value of each bound's own objective (end-to-end for the totals, "
                 "‖Δ₁‖, ‖Δ₂‖, per-head ‖ΔP_l‖_F and ‖X'C_l‖ for the parts); PGD seconds: "
                 + ", ".join(f"{k} {s:.3f}" for k, s in ev.pgd_seconds.items()))
    return "\n".join(lines)


def run(args: Namespace) -> int:
    layer = load_layer(args.layer)
    X = load_input(args.input)
    batched = X.dim() == 3
    device, dtype = resolve_device(args.device), resolve_dtype(args.dtype)
    names = split_list("--bounds", args.bounds) if args.bounds is not None else None
    # without --bounds: every bound that applies, and attention's Taylor remainder beside taylor
    ev = evaluate(layer, X, args.eps, names=names, extra=POINT_EXTRA, device=device, dtype=dtype,
                  pgd_steps=args.pgd_steps, pgd_restarts=args.pgd_restarts, seed=args.seed)
    Xb = X if batched else X[None]
    meta = describe(layer) | {
        "n": Xb.shape[1], "batch": Xb.shape[0], "eps": args.eps, "dtype": args.dtype,
        "device": device.type, "device_name": device_name(device), "versions": versions(),
        "pgd_steps": args.pgd_steps, "pgd_restarts": args.pgd_restarts, "seed": args.seed,
        "seconds": ev.seconds | {f"pgd_{k}" if k != "output" else "pgd": s
                                 for k, s in ev.pgd_seconds.items()},
        "skipped": ev.skipped,
        "certified": {n: bounds.get(n).certified for n in ev.values},
        "certificates": {n: {"kind": c.kind, "p": c.p, "seeds": list(c.seeds)}
                         for n, c in ev.certificates.items()},
        "findings": {n: bounds.get(n).finding for n in ev.values if bounds.get(n).finding},
        # the plugin file each plugin bound came from, by its sha256 (docs/guide/plugins.md)
        "plugins": {n: PLUGIN_SHA256[n] for n in ev.values if n in PLUGIN_SHA256},
    }
    if args.json:
        print(dumps(to_json(ev, meta, batched), indent=1))  # a NaN or +inf value as null
    else:
        print(f"{meta['kind']} layer: n={meta['n']}, d={meta['d']}, h={meta['h']}, "
              f"batch={meta['batch']}, eps={args.eps}, {args.dtype} on {meta['device_name']}")
        print(to_table(ev, Xb.shape[0]))
    return 0

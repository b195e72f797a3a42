"""``python -m bench run``: every cell of a profile, each written as soon as it is finished.

Re-running the same command skips finished cells. A certified bound below its PGD value is a
soundness violation: it is printed at once and counted at the end, never dropped.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import sys
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

import bounds
from bounds import jacobian as jac
from bounds import lofast as lf
from models import InputError, Stack

from .cases import Cell
from .env import device_name, git_state, resolve_device, resolve_dtype, timed, versions
from .evaluate import evaluate
from .store import cell_file, consolidate, write_cell, write_json
from .sweeps import Profile

SOUND_RTOL = 1e-6
LOFAST_ONLY = ["lofast_M", "lofast_xi", "lofast_M_half", "lofast_xi_half", "naive"]
DENSE_LIMIT = 1024  # n·d up to which the scaling task also times the exact dense solvers


def _rows_from_values(name: str, values: torch.Tensor, ref: torch.Tensor | None, seconds: float,
                      certified: bool, objective: str | None, pgd_seconds: float) -> list[dict]:
    rows = []
    B = values.shape[0]
    heads = values.shape[1] if values.dim() == 2 else None
    for b in range(B):
        for head in range(heads) if heads else [-1]:
            v = float(values[b, head] if heads else values[b])
            p = math.nan if ref is None else float(ref[b, head] if heads else ref[b])
            ratio = v / p if p and math.isfinite(p) else math.nan
            sound = not (p > 0 and v < p * (1 - SOUND_RTOL))
            rows.append({"bound": name, "sample": b, "head": head, "block": -1,
                         "certified": certified, "objective": objective or "", "value": v,
                         "pgd": p, "ratio": ratio, "sound": sound,
                         "violation": certified and not sound, "seconds": seconds / B,
                         "pgd_seconds": pgd_seconds / B})
    return rows


def bounds_rows(cell: Cell, layer, X, run: dict, device, dtype) -> list[dict]:
    names = LOFAST_ONLY if cell.task == "lofast" else None
    ev = evaluate(layer, X, cell.eps, names=names, device=device, dtype=dtype,
                  pgd_steps=run["pgd_steps"], pgd_restarts=run["pgd_restarts"], seed=run["seed"])
    rows = []
    for name, values in ev.values.items():
        b = bounds.get(name)
        rows += _rows_from_values(name, values, ev.reference(name), ev.seconds[name], b.certified,
                                  b.objective, ev.pgd_seconds.get(b.objective or "", 0.0))
    for obj, values in ev.pgd.items():  # the lower bounds themselves, for plots and `compare`
        rows += _rows_from_values(f"pgd_{obj}", values, None, ev.pgd_seconds[obj], False, obj, 0.0)
    return rows


def _measure(rows: list, name: str, fn, device, block: int = -1) -> None:
    values, s = timed(fn, device)
    values = values.reshape(values.shape[0], -1).amax(-1)  # per sample; heads: the largest
    for b, v in enumerate(values.tolist()):
        rows.append({"bound": name, "sample": b, "head": -1, "block": block, "certified": False,
                     "objective": "", "value": v, "pgd": math.nan, "ratio": math.nan,
                     "sound": True, "violation": False, "seconds": s / len(values),
                     "pgd_seconds": 0.0})


def scaling_rows(cell: Cell, layer, X, device) -> list[dict]:
    """Seconds of the matrix-free solvers (and the dense ones where they fit) for ζ, ‖M_l‖, σ_max."""
    rows: list[dict] = []
    if isinstance(layer, Stack):
        _measure(rows, "scaling:jacobian_power", lambda: jac.jacobian_power(layer.forward, X).sigma,
                 device)
        return rows
    dense = cell.n * cell.d <= DENSE_LIMIT
    if layer.kind == "dot":
        _measure(rows, "scaling:zeta_power", lambda: lf.zeta(layer, X), device)
        _measure(rows, "scaling:M_power", lambda: lf.m_norms(layer, X), device)
        if dense:
            _measure(rows, "scaling:zeta_dense", lambda: lf.zeta(layer, X, method="dense"), device)
            _measure(rows, "scaling:M_dense", lambda: lf.m_norms(layer, X, method="dense"), device)
    _measure(rows, "scaling:jacobian_power", lambda: jac.jacobian_power(layer.forward, X).sigma,
             device)
    if dense:
        _measure(rows, "scaling:jacobian_dense", lambda: jac.sigma_exact(layer, X), device)
    return rows


def cauchy_rows(cell: Cell, stack, X, device) -> list[dict]:
    """Per block k of a stack: σ_max(J_{f_k}(X_k)) (matrix-free, and exact where it fits) and the
    surrogate √(‖J‖₁‖J‖∞), the Cauchy view's per-layer quantities (SPEC §3.4)."""
    if not isinstance(stack, Stack):
        stack = Stack((stack,), R=None)
    rows: list[dict] = []
    for k, (block, Xk) in enumerate(zip(stack.blocks, stack.trajectory(X), strict=False)):
        f, x = block.forward, Xk
        _measure(rows, "block_sigma", lambda f=f, x=x: jac.jacobian_power(f, x).sigma, device, k)
        if cell.n * cell.d <= jac.DENSE_LIMIT:
            _measure(rows, "block_sigma_exact", lambda f=f, x=x: jac.spectral(jac.jacobian_dense(f, x)),
                     device, k)
            _measure(rows, "block_l1linf", lambda b=block, x=x: jac.jacobian_l1linf(b, x, 1.0), device, k)
    return rows


def run_cell(cell: Cell, run: dict, device, dtype) -> list[dict]:
    layer, X = cell.build()
    if cell.task in ("bounds", "lofast"):
        return bounds_rows(cell, layer, X, run, device, dtype)
    X = X.to(device=device, dtype=dtype)
    layer = layer.to(X)
    return scaling_rows(cell, layer, X, device) if cell.task == "scaling" else \
        cauchy_rows(cell, layer, X, device)


def run_profile(profile: Profile, out: Path, device_arg: str = "auto", dtype_arg: str | None = None,
                overrides: dict | None = None) -> tuple[Path, int]:
    """Runs (or resumes) every cell into ``out``; returns (results table, violations found)."""
    device = resolve_device(device_arg)
    run = dict(profile.run)
    if dtype_arg:
        run["dtype"] = dtype_arg
    dtype = resolve_dtype(run["dtype"])
    options = {"profile": profile.name, "run": run, "overrides": overrides or {}}
    out.mkdir(parents=True, exist_ok=True)
    manifest = out / "run.json"
    if manifest.exists():
        before = json.loads(manifest.read_text()).get("options")
        if before != json.loads(json.dumps(options)):
            raise InputError(f"{out} holds a run with other options ({before}); "
                             f"use another --out or remove it")
    commit, dirty = git_state()
    meta = {"profile": profile.name, "suite_version": versions()["suite"], "git_commit": commit,
            "git_dirty": dirty, "torch_version": torch.__version__, "device": device.type,
            "device_name": device_name(device), "dtype": run["dtype"], "run_seed": run["seed"],
            "pgd_steps": run["pgd_steps"], "pgd_restarts": run["pgd_restarts"],
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    write_json(manifest, {"options": options, "started": meta})
    cells = profile.cells()
    todo = [(i, s, c) for i, (s, c) in enumerate(cells) if not cell_file(out, s, c.id).exists()]
    bar = tqdm(total=len(cells), initial=len(cells) - len(todo), desc=f"{profile.name} on "
               f"{meta['device_name']}", unit="cell", file=sys.stderr, mininterval=5)
    for i, sweep, cell in todo:
        rows = run_cell(cell, run, device, dtype)
        df = pd.DataFrame(rows)
        for k, v in reversed(list(({"cell_index": i, "sweep": sweep, "cell_id": cell.id}
                                   | cell.params()).items())):
            df.insert(0, k, v)
        for k, v in meta.items():
            df[k] = v
        for r in df[df["violation"]].itertuples():
            tqdm.write(f"SOUNDNESS VIOLATION: {r.bound} = {r.value:.6g} < PGD {r.pgd:.6g} "
                       f"in {sweep} {cell.id} sample {r.sample} head {r.head}", file=sys.stderr)
        write_cell(out, sweep, cell.id, df)
        bar.update(1)
    bar.close()
    table = consolidate(out)
    return table, int(pd.read_csv(table)["violation"].sum())

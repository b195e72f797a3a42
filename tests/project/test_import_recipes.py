"""docs/guide/import.md's recipes run as written (issue #30 item 4): every ```bash block of the page,
in order, by bash in a fresh copy of the checkout's packages (the page says: from the root of a
checkout), with ``python`` this interpreter; then what they wrote is what the page says: the import
directories with their manifests, `point`'s table, a run whose rows load, and the report's imported
table and figure. Needs the import extra (onnx, onnxruntime, onnxscript) and transformers."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from helpers import ROOT

from bench.core.store import load

for module in ("onnx", "onnxruntime", "onnxscript", "transformers"):
    pytest.importorskip(module)

PAGE = ROOT / "docs" / "guide" / "import.md"
BLOCK = re.compile(r"^```bash\n(.*?)^```$", re.M | re.S)
PACKAGES = ("models", "bounds", "attacks", "bench")


def test_the_recipes_run_as_written(tmp_path):
    blocks = BLOCK.findall(PAGE.read_text())
    assert len(blocks) == 4  # three recipes and the sweep
    clone = tmp_path / "clone"
    for name in PACKAGES:
        shutil.copytree(ROOT / name, clone / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", clone)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # a wrapper, not a link: a venv's interpreter finds its packages from the path it was started by
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", BENCH_THREADS="1", MPLBACKEND="Agg",
               HF_HUB_OFFLINE="1")
    script = "set -euo pipefail\n" + "\n".join(blocks)
    done = subprocess.run(["bash", "-c", script], cwd=clone, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    mine = clone / "results" / "mine"
    want = {"vit_layers": (3, False, 3), "bert_layers": (2, True, 3), "encoder_layers": (1, True, 3)}
    for directory, (layers, residual, inputs) in want.items():
        m = json.loads((mine / directory / "manifest.json").read_text())
        assert len(m["layers"]) == layers, directory
        for e in m["layers"]:
            assert e["residual"] is residual and e["max_rel_err"] <= 1e-6
            assert len(e["files"]["inputs"]) == inputs
    assert done.stdout.count("value/PGD") == 3  # each recipe's `point` printed its table
    df = load(mine / "run")
    assert not df["violation"].any()
    cells = df.drop_duplicates("cell_id")
    assert len(cells) == (3 + 2 + 1) * 3 * 2  # layers × inputs × ε
    assert "![imported](imported.png)" in (mine / "report" / "README.md").read_text()
    table = (mine / "report" / "imported.md").read_text()
    assert table.count("\n| vit_layers |") == 3 * 2 and table.count("\n| encoder_layers |") == 2

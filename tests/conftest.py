"""Shared test setup: one torch thread (2-core CI), float64 by default for exact comparisons; one
finished run of helpers.ONE, which tests read or copy (never change)."""

from pathlib import Path

import pytest
import torch
from helpers import ONE

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def finished(tmp_path_factory) -> Path:
    """A finished run of ONE (two cells); copy it before changing anything in it."""
    from bench.sweep.profiles import load_profile
    from bench.sweep.runner import run_profile

    d = tmp_path_factory.mktemp("finished")
    (d / "one.toml").write_text(ONE)
    run_profile(load_profile(str(d / "one.toml")), d / "run", "cpu")
    return d / "run"

"""What several test modules share: running the CLI as a user would (a subprocess from an
unrelated directory, or in-process for the many bad-input cases), and the numpy helpers of the
independent float64 references. Fixtures (a tiny profile, a session-wide tiny run) are in
conftest.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
# a profile of two tiny cells (seconds), for the tests of runs and of what they refuse
ONE = """
[run]
pgd_steps = 3
pgd_restarts = 1
[[sweep]]
name = "one"
kind = "dot"
n = 3
d = 4
h = 2
eps = [0.01, 0.1]
"""


def cli(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), BENCH_THREADS="1")
    return subprocess.run([sys.executable, "-m", "bench", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def main_inprocess(capsys, *args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``python -m bench ARGS`` run in this process: fast, for the
    many bad-input cases; the subprocess tests above show the same path from a real shell."""
    from bench.cli.main import main

    try:
        code = main([str(a) for a in args])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def one_error(code: int, err: str, words: str) -> None:
    """Exit 2 with exactly one ``error:`` line, the last, holding ``words``, and no traceback."""
    assert code == 2, err
    lines = err.rstrip("\n").split("\n")
    assert lines[-1].startswith("error:") and words in lines[-1], err
    assert sum(line.startswith("error:") for line in lines) == 1 and "Traceback" not in err, err


def np_(t: torch.Tensor) -> np.ndarray:
    """A tensor as a float64 numpy array, for the references that must not share torch's code."""
    return t.detach().cpu().numpy().astype(np.float64)


def softmax_rows(S: np.ndarray) -> np.ndarray:
    E = np.exp(S - S.max(axis=-1, keepdims=True))
    return E / E.sum(axis=-1, keepdims=True)


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

"""``python -m bench``: point, run, report, compare, baseline, history, train, certify, import.

Bad input ends with one line on stderr and exit code 2: argparse's own errors, and every
InputError raised by the library (shapes, values, files, kinds).
"""

from __future__ import annotations

import argparse
import shlex
import sys

import torch

from models import InputError

from ..core.env import ROOT, check_environment, keep_freed_memory, set_threads
from ..sweep.profiles import OVERRIDES
from . import failures
from .certify_cmd import add_parser as add_certify_parser
from .import_cmd import add_parser as add_import_parser
from .train_cmd import add_parser as add_train_parser


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not argparse's usage block
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def _int_at_least(low: int):
    """An argparse type: an integer >= low, else argparse's one-line error."""

    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {s!r}")
        return v

    return parse


_positive_int, _count = _int_at_least(0), _int_at_least(1)


def _path(s: str) -> str:
    """An argparse type: a non-empty path (an empty one would otherwise fall back to a default, or
    name the current directory)."""
    if not s.strip():
        raise argparse.ArgumentTypeError("expected a path, got an empty string")
    return s


def add_plugin_option(parser: argparse.ArgumentParser) -> None:
    """``--plugin FILE.py``, repeatable: a researcher's own bounds for this command
    (docs/guide/plugins.md)."""
    parser.add_argument("--plugin", action="append", default=None, type=_path, metavar="FILE.py",
                        help="a Python file whose BOUNDS (bounds.Bound objects) join the registry for "
                             "this command; repeatable (docs/guide/plugins.md)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=_count, default=None,
                   help="torch CPU threads (default $BENCH_THREADS or 1)")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    pt = sub.add_parser("point", help="every bound of one layer at one input and ε, against PGD")
    pt.add_argument("--layer", required=True, type=_path, help="layer or stack file (.safetensors)")
    pt.add_argument("--input", required=True, type=_path, help="input file holding X [n,d] or [B,n,d]")
    pt.add_argument("--eps", required=True, type=float, help="radius of the Frobenius ball")
    pt.add_argument("--bounds", default=None, help="comma-separated bound names (default: all that apply)")
    pt.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    pt.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    pt.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    pt.add_argument("--pgd-steps", type=_positive_int, default=100)
    pt.add_argument("--pgd-restarts", type=_positive_int, default=8)
    pt.add_argument("--seed", type=_positive_int, default=0)
    add_plugin_option(pt)
    rn = sub.add_parser("run", help="run a profile's sweeps into a results directory (resumable)")
    rn.add_argument("--profile", default="quick", type=_path, help="quick, paper, or a TOML file")
    rn.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    rn.add_argument("--dtype", default=None, choices=["float32", "float64"],
                    help="default: the profile's (float64)")
    rn.add_argument("--out", default=None, type=_path, help="results directory (default results/<profile>)")
    for flag, field in OVERRIDES.items():
        rn.add_argument(f"--{flag.replace('_', '-')}", dest=f"ov_{flag}", default=None,
                        metavar="V[,V...]", help=f"override the {field} axis of every sweep")
    rn.add_argument("--sweeps", default=None, metavar="NAME[,NAME...]",
                    help="run only these sweeps' cells now; the others stay to do, and a later run "
                         "without it continues them (a GPU for the CROWN sweeps, say)")
    rn.add_argument("--list", action="store_true", help="list the cells and exit")
    rn.add_argument("--fresh", action="store_true",
                    help="discard the finished cells in --out instead of resuming from them")
    rn.add_argument("--adopt", default=None, type=_path, metavar="DIR",
                    help="first take the finished cells of the run in DIR (the same profile and options, "
                         "maybe another commit): their rows keep the commit they were computed at")
    dask = rn.add_mutually_exclusive_group()
    dask.add_argument("--workers", type=_count, default=None, metavar="N",
                      help="run the cells on a local Dask cluster of N processes (pip install "
                           "'attnbounds[dask]')")
    dask.add_argument("--scheduler", default=None, metavar="ADDRESS",
                      help="run the cells on the Dask cluster at ADDRESS (tcp://HOST:8786)")
    add_plugin_option(rn)

    rp = sub.add_parser("report", help="figures and tables, rebuilt from stored results alone")
    rp.add_argument("results", nargs="?", default=str(ROOT / "results" / "baseline"), type=_path,
                    help="results directory or CSV (default results/baseline)")
    rp.add_argument("--out", default=None, type=_path,
                    help="default: RESULTS/report (for a CSV: report/ beside it), git-ignored; the "
                         "committed reports/ is written only when named (--out reports) or by "
                         "`baseline --update`")
    add_plugin_option(rp)

    cp = sub.add_parser("compare", help="tightness and soundness of NEW against BASE (exit 1 if worse)")
    cp.add_argument("base", type=_path)
    cp.add_argument("new", type=_path)
    cp.add_argument("--tol", type=float, default=0.02, help="relative tolerance (default 0.02)")
    cp.add_argument("--allow-missing", action="store_true",
                    help="rows of BASE absent from NEW are reported (`!`) but do not fail")
    add_plugin_option(cp)

    bl = sub.add_parser("baseline", help="rewrite results/baseline (or results/paper) deliberately")
    bl.add_argument("--update", action="store_true", required=True)
    bl.add_argument("--profile", default="quick", choices=["quick", "paper-cpu"],
                    help="quick (default): results/baseline and reports/; paper-cpu: results/paper and "
                         "reports/paper")
    bl.add_argument("--from", dest="source", default=None, type=_path,
                    help="a finished run directory to copy (default: run the profile afresh)")
    bl.add_argument("--accept", action="append", default=None, metavar="NAME[,NAME...]",
                    help="let through what the comparison with the baseline it replaces refuses: "
                         "removed, looser, weaker, finding, incomparable (recorded in "
                         "results/baseline/CHANGES.md)")
    bl.add_argument("--allow-dirty", action="store_true",
                    help="accept rows computed from a dirty tree or without a commit")
    bl.add_argument("--tol", type=float, default=0.02,
                    help="relative tolerance of the comparison (default 0.02, as compare's)")
    hs = sub.add_parser("history", help="the committed baseline's tightness and certified accuracy "
                                        "over the commits that changed it")
    hs.add_argument("--out", default=None, type=_path,
                    help="directory of history.md and history.png (default results/history, git-ignored)")
    add_train_parser(sub)
    add_plugin_option(add_certify_parser(sub))
    add_import_parser(sub)
    return p


def _run(args) -> int:
    from dataclasses import replace
    from pathlib import Path

    from ..core.plugins import load
    from ..sweep.profiles import load_profile, parse_list
    from ..sweep.runner import Interrupted, check_sweeps, parse_sweeps, run_profile

    overrides = {f: parse_list(f, getattr(args, f"ov_{f}")) for f in OVERRIDES
                 if getattr(args, f"ov_{f}") is not None}
    profile = load_profile(args.profile, overrides)
    if args.plugin:  # --plugin beside the profile's plugins = [...]: the run records both
        profile = replace(profile, plugins=tuple(load([*(p.path for p in profile.plugins), *args.plugin])))
    sweeps = parse_sweeps(args.sweeps)
    check_sweeps(profile, sweeps)
    if args.list:
        for sweep, cell in profile.cells():
            if sweeps is None or sweep in sweeps:
                print(f"{sweep}\t{cell.id}")
        return 0
    out = Path(args.out) if args.out is not None else ROOT / "results" / profile.name
    try:
        table, violations = run_profile(profile, out, args.device, args.dtype, overrides, args.fresh,
                                        args.workers, args.scheduler, sweeps,
                                        Path(args.adopt) if args.adopt is not None else None)
    except Interrupted as e:  # Ctrl-C: the finished cells are kept, and the same run resumes them
        print(f"interrupted: {e}; resume with: {resume_command(args, e.out)}", file=sys.stderr)
        return 130
    print(f"results: {table}")
    if violations:
        print(f"SOUNDNESS VIOLATIONS: {violations} rows where PGD refutes a certified bound",
              file=sys.stderr)
    return 0


def _report_dir(results: str) -> str:
    """Where a report goes by default: beside its results (git-ignored, the baseline's included), never
    over the committed reports/, so that `python -m bench report` leaves the checkout unchanged."""
    from pathlib import Path

    path = Path(results).resolve()
    return str((path if path.is_dir() else path.parent) / "report")


def resume_command(args, out) -> str:
    """The ``run`` line that resumes an interrupted run: its options as parsed (so an abbreviated
    flag or ``--fresh``, which would discard the kept cells, does not come back), paths absolute."""
    from pathlib import Path

    from ..sweep.profiles import PROFILES

    profile = args.profile
    if Path(profile).suffix or not (PROFILES / f"{profile}.toml").exists():
        profile = str(Path(profile).resolve())
    parts = ["python", "-m", "bench", *(["--threads", str(args.threads)] if args.threads is not None else []),
             "run", "--profile", profile, "--out", str(Path(out).resolve()), "--device", args.device]
    if args.dtype is not None:
        parts += ["--dtype", args.dtype]
    for flag in OVERRIDES:
        if getattr(args, f"ov_{flag}") is not None:
            parts += [f"--{flag.replace('_', '-')}", getattr(args, f"ov_{flag}")]
    if args.sweeps is not None:
        parts += ["--sweeps", args.sweeps]
    if args.adopt is not None:
        parts += ["--adopt", str(Path(args.adopt).resolve())]
    if args.workers is not None:
        parts += ["--workers", str(args.workers)]
    if args.scheduler is not None:
        parts += ["--scheduler", args.scheduler]
    for plugin in args.plugin or []:
        parts += ["--plugin", str(Path(plugin).resolve())]
    return shlex.join(parts)


def _dispatch(args) -> int:
    """The command's own work, once its plugins are registered."""
    if args.command == "point":
        from .point import run

        return run(args)
    if args.command == "run":
        return _run(args)
    if args.command == "compare":
        from ..report.compare import run as compare

        return compare(args.base, args.new, args.tol, args.allow_missing)
    if args.command == "report":
        from ..report.render import build

        out = args.out if args.out is not None else _report_dir(args.results)
        print(f"report: {build(args.results, out)}")
        return 0
    if args.command == "baseline":
        from .baseline import update

        print(f"baseline: {update(args.source, args.accept, args.allow_dirty, args.tol, args.profile)}")
        return 0
    if args.command == "history":
        from ..report.history import run as history

        return history(args.out)
    if args.command == "train":
        from .train_cmd import run as train

        return train(args)
    if args.command == "certify":
        from .certify_cmd import run as certify

        return certify(args)
    if args.command == "import":
        from .import_cmd import run as import_model

        return import_model(args)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_environment()  # every $BENCH_* variable, before torch or the allocator is configured
        keep_freed_memory()
        set_threads(args.threads)
        from ..core.plugins import load, using

        # a plugin's bounds join the registry for this command alone, checked before any work
        with using(load(getattr(args, "plugin", None) or [])):
            return _dispatch(args)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: {args.command} stopped before it finished", file=sys.stderr)
        return 130
    except (torch.linalg.LinAlgError, OverflowError, FloatingPointError) as e:
        # the library refuses what overflows before and after its work (bench/sweep/evaluate.py); this is
        # the net under any computation that still fails numerically: one line, not a traceback
        print(failures.numerical(args.command, e), file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as e:
        # out of memory: met with whole-network α-CROWN, ≈ 8 GB an image at one block and > 20 GB at three
        if not failures.is_out_of_memory(e):
            raise
        print(failures.out_of_memory(args.command, e), file=sys.stderr)
        return 2
    except OSError as e:  # a path the library did not foresee (a full disk, a vanished directory)
        print(failures.os_error(args.command, e), file=sys.stderr)
        return 2
    return 2

"""Where a report is written: built whole in a temporary directory beside ``--out`` (same
filesystem), then renamed into place, so a build that fails midway leaves the previous report whole
and never a mix of old and new files.

Only an empty directory or a previous report is ever replaced: a directory of anything else is
refused, never deleted. A report may hold other reports in folders of their own (reports/paper in
reports/): rebuilding the outer one carries them over as they are. A build holds an flock on its
temporary directories for its whole life, so the next build tells a killed build's leftovers
(removed) from a live one's (left alone).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

from models import InputError

from ..core.store import writable_dir

HEADING = "# Benchmark report"  # the first line of every report's README.md: what marks a report
SUFFIXES = {".png", ".pdf", ".md", ".tex", ".csv"}  # .csv: a table's every number (render.py)
BUILDING, OLD = "report-building", "report-old"


def _is_report(out: Path) -> bool:
    """A previous report: a README.md that starts with HEADING, and only the kinds of file a report
    writes, or folders that are reports themselves (a user's notes dropped into it are not ours to
    delete)."""
    try:
        head = (out / "README.md").read_text(errors="replace")[:len(HEADING)]
        entries = list(out.iterdir())
    except OSError:
        return False
    return head == HEADING and all(_nested(e) or (e.is_file() and e.suffix in SUFFIXES) for e in entries)


def _nested(entry: Path) -> bool:
    """A report inside a report (a real folder, not a link), kept when the outer one is rebuilt."""
    return entry.is_dir() and not entry.is_symlink() and _is_report(entry)


def check(out: Path) -> None:
    """Raises InputError (one line) unless ``out`` can be (re)placed by a report."""
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file, not a directory")
    writable_dir(out.parent, f"--out {out}: its parent")
    if out.is_dir():
        if not os.access(out, os.W_OK | os.X_OK):
            raise InputError(f"--out {out} is not a writable directory")
        # a folder of reports alone (reports/paper built before reports/) takes the outer one too
        if any(out.iterdir()) and not _is_report(out) and not all(map(_nested, out.iterdir())):
            raise InputError(f"--out {out} exists and is not a report directory (no README.md "
                             f"starting with {HEADING!r}, or files a report does not write); "
                             f"choose another --out or empty it")


def _hold(path: Path) -> int:
    """An flock on a directory of this build, released by the kernel if the build dies."""
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _stale(out: Path) -> None:
    """Removes the leftovers of killed builds of ``out``; a killed swap's old report comes back."""
    prefix = f".{out.name}."
    for path in sorted(out.parent.iterdir()):
        kind = path.name[len(prefix):].split(".")[0] if path.name.startswith(prefix) else ""
        if kind not in (BUILDING, OLD) or path.is_symlink() or not path.is_dir():
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)  # a live build's
            continue
        try:
            if kind == OLD and not out.exists():
                os.rename(path, out)
            else:
                shutil.rmtree(path, ignore_errors=True)
        finally:
            os.close(fd)


def _sibling(out: Path, kind: str) -> Path:
    return out.parent / f".{out.name}.{kind}.{os.getpid()}.{secrets.token_hex(4)}"


@contextlib.contextmanager
def replacing(out: Path) -> Iterator[Path]:
    """Yields an empty directory to build into; on a normal exit it becomes ``out`` (the previous
    report is removed only then), on an exception it is removed and ``out`` is untouched."""
    out = out.resolve()  # a symlinked --out: the report replaces its target, the link stays
    check(out)
    _stale(out)
    tmp = _sibling(out, BUILDING)
    try:
        tmp.mkdir()  # mkdir, not mkdtemp: the report keeps the umask's permissions, not 0700
    except OSError as e:
        raise InputError(f"--out {out}: cannot create {tmp.name} beside it ({e.strerror or e})") from None
    fds = [_hold(tmp)]
    try:
        yield tmp
        old = None
        # the reports nested in the previous one move into the new one first (a rename each), and
        # back if the swap fails: they are never rebuilt here, nor lost
        nested = [e.name for e in out.iterdir() if _nested(e) and not (tmp / e.name).exists()] \
            if out.is_dir() else []
        for name in nested:
            os.rename(out / name, tmp / name)
        if out.exists():
            old = _sibling(out, OLD)
            fds.append(_hold(out))
            os.rename(out, old)
        try:
            os.rename(tmp, out)
        except OSError:
            if old is not None:
                os.rename(old, out)
            for name in nested:
                os.rename(tmp / name, out / name)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        for fd in fds:
            os.close(fd)
        shutil.rmtree(tmp, ignore_errors=True)

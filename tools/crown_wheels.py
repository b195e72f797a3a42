"""Installs auto_LiRPA (the ``crown`` extra) from ``../shared/wheels`` beside the checkout, where that
folder exists; tox's ``commands_pre`` runs it (tox runs no shell). Without the folder it prints one
note and succeeds: the CROWN tests then skip. No registry serves a working auto_LiRPA
(docs/crown.md), so there is nothing else to try.

    python tools/crown_wheels.py
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REQUIREMENT = "auto_LiRPA>=0.7.1"  # as the crown extra in pyproject.toml
WHEELS = Path(__file__).resolve().parents[1].parent / "shared" / "wheels"


def main() -> int:
    if not WHEELS.is_dir():
        print(f"note: {WHEELS} not found: auto_LiRPA not installed, the CROWN bounds and tests are skipped")
        return 0
    return subprocess.call([sys.executable, "-m", "pip", "install", "--find-links", str(WHEELS),
                            REQUIREMENT])


if __name__ == "__main__":
    sys.exit(main())

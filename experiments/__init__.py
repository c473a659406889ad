"""Experiment drivers: they import the product; nothing in the product imports them.

Run from the repository root as `python -m experiments.<name>` (see experiments/README.md).
Raw results go under `RESULTS` (ignored by git).
"""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS = REPO_ROOT / "experiments" / "results"

"""Where the subcommands print their tables."""

from __future__ import annotations

import sys

from rich.console import Console


def console() -> Console:
    """A rich console on standard output that never cuts a table when the output is not a
    terminal (a pipe, a file): rich would assume 80 columns there."""
    return Console() if sys.stdout.isatty() else Console(width=1000)

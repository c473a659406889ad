"""Flag values more than one subcommand reads."""

from __future__ import annotations

import argparse


def slo_arg(text: str) -> str:
    """`--slo` on serve and plan, checked as it is parsed (`Slo.parse`, bench's too)."""
    from protocol.serving import Slo

    try:
        Slo.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def threads_arg(text: str) -> int | None:
    """`--torch-threads`: a count >= 1, or `auto` (None: the engine's threads follow the
    cores other processes leave free, `engine.threads.ThreadGovernor`).

    Raises:
        argparse.ArgumentTypeError: neither.
    """
    if text.strip().lower() == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a thread count >= 1 or auto, got {text!r}")
    return value


# The config file's type of `threads_arg`'s values (`cluster.config_file`): a YAML number
# or `auto`.
threads_arg.value_type = int | None


def int_list(text: str, name: str) -> tuple[int, ...]:
    """Comma-separated integers >= 0 (`--tp 1,2,4`); `name` is the flag in the error."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{name}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise ValueError(f"{name}: expected integers >= 0, got {text!r}")
    return values


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


def int_list(text: str, name: str) -> tuple[int, ...]:
    """Comma-separated integers >= 0 (`--tp 1,2,4`); `name` is the flag in the error."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{name}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise ValueError(f"{name}: expected integers >= 0, got {text!r}")
    return values


"""What a worker costs: the on-demand list price of its accelerator (`data/prices.yaml`,
one provider's list, each figure with its source and date) times its TP degree.

A profile of a CPU, or of a device the table does not price, costs 1 per worker-hour: the
plan's costs then rank splits by their worker count, as before prices were known."""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any

import yaml

from planner.profile import Profile

UNPRICED = 1.0  # per worker-hour: a CPU, or an accelerator with no list price


@functools.cache
def list_prices() -> dict[str, dict[str, Any]]:
    """The table: per accelerator name, `usd_per_hour`, `provider`, `source`, `date`."""
    text = resources.files("planner").joinpath("data/prices.yaml").read_text()
    return yaml.safe_load(text)


def accelerator_price(profile: Profile) -> float | None:
    """The list price of one accelerator-hour of the profile's device; None for a CPU or
    a device the table does not list."""
    if not profile.hardware.get("gpu"):
        return None
    entry = list_prices().get(str(profile.hardware.get("accelerator", profile.hardware["gpu"])))
    return None if entry is None else float(entry["usd_per_hour"])


def worker_price(profile: Profile, per_accelerator: float | None = None) -> float:
    """A worker's cost per hour: `per_accelerator` (given) or the list price, times its TP
    degree; `UNPRICED` where neither is known.

    Args:
        profile: the worker's profile (its `hardware`: accelerator and `tp`).
        per_accelerator: the price of one accelerator-hour, over the list's.
    """
    price = per_accelerator if per_accelerator is not None else accelerator_price(profile)
    if price is None:
        return UNPRICED
    return price * int(profile.hardware.get("tp", 1))

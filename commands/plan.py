"""`pdcluster plan`: size the prefill and decode pools for a trace and SLOs.

The planner is a library (`planner/`); this command adds what it must not import: for
`--validate`, the recommended configuration and its neighbours served for real
(`commands.validate`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console

from commands.arguments import int_list, slo_arg
from engine import defaults as engine_defaults
from protocol import defaults
from protocol.serving import SLO_HELP

# `plan` keeps stdout for the plan (its tables, or with --json its JSON) and shows progress
# and notes on stderr.
notes = Console(stderr=True)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register `plan` with the `pdcluster` subcommands.

    Args:
        sub: what `ArgumentParser.add_subparsers()` returned.

    Returns:
        The subcommand's parser.
    """
    plan = sub.add_parser("plan", help="size the prefill and decode pools for a trace and SLOs")
    plan.add_argument("--profile", help="profile of every worker type (with "
                      "--max-accelerators: comma-separated, one per TP degree)")
    plan.add_argument("--prefill-profile", help="profile(s) of prefill workers")
    plan.add_argument("--decode-profile", help="profile(s) of decode workers")
    plan.add_argument("--trace", type=Path, required=True, help="a `pdcluster bench` JSONL trace")
    plan.add_argument("--rate", type=float, default=None,
                      help="rescale the trace's arrivals to this mean rate (requests/s)")
    plan.add_argument("--slo", required=True, type=slo_arg, metavar="KEY=MS,...",
                      help=SLO_HELP)
    plan.add_argument("--attainment", type=float, default=0.9,
                      help="share of requests that must meet --slo")
    plan.add_argument("--max-workers", type=int, default=4,
                      help="most workers a configuration may use")
    plan.add_argument("--modes", default="disaggregated,colocated",
                      help="comma-separated modes to try")
    plan.add_argument("--local-prefill-thresholds", default=str(defaults.LOCAL_PREFILL_THRESHOLD),
                      help="comma-separated thresholds to try (disaggregated)")
    plan.add_argument("--max-num-batched-tokens",
                      default=str(engine_defaults.MAX_NUM_BATCHED_TOKENS),
                      help="comma-separated step token budgets to try")
    plan.add_argument("--max-num-seqs", type=int, default=engine_defaults.MAX_NUM_SEQS,
                      help="most requests a worker runs at once")
    plan.add_argument("--model", default=None, metavar="PATH",
                      help="the model's folder (or .gguf file) the emitted `serve` command "
                           "serves; default: a placeholder `serve` refuses until replaced")
    plan.add_argument("--cost-per-hour-prefill", type=float, default=None,
                      help="cost of a prefill worker per hour (default: its accelerator's "
                           "list price in planner/data/prices.yaml x its TP, 1 for a CPU)")
    plan.add_argument("--cost-per-hour-decode", type=float, default=None,
                      help="cost of a decode (or colocated) worker per hour (default: as "
                           "for prefill)")
    plan.add_argument("--max-accelerators", type=int, default=None,
                      help="search every P+D split and TP degree per role (one profile per "
                           "degree) within this many accelerators, instead of --max-workers")
    plan.add_argument("--cost-per-accelerator-hour-prefill", type=float, default=None,
                      help="with --max-accelerators: cost of a prefill accelerator per hour "
                           "(default: its list price in planner/data/prices.yaml, 1 for a "
                           "CPU)")
    plan.add_argument("--cost-per-accelerator-hour-decode", type=float, default=None,
                      help="with --max-accelerators: cost of a decode accelerator per hour "
                           "(default: as for prefill)")
    plan.add_argument("--no-pareto", action="store_true",
                      help="with --max-accelerators: find only the pick's sustained rate, "
                           "not every simulated configuration's (no Pareto front)")
    plan.add_argument("--no-calibrate", action="store_true",
                      help="plan on the profiles as measured; by default a profile measured "
                           "on this machine is first scaled to its speed now (probe steps)")
    plan.add_argument("-o", "--output", type=Path, default=None, metavar="OUT.json",
                      help="write the plan document there")
    plan.add_argument("--json", action="store_true",
                      help="print the plan document (JSON) on stdout instead of the tables")
    plan.add_argument("--plot", type=Path, default=None,
                      help="OUT.png: goodput by split; OUT.front.png beside it: the Pareto "
                           "front and the recommended configuration's rate sweep")
    plan.add_argument("--validate", action="store_true",
                      help="serve the recommended config, the closest one the plan rejects and "
                           "their neighbours, replay the trace, and record measured "
                           "figures beside the predicted ones")
    plan.add_argument("--address", default=None, help="with --validate: an existing Ray cluster")
    plan.add_argument("--validate-configs", type=int, default=3,
                      help="with --validate: how many configs (the recommended and the closest "
                           "rejected one first, both served whatever the count)")
    plan.add_argument("--validate-calibration", choices=("serving", "bare"), default="serving",
                      help="with --validate: serving (default) calibrates the profile through "
                           "each served config (a probe, then a pilot trace like the plan's, "
                           "not its requests) and compares the measured figures with that "
                           "config predicted again; bare compares them with the plan's "
                           "prediction")
    plan.add_argument("--validate-pilot-requests", type=int, default=None,
                      help="with --validate-calibration serving: requests in the pilot trace "
                           "(default 20)")
    plan.set_defaults(func=run_plan)
    return plan


def run_plan(args: argparse.Namespace) -> int:
    from bench.cli import require_bench_extra
    from planner.plan import plan
    from planner.report import print_validation

    if args.plot is not None or args.validate:
        require_bench_extra("pdcluster plan --plot/--validate")
    if args.validate_pilot_requests is not None and args.validate_pilot_requests < 1:
        raise ValueError("--validate-pilot-requests: the pilot needs at least one request, "
                         f"got {args.validate_pilot_requests}")
    if args.no_pareto and args.max_accelerators is None:
        raise ValueError("--no-pareto applies to --max-accelerators (the split search's "
                         "sustained rates come with its rate bisection)")
    if args.max_accelerators is not None:
        if args.validate:
            raise ValueError("--validate serves on this machine: plan without "
                             "--max-accelerators")
        doc = run_budget_plan(args)
        _plots(doc, args.plot)
        _emit(args, doc, _show)
        return 0
    request = plan_request(args)
    measured_profiles = (request.prefill_profile, request.decode_profile)
    calibration: dict[str, Any] = {"applied": False, "reason": "--no-calibrate"}
    if not args.no_calibrate:
        from dataclasses import replace

        from planner.calibrate import calibrate_for_plan

        with notes.status("Calibrating the profiles to this machine's speed now"):
            prefill, decode, calibration = calibrate_for_plan(request.prefill_profile,
                                                              request.decode_profile)
        request = replace(request, prefill_profile=prefill, decode_profile=decode)
    with notes.status(f"Simulating {len(request.requests)} requests on every split"):
        doc = {**plan(request), "calibration": calibration}
    _plots(doc, args.plot)
    if args.validate:
        from commands.validate import PILOT_REQUESTS, validate

        doc = validate(doc, request, args.validate_configs, args.address,
                       (args.output or Path("plan.json")).with_suffix(".runs"),
                       args.validate_calibration, measured_profiles,
                       PILOT_REQUESTS if args.validate_pilot_requests is None
                       else args.validate_pilot_requests)
    def show(doc: dict[str, Any]) -> None:
        _show(doc)
        if args.validate:
            print_validation(doc)

    _emit(args, doc, show)
    return 0


def plan_request(args: argparse.Namespace) -> Any:
    """The PlanRequest the flags describe."""
    from planner.plan import PlanRequest, at_rate, load_trace
    from protocol.serving import Slo

    prefills, decodes = _profiles(args)
    if len(prefills) > 1 or len(decodes) > 1:
        raise ValueError("several profiles per role (TP degrees) need --max-accelerators")
    prefill, decode = prefills[0], decodes[0]
    slo = Slo.parse(args.slo, args.attainment)
    requests = load_trace(args.trace, decode.model)
    if args.rate is not None:
        requests = at_rate(requests, args.rate)
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    return PlanRequest(prefill, decode, requests, slo, args.max_workers, modes,
                       int_list(args.local_prefill_thresholds, "local-prefill-thresholds"),
                       int_list(args.max_num_batched_tokens, "max-num-batched-tokens"),
                       args.max_num_seqs,
                       {"prefill": _worker_price(prefill, args.cost_per_hour_prefill),
                        "decode": _worker_price(decode, args.cost_per_hour_decode)},
                       serve_model=args.model)


def run_budget_plan(args: argparse.Namespace) -> dict[str, Any]:
    """`plan --max-accelerators`: the search over splits and TP degrees per role."""
    from rich.progress import BarColumn, Progress, TimeElapsedColumn

    from planner.calibrate import calibrate_each
    from planner.plan import at_rate, load_trace
    from planner.search import BudgetRequest, profiles_by_tp, search
    from protocol.serving import Slo

    prefills, decodes = _profiles(args)
    calibration: dict[str, Any] = {"applied": False, "reason": "--no-calibrate"}
    if not args.no_calibrate:
        with notes.status("Calibrating the profiles to this machine's speed now"):
            prefills, decodes, calibration = calibrate_each(prefills, decodes)
    requests = load_trace(args.trace, decodes[0].model)
    if args.rate is not None:
        requests = at_rate(requests, args.rate)
    budgets = int_list(args.max_num_batched_tokens, "max-num-batched-tokens")
    thresholds = int_list(args.local_prefill_thresholds, "local-prefill-thresholds")
    request = BudgetRequest(
        profiles_by_tp(prefills), profiles_by_tp(decodes), requests,
        Slo.parse(args.slo, args.attainment), args.max_accelerators,
        {"prefill": _accelerator_price(prefills, args.cost_per_accelerator_hour_prefill),
         "decode": _accelerator_price(decodes, args.cost_per_accelerator_hour_decode)},
        tuple(m.strip() for m in args.modes.split(",") if m.strip()), budgets[0],
        args.max_num_seqs, thresholds[0], front=not args.no_pareto, serve_model=args.model)
    with Progress("[progress.description]{task.description}", BarColumn(),
                  "{task.completed}/{task.total}", TimeElapsedColumn(),
                  console=notes) as progress:
        task = progress.add_task("simulating", total=None)
        doc = search(request, lambda done, most: progress.update(task, completed=done,
                                                                  total=max(done, most)))
    s = doc["search"]
    notes.print(f"{s['within_budget']} configurations within {s['max_accelerators']} "
                f"accelerators: {s['pruned_by_throughput']} pruned by throughput, "
                f"{s['pruned_by_latency']} by unloaded latency; {s['simulated']} simulated "
                f"over {s['cost_levels']} cost levels in {s['seconds']:.0f} s")
    return {**doc, "calibration": calibration}


def _accelerator_price(profiles: list[Any], given: float | None) -> float:
    """One accelerator-hour of a role: the flag's price, else its profiles' list price
    (`planner.prices`; 1 for a CPU or an unlisted device)."""
    from planner.prices import UNPRICED, accelerator_price

    if given is not None:
        return given
    prices = {accelerator_price(p) for p in profiles}
    if len(prices) > 1:
        raise ValueError("one role's profiles are of devices with different list prices: "
                         "plan each accelerator separately, or give its "
                         "--cost-per-accelerator-hour-*")
    (price,) = prices
    return UNPRICED if price is None else price


def _worker_price(profile: Any, given: float | None) -> float:
    """A worker's cost per hour: the flag's, else its accelerator's list price x its TP
    (`planner.prices`)."""
    from planner.prices import worker_price

    return given if given is not None else worker_price(profile)


def _profiles(args: argparse.Namespace) -> tuple[list[Any], list[Any]]:
    """The prefill and the decode profiles the flags name."""
    from planner.profile import Profile

    if args.profile is None and (args.prefill_profile is None or args.decode_profile is None):
        raise ValueError("give --profile, or both --prefill-profile and --decode-profile")

    def load(text: str) -> list[Any]:
        return [Profile.load(Path(p.strip())) for p in text.split(",") if p.strip()]

    return load(args.prefill_profile or args.profile), load(args.decode_profile or args.profile)


def _emit(args: argparse.Namespace, doc: dict[str, Any], show: Any) -> None:
    """The plan: its tables (or with --json the document) on stdout; with -o, a file."""
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        show(doc)
    if args.output is not None:
        args.output.write_text(json.dumps(doc, indent=1))
        notes.print(f"wrote {args.output}")


def _plots(doc: dict[str, Any], plot: Path | None) -> None:
    """With --plot: goodput by split there, the Pareto front and the rate sweep beside it."""
    from planner.report import plot_front, plot_plan

    if plot is not None:
        plot_plan(doc, plot)
        plot_front(doc, plot.with_suffix(".front.png"))
        notes.print(f"wrote {plot} and {plot.with_suffix('.front.png')}")


def _show(doc: dict[str, Any]) -> None:
    """The plan's tables: its splits, the Pareto front and the rate sweep."""
    from planner.report import print_front, print_plan

    print_plan(doc)
    print_front(doc)

"""`pdcluster profile` and `pdcluster plan`: the planner's subcommands.

The planner is a library (`planner/`); these commands add what it must not import: real
workers for the KV transfer measurement (`commands.worker_pair`) and, for `--validate`,
configurations served for real (`commands.validate`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from engine import defaults as engine_defaults
from protocol import defaults
from protocol.serving import SLO_HELP

# `profile` reports on stdout (every column, piped or not); `plan` keeps stdout for the
# plan (its tables, or with --json its JSON) and shows progress and notes on stderr.
console = Console() if sys.stdout.isatty() else Console(width=1000)
notes = Console(stderr=True)


def slo_arg(text: str) -> str:
    """`--slo` on serve and plan, checked as it is parsed (`Slo.parse`, bench's too)."""
    from protocol.serving import Slo

    try:
        Slo.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_parsers(sub: Any) -> None:
    """Add `profile` and `plan` to the `pdcluster` subcommands."""
    profile = sub.add_parser("profile", help="measure a worker type on the real engine, or "
                             "model it from a hardware and model description (--analytic)")
    profile.add_argument("--model", default=None,
                         help="the model to measure (default smollm2); with --analytic, the "
                              "name the profile gives it (default: the config's)")
    profile.add_argument("--dtype", default=None,
                         help=f"default {engine_defaults.DTYPE}; with --analytic, the "
                              "config's (bfloat16, float16, fp8, float32)")
    profile.add_argument("--torch-threads", type=int, default=1,
                         help="intra-op threads of the measured worker")
    profile.add_argument("--transport", choices=["shm", "zmq", "torch"], default="shm",
                         help="KV transport whose transfer times are measured")
    profile.add_argument("--kv-cache-gb", type=float, default=engine_defaults.KV_CACHE_GB,
                         help="KV pool of the measured worker in GB")
    profile.add_argument("--block-size", type=int, default=engine_defaults.BLOCK_SIZE,
                         help="tokens per KV block")
    profile.add_argument("--repeats", type=int, default=3, help="timed repetitions a point")
    profile.add_argument("--quick", action="store_true", help="a smaller grid")
    profile.add_argument("--out", type=Path, required=True,
                         help="PROFILE.json (with several --tp: PROFILE.tpN.json each)")
    analytic = profile.add_argument_group("analytic (a step-time model, nothing measured)")
    analytic.add_argument("--analytic", action="store_true",
                          help="model the step times from --hardware and --model-config")
    analytic.add_argument("--hardware", default=None,
                          help="cpu (this machine, measured), a built-in accelerator "
                               "(H100-SXM, H100-PCIe, H200, B200, A100-80GB, L40S, MI300X) or "
                               "a YAML spec file")
    analytic.add_argument("--model-config", default=None,
                          help="a Hugging Face config.json (or its directory), or a shipped one: "
                               "llama-3-8b, llama-3-70b, qwen2.5-7b, mixtral-8x7b, smollm2")
    analytic.add_argument("--tp", default="1", help="comma-separated tensor-parallel degrees")
    analytic.add_argument("--kv-dtype", default=None, help="KV cache dtype (default: --dtype)")
    analytic.add_argument("--max-model-len", type=int, default=None,
                          help="longest prompt + output (None: the config's)")
    analytic.add_argument("--check-against", type=Path, default=None,
                          help="a measured PROFILE.json of the same model: write the step "
                               "model's error on its points to OUT.check.json")
    profile.set_defaults(func=run_profile)

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
    plan.add_argument("--cost-per-hour-prefill", type=float, default=1.0,
                      help="cost of a prefill worker per hour")
    plan.add_argument("--cost-per-hour-decode", type=float, default=1.0,
                      help="cost of a decode (or colocated) worker per hour")
    plan.add_argument("--max-accelerators", type=int, default=None,
                      help="search every P+D split and TP degree per role (one profile per "
                           "degree) within this many accelerators, instead of --max-workers")
    plan.add_argument("--cost-per-accelerator-hour-prefill", type=float, default=1.0,
                      help="with --max-accelerators: cost of a prefill accelerator per hour")
    plan.add_argument("--cost-per-accelerator-hour-decode", type=float, default=1.0,
                      help="with --max-accelerators: cost of a decode accelerator per hour")
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


def run_profile(args: argparse.Namespace) -> int:
    if args.analytic:
        return run_analytic_profile(args)
    if args.hardware or args.model_config:
        raise ValueError("--hardware and --model-config describe an --analytic profile")
    from rich.progress import BarColumn, Progress, TimeElapsedColumn

    from commands.worker_pair import transfer_samples
    from planner.measure import ProfileSettings, measure

    settings = ProfileSettings(args.model or "smollm2", args.dtype or engine_defaults.DTYPE,
                               args.torch_threads, args.transport,
                               args.kv_cache_gb, args.block_size, args.repeats, args.quick)
    with Progress("[progress.description]{task.description}", BarColumn(),
                  "{task.completed}/{task.total}", TimeElapsedColumn(),
                  console=console) as progress:
        profile = measure(settings, transfer_samples, progress)
    profile.save(args.out)
    errors = ", ".join(f"{k} {v['median']:.1%} (max {v['max']:.1%})"
                       for k, v in profile.fit_error.items())
    console.print(f"wrote {args.out}: {profile.num_blocks} KV blocks, load "
                  f"{profile.load_time_s:.1f} s; held-out fit error median: {errors}")
    return 0


def run_analytic_profile(args: argparse.Namespace) -> int:
    from planner.analytic import StepModel, analytic_profile
    from planner.specs import load_accelerator, load_model_shape

    if not args.hardware or not args.model_config:
        raise ValueError("--analytic needs --hardware and --model-config")
    shape = load_model_shape(args.model_config)
    accelerator = load_accelerator(args.hardware, args.torch_threads)
    dtype = args.dtype or ("float32" if args.hardware == "cpu" else shape.dtype)
    degrees = _ints(args.tp, "tp")
    if 0 in degrees:
        raise ValueError("tp: expected integers >= 1")
    written = 0
    for tp in degrees:
        model = StepModel(shape, accelerator, tp, dtype, args.kv_dtype or dtype)
        try:
            profile = analytic_profile(model, args.block_size, args.max_model_len,
                                       torch_threads=args.torch_threads, name=args.model)
        except ValueError as e:  # the weights do not fit: say so, go on to the next tp
            console.print(f"tp {tp}: skipped: {e}")
            continue
        written += 1
        out = args.out if len(degrees) == 1 else args.out.with_suffix(f".tp{tp}.json")
        profile.save(out)
        decode = model.step_time([(1024, 1, False)] * 32)
        console.print(f"wrote {out}: {shape.name} on {tp} x {accelerator.name} ({dtype}): "
                      f"{profile.kv_cache_gb:.1f} GiB of KV ({profile.num_blocks} blocks), "
                      f"2048-token prefill {1e3 * model.step_time([(0, 2048, True)]):.1f} ms, "
                      f"batch-32 decode at 1k context {1e3 * decode:.1f} ms")
        if args.check_against is not None:
            _check(model, args.check_against, out.with_suffix(".check.json"))
    return 0 if written else 1


def _check(model: Any, measured_path: Path, out: Path) -> None:
    from planner.analytic import check_against
    from planner.profile import Profile

    check = check_against(model, Profile.load(measured_path))
    out.write_text(json.dumps(check, indent=1))
    for source, label in (("step_model", "step model"), ("profile", "its fitted profile")):
        e = check["error"][source]
        console.print(f"{label} vs {measured_path}: median error {e['all']['median']:.1%} "
                      f"over {e['all']['points']} points (prefill {e['prefill']['median']:.1%},"
                      f" decode {e['decode']['median']:.1%}; max {e['all']['max']:.1%})")
    console.print(f"wrote {out}")


def _ints(text: str, name: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{name}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise ValueError(f"{name}: expected integers >= 0, got {text!r}")
    return values


def _profiles(args: argparse.Namespace) -> tuple[list[Any], list[Any]]:
    """The prefill and the decode profiles the flags name."""
    from planner.profile import Profile

    if args.profile is None and (args.prefill_profile is None or args.decode_profile is None):
        raise ValueError("give --profile, or both --prefill-profile and --decode-profile")

    def load(text: str) -> list[Any]:
        return [Profile.load(Path(p.strip())) for p in text.split(",") if p.strip()]

    return load(args.prefill_profile or args.profile), load(args.decode_profile or args.profile)


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
    budgets = _ints(args.max_num_batched_tokens, "max-num-batched-tokens")
    thresholds = _ints(args.local_prefill_thresholds, "local-prefill-thresholds")
    request = BudgetRequest(
        profiles_by_tp(prefills), profiles_by_tp(decodes), requests,
        Slo.parse(args.slo, args.attainment), args.max_accelerators,
        {"prefill": args.cost_per_accelerator_hour_prefill,
         "decode": args.cost_per_accelerator_hour_decode},
        tuple(m.strip() for m in args.modes.split(",") if m.strip()), budgets[0],
        args.max_num_seqs, thresholds[0], front=not args.no_pareto)
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
                       _ints(args.local_prefill_thresholds, "local-prefill-thresholds"),
                       _ints(args.max_num_batched_tokens, "max-num-batched-tokens"),
                       args.max_num_seqs,
                       {"prefill": args.cost_per_hour_prefill,
                        "decode": args.cost_per_hour_decode})


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



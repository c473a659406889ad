"""`pdcluster profile`: measure a worker type's step and transfer times on the real engine,
or model them from a hardware and model description (`--analytic`).

The planner is a library (`planner/`); the measurement needs what it must not import, real
workers for the KV transfer times (`commands.worker_pair`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from commands.arguments import int_list
from commands.console import console
from engine import defaults as engine_defaults


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register `profile` with the `pdcluster` subcommands.

    Args:
        sub: what `ArgumentParser.add_subparsers()` returned.

    Returns:
        The subcommand's parser.
    """
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
    return profile


def run_profile(args: argparse.Namespace) -> int:
    if args.analytic:
        return run_analytic_profile(args)
    if args.hardware or args.model_config:
        raise ValueError("--hardware and --model-config describe an --analytic profile")
    from rich.progress import BarColumn, Progress, TimeElapsedColumn

    from commands.worker_pair import transfer_samples
    from planner.measure import ProfileSettings, measure

    stdout = console()  # every column, piped or not
    settings = ProfileSettings(args.model or "smollm2", args.dtype or engine_defaults.DTYPE,
                               args.torch_threads, args.transport,
                               args.kv_cache_gb, args.block_size, args.repeats, args.quick)
    with Progress("[progress.description]{task.description}", BarColumn(),
                  "{task.completed}/{task.total}", TimeElapsedColumn(),
                  console=stdout) as progress:
        profile = measure(settings, transfer_samples, progress)
    profile.save(args.out)
    errors = ", ".join(f"{k} {v['median']:.1%} (max {v['max']:.1%})"
                       for k, v in profile.fit_error.items())
    stdout.print(f"wrote {args.out}: {profile.num_blocks} KV blocks, load "
                 f"{profile.load_time_s:.1f} s; held-out fit error median: {errors}")
    return 0


def run_analytic_profile(args: argparse.Namespace) -> int:
    from planner.analytic import StepModel, analytic_profile
    from planner.specs import load_accelerator, load_model_shape

    if not args.hardware or not args.model_config:
        raise ValueError("--analytic needs --hardware and --model-config")
    stdout = console()
    shape = load_model_shape(args.model_config)
    accelerator = load_accelerator(args.hardware, args.torch_threads)
    dtype = args.dtype or ("float32" if args.hardware == "cpu" else shape.dtype)
    degrees = int_list(args.tp, "tp")
    if 0 in degrees:
        raise ValueError("tp: expected integers >= 1")
    written = 0
    for tp in degrees:
        model = StepModel(shape, accelerator, tp, dtype, args.kv_dtype or dtype)
        try:
            profile = analytic_profile(model, args.block_size, args.max_model_len,
                                       torch_threads=args.torch_threads, name=args.model)
        except ValueError as e:  # the weights do not fit: say so, go on to the next tp
            stdout.print(f"tp {tp}: skipped: {e}")
            continue
        written += 1
        out = args.out if len(degrees) == 1 else args.out.with_suffix(f".tp{tp}.json")
        profile.save(out)
        decode = model.step_time([(1024, 1, False)] * 32)
        stdout.print(f"wrote {out}: {shape.name} on {tp} x {accelerator.name} ({dtype}): "
                     f"{profile.kv_cache_gb:.1f} GiB of KV ({profile.num_blocks} blocks), "
                     f"2048-token prefill {1e3 * model.step_time([(0, 2048, True)]):.1f} ms, "
                     f"batch-32 decode at 1k context {1e3 * decode:.1f} ms")
        if args.check_against is not None:
            _check(model, args.check_against, out.with_suffix(".check.json"))
    return 0 if written else 1


def _check(model: Any, measured_path: Path, out: Path) -> None:
    from planner.analytic import check_against
    from planner.profile import Profile

    stdout = console()
    check = check_against(model, Profile.load(measured_path))
    out.write_text(json.dumps(check, indent=1))
    for source, label in (("step_model", "step model"), ("profile", "its fitted profile")):
        e = check["error"][source]
        stdout.print(f"{label} vs {measured_path}: median error {e['all']['median']:.1%} "
                     f"over {e['all']['points']} points (prefill {e['prefill']['median']:.1%},"
                     f" decode {e['decode']['median']:.1%}; max {e['all']['max']:.1%})")
    stdout.print(f"wrote {out}")

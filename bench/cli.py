"""`pdcluster bench`: load a serving endpoint with a workload and report latency and throughput.

    pdcluster bench --address 127.0.0.1:50051 --rate 4 --num-requests 200 --out runs/pd
    pdcluster bench --backend openai --base-url http://127.0.0.1:8000/v1 --rate 4 \\
        --num-requests 200 --out runs/vllm
    pdcluster bench --compare runs/vllm/report.json runs/pd/report.json

Also `python -m bench.cli ...`. Requests are greedy with EOS ignored, so every output has
exactly the length asked for; prompts are random token ids (the same over both backends).
The exit status is 1 when any request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import sys
from contextlib import aclosing
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.serving_metrics import VLLM_METRICS, summarize
from bench.traces import ARRIVALS, WORKLOADS, WorkloadSpec, arrival_times, make_workload
from protocol.serving import (
    DEFAULT_VOCAB_RANGE,
    SLO_HELP,
    Slo,
    TraceRequest,
    read_trace,
    write_trace,
)

if TYPE_CHECKING:
    from bench.loadgen import LoadResult

DEFAULT_NUM_REQUESTS = 100
# Flags that shape a synthetic workload; a trace brings its own arrivals and lengths.
_WORKLOAD_FLAGS = ("workload", "prompt_len", "output_len", "num_prefix_groups", "prefix_len",
                   "rate", "arrival", "burstiness")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `bench` subcommand (its handler is `run`, set as `func`).

    Args:
        subparsers: what `ArgumentParser.add_subparsers()` returned.

    Returns:
        The subcommand's parser.
    """
    parser = subparsers.add_parser(
        "bench", help="load a serving endpoint and report TTFT/TPOT/ITL/E2E, goodput",
        description=__doc__)  # `pdcluster`'s formatter: raw description, defaults shown
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags.

    Args:
        parser: the parser to add them to.
    """
    target = parser.add_argument_group("target")
    target.add_argument("--backend", choices=["grpc", "openai"], default="grpc",
                        help="grpc: pdcluster's client; openai: any OpenAI-compatible server "
                             "(vLLM, SGLang, pdcluster's HTTP port) via streaming /completions")
    target.add_argument("--address", help="gRPC host:port (--backend grpc)")
    target.add_argument("--base-url", help="e.g. http://127.0.0.1:8000/v1 (--backend openai)")
    target.add_argument("--model", help="model name (--backend openai); default: the first "
                                        "one the server lists")
    target.add_argument("--api-key", default=os.environ.get("PDCLUSTER_API_KEY")
                        or os.environ.get("OPENAI_API_KEY"),
                        help="bearer token (both backends); default: $PDCLUSTER_API_KEY, "
                             "else $OPENAI_API_KEY")
    target.add_argument("--request-timeout", type=float, default=600.0,
                        help="seconds before a streaming request counts as failed")

    load = parser.add_argument_group("workload")
    load.add_argument("--workload", choices=WORKLOADS,
                      help="synthetic lengths (default synthetic)")
    load.add_argument("--prompt-len", type=_int_range, metavar="LO:HI",
                      help="prompt tokens, uniform (after the prefix for shared-prefix)")
    load.add_argument("--output-len", type=_int_range, metavar="LO:HI",
                      help="output tokens, uniform")
    load.add_argument("--num-prefix-groups", type=int, help="shared prefixes (default 4)")
    load.add_argument("--prefix-len", type=int, help="tokens per shared prefix (default 256)")
    load.add_argument("--vocab-range", type=_int_range, metavar="LO:HI",
                      default=DEFAULT_VOCAB_RANGE,
                      help="random prompt ids come from [LO, HI) (default %(default)s)")
    load.add_argument("--trace", type=Path, metavar="FILE.jsonl",
                      help="replay a trace (timestamp, prompt or prompt_len, output_len) "
                           "instead of a synthetic workload")
    load.add_argument("--num-requests", "--num-prompts", type=int,
                      help=f"requests to send (default {DEFAULT_NUM_REQUESTS}; a trace: all)")
    load.add_argument("--seed", type=int, default=0, help="seeds prompts and arrivals")

    arrivals = parser.add_argument_group("arrivals")
    arrivals.add_argument("--rate", "--request-rate", type=float,
                          help="mean requests/s (default: all at once; inf: all at once)")
    arrivals.add_argument("--arrival", choices=ARRIVALS,
                          help="inter-arrival law (default poisson; gamma with --burstiness)")
    arrivals.add_argument("--burstiness", type=float, metavar="SHAPE",
                          help="gamma inter-arrivals with this shape, as in vLLM: 1 is "
                               "Poisson, smaller is burstier, larger is smoother (inf: even "
                               "spacing); the gaps' coefficient of variation is 1/sqrt(SHAPE)")
    arrivals.add_argument("--max-concurrency", type=int,
                          help="at most this many requests in flight")
    arrivals.add_argument("--duration", type=float,
                          help="send nothing after this many seconds (in-flight ones finish)")

    out = parser.add_argument_group("report")
    out.add_argument("--slo", type=_slo, metavar="KEY=MS,...",
                     help=f"objectives for goodput and SLO attainment: {SLO_HELP}")
    out.add_argument("--goodput", nargs="+", metavar="KEY:MS",
                     help="vLLM's form of --slo: ttft:MS tpot:MS e2el:MS")
    out.add_argument("--percentile-metrics", default="ttft,tpot,itl", type=_metric_names,
                     help="for --save-result: metrics with mean/median/std/percentiles, "
                          "from ttft, tpot, itl, e2el (default %(default)s)")
    out.add_argument("--metric-percentiles", default="99", type=_percentiles,
                     help="for --save-result: comma-separated percentiles (default "
                          "%(default)s)")
    out.add_argument("--save-result", action="store_true",
                     help="also write vLLM's result JSON (as `vllm bench serve --save-result`)")
    out.add_argument("--result-dir", type=Path, default=Path("."),
                     help="folder of the vLLM result JSON (default: here)")
    out.add_argument("--result-filename",
                     help="file name of the vLLM result JSON (default: "
                          "pdcluster-{rate}qps-{date}.json)")
    out.add_argument("--out", type=Path, metavar="DIR",
                     help="write report.json, trace.jsonl, latency_cdf.png, throughput.png")
    out.add_argument("--label", help="the run's name in the report and comparisons")
    out.add_argument("--compare", type=Path, nargs="+", metavar="REPORT",
                     help="print these report.json files side by side (ratios against the "
                          "first) and exit")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark the flags describe (or the comparison).

    Args:
        args: parsed by a parser with `add_arguments`.

    Returns:
        The exit status: 0, or 1 when any request failed.

    Raises:
        ValueError: flags that do not fit together; the message says which.
    """
    require_bench_extra("pdcluster bench")
    from bench.report import (
        build_report,
        load_report,
        print_comparison,
        print_summary,
        write_report,
    )

    if args.compare:
        print_comparison([load_report(path) for path in args.compare])
        return 0
    _check_target(args)
    if args.goodput:
        if args.slo is not None:
            raise ValueError("--goodput and --slo: give one of them")
        args.slo = Slo.from_goodput(args.goodput)
    requests = _requests(args)
    config = _config(args)
    result, model = asyncio.run(_drive(args, requests))
    config["model"] = model
    summary = summarize(result.records, result.duration, args.slo)
    label = args.label or _default_label(args)
    print_summary(label, summary)
    if args.out:
        write_report(args.out, build_report(label, config, summary, result), result)
        write_trace(args.out / "trace.jsonl", requests[:len(result.records)])
    if args.save_result:
        _save_vllm_result(args, label, model, result)
    return 1 if summary["failed"] else 0


def _save_vllm_result(args: argparse.Namespace, label: str, model: str | None,
                      result: LoadResult) -> Path:
    from bench.report import vllm_result

    now = datetime.now()
    rate = "inf" if args.rate is None else args.rate
    settings = {"date": now.strftime("%Y%m%d-%H%M%S"), "endpoint_type": args.backend,
                "backend": args.backend, "label": label, "model_id": model,
                "tokenizer_id": model, "num_prompts": len(result.records),
                "request_rate": rate,
                "burstiness": 1.0 if args.burstiness is None else args.burstiness,
                "max_concurrency": args.max_concurrency}
    body = vllm_result(result, settings, args.percentile_metrics, args.metric_percentiles,
                       args.slo)
    name = args.result_filename or f"pdcluster-{rate}qps-{settings['date']}.json"
    path = args.result_dir / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body))
    print(f"vLLM-format result: {path}")
    return path


def require_bench_extra(command: str) -> None:
    """The load generator and the plots need the `bench` extra; say so before any work
    instead of a traceback after it.

    Raises:
        ValueError: a module of the extra is missing; the message says how to install it.
    """
    for module in ("httpx", "matplotlib"):
        if importlib.util.find_spec(module) is None:
            raise ValueError(f"{command} needs {module!r}, which comes with the bench "
                             "extra: pip install 'pdcluster[bench]'")


async def _drive(args: argparse.Namespace, requests: list[TraceRequest]
                 ) -> tuple[LoadResult, str | None]:
    from bench.loadgen import GrpcBackend, LoadOptions, OpenAIBackend, run_load, served_model

    options = LoadOptions(args.max_concurrency, args.duration, args.request_timeout)
    if args.backend == "grpc":
        async with aclosing(GrpcBackend(args.address, args.api_key)) as backend:
            return await run_load(backend, requests, options), args.model
    model = args.model or await served_model(args.base_url, args.api_key)
    async with aclosing(OpenAIBackend(args.base_url, model, args.api_key)) as backend:
        return await run_load(backend, requests, options), model


def _check_target(args: argparse.Namespace) -> None:
    if args.backend == "grpc" and not args.address:
        raise ValueError("--backend grpc needs --address host:port")
    if args.backend == "openai" and not args.base_url:
        raise ValueError("--backend openai needs --base-url http://host:port/v1")


def _requests(args: argparse.Namespace) -> list[TraceRequest]:
    if args.num_requests is not None and args.num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}")
    if args.trace:
        given = [f"--{name.replace('_', '-')}" for name in _WORKLOAD_FLAGS
                 if getattr(args, name) is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: not with --trace (it has its own arrivals "
                             "and lengths)")
        return read_trace(args.trace, args.vocab_range, args.seed)[:args.num_requests]
    knobs = {"kind": args.workload, "prompt_len": args.prompt_len,
             "output_len": args.output_len, "num_prefix_groups": args.num_prefix_groups,
             "prefix_len": args.prefix_len}
    spec = WorkloadSpec(vocab_range=args.vocab_range, seed=args.seed,
                        **{key: value for key, value in knobs.items() if value is not None})
    return make_workload(spec, _arrivals(args, args.num_requests or DEFAULT_NUM_REQUESTS))


def _arrivals(args: argparse.Namespace, num_requests: int) -> list[float]:
    if args.rate is None and (args.arrival or args.burstiness is not None):
        raise ValueError("--arrival and --burstiness need --rate")
    process = args.arrival or ("gamma" if args.burstiness is not None else "poisson")
    if args.burstiness is not None and process != "gamma":
        raise ValueError(f"--burstiness sets gamma inter-arrivals, not {process}")
    if args.burstiness is not None and not args.burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {args.burstiness}")
    rate = math.inf if args.rate is None else args.rate
    shape = 1.0 if args.burstiness is None else args.burstiness
    if math.isinf(shape):  # vLLM: infinitely smooth gamma gaps are even spacing
        process, shape = "fixed", 1.0
    # The trace generator takes the gaps' coefficient of variation: 1/sqrt(shape).
    return arrival_times(num_requests, rate, process, 1 / math.sqrt(shape), args.seed).tolist()


def _config(args: argparse.Namespace) -> dict[str, Any]:
    skip = ("func", "command", "compare", "api_key")
    config = {key: value for key, value in vars(args).items() if key not in skip}
    config["workload"] = None if args.trace else args.workload or "synthetic"
    config["slo"] = None if args.slo is None else args.slo.as_dict()
    config["started_at"] = datetime.now(UTC).isoformat(timespec="seconds")
    return config


def _default_label(args: argparse.Namespace) -> str:
    workload = args.trace.name if args.trace else args.workload or "synthetic"
    return f"{args.backend} {workload}"


def _int_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    try:
        bounds = (int(low), int(high or low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI or N, got {text!r}") from None
    if bounds[0] > bounds[1]:
        raise argparse.ArgumentTypeError(f"LO must be <= HI, got {text!r}")
    return bounds


def _metric_names(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in VLLM_METRICS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected names from {', '.join(VLLM_METRICS)}, "
                                         f"got {text!r}")
    return names


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(p) for p in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}"
                                         ) from None
    if not values or any(not 0 < p < 100 for p in values):
        raise argparse.ArgumentTypeError(f"percentiles must be in (0, 100), got {text!r}")
    return values


def _slo(text: str) -> Slo:
    try:
        return Slo.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.cli`: the same flags as `pdcluster bench`."""
    parser = argparse.ArgumentParser(prog="python -m bench.cli", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""`pdcluster serve`: start the cluster and its gRPC + OpenAI endpoints.

Its flags build one `ServeOptions` (`cluster.serve`): per model, the pools' `ClusterConfig`
and the router's `RouterConfig`; with `--autoscale`, the planner's autoscaling policy;
with `--detach`, the front door runs as a detached Ray actor (`cluster.frontdoor`). Every
flag also reads `$PDCLUSTER_<FLAG>` and the `--config` file (`config_layers`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from commands.arguments import slo_arg, threads_arg
from engine import defaults as engine_defaults
from protocol import defaults
from protocol.logs import LOG_FORMATS, LOG_LEVELS
from protocol.serving import SLO_HELP

if TYPE_CHECKING:
    from cluster.config_file import Layers

# `docker run IMAGE serve ...` must listen on every interface; the image sets this.
HOST_ENV = "PDCLUSTER_HOST"

# The `serve` flags that build one worker: shared by both pools unless a pool's section of
# the config file sets them (`cluster.config_file`). Adding one is one `add_argument` in
# this group, its `dest` a `WorkerSpec` field.
WORKER_GROUP = "per-worker settings (a config file's prefill: and decode: sections may set " \
               "them per pool)"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register `serve` with the `pdcluster` subcommands.

    Args:
        sub: what `ArgumentParser.add_subparsers()` returned.

    Returns:
        The subcommand's parser.
    """
    serve = sub.add_parser("serve", help="start the cluster and its gRPC + OpenAI endpoints",
                           epilog="Every flag also reads $PDCLUSTER_<FLAG> (--max-num-seqs:\n"
                                  "$PDCLUSTER_MAX_NUM_SEQS) and the --config file; the command\n"
                                  "line wins over the environment, which wins over the file.")
    serve.add_argument("--config", type=Path, default=None, metavar="FILE.yaml",
                       help="YAML file of serve's flags (long names without the dashes: "
                            "'port: 8000') and per-pool sections 'prefill:' and 'decode:' "
                            "(replicas, resource and any per-worker setting); see "
                            "docs/operators.md")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="the model, as `vllm serve MODEL` takes it (or --model)")
    serve.add_argument("--model", default="smollm2",
                       help="model name (smollm2, tiny), HF directory or .gguf file")
    # None: not given (`_resolve_split` fills them: the planner's pick, else SPLIT_DEFAULTS).
    serve.add_argument("--mode", choices=["disaggregated", "colocated"], default=None,
                       help="separate prefill and decode pools, or one pool of mixed workers "
                            "(default disaggregated; with none of --mode, --prefill and "
                            "--decode, and --slo, --profile and --trace, the planner's pick)")
    serve.add_argument("--prefill", type=int, default=None, help="prefill workers (default 1)")
    serve.add_argument("--decode", type=int, default=None,
                       help="decode (or colocated) workers (default 1)")
    serve.add_argument("--transport", choices=["shm", "zmq", "torch", "mooncake"],
                       default="shm",
                       help="KV transport (shm falls back to zmq across hosts; mooncake: "
                            "Mooncake's Transfer Engine, pip install 'pdcluster[mooncake]')")
    serve.add_argument("--mooncake-protocol", choices=["auto", "tcp", "rdma"], default="auto",
                       help="what --transport mooncake speaks; auto: rdma where the node "
                            "lists an RDMA device, else tcp (NICs are picked by the engine)")
    serve.add_argument("--address", default=None,
                       help="existing Ray cluster ('auto', 'ray://host:10001'); "
                            "None: embedded local Ray")
    serve.add_argument("--host", default="127.0.0.1",
                       help=f"interface of the front doors (${HOST_ENV} in the image)")
    serve.add_argument("--worker-host", default=None,
                       help="address workers and the router bind for ZMQ and KV; 'auto' "
                            "(each node's IP) with --address, else 127.0.0.1")
    serve.add_argument("--prefill-resource", default=None, metavar="NAME",
                       help="Ray custom resource each prefill worker asks a sliver of, so the "
                            "pool runs only on nodes started with ray start --resources "
                            "'{\"NAME\": N}' (None: pd_prefill where a node offers it)")
    serve.add_argument("--decode-resource", default=None, metavar="NAME",
                       help="the same for decode (and colocated) workers (None: pd_decode "
                            "where offered)")
    serve.add_argument("--internal-auth", choices=["auto", "curve", "off"], default="auto",
                       help="internal ZMQ sockets (router <-> workers, KV transfer): 'curve' "
                            "encrypts them and admits only holders of the cluster's key; "
                            "'auto' is 'curve' unless they are all on loopback of one node")
    serve.add_argument("--grpc-port", type=int, default=50051, help="gRPC port (0: any free)")
    serve.add_argument("--http-port", "--port", type=int, default=8000,
                       help="OpenAI HTTP port (--port, as in vLLM; 0: any free)")
    serve.add_argument("--served-model-name", default=None,
                       help="the model's name in the API and the metrics (None: --model)")
    serve.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt + output (None: the model's and the KV pool's "
                            "limit)")
    serve.add_argument("--local-prefill-threshold", type=int,
                       default=defaults.LOCAL_PREFILL_THRESHOLD,
                       help="uncached prompts this short prefill on the decode worker")
    serve.add_argument("--policy", choices=["continuous", "static"], default="continuous",
                       help="batching policy of every worker (static: for comparison)")
    serve.add_argument("--slo", default=None, type=slo_arg, metavar="KEY=MS,...",
                       help=f"{SLO_HELP}; what --autoscale meets, and its TTFT bound orders "
                            "each worker's waiting prompts (--scheduling-policy)")
    serve.add_argument("--scheduling-policy", choices=["deadline", "fcfs"],
                       default="deadline",
                       help="order of the prompts waiting on a worker: deadline, those that "
                            "can still meet --slo's TTFT bound behind the ones ahead first "
                            "(earliest deadline first; late ones after, promoted once they "
                            "have waited twice the bound: none starves), arrival order "
                            "without a TTFT bound; fcfs, arrival order always")
    serve.add_argument("--max-running", type=int, default=defaults.MAX_RUNNING,
                       help="requests the router runs at once; more wait in its queue")
    serve.add_argument("--max-queue", type=int, default=defaults.MAX_QUEUE,
                       help="requests that may wait in the router's queue; more get 429")
    serve.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                       help="sampling defaults for what a request omits (temperature, "
                            "top_p, top_k, min_p, repetition_penalty, max_tokens), as vLLM: "
                            "auto, the model folder's generation_config.json; vllm, none; "
                            "or a FOLDER holding a generation_config.json")
    serve.add_argument("--override-generation-config", default=None, metavar="JSON",
                       help="generation_config.json keys over those defaults, e.g. "
                            "'{\"temperature\": 0.5}' (temperature, top_p, top_k, min_p, "
                            "repetition_penalty, max_new_tokens; null removes one); default: "
                            "none")
    worker = serve.add_argument_group(WORKER_GROUP)
    worker.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                        default="auto",
                        help="model and KV dtype; auto: bfloat16 on CUDA and on CPUs with "
                             "native bf16 (AVX512-BF16/AMX), else float32 (the exact "
                             "reference)")
    worker.add_argument("--kv-cache-gb", dest="kv_cache_memory_gb", type=float, default=None,
                        metavar="GB", help="KV pool per worker in GB (None: "
                             f"{engine_defaults.KV_CACHE_GB:g} on CPU; on CUDA sized by "
                             "--gpu-memory-utilization)")
    worker.add_argument("--kv-cache-dtype", choices=["auto", "int8"], default="auto",
                        help="KV pages: auto (the model's dtype) or int8 (a scale per token "
                             "and KV head: about 2x the blocks of bf16 per GB, half the bytes "
                             "per transfer; CPU/torch attention); both pools must match")
    worker.add_argument("--speculative-config", type=speculative_arg, default=None,
                        metavar="JSON",
                        help="speculative decoding on decode and colocated workers, vLLM's "
                             "keys: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                             "\"prompt_lookup_max\": 4}' or '{\"method\": \"draft\", "
                             "\"model\": \"self\", \"draft_layers\": 8, "
                             "\"num_speculative_tokens\": 3}' (or \"model\": a draft model "
                             "directory sharing the target's tokenizer, without "
                             "draft_layers); prefill workers ignore it")
    worker.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                        help="share of the GPU's memory a worker may hold (weights + KV); "
                             "the KV pool gets what the weights leave (None: "
                             f"{engine_defaults.GPU_MEMORY_UTILIZATION:g} on CUDA unless "
                             "--kv-cache-gb is given); only for workers with a GPU")
    worker.add_argument("--max-num-batched-tokens", type=int,
                        default=engine_defaults.MAX_NUM_BATCHED_TOKENS,
                        help="token budget of one engine step")
    worker.add_argument("--max-num-seqs", type=int, default=engine_defaults.MAX_NUM_SEQS,
                        help="most requests a worker runs at once")
    worker.add_argument("--torch-threads", type=threads_arg, default=1, metavar="N|auto",
                        help="compute threads per worker (per rank with "
                             "--tensor-parallel-size); auto: on CPU, the cores the other "
                             "processes leave free, re-measured each second, so workers on "
                             "one host lend each other the cores they leave idle (e.g. a "
                             "prefill worker between prompts to a busy decode worker)")
    worker.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="ranks each worker's model is split over (vLLM's flag; gloo on "
                             "CPU, NCCL on GPU): rank 0 in the worker's process, the others "
                             "its child processes; prefill and decode pools of any sizes "
                             "exchange KV; give each worker the CPUs or GPUs of all its "
                             "ranks (--num-cpus-per-worker, --num-gpus-per-worker)")
    worker.add_argument("--tp-kv-pages", choices=engine_defaults.TP_KV_PAGES, default="auto",
                        help="where a tensor-parallel worker's ranks keep their KV heads: "
                             "shared (CPU: one pool in shared memory every rank maps), "
                             "private (each rank its own memory, as on GPU; a prefill or "
                             "decode worker mirrors every rank's heads on rank 0 for KV "
                             "transfer: one gather a layer each step, one scatter a "
                             "received prompt); auto: shared on CPU when the KV heads "
                             "divide among the ranks, else private")
    worker.add_argument("--prefix-caching", "--enable-prefix-caching",
                        dest="enable_prefix_caching", action=argparse.BooleanOptionalAction,
                        default=True, help="reuse cached prompt blocks")
    worker.add_argument("--num-cpus-per-worker", type=float, default=1.0,
                        help="Ray CPUs each worker reserves")
    worker.add_argument("--num-gpus-per-worker", type=float, default=0.0,
                        help="Ray GPUs each worker reserves (a fraction shares a GPU)")
    serve.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                       help="level of the front door's and every worker's log; INFO includes "
                            "one line per finished request (ids, token counts, latencies, "
                            "workers; never the text)")
    serve.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                       help="json: one object per line, for log shippers (a line about a "
                            "request carries its request_id and trace_id)")
    serve.add_argument("--log-prompts", action="store_true",
                       help="the per-request log line also carries the prompt and output "
                            "text (off: never)")
    serve.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                       help="export OpenTelemetry traces over OTLP/gRPC to this collector, "
                            "e.g. http://localhost:4317 (OTEL_EXPORTER_OTLP_* variables "
                            "apply; needs pdcluster[tracing]); default: no tracing")
    serve.add_argument("--sse-keepalive", type=float, default=15.0, metavar="SECONDS",
                       help="an HTTP stream silent this long (a long prefill or queue) sends "
                            "an SSE comment so proxies keep it open; 0 turns it off")
    serve.add_argument("--metrics-compat", choices=["vllm"], default=None,
                       help="also export vLLM's metric names (vllm:num_requests_waiting, "
                            "vllm:kv_cache_usage_perc, ...) for existing dashboards and "
                            "autoscalers")
    _add_security_flags(serve)
    serve.set_defaults(serve_parser=serve)  # `cli.parse_args` layers its defaults
    auto = serve.add_argument_group("planning and autoscaling (the planner on a trace at "
                                    "start, on the router's recent window live)")
    auto.add_argument("--autoscale", action="store_true",
                      help="resize the pools live to meet --slo (needs --profile)")
    auto.add_argument("--profile", type=Path, default=None,
                      help="PROFILE.json of the workers (`pdcluster profile`)")
    auto.add_argument("--trace", type=Path, default=None, metavar="TRACE.jsonl",
                      help="a workload like the one to serve (a `pdcluster bench` JSONL "
                           "trace): with --slo and --profile and none of --mode, --prefill "
                           "and --decode, serve starts the mode and split the planner "
                           "predicts to sustain the highest rate within --slo on this "
                           "machine's cores (or --max-workers), or says why it did not")
    auto.add_argument("--attainment", type=float, default=0.9,
                      help="share of requests that must meet --slo")
    auto.add_argument("--min-workers", type=int, default=None,
                      help="fewest workers (None: 2 disaggregated, 1 colocated)")
    auto.add_argument("--max-workers", type=int, default=None,
                      help="most workers (None: the starting size, at least 2)")
    auto.add_argument("--min-prefill", type=int, default=0,
                      help="fewest prefill workers (disaggregated); 0: the autoscaler may "
                           "leave prefill to the decode workers, as the planner may")
    auto.add_argument("--autoscale-interval", type=float, default=10.0, help="seconds")
    auto.add_argument("--autoscale-window", type=float, default=60.0, help="seconds")
    auto.add_argument("--autoscale-cooldown", type=float, default=60.0, help="seconds")
    auto.add_argument("--autoscale-min-requests", type=int, default=10,
                      help="fewest requests a decision looks at: while the window holds "
                           "fewer, it reaches back by whole windows")
    auto.add_argument("--autoscale-reuse", type=float, default=0.1,
                      help="hold without simulating while the window's rate and mean "
                           "lengths stay within this fraction of the last simulated hold's "
                           "(0: simulate every decision)")
    serve.add_argument("--detach", action="store_true",
                       help="run the front door and the workers as detached Ray actors on the "
                            "Ray cluster at --address, then exit: serving survives this "
                            "process, Ray restarts a dead front door, `pdcluster stop` ends it")
    serve.add_argument("--name", default="pdcluster",
                       help="with --detach: the cluster's name (its Ray actors' prefix)")
    serve.set_defaults(func=_serve)
    return serve


def _add_security_flags(serve: argparse.ArgumentParser) -> None:
    """`serve`: keys, TLS, drain and deadlines."""
    serve.add_argument("--api-key", default=os.environ.get("PDCLUSTER_API_KEY"),
                       help="key every request must present (HTTP 'Authorization: Bearer', "
                            "gRPC metadata 'authorization'); default $PDCLUSTER_API_KEY")
    serve.add_argument("--admin-key", default=os.environ.get("PDCLUSTER_ADMIN_KEY"),
                       help="key ScalePool needs; default $PDCLUSTER_ADMIN_KEY")
    serve.add_argument("--allow-unauthenticated", action="store_true",
                       help="bind a non-loopback --host without any key")
    serve.add_argument("--tls-cert", "--ssl-certfile", default=None,
                       help="server certificate (PEM), both doors")
    serve.add_argument("--tls-key", "--ssl-keyfile", default=None,
                       help="its private key (PEM)")
    serve.add_argument("--tls-client-ca", "--ssl-ca-certs", default=None,
                       help="CA (PEM) client certificates must chain to: mutual TLS, every "
                            "client presents one (vLLM's --ssl-ca-certs with "
                            "--ssl-cert-reqs 2)")
    serve.add_argument("--drain-timeout", type=float, default=defaults.DRAIN_TIMEOUT_S,
                       help="seconds running requests get to finish on SIGTERM or when their "
                            "worker is scaled away (then they move or are aborted)")
    serve.add_argument("--request-timeout", type=float, default=None,
                       help="longest a request may run, queue included (a shorter gRPC "
                            "deadline wins); default: no limit")
    serve.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                       help="a Jinja chat template (a file, or the template itself) used in "
                            "place of the tokenizer's")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="accepted for vLLM's command lines: tool_choice 'auto' is always "
                            "served where the chat template writes Hermes <tool_call> blocks")
    serve.add_argument("--tool-call-parser", choices=["hermes"], default="hermes",
                       help="how 'auto' tool calls are parsed from the text (Hermes only)")
    serve.add_argument("--no-migration", action="store_true",
                       help="end a dead worker's requests with an error instead of moving "
                            "them to another worker")


def speculative_arg(text: str) -> str:
    """`--speculative-config`, checked as it is parsed (a bad key fails here, not in a
    worker)."""
    from engine.spec_decode import SpeculativeConfig

    try:
        SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _serve(args: argparse.Namespace) -> int:
    import logging

    from router.auth import SecurityConfig, check_bind

    # Refused before the runtime is imported (seconds): a flag error answers at once.
    security = SecurityConfig(api_key=args.api_key, admin_key=args.admin_key,
                              tls_cert=args.tls_cert, tls_key=args.tls_key,
                              tls_client_ca=args.tls_client_ca)
    check_bind(args.host, security, args.allow_unauthenticated)

    from cluster.serve import ServeOptions, check_tensor_parallel_sizes, run
    from engine.hardware import isa_cap
    from protocol.logs import configure_logging
    from protocol.tracing import TracingConfig

    isa_cap()  # a bad PDCLUSTER_CPU_ISA fails here, not in every worker
    try:
        tracing = TracingConfig.from_flag(args.otlp_traces_endpoint)
    except RuntimeError as exc:  # OpenTelemetry not installed: say what to install
        raise ValueError(str(exc)) from None
    per_model = _per_model(args)
    if len(per_model) == 1:
        _resolve_split(per_model[0])
        args = per_model[0]
    for flag, given in (("--autoscale", args.autoscale), ("--detach", args.detach)):
        if given and len(per_model) > 1:
            raise ValueError(f"{flag} serves one model; this config serves {len(per_model)}")
    models = []
    for i, model_args in enumerate(per_model):
        try:
            models.append(_served_model(model_args, tracing))
        except ValueError as e:
            if len(per_model) == 1:
                raise
            raise ValueError(f"models.{i} ({model_args.model}): {e}") from None
    options = ServeOptions(models[0].cluster, args.address, args.host, args.grpc_port,
                           args.http_port, models[0].router,
                           security=security,
                           allow_unauthenticated=args.allow_unauthenticated,
                           drain_timeout_s=args.drain_timeout,
                           metrics_compat=args.metrics_compat,
                           autoscaler=_autoscaler(args), more_models=tuple(models[1:]))
    for model in models:
        check_tensor_parallel_sizes(model.cluster)
    configure_logging(args.log_level, args.log_format)
    logging.getLogger("cluster.autoscaler").setLevel(logging.INFO)  # each decision, its reason
    if args.detach:
        return _serve_detached(options, args.name)
    asyncio.run(run(options))
    return 0


SPLIT_DEFAULTS = {"mode": "disaggregated", "prefill": 1, "decode": 1}


def _resolve_split(args: argparse.Namespace) -> None:
    """Fill in `--mode`, `--prefill` and `--decode`: as given; with none given, the
    planner's pick for this machine when `--slo`, `--profile` and `--trace` say what to
    plan for (`_planned_split`); else `SPLIT_DEFAULTS` (1P+1D). Says which, and why."""
    if all(getattr(args, key) is None for key in SPLIT_DEFAULTS):
        missing = [flag for flag, value in (("--slo", args.slo), ("--profile", args.profile),
                                            ("--trace", args.trace)) if value is None]
        if not missing:
            picked, why = _planned_split(args)
            print(why, flush=True)
            if picked is not None:
                args.mode, args.prefill, args.decode = picked
        elif len(missing) < 3:
            print(f"serving the default 1P+1D: the planner picks a split from --slo, "
                  f"--profile and --trace, and {' and '.join(missing)} "
                  f"{'is' if len(missing) == 1 else 'are'} not given", flush=True)
    for key, value in _split(args).items():
        setattr(args, key, value)


def _split(args: argparse.Namespace) -> dict[str, Any]:
    """`--mode`, `--prefill` and `--decode` as given, `SPLIT_DEFAULTS` where not (a config
    file's `models:` entry, or args `_resolve_split` has not seen)."""
    return {key: value if getattr(args, key) is None else getattr(args, key)
            for key, value in SPLIT_DEFAULTS.items()}


def _planned_split(args: argparse.Namespace) -> tuple[tuple[str, int, int] | None, str]:
    """The split that serves `--trace` within `--slo` at the highest rate on this machine.

    The planner simulates every mode and split of exactly the machine's workers (its cores
    over `--torch-threads`, at least 2, or `--max-workers`: on one machine idle cores buy
    nothing) on the `--profile`, and the one that sustains the highest rate within the SLO
    wins (ties: the trace's goodput).

    Returns:
        (mode, prefill workers, decode workers), or None when no split meets the SLO at
        the trace's rate; and the line that says so.
    """
    from planner.plan import PlanRequest, label, load_trace, plan
    from planner.profile import Profile, check_same_model
    from protocol.serving import Slo
    from protocol.slo import ATTAINMENT, GOODPUT

    profile = Profile.load(args.profile)
    check_same_model([profile], args.model)
    threads = args.torch_threads or 1
    workers = args.max_workers or max(2, (os.cpu_count() or 1) // threads)
    request = PlanRequest(profile, profile, load_trace(args.trace, profile.model),
                          Slo.parse(args.slo, args.attainment), workers,
                          thresholds=(args.local_prefill_threshold,),
                          budgets=(args.max_num_batched_tokens,),
                          max_num_seqs=args.max_num_seqs, sweep_rates=False)
    configs = [c for c in plan(request)["configs"]
               if c["prefill"] * (c["mode"] == "disaggregated") + c["decode"] == workers]
    where = f"{workers} workers of {threads} thread(s)"
    good = [c for c in configs if c["meets_slo"]]
    if not good:
        best = max(configs, key=lambda c: c["predicted"][ATTAINMENT])
        return None, (f"serving the default 1P+1D: no split of {where} meets --slo on "
                      f"{args.trace} by the profile (the best, {label(best)}, "
                      f"{best['predicted'][ATTAINMENT]:.0%} of requests within it)")
    pick = max(good, key=lambda c: (c["predicted"].get("max_rate_rps") or 0,
                                    c["predicted"][GOODPUT]))
    rate = pick["predicted"].get("max_rate_rps")
    return ((pick["mode"], pick["prefill"], pick["decode"]),
            f"serving {label(pick)}, the planner's split for {where}, --slo and "
            f"{args.trace}: {len(good)} of {len(configs)} splits meet it at the trace's "
            f"rate, this one up to {'?' if rate is None else f'{rate:.2f}'} req/s")


def _per_model(args: argparse.Namespace) -> list[argparse.Namespace]:
    """The flags of each model served: `args` itself, or with a config file's `models:`,
    one copy per entry with the entry's values and pool sections over the shared ones."""
    from cluster.config_file import POOLS

    entries = getattr(args, "model_layers", None)
    if not entries:
        return [args]
    shared = getattr(args, "pool_overrides", {})
    return [argparse.Namespace(**{**vars(args), **entry.defaults, "pool_overrides": {
        pool: {**shared.get(pool, {}), **entry.pools.get(pool, {})} for pool in POOLS}})
        for entry in entries]


def _served_model(args: argparse.Namespace, tracing: Any) -> Any:
    """One model's pools and router settings from its flags."""
    from cluster.config import TRANSPORTS, ClusterConfig
    from cluster.serve import ServedModel
    from engine import parse_generation_override
    from protocol.logs import LogConfig
    from router.router import RouterConfig

    check_model_given(args.model)
    split = _split(args)
    shared: dict[str, Any] = {"policy": args.policy, "max_model_len": args.max_model_len}
    if args.transport == "mooncake":
        from kv_transfer.transports.mooncake import check_installed

        try:
            check_installed()
        except RuntimeError as exc:
            raise ValueError(str(exc)) from None
        shared["mooncake_protocol"] = args.mooncake_protocol
    cluster = ClusterConfig(
        model=args.model, mode=split["mode"], num_prefill=split["prefill"],
        num_decode=split["decode"],
        transports=TRANSPORTS[args.transport],
        host=args.worker_host or ("auto" if args.address else "127.0.0.1"),
        local_prefill_threshold=args.local_prefill_threshold,
        drain_timeout_s=args.drain_timeout, migrate=not args.no_migration,
        internal_auth=args.internal_auth, tracing=tracing,
        log=LogConfig(args.log_level, args.log_format), ttft_slo_s=_ttft_slo_s(args),
        prefill=_pool_spec(args, "prefill", shared), decode=_pool_spec(args, "decode", shared))
    router = RouterConfig(max_running=args.max_running, max_queue=args.max_queue,
                          served_model_name=args.served_model_name,
                          request_timeout_s=args.request_timeout,
                          sse_keepalive_s=args.sse_keepalive or None,
                          log_prompts=args.log_prompts,
                          generation_config=args.generation_config,
                          override_generation_config=parse_generation_override(
                              args.override_generation_config),
                          chat_template=chat_template_arg(args.chat_template))
    return ServedModel(cluster, router)


def check_model_given(model: str) -> None:
    """Refuse the placeholder `pdcluster plan` writes when it is not told the model's
    folder, before anything starts.

    Raises:
        ValueError: `model` is that placeholder, saying what to put there.
    """
    from planner.deploy import MODEL_PLACEHOLDER

    if model == MODEL_PLACEHOLDER:
        raise ValueError(f"--model {MODEL_PLACEHOLDER} is the placeholder `pdcluster plan` "
                         "writes without --model: replace it with the model's folder (a "
                         "Hugging Face directory) or .gguf file, or plan again with "
                         "--model PATH")


def chat_template_arg(value: str | None) -> str | None:
    """`--chat-template`: a file's text, or the value itself where it is a Jinja template.

    Raises:
        ValueError: neither a readable file nor a template.
    """
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")


def _ttft_slo_s(args: argparse.Namespace) -> float | None:
    """The TTFT bound workers order waiting prompts by: --slo's tightest, in seconds, under
    --scheduling-policy deadline; else None (arrival order)."""
    if args.slo is None or args.scheduling_policy != "deadline":
        return None
    from protocol.serving import Slo

    bound = Slo.parse(args.slo).bound("ttft")
    return None if bound is None else bound / 1000


def _pool_spec(args: argparse.Namespace, pool: str, shared: dict[str, Any]) -> Any:
    """One pool's spec: the shared per-worker flags, then its config file section."""
    from cluster.config import PoolSpec

    values = {dest: getattr(args, dest) for dest in _worker_dests(args.serve_parser)}
    values.update(getattr(args, "pool_overrides", {}).get(pool, {}))
    return PoolSpec(num_cpus=values.pop("num_cpus_per_worker"),
                    num_gpus=values.pop("num_gpus_per_worker"),
                    resource=values.pop("resource", getattr(args, f"{pool}_resource")),
                    engine={**shared, **values})


def _serve_detached(options: Any, name: str) -> int:
    """`serve --detach`: start the cluster as detached Ray actors, print its endpoints and
    exit; it serves on until `pdcluster stop` (`cluster.frontdoor`)."""
    from cluster.frontdoor import launch
    from cluster.serve import announce

    endpoints = launch(options, name)
    if endpoints["existing"]:
        print(f"{name!r} already runs: its settings are kept (`pdcluster stop --name {name}` "
              f"first to change them)", flush=True)
    announce(options, endpoints["grpc_port"], endpoints["http_port"])
    print(f"detached as {name!r} (Ray namespace pdcluster): `pdcluster stop --name {name}` "
          f"stops it", flush=True)
    return 0


def _autoscaler(args: argparse.Namespace) -> Any:
    """The autoscaling policy `serve --autoscale` asked for, or None."""
    if not args.autoscale:
        return None
    from planner.autoscale_policy import Autoscaler, AutoscalerConfig
    from planner.profile import Profile, check_same_model
    from protocol.serving import Slo

    if args.profile is None or args.slo is None:
        raise ValueError("--autoscale needs --profile and --slo")
    profile = Profile.load(args.profile)
    check_same_model([profile], args.model)
    split = _split(args)
    mode = split["mode"]
    low = split["prefill"] + split["decode"] if mode == "disaggregated" else split["decode"]
    config = AutoscalerConfig(
        Slo.parse(args.slo, args.attainment), mode,
        min_workers=args.min_workers or (2 if mode == "disaggregated" else 1),
        max_workers=args.max_workers or max(low, 2), min_prefill=args.min_prefill,
        interval_s=args.autoscale_interval,
        window_s=args.autoscale_window, cooldown_s=args.autoscale_cooldown,
        min_requests=args.autoscale_min_requests, reuse_tolerance=args.autoscale_reuse,
        local_prefill_threshold=args.local_prefill_threshold,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs)
    return Autoscaler(config, profile, profile)


def _worker_dests(serve: argparse.ArgumentParser) -> list[str]:
    return [a.dest for a in _worker_actions(serve)]


def _worker_actions(serve: argparse.ArgumentParser) -> list[argparse.Action]:
    (group,) = [g for g in serve._action_groups if g.title == WORKER_GROUP]
    return list(group._group_actions)


def config_layers(args: argparse.Namespace) -> Layers:
    """What the `--config` file (or `$PDCLUSTER_CONFIG`) and the `PDCLUSTER_*` variables
    set under the command line (`cluster.config_file`); an error in them exits with code 2,
    as argparse's do."""
    from cluster.config_file import ConfigError, layers

    serve = args.serve_parser
    path = args.config or (Path(os.environ["PDCLUSTER_CONFIG"])
                           if os.environ.get("PDCLUSTER_CONFIG") else None)
    try:
        return layers(serve, _worker_actions(serve), path, os.environ)
    except ConfigError as e:
        serve.exit(2, f"{serve.prog}: error: {e}\n")

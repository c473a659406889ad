"""The `pdcluster` command line: serve, generate, status, scale, bench, profile, plan."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from engine import defaults as engine_defaults
from protocol import defaults
from router.logs import LOG_LEVELS

# `docker run IMAGE serve ...` must listen on every interface; the image sets this.
HOST_ENV = "PDCLUSTER_HOST"


def _serve(args: argparse.Namespace) -> int:
    import logging

    from cluster.config import TRANSPORTS, ClusterConfig
    from cluster.serve import ServeOptions, run
    from router.auth import SecurityConfig
    from router.frontend import RouterConfig
    from router.logs import configure_logging

    worker: dict[str, Any] = {"kv_cache_memory_gb": args.kv_cache_gb,
                              "max_num_batched_tokens": args.max_num_batched_tokens,
                              "max_num_seqs": args.max_num_seqs, "dtype": args.dtype,
                              "policy": args.policy, "max_model_len": args.max_model_len,
                              "enable_prefix_caching": not args.no_prefix_caching}
    if args.speculative_config is not None:
        from engine.spec_decode import SpeculativeConfig

        SpeculativeConfig.parse(args.speculative_config)  # a bad key fails here, not in a worker
        worker["speculative_config"] = args.speculative_config
    if args.transport == "mooncake":
        from kv_transfer.transports.mooncake import check_installed

        try:
            check_installed()
        except RuntimeError as exc:
            raise ValueError(str(exc)) from None
        worker["mooncake_protocol"] = args.mooncake_protocol
    cluster = ClusterConfig(
        model=args.model, mode=args.mode, num_prefill=args.prefill, num_decode=args.decode,
        transports=TRANSPORTS[args.transport],
        host=args.worker_host or ("auto" if args.address else "127.0.0.1"),
        num_cpus_per_worker=args.num_cpus_per_worker,
        num_gpus_per_worker=args.num_gpus_per_worker, torch_threads=args.torch_threads,
        local_prefill_threshold=args.local_prefill_threshold, worker=worker,
        drain_timeout_s=args.drain_timeout, migrate=not args.no_migration,
        internal_auth=args.internal_auth, prefill_resource=args.prefill_resource,
        decode_resource=args.decode_resource)
    security = SecurityConfig(api_key=args.api_key, admin_key=args.admin_key,
                              tls_cert=args.tls_cert, tls_key=args.tls_key,
                              tls_client_ca=args.tls_client_ca)
    options = ServeOptions(cluster, args.address, args.host, args.grpc_port, args.http_port,
                           RouterConfig(max_running=args.max_running, max_queue=args.max_queue,
                                        served_model_name=args.served_model_name,
                                        request_timeout_s=args.request_timeout,
                                        sse_keepalive_s=args.sse_keepalive or None),
                           security=security,
                           allow_unauthenticated=args.allow_unauthenticated,
                           drain_timeout_s=args.drain_timeout,
                           metrics_compat=args.metrics_compat,
                           autoscaler=_autoscaler(args))
    configure_logging(args.log_level, args.log_format)
    logging.getLogger("cluster.autoscaler").setLevel(logging.INFO)  # each decision, its reason
    asyncio.run(run(options))
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
    low = args.prefill + args.decode if args.mode == "disaggregated" else args.decode
    config = AutoscalerConfig(
        Slo.parse(args.slo, args.attainment), args.mode,
        min_workers=args.min_workers or (2 if args.mode == "disaggregated" else 1),
        max_workers=args.max_workers or max(low, 2), min_prefill=args.min_prefill,
        interval_s=args.autoscale_interval,
        window_s=args.autoscale_window, cooldown_s=args.autoscale_cooldown,
        min_requests=args.autoscale_min_requests, reuse_tolerance=args.autoscale_reuse,
        local_prefill_threshold=args.local_prefill_threshold,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs)
    return Autoscaler(config, profile, profile)


def _client(args: argparse.Namespace) -> Any:
    from cluster.serve import endpoint_file
    from router.client import PdClusterClient

    address = args.address
    if address is None:
        path = endpoint_file()
        address = json.loads(path.read_text())["grpc"] if path.exists() else "127.0.0.1:50051"
    return PdClusterClient(address, timeout=args.timeout, api_key=args.api_key,
                           admin_key=args.admin_key, tls=args.tls, tls_ca=args.tls_ca,
                           tls_cert=args.tls_cert, tls_key=args.tls_key)


def _generate(args: argparse.Namespace) -> int:
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature,
                "seed": args.seed}
    if args.local:
        return _generate_local(args, sampling)
    messages = [{"role": "user", "content": args.prompt}]
    with _client(args) as client:
        for out in client.generate(messages=messages, **sampling):
            print(out.text, end="", flush=True)
            if out.finish_reason == "error":
                print(f"\nerror: {out.error}", file=sys.stderr)
                return 1
    print()
    return 0


def _generate_local(args: argparse.Namespace, sampling: dict[str, Any]) -> int:
    from engine import LLM, SamplingParams

    llm = LLM(args.model, args.dtype)
    messages = [{"role": "user", "content": args.prompt}]
    print(llm.chat(messages, SamplingParams(**sampling))[0].outputs[0].text)
    return 0


def _status(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from protocol.status import workers

    with _client(args) as client:
        status = client.status()
    if args.json:
        print(json.dumps(status, indent=2, default=str))
        return 0
    table = Table(title=f"pdcluster · {status.get('model')} · {status.get('mode')}")
    for column in ("worker", "role", "state", "node", "host", "pid", "dtype", "running",
                   "waiting", "KV used", "prefix hits", "busy"):
        table.add_column(column)
    for w in workers(status):
        busy = w.busy_seconds / max(w.uptime_s, 1e-9)
        table.add_row(w.worker_id, w.role, w.state, w.node[:12], w.host, str(w.pid), w.dtype,
                      str(w.num_running), str(w.num_waiting), f"{w.kv_usage:.0%}",
                      f"{w.prefix_hit_rate:.0%}", f"{busy:.0%}")
    Console().print(table)
    return 0


def _scale(args: argparse.Namespace) -> int:
    with _client(args) as client:
        status = client.scale(prefill=args.prefill, decode=args.decode)
    sizes = {role: len(workers) for role, workers in status.get("pools", {}).items()}
    print(f"pools now: {sizes} (removed workers drain before stopping)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdcluster", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start the cluster and its gRPC + OpenAI endpoints")
    serve.add_argument("--model", default="smollm2")
    serve.add_argument("--mode", choices=["disaggregated", "colocated"],
                       default="disaggregated")
    serve.add_argument("--prefill", type=int, default=1, help="prefill workers")
    serve.add_argument("--decode", type=int, default=1, help="decode (or colocated) workers")
    serve.add_argument("--transport", choices=["shm", "zmq", "torch", "mooncake"],
                       default="shm",
                       help="KV transport (shm falls back to zmq across hosts; mooncake: "
                            "Mooncake's Transfer Engine, pip install 'pdcluster[mooncake]')")
    serve.add_argument("--mooncake-protocol", choices=["auto", "tcp", "rdma"], default="auto",
                       help="what --transport mooncake speaks; auto (default): rdma where "
                            "the node lists an RDMA device, else tcp (NICs are picked by "
                            "the engine)")
    serve.add_argument("--address", default=None,
                       help="existing Ray cluster ('auto', 'ray://host:10001'); "
                            "default: embedded local Ray")
    serve.add_argument("--host", default=os.environ.get(HOST_ENV, "127.0.0.1"),
                       help=f"interface of the front doors (default: ${HOST_ENV} or 127.0.0.1)")
    serve.add_argument("--worker-host", default=None,
                       help="address workers and the router bind for ZMQ and KV; 'auto' "
                            "(each node's IP) with --address, else 127.0.0.1")
    serve.add_argument("--prefill-resource", default=None, metavar="NAME",
                       help="Ray custom resource each prefill worker asks a sliver of, so the "
                            "pool runs only on nodes started with ray start --resources "
                            "'{\"NAME\": N}' (default: pd_prefill where a node offers it)")
    serve.add_argument("--decode-resource", default=None, metavar="NAME",
                       help="the same for decode (and colocated) workers (default: pd_decode "
                            "where offered)")
    serve.add_argument("--internal-auth", choices=["auto", "curve", "off"], default="auto",
                       help="internal ZMQ sockets (router <-> workers, KV transfer): 'curve' "
                            "encrypts them and admits only holders of the cluster's key; "
                            "'auto' (default) is 'curve' unless they are all on loopback "
                            "of one node")
    serve.add_argument("--grpc-port", type=int, default=50051)
    serve.add_argument("--http-port", "--port", type=int, default=8000,
                       help="OpenAI HTTP port (--port, as in vLLM)")
    serve.add_argument("--served-model-name", default=None,
                       help="the model's name in the API and the metrics (default: --model)")
    serve.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt + output (default: the model's and the KV "
                            "pool's limit)")
    serve.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                       default=engine_defaults.DTYPE,
                       help="auto: bfloat16 on CUDA and on CPUs with native bf16 "
                            "(AVX512-BF16/AMX), else float32")
    serve.add_argument("--num-cpus-per-worker", type=float, default=1.0)
    serve.add_argument("--num-gpus-per-worker", type=float, default=0.0)
    serve.add_argument("--torch-threads", type=int, default=1)
    serve.add_argument("--kv-cache-gb", type=float, default=engine_defaults.KV_CACHE_GB)
    serve.add_argument("--max-num-batched-tokens", type=int,
                       default=engine_defaults.MAX_NUM_BATCHED_TOKENS)
    serve.add_argument("--max-num-seqs", type=int, default=engine_defaults.MAX_NUM_SEQS)
    serve.add_argument("--local-prefill-threshold", type=int,
                       default=defaults.LOCAL_PREFILL_THRESHOLD,
                       help="uncached prompts this short prefill on the decode worker")
    serve.add_argument("--policy", choices=["continuous", "static"], default="continuous",
                       help="batching policy of every worker (static: for comparison)")
    serve.add_argument("--no-prefix-caching", action="store_true")
    serve.add_argument("--speculative-config", default=None, metavar="JSON",
                       help="speculative decoding on decode and colocated workers, vLLM's keys: "
                            "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                            "\"prompt_lookup_max\": 4}' or '{\"method\": \"draft\", "
                            "\"model\": \"self\", \"draft_layers\": 8, "
                            "\"num_speculative_tokens\": 3}'")
    serve.add_argument("--max-running", type=int, default=defaults.MAX_RUNNING)
    serve.add_argument("--max-queue", type=int, default=defaults.MAX_QUEUE)
    serve.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                       help="level of the server's log; INFO includes one line per finished "
                            "request (ids, token counts, latencies, workers; never the text)")
    serve.add_argument("--log-format", choices=["text", "json"], default="text",
                       help="json: one object per line, for log shippers")
    serve.add_argument("--sse-keepalive", type=float, default=15.0, metavar="SECONDS",
                       help="an HTTP stream silent this long (a long prefill or queue) sends "
                            "an SSE comment so proxies keep it open; 0 turns it off")
    serve.add_argument("--metrics-compat", choices=["vllm"], default=None,
                       help="also export vLLM's metric names (vllm:num_requests_waiting, "
                            "vllm:kv_cache_usage_perc, ...) for existing dashboards and "
                            "autoscalers")
    _add_security_flags(serve)
    auto = serve.add_argument_group("autoscaling (the planner on the router's recent window)")
    auto.add_argument("--autoscale", action="store_true",
                      help="resize the pools live to meet --slo (needs --profile)")
    auto.add_argument("--profile", type=Path, default=None, help="PROFILE.json of the workers")
    auto.add_argument("--slo", default=None, help="e.g. ttft_p90_ms=500,tpot_p90_ms=50")
    auto.add_argument("--attainment", type=float, default=0.9)
    auto.add_argument("--min-workers", type=int, default=None)
    auto.add_argument("--max-workers", type=int, default=None)
    auto.add_argument("--min-prefill", type=int, default=1,
                      help="fewest prefill workers (disaggregated); 0 lets the autoscaler "
                           "leave prefill to the decode workers")
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
    serve.set_defaults(func=_serve)

    gen = sub.add_parser("generate", help="stream an answer from a running cluster")
    gen.add_argument("prompt")
    gen.add_argument("--local", action="store_true",
                     help="run the engine in this process instead of asking a cluster")
    gen.add_argument("--model", default="smollm2", help="with --local")
    gen.add_argument("--dtype", default=engine_defaults.DTYPE, help="with --local")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)

    status = sub.add_parser("status", help="pools, workers, load and KV usage")
    status.add_argument("--json", action="store_true")
    scale = sub.add_parser("scale", help="resize the pools live")
    scale.add_argument("--prefill", type=int, default=None)
    scale.add_argument("--decode", type=int, default=None)
    # bench.cli imports only what its flags need; running a benchmark needs the bench extra.
    from bench.cli import add_parser as add_bench_parser

    add_bench_parser(sub)
    from cluster.cli_planner import add_parsers as add_planner_parsers

    add_planner_parsers(sub)
    for command, func in ((gen, _generate), (status, _status), (scale, _scale)):
        command.add_argument("--address", default=None,
                             help="gRPC host:port (default: the running serve's endpoint)")
        command.add_argument("--timeout", type=float, default=600.0)
        _add_client_auth_flags(command)
        command.set_defaults(func=func)
    return parser


def _add_security_flags(serve: argparse.ArgumentParser) -> None:
    """`serve`: keys, TLS, drain and deadlines."""
    serve.add_argument("--api-key", default=os.environ.get("PDCLUSTER_API_KEY"),
                       help="key every request must present (HTTP 'Authorization: Bearer', "
                            "gRPC metadata 'authorization'); default $PDCLUSTER_API_KEY")
    serve.add_argument("--admin-key", default=os.environ.get("PDCLUSTER_ADMIN_KEY"),
                       help="key ScalePool needs; default $PDCLUSTER_ADMIN_KEY")
    serve.add_argument("--allow-unauthenticated", action="store_true",
                       help="bind a non-loopback --host without any key")
    serve.add_argument("--tls-cert", default=None, help="server certificate (PEM), both doors")
    serve.add_argument("--tls-key", default=None, help="its private key (PEM)")
    serve.add_argument("--tls-client-ca", default=None,
                       help="CA (PEM) client certificates must chain to: mutual TLS")
    serve.add_argument("--drain-timeout", type=float, default=defaults.DRAIN_TIMEOUT_S,
                       help="seconds running requests get to finish on SIGTERM or when their "
                            "worker is scaled away (then they move or are aborted)")
    serve.add_argument("--request-timeout", type=float, default=None,
                       help="longest a request may run, queue included (a shorter gRPC "
                            "deadline wins); default: no limit")
    serve.add_argument("--no-migration", action="store_true",
                       help="end a dead worker's requests with an error instead of moving "
                            "them to another worker")


def _add_client_auth_flags(command: argparse.ArgumentParser) -> None:
    """Client commands: keys and TLS towards a secured server."""
    command.add_argument("--api-key", default=os.environ.get("PDCLUSTER_API_KEY"),
                         help="default $PDCLUSTER_API_KEY")
    command.add_argument("--admin-key", default=os.environ.get("PDCLUSTER_ADMIN_KEY"),
                         help="for scale; default $PDCLUSTER_ADMIN_KEY")
    command.add_argument("--tls", action="store_true", help="connect with TLS")
    command.add_argument("--tls-ca", default=None, help="CA (PEM) to verify the server with")
    command.add_argument("--tls-cert", default=None, help="client certificate (mutual TLS)")
    command.add_argument("--tls-key", default=None, help="client key (mutual TLS)")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `pdcluster` console script."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        import grpc

        if isinstance(e, grpc.RpcError):
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())

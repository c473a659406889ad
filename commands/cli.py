"""The `pdcluster` command line: serve, stop, drain, generate, status, scale, bench,
profile, plan."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from bench import cli as bench_cli
from commands import drain, generate, plan, profile, scale, serve, status, stop

# In the order `pdcluster --help` lists them; each module registers its own subcommand
# (`add_parser`) and the function that runs it (`func`). bench's imports only what its
# flags need: running a benchmark needs the bench extra.
SUBCOMMANDS = (serve, stop, drain, generate, status, scale, bench_cli, profile, plan)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter,
                     argparse.RawDescriptionHelpFormatter):
    """Each flag's help ends with its default, unless the text already says what the
    default is (often what None means); descriptions keep their line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default" in (action.help or "").lower():
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """Every (sub)command formats its help with `_HelpFormatter`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    """`pdcluster` and every subcommand's flags."""
    parser = _Parser(prog="pdcluster", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for command in SUBCOMMANDS:
        command.add_parser(sub)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pdcluster")
    except PackageNotFoundError:
        return "unknown (not installed)"


def dashed(argv: list[str]) -> list[str]:
    """Flags as vLLM's command line takes them: `--max_num_seqs=8` is `--max-num-seqs=8`
    (the name's underscores, never a value's; nothing after a lone `--`)."""
    out = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + argv[i:]
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        out.append(arg)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; for `serve`, over the `--config` file and `PDCLUSTER_*` variables
    (`serve.config_layers`), whose errors exit with code 2 like argparse's."""
    argv = dashed(sys.argv[1:] if argv is None else list(argv))
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "serve":
        return args
    found = serve.config_layers(args)
    args.serve_parser.set_defaults(**found.defaults)
    args = parser.parse_args(argv)
    args.pool_overrides = found.pools
    args.model_layers = found.models
    if args.model_tag is not None:  # `serve MODEL`, as `vllm serve MODEL`
        if "--model" in argv or any(a.startswith("--model=") for a in argv):
            args.serve_parser.error("give the model once: as MODEL or as --model")
        if args.model_layers:
            args.serve_parser.error("MODEL: the config file's models: names each model")
        args.model = args.model_tag
    return args


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `pdcluster` console script."""
    args = parse_args(argv)
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

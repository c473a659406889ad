"""`pdcluster generate`: stream an answer from a running cluster, or with `--local` from an
engine in this process."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from commands.client import add_client_flags, connect
from engine import defaults as engine_defaults


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register `generate` with the `pdcluster` subcommands.

    Args:
        sub: what `ArgumentParser.add_subparsers()` returned.

    Returns:
        The subcommand's parser.
    """
    gen = sub.add_parser("generate", help="stream an answer from a running cluster")
    gen.add_argument("prompt", help="the user message")
    gen.add_argument("--local", action="store_true",
                     help="run the engine in this process instead of asking a cluster")
    gen.add_argument("--model", default="smollm2", help="with --local")
    gen.add_argument("--dtype", default=engine_defaults.DTYPE, help="with --local")
    gen.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--seed", type=int, default=None, help="seed of the sampler")
    add_client_flags(gen)
    gen.set_defaults(func=_generate)
    return gen


def _generate(args: argparse.Namespace) -> int:
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature,
                "seed": args.seed}
    if args.local:
        return _generate_local(args, sampling)
    messages = [{"role": "user", "content": args.prompt}]
    with connect(args) as client:
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

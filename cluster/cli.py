"""The `pdcluster` command line."""

from __future__ import annotations

import argparse
import sys


def _generate_local(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    llm = LLM(args.model, args.dtype)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            seed=args.seed)
    messages = [{"role": "user", "content": args.prompt}]
    output = llm.chat(messages, params)[0].outputs[0]
    print(output.text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdcluster", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="answer one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--local", action="store_true",
                     help="run the engine in this process instead of asking a cluster")
    gen.add_argument("--model", default="smollm2")
    gen.add_argument("--dtype", default="float32")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.set_defaults(func=_generate_local)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `pdcluster` console script."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

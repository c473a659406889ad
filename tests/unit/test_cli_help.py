"""The `pdcluster` command line as a new user meets it: every flag explained with its
default, `--version`, one SLO syntax on serve, plan and bench."""

from __future__ import annotations

import argparse

import pytest

from commands.cli import build_parser, main
from protocol.serving import Slo


def all_actions(parser: argparse.ArgumentParser, path: str = "pdcluster"):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from all_actions(sub, f"{path} {name}")
        elif action.dest != "help":
            yield path, action


def test_every_flag_of_every_command_has_help() -> None:
    missing = [f"{path} {'/'.join(a.option_strings) or a.dest}"
               for path, a in all_actions(build_parser()) if not a.help]
    assert missing == []


SUBCOMMANDS = ["serve", "stop", "drain", "generate", "status", "scale", "bench", "profile", "plan"]


def test_every_subcommand_is_registered_in_order() -> None:
    (subparsers,) = [a for a in build_parser()._actions
                     if isinstance(a, argparse._SubParsersAction)]
    assert list(subparsers.choices) == SUBCOMMANDS


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: pdcluster {command} ")


def test_help_shows_each_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "most requests a worker runs at once (default: 64)" in text
    assert "gRPC port (0: any free) (default: 50051)" in text
    assert "$PDCLUSTER_MAX_NUM_SEQS" in text


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"pdcluster {version('pdcluster')}"


@pytest.mark.parametrize("text", ["ttft:500", "ttft_p90_ms:500,tpot_p90_ms=50", "ttft 500"])
def test_other_slo_syntaxes_are_refused_with_the_one_to_use(text: str) -> None:
    with pytest.raises(ValueError, match=r"expected KEY=MS.*ttft_p90_ms=500,tpot_p90_ms=50"):
        Slo.parse(text)


def test_the_slo_syntax_is_the_same_on_serve_plan_and_bench(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The shorthand and the full keys parse alike; bench refuses vLLM's colon form with
    the same hint as serve and plan."""
    assert Slo.parse("ttft=500,tpot_p90_ms=50").bounds == {"ttft_ms": 500.0,
                                                           "tpot_p90_ms": 50.0}
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--slo", "ttft:500"])
    assert exit_.value.code == 2
    assert "expected KEY=MS" in capsys.readouterr().err
    for command in (["serve", "--autoscale", "--profile", "p.json"],
                    ["plan", "--profile", "p.json", "--trace", "t.jsonl"]):
        with pytest.raises(SystemExit) as exit_:
            main([*command, "--slo", "ttft:500"])
        assert exit_.value.code == 2
        assert "expected KEY=MS" in capsys.readouterr().err

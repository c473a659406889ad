"""Every `pdcluster ...` command README.md and docs/*.md show runs as shown: it parses with
the real command line (`commands.cli.parse_args`), and a `serve` passes every check `serve`
makes before it starts anything (each model's pools and router, the key a non-loopback
host needs, each worker's share of a shared GPU), with `cluster.serve.run` replaced so
nothing starts: no Ray, no server.

Commands come from fenced blocks and inline code, backslash continuations joined. What a
doc leaves to its reader is filled in from the explicit tables below, never skipped: a
placeholder value (`--slo ...`, `--model M`), an elision (`plan ... --validate`), the files
a reader brings (TLS certificates) and the environment a block sets (`export`,
`NAME=value`, a Ray job's `--runtime-env-json`). A synopsis (`[--flag a|b]`) cannot run:
each is listed by name in `SYNOPSES` with why, and its flags must still exist. Inline code
that is only `pdcluster SUBCOMMAND` names the subcommand in running text: it must exist.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from markdown_it import MarkdownIt  # CommonMark's reference parser; rich brings it

import cluster.serve
import commands.serve
import protocol.logs
from commands.cli import build_parser, parse_args
from tests.conftest import clear_flag_env

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
# `python -m commands.cli` is the module behind the `pdcluster` console script.
ENTRY_POINTS = (("pdcluster",), ("python", "-m", "commands.cli"))
SHELL_OPERATORS = set("();<>|&")

SLO = "ttft_p90_ms=2000,tpot_p90_ms=200"  # README's
# A measured SmolLM2 profile, for the commands whose `--profile` `serve` loads.
PROFILE = "docs/results/planner_profile_smollm2_xeon.json"
# Stands for a secret a block makes itself (`export PDCLUSTER_API_KEY=$(openssl ...)`).
SECRET = "doc-secret"

# (flag, placeholder the docs write) -> what the test passes instead. `{scratch}` is a
# folder holding the files a reader brings (`READER_FILES`).
VALUES: dict[tuple[str, str], str] = {
    ("--slo", "..."): SLO,  # the reader's objectives
    ("--profile", "P.json"): PROFILE,  # what `pdcluster profile --out P.json` wrote
    ("--profile", "smollm2.json"): PROFILE,  # the same, README's name
    ("--model", "M"): "smollm2",  # a model name
    ("--decode", "N"): "2",  # a worker count
    ("--config", "FILE.yaml"): "deploy/pdcluster.yaml",  # the example the guide shows
    ("--tls-cert", "server.pem"): "{scratch}/server.pem",
    ("--tls-key", "server.key"): "{scratch}/server.key",
    ("--tls-client-ca", "clients-ca.pem"): "{scratch}/clients-ca.pem",
}
READER_FILES = ("server.pem", "server.key", "clients-ca.pem")
# A `...` argument (not a value of a flag) by subcommand: what it elides.
ELLIPSIS: dict[str, tuple[str, ...]] = {
    "serve": (),  # `serve --detach --address auto ...`: more flags, all optional
    "plan": ("--profile", PROFILE, "--trace", "T.jsonl", "--slo", SLO),  # the plan before
}
# (doc, the command's start as written) -> why it cannot run. Their flags are checked.
SYNOPSES: dict[tuple[str, str], str] = {
    ("README.md", "pdcluster serve [--model smollm2|tiny|FILE.gguf|HF_DIR]"):
        "serve's options: alternatives (a|b) and optional flags",
    ("docs/planner.md", "pdcluster profile --model M [--dtype float32]"):
        "profile's options, each optional",
    ("docs/planner.md", "pdcluster plan --profile P.json --trace T.jsonl [--rate R]"):
        "plan's options, each optional",
    ("docs/planner.md", "pdcluster profile --analytic --hardware H100-SXM|cpu|SPEC.yaml"):
        "the analytic profile's options: alternatives (a|b) and optional flags",
    ("docs/planner.md", "pdcluster serve --model M --prefill 1 --decode 1 --autoscale"):
        "the autoscaler's options, each optional",
}


@dataclass(frozen=True)
class DocCommand:
    """One command line a doc shows.

    Args:
        doc: the file, relative to the repository.
        line: the line its entry point (`pdcluster`) is on.
        text: as written, from the entry point on (continuations joined).
        words: its arguments as the shell splits them (the subcommand first).
        env: what the doc sets in its environment.
        inline: shown in running text rather than in a block.
    """

    doc: str
    line: int
    text: str
    words: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    inline: bool = False

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def synopsis(self) -> bool:
        return "[-" in self.text

    @property
    def names_a_subcommand(self) -> bool:
        """`pdcluster plan` in running text names the subcommand; it is no command line."""
        return self.inline and len(self.words) == 1


@dataclass
class Captured:
    """What `serve` would have started with, instead of starting it."""

    options: list[Any] = field(default_factory=list)


def shell_words(line: str) -> list[str]:
    """`line` split as a POSIX shell does (quotes, `#` comments), operators apart."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def reader_value(value: str) -> str:
    """A value the shell computes (`$(openssl ...)`, `$KEY`) stands for a secret."""
    return SECRET if value.startswith("$") else value


def assignments(words: list[str]) -> dict[str, str]:
    """`NAME=value` words: the variables they set."""
    found = {}
    for word in words:
        name, equals, value = word.partition("=")
        if equals and re.fullmatch(r"[A-Z_][A-Z0-9_]*", name):
            found[name] = reader_value(value)
    return found


def job_env(words: list[str]) -> dict[str, str]:
    """The variables a `ray job submit --runtime-env-json` gives its entrypoint."""
    if "--runtime-env-json" not in words:
        return {}
    runtime_env = json.loads(words[words.index("--runtime-env-json") + 1])
    return {k: reader_value(v) for k, v in runtime_env.get("env_vars", {}).items()}


def commands_in(line: str) -> Iterator[tuple[str, list[str], dict[str, str]]]:
    """The entry-point invocations in one shell line: each as written (from its entry point
    on, without a trailing comment), its arguments, and the environment the line gives it
    (a `ray job submit`'s, `NAME=value` before it)."""
    words = shell_words(line)
    for i, word in enumerate(words):
        if word.startswith(tuple(" ".join(e) + " " for e in ENTRY_POINTS)):
            yield from commands_in(word)  # `ray exec ... 'pdcluster status'`
        for entry in ENTRY_POINTS:
            start = i + len(entry)
            if tuple(words[i:start]) != entry or start == len(words):
                continue
            end = next((j for j in range(start, len(words))
                        if set(words[j]) <= SHELL_OPERATORS), len(words))
            before = words[:i]
            prefix = len(before)  # `NAME=value pdcluster ...`
            while prefix and "=" in before[prefix - 1] and not before[prefix - 1].startswith("-"):
                prefix -= 1
            env = {**job_env(before), **assignments(before[prefix:])}
            yield written(line, words[start]), words[start:end], env


def written(line: str, subcommand: str) -> str:
    """The command as `line` writes it, from its entry point on, one space between words."""
    match = re.search(rf"(pdcluster|python -m commands\.cli)\s+{re.escape(subcommand)}", line)
    text = line[match.start() if match else 0:]
    return " ".join(re.sub(r"\s#\s.*", "", text).split())


def entry_line(lines: list[str], subcommand: str) -> int:
    """Which of a logical line's physical lines holds the command's start."""
    pattern = re.compile(rf"(?<![\w.:/-])(pdcluster|commands\.cli)\s+{re.escape(subcommand)}")
    return next((k for k, line in enumerate(lines) if pattern.search(line)), 0)


def block_commands(doc: str, first: int, text: str) -> Iterator[DocCommand]:
    """The commands of one code block, its first line at `first`."""
    lines = text.split("\n")
    env: dict[str, str] = {}  # `export`s so far in the block
    i = 0
    while i < len(lines):
        start = i
        while lines[i].endswith("\\") and i + 1 < len(lines):
            i += 1
        logical = " ".join(line.removesuffix("\\") for line in lines[start:i + 1])
        i += 1
        if "[-" in logical:  # a synopsis goes on in indented lines without backslashes
            while i < len(lines) and lines[i].startswith((" ", "\t")) and lines[i].strip():
                logical += " " + lines[i]
                i += 1
        if logical.startswith("export "):
            env.update(assignments(shell_words(logical)[1:]))
            continue
        for text, argv, own in commands_in(logical):
            at = entry_line(lines[start:i], argv[0])
            yield DocCommand(doc, first + start + at, text, tuple(argv),
                             tuple({**env, **own}.items()))


def snippets(path: Path) -> Iterator[tuple[int, str, bool]]:
    """(line, code, inline) for each code block and inline code span of a Markdown file."""
    text = path.read_text()
    lines = text.splitlines()
    for token in MarkdownIt("commonmark").enable("table").parse(text):
        if token.type in ("fence", "code_block") and token.map:
            yield token.map[0] + 1 + (token.type == "fence"), token.content, False
        elif token.type == "inline" and token.map:
            raw = "\n".join(lines[token.map[0]:token.map[1]])
            at = 0  # where the next span may start: spans come in order
            for child in token.children or []:
                if child.type != "code_inline" or not child.content.strip():
                    continue
                # CommonMark turns a span's line breaks into spaces: find it across them.
                found = re.compile(r"\s+".join(map(re.escape, child.content.split()))).search(
                    raw, at)
                at = found.end() if found else at
                offset = raw[:found.start()].count("\n") if found else 0
                yield token.map[0] + 1 + offset, child.content, True


def doc_commands(path: Path) -> list[DocCommand]:
    doc = str(path.relative_to(ROOT))
    found = []
    for line, code, inline in snippets(path):
        if not inline:
            found += block_commands(doc, line, code)
            continue
        for text, argv, env in commands_in(code):
            found.append(DocCommand(doc, line, text, tuple(argv), tuple(env.items()),
                                    inline=True))
    return found


COMMANDS = [c for path in DOC_FILES for c in doc_commands(path)]
RUNNABLE = [c for c in COMMANDS if not c.synopsis and not c.names_a_subcommand]


def listed_synopsis(command: DocCommand) -> str | None:
    """Why `command` cannot run, when SYNOPSES lists it."""
    return next((why for (doc, start), why in SYNOPSES.items()
                 if command.doc == doc and command.text.startswith(start)), None)


def runnable_argv(command: DocCommand, scratch: Path) -> list[str]:
    """`command`'s arguments with each placeholder replaced (`VALUES`, `ELLIPSIS`)."""
    words, argv = command.words, []
    for k, word in enumerate(words):
        value = VALUES.get((words[k - 1], word)) if k else None
        if value is not None:
            argv.append(value.format(scratch=scratch))
        elif word == "..." and words[0] in ELLIPSIS:
            argv += ELLIPSIS[words[0]]
        else:
            argv.append(word)
    return argv


def subcommands() -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in build_parser()._actions
                 if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def why_not(command: DocCommand, scratch: Path, captured: Captured,
            monkeypatch: pytest.MonkeyPatch) -> str | None:
    """None when `command` would run (or, for `serve`, start); else what stops it.

    It runs in the repository (the docs' relative paths are from there), with only the
    `PDCLUSTER_*` variables the doc sets.
    """
    clear_flag_env(monkeypatch)
    for name, value in command.env:
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(ROOT)
    argv = runnable_argv(command, scratch)
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            args = parse_args(argv)
    except SystemExit as e:
        if e.code == 0:  # --help
            return None
        return f"the command line is refused: {errors.getvalue().strip()}"
    if args.command != "serve":
        return None
    try:
        args.func(args)  # as `commands.cli.main` does; `run` only records its options
    except ValueError as e:  # what `main` prints as `error: ...`, exit 2
        return f"serve refuses to start: {e}"
    if len(captured.options) != 1:
        return "serve never reached the point of starting"
    return None


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> Captured:
    """Stands in for whatever `serve` would start: its options are kept instead."""
    seen = Captured()

    async def run(options: Any) -> None:
        seen.options.append(options)

    def detached(options: Any, name: str) -> int:
        seen.options.append(options)
        return 0

    monkeypatch.setattr(cluster.serve, "run", run)
    monkeypatch.setattr(commands.serve, "_serve_detached", detached)
    monkeypatch.setattr(protocol.logs, "configure_logging", lambda *_: None)
    return seen


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    for name in READER_FILES:
        (tmp_path / name).write_text("")  # `serve` checks they exist before it starts
    return tmp_path


@pytest.mark.parametrize("command", RUNNABLE, ids=[c.where for c in RUNNABLE])
def test_a_documented_command_runs(command: DocCommand, scratch: Path, captured: Captured,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    problem = why_not(command, scratch, captured, monkeypatch)
    assert problem is None, f"{command.where}: `{command.text}`\n{problem}"


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.names_a_subcommand],
                         ids=lambda c: c.where)
def test_a_subcommand_named_in_the_text_exists(command: DocCommand) -> None:
    assert command.words[0] in subcommands(), f"{command.where}: `{command.text}`"


SHOWN_SYNOPSES = [c for c in COMMANDS if c.synopsis]


@pytest.mark.parametrize("command", SHOWN_SYNOPSES, ids=[c.where for c in SHOWN_SYNOPSES])
def test_a_synopsis_is_listed_and_names_only_flags_that_exist(command: DocCommand) -> None:
    assert listed_synopsis(command), (
        f"{command.where}: `{command.text}` cannot run as shown: make it a command a reader "
        "can paste, or list it in SYNOPSES with why")
    parser = subcommands()[command.words[0]]
    flags = {flag for action in parser._actions for flag in action.option_strings}
    named = re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", command.text.split(None, 2)[2])
    assert sorted(set(named) - flags) == [], f"{command.where}: `{command.text}`"


def test_the_docs_commands_are_found_and_every_table_entry_is_used() -> None:
    by_doc = {path.relative_to(ROOT).as_posix(): 0 for path in DOC_FILES}
    for command in RUNNABLE:
        by_doc[command.doc] += 1
    for doc in ("README.md", "docs/operators.md", "docs/planner.md", "docs/reliability.md"):
        assert by_doc[doc] > 0, f"no command found in {doc}: {by_doc}"
    assert [c.doc for c in COMMANDS if c.text.startswith("python -m commands.cli")] == [
        "README.md"]
    used = {(c.words[k - 1], w) for c in RUNNABLE for k, w in enumerate(c.words) if k}
    assert sorted(set(VALUES) - used) == [], "placeholders no doc writes any more"
    elided = {c.words[0] for c in RUNNABLE if "..." in c.words[1:]}
    assert sorted(set(ELLIPSIS) - elided) == [], "elisions no doc writes any more"
    shown = {key for key in SYNOPSES for c in SHOWN_SYNOPSES
             if (c.doc, c.text[:len(key[1])]) == key}
    assert sorted(set(SYNOPSES) - shown) == [], "synopses no doc shows any more"


@pytest.mark.parametrize(("text", "problem"), [
    ("pdcluster serve --host 0.0.0.0",
     "serve refuses to start: host: binding '0.0.0.0' without --api-key"),
    ("pdcluster serve --num-gpus-per-worker 0.5",
     "serve refuses to start: num-gpus-per-worker 0.5 puts up to 2 workers on one GPU"),
    ("pdcluster serve --no-such-flag 1",
     "the command line is refused: usage: pdcluster [-h] [--version]"),
    ("pdcluster plan --slo ttft_p90_ms=1", "the command line is refused: usage: pdcluster plan"),
])
def test_the_check_catches_what_a_reader_would_hit(
        text: str, problem: str, scratch: Path, captured: Captured,
        monkeypatch: pytest.MonkeyPatch) -> None:
    (command,) = block_commands("doc.md", 1, text)
    assert (why_not(command, scratch, captured, monkeypatch) or "").startswith(problem)
    assert captured.options == []


def test_a_command_that_would_start_gets_as_far_as_starting(
        scratch: Path, captured: Captured, monkeypatch: pytest.MonkeyPatch) -> None:
    (command,) = block_commands("doc.md", 1, "pdcluster serve --host 0.0.0.0 --api-key k \\\n"
                                "  --num-gpus-per-worker 0.5 --gpu-memory-utilization 0.45")
    assert why_not(command, scratch, captured, monkeypatch) is None
    (options,) = captured.options
    assert (options.host, options.security.api_key, options.cluster.decode.num_gpus) == (
        "0.0.0.0", "k", 0.5)


def test_a_block_gives_its_commands_its_exports_and_a_job_its_runtime_env() -> None:
    block = ("export PDCLUSTER_API_KEY=$(openssl rand -hex 24)   # clients present it\n"
             "pdcluster serve --host 0.0.0.0 \\\n"
             "    --prefill 2   # a comment\n"
             "ray job submit --runtime-env-json '{\"env_vars\": {\"PDCLUSTER_ADMIN_KEY\": "
             "\"'\"$ADMIN\"'\"}}' -- \\\n"
             "  pdcluster serve --address auto ...\n")
    first, second = block_commands("doc.md", 10, block)
    assert (first.line, first.words, first.env) == (
        11, ("serve", "--host", "0.0.0.0", "--prefill", "2"),
        (("PDCLUSTER_API_KEY", SECRET),))
    assert (second.line, second.text, second.env) == (
        14, "pdcluster serve --address auto ...",
        (("PDCLUSTER_API_KEY", SECRET), ("PDCLUSTER_ADMIN_KEY", SECRET)))

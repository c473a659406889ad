"""Run `pdcluster serve` as a child process: what `plan --validate` and the experiments
serve their configurations with.

`pdcluster_serve` starts `python -m commands.cli serve ... --grpc-port 0 --http-port 0`
(its endpoints read back from its ready line) and always stops it: SIGINT, then SIGKILL to
its process group (Ray's daemons included).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

READY_LINE = re.compile(r"pdcluster ready: gRPC (\S+)\s+OpenAI (\S+)/v1")
T = TypeVar("T")


class ManagedProcess:
    """A server subprocess in its own process group, its output teed to a log file.

    Use it as a context manager: leaving the block always stops it (SIGINT, then SIGKILL to
    the whole group: Ray's daemons, vLLM's engine process).

    Args:
        name: for messages.
        command: the argv.
        log_path: where stdout and stderr go (the folder is created).
        env: the environment (default: this process's).
        ready_pattern: a regex whose first matching output line `ready_match` keeps.
    """

    def __init__(self, name: str, command: Sequence[str], log_path: Path,
                 env: dict[str, str] | None = None,
                 ready_pattern: re.Pattern[str] | None = None) -> None:
        self.name, self.command, self.log_path = name, list(command), log_path
        self.env, self.ready_pattern = env, ready_pattern
        self.ready_match: re.Match[str] | None = None
        self._tail: deque[str] = deque(maxlen=40)
        self._proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # Its own session: Ctrl-C here reaches only us, and we stop the group in order.
        self._proc = subprocess.Popen(
            self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=self.env, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True, name=self.name)
        self._reader.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        """The process id (also its process group id)."""
        if self._proc is None:
            raise RuntimeError(f"{self.name} was not started")
        return self._proc.pid

    def wait_ready(self, check: Callable[[], T | None], timeout: float) -> T:
        """Poll `check` until it returns a value.

        Raises:
            RuntimeError: the process exited, or `timeout` seconds passed; with the log's tail.
        """
        assert self._proc is not None, "enter the context first"
        deadline = time.monotonic() + timeout
        while True:
            value = check()
            if value is not None:
                return value
            if self._proc.poll() is not None:
                raise RuntimeError(self._failure(f"exited with status {self._proc.returncode}"))
            if time.monotonic() > deadline:
                raise RuntimeError(self._failure(f"was not ready after {timeout:g} s"))
            time.sleep(0.2)

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGINT, up to `grace_s` to exit, then SIGKILL; then SIGKILL what is left of the group.

        Returns:
            The exit status (negative: the signal that ended it), None when never started.
        """
        if self._proc is None:
            return None
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGINT)
            try:
                self._proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                print(f"{self.name} did not stop in {grace_s:g} s; killing it", file=sys.stderr)
                self._kill_group()
                self._proc.wait()
        self._kill_group()  # anything it left behind in its group
        if self._reader is not None:
            self._reader.join(5)
        return self._proc.returncode

    def _kill_group(self) -> None:
        with suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        with self.log_path.open("w") as log:
            for line in self._proc.stdout:
                log.write(line)
                log.flush()
                self._tail.append(line)
                if self.ready_pattern and self.ready_match is None:
                    self.ready_match = self.ready_pattern.search(line)

    def _failure(self, what: str) -> str:
        return (f"{self.name} {what}: {shlex.join(self.command)}\nlog {self.log_path}, last "
                f"lines:\n{''.join(self._tail)}")


@dataclass(frozen=True)
class Endpoints:
    """A running pdcluster's front doors.

    Args:
        grpc: `host:port`.
        http: the OpenAI base URL, `http://host:port/v1`.
    """

    grpc: str
    http: str


@contextmanager
def pdcluster_serve(model: str, flags: Sequence[str], log_path: Path,
                    ready_timeout: float = 300.0) -> Iterator[Endpoints]:
    """Run `pdcluster serve` on free ports until the block ends.

    Args:
        model: `--model`.
        flags: the other serve flags.
        log_path: the server's output.
        ready_timeout: seconds to wait for its ready line.

    Yields:
        Its endpoints, once it is ready.
    """
    command = [sys.executable, "-m", "commands.cli", "serve", "--model", model,
               "--grpc-port", "0", "--http-port", "0", *flags]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    print(f"starting: pdcluster serve --model {model} {shlex.join(flags)}", flush=True)
    with ManagedProcess("pdcluster serve", command, log_path, env, READY_LINE) as proc:
        match = proc.wait_ready(lambda: proc.ready_match, ready_timeout)
        print(f"ready: gRPC {match[1]}  OpenAI {match[2]}/v1", flush=True)
        yield Endpoints(grpc=match[1], http=f"{match[2]}/v1")

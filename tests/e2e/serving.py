"""`pdcluster serve` as a child process: started on ports 0, ready when it prints its
endpoints, its output kept (and always read, so a chatty server never blocks on a full pipe).
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

READY = re.compile(r"gRPC (\S+)\s+OpenAI (\S+)/v1")


@dataclass
class Served:
    """A running `pdcluster serve`: its process, endpoints and every line it printed."""

    proc: subprocess.Popen
    grpc: str
    http: str
    lines: list[str] = field(default_factory=list)

    def log(self, last: int = 40) -> str:
        return "".join(self.lines[-last:])


def _read(proc: subprocess.Popen, lines: list[str], ready: queue.Queue) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        match = READY.search(line)
        if match:
            ready.put(match)
    ready.put(None)  # end of output: the process is gone


@contextlib.contextmanager
def serve(*flags: str, timeout_s: float = 240.0,
          env: dict[str, str] | None = None) -> Iterator[Served]:
    """`pdcluster serve --grpc-port 0 --http-port 0 *flags`, ready within `timeout_s` (its
    output tail in the failure otherwise, even when it printed nothing); interrupted (then
    killed) on exit. `env` adds variables to this process's environment."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(
        [sys.executable, "-m", "commands.cli", "serve", "--grpc-port", "0", "--http-port", "0",
         "--kv-cache-gb", "0.25", "--dtype", "float32", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    ready: queue.Queue = queue.Queue()
    reader = threading.Thread(target=_read, args=(proc, lines, ready), daemon=True)
    reader.start()
    try:
        match = ready.get(timeout=timeout_s)
    except queue.Empty:
        match = None
    if match is None:
        proc.kill()
        proc.wait(30)
        raise AssertionError(f"serve was not ready within {timeout_s:g} s (exit code "
                             f"{proc.returncode}):\n" + "".join(lines[-30:]))
    try:
        yield Served(proc, match.group(1), match.group(2), lines)
    finally:
        if proc.poll() is None:
            proc.send_signal(2)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
        reader.join(10)


class ServerSlot:
    """One server for a module, started on first use and started again for the next test
    when a test ended it (a SIGTERM test), so no test depends on running last."""

    def __init__(self, *flags: str) -> None:
        self.flags = flags
        self._stack = contextlib.ExitStack()
        self._served: Served | None = None
        self.starts = 0

    def live(self) -> Served:
        if self._served is None or self._served.proc.poll() is not None:
            self._stack.close()
            self._stack = contextlib.ExitStack()
            self._served = self._stack.enter_context(serve(*self.flags))
            self.starts += 1
        return self._served

    def close(self) -> None:
        self._stack.close()


def wait_for(condition, what: str, timeout_s: float = 60.0, poll_s: float = 0.02) -> None:
    """Poll a condition (a status, a counter) until it holds; fail naming it."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(poll_s)

"""Hosts on one Linux machine: each a network, mount and pid namespace of its own.

`Hosts` makes a bridge in the root namespace and, per host, a network namespace joined to
it by a veth pair, with addresses it picks itself in 10.213.0.0/16 (the bridge is .1, hosts
.10, .11, ...). Each host's processes run under an init of their own (pid 1 of a new pid
namespace, in a new mount namespace with a private `/dev/shm` and `/tmp/ray`, Ray's
sessions), so two hosts share what two real machines with a shared filesystem share: no
pids, no shared memory, no loopback, no Ray session. Killing a host's init kills every
process on it, as losing the machine would. Everything made is removed on `close()`, also
after a failure, and a run killed before that is swept by the next one (names carry the
maker's pid).

Needs root (`ip netns`, `unshare`, `nsenter`); `unavailable()` says why it cannot run.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PREFIX = "pdcmn"
CLONE_NEWNET = 0x40000000
# pid 1 of each host: reaps the orphans (Ray daemonizes its raylet and workers).
INIT = ("import os, time\n"
        "while True:\n"
        "    try:\n"
        "        os.wait()\n"
        "    except ChildProcessError:\n"
        "        time.sleep(0.2)\n")


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, capture_output=True, text=True)


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (`ip netns add` is not permitted)"
    name = f"{PREFIX}probe{os.getpid()}"
    probe = _run("ip", "netns", "add", name, check=False)
    if probe.returncode != 0:
        return f"`ip netns add` failed: {probe.stderr.strip()}"
    _run("ip", "netns", "del", name, check=False)
    return None


def enter_netns(pid: int) -> None:
    """Move this process into the network namespace of `pid` — before it starts threads:
    a socket lives in the namespace of the thread that made it (the experiments run one end
    of a transfer per host this way)."""
    fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into the network namespace of {pid}")
    finally:
        os.close(fd)


def sweep() -> None:
    """Remove what a killed earlier run left: namespaces and bridges whose maker is gone."""
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(PREFIX) and not _alive(name):
            for pid in _run("ip", "netns", "pids", name, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _run("ip", "netns", "del", name, check=False)
    for line in _run("ip", "-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith(PREFIX) and not _alive(name):
            _run("ip", "link", "del", name, check=False)


def _alive(name: str) -> bool:
    """Whether the run that made `name` (pdcmn<pid>x...) still runs."""
    digits = "".join(c for c in name[len(PREFIX):].split("x")[0] if c.isdigit())
    return bool(digits) and Path(f"/proc/{digits}").exists() and int(digits) != 0


@dataclass
class Host:
    """One host: its network namespace, address, root-side link, init and files."""

    name: str
    netns: str
    ip: str
    link: str
    dir: Path
    init: subprocess.Popen | None = None
    init_pid: int = 0  # pid 1 of the host's pid namespace, as the root namespace sees it

    @property
    def alive(self) -> bool:
        return self.init is not None and self.init.poll() is None


class Hosts:
    """A bridge and `names` hosts on it (see the module docstring).

    Args:
        names: the hosts' names (short: they become interface names).
    """

    def __init__(self, names: Sequence[str]) -> None:
        sweep()
        tag = f"{PREFIX}{os.getpid()}x{random.randrange(16 ** 3):03x}"
        subnet = f"10.213.{random.randrange(1, 255)}"
        self.bridge = tag
        self.gateway = f"{subnet}.1"
        self.dir = Path(tempfile.mkdtemp(prefix=f"{tag}-"))
        # Every process on every host gets the Ray cluster's token, as operators hand it out.
        self.env = {**os.environ, "RAY_AUTH_MODE": "token",
                    "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        self.hosts: dict[str, Host] = {}
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            for i, name in enumerate(names):
                self._make(tag, i, name, f"{subnet}.{10 + i}")
        except BaseException:
            self.close()
            raise

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def _make(self, tag: str, i: int, name: str, ip: str) -> Host:
        netns, link = f"{tag}-{name}", f"{tag[-7:]}v{i}"
        host = Host(name, netns, ip, link, self.dir / name)
        self.hosts[name] = host  # from here on, close() removes it
        host.dir.mkdir()
        (host.dir / "ray").mkdir()
        _run("ip", "netns", "add", netns)
        _run("ip", "link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", netns)
        _run("ip", "link", "set", link, "master", self.bridge)
        _run("ip", "link", "set", link, "up")
        for argv in (("ip", "addr", "add", f"{ip}/24", "dev", "eth0"),
                     ("ip", "link", "set", "eth0", "up"), ("ip", "link", "set", "lo", "up")):
            _run("ip", "netns", "exec", netns, *argv)
        # pid 1 of a new pid namespace, in a new mount namespace: private /dev/shm and Ray
        # sessions (the checkout and the venv may live under /tmp: the rest stays shared).
        setup = (f"mount -t tmpfs -o size=8g tmpfs /dev/shm && mkdir -p /tmp/ray && "
                 f"mount --bind {host.dir / 'ray'} /tmp/ray && "
                 f"exec {sys.executable} -c '{INIT}'")
        with open(host.dir / "init.log", "w") as log:  # the child keeps its own copy
            host.init = subprocess.Popen(
                ["ip", "netns", "exec", netns, "unshare", "--mount", "--propagation", "private",
                 "--pid", "--fork", "--mount-proc", "--", "sh", "-c", setup],
                stdout=subprocess.DEVNULL, stderr=log)
        host.init_pid = self._child_pid(host)
        return host

    @staticmethod
    def _child_pid(host: Host, timeout_s: float = 10.0) -> int:
        """The init's pid: the child of `unshare` whose /dev/shm is mounted (setup done)."""
        assert host.init is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if host.init.poll() is not None:
                raise RuntimeError(f"host {host.name} did not start: "
                                   + (host.dir / "init.log").read_text())
            for pid in _descendants(host.init.pid):
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                except FileNotFoundError:
                    continue
                if cmdline.endswith(INIT.encode() + b"\0"):
                    return pid
            time.sleep(0.05)
        raise RuntimeError(f"host {host.name}: no init after {timeout_s:g} s")

    def popen(self, name: str, argv: Sequence[str], log: str, **kwargs) -> subprocess.Popen:
        """Start `argv` on host `name` (its network, mounts and pids), output to `log` in
        the host's folder."""
        host = self.hosts[name]
        with open(host.dir / log, "a") as out:  # the child keeps its own copy
            return subprocess.Popen(self._enter(host, argv), stdout=out,
                                    stderr=subprocess.STDOUT, env=self.env, **kwargs)

    @staticmethod
    def signal(proc: subprocess.Popen, sig: int) -> None:
        """Send `sig` to the program `popen` started (nsenter forwards no signal to it)."""
        for pid in _descendants(proc.pid)[:1]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def run(self, name: str, argv: Sequence[str], timeout_s: float = 120.0
            ) -> subprocess.CompletedProcess:
        """Run `argv` on host `name` (in this directory) to the end.

        Raises:
            AssertionError: it failed; its output in the message.
        """
        done = subprocess.run(self._enter(self.hosts[name], argv), capture_output=True,
                              text=True, timeout=timeout_s, env=self.env)
        if done.returncode:
            raise AssertionError(f"{argv[:3]} on {name} exited {done.returncode}:\n"
                                 f"{done.stdout[-2000:]}{done.stderr[-3000:]}")
        return done

    @staticmethod
    def _enter(host: Host, argv: Sequence[str]) -> list[str]:
        if not host.alive:
            raise RuntimeError(f"host {host.name} is down")
        return ["nsenter", "-t", str(host.init_pid), "--net", "--mount", "--pid",
                f"--wd={os.getcwd()}", "--", *argv]

    def kill(self, name: str) -> None:
        """Lose host `name`: SIGKILL its init, which kills every process of its pid namespace."""
        host = self.hosts[name]
        if host.alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(host.init_pid, signal.SIGKILL)
            assert host.init is not None
            host.init.wait(30)

    def pause(self, name: str, paused: bool = True) -> None:
        """Stop (SIGSTOP) every process on host `name`, as a machine that hangs, or let them
        go on (SIGCONT): a paused host sends nothing and answers nothing."""
        for pid in _descendants(self.hosts[name].init_pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP if paused else signal.SIGCONT)

    def set_link(self, name: str, up: bool) -> None:
        """Cut (or restore) host `name`'s only link, from the bridge's side."""
        _run("ip", "link", "set", self.hosts[name].link, "up" if up else "down")

    def close(self) -> None:
        """Kill every host, remove every namespace and link made, and the folder."""
        for name in list(self.hosts):
            self.kill(name)
        for host in self.hosts.values():
            _run("ip", "netns", "del", host.netns, check=False)
            _run("ip", "link", "del", host.link, check=False)
        _run("ip", "link", "del", self.bridge, check=False)
        if os.environ.get("PDCLUSTER_KEEP_MULTINODE_LOGS") is None:
            shutil.rmtree(self.dir, ignore_errors=True)


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            with contextlib.suppress(FileNotFoundError):
                children = [int(c) for c in (task / "children").read_text().split()]
                out += children
                todo += children
    return out

"""Soak: a real `pdcluster serve` (tiny model, loopback) under mixed load while its workers are
killed and its pools resized; every request must be answered and no KV block leaked.

Clients stream over gRPC and the OpenAI HTTP API; some abort mid-stream on purpose. During
the run one decode worker and one prefill worker are SIGKILLed (the ones holding requests),
and the decode pool is scaled down and up again. Greedy requests repeat a few prompts, so
their outputs must agree token for token whatever path (migration included) served them.

    python -m experiments.soak [--duration 150] [--concurrency 8]

Prints the tally and PASS or FAIL (exit status 1) on the terminal; nothing is written.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx

from router.client import PdClusterClient


@dataclass
class Tally:
    """What happened to every request sent."""

    counts: Counter = field(default_factory=Counter)
    greedy: dict[int, list[int]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: str, error: str | None = None) -> None:
        with self.lock:
            self.counts[outcome] += 1
            if error:
                self.errors.append(error)

    def check_greedy(self, prompt_index: int, tokens: list[int]) -> bool:
        with self.lock:
            return self.greedy.setdefault(prompt_index, tokens) == tokens


def _serve(api_key: str, admin_key: str) -> tuple[subprocess.Popen, str, str]:
    cmd = [sys.executable, "-m", "commands.cli", "serve", "--model", "tiny", "--prefill", "2",
           "--decode", "2", "--grpc-port", "0", "--http-port", "0", "--kv-cache-gb", "0.05",
           "--dtype", "float32", "--local-prefill-threshold", "32", "--drain-timeout", "20",
           "--api-key", api_key, "--admin-key", admin_key]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = []
    for line in proc.stdout:
        lines.append(line)
        match = re.search(r"gRPC (\S+)\s+OpenAI (\S+)/v1", line)
        if match:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, match.group(1), match.group(2)
    raise RuntimeError("serve did not start:\n" + "".join(lines[-30:]))


class Load:
    """Client threads sending a mix of requests until told to stop."""

    def __init__(self, grpc_address: str, http_url: str, api_key: str, seed: int) -> None:
        self.grpc_address, self.http_url, self.api_key = grpc_address, http_url, api_key
        self.tally = Tally()
        self.stop = threading.Event()
        rng = random.Random(seed)
        self.prompts = [[rng.randrange(100, 30000) for _ in range(rng.randint(8, 300))]
                        for _ in range(12)]
        self.seed = seed

    def run(self, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        with PdClusterClient(self.grpc_address, timeout=120, api_key=self.api_key) as client:
            while not self.stop.is_set():
                self.one(client, rng)

    def one(self, client: PdClusterClient, rng: random.Random) -> None:
        """Send one request and record its outcome.

        A completed gRPC request must hold exactly `max_tokens` tokens (EOS is ignored), and
        greedy ones the same tokens as every other completion of their prompt.
        """
        which = rng.randrange(len(self.prompts))
        greedy = rng.random() < 0.6
        params = {"max_tokens": rng.randint(8, 120), "ignore_eos": True,
                  "temperature": 0.0 if greedy else 0.8}
        if greedy:
            params["max_tokens"] = 40 + which * 5  # same prompt, same request
        abort_after = rng.randint(1, 20) if rng.random() < 0.15 else None
        self.tally.add("sent")
        try:
            if rng.random() < 0.25:
                tokens, reason = self._http(which, params, abort_after)
            else:
                tokens, reason = self._grpc(client, which, params, abort_after)
        except (grpc.RpcError, httpx.HTTPError) as e:
            self.tally.add("failed", f"{type(e).__name__}: {e}"[:300])
            return
        if reason == "client_abort":
            self.tally.add("aborted_by_client")
        elif reason in ("length", "stop"):
            self.tally.add("completed")
            if tokens is None:  # HTTP: text, not token ids
                return
            if len(tokens) != params["max_tokens"]:  # ignore_eos: exactly max_tokens
                self.tally.add("wrong_tokens", f"{len(tokens)} tokens, not "
                                               f"{params['max_tokens']}")
            elif greedy and not self.tally.check_greedy(which, tokens):
                self.tally.add("wrong_tokens", f"greedy prompt {which} differs")
        elif reason is None:
            self.tally.add("lost", "stream ended without a finish_reason")
        else:
            self.tally.add("failed", f"finish_reason {reason}")

    def _grpc(self, client: PdClusterClient, which: int, params: dict[str, Any],
              abort_after: int | None) -> tuple[list[int], str | None]:
        tokens: list[int] = []
        stream = client.generate(prompt_token_ids=self.prompts[which], **params)
        for out in stream:
            tokens += out.token_ids
            if out.finish_reason == "error":
                self.tally.errors.append(out.error or "")
            if out.finish_reason:
                return tokens, out.finish_reason
            if abort_after is not None and len(tokens) >= abort_after:
                stream.close()  # the client goes away mid-stream
                return tokens, "client_abort"
        return tokens, None

    def _http(self, which: int, params: dict[str, Any], abort_after: int | None
              ) -> tuple[None, str | None]:
        """Streams over OpenAI HTTP; returns no token ids (the chunks carry text)."""
        body = {"prompt": self.prompts[which], "stream": True, **params}
        headers = {"authorization": f"Bearer {self.api_key}"}
        chunks = 0
        with httpx.stream("POST", f"{self.http_url}/v1/completions", json=body,
                          headers=headers, timeout=120) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    self.tally.errors.append(chunk["error"]["message"])
                    return None, "error"
                chunks += 1
                reason = chunk["choices"][0].get("finish_reason")
                if reason:
                    return None, reason
                if abort_after is not None and chunks >= abort_after:
                    return None, "client_abort"  # leaving the block closes the connection
        return None, None


def _victim(admin: PdClusterClient, role: str) -> dict[str, Any]:
    workers = admin.status()["pools"][role]
    return max(workers, key=lambda w: w.get("in_flight", 0))


def _wait_idle(admin: PdClusterClient, timeout_s: float = 120) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while True:
        status = admin.status()
        workers = [w for pool in status["pools"].values() for w in pool]
        idle = (not status["router"]["num_running"] and all(
            w["state"] == "ready" and w["num_free_blocks"] == w["num_blocks"]
            and not w["num_running"] and not w["num_waiting"] for w in workers))
        if idle or time.monotonic() > deadline:
            return workers
        time.sleep(0.5)


def soak(duration_s: float, concurrency: int, seed: int) -> dict[str, Any]:
    """Run the soak; returns the tally and the fault timeline."""
    api_key, admin_key = secrets.token_hex(8), secrets.token_hex(8)
    proc, grpc_address, http_url = _serve(api_key, admin_key)
    events: list[str] = []
    try:
        load = Load(grpc_address, http_url, api_key, seed)
        threads = [threading.Thread(target=load.run, args=(i,), daemon=True)
                   for i in range(concurrency)]
        start = time.monotonic()
        for t in threads:
            t.start()
        admin = PdClusterClient(grpc_address, timeout=300, api_key=api_key, admin_key=admin_key)

        def at(share: float, what: str, action: Any) -> None:
            time.sleep(max(start + share * duration_s - time.monotonic(), 0))
            detail = action()
            events.append(f"{time.monotonic() - start:6.1f} s  {what} {detail or ''}".rstrip())
            print(events[-1], flush=True)

        def kill(role: str) -> str:
            victim = _victim(admin, role)
            os.kill(victim["pid"], signal.SIGKILL)
            return f"{victim['worker_id']} (pid {victim['pid']}, {victim['in_flight']} in flight)"

        at(0.2, "SIGKILL decode worker", lambda: kill("decode"))
        at(0.4, "SIGKILL prefill worker", lambda: kill("prefill"))
        def scale(decode: int) -> None:
            admin.scale(decode=decode)

        at(0.55, "scale decode 2 -> 1", lambda: scale(1))
        at(0.75, "scale decode 1 -> 2", lambda: scale(2))
        at(1.0, "stop load", load.stop.set)
        for t in threads:
            t.join(300)
        workers = _wait_idle(admin)
        leaked = sum(w["num_blocks"] - w["num_free_blocks"] for w in workers)
        metrics = httpx.get(f"{http_url}/metrics").text
        admin.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    counts = load.tally.counts
    lost = counts["sent"] - counts["completed"] - counts["aborted_by_client"] - counts["failed"] \
        - counts["lost"]
    return {"sent": counts["sent"], "completed": counts["completed"],
            "aborted_by_client": counts["aborted_by_client"], "failed": counts["failed"],
            "lost": counts["lost"] + lost, "wrong_tokens": counts["wrong_tokens"],
            "kv_blocks_leaked": leaked, "workers_at_end": len(workers),
            "migrations": _metric(metrics, "pdcluster:migrations_total"),
            "transfer_retries": _metric(metrics, "pdcluster:transfer_retries_total"),
            "events": events, "errors": load.tally.errors[:10]}


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=150.0, help="seconds of load")
    parser.add_argument("--concurrency", type=int, default=8, help="client threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    result = soak(args.duration, args.concurrency, args.seed)
    for key in ("sent", "completed", "aborted_by_client", "failed", "lost", "wrong_tokens",
                "kv_blocks_leaked", "migrations", "transfer_retries"):
        print(f"{key:>18}: {result[key]:g}")
    for error in result["errors"]:
        print(f"  error: {error}")
    ok = not (result["failed"] or result["lost"] or result["wrong_tokens"]
              or result["kv_blocks_leaked"])
    print("soak:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

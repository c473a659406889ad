"""Hugging Face `transformers` static batching as a benchmark peer (runs in the main venv).

    python experiments/hf_peer.py --model-dir DIR --workload W.json --out R.json [--batch-size 8]

Requests run in batches of `--batch-size`, in request order, left-padded. Each batch decodes
until its longest request is done (that waste is what static batching costs); only each
request's own `max_tokens` count as output. EOS neither stops nor is masked, as `ignore_eos`
in vLLM. Writes the same result JSON as `experiments/vllm_peer.py`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedModel


def generate_static(model: PreTrainedModel, requests: list[dict], batch_size: int,
                    pad_token_id: int) -> list[list[int]]:
    """Greedy-decode `requests` (`prompt_token_ids`, `max_tokens`) in static batches.

    Returns:
        Each request's output token ids, exactly `max_tokens` of them, in request order.
    """
    outputs = []
    for first in range(0, len(requests), batch_size):
        batch = requests[first:first + batch_size]
        width = max(len(r["prompt_token_ids"]) for r in batch)
        input_ids = torch.full((len(batch), width), pad_token_id)  # [batch, width]
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            n = len(r["prompt_token_ids"])
            input_ids[row, width - n:] = torch.tensor(r["prompt_token_ids"])
            attention_mask[row, width - n:] = 1
        new_tokens = max(r["max_tokens"] for r in batch)
        # eos_token_id=[]: EOS neither stops nor is masked (vLLM's ignore_eos). None would fall
        # back to the model's EOS, and min_new_tokens would mask it (other greedy tokens).
        config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=[],
                                  pad_token_id=pad_token_id)
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                             generation_config=config)
        outputs += [out[row, width:width + r["max_tokens"]].tolist()
                    for row, r in enumerate(batch)]
    return outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    if args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")

    workload = json.loads(args.workload.read_text())
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    pad_token_id = model.config.pad_token_id or 0  # masked by attention_mask; any id will do
    generate_static(model, [{"prompt_token_ids": list(range(100, 116)), "max_tokens": 4}],
                    1, pad_token_id)
    startup_s = time.perf_counter() - start

    start = time.perf_counter()
    outputs = generate_static(model, workload["requests"], args.batch_size, pad_token_id)
    generate_s = time.perf_counter() - start

    args.out.write_text(json.dumps({
        "engine": "hf", "version": f"transformers {transformers.__version__}",
        "startup_s": startup_s, "generate_s": generate_s, "output_token_ids": outputs,
    }))


if __name__ == "__main__":
    main()

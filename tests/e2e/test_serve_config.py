"""`pdcluster serve --config FILE.yaml` for real: a prefill and a decode pool built with
different settings from one file, greedy output equal to the engine's, and `status`
(`--json` and the table, piped) showing each pool's settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from commands.cli import main
from engine import LLM, CacheConfig, SamplingParams
from router.client import PdClusterClient
from tests.e2e.serving import serve

pytestmark = pytest.mark.e2e

GB = 2**30
CONFIG = """
model: tiny
mode: disaggregated
transport: zmq
local-prefill-threshold: 0
prefill:
  replicas: 1
  max-num-batched-tokens: 256
  max-num-seqs: 4
  kv-cache-gb: 0.0625
decode:  # vLLM's files write underscores: the same keys
  replicas: 1
  max_num_batched_tokens: 128
  max_num_seqs: 8
  kv_cache_gb: 0.125
"""


def test_a_config_file_builds_each_pool_with_its_own_settings(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text(CONFIG)
    prompt = list(range(5, 45))
    params = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    reference = LLM("tiny", dtype="float32", cache=CacheConfig(num_blocks=64))
    expected = reference.generate([prompt], SamplingParams(**params))[0].outputs[0].token_ids
    block_bytes = reference.engine.kv_cache.block_bytes * reference.engine.model_config.num_layers
    with serve("--config", str(path)) as served:
        with PdClusterClient(served.grpc, timeout=60) as client:
            outputs = list(client.generate(prompt_token_ids=prompt, **params))
        assert [t for out in outputs for t in out.token_ids] == expected

        assert main(["status", "--json", "--address", served.grpc]) == 0
        status = json.loads(capsys.readouterr().out)
        settings = status["pool_settings"]
        assert (settings["prefill"]["max_num_batched_tokens"], settings["prefill"]["max_num_seqs"],
                settings["prefill"]["kv_cache_memory_gb"]) == (256, 4, 0.0625)
        assert (settings["decode"]["max_num_batched_tokens"], settings["decode"]["max_num_seqs"],
                settings["decode"]["kv_cache_memory_gb"]) == (128, 8, 0.125)
        # What each worker's engine actually built: its pool's KV budget in blocks.
        (prefill,), (decode,) = status["pools"]["prefill"], status["pools"]["decode"]
        assert prefill["num_blocks"] == int(0.0625 * GB) // block_bytes
        assert decode["num_blocks"] == int(0.125 * GB) // block_bytes

        assert main(["status", "--address", served.grpc]) == 0
        table = capsys.readouterr().out
        rows = {line.split("│")[1].strip(): line for line in table.splitlines()
                if line.count("│") >= 3}
        # The cells themselves, prefill then decode ("4" alone would also match "64").
        assert [cell.strip() for cell in rows["max_num_seqs"].split("│")[2:4]] == ["4", "8"]
        assert "…" not in table  # piped: no column cut to fit 80 characters

        # Scaled live, prefill 1 -> 0 and decode 1 -> 2: the pools differ, so no prefill
        # worker turns decode in place (it would keep its smaller KV pool); a new decode
        # worker of the decode pool's spec starts.
        assert main(["scale", "--prefill", "0", "--decode", "2", "--address",
                     served.grpc]) == 0
        assert "pools now" in capsys.readouterr().out
        assert main(["status", "--json", "--address", served.grpc]) == 0
        decodes = json.loads(capsys.readouterr().out)["pools"]["decode"]
        assert len(decodes) == 2
        assert decode["worker_id"] in {w["worker_id"] for w in decodes}
        assert [w["num_blocks"] for w in decodes] == [decode["num_blocks"]] * 2
        assert prefill["worker_id"] not in {w["worker_id"] for w in decodes}

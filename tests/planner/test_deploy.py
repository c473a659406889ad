"""The plan's answer to act on: the serve command (read back by `pdcluster serve`'s own
parser), the KubeRay worker groups, and calibration by default."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from commands.cli import build_parser, main
from engine.hardware import cpu_features
from planner.analytic import StepModel, analytic_profile
from planner.deploy import deployment
from planner.profile import LinearModel
from planner.specs import load_accelerator, load_model_shape
from tests.planner.synthetic import synthetic_profile
from tests.planner.test_plan import PROFILE, write_trace

DISAGG = {"mode": "disaggregated", "prefill": 2, "decode": 3, "threads_per_worker": 1,
          "max_num_batched_tokens": 1024, "local_prefill_threshold": 64}


def test_the_serve_command_builds_the_configuration_as_profiled() -> None:
    deploy = deployment(DISAGG, PROFILE, PROFILE, max_num_seqs=32)
    assert deploy["serve_command"] == (
        "pdcluster serve --model synthetic --mode disaggregated --prefill 2 --decode 3 "
        "--dtype float32 --torch-threads 1 --kv-cache-gb 1 --max-num-batched-tokens 1024 "
        "--max-num-seqs 32 --local-prefill-threshold 64 --transport shm")
    args = build_parser().parse_args(deploy["serve_argv"][1:])
    assert (args.command, args.model, args.mode, args.prefill, args.decode) == (
        "serve", "synthetic", "disaggregated", 2, 3)
    assert (args.max_num_batched_tokens, args.local_prefill_threshold, args.max_num_seqs,
            args.kv_cache_memory_gb, args.dtype, args.num_gpus_per_worker) == (
        1024, 64, 32, 1.0, "float32", 0.0)
    assert deploy["notes"] == [] and deploy["tensor_parallel"] == {"prefill": 1, "decode": 1}


def test_an_analytic_tp_pick_reserves_its_gpus_in_both_forms() -> None:
    model = StepModel(load_model_shape("llama-3-70b"), load_accelerator("H100-SXM"), 4)
    profile = analytic_profile(model)
    deploy = deployment(DISAGG, profile, profile, max_num_seqs=64)
    args = build_parser().parse_args(deploy["serve_argv"][1:])
    assert (args.num_gpus_per_worker, args.dtype, args.model) == (
        4.0, "bfloat16", "llama-3-70b")
    assert args.kv_cache_memory_gb == pytest.approx(profile.kv_cache_gb, rel=1e-3)
    groups = yaml.safe_load(deploy["kuberay_worker_groups"])["workerGroupSpecs"]
    assert [(g["groupName"], g["replicas"]) for g in groups] == [("prefill", 2), ("decode", 3)]
    for g in groups:
        container = g["template"]["spec"]["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
        assert container["resources"]["requests"] == container["resources"]["limits"]
        assert g["template"]["metadata"]["labels"]["pdcluster.io/tensor-parallel"] == "4"
        assert g["rayStartParams"]["resources"] == f"'{{\"pd_{g['groupName']}\": 1}}'"
    assert any("not sharded" in note for note in deploy["notes"])
    assert any("analytic profile" in note for note in deploy["notes"])
    colocated = deployment({**DISAGG, "mode": "colocated", "prefill": 0}, profile, profile, 64)
    assert "--prefill" not in colocated["serve_argv"]
    assert [g["groupName"] for g in yaml.safe_load(
        colocated["kuberay_worker_groups"])["workerGroupSpecs"]] == ["decode"]


def plan_cli(tmp_path: Path, profile: object, *flags: str) -> dict:
    path = tmp_path / "profile.json"
    profile.save(path)
    rows = [{"timestamp": 0.5 * i, "prompt_len": 300, "output_len": 8} for i in range(40)]
    trace_path = write_trace(tmp_path / "trace.jsonl", rows)
    out = tmp_path / "plan.json"
    assert main(["plan", "--profile", str(path), "--trace", str(trace_path), "--rate", "1",
                 "--slo", "ttft_p90_ms=2000,tpot_p90_ms=50", "--max-workers", "2",
                 "--modes", "colocated", "-o", str(out), *flags]) == 0
    return json.loads(out.read_text())


def test_plan_writes_and_prints_the_command_for_its_pick(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = plan_cli(tmp_path, PROFILE)
    assert (doc["recommended"]["mode"], doc["recommended"]["decode"]) == ("colocated", 1)
    command = doc["deploy"]["serve_command"]
    assert command.startswith("pdcluster serve --model synthetic --mode colocated --decode 1 ")
    printed = capsys.readouterr().out
    assert "serve it:" in printed and command in printed.replace("\n", " ")
    assert "groupName: decode" in printed
    # The synthetic profile names no machine: it is planned on as measured, and says why.
    assert doc["calibration"] == {"applied": False,
                                  "reason": "profiled on an unnamed machine, not on this "
                                            f"{cpu_features().model}"}


def test_plan_calibrates_a_profile_of_this_machine_by_default(tmp_path: Path) -> None:
    """A profile of the tiny model claiming this CPU and 1 s steps: `plan` probes the engine,
    scales the steps far down, and predicts far lower latency than `--no-calibrate`. (The
    probe engine's KV pool is the profile's: 20 MB holds the probes.)"""
    slow = replace(synthetic_profile(prefill=(1.0, 0.0, 0.0, 0.0), model="tiny"),
                   decode=LinearModel(("b1", "b2", "b4", "b8", "b16", "context"),
                                      (1.0, 1.0, 1.0, 1.0, 1.0, 0.0)),
                   hardware={"cpu": cpu_features().model, "gpu": None}, kv_cache_gb=0.02)
    calibrated = plan_cli(tmp_path, slow)
    raw = plan_cli(tmp_path, slow, "--no-calibrate")
    assert calibrated["calibration"]["applied"] is True
    assert 0 < calibrated["calibration"]["decode"]["factors"]["decode_b1"] < 0.5
    assert raw["calibration"] == {"applied": False, "reason": "--no-calibrate"}
    one = {(c["mode"], c["decode"]): c["predicted"] for c in calibrated["configs"]}
    unscaled = {(c["mode"], c["decode"]): c["predicted"] for c in raw["configs"]}
    assert one[("colocated", 1)]["tpot_p50_ms"] < 0.5 * unscaled[("colocated", 1)][
        "tpot_p50_ms"]

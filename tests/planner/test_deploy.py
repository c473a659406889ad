"""The plan's answer to act on, read back by what would run it: the serve config file and
command through `pdcluster serve`'s own parser and config loader into the cluster's
`ClusterConfig`, the RayCluster through KubeRay's CRD schema (the excerpt
tests/deploy/test_manifests.py checks the base manifests with), and calibration by
default."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from cluster.config import TRANSPORTS
from commands.cli import main, parse_args
from commands.serve import _served_model
from engine.hardware import cpu_features
from planner.analytic import StepModel, analytic_profile
from planner.deploy import CONFIG_FILE, MODEL_PLACEHOLDER, deployment
from planner.prices import list_prices, worker_price
from planner.profile import LinearModel, Profile
from planner.specs import load_accelerator, load_model_shape
from tests.deploy.test_manifests import (
    KUBERAY_CRD_SPEC,
    assert_pools_fit,
    crd_violations,
    every_pod,
    restricted_violations,
)
from tests.planner.synthetic import synthetic_profile
from tests.planner.test_plan import PROFILE, write_trace

DISAGG = {"mode": "disaggregated", "prefill": 2, "decode": 3, "threads_per_worker": 1,
          "max_num_batched_tokens": 1024, "local_prefill_threshold": 64}
# What `profile --analytic --hardware cpu` writes of a CPU (planner/analytic.py): its
# transfer priced as a copy between processes, 4 workers to a host.
CPU_ANALYTIC = replace(PROFILE, transport="network", workers_per_host=4,
                       hardware={"accelerator": "cpu", "tp": 1, "analytic": True,
                                 "gpu": None})


def gpu_profile(accelerator: str, tp: int = 1, model: str = "llama-3-8b") -> Profile:
    return analytic_profile(StepModel(load_model_shape(model), load_accelerator(accelerator),
                                      tp))


def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, deploy: dict[str, Any]) -> Any:
    """The `ClusterConfig` that `deploy`'s command builds, as `pdcluster serve` would in a
    folder holding its config file: the real parser, config loader and pool builder
    (nothing is started)."""
    (tmp_path / deploy["serve_config_file"]).write_text(deploy["serve_config"])
    monkeypatch.chdir(tmp_path)
    assert deploy["serve_argv"][:2] == ["pdcluster", "serve"]
    return _served_model(parse_args(deploy["serve_argv"][1:]), None).cluster


def manifest(deploy: dict[str, Any]) -> dict[str, Any]:
    (cluster,) = [d for d in yaml.safe_load_all(deploy["kuberay_manifest"]) if d]
    return cluster


def assert_valid_raycluster(cluster: dict[str, Any], pools: Any) -> dict[str, dict]:
    """The manifest passes KubeRay's CRD schema and the restricted pod profile, has the
    head and the front door's group, and its pool groups hold the pools' workers."""
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    assert crd_violations(cluster["spec"], KUBERAY_CRD_SPEC, "spec") == []
    for at, pod in every_pod([cluster], "plan"):
        assert restricted_violations(pod, at) == []
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    assert groups["frontdoor"]["rayStartParams"]["resources"] == "'{\"pd_frontdoor\": 1}'"
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    assert_pools_fit(groups, SimpleNamespace(cluster=pools))
    return groups


def test_a_cpu_analytic_plan_serves_as_planned(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """2P+3D on a CPU: the file and command parse into the pools the plan simulated, over
    shm (the copy the analytic CPU profile priced: 5 workers on one 4-worker host would
    not fit, so zmq there)."""
    deploy = deployment(DISAGG, CPU_ANALYTIC, CPU_ANALYTIC, max_num_seqs=32,
                        model=str(tmp_path / "smollm2"))
    assert deploy["serve_command"] == (f"pdcluster serve --model {tmp_path / 'smollm2'} "
                                       f"--config {CONFIG_FILE}")
    cluster = served(tmp_path, monkeypatch, deploy)
    assert (cluster.model, cluster.mode, cluster.num_prefill, cluster.num_decode,
            cluster.transports, cluster.local_prefill_threshold) == (
        str(tmp_path / "smollm2"), "disaggregated", 2, 3, TRANSPORTS["zmq"], 64)
    for pool in (cluster.prefill, cluster.decode):
        assert (pool.num_cpus, pool.num_gpus, pool.resource) == (1.0, 0.0, None)
        assert {k: pool.engine[k] for k in ("dtype", "kv_cache_memory_gb", "max_num_seqs",
                                             "max_num_batched_tokens", "torch_threads")} == {
            "dtype": "float32", "kv_cache_memory_gb": 1.0, "max_num_seqs": 32,
            "max_num_batched_tokens": 1024, "torch_threads": 1}
    groups = assert_valid_raycluster(manifest(deploy), cluster)
    assert [(g["groupName"], g["replicas"]) for g in groups.values()] == [
        ("frontdoor", 1), ("prefill", 2), ("decode", 3)]
    assert "nvidia.com/gpu" not in str(groups)
    one_host = deployment({**DISAGG, "prefill": 1, "decode": 2}, CPU_ANALYTIC, CPU_ANALYTIC,
                          32, "tiny")
    assert served(tmp_path, monkeypatch, one_host).transports == TRANSPORTS["shm"]
    assert deploy["tensor_parallel"] == {"prefill": 1, "decode": 1}


def test_a_gpu_plan_gives_each_pool_its_own_gpus_and_an_rdma_capable_transport(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill on L40S, decode on H100: each pool's workers ask one GPU and its own KV
    pool, each group's pods hold exactly that, and KV moves over torch (NCCL)."""
    prefill, decode = gpu_profile("L40S"), gpu_profile("H100-SXM")
    deploy = deployment(DISAGG, prefill, decode, max_num_seqs=64)
    cluster = served(tmp_path, monkeypatch, {
        **deploy, "serve_argv": [a if a != MODEL_PLACEHOLDER else "tiny"
                                 for a in deploy["serve_argv"]]})
    assert (cluster.transports, cluster.num_prefill, cluster.num_decode) == (
        TRANSPORTS["torch"], 2, 3)
    for pool, profile in ((cluster.prefill, prefill), (cluster.decode, decode)):
        assert (pool.num_gpus, pool.engine["dtype"]) == (1.0, "bfloat16")
        assert pool.engine["kv_cache_memory_gb"] == pytest.approx(profile.kv_cache_gb,
                                                                  abs=0.01)
    assert cluster.prefill.engine["kv_cache_memory_gb"] < cluster.decode.engine[
        "kv_cache_memory_gb"]
    groups = assert_valid_raycluster(manifest(deploy), cluster)
    for role in ("prefill", "decode"):
        limits = groups[role]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == 1 and "amd.com/gpu" not in limits
    assert any("analytic profile" in note for note in deploy["notes"])
    assert any(MODEL_PLACEHOLDER in note for note in deploy["notes"])


def test_an_amd_plan_asks_for_amd_gpus() -> None:
    profile = gpu_profile("MI300X")
    deploy = deployment({**DISAGG, "mode": "colocated", "prefill": 0}, profile, profile, 64)
    cluster = manifest(deploy)
    assert crd_violations(cluster["spec"], KUBERAY_CRD_SPEC, "spec") == []
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    assert list(groups) == ["frontdoor", "decode"]
    pod = groups["decode"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["amd.com/gpu"] == 1
    assert "nvidia.com/gpu" not in str(cluster)
    assert pod["tolerations"][0]["key"] == "amd.com/gpu"


def test_tp_picks_serve_split_each_pool_asking_its_own_gpus(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A colocated TP-4 pick: each worker asks 4 GPUs and splits its model over 4 ranks,
    and the real CLI builds that pool (tiny's 4 heads and 2 KV heads split into 4: the
    serve check reads the model). A disaggregated TP-1 prefill -> TP-2 decode pick: the
    real CLI builds pools of 1 and 2 GPUs a worker, split 1 and 2 ways, and the manifest's
    groups ask the same."""
    profile = gpu_profile("H100-SXM", tp=4, model="llama-3-70b")
    colocated = deployment({**DISAGG, "mode": "colocated", "prefill": 0}, profile, profile,
                           max_num_seqs=64)
    assert colocated["tensor_parallel"] == {"prefill": None, "decode": 4}
    cluster = served(tmp_path, monkeypatch, {
        **colocated, "serve_argv": [a if a != MODEL_PLACEHOLDER else "tiny"
                                    for a in colocated["serve_argv"]]})
    assert (cluster.mode, cluster.decode.num_gpus,
            cluster.decode.engine["tensor_parallel_size"]) == ("colocated", 4.0, 4)
    groups = assert_valid_raycluster(manifest(colocated), cluster)
    limits = groups["decode"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 4
    deploy = deployment(DISAGG, gpu_profile("H100-SXM"),
                        gpu_profile("H100-SXM", tp=2, model="llama-3-70b"), max_num_seqs=64)
    assert deploy["tensor_parallel"] == {"prefill": 1, "decode": 2}
    cluster = served(tmp_path, monkeypatch, {
        **deploy, "serve_argv": [a if a != MODEL_PLACEHOLDER else "tiny"
                                 for a in deploy["serve_argv"]]})
    assert cluster.mode == "disaggregated"
    assert [(pool.num_gpus, pool.engine["tensor_parallel_size"])
            for pool in (cluster.prefill, cluster.decode)] == [(1.0, 1), (2.0, 2)]
    groups = assert_valid_raycluster(manifest(deploy), cluster)
    assert [groups[role]["template"]["spec"]["containers"][0]["resources"]["limits"][
        "nvidia.com/gpu"] for role in ("prefill", "decode")] == [1, 2]


def test_serve_refuses_the_placeholder_before_starting_anything(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    deploy = deployment(DISAGG, CPU_ANALYTIC, CPU_ANALYTIC, max_num_seqs=32)
    assert deploy["serve_argv"][2:4] == ["--model", MODEL_PLACEHOLDER]
    (tmp_path / CONFIG_FILE).write_text(deploy["serve_config"])
    monkeypatch.chdir(tmp_path)
    started = []
    monkeypatch.setattr("cluster.serve.run", lambda *a: started.append(a))
    assert main(deploy["serve_argv"][1:]) == 2
    assert started == []
    assert (f"error: --model {MODEL_PLACEHOLDER} is the placeholder `pdcluster plan` writes "
            "without --model: replace it with the model's folder") in capsys.readouterr().err


def test_every_accelerator_has_a_cited_list_price() -> None:
    """Every SKU of the accelerator table is priced, with its source and date; a worker
    costs its accelerators (TP x the price), a CPU 1 per hour."""
    table = yaml.safe_load((Path(__file__).resolve().parents[2] / "planner" / "data"
                            / "accelerators.yaml").read_text())
    prices = list_prices()
    assert set(table) == set(prices)
    for name, entry in prices.items():
        assert entry["usd_per_hour"] > 0 and entry["source"].startswith("https://"), name
        assert str(entry["date"]).startswith("20"), name
    assert worker_price(gpu_profile("H100-SXM", tp=2)) == pytest.approx(
        2 * prices["H100-SXM"]["usd_per_hour"])
    assert worker_price(gpu_profile("MI300X"), per_accelerator=2.0) == 2.0
    assert worker_price(CPU_ANALYTIC) == 1.0


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
    doc = plan_cli(tmp_path, PROFILE, "--model", "/models/smollm2")
    assert (doc["recommended"]["mode"], doc["recommended"]["decode"]) == ("colocated", 1)
    command = doc["deploy"]["serve_command"]
    assert command == f"pdcluster serve --model /models/smollm2 --config {CONFIG_FILE}"
    assert yaml.safe_load(doc["deploy"]["serve_config"])["decode"]["replicas"] == 1
    printed = capsys.readouterr().out
    assert "serve it:" in printed and command in printed.replace("\n", " ")
    assert "replicas: 1" in printed
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

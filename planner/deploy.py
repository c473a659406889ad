"""The plan's pick as something to run: the `pdcluster serve` command and the KubeRay
worker groups (`deploy/kuberay/base/raycluster.yaml`'s form) that build it."""

from __future__ import annotations

import math
import shlex
from typing import Any

import yaml

from planner.profile import Profile

# `pdcluster serve --dtype` choices; a profile's other dtypes (fp8) serve as `auto`.
SERVE_DTYPES = ("float32", "bfloat16", "float16")
IMAGE = "registry.example.com/pdcluster:0.1.0-cuda"
CPU_IMAGE = "registry.example.com/pdcluster:0.1.0-cpu"  # deploy/Dockerfile's CPU build


def tensor_parallel(profile: Profile) -> int:
    """Devices per worker: an analytic profile's TP, 1 for a measured one."""
    return int(profile.hardware.get("tp", 1))


def serve_argv(config: dict[str, Any], prefill: Profile, decode: Profile,
               max_num_seqs: int) -> list[str]:
    """`pdcluster serve` argv that builds `config` (a plan's entry) as its profiles ran."""
    dtype = decode.dtype if decode.dtype in SERVE_DTYPES else "auto"
    argv = ["pdcluster", "serve", "--model", decode.model, "--mode", config["mode"]]
    if config["mode"] == "disaggregated":
        argv += ["--prefill", str(config["prefill"])]
    argv += ["--decode", str(config["decode"]), "--dtype", dtype,
             "--torch-threads", str(config["threads_per_worker"]),
             "--kv-cache-gb", f"{math.floor(decode.kv_cache_gb * 100) / 100:g}",
             "--max-num-batched-tokens", str(config["max_num_batched_tokens"]),
             "--max-num-seqs", str(max_num_seqs),
             "--local-prefill-threshold", str(config["local_prefill_threshold"])]
    gpus = max(tensor_parallel(decode), tensor_parallel(prefill))
    if decode.hardware.get("gpu"):
        argv += ["--num-gpus-per-worker", str(gpus)]
    else:
        argv += ["--transport", decode.transport]
    return argv


def worker_groups(config: dict[str, Any], prefill: Profile, decode: Profile) -> str:
    """The RayCluster `workerGroupSpecs` for `config`: one group per role, `replicas` its
    workers, each pod one worker with its TP degree of GPUs (CPU workers: its threads)."""
    groups = []
    roles = [("prefill", config["prefill"], prefill)] if config["prefill"] else []
    roles.append(("decode", config["decode"], decode))
    for role, replicas, profile in roles:
        tp = tensor_parallel(profile)
        gpu = bool(profile.hardware.get("gpu"))
        limits: dict[str, Any] = {"cpu": str(max(profile.torch_threads, 1) + 1),
                                  "memory": "32Gi"}
        if gpu:
            limits["nvidia.com/gpu"] = tp
        groups.append({
            "groupName": role, "replicas": replicas, "minReplicas": replicas,
            "maxReplicas": replicas,
            "rayStartParams": {"resources": f"'{{\"pd_{role}\": 1}}'"},
            "template": {
                "metadata": {"labels": {"app.kubernetes.io/name": "pdcluster",
                                        "app.kubernetes.io/component": role,
                                        "pdcluster.io/tensor-parallel": str(tp)}},
                "spec": {"containers": [{
                    "name": "ray-worker", "image": IMAGE if gpu else CPU_IMAGE,
                    "resources": {"limits": limits, "requests": dict(limits)}}]}}})
    return yaml.safe_dump({"workerGroupSpecs": groups}, sort_keys=False)


def deployment(config: dict[str, Any], prefill: Profile, decode: Profile,
               max_num_seqs: int) -> dict[str, Any]:
    """The plan file's `deploy` object for its recommended configuration."""
    argv = serve_argv(config, prefill, decode, max_num_seqs)
    tp = {"prefill": tensor_parallel(prefill), "decode": tensor_parallel(decode)}
    notes = []
    if max(tp.values()) > 1:
        notes.append("pdcluster's engine runs one device per worker: with TP > 1 the "
                     "command reserves the GPUs but the model is not sharded across them")
    if prefill.hardware.get("analytic") or decode.hardware.get("analytic"):
        notes.append("planned on an analytic profile: profile the hardware once it runs "
                     "(`pdcluster profile`) and plan again before relying on the figures")
    return {"serve_argv": argv, "serve_command": shlex.join(argv),
            "tensor_parallel": tp, "kuberay_worker_groups": worker_groups(config, prefill,
                                                                          decode),
            "notes": notes}

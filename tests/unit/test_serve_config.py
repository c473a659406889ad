"""`serve --config FILE.yaml` and `PDCLUSTER_*`: precedence (command line > environment >
file > defaults), per-pool sections reaching each pool's spec, `models:` (one cluster and
router config per entry, its values over the shared ones), errors naming file and key
(exit code 2, nothing started); the GPU-aware KV sizing decided from device facts."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

import cluster.serve
from cluster.config import ClusterConfig, PoolSpec
from commands.cli import main
from engine import CacheConfig, defaults
from engine.config import kv_pool_bytes, parse_dtype
from tests.pki import make_pki

REPO = Path(__file__).resolve().parents[2]
GB = 2**30


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Replaces `cluster.serve.run`: the options are kept, nothing is started; no
    `PDCLUSTER_*` variable of the caller leaks in."""
    seen: list[Any] = []

    async def run(options: Any) -> None:
        seen.append(options)

    monkeypatch.setattr(cluster.serve, "run", run)
    for name in [k for k in os.environ if k.startswith("PDCLUSTER_")]:
        monkeypatch.delenv(name)
    return seen


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    return path


def serve(captured: list[Any], *argv: str) -> Any:
    assert main(["serve", "--model", "tiny", *argv]) == 0
    return captured[-1]


def test_command_line_beats_environment_beats_file_beats_defaults(
        captured: list[Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, "max-num-seqs: 11\nmax-queue: 12\nmax-running: 13\n"
                           "grpc-port: 0\nport: 0\n")
    monkeypatch.setenv("PDCLUSTER_MAX_QUEUE", "22")
    monkeypatch.setenv("PDCLUSTER_MAX_RUNNING", "23")
    options = serve(captured, "--config", str(path), "--max-running", "33")
    router = options.router
    assert router.max_running == 33  # command line over environment and file
    assert router.max_queue == 22  # environment over file
    assert options.cluster.decode.engine["max_num_seqs"] == 11  # file over the default
    assert options.cluster.decode.engine["max_num_batched_tokens"] == \
        defaults.MAX_NUM_BATCHED_TOKENS  # untouched: the default
    assert (options.grpc_port, options.http_port) == (0, 0)  # `port` is --http-port's name


def test_environment_alone_and_the_config_file_by_environment(
        captured: list[Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDCLUSTER_CONFIG", str(write(tmp_path, "mode: colocated\n")))
    monkeypatch.setenv("PDCLUSTER_NO_PREFIX_CACHING", "true")
    monkeypatch.setenv("PDCLUSTER_TORCH_THREADS", "3")
    config = serve(captured).cluster
    assert config.mode == "colocated"
    assert config.decode.engine["enable_prefix_caching"] is False
    assert config.decode.engine["torch_threads"] == 3


def test_pool_sections_override_the_shared_values_for_their_pool_only(
        captured: list[Any], tmp_path: Path) -> None:
    path = write(tmp_path, """
max-num-seqs: 32
torch-threads: 2
prefill:
  replicas: 2
  max-num-batched-tokens: 4096
  max-num-seqs: 4
  resource: big_cpu
  num-cpus-per-worker: 2
decode:
  replicas: 3
  kv-cache-gb: 0.5
  no-prefix-caching: true
""")
    config: ClusterConfig = serve(captured, "--config", str(path), "--max-num-seqs", "40",
                                  "--prefill", "1").cluster
    prefill, decode = config.prefill, config.decode
    assert (config.num_prefill, config.num_decode) == (1, 3)  # command line over replicas
    assert (prefill.engine["max_num_seqs"], decode.engine["max_num_seqs"]) == (4, 40)
    assert (prefill.engine["max_num_batched_tokens"],
            decode.engine["max_num_batched_tokens"]) == (4096, defaults.MAX_NUM_BATCHED_TOKENS)
    assert (prefill.engine["torch_threads"], decode.engine["torch_threads"]) == (2, 2)
    assert (prefill.engine["kv_cache_memory_gb"], decode.engine["kv_cache_memory_gb"]) == \
        (None, 0.5)
    assert (prefill.engine["enable_prefix_caching"],
            decode.engine["enable_prefix_caching"]) == (True, False)
    assert (prefill.num_cpus, decode.num_cpus) == (2.0, 1.0)
    assert config.pool_resource(decodes=False) == ("big_cpu", True)
    assert config.pool_resource(decodes=True) == ("pd_decode", False)
    shown = config.pool_settings()
    assert (shown["prefill"]["max_num_seqs"], shown["decode"]["max_num_seqs"]) == (4, 40)
    assert shown["prefill"]["resource"] == "big_cpu"


def test_torch_threads_auto_lets_a_pools_threads_follow_the_free_cores(
        captured: list[Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "torch-threads: 2\ndecode:\n  torch-threads: auto\n")
    config = serve(captured, "--config", str(path)).cluster
    # None: the engine's `ThreadGovernor` sets them from the cores others leave free.
    assert (config.prefill.engine["torch_threads"], config.decode.engine["torch_threads"]) \
        == (2, None)
    config = serve(captured, "--torch-threads", "AUTO").cluster
    assert (config.prefill.engine["torch_threads"], config.decode.engine["torch_threads"]) \
        == (None, None)
    with pytest.raises(SystemExit):
        main(["serve", "--model", "tiny", "--torch-threads", "0"])
    assert "--torch-threads: expected a thread count >= 1 or auto, got '0'" in \
        capsys.readouterr().err


@pytest.mark.parametrize(("text", "message"), [
    ("max-num-seqs: many\n", "max-num-seqs: Input should be a valid integer"),
    ("max-num-seq: 4\n", "max-num-seq: unknown key"),
    ("decode:\n  replica: 2\n", "decode.replica: unknown key"),
    ("prefill:\n  port: 9000\n", "prefill.port: unknown key"),  # not a per-worker setting
    ("prefill:\n  max-num-seqs: 1.5\n", "prefill.max-num-seqs: Input should be a valid integer"),
    ("decode:\n  replicas: -1\n", "decode.replicas: Input should be greater than or equal"),
    ("mode: split\n", "mode: Input should be 'disaggregated' or 'colocated'"),
    ("no-migration: maybe\n", "no-migration: Input should be a valid boolean"),
    ("port: null\n", "port: Input should be a valid integer"),
    # a value a flag's own parser refuses, with its message
    ("slo: bogus\n", "slo: Value error, slo: expected KEY=MS, got 'bogus'"),
    ("prefill:\n  torch-threads: lots\n",
     "prefill.torch-threads: Value error, expected a thread count >= 1 or auto, got 'lots'"),
    ("decode:\n  max-num-seqs: null\n", "decode.max-num-seqs: Input should be a valid integer"),
    ("- port: 1\n", "expected a mapping of flag names to values, got list"),
    ("port: [1\n", "while parsing a flow sequence"),
    # several models (`models:`)
    ("models:\n  - model: tiny\n  - model: tiny\n    mode: colocated\n",
     "models.1.served-model-name: 'tiny' is already served by models.0 (names must differ)"),
    ("models:\n  - model: tiny\n    served-model-name: a\n  - model: smollm2\n"
     "    served-model-name: a\n",
     "models.1.served-model-name: 'a' is already served by models.0"),
    ("models:\n  - mode: colocated\n", "models.0.model: required"),
    ("models:\n  - model: tiny\n    port: 9000\n", "models.0.port: unknown key"),
    ("models:\n  - model: tiny\n    mode: mixed\n", "models.0.mode: Input should be"),
    ("models:\n  - model: tiny\n    decode:\n      replicas: -1\n",
     "models.0.decode.replicas: Input should be greater than or equal to 0"),
    ("models: []\n", "models: list at least one model"),
    ("model: tiny\nmodels:\n  - model: smollm2\n",
     "model: give it in each entry of models:, not beside it"),
    ("models:\n  model: tiny\n", "models: Input should be a valid list"),
])
def test_a_bad_file_is_refused_naming_file_and_key(
        captured: list[Any], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--config", str(path)])
    assert exit_.value.code == 2
    assert f"{path}: {message}" in capsys.readouterr().err
    assert captured == []


def test_the_messages_name_the_key(captured: list[Any], tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "max-num-seqs: many\nprefill:\n  bogus: 1\n")
    with pytest.raises(SystemExit):
        main(["serve", "--config", str(path)])
    err = capsys.readouterr().err
    assert f"{path}: max-num-seqs: Input should be a valid integer" in err
    assert f"{path}: prefill.bogus: unknown key" in err


def test_a_bad_environment_variable_is_refused_naming_it(
        captured: list[Any], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDCLUSTER_MAX_NUM_SEQS", "lots")
    with pytest.raises(SystemExit) as exit_:
        main(["serve"])
    assert exit_.value.code == 2
    assert "environment: PDCLUSTER_MAX_NUM_SEQS: Input should be a valid integer" in \
        capsys.readouterr().err
    assert captured == []


def test_pools_that_disagree_on_the_kv_layout_are_refused(
        captured: list[Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "prefill:\n  dtype: bfloat16\ndecode:\n  dtype: float32\n")
    assert main(["serve", "--config", str(path)]) == 2
    assert "prefill and decode dtype differ (bfloat16 vs float32)" in capsys.readouterr().err
    assert captured == []


def test_a_gpu_share_on_a_pool_without_gpus_is_refused(
        captured: list[Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "decode:\n  gpu-memory-utilization: 0.8\n"
                           "  num-gpus-per-worker: 1\nprefill:\n"
                           "  gpu-memory-utilization: 0.8\n")
    assert main(["serve", "--config", str(path)]) == 2
    assert "gpu-memory-utilization sizes the KV pool from accelerator memory, but these " \
           "workers get no GPU" in capsys.readouterr().err
    assert captured == []


def test_workers_sharing_a_gpu_without_their_share_of_its_memory_are_refused() -> None:
    with pytest.raises(ValueError) as default:
        PoolSpec(num_gpus=0.5)
    assert str(default.value) == (
        "num-gpus-per-worker 0.5 puts up to 2 workers on one GPU, but each would hold the "
        "default gpu-memory-utilization 0.9 of its memory: give each at most its share "
        "(--gpu-memory-utilization 0.45) or an absolute KV pool (--kv-cache-gb)")
    with pytest.raises(ValueError) as given:
        PoolSpec(num_gpus=0.25, engine={"gpu_memory_utilization": 0.3})
    assert str(given.value) == (
        "num-gpus-per-worker 0.25 puts up to 4 workers on one GPU, but each would hold "
        "gpu-memory-utilization 0.3 of its memory: give each at most its share "
        "(--gpu-memory-utilization 0.225) or an absolute KV pool (--kv-cache-gb)")


def test_a_gpu_share_within_the_workers_share_or_a_whole_gpu_is_accepted() -> None:
    specs = [PoolSpec(num_gpus=0.5, engine={"gpu_memory_utilization": 0.45}),
             PoolSpec(num_gpus=0.5, engine={"gpu_memory_utilization": 0.5}),
             PoolSpec(num_gpus=0.5, engine={"kv_cache_memory_gb": 2.0}),  # absolute, no share
             PoolSpec(num_gpus=1), PoolSpec(num_gpus=2), PoolSpec()]
    assert [spec.num_gpus for spec in specs] == [0.5, 0.5, 0.5, 1, 2, 0]


def test_serve_refuses_a_gpu_fraction_without_a_memory_share_before_starting(
        captured: list[Any], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--num-gpus-per-worker", "0.5"]) == 2
    assert "num-gpus-per-worker 0.5 puts up to 2 workers on one GPU" in capsys.readouterr().err
    assert captured == []
    options = serve(captured, "--num-gpus-per-worker", "0.5", "--gpu-memory-utilization", "0.45")
    assert options.cluster.decode.engine["gpu_memory_utilization"] == 0.45


def test_the_example_file_is_valid_and_the_guide_shows_it(captured: list[Any]) -> None:
    example = REPO / "deploy" / "pdcluster.yaml"
    config = serve(captured, "--config", str(example)).cluster
    assert (config.num_prefill, config.num_decode) == (1, 2)
    assert config.prefill.engine["max_num_seqs"] != config.decode.engine["max_num_seqs"]
    guide = (REPO / "docs" / "operators.md").read_text()
    blocks = [yaml.safe_load(b) for b in re.findall(r"^```yaml\n(.*?)^```", guide,
                                                    flags=re.M | re.S)]
    assert yaml.safe_load(example.read_text()) in blocks


def test_equal_pools_compare_equal() -> None:
    """The scaler trades roles in place only between pools built alike."""
    assert PoolSpec(engine={"max_num_seqs": 4}) == PoolSpec(engine={"max_num_seqs": 4})
    assert PoolSpec(engine={"max_num_seqs": 4}) != PoolSpec(engine={"max_num_seqs": 8})


# ---- several models: `models:` ----

TWO = """
dtype: float32
max-num-seqs: 16
max-running: 64
prefill:
  max-num-batched-tokens: 512
models:
  - model: smollm2
    mode: disaggregated
    prefill:
      replicas: 2
    decode:
      max-num-seqs: 8
  - model: tiny
    served-model-name: small
    mode: colocated
    max-running: 4
    torch-threads: 2
    decode:
      replicas: 3
"""


def test_each_entry_builds_a_model_of_its_own(captured: list[Any], tmp_path: Path) -> None:
    assert main(["serve", "--config", str(write(tmp_path, TWO))]) == 0
    options = captured[-1]
    (first, second) = options.models
    assert (first.name, first.cluster.model, first.cluster.mode) == \
        ("smollm2", "smollm2", "disaggregated")
    assert (first.cluster.num_prefill, first.cluster.num_decode) == (2, 1)
    # The shared prefill section reaches this model's prefill pool; its own decode section
    # wins over the shared max-num-seqs for its decode pool only.
    assert first.cluster.prefill.engine["max_num_batched_tokens"] == 512
    assert first.cluster.prefill.engine["max_num_seqs"] == 16
    assert first.cluster.decode.engine["max_num_seqs"] == 8
    assert first.router.max_running == 64
    assert (second.name, second.cluster.model, second.cluster.mode) == \
        ("small", "tiny", "colocated")
    assert second.cluster.num_decode == 3
    assert second.router.max_running == 4
    assert second.cluster.decode.engine["torch_threads"] == 2
    assert first.cluster.decode.engine["torch_threads"] == 1
    assert second.cluster.decode.engine["dtype"] == "float32"  # shared key reaches both


def test_without_models_the_file_means_one_model(captured: list[Any], tmp_path: Path) -> None:
    path = write(tmp_path, "model: tiny\nmode: colocated\n")
    assert main(["serve", "--config", str(path)]) == 0
    (only,) = captured[-1].models
    assert (only.name, only.cluster.mode) == ("tiny", "colocated")


def test_one_entry_with_a_bad_pool_is_refused_naming_the_model(
        captured: list[Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "models:\n  - model: tiny\n  - model: smollm2\n    prefill:\n"
                           "      dtype: bfloat16\n    decode:\n      dtype: float32\n")
    assert main(["serve", "--config", str(path)]) == 2
    assert "models.1 (smollm2): prefill and decode dtype differ (bfloat16 vs float32)" in \
        capsys.readouterr().err
    assert captured == []


@pytest.mark.parametrize(("flags", "flag"), [
    (["--autoscale", "--profile", "profile.json", "--slo", "ttft=500"], "--autoscale"),
    (["--detach"], "--detach")])
def test_autoscaling_and_detach_serve_one_model(
        captured: list[Any], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        flags: list[str], flag: str) -> None:
    path = write(tmp_path, "models:\n  - model: tiny\n  - model: smollm2\n")
    assert main(["serve", "--config", str(path), *flags]) == 2
    assert f"{flag} serves one model; this config serves 2" in capsys.readouterr().err
    assert captured == []


def test_the_two_model_example_is_valid(captured: list[Any]) -> None:
    example = REPO / "deploy" / "pdcluster-models.yaml"
    assert main(["serve", "--config", str(example)]) == 0
    modes = {m.name: m.cluster.mode for m in captured[-1].models}
    assert modes == {"smollm2": "disaggregated", "tiny": "colocated"}
    guide = (REPO / "docs" / "operators.md").read_text()
    blocks = [yaml.safe_load(b) for b in re.findall(r"^```yaml\n(.*?)^```", guide,
                                                    flags=re.M | re.S)]
    assert yaml.safe_load(example.read_text()) in blocks


# ---- GPU defaults, decided from the device facts ----

def test_auto_dtype_is_bf16_on_cuda_whatever_the_cpu() -> None:
    import torch

    assert parse_dtype("auto", torch.device("cuda")) == torch.bfloat16


def test_kv_pool_on_cpu_is_absolute_and_refuses_a_gpu_share() -> None:
    assert kv_pool_bytes(CacheConfig(kv_cache_memory_gb=None), "cpu") == \
        int(defaults.KV_CACHE_GB * GB)
    assert kv_pool_bytes(CacheConfig(kv_cache_memory_gb=0.5), "cpu") == GB // 2
    with pytest.raises(ValueError, match="this engine runs on CPU: give kv_cache_memory_gb"):
        kv_pool_bytes(CacheConfig(kv_cache_memory_gb=None, gpu_memory_utilization=0.8), "cpu")


def test_kv_pool_on_cuda_is_the_share_left_after_the_weights() -> None:
    default = CacheConfig(kv_cache_memory_gb=None)
    # 80 GiB card, 10 GiB of weights held: 0.9 x 80 - 10 = 62 GiB.
    assert kv_pool_bytes(default, "cuda", 80 * GB, 10 * GB) == 62 * GB
    share = CacheConfig(kv_cache_memory_gb=None, gpu_memory_utilization=0.5)
    assert kv_pool_bytes(share, "cuda", 80 * GB, 10 * GB) == 30 * GB
    assert kv_pool_bytes(CacheConfig(kv_cache_memory_gb=4.0), "cuda", 80 * GB, 10 * GB) == \
        4 * GB  # an absolute size wins on CUDA too
    with pytest.raises(ValueError, match="leaves nothing for the KV pool"):
        kv_pool_bytes(CacheConfig(kv_cache_memory_gb=None, gpu_memory_utilization=0.1),
                      "cuda", 80 * GB, 10 * GB)
    with pytest.raises(ValueError, match="give one"):
        CacheConfig(kv_cache_memory_gb=1.0, gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        CacheConfig(kv_cache_memory_gb=None, gpu_memory_utilization=1.5)


def test_a_vllm_command_line_serves_as_pdclusters_own_spelling(
        captured: list[Any], tmp_path: Path) -> None:
    """`vllm serve`'s spellings: the positional model, underscores in flag names (also with
    `=`), `--no-enable-prefix-caching`, `--ssl-*`, `--enable-auto-tool-choice
    --tool-call-parser hermes`, `--chat-template FILE`: the same options as pdcluster's."""
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    pki = make_pki(tmp_path)
    key, cert, ca = pki["server.key"], pki["server.pem"], pki["ca.pem"]
    vllm = ["tiny", "--max_num_seqs", "8", "--max-num-batched-tokens=256",
            "--no-enable-prefix-caching", "--served_model_name=m", "--port", "0",
            "--ssl-keyfile", key, "--ssl-certfile", cert, "--ssl-ca-certs", ca,
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--chat-template", str(template)]
    ours = ["--model", "tiny", "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
            "--no-prefix-caching", "--served-model-name", "m", "--http-port", "0",
            "--tls-key", key, "--tls-cert", cert, "--tls-client-ca", ca,
            "--chat-template", template.read_text()]
    assert main(["serve", *vllm]) == 0 and main(["serve", *ours]) == 0
    theirs, mine = captured
    assert theirs == mine
    assert theirs.cluster.model == "tiny" and theirs.http_port == 0
    assert theirs.cluster.decode.engine["max_num_seqs"] == 8
    assert theirs.cluster.decode.engine["enable_prefix_caching"] is False
    assert (theirs.security.tls_key, theirs.security.tls_cert,
            theirs.security.tls_client_ca) == (key, cert, ca)
    assert theirs.router.chat_template == template.read_text()
    assert theirs.router.served_model_name == "m"
    # `--enable-prefix-caching` wins over a file that turned it off.
    path = write(tmp_path, "no_enable_prefix_caching: true\n")
    config = serve(captured, "--config", str(path)).cluster
    assert config.decode.engine["enable_prefix_caching"] is False
    config = serve(captured, "--config", str(path), "--enable-prefix-caching").cluster
    assert config.decode.engine["enable_prefix_caching"] is True


def test_a_vllm_config_file_with_underscores_and_a_mapping_serves_as_pdclusters(
        captured: list[Any], tmp_path: Path) -> None:
    theirs = write(tmp_path, "model: tiny\nmax_num_seqs: 6\ntorch_threads: 2\n"
                             "enable_prefix_caching: false\n"
                             "speculative_config:\n  method: ngram\n"
                             "  num_speculative_tokens: 3\n  prompt_lookup_max: 4\n")
    assert main(["serve", "--config", str(theirs)]) == 0
    ours = tmp_path / "ours.yaml"
    ours.write_text("model: tiny\nmax-num-seqs: 6\ntorch-threads: 2\nno-prefix-caching: true\n"
                    "speculative-config: '{\"method\": \"ngram\", "
                    "\"num_speculative_tokens\": 3, \"prompt_lookup_max\": 4}'\n")
    assert main(["serve", "--config", str(ours)]) == 0
    (got, want) = captured
    assert got == want
    engine = got.cluster.decode.engine
    assert (engine["max_num_seqs"], engine["torch_threads"],
            engine["enable_prefix_caching"]) == (6, 2, False)
    assert engine["speculative_config"] is not None


@pytest.mark.parametrize(("argv", "message"), [
    (["tiny", "--model", "tiny"], "give the model once: as MODEL or as --model"),
    (["tiny", "--tool-call-parser", "mistral"], "--tool-call-parser: invalid choice"),
    (["tiny", "--max_num_partial_prefills", "2"],
     "unrecognized arguments: --max-num-partial-prefills"),
])
def test_vllm_spellings_it_does_not_take_are_refused_by_name(
        captured: list[Any], capsys: pytest.CaptureFixture[str], argv: list[str],
        message: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["serve", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert captured == []


def test_a_chat_template_that_is_neither_file_nor_template_is_refused(
        captured: list[Any], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "tiny", "--chat-template", "no-such-file.jinja"]) == 2
    assert ("--chat-template: 'no-such-file.jinja' is neither a file nor a Jinja template"
            in capsys.readouterr().err)
    assert captured == []

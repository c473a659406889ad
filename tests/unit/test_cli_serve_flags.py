"""`pdcluster serve` flags reach the cluster, the front doors and their security as given
(the options `serve` would run with, captured before anything starts)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cluster.config import TRANSPORTS
from commands.cli import main
from protocol.logs import LogConfig
from tests.pki import make_pki


def test_colocated_mode_and_pool_flags(captured: list[Any]) -> None:
    assert main(["serve", "--model", "tiny", "--mode", "colocated", "--decode", "3",
                 "--transport", "zmq", "--internal-auth", "off", "--drain-timeout", "7",
                 "--no-migration", "--local-prefill-threshold", "5", "--grpc-port", "0",
                 "--http-port", "0"]) == 0
    (options,) = captured
    config = options.cluster
    assert (config.model, config.mode, config.num_decode, config.num_workers) == \
        ("tiny", "colocated", 3, 3)
    assert config.transports == TRANSPORTS["zmq"] and config.internal_auth == "off"
    assert (config.drain_timeout_s, options.drain_timeout_s) == (7.0, 7.0)
    assert config.migrate is False and config.local_prefill_threshold == 5
    assert (options.host, options.grpc_port, options.http_port) == ("127.0.0.1", 0, 0)


@pytest.mark.parametrize(("flags", "ttft_slo_s"), [
    ([], None),  # no objective: arrival order
    (["--slo", "ttft_p90_ms=8000,ttft_ms=12000,tpot_p90_ms=150"], 8.0),  # the tightest
    (["--slo", "tpot_p90_ms=150"], None),  # no TTFT bound to order by
    (["--slo", "ttft=500", "--scheduling-policy", "fcfs"], None),
])
def test_the_slos_ttft_bound_orders_the_workers_queues_unless_fcfs(
        captured: list[Any], flags: list[str], ttft_slo_s: float | None) -> None:
    assert main(["serve", "--model", "tiny", *flags]) == 0
    (options,) = captured
    assert options.cluster.ttft_slo_s == ttft_slo_s


def _plan_inputs(tmp_path: Path) -> tuple[str, str]:
    """A profile of `tiny` whose decode step grows with the batch (10 ms + 0.5 ms a
    sequence), and 200 short chats at 8 req/s: every prompt is under the local-prefill
    threshold, so 1P+1D decodes them all on one worker (predicted up to ~8.7 req/s within
    TPOT p90 25 ms) and 2 colocated workers split them (~19 req/s)."""
    import json

    from tests.planner.synthetic import poisson_arrivals, synthetic_profile

    profile = tmp_path / "profile.json"
    synthetic_profile(prefill=(0.002, 1e-3, 0.0, 0.0), decode=(0.01, 0.0005, 0.0),
                      model="tiny").save(profile)
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": float(t), "prompt_len": 32,
                                         "output_len": 50}) + "\n"
                             for t in poisson_arrivals(200, 8.0, seed=5)))
    return str(profile), str(trace)


def test_with_no_split_given_serve_starts_the_planners_split_for_the_slo_and_trace(
        captured: list[Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile, trace = _plan_inputs(tmp_path)
    plan = ["--slo", "ttft_p90_ms=2000,tpot_p90_ms=25", "--profile", profile, "--trace", trace,
            "--max-workers", "2"]
    assert main(["serve", "--model", "tiny", *plan]) == 0
    config = captured[-1].cluster
    assert (config.mode, config.num_decode) == ("colocated", 2)
    out = capsys.readouterr().out
    assert "serving 2 colocated, the planner's split for 2 workers of 1 thread(s)" in out
    assert "2 of 2 splits meet it at the trace's rate, this one up to 19.1" in out
    # A split given wins over the planner's, whole.
    assert main(["serve", "--model", "tiny", *plan, "--prefill", "1"]) == 0
    config = captured[-1].cluster
    assert (config.mode, config.num_prefill, config.num_decode) == ("disaggregated", 1, 1)
    assert "planner" not in capsys.readouterr().out


def test_serve_says_why_it_starts_the_default_split_instead_of_a_planned_one(
        captured: list[Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile, trace = _plan_inputs(tmp_path)
    assert main(["serve", "--model", "tiny", "--slo", "ttft_p90_ms=2000,tpot_p90_ms=5",
                 "--profile", profile, "--trace", trace, "--max-workers", "2"]) == 0
    assert "serving the default 1P+1D: no split of 2 workers of 1 thread(s) meets --slo " \
           f"on {trace} by the profile (the best, " in capsys.readouterr().out
    assert main(["serve", "--model", "tiny", "--slo", "ttft=500"]) == 0
    assert "serving the default 1P+1D: the planner picks a split from --slo, --profile and " \
           "--trace, and --profile and --trace are not given" in capsys.readouterr().out
    assert main(["serve", "--model", "tiny"]) == 0  # nothing asked: nothing to say
    assert capsys.readouterr().out == ""
    for options in captured:
        assert (options.cluster.mode, options.cluster.num_prefill,
                options.cluster.num_decode) == ("disaggregated", 1, 1)


def test_mooncake_transport_and_its_protocol_reach_the_workers(captured: list[Any]) -> None:
    pytest.importorskip("mooncake", reason="the mooncake extra is not installed")
    assert main(["serve", "--model", "tiny", "--transport", "mooncake",
                 "--mooncake-protocol", "tcp"]) == 0
    (options,) = captured
    assert options.cluster.transports == TRANSPORTS["mooncake"] == ("mooncake", "zmq")
    assert options.cluster.decode.engine["mooncake_protocol"] == "tcp"


def test_tls_and_key_flags_reach_both_front_doors(captured: list[Any], tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    assert main(["serve", "--model", "tiny", "--host", "0.0.0.0", "--api-key", "sk-u",
                 "--admin-key", "sk-a", "--tls-cert", pki["server.pem"], "--tls-key",
                 pki["server.key"], "--tls-client-ca", pki["ca.pem"]]) == 0
    (options,) = captured
    security = options.security
    assert (security.api_key, security.admin_key) == ("sk-u", "sk-a")
    assert (security.tls_cert, security.tls_key, security.tls_client_ca) == \
        (pki["server.pem"], pki["server.key"], pki["ca.pem"])
    assert security.tls and options.host == "0.0.0.0"  # a key: binding beyond loopback is fine


@pytest.mark.parametrize(("flags", "message"), [
    (["--host", "0.0.0.0"], "binding '0.0.0.0' without --api-key"),
    (["--tls-cert", "cert.pem"], "tls_cert and tls_key: give both or neither"),
    (["--tls-cert", "missing.pem", "--tls-key", "missing.key"], "no such file"),
    (["--tls-client-ca", "ca.pem"], "mutual TLS needs tls_cert and tls_key too"),
])
def test_refusals_start_nothing(captured: list[Any], capsys: pytest.CaptureFixture[str],
                                flags: list[str], message: str) -> None:
    assert main(["serve", "--model", "tiny", *flags]) == 2
    assert message in capsys.readouterr().err
    assert captured == []


def test_tracing_and_log_prompts_flags(captured: list[Any], monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", "tiny"]) == 0
    assert captured[0].cluster.tracing is None and captured[0].router.log_prompts is False
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-token=abc")
    assert main(["serve", "--model", "tiny", "--otlp-traces-endpoint", "http://otel:4317",
                 "--log-prompts"]) == 0
    tracing = captured[1].cluster.tracing
    assert tracing.endpoint == "http://otel:4317" and captured[1].router.log_prompts is True
    assert tracing.env["OTEL_EXPORTER_OTLP_HEADERS"] == "x-token=abc"  # the workers get it
    assert tracing.protocol == "grpc"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")  # OTLP/HTTP, 4318
    assert main(["serve", "--model", "tiny", "--otlp-traces-endpoint", "http://otel:4318"]) == 0
    tracing = captured[2].cluster.tracing
    assert (tracing.protocol, tracing.endpoint) == ("http/protobuf", "http://otel:4318/v1/traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    assert main(["serve", "--model", "tiny", "--otlp-traces-endpoint", "http://otel:4318"]) == 2
    assert "pdcluster exports traces over grpc or http/protobuf" in capsys.readouterr().err
    assert len(captured) == 3


def test_kv_cache_dtype_reaches_every_worker(captured: list[Any],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", "tiny", "--kv-cache-dtype", "int8"]) == 0
    assert main(["serve", "--model", "tiny"]) == 0
    assert [(o.cluster.prefill.engine["kv_cache_dtype"], o.cluster.decode.engine["kv_cache_dtype"])
            for o in captured] == [("int8", "int8"), ("auto", "auto")]
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model", "tiny", "--kv-cache-dtype", "int4"])
    assert exit_info.value.code == 2
    assert "--kv-cache-dtype: invalid choice: 'int4'" in capsys.readouterr().err


def test_detach_needs_a_ray_cluster_and_starts_nothing_without_one(
        captured: list[Any], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    joined: list[Any] = []  # Ray may be up already (an earlier test's): count joins instead
    monkeypatch.setattr(ray, "init", lambda *a, **k: joined.append((a, k)))
    assert main(["serve", "--model", "tiny", "--detach"]) == 2
    assert "--detach needs a running Ray cluster" in capsys.readouterr().err
    assert captured == [] and joined == []


def test_detach_hands_the_options_to_the_front_door(
        captured: list[Any], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """What the detached front door actor gets (`cluster.frontdoor.launch`, captured
    before Ray is joined), and the ready line the launcher prints from its answer."""
    import cluster.frontdoor

    launched: list[Any] = []

    def launch(options: Any, name: str) -> dict[str, Any]:
        launched.append((options, name))
        return {"grpc_port": 50061, "http_port": 8001, "existing": True}

    monkeypatch.setattr(cluster.frontdoor, "launch", launch)
    monkeypatch.setenv("PDCLUSTER_CACHE", str(tmp_path))  # the endpoint file goes there
    assert main(["serve", "--model", "tiny", "--detach", "--address", "auto", "--name", "c1",
                 "--decode", "2", "--log-format", "json", "--log-level", "debug"]) == 0
    ((options, name),) = launched
    assert (options.address, options.cluster.num_decode, name) == ("auto", 2, "c1")
    assert options.cluster.log == LogConfig("DEBUG", "json")  # the front door's and workers'

    out = capsys.readouterr().out
    assert "'c1' already runs" in out
    assert "pdcluster ready: gRPC 127.0.0.1:50061  OpenAI http://127.0.0.1:8001/v1" in out
    assert captured == []  # nothing served in this process


def test_speculative_config_reaches_the_decode_pool_and_a_bad_key_is_named(
        captured: list[Any], capsys: pytest.CaptureFixture[str]) -> None:
    config = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
    assert main(["serve", "--model", "tiny", "--speculative-config", config]) == 0
    (options,) = captured
    assert options.cluster.decode.engine["speculative_config"] == config
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model", "tiny", "--speculative-config",
              '{"method": "ngram", "num_speculative_tokens": 4, "lookup_max": 4}'])
    assert exit_info.value.code == 2
    assert "speculative_config: unknown key 'lookup_max'" in capsys.readouterr().err
    assert len(captured) == 1  # nothing started


def test_a_bad_cpu_isa_cap_is_refused_before_anything_starts(
        captured: list[Any], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PDCLUSTER_CPU_ISA", "avx10")
    assert main(["serve", "--model", "tiny"]) == 2
    assert not captured
    assert capsys.readouterr().err == (
        "error: PDCLUSTER_CPU_ISA='avx10' is not an ISA level; use one of baseline, avx2, "
        "avx512, avx512_bf16, amx\n")


def test_tensor_parallel_size_reaches_each_pool_and_a_size_the_model_cannot_split_is_named(
        captured: list[Any], capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["serve", "--model", "tiny", "--mode", "colocated", "-tp", "2"]) == 0
    (options,) = captured
    assert options.cluster.decode.engine["tensor_parallel_size"] == 2
    path = tmp_path / "serve.yaml"  # per pool, vLLM's key
    path.write_text("model: tiny\nmode: colocated\ndecode:\n  tensor-parallel-size: 2\n")
    assert main(["serve", "--config", str(path)]) == 0
    assert captured[1].cluster.decode.engine["tensor_parallel_size"] == 2
    # tiny has 4 query heads; the model is read only to check the split, nothing starts.
    assert main(["serve", "--model", "tiny", "--mode", "colocated", "-tp", "3"]) == 2
    assert "colocated workers: tensor_parallel_size 3 does not divide num_attention_heads " \
        "(4)" in capsys.readouterr().err
    # Disaggregated: both pools split (tiny's 2 KV heads at 2 ranks); at 4 ranks each
    # holds a copy of one: private pages (auto picks them), which one shared pool cannot.
    assert main(["serve", "--model", "tiny", "--tensor-parallel-size", "2"]) == 0
    assert [captured[2].cluster.prefill.engine["tensor_parallel_size"],
            captured[2].cluster.decode.engine["tensor_parallel_size"]] == [2, 2]
    capsys.readouterr()
    assert main(["serve", "--model", "tiny", "-tp", "4", "--tp-kv-pages", "shared"]) == 2
    assert "prefill workers: tensor-parallel-size 4 does not divide the model's 2 KV heads" \
        in capsys.readouterr().err
    assert main(["serve", "--model", "tiny", "-tp", "4"]) == 0
    assert (captured[3].cluster.mode, captured[3].cluster.decode.engine[
        "tensor_parallel_size"]) == ("disaggregated", 4)
    # On GPUs each rank's KV heads are on its own device: a disaggregated pool of them
    # moves KV through rank 0's mirror (private pages, which CPU workers may ask for too).
    assert main(["serve", "--model", "tiny", "-tp", "2", "--num-gpus-per-worker", "2"]) == 0
    assert captured[4].cluster.decode.num_gpus == 2
    assert main(["serve", "--model", "tiny", "-tp", "2", "--tp-kv-pages", "private"]) == 0
    assert [captured[5].cluster.prefill.engine["tp_kv_pages"],
            captured[5].cluster.decode.engine["tp_kv_pages"]] == ["private", "private"]
    with pytest.raises(SystemExit, match="2"):
        main(["serve", "--model", "tiny", "-tp", "2", "--tp-kv-pages", "gpu"])
    assert "--tp-kv-pages: invalid choice: 'gpu'" in capsys.readouterr().err
    assert len(captured) == 6

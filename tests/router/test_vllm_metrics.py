"""vLLM's per-request series under `--metrics-compat vllm`: prompt and generation token
counts and inference time per finished request, each engine's `vllm:cache_config_info` and
`vllm:iteration_tokens_total` (from a real engine's steps), and request latency buckets past
80 s as vLLM's; none of them without the flag."""

from __future__ import annotations

from dataclasses import asdict
from types import SimpleNamespace

import httpx
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cluster.metrics import ClusterMetrics, VllmCompatCollector
from engine import CacheConfig, LLMEngine, SamplingParams
from protocol.status import WorkerStats
from router.admission import AdmissionQueue
from router.metrics import RouterMetrics, token_count_buckets

STATS = WorkerStats(num_blocks=512, kv_cache_dtype="int8", num_preemptions=3)


def backend(stats: WorkerStats = STATS) -> SimpleNamespace:
    """A decode worker with its info and stats, and one still without stats."""
    workers = {
        "decode-0": SimpleNamespace(worker_id="decode-0", role="decode", stats=stats,
                                    info=SimpleNamespace(block_size=16, num_blocks=512)),
        "prefill-0": SimpleNamespace(worker_id="prefill-0", role="prefill", stats=None,
                                     info=SimpleNamespace(block_size=16, num_blocks=256))}
    return SimpleNamespace(workers=workers, metrics=ClusterMetrics("smollm2"))


def exposition(metrics: RouterMetrics, compat: bool,
               stats: WorkerStats = STATS) -> dict[tuple[str, tuple], float]:
    if compat:
        metrics.registry.register(VllmCompatCollector(backend(stats), metrics))
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_token_count_buckets_are_vllms_1_2_5_up_to_the_context():
    assert token_count_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert token_count_buckets(2048)[-3:] == (500, 1000, 2000)


def test_a_finished_request_is_counted_in_the_vllm_per_request_series():
    metrics = RouterMetrics(AdmissionQueue(max_running=1, max_queue=1), "smollm2",
                            max_model_len=2048)
    metrics.observe_finished(prompt_tokens=7, generation_tokens=12, inference_s=1.25)
    metrics.observe_finished(prompt_tokens=30, generation_tokens=1, inference_s=100.0)
    samples = exposition(metrics, compat=True)

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted({"model_name": "smollm2", **labels}.items())))]

    assert value("vllm:request_prompt_tokens_sum") == 37
    assert value("vllm:request_prompt_tokens_count") == 2
    assert value("vllm:request_prompt_tokens_bucket", le="5.0") == 0
    assert value("vllm:request_prompt_tokens_bucket", le="10.0") == 1
    assert value("vllm:request_prompt_tokens_bucket", le="50.0") == 2
    assert value("vllm:request_prompt_tokens_bucket", le="2000.0") == 2
    assert ("vllm:request_prompt_tokens_bucket",
            (("le", "5000.0"), ("model_name", "smollm2"))) not in samples
    assert value("vllm:request_generation_tokens_sum") == 13
    assert value("vllm:request_generation_tokens_bucket", le="1.0") == 1
    assert value("vllm:request_generation_tokens_bucket", le="20.0") == 2
    assert value("vllm:request_inference_time_seconds_sum") == 101.25
    assert value("vllm:request_inference_time_seconds_bucket", le="80.0") == 1
    assert value("vllm:request_inference_time_seconds_bucket", le="120.0") == 2
    assert value("vllm:request_inference_time_seconds_bucket", le="7680.0") == 2


def test_request_latencies_have_vllms_buckets_past_80_seconds():
    metrics = RouterMetrics(AdmissionQueue(max_running=1, max_queue=1), "smollm2")
    metrics.e2e.observe(300.0)
    samples = exposition(metrics, compat=True)
    for name in ("pdcluster:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds"):
        buckets = {dict(labels)["le"]: v for (sample, labels), v in samples.items()
                   if sample == f"{name}_bucket"}
        assert [le for le in buckets if float(le) > 80] == \
            ["120.0", "240.0", "480.0", "960.0", "1920.0", "7680.0", "+Inf"]
        assert buckets["240.0"] == 0 and buckets["480.0"] == 1


def test_each_engine_reports_its_cache_config():
    metrics = RouterMetrics(AdmissionQueue(max_running=1, max_queue=1), "smollm2")
    samples = exposition(metrics, compat=True)
    info = {labels: v for (name, labels), v in samples.items()
            if name == "vllm:cache_config_info"}
    assert info == {(("block_size", "16"), ("cache_dtype", "int8"), ("engine", "decode-0"),
                     ("model_name", "smollm2"), ("num_cpu_blocks", "0"),
                     ("num_gpu_blocks", "512")): 1.0}  # prefill-0 has sent no stats yet


def test_each_engine_counts_its_preemptions():
    metrics = RouterMetrics(AdmissionQueue(max_running=1, max_queue=1), "smollm2")
    samples = exposition(metrics, compat=True)
    assert {labels: v for (name, labels), v in samples.items()
            if name == "vllm:num_preemptions_total"} == {
        (("engine", "decode-0"), ("model_name", "smollm2")): 3.0}


def test_each_engine_histograms_the_tokens_of_its_steps():
    """Two prompts of 10 and 30 tokens, 5 tokens each: one step computes both prompts (40
    tokens), then 4 steps decode a token of each (2 tokens); vLLM's buckets."""
    engine = LLMEngine("tiny", cache=CacheConfig(block_size=16, num_blocks=64))
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    engine.add_request("a", list(range(100, 110)), params)
    engine.add_request("b", list(range(200, 230)), params)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    samples = exposition(RouterMetrics(AdmissionQueue(max_running=1, max_queue=1), "smollm2"),
                         compat=True, stats=WorkerStats(**asdict(engine.stats())))
    series = {name: v for (name, labels), v in samples.items()
              if name.startswith("vllm:iteration_tokens_total")
              and dict(labels).get("engine") == "decode-0"}
    assert steps == 5
    assert series["vllm:iteration_tokens_total_count"] == steps
    assert series["vllm:iteration_tokens_total_sum"] == 40 + 4 * 2
    buckets = {dict(labels)["le"]: v for (name, labels), v in samples.items()
               if name == "vllm:iteration_tokens_total_bucket"}
    assert list(buckets) == ["1.0", "8.0", "16.0", "32.0", "64.0", "128.0", "256.0", "512.0",
                             "1024.0", "2048.0", "4096.0", "8192.0", "16384.0", "+Inf"]
    assert [buckets[le] for le in ("1.0", "8.0", "32.0", "64.0", "16384.0", "+Inf")] == \
        [0, 4, 4, 5, 5, 5]


def test_without_the_flag_no_vllm_series_is_exported():
    metrics = RouterMetrics(AdmissionQueue(max_running=1, max_queue=1), "smollm2")
    metrics.observe_finished(prompt_tokens=7, generation_tokens=12, inference_s=1.25)
    assert not any(name.startswith("vllm:") for name, _ in exposition(metrics, compat=False))


def test_the_router_records_what_a_request_did(make_servers):
    servers = make_servers()
    metrics = servers.router.metrics
    resp = httpx.post(f"http://127.0.0.1:{servers.http_port}/v1/completions", json={
        "model": "tiny", "prompt": "hello there my friend", "max_tokens": 5,
        "ignore_eos": True}, timeout=30)
    assert resp.status_code == 200
    usage = resp.json()["usage"]
    samples = {s.name: s.value for f in metrics.collect_vllm() for s in f.samples
               if not s.labels.get("le")}
    assert samples["vllm:request_prompt_tokens_sum"] == usage["prompt_tokens"]
    assert samples["vllm:request_prompt_tokens_count"] == 1
    assert samples["vllm:request_generation_tokens_sum"] == usage["completion_tokens"] == 5
    assert 0 < samples["vllm:request_inference_time_seconds_sum"] < 30

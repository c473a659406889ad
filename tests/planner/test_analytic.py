"""The analytic step-time model: exact arithmetic on a tiny config, the shipped tables,
the profile's schema, bad specs."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from commands.cli import main
from planner.analytic import StepModel, analytic_profile, check_against, decode_batches
from planner.plan import PlanRequest, predict
from planner.profile import Profile
from planner.simulator import ClusterShape
from planner.specs import (
    SHIPPED_MODELS,
    accelerator_from_dict,
    accelerator_table,
    experts_touched,
    load_accelerator,
    load_model_shape,
    model_shape,
    tp_problem,
)
from protocol.serving import Slo
from tests.planner.synthetic import poisson_arrivals, random_prompts, trace

MEASURED = Path(__file__).parents[2] / "docs/results/planner_profile_smollm2_t1.json"
# hidden 8, 2 query heads and 1 KV head of 4, MLP 16, 2 layers, vocabulary 10, untied.
TINY = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 4, "intermediate_size": 16,
        "num_hidden_layers": 2, "vocab_size": 10, "max_position_embeddings": 64}
# 1000 FLOP/s, 1000 bytes/s, 10,000 bytes (memory_gb is GiB), no overheads or runtime
# reserve, every efficiency 1, a GEMM of one token at half the peak.
SLOW = {"bf16_tflops": 1e-9, "memory_gb": 10_000 / 2**30, "memory_bandwidth_gbs": 1e-6,
        "link_bandwidth_gbs": 1e-6, "gemm_efficiency": 1.0, "gemm_half_tokens": 1.0,
        "attention_efficiency": 1.0, "bandwidth_efficiency": 1.0, "step_overhead_ms": 0.0,
        "link_latency_us": 0.0, "transfer_latency_ms": 0.0, "memory_utilization": 1.0,
        "network_gbps": 8e-6, "collective_efficiency": 1.0, "runtime_reserve_gb": 0.0}


def tiny(tp: int = 1) -> StepModel:
    return StepModel(model_shape(TINY, "tiny"), accelerator_from_dict("slow", SLOW), tp)


def test_the_work_of_a_step_on_a_tiny_config() -> None:
    """Per layer: q 8x8, k and v 8x4 each, o 8x8 = 192 weights; the MLP 3 x 8 x 16 = 384.
    Model: 2 x 576 + embedding 80 + LM head 80 = 1312 weights. K and V of a token: 2 x 2
    layers x 1 head x 4 x 2 bytes = 32 bytes."""
    model = tiny()
    shape = model.shape
    assert (shape.attention_params, shape.expert_params, shape.num_params) == (192, 384, 1312)
    assert shape.kv_bytes_per_token("bfloat16") == 32
    assert shape.model_id == "LlamaForCausalLM:L2:H8:I16:A2/1x4:V10"
    # 3 tokens, one sampled: 2 x (3 x 1152 + 1 x 80).
    assert model.gemm_flops(3, 1) == 7072
    assert model.weight_bytes(3) == 1232 * 2
    # One decode token after 3 in context: 4 query-key pairs, 4 x 2 layers x 2 heads x 4 each.
    assert model.attention_flops(4) == 256
    parts = model.step_parts([(3, 1, False)])
    # One token is a matrix-vector product at the full 1000 FLOP/s (no tiles to fill):
    # 2464 FLOPs, as long as 2464 bytes at 1000 bytes/s; attention's 256 FLOPs beat
    # reading 3 and writing 1 tokens of KV (128 bytes).
    assert parts == {"overhead": 0.0, "gemm": pytest.approx(2.464), "attention":
                     pytest.approx(0.256), "all_reduce": 0.0}
    # 2 decode tokens at 2/3 of the peak (T / (T + 1)): 2 x (2 x 1152 + 2 x 80) FLOPs.
    assert model.step_parts([(3, 1, False)] * 2)["gemm"] == pytest.approx(4.928 * 1.5)
    # 8 tokens run at 8/9 of the peak; the LM head's one sampled row is a matrix-vector
    # product at the peak (its rows are the sampled positions, not the step's tokens).
    assert model.step_parts([(0, 8, True)])["gemm"] == pytest.approx(
        2 * 8 * 1152 / (1000 * 8 / 9) + 2 * 80 / 1000)
    # The KV of 16 tokens (512 bytes) over 1000 bytes/s (8e-6 Gbit/s).
    assert model.transfer_time(16) == pytest.approx(0.512)


def test_a_gemm_over_the_packed_rows_reads_its_weights_as_often_as_it_packs_them() -> None:
    """Three passes over the weights (2464 bytes) above `gemm_packed_rows`, one at or
    below, at full efficiency: 2 decode tokens take 4928 FLOPs (4.928 s) against 7.392 s
    of reads packed per call, 2.464 s packed at load; a 3-token prompt 7072 FLOPs."""
    def model(packed_rows: int) -> StepModel:
        spec = {**SLOW, "gemm_half_tokens": 0.0, "gemm_weight_passes": 3.0,
                "gemm_packed_rows": packed_rows}
        return StepModel(model_shape(TINY, "tiny"), accelerator_from_dict("slow", spec))

    two, prompt = [(3, 1, False)] * 2, [(0, 3, True)]
    assert model(1).step_parts(two)["gemm"] == pytest.approx(3 * 2.464)
    assert model(2).step_parts(two)["gemm"] == pytest.approx(4.928)
    assert model(2).step_parts(prompt)["gemm"] == pytest.approx(3 * 2.464)
    assert model(3).step_parts(prompt)["gemm"] == pytest.approx(7.072)


def test_tensor_parallelism_splits_the_work_and_adds_the_all_reduce() -> None:
    one, two = tiny(1), tiny(2)
    step = [(0, 4, True)]
    assert one.step_parts(step)["all_reduce"] == 0
    # Two all-reduces a layer of 4 tokens x 8 x 2 bytes, half of them crossing the link
    # each way at 500 bytes/s.
    assert two.step_parts(step)["all_reduce"] == pytest.approx(2 * 2 * (2 * 1 / 2) * 64 / 500)
    assert two.step_parts(step)["gemm"] == pytest.approx(one.step_parts(step)["gemm"] / 2)
    with pytest.raises(ValueError, match="tp 3 does not divide the 2 attention heads"):
        tiny(3)


def test_kv_capacity_is_memory_less_weights_and_activations() -> None:
    """10,000 bytes a device. TP 1: 2624 bytes of weights; activations of 4 tokens x (2 x 8
    + 4 heads x 4 + 2 x 16) x 2 bytes = 512 and 2 sampled x 10 x 4 bytes = 80: 6784 left.
    TP 2: 1312 bytes of weights and 4 x 40 x 2 + 2 x 5 x 4 = 360 of activations on each of
    two devices; the one KV head is kept by both ranks."""
    assert tiny(1).kv_capacity(4, 2) == 10_000 - 2624 - 592
    assert tiny(2).kv_capacity(4, 2) == 2 * (10_000 - 1312 - 360)
    assert tiny(2).kv_bytes_per_token() == 64
    profile = analytic_profile(tiny(1), block_size=2, max_num_batched_tokens=4,
                               max_num_seqs=2)
    assert (profile.block_bytes, profile.num_blocks) == (64, 6784 // 64)
    with pytest.raises(ValueError, match="does not fit a slow"):
        tiny(1).kv_capacity(1000, 2)


def test_moe_reads_the_experts_its_tokens_reach() -> None:
    config = {**TINY, "num_local_experts": 4, "num_experts_per_tok": 2}
    shape = model_shape(config, "moe")
    assert [experts_touched(shape, t) for t in (1, 2)] == [2.0, 3.0]
    model = StepModel(shape, accelerator_from_dict("slow", SLOW))
    # 2 of 4 experts per token, and the 8 x 4 router.
    assert model.gemm_flops(1, 0) == 2 * 2 * (192 + 2 * 384 + 32)
    assert shape.num_params == 2 * (192 + 4 * 384 + 32) + 160


def test_the_shipped_configs_have_their_published_sizes() -> None:
    """Parameter counts as the model cards state them (billions)."""
    published = {"llama-3-8b": 8.03, "llama-3-70b": 70.6, "qwen2.5-7b": 7.61,
                 "mixtral-8x7b": 46.7, "smollm2": 0.135}
    for name in SHIPPED_MODELS:
        assert load_model_shape(name).num_params / 1e9 == pytest.approx(published[name],
                                                                         rel=0.01)
    shape = load_model_shape("llama-3-8b")
    assert shape.kv_bytes_per_token("bfloat16") == 128 * 1024  # 32 x 8 x 128 x 2 x 2


def test_every_built_in_accelerator_loads_with_its_source() -> None:
    names = {"H100-SXM", "H100-PCIe", "H200", "B200", "A100-80GB", "L40S", "MI300X"}
    assert set(accelerator_table()) == names
    for name in names:
        accelerator = load_accelerator(name)
        assert accelerator.source.startswith("https://")
        assert accelerator.bf16_tflops > 0 and accelerator.memory_bandwidth_gbs > 0
    assert load_accelerator("A100-80GB").fp8_tflops is None
    with pytest.raises(ValueError, match="A100-80GB has no fp8"):
        StepModel(load_model_shape("llama-3-8b"), load_accelerator("A100-80GB"), 1, "fp8")


def test_the_analytic_profile_has_the_measured_schema(tmp_path: Path) -> None:
    measured = json.loads(MEASURED.read_text())
    model = StepModel(load_model_shape("llama-3-8b"), load_accelerator("H100-SXM"), 2)
    analytic_profile(model).save(tmp_path / "p.json")
    written = json.loads((tmp_path / "p.json").read_text())
    # the measured file predates step_cv and response_latency_s
    assert set(written) == set(measured) | {"step_cv", "response_latency_s"}
    for key in measured:
        assert type(written[key]) is type(measured[key]), key
    for key in ("prefill", "transfer"):
        assert written[key]["features"] == measured[key]["features"]
    # The decode table reaches the default max_num_seqs (64) beyond the measured b32.
    assert written["decode"]["features"] == \
        [*measured["decode"]["features"][:-1], "b64", "context"]
    for key in ("prefill", "decode"):
        assert set(written["samples"][key][0]) == set(measured["samples"][key][0])
    assert set(written["samples"]["transfer"][0]) == set(measured["samples"]["transfer"][0])
    profile = Profile.load(tmp_path / "p.json")
    # The fitted models stay close to the step model they are fitted on.
    assert profile.fit_error["decode"]["max"] < 0.05
    assert profile.fit_error["prefill"]["median"] < 0.1
    assert profile.step_time([(1024, 1, False)] * 8) == pytest.approx(
        model.step_time([(1024, 1, False)] * 8), rel=0.05)
    # The simulator plans on it.
    requests = trace(poisson_arrivals(50, 5.0, seed=1), random_prompts(50, 512, seed=2), 64)
    request = PlanRequest(profile, profile, requests, Slo.parse("ttft_p90_ms=500"),
                          find_max_rate=False)
    assert predict(request, ClusterShape("disaggregated", 1, 1, 2048, 256, 0))["attainment"] == 1


@pytest.mark.parametrize(("spec", "message"), [
    ({**SLOW, "bandwith_gbs": 1}, "unknown key 'bandwith_gbs'"),
    ({k: v for k, v in SLOW.items() if k != "memory_gb"}, "missing key 'memory_gb'"),
    ({**SLOW, "memory_gb": "lots"}, "memory_gb must be a number >= 0, got 'lots'"),
    ({**SLOW, "memory_utilization": 1.5}, "memory_utilization must be in"),
])
def test_a_bad_spec_file_names_the_key(tmp_path: Path, spec: dict, message: str) -> None:
    import yaml

    path = tmp_path / "gpu.yaml"
    path.write_text(yaml.safe_dump({"MyGPU": spec}))
    with pytest.raises(ValueError, match=f"hardware MyGPU: {message}"):
        load_accelerator(str(path))


def test_a_spec_file_and_a_bad_config(tmp_path: Path) -> None:
    path = tmp_path / "gpu.yaml"
    path.write_text("name: MyGPU\n" + "".join(f"{k}: {v}\n" for k, v in SLOW.items()))
    assert load_accelerator(str(path)).name == "MyGPU"
    with pytest.raises(ValueError, match="not cpu, a file, or one of H100-SXM"):
        load_accelerator("H1000")
    with pytest.raises(ValueError, match="model config bad: hidden_size must be an integer"):
        model_shape({**TINY, "hidden_size": None}, "bad")
    with pytest.raises(ValueError, match="must be a multiple of num_key_value_heads"):
        model_shape({**TINY, "num_key_value_heads": 3}, "bad")


def test_profile_analytic_writes_one_profile_per_tp_that_fits(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "l70.json"
    assert main(["profile", "--analytic", "--hardware", "H100-SXM", "--model-config",
                 "llama-3-70b", "--tp", "1,4", "--out", str(out)]) == 0
    assert "tp 1: skipped: llama-3-70b at tp 1 does not fit a H100-SXM" in capsys.readouterr().out
    assert not (tmp_path / "l70.tp1.json").exists()
    profile = Profile.load(tmp_path / "l70.tp4.json")
    assert (profile.model, profile.hardware["tp"], profile.workers_per_host) == (
        "llama-3-70b", 4, 2)


def test_check_against_a_measured_profile_scores_each_point(tmp_path: Path) -> None:
    """The check's errors, recomputed from its points; a config of another model is
    refused."""
    measured = Profile.load(MEASURED)
    model = StepModel(load_model_shape("smollm2"), accelerator_from_dict("slow", {
        **SLOW, "memory_gb": 100.0}), 1, "bfloat16")
    check = check_against(model, measured)
    points = check["points"]
    assert {p["kind"] for p in points} == {"prefill", "decode"}
    assert len(points) == len({(p["kind"], p["schedule"]) for p in points})
    errors = sorted(abs(p["step_model_s"] - p["measured_s"]) / p["measured_s"] for p in points)
    assert check["error"]["step_model"]["all"]["max"] == errors[-1]
    assert check["error"]["step_model"]["all"]["points"] == len(points)
    with pytest.raises(ValueError, match="the measured profile is of LlamaForCausalLM:L30"):
        check_against(tiny(), measured)


def h100_llama_8b(dtype: str = "fp8", kv_dtype: str = "fp8", tp: int = 1) -> StepModel:
    return StepModel(load_model_shape("llama-3-8b"), load_accelerator("H100-SXM"), tp, dtype,
                     kv_dtype)


def test_the_profile_prices_decode_up_to_max_num_seqs_not_extrapolated() -> None:
    """Llama-3-8B fp8 on an H100 at a decode batch of 2048. Per token and layer the linears
    hold 4096 x (4096 + 2 x 1024) + 4096 x 4096 + 3 x 4096 x 14336 = 218.1 M weights: 2 x
    2048 x 32 x 218.1 M = 28.6 TFLOPs at 1979 x 0.7 x 2048 / 2112 = 1343 TFLOP/s is 21.3
    ms; the bf16 LM head 2 x 2048 x 128256 x 4096 = 2.15 TFLOPs at 989 x 0.679 = 671
    TFLOP/s, 3.2 ms; 2 ms per step: at least 26.5 ms. The old table stopped at batch 32
    and extended the memory-bound slope (14.5 ms)."""
    model = h100_llama_8b()
    profile = analytic_profile(model, max_num_batched_tokens=8192, max_num_seqs=2048)
    batch = [(192, 1, False)] * 2048
    assert profile.step_time(batch) > 0.0265
    assert profile.step_time(batch) == pytest.approx(model.step_time(batch), rel=0.02)
    assert decode_batches(2048)[-7:] == [32, 64, 128, 256, 512, 1024, 2048]
    assert decode_batches(100)[-3:] == [32, 64, 100]


def test_fp8_weights_keep_activations_all_reduce_lm_head_and_bf16_attention_in_bf16() -> None:
    """The tiny config, fp8 weights (2000 FLOP/s), bf16 KV and activations (1000 FLOP/s).
    Weights read by a step: 2 layers x 576 decoder weights x 1 byte + the 80-weight LM head
    x 2 bytes = 1312 bytes (fp8 everywhere: 1232). Held per device: the decoder's 1152 bytes
    plus embedding and LM head 2 x 80 x 2 = 1472. An 8-token prompt's attention: 8 x 4.5 =
    36 pairs x 64 FLOPs = 2304 FLOPs at the bf16 1000 FLOP/s = 2.304 s (not 1.152 at the
    fp8 peak). TP 2, 4 tokens: two all-reduces a layer of 4 x 8 x 2 bytes = 64 bytes, half
    crossing each way at 500 bytes/s: 2 x 2 x 64 / 500 = 0.512 s (not 0.256 at 1 byte)."""
    fast = accelerator_from_dict("slow", {**SLOW, "fp8_tflops": 2e-9})
    shape = model_shape(TINY, "tiny")
    fp8 = StepModel(shape, fast, 1, "fp8", "bfloat16")
    assert fp8.weight_bytes(1) == 1312
    assert fp8.weights_per_device() == 1472
    assert fp8.step_parts([(0, 8, True)])["attention"] == pytest.approx(2.304)
    # The 1-row LM head GEMV at bf16's 1000 FLOP/s: 160 FLOPs, 0.16 s; the decoder's
    # 2304 FLOPs at fp8's 2000: 1.152 s; reads 1312 bytes: 1.312 s, the longer.
    assert fp8.step_parts([(3, 1, False)])["gemm"] == pytest.approx(1.312)
    two = StepModel(shape, fast, 2, "fp8", "bfloat16")
    assert two.step_parts([(0, 4, True)])["all_reduce"] == pytest.approx(0.512)


def test_kv_capacity_counts_gib_the_utilization_and_the_runtime_reserve() -> None:
    """Llama-3-8B bf16 on an H100: 80 GiB x 0.9 (vLLM's gpu_memory_utilization) = 72 GiB,
    less 1.8 GiB of runtime (vLLM's non-torch memory on an H100) = 70.2 GiB = 75.38e9
    bytes; weights 8.03e9 x 2 = 16.06e9; activations of 2048 tokens x (2 x 4096 + 48 heads
    x 128 + 2 x 14336) x 2 bytes = 0.176e9 and 64 x 128256 fp32 logits = 0.033e9: 59.11e9
    bytes of KV (80e9-byte memory without a reserve gave 55.7e9)."""
    assert h100_llama_8b("bfloat16", "bfloat16").kv_capacity(2048, 64) == pytest.approx(
        59.11e9, rel=1e-3)


def test_collectives_follow_the_links_topology() -> None:
    """MI300X: 896 GB/s of xGMI is 7 links of 128 GB/s (64 a direction). A TP 2 all-reduce
    uses one pair's link: 64 GB/s; TP 8 reaches all 7 peers: 448 GB/s. The H100's NVSwitch
    gives any TP 450 GB/s a direction. Llama-3-8B bf16 at TP 2 on MI300X, 1024 tokens: 32
    layers x 2 all-reduces of 1024 x 4096 x 2 = 8.39 MB, each 10 us + (2 x 1/2) x 8.39 MB /
    (64 GB/s x 0.8) = 173.8 us: 11.13 ms."""
    mi300x, h100 = load_accelerator("MI300X"), load_accelerator("H100-SXM")
    assert [mi300x.collective_bandwidth(tp) for tp in (2, 8)] == [64, 448]
    assert [h100.collective_bandwidth(tp) for tp in (2, 8)] == [450, 450]
    model = StepModel(load_model_shape("llama-3-8b"), mi300x, 2)
    assert model.step_parts([(0, 1024, True)])["all_reduce"] == pytest.approx(11.13e-3,
                                                                             rel=1e-3)


def test_tp_must_divide_every_split_dimension() -> None:
    """Qwen2.5-7B: 28 heads divide by 7, but its 4 KV heads neither divide by 7 nor divide
    7, its MLP width 18944 = 2^7 x 148 and its vocabulary 152064 are no multiples of 7:
    refused. TP 4 splits all (28, 4, 18944, 152064 all multiples of 4). 12 query heads
    and 4 KV heads at TP 6: each rank's 2 query heads would need 2/3 of a KV head; a
    vocabulary of 10 pads to 64, which TP 6 does not divide either."""
    h100 = load_accelerator("H100-SXM")
    with pytest.raises(ValueError, match="tp 7 neither divides nor is a multiple of the 4 KV"):
        StepModel(load_model_shape("qwen2.5-7b"), h100, 7)
    StepModel(load_model_shape("qwen2.5-7b"), h100, 4)
    shape = model_shape({**TINY, "num_attention_heads": 12, "num_key_value_heads": 4,
                         "head_dim": 2, "intermediate_size": 24}, "gqa")
    assert tp_problem(shape, 6) == "neither divides nor is a multiple of the 4 KV heads"
    assert tp_problem(shape, 2) is None
    assert tp_problem(replace(shape, num_kv_heads=6), 6) == \
        "does not divide the 64 padded vocabulary"


def test_moe_gemm_efficiency_follows_the_rows_each_expert_sees() -> None:
    """4 experts, top 2, 8 tokens: each expert sees 8 x 2 / 4 = 4 rows, at 4/5 of the peak
    (T / (T + 1)); the dense parts see 8 rows at 8/9. Experts: 2 x 8 x 2 layers x 2 x 384 =
    24576 FLOPs / 800 = 30.72 s; attention and router: 2 x 8 x 2 x (192 + 32) = 7168 / (8000
    / 9) = 8.064 s; the 1-row LM head 160 / 1000 = 0.16 s: 38.944 s (all at 8/9: 35.872)."""
    shape = model_shape({**TINY, "num_local_experts": 4, "num_experts_per_tok": 2}, "moe")
    model = StepModel(shape, accelerator_from_dict("slow", SLOW))
    assert model.step_parts([(0, 8, True)])["gemm"] == pytest.approx(38.944)


def test_the_workers_of_one_cpu_host_share_its_memory() -> None:
    """A CPU "device" is one worker's share of the host: as many workers as the host has
    devices, each with its analytic KV pool, fit the host's memory together (each used to
    get half of the whole host, so two workers on two cores asked for all of it)."""
    import os

    from planner.specs import cpu_accelerator

    host_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    cpu = cpu_accelerator(1)
    profile = analytic_profile(StepModel(load_model_shape("smollm2"), cpu, dtype="float32"))
    assert cpu.devices_per_node * profile.kv_cache_gb <= cpu.memory_utilization * host_gib

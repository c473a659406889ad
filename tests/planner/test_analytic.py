"""The analytic step-time model: exact arithmetic on a tiny config, the shipped tables,
the profile's schema, bad specs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from commands.cli import main
from planner.analytic import StepModel, analytic_profile, check_against
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
)
from protocol.serving import Slo
from tests.planner.synthetic import poisson_arrivals, random_prompts, trace

MEASURED = Path(__file__).parents[2] / "docs/results/planner_profile_smollm2_t1.json"
# hidden 8, 2 query heads and 1 KV head of 4, MLP 16, 2 layers, vocabulary 10, untied.
TINY = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 4, "intermediate_size": 16,
        "num_hidden_layers": 2, "vocab_size": 10, "max_position_embeddings": 64}
# 1000 FLOP/s, 1000 bytes/s, 10,000 bytes, no overheads, every efficiency 1, a GEMM of one
# token at half the peak.
SLOW = {"bf16_tflops": 1e-9, "memory_gb": 1e-5, "memory_bandwidth_gbs": 1e-6,
        "link_bandwidth_gbs": 1e-6, "gemm_efficiency": 1.0, "gemm_half_tokens": 1.0,
        "attention_efficiency": 1.0, "bandwidth_efficiency": 1.0, "step_overhead_ms": 0.0,
        "link_latency_us": 0.0, "transfer_latency_ms": 0.0, "memory_utilization": 1.0,
        "network_gbps": 8e-6}


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
    # 8 tokens run at 8/9 of the peak.
    assert model.step_parts([(0, 8, True)])["gemm"] == pytest.approx(
        2 * (8 * 1152 + 80) / (1000 * 8 / 9))
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
    for key in ("prefill", "decode", "transfer"):
        assert written[key]["features"] == measured[key]["features"]
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

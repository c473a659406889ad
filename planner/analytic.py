"""A step-time model from a description: an accelerator, a model's shapes, a TP degree.

Each step is priced from its work (per TP rank: the weights, heads and FLOPs split `tp`
ways):

- the linear layers: `2 x tokens x active weights` FLOPs (the LM head only for the
  sampled positions) at the device's peak times an efficiency that grows with the rows
  a GEMM sees (`Accelerator.gemm_efficiency`): the step's tokens for the dense layers,
  `tokens x top_k / experts` for each expert of an MoE layer; or the weights' read at
  memory bandwidth if that takes longer (a decode step of few requests is bound by the
  read; an MoE layer reads the experts its tokens are routed to);
- attention: `4 x heads x head_dim` FLOPs per query-key pair at
  `attention_efficiency` of the KV dtype's peak, or the KV read (every request's
  context) and write at memory bandwidth if that takes longer;
- tensor parallelism: two all-reduces of the step's activations per layer at the
  per-rank bandwidth of the link's topology (`Accelerator.collective_bandwidth`) times
  `collective_efficiency`, each with a latency;
- fixed overheads per step and per layer.

Precision per operation as vLLM and TensorRT-LLM run an fp8 checkpoint: the decoder's
linear weights in fp8, the activations, the all-reduces, the embedding and the LM head
in bf16 (`activation_dtype`); attention in the KV cache's dtype.

The KV transfer of a request is its blocks' bytes (layers x KV heads x head dim x 2 x the
KV dtype's bytes per token) over the network, plus a fixed latency. A worker's KV capacity
is, per device, its memory (GiB) times `memory_utilization` (vLLM's
`gpu_memory_utilization`) less the runtime's reserve, the weights (its TP shard) and the
activations of a full step.

`analytic_profile` evaluates the model on the grid `pdcluster profile` measures, its
decode batches extended to `max_num_seqs` (`decode_batches`: the table is not extrapolated
from the memory-bound small batches), and fits the same linear models on those points, so
the profile it writes has the measured one's
schema and the simulator reads either.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from engine import defaults
from planner.measure import fit_profile
from planner.profile import DECODE_BATCHES, LinearModel, Profile
from planner.specs import DTYPE_BYTES, Accelerator, ModelShape, experts_touched, tp_problem

_EMPTY = LinearModel((), ())  # replaced by the fits
GIB = 2**30
# Weights load from a local NVMe drive at this rate (each device its shard, in parallel).
LOAD_BYTES_PER_S = 2e9


@dataclass(frozen=True)
class StepModel:
    """Seconds per step of one worker: `shape` on `tp` devices of `accelerator`.

    Args:
        shape: the model.
        accelerator: one device.
        tp: tensor-parallel degree (devices per worker).
        dtype: weights' and activations' dtype (`bfloat16`, `fp8`, `float32`, ...).
        kv_dtype: the KV cache's dtype.
    """

    shape: ModelShape
    accelerator: Accelerator
    tp: int = 1
    dtype: str = "bfloat16"
    kv_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        if problem := tp_problem(self.shape, self.tp):
            raise ValueError(f"tp {self.tp} {problem} of {self.shape.name}")
        if self.tp > self.accelerator.devices_per_node:
            raise ValueError(f"tp {self.tp} exceeds the {self.accelerator.devices_per_node} "
                             f"devices of one {self.accelerator.name} node")
        if self.tp > 1 and not self.accelerator.link_bandwidth_gbs > 0:
            raise ValueError(f"tp {self.tp} needs a link: {self.accelerator.name} has "
                             "link_bandwidth_gbs 0")
        for dtype in (self.dtype, self.kv_dtype):
            if dtype not in DTYPE_BYTES:
                raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
        self.accelerator.flops(self.dtype)  # refuses a dtype the device has no figure for

    @property
    def activation_dtype(self) -> str:
        """The dtype of the activations, the all-reduces, the embedding and the LM head:
        the weights' own, bf16 for fp8 weights (vLLM's and TensorRT-LLM's fp8 checkpoints
        quantize the decoder's linear layers only)."""
        return "bfloat16" if self.dtype == "fp8" else self.dtype

    # ---- the work of a step ----

    def gemm_flops(self, tokens: int, seqs: int) -> float:
        """FLOPs of the linear layers (all ranks together)."""
        return sum(self._gemm_work(tokens, seqs).values())

    def _gemm_work(self, tokens: int, seqs: int) -> dict[str, float]:
        """The linear layers' FLOPs by GEMM shape: `dense` (attention projections and
        router, the step's tokens as rows), `experts` (each expert's rows), `head`."""
        s = self.shape
        dense = s.attention_params + s.router_params
        return {"dense": 2.0 * tokens * s.num_layers * dense,
                "experts": 2.0 * tokens * s.num_layers * s.experts_per_token * s.expert_params,
                "head": 2.0 * seqs * s.vocab_size * s.hidden_size}

    def weight_bytes(self, tokens: int) -> float:
        """Weight bytes a step reads (all ranks together): every layer's attention and the
        experts its tokens reach in the weights' dtype, and the LM head in the
        activations'."""
        s = self.shape
        layer = s.attention_params + experts_touched(s, tokens) * s.expert_params + \
            s.router_params
        return s.num_layers * layer * DTYPE_BYTES[self.dtype] + \
            s.vocab_size * s.hidden_size * DTYPE_BYTES[self.activation_dtype]

    def attention_flops(self, pairs: float) -> float:
        """FLOPs of QK^T and PV over `pairs` query-key pairs."""
        s = self.shape
        return 4.0 * s.num_layers * s.num_heads * s.head_dim * pairs

    @property
    def kv_replicas(self) -> float:
        """How many ranks hold each KV head: with more ranks than KV heads each rank keeps
        a copy of the head its query heads share."""
        return max(self.tp / self.shape.num_kv_heads, 1.0)

    def kv_bytes_per_token(self) -> float:
        """KV bytes of one token in one worker (all its ranks, copies included)."""
        return self.shape.kv_bytes_per_token(self.kv_dtype) * self.kv_replicas

    def kv_bytes(self, read_tokens: int, written_tokens: int) -> float:
        """Bytes of KV a step reads and writes (all ranks together)."""
        return self.kv_bytes_per_token() * (read_tokens + written_tokens)

    # ---- time ----

    def step_time(self, items: Sequence[tuple[int, int, bool]]) -> float:
        """Seconds for one step; `items` as `Profile.step_time` takes them (context before,
        new tokens, prompt tokens?)."""
        return sum(self.step_parts(items).values())

    def step_parts(self, items: Sequence[tuple[int, int, bool]]) -> dict[str, float]:
        """The step's time by part: `overhead`, `gemm`, `attention`, `all_reduce`."""
        a, s, tp = self.accelerator, self.shape, self.tp
        tokens = sum(n for _, n, _ in items)
        seqs = len(items)
        pairs = sum(n * (start + (n + 1) / 2) for start, n, _ in items)
        context = sum(start for start, _, _ in items)
        bandwidth = a.memory_bandwidth_gbs * 1e9 * a.bandwidth_efficiency
        passes = a.gemm_weight_passes if tokens > a.gemm_packed_rows else 1.0
        work = self._gemm_work(tokens, seqs)
        rows = {"dense": tokens, "experts": tokens * s.experts_per_token / s.num_experts,
                "head": seqs}
        peaks = {"dense": a.flops(self.dtype), "experts": a.flops(self.dtype),
                 "head": a.flops(self.activation_dtype)}
        compute = sum(work[k] / (peaks[k] * self._gemm_efficiency(rows[k])) for k in work
                      if work[k])
        gemm = max(compute / tp, passes * self.weight_bytes(tokens) / tp / bandwidth)
        attention_peak = a.flops(self.kv_dtype) if self.kv_dtype != "fp8" or a.fp8_tflops \
            else a.flops("bfloat16")
        attention = max(self.attention_flops(pairs) / tp
                        / (attention_peak * a.attention_efficiency),
                        self.kv_bytes(context, tokens) / tp / bandwidth)
        all_reduce = 0.0
        if tp > 1:
            message = tokens * s.hidden_size * DTYPE_BYTES[self.activation_dtype]
            per_rank = a.collective_bandwidth(tp) * 1e9 * a.collective_efficiency
            all_reduce = 2 * s.num_layers * (a.link_latency_us * 1e-6
                                             + 2 * (tp - 1) / tp * message / per_rank)
        overhead = a.step_overhead_ms * 1e-3 + s.num_layers * a.layer_overhead_us * 1e-6
        return {"overhead": overhead, "gemm": gemm, "attention": attention,
                "all_reduce": all_reduce}

    def _gemm_efficiency(self, rows: float) -> float:
        """The fraction of peak a GEMM of `rows` rows reaches. One row or fewer is a
        matrix-vector product: no tiles to fill, so the efficiency curve (a GEMM's) leaves
        it; its 2 FLOPs per weight hide under the read on real devices."""
        a = self.accelerator
        return 1.0 if rows <= 1 else a.gemm_efficiency * rows / (rows + a.gemm_half_tokens)

    def transfer_time(self, tokens: int) -> float:
        """Seconds to ship `tokens` tokens of KV over the network (all ranks in parallel,
        each its shard over its own link)."""
        a = self.accelerator
        shard = self.shape.kv_bytes_per_token(self.kv_dtype) * tokens / min(
            self.tp, self.shape.num_kv_heads)
        return a.transfer_latency_ms * 1e-3 + shard / (a.network_gbps * 1e9 / 8)

    # ---- memory ----

    def weights_per_device(self) -> float:
        """Bytes of weights one device holds (its TP shard): the decoder's in the weights'
        dtype, the embedding and the LM head in the activations'."""
        s = self.shape
        table = s.vocab_size * s.hidden_size * (1 if s.tie_word_embeddings else 2)
        return ((s.num_params - table) * DTYPE_BYTES[self.dtype]
                + table * DTYPE_BYTES[self.activation_dtype]) / self.tp

    def activation_bytes(self, max_num_batched_tokens: int, max_num_seqs: int) -> float:
        """Peak activation bytes of one device in a full step: per token the residual,
        the q/k/v projections and the MLP's gate and up (its shards), and fp32 logits of
        every sampled position."""
        s, tp = self.shape, self.tp
        width = 2 * s.hidden_size + (s.num_heads + 2 * s.num_kv_heads) * s.head_dim / tp + \
            2 * s.intermediate_size * s.experts_per_token / tp
        return max_num_batched_tokens * width * DTYPE_BYTES[self.activation_dtype] + \
            max_num_seqs * s.vocab_size / tp * 4

    def kv_capacity(self, max_num_batched_tokens: int = defaults.MAX_NUM_BATCHED_TOKENS,
                    max_num_seqs: int = defaults.MAX_NUM_SEQS) -> float:
        """KV bytes one worker holds: over its `tp` devices, the memory vLLM may use
        (`memory_gb` GiB x `memory_utilization`, its `gpu_memory_utilization`) less the
        runtime's reserve (`Accelerator.reserve_bytes`), the weight shard and the
        activations.

        Raises:
            ValueError: the weights and activations do not fit.
        """
        a = self.accelerator
        usable = a.memory_gb * GIB * a.memory_utilization - a.reserve_bytes(self.tp)
        left = usable - self.weights_per_device() - self.activation_bytes(
            max_num_batched_tokens, max_num_seqs)
        if left <= 0:
            raise ValueError(f"{self.shape.name} at tp {self.tp} does not fit a "
                             f"{a.name}: {self.weights_per_device() / GIB:.1f} GiB of weights "
                             f"per device, {usable / GIB:.1f} GiB usable")
        return self.tp * left


# ---- the profile ----

def decode_batches(max_num_seqs: int) -> list[int]:
    """The decode table's batch sizes: the measured profile's, then doubling up to
    `max_num_seqs` (and it), so no batch a worker runs is extrapolated."""
    batches = [b for b in DECODE_BATCHES if b <= max_num_seqs]
    while batches[-1] < max_num_seqs:
        batches.append(min(2 * batches[-1], max_num_seqs))
    return batches


def _grid(max_model_len: int, max_num_seqs: int = defaults.MAX_NUM_SEQS
          ) -> dict[str, list[Any]]:
    """The schedules `pdcluster profile` measures, extended to long prompts and to
    decode batches up to `max_num_seqs`."""
    news = [16, 64, 256, 512, 1024, 2048, 4096]
    prefill = [[[cached, n, True]] * k for n in news for cached in (0, 512, 2048)
               for k in (1, 2, 4) if cached + n < max_model_len and k * n <= 8192]
    mixed = [[[0, n, True]] + [[64, 1, False]] * b for n in (64, 256) for b in (4, 16)]
    contexts = sorted({min(c, max_model_len // 2) for c in (32, 256, 1024, 4096)}
                      | {max_model_len // 4})
    decode = [[[c, 1, False]] * b for b in decode_batches(max_num_seqs) for c in contexts]
    return {"prefill": prefill + mixed, "decode": decode,
            "lengths": sorted({min(n, max_model_len // 2) for n in (64, 256, 1024, 4096)}
                              | {max_model_len // 4, max_model_len // 8})}


def analytic_profile(model: StepModel, block_size: int = defaults.BLOCK_SIZE,
                     max_model_len: int | None = None,
                     max_num_batched_tokens: int = defaults.MAX_NUM_BATCHED_TOKENS,
                     max_num_seqs: int = defaults.MAX_NUM_SEQS, torch_threads: int = 1,
                     name: str | None = None) -> Profile:
    """A `pdcluster.profile/1` profile of `model`: its step times at the measured grid's
    points as the samples, the same linear models fitted on them.

    Args:
        model: the step model.
        block_size: tokens per KV block.
        max_model_len: longest prompt + output (the model's limit if None).
        max_num_batched_tokens: the step budget the activations are sized for.
        max_num_seqs: running requests per worker.
        torch_threads: recorded as the profile's threads (a CPU's).
        name: the profile's `model` (the shape's name if None).
    """
    s, a = model.shape, model.accelerator
    limit = min(max_model_len or s.max_position_embeddings, s.max_position_embeddings)
    grid = _grid(limit, max_num_seqs)
    prefill = [{"items": items, "y": model.step_time(items)} for items in grid["prefill"]]
    decode = [{"items": items, "y": model.step_time(items)} for items in grid["decode"]]
    transfer = [{"tokens": n, "blocks": -(-n // block_size), "y": model.transfer_time(n),
                 "prefill_s": model.step_time([(0, n, True)])} for n in grid["lengths"]]
    capacity = model.kv_capacity(max_num_batched_tokens, max_num_seqs)
    block_bytes = int(model.kv_bytes_per_token()) * block_size
    hardware = {"accelerator": a.name, "tp": model.tp, "kv_heads": s.num_kv_heads,
                "analytic": True,
                "kv_dtype": model.kv_dtype, "source": a.source,
                "gpu": None if a.name == "cpu" else a.name,
                "devices_per_node": a.devices_per_node}
    profile = Profile(
        model=name or s.name, model_id=s.model_id, dtype=model.dtype,
        torch_threads=torch_threads, hardware=hardware, block_size=block_size,
        num_blocks=int(capacity // block_bytes), kv_cache_gb=capacity / GIB,
        block_bytes=block_bytes, max_model_len=limit, transport="network",
        load_time_s=model.weights_per_device() / LOAD_BYTES_PER_S,
        prefill=_EMPTY, decode=_EMPTY, transfer=_EMPTY,
        workers_per_host=max(a.devices_per_node // model.tp, 1),
        samples={"prefill": prefill, "decode": decode, "transfer": transfer,
                 "neighbour": []})
    # The fits' spread over the model's own points is the linear form's error, not a
    # step-time spread to draw from: the analytic steps are exact.
    return replace(fit_profile(profile), step_cv=0.0)


def check_against(model: StepModel, measured: Profile) -> dict[str, Any]:
    """The step model and its profile against a measured profile's samples.

    Each point is one measured schedule (its repeats' median time). Errors are relative:
    (predicted - measured) / measured.

    Returns:
        `{"points": [...], "error": {...}, "hardware": ..., "measured_hardware": ...}`:
        per point the schedule's summary, the measured and both predicted seconds; the
        median, p90 and max of the absolute errors by kind and over all points.
    """
    if model.shape.model_id != measured.model_id:
        raise ValueError(f"the measured profile is of {measured.model_id}, the model "
                         f"config of {model.shape.model_id}")
    profile = analytic_profile(model, measured.block_size, measured.max_model_len,
                               torch_threads=measured.torch_threads)
    points = []
    for kind in ("prefill", "decode"):
        groups: dict[str, list[Any]] = {}
        for sample in measured.samples[kind]:
            groups.setdefault(json.dumps(sample["items"]), []).append(sample["y"])
        for key, ys in groups.items():
            items = [tuple(item) for item in json.loads(key)]
            y = float(np.median(ys))
            points.append({"kind": kind, "schedule": _describe(items), "measured_s": y,
                           "step_model_s": model.step_time(items),
                           "profile_s": profile.step_time(items)})
    error: dict[str, Any] = {}
    for source in ("step_model", "profile"):
        for kind in ("prefill", "decode", "all"):
            errors = [abs(p[f"{source}_s"] - p["measured_s"]) / p["measured_s"]
                      for p in points if kind in ("all", p["kind"])]
            error.setdefault(source, {})[kind] = {
                "median": float(np.median(errors)), "p90": float(np.percentile(errors, 90)),
                "max": float(max(errors)), "points": len(errors)}
    a = model.accelerator
    return {"hardware": {"name": a.name, "source": a.source, "tflops": a.flops(model.dtype) / 1e12,
                         "memory_bandwidth_gbs": a.memory_bandwidth_gbs},
            "measured_hardware": measured.hardware, "model_id": measured.model_id,
            "dtype": model.dtype, "error": error, "points": points}


def _describe(items: Sequence[tuple[int, int, bool]]) -> str:
    """`prefill 2x256 after 512` or `decode 16 at 256` or `mixed 64 + 4 decodes`."""
    prompts = [(s, n) for s, n, is_prompt in items if is_prompt]
    decodes = [s for s, _, is_prompt in items if not is_prompt]
    if prompts and decodes:
        return f"mixed {prompts[0][1]} + {len(decodes)} decodes"
    if prompts:
        return f"prefill {len(prompts)}x{prompts[0][1]} after {prompts[0][0]}"
    return f"decode {len(decodes)} at {decodes[0]}"

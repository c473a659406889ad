"""Turns a step's schedule into tensors, runs the model and samples."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.attention import AttentionBackend, BatchLayout
from engine.hardware import cpu_features
from engine.kernels import cpu_kernels
from engine.kv_cache import KVCache
from engine.models.llama import LayerHook, LlamaForCausalLM
from engine.sampler import sample
from engine.scheduler import ScheduledRequest, SchedulerOutput

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """request id -> sampled token (and logprobs), for requests that reached their end."""

    tokens: dict[str, int]
    logprobs: dict[str, dict[int, float]]


@dataclass(frozen=True)
class StepCosts:
    """Analytic cost of a step: matmul FLOPs and the bytes it must read (weights + KV)."""

    linear_params: int  # per token, all layers (lm_head excluded)
    lm_head_params: int  # per sampled token
    weight_bytes: int
    attn_flops_per_key: int  # per query token, per context token, all layers
    kv_bytes_per_token: int  # all layers, K and V

    @staticmethod
    def for_model(model: LlamaForCausalLM, kv_cache: KVCache) -> StepCosts:
        cfg = model.cfg
        per_layer = sum(p.numel() for n, p in model.layers[0].named_parameters()
                        if "layernorm" not in n)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        return StepCosts(per_layer * cfg.num_layers, cfg.vocab_size * cfg.hidden_size, weights,
                         4 * cfg.num_heads * cfg.head_dim * cfg.num_layers,
                         kv_cache.block_bytes * cfg.num_layers // kv_cache.block_size)

    def estimate(self, layout: BatchLayout, num_sampled: int) -> tuple[float, float]:
        """(FLOPs, bytes read) of one step."""
        tokens = sum(layout.query_lens)
        flops = 2.0 * (tokens * self.linear_params + num_sampled * self.lm_head_params)
        # Causal attention: query i of a chunk sees the context before it and itself.
        keys = sum(q * (c - q) + q * (q + 1) / 2
                   for q, c in zip(layout.query_lens, layout.context_lens, strict=True))
        flops += keys * self.attn_flops_per_key
        nbytes = self.weight_bytes + sum(layout.context_lens) * self.kv_bytes_per_token
        return flops, float(nbytes)


class ModelRunner:
    """Runs one forward pass over the scheduled requests.

    Args:
        model: the model.
        kv_cache: the paged KV pool the model writes into.
        attn: the attention backend.
        device: where inputs are built.
    """

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, attn: AttentionBackend,
                 device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.attn = attn
        self.device = device
        self.block_size = kv_cache.block_size
        self.costs = StepCosts.for_model(model, kv_cache)
        # Running totals for utilization metrics: tokens, model FLOPs, bytes read.
        self.counters = {"prefill_tokens": 0, "decode_tokens": 0, "flops": 0.0, "bytes": 0.0}
        # The device and the paths a step takes on it (logged; in the worker's stats).
        self.hardware = str(device)
        if device.type == "cpu":
            self.hardware = self._cpu_paths(next(model.parameters()).dtype)
            log.info("%s; %d torch threads", self.hardware, torch.get_num_threads())

    def _cpu_paths(self, dtype: torch.dtype) -> str:
        cpu = cpu_features()
        # fp32 linears run on OpenBLAS (BlasLinear), bf16 ones on oneDNN's bf16 GEMM with
        # prepacked weights (OneDnnLinear); fp16 takes torch's kernels.
        linears = {torch.float32: "OpenBLAS fp32",
                   torch.bfloat16: "oneDNN bf16, prepacked"}.get(dtype, "torch")
        kernels = cpu_kernels()
        glue = f"{kernels.isa()} kernels" if kernels is not None else "torch glue"
        if dtype in (torch.bfloat16, torch.float16) and not cpu.native_bf16:
            log.warning("%s on a CPU without native bf16/AMX is emulated: expect it slower "
                        "than float32", str(dtype).removeprefix("torch."))
        return f"CPU: {cpu.describe()}; linears: {linears}; {glue}"

    @torch.inference_mode()
    def execute(self, schedule: SchedulerOutput, layer_hook: LayerHook | None = None
                ) -> StepResult:
        """Compute the scheduled tokens; sample for requests whose last token was computed."""
        # Prefill-type sequences first, single-token ones after: the backends batch the latter.
        batch = sorted(schedule.scheduled, key=lambda s: s.num_new_tokens == 1)
        input_ids, positions, layout = self._prepare(batch)
        self.attn.begin_step(layout)
        hidden = self.model(input_ids, positions, self.kv_cache, self.attn, layer_hook)
        self._count(layout, sum(1 for s in batch if s.samples))
        ends = torch.tensor(layout.query_lens, device=self.device).cumsum(0) - 1
        sampling = [i for i, s in enumerate(batch) if s.samples]
        if not sampling:
            return StepResult({}, {})
        logits = self.model.compute_logits(hidden[ends[sampling]])
        requests = [batch[i].request for i in sampling]
        result = sample(logits, requests)
        tokens = {r.request_id: t for r, t in zip(requests, result.token_ids, strict=True)}
        logprobs = {r.request_id: lp for r, lp in zip(requests, result.logprobs, strict=True)
                    if lp is not None}
        return StepResult(tokens, logprobs)

    def _count(self, layout: BatchLayout, num_sampled: int) -> None:
        prefill = layout.num_prefill_tokens
        decode = len(layout.query_lens) - layout.num_prefills
        flops, nbytes = self.costs.estimate(layout, num_sampled)
        c = self.counters
        c["prefill_tokens"] += prefill
        c["decode_tokens"] += decode
        c["flops"] += flops
        c["bytes"] += nbytes

    def _prepare(self, batch: list[ScheduledRequest]
                 ) -> tuple[torch.Tensor, torch.Tensor, BatchLayout]:
        token_ids: list[int] = []
        pos_ranges = []
        for s in batch:
            end = s.start + s.num_new_tokens
            token_ids.extend(s.request.token_ids(s.start, end))
            pos_ranges.append(torch.arange(s.start, end))
        positions = torch.cat(pos_ranges)
        max_blocks = max(len(s.request.block_ids) for s in batch)
        tables = torch.zeros(len(batch), max_blocks, dtype=torch.long)
        for i, s in enumerate(batch):
            tables[i, :len(s.request.block_ids)] = torch.tensor(s.request.block_ids)
        rows = torch.repeat_interleave(torch.arange(len(batch)),
                                       torch.tensor([s.num_new_tokens for s in batch]))
        slots = tables[rows, positions // self.block_size] * self.block_size + \
            positions % self.block_size
        layout = BatchLayout(
            query_lens=[s.num_new_tokens for s in batch],
            context_lens=[s.start + s.num_new_tokens for s in batch],
            block_tables=tables.to(self.device), slot_mapping=slots.to(self.device),
            num_prefills=sum(1 for s in batch if s.num_new_tokens > 1),
            block_size=self.block_size)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        return ids, positions.to(self.device), layout

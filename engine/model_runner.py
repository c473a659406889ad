"""Turns a step's schedule into tensors, runs the model and samples."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.attention import AttentionBackend, BatchLayout
from engine.hardware import cpu_paths
from engine.kernels import cpu_kernels
from engine.kv_cache import KVCache
from engine.models.llama import LayerHook, LlamaForCausalLM
from engine.request import Request
from engine.sampler import sample
from engine.scheduler import ScheduledRequest, SchedulerOutput
from engine.spec_verify import verify

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """request id -> new tokens (and their logprobs), for requests that reached their end:
    one token, or after a speculative verification the accepted drafts and one more."""

    tokens: dict[str, list[int]]
    logprobs: dict[str, list[dict[int, float]]]


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
        per_token = sum(layer.params_per_token() for layer in model.layers)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        return StepCosts(per_token, cfg.vocab_size * cfg.hidden_size, weights,
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
        paths = cpu_paths()
        kernels = cpu_kernels()
        glue = f"{kernels.isa()} kernels" if kernels is not None else "torch glue"
        if dtype in (torch.bfloat16, torch.float16) and not paths.native_bf16:
            log.warning("%s on a CPU without native bf16/AMX is emulated: expect it slower "
                        "than float32", str(dtype).removeprefix("torch."))
        return f"CPU: {paths.describe()}; linears: {paths.linears(dtype)}; {glue}"

    @torch.inference_mode()
    def execute(self, schedule: SchedulerOutput, layer_hook: LayerHook | None = None
                ) -> StepResult:
        """Compute the scheduled tokens; sample for requests whose last token was computed,
        and verify the drafts of speculative ones (logits at each of their positions)."""
        # Prefill-type sequences first, single-token ones after: the backends batch the latter.
        batch = sorted(schedule.scheduled, key=lambda s: s.num_new_tokens == 1)
        input_ids, positions, layout = self._prepare(batch)
        self.attn.begin_step(layout)
        hidden = self.model(input_ids, positions, self.kv_cache, self.attn, layer_hook)
        # Verified drafts are decode tokens, with logits at every position.
        spec_tokens = sum(s.num_new_tokens for s in batch if s.request.spec_token_ids)
        self._count(layout, sum(1 for s in batch if s.samples and not s.request.spec_token_ids)
                    + spec_tokens, spec_tokens)
        ends = torch.tensor(layout.query_lens).cumsum(0).tolist()
        plain, spec, rows, spec_rows = [], [], [], []
        for i, s in enumerate(batch):
            if not s.samples:
                continue
            if s.request.spec_token_ids:
                spec.append(s.request)
                spec_rows.append(list(range(ends[i] - s.num_new_tokens, ends[i])))
            else:
                plain.append(s.request)
                rows.append(ends[i] - 1)
        num_plain = len(rows)
        rows += [r for group in spec_rows for r in group]
        if not rows:
            return StepResult({}, {})
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        tokens: dict[str, list[int]] = {}
        logprobs: dict[str, list[dict[int, float]]] = {}
        if plain:
            result = sample(logits[:num_plain], plain)
            for r, t, lp in zip(plain, result.token_ids, result.logprobs, strict=True):
                tokens[r.request_id] = [t]
                if lp is not None:
                    logprobs[r.request_id] = [lp]
        start = num_plain
        for r, group in zip(spec, spec_rows, strict=True):
            emitted, lps = verify(logits[start:start + len(group)], r, r.spec_token_ids)
            start += len(group)
            tokens[r.request_id] = emitted
            if lps is not None:
                logprobs[r.request_id] = lps
        return StepResult(tokens, logprobs)

    @torch.inference_mode()
    def draft_step(self, requests: list[Request], starts: list[int],
                   token_ids: list[list[int]], num_layers: int | None = None) -> torch.Tensor:
        """One drafting pass: each request's tokens from its position `start` on (one token,
        or a catch-up over the tokens a draft model has not seen), their KV written into
        the request's slots, through the first `num_layers` layers (an early exit; None:
        all), then the final norm and LM head at each request's last token.

        Returns:
            Logits `[len(requests), vocab]`.
        """
        # Multi-token queries first, as in `execute`: the backends batch the single ones.
        order = sorted(range(len(requests)), key=lambda i: len(token_ids[i]) == 1)
        lens = [len(token_ids[i]) for i in order]
        positions, layout = self._layout([requests[i] for i in order],
                                         [starts[i] for i in order], lens)
        self.attn.begin_step(layout)
        ids = torch.tensor([t for i in order for t in token_ids[i]], dtype=torch.long,
                           device=self.device)
        hidden = self.model(ids, positions, self.kv_cache, self.attn, num_layers=num_layers)
        last = torch.tensor(lens).cumsum(0) - 1
        logits = self.model.compute_logits(hidden[last.to(self.device)])
        return logits[torch.tensor(order).argsort().to(self.device)]

    def _block_tables(self, requests: list[Request]) -> torch.Tensor:
        max_blocks = max(len(r.block_ids) for r in requests)
        tables = torch.zeros(len(requests), max_blocks, dtype=torch.long)
        for i, r in enumerate(requests):
            tables[i, :len(r.block_ids)] = torch.tensor(r.block_ids)
        return tables

    def _count(self, layout: BatchLayout, num_sampled: int, num_spec_tokens: int) -> None:
        prefill = layout.num_prefill_tokens - num_spec_tokens
        decode = len(layout.query_lens) - layout.num_prefills + num_spec_tokens
        flops, nbytes = self.costs.estimate(layout, num_sampled)
        c = self.counters
        c["prefill_tokens"] += prefill
        c["decode_tokens"] += decode
        c["flops"] += flops
        c["bytes"] += nbytes

    def _prepare(self, batch: list[ScheduledRequest]
                 ) -> tuple[torch.Tensor, torch.Tensor, BatchLayout]:
        token_ids: list[int] = []
        for s in batch:
            token_ids.extend(s.request.token_ids(s.start, s.start + s.num_new_tokens))
            token_ids.extend(s.request.spec_token_ids)  # past the request's tokens
        positions, layout = self._layout([s.request for s in batch], [s.start for s in batch],
                                         [s.num_new_tokens for s in batch])
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        return ids, positions, layout

    def _layout(self, requests: list[Request], starts: list[int], lens: list[int]
                ) -> tuple[torch.Tensor, BatchLayout]:
        """Positions and batch layout of `lens[i]` new tokens of request i from `starts[i]`
        on (multi-token queries must come first)."""
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens, strict=True)])
        tables = self._block_tables(requests)
        rows = torch.repeat_interleave(torch.arange(len(requests)), torch.tensor(lens))
        slots = tables[rows, positions // self.block_size] * self.block_size + \
            positions % self.block_size
        layout = BatchLayout(
            query_lens=list(lens), context_lens=[s + n for s, n in zip(starts, lens, strict=True)],
            block_tables=tables.to(self.device), slot_mapping=slots.to(self.device),
            num_prefills=sum(1 for n in lens if n > 1), block_size=self.block_size)
        return positions.to(self.device), layout

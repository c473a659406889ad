"""What an engine reports of itself: load, memory, work done and what it computes in.

A worker adds its own clocks and pushes the whole as `protocol.WorkerStats` (a msgspec
struct: the engine imports no wire library), so every field here is one of that struct's.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

# vLLM's buckets of tokens per engine step (`vllm:iteration_tokens_total`).
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class StepTokenCounts:
    """Engine steps counted by the tokens each computed (prompt, output and drafted
    tokens): `counts[i]` the steps of more than `STEP_TOKEN_BUCKETS[i - 1]` and at most
    `STEP_TOKEN_BUCKETS[i]` tokens, the last those above the top bucket; `total` every
    step's tokens. Cumulative since the engine started."""

    def __init__(self) -> None:
        self.counts = [0] * (len(STEP_TOKEN_BUCKETS) + 1)
        self.total = 0

    def add(self, num_tokens: int) -> None:
        """Count one step that computed `num_tokens` tokens."""
        self.counts[bisect.bisect_left(STEP_TOKEN_BUCKETS, num_tokens)] += 1
        self.total += num_tokens


@dataclass(frozen=True)
class EngineStats:
    """One snapshot of an engine (`LLMEngine.stats`), read on its thread.

    Args:
        dtype: what its model computes in.
        kv_cache_dtype: what its KV pages hold (`int8`, or the model's dtype).
        kv_block_bytes: one KV block across all layers (a draft model's pages included).
        draft_kv_block_bytes: of it, a speculative draft model's pages (0: none).
        hardware: its device and the kernel paths it took there.
        compute_threads: torch's intra-op threads now.
        num_running: requests in the running batch.
        num_waiting: requests queued.
        num_parked: requests held outside the batch (waiting for remote KV, or prefilled
            and waiting to be shipped).
        num_waiting_for_kv: parked requests whose KV has not landed yet.
        num_preemptions: running requests preempted (their KV freed, to be recomputed) when
            blocks ran out (cumulative).
        num_blocks: KV blocks in the pool.
        num_free_blocks: of them, free (prefix-cached ones included).
        kv_usage: share of blocks in use.
        prefix_hit_rate: prompt tokens served from the prefix cache, as a share.
        prefix_cache_hits: prompt tokens found in the prefix cache (cumulative).
        prefix_cache_queries: prompt tokens looked up in it (cumulative).
        step_token_counts: steps by the tokens they computed, one count per bucket of
            `STEP_TOKEN_BUCKETS` and one above them (`StepTokenCounts`; cumulative).
        step_tokens: tokens computed, over those steps (cumulative).
        prefill_tokens: prompt tokens computed (cumulative).
        decode_tokens: tokens decoded (cumulative).
        flops: model FLOPs computed (cumulative).
        bytes: bytes of weights and KV read (cumulative).
        spec_draft_tokens: speculative decoding: tokens drafted (cumulative).
        spec_accepted_tokens: of them, accepted by verification (cumulative).
        spec_emitted_tokens: tokens emitted by verification steps (cumulative).
        spec_verify_steps: request-steps that verified drafts (cumulative).
        spec_acceptance_rate: accepted / drafted, since start.
        spec_tokens_per_step: emitted / verify steps, since start.
    """

    dtype: str
    kv_cache_dtype: str
    kv_block_bytes: int
    draft_kv_block_bytes: int
    hardware: str
    compute_threads: int
    num_running: int
    num_waiting: int
    num_parked: int
    num_waiting_for_kv: int
    num_preemptions: int
    num_blocks: int
    num_free_blocks: int
    kv_usage: float
    prefix_hit_rate: float
    prefix_cache_hits: int
    prefix_cache_queries: int
    step_token_counts: list[int]
    step_tokens: int
    prefill_tokens: int
    decode_tokens: int
    flops: float
    bytes: float
    spec_draft_tokens: int
    spec_accepted_tokens: int
    spec_emitted_tokens: int
    spec_verify_steps: int
    spec_acceptance_rate: float
    spec_tokens_per_step: float

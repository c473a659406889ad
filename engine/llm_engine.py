"""The engine loop: add requests, step, abort; plus the hooks the prefill and decode roles use."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from threadpoolctl import threadpool_limits

from engine.attention import AttentionBackend, get_backend
from engine.block_pool import BlockPool
from engine.config import (
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
    kv_pool_bytes,
    parse_dtype,
)
from engine.defaults import TP_KV_PAGES
from engine.draft_model import draft_block_bytes, draft_kv_cache, load_draft_model
from engine.hardware import keep_freed_memory
from engine.kv_cache import BufferAllocator, KVCache, SharedPages, map_shared
from engine.kv_cache_manager import KVCacheManager
from engine.model_loader import load_model, read_model_config, resolve_model_dir
from engine.model_runner import ModelRunner, StepResult
from engine.models.llama import LlamaForCausalLM
from engine.parallel import (
    Followers,
    KVMirror,
    MirroredAttention,
    ParallelGroup,
    TensorParallelAttention,
    TensorParallelError,
    TensorParallelModel,
    check_tensor_parallel,
    kv_heads,
    shard_config,
    weight_bytes,
)
from engine.request import Request, RequestStatus
from engine.sampler import skip_draws
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.spec_decode import (
    SpecCounters,
    SpeculativeConfig,
    Speculator,
    draft_allowed,
    finish_step,
    speculates,
)
from engine.stats import EngineStats, StepTokenCounts
from engine.structured_output import GrammarCompiler
from engine.threads import ThreadGovernor, cgroup_cpu_limit
from engine.tokenizer import load_tokenizer
from engine.validation import check_request

log = logging.getLogger(__name__)

# Called after layer i wrote its KV for the step's schedule (used to stream KV out).
StepLayerHook = Callable[[int, SchedulerOutput], None]


class KVCacheFullError(RuntimeError):
    """A decode reservation found too few free blocks."""


class EngineStepError(RuntimeError):
    """A step failed; its requests were ended with `error` and their blocks freed.

    Args:
        outputs: the final output of every request the step had scheduled, so a caller
            that streams results can still answer each of them.
    """

    def __init__(self, message: str, outputs: list[EngineOutput]) -> None:
        super().__init__(message)
        self.outputs = outputs


class EngineDeadError(EngineStepError):
    """A step failed in a way no later step recovers from (a tensor-parallel rank died):
    every later step raises it too, at once. Close the engine and start another."""


@dataclass
class EngineOutput:
    """What one step changed for one request.

    Args:
        request_id: the request.
        new_token_ids: tokens sampled this step.
        finish_reason: `stop`, `length`, `abort`, `error`, or None while running.
        new_logprobs: one map per new token when logprobs were asked for.
        num_cached_tokens: prompt tokens served from the prefix cache.
        metrics: timings in seconds (`arrival`, `first_token`, monotonic clock).
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    new_logprobs: list[dict[int, float]] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class LLMEngine:
    """A model, its paged KV cache and one scheduler, driven step by step.

    Args:
        model: `smollm2`, `tiny`, a `.gguf` file or a local Hugging Face directory.
        dtype: `auto`, `float32`, `bfloat16` or `float16`.
        cache: KV cache sizing and prefix caching.
        scheduler: budgets, role and batching policy.
        device: `auto` (CUDA when present), `cpu` or `cuda[:n]`.
        max_model_len: longest prompt + output; defaults to the model's and the pool's limit.
        attention_backend: `auto`, `torch` or `flashinfer`.
        kv_allocator: places the KV pool (for example in shared memory).
        num_threads: torch and BLAS compute threads; None: on CPU the cores other processes
            leave free, re-measured as it runs (`engine.threads.ThreadGovernor`),
            elsewhere torch's default.
        speculative_config: speculative decoding (`SpeculativeConfig`, its JSON text or a
            mapping with vLLM's keys); used by the decode and mixed roles, ignored by prefill.
            A draft model's KV pages share the pool's budget: the pool gets fewer blocks.
        tensor_parallel_size: ranks the model is split over (vLLM's name;
            `engine.parallel`). 1: the whole model in this process. N > 1: this process is
            rank 0 (scheduler, sampler, its shard) and starts N - 1 follower processes
            (forked from a forkserver: a script building an engine at import needs an
            `if __name__ == "__main__":` guard), one per CUDA device after `device` on a
            GPU (untested: no GPU here), all on this CPU otherwise. The KV budget
            (`kv_cache_memory_gb`, or `gpu_memory_utilization`) is per rank, as in vLLM:
            each rank's pool holds its KV heads of every block, so N ranks hold N times
            the budget. On CPU each rank runs `num_threads` threads, or the cores divided
            by N (at least 1). A draft model for speculative decoding runs whole on rank 0.
            Call `close()` (or use the engine as a context manager) to stop the followers.
        tp_kv_pages: where a tensor-parallel engine's ranks keep their KV heads: `shared`
            (CPU, KV heads dividing among the ranks: slices of one pool of every head in
            shared memory that every rank maps), `private` (each rank its own pages; a
            prefill or decode engine, whose KV a transport moves, also keeps a mirror of
            every rank's heads on rank 0, `engine.parallel.KVMirror`: the GPU layout, one
            device a rank), or `auto` (shared where it can be, else private).

    Raises:
        ValueError: a size the model's heads, intermediate sizes or the devices do not
            split into (the message names the dimension).
        TensorParallelError: a follower could not start (its error is in the message).
    """

    def __init__(self, model: str = "tiny", dtype: str | torch.dtype = "float32", *,
                 cache: CacheConfig | None = None, scheduler: SchedulerConfig | None = None,
                 device: str = "auto", max_model_len: int | None = None,
                 attention_backend: str = "auto", kv_allocator: BufferAllocator | None = None,
                 num_threads: int | None = None,
                 speculative_config: str | dict[str, Any] | SpeculativeConfig | None = None,
                 tensor_parallel_size: int = 1, tp_kv_pages: str = "auto") -> None:
        self.speculative_config = SpeculativeConfig.parse(speculative_config)  # fail early
        self.cache_config = cache or CacheConfig()
        self.scheduler_config = scheduler or SchedulerConfig()
        self.tensor_parallel_size = _check_tp_size(tensor_parallel_size)
        if tp_kv_pages not in TP_KV_PAGES:
            raise ValueError(f"tp_kv_pages must be one of {TP_KV_PAGES}, got {tp_kv_pages!r}")
        # Whether `kv_cache` holds every KV head of the model, as a KV transport needs it
        # to: always at size 1; under tensor parallelism, see `tp_kv_pages`.
        self.kv_cache_whole = True
        self._followers: Followers | None = None
        self._mirror: KVMirror | None = None
        self._to_scatter: list[int] = []  # blocks a transport wrote into the mirror
        self._shared_pages: SharedPages | None = None  # the pool's, when it made its own
        # Bytes of each rank's weights, rank 0 first (its shard under tensor parallelism).
        self.weight_bytes_per_rank: list[int] = []
        self.device = _pick_device(device)
        self.dtype = parse_dtype(dtype, self.device)
        self.threads: ThreadGovernor | None = None
        if tensor_parallel_size > 1 and num_threads is None and self.device.type == "cpu":
            # A governor would count the other ranks as load that takes its cores away.
            num_threads = _threads_per_rank(tensor_parallel_size)
        if num_threads is not None:
            torch.set_num_threads(num_threads)
            threadpool_limits(num_threads, user_api="blas")  # numpy's OpenBLAS: fp32 linears
        elif self.device.type == "cpu":
            self.threads = ThreadGovernor(frozenset(os.sched_getaffinity(0)), cgroup_cpu_limit(),
                                          blas_reserve=int(self.dtype == torch.float32))
        if self.device.type == "cpu" and not keep_freed_memory():
            log.info("malloc settings not applied (not glibc): activations are mapped afresh")
        self.model_dir = resolve_model_dir(model)
        self.model_config, hf_config = read_model_config(self.model_dir, max_model_len)
        self.tokenizer = load_tokenizer(self.model_dir)
        cfg = self.model_config
        bs = self.cache_config.block_size
        if tensor_parallel_size == 1:
            self.model = load_model(self.model_dir, cfg, hf_config, self.dtype, self.device)
            # A draft model is loaded before the pool is sized: its pages take part of the
            # budget.
            draft = self._load_draft(self.speculative_config)
            num_blocks = self.cache_config.num_blocks or self._blocks_for_memory(draft)
            kv_dtype = self.cache_config.kv_cache_dtype
            attn = _attention_backend(self.device, cfg, attention_backend, kv_dtype)
            self.kv_cache = KVCache(cfg.num_layers, num_blocks, bs, cfg.num_kv_heads,
                                    cfg.head_dim, self.dtype, self.device, kv_allocator,
                                    kv_dtype)
            self.weight_bytes_per_rank = [weight_bytes(self.model)]
            pages = self.kv_cache
        else:
            draft, attn, pages = self._start_tensor_parallel(
                hf_config, attention_backend, num_threads, kv_allocator, tp_kv_pages)
            num_blocks = self.kv_cache.num_blocks
        self.block_pool = BlockPool(num_blocks, self.cache_config.enable_prefix_caching)
        self.kv_manager = KVCacheManager(self.block_pool, bs)
        self.runner = ModelRunner(self.model, pages, attn, self.device)
        self.scheduler = Scheduler(self.scheduler_config, self.kv_manager)
        # The draft model's path and runner (`speculative_config.model`), while one is set.
        self._draft: tuple[str, ModelRunner] | None = None
        if draft is not None:
            self._draft = (self.speculative_config.model, self._draft_runner_for(draft))
            log.info("draft model: its KV takes %d of the %d bytes of a block; %d blocks",
                     self.draft_kv_block_bytes, self.kv_block_bytes, num_blocks)
        self.speculator: Speculator | None = None
        self.spec_counters = SpecCounters()
        self.set_speculative_config(self.speculative_config)
        self.max_model_len = min(cfg.max_model_len, num_blocks * bs)
        if not self.scheduler_config.enable_chunked_prefill:
            self.max_model_len = min(self.max_model_len,
                                     self.scheduler_config.max_num_batched_tokens)
        self.requests: dict[str, Request] = {}
        # What the last step computed (`SchedulerOutput.items`), for step-time accounting.
        self.last_step: list[tuple[int, int, bool]] = []
        self.step_token_counts = StepTokenCounts()
        self.grammar = GrammarCompiler(self.tokenizer, cfg.vocab_size, cfg.eos_token_ids)

    def _start_tensor_parallel(self, hf_config: Any, attention_backend: str,
                               num_threads: int | None, kv_allocator: BufferAllocator | None,
                               tp_kv_pages: str
                               ) -> tuple[LlamaForCausalLM | None, AttentionBackend, KVCache]:
        """Start the followers, load rank 0's shard (and a draft model, whole), size the
        pool to the smallest rank's budget and build the pages. Sets `model`, `kv_cache`
        and `weight_bytes_per_rank`.

        With `shared` pages, `kv_cache` is one pool of every head in shared memory
        (`kv_allocator` when it is `SharedPages`, else its own), each rank reading and
        writing its heads' slice of it in place. With `private` pages each rank has pages
        of its own heads; in a prefill or decode engine `kv_cache` is then rank 0's mirror
        of every rank's heads (`KVMirror`, its blocks counted in rank 0's budget), else
        rank 0's pages. Either way a prefill or decode engine's `kv_cache` is the whole
        model's pool, as at size 1, so pools of different sizes exchange KV blocks
        unchanged (`kv_cache_whole`).

        Returns:
            The draft model (or None), rank 0's attention backend and its pages.

        Raises:
            ValueError: the pool would be whole but `kv_allocator` is not `SharedPages`.
        """
        size, cfg, cache = self.tensor_parallel_size, self.model_config, self.cache_config
        check_tensor_parallel(cfg, size)
        shared = _shared_tp_pages(tp_kv_pages, self.device, cfg, size)
        # Replicated KV heads (fewer than ranks) mirror too: each replica writes the same rows.
        mirrored = not shared and self.scheduler_config.role != "mixed"
        if self.device.type == "cuda" and \
                (self.device.index or 0) + size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size {size} needs {size} CUDA devices from "
                             f"{self.device} on; {torch.cuda.device_count()} are visible")
        builder = _ShardBuilder(self.model_dir, cfg, hf_config, self.dtype, cache,
                                attention_backend, size)
        attn = builder.attention(self.device)  # refuses int8 pages on FlashInfer first
        self._followers = followers = Followers.start(size, builder, self.device, num_threads)
        try:
            shard = builder.load(followers.group)
            draft = self._load_draft(self.speculative_config)
            extra = 0 if draft is None else draft_block_bytes(
                draft, cache.block_size, self.dtype, cache.kv_cache_dtype)
            if mirrored:
                extra += KVCache.bytes_per_block(cfg.num_layers, cache.block_size,
                                                 cfg.num_kv_heads, cfg.head_dim, self.dtype,
                                                 cache.kv_cache_dtype)
            ready = followers.wait_ready()
            num_blocks = min([builder.num_blocks(self.device, extra),
                              *(blocks for blocks, _ in ready)])
            if shared:
                if kv_allocator is not None and not isinstance(kv_allocator, SharedPages):
                    raise ValueError("a tensor-parallel pool on CPU lives in shared memory "
                                     "its ranks map: kv_allocator must be SharedPages")
                if kv_allocator is None:
                    kv_allocator = self._shared_pages = SharedPages(
                        f"pdcluster-tp-{os.getpid()}")
                self.kv_cache = builder.kv_cache(num_blocks, self.device, kv_allocator,
                                                 whole=True)
                pages = self.kv_cache.heads(kv_heads(cfg, 0, size))
                followers.begin(num_blocks, os.getpid(), kv_allocator.fd,
                                kv_allocator.nbytes)
            elif mirrored:
                followers.begin(num_blocks, mirrored=True)
                pages = builder.kv_cache(num_blocks, self.device)
                self.kv_cache = builder.kv_cache(num_blocks, self.device, kv_allocator,
                                                 whole=True)
                self._mirror = KVMirror(followers.group, pages, self.kv_cache,
                                        [kv_heads(cfg, rank, size) for rank in range(size)])
                attn = MirroredAttention(attn, self._mirror)
            else:
                followers.begin(num_blocks)
                self.kv_cache = pages = builder.kv_cache(num_blocks, self.device, kv_allocator)
        except BaseException:
            followers.stop()
            raise
        self.model = TensorParallelModel(shard, followers)
        self.weight_bytes_per_rank = [weight_bytes(shard), *(nbytes for _, nbytes in ready)]
        self.kv_cache_whole = shared or mirrored
        return draft, TensorParallelAttention(attn), pages

    @property
    def follower_pids(self) -> list[int]:
        """Process ids of the tensor-parallel followers, ranks 1 to N - 1 (none at size 1)."""
        return [] if self._followers is None else self._followers.pids

    def close(self) -> None:
        """Stop the tensor-parallel followers and wait for them; idempotent. At size 1
        there is nothing to stop; above it, every later step raises EngineDeadError."""
        if self._followers is not None:
            self._followers.stop()
        if self._shared_pages is not None:  # the pages stay until the pool is dropped
            self._shared_pages.close()
            self._shared_pages = None

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def set_speculative_config(
            self, config: str | dict[str, Any] | SpeculativeConfig | None) -> None:
        """Decode speculatively as `config` says from the next step on (None: plainly).

        Drafts live for one step only, so running requests simply go on the new way. A
        draft model set here after start-up gets pages for the whole pool beside the budget
        the pool was sized with (set at construction, it shares that budget).

        Raises:
            ValueError: a bad configuration or a draft model that cannot serve this target
                (the message names the key).
        """
        config = SpeculativeConfig.parse(config)
        path = None if config is None else config.draft_model
        if path is None:
            self._draft = None
        elif self._draft is None or self._draft[0] != path:
            draft = self._load_draft(config)
            self._draft = (path, self._draft_runner_for(draft))  # type: ignore[arg-type]
        self.speculator = None if config is None else \
            Speculator(config, self.runner, None if self._draft is None else self._draft[1])
        self.speculative_config = config
        self.scheduler.num_lookahead = None if self.speculator is None else self._num_lookahead

    def _load_draft(self, config: SpeculativeConfig | None) -> LlamaForCausalLM | None:
        if config is None or config.draft_model is None:
            return None
        return load_draft_model(config.draft_model, self.model_config, self.tokenizer,
                                self.dtype, self.device)

    def _draft_runner_for(self, draft: LlamaForCausalLM) -> ModelRunner:
        """The draft's runner: its pages as many blocks as the pool, the target's KV dtype
        (int8 pages included: the torch backend reads them for any model)."""
        cfg = draft.cfg
        kv = draft_kv_cache(draft, self.kv_cache.num_blocks, self.kv_cache.block_size,
                            self.dtype, self.device, self.cache_config.kv_cache_dtype)
        attn = get_backend(self.device, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                           self.runner.attn.name)
        return ModelRunner(draft, kv, attn, self.device)

    @property
    def draft_kv_block_bytes(self) -> int:
        """Bytes one block of the draft model's pages costs (0: no draft model)."""
        if self._draft is None:
            return 0
        kv = self._draft[1].kv_cache
        return kv.block_bytes * kv.num_layers

    @property
    def kv_block_bytes(self) -> int:
        """Bytes one block costs across the target's layers and the draft model's."""
        return self.kv_cache.block_bytes * self.kv_cache.num_layers + self.draft_kv_block_bytes

    def _num_lookahead(self, request: Request) -> int:
        if not speculates(request) or not draft_allowed(request):
            return 0
        return self.speculative_config.num_speculative_tokens  # type: ignore[union-attr]

    def _blocks_for_memory(self, draft: LlamaForCausalLM | None) -> int:
        """Blocks the budget holds, each with the target's pages and the draft model's."""
        cache = self.cache_config
        extra = 0 if draft is None else draft_block_bytes(draft, cache.block_size, self.dtype,
                                                          cache.kv_cache_dtype)
        return _blocks_for_budget(cache, self.model_config, self.dtype, self.device, extra)

    # ---- requests -------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Check a request before it takes any resource.

        Raises:
            ValueError: the message names the field and the limit.
        """
        check_request(prompt_token_ids, params, self.model_config.vocab_size,
                      self.max_model_len)

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, output_token_ids: Sequence[int] = (),
                    ttft_deadline: float | None = None) -> Request:
        """Validate and queue a request.

        Args:
            request_id: unique among this engine's requests.
            prompt_token_ids: the prompt.
            params: how to sample.
            output_token_ids: tokens the request already produced elsewhere (it migrated
                from a worker that died): recomputed with the prompt, exactly like a
                preempted request, and counted as output for `max_tokens`, penalties and
                the grammar, so the continuation is the one the first worker would have made.
            ttft_deadline: `time.monotonic()` by which its first token is due (a TTFT
                objective): waiting requests that can still make theirs go first
                (`Scheduler.order_waiting`); None: arrival order.

        Raises:
            ValueError: bad input, or `request_id` already in use.
        """
        if output_token_ids:
            self.validate(list(prompt_token_ids) + list(output_token_ids), params)
            if len(output_token_ids) >= params.max_tokens:
                raise ValueError(f"output_token_ids: {len(output_token_ids)} tokens already "
                                 f"reach max_tokens {params.max_tokens}")
        request = self._new_request(request_id, prompt_token_ids, params)
        request.output_token_ids = list(output_token_ids)
        request.ttft_deadline = ttft_deadline
        skip_draws(request, self.model_config.vocab_size, len(output_token_ids))
        self.scheduler.add_request(request)
        return request

    def _new_request(self, request_id: str, prompt_token_ids: list[int],
                     params: SamplingParams) -> Request:
        self.validate(prompt_token_ids, params)
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        request = Request(request_id, prompt_token_ids, params, self.model_config.eos_token_ids,
                          self.max_model_len)
        if params.json_schema is not None:
            request.grammar = self.grammar.matcher(params.json_schema)
        self.requests[request_id] = request
        return request

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    def step(self, layer_hook: StepLayerHook | None = None) -> list[EngineOutput]:
        """Schedule, run the model once, and report what changed."""
        schedule = self.scheduler.schedule()
        for request in schedule.preempted:
            # `request` is the key pdcluster's log formats read a request's fields from.
            log.info("preempted (no free KV blocks): its %d tokens are recomputed later",
                     request.num_tokens, extra={"request": {"request_id": request.request_id}})
        if not schedule.scheduled:
            self.last_step = []
            return []
        if self.threads is not None:
            self.threads.update()
        started = time.perf_counter()
        result = self._run(schedule, layer_hook)
        num_tokens = sum(n for _, n, _ in self.last_step)
        self.scheduler.observe_step(num_tokens, time.perf_counter() - started)
        self.step_token_counts.add(num_tokens)
        before = {s.request.request_id: len(s.request.output_token_ids)
                  for s in schedule.scheduled}
        changed = self.scheduler.postprocess(schedule, result.tokens)
        new_tokens = {r.request_id: r.output_token_ids[before[r.request_id]:] for r in changed}
        finish_step(schedule, new_tokens, self.spec_counters)
        return [self._step_output(r, new_tokens[r.request_id], result) for r in changed]

    def _run(self, schedule: SchedulerOutput, layer_hook: StepLayerHook | None) -> StepResult:
        """Draft (when speculating) and run the model; a failure ends the step's requests."""
        hook = None if layer_hook is None else (lambda i: layer_hook(i, schedule))
        try:
            if self._to_scatter:  # KV a transport wrote into the mirror: to every rank
                blocks, self._to_scatter = self._to_scatter, []
                self._followers.scatter(self._mirror, blocks)
            if self.speculator is not None:
                self.speculator.propose(schedule)
            self.last_step = schedule.items()
            return self.runner.execute(schedule, hook)
        except Exception as e:
            ended = [self.abort_request(item.request.request_id, "error")
                     for item in schedule.scheduled]
            error = EngineDeadError if isinstance(e, TensorParallelError) else EngineStepError
            raise error(f"engine step failed: {type(e).__name__}: {e}",
                        [out for out in ended if out is not None]) from e

    def _step_output(self, request: Request, new_tokens: list[int],
                     result: StepResult) -> EngineOutput:
        """A changed request's output, with the logprobs of the tokens it kept (finishing
        part-way through verified drafts drops the rest)."""
        logprobs = result.logprobs.get(request.request_id)
        if logprobs is not None:
            logprobs = logprobs[:len(new_tokens)]
            request.logprobs.extend(logprobs)
        return self._output(request, new_tokens, logprobs)

    def _output(self, request: Request, new_tokens: list[int],
                logprobs: list[dict[int, float]] | None) -> EngineOutput:
        if request.is_finished and request.request_id not in self.scheduler.parked:
            self.requests.pop(request.request_id, None)
        metrics = {"arrival": request.arrival_time}
        if request.first_token_time is not None:
            metrics["first_token"] = request.first_token_time
        return EngineOutput(request.request_id, new_tokens, request.finish_reason, logprobs,
                            request.num_cached_tokens, metrics)

    def abort_request(self, request_id: str, reason: str = "abort") -> EngineOutput | None:
        """End a request wherever it is and release its blocks; None if unknown."""
        request = self.scheduler.finish(request_id, reason)
        if request is None:
            return None
        return self._output(request, [], None)

    # ---- decode role: KV that arrives from a remote prefill ---------------------------

    def reserve_remote(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> Request:
        """Reserve blocks for a prompt whose KV a prefill worker will write.

        Returns:
            The request; `block_ids` are the destinations and `num_computed_tokens`
            the prompt tokens already present through the prefix cache.

        Raises:
            ValueError: bad input.
            KVCacheFullError: not enough free blocks now.
        """
        request = self._new_request(request_id, prompt_token_ids, params)
        if not self.scheduler.reserve_remote(request):
            del self.requests[request_id]
            raise KVCacheFullError(
                f"request {request_id}: {len(prompt_token_ids)} prompt tokens need more KV "
                f"blocks than the {self.block_pool.num_free_blocks} free")
        return request

    def complete_remote(self, request_id: str, first_token_id: int) -> EngineOutput:
        """The remote prefill finished: the request joins the decode batch.

        Raises:
            KeyError: no reservation for `request_id`.
        """
        request = self.scheduler.complete_remote(request_id, first_token_id)
        skip_draws(request, self.model_config.vocab_size, 1)  # drawn on the prefill worker
        if self._mirror is not None:  # the ranks read their heads of it from the next step
            self._to_scatter.extend(request.block_ids)
        return self._output(request, [first_token_id], None)

    # ---- prefill role: KV kept until shipped -----------------------------------------

    def release(self, request_id: str) -> None:
        """Free a prefilled request's blocks once its KV has been shipped."""
        self.abort_request(request_id, "stop")

    def set_role(self, role: str) -> None:
        """Schedule as `role` (`prefill`, `decode` or `mixed`) from now on.

        The KV pool and its prefix cache stay; only the scheduler's policy changes, so the
        engine must hold no request.

        Raises:
            ValueError: requests are still running, waiting or parked, or an unknown role.
        """
        scheduler = self.scheduler
        if scheduler.running or scheduler.waiting or scheduler.parked:
            raise ValueError(f"cannot change role with requests in the engine "
                             f"({len(scheduler.running)} running, {len(scheduler.waiting)} "
                             f"waiting, {len(scheduler.parked)} parked)")
        self.scheduler_config = scheduler.config = replace(self.scheduler_config, role=role)

    def stats(self) -> EngineStats:
        """Load and memory figures for placement and metrics, and what it computes in."""
        pool = self.block_pool
        return EngineStats(
            dtype=str(self.dtype).removeprefix("torch."),
            kv_cache_dtype=self.kv_cache.kv_cache_dtype,
            kv_block_bytes=self.kv_block_bytes,
            draft_kv_block_bytes=self.draft_kv_block_bytes,
            hardware=self.runner.hardware,
            compute_threads=torch.get_num_threads(),
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_parked=len(self.scheduler.parked),
            num_waiting_for_kv=self.num_waiting_for_kv(),
            num_preemptions=self.scheduler.num_preemptions,
            num_blocks=pool.num_blocks,
            num_free_blocks=pool.num_free_blocks,
            kv_usage=pool.usage,
            prefix_hit_rate=pool.num_hits / pool.num_queries if pool.num_queries else 0.0,
            prefix_cache_hits=pool.num_hits,
            prefix_cache_queries=pool.num_queries,
            step_token_counts=list(self.step_token_counts.counts),
            step_tokens=self.step_token_counts.total,
            **self.runner.counters,
            **self.spec_counters.stats(),
        )

    def num_waiting_for_kv(self) -> int:
        """Parked requests whose remote KV has not landed yet."""
        return sum(1 for r in self.scheduler.parked.values()
                   if r.status == RequestStatus.WAITING_FOR_REMOTE_KV)


@dataclass(frozen=True)
class _ShardBuilder:
    """How every rank of a tensor-parallel engine builds its shard, its KV pages and its
    attention backend (`engine.parallel.ShardBuilder`); pickled to each follower."""

    model_dir: Path
    cfg: ModelConfig
    hf_config: Any
    dtype: torch.dtype
    cache: CacheConfig
    attention_backend: str
    size: int

    def load(self, group: ParallelGroup) -> LlamaForCausalLM:
        return load_model(self.model_dir, self.cfg, self.hf_config, self.dtype, group.device,
                          group)

    def num_blocks(self, device: torch.device, extra_block_bytes: int = 0) -> int:
        """The pool's size, or the blocks this rank's budget holds of its KV heads (and
        `extra_block_bytes` more per block: rank 0's draft model)."""
        if self.cache.num_blocks:
            return self.cache.num_blocks
        return _blocks_for_budget(self.cache, shard_config(self.cfg, self.size), self.dtype,
                                  device, extra_block_bytes)

    def attention(self, device: torch.device) -> AttentionBackend:
        return _attention_backend(device, shard_config(self.cfg, self.size),
                                  self.attention_backend, self.cache.kv_cache_dtype)

    def kv_cache(self, num_blocks: int, device: torch.device,
                 allocator: BufferAllocator | None = None, whole: bool = False) -> KVCache:
        """A rank's pages of its KV heads, or (`whole`) the pool of every head."""
        cfg = self.cfg if whole else shard_config(self.cfg, self.size)
        return KVCache(cfg.num_layers, num_blocks, self.cache.block_size, cfg.num_kv_heads,
                       cfg.head_dim, self.dtype, device, allocator, self.cache.kv_cache_dtype)

    def pages(self, num_blocks: int, device: torch.device, rank: int,
              shared: tuple[int, int, int] | None) -> tuple[KVCache, AttentionBackend]:
        if shared is None:
            return self.kv_cache(num_blocks, device), self.attention(device)
        pid, fd, nbytes = shared
        pool = self.kv_cache(num_blocks, device, lambda _numel, dtype: map_shared(
            pid, fd, nbytes, dtype), whole=True)
        return pool.heads(kv_heads(self.cfg, rank, self.size)), self.attention(device)


def _attention_backend(device: torch.device, cfg: ModelConfig, name: str,
                       kv_cache_dtype: str) -> AttentionBackend:
    """The attention backend for `cfg`'s heads (one rank's, under tensor parallelism).

    Raises:
        ValueError: int8 pages on a backend that cannot read them, or an unknown name.
    """
    attn = get_backend(device, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, name)
    if kv_cache_dtype == "int8" and attn.name != "torch":
        raise ValueError(f"--kv-cache-dtype int8 needs the torch attention backend (its "
                         f"CPU kernels read int8 pages); {attn.name} does not: use "
                         f"--kv-cache-dtype auto, or attention_backend='torch'")
    return attn


def _blocks_for_budget(cache: CacheConfig, cfg: ModelConfig, dtype: torch.dtype,
                       device: torch.device, extra_block_bytes: int) -> int:
    """Blocks the KV budget holds on `device`, each with `cfg`'s pages (one rank's KV heads
    under tensor parallelism) and `extra_block_bytes` more."""
    per_block = KVCache.bytes_per_block(cfg.num_layers, cache.block_size, cfg.num_kv_heads,
                                        cfg.head_dim, dtype, cache.kv_cache_dtype)
    per_block += extra_block_bytes
    total = held = 0
    if device.type == "cuda":
        total = torch.cuda.mem_get_info(device)[1]
        held = torch.cuda.memory_reserved(device)
    return max(kv_pool_bytes(cache, device.type, total, held) // per_block, 1)


def _shared_tp_pages(pages: str, device: torch.device, cfg: ModelConfig, size: int) -> bool:
    """Whether a tensor-parallel engine's ranks share one pool (`tp_kv_pages`).

    Raises:
        ValueError: `shared` where the ranks cannot share one pool.
    """
    possible = device.type == "cpu" and cfg.num_kv_heads % size == 0
    if pages == "shared" and not possible:
        raise ValueError(f"tp_kv_pages shared needs CPU ranks and KV heads dividing among "
                         f"them ({cfg.num_kv_heads} KV heads, {size} ranks on {device})")
    return possible and pages != "private"


def _check_tp_size(size: int) -> int:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
    return size


def _threads_per_rank(size: int) -> int:
    """Compute threads for each of `size` ranks sharing this process's cores."""
    cores = len(os.sched_getaffinity(0))
    return max(1, min(cores, cgroup_cpu_limit() or cores) // size)


def _pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        picked = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device: {device!r} is not a torch device") from e
    if picked.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda was asked for but CUDA is not available")
    return picked

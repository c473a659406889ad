"""The offline API, shaped like vLLM's: `LLM(...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from types import TracebackType
from typing import Any

from engine.config import CacheConfig
from engine.generation_config import load_generation_defaults
from engine.llm_engine import EngineOutput, LLMEngine
from engine.request import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import IncrementalDetokenizer, apply_chat_template

Prompt = str | list[int]


class LLM:
    """Generate text in-process.

    Args:
        model: `smollm2`, `tiny`, a `.gguf` file or a local Hugging Face directory.
        dtype: `float32`, `bfloat16` or `float16`.
        kv_cache_dtype: `auto` (the model's dtype) or `int8`; sets `cache.kv_cache_dtype`.
        generation_config: where `generate` without sampling params takes its defaults
            (vLLM's): `auto`, the model folder's generation_config.json; `vllm`, none; or a
            folder holding that file.
        override_generation_config: generation_config.json keys over those defaults.
        **engine_kwargs: passed to `LLMEngine` (cache, scheduler, device,
            tensor_parallel_size, ...). With `tensor_parallel_size` > 1, `close()` (or a
            `with` block) stops the engine's follower processes.

    Raises:
        ValueError: a bad generation config or override (the message names the setting).
    """

    def __init__(self, model: str = "smollm2", dtype: str = "float32",
                 kv_cache_dtype: str = "auto", generation_config: str = "auto",
                 override_generation_config: dict[str, Any] | None = None,
                 **engine_kwargs: Any) -> None:
        if kv_cache_dtype != "auto":
            cache = engine_kwargs.get("cache") or CacheConfig()
            engine_kwargs["cache"] = replace(cache, kv_cache_dtype=kv_cache_dtype)
        self.engine = LLMEngine(model, dtype, **engine_kwargs)
        self.tokenizer = self.engine.tokenizer
        self.generation = load_generation_defaults(generation_config, self.engine.model_dir,
                                                   override_generation_config)
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's tensor-parallel followers, if any (idempotent)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses when given no sampling params: SamplingParams with the
        generation config's defaults (vLLM's name)."""
        return self.generation.sampling_params()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching.

        Args:
            prompts: one prompt or a list; a prompt is text or a list of token ids.
            sampling_params: one for all prompts, or one per prompt; None:
                `get_default_sampling_params()` (the generation config's defaults).

        Returns:
            One RequestOutput per prompt, in order.

        Raises:
            ValueError: a prompt or parameter is invalid (nothing was started).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _expand_params(sampling_params, len(prompts))
        token_lists = [self._encode(p, i) for i, p in enumerate(prompts)]
        for ids, p in zip(token_lists, params, strict=True):
            self.engine.validate(ids, p)
        return self._run(token_lists, params)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
             ) -> list[RequestOutput]:
        """Generate replies to conversations rendered with the model's chat template."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [apply_chat_template(self.tokenizer, c) for c in conversations]
        return self.generate(prompts, sampling_params)

    def _encode(self, prompt: Prompt, index: int) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"prompts[{index}]: must not be empty")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list):
            return prompt
        raise ValueError(f"prompts[{index}]: must be a string or a list of token ids")

    def _run(self, token_lists: list[list[int]],
             params: list[SamplingParams]) -> list[RequestOutput]:
        ids = [f"offline-{next(self._ids)}" for _ in token_lists]
        results = {rid: _Collector(rid, tokens, p, self.tokenizer)
                   for rid, tokens, p in zip(ids, token_lists, params, strict=True)}
        try:
            for rid, tokens, p in zip(ids, token_lists, params, strict=True):
                self.engine.add_request(rid, tokens, p)
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if results[out.request_id].add(out):
                        self.engine.abort_request(out.request_id, "stop")
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid, "abort")
            raise
        return [results[rid].output() for rid in ids]


class _Collector:
    """Accumulates one request's tokens and text."""

    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams,
                 tokenizer: Any) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.detok = IncrementalDetokenizer(tokenizer, prompt, params)
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] = []
        self.finish_reason: str | None = None
        self.num_cached_tokens = 0

    def add(self, out: EngineOutput) -> bool:
        """Take a step's output; True when a stop string ended the text."""
        taken = self.detok.num_tokens
        self.detok.add(out.new_token_ids)
        taken = self.detok.num_tokens - taken  # fewer when a stop string ended the text
        self.token_ids.extend(out.new_token_ids[:taken])
        self.logprobs.extend((out.new_logprobs or [])[:taken])
        self.num_cached_tokens = out.num_cached_tokens
        if out.finish_reason is not None and taken == len(out.new_token_ids):
            self.finish_reason = out.finish_reason
        elif self.detok.stopped:
            self.finish_reason = "stop"
            return out.finish_reason is None  # still running: end it
        return False

    def output(self) -> RequestOutput:
        self.detok.flush()
        completion = CompletionOutput(0, self.detok.text, self.token_ids, self.finish_reason,
                                      self.logprobs if self.params.logprobs is not None
                                      else None)
        return RequestOutput(self.request_id, self.prompt, [completion], finished=True,
                             num_cached_tokens=self.num_cached_tokens)


def _expand_params(params: SamplingParams | Sequence[SamplingParams],
                   n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"sampling_params: {len(params)} given for {n} prompts")
    return params

"""pdcluster's model runtime: paged KV cache, continuous batching, one Llama implementation.

The public surface other packages may use: `LLM`, `LLMEngine`, `SamplingParams`,
`RequestOutput`, `CompletionOutput`, `EngineOutput`, the configs (`SpeculativeConfig`
too), the tokenizer helpers, `check_request`, `hash_blocks` (the prefix cache's chained
block hash, which the router's prefix affinity shares), the generation-config reader
(`load_generation_defaults` and its checks, which the router's defaults share) and
`defaults`. Names load on first
use, so reading `engine.defaults` (the CLI does, for its help text) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.block_pool import hash_blocks
    from engine.config import CacheConfig, ModelConfig, SchedulerConfig
    from engine.generation_config import (
        GenerationDefaults,
        check_generation_config,
        load_generation_defaults,
        parse_generation_override,
    )
    from engine.llm import LLM
    from engine.llm_engine import (
        EngineDeadError,
        EngineOutput,
        EngineStepError,
        KVCacheFullError,
        LLMEngine,
    )
    from engine.request import CompletionOutput, RequestOutput
    from engine.sampling_params import SamplingParams
    from engine.spec_decode import SpeculativeConfig
    from engine.tokenizer import IncrementalDetokenizer, apply_chat_template, load_tokenizer
    from engine.validation import check_request, fit_context

_WHERE = {
    "CacheConfig": "engine.config", "ModelConfig": "engine.config",
    "SchedulerConfig": "engine.config", "LLM": "engine.llm",
    "EngineOutput": "engine.llm_engine", "EngineStepError": "engine.llm_engine",
    "EngineDeadError": "engine.llm_engine",
    "KVCacheFullError": "engine.llm_engine", "LLMEngine": "engine.llm_engine",
    "CompletionOutput": "engine.request", "RequestOutput": "engine.request",
    "SamplingParams": "engine.sampling_params", "SpeculativeConfig": "engine.spec_decode",
    "IncrementalDetokenizer": "engine.tokenizer", "apply_chat_template": "engine.tokenizer",
    "load_tokenizer": "engine.tokenizer", "check_request": "engine.validation",
    "fit_context": "engine.validation", "hash_blocks": "engine.block_pool",
    "GenerationDefaults": "engine.generation_config",
    "check_generation_config": "engine.generation_config",
    "load_generation_defaults": "engine.generation_config",
    "parse_generation_override": "engine.generation_config",
}

__all__ = [
    "LLM",
    "CacheConfig",
    "CompletionOutput",
    "EngineDeadError",
    "EngineOutput",
    "EngineStepError",
    "GenerationDefaults",
    "IncrementalDetokenizer",
    "KVCacheFullError",
    "LLMEngine",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
    "SpeculativeConfig",
    "apply_chat_template",
    "check_generation_config",
    "check_request",
    "fit_context",
    "hash_blocks",
    "load_generation_defaults",
    "load_tokenizer",
    "parse_generation_override",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value

"""pdcluster's model runtime: paged KV cache, continuous batching, one Llama implementation.

The public surface other packages may use: `LLM`, `LLMEngine`, `SamplingParams`,
`RequestOutput`, `CompletionOutput`, `EngineOutput`, the configs, the tokenizer helpers and
`check_request`.
"""

from engine.config import CacheConfig, ModelConfig, SchedulerConfig
from engine.llm import LLM
from engine.llm_engine import EngineOutput, EngineStepError, KVCacheFullError, LLMEngine
from engine.request import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import IncrementalDetokenizer, apply_chat_template, load_tokenizer
from engine.validation import check_request, fit_context

__all__ = [
    "LLM",
    "CacheConfig",
    "CompletionOutput",
    "EngineOutput",
    "EngineStepError",
    "IncrementalDetokenizer",
    "KVCacheFullError",
    "LLMEngine",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
    "apply_chat_template",
    "check_request",
    "fit_context",
    "load_tokenizer",
]

"""A separate draft model for speculative decoding: loaded like the target, checked to
share its vocabulary, with paged KV of its own indexed by the target's block ids.

One block table per request serves both models: block `b` of the draft's pool holds the
draft's KV of the same tokens as block `b` of the target's, so allocation, freeing, prefix
caching and transfer stay the target's alone. The draft's KV is never shipped and may be
missing (blocks that arrived by transfer or from the prefix cache), so each request counts
the tokens the draft computed itself (`Request.draft_num_computed`) and the draft catches
up on the rest before drafting (`Speculator`).
"""

from __future__ import annotations

import logging

import torch
from transformers import PreTrainedTokenizerBase

from engine.config import ModelConfig
from engine.kv_cache import KVCache
from engine.model_loader import load_model, read_model_config, resolve_model_dir
from engine.models.llama import LlamaForCausalLM
from engine.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


def load_draft_model(path: str, target: ModelConfig, tokenizer: PreTrainedTokenizerBase,
                     dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """Load the draft model at `path` in the target's dtype, on its device.

    Args:
        path: a local Hugging Face directory (or what `resolve_model_dir` accepts).
        target: the target's architecture (vocabulary size, context length).
        tokenizer: the target's tokenizer.
        dtype: the target's dtype.
        device: the target's device.

    Raises:
        ValueError: naming `speculative_config.model`: the draft cannot be loaded, holds
            fewer positions than the target, or its vocabulary differs from the target's.
    """
    key = "speculative_config.model"
    try:
        model_dir = resolve_model_dir(path)
        cfg, hf = read_model_config(model_dir, target.max_model_len)
        draft_tokenizer = load_tokenizer(model_dir)
    except (ValueError, OSError) as e:
        raise ValueError(f"{key}: cannot load the draft model {path!r}: {e}") from e
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(f"{key}: the draft model {path!r} has a vocabulary of "
                         f"{cfg.vocab_size} tokens, the target {target.vocab_size}: a draft "
                         f"must share the target's tokenizer")
    if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"{key}: the draft model {path!r} has a tokenizer whose vocabulary "
                         f"differs from the target's: a draft must share the target's "
                         f"tokenizer")
    try:
        model = load_model(model_dir, cfg, hf, dtype, device)
    except (ValueError, OSError) as e:
        raise ValueError(f"{key}: cannot load the draft model {path!r}: {e}") from e
    log.info("draft model %s: %d layers, %d KV heads of %d", model_dir, cfg.num_layers,
             cfg.num_kv_heads, cfg.head_dim)
    return model


def draft_kv_cache(model: LlamaForCausalLM, num_blocks: int, block_size: int,
                   dtype: torch.dtype, device: torch.device, kv_cache_dtype: str) -> KVCache:
    """The draft's pages: as many blocks as the target's pool, the target's KV dtype."""
    cfg = model.cfg
    return KVCache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                   dtype, device, kv_cache_dtype=kv_cache_dtype)


def draft_block_bytes(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype,
                      kv_cache_dtype: str) -> int:
    """Bytes one block of the draft's pages costs across its layers."""
    cfg = model.cfg
    return KVCache.bytes_per_block(cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim,
                                   dtype, kv_cache_dtype)

"""Structured output: a JSON Schema compiled by llguidance into a per-step token mask.

The grammar state of a request is a function of its output tokens, so it is rebuilt
wherever the request runs: a decode worker that received the first token from a prefill
worker catches its matcher up on that token before it samples the second.
"""

from __future__ import annotations

import json
from functools import cached_property

import llguidance
import llguidance.hf
import numpy as np
import torch
from transformers import PreTrainedTokenizerBase


def check_json_schema(schema: str) -> None:
    """Check that `schema` is JSON Schema text llguidance can compile.

    Raises:
        ValueError: the text is not JSON, not a schema object, or uses what the grammar
            compiler does not support; the message says which.
    """
    try:
        parsed = json.loads(schema)
    except (TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"json_schema: not valid JSON ({e})") from None
    if not isinstance(parsed, dict | bool):
        raise ValueError("json_schema: must be a JSON Schema object")
    error = llguidance.LLMatcher.validate_grammar(_grammar(schema))
    if error:
        raise ValueError(f"json_schema: {error}")


def _grammar(schema: str) -> str:
    # Compact JSON (no free whitespace) keeps a small model from looping on blanks.
    return llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": False})


class GrammarCompiler:
    """Builds matchers over one tokenizer; the tokenizer is converted on first use (~1 s).

    Args:
        tokenizer: the model's fast tokenizer.
        vocab_size: rows of the model's logits (may exceed the tokenizer's vocabulary).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size

    @cached_property
    def _tokenizer(self) -> llguidance.LLTokenizer:
        return llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size)

    def matcher(self, schema: str) -> GrammarMatcher:
        """A fresh matcher at the start of `schema`'s grammar."""
        return GrammarMatcher(llguidance.LLMatcher(self._tokenizer, _grammar(schema)),
                              self.vocab_size)


class GrammarMatcher:
    """One request's position in its grammar.

    Args:
        matcher: llguidance's matcher at the grammar's start.
        vocab_size: length of the mask.
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._num_consumed = 0

    def allowed(self, output_token_ids: list[int]) -> torch.Tensor:
        """The tokens the grammar allows after `output_token_ids`.

        Returns:
            `[vocab_size]` bool.

        Raises:
            RuntimeError: an output token broke the grammar (it came from elsewhere).
        """
        new = output_token_ids[self._num_consumed:]
        if new and not self._matcher.consume_tokens(new):
            raise RuntimeError(f"structured output: {self._matcher.get_error()}")
        self._num_consumed = len(output_token_ids)
        words = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(words, bitorder="little")[:self._vocab_size]
        return torch.from_numpy(bits.astype(bool))

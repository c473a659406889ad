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

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                 eos_token_ids: tuple[int, ...]) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_only = torch.zeros(vocab_size, dtype=torch.bool)
        self._eos_only[list(eos_token_ids)] = True

    @cached_property
    def _tokenizer(self) -> llguidance.LLTokenizer:
        return llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size)

    def matcher(self, schema: str) -> GrammarMatcher:
        """A fresh matcher at the start of `schema`'s grammar."""
        return GrammarMatcher(llguidance.LLMatcher(self._tokenizer, _grammar(schema)),
                              self.vocab_size, self._eos_only)


class GrammarMatcher:
    """One request's position in its grammar.

    Args:
        matcher: llguidance's matcher at the grammar's start.
        vocab_size: length of the mask.
        eos_only: the mask once the grammar is complete.
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int,
                 eos_only: torch.Tensor) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._eos_only = eos_only
        self._num_consumed = 0

    def allowed(self, output_token_ids: list[int]) -> torch.Tensor:
        """The tokens the grammar allows after `output_token_ids`.

        Once the grammar is complete only EOS is allowed; a request that ignores EOS goes on
        with EOS tokens up to its `max_tokens` (the text stays the finished JSON).

        Returns:
            `[vocab_size]` bool.
        """
        new = output_token_ids[self._num_consumed:]
        self._num_consumed = len(output_token_ids)
        if new and not self._matcher.is_stopped():
            # A refused token (only EOS after the end can be one) leaves the matcher stopped
            # or in error; either way nothing but EOS may follow.
            self._matcher.consume_tokens(new)
        if self._matcher.is_stopped() or self._matcher.is_error():
            return self._eos_only
        words = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(words, bitorder="little")[:self._vocab_size]
        return torch.from_numpy(bits.astype(bool))

"""Tokenizer loading, chat templates and incremental detokenization with stop strings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from engine.sampling_params import SamplingParams

# Prompt tokens given to the decoder as context, so the first output token decodes with
# the spacing it has in the full text.
_CONTEXT_TOKENS = 4


# tokenizer_config.json classes that are tokenizer.json as it stands: loaded as such, without
# AutoTokenizer's look-up (which imports much of transformers, over a second of every start).
_GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(model_dir: Path | str) -> PreTrainedTokenizerBase:
    """The model directory's fast tokenizer (tokenizer.json); never fetched from a hub."""
    try:
        declared = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        declared = {}
    if isinstance(declared, dict) and declared.get("tokenizer_class") in _GENERIC_CLASSES \
            and (Path(model_dir) / "tokenizer.json").is_file():
        tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir, local_files_only=True)
    else:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise ValueError(f"tokenizer in {model_dir} has no fast (tokenizer.json) backend")
    return tokenizer


def apply_chat_template(tokenizer: PreTrainedTokenizerBase,
                        messages: list[dict[str, Any]]) -> list[int]:
    """Token ids of `messages` rendered with the model's chat template, ready to generate.

    Raises:
        ValueError: messages are malformed or the model has no chat template.
    """
    if not messages:
        raise ValueError("messages: must contain at least one message")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str) \
                or message.get("role") not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"messages[{i}]: needs a role (system, user, assistant, tool) "
                             "and a string content")
    if not tokenizer.chat_template:
        raise ValueError("messages: this model has no chat template; send a prompt instead")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, never splitting a UTF-8 character.

    Text that could be the start of a stop string is held back until it is known not
    to be; a matched stop string ends the text (and is not included), and the tokens after
    the one that completed it are not taken (`num_tokens`), so a step that brings several
    tokens (speculative decoding) ends where one token a step would have.

    Args:
        tokenizer: the model's tokenizer.
        prompt_token_ids: the prompt, for spacing context.
        params: stop strings and special-token handling.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int],
                 params: SamplingParams) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(ids=list(prompt_token_ids[-_CONTEXT_TOKENS:]),
                                    skip_special_tokens=params.skip_special_tokens)
        self._stops = params.stop
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self.text = ""
        self._sent = 0
        self.stopped = False
        self.num_tokens = 0  # tokens taken, up to the one that completed a stop string

    def add(self, token_ids: list[int]) -> str:
        """Feed new tokens; returns the text that is now safe to show."""
        if self.stopped:
            return ""
        for token_id in token_ids:
            start = max(len(self.text) - self._hold, 0)
            chunk = self._stream.step(self._backend, token_id)
            self.num_tokens += 1
            if chunk:
                self.text += chunk
                self._find_stop(start)
                if self.stopped:
                    break
        safe = len(self.text) if self.stopped else len(self.text) - self._held_back()
        return self._release(safe)

    def flush(self) -> str:
        """At the end of the request: whatever text was held back."""
        return self._release(len(self.text))

    def _find_stop(self, start: int) -> None:
        hits = [i for i in (self.text.find(s, start) for s in self._stops) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def _held_back(self) -> int:
        """Length of the longest text suffix that begins some stop string."""
        for n in range(min(self._hold, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0

    def _release(self, upto: int) -> str:
        upto = max(upto, self._sent)
        delta = self.text[self._sent:upto]
        self._sent = upto
        return delta

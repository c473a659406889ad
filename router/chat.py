"""Chat prompts: messages (tool calls and tool results included) and tool definitions rendered
with the model's chat template, then tokenized.

A template that takes `tools` gets them as its `tools` argument; one that does not (SmolLM2's)
gets them in the first system message, as the plain text `tools_system_text` writes. Likewise
an assistant message's `tool_calls` go to a template that renders them, and otherwise become
the message's text, one JSON object `{"name": ..., "arguments": {...}}` per line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.meta

from router.errors import InvalidRequestError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class ChatTemplate:
    """What a tokenizer's chat template can render.

    Args:
        tokenizer: the model's tokenizer (its `chat_template` may be None).
    """

    tokenizer: PreTrainedTokenizerBase

    @cached_property
    def source(self) -> str | None:
        template = self.tokenizer.chat_template
        return template if isinstance(template, str) else None

    @cached_property
    def _variables(self) -> set[str]:
        if self.source is None:
            return set()
        return jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(self.source))

    @property
    def takes_tools(self) -> bool:
        """The template renders tool definitions (its `tools` argument)."""
        return "tools" in self._variables

    @property
    def hermes_tool_calls(self) -> bool:
        """The template defines the Hermes tool-call format (`<tool_call>` blocks), which
        `tool_choice` `auto` parses."""
        return self.takes_tools and "<tool_call>" in (self.source or "")

    @property
    def renders_tool_calls(self) -> bool:
        """The template renders an assistant message's `tool_calls`."""
        return self.source is not None and "tool_calls" in self.source

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True, continue_final_message: bool = False,
               add_special_tokens: bool = False) -> list[int]:
        """Token ids of the chat, ready to generate (or to count).

        Args:
            messages: OpenAI messages: `role`, `content` (a string, or None on an assistant
                message with `tool_calls`), `tool_calls` (OpenAI's shape, `arguments` a JSON
                string), `tool_call_id` on a `tool` message.
            tools: OpenAI tool definitions (`{"type": "function", "function": {...}}`).
            add_generation_prompt: end with the assistant's turn opening.
            continue_final_message: leave the last message open, for the model to go on.
            add_special_tokens: add the tokenizer's special tokens (e.g. BOS) on top of the
                template's.

        Raises:
            InvalidRequestError: no chat template, or the template refused the messages.
        """
        if self.source is None:
            raise InvalidRequestError("messages: this model has no chat template; send a "
                                      "prompt instead", "messages")
        if add_generation_prompt and continue_final_message:
            raise InvalidRequestError("continue_final_message: cannot be set together with "
                                      "add_generation_prompt", "continue_final_message")
        _check_messages(messages)
        messages = [self._message(m) for m in messages]
        if tools and not self.takes_tools:
            messages = _with_system_text(messages, tools_system_text(tools))
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools if tools and self.takes_tools else None, tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message)
        except (jinja2.TemplateError, ValueError, TypeError) as e:
            raise InvalidRequestError(f"messages: the model's chat template refused them "
                                      f"({e})", "messages") from None
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _message(self, message: dict[str, Any]) -> dict[str, Any]:
        calls = message.get("tool_calls")
        if not calls:
            return {**message, "content": message.get("content") or ""}
        if self.renders_tool_calls:
            # Hugging Face templates take the arguments as a mapping, OpenAI sends JSON text.
            return {**message, "tool_calls": [
                {**call, "function": {**call["function"],
                                      "arguments": json.loads(call["function"]["arguments"])}}
                for call in calls]}
        lines = [json.dumps({"name": call["function"]["name"],
                             "arguments": json.loads(call["function"]["arguments"])})
                 for call in calls]
        text = "\n".join([message["content"], *lines] if message.get("content") else lines)
        return {"role": message["role"], "content": text}


def _check_messages(messages: list[dict[str, Any]]) -> None:
    if not messages:
        raise InvalidRequestError("messages: must contain at least one message", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            ok = False
        else:
            content = message.get("content")
            ok = isinstance(content, str) or (content is None and message["role"] == "assistant")
        if not ok:
            raise InvalidRequestError(f"messages[{i}]: needs a role ({', '.join(ROLES)}) and "
                                      "a string content (null only on an assistant message)",
                                      "messages")


def tools_system_text(tools: list[dict[str, Any]]) -> str:
    """Tool definitions as plain text, for a template that does not take them.

    Returns:
        A header line, then one JSON object per function (`name`, `description`,
        `parameters`).
    """
    functions = [{key: tool["function"][key] for key in ("name", "description", "parameters")
                  if tool["function"].get(key) is not None} for tool in tools]
    return "You can call these functions:\n" + "\n".join(json.dumps(f) for f in functions)


def _with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """`text` at the end of the first system message (one is added when there is none)."""
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        return [{**first, "content": f"{first['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]

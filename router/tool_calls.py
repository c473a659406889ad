"""Tool calls from a chat's output: forced by the grammar, or the model's own (`auto`).

Forced (`tool_choice` `required` or a named function): the output is constrained to JSON
that only a valid call can be: for a named function, its `parameters` schema (the output is
the arguments); for `required`, an array of one call or more (one at most when
`parallel_tool_calls` is false), each `{"name": ..., "parameters": {...}}` with the name one
of the tools' and the parameters that function's schema.

`auto`, for a chat template that defines the Hermes format (Qwen2.5, Hermes 2/3): the model
writes text, and any calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
blocks after it; nothing constrains them, so an output whose blocks do not parse as calls of
the given tools is returned as text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

HERMES_OPEN = "<tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCalling:
    """How one chat request's output becomes tool calls.

    Args:
        functions: name -> parameters schema of every tool the output may call.
        named: the function `tool_choice` names; None for `required` and `auto`.
        parallel: more than one call allowed (`required` only).
        auto: the model's own calls in the Hermes format, no grammar.
    """

    functions: dict[str, dict[str, Any]]
    named: str | None = None
    parallel: bool = True
    auto: bool = False

    def json_schema(self) -> str | None:
        """The JSON Schema the output must match (the grammar's); None for `auto`."""
        if self.auto:
            return None
        if self.named is not None:
            return json.dumps(self.functions[self.named])
        call = {"anyOf": [{"type": "object", "additionalProperties": False,
                           "required": ["name", "parameters"],
                           "properties": {"name": {"const": name}, "parameters": schema}}
                          for name, schema in self.functions.items()]}
        array: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        return json.dumps(array)

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
        """The finished output as a message's `content` and `tool_calls`: the text and None
        when it holds no whole call (a forced call cut off by `max_tokens`, or `auto` text)."""
        if not self.auto:
            calls = self.calls(text)
            return (text, None) if calls is None else (None, calls)
        calls = self._hermes(text)
        if calls is None:
            return text, None
        return text[:text.find(HERMES_OPEN)].strip() or None, calls

    def _hermes(self, text: str) -> list[dict[str, Any]] | None:
        calls = []
        for block in _HERMES_BLOCK.findall(text):
            try:
                call = json.loads(block)
            except json.JSONDecodeError:
                return None
            if not isinstance(call, dict) or call.get("name") not in self.functions:
                return None
            arguments = call.get("arguments", {})
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
            calls.append(tool_call(call["name"], arguments))
        return calls or None

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """OpenAI `tool_calls` from a forced call's finished output; None when it is not a
        whole call (only an output cut off by `max_tokens` can be one)."""
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError:
            return None
        if self.named is not None:
            return [tool_call(self.named, text)]
        # Compact, as the grammar writes a named call's arguments.
        return [tool_call(call["name"], json.dumps(call["parameters"], ensure_ascii=False,
                                                   separators=(",", ":")))
                for call in parsed]


def tool_call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    """One entry of OpenAI's `tool_calls`."""
    return {"id": call_id or _call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


@dataclass
class ToolCallStream:
    """One streamed choice's tool-call deltas, as OpenAI streams them.

    A named call streams as it is generated: the first delta carries the call's `id`,
    `type` and `name` with the first arguments text, later ones more `arguments` text. A
    `required` output (an array whose calls are known only once it parses) goes out whole
    with the finish. `auto` streams its text as `content` until a `<tool_call>` begins
    (text that may be its start is held back), and the calls whole with the finish.

    Args:
        calling: the request's tool calling.
    """

    calling: ToolCalling
    text: str = ""
    _id: str = field(default_factory=_call_id)
    _opened: bool = False
    _sent: int = 0  # `auto`: characters sent as content
    _holding: bool = False  # `auto`: a call began; the rest waits for the finish

    def delta(self, text: str, finished: bool) -> tuple[dict[str, Any], bool | None]:
        """The chunk's delta for new output `text`, and (once `finished`) whether the output
        made whole calls (if not, it went out as `content`)."""
        self.text += text
        if self.calling.auto:
            return self._auto(finished)
        named = self.calling.named
        if named is None:
            if not finished:
                return {}, None
            calls = self.calling.calls(self.text)
            if calls is None:
                return {"content": self.text}, False
            return {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}, True
        delta: dict[str, Any] = {}
        if not self._opened:
            self._opened = True
            delta = {"tool_calls": [{"index": 0, **tool_call(named, text, self._id)}]}
        elif text:
            delta = {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
        return delta, (self.calling.calls(self.text) is not None) if finished else None

    def _auto(self, finished: bool) -> tuple[dict[str, Any], bool | None]:
        delta: dict[str, Any] = {}
        if not self._holding:
            unsent = self.text[self._sent:]
            at = unsent.find(HERMES_OPEN)
            if at >= 0:
                self._holding, unsent = True, unsent[:at]
            elif not finished:
                unsent = unsent[:len(unsent) - _partial_suffix(unsent, HERMES_OPEN)]
            self._sent += len(unsent)
            if unsent:
                delta["content"] = unsent
        if not finished:
            return delta, None
        calls = self.calling.parse(self.text)[1] if self._holding else None
        if calls is None:
            rest = self.text[self._sent:]
            if rest:
                delta["content"] = delta.get("content", "") + rest
            return delta, False
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
        return delta, True


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that `tag` starts with (it may go on into
    the tag)."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1)
                 if tag.startswith(text[-n:])), 0)

"""Forced tool calls: `tool_choice` `required` or a named function, enforced by the grammar.

The output is constrained to JSON that only a valid call can be: for a named function, its
`parameters` schema (the output is the arguments); for `required`, an array of one call or
more (one at most when `parallel_tool_calls` is false), each `{"name": ..., "parameters":
{...}}` with the name one of the tools' and the parameters that function's schema.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCalling:
    """How one chat request's output becomes tool calls.

    Args:
        functions: name -> parameters schema of every tool the output may call.
        named: the function `tool_choice` names; None for `required`.
        parallel: more than one call allowed (`required` only).
    """

    functions: dict[str, dict[str, Any]]
    named: str | None = None
    parallel: bool = True

    def json_schema(self) -> str:
        """The JSON Schema the output must match (the grammar's)."""
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

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """OpenAI `tool_calls` from the finished output; None when it is not a whole call
        (only an output cut off by `max_tokens` can be one)."""
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
    with the finish.

    Args:
        calling: the request's tool calling.
    """

    calling: ToolCalling
    text: str = ""
    _id: str = field(default_factory=_call_id)
    _opened: bool = False

    def delta(self, text: str, finished: bool) -> tuple[dict[str, Any], bool | None]:
        """The chunk's delta for new output `text`, and (once `finished`) whether the output
        made whole calls (if not, cut off by `max_tokens`, it went out as `content`)."""
        self.text += text
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

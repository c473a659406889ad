"""OpenAI request bodies (pydantic) and the response and chunk objects built from router outputs."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from router.chat import ChatTemplate
from router.errors import InvalidRequestError
from router.outputs import GenerateOutput, TokenLogprob, Usage
from router.tool_calls import ToolCalling, ToolCallStream

_SAMPLING_FIELDS = ("max_tokens", "min_tokens", "temperature", "top_k", "top_p", "min_p", "seed",
                    "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
                    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")

# The most choices one request may ask for (n times the number of prompts).
MAX_CHOICES = 128


log = logging.getLogger(__name__)

# Fields OpenAI defines that change nothing generated here: taken and ignored, each named
# once in the log, so the SDKs' and agent frameworks' requests that carry them are served.
IGNORED_FIELDS = ("store", "metadata", "service_tier", "prompt_cache_key",
                  "safety_identifier", "include_obfuscation", "refusal", "annotations",
                  "function_call", "audio")
_ignored_seen: set[str] = set()


class _Body(BaseModel):
    """Any field a model does not declare is refused (400 naming it); the `IGNORED_FIELDS`
    a model declares are taken and ignored."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="after")
    def _note_ignored(self) -> _Body:
        for name in self.model_fields_set & set(IGNORED_FIELDS):
            if name not in _ignored_seen:
                _ignored_seen.add(name)
                log.info("ignoring request field %r (no effect on generation; logged once)",
                         name)
        return self


class StreamOptions(_Body):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # ignored: nothing here pads the chunks


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def schema_text(self) -> str | None:
        """The JSON Schema the output must match; None for free text."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return json.dumps({"type": "object"})
        if self.json_schema is None:
            raise InvalidRequestError("response_format.json_schema: required when type is "
                                      "json_schema", "response_format")
        return json.dumps(self.json_schema.schema_)


class _Request(_Body):
    """Fields both endpoints take."""

    model: str | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the client's own records; no effect here
    # Ignored (IGNORED_FIELDS): records and routing hints of OpenAI's own platform.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None  # prefix caching here needs no key
    safety_identifier: str | None = None
    return_tokens_as_token_ids: bool = False  # vLLM: logprobs name tokens `token_id:N`

    def sampling(self) -> dict[str, Any]:
        """SamplingParams fields the client set."""
        fields = {name: getattr(self, name) for name in _SAMPLING_FIELDS}
        if self.response_format is not None:
            fields["json_schema"] = self.response_format.schema_text()
        return fields

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False

    def params(self) -> dict[str, Any]:
        """SamplingParams fields; an unset max_tokens takes the router's default (the
        generation config's, else 16, as OpenAI's)."""
        if self.echo and self.logprobs is not None:
            raise InvalidRequestError("echo: not supported together with logprobs (prompt "
                                      "logprobs are not computed)", "echo")
        return {**self.sampling(), "logprobs": self.logprobs}

    def prompts(self) -> list[dict[str, Any]]:
        """One `Router.prepare` input per prompt: `{"prompt": text}` or
        `{"prompt_token_ids": ids}`."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            prompt = [prompt]  # type: ignore[list-item]
        if not prompt:
            raise InvalidRequestError("prompt: must not be empty", "prompt")
        if len(prompt) * self.n > MAX_CHOICES:
            raise InvalidRequestError(f"n: {len(prompt)} prompts x n={self.n} is more than "
                                      f"{MAX_CHOICES} choices", "n")
        return [{"prompt": p} if isinstance(p, str) else {"prompt_token_ids": p}
                for p in prompt]


class FunctionDefinition(_Body):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Body):
    name: str
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str) -> str:
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise ValueError(f"must be a JSON object as text ({e})") from None
        if not isinstance(parsed, dict):
            raise ValueError("must be a JSON object as text")
        return arguments


class ToolCall(_Body):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # Ignored (IGNORED_FIELDS): what an SDK sends back of an assistant answer it received.
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    function_call: None = None  # the legacy field, null only
    audio: None = None  # null only: no audio here

    def as_dict(self, index: int) -> dict[str, Any]:
        """The message for the chat template (`developer` is OpenAI's newer `system`)."""
        where = f"messages[{index}]"
        if self.tool_calls is not None and self.role != "assistant":
            raise InvalidRequestError(f"{where}.tool_calls: only an assistant message may "
                                      "have tool calls", "messages")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise InvalidRequestError(f"{where}.tool_call_id: required on a tool message and "
                                      "only there", "messages")
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": self.text(index)}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

    def text(self, index: int) -> str | None:
        """The content; a list of parts is joined, and must hold only text parts."""
        if self.content is None:
            if self.role != "assistant":
                raise InvalidRequestError(f"messages[{index}].content: only an assistant "
                                          "message may have null content", "messages")
            return None
        if isinstance(self.content, str):
            return self.content
        if any(part.get("type") != "text" for part in self.content):
            raise InvalidRequestError(f"messages[{index}].content: only text parts are supported",
                                      "messages")
        return "".join(str(part.get("text", "")) for part in self.content)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def params(self, calling: ToolCalling | None = None) -> dict[str, Any]:
        """SamplingParams fields; `max_completion_tokens` wins over `max_tokens`, and with
        neither max_tokens is None (the router's default: the generation config's, else to
        the end of the context, as OpenAI's). A forced tool call's grammar takes the place
        of `response_format`'s."""
        given = (self.max_completion_tokens, self.max_tokens)
        max_tokens = next((n for n in given if n is not None), None)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        fields = {**self.sampling(), "max_tokens": max_tokens, "logprobs": logprobs}
        if calling is not None and not calling.auto:
            fields["json_schema"] = calling.json_schema()
        return fields

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.as_dict(i) for i, m in enumerate(self.messages)]

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def tool_calling(self, template: ChatTemplate) -> ToolCalling | None:
        """The forced tool calls this request asks for; None when the output is text.

        `tool_choice` defaults to `auto` with tools and `none` without, as OpenAI's.

        Raises:
            InvalidRequestError: a choice without tools, an unknown function, `auto` on a
                template with no tool-call format this server parses, or a forced call with
                `response_format` or `stop` (either would fight the call's grammar).
        """
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise InvalidRequestError("tool_choice: only allowed when tools are given",
                                      "tool_choice")
        if not self.tools or choice == "none":
            return None
        functions = {t.function.name: t.function.parameters or {"type": "object"}
                     for t in self.tools}
        if len(functions) != len(self.tools):
            raise InvalidRequestError("tools: function names must be unique", "tools")
        if choice is None or choice == "auto":
            if template.hermes_tool_calls:
                return ToolCalling(functions, auto=True)
            reason = ("has no tool-call format" if not template.takes_tools else
                      "takes tools, but not in a format this server parses (Hermes "
                      "`<tool_call>` blocks)")
            raise InvalidRequestError(
                f"tool_choice: 'auto' needs the model's own tool-call format; this model's "
                f"chat template {reason}. Ask for tool_choice 'required' or a named function "
                "(the call is then enforced by a grammar), or 'none'", "tool_choice")
        named = None
        if isinstance(choice, NamedToolChoice):
            named = choice.function.name
            if named not in functions:
                raise InvalidRequestError(f"tool_choice: function {named!r} is not among the "
                                          f"tools ({', '.join(functions)})", "tool_choice")
        for name, value in (("response_format", self.response_format), ("stop", self.stop)):
            if value:
                raise InvalidRequestError(f"{name}: not supported together with a forced "
                                          "tool call (tool_choice 'required' or a named "
                                          "function)", name)
        return ToolCalling(functions, named, self.parallel_tool_calls is not False)


class TokenizeRequest(_Body):
    """vLLM's `/tokenize`: a `prompt` (special tokens added by default) or `messages`
    (rendered with the chat template; special tokens not added by default)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[Tool] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None  # default: True unless continue_final_message
    continue_final_message: bool = False
    return_token_strs: bool = False

    def token_ids(self, template: ChatTemplate) -> list[int]:
        """The ids the request's text or chat tokenizes to."""
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("prompt: give exactly one of prompt or messages",
                                      "prompt")
        if self.prompt is not None:
            if self.tools is not None:
                raise InvalidRequestError("tools: only allowed with messages", "tools")
            add_special = self.add_special_tokens is not False
            return list(template.tokenizer.encode(self.prompt, add_special_tokens=add_special))
        tools = [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None
        generation = self.add_generation_prompt
        if generation is None:
            generation = not self.continue_final_message
        return template.render([m.as_dict(i) for i, m in enumerate(self.messages or [])],
                               tools, generation, self.continue_final_message,
                               self.add_special_tokens is True)


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


@dataclass(frozen=True)
class Choice:
    """One finished choice of a non-streaming response."""

    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None


def error_body(message: str, type_: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def total_usage(finals: list[GenerateOutput], n: int) -> Usage:
    """One response's usage over its choices, `n` per prompt in order: each prompt counts
    once (with the cached tokens of its first choice), every choice's completion counts."""
    usages = [final.usage or Usage() for final in finals]
    firsts = usages[::n]
    return Usage(sum(u.prompt_tokens for u in firsts),
                 sum(u.completion_tokens for u in usages),
                 sum(u.cached_tokens for u in firsts))


def usage_body(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


class ResponseBuilder:
    """Shapes router outputs as one endpoint's OpenAI objects.

    Args:
        chat: chat completions (else legacy completions).
        request_id: the router's id; the response id is derived from it.
        model: the served model's name.
        decode_token: token id -> its text, for logprobs.
        tool_calling: a chat request's forced tool calls, if any.
    """

    def __init__(self, chat: bool, request_id: str, model: str, decode_token: Any,
                 tool_calling: ToolCalling | None = None) -> None:
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.model = model
        self.created = int(time.time())
        self._decode = decode_token
        self._tool_calling = tool_calling
        self._tool_streams: dict[int, ToolCallStream] = {}

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def response(self, choices: list[Choice], usage: Usage) -> dict[str, Any]:
        """The non-streaming response."""
        bodies = []
        for index, choice in enumerate(choices):
            body: dict[str, Any] = {"index": index, "logprobs": self._logprobs(choice.logprobs),
                                    "finish_reason": choice.finish_reason}
            if self.chat:
                body["message"] = {"role": "assistant", "content": choice.text}
                if self._tool_calling is not None:
                    content, calls = self._tool_calling.parse(choice.text)
                    if calls is not None:
                        body["message"] = {"role": "assistant", "content": content,
                                           "tool_calls": calls}
                        body["finish_reason"] = "tool_calls"
            else:
                body["text"] = choice.text
            bodies.append(body)
        envelope = self._envelope("chat.completion" if self.chat else "text_completion", bodies)
        return {**envelope, "usage": usage_body(usage)}

    def chunk(self, index: int, out: GenerateOutput | None, include_usage: bool,
              prefix: str = "") -> dict[str, Any]:
        """A streaming chunk of choice `index`; None gives the chat stream's opening (role)
        chunk; `prefix` goes before the text (the echoed prompt)."""
        if out is None:
            content = None if self._tool_calling and not self._tool_calling.auto else ""
            choice = {"index": index, "delta": {"role": "assistant", "content": content},
                      "logprobs": None, "finish_reason": None}
        else:
            text = prefix + out.text
            choice = {"index": index, "logprobs": self._logprobs(out.logprobs),
                      "finish_reason": out.finish_reason}
            if self._tool_calling is not None:
                stream = self._tool_streams.setdefault(index,
                                                       ToolCallStream(self._tool_calling))
                choice["delta"], whole = stream.delta(text, out.finished)
                if whole:
                    choice["finish_reason"] = "tool_calls"
            elif self.chat:
                choice["delta"] = {"content": text} if text else {}
            else:
                choice["text"] = text
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion",
                              [choice])
        return {**body, "usage": None} if include_usage else body

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The extra last chunk when `stream_options.include_usage` is set."""
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        return {**body, "usage": usage_body(usage)}

    def _logprobs(self, logprobs: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if logprobs is None:
            return None
        if self.chat:
            return {"content": [{**self._token(lp.token_id, lp.logprob),
                                 "top_logprobs": [self._token(t, v)
                                                  for t, v in lp.top_logprobs.items()]}
                                for lp in logprobs]}
        return {"tokens": [self._decode(lp.token_id) for lp in logprobs],
                "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [{self._decode(t): v for t, v in lp.top_logprobs.items()}
                                 for lp in logprobs]}

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._decode(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

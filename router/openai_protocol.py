"""OpenAI request bodies (pydantic) and the response and chunk objects built from router outputs."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from router.errors import InvalidRequestError
from router.outputs import GenerateOutput, TokenLogprob, Usage

_SAMPLING_FIELDS = ("max_tokens", "min_tokens", "temperature", "top_k", "top_p", "min_p", "seed",
                    "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
                    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")

# The most choices one request may ask for (n times the number of prompts).
MAX_CHOICES = 128


class _Body(BaseModel):
    """Any field a model does not declare is refused (400 naming it), never ignored."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False


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
        """SamplingParams fields; an unset max_tokens takes the default (16, as OpenAI)."""
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


class ChatMessage(_Body):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self, index: int) -> str:
        """The content; a list of parts is joined, and must hold only text parts."""
        if self.content is None:
            if self.role != "assistant":
                raise InvalidRequestError(f"messages[{index}].content: only an assistant "
                                          "message may have null content", "messages")
            return ""
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

    def params(self, max_model_len: int) -> dict[str, Any]:
        """SamplingParams fields; as OpenAI does, an unset max_tokens runs to the end of the
        context."""
        given = (self.max_completion_tokens, self.max_tokens)
        max_tokens = next((n for n in given if n is not None), max_model_len)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return {**self.sampling(), "max_tokens": max_tokens, "logprobs": logprobs}

    def message_dicts(self) -> list[dict[str, Any]]:
        return [{"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages)]


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
    """

    def __init__(self, chat: bool, request_id: str, model: str, decode_token: Any) -> None:
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.model = model
        self.created = int(time.time())
        self._decode = decode_token

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
            choice = {"index": index, "delta": {"role": "assistant", "content": ""},
                      "logprobs": None, "finish_reason": None}
        else:
            text = prefix + out.text
            choice = {"index": index, "logprobs": self._logprobs(out.logprobs),
                      "finish_reason": out.finish_reason}
            if self.chat:
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

"""OpenAI request bodies (pydantic) and the response and chunk objects built from router outputs."""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from router.errors import InvalidRequestError
from router.outputs import GenerateOutput, TokenLogprob, Usage

_SAMPLING_FIELDS = ("max_tokens", "min_tokens", "temperature", "top_k", "top_p", "min_p", "seed",
                    "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens")


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    """Fields both endpoints take; unknown fields are ignored, as vLLM does."""

    model_config = ConfigDict(extra="ignore")

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
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None

    def sampling(self) -> dict[str, Any]:
        """SamplingParams fields the client set."""
        if self.n != 1:
            raise InvalidRequestError(f"n: only 1 choice per request is supported, got {self.n}")
        return {name: getattr(self, name) for name in _SAMPLING_FIELDS}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Request):
    prompt: str | list[int]
    logprobs: int | None = None

    def params(self) -> dict[str, Any]:
        """SamplingParams fields; an unset max_tokens takes the default (16, as OpenAI)."""
        return {**self.sampling(), "logprobs": self.logprobs}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict[str, Any]]

    def text(self, index: int) -> str:
        """The content; a list of parts is joined, and must hold only text parts."""
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


def error_body(message: str, type_: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


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

    def response(self, text: str, logprobs: list[TokenLogprob] | None,
                 final: GenerateOutput) -> dict[str, Any]:
        """The non-streaming response."""
        choice: dict[str, Any] = {"index": 0, "logprobs": self._logprobs(logprobs),
                                  "finish_reason": final.finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        body = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
        return {**body, "usage": usage_body(final.usage or Usage())}

    def chunk(self, out: GenerateOutput | None, include_usage: bool) -> dict[str, Any]:
        """A streaming chunk; None gives the chat stream's opening (role) chunk."""
        if out is None:
            choice = {"index": 0, "delta": {"role": "assistant", "content": ""},
                      "logprobs": None, "finish_reason": None}
        else:
            choice = {"index": 0, "logprobs": self._logprobs(out.logprobs),
                      "finish_reason": out.finish_reason}
            if self.chat:
                choice["delta"] = {"content": out.text} if out.text else {}
            else:
                choice["text"] = out.text
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

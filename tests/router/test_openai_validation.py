"""OpenAI request validation without a server: the request bodies and their tool choices,
checked as the HTTP front door checks them (its messages are what a client reads)."""

from __future__ import annotations

import pydantic
import pytest

from engine import load_tokenizer
from router.chat import ChatTemplate
from router.errors import InvalidRequestError
from router.openai_protocol import ChatCompletionRequest
from router.router import Router, RouterConfig
from router.tool_calls import ToolCalling, ToolCallStream

TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def template(tiny_dir) -> ChatTemplate:
    return ChatTemplate(load_tokenizer(tiny_dir))


def _calling(template: ChatTemplate, **body) -> ToolCalling | None:
    request = ChatCompletionRequest.model_validate({"messages": USER, **body})
    request.message_dicts()
    return request.tool_calling(template)


def test_smollm2s_template_takes_no_tools(template):
    assert not template.takes_tools and not template.renders_tool_calls


@pytest.mark.parametrize(("body", "message"), [
    ({"tool_choice": "required"}, "tool_choice: only allowed when tools are given"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice: function 'g' is not among the tools (f)"),
    ({"tools": [TOOL, TOOL], "tool_choice": "required"},
     "tools: function names must be unique"),
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format: not supported together with a forced tool call"),
    ({"tools": [TOOL], "tool_choice": "required", "stop": ["}"]},
     "stop: not supported together with a forced tool call"),
    ({"tools": [TOOL]}, "tool_choice: 'auto' needs the model's own tool-call format"),
    ({"messages": [{"role": "tool", "content": "1"}]},
     "messages[0].tool_call_id: required on a tool message and only there"),
    ({"messages": [{"role": "user", "content": "1", "tool_call_id": "a"}]},
     "messages[0].tool_call_id: required on a tool message and only there"),
    ({"messages": [{"role": "user", "content": "1", "tool_calls": []}]},
     "messages[0].tool_calls: only an assistant message may have tool calls"),
    ({"messages": [{"role": "tool", "content": None, "tool_call_id": "a"}]},
     "messages[0].content: only an assistant message may have null content"),
])
def test_bad_tool_requests(template, body, message):
    with pytest.raises(InvalidRequestError) as e:
        _calling(template, **body)
    assert str(e.value).startswith(message)
    assert e.value.param == message.split(":")[0].split("[")[0].split(".")[0]


@pytest.mark.parametrize(("body", "field"), [
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "name"),
    ({"tools": [{"type": "retrieval"}]}, "type"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                    "function": {"name": "f", "arguments": "{x"}}]}]}, "arguments"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                    "function": {"name": "f", "arguments": "[1]"}}]}]}, "arguments"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "role"),
])
def test_malformed_tool_fields_are_refused_by_the_schema(body, field):
    with pytest.raises(pydantic.ValidationError) as e:
        ChatCompletionRequest.model_validate({"messages": USER, **body})
    assert any(field in (str(part) for part in err["loc"]) for err in e.value.errors())


def test_forced_calls_and_their_grammars(template):
    named = _calling(template, tools=[TOOL], tool_choice={"type": "function",
                                                          "function": {"name": "f"}})
    assert named == ToolCalling({"f": TOOL["function"]["parameters"]}, "f", True)
    assert named.json_schema() == '{"type": "object", "properties": {"x": {"type": ' \
        '"integer"}}, "required": ["x"]}'
    assert named.calls('{"x": 1}')[0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert named.calls('{"x": ') is None
    required = _calling(template, tools=[TOOL], tool_choice="required",
                        parallel_tool_calls=False)
    assert required.named is None and not required.parallel
    schema = required.json_schema()
    assert '"maxItems": 1' in schema and '"const": "f"' in schema
    assert [c["function"] for c in required.calls('[{"name": "f", "parameters": {"x": 2}}]')] \
        == [{"name": "f", "arguments": '{"x":2}'}]
    assert _calling(template, tools=[TOOL], tool_choice="none") is None
    assert _calling(template) is None


# A template in the shape of Qwen2.5's: it takes `tools` and renders `tool_calls` itself.
TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>\n"
    "{% endif %}{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }}:{{ c.function.arguments.x }}"
    "</call>{% endfor %}</{{ m.role }}>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_a_template_that_takes_tools_gets_them_as_its_argument(tiny_dir):
    tokenizer = load_tokenizer(tiny_dir)
    tokenizer.chat_template = TOOL_TEMPLATE
    template = ChatTemplate(tokenizer)
    assert template.takes_tools and template.renders_tool_calls
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "f", "arguments": '{"x": 7}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    ids = template.render(history, [TOOL])
    assert tokenizer.decode(ids) == ("<tools>f;</tools>\n<user>hi</user>\n"
                                     "<assistant><call>f:7</call></assistant>\n"
                                     "<tool>ok</tool>\n<assistant>")
    # auto is refused: the template's call format is not one this server parses.
    with pytest.raises(InvalidRequestError, match="takes tools, but not in a format this "
                       "server parses"):
        _calling(template, tools=[TOOL], tool_choice="auto")


def test_a_served_chat_template_replaces_the_tokenizers(backend):
    """`serve --chat-template`: the router renders chats with it, tools included; the
    tokenizer's own template is what a router without it uses."""
    router = Router(backend, RouterConfig(chat_template=TOOL_TEMPLATE))
    assert router.chat_template.takes_tools
    ids = router.chat_template.render(USER, [TOOL])
    assert router.tokenizer.decode(ids) == "<tools>f;</tools>\n<user>hi</user>\n<assistant>"
    plain = Router(backend)
    assert plain.tokenizer.chat_template != TOOL_TEMPLATE
    assert plain.tokenizer.decode(plain.chat_template.render(USER)) != \
        router.tokenizer.decode(router.chat_template.render(USER))


def test_auto_on_a_hermes_template_parses_the_models_calls(tiny_dir):
    tokenizer = load_tokenizer(tiny_dir)
    tokenizer.chat_template = TOOL_TEMPLATE.replace("<call>", "<tool_call>")
    calling = _calling(ChatTemplate(tokenizer), tools=[TOOL], stop=["x"])  # auto by default
    assert calling == ToolCalling({"f": TOOL["function"]["parameters"]}, auto=True)
    assert calling.json_schema() is None  # no grammar: the model writes as it will
    two = ('I will call f twice.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n'
           '</tool_call>\n<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>')
    content, calls = calling.parse(two)
    assert content == "I will call f twice."
    assert [c["function"] for c in calls] == [{"name": "f", "arguments": '{"x":1}'},
                                              {"name": "f", "arguments": '{"x": 2}'}]
    assert calling.parse("no call here") == ("no call here", None)
    for broken in ('<tool_call>{"name": "g", "arguments": {}}</tool_call>',  # not a tool
                   '<tool_call>{"name": "f", "arguments": {"x": </tool_call>',
                   '<tool_call>{"name": "f", "arguments": {"x": 1}}'):  # cut off
        assert calling.parse(broken) == (broken, None)


def _stream(calling: ToolCalling, pieces: list[str]) -> list[tuple[dict, bool | None]]:
    stream = ToolCallStream(calling)
    return [stream.delta(piece, i == len(pieces) - 1) for i, piece in enumerate(pieces)]


def test_auto_streams_text_then_the_calls_whole():
    calling = ToolCalling({"f": {"type": "object"}}, auto=True)
    deltas = _stream(calling, ["Sure", ". <to", "ol_call>", '{"name": "f", ',
                               '"arguments": {}}</tool_call>', ""])
    assert [d for d, _ in deltas[:5]] == [{"content": "Sure"}, {"content": ". "}, {}, {}, {}]
    last, whole = deltas[-1]
    assert whole is True and last["tool_calls"][0]["function"] == {"name": "f",
                                                                   "arguments": "{}"}
    # A tag's start that turns out to be text is sent once it cannot be a tag.
    deltas = _stream(calling, ["a <to", "y>", " b"])
    assert deltas == [({"content": "a "}, None), ({"content": "<toy>"}, None),
                      ({"content": " b"}, False)]
    # A call that does not parse goes out as text with the finish.
    deltas = _stream(calling, ["x<tool_call>{oops", "</tool_call>"])
    assert deltas == [({"content": "x"}, None),
                      ({"content": "<tool_call>{oops</tool_call>"}, False)]


def test_a_named_call_streams_its_arguments_as_they_come():
    calling = ToolCalling({"f": {"type": "object"}}, "f")
    (first, _), (second, _), (third, whole) = _stream(calling, ['{"x"', ": 1}", ""])
    call = first["tool_calls"][0]
    assert call["index"] == 0 and call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "f", "arguments": '{"x"'}
    assert second == {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}
    assert third == {} and whole is True

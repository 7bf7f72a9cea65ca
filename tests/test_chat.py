"""chat.py: template rendering against HF transformers and the spec, output parsing, streaming."""
import json
from pathlib import Path

import pytest

import chat

ROOT = Path(__file__).resolve().parents[1]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city", "strict": True,
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "zip": {"type": "string"}, "opts": {"type": "object"}, "tags": {"type": ["array", "null"]}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
HIDDEN = {"type": "function", "function": {"name": "hidden", "defer_loading": True}}


@pytest.fixture(scope="module")
def template(fixtures_dir) -> str:
    return (fixtures_dir / "glm53" / "chat_template.jinja").read_text()


def test_shipped_template_is_byte_identical_to_fixture(fixtures_dir):
    assert (ROOT / "chat_template.jinja").read_bytes() == (fixtures_dir / "glm53" / "chat_template.jinja").read_bytes()


def _render(template, messages, tools=None, effort=None, enable_thinking=None):
    return chat.render(template, chat.normalize_messages(messages), chat.check_tools(tools),
                       chat.resolve_thinking(effort, enable_thinking))


@pytest.mark.parametrize("effort,head,tail", [
    (None, "Max", "<|assistant|><think>"),
    ("max", "Max", "<|assistant|><think>"),
    ("low", "Low", "<|assistant|><think>"),
    ("high", "High", "<|assistant|><think>"),
    ("none", "Low", "<|assistant|><think></think>"),
])
def test_effort_and_thinking_prompt_from_spec(template, effort, head, tail):
    text = _render(template, [{"role": "user", "content": "Hi"}], effort=effort)
    assert text == f"[gMASK]<sop><|system|>Reasoning Effort: {head}<|user|>Hi{tail}"


def test_enable_thinking_false_closes_think(template):
    text = _render(template, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                   enable_thinking=False)
    assert text == "[gMASK]<sop><|system|>Reasoning Effort: Low<|system|>Be brief.<|user|>Hi<|assistant|><think></think>"


@pytest.mark.parametrize("effort,thinking", [("medium", None), ("MAX", None), (3, None), ("high", False), ("none", True),
                                            (None, "no")])
def test_effort_values_the_template_would_silently_make_max_are_refused(effort, thinking):
    with pytest.raises(chat.ChatError):
        chat.resolve_thinking(effort, thinking)


def test_tools_block_matches_spec(template):
    text = _render(template, [{"role": "user", "content": "Weather?"}], tools=[CLOCK, HIDDEN])
    tool_json = '{"name": "get_time", "parameters": {"type": "object", "properties": {}}}'
    assert text == (
        "[gMASK]<sop><|system|>Reasoning Effort: Max<|system|>\n# Tools\n\nYou may call one or more functions to "
        "assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:"
        f"\n<tools>\n{tool_json}\n</tools>\n\nFor each function call, output the function name and arguments "
        "within the following XML format:\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>"
        "{arg-value-1}</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>"
        "<|user|>Weather?<|assistant|><think>")


CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again"}],
    [{"role": "system", "content": "Sys"}, {"role": "user", "content": [{"type": "text", "text": "part"}, "x"]},
     {"role": "assistant", "content": "  answer  ", "reasoning_content": "thought"},
     {"role": "user", "content": "ü ✓ \"quoted\""}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": None, "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(
             {"city": "Paris", "days": 3, "metric": True, "opts": {"a": [1, "é"]}})}},
         {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
     {"role": "tool", "tool_call_id": "c2", "content": "noon"},
     {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
     {"role": "assistant", "content": "<think>old</think>It is sunny."},
     {"role": "user", "content": "Thanks"}],
]


@pytest.mark.parametrize("i", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("effort", [None, "low", "high"])
def test_render_matches_transformers(template, i, effort):
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = chat.normalize_messages(CONVERSATIONS[i])
    tools = [WEATHER, CLOCK, HIDDEN]
    kwargs = {} if effort is None else {"reasoning_effort": effort}
    want, _ = render_jinja_template([messages], tools=tools, chat_template=template, add_generation_prompt=True, **kwargs)
    got = chat.render(template, messages, tools, chat.resolve_thinking(effort))
    assert got == want[0]


def test_history_tool_calls_and_reordered_results(template):
    text = _render(template, CONVERSATIONS[2])
    assert ("<|assistant|><think></think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
            "<arg_key>days</arg_key><arg_value>3</arg_value><arg_key>metric</arg_key><arg_value>true</arg_value>"
            '<arg_key>opts</arg_key><arg_value>{"a": [1, "é"]}</arg_value></tool_call>'
            "<tool_call>get_time</tool_call><|observation|>") in text
    # results are put back in call order (c1 before c2)
    assert "<|observation|><tool_response>sunny</tool_response><tool_response>noon</tool_response>" in text
    assert "<|assistant|><think>old</think>It is sunny.<|user|>Thanks" in text


@pytest.mark.parametrize("messages,param", [
    ([], "messages"),
    ("hi", "messages"),
    ([{"role": "robot", "content": "x"}], "messages[0].role"),
    (["x"], "messages[0]"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": [{"text": "no type"}]}], "messages[0].content[0]"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages[0].content[0].text"),
    # audio and video parts would render as placeholder tokens with nothing behind them
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}],
     "messages[0].content[0].type"),
    ([{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x"}}]}], "messages[0].content[0].type"),
    ([{"role": "user", "content": ["look:", {"type": "image_url", "image_url": {"link": "x"}}]}],
     "messages[0].content[1].image_url"),
    ([{"role": "assistant", "content": [{"type": "refusal", "refusal": None}]}], "messages[0].content[0].refusal"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0].tool_calls"),
])
def test_bad_messages_name_the_field(messages, param):
    with pytest.raises(chat.ChatError) as e:
        chat.normalize_messages(messages)
    assert e.value.param == param


def test_image_parts_render_as_the_templates_placeholder_and_keep_their_source(template):
    messages = chat.normalize_messages([{"role": "user", "content": [
        {"type": "text", "text": "Compare "}, {"type": "image_url", "image_url": {"url": "data:a"}},
        {"type": "text", "text": " and "}, {"type": "image_url", "image_url": "data:b"}]},
        {"role": "assistant", "content": "Done."}, {"role": "user", "content": [{"type": "image", "image": b"c"}]}])
    assert chat.image_sources(messages) == ["data:a", "data:b", b"c"]
    text = _render(template, messages)
    image = "<|begin_of_image|><|image|><|end_of_image|>"
    assert f"Compare {image} and {image}" in text and text.count(image) == 3


def test_developer_role_renders_as_system(template):
    text = _render(template, [{"role": "developer", "content": "Dev"}, {"role": "user", "content": "Hi"}])
    assert "<|system|>Dev<|user|>Hi" in text


def test_refusal_part_renders_as_its_text(template):
    def turns(answer):
        return [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": answer},
                {"role": "user", "content": "Why?"}]

    text = _render(template, turns([{"type": "refusal", "refusal": "I can't."}]))
    assert "I can't." in text and text == _render(template, turns("I can't."))


# ---------------------------------------------------------------------------------------------


def test_parse_reasoning_content_and_typed_tool_calls():
    text = ("Let me check.</think>\nI'll look it up.<tool_call>get_weather<arg_key>city</arg_key><arg_value>New York"
            "</arg_value><arg_key>days</arg_key><arg_value>3</arg_value><arg_key>metric</arg_key><arg_value>false"
            "</arg_value><arg_key>zip</arg_key><arg_value>01234</arg_value><arg_key>opts</arg_key>"
            '<arg_value>{"x": [1, 2]}</arg_value><arg_key> tags </arg_key><arg_value>null</arg_value></tool_call>'
            "<tool_call>get_time</tool_call>")
    out = chat.parse_output(text, thinking=True, tools=[WEATHER, CLOCK])
    assert out.reasoning == "Let me check."
    assert out.content == "I'll look it up."
    assert [c.name for c in out.tool_calls] == ["get_weather", "get_time"]
    assert out.tool_calls[0].arguments == {"city": "New York", "days": 3, "metric": False, "zip": "01234",
                                           "opts": {"x": [1, 2]}, "tags": None}
    assert out.tool_calls[1].arguments == {}
    oa = out.tool_calls[0].to_openai()
    assert oa["type"] == "function" and oa["id"].startswith("call_")
    assert json.loads(oa["function"]["arguments"])["zip"] == "01234"


def test_a_parameter_that_admits_a_string_reads_back_as_its_text():
    """pydantic's Optional[str] (anyOf string, null): the template writes the string verbatim, so "02139" and 12345
    stay strings; null (the template's None) is None. Optional[int] reads JSON."""
    opt = lambda t: {"anyOf": [{"type": t}, {"type": "null"}], "default": None}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "zip": opt("string"), "n": opt("integer"), "mode": {"enum": ["1", "2"]}, "k": {"type": ["string", "null"]},
        "pick": {"oneOf": [{"type": "integer"}, {"type": "string", "format": "date"}]}}}}}]

    def args(**values) -> dict:
        body = "f" + "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in values.items())
        return chat.parse_tool_call(body, tools).arguments

    assert args(zip="12345", n="12345", mode="2", pick="7") == {"zip": "12345", "n": 12345, "mode": "2", "pick": "7"}
    assert args(zip="null", n="null", k="null") == {"zip": None, "n": None, "k": None}
    assert args(zip="02139 MA") == {"zip": "02139 MA"}


def test_parse_without_schema_decodes_json_and_keeps_other_text():
    call = chat.parse_tool_call("f<arg_key>n</arg_key><arg_value>7</arg_value><arg_key>s</arg_key><arg_value>hi there"
                                "</arg_value>", tools=None)
    assert call.arguments == {"n": 7, "s": "hi there"}


@pytest.mark.parametrize("body", ["", "<arg_key>k</arg_key><arg_value>v</arg_value>", "f<arg_key>k</arg_key>v",
                                  "f<arg_key>k</arg_key><arg_value>v", "f junk<arg_value>"])
def test_malformed_tool_call_bodies_are_rejected(body):
    assert chat.parse_tool_call(body) is None


def test_malformed_or_unterminated_tool_call_stays_content():
    out = chat.parse_output("Answer<tool_call></tool_call> tail", thinking=False, tools=[CLOCK])
    assert out.tool_calls == [] and out.content == "Answer<tool_call></tool_call> tail"
    out = chat.parse_output("x</think>A<tool_call>get_time<arg_k", thinking=True, tools=[CLOCK])
    assert out.tool_calls == [] and out.content == "A<tool_call>get_time<arg_k"


def test_thinking_off_and_tools_off():
    out = chat.parse_output("no </think> here <tool_call>get_time</tool_call>", thinking=False, parse_tools=False)
    assert out.reasoning is None and out.content == "no </think> here <tool_call>get_time</tool_call>"
    out = chat.parse_output("still thinking <tool_call>", thinking=True)
    assert out.reasoning == "still thinking <tool_call>" and out.content is None


STREAM_TEXT = ("Plan: call <tools>.</think>\n\nSure<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo"
               "</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call><tool_call>get_time"
               "</tool_call> done <tool")
TAGS = [chat.THINK_END, chat.TOOL_START, chat.TOOL_END, chat.KEY_START, chat.VALUE_START]


def _stream(pieces, **kw):
    p = chat.StreamParser(**kw)
    deltas = [d for piece in pieces for d in p.feed(piece)] + p.finish()
    return deltas


@pytest.mark.parametrize("step", [1, 2, 3, 5, 7, 11, 1000])
def test_streaming_equals_whole_parse_and_never_leaks_partial_tags(step):
    pieces = [STREAM_TEXT[i:i + step] for i in range(0, len(STREAM_TEXT), step)]
    deltas = _stream(pieces, thinking=True, tools=[WEATHER, CLOCK])
    whole = chat.parse_output(STREAM_TEXT, thinking=True, tools=[WEATHER, CLOCK])
    assert "".join(d.text for d in deltas if d.kind == "reasoning") == whole.reasoning == "Plan: call <tools>."
    assert "".join(d.text for d in deltas if d.kind == "content").strip() == whole.content == "Sure done <tool"
    calls = [d.tool_call for d in deltas if d.kind == "tool_call"]
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {})]
    watched = {"reasoning": chat.THINK_END, "content": chat.TOOL_START, "tool_call": ""}
    for d in deltas[:-1]:  # only the final flush may hold an unfinished "<tool" of the model's own text
        assert not any(tag in d.text for tag in TAGS)
        assert not any(d.text.endswith(watched[d.kind][:n]) for n in range(1, len(watched[d.kind])))

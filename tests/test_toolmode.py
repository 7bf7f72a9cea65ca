"""toolmode.py: tool calls held to their tools' schemas, against chat.parse_tool_call and the schema's plain
statement (test_jsonmode._valid)."""
import random

import pytest

import chat
import jsonmode
import toolmode
from test_jsonmode import _valid, loads

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 2},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "unit": {"type": "string", "enum": ["C", "F"]},
    "metric": {"type": "boolean"}, "station": {"type": "string", "pattern": "^(ab)+$", "maxLength": 4},
    "opts": {"type": "object", "properties": {"lang": {"type": "string"}}, "additionalProperties": False}},
    "required": ["city"], "additionalProperties": False}
TAGS = {"search": {"type": "object", "properties": {"q": {"type": ["string", "null"]}}},  # other keys allowed
        "get_weather": WEATHER, "now": None, "shell": True}  # shell: not held
TOOLS = toolmode.compile_tools(TAGS)
MARKS = {tag: bytes([toolmode.CALL + i]) for i, tag in enumerate(toolmode.TAGS)} | {"<stop>": bytes([toolmode.STOP])}


def tagged(text: str) -> bytes:
    """A text with tags (and <stop> for a stop token) as the bytes tagged_bytes gives their tokens."""
    data = text.encode()
    for tag, mark in MARKS.items():
        data = data.replace(tag.encode(), mark)
    return data


def untagged(data: bytes) -> str:
    for tag, mark in MARKS.items():
        data = data.replace(mark, tag.encode() if tag != "<stop>" else b"")
    return data.decode(errors="replace")  # (text and a free tool's arguments are not held to UTF-8)


def calls_of(text: str) -> list[chat.ToolCall]:
    """The calls chat's parser reads from an answer (the serving path's reading of it)."""
    bodies = text.split(chat.TOOL_START)[1:]
    tools = [{"type": "function", "function": {"name": n, "parameters": s if s is not True else None}}
             for n, s in TAGS.items()]
    return [chat.parse_tool_call(b.split(chat.TOOL_END)[0], tools) for b in bodies]


def valid_call(call: chat.ToolCall) -> bool:
    schema = TAGS[call.name] or {"type": "object", "properties": {}, "additionalProperties": False}
    # the parser's typed values, as json would read them (the plain statement tells integers by their text)
    return _valid(loads(chat.json.dumps(call.arguments)), schema)


GOOD = ["<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call><stop>",
        "<tool_call>get_weather<arg_key>days</arg_key><arg_value>14</arg_value><arg_key>city</arg_key><arg_value>"
        'New "York"\n\\ é</arg_value><arg_key>unit</arg_key><arg_value>F</arg_value><arg_key>metric</arg_key>'
        '<arg_value>false</arg_value><arg_key>opts</arg_key><arg_value>{"lang": "en"}</arg_value></tool_call><stop>',
        "<tool_call>now</tool_call><tool_call>search<arg_key>q</arg_key><arg_value>null</arg_value>"
        "<arg_key>page-2</arg_key><arg_value>[1, {\"a\": null}]</arg_value></tool_call><stop>",
        "<tool_call>search</tool_call><stop>"]


@pytest.mark.parametrize("text", GOOD)
def test_calls_are_accepted_tag_by_tag_and_read_back_as_their_schemas_say(text):
    data = tagged(text)
    s = toolmode.ToolCallPrefix(TOOLS)
    for i, b in enumerate(data):
        assert s.feed(bytes([b])), (text, untagged(data[:i + 1]))
        assert s.done == (i == len(data) - 1)
    calls = calls_of(text)
    assert all(c is not None and valid_call(c) for c in calls), calls
    if "New" in text:
        assert calls[0].arguments == {"days": 14, "city": 'New "York"\n\\ é', "unit": "F", "metric": False,
                                      "opts": {"lang": "en"}}


@pytest.mark.parametrize("text, refused_at", [
    ("<stop>", "<stop>"),  # a call first
    ("h", "h"),
    ("<tool_call>get_time", "get_t"),  # no such tool
    ("<tool_call>get_weather</tool_call>", "</tool_call>"),  # city is required
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>P</arg_value>", "</arg_value>"),  # minLength 2
    ("<tool_call>get_weather<arg_key>cityname", "cityn"),  # not a property, none other allowed
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value><arg_key>city</arg_key>",
     "city</arg_key>"),  # a key once
    ("<tool_call>get_weather<arg_key>days</arg_key><arg_value>0", "0"),  # minimum 1: no 0...
    ("<tool_call>get_weather<arg_key>days</arg_key><arg_value>15", "5"),  # maximum 14: 1 may go on, 15 no
    ("<tool_call>get_weather<arg_key>days</arg_key><arg_value>1.", "."),  # an integer
    ('<tool_call>get_weather<arg_key>days</arg_key><arg_value>"', '"'),  # JSON: not a string
    ("<tool_call>get_weather<arg_key>unit</arg_key><arg_value>K", "K"),  # enum
    ("<tool_call>get_weather<arg_key>metric</arg_key><arg_value>y", "y"),
    ("<tool_call>get_weather<arg_key>metric</arg_key><arg_value>true<arg_key>", "<arg_key>"),  # </arg_value> first
    ("<tool_call>get_weather<arg_key>opts</arg_key><arg_value>{\"lang\": \"en\"", "</arg_value>"),  # not closed
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>a</tool_call>", "</tool_call>"),  # a tag inside
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>\xff", "\xff"),
    ("<tool_call>search<arg_key>page ", " "),  # another key: ASCII letters, digits, _.-
    ("<tool_call>search<arg_key></arg_key>", "</arg_key>"),  # not empty
    ("<tool_call>now<arg_key>", "<arg_key>"),  # no parameters
    ("<tool_call>get_weather<arg_key>station</arg_key><arg_value>ababa", "a"),  # no match within 4 characters
    ("<tool_call>now</tool_call><tool_call>now</tool_call><stop><tool_call>", "<tool_call>"),  # done
])
def test_what_the_tools_forbid_is_refused_at_its_first_byte(text, refused_at):
    data, bad = tagged(text), tagged(refused_at)
    s = toolmode.ToolCallPrefix(TOOLS)
    if text.endswith("\xff"):  # a byte of no UTF-8 text, in a verbatim value
        data, bad = data[:-2] + b"\xff", b"\xff"
    assert s.feed(data[:len(data) - len(bad)]), untagged(data[:len(data) - len(bad)])
    assert not s.copy().feed(bad[:1]), (text, refused_at)


@pytest.mark.parametrize("text, ok", [
    ("Let me check.<tool_call>now</tool_call><stop>", True), ("Just text, no call.<stop>", True), ("<stop>", True),
    ("I'll run it.<tool_call>shell<arg_key>cmd line</arg_key><arg_value>ls -l | wc</arg_value></tool_call><stop>", True),
    ("Text<tool_call>now</tool_call>more text", False),  # after a call: another call or the end
    ("Text</tool_call>", False), ("Text «tool_call", True), ("Text «tool_call>", False),  # «: a tag's text as text
    ("<tool_call>shell<arg_key>a«/arg_key>", False), ("<tool_call>shell<arg_key></arg_key>", False),
    ("<tool_call>shell<arg_key>a</arg_key><arg_value>x</arg_value><arg_key>a</arg_key>", False),
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value><arg_key>days</arg_key>"
     "<arg_value>20", False)])  # held as ever
def test_text_may_come_first_where_a_call_is_optional_and_free_tools_are_not_held(text, ok):
    s = toolmode.ToolCallPrefix(TOOLS, mode="text")  # tool_choice auto
    assert s.feed(tagged(text).replace("«".encode(), b"<")) == ok, text
    if ok and text.endswith("<stop>"):
        assert s.done and all(c is not None and valid_call(c) for c in calls_of(text))


def test_one_call_unless_parallel_calls_are_allowed():
    s = toolmode.ToolCallPrefix(TOOLS, parallel=False)
    assert s.feed(tagged("<tool_call>now</tool_call>")) and s.done
    assert not s.copy().feed(tagged("<tool_call>")) and not s.copy().feed(tagged("<stop>"))


def test_an_optional_string_is_held_verbatim():
    """pydantic's Optional[str]: written as its text (no quotes), as the template writes a string, and read back so."""
    schema = {"type": "object", "properties": {"zip": {"anyOf": [{"type": "string", "maxLength": 5},
                                                                 {"type": "null"}]}}, "required": ["zip"]}
    tools = toolmode.compile_tools({"f": schema})
    assert tools[b"f"].verbatim == {b"zip"}
    held = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    for value, read in (("02139", "02139"), ("null", None), ("a b", "a b")):
        text = f"<tool_call>f<arg_key>zip</arg_key><arg_value>{value}</arg_value></tool_call><stop>"
        assert toolmode.ToolCallPrefix(tools).feed(tagged(text)), value
        assert chat.parse_tool_call(text.split(chat.TOOL_START)[1].split(chat.TOOL_END)[0], held).arguments == \
            {"zip": read}
    s = toolmode.ToolCallPrefix(tools)
    assert s.feed(tagged("<tool_call>f<arg_key>zip</arg_key><arg_value>12345")) and not s.copy().feed(b"6")


def test_a_verbatim_value_keeps_its_bytes_and_refuses_a_tags_text():
    s = toolmode.ToolCallPrefix(TOOLS)
    assert s.feed(tagged("<tool_call>get_weather<arg_key>city</arg_key><arg_value>a\t\x01\"\\</arg_valu"))
    assert not s.copy().feed(b"e>") and s.copy().feed(b"e!")  # "</arg_value>" as text would end the value there
    assert calls_of("<tool_call>get_weather<arg_key>city</arg_key><arg_value>a\t\x01\"\\</arg_valu</arg_value>"
                    "</tool_call>")[0].arguments == {"city": 'a\t\x01"\\</arg_valu'}


def test_parameters_through_a_root_ref_and_keys_that_json_escapes():
    defs = {"Args": {"type": "object", "properties": {"n": {"type": "integer"}, "caf\u00e9 \"x\"": {"type": "boolean"}},
                     "required": ["n"], "additionalProperties": False}}
    tools = toolmode.compile_tools({"f": {"$defs": defs, "$ref": "#/$defs/Args"}})
    s = toolmode.ToolCallPrefix(tools)
    assert s.feed(tagged('<tool_call>f<arg_key>caf\u00e9 "x"</arg_key><arg_value>true</arg_value><arg_key>n'
                         '</arg_key><arg_value>-3</arg_value></tool_call>')) and s.mode == "call"
    assert not toolmode.ToolCallPrefix(tools).feed(tagged("<tool_call>f</tool_call>"))  # n is required


def test_what_cannot_be_enforced_is_refused_by_name():
    odd = {"type": "object", "properties": {"x": {"patternProperties": {"^a": {}}}}}
    with pytest.raises(jsonmode.SchemaError, match=r"f\.parameters\.properties\.x: \['patternProperties'\] not"):
        toolmode.compile_tools({"f": odd})
    with pytest.raises(jsonmode.SchemaError, match=r"f\.parameters: a tool's parameters must be"):
        toolmode.compile_tools({"f": {"type": "string"}})
    with pytest.raises(jsonmode.SchemaError, match="a tool's name must be non-empty"):
        toolmode.compile_tools({"my tool": None})


def test_no_accepted_prefix_is_a_dead_end_and_every_answer_reads_back_valid():
    """Random walks over a small vocabulary of tagged tokens, each step a token `jsonmode.allowed` lists (tags
    favoured so that calls get written and closed): some token always continues until the answer is done, and
    every finished answer is calls that chat's parser reads back as their schemas say."""
    pieces = [bytes([b]) for b in range(0x20, 0x7f)] + [b"\n", b"\xc3\xa9", b"\xc3", b"\xa9", b"city", b"days",
                                                       b"get_weather", b"now", b"search", b"true", b"12"]
    pieces += [b"\xfa", b"a\xfe"]  # text with a tag's byte
    tag_ids = {tag: len(pieces) + i for i, tag in enumerate(toolmode.TAGS)}
    vocab = toolmode.tagged_bytes(pieces + [None] * 7, tag_ids, frozenset({len(pieces) + 6}))
    assert vocab[len(pieces) - 2:len(pieces)] == [None, None]  # text with a tag's byte: never allowed
    sorted_vocab = jsonmode.Vocabulary.of(vocab)
    weight = [40 if i >= len(pieces) else 1 for i in range(len(vocab))]
    rng, finished = random.Random(3), 0
    for walk in range(60):
        s, text = toolmode.ToolCallPrefix(TOOLS, mode="text" if walk % 3 == 0 else "call"), b""
        for _ in range(300):
            fits = jsonmode.allowed(s, sorted_vocab)
            assert fits, ("a dead end", untagged(text))
            t = rng.choices(fits, [weight[i] for i in fits])[0]
            assert s.feed(vocab[t])
            text += vocab[t]
            if s.done:
                break
        if s.done:
            finished += 1
            calls = calls_of(untagged(text))
            assert (calls or s.mode == "done" and walk % 3 == 0) and all(c is not None and valid_call(c)
                                                                        for c in calls), untagged(text)
    assert finished > 20, finished

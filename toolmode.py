"""Tool calls held to their tools' schemas (OpenAI's tool_choice "required" or a named function; with "auto", the
calls of strict tools, after any text): the answer is GLM's XML tool calls,
`<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call>` (serving.md §1.3), each naming one of
the tools, with each key once, every required key, and values as the chat template writes them and
chat.parse_tool_call reads them back: a parameter typed string as its text (verbatim), any other as JSON of its
schema (jsonmode's automaton). Keys are the schema's properties; where its additionalProperties allow others, any
other key of ASCII letters, digits and `_.-` (a key's value type must be known to hold it: such a value is JSON of
the additionalProperties schema, which the parser reads as JSON). A tool given as True is not held: any key and any
value text.

The tags are special tokens, not text: `tagged_bytes` gives each of them one byte that UTF-8 text never has (F8-FD;
text tokens with such bytes are left out) and each stop token FE, so that jsonmode.pick and jsonmode.allowed, which
feed a token's bytes, read the tags as bytes too. A verbatim value is checked by its JSON string (each byte escaped
as json.dumps would): the string automaton then holds its length, pattern, format and enum; the text of a tag may
not appear in it (the parser would end the value there).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import chat
import jsonmode
import pattern
from jsonmode import JsonPrefix, Node, SchemaError

TAGS = (chat.TOOL_START, chat.TOOL_END, chat.KEY_START, chat.KEY_END, chat.VALUE_START, chat.VALUE_END)
CALL, CALL_END, KEY, KEY_END, VALUE, VALUE_END = range(0xF8, 0xFE)
STOP = pattern.STOP  # a stop token: after a call, the answer may end (more calls may come with parallel calls)
TAG_TEXTS = tuple(t.encode() for t in TAGS)
EXTRA_KEY = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")
# A verbatim byte in its JSON string: json.dumps(ensure_ascii=False)'s escapes.
ESCAPE = {b: f"\\u{b:04x}".encode() for b in range(0x20)} | {
    8: b"\\b", 9: b"\\t", 10: b"\\n", 12: b"\\f", 13: b"\\r", ord('"'): b'\\"', ord("\\"): b"\\\\"}


@dataclass(frozen=True)
class Tool:
    """A tool's parameters: each key's node, the keys written verbatim, the required keys, and the node of any
    other key (None: no other key); or `free`: its calls are not held (any key, any value text)."""
    params: dict[bytes, Node]
    verbatim: frozenset[bytes]
    required: frozenset[bytes]
    extra: Node | None
    free: bool = False


FREE = Tool({}, frozenset(), frozenset(), None, free=True)


def compile_tools(tools: dict[str, Any]) -> dict[bytes, Tool]:
    """name -> its parameters' JSON Schema (an object's, None for no parameters, True for calls not held) as
    Tools; a SchemaError names what jsonmode cannot enforce, under `<name>.parameters`."""
    out = {}
    for name, schema in tools.items():
        if not name or re.search(r"\s|<", name):
            raise SchemaError(name, "a tool's name must be non-empty, with no whitespace or '<'")
        if schema is True:
            out[name.encode()] = FREE
            continue
        schema = {"type": "object", "properties": {}, "additionalProperties": False} if schema is None else schema
        at = f"{name}.parameters"
        try:
            node = jsonmode.compile_schema(schema)
        except SchemaError as e:
            raise SchemaError(f"{at}.{e.path}" if e.path else at, e.reason) from None
        if node.types != frozenset({"object"}) or node.options:
            raise SchemaError(at, "a tool's parameters must be {'type': 'object', ...}")
        keys = {k: json.loads(b'"' + k + b'"').encode() for k in node.props}  # a key as written between quotes
        # written verbatim as the parser reads it back: by the type in parameters.properties (chat._param_schema)
        props = schema.get("properties", {})
        out[name.encode()] = Tool({keys[k]: n for k, n in node.props.items()},
                                  frozenset(keys[k] for k in node.props
                                            if chat.written_verbatim(props.get(keys[k].decode()))),
                                  frozenset(keys[k] for k in node.required), node.extra)
    return out


def tagged_bytes(vocab_bytes: list[bytes | None], tag_ids: dict[str, int], stop_ids: frozenset[int]) -> list:
    """vocab_bytes with each tag token (tag_ids: tag text -> token id, for the tags the grammar reads: none for a
    regular expression's answer) as its byte and each stop token as STOP. A text token with a byte F8-FF (a
    byte-level vocabulary has each byte as a token) is left out (None): no UTF-8 text has one, and the grammar
    would read it as a tag or a stop."""
    out = [None if b is None or max(b, default=0) >= CALL else b for b in vocab_bytes]
    for i, tag in enumerate(TAGS):
        if tag in tag_ids:
            out[tag_ids[tag]] = bytes([CALL + i])
    for t in stop_ids:
        out[t] = bytes([STOP])
    return out


@dataclass
class ToolCallPrefix:
    """The state after some bytes (tagged_bytes) of an answer that must be tool calls of `tools`. `feed` returns
    False (and leaves the state unusable) at the first byte that no such answer can have there. `parallel`:
    after a call, another may come (else the answer is done). Starting at mode "text" (tool_choice auto), text
    may come first, and the answer may end without a call."""

    tools: dict[bytes, Tool]
    parallel: bool = True
    # "text" (text, a <tool_call> or a stop), "call" (a <tool_call>, or a stop after a call), "name", "next" (a
    # key or </tool_call>), "key", "value_tag" (<arg_value>), "value", "done"
    mode: str = "call"
    text: bytes = b""  # the name or key so far
    tool: Tool | None = None
    used: frozenset[bytes] = frozenset()  # the call's keys so far
    value: JsonPrefix | None = None  # the value being read (a verbatim one as its JSON string; None if free)
    verbatim: bool = False
    tail: bytes = b""  # the last bytes of text written as itself, where a tag's text would show
    calls: int = 0

    def copy(self) -> ToolCallPrefix:
        new = object.__new__(ToolCallPrefix)  # (as JsonPrefix.copy: field by field, `allowed` copies often)
        new.__dict__ = self.__dict__.copy()
        new.value = None if self.value is None else self.value.copy()
        return new

    @property
    def done(self) -> bool:
        return self.mode == "done"

    def feed(self, data: bytes) -> bool:
        return all(self._byte(b) for b in data)

    def _byte(self, b: int) -> bool:
        m = self.mode
        if m == "value":
            return self._value_byte(b)
        if m == "text":
            if b in (CALL, STOP):
                self.mode = "name" if b == CALL else "done"
                return True
            return self._text_byte(b)
        if m == "call":
            self.mode = "done" if b == STOP else "name"
            return b == STOP and self.calls > 0 or b == CALL
        if m == "name":
            if b in (KEY, CALL_END):
                self.tool, self.used, self.mode = self.tools.get(self.text), frozenset(), "next"
                return self.tool is not None and self._byte(b)
            self.text += bytes([b])
            return any(n.startswith(self.text) for n in self.tools)
        if m == "next":
            if b == CALL_END and self.tool.required <= self.used:
                self.calls, self.text = self.calls + 1, b""
                self.mode = "call" if self.parallel else "done"
                return True
            self.mode, self.text, self.tail = "key", b"", b""
            return b == KEY and (self.tool.free or self.tool.extra is not None or
                                 not self.tool.params.keys() <= self.used)
        if m == "key":
            if b == KEY_END:
                return self._key_done()
            self.text += bytes([b])
            if self.tool.free:
                return self._text_byte(b)
            return self.tool.extra is not None and b in EXTRA_KEY or any(
                k.startswith(self.text) and k not in self.used for k in self.tool.params)
        if m == "value_tag":
            key, self.mode = self.text, "value"
            self.value = None if self.tool.free else JsonPrefix(self.tool.params.get(key, self.tool.extra))
            self.verbatim, self.tail = key in self.tool.verbatim, b""
            return b == VALUE and (not self.verbatim or self.value.feed(b'"'))
        return False  # "done"

    def _key_done(self) -> bool:
        key = self.text
        known = key in self.tool.params or (self.tool.free or self.tool.extra is not None) and key
        if key in self.used or not known:
            return False
        self.used, self.mode = self.used | {key}, "value_tag"
        return True

    def _value_byte(self, b: int) -> bool:
        if b == VALUE_END:
            self.mode = "next"
            if self.value is None:  # a free tool's
                return True
            end = self.value.copy()
            return end.feed(b'"') and end.done if self.verbatim else self.value.complete
        if self.value is None:
            return self._text_byte(b)
        if not self.verbatim:
            return self.value.feed(bytes([b]))
        return self._text_byte(b) and self.value.feed(ESCAPE.get(b, bytes([b])))

    def _text_byte(self, b: int) -> bool:
        """A byte of text written as itself (free text, a verbatim value, a free tool's key or value): no tag,
        and no tag's text (the parser reads the text, and would take it for the tag)."""
        self.tail = (self.tail + bytes([b]))[-max(map(len, TAG_TEXTS)):]
        return b < CALL and not any(self.tail.endswith(t) for t in TAG_TEXTS)

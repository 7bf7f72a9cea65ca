"""Chat: render the checkpoint's chat template as HF transformers does, and parse GLM output.

The prompt comes from the checkpoint's own `chat_template.jinja` (glm53.md §5.2); the output is
split into reasoning (before `</think>`), content and GLM XML tool calls
`<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call>` (serving.md §1.2-1.3).
One streaming parser does the splitting; the whole-text parser is that parser fed once.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

THINK_START, THINK_END = "<think>", "</think>"
TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"
KEY_START, KEY_END = "<arg_key>", "</arg_key>"
VALUE_START, VALUE_END = "<arg_value>", "</arg_value>"

# "none" is the OpenAI spelling of "no reasoning"; "max" is the template's default.
REASONING_EFFORTS = ("none", "low", "high", "max")
ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatError(ValueError):
    """A request field the chat layer cannot honour; `param` names the field, `code` says why (OpenAI's
    error codes: "invalid_value", or "unsupported" for what is valid but not served here)."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass
class ChatRequest:
    """A request of another API (Anthropic's Messages, OpenAI's Responses) in the chat path's terms: OpenAI chat
    shapes, before normalize_messages. What messages_api.to_chat and responses_api.to_chat return."""

    messages: list[dict]
    tools: list[dict] | None
    tool_choice: str | dict  # "auto", "none", "required" or {"type": "function", "function": {"name": ...}}
    thinking: Thinking
    options: dict  # chat-completions fields: max_tokens, temperature, top_p, top_k, stop, stream
    prefill: str = ""  # the start of the answer the client wrote (Anthropic's final assistant message)
    echo: dict = field(default_factory=dict)  # request fields the API's response repeats (Responses)


# ---------------------------------------------------------------------------------------------
# Rendering


@lru_cache(maxsize=8)
def compile_template(text: str) -> jinja2.Template:
    """The environment HF transformers builds for chat templates (whitespace rules, tojson)."""

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters; HF's does not, and templates are written for HF's.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(text)


@dataclass
class Thinking:
    """How a request wants reasoning: `enabled` decides the prompt's end and where parsing starts."""

    enabled: bool
    effort: str  # the template's reasoning_effort: "low" | "high" | "max"


def resolve_thinking(reasoning_effort: Any = None, enable_thinking: Any = None) -> Thinking:
    """Map the request's reasoning fields to a template effort and a thinking switch.

    Thinking off means off: the generation prompt is closed as `<|assistant|><think></think>`, which
    is what deployments patch in for enable_thinking=false (serving.md §1.2). Emulating "off" with
    effort Low (colibri) still spends tokens inside <think> and leaves answers empty when max_tokens
    runs out there, the complaint users raise most; passing "none" to the template silently means Max.
    The closed block is the same `<think></think>` the template writes for every past assistant turn
    without reasoning, and the system line says Low so the model is asked for the least reasoning.
    Values the template would silently turn into Max ("medium", typos) are refused.
    """
    if reasoning_effort is not None and reasoning_effort not in REASONING_EFFORTS:
        raise ChatError(
            f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}; got {reasoning_effort!r}",
            "reasoning_effort",
        )
    if enable_thinking is not None and not isinstance(enable_thinking, bool):
        raise ChatError(f"enable_thinking must be a boolean; got {enable_thinking!r}", "enable_thinking")
    if enable_thinking is not None and reasoning_effort is not None and enable_thinking == (reasoning_effort == "none"):
        raise ChatError(f"enable_thinking={str(enable_thinking).lower()} contradicts reasoning_effort="
                        f"{reasoning_effort!r}", "reasoning_effort")
    if enable_thinking is False or reasoning_effort == "none":
        return Thinking(enabled=False, effort="low")
    return Thinking(enabled=True, effort=reasoning_effort or "max")


def _text_of(content: Any, param: str) -> Any:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        return [_text_part(part, f"{param}[{i}]") for i, part in enumerate(content)]
    raise ChatError(f"{param} must be a string, a list of content parts or null; got {type(content).__name__}", param)


def _text_part(part: Any, param: str) -> str | dict:
    """A content part as the template reads it: a string, a text part, or an image part (OpenAI's `{"type": "image_url",
    "image_url": {"url": ...}}`, or `{"type": "image", "image": ...}` with a PIL image, bytes or a URL, in
    Python), which the template writes as <|begin_of_image|><|image|><|end_of_image|> and which keeps its source
    (as {"type": "image", "image": source}) for image_sources. An assistant's refusal part (what OpenAI's API
    returns for a refused request) is its text. Video and audio parts are refused: this engine has no encoder for
    them (the template would write their placeholders, and the model would answer about media it never saw)."""
    if isinstance(part, str):
        return part
    if not (isinstance(part, dict) and isinstance(part.get("type"), str)):
        raise ChatError(f"{param} must be a string or an object with a 'type'", param)
    kind = part["type"]
    if kind in ("image_url", "image"):
        source = part.get(kind)
        if kind == "image_url" and isinstance(source, dict):  # (some clients send the URL itself)
            source = source.get("url")
        if source is None:
            raise ChatError(f"{param} must be {{'type': 'image_url', 'image_url': {{'url': ...}}}}", f"{param}.{kind}")
        return {"type": "image", "image": source}
    if kind not in ("text", "refusal"):
        raise ChatError(f"{param} has type {kind!r}: text and image parts are supported (this engine has no "
                        "video or audio encoder)", f"{param}.type", "unsupported")
    if not isinstance(part.get(kind), str):  # both kinds hold their text under their own name
        raise ChatError(f"{param}.{kind} must be a string", f"{param}.{kind}")
    return {"type": "text", "text": part[kind]}


def image_sources(messages: list[dict]) -> list[Any]:
    """The sources of the image parts of messages (as normalize_messages returns them), in the order the template
    writes them."""
    return [part["image"] for m in messages if isinstance(m.get("content"), list) for part in m["content"]
            if isinstance(part, dict) and part.get("type") == "image"]


def _tool_call_for_template(tc: Any, param: str) -> dict:
    """OpenAI sends arguments as a JSON string; the template iterates them as a mapping."""
    if not isinstance(tc, dict) or not isinstance(tc.get("function"), dict):
        raise ChatError(f"{param} must be an object with a 'function' object", param)
    fn = tc["function"]
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ChatError(f"{param}.function.name must be a non-empty string", f"{param}.function.name")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ChatError(f"{param}.function.arguments is not valid JSON: {e}", f"{param}.function.arguments")
    if not isinstance(args, dict):
        raise ChatError(f"{param}.function.arguments must be a JSON object", f"{param}.function.arguments")
    return {**tc, "function": {**fn, "arguments": args}}


def normalize_messages(messages: Any) -> list[dict]:
    """Check OpenAI chat messages and turn them into what the template reads."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ChatError(f"{p} must be an object", p)
        role = m.get("role")
        if role not in ROLES:
            raise ChatError(f"{p}.role must be one of {', '.join(ROLES)}; got {role!r}", f"{p}.role")
        m = dict(m)
        # The template drops roles it does not know; "developer" is OpenAI's newer name for system.
        m["role"] = "system" if role == "developer" else role
        m["content"] = _text_of(m.get("content"), f"{p}.content")
        if role in ("system", "developer", "user", "tool") and m["content"] is None:
            raise ChatError(f"{p}.content is required for role {role}", f"{p}.content")
        reasoning = next((m[k] for k in ("reasoning_content", "reasoning") if m.get(k) is not None), None)
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise ChatError(f"{p}.reasoning_content must be a string", f"{p}.reasoning_content")
            m["reasoning_content"] = reasoning
        if m.get("tool_calls") is not None:
            if role != "assistant" or not isinstance(m["tool_calls"], list):
                raise ChatError(f"{p}.tool_calls must be a list on an assistant message", f"{p}.tool_calls")
            m["tool_calls"] = [_tool_call_for_template(tc, f"{p}.tool_calls[{j}]") for j, tc in enumerate(m["tool_calls"])]
        out.append(m)
    return out


def check_tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ChatError("tools must be a list", "tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", f"tools[{i}]")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ChatError(f"tools[{i}].function.parameters must be a JSON schema object", f"tools[{i}].function.parameters")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise ChatError(f"tools[{i}].function.strict must be a boolean", f"tools[{i}].function.strict")
    return tools or None


def render(template: str, messages: list[dict], tools: list[dict] | None = None,
           thinking: Thinking | None = None, add_generation_prompt: bool = True, **kwargs: Any) -> str:
    """The prompt text; `messages` and `tools` as returned by normalize_messages / check_tools."""
    thinking = thinking or Thinking(enabled=True, effort="max")
    text = compile_template(template).render(
        messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
        reasoning_effort=thinking.effort, **kwargs)
    if add_generation_prompt and not thinking.enabled:
        if not text.endswith(THINK_START):
            raise ChatError("the chat template's generation prompt does not end with <think>; cannot turn thinking off",
                            "reasoning_effort")
        text += THINK_END
    return text


# ---------------------------------------------------------------------------------------------
# Parsing


@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


@dataclass
class Delta:
    kind: str  # "reasoning" | "content" | "tool_call"
    text: str = ""
    tool_call: ToolCall | None = None


# a JSON value's type by its Python type (a dict, anything else: object)
JSON_KINDS = {str: "string", bool: "boolean", int: "integer", float: "number", type(None): "null", list: "array"}


def written_verbatim(prop: Any) -> bool:
    """Whether a tool argument of this property schema is written as its own text, not as JSON: the template
    writes a string verbatim, so a parameter that admits a string (typed so, alone or among others, or an anyOf /
    oneOf alternative so typed: pydantic's Optional[str]) is read back as the text."""
    return "string" in _kinds(prop)


def _kinds(prop: Any) -> set[str]:
    """The JSON types a property schema admits, as far as its type (or types), its enum's and const's values and
    its anyOf / oneOf alternatives say (a $ref's: none known)."""
    if not isinstance(prop, dict):
        return set()
    t = prop.get("type")
    kinds = set(t) if isinstance(t, list) else {t} if isinstance(t, str) else set()
    values = (prop["enum"] if isinstance(prop.get("enum"), list) else []) + ([prop["const"]] if "const" in prop else [])
    kinds |= {JSON_KINDS.get(type(v), "object") for v in values}
    for alt in (prop.get("anyOf") or []) + (prop.get("oneOf") or []):
        kinds |= _kinds(alt)
    return kinds


def _param_schema(tools: list[dict] | None, name: str, key: str) -> Any:
    for t in tools or []:
        fn = t.get("function", t)
        if fn.get("name") == name:
            return ((fn.get("parameters") or {}).get("properties") or {}).get(key)
    return None


def _typed_value(raw: str, prop: Any) -> Any:
    """The template writes strings verbatim and everything else as JSON, so the schema decides: where it admits a
    string, the text (or None for `null`, where it admits null too: the template's None); else its JSON."""
    kinds = _kinds(prop)
    if "string" in kinds:
        return None if raw == "null" and "null" in kinds else raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def parse_tool_call(body: str, tools: list[dict] | None = None) -> ToolCall | None:
    """`name<arg_key>k</arg_key><arg_value>v</arg_value>...` (the text between the tool_call tags)."""
    name, sep, rest = body.partition(KEY_START)
    name = name.strip()
    if not name or any(tag in name for tag in (KEY_END, VALUE_START, VALUE_END)):
        return None
    args: dict[str, Any] = {}
    rest = sep + rest
    while rest.strip():
        if not rest.startswith(KEY_START):
            return None
        key, sep, rest = rest[len(KEY_START):].partition(KEY_END)
        rest = rest.lstrip()
        if not sep or not rest.startswith(VALUE_START):
            return None
        value, sep, rest = rest[len(VALUE_START):].partition(VALUE_END)
        if not sep:
            return None
        key = key.strip()  # mangled keys with stray whitespace still name the parameter
        args[key] = _typed_value(value, _param_schema(tools, name, key))
        rest = rest.lstrip()
    return ToolCall(name=name, arguments=args)


def held_back(text: str, tags: list[str]) -> int:
    """Length of the longest tail of `text` that could still grow into one of `tags` (a tag or stop
    string split across stream chunks)."""
    return max((k for s in tags for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


class StreamParser:
    """Turns streamed model text into reasoning / content / tool-call deltas.

    Text that might be the start of a tag is held back until it is decided; a tool call is
    buffered from `<tool_call>` to `</tool_call>` and emitted whole (serving.md §1.3).
    """

    def __init__(self, thinking: bool = True, tools: list[dict] | None = None, parse_tools: bool = True):
        self.state = "reasoning" if thinking else "content"
        self.tools = tools
        self.parse_tools = parse_tools
        self.pending = ""
        self.content_started = False

    def feed(self, text: str) -> list[Delta]:
        self.pending += text
        out: list[Delta] = []
        while True:
            if self.state == "reasoning":
                if not self._advance(THINK_END, "reasoning", "content", out):
                    break
            elif self.state == "content":
                if not self.parse_tools:
                    self._emit("content", self.pending, out)
                    self.pending = ""
                    break
                if not self._advance(TOOL_START, "content", "tool", out):
                    break
            else:
                body, sep, rest = self.pending.partition(TOOL_END)
                if not sep:
                    break
                call = parse_tool_call(body, self.tools)
                if call is None:
                    self._emit("content", TOOL_START + body + TOOL_END, out)
                else:
                    out.append(Delta("tool_call", tool_call=call))
                self.pending, self.state = rest, "content"
        return out

    def finish(self) -> list[Delta]:
        """Flush what was held back; an unterminated tool call is returned as content."""
        out: list[Delta] = []
        text = (TOOL_START if self.state == "tool" else "") + self.pending
        self._emit("reasoning" if self.state == "reasoning" else "content", text, out)
        self.pending = ""
        return out

    def _advance(self, tag: str, kind: str, next_state: str, out: list[Delta]) -> bool:
        before, sep, rest = self.pending.partition(tag)
        if sep:
            self._emit(kind, before, out)
            self.pending, self.state = rest, next_state
            return True
        keep = held_back(self.pending, [tag])
        self._emit(kind, self.pending[: len(self.pending) - keep], out)
        self.pending = self.pending[len(self.pending) - keep:]
        return False

    def _emit(self, kind: str, text: str, out: list[Delta]) -> None:
        if kind == "content" and not self.content_started:
            # The template strips stored content, and the model starts its answer after "\n".
            text = text.lstrip()
            self.content_started = bool(text)
        if text:
            out.append(Delta(kind, text))


@dataclass
class ParsedOutput:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]


def parse_output(text: str, thinking: bool = True, tools: list[dict] | None = None,
                 parse_tools: bool = True) -> ParsedOutput:
    """The whole completion at once: the streaming parser fed in one piece."""
    p = StreamParser(thinking, tools, parse_tools)
    deltas = p.feed(text) + p.finish()
    reasoning = "".join(d.text for d in deltas if d.kind == "reasoning")
    content = "".join(d.text for d in deltas if d.kind == "content").strip()
    calls = [d.tool_call for d in deltas if d.kind == "tool_call"]
    return ParsedOutput(reasoning if thinking else None, content or None, calls)

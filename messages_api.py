"""Anthropic's Messages API (POST /v1/messages) over the chat path, so Claude Code and other Anthropic clients
connect directly (spec serving.md §1.9).

Two translations, both pure: `to_chat` turns a Messages request into the OpenAI-style chat that chat.py
checks and renders; `MessageStream` turns chat.StreamParser's deltas (reasoning, content, tool calls) into
Anthropic's content blocks (thinking, text, tool_use) as the SSE events of a streamed message. A whole
(non-streamed) message is those same events folded (`fold`), so the two forms cannot disagree.

Where the two APIs differ in meaning, Anthropic's holds: thinking is off unless `thinking` turns it on
(GLM's template thinks by default), `temperature` is in [0, 1], `max_tokens` is required, and usage counts
prompt tokens served from the prefix cache as `cache_read_input_tokens`, not in `input_tokens`. Structured output
(`output_config.format`) and strict tools become chat completions' json_schema and strict tools. A bad request
raises chat.ChatError whose message starts with the field it names: Anthropic's error object has no `param`.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Iterator

import chat
import jsonmode

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "request_too_large"}  # the statuses this server sends; others are "api_error"
UNSUPPORTED_BLOCKS = ("document", "search_result", "container_upload", "server_tool_use")
SHARED_FIELDS = ("max_tokens", "top_p", "top_k", "stream")  # the same name and meaning in both APIs


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def _bad_block(b: Any, q: str, where: str) -> chat.ChatError:
    kind = b.get("type") if isinstance(b, dict) else None
    if kind in UNSUPPORTED_BLOCKS:
        return chat.ChatError(f"{q}.type {kind!r}: these blocks are not supported (this engine reads text and "
                              "images, and runs no server tools)", f"{q}.type", "unsupported")
    return chat.ChatError(f"{q}.type must be one of {where}; got {kind!r}", f"{q}.type")


def _text(content: Any, q: str) -> str:
    """A string, or a list of text blocks joined, as plain text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise chat.ChatError(f"{q} must be a string or a list of text blocks", q)
    parts = []
    for i, b in enumerate(content):
        if isinstance(b, dict) and b.get("type") == "image":
            raise chat.ChatError(f"{q}[{i}].type 'image': an image is read in a user message or a tool result, "
                                 "not here", f"{q}[{i}].type", "unsupported")
        if not (isinstance(b, dict) and b.get("type") == "text"):
            raise _bad_block(b, f"{q}[{i}]", "text")
        parts.append(_block_text(b, f"{q}[{i}]", "text"))
    return "".join(parts)  # as the template joins a message's text parts


def _block_text(b: dict, q: str, key: str) -> str:
    if not isinstance(b.get(key), str):
        raise chat.ChatError(f"{q}.{key} must be a string", f"{q}.{key}")
    return b[key]


def _blocks(m: dict, p: str) -> list[dict]:
    content = m.get("content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not content:
        raise chat.ChatError(f"{p}.content must be a string or a non-empty list of content blocks", f"{p}.content")
    return content


def _user_turn(m: dict, p: str) -> list[dict]:
    """Tool results become tool messages, put first (the template expects them right after the assistant's
    calls); the text and image blocks become one user message."""
    results, blocks = [], []
    for j, b in enumerate(_blocks(m, p)):
        q = f"{p}.content[{j}]"
        if isinstance(b, dict) and b.get("type") == "tool_result":
            if not isinstance(b.get("tool_use_id"), str):
                raise chat.ChatError(f"{q}.tool_use_id must be a string", f"{q}.tool_use_id")
            content = b.get("content", "")
            results.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": content if isinstance(
                content, str) else _parts(content, f"{q}.content", "text, image")})
        else:
            blocks.append((b, q))
    parts = [_part(b, q, "text, image, tool_result") for b, q in blocks]
    return results + ([{"role": "user", "content": _joined(parts)}] if parts else [])


def _parts(blocks: Any, q: str, where: str) -> str | list[dict]:
    """A list of text and image blocks (a tool result's content: a screenshot a tool returns) as chat content."""
    if not isinstance(blocks, list):
        raise chat.ChatError(f"{q} must be a string or a list of text and image blocks", q)
    return _joined([_part(b, f"{q}[{i}]", where) for i, b in enumerate(blocks)])


def _part(b: Any, q: str, where: str) -> dict:
    """A text or image block as a chat content part."""
    kind = b.get("type") if isinstance(b, dict) else None
    if kind == "text":
        return {"type": "text", "text": _block_text(b, q, "text")}
    if kind == "image":
        return {"type": "image_url", "image_url": {"url": _image_url(b.get("source"), f"{q}.source")}}
    raise _bad_block(b, q, where)


def _joined(parts: list[dict]) -> str | list[dict]:
    """Text parts alone as one string, as the template joins them."""
    return "".join(p["text"] for p in parts) if all(p["type"] == "text" for p in parts) else parts


def _image_url(source: Any, q: str) -> str:
    """An image block's source, {"type": "base64", "media_type": ..., "data": ...} or {"type": "url", "url": ...},
    as a URL (a data URL for the first)."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and all(isinstance(source.get(k), str) for k in ("media_type", "data")):
        return f"data:{source['media_type']};base64,{source['data']}"
    if kind == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise chat.ChatError(f"{q} must be {{'type': 'base64', 'media_type': ..., 'data': ...}} or {{'type': 'url', "
                         f"'url': ...}}", q)


def _assistant_turn(m: dict, p: str) -> dict:
    """Thinking blocks become reasoning_content, text blocks content, tool_use blocks tool_calls."""
    texts, thoughts, calls = [], [], []
    for j, b in enumerate(_blocks(m, p)):
        q = f"{p}.content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            texts.append(_block_text(b, q, "text"))
        elif kind == "thinking":
            thoughts.append(_block_text(b, q, "thinking"))
        elif kind == "redacted_thinking":
            continue  # encrypted by another server: nothing this model can read
        elif kind == "tool_use":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str) or not b["name"]:
                raise chat.ChatError(f"{q} needs a string 'id' and a non-empty string 'name'", q)
            if not isinstance(b.get("input", {}), dict):
                raise chat.ChatError(f"{q}.input must be an object", f"{q}.input")
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": b.get("input", {})}})
        else:
            raise _bad_block(b, q, "text, thinking, redacted_thinking, tool_use")
    out = {"role": "assistant", "content": "".join(texts)}
    if thoughts:
        out["reasoning_content"] = "".join(thoughts)
    if calls:
        out["tool_calls"] = calls
    return out


def _prefill(messages: list[dict], thinking: chat.Thinking) -> tuple[list[dict], str]:
    """A final assistant message is the start of the answer (Anthropic's prefill): text only, no thinking."""
    if messages[-1]["role"] != "assistant":
        return messages, ""
    last, p = messages[-1], f"messages[{len(messages) - 1}]"
    if last.get("tool_calls") or last.get("reasoning_content"):
        raise chat.ChatError(f"{p}.content: a final assistant message (the start of the answer) may hold only "
                             "text blocks", f"{p}.content")
    if thinking.enabled:
        raise chat.ChatError("thinking cannot be enabled when the final message is the assistant's (a prefilled "
                             "answer starts after the reasoning)", "thinking")
    return messages[:-1], last["content"]


def _messages(body: dict) -> list[dict]:
    system = body.get("system")
    out = [] if system is None else [{"role": "system", "content": _text(system, "system")}]
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise chat.ChatError("messages must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        p = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise chat.ChatError(f"{p}.role must be 'user' or 'assistant' (system goes in 'system')", f"{p}.role")
        out += _user_turn(m, p) if m["role"] == "user" else [_assistant_turn(m, p)]
    return out


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise chat.ChatError("tools must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
            raise chat.ChatError(f"tools[{i}] must be an object with a non-empty string 'name'", f"tools[{i}]")
        if t.get("type") not in (None, "custom"):  # Anthropic's server tools (web search, bash, ...) run there
            raise chat.ChatError(f"tools[{i}].type {t['type']!r} is a server tool: only client tools (name, "
                                 "description, input_schema) are supported", f"tools[{i}].type", "unsupported")
        schema = t.get("input_schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise chat.ChatError(f"tools[{i}].input_schema must be a JSON schema object", f"tools[{i}].input_schema")
        fn = {"name": t["name"], "parameters": schema}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        if "strict" in t:  # (structured outputs: its calls are held to the schema under tool_choice auto too)
            fn["strict"] = t["strict"]
        out.append({"type": "function", "function": fn})
    return out or None


def _tool_choice(body: dict, tools: list[dict] | None) -> str | dict:
    tc = body.get("tool_choice")
    if tc is None:
        return "auto" if tools else "none"
    kind = tc.get("type") if isinstance(tc, dict) else None
    if kind == "tool" and isinstance(tc.get("name"), str):
        return {"type": "function", "function": {"name": tc["name"]}}
    if kind in ("auto", "any", "none"):
        return {"auto": "auto", "any": "required", "none": "none"}[kind]
    raise chat.ChatError("tool_choice must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}",
                         "tool_choice")


def _thinking(body: dict) -> tuple[chat.Thinking, int | None]:
    """The thinking switch, and the enabled form's budget_tokens (the engine's thinking_token_budget)."""
    t = body.get("thinking")
    if t is None:
        return chat.resolve_thinking(enable_thinking=False), None
    kind = t.get("type") if isinstance(t, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise chat.ChatError("thinking must be {'type': 'enabled', 'budget_tokens': N}, {'type': 'adaptive'} or "
                             "{'type': 'disabled'}", "thinking")
    if kind == "enabled" and not (_is_int(t.get("budget_tokens")) and t["budget_tokens"] >= 1):
        raise chat.ChatError("thinking.budget_tokens must be a positive integer", "thinking.budget_tokens")
    budget = t["budget_tokens"] if kind == "enabled" else None
    return chat.resolve_thinking(enable_thinking=kind != "disabled"), budget


def _output_format(body: dict) -> tuple[str, dict] | None:
    """Structured output: `output_config.format` (or the beta's `output_format`), {"type": "json_schema",
    "schema": {...}}, as (the field's name, the schema), checked by jsonmode; None if the request has none."""
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise chat.ChatError("output_config must be an object", "output_config")
    name, fmt = ("output_config.format", config.get("format")) if config and "format" in config else \
        ("output_format", body.get("output_format"))
    if fmt is None:
        return None
    if not (isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict)):
        raise chat.ChatError(f"{name} must be {{'type': 'json_schema', 'schema': {{...}}}}", name)
    try:
        jsonmode.object_schema(fmt["schema"])
    except jsonmode.SchemaError as e:
        raise chat.ChatError(f"{name}.schema: {e}", f"{name}.schema", "unsupported") from None
    return name, fmt["schema"]


def to_chat(body: dict) -> chat.ChatRequest:
    """The Messages request `body` in the chat path's terms; chat.ChatError names what is wrong."""
    if body.get("max_tokens") is None:
        raise chat.ChatError("max_tokens is required", "max_tokens")
    t = body.get("temperature")
    if isinstance(t, (int, float)) and not isinstance(t, bool) and not 0 <= t <= 1:
        raise chat.ChatError(f"temperature must be between 0 and 1; got {t}", "temperature")
    stop = body.get("stop_sequences")
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise chat.ChatError("stop_sequences must be a list of non-empty strings", "stop_sequences")
    tools = _tools(body)
    options = {k: body[k] for k in SHARED_FIELDS if k in body}
    options.update(temperature=t, stop=stop or None)
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and "disable_parallel_tool_use" in choice:
        if not isinstance(choice["disable_parallel_tool_use"], bool):
            raise chat.ChatError("tool_choice.disable_parallel_tool_use must be a boolean",
                                 "tool_choice.disable_parallel_tool_use")
        options["parallel_tool_calls"] = not choice["disable_parallel_tool_use"]
    thinking, budget = _thinking(body)
    if budget is not None:
        if _is_int(body["max_tokens"]) and budget >= body["max_tokens"]:  # as Anthropic requires
            raise chat.ChatError(f"thinking.budget_tokens ({budget}) must be less than max_tokens "
                                 f"({body['max_tokens']})", "thinking.budget_tokens")
        options["thinking_token_budget"] = budget
    tool_choice = _tool_choice(body, tools)
    structured = _output_format(body)
    if structured is not None:  # as chat completions' response_format
        if tool_choice not in ("auto", "none"):
            raise chat.ChatError(f"{structured[0]} cannot go with a tool_choice that forces a tool call", structured[0])
        options["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": structured[1]}}
    messages, prefill = _prefill(_messages(body), thinking)
    if structured is not None and prefill:
        raise chat.ChatError(f"{structured[0]} cannot go with a final assistant message (the answer must be the "
                             f"JSON from its start)", "messages")
    return chat.ChatRequest(messages, tools, tool_choice, thinking, options, prefill)


# ---------------------------------------------------------------------------------------------------------
# The answer: chat deltas -> content blocks, as SSE events (name, data)

BLOCK_OF = {"reasoning": ("thinking", "thinking_delta", "thinking"), "content": ("text", "text_delta", "text")}


def stop_reason(finish_reason: str, stop_string: str | None, tool_calls: int) -> str:
    if tool_calls:
        return "tool_use"
    if finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if stop_string is not None else "end_turn"


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}


class MessageStream:
    """The events of one streamed message: `start`, then `feed` with each batch of chat.Delta, then `finish`.
    One content block is open at a time; a change of kind closes it and opens the next."""

    def __init__(self, model: str, prompt_tokens: int):
        self.id, self.model, self.prompt_tokens = f"msg_{uuid.uuid4().hex}", model, prompt_tokens
        self.index, self.open, self.tool_calls = -1, None, 0

    def start(self) -> Iterator[tuple[str, dict]]:
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": usage(self.prompt_tokens, 0, 0)}
        yield "message_start", {"type": "message_start", "message": message}

    def feed(self, deltas: list[chat.Delta]) -> Iterator[tuple[str, dict]]:
        for d in deltas:
            if d.kind == "tool_call":
                yield from self._close()
                yield from self._tool_use(d.tool_call)
                continue
            if not d.text:
                continue
            block, delta, key = BLOCK_OF[d.kind]
            if self.open != block:
                yield from self._close()
                self.index, self.open = self.index + 1, block
                start = {"type": block, key: "", **({"signature": ""} if block == "thinking" else {})}
                yield "content_block_start", {"type": "content_block_start", "index": self.index,
                                              "content_block": start}
            yield "content_block_delta", {"type": "content_block_delta", "index": self.index,
                                          "delta": {"type": delta, key: d.text}}

    def finish(self, last: Any) -> Iterator[tuple[str, dict]]:
        """`last`: the request's final engine.RequestOutput."""
        yield from self._close()
        reason, u = stop_reason(last.finish_reason, last.stop_string, self.tool_calls), last.usage
        yield "message_delta", {"type": "message_delta",
                                "delta": {"stop_reason": reason, "stop_sequence": last.stop_string if
                                          reason == "stop_sequence" else None},
                                "usage": usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)}
        yield "message_stop", {"type": "message_stop"}

    def _close(self) -> Iterator[tuple[str, dict]]:
        if self.open is not None:
            yield "content_block_stop", {"type": "content_block_stop", "index": self.index}
            self.open = None

    def _tool_use(self, call: chat.ToolCall) -> Iterator[tuple[str, dict]]:
        self.index += 1
        self.tool_calls += 1
        block = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": call.name, "input": {}}
        yield "content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block}
        yield "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": {
            "type": "input_json_delta", "partial_json": json.dumps(call.arguments, ensure_ascii=False)}}
        yield "content_block_stop", {"type": "content_block_stop", "index": self.index}


def fold(events: Iterator[tuple[str, dict]]) -> dict:
    """The whole message a client assembles from the events (as Anthropic's SDKs do)."""
    message: dict = {}
    for name, e in events:
        if name == "message_start":
            message = e["message"]
        elif name == "content_block_start":
            message["content"].append(dict(e["content_block"]))
        elif name == "content_block_delta":
            block, delta = message["content"][e["index"]], e["delta"]
            if delta["type"] == "input_json_delta":
                block["input"] = json.loads(delta["partial_json"])
            else:
                key = BLOCK_OF["reasoning" if delta["type"] == "thinking_delta" else "content"][2]
                block[key] += delta[key]
        elif name == "message_delta":
            message.update(e["delta"])
            message["usage"] = e["usage"]
    return message

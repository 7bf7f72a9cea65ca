"""OpenAI's Responses API (POST /v1/responses) over the chat path, so Codex and other Responses clients connect
directly (spec serving.md §1.9). The same shape as messages_api.py: `to_chat` turns a request into the chat
that chat.py checks and renders; `ResponseStream` turns chat.StreamParser's deltas into output items
(reasoning, message, function_call) as the API's SSE events, and the whole response is the one its last
event carries, so the streamed and the whole forms cannot disagree.

The server stores nothing: `previous_response_id` and `conversation` are refused (send the whole input),
`store` is accepted and has no effect. `reasoning.effort` takes chat's values (none, low, high; "minimal"
is low): "medium" is refused as on /v1/chat/completions, because the template would silently run it as max.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Iterator

import chat
import jsonmode

UNSUPPORTED_PARTS = ("input_file", "input_audio")
STATEFUL_FIELDS = ("previous_response_id", "conversation")


def _text(content: Any, q: str, images: bool = False) -> str | list[dict]:
    """A string, or a list of text parts (input_text, output_text) joined, as plain text; where `images` are
    allowed (a message's content, a function call's output) and one comes (input_image, its image_url a data or
    http(s) URL), the chat path's text and image parts instead."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise chat.ChatError(f"{q} must be a string or a list of content parts", q)
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in UNSUPPORTED_PARTS or kind == "input_image" and not images:
            raise chat.ChatError(f"{q}[{i}].type {kind!r}: not supported (this engine reads text, and images in a "
                                 "message or a function call's output)", f"{q}[{i}].type", "unsupported")
        if kind == "input_image":
            if not isinstance(part.get("image_url"), str):
                raise chat.ChatError(f"{q}[{i}].image_url must be a data or http(s) URL (file_id is not supported: "
                                     "this server stores no files)", f"{q}[{i}].image_url")
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
            continue
        if kind not in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            raise chat.ChatError(f"{q}[{i}].type must be input_text or output_text; got {kind!r}", f"{q}[{i}].type")
        if not isinstance(part.get("text"), str):
            raise chat.ChatError(f"{q}[{i}].text must be a string", f"{q}[{i}].text")
        parts.append({"type": "text", "text": part["text"]})
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def _messages(body: dict) -> list[dict]:
    """Input items as chat messages: function calls join the assistant message before them, a reasoning item
    goes to the next assistant message."""
    out = [] if body.get("instructions") is None else [{"role": "system",
                                                        "content": _text(body["instructions"], "instructions")}]
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise chat.ChatError("input must be a string or a non-empty list of items", "input")
    reasoning = None
    for i, item in enumerate(items):
        q = f"input[{i}]"
        if not isinstance(item, dict):
            raise chat.ChatError(f"{q} must be an object", q)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise chat.ChatError(f"{q}.role must be user, system, developer or assistant; got {role!r}",
                                     f"{q}.role")
            out.append({"role": role, "content": _text(item.get("content"), f"{q}.content", images=True)})
        elif kind == "reasoning":
            key = "content" if item.get("content") else "summary"  # the full text where the client kept it
            reasoning = _text(item.get(key) or [], f"{q}.{key}")
            continue
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise chat.ChatError(f"{q} needs string call_id, name and arguments", q)
            if not (out and out[-1]["role"] == "assistant"):
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                "name": item["name"], "arguments": item["arguments"]}})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise chat.ChatError(f"{q}.call_id must be a string", f"{q}.call_id")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _text(item.get("output", ""), f"{q}.output", images=True)})
        else:
            raise chat.ChatError(f"{q}.type must be message, reasoning, function_call or function_call_output; got "
                                 f"{kind!r} (this server stores nothing, so items cannot be referenced)", f"{q}.type",
                                 "unsupported")
        if reasoning is not None and out[-1]["role"] == "assistant":
            out[-1]["reasoning_content"], reasoning = reasoning, None
    return out


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise chat.ChatError("tools must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise chat.ChatError(f"tools[{i}].type {kind!r}: only function tools are supported (this server runs no "
                                 "built-in tools)", f"tools[{i}].type", "unsupported")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise chat.ChatError(f"tools[{i}].name must be a non-empty string", f"tools[{i}].name")
        fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        fn["strict"] = t.get("strict", True)  # (the Responses API's default; the template does not render it)
        out.append({"type": "function", "function": fn})
    return out or None


def _tool_choice(body: dict, tools: list[dict] | None) -> str | dict:
    tc = body.get("tool_choice")
    if tc is None:
        return "auto" if tools else "none"
    if tc in ("auto", "none", "required"):
        return tc
    if isinstance(tc, dict) and tc.get("type") == "function" and isinstance(tc.get("name"), str):
        return {"type": "function", "function": {"name": tc["name"]}}
    raise chat.ChatError("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}",
                         "tool_choice")


def _thinking(body: dict) -> chat.Thinking:
    r = body.get("reasoning")
    if r is not None and not isinstance(r, dict):
        raise chat.ChatError("reasoning must be an object {'effort': ...}", "reasoning")
    effort = (r or {}).get("effort")
    try:
        return chat.resolve_thinking("low" if effort == "minimal" else effort)
    except chat.ChatError as e:
        raise chat.ChatError(f"reasoning.effort: {e}", "reasoning.effort")


def to_chat(body: dict) -> chat.ChatRequest:
    """The Responses request `body` in the chat path's terms; chat.ChatError names what is wrong."""
    for name in STATEFUL_FIELDS:
        if body.get(name) is not None:
            raise chat.ChatError(f"{name} is not supported: this server stores no responses; send the whole input",
                                 name, "unsupported")
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else text
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is not None and kind not in ("text", "json_object", "json_schema"):
        raise chat.ChatError("text.format must be {'type': 'text'}, {'type': 'json_object'} or {'type': "
                             "'json_schema', 'name': ..., 'schema': {...}}", "text.format", "unsupported")
    tools = _tools(body)
    tool_choice = _tool_choice(body, tools)
    options = {k: body[k] for k in ("temperature", "top_p", "stream", "parallel_tool_calls") if k in body}
    if kind == "json_schema":
        try:
            jsonmode.object_schema(fmt.get("schema"))
        except jsonmode.SchemaError as e:
            raise chat.ChatError(f"text.format.schema: {e}", "text.format.schema", "unsupported")
    if kind in ("json_object", "json_schema"):  # as chat completions' response_format
        if tool_choice not in ("auto", "none"):
            raise chat.ChatError(f"text.format {kind} cannot go with a tool_choice that forces a tool call",
                                 "text.format")
        options["response_format"] = {"type": kind} if kind == "json_object" else \
            {"type": kind, "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}
    limit = body.get("max_output_tokens")
    if limit is not None:  # checked here: the chat path would name its own field, max_tokens
        if not (isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1):
            raise chat.ChatError(f"max_output_tokens must be an integer >= 1; got {json.dumps(limit)[:40]}",
                                 "max_output_tokens")
        options["max_tokens"] = limit
    echo = {k: body.get(k) for k in ("instructions", "temperature", "top_p", "max_output_tokens", "metadata")}
    echo["parallel_tool_calls"] = body.get("parallel_tool_calls", True)
    return chat.ChatRequest(_messages(body), tools, tool_choice, _thinking(body), options,
                            echo={**echo, "tools": body.get("tools") or [],
                                  "tool_choice": body.get("tool_choice", "auto")})


# ---------------------------------------------------------------------------------------------------------
# The answer: chat deltas -> output items, as SSE events (name, data)


def usage(u: Any) -> dict:
    """An engine.Usage in the Responses API's terms."""
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


class ResponseStream:
    """The events of one response: `start`, then `feed` with each batch of chat.Delta, then `finish`. One
    output item is open at a time; a change of kind closes it and opens the next."""

    def __init__(self, model: str, echo: dict):
        self.response = {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
                         "status": "in_progress", "model": model, "output": [], "error": None,
                         "incomplete_details": None, "usage": None, **echo}
        self.sequence, self.open = 0, None

    def _event(self, name: str, **data: Any) -> tuple[str, dict]:
        self.sequence += 1
        return name, {"type": name, "sequence_number": self.sequence - 1, **data}

    def start(self) -> Iterator[tuple[str, dict]]:
        yield self._event("response.created", response=dict(self.response, output=[]))
        yield self._event("response.in_progress", response=dict(self.response, output=[]))

    def feed(self, deltas: list[chat.Delta]) -> Iterator[tuple[str, dict]]:
        for d in deltas:
            if d.kind == "tool_call":
                yield from self._close()
                yield from self._function_call(d.tool_call)
            elif d.text:
                kind = "reasoning" if d.kind == "reasoning" else "message"
                if self.open is None or self.open["type"] != kind:
                    yield from self._close()
                    yield from self._open(kind)
                item, at = self.open, len(self.response["output"]) - 1
                item["content"][0]["text"] += d.text
                name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
                yield self._event(name, item_id=item["id"], output_index=at, content_index=0, delta=d.text)

    def finish(self, last: Any) -> Iterator[tuple[str, dict]]:
        """`last`: the request's final engine.RequestOutput."""
        yield from self._close()
        done, u = last.finish_reason != "length", last.usage
        self.response.update(status="completed" if done else "incomplete",
                             incomplete_details=None if done else {"reason": "max_output_tokens"},
                             usage=usage(u))
        yield self._event("response.completed" if done else "response.incomplete", response=self.response)

    def _open(self, kind: str) -> Iterator[tuple[str, dict]]:
        if kind == "reasoning":
            item = {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}]}
        else:
            item = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": "in_progress", "role": "assistant",
                    "content": [{"type": "output_text", "text": "", "annotations": []}]}
        self.response["output"].append(item)
        self.open, at = item, len(self.response["output"]) - 1
        yield self._event("response.output_item.added", output_index=at, item=dict(item, content=[]))
        if kind == "message":
            yield self._event("response.content_part.added", item_id=item["id"], output_index=at, content_index=0,
                              part={"type": "output_text", "text": "", "annotations": []})

    def _close(self) -> Iterator[tuple[str, dict]]:
        item, at = self.open, len(self.response["output"]) - 1
        if item is None:
            return
        self.open = None
        part = item["content"][0]
        if item["type"] == "reasoning":
            yield self._event("response.reasoning_text.done", item_id=item["id"], output_index=at, content_index=0,
                              text=part["text"])
        else:
            item["status"] = "completed"
            yield self._event("response.output_text.done", item_id=item["id"], output_index=at, content_index=0,
                              text=part["text"])
            yield self._event("response.content_part.done", item_id=item["id"], output_index=at, content_index=0,
                              part=part)
        yield self._event("response.output_item.done", output_index=at, item=item)

    def _function_call(self, call: chat.ToolCall) -> Iterator[tuple[str, dict]]:
        arguments = json.dumps(call.arguments, ensure_ascii=False)
        item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "completed", "call_id": call.id,
                "name": call.name, "arguments": arguments}
        self.response["output"].append(item)
        at = len(self.response["output"]) - 1
        yield self._event("response.output_item.added", output_index=at,
                          item=dict(item, arguments="", status="in_progress"))
        yield self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                          delta=arguments)
        yield self._event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                          arguments=arguments)
        yield self._event("response.output_item.done", output_index=at, item=item)

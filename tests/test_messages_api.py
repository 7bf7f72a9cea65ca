"""messages_api without a server: a Messages request becomes the chat the OpenAI path would render, and the
stream's events fold into the message a client assembles."""
import json

import pytest

import chat
import engine
import messages_api as m

WEATHER = {"name": "get_weather", "description": "Weather by city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
CONVERSATION = {"max_tokens": 50, "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
                "tools": [WEATHER], "messages": [
                    {"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": [
                        {"type": "thinking", "thinking": "Need the tool.", "signature": "sig"},
                        {"type": "text", "text": "Checking."},
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sun"}]},
                        {"type": "text", "text": "Thanks!"}]}]}


def test_a_tool_conversation_becomes_the_same_chat():
    r = m.to_chat(CONVERSATION)
    assert r.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Need the tool.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sun"},
        {"role": "user", "content": "Thanks!"}]
    assert r.tools == [{"type": "function", "function": {"name": "get_weather", "description": "Weather by city",
                                                         "parameters": WEATHER["input_schema"]}}]
    assert r.tool_choice == "auto" and r.options == {"max_tokens": 50, "temperature": None, "stop": None}
    assert not r.thinking.enabled  # Anthropic's default, not the template's


@pytest.mark.parametrize("thinking, enabled", [(None, False), ({"type": "disabled"}, False),
                                               ({"type": "enabled", "budget_tokens": 2048}, True),
                                               ({"type": "adaptive"}, True)])
def test_thinking(thinking, enabled):
    body = {"max_tokens": 4096, "messages": [{"role": "user", "content": "hi"}], "thinking": thinking}
    r = m.to_chat(body)
    assert r.thinking.enabled is enabled
    assert r.options.get("thinking_token_budget") == (thinking or {}).get("budget_tokens")  # the engine's budget


@pytest.mark.parametrize("choice, chat_choice", [({"type": "auto"}, "auto"), ({"type": "any"}, "required"),
                                                 ({"type": "none"}, "none"),
                                                 ({"type": "tool", "name": "get_weather"},
                                                  {"type": "function", "function": {"name": "get_weather"}})])
def test_tool_choice(choice, chat_choice):
    assert m.to_chat({**CONVERSATION, "tool_choice": choice}).tool_choice == chat_choice
    off = m.to_chat({**CONVERSATION, "tool_choice": {**choice, "disable_parallel_tool_use": True}})
    assert off.tool_choice == chat_choice and off.options["parallel_tool_calls"] is False
    assert "parallel_tool_calls" not in m.to_chat({**CONVERSATION, "tool_choice": choice}).options
    with pytest.raises(chat.ChatError, match="disable_parallel_tool_use must be a boolean"):
        m.to_chat({**CONVERSATION, "tool_choice": {**choice, "disable_parallel_tool_use": "yes"}})


SHAPE = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


@pytest.mark.parametrize("field", [{"output_config": {"format": {"type": "json_schema", "schema": SHAPE}}},
                                   {"output_format": {"type": "json_schema", "schema": SHAPE}}])
def test_structured_output_is_chat_completions_json_schema(field):
    r = m.to_chat({**CONVERSATION, **field})
    assert r.options["response_format"] == {"type": "json_schema", "json_schema": {"name": "output", "schema": SHAPE}}
    name = "output_config.format" if "output_config" in field else "output_format"
    with pytest.raises(chat.ChatError, match=f"{name} cannot go with a tool_choice") as e:
        m.to_chat({**CONVERSATION, **field, "tool_choice": {"type": "any"}})
    assert e.value.param == name
    with pytest.raises(chat.ChatError, match="cannot go with a final assistant message"):
        m.to_chat({"max_tokens": 5, **field, "messages": [U[0], {"role": "assistant", "content": "{"}]})


def test_image_blocks_become_image_parts():
    got = m.to_chat({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is "}, {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                          "data": "AAAA"}},
        {"type": "text", "text": " and "}, {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}]}]})
    assert got.messages[-1] == {"role": "user", "content": [
        {"type": "text", "text": "What is "}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "text", "text": " and "}, {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}
    assert chat.image_sources(chat.normalize_messages(got.messages)) == ["data:image/png;base64,AAAA",
                                                                         "https://x/y.png"]


def test_a_tool_results_images_become_image_parts():
    """A tool's result may hold images (a screenshot): the tool message gets the image parts, which the template
    writes as it writes a user's."""
    shot = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    got = m.to_chat({"max_tokens": 5, "messages": [
        U[0], {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "the screen:"}, shot]}, {"type": "text", "text": "and?"}]}]})
    assert got.messages[2:] == [
        {"role": "tool", "tool_call_id": "t1", "content": [{"type": "text", "text": "the screen:"}, {
            "type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
        {"role": "user", "content": "and?"}]
    assert chat.image_sources(chat.normalize_messages(got.messages)) == ["data:image/png;base64,AAAA"]


U = [{"role": "user", "content": "hi"}]
BAD = [  # (body, param, code)
    ({"max_tokens": 5, "messages": U, "output_config": {"format": {"type": "json_object"}}}, "output_config.format",
     "invalid_value"),
    ({"max_tokens": 5, "messages": U, "output_format": {"type": "json_schema", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "format": "idn-email"}}}}}, "output_format.schema",
     "unsupported"),
    ({"max_tokens": 5, "messages": U, "output_config": "json"}, "output_config", "invalid_value"),
    ({"messages": U}, "max_tokens", "invalid_value"),
    ({"max_tokens": 5}, "messages", "invalid_value"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": []}]}, "messages[0].content", "invalid_value"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0].source", "invalid_value"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "messages[0].content[0].type", "unsupported"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
     "messages[0].content[0].text", "invalid_value"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
     "messages[0].content[0].tool_use_id", "invalid_value"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "document"}]}]}]},
     "messages[0].content[0].content[0].type", "unsupported"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}]}]},
     "messages[0].content[0].content[0].source", "invalid_value"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": {"type": "text", "text": "x"}}]}]},
     "messages[0].content[0].content", "invalid_value"),
    ({"max_tokens": 5, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                                       "input": [1]}]}]},
     "messages[0].content[0].input", "invalid_value"),
    ({"max_tokens": 5, "messages": [{"role": "assistant", "content": [{"type": "tool_result"}]}]},
     "messages[0].content[0].type", "invalid_value"),
    ({"max_tokens": 5, "messages": U, "system": 5}, "system", "invalid_value"),
    ({"max_tokens": 5, "messages": U, "temperature": 1.5}, "temperature", "invalid_value"),
    ({"max_tokens": 5, "messages": U, "stop_sequences": "X"}, "stop_sequences", "invalid_value"),
    ({"max_tokens": 5, "messages": U, "tools": [{"description": "no name"}]}, "tools[0]", "invalid_value"),
    ({"max_tokens": 5, "messages": U, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "tools[0].type", "unsupported"),
    ({"max_tokens": 5, "messages": U, "tool_choice": "auto"}, "tool_choice", "invalid_value"),
    ({"max_tokens": 5, "messages": U, "thinking": {"type": "enabled"}}, "thinking.budget_tokens", "invalid_value"),
    ({"max_tokens": 5, "messages": U, "thinking": {"type": "enabled", "budget_tokens": 5}}, "thinking.budget_tokens",
     "invalid_value"),
    ({"max_tokens": 5, "messages": U, "thinking": {"type": "enabled", "budget_tokens": True}},
     "thinking.budget_tokens", "invalid_value"),
    ({"max_tokens": 5, "messages": U, "thinking": True}, "thinking", "invalid_value"),
]


@pytest.mark.parametrize("body, param, code", BAD)
def test_bad_requests_name_the_field(body, param, code):
    with pytest.raises(chat.ChatError) as e:
        m.to_chat(body)
    assert (e.value.param, e.value.code) == (param, code) and str(e.value).startswith(param)


def last(finish_reason: str, stop_string: str | None = None) -> engine.RequestOutput:
    return engine.RequestOutput("r", [], "", True, finish_reason, engine.Usage(30, 9, 16), stop_string=stop_string)


def test_stream_events_fold_into_the_message():
    s = m.MessageStream("glm", 30)
    call = chat.ToolCall("get_weather", {"city": "Paris"})
    events = [*s.start(), *s.feed([chat.Delta("reasoning", "Need "), chat.Delta("reasoning", "it.")]),
              *s.feed([chat.Delta("content", ""), chat.Delta("content", "Let me "), chat.Delta("content", "check.")]),
              *s.feed([chat.Delta("tool_call", tool_call=call)]), *s.finish(last("stop"))]
    names = [n for n, _ in events]
    assert names == ["message_start", "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_stop", "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_stop", "content_block_start", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]
    assert all(e["type"] == n for n, e in events)
    assert [e["index"] for n, e in events if n == "content_block_start"] == [0, 1, 2]
    msg = m.fold(iter(events))
    tool = msg["content"][2]
    assert msg["content"][:2] == [{"type": "thinking", "thinking": "Need it.", "signature": ""},
                                  {"type": "text", "text": "Let me check."}]
    assert (tool["type"], tool["name"], tool["input"]) == ("tool_use", "get_weather", {"city": "Paris"})
    assert tool["id"].startswith("toolu_")
    assert (msg["stop_reason"], msg["stop_sequence"]) == ("tool_use", None)
    assert msg["usage"] == {"input_tokens": 14, "output_tokens": 9, "cache_read_input_tokens": 16,
                            "cache_creation_input_tokens": 0}
    json.dumps(msg)


@pytest.mark.parametrize("finish, stop, reason", [("stop", None, "end_turn"), ("length", None, "max_tokens"),
                                                  ("stop", "###", "stop_sequence")])
def test_stop_reason(finish, stop, reason):
    s = m.MessageStream("glm", 30)
    msg = m.fold(iter([*s.start(), *s.feed([chat.Delta("content", "x")]), *s.finish(last(finish, stop))]))
    assert (msg["stop_reason"], msg["stop_sequence"]) == (reason, stop)


def test_a_final_assistant_message_is_the_start_of_the_answer():
    body = {"max_tokens": 5, "messages": [{"role": "user", "content": "Name a colour."},
                                          {"role": "assistant", "content": [{"type": "text", "text": "The colour is"}]}]}
    r = m.to_chat(body)
    assert r.messages == [{"role": "user", "content": "Name a colour."}] and r.prefill == "The colour is"
    assert m.to_chat({**body, "messages": body["messages"][:1]}).prefill == ""
    with pytest.raises(chat.ChatError) as e:
        m.to_chat({**body, "thinking": {"type": "enabled", "budget_tokens": 4}})
    assert e.value.param == "thinking"
    with pytest.raises(chat.ChatError) as e:
        m.to_chat({**body, "messages": [body["messages"][0], {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]})
    assert e.value.param == "messages[1].content"

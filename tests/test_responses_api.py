"""responses_api without a server: a Responses request becomes the chat the OpenAI path would render, and the
stream's events build the response its last event carries."""
import pytest

import chat
import engine
import responses_api as r

TOOL = {"type": "function", "name": "get_weather", "description": "Weather by city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def test_items_become_the_same_chat():
    req = r.to_chat({"instructions": "Be brief.", "tools": [TOOL], "max_output_tokens": 40, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                     {"type": "input_text", "text": "Paris?"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Need the tool."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sun"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
        {"role": "user", "content": "Thanks!"}]})
    assert req.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need the tool.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sun"},
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "Thanks!"}]
    assert req.tools == [{"type": "function", "function": {**{k: TOOL[k] for k in ("name", "description", "parameters")},
                                                           "strict": True}}]  # the Responses API's default
    assert r.to_chat({"input": "x", "tools": [{**TOOL, "strict": False}]}).tools[0]["function"]["strict"] is False
    assert req.tool_choice == "auto" and req.options == {"max_tokens": 40}
    assert req.thinking.enabled  # the chat path's default: the template thinks


def test_input_images_become_image_parts():
    image = {"type": "input_image", "image_url": "data:image/png;base64,AA", "detail": "auto"}
    got = r.to_chat({"input": [{"role": "user", "content": [{"type": "input_text", "text": "Describe "}, image]}]})
    assert got.messages[-1]["content"] == [{"type": "text", "text": "Describe "},
                                           {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]
    got = r.to_chat({"input": [{"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
                               {"type": "function_call_output", "call_id": "c1", "output": [image]}]})
    assert got.messages[-1] == {"role": "tool", "tool_call_id": "c1", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}


@pytest.mark.parametrize("effort, enabled, template", [("none", False, "low"), ("minimal", True, "low"),
                                                       ("low", True, "low"), ("high", True, "high"),
                                                       (None, True, "max")])
def test_reasoning_effort(effort, enabled, template):
    t = r.to_chat({"input": "hi", "reasoning": {"effort": effort}}).thinking
    assert (t.enabled, t.effort) == (enabled, template)


BAD = [  # (body, param, code)
    ({}, "input", "invalid_value"),
    ({"input": []}, "input", "invalid_value"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "unsupported"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "invalid_value"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]},
     "input[0].content[0].image_url", "invalid_value"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]},
     "input[0].content[0].type", "unsupported"),
    ({"input": "x", "instructions": [{"type": "input_image", "image_url": "data:,"}]}, "instructions[0].type",
     "unsupported"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "input[0].content[0].text",
     "invalid_value"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "unsupported"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0]", "invalid_value"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id", "invalid_value"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", "unsupported"),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name", "invalid_value"),
    ({"input": "x", "tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
    ({"input": "x", "reasoning": {"effort": "medium"}}, "reasoning.effort", "invalid_value"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "string"}}}},
     "text.format.schema", "unsupported"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format", "unsupported"),
    ({"input": "x", "text": {"format": {"type": "json_object"}}, "tools": [TOOL], "tool_choice": "required"},
     "text.format", "invalid_value"),
    ({"input": "x", "max_output_tokens": "10"}, "max_output_tokens", "invalid_value"),
    ({"input": "x", "text": "json"}, "text.format", "unsupported"),
    ({"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": 1}]}]}, "input[0].summary[0].text",
     "invalid_value"),
]


@pytest.mark.parametrize("body, param, code", BAD)
def test_bad_requests_name_the_field(body, param, code):
    with pytest.raises(chat.ChatError) as e:
        r.to_chat(body)
    assert (e.value.param, e.value.code) == (param, code) and str(e.value).startswith(param)


def last(finish_reason: str) -> engine.RequestOutput:
    return engine.RequestOutput("q", [], "", True, finish_reason, engine.Usage(30, 9, 16, 3))


def test_events_build_the_response():
    s = r.ResponseStream("glm", {"instructions": None})
    call = chat.ToolCall("get_weather", {"city": "Paris"})
    events = [*s.start(), *s.feed([chat.Delta("reasoning", "Need "), chat.Delta("reasoning", "it.")]),
              *s.feed([chat.Delta("content", "Let me "), chat.Delta("content", "check.")]),
              *s.feed([chat.Delta("tool_call", tool_call=call)]), *s.finish(last("stop"))]
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    assert all(e["type"] == n for n, e in events)
    names = [n.removeprefix("response.") for n, _ in events]
    assert names == ["created", "in_progress",
                     "output_item.added", "reasoning_text.delta", "reasoning_text.delta", "reasoning_text.done",
                     "output_item.done",
                     "output_item.added", "content_part.added", "output_text.delta", "output_text.delta",
                     "output_text.done", "content_part.done", "output_item.done",
                     "output_item.added", "function_call_arguments.delta", "function_call_arguments.done",
                     "output_item.done", "completed"]
    resp = events[-1][1]["response"]
    reasoning, message, fc = resp["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Need it."}]
    assert message["content"][0]["text"] == "Let me check." and message["status"] == "completed"
    assert (fc["name"], fc["arguments"], fc["call_id"]) == ("get_weather", '{"city": "Paris"}', call.id)
    assert [e["output_index"] for n, e in events if n == "response.output_item.added"] == [0, 1, 2]
    assert resp["status"] == "completed" and resp["usage"] == {
        "input_tokens": 30, "input_tokens_details": {"cached_tokens": 16}, "output_tokens": 9,
        "output_tokens_details": {"reasoning_tokens": 3}, "total_tokens": 39}


def test_length_is_incomplete():
    s = r.ResponseStream("glm", {})
    events = [*s.start(), *s.feed([chat.Delta("content", "x")]), *s.finish(last("length"))]
    assert events[-1][0] == "response.incomplete"
    assert events[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_json_object_format_is_chat_completions_json_mode():
    req = r.to_chat({"input": "x", "text": {"format": {"type": "json_object"}}})
    assert req.options["response_format"] == {"type": "json_object"}
    assert "response_format" not in r.to_chat({"input": "x", "text": {"format": {"type": "text"}}}).options
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = r.to_chat({"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": schema}}})
    assert req.options["response_format"] == {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}

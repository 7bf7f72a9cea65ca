"""serve.py end to end: the real server on loopback (in a thread), the built-in default model,
the openai client, a table of malformed requests, client disconnects and a concurrent load test."""
import base64
import hashlib
import io
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import openai
import pytest
import requests
import torch

import chat
import default_model
import engine as engine_mod
import jsonmode
import serve
import vision

MAX_MODEL_LEN = 1024


def _digest(path) -> dict:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("glm53-cache")


def test_default_model_is_deterministic_and_in_the_real_layout(cache_dir, tmp_path, fixtures_dir):
    a = default_model.ensure(cache_dir)
    b = default_model.ensure(tmp_path)
    assert a.name == b.name and _digest(a) == _digest(b)
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", "model.safetensors"} <= set(_digest(a))
    assert (a / "chat_template.jinja").read_bytes() == (fixtures_dir / "glm53" / "chat_template.jinja").read_bytes()
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(a / "tokenizer.json"))
    config = json.loads((a / "config.json").read_text())["text_config"]
    assert config["vocab_size"] == tok.get_vocab_size()
    eos = [tok.token_to_id(t) for t in ("<|endoftext|>", "<|user|>", "<|observation|>")]
    assert json.loads((a / "generation_config.json").read_text())["eos_token_id"] == eos
    base = tok.token_to_id("<|endoftext|>")
    # the offsets glm53.md §5.1 confirms: [gMASK] +2, <sop> +4, <|user|> +7, <|observation|> +9, <|image|> +34
    assert [tok.token_to_id(t) - base for t in ("[gMASK]", "<sop>", "<|user|>", "<|observation|>", "<|image|>")] == \
        [2, 4, 7, 9, 34]
    for t in ("<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "<arg_value>", "<tool_response>"):
        assert len(tok.encode(t, add_special_tokens=False).ids) == 1
    text = "Hello, wörld! ✓ def f(x): return x"
    assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text
    from transformers import AutoTokenizer  # the folder also loads as an HF tokenizer with its template
    hf = AutoTokenizer.from_pretrained(str(a))
    assert hf.eos_token_id == eos[0] and len(hf) == tok.get_vocab_size()
    messages = [{"role": "user", "content": "Hi"}]
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        chat.render((a / "chat_template.jinja").read_text(), messages)


@pytest.fixture(scope="module")
def server(cache_dir):
    old = os.environ.get("GLM53_CACHE")
    os.environ["GLM53_CACHE"] = str(cache_dir)
    t0 = time.monotonic()
    srv = serve.Server(serve.parse_args(["--port", "0", "--max-model-len", str(MAX_MODEL_LEN)]))
    srv.serve_in_thread()
    loader = threading.Thread(target=srv.load, daemon=True)
    loader.start()
    srv.loading_health = requests.get(f"http://127.0.0.1:{srv.port}/health", timeout=10)
    loader.join(timeout=120)
    assert srv.ready.is_set(), srv.load_error
    print(f"\nserver ready {time.monotonic() - t0:.2f} s after start (model already built)")
    yield srv
    srv.shutdown()
    if old is None:
        os.environ.pop("GLM53_CACHE")
    else:
        os.environ["GLM53_CACHE"] = old


@pytest.fixture(scope="module")
def url(server):
    return f"http://127.0.0.1:{server.port}"


@pytest.fixture(scope="module")
def client(url):
    import openai
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def metrics(url, headers=None) -> dict[str, float]:
    out = {}
    for line in requests.get(url + "/metrics", timeout=30, headers=headers).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def prompt_len(server, messages, tools=None, effort=None) -> int:
    text = chat.render(server.engine.chat_template, chat.normalize_messages(messages), tools,
                       chat.resolve_thinking(effort))
    return len(server.engine.tokenizer.encode(text, add_special_tokens=False).ids)


HI = [{"role": "user", "content": "Hi, who are you?"}]


def test_health_loading_then_ready_and_models(server, url, client):
    assert server.loading_health.status_code == 503 and server.loading_health.json()["status"] == "loading"
    assert requests.get(url + "/health", timeout=10).json()["status"] == "ok"
    assert [m.id for m in client.models.list().data] == [default_model.NAME]
    card = client.models.retrieve(default_model.NAME)
    assert (card.id, card.model_extra["max_model_len"]) == (default_model.NAME, MAX_MODEL_LEN)
    r = requests.get(url + "/v1/models/org/other-model", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_chat_thinking_on_greedy_stream_matches_nonstream(server, client):
    r = client.chat.completions.create(model=default_model.NAME, messages=HI, max_tokens=12, temperature=0)
    c = r.choices[0]
    assert r.usage.prompt_tokens == prompt_len(server, HI) and r.usage.completion_tokens <= 12
    assert c.finish_reason in ("stop", "length")
    reasoning = c.message.model_extra.get("reasoning_content")
    if c.finish_reason == "length" and c.message.content is None:
        assert reasoning  # the answer starts inside <think>: text before </think> is reasoning
    chunks = list(client.chat.completions.create(model=default_model.NAME, messages=HI, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed_reasoning = "".join(ch.choices[0].delta.model_extra.get("reasoning_content") or ""
                                 for ch in chunks if ch.choices)
    streamed_content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices).strip()
    assert streamed_reasoning == (reasoning or "") and streamed_content == (c.message.content or "")
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == c.finish_reason
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_chat_thinking_off_closes_think_and_answers_in_content(server, client):
    r = client.chat.completions.create(model=default_model.NAME, messages=HI, max_tokens=10, temperature=0,
                                       logprobs=True, extra_body={"reasoning_effort": "none"})
    c = r.choices[0]
    assert r.usage.prompt_tokens == prompt_len(server, HI, effort="none") == prompt_len(server, HI, effort="low") + 1
    assert c.message.model_extra.get("reasoning_content") is None
    tokens = "".join(t.token for t in c.logprobs.content)
    if c.finish_reason == "length":
        assert (c.message.content or "") == tokens.strip()


def test_chat_logprobs_are_the_models_distribution(server, url, client):
    r = client.chat.completions.create(model=default_model.NAME, messages=HI, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=3)
    lps = r.choices[0].logprobs.content
    assert len(lps) == r.usage.completion_tokens
    for t in lps:
        assert len(t.top_logprobs) == 3
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-5)  # greedy takes the argmax
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token
    stream = list(client.chat.completions.create(model=default_model.NAME, messages=HI, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = [t for ch in stream if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in lps]
    # the first token's distribution is the scoring endpoint's last row for the same prompt
    ids = server.engine.tokenizer.encode(chat.render(server.engine.chat_template, chat.normalize_messages(HI)),
                                         add_special_tokens=False).ids
    s = requests.post(url + "/v1/score", json={"token_ids": ids, "top_k": 3}, timeout=60).json()
    assert s["positions"][-1]["top_logprobs"] == pytest.approx([x.logprob for x in lps[0].top_logprobs], abs=1e-4)


def test_completions_stream_and_logprobs(server, client):
    r = client.completions.create(model=default_model.NAME, prompt="def parse(args):", max_tokens=6, temperature=0,
                                  logprobs=2)
    c = r.choices[0]
    assert len(c.logprobs.tokens) == r.usage.completion_tokens == len(c.logprobs.top_logprobs)
    assert all(len(t) == 2 for t in c.logprobs.top_logprobs)
    streamed = list(client.completions.create(model=default_model.NAME, prompt="def parse(args):", max_tokens=6,
                                              temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == c.text
    ids = server.engine.tokenizer.encode("def parse(args):", add_special_tokens=False).ids
    by_ids = client.completions.create(model=default_model.NAME, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == c.text


def test_score_full_vocabulary(server, url):
    ids = server.engine.tokenizer.encode("The quick brown fox jumps.", add_special_tokens=False).ids
    s = requests.post(url + "/v1/score", json={"token_ids": ids, "top_k": 4, "full": True}, timeout=60).json()
    full = np.frombuffer(base64.b64decode(s["full_logprobs"]["data"]), "<f4").reshape(s["full_logprobs"]["shape"])
    assert full.shape == (len(ids), server.engine.vocab_size)
    assert np.allclose(np.log(np.exp(full.astype(np.float64)).sum(-1)), 0, atol=1e-4)
    for t, row in enumerate(s["positions"]):
        # the 4 largest, in order (bf16 logits on a GPU tie often: which of tied ids comes first is not fixed)
        top = row["top_ids"]
        assert len(set(top)) == 4 and full[t, top].tolist() == np.sort(full[t])[::-1][:4].tolist()
        assert row["rest_mass"] == pytest.approx(1 - np.exp(full[t, top].astype(np.float64)).sum(), abs=1e-5)
        if t + 1 < len(ids):
            assert row["token_logprob"] == pytest.approx(float(full[t, ids[t + 1]]), abs=1e-5)


# --- tool calls: the model is random, so its sampled tokens are forced to a script --------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
SCRIPT = ("Need the weather.</think>\nLet me check.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris"
          "</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>")


@pytest.fixture
def scripted(server, monkeypatch):
    """Replace only the sampler's choice: the forward, cache, detokenizer, stops and parser are real."""
    tok = server.engine.tokenizer

    def use(text: str):
        ids = tok.encode(text, add_special_tokens=False).ids + [tok.token_to_id("<|observation|>")]
        monkeypatch.setattr(engine_mod, "draw_on_device", lambda logits, params, prompts, outs, gens, kernel:
                            torch.tensor([ids[min(len(out), len(ids) - 1)] for out in outs], device=logits.device))
    return use


def test_tool_call_nonstream_and_stream(server, client, scripted):
    scripted(SCRIPT)
    q = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    r = client.chat.completions.create(model=default_model.NAME, messages=q, tools=[WEATHER, CLOCK], max_tokens=200)
    c = r.choices[0]
    assert r.usage.prompt_tokens == prompt_len(server, q, tools=[WEATHER, CLOCK])
    assert c.finish_reason == "tool_calls"
    assert c.message.model_extra["reasoning_content"] == "Need the weather."
    assert c.message.content == "Let me check."
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "days": 3}

    chunks = list(client.chat.completions.create(model=default_model.NAME, messages=q, tools=[WEATHER, CLOCK],
                                                 max_tokens=200, stream=True))
    calls = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == \
        [(0, "get_weather", {"city": "Paris", "days": 3})]
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert text == "Let me check." and "<" not in text
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


REASONING = "First list the options, then weigh each one, then pick the best and say why."


def test_thinking_token_budget_closes_reasoning_on_every_api(server, url, client, scripted, monkeypatch):
    """After the budget's tokens of reasoning the engine forces </think> in place of the sampled token and the
    rest is the answer: the request's budget (thinking_token_budget; Anthropic's thinking.budget_tokens), or
    else the server's --thinking-token-budget."""
    tok = server.engine.tokenizer
    scripted(REASONING)  # the model never closes its reasoning (content starts after its spaces, as chat.py does)
    ids = tok.encode(REASONING, add_special_tokens=False).ids
    q = [{"role": "user", "content": "Which option?"}]
    r = client.chat.completions.create(model=default_model.NAME, messages=q, max_tokens=100,
                                       extra_body={"thinking_token_budget": 4})
    m = r.choices[0].message
    assert (m.model_extra["reasoning_content"], m.content) == (tok.decode(ids[:4]), tok.decode(ids[5:]).lstrip())
    assert r.usage.completion_tokens == len(ids) + 1  # 4, </think>, ids[5:], <|observation|>
    assert r.usage.completion_tokens_details.reasoning_tokens == 4
    status, msg, _ = post_messages(url, {"max_tokens": 100, "messages": q,
                                         "thinking": {"type": "enabled", "budget_tokens": 6}})
    assert status == 200 and [b["type"] for b in msg["content"]] == ["thinking", "text"], msg
    assert (msg["content"][0]["thinking"], msg["content"][1]["text"]) == \
        (tok.decode(ids[:6]), tok.decode(ids[7:]).lstrip())
    monkeypatch.setattr(server.args, "thinking_token_budget", 2)
    r = client.chat.completions.create(model=default_model.NAME, messages=q, max_tokens=100)
    assert r.choices[0].message.model_extra["reasoning_content"] == tok.decode(ids[:2])
    resp = client.responses.create(model=default_model.NAME, input=q, max_output_tokens=100)
    assert resp.output[0].content[0].text == tok.decode(ids[:2]) and resp.output_text == tok.decode(ids[3:]).lstrip()
    assert resp.usage.output_tokens_details.reasoning_tokens == 2
    r = client.chat.completions.create(model=default_model.NAME, messages=q, max_tokens=100,
                                       extra_body={"thinking_token_budget": 5})  # the request's budget wins
    assert r.choices[0].message.model_extra["reasoning_content"] == tok.decode(ids[:5])


def test_the_thinking_token_budget_flag_is_checked(capsys):
    assert serve.parse_args(["--thinking-token-budget", "0"]).thinking_token_budget == 0
    with pytest.raises(SystemExit):
        serve.parse_args(["--thinking-token-budget", "-1"])
    assert "--thinking-token-budget must be >= 0; got -1" in capsys.readouterr().err


def test_logit_bias(server, client):
    tok = server.engine.tokenizer
    t = tok.encode(" the", add_special_tokens=False).ids[0]
    r = client.completions.create(model=default_model.NAME, prompt="The", max_tokens=3, temperature=0,
                                  logit_bias={str(t): 100})
    assert r.choices[0].text == tok.decode([t] * 3)
    free = client.completions.create(model=default_model.NAME, prompt="The", max_tokens=1, temperature=0)
    first = tok.encode(free.choices[0].text, add_special_tokens=False).ids[0]
    banned = client.completions.create(model=default_model.NAME, prompt="The", max_tokens=1, temperature=0,
                                       logit_bias={str(first): -100})
    assert tok.encode(banned.choices[0].text, add_special_tokens=False).ids[0] != first


def test_truncate_prompt_tokens_keeps_the_prompts_end(server, client):
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens are the prompt (echo shows them)."""
    tok = server.engine.tokenizer
    ids = tok.encode("The quick brown fox jumps over the lazy dog and runs away", add_special_tokens=False).ids
    kw = dict(model=default_model.NAME, max_tokens=4, temperature=0)
    r = client.completions.create(prompt=tok.decode(ids), echo=True, extra_body={"truncate_prompt_tokens": 5}, **kw)
    same = client.completions.create(prompt=ids[-5:], **kw)
    assert r.usage.prompt_tokens == 5 and r.choices[0].text == tok.decode(ids[-5:]) + same.choices[0].text
    r = client.chat.completions.create(messages=HI, extra_body={"truncate_prompt_tokens": 3}, **kw)
    assert r.usage.prompt_tokens == 3
    # a chat prompt longer than the context fits once cut (its length is checked after the cut)
    long_chat = [{"role": "user", "content": "word " * (MAX_MODEL_LEN + 10)}]
    r = client.chat.completions.create(messages=long_chat, extra_body={"truncate_prompt_tokens": 8}, **kw)
    assert r.usage.prompt_tokens == 8
    whole = client.completions.create(prompt=ids, extra_body={"truncate_prompt_tokens": -1}, **kw)
    assert whole.usage.prompt_tokens == len(ids)


def test_allowed_token_ids(server, client):
    """vLLM's allowed_token_ids: every token drawn is one of them."""
    tok = server.engine.tokenizer
    allowed = [tok.encode(w, add_special_tokens=False).ids[0] for w in (" the", " a", " of")]
    r = client.completions.create(model=default_model.NAME, prompt="The", max_tokens=8, temperature=1.0, seed=0,
                                  extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
    assert set(tok.encode(r.choices[0].text, add_special_tokens=False).ids) <= set(allowed), r.choices[0].text


def test_stop_token_ids_end_the_answer_without_their_text(server, client):
    """vLLM's stop_token_ids: the token ends the answer ("stop"), counted but not written."""
    tok = server.engine.tokenizer
    the, a = (tok.encode(w, add_special_tokens=False).ids[0] for w in (" the", " a"))
    kw = dict(model=default_model.NAME, prompt="The", max_tokens=3, temperature=0, logit_bias={str(the): 100})
    r = client.completions.create(**kw, extra_body={"stop_token_ids": [a, the]})
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == ("", "stop", 1)
    r = client.completions.create(**kw, extra_body={"stop_token_ids": [a]})
    assert (r.choices[0].text, r.choices[0].finish_reason) == (tok.decode([the] * 3), "length")
    r = client.chat.completions.create(model=default_model.NAME, messages=HI, max_tokens=3, temperature=0,
                                       reasoning_effort="none", logit_bias={str(the): 100},
                                       extra_body={"stop_token_ids": [the]})
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (None, "stop")


def test_min_tokens_and_include_stop_str_in_output(server, client):
    """vLLM's min_tokens: no stop token (eos here, made the most likely token) before that many tokens; its
    include_stop_str_in_output: the stop string stays in the text."""
    eos = sorted(server.engine.eos_token_ids)[0]
    kw = dict(model=default_model.NAME, prompt="The", max_tokens=8, temperature=0)
    r = client.completions.create(**kw, logit_bias={str(eos): 100})
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == ("", "stop", 1)
    r = client.completions.create(**kw, logit_bias={str(eos): 100}, extra_body={"min_tokens": 3})
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("stop", 4) and r.choices[0].text
    text = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text
    stop = text[2:4]
    r = client.completions.create(**kw, stop=[stop], extra_body={"ignore_eos": True,
                                                               "include_stop_str_in_output": True})
    assert r.choices[0].text == text[:text.index(stop) + len(stop)] and r.choices[0].finish_reason == "stop"


def test_continue_final_message_goes_on_from_the_assistants_text(server, client):
    """vLLM's continue_final_message: the prompt is the messages before the final assistant one, a closed think
    block and that message's text; the answer is what follows (greedy: what the same prompt's ids give)."""
    msgs = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once upon a"}]
    r = client.chat.completions.create(model=default_model.NAME, messages=msgs, max_tokens=6, temperature=0,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False})
    text = chat.render(server.engine.chat_template, chat.normalize_messages(msgs[:1]), None,
                       chat.Thinking(enabled=False, effort="max")) + "Once upon a"
    ids = server.engine.tokenizer.encode(text, add_special_tokens=False).ids
    same = client.completions.create(model=default_model.NAME, prompt=ids, max_tokens=6, temperature=0)
    assert r.usage.prompt_tokens == len(ids) and r.choices[0].message.content == same.choices[0].text


def png_data_url(seed: int, size: tuple[int, int] = (90, 60)) -> str:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


@pytest.fixture
def seeing(server, monkeypatch):
    """The default model with a random vision tower of its hidden size (it has none): the plumbing of images."""
    import tiny

    eng = server.engine
    tower = tiny.random_vision_tower(eng.config.hidden_size, eng.tokenizer.token_to_id("<|image|>"), eng.device,
                                     eng.dtype)
    monkeypatch.setattr(eng, "vision", tower)
    return tower


def test_images_through_the_three_apis(server, url, client, seeing):
    """An image part (OpenAI's image_url, Anthropic's image block, the Responses API's input_image) is decoded by
    the server and counted as its tokens; one that cannot be read is a 400 naming it."""
    import anthropic

    image = png_data_url(0)
    n = vision.prepare(image, seeing.cfg).tokens
    text = [{"role": "user", "content": "What is this?"}]
    with_image = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                               {"type": "image_url", "image_url": {"url": image}}]}]
    kw = dict(model=default_model.NAME, max_tokens=4, temperature=0, reasoning_effort="none")
    plain, seen = (client.chat.completions.create(messages=m, **kw) for m in (text, with_image))
    extra = len(server.engine.tokenizer.encode("<|begin_of_image|><|image|><|end_of_image|>",
                                               add_special_tokens=False).ids) - 1
    assert seen.usage.prompt_tokens == plain.usage.prompt_tokens + extra + n and n == 20
    tokenized = requests.post(url + "/tokenize", json={"model": default_model.NAME, "messages": with_image,
                                                       "reasoning_effort": "none"}, timeout=30).json()
    assert tokenized["count"] == len(tokenized["tokens"]) == seen.usage.prompt_tokens
    ids, image_id = tokenized["tokens"], server.engine.vision.image_token_id
    at = ids.index(image_id)
    assert ids[at:at + n] == [image_id] * n and ids.count(image_id) == n  # written out, as the model reads it
    a = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": image.split(",")[1]}}
    msg = a.messages.create(model=default_model.NAME, max_tokens=4, messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, block]}])
    assert msg.usage.input_tokens == a.messages.count_tokens(model=default_model.NAME, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, block]}]).input_tokens

    def result(content) -> list[dict]:  # a conversation whose tool returned `content`
        return [{"role": "user", "content": "Look."}, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": content}]}]

    counted = [a.messages.count_tokens(model=default_model.NAME, messages=result(c)).input_tokens
               for c in ([{"type": "text", "text": "x"}], [{"type": "text", "text": "x"}, block])]
    assert counted[1] == counted[0] + extra + n  # an image in a tool's result is read
    resp = client.responses.create(model=default_model.NAME, max_output_tokens=4, reasoning={"effort": "none"},
                                   input=[{"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                                                       {"type": "input_image", "image_url": image}]}])
    assert resp.usage.input_tokens == seen.usage.prompt_tokens
    bad = requests.post(url + "/v1/chat/completions", timeout=30, json={"model": default_model.NAME, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {
            "url": "data:image/png;base64,AAAA"}}]}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[0].content[1]"
    assert "could not be decoded" in bad.json()["error"]["message"]
    cut = requests.post(url + "/v1/chat/completions", timeout=30, json={"model": default_model.NAME,
                                                                       "messages": with_image,
                                                                       "truncate_prompt_tokens": 5})
    assert cut.status_code == 400 and cut.json()["error"]["param"] == "truncate_prompt_tokens"


def test_tokenize_and_detokenize(server, url, client):
    post = lambda path, body: requests.post(url + path, json=body, timeout=30)
    ids = server.engine.tokenizer.encode("Hello there, wörld", add_special_tokens=False).ids
    assert post("/tokenize", {"prompt": "Hello there, wörld"}).json() == \
        {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids}
    assert post("/detokenize", {"tokens": ids}).json() == {"prompt": "Hello there, wörld"}
    q = [{"role": "user", "content": "Weather in Oslo?"}]
    r = post("/tokenize", {"messages": q, "tools": [WEATHER], "reasoning_effort": "low"}).json()
    assert r["count"] == prompt_len(server, q, [WEATHER], "low") == client.chat.completions.create(
        model=default_model.NAME, messages=q, tools=[WEATHER], reasoning_effort="low", max_tokens=1).usage.prompt_tokens
    assert post("/detokenize", {"tokens": r["tokens"]}).json()["prompt"].endswith("<|assistant|><think>")
    for path, body, param in (("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": ["a", "b"]}, "prompt"),
                              ("/tokenize", {"messages": []}, "messages"),
                              ("/detokenize", {"tokens": [10**9]}, "tokens"),
                              ("/detokenize", {"tokens": "x"}, "tokens")):
        r = post(path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)


def test_completions_echo_scores_the_prompt_as_lm_eval_asks(server, url, client):
    """lm-eval's loglikelihood request (token ids, echo, logprobs 1, max_tokens 0 or 1, temperature 0) gets every
    prompt token's logprob (the first null), the same as /v1/score's, then the generated token's."""
    ids = server.engine.tokenizer.encode("The quick brown fox jumps over", add_special_tokens=False).ids
    score = requests.post(url + "/v1/score", json={"token_ids": ids, "top_k": 2}, timeout=30).json()["positions"]
    for max_tokens in (0, 1):
        r = requests.post(url + "/v1/completions", json={"prompt": [ids], "echo": True, "logprobs": 2, "temperature": 0,
                                                          "max_tokens": max_tokens}, timeout=30).json()
        (c,) = r["choices"]
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(ids) + max_tokens, r
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][1:len(ids)] == pytest.approx([p["token_logprob"] for p in score[:-1]], abs=1e-6)
        assert [v for t in lp["top_logprobs"][1:len(ids)] for v in sorted(t.values(), reverse=True)] == \
            pytest.approx([v for p in score[:-1] for v in p["top_logprobs"]], abs=1e-6)
        assert c["text"].startswith("The quick brown fox jumps over") and r["usage"]["completion_tokens"] == max_tokens
    plain = client.completions.create(model=default_model.NAME, prompt="Once upon", max_tokens=4, temperature=0)
    echoed = client.completions.create(model=default_model.NAME, prompt="Once upon", max_tokens=4, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == "Once upon" + plain.choices[0].text and echoed.choices[0].logprobs is None
    streamed = list(client.completions.create(model=default_model.NAME, prompt="Once upon", max_tokens=4,
                                              temperature=0, echo=True, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == echoed.choices[0].text
    assert streamed[0].choices[0].text.startswith("Once upon")


def test_structured_outputs_choice_regex_and_json(server, client):
    """vLLM's structured_outputs (and the guided_* fields it replaced): a choice's answer is one of its strings, a
    regex's matches it whole, a json's is an object of the schema."""
    kw = dict(model=default_model.NAME, messages=[{"role": "user", "content": "Is it?"}], max_tokens=16,
              temperature=1.0, reasoning_effort="none")
    choices = ["yes", "no", "not sure"]
    for body in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        got = [client.chat.completions.create(**kw, seed=s, extra_body=body).choices[0] for s in range(4)]
        assert all(c.message.content in choices and c.finish_reason == "stop" for c in got), got
    source = r"[A-Z][a-z]{1,6}, \d{2}"
    for body in ({"structured_outputs": {"regex": source}}, {"guided_regex": source}):
        r = client.completions.create(model=default_model.NAME, prompt="Name, age:", max_tokens=16, temperature=1.0,
                                      seed=1, extra_body=body)
        assert r.choices[0].finish_reason == "stop" and re.fullmatch(source, r.choices[0].text), r.choices[0].text
    shape = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}
    for body in ({"structured_outputs": {"json": shape}}, {"guided_json": json.dumps(shape)}):
        tok = server.engine.tokenizer
        braces = {str(tok.token_to_id("{")): 100, str(tok.token_to_id("}")): 100}
        text = client.chat.completions.create(**{**kw, "max_tokens": 40}, seed=0, logit_bias=braces,
                                              extra_body=body).choices[0].message.content
        assert jsonmode.JsonPrefix(jsonmode.object_schema(shape)).feed((text or "").encode()), text


def test_json_mode(server, client):
    """response_format json_object: the answer is a JSON object, and the request stops when it is complete."""
    tok = server.engine.tokenizer
    braces = {str(tok.token_to_id("{")): 100, str(tok.token_to_id("}")): 100}
    kw = dict(model=default_model.NAME, messages=[{"role": "user", "content": "Reply in JSON."}],
              response_format={"type": "json_object"}, reasoning_effort="none")
    r = client.chat.completions.create(max_tokens=20, temperature=0, logit_bias=braces, **kw)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("{}", "stop")
    for seed in range(3):
        c = client.chat.completions.create(max_tokens=30, temperature=1.0, seed=seed, **kw).choices[0]
        assert jsonmode.JsonPrefix().feed((c.message.content or "").encode()), c.message.content
        assert c.finish_reason == "length" or isinstance(json.loads(c.message.content), dict)
    shape = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": shape, "strict": True}}
    texts = [client.chat.completions.create(max_tokens=40, temperature=1.0, seed=seed, logit_bias=braces,
                                            **{**kw, "response_format": fmt}).choices[0].message.content
             for seed in range(3)]
    assert all(jsonmode.JsonPrefix(jsonmode.object_schema(shape)).feed((t or "").encode()) for t in texts), texts
    resp = client.responses.create(model=default_model.NAME, input="Reply in JSON.", max_output_tokens=40,
                                   temperature=0, reasoning={"effort": "none"},
                                   text={"format": {"type": "json_schema", "name": "answer", "schema": shape}})
    assert jsonmode.JsonPrefix(jsonmode.object_schema(shape)).feed(resp.output_text.encode()), resp.output_text
    # the openai client's parse() with a pydantic model ($defs, $ref, anyOf for Optional and for a Union of models,
    # oneOf for a discriminated one, bounds, lengths, a Literal of numbers, a pattern, a date, a URL with a length),
    # read back and validated by the client through pydantic
    import datetime
    import typing

    import pydantic

    class Owner(pydantic.BaseModel):
        id: int = pydantic.Field(ge=1, le=99)

    class Cat(pydantic.BaseModel):
        kind: typing.Literal["cat"]

    class Dog(pydantic.BaseModel):
        kind: typing.Literal["dog"]
        good: bool

    class Pet(pydantic.BaseModel):
        name: str = pydantic.Field(min_length=1, max_length=12)
        legs: typing.Literal[2, 4]
        weight: float = pydantic.Field(gt=0, lt=100)
        tags: list[str] = pydantic.Field(min_length=1, max_length=3)
        code: str = pydantic.Field(pattern=r"^[A-Z]{2}\d{2}$")
        born: datetime.date
        owner: Owner | None
        friend: Cat | Dog

    class Visit(pydantic.BaseModel):
        pet: typing.Annotated[Cat | Dog, pydantic.Field(discriminator="kind")]
        site: typing.Annotated[pydantic.AnyUrl, pydantic.networks.UrlConstraints(max_length=24)]

    # The small model likes whitespace (32 bytes in a row at every turn): whitespace-only tokens pushed down. It
    # may also write a number's digits or a string's characters until max_tokens: an answer cut short is not an
    # invalid one, and pydantic validates every one that ends.
    spaces = {str(i): -100 for i in range(tok.get_vocab_size()) if engine_mod.token_bytes(tok, i).isspace()}
    for model in (Pet, Visit):
        parsed = 0
        for seed in range(4):
            try:
                r = client.chat.completions.parse(model=default_model.NAME, response_format=model,
                                                  messages=[{"role": "user", "content": "A pet as JSON."}],
                                                  reasoning_effort="none", max_tokens=400, temperature=0.7, seed=seed,
                                                  logit_bias=spaces)
            except openai.LengthFinishReasonError:
                continue
            assert r.choices[0].finish_reason == "stop" and isinstance(r.choices[0].message.parsed, model)
            parsed += 1
        assert parsed >= 1, model
    schema = "response_format.json_schema.schema"
    for extra, param in (({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, schema),
                         ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                             "type": "object", "properties": {"a": {"type": "string", "format": "iri"}}}}}}, schema),
                         ({"tools": [CLOCK], "tool_choice": "required"}, "response_format")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(max_tokens=5, **{**kw, **extra})
        assert e.value.body["param"] == param, e.value.body


def test_usage_counts_the_prompt_once_and_reports_drafts_when_the_engine_speculates():
    out = engine_mod.RequestOutput("r", [], "", True, "stop", engine_mod.Usage(20, 9, 16, 4))
    assert serve._usage([out]) == {"prompt_tokens": 20, "completion_tokens": 9, "total_tokens": 29,
                                   "prompt_tokens_details": {"cached_tokens": 16},
                                   "completion_tokens_details": {"reasoning_tokens": 4}}
    out.acceptance = engine_mod.Acceptance(verify_steps=4, draft_tokens=12, accepted_tokens=5)
    assert serve._usage([out])["speculative"] == {"verify_steps": 4, "draft_tokens": 12, "accepted_tokens": 5,
                                                  "mean_accepted_length": 2.25}
    other = engine_mod.RequestOutput("s", [], "", True, "length", engine_mod.Usage(20, 6, 20, 1),
                                     acceptance=engine_mod.Acceptance(2, draft_tokens=4, accepted_tokens=3))
    u = serve._usage([out, other])  # two choices of one request
    assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (20, 15, 35)
    assert u["prompt_tokens_details"] == {"cached_tokens": 16}
    b = serve._usage([out, other, other, out], 2)  # a batch of two prompts, two choices each
    assert (b["prompt_tokens"], b["completion_tokens"], b["prompt_tokens_details"]["cached_tokens"]) == (40, 30, 36)
    assert u["completion_tokens_details"]["reasoning_tokens"] == 5
    assert u["speculative"] == {"verify_steps": 6, "draft_tokens": 16, "accepted_tokens": 8,
                                "mean_accepted_length": round(14 / 6, 4)}


def test_n_choices_chat_and_completions_whole_and_streamed(server, client):
    """n samples n sequences: a seeded request's choice i is the same request with seed + i, alone."""
    q = [{"role": "user", "content": "Name a colour."}]
    kw = dict(model=default_model.NAME, messages=q, max_tokens=8, temperature=1.0, seed=11, reasoning_effort="none")
    r = client.chat.completions.create(n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    alone = [client.chat.completions.create(**{**kw, "seed": 11 + i}) for i in range(3)]
    assert [c.message.content for c in r.choices] == [a.choices[0].message.content for a in alone]
    assert r.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    chunks = list(client.chat.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **kw))
    for i in range(3):
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == r.choices[i].finish_reason
        assert ("".join(c.delta.content or "" for c in mine).strip() or None) == r.choices[i].message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    ckw = dict(model=default_model.NAME, prompt="Once upon", max_tokens=5, temperature=1.0, seed=5)
    c = client.completions.create(n=2, **ckw)
    assert [x.text for x in c.choices] == [client.completions.create(**{**ckw, "seed": 5 + i}).choices[0].text
                                           for i in range(2)]
    streamed = list(client.completions.create(n=2, stream=True, **ckw))
    assert ["".join(ch.choices[0].text for ch in streamed if ch.choices[0].index == i) for i in range(2)] == \
        [x.text for x in c.choices]


def test_a_batch_of_prompts_is_each_prompt_alone(server, url, client):
    """/v1/completions with an array of prompts (text or ids, as lm-eval batches them): choice p * n + i is prompt p's
    choice i alone, whole and streamed; the usage adds every prompt's tokens; echo scores each prompt."""
    tok = server.engine.tokenizer
    texts = ["Once upon", "The quick brown fox", "A"]
    ckw = dict(model=default_model.NAME, max_tokens=5, temperature=1.0, seed=7, logprobs=2)
    r = client.completions.create(prompt=texts, n=2, **ckw)
    alone = [client.completions.create(prompt=t, n=2, **ckw) for t in texts]
    assert [c.index for c in r.choices] == list(range(6))
    want = [c for a in alone for c in a.choices]
    assert [c.text for c in r.choices] == [c.text for c in want]
    for c, w in zip(r.choices, want):
        assert c.logprobs.tokens == w.logprobs.tokens
        assert c.logprobs.token_logprobs == pytest.approx(w.logprobs.token_logprobs, abs=1e-4)
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone) == \
        sum(len(tok.encode(t, add_special_tokens=False).ids) for t in texts)
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    streamed = list(client.completions.create(prompt=texts, n=2, stream=True, stream_options={"include_usage": True},
                                              **ckw))
    assert ["".join(ch.choices[0].text for ch in streamed if ch.choices and ch.choices[0].index == k)
            for k in range(6)] == [c.text for c in r.choices]
    assert streamed[-1].usage.prompt_tokens == r.usage.prompt_tokens
    echoed = list(client.completions.create(prompt=texts, n=2, stream=True, echo=True, **ckw))
    assert ["".join(ch.choices[0].text for ch in echoed if ch.choices[0].index == k) for k in range(6)] == \
        [texts[k // 2] + c.text for k, c in enumerate(r.choices)]
    ids = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    for max_tokens in (0, 1):  # lm-eval's loglikelihood batch: token ids, echo, logprobs 1
        body = {"echo": True, "logprobs": 1, "temperature": 0, "max_tokens": max_tokens}
        got = requests.post(url + "/v1/completions", json={"prompt": ids, **body}, timeout=60).json()
        for p, c in enumerate(got["choices"]):
            (one,) = requests.post(url + "/v1/completions", json={"prompt": ids[p], **body}, timeout=60).json()["choices"]
            assert c["index"] == p and c["text"] == one["text"] and c["text"].startswith(texts[p])
            assert c["logprobs"]["tokens"] == one["logprobs"]["tokens"]
            assert c["logprobs"]["token_logprobs"] == pytest.approx(one["logprobs"]["token_logprobs"], abs=1e-4)
        assert got["usage"]["prompt_tokens"] == sum(map(len, ids))


def test_tool_choice_none_renders_no_tools(server, client, scripted):
    q = [{"role": "user", "content": "What time is it?"}]
    scripted(SCRIPT)
    r = client.chat.completions.create(model=default_model.NAME, messages=q, tools=[WEATHER], tool_choice="none",
                                       max_tokens=200)
    assert r.usage.prompt_tokens == prompt_len(server, q)  # no tools block in the prompt
    assert r.choices[0].message.tool_calls is None and "<tool_call>get_weather" in r.choices[0].message.content


STRICT = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Oslo", "Paris"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
NOW = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {},
                                                                           "additionalProperties": False}}}


def held_call(name: str, args: dict) -> bool:
    """A call as the held tools allow it (STRICT, NOW)."""
    if name == "get_time":
        return args == {}
    return name == "get_weather" and set(args) == {"city", "days"} and args["city"] in ("Oslo", "Paris") and \
        type(args["days"]) is int and 1 <= args["days"] <= 7


def test_forced_tool_calls_are_held_to_their_schemas_on_every_api(server, url, client):
    """tool_choice "required" or a named function: the answer starts with <tool_call> and the engine holds the
    calls to the tools' schemas (toolmode.py), whatever the model would write; one call where parallel calls
    are off."""
    q = [{"role": "user", "content": "What time is it?"}]
    r = client.chat.completions.create(model=default_model.NAME, messages=q, tools=[STRICT, NOW], max_tokens=20,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert r.usage.prompt_tokens == prompt_len(server, q, tools=[STRICT, NOW], effort="none") + 1  # <tool_call>
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments, r.choices[0].finish_reason) == ("get_time", "{}", "tool_calls")
    for seed in range(3):
        kw = dict(model=default_model.NAME, messages=q, tools=[STRICT, NOW], tool_choice="required", max_tokens=40,
                  seed=seed, parallel_tool_calls=False)
        r = client.chat.completions.create(**kw)
        (call,) = r.choices[0].message.tool_calls
        assert held_call(call.function.name, json.loads(call.function.arguments)), call
        assert r.choices[0].message.content is None and r.choices[0].message.model_extra["reasoning_content"] is None
        streamed = [tc for ch in client.chat.completions.create(**kw, stream=True)
                    for tc in (ch.choices[0].delta.tool_calls or [])]
        assert [(tc.function.name, tc.function.arguments) for tc in streamed] == \
            [(call.function.name, call.function.arguments)]  # (seeded: the same call)
    # (greedy from here: these APIs take no seed, and a draw may spend 40 tokens on the whitespace a value allows)
    status, msg, _ = post_messages(url, {"max_tokens": 40, "temperature": 0, "messages": q, "tools": [
        {"name": f["function"]["name"], "input_schema": f["function"]["parameters"]} for f in (STRICT, NOW)],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True}})
    assert status == 200 and msg["stop_reason"] == "tool_use", msg
    (tool,) = msg["content"]
    assert tool["type"] == "tool_use" and held_call(tool["name"], tool["input"]), msg
    r = client.responses.create(model=default_model.NAME, input=q, tools=[{"type": "function", **f["function"]}
                                                                          for f in (STRICT, NOW)],
                                tool_choice="required", parallel_tool_calls=False, max_output_tokens=40, temperature=0)
    assert [o.type for o in r.output] == ["function_call"] and r.parallel_tool_calls is False
    assert held_call(r.output[0].name, json.loads(r.output[0].arguments)), r.output
    # parallel calls (the default): one or more, each held
    r = client.chat.completions.create(model=default_model.NAME, messages=q, tools=[STRICT, NOW],
                                       tool_choice="required", max_tokens=100, seed=5)
    calls = r.choices[0].message.tool_calls or []
    assert all(held_call(c.function.name, json.loads(c.function.arguments)) for c in calls)
    assert calls or r.choices[0].finish_reason == "length"
    # a schema the engine cannot hold is a 400 naming it, where a call is forced; with "auto" it is only rendered
    odd = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "object", "patternProperties": {"^a": {}}}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=default_model.NAME, messages=q, tools=[NOW, odd], tool_choice="required")
    assert e.value.body["param"] == "tools[1].function.parameters.properties.x"
    assert "patternProperties" in e.value.body["message"]
    client.chat.completions.create(model=default_model.NAME, messages=q, tools=[NOW, odd], max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:  # strict: held under "auto" too
        client.chat.completions.create(model=default_model.NAME, messages=q, max_tokens=2, tools=[
            NOW, {"type": "function", "function": {**odd["function"], "strict": True}}])
    assert e.value.body["param"] == "tools[1].function.parameters.properties.x"


def test_strict_tools_hold_their_calls_under_auto(server, client, monkeypatch):
    """tool_choice "auto": the answer may be text, and the calls of a strict tool are held to its schema (a tool
    not strict is called as the model writes it: toolmode's tests); the Responses API's tools are strict unless
    they say not."""
    q = [{"role": "user", "content": "Weather in Oslo?"}]
    strict = {"type": "function", "function": {**STRICT["function"], "strict": True}}
    tok = server.engine.tokenizer
    push = {str(tok.token_to_id(chat.TOOL_START)): 100}  # (the small model seldom calls by itself)
    made = []
    for seed in range(4):
        r = client.chat.completions.create(model=default_model.NAME, messages=q, tools=[strict], max_tokens=60,
                                           seed=seed, logit_bias=push, reasoning_effort="none",
                                           parallel_tool_calls=False)
        made += [(c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls or []]
    assert all(held_call(*c) for c in made if c[0] == "get_weather") and any(c[0] == "get_weather" for c in made), made
    submitted = []
    submit = server.loop.submit
    monkeypatch.setattr(server.loop, "submit", lambda ids, sp, out, images: (submitted.append(sp),
                                                                             submit(ids, sp, out, images))[1])
    for tool in ({}, {"strict": False}):
        client.responses.create(model=default_model.NAME, input=q, tools=[{"type": "function", **STRICT["function"],
                                                                           **tool}], max_output_tokens=2)
    assert submitted[0].tool_calls == {"get_weather": STRICT["function"]["parameters"]}
    assert submitted[0].tool_calls_optional and submitted[1].tool_calls is None
    # beside a JSON answer (which writes no call) strict tools hold nothing
    r = client.chat.completions.create(model=default_model.NAME, messages=q, tools=[strict], max_tokens=8,
                                       response_format={"type": "json_object"}, reasoning_effort="none")
    assert submitted[-1].json_object and submitted[-1].tool_calls is None and r.choices[0].message.tool_calls is None


def test_prefix_cache_hits_are_reported(url, client):
    q = [{"role": "user", "content": "Summarize: " + "the cat sat on the mat and looked around. " * 30}]
    before = metrics(url)["glm53_prefix_cache_hit_tokens_total"]
    first = client.chat.completions.create(model=default_model.NAME, messages=q, max_tokens=1)
    again = client.chat.completions.create(model=default_model.NAME, messages=q, max_tokens=1)
    assert first.usage.prompt_tokens >= 128
    hit = again.usage.prompt_tokens_details.cached_tokens
    assert hit >= 64 and hit % 64 == 0  # whole cache blocks
    assert metrics(url)["glm53_prefix_cache_hit_tokens_total"] - before >= hit
    r = requests.post(url + "/reset_prefix_cache", timeout=30)  # vLLM's path, for cold benchmarks
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    cold = client.chat.completions.create(model=default_model.NAME, messages=q, max_tokens=1)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert requests.get(url + "/reset_prefix_cache", timeout=30).status_code == 405


# --- bad input ------------------------------------------------------------------------------------

LONG = "word " * (MAX_MODEL_LEN + 10)
M = [{"role": "user", "content": "hi"}]
BAD = [  # (path, body: dict or raw str, status, param, code)
    ("/v1/chat/completions", "not json", 400, None, "invalid_json"),
    ("/v1/chat/completions", "[1, 2]", 400, None, "invalid_json"),
    ("/v1/chat/completions", "", 400, None, "invalid_json"),
    ("/v1/chat/completions", "[" * 100000 + "]" * 100000, 400, None, "invalid_json"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400,
     "temperature", "invalid_type"),
    ("/v1/chat/completions", {}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", None),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0].content", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"text": "x"}]}]}, 400,
     "messages[0].content[0]", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, 400, "messages[0].content[0]", "unsupported"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}, *M]}, 400,
     "messages[0].tool_calls[0].function.arguments", None),
    ("/v1/chat/completions", {"messages": M, "thinking_token_budget": -1}, 400, "thinking_token_budget",
     "invalid_value"),
    ("/v1/chat/completions", {"messages": M, "thinking_token_budget": "4"}, 400, "thinking_token_budget",
     "invalid_type"),
    ("/v1/chat/completions", {"model": "gpt-9", "messages": M}, 404, "model", "model_not_found"),
    ("/v1/chat/completions", {"model": 5, "messages": M}, 400, "model", "invalid_type"),
    ("/v1/chat/completions", {"messages": M, "temperature": "hot"}, 400, "temperature", "invalid_type"),
    ("/v1/chat/completions", {"messages": M, "temperature": -1}, 400, "temperature", "invalid_value"),
    ("/v1/chat/completions", {"messages": M, "temperature": 3}, 400, "temperature", "invalid_value"),
    ("/v1/chat/completions", {"messages": M, "top_p": 0}, 400, "top_p", "invalid_value"),
    ("/v1/chat/completions", {"messages": M, "top_p": 1.5}, 400, "top_p", "invalid_value"),
    ("/v1/chat/completions", {"messages": M, "top_k": -5}, 400, "top_k", "invalid_value"),
    ("/v1/chat/completions", {"messages": M, "presence_penalty": 5}, 400, "presence_penalty", "invalid_value"),
    ("/v1/chat/completions", {"messages": M, "seed": 1.5}, 400, "seed", "invalid_type"),
    ("/v1/chat/completions", {"messages": M, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("/v1/chat/completions", {"messages": M, "max_tokens": "10"}, 400, "max_tokens", "invalid_type"),
    ("/v1/chat/completions", {"messages": M, "max_tokens": 10 ** 9}, 400, "max_tokens", "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages",
     "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": M, "n": 0}, 400, "n", "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "n": 17}, 400, "n", "invalid_value"),
    ("/v1/chat/completions", {"messages": M, "logit_bias": {"one": 5}}, 400, "logit_bias", "invalid_value"),
    ("/v1/chat/completions", {"messages": M, "logit_bias": {"1": 101}}, 400, "logit_bias", "invalid_value"),
    ("/v1/chat/completions", {"messages": M, "logit_bias": {"99999999": 1}}, 400, "logit_bias", "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": [1]}, 400, "logit_bias", "invalid_type"),
    ("/v1/chat/completions", {"messages": M, "response_format": {"type": "grammar"}}, 400, "response_format",
     "invalid_value"),
    ("/v1/chat/completions", {"messages": M, "stream": "yes"}, 400, "stream", "invalid_type"),
    ("/v1/chat/completions", {"messages": M, "stream": True, "stream_options": "x"}, 400, "stream_options",
     "invalid_type"),
    ("/v1/chat/completions", {"messages": M, "stop": 5}, 400, "stop", "invalid_value"),
    ("/v1/chat/completions", {"messages": M, "stop": [""]}, 400, "stop", "invalid_value"),
    ("/v1/chat/completions", {"messages": M, "stop_token_ids": [-1]}, 400, "stop_token_ids", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": 3}, 400, "stop_token_ids", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "min_tokens": -1}, 400, "min_tokens", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 5, "max_tokens": 4}, 400, "min_tokens", "invalid_value"),
    ("/v1/chat/completions", {"messages": M, "min_tokens": 2, "response_format": {"type": "json_object"}}, 400,
     "min_tokens", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "include_stop_str_in_output": "yes"}, 400, "include_stop_str_in_output",
     "invalid_type"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": [10 ** 9]}, 400, "allowed_token_ids", "invalid_value"),
    ("/v1/chat/completions", {"messages": M, "continue_final_message": True}, 400, "continue_final_message",
     "invalid_value"),
    ("/v1/chat/completions", {"messages": [*M, {"role": "assistant", "content": "a"}], "continue_final_message": True,
                              "add_generation_prompt": True}, 400, "add_generation_prompt", "invalid_value"),
    ("/v1/chat/completions", {"messages": M, "add_generation_prompt": False}, 400, "add_generation_prompt",
     "unsupported"),
    ("/v1/chat/completions", {"messages": [*M, {"role": "assistant", "content": "a"}], "continue_final_message": True,
                              "reasoning_effort": "high"}, 400, "continue_final_message", "invalid_value"),
    ("/v1/chat/completions", {"messages": [*M, {"role": "assistant", "content": "a"}], "continue_final_message": True,
                              "response_format": {"type": "json_object"}}, 400, "response_format", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"grammar": "root ::= x"}}, 400,
     "structured_outputs.grammar", "unsupported"),
    ("/v1/completions", {"prompt": "x", "guided_grammar": "root ::= x"}, 400, "guided_grammar", "unsupported"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "(a"}}, 400, "structured_outputs.regex",
     "unsupported"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}}, 400,
     "structured_outputs.choice", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"choice": []}}, 400, "structured_outputs.choice",
     "invalid_value"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regexp": "a"}}, 400, "structured_outputs.regexp",
     "invalid_value"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": "a"}, 400, "structured_outputs", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "guided_json": "{oops"}, 400, "guided_json", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "guided_json": {"type": "object", "not": {}}}, 400, "guided_json",
     "unsupported"),
    ("/v1/chat/completions", {"messages": M, "response_format": {"type": "json_object"}, "guided_regex": "a"}, 400,
     "guided_regex", "invalid_value"),
    ("/v1/chat/completions", {"messages": M, "tools": [CLOCK], "tool_choice": "required",
                              "structured_outputs": {"choice": ["a"]}}, 400, "structured_outputs.choice",
     "invalid_value"),
    ("/v1/chat/completions", {"messages": M, "logprobs": "true"}, 400, "logprobs", "invalid_type"),
    ("/v1/chat/completions", {"messages": M, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs",
     "invalid_value"),
    ("/v1/chat/completions", {"messages": M, "top_logprobs": 2}, 400, "top_logprobs", "invalid_value"),
    ("/v1/chat/completions", {"messages": M, "reasoning_effort": "medium"}, 400, "reasoning_effort", None),
    ("/v1/chat/completions", {"messages": M, "enable_thinking": False, "reasoning_effort": "high"}, 400,
     "reasoning_effort", None),
    ("/v1/chat/completions", {"messages": M, "chat_template_kwargs": "x"}, 400, "chat_template_kwargs", None),
    ("/v1/chat/completions", {"messages": M, "chat_template_kwargs": {"foo": 1}}, 400, "chat_template_kwargs",
     "unsupported"),
    ("/v1/chat/completions", {"messages": M, "tools": [CLOCK], "tool_choice": None, "max_tokens": 0}, 400,
     "max_tokens", "invalid_value"),
    ("/v1/chat/completions", {"messages": M, "tools": "x"}, 400, "tools", None),
    ("/v1/chat/completions", {"messages": M, "tools": [{"type": "function"}]}, 400, "tools[0]", None),
    ("/v1/chat/completions", {"messages": M, "tool_choice": "required"}, 400, "tool_choice", None),
    ("/v1/chat/completions", {"messages": M, "tools": [CLOCK], "tool_choice": "sometimes"}, 400, "tool_choice", None),
    ("/v1/chat/completions", {"messages": M, "tools": [CLOCK], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, 400, "tool_choice", None),
    ("/v1/completions", {}, 400, "prompt", None),
    ("/v1/completions", {"prompt": []}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [10 ** 9]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [-1, 2]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": ["a", ""]}, 400, "prompt[1]", "invalid_value"),
    ("/v1/completions", {"prompt": [[1, 2], [10 ** 9]]}, 400, "prompt[1]", "invalid_value"),
    ("/v1/completions", {"prompt": ["a", 3]}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": ["x", LONG]}, 400, "prompt[1]", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x", "logprobs": 100}, 400, "logprobs", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "echo": 1}, 400, "echo", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix", "unsupported"),
    ("/v1/completions", {"prompt": "x", "best_of": 2}, 400, "best_of", "unsupported"),
    ("/v1/completions", {"prompt": "x", "best_of": "2"}, 400, "best_of", "invalid_type"),
    ("/v1/completions", {"prompt": LONG}, 400, "prompt", "context_length_exceeded"),
    ("/v1/score", {}, 400, "token_ids", None),
    ("/v1/score", {"token_ids": ["a"]}, 400, "token_ids", None),
    ("/v1/score", {"token_ids": [10 ** 9]}, 400, "token_ids", None),
    ("/v1/score", {"token_ids": [1, 2], "top_k": -1}, 400, "top_k", "invalid_value"),
    ("/v1/nothing", {}, 404, None, "not_found"),
]


def test_malformed_requests_get_openai_errors_and_never_5xx(url, client):
    assert len(BAD) >= 30
    for path, body, status, param, code in BAD:
        raw = body if isinstance(body, str) else json.dumps(body)
        r = requests.post(url + path, data=raw, headers={"Content-Type": "application/json"}, timeout=30)
        assert r.status_code == status, (path, body if len(raw) < 200 else raw[:200], r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], (body, err)
        assert err["param"] == param and (code is None or err["code"] == code), (body, err)
    assert requests.get(url + "/v1/chat/completions", timeout=10).status_code == 405
    # the engine is unharmed
    r = client.chat.completions.create(model=default_model.NAME, messages=M, max_tokens=2)
    assert r.usage.completion_tokens >= 1


# --- Anthropic's Messages API --------------------------------------------------------------------


def post_messages(url, body, headers=None):
    """(status, the whole message or the error) and, when streamed, the (event, data) pairs in order."""
    r = requests.post(url + "/v1/messages", json={"model": default_model.NAME, **body}, timeout=120,
                      headers=headers, stream=bool(body.get("stream")))
    if not body.get("stream") or r.status_code != 200:
        return r.status_code, r.json(), None
    events, name = [], None
    for line in r.iter_lines(decode_unicode=True):
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[len("data: "):])))
    return r.status_code, None, events


ANTHROPIC_WEATHER = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}


def test_messages_greedy_stream_matches_nonstream_and_counts_like_chat(server, url):
    body = {"max_tokens": 12, "temperature": 0, "messages": HI}
    status, msg, _ = post_messages(url, body)
    assert status == 200 and msg["type"] == "message" and msg["role"] == "assistant", msg
    assert msg["id"].startswith("msg_") and msg["model"] == default_model.NAME
    u = msg["usage"]  # thinking is off unless asked for: the same prompt as chat's reasoning_effort "none"
    assert u["input_tokens"] + u["cache_read_input_tokens"] == prompt_len(server, HI, effort="none")
    assert [b["type"] for b in msg["content"]] == ["text"] and 1 <= u["output_tokens"] <= 12
    assert msg["stop_reason"] in ("end_turn", "max_tokens")
    status, _, events = post_messages(url, {**body, "stream": True})
    names = [n for n, _ in events]
    assert status == 200 and names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert all(e["type"] == n for n, e in events)
    text = "".join(e["delta"]["text"] for n, e in events if n == "content_block_delta")
    assert text == msg["content"][0]["text"] and events[-2][1]["delta"]["stop_reason"] == msg["stop_reason"]
    assert requests.post(url + "/v1/messages/count_tokens", json={"messages": HI}, timeout=30).json() == \
        {"input_tokens": prompt_len(server, HI, effort="none")}


def test_messages_thinking_and_tool_use_nonstream_and_stream(server, url, scripted):
    scripted(SCRIPT)
    q = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    body = {"max_tokens": 200, "messages": q, "tools": [ANTHROPIC_WEATHER],
            "thinking": {"type": "enabled", "budget_tokens": 100}}
    status, msg, _ = post_messages(url, body)
    assert status == 200, msg
    thinking, text, tool = msg["content"]
    assert thinking == {"type": "thinking", "thinking": "Need the weather.", "signature": ""}
    assert text == {"type": "text", "text": "Let me check."}
    assert (tool["type"], tool["name"], tool["input"]) == ("tool_use", "get_weather", {"city": "Paris", "days": 3})
    assert msg["stop_reason"] == "tool_use"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": ANTHROPIC_WEATHER["input_schema"]}}]
    assert msg["usage"]["input_tokens"] + msg["usage"]["cache_read_input_tokens"] == prompt_len(server, q, tools)
    _, _, events = post_messages(url, {**body, "stream": True})
    starts = [e["content_block"]["type"] for n, e in events if n == "content_block_start"]
    deltas = [e["delta"]["type"] for n, e in events if n == "content_block_delta"]
    assert starts == ["thinking", "text", "tool_use"] and deltas[-1] == "input_json_delta"
    partial = next(e["delta"]["partial_json"] for n, e in events if e.get("delta", {}).get("type") == "input_json_delta")
    assert json.loads(partial) == {"city": "Paris", "days": 3}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_messages_structured_output(server, url):
    """output_config.format (the beta's output_format): the answer's text is a JSON object of the schema."""
    shape = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}
    fmt = {"type": "json_schema", "schema": shape}
    for field in ({"output_config": {"format": fmt}}, {"output_format": fmt}):
        status, msg, _ = post_messages(url, {"max_tokens": 200, "messages": M, **field})
        assert status == 200, msg
        (block,) = msg["content"]
        assert block["type"] == "text"
        assert jsonmode.JsonPrefix(jsonmode.object_schema(shape)).feed(block["text"].encode()), block
        assert msg["stop_reason"] == "max_tokens" or isinstance(json.loads(block["text"])["ok"], bool), msg


def test_messages_tool_result_turn_renders_like_chat(server, url):
    anthropic = [{"role": "user", "content": "Weather in Paris?"},
                 {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                    "input": {"city": "Paris"}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sun"}]}]
    openai = [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": "", "tool_calls": [
                  {"id": "toolu_1", "type": "function", "function": {"name": "get_weather",
                                                                     "arguments": '{"city": "Paris"}'}}]},
              {"role": "tool", "tool_call_id": "toolu_1", "content": "sun"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": ANTHROPIC_WEATHER["input_schema"]}}]
    counted = requests.post(url + "/v1/messages/count_tokens", timeout=30, json={
        "messages": anthropic, "tools": [ANTHROPIC_WEATHER], "system": "Be brief."}).json()
    assert counted == {"input_tokens": prompt_len(server, [{"role": "system", "content": "Be brief."}, *openai], tools,
                                                  effort="none")}


def test_messages_stop_sequence_and_large_max_tokens(server, url, scripted):
    scripted("Hello STOP more")
    status, msg, _ = post_messages(url, {"max_tokens": 10 ** 6, "messages": M, "stop_sequences": ["zzz", "STOP"]})
    assert status == 200, msg  # a max_tokens past the context is the most the context leaves
    assert msg["content"] == [{"type": "text", "text": "Hello "}]
    assert (msg["stop_reason"], msg["stop_sequence"]) == ("stop_sequence", "STOP")


def test_messages_with_the_anthropic_client(server, url, scripted):
    import anthropic
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)
    scripted(SCRIPT)
    q = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    kw = dict(model=default_model.NAME, max_tokens=200, messages=q, tools=[ANTHROPIC_WEATHER],
              thinking={"type": "enabled", "budget_tokens": 100})
    r = client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        streamed = s.get_final_message()
    for msg in (r, streamed):
        assert [b.type for b in msg.content] == ["thinking", "text", "tool_use"] and msg.stop_reason == "tool_use"
        assert (msg.content[0].thinking, msg.content[1].text) == ("Need the weather.", "Let me check.")
        assert (msg.content[2].name, msg.content[2].input) == ("get_weather", {"city": "Paris", "days": 3})
    assert streamed.usage.output_tokens == r.usage.output_tokens
    assert client.messages.count_tokens(model=default_model.NAME, messages=q).input_tokens == \
        prompt_len(server, q, effort="none")
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=default_model.NAME, max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    assert "this model has no vision tower" in e.value.body["error"]["message"]


def test_messages_prefill_starts_the_answer_and_is_not_returned(server, url, scripted):
    scripted(" blue.")
    q = [{"role": "user", "content": "Name a colour."}]
    status, msg, _ = post_messages(url, {"max_tokens": 20, "messages": [*q, {"role": "assistant",
                                                                             "content": "The colour is"}]})
    assert status == 200 and msg["content"] == [{"type": "text", "text": " blue."}], msg
    text = chat.render(server.engine.chat_template, q, None, chat.resolve_thinking("none")) + "The colour is"
    u = msg["usage"]
    assert u["input_tokens"] + u["cache_read_input_tokens"] == \
        len(server.engine.tokenizer.encode(text, add_special_tokens=False).ids)


MESSAGES_BAD = [  # (body, status, words the message must hold)
    ({"messages": M}, 400, "max_tokens is required"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, 400,
     "not supported"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "content[0].source must be"),
    ({"max_tokens": 5, "messages": M, "temperature": 2}, 400, "temperature"),
    ({"max_tokens": 0, "messages": M}, 400, "max_tokens"),
    ({"max_tokens": 5, "messages": M, "tool_choice": {"type": "any"}}, 400, "needs 'tools'"),
    ({"max_tokens": 5, "messages": M, "thinking": {"type": "enabled", "budget_tokens": 5}}, 400,
     "thinking.budget_tokens (5) must be less than max_tokens (5)"),
    ({"max_tokens": 5, "messages": M, "model": "claude-9"}, 404, "does not exist"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": LONG}]}, 400, "context"),
]


def test_messages_errors_in_anthropics_shape(url):
    for body, status, words in MESSAGES_BAD:
        r = requests.post(url + "/v1/messages", json=body, timeout=30)
        assert r.status_code == status, (body, r.text)
        e = r.json()
        assert e["type"] == "error" and set(e["error"]) == {"type", "message"}, e
        assert e["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
        assert words in e["error"]["message"], (body, e)
    r = requests.post(url + "/v1/messages", data="{oops", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


# --- OpenAI's Responses API --------------------------------------------------------------------

RESPONSES_WEATHER = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"],
                     "strict": False}  # (scripted answers: a strict tool's calls would be held, drawn by the model)


def test_responses_reasoning_and_function_call_whole_and_streamed(server, client, scripted):
    scripted(SCRIPT)
    q = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    kw = dict(model=default_model.NAME, input=q, tools=[RESPONSES_WEATHER], max_output_tokens=200)
    r = client.responses.create(**kw)
    with client.responses.stream(**kw) as s:
        streamed = s.get_final_response()
    for resp in (r, streamed):
        assert resp.status == "completed" and [o.type for o in resp.output] == ["reasoning", "message", "function_call"]
        assert resp.output[0].content[0].text == "Need the weather." and resp.output_text == "Let me check."
        fc = resp.output[2]
        assert (fc.name, json.loads(fc.arguments)) == ("get_weather", {"city": "Paris", "days": 3})
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": RESPONSES_WEATHER["parameters"]}}]
    assert r.usage.input_tokens == prompt_len(server, q, tools) and streamed.usage.output_tokens == r.usage.output_tokens


def test_responses_function_call_output_turn_renders_like_chat(server, client, scripted):
    scripted("It is sunny.")
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sun"}]
    chat_messages = [{"role": "user", "content": "Weather in Paris?"},
                     {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                         "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "sun"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": RESPONSES_WEATHER["parameters"]}}]
    r = client.responses.create(model=default_model.NAME, input=items, tools=[RESPONSES_WEATHER],
                                reasoning={"effort": "none"}, max_output_tokens=3)
    assert r.usage.input_tokens == prompt_len(server, chat_messages, tools, effort="none")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == "It is sunny."[:len(r.output_text)] and r.usage.output_tokens == 3


def test_responses_errors_name_the_field(url):
    for body, param in [({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
                        ({"input": "x", "reasoning": {"effort": "medium"}}, "reasoning.effort"),
                        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
                         "input[0].content[0].image_url"),
                        ({"input": LONG}, "input"), ({"input": "x", "max_output_tokens": 0}, "max_output_tokens")]:
        resp = requests.post(url + "/v1/responses", json=body, timeout=30)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, (body, resp.text)


def test_body_too_large_is_413(server, url):
    limit = server.app.config["MAX_CONTENT_LENGTH"]
    server.app.config["MAX_CONTENT_LENGTH"] = 1000
    try:
        r = requests.post(url + "/v1/chat/completions", data=json.dumps({"messages": M, "x": "a" * 2000}),
                          headers={"Content-Type": "application/json"}, timeout=30)
    finally:
        server.app.config["MAX_CONTENT_LENGTH"] = limit
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_api_key(server, url):
    server.args.api_key = "sekrit"
    try:
        body = {"messages": M, "max_tokens": 1}
        assert requests.post(url + "/v1/chat/completions", json=body, timeout=30).status_code == 401
        wrong = requests.post(url + "/v1/chat/completions", json=body, timeout=30,
                              headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert requests.get(url + "/health", timeout=10).status_code == 200
        ok = requests.post(url + "/v1/chat/completions", json=body, timeout=60,
                           headers={"Authorization": "Bearer sekrit"})
        assert ok.status_code == 200
        anthropic = {"messages": M, "max_tokens": 1}
        wrong = requests.post(url + "/v1/messages", json=anthropic, timeout=30, headers={"x-api-key": "nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
        assert requests.post(url + "/v1/messages", json=anthropic, timeout=60,
                             headers={"x-api-key": "sekrit"}).status_code == 200
    finally:
        server.args.api_key = None


# --- disconnects and load ---------------------------------------------------------------------------


def wait_idle(url, timeout=60.0, reported: dict[str, float] | None = None) -> dict:
    """The metrics once nothing runs, waits or holds cache and each counter in `reported` has reached its value: a
    cancelled request leaves the running batch at once but is counted by the engine step after."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = metrics(url)
        if m["glm53_num_requests_running"] == 0 and m["glm53_num_requests_waiting"] == 0 \
                and m["glm53_cache_blocks_used"] == 0 and all(m.get(k, 0) >= v for k, v in (reported or {}).items()):
            return m
        time.sleep(0.2)
    raise AssertionError(f"engine not idle after {timeout} s: {m}")


@pytest.mark.parametrize("n, stream", [(1, False), (3, False), (3, True)])
def test_client_disconnect_cancels_every_choice(server, url, n, stream, monkeypatch):
    before = metrics(url).get('glm53_requests_finished_total{reason="cancelled"}', 0)
    # a step of at least 5 ms: on an H100 the default model writes 1000 tokens in a quarter of a second, before
    # the server had seen the client go
    step = server.engine.step
    monkeypatch.setattr(server.engine, "step", lambda: (time.sleep(0.005), step())[1])
    body = json.dumps({"messages": M, "max_tokens": 1000, "ignore_eos": True, "n": n, "stream": stream}).encode()
    s = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    time.sleep(0.25)
    s.close()
    cancelled = 'glm53_requests_finished_total{reason="cancelled"}'
    m = wait_idle(url, reported={cancelled: before + n})
    assert m[cancelled] == before + n


def test_load_32_streaming_clients_a_third_disconnect(url):
    before = metrics(url)
    results: dict[int, str] = {}

    def client(i: int) -> None:
        quitter = i % 3 == 0
        body = {"messages": [{"role": "user", "content": f"Request {i}: tell me a story."}], "stream": True,
                "max_tokens": 400 if quitter else 8, "ignore_eos": True, "temperature": 0.8, "seed": i}
        try:
            with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=120) as r:
                if r.status_code != 200:
                    results[i] = f"status {r.status_code}"
                    return
                events = 0
                finish = None
                for line in r.iter_lines():
                    if not line:
                        continue
                    events += 1
                    if quitter and events == 3:
                        results[i] = "quit"
                        return  # leaving the with-block closes the connection mid-stream
                    if line == b"data: [DONE]":
                        results[i] = f"done {finish}"
                        return
                    data = json.loads(line[len(b"data: "):])
                    if data["choices"] and data["choices"][0]["finish_reason"]:
                        finish = data["choices"][0]["finish_reason"]
                results[i] = "eof without [DONE]"
        except Exception as e:  # recorded, then asserted below
            results[i] = f"error {e!r}"

    threads = [threading.Thread(target=client, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    quitters = [i for i in range(32) if i % 3 == 0]
    assert {i: results.get(i) for i in range(32)} == {i: "quit" if i in quitters else "done length" for i in range(32)}
    cancelled = 'glm53_requests_finished_total{reason="cancelled"}'
    length = 'glm53_requests_finished_total{reason="length"}'
    after = wait_idle(url, reported={cancelled: before.get(cancelled, 0) + len(quitters)})
    assert after[cancelled] - before.get(cancelled, 0) == len(quitters)
    assert after[length] - before.get(length, 0) == 32 - len(quitters)
    assert not [k for k, v in after.items()
                if k.startswith("glm53_requests_total") and 'status="5' in k and v != before.get(k, 0)]


def test_command_line_server_starts_shows_progress_and_checks_the_key(server, client, cache_dir):
    """`python serve.py` itself: listens at once, prints load progress and the time to ready; with
    `--speculator mtp` its greedy answers equal the plain server's and /metrics counts the drafts; with two
    served model names it takes either and replies with the first."""
    env = {**os.environ, "GLM53_CACHE": str(cache_dir), "OMP_NUM_THREADS": "1"}
    names = ["glm-5.3-flash", "claude-haiku-4-5"]
    proc = subprocess.Popen([sys.executable, "serve.py", "--port", "0", "--api-key", "k1", "--speculator", "mtp",
                             "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", *names],
                            cwd=Path(serve.__file__).parent, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if "ready in" in line or not line:
                break
        out = "".join(lines)
        assert "ready in" in out and "loading weights" in out, out
        port = int(out.split("listening on http://127.0.0.1:")[1].split(" ")[0])
        base = f"http://127.0.0.1:{port}"
        assert requests.get(base + "/health", timeout=10).json()["status"] == "ok"
        assert requests.get(base + "/v1/models", timeout=10).status_code == 401
        models = requests.get(base + "/v1/models", timeout=10, headers={"Authorization": "Bearer k1"}).json()
        assert [m["id"] for m in models["data"]] == names
        ask = dict(model=default_model.NAME, messages=HI, max_tokens=24, temperature=0)
        plain = client.chat.completions.create(**ask).choices[0].message
        import openai
        spec_client = openai.OpenAI(base_url=base + "/v1", api_key="k1", max_retries=0, timeout=120)
        reply = spec_client.chat.completions.create(**{**ask, "model": names[1]})
        spec = reply.choices[0].message
        assert reply.model == names[0]
        with pytest.raises(openai.NotFoundError):
            spec_client.chat.completions.create(**ask)  # the built-in model's name is not among those served
        assert (spec.content, spec.model_extra.get("reasoning_content")) == \
            (plain.content, plain.model_extra.get("reasoning_content"))
        m = metrics(base, headers={"Authorization": "Bearer k1"})
        assert m['glm53_spec_verify_steps_total{speculator="mtp"}'] > 0
        assert m['glm53_spec_draft_tokens_total{speculator="mtp"}'] > 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)

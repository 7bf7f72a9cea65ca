"""OpenAI-compatible HTTP server: flask handlers and one engine thread doing continuous batching.

    python serve.py [--model PATH_OR_HF_ID] [--host 127.0.0.1] [--port 8000] [--api-key KEY] ...

The engine is not thread-safe, so exactly one thread (EngineLoop) touches it: handlers post
commands to its inbox (add a request, cancel one, run a function such as scoring) and read their
request's outputs from a per-request queue. Endpoints: /v1/chat/completions, /v1/completions
(both streamed as SSE or not), /v1/models, /v1/score (teacher-forced log-probabilities),
/v1/messages and /v1/messages/count_tokens (Anthropic's API, translated by messages_api.py),
/v1/responses (OpenAI's Responses API, translated by responses_api.py),
/health (ready after load and warm-up), /metrics (Prometheus text). Every bad request gets an
OpenAI-style error body {"error": {"message", "type", "param", "code"}} with a 4xx status (on
/v1/messages Anthropic's {"type": "error", "error": {"type", "message"}}).
"""
from __future__ import annotations

import time

STARTED = time.monotonic()  # before the heavy imports: "ready in" counts from (nearly) process start

import argparse
import base64
import copy
import json
import math
import queue
import socket
import sys
import threading
import traceback
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from flask import Flask, Response, request
from werkzeug.exceptions import HTTPException
from werkzeug.serving import make_server

import chat
import jsonmode
import pattern
import messages_api
import responses_api
import toolmode
import vision

MAX_BODY_BYTES = 32 << 20
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 16  # n: each choice is a sequence of its own in the engine
POLL_S = 0.2  # how often a waiting handler checks whether its client is still connected


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self, anthropic: bool = False) -> dict:
        """OpenAI's error object, or Anthropic's for /v1/messages (which has no param: the message names it)."""
        if anthropic:
            named = self.param is None or self.param in self.message
            return messages_api.error_body(self.status, self.message if named else f"{self.param}: {self.message}")
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------------------------------------
# Metrics (Prometheus text format)


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * len(buckets)
        self.sum, self.count = 0.0, 0

    def observe(self, v: float) -> None:
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
        self.sum += v
        self.count += 1

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        out += [f'{self.name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out += [f'{self.name}_bucket{{le="+Inf"}} {self.count}', f"{self.name}_sum {self.sum}",
                f"{self.name}_count {self.count}"]
        return out


class Metrics:
    """Server-side counters; the engine's own (cache, prefix hits) are read at scrape time."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = self.generation_tokens = self.cached_tokens = 0
        self.finished: dict[str, int] = {}
        lat = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
        self.ttft = Histogram("glm53_time_to_first_token_seconds", "Time from request arrival to its first token.", lat)
        self.itl = Histogram("glm53_inter_token_latency_seconds", "Time between a request's successive outputs.", lat)
        self.e2e = Histogram("glm53_request_latency_seconds", "Time from arrival to the last token.", lat)

    def count_request(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.requests[(endpoint, status)] = self.requests.get((endpoint, status), 0) + 1

    def observe(self, hist: Histogram, v: float) -> None:
        with self.lock:
            hist.observe(v)

    def finish(self, reason: str, prompt: int, generated: int, cached: int) -> None:
        with self.lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.prompt_tokens += prompt
            self.generation_tokens += generated
            self.cached_tokens += cached

    def render(self, stats: Any) -> str:
        def metric(name, kind, help, samples):
            return [f"# HELP {name} {help}", f"# TYPE {name} {kind}"] + [f"{name}{lbl} {v}" for lbl, v in samples]

        with self.lock:
            lines = metric("glm53_requests_total", "counter", "HTTP requests by endpoint and status.",
                           [(f'{{endpoint="{e}",status="{s}"}}', n) for (e, s), n in sorted(self.requests.items())])
            lines += metric("glm53_requests_finished_total", "counter", "Generation requests by finish reason.",
                            [(f'{{reason="{r}"}}', n) for r, n in sorted(self.finished.items())])
            lines += metric("glm53_prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
                            [("", self.prompt_tokens)])
            lines += metric("glm53_generation_tokens_total", "counter", "Generated tokens of finished requests.",
                            [("", self.generation_tokens)])
            lines += metric("glm53_request_cached_tokens_total", "counter",
                            "Prompt tokens of finished requests served by the prefix cache.", [("", self.cached_tokens)])
            for h in (self.ttft, self.itl, self.e2e):
                lines += h.lines()
        if stats is not None:
            s = stats
            lines += metric("glm53_num_requests_running", "gauge", "Sequences in the running batch.", [("", s.running)])
            lines += metric("glm53_num_requests_waiting", "gauge", "Sequences waiting for admission.", [("", s.waiting)])
            lines += metric("glm53_cache_blocks_used", "gauge", "Paged cache blocks in use.", [("", s.blocks_used)])
            lines += metric("glm53_cache_blocks_total", "gauge", "Paged cache blocks in the pool.", [("", s.blocks_total)])
            lines += metric("glm53_cache_usage_ratio", "gauge", "Fraction of cache blocks in use.",
                            [("", s.blocks_used / max(s.blocks_total, 1))])
            lines += metric("glm53_prefix_cache_query_tokens_total", "counter", "Prompt tokens looked up in the prefix cache.",
                            [("", s.prefix_query_tokens)])
            lines += metric("glm53_prefix_cache_hit_tokens_total", "counter", "Prompt tokens found in the prefix cache.",
                            [("", s.prefix_hit_tokens)])
            lines += metric("glm53_kda_snapshots", "gauge", "KDA state snapshots held for the prefix cache.",
                            [("", s.snapshots)])
            lines += metric("glm53_preemptions_total", "counter", "Sequences preempted for lack of cache.",
                            [("", s.preemptions)])
            lines += metric("glm53_spec_verify_steps_total", "counter", "Speculative verify passes.",
                            [(f'{{speculator="{s.speculator}"}}', s.spec_verify_steps)])
            lines += metric("glm53_spec_draft_tokens_total", "counter", "Draft tokens verified.",
                            [(f'{{speculator="{s.speculator}"}}', s.spec_draft_tokens)])
            lines += metric("glm53_spec_accepted_tokens_total", "counter", "Draft tokens accepted.",
                            [(f'{{speculator="{s.speculator}"}}', s.spec_accepted_tokens)])
            lines += metric("glm53_spec_tokens_per_step", "gauge",
                            "Tokens emitted per verify pass: (accepted + steps) / steps; 0 before any.",
                            [(f'{{speculator="{s.speculator}"}}',
                              (s.spec_accepted_tokens + s.spec_verify_steps) / s.spec_verify_steps
                              if s.spec_verify_steps else 0)])
        return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# The engine thread


@dataclass
class Pending:
    """One in-flight request: the engine thread puts RequestOutputs (or an exception) on `outputs`."""

    request_id: str
    outputs: queue.Queue


class EngineLoop:
    """Owns the engine. Handlers talk to it only through `submit`, `cancel` and `call`."""

    def __init__(self, engine: Any, metrics: Metrics):
        self.engine, self.metrics = engine, metrics
        self.inbox: queue.Queue = queue.Queue()
        self.pending: dict[str, Pending] = {}
        self.thread = threading.Thread(target=self.run, name="engine", daemon=True)
        self.stopped = False

    def submit(self, prompt_ids: list[int], sampling: Any, outputs: queue.Queue | None = None,
               images: list = ()) -> Pending:
        """`outputs`: a queue shared with other requests (a request's choices), else one of its own."""
        p = Pending(f"req-{uuid.uuid4().hex}", outputs or queue.Queue())
        self.inbox.put(("add", p, prompt_ids, sampling, images))
        return p

    def cancel(self, request_id: str) -> None:
        self.inbox.put(("cancel", request_id))

    def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps; return its result or raise its error."""
        done: queue.Queue = queue.Queue()
        self.inbox.put(("call", fn, done))
        while True:
            try:
                ok, value = done.get(timeout=1.0)
                break
            except queue.Empty:
                if not self.thread.is_alive():
                    raise ApiError(503, "the engine thread has stopped; see the server log", None, None, "server_error")
        if not ok:
            raise value
        return value

    def stop(self) -> None:
        self.stopped = True
        self.inbox.put(("wake",))

    def run(self) -> None:
        while not self.stopped:
            block = not self.engine.has_work()
            try:
                cmd = self.inbox.get(block=block)
            except queue.Empty:
                cmd = None
            while cmd is not None:
                self._do(cmd)
                try:
                    cmd = self.inbox.get_nowait()
                except queue.Empty:
                    cmd = None
            if self.engine.has_work():
                self._step()

    def _do(self, cmd: tuple) -> None:
        try:
            self._do_one(cmd)
        except Exception:  # an engine bug in add/cancel must not stop the loop every request depends on
            traceback.print_exc()

    def _do_one(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, p, prompt_ids, sampling, images = cmd
            try:
                self.engine.add_request(prompt_ids, sampling, p.request_id, images)
                self.pending[p.request_id] = p
            except ValueError as e:
                p.outputs.put(ApiError(400, str(e), None, "invalid_value"))
            except Exception as e:
                p.outputs.put(ApiError(500, f"the engine failed to add this request: {e}", type="server_error"))
                raise
        elif kind == "cancel":
            self.engine.cancel(cmd[1])
        elif kind == "call":
            _, fn, done = cmd
            try:
                done.put((True, fn(self.engine)))
            except Exception as e:  # handed to the caller, who turns it into an HTTP error
                done.put((False, e))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:
            # An engine bug must not take the server down: fail what is in flight and go on.
            traceback.print_exc()
            for rid, p in list(self.pending.items()):
                self.engine.cancel(rid)
                p.outputs.put(ApiError(500, "the engine failed while running this request; see the server log",
                                       type="server_error"))
            self.pending.clear()  # the next step reports the cancellations (and frees their cache)
            return
        for o in outputs:
            if o.finished and o.usage is not None:
                u = o.usage
                self.metrics.finish(o.finish_reason, u.prompt_tokens, u.completion_tokens, u.cached_tokens)
            p = self.pending.pop(o.request_id, None) if o.finished else self.pending.get(o.request_id)
            if p is not None:
                p.outputs.put(o)


# ---------------------------------------------------------------------------------------------
# Request fields


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "int": (_is_int, "an integer"),
    "number": (_is_num, "a finite number"),
    "bool": (lambda v: isinstance(v, bool), "a boolean"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "dict": (lambda v: isinstance(v, dict), "an object"),
    "list": (lambda v: isinstance(v, list), "an array"),
}


def field_of(body: dict, name: str, kind: str, default: Any = None, ok: Callable[[Any], bool] | None = None,
             why: str = "") -> Any:
    """body[name] checked for type (and range); null or absent gives `default`."""
    v = body.get(name)
    if v is None:
        return default
    test, what = KINDS[kind]
    if not test(v):
        raise ApiError(400, f"'{name}' must be {what}; got {json.dumps(v)[:80]}", name, "invalid_type")
    if ok is not None and not ok(v):
        raise ApiError(400, f"'{name}' {why}; got {json.dumps(v)[:80]}", name, "invalid_value")
    return v


def _stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 16:
        raise ApiError(400, "'stop' must be a non-empty string or a list of at most 16 non-empty strings", "stop",
                       "invalid_value")
    return stops


def _logit_bias(body: dict, vocab_size: int) -> dict[int, float]:
    """OpenAI's logit_bias: token ids (JSON keys, so strings) -> a bias in [-100, 100]."""
    out = {}
    for k, v in field_of(body, "logit_bias", "dict", {}).items():
        if not (k.isascii() and k.isdigit() and int(k) < vocab_size and _is_num(v) and -100 <= v <= 100):
            raise ApiError(400, f"'logit_bias' maps token ids below {vocab_size} to numbers in [-100, 100]; got "
                                f"{json.dumps({k: v})[:80]}", "logit_bias", "invalid_value")
        out[int(k)] = float(v)
    return out


def _json_format(body: dict) -> dict:
    """response_format -> the SamplingParams fields that hold the answer: {"type": "text"} (none), {"type":
    "json_object"} or {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}."""
    fmt = body.get("response_format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind in ("text", "json_object"):
        return {"json_object": True} if kind == "json_object" else {}
    if kind != "json_schema":
        raise ApiError(400, "'response_format' must be {'type': 'text'}, {'type': 'json_object'} or {'type': "
                            "'json_schema', 'json_schema': {...}}", "response_format", "invalid_value")
    schema = fmt.get("json_schema", {}).get("schema") if isinstance(fmt.get("json_schema"), dict) else None
    return {"json_schema": _schema(schema, "response_format.json_schema.schema")}


def _schema(schema: Any, param: str) -> dict:
    """A JSON Schema the answer is held to, checked (as JSON text where a client sent it as a string)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ApiError(400, f"'{param}' is a string that is not JSON: {e}", param, "invalid_value")
    if not isinstance(schema, dict):
        raise ApiError(400, f"'{param}' must be a JSON Schema object", param, "invalid_value")
    try:
        jsonmode.object_schema(schema)
    except jsonmode.SchemaError as e:
        raise ApiError(400, f"'{param}': {e}", param, "unsupported")
    return schema


GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice"}  # vLLM's fields before 0.12
STRUCTURED = ("json", "regex", "choice", "json_object")  # the structured_outputs kinds held (one a request)
NOT_STRUCTURED = ("grammar", "structural_tag", "whitespace_pattern", "disable_any_whitespace",
                  "disable_additional_properties")  # structured_outputs' options that would change the answer


def _structured_outputs(body: dict) -> tuple[dict, str | None]:
    """vLLM's structured_outputs ({"json": schema}, {"regex": ...}, {"choice": [...]} or {"json_object": true}) or
    the fields it replaced (guided_json, guided_regex, guided_choice) -> the SamplingParams fields that hold the
    answer, and the request field they came from. A context-free grammar, a structural tag, a whitespace pattern
    are a 400 (not held), as is more than one kind."""
    for name in ("guided_grammar", "guided_whitespace_pattern", "structural_tag"):
        if body.get(name) is not None:
            raise ApiError(400, f"'{name}' is not supported: this server holds an answer to a JSON schema, a regular "
                                f"expression or a choice of strings", name, "unsupported")
    so = field_of(body, "structured_outputs", "dict", {})
    given = [(f"structured_outputs.{k}", k, v) for k, v in so.items() if v not in (None, False)]
    given += [(name, kind, body[name]) for name, kind in GUIDED.items() if body.get(name) is not None]
    for param, kind, _ in given:
        if kind in NOT_STRUCTURED:
            raise ApiError(400, f"'{param}' is not supported: this server holds an answer to a JSON schema, a "
                                f"regular expression or a choice of strings", param, "unsupported")
        if kind not in STRUCTURED and kind != "disable_fallback":  # (which backend: this server has one)
            raise ApiError(400, f"'{param}' is not a structured_outputs field ({', '.join(STRUCTURED)} are)", param,
                           "invalid_value")
    given = [g for g in given if g[1] in STRUCTURED]
    if len(given) > 1:
        raise ApiError(400, f"'{given[0][0]}' and '{given[1][0]}': the answer can be held to one of them only",
                       given[1][0], "invalid_value")
    if not given:
        return {}, None
    param, kind, value = given[0]
    if kind == "json":
        return {"json_schema": _schema(value, param)}, param
    if kind == "json_object":
        return {"json_object": field_of({param: value}, param, "bool")}, param
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise ApiError(400, f"'{param}' must be a non-empty list of non-empty strings", param, "invalid_value")
        source = pattern.choice_regex(value)
    else:
        source = field_of({param: value}, param, "str")
    try:
        pattern.Pattern(source, whole=True)
    except pattern.PatternError as e:
        raise ApiError(400, f"'{param}': {e}", param, "unsupported")
    return {kind: value}, param


def _answer_format(body: dict) -> tuple[dict, str | None]:
    """What holds the answer (SamplingParams fields), from response_format or structured outputs (not both), and
    the request field it came from."""
    fmt, held = _json_format(body), _structured_outputs(body)
    if fmt and held[0]:
        raise ApiError(400, f"'response_format' and '{held[1]}': the answer can be held to one of them only",
                       held[1], "invalid_value")
    return (fmt, "response_format") if fmt else held


# ---------------------------------------------------------------------------------------------
# The server


@dataclass
class CompletionPrompt:
    """One prompt of a completions request: its token ids, the text it was sent as (None: sent as ids), and the
    request field it came from ("prompt", or "prompt[i]" in a batch), named in its errors."""

    ids: list[int]
    text: str | None
    param: str


@dataclass
class Job:
    """A validated generation request, ready for the engine."""

    prompt_ids: list[int]
    sampling: Any
    stream: bool
    include_usage: bool
    logprobs: int | None  # top alternatives per token when logprobs were asked for
    n: int = 1  # choices, each sampled on its own
    images: list = field(default_factory=list)  # vision.Prepared, one for each <|image|> token of prompt_ids


@dataclass
class ChatPrompt:
    """A chat request rendered (Server._chat_prompt): its token ids, the parser of its answer, what the parser
    already made of a forced start of the answer, the SamplingParams fields that hold its calls to their tools'
    schemas, and its images (vision.Prepared; the engine writes each one's <|image|> token out to its tokens)."""

    ids: list[int]
    parser: chat.StreamParser
    head: list[chat.Delta]
    held: dict
    images: list

    @property
    def length(self) -> int:
        return prompt_length(self.ids, self.images)


def prompt_length(ids: list[int], images: list) -> int:
    """A prompt's tokens, each image's counted (the engine writes its <|image|> out to them)."""
    return len(ids) + sum(im.tokens - 1 for im in images)


class Server:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.engine: Any = None
        self.loop: EngineLoop | None = None
        # the ids clients may send (vLLM's --served-model-name: several, e.g. Claude Code's main and small model);
        # replies name the first
        self.model_names: list[str] = list(args.served_model_name or [])
        self.model_path: Path | None = None
        self.defaults: dict[str, float] = {}
        self.metrics = Metrics()
        self.app = self._make_app()
        self.http = make_server(args.host, args.port, self.app, threaded=True)
        self.port = self.http.server_port

    # --- start-up ---------------------------------------------------------------------------

    def load(self) -> None:
        """Load the checkpoint (with progress bars), warm up, then open /health."""
        import engine as engine_mod
        import checkpoint
        import default_model

        a = self.args
        try:
            path = Path(default_model.ensure()) if a.model is None else checkpoint.resolve_model_path(a.model)
            self.model_path = path
            self.model_names = self.model_names or [default_model.NAME if a.model is None else
                                                    a.model.rstrip("/").split("/")[-1]]
            opts = {k: v for k, v in dict(max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
                                          max_batch_tokens=a.max_batch_tokens, max_cache_tokens=a.max_cache_tokens,
                                          speculator=a.speculator, drafter_path=a.drafter,
                                          draft_tokens=a.draft_tokens).items()
                    if v is not None}
            if a.model is None and a.speculator == "dflash2" and a.drafter is None:
                opts["drafter_path"] = default_model.shipped_drafter()  # trained against the built-in model
            dtype = getattr(torch, a.dtype) if a.dtype else None
            print(f"serve: loading {path} ({time.monotonic() - STARTED:.1f} s since start)", flush=True)
            self.engine = engine_mod.load(str(path), device=a.device, devices=a.devices, split_experts=a.split_experts,
                                          dtype=dtype, use_kernels=not a.no_kernels, fp8_core=a.fp8_core, **opts)
            self.engine_mod = engine_mod
            self.added_ids = set(self.engine.tokenizer.get_added_tokens_decoder())
            gen = path / "generation_config.json"
            gen_cfg = json.loads(gen.read_text()) if gen.is_file() else {}
            self.defaults = {k: gen_cfg[k] for k in ("temperature", "top_p", "top_k") if k in gen_cfg}
            t = time.monotonic()
            self._warm_up()
            print(f"serve: warm-up {time.monotonic() - t:.1f} s", flush=True)
        except Exception as e:
            self.load_error = f"{type(e).__name__}: {e}"
            raise
        self.loop = EngineLoop(self.engine, self.metrics)
        self.loop.thread.start()
        self.ready.set()
        print(f"serve: {self.model_name} ready in {time.monotonic() - STARTED:.1f} s on "
              f"http://{a.host}:{self.port}", flush=True)

    def _warm_up(self) -> None:
        # Prefill, decode and scoring each run once, so the first request pays no first-call cost.
        e = self.engine
        ids = e.tokenizer.encode("Hello, world. This warms up the engine.", add_special_tokens=False).ids
        e.generate([ids], self.engine_mod.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        e.score_logprobs(ids, 5)

    # --- flask ------------------------------------------------------------------------------

    def _make_app(self) -> Flask:
        app = Flask("glm53")
        app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES

        @app.errorhandler(ApiError)
        def api_error(e: ApiError):
            return Response(json.dumps(e.body(anthropic=request.path.startswith("/v1/messages"))), e.status,
                            mimetype="application/json")

        @app.errorhandler(HTTPException)
        def http_error(e: HTTPException):
            code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.code)
            return api_error(ApiError(e.code or 400, e.description or e.name, None, code))

        @app.errorhandler(Exception)
        def internal_error(e: Exception):
            traceback.print_exc()
            return api_error(ApiError(500, f"internal error: {type(e).__name__}", type="server_error"))

        @app.before_request
        def gate():
            if self.args.api_key and request.path != "/health":
                key = self.args.api_key  # OpenAI clients send a bearer token, Anthropic clients x-api-key
                if request.headers.get("Authorization", "") != f"Bearer {key}" and request.headers.get("x-api-key") != key:
                    raise ApiError(401, "missing or wrong API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')",
                                   None, "invalid_api_key", "authentication_error")
            if request.path not in ("/health", "/metrics") and not self.ready.is_set():
                raise ApiError(503, "the model is still loading; poll /health", None, "loading", "server_error")

        @app.after_request
        def count(resp: Response):
            self.metrics.count_request(request.url_rule.rule if request.url_rule else "other", resp.status_code)
            return resp

        app.add_url_rule("/health", view_func=self.health)
        app.add_url_rule("/metrics", view_func=self.metrics_text)
        app.add_url_rule("/reset_prefix_cache", view_func=self.reset_prefix_cache, methods=["POST"])
        app.add_url_rule("/tokenize", view_func=self.tokenize, methods=["POST"])
        app.add_url_rule("/detokenize", view_func=self.detokenize, methods=["POST"])
        app.add_url_rule("/v1/models", view_func=self.models)
        app.add_url_rule("/v1/models/<path:name>", view_func=self.model)
        app.add_url_rule("/v1/chat/completions", view_func=self.chat_completions, methods=["POST"])
        app.add_url_rule("/v1/completions", view_func=self.completions, methods=["POST"])
        app.add_url_rule("/v1/score", view_func=self.score, methods=["POST"])
        app.add_url_rule("/v1/messages", view_func=self.messages, methods=["POST"])
        app.add_url_rule("/v1/messages/count_tokens", view_func=self.count_tokens, methods=["POST"])
        app.add_url_rule("/v1/responses", view_func=self.responses, methods=["POST"])
        return app

    def health(self):
        if self.ready.is_set() and not self.loop.thread.is_alive():
            return Response(json.dumps({"status": "failed: the engine thread stopped"}), 503,
                            mimetype="application/json")
        if self.ready.is_set():
            return {"status": "ok", "model": self.model_name}
        status = "failed: " + self.load_error if self.load_error else "loading"
        return Response(json.dumps({"status": status}), 503, mimetype="application/json")

    def metrics_text(self):
        stats = self.loop.call(lambda e: e.stats()) if self.ready.is_set() else None
        return Response(self.metrics.render(stats), mimetype="text/plain; version=0.0.4")

    def reset_prefix_cache(self):
        """Every following request starts cold (benchmarks); requests in flight keep their cache."""
        self.loop.call(lambda e: e.reset_prefix_cache())
        return {"status": "ok"}

    @property
    def model_name(self) -> str | None:
        return self.model_names[0] if self.model_names else None

    def models(self):
        return {"object": "list", "data": [self._model_card(name) for name in self.model_names]}

    def model(self, name: str):
        self._check_model(name)
        return self._model_card(name if name in self.model_names else self.model_name)

    def _check_model(self, name: str | None) -> None:
        """A request's model: one of the served names, the --model it was loaded from, or none."""
        if name not in (None, *self.model_names, self.args.model):
            served = ", ".join(f"'{n}'" for n in self.model_names)
            raise ApiError(404, f"the model '{name}' does not exist; this server serves {served}", "model",
                           "model_not_found")

    def _model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "glm53",
                "max_model_len": self.engine.max_model_len}

    # --- request parsing --------------------------------------------------------------------

    def _body(self) -> dict:
        raw = request.get_data(cache=False)
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}", None, "invalid_json")
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", None, "invalid_json")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise ApiError(400, "'model' must be a string", "model", "invalid_type")
        self._check_model(model)
        return body

    def _job(self, body: dict, prompt_ids: list[int], logprobs: int | None, skip_special: bool,
             prompt_param: str, prompt: ChatPrompt | None = None) -> Job:
        """`prompt_param`: the request field the prompt came from, named when the prompt is too long; `prompt`: the
        chat prompt prompt_ids come from (its images, and the SamplingParams fields that hold its tool calls to their
        schemas, with the body's parallel_tool_calls)."""
        limit = self.engine.max_model_len
        images, held = (prompt.images, prompt.held) if prompt is not None else ([], None)
        keep = field_of(body, "truncate_prompt_tokens", "int", None, lambda v: v >= 1 or v == -1,
                        "must be >= 1 (the prompt's last tokens kept) or -1 (as many as the context holds)")
        if keep is not None and images:
            raise ApiError(400, "'truncate_prompt_tokens' cannot cut a prompt with images", "truncate_prompt_tokens",
                           "unsupported")
        if keep is not None:  # vLLM's: the prompt's start is cut off
            prompt_ids = prompt_ids[-(limit - 1 if keep == -1 else keep):]
        length = prompt_length(prompt_ids, images)  # (no image where the prompt was cut)
        if length >= limit:
            raise ApiError(400, f"the prompt has {length} tokens; this model's context is {limit} tokens "
                                f"(at most {limit - 1} for the prompt)", prompt_param,
                           "context_length_exceeded")
        max_tokens = field_of(body, "max_completion_tokens", "int", None, lambda v: v >= 1, "must be >= 1")
        max_tokens = field_of(body, "max_tokens", "int", max_tokens, lambda v: v >= 1, "must be >= 1")
        if max_tokens is not None and length + max_tokens > limit:
            raise ApiError(400, f"max_tokens {max_tokens} + {length} prompt tokens exceeds the context of "
                                f"{limit} tokens", "max_tokens", "context_length_exceeded")
        top_k = field_of(body, "top_k", "int", self.defaults.get("top_k", 0), lambda v: v >= -1,
                         "must be >= 0 (-1 or 0 is off)")
        stream_options = field_of(body, "stream_options", "dict", {})
        answer, _ = _answer_format(body)
        if answer and held and held.get("tool_calls_optional"):
            held = None  # strict tools under "auto" beside a held answer (JSON, a regex): it writes no call
        try:
            sampling = self.engine_mod.SamplingParams(
                max_tokens=max_tokens,
                temperature=field_of(body, "temperature", "number", self.defaults.get("temperature", 1.0),
                                     lambda v: 0 <= v <= 2, "must be between 0 and 2"),
                top_p=field_of(body, "top_p", "number", self.defaults.get("top_p", 1.0), lambda v: 0 < v <= 1,
                               "must be in (0, 1]"),
                top_k=max(top_k, 0),
                min_p=field_of(body, "min_p", "number", 0.0, lambda v: 0 <= v <= 1, "must be in [0, 1]"),
                presence_penalty=field_of(body, "presence_penalty", "number", 0.0, lambda v: -2 <= v <= 2,
                                          "must be between -2 and 2"),
                frequency_penalty=field_of(body, "frequency_penalty", "number", 0.0, lambda v: -2 <= v <= 2,
                                           "must be between -2 and 2"),
                repetition_penalty=field_of(body, "repetition_penalty", "number", 1.0, lambda v: v > 0,
                                            "must be > 0"),
                seed=field_of(body, "seed", "int"),
                stop=_stop_strings(body),
                stop_token_ids=field_of(body, "stop_token_ids", "list", [],
                                        lambda v: all(_is_int(t) and 0 <= t < self.engine.vocab_size for t in v),
                                        f"must list token ids below {self.engine.vocab_size}"),
                ignore_eos=field_of(body, "ignore_eos", "bool", False),
                include_stop_str_in_output=field_of(body, "include_stop_str_in_output", "bool", False),
                min_tokens=field_of(body, "min_tokens", "int", 0, lambda v: v >= 0, "must be >= 0"),
                logprobs=logprobs,
                skip_special_tokens=skip_special,
                thinking_token_budget=field_of(body, "thinking_token_budget", "int", self.args.thinking_token_budget,
                                               lambda v: v >= 0, "must be >= 0"),
                logit_bias=_logit_bias(body, self.engine.vocab_size),
                allowed_token_ids=field_of(body, "allowed_token_ids", "list", None,
                                           lambda v: v and all(_is_int(t) and 0 <= t < self.engine.vocab_size
                                                               for t in v),
                                           f"must list token ids below {self.engine.vocab_size} (at least one)"),
                parallel_tool_calls=field_of(body, "parallel_tool_calls", "bool", True),
                **answer,
                **(held or {}),
            )
        except ValueError as e:  # (engine.SamplingError names its field)
            raise ApiError(400, str(e), getattr(e, "field", None), "invalid_value")
        n = field_of(body, "n", "int", 1, lambda v: 1 <= v <= MAX_CHOICES, f"must be between 1 and {MAX_CHOICES}")
        return Job(prompt_ids, sampling, field_of(body, "stream", "bool", False),
                   bool(field_of(stream_options, "include_usage", "bool", False)), logprobs, n, images)

    # --- running a job ----------------------------------------------------------------------

    def _outputs(self, job: Job, sock: socket.socket | None) -> Iterator[Any]:
        """The engine's outputs for a job of one choice."""
        choices = self._choices([job], sock)
        try:
            for _, o in choices:
                yield o
        finally:
            choices.close()

    def _choices(self, jobs: list[Job], sock: socket.socket | None) -> Iterator[tuple[int, Any]]:
        """The engine's outputs for the jobs' choices (n each, numbered job by job: a completions batch's choices
        prompt by prompt, as OpenAI and vLLM number them), as (choice index, output) in the order they come;
        cancels the unfinished ones if the client goes away or stops reading. A seeded job's choice i has
        seed + i."""
        shared: queue.Queue = queue.Queue()
        pending = [self.loop.submit(job.prompt_ids, replace(job.sampling, seed=job.sampling.seed + i)
                                    if job.sampling.seed is not None else job.sampling, shared, job.images)
                   for job in jobs for i in range(job.n)]
        index = {p.request_id: i for i, p in enumerate(pending)}
        arrived = checked = time.monotonic()
        last: dict[int, float] = {}  # each choice's last token time
        unfinished = set(range(len(pending)))
        try:
            while True:
                try:
                    o = shared.get(timeout=POLL_S)
                except queue.Empty:
                    o = None
                now = time.monotonic()
                if now - checked >= POLL_S:
                    if _client_gone(sock):
                        return
                    checked = now
                if o is None:
                    if not self.loop.thread.is_alive():
                        raise ApiError(503, "the engine thread has stopped; see the server log", None, None,
                                       "server_error")
                    continue
                if isinstance(o, ApiError):
                    raise o
                i = index[o.request_id]
                if o.token_ids:
                    self.metrics.observe(self.metrics.itl if i in last else self.metrics.ttft,
                                         now - last.get(i, arrived))
                    last[i] = now
                if o.finished:
                    self.metrics.observe(self.metrics.e2e, now - arrived)
                    unfinished.discard(i)
                yield i, o
                if not unfinished:
                    return
        finally:
            for i in unfinished:
                self.loop.cancel(pending[i].request_id)

    def _logprob_entries(self, lps: list[Any] | None, n: int | None) -> list[dict]:
        if not lps:
            return []
        tok = self.engine.tokenizer

        def entry(tid: int, lp: float) -> dict:
            b = self.engine_mod.token_bytes(tok, tid, self.added_ids)
            return {"token": b.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(b)}

        return [{**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, v) for i, v in t.top[:n or 0]]}
                for t in lps]

    # --- /v1/chat/completions ---------------------------------------------------------------

    def chat_completions(self):
        body = self._body()
        prompt = self._openai_chat_prompt(body)
        parser, head = prompt.parser, prompt.head
        logprobs = field_of(body, "logprobs", "bool", False)
        top = field_of(body, "top_logprobs", "int", 0, lambda v: 0 <= v <= MAX_TOP_LOGPROBS,
                       f"must be between 0 and {MAX_TOP_LOGPROBS}")
        if top and not logprobs:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")
        job = self._job(body, prompt.ids, top if logprobs else None, skip_special=False, prompt_param="messages",
                        prompt=prompt)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        choices = self._choices([job], request.environ.get("werkzeug.socket"))
        # each choice parses its own answer; the head (a forced start) is already fed to the parser
        parsers = [parser] + [copy.deepcopy(parser) for _ in range(job.n - 1)]
        if job.stream:
            return self._sse(self._chat_chunks(choices, parsers, head, job, rid, created), choices)
        return self._chat_response(choices, parsers, head, job, rid, created)

    def _openai_chat_prompt(self, body: dict) -> ChatPrompt:
        """_chat_prompt for a chat completions request (messages, tools, tool_choice and the thinking fields)."""
        if not self.engine.chat_template:
            raise ApiError(400, "this checkpoint has no chat template; use /v1/completions", "messages", "unsupported")
        try:
            messages = chat.normalize_messages(body.get("messages"))
            tools = chat.check_tools(body.get("tools"))
            kwargs = field_of(body, "chat_template_kwargs", "dict", {})
            unknown = sorted(set(kwargs) - {"enable_thinking", "reasoning_effort", "clear_thinking"})
            if unknown:
                raise ApiError(400, f"chat_template_kwargs {unknown} are not supported (enable_thinking, "
                                    f"reasoning_effort, clear_thinking are)", "chat_template_kwargs", "unsupported")
            effort, enable = (body.get(k, kwargs.get(k)) for k in ("reasoning_effort", "enable_thinking"))
            thinking = chat.resolve_thinking(effort, enable)
        except chat.ChatError as e:
            raise ApiError(400, str(e), e.param, e.code)
        tool_choice = body.get("tool_choice") or ("auto" if tools else "none")
        answer, param = _answer_format(body)
        if (tool_choice == "required" or _named_choice(tool_choice)) and answer:
            raise ApiError(400, f"'{param}' cannot go with a tool_choice that forces a tool call: the answer would "
                                f"have to be both", param, "invalid_value")
        messages, prefill = _continued(body, messages, thinking.enabled and (effort is not None or enable is True))
        if prefill and answer:
            raise ApiError(400, f"'{param}' cannot go with 'continue_final_message': the held answer would start "
                                f"with text it was not held to", param, "invalid_value")
        if prefill:  # (the answer goes on after a closed think block, as a past turn without reasoning is written)
            thinking = chat.Thinking(enabled=False, effort=thinking.effort)
        extra = {"clear_thinking": field_of(kwargs, "clear_thinking", "bool")} if "clear_thinking" in kwargs else {}
        return self._chat_prompt(messages, tools, tool_choice, thinking, prefill, **extra)

    def _chat_prompt(self, messages: list[dict], tools: list[dict] | None, tool_choice: Any, thinking: chat.Thinking,
                     prefill: str = "", **extra: Any) -> ChatPrompt:
        """Checked messages and tools rendered: the held fields hold calls where tool_choice forces a call, or with
        "auto" where a tool is strict. `prefill`: the start of the answer a client wrote, after a closed think
        block; parsed but not returned (the client has it)."""
        images = self._images(messages)
        if tool_choice not in ("auto", "none", "required") and not _named_choice(tool_choice):
            raise ApiError(400, "'tool_choice' must be 'auto', 'none', 'required' or "
                                "{'type': 'function', 'function': {'name': ...}}", "tool_choice", "invalid_value")
        if tool_choice != "none" and not tools:
            raise ApiError(400, f"'tool_choice' {json.dumps(tool_choice)} needs 'tools'", "tool_choice", "invalid_value")
        forced, held = "", {}
        if tool_choice == "auto" and any(t["function"].get("strict") for t in tools or []):
            held = {"tool_calls": _held_tools(tools, "", strict_only=True), "tool_calls_optional": True}
        if tool_choice == "required" or _named_choice(tool_choice):
            # The answer is started with <tool_call>, which closes the think block first (these turns have no
            # reasoning), and the engine holds the calls to the tools' schemas (toolmode.py).
            name = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else ""
            if name and name not in [t["function"]["name"] for t in tools]:
                raise ApiError(400, f"tool_choice names '{name}', which is not in 'tools'", "tool_choice", "invalid_value")
            thinking = chat.Thinking(enabled=False, effort=thinking.effort)
            forced, held = chat.TOOL_START, {"tool_calls": _held_tools(tools, name)}
        if forced and prefill:
            raise ApiError(400, f"tool_choice {json.dumps(tool_choice)} starts the answer with a tool call, so the "
                                "final assistant message cannot start it too", "tool_choice", "invalid_value")
        try:
            text = chat.render(self.engine.chat_template, messages, tools if tool_choice != "none" else None,
                               thinking, **extra) + forced + prefill
        except chat.ChatError as e:
            raise ApiError(400, str(e), e.param, e.code)
        except Exception as e:  # the template itself rejected the conversation
            raise ApiError(400, f"the chat template could not render these messages: {e}", "messages", "invalid_value")
        prompt_ids = self.engine.tokenizer.encode(text, add_special_tokens=False).ids
        parser = chat.StreamParser(thinking.enabled, tools, parse_tools=tool_choice != "none")
        head = parser.feed(forced)
        parser.feed(prefill)
        return ChatPrompt(prompt_ids, parser, head, held, images)

    def _images(self, messages: list[dict]) -> list[vision.Prepared]:
        """The messages' images, decoded and resized into their canvases here (a request's handler thread; the
        engine's runs the tower): a 400 names the part that cannot be read, or the first image where the checkpoint
        has no vision tower."""
        at = [(f"messages[{i}].content[{j}]", part["image"]) for i, m in enumerate(messages)
              if isinstance(m.get("content"), list) for j, part in enumerate(m["content"])
              if isinstance(part, dict) and part.get("type") == "image"]
        if at and self.engine.vision is None:
            raise ApiError(400, f"'{at[0][0]}': this model has no vision tower (its checkpoint has no "
                                f"model.visual.* tensors), so it cannot read images", at[0][0], "unsupported")
        images = []
        for param, source in at:
            try:
                images.append(vision.prepare(source, self.engine.vision.cfg))
            except ValueError as e:
                raise ApiError(400, f"'{param}': {e}", param, "invalid_value")
        return images

    def _chat_response(self, choices, parsers: list[chat.StreamParser], head, job: Job, rid: str,
                       created: int) -> dict:
        deltas, lps, lasts = [list(head) for _ in parsers], [[] for _ in parsers], [None] * job.n
        for i, o in choices:
            deltas[i] += parsers[i].feed(o.text)
            lps[i] += o.logprobs or []
            lasts[i] = o
        if not all(o is not None and o.finished for o in lasts):
            raise ApiError(499, "the client went away", None, "cancelled")
        out = []
        for i, (parser, d, last) in enumerate(zip(parsers, deltas, lasts)):
            d += parser.finish()
            calls = [x.tool_call.to_openai() for x in d if x.kind == "tool_call"]
            content = "".join(x.text for x in d if x.kind == "content").rstrip() or None
            reasoning = "".join(x.text for x in d if x.kind == "reasoning") or None
            message = {"role": "assistant", "content": content, "reasoning_content": reasoning}
            if calls:
                message["tool_calls"] = calls
            out.append({"index": i, "message": message, "finish_reason": "tool_calls" if calls else last.finish_reason,
                        "logprobs": {"content": self._logprob_entries(lps[i], job.logprobs)}
                        if job.logprobs is not None else None})
        return {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                "choices": out, "usage": _usage(lasts)}

    def _chat_chunks(self, choices, parsers: list[chat.StreamParser], head, job: Job, rid: str,
                     created: int) -> Iterator[dict]:
        def chunk(i: int, delta: dict, finish: str | None = None, logprobs: list | None = None) -> dict:
            c = {"index": i, "delta": delta, "finish_reason": finish}
            if job.logprobs is not None:
                c["logprobs"] = {"content": logprobs or []}
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                    "choices": [c]}

        n_calls = [0] * job.n  # each choice numbers its own tool calls

        def deltas_to_chunks(i: int, deltas) -> Iterator[dict]:
            for d in deltas:
                if d.kind == "tool_call":
                    call = {"index": n_calls[i], **d.tool_call.to_openai()}
                    n_calls[i] += 1
                    yield chunk(i, {"tool_calls": [call]})
                else:
                    yield chunk(i, {"reasoning_content" if d.kind == "reasoning" else "content": d.text})

        for i in range(job.n):
            yield chunk(i, {"role": "assistant", "content": ""})
            yield from deltas_to_chunks(i, head)
        lasts = [None] * job.n
        for i, o in choices:
            lasts[i] = o
            parser = parsers[i]
            produced = list(deltas_to_chunks(i, parser.feed(o.text) + (parser.finish() if o.finished else [])))
            lps = self._logprob_entries(o.logprobs, job.logprobs)
            if lps and produced:
                produced[0]["choices"][0]["logprobs"] = {"content": lps}
            elif lps:
                produced = [chunk(i, {}, logprobs=lps)]
            yield from produced
            if o.finished:
                yield chunk(i, {}, "tool_calls" if n_calls[i] else o.finish_reason)
        if job.include_usage and all(o is not None and o.finished for o in lasts):
            yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                   "choices": [], "usage": _usage(lasts)}

    # --- /v1/messages (Anthropic) -----------------------------------------------------------

    def _translated_prompt(self, to_chat: Callable[[dict], chat.ChatRequest], body: dict, prompt_param: str
                           ) -> tuple[chat.ChatRequest, ChatPrompt]:
        """A Messages or Responses request (`to_chat` of messages_api or responses_api) in the chat path's terms,
        checked and rendered as chat completions are."""
        if not self.engine.chat_template:
            raise ApiError(400, "this checkpoint has no chat template; use /v1/completions", prompt_param, "unsupported")
        try:
            req = to_chat(body)
            messages, tools = chat.normalize_messages(req.messages), chat.check_tools(req.tools)
        except chat.ChatError as e:
            raise ApiError(400, str(e), e.param, e.code)
        return req, self._chat_prompt(messages, tools, req.tool_choice, req.thinking, req.prefill)

    def messages(self):
        req, prompt = self._translated_prompt(messages_api.to_chat, self._body(), "messages")
        left = self.engine.max_model_len - prompt.length
        if _is_int(req.options.get("max_tokens")) and left > 0:
            # Anthropic clients ask for one large max_tokens whatever the model's context (a maximum there,
            # not a promise): what the context leaves is the most this request can get.
            req.options["max_tokens"] = min(req.options["max_tokens"], left)
        job = self._job(req.options, prompt.ids, None, skip_special=False, prompt_param="messages",
                        prompt=prompt)
        outputs = self._outputs(job, request.environ.get("werkzeug.socket"))
        events = self._stream_events(messages_api.MessageStream(self.model_name, prompt.length), outputs,
                                     prompt.parser, prompt.head)
        if job.stream:
            return self._sse(events, outputs, api="anthropic")
        message = messages_api.fold(events)
        if message.get("stop_reason") is None:
            raise ApiError(499, "the client went away", None, "cancelled")
        return message

    def _stream_events(self, stream: Any, outputs, parser: chat.StreamParser,
                       head: list) -> Iterator[tuple[str, dict]]:
        """A messages_api.MessageStream's or a responses_api.ResponseStream's events for the engine's outputs."""
        yield from stream.start()
        yield from stream.feed(head)
        last = None
        for o in outputs:
            last = o
            yield from stream.feed(parser.feed(o.text) + (parser.finish() if o.finished else []))
        if last is not None and last.finished:
            yield from stream.finish(last)

    def count_tokens(self):
        # count_tokens takes a Messages request without max_tokens, which to_chat requires of one to generate.
        body = {"max_tokens": 1, **self._body()}
        return {"input_tokens": self._translated_prompt(messages_api.to_chat, body, "messages")[1].length}

    # --- /v1/responses (OpenAI's Responses API) ----------------------------------------------

    def responses(self):
        req, prompt = self._translated_prompt(responses_api.to_chat, self._body(), "input")
        job = self._job(req.options, prompt.ids, None, skip_special=False, prompt_param="input",
                        prompt=prompt)
        outputs = self._outputs(job, request.environ.get("werkzeug.socket"))
        events = self._stream_events(responses_api.ResponseStream(self.model_name, req.echo), outputs, prompt.parser,
                                     prompt.head)
        if job.stream:
            return self._sse(events, outputs, api="responses")
        last = None
        for last in events:
            pass
        if last is None or last[0] not in ("response.completed", "response.incomplete"):
            raise ApiError(499, "the client went away", None, "cancelled")
        return last[1]["response"]

    # --- /v1/completions --------------------------------------------------------------------

    def _completion_prompts(self, body: dict) -> list[CompletionPrompt]:
        """A completions request's `prompt`: text (encoded without special tokens), token ids, or a batch (an array
        of either, each a prompt with its own choices, as in OpenAI's API and vLLM)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            return [self._completion_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
        return [self._completion_prompt(prompt, "prompt")]

    def _completion_prompt(self, prompt: Any, param: str) -> CompletionPrompt:
        if isinstance(prompt, str) and prompt:
            prompt_ids = self.engine.tokenizer.encode(prompt, add_special_tokens=False).ids
        elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.engine.vocab_size]
            if bad:
                raise ApiError(400, f"'{param}': token ids {bad[:5]} are outside the vocabulary [0, "
                                    f"{self.engine.vocab_size})", param, "invalid_value")
            prompt_ids = list(prompt)
        else:
            batch = " (or an array of those, a batch)" if param == "prompt" else ""
            raise ApiError(400, f"'{param}' must be a non-empty string or a non-empty array of token ids{batch}",
                           param, "invalid_value")
        if not prompt_ids:
            raise ApiError(400, f"'{param}' encodes to no tokens", param, "invalid_value")
        return CompletionPrompt(prompt_ids, prompt if isinstance(prompt, str) else None, param)

    def completions(self):
        body = self._body()
        prompts = self._completion_prompts(body)
        echo = field_of(body, "echo", "bool", False)
        if body.get("suffix") is not None:
            raise ApiError(400, "'suffix' is not supported", "suffix", "unsupported")
        if field_of(body, "best_of", "int", 1) != 1:
            raise ApiError(400, "'best_of' other than 1 is not supported: this server samples one completion per "
                                "request", "best_of", "unsupported")
        logprobs = field_of(body, "logprobs", "int", None, lambda v: 0 <= v <= MAX_TOP_LOGPROBS,
                            f"must be between 0 and {MAX_TOP_LOGPROBS}")
        skip = field_of(body, "skip_special_tokens", "bool", True)
        score_only = echo and body.get("max_tokens") == 0  # the prompt's logprobs only (lm-eval's loglikelihood)
        # (a request that generates nothing is checked as one that generates a token)
        jobs = [self._job({**body, "max_tokens": 1} if score_only else body, p.ids, logprobs, skip_special=skip,
                          prompt_param=p.param) for p in prompts]
        # echo: each prompt's choices start with it (cut: truncate_prompt_tokens took its start off)
        heads = [self._echo(p.text, job.prompt_ids, logprobs, skip, len(job.prompt_ids) < len(p.ids)) if echo
                 else ("", None) for p, job in zip(prompts, jobs)]
        n, job = jobs[0].n, jobs[0]  # (the fields every prompt's job shares)
        total = n * len(jobs)  # choice k is prompt k // n's
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if score_only:
            choices = ((k, self.engine_mod.RequestOutput("", [], "", True, "length",
                                                         self.engine_mod.Usage(len(jobs[k // n].prompt_ids), 0, 0)))
                       for k in range(total))
        else:
            choices = self._choices(jobs, request.environ.get("werkzeug.socket"))

        def legacy_logprobs(lps, head: list[dict] | None) -> dict | None:
            if job.logprobs is None:
                return None
            entries = (head or []) + self._logprob_entries(lps, job.logprobs)
            return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                    "top_logprobs": [None if e["top_logprobs"] is None else
                                     {t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries]}

        def choice(k: int, text: str, finish: str | None, lps, head: list[dict] | None) -> dict:
            return {"index": k, "text": text, "finish_reason": finish, "logprobs": legacy_logprobs(lps, head)}

        if job.stream:
            def chunks() -> Iterator[dict]:
                lasts = [None] * total
                for k, o in choices:
                    text, head = heads[k // n] if lasts[k] is None else ("", None)  # echo: a choice's first
                    lasts[k] = o
                    yield {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                           "choices": [choice(k, text + o.text, o.finish_reason if o.finished else None, o.logprobs,
                                              head)]}
                if job.include_usage and all(o is not None and o.finished for o in lasts):
                    yield {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                           "choices": [], "usage": _usage(lasts, n)}
            return self._sse(chunks(), choices)
        texts, lps, lasts = [[heads[k // n][0]] for k in range(total)], [[] for _ in range(total)], [None] * total
        for k, o in choices:
            texts[k].append(o.text)
            lps[k] += o.logprobs or []
            lasts[k] = o
        if not all(o is not None and o.finished for o in lasts):
            raise ApiError(499, "the client went away", None, "cancelled")
        return {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": [choice(k, "".join(texts[k]), lasts[k].finish_reason, lps[k], heads[k // n][1])
                            for k in range(total)], "usage": _usage(lasts, n)}

    def _echo(self, sent: str | None, prompt_ids: list[int], logprobs: int | None, skip: bool,
              cut: bool) -> tuple[str, list[dict] | None]:
        """What an echoed choice starts with: the prompt's text (as `sent`, or its ids decoded: always where its start
        was cut off) and, when logprobs are asked for, its tokens' entries."""
        text = sent if sent is not None and not cut else self.engine.tokenizer.decode(prompt_ids,
                                                                                      skip_special_tokens=skip)
        return text, self._prompt_logprobs(prompt_ids, logprobs) if logprobs is not None else None

    def _prompt_logprobs(self, ids: list[int], n: int) -> list[dict]:
        """Logprob entries of a prompt's tokens, each given the tokens before it, with the n most likely tokens
        there; the first token's logprob is null (nothing comes before it), as in OpenAI's echo."""
        try:
            scored = self.loop.call(lambda e: e.score_logprobs(ids, n))
        except ValueError as e:
            raise ApiError(503, f"the prompt cannot be scored now: {e}", "prompt", "server_busy")
        chosen, top_ids, top_values = (t.tolist() for t in (scored.token_logprobs, scored.top_ids, scored.top_logprobs))
        lps = [self.engine_mod.TokenLogprob(t, c, list(zip(i, v)))
               for t, c, i, v in zip(ids[1:], chosen, top_ids, top_values)]
        b = self.engine_mod.token_bytes(self.engine.tokenizer, ids[0], self.added_ids)
        first = {"token": b.decode("utf-8", errors="replace"), "logprob": None, "bytes": list(b), "top_logprobs": None}
        return [first] + self._logprob_entries(lps, n)

    # --- /v1/score --------------------------------------------------------------------------

    def score(self):
        """Teacher-forced scoring: token ids in (no template, no BOS), log-probabilities out.

        Row t is the model's distribution for position t+1 given tokens 0..t. Each row reports the
        log-probability of the actual next token, the top_k alternatives and the probability mass
        outside them; with "full": true, all rows as little-endian float32 [T, vocab], base64.
        """
        body = self._body()
        ids = self._token_ids(body, "token_ids")
        if not ids:
            raise ApiError(400, "'token_ids' must be a non-empty array of integers", "token_ids", "invalid_value")
        vocab = self.engine.vocab_size
        if len(ids) > self.engine.max_model_len:
            raise ApiError(400, f"{len(ids)} tokens exceed the context of {self.engine.max_model_len}", "token_ids",
                           "context_length_exceeded")
        top_k = field_of(body, "top_k", "int", 5, lambda v: 0 <= v <= vocab, f"must be between 0 and {vocab}")
        full = field_of(body, "full", "bool", False)
        try:
            scored = self.loop.call(lambda e: e.score_logprobs(ids, top_k, full))
        except ValueError as e:
            raise ApiError(400 if "free cache blocks" not in str(e) else 503, str(e), "token_ids", "invalid_value")
        actual = scored.token_logprobs.tolist()
        rows = []
        for t in range(len(ids)):
            row = {"token_logprob": actual[t] if t + 1 < len(ids) else None}
            if top_k:
                row["top_ids"] = scored.top_ids[t].tolist()
                row["top_logprobs"] = scored.top_logprobs[t].tolist()
                row["rest_mass"] = max(0.0, 1.0 - float(scored.top_logprobs[t].exp().sum()))
            rows.append(row)
        out = {"object": "score", "model": self.model_name, "num_tokens": len(ids), "vocab_size": vocab,
               "positions": rows}
        if full:
            lp = scored.full
            out["full_logprobs"] = {"dtype": "float32", "shape": list(lp.shape),
                                    "data": base64.b64encode(lp.contiguous().numpy().astype("<f4").tobytes()).decode()}
        return out

    def _token_ids(self, body: dict, name: str) -> list[int]:
        ids = body.get(name)
        if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
            raise ApiError(400, f"'{name}' must be an array of integers", name, "invalid_value")
        bad = [t for t in ids if not 0 <= t < self.engine.vocab_size]
        if bad:
            raise ApiError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {self.engine.vocab_size})", name,
                           "invalid_value")
        return ids

    # --- /tokenize, /detokenize (vLLM's paths) ----------------------------------------------

    def tokenize(self):
        """The token ids a request's prompt becomes: a completions `prompt`, or a chat request's `messages`
        (with its tools and thinking fields) rendered as /v1/chat/completions renders them."""
        body = self._body()
        if "messages" in body:
            prompt = self._openai_chat_prompt(body)  # (its images' tokens written out, as the model reads them)
            ids = vision.write_out(prompt.ids, self.engine.vision.image_token_id, prompt.images)[0] \
                if prompt.images else prompt.ids
            return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids}
        prompts = self._completion_prompts(body)
        if len(prompts) > 1:
            raise ApiError(400, f"'prompt': /tokenize takes one prompt, got a batch of {len(prompts)}", "prompt",
                           "unsupported")
        ids = prompts[0].ids
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids}

    def detokenize(self):
        ids = self._token_ids(self._body(), "tokens")
        return {"prompt": self.engine.tokenizer.decode(ids, skip_special_tokens=False)}

    # --- SSE --------------------------------------------------------------------------------

    def _sse(self, events: Iterator[Any], outputs: Iterator[Any], api: str = "chat") -> Response:
        # Request validation happens before this, so bad requests still get a 4xx status; an error
        # after the first byte (the engine refusing the request) goes out as an error event.
        # Chat completions stream data lines ending in [DONE]; the Messages and Responses APIs name each
        # event ((name, data) pairs here) and have no end marker.
        named = api != "chat"

        def frame(e: Any) -> str:
            name, data = e if named else (None, e)
            return (f"event: {name}\n" if named else "") + f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        def error(e: ApiError) -> str:
            if api == "chat":
                return frame(e.body())
            data = e.body(anthropic=True) if api == "anthropic" else {"type": "error", **e.body()["error"]}
            return frame(("error", data))

        def body() -> Iterator[str]:
            try:
                for e in events:
                    yield frame(e)
                if not named:
                    yield "data: [DONE]\n\n"
            except ApiError as e:
                yield error(e)
            except Exception as e:  # a server bug after the 200 went out: say so in the stream
                traceback.print_exc()
                yield error(ApiError(500, f"internal error: {type(e).__name__}", type="server_error"))
            finally:
                # A client that disconnects ends up here (GeneratorExit): cancel its request.
                events.close()
                outputs.close()

        return Response(body(), mimetype="text/event-stream", headers={"Cache-Control": "no-cache"})

    # --- run --------------------------------------------------------------------------------

    def serve_in_thread(self) -> threading.Thread:
        t = threading.Thread(target=self.http.serve_forever, name="http", daemon=True)
        t.start()
        return t

    def shutdown(self) -> None:
        self.http.shutdown()
        if self.loop is not None:
            self.loop.stop()


def _continued(body: dict, messages: list[dict], asked_thinking: bool) -> tuple[list[dict], str]:
    """vLLM's continue_final_message: the messages before the final assistant one, and that one's text, the start
    of the answer (a prefill, as Anthropic's); add_generation_prompt false is taken only with it."""
    cont = field_of(body, "continue_final_message", "bool", False)
    gen = field_of(body, "add_generation_prompt", "bool")
    if not cont:
        if gen is False:
            raise ApiError(400, "'add_generation_prompt' false is supported only with 'continue_final_message' true "
                                "(the answer continues the final assistant message)", "add_generation_prompt",
                           "unsupported")
        return messages, ""
    if gen:
        raise ApiError(400, "'continue_final_message' continues the final assistant message, so "
                            "'add_generation_prompt' must be false (or absent)", "add_generation_prompt",
                       "invalid_value")
    last, at = messages[-1], f"messages[{len(messages) - 1}]"
    if last["role"] != "assistant":
        raise ApiError(400, f"'continue_final_message' continues the final message, which must be the assistant's; "
                            f"{at} is the {last['role']}'s", "continue_final_message", "invalid_value")
    if last.get("tool_calls") or last.get("reasoning_content"):
        raise ApiError(400, f"{at}: a continued assistant message may hold only text (no tool_calls, no "
                            f"reasoning_content)", at, "invalid_value")
    if asked_thinking:
        raise ApiError(400, "thinking cannot be enabled with 'continue_final_message': the continued answer comes "
                            "after the reasoning", "continue_final_message", "invalid_value")
    content = last["content"] or ""
    text = content if isinstance(content, str) else "".join(
        part if isinstance(part, str) else part["text"] for part in content)
    if not text:
        raise ApiError(400, f"{at}: a continued assistant message needs text to continue", at, "invalid_value")
    return messages[:-1], text


def _held_tools(tools: list[dict], name: str, strict_only: bool = False) -> dict:
    """SamplingParams.tool_calls: the tools a call may be of (all of them, or the one tool_choice names): name ->
    parameters, each checked by toolmode (a schema it cannot enforce is a 400 naming where); with strict_only,
    a tool not marked strict as True (its calls are not held)."""
    held = {}
    for i, t in enumerate(tools):
        fn = t["function"]
        if strict_only and not fn.get("strict"):
            held[fn["name"]] = True
        elif name in ("", fn["name"]):
            try:
                toolmode.compile_tools({fn["name"]: fn.get("parameters")})
            except jsonmode.SchemaError as e:
                at = e.path.removeprefix(fn["name"])  # "" (the name) or ".parameters..."
                param = f"tools[{i}].function{at or '.name'}"
                raise ApiError(400, f"'{param}': {e.reason} (a call is held to its tool's schema where tool_choice "
                                    f"forces one or the tool is strict)", param, "unsupported")
            held[fn["name"]] = fn.get("parameters")
    return held


def _named_choice(choice: Any) -> bool:
    return (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
            and isinstance(choice["function"].get("name"), str))


def _usage(lasts: list[Any], n: int | None = None) -> dict:
    """The usage of a request's finished choices (their final engine.RequestOutputs), n a prompt (None: all of one
    prompt): each prompt once (as its first choice saw the prefix cache), the completions summed; with a
    speculator, their drafts too (serving.md §1.6 asks for acceptance per request)."""
    us = [o.usage for o in lasts]
    firsts = us[::n or len(us)]
    prompt, completion = sum(u.prompt_tokens for u in firsts), sum(u.completion_tokens for u in us)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
             "prompt_tokens_details": {"cached_tokens": sum(u.cached_tokens for u in firsts)},
             "completion_tokens_details": {"reasoning_tokens": sum(u.reasoning_tokens for u in us)}}
    accs = [o.acceptance for o in lasts if o.acceptance is not None]
    if accs:
        steps, accepted = sum(a.verify_steps for a in accs), sum(a.accepted_tokens for a in accs)
        usage["speculative"] = {"verify_steps": steps, "draft_tokens": sum(a.draft_tokens for a in accs),
                                "accepted_tokens": accepted,
                                "mean_accepted_length": round((accepted + steps) / max(steps, 1), 4)}
    return usage


def _client_gone(sock: socket.socket | None) -> bool:
    """True when the peer closed the connection (a readable socket with nothing to read)."""
    if sock is None:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint folder or Hugging Face id (default: built-in tiny model)")
    ap.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                    help="the model ids clients may send; replies name the first (default: the folder's name)")
    ap.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    ap.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    ap.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    ap.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda if available)")
    ap.add_argument("--devices", default=None, type=_devices,
                    help="several devices for one model, e.g. cuda:0,cuda:1 (layers split between them)")
    ap.add_argument("--split-experts", action="store_true",
                    help="with --devices: also split the routed experts of every MoE layer between the devices")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="context limit in tokens (default: the model's max_position_embeddings, less where the cache "
                         "holds less)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="sequences in one batch")
    ap.add_argument("--max-batch-tokens", type=int, default=None, help="tokens in one forward")
    ap.add_argument("--max-cache-tokens", type=int, default=None, help="paged cache size in tokens")
    ap.add_argument("--speculator", default=None, choices=["none", "dflash2", "mtp"],
                    help="speculative decoding: a DFlash2 drafter (--drafter) or the checkpoint's MTP layer")
    ap.add_argument("--drafter", default=None, help="DFlash2 drafter folder or Hugging Face id (with --speculator dflash2)")
    ap.add_argument("--draft-tokens", type=int, default=None, help="fixed draft length (default: adaptive)")
    ap.add_argument("--fp8-core", default=None, choices=["amax", "pow2"],
                    help="run the non-routed projections in FP8 block-128 (BF16 ones quantized at load with this scale rule)")
    ap.add_argument("--thinking-token-budget", type=int, default=None, metavar="N",
                    help="at most N tokens of reasoning, then </think> is forced, for requests that set no budget "
                         "of their own (thinking_token_budget; thinking.budget_tokens on /v1/messages)")
    ap.add_argument("--no-kernels", action="store_true",
                    help="decode through model_glm's reference path (no fast decode step, no CUDA graphs)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: torch's choice; 1 is fastest for the tiny default model "
                         "on a busy machine)")
    args = ap.parse_args(argv)
    if args.device is not None and args.devices is not None:
        ap.error("give --device or --devices, not both")
    if args.split_experts and args.devices is None:
        ap.error("--split-experts needs --devices")
    if args.thinking_token_budget is not None and args.thinking_token_budget < 0:
        ap.error(f"--thinking-token-budget must be >= 0; got {args.thinking_token_budget}")
    return args


def _devices(text: str) -> tuple[torch.device, ...]:
    import placement  # with the engine's modules, after the port is open (see Server.load)
    try:
        return placement.parse_devices(text)
    except placement.PlacementError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    server = Server(args)
    print(f"serve: listening on http://{server.args.host}:{server.port} (/health turns ready after load)", flush=True)
    http = server.serve_in_thread()
    try:
        server.load()
    except Exception as e:
        print(f"serve: loading failed: {e}", file=sys.stderr, flush=True)
        server.shutdown()
        raise SystemExit(1)
    try:
        while http.is_alive():
            http.join(1.0)
    except KeyboardInterrupt:
        server.shutdown()


if __name__ == "__main__":
    main()

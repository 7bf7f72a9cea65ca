"""The generate loop: requests -> scheduler and block manager -> model forward -> sampling.

One `Engine.step()` is one scheduler iteration (nano-vllm's split, serving.md §4.1 and §5):
1. schedule: running sequences first (one decode token, or the next prefill chunk), then admit
   waiting ones, all under a token budget; when blocks run out the youngest running sequence is
   preempted (its cache is dropped and recomputed later);
2. run the chunks: single decode tokens through `fastdecode.FastDecoder` (one CUDA device: kernels
   in CUDA graphs), prefill chunks (and everything on CPU) through `GLMModel.forward`;
3. commit: hash the blocks that became full, snapshot the KDA slot where the prefix cache wants;
4. sample a token for every sequence whose chunk reached its last token, detokenize, check stops.
With a speculator (dflash.py: DFlash2 or MTP), a decoding sequence's chunk is its next token plus k
drafts; the same forward verifies them, the accepted drafts and the target's own token are emitted,
and what the rejected rows wrote is rolled back (`_speculative_step`).

The cache is hybrid (glm53.md §4.3-4.4): paged DSA blocks (latent, indexer keys, gate scores,
pooled keys) addressed through per-sequence block tables, plus one KDA slot (recurrent state and
conv window) per running sequence. The prefix cache therefore needs two things for a hit at a block
boundary: the DSA blocks before it (shared, refcounted, immutable once full, found by chained
hashes of their token ids) and a snapshot of the KDA slot taken at that boundary. A boundary the
cache wants inside a prefill chunk does not cut the chunk: the forward returns the KDA rows there
(SeqChunk.snapshots; the KDA pieces end at block boundaries anyway), and at a chunk's end the
snapshot is a copy of the slot. Either is copied to (pinned) CPU memory, ~141 MiB on the full model.
A later hit resumes from it with the arithmetic of a run cut there (the same up to the rounding of
products over fewer rows).
"""
from __future__ import annotations

import itertools
import json
import math
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Collection, Iterator, Sequence as Seq

import numpy as np
import torch
from tokenizers import Tokenizer

import cache as cache_mod
import chat
import dflash
import fastdecode
import fastprefill
import jsonmode
import kernels
import pattern
import placement
import toolmode
import vision
from cache import CachePool
from prefix_cache import BlockManager, SnapshotStore, block_hash
from model_glm import GLMConfig, GLMModel, KDASnapshot, SeqChunk, chunk_images

CPU_CACHE_TOKENS = 65536  # the cache pool's size when neither the caller nor CUDA memory sets it
# Tokens of one forward. An 8K prompt through the engine: 5.56K tok/s against 4.12K in 2048-token
# chunks (H200, full-size synthetic model, one process, BENCHMARKS.md session 17); a decode step
# waits for the chunk beside it.
MAX_BATCH_TOKENS = 8192
SCORE_ROWS = 256  # logit rows scored a block (Engine.score_blocks): 151 MiB of fp32 at the real vocabulary


# ---------------------------------------------------------------------------------------------
# Requests and results


class SamplingError(ValueError):
    """A SamplingParams field out of its range; `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass
class SamplingParams:
    """Per-request sampling. temperature 0 is greedy; top_k 0, top_p 1, min_p 0 switch a filter off.

    Order: `allowed_token_ids` (vLLM's: every other token at -inf), `logit_bias` (added to the model's logits, as
    OpenAI's field), then as vLLM: penalties, temperature, top_k, top_p, min_p. `stop_token_ids` are extra stop ids;
    the checkpoint's eos ids always stop unless `ignore_eos`. A stop string ends the text before it (after it with
    `include_stop_str_in_output`, vLLM's field). `min_tokens=n` (vLLM's): the first n tokens cannot stop the
    request: its stop tokens are drawn as if their logits were -inf, and a stop string that ends inside them does
    not count. `logprobs=n` returns the chosen token's log-probability and the n most likely tokens, from the
    model's distribution before any of the processing above.
    `thinking_token_budget=n`: when the prompt ends inside a think block (after `<think>`, with no
    `</think>` since), at most n tokens are generated inside it, counting those the prompt already has
    there; the next one is `</think>`, forced whatever was sampled (serving.md §1.2: a reasoning budget
    that answers instead of spending max_tokens on thinking).
    `json_object`: the answer (after the think block, if any) is one JSON object; each token is drawn among
    those that keep it one (jsonmode.py), and the request stops, "stop", when the object is complete.
    `json_schema`: the same, an object of this JSON Schema (the subset jsonmode.compile_schema enforces).
    `regex`: the answer is text that this regular expression matches whole (pattern.py's subset; vLLM's structured
    outputs `regex`); it may stop (a stop token) only where the text matches, and stops, "stop", where nothing can
    follow. `choice`: the same for the regex that matches exactly one of these strings (vLLM's `choice`).
    `tool_calls`: the answer is GLM's XML tool calls of these tools (name -> the JSON Schema of its parameters,
    None for none, True for calls not held), each held to its schema (toolmode.py); after a call the answer
    stops, or with `parallel_tool_calls` it may go on to another call or stop. A prompt that ends with
    `<tool_call>` has started the first call (serve.py forces it). `tool_calls_optional` (tool_choice auto):
    text may come first, and the answer may end without a call.
    """

    max_tokens: int | None = None  # None: until a stop or the context limit
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    thinking_token_budget: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # None: every token
    json_object: bool = False
    json_schema: dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    tool_calls: dict[str, dict | bool | None] | None = None
    parallel_tool_calls: bool = True
    tool_calls_optional: bool = False

    @property
    def reshapes(self) -> bool:
        """Whether the logits change before the temperature and filters (allowed_token_ids, logit_bias, penalties):
        a greedy row's token is then not the model's argmax."""
        return self.allowed_token_ids is not None or bool(self.logit_bias) or self.penalizes

    @property
    def penalizes(self) -> bool:
        """Whether a penalty changes the logits (it reads the prompt and the generated tokens)."""
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty or self.frequency_penalty)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]

        def bad(name: str, why: str) -> SamplingError:
            return SamplingError(name, f"SamplingParams.{name} = {getattr(self, name)!r}: {why}")

        def is_int(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        if self.max_tokens is not None and not (is_int(self.max_tokens) and self.max_tokens >= 1):
            raise bad("max_tokens", "must be an integer >= 1 (or None for no limit)")
        if not (is_num(self.temperature) and self.temperature >= 0):
            raise bad("temperature", "must be a finite number >= 0 (0 is greedy)")
        if not (is_int(self.top_k) and self.top_k >= 0):
            raise bad("top_k", "must be an integer >= 0 (0 keeps every token)")
        if not (is_num(self.top_p) and 0 < self.top_p <= 1):
            raise bad("top_p", "must be in (0, 1]")
        if not (is_num(self.min_p) and 0 <= self.min_p <= 1):
            raise bad("min_p", "must be in [0, 1]")
        if not (is_num(self.repetition_penalty) and self.repetition_penalty > 0):
            raise bad("repetition_penalty", "must be a finite number > 0 (1 is off)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (is_num(getattr(self, name)) and -2 <= getattr(self, name) <= 2):
                raise bad(name, "must be in [-2, 2]")
        if self.seed is not None and not is_int(self.seed):
            raise bad("seed", "must be an integer or None")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of token ids >= 0")
        if not (is_int(self.min_tokens) and self.min_tokens >= 0):
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be at most max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not (is_int(self.logprobs) and self.logprobs >= 0):
            raise bad("logprobs", "must be an integer >= 0 (the number of top alternatives) or None")
        if not isinstance(self.logit_bias, dict) or not all(
                is_int(t) and t >= 0 and is_num(b) and -100 <= b <= 100 for t, b in self.logit_bias.items()):
            raise bad("logit_bias", "must map token ids >= 0 to numbers in [-100, 100]")
        if self.allowed_token_ids is not None and not (isinstance(self.allowed_token_ids, list) and self.allowed_token_ids
                                                       and all(is_int(t) and t >= 0 for t in self.allowed_token_ids)):
            raise bad("allowed_token_ids", "must be a non-empty list of token ids >= 0 (or None for every token)")
        if self.json_schema is not None:
            try:
                jsonmode.object_schema(self.json_schema)
            except jsonmode.SchemaError as e:
                raise bad("json_schema", str(e)) from None
        if self.choice is not None and not (isinstance(self.choice, list) and self.choice
                                            and all(isinstance(c, str) and c for c in self.choice)):
            raise bad("choice", "must be a non-empty list of non-empty strings")
        if self.regex is not None:
            if not isinstance(self.regex, str):
                raise bad("regex", "must be a string")
            try:
                pattern.Pattern(self.regex, whole=True)
            except pattern.PatternError as e:
                raise bad("regex", str(e)) from None
        held = [name for name in ("json_object", "json_schema", "regex", "choice", "tool_calls")
                if getattr(self, name) not in (None, False)]
        if len(held) > 1:
            raise bad(held[1], f"the answer cannot be held to both {held[0]} and {held[1]}")
        if self.min_tokens and held:
            raise bad("min_tokens", f"cannot go with an answer a grammar holds ({held[0]}): it ends where the "
                                    f"grammar completes it")
        if self.tool_calls is not None:
            if not isinstance(self.tool_calls, dict) or not self.tool_calls:
                raise bad("tool_calls", "must map tool names to their parameters' schemas (None for none, True "
                                        "for calls not held)")
            try:
                toolmode.compile_tools(self.tool_calls)
            except jsonmode.SchemaError as e:
                raise bad("tool_calls", str(e)) from None
        if self.thinking_token_budget is not None and not (is_int(self.thinking_token_budget)
                                                           and self.thinking_token_budget >= 0):
            raise bad("thinking_token_budget", "must be an integer >= 0 (the tokens allowed inside <think>) or None")


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass
class PromptLogprobs:
    """Teacher-forced log-probabilities of T tokens, on the host (Engine.score_logprobs); row t is the
    model's distribution for position t+1 given tokens 0..t."""
    token_logprobs: torch.Tensor  # [T - 1]: log p(token t+1 | tokens 0..t)
    top_ids: torch.Tensor  # [T, n]: the n most likely tokens of each row, most likely first
    top_logprobs: torch.Tensor  # [T, n]
    full: torch.Tensor | None  # [T, vocab]: every log-probability, when asked for


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served by the prefix cache
    reasoning_tokens: int = 0  # completion tokens inside the think block (before </think>)


@dataclass
class Acceptance:
    """Speculative decoding of one request: verify steps, drafts verified, drafts accepted."""

    verify_steps: int
    draft_tokens: int
    accepted_tokens: int

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step (accepted drafts + the target's own token), dflash2.md §9.9."""
        return (self.accepted_tokens + self.verify_steps) / max(self.verify_steps, 1)


@dataclass
class RequestOutput:
    """What one step produced for one request: the new tokens and the new text (a delta)."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    usage: Usage | None = None  # set when finished
    logprobs: list[TokenLogprob] | None = None
    acceptance: Acceptance | None = None  # set when finished, if the engine speculates
    stop_string: str | None = None  # the stop string that ended it (finish_reason "stop"), if one did


@dataclass
class Result:
    text: str
    token_ids: list[int]  # completion tokens, including a stop token that ended it
    finish_reason: str
    usage: Usage
    logprobs: list[TokenLogprob] | None = None
    acceptance: Acceptance | None = None


@dataclass
class EngineStats:
    running: int
    waiting: int
    blocks_used: int
    blocks_total: int
    blocks_cached: int  # free blocks that still hold a reusable full block
    snapshots: int
    snapshot_bytes: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    prompt_tokens_computed: int
    tokens_generated: int
    preemptions: int
    speculator: str  # "none" | "dflash2" | "mtp"
    spec_verify_steps: int
    spec_draft_tokens: int  # drafts verified
    spec_accepted_tokens: int


# ---------------------------------------------------------------------------------------------
# Sampling


GRAMMAR_CANDIDATES = 64  # a held answer's token is first sought among this many of its row's race leaders
TOP_P_CANDIDATES = 1024  # a top_p row without top_k is cut among this many of its most likely tokens when it can be


def penalized_rows(logits: torch.Tensor, params: Seq[SamplingParams], prompt_ids: Seq[torch.Tensor],
                   output_ids: Seq[torch.Tensor | list[int]]) -> torch.Tensor:
    """fp32 [N, vocab] logits, row i under params[i] -> the rows after its allowed_token_ids, logit_bias and
    penalties, which see prompt_ids[i] and output_ids[i] (a tensor or a list, moved to the device only when a
    penalty reads it)."""
    x = logits.float()
    N, V = x.shape
    for i, p in enumerate(params):
        if p.allowed_token_ids is not None:
            x = x.clone() if x is logits else x
            keep = torch.full((V,), -math.inf, device=x.device)
            keep[fastdecode.to_device(p.allowed_token_ids, x.device)] = 0.0
            x[i] += keep
        if p.logit_bias:
            x = x.clone() if x is logits else x
            x[i, fastdecode.to_device(list(p.logit_bias), x.device)] += \
                fastdecode.to_device(list(p.logit_bias.values()), x.device, torch.float32)
        if p.repetition_penalty == 1.0 and not ((p.presence_penalty or p.frequency_penalty) and len(output_ids[i])):
            continue
        x = x.clone() if x is logits else x
        out = output_ids[i]
        out = out.to(x.device) if isinstance(out, torch.Tensor) else fastdecode.to_device(out, x.device)
        if p.repetition_penalty != 1.0:
            # CTRL-style: seen tokens (prompt and output) get less likely whatever the logit's sign.
            seen = torch.cat([prompt_ids[i], out]).unique()
            v = x[i, seen]
            x[i, seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and out.numel():
            counts = torch.bincount(out, minlength=V).to(x.dtype)
            x[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(x.dtype)
    return x


@dataclass
class SamplingColumns:
    """Each row's temperature and filter bounds, fp32 [N, 4] on the device in one transfer; a filter
    that is off gets the bound that removes nothing, temperature 0 divides by 1 (its draw is the argmax)."""
    cols: torch.Tensor

    @classmethod
    def of(cls, params: Seq[SamplingParams], vocab: int, device: torch.device) -> "SamplingColumns":
        rows = [[p.temperature if p.temperature > 0 else 1.0, p.top_k if 0 < p.top_k < vocab else 0,
                 p.top_p if p.top_p < 1.0 else math.inf, math.log(p.min_p) if p.min_p > 0 else -math.inf]
                for p in params]
        return cls(fastdecode.to_device(rows, device, torch.float32))

    temperature = property(lambda self: self.cols[:, 0:1])
    top_k = property(lambda self: self.cols[:, 1:2].long())
    top_p = property(lambda self: self.cols[:, 2:3])
    log_min_p = property(lambda self: self.cols[:, 3:4])


def filter_rows(x: torch.Tensor, params: Seq[SamplingParams]) -> torch.Tensor:
    """fp32 [N, vocab] penalized rows -> the logits sampling draws from: divided by the temperature, -inf
    where a filter removed a token: top_k, then top_p over what top_k kept, then min_p. Every filter runs
    on all rows at once."""
    N, V = x.shape
    if all(p.temperature in (0.0, 1.0) and not 0 < p.top_k < V and p.top_p >= 1.0 and p.min_p <= 0 for p in params):
        return x  # nothing to divide or remove (temperature alone at 1: the OpenAI default)
    f = SamplingColumns.of(params, V, x.device)
    x = x / f.temperature
    if any(0 < p.top_k < V for p in params):
        kth = x.topk(max(p.top_k for p in params if 0 < p.top_k < V), -1).values.gather(1, (f.top_k - 1).clamp(min=0))
        x = x.masked_fill(x < torch.where(f.top_k > 0, kth, -math.inf), -math.inf)  # ties with the k-th stay
    if any(p.top_p < 1.0 for p in params):
        # Keep the smallest head of the sorted row whose mass reaches top_p (the mass before a dropped
        # token already reaches it); top_p 1 keeps everything, rounding or not.
        sorted_x, order = torch.sort(x, -1, descending=True)
        probs = torch.softmax(sorted_x, -1)
        drop = probs.cumsum(-1) - probs >= f.top_p
        x = torch.empty_like(x).scatter_(1, order, sorted_x.masked_fill(drop, -math.inf))
    if any(p.min_p > 0 for p in params):
        # p < min_p * p_max, in logits: the softmax's normalizer cancels.
        x = x.masked_fill(x - x.max(-1, keepdim=True).values < f.log_min_p, -math.inf)
    return x


def process_rows(logits: torch.Tensor, params: Seq[SamplingParams], prompt_ids: Seq[torch.Tensor],
                 output_ids: Seq[torch.Tensor | list[int]]) -> torch.Tensor:
    """The logits each row draws from: its penalties, temperature and filters (penalized_rows, filter_rows)."""
    return filter_rows(penalized_rows(logits, params, prompt_ids, output_ids), params)


def process_logits(logits: torch.Tensor, p: SamplingParams, prompt_ids: torch.Tensor,
                   output_ids: torch.Tensor) -> torch.Tensor:
    """process_rows for one row of fp32 [vocab] logits."""
    return process_rows(logits[None], [p], [prompt_ids], [output_ids])[0]


def hold_stops(rows: torch.Tensor, stops: Seq[Collection[int]]) -> torch.Tensor:
    """fp32 [N, vocab] rows with the tokens of stops[i] at -inf in row i (min_tokens: a request that may not stop
    yet); a copy where any are, the rows themselves where none are."""
    at = [(i, t) for i, ts in enumerate(stops) for t in ts]
    if not at:
        return rows
    rows, (i, t) = rows.clone(), zip(*at)
    rows[fastdecode.to_device(list(i), rows.device), fastdecode.to_device(list(t), rows.device)] = -math.inf
    return rows


def race_noise(params: Seq[SamplingParams], generators: Seq[torch.Generator], vocab: int,
               device: torch.device) -> torch.Tensor:
    """[N, vocab] Exp(1) draws, one per token, from each row's own generator (1 for a temperature-0 row)."""
    noise = torch.empty(len(params), vocab, device=device)
    for row, p, g in zip(noise, params, generators):
        if p.temperature > 0:
            row.exponential_(generator=g)
        else:
            row.fill_(1.0)
    return noise


def race_scores(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """x - log noise: each token's time in the race (the largest wins). (Noise 0, possible in fp32, would let
    any token win, a removed one included: it counts as the smallest float.)"""
    return x - noise.clamp(min=torch.finfo(torch.float32).tiny).log()


def race(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(x - log noise) of each row: a draw from softmax(x) (the Gumbel-max trick, as exponential
    races), the argmax for noise 1. The noise belongs to the token, not to a position in some list of
    candidates, so any way of cutting a row that keeps the same tokens draws the same one."""
    return race_scores(x, noise).argmax(-1)


def draw_on_device(logits: torch.Tensor, params: Seq[SamplingParams], prompt_ids: Seq[torch.Tensor],
                   output_ids: Seq[torch.Tensor | list[int]], generators: Seq[torch.Generator],
                   kernel: bool | None = None) -> torch.Tensor:
    """One token per row of fp32 [N, vocab] logits, as an int64 tensor [N] on their device:
    race(process_rows(...), race_noise(...)), the argmax at temperature 0, a draw from the filtered softmax
    with the row's generator otherwise (so a seeded request draws the same tokens whatever else is in the
    batch). Nothing is read back, so more work can queue behind the draw (Engine._launch_ahead).

    With kernel (default: on a GPU) a batch with a row cut by top_k or top_p is drawn by kernels.sample_race
    without process_rows' sort of the whole vocabulary: such a row races among its most likely tokens
    (its top_k, or TOP_P_CANDIDATES for top_p alone), and over its whole row where its kept set may reach
    past them. A batch without such rows races over whole rows in torch (the kernel's one program a row
    streams them slower: 337 against ~200 us at batch 1 on the H200)."""
    if all(p.temperature == 0 and not p.reshapes for p in params):
        return logits.argmax(-1)  # what the filters would give: none removes the most likely token
    x = penalized_rows(logits, params, prompt_ids, output_ids)
    V = x.shape[1]
    noise = race_noise(params, generators, V, x.device)
    cut = [p.top_k if 0 < p.top_k < V else TOP_P_CANDIDATES for p in params if 0 < p.top_k < V or p.top_p < 1.0]
    c = min(V, 1 + max(cut, default=0))
    if cut and (x.is_cuda if kernel is None else kernel) and c <= kernels.SAMPLE_MAX_CANDIDATES:
        return kernels.sample_race(x, noise, SamplingColumns.of(params, V, x.device).cols, c)
    return race(filter_rows(x, params), noise)


def sample_rows(logits: torch.Tensor, params: Seq[SamplingParams], prompt_ids: Seq[torch.Tensor],
                output_ids: Seq[torch.Tensor | list[int]], generators: Seq[torch.Generator],
                kernel: bool | None = None) -> list[int]:
    """draw_on_device's tokens, read back (one device sync)."""
    return draw_on_device(logits, params, prompt_ids, output_ids, generators, kernel).tolist()


def sample(logits: torch.Tensor, p: SamplingParams, prompt_ids: torch.Tensor, output_ids: torch.Tensor,
           generator: torch.Generator) -> int:
    """sample_rows for one row of fp32 [vocab] logits."""
    return sample_rows(logits[None], [p], [prompt_ids], [output_ids], [generator])[0]


def logprob_rows(logits: torch.Tensor, tokens: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """For rows of [N, vocab] logits and their tokens [N], on the logits' device (nothing read back): each
    token's log-probability [N], and the ids and log-probabilities of each row's n most likely tokens [N, n]."""
    lp = torch.log_softmax(logits.float(), -1)
    top = torch.topk(lp, min(n, lp.shape[-1]), -1)
    return lp.gather(1, tokens[:, None])[:, 0], top.indices, top.values


def read_logprob(token: int, chosen: torch.Tensor, ids: torch.Tensor, values: torch.Tensor, n: int) -> TokenLogprob:
    """One row of logprob_rows as a TokenLogprob, its first n most likely tokens."""
    return TokenLogprob(token, float(chosen), list(zip(ids[:n].tolist(), values[:n].tolist())))


def token_logprobs(logits: torch.Tensor, token: int, n: int) -> TokenLogprob:
    """logprob_rows for one row of [vocab] logits."""
    rows = logprob_rows(logits[None], torch.tensor([token], device=logits.device), n)
    return read_logprob(token, *(r[0] for r in rows), n)


# ---------------------------------------------------------------------------------------------
# Detokenization


class Detokenizer:
    """Incremental decode that only emits text once its UTF-8 bytes are complete.

    Byte-level BPE can split one character over several tokens; decoding such a prefix gives
    U+FFFD. Decode a short window (from `prefix` on) and emit the part past the already-emitted
    window only when it does not end in U+FFFD (the approach of HF TGI and vLLM).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = self.read = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.prefix:self.read], skip_special_tokens=self.skip)
        after = self.tokenizer.decode(self.ids[self.prefix:], skip_special_tokens=self.skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]


def _byte_decoder() -> dict[str, int]:
    """Inverse of the GPT-2 byte-to-unicode map that byte-level BPE vocabularies are written in."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


BYTE_DECODER = _byte_decoder()


def token_bytes(tokenizer: Tokenizer, token_id: int, added: set[int] | frozenset[int] = frozenset()) -> bytes:
    """The raw bytes one token stands for (OpenAI logprobs' `bytes`); `added` are the added-token ids,
    whose text is stored as is rather than byte-mapped."""
    piece = tokenizer.id_to_token(token_id)
    if piece is None:
        return b""
    if token_id not in added and all(ch in BYTE_DECODER for ch in piece):
        return bytes(BYTE_DECODER[ch] for ch in piece)
    return piece.encode("utf-8")


# ---------------------------------------------------------------------------------------------
# Sequences


# the automata that hold an answer: a JSON object's, tool calls', a regular expression's
Grammar = jsonmode.JsonPrefix | toolmode.ToolCallPrefix | pattern.RegexPrefix


@dataclass
class PromptImage:
    """An image of a prompt: its first position and the image made ready for the tower (its canvas's pixels, token
    count, and the digest the prefix cache's block hashes take in). Its rows are the tower's run, made when a chunk
    first needs them (Engine._run_tower): an image the prefix cache holds runs no tower."""
    start: int
    image: vision.Prepared

    @property
    def end(self) -> int:
        return self.start + self.image.tokens

    def meets(self, lo: int, hi: int) -> bool:
        """Whether the image has a position in [lo, hi)."""
        return self.start < hi and self.end > lo

    @property
    def digest(self) -> bytes:
        return self.image.digest


@dataclass(eq=False)  # a sequence is itself: `in` / remove on the running list compare identities, not every field
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt then output
    prompt_len: int
    params: SamplingParams
    stop_ids: frozenset[int]
    generator: torch.Generator
    detok: Detokenizer
    prompt_tensor: torch.Tensor
    outputs: list[int] = field(default_factory=list)  # the generated tokens (output_ids)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of the full blocks of token_ids
    snapshot_at: set[int] = field(default_factory=set)  # boundaries (token counts) to snapshot
    slot: int = -1
    num_computed: int = 0  # tokens whose cache entries exist
    cached_tokens: int = -1  # prefix-cache hit of the first admission
    draft_stats: dflash.DraftStats | None = None  # set when the engine speculates
    k: int = 0  # drafts planned for this step
    draft: dflash.Draft | None = None  # this step's drafts
    text: str = ""
    emitted: int = 0  # characters of text already returned
    finish_reason: str | None = None
    stop_string: str | None = None
    thinking: bool = False  # inside a think block (the prompt's last <think> is open; no </think> generated yet)
    thought: int = 0  # tokens inside that block so far, the prompt's included
    reasoning_tokens: int = 0  # generated inside it
    grammar: Grammar | None = None  # the answer so far, where one holds it
    images: list[PromptImage] = field(default_factory=list)  # the prompt's, in order
    # block_table's mirror for table(): the list it mirrors, and its first `_mirrored` entries
    _table: np.ndarray = field(default_factory=lambda: np.zeros(16, dtype=np.int64), repr=False)
    _table_of: list[int] | None = field(default=None, repr=False)
    _mirrored: int = 0

    @property
    def output_ids(self) -> list[int]:
        """token_ids past the prompt, kept as a list of their own (read it, do not change it): a slice
        of token_ids would copy a 32K-token reply (~0.15 ms) twice a step."""
        return self.outputs

    def table(self) -> torch.Tensor:
        """block_table as a CPU int64 tensor, copied from a numpy mirror that only takes in the blocks
        added since the last call: torch.tensor of a 128K-token context's 2048 block ids took ~0.4 ms
        of host time a step, the GPU's idle time. The list grows by appends, which keep the mirrored
        prefix, and shrinks through drop_blocks; a new list (admission, preemption) is mirrored anew."""
        n = len(self.block_table)
        if self._table_of is not self.block_table:
            self._table_of, self._mirrored = self.block_table, 0
        if n > self._table.shape[0]:
            grown = np.zeros(max(n, 2 * self._table.shape[0]), dtype=np.int64)
            grown[:self._mirrored] = self._table[:self._mirrored]
            self._table = grown
        self._table[self._mirrored:n] = self.block_table[self._mirrored:n]
        self._mirrored = n
        return torch.from_numpy(self._table[:n].copy())

    def drop_blocks(self, keep: int) -> list[int]:
        """Cut block_table to its first `keep` blocks; returns the blocks cut off."""
        dropped = self.block_table[keep:]
        del self.block_table[keep:]
        self._mirrored = min(self._mirrored, keep)
        return dropped


def draw_args(seqs: Seq[Sequence]) -> tuple[list, list, list, list]:
    """draw_on_device's arguments for these sequences' rows: params, prompt ids, output ids, generators."""
    return ([s.params for s in seqs], [s.prompt_tensor for s in seqs], [s.output_ids for s in seqs],
            [s.generator for s in seqs])


@dataclass
class Ahead:
    """A decode step launched before the host read the tokens it decodes (Engine._launch_ahead): its
    sequences, one token each, in the rows of its logits."""
    batch: list[tuple[Sequence, int]]
    logits: torch.Tensor


# ---------------------------------------------------------------------------------------------
# Engine


class Engine:
    """Continuous batching over a paged hybrid cache. Not thread-safe: one thread calls step()."""

    def __init__(self, model: GLMModel, tokenizer: Tokenizer, *, eos_token_ids: Seq[int],
                 chat_template: str | None = None, num_blocks: int | None = None,
                 max_cache_tokens: int | None = None, memory_fraction: float = 0.9, max_num_seqs: int = 16,
                 max_batch_tokens: int = MAX_BATCH_TOKENS, block_size: int = 64, max_model_len: int | None = None,
                 snapshot_bytes: int = 4 << 30, snapshot_device: str | torch.device = "cpu",
                 speculator: str = "none", drafter: dflash.DFlash2Drafter | None = None,
                 draft_tokens: int | None = None, draft_row_cost: float = 0.25, use_kernels: bool = True,
                 vision_tower: vision.VisionTower | None = None):
        """speculator: "none", "dflash2" (needs `drafter`) or "mtp" (the checkpoint's layer 45).
        Draft length per step: `draft_tokens` if given, else adaptive (dflash.draft_length with
        `draft_row_cost`, the cost of one more verify row relative to a decode step; 0.25 is CuteAFD's
        GLM-Flash table, 8 rows = 2.8x one row, dflash2.md §6.3).
        use_kernels: on one CUDA device, plain decode steps run fastdecode.FastDecoder's kernels in
        CUDA graphs captured here (batch 1..max_num_seqs, context buckets up to max_model_len) and
        prefill chunks (and a speculator's verify passes) run fastprefill.FastPrefill's; False runs
        every step through model_glm's reference path.
        max_batch_tokens: the tokens of one forward (prefill chunks and decode tokens together). When
        CUDA memory sizes the cache, one chunk of that many tokens runs first (`_chunk_peak`) and the
        memory it takes is kept out of the pool.
        max_model_len: the context limit, at most (and by default) the model's max_position_embeddings; the
        cache's size caps it too.
        vision_tower: reads the images of a prompt (vision.py; None: a prompt with images is refused)."""
        self.model, self.tokenizer, self.chat_template = model, tokenizer, chat_template
        self.config: GLMConfig = model.config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.think_start, self.think_end = (tokenizer.token_to_id(t) for t in (chat.THINK_START, chat.THINK_END))
        self.tool_tags = {t: tokenizer.token_to_id(t) for t in toolmode.TAGS}  # None where not one token
        self._vocab_bytes: list[bytes | None] | None = None
        self._tagged: dict[type, list[bytes | None]] = {}  # by grammar: _grammar_bytes
        self._sorted: dict[type, jsonmode.Vocabulary] = {}  # by grammar, built on the first row that needs it
        self.vocab_size = self.config.vocab_size
        self.device, self.dtype = model.weights["embed_tokens.weight"].device, model.dtype
        if block_size <= 0 or block_size % self.config.index_kpool:
            raise ValueError(f"block_size {block_size} must be a positive multiple of index_kpool "
                             f"{self.config.index_kpool} so no k-pool straddles a block boundary")
        if max_batch_tokens < 1 or max_num_seqs < 1:
            raise ValueError(f"max_batch_tokens ({max_batch_tokens}) and max_num_seqs ({max_num_seqs}) must be >= 1")
        self.block_size, self.max_num_seqs, self.max_batch_tokens = block_size, max_num_seqs, max_batch_tokens
        trained = self.config.max_position_embeddings
        if max_model_len is not None and not 0 < max_model_len <= trained:
            raise ValueError(f"max_model_len={max_model_len} must be in [1, {trained}]: the model's "
                             f"max_position_embeddings (config.json), past which its positions were never trained")
        max_model_len = max_model_len or trained
        num_slots = max_num_seqs + 1  # the last slot belongs to score(), so scoring never waits
        plan = model.placement
        # Per-block and per-slot bytes of each device's cache rows (its layers' rows).
        per_device = [[0, 0] for _ in plan.devices]
        for L, d in enumerate(plan.layer_device):
            b, s = cache_mod.layer_bytes(self.config, L, block_size, self.dtype)
            per_device[d][0] += b
            per_device[d][1] += s
        block_bytes, slot_bytes = sum(b for b, _ in per_device), sum(s for _, s in per_device)
        self.chunk_peak = [0] * len(plan.devices)
        if num_blocks is None and max_cache_tokens is None and any(d.type == "cuda" for d in plan.devices):
            # the longest context this engine could serve: the pool sized as if the chunk took nothing
            longest = self._size_pool(None, None, memory_fraction, per_device, num_slots) * block_size
            self.chunk_peak = self._chunk_peak(use_kernels, min(longest, max_model_len))
        num_blocks = self._size_pool(num_blocks, max_cache_tokens, memory_fraction, per_device, num_slots)
        self.cache = CachePool(self.config, num_blocks, num_slots, block_size=block_size, dtype=self.dtype,
                               device=list(plan.devices), layer_device=dict(enumerate(plan.layer_device)))
        snapshot_size = self.cache.kda_bytes_per_sequence()
        if 0 < snapshot_bytes < snapshot_size:
            raise ValueError(f"snapshot_bytes={snapshot_bytes} cannot hold one KDA snapshot ({snapshot_size} bytes); "
                             f"0 turns the prefix cache off")
        self.max_model_len = min(max_model_len, num_blocks * block_size)
        print(f"engine: cache {num_blocks} blocks x {block_size} tokens, {block_bytes / block_size:.0f} B/token, "
              f"{slot_bytes / 2**20:.1f} MiB per sequence (KDA state, indexer tails), {num_slots} slots, "
              f"{(num_blocks * block_bytes + num_slots * slot_bytes) / 2**30:.3f} GiB; context {self.max_model_len}")
        # Speculative steps verify several rows per sequence: FastPrefill runs them (eagerly), and no
        # decode graphs are captured.
        self.use_kernels = use_kernels  # the sampler's kernel too
        self.vision = vision_tower
        self.image_rows: dict[bytes, torch.Tensor] = {}  # the tower's rows of images still to compute, by digest
        self.fast = self._fast_decoder(max_num_seqs) if use_kernels and speculator == "none" else None
        self.prefill = self._fast_prefill(self.cache, self.max_model_len, self.fast) if use_kernels else None
        if self.prefill is not None:
            self.prefill.reserve(self.max_model_len)
        if speculator != "none" and self.device.type == "cuda":
            print(f"engine: speculator {speculator!r}: verify passes run without CUDA graphs and the drafter and "
                  "rollback in torch; on an H200 this decodes 7-14x slower than speculator='none' (BENCHMARKS.md)")
        self.blocks = BlockManager(num_blocks, SnapshotStore(snapshot_bytes, torch.device(snapshot_device)))
        if self.cache.kda_state.device.type == "cuda":
            self.blocks.snapshots.pin(self.cache.kda_state[:, 0], self.cache.conv_state[:, 0])
        self.free_slots = list(range(max_num_seqs))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}
        self.cancelled: list[RequestOutput] = []
        self.ahead: Ahead | None = None
        self.ids = itertools.count()
        self.counters = dict(prefix_query_tokens=0, prefix_hit_tokens=0, prompt_tokens_computed=0,
                             tokens_generated=0, preemptions=0, spec_verify_steps=0, spec_draft_tokens=0,
                             spec_accepted_tokens=0)
        self.speculator_name = speculator
        self.speculator = self._make_speculator(speculator, drafter)
        rejectable = cache_mod.TAIL_RING - (self.config.index_kpool - 1)
        if self.speculator and self.speculator.max_draft > rejectable:
            raise ValueError(f"speculator {speculator!r} drafts up to {self.speculator.max_draft} tokens; a verify "
                             f"pass may reject at most {rejectable} (the DSA layers' tail ring, cache.TAIL_RING)")
        if draft_tokens is not None and not (self.speculator and 1 <= draft_tokens <= self.speculator.max_draft):
            raise ValueError(f"draft_tokens={draft_tokens}: needs a speculator and 1..max drafts "
                             f"({self.speculator.max_draft if self.speculator else 0})")
        self.draft_tokens, self.draft_row_cost = draft_tokens, draft_row_cost

    def _make_speculator(self, name: str, drafter: dflash.DFlash2Drafter | None):
        if name == "none":
            return None
        if name == "mtp":
            return dflash.MTPDrafter(self.model, self.cache)
        if name == "dflash2":
            if drafter is None:
                raise ValueError("speculator 'dflash2' needs a drafter (engine.load(..., drafter_path=...))")
            return drafter
        raise ValueError(f"speculator={name!r}: expected 'none', 'dflash2' or 'mtp'")

    def _chunk_peak(self, use_kernels: bool, context: int) -> list[int]:
        """Bytes that one prefill chunk of max_batch_tokens tokens takes on each device of the plan
        above what is allocated before it (activations, scratch, and the fast path's prepared weights,
        which live beside the cache as well), as vLLM's profile run measures them: one such chunk of
        random tokens over a cache of just enough blocks, on the path the engine takes (fast or
        reference), with the fast path's indexer scratch reserved for `context` (FastPrefill.reserve:
        the one buffer that grows with a chunk's context, up to 256 MiB). Its kernels are compiled on
        the way, and those of a short chunk after it (short prompts, and the rest of a long one, take
        other launch settings), so the first request does not wait for them (H200, full-size model,
        while the prefix cache still cut prompts before their last block: the first 8K prompt took
        7.1 s without the short chunk, 2.6 s with it)."""
        plan = self.model.placement
        T, bs = self.max_batch_tokens, self.block_size
        blocks = -(-T // bs) + 1
        cache = CachePool(self.config, blocks, 1, block_size=bs, dtype=self.dtype,
                          device=list(plan.devices), layer_device=dict(enumerate(plan.layer_device)))
        tokens = torch.randint(self.vocab_size, (T + bs,), generator=torch.Generator().manual_seed(0)).to(self.device)
        table = torch.arange(blocks, device=self.device)
        # A prompt's chunk can hold two prefix-cache snapshots (where it leaves the cached blocks, and
        # before its last token): each a copy of the sequence's KDA rows, held until the forward returns.
        inside = tuple(sorted({bs, (T - 1) // bs * bs})) if T > bs else ()
        chunks = [SeqChunk(tokens[:T], 0, table, 0, inside), SeqChunk(tokens[T:], T, table, 0)]
        cuda = [d for d in plan.devices if d.type == "cuda"]
        for d in cuda:
            torch.cuda.synchronize(d)
            torch.cuda.reset_peak_memory_stats(d)
        before = {d: torch.cuda.memory_allocated(d) for d in cuda}
        start = time.perf_counter()
        try:
            prefill = self._fast_prefill(cache, blocks * bs) if use_kernels else None
            if prefill is not None:
                prefill.reserve(context)
            with torch.no_grad():
                for chunk in chunks:
                    out = self.model.forward([chunk], cache) if prefill is None else prefill.forward([chunk])
                    out.logits.cpu()
        except torch.cuda.OutOfMemoryError as oom:
            raise ValueError(f"max_batch_tokens={self.max_batch_tokens}: one prefill chunk of that many tokens "
                             f"does not fit in the memory the weights leave ({oom}); give a smaller "
                             "max_batch_tokens") from None
        peak = [torch.cuda.max_memory_allocated(d) - before[d] if d in before else 0 for d in plan.devices]
        del prefill, cache, out
        torch.cuda.empty_cache()
        print(f"engine: a {T}-token prefill chunk takes "
              f"{', '.join(f'{p / 2**30:.2f}' for p in peak)} GiB (per device) beside the weights, kept out of the "
              f"cache (measured in {time.perf_counter() - start:.1f} s)")
        return peak

    def _size_pool(self, num_blocks, max_cache_tokens, memory_fraction, per_device: list[list[int]],
                   num_slots: int) -> int:
        """Blocks in the pool: as asked, else (CUDA) what every device allows for its layers' rows:
        memory_fraction of its free memory, and no more than its budget left after the planned
        weights, less the chunk's measured peak (`_chunk_peak`); else 64K tokens."""
        if num_blocks is None and max_cache_tokens is not None:
            num_blocks = -(-max_cache_tokens // self.block_size)
        plan = self.model.placement
        if num_blocks is None and any(d.type == "cuda" for d in plan.devices):
            if not 0 < memory_fraction <= 1:
                raise ValueError(f"memory_fraction={memory_fraction} must be in (0, 1]")
            fits = []
            for d, budget, weights, (block_bytes, slot_bytes), peak in zip(plan.devices, plan.budget,
                                                                           plan.weight_bytes, per_device,
                                                                           self.chunk_peak):
                room = [torch.cuda.mem_get_info(d)[0] * memory_fraction] if d.type == "cuda" else []
                room += [budget - weights] if budget is not None else []
                if block_bytes and room:
                    fits.append(int((min(room) - peak - slot_bytes * num_slots) // block_bytes))
            num_blocks = min(fits) if fits else None
        if num_blocks is None:
            num_blocks = CPU_CACHE_TOKENS // self.block_size
        if num_blocks < 1:
            raise ValueError(f"the cache gets {num_blocks} blocks: give num_blocks or max_cache_tokens, or free memory")
        return num_blocks

    # --- requests ---------------------------------------------------------------------------

    def encode(self, prompt: str | list[int] | list[dict], **chat_kwargs) -> list[int]:
        """Text, token ids, or chat messages (rendered with the checkpoint's template) -> ids."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False).ids
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            if self.chat_template is None:
                raise ValueError("chat messages need a chat template; the checkpoint has no chat_template.jinja")
            text = chat.render(self.chat_template, chat.normalize_messages(prompt), **chat_kwargs)
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise ValueError(f"a prompt is a string, a list of token ids or a list of chat messages, got {type(prompt).__name__}")

    @staticmethod
    def images_of(prompt: str | list[int] | list[dict]) -> list:
        """The image sources of chat messages' image parts, in the order the template writes them (add_request's
        `images` for encode's ids); none for text or token ids."""
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            return chat.image_sources(chat.normalize_messages(prompt))
        return []

    def add_request(self, prompt_ids: list[int], sampling: SamplingParams | None = None,
                    request_id: str | None = None, images: Seq = ()) -> str:
        """Queue a request. `images` (PIL images, their bytes, data or http(s) URLs, or vision.Prepared): one for
        each <|image|> token of the prompt, in order, which the engine writes out to as many as the image has
        tokens."""
        p = sampling or SamplingParams()
        if not isinstance(p, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(p).__name__}")
        request_id = request_id if request_id is not None else f"req-{next(self.ids)}"
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        if not prompt_ids:
            raise ValueError("prompt is empty: the model needs at least one token")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        prompt_ids, placed = self._read_images(list(prompt_ids), images)
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; the limit is {self.max_model_len - 1} "
                             f"(context {self.max_model_len} = min(max_model_len, cache blocks x block size), "
                             f"one position left to generate)")
        if any(t >= self.vocab_size for t in p.stop_token_ids):
            raise ValueError(f"stop_token_ids {p.stop_token_ids} must be below the vocabulary size {self.vocab_size}")
        if any(t >= self.vocab_size for t in p.allowed_token_ids or []):
            raise ValueError(f"allowed_token_ids {sorted(t for t in p.allowed_token_ids if t >= self.vocab_size)[:5]} "
                             f"must be below the vocabulary size {self.vocab_size}")
        if any(t >= self.vocab_size for t in p.logit_bias):
            raise ValueError(f"logit_bias token ids {sorted(t for t in p.logit_bias if t >= self.vocab_size)[:5]} "
                             f"must be below the vocabulary size {self.vocab_size}")
        if p.tool_calls is not None and None in self.tool_tags.values():
            raise ValueError(f"tool_calls needs {', '.join(toolmode.TAGS)} as tokens; this tokenizer lacks "
                             f"{[t for t, i in self.tool_tags.items() if i is None]}")
        if p.thinking_token_budget is not None and None in (self.think_start, self.think_end):
            raise ValueError(f"thinking_token_budget needs {chat.THINK_START} and {chat.THINK_END} tokens; "
                             f"this tokenizer has no such token")
        generator = torch.Generator(self.device)
        if p.seed is None:
            generator.seed()
        else:
            generator.manual_seed(p.seed)
        seq = Sequence(request_id, list(prompt_ids), len(prompt_ids), p,
                       frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_token_ids),
                       generator, Detokenizer(self.tokenizer, p.skip_special_tokens),
                       torch.tensor(prompt_ids, dtype=torch.long, device=self.device))
        if self.speculator is not None:
            seq.draft_stats = dflash.DraftStats.new(self.speculator.max_draft)
        seq.thinking, seq.thought = self._open_thought(prompt_ids)
        seq.grammar = self._grammar(p, prompt_ids)
        seq.images = placed
        self.requests[request_id] = seq
        self.waiting.append(seq)
        return request_id

    def _grammar(self, p: SamplingParams, prompt_ids: list[int]) -> Grammar | None:
        """The automaton that holds the answer (JSON mode, a regular expression, tool calls), fed the first call's
        tag where the prompt has started it."""
        if p.json_schema is not None:
            return jsonmode.JsonPrefix(jsonmode.object_schema(p.json_schema))
        if p.json_object:
            return jsonmode.JsonPrefix()
        if p.regex is not None or p.choice is not None:
            return pattern.RegexPrefix(pattern.Pattern(p.regex or pattern.choice_regex(p.choice), whole=True))
        if p.tool_calls is None:
            return None
        calls = toolmode.ToolCallPrefix(toolmode.compile_tools(p.tool_calls), p.parallel_tool_calls,
                                        "text" if p.tool_calls_optional else "call")
        if prompt_ids[-1] == self.tool_tags[chat.TOOL_START]:
            calls.feed(bytes([toolmode.CALL]))
        return calls

    def _read_images(self, prompt_ids: list[int], images: Seq) -> tuple[list[int], list[PromptImage]]:
        """The prompt with each image's <|image|> token written out to the image's tokens, and its images."""
        if not images:
            return prompt_ids, []
        if self.vision is None:
            raise ValueError("this checkpoint has no vision tower (no model.visual.* tensors): it cannot read images")
        ready = [im if isinstance(im, vision.Prepared) else vision.prepare(im, self.vision.cfg) for im in images]
        ids, starts = vision.write_out(prompt_ids, self.vision.image_token_id, ready)
        return ids, [PromptImage(start, im) for start, im in zip(starts, ready)]

    def _run_tower(self, batch: list[tuple[Sequence, int]]) -> None:
        """The tower's rows of the images this step's chunks need that no live sequence's chunk has needed before
        (a request's n choices, clients sending one image at once, an image across chunks: one run), in runs of
        the patches of one image of the processor's largest size at most (vision.runs)."""
        need = {}
        for seq, n in batch:
            lo, hi = seq.num_computed, seq.num_computed + n
            need |= {im.digest: im.image for im in seq.images
                     if im.meets(lo, hi) and im.digest not in self.image_rows}
        if not need:
            return
        for run in vision.runs(list(need.values()), self.vision.cfg):
            rows = self.vision.read(run)
            self.image_rows.update((image.digest, r.to(self.device, self.dtype)) for image, r in zip(run, rows))

    def _drop_image_rows(self) -> None:
        """Forget the rows of images no live sequence has positions of left to compute (one preempted runs the
        tower again)."""
        if self.image_rows:
            pending = {im.digest for seq in self.requests.values() for im in seq.images if im.end > seq.num_computed}
            for digest in self.image_rows.keys() - pending:
                del self.image_rows[digest]

    def _open_thought(self, prompt_ids: list[int]) -> tuple[bool, int]:
        """Whether the prompt ends inside a think block, and the tokens it holds there."""
        for i in range(len(prompt_ids) - 1, -1, -1):
            if prompt_ids[i] == self.think_end:
                return False, 0
            if prompt_ids[i] == self.think_start:
                return True, len(prompt_ids) - 1 - i
        return False, 0

    @staticmethod
    def _thinking_left(seq: Sequence) -> int | None:
        """Tokens seq may still generate inside its think block (None: no limit there, or outside it)."""
        budget = seq.params.thinking_token_budget
        return max(budget - seq.thought, 0) if seq.thinking and budget is not None else None

    def cancel(self, request_id: str) -> bool:
        """Stop a request and free its cache; the next step() reports it. False if unknown/finished."""
        seq = self.requests.get(request_id)
        if seq is None:
            return False
        self._finish(seq, "cancelled")
        self.cancelled.append(self._output(seq, [], None))
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.cancelled)

    def reset_prefix_cache(self) -> None:
        """Make every following request cold (benchmarks): a hit needs a KDA snapshot, so drop them all."""
        self.blocks.snapshots.clear()

    def stats(self) -> EngineStats:
        b = self.blocks
        return EngineStats(len(self.running), len(self.waiting), b.num_blocks - b.num_free(), b.num_blocks,
                           sum(b.hash[i] is not None for i in b.free), len(b.snapshots.items),
                           b.snapshots.nbytes, speculator=self.speculator_name, **self.counters)

    def _fast_prefill(self, cache: CachePool, max_context: int,
                      decoder: "fastdecode.FastDecoder | None" = None) -> "fastprefill.FastPrefill | None":
        """The kernel prefill (and verify passes) on CUDA (a layer split too) over `cache`, with the fast
        decode step's prepared weights (without one, e.g. with a speculator, a decoder of its own: no
        graphs are captured)."""
        if self.device.type != "cuda":
            return None
        try:
            return fastprefill.FastPrefill(decoder or fastdecode.FastDecoder(self.model, cache, max_context=max_context))
        except fastdecode.Unsupported as why:
            print(f"engine: prefill chunks and verify passes take the reference path: {why}")
            return None

    def _fast_decoder(self, max_num_seqs: int) -> "fastdecode.FastDecoder | None":
        """The graph-captured decode step, where it applies (CUDA, a model it supports; a layer split:
        one graph per device run of layers). Captured now, before any sequence lives in the cache
        (capture writes scratch rows)."""
        if self.device.type != "cuda":
            return None
        try:
            fast = fastdecode.FastDecoder(self.model, self.cache, max_context=self.max_model_len)
        except fastdecode.Unsupported as why:
            print(f"engine: decode steps take the reference path: {why}")
            return None
        contexts, c = [], 4096
        while c < self.max_model_len:
            contexts.append(c)
            c *= 4
        contexts.append(self.max_model_len)
        start = time.perf_counter()
        fast.capture(list(range(1, max_num_seqs + 1)), contexts)
        print(f"engine: {len(fast.graphs)} decode CUDA graphs (batch 1..{max_num_seqs}, contexts "
              f"{contexts}) captured in {time.perf_counter() - start:.1f} s")
        return fast

    # --- one iteration ----------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        outputs, self.cancelled = self.cancelled, []
        if self.ahead is not None:
            return outputs + self._step_ahead()
        batch = self._schedule()
        self._drop_image_rows()
        if not batch:
            return outputs
        self._run_tower(batch)
        self._draft(batch)
        # Single decode tokens go to the fast decode step (inputs on the host), prefill chunks to the
        # fast prefill (or the reference forward); the two touch different slots and blocks.
        fast = [i for i, (seq, n) in enumerate(batch)  # (no fast step is built with a speculator; it embeds tokens)
                if self.fast is not None and n == 1 and seq.num_computed > 0
                and not any(im.meets(seq.num_computed, seq.num_computed + 1) for im in seq.images)]
        chunks = [self._seq_chunk(seq, n, "cpu" if i in fast else self.device) for i, (seq, n) in enumerate(batch)]
        if self.speculator is not None:
            return outputs + self._speculative_step(batch, chunks)
        rest = [i for i in range(len(batch)) if i not in fast]
        captured = {}
        if not rest:  # a decode batch: the step's own rows, nothing to place
            logits = self.fast.step(chunks).logits
        else:
            logits = torch.empty(len(batch), self.vocab_size, dtype=torch.float32, device=self.device)
            if fast:
                logits[fastdecode.to_device(fast, self.device)] = self.fast.step([chunks[i] for i in fast]).logits
            todo = [chunks[i] for i in rest]
            out = self.model.forward(todo, self.cache) if self.prefill is None else self.prefill.forward(todo)
            logits[fastdecode.to_device(rest, self.device)] = out.logits
            captured = {(rest[j], p): snap for (j, p), snap in out.snapshots.items()}
        done = []
        for i, (seq, n) in enumerate(batch):
            self._commit(seq, n, {p: snap for (j, p), snap in captured.items() if j == i})
            if seq.num_computed == len(seq.token_ids):
                done.append((seq, i))
        return outputs + self._sample(done, logits)

    def _step_ahead(self) -> list[RequestOutput]:
        """The step the last one launched ahead: its sequences that are still running (one that stopped
        or was cancelled since has its row dropped) take their token from its logits."""
        ahead, self.ahead = self.ahead, None
        done = []
        for i, (seq, n) in enumerate(ahead.batch):
            if seq.finish_reason is None:
                self._commit(seq, n)
                done.append((seq, i))
        return self._sample(done, ahead.logits)

    def _launch_ahead(self, done: list[tuple[Sequence, int]], drawn: torch.Tensor) -> Ahead | None:
        """The next decode step, launched before the host reads `drawn`, the tokens it decodes, when it is
        sure to be every running sequence's next token: a fast decode step, no seat free for a waiting
        request, none at its length limit, blocks free for all. The GPU then runs it while the host reads
        the tokens, detokenizes and checks stops, instead of waiting for the host to launch it. A sequence
        that stops at its token (a stop token or string) wastes its row there, and a request waiting for
        its seat is admitted a step later (as in vLLM's asynchronous scheduling: all seats taken, the
        running sequences' speed before one queued request's first token)."""
        seqs = [seq for seq, _ in done]
        admits = self.waiting and len(self.running) < self.max_num_seqs
        if (self.fast is None or self.speculator is not None or admits or len(seqs) != len(self.running)
                or any(seq.num_computed != len(seq.token_ids) for seq in self.running)):
            return None
        if any(self._tokens_left(seq) <= 1 for seq in seqs):  # its drawn token ends it
            return None
        need = [self._blocks_needed(seq, seq.num_computed + 1) for seq in seqs]
        if sum(need) > self.blocks.num_free():
            return None
        for seq, n in zip(seqs, need):
            self._grow(seq, n)
        chunks = [SeqChunk(torch.zeros(1, dtype=torch.long), seq.num_computed, seq.table(), seq.slot) for seq in seqs]
        return Ahead([(seq, 1) for seq in seqs], self.fast.step(chunks, tokens=drawn).logits)

    def _seq_chunk(self, seq: Sequence, n: int, device: str | torch.device) -> SeqChunk:
        """The next n positions of seq (its pending drafts after the last real token)."""
        tokens = seq.token_ids[seq.num_computed:seq.num_computed + n - seq.k] + (seq.draft.tokens if seq.draft else [])
        lo, hi = seq.num_computed, seq.num_computed + n
        inside = tuple(sorted(b for b in seq.snapshot_at if lo < b < hi))
        # (image_rows holds the rows of the images a chunk needs, not of every image of the prompt)
        images = chunk_images(((im.start, self.image_rows[im.digest]) for im in seq.images if im.meets(lo, hi)),
                              lo, hi)
        return SeqChunk(fastdecode.to_device(tokens, device), seq.num_computed,
                        fastdecode.to_device(seq.table(), device), seq.slot, inside, images)

    # --- speculative decoding (dflash.py) ---------------------------------------------------

    def _plan_draft(self, seq: Sequence, budget: int) -> int:
        """Drafts to verify this step for a running sequence: 0 unless it is decoding; never more than
        the token budget left after its next token, max_tokens or the context can take (a step emits
        up to k + 1 tokens)."""
        seq.k = 0
        if self.speculator is None or seq.num_computed != len(seq.token_ids) - 1 or seq.grammar is not None:
            return 0  # (a held answer's tokens are each picked by _draw)
        room = min(budget, self._tokens_left(seq) - 1, self.speculator.max_draft)
        left = self._thinking_left(seq)
        if left is not None:  # no draft past the budget: the token after it is forced (_sample)
            room = min(room, left - 1)
        seq.k = max(0, min(room, dflash.draft_length(seq.draft_stats, self.draft_row_cost, self.draft_tokens)))
        return seq.k

    def _draft(self, batch: list[tuple[Sequence, int]]) -> None:
        wanted = [seq for seq, _ in batch if seq.k > 0]
        for seq, _ in batch:
            seq.draft = None
        if not wanted:
            return
        requests = [dflash.DraftRequest(seq.request_id, seq.token_ids, seq.num_computed, seq.k,
                                        fastdecode.to_device(seq.table(), self.device), seq.slot,
                                        seq.params.temperature, seq.generator) for seq in wanted]
        for seq, draft in zip(wanted, self.speculator.draft(requests)):
            seq.draft = draft

    def _speculative_step(self, batch: list[tuple[Sequence, int]], chunks: list[SeqChunk]) -> list[RequestOutput]:
        """One target pass computes every chunk: all rows' logits of a drafted chunk (its verify), the
        last row's of the others. Then accept, roll back rejected rows, emit, and show the drafter
        every committed row."""
        offsets = list(itertools.accumulate((n for _, n in batch), initial=0))
        first, rows = [], []  # each chunk's first row in the logits; the rows whose logits are needed
        for (seq, n), a in zip(batch, offsets):
            first.append(len(rows))
            rows += range(a, a + n) if seq.draft else [a + n - 1]
        saved = dflash.save_kda_slots(self.cache, [seq.slot for seq, _ in batch if seq.draft])
        drafted = [r for (seq, n), a in zip(batch, offsets) if seq.draft for r in range(a, a + n)]
        verify = dflash.target_forward(self.model, chunks, self.cache, rows, self.speculator.taps, drafted, self.prefill)
        logits = verify.logits
        emitted = {i: self._verify(seq, logits[first[i]:first[i] + n]) for i, (seq, n) in enumerate(batch) if seq.draft}
        dflash.rollback_kda(self.model, self.cache, verify, chunks,
                            {i: len(e) for i, e in emitted.items() if len(e) < batch[i][1]}, saved)
        outputs, done = [], []
        for i, (seq, n) in enumerate(batch):
            start = seq.num_computed
            if i in emitted:  # kept rows = the anchor and the accepted drafts = the emitted tokens
                outputs.append(self._emit(seq, emitted[i], logits[first[i]:]))
                if seq.finish_reason is not None:
                    continue
                n = len(emitted[i])
                self._commit(seq, n)
                keep = -(-seq.num_computed // self.block_size)  # the rejected rows' blocks go back
                self.blocks.release(seq.drop_blocks(keep))
            else:
                self._commit(seq, n, {p: snap for (j, p), snap in verify.snapshots.items() if j == i})
            self.speculator.observe(seq.request_id, start, verify, (offsets[i], offsets[i] + n), chunks[i].images)
            if i not in emitted and seq.num_computed == len(seq.token_ids):
                done.append((seq, first[i]))
        return outputs + self._sample(done, logits)

    def _verify(self, seq: Sequence, logits: torch.Tensor) -> list[int]:
        """The tokens one verify emits (accepted drafts, then the target's), with the statistics."""
        p, drafts = seq.params, seq.draft.tokens
        # Row j is processed as if drafts 1..j had been emitted (penalties and min_tokens see them).
        logits = hold_stops(logits, [self._early_stops(seq, j) for j in range(len(logits))])
        x = process_rows(logits, [p] * len(logits), [seq.prompt_tensor] * len(logits),
                         [torch.tensor(seq.output_ids + drafts[:j], dtype=torch.long, device=self.device)
                          for j in range(len(logits))])
        emitted = dflash.accept_drafts(x, drafts, seq.draft.q, p.temperature == 0, seq.generator)
        seq.draft_stats.record(len(drafts), len(emitted) - 1)
        self.counters["spec_verify_steps"] += 1
        self.counters["spec_draft_tokens"] += len(drafts)
        self.counters["spec_accepted_tokens"] += len(emitted) - 1
        return emitted

    @staticmethod
    def _early_stops(seq: Sequence, drafted: int = 0) -> frozenset[int]:
        """The stop tokens seq may not draw next (`drafted`: tokens drafted before it): all of them while it has
        fewer than min_tokens tokens."""
        return seq.stop_ids if len(seq.outputs) + drafted < seq.params.min_tokens else frozenset()

    def _emit(self, seq: Sequence, tokens: list[int], logits: torch.Tensor) -> RequestOutput:
        """Append tokens until one finishes the request (the rest are dropped); one output for all."""
        n, lps = seq.params.logprobs, []
        for token, row in zip(tokens, logits):
            self._append(seq, token)
            lps.append(token_logprobs(row, token, n) if n is not None else None)
            if seq.finish_reason is not None:
                break
        return self._output(seq, tokens[:len(lps)], lps if n is not None else None)

    def _schedule(self) -> list[tuple[Sequence, int]]:
        """Pick (sequence, number of new tokens) pairs: running first, then admissions."""
        budget, batch = self.max_batch_tokens, []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:  # preempted below for an older sequence
                continue
            n = self._chunk(seq, budget)
            n += self._plan_draft(seq, budget - n)
            need = self._blocks_needed(seq, seq.num_computed + n)
            while self.blocks.num_free() < need and seq in self.running:
                self._preempt(self.running[-1])
            if seq in self.running:
                self._grow(seq, need)
                batch.append((seq, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            n = self._admit(self.waiting[0], budget)
            if n == 0:
                break
            seq = self.waiting.popleft()
            self.running.append(seq)
            batch.append((seq, n))
            budget -= n
        return batch

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens to compute next: all that are left, within the budget. A wanted snapshot inside the
        chunk does not cut it: the forward returns the KDA rows there (SeqChunk.snapshots). Cutting
        cost a pass over the weights for the last block alone (H200, full-size model: 122 ms, half a
        1K prompt's time)."""
        return min(len(seq.token_ids), seq.num_computed + budget) - seq.num_computed

    def _blocks_needed(self, seq: Sequence, upto: int) -> int:
        return max(0, -(-upto // self.block_size) - len(seq.block_table))

    def _grow(self, seq: Sequence, n: int) -> None:
        seq.block_table += [self.blocks.allocate() for _ in range(n)]

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Give a waiting sequence its prefix-cache hit, blocks and a slot; returns its chunk length."""
        bs = self.block_size
        full = len(seq.token_ids) // bs
        self._hash_blocks(seq, full)
        # The last token is always recomputed: its logits pick the next token.
        hit, common = self.blocks.match(seq.block_hashes, (len(seq.token_ids) - 1) // bs)
        hit_blocks = [self.blocks.cached[h] for h in seq.block_hashes[:hit]]
        # Snapshot the prompt's last full block (an extended prompt restores there), the last one
        # before its last token (the same prompt again restores there) and the point where it leaves
        # the cached blocks (a shared system prompt: later requests hit).
        snaps = self.blocks.snapshots
        seq.snapshot_at = {b * bs for b in (full, (len(seq.token_ids) - 1) // bs, common)
                           if hit < b <= full and snaps.max_bytes > 0 and seq.block_hashes[b - 1] not in snaps}
        seq.num_computed, seq.k = hit * bs, 0
        n = self._chunk(seq, budget)
        need = -(-(hit * bs + n) // bs) - hit
        if self.blocks.num_free() - sum(self.blocks.ref[b] == 0 for b in hit_blocks) < need:
            seq.num_computed, seq.snapshot_at = 0, set()
            return 0
        for b in hit_blocks:
            self.blocks.share(b)
        seq.block_table = hit_blocks
        self._grow(seq, need)
        seq.slot = self.free_slots.pop()
        if hit:  # (a chunk that starts at 0 makes the model reset the slot itself)
            snap = self.blocks.snapshots.get(seq.block_hashes[hit - 1])
            # assignment, not copy_: with rows on several devices a read is a copy (cache.LayerRows)
            self.cache.kda_state[:, seq.slot] = snap.kda_state
            self.cache.conv_state[:, seq.slot] = snap.conv_state
        if seq.cached_tokens < 0:
            seq.cached_tokens = hit * bs
        self.counters["prefix_query_tokens"] += seq.prompt_len
        self.counters["prefix_hit_tokens"] += hit * bs
        return n

    def _preempt(self, seq: Sequence) -> None:
        """Drop a running sequence's cache; it waits at the front and recomputes prompt + output."""
        self._release(seq)
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.counters["preemptions"] += 1

    def _release(self, seq: Sequence) -> None:
        self.blocks.release(seq.block_table)
        seq.block_table, seq.num_computed, seq.snapshot_at = [], 0, set()
        if seq.slot >= 0:
            self.free_slots.append(seq.slot)
            seq.slot = -1
        if self.speculator is not None:
            self.speculator.release(seq.request_id)

    def _commit(self, seq: Sequence, n: int, captured: dict[int, KDASnapshot] | None = None) -> None:
        """Advance past the computed chunk: hash and publish full blocks, keep wanted snapshots (at
        the chunk's end from the slot; inside it, `captured` by the forward)."""
        bs, start = self.block_size, seq.num_computed
        seq.num_computed += n
        self.counters["prompt_tokens_computed"] += max(0, min(seq.num_computed, seq.prompt_len) - start)
        self._hash_blocks(seq, seq.num_computed // bs)
        for i in range(start // bs, seq.num_computed // bs):
            self.blocks.register(seq.block_table[i], seq.block_hashes[i])
        snaps = self.blocks.snapshots
        for p, snap in sorted((captured or {}).items()):
            first = snap.kda_state[0].device  # (a layer split: rows on several devices, as the cache reads them)
            snaps.put(seq.block_hashes[p // bs - 1], torch.stack([t.to(first) for t in snap.kda_state]),
                      torch.stack([t.to(first) for t in snap.conv_state]))
        if seq.num_computed in seq.snapshot_at:
            snaps.put(seq.block_hashes[seq.num_computed // bs - 1],
                      self.cache.kda_state[:, seq.slot], self.cache.conv_state[:, seq.slot])

    def _hash_blocks(self, seq: Sequence, n: int) -> None:
        bs = self.block_size
        for i in range(len(seq.block_hashes), n):
            seen = b"".join(im.digest for im in seq.images if im.start < (i + 1) * bs and im.end > i * bs)
            seq.block_hashes.append(block_hash(seq.block_hashes[-1] if i else b"", seq.token_ids[i * bs:(i + 1) * bs],
                                               seen))

    def _sample(self, done: list[tuple[Sequence, int]], logits: torch.Tensor) -> list[RequestOutput]:
        """The next token of each (sequence, its logits row) whose prompt and tokens are all computed, in
        one batched draw (draw_on_device): one device sync for the batch, not a filter pass and a sync per
        sequence. The next step may be launched behind the draw before its tokens are read (_launch_ahead)."""
        if not done:
            return []
        at = [i for _, i in done]
        rows = logits if at == list(range(len(logits))) else logits[fastdecode.to_device(at, logits.device)]
        drawn = self._draw([seq for seq, _ in done], rows)
        spent = [j for j, (seq, _) in enumerate(done) if self._thinking_left(seq) == 0]
        if spent:  # on the device, before the step launched ahead reads the tokens
            drawn[fastdecode.to_device(spent, drawn.device)] = self.think_end
        asked = [j for j, (seq, _) in enumerate(done) if seq.params.logprobs is not None]
        queued = [drawn]
        if asked:  # the logprobs too, so that nothing reads these logits after the next step is launched
            pick = slice(None) if len(asked) == len(done) else fastdecode.to_device(asked, rows.device)
            queued += logprob_rows(rows[pick], drawn[pick], max(done[j][0].params.logprobs for j in asked))
        # read back in stream order before the step launched ahead, which would otherwise come first
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda).copy_(t, non_blocking=True) for t in queued]
        read = torch.cuda.Event() if drawn.is_cuda else None
        if read is not None:
            read.record()
        self.ahead = self._launch_ahead(done, drawn)
        if read is not None:
            read.synchronize()
        tokens = host[0].tolist()
        lps = {j: read_logprob(tokens[j], *(h[a] for h in host[1:]), done[j][0].params.logprobs)
               for a, j in enumerate(asked)}
        outputs = []
        for j, ((seq, _), token) in enumerate(zip(done, tokens)):
            self._append(seq, token)
            outputs.append(self._output(seq, [token], [lps[j]] if j in lps else None))
        if self.ahead is not None and all(seq.finish_reason is not None for seq, _ in self.ahead.batch):
            self.ahead = None  # every sequence it decodes has stopped
        return outputs

    def _draw(self, seqs: list[Sequence], rows: torch.Tensor) -> torch.Tensor:
        """Each sequence's token [N] on the device: one draw_on_device for the free rows; the rows of answers a
        grammar holds (JSON, tool calls) by _held_tokens instead (which draws each row's race from its generator:
        once a step, as a free row does, so the grammar changes a seeded draw only where the free token would
        not fit)."""
        rows = hold_stops(rows, [self._early_stops(seq) for seq in seqs])
        held = [j for j, seq in enumerate(seqs) if seq.grammar is not None and not seq.thinking]
        free = [j for j in range(len(seqs)) if j not in held]  # (a row forced to </think> is still thinking)
        kernel = self.use_kernels and rows.is_cuda
        if not held:
            return draw_on_device(rows, *draw_args(seqs), kernel=kernel)
        drawn = torch.empty(len(seqs), dtype=torch.long, device=rows.device)
        if free:
            at = fastdecode.to_device(free, rows.device)
            drawn[at] = draw_on_device(rows[at], *draw_args([seqs[j] for j in free]), kernel=kernel)
        at = fastdecode.to_device(held, rows.device)
        drawn[at] = fastdecode.to_device(self._held_tokens([seqs[j] for j in held], rows[at]), rows.device)
        return drawn

    def _held_tokens(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        """The tokens of answers a grammar holds, one a row: the race of draw_on_device (each row's own noise
        draw from its generator) run down the row's tokens in order until one keeps the answer a prefix the
        grammar accepts (a JSON object's, tool calls'); if the filters (top_k, top_p, min_p) left none that does,
        the model's most likely one that does. The rows' race leaders are read back at once (one device sync)."""
        params = [s.params for s in seqs]
        x = process_rows(logits, params, [s.prompt_tensor for s in seqs], [s.output_ids for s in seqs])
        scores = race_scores(x, race_noise(params, [s.generator for s in seqs], x.shape[1], x.device))
        lead = scores.topk(min(GRAMMAR_CANDIDATES, x.shape[1]), -1)  # one of them usually fits: no full sort
        ids = torch.where(torch.isfinite(lead.values), lead.indices, -1).tolist()  # -1: a token the filters removed
        tokens = []
        for j, seq in enumerate(seqs):
            head = [t for t in ids[j] if t >= 0]
            token = jsonmode.pick(head, seq.grammar, self._grammar_bytes(seq.grammar))
            tokens.append(token if token is not None else self._held_fallback(seq, scores[j], logits[j]))
        return tokens

    def _held_fallback(self, seq: Sequence, scores: torch.Tensor, logits: torch.Tensor) -> int:
        """_held_tokens' token where none of a row's race leaders fits: few tokens fit here (or the model wants
        none of them), so find them all; the first in race order wins."""
        kind = type(seq.grammar)
        if kind not in self._sorted:
            self._sorted[kind] = jsonmode.Vocabulary.of(self._grammar_bytes(seq.grammar))
        fits = jsonmode.allowed(seq.grammar, self._sorted[kind])
        if not fits:
            raise RuntimeError(f"request {seq.request_id}: no token continues its answer ({kind.__name__})")
        at = fastdecode.to_device(fits, scores.device)
        race_of_fits = scores[at]
        return fits[int((race_of_fits if torch.isfinite(race_of_fits).any() else logits[at]).argmax())]

    @property
    def vocab_bytes(self) -> list[bytes | None]:
        """Each token id's bytes (None for added tokens, which are markup, not text), built on first use."""
        if self._vocab_bytes is None:
            added = set(self.tokenizer.get_added_tokens_decoder())
            self._vocab_bytes = [None if i in added else token_bytes(self.tokenizer, i) for i in range(self.vocab_size)]
        return self._vocab_bytes

    def _grammar_bytes(self, grammar: Grammar) -> list[bytes | None]:
        """Each token's bytes as the grammar reads them: vocab_bytes; for tool calls the tags' and the stop tokens'
        bytes too, for a regular expression the stop tokens' (toolmode.tagged_bytes)."""
        if isinstance(grammar, jsonmode.JsonPrefix):
            return self.vocab_bytes
        kind = type(grammar)
        if kind not in self._tagged:
            tags = self.tool_tags if kind is toolmode.ToolCallPrefix else {}
            self._tagged[kind] = toolmode.tagged_bytes(self.vocab_bytes, tags, self.eos_token_ids)
        return self._tagged[kind]

    def _append(self, seq: Sequence, token: int) -> None:
        """Add one generated token: detokenize, check stops and limits."""
        p = seq.params
        seq.token_ids.append(token)
        seq.outputs.append(token)
        self.counters["tokens_generated"] += 1
        if seq.grammar is not None and not seq.thinking:
            seq.grammar.feed(self._grammar_bytes(seq.grammar)[token])
        if seq.thinking:
            seq.thinking = token != self.think_end
            seq.thought += seq.thinking
            seq.reasoning_tokens += seq.thinking
        if token in seq.stop_ids:
            self._finish(seq, "stop")
        else:
            old_len = len(seq.text)
            seq.text += seq.detok.push(token)
            # A stop string can only be new if it ends inside the new text, and counts past min_tokens.
            hit = [(i, s) for i, s in ((seq.text.find(s, max(0, old_len - len(s) + 1)), s) for s in p.stop)
                   if i >= 0 and len(seq.outputs) > p.min_tokens]
            if hit:
                at, seq.stop_string = min(hit, key=lambda h: h[0])
                seq.text = seq.text[:at + (len(seq.stop_string) if p.include_stop_str_in_output else 0)]
                self._finish(seq, "stop")
            elif seq.grammar is not None and seq.grammar.done:
                self._finish(seq, "stop")
            elif self._tokens_left(seq) <= 0:
                self._finish(seq, "length")

    def _tokens_left(self, seq: Sequence) -> int:
        """Tokens seq may still generate before max_tokens or the context stops it."""
        left = self.max_model_len - len(seq.token_ids)
        if seq.params.max_tokens is not None:
            left = min(left, seq.params.max_tokens - len(seq.output_ids))
        return left

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self._release(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        del self.requests[seq.request_id]
        if seq.images:
            self._drop_image_rows()

    def _output(self, seq: Sequence, token_ids: list[int], logprobs: list[TokenLogprob] | None) -> RequestOutput:
        finished = seq.finish_reason is not None
        end = len(seq.text) if finished else len(seq.text) - chat.held_back(seq.text, seq.params.stop)
        text, seq.emitted = seq.text[seq.emitted:max(end, seq.emitted)], max(end, seq.emitted)
        usage = Usage(seq.prompt_len, len(seq.output_ids), max(seq.cached_tokens, 0),
                      seq.reasoning_tokens) if finished else None
        st = seq.draft_stats
        acceptance = Acceptance(st.verify_steps, st.draft_tokens, st.accepted_tokens) if finished and st else None
        return RequestOutput(seq.request_id, token_ids, text, finished, seq.finish_reason, usage, logprobs, acceptance,
                             seq.stop_string)

    # --- whole requests ---------------------------------------------------------------------

    def generate(self, prompts, sampling: SamplingParams | list[SamplingParams] | None = None,
                 **chat_kwargs) -> list[Result]:
        """Run prompts to completion (a prompt is text, token ids or chat messages)."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and
                                               not isinstance(prompts[0], (str, list)))
        prompts = [prompts] if single else list(prompts)
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        self._require_idle()
        ids = [self.encode(pr, **chat_kwargs) for pr in prompts]
        rids: list[str] = []
        try:
            for pr, x, sp in zip(prompts, ids, params):
                rids.append(self.add_request(x, sp, images=self.images_of(pr)))
        except ValueError:  # leave the engine idle: none of the prompts run
            for r in rids:
                self.cancel(r)
            self.cancelled = []
            raise
        want_lp = {r: sp is not None and sp.logprobs is not None for r, sp in zip(rids, params)}
        results: dict[str, Result] = {}
        tokens: dict[str, list[int]] = {r: [] for r in rids}
        texts: dict[str, list[str]] = {r: [] for r in rids}
        logprobs: dict[str, list[TokenLogprob]] = {r: [] for r in rids}
        while self.has_work():
            for o in self.step():
                r = o.request_id
                tokens[r] += o.token_ids
                texts[r].append(o.text)
                logprobs[r] += o.logprobs or []
                if o.finished:
                    results[r] = Result("".join(texts[r]), tokens[r], o.finish_reason, o.usage,
                                        logprobs[r] if want_lp[r] else None, o.acceptance)
        return [results[r] for r in rids]

    def stream(self, prompt, sampling: SamplingParams | None = None, **chat_kwargs) -> Iterator[RequestOutput]:
        """Yield one RequestOutput (token and text deltas) per step until the request finishes."""
        self._require_idle()
        rid = self.add_request(self.encode(prompt, **chat_kwargs), sampling, images=self.images_of(prompt))
        try:
            while self.has_work():
                for o in self.step():
                    if o.request_id == rid:
                        yield o
        finally:
            if rid in self.requests:  # the consumer stopped early
                self.cancel(rid)
                self.cancelled = [o for o in self.cancelled if o.request_id != rid]

    def _require_idle(self) -> None:
        if self.has_work():
            raise RuntimeError("generate()/stream() drive the engine themselves; requests added with "
                               "add_request() are still in flight")

    def score(self, token_ids: list[int], chunk_tokens: int | None = None) -> torch.Tensor:
        """Teacher-forced fp32 logits [T, vocab] on the host: row t predicts token t+1 (no template, no BOS)."""
        return torch.cat([rows.cpu() for _, rows in self.score_blocks(token_ids, chunk_tokens)])

    def score_logprobs(self, token_ids: list[int], n: int, full: bool = False) -> PromptLogprobs:
        """Teacher-forced log-probabilities on the host (what /v1/score and echo read): each next token's, the
        n most likely at each row, and every one only when `full` asks, reduced on the device block by block."""
        nxt = torch.tensor(token_ids[1:] + [0])
        parts = []
        for s, rows in self.score_blocks(token_ids):
            lp = torch.log_softmax(rows, -1)
            top = torch.topk(lp, min(n, lp.shape[-1]), -1)
            chosen = lp.gather(1, fastdecode.to_device(nxt[s:s + len(lp)], lp.device)[:, None])[:, 0]
            parts.append([t.cpu() for t in (chosen, top.indices, top.values)] + ([lp.cpu()] if full else []))
        out = [torch.cat(p) for p in zip(*parts)]
        return PromptLogprobs(out[0][:-1], out[1], out[2], out[3] if full else None)

    @torch.no_grad()
    def score_blocks(self, token_ids: list[int], chunk_tokens: int | None = None) -> Iterator[tuple[int, torch.Tensor]]:
        """score()'s rows as (first row, fp32 logits [<= SCORE_ROWS, vocab] on the device), one prefill chunk of
        chunk_tokens (default max_batch_tokens) a forward and the head a block of rows after it: the device holds
        one block's logits beside the chunk (an 8K chunk's rows would take 5 GB at full size, a prompt's 620 KB a
        token), the memory Engine._chunk_peak measured."""
        T, bs = len(token_ids), self.block_size
        if T == 0 or -(-T // bs) > self.blocks.num_free():
            raise ValueError(f"score() needs {-(-T // bs)} free cache blocks for {T} tokens; "
                             f"{self.blocks.num_free()} are free of {self.blocks.num_blocks}")
        chunk = chunk_tokens or self.max_batch_tokens
        table = [self.blocks.allocate() for _ in range(-(-T // bs))]
        slot = self.max_num_seqs
        try:
            ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
            bt = torch.tensor(table, device=self.device)
            for s in range(0, T, chunk):
                c = SeqChunk(ids[s:s + chunk], s, bt, slot)
                if self.prefill is None:
                    h, head = self.model.forward([c], self.cache, logit_rows=[]).hidden, self.model.head
                else:  # (logit_rows=[]: every row's hidden, no logits)
                    h, head = self.prefill.forward([c], logit_rows=[]).hidden, self.prefill.head
                for r in range(0, len(h), SCORE_ROWS):
                    yield s + r, head(h[r:r + SCORE_ROWS])
        finally:
            self.blocks.release(table)


# ---------------------------------------------------------------------------------------------
# Loading


def load(path_or_hf_id: str | Path | None = None, device: str | torch.device | None = None,
         dtype: torch.dtype | None = None, *, devices: str | Seq[str | torch.device] | None = None,
         split_experts: bool = False, memory_per_device: int | Seq[int] | None = None,
         num_blocks: int | None = None, max_cache_tokens: int | None = None,
         memory_fraction: float = 0.9, max_num_seqs: int = 16, max_batch_tokens: int = MAX_BATCH_TOKENS,
         block_size: int = 64,
         max_model_len: int | None = None, snapshot_bytes: int = 4 << 30,
         snapshot_device: str | torch.device = "cpu", progress: bool = True, speculator: str = "none",
         drafter_path: str | Path | None = None, draft_tokens: int | None = None, use_kernels: bool = True,
         fp8_core: str | None = None) -> Engine:
    """A checkpoint folder or Hugging Face id (None: the built-in default model) -> a ready Engine.

    `speculator`: "none", "mtp" (the checkpoint's MTP layer) or "dflash2" (a DFlash2 drafter folder or
    Hugging Face id in `drafter_path`); `draft_tokens` fixes the draft length (default adaptive). The
    MTP layer's weights are read, and its cache row kept, only for speculator="mtp".

    `fp8_core` "amax" | "pow2": the non-routed projections run as FP8 block-128 linears (stored FP8
    kept as stored, BF16 quantized at load with that scale rule; checkpoint.load_weights). The
    placement plan still counts them at their stored size. `use_kernels`: see Engine.

    One process may drive several devices: `devices` ("cuda:0,cuda:1" or a list; instead of
    `device`) places layers, and with `split_experts` also half the routed experts of every MoE layer,
    on each (placement.py). The plan is printed before any weight is read and refused, with the
    numbers, when a device cannot hold its weights and cache; a device may use `memory_per_device`
    bytes (one number or one per device), by default a CUDA device's free memory (CPU: no limit).

    The cache pool holds `num_blocks` blocks, or enough for `max_cache_tokens`, or (on CUDA)
    `memory_fraction` of the memory left free after the weights, or 64K tokens on CPU. Prefix-cache
    KDA snapshots live on `snapshot_device` within `snapshot_bytes` (0 turns the prefix cache off).
    """
    import checkpoint
    import default_model
    if path_or_hf_id is None:
        path = Path(default_model.ensure())
    else:
        path = checkpoint.resolve_model_path(path_or_hf_id)
    if device is not None and devices is not None:
        raise ValueError(f"device={device!r} and devices={devices!r}: give one of them")
    devs = placement.parse_devices(devices if devices is not None else
                                   [device or ("cuda" if torch.cuda.is_available() else "cpu")])
    dtype = dtype or (torch.bfloat16 if devs[0].type == "cuda" else torch.float32)
    stored = GLMConfig.from_file(path)
    # The MTP layer (on GLM-5.3-Flash a DSA layer and 288 experts: ~3 GB at K3.25, and a cache row) serves
    # only the MTP speculator: without it, it is checked but not read, and no cache row is kept for it.
    mtp = speculator == "mtp"
    config = stored if mtp else stored.without_mtp()
    if num_blocks is None and max_cache_tokens is None and all(d.type == "cpu" for d in devs):
        num_blocks = CPU_CACHE_TOKENS // block_size  # what the engine would pick; planned for up front
    # The cache the plan reserves: as asked, else (CUDA, sized after loading) one full batch.
    tokens = num_blocks * block_size if num_blocks else max_cache_tokens or max(max_model_len or 0, max_batch_tokens)
    reserve = cache_mod.pool_bytes(config, -(-tokens // block_size), max_num_seqs + 1, block_size, dtype)
    budgets, tower_tensors = _budgets(devs, memory_per_device), vision.stored(path)
    if budgets[0] is not None:  # the vision tower goes beside the embedding
        budgets[0] -= vision.weight_bytes(tower_tensors, dtype)
    plan = placement.plan(config, checkpoint.weight_bytes(path, stored, dtype, mtp=mtp), devs,
                          split_experts=split_experts, budgets=budgets, cache=reserve)
    print(plan.describe(), flush=True)
    model = GLMModel(config, checkpoint.load_weights(path, stored, dtype, plan.device_of, progress,
                                                     fp8_core=fp8_core, mtp=mtp), plan)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{path / 'tokenizer.json'} is missing: the engine needs the checkpoint's tokenizer")
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    if speculator == "dflash2" and drafter_path is None and path_or_hf_id is None:
        drafter_path = default_model.shipped_drafter()  # trained against the built-in model
    if (speculator == "dflash2") != (drafter_path is not None):
        raise ValueError(f"speculator={speculator!r} with drafter_path={drafter_path!r}: a drafter path goes "
                         "with speculator='dflash2', and only with it")
    drafter = dflash.load_drafter(drafter_path, model) if drafter_path is not None else None
    tower = vision.load(path, tower_tensors, dtype, model.weights["embed_tokens.weight"].device)
    if tower is not None:
        print(f"engine: vision tower, {sum(t.numel() for t in tower.w.values()) / 1e6:.1f} M parameters on "
              f"{tower.device}", flush=True)
    return Engine(model, tokenizer, eos_token_ids=_eos_ids(path, config), chat_template=_chat_template(path),
                  num_blocks=num_blocks, max_cache_tokens=max_cache_tokens, memory_fraction=memory_fraction,
                  max_num_seqs=max_num_seqs, max_batch_tokens=max_batch_tokens, block_size=block_size,
                  max_model_len=max_model_len, snapshot_bytes=snapshot_bytes, snapshot_device=snapshot_device,
                  speculator=speculator, drafter=drafter, draft_tokens=draft_tokens, use_kernels=use_kernels,
                  vision_tower=tower)


def _budgets(devices: tuple[torch.device, ...], memory_per_device: int | Seq[int] | None) -> list[int | None]:
    """Bytes each device may use: as given, else a CUDA device's free memory (the cache takes
    memory_fraction of what the weights leave, Engine._size_pool), else no limit."""
    if memory_per_device is not None:
        given = [memory_per_device] * len(devices) if isinstance(memory_per_device, int) else list(memory_per_device)
        if len(given) != len(devices):
            raise ValueError(f"memory_per_device has {len(given)} entries for {len(devices)} devices")
        return given
    return [torch.cuda.mem_get_info(d)[0] if d.type == "cuda" else None for d in devices]


def _eos_ids(path: Path, config: GLMConfig) -> list[int]:
    """generation_config.json's eos_token_id (GLM lists three stop ids there), else config.json's."""
    gen = path / "generation_config.json"
    eos = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
    if eos is None:
        return list(config.eos_token_ids)
    return eos if isinstance(eos, list) else [eos]


def _chat_template(path: Path) -> str | None:
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    cfg = path / "tokenizer_config.json"
    template = json.loads(cfg.read_text()).get("chat_template") if cfg.is_file() else None
    return template if isinstance(template, str) else None


def generate(model: str | Path | Engine | None, prompts, **sampling) -> list[Result]:
    """One line: `generate("path/or/hf-id", "Hello", max_tokens=20)[0].text` (loads unless given an Engine)."""
    engine = model if isinstance(model, Engine) else load(model)
    return engine.generate(prompts, SamplingParams(**sampling))

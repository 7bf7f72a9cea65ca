"""Benchmarks against the floors of ../shared/spec/performance.md, measured on the same GPU in the same run.

    python bench.py model [--layers N] [--bits 3.25|4] [--core fp8|bf16]   synthetic full-size model
    python bench.py model --devices cuda:0,cuda:1 --bits 4                   the same, layers split over GPUs
    python bench.py model --device cpu --tiny                                the same code on a tiny model
    python bench.py kernels [--peer]       EXL3 GEMV and fused MoE, KDA decode/prefill, FP8 GEMV (--peer: + exllamav3)
    python bench.py exl3 sweep|quick|compare|sweep+compare|crosscheck [--codebook mcg]
    python bench.py kda [decode] [prefill] [precision]
    python bench.py engine [--batch 1 4] [--layers N]   the engine's decode step on the synthetic model
    python bench.py speculative [--device cpu]   the default model at batch 1: plain vs MTP vs DFlash2
    python bench.py agreement [--device cpu]     the default model: fast decode step vs reference path (KL)
    python bench.py fp8core [--device cpu]       the default model: BF16 core vs FP8 core (bytes, KL, speed)

`model` builds GLM-5.3-Flash (synthetic.py: shapes from the fixture config.json, no files) directly on the device:
routed experts as EXL3 random trellises (--bits 3.25: a quarter of the MoE layers K4, the rest K3),
the other linears FP8 block-128 (`fp8.FP8Linear`) or BF16, and runs it on `CachePool` / `SeqChunk`
as the engine does, through the fast path (fastdecode / fastprefill; --reference: model_glm's
forward): decode at batch 1, 4, 16 and at batch 1 over a long context (cache filled with random
rows, not prefilled), prefill at 1K to 128K. Every figure comes with its floor: bytes per step at
the copy bandwidth measured here (decode), or the larger of all-weights read and FLOPs at the bf16
matmul rate measured here (prefill). Random weights: the numbers are speeds, not quality. Weights
and cache are planned first (placement.py, from `synthetic.weight_sizes`): a plan that does not fit is
refused with its numbers before anything is built. With --devices the layers are split over the
devices; the decode step then replays one CUDA graph per device run of layers, and the eager
steps are timed beside the graph ones (what the graphs save). --profile: where one decode
step and one prefill spend their time.

Timings: decode and prefill are wall time between CUDA synchronizations (eager, as the engine runs);
kernels use triton.testing.do_bench medians, "graph" = the calls replayed from one CUDA graph.
`exllamav3` (for --peer, `exl3 compare`, `exl3 crosscheck`) must be importable; its extension
JIT-compiles for ~5 minutes on first import.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from tokenizers import Tokenizer, models

if not torch.cuda.is_available():  # the Triton kernels then run in the interpreter (set before they load)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import cache as cache_mod
import checkpoint
import exl3
import fp8
import placement
import synthetic
from cache import CachePool
from fastdecode import FastDecoder, Unsupported
from fastprefill import FastPrefill
from model_glm import GLMConfig, GLMModel, SeqChunk, kda_recurrent, on_device
from placement import PlacementError

START = time.time()


def say(line: str = "") -> None:
    print(line, flush=True)


# ================================================================ timing helpers (CUDA)

def median_us(fn) -> float:
    import triton
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e3


def capture(calls) -> "torch.cuda.CUDAGraph":
    """The calls captured in order in one CUDA graph, after a warm-up on a side stream (compiles,
    allocator). Inputs and outputs must be static tensors the calls update in place."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return graph


def eager_us(calls) -> float:
    cycle = itertools.cycle(calls)
    return median_us(lambda: next(cycle)())


def graph_us(calls) -> float:
    """Per call, the calls replayed from one graph (no launch overhead)."""
    return median_us(capture(calls).replay) / len(calls)


def copy_gbps() -> float:
    """Device copy of 2 GiB, read + write bytes per second: the HBM rate the floors use."""
    a = torch.empty(1 << 31, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    return 2 * a.numel() / (median_us(lambda: b.copy_(a)) * 1e-6) / 1e9


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    return 2 * 8192 ** 3 / (median_us(lambda: a @ b) * 1e-6) / 1e12


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


def kl_nats(ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """KL(softmax(ref) || softmax(got)) per row of logits, in nats (float64)."""
    p, q = torch.log_softmax(ref.double(), -1), torch.log_softmax(got.double(), -1)
    return (p.exp() * (p - q)).sum(-1)


# ================================================================ the synthetic model: floors and runs

@dataclass
class Budget:
    """Bytes and FLOPs of the configuration, for the floors (performance.md §3, §4, §6)."""
    cfg: GLMConfig
    core_bytes: int  # every non-routed weight read once per decode step (embedding: one row per sequence)
    expert_bytes: dict[int, float]  # MoE layer -> bytes of one routed expert (3 linears)
    all_bytes: int  # every weight once (a prefill chunk touches every expert)
    core_params: int  # matmul parameters per token outside the routed experts (no embedding, no head)
    expert_params: int  # one routed expert
    dtype_bytes: int

    @classmethod
    def of(cls, cfg: GLMConfig, bits: dict[int, int], core: str, dtype_bytes: int) -> "Budget":
        core_bytes = all_bytes = core_params = 0
        expert_bytes: dict[int, float] = {}
        for name, spec in checkpoint.expected_tensors(cfg).items():
            fmt = synthetic.weight_format(name, spec, core)
            b = synthetic.weight_bytes(name, spec, fmt, bits, dtype_bytes)
            all_bytes += b
            if fmt == "exl3":
                L = synthetic.layer_index(name)
                expert_bytes[L] = expert_bytes.get(L, 0) + b / cfg.n_routed_experts
            elif name != "embed_tokens.weight":
                core_bytes += b
                if len(spec.shape) == 2 and name != checkpoint.HEAD_NAME:
                    core_params += math.prod(spec.shape)
        expert_params = 3 * cfg.hidden_size * cfg.moe_intermediate_size
        return cls(cfg, core_bytes, expert_bytes, all_bytes, core_params, expert_params, dtype_bytes)

    def experts_touched(self, batch: int) -> float:
        """E(B) = n (1 - (1 - k/n)^B): distinct experts per layer under uniform routing (§4)."""
        n, k = self.cfg.n_routed_experts, self.cfg.num_experts_per_tok
        return n * (1 - (1 - k / n) ** batch)

    def per_sequence_bytes(self, ctx: int) -> float:
        """KDA + conv state read and written, selected latent rows and all pooled index keys read."""
        c = self.cfg
        n_kda, n_dsa = len(c.kda_layers), len(c.dsa_layers)
        state = n_kda * (c.linear_num_heads * c.linear_head_dim ** 2 * 4
                         + 3 * (c.linear_conv_kernel - 1) * c.kda_dim * self.dtype_bytes)
        selected = min(ctx, c.index_topk + c.index_kpool - 1)
        kv = n_dsa * (selected * c.kv_lora_rank + ctx // c.index_kpool * c.index_head_dim) * self.dtype_bytes
        return 2 * state + kv

    def decode_bytes(self, batch: int, ctx: int) -> float:
        experts = sum(self.experts_touched(batch) * b for b in self.expert_bytes.values())
        embed_rows = batch * self.cfg.hidden_size * self.dtype_bytes
        return self.core_bytes + embed_rows + experts + batch * self.per_sequence_bytes(ctx)

    def prefill_flops(self, T: int) -> float:
        """§6: weights, KDA chunked form (C = 64), sparse MLA over min(pos, selected), indexer over
        the complete pools, summed over positions 0..T-1; the head once."""
        c = self.cfg
        n_moe = len(self.expert_bytes)
        weights = 2 * (self.core_params + n_moe * c.num_experts_per_tok * self.expert_params)
        C, K = 64, c.linear_head_dim
        kda = len(c.kda_layers) * c.linear_num_heads * (2 * C * K * 3 + 2 * C * K * 2 + 3 * 2 * K * K + C * C)
        sel = c.index_topk + c.index_kpool - 1
        sum_min = sum(min(p, sel) for p in range(min(T, sel))) + max(0, T - sel) * sel
        sum_pos = T * (T - 1) / 2
        n_dsa = len(c.dsa_layers)
        mla = n_dsa * c.num_attention_heads * 2 * c.kv_lora_rank * 2 * sum_min
        indexer = n_dsa * c.index_n_heads * c.index_head_dim * 2 * sum_pos / c.index_kpool
        head = 2 * c.vocab_size * c.hidden_size
        return T * (weights + kda) + mla + indexer + head


def warm_up(model: GLMModel) -> float:
    """Calls every distinct quantized linear (by device, type, shape and K) with the row counts decode
    can give it, so that Triton compiles (one per specialization: 1 row, 2..8 rows by power of two,
    16) happen here and not inside a timed step. Returns the seconds it took."""
    start = time.time()
    seen = set()
    for w in model.weights.values():
        if isinstance(w, exl3.EXL3Linear):
            device, key, rows = w.trellis.device, ("exl3", w.in_features, w.out_features, w.bits), (1, 2, 3, 5, 9, 16)
        elif isinstance(w, fp8.FP8Linear):
            device, key, rows = w.weight.device, ("fp8", w.in_features, w.out_features), (1, 2, 4, 16)
        else:
            continue
        if (device, key) not in seen:
            seen.add((device, key))
            with on_device(device):  # Triton launches on the current device
                for m in rows:
                    w(torch.zeros(m, w.in_features, dtype=model.dtype, device=device))
    sync(*model.placement.devices)
    return time.time() - start


def sync(*devices: torch.device) -> None:
    for device in dict.fromkeys(devices):
        if device.type == "cuda":
            torch.cuda.synchronize(device)


@dataclass
class Row:
    what: str
    measured: float  # tok/s
    floor: float  # tok/s at the floor
    extra: str = ""


def decode_rate(step, tables: list[torch.Tensor], ctx: int, steps: int, devices: Sequence[torch.device]) -> float:
    """tok/s of `steps` decode steps for len(tables) sequences (slots 0..B-1) that hold `ctx` tokens;
    `step(batch)` returns the logits (GLMModel.forward or FastDecoder.step); each step feeds the
    argmax of the previous one to the host, as the engine does. One untimed step first; the
    clock stops after every device is done."""
    B = len(tables)
    tokens = torch.ones(B, dtype=torch.long)
    pos = ctx
    for i in range(steps + 1):
        if i == 1:
            sync(*devices)
            start = time.perf_counter()
        batch = [SeqChunk(tokens[b:b + 1], pos, tables[b], b) for b in range(B)]
        tokens = step(batch).argmax(-1).cpu()
        pos += 1
    sync(*devices)
    return B * steps / (time.perf_counter() - start)


def fast_vs_reference(model: GLMModel, fast: FastDecoder, cache: CachePool, table: torch.Tensor, ctx: int,
                      steps: int) -> dict[str, tuple[float, float, int]]:
    """KL(reference || x) in nats (mean, max) and top-1 agreements over `steps` batch-1 decode steps
    from one cache state (slot 0 and its blocks restored before each run), for x = the fast step and
    x = the reference itself with this token's embedding row moved by one bf16 ulp per element
    (random signs): how far a rounding-sized change at the input moves this model's logits."""
    used = table[:ctx // cache.block_size + 2].to(cache.device)
    by_block, by_slot = ("latent", "pooled"), ("index_k", "gate", "kda_state", "conv_state")
    embed = model.w("embed_tokens.weight")
    gen = torch.Generator(device=embed.device).manual_seed(5)
    kls: dict[str, list[float]] = {"fast": [], "reference, input moved 1 ulp": []}
    agree = dict.fromkeys(kls, 0)
    tok = torch.ones(1, dtype=torch.long)
    for i in range(steps):
        saved = ([getattr(cache, n)[:, used].clone() for n in by_block],
                 [getattr(cache, n)[:, 0].clone() for n in by_slot])

        def restore() -> None:
            for n, t in zip(by_block, saved[0]):
                getattr(cache, n)[:, used] = t
            for n, t in zip(by_slot, saved[1]):
                getattr(cache, n)[:, 0] = t

        batch = [SeqChunk(tok, ctx + i, table, 0)]
        got = {"fast": fast.step(batch).logits}
        restore()
        row = embed[int(tok)].clone()
        sign = torch.randint(0, 2, row.shape, device=row.device, generator=gen) * 2 - 1
        embed[int(tok)] = row * (1 + sign * 2.0 ** -8)
        got["reference, input moved 1 ulp"] = model.forward(batch, cache).logits
        embed[int(tok)] = row
        restore()
        ref = model.forward(batch, cache).logits
        for key, logits in got.items():
            kls[key].append(float(kl_nats(ref, logits)))
            agree[key] += int(ref.argmax() == logits.argmax())
        tok = ref.argmax(-1).cpu()
    return {k: (sum(v) / len(v), max(v), agree[k]) for k, v in kls.items()}


def model_devices(args) -> tuple[torch.device, ...]:
    """--devices (a layer split over them) or --device (default cuda), checked by placement."""
    return placement.parse_devices(args.devices if args.devices else [args.device or "cuda"])


def run_model(args) -> list[Row]:
    devices = model_devices(args)
    device = devices[0]  # embedding, final norm, head; logits arrive here
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = synthetic.model_config(args.layers, args.tiny)
    bits = synthetic.layer_bits(cfg, args.bits)
    budget = Budget.of(cfg, bits, args.core, torch.finfo(dtype).bits // 8)
    n_kda, n_dsa = len(cfg.kda_layers), len(cfg.dsa_layers)
    say(f"model: {cfg.num_hidden_layers} layers ({n_kda} KDA, {n_dsa} DSA, {len(bits)} MoE), experts EXL3 "
        f"{synthetic.CODEBOOK} K{args.bits} ({sum(k == 4 for k in bits.values())} layers K4), core {args.core}, "
        f"{dtype}, weights {budget.all_bytes / 1e9:.2f} GB")

    batches = [b for b in (1, 4, 16) if b <= args.max_batch]
    prompts = [64, 256] if args.tiny else [1024, 8192, 32768, 131072]
    long_ctx = 512 if args.tiny else args.long_context
    ctx0, steps = args.context, args.steps
    blocks_per_seq = -(-(ctx0 + steps + 1) // synthetic.BLOCK_SIZE)
    long_blocks = -(-(max(long_ctx + steps + 1, max(prompts))) // synthetic.BLOCK_SIZE)  # also the prompts' table
    num_blocks = max(max(batches) * blocks_per_seq, long_blocks)
    num_slots = max(batches)

    # A CUDA device may use its free memory less --reserve-gb (activations) for weights and cache.
    budgets = [torch.cuda.mem_get_info(d)[0] - int(args.reserve_gb * 1e9) if d.type == "cuda" else None
               for d in devices]
    plan = synthetic.plan_model(cfg, bits, args.core, dtype, devices, budgets, num_blocks, num_slots)
    say(plan.describe())
    split = len(set(plan.device(L) for L in range(cfg.num_hidden_layers)) | {device}) > 1
    if device.type == "cuda":
        with torch.cuda.device(device):
            bw, tflops = copy_gbps() * 1e9, matmul_tflops() * 1e12
        say(f"{torch.cuda.get_device_name(device)}: copy {bw / 1e9:.0f} GB/s (read + write), bf16 matmul "
            f"{tflops / 1e12:.0f} TFLOP/s (8192^3)")
    else:
        bw, tflops = 50e9, 1e12  # nominal: the CPU smoke run checks the code, not the machine
        say("CPU: floors use a nominal 50 GB/s and 1 TFLOP/s")
    if split:
        say(f"note: the floors are one device's ({device}): the layers run one after another, each on its "
            f"device, so a layer split adds memory, not bandwidth; its floor per token is the one-device floor")

    t0 = time.time()
    weights = synthetic.build_weights(cfg, bits, args.core, dtype, plan.device_of, args.seed)
    model = GLMModel(cfg, weights, plan)
    sync(*devices)
    for d in dict.fromkeys(devices):
        if d.type == "cuda":
            with torch.cuda.device(d):
                torch.cuda.empty_cache()  # the FP8 quantization's transients
    say(f"built in {time.time() - t0:.0f} s")
    try:
        say(f"kernel warm-up (Triton compiles): {warm_up(model):.0f} s")
    except Exception as error:  # the sections then report their own failures
        say(f"kernel warm-up failed: {type(error).__name__}: {error}")

    probe = CachePool(cfg, 1, 1, block_size=synthetic.BLOCK_SIZE, dtype=dtype, device="meta")
    fits = []
    for i, d in enumerate(plan.devices):
        if d.type != "cuda" or i != plan.devices.index(d):
            continue
        layers = [L for L in range(cfg.num_hidden_layers) if plan.device(L) == d]
        per_block, per_slot = (sum(cache_mod.layer_bytes(cfg, L, synthetic.BLOCK_SIZE, dtype)[j] for L in layers)
                               for j in (0, 1))
        free, _ = torch.cuda.mem_get_info(d)
        spare = free - args.reserve_gb * 1e9 - num_slots * per_slot
        if per_block:
            fits.append(int(spare // per_block) * synthetic.BLOCK_SIZE)
        say(f"after weights [{i}] {d}: {torch.cuda.memory_allocated(d) / 1e9:.2f} GB allocated, {free / 1e9:.1f} GB "
            f"free; its layers' cache rows: {per_block // synthetic.BLOCK_SIZE:,} B/token, {per_slot / 1e6:.1f} MB per KDA "
            "slot")
    if fits:
        say(f"cache capacity with {args.reserve_gb} GB kept for activations on each device and {num_slots} KDA slots "
            f"({probe.bytes_per_sequence() / 1e6:.1f} MB each): {min(fits):,} tokens at {probe.bytes_per_token():,} "
            f"B/token")
    cache = CachePool(cfg, num_blocks, num_slots, block_size=synthetic.BLOCK_SIZE, dtype=dtype,
                      device=list(plan.devices), layer_device=dict(enumerate(plan.layer_device)))
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    tables = [torch.arange(b * blocks_per_seq, (b + 1) * blocks_per_seq) for b in range(num_slots)]

    fast, captured = None, False
    if not args.reference:
        t0 = time.time()
        fast = FastDecoder(model, cache, max_context=max(long_ctx, ctx0) + steps + 2)
        say(f"fast path prepared (fused projections, stacked experts) in {time.time() - t0:.1f} s")
        if device.type == "cuda":  # a layer split: one graph per device run of layers (FastDecoder.capture)
            t0 = time.time()
            try:
                fast.capture(batches, contexts=[ctx0 + steps + 2])
                fast.capture([1], contexts=[long_ctx + steps + 2])
                captured = True
                say(f"CUDA graphs captured for batch {batches} (context {ctx0 + steps + 2}) and batch 1 "
                    f"(context {long_ctx + steps + 2}) in {time.time() - t0:.1f} s; "
                    f"{torch.cuda.memory_allocated(device) / 1e9:.2f} GB allocated")
            except Exception as error:  # the eager fast step still runs
                say(f"CUDA graph capture failed: {type(error).__name__}: {error}")
    pre = None
    if fast is not None:
        try:
            pre = FastPrefill(fast)
        except Unsupported as why:
            say(f"fast prefill: not available: {why}")
    path = "reference" if fast is None else ("graph" if captured else "fast eager")
    step = (lambda batch: model.forward(batch, cache).logits) if fast is None else (lambda batch: fast.step(batch).logits)

    def eager_step(batch: list[SeqChunk]) -> torch.Tensor:
        """The fast step without its graphs."""
        return fast.run(*fast._inputs(batch, max(c.start for c in batch) // synthetic.BLOCK_SIZE + 1))[0]

    rows: list[Row] = []
    timed_from = time.time()  # the budget counts the timed sections, not building and capturing (minutes cold)

    def section(name: str, fn) -> None:
        if time.time() - timed_from > args.budget:
            say(f"{name}: skipped, past the --budget of {args.budget} s of timed sections")
            return
        try:
            r = fn()
            if r is None:
                return
            rows.append(r)
            say(f"{r.what}: {r.measured:.2f} tok/s, floor {r.floor:.1f}, {r.measured / r.floor:.3f} of floor {r.extra}"
                f"  [{time.time() - START:.0f} s]")
        except Exception as error:  # one failing section must not hide the others
            say(f"{name}: failed: {type(error).__name__}: {error}")

    def decode(B: int, forward=step, label: str = path, n: int = steps) -> Row:
        for b in range(B):
            synthetic.fill_context(cache, tables[b], b, ctx0, gen)
        rate = decode_rate(forward, tables[:B], ctx0, n, devices)
        floor = B * bw / budget.decode_bytes(B, ctx0)
        return Row(f"decode B={B} ctx {ctx0} ({label})", rate, floor,
                   f"({budget.decode_bytes(B, ctx0) / 1e9:.2f} GB/step, E(B)={budget.experts_touched(B):.1f})")

    def decode_long() -> Row:
        table = torch.arange(long_blocks)
        synthetic.fill_context(cache, table, 0, long_ctx, gen)
        rate = decode_rate(step, [table], long_ctx, steps, devices)
        return Row(f"decode B=1 ctx {long_ctx} ({path})", rate, bw / budget.decode_bytes(1, long_ctx),
                   f"({budget.decode_bytes(1, long_ctx) / 1e9:.2f} GB/step)")

    def prefill_agreement(T: int) -> None:
        """KL(reference || fast prefill) on the prompt's last row, beside the reference's own move when
        the prompt's embedding rows move by one bf16 ulp (random signs; decode's `fast_vs_reference`
        moves one token's): a prefill differs at every position, so its baseline is a prefill's."""
        ref, _ = prefill_logits(T, fast_path=False)
        got, _ = prefill_logits(T, fast_path=True)
        embed = model.w("embed_tokens.weight")
        ids = prompt(T).unique().to(embed.device)
        rows = embed[ids].clone()
        sign = torch.randint(0, 2, rows.shape, device=rows.device, generator=gen) * 2 - 1
        embed[ids] = (rows * (1 + sign * 2.0 ** -8)).to(rows.dtype)  # index_put wants one dtype
        moved, _ = prefill_logits(T, fast_path=False)
        embed[ids] = rows
        for what, logits in (("fast prefill", got), ("reference prefill, input moved 1 ulp", moved)):
            say(f"KL(reference || {what}), last row of a {T}-token prompt: {float(kl_nats(ref, logits)):.2e} nats, "
                f"top-1 {'agrees' if int(ref.argmax()) == int(logits.argmax()) else 'differs'}")

    def verify_cost() -> None:
        """What a speculative verify pass costs: 8 rows of one sequence vs 1, reference path (dflash2.md §6.3)."""
        synthetic.fill_context(cache, tables[0], 0, ctx0, gen)
        times = {}
        for rows in (1, 8, 1, 8):
            tokens = torch.ones(rows, dtype=torch.long)
            sync(*devices)
            t = time.perf_counter()
            model.forward([SeqChunk(tokens, ctx0, tables[0], 0)], cache, all_logits=True)
            sync(*devices)
            times[rows] = min(times.get(rows, math.inf), time.perf_counter() - t)
        say(f"verify cost, reference path, B=1 ctx {ctx0}: 8 rows {1e3 * times[8]:.0f} ms vs 1 row "
            f"{1e3 * times[1]:.0f} ms ({times[8] / times[1]:.2f}x)")

    def agreement() -> None:
        synthetic.fill_context(cache, tables[0], 0, ctx0, gen)
        for what, (mean, worst, agree) in fast_vs_reference(model, fast, cache, tables[0], ctx0,
                                                            args.kl_steps).items():
            say(f"KL(reference || {what}), B=1 ctx {ctx0}, {args.kl_steps} steps: mean {mean:.2e} nats "
                f"(max {worst:.2e}), top-1 agreement {agree}/{args.kl_steps}")

    def prompt(T: int) -> torch.Tensor:
        return torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(T))

    def prefill_logits(T: int, fast_path: bool) -> tuple[torch.Tensor, float]:
        """One prompt of T tokens in chunks of --prefill-chunk, as the engine runs it: last logits, seconds."""
        tokens = prompt(T)
        table = torch.arange(long_blocks)
        sync(*devices)
        start = time.perf_counter()
        for s in range(0, T, args.prefill_chunk):
            chunk = [SeqChunk(tokens[s:s + args.prefill_chunk], s, table, 0)]
            logits = pre.forward(chunk).logits if fast_path else model.forward(chunk, cache).logits
        sync(*devices)
        return logits, time.perf_counter() - start

    def prefill(T: int, fast_path: bool = pre is not None) -> Row:
        _, seconds = prefill_logits(T, fast_path)
        floor_s = max(budget.all_bytes / bw, budget.prefill_flops(T) / tflops)
        return Row(f"prefill {T} ({'fast' if fast_path else 'reference'})", T / seconds, T / floor_s,
                   f"(TTFT {seconds:.2f} s, floor {floor_s:.3f} s: {budget.prefill_flops(T) / T / 1e9:.1f} "
                   f"GFLOP/token, weights {budget.all_bytes / 1e9:.1f} GB)")

    # Most telling first: a --budget cut drops the tail. The figures (decode at each batch and at
    # long context, prefill at each length), then what explains them (the graphs' saving, the reference
    # path, agreement, a verify's cost).
    for B in batches:
        section(f"decode B={B}", lambda B=B: decode(B))
    section(f"decode long context {long_ctx}", decode_long)
    # compiles every kernel variant the timed prompts use: a full chunk picks other launch tiles than a short
    # prompt, and later chunks take paths a first one does not (the indexer's top-k once positions pass
    # index_topk: at 2048-token chunks a first timed 8K prompt took 4.4 s, 1.9 s once compiled)
    section("prefill warm-up (compiles, untimed)",
            lambda: prefill(prompts[0]) and prefill(min(2 * args.prefill_chunk, max(prompts))) and None)
    for T in prompts:
        section(f"prefill {T}", lambda T=T: prefill(T))
    if captured:  # what the graphs save: the same steps launched eagerly
        for B in dict.fromkeys((batches[0], batches[-1])):
            section(f"decode B={B} fast eager", lambda B=B: decode(B, eager_step, "fast eager"))
    if fast is not None:
        section("decode B=1 reference path", lambda: decode(1, lambda b: model.forward(b, cache).logits, "reference", 2))
        if args.kl_steps:
            section("fast vs reference", agreement)
    if pre is not None:
        section(f"prefill {prompts[0]} reference path", lambda: prefill(prompts[0], fast_path=False))
        section("prefill fast vs reference", lambda: prefill_agreement(prompts[0]))
    section("verify cost", verify_cost)
    for i, d in enumerate(plan.devices):
        if d.type == "cuda" and i == plan.devices.index(d):
            say(f"peak GPU memory [{i}] {d}: {torch.cuda.max_memory_allocated(d) / 1e9:.2f} GB")
    print_table(rows)
    if args.profile:  # asked for by name: --budget cuts only the timed sections
        decode_step = (lambda b: model.forward(b, cache)) if fast is None else \
            fast.step if captured else (lambda b: fast.run(*fast._inputs(b, ctx0 // synthetic.BLOCK_SIZE + 1)))
        profile_step(decode_step, SeqChunk(torch.ones(1, dtype=torch.long), ctx0, tables[0], 0), devices,
                     f"one decode step, B=1 ({path})")
        T = min(args.prefill_chunk, prompts[-1])
        tokens = torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(T))
        forward = (lambda b: model.forward(b, cache)) if pre is None else pre.forward
        profile_step(forward, SeqChunk(tokens, 0, torch.arange(long_blocks), 0), devices,
                     f"one prefill of {T} tokens ({'reference' if pre is None else 'fast'})")
    return rows


def profile_step(step, chunk: SeqChunk, devices: Sequence[torch.device], what: str) -> None:
    """Where one forward (`step([chunk])`, a graph replay or eager launches) spends its time: on a GPU
    each kernel's share of the device's span (`exclusive_times`), then torch.profiler's top operators by
    self time on the device and on the host, and the number of device events. The step runs once
    before the profiler starts: a first call's compilation and autotuning would be most of the span."""
    import tempfile
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if devices[0].type == "cuda" else [])
    step([chunk])
    sync(*devices)
    try:
        with profile(activities=activities) as prof:
            step([chunk])
            sync(*devices)
    except Exception as error:  # the profiler depends on CUPTI being usable
        say(f"profile: failed: {type(error).__name__}: {error}")
        return
    events = prof.key_averages()
    n_events = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    say(f"\nprofile of {what}: {n_events} device events (kernels, copies)")
    if devices[0].type == "cuda":
        with tempfile.TemporaryDirectory() as folder:
            trace = os.path.join(folder, "trace.json")
            prof.export_chrome_trace(trace)
            with open(trace) as f:
                spans = [(e["name"], e["ts"], e["ts"] + e["dur"]) for e in json.load(f)["traceEvents"]
                         if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
        shares, span, idle = exclusive_times(spans)
        say(f"device span {span:.0f} us, idle {idle:.0f} us; each event's share of the span (its time that no "
            f"event started before it covers):")
        say("| device event | calls | share us | us a call | of the span |")
        say("|---|---:|---:|---:|---:|")
        for name, (calls, us) in sorted(shares.items(), key=lambda kv: -kv[1][1])[:25]:
            say(f"| {name[:60]} | {calls} | {us:.1f} | {us / calls:.2f} | {us / span:.3f} |")
    for key in (["self_device_time_total"] if devices[0].type == "cuda" else []) + ["self_cpu_time_total"]:
        say(events.table(sort_by=key, row_limit=25, max_name_column_width=60))


def exclusive_times(spans: Sequence[tuple[str, float, float]]) -> tuple[dict[str, tuple[int, float]], float, float]:
    """Device events (name, start, end) -> ({name: (calls, share)}, span, idle). Walking the events by
    start, each one's share runs from max(its start, the latest end so far) to its end: time that
    overlapping events cover counts once, to the event that started first. Overlaps are a second stream
    and kernels launched early under programmatic dependent launch, whose own durations then include
    the wait for the kernel before (their sum can pass the span by half). The shares and idle sum to
    the span, first start to last end."""
    shares: dict[str, tuple[int, float]] = {}
    ordered = sorted(spans, key=lambda e: e[1])
    if not ordered:
        return shares, 0.0, 0.0
    reached = first = ordered[0][1]
    idle = 0.0
    for name, start, end in ordered:
        idle += max(0.0, start - reached)
        calls, us = shares.get(name, (0, 0.0))
        shares[name] = (calls + 1, us + max(0.0, end - max(start, reached)))
        reached = max(reached, end)
    return shares, reached - first, idle


def print_table(rows: list[Row]) -> None:
    say("\n| what | tok/s | floor tok/s | of floor | notes |")
    say("|---|---:|---:|---:|---|")
    for r in rows:
        say(f"| {r.what} | {r.measured:.2f} | {r.floor:.1f} | {r.measured / r.floor:.3f} | {r.extra} |")


# ================================================================ kernels

def run_kernels(args) -> None:
    gbps = copy_gbps()
    say(f"{torch.cuda.get_device_name()}: copy {gbps:.0f} GB/s (read + write); floor = bytes / that rate")
    say("| kernel | shape | eager us | graph us | floor us | floor/graph | rel err |")
    say("|---|---|---:|---:|---:|---:|---:|")

    def line(kernel, shape, calls, floor_us, ref=None):
        """ref: a function giving the twin's output for calls[0] (rel err column), or None."""
        try:
            err = rel_err(calls[0](), ref()) if ref else float("nan")
            e, g = eager_us(calls), graph_us(calls)
            say(f"| {kernel} | {shape} | {e:.1f} | {g:.1f} | {floor_us:.2f} | {floor_us / g:.3f} | {err:.1e} |")
        except Exception as error:
            say(f"| {kernel} | {shape} | failed: {type(error).__name__}: {error} |")

    import kda_kernels
    import kernels
    for (k, n), bits in itertools.product(EXL3_SHAPES, (3, 4)):
        sets = exl3_data_sets(k, n, bits)
        ref = exl3_reference(*sets[0], synthetic.CODEBOOK)
        calls = [exl3_ours(*s, synthetic.CODEBOOK) for s in sets]
        line("exl3_gemv m=1", f"{k}x{n} K{bits}", calls, k * n * bits / 8 / gbps / 1e3, lambda ref=ref: ref)

    for bits in (3, 4):
        try:
            moe_line(line, gbps, bits, args.peer)
        except Exception as error:  # one failing kernel must not hide the others
            say(f"| exl3_moe_decode | K{bits} | failed: {type(error).__name__}: {error} |")

    H, D = KDA_H, KDA_D
    for B in (1, 16):
        q, k, v, g, beta = kda_inputs(B, seed=2)
        n_calls = 20
        pool = torch.zeros(n_calls * B, H, D, D, device="cuda")
        slots = [torch.arange(i * B, (i + 1) * B, device="cuda") for i in range(n_calls)]
        calls = [lambda s=s: kda_kernels.kda_recurrent_step(q, k, v, g, beta, pool, s) for s in slots]
        line("kda_recurrent_step", f"B={B} H={H} d={D}", calls, 2 * B * H * D * D * 4 / gbps / 1e3)
    T = 8192
    q, k, v, g, beta = kda_inputs(T, seed=3)
    try:
        ms = median_us(lambda: kda_kernels.kda_chunk_prefill(q, k, v, g, beta)) / 1e3
        say(f"kda_chunk_prefill T={T}: {ms:.3f} ms per layer (fla chunk_kda: 1.85 ms, spec §9.3 [meas], not measured here)")
    except Exception as error:
        say(f"kda_chunk_prefill T={T}: failed: {type(error).__name__}: {error}")

    for n, k in FP8_SHAPES:
        # Enough weight copies that one pass over them exceeds the L2 three times.
        lins = [fp8.FP8Linear.from_weight(torch.randn(n, k, device="cuda") / math.sqrt(k))
                for _ in range(max(1, math.ceil(3 * L2_BYTES / (n * k))))]
        dense = [lin.dequantize(torch.bfloat16) for lin in lins[:max(1, math.ceil(3 * L2_BYTES / (2 * n * k)))]]
        for m in (1, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            calls = [lambda lin=lin: kernels.fp8_gemv(x, lin.weight, lin.scale_inv, out=out) for lin in lins]
            line("fp8_gemv", f"m={m} {n}x{k}", calls, lins[0].nbytes() / gbps / 1e3,
                 lambda: x.float() @ lins[0].dequantize().T)
            cublas = [lambda w=w: torch.nn.functional.linear(x, w) for w in dense]
            line("bf16 F.linear (cuBLAS)", f"m={m} {n}x{k}", cublas, 2 * n * k / gbps / 1e3)
    fp8_sweep(line, gbps)
    if args.peer:
        exl3_compare(argparse.Namespace(codebook=synthetic.CODEBOOK))


def fp8_sweep(line, gbps: float, n: int = 8192, k: int = 4096) -> None:
    """fp8_gemv launch configurations at batch 1 on one core-sized weight."""
    import kernels
    lins = [fp8.FP8Linear.from_weight(torch.randn(n, k, device="cuda") / math.sqrt(k))
            for _ in range(math.ceil(3 * L2_BYTES / (n * k)))]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    for block_n, warps in itertools.product((8, 16), (1, 2, 4)):  # the FMA kernel's settings (one row)
        launch = dict(block_n=block_n, num_warps=warps)
        calls = [lambda lin=lin: kernels.fp8_gemv(x, lin.weight, lin.scale_inv, out=out, **launch) for lin in lins]
        line("fp8_gemv sweep", f"m=1 {n}x{k} {launch}", calls, lins[0].nbytes() / gbps / 1e3,
             lambda: x.float() @ lins[0].dequantize().T)


def moe_line(line, gbps: float, bits: int, peer: bool = False, E: int = 288, top_k: int = 8, D: int = 4096,
             I: int = 2048) -> None:
    """One MoE layer at batch 1: exl3_moe_decode (3 launches) vs the 3 * top_k exl3_gemv calls of the
    per-expert path (without its SwiGLU and sums), over 10 routings (80 experts, past the L2); with
    peer, also exllamav3's fused MoE kernel on the same experts and routings (`their_moe`)."""
    import exl3_kernels
    from model_glm import swiglu
    g = torch.Generator(device="cuda").manual_seed(bits)
    projections = []
    for k, n in ((D, I), (D, I), (I, D)):
        trellis = torch.empty(E * k * n * bits // 8, dtype=torch.uint8, device="cuda").random_(generator=g)
        sign = lambda size: (torch.randint(0, 2, (E, size), generator=g, device="cuda") * 2 - 1).half()
        projections.append((trellis.view(torch.int16).view(E, k // 16, n // 16, 16 * bits),
                            sign(k) * (1.2 * k) ** -0.5, sign(n) * (1.2 * k) ** -0.5))
    x = torch.randn(1, D, generator=g, device="cuda").half()
    routings = [torch.randperm(E, generator=g, device="cuda")[:top_k][None] for _ in range(10)]
    route = torch.rand(1, top_k, generator=g, device="cuda")
    fused = [lambda ids=ids: exl3_kernels.exl3_moe_decode(x, ids, route, *projections, synthetic.CODEBOOK, 10.0)
             for ids in routings]
    ids0 = routings[0][0].tolist()
    ref = torch.zeros(1, D, device="cuda")
    for j, e in enumerate(ids0):
        gate, up, down = (exl3.EXL3Linear(p[0][e], p[1][e], p[2][e], synthetic.CODEBOOK) for p in projections)
        # The torch twin (EXL3Linear's slow path), not its CUDA dispatch to the kernels under test.
        act = swiglu(gate._forward_torch(x.float()), up._forward_torch(x.float()), 10.0)
        ref += route[0, j] * down._forward_torch(act)
    expert_bytes = 3 * D * I * bits / 8 + 2 * 2 * (D + I) * 2
    line("exl3_moe_decode", f"B=1 top-{top_k} of {E}, {D}x{I} K{bits}", fused, top_k * expert_bytes / gbps / 1e3,
         lambda: ref)
    outs = [torch.empty(1, n, dtype=torch.float16, device="cuda") for n in (I, I, D)]
    act = torch.randn(1, I, generator=g, device="cuda").half()
    separate = []
    for ids in routings:
        for e in ids[0].tolist():
            for p, xin, out in zip(projections, (x, x, act), outs):
                separate.append(lambda p=p, e=e, xin=xin, out=out: exl3_kernels.exl3_gemv(
                    xin, p[0][e], p[1][e], p[2][e], synthetic.CODEBOOK, out=out))
    per_layer = 3 * top_k
    line(f"{per_layer} x exl3_gemv (per expert)", "same, per layer",
         [lambda i=i: [c() for c in separate[i:i + per_layer]] for i in range(0, len(separate), per_layer)],
         top_k * expert_bytes / gbps / 1e3)
    if peer:
        _, ext = load_exllamav3()
        theirs = [their_moe(ext, projections, synthetic.CODEBOOK, x, ids, route, 10.0) for ids in routings]
        line("exllamav3 exl3_moe", f"B=1 top-{top_k} of {E}, {D}x{I} K{bits}", theirs,
             top_k * expert_bytes / gbps / 1e3, lambda: ref)


FP8_SHAPES = [(8192, 4096), (4096, 8192), (1536, 4096), (24576, 4096), (154880, 4096)]  # (out, in)


# ================================================================ EXL3

EXL3_SHAPES = [(4096, 2048), (2048, 4096), (4096, 12288)]  # (in, out)
MARKERS = {"mcg": 0xCBAC1FED - (1 << 32), "mul1": 0x83DCD12D - (1 << 32)}
L2_BYTES = 60e6


def exl3_random_linear(k: int, n: int, bits: float, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    width = int(16 * bits)
    trellis = torch.randint(-2**15, 2**15, (k // 16, n // 16, width), generator=g, device="cuda",
                            dtype=torch.int32).to(torch.int16)
    sign = lambda size: torch.randint(0, 2, (size,), generator=g, device="cuda") * 2 - 1
    suh = ((torch.rand(k, generator=g, device="cuda") * 0.1 + 0.01) * sign(k)).half()
    svh = ((torch.rand(n, generator=g, device="cuda") * 0.1 + 0.01) * sign(n)).half()
    x = torch.randn(1, k, generator=g, device="cuda").half()
    return trellis, suh, svh, x


def exl3_data_sets(k: int, n: int, bits: float):
    """Enough copies that the trellis bytes exceed the L2 three times: timings are not L2 hits."""
    count = max(2, math.ceil(3 * L2_BYTES / (k * n * bits / 8)))
    return [exl3_random_linear(k, n, bits, seed) for seed in range(count)]


def exl3_reference(trellis, suh, svh, x, codebook):
    # The torch twin's math (x @ dequantize), decoded with the bit-exact kernel to stay fast.
    import exl3_kernels
    w = exl3_kernels.exl3_decode(trellis, codebook).float()
    h = exl3.hadamard_128("cuda")
    k, n = w.shape
    w = (h @ w.view(k // 128, 128, n)).view(k, n)
    w = (w.view(k, n // 128, 128) @ h).view(k, n)
    return x.float() @ (suh.float()[:, None] * w * svh.float()[None, :])


def exl3_ours(trellis, suh, svh, x, codebook, **launch):
    import exl3_kernels
    out = torch.empty((x.shape[0], trellis.shape[1] * 16), dtype=torch.float16, device="cuda")
    return lambda: exl3_kernels.exl3_gemv(x, trellis, suh, svh, codebook, out=out, **launch)


EXL3_CONFIGS = [dict(block_n=bn, row_tiles=rt, num_warps=4) for bn in (64, 128) for rt in (1, 2, 4)] + [
    dict(block_n=128, row_tiles=2, num_warps=8)]
EXL3_QUICK_CONFIGS = [dict(block_n=128, row_tiles=1), dict(block_n=64, row_tiles=2), dict(block_n=128, row_tiles=2)]


def exl3_sweep(args, configs: list[dict] = EXL3_CONFIGS, decode: bool = True) -> dict:
    """Graph time of every launch configuration; returns the fastest per (shape, K)."""
    import exl3_kernels
    say(f"device {torch.cuda.get_device_name()}, copy {copy_gbps():.0f} GB/s (read + write)")
    say("| shape (in x out) | K | block_n | row_tiles | warps | split | graph us | trellis GB/s | T weights/s | rel err |")
    best = {}
    for (k, n), bits in itertools.product(EXL3_SHAPES, (3, 4)):
        sets = exl3_data_sets(k, n, bits)
        ref = exl3_reference(*sets[0], args.codebook)
        for launch in configs:
            calls = [exl3_ours(*s, args.codebook, **launch) for s in sets]
            try:
                err, t = rel_err(calls[0](), ref), graph_us(calls)
            except Exception as error:  # one broken launch shape must not hide the others
                say(f"| {k}x{n} | {bits} | {launch} | failed: {error!r} |")
                continue
            split = exl3_kernels._default_split(torch.device("cuda"), n, k // 16 // launch["row_tiles"], launch["block_n"])
            say(f"| {k}x{n} | {bits} | {launch['block_n']} | {launch['row_tiles']} | {launch.get('num_warps', 4)} | "
                f"{split} | {t:.1f} | {k * n * bits / 8 / t / 1e3:.0f} | {k * n / t / 1e6:.2f} | {err:.1e} |")
            if err <= 1e-3 and t < best.get((k, n, bits), (None, float("inf")))[1]:
                best[(k, n, bits)] = (launch, t)
    exl3_registers()
    if decode:
        say("| decode (in x out) | K | exl3_decode graph us | GB/s (trellis read + fp16 write) |")
        for bits in (3, 4):
            k, n = 4096, 12288
            sets = exl3_data_sets(k, n, bits)
            outs = [torch.empty((k, n), dtype=torch.float16, device="cuda") for _ in sets]
            calls = [lambda s=s, o=o: exl3_kernels.exl3_decode(s[0], args.codebook, out=o) for s, o in zip(sets, outs)]
            t = graph_us(calls)
            say(f"| {k}x{n} | {bits} | {t:.1f} | {k * n * (2 + bits / 8) / t / 1e3:.0f} |")
    return {key: launch for key, (launch, _) in best.items()}


def exl3_registers() -> None:
    """Compiler resource report of every compiled exl3_gemv variant (registers, spills)."""
    import exl3_kernels
    try:
        for caches in exl3_kernels._gemv_kernel.device_caches.values():
            for compiled in caches[0].values():
                say(f"gemv kernel warps {compiled.metadata.num_warps}: {compiled.n_regs} registers, "
                    f"{compiled.n_spills} spills")
    except Exception as error:  # Triton's cache layout differs between versions
        say(f"no register report: {error!r}")


def load_exllamav3():
    start = time.time()
    from exllamav3.ext import exllamav3_ext
    from exllamav3.modules.quant.exl3 import LinearEXL3
    say(f"exllamav3 imported (extension JIT/load) in {time.time() - start:.0f} s")
    return LinearEXL3, exllamav3_ext


def their_linear(LinearEXL3, trellis, suh, svh, codebook):
    markers = {cb: torch.tensor(v, dtype=torch.int32, device=trellis.device) for cb, v in MARKERS.items()}
    k, n = trellis.shape[0] * 16, trellis.shape[1] * 16
    return LinearEXL3(None, k, n, suh=suh, svh=svh, trellis=trellis,
                      mcg=markers["mcg"] if codebook == "mcg" else None,
                      mul1=markers["mul1"] if codebook == "mul1" else None)


def their_moe(ext, projections: list, codebook: str, x: torch.Tensor, ids: torch.Tensor, route: torch.Tensor,
              limit: float) -> Callable[[], torch.Tensor]:
    """A call of exllamav3's fused MoE kernel (`exl3_moe`, which its BlockSparseMLP runs for batches of
    rows; one to eight rows go through its bound BC_BlockSparseMLP class instead, not reachable without
    its module) on our stacked experts (per-expert pointer tables into them) for one routing (ids, route
    [m, top_k]): SiLU, K from the trellis, its 16-row tiles. Returns the fp32 [m, D] output."""
    E, _, tiles_n, width = projections[0][0].shape
    D, I, K = x.shape[1], tiles_n * 16, width / 16
    dev = x.device
    tables = [torch.tensor([t[e].data_ptr() for e in range(E)], dtype=torch.long, device=dev)
              for p in projections for t in p]  # gate trellis, suh, svh; up ...; down ...
    concurrency, rows = ext.exl3_moe_max_concurrency(dev.index), 128  # rows: exllamav3's MOE_FUSED_ROWS
    temp = [torch.empty(concurrency, rows, size, dtype=torch.half, device=dev) for size in (D, D, I, I)]
    m, top_k = ids.shape
    flat = ids.reshape(-1).long()
    order = flat.argsort()
    token_sorted = (torch.arange(m * top_k, device=dev) // top_k)[order]
    weight_sorted = route.reshape(-1)[order].half()
    count = torch.bincount(flat, minlength=E + 1)
    out = torch.zeros(m, D, dtype=torch.float32, device=dev)
    mcg, mul1 = codebook == "mcg", codebook == "mul1"
    xh = x.half()

    def call() -> torch.Tensor:
        out.zero_()
        ext.exl3_moe(xh, out, count, token_sorted, weight_sorted, *temp, 0, K, K, K, *tables,
                     mcg, mul1, mcg, mul1, mcg, mul1, limit, -1, None, None, 1, rows, 16)
        return out
    return call


def exl3_compare(args, best: dict | None = None) -> None:
    """Batch-1 exl3_gemv vs exllamav3 LinearEXL3.forward, exl3_decode vs its reconstruct, same tensors."""
    import exl3_kernels
    gbps = copy_gbps()
    say(f"device {torch.cuda.get_device_name()}, copy {gbps:.0f} GB/s (read + write)")
    LinearEXL3, ext = load_exllamav3()
    say("| shape (in x out) | K | ours launch | ours eager us | exllamav3 eager us | ours graph us | "
        "exllamav3 graph us | trellis floor us | ours/exl3 graph | ours err | exl3 err |")
    for (k, n), bits in itertools.product(EXL3_SHAPES, (3, 4)):
        sets = exl3_data_sets(k, n, bits)
        ref = exl3_reference(*sets[0], args.codebook)
        mods = [their_linear(LinearEXL3, t, su, sv, args.codebook) for t, su, sv, _ in sets]
        theirs = [lambda mod=mod, x=s[3]: mod.forward(x, {}) for mod, s in zip(mods, sets)]
        err_theirs, e_theirs = rel_err(theirs[0](), ref), eager_us(theirs)
        try:
            g_theirs = graph_us(theirs)
        except Exception as error:  # report, do not hide
            say(f"exllamav3 graph capture failed: {error!r}")
            g_theirs = float("nan")
        floor = k * n * bits / 8 / (gbps * 1e9) * 1e6
        for launch in [{}] + ([best[(k, n, bits)]] if best and (k, n, bits) in best else []):
            mine = [exl3_ours(*s, args.codebook, **launch) for s in sets]
            try:
                err_mine, e_mine, g_mine = rel_err(mine[0](), ref), eager_us(mine), graph_us(mine)
            except Exception as error:
                say(f"| {k}x{n} | {bits} | {launch or 'default'} | failed: {error!r} | {e_theirs:.1f} |")
                continue
            say(f"| {k}x{n} | {bits} | {launch or 'default'} | {e_mine:.1f} | {e_theirs:.1f} | {g_mine:.1f} | "
                f"{g_theirs:.1f} | {floor:.2f} | {g_mine / g_theirs:.2f} | {err_mine:.1e} | {err_theirs:.1e} |")
    say("| decode (in x out) | K | ours exl3_decode us | exllamav3 reconstruct us | bit-exact | ours GB/s |")
    for bits in (3, 4):
        k, n = 4096, 12288
        sets = exl3_data_sets(k, n, bits)
        outs = [torch.empty((k, n), dtype=torch.float16, device="cuda") for _ in sets]
        mcg, mul1 = args.codebook == "mcg", args.codebook == "mul1"
        mine = [lambda s=s, o=o: exl3_kernels.exl3_decode(s[0], args.codebook, out=o) for s, o in zip(sets, outs)]
        theirs = [lambda s=s, o=o: ext.reconstruct(o, s[0], bits, mcg, mul1) for s, o in zip(sets, outs)]
        w_mine = mine[0]().clone()
        theirs[0]()
        exact = torch.equal(w_mine.view(torch.int16), outs[0].view(torch.int16))
        t_mine, t_theirs = graph_us(mine), graph_us(theirs)
        say(f"| {k}x{n} | {bits} | {t_mine:.1f} | {t_theirs:.1f} | {exact} | {k * n * (2 + bits / 8) / t_mine / 1e3:.0f} |")


def exl3_crosscheck(args) -> None:
    """exllamav3's decode of our tensors (random trellis; exl3.quantize) vs exl3.py and the kernel."""
    import exl3_kernels
    LinearEXL3, _ = load_exllamav3()
    say("| tensor | codebook | K | exllamav3 inner == exl3.unpack | == exl3_decode | full rel err vs dequantize |")
    cases = [(cb, float(b)) for cb in exl3_kernels.CODEBOOKS for b in range(1, 9)] + [("mul1", b) for b in (1.5, 2.5, 3.5)]
    for codebook, bits in cases:
        trellis, suh, svh, _ = exl3_random_linear(1024, 512, bits, seed=int(bits * 2))
        theirs = their_linear(LinearEXL3, trellis, suh, svh, codebook)
        inner = theirs.get_inner_weight_tensor()
        same_torch = torch.equal(inner.view(torch.int16), exl3.unpack(trellis, codebook).view(torch.int16))
        same_triton = torch.equal(inner.view(torch.int16), exl3_kernels.exl3_decode(trellis, codebook).view(torch.int16))
        err = rel_err(theirs.get_weight_tensor(), exl3.dequantize(trellis, suh, svh, codebook))
        say(f"| random 1024x512 | {codebook} | {bits:g} | {same_torch} | {same_triton} | {err:.1e} |")
    seconds = 0.0
    for (k, n), bits, codebook in [((1024, 512), 4, "mcg"), ((4096, 2048), 3, "mul1")]:
        if seconds > 15:  # the second is 16x the first's tiles
            say(f"skipped {k}x{n}: the smaller quantize took {seconds:.0f} s")
            break
        g = torch.Generator(device="cuda").manual_seed(k)
        weight = torch.randn(n, k, generator=g, device="cuda")  # HF layout [out, in]
        start = time.time()
        lin = exl3.quantize(weight, bits, codebook=codebook)
        torch.cuda.synchronize()
        seconds = time.time() - start
        tensors = {name: t.cuda() for name, t in lin.tensors().items()}
        theirs = LinearEXL3(None, k, n, suh=tensors["suh"], svh=tensors["svh"], trellis=tensors["trellis"],
                            mcg=tensors.get("mcg"), mul1=tensors.get("mul1"))
        same = torch.equal(theirs.get_inner_weight_tensor().view(torch.int16),
                           exl3.unpack(tensors["trellis"], codebook).view(torch.int16))
        ours_w = exl3.dequantize(tensors["trellis"], tensors["suh"], tensors["svh"], codebook)
        err = rel_err(theirs.get_weight_tensor(), ours_w)
        nmse = rel_err(ours_w.float(), weight.t()) ** 2
        x = torch.randn(1, k, generator=g, device="cuda").half()
        y_err = rel_err(theirs.forward(x, {}), x.float() @ ours_w.float())
        say(f"| exl3.quantize {k}x{n} ({seconds:.0f} s, NMSE {nmse:.4f}) | {codebook} | {bits} | {same} | - | "
            f"{err:.1e} (their forward vs x@W: {y_err:.1e}) |")


def run_exl3(args) -> None:
    if args.mode == "quick":
        exl3_sweep(args, EXL3_QUICK_CONFIGS, decode=False)
    elif args.mode == "sweep+compare":
        exl3_compare(args, exl3_sweep(args))
    else:
        {"sweep": exl3_sweep, "compare": exl3_compare, "crosscheck": exl3_crosscheck}[args.mode](args)


# ================================================================ KDA

KDA_H, KDA_D = 64, 128
STATE_BYTES = KDA_H * KDA_D * KDA_D * 4  # one sequence's fp32 state in one layer: 4 MiB


def kda_inputs(lead: int, seed: int, dtype=torch.float32):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")
    l2 = lambda x: x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    H, D = KDA_H, KDA_D
    q = l2(r(lead, H, D)) * D ** -0.5
    k = l2(r(lead, H, D))
    v = r(lead, H, D)
    g = -5 * torch.sigmoid(2 * r(lead, H, D))
    beta = torch.sigmoid(r(lead, H))
    return q.to(dtype), k.to(dtype), v.to(dtype), g, beta


def kda_twin(q, k, v, g, beta, S0=None, block=None):
    """model_glm.kda_recurrent over the sequence: (o, final state, states after each `block` tokens)."""
    S = torch.zeros(q.shape[1], q.shape[2], v.shape[2], device=q.device) if S0 is None else S0.clone()
    outs, saved = [], []
    T = q.shape[0]
    cuts = sorted({T} | (set(range(block, T + 1, block)) if block else set()))
    t0 = 0
    for t1 in cuts:
        o, S = kda_recurrent(*(x[t0:t1].float() for x in (q, k, v, g, beta)), S)
        outs.append(o)
        if block and t1 % block == 0:
            saved.append(S)
        t0 = t1
    return torch.cat(outs).to(q.dtype), S, (torch.stack(saved) if block else None)


def max_rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def kda_decode(gbps: float) -> None:
    import kda_kernels
    say("\n== decode: kda_recurrent_step, one token per sequence ==")
    B, slots_total = 16, 40
    q, k, v, g, beta = kda_inputs(B, seed=1)
    pool = torch.randn(slots_total, KDA_H, KDA_D, KDA_D, device="cuda")
    pool_ref = pool.clone()
    slots = torch.randperm(slots_total, device="cuda")[:B]
    for _ in range(3):
        o = kda_kernels.kda_recurrent_step(q, k, v, g, beta, pool, slots)
        outs = []
        for b, s in enumerate(slots.tolist()):
            o_b, pool_ref[s] = kda_recurrent(*(x[b:b + 1] for x in (q, k, v, g, beta)), pool_ref[s])
            outs.append(o_b[0])
        o_ref = torch.stack(outs)
    say(f"B={B}, 3 steps, random slots: rel err o {max_rel_err(o, o_ref):.2e}, pool {max_rel_err(pool, pool_ref):.2e}")
    say("eager: do_bench median, Python launch included; graph: 20 calls in one CUDA graph, each on its own")
    say("slots (20 x B states, past the L2); GB/s and 'of copy' from the graph time")
    say(f"{'B':>3} {'BV':>3} {'warps':>5} {'eager us':>9} {'graph us':>9} {'GB/s':>7} {'of copy':>8}")
    calls = 20
    for B in (1, 16, 64):
        q, k, v, g, beta = kda_inputs(B, seed=2)
        pool = torch.zeros(calls * B, KDA_H, KDA_D, KDA_D, device="cuda")
        slots = [torch.arange(i * B, (i + 1) * B, device="cuda") for i in range(calls)]
        for bv, warps in ((16, 2), (16, 4), (32, 4), (32, 8), (64, 8)):
            step = [lambda s=s: kda_kernels.kda_recurrent_step(q, k, v, g, beta, pool, s, block_v=bv, num_warps=warps)
                    for s in slots]
            e, t = median_us(step[0]), graph_us(step)
            rate = 2 * B * STATE_BYTES / t / 1e3
            say(f"{B:>3} {bv:>3} {warps:>5} {e:>9.1f} {t:>9.1f} {rate:>7.0f} {rate / gbps:>8.2f}")
    say("[spec §9.3, not measured here] fla fused_recurrent_kda: 39 us at B=1")


def kda_prefill(gbps: float) -> None:
    import kda_kernels
    say("\n== prefill: kda_chunk_prefill (chunk 64) vs the per-token recurrence ==")
    for T, block in ((1024, 256), (8192, None)):
        q, k, v, g, beta = kda_inputs(T, seed=T)
        S0 = 0.1 * torch.randn(KDA_H, KDA_D, KDA_D, device="cuda")
        after = range(block, T + 1, block) if block else ()
        o, final, states = kda_kernels.kda_chunk_prefill(q, k, v, g, beta, S0, after=after)
        o_ref, final_ref, states_ref = kda_twin(q, k, v, g, beta, S0, block=block)
        line = f"T={T}: rel err o {max_rel_err(o, o_ref):.2e}, final state {max_rel_err(final, final_ref):.2e}"
        if block:
            line += f", {states.shape[0]} boundary states {max_rel_err(states, states_ref):.2e}"
        say(line)
    q, k, v, g, beta = kda_inputs(1024, seed=5, dtype=torch.bfloat16)
    o, final, _ = kda_kernels.kda_chunk_prefill(q, k, v, g, beta)
    o_ref, final_ref, _ = kda_twin(q, k, v, g, beta)
    say(f"T=1024 bf16 q/k/v (o in bf16): rel err o {max_rel_err(o, o_ref):.2e}, final state "
        f"{max_rel_err(final, final_ref):.2e}")
    say(f"\n{'T':>5} {'BV':>3} {'warps':>5} {'stages':>6} {'factors':>8} {'states':>8} {'output':>8} {'total ms':>8}")
    for T in (1024, 8192):
        q, k, v, g, beta = kda_inputs(T, seed=T)
        S0 = torch.zeros(KDA_H, KDA_D, KDA_D, device="cuda")
        f = kda_kernels.chunk_factors(q, k, v, g, beta, 64)
        factors_ms = median_us(lambda: kda_kernels.chunk_factors(q, k, v, g, beta, 64)) / 1e3
        for bv, warps, stages in ((32, 4, 1), (32, 4, 2), (64, 8, 2), (16, 4, 1)):
            try:
                states = kda_kernels.chunk_states(f, S0, bv, warps, stages)  # overwrites f.u: timing only from here
                states_ms = median_us(lambda: kda_kernels.chunk_states(f, S0, bv, warps, stages)) / 1e3
                output_ms = median_us(lambda: kda_kernels.chunk_output(f, states, torch.float32)) / 1e3
                total_ms = median_us(lambda: kda_kernels.kda_chunk_prefill(q, k, v, g, beta, S0, block_v=bv,
                                                                           num_warps=warps, num_stages=stages)) / 1e3
            except Exception as e:  # e.g. out of shared memory for deep pipelines
                say(f"{T:>5} {bv:>3} {warps:>5} {stages:>6} failed: {type(e).__name__}: {str(e)[:80]}")
                continue
            say(f"{T:>5} {bv:>3} {warps:>5} {stages:>6} {factors_ms:>8.3f} {states_ms:>8.3f} {output_ms:>8.3f} {total_ms:>8.3f}")
    say("[spec §9.3, not measured here] fla chunk_kda: 1.85 ms at T=8192")


def kda_precision(gbps: float) -> None:
    import kda_kernels
    say("\n== tl.dot input precision (prefill T=8192, default tiles; kda_kernels.DOT_PRECISION is the default) ==")
    T = 8192
    q, k, v, g, beta = kda_inputs(T, seed=11)
    S0 = 0.1 * torch.randn(KDA_H, KDA_D, KDA_D, device="cuda")
    o_ref, final_ref, _ = kda_twin(q, k, v, g, beta, S0)
    for precision in ("tf32", "tf32x3", "ieee"):
        o, final, _ = kda_kernels.kda_chunk_prefill(q, k, v, g, beta, S0, precision=precision)
        ms = median_us(lambda: kda_kernels.kda_chunk_prefill(q, k, v, g, beta, S0, precision=precision)) / 1e3
        say(f"{precision:>7}: {ms:.3f} ms, rel err o {max_rel_err(o, o_ref):.2e}, final state "
            f"{max_rel_err(final, final_ref):.2e}")


def run_kda(args) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False  # the twin must be true fp32
    gbps = copy_gbps()
    say(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, H={KDA_H}, d={KDA_D}, copy {gbps:.0f} GB/s")
    wanted = set(args.sections) or {"decode", "prefill"}
    unknown = wanted - {"decode", "prefill", "precision"}
    if unknown:
        sys.exit(f"bench.py kda: unknown section(s) {sorted(unknown)}; expected decode, prefill, precision")
    for name, fn in (("decode", kda_decode), ("prefill", kda_prefill), ("precision", kda_precision)):
        if name in wanted:
            fn(gbps)
            say(f"[{time.time() - START:.0f} s elapsed]")


# ================================================================ command line

def _synthetic_model_args(p: argparse.ArgumentParser) -> None:
    """The synthetic model's options, the same for `model` and `engine`."""
    p.add_argument("--tiny", action="store_true", help="the tests' tiny config (CPU smoke run)")
    p.add_argument("--layers", type=int, default=None, help="first N layers only (default: all 45)")
    p.add_argument("--bits", type=float, default=3.25, help="3.25 (K3/K4 mix) or an integer K")
    p.add_argument("--core", choices=("fp8", "bf16"), default="fp8")
    p.add_argument("--reserve-gb", type=float, default=8.0, help="GPU memory kept for activations")
    p.add_argument("--seed", type=int, default=0)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("model", help="synthetic full-size model: decode and prefill vs floors")
    where = m.add_mutually_exclusive_group()
    where.add_argument("--device", default=None, help="one device (default cuda)")
    where.add_argument("--devices", default=None,
                       help="e.g. cuda:0,cuda:1: the layers split over them (placement.py); no CUDA graphs then")
    _synthetic_model_args(m)
    m.add_argument("--steps", type=int, default=8, help="timed decode steps per batch size")
    m.add_argument("--context", type=int, default=1024, help="context already in the cache for decode")
    m.add_argument("--long-context", type=int, default=131072)
    m.add_argument("--prefill-chunk", type=int, default=8192, help="tokens per prefill forward (the engine's max_batch_tokens, whose default is the same)")
    m.add_argument("--max-batch", type=int, default=16)
    m.add_argument("--budget", type=float, default=240.0,
                   help="seconds of timed sections, counted once the model is built and its graphs captured; "
                        "later sections are skipped past it")
    m.add_argument("--reference", action="store_true",
                   help="every step through model_glm's reference path (no fast decode step, no CUDA graphs)")
    m.add_argument("--kl-steps", type=int, default=4, help="decode steps compared between fast and reference")
    m.add_argument("--profile", action="store_true",
                   help="profile one decode step (graph, fast eager, or --reference) and one prefill (after the timed "
                        "sections, whatever --budget)")
    k = sub.add_parser("kernels", help="per-kernel timings vs floors")
    k.add_argument("--peer", action="store_true", help="also exllamav3 (needs it importable; ~5 min JIT)")
    e = sub.add_parser("exl3", help="EXL3 GEMV launch sweep / exllamav3 comparison")
    e.add_argument("mode", choices=["sweep", "quick", "compare", "sweep+compare", "crosscheck"])
    e.add_argument("--codebook", default="mcg", choices=exl3.CODEBOOKS)
    g = sub.add_parser("engine", help="synthetic model: Engine.step() in steady decode against the bare fast step")
    g.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    _synthetic_model_args(g)
    g.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    g.add_argument("--context", type=int, default=1024, help="prompt tokens of each request")
    g.add_argument("--tokens", type=int, default=48, help="generated tokens of each request")
    sp = sub.add_parser("speculative", help="the default model at batch 1: plain vs MTP vs DFlash2 speculative decoding")
    sp.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    sp.add_argument("--draft-tokens", type=int, default=None, help="fixed drafts per step (default: adaptive)")
    f = sub.add_parser("fp8core", help="the default model: BF16 core vs FP8 core (amax, pow2): bytes, KL, speed")
    f.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    f.add_argument("--context", type=int, default=1024)
    a = sub.add_parser("agreement", help="the default model: the fast decode step vs the reference path (KL)")
    a.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a.add_argument("--context", type=int, default=256)
    a.add_argument("--steps", type=int, default=32)
    d = sub.add_parser("kda", help="KDA kernels at the real shapes: correctness and timings")
    d.add_argument("sections", nargs="*", help="decode, prefill, precision (default: decode prefill)")
    return parser.parse_args(argv)


# ================================================================ the engine on the synthetic model

ENGINE_SAMPLING = (("greedy", dict(temperature=0)), ("top_p 0.95", dict(temperature=1.0, top_p=0.95, seed=1)),
                   ("top_p 0.95 json_object", dict(temperature=1.0, top_p=0.95, seed=1, json_object=True)),
                   ("top_p 0.95 tool_calls", dict(temperature=1.0, top_p=0.95, seed=1, tool_calls={"search": {
                       "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}})))


def stand_in_tokenizer(vocab_size: int) -> Tokenizer:
    """A word-level tokenizer for the synthetic model: ids 2..257 are the 256 single bytes (byte-level
    pieces), 258..263 the tool-call tags, every other id i the word "t{i}". The bytes let a JSON answer open its
    object and a key (a tool call its name and key); random logits then keep it inside that key's string,
    where every "t{i}" fits: the common case of a held row, whose first few race leaders continue the answer."""
    import engine
    import toolmode
    byte_piece = {b: ch for ch, b in engine.BYTE_DECODER.items()}
    vocab = {f"t{i}": i for i in range(vocab_size) if not 2 <= i < 264} | {byte_piece[b]: 2 + b for b in range(256)}
    vocab |= {tag: 258 + i for i, tag in enumerate(toolmode.TAGS)}
    return Tokenizer(models.WordLevel(vocab, unk_token="t0"))


def run_engine(args) -> None:
    """Engine.step() in steady decode on the synthetic model, with a stand-in word-level tokenizer
    (stand_in_tokenizer): the scheduler, the sampler (greedy; the generation config's top_p 0.95; the same
    for a JSON answer) and the detokenizer on top of the step, at each --batch; beside it the bare fast step
    with the argmax read back (decode_rate over the engine's own graphs). The median step after every prompt
    is in."""
    import engine
    (device,) = placement.parse_devices([args.device])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = synthetic.model_config(args.layers, args.tiny)
    bits = synthetic.layer_bits(cfg, args.bits)
    B, per_seq = max(args.batch), -(-(args.context + args.tokens + 2) // synthetic.BLOCK_SIZE)
    budget = [torch.cuda.mem_get_info(device)[0] - int(args.reserve_gb * 1e9) if device.type == "cuda" else None]
    plan = synthetic.plan_model(cfg, bits, args.core, dtype, [device], budget, B * per_seq, B + 1)
    model = GLMModel(cfg, synthetic.build_weights(cfg, bits, args.core, dtype, plan.device_of, args.seed), plan)
    e = engine.Engine(model, stand_in_tokenizer(cfg.vocab_size), eos_token_ids=[], max_num_seqs=B,
                      num_blocks=B * per_seq, max_model_len=per_seq * synthetic.BLOCK_SIZE)
    gen = torch.Generator().manual_seed(args.seed)
    for b in args.batch:
        for label, kw in ENGINE_SAMPLING:
            sp = engine.SamplingParams(max_tokens=args.tokens, ignore_eos=True, **kw)
            for _ in range(b):
                e.add_request(torch.randint(2, cfg.vocab_size, (args.context,), generator=gen).tolist(), sp)
            times = []
            while e.has_work():
                t = time.perf_counter()
                e.step()
                if len(e.running) == b and all(s.num_computed >= args.context for s in e.running):
                    times.append(time.perf_counter() - t)
            step = statistics.median(times[1:] or times)  # the first is the step that ended the prefill
            line = f"engine decode B={b} ctx {args.context} {label}: {b / step:.2f} tok/s ({1e3 * step:.3f} ms a step)"
            if e.fast is not None:
                tables = [torch.arange(i * per_seq, (i + 1) * per_seq) for i in range(b)]
                bare = decode_rate(lambda batch: e.fast.step(batch).logits, tables, args.context, 16, [device])
                line += f"; the bare fast step {bare:.2f} tok/s: the engine {b / step / bare:.3f} of it"
            say(line)


# ================================================================ speculative decoding (default model)

SPEC_PROMPTS = ("What does json.dumps do?", "Explain the Python topic 'assert'.", "What does os.path.join do?",
                "How do I sort a list?", "What is a generator?", "Explain the Python topic 'with'.")
SPEC_CACHE_TOKENS = 8192  # per engine: the three live side by side (a default pool takes most of a GPU)


def run_agreement(args) -> None:
    """The trained default model (EXL3 4-bit experts): KL(reference || fast step) over decode steps
    that follow a prefill of real text, beside the reference's own move for a 1-ulp input change;
    then KL(reference || fast prefill) of the last row of 8 prompts (prefixes of the same text)."""
    import engine
    device = torch.device(args.device)
    e = engine.load(device=args.device, progress=False, max_cache_tokens=8192, use_kernels=False)
    model, cfg = e.model, e.model.config
    ids = e.tokenizer.encode(Path(json.__file__).read_text()).ids[:args.context]
    cache = CachePool(cfg, num_blocks=128, num_slots=2, block_size=synthetic.BLOCK_SIZE, dtype=model.dtype,
                      device=device)
    table = torch.arange(64)
    model.forward([SeqChunk(torch.tensor(ids), 0, table, 0)], cache)
    fast = FastDecoder(model, cache, max_context=4096)
    for what, (mean, worst, agree) in fast_vs_reference(model, fast, cache, table, len(ids), args.steps).items():
        say(f"default model ({model.dtype}, {args.device}), KL(reference || {what}) over {args.steps} decode steps "
            f"after {len(ids)} tokens of json/__init__.py: mean {mean:.2e} nats (max {worst:.2e}), "
            f"top-1 agreement {agree}/{args.steps}")
    prefill, kls, agree = FastPrefill(fast), [], 0
    for n in (len(ids) * (i + 1) // 8 for i in range(8)):  # slot 1 and blocks 64.. (slot 0 holds the text)
        chunk = [SeqChunk(torch.tensor(ids[:n]), 0, torch.arange(64, 128), 1)]
        ref, got = model.forward(chunk, cache).logits, prefill.forward(chunk).logits
        kls.append(float(kl_nats(ref, got)))
        agree += int(ref.argmax() == got.argmax())
    say(f"default model ({model.dtype}, {args.device}), KL(reference || fast prefill), last row of 8 prompts of "
        f"{len(ids) // 8}..{len(ids)} tokens: mean {sum(kls) / 8:.2e} nats (max {max(kls):.2e}), top-1 agreement {agree}/8")


def run_fp8_core(args) -> None:
    """The default model (EXL3 4-bit experts) with its BF16 core against the core converted to FP8
    block-128 at load (`engine.load(fp8_core=...)`, both scale rules): core weight bytes, KL(BF16 ||
    FP8) and top-1 agreement of teacher-forced logits over real text, and on CUDA the batch-1
    decode speed of each (64 greedy tokens, best of 3)."""
    import engine
    dtype = torch.bfloat16
    text = Path(json.__file__).read_text()
    params = engine.SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    base = None
    for rule in (None, *fp8.SCALE_RULES):
        e = engine.load(device=args.device, dtype=dtype, progress=False, max_cache_tokens=8192, fp8_core=rule)
        ids = e.tokenizer.encode(text).ids[:args.context]
        logits = e.score(ids)
        specs = checkpoint.expected_tensors(e.config)
        core = sum(w.weight.numel() + 4 * w.scale_inv.numel() if isinstance(w, fp8.FP8Linear) else
                   w.numel() * w.element_size() for name, w in e.model.weights.items()
                   if checkpoint.is_fp8_core(name, specs[name]))
        line = f"core {rule or 'bf16'}: {core / 2**20:.2f} MiB of core projections"
        if base is None:
            base = (logits, core)
        else:
            kl = kl_nats(base[0], logits)
            top1 = (base[0].argmax(-1) == logits.argmax(-1)).float().mean()
            line += (f" ({core / base[1]:.2f} of BF16); KL(BF16 || FP8 {rule}) over {len(ids)} positions: mean "
                     f"{kl.mean():.2e} nats (max {kl.max():.2e}), top-1 agreement {100 * top1:.1f}%")
        if args.device != "cpu":
            prompt = [[{"role": "user", "content": "What does json.dumps do?"}]]
            e.generate(prompt, engine.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
            best = math.inf
            for _ in range(3):
                t = time.perf_counter()
                e.generate(prompt, params)
                best = min(best, time.perf_counter() - t)
            line += f"; decode B=1 {params.max_tokens / best:.1f} tok/s"
        say(line)


def run_speculative(args) -> None:
    """Batch 1, one request at a time, 64 greedy tokens each, for no speculation, MTP (the model's own
    layer) and DFlash2 (the drafter train.py --drafter trained against it): tok/s of the best of 3
    rounds (each round times every speculator in turn, so a shared machine's load hits them alike),
    tokens per verify step (accepted drafts + the target's token), the fraction of verified drafts
    accepted, the speedup over plain decoding, and whether the speculative tokens equal the plain ones
    (greedy verification makes them equal; bf16 verify rows may break a near-tie differently)."""
    import default_model
    import engine
    prompts = [[{"role": "user", "content": q}] for q in SPEC_PROMPTS]
    params = engine.SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    drafter = default_model.shipped_drafter()
    specs = {"none": {}, "mtp": {}, "dflash2": {"drafter_path": drafter}}
    if args.device != "cpu":  # plain decoding through the reference path too (no fast step, no graphs)
        specs = {"none (reference path)": {"use_kernels": False}} | specs
    if drafter is None:
        say(f"dflash2: skipped, no trained drafter in {default_model.SHIPPED_DRAFTER} "
            f"(python train.py --drafter --target default_weights/bf16 --out build/drafter ...)")
        del specs["dflash2"]
    plain = lambda spec: spec.startswith("none")
    engines = {spec: engine.load(device=args.device, progress=False, max_cache_tokens=SPEC_CACHE_TOKENS,
                                 speculator="none" if plain(spec) else spec,
                                 draft_tokens=None if plain(spec) else args.draft_tokens, **opts)
               for spec, opts in specs.items()}
    for e in engines.values():
        e.generate(prompts[:1], engine.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    best, tokens = dict.fromkeys(engines, math.inf), {}
    for _ in range(3):
        for spec, e in engines.items():
            t = time.perf_counter()
            out = [e.generate([q], params)[0] for q in prompts]
            best[spec] = min(best[spec], time.perf_counter() - t)
            tokens[spec] = [r.token_ids for r in out]
    rate = {spec: sum(map(len, tokens[spec])) / best[spec] for spec in engines}
    for spec, e in engines.items():
        s = e.stats()
        line = f"{spec}: {rate[spec]:.1f} tok/s"
        if spec == "none (reference path)":
            line += (f", the fast step is {rate['none'] / rate[spec]:.2f}x faster; tokens identical: "
                     f"{same_tokens(tokens['none'], tokens[spec])}")
        elif spec != "none":
            line += (f", {(s.spec_accepted_tokens + s.spec_verify_steps) / max(1, s.spec_verify_steps):.2f} tokens "
                     f"per verify step, {s.spec_accepted_tokens} of {s.spec_draft_tokens} drafts accepted "
                     f"({100 * s.spec_accepted_tokens / max(1, s.spec_draft_tokens):.1f}%), "
                     f"speedup {rate[spec] / rate['none']:.2f}x, tokens identical to plain: "
                     f"{same_tokens(tokens[spec], tokens['none'])}")
        say(line)


def same_tokens(spec: list[list[int]], plain: list[list[int]]) -> str:
    """"True", or which replies differ and where (bf16 verify rows can break near-ties differently)."""
    diff = [(i, next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y))))
            for i, (x, y) in enumerate(zip(spec, plain)) if x != y]
    if not diff:
        return "True"
    return f"False ({len(diff)} of {len(plain)} replies; first difference at (reply, token) {diff[0]})"


def main(argv: list[str] | None = None) -> None:
    # The model nearly fills the GPU: let the allocator grow segments instead of fragmenting.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    args = parse(argv)
    if args.command == "model":
        _or_exit(lambda: model_devices(args))  # names a CUDA device this machine lacks
    elif not (args.command in ("speculative", "agreement", "fp8core", "engine") and args.device == "cpu"):
        if not torch.cuda.is_available():
            sys.exit(f"bench.py {args.command} needs CUDA (only `model --device cpu --tiny` runs without)")
    torch.manual_seed(0)
    with torch.inference_mode():
        _or_exit(lambda: {"model": run_model, "kernels": run_kernels, "exl3": run_exl3, "kda": run_kda,
                          "speculative": run_speculative, "agreement": run_agreement,
                          "fp8core": run_fp8_core, "engine": run_engine}[args.command](args))


def _or_exit(fn):
    """fn(), or exit with a placement's refusal (the device list, or the numbers of a plan that does not fit)."""
    try:
        return fn()
    except PlacementError as error:
        sys.exit(f"bench.py: {error}")


if __name__ == "__main__":
    main()

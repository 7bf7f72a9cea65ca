"""The fast decode step: `GLMModel.forward` for B sequences that each add one token, computed with
the Triton kernels, fixed shapes and no host synchronization, so that a whole 45-layer step is
captured once per batch size in a CUDA graph and replayed (spec performance.md §7).

The math is model_glm's, in the same order (spec glm53.md §4), and model_glm.forward is this file's
twin (tests/test_fastdecode.py holds them together). Only the way of computing differs:
- mHC (§4.2): one launch per sub-layer boundary up to 32 rows (`mhc_kernels.hc_post_pre`: a sub-layer's
  hc_post with the next one's mix, whose last program of a row finishes hc_pre and its RMSNorm), plus the
  Sinkhorn on the second stream, instead of ~70 torch ops, most of them the 20 Sinkhorn iterations on 4x4
  matrices;
- projections that read the same input run as one GEMV: their weights are concatenated once and
  the model's own entries become views of the concatenation (same values, no extra memory);
- the routed experts of a layer are stacked the same way, so `exl3_kernels.exl3_moe_decode` runs all
  selected experts in three launches with the expert ids read on the device;
- KDA (§4.3): conv window, SiLU, L2 norms, gate and β in one kernel (`kda_kernels.kda_decode_inputs`),
  the recurrence in `kda_kernels.kda_recurrent_step`, the output norm and gate in one more;
- DSA (§4.4): one kernel applies q_a_layernorm and writes the token's cache rows and pooled key
  (`dsa_kernels.dsa_decode_inputs`);
  the indexer scores every pool of a fixed-width block table (`dsa_kernels.dsa_index_scores`) and takes
  a fixed top-k (2051 positions at full size), masking what does not exist instead of slicing; the
  attention gathers the selected latent rows itself (`dsa_kernels.dsa_sparse_attention`); cache rows
  are addressed through device index tensors;
- the router (§4.5): GEMV, sigmoid, top-k and weights in `kernels.moe_route` (two launches);
- on a GPU a MoE layer's shared expert runs on a second stream beside the router and the routed experts
  (`FastDecoder.beside_shared`; the prefill's MoE layers too).
Chunks of several tokens (prefill, speculative verification) go to fastprefill.py; MTP stays in model_glm.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

import exl3
import dsa_kernels
import exl3_kernels
import fp8
import kda_kernels
import kernels
import mhc_kernels
from cache import CachePool
from model_glm import ForwardOutput, GLMModel, SeqChunk, Weight, linear, on_device, swiglu


class Unsupported(ValueError):
    """The model has a part the fast decode step does not run (the reference path still does)."""


# ---------------------------------------------------------------------------------------------
# Preparing the weights: fused projections and stacked experts, as views the model shares
# ---------------------------------------------------------------------------------------------

@dataclass
class Fused:
    """Linears that read the same input, in runs: each run is one weight (a concatenation along the
    outputs, or a single linear) whose output splits into its parts' `sizes`."""
    runs: list[tuple[Weight, list[int]]]

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [y for w, sizes in self.runs for y in linear(x, w).split(sizes, dim=-1)]


def to_device(values: torch.Tensor | list[int], device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Host values on `device` without waiting for it. A copy from pageable memory (torch.tensor(...,
    device=cuda), a list as an index) synchronizes the stream, so the host could not queue the next work,
    the sampler's, behind a decode step's graph; from pinned memory it is queued like a kernel. Values
    already on a GPU are only moved or cast there (no host copy)."""
    if isinstance(values, torch.Tensor) and values.device.type != "cpu":
        return values.to(device, dtype)
    host = torch.as_tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _split_inputs(row: torch.Tensor, B: int, width: int) -> tuple[torch.Tensor, ...]:
    """(tokens, positions, slots [B], tables [B, width]): views of a step's input row."""
    return row[:B], row[B:2 * B], row[2 * B:3 * B], row[3 * B:].view(B, width)


def _out_features(w: Weight) -> int:
    return w.shape[0] if isinstance(w, torch.Tensor) else w.out_features


def _joins(run: list[Weight], w: Weight) -> bool:
    """w may be concatenated after the run: dense tensors of one dtype, or FP8 block-128 linears
    whose row blocks line up (every part before w a multiple of 128 rows)."""
    last = run[-1]
    if isinstance(w, torch.Tensor) and isinstance(last, torch.Tensor):
        return w.dtype == last.dtype
    return (isinstance(w, fp8.FP8Linear) and isinstance(last, fp8.FP8Linear)
            and all(p.out_features % fp8.BLOCK == 0 for p in run))


def _concat(model: GLMModel, names: list[str]) -> Weight:
    """One weight for the run `names`; the model's entries become views of it."""
    parts = [model.w(n) for n in names]
    if len(parts) == 1:
        return parts[0]
    sizes = [_out_features(w) for w in parts]
    if isinstance(parts[0], torch.Tensor):
        fused: Weight = _adjacent(parts, (sum(sizes), *parts[0].shape[1:]))
        if fused is None:
            fused = torch.cat(parts)
        views = list(fused.split(sizes))
    else:
        weight = _adjacent([w.weight for w in parts], (sum(sizes), parts[0].weight.shape[1]))
        scale = _adjacent([w.scale_inv for w in parts],
                          (sum(w.scale_inv.shape[0] for w in parts), parts[0].scale_inv.shape[1]))
        if weight is None or scale is None:
            weight = torch.cat([w.weight.view(torch.uint8) for w in parts]).view(torch.float8_e4m3fn)
            scale = torch.cat([w.scale_inv for w in parts])
        fused = fp8.FP8Linear(weight, scale, name="+".join(names))
        views, row = [], 0
        for n, name in zip(sizes, names):
            views.append(fp8.FP8Linear(weight[row:row + n], scale[row // fp8.BLOCK:-(-(row + n) // fp8.BLOCK)],
                                       name=name))
            row += n
    for name, view in zip(names, views):
        model.weights[name] = view
    return fused


def fuse(model: GLMModel, names: list[str]) -> Fused:
    """Consecutive linears that can be concatenated (`_joins`) run as one GEMV; anything else (EXL3
    core weights, a dtype change) starts a new run. The model's entries are replaced by views."""
    runs: list[list[str]] = []
    for name in names:
        if runs and _joins([model.w(n) for n in runs[-1]], model.w(name)):
            runs[-1].append(name)
        else:
            runs.append([name])
    return Fused([(_concat(model, run), [_out_features(model.w(n)) for n in run]) for run in runs])


@dataclass
class Experts:
    """One MoE layer's routed experts stacked [E, ...]: EXL3 (gate, up, down) = (trellis, suh, svh)
    for exl3_kernels.exl3_moe_decode, or dense gate / up / down weights [E, out, in]."""
    exl3: tuple | None = None  # (gate, up, down, codebook)
    dense: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def _adjacent(tensors: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor | None:
    """A view of shape `shape` over the tensors when they lie back to back in one storage, in order
    and contiguous (as bench.py builds experts, or as an earlier FastDecoder left a fused run), else
    None: building a second FastDecoder on the same model (Engine's profile run) then copies nothing."""
    t0 = tensors[0]
    storage, offset = t0.untyped_storage(), t0.storage_offset()
    for t in tensors:
        if not (t.is_contiguous() and t.dtype == t0.dtype and t.shape[1:] == t0.shape[1:]
                and t.untyped_storage().data_ptr() == storage.data_ptr() and t.storage_offset() == offset):
            return None
        offset += t.numel()
    return t0.new_empty(0).set_(storage, t0.storage_offset(), shape)


def _stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[E, ...] holding the tensors: a view of their storage when they already lie there back to
    back in order (`_adjacent`), else a new stack."""
    t0 = tensors[0]
    if any(t.shape != t0.shape for t in tensors):
        return torch.stack(tensors)  # (raises, naming both shapes)
    stack = _adjacent(tensors, (len(tensors), *t0.shape))
    return torch.stack(tensors) if stack is None else stack


def stack_experts(model: GLMModel, L: int) -> Experts:
    """Stacks layer L's routed experts; the model's expert entries become views of the stacks."""
    cfg = model.config
    p = f"layers.{L}.mlp.experts."
    names = {proj: [f"{p}{e}.{proj}.weight" for e in range(cfg.n_routed_experts)]
             for proj in ("gate_proj", "up_proj", "down_proj")}
    ws = {proj: [model.w(n) for n in ns] for proj, ns in names.items()}
    every = [w for group in ws.values() for w in group]
    if all(isinstance(w, exl3.EXL3Linear) for w in every):
        kinds = {(w.codebook, w.bits, w.bias is None) for w in every}
        if len(kinds) != 1 or not next(iter(kinds))[2]:
            raise Unsupported(f"layer {L}: the fast MoE kernel needs one codebook and one K per layer and "
                              f"no expert bias, found (codebook, K, no bias) {sorted(kinds)}")
        stacks = []
        for proj, group in ws.items():
            trellis, suh, svh = (_stacked([getattr(w, a) for w in group]) for a in ("trellis", "suh", "svh"))
            for e, name in enumerate(names[proj]):
                model.weights[name] = exl3.EXL3Linear(trellis[e], suh[e], svh[e], group[e].codebook, name=name)
            stacks.append((trellis, suh, svh))
        return Experts(exl3=(*stacks, every[0].codebook))
    if all(isinstance(w, torch.Tensor) for w in every):
        stacks = []
        for proj, group in ws.items():
            stack = _stacked(group)
            for e, name in enumerate(names[proj]):
                model.weights[name] = stack[e]
            stacks.append(stack)
        return Experts(dense=tuple(stacks))
    kinds = sorted({type(w).__name__ for w in every})
    raise Unsupported(f"layer {L}: routed experts of type {kinds}; the fast path runs EXL3 or dense experts")


@dataclass
class Layer:
    kind: str  # "kda" | "dsa"
    row: int  # cache row (kda_index / dsa_index)
    attn_hc: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # fn, base, scale (fp32)
    ffn_hc: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    proj: Fused  # KDA: q, k, v, f_a, g_a, b; DSA: q_a, kv_a, indexer wk (its gate: attn["gate"])
    proj2: list[Fused]  # KDA: [f_b], [g_b]; DSA: [q_b, indexer wq_b]
    gates: tuple[kda_kernels.LowRank, kda_kernels.LowRank] | None  # KDA: f_b, g_b applied by the inputs kernel
    attn: dict[str, torch.Tensor]  # the small tensors of the mixer
    o_proj: Weight
    mlp: Fused | None  # dense MLP or shared expert: gate, up
    down: Weight | None
    experts: Experts | None
    router: tuple[torch.Tensor, torch.Tensor] | None  # fp32 gate weight, correction bias
    device: torch.device  # where the layer's weights and cache rows live (model.placement)


# ---------------------------------------------------------------------------------------------
# The step
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Span:
    """A stretch of the step on one device: the embedding (if `embed`), layers [start, end), the
    final norm and head (if `head`). One device gives one span; a layer split gives one per run of
    consecutive layers, plus the embedding or head on the first device where the runs do not start
    or end there."""
    device: torch.device
    embed: bool
    start: int
    end: int
    head: bool


@dataclass
class _Piece:
    """A span's CUDA graph: its static copy of the step's input row (FastDecoder._input_row) on its
    device, the streams it reads (None after the embedding) and what it leaves: (X,) or (logits,
    hidden)."""
    span: _Span
    graph: "torch.cuda.CUDAGraph"
    row: torch.Tensor
    x_in: torch.Tensor | None
    out: tuple[torch.Tensor, ...]


def _spans(layer_device: list[int], devices: tuple[torch.device, ...]) -> list[_Span]:
    """The spans of a step whose layer L runs on devices[layer_device[L]], the embedding and head on
    devices[0] (placement indices, so that two "cpu" entries still give two spans)."""
    runs, L = [], 0
    while L < len(layer_device):
        end = L
        while end < len(layer_device) and layer_device[end] == layer_device[L]:
            end += 1
        runs.append((layer_device[L], L, end))
        L = end
    first, last = runs[0], runs[-1]
    spans = [_Span(devices[d], False, a, b, False) for d, a, b in runs]
    if first[0] == 0:
        spans[0] = _Span(devices[0], True, first[1], first[2], False)
    else:
        spans.insert(0, _Span(devices[0], True, 0, 0, False))
    if last[0] == 0:
        spans[-1] = _Span(devices[0], spans[-1].embed, last[1], last[2], True)
    else:
        spans.append(_Span(devices[0], False, last[2], last[2], True))
    return spans


class FastDecoder:
    """Decode steps of `model` against `cache`: `step(batch)` for chunks of one token each.

    Construction prepares the weights (fusing and stacking them in place, see `fuse`,
    `stack_experts`). `capture(batch_sizes, contexts)` records one CUDA graph per batch size and
    context bucket, and must run before any sequence lives in the cache (the recording run writes
    scratch values into slots 0..B-1 and block 0). A step uses the graph of its batch size with the
    smallest context bucket that holds its positions: the bucket fixes the width of the block
    table, which is what the indexer scans. Steps without a graph, and every step on CPU, run the
    same code eagerly over the blocks they need. `max_context` bounds every position. A model whose
    layers are split over devices (`model.placement`, not the expert split) runs each layer on its
    device: the step is cut into spans, one per device run (`_spans`), each its own CUDA graph, the
    streams copied between them."""

    def __init__(self, model: GLMModel, cache: CachePool, max_context: int):
        self.model, self.cache, self.cfg = model, cache, model.config
        if cache.config != model.config:
            raise ValueError("FastDecoder: the CachePool was built for a different config")
        self.device = cache.device
        self.max_blocks = -(-max_context // cache.block_size)
        if self.max_blocks > cache.num_blocks:
            raise ValueError(f"FastDecoder: max_context {max_context} needs {self.max_blocks} blocks, "
                             f"the cache has {cache.num_blocks}")
        self.max_context = max_context
        if model.placement.split_experts:
            raise Unsupported("the routed experts are split over devices; the fast path runs a layer split only")
        self.layers = [self._prepare(L) for L in range(self.cfg.num_hidden_layers)]
        self.embed = model.w("embed_tokens.weight")
        self.head = model.w("lm_head.weight")
        self.norm = model.w("norm.weight")
        placement = model.placement
        self.spans = _spans(list(placement.layer_device[:self.cfg.num_hidden_layers]), placement.devices)
        self.graphs: dict[tuple[int, int], list[_Piece]] = {}  # (batch size, table width in blocks)
        self._pools: dict[torch.device, tuple] = {}  # one graph memory pool per device
        # a second stream per GPU for the shared experts (see beside_shared); graphs capture it as a branch
        self._beside = {d: torch.cuda.Stream(d) for d in placement.devices if d.type == "cuda"}

    def _prepare(self, L: int) -> Layer:
        m, cfg = self.model, self.cfg
        p = f"layers.{L}."
        hc = lambda kind: (m.w(p + f"hc_{kind}_fn").float().contiguous(), m.w(p + f"hc_{kind}_base").float(),
                           m.w(p + f"hc_{kind}_scale").float())
        a = p + "self_attn."
        if cfg.layer_types[L] == "kda":
            kind, row = "kda", self.cache.kda_index(L)
            proj = fuse(m, [a + f"{n}_proj.weight" for n in ("q", "k", "v", "f_a", "g_a", "b")])
            proj2 = [fuse(m, [a + "f_b_proj.weight"]), fuse(m, [a + "g_b_proj.weight"])]
            gates = (_low_rank_factor(m.w(a + "f_b_proj.weight"), m.dtype),
                     _low_rank_factor(m.w(a + "g_b_proj.weight"), m.dtype))
            gates = None if None in gates else gates
            attn = {"conv": torch.stack([m.w(a + f"{n}_conv1d.weight").squeeze(1) for n in "qkv"]).contiguous(),
                    "A_log": m.w(a + "A_log").float().contiguous(), "dt_bias": m.w(a + "dt_bias").float().contiguous(),
                    "o_norm": m.w(a + "o_norm.weight").float().contiguous()}
        else:
            kind, row, gates = "dsa", self.cache.dsa_index(L), None
            i = a + "indexer."
            proj = fuse(m, [a + "q_a_proj.weight", a + "kv_a_proj_with_mqa.weight", i + "wk.weight"])
            proj2 = [fuse(m, [a + "q_b_proj.weight", i + "wq_b.weight"])]
            H, dn = cfg.num_attention_heads, cfg.qk_nope_head_dim
            # views of kv_b_proj in its own dtype (dsa_kernels.head_matmul takes 16-bit weights exactly)
            W = m.w(a + "kv_b_proj.weight").view(H, dn + cfg.v_head_dim, cfg.kv_lora_rank)
            attn = {"W_UK": W[:, :dn], "W_UV": W[:, dn:],
                    "q_norm": m.w(a + "q_a_layernorm.weight"), "kv_norm": m.w(a + "kv_a_layernorm.weight"),
                    "k_norm_w": m.w(i + "k_norm.weight"), "k_norm_b": m.w(i + "k_norm.bias"),
                    "w_idx": m.w(i + "weights_proj.weight").float(), "ape": m.w(i + "index_kpool_compress_ape").float(),
                    "gate": m.w(i + "index_kpool_compress_gate")}
        f = p + "mlp."
        if cfg.mlp_layer_types[L] == "dense":
            mlp, down, experts, router = fuse(m, [f + "gate_proj.weight", f + "up_proj.weight"]), \
                m.w(f + "down_proj.weight"), None, None
        else:
            s = f + "shared_experts."
            mlp, down = fuse(m, [s + "gate_proj.weight", s + "up_proj.weight"]), m.w(s + "down_proj.weight")
            experts = stack_experts(m, L)
            router = (m.w(f + "gate.weight").float(), m.w(f + "gate.e_score_correction_bias").float())
        return Layer(kind, row, hc("attn"), hc("ffn"), m.w(p + "input_layernorm.weight"),
                     m.w(p + "post_attention_layernorm.weight"), proj, proj2, gates, attn, m.w(a + "o_proj.weight"),
                     mlp, down, experts, router, m.placement.device(L))

    # -- the public step ----------------------------------------------------------------------

    def step(self, batch: list[SeqChunk], tokens: torch.Tensor | None = None) -> ForwardOutput:
        """Logits [B, vocab] (fp32) and final hidden rows for B chunks of one token each. `tokens`
        (int64 [B] on the device) replace the chunks' own: the tokens a sampler drew for the step
        before, which the host has not read yet (the engine launching a step ahead)."""
        width = max(c.start for c in batch) // self.cache.block_size + 1 if batch else 0
        fits = [w for B, w in self.graphs if B == len(batch) and w >= width]
        width = min(fits, default=width)
        row = self._input_row(batch, width)
        if tokens is not None:
            if tuple(tokens.shape) != (len(batch),) or tokens.device != row.device:
                raise ValueError(f"FastDecoder.step: tokens must be [{len(batch)}] on {row.device}, got "
                                 f"{tuple(tokens.shape)} on {tokens.device}")
            row[:len(batch)].copy_(tokens)
        pieces = self.graphs.get((len(batch), width))
        if pieces is None:
            logits, hidden = self.run(*_split_inputs(row, len(batch), width))
        else:
            out = ()
            for piece in pieces:
                # each graph replays on its device's current stream; a copy between devices orders
                # the two devices' current streams (torch's peer copy), so the spans run in turn
                with on_device(piece.span.device):
                    piece.row.copy_(row)
                    if piece.x_in is not None:
                        piece.x_in.copy_(out[0])
                    piece.graph.replay()
                out = piece.out
            logits, hidden = out
        return ForwardOutput(logits.clone(), hidden.clone())

    def _inputs(self, batch: list[SeqChunk], width: int) -> tuple[torch.Tensor, ...]:
        """Device tensors (tokens, positions, slots [B], tables [B, width]) for the chunks: views of
        `_input_row`'s one row."""
        return _split_inputs(self._input_row(batch, width), len(batch), width)

    def _input_row(self, batch: list[SeqChunk], width: int) -> torch.Tensor:
        """The chunks as one int64 device row: B tokens, B positions, B slots, then the block tables
        `width` blocks wide, after checking them (one token each, decode positions). It is put together
        in numpy and copied in one go: the host's time here is the GPU's idle time between two steps,
        and a torch op on the host costs more than a row of numpy."""
        if not batch:
            raise ValueError("FastDecoder.step: empty batch")
        B = len(batch)
        row = np.zeros(B * (3 + width), dtype=np.int64)
        tables = row[3 * B:].reshape(B, width)
        seen = set()
        for i, c in enumerate(batch):
            if c.tokens.dim() != 1 or c.tokens.shape[0] != 1:
                raise ValueError(f"FastDecoder.step: batch[{i}] has tokens of shape {tuple(c.tokens.shape)}; "
                                 "a decode step takes exactly one token per sequence")
            if not 1 <= c.start < self.max_context:
                raise ValueError(f"FastDecoder.step: batch[{i}].start={c.start} is outside 1..{self.max_context - 1} "
                                 "(a decode step follows a prefill; max_context bounds it)")
            if not 0 <= c.slot < self.cache.num_slots or c.slot in seen:
                raise ValueError(f"FastDecoder.step: batch[{i}].slot={c.slot} is out of range or used twice")
            seen.add(c.slot)
            need = c.start // self.cache.block_size + 1
            if c.block_table.shape[0] < need:
                raise ValueError(f"FastDecoder.step: batch[{i}].block_table has {c.block_table.shape[0]} blocks, "
                                 f"position {c.start} needs {need}")
            table = c.block_table.cpu() if c.block_table.is_cuda else c.block_table
            n = min(table.shape[0], width)
            tables[i, :n] = table.numpy()[:n]
            row[i], row[B + i], row[2 * B + i] = c.tokens.item(), c.start, c.slot
        if row[:B].min() < 0 or row[:B].max() >= self.cfg.vocab_size:
            raise ValueError(f"FastDecoder.step: token ids outside 0..{self.cfg.vocab_size - 1}")
        return to_device(torch.from_numpy(row), self.device)  # queued behind the previous step

    # -- CUDA graphs --------------------------------------------------------------------------

    def capture(self, batch_sizes: list[int], contexts: list[int] | None = None) -> None:
        """One CUDA graph per span (one per device run of layers, see `_spans`) for each batch size
        and context bucket (default: max_context), sharing one memory pool per device. Scratch
        writes: see the class."""
        if self.device.type != "cuda":
            raise ValueError("FastDecoder.capture: CUDA graphs need a CUDA device")
        bad = [c for c in contexts or () if not 1 <= c <= self.max_context]
        if bad:
            raise ValueError(f"FastDecoder.capture: contexts {bad} are outside 1..max_context ({self.max_context})")
        widths = sorted({-(-c // self.cache.block_size) for c in contexts or [self.max_context]}, reverse=True)
        for B, width in ((B, w) for B in sorted(batch_sizes, reverse=True) for w in widths):
            # the largest first: the later graphs fit in its memory pool
            if B > self.cache.num_slots:
                raise ValueError(f"FastDecoder.capture: batch size {B} exceeds the cache's {self.cache.num_slots} slots")
            row = torch.zeros(B * (3 + width), dtype=torch.long, device=self.device)
            row[B:2 * B] = 1  # positions
            row[2 * B:3 * B] = torch.arange(B)  # slots
            self.graphs[(B, width)] = self._capture_spans(row, B, width)
        for d in {span.device for span in self.spans}:
            torch.cuda.synchronize(d)

    def _capture_spans(self, row: torch.Tensor, B: int, width: int) -> list[_Piece]:
        pieces, out = [], ()
        for span in self.spans:
            with torch.cuda.device(span.device):
                static_row = row.to(span.device, copy=True)  # the same row on each span's own device
                static = _split_inputs(static_row, B, width)
                x_in = None if span.embed else out[0].to(span.device)
                side = torch.cuda.Stream(span.device)
                side.wait_stream(torch.cuda.current_stream(span.device))
                with torch.cuda.stream(side):  # compiles every kernel outside the capture
                    self._run_span(span, x_in, *static)
                torch.cuda.current_stream(span.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                if span.device not in self._pools:
                    self._pools[span.device] = torch.cuda.graph_pool_handle()
                # the capture stream must be this device's: torch.cuda.graph's default is one stream
                # made once on whichever device was current then, and capturing on it would record
                # nothing of the kernels launched under this device (an empty graph, a skipped span)
                with torch.cuda.graph(graph, pool=self._pools[span.device], stream=side):
                    out = self._run_span(span, x_in, *static)
            pieces.append(_Piece(span, graph, static_row, x_in, out))
        return pieces

    # -- §4.1 the trunk, one token per sequence ---------------------------------------------------

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step on device tensors: tokens, positions, slots [B]; tables [B, width in blocks].
        With a layer split the streams and the index tensors move to each span's device."""
        out, moved = (), {}
        for span in self.spans:
            if span.device not in moved:
                moved[span.device] = tuple(t.to(span.device) for t in (tokens, positions, slots, tables))
            out = self._run_span(span, None if span.embed else out[0].to(span.device), *moved[span.device])
        return out

    def _run_span(self, span: _Span, X: torch.Tensor | None, tokens: torch.Tensor, positions: torch.Tensor,
                  slots: torch.Tensor, tables: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One span on its device: (X,) after its layers, or (logits, hidden) when it ends with the head."""
        cfg = self.cfg
        with on_device(span.device):  # Triton launches on the current device
            if span.embed:
                X = kernels.embed_streams(self.embed, tokens, cfg.hc_mult)
            # A sub-layer's hc_post shares a launch with the next one's hc_pre (`_mhc`): `done`
            # holds the sub-layer's output (y, y2) and its post, C until then.
            done = None
            for layer in self.layers[span.start:span.end]:
                X, x, post, C = self._mhc(X, done, layer.attn_hc, layer.input_norm)
                if layer.kind == "kda":
                    y = self.kda(layer, x, slots)
                else:
                    y = self.dsa(layer, x, positions, slots, tables)
                X, h, post, C = self._mhc(X, (y, None, post, C), layer.ffn_hc, layer.post_norm)
                if layer.experts is not None:
                    done = (*self.moe(layer, h), post, C)
                else:
                    done = (self.mlp(layer, h), None, post, C)
            if done is not None:
                y, y2, post, C = done
                self._join(X.device)
                X = mhc_kernels.hc_post(X, y, post, C, y2)
            if not span.head:
                return (X,)
            h = kernels.stream_mean_norm(X, self.norm, cfg.rms_norm_eps)
            return linear(h, self.head).float(), h

    def _hc_pre(self, X: torch.Tensor, hc: tuple, norm: torch.Tensor,
                beside: "torch.cuda.Stream | None" = None) -> tuple[torch.Tensor, ...]:
        cfg = self.cfg
        return mhc_kernels.hc_pre(X, *hc, norm, cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters, beside)

    def _mhc(self, X: torch.Tensor, done: tuple | None, hc: tuple, norm: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """§4.2 between two sub-layers: hc_post of the one before (done = (y, y2, post, C); None before
        the first) and hc_pre of the next: (X', x, post', C'). On a GPU the Sinkhorn (post', C') runs on
        the second stream beside the sub-layer (mhc_kernels.hc_pre's `beside`), joined before the next mHC."""
        cfg = self.cfg
        beside = self._beside.get(X.device)
        if done is None:
            return X, *self._hc_pre(X, hc, norm, beside)
        y, y2, post, C = done
        self._join(X.device)  # post and C of the sub-layer before
        return mhc_kernels.hc_post_pre(X, y, post, C, *hc, norm, cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters,
                                   y2=y2, beside=beside)

    def _join(self, device: torch.device) -> None:
        """This device's stream waits for its second stream (the Sinkhorn, the shared expert)."""
        if device in self._beside:
            torch.cuda.current_stream(device).wait_stream(self._beside[device])

    # -- §4.3 KDA ------------------------------------------------------------------------------

    def kda(self, layer: Layer, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        H, d = cfg.linear_num_heads, cfg.linear_head_dim
        q_pre, k_pre, v_pre, f, o_g, b = layer.proj(x)
        a = layer.attn
        inputs = lambda f, **low_rank: kda_kernels.kda_decode_inputs(
            (q_pre, k_pre, v_pre), self.cache.conv_state[layer.row], slots, a["conv"], f, a["A_log"],
            a["dt_bias"], b, cfg.linear_lower_bound, H, d, **low_rank)
        if layer.gates is None:  # f_b and g_b as GEMVs of their own
            (f,), (o_g,) = layer.proj2[0](f), layer.proj2[1](o_g)
            q, k, v, g, beta = inputs(f)
        else:  # applied by the inputs kernel, which then also returns o_g
            q, k, v, g, beta, o_g = inputs(f, f_b=layer.gates[0], o_gate=(o_g, layer.gates[1]))
        o = kda_kernels.kda_recurrent_step(q, k, v, g, beta, self.cache.kda_state[layer.row], slots)
        o = kda_kernels.kda_output_gate(o, o_g, a["o_norm"], cfg.rms_norm_eps, x.dtype)
        return linear(o, layer.o_proj)

    # -- §4.4 DSA ------------------------------------------------------------------------------

    def dsa(self, layer: Layer, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            tables: torch.Tensor) -> torch.Tensor:
        cfg, cache, a, row = self.cfg, self.cache, layer.attn, layer.row
        q_a, kv_a, wk = layer.proj(x)
        gamma = gate_linear(x, a["gate"])
        # q_a_layernorm; this token's cache rows (kv_a_layernorm and k_norm applied there), and its
        # pool's pooled key once the pool is complete.
        q_r = dsa_kernels.dsa_decode_inputs(q_a, kv_a, wk, gamma, a["q_norm"], a["kv_norm"], a["k_norm_w"], a["k_norm_b"],
                                        a["ape"], cache.latent[row], cache.index_k[row], cache.gate[row],
                                        cache.pooled[row], tables, positions, slots, cfg.rms_norm_eps)
        q, q_idx = layer.proj2[0](q_r)
        out = torch.empty(x.shape[0], cfg.num_attention_heads, cfg.v_head_dim, dtype=x.dtype, device=x.device)
        self.sparse_attention(layer, x, q, q_idx, positions, tables, out)
        return linear(out.flatten(1), layer.o_proj)

    def sparse_attention(self, layer: Layer, x: torch.Tensor, q: torch.Tensor, q_idx: torch.Tensor,
                         positions: torch.Tensor, tables: torch.Tensor, out: torch.Tensor,
                         chunk_start: int | None = None, scratch: torch.Tensor | None = None) -> None:
        """§4.4 after the cache rows are written, for B query rows (x their layer input, q and q_idx
        their projections) at `positions` over `tables` [B, width]: the indexer's selection, then the
        absorbed NoPE MLA over it into out [B, H, d_v]. fastprefill.py passes a chunk's rows of one
        sequence (positions chunk_start.., one table, the pool scores' `scratch`): they go to the chunk
        kernels, whose indexer reads each pooled key once for several rows and whose attention gives each
        row all its heads' work instead of splitting rows over head groups and position ranges."""
        cfg, cache, a = self.cfg, self.cache, layer.attn
        kpool, row = cfg.index_kpool, layer.row
        B, H, dn = x.shape[0], cfg.num_attention_heads, cfg.qk_nope_head_dim
        # The indexer scores every pool of the table and takes a fixed top-k (pools past the
        # candidates score -inf and are skipped); a table with no more pools than the top-k selects
        # them all, whatever their scores, so it needs no indexer.
        top = None
        n_top = cfg.index_topk // kpool
        if tables.shape[1] * (cache.block_size // kpool) > n_top:
            w_idx = fp32_linear(x, a["w_idx"])
            q_idx = q_idx.reshape(B, cfg.index_n_heads, cfg.index_head_dim)
            if chunk_start is None:
                score = dsa_kernels.dsa_index_scores(q_idx, w_idx, cache.pooled[row], tables, positions, kpool)
            else:
                score = dsa_kernels.dsa_prefill_index_scores(q_idx, w_idx, cache.pooled[row], tables[0], chunk_start,
                                                             kpool, scratch)
            if score.shape[1] <= dsa_kernels.TOP_POOLS_MAX:
                top = dsa_kernels.top_pools(score, n_top)
            else:
                top = torch.topk(score, n_top, dim=1, sorted=False).indices
        # Absorbed NoPE MLA over the selected positions (model_glm.mla_attention).
        q_hat = dsa_kernels.head_matmul(q.reshape(B, H, dn), a["W_UK"])
        tail, scale = cfg.index_kpool_always_select_tail, math.sqrt(dn)
        if chunk_start is None:
            o = dsa_kernels.dsa_sparse_attention(q_hat, cache.latent[row], tables, positions, top, kpool, tail, scale)
        else:
            o = dsa_kernels.dsa_prefill_attention(q_hat, cache.latent[row], tables[0], chunk_start, top, kpool, tail,
                                              scale)
        # the prefill kernel's o holds ~12 significant bits (fp16 products): two bf16 pieces of it (16 bits)
        dsa_kernels.head_matmul(o, a["W_UV"].transpose(1, 2), out=out, pieces=None if chunk_start is None else 2)

    # -- §4.5 feed-forward ------------------------------------------------------------------------

    def mlp(self, layer: Layer, h: torch.Tensor) -> torch.Tensor:
        gate, up = layer.mlp(h)
        return linear(kernels.swiglu(gate, up, self.cfg.swiglu_limit), layer.down)

    def moe(self, layer: Layer, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(routed [B, D] fp32, shared expert [B, D]): model_glm adds them in fp32 and rounds the sum to
        h's dtype; here the next mHC launch does (`mhc_kernels.hc_post` / `hc_post_pre`'s y2)."""
        return self.beside_shared(layer, h, lambda: self._routed(layer, h))

    def _routed(self, layer: Layer, h: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        ids, route = kernels.moe_route(h, *layer.router, cfg.num_experts_per_tok, cfg.norm_topk_prob,
                                       cfg.routed_scaling_factor)
        ex = layer.experts
        if ex.exl3 is not None:
            gate, up, down, codebook = ex.exl3
            return exl3_kernels.exl3_moe_decode(h, ids, route, gate, up, down, codebook, cfg.swiglu_limit)
        return _dense_experts(h, ids, route, ex.dense, cfg.swiglu_limit)

    def beside_shared(self, layer: Layer, h: torch.Tensor,
                      routed: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(routed(), the shared expert of h). On a GPU the shared expert (three launches reading 25 MB
        of FP8 at full size) runs on the device's second stream, forked after h and joined after
        routed(): the router and the routed experts (their decode kernel ALU-bound, its memory bus
        mostly idle) leave room beside them. The numbers do not change. The fork and join also keep the
        GEMVs' shared scratch (kernels._FP8_ARRIVALS, _split_buffers) to one stream at a time: routed()
        runs none of those GEMVs."""
        beside = self._beside.get(h.device)
        if beside is None:
            return routed(), self.mlp(layer, h)
        main = torch.cuda.current_stream(h.device)
        beside.wait_stream(main)
        with torch.cuda.stream(beside):
            shared = self.mlp(layer, h)
        out = routed()
        main.wait_stream(beside)
        shared.record_stream(main)  # made on the second stream, read and freed on the main one
        return out, shared


def _low_rank_factor(w: Weight, dtype: torch.dtype) -> kda_kernels.LowRank | None:
    """A KDA gate's second low-rank factor (f_b, g_b: [H·d, 128], 1 MB at FP8) as the KDA inputs kernel
    applies it: FP8 block-128 in a 16-bit model or a dense weight in the model's dtype (see
    kda_kernels.LowRank.check), else None (a GEMV of its own). H200, full size, decode B=1: the two
    GEMVs took 9.8 us a layer, the inputs kernel grew by 3.9 us (`.whl/s16_trace.py`)."""
    if isinstance(w, fp8.FP8Linear) and dtype in (torch.bfloat16, torch.float16):
        return kda_kernels.LowRank(w.weight, w.scale_inv)
    if isinstance(w, torch.Tensor) and w.dtype == dtype and w.is_contiguous():
        return kda_kernels.LowRank(w)
    return None


def fp32_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x.float() @ w.T for an fp32 weight (the router's, the indexer's head weights): many bf16 rows
    on the tensor cores (kernels.bf16_fp32_linear: 2.5-3.3x torch at 8192 rows on an H200, within
    2e-6 of Σ|x||w| against torch's 1.4e-7); decode rows in one launch (kernels.fp32_gemv); else
    torch's fp32 GEMM on the CUDA cores."""
    if x.dtype == torch.bfloat16 and x.shape[0] > kernels.FP8_GEMV_ROWS:
        return kernels.bf16_fp32_linear(x, w)
    if _gemv_rows(x):
        return kernels.fp32_gemv(x, w)
    return F.linear(x.float(), w)


def _gemv_rows(x: torch.Tensor) -> bool:
    """Rows that kernels.fp32_gemv takes in one launch: a decode step's (at most FP8_GEMV_ROWS), each of
    at most GEMV_MAX_K."""
    return x.shape[0] <= kernels.FP8_GEMV_ROWS and x.shape[1] <= kernels.GEMV_MAX_K


def gate_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """model_glm.linear for the indexer's pooling gate (128 x 4096, left in the checkpoint's dtype by an
    FP8 core, so it runs apart from the FP8 projections beside it): decode rows in one launch
    (kernels.fp32_gemv, with F.linear's exact products and fp32 sums, in another order), where cuBLAS took
    a split-K GEMV and its reduce; else F.linear."""
    if _gemv_rows(x):
        return kernels.fp32_gemv(x.to(w.dtype), w, w.dtype)
    return linear(x, w)


def _dense_experts(h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                   stacks: tuple[torch.Tensor, torch.Tensor, torch.Tensor], limit: float) -> torch.Tensor:
    """Σ_j w_j · down_e(swiglu(gate_e h, up_e h)) for dense stacked experts, gathering each pair's
    weights (fine for small models; full-size models run EXL3 experts). Returns fp32 [B, D]."""
    gate, up, down = (t[ids] for t in stacks)  # [B, k, out, in]
    hx = h.to(gate.dtype)[:, None, :, None]
    g, u = (gate @ hx).squeeze(-1), (up @ hx).squeeze(-1)
    a = swiglu(g, u, limit)
    y = (down @ a[..., None]).squeeze(-1)  # [B, k, D]
    return (y.float() * w[..., None]).sum(1)

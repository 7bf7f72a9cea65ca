"""The fast prefill: `GLMModel.forward` for prompt chunks (many tokens of one sequence), with the
kernels where the reference spends its time (spec performance.md §5: prefill is compute-bound).

The trunk is model_glm's, in the same order (spec glm53.md §4.1), over the fused projections and
stacked experts that `fastdecode.FastDecoder` prepared; model_glm.forward is this file's twin
(tests/test_fastprefill.py holds them together). What differs:
- mHC (§4.2): `mhc_kernels.hc_pre` / `hc_post`, row-parallel, as in the decode step;
- KDA (§4.3): the short conv, norms, gate and β in one launch (`kda_kernels.kda_chunk_inputs`), then the
  chunked WY form in `kda_kernels.kda_chunk_prefill` (three launches for the whole chunk) instead of a
  Python loop of torch ops per 64 tokens;
- DSA (§4.4): the RMSNorms of q_a and kv_a in one launch each (`kernels.rms_norm`);
  `dsa_kernels.dsa_prefill_index_scores` (each pooled key read once for 4 of the chunk's rows), then
  `dsa_kernels.dsa_prefill_attention` (one program per query row and 32 heads, fp16 products), so each
  query reads its 2051 selected positions instead of a mask over the whole context;
- routed experts (§4.5): `exl3_kernels.exl3_moe_prefill` runs every selected expert of the layer in a few
  launches instead of a Python loop over up to 288 experts; a step of a few rows (a short verify pass)
  takes the decode step's `exl3_moe_decode` instead.
Decode steps go to FastDecoder; speculative verify passes come here too (dflash.target_forward);
MTP drafting and the KDA rollback after a partial accept stay in model_glm.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

import exl3_kernels
import kda_kernels
import kernels
import mhc_kernels
from fastdecode import FastDecoder, Layer, Unsupported, fp32_linear, gate_linear, to_device
from model_glm import (KDA_CHUNK, ForwardOutput, KDASnapshot, SeqChunk, linear, on_device, place_images,
                       write_dsa_rows)

# Up to this many rows in a step, the decode kernel's split-k GEMVs beat the grouped GEMMs, whose few
# tiles leave most SMs idle (H200, full-size K3 experts, uniform routing, session 23: 2.82x at 1 row,
# 1.56x at 4, 1.30x at 8, 0.98x at 16; `.whl/s23_prefill_ab.py`).
MOE_DECODE_ROWS = 8


@dataclass
class ChunkRun:
    """What one chunk's pass through the trunk keeps (see FastPrefill.chunk)."""
    h: torch.Tensor | None = None
    taps: dict[int, torch.Tensor] = field(default_factory=dict)
    kda_inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    snapshots: dict[int, KDASnapshot] = field(default_factory=dict)  # position -> KDA rows (SeqChunk.snapshots)


class FastPrefill:
    """Prompt chunks and verify passes of `decoder.model` against `decoder.cache`: `forward(batch)`
    for chunks of any length >= 1 (each a sequence's next positions, as model_glm.forward takes
    them), one chunk after another; no CUDA graphs (the shapes vary)."""

    DSA_ROWS = 2048  # queries per indexer launch at most
    # The fp32 pool scores of one indexer launch at most: DSA_ROWS rows up to 128K of context, fewer past it.
    # Without a bound they would grow with the context (2 GiB at 1M), outside the cache pool.
    DSA_SCORE_BYTES = 256 << 20

    def __init__(self, decoder: FastDecoder):
        self.decoder, self.model, self.cache, self.cfg = decoder, decoder.model, decoder.cache, decoder.cfg
        self.scores: dict[torch.device, torch.Tensor] = {}  # the indexer's score scratch, a flat buffer a device
        bs = self.cache.block_size
        # kda_chunk_prefill chunks from its first row; model_glm cuts at multiples of KDA_CHUNK and of
        # the block size, which is one stride when one divides the other.
        self.kda_chunk = min(KDA_CHUNK, bs)
        if self.kda_chunk not in (16, 32, 64) or max(KDA_CHUNK, bs) % self.kda_chunk:
            raise Unsupported(f"block size {bs}: the KDA prefill kernel needs a block size that is a multiple "
                              f"of {KDA_CHUNK} or one of 16 and 32")
        if self.cfg.linear_lower_bound <= kda_kernels.GATE_FLOOR:
            raise Unsupported(f"gate_lower_bound {self.cfg.linear_lower_bound}: the KDA prefill kernel needs "
                              f"gates above {kda_kernels.GATE_FLOOR} (kda_kernels.GATE_FLOOR)")

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits of final-norm rows h, through the decode step's prepared lm_head."""
        with on_device(h.device):
            return linear(h, self.decoder.head).float()

    def reserve(self, context: int) -> None:
        """Allocates now, on each device with a DSA layer, the indexer's score scratch that chunks ending at
        up to `context` use, so that it is taken before the engine measures a chunk's memory and sizes the
        cache (Engine._chunk_peak), and a long prompt later needs no more."""
        for d in {self.model.placement.device(L) for L in self.cfg.dsa_layers}:
            self._score_scratch(d, context)

    def _score_scratch(self, device: torch.device, end: int) -> torch.Tensor:
        """The device's score scratch, grown (up to DSA_SCORE_BYTES) if a chunk ending at `end` needs more."""
        pools = -(-end // self.cache.block_size) * (self.cache.block_size // self.cfg.index_kpool)
        want = min(self.DSA_SCORE_BYTES // 4, self.DSA_ROWS * pools)
        if device not in self.scores or self.scores[device].numel() < want:
            self.scores[device] = torch.empty(want, dtype=torch.float32, device=device)
        return self.scores[device]

    def forward(self, batch: list[SeqChunk], *, logit_rows: list[int] | None = None, taps: tuple[int, ...] = (),
                kda_input_rows: list[int] = ()) -> ForwardOutput:
        """GLMModel.forward's contract (without all_logits): logits of each chunk's last row, or of
        `logit_rows` of the flattened batch (`hidden` then holds every row); `taps` and the KDA
        layers' inputs at `kda_input_rows` for speculative verification (dflash.py)."""
        cfg = self.cfg
        spans = self.model._check_batch(batch, self.cache)
        self.model._check_taps(taps)
        every_row = logit_rows is not None
        runs = [self.chunk(c, every_row, taps, [r - a for r in kda_input_rows if a <= r < b])
                for c, (a, b) in zip(batch, spans)]
        h = torch.cat([r.h for r in runs])
        logits = self.head(h[to_device(logit_rows, h.device)] if every_row else h)
        tapped = torch.cat([torch.cat([r.taps[L] for r in runs]) for L in taps], dim=-1) if taps else None
        kda_inputs = {}
        if len(kda_input_rows):  # the chunks kept their recorded rows in row order; put them in the asked order
            kept = sorted(kda_input_rows)
            order = to_device([kept.index(r) for r in kda_input_rows], h.device)
            kda_inputs = {L: torch.cat([r.kda_inputs[L] for r in runs if L in r.kda_inputs])[order]
                          for L in cfg.kda_layers}
        snapshots = {(i, p): snap for i, r in enumerate(runs) for p, snap in r.snapshots.items()}
        return ForwardOutput(logits, h, tapped, kda_inputs, snapshots)

    # -- §4.1 the trunk, one chunk ------------------------------------------------------------

    def chunk(self, c: SeqChunk, every_row: bool = False, taps: tuple[int, ...] = (),
              record: list[int] = ()) -> "ChunkRun":
        """One chunk through the trunk: the final-norm hidden of its last row (every row), the
        taps of its rows and the KDA layers' inputs at the chunk rows `record` (in row order)."""
        d, cfg = self.decoder, self.cfg
        first = d.embed.device
        # the tokens and the block table on the device once, from pinned memory: a copy from pageable
        # memory waits for the GPU, and each DSA layer read the table (H200, 8K chunk: ~16 ms of the GPU
        # idle behind the host)
        tokens = to_device(c.tokens, first)
        c = replace(c, block_table=to_device(c.block_table, first))
        run = ChunkRun(snapshots={p: KDASnapshot.empty(len(cfg.kda_layers)) for p in c.snapshots})
        recorded = to_device(sorted(record), first) if record else None
        with on_device(first):
            X = place_images(kernels.embed_streams(d.embed, tokens, cfg.hc_mult), [c], [(0, len(tokens))])
        for L, layer in enumerate(d.layers):
            X = X.to(layer.device)  # a layer split: each layer on its device (FastDecoder.run)
            with on_device(layer.device):
                x, post, C = d._hc_pre(X, layer.attn_hc, layer.input_norm)
                if layer.kind == "kda":
                    if record:  # kept on the first device, as model_glm keeps them
                        run.kda_inputs[L] = x[recorded.to(x.device)].to(first)
                    y = self.kda(layer, x, c, run.snapshots)
                else:
                    y = self.dsa(layer, x, c)
                X = mhc_kernels.hc_post(X, y, post, C)
                h, post, C = d._hc_pre(X, layer.ffn_hc, layer.post_norm)
                y, y2 = self.moe(L, layer, h) if layer.experts is not None else (d.mlp(layer, h), None)
                X = mhc_kernels.hc_post(X, y, post, C, y2)
            if L in taps:  # DFlash2 §2.4: mean of the streams after the layer, fp32 in stream order
                run.taps[L] = (X.float().sum(1) * (1 / cfg.hc_mult)).to(X.dtype).to(first)
        X = X.to(first)
        with on_device(first):
            run.h = kernels.stream_mean_norm(X if every_row else X[-1:], d.norm, cfg.rms_norm_eps)
        return run

    # -- §4.3 KDA ------------------------------------------------------------------------------

    def kda(self, layer: Layer, x: torch.Tensor, c: SeqChunk, snapshots: dict[int, KDASnapshot]) -> torch.Tensor:
        """§4.3 for one chunk; the layer's rows at the chunk's snapshot positions go into `snapshots`."""
        cfg, cache, a = self.cfg, self.cache, layer.attn
        H, d, K = cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel
        n, row, slot = x.shape[0], layer.row, c.slot
        q_pre, k_pre, v_pre, f_a, g_a, b = layer.proj(x)
        (f,), (o_g,) = layer.proj2[0](f_a), layer.proj2[1](g_a)
        if c.start == 0:
            cache.conv_state[row, slot] = 0
            cache.kda_state[row, slot] = 0
        history = cache.conv_state[row, slot]  # [3, K-1, H*d]
        q, k, v, g, beta = kda_kernels.kda_chunk_inputs((q_pre, k_pre, v_pre), history, a["conv"], f, a["A_log"],
                                                        a["dt_bias"], b, cfg.linear_lower_bound, H, d)

        def window(r: int) -> torch.Tensor:
            # The conv window before chunk row r: the last K-1 rows of the history then the chunk's first
            # r (only those: a cat of all r rows copied ~400 MB a layer at 8K). history is a view of the
            # slot, so every window is taken before the slot's is written.
            return torch.stack([torch.cat([history[j], t[max(r - (K - 1), 0):r].to(history.dtype)])[-(K - 1):]
                                for j, t in enumerate((q_pre, k_pre, v_pre))])

        for p, snap in snapshots.items():
            snap.conv_state[row] = window(p - c.start)
        cache.conv_state[row, slot] = window(n)
        o, S, at = self.recurrence(q, k, v, g, beta, cache.kda_state[row, slot], c.start,
                                   [p - c.start for p in sorted(snapshots)])
        for p, state in zip(sorted(snapshots), at):
            snapshots[p].kda_state[row] = state
        cache.kda_state[row, slot] = S
        return linear(kda_kernels.kda_output_gate(o, o_g, a["o_norm"], cfg.rms_norm_eps, x.dtype), layer.o_proj)

    def recurrence(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, S: torch.Tensor, start: int, cuts: list[int] = ()
                   ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """§4.3.6-7 from state S for positions start.., chunked at the same absolute positions as
        model_glm (a head piece up to the next chunk boundary first). Also returns the states after
        the rows `cuts` (ascending, each at a chunk boundary, where the kernel keeps the state anyway),
        for the chunk's snapshots: they cut no piece, so they cost no torch.cat of the pieces' outputs
        (a copy of o: 125 us a KDA layer for an 8K chunk on the H200, and o's size again in memory)."""
        n = q.shape[0]
        head = min((-start) % self.kda_chunk, n)
        ends = sorted({head, n} - {0})
        outs, at = [], []
        for r0, r1 in zip([0] + ends[:-1], ends):
            after = [c - r0 for c in cuts if r0 < c <= r1]
            o, S, states = kda_kernels.kda_chunk_prefill(q[r0:r1], k[r0:r1], v[r0:r1], g[r0:r1], beta[r0:r1], S,
                                                         chunk=self.kda_chunk, after=after)
            outs.append(o)
            at += list(states) if after else []
        return outs[0] if len(outs) == 1 else torch.cat(outs), S, at

    # -- §4.4 DSA ------------------------------------------------------------------------------

    def dsa(self, layer: Layer, x: torch.Tensor, c: SeqChunk) -> torch.Tensor:
        """The chunk's cache rows first (model_glm.write_dsa_rows), then every row as a query over its
        own selection: the decode step's `sparse_attention`, the chunk's rows standing in for the
        batch (one block table, their own positions; the chunk kernel), so the work grows with the
        top-k (2051 positions at full size), not with the context."""
        cfg, cache, a = self.cfg, self.cache, layer.attn
        eps, n = cfg.rms_norm_eps, x.shape[0]
        q_a, kv_a, wk = layer.proj(x)
        gamma = gate_linear(x, a["gate"])
        q, q_idx = layer.proj2[0](kernels.rms_norm(q_a, a["q_norm"], eps))
        k_idx = F.layer_norm(wk, (cfg.index_head_dim,), a["k_norm_w"], a["k_norm_b"], eps=1e-6)
        write_dsa_rows(cache, layer.row, c, kernels.rms_norm(kv_a, a["kv_norm"], eps), k_idx, gamma, a["ape"],
                       cfg.index_kpool)
        table = c.block_table[:-(-(c.start + n) // cache.block_size)].to(x.device)
        out = torch.empty(n, cfg.num_attention_heads, cfg.v_head_dim, dtype=x.dtype, device=x.device)
        scratch = self._score_scratch(x.device, c.start + n)
        rows = min(self.DSA_ROWS, scratch.numel() // (table.shape[0] * (cache.block_size // cfg.index_kpool)))
        for r0 in range(0, n, rows):
            r1 = min(r0 + rows, n)
            # each piece's table reaches only its last row's block: the indexer then scores (and top-k
            # sorts) no pool past the piece, and a piece with no more pools than the top-k needs no indexer
            width = -(-(c.start + r1) // cache.block_size)
            positions = torch.arange(c.start + r0, c.start + r1, device=x.device)
            self.decoder.sparse_attention(layer, x[r0:r1], q[r0:r1], q_idx[r0:r1], positions,
                                          table[:width].expand(r1 - r0, width), out[r0:r1], chunk_start=c.start + r0,
                                          scratch=scratch)
        return linear(out.flatten(1), layer.o_proj)

    # -- §4.5 routed experts ------------------------------------------------------------------------

    def moe(self, L: int, layer: Layer, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(routed fp32, shared expert), summed by `mhc_kernels.hc_post`; on a GPU the shared expert runs
        beside the routed ones (FastDecoder.beside_shared)."""
        return self.decoder.beside_shared(layer, h, lambda: self._routed(L, layer, h))

    def _routed(self, L: int, layer: Layer, h: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        gate_w, bias = layer.router
        # the decode step's top-k kernel (ties to the lower expert): one launch where model_glm.route_logits
        # takes ten (~0.2 ms a layer for an 8K chunk on the H200)
        ids, w = kernels.route_topk(fp32_linear(h, gate_w), bias, cfg.num_experts_per_tok, cfg.norm_topk_prob,
                                    cfg.routed_scaling_factor)
        ex = layer.experts
        if ex.exl3 is not None:
            gate, up, down, codebook = ex.exl3
            x = h if h.dtype != torch.float32 else h.half()  # the kernel's GEMMs take fp16 activations
            moe = exl3_kernels.exl3_moe_decode if h.shape[0] <= MOE_DECODE_ROWS else exl3_kernels.exl3_moe_prefill
            return moe(x, ids, w, gate, up, down, codebook, cfg.swiglu_limit)
        return self.model.routed_experts(f"layers.{L}.mlp.", h, ids, w)

"""Triton kernels, each with a slow pure-torch twin that the tests hold it to. Four families:

EXL3 linears (spec exl3.md §0-§4). Twins in exl3.py: `exl3_decode` is `exl3.unpack`, `exl3_gemv`
is `x @ exl3.dequantize(...)`. Decoding one weight, for a tile whose packed words are read as
little-endian uint32:
  position t -> its 16-bit state = ring bits [E(t) - 16, E(t)), E(t) = ((t + 1) * K2) >> 1 with
  K2 = 2K (also for the half rates 1.5 / 2.5 / 3.5), the ring being 128 * K2 bits, MSB first;
  state -> fp16 value through the codebook (one round-to-nearest-even);
  position t <-> tile row/column by the mma B-fragment layout (§3).
exl3_gemv never materializes W: a small kernel rotates the input ((x ⊙ suh) · H128, fp32), then
every thread element of the main kernel is one mma lane of one 16x16 tile, whose 8 positions
come from 2-4 ring words loaded once (every bit offset a compile-time constant); the decoded
tiles feed tl.dot as they are, as its A operand (y^T = Ŵ^T x^T; the activations are B: fp16 hi and
lo parts of each fp32 row, N padded to 16), so the ALU only decodes. k is split over programs;
partial sums meet in a zeroed fp32 buffer and the last program to arrive at a 128-column block
applies H128 and svh (stream-K style fixup, one launch).
exl3_moe_decode runs the same loop for all selected experts of a MoE layer at once (expert ids
read on the device), with SwiGLU and the routed sum in the block fixups.
exl3_moe_prefill is the MoE layer for many rows: pairs sorted by expert, grouped GEMMs that decode
each trellis tile in registers once per tile of up to 128 rows of that expert.

KDA recurrence (spec glm53.md §4.3.6-7). Twins in model_glm.py: `kda_recurrent_step` and
`kda_chunk_prefill` compute what `model_glm.kda_recurrent` computes token by token.

FP8 block-128 linears (fp8.py holds the format and the twin): `fp8_gemv` for 1..16 rows,
dequantizing in registers (fp32 FMAs up to FP8_FMA_ROWS = 3 rows, tensor cores above); `fp8_dequantize` (twin
`fp8.dequantize_fp8_block`) for more rows, whose product then runs in cuBLAS. `bf16_fp32_linear`: x · wᵀ of bf16 rows and an fp32 weight, near fp32
accuracy on bf16 tensor cores (the prefill's router and indexer head weights; twin x.float() @ w.T).

The decode step's glue (fastdecode.py), twins in model_glm.py: `hc_pre` / `hc_post` (mHC, §4.2:
the 24 mixing dot products, Sinkhorn, the collapse and the sub-layer's RMSNorm; the stream update),
`kda_decode_inputs` (short conv, SiLU, L2 norms, gate, β for one token, §4.3.2-5; the prefill's
`kda_chunk_inputs` for the rows of one sequence's chunk) and `kda_output_gate` (§4.3.8's norm and gate);
`swiglu` (§4.5's clamped SwiGLU: `swiglu`);
`moe_route` (the router GEMV, sigmoid, top-k and weights, §4.5: `route`);
`dsa_decode_inputs` (q_a / kv_a layernorms, indexer k_norm, the token's cache rows and pooled key, §4.4:
`rms_norm`, `pool_keys` and GLMModel.dsa's writes), `dsa_index_scores` (the indexer's pool scores:
`select_tokens` before its top-k) and `dsa_sparse_attention` (absorbed MLA over the selected positions,
gathered from the paged cache: `mla_attention` between W_UK and W_UV); the prefill's
`dsa_prefill_attention` is the latter for the query rows of one sequence's chunk (fastprefill.py).

This file imports neither exl3.py nor model_glm.py (they sit above it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

CODEBOOKS = ("3inst", "mcg", "mul1")


@triton.jit
def _stream_position(r, c):
    # Inverse of spec §3: tile row r, column c -> stream position t = 8 * lane + j.
    lane = 4 * (c & 7) + ((r & 7) >> 1)
    j = (r & 1) + 2 * (r >> 3) + 4 * (c >> 3)
    return 8 * lane + j


@triton.jit
def _window(t, K2: tl.constexpr):
    # First ring bit of position t's state (word index, bit offset), wrapped onto the ring.
    RING: tl.constexpr = 128 * K2
    start = (((t + 1) * K2) >> 1) + (RING - 16)
    start = tl.where(start >= RING, start - RING, start)
    return start >> 5, start & 31


@triton.jit
def _state(words_ptr, tile_word0, w, o, K2: tl.constexpr):
    # 16 bits starting at bit o of word w, continuing into the next word of the same tile (tail-biting).
    NW: tl.constexpr = 4 * K2
    w_next = tl.where(w == NW - 1, 0, w + 1)
    hi = tl.load(words_ptr + tile_word0 + w).to(tl.uint32, bitcast=True)
    lo = tl.load(words_ptr + tile_word0 + w_next).to(tl.uint32, bitcast=True)
    o = o.to(tl.uint32)
    # (lo >> 1) >> (31 - o) is lo >> (32 - o) without a 32-bit shift when o == 0.
    window = (hi << o) | ((lo >> 1) >> (31 - o))
    return window >> 16


@triton.jit
def _codebook(state, CB: tl.constexpr, zero=0):
    # spec §2.3; CB 0 = 3INST, 1 = MCG, 2 = MUL1. All products are mod 2^32 (uint32).
    if CB == 2:
        x = state * 0x83DCD12D
        s = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)
        # Exact in fp32 (s * 1773 * 2^-18 - 221 * 2^-6 fits 24 bits), then the single RNE to fp16.
        value = (s.to(tl.float32) * 0.00676727294921875 - 3.453125).to(tl.float16)
    else:
        if CB == 0:
            x = state * 89226354 + 64248484
        else:
            x = state * 0xCBAC1FED
        x = (x & 0x8FFF8FFF) ^ (zero | 0x3B603B60)
        lo = (x & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
        hi = (x >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
        value = lo + hi  # fp16 add: the exact sum rounded once (both halves lie in ±[0.125, 2))
    return value


@triton.jit
def _decode_kernel(words_ptr, out_ptr, tiles_k, tiles_n,
                   K2: tl.constexpr, CB: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    NW: tl.constexpr = 4 * K2
    tile_row0 = tl.program_id(0) * (BR // 16)
    tile_col0 = tl.program_id(1) * (BC // 16)
    i = tl.arange(0, BR)[:, None]
    j = tl.arange(0, BC)[None, :]
    inside = (tile_row0 + i // 16 < tiles_k) & (tile_col0 + j // 16 < tiles_n)
    w, o = _window(_stream_position(i % 16, j % 16), K2)
    tile = tl.where(inside, (tile_row0 + i // 16) * tiles_n + tile_col0 + j // 16, 0)
    value = _codebook(_state(words_ptr, tile.to(tl.int64) * NW, w, o, K2), CB)
    rows = (tile_row0 * 16 + i).to(tl.int64)
    tl.store(out_ptr + rows * (tiles_n * 16) + tile_col0 * 16 + j, value, mask=inside)


@triton.jit
def _times_hadamard(z, ROWS: tl.constexpr):
    # z [ROWS, 128] times sqrt(128) * H128 (Sylvester order, spec §4): 7 butterfly stages
    # (a, b) -> (a + b, a - b) over index bit s, in fp32.
    for s in tl.static_range(7):
        z = tl.reshape(z, [ROWS, 64 >> s, 2, 1 << s])
        a, b = tl.split(tl.permute(z, (0, 1, 3, 2)))
        z = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
    return tl.reshape(z, [ROWS, 128])


@triton.jit
def _rotate_input_kernel(x_ptr, suh_ptr, xh_ptr, m, k):
    # xh = (x ⊙ suh) · H128 for one 128-block of k, in fp32, stored in the gemv's row order:
    # inside every 16-row tile, row r = 8 * j1 + 2 * ll + j0 goes to slot 4 * ll + 2 * j1 + j0, so
    # that the rows one mma lane needs (spec §3) are 4 neighbours.
    rows = tl.arange(0, 16)[:, None]
    i = tl.arange(0, 128)
    x = tl.load(x_ptr + rows * k + tl.program_id(0) * 128 + i[None, :], mask=rows < m, other=0.0)
    suh = tl.load(suh_ptr + tl.program_id(0) * 128 + i)
    xh = _times_hadamard(x.to(tl.float32) * suh.to(tl.float32)[None, :], 16) * 0.08838834764831845  # /sqrt(128)
    r = i % 16
    slot = i - r + 4 * ((r >> 1) & 3) + 2 * (r >> 3) + (r & 1)
    tl.store(xh_ptr + rows * k + tl.program_id(0) * 128 + slot[None, :], xh, mask=rows < m)


@triton.jit
def _pick(v0, v1, v2, v3, q: tl.constexpr):
    if q == 0:
        v = v0
    elif q == 1:
        v = v1
    elif q == 2:
        v = v2
    else:
        v = v3
    return v


@triton.jit
def _funnel(hi, lo, o):
    # The 32 bits from bit o (0..31, MSB first) of the 64-bit stream hi lo.
    return ((((hi.to(tl.uint64) << 32) | lo.to(tl.uint64)) << o.to(tl.uint64)) >> 32).to(tl.uint32)


@triton.jit
def _bits16(r0, r1, r2, r3, p: tl.constexpr):
    # The 16 bits from bit p (compile-time, MSB first) of the stream r0 r1 r2 r3, as a state.
    hi = _pick(r0, r1, r2, r3, p // 32)
    s: tl.constexpr = p % 32
    if s == 0:
        state = hi >> 16
    elif s <= 16:
        state = (hi >> (16 - s)) & 0xFFFF
    else:
        state = ((hi << s) | (_pick(r0, r1, r2, r3, p // 32 + 1) >> (32 - s))) >> 16
    return state


@triton.jit
def _load_step(p0, p1, p2, p3, delta, x_ptrs, x_delta, x_ok, NL: tl.constexpr):
    # One step's NL ring words of every lane of RT x CT tiles (word pointers p0..p3 plus delta), and
    # its activations (x_ptrs plus x_delta). The callers form the pointers once, outside their loop,
    # and pass the step as a scalar delta: each load's address is then one IMAD.WIDE on sm_90 (a
    # per-step base plus a per-lane offset took a 64-bit add, two instructions, per load).
    w0 = tl.load(p0 + delta).to(tl.uint32, bitcast=True)
    w1 = w0
    w2 = w0
    w3 = w0
    if NL > 1:
        w1 = tl.load(p1 + delta).to(tl.uint32, bitcast=True)
    if NL > 2:
        w2 = tl.load(p2 + delta).to(tl.uint32, bitcast=True)
    if NL > 3:
        w3 = tl.load(p3 + delta).to(tl.uint32, bitcast=True)
    x = tl.load(x_ptrs + x_delta, mask=x_ok, other=0.0)
    return w0, w1, w2, w3, x


@triton.jit
def _lane_words(tiles_n, pid_n, K2: tl.constexpr, RT: tl.constexpr, CT: tl.constexpr):
    # For each mma lane L of each of the RT x CT tiles of a step (column block pid_n of tiles_n
    # tiles): the bit offset o of b_L, the start of its first state, in its word, and the offsets of
    # the 4 ring words from that one on (the ring wraps) relative to the step's first word.
    NW: tl.constexpr = 4 * K2
    RING: tl.constexpr = 128 * K2
    lane = tl.arange(0, 32)[:, None, None]
    b = (((8 * lane + 1) * K2) >> 1) + RING - 16
    b = tl.where(b >= RING, b - RING, b)
    first = b >> 5
    tile_word0 = (tl.arange(0, RT)[None, None, :] * tiles_n + pid_n * CT + tl.arange(0, CT)[None, :, None]) * NW
    return ((b & 31).to(tl.uint32), tile_word0 + first, tile_word0 + (first + 1) % NW,
            tile_word0 + (first + 2) % NW, tile_word0 + (first + 3) % NW)


@triton.jit
def _lane_state(w0, w1, r0, r1, r2, r3, o, p: tl.constexpr, DIRECT: tl.constexpr):
    # The state p bits after b_L: a 64-bit shift of the lane's first two words when DIRECT, else a
    # constant shift of the realigned words.
    if DIRECT:
        state = _funnel(w0, w1, o + p) >> 16
    else:
        state = _bits16(r0, r1, r2, r3, p)
    return state


@triton.jit
def _decoded_tiles(w0, w1, w2, w3, o, zero, K2: tl.constexpr, CB: tl.constexpr, RT: tl.constexpr,
                   CT: tl.constexpr, STATIC: tl.constexpr, BASE: tl.constexpr, NR: tl.constexpr,
                   DIRECT: tl.constexpr):
    # Ŵ^T [CT * 16, RT * 16] fp16 of one step from every lane's ring words, in the mma A-operand
    # layout (rows: output columns, columns: k, both natural).
    r0 = w0
    r1 = w1
    r2 = w2
    r3 = w3
    if not STATIC and not DIRECT:
        r0 = _funnel(w0, w1, o)
        r1 = r0
        r2 = r0
        if NR > 1:
            r1 = _funnel(w1, w2, o)
        if NR > 2:
            r2 = _funnel(w2, w3, o)
        r3 = r0
    v0 = _codebook(_lane_state(w0, w1, r0, r1, r2, r3, o, BASE, DIRECT), CB, zero)
    v1 = _codebook(_lane_state(w0, w1, r0, r1, r2, r3, o, BASE + ((2 * K2) >> 1) - (K2 >> 1), DIRECT), CB, zero)
    v2 = _codebook(_lane_state(w0, w1, r0, r1, r2, r3, o, BASE + ((3 * K2) >> 1) - (K2 >> 1), DIRECT), CB, zero)
    v3 = _codebook(_lane_state(w0, w1, r0, r1, r2, r3, o, BASE + ((4 * K2) >> 1) - (K2 >> 1), DIRECT), CB, zero)
    v4 = _codebook(_lane_state(w0, w1, r0, r1, r2, r3, o, BASE + ((5 * K2) >> 1) - (K2 >> 1), DIRECT), CB, zero)
    v5 = _codebook(_lane_state(w0, w1, r0, r1, r2, r3, o, BASE + ((6 * K2) >> 1) - (K2 >> 1), DIRECT), CB, zero)
    v6 = _codebook(_lane_state(w0, w1, r0, r1, r2, r3, o, BASE + ((7 * K2) >> 1) - (K2 >> 1), DIRECT), CB, zero)
    v7 = _codebook(_lane_state(w0, w1, r0, r1, r2, r3, o, BASE + ((8 * K2) >> 1) - (K2 >> 1), DIRECT), CB, zero)
    # w[L, ct, rt, j0, j1, j2] = v_(4 j2 + 2 j1 + j0): Ŵ row 8 j1 + 2 (L % 4) + j0, column 8 j2 + L / 4.
    w = tl.join(tl.join(tl.join(v0, v1), tl.join(v2, v3)), tl.join(tl.join(v4, v5), tl.join(v6, v7)))
    w = tl.reshape(w, [8, 4, CT, RT, 2, 2, 2])                                  # c, g, ct, rt, j0, j1, j2
    return tl.reshape(tl.permute(w, (2, 6, 0, 3, 5, 1, 4)), [CT * 16, RT * 16])  # Ŵ^T: ct j2 c | rt j1 g j0


@triton.jit
def _step_dot(w0, w1, w2, w3, x, o, zero, acc, K2: tl.constexpr, CB: tl.constexpr, MP: tl.constexpr,
              RT: tl.constexpr, CT: tl.constexpr, STATIC: tl.constexpr, BASE: tl.constexpr, NR: tl.constexpr,
              DIRECT: tl.constexpr):
    # acc [CT * 16, 16] += Ŵ^T · B for one step of RT x CT tiles: y^T = Ŵ^T x^T, so that the decoded
    # weights are the mma A operand, whose fragment is exactly a lane's 8 states (spec §3: rows
    # 2(L%4) + {0, 1, 8, 9} of Ŵ, columns L/4 and L/4 + 8) and never leave the registers (on sm_90
    # triton 3.6 makes this a wgmma with A in registers). B holds each fp32 activation row as fp16
    # hi (column i) and lo * 2^11 (column MP + i) parts, so the fp16 products summed in fp32 lose
    # nothing that matters: the 2^11 keeps lo out of fp16's subnormals for |x| >= 2^-14 (without it
    # a MoE layer with ~1e-4 activations was 6.5e-3 off on the H200); |x| must stay below 65504, as
    # in exllamav3's fp16 path.
    # Columns from 2 MP on are zero.
    w = _decoded_tiles(w0, w1, w2, w3, o, zero, K2, CB, RT, CT, STATIC, BASE, NR, DIRECT)
    hi = x.to(tl.float16)
    b = tl.where(tl.arange(0, 16)[None, :] < MP, hi, ((x - hi.to(tl.float32)) * 2048.0).to(tl.float16))
    return tl.dot(w, b, acc)


@triton.jit
def _gemv_products(xh_ptr, words_ptr, m, k, n, steps, pid_n, pid_k,
                   K2: tl.constexpr, CB: tl.constexpr, MP: tl.constexpr, RT: tl.constexpr, CT: tl.constexpr):
    # Program (pid_n, pid_k): output tiles [CT * pid_n, CT * (pid_n + 1)), `steps` steps of RT row
    # tiles from row tile RT * steps * pid_k, MP <= 8 rows. One thread element = one mma lane L of
    # one tile, which owns stream positions 8L .. 8L + 7 (spec §3); the decoded tiles go straight
    # into tl.dot (see _step_dot), so the multiply-adds leave the ALU. The lane axis comes first in
    # the decode tensors: that is the order in which triton lays them out like the mma operand.
    # Returns this program's partial sums z [MP, CT * 16]; the callers add them up across programs
    # and let the last program of each 128-column block apply H128 and svh.
    NW: tl.constexpr = 4 * K2
    # Position 8L + j of a tile ends at ring bit 4 L K2 + (((j + 1) K2) >> 1), so relative to the
    # start b_L of lane L's first state, state j starts at the compile-time bit
    # ((j + 1) K2 >> 1) - (K2 >> 1), and all 8 end SPAN bits after b_L. Only b_L's offset in its word
    # depends on the lane, unless 4 K2 is a multiple of 32 (STATIC: then it is BASE for every lane).
    # Otherwise that offset o = (4 L K2 + (K2 >> 1) + 16) mod 32 steps by G = gcd(4 K2, 32) from lane
    # to lane, so it is at most O_MAX. When every state of every lane then lies in the lane's first
    # two words (DIRECT: K <= 3), each state is one 64-bit shift of those by o plus a constant (on
    # sm_90 one SHF.L.U64.HI and the shift down: K3 467 loop instructions against 476 with the
    # realignment); other rates shift the lane's words once per step so that they start at b_L (NR
    # realigned words from NL loaded ones), and every state is then a shift by a constant.
    SPAN: tl.constexpr = ((8 * K2) >> 1) - (K2 >> 1) + 16
    STATIC: tl.constexpr = (4 * K2) % 32 == 0
    BASE: tl.constexpr = ((K2 >> 1) + 16) % 32 if STATIC else 0
    NR: tl.constexpr = (SPAN + 31) // 32
    G: tl.constexpr = 32 if K2 % 8 == 0 else (16 if K2 % 4 == 0 else (8 if K2 % 2 == 0 else 4))
    O_MAX: tl.constexpr = (((K2 >> 1) + 16) % G) + 32 - G
    DIRECT: tl.constexpr = not STATIC and SPAN + O_MAX <= 64
    NL: tl.constexpr = (BASE + SPAN + 31) // 32 if STATIC else (2 if DIRECT else NR + 1)
    tiles_n = n // 16
    # A zero the compiler cannot see through: with it, the codebook's two LOP3 constants are one
    # immediate and one loop-invariant register, instead of a constant re-materialized per weight.
    zero = (k >> 31).to(tl.uint32)
    o, off0, off1, off2, off3 = _lane_words(tiles_n, pid_n, K2, RT, CT)
    # B's columns i and MP + i both read activation row i; tile row r sits at the rotation's slot for it.
    b_col = tl.arange(0, 16)[None, :]
    x_row = tl.where(b_col < MP, b_col, b_col - MP)
    x_ok = (x_row < m) & (b_col < 2 * MP)
    r = tl.arange(0, RT * 16)[:, None]
    t = r % 16
    x_off = x_row * k + r - t + 4 * ((t >> 1) & 3) + 2 * (t >> 3) + (t & 1)

    acc = tl.zeros([CT * 16, 16], tl.float32)
    tile0 = pid_k * steps * RT
    words_ptr += tile0 * tiles_n * NW
    xh_ptr += tile0 * 16
    step_words = RT * tiles_n * NW
    # Each step prefetches the next step's words and activations (the loop is otherwise
    # latency-bound); the last step re-reads its own instead of reading past the split. Two steps
    # per iteration, so that the prefetched registers need no copying.
    p0, p1, p2, p3, xp = words_ptr + off0, words_ptr + off1, words_ptr + off2, words_ptr + off3, xh_ptr + x_off
    w0, w1, w2, w3, x = _load_step(p0, p1, p2, p3, 0, xp, 0, x_ok, NL)
    for step_index in range(0, steps, 2):
        ahead = tl.minimum(step_index + 1, steps - 1)
        n0, n1, n2, n3, nx = _load_step(p0, p1, p2, p3, ahead * step_words, xp, ahead * (RT * 16), x_ok, NL)
        if 2 * MP < 16:
            # x is already zero outside x_ok; saying so again after the loop-carried copy lets the
            # compiler drop the B elements that are zero by their place (columns from 2 MP on), whose
            # conversions otherwise ran every other step (sm_90 MoE loop, K3: 467 -> 443 instructions).
            x = tl.where(x_ok, x, 0.0)
        acc = _step_dot(w0, w1, w2, w3, x, o, zero, acc, K2, CB, MP, RT, CT, STATIC, BASE, NR, DIRECT)
        ahead = tl.minimum(step_index + 2, steps - 1)
        w0, w1, w2, w3, x = _load_step(p0, p1, p2, p3, ahead * step_words, xp, ahead * (RT * 16), x_ok, NL)
        if step_index + 1 < steps:
            acc = _step_dot(n0, n1, n2, n3, nx, o, zero, acc, K2, CB, MP, RT, CT, STATIC, BASE, NR, DIRECT)

    # Columns i and MP + i (hi and lo * 2^11 parts) make row i; columns from 2 MP on are zero.
    part = tl.where(tl.arange(0, 2)[None, :, None, None] == 0, 1.0, 1.0 / 2048.0)
    z = tl.sum(tl.sum(tl.reshape(tl.trans(acc), [16 // (2 * MP), 2, MP, CT * 16]) * part, axis=1), axis=0)
    return z


@triton.jit
def _gemv_kernel(xh_ptr, svh_ptr, words_ptr, partial_ptr, arrivals_ptr, y_ptr,
                 m, k, n, steps, arrivals,
                 K2: tl.constexpr, CB: tl.constexpr, MP: tl.constexpr, RT: tl.constexpr, CT: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    z = _gemv_products(xh_ptr, words_ptr, m, k, n, steps, pid_n, pid_k, K2, CB, MP, RT, CT)
    cols = pid_n * CT * 16 + tl.arange(0, CT * 16)[None, :]
    tl.atomic_add(partial_ptr + tl.arange(0, MP)[:, None] * n + cols, z,
                  mask=tl.arange(0, MP)[:, None] < m, sem="relaxed")
    tl.debug_barrier()
    block = pid_n * CT * 16 // 128
    arrived = tl.atomic_add(arrivals_ptr + block, 1, sem="acq_rel")
    if arrived == arrivals - 1:
        _gemv_output(partial_ptr, arrivals_ptr, svh_ptr, y_ptr, m, n, block)


@triton.jit
def _gemv_output(partial_ptr, arrivals_ptr, svh_ptr, y_ptr, m, n, block):
    # y[:, block] = (z · H128) ⊙ svh in fp32, rounded once to fp16; z is read at L2 and zeroed.
    rows = tl.arange(0, 16)[:, None]
    i = tl.arange(0, 128)
    cols = block * 128 + i
    z_ptr = partial_ptr + rows * n + cols[None, :]
    z = tl.atomic_add(z_ptr, tl.zeros([16, 128], tl.float32), mask=rows < m, sem="acq_rel")
    z = tl.where(rows < m, z, 0.0)
    tl.store(z_ptr, tl.zeros([16, 128], tl.float32), mask=rows < m)
    tl.store(arrivals_ptr + block, 0)
    y = _times_hadamard(z, 16)
    svh = tl.load(svh_ptr + cols).to(tl.float32)
    y = (y * (0.08838834764831845 * svh)[None, :]).to(tl.float16)  # 1/sqrt(128) ⊙ svh
    tl.store(y_ptr + rows * n + cols[None, :], y, mask=rows < m)


def trellis_k2(trellis: torch.Tensor, codebook: str) -> int:
    """2K for a trellis tensor (K from its last dim, spec §1.1), after checking trellis and codebook."""
    if codebook not in CODEBOOKS:
        raise ValueError(f"codebook must be one of {CODEBOOKS}, got {codebook!r}")
    if trellis.dtype != torch.int16 or trellis.dim() != 3:
        raise ValueError(f"trellis must be int16 (k/16, n/16, 16K), got {trellis.dtype} {tuple(trellis.shape)}")
    width = trellis.shape[-1]
    k2 = width // 8
    if width % 8 or not 2 <= k2 <= 16:
        raise ValueError(f"trellis last dim {width} is not 16K (K 1..8) or 16K+8 (K 1.5, 2.5, 3.5)")
    if k2 % 2 and (k2 > 7 or codebook != "mul1"):
        raise ValueError(f"half-integer K = {k2 / 2} needs the mul1 codebook and K < 4, got {codebook!r}")
    return k2


def exl3_decode(trellis: torch.Tensor, codebook: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """Ŵ (k, n) fp16, bit-exact (spec §0 steps 1-5). Twin: exl3.unpack."""
    k2 = trellis_k2(trellis, codebook)
    tiles_k, tiles_n, _ = trellis.shape
    shape = (tiles_k * 16, tiles_n * 16)
    out = _out_buffer(out, shape, torch.float16, trellis.device)
    words = trellis.contiguous().view(torch.int32)
    block_rows, block_cols = 64, 128
    grid = (triton.cdiv(tiles_k * 16, block_rows), triton.cdiv(tiles_n * 16, block_cols))
    _decode_kernel[grid](words, out, tiles_k, tiles_n, K2=k2, CB=CODEBOOKS.index(codebook),
                         BR=block_rows, BC=block_cols)
    return out


GEMV_ROWS = 8  # rows per launch: tl.dot's 16 rows hold each row twice (fp16 hi and lo parts)
_SPLIT_BUFFERS: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _split_buffers(device: torch.device, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Zeroed fp32 partial sums [16, n] (the epilogue's row block) and per-128-column arrival
    # counters. Kernels leave them zeroed, so they are allocated once per (device, n) and never
    # freed: CUDA graphs captured with them keep valid addresses. Two launches must not
    # run at once (one stream, or streams joined in between).
    key = (device, n)
    if key not in _SPLIT_BUFFERS:
        _SPLIT_BUFFERS[key] = (torch.zeros(16 * n, dtype=torch.float32, device=device),
                               torch.zeros(n // 128, dtype=torch.int32, device=device))
    return _SPLIT_BUFFERS[key]


def _default_split(device: torch.device, n: int, steps: int, block_n: int) -> int:
    # Enough programs to cover every SM a few times; the split must divide the loop steps.
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    split = 1
    while steps % (2 * split) == 0 and (n // block_n) * split * 2 <= 4 * sms:
        split *= 2
    return split


def exl3_gemv(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
              codebook: str, out: torch.Tensor | None = None, *, block_n: int = 128, row_tiles: int = 2,
              split_k: int | None = None, num_warps: int = 4, num_stages: int = 1) -> torch.Tensor:
    """y = x · diag(suh) · H · Ŵ · H · diag(svh) for small m, decoding Ŵ in registers.

    x [m, k] fp16 -> y [m, n] fp16. Twin: x @ exl3.dequantize(trellis, suh, svh, codebook).
    block_n (output columns per program), row_tiles (16-row tiles per loop step), split_k,
    num_warps and num_stages are launch tuning; split_k None picks one by SM count.
    """
    k2 = trellis_k2(trellis, codebook)
    tiles_k, tiles_n, _ = trellis.shape
    k, n = tiles_k * 16, tiles_n * 16
    if k % 128 or n % 128:
        raise ValueError(f"EXL3 linear dims must be multiples of 128, got trellis {tuple(trellis.shape)} = {k}x{n}")
    if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.float16:
        raise ValueError(f"x must be fp16 [m, {k}], got {x.dtype} {tuple(x.shape)}")
    if suh.shape != (k,) or suh.dtype != torch.float16:
        raise ValueError(f"suh must be fp16 ({k},), got {suh.dtype} {tuple(suh.shape)}")
    if svh.shape != (n,) or svh.dtype != torch.float16:
        raise ValueError(f"svh must be fp16 ({n},), got {svh.dtype} {tuple(svh.shape)}")
    _check_block_n(block_n)
    m = x.shape[0]
    out = _out_buffer(out, (m, n), torch.float16, x.device)
    split = split_k or _default_split(x.device, n, tiles_k // row_tiles, block_n)
    if tiles_k % (split * row_tiles):
        raise ValueError(f"split_k {split} x row_tiles {row_tiles} must divide the {tiles_k} row tiles of 16")
    x = x.contiguous()
    words = trellis.contiguous().view(torch.int32)
    partial, counters = _split_buffers(x.device, n)
    for row in range(0, m, GEMV_ROWS):
        rows = min(GEMV_ROWS, m - row)
        xh = torch.empty((rows, k), dtype=torch.float32, device=x.device)
        _rotate_input_kernel[(k // 128,)](x[row:], suh, xh, rows, k)
        _gemv_kernel[(n // block_n, split)](
            xh, svh, words, partial, counters, out[row:], rows, k, n, tiles_k // (split * row_tiles),
            split * 128 // block_n, K2=k2, CB=CODEBOOKS.index(codebook), MP=triton.next_power_of_2(rows),
            RT=row_tiles, CT=block_n // 16, num_warps=num_warps, num_stages=num_stages)
    return out



# ---------------------------------------------------------------- EXL3 MoE decode: all selected experts at once
# For P = m * top_k (token, expert) pairs of one MoE layer, in three launches whatever P:
#   1. rotate x for every pair with its expert's gate and up suh (and zero the output rows 3. adds into);
#   2. gate and up GEMV over all pairs (program axis 2 = projection and pair, expert id read on the
#      device); the last program to finish a 128-column block of a pair (counted over both
#      projections) applies H128 and svh to gate and up, the clamped SwiGLU (spec glm53.md §4.5),
#      and the down projection's input rotation (⊙ suh_down, H128): the block is ready for 3.;
#   3. down GEMV over all pairs; the last program of a block applies H128, svh and the routing
#      weight and adds the block into the token's fp32 output row.
# Twin: Σ_j w_j · down_e(swiglu(gate_e(x), up_e(x))) with exl3.EXL3Linear experts and model_glm.swiglu
# (tests/test_kernels.py); the kernel keeps the intermediates in fp32 where the twin rounds each
# linear's output to the activation dtype.


@triton.jit
def _moe_rotate_kernel(x_ptr, ids_ptr, suh_gate_ptr, suh_up_ptr, xh_ptr, y_ptr, k, top_k, pairs):
    # xh[0 | 1, p, block] = (x[token] ⊙ suh_gate | suh_up [e]) · H128 / sqrt(128), in the gemv's row order;
    # a token's first pair also zeroes its block of the output y (k = D columns), which the down launch
    # adds into, two launches later (a memset launch fewer).
    blk = tl.program_id(0)
    p = tl.program_id(1)
    e = tl.load(ids_ptr + p).to(tl.int64)
    i = tl.arange(0, 128)
    if p % top_k == 0:
        tl.store(y_ptr + (p // top_k) * k + blk * 128 + i, tl.zeros([128], tl.float32))
    x = tl.load(x_ptr + (p // top_k) * k + blk * 128 + i).to(tl.float32)
    r = i % 16
    slot = blk * 128 + i - r + 4 * ((r >> 1) & 3) + 2 * (r >> 3) + (r & 1)
    suh = tl.load(suh_gate_ptr + e * k + blk * 128 + i).to(tl.float32)
    tl.store(xh_ptr + p * k + slot[None, :], _times_hadamard((x * suh)[None, :], 1) * 0.08838834764831845)
    suh = tl.load(suh_up_ptr + e * k + blk * 128 + i).to(tl.float32)
    tl.store(xh_ptr + (pairs + p) * k + slot[None, :], _times_hadamard((x * suh)[None, :], 1) * 0.08838834764831845)


@triton.jit
def _moe_gemv_kernel(xh_ptr, words_ptr, words_up_ptr, ids_ptr, partial_ptr, arrivals_ptr, k, n, steps, arrivals,
                     expert_words, pairs, svh_a_ptr, svh_b_ptr, suh_next_ptr, route_ptr, out_ptr, top_k, limit,
                     K2: tl.constexpr, CB: tl.constexpr, RT: tl.constexpr, CT: tl.constexpr, DOWN: tl.constexpr):
    # Program (pid_n, pid_k, q): one row, its expert's trellis. Gate and up share a launch: q is
    # half * pairs + p with half 0 for gate (words_ptr) and 1 for up (words_up_ptr); down has q = p.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    q = tl.program_id(2)
    half = q // pairs
    p = q - half * pairs
    e = tl.load(ids_ptr + p).to(tl.int64)
    if half == 0:
        words = words_ptr + e * expert_words
    else:
        words = words_up_ptr + e * expert_words
    z = _gemv_products(xh_ptr + q.to(tl.int64) * k, words, 1, k, n, steps, pid_n, pid_k, K2, CB, 1, RT, CT)
    parts: tl.constexpr = 1 if DOWN else 2
    cols = pid_n * CT * 16 + tl.arange(0, CT * 16)[None, :]
    tl.atomic_add(partial_ptr + (p * parts + half) * n + cols, z, sem="relaxed")
    tl.debug_barrier()
    block = pid_n * CT * 16 // 128
    counter = arrivals_ptr + p * (n // 128) + block
    arrived = tl.atomic_add(counter, 1, sem="acq_rel")
    if arrived == arrivals - 1:
        i = tl.arange(0, 128)
        c = block * 128 + i
        zero = tl.zeros([1, 128], tl.float32)
        if DOWN:
            z_ptr = partial_ptr + p * n + c[None, :]
            y = _times_hadamard(tl.atomic_add(z_ptr, zero, sem="acq_rel"), 1)
            tl.store(z_ptr, zero)
            scale = 0.08838834764831845 * tl.load(svh_a_ptr + e * n + c).to(tl.float32) * tl.load(route_ptr + p)
            tl.atomic_add(out_ptr + (p // top_k) * n + c[None, :], y * scale[None, :], sem="relaxed")
        else:
            g_ptr = partial_ptr + (2 * p) * n + c[None, :]
            u_ptr = partial_ptr + (2 * p + 1) * n + c[None, :]
            gate = _times_hadamard(tl.atomic_add(g_ptr, zero, sem="acq_rel"), 1)
            up = _times_hadamard(tl.atomic_add(u_ptr, zero, sem="acq_rel"), 1)
            tl.store(g_ptr, zero)
            tl.store(u_ptr, zero)
            gate = gate * (0.08838834764831845 * tl.load(svh_a_ptr + e * n + c).to(tl.float32))[None, :]
            up = up * (0.08838834764831845 * tl.load(svh_b_ptr + e * n + c).to(tl.float32))[None, :]
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
            act = gate * tl.sigmoid(gate) * up
            suh = tl.load(suh_next_ptr + e * n + c).to(tl.float32)
            act_h = _times_hadamard(act * suh[None, :], 1) * 0.08838834764831845
            r = i % 16
            slot = i - r + 4 * ((r >> 1) & 3) + 2 * (r >> 3) + (r & 1)
            tl.store(out_ptr + p * n + block * 128 + slot[None, :], act_h)
        tl.store(counter, 0)


_MOE_BUFFERS: dict[tuple[torch.device, int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _moe_buffers(device: torch.device, pairs: int, n: int, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Zeroed partial sums [pairs, parts, n] and arrival counters [pairs, n / 128]; the kernels leave
    # them zeroed, so they are allocated once and never freed (graph-safe, one stream).
    key = (device, pairs, n, parts)
    if key not in _MOE_BUFFERS:
        _MOE_BUFFERS[key] = (torch.zeros(pairs * parts * n, dtype=torch.float32, device=device),
                             torch.zeros(pairs * (n // 128), dtype=torch.int32, device=device))
    return _MOE_BUFFERS[key]


def _moe_split(device: torch.device, n: int, pairs: int, steps: int, block_n: int) -> int:
    # Up to 8 programs per SM: on the H200 that was 2-3% faster than 4 at batch 1 (twice measured).
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    split = 1
    while steps % (2 * split) == 0 and (n // block_n) * pairs * split * 2 <= 8 * sms:
        split *= 2
    return split


def _check_experts(name: str, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
                   codebook: str, experts: int | None) -> int:
    if trellis.dim() != 4:
        raise ValueError(f"{name} trellis must be stacked (experts, k/16, n/16, 16K), got {tuple(trellis.shape)}")
    k2 = trellis_k2(trellis[0], codebook)
    E, tk, tn, _ = trellis.shape
    if experts is not None and E != experts:
        raise ValueError(f"{name} has {E} experts, gate has {experts}")
    for what, t, size in (("suh", suh, tk * 16), ("svh", svh, tn * 16)):
        if tuple(t.shape) != (E, size) or t.dtype != torch.float16:
            raise ValueError(f"{name} {what} must be fp16 ({E}, {size}), got {t.dtype} {tuple(t.shape)}")
    return k2


def _check_moe(x: torch.Tensor, ids: torch.Tensor, route: torch.Tensor, gate: tuple, up: tuple, down: tuple,
               codebook: str, x_form: str) -> tuple[int, int, int, int]:
    # The MoE kernels' shared contract (x_form names what x must be, with {D}): returns (k2, E, D, I).
    k2 = _check_experts("gate", *gate, codebook, None)
    E = gate[0].shape[0]
    if _check_experts("up", *up, codebook, E) != k2 or _check_experts("down", *down, codebook, E) != k2:
        raise ValueError("gate, up and down must share one K (trellis last dim)")
    D, I = gate[0].shape[1] * 16, gate[0].shape[2] * 16
    if up[0].shape != gate[0].shape or tuple(down[0].shape[1:3]) != (I // 16, D // 16):
        raise ValueError(f"expert shapes disagree: gate {tuple(gate[0].shape)}, up {tuple(up[0].shape)}, "
                         f"down {tuple(down[0].shape)}")
    if D % 128 or I % 128:
        raise ValueError(f"expert dims must be multiples of 128, got {D} x {I}")
    if x.dim() != 2 or x.shape[1] != D:
        raise ValueError(f"x must be {x_form.format(D=D)}, got {x.dtype} {tuple(x.shape)}")
    m = x.shape[0]
    if ids.dim() != 2 or ids.shape[0] != m or tuple(route.shape) != tuple(ids.shape):
        raise ValueError(f"ids and route must both be [{m}, top_k], got {tuple(ids.shape)} and {tuple(route.shape)}")
    return k2, E, D, I


def exl3_moe_decode(x: torch.Tensor, ids: torch.Tensor, route: torch.Tensor,
                    gate: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                    up: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                    down: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                    codebook: str, limit: float, *, block_n: int = 128, row_tiles: int = 2,
                    num_warps: int = 4) -> torch.Tensor:
    """Σ_j route[t, j] · down_e(swiglu(gate_e(x_t), up_e(x_t))) for e = ids[t, j], all pairs at once.

    x [m, D] fp16 / bf16; ids [m, top_k] integer expert ids and route [m, top_k] fp32 weights, on the
    device (no host synchronization: CUDA-graph safe); gate, up = (trellis [E, D/16, I/16, 16K],
    suh [E, D], svh [E, I]) and down = (trellis [E, I/16, D/16, 16K], suh [E, I], svh [E, D]), each
    stacked over the layer's experts (one K per layer). Returns fp32 [m, D].
    """
    k2, E, D, I = _check_moe(x, ids, route, gate, up, down, codebook, "[m, {D}]")
    m = x.shape[0]
    _check_block_n(block_n)
    top_k = ids.shape[1]
    P = m * top_k
    dev = x.device
    ids = ids.reshape(-1).to(torch.int32).contiguous()
    route = route.reshape(-1).float().contiguous()
    x = x.contiguous()
    words = [t[0].contiguous().view(torch.int32) for t in (gate, up, down)]
    NW = 4 * k2
    cb = CODEBOOKS.index(codebook)

    xh = torch.empty((2, P, D), dtype=torch.float32, device=dev)
    y = torch.empty((m, D), dtype=torch.float32, device=dev)  # zeroed by the rotation
    _moe_rotate_kernel[(D // 128, P)](x, ids, gate[1], up[1], xh, y, D, top_k, P)

    act_h = torch.empty((P, I), dtype=torch.float32, device=dev)
    steps = D // 16 // row_tiles
    split = _moe_split(dev, I, 2 * P, steps, block_n)
    partial, counters = _moe_buffers(dev, P, I, 2)
    launch = dict(K2=k2, CB=cb, RT=row_tiles, CT=block_n // 16, num_warps=num_warps)
    _moe_gemv_kernel[(I // block_n, split, 2 * P)](
        xh, words[0], words[1], ids, partial, counters, D, I, steps // split, 2 * split * 128 // block_n,
        (D // 16) * (I // 16) * NW, P, gate[2], up[2], down[1], route, act_h, top_k, limit, DOWN=False, **launch)

    steps = I // 16 // row_tiles
    split = _moe_split(dev, D, P, steps, block_n)
    partial, counters = _moe_buffers(dev, P, D, 1)
    _moe_gemv_kernel[(D // block_n, split, P)](
        act_h, words[2], words[2], ids, partial, counters, I, D, steps // split, split * 128 // block_n,
        (I // 16) * (D // 16) * NW, P, down[2], down[2], down[1], route, y, top_k, limit, DOWN=True, **launch)
    return y


# ---------------------------------------------------------------- EXL3 MoE prefill: many rows per expert
# For P = m * top_k (row, expert) pairs of one MoE layer, sorted by expert (argsort on the device; no
# host synchronization), in four launches whatever P:
#   1. rotate every sorted pair's row for gate and for up ((x ⊙ suh_e) · H128, fp32) and store it
#      in fp16 times a per-row power of two that puts the row's largest value in [2^13, 2^14): exact,
#      and it keeps small activations out of fp16's subnormals (spec §4 allows any fp16 suh);
#   2. gate and up as one grouped GEMM: a program owns a tile of BM sorted pairs of one expert and
#      one 128-column block, runs over all of k for gate and then for up, decoding each 16x16 trellis
#      tile in registers straight into tl.dot's A operand (Ŵ^T, as exl3_gemv does; the activations
#      are B, [32, BM] fp16), so a weight is decoded once per BM rows, the ALU only decodes and the
#      tensor cores multiply; its epilogue owns a whole 128-column block of both projections: H128,
#      svh, the clamped SwiGLU (glm53.md §4.5), ⊙ suh_down and H128 again: fp32 down inputs;
#   3. the down inputs to fp16 with per-row powers of two, as in 1.;
#   4. down as the same grouped GEMM; its epilogue applies H128, svh, the routing weight and the
#      row scale and adds the block into the token's fp32 output row (atomic adds);
# plus the small torch ops that sort and build the tile table [tiles, 3] = (expert, first sorted
# pair, rows). The grid covers cdiv(P, BM) + E tiles, an upper bound; programs past the real tiles
# do nothing. BM follows the mean rows per expert (16..128): at 8K tokens (228 pairs per expert)
# most experts take two tiles, so each weight is decoded about twice per layer instead of once per
# row as in the per-expert path, and no decoded weight is written to memory.
# Transient memory: at most 4 P (D + I) bytes (1.6 GB at 8K tokens of the full model).
# Twin: the per-expert fp32 sum Σ_j w_j · down_e(swiglu(gate_e(x), up_e(x))) with exl3.EXL3Linear
# (tests/test_kernels.py); activations enter the tensor cores as fp16 (11 significant bits), which
# sets the precision (~5e-4 relative), as in EXL3Linear's GEMM path.

PREFILL_ROWS = 16  # sorted pairs per program of the rotation and scaling kernels


@triton.jit
def _fp16_scale(peak):
    # Powers of two s = 2^(13 - e) and 1 / s for a row whose largest |value| is peak in [2^e, 2^(e+1)),
    # built from the exponent bits (exact; no exp2). Zero rows get a finite scale.
    expo = (tl.maximum(peak, 7.888609052210118e-31).to(tl.int32, bitcast=True) >> 23) & 0xFF
    scale = ((267 - expo) << 23).to(tl.float32, bitcast=True)
    inv = ((expo - 13) << 23).to(tl.float32, bitcast=True)
    return scale, inv


@triton.jit
def _prefill_rotate(x_ptr, suh_ptr, tok, e, ok, D, out_ptr, inv_ptr, s, RB: tl.constexpr):
    # out[s] = fp16((x[tok] ⊙ suh[e]) · H128 · scale), inv[s] = 1 / scale, for RB sorted pairs.
    i = tl.arange(0, 128)[None, :]
    peak = tl.zeros([RB], tl.float32)
    for b in range(0, D // 128):
        x = tl.load(x_ptr + tok[:, None] * D + b * 128 + i, mask=ok[:, None], other=0.0).to(tl.float32)
        suh = tl.load(suh_ptr + e[:, None] * D + b * 128 + i, mask=ok[:, None], other=0.0).to(tl.float32)
        xh = _times_hadamard(x * suh, RB)
        peak = tl.maximum(peak, tl.max(tl.abs(xh), axis=1) * 0.08838834764831845)
    scale, inv = _fp16_scale(peak)
    tl.store(inv_ptr + s, inv, mask=ok)
    scale = scale * 0.08838834764831845  # 1/sqrt(128) of the normalized H128, times the row's scale
    for b in range(0, D // 128):
        x = tl.load(x_ptr + tok[:, None] * D + b * 128 + i, mask=ok[:, None], other=0.0).to(tl.float32)
        suh = tl.load(suh_ptr + e[:, None] * D + b * 128 + i, mask=ok[:, None], other=0.0).to(tl.float32)
        xh = _times_hadamard(x * suh, RB) * scale[:, None]
        tl.store(out_ptr + s[:, None] * D + b * 128 + i, xh.to(tl.float16), mask=ok[:, None])


@triton.jit
def _prefill_rotate_kernel(x_ptr, order_ptr, ids_ptr, suh_gate_ptr, suh_up_ptr, xs_gate_ptr, xs_up_ptr,
                           inv_gate_ptr, inv_up_ptr, P, D, top_k, RB: tl.constexpr):
    # Rows s of xs_gate and xs_up for the sorted pairs s of this program: rotated, scaled rows.
    s = tl.program_id(0) * RB + tl.arange(0, RB)
    ok = s < P
    pair = tl.load(order_ptr + s, mask=ok, other=0)
    e = tl.load(ids_ptr + pair, mask=ok, other=0).to(tl.int64)
    tok = (pair // top_k).to(tl.int64)
    s = s.to(tl.int64)
    _prefill_rotate(x_ptr, suh_gate_ptr, tok, e, ok, D, xs_gate_ptr, inv_gate_ptr, s, RB)
    _prefill_rotate(x_ptr, suh_up_ptr, tok, e, ok, D, xs_up_ptr, inv_up_ptr, s, RB)


@triton.jit
def _prefill_scale_kernel(a_ptr, out_ptr, inv_ptr, P, n, RB: tl.constexpr):
    # out[s] = fp16(a[s] · scale), inv[s] = 1 / scale, for RB rows of a [P, n] fp32.
    s = (tl.program_id(0) * RB + tl.arange(0, RB)).to(tl.int64)
    ok = s < P
    i = tl.arange(0, 128)[None, :]
    peak = tl.zeros([RB], tl.float32)
    for b in range(0, n // 128):
        a = tl.load(a_ptr + s[:, None] * n + b * 128 + i, mask=ok[:, None], other=0.0)
        peak = tl.maximum(peak, tl.max(tl.abs(a), axis=1))
    scale, inv = _fp16_scale(peak)
    tl.store(inv_ptr + s, inv, mask=ok)
    for b in range(0, n // 128):
        a = tl.load(a_ptr + s[:, None] * n + b * 128 + i, mask=ok[:, None], other=0.0)
        tl.store(out_ptr + s[:, None] * n + b * 128 + i, (a * scale[:, None]).to(tl.float16), mask=ok[:, None])


@triton.jit
def _prefill_products(words_ptr, xs_ptr, rows_ok, k, n, pid_n,
                      K2: tl.constexpr, CB: tl.constexpr, RT: tl.constexpr, BM: tl.constexpr):
    # acc [128, BM] fp32 = (xs[:BM] · Ŵ[:, 128 pid_n : 128 (pid_n + 1)])^T for one expert's trellis
    # words (k x n) and BM fp16 rows at xs_ptr (row stride k; rows_ok [1, BM] masks the tile's end).
    # Lane geometry as in _gemv_products: one thread element = one mma lane of one 16x16 tile.
    CT: tl.constexpr = 8
    NW: tl.constexpr = 4 * K2
    SPAN: tl.constexpr = ((8 * K2) >> 1) - (K2 >> 1) + 16
    STATIC: tl.constexpr = (4 * K2) % 32 == 0
    BASE: tl.constexpr = ((K2 >> 1) + 16) % 32 if STATIC else 0
    NR: tl.constexpr = (SPAN + 31) // 32
    G: tl.constexpr = 32 if K2 % 8 == 0 else (16 if K2 % 4 == 0 else (8 if K2 % 2 == 0 else 4))
    O_MAX: tl.constexpr = (((K2 >> 1) + 16) % G) + 32 - G
    DIRECT: tl.constexpr = not STATIC and SPAN + O_MAX <= 64
    NL: tl.constexpr = (BASE + SPAN + 31) // 32 if STATIC else (2 if DIRECT else NR + 1)
    tiles_n = n // 16
    zero = (k >> 31).to(tl.uint32)
    o, off0, off1, off2, off3 = _lane_words(tiles_n, pid_n, K2, RT, CT)
    x_off = tl.arange(0, BM)[None, :] * k + tl.arange(0, RT * 16)[:, None]  # B [RT * 16, BM] = xs^T
    steps = k // (RT * 16)
    step_words = RT * tiles_n * NW
    acc = tl.zeros([CT * 16, BM], tl.float32)
    # Each step loads the next step's words and activations before decoding its own (the last step
    # re-reads its own).
    p0, p1, p2, p3, xp = words_ptr + off0, words_ptr + off1, words_ptr + off2, words_ptr + off3, xs_ptr + x_off
    w0, w1, w2, w3, x = _load_step(p0, p1, p2, p3, 0, xp, 0, rows_ok, NL)
    for step in range(0, steps):
        ahead = tl.minimum(step + 1, steps - 1)
        n0, n1, n2, n3, nx = _load_step(p0, p1, p2, p3, ahead * step_words, xp, ahead * (RT * 16), rows_ok, NL)
        acc = tl.dot(_decoded_tiles(w0, w1, w2, w3, o, zero, K2, CB, RT, CT, STATIC, BASE, NR, DIRECT), x, acc)
        w0, w1, w2, w3, x = n0, n1, n2, n3, nx
    return acc


@triton.jit
def _prefill_tile(tiles_ptr, tile, rows, BM: tl.constexpr):
    # A tile of the table (see _prefill_tiles): its expert, first sorted pair, the BM pair slots
    # from there and which of them hold pairs.
    e = tl.load(tiles_ptr + 3 * tile).to(tl.int64)
    first = tl.load(tiles_ptr + 3 * tile + 1).to(tl.int64)
    i = tl.arange(0, BM)
    return e, first, first + i, i < rows


@triton.jit
def _prefill_gate_up_kernel(xs_gate_ptr, xs_up_ptr, inv_gate_ptr, inv_up_ptr, gate_words_ptr, up_words_ptr,
                            tiles_ptr, svh_gate_ptr, svh_up_ptr, suh_down_ptr, act_ptr, D, I, expert_words, limit,
                            K2: tl.constexpr, CB: tl.constexpr, RT: tl.constexpr, BM: tl.constexpr):
    # Program (128-column block, tile): act[pairs of the tile, block] = (swiglu(gate, up) ⊙ suh_down) · H128.
    pid_n = tl.program_id(0)
    tile = tl.program_id(1)
    rows = tl.load(tiles_ptr + 3 * tile + 2)
    if rows > 0:
        e, first, s, ok = _prefill_tile(tiles_ptr, tile, rows, BM)
        gate = _prefill_products(gate_words_ptr + e * expert_words, xs_gate_ptr + first * D, ok[None, :], D, I,
                                 pid_n, K2, CB, RT, BM)
        up = _prefill_products(up_words_ptr + e * expert_words, xs_up_ptr + first * D, ok[None, :], D, I, pid_n,
                               K2, CB, RT, BM)
        c = pid_n * 128 + tl.arange(0, 128)
        inv_gate = tl.load(inv_gate_ptr + s, mask=ok, other=0.0)
        inv_up = tl.load(inv_up_ptr + s, mask=ok, other=0.0)
        svh_gate = 0.08838834764831845 * tl.load(svh_gate_ptr + e * I + c).to(tl.float32)
        svh_up = 0.08838834764831845 * tl.load(svh_up_ptr + e * I + c).to(tl.float32)
        gate = _times_hadamard(tl.trans(gate) * inv_gate[:, None], BM) * svh_gate[None, :]
        up = _times_hadamard(tl.trans(up) * inv_up[:, None], BM) * svh_up[None, :]
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        act = gate * tl.sigmoid(gate) * up
        suh = tl.load(suh_down_ptr + e * I + c).to(tl.float32)
        act = _times_hadamard(act * suh[None, :], BM) * 0.08838834764831845
        tl.store(act_ptr + s[:, None] * I + c[None, :], act, mask=ok[:, None])


@triton.jit
def _prefill_down_kernel(acts_ptr, inv_ptr, words_ptr, tiles_ptr, order_ptr, route_ptr, svh_ptr, out_ptr,
                         I, D, top_k, expert_words,
                         K2: tl.constexpr, CB: tl.constexpr, RT: tl.constexpr, BM: tl.constexpr):
    # Program (128-column block, tile): out[token, block] += route · (down products · H128) ⊙ svh.
    pid_n = tl.program_id(0)
    tile = tl.program_id(1)
    rows = tl.load(tiles_ptr + 3 * tile + 2)
    if rows > 0:
        e, first, s, ok = _prefill_tile(tiles_ptr, tile, rows, BM)
        z = _prefill_products(words_ptr + e * expert_words, acts_ptr + first * I, ok[None, :], I, D, pid_n,
                              K2, CB, RT, BM)
        pair = tl.load(order_ptr + s, mask=ok, other=0)
        weight = tl.load(route_ptr + pair, mask=ok, other=0.0) * tl.load(inv_ptr + s, mask=ok, other=0.0)
        c = pid_n * 128 + tl.arange(0, 128)
        svh = 0.08838834764831845 * tl.load(svh_ptr + e * D + c).to(tl.float32)
        y = _times_hadamard(tl.trans(z) * weight[:, None], BM) * svh[None, :]
        token = (pair // top_k).to(tl.int64)
        tl.atomic_add(out_ptr + token[:, None] * D + c[None, :], y, mask=ok[:, None], sem="relaxed")


def _prefill_tiles(ids: torch.Tensor, experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    # The pairs sorted by expert (stable) and the tile table [cdiv(P, BM) + E, 3] int32 of
    # (expert, first sorted pair, rows), rows 0 past the last real tile; all on the device.
    P = ids.numel()
    order = torch.argsort(ids, stable=True)
    counts = torch.zeros(experts, dtype=torch.int64, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))
    per_expert = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(per_expert, 0)
    t = torch.arange(triton.cdiv(P, block_m) + min(experts, P), device=ids.device)
    e = torch.searchsorted(tile_end, t, right=True).clamp_(max=experts - 1)
    j = t - (tile_end[e] - per_expert[e])
    first = torch.cumsum(counts, 0)[e] - counts[e] + j * block_m
    rows = (counts[e] - j * block_m).clamp(0, block_m)
    return order.to(torch.int32), torch.stack([e, first, rows], 1).to(torch.int32).contiguous()


def exl3_moe_prefill(x: torch.Tensor, ids: torch.Tensor, route: torch.Tensor,
                     gate: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                     up: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                     down: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                     codebook: str, limit: float, *, block_m: int | None = None, row_tiles: int | None = None,
                     num_warps: int | None = None) -> torch.Tensor:
    """exl3_moe_decode's contract for many rows: Σ_j route[t, j] · down_e(swiglu(gate_e(x_t), up_e(x_t))),
    e = ids[t, j], as grouped GEMMs over the pairs sorted by expert (see the section comment).

    x [m, D] fp16 / bf16; ids [m, top_k] integer expert ids, route [m, top_k] fp32; gate, up, down
    stacked as for exl3_moe_decode. Returns fp32 [m, D]. block_m (sorted pairs per GEMM tile, 16..128;
    None picks by the mean pairs per expert), row_tiles (16-row trellis tiles per loop step; None: 4 at
    128-row tiles, else 2; H200, 8K rows: 20.7 vs 23.4 ms at K3) and num_warps (None: 8 from 64 rows on)
    are launch tuning.
    """
    k2, E, D, I = _check_moe(x, ids, route, gate, up, down, codebook, "fp16 or bf16 [m, {D}]")
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"x must be fp16 or bf16 [m, {D}], got {x.dtype} {tuple(x.shape)}")
    m = x.shape[0]
    if row_tiles is not None and row_tiles not in (1, 2, 4, 8):
        raise ValueError(f"row_tiles must be 1, 2, 4 or 8, got {row_tiles}")
    top_k = ids.shape[1]
    P = m * top_k
    dev = x.device
    y = torch.zeros((m, D), dtype=torch.float32, device=dev)
    if P == 0:
        return y
    BM = block_m or min(128, max(16, triton.next_power_of_2(triton.cdiv(P, E))))
    if BM not in (16, 32, 64, 128):
        raise ValueError(f"block_m must be 16, 32, 64 or 128, got {BM}")
    warps = num_warps or (8 if BM >= 64 else 4)
    row_tiles = row_tiles or (4 if BM == 128 else 2)
    ids = ids.reshape(-1).to(torch.int64)
    order, tiles = _prefill_tiles(ids, E, BM)
    ids = ids.to(torch.int32)
    route = route.reshape(-1).float().contiguous()
    words = [t[0].contiguous().view(torch.int32) for t in (gate, up, down)]
    launch = dict(K2=k2, CB=CODEBOOKS.index(codebook), RT=row_tiles, BM=BM, num_warps=warps)
    rows_grid = (triton.cdiv(P, PREFILL_ROWS),)

    xs = torch.empty((2, P, D), dtype=torch.float16, device=dev)
    inv = torch.empty((2, P), dtype=torch.float32, device=dev)
    _prefill_rotate_kernel[rows_grid](x.contiguous(), order, ids, gate[1], up[1], xs[0], xs[1], inv[0], inv[1],
                                      P, D, top_k, RB=PREFILL_ROWS)
    act = torch.empty((P, I), dtype=torch.float32, device=dev)
    _prefill_gate_up_kernel[(I // 128, tiles.shape[0])](
        xs[0], xs[1], inv[0], inv[1], words[0], words[1], tiles, gate[2], up[2], down[1], act, D, I,
        (D // 16) * (I // 16) * 4 * k2, limit, **launch)
    del xs
    acts = torch.empty((P, I), dtype=torch.float16, device=dev)
    inv = torch.empty((P,), dtype=torch.float32, device=dev)
    _prefill_scale_kernel[rows_grid](act, acts, inv, P, I, RB=PREFILL_ROWS)
    del act
    _prefill_down_kernel[(D // 128, tiles.shape[0])](
        acts, inv, words[2], tiles, order, route, down[2], y, I, D, top_k, (I // 16) * (D // 16) * 4 * k2, **launch)
    return y

# ================================================================ KDA recurrence
# Per head h the state S[h] is fp32 [d_k, d_v], indexed [key i, value j]. One token:
#
#     S <- diag(exp(g)) S          decay the key rows first
#     p  = S^T k                   what the state predicts for k
#     δ  = β (v - p)               delta rule
#     S <- S + k δ^T
#     o  = S^T q                   read from the updated state (q already L2-normed and scaled)
#
# `kda_recurrent_step` runs that for one token of B sequences against a state pool (decode);
# `kda_chunk_prefill` runs a whole sequence in the chunked WY form (§4.3.7).
#
# Matrix products inside the prefill kernels use `tl.dot` with DOT_PRECISION = "tf32x3": each fp32
# operand goes to the tensor cores as a TF32 hi part plus a TF32 remainder (three products), near
# fp32; everything else (the carried state, Γ, the exact solve of the 16-row diagonal blocks) is fp32.
# `bench.py kda precision`, H200, T = 8192, one layer: "tf32" 9.2 ms at 1.5e-3 relative error of o,
# "tf32x3" 11.3 ms at 1.5e-6, "ieee" (fp32 FMA) 16.3 ms at 1.5e-6. With "tf32" the fast prefill of
# the trained default model (bf16) was 5.9e-3 nats of KL from the reference; with "tf32x3" 5.5e-4,
# the size of that model's own move for a 1-ulp change of its input (5.4e-4).
# Under the CPU interpreter tl.dot is exact fp32 whatever the setting. The decode kernel has no
# matrix product.

DOT_PRECISION = "tf32x3"
SUB_CHUNK = 16  # rows of the diagonal blocks solved exactly inside a chunk; tl.dot needs >= 16
OUT_BLOCK_V, OUT_BLOCK_K = 64, 32


# ---------------------------------------------------------------- decode: one token, state pool

def kda_recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                       block_v: int = 32, num_warps: int = 4) -> torch.Tensor:
    """One token of §4.3.6 for B sequences (twin: `model_glm.kda_recurrent`, one sequence at a time):
    q, k, g [B, H, d_k], v [B, H, d_v], beta [B, H], state [num_slots, H, d_k, d_v] fp32 (e.g.
    CachePool.kda_state[layer]) updated in place at rows `slots` [B] (distinct). Returns o [B, H, d_v]
    in q's dtype.

    Each program owns a [d_k, block_v] tile of one head's state in registers: one read, one write.
    """
    _check_step(q, k, v, g, beta, state, slots)
    B, H, dk = q.shape
    dv = v.shape[-1]
    if state.dtype != torch.float32:
        raise ValueError(f"state must be fp32, got {state.dtype}")
    _check_pow2("d_k", dk)
    _check_pow2("d_v", dv)
    bv = min(dv, block_v)
    if dv % bv:
        raise ValueError(f"block_v {bv} must divide d_v {dv}")
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o = torch.empty(B, H, dv, dtype=q.dtype, device=q.device)
    _kda_step_kernel[(B * H, dv // bv)](
        q, k, v, g, beta, state, slots.to(torch.int64).contiguous(), o,
        *state.stride(), H=H, DK=dk, DV=dv, BV=bv, num_warps=num_warps)
    return o


@triton.jit
def _kda_step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, o_ptr,
                     s_slot, s_head, s_key, s_val,
                     H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr):
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    i = tl.arange(0, DK)
    j = tl.program_id(1) * BV + tl.arange(0, BV)
    slot = tl.load(slots_ptr + b)
    s_ptrs = state_ptr + slot * s_slot + h * s_head + i[:, None] * s_key + j[None, :] * s_val
    S = tl.load(s_ptrs)
    q = tl.load(q_ptr + bh * DK + i).to(tl.float32)
    k = tl.load(k_ptr + bh * DK + i).to(tl.float32)
    g = tl.load(g_ptr + bh * DK + i).to(tl.float32)
    v = tl.load(v_ptr + bh * DV + j).to(tl.float32)
    beta = tl.load(beta_ptr + bh).to(tl.float32)
    S = S * tl.exp(g)[:, None]
    p = tl.sum(S * k[:, None], axis=0)
    delta = beta * (v - p)
    S = S + k[:, None] * delta[None, :]
    o = tl.sum(S * q[:, None], axis=0)
    tl.store(s_ptrs, S)
    tl.store(o_ptr + bh * DV + j, o.to(o_ptr.dtype.element_ty))


# ---------------------------------------------------------------- prefill: chunked WY form

def kda_chunk_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, initial_state: torch.Tensor | None = None, chunk: int = 64,
                      block: int | None = None, block_v: int = 32, num_warps: int = 4,
                      num_stages: int = 1, precision: str = DOT_PRECISION
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A whole sequence: q, k, g [T, H, d_k], v [T, H, d_v], beta [T, H] (twin: `model_glm.kda_recurrent`
    over the T tokens from `initial_state`, zeros if None). Returns (o [T, H, d_v] in q's dtype, final
    state [H, d_k, d_v] fp32, boundary states [T // block, H, d_k, d_v] fp32 = the state after each
    token t with (t + 1) % block == 0, or None). Three passes:

    1. `chunk_factors`: every (chunk, head) in parallel, the WY factors of §4.3.7.
    2. `chunk_states`: every (value tile, head) in parallel, chunks in order: the state entering
       each chunk (kept for pass 3; `block` boundaries are among them) and U' = U - W S.
    3. `chunk_output`: every (chunk, head, value tile) in parallel: O = (Q ⊙ exp(Γ)) S + Aqk U'.
    g must be <= 0 (a log-decay): the factorizations keep every exponent <= 0.
    block_v, num_warps, num_stages tune pass 2; precision is the tl.dot input precision.
    Transient memory: one fp32 state per chunk (4 MiB per 64 tokens at H = 64, d = 128).
    """
    T, H, dk, dv = _check_prefill(q, k, v, g, beta, initial_state)
    if chunk not in (16, 32, 64):
        raise ValueError(f"chunk must be 16, 32 or 64, got {chunk}")
    if block is not None and (block <= 0 or block % chunk):
        raise ValueError(f"block {block} must be a positive multiple of chunk {chunk}")
    _check_pow2("d_k", dk)
    _check_pow2("d_v", dv)
    if dv % min(dv, block_v):
        raise ValueError(f"block_v {block_v} must divide d_v {dv}")
    f = chunk_factors(q, k, v, g, beta, chunk, precision)
    states = chunk_states(f, initial_state, block_v, num_warps, num_stages, precision)
    o = chunk_output(f, states, q.dtype, precision)
    boundary = None
    if block is not None:
        boundary = states[[(i + 1) * block // chunk for i in range(T // block)]]
    return o, states[-1].clone(), boundary


@dataclass
class ChunkFactors:
    """Per-chunk quantities of §4.3.7, rows padded to whole chunks (padding: g = k = v = β = 0).

    gamma: Γ, the chunk-local cumulative log-decay [rows, H, d_k]; w = Tm (K_β ⊙ exp(Γ)) and
    u = Tm V_β [rows, H, d_k | d_v] (`chunk_states` overwrites u with U' = U - W S);
    qg = Q ⊙ exp(Γ); kd = K ⊙ exp(Γ_last - Γ); aqk [rows, H, chunk] = (Q K^T ⊙ D) on and below
    the diagonal, zero above.
    """
    T: int
    chunk: int
    gamma: torch.Tensor
    w: torch.Tensor
    u: torch.Tensor
    qg: torch.Tensor
    kd: torch.Tensor
    aqk: torch.Tensor


def chunk_factors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, chunk: int, precision: str = DOT_PRECISION,
                  num_warps: int = 4, num_stages: int = 1) -> ChunkFactors:
    """Two launches: `_kda_chunk_intra_kernel` per (chunk, head) builds Γ, Aqk and
    Tm = (I - A)^{-1} one 16-row block at a time; `_kda_chunk_wy_kernel` per (32 columns of
    [K | V], chunk, head) multiplies W = Tm (K_β ⊙ exp(Γ)), U = Tm V_β as [chunk, chunk] x
    [chunk, 32] products. ptxas for sm_90 (triton 3.6, d = 128, chunk 64, tf32x3, 4 warps): 128
    registers with 4 B spilled, and 125 registers (the single kernel this replaces: 255 and
    176 B spilled); key slices of 32 instead of 16 in the intra kernel take ~250 (its slice loop
    is unrolled and the loads hoisted). H200, T 8192, H 64, d 128: 4.7 ms (intra 3.9, WY 0.8) against
    8.9 ms for the single kernel. Transient memory: A and Tm, [rows, H, chunk] fp32 each."""
    T, H, dk = q.shape
    dv = v.shape[-1]
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    n_chunks = triton.cdiv(T, chunk)
    rows = n_chunks * chunk
    f32 = dict(dtype=torch.float32, device=q.device)
    keys = lambda: torch.empty(rows, H, dk, **f32)
    f = ChunkFactors(T, chunk, gamma=keys(), w=keys(), u=torch.empty(rows, H, dv, **f32), qg=keys(), kd=keys(),
                     aqk=torch.empty(rows, H, chunk, **f32))
    a = torch.empty(rows, H, chunk, **f32)
    tm = torch.empty(rows, H, chunk, **f32)
    _kda_chunk_intra_kernel[(n_chunks, H)](
        q, k, g, beta, f.gamma, a, tm, f.aqk, T, H=H, DK=dk, BT=chunk, BC=SUB_CHUNK, BK3=4, BKD=16,
        DOT=precision, num_warps=num_warps, num_stages=num_stages)
    bd = min(dk, dv, 32)
    _kda_chunk_wy_kernel[((dk + dv) // bd, n_chunks, H)](
        q, k, v, beta, f.gamma, tm, f.w, f.u, f.qg, f.kd, T, H=H, DK=dk, DV=dv, BT=chunk, BD=bd,
        DOT=precision, num_warps=4, num_stages=1)
    return f


def chunk_states(f: ChunkFactors, initial_state: torch.Tensor | None, block_v: int = 32,
                 num_warps: int = 4, num_stages: int = 1, precision: str = DOT_PRECISION) -> torch.Tensor:
    """States [n_chunks + 1, H, d_k, d_v] fp32: entry c is the state before chunk c, the last one
    the final state. Overwrites f.u with U'.

    The default tiles keep every program resident at once (sm_90, d = 128: 234 registers, 57 KB
    shared memory); a 2-stage pipeline needs 172 KB (BV = 32), one program per SM, two waves."""
    rows, H, dk = f.w.shape
    dv = f.u.shape[-1]
    n_chunks = rows // f.chunk
    bv = min(dv, block_v)
    states = torch.empty(n_chunks + 1, H, dk, dv, dtype=torch.float32, device=f.w.device)
    init = initial_state.contiguous() if initial_state is not None else states
    _kda_chunk_state_kernel[(dv // bv, H)](
        f.w, f.u, f.kd, f.gamma, init, states, n_chunks,
        H=H, DK=dk, DV=dv, BT=f.chunk, BV=bv, HAS_INIT=initial_state is not None, DOT=precision,
        num_warps=num_warps, num_stages=num_stages)
    return states


def chunk_output(f: ChunkFactors, states: torch.Tensor, out_dtype: torch.dtype,
                 precision: str = DOT_PRECISION) -> torch.Tensor:
    """o [T, H, d_v] after `chunk_states` (f.u holds U')."""
    rows, H, dk = f.w.shape
    dv = f.u.shape[-1]
    bv = min(dv, OUT_BLOCK_V)
    o = torch.empty(f.T, H, dv, dtype=out_dtype, device=f.w.device)
    _kda_chunk_output_kernel[(rows // f.chunk, H, dv // bv)](
        f.qg, f.aqk, f.u, states, o, f.T,
        H=H, DK=dk, DV=dv, BT=f.chunk, BV=bv, BK=min(dk, OUT_BLOCK_K), DOT=precision,
        num_warps=4, num_stages=2)
    return o


@triton.jit
def _kda_chunk_intra_kernel(q_ptr, k_ptr, g_ptr, beta_ptr, gamma_ptr, a_ptr, tm_ptr, aqk_ptr, T,
                            H: tl.constexpr, DK: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                            BK3: tl.constexpr, BKD: tl.constexpr, DOT: tl.constexpr):
    """One (chunk, head): Γ (the chunk's cumulative sum of g), then Aqk and Tm = (I - A)^{-1},
    BC x BC blocks at a time. Row block R:

        Tm_RR = (I - A_RR)^{-1},   Tm_RQ = Tm_RR Σ_{Q<=P<R} A_RP Tm_PQ   (Q < R)

    A's blocks go through a_ptr and Tm's through tm_ptr, both [rows, H, BT] and read back by the
    same program after a barrier (a few KB, cache-resident), so no register holds a whole
    chunk's matrix.
    A_R,<R is a product of two factors decayed to block R's first row, so both exponents are <= 0;
    A_RR is summed per key channel from exp(Γ_r - Γ_s) over the pairs s < r only, so it is exact
    for any g <= 0.
    """
    c = tl.program_id(0)
    h = tl.program_id(1)
    NC: tl.constexpr = BT // BC
    rc = tl.arange(0, BC)
    it = tl.arange(0, BT)
    id_ = tl.arange(0, BKD)
    lower = rc[:, None] > rc[None, :]
    chunk0 = c * BT
    rows_c = (chunk0 + it).to(tl.int64)
    valid_c = rows_c < T
    for i0 in range(0, DK, BKD):
        col = (rows_c[:, None] * H + h) * DK + i0 + id_[None, :]
        g = tl.load(g_ptr + col, mask=valid_c[:, None], other=0.0).to(tl.float32)
        tl.store(gamma_ptr + col, tl.cumsum(g, axis=0))
    tl.debug_barrier()  # Γ is read below across rows written by other threads
    for R in range(NC):
        rows = (chunk0 + R * BC + rc).to(tl.int64)
        valid = rows < T
        bx = tl.load(beta_ptr + rows * H + h, mask=valid, other=0.0).to(tl.float32)
        block_rows = (rows[:, None] * H + h) * BT  # row offsets into aqk, a and tm
        # A_RP and Aqk_RP for all P < R at once: [BC, BT] products over the key dim, BKD channels
        # at a time, both factors decayed to row R·BC; columns from R·BC on are masked to zero
        # before exponentiating (and not stored).
        if R > 0:
            ref = ((chunk0 + R * BC).to(tl.int64) * H + h) * DK
            earlier = it < R * BC
            kk = tl.zeros([BC, BT], dtype=tl.float32)
            qk = tl.zeros([BC, BT], dtype=tl.float32)
            for i0 in range(0, DK, BKD):
                col_r = (rows[:, None] * H + h) * DK + i0 + id_[None, :]
                col_s = (rows_c[:, None] * H + h) * DK + i0 + id_[None, :]
                gamma_ref = tl.load(gamma_ptr + ref + i0 + id_)[None, :]
                to_ref = tl.exp(tl.load(gamma_ptr + col_r) - gamma_ref)
                from_ref = tl.exp(tl.where(earlier[:, None], gamma_ref - tl.load(gamma_ptr + col_s),
                                           float("-inf")))
                k_r = tl.load(k_ptr + col_r, mask=valid[:, None], other=0.0).to(tl.float32) * to_ref
                q_r = tl.load(q_ptr + col_r, mask=valid[:, None], other=0.0).to(tl.float32) * to_ref
                k_s = tl.load(k_ptr + col_s, mask=valid_c[:, None], other=0.0).to(tl.float32) * from_ref
                kk += tl.dot(k_r, tl.trans(k_s), input_precision=DOT)
                qk += tl.dot(q_r, tl.trans(k_s), input_precision=DOT)
            tl.store(aqk_ptr + block_rows + it[None, :], qk, mask=earlier[None, :])
            tl.store(a_ptr + block_rows + it[None, :], -bx[:, None] * kk, mask=earlier[None, :])
        # Diagonal block: the pairs s < r exactly per key channel into A (through a_ptr) and Aqk,
        # Aqk's diagonal Σ_i q_r,i k_r,i, and zeros above it.
        r0 = ((chunk0 + R * BC).to(tl.int64) * H + h) * DK
        n_valid = T - chunk0 - R * BC
        r, s, kk_rs, qk_rs = _kda_diag_pairs(q_ptr, k_ptr, gamma_ptr, r0, n_valid, H, DK, BC, BK3)
        pair_rows = ((chunk0 + R * BC + r).to(tl.int64) * H + h) * BT + R * BC
        b_r = tl.load(beta_ptr + (chunk0 + R * BC + r).to(tl.int64) * H + h, mask=r < n_valid, other=0.0)
        tl.store(a_ptr + pair_rows + s, -b_r.to(tl.float32) * kk_rs, mask=r > s)
        tl.store(aqk_ptr + pair_rows + s, qk_rs, mask=r > s)
        qk_rr = tl.zeros([BC], dtype=tl.float32)
        for i0 in range(0, DK, BKD):
            col_r = (rows[:, None] * H + h) * DK + i0 + id_[None, :]
            k_r = tl.load(k_ptr + col_r, mask=valid[:, None], other=0.0).to(tl.float32)
            qk_rr += tl.sum(tl.load(q_ptr + col_r, mask=valid[:, None], other=0.0).to(tl.float32) * k_r, axis=1)
        tl.store(aqk_ptr + (rows * H + h) * BT + R * BC + rc, qk_rr)
        tl.store(aqk_ptr + block_rows + it[None, :], tl.zeros([BC, BT], dtype=tl.float32),
                 mask=it[None, :] > R * BC + rc[:, None])
        tl.debug_barrier()  # A_RR, written by other threads; such read-backs go through L2 (.cg)
        a_rr = tl.load(a_ptr + block_rows + R * BC + rc[None, :], mask=lower, other=0.0, cache_modifier=".cg")
        tm_rr = _unit_lower_inverse(a_rr, BC)
        tl.store(tm_ptr + block_rows + it[None, :], tl.zeros([BC, BT], dtype=tl.float32),
                 mask=(it >= R * BC + BC)[None, :])
        tl.store(tm_ptr + block_rows + R * BC + rc[None, :], tm_rr)
        tl.debug_barrier()  # A_RP and the Tm rows before block R, written by other threads
        for Q in range(R):
            acc = tl.zeros([BC, BC], dtype=tl.float32)
            for P in range(Q, R):
                rows_p = (chunk0 + P * BC + rc).to(tl.int64)
                a_rp = tl.load(a_ptr + block_rows + P * BC + rc[None, :], cache_modifier=".cg")
                tm_pq = tl.load(tm_ptr + (rows_p[:, None] * H + h) * BT + Q * BC + rc[None, :],
                                cache_modifier=".cg")
                acc += tl.dot(a_rp, tm_pq, input_precision=DOT)
            tl.store(tm_ptr + block_rows + Q * BC + rc[None, :], tl.dot(tm_rr, acc, input_precision=DOT))
        tl.debug_barrier()


@triton.jit
def _kda_chunk_wy_kernel(q_ptr, k_ptr, v_ptr, beta_ptr, gamma_ptr, tm_ptr, w_ptr, u_ptr, qg_ptr, kd_ptr, T,
                         H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr,
                         BD: tl.constexpr, DOT: tl.constexpr):
    """One (chunk, head, BD columns of [K | V]): W = Tm (K_β ⊙ exp(Γ)) with qg and kd, or U = Tm V_β."""
    j0 = tl.program_id(0) * BD  # fastest: the programs of one chunk read its Tm while it is in L2
    c = tl.program_id(1)
    h = tl.program_id(2)
    it = tl.arange(0, BT)
    jd = tl.arange(0, BD)
    rows = (c * BT + it).to(tl.int64)
    valid = (rows < T)[:, None]
    tm = tl.load(tm_ptr + (rows[:, None] * H + h) * BT + it[None, :])
    bx = tl.load(beta_ptr + rows * H + h, mask=rows < T, other=0.0).to(tl.float32)[:, None]
    if j0 < DK:
        key_off = (rows[:, None] * H + h) * DK + j0 + jd[None, :]
        last = ((c * BT + BT - 1).to(tl.int64) * H + h) * DK + j0 + jd
        gam = tl.load(gamma_ptr + key_off)
        kx = tl.load(k_ptr + key_off, mask=valid, other=0.0).to(tl.float32)
        qx = tl.load(q_ptr + key_off, mask=valid, other=0.0).to(tl.float32)
        tl.store(qg_ptr + key_off, qx * tl.exp(gam))
        tl.store(kd_ptr + key_off, kx * tl.exp(tl.load(gamma_ptr + last)[None, :] - gam))
        tl.store(w_ptr + key_off, tl.dot(tm, kx * bx * tl.exp(gam), input_precision=DOT))
    else:
        val_off = (rows[:, None] * H + h) * DV + j0 - DK + jd[None, :]
        vx = tl.load(v_ptr + val_off, mask=valid, other=0.0).to(tl.float32)
        tl.store(u_ptr + val_off, tl.dot(tm, vx * bx, input_precision=DOT))


@triton.jit
def _kda_diag_pairs(q_ptr, k_ptr, gamma_ptr, r0, n_valid, H: tl.constexpr, DK: tl.constexpr,
                    BC: tl.constexpr, BK3: tl.constexpr):
    """Σ_i x_r,i k_s,i exp(Γ_r,i - Γ_s,i) for the pairs s < r of one row block, x = k and x = q,
    BK3 key channels at a time: returns r, s and both sums, [BC²/2] each (the BC(BC-1)/2 pairs,
    then BC/2 repeats of the pair (0, 0) to mask). Pair p = r(r-1)/2 + s. The pointers are at
    the head's channel 0 of the block's first row r0; n_valid of its rows exist. Only pairs
    below the diagonal are computed, each by one thread over whole channel runs: no exponent
    above 0, no shuffles, 32-bit offsets."""
    p = tl.arange(0, BC * BC // 2)
    r = tl.zeros([BC * BC // 2], dtype=tl.int32)
    for j in tl.static_range(1, BC):
        r += (p >= j * (j - 1) // 2).to(tl.int32)
    s = p - r * (r - 1) // 2
    pair = s < r
    r = tl.where(pair, r, 0)
    s = tl.where(pair, s, 0)
    ic = tl.arange(0, BK3)
    at_r = (r * (H * DK))[:, None] + ic[None, :]
    at_s = (s * (H * DK))[:, None] + ic[None, :]
    in_r = (r < n_valid)[:, None]
    in_s = (s < n_valid)[:, None]
    g_ptr = gamma_ptr + r0
    kk = tl.zeros([BC * BC // 2], dtype=tl.float32)
    qk = tl.zeros([BC * BC // 2], dtype=tl.float32)
    for i0 in range(0, DK, BK3):
        ks = tl.load(k_ptr + r0 + at_s + i0, mask=in_s, other=0.0).to(tl.float32)
        ks *= tl.exp(tl.load(g_ptr + at_r + i0) - tl.load(g_ptr + at_s + i0))
        kk += tl.sum(tl.load(k_ptr + r0 + at_r + i0, mask=in_r, other=0.0).to(tl.float32) * ks, axis=1)
        qk += tl.sum(tl.load(q_ptr + r0 + at_r + i0, mask=in_r, other=0.0).to(tl.float32) * ks, axis=1)
    return r, s, kk, qk


@triton.jit
def _unit_lower_inverse(a, BC: tl.constexpr):
    """(I - a)^{-1} for a strictly lower [BC, BC], by forward substitution: row r = e_r + Σ_{s<r} a[r, s] row s."""
    rc = tl.arange(0, BC)
    tm = tl.where(rc[:, None] == rc[None, :], 1.0, 0.0)
    for r in range(1, BC):
        a_r = tl.sum(tl.where(rc[:, None] == r, a, 0.0), axis=0)
        tm = tl.where(rc[:, None] == r, tm + tl.sum(a_r[:, None] * tm, axis=0)[None, :], tm)
    return tm


@triton.jit
def _kda_chunk_state_kernel(w_ptr, u_ptr, kd_ptr, gamma_ptr, init_ptr, states_ptr, n_chunks,
                            H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr,
                            BV: tl.constexpr, HAS_INIT: tl.constexpr, DOT: tl.constexpr):
    """One (value tile, head), chunk after chunk, with S [d_k, BV] in registers:

        states[c] = S;   U' = U - W S;   S <- diag(exp(Γ_last)) S + (K ⊙ exp(Γ_last - Γ))^T U'
    """
    h = tl.program_id(1)
    ik = tl.arange(0, DK)
    jv = tl.program_id(0) * BV + tl.arange(0, BV)
    it = tl.arange(0, BT)
    s_off = h * DK * DV + ik[:, None] * DV + jv[None, :]
    if HAS_INIT:
        S = tl.load(init_ptr + s_off)
    else:
        S = tl.zeros([DK, BV], dtype=tl.float32)
    for c in range(n_chunks):
        tl.store(states_ptr + tl.cast(c, tl.int64) * (H * DK * DV) + s_off, S)
        rows = (c * BT + it).to(tl.int64)
        wc = tl.load(w_ptr + (rows[:, None] * H + h) * DK + ik[None, :])
        kd = tl.load(kd_ptr + (rows[:, None] * H + h) * DK + ik[None, :])
        u_off = (rows[:, None] * H + h) * DV + jv[None, :]
        u_new = tl.load(u_ptr + u_off) - tl.dot(wc, S, input_precision=DOT)
        tl.store(u_ptr + u_off, u_new)
        last = tl.cast(c * BT + BT - 1, tl.int64)
        decay_last = tl.exp(tl.load(gamma_ptr + (last * H + h) * DK + ik))
        S = S * decay_last[:, None] + tl.dot(tl.trans(kd), u_new, input_precision=DOT)
    tl.store(states_ptr + tl.cast(n_chunks, tl.int64) * (H * DK * DV) + s_off, S)


@triton.jit
def _kda_chunk_output_kernel(qg_ptr, aqk_ptr, u_ptr, states_ptr, o_ptr, T,
                             H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr,
                             BV: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr):
    """One (chunk, head, value tile): O = (Q ⊙ exp(Γ)) S_c + Aqk U'."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    jv = tl.program_id(2) * BV + tl.arange(0, BV)
    it = tl.arange(0, BT)
    ib = tl.arange(0, BK)
    rows = (c * BT + it).to(tl.int64)
    state0 = states_ptr + (c.to(tl.int64) * H + h) * DK * DV
    o = tl.zeros([BT, BV], dtype=tl.float32)
    for i0 in range(0, DK, BK):
        qg = tl.load(qg_ptr + (rows[:, None] * H + h) * DK + i0 + ib[None, :])
        s = tl.load(state0 + (i0 + ib[:, None]) * DV + jv[None, :])
        o += tl.dot(qg, s, input_precision=DOT)
    aqk = tl.load(aqk_ptr + (rows[:, None] * H + h) * BT + it[None, :])
    u_new = tl.load(u_ptr + (rows[:, None] * H + h) * DV + jv[None, :])
    o += tl.dot(aqk, u_new, input_precision=DOT)
    tl.store(o_ptr + (rows[:, None] * H + h) * DV + jv[None, :], o.to(o_ptr.dtype.element_ty),
             mask=(rows < T)[:, None])


# ---------------------------------------------------------------- argument checks

def _check_qkvgb(q, k, v, g, beta, rows: str) -> tuple[int, int, int, int]:
    """Both KDA kernels' inputs: q, k, g [N, H, d_k], v [N, H, d_v], beta [N, H]; `rows` names N."""
    if q.dim() != 3:
        raise ValueError(f"q must be [{rows}, H, d_k], got {tuple(q.shape)}")
    N, H, dk = q.shape
    for name, x, shape in (("k", k, (N, H, dk)), ("g", g, (N, H, dk)), ("beta", beta, (N, H))):
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} shape {tuple(x.shape)} does not match q {tuple(q.shape)}: expected {shape}")
    if v.dim() != 3 or tuple(v.shape[:2]) != (N, H):
        raise ValueError(f"v shape {tuple(v.shape)} does not match q {tuple(q.shape)}: expected ({N}, {H}, d_v)")
    return N, H, dk, v.shape[-1]


def _check_step(q, k, v, g, beta, state, slots) -> None:
    B, H, dk, dv = _check_qkvgb(q, k, v, g, beta, "B")
    if state.dim() != 4 or tuple(state.shape[1:]) != (H, dk, dv):
        raise ValueError(f"state shape {tuple(state.shape)}: expected (num_slots, {H}, {dk}, {dv})")
    if tuple(slots.shape) != (B,):
        raise ValueError(f"slots shape {tuple(slots.shape)}: expected ({B},)")


def _check_prefill(q, k, v, g, beta, initial_state) -> tuple[int, int, int, int]:
    T, H, dk, dv = _check_qkvgb(q, k, v, g, beta, "T")
    if T == 0:
        raise ValueError("q has no tokens (T = 0)")
    if initial_state is not None:
        if tuple(initial_state.shape) != (H, dk, dv):
            raise ValueError(f"initial_state shape {tuple(initial_state.shape)}: expected ({H}, {dk}, {dv})")
        if initial_state.dtype != torch.float32:
            raise ValueError(f"initial_state must be fp32, got {initial_state.dtype}")
    return T, H, dk, dv


def _check_block_n(block_n: int) -> None:
    if block_n not in (16, 32, 64, 128):
        raise ValueError(f"block_n must be 16, 32, 64 or 128, got {block_n}")


def _out_buffer(out: torch.Tensor | None, shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new result tensor, or the caller's `out` (a static buffer for CUDA graphs) once it fits."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if out.shape != shape or out.dtype != dtype or not out.is_contiguous():
        name = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, str(dtype))
        raise ValueError(f"out must be contiguous {name} {shape}, got {out.dtype} {tuple(out.shape)}")
    return out


def _check_pow2(name: str, n: int) -> None:
    if n < 16 or n & (n - 1):
        raise ValueError(f"{name} = {n}: the Triton kernels need a power of two >= 16")


@triton.jit
def _cast(x, DT: tl.constexpr):
    # fp32 -> DT rounding to nearest even. bf16 by hand: the CPU interpreter truncates (numpy has no
    # bf16) where the GPU's conversion rounds; the bit form gives the GPU's result on both.
    if DT == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DT)


# ================================================================ FP8 block-128: GEMV, dequantization
# W [n, k] float8_e4m3fn, scale_inv [ceil(n/128), ceil(k/128)] fp32, W_real = W * scale_inv[i//128,
# j//128]. y = x · W_real^T. Every e4m3 value and every bf16 / fp16 activation is exact in fp32 (and
# in tf32), so each product w * x is exact and the sums are fp32: the only rounding beyond the twin's
# is the order of the fp32 sums. Each 128-wide k block's dot product is summed first, then multiplied
# by its scale. Two kernels, picked by the number of rows m:
#   m <= FP8_FMA_ROWS (decode at batch 1..3): `_fp8_gemv_fma_kernel`, no tensor cores. A program owns
#   BN output features (one thread holds all BN of them) and loops over chunks of KB = 4 * num_warps
#   k blocks; each thread loads 16 consecutive weight bytes of each of its BN rows (128-bit loads),
#   converts them (e4m3x2 -> f16x2 -> fp32) and multiplies them with the 16 activations of the same
#   k positions (fp32, in registers, loaded once per chunk for all BN rows) in a chain of fp32 FMAs
#   in that thread. KB = 4 * num_warps makes the activations' load layout the weights' one (32 lanes x
#   num_warps warps along k), so no layout conversion through shared memory. Issue budget: 4.8 TB/s
#   over 132 SMs at 1.98 GHz is 18.4 weight bytes per clock per SM, at 4 warp instructions per clock
#   7.0 warp instructions per 32 bytes. The loop takes 3.05 at 1 row, 4.3 at 2, 5.6 at 3, 6.9 at 4
#   with block_n 8 (2.9, 4.1, 5.3, 6.4 with 16; triton 3.6 SASS for sm_90: per weight half an
#   e4m3x2 -> f16x2 conversion, an f16 -> fp32 one and one FMA per row), against 4.0 for the
#   tensor-core kernel at any row count. H200 sweep (session 5, `.whl_fp8_sweep.py`, CUDA graphs,
#   weights cycled past the L2): at 1 row 0.69-0.87x the tensor-core kernel's best time on the
#   model's 11 shapes (sum 266 vs 315 us, floor 220), best with 4 warps on most; at 2 rows 0.77-0.92x;
#   at 3 rows 0.84-1.01x; at 4 rows 0.97-1.28x, so FP8_FMA_ROWS is 3;
#   more rows: `_fp8_gemv_mma_kernel`, 16 activation rows (padded) per launch, the smallest tl.dot,
#   tf32 (the weight tile goes to the tensor cores as fp32 through shared memory).
# Both split k over programs: each stores its fp32 partial sums in its own slab; the last program of a
# column block to arrive adds the slabs in split order (deterministic), rounds once to the output dtype
# and resets the block's arrival counter (one launch, no host sync).

FP8_BLOCK = 128
FP8_GEMV_ROWS = 16
FP8_FMA_ROWS = 3
_FP8_ARRIVALS: dict[tuple[torch.device, int], torch.Tensor] = {}


@triton.jit
def _fp8_finish(y, out_ptr, part_ptr, arrivals_ptr, pid_n, pid_k, m, n, split, MP: tl.constexpr, BN: tl.constexpr):
    # y [MP, BN] fp32: this program's sums for rows 0..m-1, columns pid_n * BN + 0..BN-1.
    rows = tl.arange(0, MP)
    cols = pid_n * BN + tl.arange(0, BN)
    inside = (rows[:, None] < m) & (cols[None, :] < n)
    out = out_ptr + rows[:, None] * n + cols[None, :]
    if split == 1:
        tl.store(out, _cast(y, out_ptr.dtype.element_ty), mask=inside)
    else:
        slab = part_ptr + rows[:, None] * n + cols[None, :]
        tl.store(slab + pid_k * m * n, y, mask=inside)
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr + pid_n, 1, sem="acq_rel")
        if arrived == split - 1:
            total = tl.zeros([MP, BN], tl.float32)
            for p in range(0, split):
                # .cg: read at L2, where the other programs' stores are, never a stale L1 line.
                total += tl.load(slab + p * m * n, mask=inside, other=0.0, cache_modifier=".cg")
            tl.store(out, _cast(total, out_ptr.dtype.element_ty), mask=inside)
            tl.store(arrivals_ptr + pid_n, 0)


@triton.jit
def _fp8_gemv_mma_kernel(x_ptr, w_ptr, s_ptr, out_ptr, part_ptr, arrivals_ptr, m, n, k, k_blocks, blocks_per_split,
                         split, BN: tl.constexpr, MP: tl.constexpr, STAGES: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, MP)
    cols = pid_n * BN + tl.arange(0, BN)
    kk = tl.arange(0, 128)
    scale_row = (pid_n * BN) // 128
    acc = tl.zeros([MP, BN], tl.float32)
    first = pid_k * blocks_per_split
    last = tl.minimum(first + blocks_per_split, k_blocks)
    for b in tl.range(first, last, num_stages=STAGES):
        ks = b * 128 + kk
        x = tl.load(x_ptr + rows[:, None] * k + ks[None, :], mask=(rows[:, None] < m) & (ks[None, :] < k),
                    other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * k + ks[None, :],
                    mask=(cols[:, None] < n) & (ks[None, :] < k), other=0.0).to(tl.float32)
        s = tl.load(s_ptr + scale_row * k_blocks + b)
        acc += tl.dot(x, tl.trans(w), input_precision="tf32") * s
    _fp8_finish(acc, out_ptr, part_ptr, arrivals_ptr, pid_n, pid_k, m, n, split, MP, BN)


@triton.jit
def _fp8_row_dots(wa, wb, x_ptr, k0, k, G: tl.constexpr, K_TAIL: tl.constexpr):
    # [BN, G]: per row of W and group of 16 k, the sum of the 16 exact products with one activation
    # row, one thread's chain of FMAs. The activations are loaded as the group's first and last 8 (16
    # bytes per thread, as wa / wb hold the weights), which lands them in the weights' layout; joined
    # back, the 16 products reduce in one chain (1 multiply, 15 FMAs).
    ka = k0 + tl.arange(0, G)[:, None] * 16 + tl.arange(0, 8)[None, :]
    if K_TAIL:
        xa = tl.load(x_ptr + ka, mask=ka < k, other=0.0)
        xb = tl.load(x_ptr + ka + 8, mask=ka + 8 < k, other=0.0)
    else:
        xa = tl.load(x_ptr + ka)
        xb = tl.load(x_ptr + ka + 8)
    products = tl.join(wa, wb) * tl.join(xa, xb).to(tl.float32)[None, :, :, :]
    return tl.sum(tl.reshape(products, [products.shape[0], G, 16]), axis=2)


@triton.jit
def _fp8_gemv_fma_kernel(x_ptr, w_ptr, s_ptr, out_ptr, part_ptr, arrivals_ptr, m, n, k, k_blocks, chunks_per_split,
                         split, BN: tl.constexpr, KB: tl.constexpr, ROWS: tl.constexpr, K_TAIL: tl.constexpr,
                         STAGES: tl.constexpr):
    # ROWS (1..4) activation rows, one accumulator each; K_TAIL: k is not a whole number of chunks,
    # so the loads are masked (the model's shapes are not). STAGES > 1 prefetches chunks through
    # shared memory (cp.async: ~10% more instructions, more bytes in flight per warp); 1 keeps them
    # in registers.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    G: tl.constexpr = KB * 8
    # Features past n read the last row again (valid memory) and are dropped at the store: no mask.
    feats = tl.minimum(pid_n * BN + tl.arange(0, BN), n - 1)
    kc = tl.arange(0, KB * 128)
    groups = tl.arange(0, G)
    scale_row = (pid_n * BN) // 128
    acc0 = tl.zeros([BN, G], tl.float32)
    acc1 = tl.zeros([BN, G], tl.float32)
    acc2 = tl.zeros([BN, G], tl.float32)
    acc3 = tl.zeros([BN, G], tl.float32)
    first = pid_k * chunks_per_split
    last = tl.minimum(first + chunks_per_split, tl.cdiv(k_blocks, KB))
    for c in tl.range(first, last, num_stages=STAGES):
        k0 = c * (KB * 128)
        w_ptrs = w_ptr + feats[:, None].to(tl.int64) * k + (k0 + kc)[None, :]
        if K_TAIL:
            w = tl.load(w_ptrs, mask=(k0 + kc)[None, :] < k, other=0.0)
        else:
            w = tl.load(w_ptrs)
        wa, wb = tl.split(tl.permute(tl.reshape(w, [BN, G, 2, 8]), [0, 1, 3, 2]))
        wa = wa.to(tl.float32)
        wb = wb.to(tl.float32)
        blk = c * KB + groups // 8
        s = tl.load(s_ptr + scale_row * k_blocks + blk, mask=blk < k_blocks, other=0.0)[None, :]
        acc0 += _fp8_row_dots(wa, wb, x_ptr, k0, k, G, K_TAIL) * s
        if ROWS > 1:
            acc1 += _fp8_row_dots(wa, wb, x_ptr + k, k0, k, G, K_TAIL) * s
        if ROWS > 2:
            acc2 += _fp8_row_dots(wa, wb, x_ptr + 2 * k, k0, k, G, K_TAIL) * s
        if ROWS > 3:
            acc3 += _fp8_row_dots(wa, wb, x_ptr + 3 * k, k0, k, G, K_TAIL) * s
    # [4, BN], row r = acc_r summed over its groups (tl.join stacks along a new last axis).
    y = tl.join(tl.join(tl.sum(acc0, axis=1), tl.sum(acc2, axis=1)), tl.join(tl.sum(acc1, axis=1), tl.sum(acc3, axis=1)))
    y = tl.trans(tl.reshape(y, [BN, 4]))
    _fp8_finish(y, out_ptr, part_ptr, arrivals_ptr, pid_n, pid_k, m, n, split, 4, BN)


def _fp8_arrivals(device: torch.device, n_tiles: int) -> torch.Tensor:
    # Per-column-block arrival counters. The kernel leaves them zeroed, so they are allocated once per
    # (device, n_tiles) and never freed: CUDA graphs captured with them keep valid addresses. Two
    # launches must not run at once (one stream, or streams joined in between).
    key = (device, n_tiles)
    if key not in _FP8_ARRIVALS:
        _FP8_ARRIVALS[key] = torch.zeros(n_tiles, dtype=torch.int32, device=device)
    return _FP8_ARRIVALS[key]


def _fp8_default_split(device: torch.device, programs: int, parts: int, target: int) -> int:
    # Double the split of `parts` (k blocks or chunks) while that keeps at most `target` programs
    # (warps, for the FMA kernel) per SM; more splits only add partial sums to reduce.
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    split = 1
    while 2 * split <= parts and programs * 2 * split <= target * sms:
        split *= 2
    return split


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, out: torch.Tensor | None = None,
             *, block_n: int | None = None, split_k: int | None = None, num_warps: int | None = None,
             num_stages: int | None = None) -> torch.Tensor:
    """y = x · (weight ⊙ scale_inv)^T for x [m, k] bf16 / fp16 (any m).

    weight [n, k] float8_e4m3fn, scale_inv [ceil(n/128), ceil(k/128)] fp32; y [m, n] in x's dtype.
    Twin: `fp8.FP8Linear` on CPU (dequantize, then matmul). m <= FP8_FMA_ROWS runs the FMA kernel
    (block_n: output features per program, 8 or 16, default 8; num_warps 1, 2 or 4, default 4 at one
    row and 1 at more (the H200 sweep's best on most shapes), each
    program covering 4 * num_warps k blocks per loop step; num_stages default 1), more rows the
    tensor-core kernel, 16 rows per launch (block_n divides 128, default 128; num_warps default 4;
    num_stages default 4). split_k: programs
    along k (k blocks for the tensor-core kernel, chunks of 4 * num_warps blocks for the FMA one);
    None picks by SM count. The tensor-core defaults come from an H200 sweep at the full model's 11
    shapes, batch 1 (`.whl/s4_fp8_sweep.py`, CUDA graphs): 128 features and 4 stages took 0.85-0.95x
    the time of 64 and 3 on the k-long shapes (o_proj 4096x16384: 22.0 vs 26.0 µs), ~0.93x on the
    24576-row ones, the same on the rest.
    """
    if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"weight must be float8_e4m3fn [n, k], got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    grid_shape = (triton.cdiv(n, FP8_BLOCK), triton.cdiv(k, FP8_BLOCK))
    if tuple(scale_inv.shape) != grid_shape or scale_inv.dtype != torch.float32:
        raise ValueError(f"scale_inv must be fp32 {grid_shape} for weight {tuple(weight.shape)}, "
                         f"got {scale_inv.dtype} {tuple(scale_inv.shape)}")
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"x must be bf16 or fp16 [m, {k}], got {x.dtype} {tuple(x.shape)}")
    m = x.shape[0]
    out = _out_buffer(out, (m, n), x.dtype, x.device)
    x, weight, scale_inv = x.contiguous(), weight.contiguous(), scale_inv.contiguous()
    if m <= FP8_FMA_ROWS:
        warps = num_warps or (4 if m == 1 else 1)
        _fp8_gemv_fma(x, weight, scale_inv, out, block_n or 8, split_k, warps, num_stages or 1)
    else:
        _fp8_gemv_mma(x, weight, scale_inv, out, block_n or 128, split_k, num_warps or 4, num_stages or 4)
    return out


def _fp8_gemv_fma(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, out: torch.Tensor,
                  block_n: int, split_k: int | None, num_warps: int, num_stages: int) -> None:
    if block_n not in (8, 16):
        raise ValueError(f"block_n must be 8 or 16 for {x.shape[0]} rows (the FMA kernel), got {block_n}")
    if num_warps not in (1, 2, 4):
        raise ValueError(f"num_warps must be 1, 2 or 4 for {x.shape[0]} rows (the FMA kernel), got {num_warps}")
    m, k = x.shape
    n = weight.shape[0]
    kb, k_blocks = 4 * num_warps, triton.cdiv(k, FP8_BLOCK)
    n_tiles, chunks = triton.cdiv(n, block_n), triton.cdiv(k_blocks, kb)
    split = split_k or _fp8_default_split(x.device, n_tiles * num_warps, chunks, 16)
    if not 1 <= split <= chunks:
        raise ValueError(f"split_k {split} must lie in 1..{chunks} (the chunks of {kb} k blocks)")
    per_split = triton.cdiv(chunks, split)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    _fp8_gemv_fma_kernel[(n_tiles, split)](
        x, weight, scale_inv, out, part, _fp8_arrivals(x.device, n_tiles), m, n, k, k_blocks, per_split, split,
        BN=block_n, KB=kb, ROWS=m, K_TAIL=k % (kb * FP8_BLOCK) != 0, STAGES=num_stages, num_warps=num_warps)


def _fp8_gemv_mma(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, out: torch.Tensor,
                  block_n: int, split_k: int | None, num_warps: int, num_stages: int) -> None:
    _check_block_n(block_n)
    m, k = x.shape
    n = weight.shape[0]
    n_tiles, k_blocks = triton.cdiv(n, block_n), triton.cdiv(k, FP8_BLOCK)
    split = split_k or _fp8_default_split(x.device, n_tiles, k_blocks, 2)
    if not 1 <= split <= k_blocks:
        raise ValueError(f"split_k {split} must lie in 1..{k_blocks} (the k blocks of 128)")
    per_split = triton.cdiv(k_blocks, split)
    arrivals = _fp8_arrivals(x.device, n_tiles)
    for row in range(0, m, FP8_GEMV_ROWS):
        rows = min(FP8_GEMV_ROWS, m - row)
        target = out[row:row + rows]
        # One fp32 slab of partial sums per split; a single split writes the output directly.
        part = torch.empty((split, rows, n), dtype=torch.float32, device=x.device) if split > 1 else target
        _fp8_gemv_mma_kernel[(n_tiles, split)](
            x[row:row + rows], weight, scale_inv, target, part, arrivals, rows, n, k, k_blocks,
            per_split, split, BN=block_n, MP=FP8_GEMV_ROWS, STAGES=num_stages, num_warps=num_warps)


@triton.jit
def _fp8_dequantize_kernel(w_ptr, s_ptr, out_ptr, n, k, k_blocks, BN: tl.constexpr):
    # One program: BN rows x 128 columns inside one scale block, so one scale. The fp32 product is
    # the twin's, rounded once to the output dtype: bit-identical, one read of W and one write.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BN + tl.arange(0, BN)
    cols = pid_k * 128 + tl.arange(0, 128)
    inside = (rows[:, None] < n) & (cols[None, :] < k)
    offsets = rows[:, None].to(tl.int64) * k + cols[None, :]
    w = tl.load(w_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + ((pid_n * BN) // 128) * k_blocks + pid_k)
    tl.store(out_ptr + offsets, _cast(w * s, out_ptr.dtype.element_ty), mask=inside)


def fp8_dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                   *, block_n: int = 64, num_warps: int = 4) -> torch.Tensor:
    """W = weight ⊙ scale_inv per 128 x 128 block, [n, k] in dtype (bf16 or fp16), in one pass.

    weight [n, k] float8_e4m3fn, scale_inv [ceil(n/128), ceil(k/128)] fp32. Twin (bit for bit):
    `fp8.dequantize_fp8_block`, which goes through a full fp32 copy. block_n (rows per program,
    divides 128) and num_warps are launch tuning.
    """
    if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"weight must be float8_e4m3fn [n, k], got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    grid_shape = (triton.cdiv(n, FP8_BLOCK), triton.cdiv(k, FP8_BLOCK))
    if tuple(scale_inv.shape) != grid_shape or scale_inv.dtype != torch.float32:
        raise ValueError(f"scale_inv must be fp32 {grid_shape} for weight {tuple(weight.shape)}, "
                         f"got {scale_inv.dtype} {tuple(scale_inv.shape)}")
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype}")
    _check_block_n(block_n)
    weight, scale_inv = weight.contiguous(), scale_inv.contiguous()
    out = torch.empty((n, k), dtype=dtype, device=weight.device)
    _fp8_dequantize_kernel[(triton.cdiv(n, block_n), grid_shape[1])](
        weight, scale_inv, out, n, k, grid_shape[1], BN=block_n, num_warps=num_warps)
    return out


# ================================================================ fp32-accurate x · wᵀ for bf16 rows
# y = x · wᵀ in fp32 for bf16 x [m, k] and fp32 w [n, k] (at prefill's thousands of rows: the router's
# logits, §4.5, and the DSA indexer's head weights, §4.4), on bf16 tensor cores instead of fp32 FMA.
# w splits exactly into three bf16 parts, w = w1 + w2 + w3: w1 is w's top 8 significant bits (the
# fp32 bits & 0xFFFF0000), w2 the top 8 of the exact remainder w - w1, w3 = w - w1 - w2 the last 8
# at most, so bf16 holds each. A bf16 x bf16 product is exact in fp32 (8 + 8 significant bits) and
# the products are summed in fp32, so y is x.float() @ w.T up to the order (and, on tensor cores,
# the rounding mode) of fp32 sums. Two TF32 parts (11 + 11 bits) cannot hold fp32's 24; bf16 tensor
# cores run at twice the TF32 rate, so the three products cost one and a half TF32 ones. For weights
# stored as bf16 (the checkpoint's router and indexer) w2 = w3 = 0. Measured on the H200 (triton 3.6,
# 8192 x 4096 bf16 rows, `.whl/s4_micro.py`): 222 µs against torch's fp32 GEMM's 565 µs for the
# router's 288 outputs, 55 vs 184 µs for the indexer's 32; error 2.0e-6 of Σ|x||w| (torch 1.4e-7):
# the tensor cores add in fp32 but truncate the aligned addends, so w3 mostly vanishes there.


@triton.jit
def _bf16_fp32_linear_kernel(x_ptr, w_ptr, y_ptr, m, n, k, BM: tl.constexpr, BN: tl.constexpr,
                             BK: tl.constexpr, STAGES: tl.constexpr, TC: tl.constexpr):
    pid_n = tl.program_id(0)  # fastest: the programs sharing a block of x rows run together
    pid_m = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    kk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in tl.range(0, k, BK, num_stages=STAGES):
        ks = k0 + kk
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * k + ks[None, :],
                    mask=(rows[:, None] < m) & (ks[None, :] < k), other=0.0)
        w = tl.load(w_ptr + cols[:, None] * k + ks[None, :], mask=(cols[:, None] < n) & (ks[None, :] < k),
                    other=0.0)
        w1 = (w.to(tl.uint32, bitcast=True) & 0xFFFF0000).to(tl.float32, bitcast=True)
        rest = w - w1
        w2 = (rest.to(tl.uint32, bitcast=True) & 0xFFFF0000).to(tl.float32, bitcast=True)
        w3 = rest - w2
        acc += _dot_bf16(x, tl.trans(w3.to(tl.bfloat16)), TC)
        acc += _dot_bf16(x, tl.trans(w2.to(tl.bfloat16)), TC)
        acc += _dot_bf16(x, tl.trans(w1.to(tl.bfloat16)), TC)
    tl.store(y_ptr + rows[:, None].to(tl.int64) * n + cols[None, :], acc,
             mask=(rows[:, None] < m) & (cols[None, :] < n))


def bf16_fp32_linear(x: torch.Tensor, w: torch.Tensor, *, block_m: int = 64, block_n: int = 32,
                     block_k: int = 64, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """y = x.float() @ w.T, fp32 [m, n], for x bf16 [m, k] and w fp32 [n, k], on bf16 tensor cores.

    Twin: that torch expression (fp32 FMA); the two differ only in how the fp32 sums are ordered and
    rounded (see the section comment).
    block_m / block_n / block_k (powers of two >= 16), num_warps and num_stages are launch tuning.
    """
    if x.dim() != 2 or x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bf16 [m, k], got {x.dtype} {tuple(x.shape)}")
    if w.dim() != 2 or w.dtype != torch.float32 or w.shape[1] != x.shape[1]:
        raise ValueError(f"w must be fp32 [n, {x.shape[1]}] for x {tuple(x.shape)}, got {w.dtype} {tuple(w.shape)}")
    for name, size in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        _check_pow2(name, size)
    (m, k), n = x.shape, w.shape[0]
    y = torch.empty((m, n), dtype=torch.float32, device=x.device)
    if m == 0:
        return y
    x, w = x.contiguous(), w.contiguous()
    _bf16_fp32_linear_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
        x, w, y, m, n, k, BM=block_m, BN=block_n, BK=block_k, STAGES=num_stages, TC=x.is_cuda,
        num_warps=num_warps)
    return y


# ================================================================ decode-step kernels: mHC (§4.2)
# hc_pre for B rows of streams X [B, hc, D]: m = (X_flat · fnᵀ) · r with r = rsqrt(mean(X_flat²) + eps),
# then pre / post / the Sinkhorn matrix C from m, u = Σ_i pre_i X_i rounded to X's dtype, and the
# sub-layer's RMSNorm of u. Three launches. The mix splits the 16384-long dot products (and Σ x²)
# over S programs along n_in, one partial sum per row and split: `_hc_mix_kernel` (BR rows per
# program, fp32 FMA) for the decode step's few rows and for fp32 X; `_hc_mix_dot_kernel` (tiles of
# BM rows on the tensor cores, fp32-level) from HC_DOT_MIN_ROWS 16-bit rows on (prefill chunks).
# In `_hc_pre_kernel`, parallel over blocks of D, every program adds those partial sums and computes
# pre itself (cheaper than another launch; the first program of a row also computes post and C),
# then its block of u and the block's Σ u²; `_hc_norm_kernel` adds the Σ u² partial sums and applies
# the RMSNorm to its block. Partial sums are added in a fixed order: deterministic. `_hc_pre_kernel`
# runs one warp per program: the 39 normalizations of the 4x4 Sinkhorn matrix are a serial chain of
# reductions, which with 4 warps cross warps through shared memory (H200, one decode row: 7.4 us a
# call with 4 warps, 4.7 with one; 4.3 with 4 warps and a single Sinkhorn iteration).
# `_hc_post_kernel`: X'_j = post_j y + Σ_i C[i, j] X_i. `hc_post_pre`: a sub-layer's hc_post and the
# next one's hc_pre (the decode step's order), the post and the mix in one launch.

HC_MIX_BLOCK = 256
HC_MIX_ROWS = 16
HC_POST_MIX_BLOCK = 64  # columns of each of the hc streams a program of `_hc_post_mix_kernel` takes
HC_DOT_MIN_ROWS = 64
HC_DOT_ROWS = 64
HC_DOT_BLOCK = 64
HC_DOT_SPLIT = 1024
HC_BLOCK = 512


@triton.jit
def _hc_mix_kernel(x_ptr, fn_ptr, part_ptr, sq_ptr, B, n_in, n_out, S, NP: tl.constexpr, BK: tl.constexpr,
                   BR: tl.constexpr):
    # BR rows per program share each load of fn (a prefill chunk has thousands of rows; fn is 1.5 MB);
    # each row's sums are the one-row kernel's, in fp32 FMA (tl.dot may round its inputs to TF32)
    s = tl.program_id(1)
    k = s * BK + tl.arange(0, BK)
    inside = k < n_in
    o = tl.arange(0, NP)
    fn = tl.load(fn_ptr + o[:, None] * n_in + k[None, :], mask=(o[:, None] < n_out) & inside[None, :], other=0.0)
    for i in tl.static_range(BR):
        b = tl.program_id(0) * BR + i
        if b < B:
            x = tl.load(x_ptr + b * n_in + k, mask=inside, other=0.0).to(tl.float32)
            tl.store(part_ptr + (b * S + s) * NP + o, tl.sum(fn * x[None, :], axis=1))
            tl.store(sq_ptr + b * S + s, tl.sum(x * x, axis=0))


@triton.jit
def _tf32(v):
    # v rounded to the nearest TF32 value (10 mantissa bits, ties away from zero), as fp32 bits.
    return ((v.to(tl.int32, bitcast=True) + 0x1000) & -0x2000).to(tl.float32, bitcast=True)


@triton.jit
def _hc_mix_dot_kernel(x_ptr, fn_ptr, part_ptr, sq_ptr, B, n_in, n_out, S, steps,
                       NP: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    # fp32-level sums on TF32 tensor cores. x (bf16 or fp16) is a TF32 value. fn = fn_hi + fn_lo + e
    # with both parts TF32 values, so every product x·fn_hi, x·fn_lo is exact (whether the MMA rounds
    # or truncates its fp32 inputs to TF32, and under the interpreter, which multiplies in fp32).
    # fn_hi is fn rounded to 11 significant bits; the rest, at most 2^-11 |fn|, has 12 significant
    # bits, and fn_lo rounds it to 11: |e| <= 2^-23 |fn|, one fp32 ulp. So the sums differ from Σ x·fn
    # by the fp32 accumulation's rounding plus at most 2^-23 Σ |x·fn|. A plain tl.dot (fn in TF32,
    # i.e. fn_hi alone) is off by up to 2^-11 |fn| per term (2^-10 where the MMA truncates).
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    s = tl.program_id(1)
    row_ok = rows < B
    o = tl.arange(0, NP)
    acc = tl.zeros((BM, NP), dtype=tl.float32)
    sq = tl.zeros((BM,), dtype=tl.float32)
    for step in range(steps):
        k = (s * steps + step) * BK + tl.arange(0, BK)
        inside = k < n_in
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * n_in + k[None, :], mask=row_ok[:, None] & inside[None, :],
                    other=0.0).to(tl.float32)
        fn = tl.load(fn_ptr + o[None, :] * n_in + k[:, None], mask=(o[None, :] < n_out) & inside[:, None], other=0.0)
        fn_hi = _tf32(fn)
        fn_lo = _tf32(fn - fn_hi)
        acc = tl.dot(x, fn_hi, acc, input_precision="tf32")
        acc = tl.dot(x, fn_lo, acc, input_precision="tf32")
        sq += tl.sum(x * x, axis=1)
    tl.store(part_ptr + (rows[:, None] * S + s) * NP + o[None, :], acc, mask=row_ok[:, None])
    tl.store(sq_ptr + rows * S + s, sq, mask=row_ok)


@triton.jit
def _hc_pre_kernel(x_ptr, part_ptr, sq_ptr, base_ptr, scale_ptr, u_ptr, usq_ptr, post_ptr, c_ptr,
                   D, S, NB, rms_eps, hc_eps, iters,
                   HC: tl.constexpr, NP: tl.constexpr, SP: tl.constexpr, BD: tl.constexpr):
    b = tl.program_id(0)
    blk = tl.program_id(1)
    s = tl.arange(0, SP)
    on = s < S
    row = (b * S + s) * NP
    r = 1.0 / tl.sqrt(tl.sum(tl.load(sq_ptr + b * S + s, mask=on, other=0.0), axis=0) / (HC * D) + rms_eps)
    i = tl.arange(0, HC)
    ij = i[:, None] * HC + i[None, :]
    m_pre = tl.sum(tl.load(part_ptr + row[:, None] + i[None, :], mask=on[:, None], other=0.0), axis=0) * r
    pre = tl.sigmoid(tl.load(scale_ptr) * m_pre + tl.load(base_ptr + i)) + hc_eps
    if blk == 0:
        m_post = tl.sum(tl.load(part_ptr + row[:, None] + HC + i[None, :], mask=on[:, None], other=0.0), axis=0) * r
        m_c = tl.sum(tl.load(part_ptr + row[:, None, None] + 2 * HC + ij[None, :, :], mask=on[:, None, None],
                             other=0.0), axis=0) * r
        post = 2 * tl.sigmoid(tl.load(scale_ptr + 1) * m_post + tl.load(base_ptr + HC + i))
        cl = tl.load(scale_ptr + 2) * m_c + tl.load(base_ptr + 2 * HC + ij)
        # Sinkhorn (model_glm.sinkhorn): softmax over j, then columns, then rows and columns alternately.
        e = tl.exp(cl - tl.max(cl, axis=1)[:, None])
        C = e / tl.sum(e, axis=1)[:, None] + hc_eps
        C = C / (tl.sum(C, axis=0)[None, :] + hc_eps)
        for _ in range(iters - 1):
            C = C / (tl.sum(C, axis=1)[:, None] + hc_eps)
            C = C / (tl.sum(C, axis=0)[None, :] + hc_eps)
        tl.store(post_ptr + b * HC + i, post)
        tl.store(c_ptr + b * HC * HC + ij, C)
    # u in X's dtype (model_glm.hc_pre's rounding); Σ u² of the rounded values for the RMSNorm.
    d = blk * BD + tl.arange(0, BD)
    inside = d < D
    X = tl.load(x_ptr + b * HC * D + i[:, None] * D + d[None, :], mask=inside[None, :], other=0.0)
    u = _cast(tl.sum(pre[:, None] * X.to(tl.float32), axis=0), u_ptr.dtype.element_ty)
    tl.store(u_ptr + b * D + d, u, mask=inside)
    tl.store(usq_ptr + b * NB + blk, tl.sum(u.to(tl.float32) * u.to(tl.float32), axis=0))


@triton.jit
def _hc_norm_kernel(u_ptr, usq_ptr, norm_ptr, out_ptr, D, NB, rms_eps, NBP: tl.constexpr, BD: tl.constexpr):
    # RMSNorm(u) · weight with model_glm.rms_norm's roundings.
    b = tl.program_id(0)
    blocks = tl.arange(0, NBP)
    usq = tl.load(usq_ptr + b * NB + blocks, mask=blocks < NB, other=0.0)
    rs = 1.0 / tl.sqrt(tl.sum(usq, axis=0) / D + rms_eps)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    inside = d < D
    u = tl.load(u_ptr + b * D + d, mask=inside, other=0.0).to(tl.float32)
    y = _cast(u * rs, u_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(norm_ptr + d, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + b * D + d, _cast(w * y, out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _hc_post_block(x_ptr, y_ptr, y2_ptr, post_ptr, c_ptr, out_ptr, b, d, D, HC: tl.constexpr, SUM: tl.constexpr):
    # X'_j = post_j y + Σ_i C[i, j] X_i for row b and columns d of every stream: stores X' and returns it
    # [HC, len(d)] in out's dtype. SUM: y is a MoE output, routed (fp32) + shared, rounded to the
    # stream's dtype as model_glm's sum is.
    # The sum over i runs in a fixed order (source streams one by one, then post_j y added, as
    # model_glm.hc_post orders it), not as a tl.sum whose order follows the block's layout: X' is then
    # bit for bit the same whatever block size the caller takes (hc_post and hc_post_pre differ in it).
    inside = d < D
    j = tl.arange(0, HC)
    y = tl.load(y_ptr + b * D + d, mask=inside, other=0.0).to(tl.float32)
    if SUM:
        y2 = tl.load(y2_ptr + b * D + d, mask=inside, other=0.0).to(tl.float32)
        y = _cast(y + y2, out_ptr.dtype.element_ty).to(tl.float32)
    mixed = tl.zeros([HC, d.shape[0]], tl.float32)
    for i in tl.static_range(HC):
        X_i = tl.load(x_ptr + b * HC * D + i * D + d, mask=inside, other=0.0).to(tl.float32)
        mixed += tl.load(c_ptr + b * HC * HC + i * HC + j)[:, None] * X_i[None, :]  # C[source i, destination j]
    out = _cast(tl.load(post_ptr + b * HC + j)[:, None] * y[None, :] + mixed, out_ptr.dtype.element_ty)
    tl.store(out_ptr + b * HC * D + j[:, None] * D + d[None, :], out, mask=inside[None, :])
    return out


@triton.jit
def _hc_post_kernel(x_ptr, y_ptr, y2_ptr, post_ptr, c_ptr, out_ptr, D, HC: tl.constexpr, BD: tl.constexpr,
                    SUM: tl.constexpr):
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    _hc_post_block(x_ptr, y_ptr, y2_ptr, post_ptr, c_ptr, out_ptr, tl.program_id(0), d, D, HC, SUM)


@triton.jit
def _hc_post_mix_kernel(x_ptr, y_ptr, y2_ptr, post_ptr, c_ptr, out_ptr, fn_ptr, part_ptr, sq_ptr, B, D, n_out, S,
                        HC: tl.constexpr, BD: tl.constexpr, NP: tl.constexpr, BR: tl.constexpr, SUM: tl.constexpr):
    # `_hc_post_block` for BR rows and one block of BD columns of every stream, then `_hc_mix_kernel`'s
    # partial sums over those HC x BD elements of the flattened row (split s = the column block), from
    # X' as stored. They group the products by column block instead of by runs of the flattened row:
    # the same sums up to fp32 rounding.
    s = tl.program_id(1)
    d = s * BD + tl.arange(0, BD)
    i = tl.arange(0, HC)
    o = tl.arange(0, NP)
    flat = i[:, None] * D + d[None, :]  # [HC, BD]: the block's places in a flattened row
    fn = tl.load(fn_ptr + o[:, None, None] * (HC * D) + flat[None, :, :], mask=(o < n_out)[:, None, None], other=0.0)
    for r in tl.static_range(BR):
        b = tl.program_id(0) * BR + r
        if b < B:
            v = _hc_post_block(x_ptr, y_ptr, y2_ptr, post_ptr, c_ptr, out_ptr, b, d, D, HC, SUM).to(tl.float32)
            tl.store(part_ptr + (b * S + s) * NP + o, tl.sum(tl.sum(fn * v[None, :, :], axis=2), axis=1))
            tl.store(sq_ptr + b * S + s, tl.sum(tl.sum(v * v, axis=1), axis=0))


def _hc_mix(x: torch.Tensor, fn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial sums of x [B, n_in] · fnᵀ and of x² over S splits of n_in: part [B, S, NP] (NP >= n_out,
    the padding zero) and sq [B, S], fp32. The tensor-core kernel needs x exact in TF32 (16-bit)."""
    B, n_in = x.shape
    n_out = fn.shape[0]
    NP = max(16, triton.next_power_of_2(n_out))  # tl.dot's minimum tile
    if B >= HC_DOT_MIN_ROWS and x.dtype in (torch.bfloat16, torch.float16):
        steps = triton.cdiv(min(HC_DOT_SPLIT, n_in), HC_DOT_BLOCK)
        S = triton.cdiv(n_in, steps * HC_DOT_BLOCK)
        part = torch.empty(B, S, NP, dtype=torch.float32, device=x.device)
        sq = torch.empty(B, S, dtype=torch.float32, device=x.device)
        _hc_mix_dot_kernel[(triton.cdiv(B, HC_DOT_ROWS), S)](x, fn, part, sq, B, n_in, n_out, S, steps, NP=NP,
                                                             BM=HC_DOT_ROWS, BK=HC_DOT_BLOCK)
    else:
        S = triton.cdiv(n_in, HC_MIX_BLOCK)
        part = torch.empty(B, S, NP, dtype=torch.float32, device=x.device)
        sq = torch.empty(B, S, dtype=torch.float32, device=x.device)
        _hc_mix_kernel[(triton.cdiv(B, HC_MIX_ROWS), S)](x, fn, part, sq, B, n_in, n_out, S, NP=NP, BK=HC_MIX_BLOCK,
                                                         BR=HC_MIX_ROWS)
    return part, sq


def hc_pre(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm: torch.Tensor,
           rms_eps: float, hc_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """model_glm.hc_pre followed by rms_norm(u, norm): X [B, hc, D] -> (x [B, D], post [B, hc] fp32,
    C [B, hc, hc] fp32). fn [3hc + hc², hc·D] fp32, base [3hc + hc²] and scale [3] fp32."""
    B, hc, D = X.shape
    _hc_check("hc_pre", X, fn)
    X = X.contiguous()
    return _hc_finish(X, *_hc_mix(X.view(B, hc * D), fn), base, scale, norm, rms_eps, hc_eps, iters)


def _hc_check(name: str, X: torch.Tensor, fn: torch.Tensor) -> None:
    B, hc, D = X.shape
    n_in, n_out = hc * D, 2 * hc + hc * hc
    if tuple(fn.shape) != (n_out, n_in) or fn.dtype != torch.float32 or not fn.is_contiguous():
        raise ValueError(f"{name}: fn must be contiguous fp32 ({n_out}, {n_in}), got {fn.dtype} {tuple(fn.shape)}")
    if hc & (hc - 1):
        raise ValueError(f"{name}: hc_mult {hc} must be a power of two")


def _hc_finish(X: torch.Tensor, part: torch.Tensor, sq: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
               norm: torch.Tensor, rms_eps: float, hc_eps: float, iters: int) -> tuple[torch.Tensor, ...]:
    """hc_pre after the mix: (x, post, C) from its partial sums part [B, S, NP] and sq [B, S]."""
    B, hc, D = X.shape
    S, NP = part.shape[1:]
    BD = min(HC_BLOCK, triton.next_power_of_2(D))
    NB = triton.cdiv(D, BD)
    u = torch.empty(B, D, dtype=X.dtype, device=X.device)
    usq = torch.empty(B, NB, dtype=torch.float32, device=X.device)
    x = torch.empty(B, D, dtype=torch.promote_types(norm.dtype, X.dtype), device=X.device)
    post = torch.empty(B, hc, dtype=torch.float32, device=X.device)
    C = torch.empty(B, hc, hc, dtype=torch.float32, device=X.device)
    _hc_pre_kernel[(B, NB)](X, part, sq, base.float().contiguous(), scale.float().contiguous(), u, usq, post, C,
                            D, S, NB, rms_eps, hc_eps, iters, HC=hc, NP=NP, SP=triton.next_power_of_2(S), BD=BD,
                            num_warps=1)
    _hc_norm_kernel[(B, NB)](u, usq, norm, x, D, NB, rms_eps, NBP=triton.next_power_of_2(NB), BD=BD)
    return x, post, C


def hc_post(X: torch.Tensor, y: torch.Tensor, post: torch.Tensor, C: torch.Tensor,
            y2: torch.Tensor | None = None) -> torch.Tensor:
    """model_glm.hc_post: X [B, hc, D], y [B, D], post [B, hc], C [B, hc, hc] -> X' in X's dtype.
    With y2 [B, D] the sub-layer output is (y + y2) in fp32 rounded to X's dtype: a MoE layer's routed
    sum (fp32) and shared expert, added here instead of in two more launches."""
    B, hc, D = X.shape
    X, y, y2, post, C = _hc_post_operands("hc_post", X, y, y2, post, C)
    out = torch.empty_like(X)
    BD = min(512, triton.next_power_of_2(D))
    _hc_post_kernel[(B, triton.cdiv(D, BD))](X, y, y2, post, C, out, D, HC=hc, BD=BD, SUM=y2 is not y)
    return out


def _hc_post_operands(name: str, X: torch.Tensor, y: torch.Tensor, y2: torch.Tensor | None, post: torch.Tensor,
                      C: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # Contiguous operands; y2 is y itself when there is no second part (the kernels' SUM switch).
    B, hc, D = X.shape
    for name_t, t in (("y", y), ("y2", y2)):
        if t is not None and tuple(t.shape) != (B, D):
            raise ValueError(f"{name}: {name_t} must be ({B}, {D}), got {tuple(t.shape)}")
    y = y.contiguous()
    return X.contiguous(), y, y if y2 is None else y2.contiguous(), post.contiguous(), C.contiguous()


def hc_post_pre(X: torch.Tensor, y: torch.Tensor, post: torch.Tensor, C: torch.Tensor, fn: torch.Tensor,
                base: torch.Tensor, scale: torch.Tensor, norm: torch.Tensor, rms_eps: float, hc_eps: float,
                iters: int, y2: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """hc_post(X, y, post, C, y2) followed by the next sub-layer's hc_pre(X', fn, base, scale, norm, ...):
    (X', x, post', C'). Below HC_DOT_MIN_ROWS rows (the decode step's) hc_post and hc_pre's mix share
    one launch (`_hc_post_mix_kernel`); more rows run the two functions."""
    B, hc, D = X.shape
    _hc_check("hc_post_pre", X, fn)
    if B >= HC_DOT_MIN_ROWS or D % HC_POST_MIX_BLOCK:
        X = hc_post(X, y, post, C, y2)
        return X, *hc_pre(X, fn, base, scale, norm, rms_eps, hc_eps, iters)
    X, y, y2, post, C = _hc_post_operands("hc_post_pre", X, y, y2, post, C)
    out = torch.empty_like(X)
    S = D // HC_POST_MIX_BLOCK
    NP = max(16, triton.next_power_of_2(fn.shape[0]))
    part = torch.empty(B, S, NP, dtype=torch.float32, device=X.device)
    sq = torch.empty(B, S, dtype=torch.float32, device=X.device)
    _hc_post_mix_kernel[(triton.cdiv(B, HC_MIX_ROWS), S)](X, y, y2, post, C, out, fn, part, sq, B, D, fn.shape[0], S,
                                                         HC=hc, BD=HC_POST_MIX_BLOCK, NP=NP, BR=HC_MIX_ROWS,
                                                         SUM=y2 is not y)
    return out, *_hc_finish(out, part, sq, base, scale, norm, rms_eps, hc_eps, iters)


# ================================================================ the clamped SwiGLU (§4.5)

SWIGLU_BLOCK = 1024


@triton.jit
def _swiglu_kernel(g_ptr, g_stride, u_ptr, u_stride, out_ptr, I, limit, BI: tl.constexpr):
    # model_glm.swiglu with its roundings: SiLU's output in the activations' dtype, then the product.
    b = tl.program_id(0)
    c = tl.program_id(1) * BI + tl.arange(0, BI)
    inside = c < I
    g = tl.minimum(tl.load(g_ptr + b * g_stride + c, mask=inside, other=0.0).to(tl.float32), limit)
    u = tl.load(u_ptr + b * u_stride + c, mask=inside, other=0.0).to(tl.float32)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    DT = out_ptr.dtype.element_ty
    s = _cast(g * tl.sigmoid(g), DT).to(tl.float32)
    tl.store(out_ptr + b * I + c, _cast(s * u, DT), mask=inside)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """model_glm.swiglu in one launch (its twin: four torch ops): SiLU(min(gate, limit)) ·
    clamp(up, ±limit) for gate, up [B, I] (rows may be strided: the halves of a fused projection),
    [B, I] contiguous in gate's dtype."""
    B, I = gate.shape
    _rows(gate, "swiglu: gate", B, I)
    _rows(up, "swiglu: up", B, I)
    if up.dtype != gate.dtype:
        raise ValueError(f"swiglu: gate and up must share a dtype, got {gate.dtype} and {up.dtype}")
    out = torch.empty(B, I, dtype=gate.dtype, device=gate.device)
    if B:
        _swiglu_kernel[(B, triton.cdiv(I, SWIGLU_BLOCK))](gate, gate.stride(0), up, up.stride(0), out, I, limit,
                                                          BI=SWIGLU_BLOCK)
    return out


# ================================================================ KDA decode inputs and output (§4.3)

@triton.jit
def _kda_inputs_kernel(q_ptr, k_ptr, v_ptr, x_stride, conv_ptr, slots_ptr, w_ptr, f_ptr, f_stride,
                       alog_ptr, dtb_ptr, b_ptr, b_stride, qo_ptr, ko_ptr, vo_ptr, go_ptr, beta_ptr,
                       lower, scale, cs_slot, cs_j, cs_row,
                       H: tl.constexpr, DH: tl.constexpr, KW: tl.constexpr, KP: tl.constexpr):
    bi = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + bi).to(tl.int64)
    c = h * DH + tl.arange(0, DH)
    t = tl.arange(0, KP)[:, None]  # window rows: 0 .. KW-2 the history, KW-1 this token
    out = (bi * H + h) * DH + tl.arange(0, DH)
    for j in tl.static_range(3):
        if j == 0:
            src = q_ptr
        elif j == 1:
            src = k_ptr
        else:
            src = v_ptr
        hist_ptr = conv_ptr + slot * cs_slot + j * cs_j
        hist = tl.load(hist_ptr + t * cs_row + c[None, :], mask=t < KW - 1, other=0.0)
        new = tl.load(src + bi * x_stride + c)
        window = tl.where(t == KW - 1, new.to(tl.float32)[None, :], hist.to(tl.float32))
        weight = tl.load(w_ptr + (j * H * DH + c[None, :]) * KW + t, mask=t < KW, other=0.0).to(tl.float32)
        pre = tl.sum(window * weight, axis=0)
        act = _cast(pre * tl.sigmoid(pre), hist.dtype).to(tl.float32)  # SiLU, rounded as short_conv rounds
        tl.debug_barrier()
        tl.store(hist_ptr + (t - 1) * cs_row + c[None, :], _cast(window, hist.dtype), mask=(t >= 1) & (t < KW))
        if j == 0:
            tl.store(qo_ptr + out, act / tl.sqrt(tl.sum(act * act, axis=0) + 1e-6) * scale)
        elif j == 1:
            tl.store(ko_ptr + out, act / tl.sqrt(tl.sum(act * act, axis=0) + 1e-6))
        else:
            tl.store(vo_ptr + out, act)
    a = tl.exp(tl.load(alog_ptr + h))
    f = tl.load(f_ptr + bi * f_stride + c).to(tl.float32)
    tl.store(go_ptr + out, lower * tl.sigmoid(a * (f + tl.load(dtb_ptr + c))))
    tl.store(beta_ptr + bi * H + h, tl.sigmoid(tl.load(b_ptr + bi * b_stride + h).to(tl.float32)))


def _rows(t: torch.Tensor, name: str, B: int, width: int) -> torch.Tensor:
    # A [B, width] operand whose rows may be strided (a slice of a fused projection's output).
    if tuple(t.shape) != (B, width) or t.stride(1) != 1:
        raise ValueError(f"{name} must be ({B}, {width}) with unit column stride, got {tuple(t.shape)} {t.stride()}")
    return t


def _check_kda_inputs(name: str, pre_conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor], conv_w: torch.Tensor,
                      f: torch.Tensor, b: torch.Tensor, H: int, d: int) -> tuple[int, int, int]:
    # kda_decode_inputs' and kda_chunk_inputs' shared operands: returns (rows, H·d, conv width K).
    n, HD = pre_conv[0].shape[0], H * d
    for qkv, t in zip("qkv", pre_conv):
        _rows(t, f"{name}: {qkv}", n, HD)
    if pre_conv[0].stride(0) != pre_conv[1].stride(0) or pre_conv[0].stride(0) != pre_conv[2].stride(0):
        raise ValueError(f"{name}: q, k, v must share a row stride")
    _rows(f, f"{name}: f", n, HD)
    _rows(b, f"{name}: b", n, H)
    K = conv_w.shape[-1]
    if tuple(conv_w.shape) != (3, HD, K) or not conv_w.is_contiguous():
        raise ValueError(f"{name}: conv_w must be contiguous (3, {HD}, {K}), got {tuple(conv_w.shape)}")
    return n, HD, K


def kda_decode_inputs(pre_conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor], conv_state: torch.Tensor,
                      slots: torch.Tensor, conv_w: torch.Tensor, f: torch.Tensor, A_log: torch.Tensor,
                      dt_bias: torch.Tensor, b: torch.Tensor, lower_bound: float, H: int, d: int
                      ) -> tuple[torch.Tensor, ...]:
    """§4.3.2-4.3.5 for one token of B sequences: short conv + SiLU over the slot's window (updating
    conv_state [slots, 3, K-1, H·d] in place), q and k L2-normalized (q also · d^-1/2), the gate g
    and β. pre_conv: q̃, k̃, ṽ [B, H·d]; conv_w [3, H·d, K]; f [B, H·d] (f_b's output); A_log [H] and
    dt_bias [H·d] fp32; b [B, H] (b_proj's output). Returns q, k, v, g [B, H, d] and β [B, H], fp32."""
    B, HD, K = _check_kda_inputs("kda_decode_inputs", pre_conv, conv_w, f, b, H, d)
    if tuple(conv_state.shape[1:]) != (3, K - 1, HD) or conv_state.stride(-1) != 1:
        raise ValueError(f"kda_decode_inputs: conv_state must be (slots, 3, {K - 1}, {HD}), got {tuple(conv_state.shape)}")
    q, k, v, g = (torch.empty(B, H, d, dtype=torch.float32, device=f.device) for _ in range(4))
    beta = torch.empty(B, H, dtype=torch.float32, device=f.device)
    _kda_inputs_kernel[(B, H)](
        *pre_conv, pre_conv[0].stride(0), conv_state, slots.contiguous(), conv_w, f, f.stride(0),
        A_log.float().contiguous(), dt_bias.float().contiguous(), b, b.stride(0), q, k, v, g, beta,
        lower_bound, d ** -0.5, conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        H=H, DH=d, KW=K, KP=triton.next_power_of_2(K))
    return q, k, v, g, beta


KDA_INPUT_ROWS = 16  # chunk rows per program of the prefill inputs kernel


@triton.jit
def _kda_chunk_inputs_kernel(q_ptr, k_ptr, v_ptr, x_stride, hist_ptr, hist_j, hist_row, w_ptr, f_ptr, f_stride,
                             alog_ptr, dtb_ptr, b_ptr, b_stride, qo_ptr, ko_ptr, vo_ptr, go_ptr, beta_ptr,
                             n, lower, scale, H: tl.constexpr, DH: tl.constexpr, KW: tl.constexpr,
                             BR: tl.constexpr):
    # Rows r of one sequence's chunk: window row r + t (tap t) is history row r + t for r + t < K-1,
    # else chunk row r + t - (K-1); taps added in short_conv's order, 0 first.
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    h = tl.program_id(1)
    c = h * DH + tl.arange(0, DH)
    inside = (r < n)[:, None]
    out = (r[:, None] * H + h) * DH + tl.arange(0, DH)[None, :]
    for j in tl.static_range(3):
        if j == 0:
            src = q_ptr
        elif j == 1:
            src = k_ptr
        else:
            src = v_ptr
        acc = tl.zeros([BR, DH], dtype=tl.float32)
        for t in tl.static_range(KW):
            at = r + t - (KW - 1)  # the chunk row of the tap; negative: history row KW-1 + at
            old = inside & (at < 0)[:, None]
            hist = tl.load(hist_ptr + j * hist_j + (KW - 1 + at)[:, None] * hist_row + c[None, :], mask=old, other=0.0)
            new = tl.load(src + at[:, None] * x_stride + c[None, :], mask=inside & (at >= 0)[:, None], other=0.0)
            window = tl.where(old, hist.to(tl.float32), _cast(new.to(tl.float32), hist.dtype).to(tl.float32))
            acc += window * tl.load(w_ptr + (j * H * DH + c) * KW + t).to(tl.float32)[None, :]
        act = _cast(acc * tl.sigmoid(acc), hist.dtype).to(tl.float32)  # SiLU, rounded as short_conv rounds
        if j == 0:
            tl.store(qo_ptr + out, act / tl.sqrt(tl.sum(act * act, axis=1) + 1e-6)[:, None] * scale, mask=inside)
        elif j == 1:
            tl.store(ko_ptr + out, act / tl.sqrt(tl.sum(act * act, axis=1) + 1e-6)[:, None], mask=inside)
        else:
            tl.store(vo_ptr + out, act, mask=inside)
    a = tl.exp(tl.load(alog_ptr + h))
    f = tl.load(f_ptr + r[:, None] * f_stride + c[None, :], mask=inside, other=0.0).to(tl.float32)
    tl.store(go_ptr + out, lower * tl.sigmoid(a * (f + tl.load(dtb_ptr + c)[None, :])), mask=inside)
    beta = tl.sigmoid(tl.load(b_ptr + r * b_stride + h, mask=r < n, other=0.0).to(tl.float32))
    tl.store(beta_ptr + r * H + h, beta, mask=r < n)


def kda_chunk_inputs(pre_conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor], history: torch.Tensor,
                     conv_w: torch.Tensor, f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                     b: torch.Tensor, lower_bound: float, H: int, d: int) -> tuple[torch.Tensor, ...]:
    """kda_decode_inputs for the n rows of one sequence's chunk: §4.3.2-4.3.5 with the short conv's
    window running over history [3, K-1, H·d] (the slot's conv state before the chunk, read only)
    and then the chunk's own rows. pre_conv q̃, k̃, ṽ [n, H·d]; f [n, H·d]; b [n, H]. Returns q, k, v,
    g [n, H, d] and β [n, H], fp32. Twin: model_glm's short_conv, l2_norm and kda_gate."""
    n, HD, K = _check_kda_inputs("kda_chunk_inputs", pre_conv, conv_w, f, b, H, d)
    if tuple(history.shape) != (3, K - 1, HD) or history.stride(-1) != 1:
        raise ValueError(f"kda_chunk_inputs: history must be (3, {K - 1}, {HD}), got {tuple(history.shape)}")
    q, k, v, g = (torch.empty(n, H, d, dtype=torch.float32, device=f.device) for _ in range(4))
    beta = torch.empty(n, H, dtype=torch.float32, device=f.device)
    _kda_chunk_inputs_kernel[(triton.cdiv(n, KDA_INPUT_ROWS), H)](
        *pre_conv, pre_conv[0].stride(0), history, history.stride(0), history.stride(1), conv_w, f, f.stride(0),
        A_log.float().contiguous(), dt_bias.float().contiguous(), b, b.stride(0), q, k, v, g, beta, n,
        lower_bound, d ** -0.5, H=H, DH=d, KW=K, BR=KDA_INPUT_ROWS)
    return q, k, v, g, beta


@triton.jit
def _kda_output_kernel(o_ptr, og_ptr, og_stride, w_ptr, out_ptr, eps, H: tl.constexpr, DH: tl.constexpr):
    bi = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.arange(0, DH)
    o = tl.load(o_ptr + (bi * H + h) * DH + i).to(tl.float32)
    y = tl.load(w_ptr + i) * (o / tl.sqrt(tl.sum(o * o, axis=0) / DH + eps))
    gate = tl.load(og_ptr + bi * og_stride + h * DH + i).to(tl.float32)
    tl.store(out_ptr + bi * H * DH + h * DH + i, _cast(y * tl.sigmoid(gate), out_ptr.dtype.element_ty))


def kda_output_gate(o: torch.Tensor, o_g: torch.Tensor, o_norm: torch.Tensor, eps: float,
                    dtype: torch.dtype) -> torch.Tensor:
    """§4.3.8 before o_proj: per-head RMSNorm of o [B, H, d] (fp32 weight o_norm [d]) times
    sigmoid(o_g [B, H·d]), in `dtype`, [B, H·d]."""
    B, H, d = o.shape
    _rows(o_g, "kda_output_gate: o_g", B, H * d)
    out = torch.empty(B, H * d, dtype=dtype, device=o.device)
    _kda_output_kernel[(B, H)](o.contiguous(), o_g, o_g.stride(0), o_norm.float().contiguous(), out, eps, H=H, DH=d)
    return out


# ================================================================ decode-step kernels: routing (§4.5)
# moe_route in two launches. `_route_logits_kernel`: the fp32 router GEMV split over blocks of
# experts and of D, so that at full size (288 x 4096, 4.7 MB) ~150 programs stream gate_w at once;
# each holds its gate_w block in registers for every row of h. `_route_topk_kernel`: one program
# per row adds the partial sums in a fixed order, applies the sigmoid and takes the top-k of s + bias
# by k rounds of argmax (ties to the lower expert), the weights coming from s, then normalizes and
# scales them. The logits never exist as a separate tensor, and there is no torch op in between.

ROUTE_BLOCK_E = 16
ROUTE_BLOCK_K = 512


@triton.jit
def _route_logits_kernel(h_ptr, h_stride, w_ptr, part_ptr, B, E, D, BE: tl.constexpr, BK: tl.constexpr):
    e = tl.program_id(0) * BE + tl.arange(0, BE)
    s = tl.program_id(1)
    k = s * BK + tl.arange(0, BK)
    w = tl.load(w_ptr + e[:, None] * D + k[None, :], mask=(e[:, None] < E) & (k[None, :] < D), other=0.0)
    for b in range(B):
        x = tl.load(h_ptr + b * h_stride + k, mask=k < D, other=0.0).to(tl.float32)
        tl.store(part_ptr + (b * tl.num_programs(1) + s) * E + e, tl.sum(w * x[None, :], axis=1), mask=e < E)


@triton.jit
def _route_topk_kernel(part_ptr, bias_ptr, ids_ptr, wt_ptr, E, S, scaling,
                       NORM: tl.constexpr, TOPK: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr,
                       SP: tl.constexpr):
    b = tl.program_id(0)
    e = tl.arange(0, EP)
    s = tl.arange(0, SP)
    inside = e < E
    part = tl.load(part_ptr + (b * S + s[:, None]) * E + e[None, :], mask=(s[:, None] < S) & inside[None, :],
                   other=0.0)
    score = tl.sigmoid(tl.sum(part, axis=0))
    choice = tl.where(inside, score + tl.load(bias_ptr + e, mask=inside, other=0.0), -float("inf"))
    j = tl.arange(0, KP)
    ids = tl.zeros([KP], dtype=tl.int32)
    w = tl.zeros([KP], dtype=tl.float32)
    for r in tl.static_range(TOPK):
        pick = tl.min(tl.where(choice == tl.max(choice, axis=0), e, EP), axis=0)
        ids = tl.where(j == r, pick, ids)
        w = tl.where(j == r, tl.sum(tl.where(e == pick, score, 0.0), axis=0), w)
        choice = tl.where(e == pick, -float("inf"), choice)
    if NORM:
        w = w / (tl.sum(w, axis=0) + 1e-20)
    tl.store(ids_ptr + b * TOPK + j, ids, mask=j < TOPK)
    tl.store(wt_ptr + b * TOPK + j, w * scaling, mask=j < TOPK)


def moe_route(h: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, top_k: int, norm_topk_prob: bool,
              scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """model_glm.route for rows h [B, D]: s = sigmoid(h·gate_wᵀ) in fp32 (gate_w [E, D] fp32), the
    top_k experts of s + bias (bias [E] fp32), their s normalized (norm_topk_prob) and scaled.
    Returns (ids int32 [B, top_k], weights fp32 [B, top_k]), in no particular order (int32: what
    exl3_moe_decode reads, so no conversion launch between them)."""
    B, D = h.shape
    E = gate_w.shape[0]
    if tuple(gate_w.shape) != (E, D) or gate_w.dtype != torch.float32 or not gate_w.is_contiguous():
        raise ValueError(f"moe_route: gate_w must be contiguous fp32 (E, {D}), got {gate_w.dtype} "
                         f"{tuple(gate_w.shape)}")
    if tuple(bias.shape) != (E,):
        raise ValueError(f"moe_route: bias must be ({E},), got {tuple(bias.shape)}")
    if not 1 <= top_k <= E:
        raise ValueError(f"moe_route: top_k = {top_k} must be in 1..{E}")
    _rows(h, "moe_route: h", B, D)
    S = triton.cdiv(D, ROUTE_BLOCK_K)
    part = torch.empty(B, S, E, dtype=torch.float32, device=h.device)
    _route_logits_kernel[(triton.cdiv(E, ROUTE_BLOCK_E), S)](h, h.stride(0), gate_w, part, B, E, D,
                                                             BE=ROUTE_BLOCK_E, BK=ROUTE_BLOCK_K)
    ids = torch.empty(B, top_k, dtype=torch.int32, device=h.device)
    weights = torch.empty(B, top_k, dtype=torch.float32, device=h.device)
    _route_topk_kernel[(B,)](part, bias.float().contiguous(), ids, weights, E, S, float(scaling),
                             NORM=bool(norm_topk_prob), TOPK=top_k, KP=triton.next_power_of_2(top_k),
                             EP=triton.next_power_of_2(E), SP=triton.next_power_of_2(S))
    return ids, weights


# ================================================================ decode-step kernels: DSA (§4.4)
# One token per sequence against a paged cache: row tensors latent [blocks, bs, R], index_k / gate
# [blocks, bs, d], pooled [blocks, bs / kpool, d]; tables [B, width] (block ids) and positions [B] on
# the device. Pools are numbered along the table (pool p = block table[p // (bs / kpool)]).
# `dsa_decode_inputs`: q_a_layernorm, and this token's latent (kv_a_layernorm), indexer key (k_norm)
# and gate rows, and the pooled key of its pool when the token completes it: one program per sequence.
# `dsa_index_scores`: Σ_h w[h] · relu(q[h] · K_p / √d) for every pool of the table, -inf past the
# candidates (complete pools).
# `dsa_sparse_attention`: the absorbed MLA over the selected positions (the chosen pools' members and
# the tail), gathering the latent rows itself; the positions are split over programs (flash-decoding:
# an online softmax per split, then `_dsa_combine_kernel`). Products whose operands are bf16 run on
# bf16 tensor cores, exact (a bf16 x bf16 product fits fp32); an fp32 operand (q̂, p) facing a bf16
# latent is split into bf16 hi + lo parts (16 of its 24 significand bits); an fp32 cache runs
# fp32 dots.

DSA_SCORE_BLOCK = 64
DSA_ATTN_HEADS = 16  # heads per program (tl.dot needs >= 16 rows; fewer heads are padded)
DSA_ATTN_BLOCK = 16  # selected positions per inner step
DSA_ATTN_WARPS = 8  # 156 registers, no spill, for sm_90 at full size (ptxas, triton 3.9); 32 positions spill


@triton.jit
def _dot_bf16(a, b, TC: tl.constexpr):
    # bf16 x bf16 -> fp32. TC: on tensor cores; else (the CPU interpreter, whose bf16 dot is wrong)
    # as fp32, which gives the same exact products.
    if TC:
        return tl.dot(a, b)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def _split(a, B_DT: tl.constexpr):
    # fp32 a as the (hi, lo) operand pair `_dot_pair` takes against a B_DT operand.
    if B_DT == tl.bfloat16:
        hi = a.to(tl.bfloat16)
        return hi, (a - hi.to(tl.float32)).to(tl.bfloat16)
    else:
        return a, a


@triton.jit
def _dot_pair(hi, lo, b, TC: tl.constexpr):
    # (hi + lo) · b in fp32 for bf16 b (from `_split`); hi · b in fp32 otherwise.
    if b.dtype == tl.bfloat16:
        return _dot_bf16(hi, b, TC) + _dot_bf16(lo, b, TC)
    else:
        return tl.dot(hi.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def _dot_f32(a, b, TC: tl.constexpr):
    # a (fp32 or bf16) · b in fp32 (see the section comment).
    if a.dtype == b.dtype:
        if b.dtype == tl.bfloat16:
            return _dot_bf16(a, b, TC)
        else:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        hi, lo = _split(a.to(tl.float32), b.dtype)
        return _dot_pair(hi, lo, b, TC)


@triton.jit
def _rms_norm_row(x_ptr, w_ptr, eps, N: tl.constexpr, NP: tl.constexpr, OUT_DT: tl.constexpr):
    # model_glm.rms_norm of one row of N, with its roundings (to x's dtype, then to OUT_DT), as fp32.
    i = tl.arange(0, NP)
    x = tl.load(x_ptr + i, mask=i < N, other=0.0).to(tl.float32)
    normed = _cast(x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)), x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + i, mask=i < N, other=0.0).to(tl.float32)
    return _cast(w * normed.to(tl.float32), OUT_DT).to(tl.float32)


@triton.jit
def _dsa_inputs_kernel(qa_ptr, qa_stride, kv_ptr, kv_stride, wk_ptr, wk_stride, g_ptr, g_stride, qn_ptr, kvn_ptr,
                       knw_ptr, knb_ptr, ape_ptr, qr_ptr, lat_ptr, ik_ptr, gate_ptr, pool_ptr, tables_ptr, t_stride,
                       pos_ptr, rms_eps, bs, Q: tl.constexpr, QP: tl.constexpr, R: tl.constexpr, DI: tl.constexpr,
                       KPOOL: tl.constexpr, C_DT: tl.constexpr):
    b = tl.program_id(0)
    i = tl.arange(0, QP)
    q_r = _rms_norm_row(qa_ptr + b * qa_stride, qn_ptr, rms_eps, Q, QP, qr_ptr.dtype.element_ty)
    tl.store(qr_ptr + b * Q + i, q_r.to(qr_ptr.dtype.element_ty), mask=i < Q)
    pos = tl.load(pos_ptr + b)
    blk = tl.load(tables_ptr + b * t_stride + pos // bs)
    off = pos % bs
    # latent: kv_a_layernorm's output (C_DT), then the cache's dtype
    r = tl.arange(0, R)
    c = _rms_norm_row(kv_ptr + b * kv_stride, kvn_ptr, rms_eps, R, R, C_DT)
    tl.store(lat_ptr + (blk * bs + off) * R + r, _cast(c, lat_ptr.dtype.element_ty))
    # indexer key: F.layer_norm(wk, k_norm, eps 1e-6) in wk's dtype; the gate row as it is
    d = tl.arange(0, DI)
    x = tl.load(wk_ptr + b * wk_stride + d).to(tl.float32)
    xc = x - tl.sum(x, axis=0) / DI
    k = xc * (1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / DI + 1e-6))
    k = k * tl.load(knw_ptr + d).to(tl.float32) + tl.load(knb_ptr + d).to(tl.float32)
    k = _cast(_cast(k, wk_ptr.dtype.element_ty).to(tl.float32), ik_ptr.dtype.element_ty)
    g = _cast(tl.load(g_ptr + b * g_stride + d).to(tl.float32), gate_ptr.dtype.element_ty)
    tl.store(ik_ptr + (blk * bs + off) * DI + d, k)
    tl.store(gate_ptr + (blk * bs + off) * DI + d, g)
    # the pooled key (model_glm.pool_keys) when this token is its pool's last: the other members
    # come from the cache, this one from registers
    if (pos + 1) % KPOOL == 0:
        m = tl.arange(0, KPOOL)
        rows = (blk * bs + off - (KPOOL - 1) + m)[:, None] * DI + d[None, :]
        earlier = (m < KPOOL - 1)[:, None]
        km = tl.where(earlier, tl.load(ik_ptr + rows, mask=earlier, other=0.0), k[None, :]).to(tl.float32)
        gm = tl.where(earlier, tl.load(gate_ptr + rows, mask=earlier, other=0.0), g[None, :]).to(tl.float32)
        logit = gm + tl.load(ape_ptr + m[:, None] * DI + d[None, :])
        e = tl.exp(logit - tl.max(logit, axis=0)[None, :])
        pooled = tl.sum(e / tl.sum(e, axis=0)[None, :] * km, axis=0)
        pooled = _cast(_cast(pooled, ik_ptr.dtype.element_ty).to(tl.float32), pool_ptr.dtype.element_ty)
        tl.store(pool_ptr + (blk * (bs // KPOOL) + off // KPOOL) * DI + d, pooled)


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _check_cache_row(name: str, t: torch.Tensor, blocks: int, rows: int, width: int) -> None:
    if t.dim() != 3 or tuple(t.shape) != (blocks, rows, width) or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous cache row ({blocks}, {rows}, {width}), got "
                         f"{tuple(t.shape)} contiguous={t.is_contiguous()}")


def _check_tables(name: str, tables: torch.Tensor, positions: torch.Tensor) -> int:
    B = positions.shape[0]
    if positions.dim() != 1 or tables.dim() != 2 or tables.shape[0] != B or tables.stride(1) != 1:
        raise ValueError(f"{name}: positions must be [B] and tables [B, width] with unit column stride, got "
                         f"{tuple(positions.shape)} and {tuple(tables.shape)}")
    return B


def dsa_decode_inputs(q_a: torch.Tensor, kv_a: torch.Tensor, wk: torch.Tensor, gamma: torch.Tensor,
                      q_norm: torch.Tensor, kv_norm: torch.Tensor, k_norm_w: torch.Tensor, k_norm_b: torch.Tensor,
                      ape: torch.Tensor, latent: torch.Tensor, index_k: torch.Tensor, gate: torch.Tensor,
                      pooled: torch.Tensor, tables: torch.Tensor, positions: torch.Tensor,
                      rms_eps: float) -> torch.Tensor:
    """§4.4 for one token per sequence, from the first projections' outputs q_a [B, q_lora], kv_a
    [B, R], wk and gamma [B, d] (rows may be strided): returns q_r = rms_norm(q_a, q_norm), and
    writes the token's cache rows as model_glm.GLMModel.dsa does: latent ← rms_norm(kv_a, kv_norm),
    index_k ← layer_norm(wk, k_norm_w, k_norm_b, eps 1e-6), gate ← gamma, and pooled ←
    pool_keys(the pool's members, ape [kpool, d] fp32) when position + 1 completes a pool."""
    B = _check_tables("dsa_decode_inputs", tables, positions)
    Q, R, (kpool, d) = q_a.shape[-1], kv_a.shape[-1], ape.shape
    nb, bs = latent.shape[:2]
    _check_cache_row("dsa_decode_inputs: latent", latent, nb, bs, R)
    _check_cache_row("dsa_decode_inputs: index_k", index_k, nb, bs, d)
    _check_cache_row("dsa_decode_inputs: gate", gate, nb, bs, d)
    _check_cache_row("dsa_decode_inputs: pooled", pooled, nb, bs // kpool, d)
    for name, t, width in (("q_a", q_a, Q), ("kv_a", kv_a, R), ("wk", wk, d), ("gamma", gamma, d)):
        _rows(t, f"dsa_decode_inputs: {name}", B, width)
    if bs % kpool or R & (R - 1) or d & (d - 1) or kpool & (kpool - 1):
        raise ValueError(f"dsa_decode_inputs: needs block_size ({bs}) a multiple of kpool ({kpool}) and powers "
                         f"of two for kv_lora_rank ({R}), index_head_dim ({d}) and kpool")
    q_r = torch.empty(B, Q, dtype=torch.promote_types(q_norm.dtype, q_a.dtype), device=q_a.device)
    _dsa_inputs_kernel[(B,)](q_a, q_a.stride(0), kv_a, kv_a.stride(0), wk, wk.stride(0), gamma, gamma.stride(0),
                             q_norm, kv_norm, k_norm_w, k_norm_b, ape.float().contiguous(), q_r, latent, index_k,
                             gate, pooled, tables, tables.stride(0), positions, rms_eps, bs, Q=Q,
                             QP=triton.next_power_of_2(Q), R=R, DI=d, KPOOL=kpool,
                             C_DT=_TL_DTYPES[torch.promote_types(kv_norm.dtype, kv_a.dtype)])
    return q_r


@triton.jit
def _dsa_scores_kernel(q_ptr, q_stride, w_ptr, pool_ptr, tables_ptr, t_stride, pos_ptr, out_ptr, P, ppb,
                       q_scale, w_scale, HI: tl.constexpr, DI: tl.constexpr, KPOOL: tl.constexpr,
                       BP: tl.constexpr, TC: tl.constexpr):
    b = tl.program_id(0)
    p = tl.program_id(1) * BP + tl.arange(0, BP)
    candidate = p < (tl.load(pos_ptr + b) + 1) // KPOOL
    h = tl.arange(0, HI)
    d = tl.arange(0, DI)
    q = tl.load(q_ptr + b * q_stride + h[:, None] * DI + d[None, :])
    blk = tl.load(tables_ptr + b * t_stride + p // ppb, mask=candidate, other=0)
    keys = tl.load(pool_ptr + (blk * ppb + p % ppb)[:, None] * DI + d[None, :], mask=candidate[:, None], other=0.0)
    dots = _dot_f32(q, tl.trans(keys), TC) / q_scale
    w = tl.load(w_ptr + b * HI + h) / w_scale
    score = tl.sum(w[:, None] * tl.maximum(dots, 0.0), axis=0)
    tl.store(out_ptr + b * P + p, tl.where(candidate, score, -float("inf")), mask=p < P)


def dsa_index_scores(q_idx: torch.Tensor, w_idx: torch.Tensor, pooled: torch.Tensor, tables: torch.Tensor,
                     positions: torch.Tensor, kpool: int) -> torch.Tensor:
    """The indexer's pool scores (model_glm.select_tokens before its top-k) over every pool of the
    table: q_idx [B, heads, d] (the last two dims packed, rows may be strided), w_idx [B, heads]
    fp32 (weights_proj's output, divided by √heads here), pooled the cache row. Returns fp32
    [B, width · bs / kpool], -inf for pools that are not complete at the position."""
    B = _check_tables("dsa_index_scores", tables, positions)
    _, Hi, d = q_idx.shape
    nb, ppb = pooled.shape[:2]
    _check_cache_row("dsa_index_scores: pooled", pooled, nb, ppb, d)
    if q_idx.stride(2) != 1 or q_idx.stride(1) != d or tuple(w_idx.shape) != (B, Hi):
        raise ValueError(f"dsa_index_scores: q_idx must be [{B}, heads, {d}] with packed heads and w_idx "
                         f"[{B}, heads], got {tuple(q_idx.shape)} {q_idx.stride()} and {tuple(w_idx.shape)}")
    _check_pow2("dsa_index_scores: index heads", Hi)
    _check_pow2("dsa_index_scores: index_head_dim", d)
    P = tables.shape[1] * ppb
    out = torch.empty(B, P, dtype=torch.float32, device=q_idx.device)
    _dsa_scores_kernel[(B, triton.cdiv(P, DSA_SCORE_BLOCK))](
        q_idx, q_idx.stride(0), w_idx.float().contiguous(), pooled, tables, tables.stride(0), positions, out, P, ppb,
        d ** 0.5, Hi ** 0.5, HI=Hi, DI=d, KPOOL=kpool, BP=DSA_SCORE_BLOCK, TC=q_idx.is_cuda)
    return out


@triton.jit
def _online_softmax_step(q_hi, q_lo, lat, valid, scale, m, l, acc, TC: tl.constexpr):
    # One block of selected latent rows into the running softmax (max m, sum l, acc = Σ p · lat) of
    # the heads q = q_hi + q_lo; rows that are not valid score -inf. A head with only -inf so far
    # keeps m = -inf and is shifted by 0 instead (no inf - inf).
    s = tl.where(valid[None, :], _dot_pair(q_hi, q_lo, tl.trans(lat), TC) / scale, -float("inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m - m_safe)
    return m_new, l * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + _dot_f32(p, lat, TC)


@triton.jit
def _dsa_attn_kernel(q_ptr, q_sb, q_sh, lat_ptr, tables_ptr, t_stride, pos_ptr, top_ptr, top_stride,
                     m_ptr, l_ptr, acc_ptr, H, NT, steps, bs, scale,
                     R: tl.constexpr, KPOOL: tl.constexpr, TAIL: tl.constexpr, ALL: tl.constexpr,
                     BH: tl.constexpr, BW: tl.constexpr, TC: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    split = tl.program_id(2)
    r = tl.arange(0, R)
    q = tl.load(q_ptr + b * q_sb + h[:, None] * q_sh + r[None, :], mask=h[:, None] < H, other=0.0)
    q_hi, q_lo = _split(q, lat_ptr.dtype.element_ty)
    pos = tl.load(pos_ptr + b)
    n_cand = (pos + 1) // KPOOL
    m = tl.full([BH], -float("inf"), tl.float32)
    l = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, R], dtype=tl.float32)
    i = tl.arange(0, BW)
    for step in range(steps):
        # selected position t0 + i: member (t0 + i) % kpool of pool slot j, slot NT being the tail
        t0 = (split * steps + step) * BW
        j = (t0 + i) // KPOOL
        if ALL:
            pool = j
        else:
            # With no more candidates than NT the top-k holds them all (and -inf picks): take pools
            # 0.. in order instead, so that the skipped steps are the last ones.
            picked = j < tl.where(n_cand > NT, NT, 0)
            pool = tl.where(picked, tl.load(top_ptr + b * top_stride + j, mask=picked, other=0), j)
        valid = (j < NT) & (pool < n_cand)
        if TAIL:
            pool = tl.where(j == NT, n_cand, pool)
            valid = valid | ((j == NT) & (pool * KPOOL + (t0 + i) % KPOOL <= pos))
        if tl.max(valid.to(tl.int32), axis=0) > 0:
            t = pool * KPOOL + (t0 + i) % KPOOL
            blk = tl.load(tables_ptr + b * t_stride + t // bs, mask=valid, other=0)
            lat = tl.load(lat_ptr + (blk * bs + t % bs)[:, None] * R + r[None, :], mask=valid[:, None], other=0.0)
            m, l, acc = _online_softmax_step(q_hi, q_lo, lat, valid, scale, m, l, acc, TC)
    part = (b * tl.num_programs(2) + split) * H + h
    tl.store(m_ptr + part, m, mask=h < H)
    tl.store(l_ptr + part, l, mask=h < H)
    tl.store(acc_ptr + part[:, None] * R + r[None, :], acc, mask=h[:, None] < H)


@triton.jit
def _dsa_combine_kernel(m_ptr, l_ptr, acc_ptr, o_ptr, o_sb, o_sh, H, NS, R: tl.constexpr, SP: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SP)
    r = tl.arange(0, R)
    part = (b * NS + s) * H + h
    m = tl.load(m_ptr + part, mask=s < NS, other=-float("inf"))
    top = tl.max(m, axis=0)
    w = tl.exp(m - tl.where(top == -float("inf"), 0.0, top))
    l = tl.sum(w * tl.load(l_ptr + part, mask=s < NS, other=0.0), axis=0)
    acc = tl.load(acc_ptr + part[:, None] * R + r[None, :], mask=(s < NS)[:, None], other=0.0)
    tl.store(o_ptr + b * o_sb + h * o_sh + r, tl.sum(w[:, None] * acc, axis=0) / l)


def dsa_sparse_attention(q_hat: torch.Tensor, latent: torch.Tensor, tables: torch.Tensor, positions: torch.Tensor,
                         top: torch.Tensor | None, kpool: int, select_tail: bool, scale: float,
                         splits: int | None = None) -> torch.Tensor:
    """model_glm.mla_attention between W_UK and W_UV: softmax_t(q̂ · c_t / scale) over the selected
    positions t, times c_t. q̂ [B, H, R] fp32 (any strides); latent the cache row. The selection
    (model_glm.select_tokens): the members of pools top [B, NT] (the top-k of `dsa_index_scores`;
    a sequence with no more complete pools than NT takes them all, as its top-k does) or, top None,
    of every complete pool of the table, plus the tail (positions after the last complete pool)
    with select_tail. Returns o [B, H, R] fp32 in
    q̂'s memory layout. `splits`: programs per (sequence, head block) (default: enough to fill the GPU)."""
    B = _check_tables("dsa_sparse_attention", tables, positions)
    H, R = q_hat.shape[1:]
    nb, bs = latent.shape[:2]
    _check_cache_row("dsa_sparse_attention: latent", latent, nb, bs, R)
    if q_hat.shape[0] != B or q_hat.dtype != torch.float32 or q_hat.stride(2) != 1:
        raise ValueError(f"dsa_sparse_attention: q_hat must be fp32 [{B}, H, {R}] with unit last stride, got "
                         f"{q_hat.dtype} {tuple(q_hat.shape)} {q_hat.stride()}")
    _check_pow2("dsa_sparse_attention: kv_lora_rank", R)
    every = top is None
    if every:
        NT, top = tables.shape[1] * (bs // kpool), positions  # a pointer the kernel never reads
    elif top.dim() != 2 or top.shape[0] != B or top.stride(1) != 1:
        raise ValueError(f"dsa_sparse_attention: top must be [{B}, NT] with unit column stride, got {tuple(top.shape)}")
    else:
        NT = top.shape[1]
    n_steps = triton.cdiv((NT + select_tail) * kpool, DSA_ATTN_BLOCK)
    head_blocks = triton.cdiv(H, DSA_ATTN_HEADS)
    if splits is None:
        # about one program per SM: more splits cost more partial sums to combine
        programs = torch.cuda.get_device_properties(q_hat.device).multi_processor_count if q_hat.is_cuda else 2
        splits = max(1, min(n_steps, programs // (B * head_blocks)))
    steps = triton.cdiv(n_steps, splits)
    m = torch.empty(B, splits, H, dtype=torch.float32, device=q_hat.device)
    l = torch.empty_like(m)
    acc = torch.empty(B, splits, H, R, dtype=torch.float32, device=q_hat.device)
    _dsa_attn_kernel[(B, head_blocks, splits)](
        q_hat, q_hat.stride(0), q_hat.stride(1), latent, tables, tables.stride(0), positions, top, top.stride(0),
        m, l, acc, H, NT, steps, bs, scale, R=R, KPOOL=kpool, TAIL=bool(select_tail), ALL=every,
        BH=DSA_ATTN_HEADS, BW=DSA_ATTN_BLOCK, TC=q_hat.is_cuda, num_warps=DSA_ATTN_WARPS)
    o = torch.empty_like(q_hat)
    _dsa_combine_kernel[(B, H)](m, l, acc, o, o.stride(0), o.stride(1), H, splits, R=R,
                                SP=triton.next_power_of_2(splits))
    return o


# ---------------------------------------------------------------- the absorbed MLA's per-head products
# q̂ = q · W_UK and o · W_UVᵀ (model_glm.mla_attention's first and last einsum), per head h:
# out[b, h] = a[b, h] · w[h]. torch runs them as fp32 bmm's on the CUDA cores (a decode row: two cuBLAS
# GEMVs of 11-14 us on the H200, reading 16.8 MB each; a prefill chunk: SIMT SGEMMs of ~3 ms at 8192
# rows). Here on tensor cores with tf32x3 operands (each fp32 operand as a TF32 value plus a TF32
# remainder: ~2^-21 relative per product; a 16-bit operand is exact), fp32 sums. The weights may stay
# in the checkpoint's 16 bits (kv_b_proj is BF16): converted in registers they are exact TF32 values
# with a zero remainder, so the products are those of their fp32 copies, from half the bytes (on the
# H200 a sum may still differ from theirs in its last bits; the tests bound it).
# One program: BM rows x BN columns of one head.
HEAD_MM_BLOCK_K = 32


@triton.jit
def _head_matmul_kernel(a_ptr, a_sb, a_sh, a_sk, w_ptr, w_sh, w_sk, w_sn, o_ptr, o_sb, o_sh, o_sn, B, K, N,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    h = tl.program_id(0)
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    cols = tl.program_id(2) * BN + tl.arange(0, BN)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + rows[:, None].to(tl.int64) * a_sb + h * a_sh + ks[None, :] * a_sk,
                    mask=(rows[:, None] < B) & (ks[None, :] < K), other=0.0).to(tl.float32)
        w = tl.load(w_ptr + h * w_sh + ks[:, None] * w_sk + cols[None, :] * w_sn,
                    mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0).to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision="tf32x3")
    tl.store(o_ptr + rows[:, None].to(tl.int64) * o_sb + h * o_sh + cols[None, :] * o_sn,
             _cast(acc, o_ptr.dtype.element_ty), mask=(rows[:, None] < B) & (cols[None, :] < N))


def head_matmul(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """out[b, h] = a[b, h] · w[h] for a [B, H, K] (any float dtype, any strides), w [H, K, N] fp32, bf16
    or fp16 (any strides, e.g. a slice of kv_b_proj's view or W_UV.transpose(1, 2)); out [B, H, N] (any
    strides, given or new in out_dtype). Twin: torch.einsum("bhk,hkn->bhn", a.float(), w.float()) (see
    the section comment for the precision)."""
    if a.dim() != 3 or w.dim() != 3 or a.shape[1] != w.shape[0] or a.shape[2] != w.shape[1]:
        raise ValueError(f"head_matmul: a must be [B, H, K] and w [H, K, N], got {tuple(a.shape)} and {tuple(w.shape)}")
    if w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"head_matmul: w must be fp32, bf16 or fp16, got {w.dtype}")
    B, H, K = a.shape
    N = w.shape[2]
    if out is None:
        out = torch.empty(B, H, N, dtype=out_dtype, device=a.device)
    elif tuple(out.shape) != (B, H, N):
        raise ValueError(f"head_matmul: out must be [{B}, {H}, {N}], got {tuple(out.shape)}")
    BM = 16 if B <= 16 else 64
    BN = 64 if B <= 16 else 128
    _head_matmul_kernel[(H, triton.cdiv(B, BM), triton.cdiv(N, BN))](
        a, *a.stride(), w, *w.stride(), out, *out.stride(), B, K, N, BM=BM, BN=BN, BK=HEAD_MM_BLOCK_K)
    return out


# ================================================================ prefill: DSA attention of a chunk (§4.4)
# `dsa_prefill_attention`: dsa_sparse_attention's math for the n query rows of ONE sequence's chunk
# (one block table, positions start..start+n-1). A program owns one query row and BH of its heads for
# the whole selection (no splits once n fills the GPU): all heads of a row share the row's selected
# positions, so the heads are the MMA's M rows and the selection stays exact.
# Why not blocks of query rows over the union of their selections: registers bound M. q̂ (bf16 hi +
# lo) and the fp32 output accumulator take M·R·8 bytes: M = 32 at R = 512 is half the 256 KB register
# file, M = 64 all of it. At a fixed M, BQ rows x M/BQ heads over the union U of the rows' pools
# costs per row H·U·kpool·R·8 flops and H·U·kpool·2R/M bytes of latent, against the same with U = NT
# for one row x M heads: rows only help when there are fewer heads than M (and 8K-context rows each
# pick 25% of the pools, random picks of 16 rows cover 99%).
# Cost at full size (H = 64, R = 512, 2051 positions a row, M = 32): per row 2 programs x 65 steps of
# 32 positions; four bf16 MMAs per product pair (q̂ and p split in hi + lo) = 64·2051·512·2·4 = 0.54
# GFLOP, 8192 rows = 4.4 TFLOP (about 4.5 ms at the H200's dense bf16 peak); each row reads its 2 MB
# of selected latent rows twice (34 GB at 8192 rows, from L2: an 8K-32K context's latent is 8-32 MB).
# The decode kernel reads them four times, with M = 16 heads and 16 positions a step.

# Launch settings from the H200 sweep (triton 3.6, `.whl/s3_dsa_prefill_time.py --sweep`, 8K-32K
# contexts, 2048 and 8192 rows): 32 heads x 32 positions a step, 4 warps, 2 stages runs 85-91 TFLOP/s,
# 5.0x the decode kernel on the same rows (21.1 vs 106.8 ms for 8192 rows at 8K); 8 warps 1.8-3.1x,
# 16 heads at most 3.2x, 3 stages 7-25% slower than 2 at 4 warps.
DSA_PREFILL_HEADS = 32  # heads per program (M of the MMAs; see above why not more)
DSA_PREFILL_BLOCK = 32  # selected positions per step
DSA_PREFILL_WARPS = 4
DSA_PREFILL_STAGES = 2


@triton.jit
def _dsa_prefill_kernel(q_ptr, q_sn, q_sh, lat_ptr, table_ptr, picks_ptr, picks_stride, m_ptr, l_ptr, o_ptr, o_sn,
                        o_sh, start, H, NT, bs, scale, R: tl.constexpr, KPOOL: tl.constexpr, TAIL: tl.constexpr,
                        BH: tl.constexpr, BK: tl.constexpr, ONE: tl.constexpr, TC: tl.constexpr):
    row = tl.program_id(0)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    split = tl.program_id(2)
    r = tl.arange(0, R)
    q = tl.load(q_ptr + row * q_sn + h[:, None] * q_sh + r[None, :], mask=h[:, None] < H, other=0.0)
    q_hi, q_lo = _split(q, lat_ptr.dtype.element_ty)
    pos = start + row
    n_cand = (pos + 1) // KPOOL
    # The row's selection as slots k = 0..n_sel-1. A row with more complete pools than NT: member
    # k % KPOOL of its pick k // KPOOL (picks[row] = the picked pools' cache rows, -1 for one not
    # complete at pos: skipped), then the tail from slot NT·KPOOL on. Otherwise every complete pool,
    # then the tail: positions 0.. in order. Each latent row's address waits for one load (of picks
    # or of the table), not two in a row.
    many = n_cand > NT
    n_sel = tl.where(many, NT, n_cand) * KPOOL
    if TAIL:
        n_sel += pos + 1 - n_cand * KPOOL
    tiles = tl.cdiv(n_sel, BK)
    per_split = tl.cdiv(tiles, tl.num_programs(2))
    m = tl.full([BH], -float("inf"), tl.float32)
    l = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, R], dtype=tl.float32)
    k0 = tl.arange(0, BK)
    for tile in range(split * per_split, tl.minimum((split + 1) * per_split, tiles)):
        k = tile * BK + k0
        picked = k < tl.where(many, NT * KPOOL, 0)
        pick = tl.load(picks_ptr + row * picks_stride + k // KPOOL, mask=picked, other=-1)
        t = tl.where(many, k + (n_cand - NT) * KPOOL, k)  # the position of a slot that is not a pick
        blk = tl.load(table_ptr + t // bs, mask=~picked & (k < n_sel), other=0)
        valid = (k < n_sel) & ((pick >= 0) | ~picked)
        lat_row = tl.where(picked, pick * KPOOL + k % KPOOL, blk * bs + t % bs)
        lat = tl.load(lat_ptr + lat_row[:, None] * R + r[None, :], mask=valid[:, None], other=0.0)
        m, l, acc = _online_softmax_step(q_hi, q_lo, lat, valid, scale, m, l, acc, TC)
    if ONE:
        tl.store(o_ptr + row * o_sn + h[:, None] * o_sh + r[None, :], acc / l[:, None], mask=h[:, None] < H)
    else:  # partial sums for _dsa_combine_kernel
        part = (row * tl.num_programs(2) + split) * H + h
        tl.store(m_ptr + part, m, mask=h < H)
        tl.store(l_ptr + part, l, mask=h < H)
        tl.store(o_ptr + part[:, None] * R + r[None, :], acc, mask=h[:, None] < H)


def dsa_prefill_attention(q_hat: torch.Tensor, latent: torch.Tensor, table: torch.Tensor, start: int,
                          top: torch.Tensor | None, kpool: int, select_tail: bool, scale: float,
                          splits: int | None = None) -> torch.Tensor:
    """dsa_sparse_attention for the n query rows of one sequence's chunk at positions start..start+n-1
    (the same block table `table` [width] for all): softmax_t(q̂ · c_t / scale) · c_t over each row's
    selected positions t. q̂ [n, H, R] fp32 (unit last stride); latent the cache row; top [n, NT] the
    rows' picked pools (dsa_index_scores' top-k: picks not complete at the row's position are skipped,
    a row with no more complete pools than NT takes them all) or None for every complete pool; plus
    the tail with select_tail. Returns o [n, H, R] fp32 in q̂'s memory layout. `splits`: programs
    per (row, head block) (default: more than one only while the rows leave SMs idle)."""
    if q_hat.dim() != 3 or q_hat.dtype != torch.float32 or q_hat.stride(2) != 1:
        raise ValueError(f"dsa_prefill_attention: q_hat must be fp32 [n, H, R] with unit last stride, got "
                         f"{q_hat.dtype} {tuple(q_hat.shape)} {q_hat.stride()}")
    n, H, R = q_hat.shape
    nb, bs = latent.shape[:2]
    _check_cache_row("dsa_prefill_attention: latent", latent, nb, bs, R)
    _check_pow2("dsa_prefill_attention: kv_lora_rank", R)
    if table.dim() != 1 or table.stride(0) != 1:
        raise ValueError(f"dsa_prefill_attention: table must be one sequence's [width] block ids with unit "
                         f"stride, got {tuple(table.shape)} {table.stride()}")
    if bs % kpool or start < 0 or start + n > table.shape[0] * bs:
        raise ValueError(f"dsa_prefill_attention: positions {start}..{start + n - 1} do not fit a table of "
                         f"{table.shape[0]} blocks of {bs} (a multiple of kpool {kpool})")
    ppb = bs // kpool
    if top is None:
        NT, picks = table.shape[0] * ppb, table  # every row has at most NT candidates: picks is not read
    elif top.dim() != 2 or top.shape[0] != n:
        raise ValueError(f"dsa_prefill_attention: top must be [{n}, NT], got {tuple(top.shape)}")
    else:
        NT = top.shape[1]
        # the picked pools' rows of the cache (blocks of ppb pools), -1 for a pool not complete at the row
        n_cand = (torch.arange(start + 1, start + n + 1, device=top.device) // kpool)[:, None]
        pool = torch.where(top < n_cand, top, 0)
        picks = torch.where(top < n_cand, table[pool // ppb] * ppb + pool % ppb, -1).contiguous()
    BH = min(DSA_PREFILL_HEADS, max(16, triton.next_power_of_2(H)))  # tl.dot needs >= 16 rows
    head_blocks = triton.cdiv(H, BH)
    if splits is None:
        programs = torch.cuda.get_device_properties(q_hat.device).multi_processor_count if q_hat.is_cuda else 2
        tiles = triton.cdiv((min(NT, table.shape[0] * ppb) + select_tail) * kpool, DSA_PREFILL_BLOCK)
        splits = max(1, min(tiles, programs // (n * head_blocks)))
    o = torch.empty_like(q_hat)
    one = splits == 1
    if one:
        m = l = acc = o  # pointers the kernel does not use
    else:
        m = torch.empty(n, splits, H, dtype=torch.float32, device=q_hat.device)
        l = torch.empty_like(m)
        acc = torch.empty(n, splits, H, R, dtype=torch.float32, device=q_hat.device)
    out = o if one else acc
    _dsa_prefill_kernel[(n, head_blocks, splits)](
        q_hat, q_hat.stride(0), q_hat.stride(1), latent, table, picks, picks.stride(0), m, l, out, out.stride(0),
        out.stride(1), start, H, NT, bs, scale, R=R, KPOOL=kpool, TAIL=bool(select_tail), BH=BH,
        BK=DSA_PREFILL_BLOCK, ONE=one, TC=q_hat.is_cuda, num_warps=DSA_PREFILL_WARPS,
        num_stages=DSA_PREFILL_STAGES)
    if not one:
        _dsa_combine_kernel[(n, H)](m, l, acc, o, o.stride(0), o.stride(1), H, splits, R=R,
                                    SP=triton.next_power_of_2(splits))
    return o

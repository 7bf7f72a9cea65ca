"""EXL3 linears in Triton (spec exl3.md), each kernel with its pure-torch twin in exl3.py.

Twins: `exl3_decode` is `exl3.unpack`, `exl3_gemv`
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
each trellis tile in registers once per tile of up to 256 rows of that expert.

Like kernels.py, this file imports neither exl3.py nor model_glm.py (they sit above it); it takes
two small helpers from kernels.py (the result buffer and the block_n check the FP8 GEMV shares).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels import _COMPILED, _check_block_n, _out_buffer, _pdl, _pdl_enter, _pow2_scale, _sm_count

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
    # spec §2.3; CB 0 = 3INST, 1 = MCG, 2 = MUL1. All products are mod 2^32 (uint32). zero: 0, from
    # _opaque_zero in the hot loops.
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
        x = (x & 0x8FFF8FFF) ^ (zero + 0x3B603B60)
        if _COMPILED:
            # The same add as below, written per weight on the halves of x's register: one HADD2 (FMA
            # pipe) a weight and one PRMT a pair to pack; from `lo + hi` ptxas makes two PRMTs (ALU pipe,
            # the busier one) and one HADD2 a pair. H200, batch-1 MoE decode: 1.06-1.08x at K3.
            value = tl.inline_asm_elementwise(
                "{ .reg .b16 l, h; mov.b32 {l, h}, $1; add.rn.f16 $0, l, h; }", "=h,r", [x],
                dtype=tl.float16, is_pure=True, pack=1)
        else:
            lo = (x & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
            hi = (x >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
            value = lo + hi  # fp16 add: the exact sum rounded once (both halves lie in ±[0.125, 2))
    return value


@triton.jit
def _opaque_zero(k):
    # 0 for a size k >= 0, in a form no compiler can see is 0, for _codebook: its xor constant is then
    # zero + C, a loop-invariant register, and its mask and xor one LOP3 a weight ((x & M) ^ R) instead
    # of two (on sm_90, M and C cannot both be immediates of one LOP3). The shift is inline PTX because
    # LLVM folded a plain k >> 31 in the prefill kernels; the constant is zero + C, not zero | C, because
    # ptxas splits an or back out. Triton 3.6, sm_90: prefill loops 10-12 % shorter, the decode kernels'
    # as before; H200: MoE prefill 1.05-1.07x at 2048 tokens, 1.10x at 1024, 1.02-1.04x at 8192.
    if _COMPILED:
        z = tl.inline_asm_elementwise("shr.s32 $0, $1, 31;", "=r,r", [k], dtype=tl.int32, is_pure=True, pack=1)
    else:
        z = k >> 31
    return z.to(tl.uint32)


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
    _pdl_enter()
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


@triton.constexpr_function
def _lane(k2: int, name: str) -> int | bool:
    # The lane geometry of rate k2 (K2 = 2K) that the decode loops specialize on, computed once here at
    # compile time: _lane(K2, "NL") and so on inside the kernels. Position 8L + j of a tile ends at ring
    # bit 4 L K2 + (((j + 1) K2) >> 1), so relative to the start b_L of lane L's first state, state j
    # starts at the compile-time bit ((j + 1) K2 >> 1) - (K2 >> 1), and all 8 end span bits after b_L.
    # Only b_L's offset in its word depends on the lane, unless 4 K2 is a multiple of 32 (STATIC: then
    # it is BASE for every lane). Otherwise that offset o = (4 L K2 + (K2 >> 1) + 16) mod 32 steps by
    # g = gcd(4 K2, 32) from lane to lane, so it is at most o_max. When every state of every lane then
    # lies in the lane's first two words (DIRECT: K <= 3), each state is one 64-bit shift of those by o
    # plus a constant (on sm_90 one SHF.L.U64.HI and the shift down: K3 467 loop instructions against
    # 476 with the realignment); other rates shift the lane's words once per step so that they start
    # at b_L (NR realigned words from NL loaded ones), and every state is then a shift by a constant.
    span = ((8 * k2) >> 1) - (k2 >> 1) + 16
    static = (4 * k2) % 32 == 0
    base = ((k2 >> 1) + 16) % 32 if static else 0
    nr = (span + 31) // 32
    g = 32 if k2 % 8 == 0 else (16 if k2 % 4 == 0 else (8 if k2 % 2 == 0 else 4))
    o_max = (((k2 >> 1) + 16) % g) + 32 - g
    direct = not static and span + o_max <= 64
    nl = (base + span + 31) // 32 if static else (2 if direct else nr + 1)
    return {"STATIC": static, "BASE": base, "NR": nr, "DIRECT": direct, "NL": nl}[name]


@triton.jit
def _load_step(p0, p1, p2, p3, delta, x_ptrs, x_delta, x_ok, K2: tl.constexpr):
    # One step's NL ring words of every lane of RT x CT tiles (word pointers p0..p3 plus delta), and
    # its activations (x_ptrs plus x_delta). The callers form the pointers once, outside their loop,
    # and pass the step as a scalar delta: each load's address is then one IMAD.WIDE on sm_90 (a
    # per-step base plus a per-lane offset took a 64-bit add, two instructions, per load).
    NL: tl.constexpr = _lane(K2, "NL")
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
                   CT: tl.constexpr):
    # Ŵ^T [CT * 16, RT * 16] fp16 of one step from every lane's ring words, in the mma A-operand
    # layout (rows: output columns, columns: k, both natural).
    STATIC: tl.constexpr = _lane(K2, "STATIC")
    BASE: tl.constexpr = _lane(K2, "BASE")
    NR: tl.constexpr = _lane(K2, "NR")
    DIRECT: tl.constexpr = _lane(K2, "DIRECT")
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
              RT: tl.constexpr, CT: tl.constexpr):
    # acc [CT * 16, 16] += Ŵ^T · B for one step of RT x CT tiles: y^T = Ŵ^T x^T, so that the decoded
    # weights are the mma A operand, whose fragment is exactly a lane's 8 states (spec §3: rows
    # 2(L%4) + {0, 1, 8, 9} of Ŵ, columns L/4 and L/4 + 8) and never leave the registers (on sm_90
    # triton 3.6 makes this a wgmma with A in registers). B holds each fp32 activation row as fp16
    # hi (column i) and lo * 2^11 (column MP + i) parts, so the fp16 products summed in fp32 lose
    # nothing that matters: the 2^11 keeps lo out of fp16's subnormals for |x| >= 2^-14 (without it
    # a MoE layer with ~1e-4 activations was 6.5e-3 off on the H200); |x| must stay below 65504, as
    # in exllamav3's fp16 path.
    # Columns from 2 MP on are zero.
    w = _decoded_tiles(w0, w1, w2, w3, o, zero, K2, CB, RT, CT)
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
    tiles_n = n // 16
    zero = _opaque_zero(k)
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
    w0, w1, w2, w3, x = _load_step(p0, p1, p2, p3, 0, xp, 0, x_ok, K2)
    for step_index in range(0, steps, 2):
        ahead = tl.minimum(step_index + 1, steps - 1)
        n0, n1, n2, n3, nx = _load_step(p0, p1, p2, p3, ahead * step_words, xp, ahead * (RT * 16), x_ok, K2)
        if 2 * MP < 16:
            # x is already zero outside x_ok; saying so again after the loop-carried copy lets the
            # compiler drop the B elements that are zero by their place (columns from 2 MP on), whose
            # conversions otherwise ran every other step (sm_90 MoE loop, K3: 467 -> 443 instructions).
            x = tl.where(x_ok, x, 0.0)
        acc = _step_dot(w0, w1, w2, w3, x, o, zero, acc, K2, CB, MP, RT, CT)
        ahead = tl.minimum(step_index + 2, steps - 1)
        w0, w1, w2, w3, x = _load_step(p0, p1, p2, p3, ahead * step_words, xp, ahead * (RT * 16), x_ok, K2)
        if step_index + 1 < steps:
            acc = _step_dot(n0, n1, n2, n3, nx, o, zero, acc, K2, CB, MP, RT, CT)

    # Columns i and MP + i (hi and lo * 2^11 parts) make row i; columns from 2 MP on are zero.
    part = tl.where(tl.arange(0, 2)[None, :, None, None] == 0, 1.0, 1.0 / 2048.0)
    z = tl.sum(tl.sum(tl.reshape(tl.trans(acc), [16 // (2 * MP), 2, MP, CT * 16]) * part, axis=1), axis=0)
    return z


@triton.jit
def _gemv_kernel(xh_ptr, svh_ptr, words_ptr, slab_ptr, arrivals_ptr, y_ptr,
                 m, k, n, steps, split, arrivals,
                 K2: tl.constexpr, CB: tl.constexpr, MP: tl.constexpr, RT: tl.constexpr, CT: tl.constexpr,
                 SP: tl.constexpr):
    # Each program stores its split's products in its own slab rows; the last to arrive at a
    # 128-column block adds them up in split order (the same bits every run), then the epilogue.
    _pdl_enter()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    z = _gemv_products(xh_ptr, words_ptr, m, k, n, steps, pid_n, pid_k, K2, CB, MP, RT, CT)
    cols = pid_n * CT * 16 + tl.arange(0, CT * 16)[None, :]
    tl.store(slab_ptr + (pid_k * 16 + tl.arange(0, MP)[:, None]) * n + cols, z, mask=tl.arange(0, MP)[:, None] < m)
    tl.debug_barrier()
    block = pid_n * CT * 16 // 128
    arrived = tl.atomic_add(arrivals_ptr + block, 1, sem="acq_rel")
    if arrived == arrivals - 1:
        _gemv_output(slab_ptr, arrivals_ptr, svh_ptr, y_ptr, m, n, split, block, SP, MP)


@triton.jit
def _gemv_output(slab_ptr, arrivals_ptr, svh_ptr, y_ptr, m, n, split, block, SP: tl.constexpr, MP: tl.constexpr):
    # y[:, block] = (z · H128) ⊙ svh in fp32, rounded once to fp16. Row r of z, the sum of its split
    # rows, comes from one load of all of them, unrolled over the rows so the loads overlap (a loop of
    # dependent loads over the splits cost 2-3 us at split 32, H200), read at L2 (.cg: where the other
    # programs' stores are, never a stale L1 line).
    i = tl.arange(0, 128)
    cols = block * 128 + i
    s = tl.arange(0, SP)[:, None]
    rows = tl.arange(0, MP)[:, None]
    z = tl.zeros([MP, 128], tl.float32)
    for r in tl.static_range(MP):
        z_r = tl.sum(tl.load(slab_ptr + (s * 16 + r) * n + cols[None, :], mask=s < tl.where(r < m, split, 0),
                             other=0.0, cache_modifier=".cg"), axis=0)
        z = tl.where(rows == r, z_r[None, :], z)
    tl.store(arrivals_ptr + block, 0)
    svh = 0.08838834764831845 * tl.load(svh_ptr + cols).to(tl.float32)  # 1/sqrt(128) ⊙ svh
    y = _times_hadamard(z, MP) * svh[None, :]
    tl.store(y_ptr + rows * n + cols[None, :], y.to(tl.float16), mask=rows < m)


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
_SPLIT_BUFFERS: dict[tuple[torch.device, int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _split_buffers(device: torch.device, n: int, split: int) -> tuple[torch.Tensor, torch.Tensor]:
    # fp32 slab rows [split, 16, n] (each split's products for the epilogue's row block, written
    # before they are read) and per-128-column arrival counters, which the kernel leaves zeroed. They
    # are allocated once per (device, n, split) and never freed: CUDA graphs captured with them keep
    # valid addresses. Two launches must not run at once (one stream, or streams joined in between).
    key = (device, n, split)
    if key not in _SPLIT_BUFFERS:
        _SPLIT_BUFFERS[key] = (torch.empty(split * 16 * n, dtype=torch.float32, device=device),
                               torch.zeros(n // 128, dtype=torch.int32, device=device))
    return _SPLIT_BUFFERS[key]


def _default_split(device: torch.device, n: int, steps: int, block_n: int) -> int:
    # Enough programs to cover every SM a few times; the split must divide the loop steps.
    sms = _sm_count(device)
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
    slab, counters = _split_buffers(x.device, n, split)
    for row in range(0, m, GEMV_ROWS):
        rows = min(GEMV_ROWS, m - row)
        xh = torch.empty((rows, k), dtype=torch.float32, device=x.device)
        _rotate_input_kernel[(k // 128,)](x[row:], suh, xh, rows, k, launch_pdl=_pdl())
        _gemv_kernel[(n // block_n, split)](
            xh, svh, words, slab, counters, out[row:], rows, k, n, tiles_k // (split * row_tiles), split,
            split * 128 // block_n, K2=k2, CB=CODEBOOKS.index(codebook), MP=triton.next_power_of_2(rows),
            RT=row_tiles, CT=block_n // 16, SP=triton.next_power_of_2(split), num_warps=num_warps,
            num_stages=num_stages, launch_pdl=_pdl())
    return out



# ---------------------------------------------------------------- EXL3 MoE decode: all selected experts at once
# For P = m * top_k (token, expert) pairs of one MoE layer, in three launches whatever P:
#   1. rotate x for every pair with its expert's gate and up suh;
#   2. gate and up GEMV over all pairs (program axis 2 = projection and pair, expert id read on the
#      device); the last program to finish a 128-column block of a pair (counted over both
#      projections) adds up the K splits' rows, applies H128 and svh to gate and up, the clamped
#      SwiGLU (spec glm53.md §4.5), and the down projection's input rotation (⊙ suh_down, H128): the
#      block is ready for 3.;
#   3. down GEMV over all pairs; the last program of a block adds up the splits, applies H128, svh
#      and the routing weight and stores the pair's row; the last of a token's pairs to do so adds
#      the token's rows into its fp32 output row.
# Every sum has a fixed order (no atomic adds of values, only arrival counters), so the same inputs
# give the same bits in every run, as the FP8 GEMV's split-k does (kernels._fp8_finish).
# Twin: Σ_j w_j · down_e(swiglu(gate_e(x), up_e(x))) with exl3.EXL3Linear experts and model_glm.swiglu
# (tests/test_kernels.py); the kernel keeps the intermediates in fp32 where the twin rounds each
# linear's output to the activation dtype.


MOE_CAP_ROWS = 4  # rows from which the K <= 3 GEMV gets 128 registers (_moe_registers)
# Rows from which the rotation runs at 1 warp a (pair, block) instead of 4 (the same bits). H100, whole
# 20-layer decode steps at 1K of context, 4 alternating rounds (`.notes/s36_trees.py`): 1.006x at B 4
# (every round above main's), 1.000x at B 1 and 16.
MOE_ROTATE_ONE_WARP_ROWS = 4


def _moe_registers(k2: int, m: int) -> dict:
    # The GEMV's registers by rate and rows: at K <= 3 (DIRECT lanes) ptxas, left alone, stops at 96 (gate /
    # up) and 124 (down) registers and spends loop instructions to stay there; given 128, the sm_90 K3 loop
    # is 444 against 465 (gate / up) and 445 against 458 (down) instructions, without spills (triton 3.6).
    # H200, K3 top-8 of 288, 4096x2048: 1.06x at 4 and 16 rows, but 0.94x at one (the occupancy lost
    # costs more there); K4: 0.99-1.00x.
    return {"maxnreg": 128} if _lane(k2, "DIRECT") and m >= MOE_CAP_ROWS else {}


@triton.jit
def _moe_rotate_kernel(x_ptr, ids_ptr, suh_gate_ptr, suh_up_ptr, xh_ptr, k, top_k, pairs):
    # xh[0 | 1, p, block] = (x[token] ⊙ suh_gate | suh_up [e]) · H128 / sqrt(128), in the gemv's row
    # order, e = ids[p]. The router's top-k is a launch of its own before this one (kernels.route_pick, at
    # one warp). Picking in each of these programs instead, as this launch once did, made the serial chain
    # of max reductions meet across 4 warps and repeated it for every (pair, block). H100, router and
    # rotation of 20 layers in a CUDA graph: the same at B 1 (10.93 against 10.86 us a layer), 1.18x at
    # B 4 (12.03 against 14.24), 1.52x at B 16 (18.87 against 28.70).
    _pdl_enter()
    blk = tl.program_id(0)
    p = tl.program_id(1)
    i = tl.arange(0, 128)
    x = tl.load(x_ptr + (p // top_k) * k + blk * 128 + i).to(tl.float32)
    e = tl.load(ids_ptr + p).to(tl.int64)
    r = i % 16
    slot = blk * 128 + i - r + 4 * ((r >> 1) & 3) + 2 * (r >> 3) + (r & 1)
    # Both signs before the first Hadamard: its shuffles through shared memory (barriers) would hold
    # the second load back for a round trip of its own.
    suh_gate = tl.load(suh_gate_ptr + e * k + blk * 128 + i).to(tl.float32)
    suh_up = tl.load(suh_up_ptr + e * k + blk * 128 + i).to(tl.float32)
    tl.store(xh_ptr + p * k + slot[None, :], _times_hadamard((x * suh_gate)[None, :], 1) * 0.08838834764831845)
    tl.store(xh_ptr + (pairs + p) * k + slot[None, :], _times_hadamard((x * suh_up)[None, :], 1) * 0.08838834764831845)


@triton.jit
def _moe_gemv_kernel(xh_ptr, words_ptr, words_up_ptr, ids_ptr, slab_ptr, arrivals_ptr, k, n, steps, split, arrivals,
                     expert_words, pairs, svh_a_ptr, svh_b_ptr, suh_next_ptr, route_ptr, pair_ptr, tokens_ptr,
                     out_ptr, top_k, limit, K2: tl.constexpr, CB: tl.constexpr, RT: tl.constexpr, CT: tl.constexpr,
                     SP: tl.constexpr, KP: tl.constexpr, DOWN: tl.constexpr):
    # Program (pid_n, pid_k, q): one row, its expert's trellis. Gate and up share a launch: q is
    # half * pairs + p with half 0 for gate (words_ptr) and 1 for up (words_up_ptr); down has q = p.
    # Sums in a fixed order, so that a launch gives the same bits every run: each program stores its
    # split's products in its own slab row, and the last to arrive at a 128-column block adds the
    # split rows up; in down, the last pair of a token to finish a block adds the token's top_k rows.
    _pdl_enter()
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
    tl.store(slab_ptr + ((p * parts + half) * split + pid_k) * n + cols, z)
    tl.debug_barrier()
    block = pid_n * CT * 16 // 128
    counter = arrivals_ptr + p * (n // 128) + block
    arrived = tl.atomic_add(counter, 1, sem="acq_rel")
    if arrived == arrivals - 1:
        i = tl.arange(0, 128)
        c = block * 128 + i
        s = tl.arange(0, SP)[:, None]
        rows = s < split
        # Every load of the block's finish is issued at once, before the Hadamards' exchanges between warps
        # (barriers) would put each behind the one before.
        svh_a = tl.load(svh_a_ptr + e * n + c).to(tl.float32)
        if DOWN:
            route = tl.load(route_ptr + p)
            # .cg: read at L2, where the other programs' stores are, never a stale L1 line.
            total = tl.sum(tl.load(slab_ptr + (p * split + s) * n + c[None, :], mask=rows, other=0.0,
                                   cache_modifier=".cg"), axis=0)[None, :]
            y = _times_hadamard(total, 1)
            scale = 0.08838834764831845 * svh_a * route
            t = p // top_k
            tl.store(pair_ptr + p * n + c[None, :], y * scale[None, :])
            tl.debug_barrier()
            done = tl.atomic_add(tokens_ptr + t * (n // 128) + block, 1, sem="acq_rel")
            if done == top_k - 1:
                j = tl.arange(0, KP)[:, None]
                mine = tl.load(pair_ptr + (t * top_k + j) * n + c[None, :], mask=j < top_k, other=0.0,
                               cache_modifier=".cg")
                tl.store(out_ptr + t * n + c, tl.sum(mine, axis=0))
                tl.store(tokens_ptr + t * (n // 128) + block, 0)
        else:
            svh_b = tl.load(svh_b_ptr + e * n + c).to(tl.float32)
            suh = tl.load(suh_next_ptr + e * n + c).to(tl.float32)
            gate_rows = tl.load(slab_ptr + (2 * p * split + s) * n + c[None, :], mask=rows, other=0.0,
                                cache_modifier=".cg")
            up_rows = tl.load(slab_ptr + ((2 * p + 1) * split + s) * n + c[None, :], mask=rows, other=0.0,
                              cache_modifier=".cg")
            gate = _times_hadamard(tl.sum(gate_rows, axis=0)[None, :], 1)
            up = _times_hadamard(tl.sum(up_rows, axis=0)[None, :], 1)
            gate = gate * (0.08838834764831845 * svh_a)[None, :]
            up = up * (0.08838834764831845 * svh_b)[None, :]
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
            act = gate * tl.sigmoid(gate) * up
            act_h = _times_hadamard(act * suh[None, :], 1) * 0.08838834764831845
            r = i % 16
            slot = i - r + 4 * ((r >> 1) & 3) + 2 * (r >> 3) + (r & 1)
            tl.store(out_ptr + p * n + block * 128 + slot[None, :], act_h)
        tl.store(counter, 0)


_MOE_BUFFERS: dict[tuple, tuple[torch.Tensor, ...]] = {}


def _moe_buffers(device: torch.device, pairs: int, n: int, parts: int, split: int,
                 tokens: int) -> tuple[torch.Tensor, ...]:
    # The split rows [pairs, parts, split, n] fp32, arrival counters [pairs, n / 128], and for down
    # the pairs' weighted rows [pairs, n] fp32 and the tokens' counters [tokens, n / 128]. Each slab
    # and pair row is written before it is read, and the kernel leaves the counters zeroed, so they
    # are allocated once and never freed (graph-safe, one stream).
    key = (device, pairs, n, parts, split, tokens)
    if key not in _MOE_BUFFERS:
        _MOE_BUFFERS[key] = (torch.empty(pairs * parts * split * n, dtype=torch.float32, device=device),
                             torch.zeros(pairs * (n // 128), dtype=torch.int32, device=device),
                             torch.empty(pairs * n if parts == 1 else 0, dtype=torch.float32, device=device),
                             torch.zeros(tokens * (n // 128), dtype=torch.int32, device=device))
    return _MOE_BUFFERS[key]


def _moe_split(device: torch.device, n: int, pairs: int, steps: int, block_n: int) -> int:
    # Up to 8 programs per SM: on the H200 that was 2-3% faster than 4 at batch 1 (twice measured).
    sms = _sm_count(device)
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
    m, top_k = ids.shape
    ids = ids.reshape(-1).to(torch.int32).contiguous()
    route = route.reshape(-1).float().contiguous()
    _check_block_n(block_n)
    P = m * top_k
    dev = x.device
    x = x.contiguous()
    words = [t[0].contiguous().view(torch.int32) for t in (gate, up, down)]
    NW = 4 * k2
    cb = CODEBOOKS.index(codebook)

    xh = torch.empty((2, P, D), dtype=torch.float32, device=dev)
    y = torch.empty((m, D), dtype=torch.float32, device=dev)
    _moe_rotate_kernel[(D // 128, P)](x, ids, gate[1], up[1], xh, D, top_k, P,
                                      num_warps=1 if m >= MOE_ROTATE_ONE_WARP_ROWS else 4, launch_pdl=_pdl())

    act_h = torch.empty((P, I), dtype=torch.float32, device=dev)
    steps = D // 16 // row_tiles
    split = _moe_split(dev, I, 2 * P, steps, block_n)
    slab, counters, _, _ = _moe_buffers(dev, P, I, 2, split, 0)
    launch = dict(K2=k2, CB=cb, RT=row_tiles, CT=block_n // 16, KP=triton.next_power_of_2(top_k),
                  num_warps=num_warps, launch_pdl=_pdl(), **_moe_registers(k2, m))
    _moe_gemv_kernel[(I // block_n, split, 2 * P)](
        xh, words[0], words[1], ids, slab, counters, D, I, steps // split, split, 2 * split * 128 // block_n,
        (D // 16) * (I // 16) * NW, P, gate[2], up[2], down[1], route, slab, counters, act_h, top_k, limit,
        SP=triton.next_power_of_2(split), DOWN=False, **launch)

    steps = I // 16 // row_tiles
    split = _moe_split(dev, D, P, steps, block_n)
    slab, counters, pair_rows, token_counters = _moe_buffers(dev, P, D, 1, split, m)
    _moe_gemv_kernel[(D // block_n, split, P)](
        act_h, words[2], words[2], ids, slab, counters, I, D, steps // split, split, split * 128 // block_n,
        (I // 16) * (D // 16) * NW, P, down[2], down[2], down[1], route, pair_rows, token_counters, y, top_k,
        limit, SP=triton.next_power_of_2(split), DOWN=True, **launch)
    return y


# ---------------------------------------------------------------- EXL3 MoE prefill: many rows per expert
# For P = m * top_k (row, expert) pairs of one MoE layer, sorted by expert (argsort on the device; no
# host synchronization), in five launches:
#   1. per sorted pair, the token's row read once and held in registers (`_prefill_rotate_kernel`):
#      rotated for gate and for up ((x ⊙ suh_e) · H128, fp32), each stored in fp16 times a per-row power
#      of two that puts the row's largest value in [2^9.5, 2^14) (from a bound, see _rotate_row): exact,
#      and it keeps small activations out of fp16's subnormals (spec §4 allows any fp16 suh);
#   2. gate and up as one grouped GEMM (`_prefill_gemm_kernel`): a program owns a tile of BM sorted
#      pairs of one expert, one 128-column block and one projection, runs over all of k decoding each
#      16x16 trellis tile in registers straight into tl.dot's A operand (Ŵ^T, as exl3_gemv does; the
#      activations are B, [16 RT, BM] fp16), so a weight is decoded once per BM rows, the ALU only
#      decodes and the tensor cores multiply, and stores the raw fp32 products;
#   3. per sorted pair, whole rows in registers (`_prefill_swiglu_kernel`): H128, the row scale's
#      inverse and svh of both projections, the clamped SwiGLU (glm53.md §4.5), ⊙ suh_down and H128
#      again, then fp16 with per-row powers of two as in 1.;
#   4. down as the same grouped GEMM, its raw products by sorted pair;
#   5. each token's output row (`_token_sum_kernel`): per pair the routing weight, the row scale,
#      H128 and svh, then the top_k pairs added in a fixed order;
# plus the small torch ops that sort, rank each pair in that order and build the tile table
# [tiles, 3] = (expert, first sorted pair, rows). The grid covers cdiv(P, BM) + E tiles, an upper
# bound; programs past the real tiles do nothing. BM follows the mean rows per expert (32, 128 or
# 256): at 8K tokens (228 pairs per expert) most experts fit one 256-row tile, so each weight is
# decoded about once per layer instead of once per row as in the per-expert path, and no decoded
# weight is written to memory.
# Transient memory: at most 4 P D + 8 P I bytes (2.1 GB at 8K tokens of the full model).
# Twin: the per-expert fp32 sum Σ_j w_j · down_e(swiglu(gate_e(x), up_e(x))) with exl3.EXL3Linear
# (tests/test_kernels.py); activations enter the tensor cores as fp16 (11 significant bits), which
# sets the precision (~5e-4 relative), as in EXL3Linear's GEMM path.

# Launch settings from the H200 sweep at 8K tokens' sizes (P 65536, I 2048, D 4096; `.whl/s25_epi_ab.py`):
# the SwiGLU kernel at 1 warp a pair 626 us (2, 4, 8 warps: 651, 719, 744); the token sum at 4 blocks and
# 1 warp 335 us (8 blocks at 2 and 4 warps: 407, 414; 16 and 32 blocks 422-461).
PREFILL_SWIGLU_WARPS = 1  # a program holds one sorted pair's row
TOKEN_SUM_BLOCKS = 4  # 128-column blocks of a token's row a program sums
TOKEN_SUM_WARPS = 1
# block_m's own choice by the mean pairs per expert: 32-row tiles up to PREFILL_128_ROWS, then 128 up to
# PREFILL_256_ROWS, then 256. H200, full-size experts, K3 and K4, skewed routing (`.whl/s12_sweep.py`),
# the best tile and the others' time against it: 7 and 14 pairs (256 and 512 tokens) 32 rows, 16 rows
# 1.02-1.19x; 43 pairs 32 rows, 128 1.07x, 64 1.35x; 57 pairs 128 rows, 32 1.02x, 64 1.31x; 71-114
# pairs 128 rows; 142 pairs 128 rows by 0.5-1 %; 171 pairs 256 rows by 2-4 %; 228 pairs 256 rows, 1.10x.
# Tiles of 16 and 64 rows stay for callers that ask for them.
PREFILL_128_ROWS = 48
PREFILL_256_ROWS = 160
# The rotation at 1 warp a sorted pair. H200, D 4096, top-8 of 288 experts, against the former kernel (4 pairs and
# one 128-block span a program, the row read twice: once for its scale's bound, once to rotate; the same bits):
# 8192 rows 1.00-1.04x alone but 0.965x inside an 8K prefill (769 vs 741 us), 1024 rows 1.07-1.23x, 8 and 32 rows
# 1.45-1.53x (`.whl/s27_rot_ab.py`, `s27_rot_ab2.py`, `s24_prefill_prof.py`).
# 2, 4 and 8 warps: 0.90-1.01x at 8192 rows. The Hadamard on the tensor cores (fp16 hi + lo pieces times
# sqrt(128) H128) took as many instructions a pair and ran 0.42-0.71x at 8192 rows.
PREFILL_ROTATE_WARPS = 1


@triton.jit
def _rotate_row(x, suh_ptrs, inside, out_ptrs, inv_ptr, NB: tl.constexpr):
    # out = fp16((x ⊙ suh) · H128 · scale), inv = 1 / scale, for one row held as [NB, 128] (its 128-blocks
    # as rows). The scale comes from a bound on the row's largest rotated value instead of the value
    # itself: an element of v · H128 / sqrt(128) (orthonormal) is at most |v|, the 128-block's L2 norm.
    # The largest value then lands in [2^13 / sqrt(128), 2^14): far from overflow and from fp16's
    # subnormals, and a power-of-two scale does not change a normal fp16's rounding, so the products are
    # those of the exact peak's scale.
    v = x * tl.load(suh_ptrs, mask=inside, other=0.0).to(tl.float32)
    scale, inv = _pow2_scale(tl.max(tl.sqrt(tl.sum(v * v, axis=1)), axis=0), 13)
    tl.store(inv_ptr, inv)
    xh = _times_hadamard(v, NB) * (scale * 0.08838834764831845)  # 1/sqrt(128) of the normalized H128
    tl.store(out_ptrs, xh.to(tl.float16), mask=inside)


@triton.jit
def _prefill_rotate_kernel(x_ptr, order_ptr, ids_ptr, suh_gate_ptr, suh_up_ptr, xs_ptr, xs_proj, inv_ptr, P, D,
                           top_k, NB: tl.constexpr):
    # Program (sorted pair s): its rows of xs [2, P, D] and inv [2, P] for gate and for up, from one read
    # of the token's row x, which stays in registers as [NB, 128].
    s = tl.program_id(0).to(tl.int64)
    pair = tl.load(order_ptr + s)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    tok = (pair // top_k).to(tl.int64)
    i = tl.arange(0, NB)[:, None] * 128 + tl.arange(0, 128)[None, :]
    inside = i < D
    x = tl.load(x_ptr + tok * D + i, mask=inside, other=0.0).to(tl.float32)
    _rotate_row(x, suh_gate_ptr + e * D + i, inside, xs_ptr + s * D + i, inv_ptr + s, NB)
    _rotate_row(x, suh_up_ptr + e * D + i, inside, xs_ptr + xs_proj + s * D + i, inv_ptr + P + s, NB)


@triton.jit
def _projection_blocks(z, factor, svh):
    # One projection's outputs from its raw products z [NB, 128] (a row's 128-blocks as rows): times the
    # row's factor (the row scale's inverse; for down also the routing weight), H128 and svh [NB, 128].
    # H128 on a tile whose rows are the blocks runs at the bandwidth of a copy (H200: 4.0 TB/s at 1 to 64
    # blocks a program); a row held as [rows, I] and reshaped to blocks took its kernel to a third of that.
    NB: tl.constexpr = z.shape[0]
    return _times_hadamard(z * factor, NB) * (0.08838834764831845 * svh)


@triton.jit
def _prefill_swiglu_kernel(gu_ptr, gu_proj, inv_gate_ptr, inv_up_ptr, order_ptr, ids_ptr, svh_gate_ptr, svh_up_ptr,
                           suh_down_ptr, out_ptr, out_inv_ptr, I, limit, NB: tl.constexpr):
    # Program (sorted pair s): the down GEMM's input row from gate's and up's raw products gu [2, P, I]:
    # act = (swiglu(gate, up) ⊙ suh_down) · H128, stored as fp16(act · scale) with its 1 / scale
    # (`kernels._pow2_scale` of the row's largest |act|); the row stays in registers as [NB, 128] throughout.
    s = tl.program_id(0).to(tl.int64)
    e = tl.load(ids_ptr + tl.load(order_ptr + s)).to(tl.int64)
    i = tl.arange(0, NB)[:, None] * 128 + tl.arange(0, 128)[None, :]
    inside = i < I
    gate = tl.load(gu_ptr + s * I + i, mask=inside, other=0.0)
    svh = tl.load(svh_gate_ptr + e * I + i, mask=inside, other=0.0).to(tl.float32)
    gate = tl.minimum(_projection_blocks(gate, tl.load(inv_gate_ptr + s), svh), limit)
    up = tl.load(gu_ptr + gu_proj + s * I + i, mask=inside, other=0.0)
    svh = tl.load(svh_up_ptr + e * I + i, mask=inside, other=0.0).to(tl.float32)
    up = _projection_blocks(up, tl.load(inv_up_ptr + s), svh)
    act = gate * tl.sigmoid(gate) * tl.minimum(tl.maximum(up, -limit), limit)
    suh = tl.load(suh_down_ptr + e * I + i, mask=inside, other=0.0).to(tl.float32)
    act = _times_hadamard(act * suh, NB) * 0.08838834764831845
    scale, inv = _pow2_scale(tl.max(tl.max(tl.abs(act), axis=1), axis=0), 13)
    tl.store(out_inv_ptr + s, inv)
    tl.store(out_ptr + s * I + i, (act * scale).to(tl.float16), mask=inside)


@triton.jit
def _prefill_products(words_ptr, xs_ptr, rows_ok, k, n, pid_n,
                      K2: tl.constexpr, CB: tl.constexpr, RT: tl.constexpr, BM: tl.constexpr):
    # acc [128, BM] fp32 = (xs[:BM] · Ŵ[:, 128 pid_n : 128 (pid_n + 1)])^T for one expert's trellis
    # words (k x n) and BM fp16 rows at xs_ptr (row stride k; rows_ok [1, BM] masks the tile's end).
    # Lanes as in _gemv_products (geometry: _lane): one thread element = one mma lane of one 16x16 tile.
    CT: tl.constexpr = 8
    NW: tl.constexpr = 4 * K2
    tiles_n = n // 16
    zero = _opaque_zero(k)
    o, off0, off1, off2, off3 = _lane_words(tiles_n, pid_n, K2, RT, CT)
    x_off = tl.arange(0, BM)[None, :] * k + tl.arange(0, RT * 16)[:, None]  # B [RT * 16, BM] = xs^T
    steps = k // (RT * 16)
    step_words = RT * tiles_n * NW
    acc = tl.zeros([CT * 16, BM], tl.float32)
    # Each step loads the next step's words and activations before decoding its own (the last step
    # re-reads its own). At 128-row tiles the activations are instead a plain load into the dot, which
    # triton's pipeliner turns into async copies into shared memory, num_stages deep, without the
    # registers' trip through them (H200, full-size experts, 8K rows: 1.12x at K3, 1.15x at K4); at the
    # small tiles of short prompts that form is slower (1K rows, 32-row tiles: 0.95x). The register
    # prefetch of x (nx) is then unused, and the compiler drops its loads (sm_90: LDG 12 -> 8 a step).
    PIPELINED: tl.constexpr = BM >= 128
    p0, p1, p2, p3, xp = words_ptr + off0, words_ptr + off1, words_ptr + off2, words_ptr + off3, xs_ptr + x_off
    w0, w1, w2, w3, x = _load_step(p0, p1, p2, p3, 0, xp, 0, rows_ok, K2)
    for step in range(0, steps):
        ahead = tl.minimum(step + 1, steps - 1)
        n0, n1, n2, n3, nx = _load_step(p0, p1, p2, p3, ahead * step_words, xp, ahead * (RT * 16), rows_ok, K2)
        if PIPELINED:
            x = tl.load(xp + step * (RT * 16), mask=rows_ok, other=0.0)
        acc = tl.dot(_decoded_tiles(w0, w1, w2, w3, o, zero, K2, CB, RT, CT), x, acc)
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
def _prefill_gemm_kernel(xs_ptr, xs_proj, words_ptr, words_up_ptr, tiles_ptr, out_ptr, out_proj, k, n, expert_words,
                         K2: tl.constexpr, CB: tl.constexpr, RT: tl.constexpr, BM: tl.constexpr):
    # Program (128-column block, tile, projection): out[proj][the tile's sorted pairs, block] = their rows
    # of xs[proj] times the expert's Ŵ of that projection (words_ptr for 0, words_up_ptr for 1), the raw
    # fp32 products. Their H128 runs in the kernels that read them, whose layout keeps a row's 128-blocks
    # together: here the accumulator's wgmma layout spreads each block over lanes and warps, and with one
    # program an SM nothing overlapped the butterflies (H200: the epilogue drew 22-26 % of the warp samples,
    # ncu, session 23; without them gate, up and down took 0.88x the time, session 25).
    pid_n = tl.program_id(0)
    tile = tl.program_id(1)
    proj = tl.program_id(2).to(tl.int64)
    rows = tl.load(tiles_ptr + 3 * tile + 2)
    if rows > 0:
        e, first, s, ok = _prefill_tile(tiles_ptr, tile, rows, BM)
        words = words_ptr
        if proj == 1:
            words = words_up_ptr
        acc = _prefill_products(words + e * expert_words, xs_ptr + proj * xs_proj + first * k, ok[None, :], k, n,
                                pid_n, K2, CB, RT, BM)
        c = pid_n * 128 + tl.arange(0, 128)
        tl.store(out_ptr + proj * out_proj + s[:, None] * n + c[None, :], tl.trans(acc), mask=ok[:, None])


@triton.jit
def _token_sum_kernel(z_ptr, rank_ptr, ids_ptr, route_ptr, inv_ptr, svh_ptr, out_ptr, D, TOP_K: tl.constexpr,
                      NB: tl.constexpr):
    # Program (token, NB 128-column blocks): out[token] = Σ_j route_j · (z[rank_j] / scale_j · H128) ⊙ svh_(e_j)
    # over its pairs j = 0, 1, .. in that order (atomic adds into the token's row made the order, and the
    # sum's last bits, vary from run to run); z holds down's raw products by sorted pair, rank_j is pair j's row.
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * NB * 128 + tl.arange(0, NB)[:, None] * 128 + tl.arange(0, 128)[None, :]
    total = tl.zeros([NB, 128], tl.float32)
    for j in tl.static_range(TOP_K):
        pair = t * TOP_K + j
        row = tl.load(rank_ptr + pair).to(tl.int64)
        e = tl.load(ids_ptr + pair).to(tl.int64)
        weight = tl.load(route_ptr + pair) * tl.load(inv_ptr + row)
        svh = tl.load(svh_ptr + e * D + c).to(tl.float32)
        total += _projection_blocks(tl.load(z_ptr + row * D + c), weight, svh)
    tl.store(out_ptr + t * D + c, total)


def _prefill_swiglu(gu: torch.Tensor, inv: torch.Tensor, order: torch.Tensor, ids: torch.Tensor,
                    svh_gate: torch.Tensor, svh_up: torch.Tensor, suh_down: torch.Tensor,
                    limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    # The down GEMM's fp16 input and its row scales' inverses from gate's and up's raw products
    # gu [2, P, I] by sorted pair (_prefill_swiglu_kernel).
    _, P, I = gu.shape
    out = torch.empty((P, I), dtype=torch.float16, device=gu.device)
    out_inv = torch.empty((P,), dtype=torch.float32, device=gu.device)
    _prefill_swiglu_kernel[(P,)](gu, P * I, inv[0], inv[1], order, ids, svh_gate, svh_up, suh_down, out, out_inv, I,
                                 limit, NB=triton.next_power_of_2(I // 128), num_warps=PREFILL_SWIGLU_WARPS)
    return out, out_inv


SORT_MAX_EXPERTS = 32767


def _prefill_tiles(ids: torch.Tensor, experts: int,
                   block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # The pairs sorted by expert (stable: order), each pair's place in that order (rank), and the tile
    # table [cdiv(P, BM) + E, 3] int32 of (expert, first sorted pair, rows), rows 0 past the last real
    # tile; all on the device.
    if experts > SORT_MAX_EXPERTS:
        raise ValueError(f"the MoE prefill sorts expert ids as int16: at most {SORT_MAX_EXPERTS} experts, got {experts}")
    P = ids.numel()
    # torch's CUDA radix sort takes a pass per digit of the key's width: int16 keys take a quarter of
    # int64's passes (H200, an 8K prefill's 42 sorts: 84 instead of 336 onesweep launches, 0.67 vs 2.11 ms)
    order = torch.argsort(ids.to(torch.int16), stable=True)
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(P, device=ids.device))
    counts = torch.zeros(experts, dtype=torch.int64, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))
    per_expert = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(per_expert, 0)
    t = torch.arange(triton.cdiv(P, block_m) + min(experts, P), device=ids.device)
    e = torch.searchsorted(tile_end, t, right=True).clamp_(max=experts - 1)
    j = t - (tile_end[e] - per_expert[e])
    first = torch.cumsum(counts, 0)[e] - counts[e] + j * block_m
    rows = (counts[e] - j * block_m).clamp(0, block_m)
    return order.to(torch.int32), rank.to(torch.int32), torch.stack([e, first, rows], 1).to(torch.int32).contiguous()


def _prefill_rotate(x: torch.Tensor, order: torch.Tensor, ids: torch.Tensor, suh_gate: torch.Tensor,
                    suh_up: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    # The gate and up GEMMs' fp16 inputs xs [2, P, D] by sorted pair and their row scales' inverses
    # inv [2, P] (_prefill_rotate_kernel).
    P, D = order.numel(), x.shape[1]
    xs = torch.empty((2, P, D), dtype=torch.float16, device=x.device)
    inv = torch.empty((2, P), dtype=torch.float32, device=x.device)
    _prefill_rotate_kernel[(P,)](x.contiguous(), order, ids, suh_gate, suh_up, xs, P * D, inv, P, D, top_k,
                                 NB=triton.next_power_of_2(D // 128), num_warps=PREFILL_ROTATE_WARPS)
    return xs, inv


def exl3_moe_prefill(x: torch.Tensor, ids: torch.Tensor, route: torch.Tensor,
                     gate: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                     up: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                     down: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                     codebook: str, limit: float, *, block_m: int | None = None, row_tiles: int | None = None,
                     num_warps: int | None = None) -> torch.Tensor:
    """exl3_moe_decode's contract for many rows: Σ_j route[t, j] · down_e(swiglu(gate_e(x_t), up_e(x_t))),
    e = ids[t, j], as grouped GEMMs over the pairs sorted by expert (see the section comment).

    x [m, D] fp16 / bf16; ids [m, top_k] integer expert ids, route [m, top_k] fp32; gate, up, down
    stacked as for exl3_moe_decode. Returns fp32 [m, D]. block_m (sorted pairs per GEMM tile, 16..256;
    None picks by the mean pairs per expert), row_tiles (16-row trellis tiles per loop step; None: 4 from
    128-row tiles on, else 2; H200, 8K rows: 20.7 vs 23.4 ms at K3) and num_warps (None: 8 from 64 rows
    on) are launch tuning.
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
    if P == 0:
        return torch.zeros((m, D), dtype=torch.float32, device=dev)
    mean_rows = triton.cdiv(P, E)
    BM = block_m or (32 if mean_rows <= PREFILL_128_ROWS else 128 if mean_rows <= PREFILL_256_ROWS else 256)
    if BM not in (16, 32, 64, 128, 256):
        raise ValueError(f"block_m must be 16, 32, 64, 128 or 256, got {BM}")
    warps = num_warps or (8 if BM >= 64 else 4)
    row_tiles = row_tiles or (4 if BM >= 128 else 2)
    ids = ids.reshape(-1).to(torch.int64)
    order, rank, tiles = _prefill_tiles(ids, E, BM)
    ids = ids.to(torch.int32)
    route = route.reshape(-1).float().contiguous()
    words = [t[0].contiguous().view(torch.int32) for t in (gate, up, down)]
    # the activations' pipeline: 4 stages at 256-row tiles of 4 trellis rows a step for K <= 3, else triton's 3
    # (H200, 8K tokens, full-size experts, `.whl/s25_gemm_sweep.py`: K3 gate+up 1.040x, down 1.046x; K4 0.979x /
    # 0.989x; 2 stages 0.70-0.94x). At 8 rows a step 4 stages of [128, 256] fp16 need 256 KB of shared memory.
    stages = 4 if BM == 256 and row_tiles <= 4 and k2 <= 6 else 3
    launch = dict(K2=k2, CB=CODEBOOKS.index(codebook), RT=row_tiles, BM=BM, num_warps=warps, num_stages=stages)

    xs, inv = _prefill_rotate(x, order, ids, gate[1], up[1], top_k)
    gu = torch.empty((2, P, I), dtype=torch.float32, device=dev)
    _prefill_gemm_kernel[(I // 128, tiles.shape[0], 2)](
        xs, P * D, words[0], words[1], tiles, gu, P * I, D, I, (D // 16) * (I // 16) * 4 * k2, **launch)
    del xs
    acts, inv = _prefill_swiglu(gu, inv, order, ids, gate[2], up[2], down[1], limit)
    del gu
    z = torch.empty((P, D), dtype=torch.float32, device=dev)
    _prefill_gemm_kernel[(D // 128, tiles.shape[0], 1)](
        acts, 0, words[2], words[2], tiles, z, 0, I, D, (I // 16) * (D // 16) * 4 * k2, **launch)
    del acts
    y = torch.empty((m, D), dtype=torch.float32, device=dev)
    blocks = math.gcd(D // 128, TOKEN_SUM_BLOCKS)
    _token_sum_kernel[(m, D // 128 // blocks)](z, rank, ids, route, inv, down[2], y, D, TOP_K=top_k, NB=blocks,
                                                num_warps=TOKEN_SUM_WARPS)
    return y

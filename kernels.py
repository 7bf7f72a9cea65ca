"""Triton kernels for EXL3 linears (spec: ../shared/spec/exl3.md §0-§4).

The slow twins live in exl3.py: `exl3_decode` is `exl3.unpack`, `exl3_gemv` is
`x @ exl3.dequantize(...)`. This file does not import exl3.py.

Decoding one weight, for a tile whose packed words are read as little-endian uint32:
  position t -> its 16-bit state = ring bits [E(t) - 16, E(t)), E(t) = ((t + 1) * K2) >> 1 with
  K2 = 2K (also for the half rates 1.5 / 2.5 / 3.5), the ring being 128 * K2 bits, MSB first;
  state -> fp16 value through the codebook (one round-to-nearest-even);
  position t <-> tile row/column by the mma B-fragment layout (§3).

exl3_gemv never materializes W: a small kernel rotates the input ((x ⊙ suh) · H128, fp32), then
every thread element of the main kernel is one mma lane of one 16x16 tile, whose 8 positions
come from 4 ring words loaded once; products accumulate elementwise in fp32 and are reduced
once. k is split over programs; partial sums meet in a zeroed fp32 buffer and the last program
to arrive at a 128-column block applies H128 and svh (stream-K style fixup, one launch).
"""
from __future__ import annotations

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
def _codebook(state, CB: tl.constexpr):
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
        x = (x & 0x8FFF8FFF) ^ 0x3B603B60
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
def _load_step(words_ptr, off0, off1, off2, off3, xh_ptr, x_slot, row_ok):
    # The 4 ring words of every lane of RT x CT tiles, and the 4 activations each lane multiplies.
    w0 = tl.load(words_ptr + off0).to(tl.uint32, bitcast=True)
    w1 = tl.load(words_ptr + off1).to(tl.uint32, bitcast=True)
    w2 = tl.load(words_ptr + off2).to(tl.uint32, bitcast=True)
    w3 = tl.load(words_ptr + off3).to(tl.uint32, bitcast=True)
    x0 = tl.load(xh_ptr + x_slot, mask=row_ok, other=0.0)
    x1 = tl.load(xh_ptr + x_slot + 1, mask=row_ok, other=0.0)
    x2 = tl.load(xh_ptr + x_slot + 2, mask=row_ok, other=0.0)
    x3 = tl.load(xh_ptr + x_slot + 3, mask=row_ok, other=0.0)
    return w0, w1, w2, w3, x0, x1, x2, x3


@triton.jit
def _gemv_kernel(xh_ptr, svh_ptr, words_ptr, partial_ptr, arrivals_ptr, y_ptr,
                 m, k, n, steps, arrivals,
                 K2: tl.constexpr, CB: tl.constexpr, MP: tl.constexpr, RT: tl.constexpr, CT: tl.constexpr):
    # Program (pid_n, pid_k): output tiles [CT * pid_n, CT * (pid_n + 1)), `steps` steps of RT row
    # tiles from row tile RT * steps * pid_k. One thread element = one mma lane L of one tile, which
    # owns stream positions 8L .. 8L + 7 (spec §3): rows 2(L%4) + {0, 1, 8, 9} of columns L/4 and
    # L/4 + 8. Its bits lie in 4 consecutive words of the tile ring, loaded once for all 8.
    # Products accumulate elementwise; rows and lanes are summed once at the end. `arrivals`
    # programs add into each 128-column block; the last one applies H128 and svh.
    NW: tl.constexpr = 4 * K2
    RING: tl.constexpr = 128 * K2
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    tiles_n = n // 16
    lane = tl.arange(0, 32)[None, None, :]
    first = (((((8 * lane + 1) * K2) >> 1) + RING - 16) % RING) >> 5
    tile_word0 = (tl.arange(0, RT)[:, None, None] * tiles_n + pid_n * CT + tl.arange(0, CT)[None, :, None]) * NW
    off0 = tile_word0 + first
    off1 = tile_word0 + (first + 1) % NW
    off2 = tile_word0 + (first + 2) % NW
    off3 = tile_word0 + (first + 3) % NW
    rows = tl.arange(0, MP)[:, None, None, None]
    row_ok = rows < m
    x_slot = rows * k + tl.arange(0, RT)[None, :, None, None] * 16 + 4 * (lane[None] & 3)

    acc_left = tl.zeros([MP, RT, CT, 32], tl.float32)   # column L/4 of each tile
    acc_right = tl.zeros([MP, RT, CT, 32], tl.float32)  # column L/4 + 8
    tile0 = pid_k * steps * RT
    words_ptr += tile0 * tiles_n * NW
    xh_ptr += tile0 * 16
    # Each step prefetches the next step's words and activations (the loop is otherwise
    # latency-bound); the last step re-reads its own instead of reading past the split.
    w0, w1, w2, w3, x0, x1, x2, x3 = _load_step(words_ptr, off0, off1, off2, off3, xh_ptr, x_slot, row_ok)
    for step_index in range(steps):
        ahead = tl.minimum(step_index + 1, steps - 1)
        n0, n1, n2, n3, nx0, nx1, nx2, nx3 = _load_step(
            words_ptr + ahead * (RT * tiles_n * NW), off0, off1, off2, off3, xh_ptr + ahead * (RT * 16),
            x_slot, row_ok)
        for j in tl.static_range(8):
            start = ((((8 * lane + j + 1) * K2) >> 1) + RING - 16) % RING
            step = ((start >> 5) - first + NW) % NW  # 0, 1 or 2 words past the lane's first
            o = (start & 31).to(tl.uint32)
            hi = tl.where(step == 0, w0, tl.where(step == 1, w1, w2))
            lo = tl.where(step == 0, w1, tl.where(step == 1, w2, w3))
            window = (hi << o) | ((lo >> 1) >> (31 - o))
            value = _codebook(window >> 16, CB).to(tl.float32)
            x = _pick(x0, x1, x2, x3, 2 * ((j >> 1) & 1) + (j & 1))
            if j < 4:
                acc_left += x * value[None]
            else:
                acc_right += x * value[None]
        w0, w1, w2, w3, x0, x1, x2, x3 = n0, n1, n2, n3, nx0, nx1, nx2, nx3

    # Sum the row tiles and the 4 lanes that share a column; columns are c = L/4 (left), L/4 + 8.
    left = tl.sum(tl.reshape(tl.sum(acc_left, axis=1), [MP, CT, 8, 4]), axis=3)
    right = tl.sum(tl.reshape(tl.sum(acc_right, axis=1), [MP, CT, 8, 4]), axis=3)
    z = tl.reshape(tl.permute(tl.join(left, right), (0, 1, 3, 2)), [MP, CT * 16])
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
    if out is None:
        out = torch.empty(shape, dtype=torch.float16, device=trellis.device)
    elif out.shape != shape or out.dtype != torch.float16 or not out.is_contiguous():
        raise ValueError(f"out must be contiguous fp16 {shape}, got {out.dtype} {tuple(out.shape)}")
    words = trellis.contiguous().view(torch.int32)
    block_rows, block_cols = 64, 128
    grid = (triton.cdiv(tiles_k * 16, block_rows), triton.cdiv(tiles_n * 16, block_cols))
    _decode_kernel[grid](words, out, tiles_k, tiles_n, K2=k2, CB=CODEBOOKS.index(codebook),
                         BR=block_rows, BC=block_cols)
    return out


GEMV_ROWS = 8  # rows per launch: the elementwise accumulators grow with the row count
_SPLIT_BUFFERS: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _split_buffers(device: torch.device, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Zeroed fp32 partial sums [16, n] (the epilogue's row block) and per-128-column arrival
    # counters. Kernels leave them zeroed, so they are allocated once per (device, n) and never
    # freed: CUDA graphs captured with them keep valid addresses. Users must share one stream.
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
              codebook: str, out: torch.Tensor | None = None, *, block_n: int = 128, row_tiles: int = 1,
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
    if block_n not in (16, 32, 64, 128):
        raise ValueError(f"block_n must be 16, 32, 64 or 128, got {block_n}")
    m = x.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=torch.float16, device=x.device)
    elif out.shape != (m, n) or out.dtype != torch.float16 or not out.is_contiguous():
        raise ValueError(f"out must be contiguous fp16 ({m}, {n}), got {out.dtype} {tuple(out.shape)}")
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

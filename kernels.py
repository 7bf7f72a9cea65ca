"""Triton kernels for EXL3 linears (spec: ../shared/spec/exl3.md §0-§4).

The slow twins live in exl3.py: `exl3_decode` is `exl3.unpack`, `exl3_gemv` is
`x @ exl3.dequantize(...)`. This file does not import exl3.py.

Decoding one weight, for a tile whose packed words are read as little-endian uint32:
  position t -> its 16-bit state = ring bits [E(t) - 16, E(t)), E(t) = ((t + 1) * K2) >> 1 with
  K2 = 2K (also for the half rates 1.5 / 2.5 / 3.5), the ring being 128 * K2 bits, MSB first;
  state -> fp16 value through the codebook (one round-to-nearest-even);
  position t <-> tile row/column by the mma B-fragment layout (§3).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

CODEBOOKS = ("3inst", "mcg", "mul1")
RSQRT128 = 1.0 / math.sqrt(128.0)


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
def _hadamard_signs(i, j):
    # 128 * H128[i, j] = (-1)^popcount(i & j) (Sylvester order, spec §4), as fp16 ±1.
    v = i & j
    v = v ^ (v >> 4)
    v = v ^ (v >> 2)
    v = v ^ (v >> 1)
    return (1 - 2 * (v & 1)).to(tl.float16)


@triton.jit
def _gemv_kernel(x_ptr, suh_ptr, svh_ptr, words_ptr, partial_ptr, arrivals_ptr, y_ptr,
                 m, k, n, blocks_per_split,
                 K2: tl.constexpr, CB: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr):
    # Program (pid_n, pid_k): output columns [BN * pid_n, BN * (pid_n + 1)), input rows of
    # 128-blocks [blocks_per_split * pid_k, blocks_per_split * (pid_k + 1)).
    # y = ((((x ⊙ suh) · H) · Ŵ) · H) ⊙ svh, rows padded to 16 for tl.dot.
    BM: tl.constexpr = 16
    NW: tl.constexpr = 4 * K2
    ARRIVALS: tl.constexpr = SPLIT * (128 // BN)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    tiles_n = n // 16
    rows = tl.arange(0, BM)
    i128 = tl.arange(0, 128)
    signs = _hadamard_signs(i128[:, None], i128[None, :])
    row_ok = rows[:, None] < m

    # Loop-invariant part of the weight-block addressing (spec §2.2, §3).
    i = i128[:, None]
    j = tl.arange(0, BN)[None, :]
    w, o = _window(_stream_position(i % 16, j % 16), K2)
    tile_word0 = ((i // 16) * tiles_n + pid_n * (BN // 16) + j // 16) * NW

    acc = tl.zeros([BM, BN], tl.float32)
    blk0 = pid_k * blocks_per_split
    x_ptr += blk0 * 128
    suh_ptr += blk0 * 128
    words_ptr += blk0 * (8 * tiles_n * NW)  # a 128-row block is 8 rows of tiles
    for _ in range(blocks_per_split):
        x = tl.load(x_ptr + rows[:, None] * k + i128[None, :], mask=row_ok, other=0.0)
        suh = tl.load(suh_ptr + i128)
        xh = (tl.dot(x * suh[None, :], signs) * 0.08838834764831845).to(tl.float16)
        w_hat = _codebook(_state(words_ptr, tile_word0, w, o, K2), CB)
        acc = tl.dot(xh, w_hat, acc)
        x_ptr += 128
        suh_ptr += 128
        words_ptr += 8 * tiles_n * NW

    cols = pid_n * BN // 128 * 128 + i128
    if ARRIVALS == 1:
        _gemv_output(acc, signs, svh_ptr, y_ptr, rows, cols, row_ok, n)
    else:
        # Split-k: sum the partials in a zeroed fp32 buffer; the last program to arrive at this
        # 128-column block applies the output Hadamard and leaves buffer and counter zeroed again.
        tl.atomic_add(partial_ptr + rows[:, None] * n + pid_n * BN + j, acc, sem="relaxed")
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr + pid_n * BN // 128, 1, sem="acq_rel")
        if arrived == ARRIVALS - 1:
            block = partial_ptr + rows[:, None] * n + cols[None, :]
            z = tl.atomic_add(block, tl.zeros([BM, 128], tl.float32), sem="acq_rel")  # read at L2
            tl.store(block, tl.zeros([BM, 128], tl.float32))
            tl.store(arrivals_ptr + pid_n * BN // 128, 0)
            _gemv_output(z, signs, svh_ptr, y_ptr, rows, cols, row_ok, n)


@triton.jit
def _gemv_output(z, signs, svh_ptr, y_ptr, rows, cols, row_ok, n):
    # y[:, cols] = (z · H128) ⊙ svh for one 128-column block, in fp32, rounded once to fp16.
    y = tl.dot(z, signs.to(tl.float32), input_precision="ieee")
    svh = tl.load(svh_ptr + cols).to(tl.float32)
    y = (y * (0.08838834764831845 * svh)[None, :]).to(tl.float16)
    tl.store(y_ptr + rows[:, None] * n + cols[None, :], y, mask=row_ok)


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


_SPLIT_BUFFERS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _split_buffers(device: torch.device, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Zeroed fp32 partial sums [16, n] and per-128-column arrival counters; kernels leave them
    # zeroed, so they are allocated once per device (one stream at a time may use them).
    partial, arrivals = _SPLIT_BUFFERS.get(device, (None, None))
    if partial is None or partial.numel() < 16 * n:
        partial = torch.zeros(16 * n, dtype=torch.float32, device=device)
        arrivals = torch.zeros(n // 128, dtype=torch.int32, device=device)
        _SPLIT_BUFFERS[device] = (partial, arrivals)
    return partial, arrivals


def _default_split(device: torch.device, n: int, blocks: int, block_n: int) -> int:
    # Enough programs to cover every SM a few times; the split must divide the 128-row blocks.
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    split = 1
    while blocks % (2 * split) == 0 and (n // block_n) * split * 2 <= 4 * sms:
        split *= 2
    return split


def exl3_gemv(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
              codebook: str, out: torch.Tensor | None = None, *, block_n: int = 64,
              split_k: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """y = x · diag(suh) · H · Ŵ · H · diag(svh) for small m, decoding Ŵ in registers.

    x [m, k] fp16 -> y [m, n] fp16. Twin: x @ exl3.dequantize(trellis, suh, svh, codebook).
    block_n / split_k / num_warps are launch tuning (split_k None = pick by SM count).
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
    blocks = k // 128
    split = split_k or _default_split(x.device, n, blocks, block_n)
    if blocks % split:
        raise ValueError(f"split_k {split} must divide the {blocks} input blocks of 128")
    x = x.contiguous()
    words = trellis.contiguous().view(torch.int32)
    partial, arrivals = _split_buffers(x.device, n)
    for row in range(0, m, 16):  # one launch per 16 rows: the kernel pads rows to one mma tile
        rows = min(16, m - row)
        _gemv_kernel[(n // block_n, split)](
            x[row:], suh, svh, words, partial, arrivals, out[row:], rows, k, n, blocks // split,
            K2=k2, CB=CODEBOOKS.index(codebook), BN=block_n, SPLIT=split, num_warps=num_warps)
    return out

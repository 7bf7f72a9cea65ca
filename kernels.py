"""Triton kernels, each with a slow pure-torch twin that the tests hold it to. Two families here:

EXL3 linears (spec exl3.md §0-§4) have their own file, exl3_kernels.py; KDA (the recurrence, its
chunked prefill and the decode step's KDA inputs and output gate, spec glm53.md §4.3) has kda_kernels.py;
DSA (the decode step's inputs, the indexer's scores, the sparse MLA of decode and prefill, §4.4) has
dsa_kernels.py; mHC (the streams' mix, Sinkhorn, collapse and update, §4.2) has mhc_kernels.py.

FP8 block-128 linears (fp8.py holds the format and the twin): `fp8_gemv` for 1..16 rows,
dequantizing in registers (fp32 FMAs up to FP8_FMA_ROWS = 3 rows, tensor cores above); `fp8_dequantize` (twin
`fp8.dequantize_fp8_block`) for more rows, whose product then runs in cuBLAS. `bf16_fp32_linear`: x · wᵀ of bf16 rows and an fp32 weight, near fp32
accuracy on bf16 tensor cores (the prefill's router and indexer head weights; twin x.float() @ w.T).

The decode step's glue (fastdecode.py), twins in model_glm.py: `swiglu` (§4.5's clamped SwiGLU: `swiglu`);
`rms_norm`, `stream_mean_norm` and `embed_streams` (§4.1's ends, §4.4's norms);
`moe_route` (the router GEMV, sigmoid, top-k and weights, §4.5: `route`).

The engine's sampler: `sample_race`, a batch's draw on the device in two launches (twin: engine.process_rows +
engine.race).

This file imports neither exl3.py nor model_glm.py (they sit above it); exl3_kernels.py,
kda_kernels.py, dsa_kernels.py and mhc_kernels.py import a few of its helpers.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.language.target_info import cuda_capability_geq

# Compiled for an NVIDIA GPU (inline PTX), not run by the CPU interpreter (which has no inline asm).
_COMPILED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")

# Programmatic dependent launch (sm_90 on; H200 decode B=1 1.033x, BENCHMARKS session 31): the decode
# step's kernels launch with launch_pdl=_pdl() and start with _pdl_enter(), so that in a CUDA graph each is
# launched while the one before still runs. PDL = False launches each after the one before has finished
# (for A/B timing). Older GPUs have no griddepcontrol (ptxas refuses it): both sides ask the current device.
PDL = True


@functools.cache
def _pdl_device(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def _pdl() -> bool:
    return PDL and torch.cuda.is_available() and _pdl_device(torch.cuda.current_device())


@triton.jit
def _pdl_enter():
    # Lets the next kernel launch now, then waits until the kernel before has finished and its writes are
    # visible: everything a program reads or writes comes after this. Without PDL both are no-ops.
    if _COMPILED:
        if cuda_capability_geq(9):
            gdc_launch_dependents()
            gdc_wait()


# ---------------------------------------------------------------- argument checks

def _rows(t: torch.Tensor, name: str, B: int, width: int) -> torch.Tensor:
    # A [B, width] operand whose rows may be strided (a slice of a fused projection's output).
    if tuple(t.shape) != (B, width) or t.stride(1) != 1:
        raise ValueError(f"{name} must be ({B}, {width}) with unit column stride, got {tuple(t.shape)} {t.stride()}")
    return t


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
def _pow2_scale(peak, TOP: tl.constexpr):
    # Powers of two s = 2^(TOP - e) and 1 / s for values whose largest |value| is peak in [2^e, 2^(e+1)), so
    # that peak · s lies in [2^TOP, 2^(TOP+1)): built from the exponent bits (exact; no exp2). A zero peak
    # gets a finite scale.
    expo = (tl.maximum(peak, 7.888609052210118e-31).to(tl.int32, bitcast=True) >> 23) & 0xFF
    return ((254 + TOP - expo) << 23).to(tl.float32, bitcast=True), ((expo - TOP) << 23).to(tl.float32, bitcast=True)


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


@triton.jit
def _rms_scaled(x, rs, w, X_DT: tl.constexpr, OUT_DT: tl.constexpr):
    # model_glm.rms_norm's two roundings, from fp32 x, 1 / rms and weight w: x · rs to x's dtype X_DT,
    # then its product with the weight to the output's OUT_DT.
    return _cast(w * _cast(x * rs, X_DT).to(tl.float32), OUT_DT)


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
    _pdl_enter()
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
    _pdl_enter()
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


def _arrival_counters(store: dict[tuple[torch.device, int], torch.Tensor], device: torch.device,
                      n: int) -> torch.Tensor:
    # n int32 arrival counters (a kernel's, one per block it finishes: `store` is the kernel's own). The
    # kernel leaves them zeroed, so they are allocated once per (device, n) and never freed: CUDA graphs
    # captured with them keep valid addresses. Two launches must not run at once (one stream, or streams
    # joined in between).
    key = (device, n)
    if key not in store:
        store[key] = torch.zeros(n, dtype=torch.int32, device=device)
    return store[key]


def _sm_count(device: torch.device) -> int:
    # SMs that launch grids are sized for; on CPU (the interpreter) a small stand-in, so tests see splits.
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _fp8_default_split(device: torch.device, programs: int, parts: int, target: int) -> int:
    # Double the split of `parts` (k blocks or chunks) while that keeps at most `target` programs
    # (warps, for the FMA kernel) per SM; more splits only add partial sums to reduce.
    sms = _sm_count(device)
    split = 1
    while 2 * split <= parts and programs * 2 * split <= target * sms:
        split *= 2
    return split


def _check_fp8_weight(weight: torch.Tensor, scale_inv: torch.Tensor) -> tuple[int, int]:
    """(n, k) of a float8_e4m3fn weight [n, k] whose fp32 scale_inv holds one scale per 128 x 128 block."""
    if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"weight must be float8_e4m3fn [n, k], got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    grid_shape = (triton.cdiv(n, FP8_BLOCK), triton.cdiv(k, FP8_BLOCK))
    if tuple(scale_inv.shape) != grid_shape or scale_inv.dtype != torch.float32:
        raise ValueError(f"scale_inv must be fp32 {grid_shape} for weight {tuple(weight.shape)}, "
                         f"got {scale_inv.dtype} {tuple(scale_inv.shape)}")
    return n, k


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
    n, k = _check_fp8_weight(weight, scale_inv)
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
    arrivals = _arrival_counters(_FP8_ARRIVALS, x.device, n_tiles)
    _fp8_gemv_fma_kernel[(n_tiles, split)](
        x, weight, scale_inv, out, part, arrivals, m, n, k, k_blocks, per_split, split,
        BN=block_n, KB=kb, ROWS=m, K_TAIL=k % (kb * FP8_BLOCK) != 0, STAGES=num_stages, num_warps=num_warps,
        launch_pdl=_pdl())


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
    arrivals = _arrival_counters(_FP8_ARRIVALS, x.device, n_tiles)
    for row in range(0, m, FP8_GEMV_ROWS):
        rows = min(FP8_GEMV_ROWS, m - row)
        target = out[row:row + rows]
        # One fp32 slab of partial sums per split; a single split writes the output directly.
        part = torch.empty((split, rows, n), dtype=torch.float32, device=x.device) if split > 1 else target
        _fp8_gemv_mma_kernel[(n_tiles, split)](
            x[row:row + rows], weight, scale_inv, target, part, arrivals, rows, n, k, k_blocks,
            per_split, split, BN=block_n, MP=FP8_GEMV_ROWS, STAGES=num_stages, num_warps=num_warps, launch_pdl=_pdl())


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
    n, k = _check_fp8_weight(weight, scale_inv)
    k_blocks = triton.cdiv(k, FP8_BLOCK)
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype}")
    _check_block_n(block_n)
    weight, scale_inv = weight.contiguous(), scale_inv.contiguous()
    out = torch.empty((n, k), dtype=dtype, device=weight.device)
    _fp8_dequantize_kernel[(triton.cdiv(n, block_n), k_blocks)](
        weight, scale_inv, out, n, k, k_blocks, BN=block_n, num_warps=num_warps)
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
    _pdl_enter()
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


def _linear_tiles(m: int, n: int) -> tuple[int, int, int]:
    """(block_m, block_n, block_k) of `bf16_fp32_linear` for y [m, n]. H200, k 4096, against the former
    fixed (64, 32, 64): 32 outputs (the indexer's head weights) take 128 of k a step, 1.18-1.22x at
    2048-8192 rows; from 4096 rows the router's 288 outputs take 128 x 64 tiles, 1.13x at 8192 rows (at
    2048 rows (64, 32, 64) is still the best). An 8K prefill's 86 calls: 10.2 against 11.9 ms."""
    if n <= 32:
        return 64, 32, 128
    if m >= 4096:
        return 128, 64, 64
    return 64, 32, 64


def bf16_fp32_linear(x: torch.Tensor, w: torch.Tensor, *, block_m: int | None = None, block_n: int | None = None,
                     block_k: int | None = None, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """y = x.float() @ w.T, fp32 [m, n], for x bf16 [m, k] and w fp32 [n, k], on bf16 tensor cores.

    Twin: that torch expression (fp32 FMA); the two differ only in how the fp32 sums are ordered and
    rounded (see the section comment).
    block_m / block_n / block_k (powers of two >= 16), num_warps and num_stages are launch tuning; a
    block left None is `_linear_tiles`' choice for the shape.
    """
    if x.dim() != 2 or x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bf16 [m, k], got {x.dtype} {tuple(x.shape)}")
    if w.dim() != 2 or w.dtype != torch.float32 or w.shape[1] != x.shape[1]:
        raise ValueError(f"w must be fp32 [n, {x.shape[1]}] for x {tuple(x.shape)}, got {w.dtype} {tuple(w.shape)}")
    tiles = _linear_tiles(x.shape[0], w.shape[0])
    block_m, block_n, block_k = (chosen if given is None else given
                                 for given, chosen in zip((block_m, block_n, block_k), tiles))
    for name, size in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        _check_pow2(name, size)
    (m, k), n = x.shape, w.shape[0]
    y = torch.empty((m, n), dtype=torch.float32, device=x.device)
    if m == 0:
        return y
    x, w = x.contiguous(), w.contiguous()
    _bf16_fp32_linear_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
        x, w, y, m, n, k, BM=block_m, BN=block_n, BK=block_k, STAGES=num_stages, TC=x.is_cuda,
        num_warps=num_warps, launch_pdl=_pdl())
    return y


# ================================================================ the clamped SwiGLU (§4.5)

SWIGLU_BLOCK = 1024


@triton.jit
def _swiglu_kernel(g_ptr, g_stride, u_ptr, u_stride, out_ptr, I, limit, BI: tl.constexpr):
    # model_glm.swiglu with its roundings: SiLU's output in the activations' dtype, then the product.
    _pdl_enter()
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
                                                          BI=SWIGLU_BLOCK, launch_pdl=_pdl())
    return out


# ================================================================ RMSNorm of rows (§4.4's q_a and kv_a)
# model_glm.rms_norm for a prefill chunk's rows (the DSA layers' q_a and kv_a): one read and one write
# of the rows, where the twin's torch ops take seven launches and an fp32 copy (H200, an 8K prefill's 22 calls:
# 0.27 against ~2.7 ms). A program holds RB whole rows; the sum of squares follows the block's layout, not
# torch's order, so the scale can differ from the twin's in its last bit. `stream_mean_norm` (§4.1's end,
# h = norm(mean over the streams of X)) runs the same kernel on the S streams of each row: their fp32 mean,
# rounded to X's dtype, is the row.

RMS_NORM_ELEMENTS = 2048  # elements a program holds (whole rows, at least one)


@triton.jit
def _rms_norm_kernel(x_ptr, x_stride, s_stride, w_ptr, out_ptr, B, N, eps, S: tl.constexpr, RB: tl.constexpr,
                     NP: tl.constexpr):
    _pdl_enter()
    rows = tl.program_id(0) * RB + tl.arange(0, RB)[:, None]
    cols = tl.arange(0, NP)[None, :]
    inside = (rows < B) & (cols < N)
    x = tl.load(x_ptr + rows.to(tl.int64) * x_stride + cols, mask=inside, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    if S > 1:
        for i in tl.static_range(1, S):
            x += tl.load(x_ptr + rows.to(tl.int64) * x_stride + i * s_stride + cols, mask=inside, other=0.0).to(
                tl.float32)
        x = _cast(x / S, x_ptr.dtype.element_ty).to(tl.float32)
    rs = 1.0 / tl.sqrt(tl.sum(x * x, axis=1)[:, None] / N + eps)
    y = _rms_scaled(x, rs, w, x_ptr.dtype.element_ty, out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows.to(tl.int64) * N + cols, y, mask=inside)


def _rms_norm_launch(name: str, x: torch.Tensor, s_stride: int, S: int, weight: torch.Tensor, eps: float, B: int,
                     N: int) -> torch.Tensor:
    if tuple(weight.shape) != (N,):
        raise ValueError(f"{name}: weight must be ({N},), got {tuple(weight.shape)}")
    out = torch.empty(B, N, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if B:
        NP = triton.next_power_of_2(N)
        rb = max(1, RMS_NORM_ELEMENTS // NP)
        _rms_norm_kernel[(triton.cdiv(B, rb),)](x, x.stride(0), s_stride, weight.contiguous(), out, B, N, eps, S=S,
                                                RB=rb, NP=NP, launch_pdl=_pdl())
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """model_glm.rms_norm in one launch for rows x [B, N] (they may be strided: a slice of a fused
    projection's output) and weight [N]: [B, N] contiguous, in the dtype torch's product gives."""
    B, N = x.shape
    _rows(x, "rms_norm: x", B, N)
    return _rms_norm_launch("rms_norm", x, 0, 1, weight, eps, B, N)


def stream_mean_norm(X: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """model_glm.rms_norm(X.float().mean(1).to(X.dtype), weight, eps) in one launch for the residual
    streams X [B, S, N] (unit last stride): [B, N] contiguous."""
    if X.dim() != 3 or X.stride(2) != 1:
        raise ValueError(f"stream_mean_norm: X must be [B, S, N] with unit last stride, got {tuple(X.shape)} "
                         f"{X.stride()}")
    B, S, N = X.shape
    return _rms_norm_launch("stream_mean_norm", X, X.stride(1), S, weight, eps, B, N)


# ================================================================ the embedding's streams (§4.1)
# X = repeat(embed(tok), S streams) in one launch, where torch takes two (the gather, the repeat). Token
# ids are not checked here: the engine and the server reject ids outside the vocabulary.

EMBED_BLOCK = 1024


@triton.jit
def _embed_streams_kernel(embed_ptr, tok_ptr, out_ptr, D, S: tl.constexpr, BD: tl.constexpr):
    _pdl_enter()
    b = tl.program_id(0)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    row = tl.load(embed_ptr + tl.load(tok_ptr + b).to(tl.int64) * D + cols, mask=cols < D)
    for i in tl.static_range(S):
        tl.store(out_ptr + (b * S + i).to(tl.int64) * D + cols, row, mask=cols < D)


def embed_streams(embed: torch.Tensor, tokens: torch.Tensor, streams: int) -> torch.Tensor:
    """embed[tokens][:, None, :].repeat(1, streams, 1) for tokens [B] (int32 / int64) and a contiguous
    embedding [V, D]: [B, streams, D] contiguous in embed's dtype."""
    if embed.dim() != 2 or not embed.is_contiguous():
        raise ValueError(f"embed_streams: embed must be a contiguous [V, D], got {tuple(embed.shape)} {embed.stride()}")
    if tokens.dim() != 1 or tokens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"embed_streams: tokens must be int32 / int64 [B], got {tokens.dtype} {tuple(tokens.shape)}")
    B, D = tokens.shape[0], embed.shape[1]
    out = torch.empty(B, streams, D, dtype=embed.dtype, device=embed.device)
    if B:
        _embed_streams_kernel[(B, triton.cdiv(D, EMBED_BLOCK))](embed, tokens.contiguous(), out, D, S=streams,
                                                                BD=EMBED_BLOCK, launch_pdl=_pdl())
    return out


# ================================================================ decode-step kernels: routing (§4.5)
# moe_route in two launches. `_route_logits_kernel`: the fp32 router GEMV split over blocks of
# experts and of D, so that at full size (288 x 4096, 4.7 MB) 144-576 programs stream gate_w at once;
# each holds its gate_w block in registers for every row of h. `_route_topk_kernel`: one program
# per row runs `_route_pick`, which adds the partial sums in a fixed order, applies the sigmoid and
# takes the top-k of s + bias by k rounds of one max over packed (choice, expert) keys (ties to the
# lower expert), the weights coming from s, then normalizes and scales them. The logits never exist
# as a separate tensor, and there is no torch op in between.

ROUTE_BLOCK_K = 512
# the router GEMV's launch (experts a program, warps): from ROUTE_MANY_ROWS rows 4 experts at one warp, so that
# 576 programs stream gate_w at once instead of 144 (H200, 288 x 4096 in a CUDA graph: 3.58 / 8.42 us at B 4 /
# 16 against 5.89 / 17.87; whole decode steps 1.005-1.008x). At B 1 the GEMV alone is faster too (2.43 against
# 2.91 us), but whole steps ran 0.992-0.994x (two runs, noise-level): unchanged there.
ROUTE_MANY_ROWS = 4
ROUTE_LAUNCH = {False: (16, 4), True: (4, 1)}
# `_route_topk_kernel` at one warp: its top-k is a serial chain of max reductions over EP values, which
# across 4 warps meet in shared memory at every step (sm_90 code for EP 512, top-8: 2064 instructions a
# row and no barrier at 1 warp, against 4096 and 28 barriers at 4). H200, 8192 rows: 66 against 83 us;
# an 8K prefill's 42 calls 2.3 against 3.3 ms; the same at 1-16 rows.
ROUTE_PICK_WARPS = 1


@dataclass
class RouterScores:
    """The router GEMV's partial sums part [B, S, E] fp32 (S blocks of D, added up by `_route_pick`)
    and what the top-k needs: the first launch of moe_route, for `route_pick`."""
    part: torch.Tensor
    bias: torch.Tensor
    top_k: int
    norm_topk_prob: bool
    scaling: float

    def pick_constants(self) -> dict:
        """The launch constants of `_route_pick` for this part."""
        S, E = self.part.shape[1:]
        return dict(NORM=bool(self.norm_topk_prob), TOPK=self.top_k, KP=triton.next_power_of_2(self.top_k),
                    EP=triton.next_power_of_2(E), SP=triton.next_power_of_2(S))


@triton.jit
def _route_logits_kernel(h_ptr, h_stride, w_ptr, part_ptr, B, E, D, BE: tl.constexpr, BK: tl.constexpr):
    _pdl_enter()
    e = tl.program_id(0) * BE + tl.arange(0, BE)
    s = tl.program_id(1)
    k = s * BK + tl.arange(0, BK)
    w = tl.load(w_ptr + e[:, None] * D + k[None, :], mask=(e[:, None] < E) & (k[None, :] < D),
                other=0.0).to(tl.float32)
    for b in range(B):
        x = tl.load(h_ptr + b * h_stride + k, mask=k < D, other=0.0).to(tl.float32)
        y = _cast(tl.sum(w * x[None, :], axis=1), part_ptr.dtype.element_ty)  # fp32 for the router's partial sums
        tl.store(part_ptr + (b * tl.num_programs(1) + s) * E + e, y, mask=e < E)


@triton.jit
def _route_pick(part_ptr, bias_ptr, b, E, S, scaling, NORM: tl.constexpr, TOPK: tl.constexpr, KP: tl.constexpr,
                EP: tl.constexpr, SP: tl.constexpr):
    # Row b's picks: (ids [KP] int32, weights [KP] fp32), entries from TOPK on zero.
    e = tl.arange(0, EP)
    s = tl.arange(0, SP)
    inside = e < E
    part = tl.load(part_ptr + (b * S + s[:, None]) * E + e[None, :], mask=(s[:, None] < S) & inside[None, :],
                   other=0.0)
    score = tl.sigmoid(tl.sum(part, axis=0))
    choice = tl.where(inside, score + tl.load(bias_ptr + e, mask=inside, other=0.0), -float("inf"))
    # One max a pick: the key is choice's fp32 bits made to order as signed integers (negative values'
    # magnitude bits flipped) in the high word and EP - 1 - e in the low one, so that equal choices go
    # to the lower expert; a picked key drops to the bottom.
    bits = choice.to(tl.int32, bitcast=True)
    key = ((bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) << 32) | (EP - 1 - e).to(tl.int64)
    j = tl.arange(0, KP)
    ids = tl.zeros([KP], dtype=tl.int32)
    for r in tl.static_range(TOPK):
        best = tl.max(key, axis=0)
        ids = tl.where(j == r, EP - 1 - (best & 0xFFFFFFFF).to(tl.int32), ids)
        key = tl.where(key == best, -9223372036854775807, key)
    w = tl.sum(tl.where(e[None, :] == ids[:, None], score[None, :], 0.0), axis=1)  # s of each pick
    w = tl.where(j < TOPK, w, 0.0)
    if NORM:
        w = w / (tl.sum(w, axis=0) + 1e-20)
    return ids, w * scaling


@triton.jit
def _route_topk_kernel(part_ptr, bias_ptr, ids_ptr, wt_ptr, E, S, scaling,
                       NORM: tl.constexpr, TOPK: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr,
                       SP: tl.constexpr):
    _pdl_enter()
    b = tl.program_id(0)
    ids, w = _route_pick(part_ptr, bias_ptr, b, E, S, scaling, NORM, TOPK, KP, EP, SP)
    j = tl.arange(0, KP)
    tl.store(ids_ptr + b * TOPK + j, ids, mask=j < TOPK)
    tl.store(wt_ptr + b * TOPK + j, w, mask=j < TOPK)


def _gemv_weight(name: str, w: torch.Tensor, D: int, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> int:
    # The rows E of a GEMV's weight w [E, D], which `_route_logits_kernel` reads contiguous, in one of `dtypes`.
    E = w.shape[0]
    if tuple(w.shape) != (E, D) or w.dtype not in dtypes or not w.is_contiguous():
        names = ", ".join({torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[t] for t in dtypes)
        raise ValueError(f"{name} must be contiguous {names} (E, {D}), got {w.dtype} {tuple(w.shape)}")
    return E


def _check_route(name: str, bias: torch.Tensor, top_k: int, E: int) -> None:
    if tuple(bias.shape) != (E,):
        raise ValueError(f"{name}: bias must be ({E},), got {tuple(bias.shape)}")
    if not 1 <= top_k <= E:
        raise ValueError(f"{name}: top_k = {top_k} must be in 1..{E}")


def router_scores(h: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, top_k: int, norm_topk_prob: bool,
                  scaling: float) -> RouterScores:
    """The first launch of moe_route: the router GEMV h·gate_wᵀ (gate_w [E, D] fp32) as partial sums."""
    B, D = h.shape
    E = _gemv_weight("moe_route: gate_w", gate_w, D)
    _check_route("moe_route", bias, top_k, E)
    _rows(h, "moe_route: h", B, D)
    S = triton.cdiv(D, ROUTE_BLOCK_K)
    part = torch.empty(B, S, E, dtype=torch.float32, device=h.device)
    be, warps = ROUTE_LAUNCH[B >= ROUTE_MANY_ROWS]
    _route_logits_kernel[(triton.cdiv(E, be), S)](h, h.stride(0), gate_w, part, B, E, D, BE=be, BK=ROUTE_BLOCK_K,
                                                  num_warps=warps, launch_pdl=_pdl())
    return RouterScores(part, bias.float().contiguous(), top_k, norm_topk_prob, float(scaling))


def route_pick(scores: RouterScores) -> tuple[torch.Tensor, torch.Tensor]:
    """The second launch of moe_route: (ids int32 [B, top_k], weights fp32 [B, top_k])."""
    B, S, E = scores.part.shape
    dev = scores.part.device
    ids = torch.empty(B, scores.top_k, dtype=torch.int32, device=dev)
    weights = torch.empty(B, scores.top_k, dtype=torch.float32, device=dev)
    _route_topk_kernel[(B,)](scores.part, scores.bias, ids, weights, E, S, scores.scaling, **scores.pick_constants(),
                             num_warps=ROUTE_PICK_WARPS, launch_pdl=_pdl())
    return ids, weights


def route_topk(logits: torch.Tensor, bias: torch.Tensor, top_k: int, norm_topk_prob: bool,
               scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """model_glm.route_logits in one launch for router logits [B, E] fp32 already made (a prefill's
    GEMM): route_pick with the logits as the single partial sum. Returns (ids int32, weights fp32)
    [B, top_k], as moe_route."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"route_topk: logits must be fp32 [B, E], got {logits.dtype} {tuple(logits.shape)}")
    _check_route("route_topk", bias, top_k, logits.shape[1])
    return route_pick(RouterScores(logits.contiguous()[:, None, :], bias.float().contiguous(), top_k, norm_topk_prob,
                                   float(scaling)))


# `fp32_gemv`: x.float() · w.float()ᵀ for decode rows against a small weight in one launch of
# `_route_logits_kernel`, where torch takes two or three (x.float(), cuBLAS's GEMV, a split-K reduce): the
# indexer's head weights (fp32, 32 x 4096, 512 KB) and its pooling gate (bf16, 128 x 4096, which an FP8
# core leaves in bf16 and cuBLAS ran as a split-K GEMV and its reduce). A program holds whole rows of w
# (GEMV_ROWS_A_PROGRAM of them), so its sums are finished and no second pass adds parts; x and a 16-bit w
# are widened in registers. H100, 11 copies in a graph,
# `.notes/s35_gemv.py`: 32 x 4096 at 1 / 4 / 16 rows 2.1 / 4.3 / 13.3 us against torch's 8.3 / 13.9 / 13.5;
# the router's 288 x 4096 (a prefill chunk of <= 16 rows) 4.0 / 6.8 / 17.5 against 8.8 / 18.8 / 22.6. Rows of x
# run one after another in a program, hence the small gain at 16. Other launches: 8 warps 6 % faster at 1 row
# of 32 x 4096, slower at 4 and 16; 2 rows of w a program 2-4 % faster on 288 x 4096 at 4 and 16 rows, slower
# on 32 x 4096 (the decode step's shape).
GEMV_ROWS_A_PROGRAM = 1
GEMV_MAX_K = 8192  # a program's rows of w sit in registers: 64 fp32 a thread at 4 warps


def fp32_gemv(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x.float() @ w.float().T for rows x [B, D] (any float dtype, unit column stride) and w [E, D] contiguous
    fp32, bf16 or fp16, D <= GEMV_MAX_K. Returns [B, E] in out_dtype, each fp32 sum (in a fixed tree order,
    not torch's) rounded once: 16-bit x and w give F.linear's exact products and fp32 sums."""
    B, D = x.shape
    E = _gemv_weight("fp32_gemv: w", w, D, (torch.float32, torch.bfloat16, torch.float16))
    if D > GEMV_MAX_K:
        raise ValueError(f"fp32_gemv: rows of {D} exceed GEMV_MAX_K ({GEMV_MAX_K})")
    _rows(x, "fp32_gemv: x", B, D)
    out = torch.empty(B, E, dtype=out_dtype, device=x.device)
    _route_logits_kernel[(triton.cdiv(E, GEMV_ROWS_A_PROGRAM), 1)](
        x, x.stride(0), w, out, B, E, D, BE=GEMV_ROWS_A_PROGRAM, BK=triton.next_power_of_2(D), launch_pdl=_pdl())
    return out


def moe_route(h: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, top_k: int, norm_topk_prob: bool,
              scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """model_glm.route for rows h [B, D]: s = sigmoid(h·gate_wᵀ) in fp32 (gate_w [E, D] fp32), the
    top_k experts of s + bias (bias [E] fp32), their s normalized (norm_topk_prob) and scaled.
    Returns (ids int32 [B, top_k], weights fp32 [B, top_k]), in no particular order (int32: what
    exl3_kernels.exl3_moe_decode reads, so no conversion launch between them)."""
    return route_pick(router_scores(h, gate_w, bias, top_k, norm_topk_prob, scaling))


# ================================================================ exact products on the tensor cores
# fp32-level products from 16-bit MMAs (bf16_fp32_linear here, dsa_kernels.py's attention and head
# matmul, kda_kernels.py's chunked prefill): bf16 x bf16 exact, an fp32 operand split into pieces.


@triton.jit
def _dot_bf16(a, b, TC: tl.constexpr, acc=None):
    # acc + bf16 x bf16 -> fp32. TC: on tensor cores; else (the CPU interpreter, whose bf16 dot is
    # wrong) as fp32, which gives the same exact products.
    if TC:
        return tl.dot(a, b, acc)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def _split(a, B_DT: tl.constexpr):
    # fp32 a as the (hi, lo) operand pair `_dot_pair` takes against a B_DT operand.
    if B_DT == tl.bfloat16:
        hi = a.to(tl.bfloat16)
        return hi, (a - hi.to(tl.float32)).to(tl.bfloat16)
    else:
        return a, a


@triton.jit
def _dot_pair(hi, lo, b, TC: tl.constexpr, acc=None):
    # acc + (hi + lo) · b in fp32 for bf16 b (from `_split`); acc + hi · b in fp32 otherwise. The
    # accumulator goes into the MMAs: added after them, it would be a second accumulator in registers.
    if b.dtype == tl.bfloat16:
        return _dot_bf16(lo, b, TC, _dot_bf16(hi, b, TC, acc))
    else:
        return tl.dot(hi.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def _dot_f32(a, b, TC: tl.constexpr, acc=None):
    # acc + a (fp32 or bf16) · b in fp32 (see the section comment).
    if a.dtype == b.dtype:
        if b.dtype == tl.bfloat16:
            return _dot_bf16(a, b, TC, acc)
        else:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        hi, lo = _split(a.to(tl.float32), b.dtype)
        return _dot_pair(hi, lo, b, TC, acc)


@triton.jit
def _dot_tf32x3(a, b, acc, B_EXACT: tl.constexpr):
    """acc + a · b for fp32 a, b near fp32 on TF32 tensor cores: each operand split into hi (its top 10
    mantissa bits, truncated: exact in TF32) and lo = x - hi, |lo| < 2^-10 |x|, then lo·hi + hi·lo + hi·hi;
    B_EXACT: b holds values TF32 keeps exact (bf16, fp16), so only a is split and two products do.
    Per product the dropped lo·lo is < 2^-20 of |a·b|, and the tensor cores truncate each lo to TF32,
    < 2^-20 more per split operand (`mhc_kernels._tf32`'s rounding, as its mix splits, would bring
    both to ~2^-22 for two more integer adds an element: not measured). Triton's own "tf32x3" rounds,
    with NaN / inf guards that cost ~40 % of the KDA state kernel's loop (sm_90 AOT: 1767 instructions
    against 1079); finite inputs need none."""
    a_hi, a_lo = _tf32_split(a)
    if B_EXACT:
        acc = tl.dot(a_lo, b, acc, input_precision="tf32")
        return tl.dot(a_hi, b, acc, input_precision="tf32")
    b_hi, b_lo = _tf32_split(b)
    acc = tl.dot(a_lo, b_hi, acc, input_precision="tf32")
    acc = tl.dot(a_hi, b_lo, acc, input_precision="tf32")
    return tl.dot(a_hi, b_hi, acc, input_precision="tf32")


@triton.jit
def _tf32_split(x):
    hi = (x.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return hi, x - hi


# ================================================================ sampling: the exponential race over candidates
# engine.draw_on_device's draw in two launches a batch (the twin: engine.process_rows and engine.race, the whole
# row filtered, then argmax(x - log noise)). Eager torch pays ~15-20 µs of host time an op on the H200, and
# the candidate form of the draw is ~35 ops: at batch 1 that was 0.8-1.2 ms a token (`.whl/s19_sample2_ab.py`).
# A program owns a row: its C most likely tokens come from one torch topk over the batch (sorted), the
# temperature divides them (IEEE, as the twin's division), top_k keeps those >= the k-th (ties kept), top_p
# the sorted head whose mass before a token stays under top_p (the mass over what top_k kept; without
# top_k over the whole row, streamed), min_p those within log(min_p) of the top. The token is the kept
# candidate with the largest x - log noise, noise read at its token id. A row whose kept set may reach past
# its candidates (a tie with the k-th at the last one; top_p's mass not reached by them) gets -1 and is
# drawn again over its whole row by a second kernel. A row without top_k and top_p races over its whole
# row, streamed.

SAMPLE_MAX_CANDIDATES = 2048  # more candidates than this and the batch is drawn by the twin
SAMPLE_BLOCK_V = 8192  # the whole-row passes' block (the more bytes in flight, the less the loads' latency shows)


@triton.jit
def _race_noise_log(e):
    # log of Exp(1) noise; noise 0 (possible in fp32) would give +inf to any token, a removed one included.
    return tl.log(tl.maximum(e, 1.1754943508222875e-38))


@triton.jit
def _row_mass(x_ptr, V, t, top, BV: tl.constexpr):
    # sum of exp(x / t - top) over the row; top is its largest x / t.
    acc = tl.zeros([BV], dtype=tl.float32)
    for start in range(0, V, BV):
        v = start + tl.arange(0, BV)
        xv = tl.math.div_rn(tl.load(x_ptr + v, mask=v < V, other=float("-inf")), t)
        acc += tl.exp(xv - top)
    return tl.sum(acc, 0)


@triton.jit
def _mass_split(y_ptr, V, top, mid, floor, BV: tl.constexpr):
    # Over the row's y = x / t (already divided) >= floor: the sum of exp(y - top) over y > mid, the largest
    # y <= mid and the smallest y > mid (-inf / inf where there is none).
    acc = tl.zeros([BV], dtype=tl.float32)
    below = tl.full([BV], float("-inf"), dtype=tl.float32)
    above = tl.full([BV], float("inf"), dtype=tl.float32)
    for start in range(0, V, BV):
        v = start + tl.arange(0, BV)
        y = tl.load(y_ptr + v, mask=v < V, other=float("-inf"))
        kept = y >= floor
        acc += tl.where(kept & (y > mid), tl.exp(y - top), 0.0)
        below = tl.maximum(below, tl.where(kept & (y <= mid), y, float("-inf")))
        above = tl.minimum(above, tl.where(kept & (y > mid), y, float("inf")))
    return tl.sum(acc, 0), tl.max(below, 0), tl.min(above, 0)


@triton.jit
def _row_race(x_ptr, noise_ptr, V, t, top, log_min_p, floor, BV: tl.constexpr):
    # argmax over the row of x / t - log noise where x / t - top >= log(min_p) and x / t >= floor; the first
    # of equal scores.
    # Each lane keeps its own best and the lanes meet once at the end: a reduction a block would stall
    # every block on a barrier, and the loop is bound by the loads' latency as it is.
    best = tl.full([BV], float("-inf"), dtype=tl.float32)
    best_i = tl.zeros([BV], dtype=tl.int32)
    for start in range(0, V, BV):
        v = start + tl.arange(0, BV)
        xv = tl.math.div_rn(tl.load(x_ptr + v, mask=v < V, other=float("-inf")), t)
        e = tl.load(noise_ptr + v, mask=v < V, other=1.0)
        score = tl.where((xv - top >= log_min_p) & (xv >= floor) & (v < V), xv - _race_noise_log(e), float("-inf"))
        best_i = tl.where(score > best, v, best_i)
        best = tl.maximum(best, score)
    m = tl.max(best, 0)
    return tl.min(tl.where(best == m, best_i, V), 0).to(tl.int64)


@triton.jit
def _sample_race_kernel(x_ptr, vals_ptr, idx_ptr, noise_ptr, cols_ptr, out_ptr, V, C,
                        BC: tl.constexpr, BV: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(cols_ptr + row * 4)  # temperature, 1 for a greedy row
    k = tl.load(cols_ptr + row * 4 + 1).to(tl.int32)  # 0: no top_k
    top_p = tl.load(cols_ptr + row * 4 + 2)  # inf: no top_p
    log_min_p = tl.load(cols_ptr + row * 4 + 3)  # -inf: no min_p
    j = tl.arange(0, BC)
    inside_c = j < C
    vals = tl.math.div_rn(tl.load(vals_ptr + row * C + j, mask=inside_c, other=float("-inf")), t)
    top = tl.max(vals, 0)
    kth = tl.where(k > 0, tl.sum(tl.where(j == k - 1, vals, 0.0), 0), float("-inf"))
    last = tl.sum(tl.where(j == C - 1, vals, 0.0), 0)
    keep = (vals >= kth) & inside_c
    mass = tl.sum(tl.where(keep, tl.exp(vals - top), 0.0), 0)
    if (k == 0) & (top_p < float("inf")):
        mass = _row_mass(x_ptr + row * V, V, t, top, BV)
    probs = tl.where(keep, tl.math.div_rn(tl.exp(vals - top), mass), 0.0)
    drop = tl.cumsum(probs, 0) - probs >= top_p
    keep = keep & (drop == 0) & (vals - top >= log_min_p)
    drop_last = tl.sum(tl.where((j == C - 1) & drop, 1, 0), 0) > 0
    inside = (C == V) | tl.where(k > 0, last < kth, drop_last)
    if (k > 0) | (top_p < float("inf")):
        idx = tl.load(idx_ptr + row * C + j, mask=inside_c, other=0)
        e = tl.load(noise_ptr + row * V + idx, mask=inside_c, other=1.0)
        score = tl.where(keep, vals - _race_noise_log(e), float("-inf"))
        token = tl.sum(tl.where(j == tl.argmax(score, 0), idx, 0), 0)
        token = tl.where(inside, token, -1)
    else:
        token = _row_race(x_ptr + row * V, noise_ptr + row * V, V, t, top, log_min_p, float("-inf"), BV)
    tl.store(out_ptr + row, token)


@triton.jit
def _float_key(x):
    # fp32 -> int32 in the order of the floats (a negative float's magnitude bits reversed); its own inverse
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _key_float(key):
    b = key.to(tl.int32)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b).to(tl.float32, bitcast=True)


@triton.jit
def _sample_rest_kernel(x_ptr, y_ptr, vals_ptr, noise_ptr, cols_ptr, out_ptr, V, C, BV: tl.constexpr):
    # A row _sample_race_kernel left at -1, drawn over its whole row on the device (no host decision, so
    # the engine can queue the next step behind the draw); any other row returns at once. Its kept set is
    # y = x / t >= floor: top_k's k-th value, raised by top_p to the smallest y whose row mass above it
    # stays under top_p (a token is dropped when the mass before it reaches top_p). That y lies in
    # (lo, hi]: the mass above lo reaches top_p, above hi it does not. Each pass over the row (divided once
    # into y_ptr) tries a point between them by the masses' linear interpolation (Illinois: a bound kept
    # twice in a row counts half), after 32 passes their middle in the floats' integer order, and moves lo
    # or hi onto the row's values next to it: 6-16 passes on 154880-token rows of several shapes (CPU
    # interpreter), at most 64, instead of the twin's sort. A tie at the
    # boundary keeps every tied token, where the twin keeps those its sort puts first.
    row = tl.program_id(0).to(tl.int64)
    if tl.load(out_ptr + row) < 0:
        t = tl.load(cols_ptr + row * 4)
        k = tl.load(cols_ptr + row * 4 + 1).to(tl.int32)
        top_p = tl.load(cols_ptr + row * 4 + 2)
        log_min_p = tl.load(cols_ptr + row * 4 + 3)
        top = tl.math.div_rn(tl.load(vals_ptr + row * C), t)
        floor = tl.math.div_rn(tl.load(vals_ptr + row * C + tl.maximum(k - 1, 0)), t)
        floor = tl.where(k > 0, floor, float("-inf"))
        if top_p < float("inf"):
            acc = tl.zeros([BV], dtype=tl.float32)
            for start in range(0, V, BV):
                v = start + tl.arange(0, BV)
                y = tl.math.div_rn(tl.load(x_ptr + row * V + v, mask=v < V, other=float("-inf")), t)
                tl.store(y_ptr + row * V + v, y, mask=v < V)
                acc += tl.where(y >= floor, tl.exp(y - top), 0.0)
            mass = tl.sum(acc, 0)
            tl.debug_barrier()  # the passes below read what other threads of the program stored
            # exp(y - top) is 0 in fp32 below top - 104: all of the mass lies above top - 128
            lo_v, hi_v, g_lo, g_hi = top - 128.0, top, 1.0 - top_p, -top_p  # mass above, less top_p
            lo, hi = _float_key(lo_v).to(tl.int64), _float_key(hi_v).to(tl.int64)
            passes, side = 0, 0
            while hi - lo > 1:
                if passes < 32:  # Illinois: the bound kept twice in a row counts half in the next guess
                    guess = lo_v + (hi_v - lo_v) * (g_lo / (g_lo - g_hi))
                    mid = tl.minimum(tl.maximum(_float_key(guess).to(tl.int64), lo + 1), hi - 1)
                else:  # (a bound on the passes whatever the row)
                    mid = lo + (hi - lo) // 2
                above_mid, below, above = _mass_split(y_ptr + row * V, V, top, _key_float(mid), floor, BV)
                g = tl.math.div_rn(above_mid, mass) - top_p
                if g >= 0:  # the boundary lies above mid, at the row's next value or higher
                    lo = _float_key(above).to(tl.int64) - 1
                    lo_v, g_lo = _key_float(lo), g
                    g_hi = tl.where(side == 1, g_hi * 0.5, g_hi)
                    side = 1
                else:  # at mid or below, at the row's value next to it or lower
                    hi = _float_key(below).to(tl.int64)
                    hi_v, g_hi = below, g
                    g_lo = tl.where(side == 2, g_lo * 0.5, g_lo)
                    side = 2
                passes += 1
            floor = tl.maximum(floor, _key_float(hi))
        token = _row_race(x_ptr + row * V, noise_ptr + row * V, V, t, top, log_min_p, floor, BV)
        tl.store(out_ptr + row, token)


def sample_race(x: torch.Tensor, noise: torch.Tensor, cols: torch.Tensor, c: int) -> torch.Tensor:
    """One token per row of fp32 [N, V] logits x (penalties applied, not the temperature): the exponential
    race of the row's kept tokens with noise [N, V] (Exp(1)), under cols [N, 4] fp32 (temperature, 1 at
    temperature 0; top_k, 0 off; top_p, inf off; log(min_p), -inf off), among the row's c most likely
    tokens when it has top_k or top_p, and over its whole row where the kept set may reach past them
    (a second launch, which returns at once for the other rows). int64 [N], left on the device."""
    N, V = x.shape
    if x.dtype != torch.float32 or noise.shape != x.shape or cols.shape != (N, 4):
        raise ValueError(f"sample_race: x fp32 [N, V] (got {x.dtype} {list(x.shape)}), noise {list(noise.shape)} "
                         f"and cols [N, 4] (got {list(cols.shape)})")
    if not 1 <= c <= min(V, SAMPLE_MAX_CANDIDATES):
        raise ValueError(f"sample_race: {c} candidates, not in 1..{min(V, SAMPLE_MAX_CANDIDATES)}")
    x, noise = x.contiguous(), noise.contiguous()
    vals, idx = x.topk(c, -1)
    out = torch.empty(N, dtype=torch.int64, device=x.device)
    _sample_race_kernel[(N,)](x, vals, idx, noise, cols, out, V, c, BC=max(16, triton.next_power_of_2(c)),
                              BV=SAMPLE_BLOCK_V, num_warps=8)
    _sample_rest_kernel[(N,)](x, torch.empty_like(x), vals, noise, cols, out, V, c, BV=SAMPLE_BLOCK_V, num_warps=16)
    return out

"""mHC (spec glm53.md §4.2) in Triton, each kernel with its twin in model_glm.py (`hc_pre`, `hc_post`): the
decode step's and the prefill chunk's stream mixing. Like kernels.py it imports neither exl3.py nor
model_glm.py; it takes a few helpers from kernels.py.

hc_pre for B rows of streams X [B, hc, D]: m = (X_flat · fnᵀ) · r with r = rsqrt(mean(X_flat²) + eps),
then pre / post / the Sinkhorn matrix C from m, u = Σ_i pre_i X_i rounded to X's dtype, and the
sub-layer's RMSNorm of u. Three launches. The mix splits the 16384-long dot products (and Σ x²)
over S programs along n_in, one partial sum per row and split: `_hc_mix_kernel` (BR rows per
program, fp32 FMA) for the decode step's few rows and for fp32 X; `_hc_mix_dot_kernel` (tiles of
BM rows on the tensor cores, fp32-level) from HC_DOT_MIN_ROWS 16-bit rows on (prefill chunks).
In `_hc_pre_kernel`, parallel over blocks of D, every program adds those partial sums and computes
pre itself (cheaper than another launch; the first program of a row also computes post and C, unless
`_hc_sinkhorn_kernel` does so on a second stream),
then its block of u and the block's Σ u²; `_hc_norm_kernel` adds the Σ u² partial sums and applies
the RMSNorm to its block. Partial sums are added in a fixed order: deterministic. `_hc_pre_kernel`
runs one warp per program: the 39 normalizations of the 4x4 Sinkhorn matrix are a serial chain of
reductions, which with 4 warps cross warps through shared memory (H200, one decode row: 7.4 us a
call with 4 warps, 4.7 with one; 4.3 with 4 warps and a single Sinkhorn iteration).
`_hc_post_kernel`: X'_j = post_j y + Σ_i C[i, j] X_i. `hc_post_pre`: a sub-layer's hc_post and the
next one's hc_pre (the decode step's order), the post and the mix in one launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _arrival_counters, _cast, _pdl, _pdl_enter, _rms_scaled

HC_MIX_BLOCK = 256
HC_MIX_ROWS = 16
HC_POST_MIX_BLOCK = 64  # columns of each of the hc streams a program of `_hc_post_mix_kernel` takes
# rows up to which that launch's last program of a row also runs hc_pre and the RMSNorm (H100, first 20 layers,
# decode steps against the two launches after it, two runs: 1.002x / 1.056x / 1.047x / 1.077x / 1.077x / 1.035x
# at B 1 / 2 / 4 / 8 / 16 / 32; more rows are unmeasured)
HC_FINISH_ROWS = 32
_HC_ARRIVALS: dict[tuple[torch.device, int], torch.Tensor] = {}  # `_hc_post_mix_kernel`'s (_arrival_counters)
HC_DOT_MIN_ROWS = 64
HC_DOT_ROWS = 64
HC_DOT_BLOCK = 32  # columns a step, at HC_DOT_STAGES stages (H200, 8192 rows: 189 us against 263 at 64 and 3)
HC_DOT_STAGES = 4
HC_DOT_SPLIT = 1024
HC_BLOCK = 512
HC_POST_BLOCK = 1024  # columns a program of `_hc_post_kernel`: 152 us at 8192 rows of 4 x 4096 against 216 at 512 (H200)


@triton.jit
def _hc_mix_kernel(x_ptr, fn_ptr, part_ptr, sq_ptr, B, n_in, n_out, S, NP: tl.constexpr, BK: tl.constexpr,
                   BR: tl.constexpr):
    # BR rows per program share each load of fn (a prefill chunk has thousands of rows; fn is 1.5 MB);
    # each row's sums are the one-row kernel's, in fp32 FMA (tl.dot may round its inputs to TF32)
    _pdl_enter()
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
    _pdl_enter()
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
        # each step's products summed apart, then added to acc in fp32: the MMA's own accumulation rounds
        # less evenly, and at 32 columns a step twice as many of its adds into acc missed the exactness
        # bound on the H200 (tests/test_fastdecode.py)
        acc += tl.dot(x, fn_lo, tl.dot(x, fn_hi, input_precision="tf32"), input_precision="tf32")
        sq += tl.sum(x * x, axis=1)
    tl.store(part_ptr + (rows[:, None] * S + s) * NP + o[None, :], acc, mask=row_ok[:, None])
    tl.store(sq_ptr + rows * S + s, sq, mask=row_ok)


# The mix's partial sums and X' are read with a cache modifier CACHE: ".cg" (at L2) where other programs
# of the same launch stored them (`_hc_pre_norm_rows`), "" where a launch before did.

@triton.jit
def _hc_rms_factor(sq_ptr, b, s, on, S, D, rms_eps, HC: tl.constexpr, CACHE: tl.constexpr):
    # r = rsqrt(mean(X_flat²) + eps) of row b from its S partial sums of squares.
    sq = tl.load(sq_ptr + b * S + s, mask=on, other=0.0, cache_modifier=CACHE)
    return 1.0 / tl.sqrt(tl.sum(sq, axis=0) / (HC * D) + rms_eps)


@triton.jit
def _hc_post_and_c(part_ptr, row, on, r, base_ptr, scale_ptr, post_ptr, c_ptr, b, hc_eps, iters, HC: tl.constexpr,
                   CACHE: tl.constexpr):
    # post and the Sinkhorn matrix C of row b from its mix partial sums (rows `row` of part, S of them).
    i = tl.arange(0, HC)
    ij = i[:, None] * HC + i[None, :]
    m_post = tl.sum(tl.load(part_ptr + row[:, None] + HC + i[None, :], mask=on[:, None], other=0.0,
                            cache_modifier=CACHE), axis=0) * r
    m_c = tl.sum(tl.load(part_ptr + row[:, None, None] + 2 * HC + ij[None, :, :], mask=on[:, None, None],
                         other=0.0, cache_modifier=CACHE), axis=0) * r
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


@triton.jit
def _hc_pre_weights(part_ptr, sq_ptr, base_ptr, scale_ptr, b, S, D, rms_eps, hc_eps, HC: tl.constexpr,
                    NP: tl.constexpr, SP: tl.constexpr, CACHE: tl.constexpr):
    # hc_pre's weights of row b from its mix partial sums: (pre [HC], r, the row's places in part, which
    # of them exist), the last three for `_hc_post_and_c`.
    s = tl.arange(0, SP)
    on = s < S
    row = (b * S + s) * NP
    i = tl.arange(0, HC)
    # every load before the sums (an exchange between warps each), so that none waits for another
    scale = tl.load(scale_ptr)
    base = tl.load(base_ptr + i)
    parts = tl.load(part_ptr + row[:, None] + i[None, :], mask=on[:, None], other=0.0, cache_modifier=CACHE)
    r = _hc_rms_factor(sq_ptr, b, s, on, S, D, rms_eps, HC, CACHE)
    return tl.sigmoid(scale * (tl.sum(parts, axis=0) * r) + base) + hc_eps, r, row, on


@triton.jit
def _hc_streams(x_ptr, b, d, D, HC: tl.constexpr, CACHE: tl.constexpr):
    # Row b's HC streams X_i at columns d, [HC, len(d)]: loaded before hc_pre's weights, whose sums
    # exchange values between warps, so that the two loads are in flight together.
    i = tl.arange(0, HC)
    return tl.load(x_ptr + b * HC * D + i[:, None] * D + d[None, :], mask=(d < D)[None, :], other=0.0,
                   cache_modifier=CACHE)


@triton.jit
def _hc_u(X, pre, DT: tl.constexpr):
    # u = Σ_i pre_i X_i, rounded to DT (X's dtype: model_glm.hc_pre's rounding).
    return _cast(tl.sum(pre[:, None] * X.to(tl.float32), axis=0), DT)


@triton.jit
def _hc_pre_kernel(x_ptr, part_ptr, sq_ptr, base_ptr, scale_ptr, u_ptr, usq_ptr, post_ptr, c_ptr,
                   D, S, NB, rms_eps, hc_eps, iters,
                   HC: tl.constexpr, NP: tl.constexpr, SP: tl.constexpr, BD: tl.constexpr, SINKHORN: tl.constexpr):
    # SINKHORN: the first program of a row also computes post and C (else `_hc_sinkhorn_kernel` does).
    _pdl_enter()
    b = tl.program_id(0)
    blk = tl.program_id(1)
    d = blk * BD + tl.arange(0, BD)
    X = _hc_streams(x_ptr, b, d, D, HC, "")
    pre, r, row, on = _hc_pre_weights(part_ptr, sq_ptr, base_ptr, scale_ptr, b, S, D, rms_eps, hc_eps, HC, NP, SP, "")
    if SINKHORN:
        if blk == 0:
            _hc_post_and_c(part_ptr, row, on, r, base_ptr, scale_ptr, post_ptr, c_ptr, b, hc_eps, iters, HC, "")
    # Σ u² of the rounded values for the RMSNorm.
    u = _hc_u(X, pre, u_ptr.dtype.element_ty)
    tl.store(u_ptr + b * D + d, u, mask=d < D)
    tl.store(usq_ptr + b * NB + blk, tl.sum(u.to(tl.float32) * u.to(tl.float32), axis=0))


@triton.jit
def _hc_sinkhorn_kernel(part_ptr, sq_ptr, base_ptr, scale_ptr, post_ptr, c_ptr, D, S, rms_eps, hc_eps, iters,
                        HC: tl.constexpr, NP: tl.constexpr, SP: tl.constexpr):
    # hc_pre's post and C of row b on their own, for a second stream (see _hc_finish).
    _pdl_enter()
    b = tl.program_id(0)
    s = tl.arange(0, SP)
    on = s < S
    r = _hc_rms_factor(sq_ptr, b, s, on, S, D, rms_eps, HC, "")
    _hc_post_and_c(part_ptr, (b * S + s) * NP, on, r, base_ptr, scale_ptr, post_ptr, c_ptr, b, hc_eps, iters, HC, "")


@triton.jit
def _hc_norm_factor(usq, D, rms_eps):
    # 1 / rms(u) from u's per-block sums of squares usq.
    return 1.0 / tl.sqrt(tl.sum(usq, axis=0) / D + rms_eps)


@triton.jit
def _hc_pre_norm_rows(x_ptr, part_ptr, sq_ptr, base_ptr, scale_ptr, norm_ptr, out_ptr, post_ptr, c_ptr, b0, B, D, S,
                      rms_eps, hc_eps, iters, HC: tl.constexpr, NP: tl.constexpr, SP: tl.constexpr, BD: tl.constexpr,
                      NBP: tl.constexpr, BR: tl.constexpr, SINKHORN: tl.constexpr):
    # `_hc_pre_kernel` and `_hc_norm_kernel` for rows b0 .. b0 + BR - 1 of X' (x_ptr) in one program, which
    # reads what the other programs of its launch stored at L2. A row's whole X' is loaded at once (a loop
    # over blocks of it waits for each load in turn); u's sums of squares are taken per block of BD, as
    # `_hc_pre_kernel`'s programs take them.
    DT = x_ptr.dtype.element_ty
    d = tl.arange(0, NBP * BD)
    w = tl.load(norm_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    for r in range(BR):
        b = b0 + r
        if b < B:
            X = _hc_streams(x_ptr, b, d, D, HC, ".cg")
            pre, rf, row, on = _hc_pre_weights(part_ptr, sq_ptr, base_ptr, scale_ptr, b, S, D, rms_eps, hc_eps, HC, NP,
                                               SP, ".cg")
            if SINKHORN:
                _hc_post_and_c(part_ptr, row, on, rf, base_ptr, scale_ptr, post_ptr, c_ptr, b, hc_eps, iters, HC,
                               ".cg")
            u = _hc_u(X, pre, DT).to(tl.float32)
            rs = _hc_norm_factor(tl.sum(tl.reshape(u * u, (NBP, BD)), axis=1), D, rms_eps)
            tl.store(out_ptr + b * D + d, _rms_scaled(u, rs, w, DT, out_ptr.dtype.element_ty), mask=d < D)


@triton.jit
def _hc_norm_kernel(u_ptr, usq_ptr, norm_ptr, out_ptr, D, NB, rms_eps, NBP: tl.constexpr, BD: tl.constexpr):
    # RMSNorm(u) · weight with model_glm.rms_norm's roundings.
    _pdl_enter()
    b = tl.program_id(0)
    blocks = tl.arange(0, NBP)
    rs = _hc_norm_factor(tl.load(usq_ptr + b * NB + blocks, mask=blocks < NB, other=0.0), D, rms_eps)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    inside = d < D
    u = tl.load(u_ptr + b * D + d, mask=inside, other=0.0).to(tl.float32)
    w = tl.load(norm_ptr + d, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + b * D + d, _rms_scaled(u, rs, w, u_ptr.dtype.element_ty, out_ptr.dtype.element_ty),
             mask=inside)


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
    _pdl_enter()
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    _hc_post_block(x_ptr, y_ptr, y2_ptr, post_ptr, c_ptr, out_ptr, tl.program_id(0), d, D, HC, SUM)


@triton.jit
def _hc_post_mix_kernel(x_ptr, y_ptr, y2_ptr, post_ptr, c_ptr, out_ptr, fn_ptr, part_ptr, sq_ptr, B, D, n_out, S,
                        arrivals_ptr, base_ptr, scale_ptr, norm_ptr, xn_ptr, post2_ptr, c2_ptr, rms_eps, hc_eps, iters,
                        HC: tl.constexpr, BD: tl.constexpr, NP: tl.constexpr, BR: tl.constexpr, SUM: tl.constexpr,
                        FINISH: tl.constexpr, SP: tl.constexpr, BDN: tl.constexpr, NBP: tl.constexpr,
                        SINKHORN: tl.constexpr):
    # `_hc_post_block` for BR rows and one block of BD columns of every stream, then `_hc_mix_kernel`'s
    # partial sums over those HC x BD elements of the flattened row (split s = the column block), from
    # X' as stored. They group the products by column block instead of by runs of the flattened row:
    # the same sums up to fp32 rounding. FINISH: the last of the S programs of a row block (BR 1: of a row)
    # to store them goes on with hc_pre and the RMSNorm of those rows (`_hc_pre_norm_rows`: x, and with
    # SINKHORN post and C), which else are two more launches.
    _pdl_enter()
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
    if FINISH:
        tl.debug_barrier()
        g = tl.program_id(0)
        if tl.atomic_add(arrivals_ptr + g, 1, sem="acq_rel") == S - 1:
            _hc_pre_norm_rows(out_ptr, part_ptr, sq_ptr, base_ptr, scale_ptr, norm_ptr, xn_ptr, post2_ptr, c2_ptr, g * BR,
                              B, D, S, rms_eps, hc_eps, iters, HC, NP, SP, BDN, NBP, BR, SINKHORN)
            tl.store(arrivals_ptr + g, 0)


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
                                                             BM=HC_DOT_ROWS, BK=HC_DOT_BLOCK,
                                                             num_stages=HC_DOT_STAGES, launch_pdl=_pdl())
    else:
        S = triton.cdiv(n_in, HC_MIX_BLOCK)
        part = torch.empty(B, S, NP, dtype=torch.float32, device=x.device)
        sq = torch.empty(B, S, dtype=torch.float32, device=x.device)
        _hc_mix_kernel[(triton.cdiv(B, HC_MIX_ROWS), S)](x, fn, part, sq, B, n_in, n_out, S, NP=NP, BK=HC_MIX_BLOCK,
                                                         BR=HC_MIX_ROWS, launch_pdl=_pdl())
    return part, sq


def hc_pre(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm: torch.Tensor,
           rms_eps: float, hc_eps: float, iters: int, beside: "torch.cuda.Stream | None" = None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """model_glm.hc_pre followed by rms_norm(u, norm): X [B, hc, D] -> (x [B, D], post [B, hc] fp32,
    C [B, hc, hc] fp32). fn [3hc + hc², hc·D] fp32, base [3hc + hc²] and scale [3] fp32. With a CUDA
    stream `beside`, post and C (the Sinkhorn) are computed on it, beside x: the caller makes its
    stream wait for `beside` before it reads them."""
    B, hc, D = X.shape
    _hc_check("hc_pre", X, fn)
    X = X.contiguous()
    return _hc_finish(X, *_hc_mix(X.view(B, hc * D), fn), base, scale, norm, rms_eps, hc_eps, iters, beside)


def _hc_check(name: str, X: torch.Tensor, fn: torch.Tensor) -> None:
    B, hc, D = X.shape
    n_in, n_out = hc * D, 2 * hc + hc * hc
    if tuple(fn.shape) != (n_out, n_in) or fn.dtype != torch.float32 or not fn.is_contiguous():
        raise ValueError(f"{name}: fn must be contiguous fp32 ({n_out}, {n_in}), got {fn.dtype} {tuple(fn.shape)}")
    if hc & (hc - 1):
        raise ValueError(f"{name}: hc_mult {hc} must be a power of two")


def _hc_finish(X: torch.Tensor, part: torch.Tensor, sq: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
               norm: torch.Tensor, rms_eps: float, hc_eps: float, iters: int,
               beside: "torch.cuda.Stream | None" = None) -> tuple[torch.Tensor, ...]:
    """hc_pre after the mix: (x, post, C) from its partial sums part [B, S, NP] and sq [B, S]; with
    `beside`, post and C come from `_hc_sinkhorn_kernel` on that stream (see hc_pre). The Sinkhorn's
    ~40 dependent normalizations are then off the path to x (H200, whole model, decode B=1 against the
    Sinkhorn inside _hc_pre_kernel: 1.006-1.013x, BENCHMARKS.md session 17)."""
    B, hc, D = X.shape
    S, NP = part.shape[1:]
    BD = min(HC_BLOCK, triton.next_power_of_2(D))
    NB = triton.cdiv(D, BD)
    SP = triton.next_power_of_2(S)
    base, scale = base.float().contiguous(), scale.float().contiguous()
    u = torch.empty(B, D, dtype=X.dtype, device=X.device)
    usq = torch.empty(B, NB, dtype=torch.float32, device=X.device)
    x, post, C = _hc_outputs(X, norm)
    if beside is not None:
        _hc_sinkhorn_beside(beside, part, sq, base, scale, post, C, D, rms_eps, hc_eps, iters)
    _hc_pre_kernel[(B, NB)](X, part, sq, base, scale, u, usq, post, C, D, S, NB, rms_eps, hc_eps, iters, HC=hc,
                            NP=NP, SP=SP, BD=BD, SINKHORN=beside is None, num_warps=1, launch_pdl=_pdl())
    _hc_norm_kernel[(B, NB)](u, usq, norm, x, D, NB, rms_eps, NBP=triton.next_power_of_2(NB), BD=BD, launch_pdl=_pdl())
    return x, post, C


def _hc_outputs(X: torch.Tensor, norm: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # hc_pre's (x, post, C) for X [B, hc, D], unfilled.
    B, hc, D = X.shape
    return (torch.empty(B, D, dtype=torch.promote_types(norm.dtype, X.dtype), device=X.device),
            torch.empty(B, hc, dtype=torch.float32, device=X.device),
            torch.empty(B, hc, hc, dtype=torch.float32, device=X.device))


def _hc_sinkhorn_beside(beside: "torch.cuda.Stream", part: torch.Tensor, sq: torch.Tensor, base: torch.Tensor,
                        scale: torch.Tensor, post: torch.Tensor, C: torch.Tensor, D: int, rms_eps: float,
                        hc_eps: float, iters: int) -> None:
    # `_hc_sinkhorn` on the stream `beside`, after what this stream has launched so far.
    beside.wait_stream(torch.cuda.current_stream(part.device))
    with torch.cuda.stream(beside):
        _hc_sinkhorn(part, sq, base, scale, post, C, D, rms_eps, hc_eps, iters)
    for t in (part, sq, base, scale, post, C):  # made on this stream, used on the other one
        t.record_stream(beside)


def _hc_sinkhorn(part: torch.Tensor, sq: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, post: torch.Tensor,
                 C: torch.Tensor, D: int, rms_eps: float, hc_eps: float, iters: int) -> None:
    """hc_pre's post [B, hc] and C [B, hc, hc] from the mix's partial sums, into post and C, in a launch
    of their own (the same sums in the same order as `_hc_pre_kernel`'s own)."""
    B, hc = post.shape
    S, NP = part.shape[1:]
    _hc_sinkhorn_kernel[(B,)](part, sq, base, scale, post, C, D, S, rms_eps, hc_eps, iters, HC=hc, NP=NP,
                              SP=triton.next_power_of_2(S), num_warps=1, launch_pdl=_pdl())


def hc_post(X: torch.Tensor, y: torch.Tensor, post: torch.Tensor, C: torch.Tensor,
            y2: torch.Tensor | None = None) -> torch.Tensor:
    """model_glm.hc_post: X [B, hc, D], y [B, D], post [B, hc], C [B, hc, hc] -> X' in X's dtype.
    With y2 [B, D] the sub-layer output is (y + y2) in fp32 rounded to X's dtype: a MoE layer's routed
    sum (fp32) and shared expert, added here instead of in two more launches."""
    B, hc, D = X.shape
    X, y, y2, post, C = _hc_post_operands("hc_post", X, y, y2, post, C)
    out = torch.empty_like(X)
    BD = min(HC_POST_BLOCK, triton.next_power_of_2(D))
    _hc_post_kernel[(B, triton.cdiv(D, BD))](X, y, y2, post, C, out, D, HC=hc, BD=BD, SUM=y2 is not y,
                                             launch_pdl=_pdl())
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
                iters: int, y2: torch.Tensor | None = None, beside: "torch.cuda.Stream | None" = None
                ) -> tuple[torch.Tensor, ...]:
    """hc_post(X, y, post, C, y2) followed by the next sub-layer's hc_pre(X', fn, base, scale, norm, ...):
    (X', x, post', C'). Below HC_DOT_MIN_ROWS rows (the decode step's) hc_post and hc_pre's mix share
    one launch (`_hc_post_mix_kernel`), and up to HC_FINISH_ROWS rows the rest of hc_pre and its
    RMSNorm run at the end of that launch too; more rows run the two functions. `beside`: see hc_pre."""
    B, hc, D = X.shape
    _hc_check("hc_post_pre", X, fn)
    if B >= HC_DOT_MIN_ROWS or D % HC_POST_MIX_BLOCK:
        X = hc_post(X, y, post, C, y2)
        return X, *hc_pre(X, fn, base, scale, norm, rms_eps, hc_eps, iters, beside)
    X, y, y2, post, C = _hc_post_operands("hc_post_pre", X, y, y2, post, C)
    out = torch.empty_like(X)
    S = D // HC_POST_MIX_BLOCK
    NP = max(16, triton.next_power_of_2(fn.shape[0]))
    part = torch.empty(B, S, NP, dtype=torch.float32, device=X.device)
    sq = torch.empty(B, S, dtype=torch.float32, device=X.device)
    finish = B <= HC_FINISH_ROWS
    rows = 1 if finish else HC_MIX_ROWS  # finishing, a program a row: each row's last program takes it on
    groups = triton.cdiv(B, rows)
    base, scale = base.float().contiguous(), scale.float().contiguous()
    x, post2, C2 = _hc_outputs(X, norm)
    BD = min(HC_BLOCK, triton.next_power_of_2(D))
    arrivals = _arrival_counters(_HC_ARRIVALS, X.device, groups)
    _hc_post_mix_kernel[(groups, S)](X, y, y2, post, C, out, fn, part, sq, B, D, fn.shape[0], S, arrivals, base,
                                     scale, norm, x, post2, C2, rms_eps, hc_eps, iters, HC=hc, BD=HC_POST_MIX_BLOCK,
                                     NP=NP, BR=rows, SUM=y2 is not y, FINISH=finish, SP=triton.next_power_of_2(S),
                                     BDN=BD, NBP=triton.next_power_of_2(triton.cdiv(D, BD)), SINKHORN=beside is None,
                                     launch_pdl=_pdl())
    if not finish:
        return out, *_hc_finish(out, part, sq, base, scale, norm, rms_eps, hc_eps, iters, beside)
    if beside is not None:
        _hc_sinkhorn_beside(beside, part, sq, base, scale, post2, C2, D, rms_eps, hc_eps, iters)
    return out, x, post2, C2

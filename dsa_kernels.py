"""Triton kernels of DSA (spec glm53.md §4.4), each with a slow pure-torch twin in model_glm.py that
tests/test_fastdecode.py holds it to: the decode step's `dsa_decode_inputs` (q_a / kv_a layernorms,
indexer k_norm, the token's cache rows and pooled key: `rms_norm`, `pool_keys` and GLMModel.dsa's
writes), `dsa_index_scores` (the indexer's pool scores: `select_tokens` before its top-k) and
`dsa_sparse_attention` (absorbed MLA over the selected positions, gathered from the paged cache:
`mla_attention` between W_UK and W_UV); `head_matmul`, the absorbed MLA's per-head products around
it; the prefill's `dsa_prefill_index_scores` and `dsa_prefill_attention`, the indexer and the attention
for the query rows of one sequence's chunk (fastprefill.py).

Like kernels.py, this file imports neither exl3.py nor model_glm.py; it takes kernels.py's shared
helpers (checks, roundings, the exact products on the tensor cores).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import (_cast, _check_pow2, _dot_bf16, _dot_f32, _dot_pair, _dot_tf32x3, _pdl, _pdl_enter, _pow2_scale,
                     _rms_scaled, _rows, _split)

# ================================================================ decode-step kernels: DSA (§4.4)
# One token per sequence against a paged cache: row tensors latent [blocks, bs, R], pooled
# [blocks, bs / kpool, d], and the slots' tail rings index_k / gate [slots, ring, d] (position % ring);
# tables [B, width] (block ids), positions and slots [B] on the device. Pools are numbered along the
# table (pool p = block table[p // (bs / kpool)]).
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

# Pools a program and warps of `dsa_index_scores`: 32 and 8 against 64 and 4 (H100, 11 layers' caches in a
# graph, `.notes/s36_sweep.py`): 1.30x at B=1 and 8K of context (2.74 us; 64 pools a program left 33 programs
# for 132 SMs), 1.02x at 64K, 1.06x at B=4 and 1.18x at B=16.
DSA_SCORE_BLOCK = 32
DSA_SCORE_WARPS = 8
DSA_ATTN_HEADS = 16  # heads per program (tl.dot needs >= 16 rows; fewer heads are padded)
# From DSA_ATTN_WIDE_FROM sequences on, 32 heads a program (255 registers at 4 warps, no spill): each
# gathered latent row serves twice the heads, and B sequences still give every SM its programs. H100,
# `.notes/s36_sweep.py`, 8K of context: 1.235x at B=4, 1.176x at B=16; at B=1, 0.80x (1K) and 0.89x (8K).
DSA_ATTN_HEADS_WIDE = 32
DSA_ATTN_WIDE_FROM = 4
DSA_ATTN_BLOCK = 16  # selected positions per inner step
# 4 warps (183 registers, no spill: sm_90, full size, triton 3.6) and splits for 2 programs an SM, against 8
# warps and 1 (H100, 11 layers' caches in a graph, `.notes/s35_attn2.py`): B=1 1.01x at 1K of context, 1.14x at
# 8K-64K (18.3 us); 1.39x at B=4 and 1.53x at B=16 at 8K. 3 an SM: more partial sums to combine than it gains.
DSA_ATTN_WARPS = 4
DSA_ATTN_PROGRAMS_PER_SM = 2

@triton.jit
def _rms_norm_of(x, w, eps, N: tl.constexpr, X_DT: tl.constexpr, OUT_DT: tl.constexpr):
    # model_glm.rms_norm of one loaded row x of N (X_DT, zero past N) and weight w, with its roundings (to
    # X_DT, then to OUT_DT), as fp32.
    rs = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    return _rms_scaled(x, rs, w, X_DT, OUT_DT).to(tl.float32)


@triton.jit
def _dsa_inputs_kernel(qa_ptr, qa_stride, kv_ptr, kv_stride, wk_ptr, wk_stride, g_ptr, g_stride, qn_ptr, kvn_ptr,
                       knw_ptr, knb_ptr, ape_ptr, qr_ptr, lat_ptr, ik_ptr, gate_ptr, pool_ptr, tables_ptr, t_stride,
                       pos_ptr, slots_ptr, ring, rms_eps, bs, Q: tl.constexpr, QP: tl.constexpr, R: tl.constexpr,
                       DI: tl.constexpr, KPOOL: tl.constexpr, C_DT: tl.constexpr):
    # A program's time is latency: every load comes first (the ring rows the pooled key needs behind the
    # slot, which they depend on), before the norms' sums exchange values between warps.
    _pdl_enter()
    b = tl.program_id(0)
    i = tl.arange(0, QP)
    r = tl.arange(0, R)
    d = tl.arange(0, DI)
    m = tl.arange(0, KPOOL)
    pos = tl.load(pos_ptr + b)
    qa = tl.load(qa_ptr + b * qa_stride + i, mask=i < Q, other=0.0).to(tl.float32)
    qn = tl.load(qn_ptr + i, mask=i < Q, other=0.0).to(tl.float32)
    kv = tl.load(kv_ptr + b * kv_stride + r).to(tl.float32)
    kvn = tl.load(kvn_ptr + r).to(tl.float32)
    x = tl.load(wk_ptr + b * wk_stride + d).to(tl.float32)
    knw = tl.load(knw_ptr + d).to(tl.float32)
    knb = tl.load(knb_ptr + d).to(tl.float32)
    g_raw = tl.load(g_ptr + b * g_stride + d)
    ape = tl.load(ape_ptr + m[:, None] * DI + d[None, :])
    blk = tl.load(tables_ptr + b * t_stride + pos // bs)
    off = pos % bs
    tail = tl.load(slots_ptr + b).to(tl.int64) * ring
    # the pooled key (model_glm.pool_keys) when this token is its pool's last: the other members come from
    # the slot's ring, this one from registers
    last = (pos + 1) % KPOOL == 0
    rows = (tail + (pos - (KPOOL - 1) + m) % ring)[:, None] * DI + d[None, :]
    earlier = ((m < KPOOL - 1) & ((pos + 1 + 0 * m) % KPOOL == 0))[:, None]  # (a vector: see _attn_rows)
    k_prev = tl.load(ik_ptr + rows, mask=earlier, other=0.0)
    g_prev = tl.load(gate_ptr + rows, mask=earlier, other=0.0)
    q_r = _rms_norm_of(qa, qn, rms_eps, Q, qa_ptr.dtype.element_ty, qr_ptr.dtype.element_ty)
    tl.store(qr_ptr + b * Q + i, q_r.to(qr_ptr.dtype.element_ty), mask=i < Q)
    # latent: kv_a_layernorm's output (C_DT), then the cache's dtype
    c = _rms_norm_of(kv, kvn, rms_eps, R, kv_ptr.dtype.element_ty, C_DT)
    tl.store(lat_ptr + (blk * bs + off) * R + r, _cast(c, lat_ptr.dtype.element_ty))
    # indexer key: F.layer_norm(wk, k_norm, eps 1e-6) in wk's dtype; the gate row as it is
    xc = x - tl.sum(x, axis=0) / DI
    k = xc * (1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / DI + 1e-6))
    k = k * knw + knb
    k = _cast(_cast(k, wk_ptr.dtype.element_ty).to(tl.float32), ik_ptr.dtype.element_ty)
    g = _cast(g_raw.to(tl.float32), gate_ptr.dtype.element_ty)
    tl.store(ik_ptr + (tail + pos % ring) * DI + d, k)
    tl.store(gate_ptr + (tail + pos % ring) * DI + d, g)
    if last:
        mine = (m == KPOOL - 1)[:, None]
        km = tl.where(mine, k[None, :], k_prev).to(tl.float32)
        gm = tl.where(mine, g[None, :], g_prev).to(tl.float32)
        logit = gm + ape
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
                      pooled: torch.Tensor, tables: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                      rms_eps: float) -> torch.Tensor:
    """§4.4 for one token per sequence, from the first projections' outputs q_a [B, q_lora], kv_a
    [B, R], wk and gamma [B, d] (rows may be strided): returns q_r = rms_norm(q_a, q_norm), and
    writes the token's cache rows as model_glm.write_dsa_rows does: latent ← rms_norm(kv_a, kv_norm),
    its slot's ring rows index_k ← layer_norm(wk, k_norm_w, k_norm_b, eps 1e-6) and gate ← gamma, and
    pooled ← pool_keys(the pool's members, ape [kpool, d] fp32) when position + 1 completes a pool."""
    B = _check_tables("dsa_decode_inputs", tables, positions)
    Q, R, (kpool, d) = q_a.shape[-1], kv_a.shape[-1], ape.shape
    nb, bs = latent.shape[:2]
    _check_cache_row("dsa_decode_inputs: latent", latent, nb, bs, R)
    ns, ring = index_k.shape[:2]
    _check_cache_row("dsa_decode_inputs: index_k", index_k, ns, ring, d)
    _check_cache_row("dsa_decode_inputs: gate", gate, ns, ring, d)
    if tuple(slots.shape) != (B,):
        raise ValueError(f"dsa_decode_inputs: slots must be [{B}], got {tuple(slots.shape)}")
    _check_cache_row("dsa_decode_inputs: pooled", pooled, nb, bs // kpool, d)
    for name, t, width in (("q_a", q_a, Q), ("kv_a", kv_a, R), ("wk", wk, d), ("gamma", gamma, d)):
        _rows(t, f"dsa_decode_inputs: {name}", B, width)
    if bs % kpool or R & (R - 1) or d & (d - 1) or kpool & (kpool - 1):
        raise ValueError(f"dsa_decode_inputs: needs block_size ({bs}) a multiple of kpool ({kpool}) and powers "
                         f"of two for kv_lora_rank ({R}), index_head_dim ({d}) and kpool")
    q_r = torch.empty(B, Q, dtype=torch.promote_types(q_norm.dtype, q_a.dtype), device=q_a.device)
    _dsa_inputs_kernel[(B,)](q_a, q_a.stride(0), kv_a, kv_a.stride(0), wk, wk.stride(0), gamma, gamma.stride(0),
                             q_norm, kv_norm, k_norm_w, k_norm_b, ape.float().contiguous(), q_r, latent, index_k,
                             gate, pooled, tables, tables.stride(0), positions, slots, ring, rms_eps, bs, Q=Q,
                             QP=triton.next_power_of_2(Q), R=R, DI=d, KPOOL=kpool,
                             C_DT=_TL_DTYPES[torch.promote_types(kv_norm.dtype, kv_a.dtype)], launch_pdl=_pdl())
    return q_r


@triton.jit
def _pooled_keys(pool_ptr, table_ptr, p, ppb, mask, DI: tl.constexpr):
    # The pooled keys of pools p [BP] through a block table of ppb pools a block: [BP, DI], 0 off mask.
    blk = tl.load(table_ptr + p // ppb, mask=mask, other=0)
    d = tl.arange(0, DI)
    return tl.load(pool_ptr + (blk * ppb + p % ppb)[:, None] * DI + d[None, :], mask=mask[:, None], other=0.0)


@triton.jit
def _dsa_scores_kernel(q_ptr, q_stride, w_ptr, pool_ptr, tables_ptr, t_stride, pos_ptr, out_ptr, P, ppb,
                       q_scale, w_scale, HI: tl.constexpr, DI: tl.constexpr, KPOOL: tl.constexpr,
                       BP: tl.constexpr, TC: tl.constexpr):
    _pdl_enter()
    b = tl.program_id(0)
    p = tl.program_id(1) * BP + tl.arange(0, BP)
    candidate = p < (tl.load(pos_ptr + b) + 1) // KPOOL
    h = tl.arange(0, HI)
    d = tl.arange(0, DI)
    q = tl.load(q_ptr + b * q_stride + h[:, None] * DI + d[None, :])
    keys = _pooled_keys(pool_ptr, tables_ptr + b * t_stride, p, ppb, candidate, DI)
    dots = _dot_f32(q, tl.trans(keys), TC) / q_scale
    w = tl.load(w_ptr + b * HI + h) / w_scale
    score = tl.sum(w[:, None] * tl.maximum(dots, 0.0), axis=0)
    tl.store(out_ptr + b * P + p, tl.where(candidate, score, -float("inf")), mask=p < P)


def _check_index_operands(name: str, q_idx: torch.Tensor, w_idx: torch.Tensor, pooled: torch.Tensor,
                          B: int) -> tuple[int, int, int]:
    # (heads, index_head_dim, pools per block) of an indexer call's operands, checked
    _, Hi, d = q_idx.shape
    nb, ppb = pooled.shape[:2]
    _check_cache_row(f"{name}: pooled", pooled, nb, ppb, d)
    if q_idx.stride(2) != 1 or q_idx.stride(1) != d or tuple(w_idx.shape) != (B, Hi):
        raise ValueError(f"{name}: q_idx must be [{B}, heads, {d}] with packed heads and w_idx "
                         f"[{B}, heads], got {tuple(q_idx.shape)} {q_idx.stride()} and {tuple(w_idx.shape)}")
    _check_pow2(f"{name}: index heads", Hi)
    _check_pow2(f"{name}: index_head_dim", d)
    return Hi, d, ppb


MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension


def _pool_programs(name: str, P: int, block: int) -> int:
    """Programs over a table's P pools, on the grid's second dimension: a table longer than it holds is an error
    that says so, not a launch that fails with "invalid argument"."""
    programs = triton.cdiv(P, block)
    if programs > MAX_GRID_Y:
        raise ValueError(f"{name}: a table of {P} pools needs {programs} programs on the grid's second dimension, "
                         f"past CUDA's {MAX_GRID_Y}: {MAX_GRID_Y * block} pools at most")
    return programs


def dsa_index_scores(q_idx: torch.Tensor, w_idx: torch.Tensor, pooled: torch.Tensor, tables: torch.Tensor,
                     positions: torch.Tensor, kpool: int) -> torch.Tensor:
    """The indexer's pool scores (model_glm.select_tokens before its top-k) over every pool of the
    table: q_idx [B, heads, d] (the last two dims packed, rows may be strided), w_idx [B, heads]
    fp32 (weights_proj's output, divided by √heads here), pooled the cache row. Returns fp32
    [B, width · bs / kpool], -inf for pools that are not complete at the position."""
    B = _check_tables("dsa_index_scores", tables, positions)
    Hi, d, ppb = _check_index_operands("dsa_index_scores", q_idx, w_idx, pooled, B)
    P = tables.shape[1] * ppb
    programs = _pool_programs("dsa_index_scores", P, DSA_SCORE_BLOCK)
    out = torch.empty(B, P, dtype=torch.float32, device=q_idx.device)
    _dsa_scores_kernel[(B, programs)](
        q_idx, q_idx.stride(0), w_idx.float().contiguous(), pooled, tables, tables.stride(0), positions, out, P, ppb,
        d ** 0.5, Hi ** 0.5, HI=Hi, DI=d, KPOOL=kpool, BP=DSA_SCORE_BLOCK, TC=q_idx.is_cuda, num_warps=DSA_SCORE_WARPS,
        launch_pdl=_pdl())
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
    return m_new, l * alpha + tl.sum(p, axis=1), _dot_f32(p, lat, TC, acc * alpha[:, None])


@triton.jit
def _dsa_attn_kernel(q_ptr, q_sb, q_sh, lat_ptr, tables_ptr, t_stride, pos_ptr, top_ptr, top_stride,
                     m_ptr, l_ptr, acc_ptr, H, NT, steps, bs, scale,
                     R: tl.constexpr, KPOOL: tl.constexpr, TAIL: tl.constexpr, ALL: tl.constexpr,
                     BH: tl.constexpr, BW: tl.constexpr, TC: tl.constexpr):
    _pdl_enter()
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
def _dsa_combine_kernel(m_ptr, l_ptr, acc_ptr, o_ptr, o_sb, o_sh, H, NS, R: tl.constexpr, RC: tl.constexpr,
                        SP: tl.constexpr):
    # Program (row, head, block of RC latent columns). All three loads come before the max, whose exchange
    # between warps would hold the others back; RC columns of the NS splits' partial sums a program keep
    # them in registers (the whole 512 spilled) and spread a decode row over more programs.
    _pdl_enter()
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SP)
    r = tl.program_id(2) * RC + tl.arange(0, RC)
    part = (b * NS + s) * H + h
    m = tl.load(m_ptr + part, mask=s < NS, other=-float("inf"))
    l_s = tl.load(l_ptr + part, mask=s < NS, other=0.0)
    acc = tl.load(acc_ptr + part[:, None] * R + r[None, :], mask=(s < NS)[:, None], other=0.0)
    top = tl.max(m, axis=0)
    w = tl.exp(m - tl.where(top == -float("inf"), 0.0, top))
    l = tl.sum(w * l_s, axis=0)
    tl.store(o_ptr + b * o_sb + h * o_sh + r, tl.sum(w[:, None] * acc, axis=0) / l)


DSA_COMBINE_COLUMNS = 128  # latent columns a program of `_dsa_combine_kernel` takes


def _dsa_combine(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, o: torch.Tensor, splits: int) -> None:
    # o [n, H, R] from the splits' running max m, sum l [n, splits, H] and acc [n, splits, H, R].
    n, H, R = o.shape
    rc = min(R, DSA_COMBINE_COLUMNS)
    _dsa_combine_kernel[(n, H, R // rc)](m, l, acc, o, o.stride(0), o.stride(1), H, splits, R=R, RC=rc,
                                         SP=triton.next_power_of_2(splits), launch_pdl=_pdl())


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
    BH = DSA_ATTN_HEADS_WIDE if B >= DSA_ATTN_WIDE_FROM else DSA_ATTN_HEADS
    head_blocks = triton.cdiv(H, BH)
    if splits is None:
        sms = torch.cuda.get_device_properties(q_hat.device).multi_processor_count if q_hat.is_cuda else 2
        programs = DSA_ATTN_PROGRAMS_PER_SM * sms
        splits = max(1, min(n_steps, programs // (B * head_blocks)))
    steps = triton.cdiv(n_steps, splits)
    m = torch.empty(B, splits, H, dtype=torch.float32, device=q_hat.device)
    l = torch.empty_like(m)
    acc = torch.empty(B, splits, H, R, dtype=torch.float32, device=q_hat.device)
    _dsa_attn_kernel[(B, head_blocks, splits)](
        q_hat, q_hat.stride(0), q_hat.stride(1), latent, tables, tables.stride(0), positions, top, top.stride(0),
        m, l, acc, H, NT, steps, bs, scale, R=R, KPOOL=kpool, TAIL=bool(select_tail), ALL=every,
        BH=BH, BW=DSA_ATTN_BLOCK, TC=q_hat.is_cuda, num_warps=DSA_ATTN_WARPS, launch_pdl=_pdl())
    o = torch.empty_like(q_hat)
    _dsa_combine(m, l, acc, o, splits)
    return o


# ---------------------------------------------------------------- the absorbed MLA's per-head products
# q̂ = q · W_UK and o · W_UVᵀ (model_glm.mla_attention's first and last einsum), per head h:
# out[b, h] = a[b, h] · w[h]. torch runs them as fp32 bmm's on the CUDA cores (a decode row: two cuBLAS
# GEMVs of 11-14 us on the H200, reading 16.8 MB each; a prefill chunk: SIMT SGEMMs of ~3 ms at 8192
# rows). Here on tensor cores, fp32 sums. For prefill rows (B > 16), BF16 weights (the checkpoint's
# kv_b_proj) meet a as the sum of PIECES bf16 values (a's 24 significant bits in three 8-bit pieces,
# 11 of fp16 in two, bf16 as it is): every product is exact, and bf16 MMAs run at twice TF32's rate.
# The smallest pieces go first, so that the larger ones are added to their sum; still, the tensor
# cores' sums truncate, and on the H200 the results are 5.6-7.4e-7 of Σ|products| off (tf32x3:
# 0.8e-7), for 2.2-6.2x less time at 8192 rows (`.whl/s12_pre.py`). Decode rows and other weights
# take `_dot_tf32x3` (fp32 a as a TF32 value plus a TF32 remainder: < 2^-20 relative per product; two
# TF32 MMAs against bf16 / fp16 weights, which TF32 holds exactly, three against fp32 ones; H200, full
# size, 1-16 rows in CUDA graphs, `.whl/s15_head.py`: q · W_UK 8.0-8.4 us, o · W_UVᵀ 11.0-11.3, against
# 11.8-12.2 and 12.9-13.3 with triton's own tf32x3; error 5.6-6.9e-7 of the largest output, against 1.2-1.5e-7).
# At 1 and 16 rows the bf16 pieces were 0.93-1.73x triton's tf32x3 (eager calls), no clear win.
# One program: BM rows x BN columns of one head. From HEAD_MM_BIG_ROWS rows (prefill chunks) against bf16
# weights 128 x 256 tiles, 64 of K a step, 8 warps, 4 stages (H200, 2048 rows x 64 heads, `.whl/s26_hc.py`: q · W_UK
# 1.08x, o · W_UVᵀ 1.11x against 64 x 128, 32, 4 warps, 3 stages; o in two pieces 1.37x).
HEAD_MM_BLOCK_K = 32
HEAD_MM_BIG_ROWS = 256


def _decode_block_k(K: int) -> int:
    """K a step for decode rows (<= 16): a quarter of K's power of two, 32 to 128. A decode call is a
    stream of the weight's bytes, and wider steps keep more of them in flight (H100, full size, 11 layers'
    copies in a graph, `.notes/s35_sweep.py`: q · W_UK, K 256, 64 a step 1.15x / 1.09x at 1 / 16 rows;
    o · W_UVᵀ, K 512, 128 a step 1.46x / 1.38x, against 32; 9.2 us at 1 row, 1.7x the 5.5 us of reading its
    16.8 MB at the copy rate)."""
    return min(128, max(HEAD_MM_BLOCK_K, triton.next_power_of_2(K) // 4))


@triton.jit
def _head_matmul_kernel(a_ptr, a_sb, a_sh, a_sk, w_ptr, w_sh, w_sk, w_sn, o_ptr, o_sb, o_sh, o_sn, B, K, N,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PIECES: tl.constexpr,
                        TC: tl.constexpr):
    _pdl_enter()
    h = tl.program_id(0)
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    cols = tl.program_id(2) * BN + tl.arange(0, BN)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + rows[:, None].to(tl.int64) * a_sb + h * a_sh + ks[None, :] * a_sk,
                    mask=(rows[:, None] < B) & (ks[None, :] < K), other=0.0).to(tl.float32)
        w = tl.load(w_ptr + h * w_sh + ks[:, None] * w_sk + cols[None, :] * w_sn,
                    mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)
        if PIECES == 0:
            acc = _dot_tf32x3(a, w.to(tl.float32), acc, w.dtype != tl.float32)
        else:
            hi = a.to(tl.bfloat16)
            if PIECES > 1:
                rest = a - hi.to(tl.float32)
                mid = rest.to(tl.bfloat16)
                if PIECES > 2:
                    acc += _dot_bf16((rest - mid.to(tl.float32)).to(tl.bfloat16), w, TC)
                acc += _dot_bf16(mid, w, TC)
            acc += _dot_bf16(hi, w, TC)
    tl.store(o_ptr + rows[:, None].to(tl.int64) * o_sb + h * o_sh + cols[None, :] * o_sn,
             _cast(acc, o_ptr.dtype.element_ty), mask=(rows[:, None] < B) & (cols[None, :] < N))


def head_matmul(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                out_dtype: torch.dtype = torch.float32, pieces: int | None = None) -> torch.Tensor:
    """out[b, h] = a[b, h] · w[h] for a [B, H, K] (any float dtype, any strides), w [H, K, N] fp32, bf16
    or fp16 (any strides, e.g. a slice of kv_b_proj's view or W_UV.transpose(1, 2)); out [B, H, N] (any
    strides, given or new in out_dtype). Twin: torch.einsum("bhk,hkn->bhn", a.float(), w.float()) (see
    the section comment for the precision). pieces: for more than 16 rows against bf16 w, the bf16
    pieces a is cut into (default all of a's bits: 1 for bf16, 2 for fp16, 3 for fp32); fewer where a
    holds fewer bits that matter (dsa_prefill_attention's o: 2)."""
    if pieces not in (None, 1, 2, 3):
        raise ValueError(f"head_matmul: pieces must be 1, 2 or 3, got {pieces}")
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
    if w.dtype == torch.bfloat16 and B > 16:
        pieces = pieces or {torch.bfloat16: 1, torch.float16: 2}.get(a.dtype, 3)
    else:
        pieces = 0
    # the big tiles' 4 stages of w fit shared memory for 16-bit w only (fp32: 256 KB)
    BM, BN, BK, warps, stages = ((16, 64, _decode_block_k(K), 4, 3) if B <= 16 else (128, 256, 64, 8, 4)
                                 if B >= HEAD_MM_BIG_ROWS and pieces else (64, 128, HEAD_MM_BLOCK_K, 4, 3))
    _head_matmul_kernel[(H, triton.cdiv(B, BM), triton.cdiv(N, BN))](
        a, *a.stride(), w, *w.stride(), out, *out.stride(), B, K, N, BM=BM, BN=BN, BK=BK, PIECES=pieces,
        TC=a.is_cuda, num_warps=warps, num_stages=stages, launch_pdl=_pdl())
    return out


# ================================================================ prefill: DSA of a chunk (§4.4)
# `dsa_prefill_index_scores`: dsa_index_scores for the n rows of ONE sequence's chunk (one block table,
# positions start..start+n-1). A program takes BR rows x BP pools, the rows' heads stacked as the MMA's
# M (BR · heads), so each tile of pooled keys is read once for BR rows (the decode kernel, one row a
# program, reads every pool once a row: at 8K rows of an 8K context 4 GB from L2 a DSA layer); pool
# blocks past the last row's candidates are not computed. The heads' sum is a tl.sum of the reshaped
# products: its order may differ from the decode kernel's in the last bits.
DSA_PREFILL_SCORE_ROWS = 4
DSA_PREFILL_SCORE_BLOCK = 64


@triton.jit
def _dsa_prefill_scores_kernel(q_ptr, q_stride, w_ptr, pool_ptr, table_ptr, out_ptr, n, start, P, ppb, q_scale,
                               w_scale, HI: tl.constexpr, DI: tl.constexpr, KPOOL: tl.constexpr, BR: tl.constexpr,
                               BP: tl.constexpr, TC: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    p = tl.program_id(1) * BP + tl.arange(0, BP)
    ok = (rows < n)[:, None] & (p < P)[None, :]
    candidate = p[None, :] < ((start + rows + 1) // KPOOL)[:, None]
    score = tl.full([BR, BP], -float("inf"), tl.float32)
    last = tl.minimum(tl.program_id(0) * BR + BR, n) - 1
    if tl.program_id(1) * BP < (start + last + 1) // KPOOL:  # some row has a candidate here
        m = tl.arange(0, BR * HI)  # (row, head) pairs
        r = tl.program_id(0) * BR + m // HI
        d = tl.arange(0, DI)
        q = tl.load(q_ptr + r[:, None] * q_stride + (m % HI)[:, None] * DI + d[None, :], mask=(r < n)[:, None],
                    other=0.0)
        keys = _pooled_keys(pool_ptr, table_ptr, p, ppb, p < P, DI)
        dots = _dot_f32(q, tl.trans(keys), TC) / q_scale
        w = tl.load(w_ptr + r * HI + m % HI, mask=r < n, other=0.0) / w_scale
        summed = tl.sum(tl.reshape(w[:, None] * tl.maximum(dots, 0.0), [BR, HI, BP]), axis=1)
        score = tl.where(candidate, summed, score)
    tl.store(out_ptr + rows[:, None] * P + p[None, :], score, mask=ok)


def dsa_prefill_index_scores(q_idx: torch.Tensor, w_idx: torch.Tensor, pooled: torch.Tensor, table: torch.Tensor,
                             start: int, kpool: int, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """dsa_index_scores for the n rows of one sequence's chunk at positions start..start+n-1 over one
    block table [width]: q_idx [n, heads, d] (packed heads, rows may be strided), w_idx [n, heads]
    fp32, pooled the cache row. Returns fp32 [n, width · bs / kpool], -inf for pools that are not
    complete at a row's position: a view of `scratch` (a flat fp32 buffer of at least that many
    elements) when given."""
    n = q_idx.shape[0]
    Hi, d, ppb = _check_index_operands("dsa_prefill_index_scores", q_idx, w_idx, pooled, n)
    if table.dim() != 1 or table.stride(0) != 1:
        raise ValueError(f"dsa_prefill_index_scores: table must be one sequence's [width] block ids with unit "
                         f"stride, got {tuple(table.shape)} {table.stride()}")
    P = table.shape[0] * ppb
    programs = _pool_programs("dsa_prefill_index_scores", P, DSA_PREFILL_SCORE_BLOCK)
    if scratch is None:
        out = torch.empty(n, P, dtype=torch.float32, device=q_idx.device)
    elif scratch.dtype != torch.float32 or scratch.dim() != 1 or scratch.numel() < n * P:
        raise ValueError(f"dsa_prefill_index_scores: scratch must be a flat fp32 buffer of at least {n} x {P} "
                         f"elements, got {scratch.dtype} {tuple(scratch.shape)}")
    else:
        out = scratch[:n * P].view(n, P)
    grid = (triton.cdiv(n, DSA_PREFILL_SCORE_ROWS), programs)
    _dsa_prefill_scores_kernel[grid](q_idx, q_idx.stride(0), w_idx.float().contiguous(), pooled, table, out, n, start,
                                     P, ppb, d ** 0.5, Hi ** 0.5, HI=Hi, DI=d, KPOOL=kpool, BR=DSA_PREFILL_SCORE_ROWS,
                                     BP=DSA_PREFILL_SCORE_BLOCK, TC=q_idx.is_cuda)
    return out


# `top_pools`: the indexer's top-k of a decode step's or a chunk's rows (H100, top 512 of 1-16 rows of
# 1024-8192 pools, 11 copies in a graph, `.notes/s35_sweep.py`: 8-18 us against torch.topk's 10-47 us,
# 1.2-2.6x, the same picks). One program a row held in registers, TOP_POOLS_KEYS keys a thread: each score
# becomes an int32 key whose signed order is the floats' (negative floats flip their 31 low bits); the
# k-th largest key T is found bit by bit (32 count passes: T grows while at least k keys are >= it),
# then the row takes every key > T and the first k - #(> T) keys equal to T (ties to the lower pools,
# as model_glm.select_tokens' stable sort), stored in pool order. 16 keys a thread keep the row and its
# sums in 50-111 registers (sm_90, triton 3.6, 512-8192 keys); 32 took up to 238, 64 spilled. Rows of
# up to TOP_POOLS_MAX pools (32K-token contexts): longer ones would be read from memory in each pass,
# and fastdecode leaves them to torch.topk. Twin: torch.sort(stable) of select_tokens
# (tests/test_fastdecode.py).
TOP_POOLS_MAX = 8192
TOP_POOLS_KEYS = 16


@triton.jit
def _top_pools_kernel(score_ptr, out_ptr, P, k, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    # -inf (a pool not complete at the row) is a real score; past the row lies INT_MIN, below every
    # float's key but NaN's, so no pick comes from there as long as k <= P. -0.0 ties with 0.0.
    x = tl.load(score_ptr + row * P + j, mask=j < P, other=0.0)
    b = x.to(tl.int32, bitcast=True)
    key = tl.where(j < P, tl.where(x == 0.0, 0, b ^ ((b >> 31) & 0x7FFFFFFF)), -2147483648)
    t = tl.full((), -2147483648, tl.int32)
    for bit in tl.static_range(31, -1, -1):
        # in unsigned order (key ^ INT_MIN) the candidate is t | 2^bit; for the sign bit that is key 0
        c = t | (1 << bit) if bit < 31 else tl.full((), 0, tl.int32)
        t = tl.where(tl.sum((key >= c).to(tl.int32), axis=0) >= k, c, t)
    ties = k - tl.sum((key > t).to(tl.int32), axis=0)
    eq = (key == t).to(tl.int32)
    pick = (key > t) | ((eq != 0) & (tl.cumsum(eq, axis=0) <= ties))
    tl.store(out_ptr + row * k + tl.cumsum(pick.to(tl.int32), axis=0) - 1, j, mask=pick)


def top_pools(score: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest of each row of score [n, P] fp32 (contiguous, P <= TOP_POOLS_MAX), as int32 pool
    indices [n, k] in pool order; ties go to the lower pools. torch.topk's picks in one launch that
    also fixes the ties."""
    if score.dim() != 2 or score.dtype != torch.float32 or not score.is_contiguous():
        raise ValueError(f"top_pools: score must be contiguous fp32 [n, P], got {score.dtype} "
                         f"{tuple(score.shape)} {score.stride()}")
    n, P = score.shape
    if P > TOP_POOLS_MAX:
        raise ValueError(f"top_pools: rows of {P} pools exceed TOP_POOLS_MAX ({TOP_POOLS_MAX})")
    if not 0 < k <= P:
        raise ValueError(f"top_pools: k = {k} must be in 1..{P} (the pools of a row)")
    out = torch.empty(n, k, dtype=torch.int32, device=score.device)
    block = triton.next_power_of_2(P)
    _top_pools_kernel[(n,)](score, out, P, k, BLOCK=block, num_warps=max(1, block // (32 * TOP_POOLS_KEYS)))
    return out


# `dsa_prefill_attention`: dsa_sparse_attention's math for the n query rows of ONE sequence's chunk
# (one block table, positions start..start+n-1). A program owns one query row and BH of its heads for
# the whole selection (no splits once n fills the GPU): all heads of a row share the row's selected
# positions, so the heads are the MMA's M rows and the selection stays exact.
# Why not blocks of query rows over the union of their selections: registers bound M. q̂ and the fp32
# output accumulator take M·R·6 bytes: M = 32 at R = 512 is 96 KB of the 256 KB register file. At a
# fixed M, BQ rows x M/BQ heads over the union U of the rows' pools costs per row H·U·kpool·R·4 flops
# and H·U·kpool·2R/M bytes of latent, against the same with U = NT for one row x M heads: rows only
# help when there are fewer heads than M (and 8K-context rows each pick 25% of the pools, random picks
# of 16 rows cover 99%).
#
# Precision: a 16-bit cache runs fp16 products, 11 significant bits an operand, three more than a
# bf16 cache holds. The context's latent is first copied in position order as fp16 times a power of
# two f that puts its peak |value| in [2^14, 2^15) (`_latent_peak_kernel`, `_latent_copy_kernel`):
# exact for a bf16 cache, down to values 2^-28 below the peak (smaller ones keep an absolute error
# under 2^-25 / f). q̂ is rounded to fp16 times a power of two a head, p = exp(s - m) <= 1 to fp16: each
# product off by ~2^-12 of its size. Against fp64, full size (R 512, 8192 and 2048 rows), the output's
# largest error is 1.5e-5-2.3e-4 of its peak for flat scores and 1.3-1.5e-3 for peaked ones (std ~6),
# where the bf16 hi + lo split of both (four MMAs a step, session 25's kernel) gave 2.4e-7-6.1e-6 and
# 1.7-1.8e-5, at 1.61-1.65x the time (H200, the whole call; BENCHMARKS session 26). The copy keeps the
# conversion out of the loop (the kernel alone, converting each step's tile there: 1.43x against 1.94x).
# An fp32 cache runs fp32 products on a copy scaled alike.
#
# Cost at full size (H = 64, R = 512, 2051 positions a row, M = 32): per row 2 programs x 33 steps of
# 64 positions; two fp16 MMAs a step: 64·2051·512·2·2 = 0.27 GFLOP, 8192 rows = 2.2 TFLOP; each row
# reads its 2 MB of selected latent rows twice (from L2: an 8K-32K context's fp16 copy is 8-32 MB).

# The selection reaches the kernel as slots (`_dsa_prefill_slots_kernel`): per row, slot j -> the last
# position of its pool (a pick's kpool - 1 past its first, the tail's last), -1 for none; the picked
# pools in top-k order, then the tail. The loop then only adds a member's offset. Launch settings from
# the H200 sweep (triton 3.6, full size, 8192 rows from 0 and 2048 at 6144, `.whl/s26_dsa16.py`): 32
# heads x 64 positions a step, 4 warps, 2 stages; 128 positions 0.83x, 16 heads 0.69x, 8 warps
# 0.57-0.79x, 3 stages 0.89x (each against 64 positions at 4 warps, fp16 q̂ and latent, both shapes).
# 64 heads a program with R split over two programs (wgmma) reached 0.79x.
DSA_PREFILL_HEADS = 32  # heads per program (M of the MMAs; see above why not more)
DSA_PREFILL_BLOCK = 64  # selected positions per step
DSA_PREFILL_WARPS = 4
DSA_PREFILL_STAGES = 2
DSA_COPY_ROWS = 16  # positions per program of the latent's peak and copy


@triton.jit
def _latent_rows(lat_ptr, table_ptr, bs, T, R: tl.constexpr, BT: tl.constexpr):
    # Positions BT·pid.. of the context (their cache rows through the block table) as fp32 [BT, R].
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    row = tl.load(table_ptr + t // bs, mask=t < T, other=0).to(tl.int64) * bs + t % bs
    r = tl.arange(0, R)
    return t, tl.load(lat_ptr + row[:, None] * R + r[None, :], mask=t[:, None] < T, other=0.0).to(tl.float32)


@triton.jit
def _latent_peak_kernel(lat_ptr, table_ptr, bs, T, peak_ptr, R: tl.constexpr, BT: tl.constexpr):
    # peak = the largest |value| of positions 0..T-1 as fp32 bits (non-negative floats order as their
    # bits, so an integer max is exact and in no particular order the same).
    _, c = _latent_rows(lat_ptr, table_ptr, bs, T, R, BT)
    tl.atomic_max(peak_ptr, tl.max(tl.max(tl.abs(c), axis=1), axis=0).to(tl.int32, bitcast=True))


@triton.jit
def _latent_factor(peak_ptr):
    # (f, 1 / f): powers of two that put the peak in [2^14, 2^15), below fp16's 65504 (see the section
    # comment); a zero peak gets a finite f.
    return _pow2_scale(tl.load(peak_ptr).to(tl.float32, bitcast=True), 14)


@triton.jit
def _latent_copy_kernel(lat_ptr, table_ptr, bs, T, peak_ptr, out_ptr, R: tl.constexpr, BT: tl.constexpr):
    # out[t] = latent at position t times f, in out's dtype (exact: see the section comment).
    t, c = _latent_rows(lat_ptr, table_ptr, bs, T, R, BT)
    f, _ = _latent_factor(peak_ptr)
    r = tl.arange(0, R)
    tl.store(out_ptr + t[:, None].to(tl.int64) * R + r[None, :], (c * f).to(out_ptr.dtype.element_ty),
             mask=t[:, None] < T)


@triton.jit
def _dot_lat(a, b, acc=None):
    # acc + a · b against the latent copy b: fp16 tensor-core products, or exact fp32 ones.
    if b.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a.to(b.dtype), b, acc)


@triton.jit
def _dsa_prefill_kernel(q_ptr, q_sn, q_sh, lat_ptr, peak_ptr, slots_ptr, slots_stride, m_ptr, l_ptr, o_ptr, o_sn,
                        o_sh, start, H, NT, scale, R: tl.constexpr, KPOOL: tl.constexpr, TAIL: tl.constexpr,
                        BH: tl.constexpr, BK: tl.constexpr, ONE: tl.constexpr):
    row = tl.program_id(0)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    split = tl.program_id(2)
    r = tl.arange(0, R)
    q = tl.load(q_ptr + row * q_sn + h[:, None] * q_sh + r[None, :], mask=h[:, None] < H, other=0.0)
    # scores = (q̂ · s_h) · (c · f) / (s_h f scale): s_h a head's power of two into fp16 (exl3_kernels'
    # row rule, peak in [2^13, 2^14)), 1 for an fp32 copy
    _, inv_f = _latent_factor(peak_ptr)
    inv_q = tl.full([BH], 1.0, tl.float32)
    if lat_ptr.dtype.element_ty == tl.float16:
        s_h, inv_q = _pow2_scale(tl.max(tl.abs(q), axis=1), 13)
        q = q * s_h[:, None]
    q = q.to(lat_ptr.dtype.element_ty)
    score_scale = inv_q * inv_f / scale
    pos = start + row
    n_cand = (pos + 1) // KPOOL
    n_slots = tl.minimum(n_cand, NT)
    if TAIL:
        n_slots += (pos + 1 - n_cand * KPOOL) > 0
    tiles = tl.cdiv(n_slots * KPOOL, BK)
    per_split = tl.cdiv(tiles, tl.num_programs(2))
    m = tl.full([BH], -float("inf"), tl.float32)
    l = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, R], dtype=tl.float32)
    k0 = tl.arange(0, BK)
    for tile in range(split * per_split, tl.minimum((split + 1) * per_split, tiles)):
        k = tile * BK + k0  # position slot: member k % KPOOL of slot k // KPOOL
        slot = tl.load(slots_ptr + row * slots_stride + k // KPOOL)
        member = k % KPOOL
        valid = (slot >= 0) & (member <= slot % KPOOL)
        t = slot - slot % KPOOL + member
        lat = tl.load(lat_ptr + t[:, None].to(tl.int64) * R + r[None, :], mask=valid[:, None], other=0.0)
        s = tl.where(valid[None, :], _dot_lat(q, tl.trans(lat)) * score_scale[:, None], -float("inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # a head with only -inf so far
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l = l * alpha + tl.sum(p, axis=1)
        acc = _dot_lat(p, lat, acc * alpha[:, None])
        m = m_new
    acc = acc * inv_f  # Σ p · c, the copy's f undone
    if ONE:
        tl.store(o_ptr + row * o_sn + h[:, None] * o_sh + r[None, :], acc / l[:, None], mask=h[:, None] < H)
    else:  # partial sums for _dsa_combine_kernel
        part = (row * tl.num_programs(2) + split) * H + h
        tl.store(m_ptr + part, m, mask=h < H)
        tl.store(l_ptr + part, l, mask=h < H)
        tl.store(o_ptr + part[:, None] * R + r[None, :], acc, mask=h[:, None] < H)


@triton.jit
def _dsa_prefill_slots_kernel(top_ptr, top_stride, slots_ptr, W, start, NT, KPOOL: tl.constexpr, TAIL: tl.constexpr,
                              HAS_TOP: tl.constexpr, BW: tl.constexpr):
    # One row's slots (see the section comment): a row with more complete pools than NT takes its
    # picks in top-k order (a pick not complete at the row: -1), otherwise every complete pool in
    # order; then the tail; -1 past the row's last slot.
    row = tl.program_id(0)
    pos = start + row
    n_cand = (pos + 1) // KPOOL
    n_pools = tl.minimum(n_cand, NT)
    count = pos + 1 - n_cand * KPOOL  # the tail's positions, from n_cand * KPOOL on
    for j0 in range(0, W, BW):
        j = j0 + tl.arange(0, BW)
        pool = j
        if HAS_TOP:
            pool = tl.where(n_cand > NT, tl.load(top_ptr + row * top_stride + j, mask=j < NT, other=-1), j)
        ok = (pool >= 0) & (pool < n_cand) & (j < n_pools)
        slot = tl.where(ok, pool * KPOOL + (KPOOL - 1), -1)
        if TAIL:
            slot = tl.where((j == n_pools) & (count > 0), pos, slot)
        tl.store(slots_ptr + row * W + j, slot.to(tl.int32), mask=j < W)


def dsa_prefill_attention(q_hat: torch.Tensor, latent: torch.Tensor, table: torch.Tensor, start: int,
                          top: torch.Tensor | None, kpool: int, select_tail: bool, scale: float,
                          splits: int | None = None) -> torch.Tensor:
    """dsa_sparse_attention for the n query rows of one sequence's chunk at positions start..start+n-1
    (the same block table `table` [width] for all): softmax_t(q̂ · c_t / scale) · c_t over each row's
    selected positions t. q̂ [n, H, R] fp32 (unit last stride); latent the cache row; top [n, NT] the
    rows' picked pools (dsa_index_scores' top-k: picks not complete at the row's position are skipped,
    a row with no more complete pools than NT takes them all) or None for every complete pool; plus
    the tail with select_tail. Returns o [n, H, R] fp32 in q̂'s memory layout, from fp16 products for a
    16-bit cache (see the section comment). `splits`: programs per (row, head block) (default: more
    than one only while the rows leave SMs idle)."""
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
    if start < 0 or start + n > table.shape[0] * bs:
        raise ValueError(f"dsa_prefill_attention: positions {start}..{start + n - 1} do not fit a table of "
                         f"{table.shape[0]} blocks of {bs}")
    if top is None:
        NT = table.shape[0] * (bs // kpool)  # every row has at most NT candidates
    elif top.dim() != 2 or top.shape[0] != n:
        raise ValueError(f"dsa_prefill_attention: top must be [{n}, NT], got {tuple(top.shape)}")
    else:
        NT = top.shape[1]
    per_step = DSA_PREFILL_BLOCK // kpool
    W = triton.cdiv(NT + 1, per_step) * per_step  # NT picks and the tail, in whole steps
    slots = torch.empty(n, W, dtype=torch.int32, device=q_hat.device)
    _dsa_prefill_slots_kernel[(n,)](table if top is None else top, 0 if top is None else top.stride(0), slots, W,
                                    start, NT, KPOOL=kpool, TAIL=bool(select_tail), HAS_TOP=top is not None,
                                    BW=min(256, triton.next_power_of_2(W)))
    T = start + n  # the context in position order, fp16 (fp32 for an fp32 cache) times f
    copy = torch.empty(T, R, dtype=torch.float32 if latent.dtype == torch.float32 else torch.float16,
                       device=q_hat.device)
    peak = torch.zeros(1, dtype=torch.int32, device=q_hat.device)
    grid = (triton.cdiv(T, DSA_COPY_ROWS),)
    _latent_peak_kernel[grid](latent, table, bs, T, peak, R=R, BT=DSA_COPY_ROWS)
    _latent_copy_kernel[grid](latent, table, bs, T, peak, copy, R=R, BT=DSA_COPY_ROWS)
    BH = min(DSA_PREFILL_HEADS, max(16, triton.next_power_of_2(H)))  # tl.dot needs >= 16 rows
    head_blocks = triton.cdiv(H, BH)
    if splits is None:
        programs = torch.cuda.get_device_properties(q_hat.device).multi_processor_count if q_hat.is_cuda else 2
        tiles = triton.cdiv((min(NT, table.shape[0] * (bs // kpool)) + select_tail) * kpool, DSA_PREFILL_BLOCK)
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
        q_hat, q_hat.stride(0), q_hat.stride(1), copy, peak, slots, slots.stride(0), m, l, out, out.stride(0),
        out.stride(1), start, H, NT, scale, R=R, KPOOL=kpool, TAIL=bool(select_tail), BH=BH,
        BK=DSA_PREFILL_BLOCK, ONE=one, num_warps=DSA_PREFILL_WARPS, num_stages=DSA_PREFILL_STAGES)
    if not one:
        _dsa_combine(m, l, acc, o, splits)
    return o

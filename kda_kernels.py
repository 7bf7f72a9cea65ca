"""KDA's Triton kernels (spec glm53.md §4.3), each with a slow pure-torch twin in model_glm.py that the
tests hold it to:

the recurrence (§4.3.6-7): `kda_recurrent_step` (one token of B sequences against the state pool, decode)
and `kda_chunk_prefill` (a whole sequence in the chunked WY form, prefill; `chunk_factors`,
`chunk_states` and `chunk_output` are its three stages) compute what `model_glm.kda_recurrent` computes
token by token;

the decode step's KDA glue (fastdecode.py): `kda_decode_inputs` (short conv, SiLU, L2 norms, gate, β for
one token, §4.3.2-5; the prefill's `kda_chunk_inputs` for the rows of one sequence's chunk) and
`kda_output_gate` (§4.3.8's norm and gate).

Like kernels.py, this file imports neither exl3.py nor model_glm.py (they sit above it); it takes four
small helpers from kernels.py (the bf16 rounding, the power-of-two check, the strided-rows check and
the split TF32 product).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import _cast, _check_pow2, _dot_tf32x3, _pdl, _pdl_enter, _rows

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
# Matrix products inside the prefill kernels go through `_dot` at DOT_PRECISION = "tf32x3": each fp32
# operand goes to the tensor cores as a TF32 hi part plus a TF32 remainder (three products, split by
# hand in `kernels._dot_tf32x3`), near fp32; everything else (the carried state, Γ, the solve of the
# 16-row diagonal blocks) is fp32.
# `bench.py kda precision`, H200, T = 8192, one layer: "tf32" 9.2 ms at 1.5e-3 relative error of o,
# "tf32x3" 11.3 ms at 1.5e-6, "ieee" (fp32 FMA) 16.3 ms at 1.5e-6. With "tf32" the fast prefill of
# the trained default model (bf16) was 5.9e-3 nats of KL from the reference; with "tf32x3" 5.5e-4,
# the size of that model's own move for a 1-ulp change of its input (5.4e-4). (Those timings predate
# the split by hand and the kernels' later forms: `.whl/s15_kda2.py`, T 8192, 3.5 ms at 2.4e-6.)
# Under the CPU interpreter tl.dot is exact fp32 whatever the setting. The decode kernel has no
# matrix product.

DOT_PRECISION = "tf32x3"
SUB_CHUNK = 16  # rows of the diagonal blocks solved exactly inside a chunk; tl.dot needs >= 16
# The prefill decays a sub-chunk's keys to its first row and back, so exp(±(SUB_CHUNK - 1) · g) must
# stay a normal fp32 (e^±87.3): g > GATE_FLOOR. The model's gate is g = lower_bound · σ(·) with
# lower_bound -5 (spec §4.3.4); fastprefill refuses a config whose bound is at or below the floor.
GATE_FLOOR = -5.8
# chunk_output's tiles, at 4 warps and 3 stages: H200, T 8192, 0.82 ms against 0.87 at 2 stages (same output bit for
# bit); 128-value tiles, 64-key slices or 8 warps 1.1-2.2x slower (`.whl/s11_sweep2.py`)
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
        *state.stride(), H=H, DK=dk, DV=dv, BV=bv, num_warps=num_warps, launch_pdl=_pdl())
    return o


@triton.jit
def _kda_step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, o_ptr,
                     s_slot, s_head, s_key, s_val,
                     H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr):
    _pdl_enter()
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
                      after: Sequence[int] = (), block_v: int = 32, num_warps: int = 4,
                      num_stages: int = 2, precision: str = DOT_PRECISION
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A whole sequence: q, k, g [T, H, d_k], v [T, H, d_v], beta [T, H] (twin: `model_glm.kda_recurrent`
    over the T tokens from `initial_state`, zeros if None). Returns (o [T, H, d_v] in q's dtype, final
    state [H, d_k, d_v] fp32, the states after the first r tokens for each r in `after` [len(after),
    H, d_k, d_v] fp32, or None if `after` is empty). Each r must be T or a positive multiple of chunk
    below it: pass 2 keeps the state at every chunk boundary anyway, so these cost a copy. Three passes:

    1. `chunk_factors`: every (chunk, head) in parallel, the WY factors of §4.3.7.
    2. `chunk_states`: every (value tile, head) in parallel, chunks in order: the state entering
       each chunk (kept for pass 3; `block` boundaries are among them) and U' = U - W S.
    3. `chunk_output`: every (chunk, head, value tile) in parallel: O = (Q ⊙ exp(Γ)) S + Aqk U'.
    g must lie in (GATE_FLOOR, 0] (a log-decay; the model's is in (-5, 0)): see GATE_FLOOR.
    block_v, num_warps, num_stages tune pass 2; precision is the tl.dot input precision.
    Transient memory: one fp32 state per chunk (4 MiB per 64 tokens at H = 64, d = 128).
    """
    T, H, dk, dv = _check_prefill(q, k, v, g, beta, initial_state)
    if chunk not in (16, 32, 64):
        raise ValueError(f"chunk must be 16, 32 or 64, got {chunk}")
    bad = [r for r in after if not (r == T or 0 < r < T and r % chunk == 0)]
    if bad:
        raise ValueError(f"after {bad}: each must be T {T} or a positive multiple of chunk {chunk} below it")
    _check_pow2("d_k", dk)
    _check_pow2("d_v", dv)
    if dv % min(dv, block_v):
        raise ValueError(f"block_v {block_v} must divide d_v {dv}")
    f = chunk_factors(q, k, v, g, beta, chunk, precision)
    states = chunk_states(f, initial_state, block_v, num_warps, num_stages, precision)
    o = chunk_output(f, states, q.dtype, precision)
    return o, states[-1].clone(), states[[-1 if r == T else r // chunk for r in after]] if after else None


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
                  num_warps: int = 1, num_stages: int = 2) -> ChunkFactors:
    """Two launches: `_kda_chunk_intra_kernel` per (chunk, head) builds Γ, Aqk and
    Tm = (I - A)^{-1} one 16-row block at a time; `_kda_chunk_wy_kernel` per (32 columns of
    [K | V], chunk, head) multiplies W = Tm (K_β ⊙ exp(Γ)), U = Tm V_β as [chunk, chunk] x
    [chunk, 32] products. num_warps and num_stages launch the intra kernel. H200, T 8192, H 64, d 128,
    fp32 (`.whl/s15_kda3.py`): both launches 1.71-1.81 ms at 1 warp and 2 stages, 2.39-2.44 at 2 and 2,
    3.39-3.40 at 4 and 2 (the previous intra kernel, which reloaded all the chunk's keys for each row
    block: 2.61-2.69 at its best, 2 and 2). sm_90 AOT (triton 3.6, d = 128, chunk 64, pointers and
    sizes specialized as the JIT does) at 1 warp: 255 registers, 296 B spilled, a 1744-instruction
    loop a 16-channel slice; grouping the pairs by row block (4 passes over the channels) spills none
    but took 1.96-2.02 ms. Transient memory: A and Tm, [rows, H, chunk] fp32 each."""
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
        q, k, g, beta, f.gamma, a, tm, f.aqk, T, H=H, DK=dk, BT=chunk, BC=SUB_CHUNK, BKD=16,
        DOT=precision, num_warps=num_warps, num_stages=num_stages)
    bd = min(dk, dv, 32)
    _kda_chunk_wy_kernel[((dk + dv) // bd, n_chunks, H)](
        q, k, v, beta, f.gamma, tm, f.w, f.u, f.qg, f.kd, T, H=H, DK=dk, DV=dv, BT=chunk, BD=bd,
        DOT=precision, num_warps=4, num_stages=1)
    return f


def chunk_states(f: ChunkFactors, initial_state: torch.Tensor | None, block_v: int = 32,
                 num_warps: int = 4, num_stages: int = 2, precision: str = DOT_PRECISION) -> torch.Tensor:
    """States [n_chunks + 1, H, d_k, d_v] fp32: entry c is the state before chunk c, the last one
    the final state. Overwrites f.u with U'.

    The default tiles keep every program resident at once (d = 128, H = 64: 256 programs, two an SM:
    193 registers and 90 KB of shared memory each with the next chunk's loads in flight, sm_90 AOT).
    H200, T 8192 (`.whl/s15_kda2.py`): 1.00 ms at 2 stages, 1.12 at 1; 64-value tiles 1.26-1.31,
    8 warps 2.49."""
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
        num_warps=4, num_stages=3)
    return o


@triton.jit
def _dot(a, b, acc, DOT: tl.constexpr):
    """tl.dot(a, b, acc) at input precision DOT, "tf32x3" by hand (`kernels._dot_tf32x3`)."""
    if DOT == "tf32x3":
        return _dot_tf32x3(a, b, acc, False)
    return tl.dot(a, b, acc, input_precision=DOT)


@triton.jit
def _kda_chunk_intra_kernel(q_ptr, k_ptr, g_ptr, beta_ptr, gamma_ptr, a_ptr, tm_ptr, aqk_ptr, T,
                            H: tl.constexpr, DK: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                            BKD: tl.constexpr, DOT: tl.constexpr):
    """One (chunk, head): Γ (the chunk's cumulative sum of g), then Aqk and Tm = (I - A)^{-1},
    BC x BC blocks at a time (BT = BC · NC, NC = 1, 2 or 4). Row block R:

        Tm_RR = (I - A_RR)^{-1},   Tm_RQ = Tm_RR Σ_{Q<=P<R} A_RP Tm_PQ   (Q < R)

    The blocks A_RP and Aqk_RP (P <= R) are products over the key channels of block R's rows and
    block P's keys, both decayed to block R's first row: exponents <= 0 on R's side and on P's for
    P < R, at most (BC - 1) · |g| < 88 for P = R, finite for g > GATE_FLOOR. One pass over the
    channels, BKD at a time, loads each block's k, q and Γ once and keeps the pairs' products in
    registers (`_intra_pair`); A and Tm then go through a_ptr and tm_ptr, both [rows, H, BT], and are
    read back by the same program after a barrier (a few KB, cache-resident), so no register holds
    a whole chunk's matrix.
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
    z = tl.zeros([BC, BC], dtype=tl.float32)
    kk00, qk00, kk10, qk10, kk11, qk11 = z, z, z, z, z, z
    kk20, qk20, kk21, qk21, kk22, qk22 = z, z, z, z, z, z
    kk30, qk30, kk31, qk31, kk32, qk32, kk33, qk33 = z, z, z, z, z, z, z, z
    for i0 in range(0, DK, BKD):
        k0, q0, g0, f0 = _intra_rows(q_ptr, k_ptr, gamma_ptr, chunk0, h, i0, T, H, DK, BC, BKD)
        kk00, qk00 = _intra_pair(kk00, qk00, k0, q0, g0, f0, k0, g0, DOT)
        if NC > 1:
            k1, q1, g1, f1 = _intra_rows(q_ptr, k_ptr, gamma_ptr, chunk0 + BC, h, i0, T, H, DK, BC, BKD)
            kk10, qk10 = _intra_pair(kk10, qk10, k1, q1, g1, f1, k0, g0, DOT)
            kk11, qk11 = _intra_pair(kk11, qk11, k1, q1, g1, f1, k1, g1, DOT)
        if NC > 2:
            k2, q2, g2, f2 = _intra_rows(q_ptr, k_ptr, gamma_ptr, chunk0 + 2 * BC, h, i0, T, H, DK, BC, BKD)
            kk20, qk20 = _intra_pair(kk20, qk20, k2, q2, g2, f2, k0, g0, DOT)
            kk21, qk21 = _intra_pair(kk21, qk21, k2, q2, g2, f2, k1, g1, DOT)
            kk22, qk22 = _intra_pair(kk22, qk22, k2, q2, g2, f2, k2, g2, DOT)
            k3, q3, g3, f3 = _intra_rows(q_ptr, k_ptr, gamma_ptr, chunk0 + 3 * BC, h, i0, T, H, DK, BC, BKD)
            kk30, qk30 = _intra_pair(kk30, qk30, k3, q3, g3, f3, k0, g0, DOT)
            kk31, qk31 = _intra_pair(kk31, qk31, k3, q3, g3, f3, k1, g1, DOT)
            kk32, qk32 = _intra_pair(kk32, qk32, k3, q3, g3, f3, k2, g2, DOT)
            kk33, qk33 = _intra_pair(kk33, qk33, k3, q3, g3, f3, k3, g3, DOT)
    # Aqk on and below the diagonal, zeros above; A = -β K K^T strictly below it.
    _intra_store(kk00, qk00, 0, 0, chunk0, h, beta_ptr, a_ptr, aqk_ptr, T, H, BT, BC)
    if NC > 1:
        _intra_store(kk10, qk10, 1, 0, chunk0, h, beta_ptr, a_ptr, aqk_ptr, T, H, BT, BC)
        _intra_store(kk11, qk11, 1, 1, chunk0, h, beta_ptr, a_ptr, aqk_ptr, T, H, BT, BC)
    if NC > 2:
        _intra_store(kk20, qk20, 2, 0, chunk0, h, beta_ptr, a_ptr, aqk_ptr, T, H, BT, BC)
        _intra_store(kk21, qk21, 2, 1, chunk0, h, beta_ptr, a_ptr, aqk_ptr, T, H, BT, BC)
        _intra_store(kk22, qk22, 2, 2, chunk0, h, beta_ptr, a_ptr, aqk_ptr, T, H, BT, BC)
        _intra_store(kk30, qk30, 3, 0, chunk0, h, beta_ptr, a_ptr, aqk_ptr, T, H, BT, BC)
        _intra_store(kk31, qk31, 3, 1, chunk0, h, beta_ptr, a_ptr, aqk_ptr, T, H, BT, BC)
        _intra_store(kk32, qk32, 3, 2, chunk0, h, beta_ptr, a_ptr, aqk_ptr, T, H, BT, BC)
        _intra_store(kk33, qk33, 3, 3, chunk0, h, beta_ptr, a_ptr, aqk_ptr, T, H, BT, BC)
    tl.debug_barrier()  # A's blocks, written by other threads; such read-backs go through L2 (.cg)
    for R in range(NC):
        block_rows = ((chunk0 + R * BC + rc).to(tl.int64)[:, None] * H + h) * BT  # row offsets into a and tm
        a_rr = tl.load(a_ptr + block_rows + R * BC + rc[None, :], mask=lower, other=0.0, cache_modifier=".cg")
        tm_rr = _unit_lower_inverse(a_rr, BC)
        tl.store(tm_ptr + block_rows + it[None, :], tl.zeros([BC, BT], dtype=tl.float32),
                 mask=(it >= R * BC + BC)[None, :])
        tl.store(tm_ptr + block_rows + R * BC + rc[None, :], tm_rr)
        tl.debug_barrier()  # the Tm rows before block R, written by other threads
        for Q in range(R):
            acc = tl.zeros([BC, BC], dtype=tl.float32)
            for P in range(Q, R):
                rows_p = (chunk0 + P * BC + rc).to(tl.int64)
                a_rp = tl.load(a_ptr + block_rows + P * BC + rc[None, :], cache_modifier=".cg")
                tm_pq = tl.load(tm_ptr + (rows_p[:, None] * H + h) * BT + Q * BC + rc[None, :],
                                cache_modifier=".cg")
                acc = _dot(a_rp, tm_pq, acc, DOT)
            tl.store(tm_ptr + block_rows + Q * BC + rc[None, :], _dot(tm_rr, acc, None, DOT))
        tl.debug_barrier()


@triton.jit
def _intra_rows(q_ptr, k_ptr, gamma_ptr, row0, h, i0, T, H: tl.constexpr, DK: tl.constexpr, BC: tl.constexpr,
                BKD: tl.constexpr):
    """The BC rows from row0, key channels i0..i0+BKD: k, q (zero past T), Γ, and Γ of the first row."""
    rows = (row0 + tl.arange(0, BC)).to(tl.int64)
    cols = i0 + tl.arange(0, BKD)
    off = (rows[:, None] * H + h) * DK + cols[None, :]
    valid = (rows < T)[:, None]
    k = tl.load(k_ptr + off, mask=valid, other=0.0).to(tl.float32)
    q = tl.load(q_ptr + off, mask=valid, other=0.0).to(tl.float32)
    first = tl.load(gamma_ptr + (tl.cast(row0, tl.int64) * H + h) * DK + cols)
    return k, q, tl.load(gamma_ptr + off), first


@triton.jit
def _intra_pair(kk, qk, k_r, q_r, g_r, first_r, k_p, g_p, DOT: tl.constexpr):
    """kk += (K_R ⊙ exp(Γ_R - Γ_first)) (K_P ⊙ exp(Γ_first - Γ_P))^T and qk the same with Q_R, for one
    BKD-channel slice: block R's rows against block P's keys, both decayed to R's first row."""
    to_first = tl.exp(g_r - first_r[None, :])
    keys = tl.trans(k_p * tl.exp(first_r[None, :] - g_p))
    return _dot(k_r * to_first, keys, kk, DOT), _dot(q_r * to_first, keys, qk, DOT)


@triton.jit
def _intra_store(kk, qk, R: tl.constexpr, P: tl.constexpr, chunk0, h, beta_ptr, a_ptr, aqk_ptr, T,
                 H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Block (R, P) of Aqk (on and below the diagonal) and of A = -β K K^T (strictly below); for the
    diagonal block also Aqk's zeros right of it."""
    rc = tl.arange(0, BC)
    rows = (chunk0 + R * BC + rc).to(tl.int64)
    block = (rows[:, None] * H + h) * BT + P * BC + rc[None, :]
    beta = tl.load(beta_ptr + rows * H + h, mask=rows < T, other=0.0).to(tl.float32)
    if R == P:
        tl.store(aqk_ptr + block, tl.where(rc[None, :] <= rc[:, None], qk, 0.0))
        tl.store(a_ptr + block, -beta[:, None] * kk, mask=rc[None, :] < rc[:, None])
        it = tl.arange(0, BT)
        tl.store(aqk_ptr + (rows[:, None] * H + h) * BT + it[None, :], tl.zeros([BC, BT], dtype=tl.float32),
                 mask=(it >= P * BC + BC)[None, :])
    else:
        tl.store(aqk_ptr + block, qk)
        tl.store(a_ptr + block, -beta[:, None] * kk)


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
        tl.store(w_ptr + key_off, _dot(tm, kx * bx * tl.exp(gam), None, DOT))
    else:
        val_off = (rows[:, None] * H + h) * DV + j0 - DK + jd[None, :]
        vx = tl.load(v_ptr + val_off, mask=valid, other=0.0).to(tl.float32)
        tl.store(u_ptr + val_off, _dot(tm, vx * bx, None, DOT))


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

    S is held as its two halves of key rows, S1 and S2 (one piece when d_k < 32: tl.dot needs 16),
    so that each product is [BT, d_k/2] x [d_k/2, BV] and its operands' pieces fit the registers:
    sm_90 AOT (d 128, BV 32, 4 warps): a 1079-instruction loop without spills, against 2195 with
    744 B spilled for one [d_k, BV] piece and triton's own tf32x3.
    """
    h = tl.program_id(1)
    HALVES: tl.constexpr = 2 if DK >= 32 else 1
    HK: tl.constexpr = DK // HALVES
    ik = tl.arange(0, HK)
    jv = tl.program_id(0) * BV + tl.arange(0, BV)
    it = tl.arange(0, BT)
    s_off = h * DK * DV + ik[:, None] * DV + jv[None, :]
    half = HK * DV  # from S1's rows to S2's in a state, and HK columns in w and kd
    if HAS_INIT:
        S1 = tl.load(init_ptr + s_off)
    else:
        S1 = tl.zeros([HK, BV], dtype=tl.float32)
    S2 = S1  # unused with one piece
    if HALVES == 2 and HAS_INIT:
        S2 = tl.load(init_ptr + s_off + half)
    for c in range(n_chunks):
        state = states_ptr + tl.cast(c, tl.int64) * (H * DK * DV) + s_off
        tl.store(state, S1)
        rows = (c * BT + it).to(tl.int64)
        k_off = (rows[:, None] * H + h) * DK + ik[None, :]
        u_off = (rows[:, None] * H + h) * DV + jv[None, :]
        ws = _dot(tl.load(w_ptr + k_off), S1, None, DOT)
        if HALVES == 2:
            tl.store(state + half, S2)
            ws = _dot(tl.load(w_ptr + k_off + HK), S2, ws, DOT)
        u_new = tl.load(u_ptr + u_off) - ws
        tl.store(u_ptr + u_off, u_new)
        last = (tl.cast(c * BT + BT - 1, tl.int64) * H + h) * DK + ik
        S1 = _dot(tl.trans(tl.load(kd_ptr + k_off)), u_new, S1 * tl.exp(tl.load(gamma_ptr + last))[:, None], DOT)
        if HALVES == 2:
            S2 = _dot(tl.trans(tl.load(kd_ptr + k_off + HK)), u_new,
                      S2 * tl.exp(tl.load(gamma_ptr + last + HK))[:, None], DOT)
    state = states_ptr + tl.cast(n_chunks, tl.int64) * (H * DK * DV) + s_off
    tl.store(state, S1)
    if HALVES == 2:
        tl.store(state + half, S2)


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
        o = _dot(qg, s, o, DOT)
    aqk = tl.load(aqk_ptr + (rows[:, None] * H + h) * BT + it[None, :])
    u_new = tl.load(u_ptr + (rows[:, None] * H + h) * DV + jv[None, :])
    o = _dot(aqk, u_new, o, DOT)
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


# ================================================================ KDA decode inputs and output (§4.3)

@triton.jit
def _qkv(j: tl.constexpr, q, k, v):
    # q, k or v for j = 0, 1, 2: the input kernels run one loop body over the three projections.
    if j == 0:
        x = q
    elif j == 1:
        x = k
    else:
        x = v
    return x


@triton.jit
def _low_rank_tile(x_ptr, w_ptr, s_ptr, r, k0: tl.constexpr, R: tl.constexpr, LR: tl.constexpr):
    # The 128-wide block from k0 of a low-rank product's operands (see _low_rank): x, loaded as W's
    # [rows, 128] tile is (x once per row of it, so that it needs no layout change), W and its scale.
    j = k0 + tl.arange(0, 128)[None, :]
    x = tl.load(x_ptr + j + 0 * r, mask=j < R, other=0.0)
    w = tl.load(w_ptr + r * R + j, mask=j < R, other=0.0)
    if LR == 1:
        scale = tl.load(s_ptr + (r // 128) * ((R + 127) // 128) + k0 // 128)
    else:
        scale = 1.0
    return x, w, scale


@triton.jit
def _low_rank_dot(x, w, scale, LR: tl.constexpr):
    dot = tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1, keep_dims=True)
    if LR == 1:
        dot = dot * scale
    return dot


@triton.jit
def _low_rank(x_ptr, w_ptr, s_ptr, r, x0, w0, scale0, R: tl.constexpr, LR: tl.constexpr, DT: tl.constexpr):
    # Rows r [rows, 1] of W · x (W [n, R] row-major, x [R]) rounded to DT, as fastdecode's linear gives them:
    # fp32 sums; for FP8 block-128 (LR 1, scale_inv s [ceil(n/128), ceil(R/128)]) each 128-wide block's
    # dot times its scale, the blocks added in order, as kernels.fp8_gemv does; LR 2: a dense W. The
    # first block's operands (x0, w0, scale0: `_low_rank_tile`) come loaded, so that the caller can issue
    # them before any barrier; the model's rank is one block.
    acc = _low_rank_dot(x0, w0, scale0, LR)
    for k0 in tl.static_range(128, R, 128):
        x, w, scale = _low_rank_tile(x_ptr, w_ptr, s_ptr, r, k0, R, LR)
        acc += _low_rank_dot(x, w, scale, LR)
    return tl.reshape(_cast(acc, DT).to(tl.float32), [r.shape[0]])


@triton.jit
def _conv_loads(j: tl.constexpr, q_ptr, k_ptr, v_ptr, x_row, hist_ptr, cs_row, w_ptr, c, t,
                H: tl.constexpr, DH: tl.constexpr, KW: tl.constexpr):
    # Projection j's history rows (t < KW-1) of the slot, this token's row and the conv weights [KP, DH],
    # as loaded: they meet in one layout (a shared-memory exchange, with barriers) only in `_conv_out`.
    hist = tl.load(hist_ptr + t * cs_row + c[None, :], mask=t < KW - 1, other=0.0)
    new = tl.load(_qkv(j, q_ptr, k_ptr, v_ptr) + x_row + c[None, :])
    weight = tl.load(w_ptr + (j * H * DH + c[None, :]) * KW + t, mask=t < KW, other=0.0)
    return hist, new, weight


@triton.jit
def _conv_out(j: tl.constexpr, hist, new, weight, hist_ptr, cs_row, c, t, out_ptr, scale, KW: tl.constexpr):
    # Projection j's SiLU(conv) over the window (rows t: 0 .. KW-2 the history, KW-1 the token), q and k
    # L2-normalized (q also · scale), and the window shifted by one into the slot's history.
    window = tl.where(t == KW - 1, new.to(tl.float32), hist.to(tl.float32))
    pre = tl.sum(window * weight.to(tl.float32), axis=0)
    act = _cast(pre * tl.sigmoid(pre), hist.dtype).to(tl.float32)  # SiLU, rounded as short_conv rounds
    tl.store(hist_ptr + (t - 1) * cs_row + c[None, :], _cast(window, hist.dtype), mask=(t >= 1) & (t < KW))
    if j == 0:
        act = act / tl.sqrt(tl.sum(act * act, axis=0) + 1e-6) * scale
    elif j == 1:
        act = act / tl.sqrt(tl.sum(act * act, axis=0) + 1e-6)
    tl.store(out_ptr, act)


@triton.jit
def _kda_inputs_kernel(q_ptr, k_ptr, v_ptr, x_stride, conv_ptr, slots_ptr, w_ptr, f_ptr, f_stride, fw_ptr, fs_ptr,
                       ga_ptr, ga_stride, gw_ptr, gs_ptr, og_ptr, alog_ptr, dtb_ptr, b_ptr, b_stride,
                       qo_ptr, ko_ptr, vo_ptr, go_ptr, beta_ptr, lower, scale, cs_slot, cs_j, cs_row,
                       H: tl.constexpr, DH: tl.constexpr, KW: tl.constexpr, KP: tl.constexpr, R: tl.constexpr,
                       LR: tl.constexpr, LRG: tl.constexpr):
    # LR 0: f_ptr holds f (f_b's output); 1, 2: f_a's output, and f = f_b · it here (see _low_rank). LRG 1, 2:
    # also o_g = g_b · g_a (ga_ptr) into og_ptr [B, H·d] for the output gate; R: their rank. A program's time
    # at B=1 is latency, so every global load is issued before the one barrier (the history's loads before its
    # stores) and nothing that exchanges layouts through shared memory comes between them. H200, full size,
    # B=1, when each window's barrier and x's layout exchange split the loads into waits of their own: 9.4 us a
    # call with both factors against 5.5 without (the two GEMV launches they replace took 9.8); H100, first 8
    # layers, decode steps with the loads first: 1.016x at B=1 (~4.7 us a call less), 1.008x at B=4.
    _pdl_enter()
    bi = tl.program_id(0)
    h = tl.program_id(1)
    c = h * DH + tl.arange(0, DH)
    slot = tl.load(slots_ptr + bi).to(tl.int64)
    t = tl.arange(0, KP)[:, None]
    hist_ptr = conv_ptr + slot * cs_slot
    x_row = bi * x_stride
    hist_q, new_q, w_q = _conv_loads(0, q_ptr, k_ptr, v_ptr, x_row, hist_ptr, cs_row, w_ptr, c, t, H, DH, KW)
    hist_k, new_k, w_k = _conv_loads(1, q_ptr, k_ptr, v_ptr, x_row, hist_ptr + cs_j, cs_row, w_ptr, c, t, H, DH, KW)
    hist_v, new_v, w_v = _conv_loads(2, q_ptr, k_ptr, v_ptr, x_row, hist_ptr + 2 * cs_j, cs_row, w_ptr, c, t, H, DH,
                                     KW)
    b = tl.load(b_ptr + bi * b_stride + h).to(tl.float32)
    a = tl.exp(tl.load(alog_ptr + h))
    dtb = tl.load(dtb_ptr + c)
    r = c[:, None]
    if LR == 0:
        f = tl.load(f_ptr + bi * f_stride + c).to(tl.float32)
    else:
        fx, fw, fs = _low_rank_tile(f_ptr + bi * f_stride, fw_ptr, fs_ptr, r, 0, R, LR)
    if LRG != 0:
        gx, gw, gs = _low_rank_tile(ga_ptr + bi * ga_stride, gw_ptr, gs_ptr, r, 0, R, LRG)
    tl.debug_barrier()
    if LR != 0:
        f = _low_rank(f_ptr + bi * f_stride, fw_ptr, fs_ptr, r, fx, fw, fs, R, LR, f_ptr.dtype.element_ty)
    if LRG != 0:
        o_g = _low_rank(ga_ptr + bi * ga_stride, gw_ptr, gs_ptr, r, gx, gw, gs, R, LRG, ga_ptr.dtype.element_ty)
        tl.store(og_ptr + bi * (H * DH) + c, o_g.to(og_ptr.dtype.element_ty))
    out = (bi * H + h) * DH + tl.arange(0, DH)
    _conv_out(0, hist_q, new_q, w_q, hist_ptr, cs_row, c, t, qo_ptr + out, scale, KW)
    _conv_out(1, hist_k, new_k, w_k, hist_ptr + cs_j, cs_row, c, t, ko_ptr + out, scale, KW)
    _conv_out(2, hist_v, new_v, w_v, hist_ptr + 2 * cs_j, cs_row, c, t, vo_ptr + out, scale, KW)
    tl.store(go_ptr + out, lower * tl.sigmoid(a * (f + dtb)))
    tl.store(beta_ptr + bi * H + h, tl.sigmoid(b))


@dataclass
class LowRank:
    """The second factor W [n, r] of a low-rank projection (f_b, g_b), for a decode kernel to apply to
    the first factor's output itself instead of a GEMV launch of its own: FP8 block-128 (weight
    float8_e4m3fn, scale_inv [ceil(n/128), ceil(r/128)] fp32) or a dense weight (scale_inv None)."""
    weight: torch.Tensor
    scale_inv: torch.Tensor | None = None

    def check(self, name: str, x: torch.Tensor, rows: int, n: int) -> int:
        """Checks W against its input x [rows, r]; returns the kernels' LR switch (1 FP8, 2 dense)."""
        w, s = self.weight, self.scale_inv
        r = w.shape[-1]
        fp8 = w.dtype == torch.float8_e4m3fn
        if w.dim() != 2 or w.shape[0] != n or not w.is_contiguous() or \
                not (fp8 or (s is None and w.dtype in (torch.bfloat16, torch.float16, torch.float32))):
            raise ValueError(f"{name}: the low-rank weight must be contiguous FP8 (with scale_inv), bf16, fp16 or "
                             f"fp32 ({n}, r), got {w.dtype} {tuple(w.shape)}")
        if fp8 and (s is None or tuple(s.shape) != ((n + 127) // 128, (r + 127) // 128) or s.dtype != torch.float32
                    or not s.is_contiguous()):
            raise ValueError(f"{name}: scale_inv must be contiguous fp32 ({(n + 127) // 128}, {(r + 127) // 128}), "
                             f"got {None if s is None else (s.dtype, tuple(s.shape))}")
        _rows(x, f"{name}: the low-rank input", rows, r)
        # What linear does on a GPU: a dense W converts x to its dtype and rounds to it; fp8.FP8Linear
        # rounds an fp32 x to bf16 first. Inputs that linear would convert are refused.
        if not fp8 and x.dtype != w.dtype:
            raise ValueError(f"{name}: a dense low-rank weight must have its input's dtype {x.dtype}, got {w.dtype}")
        if fp8 and x.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"{name}: an FP8 low-rank weight needs a bf16 or fp16 input, got {x.dtype}")
        return 1 if fp8 else 2


def _low_rank_args(lr: LowRank | None, x: torch.Tensor) -> tuple:
    # The kernels' weight and scale pointers and rank r (x itself where unused).
    if lr is None:
        return x, x, 0
    return lr.weight, x if lr.scale_inv is None else lr.scale_inv, lr.weight.shape[1]


def _check_kda_inputs(name: str, pre_conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor], conv_w: torch.Tensor,
                      f: torch.Tensor, b: torch.Tensor, H: int, d: int,
                      f_b: LowRank | None = None) -> tuple[int, int, int, int]:
    # kda_decode_inputs' and kda_chunk_inputs' shared operands: returns (rows, H·d, conv width K, LR).
    n, HD = pre_conv[0].shape[0], H * d
    for qkv, t in zip("qkv", pre_conv):
        _rows(t, f"{name}: {qkv}", n, HD)
    if pre_conv[0].stride(0) != pre_conv[1].stride(0) or pre_conv[0].stride(0) != pre_conv[2].stride(0):
        raise ValueError(f"{name}: q, k, v must share a row stride")
    if f_b is None:
        _rows(f, f"{name}: f", n, HD)
    lr = 0 if f_b is None else f_b.check(f"{name}: f_b", f, n, HD)
    _rows(b, f"{name}: b", n, H)
    K = conv_w.shape[-1]
    if tuple(conv_w.shape) != (3, HD, K) or not conv_w.is_contiguous():
        raise ValueError(f"{name}: conv_w must be contiguous (3, {HD}, {K}), got {tuple(conv_w.shape)}")
    return n, HD, K, lr


def kda_decode_inputs(pre_conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor], conv_state: torch.Tensor,
                      slots: torch.Tensor, conv_w: torch.Tensor, f: torch.Tensor, A_log: torch.Tensor,
                      dt_bias: torch.Tensor, b: torch.Tensor, lower_bound: float, H: int, d: int,
                      f_b: LowRank | None = None, o_gate: tuple[torch.Tensor, LowRank] | None = None
                      ) -> tuple[torch.Tensor, ...]:
    """§4.3.2-4.3.5 for one token of B sequences: short conv + SiLU over the slot's window (updating
    conv_state [slots, 3, K-1, H·d] in place), q and k L2-normalized (q also · d^-1/2), the gate g
    and β. pre_conv: q̃, k̃, ṽ [B, H·d]; conv_w [3, H·d, K]; f [B, H·d] (f_b's output), or with f_b
    f_a's output [B, r], f_b applied here; A_log [H] and dt_bias [H·d] fp32; b [B, H] (b_proj's
    output). Returns q, k, v, g [B, H, d] and β [B, H], fp32; with o_gate = (g_a's output [B, r], g_b)
    also o_g = g_b · g_a [B, H·d] in g_a's dtype (kda_output_gate's input), as linear gives it."""
    B, HD, K, lr = _check_kda_inputs("kda_decode_inputs", pre_conv, conv_w, f, b, H, d, f_b)
    if tuple(conv_state.shape[1:]) != (3, K - 1, HD) or conv_state.stride(-1) != 1:
        raise ValueError(f"kda_decode_inputs: conv_state must be (slots, 3, {K - 1}, {HD}), got {tuple(conv_state.shape)}")
    q, k, v, g = (torch.empty(B, H, d, dtype=torch.float32, device=f.device) for _ in range(4))
    beta = torch.empty(B, H, dtype=torch.float32, device=f.device)
    g_a, g_b = o_gate or (f, None)
    lrg = 0 if g_b is None else g_b.check("kda_decode_inputs: g_b", g_a, B, HD)
    o_g = torch.empty(B, HD, dtype=g_a.dtype, device=f.device) if g_b is not None else g_a
    f_args, g_args = _low_rank_args(f_b, f), _low_rank_args(g_b, g_a)
    if f_b is not None and g_b is not None and f_args[2] != g_args[2]:
        raise ValueError(f"kda_decode_inputs: f_b and g_b must share their rank, got {f_args[2]} and {g_args[2]}")
    _kda_inputs_kernel[(B, H)](
        *pre_conv, pre_conv[0].stride(0), conv_state, slots.contiguous(), conv_w, f, f.stride(0), *f_args[:2],
        g_a, g_a.stride(0), *g_args[:2], o_g, A_log.float().contiguous(),
        dt_bias.float().contiguous(), b, b.stride(0), q, k, v, g, beta, lower_bound, d ** -0.5,
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        H=H, DH=d, KW=K, KP=triton.next_power_of_2(K), R=max(f_args[2], g_args[2]), LR=lr, LRG=lrg,
        launch_pdl=_pdl())
    return (q, k, v, g, beta) + ((o_g,) if g_b is not None else ())


KDA_OUTPUT_ROWS = 16  # (row, head) pairs per program of the output gate, from this many rows on
KDA_INPUT_ROWS = 8  # chunk rows per program of the prefill inputs kernel (H200, 8192 rows: 685 us; 16 rows 776)


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
        src = _qkv(j, q_ptr, k_ptr, v_ptr)
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
    n, HD, K, _ = _check_kda_inputs("kda_chunk_inputs", pre_conv, conv_w, f, b, H, d)
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
def _kda_output_kernel(o_ptr, og_ptr, og_stride, w_ptr, out_ptr, eps, N, H: tl.constexpr, DH: tl.constexpr,
                       RB: tl.constexpr):
    # RB (row, head) pairs p = row * H + head a program, N of them in all.
    _pdl_enter()
    p = tl.program_id(0) * RB + tl.arange(0, RB)[:, None]
    ok = p < N
    bi = (p // H).to(tl.int64)
    i = tl.arange(0, DH)[None, :]
    o = tl.load(o_ptr + p.to(tl.int64) * DH + i, mask=ok, other=0.0).to(tl.float32)
    # the gate before the norm's sum, whose exchange between warps (a barrier) would hold its load back
    gate = tl.load(og_ptr + bi * og_stride + (p % H) * DH + i, mask=ok, other=0.0).to(tl.float32)
    y = tl.load(w_ptr + i) * (o / tl.sqrt(tl.sum(o * o, axis=1)[:, None] / DH + eps))
    tl.store(out_ptr + p.to(tl.int64) * DH + i, _cast(y * tl.sigmoid(gate), out_ptr.dtype.element_ty), mask=ok)


def kda_output_gate(o: torch.Tensor, o_g: torch.Tensor, o_norm: torch.Tensor, eps: float,
                    dtype: torch.dtype) -> torch.Tensor:
    """§4.3.8 before o_proj: per-head RMSNorm of o [B, H, d] (fp32 weight o_norm [d]) times
    sigmoid(o_g [B, H·d]), in `dtype`, [B, H·d]."""
    B, H, d = o.shape
    _rows(o_g, "kda_output_gate: o_g", B, H * d)
    out = torch.empty(B, H * d, dtype=dtype, device=o.device)
    # a decode step's few rows a (row, head) pair a program; a prefill chunk's RB pairs a program (one
    # pair a program left the 8K chunk's 524288 programs at 365 us on the H200)
    rb = 1 if B < KDA_OUTPUT_ROWS else KDA_OUTPUT_ROWS
    _kda_output_kernel[(triton.cdiv(B * H, rb),)](o.contiguous(), o_g, o_g.stride(0), o_norm.float().contiguous(), out,
                                                 eps, B * H, H=H, DH=d, RB=rb, launch_pdl=_pdl())
    return out

"""KDA (Kimi Delta Attention) recurrence: Triton kernels and their pure-torch twins (spec §4.3.6-7).

Per head h the state S[h] is fp32 [d_k, d_v], indexed [key i, value j]. One token:

    S <- diag(exp(g)) S          decay the key rows first
    p  = S^T k                   what the state predicts for k
    δ  = β (v - p)               delta rule
    S <- S + k δ^T
    o  = S^T q                   read from the updated state (q already L2-normed and scaled)

`kda_recurrent_step` runs that for one token of B sequences against a state pool (decode);
`kda_chunk_prefill` runs a whole sequence in the chunked WY form (§4.3.7). The `_ref` twins are the
per-token recurrence written plainly in fp32; tests hold the kernels to them.

Matrix products inside the prefill kernels use `tl.dot` with DOT_PRECISION = "tf32": operands are
rounded to a 10-bit mantissa on the tensor cores (about 1e-3 relative error per product), while
everything else (the carried state, Γ, the exact solve of the 16-row diagonal blocks) stays fp32. "tf32x3"
(near fp32 on the tensor cores) and "ieee" (plain fp32 FMA) both spill registers in these kernels
when compiled for sm_90; kda_gpu_check.py measures the error and time of all three. Under the CPU
interpreter tl.dot is exact fp32 whatever the setting. The decode kernel has no matrix product.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

DOT_PRECISION = "tf32"
SUB_CHUNK = 16  # rows of the diagonal blocks solved exactly inside a chunk; tl.dot needs >= 16
OUT_BLOCK_V, OUT_BLOCK_K = 64, 32


# ---------------------------------------------------------------- torch twins (the spec as code)

def kda_recurrent_step_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One token for B sequences; state[slots[b]] is updated in place. Returns o [B, H, d_v] in q's dtype."""
    _check_step(q, k, v, g, beta, state, slots)
    S, o = _delta_rule_token(state[slots].float(), q, k, v, g, beta)
    state[slots] = S
    return o.to(q.dtype)


def kda_chunk_prefill_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor, initial_state: torch.Tensor | None = None,
                          block: int | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The per-token recurrence over one sequence: q, k, g [T, H, d_k], v [T, H, d_v], beta [T, H].

    Returns (o [T, H, d_v] in q's dtype, final state [H, d_k, d_v] fp32, boundary states
    [T // block, H, d_k, d_v] fp32 = the state after each token t with (t + 1) % block == 0, or None).
    """
    T, H, dk, dv = _check_prefill(q, k, v, g, beta, initial_state)
    S = _initial(initial_state, H, dk, dv, q.device)
    o = torch.empty(T, H, dv, dtype=torch.float32, device=q.device)
    saved = []
    for t in range(T):
        S, o[t] = _delta_rule_token(S, q[t], k[t], v[t], g[t], beta[t])
        if block is not None and (t + 1) % block == 0:
            saved.append(S)
    boundary = _stack_boundaries(saved, block, H, dk, dv, q.device)
    return o.to(q.dtype), S, boundary


def _delta_rule_token(S: torch.Tensor, q, k, v, g, beta) -> tuple[torch.Tensor, torch.Tensor]:
    """§4.3.6 for one token, batched over leading dims: S [..., d_k, d_v] fp32, q k g [..., d_k],
    v [..., d_v], beta [...]. Returns the new state and o [..., d_v] (fp32)."""
    S = S * torch.exp(g.float())[..., None]
    p = torch.einsum("...ij,...i->...j", S, k.float())
    delta = beta.float()[..., None] * (v.float() - p)
    S = S + k.float()[..., None] * delta[..., None, :]
    o = torch.einsum("...ij,...i->...j", S, q.float())
    return S, o


# ---------------------------------------------------------------- decode: one token, state pool

def kda_recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                       block_v: int = 32, num_warps: int = 4) -> torch.Tensor:
    """Triton twin of `kda_recurrent_step_ref`: q, k, g [B, H, d_k], v [B, H, d_v], beta [B, H],
    state [num_slots, H, d_k, d_v] fp32 (e.g. CachePool.kda_state[layer]) updated in place at rows
    `slots` [B] (distinct). Returns o [B, H, d_v] in q's dtype.

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
    """Triton twin of `kda_chunk_prefill_ref` (same arguments and results), in three passes:

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
    """ptxas for sm_90 (d = 128, tf32): 4 warps, 1 stage: 255 registers, 32 B spilled, 17 KB shared
    memory, two programs per SM; the default 3 stages would pipeline the block loop through 117 KB
    of shared memory, one program per SM."""
    T, H, dk = q.shape
    dv = v.shape[-1]
    q, k, v, beta = (x.contiguous() for x in (q, k, v, beta))
    n_chunks = triton.cdiv(T, chunk)
    rows = n_chunks * chunk
    f32 = dict(dtype=torch.float32, device=q.device)
    gamma = torch.zeros(rows, H, dk, **f32)
    gamma[:T] = g
    gamma = gamma.view(n_chunks, chunk, H, dk).cumsum(1).view(rows, H, dk)
    f = ChunkFactors(T, chunk, gamma, w=torch.empty(rows, H, dk, **f32), u=torch.empty(rows, H, dv, **f32),
                     qg=torch.empty(rows, H, dk, **f32), kd=torch.empty(rows, H, dk, **f32),
                     aqk=torch.empty(rows, H, chunk, **f32))
    _kda_chunk_intra_kernel[(n_chunks, H)](
        q, k, v, beta, gamma, f.w, f.u, f.qg, f.kd, f.aqk, T,
        H=H, DK=dk, DV=dv, BT=chunk, BC=SUB_CHUNK, BK3=16, BKD=min(dk, 32), DOT=precision,
        num_warps=num_warps, num_stages=num_stages)
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
def _kda_chunk_intra_kernel(q_ptr, k_ptr, v_ptr, beta_ptr, gamma_ptr,
                            w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, T,
                            H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr,
                            BC: tl.constexpr, BK3: tl.constexpr, BKD: tl.constexpr, DOT: tl.constexpr):
    """One (chunk, head): rows are taken BC at a time (sub-block R), in order, because row block R
    of U = Tm V_β needs the finished U of the blocks before it (block forward substitution):

        (I - A_RR) U_R = V_β,R + Σ_{Q<R} A_RQ U_Q,   and the same for W with K_β ⊙ exp(Γ).

    A_RQ for Q < R is a product of two factors decayed to the row just before block R, so both
    exponents are <= 0; the diagonal block A_RR is summed per key channel from exp(Γ_r - Γ_s),
    masked before exponentiating, so it is exact for any g <= 0.
    """
    c = tl.program_id(0)
    h = tl.program_id(1)
    NC: tl.constexpr = BT // BC
    rc = tl.arange(0, BC)
    ik = tl.arange(0, DK)
    iv = tl.arange(0, DV)
    ic = tl.arange(0, BK3)
    id_ = tl.arange(0, BKD)
    lower = rc[:, None] > rc[None, :]
    lower_incl = rc[:, None] >= rc[None, :]
    chunk0 = c * BT
    gamma_last = tl.load(gamma_ptr + ((chunk0 + BT - 1).to(tl.int64) * H + h) * DK + ik)
    for R in range(NC):
        rows = (chunk0 + R * BC + rc).to(tl.int64)
        valid = rows < T
        key_off = (rows[:, None] * H + h) * DK + ik[None, :]
        gam = tl.load(gamma_ptr + key_off)
        kx = tl.load(k_ptr + key_off, mask=valid[:, None], other=0.0).to(tl.float32)
        qx = tl.load(q_ptr + key_off, mask=valid[:, None], other=0.0).to(tl.float32)
        tl.store(qg_ptr + key_off, qx * tl.exp(gam))
        tl.store(kd_ptr + key_off, kx * tl.exp(gamma_last[None, :] - gam))
        bx = tl.load(beta_ptr + rows * H + h, mask=valid, other=0.0).to(tl.float32)
        rhs_w = kx * bx[:, None] * tl.exp(gam)
        val_off = (rows[:, None] * H + h) * DV + iv[None, :]
        rhs_u = tl.load(v_ptr + val_off, mask=valid[:, None], other=0.0).to(tl.float32) * bx[:, None]

        # Diagonal block, per key channel: A[r, s] = -β_r Σ_i k_r,i k_s,i exp(Γ_r,i - Γ_s,i), s < r.
        a_diag = tl.zeros([BC, BC], dtype=tl.float32)
        aqk_diag = tl.zeros([BC, BC], dtype=tl.float32)
        for i0 in tl.static_range(0, DK, BK3):
            col_off = (rows[:, None] * H + h) * DK + i0 + ic[None, :]
            kc = tl.load(k_ptr + col_off, mask=valid[:, None], other=0.0).to(tl.float32)
            qc = tl.load(q_ptr + col_off, mask=valid[:, None], other=0.0).to(tl.float32)
            gc = tl.load(gamma_ptr + col_off)
            decay = tl.exp(tl.where(lower_incl[:, :, None], gc[:, None, :] - gc[None, :, :], float("-inf")))
            ks = kc[None, :, :] * decay
            a_diag += tl.sum(kc[:, None, :] * ks, axis=2)
            aqk_diag += tl.sum(qc[:, None, :] * ks, axis=2)
        a_diag = tl.where(lower, -bx[:, None] * a_diag, 0.0)
        aqk_diag = tl.where(lower_incl, aqk_diag, 0.0)

        # Earlier blocks, both factors decayed to the reference row just before block R. The key
        # dim is taken BKD at a time: a 16-row tl.dot holds its whole A operand in every warp.
        ref_row = (chunk0 + tl.maximum(R * BC - 1, 0)).to(tl.int64)
        for Q in range(R):
            rows_q = (chunk0 + Q * BC + rc).to(tl.int64)
            a_rq = tl.zeros([BC, BC], dtype=tl.float32)
            aqk_rq = tl.zeros([BC, BC], dtype=tl.float32)
            for i0 in tl.static_range(0, DK, BKD):
                col_r = (rows[:, None] * H + h) * DK + i0 + id_[None, :]
                col_q = (rows_q[:, None] * H + h) * DK + i0 + id_[None, :]
                gamma_ref = tl.load(gamma_ptr + (ref_row * H + h) * DK + i0 + id_)
                to_ref = tl.exp(tl.load(gamma_ptr + col_r) - gamma_ref[None, :])
                from_ref = tl.exp(gamma_ref[None, :] - tl.load(gamma_ptr + col_q))
                k_r = tl.load(k_ptr + col_r, mask=valid[:, None], other=0.0).to(tl.float32) * to_ref
                q_r = tl.load(q_ptr + col_r, mask=valid[:, None], other=0.0).to(tl.float32) * to_ref
                k_q = tl.load(k_ptr + col_q, mask=(rows_q < T)[:, None], other=0.0).to(tl.float32) * from_ref
                a_rq += tl.dot(k_r, tl.trans(k_q), input_precision=DOT)
                aqk_rq += tl.dot(q_r, tl.trans(k_q), input_precision=DOT)
            a_rq = -bx[:, None] * a_rq
            tl.store(aqk_ptr + (rows[:, None] * H + h) * BT + Q * BC + rc[None, :], aqk_rq)
            u_q = tl.load(u_ptr + (rows_q[:, None] * H + h) * DV + iv[None, :], cache_modifier=".cg")
            w_q = tl.load(w_ptr + (rows_q[:, None] * H + h) * DK + ik[None, :], cache_modifier=".cg")
            rhs_u += tl.dot(a_rq, u_q, input_precision=DOT)
            rhs_w += tl.dot(a_rq, w_q, input_precision=DOT)
        tl.store(aqk_ptr + (rows[:, None] * H + h) * BT + R * BC + rc[None, :], aqk_diag)
        for Q in range(R + 1, NC):
            tl.store(aqk_ptr + (rows[:, None] * H + h) * BT + Q * BC + rc[None, :],
                     tl.zeros([BC, BC], dtype=tl.float32))

        # Tm_RR = (I - A_RR)^{-1} by forward substitution: row r = e_r + Σ_{s<r} A[r, s] row s.
        tm = tl.where(rc[:, None] == rc[None, :], 1.0, 0.0)
        for r in tl.static_range(1, BC):
            a_r = tl.sum(tl.where(rc[:, None] == r, a_diag, 0.0), axis=0)
            tm = tl.where(rc[:, None] == r, tm + tl.sum(a_r[:, None] * tm, axis=0)[None, :], tm)
        tl.store(u_ptr + val_off, tl.dot(tm, rhs_u, input_precision=DOT))
        tl.store(w_ptr + key_off, tl.dot(tm, rhs_w, input_precision=DOT))
        # The next block reads this block's U and W back.
        tl.debug_barrier()


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

def _check_step(q, k, v, g, beta, state, slots) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [B, H, d_k], got {tuple(q.shape)}")
    B, H, dk = q.shape
    for name, x, shape in (("k", k, (B, H, dk)), ("g", g, (B, H, dk)), ("beta", beta, (B, H))):
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} shape {tuple(x.shape)} does not match q {tuple(q.shape)}: expected {shape}")
    if v.dim() != 3 or tuple(v.shape[:2]) != (B, H):
        raise ValueError(f"v shape {tuple(v.shape)} does not match q {tuple(q.shape)}: expected ({B}, {H}, d_v)")
    dv = v.shape[-1]
    if state.dim() != 4 or tuple(state.shape[1:]) != (H, dk, dv):
        raise ValueError(f"state shape {tuple(state.shape)}: expected (num_slots, {H}, {dk}, {dv})")
    if tuple(slots.shape) != (B,):
        raise ValueError(f"slots shape {tuple(slots.shape)}: expected ({B},)")


def _check_prefill(q, k, v, g, beta, initial_state) -> tuple[int, int, int, int]:
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, d_k], got {tuple(q.shape)}")
    T, H, dk = q.shape
    for name, x, shape in (("k", k, (T, H, dk)), ("g", g, (T, H, dk)), ("beta", beta, (T, H))):
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} shape {tuple(x.shape)} does not match q {tuple(q.shape)}: expected {shape}")
    if v.dim() != 3 or tuple(v.shape[:2]) != (T, H):
        raise ValueError(f"v shape {tuple(v.shape)} does not match q {tuple(q.shape)}: expected ({T}, {H}, d_v)")
    dv = v.shape[-1]
    if T == 0:
        raise ValueError("q has no tokens (T = 0)")
    if initial_state is not None:
        if tuple(initial_state.shape) != (H, dk, dv):
            raise ValueError(f"initial_state shape {tuple(initial_state.shape)}: expected ({H}, {dk}, {dv})")
        if initial_state.dtype != torch.float32:
            raise ValueError(f"initial_state must be fp32, got {initial_state.dtype}")
    return T, H, dk, dv


def _check_pow2(name: str, n: int) -> None:
    if n < 16 or n & (n - 1):
        raise ValueError(f"{name} = {n}: the Triton kernels need a power of two >= 16")


def _initial(initial_state, H, dk, dv, device) -> torch.Tensor:
    if initial_state is None:
        return torch.zeros(H, dk, dv, dtype=torch.float32, device=device)
    return initial_state.float().clone()


def _stack_boundaries(saved, block, H, dk, dv, device) -> torch.Tensor | None:
    if block is None:
        return None
    if not saved:
        return torch.empty(0, H, dk, dv, dtype=torch.float32, device=device)
    return torch.stack(saved)

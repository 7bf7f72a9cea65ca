"""Decode-step kernels for fastdecode.py (to be merged into kernels.py). Twins: model_glm.hc_pre /
hc_post (mHC, spec glm53.md §4.2), model_glm's KDA input and output code (§4.3)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


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


# ================================================================ mHC (§4.2)
# hc_pre for B rows of streams X [B, hc, D]: m = (X_flat · fnᵀ) · r with r = rsqrt(mean(X_flat²) + eps),
# then pre / post / the Sinkhorn matrix C from m, u = Σ_i pre_i X_i rounded to X's dtype, and the
# sub-layer's RMSNorm of u. Two launches: `_hc_mix_kernel` splits the 16384-long dot products over
# programs (partial sums in a buffer, added in a fixed order: deterministic); `_hc_pre_kernel` does
# the rest, one program per row. `_hc_post_kernel`: X'_j = post_j y + Σ_i C[i, j] X_i.

HC_MIX_BLOCK = 256


@triton.jit
def _hc_mix_kernel(x_ptr, fn_ptr, part_ptr, sq_ptr, n_in, n_out, S, NP: tl.constexpr, BK: tl.constexpr):
    b = tl.program_id(0)
    s = tl.program_id(1)
    k = s * BK + tl.arange(0, BK)
    inside = k < n_in
    x = tl.load(x_ptr + b * n_in + k, mask=inside, other=0.0).to(tl.float32)
    o = tl.arange(0, NP)
    fn = tl.load(fn_ptr + o[:, None] * n_in + k[None, :], mask=(o[:, None] < n_out) & inside[None, :], other=0.0)
    tl.store(part_ptr + (b * S + s) * NP + o, tl.sum(fn * x[None, :], axis=1))
    tl.store(sq_ptr + b * S + s, tl.sum(x * x, axis=0))


@triton.jit
def _hc_pre_kernel(x_ptr, part_ptr, sq_ptr, base_ptr, scale_ptr, norm_ptr, u_ptr, out_ptr, post_ptr, c_ptr,
                   D, S, rms_eps, hc_eps, iters,
                   HC: tl.constexpr, NP: tl.constexpr, SP: tl.constexpr, BD: tl.constexpr):
    b = tl.program_id(0)
    s = tl.arange(0, SP)
    on = s < S
    row = (b * S + s) * NP
    r = 1.0 / tl.sqrt(tl.sum(tl.load(sq_ptr + b * S + s, mask=on, other=0.0), axis=0) / (HC * D) + rms_eps)
    i = tl.arange(0, HC)
    ij = i[:, None] * HC + i[None, :]
    m_pre = tl.sum(tl.load(part_ptr + row[:, None] + i[None, :], mask=on[:, None], other=0.0), axis=0) * r
    m_post = tl.sum(tl.load(part_ptr + row[:, None] + HC + i[None, :], mask=on[:, None], other=0.0), axis=0) * r
    m_c = tl.sum(tl.load(part_ptr + row[:, None, None] + 2 * HC + ij[None, :, :], mask=on[:, None, None],
                         other=0.0), axis=0) * r
    pre = tl.sigmoid(tl.load(scale_ptr) * m_pre + tl.load(base_ptr + i)) + hc_eps
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
    # u in X's dtype, then RMSNorm(u) · weight (model_glm.rms_norm's roundings).
    acc = tl.zeros([BD], tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        inside = d < D
        X = tl.load(x_ptr + b * HC * D + i[:, None] * D + d[None, :], mask=inside[None, :], other=0.0)
        u = _cast(tl.sum(pre[:, None] * X.to(tl.float32), axis=0), u_ptr.dtype.element_ty)
        tl.store(u_ptr + b * D + d, u, mask=inside)
        acc += u.to(tl.float32) * u.to(tl.float32)
    rs = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / D + rms_eps)
    tl.debug_barrier()
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        inside = d < D
        u = tl.load(u_ptr + b * D + d, mask=inside, other=0.0).to(tl.float32)
        y = _cast(u * rs, u_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(norm_ptr + d, mask=inside, other=0.0).to(tl.float32)
        tl.store(out_ptr + b * D + d, _cast(w * y, out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _hc_post_kernel(x_ptr, y_ptr, post_ptr, c_ptr, out_ptr, D, HC: tl.constexpr, BD: tl.constexpr):
    b = tl.program_id(0)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    inside = d < D
    i = tl.arange(0, HC)
    X = tl.load(x_ptr + b * HC * D + i[:, None] * D + d[None, :], mask=inside[None, :], other=0.0).to(tl.float32)
    C = tl.load(c_ptr + b * HC * HC + i[:, None] * HC + i[None, :])  # [source i, destination j]
    mixed = tl.sum(C[:, :, None] * X[:, None, :], axis=0)
    y = tl.load(y_ptr + b * D + d, mask=inside, other=0.0).to(tl.float32)
    out = tl.load(post_ptr + b * HC + i)[:, None] * y[None, :] + mixed
    tl.store(out_ptr + b * HC * D + i[:, None] * D + d[None, :], _cast(out, out_ptr.dtype.element_ty), mask=inside[None, :])


def hc_pre(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm: torch.Tensor,
           rms_eps: float, hc_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """model_glm.hc_pre followed by rms_norm(u, norm): X [B, hc, D] -> (x [B, D], post [B, hc] fp32,
    C [B, hc, hc] fp32). fn [3hc + hc², hc·D] fp32, base [3hc + hc²] and scale [3] fp32."""
    B, hc, D = X.shape
    n_in, n_out = hc * D, 2 * hc + hc * hc
    if tuple(fn.shape) != (n_out, n_in) or fn.dtype != torch.float32 or not fn.is_contiguous():
        raise ValueError(f"hc_pre: fn must be contiguous fp32 ({n_out}, {n_in}), got {fn.dtype} {tuple(fn.shape)}")
    if hc & (hc - 1):
        raise ValueError(f"hc_pre: hc_mult {hc} must be a power of two")
    X = X.contiguous()
    S = triton.cdiv(n_in, HC_MIX_BLOCK)
    NP = triton.next_power_of_2(n_out)
    part = torch.empty(B, S, NP, dtype=torch.float32, device=X.device)
    sq = torch.empty(B, S, dtype=torch.float32, device=X.device)
    _hc_mix_kernel[(B, S)](X, fn, part, sq, n_in, n_out, S, NP=NP, BK=HC_MIX_BLOCK)
    u = torch.empty(B, D, dtype=X.dtype, device=X.device)
    x = torch.empty(B, D, dtype=torch.promote_types(norm.dtype, X.dtype), device=X.device)
    post = torch.empty(B, hc, dtype=torch.float32, device=X.device)
    C = torch.empty(B, hc, hc, dtype=torch.float32, device=X.device)
    _hc_pre_kernel[(B,)](X, part, sq, base.float().contiguous(), scale.float().contiguous(), norm, u, x, post, C,
                         D, S, rms_eps, hc_eps, iters, HC=hc, NP=NP, SP=triton.next_power_of_2(S),
                         BD=min(1024, triton.next_power_of_2(D)))
    return x, post, C


def hc_post(X: torch.Tensor, y: torch.Tensor, post: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    """model_glm.hc_post: X [B, hc, D], y [B, D], post [B, hc], C [B, hc, hc] -> X' in X's dtype."""
    B, hc, D = X.shape
    if tuple(y.shape) != (B, D):
        raise ValueError(f"hc_post: y must be ({B}, {D}), got {tuple(y.shape)}")
    X, y = X.contiguous(), y.contiguous()
    out = torch.empty_like(X)
    BD = min(512, triton.next_power_of_2(D))
    _hc_post_kernel[(B, triton.cdiv(D, BD))](X, y, post.contiguous(), C.contiguous(), out, D, HC=hc, BD=BD)
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


def kda_decode_inputs(pre_conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor], conv_state: torch.Tensor,
                      slots: torch.Tensor, conv_w: torch.Tensor, f: torch.Tensor, A_log: torch.Tensor,
                      dt_bias: torch.Tensor, b: torch.Tensor, lower_bound: float, H: int, d: int
                      ) -> tuple[torch.Tensor, ...]:
    """§4.3.2-4.3.5 for one token of B sequences: short conv + SiLU over the slot's window (updating
    conv_state [slots, 3, K-1, H·d] in place), q and k L2-normalized (q also · d^-1/2), the gate g
    and β. pre_conv: q̃, k̃, ṽ [B, H·d]; conv_w [3, H·d, K]; f [B, H·d] (f_b's output); A_log [H] and
    dt_bias [H·d] fp32; b [B, H] (b_proj's output). Returns q, k, v, g [B, H, d] and β [B, H], fp32."""
    B, HD = pre_conv[0].shape[0], H * d
    for name, t in zip("qkv", pre_conv):
        _rows(t, f"kda_decode_inputs: {name}", B, HD)
    if pre_conv[0].stride(0) != pre_conv[1].stride(0) or pre_conv[0].stride(0) != pre_conv[2].stride(0):
        raise ValueError("kda_decode_inputs: q, k, v must share a row stride")
    _rows(f, "kda_decode_inputs: f", B, HD)
    _rows(b, "kda_decode_inputs: b", B, H)
    K = conv_w.shape[-1]
    if tuple(conv_state.shape[1:]) != (3, K - 1, HD) or conv_state.stride(-1) != 1:
        raise ValueError(f"kda_decode_inputs: conv_state must be (slots, 3, {K - 1}, {HD}), got {tuple(conv_state.shape)}")
    if tuple(conv_w.shape) != (3, HD, K) or not conv_w.is_contiguous():
        raise ValueError(f"kda_decode_inputs: conv_w must be contiguous (3, {HD}, {K}), got {tuple(conv_w.shape)}")
    q, k, v, g = (torch.empty(B, H, d, dtype=torch.float32, device=f.device) for _ in range(4))
    beta = torch.empty(B, H, dtype=torch.float32, device=f.device)
    _kda_inputs_kernel[(B, H)](
        *pre_conv, pre_conv[0].stride(0), conv_state, slots.contiguous(), conv_w, f, f.stride(0),
        A_log.float().contiguous(), dt_bias.float().contiguous(), b, b.stride(0), q, k, v, g, beta,
        lower_bound, d ** -0.5, conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        H=H, DH=d, KW=K, KP=triton.next_power_of_2(K))
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

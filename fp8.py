"""FP8 block-128 linear weights: the format of the official GLM-5.3-Flash checkpoint (spec glm53.md §3).

A weight [out, in] is stored as float8_e4m3fn plus one fp32 `weight_scale_inv` per 128 x 128
block, [ceil(out/128), ceil(in/128)], which multiplies:

    W[i, j] = float(W_fp8[i, j]) * scale_inv[i // 128, j // 128]

`FP8Linear` keeps it that way in memory (1 byte per weight instead of 2) and is called like a
function, y = lin(x). On CPU it dequantizes and multiplies (the slow twin); on CUDA, up to 16 rows
go through `kernels.fp8_gemv` (dequantizing in registers: torch's scaled matmul is slower than a
bf16 GEMV at batch 1, performance.md §11.1), more rows dequantize the weight in one pass
(`kernels.fp8_dequantize`, this file's `dequantize_fp8_block` without the fp32 copy) and use cuBLAS.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_RULES = ("amax", "pow2")


def scale_grid(out_f: int, in_f: int) -> tuple[int, int]:
    """The shape of `weight_scale_inv` for a weight [out, in]: one per 128 x 128 block."""
    return -(-out_f // BLOCK), -(-in_f // BLOCK)


def _expand(scale_inv: torch.Tensor, out_f: int, in_f: int) -> torch.Tensor:
    """The per-block factor repeated over its block, cut to [out, in]."""
    return scale_inv.repeat_interleave(BLOCK, 0)[:out_f].repeat_interleave(BLOCK, 1)[:, :in_f]


def quantize_fp8_block(w: torch.Tensor, scale_rule: str = "amax") -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] (any float dtype) -> (float8_e4m3fn [out, in], scale_inv fp32 [ceil(out/128), ceil(in/128)]).

    scale_rule "amax": scale_inv = amax / 448, so each block's largest |w| lands on 448 (how the
    official checkpoint is made). "pow2": the smallest power of two >= amax / 448, so dequantizing
    is a pure exponent shift (exact in any float format) at the cost of up to one bit of range.
    An all-zero block gets scale 1. Values round to nearest even.
    """
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"weight must be a float [out, in] matrix, got {w.dtype} {tuple(w.shape)}")
    out_f, in_f = w.shape
    go, gi = scale_grid(out_f, in_f)
    wf = w.float()
    padded = F.pad(wf, (0, gi * BLOCK - in_f, 0, go * BLOCK - out_f))
    amax = padded.view(go, BLOCK, gi, BLOCK).abs().amax(dim=(1, 3))
    if not torch.isfinite(amax).all():
        raise ValueError("weight holds inf or NaN: FP8 cannot represent it")
    ratio = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    if scale_rule == "pow2":
        mantissa, exponent = torch.frexp(ratio)  # ratio = mantissa * 2^exponent, mantissa in [0.5, 1)
        ratio = torch.ldexp(torch.where(mantissa == 0.5, 0.5, 1.0), exponent)
    q = (wf / _expand(ratio, out_f, in_f)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, ratio.contiguous()


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W = W_fp8 * scale_inv per block, computed in fp32 and rounded once to `dtype`."""
    out_f, in_f = weight.shape
    if out_f % BLOCK == 0 and in_f % BLOCK == 0:
        # the block grid as broadcast axes: no full-size copies of the scales (prefill dequantizes
        # every core weight once per chunk; the lm_head's expanded scales alone would be 2.5 GB)
        go, gi = out_f // BLOCK, in_f // BLOCK
        w = weight.reshape(go, BLOCK, gi, BLOCK).float() * scale_inv.float()[:, None, :, None]
        return w.to(dtype).reshape(out_f, in_f)
    return (weight.float() * _expand(scale_inv.float(), out_f, in_f)).to(dtype)


@dataclass
class FP8Linear:
    """y = x W^T for an FP8 block-128 weight [out, in] (the checkpoint's `weight` and `weight_scale_inv`)."""

    weight: torch.Tensor
    scale_inv: torch.Tensor
    name: str = ""

    def __post_init__(self) -> None:
        label = self.name or "FP8Linear"
        if self.weight.dim() != 2 or self.weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{label}.weight must be float8_e4m3fn [out, in], got "
                             f"{self.weight.dtype} {tuple(self.weight.shape)}")
        self.out_features, self.in_features = self.weight.shape
        grid = scale_grid(self.out_features, self.in_features)
        if tuple(self.scale_inv.shape) != grid:
            raise ValueError(f"{label}.weight_scale_inv has shape {tuple(self.scale_inv.shape)}, weight "
                             f"{tuple(self.weight.shape)} needs {grid} (one per 128 x 128 block)")
        self.scale_inv = self.scale_inv.float()

    @classmethod
    def from_weight(cls, w: torch.Tensor, scale_rule: str = "amax", name: str = "") -> "FP8Linear":
        """Quantize a dense [out, in] weight at load time (`quantize_fp8_block`)."""
        return cls(*quantize_fp8_block(w, scale_rule), name=name)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Checkpoint suffixes: `<name>.weight` and `<name>.weight_scale_inv`."""
        return {"weight": self.weight, "weight_scale_inv": self.scale_inv}

    def to(self, device: torch.device | str) -> "FP8Linear":
        return FP8Linear(self.weight.to(device), self.scale_inv.to(device), self.name)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_fp8_block(self.weight, self.scale_inv, dtype)

    def nbytes(self) -> int:
        return self.weight.numel() + 4 * self.scale_inv.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self.name or 'FP8Linear'}: input shape {tuple(x.shape)} does not match "
                             f"in_features {self.in_features} (weight {tuple(self.weight.shape)})")
        rows = x.reshape(-1, self.in_features)
        y = self._forward_cuda(rows) if rows.is_cuda else rows.float() @ self.dequantize().T
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        import kernels  # the Triton kernels exist only where there is a GPU

        dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        if x.shape[0] <= kernels.FP8_GEMV_ROWS:
            return kernels.fp8_gemv(x.to(dtype), self.weight, self.scale_inv)
        return F.linear(x.to(dtype), kernels.fp8_dequantize(self.weight, self.scale_inv, dtype))

"""Triton kernels against their torch twins: EXL3 (exl3_kernels.py; exllamav3's golden outputs and exl3.py), KDA
(kda_kernels.py; model_glm.kda_recurrent), FP8 block-128 (fp8.py).

On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py), so shapes stay tiny there;
the larger cases run only on a GPU.
"""
import math

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import exl3
import exl3_kernels
import fp8
import kda_kernels
import kernels
from bench import kda_twin, rel_err
from model_glm import kda_recurrent

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="large shapes only on a GPU")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONFIGS = [f"K{k}_{cb}" for k in range(1, 9) for cb in exl3_kernels.CODEBOOKS] + [
    "K1p5_mul1", "K2p5_mul1", "K3p5_mul1"]
# Every K and every codebook at least once. Launch shapes (block_n, row_tiles, split_k) vary to cover
# one and several programs per 128-column block; large row_tiles keep the interpreter's loop short.
GEMV_CASES = [("K1_3inst", 128, 16, None), ("K2_mcg", 64, 16, None), ("K3_mul1", 128, 8, 2),
              ("K4_3inst", 128, 16, None), ("K5_mcg", 128, 8, 2), ("K6_mul1", 64, 16, None),
              ("K7_3inst", 128, 16, None), ("K8_mcg", 128, 8, 2), ("K1p5_mul1", 128, 16, None),
              ("K2p5_mul1", 128, 16, None), ("K3p5_mul1", 128, 8, 2), ("K4_mul1", 32, 16, None),
              # default launch settings: half rates with several rows went wrong here on the H200
              ("K2p5_mul1", 128, 1, None), ("K3p5_mul1", 128, 1, None), ("K1p5_mul1", 128, 1, None)]

@pytest.fixture(scope="module")
def golden(fixtures_dir):
    return np.load(fixtures_dir / "exl3" / "exl3_golden.npz")


def _golden(golden, config: str, name: str) -> torch.Tensor:
    return torch.from_numpy(golden[f"{config}.{name}"]).to(DEVICE)


def _random_linear(k: int, n: int, width: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    trellis = torch.randint(-2**15, 2**15, (k // 16, n // 16, width), generator=g, dtype=torch.int32)
    # General fp16 factors of both signs (spec §4: never assume ±1).
    suh = (torch.rand(k, generator=g) * 0.1 + 0.01) * (torch.randint(0, 2, (k,), generator=g) * 2 - 1)
    svh = (torch.rand(n, generator=g) * 0.1 + 0.01) * (torch.randint(0, 2, (n,), generator=g) * 2 - 1)
    return (trellis.to(torch.int16).to(DEVICE), suh.half().to(DEVICE), svh.half().to(DEVICE))


def _random_experts(E: int, D: int, I: int, width: int, g: torch.Generator) -> list[tuple]:
    """gate, up (D -> I) and down (I -> D) of E random experts, each (trellis, suh, svh) stacked over them."""
    projections = []
    for k, n in ((D, I), (D, I), (I, D)):
        parts = [_random_linear(k, n, width, seed=int(torch.randint(0, 1 << 30, (1,), generator=g))) for _ in range(E)]
        projections.append(tuple(torch.stack(t) for t in zip(*parts)))
    return projections


def _random_x(m: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).half().to(DEVICE)


@pytest.mark.parametrize("config", CONFIGS)
def test_decode_is_bit_exact_against_exllamav3(golden, config):
    trellis = _golden(golden, config, "trellis")
    out = torch.full((256, 256), float("nan"), dtype=torch.float16, device=DEVICE)
    exl3_kernels.exl3_decode(trellis, config.split("_")[1], out=out)
    inner = _golden(golden, config, "inner")
    mismatches = (out.view(torch.int16) != inner.view(torch.int16)).sum().item()
    assert mismatches == 0, f"{config}: {mismatches} of 65536 values differ from exllamav3's reconstruct"


@triton.jit
def _identity_times_tiles_kernel(words_ptr, eye_ptr, out_ptr, k, n, K2: tl.constexpr, CB: tl.constexpr,
                                 RT: tl.constexpr, BM: tl.constexpr):
    # out[BM rows, 128-column block] = (I · Ŵ)[those rows] through the decode that feeds tl.dot in the
    # MoE prefill (_lane_words, _load_step, _decoded_tiles): each sum has one nonzero product, w · 1.
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    acc = exl3_kernels._prefill_products(words_ptr, eye_ptr + tl.program_id(1) * BM * k, (rows < k)[None, :], k, n,
                                    tl.program_id(0), K2, CB, RT, BM)
    cols = tl.program_id(0) * 128 + tl.arange(0, 128)
    tl.store(out_ptr + rows[None, :] * n + cols[:, None], acc)


# The decode paths of each rate: two words per lane (K <= 3), realigned words, lane-independent offsets.
@pytest.mark.parametrize("config", ["K1_mcg", "K1p5_mul1", "K2_3inst", "K2p5_mul1", "K3_mcg", "K3p5_mul1",
                                    "K4_mcg", "K5_3inst", "K6_mul1", "K7_mcg", "K8_3inst"])
def test_decoded_tiles_are_bit_exact_against_exllamav3(golden, config):
    trellis = _golden(golden, config, "trellis")
    codebook = config.split("_")[1]
    k2 = exl3_kernels.trellis_k2(trellis, codebook)
    eye = torch.eye(256, dtype=torch.float16, device=DEVICE)
    out = torch.full((256, 256), float("nan"), dtype=torch.float32, device=DEVICE)
    _identity_times_tiles_kernel[(2, 2)](trellis.contiguous().view(torch.int32), eye, out, 256, 256, K2=k2,
                                         CB=exl3_kernels.CODEBOOKS.index(codebook), RT=2, BM=128, num_warps=8)
    inner = _golden(golden, config, "inner").float()
    mismatches = (out != inner).sum().item()  # values, not bits: a zero weight may come out as +0 or -0
    assert mismatches == 0, f"{config}: {mismatches} of 65536 decoded weights differ from exllamav3's reconstruct"


@pytest.mark.parametrize("config,block_n,row_tiles,split_k", GEMV_CASES)
def test_gemv_matches_exllamav3_batch4(golden, config, block_n, row_tiles, split_k):
    x = _golden(golden, config, "x4")
    out = torch.full((4, 256), float("nan"), dtype=torch.float16, device=DEVICE)
    exl3_kernels.exl3_gemv(x, _golden(golden, config, "trellis"), _golden(golden, config, "suh"),
                      _golden(golden, config, "svh"), config.split("_")[1], out=out,
                      block_n=block_n, row_tiles=row_tiles, split_k=split_k)
    assert torch.isfinite(out).all(), "some outputs were not written"
    err = rel_err(out, _golden(golden, config, "y4"))
    assert err <= 1e-3, f"{config}: relative error {err:.2e} against exllamav3's y4"


def test_gemv_split_buffers_are_left_clean(golden):
    # The split-k rows and arrival counters live in reused buffers; a second call must not see the first's.
    config = "K3_mcg"
    args = [_golden(golden, config, name) for name in ("trellis", "suh", "svh")]
    x = _random_x(2, 256, seed=1)
    first = exl3_kernels.exl3_gemv(x, *args, "mcg", block_n=64, row_tiles=8, split_k=2)
    second = exl3_kernels.exl3_gemv(x, *args, "mcg", block_n=64, row_tiles=8, split_k=2)
    assert rel_err(second, first) <= 1e-6


@pytest.mark.parametrize("width,codebook", [(48, "3inst"), (32, "mcg"), (56, "mul1"), (128, "mul1")])
def test_decode_matches_torch_twin(width, codebook):
    trellis, _, _ = _random_linear(256, 384, width, seed=width)
    out = torch.full((256, 384), float("nan"), dtype=torch.float16, device=DEVICE)
    exl3_kernels.exl3_decode(trellis, codebook, out=out)
    assert torch.equal(out.view(torch.int16), exl3.unpack(trellis, codebook).view(torch.int16))


@pytest.mark.parametrize("m,width,codebook,split_k", [(3, 64, "mcg", 2), (1, 40, "mul1", 1),
                                                      (8, 48, "3inst", 1)])
def test_gemv_matches_torch_twin(m, width, codebook, split_k):
    trellis, suh, svh = _random_linear(128, 256, width, seed=m)
    x = _random_x(m, 128, seed=m + 10)
    out = torch.full((m, 256), float("nan"), dtype=torch.float16, device=DEVICE)
    exl3_kernels.exl3_gemv(x, trellis, suh, svh, codebook, out=out, row_tiles=8 // split_k, split_k=split_k)
    assert torch.isfinite(out).all(), "some outputs were not written"
    ref = x.float() @ exl3.dequantize(trellis, suh, svh, codebook).float()
    err = rel_err(out, ref)
    assert err <= 1e-3, f"relative error {err:.2e} against x @ exl3.dequantize"


def test_gemv_more_rows_than_one_launch_takes():
    trellis, suh, svh = _random_linear(128, 128, 32, seed=5)
    x = _random_x(2 * exl3_kernels.GEMV_ROWS + 1, 128, seed=6)
    y = exl3_kernels.exl3_gemv(x, trellis, suh, svh, "mul1", row_tiles=8)
    ref = x.float() @ exl3.dequantize(trellis, suh, svh, "mul1").float()
    assert rel_err(y, ref) <= 1e-3


@needs_gpu
@pytest.mark.parametrize("k,n,width,codebook", [(4096, 2048, 64, "mcg"), (2048, 4096, 48, "3inst"),
                                                (4096, 12288, 48, "mul1")])
def test_large_shapes_on_gpu(k, n, width, codebook):
    trellis, suh, svh = _random_linear(k, n, width, seed=k + n)
    inner = exl3.unpack(trellis, codebook)
    assert torch.equal(exl3_kernels.exl3_decode(trellis, codebook).view(torch.int16), inner.view(torch.int16))
    w = exl3.dequantize(trellis, suh, svh, codebook).float()
    for m in (1, 8):
        x = _random_x(m, k, seed=m)
        ref = x.float() @ w
        for _ in range(3):  # repeated calls: a moving error would mean a split-k race
            out = torch.full((m, n), float("nan"), dtype=torch.float16, device=DEVICE)
            exl3_kernels.exl3_gemv(x, trellis, suh, svh, codebook, out=out)
            err = rel_err(out, ref)
            assert err <= 1e-3, f"m={m}: relative error {err:.2e}"


def test_bad_input_is_named():
    trellis = torch.zeros(8, 8, 48, dtype=torch.int16, device=DEVICE)
    with pytest.raises(ValueError, match="codebook"):
        exl3_kernels.exl3_decode(trellis, "qtip")
    with pytest.raises(ValueError, match="last dim 20"):
        exl3_kernels.exl3_decode(torch.zeros(8, 8, 20, dtype=torch.int16), "mcg")
    with pytest.raises(ValueError, match="half-integer"):
        exl3_kernels.exl3_decode(torch.zeros(8, 8, 40, dtype=torch.int16), "mcg")
    x = torch.zeros(1, 64, dtype=torch.float16, device=DEVICE)
    suh = torch.ones(128, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match=r"\[m, 128\].*\(1, 64\)"):
        exl3_kernels.exl3_gemv(x, trellis, suh, suh, "3inst")


# ---------------------------------------------------------------- KDA recurrence

def _l2(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _inputs(lead, H, dk, dv, seed):
    """Realistic KDA inputs: L2-normed k, normed and scaled q, gates in (-5, 0), beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = _l2(torch.randn(*lead, H, dk, generator=gen)) * dk ** -0.5
    k = _l2(torch.randn(*lead, H, dk, generator=gen))
    v = torch.randn(*lead, H, dv, generator=gen)
    g = -5 * torch.sigmoid(2 * torch.randn(*lead, H, dk, generator=gen))
    beta = torch.sigmoid(torch.randn(*lead, H, generator=gen))
    return tuple(x.to(DEVICE) for x in (q, k, v, g, beta))


def step_twin(q, k, v, g, beta, pool, slots):
    """model_glm.kda_recurrent one sequence at a time on pool rows `slots` (updated in place)."""
    outs = []
    for b, slot in enumerate(slots.tolist()):
        o, pool[slot] = kda_recurrent(*(x[b:b + 1].float() for x in (q, k, v, g, beta)), pool[slot])
        outs.append(o[0])
    return torch.stack(outs).to(q.dtype)




# On the GPU the prefill kernels' tl.dot runs fp32 products as tf32x3 (kda_kernels.DOT_PRECISION; H200:
# 1.5e-6 relative at T = 8192); the interpreter computes them in exact fp32. Decode has no tl.dot.
PREFILL_REL = 1e-4


def _close(actual, expected, what, rel=1e-4):
    scale = expected.abs().max().item()
    err = (actual.float() - expected.float()).abs().max().item()
    assert err <= rel * scale + 1e-6, f"{what}: max error {err:.3g} vs max |expected| {scale:.3g}"


def test_step_matches_twin_and_touches_only_its_slots():
    H, dk, dv = 2, 16, 32
    gen = torch.Generator().manual_seed(1)
    pool = torch.randn(6, H, dk, dv, generator=gen).to(DEVICE)
    pool_ref = pool.clone()
    slots = torch.tensor([4, 0, 3], device=DEVICE)
    for step in range(2):  # the second token reads the state the first one wrote
        q, k, v, g, beta = _inputs((3,), H, dk, dv, seed=10 + step)
        o = kda_kernels.kda_recurrent_step(q, k, v, g, beta, pool, slots, block_v=16)
        o_ref = step_twin(q, k, v, g, beta, pool_ref, slots)
        _close(o, o_ref, f"o at step {step}")
        _close(pool, pool_ref, f"state pool at step {step}")
    untouched = [1, 2, 5]
    before = torch.randn(6, H, dk, dv, generator=torch.Generator().manual_seed(1))
    assert torch.equal(pool[untouched].cpu(), before[untouched])


@pytest.mark.parametrize("T, chunk, dk, dv, with_init, block", [
    (70, 16, 16, 32, True, 32),    # crosses chunks, T not a multiple of the chunk, boundary states
    (70, 64, 32, 16, False, None),  # one full and one partial chunk of 64 (four sub-blocks each)
    (64, 32, 16, 16, True, 32),    # T a multiple of block: the final state is a boundary too
    (5, 32, 16, 16, True, None),   # shorter than one sub-block
])
def test_prefill_matches_recurrence(T, chunk, dk, dv, with_init, block):
    H = 2
    q, k, v, g, beta = _inputs((T,), H, dk, dv, seed=T + chunk)
    S0 = torch.randn(H, dk, dv).to(DEVICE) if with_init else None
    after = range(block, T + 1, block) if block else ()
    o, final, states = kda_kernels.kda_chunk_prefill(q, k, v, g, beta, S0, chunk=chunk, after=after, block_v=16)
    o_ref, final_ref, states_ref = kda_twin(q, k, v, g, beta, S0, block=block)
    _close(o, o_ref, "o", PREFILL_REL)
    _close(final, final_ref, "final state", PREFILL_REL)
    _, _, end = kda_kernels.kda_chunk_prefill(q, k, v, g, beta, S0, chunk=chunk, after=[T], block_v=16)
    assert torch.equal(end[0], final)  # after T tokens, a multiple of chunk or not: the final state
    if block is None:
        assert states is None and states_ref is None
    else:
        assert states.shape == states_ref.shape == (T // block, H, dk, dv)
        _close(states, states_ref, "boundary states", PREFILL_REL)


@pytest.mark.parametrize("chunk", [32, 64])  # 64: three row blocks of Tm's block formula, one of padding
def test_prefill_hard_inputs(chunk):
    """Strongest decay (g near -5: exp(Γ) underflows within a chunk), slow decay on other channels,
    nearly identical keys with β near 1 (the triangular solve is least benign)."""
    T, H, d = 40, 2, 16
    q, k, v, g, beta = _inputs((T,), H, d, d, seed=7)
    g[:, :, : d // 2] = -4.999
    g[:, :, d // 2:] = -1e-3
    k = _l2(k[:1] + 0.05 * k)
    beta = torch.full_like(beta, 0.999)
    o, final, _ = kda_kernels.kda_chunk_prefill(q, k, v, g, beta, None, chunk=chunk)
    o_ref, final_ref, _ = kda_twin(q, k, v, g, beta, None)
    assert torch.isfinite(o).all()
    _close(o, o_ref, "o", PREFILL_REL)
    _close(final, final_ref, "final state", PREFILL_REL)


def test_bf16_inputs_give_bf16_output():
    """The model may hand over bf16 q, k, v: kernels compute in fp32 and round only o."""
    q, k, v, g, beta = _inputs((20,), 2, 16, 16, seed=9)
    q, k, v = (x.bfloat16() for x in (q, k, v))
    o, final, _ = kda_kernels.kda_chunk_prefill(q, k, v, g, beta, None, chunk=16)
    o_ref, final_ref, _ = kda_twin(q, k, v, g, beta, None)
    assert o.dtype == o_ref.dtype == torch.bfloat16
    _close(final, final_ref, "final state", PREFILL_REL)
    assert (o.float() - o_ref.float()).abs().max() <= 1e-2 * o_ref.float().abs().max()
    pool, pool_ref = torch.zeros(2, 2, 16, 16, device=DEVICE), torch.zeros(2, 2, 16, 16, device=DEVICE)
    slots = torch.tensor([1, 0], device=DEVICE)
    step = kda_kernels.kda_recurrent_step(q[:2], k[:2], v[:2], g[:2], beta[:2], pool, slots)
    step_ref = step_twin(q[:2], k[:2], v[:2], g[:2], beta[:2], pool_ref, slots)
    assert step.dtype == torch.bfloat16
    _close(pool, pool_ref, "state pool")
    assert (step.float() - step_ref.float()).abs().max() <= 1e-2 * step_ref.float().abs().max()


@triton.jit
def _tf32_split_kernel(x_ptr, hi_ptr, lo_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    hi, lo = kernels._tf32_split(tl.load(x_ptr + i))
    tl.store(hi_ptr + i, hi)
    tl.store(lo_ptr + i, lo)


def test_tf32_split_gives_a_tf32_head_and_an_exact_remainder():
    """kernels._dot_tf32x3's operand split: hi must be a TF32 value (its 13 low mantissa bits zero, else
    the tensor cores drop part of it), hi + lo must be x exactly, and |lo| < 2^-10 |x| (what bounds the
    dropped lo·lo). The interpreter's fp32 dot would not notice a wrong split; this does."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, generator=g) * torch.exp2(torch.randint(-60, 60, (1024,), generator=g).float())
    x[:4] = torch.tensor([1.0, -1.0, 1 + 2 ** -10, -(1 + 2 ** -11 + 2 ** -20)])
    x = x.to(DEVICE)
    hi, lo = torch.empty_like(x), torch.empty_like(x)
    _tf32_split_kernel[(1,)](x, hi, lo, N=1024)
    assert ((hi.view(torch.int32) & 0x1FFF) == 0).all()
    assert torch.equal(hi.double() + lo.double(), x.double())
    assert (lo.abs() < 2.0 ** -10 * x.abs()).all()
    assert lo[2] == 0 and lo[3] == -(2 ** -11 + 2 ** -20)


def test_errors_name_the_tensor():
    q, k, v, g, beta = _inputs((8,), 2, 16, 16, seed=0)
    with pytest.raises(ValueError, match="g shape"):
        kda_kernels.kda_chunk_prefill(q, k, v, g[:, :1], beta)
    with pytest.raises(ValueError, match="initial_state shape"):
        kda_kernels.kda_chunk_prefill(q, k, v, g, beta, torch.zeros(2, 16, 8, device=DEVICE))
    with pytest.raises(ValueError, match=r"after \[4, 9\]: each must be T 8 or a positive multiple of chunk 16"):
        kda_kernels.kda_chunk_prefill(q, k, v, g, beta, chunk=16, after=[4, 8, 9])
    with pytest.raises(ValueError, match="state shape"):
        kda_kernels.kda_recurrent_step(q[:2], k[:2], v[:2], g[:2], beta[:2], torch.zeros(4, 2, 16, 8, device=DEVICE),
                                       torch.tensor([0, 1], device=DEVICE))


# ---------------------------------------------------------------- FP8 block-128 GEMV

def _fp8_linear(n: int, k: int, seed: int) -> fp8.FP8Linear:
    g = torch.Generator().manual_seed(seed)
    # Blocks of very different scale, so a wrong block index shows.
    w = torch.randn(n, k, generator=g) * torch.exp(2 * torch.randn(-(-n // 128), 1, -(-k // 128), 1, generator=g)
                                                   ).repeat(1, 128, 1, 128).flatten(0, 1).flatten(1)[:n, :k]
    return fp8.FP8Linear.from_weight(w).to(DEVICE)


@pytest.mark.parametrize("m,n,k,dtype,block_n,split_k,warps,stages", [
    # m <= FP8_FMA_ROWS: the FMA kernel (chunks of 4 * warps k blocks)
    (1, 203, 384, torch.bfloat16, 8, None, 1, 1),   # n not a multiple of 8 or 128, k short of one chunk
    (2, 256, 1024, torch.float16, 16, 2, 1, 1),     # whole chunks (no masks), partial sums over 2 splits
    (3, 136, 300, torch.bfloat16, 8, 1, 1, 1),      # k not a multiple of 128, three accumulators
    (3, 128, 1280, torch.bfloat16, 8, 2, 2, 1),     # 2 warps: chunks of 8 blocks, the second partial
    (2, 64, 2048, torch.float16, 16, 1, 4, 1),      # 4 warps: one chunk of 16 blocks
    (1, 128, 2048, torch.bfloat16, 8, 1, 1, 3),     # 4 chunks prefetched through 3 stages
    (1, 72, 640, torch.bfloat16, None, None, None, None),  # one row's defaults (4 warps): k inside one chunk
    # more rows: the tensor-core kernel
    (4, 128, 384, torch.bfloat16, 64, 2, 4, 4),     # the first row count past FP8_FMA_ROWS
    (5, 256, 300, torch.float16, 32, 2, 4, 4),      # k not a multiple of 128, partial sums over splits
    (16, 128, 640, torch.bfloat16, 128, 3, 4, 4),   # uneven split of 5 k blocks, a full 16-row launch
    (17, 64, 256, torch.float16, 16, 1, 4, 4),      # two launches of rows, n below one block
    (18, 200, 512, torch.bfloat16, 64, 4, 4, 4),    # two launches of rows, each adding 4 splits' slabs
])
def test_fp8_gemv_matches_twin(m, n, k, dtype, block_n, split_k, warps, stages):
    lin = _fp8_linear(n, k, seed=m + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).to(DEVICE)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
    kernels.fp8_gemv(x, lin.weight, lin.scale_inv, out=out, block_n=block_n, split_k=split_k, num_warps=warps,
                     num_stages=stages)
    ref = x.float() @ lin.dequantize().T  # the twin before its final rounding
    # Products of e4m3 and bf16/fp16 values are exact in fp32 (and tf32); what is left is the output
    # rounding (2^-8 relative for bf16) and the order of fp32 sums.
    tol = (2 ** -8 if dtype == torch.bfloat16 else 2 ** -11) * ref.abs() + 1e-5 * ref.abs().max()
    assert torch.isfinite(out).all(), "some outputs were not written"
    assert ((out.float() - ref).abs() <= tol).all(), f"max error {(out.float() - ref).abs().max():.3g}"


@pytest.mark.parametrize("m,n,k,block_n,split_k", [(3, 64, 1536, 8, 3), (5, 128, 768, 32, 6)])  # FMA, tensor cores
def test_fp8_gemv_splits_are_deterministic_and_leave_counters_clean(m, n, k, block_n, split_k):
    lin = _fp8_linear(n, k, seed=3)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(DEVICE)
    first = kernels.fp8_gemv(x, lin.weight, lin.scale_inv, block_n=block_n, split_k=split_k)
    assert not kernels._FP8_ARRIVALS[(x.device, n // block_n)].any(), "arrival counters left non-zero"
    # The slabs are added in split order whichever program arrives last (on a GPU that order varies).
    for _ in range(2):
        assert torch.equal(kernels.fp8_gemv(x, lin.weight, lin.scale_inv, block_n=block_n, split_k=split_k), first)


def test_fp8_gemv_bad_input_is_named():
    lin = _fp8_linear(128, 256, seed=0)
    x = torch.zeros(1, 128, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match=r"\[m, 256\].*\(1, 128\)"):
        kernels.fp8_gemv(x, lin.weight, lin.scale_inv)
    with pytest.raises(ValueError, match=r"scale_inv must be fp32 \(1, 2\)"):
        kernels.fp8_gemv(x, lin.weight, lin.scale_inv[:, :1])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        kernels.fp8_gemv(x, lin.dequantize(), lin.scale_inv)
    x = torch.zeros(1, 256, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="block_n must be 8 or 16 for 1 rows"):
        kernels.fp8_gemv(x, lin.weight, lin.scale_inv, block_n=32)
    with pytest.raises(ValueError, match=r"split_k 2 must lie in 1\.\.1 \(the chunks of 4 k blocks\)"):
        kernels.fp8_gemv(x, lin.weight, lin.scale_inv, split_k=2, num_warps=1)


# ---------------------------------------------------------------- EXL3 MoE decode

@pytest.mark.parametrize("m,top_k,k_words,codebook,block_n,row_tiles,scale", [
    (1, 2, 48, "mcg", 64, 8, 4.0),      # batch 1, K3, two programs per 128-column block
    (2, 2, 64, "3inst", 128, 8, 4.0),   # two tokens sharing expert 2, K4
    (1, 2, 64, "mcg", 128, 8, 0.05),    # small activations (down's input ~1e-5): fp16 subnormal range
    (1, 2, 48, "mcg", 64, 2, 4.0),      # 2-tile steps: gate and up take 2 loop steps a program (the others 1)
])
def test_moe_decode_matches_expert_twins(m, top_k, k_words, codebook, block_n, row_tiles, scale):
    from model_glm import swiglu

    E, D, I, limit = 4, 256, 128, 1.0  # a low limit, so both clamps act
    g = torch.Generator().manual_seed(m)
    projections = _random_experts(E, D, I, k_words, g)
    x = (scale * torch.randn(m, D, generator=g)).half().to(DEVICE)
    ids = torch.tensor([[0, 2, 3][:top_k], [2, 1, 0][:top_k]][:m], device=DEVICE)
    route = torch.rand(m, top_k, generator=g).to(DEVICE)
    y = exl3_kernels.exl3_moe_decode(x, ids, route, *projections, codebook, limit, block_n=block_n, row_tiles=row_tiles)
    ref = torch.zeros(m, D, device=DEVICE)
    for t in range(m):
        for j in range(top_k):
            e = int(ids[t, j])
            gate, up, down = (exl3.EXL3Linear(p[0][e], p[1][e], p[2][e], codebook) for p in projections)
            xt = x[t:t + 1].float()
            # EXL3Linear's fp32 torch math on every device (on CUDA its call would run exl3_gemv,
            # whose fp16 outputs would hide the kernel's own precision).
            act = swiglu(gate._forward_torch(xt), up._forward_torch(xt), limit)
            ref[t] += route[t, j] * down._forward_torch(act)[0]
    # Both sides stay in fp32 between projections; the kernel feeds tl.dot fp16 hi and lo parts of
    # each activation (a lo part lost to fp16 subnormals showed here as 2e-2 with scale 0.05).
    assert rel_err(y, ref) <= (1e-5 if DEVICE == "cpu" else 1e-4), f"relative error {rel_err(y, ref):.2e}"
    # The output comes from torch.empty and is zeroed by the first launch: memory an earlier tensor of
    # its size left full of NaN (the allocator hands it out again) must not show.
    junk = torch.full((m, D), float("nan"), device=DEVICE)
    del junk
    again = exl3_kernels.exl3_moe_decode(x, ids, route, *projections, codebook, limit, block_n=block_n,
                                         row_tiles=row_tiles)
    assert rel_err(again, y) <= 1e-6, "the second call sees the first's partial sums, or unzeroed memory"


@needs_gpu
def test_exl3_kernels_give_the_same_bits_every_launch():
    """The K splits' sums and a token's sum over its experts are added in a fixed order: 40 launches of
    one layer (4 tokens, top-8 of 16 experts, 2048 x 1024, several splits a block) give identical bits,
    and so do 10 of exl3_moe_prefill (64 tokens) and 40 of exl3_gemv with 8 splits.
    With atomic adds of the values the order followed the programs' arrival, and runs differed by ulps
    (H200, session 22: the default model's logprobs up to 0.25 apart between two runs of a request)."""
    E, D, I, m, top_k = 16, 2048, 1024, 4, 8
    g = torch.Generator().manual_seed(11)
    projections = _random_experts(E, D, I, 48, g)
    x = (4.0 * torch.randn(m, D, generator=g)).half().to(DEVICE)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(m)]).to(DEVICE)
    route = torch.rand(m, top_k, generator=g).to(DEVICE)
    first = exl3_kernels.exl3_moe_decode(x, ids, route, *projections, "mcg", 10.0)
    for _ in range(40):
        assert torch.equal(exl3_kernels.exl3_moe_decode(x, ids, route, *projections, "mcg", 10.0), first)
    # the prefill's tiles and token sums (pairs sorted by expert), and exl3_gemv's split-k, the same way
    x = (4.0 * torch.randn(64, D, generator=g)).half().to(DEVICE)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(64)]).to(DEVICE)
    route = torch.rand(64, top_k, generator=g).to(DEVICE)
    first = exl3_kernels.exl3_moe_prefill(x, ids, route, *projections, "mcg", 10.0)
    for _ in range(10):
        assert torch.equal(exl3_kernels.exl3_moe_prefill(x, ids, route, *projections, "mcg", 10.0), first)
    x = x[:4]
    trellis, suh, svh = _random_linear(D, I, 48, seed=12)
    first = exl3_kernels.exl3_gemv(x, trellis, suh, svh, "mcg", row_tiles=2, split_k=8)
    for _ in range(40):
        assert torch.equal(exl3_kernels.exl3_gemv(x, trellis, suh, svh, "mcg", row_tiles=2, split_k=8), first)


# ---------------------------------------------------------------- EXL3 MoE prefill

@pytest.mark.parametrize("I", [256, 384])
def test_prefill_swiglu_matches_its_twin_and_puts_each_rows_peak_below_2_to_14(I):
    """The down GEMM's fp16 input from gate's and up's raw products (_prefill_swiglu): per sorted pair, both
    projections (row scale, H128, svh of the pair's expert), the clamped SwiGLU, ⊙ suh_down and H128, then
    fp16 times the power of two that puts the row's largest |value| in [2^13, 2^14). Sorted row 2 is built to
    come out as one value -30 among values in [0, 0.01): a scale from the plain max would overflow fp16 to
    inf. Row 4 is zero (its scale must stay finite); 384 columns leave a padded 128-block."""
    g = torch.Generator().manual_seed(3)
    P, E, limit = 7, 3, 3.0
    order = torch.tensor([3, 0, 6, 1, 5, 2, 4])
    ids = torch.tensor([0, 1, 0, 1, 0, 1, 2])  # sorted row 2 is pair 6: expert 2, whose factors are ones
    factors = [(torch.rand(E, I, generator=g) + 0.5) * torch.sign(torch.randn(E, I, generator=g)) for _ in range(3)]
    for f in factors:
        f[2] = 1.0
    svh_gate, svh_up, suh_down = (f.half() for f in factors)
    inv = 2.0 ** -torch.randint(0, 8, (2, P), generator=g).float()
    gu = torch.randn(2, P, I, generator=g)
    v = 0.01 * torch.rand(I, generator=g)
    v[5] = -30.0
    silu_limit = torch.nn.functional.silu(torch.tensor(limit, dtype=torch.float64))
    gu[0, 2] = ((limit + 1) * 128 ** 0.5 * (torch.arange(I) % 128 == 0) / inv[0, 2]).float()  # gate = limit + 1
    gu[1, 2] = (v.double() / (silu_limit * inv[1, 2])).float()  # up = H(v) / silu(limit)
    gu[0, 4] = 0.0

    e = ids[order].long()
    gate = (exl3.had_right(gu[0] * inv[0, :, None]) * svh_gate[e].float()).clamp(max=limit)
    up = (exl3.had_right(gu[1] * inv[1, :, None]) * svh_up[e].float()).clamp(-limit, limit)
    want = exl3.had_right(torch.nn.functional.silu(gate) * up * suh_down[e].float()).double()
    peak = want.abs().amax(1)
    assert want[2].argmin() == 5 and abs(want[2, 5] + 30) < 1e-3 and want[2].max() < 0.011 and peak[4] == 0

    dev = lambda t: t.to(DEVICE)
    out, out_inv = exl3_kernels._prefill_swiglu(dev(gu), dev(inv), dev(order.int()), dev(ids.int()), dev(svh_gate),
                                                dev(svh_up), dev(suh_down), limit)
    out, out_inv = out.cpu().double(), out_inv.cpu().double()
    assert torch.isfinite(out_inv).all() and (out[4] == 0).all()
    want_inv = 2.0 ** (torch.floor(torch.log2(peak.clamp_min(1e-30))) - 13)
    assert torch.equal(out_inv[peak > 0], want_inv[peak > 0])
    top = out.abs().amax(1)[peak > 0]
    assert ((top >= 2 ** 13) & (top < 2 ** 14)).all()
    # fp16's rounding of each value (2^-11 of the row's peak at most) plus fp32 sums in another order
    assert ((out * out_inv[:, None] - want).abs() <= 2 ** -10 * peak[:, None] + 1e-6).all()


def _stacked_experts(E: int, D: int, I: int, width: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    projections = _random_experts(E, D, I, width, g)
    return projections


def _skewed_routing(m: int, top_k: int, E: int, seed: int):
    # Distinct experts per row, uneven counts: expert 0 takes the most rows, the last expert none.
    g = torch.Generator().manual_seed(seed)
    popularity = torch.tensor([2.0 ** -e for e in range(E - 1)] + [0.0])
    ids = torch.stack([torch.multinomial(popularity, top_k, generator=g) for _ in range(m)])
    return ids.to(DEVICE), torch.rand(m, top_k, generator=g).to(DEVICE)


def _moe_twin(x, ids, route, projections, codebook, limit):
    """Σ_j route · down_e(swiglu(gate_e(x), up_e(x))) per expert with EXL3Linear's fp32 torch math."""
    from model_glm import swiglu

    ref = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        tok, j = (ids == e).nonzero(as_tuple=True)
        gate, up, down = (exl3.EXL3Linear(p[0][e], p[1][e], p[2][e], codebook) for p in projections)
        xt = x[tok].float()
        act = swiglu(gate._forward_torch(xt), up._forward_torch(xt), limit)
        ref.index_add_(0, tok, route[tok, j, None] * down._forward_torch(act))
    return ref


# Activations enter the tensor cores in fp16 (per-row powers of two keep them clear of subnormals):
# ~5e-4 relative against the fp32 twin.
PREFILL_MOE_REL = 2e-3


@pytest.mark.parametrize("width,codebook,block_m,row_tiles,scale,dtype", [
    (48, "3inst", None, 8, 4.0, torch.float16),   # K3; 37 rows x 2 -> block_m 32, one tile an expert
    (64, "mcg", 128, 8, 0.05, torch.bfloat16),    # K4, small activations (down's input ~1e-5), bf16 x, 128-row tiles
    (40, "mul1", 16, 4, 4.0, torch.float16),      # K2.5 (a half rate), 4 k-tiles per step, experts over 2 tiles
    (48, "mcg", 256, 8, 1.0, torch.bfloat16),     # 256-row tiles
])
def test_moe_prefill_matches_expert_twins(width, codebook, block_m, row_tiles, scale, dtype):
    m, top_k, E, D, I, limit = 37, 2, 6, 256, 128, 1.0  # a low limit, so both clamps act
    projections = _stacked_experts(E, D, I, width, seed=width)
    ids, route = _skewed_routing(m, top_k, E, seed=width)
    x = (scale * torch.randn(m, D, generator=torch.Generator().manual_seed(width))).to(dtype).to(DEVICE)
    y = exl3_kernels.exl3_moe_prefill(x, ids, route, *projections, codebook, limit, block_m=block_m,
                                      row_tiles=row_tiles)
    ref = _moe_twin(x, ids, route, projections, codebook, limit)
    assert (ids == E - 1).sum() == 0 and y.dtype == torch.float32
    err = rel_err(y, ref)
    assert err <= PREFILL_MOE_REL, f"relative error {err:.2e} against the per-expert twin"


def test_moe_prefill_equals_moe_decode():
    m, top_k, E, D, I, limit, codebook = 5, 3, 4, 256, 128, 2.0, "mcg"
    projections = _stacked_experts(E, D, I, 48, seed=3)
    ids, route = _skewed_routing(m, top_k, E, seed=3)
    x = torch.randn(m, D, generator=torch.Generator().manual_seed(3)).half().to(DEVICE)
    y = exl3_kernels.exl3_moe_prefill(x, ids, route, *projections, codebook, limit, row_tiles=8)
    ref = exl3_kernels.exl3_moe_decode(x, ids, route, *projections, codebook, limit, row_tiles=8)
    err = rel_err(y, ref)
    assert err <= PREFILL_MOE_REL, f"relative error {err:.2e} against exl3_moe_decode"


def test_moe_prefill_tiles_sort_ids_of_many_experts():
    """The pairs' order (sorted by expert, stable) at the model's 288 experts, whose ids pass int8's range:
    the int16 sort key must give int64's order (an int8 key, tried below, wraps ids >= 128 and fails)."""
    E = 288
    ids = torch.randint(0, E, (257 * 8,), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    order, rank, tiles = exl3_kernels._prefill_tiles(ids, E, 32)
    expected = torch.argsort(ids, stable=True)
    assert torch.equal(order.long(), expected)
    assert torch.equal(order.long()[rank.long()], torch.arange(ids.numel(), device=DEVICE))
    assert not torch.equal(torch.argsort(ids.to(torch.int8), stable=True), expected)
    with pytest.raises(ValueError, match="at most 32767 experts, got 32768"):
        exl3_kernels._prefill_tiles(ids, 32768, 32)


@pytest.mark.parametrize("D", [256, 384])
def test_moe_prefill_rotation_matches_its_fp64_twin(D):
    """_prefill_rotate: per sorted pair s of (token, expert e), xs[p, s] = fp16((x ⊙ suh_p[e]) · H128 / sqrt(128)
    · 2^(13 - ⌊log2 bound⌋)) with bound the largest 128-block L2 norm of x ⊙ suh_p[e], inv[p, s] that
    power's inverse, for gate (p 0) and up (p 1); D 384 pads the row's three blocks to four."""
    m, top_k, E = 5, 2, 3
    g = torch.Generator().manual_seed(D)
    x = (torch.randn(m, D, generator=g) * torch.tensor([[1e-3], [1.0], [30.0], [0.2], [4.0]])).bfloat16()
    suh = torch.randn(2, E, D, generator=g).half()
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(m)]).reshape(-1)
    order = torch.argsort(ids, stable=True)
    xs, inv = exl3_kernels._prefill_rotate(x.to(DEVICE), order.to(torch.int32).to(DEVICE),
                                           ids.to(torch.int32).to(DEVICE), suh[0].to(DEVICE), suh[1].to(DEVICE), top_k)
    xs, inv = xs.cpu().double(), inv.cpu().double()
    H = exl3.hadamard_128(dtype=torch.float64)
    for p in range(2):
        for s, pair in enumerate(order.tolist()):
            v = (x[pair // top_k].double() * suh[p, ids[pair]].double()).view(-1, 128)
            expo = math.floor(math.log2(v.norm(dim=1).max().item()))
            assert inv[p, s].item() == 2.0 ** (expo - 13), f"projection {p}, sorted pair {s}: inv {inv[p, s].item()}"
            ref = ((v @ H) * 2.0 ** (13 - expo)).reshape(-1)
            ulp = torch.finfo(torch.float16).eps * 2.0 ** torch.floor(torch.log2(ref.abs().clamp(min=2.0 ** -14)))
            err = ((xs[p, s] - ref).abs() / ulp).max().item()
            assert err <= 1.0, f"projection {p}, sorted pair {s}: {err:.2f} fp16 ulps from the fp64 twin"
            assert 2.0 ** 13 / 128 ** 0.5 <= xs[p, s].abs().max().item() < 2.0 ** 14


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the interpreter's sigmoid
def test_moe_prefill_scales_a_row_that_rotates_to_spikes():
    """The rotation's fp16 scale comes from a bound on each row's largest rotated value (its 128-blocks'
    L2 norms). A row whose gate input x ⊙ suh is a Hadamard row in every block rotates to one spike per
    block as large as that norm, the bound's worst case: a bound from the unrotated values (sqrt(128)
    times too small there) would overflow fp16 to inf."""
    m, top_k, E, D, I, limit, codebook = 3, 1, 2, 256, 128, 10.0, "mcg"
    projections = _stacked_experts(E, D, I, 48, seed=5)
    ids = torch.zeros(m, top_k, dtype=torch.long, device=DEVICE)
    route = torch.ones(m, top_k, device=DEVICE)
    signs = torch.tensor([[(-1) ** bin(i & j).count("1") for j in range(128)] for i in (1, 37, 90)], dtype=torch.float32)
    x = (signs.repeat(1, D // 128) * torch.tensor([[1.0], [1e-3], [30.0]]) / projections[0][1][0].float().cpu())
    x = x.half().to(DEVICE)
    y = exl3_kernels.exl3_moe_prefill(x, ids, route, *projections, codebook, limit, row_tiles=8)
    ref = exl3_kernels.exl3_moe_decode(x, ids, route, *projections, codebook, limit, row_tiles=8)
    assert torch.isfinite(y).all()
    err = rel_err(y, ref)
    assert err <= PREFILL_MOE_REL, f"relative error {err:.2e} against exl3_moe_decode"


@needs_gpu
@pytest.mark.parametrize("width,codebook,block_m,num_warps", [(64, "mcg", None, None), (48, "mul1", 64, 4),
                                                              (48, "3inst", 32, None), (64, "3inst", 128, None)])
def test_moe_prefill_large_on_gpu(width, codebook, block_m, num_warps):
    m, top_k, E, D, I, limit = 1024, 8, 32, 1024, 512, 10.0  # 256 pairs per expert: 256-row tiles by default
    projections = _stacked_experts(E, D, I, width, seed=width)
    ids, route = _skewed_routing(m, top_k, E, seed=width)
    x = torch.randn(m, D, generator=torch.Generator().manual_seed(width)).bfloat16().to(DEVICE)
    ref = _moe_twin(x, ids, route, projections, codebook, limit)
    for _ in range(2):  # a second call must not see the first's buffers
        y = exl3_kernels.exl3_moe_prefill(x, ids, route, *projections, codebook, limit, block_m=block_m,
                                     num_warps=num_warps)
        err = rel_err(y, ref)
        assert err <= PREFILL_MOE_REL, f"relative error {err:.2e} against the per-expert twin"


def test_moe_prefill_bad_input_is_named():
    projections = _stacked_experts(2, 128, 128, 48, seed=1)
    x = torch.zeros(3, 128, dtype=torch.float16, device=DEVICE)
    ids = torch.zeros(3, 2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=r"ids and route must both be \[3, top_k\]"):
        exl3_kernels.exl3_moe_prefill(x, ids, torch.ones(3, 1, device=DEVICE), *projections, "mcg", 1.0)
    with pytest.raises(ValueError, match="block_m must be"):
        exl3_kernels.exl3_moe_prefill(x, ids, torch.ones(3, 2, device=DEVICE), *projections, "mcg", 1.0, block_m=48)
    with pytest.raises(ValueError, match=r"x must be fp16 or bf16 \[m, 128\]"):
        exl3_kernels.exl3_moe_prefill(x.float(), ids, torch.ones(3, 2, device=DEVICE), *projections, "mcg", 1.0)


# ---------------------------------------------------------------- bf16 rows x fp32 weight, fp32-accurate

@pytest.mark.parametrize("signs,m,n,blocks", [
    ("mixed", 70, 40, (32, 32, 64)), ("positive", 70, 40, (32, 32, 64)),
    ("positive", 70, 32, (None, None, None)),  # the indexer's 32 outputs: 128 of k a step
    ("mixed", 4100, 40, (None, None, None)),  # the router's rows: 128 x 64 tiles, one row past a block
])
def test_bf16_fp32_linear_has_fp32_accuracy(signs, m, n, blocks):
    """Against the fp64 product, relative to Σ|x||w| per output: on CPU the fp32 twin's error level
    (<= 4e-7 here). The weights use all 24 significand bits; dropping the split's last bf16 part (w3)
    costs >= 2e-6, which that tolerance catches (checked below on the same data). On a GPU the tensor
    cores add the products in fp32 truncating the aligned addends: 2.8e-6 measured on the H200 with
    positive data (errors of one sign), so there the bound is 5e-6 (dropping w2 costs 1.5e-3)."""
    g = torch.Generator().manual_seed(11)
    k = 200  # ragged against every block size
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * torch.exp2(torch.randn(n, 1, generator=g))
    if signs == "positive":  # dropped bits then add up instead of cancelling
        x, w = x.abs(), w.abs()
    x = x.bfloat16()
    block_m, block_n, block_k = blocks
    assert blocks[0] is not None or kernels._linear_tiles(m, n) == ((64, 32, 128) if n <= 32 else (128, 64, 64))
    y = kernels.bf16_fp32_linear(x.to(DEVICE), w.to(DEVICE), block_m=block_m, block_n=block_n, block_k=block_k)
    assert y.shape == (m, n) and y.dtype == torch.float32
    exact = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    rel = lambda approx: ((approx.double().cpu() - exact).abs() / scale).max().item()
    assert rel(y) <= (5e-6 if DEVICE == "cuda" else 1e-6), f"relative error {rel(y):.3g}"
    assert rel(x.float() @ w.T) <= 1e-6, "the fp32 twin itself should meet the tolerance"
    w1 = (w.view(torch.int32) & -65536).view(torch.float32)
    w2 = ((w - w1).view(torch.int32) & -65536).view(torch.float32)
    assert torch.equal(w1 + w2 + (w - w1 - w2), w)
    assert rel(x.double() @ (w1 + w2).double().T) > 1e-6, "the test could not see a dropped w3"


def test_bf16_fp32_linear_bad_input_is_named():
    x = torch.zeros(3, 64, dtype=torch.bfloat16, device=DEVICE)
    w = torch.zeros(32, 64, device=DEVICE)
    with pytest.raises(ValueError, match=r"x must be bf16 \[m, k\], got torch.float32 \(3, 64\)"):
        kernels.bf16_fp32_linear(x.float(), w)
    with pytest.raises(ValueError, match=r"w must be fp32 \[n, 64\] for x \(3, 64\), got torch.float32 \(32, 65\)"):
        kernels.bf16_fp32_linear(x, torch.zeros(32, 65, device=DEVICE))
    with pytest.raises(ValueError, match=r"w must be fp32 .*got torch.bfloat16 \(32, 64\)"):
        kernels.bf16_fp32_linear(x, w.bfloat16())
    with pytest.raises(ValueError, match="block_k = 48"):
        kernels.bf16_fp32_linear(x, w, block_k=48)
    assert kernels.bf16_fp32_linear(x[:0], w).shape == (0, 32)

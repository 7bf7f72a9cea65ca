"""fp8.py: block-128 FP8 quantization (both scale rules), dequantization and FP8Linear on CPU;
kernels.fp8_dequantize against its twin (interpreted on CPU)."""
import pytest
import torch
import torch.nn.functional as F

import fp8
import kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weight(out_f: int, in_f: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out_f, in_f, generator=g) * torch.rand(out_f, 1, generator=g) * 3


def test_amax_rule_is_the_official_formula():
    """Bit for bit what the checkpoint writer stored before it used fp8.py: scale_inv = amax / 448 per
    zero-padded 128 x 128 block (1 for an all-zero block), W_fp8 = W / scale_inv cast to e4m3."""
    w = _weight(200, 300, seed=1)
    w[128:, 256:] = 0
    q, s = fp8.quantize_fp8_block(w, "amax")
    assert s.shape == (2, 3) and q.dtype == torch.float8_e4m3fn
    padded = torch.zeros(256, 384)
    padded[:200, :300] = w
    amax = padded.view(2, 128, 3, 128).abs().amax(dim=(1, 3))
    s_ref = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    full = s_ref.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    q_ref = (w / full).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert s[1, 2] == 1
    assert torch.equal(fp8.dequantize_fp8_block(q, s, torch.bfloat16), (q_ref.float() * full).to(torch.bfloat16))


@pytest.mark.parametrize("rule", fp8.SCALE_RULES)
def test_round_trip_error_is_e4m3_rounding(rule):
    w = _weight(256, 384, seed=2)
    q, s = fp8.quantize_fp8_block(w, rule)
    back = fp8.dequantize_fp8_block(q, s)
    scale = s.repeat_interleave(128, 0).repeat_interleave(128, 1)
    # e4m3: 3 mantissa bits (relative rounding <= 2^-4), subnormal spacing 2^-9 times the scale
    assert ((back - w).abs() <= torch.maximum(w.abs() * 2 ** -4, scale * 2 ** -10)).all()
    amax = w.abs().view(2, 128, 3, 128).amax(dim=(1, 3))
    assert (amax / s <= fp8.FP8_MAX).all()
    if rule == "pow2":
        assert torch.equal(s, torch.exp2(torch.log2(s).round()))
        assert (amax / s > fp8.FP8_MAX / 2).all(), "pow2 must pick the smallest power of two that fits"
    else:
        assert torch.allclose(amax / s, torch.full_like(s, fp8.FP8_MAX))


def test_pow2_scales_keep_representable_weights_exact():
    g = torch.Generator().manual_seed(3)
    codes = (torch.rand(128, 256, generator=g) * 400 - 200).to(torch.float8_e4m3fn)
    codes[0, 0], codes[0, 128] = 448.0, -448.0  # each block's amax on the grid's end
    w = codes.float() * torch.tensor([0.25, 8.0]).repeat_interleave(128)[None, :]
    q, s = fp8.quantize_fp8_block(w, "pow2")
    assert torch.equal(s, torch.tensor([[0.25, 8.0]]))
    assert torch.equal(q.view(torch.uint8), codes.view(torch.uint8))


def test_zero_block_gets_scale_one():
    w = torch.zeros(128, 256)
    w[:, 128:] = 1.0
    _, s = fp8.quantize_fp8_block(w, "pow2")
    assert s[0, 0] == 1.0


def test_linear_is_dequantize_then_matmul():
    w = _weight(130, 260, seed=4)
    lin = fp8.FP8Linear.from_weight(w, name="layers.0.mlp.up_proj")
    assert (lin.out_features, lin.in_features) == (130, 260)
    x = torch.randn(2, 3, 260, generator=torch.Generator().manual_seed(5)).bfloat16()
    y = lin(x)
    assert y.shape == (2, 3, 130) and y.dtype == torch.bfloat16
    ref = (x.float().reshape(6, 260) @ lin.dequantize().T).reshape(2, 3, 130)
    assert torch.equal(y, ref.bfloat16())
    assert lin.nbytes() == 130 * 260 + 4 * 2 * 3
    assert set(lin.tensors()) == {"weight", "weight_scale_inv"}


def test_bad_input_is_named():
    lin = fp8.FP8Linear.from_weight(_weight(128, 256, seed=6), name="lm_head")
    with pytest.raises(ValueError, match=r"lm_head: input shape \(1, 128\) does not match in_features 256"):
        lin(torch.zeros(1, 128))
    with pytest.raises(ValueError, match=r"q_a_proj.weight_scale_inv has shape \(1, 1\).*\(128, 256\) needs \(1, 2\)"):
        fp8.FP8Linear(lin.weight, lin.scale_inv[:, :1], name="q_a_proj")
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8.FP8Linear(lin.dequantize(), lin.scale_inv)
    with pytest.raises(ValueError, match="scale_rule"):
        fp8.quantize_fp8_block(torch.ones(4, 4), "ue8m0")
    with pytest.raises(ValueError, match="inf or NaN"):
        fp8.quantize_fp8_block(torch.tensor([[float("nan"), 1.0]]))


@pytest.mark.parametrize("shape", [(256, 384), (200, 300)], ids=["whole blocks", "ragged"])
def test_dequantize_is_the_per_block_product(shape):
    """Whole-block shapes broadcast the scale grid, ragged ones expand it: the same fp32 products."""
    g = torch.Generator().manual_seed(2)
    q, s = fp8.quantize_fp8_block(torch.randn(shape, generator=g))
    expanded = s.repeat_interleave(fp8.BLOCK, 0)[:shape[0]].repeat_interleave(fp8.BLOCK, 1)[:, :shape[1]]
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(fp8.dequantize_fp8_block(q, s, dtype), (q.float() * expanded).to(dtype))


def _codes_and_scales(shape: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite e4m3 code (subnormals, both zeros) and per-block scales from 2^-20 to 2^8 with
    random mantissas: products that round, and in fp16 also underflow to subnormals or overflow."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # the two NaN codes
    grid = fp8.scale_grid(*shape)
    scales = (1 + torch.rand(grid, generator=g)) * torch.exp2(torch.randint(-20, 9, grid, generator=g).float())
    return codes.view(torch.float8_e4m3fn), scales


@pytest.mark.parametrize("shape,block_n", [((256, 384), 64), ((200, 300), 32), ((130, 1000), 128), ((64, 100), 16)],
                         ids=["whole blocks", "ragged", "ragged k, 8 blocks", "below one block"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # fp16's inf is part of the test
def test_dequantize_kernel_is_the_twin_bit_for_bit(shape, block_n, dtype):
    q, s = _codes_and_scales(shape, seed=shape[0] + block_n)
    got = kernels.fp8_dequantize(q.to(DEVICE), s.to(DEVICE), dtype, block_n=block_n)
    assert got.shape == shape and got.dtype == dtype
    assert torch.equal(got.cpu(), fp8.dequantize_fp8_block(q, s, dtype))


def test_many_rows_use_the_dequantize_kernel():
    """FP8Linear's CUDA path beyond kernels.FP8_GEMV_ROWS rows: the kernel's W, then F.linear (called
    directly: on CPU __call__ would take the twin)."""
    lin = fp8.FP8Linear(*(t.to(DEVICE) for t in _codes_and_scales((200, 300), seed=7)))
    x = torch.randn(kernels.FP8_GEMV_ROWS + 1, 300, generator=torch.Generator().manual_seed(8)).bfloat16().to(DEVICE)
    assert torch.equal(lin._forward_cuda(x), F.linear(x, lin.dequantize(torch.bfloat16)))


def test_dequantize_kernel_bad_input_is_named():
    q, s = _codes_and_scales((128, 256), seed=9)
    with pytest.raises(ValueError, match=r"float8_e4m3fn \[n, k\], got torch.float32 \(128, 256\)"):
        kernels.fp8_dequantize(q.float(), s)
    with pytest.raises(ValueError, match=r"scale_inv must be fp32 \(1, 2\) for weight \(128, 256\), got torch.float32 \(1, 1\)"):
        kernels.fp8_dequantize(q, s[:, :1])
    with pytest.raises(ValueError, match=r"scale_inv must be fp32 \(1, 2\).*got torch.float64"):
        kernels.fp8_dequantize(q, s.double())
    with pytest.raises(ValueError, match="dtype must be torch.bfloat16 or torch.float16, got torch.float32"):
        kernels.fp8_dequantize(q, s, torch.float32)
    with pytest.raises(ValueError, match="block_n"):
        kernels.fp8_dequantize(q, s, block_n=48)

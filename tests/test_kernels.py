"""Triton EXL3 kernels against exllamav3's golden outputs and against their torch twins in exl3.py.

On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py), so shapes stay tiny there;
the larger cases run only on a GPU.
"""
import numpy as np
import pytest
import torch

import kernels

try:
    import exl3
    EXL3_MISSING = ""
except ImportError as error:  # written in parallel; the twin tests need it
    exl3 = None
    EXL3_MISSING = f"exl3.py is not importable yet: {error}"

needs_exl3 = pytest.mark.skipif(exl3 is None, reason=EXL3_MISSING)
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="large shapes only on a GPU")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONFIGS = [f"K{k}_{cb}" for k in range(1, 9) for cb in kernels.CODEBOOKS] + [
    "K1p5_mul1", "K2p5_mul1", "K3p5_mul1"]
# Every K and every codebook at least once. Launch shapes (block_n, row_tiles, split_k) vary to cover
# one and several programs per 128-column block; large row_tiles keep the interpreter's loop short.
GEMV_CASES = [("K1_3inst", 128, 16, None), ("K2_mcg", 64, 16, None), ("K3_mul1", 128, 8, 2),
              ("K4_3inst", 128, 16, None), ("K5_mcg", 128, 8, 2), ("K6_mul1", 64, 16, None),
              ("K7_3inst", 128, 16, None), ("K8_mcg", 128, 8, 2), ("K1p5_mul1", 128, 16, None),
              ("K2p5_mul1", 128, 16, None), ("K3p5_mul1", 128, 8, 2), ("K4_mul1", 32, 16, None)]

@pytest.fixture(scope="module")
def golden(fixtures_dir):
    return np.load(fixtures_dir / "exl3" / "exl3_golden.npz")


def _golden(golden, config: str, name: str) -> torch.Tensor:
    return torch.from_numpy(golden[f"{config}.{name}"]).to(DEVICE)


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


def _random_linear(k: int, n: int, width: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    trellis = torch.randint(-2**15, 2**15, (k // 16, n // 16, width), generator=g, dtype=torch.int32)
    # General fp16 factors of both signs (spec §4: never assume ±1).
    suh = (torch.rand(k, generator=g) * 0.1 + 0.01) * (torch.randint(0, 2, (k,), generator=g) * 2 - 1)
    svh = (torch.rand(n, generator=g) * 0.1 + 0.01) * (torch.randint(0, 2, (n,), generator=g) * 2 - 1)
    return (trellis.to(torch.int16).to(DEVICE), suh.half().to(DEVICE), svh.half().to(DEVICE))


def _random_x(m: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).half().to(DEVICE)


@pytest.mark.parametrize("config", CONFIGS)
def test_decode_is_bit_exact_against_exllamav3(golden, config):
    trellis = _golden(golden, config, "trellis")
    out = torch.full((256, 256), float("nan"), dtype=torch.float16, device=DEVICE)
    kernels.exl3_decode(trellis, config.split("_")[1], out=out)
    inner = _golden(golden, config, "inner")
    mismatches = (out.view(torch.int16) != inner.view(torch.int16)).sum().item()
    assert mismatches == 0, f"{config}: {mismatches} of 65536 values differ from exllamav3's reconstruct"


@pytest.mark.parametrize("config,block_n,row_tiles,split_k", GEMV_CASES)
def test_gemv_matches_exllamav3_batch4(golden, config, block_n, row_tiles, split_k):
    x = _golden(golden, config, "x4")
    out = torch.full((4, 256), float("nan"), dtype=torch.float16, device=DEVICE)
    kernels.exl3_gemv(x, _golden(golden, config, "trellis"), _golden(golden, config, "suh"),
                      _golden(golden, config, "svh"), config.split("_")[1], out=out,
                      block_n=block_n, row_tiles=row_tiles, split_k=split_k)
    assert torch.isfinite(out).all(), "some outputs were not written"
    err = _rel_err(out, _golden(golden, config, "y4"))
    assert err <= 1e-3, f"{config}: relative error {err:.2e} against exllamav3's y4"


def test_gemv_split_buffers_are_left_clean(golden):
    # The split-k partial sums live in a reused buffer; a second call must not see the first's.
    config = "K3_mcg"
    args = [_golden(golden, config, name) for name in ("trellis", "suh", "svh")]
    x = _random_x(2, 256, seed=1)
    first = kernels.exl3_gemv(x, *args, "mcg", block_n=64, row_tiles=8, split_k=2)
    second = kernels.exl3_gemv(x, *args, "mcg", block_n=64, row_tiles=8, split_k=2)
    assert _rel_err(second, first) <= 1e-6


@needs_exl3
@pytest.mark.parametrize("width,codebook", [(48, "3inst"), (32, "mcg"), (56, "mul1"), (128, "mul1")])
def test_decode_matches_torch_twin(width, codebook):
    trellis, _, _ = _random_linear(256, 384, width, seed=width)
    out = torch.full((256, 384), float("nan"), dtype=torch.float16, device=DEVICE)
    kernels.exl3_decode(trellis, codebook, out=out)
    assert torch.equal(out.view(torch.int16), exl3.unpack(trellis, codebook).view(torch.int16))


@needs_exl3
@pytest.mark.parametrize("m,width,codebook,split_k", [(3, 64, "mcg", 2), (1, 40, "mul1", 1),
                                                      (8, 48, "3inst", 1)])
def test_gemv_matches_torch_twin(m, width, codebook, split_k):
    trellis, suh, svh = _random_linear(128, 256, width, seed=m)
    x = _random_x(m, 128, seed=m + 10)
    out = torch.full((m, 256), float("nan"), dtype=torch.float16, device=DEVICE)
    kernels.exl3_gemv(x, trellis, suh, svh, codebook, out=out, row_tiles=8 // split_k, split_k=split_k)
    assert torch.isfinite(out).all(), "some outputs were not written"
    ref = x.float() @ exl3.dequantize(trellis, suh, svh, codebook).float()
    err = _rel_err(out, ref)
    assert err <= 1e-3, f"relative error {err:.2e} against x @ exl3.dequantize"


@needs_exl3
def test_gemv_more_rows_than_one_launch_takes():
    trellis, suh, svh = _random_linear(128, 128, 32, seed=5)
    x = _random_x(2 * kernels.GEMV_ROWS + 1, 128, seed=6)
    y = kernels.exl3_gemv(x, trellis, suh, svh, "mul1", row_tiles=8)
    ref = x.float() @ exl3.dequantize(trellis, suh, svh, "mul1").float()
    assert _rel_err(y, ref) <= 1e-3


@needs_exl3
@needs_gpu
@pytest.mark.parametrize("k,n,width,codebook", [(4096, 2048, 64, "mcg"), (2048, 4096, 48, "3inst"),
                                                (4096, 12288, 48, "mul1")])
def test_large_shapes_on_gpu(k, n, width, codebook):
    trellis, suh, svh = _random_linear(k, n, width, seed=k + n)
    inner = exl3.unpack(trellis, codebook)
    assert torch.equal(kernels.exl3_decode(trellis, codebook).view(torch.int16), inner.view(torch.int16))
    w = exl3.dequantize(trellis, suh, svh, codebook).float()
    for m in (1, 8):
        x = _random_x(m, k, seed=m)
        ref = x.float() @ w
        for _ in range(3):  # repeated calls: a moving error would mean a split-k race
            out = torch.full((m, n), float("nan"), dtype=torch.float16, device=DEVICE)
            kernels.exl3_gemv(x, trellis, suh, svh, codebook, out=out)
            err = _rel_err(out, ref)
            assert err <= 1e-3, f"m={m}: relative error {err:.2e}"


def test_bad_input_is_named():
    trellis = torch.zeros(8, 8, 48, dtype=torch.int16, device=DEVICE)
    with pytest.raises(ValueError, match="codebook"):
        kernels.exl3_decode(trellis, "qtip")
    with pytest.raises(ValueError, match="last dim 20"):
        kernels.exl3_decode(torch.zeros(8, 8, 20, dtype=torch.int16), "mcg")
    with pytest.raises(ValueError, match="half-integer"):
        kernels.exl3_decode(torch.zeros(8, 8, 40, dtype=torch.int16), "mcg")
    x = torch.zeros(1, 64, dtype=torch.float16, device=DEVICE)
    suh = torch.ones(128, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match=r"\[m, 128\].*\(1, 64\)"):
        kernels.exl3_gemv(x, trellis, suh, suh, "3inst")

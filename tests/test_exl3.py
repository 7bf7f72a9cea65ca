"""exl3.py against exllamav3's own outputs (golden file), the spec's worked examples, and itself.

`python tests/test_exl3.py` prints the quantizer's NMSE table and CPU speed (not run by pytest).
"""
import math
import time

import numpy as np
import pytest
import torch

import exl3

CONFIGS = [f"K{k}_{cb}" for k in range(1, 9) for cb in ("3inst", "mcg", "mul1")] + \
          ["K1p5_mul1", "K2p5_mul1", "K3p5_mul1"]
ALL_BITS = [(float(k), cb) for k in range(1, 9) for cb in ("3inst", "mcg", "mul1")] + \
           [(1.5, "mul1"), (2.5, "mul1"), (3.5, "mul1")]


@pytest.fixture(scope="module")
def golden(fixtures_dir):
    with np.load(fixtures_dir / "exl3" / "exl3_golden.npz") as z:
        return {k: torch.from_numpy(z[k]) for k in z.files}


def parts(golden, config):
    return {name: golden[f"{config}.{name}"] for name in
            ("trellis", "suh", "svh", "inner", "full", "x1", "y1", "x4", "y4", "x300", "y300")}


def linear(g, codebook):
    tensors = {"trellis": g["trellis"], "suh": g["suh"], "svh": g["svh"]}
    if codebook != "3inst":
        tensors[codebook] = torch.tensor(0, dtype=torch.int32)  # the value is never read
    return exl3.EXL3Linear.from_tensors(tensors, "golden")


def rel_rms(a, b):
    a, b = a.double(), b.double()
    return ((a - b).square().mean() / b.square().mean()).sqrt().item()


# ---------------------------------------------------------------------------------------------
# Golden file (exllamav3 1.6.5 kernels on an H200)


def test_golden_has_27_configurations(golden):
    assert sorted({k.split(".")[0] for k in golden}) == sorted(CONFIGS)


@pytest.mark.parametrize("config", CONFIGS)
def test_unpack_bit_exact(golden, config):
    g = parts(golden, config)
    inner = exl3.unpack(g["trellis"], config.split("_")[1])
    assert inner.dtype == torch.float16 and inner.shape == (256, 256)
    assert torch.equal(inner.view(torch.int16), g["inner"].view(torch.int16))


@pytest.mark.parametrize("config", CONFIGS)
def test_dequantize_and_linear(golden, config):
    codebook = config.split("_")[1]
    g = parts(golden, config)
    full = exl3.dequantize(g["trellis"], g["suh"], g["svh"], codebook)
    # More than one fp16 rounding apart: exllamav3 rounds intermediates (the Hadamard products) to
    # fp16, so its `full` is up to 4.2e-4 relative RMS off the exact product (spec §10.2); ours is
    # the exact product rounded once (<= 2.1e-4 measured). Together: up to 4.66e-4 over the 27.
    assert rel_rms(full, g["full"]) <= 5e-4
    exact = g["suh"].double()[:, None] * exl3.had_left(exl3.had_right(g["inner"])).double() * g["svh"].double()
    assert rel_rms(full, exact) <= 2.5e-4  # a single fp16 rounding

    lin = linear(g, codebook)
    assert (lin.in_features, lin.out_features, lin.codebook) == (256, 256, codebook)
    for rows in ("4", "300"):
        y = lin(g["x" + rows])
        assert y.dtype == torch.float16 and y.shape == g["y" + rows].shape
        assert rel_rms(y, g["y" + rows]) <= 1e-3
    y1 = lin(g["x1"])
    if codebook == "mul1" and lin.bits <= 6:
        # exllamav3's batch-1 MUL1 path (K <= 6) is the int8-activation GEMV (spec §5.1, §10.2): it
        # quantizes x to int8 and uses the unrounded affine codebook, so its y1 is ~6e-3..1.3e-2 off
        assert rel_rms(y1, g["y1"]) <= 1.5e-2
    else:
        assert rel_rms(y1, g["y1"]) <= 1e-3


def test_linear_keeps_dtype_and_leading_dims(golden):
    g = parts(golden, "K3_mcg")
    lin = linear(g, "mcg")
    x = g["x4"].float().view(2, 2, 256)
    y = lin(x)
    assert y.dtype == torch.float32 and y.shape == (2, 2, 256)
    assert rel_rms(y.view(4, 256), g["y4"]) <= 1e-3
    assert lin(x.bfloat16()).dtype == torch.bfloat16
    assert torch.allclose(lin(x), x @ lin.weight().float(), rtol=0, atol=2e-3 * y.abs().max().item())
    assert lin.weight().shape == (256, 256)


# ---------------------------------------------------------------------------------------------
# Spec worked examples (§2.1, §2.2, §2.4)

CODEBOOK_EXAMPLES = {  # state: (3inst, mcg, mul1) fp16 bit patterns, spec §2.4
    0x1234: (0xC066, 0x3E0F, 0xB89E),
    0x0000: (0x3A25, 0x3F60, 0xC2E8),
    0x0001: (0xBB5B, 0x304E, 0x3921),
    0x8000: (0xB7F8, 0xB915, 0xBAF2),
    0xBEEF: (0x424B, 0xC293, 0x3124),
    0xFFFF: (0xB110, 0x3ACD, 0xB936),
}


@pytest.mark.parametrize("index,codebook", list(enumerate(exl3.CODEBOOKS)))
def test_codebook_worked_examples(index, codebook):
    states = torch.tensor(list(CODEBOOK_EXAMPLES))
    got = exl3.decode_codebook(states, codebook).view(torch.int16).to(torch.int64) & 0xFFFF
    assert got.tolist() == [bits[index] for bits in CODEBOOK_EXAMPLES.values()]


def test_codebook_values_and_statistics():
    assert exl3.decode_codebook(torch.tensor([0x1234]), "3inst").item() == -2.19921875  # the RNE step
    assert exl3.decode_codebook(torch.tensor([0x1234]), "mul1").item() == -0.5771484375
    assert abs(exl3.codebook_lut("3inst").float().std().item() - 1.24371) < 1e-4
    assert abs(exl3.codebook_lut("mul1").float().std().item() - 1.0003) < 1e-3


def test_ring_worked_example():
    """K = 3, symbols 3, 0, 5, 2, 7, 4, 1, 6, ...: file words 0x0E62, 0x62AF; states 0x7873, 0xC398."""
    symbols = torch.tensor([3, 0, 5, 2, 7, 4, 1, 6] * 32)
    states = torch.zeros(256, dtype=torch.int64)
    state = 0
    for _ in range(2):  # go round twice so position 0 sees the ring's tail
        for t in range(256):
            state = ((state << 3) | symbols[t].item()) & 0xFFFF
            states[t] = state
    words = exl3.pack_states(states, 3)
    assert words.shape == (48,) and (words[:2].to(torch.int64) & 0xFFFF).tolist() == [0x0E62, 0x62AF]
    unpacked = exl3.unpack_states(words, 3)
    assert unpacked[0].item() == 0x7873 and unpacked[1].item() == 0xC398
    assert torch.equal(unpacked, states)
    tile = exl3.unpack(words.view(1, 1, 48), "3inst")
    assert tile[0, 0].item() == -1.048828125 and tile[1, 0].item() == exl3.decode_codebook(
        torch.tensor([0xC398]), "3inst").item()
    assert exl3.unpack(words.view(1, 1, 48), "mul1")[0, 0].item() == -1.267578125


def test_tile_order():
    """Positions 0..7 -> (0,0) (1,0) (8,0) (9,0) (0,8) (1,8) (8,8) (9,8); 8..15 -> rows 2, 3, 10, 11."""
    order = exl3.stream_to_tile()
    assert [(p // 16, p % 16) for p in order[:8].tolist()] == \
        [(0, 0), (1, 0), (8, 0), (9, 0), (0, 8), (1, 8), (8, 8), (9, 8)]
    assert [p // 16 for p in order[8:12].tolist()] == [2, 3, 10, 11]
    assert sorted(order.tolist()) == list(range(256))
    m = torch.randn(32, 48)
    assert torch.equal(exl3.tiles_to_matrix(exl3.matrix_to_tiles(m)), m)


def test_hadamard():
    h = exl3.hadamard_128()
    assert torch.allclose(h @ h, torch.eye(128), atol=1e-6)
    i = torch.arange(128)
    popcount = torch.zeros(128, 128, dtype=torch.int64)
    for b in range(7):
        popcount += ((i[:, None] & i[None, :]) >> b) & 1
    assert torch.allclose(h, (1 - 2 * (popcount % 2)).float() / math.sqrt(128))
    x = torch.randn(3, 256)
    assert torch.allclose(exl3.had_right(x)[:, 128:], x[:, 128:] @ h, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Tensor sets, legacy signs, errors


def test_legacy_signs_match_suh(golden):
    g = parts(golden, "K2_mul1")
    signs = torch.randint(0, 2, (256,))
    weights = (signs.view(16, 16) << torch.arange(16)).sum(1)
    packed = ((weights ^ 0x8000) - 0x8000).to(torch.int16)
    as_pm1 = (1 - 2 * signs).half()
    legacy = exl3.EXL3Linear.from_tensors({"trellis": g["trellis"], "su": packed, "sv": packed,
                                           "mul1": torch.zeros(1, dtype=torch.int16)})
    plain = exl3.EXL3Linear.from_tensors({"trellis": g["trellis"], "suh": as_pm1, "svh": as_pm1,
                                          "mul1": torch.tensor(exl3.MARKER_VALUES["mul1"] - (1 << 32))})
    assert torch.equal(legacy.suh, as_pm1) and torch.equal(legacy.svh, as_pm1)
    assert torch.equal(legacy.weight(), plain.weight())
    assert torch.equal(legacy(g["x4"]), plain(g["x4"]))


def test_tensors_and_safetensors_roundtrip(golden, tmp_path):
    g = parts(golden, "K2p5_mul1")
    bias = torch.randn(256).half()
    lin = exl3.EXL3Linear.from_tensors({"trellis": g["trellis"], "suh": g["suh"], "svh": g["svh"],
                                        "mul1": torch.tensor(0), "bias": bias}, "layer")
    t = lin.tensors()
    assert set(t) == {"trellis", "suh", "svh", "mul1", "bias"}
    assert t["mul1"].dtype == torch.int32 and t["mul1"].shape == () and t["mul1"].item() == -2082680531
    path = tmp_path / "model.safetensors"
    exl3.save_exl3(path, {"model.layers.3.mlp.experts.0.up_proj": lin})
    loaded = exl3.load_exl3(path)
    assert list(loaded) == ["model.layers.3.mlp.experts.0.up_proj"]
    back = loaded["model.layers.3.mlp.experts.0.up_proj"]
    assert (back.bits, back.codebook) == (2.5, "mul1")
    assert torch.equal(back(g["x4"]), lin(g["x4"]))
    with_bias = lin(g["x4"].float()) - bias.float()
    assert torch.allclose(with_bias, linear(g, "mul1")(g["x4"].float()), rtol=0, atol=1e-5)
    flat = exl3.flatten_exl3({"a.b": lin})
    assert exl3.load_exl3(flat)["a.b"].codebook == "mul1"


def test_quantization_config(golden):
    g = parts(golden, "K4_mcg")
    lin = exl3.EXL3Linear.from_tensors({"trellis": g["trellis"], "suh": g["suh"], "svh": g["svh"],
                                        "mcg": torch.tensor(0)})
    cfg = exl3.quantization_config(4.05, "mul1", tensor_storage={"x.proj": lin})
    assert cfg["quant_method"] == "exl3" and cfg["bits"] == 4.05 and cfg["codebook"] == "mul1"
    assert cfg["head_bits"] == 6 and cfg["calibration"] == {"rows": 250, "cols": 2048}
    entry = cfg["tensor_storage"]["x.proj"]
    assert entry["quant_format"] == "exl3" and entry["bits_per_weight"] == 4
    assert entry["mcg_multiplier"] == 3417055213
    assert entry["stored_tensors"]["x.proj.trellis"] == {"shape": [16, 16, 64], "n_bytes": 32768, "dtype": "int16"}


def test_errors(golden):
    g = parts(golden, "K3_3inst")
    tr = g["trellis"]
    with pytest.raises(ValueError, match="int16.*float32"):
        exl3.unpack(tr.float(), "3inst")
    with pytest.raises(ValueError, match="unknown EXL3 codebook 'foo'"):
        exl3.unpack(tr, "foo")
    with pytest.raises(ValueError, match="last dim 52"):
        exl3.unpack(torch.zeros(16, 16, 52, dtype=torch.int16), "3inst")
    with pytest.raises(ValueError, match="K = 9"):
        exl3.unpack(torch.zeros(16, 16, 144, dtype=torch.int16), "3inst")
    with pytest.raises(ValueError, match="half-integer.*mcg"):
        exl3.unpack(torch.zeros(16, 16, 40, dtype=torch.int16), "mcg")
    with pytest.raises(ValueError, match=r"suh.*\(128,\).*\(256,\)"):
        exl3.dequantize(tr, g["suh"][:128], g["svh"], "3inst")
    with pytest.raises(ValueError, match=r"lin.svh.*\(200,\).*\(256,\)"):
        exl3.EXL3Linear.from_tensors({"trellis": tr, "suh": g["suh"], "svh": torch.ones(200).half()}, "lin")
    with pytest.raises(ValueError, match=r"lin.svh: missing"):
        exl3.EXL3Linear.from_tensors({"trellis": tr, "suh": g["suh"]}, "lin")
    with pytest.raises(ValueError, match=r"lin.trellis: missing"):
        exl3.EXL3Linear.from_tensors({"suh": g["suh"], "svh": g["svh"]}, "lin")
    with pytest.raises(ValueError, match=r"unknown EXL3 tensor.*'scale'"):
        exl3.EXL3Linear.from_tensors({"trellis": tr, "suh": g["suh"], "svh": g["svh"], "scale": g["suh"]}, "lin")
    with pytest.raises(ValueError, match="both .mcg and .mul1"):
        exl3.EXL3Linear.from_tensors({"trellis": tr, "suh": g["suh"], "svh": g["svh"],
                                      "mcg": torch.tensor(0), "mul1": torch.tensor(0)}, "lin")
    with pytest.raises(ValueError, match=r"multiples of 128"):
        exl3.EXL3Linear.from_tensors({"trellis": tr[:4], "suh": g["suh"][:64], "svh": g["svh"]}, "lin")
    with pytest.raises(ValueError, match=r"lin.suh.*int16"):
        exl3.EXL3Linear.from_tensors({"trellis": tr, "suh": g["suh"].view(torch.int16), "svh": g["svh"]}, "lin")
    with pytest.raises(ValueError, match=r"lin.su.*int16 \(16,\).*\(15,\)"):
        exl3.EXL3Linear.from_tensors({"trellis": tr, "su": torch.zeros(15, dtype=torch.int16), "svh": g["svh"]},
                                     "lin")
    with pytest.raises(ValueError, match=r"input shape \(2, 100\).*256"):
        linear(g, "3inst")(torch.randn(2, 100))
    with pytest.raises(ValueError, match=r"weight.*\(128, 100\)"):
        exl3.quantize(torch.randn(128, 100), 4)
    with pytest.raises(ValueError, match=r"hessian.*\(64, 64\).*\(128, 128\)"):
        exl3.quantize(torch.randn(128, 128), 4, hessian=torch.eye(64))
    with pytest.raises(ValueError, match=r"weight: contains inf or NaN"):
        exl3.quantize(torch.full((128, 128), math.nan), 4)
    with pytest.raises(ValueError, match="half-integer"):
        exl3.quantize(torch.randn(128, 128), 2.5, "3inst")
    with pytest.raises(ValueError, match="K = 2.25"):
        exl3.quantize(torch.randn(128, 128), 2.25, "mul1")


# ---------------------------------------------------------------------------------------------
# Quantizer


@pytest.mark.parametrize("bits,codebook", ALL_BITS)
def test_viterbi_pack_unpack_every_bitrate(bits, codebook):
    """The Viterbi's states form valid rings: packing then unpacking gives them back exactly, and
    the decoded trellis equals the values the Viterbi reported."""
    torch.manual_seed(int(bits * 10))
    tiles = torch.randn(1, 256) * (0.9 if codebook == "mul1" else 1.1)  # inside each codebook's range
    values, states = exl3.quantize_tiles(tiles, bits, codebook)
    trellis = exl3.pack_states(states, bits)
    assert trellis.dtype == torch.int16 and trellis.shape == (1, exl3.trellis_width(bits))
    assert torch.equal(exl3.unpack_states(trellis, bits), states)
    decoded = exl3.unpack(trellis.view(1, 1, -1), codebook)
    assert torch.equal(exl3.matrix_to_tiles(decoded)[0].float(), values)
    nmse = ((values - tiles).square().mean() / tiles.square().mean()).item()
    assert nmse < 2.0 ** (-1.6 * bits)  # about 6 dB per bit, loosely


@pytest.mark.parametrize("bits,codebook,scale", [(2.5, "mul1", 0.8), (3, "mcg", 1.0)])
def test_quantize_roundtrip(bits, codebook, scale):
    """quantize -> tensors() -> from_tensors; every K is covered at tile level above (a full
    128x128 quantize costs 64 tiles of Viterbi, too slow to repeat 27 times here)."""
    torch.manual_seed(1)
    weight = torch.randn(128, 128) * 0.02
    weight[:, 7] = 0  # an all-zero input column
    weight[9] = 0  # an all-zero output row: its svh must be 0
    lin = exl3.quantize(weight, bits, codebook, seed=3, scale=scale)
    assert (lin.in_features, lin.out_features, lin.bits, lin.codebook) == (128, 128, bits, codebook)
    assert lin.svh[9] == 0
    t = lin.tensors()
    assert t["trellis"].shape == (8, 8, exl3.trellis_width(bits)) and t["suh"].dtype == torch.float16
    back = exl3.EXL3Linear.from_tensors(t, "rt")
    assert torch.equal(back.weight(), lin.weight())
    nmse = exl3.proxy_error(weight, back)
    assert nmse < {2.5: 0.05, 3: 0.03}[bits]
    x = torch.randn(5, 128)
    assert rel_rms(back(x), x @ weight.T) < math.sqrt(nmse) * 1.5


def test_global_scale_is_a_minimum():
    torch.manual_seed(2)
    w_reg = torch.randn(32, 32) * exl3.CODEBOOK_SCALE  # what regularize() produces
    g = exl3.global_scale(w_reg, 3, "mul1")
    assert 0.5 < g < 1.0  # the mul1 codebook's std is 1.0003, the rows' RMS 1.2437
    tiles = exl3.sample_scale_tiles(w_reg)
    at_g, below, above = exl3._scale_mse(tiles, [g, g - 0.2, g + 0.2], 3, "mul1")
    assert at_g < below and at_g < above


@pytest.mark.parametrize("bits,codebook,bound", [(2, "3inst", 0.085), (2, "mul1", 0.085), (3, "3inst", 0.024),
                                                 (3, "mul1", 0.024), (4, "3inst", 0.007), (4, "mul1", 0.007)])
def test_tile_nmse_gaussian(bits, codebook, bound):
    """Unit Gaussian tiles scaled to the codebook's spread; spec §8.2 measured 0.068 / 0.0178 / 0.005."""
    torch.manual_seed(5)
    tiles = torch.randn(4, 256)
    scale = 1.1 if codebook == "3inst" else 0.9
    values, _ = exl3.quantize_tiles(tiles * scale, bits, codebook)
    nmse = ((values / scale - tiles).square().mean() / tiles.square().mean()).item()
    assert bound / 2 < nmse < bound


def test_heavy_tailed_weights():
    """Student-t (df = 3) weights: the Hadamard rotation makes the tiles Gaussian enough."""
    torch.manual_seed(4)
    weight = torch.distributions.StudentT(3.0).sample((128, 128))
    lin = exl3.quantize(weight, 3, "mul1", scale=0.85)
    assert exl3.proxy_error(weight, lin) < 0.03


def test_ldlq_reduces_proxy_error():
    torch.manual_seed(6)
    # strongly correlated inputs: a few directions dominate
    x = torch.randn(2048, 16) @ torch.randn(16, 128) + 0.1 * torch.randn(2048, 128)
    hessian = x.T @ x / x.shape[0]
    weight = torch.randn(128, 128)
    plain = exl3.quantize(weight, 2, "mul1", scale=0.8)
    ldlq = exl3.quantize(weight, 2, "mul1", hessian=hessian, scale=0.8)
    err_plain = exl3.proxy_error(weight, plain, hessian)
    err_ldlq = exl3.proxy_error(weight, ldlq, hessian)
    assert err_ldlq < 0.7 * err_plain


def test_block_ldl():
    a = torch.randn(64, 64, dtype=torch.float64)
    h = a @ a.T + 64 * torch.eye(64, dtype=torch.float64)
    feedback = exl3.block_ldl(h)
    unit = feedback + torch.eye(64, dtype=torch.float64)
    assert torch.equal(feedback.triu(), torch.zeros_like(feedback))
    d = torch.linalg.inv(unit) @ h @ torch.linalg.inv(unit).T  # must be block diagonal
    off = d.clone().view(4, 16, 4, 16)
    off[torch.arange(4), :, torch.arange(4), :] = 0
    assert off.abs().max() < 1e-9 * h.abs().max()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA paths need a GPU")
@pytest.mark.parametrize("config", ["K4_mcg", "K2p5_mul1", "K3_3inst"])
def test_cuda_matches_cpu(golden, config):
    codebook = config.split("_")[1]
    g = parts(golden, config)
    cpu = linear(g, codebook)
    gpu = cpu.to("cuda")
    assert torch.equal(exl3.unpack(gpu.trellis, codebook).cpu(), cpu.inner())
    for rows in ("1", "4", "300"):  # GEMV kernel for <= 8 rows, decode + GEMM above
        assert rel_rms(gpu(g["x" + rows].cuda()).cpu(), cpu(g["x" + rows])) <= 1e-3
    weight = torch.randn(256, 256, device="cuda")
    q = exl3.quantize(weight, 3, codebook)
    assert q.trellis.is_cuda and exl3.proxy_error(weight, q) < 0.025


# ---------------------------------------------------------------------------------------------
# Measurements for the report: python tests/test_exl3.py


def measure(bits_list: list[float], codebooks: list[str]) -> None:
    torch.set_num_threads(1)
    print("NMSE of exl3.quantize (no Hessian, default scale search), 128x256 weights (128 tiles)")
    print(f"{'K':>4} {'codebook':>8} {'gaussian':>9} {'student-t3':>10} {'CPU s':>6}")
    for bits in bits_list:
        for codebook in codebooks:
            row = []
            cpu = time.process_time()
            for dist in ("gaussian", "t3"):
                torch.manual_seed(int(bits * 10))
                w = torch.randn(128, 256) if dist == "gaussian" else torch.distributions.StudentT(3.0).sample((128, 256))
                row.append(exl3.proxy_error(w, exl3.quantize(w, bits, codebook)))
            cpu = (time.process_time() - cpu) / 2
            print(f"{bits:>4} {codebook:>8} {row[0]:>9.4f} {row[1]:>10.4f} {cpu:>6.1f}", flush=True)
    print("Viterbi speed, 1 thread, 64 tiles (CPU time, so a loaded machine does not distort it)")
    for bits in bits_list:
        tiles = torch.randn(64, 256)
        cpu = time.process_time()
        exl3.quantize_tiles(tiles, bits, codebooks[0])
        print(f"K={bits} {codebooks[0]}: {64 / (time.process_time() - cpu):.1f} tiles/s", flush=True)


if __name__ == "__main__":
    # python tests/test_exl3.py [K ...] [codebook ...]
    import sys
    args = sys.argv[1:]
    measure([float(a) for a in args if a not in exl3.CODEBOOKS] or [2, 3, 4],
            [a for a in args if a in exl3.CODEBOOKS] or ["3inst", "mul1"])

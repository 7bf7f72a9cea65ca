"""bench.py: the floor arithmetic against performance.md's own numbers, and the CPU smoke run of the
model benchmark (the GPU runs cannot happen here)."""
import math

import pytest
import torch

import bench


@pytest.fixture(scope="module")
def full_budget(fixtures_dir):
    cfg = bench.model_config(None, tiny=False)
    return bench.Budget.of(cfg, bench.layer_bits(cfg, 3.25), "fp8", dtype_bytes=2)


def test_experts_touched_is_spec_e_of_b(full_budget):
    # performance.md §0: distinct experts per MoE layer 8 / 30.7 / 104.5 / 240.5 of 288
    got = [round(full_budget.experts_touched(b), 1) for b in (1, 4, 16, 64)]
    assert got == [8.0, 30.7, 104.5, 240.5]


def test_bytes_and_flops_match_the_spec(full_budget):
    # §3: expert_bytes 12.62 MB at K4; K3 layers hold 3/4 of its trellis bytes.
    assert sorted({round(b / 1e6, 2) for b in full_budget.expert_bytes.values()}) == [9.47, 12.62]
    # §0: K3.25 + all-FP8 core, batch 1 at 32K: 12.34 GB/token. Here kv_b and the indexer's
    # weights_proj stay BF16 (+0.18 GB) and the K mix is 3.26 bits: within 1.5 %.
    assert math.isclose(full_budget.decode_bytes(1, 32768), 12.34e9, rel_tol=0.015)
    # §4: batch scaling at 4.3 TB/s: 744 / 1,169 / 2,064 tok/s (same 1.5 % allowance)
    for batch, rate in ((4, 744), (16, 1169), (64, 2064)):
        assert math.isclose(batch * 4.3e12 / full_budget.decode_bytes(batch, 32768), rate, rel_tol=0.015)
    # §6: 34.1 / 35.3 / 37.0 GFLOP per token for 2K / 8K / 128K prompts
    for T, gflop in ((2048, 34.1), (8192, 35.3), (131072, 37.0)):
        assert round(full_budget.prefill_flops(T) / T / 1e9, 1) == gflop


def test_layer_subsets_keep_the_pattern(fixtures_dir):
    cfg = bench.model_config(8, tiny=False)
    assert cfg.layer_types == ("kda",) * 3 + ("dsa",) + ("kda",) * 3 + ("dsa",)
    assert cfg.mlp_layer_types == ("dense",) * 3 + ("sparse",) * 5 and cfg.num_nextn_predict_layers == 0
    bits = bench.layer_bits(bench.model_config(None, tiny=False), 3.25)
    assert len(bits) == 42 and sum(k == 4 for k in bits.values()) == 11
    with pytest.raises(ValueError, match="--layers 46"):
        bench.model_config(46, tiny=False)
    with pytest.raises(ValueError, match="--bits 3.5"):
        bench.layer_bits(cfg, 3.5)


def test_tiny_model_runs_every_section_on_cpu():
    """The reference path: the fast step runs its kernels in the interpreter on CPU, far too slowly
    for every section (tests/test_fastdecode.py holds it to the reference)."""
    with torch.inference_mode():
        rows = bench.run_model(bench.parse(["model", "--device", "cpu", "--tiny", "--steps", "2",
                                            "--context", "64", "--budget", "600", "--reference"]))
    names = [r.what for r in rows]
    assert names == ["decode B=1 ctx 64 (reference)", "prefill 64 (reference)", "decode B=1 ctx 512 (reference)",
                     "decode B=4 ctx 64 (reference)", "decode B=16 ctx 64 (reference)", "prefill 256 (reference)"]
    for r in rows:
        assert 0 < r.measured < r.floor < math.inf, r

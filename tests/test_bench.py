"""bench.py and synthetic.py: the floor arithmetic against performance.md's own numbers, the synthetic
model's sizes and layouts, and the CPU smoke run of the model benchmark (the GPU runs cannot happen here)."""
import math

import pytest
import torch

import bench
import placement
import synthetic
from cache import CachePool, LayerRows
from model_glm import GLMModel, SeqChunk
from placement import PlacementError


@pytest.fixture(scope="module")
def full_budget(fixtures_dir):
    cfg = synthetic.model_config(None, tiny=False)
    return bench.Budget.of(cfg, synthetic.layer_bits(cfg, 3.25), "fp8", dtype_bytes=2)


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
    cfg = synthetic.model_config(8, tiny=False)
    assert cfg.layer_types == ("kda",) * 3 + ("dsa",) + ("kda",) * 3 + ("dsa",)
    assert cfg.mlp_layer_types == ("dense",) * 3 + ("sparse",) * 5 and cfg.num_nextn_predict_layers == 0
    bits = synthetic.layer_bits(synthetic.model_config(None, tiny=False), 3.25)
    assert len(bits) == 42 and sum(k == 4 for k in bits.values()) == 11
    with pytest.raises(ValueError, match="--layers 46"):
        synthetic.model_config(46, tiny=False)
    with pytest.raises(ValueError, match="--bits 3.5"):
        synthetic.layer_bits(cfg, 3.5)


# The tiny model's rows, in bench's order: the figures first (what a --budget cut keeps).
TINY_ROWS = ["decode B=1 ctx 64 (reference)", "decode B=4 ctx 64 (reference)", "decode B=16 ctx 64 (reference)",
             "decode B=1 ctx 512 (reference)", "prefill 64 (reference)", "prefill 256 (reference)"]


def test_tiny_model_runs_every_section_on_cpu(monkeypatch):
    """The reference path: the fast step runs its kernels in the interpreter on CPU, far too slowly
    for every section (tests/test_fastdecode.py holds it to the reference). The process started long
    ago here: --budget counts only the timed sections, not what came before them (on a cold GPU machine
    building and compiling took the whole budget)."""
    monkeypatch.setattr(bench, "START", bench.START - 10_000)
    with torch.inference_mode():
        rows = bench.run_model(bench.parse(["model", "--device", "cpu", "--tiny", "--steps", "2",
                                            "--context", "64", "--budget", "600", "--reference"]))
    assert [r.what for r in rows] == TINY_ROWS
    for r in rows:
        assert 0 < r.measured < r.floor < math.inf, r


def test_exclusive_times_count_overlapping_device_time_once():
    """A kernel beside another (a second stream), one launched early that waits for the one before (PDL),
    a gap: each event's share is its time that no earlier-started event covers; shares and idle sum to
    the span. Given out of order."""
    spans = [("c", 12.0, 20.0), ("a", 0.0, 10.0), ("pdl", 15.0, 25.0), ("beside", 5.0, 8.0), ("a", 26.0, 27.0)]
    shares, span, idle = bench.exclusive_times(spans)
    assert shares == {"a": (2, 11.0), "beside": (1, 0.0), "c": (1, 8.0), "pdl": (1, 5.0)}
    assert (span, idle) == (27.0, 3.0)
    assert sum(us for _, us in shares.values()) + idle == span
    assert bench.exclusive_times([]) == ({}, 0.0, 0.0)


def test_profile_leaves_the_first_call_out(capsys):
    """A step's first call compiles and autotunes its kernels (on an H100 a first prefill put 30 s of idle
    device time into its profile): profile_step runs the step once before profiling it."""
    profiled = []
    chunk = SeqChunk(torch.ones(1, dtype=torch.long), 0, torch.arange(1), 0)
    bench.profile_step(lambda chunks: profiled.append(torch.autograd._profiler_enabled()), chunk,
                       [torch.device("cpu")], "a step")
    assert profiled == [False, True]
    assert "profile of a step" in capsys.readouterr().out


@pytest.mark.parametrize("core, dtype, bits", [("fp8", torch.float32, 3.25), ("bf16", torch.bfloat16, 4),
                                               ("fp8", torch.bfloat16, 2)])
def test_weight_sizes_are_what_build_weights_allocates(core, dtype, bits):
    cfg = synthetic.model_config(None, tiny=True)
    k = synthetic.layer_bits(cfg, bits)
    built = placement.sizes_of(synthetic.build_weights(cfg, k, core, dtype, torch.device("cpu")))
    assert synthetic.weight_sizes(cfg, k, core, dtype) == built


def test_k4_plan_refuses_one_h200_and_splits_over_two(fixtures_dir):
    """Full size, K4 experts: refused on one device of an H200's free memory less the 8 GB reserve,
    with the numbers, before anything is built; two such devices hold it, layers on each."""
    cfg = synthetic.model_config(None, tiny=False)
    bits, budget = synthetic.layer_bits(cfg, 4), 141 * 10**9
    with pytest.raises(PlacementError, match=r"does not fit: \[0\] cpu needs 15\d\.\d\d GiB .* has 131\.32 GiB"):
        synthetic.plan_model(cfg, bits, "fp8", torch.bfloat16, [torch.device("cpu")], [budget], 2049, 16)
    plan = synthetic.plan_model(cfg, bits, "fp8", torch.bfloat16, [torch.device("cpu")] * 2, [budget] * 2, 2049, 16)
    assert set(plan.layer_device) == {0, 1}
    assert sum(plan.weight_bytes) == bench.Budget.of(cfg, bits, "fp8", dtype_bytes=2).all_bytes
    need = [b + c for b, c in zip(plan.weight_bytes, plan.cache_bytes)]
    assert max(need) < 0.52 * sum(need)


def test_tiny_model_runs_every_section_on_two_cpu_devices():
    """The same sections over a layer split (placement over "cpu", "cpu": the cache rows in LayerRows)."""
    with torch.inference_mode():
        rows = bench.run_model(bench.parse(["model", "--devices", "cpu,cpu", "--tiny", "--steps", "2",
                                            "--context", "64", "--budget", "600", "--reference"]))
    assert [r.what for r in rows] == TINY_ROWS


def test_two_cpu_devices_give_the_one_device_weights_and_decode_logits():
    cfg = synthetic.model_config(None, tiny=True)
    bits, blocks = synthetic.layer_bits(cfg, 3.25), 4
    logits, weights = [], []
    for devices in (["cpu"], ["cpu", "cpu"]):
        plan = synthetic.plan_model(cfg, bits, "fp8", torch.float32, [torch.device(d) for d in devices],
                                [None] * len(devices), 2 * blocks, 2)
        w = synthetic.build_weights(cfg, bits, "fp8", torch.float32, plan.device_of, seed=3)
        model = GLMModel(cfg, w, plan)
        cache = CachePool(cfg, 2 * blocks, 2, block_size=synthetic.BLOCK_SIZE, dtype=torch.float32,
                          device=list(plan.devices), layer_device=dict(enumerate(plan.layer_device)))
        assert isinstance(cache.latent, LayerRows) == (len(devices) == 2)
        gen = torch.Generator().manual_seed(4)
        tables = [torch.arange(b * blocks, (b + 1) * blocks) for b in range(2)]
        for b in range(2):
            synthetic.fill_context(cache, tables[b], b, 100, gen)
        with torch.inference_mode():
            batch = [bench.SeqChunk(torch.tensor([5 + b]), 100, tables[b], b) for b in range(2)]
            logits.append(model.forward(batch, cache).logits)
        weights.append(w)
    weights.append(synthetic.build_weights(cfg, bits, "fp8", torch.float32, torch.device("cpu"), seed=3))
    assert set(plan.layer_device) == {0, 1}
    values = [{(n, k): t for n, x in w.items()
               for k, t in ({"": x} if isinstance(x, torch.Tensor) else x.tensors()).items()} for w in weights]
    assert values[0].keys() == values[1].keys() == values[2].keys()
    assert all(torch.equal(values[0][key], v[key]) for v in values[1:] for key in values[0])
    assert torch.equal(logits[0], logits[1])


def test_a_model_cut_to_kda_layers_plans_and_decodes():
    """`--layers 1` keeps one KDA layer and no DSA layer: the cache has no DSA rows (the H200's
    `--layers 2` run failed in CachePool on an empty list of rows), and a decode step still runs."""
    cfg = synthetic.model_config(1, tiny=True)
    assert cfg.dsa_layers == () and cfg.mtp_layer is None
    bits = synthetic.layer_bits(cfg, 3.25)
    plan = synthetic.plan_model(cfg, bits, "fp8", torch.float32, [torch.device("cpu")], [None], 2, 1)
    model = GLMModel(cfg, synthetic.build_weights(cfg, bits, "fp8", torch.float32, plan.device_of, seed=3), plan)
    cache = CachePool(cfg, 2, 1, block_size=synthetic.BLOCK_SIZE, dtype=torch.float32)
    assert cache.latent.shape[0] == 0 and cache.kda_state.shape[0] == 1
    with torch.inference_mode():
        out = model.forward([bench.SeqChunk(torch.tensor([5, 6]), 0, torch.arange(2), 0)], cache)
    assert out.logits.shape == (1, cfg.vocab_size) and out.logits.isfinite().all()


def test_engine_section_runs_on_cpu(capsys):
    """`bench.py engine` on the tiny model: a rate for each batch and sampling (no fast step on a CPU)."""
    with torch.inference_mode():
        bench.run_engine(bench.parse(["engine", "--device", "cpu", "--tiny", "--batch", "1", "2", "--context", "20",
                                      "--tokens", "4"]))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("engine decode")]
    assert [line.split(":")[0] for line in lines] == [f"engine decode B={b} ctx 20 {label}"
                                                      for b in (1, 2) for label, _ in bench.ENGINE_SAMPLING]
    assert all(float(line.split(": ")[1].split(" tok/s")[0]) > 0 for line in lines)

"""One process, several devices (placement.py): the plan, its refusal, and a split that changes no output.

Two "cpu" entries run exactly the multi-device code path (per-layer device strings, .to() copies of
the streams, cache rows in runs per device, partial expert sums added on the layer's device) on a
machine without GPUs. References are the same checkpoint on one device.
"""
from __future__ import annotations

import math

import pytest
import torch

import checkpoint
import engine as E
import fastdecode
import fastprefill
import placement
import serve
import tiny
import cache as cache_mod
from cache import CachePool, LayerRows
from model_glm import GLMConfig, GLMModel, SeqChunk
from test_engine import make_tokenizer

BS = 16
OPTS = dict(dtype=torch.float32, progress=False, num_blocks=16, block_size=BS, max_num_seqs=2)
GREEDY = E.SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
PAIR = ["cuda:0", "cuda:1"] if torch.cuda.is_available() else ["cpu", "cpu"]
# A GPU machine needs two GPUs for a split: a device may be listed once (Triton runs no cpu tensors there).
NEEDS_PAIR = pytest.mark.skipif(torch.cuda.device_count() == 1, reason="needs two GPUs (a device is listed once)")


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(2, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # Top-4 of 8 experts: a token's experts often span both halves, so the expert split's two
    # partial sums really reassociate the routed sum (with top-2, 0 + a + b rounds the same either way).
    path = tiny.make_tiny_checkpoint(tmp_path_factory.mktemp("devices") / "ckpt", experts="exl3",
                                     num_experts_per_tok=4)
    make_tokenizer(512).save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def one(ckpt):
    return E.load(ckpt, device="cpu", **OPTS)


# ---------------------------------------------------------------------------------------------
# The plan


def test_weight_bytes_are_what_loading_makes(ckpt):
    cfg = GLMConfig.from_file(ckpt)
    for dtype in (torch.float32, torch.bfloat16):
        planned = checkpoint.weight_bytes(ckpt, cfg, dtype)
        loaded = placement.sizes_of(checkpoint.load_weights(ckpt, cfg, dtype, progress=False))
        assert planned == loaded


def test_plan_is_printed_and_balanced(ckpt, capsys):
    eng = E.load(ckpt, devices=["cpu", "cpu"], speculator="mtp", **OPTS)  # (only the MTP speculator loads it)
    printed = capsys.readouterr().out
    p = eng.model.placement
    assert "placement: 2 device(s), layer split" in printed
    assert "[0] cpu     embed_tokens, norm, lm_head; layers 0-" in printed and "MTP layer 4" in printed
    assert p.layer_device == tuple(sorted(p.layer_device)) and set(p.layer_device) == {0, 1}
    # Weights and cache rows are where the plan says.
    for name in ("embed_tokens.weight", "lm_head.weight", "layers.3.self_attn.q_a_proj.weight"):
        assert eng.model.placement.index_of(name) == (0 if "layers" not in name else p.layer_device[3])
    assert isinstance(eng.cache.kda_state, LayerRows) and isinstance(eng.cache.latent, LayerRows)


def test_layer_split_is_the_best_contiguous_cut(ckpt):
    cfg = GLMConfig.from_file(ckpt)
    sizes = checkpoint.weight_bytes(ckpt, cfg, torch.float32)
    p = placement.plan(cfg, sizes, ["cpu", "cpu"])
    n_layers = len(p.layer_device)
    head = sum(b for k, b in sizes.items() if not k.startswith("layers."))
    layer = [sum(b for k, b in sizes.items() if k.startswith(f"layers.{L}.")) for L in range(n_layers)]
    assert sum(p.weight_bytes) == sum(sizes.values()) and p.weight_bytes[0] == head + sum(
        layer[L] for L in range(n_layers) if p.layer_device[L] == 0)
    best = min(max(head + sum(layer[:c]), sum(layer[c:])) for c in range(n_layers + 1))
    assert max(p.weight_bytes) == best


def test_unequal_budgets_move_layers(ckpt):
    cfg = GLMConfig.from_file(ckpt)
    sizes = checkpoint.weight_bytes(ckpt, cfg, torch.float32)
    even = placement.plan(cfg, sizes, ["cpu", "cpu"], budgets=[1 << 30, 1 << 30])
    small_second = placement.plan(cfg, sizes, ["cpu", "cpu"], budgets=[1 << 30, 1 << 27])
    assert small_second.layer_device.count(1) < even.layer_device.count(1)


def test_a_plan_that_does_not_fit_is_refused_before_loading(ckpt, monkeypatch):
    def no_read(*args, **kwargs):
        raise AssertionError("weights were read before the plan was checked")
    monkeypatch.setattr(checkpoint, "load_weights", no_read)
    cfg = GLMConfig.from_file(ckpt)
    total = sum(checkpoint.weight_bytes(ckpt, cfg, torch.float32).values())
    with pytest.raises(placement.PlacementError) as err:
        E.load(ckpt, devices="cpu,cpu", memory_per_device=total // 4, **OPTS)
    msg = str(err.value)
    assert "placement does not fit: [0] cpu needs" in msg and f"has {placement._size(total // 4)}" in msg
    assert "[1] cpu" in msg  # the whole plan follows, every device with its numbers
    with pytest.raises(ValueError, match="memory_per_device has 3 entries for 2 devices"):
        E.load(ckpt, devices="cpu,cpu", memory_per_device=[1, 2, 3], **OPTS)


def test_full_size_k4_needs_two_h200s(fixtures_dir):
    """The target: the real config with K4 EXL3 experts and a BF16 core (as loaded; ~163 GiB) does
    not fit one H200 (~139 GiB free) and is refused with the numbers; two hold it either way."""
    cfg = GLMConfig.from_file(fixtures_dir / "glm53" / "config.json")
    sizes = {}
    for name, spec in checkpoint.expected_tensors(cfg).items():
        out_f, in_f = spec.shape[0], spec.shape[-1]
        sizes[name] = in_f * out_f * 4 // 8 + 2 * (in_f + out_f) if checkpoint.is_routed_expert(name) else \
            math.prod(spec.shape) * (4 if spec.fp32 else 2)
    h200 = 139 * 2**30
    with pytest.raises(placement.PlacementError, match=r"\[0\] cpu needs 16\d\.\d\d GiB .*has 139\.00 GiB"):
        placement.plan(cfg, sizes, ["cpu"], budgets=[h200])
    for split_experts in (False, True):
        p = placement.plan(cfg, sizes, ["cpu", "cpu"], split_experts=split_experts, budgets=[h200, h200])
        assert max(p.weight_bytes) < 0.51 * sum(p.weight_bytes) and p.layer_device[-1] == 1


@pytest.mark.parametrize("spec,why", [
    ("gpu", "'gpu' is not a device"), ("meta", "only cpu and cuda"), ("", "'' is not a device"),
    (f"cuda:{torch.cuda.device_count()}", f"this machine has {torch.cuda.device_count()} CUDA device"),
])
def test_bad_device_lists(spec, why):
    with pytest.raises(placement.PlacementError, match=why):
        placement.parse_devices(spec)


def test_serve_devices_flag(capsys):
    args = serve.parse_args(["--devices", "cpu, cpu", "--split-experts"])
    assert args.devices == (torch.device("cpu"), torch.device("cpu")) and args.split_experts
    for argv, why in ((["--devices", "cpu,tpu"], "not a device"),
                      (["--devices", f"cuda:{torch.cuda.device_count()}"], "CUDA device"),
                      (["--device", "cpu", "--devices", "cpu,cpu"], "give --device or --devices"),
                      (["--split-experts"], "--split-experts needs --devices")):
        with pytest.raises(SystemExit):
            serve.parse_args(argv)
        assert why in capsys.readouterr().err


def test_serve_loads_on_two_devices(ckpt):
    srv = serve.Server(serve.parse_args(["--model", str(ckpt), "--port", "0", "--devices", "cpu,cpu",
                                         "--split-experts", "--dtype", "float32", "--max-cache-tokens", "256"]))
    srv.serve_in_thread()  # (shutdown waits for the HTTP loop to stop)
    try:
        srv.load()  # its warm-up generates through the split model
        p = srv.engine.model.placement
        assert srv.ready.is_set() and len(p.devices) == 2 and p.split_experts and set(p.layer_device) == {0, 1}
    finally:
        srv.shutdown()


# ---------------------------------------------------------------------------------------------
# The cache rows


def test_layer_rows_read_and_write_across_runs():
    cfg = GLMConfig.from_dict(tiny.tiny_config_dict())
    pool = CachePool(cfg, 2, 3, block_size=BS, dtype=torch.float32, device=["cpu", "cpu"],
                     layer_device={0: 0, 1: 0, 2: 1, 3: 1, 4: 1})
    kda = pool.kda_state  # KDA layers 0 (device 0) and 2 (device 1)
    assert isinstance(kda, LayerRows) and [p.shape[0] for p in kda.parts] == [1, 1]
    assert [p.shape[0] for p in pool.latent.parts] == [1, 2]  # DSA layer 1, then layer 3 and MTP
    value = torch.randn(kda.shape[0], *kda.shape[2:])
    kda[:, 1] = value
    assert torch.equal(kda[:, 1], value) and torch.equal(kda[1, 1], value[1])
    assert torch.equal(kda.parts[1][0, 1], value[1]) and not kda[:, 0].any()
    kda[0, 2] = 1.0
    assert kda.parts[0][0, 2].eq(1).all()
    with pytest.raises(TypeError, match="an int or ':'"):
        kda[0:1]
    assert pool.bytes_per_sequence() == CachePool(cfg, 2, 3, block_size=BS, dtype=torch.float32).bytes_per_sequence()


def test_pool_bytes_is_what_a_pool_allocates():
    """What a plan reserves per layer (engine.load, bench.py) sums to the pool's tensors, MTP row included."""
    cfg = GLMConfig.from_dict(tiny.tiny_config_dict())
    for dtype in (torch.float32, torch.bfloat16):
        pool = CachePool(cfg, 5, 3, block_size=BS, dtype=dtype)
        tensors = (pool.latent, pool.index_k, pool.gate, pool.pooled, pool.kda_state, pool.conv_state)
        assert sum(cache_mod.pool_bytes(cfg, 5, 3, BS, dtype).values()) == sum(t.numel() * t.element_size()
                                                                            for t in tensors)


# ---------------------------------------------------------------------------------------------
# A split changes no output


@pytest.mark.parametrize("split_experts", [False, True])
def test_split_matches_one_device(ckpt, one, split_experts):
    two = E.load(ckpt, devices=["cpu", "cpu"], split_experts=split_experts, **OPTS)
    assert two.model.placement.split_experts == split_experts
    prompts = [prompt(1, 23), prompt(2, 9)]
    assert [r.token_ids for r in two.generate(prompts, GREEDY)] == [r.token_ids for r in one.generate(prompts, GREEDY)]
    ids = prompt(3, 40)
    ref, got = one.score(ids, chunk_tokens=17), two.score(ids, chunk_tokens=17)
    if split_experts:  # the routed sum is added in two partials: only the rounding may differ
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    else:  # same arithmetic in the same order
        assert torch.equal(got, ref)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_decode_in_span_graphs_as_one_gpu(ckpt):
    """A layer split over two GPUs on the fast path: one CUDA graph per span (each captured on its
    own device's stream; a span captured on another device's stream records nothing and is skipped
    at replay), greedy tokens equal to one GPU's reference path, fp32."""
    two = E.load(ckpt, devices=["cuda:0", "cuda:1"], **OPTS)
    spans = two.fast.spans
    assert len({s.device for s in spans}) == 2 and all(len(pieces) == len(spans) for pieces in two.fast.graphs.values())
    ref = E.load(ckpt, device="cuda:0", use_kernels=False, **OPTS)
    prompts = [prompt(1, 23), prompt(2, 9)]
    assert [r.token_ids for r in two.generate(prompts, GREEDY)] == [r.token_ids for r in ref.generate(prompts, GREEDY)]


def test_mtp_and_rollback_across_devices(ckpt, one):
    """MTP drafts (the MTP layer on the second device, embedding and head on the first) and the
    KDA rollback (inputs kept on the first device, replayed on each layer's) give the plain tokens."""
    two = E.load(ckpt, devices=["cpu", "cpu"], split_experts=True, speculator="mtp", draft_tokens=2, **OPTS)
    assert two.model.placement.layer_device[-1] == 1
    ids = prompt(4, 11)
    r = two.generate([ids], GREEDY)[0]
    assert r.token_ids == one.generate([ids], GREEDY)[0].token_ids and r.acceptance.verify_steps > 0


def test_prefix_cache_snapshots_across_devices(ckpt, one):
    two = E.load(ckpt, devices=["cpu", "cpu"], **OPTS)
    ids = prompt(5, 2 * BS + 3)
    first = two.generate([ids], GREEDY)[0]
    again = two.generate([ids], GREEDY)[0]  # restores the KDA snapshot into rows on both devices
    assert again.usage.cached_tokens > 0 and again.token_ids == first.token_ids
    assert first.token_ids == one.generate([ids], GREEDY)[0].token_ids


def test_model_rejects_weights_off_their_planned_device():
    cfg = GLMConfig.from_dict(tiny.tiny_config_dict())
    weights = tiny.random_weights(cfg)
    plan = placement.plan(cfg, placement.sizes_of(weights), ["cpu", "meta"])
    with pytest.raises(ValueError, match="is on cpu, the placement puts it on meta"):
        GLMModel(cfg, weights, plan)
    model = GLMModel(cfg, weights)
    assert model.placement.devices == (torch.device("cpu"),) and set(model.placement.layer_device) == {0}
    out = model.forward([SeqChunk(torch.tensor(prompt(6, 5)), 0, torch.tensor([0]), 0)],
                        CachePool(cfg, 1, 1, block_size=BS, dtype=torch.float32))
    assert out.logits.shape == (1, cfg.vocab_size)


@NEEDS_PAIR
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the interpreter's sigmoid
def test_fast_path_runs_a_layer_split(ckpt):
    """The kernels' prefill (FastPrefill) and decode step (FastDecoder, three spans, eager) over a layer
    split on two "cpu" devices (the kernels interpreted), or on a GPU machine two CUDA devices, against
    the reference forward of the same split model on other blocks and another slot; an expert split is
    refused by name."""
    eng = E.load(ckpt, devices=PAIR, **OPTS)
    assert len(set(eng.model.placement.layer_device)) == 2
    fast = fastdecode.FastDecoder(eng.model, eng.cache, max_context=64)
    assert len(fast.spans) == 3
    ids, table = torch.tensor(prompt(6, 21)), torch.arange(4)
    reference = lambda tokens, start: eng.model.forward([SeqChunk(tokens, start, table + 4, 1)], eng.cache).logits
    got = fastprefill.FastPrefill(fast).forward([SeqChunk(ids, 0, table, 0)]).logits
    ref = reference(ids, 0)
    # the EXL3 expert kernels take fp16 activations (tests/test_fastprefill.py: the same bound)
    torch.testing.assert_close(got, ref, rtol=0, atol=5e-3)
    token = ref.argmax(-1).cpu()  # then one decode step with the reference's greedy token
    got = fast.step([SeqChunk(token, ids.shape[0], table, 0)]).logits
    torch.testing.assert_close(got, reference(token, ids.shape[0]), rtol=0, atol=5e-3)
    split = E.load(ckpt, devices=PAIR, split_experts=True, **OPTS)
    with pytest.raises(fastdecode.Unsupported, match="split over devices"):
        fastdecode.FastDecoder(split.model, split.cache, max_context=64)


def test_decode_spans_follow_the_layer_runs():
    """The decode step's graph pieces: one per run of consecutive layers on a device, the embedding
    and head joining a run on the first device or standing alone."""
    a, b = torch.device("cpu"), torch.device("meta")
    spans = lambda layout: [(s.device.type, s.embed, s.start, s.end, s.head)
                            for s in fastdecode._spans(layout, (a, b))]
    assert spans([0, 0, 0]) == [("cpu", True, 0, 3, True)]
    assert spans([0, 0, 1]) == [("cpu", True, 0, 2, False), ("meta", False, 2, 3, False), ("cpu", False, 3, 3, True)]
    assert spans([1, 0, 0]) == [("cpu", True, 0, 0, False), ("meta", False, 0, 1, False), ("cpu", False, 1, 3, True)]
    assert spans([0, 1, 0]) == [("cpu", True, 0, 1, False), ("meta", False, 1, 2, False), ("cpu", False, 2, 3, True)]

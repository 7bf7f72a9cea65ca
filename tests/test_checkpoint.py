"""checkpoint.py: the layout against the real shard headers, negative cases, and round trips."""
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import bench
import checkpoint
import exl3
import fp8
from checkpoint import CheckpointError
import tiny
from model_glm import GLMConfig

# ---------------------------------------------------------------------------------------------
# The real checkpoint's headers (62 shards, no data)


@pytest.fixture(scope="module")
def real_config(fixtures_dir):
    return GLMConfig.from_file(fixtures_dir / "glm53" / "config.json")


@pytest.fixture(scope="module")
def real_inventory(fixtures_dir):
    inventory = {}
    files = sorted((fixtures_dir / "glm53" / "headers").glob("*.header.json"))
    assert len(files) == 62
    for f in files:
        for name, entry in json.loads(f.read_text()).items():
            if name != "__metadata__":
                inventory[name] = (entry["dtype"], tuple(entry["shape"]))
    return inventory


def test_real_headers_fully_claimed(real_inventory, real_config):
    assert len(real_inventory) == 76_108
    plan = checkpoint.check_inventory(real_inventory, real_config)
    claimed = [k for s in plan.stored.values() for k in s.keys.values()]
    assert len(claimed) == len(set(claimed))
    assert len(plan.skipped) == 347 and all(k.startswith("model.visual.") for k in plan.skipped)
    assert set(claimed) | set(plan.skipped) == set(real_inventory)
    # spec §2.7: trunk 74,001 keys (embed, norm, lm_head, layers 0..44), MTP layer 45: 1,760 keys
    mtp = [k for k in claimed if k.startswith("model.language_model.layers.45.")]
    assert len(mtp) == 1_760
    assert len(claimed) - len(mtp) == 3 + 45 * 8 + 34 * 15 + 11 * 18 + 3 * 6 + 42 * 1736 == 74_001
    # every claimed tensor has the shape the config implies
    specs = checkpoint.expected_tensors(real_config)
    assert set(plan.stored) == set(specs)
    for name, s in plan.stored.items():
        assert real_inventory[s.keys["weight"]][1] == specs[name].shape, name
    fp8 = [n for n, s in plan.stored.items() if s.format == "fp8"]
    assert len(fp8) == 43 * 288 * 3 + 43 * 3 + 3 * 3 + 12 * 4  # experts, shared, dense, 4 MLA per DSA layer
    assert all(checkpoint.fp8_in_official_release(real_config, n) for n in fp8)
    assert sum(checkpoint.fp8_in_official_release(real_config, n) for n in specs) == len(fp8)
    assert plan.stored["layers.3.self_attn.kv_a_proj_with_mqa.weight"].keys["weight_scale_inv"] == \
        "model.language_model.layers.3.self_attn.kv_a_proj_with_mqa.weight_scale_inv"
    assert specs["layers.45.self_attn.kv_a_proj_with_mqa.weight"].shape == (512, 4096)
    assert specs["layers.0.self_attn.A_log"].fp32 and specs["layers.44.hc_ffn_base"].fp32


def test_real_headers_without_the_mtp_layer(real_inventory, real_config):
    """mtp=False (a server without the MTP speculator): layer 45's 1,760 keys are checked, then left out."""
    plan = checkpoint.check_inventory(real_inventory, real_config, mtp=False)
    mtp_keys = {k for k in real_inventory if k.startswith("model.language_model.layers.45.")}
    assert len(mtp_keys) == 1_760 and mtp_keys <= set(plan.skipped)
    assert not any(n.startswith("layers.45.") for n in plan.stored)
    assert len(plan.stored) == len(checkpoint.expected_tensors(real_config.without_mtp()))
    inv = dict(real_inventory)
    inv["model.language_model.layers.45.eh_proj.weight"] = ("BF16", (4096, 4096))
    with pytest.raises(CheckpointError, match=r"layers.45.eh_proj.weight.*\[4096, 4096\]"):
        checkpoint.check_inventory(inv, real_config, mtp=False)


def _error(inventory, config) -> str:
    with pytest.raises(CheckpointError) as e:
        checkpoint.check_inventory(inventory, config)
    return str(e.value)


def test_real_headers_negative(real_inventory, real_config):
    inv = dict(real_inventory)
    gone = "model.language_model.layers.17.mlp.experts.200.up_proj.weight"
    del inv[gone]
    msg = _error(inv, real_config)
    assert gone + ": missing" in msg and "1 problem" in msg  # its orphaned scale is not reported twice

    # Several faults at once: each is reported, naming its key (one pass over the 76k keys).
    inv = dict(real_inventory)
    shape_key = "model.language_model.layers.7.self_attn.kv_a_proj_with_mqa.weight"
    inv[shape_key] = ("F8_E4M3", (576, 4096))  # the DeepSeek RoPE rows this model does not have
    norm_key = "model.language_model.layers.12.post_attention_layernorm.weight"
    inv[norm_key] = ("F8_E4M3", (4096,))  # only linears may be FP8
    scale_key = "model.language_model.layers.3.mlp.experts.0.down_proj.weight_scale_inv"
    inv[scale_key] = ("BF16", (32, 16))
    alog_key = "model.language_model.layers.0.self_attn.A_log"
    inv[alog_key] = ("I32", (64,))
    extra_key = "model.language_model.layers.3.self_attn.rotary_emb.inv_freq"
    inv[extra_key] = ("F32", (64,))
    msg = _error(inv, real_config)
    assert "5 problem" in msg
    assert f"{shape_key}: shape [576, 4096] in the checkpoint, [512, 4096] expected" in msg
    assert f"{norm_key}: dtype F8_E4M3" in msg
    assert f"{scale_key}: is BF16 [32, 16], expected F32 [32, 16]" in msg
    assert f"{alog_key}: dtype I32" in msg
    assert f"{extra_key}: unexpected" in msg


def test_real_headers_wrong_config(real_inventory, fixtures_dir):
    d = json.loads((fixtures_dir / "glm53" / "config.json").read_text())
    d["text_config"]["index_kpool"] = 16  # the transformers class default (spec §8.1)
    msg = _error(real_inventory, GLMConfig.from_dict(d))
    assert "index_kpool_compress_ape: shape [4, 128]" in msg and "[16, 128]" in msg


def _expand(pattern_file: Path) -> dict:
    def ids(field: str) -> list:
        out = []
        for part in filter(None, field.split(",")):
            lo, _, hi = part.partition("-")
            out += range(int(lo), int(hi or lo) + 1)
        return out or [None]

    inventory = {}
    lines = pattern_file.read_text().splitlines()
    for line in lines[1:]:
        pattern, dtype, shape, count, L, E, B = (line.split("\t") + [""] * 7)[:7]
        shape = tuple(json.loads(shape))
        names = [pattern]
        for tag, field in (("{L}", L), ("{E}", E), ("{B}", B)):
            names = [n.replace(tag, str(i)) for n in names for i in ids(field)] if tag in pattern else names
        assert len(names) == int(count), pattern
        inventory |= {n: (dtype, shape) for n in names}
    return inventory


def test_exl3_tr3_inventory(fixtures_dir, real_config):
    inventory = _expand(fixtures_dir / "glm53" / "exl3-tr3-4bpw.tensor-patterns.tsv")
    assert len(inventory) == 150_226
    plan = checkpoint.check_inventory(inventory, real_config)
    formats = {}
    for name, s in plan.stored.items():
        formats.setdefault(s.format, []).append(name)
    assert len(formats["exl3"]) == 43 * 288 * 3 and all(checkpoint.is_routed_expert(n) for n in formats["exl3"])
    assert set(formats) == {"plain", "exl3"}
    s = plan.stored["layers.45.mlp.experts.287.down_proj.weight"]
    assert set(s.keys) == {"trellis", "suh", "svh", "mcg"}
    assert len(plan.skipped) == 347

    bad = dict(inventory)
    key = "model.language_model.layers.9.mlp.experts.5.gate_proj.trellis"
    bad[key] = ("I16", (128, 256, 64))  # transposed: the trellis is (in/16, out/16, 16K)
    del bad["model.language_model.layers.9.mlp.experts.6.up_proj.suh"]
    width_key = "model.language_model.layers.10.mlp.experts.7.down_proj.trellis"
    bad[width_key] = ("I16", (128, 256, 20))
    mul1_key = "model.language_model.layers.11.mlp.experts.8.up_proj"
    del bad[mul1_key + ".mcg"]
    bad[mul1_key + ".trellis"] = ("I16", (256, 128, 24))  # K = 1.5: legal for MUL1 only, here 3INST
    msg = _error(bad, real_config)
    assert "4 problem" in msg
    assert f"{key}: EXL3 trellis is I16 [128, 256, 64], expected I16 [256, 128, 16*K]" in msg
    assert "layers.9.mlp.experts.6.up_proj.suh: missing" in msg
    assert f"{width_key}: last dim 20 is neither 16*K nor 16*KA+8" in msg
    assert f"{mul1_key}.trellis (last dim 24): half-integer K = 1.5 exists only for the mul1 codebook" in msg


# ---------------------------------------------------------------------------------------------
# Tiny checkpoints: write, read back


@pytest.fixture(scope="module")
def tiny_config():
    return GLMConfig.from_dict(tiny.tiny_config_dict())


@pytest.fixture(scope="module")
def tiny_ref(tiny_config):
    return tiny.random_weights(tiny_config, seed=0)


def _file_tensors(path: Path) -> dict:
    out = {}
    for f in checkpoint.checkpoint_files(path):
        with safe_open(f, framework="pt") as st:
            out |= {k: st.get_tensor(k) for k in st.keys()}
    return out


def test_tiny_layout(tiny_config, tiny_ref):
    assert [checkpoint.is_dsa_layer(tiny_config, i) for i in range(5)] == [False, True, False, True, True]
    assert "layers.4.eh_proj.weight" in tiny_ref and "layers.4.hc_attn_fn" not in tiny_ref
    assert "layers.0.mlp.gate_proj.weight" in tiny_ref and "layers.1.mlp.experts.7.down_proj.weight" in tiny_ref
    # the parameters transformers initialises to constants are spread out
    for name in ("layers.0.self_attn.A_log", "layers.1.self_attn.indexer.index_kpool_compress_ape",
                 "layers.1.self_attn.indexer.index_kpool_compress_gate", "layers.2.hc_attn_base",
                 "layers.2.mlp.gate.e_score_correction_bias"):
        assert tiny_ref[name].std() > 0.05, name
    again = tiny.random_weights(tiny_config, seed=0)
    assert all(torch.equal(again[k], v) for k, v in tiny_ref.items())
    assert not torch.equal(tiny.random_weights(tiny_config, seed=1)["norm.weight"], tiny_ref["norm.weight"])


def test_roundtrip_bf16(tmp_path, tiny_config, tiny_ref):
    path = tiny.make_tiny_checkpoint(tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["text_config"]["num_nextn_predict_layers"] == 1 and "quantization_config" not in cfg
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == 1
    files = _file_tensors(path)
    assert files["model.language_model.layers.0.self_attn.A_log"].dtype == torch.float32
    assert files["model.language_model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert "lm_head.weight" in files

    w = checkpoint.load_weights(path, tiny_config, dtype=torch.float32, progress=False)
    assert set(w) == set(tiny_ref)
    for k, v in tiny_ref.items():
        assert torch.equal(w[k], v), k
    w = checkpoint.load_weights(path, tiny_config, dtype=torch.bfloat16, progress=False)
    assert w["layers.1.mlp.experts.3.up_proj.weight"].dtype == torch.bfloat16
    for k in ("layers.0.self_attn.A_log", "layers.0.self_attn.dt_bias", "layers.1.mlp.gate.weight",
              "layers.1.mlp.gate.e_score_correction_bias", "layers.3.hc_ffn_base", "layers.3.hc_ffn_scale"):
        assert w[k].dtype == torch.float32 and torch.equal(w[k], tiny_ref[k]), k


def test_dequantize_fp8_formula():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=g)
    q, s = fp8.quantize_fp8_block(w, "amax")
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2)
    d = fp8.dequantize_fp8_block(q, s, torch.float32)
    for i, j in ((0, 0), (127, 128), (128, 127), (299, 199), (256, 5)):
        assert d[i, j] == q[i, j].float() * s[i // 128, j // 128]
    assert (d - w).abs().max() > 0


def test_roundtrip_fp8(tmp_path, tiny_config, tiny_ref):
    path = tiny.make_tiny_checkpoint(tmp_path / "ckpt", experts="fp8", core="fp8")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    files = _file_tensors(path)
    prefix = "model.language_model."
    grids = {"layers.0.mlp.gate_proj.weight": (4, 2), "layers.0.mlp.down_proj.weight": (2, 4),
             "layers.1.mlp.experts.2.down_proj.weight": (2, 1), "layers.3.self_attn.q_a_proj.weight": (1, 2),
             "layers.4.self_attn.o_proj.weight": (2, 1), "layers.2.mlp.shared_experts.up_proj.weight": (1, 2)}
    for name, grid in grids.items():
        assert files[prefix + name].dtype == torch.float8_e4m3fn, name
        assert tuple(files[prefix + name + "_scale_inv"].shape) == grid, name
        q, s = fp8.quantize_fp8_block(tiny_ref[name], "amax")  # the writer stores fp8.py's amax rule
        assert torch.equal(files[prefix + name].view(torch.uint8), q.view(torch.uint8)), name
        assert torch.equal(files[prefix + name + "_scale_inv"], s), name
    for name in ("layers.2.self_attn.o_proj.weight", "layers.3.self_attn.kv_b_proj.weight",
                 "layers.1.self_attn.indexer.wk.weight", "layers.1.mlp.gate.weight", "lm_head.weight"):
        key = name if name == "lm_head.weight" else prefix + name
        assert files[key].dtype in (torch.bfloat16, torch.float32), name
        assert key + "_scale_inv" not in files

    w = checkpoint.load_weights(path, tiny_config, dtype=torch.float32, progress=False)
    n_fp8 = 0
    for name, ref in tiny_ref.items():
        if not checkpoint.fp8_in_official_release(tiny_config, name):
            assert torch.equal(w[name], ref), name
            continue
        n_fp8 += 1
        s = files[prefix + name + "_scale_inv"]
        s = s.repeat_interleave(128, 0)[: ref.shape[0]].repeat_interleave(128, 1)[:, : ref.shape[1]]
        # e4m3 rounding: half an ulp, 2^-4 relative for normals, 2^-10 * scale below 2^-6 * scale
        bound = torch.maximum(ref.abs() / 16, s / 1024) * (1 + 1e-6)
        assert ((w[name] - ref).abs() <= bound).all(), name
        assert (w[name] - ref).abs().max() > 0, name
    assert n_fp8 == 3 + 4 * (8 * 3 + 3) + 3 * 4


def test_sharded_index(tmp_path, tiny_config, tiny_ref):
    path = tiny.make_tiny_checkpoint(tmp_path / "ckpt")
    # rewrite the same checkpoint in ~1 MB shards
    files = _file_tensors(path)
    w = checkpoint.load_weights(path, tiny_config, dtype=torch.float32, progress=False)
    sharded = checkpoint.write_checkpoint(tmp_path / "sharded", tiny.tiny_config_dict(), w, shard_size=1 << 20)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shard_files = sorted(set(index["weight_map"].values()))
    assert len(shard_files) > 3 and re.fullmatch(r"model-00001-of-000\d\d\.safetensors", shard_files[0])
    assert not (sharded / "model.safetensors").exists()
    assert set(index["weight_map"]) == set(files)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in files.values())
    w2 = checkpoint.load_weights(sharded, tiny_config, dtype=torch.float32, progress=False)
    assert all(torch.equal(w2[k], v) for k, v in tiny_ref.items())

    # an index that disagrees with the shards names the key
    del index["weight_map"]["model.language_model.norm.weight"]
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model.language_model.norm.weight"):
        checkpoint.load_weights(sharded, tiny_config, progress=False)

    # without an index every *.safetensors file is read; a key stored twice is named
    (sharded / "model.safetensors.index.json").unlink()
    w3 = checkpoint.load_weights(sharded, tiny_config, dtype=torch.float32, progress=False)
    assert all(torch.equal(w3[k], v) for k, v in tiny_ref.items())
    save_file({"model.language_model.norm.weight": torch.ones(256)}, sharded / "extra.safetensors")
    with pytest.raises(CheckpointError, match="model.language_model.norm.weight: stored twice"):
        checkpoint.load_weights(sharded, tiny_config, progress=False)


def test_text_only_prefix_and_stray_scale(tmp_path, tiny_config, tiny_ref):
    text_only = tiny.tiny_config_dict()["text_config"]
    path = checkpoint.write_checkpoint(tmp_path / "t", text_only, tiny_ref)
    keys = list(_file_tensors(path))
    assert "model.layers.0.self_attn.A_log" in keys and "lm_head.weight" in keys
    w = checkpoint.load_weights(path, tiny_config, dtype=torch.float32, progress=False)
    assert all(torch.equal(w[k], v) for k, v in tiny_ref.items())

    files = _file_tensors(path)
    files["model.layers.0.self_attn.q_proj.weight_scale_inv"] = torch.ones(1, 2)  # scale of a BF16 weight
    save_file(files, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight_scale_inv: unexpected"):
        checkpoint.load_weights(path, tiny_config, progress=False)


def test_write_rejects_bad_weights(tmp_path, tiny_ref):
    bad = dict(tiny_ref)
    del bad["layers.2.self_attn.b_proj.weight"]
    bad["layers.0.mlp.up_proj.weight"] = torch.zeros(512, 255)
    with pytest.raises(CheckpointError) as e:
        checkpoint.write_checkpoint(tmp_path / "x", tiny.tiny_config_dict(), bad)
    assert "layers.2.self_attn.b_proj.weight: missing" in str(e.value)
    assert "layers.0.mlp.up_proj.weight: shape [512, 255], expected [512, 256]" in str(e.value)
    with pytest.raises(CheckpointError, match="experts='int4'"):
        checkpoint.write_checkpoint(tmp_path / "x", tiny.tiny_config_dict(), tiny_ref, experts="int4")


def test_resolve_model_path(tmp_path):
    assert checkpoint.resolve_model_path(tmp_path) == tmp_path
    with pytest.raises(CheckpointError, match="not a local folder"):
        checkpoint.resolve_model_path(str(tmp_path / "no" / "such" / "dir"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="is a file"):
        checkpoint.resolve_model_path(tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="no .safetensors files"):
        checkpoint.checkpoint_files(tmp_path)


def test_transformers_save_pretrained_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    d = tiny.tiny_config_dict(num_nextn_predict_layers=0)  # transformers has no MTP layer (spec §7.1)
    cfg = transformers.Glm5NextConfig(text_config=d["text_config"], vision_config=d["vision_config"])
    torch.manual_seed(0)
    model = transformers.Glm5NextForConditionalGeneration(cfg).eval()
    model.save_pretrained(tmp_path / "hf")
    config = GLMConfig.from_dict(json.loads((tmp_path / "hf" / "config.json").read_text()))
    w = checkpoint.load_weights(tmp_path / "hf", config, dtype=torch.float32, progress=False)
    sd = model.state_dict()
    lm = "model.language_model."
    c = 4 * 32  # KDA channels: heads x head_dim
    # the names mean what transformers means by them (spec §2.8)
    assert torch.equal(w["layers.0.self_attn.A_log"], sd[lm + "layers.0.self_attn.forget_gate.A_log"])
    assert torch.equal(w["layers.2.hc_ffn_fn"], sd[lm + "layers.2.ffn_hc.fn"])
    assert torch.equal(w["layers.2.self_attn.k_conv1d.weight"], sd[lm + "layers.2.self_attn.conv1d.weight"][c:2 * c])
    gate_up, down = sd[lm + "layers.3.mlp.experts.gate_up_proj"], sd[lm + "layers.3.mlp.experts.down_proj"]
    assert torch.equal(w["layers.3.mlp.experts.5.gate_proj.weight"], gate_up[5, :128])
    assert torch.equal(w["layers.3.mlp.experts.5.up_proj.weight"], gate_up[5, 128:])
    assert torch.equal(w["layers.3.mlp.experts.5.down_proj.weight"], down[5])
    assert torch.equal(w["lm_head.weight"], sd["lm_head.weight"])

    # the same files under a config that expects the MTP layer: the missing tensors are named
    with_mtp = GLMConfig.from_dict(tiny.tiny_config_dict())
    with pytest.raises(CheckpointError, match="model.language_model.layers.4.enorm.weight: missing"):
        checkpoint.load_weights(tmp_path / "hf", with_mtp, progress=False)


def test_roundtrip_exl3_experts_fp8_core(tmp_path, tiny_config, tiny_ref):
    weights = dict(tiny_ref) | tiny.random_exl3_experts(tiny_config, seed=0)
    # layer 2 at K = 3, layer 3 with the MUL1 codebook: a per-layer mix
    weights |= {n: w for n, w in tiny.random_exl3_experts(tiny_config, seed=1, bits=3).items() if n.startswith("layers.2.")}
    weights |= {n: w for n, w in tiny.random_exl3_experts(tiny_config, seed=2, codebook="mul1").items()
                if n.startswith("layers.3.")}
    path = checkpoint.write_checkpoint(tmp_path / "x", tiny.tiny_config_dict(), weights, core="fp8")
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "exl3" and qc["codebook"] == ["mcg", "mul1"] and 3 < qc["bits"] < 4
    assert qc["original_quantization_config"]["quant_method"] == "fp8"

    w = checkpoint.load_weights(path, tiny_config, dtype=torch.float32, progress=False)
    files = _file_tensors(path)
    n_exl3 = 0
    for name, ref in tiny_ref.items():
        if checkpoint.is_routed_expert(name):
            n_exl3 += 1
            lin, written = w[name], weights[name]
            assert isinstance(lin, exl3.EXL3Linear) and (lin.out_features, lin.in_features) == ref.shape
            assert (lin.bits, lin.codebook) == (written.bits, written.codebook), name
            assert all(torch.equal(getattr(lin, t), getattr(written, t)) for t in ("trellis", "suh", "svh")), name
        elif checkpoint.fp8_in_official_release(tiny_config, name):
            assert not torch.equal(w[name], ref) and torch.allclose(w[name], ref, atol=0.1 * ref.abs().max())
        else:
            assert torch.equal(w[name], ref), name
    assert n_exl3 == 4 * 8 * 3
    # decoded weights, one linear per (layer, K, codebook) combination (decoding is slow on CPU)
    for name in ("layers.1.mlp.experts.0.gate_proj.weight", "layers.2.mlp.experts.5.down_proj.weight",
                 "layers.3.mlp.experts.7.up_proj.weight", "layers.4.mlp.experts.2.down_proj.weight"):
        base = "model.language_model." + name.removesuffix(".weight")
        codebook = "mul1" if base + ".mul1" in files else "mcg"
        assert (base + ".mcg" in files) != (base + ".mul1" in files) and codebook == weights[name].codebook
        expect = exl3.dequantize(files[base + ".trellis"], files[base + ".suh"], files[base + ".svh"], codebook)
        assert torch.equal(w[name].weight(), expect), name


def test_random_exl3_experts_scale(tiny_config, tiny_ref):
    experts = tiny.random_exl3_experts(tiny_config, seed=0)
    assert len(experts) == 4 * 8 * 3
    name = "layers.1.mlp.experts.0.down_proj.weight"
    w = experts[name].weight().float()  # (in, out)
    assert w.shape == tiny_ref[name].T.shape
    assert 0.5 < w.std() / tiny_ref[name].std() < 2
    again = tiny.random_exl3_experts(tiny_config, seed=0)[name]
    assert torch.equal(again.trellis, experts[name].trellis) and torch.equal(again.svh, experts[name].svh)


def test_write_exl3_experts_calls_quantize(tmp_path, tiny_config, tiny_ref, monkeypatch):
    """The writer's EXL3 path: each routed expert goes through exl3.quantize with the HF-layout
    weight, its layer's bits and the codebook. exl3.quantize itself is too slow on CPU for 96
    linears, so a deterministic stand-in records the calls (exl3's own tests cover the quantizer)."""
    calls = {}
    stand_in = tiny.random_exl3_experts(tiny_config, seed=5, bits=2, codebook="mul1")

    def fake_quantize(weight, bits, codebook="3inst", hessian=None, seed=0):
        name = next(n for n, ref in tiny_ref.items() if ref.shape == weight.shape and torch.equal(ref, weight)
                    and checkpoint.is_routed_expert(n))
        calls[name] = (bits, codebook, seed)
        return stand_in[name]

    monkeypatch.setattr(exl3, "quantize", fake_quantize)
    bits = {1: 2, 2: 2, 3: 2, 4: 2}
    path = checkpoint.write_checkpoint(tmp_path / "x", tiny.tiny_config_dict(), tiny_ref, experts="exl3",
                                       bits=bits, codebook="mul1")
    assert set(calls) == {n for n in tiny_ref if checkpoint.is_routed_expert(n)}
    assert {c[:2] for c in calls.values()} == {(2, "mul1")}
    assert len({c[2] for c in calls.values()}) == len(calls)  # one seed per tensor
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qc == {"quant_method": "exl3", "bits": 2.0, "head_bits": 16, "codebook": "mul1"}
    w = checkpoint.load_weights(path, tiny_config, dtype=torch.float32, progress=False)
    for name, lin in stand_in.items():
        assert torch.equal(w[name].trellis, lin.trellis) and w[name].codebook == "mul1", name
    assert torch.equal(w["layers.1.mlp.shared_experts.up_proj.weight"], tiny_ref["layers.1.mlp.shared_experts.up_proj.weight"])

    with pytest.raises(CheckpointError, match=r"layers\.4\.mlp\.experts\.0\.gate_proj\.weight: no EXL3 bits given for layer 4"):
        checkpoint.write_checkpoint(tmp_path / "y", tiny.tiny_config_dict(), tiny_ref, experts="exl3", bits={1: 2, 2: 2, 3: 2})


def test_make_tiny_checkpoint_exl3(tmp_path, tiny_config):
    path = tiny.make_tiny_checkpoint(tmp_path / "x", experts="exl3", core="fp8", seed=3, bits=2)
    w = checkpoint.load_weights(path, tiny_config, progress=False)
    expect = tiny.random_exl3_experts(tiny_config, seed=3, bits=2)
    assert all(torch.equal(w[n].trellis, lin.trellis) and w[n].bits == 2 for n, lin in expect.items())
    assert w["layers.0.mlp.gate_proj.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("rule", fp8.SCALE_RULES)
def test_fp8_core_at_load(tmp_path, tiny_config, tiny_ref, rule):
    """load_weights(fp8_core=rule): every non-routed projection becomes an FP8Linear, BF16 ones
    quantized by `rule`, stored FP8 ones kept byte for byte; the rest is loaded as before."""
    specs = checkpoint.expected_tensors(tiny_config)
    bf16 = tiny.make_tiny_checkpoint(tmp_path / "bf16")
    w = checkpoint.load_weights(bf16, tiny_config, dtype=torch.bfloat16, progress=False, fp8_core=rule)
    converted = {n for n, t in w.items() if isinstance(t, fp8.FP8Linear)}
    assert converted == {n for n in specs if checkpoint.is_fp8_core(n, specs[n])}
    assert {"lm_head.weight", "layers.0.self_attn.q_proj.weight", "layers.4.eh_proj.weight"} <= converted
    for kept in ("layers.1.self_attn.kv_b_proj.weight", "layers.1.self_attn.indexer.weights_proj.weight",
                 "layers.1.mlp.experts.0.up_proj.weight", "layers.1.mlp.gate.weight", "embed_tokens.weight"):
        assert isinstance(w[kept], torch.Tensor), kept
    name = "layers.0.self_attn.q_proj.weight"
    q, s = fp8.quantize_fp8_block(tiny_ref[name].bfloat16(), rule)
    assert torch.equal(w[name].weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(w[name].scale_inv, s)

    # the model runs on them: KL(BF16 || FP8 core) of a random tiny model is ~0.06 nats for both rules
    from cache import CachePool
    from model_glm import GLMModel, SeqChunk
    logits = []
    for weights in (checkpoint.load_weights(bf16, tiny_config, dtype=torch.float32, progress=False),
                    checkpoint.load_weights(bf16, tiny_config, dtype=torch.float32, progress=False, fp8_core=rule)):
        cache = CachePool(tiny_config, 8, 1, block_size=16)
        logits.append(GLMModel(tiny_config, weights).forward(
            [SeqChunk(torch.arange(2, 50), 0, torch.arange(8), 0)], cache, all_logits=True).logits.double())
    assert 1e-3 < float(bench.kl_nats(*logits).mean()) < 0.15

    stored = tiny.make_tiny_checkpoint(tmp_path / "fp8", core="fp8")
    files = _file_tensors(stored)
    w = checkpoint.load_weights(stored, tiny_config, dtype=torch.bfloat16, progress=False, fp8_core=rule)
    key = "model.language_model.layers.3.self_attn.q_a_proj.weight"  # FP8 in the file: not requantized
    lin = w["layers.3.self_attn.q_a_proj.weight"]
    assert torch.equal(lin.weight.view(torch.uint8), files[key].view(torch.uint8))
    assert torch.equal(lin.scale_inv, files[key + "_scale_inv"])


def test_fp8_core_rejects_an_unknown_rule(tmp_path, tiny_config):
    path = tiny.make_tiny_checkpoint(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"fp8_core must be one of \('amax', 'pow2'\) or None, got 'e5m2'"):
        checkpoint.load_weights(path, tiny_config, progress=False, fp8_core="e5m2")

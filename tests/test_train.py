"""train.py on CPU: gradients reach every part of the architecture through the engine's forward,
a few steps lower the loss, resume continues exactly, exports load in the engine, and the default
model is the shipped one when present (else the random one). The DFlash2 drafter stage: its config
has the published structure, a few steps against the shipped model lower its losses, resume is
exact, the written drafter loads and speculates, and the shipped drafter is what the stage makes."""
import json
import math
import shutil

import pytest
import torch
from safetensors import safe_open

import default_model
import dflash
import engine
import exl3
import train

torch.set_num_threads(1)

# A micro model with every part: KDA layer (dense MLP), DSA layer (MoE), MTP layer.
MICRO = dict(
    hidden_size=128, intermediate_size=128, moe_intermediate_size=128,
    num_hidden_layers=2, first_k_dense_replace=1, layer_types=["linear_attention", "deepseek_sparse_attention"],
    num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_head_dim=16, v_head_dim=16,
    index_n_heads=4, index_head_dim=16, index_topk=8, index_kpool=4,
    linear_attn_config={"num_heads": 2, "head_dim": 32}, max_position_embeddings=4096,
)
SEQ = 40  # crosses a k-pool and makes the DSA indexer choose (index_topk 8 < 40)


@pytest.fixture(scope="module")
def tok():
    return train.make_tokenizer()


@pytest.fixture(scope="module")
def corpus(tok):
    root = train.stdlib_root()
    files = [root / f for f in ("textwrap.py", "json/__init__.py", "shlex.py", "colorsys.py", "bisect.py")]
    return train.load_corpus(tok, default_model.TEMPLATE.read_text(), files, root)


def micro_trainer(tok, **settings) -> train.Trainer:
    s = train.Settings(seq_len=SEQ, batch_size=2, warmup_steps=1, **settings)
    t = train.Trainer(train.model_config(tok, MICRO), s, "cpu")
    t.total_steps = 6
    return t


def test_corpus_is_fixed_and_split(tok, corpus):
    files = train.corpus_files()
    assert files == sorted(files, key=lambda p: p.relative_to(train.stdlib_root()).as_posix())
    tr, held = train.split_files(files)
    assert held == files[::train.HOLDOUT_EVERY] and not set(tr) & set(held) and len(tr) + len(held) == len(files)
    # chats from docstrings are in the stream, in the served template, ended by <|endoftext|>
    text = tok.decode(corpus.train.tolist(), skip_special_tokens=False)
    assert "<|user|>What does json.dumps do?<|assistant|>" in text  # textwrap.py (file 0) is held out
    assert text.count("<|endoftext|>") == int((corpus.train == tok.token_to_id("<|endoftext|>")).sum())


def test_training_model_is_the_engine_model(tok, corpus):
    """A training batch (3 sequences side by side in KDA) gives the logits and MTP logits of the
    engine's model run on each sequence alone (fp32)."""
    t = micro_trainer(tok)
    for _ in range(2):  # trained a little, so the layers are not at their init
        t.step(corpus.train)
    plain = train.GLMModel(t.config, t.weights())
    tokens = train.train_batch(corpus.train, 10, train.Settings(seq_len=70, batch_size=3))  # 70: two KDA chunks
    T = 70

    def run(model, rows):
        cache = train.CachePool(t.config, num_blocks=6, num_slots=3, block_size=train.BLOCK, dtype=torch.float32)
        chunks = [train.SeqChunk(tokens[i, :T], 0, torch.arange(2 * i, 2 * i + 2), i) for i in rows]
        out = model.forward(chunks, cache, all_logits=True)
        nxt = [train.SeqChunk(tokens[i, 1:T + 1], 0, torch.arange(2 * i, 2 * i + 2), i) for i in rows]
        return out.logits, model.mtp_forward(out.hidden, nxt, cache, all_logits=True).logits

    with torch.no_grad():
        batched = run(t.model, range(3))
        alone = [torch.cat(x) for x in zip(*(run(plain, [i]) for i in range(3)))]
    torch.testing.assert_close(batched[0], alone[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(batched[1], alone[1], rtol=1e-4, atol=1e-4)


def test_gradients_reach_every_part_and_loss_drops(tok, corpus):
    t = micro_trainer(tok, lr=1e-2)
    one_window = corpus.train[:SEQ + 2]  # every batch is this window: a fixed batch
    losses = train.compute_losses(t.model, train.train_batch(one_window, 0, t.settings))
    losses.total.backward()
    grads = {n: p.grad for n, p in t.params.items() if p.requires_grad}
    must_move = ["embed_tokens.weight", "lm_head.weight", "layers.0.hc_attn_fn", "layers.0.hc_ffn_base",
                 "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.A_log", "layers.0.self_attn.dt_bias",
                 "layers.0.self_attn.q_conv1d.weight", "layers.0.self_attn.b_proj.weight",
                 "layers.0.self_attn.g_b_proj.weight", "layers.0.mlp.down_proj.weight",
                 "layers.1.self_attn.kv_b_proj.weight", "layers.1.self_attn.q_a_proj.weight",
                 "layers.1.mlp.gate.weight", "layers.1.mlp.shared_experts.up_proj.weight",
                 "layers.2.eh_proj.weight", "layers.2.self_attn.kv_b_proj.weight", "layers.2.mlp.gate.weight"]
    for n in must_move:
        assert grads[n] is not None and torch.isfinite(grads[n]).all() and grads[n].abs().sum() > 0, n
    for L in (1, 2):  # the routed experts that took tokens learn
        moved = [e for e in range(4) if grads[f"layers.{L}.mlp.experts.{e}.gate_proj.weight"] is not None
                 and grads[f"layers.{L}.mlp.experts.{e}.gate_proj.weight"].abs().sum() > 0]
        assert len(moved) >= 2, (L, moved)
    assert "layers.1.mlp.gate.e_score_correction_bias" not in grads  # moved by the balancing rule instead

    t.optimizer.zero_grad(set_to_none=True)
    first = [t.step(one_window) for _ in range(6)]
    after = train.compute_losses(t.model, train.train_batch(one_window, 0, t.settings), grad=False)
    assert after.main.item() < first[0].main.item() - 1.0, (first[0].main.item(), after.main.item())
    assert after.mtp.item() < first[0].mtp.item() - 0.5, (first[0].mtp.item(), after.mtp.item())
    bias = t.params["layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.abs().max() > 0  # 6 balancing updates of ±1e-3 on a fixed batch


def test_resume_continues_exactly(tok, corpus, tmp_path):
    straight = micro_trainer(tok)
    for _ in range(3):
        straight.step(corpus.train)

    first = micro_trainer(tok)
    for _ in range(2):
        first.step(corpus.train)
    first.save(tmp_path / "state.pt")
    resumed = train.Trainer.load(tmp_path / "state.pt", "cpu")
    assert (resumed.step_index, resumed.data_pos, resumed.total_steps) == (2, 4, 6)
    resumed.step(corpus.train)
    for n, p in straight.params.items():
        assert torch.equal(p, resumed.params[n]), n
    # the data position moved on: the next batch is a different one
    assert not torch.equal(train.train_batch(corpus.train, 0, first.settings),
                           train.train_batch(corpus.train, resumed.data_pos, first.settings))


def test_split_stacked_is_the_stacked_linear():
    """Each part's dequantized weight is exactly its column block of the stacked linear's."""
    g = torch.Generator().manual_seed(0)
    trellis = torch.randint(-(1 << 15), 1 << 15, (8, 24, exl3.trellis_width(2)), generator=g, dtype=torch.int32)
    stacked = exl3.EXL3Linear(trellis.to(torch.int16), (torch.rand(128, generator=g) + 0.5).half(),
                              (torch.rand(384, generator=g) + 0.5).half(), "mcg")
    parts = train.split_stacked(stacked, 3, ["a", "b", "c"])
    w = stacked.weight()
    for i, name in enumerate("abc"):
        assert (parts[name].in_features, parts[name].out_features) == (128, 128)
        assert torch.equal(parts[name].weight(), w[:, 128 * i:128 * (i + 1)])
    with pytest.raises(ValueError, match="multiple of 128"):
        train.split_stacked(stacked, 2, ["a", "b"])


def test_stacked_quantization_is_as_good_as_separate():
    """Quantizing experts as one stacked matrix (shared suh and global scale) costs no accuracy:
    experts of different scales get their own svh. K=2, fixed scale: the CPU Viterbi is slow."""
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(128, 128, generator=g) * s for s in (0.05, 0.15)]
    parts = train.split_stacked(exl3.quantize(torch.cat(ws), 2, codebook="mcg", seed=1, scale=1.0), 2, ["a", "b"])
    for w, name in zip(ws, "ab"):
        separate = exl3.proxy_error(w, exl3.quantize(w, 2, codebook="mcg", seed=1, scale=1.0))
        stacked = exl3.proxy_error(w, parts[name])
        assert stacked < 1.1 * separate, (name, stacked, separate)
        assert stacked < 0.1  # K=2 on gaussian weights: ~0.07 measured


def fake_quantize(weight, bits, codebook="3inst", hessian=None, seed=0, *, scale=None):
    """A valid EXL3 linear of the weight's shape with a random trellis: the real quantizer takes
    ~10 tiles/s on CPU (its own tests cover it); this checks the export's layout."""
    g = torch.Generator().manual_seed(seed)
    out_f, in_f = weight.shape
    trellis = torch.randint(-(1 << 15), 1 << 15, (in_f // 16, out_f // 16, exl3.trellis_width(bits)),
                            generator=g, dtype=torch.int32).to(torch.int16)
    signs = lambda n: (torch.randint(0, 2, (n,), generator=g) * 2 - 1).half() * 0.05  # noqa: E731
    return exl3.EXL3Linear(trellis, signs(in_f), signs(out_f), codebook)


def test_export_loads_in_engine_and_scores(tok, corpus, tmp_path, monkeypatch):
    t = micro_trainer(tok)
    for _ in range(2):
        t.step(corpus.train)
    monkeypatch.setattr(exl3, "quantize", fake_quantize)
    folders = train.export(tmp_path, t.config_dict, t.weights(), tok, bits=(2,))
    assert set(folders) == {"bf16", "exl3-2bit"}
    ids = corpus.held[:SEQ].tolist()
    ref = train.compute_losses(t.model, corpus.held[:SEQ + 2][None], grad=False)
    for variant, folder in folders.items():
        for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "chat_template.jinja", "model.safetensors"):
            assert (folder / f).is_file(), (variant, f)
        eng = engine.load(folder, device="cpu", max_cache_tokens=512, snapshot_bytes=0, progress=False)
        logits = eng.score(ids)
        assert logits.shape == (SEQ, tok.get_vocab_size()) and torch.isfinite(logits).all()
        loss = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item()
        if variant == "bf16":  # the export holds the trained weights (rounded to bf16)
            assert abs(loss - ref.main.item()) < 0.05, (loss, ref.main.item())
        assert eng.generate("def f(x):", engine.SamplingParams(max_tokens=3, temperature=0.0))[0].token_ids
    expert = "layers.1.mlp.experts.3.up_proj"
    assert '"quant_method": "exl3"' in (folders["exl3-2bit"] / "config.json").read_text()
    batches = train.held_batches(corpus.held, SEQ, 2, 2)
    results = train.evaluate(folders, batches, torch.device("cpu"))
    assert [r.variant for r in results] == ["bf16", "exl3-2bit"] and results[0].kl is None
    assert math.isfinite(results[0].loss) and results[1].kl > 0 and 0 <= results[1].top1 <= 1
    with safe_open(folders["exl3-2bit"] / "model.safetensors", "pt") as f:
        assert any(k.endswith(expert + ".trellis") for k in f.keys())
    print(train.table(results))


def test_default_model_prefers_the_shipped_export(tmp_path, monkeypatch):
    monkeypatch.setattr(default_model, "SHIPPED", tmp_path / "default_weights")
    monkeypatch.setattr(default_model, "SHIPPED_DRAFTER", tmp_path / "default_weights" / "dflash2")
    assert default_model.shipped_drafter() is None
    (tmp_path / "default_weights" / "dflash2").mkdir(parents=True)
    (tmp_path / "default_weights" / "dflash2" / "config.json").write_text("{}")
    assert default_model.shipped_drafter() is None  # no weights: not a drafter
    (tmp_path / "default_weights" / "dflash2" / "model.safetensors").write_bytes(b"")
    assert default_model.shipped_drafter() == tmp_path / "default_weights" / "dflash2"
    built = default_model.ensure(tmp_path / "cache")  # nothing shipped: the random model is built
    assert built.parent == tmp_path / "cache" and (built / "model.safetensors").is_file()
    files = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
    bf16, exl3_4 = (tmp_path / "default_weights" / v for v in ("bf16", "exl3-4bit"))
    bf16.mkdir(parents=True)
    for f in files[:-1]:
        (bf16 / f).write_text((built / f).read_text())
    assert default_model.ensure(tmp_path / "cache") == built  # incomplete (no chat template): not used
    (bf16 / files[-1]).write_text((built / files[-1]).read_text())
    assert default_model.ensure(tmp_path / "cache") == bf16
    shutil.copytree(built, exl3_4)  # a complete checkpoint (random weights stand in for trained ones)
    assert default_model.ensure(tmp_path / "cache") == exl3_4  # EXL3 first
    assert engine.load(None, device="cpu", max_cache_tokens=256, snapshot_bytes=0, progress=False).config.vocab_size \
        == train.GLMConfig.from_file(exl3_4).vocab_size


# ---------------------------------------------------------------------------------------------
# The DFlash2 drafter stage (train.py --drafter)

DRAFT_SEQ = 48


@pytest.fixture(scope="module")
def shipped_target():
    """The shipped trained model in fp32, as the drafter stage loads it (a trained target: the
    drafter has something to learn, unlike against random weights)."""
    return train.load_target(default_model.SHIPPED / "bf16", torch.device("cpu"))


def test_drafter_config_has_the_published_structure(tok, shipped_target, fixtures_dir):
    ours = train.drafter_config(shipped_target.config, tok)
    published = json.loads((fixtures_dir / "glm53" / "dflash2.config.json").read_text())
    assert set(ours) <= set(published) | {"rope_parameters"} and set(published) - set(ours) <= {"transformers_version"}
    assert set(ours["dflash_config"]) == set(published["dflash_config"])
    cfg = dflash.DFlash2Config.from_dict(ours)
    cfg.check_target(shipped_target.config)
    assert cfg.block_size == 8 and cfg.selector_top_k == 16 and cfg.conv_kernel_size == 2
    assert set(cfg.target_layer_ids) <= set(shipped_target.config.kda_layers)  # taps after KDA layers, as GLM's (§2.4)
    assert cfg.mask_token_id == tok.token_to_id("[MASK]")


def drafter_trainer(target, tok) -> train.DrafterTrainer:
    s = train.DrafterSettings(seq_len=DRAFT_SEQ, batch_size=2, anchors=8, warmup_steps=2)
    t = train.DrafterTrainer(train.drafter_config(target.config, tok), target, s, "cpu")
    t.total_steps = 14
    return t


def test_drafter_training_lowers_the_loss_resumes_and_speculates(tok, corpus, shipped_target, tmp_path):
    held = train.held_batches(corpus.held, DRAFT_SEQ, 2, 2)
    t = drafter_trainer(shipped_target, tok)
    before = train.evaluate_drafter(t.drafter, held, t.settings)
    for _ in range(10):
        t.step(corpus.train)
    t.save(tmp_path / "state.pt")
    t.step(corpus.train)
    after = train.evaluate_drafter(t.drafter, held, t.settings)
    assert after.main.item() < before.main.item() - 0.5, (before.main.item(), after.main.item())
    assert after.selector.item() < before.selector.item() - 0.5, (before.selector.item(), after.selector.item())
    assert after.head_top1.shape == (7,) and 0 <= after.walk_top1.min() <= after.walk_top1.max() <= 1

    resumed = train.DrafterTrainer.load(tmp_path / "state.pt", shipped_target, "cpu")
    assert (resumed.step_index, resumed.data_pos, resumed.total_steps) == (10, 20, 14)
    resumed.step(corpus.train)
    for n, w in t.params.items():
        assert torch.equal(w, resumed.params[n]), n

    folder = dflash.write_drafter(tmp_path / "dflash2", t.config_dict, t.weights())
    loaded = dflash.load_drafter(folder, shipped_target)
    for n, w in t.weights().items():
        assert torch.equal(loaded.w(n), w.to(torch.bfloat16).float()), n
    greedy = engine.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = {}
    for spec, opts in (("none", {}), ("dflash2", {"drafter_path": folder})):
        eng = engine.load(default_model.SHIPPED / "bf16", device="cpu", max_cache_tokens=512, snapshot_bytes=0,
                          progress=False, speculator=spec, **opts)
        runs[spec] = eng.generate("def f(x):", greedy)[0].token_ids
        stats = eng.stats()
    assert runs["dflash2"] == runs["none"] and stats.spec_verify_steps > 0


def test_the_shipped_drafter_is_the_stage_output_for_the_shipped_model(tok, shipped_target):
    folder = default_model.shipped_drafter()
    assert folder == default_model.SHIPPED_DRAFTER
    assert json.loads((folder / "config.json").read_text()) == train.drafter_config(shipped_target.config, tok)
    assert dflash.load_drafter(folder, shipped_target).max_draft == 7

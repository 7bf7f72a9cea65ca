"""dflash.py and the engine's speculative path: DFlash2 and MTP drafters, verification, rollback.

The target is the tiny real-layout model with every trunk sublayer's output projection scaled by 0.1,
so that, like real text, its next token depends mostly on the current one (about 70 % of its argmaxes
equal those of the current token alone; the unscaled random model gives 3 %, which no small drafter
can learn). Drafters that agree often are made honestly from the target's own outputs: a DFlash2
drafter trained for a few hundred steps on its greedy continuations, and MTP weights fitted by ridge
regression to its hidden states. Neither sees the answers it is later asked to draft (other prompts).
"""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

import cache as cache_mod
import dflash
import engine as E
import tiny
from cache import CachePool
from model_glm import GLMConfig, GLMModel, SeqChunk, rms_norm
from test_engine import THINK_TOKENS, make_tokenizer

BS = 16
EOS = 1
MASK = 511
FIXTURE_CONFIG = "glm53/dflash2.config.json"


def drafter_config_dict(layers: int = 5, window: int = 64) -> dict:
    """The published config's key structure (dflash2.config.json), scaled to the tiny target."""
    return {"architectures": ["DFlash2DraftModel"], "attention_bias": False, "dtype": "bfloat16",
            "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": layers, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512, "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "hidden_act": "silu",
            "layer_types": ["sliding_attention"] * layers, "sliding_window": window, "use_sliding_window": True,
            "num_target_layers": 4, "is_causal": False, "tie_word_embeddings": False, "model_type": "qwen3",
            "dflash_config": {"block_size": 8, "mask_token_id": MASK, "target_layer_ids": [0, 1, 2, 3],
                              "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 16,
                              "selector_top_k": 16}}


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, MASK, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def target():
    cfg = GLMConfig.from_dict(tiny.tiny_config_dict())
    w = tiny.random_weights(cfg)
    for k in w:
        trunk = k.startswith("layers.") and not k.startswith(f"layers.{cfg.mtp_layer}.")
        if trunk and (k.endswith("o_proj.weight") or k.endswith("down_proj.weight")):
            w[k] = w[k] * 0.1
    return GLMModel(cfg, w), make_tokenizer(cfg.vocab_size)


def make_engine(target, **opts) -> E.Engine:
    model, tok = target
    opts = {"num_blocks": 96, "block_size": BS, "max_num_seqs": 8, "max_batch_tokens": 256,
            "eos_token_ids": [EOS], "snapshot_bytes": 0, **opts}
    return E.Engine(model, tok, **opts)


@pytest.fixture(scope="module")
def trajectories(target):
    """Training prompts and the target's greedy continuations (prompt seeds never used by the tests)."""
    prompts = [prompt(1000 + i, 4 + i % 9) for i in range(24)]
    res = make_engine(target, max_num_seqs=24).generate(
        prompts, E.SamplingParams(temperature=0, max_tokens=36, ignore_eos=True))
    return [(p, p + r.token_ids) for p, r in zip(prompts, res)]


@pytest.fixture(scope="module")
def features(target, trajectories):
    """Per training sequence: ids, the target's final-norm hidden rows and DFlash2 taps."""
    model, _ = target
    seqs = [torch.tensor(s) for _, s in trajectories]
    nb = [-(-len(s) // BS) for s in seqs]
    cache = CachePool(model.config, sum(nb), len(seqs), block_size=BS, dtype=torch.float32)
    starts = [sum(nb[:i]) for i in range(len(seqs))]
    batch = [SeqChunk(s, 0, torch.arange(b, b + n), i) for i, (s, b, n) in enumerate(zip(seqs, starts, nb))]
    out = dflash.target_forward(model, batch, cache, [], (0, 1, 2, 3))
    rows, feats = 0, []
    for (p, _), s in zip(trajectories, seqs):
        feats.append((len(p), s, out.hidden[rows:rows + len(s)], out.taps[rows:rows + len(s)]))
        rows += len(s)
    return feats


def train_drafter(target, features, steps: int = 160) -> dict[str, torch.Tensor]:
    """SpecForge's objective (dflash2.md §1.3) on the target's greedy continuations: random anchors in
    the generated part, blocks [x_a, MASK...] that see context rows before a, CE on rows 1..7 with
    weights exp(-(k-1)/4), plus the selector's K-way CE with the gold predecessor (§2.1.3)."""
    model, _ = target
    cfg = dflash.DFlash2Config.from_dict(drafter_config_dict(layers=2))
    weights = {k: v.requires_grad_() for k, v in dflash.init_drafter_weights(cfg, seed=1).items()}
    drafter = dflash.DFlash2Drafter(cfg, weights, model)
    opt = torch.optim.Adam(weights.values(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    B, lm_head = cfg.block_size, model.w("lm_head.weight")
    row_w = torch.exp(-torch.arange(B - 1) / 4.0)
    for step in range(steps):
        p_len, ids, _, taps = features[step % len(features)]
        T = len(ids)
        anchors = torch.randint(p_len - 1, T - 1, (16,), generator=g)
        pos = anchors[:, None] + torch.arange(B)
        valid = pos[:, 1:] < T
        gold = ids[pos.clamp(max=T - 1)]
        block = torch.cat([gold[:, :1], torch.full((16, B - 1), MASK)], 1)
        ctx = drafter.context_kv(taps, torch.arange(T))
        h = drafter.block_hidden(block, pos, ctx, torch.arange(T), torch.arange(T)[None] < anchors[:, None])[:, 1:]
        logits = F.linear(h, lm_head)
        ce = F.cross_entropy(logits.flatten(0, 1), gold[:, 1:].flatten(), reduction="none").view(16, B - 1)
        loss = (ce * row_w * valid).sum() / (row_w * valid).sum()
        U, cand = torch.topk(logits.detach(), cfg.selector_top_k, -1)
        z = F.linear(h, weights["candidate_selector.hidden_projection.weight"])
        A = weights["candidate_selector.predecessor_codebook"][gold[:, :-1]]
        score = U + torch.einsum("nrj,nrj,nrkj->nrk", A, z, weights["candidate_selector.successor_codebook"][cand])
        hit = (cand == gold[:, 1:, None])
        keep = hit.any(-1) & valid
        if keep.any():
            loss = loss + F.cross_entropy(score[keep], hit[keep].float().argmax(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach() for k, v in weights.items()}


@pytest.fixture(scope="module")
def drafters(target, features, tmp_path_factory):
    """A random DFlash2 drafter (5 layers, selector on) and a trained one (2 layers), both written in
    the published layout and loaded back through load_drafter."""
    model, _ = target
    root = tmp_path_factory.mktemp("drafters")
    rand_cfg = drafter_config_dict()
    rand = dflash.init_drafter_weights(dflash.DFlash2Config.from_dict(rand_cfg), seed=2, std=0.1)
    dflash.write_drafter(root / "random", rand_cfg, rand)
    dflash.write_drafter(root / "trained", drafter_config_dict(layers=2), train_drafter(target, features))
    return {name: dflash.load_drafter(root / name, model) for name in ("random", "trained")}


@pytest.fixture(scope="module")
def mtp_target(target, features):
    """The target with layer 45 fitted to it: attention and MoE branches off, eh_proj by ridge
    regression so that z ≈ the next position's normalized residual (h_{t+1} / norm.weight), and
    shared_head.norm = norm, so MTP's logits approximate the target's next-next prediction."""
    model, tok = target
    cfg, w = model.config, dict(model.weights)
    p = f"layers.{cfg.mtp_layer}."
    X, Y = [], []
    for _, ids, h, _ in features:
        e = w["embed_tokens.weight"][ids[1:]]
        X.append(torch.cat([rms_norm(e, w[p + "enorm.weight"], 1e-5),
                            rms_norm(h[:-1], w[p + "hnorm.weight"], 1e-5)], -1))
        Y.append(h[1:] / w["norm.weight"])
    X, Y = torch.cat(X), torch.cat(Y)
    w[p + "eh_proj.weight"] = torch.linalg.solve(X.T @ X + 1.0 * torch.eye(X.shape[1]), X.T @ Y).T.contiguous()
    w[p + "shared_head.norm.weight"] = w["norm.weight"].clone()
    for k in w:
        if k.startswith(p) and (k.endswith("o_proj.weight") or k.endswith("down_proj.weight")):
            w[k] = torch.zeros_like(w[k])
    return GLMModel(cfg, w), tok


TEST_PROMPTS = [prompt(i, 3 + 5 * i) for i in range(6)]
GREEDY = E.SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_greedy(target):
    return [r.token_ids for r in make_engine(target).generate(TEST_PROMPTS, GREEDY)]


# ---------------------------------------------------------------------------------------------
# Config and checkpoint


def test_published_config_parses_and_names_every_tensor(fixtures_dir):
    d = json.loads((fixtures_dir / FIXTURE_CONFIG).read_text())
    cfg = dflash.DFlash2Config.from_dict(d)
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (8, 154856, (5, 14, 24, 33, 42))
    assert cfg.windows == (2048,) * 5 and cfg.n_groups == 256
    rows = [line.split("\t") for line in (fixtures_dir / "glm53/dflash2.tensors.tsv").read_text().splitlines()[1:]]
    published = {name: tuple(json.loads(shape)) for name, _, shape in rows}
    assert dflash.drafter_shapes(cfg) == published
    assert sum(math.prod(s) for s in published.values()) == 1_171_080_448
    dflash.check_drafter_tensors(cfg, {n: ("BF16", s) for n, s in published.items()})
    assert dflash.build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # the spec's example


def test_bad_drafters_are_named(target, tmp_path, monkeypatch):
    model, _ = target
    d = drafter_config_dict(layers=1)
    with pytest.raises(ValueError, match="DFlash2DraftModel"):
        dflash.DFlash2Config.from_dict({**d, "architectures": ["DFlashDraftModel"]})
    with pytest.raises(ValueError, match="conv_group_size"):
        dflash.DFlash2Config.from_dict({**d, "dflash_config": {**d["dflash_config"], "conv_group_size": 15}})
    with pytest.raises(ValueError, match="missing field 'dflash_config.mask_token_id'"):
        dflash.DFlash2Config.from_dict({**d, "dflash_config": {k: v for k, v in d["dflash_config"].items()
                                                               if k != "mask_token_id"}})
    with pytest.raises(ValueError, match="hidden_size = 128 does not match the target's 256"):
        dflash.DFlash2Config.from_dict({**d, "hidden_size": 128}).check_target(model.config)
    with pytest.raises(ValueError, match=r"target_layer_ids \[7\]"):
        dflash.DFlash2Config.from_dict({**d, "dflash_config": {**d["dflash_config"], "target_layer_ids": [0, 7]}}
                                       ).check_target(model.config)
    cfg = dflash.DFlash2Config.from_dict(d)
    w = dflash.init_drafter_weights(cfg)
    path = dflash.write_drafter(tmp_path / "ok", d, w)
    assert set(dflash.load_drafter(path, model).weights) == set(w)
    from safetensors.torch import save_file
    bad = {k: v.to(torch.bfloat16) for k, v in w.items() if k != "norm.weight"}
    bad["fc.weight"] = bad["fc.weight"][:, :512].contiguous()
    save_file(bad, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"norm.weight: missing.*fc.weight: shape \[256, 512\], expected \[256, 10"):
        dflash.load_drafter(path, model)
    with pytest.raises(ValueError, match="speculator 'dflash2' needs a drafter"):
        make_engine(target, speculator="dflash2")
    with pytest.raises(ValueError, match="speculator='eagle'"):
        make_engine(target, speculator="eagle")
    no_mtp = GLMConfig.from_dict(tiny.tiny_config_dict(num_nextn_predict_layers=0))
    with pytest.raises(ValueError, match="needs the checkpoint's MTP layer"):
        make_engine((GLMModel(no_mtp, tiny.random_weights(no_mtp)), target[1]), speculator="mtp")
    monkeypatch.setattr(cache_mod, "TAIL_RING", 9)  # 7 drafts rejected would overwrite an open pool's members
    with pytest.raises(ValueError, match="drafts up to 7 tokens; a verify pass may reject at most 6"):
        make_engine(target, speculator="mtp")


# ---------------------------------------------------------------------------------------------
# DFlash2 math


def test_block_conv_and_identity_init():
    y = torch.randn(2, 5, 32)
    base = torch.randn(2, 32)
    delta = torch.randn(2, 5, 2, 2)  # groups of 16
    out = dflash.block_conv(y, base, delta, 16)
    i, c = 3, 20
    want = (base[0, c] + delta[1, i, 0, 1]) * y[1, i, c] + (base[1, c] + delta[1, i, 1, 1]) * y[1, i - 1, c]
    assert torch.allclose(out[1, i, c], want, atol=1e-6)
    row0 = (base[0] + delta[:, 0, 0].repeat_interleave(16, -1)) * y[:, 0]
    assert torch.allclose(out[:, 0], row0)  # row 0 sees no earlier row
    ident = torch.tensor([[1.0] * 32, [0.0] * 32])
    assert torch.equal(dflash.block_conv(y, ident, torch.zeros_like(delta), 16), y)


def test_block_rows_see_only_context_before_the_anchor_and_inside_the_window(target, drafters):
    drafter = drafters["random"]
    assert drafter.config.windows == (64,) * 5
    g = torch.Generator().manual_seed(3)
    taps = torch.randn(100, 4 * 256, generator=g)
    ids = torch.tensor([[7] + [MASK] * 7])
    pos = 90 + torch.arange(8)[None]
    before = (torch.arange(100) < 90)[None]

    def hidden(t: torch.Tensor) -> torch.Tensor:
        return drafter.block_hidden(ids, pos, drafter.context_kv(t, torch.arange(100)), torch.arange(100), before)
    h = hidden(taps)
    for row, seen in ((95, False), (20, False), (40, True)):  # after the anchor; 70 >= 64 away; 50 away
        changed = taps.clone()
        changed[row] += 1
        assert torch.equal(hidden(changed), h) != seen, row


def test_batched_drafts_equal_drafts_alone(drafters):
    """draft() runs one block pass for several sequences; each must see only its own context."""
    drafter = drafters["trained"]
    g = torch.Generator().manual_seed(5)
    lengths = {"a": 30, "b": 12}
    for key, n in lengths.items():
        rows = dflash.TargetPass(torch.zeros(0), torch.zeros(0), torch.randn(n, 4 * 256, generator=g), {})
        drafter.observe(key, 0, rows, (0, n))
    reqs = [dflash.DraftRequest(key, prompt(i, n + 1), n, 5, torch.zeros(0), 0, 0.0, g)
            for i, (key, n) in enumerate(lengths.items())]
    together = drafter.draft(reqs)
    assert [d.tokens for d in together] == [drafter.draft([r])[0].tokens for r in reqs]
    for key in lengths:
        drafter.release(key)


def test_selector_walk_and_sampled_q(drafters):
    d = drafters["random"]
    g = torch.Generator().manual_seed(4)
    logits, h = torch.randn(7, 512, generator=g), torch.randn(7, 256, generator=g)
    greedy = d.select(logits, h, 5, 7, 0.0, g)
    A = d.w("candidate_selector.predecessor_codebook")
    Bc = d.w("candidate_selector.successor_codebook")
    z = h @ d.w("candidate_selector.hidden_projection.weight").T
    prev = 5
    for r, t in enumerate(greedy.tokens):  # the walk, scored over all 16 candidates the slow way
        U, cand = torch.topk(logits[r], 16)
        scores = [float(U[j] + (A[prev] * z[r] * Bc[cand[j]]).sum()) for j in range(16)]
        assert t == int(cand[max(range(16), key=scores.__getitem__)])
        prev = t
    assert greedy.q is None
    sampled = d.select(logits, h, 5, 3, 1.0, torch.Generator().manual_seed(0))
    assert sampled.q.shape == (3, 512) and torch.allclose(sampled.q.sum(-1), torch.ones(3))
    assert all(sampled.q[r, t] > 0 and (sampled.q[r] > 0).sum() <= 16 for r, t in enumerate(sampled.tokens))


# ---------------------------------------------------------------------------------------------
# Acceptance rule


def test_greedy_acceptance_is_the_longest_matching_prefix_plus_the_target_token():
    x = torch.full((4, 6), -1.0)
    for j, t in enumerate([3, 1, 4, 2]):
        x[j, t] = 1.0
    g = torch.Generator()
    assert dflash.accept_drafts(x, [3, 1, 4], None, True, g) == [3, 1, 4, 2]  # all accepted + bonus
    assert dflash.accept_drafts(x, [3, 5, 4], None, True, g) == [3, 1]  # d2 rejected: the target's 1
    assert dflash.accept_drafts(x, [0, 1, 4], None, True, g) == [3]


@pytest.mark.parametrize("q_aware", [False, True])
def test_rejection_sampling_preserves_the_target_distribution(q_aware):
    """First emitted token ~ p_0 and, after an accepted d1, the second ~ p_1: chi-square at a fixed
    seed over 5,000 trials (5 % critical value for 5 degrees of freedom is 11.07)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 6, generator=g) * 1.5
    x[0, 1] += 2  # the drafts' first token is likely, so the second row is reached often
    p = torch.softmax(x, -1)
    q = torch.softmax(torch.randn(2, 6, generator=g), -1) if q_aware else None
    first, second = torch.zeros(6), torch.zeros(6)
    for _ in range(5000):
        drafts = [int(torch.multinomial(q[0], 1, generator=g)), int(torch.multinomial(q[1], 1, generator=g))] \
            if q_aware else [1, 4]
        out = dflash.accept_drafts(x, drafts, q, False, g)
        first[out[0]] += 1
        if out[0] == drafts[0] and len(out) > 1:
            second[out[1]] += 1

    def chi2(counts, probs):
        expected = counts.sum() * probs
        return float(((counts - expected) ** 2 / expected).sum())
    assert chi2(first, p[0]) < 11.07
    assert chi2(second, p[1]) < 11.07
    assert second.sum() > 1000  # the second row was reached often enough to test it


# ---------------------------------------------------------------------------------------------
# Rollback


@pytest.mark.parametrize("ring", [cache_mod.TAIL_RING, 8], ids=["ring", "smallest_ring"])
@pytest.mark.parametrize("kept", [2, 1])
def test_rollback_equals_a_run_that_saw_only_the_accepted_tokens(target, monkeypatch, kept, ring):
    """Verify [anchor, d1..d5] at position 10, keep `kept` rows: pools [8..11] and [12..15] were completed
    in the verify, the second only by rejected drafts. After rollback the KDA state, conv window,
    DSA rows and pooled keys equal a run that computed just the kept rows, and so does the next step,
    which reads its open pool's first members back from the slot's tail ring. A ring of 8 is the
    smallest that holds them past 5 rejected rows (cache.TAIL_RING)."""
    model, _ = target
    cfg = model.config
    monkeypatch.setattr(cache_mod, "TAIL_RING", ring)
    cache = CachePool(cfg, 4, 2, block_size=BS, dtype=torch.float32)
    ctx, anchor_d = prompt(20, 10), prompt(21, 6)
    a_bt, b_bt = torch.tensor([0, 2]), torch.tensor([1, 3])
    for slot, bt in ((0, a_bt), (1, b_bt)):
        model.forward([SeqChunk(torch.tensor(ctx), 0, bt, slot)], cache)
    saved = dflash.save_kda_slots(cache, [0])
    verify_batch = [SeqChunk(torch.tensor(anchor_d), 10, a_bt, 0)]
    verify = dflash.target_forward(model, verify_batch, cache, list(range(6)), record_rows=list(range(6)))
    dflash.rollback_kda(model, cache, verify, verify_batch, {0: kept}, saved)
    ref = model.forward([SeqChunk(torch.tensor(anchor_d[:kept]), 10, b_bt, 1)], cache, all_logits=True)
    end = 10 + kept
    assert torch.allclose(verify.logits[:kept], ref.logits, atol=1e-5)
    assert torch.allclose(cache.kda_state[:, 0], cache.kda_state[:, 1], atol=1e-5)
    assert torch.allclose(cache.conv_state[:, 0], cache.conv_state[:, 1], atol=1e-6)
    assert torch.allclose(cache.latent[:, 0, :end], cache.latent[:, 1, :end], atol=1e-5)
    open_pool = torch.arange(end // 4 * 4, end) % ring
    for t in (cache.index_k, cache.gate):
        assert torch.allclose(t[:, 0, open_pool], t[:, 1, open_pool], atol=1e-5)
    assert torch.allclose(cache.pooled[:, 0, :end // 4], cache.pooled[:, 1, :end // 4], atol=1e-5)
    assert not torch.allclose(cache.pooled[:, 0, 3], cache.pooled[:, 1, 3])  # the rejected pool's stale key
    nxt = prompt(22, 5)  # completes the open pool and [12..15] from accepted rows only
    after = [model.forward([SeqChunk(torch.tensor(nxt), end, bt, s)], cache, all_logits=True).logits
             for s, bt in ((0, a_bt), (1, b_bt))]
    assert torch.allclose(after[0], after[1], atol=1e-5)
    assert torch.allclose(cache.pooled[:, 0, :4], cache.pooled[:, 1, :4], atol=1e-5)
    assert torch.allclose(cache.kda_state[:, 0], cache.kda_state[:, 1], atol=1e-5)


def test_engine_rollback_leaves_the_cache_of_a_plain_run(target, drafters):
    """Engine level: after a speculative generate with partial accepts, score() of prompt + output
    (a cold teacher-forced pass) reproduces the logits each emitted token was chosen from."""
    eng = make_engine(target, speculator="dflash2", drafter=drafters["trained"], draft_tokens=5)
    ids = TEST_PROMPTS[3]
    lp = E.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    r = eng.generate([ids], lp)[0]
    assert 0 < r.acceptance.accepted_tokens < r.acceptance.draft_tokens  # partial accepts happened
    logits = eng.score(ids + r.token_ids)[len(ids) - 1:-1]
    ref = torch.log_softmax(logits, -1)
    for t, got in enumerate(r.logprobs):
        assert abs(got.logprob - float(ref[t, got.token_id])) < 1e-4
    assert eng.stats().blocks_used == 0 and not drafters["trained"].contexts
    # The drafter's cache holds exactly the committed rows: positions 0 .. tokens - 2 (the last
    # token is the next anchor), never a rejected draft's.
    n = len(ids)
    for o in eng.stream(ids, lp):
        n += len(o.token_ids)
        if not o.finished:
            assert drafters["trained"].contexts[o.request_id].pos.tolist() == list(range(n - 1))


# ---------------------------------------------------------------------------------------------
# Lossless greedy, acceptance, mixing


@pytest.mark.parametrize("which", ["dflash2-random", "dflash2-trained", "mtp-random", "mtp-fitted"])
def test_greedy_speculation_is_token_identical_to_plain_greedy(which, target, mtp_target, drafters, plain_greedy):
    name, kind = which.split("-")
    if name == "dflash2":
        eng = make_engine(target, speculator="dflash2", drafter=drafters[kind])
    else:
        eng = make_engine(mtp_target if kind == "fitted" else target, speculator="mtp")
    out = eng.generate(TEST_PROMPTS, GREEDY)
    assert [r.token_ids for r in out] == plain_greedy
    st = eng.stats()
    acc = [r.acceptance for r in out]
    assert st.spec_verify_steps == sum(a.verify_steps for a in acc) > 0
    assert st.spec_accepted_tokens == sum(a.accepted_tokens for a in acc)
    rate = st.spec_accepted_tokens / st.spec_draft_tokens
    print(f"{which}: {st.spec_accepted_tokens}/{st.spec_draft_tokens} drafts accepted, mean accepted length "
          f"{(st.spec_accepted_tokens + st.spec_verify_steps) / st.spec_verify_steps:.2f}")
    if kind == "random":  # and the adaptive length falls to one draft per step
        assert rate < 0.1 and st.spec_draft_tokens < 2 * st.spec_verify_steps
    else:
        assert rate > 0.3 and sum(a.mean_accepted_length for a in acc) / len(acc) > 1.8


@pytest.mark.parametrize("which", ["dflash2", "mtp"])
def test_greedy_speculation_with_the_smallest_tail_ring_the_engine_takes(which, target, mtp_target, drafters,
                                                                        plain_greedy, monkeypatch):
    """The DSA layers' tail ring only just long enough for the drafter's rejected rows (max_draft + kpool - 1:
    the engine refuses one less): greedy tokens still equal plain greedy's, through passes that rejected drafts.
    (With the engine's check taken out, a ring of one pool gives other tokens here; rings 2 and 4 shorter than
    this one happened not to: the rollback test above holds the bound exactly.)"""
    max_draft = drafters["trained"].max_draft if which == "dflash2" else dflash.MTPDrafter.max_draft
    monkeypatch.setattr(cache_mod, "TAIL_RING", max_draft + target[0].config.index_kpool - 1)
    eng = (make_engine(target, speculator="dflash2", drafter=drafters["trained"]) if which == "dflash2"
           else make_engine(mtp_target, speculator="mtp"))
    assert [r.token_ids for r in eng.generate(TEST_PROMPTS, GREEDY)] == plain_greedy
    st = eng.stats()
    assert 0 < st.spec_accepted_tokens < st.spec_draft_tokens


def test_mixed_batch_and_stops(target, drafters, plain_greedy):
    """Speculative decodes share steps with prefill chunks (a small token budget), a request that
    stops on a token, and one with max_tokens=1 (never drafts); outputs equal plain runs."""
    eng = make_engine(target, speculator="dflash2", drafter=drafters["trained"], max_batch_tokens=24)
    stop_at = plain_greedy[1][4]
    params = [GREEDY, E.SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_at]),
              E.SamplingParams(temperature=0, max_tokens=1)] + [GREEDY] * 3
    out = eng.generate(TEST_PROMPTS, params)
    assert out[0].token_ids == plain_greedy[0]
    assert out[1].token_ids == plain_greedy[1][:plain_greedy[1].index(stop_at) + 1] and out[1].finish_reason == "stop"
    assert out[2].token_ids == plain_greedy[2][:1] and out[2].acceptance.verify_steps == 0
    assert [r.token_ids for r in out[3:]] == plain_greedy[3:]
    assert eng.stats().blocks_used == 0


def test_min_tokens_under_speculation_equals_plain_greedy(target, drafters):
    """A verify row sees the drafts before it as generated: with eos made the most likely token everywhere, plain
    greedy under min_tokens m writes m other tokens, then eos, and speculative greedy writes the same (a row past
    min_tokens held off eos would accept the draft there instead)."""
    mins = (0, 3, 5, 8, 11, 16)
    params = [E.SamplingParams(temperature=0, max_tokens=20, logit_bias={EOS: 100}, min_tokens=m) for m in mins]
    plain = make_engine(target).generate(TEST_PROMPTS, params)
    spec = make_engine(target, speculator="dflash2", drafter=drafters["trained"]).generate(TEST_PROMPTS, params)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert all(EOS not in r.token_ids[:m] and r.token_ids[m:] == [EOS] for r, m in zip(plain, mins))
    assert sum(r.acceptance.accepted_tokens for r in spec) > 10


def test_no_draft_goes_past_the_thinking_budget(target, drafters):
    """The token after the thinking budget is forced, so a step drafts no further than the budget:
    speculative greedy with budgets is token-identical to plain greedy with them."""
    model, _ = target
    tok = make_tokenizer(model.config.vocab_size, THINK_TOKENS)
    budgets = (0, 1, 3, 5, 8, 12)
    params = [E.SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, thinking_token_budget=b) for b in budgets]
    prompts = [p + [tok.token_to_id("<think>")] for p in TEST_PROMPTS]
    opts = {"num_blocks": 96, "block_size": BS, "max_num_seqs": 8, "max_batch_tokens": 256, "eos_token_ids": [EOS],
            "snapshot_bytes": 0}
    plain = [r.token_ids for r in E.Engine(model, tok, **opts).generate(prompts, params)]
    spec = E.Engine(model, tok, speculator="dflash2", drafter=drafters["trained"], **opts).generate(prompts, params)
    assert [r.token_ids for r in spec] == plain
    end = tok.token_to_id("</think>")
    assert all(out[b] == end for out, b in zip(plain, budgets) if end not in out[:b])
    assert sum(r.acceptance.accepted_tokens for r in spec) > 10


def test_pool_exhaustion_preempts_speculating_sequences_without_changing_outputs(target, drafters, plain_greedy):
    eng = make_engine(target, speculator="dflash2", drafter=drafters["trained"], num_blocks=8, max_num_seqs=6)
    assert [r.token_ids for r in eng.generate(TEST_PROMPTS, GREEDY)] == plain_greedy
    assert eng.stats().preemptions > 0 and eng.stats().blocks_used == 0 and not drafters["trained"].contexts


def test_draft_length_adapts_to_acceptance():
    st = dflash.DraftStats.new(7)
    assert dflash.draft_length(st, 0.25, None) == 4  # the 3-in-4 prior: 0.75^4 >= 0.25 > 0.75^5
    for _ in range(20):
        st.record(7, 7)
    assert dflash.draft_length(st, 0.25, None) == 7
    for _ in range(40):
        st.record(4, 0)
    assert dflash.draft_length(st, 0.25, None) == 1
    assert dflash.draft_length(st, 0.25, 3) == 3
    assert (st.verify_steps, st.draft_tokens, st.accepted_tokens) == (60, 300, 140)


# ---------------------------------------------------------------------------------------------
# Sampling end to end


def exact_three_token_distribution(eng: E.Engine, ids: list[int], p: E.SamplingParams) -> dict[tuple, float]:
    """Probabilities of every first-3-token continuation under plain sampling, from score()."""
    def dist(prefix: list[int]) -> torch.Tensor:
        x = E.process_logits(eng.score(ids + prefix)[-1], p, torch.tensor(ids), torch.tensor(prefix, dtype=torch.long))
        return torch.softmax(x, -1)
    out = {}
    p1 = dist([])
    for a in p1.nonzero().flatten().tolist():
        p2 = dist([a])
        for b in p2.nonzero().flatten().tolist():
            p3 = dist([a, b])
            for c in p3.nonzero().flatten().tolist():
                out[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    return out


@pytest.mark.parametrize("speculator", ["dflash2", "mtp"])
def test_sampled_speculation_matches_the_plain_distribution(speculator, target, mtp_target, drafters,
                                                           plain_greedy):
    """300 seeded requests (temperature 0.8, top_k 3, a presence penalty) of 3 tokens after a prompt
    that ends in generated text (where the drafters are good): the empirical distribution of the 27
    continuations against the exact one, chi-square over bins with expected count >= 5 (0.1 %
    critical value) and total variation < 0.17. Fixed seeds: deterministic."""
    model_target = mtp_target if speculator == "mtp" else target
    kw = {"drafter": drafters["trained"]} if speculator == "dflash2" else {}
    # The prefix cache serves the repeated prompt (the drafters then see only its recomputed tail).
    eng = make_engine(model_target, speculator=speculator, max_num_seqs=100, max_batch_tokens=512,
                      snapshot_bytes=1 << 24, **kw)
    ids = TEST_PROMPTS[1] + plain_greedy[1]
    N = 300
    params = [E.SamplingParams(temperature=0.8, top_k=3, presence_penalty=0.5, max_tokens=3, ignore_eos=True, seed=s)
              for s in range(N)]
    out = eng.generate([ids] * N, params)
    exact = exact_three_token_distribution(eng, ids, params[0])
    counts: dict[tuple, int] = {}
    for r in out:
        counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
    assert set(counts) <= set(exact)
    assert 20 < eng.stats().spec_accepted_tokens < N - 20  # drafts were accepted, and rejected
    tv = 0.5 * sum(abs(counts.get(k, 0) / N - v) for k, v in exact.items())
    big = [k for k, v in exact.items() if v * N >= 5]
    rest = N * (1 - sum(exact[k] for k in big))
    chi2 = sum((counts.get(k, 0) - N * exact[k]) ** 2 / (N * exact[k]) for k in big)
    if rest >= 5:
        chi2 += (sum(counts.get(k, 0) for k in exact if k not in big) - rest) ** 2 / rest
    critical = {d: c for d, c in enumerate([10.8, 13.8, 16.3, 18.5, 20.5, 22.5, 24.3, 26.1, 27.9, 29.6, 31.3,
                                            32.9, 34.5, 36.1, 37.7, 39.3, 40.8, 42.3, 43.8, 45.3, 46.8, 48.3,
                                            49.7, 51.2, 52.6, 54.1], start=1)}
    print(f"{speculator}: TV {tv:.3f}, chi2 {chi2:.1f} over {len(big) + (rest >= 5)} bins")
    assert eng.stats().prefix_hit_tokens > 0
    assert tv < 0.17 and chi2 < critical[len(big) + (rest >= 5) - 1]


def test_load_with_speculators(tmp_path, target):
    path = tiny.make_tiny_checkpoint(tmp_path / "ckpt")
    make_tokenizer(512).save(str(path / "tokenizer.json"))
    d = drafter_config_dict(layers=1)
    dpath = dflash.write_drafter(tmp_path / "drafter", d,
                                 dflash.init_drafter_weights(dflash.DFlash2Config.from_dict(d)))
    opts = dict(device="cpu", dtype=torch.float32, progress=False, num_blocks=16, block_size=BS)
    plain = E.load(path, **opts).generate([prompt(7, 9)], GREEDY)[0]
    for spec, extra in (("dflash2", {"drafter_path": dpath}), ("mtp", {"draft_tokens": 2})):
        eng = E.load(path, speculator=spec, **extra, **opts)
        r = eng.generate([prompt(7, 9)], GREEDY)[0]
        assert r.token_ids == plain.token_ids and r.acceptance.verify_steps > 0
        assert eng.stats().speculator == spec
    with pytest.raises(ValueError, match="drafter path goes with speculator='dflash2'"):
        E.load(path, speculator="mtp", drafter_path=dpath, **opts)


def benchmark() -> None:
    """`PYTHONPATH=. python tests/test_dflash.py`: batch-1 greedy on the tiny target (6 prompts x 48
    tokens), plain against DFlash2 (the trained drafter) and MTP (fitted), best of 4 interleaved runs,
    wall and CPU time."""
    import time
    torch.set_num_threads(1)
    tgt = target.__wrapped__()
    feats = features.__wrapped__(tgt, trajectories.__wrapped__(tgt))
    drafter = dflash.DFlash2Drafter(dflash.DFlash2Config.from_dict(drafter_config_dict(layers=2)),
                                    train_drafter(tgt, feats), tgt[0])
    mtp = mtp_target.__wrapped__(tgt, feats)
    engines = {"plain": make_engine(tgt, max_num_seqs=1),
               "dflash2": make_engine(tgt, max_num_seqs=1, speculator="dflash2", drafter=drafter),
               "dflash2 k=7": make_engine(tgt, max_num_seqs=1, speculator="dflash2", drafter=drafter, draft_tokens=7),
               "mtp": make_engine(mtp, max_num_seqs=1, speculator="mtp"),
               "mtp k=3": make_engine(mtp, max_num_seqs=1, speculator="mtp", draft_tokens=3)}
    prompts = [prompt(100 + i, 8 + 4 * i) for i in range(6)]
    p = E.SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    wall, cpu, outs = {k: math.inf for k in engines}, {k: math.inf for k in engines}, {}
    for _ in range(4):
        for name, eng in engines.items():
            t, c = time.perf_counter(), time.process_time()
            outs[name] = [eng.generate([x], p)[0].token_ids for x in prompts]
            wall[name], cpu[name] = min(wall[name], time.perf_counter() - t), min(cpu[name], time.process_time() - c)
    for name, eng in engines.items():
        st = eng.stats()
        per_step = (st.spec_accepted_tokens + st.spec_verify_steps) / max(st.spec_verify_steps, 1)
        spec = (f"  identical {outs[name] == outs['plain']}, {st.spec_accepted_tokens}/{st.spec_draft_tokens} drafts "
                f"accepted, {per_step:.2f} tokens/verify step" if st.spec_verify_steps else "")
        print(f"{name:12s} wall {wall[name]:.2f} s ({wall['plain'] / wall[name]:.2f}x)  "
              f"cpu {cpu[name]:.2f} s ({cpu['plain'] / cpu[name]:.2f}x){spec}")


if __name__ == "__main__":
    benchmark()

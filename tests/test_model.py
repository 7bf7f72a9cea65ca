"""model_glm.py and cache.py against transformers' glm5_next (spec glm53.md §7) and by hand.

The oracle is a tiny random transformers model (fp32) whose degenerate default inits (A_log, kpool
ape and gate, mHC base, e_score_correction_bias) are perturbed, with 16 indexer heads, 2 DSA
layers, index_topk 16 / kpool 4 (so a 300-token prompt selects 4 of 75 pools) and a SwiGLU limit
the activations actually reach. Our side loads the saved checkpoint through checkpoint.load_weights.
"""
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

import cache as cache_mod
import checkpoint
import exl3
import model_glm
from cache import TAIL_RING, CachePool
from model_glm import GLMConfig, GLMModel, SeqChunk

transformers = pytest.importorskip("transformers")
from transformers.models.glm5_next import modeling_glm5_next as hf  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

TEXT = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.5,
    n_group=1, topk_group=1, norm_topk_prob=True,
    q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=0, v_head_dim=16,
    index_n_heads=16, index_head_dim=16, index_topk=16, index_kpool=4, index_kpool_always_select_tail=True,
    layer_types=["linear_attention", "deepseek_sparse_attention", "linear_attention", "deepseek_sparse_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"], indexer_types=["full"] * 4,
    linear_attn_config={"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0},
    hc_mult=4, hc_eps=1e-6, hc_sinkhorn_iters=20,
    # Weights ~N(0, 0.1) put gate/up activations around ±1, so a limit of 1 clamps a good share of them.
    swiglu_limit=1.0, initializer_range=0.1,
    rms_norm_eps=1e-5, pad_token_id=0, eos_token_id=1, tie_word_embeddings=False, max_position_embeddings=4096,
)
VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
              projection_intermediate_size=64)
PREFILL, DECODE, BLOCK = 300, 20, 16


def perturb(module: torch.nn.Module, g: torch.Generator) -> None:
    """Spread the parameters the default init leaves constant (spec §7.2 step 3)."""
    with torch.no_grad():
        for name, p in list(module.named_parameters()) + list(module.named_buffers()):
            if name.endswith("A_log"):
                p.uniform_(-1.0, 1.0, generator=g)
            elif name.endswith("index_kpool_compress_ape"):
                p.normal_(0.0, 1.0, generator=g)
            elif name.endswith("index_kpool_compress_gate"):
                p.normal_(0.0, 0.3, generator=g)
            elif name.endswith("hc.base"):
                p.normal_(0.0, 0.5, generator=g)
            elif name.endswith("hc.scale"):
                p.uniform_(0.5, 1.5, generator=g)
            elif name.endswith("e_score_correction_bias"):
                p.normal_(0.0, 0.05, generator=g)


def build_oracle(path, seed: int = 0, **overrides):
    """A perturbed tiny transformers model, saved to `path`, and our model on the saved checkpoint."""
    torch.manual_seed(seed)
    hf_cfg = transformers.Glm5NextConfig(text_config={**TEXT, **overrides}, vision_config=VISION)
    ref = transformers.Glm5NextForConditionalGeneration(hf_cfg).eval()
    perturb(ref, torch.Generator().manual_seed(seed + 1))
    ref.save_pretrained(path)
    cfg = GLMConfig.from_file(path)
    return ref, cfg, checkpoint.load_weights(path, cfg, torch.float32, "cpu", progress=False)


def new_pool(cfg: GLMConfig, slots: int = 4, blocks: int = 96) -> CachePool:
    return CachePool(cfg, num_blocks=blocks, num_slots=slots, block_size=BLOCK, dtype=torch.float32)


def table(first_block: int, n: int = 24) -> torch.Tensor:
    """A block table that is deliberately not the identity (blocks of other sequences interleave)."""
    return torch.arange(first_block, first_block + 4 * n, 4)


def hf_logits(ref, ids: torch.Tensor, decode: int) -> torch.Tensor:
    """transformers: prefill all but the last `decode` tokens, then decode them one by one."""
    with torch.no_grad():
        out = ref(input_ids=ids[None, :len(ids) - decode], use_cache=True)
        rows, past = [out.logits[0]], out.past_key_values
        for t in range(len(ids) - decode, len(ids)):
            out = ref(input_ids=ids[None, t:t + 1], past_key_values=past, use_cache=True)
            rows.append(out.logits[0])
            past = out.past_key_values
    return torch.cat(rows)


def run_chunks(model: GLMModel, pool: CachePool, ids: torch.Tensor, sizes: list[int], bt: torch.Tensor,
               slot: int = 0) -> torch.Tensor:
    """Feed ids in consecutive chunks of the given sizes; all logits."""
    rows, start = [], 0
    for n in sizes:
        rows.append(model.forward([SeqChunk(ids[start:start + n], start, bt, slot)], pool, all_logits=True).logits)
        start += n
    assert start == len(ids)
    return torch.cat(rows)


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    ref, cfg, weights = build_oracle(tmp_path_factory.mktemp("oracle"))
    ids = torch.randint(2, TEXT["vocab_size"], (PREFILL + DECODE,), generator=torch.Generator().manual_seed(7))
    return ref, cfg, GLMModel(cfg, weights), ids, hf_logits(ref, ids, DECODE)


# ---------------------------------------------------------------------------------------------
# Against transformers

def test_prefill_and_decode_match_transformers(oracle):
    _, cfg, model, ids, expected = oracle
    got = run_chunks(model, new_pool(cfg), ids, [PREFILL] + [1] * DECODE, table(5))
    diff = (got - expected).abs().amax(-1)
    assert diff[:PREFILL].max() <= 1e-4, f"prefill max |Δlogit| {diff[:PREFILL].max():.3g}"
    assert diff[PREFILL:].max() <= 1e-4, f"decode max |Δlogit| {diff[PREFILL:].max():.3g}"
    assert expected.std() > 0.5  # the logits are not near-constant, so 1e-4 is a tight bound


@pytest.mark.parametrize("ring", [TAIL_RING, 4], ids=["ring", "smallest_ring"])
def test_uneven_chunked_prefill_equals_one_shot(oracle, monkeypatch, ring):
    """Chunks that start inside a pool read its first members back from the slot's tail ring; the
    smallest ring (one pool) holds only the positions a chunk leaves open."""
    _, cfg, model, ids, expected = oracle
    monkeypatch.setattr(cache_mod, "TAIL_RING", ring)
    one_shot = run_chunks(model, new_pool(cfg), ids[:PREFILL], [PREFILL], table(0))
    # The chunked run also splits the DSA queries into groups of 7 rows.
    monkeypatch.setattr(model_glm, "SCORE_BUDGET", 7 * cfg.index_n_heads * PREFILL)
    chunked = run_chunks(model, new_pool(cfg), ids[:PREFILL], [37, 1, 90, 3, 64, 105], table(2))
    assert (chunked - one_shot).abs().max() <= 1e-5
    assert (chunked - expected[:PREFILL]).abs().max() <= 1e-4


def test_sparse_selection_matters(oracle):
    """The oracle would catch a wrong selection: dense causal attention moves the logits a lot."""
    _, cfg, model, ids, expected = oracle
    dense = GLMModel(dataclasses.replace(cfg, index_topk=4 * PREFILL), model.weights)
    got = run_chunks(dense, new_pool(dense.config), ids[:PREFILL], [PREFILL], table(0))
    assert (got - expected[:PREFILL]).abs().max() > 0.1


def random_exl3(k: int, n: int, g: torch.Generator) -> exl3.EXL3Linear:
    """A K=4 EXL3 linear with a random trellis (exl3.quantize takes minutes per matrix on CPU; any
    trellis is a valid EXL3 weight). suh/svh of ±0.3 give weights of about the oracle's scale."""
    trellis = torch.randint(-2 ** 15, 2 ** 15, (k // 16, n // 16, 64), generator=g).to(torch.int16)
    suh, svh = (0.3 * (torch.randint(0, 2, (m,), generator=g) * 2 - 1) for m in (k, n))
    return exl3.EXL3Linear(trellis, suh.half(), svh.half(), "3inst")


def test_exl3_experts_match_transformers_on_dequantized_weights(tmp_path):
    """Routed experts as EXL3Linear on our side; transformers gets their dequantized weights."""
    # EXL3 needs in/out features in multiples of 128.
    ref, cfg, weights = build_oracle(tmp_path, seed=3, hidden_size=128, moe_intermediate_size=128,
                                     n_routed_experts=4, num_hidden_layers=2, layer_types=TEXT["layer_types"][:2],
                                     mlp_layer_types=["dense", "sparse"], indexer_types=["full"] * 2)
    experts = ref.model.language_model.layers[1].mlp.experts
    g = torch.Generator().manual_seed(4)
    D, I = cfg.hidden_size, cfg.moe_intermediate_size
    with torch.no_grad():
        for e in range(cfg.n_routed_experts):
            p = f"layers.1.mlp.experts.{e}."
            lins = {"gate": random_exl3(D, I, g), "up": random_exl3(D, I, g), "down": random_exl3(I, D, g)}
            for n, lin in lins.items():
                weights[p + f"{n}_proj.weight"] = lin
            # W as the EXL3Linear applies it (fp32): its rows are the images of the unit vectors.
            # weight() is the same W rounded to fp16, which alone moves these logits by ~2e-3.
            dq = {n: lin(torch.eye(lin.in_features)).T for n, lin in lins.items()}
            for n, lin in lins.items():
                assert torch.allclose(dq[n], lin.weight().float().T, rtol=1e-3, atol=1e-4)
            experts.gate_up_proj[e] = torch.cat([dq["gate"], dq["up"]])
            experts.down_proj[e] = dq["down"]
    ids = torch.randint(2, TEXT["vocab_size"], (100,), generator=torch.Generator().manual_seed(11))
    expected = hf_logits(ref, ids, 4)
    got = run_chunks(GLMModel(cfg, weights), new_pool(cfg), ids, [96, 1, 1, 1, 1], table(1))
    assert expected.std() > 0.5
    assert (got - expected).abs().max() <= 1e-4


# ---------------------------------------------------------------------------------------------
# MTP (transformers has none): a hand computation built from transformers' own DSA and MoE modules

def mtp_weights(tc, layer: int, g: torch.Generator) -> tuple[dict, "hf.Glm5NextTextAttention", "hf.Glm5NextTextMoE"]:
    D = tc.hidden_size
    attn = hf.Glm5NextTextAttention(tc, layer_idx=1).eval()
    moe = hf.Glm5NextTextMoE(tc).eval()
    with torch.no_grad():
        for mod in (attn, moe):
            for name, p in list(mod.named_parameters()) + list(mod.named_buffers()):
                p.normal_(0.0, 0.1, generator=g)
                if name.endswith("norm.weight"):
                    p.add_(1.0)
        perturb(attn, g)
        perturb(moe, g)
    p = f"layers.{layer}."
    w = {p + "self_attn." + k: v for k, v in attn.state_dict().items()}
    w |= {p + "mlp." + k: v for k, v in moe.state_dict().items() if not k.startswith("experts.")}
    for e in range(tc.n_routed_experts):
        gate, up = moe.experts.gate_up_proj[e].detach().chunk(2)
        w |= {p + f"mlp.experts.{e}.gate_proj.weight": gate, p + f"mlp.experts.{e}.up_proj.weight": up,
              p + f"mlp.experts.{e}.down_proj.weight": moe.experts.down_proj[e].detach()}
    for name in ("enorm", "hnorm", "shared_head.norm", "input_layernorm", "post_attention_layernorm"):
        w[p + name + ".weight"] = 1 + 0.1 * torch.randn(D, generator=g)
    w[p + "eh_proj.weight"] = 0.1 * torch.randn(D, 2 * D, generator=g)
    return w, attn, moe


def test_mtp_matches_hand_computation(oracle):
    ref, cfg, model, ids, _ = oracle
    tc = ref.config.text_config
    cfg = dataclasses.replace(cfg, num_nextn_predict_layers=1)
    L = cfg.mtp_layer
    extra, attn, moe = mtp_weights(tc, L, torch.Generator().manual_seed(5))
    weights = {**model.weights, **extra}
    mtp = GLMModel(cfg, weights)
    pool = new_pool(cfg)
    T = PREFILL
    bt = table(0)
    h = mtp.forward([SeqChunk(ids[:T], 0, bt, 0)], pool, all_logits=True).hidden
    # Draft for position t: trunk hidden h_t with the token at t+1.
    got = mtp.mtp_forward(h[:T - 1], [SeqChunk(ids[1:T], 0, bt, 0)], pool, all_logits=True).logits

    eps, p = cfg.rms_norm_eps, f"layers.{L}."

    def norm(x, name):
        return weights[p + name + ".weight"] * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def by_hand(e: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            z = torch.cat([norm(e, "enorm"), norm(h[:T - 1], "hnorm")], -1) @ weights[p + "eh_proj.weight"].T
            mask = torch.ones(1, T - 1, dtype=torch.bool)
            r1 = z + attn(norm(z, "input_layernorm")[None], attention_mask=mask)[0][0]
            r2 = r1 + moe(norm(r1, "post_attention_layernorm")[None])[0]
            return norm(r2, "shared_head.norm") @ weights["lm_head.weight"].T

    e = weights["embed_tokens.weight"][ids[1:T]]
    expected = by_hand(e)
    assert (got - expected).abs().max() <= 1e-4

    # Rows in SeqChunk.images (an image's) stand for their tokens' embedding, as in forward.
    image = torch.randn(6, cfg.hidden_size, generator=torch.Generator().manual_seed(6))
    with_image = mtp.mtp_forward(h[:T - 1], [SeqChunk(ids[1:T], 0, bt, 2, images=((40, image),))], new_pool(cfg),
                                 all_logits=True).logits
    e_image = e.clone()
    e_image[40:46] = image
    assert (with_image - by_hand(e_image)).abs().max() <= 1e-4 < (with_image - expected).abs().max()

    # The same drafts one step at a time after a partial prefill of the MTP cache.
    pool2 = new_pool(cfg)
    rows = [mtp.mtp_forward(h[:280], [SeqChunk(ids[1:281], 0, bt, 1)], pool2, all_logits=True).logits]
    for t in range(280, T - 1):
        rows.append(mtp.mtp_forward(h[t:t + 1], [SeqChunk(ids[t + 1:t + 2], t, bt, 1)], pool2).logits)
    assert (torch.cat(rows) - expected).abs().max() <= 1e-4


# ---------------------------------------------------------------------------------------------
# Batching, cache, KDA slots, autograd

def test_batch_of_different_lengths_equals_each_alone(oracle, monkeypatch):
    _, cfg, model, ids, _ = oracle
    seqs = [ids[:150], ids[100:137], ids[40:65], ids[7:87]]
    # Each alone: all but the last 20 tokens, then those 20 (sequence 3: 60 + 20 as well).
    alone = [run_chunks(model, new_pool(cfg), s, [len(s) - 20, 20], table(0)) for s in seqs]
    # Batched, the DSA query groups (of 3 to 40 rows here) do not line up with the sequences.
    monkeypatch.setattr(model_glm, "SCORE_BUDGET", 5000 * cfg.index_n_heads)

    pool = new_pool(cfg, slots=6)
    slots, tables = [0, 1, 2, 5], [table(i) for i in range(4)]
    model.forward([SeqChunk(seqs[3][:60], 0, tables[3], 5)], pool)  # a sequence already under way
    first = [SeqChunk(s[:len(s) - 20], 0, tables[i], slots[i]) for i, s in enumerate(seqs[:3])]
    first.append(SeqChunk(seqs[3][60:], 60, tables[3], 5))
    got = model.forward(first, pool, all_logits=True).logits
    a = 0
    for i, chunk in enumerate(first):
        n = len(chunk.tokens)
        expected = alone[i][chunk.start:chunk.start + n]
        assert (got[a:a + n] - expected).abs().max() <= 1e-5, f"sequence {i}"
        a += n
    # Then the last 20 tokens of sequences 0-2 together: last-position logits of each.
    second = [SeqChunk(s[len(s) - 20:], len(s) - 20, tables[i], slots[i]) for i, s in enumerate(seqs[:3])]
    got = model.forward(second, pool).logits
    for i in range(3):
        assert (got[i] - alone[i][-1]).abs().max() <= 1e-5, f"sequence {i}"


def test_equal_chunks_run_side_by_side_like_each_alone(oracle, monkeypatch):
    """Chunks whose KDA segments line up (equal start and length; decode steps anywhere) share one
    KDA pass, stacked on the head axis; a chunk of another shape in the same batch runs on its own."""
    _, cfg, model, ids, _ = oracle
    passes = []
    side_by_side = GLMModel._kda_side_by_side
    monkeypatch.setattr(GLMModel, "_kda_side_by_side",
                        lambda self, row, chunks, *a: passes.append(len(chunks)) or side_by_side(self, row, chunks, *a))
    seqs = [ids[:70], ids[90:160], ids[200:270], ids[30:75]]  # 70: a KDA chunk and a piece
    slots = [1, 0, 3, 2]
    pool, alone_pool = new_pool(cfg), new_pool(cfg)
    batch = [SeqChunk(s, 0, table(i), slot) for i, (s, slot) in enumerate(zip(seqs, slots))]
    got = model.forward(batch, pool, all_logits=True).logits
    assert passes == [3, 1] * len(cfg.kda_layers)
    a = 0
    for c in batch:
        alone = model.forward([c], alone_pool, all_logits=True).logits
        assert (got[a:a + len(c.tokens)] - alone).abs().max() <= 1e-5
        a += len(c.tokens)
    # One decode step of all four (positions 70, 70, 70, 45): one KDA pass.
    passes.clear()
    step = [SeqChunk(ids[300 + i:301 + i], len(s), table(i), slot) for i, (s, slot) in enumerate(zip(seqs, slots))]
    got = model.forward(step, pool).logits
    assert passes == [4] * len(cfg.kda_layers)
    for i, c in enumerate(step):
        assert (got[i] - model.forward([c], alone_pool).logits[0]).abs().max() <= 1e-5
    assert (pool.kda_state - alone_pool.kda_state).abs().max() <= 1e-5
    assert (pool.conv_state - alone_pool.conv_state).abs().max() <= 1e-5


def test_logit_rows_taps_and_kda_inputs(oracle):
    """What speculative decoding reads from forward: logits at chosen rows with every row's hidden,
    the streams' mean after a layer (after the last one it is what the final norm normalizes), and
    each KDA layer's input at chosen rows."""
    _, cfg, model, ids, _ = oracle
    batch = lambda: [SeqChunk(ids[:30], 0, table(0), 0), SeqChunk(ids[40:50], 0, table(1), 1)]
    full = model.forward(batch(), new_pool(cfg), all_logits=True)
    L = cfg.num_hidden_layers - 1
    out = model.forward(batch(), new_pool(cfg), logit_rows=[3, 29, 35], taps=(0, L), kda_input_rows=[31, 32])
    assert torch.equal(out.hidden, full.hidden) and out.taps.shape == (40, 2 * cfg.hidden_size)
    assert (out.logits - full.logits[[3, 29, 35]]).abs().max() <= 1e-5
    normed = model_glm.rms_norm(out.taps[:, cfg.hidden_size:], model.weights["norm.weight"], cfg.rms_norm_eps)
    assert (normed - full.hidden).abs().max() <= 1e-5
    assert sorted(out.kda_inputs) == list(cfg.kda_layers)
    assert all(x.shape == (2, cfg.hidden_size) for x in out.kda_inputs.values())


def test_slot_state_restores_and_start_zero_resets(oracle):
    _, cfg, model, ids, _ = oracle
    pool = new_pool(cfg)
    model.forward([SeqChunk(ids[:112], 0, table(0), 0)], pool)
    # Copying a slot's KDA state and conv window into another slot continues exactly like the original.
    pool.kda_state[:, 3], pool.conv_state[:, 3] = pool.kda_state[:, 0], pool.conv_state[:, 0]
    a = model.forward([SeqChunk(ids[112:130], 112, table(0), 0)], pool).logits
    b = model.forward([SeqChunk(ids[112:130], 112, table(0), 3)], pool).logits
    assert torch.equal(a, b)
    # start == 0 begins afresh on a used slot and used blocks.
    fresh = model.forward([SeqChunk(ids[200:230], 0, table(1), 0)], new_pool(cfg), all_logits=True).logits
    reused = model.forward([SeqChunk(ids[200:230], 0, table(0), 3)], pool, all_logits=True).logits
    assert torch.equal(fresh, reused)


def test_forward_records_autograd_and_the_pool_keeps_values(oracle):
    """No no_grad inside forward (train.py backpropagates through it); the pool never holds a graph."""
    _, cfg, model, ids, _ = oracle
    weights = {n: w.detach().clone().requires_grad_(n == "layers.0.self_attn.A_log") for n, w in model.weights.items()}
    pool = new_pool(cfg)
    out = GLMModel(cfg, weights).forward([SeqChunk(ids[:40], 0, table(0), 0), SeqChunk(ids[50:90], 0, table(1), 1)],
                                         pool, all_logits=True)
    out.logits.sum().backward()
    grad = weights["layers.0.self_attn.A_log"].grad
    assert grad is not None and grad.abs().sum() > 0
    assert not pool.kda_state.requires_grad and not pool.conv_state.requires_grad
    with pytest.raises(ValueError, match=r"taps \[4\] are not trunk layers 0..3"):
        model.forward([SeqChunk(ids[:4], 0, table(0), 0)], pool, taps=(1, 4))


def test_cache_pool_layout_and_sizes(oracle):
    _, cfg, _, _, _ = oracle
    mtp_cfg = dataclasses.replace(cfg, num_nextn_predict_layers=1)
    pool = CachePool(mtp_cfg, num_blocks=3, num_slots=2, block_size=8, dtype=torch.bfloat16)
    assert pool.latent.shape == (3, 3, 8, cfg.kv_lora_rank)  # 2 DSA layers + MTP
    assert pool.pooled.shape == (3, 3, 2, cfg.index_head_dim)
    assert pool.index_k.shape == pool.gate.shape == (3, 2, TAIL_RING, cfg.index_head_dim)  # a ring a slot
    assert pool.kda_state.shape == (2, 2, 2, 16, 16) and pool.kda_state.dtype == torch.float32
    assert pool.conv_state.shape == (2, 2, 3, 3, 32)
    assert [pool.dsa_index(L) for L in (1, 3, 4)] == [0, 1, 2] and pool.kda_index(2) == 1
    with pytest.raises(ValueError, match="not a DSA layer"):
        pool.dsa_index(0)
    assert pool.bytes_per_token() == 3 * 2 * (16 + 16 // 4)  # latent, pooled key
    assert pool.kda_bytes_per_sequence() == 2 * (2 * 16 * 16 * 4 + 3 * 3 * 32 * 2)
    assert pool.bytes_per_sequence() == pool.kda_bytes_per_sequence() + 3 * 2 * 2 * TAIL_RING * 16
    with pytest.raises(ValueError, match="block_size"):
        CachePool(cfg, num_blocks=3, num_slots=2, block_size=6)


# ---------------------------------------------------------------------------------------------
# Pieces

def test_kda_chunk_equals_recurrence():
    g = torch.Generator().manual_seed(0)
    n, H, d = 45, 3, 8
    q, k = (model_glm.l2_norm(torch.randn(n, H, d, generator=g)) for _ in range(2))
    v = torch.randn(n, H, d, generator=g)
    gate = -5 * torch.rand(n, H, d, generator=g)
    beta = torch.rand(n, H, generator=g)
    S0 = torch.randn(H, d, d, generator=g)
    o1, S1 = model_glm.kda_recurrent(q, k, v, gate, beta, S0)
    o2, S2 = model_glm.kda_chunk(q, k, v, gate, beta, S0)
    assert (o1 - o2).abs().max() <= 1e-5 and (S1 - S2).abs().max() <= 1e-5


def test_indexer_ties_go_to_the_lower_pool():
    cfg = GLMConfig.from_dict(dict(TEXT, index_topk=8))  # 2 pools per query
    q = torch.ones(3, 16, 16)
    w = torch.ones(3, 16)
    pooled = torch.ones(6, 16)  # every pool scores the same
    positions = torch.tensor([13, 22, 23])
    mask = model_glm.select_tokens(q, w, pooled, positions, cfg)
    chosen = [torch.nonzero(row).flatten().tolist() for row in mask]
    assert chosen[0] == list(range(8)) + [12, 13]  # pools 0, 1 and the open tail 12..13
    assert chosen[1] == list(range(8)) + [20, 21, 22]
    assert chosen[2] == list(range(8))  # pool 5 (20..23) is complete: it competes, no tail


def test_swiglu_clamps_gate_from_above_only():
    gate = torch.tensor([-20.0, 20.0])
    up = torch.tensor([-20.0, 20.0])
    assert torch.allclose(model_glm.swiglu(gate, up, 10.0), F.silu(torch.tensor([-20.0, 10.0])) * torch.tensor([-10.0, 10.0]))


# ---------------------------------------------------------------------------------------------
# Config and weight validation

def test_config_reads_the_real_checkpoint_config(fixtures_dir):
    cfg = GLMConfig.from_file(fixtures_dir / "glm53" / "config.json")
    assert cfg.index_kpool == 4 and cfg.index_n_heads == 32 and cfg.index_topk == 2048
    assert cfg.dsa_layers == tuple(range(3, 45, 4)) and len(cfg.kda_layers) == 34
    assert cfg.mlp_layer_types == ("dense",) * 3 + ("sparse",) * 42
    assert (cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel) == (64, 128, 4)
    assert cfg.linear_lower_bound == -5.0 and cfg.mtp_layer == 45
    assert cfg.eos_token_ids == (154820, 154827, 154829)
    text_only = GLMConfig.from_dict(json.loads((fixtures_dir / "glm53" / "config.json").read_text())["text_config"])
    assert text_only == cfg


def _real_text(fixtures_dir) -> dict:
    return json.loads((fixtures_dir / "glm53" / "config.json").read_text())["text_config"]


@pytest.mark.parametrize("change, message", [
    (lambda t: t.update(layer_types=t["layer_types"][:-1]), "layer_types has 44 entries"),
    (lambda t: t.update(index_topk=2046), "multiple of index_kpool"),
    (lambda t: t.pop("index_kpool"), "index_kpool"),
    (lambda t: t.update(linear_num_heads=32), "contradicts linear_num_heads"),
    (lambda t: t.update(first_k_dense_replace=2), "contradicts first_k_dense_replace"),
    (lambda t: t["layer_types"].__setitem__(3, "full_attention"), r"layer_types\[3\]"),
    (lambda t: t["linear_attn_config"].update(full_attn_layers=[3]), "kda_layers and full_attn_layers"),
    (lambda t: t["indexer_types"].__setitem__(5, "shared"), "shared"),
    (lambda t: t.update(qk_rope_head_dim=64), "qk_rope_head_dim"),
    (lambda t: t["linear_attn_config"].update(gate_lower_bound=None), "softplus"),
    (lambda t: t.pop("hc_mult"), "hc_mult"),
])
def test_config_errors_name_the_field(fixtures_dir, change, message):
    t = _real_text(fixtures_dir)
    change(t)
    with pytest.raises(ValueError, match=message):
        GLMConfig.from_dict({"text_config": t})


def test_indexed_attention_label_and_derived_lists(fixtures_dir):
    t = _real_text(fixtures_dir)
    t["layer_types"] = ["indexed_attention" if x != "linear_attention" else x for x in t["layer_types"]]
    del t["mlp_layer_types"]
    assert GLMConfig.from_dict(t).dsa_layers == tuple(range(3, 45, 4))
    del t["layer_types"]  # falls back on linear_attn_config's layer lists
    cfg = GLMConfig.from_dict(t)
    assert cfg.dsa_layers == tuple(range(3, 45, 4)) and cfg.mlp_layer_types[:4] == ("dense",) * 3 + ("sparse",)


def test_weight_errors_name_the_tensor(oracle):
    _, cfg, model, _, _ = oracle
    weights = dict(model.weights)
    del weights["layers.1.self_attn.indexer.index_kpool_compress_ape"]
    with pytest.raises(ValueError, match="layers.1.self_attn.indexer.index_kpool_compress_ape"):
        GLMModel(cfg, weights)
    weights = dict(model.weights, **{"layers.2.self_attn.A_log": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"A_log.*\(3,\).*\(2,\)"):
        GLMModel(cfg, weights)
    with pytest.raises(ValueError, match="block_table"):
        model.forward([SeqChunk(torch.tensor([2] * 40), 0, torch.tensor([0, 1]), 0)], new_pool(cfg))

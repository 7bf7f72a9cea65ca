"""fastprefill.FastPrefill against its twin, model_glm.GLMModel.forward, on the tiny real-layout model:
the last-row logits of every chunk and every cache tensor afterwards (what decoding reads next), a
verify pass's rows, taps and KDA inputs, and the engine's use of it (speculative verify, score).

On CPU the Triton kernels run under the interpreter (tests/conftest.py)."""
import dataclasses

import pytest
import torch

import exl3_kernels
import fastdecode
import fastprefill
from cache import CachePool
from model_glm import SeqChunk
from test_fastdecode import CACHE_TENSORS, DEVICE, _kl, _model

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _both(model, block_size: int = 16, blocks: int = 8, slots: int = 3):
    """A reference cache and a fast one (with its FastPrefill), alike."""
    caches = [CachePool(model.config, num_blocks=blocks * slots, num_slots=slots, block_size=block_size,
                        dtype=model.dtype, device=DEVICE) for _ in range(2)]
    decoder = fastdecode.FastDecoder(model, caches[1], max_context=blocks * block_size)
    return caches, fastprefill.FastPrefill(decoder)


def _steps(model, caches, fast, steps: list[list[SeqChunk]]) -> tuple[float, float]:
    """Runs each step's chunks on both paths; the worst logit gap and KL over the steps."""
    worst, kl = 0.0, 0.0
    for batch in steps:
        ref = model.forward(batch, caches[0]).logits
        got = fast.forward(batch).logits
        assert got.shape == ref.shape
        worst, kl = max(worst, float((ref - got).abs().max())), max(kl, _kl(ref, got))
    return worst, kl


def _chunks(model, lens: list[list[int]], blocks: int = 8) -> list[list[SeqChunk]]:
    """lens[s] = the chunk lengths of sequence s (slot s, blocks s*blocks..): one step per round of
    chunks, sequences side by side."""
    g = torch.Generator().manual_seed(11)
    steps, starts = [], [0] * len(lens)
    for r in range(max(len(ls) for ls in lens)):
        batch = []
        for s, ls in enumerate(lens):
            if r < len(ls):
                toks = torch.randint(2, model.config.vocab_size, (ls[r],), generator=g)
                batch.append(SeqChunk(toks, starts[s], torch.arange(s * blocks, (s + 1) * blocks), s))
                starts[s] += ls[r]
        steps.append(batch)
    return steps


def _two_layers(dtype, experts: str = "dense"):
    """KDA + dense MLP, then DSA + MoE: every kind of sub-layer, at half the interpreter time."""
    return _model(dtype, experts, num_hidden_layers=2, first_k_dense_replace=1)


def _same_caches(caches, tight: bool) -> None:
    for n in CACHE_TENSORS:
        got, ref = getattr(caches[1], n).float(), getattr(caches[0], n).float()
        if tight:
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4, msg=n)
        else:  # bf16: a rounding may flip any element by an ulp of its size
            gap = (got - ref).abs()
            assert float(gap.max()) <= 2 ** -6 * float(ref.abs().max()) and float(gap.mean()) < 1e-3, n


# On a GPU the fp32 products of the KDA and DSA kernels run as TF32 (10-bit mantissa inputs).
EXACT = DEVICE == "cpu"


def test_prefill_matches_forward():
    """fp32. Chunks that start mid KDA chunk and mid block (19 = 16 + 3), cross pool completions and
    the indexer's top-k (16 positions), two sequences in one step; then a fast decode step reads
    the state the fast prefill left."""
    model = _two_layers(torch.float32)
    caches, fast = _both(model)
    steps = _chunks(model, [[19, 14], [5, 9]])
    worst, kl = _steps(model, caches, fast, steps)
    assert worst < (1e-3 if EXACT else 1e-2) and kl < (1e-7 if EXACT else 1e-6), (worst, kl)  # H200: 2.1e-3, 2.5e-7
    _same_caches(caches, tight=EXACT)
    step = [SeqChunk(torch.tensor([5]), 33, steps[0][0].block_table, 0)]
    assert _kl(model.forward(step, caches[0]).logits, fast.decoder.step(step).logits) < 1e-7


def test_image_rows_replace_their_tokens_embedding():
    """fp32. An image's rows (vision.py's, here random) across two chunks of one sequence, as the engine slices them:
    the kernel prefill places them as model_glm's forward does, and they matter."""
    model = _two_layers(torch.float32)
    caches, fast = _both(model)
    rows = torch.randn(12, model.config.hidden_size, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    steps = _chunks(model, [[19, 14]])
    steps[0][0] = dataclasses.replace(steps[0][0], images=((10, rows[:9]),))
    steps[1][0] = dataclasses.replace(steps[1][0], images=((0, rows[9:]),))
    worst, kl = _steps(model, caches, fast, steps)
    assert worst < (1e-3 if EXACT else 1e-2) and kl < (1e-7 if EXACT else 1e-6), (worst, kl)
    _same_caches(caches, tight=EXACT)
    last = []
    for images in (True, False):  # the same tokens without the rows: other logits
        pool = _both(model)[0][0]
        for batch in steps:
            out = model.forward([c if images else dataclasses.replace(c, images=()) for c in batch], pool)
        last.append(out.logits)
    assert float((last[0] - last[1]).abs().max()) > 1e-2


def test_prefill_matches_forward_in_bf16():
    """bf16; a one-token first chunk, then one that starts one row into a KDA chunk."""
    model = _two_layers(torch.bfloat16)
    caches, fast = _both(model)
    worst, kl = _steps(model, caches, fast, _chunks(model, [[1, 20]]))
    assert worst < 0.1 and kl < 1e-4, (worst, kl)  # CPU: 0.04, 4.8e-5 on the 4-layer model
    _same_caches(caches, tight=False)


def test_prefill_in_pieces_of_dsa_rows_matches_forward(monkeypatch):
    """fp32. A 30-row chunk in DSA pieces of 8 rows: the first two pieces' tables hold no more pools than
    the top-k (no indexer), the last two's more (the indexer over the pools up to each piece's end)."""
    model = _two_layers(torch.float32)
    caches, fast = _both(model)
    monkeypatch.setattr(fast, "DSA_ROWS", 8)
    calls = []
    scores = fastdecode.dsa_kernels.dsa_prefill_index_scores
    monkeypatch.setattr(fastdecode.dsa_kernels, "dsa_prefill_index_scores",
                        lambda *a, **k: calls.append(a[3].shape[0]) or scores(*a, **k))
    worst, kl = _steps(model, caches, fast, _chunks(model, [[30, 3]]))
    assert worst < (1e-3 if EXACT else 1e-2) and kl < (1e-7 if EXACT else 1e-6), (worst, kl)
    _same_caches(caches, tight=EXACT)
    assert calls == [2, 2, 3] * len(model.config.dsa_layers), calls  # the table widths of the pieces that score


def test_the_indexer_scratch_is_reserved_once_and_bounds_the_rows_a_launch(monkeypatch):
    """The pool scores of an indexer launch go into one scratch buffer a device, reserved for a context up
    front (what the engine measures before it sizes the cache): a chunk up to that context allocates no
    other, and once the scratch is at DSA_SCORE_BYTES a chunk at a longer context scores fewer rows a
    launch instead of growing it. The logits and caches stay the forward's."""
    model = _two_layers(torch.float32)
    caches, fast = _both(model)
    pools_per_block = 16 // model.config.index_kpool
    monkeypatch.setattr(fast, "DSA_ROWS", 8)
    monkeypatch.setattr(fast, "DSA_SCORE_BYTES", 4 * 8 * 3 * pools_per_block)  # 8 rows over 3 blocks of pools
    calls = []
    scores = fastdecode.dsa_kernels.dsa_prefill_index_scores
    monkeypatch.setattr(fastdecode.dsa_kernels, "dsa_prefill_index_scores",
                        lambda *a, **k: calls.append((a[0].shape[0], a[3].shape[0])) or scores(*a, **k))
    fast.reserve(2 * 16)
    (scratch,) = fast.scores.values()
    assert scratch.numel() == 8 * 2 * pools_per_block
    fast.reserve(5 * 16)  # past 8 rows over 3 blocks: the bound
    (scratch,) = fast.scores.values()
    assert scratch.numel() == 8 * 3 * pools_per_block
    worst, kl = _steps(model, caches, fast, _chunks(model, [[30, 36]]))
    assert worst < (1e-3 if EXACT else 1e-2) and kl < (1e-7 if EXACT else 1e-6), (worst, kl)
    _same_caches(caches, tight=EXACT)
    assert fast.scores[scratch.device] is scratch  # never grown
    # (rows, table width) of the launches that score (a one-block table holds no more pools than the top-k):
    # 30 rows in 8s, then 36 rows ending in block 5 in 4s (4 rows over 5 blocks of pools fit the bound, 8 do not)
    per_layer = [(8, 2), (6, 2)] + [(4, 3)] * 4 + [(4, 4)] * 4 + [(4, 5)]
    assert calls == per_layer * len(model.config.dsa_layers), calls


def test_prefill_with_exl3_experts_runs_the_moe_kernels(monkeypatch):
    """A step of up to MOE_DECODE_ROWS rows takes the decode kernel, a longer one the grouped GEMMs."""
    model = _two_layers(torch.float32, experts="exl3")
    caches, fast = _both(model)
    assert fast.decoder.layers[1].experts.exl3 is not None
    calls = []
    for name in ("exl3_moe_decode", "exl3_moe_prefill"):
        real = getattr(exl3_kernels, name)
        monkeypatch.setattr(exl3_kernels, name, lambda x, *a, real=real, name=name, **k:
                            calls.append((name, x.shape[0])) or real(x, *a, **k))
    rows = [19, fastprefill.MOE_DECODE_ROWS, fastprefill.MOE_DECODE_ROWS + 1]
    worst, kl = _steps(model, caches, fast, _chunks(model, [rows]))
    assert calls == [("exl3_moe_prefill", rows[0]), ("exl3_moe_decode", rows[1]), ("exl3_moe_prefill", rows[2])]
    assert worst < 5e-3 and kl < 1e-6, (worst, kl)
    _same_caches(caches, tight=EXACT)


def test_snapshots_inside_a_chunk_are_what_a_chunk_ending_there_leaves():
    """SeqChunk.snapshots on both paths: the KDA state and conv window at each block boundary asked
    are those a chunk ending there leaves in its slot (up to the rounding of fewer rows' products),
    and asking changes nothing else. Two sequences side by side at different starts, whose KDA
    pieces line up (the reference runs them as one group)."""
    model = _two_layers(torch.float32)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(5)
    a, b0, b = (torch.randint(2, V, (n,), generator=g) for n in (40, 16, 40))
    tables = [torch.arange(0, 8), torch.arange(8, 16)]
    asked = [SeqChunk(a, 0, tables[0], 0, (16, 32)), SeqChunk(b, 16, tables[1], 1, (48,))]

    def run(batch, fast_too=True):
        caches, fast = _both(model)
        paths = (lambda x: model.forward(x, caches[0]), fast.forward)[:2 if fast_too else 1]
        for path in paths:
            path([SeqChunk(b0, 0, tables[1], 1)])
        return [path(batch) for path in paths], caches

    (ref, got), caches = run(asked)
    (ref_plain, got_plain), plain_caches = run([dataclasses.replace(c, snapshots=()) for c in asked])
    assert torch.equal(ref.logits, ref_plain.logits) and torch.equal(got.logits, got_plain.logits)
    for c, plain in zip(caches, plain_caches):
        assert all(torch.equal(getattr(c, n), getattr(plain, n)) for n in CACHE_TENSORS)
    assert sorted(ref.snapshots) == sorted(got.snapshots) == [(0, 16), (0, 32), (1, 48)]
    for (i, p), snap in ref.snapshots.items():
        c = asked[i]
        _, (cut, _) = run([SeqChunk(c.tokens[:p - c.start], c.start, c.block_table, c.slot)], fast_too=False)
        want = cut.kda_state[:, c.slot], cut.conv_state[:, c.slot]
        for path, s, tol in (("reference", snap, 1e-5), ("fast", got.snapshots[(i, p)], 1e-5 if EXACT else 1e-3)):
            for name, rows, w in (("kda_state", s.kda_state, want[0]), ("conv_state", s.conv_state, want[1])):
                torch.testing.assert_close(torch.stack(rows), w, rtol=10 * tol, atol=tol, msg=f"{path} {name} at {p}")
    for bad in ((8,), (0,), (40,), (48,)):
        with pytest.raises(ValueError, match="snapshots"):
            model.forward([SeqChunk(a, 0, tables[0], 0, bad)], caches[0])


def test_a_snapshot_in_a_chunks_first_rows_takes_the_history_before_the_chunk():
    """A chunk that starts one row before a block boundary and snapshots there: the conv window at the
    snapshot is the slot's history before the chunk, then the chunk's first row, as a chunk ending
    there leaves it (the fast path once read the slot after writing the chunk's own end into it)."""
    model = _two_layers(torch.float32)
    tokens = torch.randint(2, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(6))
    table = torch.arange(0, 8)
    caches, fast = _both(model)
    snaps = []
    for path in (lambda x: model.forward(x, caches[0]), fast.forward):
        path([SeqChunk(tokens[:15], 0, table, 0)])
        snaps.append(path([SeqChunk(tokens[15:], 15, table, 0, (16,))]).snapshots[(0, 16)])
    (cut, _), _ = _both(model)
    for piece, start in ((tokens[:15], 0), (tokens[15:16], 15)):
        model.forward([SeqChunk(piece, start, table, 0)], cut)
    for path, snap, tol in (("reference", snaps[0], 1e-5), ("fast", snaps[1], 1e-5 if EXACT else 1e-3)):
        torch.testing.assert_close(torch.stack(snap.conv_state), cut.conv_state[:, 0], rtol=10 * tol, atol=tol,
                                   msg=f"{path} conv_state at 16")


def test_unsupported_block_size_is_named():
    model = _model(torch.float32)
    cache = CachePool(model.config, num_blocks=8, num_slots=2, block_size=48, dtype=model.dtype, device=DEVICE)
    with pytest.raises(fastdecode.Unsupported, match="block size 48"):
        fastprefill.FastPrefill(fastdecode.FastDecoder(model, cache, max_context=96))


def test_gate_bound_below_the_kernels_floor_is_named():
    """The KDA prefill kernel decays a 16-row block's keys to its first row and back: a gate bound of
    -6 could overflow exp(15 · 6) in fp32, so the fast path refuses the config instead."""
    model = _model(torch.float32)
    cache = CachePool(model.config, num_blocks=8, num_slots=2, block_size=16, dtype=model.dtype, device=DEVICE)
    decoder = fastdecode.FastDecoder(model, cache, max_context=96)
    fastprefill.FastPrefill(decoder)
    decoder.cfg = dataclasses.replace(decoder.cfg, linear_lower_bound=-6.0)
    with pytest.raises(fastdecode.Unsupported, match="gate_lower_bound -6.0"):
        fastprefill.FastPrefill(decoder)


def test_verify_pass_matches_forward():
    """A speculative verify's pass (dflash.target_forward): a prompt chunk beside a 4-row chunk,
    logits at chosen rows, every row's hidden, the taps and the KDA inputs at the verify rows."""
    model = _two_layers(torch.float32)
    caches, fast = _both(model)
    steps = _chunks(model, [[11], [17]])
    _steps(model, caches, fast, steps)
    batch = [SeqChunk(torch.tensor([3, 9, 27, 81]), 11, steps[0][0].block_table, 0),
             SeqChunk(torch.tensor([5, 6, 7, 8, 9, 10]), 17, steps[0][1].block_table, 1)]
    asked = dict(logit_rows=[0, 1, 2, 3, 9], taps=(0, 1), kda_input_rows=[2, 0, 1, 3])
    ref = model.forward(batch, caches[0], **asked)
    got = fast.forward(batch, **asked)
    assert _kl(ref.logits, got.logits) < (1e-7 if EXACT else 1e-6)
    for what in ("hidden", "taps"):
        torch.testing.assert_close(getattr(got, what), getattr(ref, what), rtol=1e-4, atol=1e-4 if EXACT else 1e-2)
    assert sorted(got.kda_inputs) == sorted(ref.kda_inputs) == list(model.config.kda_layers)
    for L in ref.kda_inputs:
        torch.testing.assert_close(got.kda_inputs[L], ref.kda_inputs[L], rtol=1e-4, atol=1e-4 if EXACT else 1e-2)
    _same_caches(caches, tight=EXACT)


def test_engine_verifies_speculative_drafts_on_the_fast_prefill():
    """engine: with a speculator (MTP here) the verify passes go to FastPrefill (on a GPU the engine
    builds it; here it is attached by hand), and greedy tokens stay the reference's."""
    import engine as E
    from test_engine import make_tokenizer

    model = _two_layers(torch.float32)
    tok = make_tokenizer(model.config.vocab_size)
    params = E.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    make = lambda: E.Engine(model, tok, eos_token_ids=[1], num_blocks=16, block_size=16, max_num_seqs=2,
                            speculator="mtp", draft_tokens=3, snapshot_bytes=0)
    prompts = [[5, 9, 13, 200, 7, 3, 77, 41, 19]]
    reference = [r.token_ids for r in make().generate(prompts, params)]
    eng = make()
    eng.prefill = fastprefill.FastPrefill(fastdecode.FastDecoder(model, eng.cache, max_context=eng.max_model_len))
    passes = []
    forward = eng.prefill.forward
    eng.prefill.forward = lambda batch, **kw: passes.append(len(kw.get("logit_rows") or ())) or forward(batch, **kw)
    assert [r.token_ids for r in eng.generate(prompts, params)] == reference
    assert passes and max(passes) > 1, passes  # verify passes with several logit rows ran here


def test_engine_scores_on_the_fast_prefill():
    import engine as E
    from test_engine import make_tokenizer

    model = _two_layers(torch.float32)
    make = lambda: E.Engine(model, make_tokenizer(model.config.vocab_size), eos_token_ids=[1], num_blocks=8,
                            block_size=16, max_num_seqs=2)
    ids = torch.randint(2, model.config.vocab_size, (23,), generator=torch.Generator().manual_seed(4)).tolist()
    reference = make().score(ids, chunk_tokens=10)
    eng = make()
    eng.prefill = fastprefill.FastPrefill(fastdecode.FastDecoder(model, eng.cache, max_context=eng.max_model_len))
    got = eng.score(ids, chunk_tokens=10)
    assert got.shape == reference.shape == (23, model.config.vocab_size)
    assert _kl(reference, got) < (1e-7 if EXACT else 1e-6)

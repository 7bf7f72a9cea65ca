"""engine.py: sampling, block manager, scheduler, prefix cache and the generate loop.

Engine tests run the tiny real-layout model (tests/tiny.py) in fp32 on CPU. A "solo" reference is
each prompt alone on an engine whose prefix cache is off (snapshot_bytes=0), so it is always cold.
"""
from __future__ import annotations

import dataclasses
import json
import math
import random
import re

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import chat
import engine as E
import jsonmode
import kernels
import pattern
import prefix_cache
import tiny
import toolmode
from model_glm import GLMConfig, GLMModel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the sampler's kernel runs where the logits are

BS = 16  # block size: a multiple of index_kpool (4), small so short prompts span several blocks
EOS = 1  # tiny config's eos_token_id


def make_tokenizer(vocab_size: int, special_tokens: tuple[str, ...] = ("<pad>", "<eos>")) -> Tokenizer:
    """A byte-level BPE with exactly the tiny model's vocabulary: <pad>=0, <eos>=1 (then any other
    special tokens), then bytes and merges."""
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7))) for _ in range(400)]
    corpus = [" ".join(rng.choice(words) for _ in range(50)) for _ in range(40)] + ["é ü ñ 中文字 😀 ✓"] * 5
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(special_tokens), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    assert tok.get_vocab_size() == vocab_size
    return tok


@pytest.fixture(scope="module")
def parts():
    cfg = GLMConfig.from_dict(tiny.tiny_config_dict())
    model = GLMModel(cfg, tiny.random_weights(cfg))
    return model, make_tokenizer(cfg.vocab_size)


@pytest.fixture(scope="module")
def make_engine(parts):
    model, tok = parts

    def make(**opts) -> E.Engine:
        opts = {"num_blocks": 64, "block_size": BS, "max_num_seqs": 4, "max_batch_tokens": 64,
                "eos_token_ids": [EOS], **opts}
        return E.Engine(model, tok, **opts)
    return make


@pytest.fixture(scope="module")
def cold(make_engine):
    return make_engine(snapshot_bytes=0)


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 512, (n,), generator=g).tolist()


GREEDY = E.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def solo(engine: E.Engine, ids: list[int], p: E.SamplingParams = GREEDY) -> E.Result:
    return engine.generate([ids], p)[0]


# ---------------------------------------------------------------------------------------------
# Sampling parameters and logits processing (no model)


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.5), ("temperature", float("nan")), ("top_k", -1), ("top_k", 2.5), ("top_p", 0.0),
    ("top_p", 1.5), ("min_p", -0.1), ("min_p", 2), ("repetition_penalty", 0), ("presence_penalty", 3),
    ("frequency_penalty", -2.5), ("max_tokens", 0), ("max_tokens", 1.0), ("seed", "x"), ("stop", [""]),
    ("stop", [3]), ("stop_token_ids", [-1]), ("logprobs", -1), ("temperature", True),
    ("thinking_token_budget", -1), ("thinking_token_budget", 2.0), ("logit_bias", {-1: 1.0}),
    ("logit_bias", {5: 101}), ("logit_bias", {5: float("inf")}), ("logit_bias", [5]), ("min_tokens", -1),
    ("min_tokens", 1.5), ("allowed_token_ids", []), ("allowed_token_ids", [-1])])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        E.SamplingParams(**{field: value})


def test_logit_bias_is_added_to_its_rows_logits_before_the_penalties():
    logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(0))
    biased = E.SamplingParams(logit_bias={3: 2.5, 9: -1.0}, presence_penalty=0.5)
    empty = torch.zeros(0, dtype=torch.long)
    x = E.penalized_rows(logits, [biased, E.SamplingParams()], [empty, empty], [torch.tensor([9]), []])
    want = logits.clone()
    want[0, 3] += 2.5
    want[0, 9] -= 1.0 + 0.5
    assert torch.equal(x, want) and not torch.equal(x, logits)
    greedy = E.SamplingParams(temperature=0, logit_bias={int(logits[1].argmin()): 100})
    assert E.draw_on_device(logits[1:], [greedy], [empty], [[]], [torch.Generator()]).tolist() == \
        [int(logits[1].argmin())]  # temperature 0 draws the biased argmax


def test_min_tokens_is_checked_against_max_tokens_and_held_answers():
    with pytest.raises(ValueError, match=r"min_tokens = 5: must be at most max_tokens \(4\)"):
        E.SamplingParams(min_tokens=5, max_tokens=4)
    with pytest.raises(ValueError, match="min_tokens = 1: cannot go with an answer a grammar holds"):
        E.SamplingParams(min_tokens=1, json_object=True)
    assert E.SamplingParams(min_tokens=4, max_tokens=4).min_tokens == 4


def test_hold_stops_puts_minus_inf_at_each_rows_own_tokens():
    rows = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    held = E.hold_stops(rows, [{1, 5}, set(), {7}])
    want = rows.clone()
    want[0, [1, 5]] = want[2, 7] = -math.inf
    assert torch.equal(held, want) and not torch.equal(rows, want)
    assert E.hold_stops(rows, [set()] * 3) is rows


def test_allowed_token_ids_leave_every_other_token_out():
    logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(1))
    only = E.SamplingParams(allowed_token_ids=[3, 9], logit_bias={9: 1.0})
    empty = torch.zeros(0, dtype=torch.long)
    x = E.penalized_rows(logits, [only, E.SamplingParams()], [empty, empty], [[], []])
    assert torch.isinf(x[0]).sum() == 14 and x[0, 3] == logits[0, 3] and x[0, 9] == logits[0, 9] + 1.0
    assert torch.equal(x[1], logits[1])
    greedy = E.SamplingParams(temperature=0, allowed_token_ids=[int(logits[1].argmin())])
    assert E.draw_on_device(logits[1:], [greedy], [empty], [[]], [torch.Generator()]).tolist() == \
        [int(logits[1].argmin())]  # temperature 0 draws the best allowed token, not the model's argmax
    drawn = {E.sample(logits[0], E.SamplingParams(temperature=1.0, allowed_token_ids=[3, 9]), empty, empty,
                      torch.Generator().manual_seed(s)) for s in range(20)}
    assert drawn == {3, 9}


def test_stop_string_becomes_a_list():
    assert E.SamplingParams(stop="###").stop == ["###"]


def probs(logits, **kw) -> torch.Tensor:
    empty = torch.zeros(0, dtype=torch.long)
    return torch.softmax(E.process_logits(logits, E.SamplingParams(**kw), empty, empty), -1)


def test_top_k_top_p_min_p_filter_as_defined():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]))
    assert (probs(logits, top_k=2) > 0).tolist() == [True, True, False, False, False]
    assert torch.allclose(probs(logits, top_k=2)[:2], torch.tensor([4 / 7, 3 / 7]))
    # top_p: the smallest head whose mass reaches p (0.4 + 0.3 = 0.7 >= 0.7; 0.85 needs three tokens)
    assert (probs(logits, top_p=0.7) > 0).sum() == 2
    assert (probs(logits, top_p=0.71) > 0).sum() == 3
    assert (probs(logits, top_p=0.3) > 0).sum() == 1
    # min_p: keep p >= min_p * p_max (0.5 * 0.4 = 0.2)
    assert (probs(logits, min_p=0.5) > 0).tolist() == [True, True, False, False, False]
    assert torch.allclose(probs(logits), torch.softmax(logits, -1))


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([2.0, 1.0, 0.0])
    cold_, hot = probs(logits, temperature=0.5), probs(logits, temperature=2.0)
    base = torch.softmax(logits, -1)
    assert cold_[0] > base[0] > hot[0]
    assert torch.allclose(cold_, torch.softmax(logits / 0.5, -1))


def test_penalties_lower_seen_tokens():
    logits = torch.tensor([2.0, -1.0, 0.5, 0.5])
    prompt_ids, out = torch.tensor([0]), torch.tensor([1, 2, 2])
    rep = E.process_logits(logits, E.SamplingParams(repetition_penalty=2.0), prompt_ids, out)
    assert rep.tolist() == [1.0, -2.0, 0.25, 0.5]  # positive logits divided, negative multiplied
    pres = E.process_logits(logits, E.SamplingParams(presence_penalty=1.0), prompt_ids, out)
    assert pres.tolist() == [2.0, -2.0, -0.5, 0.5]  # output tokens only, once each
    freq = E.process_logits(logits, E.SamplingParams(frequency_penalty=1.0), prompt_ids, out)
    assert freq.tolist() == [2.0, -2.0, -1.5, 0.5]  # by count


def test_batched_filters_are_each_rows_own():
    # process_rows filters all rows of a batch at once, each under its own params: row i comes out as it
    # would alone, and a row with every filter off keeps every token while the others are cut.
    logits = 3 * torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    params = [E.SamplingParams(temperature=0), E.SamplingParams(temperature=0.7), E.SamplingParams(top_k=5),
              E.SamplingParams(temperature=1.3, top_p=0.8), E.SamplingParams(top_k=10, top_p=0.5, min_p=0.05),
              E.SamplingParams(repetition_penalty=1.5, presence_penalty=0.5, min_p=0.2)]
    prompts, outs = [torch.tensor([1, 2])] * 6, [[3, 3, 4]] * 6
    batch = E.process_rows(logits, params, prompts, outs)
    for i, p in enumerate(params):
        assert torch.equal(batch[i], E.process_logits(logits[i], p, prompts[i], torch.tensor(outs[i]))), f"row {i}"
    kept = torch.isfinite(batch).sum(1).tolist()
    assert kept[:3] == [50, 50, 5] and 1 <= kept[4] <= 10 and kept[3] < 50 and kept[5] < 50
    assert torch.equal(batch[1], logits[1] / 0.7)
    gens = [torch.Generator().manual_seed(i) for i in range(6)]
    tokens = E.sample_rows(logits, params, prompts, outs, gens)
    assert tokens[0] == int(logits[0].argmax()) and all(torch.isfinite(batch[i, t]) for i, t in enumerate(tokens))


def test_sample_rows_draws_what_the_whole_row_race_draws(monkeypatch):
    # sample_rows' kernel (kernels.sample_race) cuts a row among its most likely tokens instead of filtering
    # the whole row; it must draw the token the plain statement draws, race(process_rows, race_noise), with
    # the same generators, in one batch and alone (the twin's path). Rows decided among their candidates: top_p cutting real mass, ties at the
    # k-th inside, top_p's mass over what top_k kept (not the whole row), min_p; rows the second kernel draws
    # over the whole row: flat top_p rows (their candidates' mass falls short; one with min_p), ties at the
    # k-th past the candidates (one with top_p over what top_k kept); rows never cut (raced over the whole row): min_p alone, temperature alone, greedy with a
    # penalty, its top value twice.
    monkeypatch.setattr(E, "TOP_P_CANDIDATES", 8)
    monkeypatch.setattr(kernels, "SAMPLE_BLOCK_V", 16)  # whole rows streamed in four blocks
    V = 64
    tail = lambda head: torch.cat([torch.tensor(head), torch.full((V - len(head),), (1 - sum(head)) / (V - len(head)))]).log()
    base = torch.randn(4, V, generator=torch.Generator().manual_seed(0))
    ties_inside = torch.cat([torch.tensor([5.0, 4.0, 3.0, 3.0]), -torch.arange(1.0, V - 3)])
    ties_past = torch.cat([torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0]), torch.zeros(5), -torch.arange(1.0, V - 9)])
    logits = torch.stack([tail([0.5, 0.3, 0.1, 0.05]), ties_inside, tail([0.4, 0.3, 0.2]),
                          tail([0.4, 0.3, 0.1, 0.1, 0.05]), 0.5 * base[0], ties_past, 3 * base[2], base[3],
                          2 * base[3], (2 * base[1]).round(), ties_inside.index_fill(0, torch.tensor([33, 48]), 5.0),
                          ties_past, 0.5 * base[1]])
    logits = logits.to(DEVICE)
    params = [E.SamplingParams(top_p=0.7), E.SamplingParams(top_k=3), E.SamplingParams(top_k=3, top_p=0.75),
              E.SamplingParams(top_p=0.9, min_p=0.3), E.SamplingParams(top_p=0.9),
              E.SamplingParams(temperature=2.0, top_k=6), E.SamplingParams(temperature=1.2, min_p=0.1),
              E.SamplingParams(temperature=0.9), E.SamplingParams(temperature=0, top_k=3, repetition_penalty=1.3),
              E.SamplingParams(top_k=6, top_p=0.8), E.SamplingParams(temperature=0, repetition_penalty=1.3),
              E.SamplingParams(temperature=2.0, top_k=6, top_p=0.78),
              E.SamplingParams(temperature=0.7, top_p=0.95, min_p=0.05)]
    n = len(params)
    prompts, outs = [torch.tensor([1, 2], device=DEVICE)] * n, [[30, 30, 40]] * n
    undecided, rest = [], kernels._sample_rest_kernel

    class Spy:  # the rows the candidates left to the whole-row kernel (-1 in `out` when it starts)
        def __getitem__(self, grid):
            def launch(x, y, vals, noise, cols, out, *args, **kw):
                undecided.append((out < 0).nonzero().flatten().tolist())
                return rest[grid](x, y, vals, noise, cols, out, *args, **kw)
            return launch
    monkeypatch.setattr(kernels, "_sample_rest_kernel", Spy())
    drawn = set()
    for seed in range(40):
        gens = lambda: [torch.Generator(DEVICE).manual_seed(100 * seed + i) for i in range(n)]
        undecided.clear()
        got = E.sample_rows(logits, params, prompts, outs, gens(), kernel=True)
        assert undecided == [[4, 5, 11, 12]], undecided
        x = E.process_rows(logits, params, prompts, outs)
        want = E.race(x, E.race_noise(params, gens(), V, x.device)).tolist()
        assert got == want, seed
        alone = [E.sample(logits[i], p, prompts[i], torch.tensor(outs[i], device=DEVICE), g)
                 for i, (p, g) in enumerate(zip(params, gens()))]
        assert alone == got, seed
        drawn |= {(i, t) for i, t in enumerate(got)}
    kept = lambda i: {t for j, t in drawn if j == i}
    assert kept(0) == kept(2) == kept(3) == {0, 1} and kept(1) == kept(11) == {0, 1, 2, 3} and len(kept(5)) > 5
    assert len(kept(4)) > 5 and len(kept(12)) > 5  # (the mass of what top_k kept puts token 4 of row 11 out)
    assert got[8] == int(x[8].argmax()) and got[10] == 0  # its top value at 0, 33, 48 (one lane, another, the same): the first wins


def test_the_whole_row_kernel_finds_top_ps_boundary_on_long_rows(monkeypatch):
    # kernels._sample_rest_kernel searches the row's values for top_p's boundary (no sort): on rows far past
    # their candidates, of several shapes (flat, heavy-tailed, six levels of 1e-4-apart values, a near-point mass),
    # each top_p keeps the twin's set: the same draws over many seeds.
    monkeypatch.setattr(E, "TOP_P_CANDIDATES", 4)
    V = 3000
    g = torch.Generator().manual_seed(5)
    rows = torch.stack([torch.randn(V, generator=g), 3 * torch.randn(V, generator=g).exp().neg(),
                        torch.randint(0, 6, (V,), generator=g).float() / 2 + torch.arange(V) * 1e-4,
                        torch.cat([torch.tensor([9.0]), torch.randn(V - 1, generator=g)])]).to(DEVICE)
    for top_p in (0.3, 0.9, 0.999):
        params = [E.SamplingParams(temperature=0.8, top_p=top_p)] * len(rows)
        ids = [torch.zeros(0, dtype=torch.long, device=DEVICE)] * len(rows)
        x = E.process_rows(rows, params, ids, [[]] * len(rows))
        for seed in range(6):
            gens = lambda: [torch.Generator(DEVICE).manual_seed(10 * seed + i) for i in range(len(rows))]
            got = E.sample_rows(rows, params, ids, [[]] * len(rows), gens(), kernel=True)
            assert got == E.race(x, E.race_noise(params, gens(), V, x.device)).tolist(), (top_p, seed)


def test_sampling_follows_the_distribution_and_the_seed():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1]))
    empty = torch.zeros(0, dtype=torch.long)
    p = E.SamplingParams(temperature=1.0)
    draw = lambda g: E.sample(logits, p, empty, empty, g)
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([draw(g) for _ in range(3000)]), minlength=3) / 3000
    assert torch.allclose(counts, torch.tensor([0.6, 0.3, 0.1]), atol=0.03)
    a, b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert [draw(a) for _ in range(50)] == [draw(b) for _ in range(50)]
    assert E.sample(logits, E.SamplingParams(temperature=0), empty, empty, g) == 0


# ---------------------------------------------------------------------------------------------
# Detokenization and stop strings (no model)


def test_incremental_detokenization_never_emits_broken_utf8():
    tok = make_tokenizer(512)
    text = "abc é 漢 ж 🙂 xyz"  # 漢, ж and 🙂 are not in the training text: split over byte tokens
    ids = tok.encode(text, add_special_tokens=False).ids
    d = E.Detokenizer(tok, skip_special_tokens=True)
    deltas = [d.push(t) for t in ids]
    assert "".join(deltas) == text
    assert not any("\ufffd" in x for x in deltas)
    assert "" in deltas  # a character's first bytes were held back


def test_held_back_keeps_possible_stop_prefixes():
    assert chat.held_back("hello ##", ["###"]) == 2
    assert chat.held_back("hello #", ["###", "#!"]) == 1
    assert chat.held_back("hello", ["###"]) == 0
    assert chat.held_back("ab", []) == 0


# ---------------------------------------------------------------------------------------------
# Block manager and prefix hashing (no model)


def test_sequence_table_follows_its_block_list():
    """Sequence.table() mirrors block_table through appends (past the mirror's capacity), drop_blocks
    (also with appends before the next call), a new list of the same length and one of any length,
    without a stale block."""
    seq = E.Sequence("r", [1], 1, E.SamplingParams(), frozenset(), torch.Generator(), None, torch.zeros(1))
    seq.block_table.extend(range(100, 103))
    assert seq.table().tolist() == [100, 101, 102]
    seq.block_table.extend(range(200, 240))  # past the mirror's first capacity (16)
    seq.block_table.append(7)
    assert seq.table().tolist() == [100, 101, 102, *range(200, 240), 7]
    assert seq.drop_blocks(30) == [*range(227, 240), 7]
    seq.block_table.append(8)
    assert seq.table().tolist() == [100, 101, 102, *range(200, 227), 8]
    assert seq.drop_blocks(20) == [*range(217, 227), 8]
    seq.block_table.extend([9, 10])  # appended before the next call
    assert seq.table().tolist() == [100, 101, 102, *range(200, 217), 9, 10]
    kept = seq.table()
    seq.block_table = [int(b) + 1000 for b in seq.block_table]  # admission after preemption: a new list
    assert seq.table().tolist() == seq.block_table and kept.tolist() != seq.block_table  # (a copy, not a view)
    seq.block_table = []
    assert seq.table().tolist() == []
    seq.block_table = [3, 1, 2]
    assert seq.table().tolist() == [3, 1, 2]


def test_block_hash_is_chained():
    a = prefix_cache.block_hash(b"", [1, 2, 3])
    assert a == prefix_cache.block_hash(b"", [1, 2, 3]) and a != prefix_cache.block_hash(b"", [1, 2, 4])
    assert prefix_cache.block_hash(a, [5]) != prefix_cache.block_hash(prefix_cache.block_hash(b"", [9]), [5])


def test_block_manager_refcounts_lru_and_eviction():
    snaps = prefix_cache.SnapshotStore(1 << 20, torch.device("cpu"))
    bm = prefix_cache.BlockManager(4, snaps)
    h = [prefix_cache.block_hash(b"", [i]) for i in range(4)]
    b0, b1 = bm.allocate(), bm.allocate()
    bm.register(b0, h[0])
    bm.register(b1, h[1])
    snaps.put(h[1], torch.zeros(2), torch.zeros(1))
    assert bm.match(h[:2], max_blocks=2) == (2, 2)
    assert bm.match(h[:2], max_blocks=1) == (0, 2)  # no snapshot at the first boundary
    bm.share(b0)
    assert bm.ref[b0] == 2
    bm.release([b0, b1])
    bm.release([b0])
    assert bm.num_free() == 4 and bm.match(h[:2], 2) == (2, 2)  # free but still cached
    # handed out least recently freed first: the two never-used blocks, then b1, then b0
    order = [bm.allocate() for _ in range(3)]
    assert order[2] == b1 and h[1] not in bm.cached and h[1] not in snaps  # evicting drops its snapshot
    assert bm.match(h[:2], 2) == (0, 1)


def test_snapshot_store_is_lru_within_budget():
    s = prefix_cache.SnapshotStore(3 * 40, torch.device("cpu"))  # room for three 40-byte snapshots
    for i in range(4):
        s.put(bytes([i]), torch.zeros(8), torch.zeros(2))
    assert list(s.items) == [b"\x01", b"\x02", b"\x03"] and s.nbytes == 120
    s.get(b"\x01")
    s.put(b"\x04", torch.zeros(8), torch.zeros(2))
    assert list(s.items) == [b"\x03", b"\x01", b"\x04"]
    s.pin(torch.zeros(0, 8), torch.zeros(0, 2))  # a model without KDA layers: no arena
    s.pin(torch.zeros(100), torch.zeros(2))  # one snapshot over the budget: no arena
    assert s.arena is None and list(s.items) == [b"\x03", b"\x01", b"\x04"]



@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned copies from a GPU")
def test_snapshot_store_copies_gpu_slots_to_pinned_memory_before_the_slot_changes():
    kda, conv = torch.randn(4, 8, 256, 256, device="cuda"), torch.randn(4, 3, 3, 512, device="cuda")
    size = (kda.numel() + conv.numel()) * 4
    s = prefix_cache.SnapshotStore(2 * size, torch.device("cpu"))
    s.pin(kda, conv)  # room for two
    want = []
    for i in range(3):  # the third put evicts the first and reuses its slot
        want.append((kda.cpu(), conv.cpu()))
        s.put(bytes([i]), kda, conv)
        kda.add_(1)  # the next forward writes the slot: queued after the copy
        conv.mul_(2)
    assert list(s.items) == [b"\x01", b"\x02"] and s.nbytes == 2 * size and s.free == []
    for i in (1, 2):
        snap = s.get(bytes([i]))
        assert snap.kda_state.is_pinned() and snap.conv_state.is_pinned()
        assert torch.equal(snap.kda_state, want[i][0]) and torch.equal(snap.conv_state, want[i][1])
    s.discard(b"\x01")
    assert len(s.free) == 1

# ---------------------------------------------------------------------------------------------
# The engine on the tiny model


def test_batched_greedy_equals_each_prompt_alone(make_engine, cold):
    prompts = [prompt(1, 5), prompt(2, 37), prompt(3, 16), prompt(4, 70)]
    alone = [solo(cold, p).token_ids for p in prompts]
    eng = make_engine(snapshot_bytes=0)
    batched = eng.generate(prompts, GREEDY)
    assert [r.token_ids for r in batched] == alone
    assert all(r.finish_reason == "length" and r.usage.completion_tokens == 6 for r in batched)
    assert [r.usage.prompt_tokens for r in batched] == [5, 37, 16, 70]


def test_the_measured_prefill_chunk_is_as_long_and_snapshots_as_much_as_a_real_prompts(make_engine, monkeypatch):
    """Engine._chunk_peak sizes the cache from one measured chunk (on CUDA): it must be as long as the
    longest chunk a prompt sends and take as many KDA snapshots inside it (each a copy of the
    sequence's KDA rows, ~141 MiB on the full model) as a real prompt's chunk does: two, where a prompt
    leaves the cached blocks and before its last token (the second prompt shares two blocks)."""
    eng = make_engine(max_batch_tokens=4 * BS)
    forward, sent = eng.model.forward, []

    def recording(chunks, *args, **kwargs):
        sent.extend((len(c.tokens), len(c.snapshots)) for c in chunks)
        return forward(chunks, *args, **kwargs)

    monkeypatch.setattr(eng.model, "forward", recording)
    first = prompt(7, 4 * BS)
    for p in (first, first[:2 * BS] + prompt(8, 2 * BS)):
        eng.generate([p], E.SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    real, sent[:] = list(sent), []
    assert max(n for _, n in real) == 2, real
    eng._chunk_peak(use_kernels=False, context=4 * BS)
    assert sent[0] == (4 * BS, 2), sent


def test_chunked_prefill_equals_one_shot(cold):
    ids = prompt(5, 90)
    whole = cold.score(ids, chunk_tokens=90)
    assert whole.shape == (90, 512) and whole.dtype == torch.float32
    for chunk in (7, 16, 33):
        assert (cold.score(ids, chunk_tokens=chunk) - whole).abs().max() <= 1e-5, chunk
    # the generate path with a 7-token budget samples from the same last-position logits
    eng_small = E.Engine(cold.model, cold.tokenizer, eos_token_ids=[EOS], num_blocks=64, block_size=BS,
                         max_batch_tokens=7, snapshot_bytes=0)
    lp = E.SamplingParams(temperature=0, max_tokens=1, logprobs=512)
    one = eng_small.generate([ids], lp)[0].logprobs[0]
    ref = torch.log_softmax(whole[-1], -1)
    assert max(abs(v - ref[t].item()) for t, v in one.top) <= 1e-5


def test_scoring_runs_the_head_a_block_of_rows_at_a_time(cold, monkeypatch):
    """score_blocks: one forward a chunk, then the head over SCORE_ROWS rows at a time (so the device never
    holds a chunk's or a prompt's logits at once); score and score_logprobs are made of those blocks and
    equal the one-shot rows and their log-softmax."""
    ids = prompt(6, 50)
    whole = cold.score(ids, chunk_tokens=50)
    monkeypatch.setattr(E, "SCORE_ROWS", 8)
    heads = []
    monkeypatch.setattr(cold.model, "head", lambda h, head=cold.model.head: heads.append(len(h)) or head(h))
    blocks = list(cold.score_blocks(ids, chunk_tokens=20))
    assert [s for s, _ in blocks] == [0, 8, 16, 20, 28, 36, 40, 48]
    assert heads == [0, 8, 8, 4, 0, 8, 8, 4, 0, 8, 2]  # each forward's own head sees no row
    assert (torch.cat([b.cpu() for _, b in blocks]) - whole).abs().max() <= 1e-5
    lp = torch.log_softmax(whole, -1)
    scored = cold.score_logprobs(ids, 3, full=True)
    assert (scored.full - lp).abs().max() <= 1e-5
    assert (scored.token_logprobs - lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]).abs().max() <= 1e-5
    assert torch.equal(scored.top_ids, lp.topk(3, -1).indices)
    assert (scored.top_logprobs - lp.topk(3, -1).values).abs().max() <= 1e-5
    assert cold.score_logprobs(ids, 0).full is None and cold.stats().blocks_used == 0


def test_score_validates_and_frees(cold):
    with pytest.raises(ValueError, match="free cache blocks"):
        cold.score(prompt(0, 64 * BS + 1))
    assert cold.stats().blocks_used == 0


def logits_of(eng: E.Engine, ids: list[int], n: int, monkeypatch) -> tuple[torch.Tensor, E.Result]:
    """Greedy run of n tokens (top_k=1); returns the logits sampled from [n, vocab] (draw_on_device's rows)."""
    seen = []

    def spy(logits, *args, **kwargs):
        seen.extend(logits.clone())
        return real(logits, *args, **kwargs)
    real = E.draw_on_device
    with monkeypatch.context() as m:
        m.setattr(E, "draw_on_device", spy)
        r = eng.generate([ids], E.SamplingParams(top_k=1, max_tokens=n, ignore_eos=True))[0]
    return torch.stack(seen), r


def test_prefix_cache_hit_equals_cold_run(make_engine, cold, monkeypatch):
    eng = make_engine()
    ids = prompt(6, 3 * BS + 5)
    first, r1 = logits_of(eng, ids, 4, monkeypatch)
    assert r1.usage.cached_tokens == 0
    st = eng.stats()
    assert st.prefix_hit_tokens == 0 and st.snapshots == 1  # at the prompt's last full block
    second, r2 = logits_of(eng, ids, 4, monkeypatch)
    assert r2.usage.cached_tokens == 3 * BS and r2.token_ids == r1.token_ids
    st = eng.stats()
    assert st.prefix_hit_tokens == 3 * BS and st.prefix_query_tokens == 2 * len(ids)
    assert st.prompt_tokens_computed == len(ids) + 5
    # The cold run took the snapshot inside its one chunk (SeqChunk.snapshots), which changed
    # nothing it computed; the hit resumes there, and a correct restore (shared DSA blocks + KDA
    # state + conv window) agrees with the cold run up to the rounding of fewer rows' products.
    one_shot, _ = logits_of(cold, ids, 4, monkeypatch)
    assert torch.equal(first, one_shot)
    assert (second - one_shot).abs().max() <= 1e-5


def test_a_prompt_of_whole_blocks_still_recomputes_its_last_token(make_engine, cold):
    eng = make_engine()
    ids = prompt(15, 2 * BS)
    eng.generate([ids], GREEDY)
    again = eng.generate([ids], GREEDY)[0]
    assert again.usage.cached_tokens == BS  # not 2 * BS: the last token's logits are needed
    longer = ids + prompt(16, 5)
    r = eng.generate([longer], GREEDY)[0]
    assert r.usage.cached_tokens == 2 * BS
    assert again.token_ids == solo(cold, ids).token_ids and r.token_ids == solo(cold, longer).token_ids
    eng.reset_prefix_cache()
    assert eng.generate([longer], GREEDY)[0].usage.cached_tokens == 0 and eng.stats().snapshots > 0


def test_logprobs_report_the_model_distribution(cold, monkeypatch):
    ids = prompt(14, 9)
    logits, r_top1 = logits_of(cold, ids, 3, monkeypatch)
    r = cold.generate([ids], E.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=5))[0]
    assert r.token_ids == r_top1.token_ids  # the batched argmax path agrees with sample()
    # in a batch where another request asks for none and one for fewer: each its own row, its own top n
    batch = cold.generate([prompt(15, 6), ids, ids], [GREEDY] + [E.SamplingParams(
        temperature=0, max_tokens=3, ignore_eos=True, logprobs=n) for n in (2, 5)])
    assert batch[0].logprobs is None and batch[2].token_ids == r.token_ids
    for got, n in ((r, 5), (batch[1], 2), (batch[2], 5)):
        for row, step, token in zip(logits, got.logprobs, got.token_ids):
            lp = torch.log_softmax(row, -1)
            # (a batch's forward rounds its products in another order than one request's: ~1e-6)
            assert step.token_id == token and step.logprob == pytest.approx(lp[token].item(), abs=1e-5)
            assert [t for t, _ in step.top] == torch.topk(lp, n).indices.tolist()


def test_one_block_shared_prefix_hits(make_engine, cold, monkeypatch):
    """Short agent turns: a shared prefix of a single block is reused (no large block floor)."""
    eng = make_engine()
    system = prompt(7, BS)
    eng.generate([system + prompt(8, 5)], GREEDY)
    ids = system + prompt(9, 6)
    hit, r = logits_of(eng, ids, 6, monkeypatch)
    assert r.usage.cached_tokens == BS
    # the cold reference cuts its prefill after the first block, where the hit resumed (the caching
    # run took its snapshot inside its one chunk: the same up to the rounding of fewer rows' products)
    split = E.Engine(cold.model, cold.tokenizer, eos_token_ids=[EOS], num_blocks=64, block_size=BS,
                     max_batch_tokens=BS, snapshot_bytes=0)
    ref, r_cold = logits_of(split, ids, 6, monkeypatch)
    assert r.token_ids == r_cold.token_ids and (hit - ref).abs().max() <= 1e-5


def test_branch_point_snapshot_lets_the_third_request_hit(make_engine, cold):
    eng = make_engine()
    system = prompt(10, BS + 3)  # the common part ends inside block 1: one full shared block
    eng.generate([system + prompt(11, 40)], GREEDY)  # snapshot at its last full block only
    second = eng.generate([system + prompt(12, 40)], GREEDY)[0]
    assert second.usage.cached_tokens == 0  # block 0 is cached, but no KDA snapshot at its end yet
    ids = system + prompt(13, 40)
    third = eng.generate([ids], GREEDY)[0]
    assert third.usage.cached_tokens == BS
    assert third.token_ids == solo(cold, ids).token_ids


def test_pool_exhaustion_preempts_without_changing_outputs(make_engine, cold):
    prompts = [prompt(20 + i, n) for i, n in enumerate([30, 45, 20, 38])]
    p = E.SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    alone = [solo(cold, x, p).token_ids for x in prompts]
    eng = make_engine(num_blocks=10, snapshot_bytes=0)  # 160 tokens for 189 wanted at the end
    out = eng.generate(prompts, p)
    assert eng.stats().preemptions > 0
    assert [r.token_ids for r in out] == alone
    assert eng.stats().blocks_used == 0


def test_one_step_mixes_decodes_and_prefill_chunks_under_the_budget(make_engine, monkeypatch):
    eng = make_engine(max_batch_tokens=8, snapshot_bytes=0)
    sizes = []
    real = eng.model.forward

    def spy(batch, cache, **kw):
        sizes.append([len(c.tokens) for c in batch])
        return real(batch, cache, **kw)
    monkeypatch.setattr(eng.model, "forward", spy)
    eng.add_request(prompt(80, 3), GREEDY)
    eng.add_request(prompt(81, 4), GREEDY)
    eng.step()  # both prompts fit: 3 + 4 tokens
    eng.add_request(prompt(82, 20), GREEDY)
    eng.step()  # two decode tokens, then 6 of the 20 prompt tokens
    eng.step()
    eng.step()
    assert sizes == [[3, 4], [1, 1, 6], [1, 1, 6], [1, 1, 6]]
    out = eng.step()  # the last 2 prompt tokens: the third request samples its first token
    assert sizes[-1] == [1, 1, 2] and len(out) == 3
    with pytest.raises(ValueError, match="cannot hold one KDA snapshot"):
        make_engine(snapshot_bytes=1)


def test_cancel_frees_everything(make_engine):
    eng = make_engine()
    rids = [eng.add_request(prompt(30 + i, 20 + 7 * i), GREEDY) for i in range(3)]
    eng.step()
    eng.step()
    assert eng.stats().blocks_used > 0 and eng.stats().running == 3
    late = eng.add_request(prompt(40, 9), GREEDY)
    assert all(eng.cancel(r) for r in rids + [late])
    assert not eng.cancel("nope")
    outs = eng.step()
    assert sorted(o.request_id for o in outs) == sorted(rids + [late])
    assert all(o.finished and o.finish_reason == "cancelled" for o in outs)
    st = eng.stats()
    assert (st.blocks_used, st.running, st.waiting) == (0, 0, 0) and not eng.has_work()
    assert sorted(eng.free_slots) == list(range(eng.max_num_seqs))
    # a stream the consumer abandons is cancelled and leaves nothing behind
    for delta in eng.stream(prompt(41, 20), GREEDY):
        assert delta.token_ids and not delta.finished
        break
    st = eng.stats()
    assert (st.blocks_used, st.running, st.waiting) == (0, 0, 0) and not eng.has_work()
    # a bad prompt in a batch: an error, and none of the batch stays queued
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.generate([prompt(42, 5), [600]], GREEDY)
    assert not eng.has_work()


def test_the_penalties_see_each_sequences_generated_tokens(make_engine, monkeypatch):
    """Each step's penalties see every sequence's tokens so far (output_ids), also across a preemption that
    recomputes a sequence."""
    eng = make_engine(snapshot_bytes=0, num_blocks=10)  # 160 tokens for 189 wanted at the end
    params = E.SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, frequency_penalty=1.0)
    real, seen = E.penalized_rows, []

    def penalized_rows(logits, ps, prompt_ids, output_ids):
        seen.append([list(o) for o in output_ids])
        return real(logits, ps, prompt_ids, output_ids)

    monkeypatch.setattr(E, "penalized_rows", penalized_rows)
    results = eng.generate([prompt(20 + i, n) for i, n in enumerate([30, 45, 20, 38])], params)
    assert eng.stats().preemptions > 0
    got = {}  # each sequence's outputs as the sampler saw them, in order
    for rows in seen:
        for row in rows:
            got.setdefault(len(row), []).append(row)
    assert all(sorted(got[i]) == sorted(r.token_ids[:i] for r in results) for i in range(14)), got


def test_seed_reproduces_a_sampled_output(make_engine):
    eng = make_engine(snapshot_bytes=0)
    p = E.SamplingParams(temperature=1.0, max_tokens=8, seed=1234, ignore_eos=True)
    ids = prompt(50, 12)
    a = eng.generate([ids], p)[0].token_ids
    # the same seed gives the same tokens inside a batch with other requests
    b = eng.generate([prompt(51, 30), ids, prompt(52, 3)],
                     [E.SamplingParams(temperature=1.0, max_tokens=5, seed=1), p, GREEDY])[1].token_ids
    assert a == b
    others = {tuple(eng.generate([ids], E.SamplingParams(temperature=1.0, max_tokens=8, seed=s, ignore_eos=True))[0].token_ids)
              for s in range(3)}
    assert len(others | {tuple(a)}) > 1


def test_stop_token_max_tokens_and_stop_strings(make_engine):
    eng = make_engine(snapshot_bytes=0)
    ids = prompt(60, 10)
    free = eng.generate([ids], E.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    # a stop token: the output ends with it, its text is not included
    stop_id = free.token_ids[4]
    r = eng.generate([ids], E.SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id]))[0]
    first = free.token_ids.index(stop_id)
    assert r.finish_reason == "stop" and r.token_ids == free.token_ids[:first + 1]
    # a stop string from the middle of the text: the text ends right before it
    text = free.text
    assert len(text) > 8
    stop = text[5:8]
    r = eng.generate([ids], E.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]))[0]
    assert r.finish_reason == "stop" and r.text == text[:text.index(stop)]
    # streaming never leaks a partial stop string: the deltas add up to the final text
    deltas = list(eng.stream(ids, E.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])))
    assert "".join(d.text for d in deltas) == r.text and deltas[-1].finished
    assert [t for d in deltas for t in d.token_ids] == r.token_ids


def test_min_tokens_holds_off_stop_tokens_and_stop_strings(make_engine):
    eng = make_engine(snapshot_bytes=0)
    ids = prompt(61, 10)
    eos_first = dict(temperature=0, max_tokens=12, logit_bias={EOS: 100})
    assert eng.generate([ids], E.SamplingParams(**eos_first))[0].token_ids == [EOS]
    r = eng.generate([ids], E.SamplingParams(**eos_first, min_tokens=5))[0]
    assert EOS not in r.token_ids[:5] and r.token_ids[5:] == [EOS] and r.finish_reason == "stop"
    free = eng.generate([ids], E.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    stop_id = free.token_ids[1]
    r = eng.generate([ids], E.SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id], min_tokens=4,
                                             ignore_eos=True))[0]
    assert stop_id not in r.token_ids[:4] and r.token_ids[:1] == free.token_ids[:1]
    assert r.finish_reason == "length" or r.token_ids[-1] == stop_id
    # a stop string that ends inside the first min_tokens tokens does not count; past them it does
    stop = free.text[1:3]
    assert eng.generate([ids], E.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                stop=[stop]))[0].finish_reason == "stop"
    r = eng.generate([ids], E.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop],
                                             min_tokens=12))[0]
    assert r.finish_reason == "length" and r.text == free.text


def test_include_stop_str_in_output_keeps_the_stop_string(make_engine):
    eng = make_engine(snapshot_bytes=0)
    ids = prompt(60, 10)
    text = eng.generate([ids], E.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].text
    stop = text[5:8]
    r = eng.generate([ids], E.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop],
                                             include_stop_str_in_output=True))[0]
    assert r.finish_reason == "stop" and r.text == text[:text.index(stop) + len(stop)]


THINK_TOKENS = ("<pad>", "<eos>", chat.THINK_START, chat.THINK_END)  # <think> = 2, </think> = 3


def test_thinking_token_budget_forces_the_end_of_thinking(parts, cold, monkeypatch):
    model, _ = parts
    eng = E.Engine(model, make_tokenizer(model.config.vocab_size, THINK_TOKENS), eos_token_ids=[EOS], num_blocks=64,
                   block_size=BS, max_num_seqs=4, max_batch_tokens=64, snapshot_bytes=0)
    start, end = eng.think_start, eng.think_end
    assert (start, end) == (2, 3)
    ids = [t + 2 if t < 4 else t for t in prompt(70, 10)]  # no think token inside
    greedy = dict(temperature=0, max_tokens=10, ignore_eos=True)
    free = eng.generate([ids + [start]], E.SamplingParams(**greedy))[0]
    assert end not in free.token_ids[:4]  # (the random model would close by itself)
    r = eng.generate([ids + [start]], E.SamplingParams(**greedy, thinking_token_budget=3))[0]
    assert r.token_ids[:3] == free.token_ids[:3] and r.token_ids[3] == end
    assert (free.usage.reasoning_tokens, r.usage.reasoning_tokens) == ((free.token_ids + [end]).index(end), 3)
    # the forced token is decoded like a sampled one: what follows is the model's continuation of it
    after = eng.generate([ids + [start] + r.token_ids[:4]], E.SamplingParams(**{**greedy, "max_tokens": 6}))[0]
    assert r.token_ids[4:] == after.token_ids
    # thinking the prompt already holds counts; a budget of 0 closes at once
    r = eng.generate([ids + [start] + free.token_ids[:2]], E.SamplingParams(**greedy, thinking_token_budget=3))[0]
    assert r.token_ids[0] == free.token_ids[2] and r.token_ids[1] == end and r.usage.reasoning_tokens == 1
    assert eng.generate([ids + [start]], E.SamplingParams(**greedy, thinking_token_budget=0))[0].token_ids[0] == end
    # a prompt outside any think block (closed, or none) is not touched
    for outside in (ids + [start, end], ids):
        assert eng.generate([outside], E.SamplingParams(**greedy, thinking_token_budget=0))[0].token_ids == \
            eng.generate([outside], E.SamplingParams(**greedy))[0].token_ids
    # the budget overrides the sampler's choice, and a block the model closes itself is over
    script = [7, 8, 9, 10, 11, 12]
    monkeypatch.setattr(E, "draw_on_device", lambda logits, params, prompts, outs, gens, kernel:
                        torch.tensor([script[len(o)] for o in outs], device=logits.device))
    sampled = dict(max_tokens=6, ignore_eos=True)
    assert eng.generate([ids + [start]], E.SamplingParams(**sampled, thinking_token_budget=2))[0].token_ids == \
        [7, 8, end, 10, 11, 12]
    script[1] = end
    assert eng.generate([ids + [start]], E.SamplingParams(**sampled, thinking_token_budget=2))[0].token_ids == script
    with pytest.raises(ValueError, match="thinking_token_budget needs <think> and </think> tokens"):
        cold.add_request(ids, E.SamplingParams(thinking_token_budget=4))


def test_json_object_answers_are_json_objects(parts, monkeypatch):
    model, _ = parts
    eng = E.Engine(model, make_tokenizer(model.config.vocab_size, THINK_TOKENS), eos_token_ids=[EOS], num_blocks=64,
                   block_size=BS, max_num_seqs=4, max_batch_tokens=64, snapshot_bytes=0)
    tok, ids = eng.tokenizer, [t + 2 if t < 4 else t for t in prompt(90, 10)]
    braces = {tok.token_to_id("{"): 100.0, tok.token_to_id("}"): 100.0}
    # greedy with only the braces pushed up: "{" is the one that can start, then "}" the one that can follow
    r = eng.generate([ids], E.SamplingParams(temperature=0, max_tokens=10, json_object=True, logit_bias=braces))[0]
    assert (r.text, r.finish_reason) == ("{}", "stop")
    # the leader fails ("}" cannot open the object): the walk over the vocabulary finds what fits, and the race's
    # leader among it wins: a space (pushed up more than "{") until MAX_WS of them, then "{"; then "}" fits
    with monkeypatch.context() as m:
        m.setattr(E, "GRAMMAR_CANDIDATES", 1)
        opened = {tok.token_to_id("}"): 100.0, tok.token_to_id("\u0120"): 60.0, tok.token_to_id("{"): 50.0}
        r = eng.generate([ids], E.SamplingParams(temperature=0, max_tokens=40, json_object=True, logit_bias=opened))[0]
    assert (r.text, r.finish_reason) == (" " * jsonmode.MAX_WS + "{}", "stop")
    # sampled freely: every answer is a JSON object's prefix, and one that stopped is a JSON object
    outs = eng.generate([ids] * 4, [E.SamplingParams(temperature=1.0, seed=s, max_tokens=24, json_object=True)
                                   for s in range(4)])
    for r in outs:
        assert jsonmode.JsonPrefix().feed(r.text.encode()), r.text
        assert r.finish_reason == "length" or isinstance(json.loads(r.text), dict)
    assert len({r.text for r in outs}) > 1
    # the held rows of a batch are drawn together (one read-back): each draws what it draws alone
    alone = [eng.generate([ids], E.SamplingParams(temperature=1.0, seed=s, max_tokens=24, json_object=True))[0]
             for s in (1, 3)]
    assert [r.token_ids for r in alone] == [outs[1].token_ids, outs[3].token_ids]
    # where the free draw's token fits, the answer's is that token: a JSON row's race is drawn once a step, from
    # the seeded generator as a free row's (a space and "{" pushed up alike: either may open the object)
    even = {tok.token_to_id("\u0120"): 100.0, tok.token_to_id("{"): 100.0}
    firsts = [[eng.generate([ids], E.SamplingParams(temperature=1.0, seed=s, max_tokens=1, logit_bias=even,
                                                    json_object=held))[0].token_ids for held in (False, True)]
              for s in range(8)]
    assert all(free == held for free, held in firsts) and len({tuple(free) for free, _ in firsts}) == 2, firsts
    # with a schema: a boolean "a" is required, nothing else allowed
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}, "n": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    outs = eng.generate([ids] * 4, [E.SamplingParams(temperature=1.0, seed=s, max_tokens=40, json_schema=schema,
                                                     logit_bias=braces) for s in range(4)])
    for r in outs:
        assert jsonmode.JsonPrefix(jsonmode.object_schema(schema)).feed(r.text.encode()), r.text
        if r.finish_reason == "stop":
            v = json.loads(r.text)
            assert isinstance(v["a"], bool) and set(v) <= {"a", "n"} and isinstance(v.get("n", 0), int), r.text
    assert any(r.finish_reason == "stop" for r in outs), [r.text for r in outs]
    with pytest.raises(ValueError, match="SamplingParams.json_schema .*format"):
        E.SamplingParams(json_schema={"type": "object", "properties": {"a": {"type": "string", "format": "idn-email"}}})
    # after a think block: reasoning is free, the answer after </think> is held
    r = eng.generate([ids + [eng.think_start]], E.SamplingParams(temperature=0, max_tokens=10, json_object=True,
                                                                  logit_bias=braces, thinking_token_budget=2))[0]
    assert r.token_ids[2] == eng.think_end and tok.decode(r.token_ids[3:]) == "{}" and r.finish_reason == "stop"


def test_regex_and_choice_answers_match_whole(parts):
    """vLLM's structured outputs regex and choice: a stopped answer matches whole (a stop token taken only where
    the text matches), one cut by max_tokens begins a match; a choice's answer is one of its strings."""
    model, _ = parts
    eng = E.Engine(model, make_tokenizer(model.config.vocab_size, THINK_TOKENS), eos_token_ids=[EOS], num_blocks=64,
                   block_size=BS, max_num_seqs=4, max_batch_tokens=64, snapshot_bytes=0)
    ids = [t + 2 if t < 4 else t for t in prompt(92, 10)]
    source = r"\d{2,3}-[a-z]{1,4}"
    outs = eng.generate([ids] * 4, [E.SamplingParams(temperature=1.0, seed=s, max_tokens=12, regex=source,
                                                     logit_bias={EOS: 8.0}) for s in range(4)])
    rx = re.compile(source)
    for r in outs:
        assert r.finish_reason == "stop" and rx.fullmatch(r.text), r.text
        assert (r.token_ids[-1] == EOS) == (len(r.text.split("-")[1]) < 4), (r.text, r.token_ids)
    assert len({r.text for r in outs}) > 1 and any(r.token_ids[-1] == EOS for r in outs)
    cut = eng.generate([ids], E.SamplingParams(temperature=1.0, seed=0, max_tokens=2, regex=source))[0]
    assert cut.finish_reason == "length" and pattern.RegexPrefix(pattern.Pattern(source, whole=True)).feed(
        cut.text.encode())
    choices = ["yes", "no", "maybe so", "(n/a)"]
    outs = eng.generate([ids] * 6, [E.SamplingParams(temperature=1.0, seed=s, max_tokens=12, choice=choices)
                                   for s in range(6)])
    assert all(r.text in choices and r.finish_reason == "stop" for r in outs) and len({r.text for r in outs}) > 1
    with pytest.raises(ValueError, match=r"SamplingParams.regex = '\(a': pattern '\(a' at 2: an unclosed group"):
        E.SamplingParams(regex="(a")
    with pytest.raises(ValueError, match="SamplingParams.choice .*non-empty list of non-empty strings"):
        E.SamplingParams(choice=["a", ""])
    with pytest.raises(ValueError, match="held to both json_object and regex"):
        E.SamplingParams(regex="a", json_object=True)


def test_tool_calls_are_held_to_their_schemas(parts):
    model, _ = parts
    tok = make_tokenizer(model.config.vocab_size, THINK_TOKENS + toolmode.TAGS)
    eng = E.Engine(model, tok, eos_token_ids=[EOS], num_blocks=64, block_size=BS, max_num_seqs=4, max_batch_tokens=64,
                   snapshot_bytes=0)
    call = eng.tool_tags[chat.TOOL_START]
    ids = [t + 8 if t < 10 else t for t in prompt(91, 10)]  # no special token inside
    weather = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 14}},
               "required": ["city", "days"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}]

    def calls(token_ids: list[int]) -> list[chat.ToolCall]:
        text = tok.decode(token_ids, skip_special_tokens=False)
        got = [chat.parse_tool_call(b.split(chat.TOOL_END)[0], tools) for b in text.split(chat.TOOL_START)[1:]]
        assert None not in got, text
        return got

    # one call, started by the prompt (as serve.py forces it) or not: the random model writes it whole
    for start in ([call], []):
        outs = eng.generate([ids + start] * 3, [E.SamplingParams(temperature=1.0, seed=s, max_tokens=60,
                                                                 tool_calls={"get_weather": weather},
                                                                 parallel_tool_calls=False, skip_special_tokens=False)
                                                for s in range(3)])
        for r in outs:
            got = calls(r.token_ids if not start else [call] + r.token_ids)
            assert r.finish_reason == "stop" and len(got) == 1, tok.decode(r.token_ids, skip_special_tokens=False)
            assert set(got[0].arguments) == {"city", "days"} and len(got[0].arguments["city"]) <= 6
            assert 1 <= got[0].arguments["days"] <= 14 and isinstance(got[0].arguments["days"], int)
            assert r.token_ids[-1] == eng.tool_tags[chat.TOOL_END] and (start or r.token_ids[0] == call)
    # parallel calls: after each call another or a stop token; tools without parameters
    outs = eng.generate([ids + [call]] * 4, [E.SamplingParams(temperature=1.0, seed=s, max_tokens=40, logit_bias={
        EOS: 5.0}, tool_calls={"now": None, "today": None}) for s in range(4)])
    for r in outs:
        got = calls([call] + r.token_ids)
        assert got and all(c is not None and c.name in ("now", "today") and not c.arguments for c in got)
        assert r.finish_reason == "length" or r.token_ids[-1] == EOS
    assert any(r.finish_reason == "stop" for r in outs)
    # optional calls (tool_choice auto with a strict tool): text first, then calls or the end; each call held
    outs = eng.generate([ids] * 4, [E.SamplingParams(temperature=1.0, seed=s, max_tokens=60, logit_bias={call: 4.0},
                                                     tool_calls={"get_weather": weather}, tool_calls_optional=True,
                                                     parallel_tool_calls=False) for s in range(4)])
    made = [calls(r.token_ids) for r in outs]
    assert any(m and r.token_ids[0] != call for r, m in zip(outs, made)), made  # a call after text
    for got in made:
        assert all(set(c.arguments) == {"city", "days"} and 1 <= c.arguments["days"] <= 14 for c in got)
    with pytest.raises(ValueError, match=r"tool_calls needs .* as tokens; this tokenizer lacks \['<tool_call>'"):
        E.Engine(model, make_tokenizer(model.config.vocab_size, THINK_TOKENS), eos_token_ids=[EOS], num_blocks=8,
                 block_size=BS).add_request(ids, E.SamplingParams(tool_calls={"now": None}))
    with pytest.raises(ValueError, match="SamplingParams.tool_calls .*get_weather.parameters.properties.city"):
        E.SamplingParams(tool_calls={"get_weather": {"type": "object", "properties": {"city": {"not": {}}}}})
    with pytest.raises(ValueError, match="held to both json_object and tool_calls"):
        E.SamplingParams(tool_calls={"now": None}, json_object=True)


def test_admission_errors_are_clear(make_engine):
    eng = make_engine(num_blocks=4)
    with pytest.raises(ValueError, match=r"logit_bias token ids \[512\] must be below the vocabulary size 512"):
        eng.add_request([5], E.SamplingParams(logit_bias={512: 1.0, 3: 1.0}))
    with pytest.raises(ValueError, match="prompt has 64 tokens; the limit is 63"):
        eng.add_request(prompt(0, 4 * BS))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request([5, 512])
    with pytest.raises(ValueError, match="empty"):
        eng.add_request([])
    rid = eng.add_request(prompt(0, 10))
    with pytest.raises(ValueError, match="already in the engine"):
        eng.add_request(prompt(0, 10), request_id=rid)
    eng.cancel(rid)
    eng.step()
    # a sequence that fills the whole context ends with "length"
    r = eng.generate([prompt(1, 4 * BS - 3)], E.SamplingParams(temperature=0, ignore_eos=True))[0]
    assert r.finish_reason == "length" and r.usage.prompt_tokens + r.usage.completion_tokens == 4 * BS


def test_the_context_is_at_most_the_models_trained_length(parts):
    """max_model_len defaults to config.json's max_position_embeddings (the cache's size capping it) and may not
    pass it."""
    model, tok = parts
    trained = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=rf"max_model_len={trained + 1} must be in \[1, {trained}\]"):
        E.Engine(model, tok, eos_token_ids=[EOS], num_blocks=4, block_size=BS, max_model_len=trained + 1)
    short = GLMModel(dataclasses.replace(model.config, max_position_embeddings=3 * BS), model.weights)
    eng, full = (E.Engine(m, tok, eos_token_ids=[EOS], num_blocks=64, block_size=BS) for m in (short, model))
    assert (eng.max_model_len, full.max_model_len) == (3 * BS, 64 * BS)
    with pytest.raises(ValueError, match=f"prompt has {3 * BS} tokens; the limit is {3 * BS - 1}"):
        eng.add_request(prompt(0, 3 * BS))


def test_text_and_chat_prompts(make_engine):
    eng = make_engine(snapshot_bytes=0)
    r = eng.generate("abc abd", E.SamplingParams(temperature=0, max_tokens=3))
    assert len(r) == 1 and r[0].usage.prompt_tokens == len(eng.tokenizer.encode("abc abd").ids)
    with pytest.raises(ValueError, match="chat template"):
        eng.generate([[{"role": "user", "content": "hi"}]], GREEDY)
    with pytest.raises(TypeError, match="SamplingParams"):
        eng.add_request([5], {"temperature": 0})
    one_liner = E.generate(eng, "abc abd", temperature=0, max_tokens=3)
    assert one_liner[0].token_ids == r[0].token_ids


def test_random_arrivals_cancellations_and_lengths_match_solo_runs(make_engine, cold):
    rng = random.Random(0)
    # 8 blocks (128 tokens) for up to 4 sequences of up to 74 tokens: preemption happens.
    eng = make_engine(num_blocks=8, max_num_seqs=4, max_batch_tokens=24)
    system = prompt(70, BS + 2)  # some requests share a prefix, so the prefix cache is exercised
    specs, outputs, live, cancelled = {}, {}, set(), set()
    for step in range(90):
        if rng.random() < 0.35 and len(specs) < 16:
            ids = (system if rng.random() < 0.5 else []) + prompt(100 + len(specs), rng.randint(1, 40))
            p = E.SamplingParams(temperature=0, max_tokens=rng.randint(1, 16), ignore_eos=True)
            rid = eng.add_request(ids, p)
            specs[rid], outputs[rid] = ids, []
            live.add(rid)
        if live and rng.random() < 0.08:
            rid = rng.choice(sorted(live))
            assert eng.cancel(rid)
            live.discard(rid)
            cancelled.add(rid)
        for o in eng.step():
            outputs[o.request_id] += o.token_ids
            if o.finished:
                live.discard(o.request_id)
    while eng.has_work():
        for o in eng.step():
            outputs[o.request_id] += o.token_ids
    st = eng.stats()
    done = [r for r in specs if r not in cancelled]
    assert len(done) >= 10 and len(cancelled) >= 2 and st.preemptions > 0 and st.prefix_hit_tokens > 0
    assert st.blocks_used == 0 and st.tokens_generated >= sum(len(outputs[r]) for r in done)
    for rid in done:
        p = E.SamplingParams(temperature=0, max_tokens=len(outputs[rid]), ignore_eos=True)
        assert outputs[rid] == solo(cold, specs[rid], p).token_ids, rid


def test_the_mtp_layer_is_loaded_only_for_its_speculator(tmp_path):
    """Without speculator="mtp" the checkpoint's MTP layer is not read and has no cache row (on GLM-5.3-Flash
    ~3 GB of weights); the trunk, and so the greedy answer, is the same."""
    path = tiny.make_tiny_checkpoint(tmp_path / "ckpt")
    make_tokenizer(512).save(str(path / "tokenizer.json"))
    opts = dict(device="cpu", dtype=torch.float32, progress=False, num_blocks=16, block_size=BS)
    plain, mtp = E.load(path, **opts), E.load(path, speculator="mtp", **opts)
    L = plain.config.num_hidden_layers
    assert not plain.model.has_mtp and not any(n.startswith(f"layers.{L}.") for n in plain.model.weights)
    assert mtp.model.has_mtp and f"layers.{L}.eh_proj.weight" in mtp.model.weights
    assert plain.cache.latent.shape[0] == len(plain.config.dsa_layers) == mtp.cache.latent.shape[0] - 1
    p = E.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert plain.generate("a b c d", p)[0].token_ids == mtp.generate("a b c d", p)[0].token_ids


def test_load_from_a_tiny_checkpoint(tmp_path, monkeypatch):
    path = tiny.make_tiny_checkpoint(tmp_path / "ckpt")
    make_tokenizer(512).save(str(path / "tokenizer.json"))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
    (path / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}")
    eng = E.load(path, device="cpu", dtype=torch.float32, progress=False, num_blocks=16, block_size=BS)
    assert eng.eos_token_ids == {1, 7} and eng.config.vocab_size == 512
    r = eng.generate([[{"role": "user", "content": "hi"}]], E.SamplingParams(temperature=0, max_tokens=2))[0]
    assert r.usage.prompt_tokens == len(eng.tokenizer.encode("<user>hi<a>", add_special_tokens=False).ids)
    monkeypatch.setenv("GLM53_CACHE", str(tmp_path / "cache"))
    default = E.load(device="cpu", progress=False, num_blocks=16)  # the built-in default model
    assert default.generate("Hello", E.SamplingParams(max_tokens=2))[0].usage.completion_tokens <= 2
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        (path / "tokenizer.json").unlink()
        E.load(path, device="cpu", progress=False, num_blocks=16, block_size=BS)

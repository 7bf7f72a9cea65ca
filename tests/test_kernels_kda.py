"""KDA Triton kernels against their torch twins (interpreted on CPU, tiny shapes)."""
import pytest
import torch

from kernels_kda import (kda_chunk_prefill, kda_chunk_prefill_ref, kda_recurrent_step,
                         kda_recurrent_step_ref)


def _l2(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _inputs(lead, H, dk, dv, seed):
    """Realistic KDA inputs: L2-normed k, normed and scaled q, gates in (-5, 0), beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = _l2(torch.randn(*lead, H, dk, generator=gen)) * dk ** -0.5
    k = _l2(torch.randn(*lead, H, dk, generator=gen))
    v = torch.randn(*lead, H, dv, generator=gen)
    g = -5 * torch.sigmoid(2 * torch.randn(*lead, H, dk, generator=gen))
    beta = torch.sigmoid(torch.randn(*lead, H, generator=gen))
    return q, k, v, g, beta


def _close(actual, expected, what):
    scale = expected.abs().max().item()
    err = (actual.float() - expected.float()).abs().max().item()
    assert err <= 1e-4 * scale + 1e-6, f"{what}: max error {err:.3g} vs max |expected| {scale:.3g}"


def test_step_matches_ref_and_touches_only_its_slots():
    H, dk, dv = 2, 16, 32
    gen = torch.Generator().manual_seed(1)
    pool = torch.randn(6, H, dk, dv, generator=gen)
    pool_ref = pool.clone()
    slots = torch.tensor([4, 0, 3])
    for step in range(2):  # the second token reads the state the first one wrote
        q, k, v, g, beta = _inputs((3,), H, dk, dv, seed=10 + step)
        o = kda_recurrent_step(q, k, v, g, beta, pool, slots, block_v=16)
        o_ref = kda_recurrent_step_ref(q, k, v, g, beta, pool_ref, slots)
        _close(o, o_ref, f"o at step {step}")
        _close(pool, pool_ref, f"state pool at step {step}")
    untouched = [1, 2, 5]
    assert torch.equal(pool[untouched], torch.randn(6, H, dk, dv, generator=torch.Generator().manual_seed(1))[untouched])


def test_step_ref_is_the_spec_recurrence():
    """The twin, written out for one head with explicit loops over i and j."""
    q, k, v, g, beta = _inputs((1,), 1, 16, 16, seed=3)
    S0 = torch.randn(1, 1, 16, 16)
    S = S0[0, 0] * torch.exp(g[0, 0])[:, None]
    p = torch.stack([sum(S[i, j] * k[0, 0, i] for i in range(16)) for j in range(16)])
    delta = beta[0, 0] * (v[0, 0] - p)
    S = S + torch.outer(k[0, 0], delta)
    o = torch.stack([sum(S[i, j] * q[0, 0, i] for i in range(16)) for j in range(16)])
    pool = S0.clone()
    o_ref = kda_recurrent_step_ref(q, k, v, g, beta, pool, torch.tensor([0]))
    _close(o_ref[0, 0], o, "o")
    _close(pool[0, 0], S, "state")


@pytest.mark.parametrize("T, chunk, dk, dv, with_init, block", [
    (70, 16, 16, 32, True, 32),    # crosses chunks, T not a multiple of the chunk, boundary states
    (70, 64, 32, 16, False, None),  # one full and one partial chunk of 64 (four sub-blocks each)
    (64, 32, 16, 16, True, 32),    # T a multiple of block: the final state is a boundary too
    (5, 32, 16, 16, True, None),   # shorter than one sub-block
])
def test_prefill_matches_recurrence(T, chunk, dk, dv, with_init, block):
    H = 2
    q, k, v, g, beta = _inputs((T,), H, dk, dv, seed=T + chunk)
    S0 = torch.randn(H, dk, dv) if with_init else None
    o, final, states = kda_chunk_prefill(q, k, v, g, beta, S0, chunk=chunk, block=block, block_v=16)
    o_ref, final_ref, states_ref = kda_chunk_prefill_ref(q, k, v, g, beta, S0, block=block)
    _close(o, o_ref, "o")
    _close(final, final_ref, "final state")
    if block is None:
        assert states is None and states_ref is None
    else:
        assert states.shape == states_ref.shape == (T // block, H, dk, dv)
        _close(states, states_ref, "boundary states")


def test_prefill_hard_inputs():
    """Strongest decay (g near -5: exp(Γ) underflows within a chunk), slow decay on other channels,
    nearly identical keys with β near 1 (the triangular solve is least benign)."""
    T, H, d = 40, 2, 16
    q, k, v, g, beta = _inputs((T,), H, d, d, seed=7)
    g[:, :, : d // 2] = -4.999
    g[:, :, d // 2:] = -1e-3
    k = _l2(k[:1] + 0.05 * k)
    beta = torch.full_like(beta, 0.999)
    o, final, _ = kda_chunk_prefill(q, k, v, g, beta, None, chunk=32)
    o_ref, final_ref, _ = kda_chunk_prefill_ref(q, k, v, g, beta, None)
    assert torch.isfinite(o).all()
    _close(o, o_ref, "o")
    _close(final, final_ref, "final state")


def test_bf16_inputs_give_bf16_output():
    """The model may hand over bf16 q, k, v: kernels compute in fp32 and round only o."""
    q, k, v, g, beta = _inputs((20,), 2, 16, 16, seed=9)
    q, k, v = (x.bfloat16() for x in (q, k, v))
    o, final, _ = kda_chunk_prefill(q, k, v, g, beta, None, chunk=16)
    o_ref, final_ref, _ = kda_chunk_prefill_ref(q, k, v, g, beta, None)
    assert o.dtype == o_ref.dtype == torch.bfloat16
    _close(final, final_ref, "final state")
    assert (o.float() - o_ref.float()).abs().max() <= 1e-2 * o_ref.float().abs().max()
    pool, pool_ref = torch.zeros(2, 2, 16, 16), torch.zeros(2, 2, 16, 16)
    step = kda_recurrent_step(q[:2], k[:2], v[:2], g[:2], beta[:2], pool, torch.tensor([1, 0]))
    step_ref = kda_recurrent_step_ref(q[:2], k[:2], v[:2], g[:2], beta[:2], pool_ref, torch.tensor([1, 0]))
    assert step.dtype == torch.bfloat16
    _close(pool, pool_ref, "state pool")
    assert (step.float() - step_ref.float()).abs().max() <= 1e-2 * step_ref.float().abs().max()


def test_errors_name_the_tensor():
    q, k, v, g, beta = _inputs((8,), 2, 16, 16, seed=0)
    with pytest.raises(ValueError, match="g shape"):
        kda_chunk_prefill(q, k, v, g[:, :1], beta)
    with pytest.raises(ValueError, match="initial_state shape"):
        kda_chunk_prefill(q, k, v, g, beta, torch.zeros(2, 16, 8))
    with pytest.raises(ValueError, match="block 48 must be a positive multiple of chunk 32"):
        kda_chunk_prefill(q, k, v, g, beta, chunk=32, block=48)
    with pytest.raises(ValueError, match="state shape"):
        kda_recurrent_step(q[:2], k[:2], v[:2], g[:2], beta[:2], torch.zeros(4, 2, 16, 8), torch.tensor([0, 1]))

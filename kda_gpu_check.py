"""GPU check of kernels_kda.py at the real shapes (H = 64, d = 128): correctness against the torch
twins, then timings (triton.testing.do_bench, median) against a device copy measured in the same run.

    python kda_gpu_check.py            # everything (~1 min on an H200)
    python kda_gpu_check.py decode     # only the sections named: copy, decode, prefill, precision

Sections print as they finish, so a cut-off run still reports what it measured.
"""
import sys
import time

import torch
from triton.testing import do_bench

import kernels_kda as K

H, D = 64, 128
DEVICE = "cuda"
STATE_BYTES = H * D * D * 4  # one sequence's fp32 state in one layer: 4 MiB
START = time.time()


def say(line: str = "") -> None:
    print(line, flush=True)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def l2(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def inputs(lead: int, seed: int, dtype=torch.float32):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device=DEVICE)
    q = l2(r(lead, H, D)) * D ** -0.5
    k = l2(r(lead, H, D))
    v = r(lead, H, D)
    g = -5 * torch.sigmoid(2 * r(lead, H, D))
    beta = torch.sigmoid(r(lead, H))
    return q.to(dtype), k.to(dtype), v.to(dtype), g, beta


def bench(fn) -> float:
    """Median milliseconds."""
    return do_bench(fn, warmup=10, rep=40, return_mode="median")


def copy_bandwidth() -> float:
    src = torch.empty(2**28, dtype=torch.float32, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    gbs = 2 * src.numel() * 4 / ms / 1e6
    say(f"copy 1 GiB -> 1 GiB: {ms * 1e3:.0f} us, {gbs:.0f} GB/s (read + write)")
    return gbs


def check_decode(copy_gbs: float) -> None:
    say("\n== decode: kda_recurrent_step, one token per sequence ==")
    B, slots_total = 16, 40
    q, k, v, g, beta = inputs(B, seed=1)
    pool = torch.randn(slots_total, H, D, D, device=DEVICE)
    pool_ref = pool.clone()
    slots = torch.randperm(slots_total, device=DEVICE)[:B]
    for step in range(3):
        o = K.kda_recurrent_step(q, k, v, g, beta, pool, slots)
        o_ref = K.kda_recurrent_step_ref(q, k, v, g, beta, pool_ref, slots)
    say(f"B={B}, 3 steps, random slots: rel err o {rel_err(o, o_ref):.2e}, pool {rel_err(pool, pool_ref):.2e}")

    say(f"{'B':>3} {'BV':>3} {'warps':>5} {'us':>8} {'GB/s':>7} {'of copy':>8}")
    for B in (1, 16, 64):
        q, k, v, g, beta = inputs(B, seed=2)
        pool = torch.zeros(B, H, D, D, device=DEVICE)
        slots = torch.arange(B, device=DEVICE)
        for bv, warps in ((16, 2), (16, 4), (32, 4), (32, 8), (64, 8)):
            ms = bench(lambda: K.kda_recurrent_step(q, k, v, g, beta, pool, slots, block_v=bv, num_warps=warps))
            gbs = 2 * B * STATE_BYTES / ms / 1e6
            say(f"{B:>3} {bv:>3} {warps:>5} {ms * 1e3:>8.1f} {gbs:>7.0f} {gbs / copy_gbs:>8.2f}")
    say("[spec §9.3, not measured here] fla fused_recurrent_kda: 39 us at B=1")


def check_prefill(copy_gbs: float) -> None:
    say("\n== prefill: kda_chunk_prefill (chunk 64) vs the per-token recurrence ==")
    for T, block in ((1024, 256), (8192, None)):
        q, k, v, g, beta = inputs(T, seed=T)
        S0 = 0.1 * torch.randn(H, D, D, device=DEVICE)
        o, final, states = K.kda_chunk_prefill(q, k, v, g, beta, S0, block=block)
        o_ref, final_ref, states_ref = K.kda_chunk_prefill_ref(q, k, v, g, beta, S0, block=block)
        line = f"T={T}: rel err o {rel_err(o, o_ref):.2e}, final state {rel_err(final, final_ref):.2e}"
        if block:
            line += f", {states.shape[0]} boundary states {rel_err(states, states_ref):.2e}"
        say(line)
    q, k, v, g, beta = inputs(1024, seed=5, dtype=torch.bfloat16)
    o, final, _ = K.kda_chunk_prefill(q, k, v, g, beta)
    o_ref, final_ref, _ = K.kda_chunk_prefill_ref(q, k, v, g, beta)
    say(f"T=1024 bf16 q/k/v (o in bf16): rel err o {rel_err(o, o_ref):.2e}, final state {rel_err(final, final_ref):.2e}")

    say(f"\n{'T':>5} {'BV':>3} {'warps':>5} {'stages':>6} {'factors ms':>10} {'scan ms':>8} {'total ms':>8} {'in+out GB/s':>11}")
    for T in (1024, 8192):
        q, k, v, g, beta = inputs(T, seed=T)
        S0 = torch.zeros(H, D, D, device=DEVICE)
        f = K.chunk_factors(q, k, v, g, beta, 64)
        factors_ms = bench(lambda: K.chunk_factors(q, k, v, g, beta, 64))
        io_bytes = T * H * (4 * D + 1) * 4 + T * H * D * 4
        for bv, warps, stages in ((32, 4, 1), (64, 4, 1), (64, 8, 1), (32, 4, 2), (128, 8, 1)):
            try:
                scan_ms = bench(lambda: K.chunk_scan(f, S0, None, torch.float32, bv, warps, stages))
                total_ms = bench(lambda: K.kda_chunk_prefill(q, k, v, g, beta, S0, block_v=bv,
                                                             num_warps=warps, num_stages=stages))
            except Exception as e:  # e.g. out of shared memory for deep pipelines
                say(f"{T:>5} {bv:>3} {warps:>5} {stages:>6} failed: {type(e).__name__}: {str(e)[:80]}")
                continue
            gbs = io_bytes / total_ms / 1e6
            say(f"{T:>5} {bv:>3} {warps:>5} {stages:>6} {factors_ms:>10.3f} {scan_ms:>8.3f} {total_ms:>8.3f} {gbs:>11.0f}")
    say("[spec §9.3, not measured here] fla chunk_kda: 1.85 ms at T=8192")


def check_precision(copy_gbs: float) -> None:
    say("\n== tl.dot input precision (prefill T=8192, default tiles) ==")
    T = 8192
    q, k, v, g, beta = inputs(T, seed=11)
    S0 = 0.1 * torch.randn(H, D, D, device=DEVICE)
    o_ref, final_ref, _ = K.kda_chunk_prefill_ref(q, k, v, g, beta, S0)
    for precision in ("ieee", "tf32x3", "tf32"):
        o, final, _ = K.kda_chunk_prefill(q, k, v, g, beta, S0, precision=precision)
        ms = bench(lambda: K.kda_chunk_prefill(q, k, v, g, beta, S0, precision=precision))
        say(f"{precision:>7}: {ms:.3f} ms, rel err o {rel_err(o, o_ref):.2e}, final state {rel_err(final, final_ref):.2e}")


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("kda_gpu_check.py needs CUDA")
    torch.backends.cuda.matmul.allow_tf32 = False  # the twins must be true fp32
    torch.backends.cudnn.allow_tf32 = False
    say(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, H={H}, d={D}")
    wanted = set(sys.argv[1:]) or {"decode", "prefill", "precision"}
    copy_gbs = copy_bandwidth()
    for name, fn in (("decode", check_decode), ("prefill", check_prefill), ("precision", check_precision)):
        if name in wanted:
            fn(copy_gbs)
            say(f"[{time.time() - START:.0f} s elapsed]")


if __name__ == "__main__":
    main()

"""GPU check of kernels_kda.py at the real shapes (H = 64, d = 128): correctness against the torch
twins, then timings (triton.testing.do_bench, median) against a device copy measured in the same run.

    python kda_gpu_check.py                    # decode and prefill (~1 min on an H200)
    python kda_gpu_check.py decode precision   # only the sections named (precision compiles the
                                               # prefill kernels twice more: tf32x3 and ieee)

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


def bench_graph(make_call, calls: int = 20, reps: int = 10) -> float:
    """Median microseconds per call of `calls` calls replayed from one CUDA graph: no launch
    overhead, as in the engine's captured decode step. make_call(i) returns call number i, so
    calls can touch different memory and not be served from the 60 MB L2."""
    fns = [make_call(i) for i in range(calls)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[reps // 2]


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

    say("eager: do_bench median, Python launch included; graph: 20 calls in one CUDA graph, each on")
    say("its own slots (20 x B states, past the L2); GB/s and 'of copy' from the graph time")
    say(f"{'B':>3} {'BV':>3} {'warps':>5} {'eager us':>9} {'graph us':>9} {'GB/s':>7} {'of copy':>8}")
    calls = 20
    for B in (1, 16, 64):
        q, k, v, g, beta = inputs(B, seed=2)
        pool = torch.zeros(calls * B, H, D, D, device=DEVICE)
        slots = [torch.arange(i * B, (i + 1) * B, device=DEVICE) for i in range(calls)]
        for bv, warps in ((16, 2), (16, 4), (32, 4), (32, 8), (64, 8)):
            step = lambda i: lambda: K.kda_recurrent_step(q, k, v, g, beta, pool, slots[i], block_v=bv, num_warps=warps)
            eager_ms = bench(step(0))
            graph_us = bench_graph(step, calls)
            gbs = 2 * B * STATE_BYTES / graph_us / 1e3
            say(f"{B:>3} {bv:>3} {warps:>5} {eager_ms * 1e3:>9.1f} {graph_us:>9.1f} {gbs:>7.0f} {gbs / copy_gbs:>8.2f}")
        del pool
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

    say(f"\n{'T':>5} {'BV':>3} {'warps':>5} {'stages':>6} {'factors':>8} {'states':>8} {'output':>8} {'total ms':>8} {'in+out GB/s':>11}")
    for T in (1024, 8192):
        q, k, v, g, beta = inputs(T, seed=T)
        S0 = torch.zeros(H, D, D, device=DEVICE)
        f = K.chunk_factors(q, k, v, g, beta, 64)
        factors_ms = bench(lambda: K.chunk_factors(q, k, v, g, beta, 64))
        io_bytes = T * H * (4 * D + 1) * 4 + T * H * D * 4
        for bv, warps, stages in ((32, 4, 1), (32, 4, 2), (64, 8, 2), (16, 4, 1)):
            try:
                states = K.chunk_states(f, S0, bv, warps, stages)  # overwrites f.u: timing only from here
                states_ms = bench(lambda: K.chunk_states(f, S0, bv, warps, stages))
                output_ms = bench(lambda: K.chunk_output(f, states, torch.float32))
                total_ms = bench(lambda: K.kda_chunk_prefill(q, k, v, g, beta, S0, block_v=bv,
                                                             num_warps=warps, num_stages=stages))
            except Exception as e:  # e.g. out of shared memory for deep pipelines
                say(f"{T:>5} {bv:>3} {warps:>5} {stages:>6} failed: {type(e).__name__}: {str(e)[:80]}")
                continue
            gbs = io_bytes / total_ms / 1e6
            say(f"{T:>5} {bv:>3} {warps:>5} {stages:>6} {factors_ms:>8.3f} {states_ms:>8.3f} {output_ms:>8.3f} {total_ms:>8.3f} {gbs:>11.0f}")
    say("[spec §9.3, not measured here] fla chunk_kda: 1.85 ms at T=8192")


def check_precision(copy_gbs: float) -> None:
    say("\n== tl.dot input precision (prefill T=8192, default tiles; tf32 is the default) ==")
    T = 8192
    q, k, v, g, beta = inputs(T, seed=11)
    S0 = 0.1 * torch.randn(H, D, D, device=DEVICE)
    o_ref, final_ref, _ = K.kda_chunk_prefill_ref(q, k, v, g, beta, S0)
    for precision in ("tf32", "tf32x3", "ieee"):
        o, final, _ = K.kda_chunk_prefill(q, k, v, g, beta, S0, precision=precision)
        ms = bench(lambda: K.kda_chunk_prefill(q, k, v, g, beta, S0, precision=precision))
        say(f"{precision:>7}: {ms:.3f} ms, rel err o {rel_err(o, o_ref):.2e}, final state {rel_err(final, final_ref):.2e}")


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("kda_gpu_check.py needs CUDA")
    torch.backends.cuda.matmul.allow_tf32 = False  # the twins must be true fp32
    torch.backends.cudnn.allow_tf32 = False
    say(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, H={H}, d={D}")
    wanted = set(sys.argv[1:]) or {"decode", "prefill"}
    copy_gbs = copy_bandwidth()
    for name, fn in (("decode", check_decode), ("prefill", check_prefill), ("precision", check_precision)):
        if name in wanted:
            fn(copy_gbs)
            say(f"[{time.time() - START:.0f} s elapsed]")


if __name__ == "__main__":
    main()

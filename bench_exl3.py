"""EXL3 linear on a GPU: our Triton kernels against exllamav3 1.6.5 (spec exl3.md §6, performance.md §8).

    python bench_exl3.py sweep        launch configurations of exl3_gemv (needs no exllamav3)
    python bench_exl3.py quick        three of them, no decode timing
    python bench_exl3.py compare      batch-1 exl3_gemv vs exllamav3 LinearEXL3.forward, and
                                      exl3_decode vs exllamav3's reconstruct, on the same tensors
    python bench_exl3.py sweep+compare  both, comparing with the sweep's fastest launch too
    python bench_exl3.py crosscheck   exllamav3's decode of our tensors (random trellis; exl3.quantize)

Times are medians of triton.testing.do_bench: "eager" is one Python call per launch; "graph" is
the same calls captured in one CUDA graph, per call. Inputs rotate over enough copies that the
trellis bytes exceed the L2 three times, so the numbers are not L2 hits.
"""
from __future__ import annotations

import argparse
import itertools
import math
import time

import torch
import triton

import kernels

SHAPES = [(4096, 2048), (4096, 12288)]  # (in, out)
BITS = [3, 4]
MARKERS = {"mcg": 0xCBAC1FED - (1 << 32), "mul1": 0x83DCD12D - (1 << 32)}
L2_BYTES = 60e6


def median_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=300, return_mode="median") * 1e3


def eager_us(calls) -> float:
    cycle = itertools.cycle(calls)
    return median_us(lambda: next(cycle)())


def graph_us(calls) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return median_us(graph.replay) / len(calls)


def copy_gbps() -> float:
    a = torch.randint(0, 255, (1 << 31,), dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() / (median_us(lambda: b.copy_(a)) * 1e-6) / 1e9


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


def random_linear(k: int, n: int, bits: float, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    width = int(16 * bits)
    trellis = torch.randint(-2**15, 2**15, (k // 16, n // 16, width), generator=g, device="cuda",
                            dtype=torch.int32).to(torch.int16)
    sign = lambda size: torch.randint(0, 2, (size,), generator=g, device="cuda") * 2 - 1
    suh = ((torch.rand(k, generator=g, device="cuda") * 0.1 + 0.01) * sign(k)).half()
    svh = ((torch.rand(n, generator=g, device="cuda") * 0.1 + 0.01) * sign(n)).half()
    x = torch.randn(1, k, generator=g, device="cuda").half()
    return trellis, suh, svh, x


def data_sets(k: int, n: int, bits: float):
    count = max(2, math.ceil(3 * L2_BYTES / (k * n * bits / 8)))
    return [random_linear(k, n, bits, seed) for seed in range(count)]


def reference(trellis, suh, svh, x, codebook):
    # The torch twin's math (x @ dequantize), decoded with our bit-exact kernel to stay fast.
    w = kernels.exl3_decode(trellis, codebook).float()
    h = torch.tensor([[(-1) ** bin(i & j).count("1") for j in range(128)] for i in range(128)],
                     dtype=torch.float32, device="cuda") / math.sqrt(128)
    k, n = w.shape
    w = (h @ w.view(k // 128, 128, n)).view(k, n)
    w = (w.view(k, n // 128, 128) @ h).view(k, n)
    return x.float() @ (suh.float()[:, None] * w * svh.float()[None, :])


def ours(trellis, suh, svh, x, codebook, **launch):
    out = torch.empty((x.shape[0], trellis.shape[1] * 16), dtype=torch.float16, device="cuda")
    return lambda: kernels.exl3_gemv(x, trellis, suh, svh, codebook, out=out, **launch)


CONFIGS = [dict(block_n=bn, row_tiles=rt, num_warps=4) for bn in (64, 128) for rt in (1, 2, 4)] + [
    dict(block_n=128, row_tiles=2, num_warps=8)]


QUICK_CONFIGS = [dict(block_n=128, row_tiles=1), dict(block_n=64, row_tiles=2), dict(block_n=128, row_tiles=2)]


def sweep(args, configs: list[dict] = CONFIGS, decode: bool = True) -> dict:
    """Graph time of every launch configuration; returns the fastest per (shape, K)."""
    print(f"device {torch.cuda.get_device_name()}, copy {copy_gbps():.0f} GB/s (read + write)")
    print("| shape (in x out) | K | block_n | row_tiles | warps | split | graph us | trellis GB/s | T weights/s | rel err |")
    best = {}
    for (k, n), bits in itertools.product(SHAPES, BITS):
        sets = data_sets(k, n, bits)
        ref = reference(*sets[0], args.codebook)
        for launch in configs:
            calls = [ours(*s, args.codebook, **launch) for s in sets]
            try:
                err, t = rel_err(calls[0](), ref), graph_us(calls)
            except Exception as error:  # one broken launch shape must not hide the others
                print(f"| {k}x{n} | {bits} | {launch} | failed: {error!r} |")
                continue
            split = kernels._default_split(torch.device("cuda"), n, k // 16 // launch["row_tiles"], launch["block_n"])
            print(f"| {k}x{n} | {bits} | {launch['block_n']} | {launch['row_tiles']} | {launch.get('num_warps', 4)} | "
                  f"{split} | {t:.1f} | {k * n * bits / 8 / t / 1e3:.0f} | {k * n / t / 1e6:.2f} | {err:.1e} |",
                  flush=True)
            if err <= 1e-3 and t < best.get((k, n, bits), (None, float("inf")))[1]:
                best[(k, n, bits)] = (launch, t)
    print_registers()
    if not decode:
        return {key: launch for key, (launch, _) in best.items()}
    print("| decode (in x out) | K | exl3_decode graph us | GB/s (trellis read + fp16 write) |")
    for (k, n), bits in itertools.product([(4096, 12288)], BITS):
        sets = data_sets(k, n, bits)
        outs = [torch.empty((k, n), dtype=torch.float16, device="cuda") for _ in sets]
        calls = [lambda s=s, o=o: kernels.exl3_decode(s[0], args.codebook, out=o) for s, o in zip(sets, outs)]
        t = graph_us(calls)
        print(f"| {k}x{n} | {bits} | {t:.1f} | {k * n * (2 + bits / 8) / t / 1e3:.0f} |", flush=True)
    return {key: launch for key, (launch, _) in best.items()}


def print_registers() -> None:
    # Compiler resource report of every compiled exl3_gemv variant (registers, spills).
    try:
        _print_registers()
    except Exception as error:  # Triton's cache layout differs between versions
        print(f"no register report: {error!r}")


def _print_registers() -> None:
    for caches in kernels._gemv_kernel.device_caches.values():
        for compiled in caches[0].values():
            c = {k: v for k, v in compiled.src.constants.items() if isinstance(k, str)} \
                if hasattr(compiled.src, "constants") else {}
            print(f"gemv kernel {c} warps {compiled.metadata.num_warps}: {compiled.n_regs} registers, "
                  f"{compiled.n_spills} spills")


def load_exllamav3():
    start = time.time()
    from exllamav3.ext import exllamav3_ext
    from exllamav3.modules.quant.exl3 import LinearEXL3
    print(f"exllamav3 imported (extension JIT/load) in {time.time() - start:.0f} s", flush=True)
    return LinearEXL3, exllamav3_ext


def their_linear(LinearEXL3, trellis, suh, svh, codebook):
    markers = {cb: torch.tensor(v, dtype=torch.int32, device=trellis.device) for cb, v in MARKERS.items()}
    k, n = trellis.shape[0] * 16, trellis.shape[1] * 16
    return LinearEXL3(None, k, n, suh=suh, svh=svh, trellis=trellis,
                      mcg=markers["mcg"] if codebook == "mcg" else None,
                      mul1=markers["mul1"] if codebook == "mul1" else None)


def compare(args, best: dict | None = None) -> None:
    gbps = copy_gbps()
    print(f"device {torch.cuda.get_device_name()}, copy {gbps:.0f} GB/s (read + write)")
    LinearEXL3, ext = load_exllamav3()
    print(f"ours: exl3_gemv with the defaults (or the sweep's fastest launch), codebook {args.codebook}")
    print("| shape (in x out) | K | ours launch | ours eager us | exllamav3 eager us | ours graph us | "
          "exllamav3 graph us | trellis floor us | ours/exl3 graph | ours err | exl3 err |")
    for (k, n), bits in itertools.product(SHAPES, BITS):
        sets = data_sets(k, n, bits)
        ref = reference(*sets[0], args.codebook)
        theirs_mods = [their_linear(LinearEXL3, t, su, sv, args.codebook) for t, su, sv, _ in sets]
        theirs = [lambda mod=mod, x=s[3]: mod.forward(x, {}) for mod, s in zip(theirs_mods, sets)]
        err_theirs, e_theirs = rel_err(theirs[0](), ref), eager_us(theirs)
        try:
            g_theirs = graph_us(theirs)
        except Exception as error:  # report, do not hide
            print(f"exllamav3 graph capture failed: {error!r}")
            g_theirs = float("nan")
        floor = k * n * bits / 8 / (gbps * 1e9) * 1e6  # the trellis bytes at the copy's HBM traffic rate
        launches = [{}] + ([best[(k, n, bits)]] if best and (k, n, bits) in best else [])
        for launch in launches:
            mine = [ours(*s, args.codebook, **launch) for s in sets]
            try:
                err_mine, e_mine, g_mine = rel_err(mine[0](), ref), eager_us(mine), graph_us(mine)
            except Exception as error:
                print(f"| {k}x{n} | {bits} | {launch or 'default'} | failed: {error!r} | {e_theirs:.1f} |")
                continue
            print(f"| {k}x{n} | {bits} | {launch or 'default'} | {e_mine:.1f} | {e_theirs:.1f} | {g_mine:.1f} | "
                  f"{g_theirs:.1f} | {floor:.2f} | {g_mine / g_theirs:.2f} | {err_mine:.1e} | {err_theirs:.1e} |",
                  flush=True)

    print("| decode (in x out) | K | ours exl3_decode us | exllamav3 reconstruct us | bit-exact | ours GB/s |")
    for (k, n), bits in itertools.product([(4096, 12288)], BITS):
        sets = data_sets(k, n, bits)
        outs = [torch.empty((k, n), dtype=torch.float16, device="cuda") for _ in sets]
        mcg, mul1 = args.codebook == "mcg", args.codebook == "mul1"
        mine = [lambda s=s, o=o: kernels.exl3_decode(s[0], args.codebook, out=o) for s, o in zip(sets, outs)]
        theirs = [lambda s=s, o=o: ext.reconstruct(o, s[0], bits, mcg, mul1) for s, o in zip(sets, outs)]
        w_mine = mine[0]().clone()
        theirs[0]()
        exact = torch.equal(w_mine.view(torch.int16), outs[0].view(torch.int16))
        t_mine, t_theirs = graph_us(mine), graph_us(theirs)
        moved = k * n * (2 + bits / 8)
        print(f"| {k}x{n} | {bits} | {t_mine:.1f} | {t_theirs:.1f} | {exact} | {moved / t_mine / 1e3:.0f} |")


def crosscheck(args) -> None:
    import exl3

    LinearEXL3, _ = load_exllamav3()
    print("| tensor | codebook | K | exllamav3 inner == exl3.unpack | == exl3_decode | full rel err vs dequantize |")
    cases = [(cb, float(b)) for cb in kernels.CODEBOOKS for b in range(1, 9)]
    cases += [("mul1", b) for b in (1.5, 2.5, 3.5)]
    for codebook, bits in cases:
        trellis, suh, svh, _ = random_linear(1024, 512, bits, seed=int(bits * 2))
        theirs = their_linear(LinearEXL3, trellis, suh, svh, codebook)
        inner = theirs.get_inner_weight_tensor()
        same_torch = torch.equal(inner.view(torch.int16), exl3.unpack(trellis, codebook).view(torch.int16))
        same_triton = torch.equal(inner.view(torch.int16), kernels.exl3_decode(trellis, codebook).view(torch.int16))
        err = rel_err(theirs.get_weight_tensor(), exl3.dequantize(trellis, suh, svh, codebook))
        print(f"| random 1024x512 | {codebook} | {bits:g} | {same_torch} | {same_triton} | {err:.1e} |", flush=True)
    if not hasattr(exl3, "quantize"):
        print("exl3.quantize does not exist yet: quantizer cross-check not run")
        return
    seconds = 0.0
    for (k, n), bits, codebook in [((1024, 512), 4, "mcg"), ((4096, 2048), 3, "mul1")]:
        if seconds > 15:  # the second is 16x the first's tiles
            print(f"skipped {k}x{n}: the smaller quantize took {seconds:.0f} s")
            break
        g = torch.Generator(device="cuda").manual_seed(k)
        weight = torch.randn(n, k, generator=g, device="cuda")  # HF layout [out, in]
        start = time.time()
        lin = exl3.quantize(weight, bits, codebook=codebook)
        torch.cuda.synchronize()
        seconds = time.time() - start
        tensors = {name: t.cuda() for name, t in lin.tensors().items()}
        theirs = LinearEXL3(None, k, n, suh=tensors["suh"], svh=tensors["svh"], trellis=tensors["trellis"],
                            mcg=tensors.get("mcg"), mul1=tensors.get("mul1"))
        inner = theirs.get_inner_weight_tensor()
        same = torch.equal(inner.view(torch.int16), exl3.unpack(tensors["trellis"], codebook).view(torch.int16))
        ours_w = exl3.dequantize(tensors["trellis"], tensors["suh"], tensors["svh"], codebook)
        err = rel_err(theirs.get_weight_tensor(), ours_w)
        nmse = rel_err(ours_w.float(), weight.t()) ** 2
        x = torch.randn(1, k, generator=g, device="cuda").half()
        y_err = rel_err(theirs.forward(x, {}), x.float() @ ours_w.float())
        print(f"| exl3.quantize {k}x{n} ({seconds:.0f} s, NMSE {nmse:.4f}) | {codebook} | {bits} | {same} | - | "
              f"{err:.1e} (their forward vs x@W: {y_err:.1e}) |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["sweep", "quick", "compare", "sweep+compare", "crosscheck"])
    parser.add_argument("--codebook", default="mcg", choices=kernels.CODEBOOKS)
    args = parser.parse_args()
    if args.mode == "quick":
        sweep(args, QUICK_CONFIGS, decode=False)
    elif args.mode == "sweep+compare":
        compare(args, sweep(args))
    else:
        {"sweep": sweep, "compare": compare, "crosscheck": crosscheck}[args.mode](args)


if __name__ == "__main__":
    main()

"""A full-size synthetic GLM-5.3-Flash, built on the device with no files, for bench.py and the tests: the
published config (fixtures/glm53/config.json) cut to its first N layers, K per MoE layer (`layer_bits`), the
bytes each weight will take (`weight_sizes`, what placement.plan places before anything is allocated),
random weights in those formats (`build_weights`: routed experts as random EXL3 trellises, the core FP8
block-128 or BF16) and random cache rows standing in for a prefill (`fill_context`). Random weights: the
numbers it gives are speeds and memory, not quality.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Callable, Sequence

import torch

import cache as cache_mod
import checkpoint
import exl3
import fp8
import placement
from cache import CachePool
from model_glm import GLMConfig
from placement import Placement

ROOT = Path(__file__).resolve().parent
CONFIG_CANDIDATES = [Path(os.environ.get("GLM53_SHARED", ROOT.parent / "shared")), ROOT / "shared",
                     ROOT / ".whl" / "shared"]
CODEBOOK = "mcg"
BLOCK_SIZE = 64


def fixture_config() -> dict:
    for base in CONFIG_CANDIDATES:
        path = base / "fixtures" / "glm53" / "config.json"
        if path.is_file():
            with open(path) as f:
                return json.load(f)
    raise FileNotFoundError(f"fixtures/glm53/config.json not found under any of {[str(c) for c in CONFIG_CANDIDATES]}; "
                            "set GLM53_SHARED to the folder holding fixtures/")


def model_config(layers: int | None, tiny: bool) -> GLMConfig:
    """The real config (or the tests' tiny one), without MTP, cut to the first `layers` layers: the
    pattern (3 KDA + 1 DSA, dense layers first) stays as it is at the top of the model."""
    d = checkpoint.tiny_config_dict() if tiny else fixture_config()
    t = dict(d["text_config"])
    n = layers or t["num_hidden_layers"]
    if not 1 <= n <= t["num_hidden_layers"]:
        raise ValueError(f"--layers {n}: the model has 1..{t['num_hidden_layers']} layers")
    t["num_hidden_layers"], t["num_nextn_predict_layers"] = n, 0
    for key in ("layer_types", "mlp_layer_types", "indexer_types"):
        if key in t:
            t[key] = t[key][:n]
    lin = dict(t["linear_attn_config"])
    for key in ("kda_layers", "full_attn_layers"):
        if key in lin:
            lin[key] = [i for i in lin[key] if i < n]
    t["linear_attn_config"] = lin
    return GLMConfig.from_dict({"text_config": t})


def layer_bits(cfg: GLMConfig, bits: float) -> dict[int, int]:
    """K per MoE layer: 3.25 = every fourth MoE layer K4, the others K3 (K3.25-like); else K for all."""
    moe = [L for L, t in enumerate(cfg.mlp_layer_types) if t == "sparse"]
    if bits == 3.25:
        return {L: 4 if j % 4 == 0 else 3 for j, L in enumerate(moe)}
    if bits not in (2, 3, 4, 5, 6):
        raise ValueError(f"--bits {bits}: expected 3.25 (K3/K4 mix) or an integer 2..6")
    return {L: int(bits) for L in moe}


def weight_format(name: str, spec: checkpoint.TensorSpec, core: str) -> str:
    """"exl3" (routed experts), "fp8" (core linears with --core fp8) or "plain" (a tensor)."""
    if checkpoint.is_routed_expert(name):
        return "exl3"
    if core == "fp8" and checkpoint.is_fp8_core(name, spec):
        return "fp8"
    return "plain"


def layer_index(name: str) -> int:
    """L of a weight named layers.L.*."""
    return int(name.split(".")[1])


def weight_bytes(name: str, spec: checkpoint.TensorSpec, fmt: str, bits: dict[int, int], dtype_bytes: int) -> int:
    """Bytes `build_weights` allocates for one weight: an EXL3 linear's int16 trellis and fp16 suh,
    svh; an FP8 linear's bytes and fp32 block scales; else the tensor in the model dtype (small
    fp32 tensors in fp32)."""
    if fmt == "exl3":
        out_f, in_f = spec.shape
        return (in_f // 16) * (out_f // 16) * exl3.trellis_width(bits[layer_index(name)]) * 2 + 2 * (in_f + out_f)
    if fmt == "fp8":
        out_f, in_f = spec.shape
        return out_f * in_f + 4 * -(-out_f // 128) * -(-in_f // 128)
    fp32 = spec.fp32 and not spec.linear and name != "embed_tokens.weight"
    return math.prod(spec.shape) * (4 if fp32 else dtype_bytes)


def weight_sizes(cfg: GLMConfig, bits: dict[int, int], core: str, dtype: torch.dtype) -> dict[str, int]:
    """Bytes by in-memory name of what `build_weights` will allocate, without allocating: what
    placement.plan places."""
    size = torch.empty((), dtype=dtype).element_size()
    return {name: weight_bytes(name, spec, weight_format(name, spec, core), bits, size)
            for name, spec in checkpoint.expected_tensors(cfg).items()}


def _random_linear_tensor(shape, dtype, device, gen) -> torch.Tensor:
    """N(0, 1/in) in `dtype`, generated on the device (the model-scale tensors do not fit a CPU RNG's time)."""
    return torch.randn(shape, dtype=dtype, device=device, generator=gen) / math.sqrt(shape[-1])


def _random_experts(cfg: GLMConfig, L: int, k: int, device, gen) -> dict[str, exl3.EXL3Linear]:
    """All routed experts of layer L from one trellis allocation per projection kind; W std ~ 1/sqrt(in)
    as in tests/tiny.py (random signs times (codebook std * sqrt(in))^-1/2 on both sides)."""
    E, D, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    cb_std = exl3.codebook_lut(CODEBOOK).float().std().item()
    out = {}
    for proj, (in_f, out_f) in (("gate_proj", (D, I)), ("up_proj", (D, I)), ("down_proj", (I, D))):
        shape = (E, in_f // 16, out_f // 16, exl3.trellis_width(k))
        # uint8 random_() covers all 256 byte values; int16 random_() would never set the sign bit.
        trellis = torch.empty(math.prod(shape) * 2, dtype=torch.uint8, device=device).random_(
            generator=gen).view(torch.int16).view(shape)
        mag = (cb_std * math.sqrt(in_f)) ** -0.5
        sign = lambda n: torch.randint(0, 2, (E, n), device=device, generator=gen) * 2 - 1
        suh, svh = (sign(in_f) * mag).half(), (sign(out_f) * mag).half()
        for e in range(E):
            name = f"layers.{L}.mlp.experts.{e}.{proj}.weight"
            out[name] = exl3.EXL3Linear(trellis[e], suh[e], svh[e], CODEBOOK, name=name)
    return out


def build_weights(cfg: GLMConfig, bits: dict[int, int], core: str, dtype: torch.dtype,
                  device: torch.device | Callable[[str], torch.device], seed: int = 0) -> dict:
    """Random weights by in-memory name, on `device` or on `device(name)` (a placement's device_of);
    the core first (its FP8 quantization needs transient memory), then the experts layer by layer.
    One generator per device, each seeded with `seed`: one device draws what it always drew."""
    where = device if callable(device) else lambda name: device
    gens: dict[torch.device, torch.Generator] = {}

    def gen(dev: torch.device) -> torch.Generator:
        if dev not in gens:
            gens[dev] = torch.Generator(device=dev).manual_seed(seed)
        return gens[dev]

    weights: dict = {}
    specs = checkpoint.expected_tensors(cfg)
    for name, spec in specs.items():
        fmt = weight_format(name, spec, core)
        if fmt == "exl3":
            continue
        dev = torch.device(where(name))
        if fmt == "fp8":
            w = _random_linear_tensor(spec.shape, torch.bfloat16, dev, gen(dev))
            weights[name] = fp8.FP8Linear.from_weight(w, name=name)
        elif spec.linear:
            weights[name] = _random_linear_tensor(spec.shape, dtype, dev, gen(dev))
        elif name == "embed_tokens.weight":
            weights[name] = torch.randn(spec.shape, dtype=dtype, device=dev, generator=gen(dev))
        else:  # small tensors: checkpoint's initializer (A_log, dt_bias, mHC, norms, router ...)
            g = torch.Generator().manual_seed(seed + len(weights))
            weights[name] = checkpoint.random_init(name, spec, g).to(
                device=dev, dtype=torch.float32 if spec.fp32 else dtype)
    for L, k in bits.items():
        dev = torch.device(where(f"layers.{L}.mlp.experts.0.gate_proj.weight"))  # the layer's experts lie together
        weights |= _random_experts(cfg, L, k, dev, gen(dev))
    return weights


def fill_context(cache: CachePool, blocks: torch.Tensor, slot: int, ctx: int, gen: torch.Generator) -> None:
    """Stand-in for a prefill of `ctx` tokens: random latent rows and pooled keys in the sequence's blocks;
    random indexer-key and gate tail rows, KDA and conv state in its slot (unit-scale values).
    Drawn on the generator's device; a pool split over devices (cache.LayerRows) sends each layer's
    rows to its device."""
    used = blocks[:-(-ctx // cache.block_size)].to(cache.device)
    for t in (cache.latent, cache.pooled):
        t[:, used] = torch.randn((t.shape[0], len(used), *t.shape[2:]), dtype=t.dtype, device=gen.device,
                                 generator=gen)
    for t in (cache.index_k, cache.gate):
        t[:, slot] = torch.randn((t.shape[0], *t.shape[2:]), dtype=t.dtype, device=gen.device, generator=gen)
    s = cache.kda_state
    cache.kda_state[:, slot] = 0.05 * torch.randn((s.shape[0], *s.shape[2:]), device=gen.device, generator=gen)
    c = cache.conv_state
    cache.conv_state[:, slot] = torch.randn((c.shape[0], *c.shape[2:]), dtype=c.dtype, device=gen.device,
                                            generator=gen)


def plan_model(cfg: GLMConfig, bits: dict[int, int], core: str, dtype: torch.dtype,
               devices: Sequence[torch.device], budgets: Sequence[int | None], num_blocks: int,
               num_slots: int) -> Placement:
    """The layer split of the synthetic model and its cache over `devices` (placement.plan, with the
    bytes build_weights will allocate): raises PlacementError, with every device's numbers, when a
    device's weights and cache rows exceed its budget."""
    return placement.plan(cfg, weight_sizes(cfg, bits, core, dtype), devices, budgets=budgets,
                          cache=cache_mod.pool_bytes(cfg, num_blocks, num_slots, BLOCK_SIZE, dtype))

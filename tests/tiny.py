"""Tiny GLM-5.3-Flash models for tests: a config (spec glm53.md §7.2), random weights, a checkpoint.

`tiny_config_dict` and `random_weights` live in checkpoint.py (the built-in default model uses them
too) and are re-exported here. Everything is deterministic in its arguments.
"""
from __future__ import annotations

import math
import zlib
from pathlib import Path
from typing import Any

import torch

import checkpoint
from checkpoint import random_weights, tiny_config_dict  # noqa: F401  (re-exported)
import exl3
import vision
from model_glm import GLMConfig


def random_exl3_experts(config: Any, seed: int = 0, bits: float = 4, codebook: str = "mcg") -> dict[str, exl3.EXL3Linear]:
    """Routed experts as EXL3 linears with random trellises: every int16 trellis is a valid EXL3
    tensor (exl3.md §8.2), so this needs no (slow, on CPU) quantizer. suh/svh are random signs
    times a magnitude that gives W about the spread of `random_weights`' experts (std 1/sqrt(in)).
    Merge into `random_weights(...)` to get a model whose experts are EXL3."""
    out = {}
    words = exl3.trellis_width(bits)
    cb_std = exl3.codebook_lut(codebook).float().std().item()
    for name, spec in checkpoint.expected_tensors(config).items():
        if not checkpoint.is_routed_expert(name):
            continue
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        out_f, in_f = spec.shape
        trellis = torch.randint(-(1 << 15), 1 << 15, (in_f // 16, out_f // 16, words), generator=g,
                                dtype=torch.int32).to(torch.int16)
        mag = (cb_std * math.sqrt(in_f)) ** -0.5
        suh = ((torch.randint(0, 2, (in_f,), generator=g) * 2 - 1) * mag).half()
        svh = ((torch.randint(0, 2, (out_f,), generator=g) * 2 - 1) * mag
               * (1 + 0.1 * torch.randn(out_f, generator=g))).half()
        out[name] = exl3.EXL3Linear(trellis, suh, svh, codebook, name=name)
    return out


def make_tiny_checkpoint(dir: str | Path, experts: str = "bf16", core: str = "bf16", seed: int = 0,
                         bits: float = 4, **overrides: Any) -> Path:
    """Write a tiny random checkpoint to `dir` (see `checkpoint.write_checkpoint`) and return its path.
    experts="exl3" stores `random_exl3_experts(config, seed, bits)` (exl3.quantize is far too slow
    on CPU for every test to run it); "fp8" quantizes `random_weights`' experts."""
    config_dict = tiny_config_dict(**overrides)
    config = GLMConfig.from_dict(config_dict)
    weights = random_weights(config, seed)
    if experts == "exl3":
        weights |= random_exl3_experts(config, seed, bits)
    return checkpoint.write_checkpoint(dir, config_dict, weights, experts=experts, core=core, bits=bits)


def random_vision_tower(out_hidden_size: int, image_token_id: int, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32, seed: int = 0) -> vision.VisionTower:
    """A one-block vision tower of random weights whose rows fit a language model of out_hidden_size."""
    cfg = vision.VisionConfig(depth=1, hidden_size=32, num_heads=2, intermediate_size=64,
                              out_hidden_size=out_hidden_size, projection_intermediate_size=48)
    h, i, o, pi, m = 32, 64, out_hidden_size, 48, cfg.spatial_merge_size
    shapes = {"attn.qkv.weight": (3 * h, h), "attn.qkv.bias": (3 * h,), "attn.proj.weight": (h, h),
              "attn.proj.bias": (h,), "attn.q_norm.weight": (cfg.head_dim,), "attn.k_norm.weight": (cfg.head_dim,),
              "mlp.gate_proj.weight": (i, h), "mlp.gate_proj.bias": (i,), "mlp.up_proj.weight": (i, h),
              "mlp.up_proj.bias": (i,), "mlp.down_proj.weight": (h, i), "mlp.down_proj.bias": (h,),
              "norm1.weight": (h,), "norm2.weight": (h,)}
    shapes = {f"blocks.0.{k}": v for k, v in shapes.items()} | {
        "downsample.weight": (o, h, m, m), "downsample.bias": (o,), "merger.proj.weight": (o, o),
        "merger.post_projection_norm.weight": (o,), "merger.post_projection_norm.bias": (o,),
        "merger.gate_proj.weight": (pi, o), "merger.up_proj.weight": (pi, o), "merger.down_proj.weight": (o, pi),
        "patch_embed.proj.weight": (h, 3, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size),
        "patch_embed.proj.bias": (h,), "post_layernorm.weight": (h,)}
    g = torch.Generator().manual_seed(seed)
    weights = {k: (torch.randn(shape, generator=g) / math.sqrt(math.prod(shape[1:]) or 1)).to(device, dtype)
               for k, shape in shapes.items()}
    return vision.VisionTower(cfg, weights, image_token_id)

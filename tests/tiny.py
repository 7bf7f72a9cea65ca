"""Tiny GLM-5.3-Flash models for tests: a config (spec glm53.md §7.2), random weights, a checkpoint.

Everything here is deterministic in its arguments. The config is the real multimodal layout
(top level + `text_config` + a tiny `vision_config`) so the same dict feeds this engine and
transformers' `Glm5NextConfig` oracle.
"""
from __future__ import annotations

import copy
import math
import zlib
from pathlib import Path
from typing import Any

import torch

import checkpoint
import exl3
from model_glm import GLMConfig

_TEXT = dict(
    model_type="glm5_next_text",
    vocab_size=512, hidden_size=256, intermediate_size=512,
    # 128, not §7.2's 64: EXL3 needs in/out features in multiples of 128 (exl3.md §4).
    moe_intermediate_size=128,
    num_hidden_layers=4, first_k_dense_replace=1,
    num_attention_heads=4, num_key_value_heads=4,
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.5,
    n_group=1, topk_group=1, norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc",
    moe_router_dtype="float32",
    q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=0, qk_head_dim=32,
    v_head_dim=32, head_dim=0, mla_use_nope=True,
    # >= 16 indexer heads: with fewer, many pool scores tie at 0 after ReLU (spec §7.3 (c)).
    index_n_heads=16, index_head_dim=32, index_topk=16, index_kpool=4,
    index_kpool_compress=True, index_kpool_always_select_tail=True, index_share_for_mtp_iteration=True,
    hc_mult=4, hc_eps=1e-6, hc_sinkhorn_iters=20, mhc=True,
    swiglu_limit=10.0, rms_norm_eps=1e-5, hidden_act="silu",
    num_nextn_predict_layers=1,
    max_position_embeddings=1048576, attention_bias=False, attention_dropout=0.0,
    pad_token_id=0, eos_token_id=1, tie_word_embeddings=False, dtype="bfloat16",
)
_LINEAR_ATTN = {"num_heads": 4, "head_dim": 32, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0}
_VISION = dict(model_type="glm5_next_vision", depth=1, hidden_size=32, num_heads=2, intermediate_size=64,
               out_hidden_size=256, projection_intermediate_size=64)


def tiny_config_dict(**overrides: Any) -> dict:
    """config.json of a 4-layer model: layers 1 and 3 DSA, 0 and 2 KDA, layer 0 dense, 8 experts
    top-2, MTP on. `overrides` are text_config fields; per-layer lists follow `num_hidden_layers`
    (DSA on odd layers) and `first_k_dense_replace` unless given."""
    text = {**copy.deepcopy(_TEXT), **overrides}
    n = text["num_hidden_layers"]
    dsa = [i for i in range(n) if i % 2 == 1]
    text.setdefault("layer_types", ["deepseek_sparse_attention" if i in dsa else "linear_attention"
                                    for i in range(n)])
    text.setdefault("mlp_layer_types", ["dense" if i < text["first_k_dense_replace"] else "sparse"
                                        for i in range(n)])
    text.setdefault("indexer_types", ["full"] * n)
    lin = {**_LINEAR_ATTN, **text.get("linear_attn_config", {})}
    lin["kda_layers"] = [i for i, t in enumerate(text["layer_types"]) if t == "linear_attention"]
    lin["full_attn_layers"] = [i for i, t in enumerate(text["layer_types"]) if t != "linear_attention"]
    text["linear_attn_config"] = lin
    return {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next",
            "tie_word_embeddings": False, "text_config": text, "vision_config": dict(_VISION)}


def _init(name: str, spec: checkpoint.TensorSpec, g: torch.Generator) -> torch.Tensor:
    """Random values on a sensible scale; the tensors transformers initialises to constants
    (A_log, kpool ape/gate, hc base, e_score_correction_bias) get spread so no path is degenerate."""
    shape = spec.shape
    randn = torch.randn(shape, generator=g)
    if name == "embed_tokens.weight":
        return randn
    if name.endswith("A_log"):  # FLA init: A ~ U(1, 16)
        return torch.rand(shape, generator=g).mul(15).add(1).log()
    if name.endswith("dt_bias"):  # inverse softplus of dt ~ logU(1e-3, 1e-1)
        dt = torch.rand(shape, generator=g).mul(math.log(100)).add(math.log(1e-3)).exp()
        return dt + torch.log(-torch.expm1(-dt))
    if name.endswith("_base"):  # hc_*_base
        return 0.5 * randn
    if name.endswith("_scale"):  # hc_*_scale
        return torch.rand(shape, generator=g) + 0.5
    if name.endswith("index_kpool_compress_ape"):
        return 0.5 * randn
    if name.endswith("e_score_correction_bias") or name.endswith(".bias"):
        return 0.1 * randn
    if name.endswith("norm.weight"):
        return 1 + 0.1 * randn
    # projections (linears, router, hc_*_fn, kpool gate) and conv taps: unit-variance outputs
    return randn / math.sqrt(shape[-1])


def random_weights(config: Any, seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 weights by in-memory name. Each tensor has its own generator (seed, name), so changing
    one part of the config leaves the others' values alone. Tensors the checkpoint stores in BF16
    are rounded to BF16 here, so a BF16 checkpoint holds exactly these values."""
    out = {}
    for name, spec in checkpoint.expected_tensors(config).items():
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        w = _init(name, spec, g)
        out[name] = w if spec.fp32 else w.to(torch.bfloat16).float()
    return out


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

"""GLM-5.3-Flash (`glm5_next`) text model: configuration and the pure-torch forward pass.

Follows ../shared/spec/glm53.md §4 in order: mHC (§4.2), KDA (§4.3), DSA (§4.4), the feed-forward
blocks (§4.5), the head (§4.6) and MTP (§4.7). This is the slow path: plain torch that runs on CPU
and is meant to be stepped through in a debugger. Names follow the spec (q̃ → q_pre, Γ → Gam, ...).
"""
from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Union

import torch
import torch.nn.functional as F

import checkpoint
import placement as placement_mod
from cache import CachePool
from placement import Placement

# A linear weight: a dense [out, in] tensor or a callable (exl3.EXL3Linear) computing x W^T.
Weight = Union[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]

KDA_CHUNK = 64  # §4.3.7: chunk length of the WY prefill form
SCORE_BUDGET = 1 << 26  # DSA: most query x head x key scores held at once (256 MiB in fp32)


# ---------------------------------------------------------------------------------------------
# Configuration (§1.1)
# ---------------------------------------------------------------------------------------------

_ATTN_LABELS = {
    "linear_attention": "kda",
    "deepseek_sparse_attention": "dsa",
    "indexed_attention": "dsa",  # how transformers >= 5.24 saves a DSA layer
}

# Our name -> (key inside linear_attn_config, flat key transformers writes next to it).
_LINEAR_ATTN_KEYS = {
    "linear_num_heads": ("num_heads", "linear_num_heads"),
    "linear_head_dim": ("head_dim", "linear_head_dim"),
    "linear_conv_kernel": ("short_conv_kernel_size", "linear_conv_kernel_dim"),
    "linear_lower_bound": ("gate_lower_bound", "linear_lower_bound"),
}

# Fields that, when present, must hold exactly this value: anything else is a model we do not run.
_SUPPORTED_ONLY = {
    "hidden_act": "silu",
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "n_group": 1,
    "topk_group": 1,
    "moe_router_dtype": "float32",
    "mla_use_nope": True,
    "mhc": True,
    "index_kpool_compress": True,
    "qk_rope_head_dim": 0,
    "tie_word_embeddings": False,
    "attention_bias": False,
}


@dataclass(frozen=True)
class GLMConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]  # "kda" | "dsa" per trunk layer
    mlp_layer_types: tuple[str, ...]  # "dense" | "sparse" per trunk layer
    rms_norm_eps: float
    # mHC
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    # KDA
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel: int
    linear_lower_bound: float
    # DSA: NoPE MLA
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    v_head_dim: int
    # DSA: k-pool lightning indexer
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    index_kpool: int
    index_kpool_always_select_tail: bool
    # feed-forward
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    swiglu_limit: float
    # MTP and tokens
    num_nextn_predict_layers: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    max_position_embeddings: int  # the longest context the model was trained for: the engine's default limit

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "kda")

    @property
    def dsa_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "dsa")

    @property
    def mtp_layer(self) -> int | None:
        """Layer id of the MTP block (stored right after the trunk), or None without MTP."""
        return self.num_hidden_layers if self.num_nextn_predict_layers > 0 else None

    def without_mtp(self) -> "GLMConfig":
        """This config with no MTP layer: the model a server without the MTP speculator runs (the layer's
        weights and its cache rows are then not on the device)."""
        return replace(self, num_nextn_predict_layers=0)

    @property
    def kda_dim(self) -> int:
        return self.linear_num_heads * self.linear_head_dim

    @classmethod
    def from_file(cls, path: str | Path) -> "GLMConfig":
        """Reads config.json (a path to the file or to the checkpoint folder)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        with open(path) as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_dict(cls, d: dict) -> "GLMConfig":
        """Accepts the multimodal top level (fields under `text_config`) or a text-only config."""
        t = d["text_config"] if "text_config" in d else d
        if not isinstance(t, dict):
            raise ValueError(f"config: text_config must be an object, got {type(t).__name__}")
        for name, value in _SUPPORTED_ONLY.items():
            if name in t and t[name] != value:
                raise ValueError(f"config: {name}={t[name]!r} is not supported (only {value!r})")

        n_layers = _field(t, "num_hidden_layers")
        lin = _linear_attn(t)
        eos = _field(t, "eos_token_id")
        cfg = cls(
            vocab_size=_field(t, "vocab_size"),
            hidden_size=_field(t, "hidden_size"),
            num_hidden_layers=n_layers,
            layer_types=_layer_types(t, n_layers),
            mlp_layer_types=_mlp_layer_types(t, n_layers),
            rms_norm_eps=float(_field(t, "rms_norm_eps")),
            hc_mult=_field(t, "hc_mult"),
            hc_sinkhorn_iters=_field(t, "hc_sinkhorn_iters"),
            hc_eps=float(_field(t, "hc_eps")),
            linear_num_heads=lin["linear_num_heads"],
            linear_head_dim=lin["linear_head_dim"],
            linear_conv_kernel=lin["linear_conv_kernel"],
            linear_lower_bound=float(lin["linear_lower_bound"]),
            num_attention_heads=_field(t, "num_attention_heads"),
            q_lora_rank=_field(t, "q_lora_rank"),
            kv_lora_rank=_field(t, "kv_lora_rank"),
            qk_nope_head_dim=_field(t, "qk_nope_head_dim"),
            v_head_dim=_field(t, "v_head_dim"),
            index_n_heads=_field(t, "index_n_heads"),
            index_head_dim=_field(t, "index_head_dim"),
            index_topk=_field(t, "index_topk"),
            index_kpool=_field(t, "index_kpool"),
            index_kpool_always_select_tail=bool(_field(t, "index_kpool_always_select_tail")),
            intermediate_size=_field(t, "intermediate_size"),
            moe_intermediate_size=_field(t, "moe_intermediate_size"),
            n_routed_experts=_field(t, "n_routed_experts"),
            num_experts_per_tok=_field(t, "num_experts_per_tok"),
            n_shared_experts=_field(t, "n_shared_experts"),
            routed_scaling_factor=float(_field(t, "routed_scaling_factor")),
            norm_topk_prob=bool(_field(t, "norm_topk_prob")),
            swiglu_limit=float(_field(t, "swiglu_limit")),
            num_nextn_predict_layers=t.get("num_nextn_predict_layers", 0),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (eos,),
            pad_token_id=t.get("pad_token_id"),
            max_position_embeddings=_field(t, "max_position_embeddings"),
        )
        _check_consistency(cfg, t)
        return cfg


def _field(t: dict, name: str):
    if t.get(name) is None:
        raise ValueError(f"config: missing field {name!r}")
    return t[name]


def _linear_attn(t: dict) -> dict:
    """KDA geometry from `linear_attn_config` and/or the flat `linear_*` keys; they must agree."""
    nested = t.get("linear_attn_config") or {}
    out = {}
    for ours, (nested_key, flat_key) in _LINEAR_ATTN_KEYS.items():
        a, b = nested.get(nested_key), t.get(flat_key)
        if a is not None and b is not None and a != b:
            raise ValueError(
                f"config: linear_attn_config.{nested_key}={a!r} contradicts {flat_key}={b!r}")
        if a is None and b is None:
            if ours == "linear_lower_bound":
                raise ValueError("config: linear_attn_config.gate_lower_bound is missing or null; "
                                 "the softplus forget gate is not supported")
            raise ValueError(f"config: missing field linear_attn_config.{nested_key}")
        out[ours] = a if a is not None else b
    return out


def _layer_types(t: dict, n_layers: int) -> tuple[str, ...]:
    nested = t.get("linear_attn_config") or {}
    listed = t.get("layer_types")
    from_ids = None
    if "kda_layers" in nested or "full_attn_layers" in nested:
        kda, full = set(nested.get("kda_layers", [])), set(nested.get("full_attn_layers", []))
        if kda & full or kda | full != set(range(n_layers)):
            raise ValueError("config: linear_attn_config.kda_layers and full_attn_layers must "
                             f"split layers 0..{n_layers - 1} between them")
        from_ids = tuple("kda" if i in kda else "dsa" for i in range(n_layers))
    if listed is None:
        if from_ids is None:
            raise ValueError("config: missing field 'layer_types'")
        return from_ids
    _check_per_layer(listed, "layer_types", n_layers, _ATTN_LABELS)
    types = tuple(_ATTN_LABELS[label] for label in listed)
    if from_ids is not None and from_ids != types:
        raise ValueError("config: layer_types contradicts linear_attn_config.kda_layers/full_attn_layers")
    return types


def _check_per_layer(listed: list, key: str, n_layers: int, allowed) -> None:
    """A per-layer list in the config: one entry per layer, each one of `allowed`."""
    if len(listed) != n_layers:
        raise ValueError(f"config: {key} has {len(listed)} entries, num_hidden_layers is {n_layers}")
    for i, label in enumerate(listed):
        if label not in allowed:
            raise ValueError(f"config: {key}[{i}]={label!r} is not one of {sorted(allowed)}")


def _mlp_layer_types(t: dict, n_layers: int) -> tuple[str, ...]:
    listed, k = t.get("mlp_layer_types"), t.get("first_k_dense_replace")
    from_k = None if k is None else tuple("dense" if i < k else "sparse" for i in range(n_layers))
    if listed is None:
        if from_k is None:
            raise ValueError("config: missing field 'mlp_layer_types' (or 'first_k_dense_replace')")
        return from_k
    _check_per_layer(listed, "mlp_layer_types", n_layers, ("dense", "sparse"))
    if from_k is not None and from_k != tuple(listed):
        raise ValueError(f"config: mlp_layer_types contradicts first_k_dense_replace={k}")
    return tuple(listed)


def _check_consistency(cfg: GLMConfig, t: dict) -> None:
    if cfg.index_kpool < 1:
        raise ValueError(f"config: index_kpool must be >= 1, got {cfg.index_kpool}")
    if cfg.index_topk < cfg.index_kpool or cfg.index_topk % cfg.index_kpool:
        raise ValueError(f"config: index_topk ({cfg.index_topk}) must be a positive multiple of "
                         f"index_kpool ({cfg.index_kpool})")
    if t.get("num_key_value_heads", cfg.num_attention_heads) != cfg.num_attention_heads:
        raise ValueError(f"config: num_key_value_heads ({t['num_key_value_heads']}) must equal "
                         f"num_attention_heads ({cfg.num_attention_heads})")
    if t.get("qk_head_dim", cfg.qk_nope_head_dim) != cfg.qk_nope_head_dim:
        raise ValueError(f"config: qk_head_dim ({t['qk_head_dim']}) must equal qk_nope_head_dim "
                         f"({cfg.qk_nope_head_dim}) without RoPE dims")
    if cfg.num_experts_per_tok > cfg.n_routed_experts:
        raise ValueError(f"config: num_experts_per_tok ({cfg.num_experts_per_tok}) exceeds "
                         f"n_routed_experts ({cfg.n_routed_experts})")
    if cfg.linear_conv_kernel < 2:
        raise ValueError(f"config: short_conv_kernel_size must be >= 2, got {cfg.linear_conv_kernel}")
    if cfg.num_nextn_predict_layers not in (0, 1):
        raise ValueError(f"config: num_nextn_predict_layers={cfg.num_nextn_predict_layers} "
                         "is not supported (0 or 1)")
    indexer_types = t.get("indexer_types")
    if indexer_types is not None:
        if len(indexer_types) != cfg.num_hidden_layers:
            raise ValueError(f"config: indexer_types has {len(indexer_types)} entries, "
                             f"num_hidden_layers is {cfg.num_hidden_layers}")
        if any(x != "full" for x in indexer_types):
            raise ValueError("config: indexer_types other than 'full' (shared top-k) are not supported")


# ---------------------------------------------------------------------------------------------
# Batch in, results out (DESIGN.md)
# ---------------------------------------------------------------------------------------------

@dataclass
class SeqChunk:
    """The n new tokens of one sequence at positions start .. start+n-1.

    block_table[i] is the cache block holding positions i*block_size .. (i+1)*block_size-1;
    slot indexes the KDA state. start == 0 begins a fresh sequence (its slot state is reset).
    snapshots: block boundaries p inside the chunk (start < p < start+n, p a multiple of the block
    size) at which the forward also returns the sequence's KDA rows as they are after position p-1
    (ForwardOutput.snapshots), for the prefix cache: the KDA pieces end there anyway (_kda_segments),
    so this costs a copy, where cutting the chunk there would cost another pass over the weights.
    images: (row in the chunk, rows [n, hidden]) pairs: the input of those n rows is the vision tower's rows for
    an image (vision.py), not their <|image|> tokens' embedding (transformers' masked_scatter of image features).
    """
    tokens: torch.Tensor
    start: int
    block_table: torch.Tensor
    slot: int
    snapshots: tuple[int, ...] = ()
    images: tuple[tuple[int, torch.Tensor], ...] = ()


def chunk_images(placed, lo: int, hi: int) -> tuple[tuple[int, torch.Tensor], ...]:
    """SeqChunk.images of a chunk whose rows are positions lo..hi-1, from images placed at positions
    ((first position, rows), ...): each one's rows inside the chunk, at its row there."""
    return tuple((max(pos, lo) - lo, rows[max(pos, lo) - pos:min(pos + len(rows), hi) - pos])
                 for pos, rows in placed if pos < hi and pos + len(rows) > lo)


@dataclass
class KDASnapshot:
    """A sequence's KDA rows after a position: per KDA layer, in cache row order (CachePool.kda_index),
    its state [H, d_k, d_v] fp32 and its conv window [3, K-1, H*d] in the cache's dtype."""
    kda_state: list[torch.Tensor | None]
    conv_state: list[torch.Tensor | None]

    @classmethod
    def empty(cls, layers: int) -> "KDASnapshot":
        return cls([None] * layers, [None] * layers)


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # fp32 [len(batch), vocab], [sum n, vocab] with all_logits, or the logit_rows
    hidden: torch.Tensor  # final-norm output of the same rows ([sum n, D] every row with logit_rows)
    # [sum n, len(taps) * D]: the streams' mean after each tapped layer (DFlash2 §2.4), or None
    taps: torch.Tensor | None = None
    # KDA layer -> its input x at kda_input_rows (replayed by speculative decoding's rollback)
    kda_inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    # (chunk index, position) -> the KDA rows after position - 1, for each of the chunks' `snapshots`
    snapshots: dict[tuple[int, int], KDASnapshot] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------

def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Makes a CUDA device current: Triton kernels (EXL3, FP8) launch on the current device, not on
    their tensors' device, so each layer's work runs under its own device."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """x W^T for a dense [out, in] weight; a quantized weight (EXL3Linear) computes it itself."""
    if isinstance(w, torch.Tensor):
        return F.linear(x.to(w.dtype), w)
    return w(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """§4.3.3: the epsilon sits inside the square root (not F.normalize)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """§4.5 clamped SwiGLU: the gate is clamped from above only, up on both sides."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


# §4.2 mHC -----------------------------------------------------------------------------------

def sinkhorn(Cl: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Softmax over j, then alternate normalizations starting (and ending) with the columns."""
    C = torch.softmax(Cl, dim=-1) + eps
    C = C / (C.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        C = C / (C.sum(-1, keepdim=True) + eps)
        C = C / (C.sum(-2, keepdim=True) + eps)
    return C


def hc_pre(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
           cfg: GLMConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """§4.2 steps 1-4 for streams X [N, hc, D]: returns the collapsed input u, post and C."""
    hc = cfg.hc_mult
    x = X.flatten(1).float()
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
    m = F.linear(x, fn.float()) * r
    base, scale = base.float(), scale.float()
    pre = torch.sigmoid(scale[0] * m[:, :hc] + base[:hc]) + cfg.hc_eps
    post = 2 * torch.sigmoid(scale[1] * m[:, hc:2 * hc] + base[hc:2 * hc])
    Cl = (scale[2] * m[:, 2 * hc:] + base[2 * hc:]).view(-1, hc, hc)
    C = sinkhorn(Cl, cfg.hc_sinkhorn_iters, cfg.hc_eps)
    u = (pre[:, :, None] * X.float()).sum(1).to(X.dtype)
    return u, post, C


def hc_post(X: torch.Tensor, y: torch.Tensor, post: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    """§4.2 step 5: X'_j = post_j y + Σ_i C[i, j] X_i (destination j sums over source i)."""
    mixed = torch.einsum("nij,nid->njd", C, X.float())
    return (post[:, :, None] * y.float()[:, None, :] + mixed).to(X.dtype)


# §4.3 KDA -----------------------------------------------------------------------------------

def short_conv(window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU. window [K-1+n, C] holds K-1 history rows then the n new ones;
    weight [C, 1, K], tap K-1 multiplies the current token. Runs in fp32."""
    K = weight.shape[-1]
    n, w = window.shape[0] - (K - 1), weight.float().reshape(-1, K)
    return F.silu(sum(window[k:k + n].float() * w[:, k] for k in range(K))).to(window.dtype)


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float,
             H: int, d: int) -> torch.Tensor:
    """§4.3.4: g = lower_bound · σ(exp(A_log) (f + dt_bias)), fp32, [n, H, d]."""
    a = torch.exp(A_log.float()).view(H, 1)
    return lower_bound * torch.sigmoid(a * (f.float().view(-1, H, d) + dt_bias.float().view(H, d)))


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """§4.3.6, one token at a time. q, k, v, g [n, H, d] (q, k normalized, q scaled), beta [n, H],
    S [H, d_k, d_v]; all fp32. Returns the outputs [n, H, d_v] and the final state."""
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        S = S * torch.exp(g[t])[:, :, None]  # decay the key rows first
        p = torch.einsum("hij,hi->hj", S, k[t])
        delta = beta[t][:, None] * (v[t] - p)
        S = S + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hij,hi->hj", S, q[t])  # read the updated state
    return out, S


def kda_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """§4.3.7, the WY form of kda_recurrent for one chunk (same arguments, n <= 64)."""
    Q, K, V, G = (x.transpose(0, 1) for x in (q, k, v, g))  # heads first: [H, c, d]
    c = Q.shape[1]
    Gam = G.cumsum(1)
    Kb, Vb = K * beta.T[:, :, None], V * beta.T[:, :, None]
    causal = torch.ones(c, c, dtype=torch.bool, device=Q.device).tril()
    strict = causal.tril(-1)
    # D[h, r, s, i] = exp(Γ_r[i] - Γ_s[i]) for s <= r; masked before exp so it cannot overflow
    D = (Gam[:, :, None, :] - Gam[:, None, :, :]).masked_fill(~causal[None, :, :, None], -math.inf).exp()
    A = -torch.einsum("hri,hsi,hrsi->hrs", Kb, K, D) * strict
    eye = torch.eye(c, dtype=Q.dtype, device=Q.device)
    Tm = torch.linalg.solve_triangular(eye - A, eye.expand_as(A), upper=False, unitriangular=True)
    U = Tm @ Vb
    W = Tm @ (Kb * Gam.exp())
    U = U - W @ S
    O = (Q * Gam.exp()) @ S + (torch.einsum("hri,hsi,hrsi->hrs", Q, K, D) * causal) @ U
    last = Gam[:, -1:, :]
    S = torch.exp(last).transpose(1, 2) * S + (K * torch.exp(last - Gam)).transpose(1, 2) @ U
    return O.transpose(0, 1), S


# §4.4 DSA -----------------------------------------------------------------------------------

def pool_keys(k_idx: torch.Tensor, gamma: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """K_p[i] = Σ_r softmax_r(γ_{4p+r}[i] + ape[r, i]) k^I_{4p+r}[i] for complete pools.
    k_idx, gamma [P·kpool, d] -> [P, d]."""
    kpool, d = ape.shape
    weights = torch.softmax(gamma.float().view(-1, kpool, d) + ape.float(), dim=1)
    return (weights * k_idx.float().view(-1, kpool, d)).sum(1).to(k_idx.dtype)


def select_tokens(q_idx: torch.Tensor, w: torch.Tensor, pooled: torch.Tensor, positions: torch.Tensor,
                  cfg: GLMConfig) -> torch.Tensor:
    """The indexer's choice: for each query a boolean mask over key positions 0..T-1.

    q_idx [n, heads, d] and w [n, heads] (already / √heads) per query; pooled [P, d] the complete
    pools; positions [n] the queries' positions; T = positions[-1] + 1.
    """
    kpool = cfg.index_kpool
    T, P = int(positions[-1]) + 1, pooled.shape[0]
    n_candidates = (positions + 1) // kpool  # complete pools whose last token is <= t
    dots = torch.einsum("nhd,pd->nhp", q_idx.float(), pooled.float()) / math.sqrt(q_idx.shape[-1])
    score = torch.einsum("nh,nhp->np", w.float(), F.relu(dots))
    candidate = torch.arange(P, device=score.device)[None, :] < n_candidates[:, None]
    # Ties go to the lower pool index: a stable descending sort keeps index order among equals.
    order = torch.sort(score.masked_fill(~candidate, -math.inf), dim=1, descending=True, stable=True).indices
    chosen = order[:, :min(cfg.index_topk // kpool, P)]
    pool_mask = torch.zeros_like(candidate)
    pool_mask.scatter_(1, chosen, candidate.gather(1, chosen))
    key_pos = torch.arange(T, device=score.device)[None, :]
    mask = F.pad(pool_mask.repeat_interleave(kpool, dim=1), (0, T - P * kpool))
    if cfg.index_kpool_always_select_tail:
        tail = (key_pos >= (n_candidates * kpool)[:, None]) & (key_pos <= positions[:, None])
        mask = mask | tail
    return mask


def mla_attention(q: torch.Tensor, latent: torch.Tensor, kv_b: torch.Tensor, mask: torch.Tensor,
                  cfg: GLMConfig) -> torch.Tensor:
    """NoPE MLA in the absorbed form over the selected keys. q [n, H, d_nope], latent [T, R],
    kv_b [H·(d_nope + d_v), R], mask [n, T]. Returns [n, H·d_v]."""
    H, dn = cfg.num_attention_heads, cfg.qk_nope_head_dim
    W = kv_b.float().view(H, dn + cfg.v_head_dim, cfg.kv_lora_rank)
    W_UK, W_UV = W[:, :dn], W[:, dn:]
    q_hat = torch.einsum("nhd,hdr->nhr", q.float(), W_UK)
    s = torch.einsum("nhr,tr->nht", q_hat, latent.float()) / math.sqrt(dn)
    p = torch.softmax(s.masked_fill(~mask[:, None, :], -math.inf), dim=-1)
    o = torch.einsum("nht,tr->nhr", p, latent.float())
    return torch.einsum("nhr,hvr->nhv", o, W_UV).flatten(1).to(q.dtype)


def write_dsa_rows(cache: CachePool, row: int, chunk: SeqChunk, c: torch.Tensor, k_idx: torch.Tensor,
                   gamma: torch.Tensor, ape: torch.Tensor, kpool: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache side of §4.4 for one chunk of n tokens: their latent rows, the pooled key of every pool
    the chunk completes (older pools are cached), and the indexer-key and gate rows of its last
    positions in the slot's tail ring (cache.TAIL_RING), where the next chunk finds the members of a pool
    this one leaves open. Returns the chunk's whole context: pooled keys [T // kpool, d] and latents
    [T, R], T = chunk.start + n."""
    bs, ring, device = cache.block_size, cache.index_k.shape[2], c.device
    T = chunk.start + c.shape[0]
    positions = torch.arange(chunk.start, T, device=device)
    blocks = chunk.block_table.to(device)
    cache.latent[row, blocks[positions // bs], positions % bs] = c.to(cache.latent.dtype)
    k_new, g_new = k_idx.to(cache.index_k.dtype), gamma.to(cache.gate.dtype)
    first_new, n_pools = chunk.start // kpool, T // kpool
    if n_pools > first_new:  # members before the chunk come from the ring (read before this chunk writes it)
        held = torch.arange(first_new * kpool, chunk.start, device=device) % ring
        span = n_pools * kpool - chunk.start
        k_hist = torch.cat([cache.index_k[row, chunk.slot, held], k_new[:span]])
        g_hist = torch.cat([cache.gate[row, chunk.slot, held], g_new[:span]])
        pool_pos = torch.arange(first_new, n_pools, device=device) * kpool
        cache.pooled[row, blocks[pool_pos // bs], (pool_pos % bs) // kpool] = \
            pool_keys(k_hist, g_hist, ape).to(cache.pooled.dtype)
    last = positions[-ring:] % ring
    cache.index_k[row, chunk.slot, last] = k_new[-ring:]
    cache.gate[row, chunk.slot, last] = g_new[-ring:]
    used = blocks[:(T + bs - 1) // bs]
    return cache.pooled[row, used].flatten(0, 1)[:n_pools], cache.latent[row, used].flatten(0, 1)[:T]


# §4.5 feed-forward ----------------------------------------------------------------------------

def route(h: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor,
          cfg: GLMConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 sigmoid router; the correction bias only chooses. Returns (expert ids, weights) [N, k]."""
    return route_logits(F.linear(h.float(), gate_w.float()), bias, cfg)


def route_logits(logits: torch.Tensor, bias: torch.Tensor, cfg: GLMConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` from the fp32 router logits h · gate_wᵀ [N, E]."""
    s = torch.sigmoid(logits)
    experts = torch.topk(s + bias.float(), cfg.num_experts_per_tok, dim=-1).indices
    w = s.gather(1, experts)
    if cfg.norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return experts, w * cfg.routed_scaling_factor


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------

def place_images(X: torch.Tensor, batch: list[SeqChunk], spans: list[tuple[int, int]]) -> torch.Tensor:
    """The streams X [T, hc_mult, hidden] of the batch's embedded tokens with each chunk's image rows in place of
    their placeholder tokens' embedding, in every stream."""
    for c, (a, _) in zip(batch, spans):
        for r, rows in c.images:
            X[a + r:a + r + len(rows)] = rows.to(X.device, X.dtype)[:, None, :]
    return X


class GLMModel:
    """GLM-5.3-Flash text model over a weight dict (DESIGN.md: checkpoint names without the
    `model.language_model.` prefix; each linear weight a Tensor [out, in] or an EXL3Linear).

    `placement` says which device holds each layer (and, with the expert split, each routed
    expert); the weights must already be there (checkpoint.load_weights with the placement's
    device_of). None: everything on the embedding's device. The streams X move to each layer's
    device; logits, `hidden`, taps and KDA inputs come back on the first device."""

    def __init__(self, config: GLMConfig, weights: dict[str, Weight], placement: Placement | None = None):
        self.config = config
        self.weights = weights
        _check_weights(config, weights)
        self.dtype = weights["embed_tokens.weight"].dtype
        self.placement = placement or placement_mod.plan(config, placement_mod.sizes_of(weights),
                                                         [weights["embed_tokens.weight"].device])
        _check_devices(self.placement, weights)

    @property
    def has_mtp(self) -> bool:
        """The config has the MTP layer (its weights are then required, see _check_weights)."""
        return self.config.mtp_layer is not None

    def w(self, name: str) -> Weight:
        try:
            return self.weights[name]
        except KeyError:
            raise ValueError(f"missing weight {name!r}") from None

    # -- whole model (§4.1) ------------------------------------------------------------------

    def forward(self, batch: list[SeqChunk], cache: CachePool, all_logits: bool = False, *,
                logit_rows: list[int] | None = None, taps: tuple[int, ...] = (),
                kda_input_rows: list[int] = ()) -> ForwardOutput:
        """Runs the chunks through the trunk. Logits of the last row of each chunk, of every row
        (all_logits), or of `logit_rows` (rows of the flattened batch; `hidden` then holds every
        row). `taps` and `kda_input_rows` serve speculative decoding (dflash.py). Records autograd
        when the weights require grad: inference callers run it under torch.no_grad()."""
        cfg = self.config
        spans = self._check_batch(batch, cache)
        tokens = torch.cat([c.tokens for c in batch]).to(self.w("embed_tokens.weight").device)
        self._check_taps(taps)
        record = _as_index(list(kda_input_rows), tokens.device) if len(kda_input_rows) else None
        tapped, kda_inputs = {}, {}
        snapshots = {(i, p): KDASnapshot.empty(len(cfg.kda_layers)) for i, c in enumerate(batch) for p in c.snapshots}

        X = place_images(self.w("embed_tokens.weight")[tokens][:, None, :].repeat(1, cfg.hc_mult, 1), batch, spans)
        first = X.device
        for L in range(cfg.num_hidden_layers):
            p = f"layers.{L}."
            device = self.placement.device(L)
            X = X.to(device)
            with on_device(device):
                u, post, C = hc_pre(X, self.w(p + "hc_attn_fn"), self.w(p + "hc_attn_base"),
                                    self.w(p + "hc_attn_scale"), cfg)
                x = rms_norm(u, self.w(p + "input_layernorm.weight"), cfg.rms_norm_eps)
                if cfg.layer_types[L] == "kda":
                    if record is not None:
                        rows = record if isinstance(record, slice) else record.to(device)
                        kda_inputs[L] = x[rows].to(first)
                    y = self.kda(L, x, batch, spans, cache, snapshots)
                else:
                    y = self.dsa(L, x, batch, spans, cache)
                X = hc_post(X, y, post, C)

                u, post, C = hc_pre(X, self.w(p + "hc_ffn_fn"), self.w(p + "hc_ffn_base"),
                                    self.w(p + "hc_ffn_scale"), cfg)
                h = rms_norm(u, self.w(p + "post_attention_layernorm.weight"), cfg.rms_norm_eps)
                y = self.mlp(p + "mlp.", h) if cfg.mlp_layer_types[L] == "dense" else self.moe(p + "mlp.", h)
                X = hc_post(X, y, post, C)
                if L in taps:  # DFlash2 §2.4: mean of the streams after the layer, fp32 in stream order
                    tapped[L] = (X.float().sum(1) * (1 / cfg.hc_mult)).to(X.dtype).to(first)

        X = X.to(first)
        with on_device(first):
            if logit_rows is not None:
                h = rms_norm(X.float().mean(1).to(X.dtype), self.w("norm.weight"), cfg.rms_norm_eps)
                logits = self.head(h[logit_rows])
            else:
                rows = slice(None) if all_logits else torch.tensor([b - 1 for _, b in spans])
                h = rms_norm(X[rows].float().mean(1).to(X.dtype), self.w("norm.weight"), cfg.rms_norm_eps)
                logits = self.head(h)
        tap_rows = torch.cat([tapped[L] for L in taps], dim=-1) if taps else None
        return ForwardOutput(logits, h, tap_rows, kda_inputs, snapshots)

    # -- §4.3 KDA ------------------------------------------------------------------------------

    def kda(self, L: int, x: torch.Tensor, batch: list[SeqChunk], spans: list[tuple[int, int]],
            cache: CachePool, snapshots: dict[tuple[int, int], KDASnapshot] | None = None) -> torch.Tensor:
        """§4.3 for every chunk; the KDA rows at the chunks' `snapshots` go into `snapshots`."""
        cfg = self.config
        p = f"layers.{L}.self_attn."
        H, d = cfg.linear_num_heads, cfg.linear_head_dim
        device = self.placement.device(L)
        x = x.to(device)  # speculative rollback replays inputs kept on the first device
        with on_device(device):
            pre_conv = [linear(x, self.w(p + f"{n}_proj.weight")) for n in "qkv"]  # q̃, k̃, ṽ
            f = linear(linear(x, self.w(p + "f_a_proj.weight")), self.w(p + "f_b_proj.weight"))
            o_g = linear(linear(x, self.w(p + "g_a_proj.weight")), self.w(p + "g_b_proj.weight"))
            g = kda_gate(f, self.w(p + "A_log"), self.w(p + "dt_bias"), cfg.linear_lower_bound, H, d)
            beta = torch.sigmoid(linear(x, self.w(p + "b_proj.weight")).float())
            conv_w = [self.w(p + f"{n}_conv1d.weight") for n in "qkv"]

            row = cache.kda_index(L)
            out = torch.empty(x.shape[0], H, d, dtype=torch.float32, device=x.device)
            for group in _kda_groups(batch, spans, cache.block_size):
                rows = _as_index([r for i in group for r in range(*spans[i])], x.device)
                wanted = ([{pos: snapshots[(i, pos)] for pos in batch[i].snapshots} for i in group]
                          if snapshots else None)
                out[rows] = self._kda_side_by_side(row, [batch[i] for i in group], [t[rows] for t in pre_conv],
                                                   g[rows], beta[rows], conv_w, cache, wanted)

            o = rms_norm(out, self.w(p + "o_norm.weight").float(), cfg.rms_norm_eps)
            o = o * torch.sigmoid(o_g.float().view(-1, H, d))
            return linear(o.flatten(1).to(x.dtype), self.w(p + "o_proj.weight"))

    def _kda_side_by_side(self, row: int, chunks: list[SeqChunk], pre_conv: list[torch.Tensor],
                          g: torch.Tensor, beta: torch.Tensor, conv_w: list[Weight],
                          cache: CachePool, wanted: list[dict[int, KDASnapshot]] | None = None) -> torch.Tensor:
        """§4.3 for B chunks of n tokens whose KDA segments line up (see _kda_groups): the equations
        are per head, so the sequences go side by side on the head axis (the depthwise conv on the
        channel axis) and one pass serves them all; B = 1 is the plain per-sequence case. Rows in
        (chunk, token) order; returns o [B*n, H, d] before the output norm. wanted[b]: position ->
        the snapshot whose row `row` gets chunk b's state and conv window after that position - 1."""
        cfg = self.config
        H, d, K = cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel
        B, n = len(chunks), g.shape[0] // len(chunks)
        fresh = [c.slot for c in chunks if c.start == 0]
        if fresh:
            cache.conv_state[row, _as_index(fresh, g.device)] = 0
            cache.kda_state[row, _as_index(fresh, g.device)] = 0
        slots = _as_index([c.slot for c in chunks], g.device)

        def side_by_side(t: torch.Tensor) -> torch.Tensor:  # [B*n, H, ...] -> [n, B*H, ...]
            return t.view(B, n, H, *t.shape[2:]).transpose(0, 1).reshape(n, B * H, *t.shape[2:])

        history = cache.conv_state[row, slots]  # [B, 3, K-1, H*d]
        windows = [torch.cat([history[:, j], pre_conv[j].view(B, n, H * d).to(history.dtype)], dim=1)
                   for j in range(3)]  # [B, K-1+n, H*d]
        q, k, v = (short_conv(windows[j].transpose(0, 1).reshape(K - 1 + n, B * H * d),
                              conv_w[j].repeat(B, 1, 1)).float().view(n, B * H, d) for j in range(3))
        q = l2_norm(q) * d ** -0.5
        k = l2_norm(k)
        g, beta = side_by_side(g), side_by_side(beta)
        S = cache.kda_state[row, slots].flatten(0, 1).clone()  # [B*H, d, d]; autograd may keep it
        seg_out = []
        start = chunks[0].start
        for s0, s1 in _kda_segments(start, n, cache.block_size):
            r0, r1 = s0 - start, s1 - start
            step = kda_recurrent if s1 - s0 == 1 else kda_chunk
            o, S = step(q[r0:r1], k[r0:r1], v[r0:r1], g[r0:r1], beta[r0:r1], S)
            seg_out.append(o)
            for b, want in enumerate(wanted or ()):
                pos = chunks[b].start + r1  # (a group's chunks may start apart)
                if pos in want:  # the conv window's rows r1 .. r1+K-2 are positions pos-K+1 .. pos-1
                    want[pos].kda_state[row] = S.reshape(B, H, d, d)[b].detach().clone()
                    want[pos].conv_state[row] = torch.stack([w[b, r1:r1 + K - 1] for w in windows]).detach()
        # The pool keeps values, not autograd history (training runs a batch in one forward): a graph
        # through the pool would copy all of it at every write during backward.
        cache.kda_state[row, slots] = S.detach().reshape(B, H, d, d)
        cache.conv_state[row, slots] = torch.stack([w[:, -(K - 1):] for w in windows], dim=1).detach()
        return torch.cat(seg_out).view(n, B, H, d).transpose(0, 1).reshape(B * n, H, d)

    # -- §4.4 DSA ------------------------------------------------------------------------------

    def dsa(self, L: int, x: torch.Tensor, batch: list[SeqChunk], spans: list[tuple[int, int]],
            cache: CachePool) -> torch.Tensor:
        cfg = self.config
        p = f"layers.{L}.self_attn."
        pi = p + "indexer."
        eps = cfg.rms_norm_eps
        q_r = rms_norm(linear(x, self.w(p + "q_a_proj.weight")), self.w(p + "q_a_layernorm.weight"), eps)
        q = linear(q_r, self.w(p + "q_b_proj.weight")).view(-1, cfg.num_attention_heads, cfg.qk_nope_head_dim)
        c = rms_norm(linear(x, self.w(p + "kv_a_proj_with_mqa.weight")), self.w(p + "kv_a_layernorm.weight"), eps)
        q_idx = linear(q_r, self.w(pi + "wq_b.weight")).view(-1, cfg.index_n_heads, cfg.index_head_dim)
        k_idx = F.layer_norm(linear(x, self.w(pi + "wk.weight")), (cfg.index_head_dim,),
                             self.w(pi + "k_norm.weight"), self.w(pi + "k_norm.bias"), eps=1e-6)
        gamma = linear(x, self.w(pi + "index_kpool_compress_gate"))
        w_idx = F.linear(x.float(), self.w(pi + "weights_proj.weight").float()) / math.sqrt(cfg.index_n_heads)
        kv_b = self.w(p + "kv_b_proj.weight").float()  # once per layer, not per sequence
        ape = self.w(pi + "index_kpool_compress_ape")

        row = cache.dsa_index(L)
        kpool = cfg.index_kpool
        out = []
        for chunk, (a, b) in zip(batch, spans):
            T = chunk.start + (b - a)
            positions = torch.arange(chunk.start, T, device=x.device)
            pooled, latent = write_dsa_rows(cache, row, chunk, c[a:b], k_idx[a:b], gamma[a:b], ape, kpool)
            # Queries go in groups small enough that the [rows, heads, keys] scores stay bounded.
            group = max(1, SCORE_BUDGET // (max(cfg.num_attention_heads, cfg.index_n_heads) * T))
            for r0 in range(a, b, group):
                r1 = min(r0 + group, b)
                pos = positions[r0 - a:r1 - a]
                seen = int(pos[-1]) + 1
                mask = select_tokens(q_idx[r0:r1], w_idx[r0:r1], pooled[:seen // kpool], pos, cfg)
                out.append(mla_attention(q[r0:r1], latent[:seen], kv_b, mask, cfg))
        return linear(torch.cat(out).to(x.dtype), self.w(p + "o_proj.weight"))

    # -- §4.5 feed-forward ------------------------------------------------------------------------

    def mlp(self, p: str, h: torch.Tensor) -> torch.Tensor:
        gate = linear(h, self.w(p + "gate_proj.weight"))
        up = linear(h, self.w(p + "up_proj.weight"))
        return linear(swiglu(gate, up, self.config.swiglu_limit), self.w(p + "down_proj.weight"))

    def moe(self, p: str, h: torch.Tensor) -> torch.Tensor:
        """`p` = "layers.L.mlp.": the routed experts and the shared expert."""
        experts, weights = route(h, self.w(p + "gate.weight"), self.w(p + "gate.e_score_correction_bias"),
                                 self.config)
        return (self.routed_experts(p, h, experts, weights) + self.mlp(p + "shared_experts.", h).float()).to(h.dtype)

    def routed_experts(self, p: str, h: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Σ_j weights[t, j] · expert_{experts[t, j]}(h_t), fp32 [N, D]. Each device of the placement's
        expert groups sums its own selected experts; the partial sums are added on h's device."""
        selected = experts.unique().tolist()
        out = None
        for device, ids in self.placement.expert_groups(int(p.split(".")[1])):
            mine = [e for e in selected if e in ids]
            if not mine:
                continue
            hd, ed, wd = h.to(device), experts.to(device), weights.to(device)
            partial = torch.zeros(h.shape, dtype=torch.float32, device=device)
            with on_device(device):
                for e in mine:
                    tok, k = (ed == e).nonzero(as_tuple=True)
                    y = self.mlp(p + f"experts.{e}.", hd[tok])
                    partial.index_add_(0, tok, y.float() * wd[tok, k, None])
            out = partial.to(h.device) if out is None else out + partial.to(h.device)
        return out

    # -- §4.7 MTP --------------------------------------------------------------------------------

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits of final-norm rows h (§4.1: logits = lm_head(h))."""
        with on_device(h.device):
            return linear(h, self.w("lm_head.weight")).float()

    def mtp_forward(self, hidden: torch.Tensor, batch: list[SeqChunk], cache: CachePool,
                    all_logits: bool = False) -> ForwardOutput:
        """One MTP step. hidden [sum n, D]: the trunk's final-norm output h_t for each position t of
        the chunks; batch[i].tokens: the tokens at t+1 for the same positions (chunk positions are
        those of h_t, and the MTP DSA cache row is written there), whose embedding batch[i].images'
        rows replace as in `forward` (an image's). Returns draft logits for t+2 and h' (to feed back
        as `hidden` for the next draft step)."""
        cfg = self.config
        if cfg.mtp_layer is None:
            raise ValueError("this model has no MTP layer (config num_nextn_predict_layers is 0)")
        spans = self._check_batch(batch, cache)
        if hidden.shape[0] != spans[-1][1]:
            raise ValueError(f"mtp_forward: hidden has {hidden.shape[0]} rows, batch has {spans[-1][1]} tokens")
        L, eps = cfg.mtp_layer, cfg.rms_norm_eps
        p = f"layers.{L}."
        embed = self.w("embed_tokens.weight")
        first, device = embed.device, self.placement.device(L)
        e = embed[torch.cat([c.tokens for c in batch]).to(first)].to(device)
        place_images(e[:, None, :], batch, spans)  # (in place: a one-stream view of e)
        hidden = hidden.to(device, e.dtype)
        with on_device(device):
            z = linear(torch.cat([rms_norm(e, self.w(p + "enorm.weight"), eps),
                                  rms_norm(hidden, self.w(p + "hnorm.weight"), eps)], dim=-1),
                       self.w(p + "eh_proj.weight"))
            r1 = z + self.dsa(L, rms_norm(z, self.w(p + "input_layernorm.weight"), eps), batch, spans, cache)
            r2 = r1 + self.moe(p + "mlp.", rms_norm(r1, self.w(p + "post_attention_layernorm.weight"), eps))
            rows = slice(None) if all_logits else torch.tensor([b - 1 for _, b in spans])
            h = rms_norm(r2[rows], self.w(p + "shared_head.norm.weight"), eps).to(first)
        return ForwardOutput(self.head(h), h)

    # -- checks ------------------------------------------------------------------------------------

    def _check_taps(self, taps: tuple[int, ...]) -> None:
        n = self.config.num_hidden_layers
        bad = [L for L in taps if not 0 <= L < n]
        if bad:
            raise ValueError(f"forward: taps {bad} are not trunk layers 0..{n - 1}")

    def _check_batch(self, batch: list[SeqChunk], cache: CachePool) -> list[tuple[int, int]]:
        """Validates the chunks; returns each chunk's row span in the flattened token axis."""
        if not batch:
            raise ValueError("forward: empty batch")
        if cache.config != self.config:
            raise ValueError("forward: the CachePool was built for a different config")
        spans, row, slots = [], 0, set()
        for i, c in enumerate(batch):
            n = c.tokens.shape[0] if c.tokens.dim() == 1 else -1
            if n < 1:
                raise ValueError(f"batch[{i}].tokens must be a non-empty 1-D tensor, got shape "
                                 f"{tuple(c.tokens.shape)}")
            if c.start < 0:
                raise ValueError(f"batch[{i}].start={c.start} is negative")
            if not 0 <= c.slot < cache.num_slots:
                raise ValueError(f"batch[{i}].slot={c.slot} is outside 0..{cache.num_slots - 1}")
            if c.slot in slots:
                raise ValueError(f"batch[{i}].slot={c.slot} is used twice in one batch")
            slots.add(c.slot)
            need = (c.start + n + cache.block_size - 1) // cache.block_size
            if c.block_table.shape[0] < need:
                raise ValueError(f"batch[{i}].block_table has {c.block_table.shape[0]} blocks, "
                                 f"positions up to {c.start + n - 1} need {need}")
            if int(c.tokens.min()) < 0 or int(c.tokens.max()) >= self.config.vocab_size:
                raise ValueError(f"batch[{i}].tokens hold ids outside 0..{self.config.vocab_size - 1}")
            for r, rows in c.images:
                if not (0 <= r and r + len(rows) <= n and rows.dim() == 2 and rows.shape[1] == self.config.hidden_size):
                    raise ValueError(f"batch[{i}].images: rows {tuple(rows.shape)} at row {r} do not fit a chunk of "
                                     f"{n} rows of hidden size {self.config.hidden_size}")
            bad = [p for p in c.snapshots if not (c.start < p < c.start + n and p % cache.block_size == 0)]
            if bad:
                raise ValueError(f"batch[{i}].snapshots {bad}: each must be a multiple of the block size "
                                 f"{cache.block_size} strictly inside positions {c.start}..{c.start + n - 1}")
            spans.append((row, row + n))
            row += n
        return spans


def _kda_segments(start: int, n: int, block_size: int) -> list[tuple[int, int]]:
    """Cuts positions start..start+n-1 into pieces that never cross a multiple of the KDA chunk or of
    the cache block size: chunking follows absolute positions, so a prefill split at any point, or
    stopped at a block end, does the same arithmetic as one piece."""
    cuts, pos, end = [], start, start + n
    while pos < end:
        nxt = min(end, (pos // KDA_CHUNK + 1) * KDA_CHUNK, (pos // block_size + 1) * block_size)
        cuts.append((pos, nxt))
        pos = nxt
    return cuts


def _kda_groups(batch: list[SeqChunk], spans: list[tuple[int, int]], block_size: int) -> list[list[int]]:
    """Chunk indices grouped by their KDA segments relative to their start (equal start and length,
    or single-token decode steps anywhere): a group runs side by side in one pass."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (c, (a, b)) in enumerate(zip(batch, spans)):
        key = tuple(s1 - s0 for s0, s1 in _kda_segments(c.start, b - a, block_size))
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def _as_index(values: list[int], device: torch.device) -> slice | torch.Tensor:
    """A run of consecutive ints as a slice (no host-to-device copy, a view), else an index tensor."""
    if values == list(range(values[0], values[0] + len(values))):
        return slice(values[0], values[0] + len(values))
    return torch.tensor(values, dtype=torch.long, device=device)


def _check_weights(cfg: GLMConfig, weights: dict[str, Weight]) -> None:
    """Every tensor the config implies (checkpoint.expected_tensors) is there with its shape."""
    for name, spec in checkpoint.expected_tensors(cfg).items():
        if name not in weights:
            raise ValueError(f"missing weight {name!r}")
        w = weights[name]
        got = tuple(w.shape) if isinstance(w, torch.Tensor) else (w.out_features, w.in_features)
        if got != spec.shape:
            raise ValueError(f"weight {name!r} has shape {got}, expected {spec.shape}")
    if not isinstance(weights["embed_tokens.weight"], torch.Tensor):
        raise ValueError("weight 'embed_tokens.weight' must be a tensor")


def _check_devices(placement: Placement, weights: dict[str, Weight]) -> None:
    """Every weight sits where the placement says (a copy per call would hide a loading mistake)."""
    for name, w in weights.items():
        # a tensor, an EXL3Linear (trellis) or an FP8Linear (weight)
        got = w.device if isinstance(w, torch.Tensor) else getattr(w, "trellis", getattr(w, "weight", None)).device
        want = placement.device_of(name)
        if got != want:
            raise ValueError(f"weight {name!r} is on {got}, the placement puts it on {want}")

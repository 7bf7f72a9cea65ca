"""Speculative decoding (../shared/spec/dflash2.md): the DFlash2 drafter, the native MTP drafter,
the target's verify pass, acceptance and rollback. engine.py drives them; this file holds the math.

One speculative step for a sequence whose next token (the anchor) sits at position p:
1. draft k tokens (DFlash2: one non-causal pass over [anchor, MASK x (B-1)], §2.6; MTP: k chained
   steps of layer 45, §5);
2. verify: the target runs [anchor, d1..dk] as one chunk (`target_forward`), k+1 rows of logits;
3. accept (§3.2, `accept_drafts`): greedy prefix match, or Leviathan rejection sampling against the
   engine's processed distribution; the emitted tokens are the accepted drafts plus the target's own
   token at the first rejection (or after the last draft);
4. roll back what rejected rows touched (§4). KDA uses design D of §4.2: the verify pass keeps each
   KDA layer's input rows and the engine keeps the slot's state from before the pass; after a partial
   accept the state is restored and the kept rows are re-run through `GLMModel.kda` (the same
   arithmetic as the forward; no projections of the whole layer stack, no MoE). DSA needs no undo:
   latent / indexer key / gate rows past the committed length are never read before the next chunk
   overwrites them, and the model recomputes every pool from `start // index_kpool` on when a chunk
   completes it, so a pooled key built from rejected rows is rebuilt from accepted ones before it is
   read. The engine trims the block table to the committed length. The drafters' own caches only ever
   receive committed rows (§4.3), so they need no undo either.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

import checkpoint
from cache import CachePool
from model_glm import GLMConfig, GLMModel, SeqChunk, chunk_images, linear, rms_norm

# Config fields of other DFlash2 checkpoints (§2.1.3) that the GLM drafter does not set.
_UNSUPPORTED_FIELDS = ("input_embedding_scale", "output_multiplier", "final_logit_softcapping")


# ---------------------------------------------------------------------------------------------
# The target's verify pass (glm53.md §4.1 plus the taps of dflash2.md §2.4)


@dataclass
class TargetPass:
    logits: torch.Tensor  # fp32 [len(logit_rows), vocab]
    hidden: torch.Tensor  # final-norm output of every row [rows, D] (feeds MTP)
    taps: torch.Tensor | None  # [rows, n_taps * D]: contracted residual after each tap layer
    kda_inputs: dict[int, torch.Tensor]  # KDA layer -> its input x at the recorded rows, for rollback
    recorded: list[int] = field(default_factory=list)  # those rows (of the pass), in order
    snapshots: dict = field(default_factory=dict)  # ForwardOutput.snapshots: a prefill chunk's KDA rows


def target_forward(model: GLMModel, batch: list[SeqChunk], cache: CachePool, logit_rows: list[int],
                   taps: tuple[int, ...] = (), record_rows: list[int] = (), prefill=None) -> TargetPass:
    """`GLMModel.forward` with logits at `logit_rows`, every row's hidden, the DFlash2 taps and the KDA
    layers' inputs at `record_rows` (the verify rows: a prefill chunk in the same pass is not kept).
    `prefill`: a fastprefill.FastPrefill over the same model and cache computes it instead."""
    asked = dict(logit_rows=list(logit_rows), taps=taps, kda_input_rows=list(record_rows))
    with torch.no_grad():
        out = model.forward(batch, cache, **asked) if prefill is None else prefill.forward(batch, **asked)
    return TargetPass(out.logits, out.hidden, out.taps, out.kda_inputs, list(record_rows), out.snapshots)


def save_kda_slots(cache: CachePool, slots: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The KDA state and conv window of each slot before a verify pass (S_0 of §4.2 D)."""
    return {s: (cache.kda_state[:, s].clone(), cache.conv_state[:, s].clone()) for s in slots}


def rollback_kda(model: GLMModel, cache: CachePool, verify: TargetPass, batch: list[SeqChunk],
                 kept: dict[int, int], saved: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """After partial accepts: restore the saved slots and replay the kept rows through every KDA layer.

    `kept` maps a chunk index of the verify batch to its number of kept rows (anchor + accepted
    drafts, fewer than the chunk's rows). Afterwards each slot holds the state and conv window of a
    run that only saw the kept tokens."""
    if not kept:
        return
    with torch.no_grad():
        offsets = [0]
        for c in batch:
            offsets.append(offsets[-1] + c.tokens.shape[0])
        chunks, rows, spans = [], [], []
        for i, n in kept.items():
            c = batch[i]
            state, conv = saved[c.slot]
            cache.kda_state[:, c.slot] = state
            cache.conv_state[:, c.slot] = conv
            chunks.append(SeqChunk(c.tokens[:n], c.start, c.block_table, c.slot))
            spans.append((len(rows), len(rows) + n))
            rows += range(offsets[i], offsets[i] + n)
        where = {r: j for j, r in enumerate(verify.recorded)}
        idx = torch.tensor([where[r] for r in rows], device=cache.device)
        for L in model.config.kda_layers:
            model.kda(L, verify.kda_inputs[L][idx], chunks, spans, cache)


# ---------------------------------------------------------------------------------------------
# Acceptance (§3.2)


def accept_drafts(x: torch.Tensor, drafts: list[int], q: torch.Tensor | None, greedy: bool,
                  generator: torch.Generator) -> list[int]:
    """The tokens to emit from one verify: accepted drafts, then the target's token.

    x [k+1, vocab]: the target's processed logits per verify row (row j as the engine would sample
    it after the anchor and drafts 1..j). q [k, vocab]: the probabilities the drafts were drawn
    from, or None for a deterministic draft (q one-hot). Greedy: accept while d_{j+1} = argmax x_j.
    Sampled: accept d with probability min(1, p(d)/q(d)); at the first rejection emit a sample of
    norm(max(0, p - q)); after k acceptances emit a sample of p_k. The emitted tokens are
    distributed exactly as sampling the target token by token (Leviathan et al. 2023)."""
    if greedy:
        target = x.argmax(-1).tolist()
        out = []
        for j, t in enumerate(target):
            out.append(t)
            if j == len(drafts) or drafts[j] != t:
                return out
    p = torch.softmax(x.float(), -1)
    out = []
    for j, d in enumerate(drafts):
        q_d = 1.0 if q is None else float(q[j, d])
        if float(torch.rand((), generator=generator, device=p.device)) * q_d < float(p[j, d]):
            out.append(d)
            continue
        residual = p[j].clone()
        if q is None:
            residual[d] = 0
        else:
            residual = (residual - q[j].to(residual)).clamp(min=0)
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p[-1], 1, generator=generator)))
    return out


# ---------------------------------------------------------------------------------------------
# Draft length (§3.2 "which draft positions to verify", §7.3)


DECAY = 15 / 16  # about the last 16 outcomes count (CuteAFD keeps 16)


@dataclass
class DraftStats:
    """Per request: decayed per-position acceptance counts (policy) and plain totals (reporting)."""
    tried: list[float]
    accepted: list[float]
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @classmethod
    def new(cls, max_draft: int) -> "DraftStats":
        return cls([0.0] * max_draft, [0.0] * max_draft)

    def record(self, k: int, acc: int) -> None:
        """k drafts verified, the first acc accepted (draft acc+1 rejected if acc < k)."""
        self.tried = [t * DECAY for t in self.tried]
        self.accepted = [a * DECAY for a in self.accepted]
        for i in range(min(acc + 1, k)):
            self.tried[i] += 1
            self.accepted[i] += i < acc
        self.verify_steps += 1
        self.draft_tokens += k
        self.accepted_tokens += acc


def draft_length(stats: DraftStats, row_cost: float, fixed: int | None) -> int:
    """Verify draft i while P(drafts 1..i all accepted) >= row_cost, the cost of one more verify row
    relative to a plain decode step; conditional acceptance per position has a 3-in-4 prior. At least
    one draft is verified so that the statistics keep moving."""
    if fixed is not None:
        return fixed
    k, chain = 0, 1.0
    for tried, accepted in zip(stats.tried, stats.accepted):
        chain *= (accepted + 3) / (tried + 4)
        if chain < row_cost:
            break
        k += 1
    return max(k, 1)


# ---------------------------------------------------------------------------------------------
# What the engine hands a drafter


@dataclass
class DraftRequest:
    key: str  # request id
    token_ids: list[int]  # prompt and output; the last one is the anchor
    position: int  # the anchor's position (= tokens whose cache entries exist)
    k: int  # drafts wanted
    block_table: torch.Tensor  # covers positions up to position + k
    slot: int
    temperature: float  # 0: deterministic draft
    generator: torch.Generator


@dataclass
class Draft:
    tokens: list[int]
    q: torch.Tensor | None  # [k, vocab] draw probabilities, None when deterministic


# ---------------------------------------------------------------------------------------------
# DFlash2 configuration and checkpoint (§2.2, §2.3)


@dataclass(frozen=True)
class DFlash2Config:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    windows: tuple[int | None, ...]  # per layer: sliding window, or None for full attention
    num_target_layers: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int

    @classmethod
    def from_file(cls, path: str | Path) -> "DFlash2Config":
        path = Path(path)
        return cls.from_dict(json.loads((path / "config.json" if path.is_dir() else path).read_text()))

    @classmethod
    def from_dict(cls, d: dict) -> "DFlash2Config":
        def need(where: dict, name: str, prefix: str = "") -> Any:
            if where.get(name) is None:
                raise ValueError(f"drafter config: missing field '{prefix}{name}'")
            return where[name]

        arch = d.get("architectures") or []
        if "DFlash2DraftModel" not in arch:
            raise ValueError(f"drafter config: architectures={arch!r}; only DFlash2DraftModel is supported "
                             f"(DFlashDraftModel v1 has no conv/selector)")
        for name in _UNSUPPORTED_FIELDS:
            if d.get(name) is not None:
                raise ValueError(f"drafter config: {name}={d[name]!r} is not supported")
        if d.get("is_causal", False):
            raise ValueError("drafter config: is_causal=true is not a DFlash drafter (block rows are non-causal)")
        dc = need(d, "dflash_config")
        n_layers, n_target = need(d, "num_hidden_layers"), need(d, "num_target_layers")
        layer_types = d.get("layer_types") or ["full_attention"] * n_layers
        if len(layer_types) != n_layers:
            raise ValueError(f"drafter config: layer_types has {len(layer_types)} entries, "
                             f"num_hidden_layers is {n_layers}")
        windows = []
        for i, t in enumerate(layer_types):
            if t not in ("sliding_attention", "full_attention"):
                raise ValueError(f"drafter config: layer_types[{i}]={t!r} is not sliding_attention/full_attention")
            windows.append(need(d, "sliding_window") if t == "sliding_attention" else None)
        rope = d.get("rope_parameters") or {"rope_type": "default", "rope_theta": d.get("rope_theta")}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"drafter config: rope_type={rope['rope_type']!r} is not supported (only default)")
        taps = dc.get("target_layer_ids") or build_target_layer_ids(n_target, n_layers)
        cfg = cls(hidden_size=need(d, "hidden_size"), intermediate_size=need(d, "intermediate_size"),
                  num_hidden_layers=n_layers, num_attention_heads=need(d, "num_attention_heads"),
                  num_key_value_heads=need(d, "num_key_value_heads"), head_dim=need(d, "head_dim"),
                  vocab_size=need(d, "vocab_size"), rms_norm_eps=float(need(d, "rms_norm_eps")),
                  rope_theta=float(need(rope, "rope_theta", "rope_parameters.")), windows=tuple(windows),
                  num_target_layers=n_target, block_size=need(dc, "block_size", "dflash_config."),
                  mask_token_id=need(dc, "mask_token_id", "dflash_config."), target_layer_ids=tuple(taps),
                  conv_kernel_size=need(dc, "conv_kernel_size", "dflash_config."),
                  conv_group_size=need(dc, "conv_group_size", "dflash_config."),
                  selector_rank=need(dc, "selector_rank", "dflash_config."),
                  selector_top_k=need(dc, "selector_top_k", "dflash_config."))
        if cfg.block_size < 2:
            raise ValueError(f"drafter config: dflash_config.block_size={cfg.block_size} leaves no draft row")
        if cfg.hidden_size % cfg.conv_group_size:
            raise ValueError(f"drafter config: hidden_size {cfg.hidden_size} is not a multiple of "
                             f"dflash_config.conv_group_size {cfg.conv_group_size}")
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ValueError(f"drafter config: num_attention_heads {cfg.num_attention_heads} is not a multiple "
                             f"of num_key_value_heads {cfg.num_key_value_heads}")
        if not 0 <= cfg.mask_token_id < cfg.vocab_size:
            raise ValueError(f"drafter config: mask_token_id {cfg.mask_token_id} is outside the vocabulary")
        if not 1 <= cfg.selector_top_k <= cfg.vocab_size:
            raise ValueError(f"drafter config: selector_top_k {cfg.selector_top_k} must be in 1..vocab_size")
        return cfg

    @property
    def n_groups(self) -> int:
        return self.hidden_size // self.conv_group_size

    def check_target(self, target: GLMConfig) -> None:
        """The drafter borrows the target's embedding, head and hidden states: sizes must agree."""
        for name, ours, theirs in (("hidden_size", self.hidden_size, target.hidden_size),
                                   ("vocab_size", self.vocab_size, target.vocab_size),
                                   ("num_target_layers", self.num_target_layers, target.num_hidden_layers)):
            if ours != theirs:
                raise ValueError(f"drafter {name} = {ours} does not match the target's {theirs}")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_hidden_layers]
        if bad:
            raise ValueError(f"drafter dflash_config.target_layer_ids {bad} are not target layers "
                             f"0..{target.num_hidden_layers - 1}")


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """§1.1 default taps: one per draft layer, spread from layer 1 to layer L-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def drafter_shapes(cfg: DFlash2Config) -> dict[str, tuple[int, ...]]:
    """Every tensor of a DFlash2 checkpoint (no prefix, dflash2.tensors.tsv) with its shape."""
    D, hd, V = cfg.hidden_size, cfg.head_dim, cfg.vocab_size
    conv = (2 * cfg.conv_kernel_size * cfg.n_groups, D)
    shapes = {"fc.weight": (D, len(cfg.target_layer_ids) * D), "hidden_norm.weight": (D,), "norm.weight": (D,),
              "candidate_selector.hidden_projection.weight": (cfg.selector_rank, D),
              "candidate_selector.predecessor_codebook": (V, cfg.selector_rank),
              "candidate_selector.successor_codebook": (V, cfg.selector_rank)}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        shapes |= {p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                   p + "attention_conv.kernel_projection.weight": conv,
                   p + "attention_conv.base_kernel": (2, cfg.conv_kernel_size, D),
                   p + "mlp_conv.kernel_projection.weight": conv,
                   p + "mlp_conv.base_kernel": (2, cfg.conv_kernel_size, D),
                   p + "self_attn.q_proj.weight": (cfg.num_attention_heads * hd, D),
                   p + "self_attn.k_proj.weight": (cfg.num_key_value_heads * hd, D),
                   p + "self_attn.v_proj.weight": (cfg.num_key_value_heads * hd, D),
                   p + "self_attn.o_proj.weight": (D, cfg.num_attention_heads * hd),
                   p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                   p + "mlp.gate_proj.weight": (cfg.intermediate_size, D),
                   p + "mlp.up_proj.weight": (cfg.intermediate_size, D),
                   p + "mlp.down_proj.weight": (D, cfg.intermediate_size)}
    return shapes


def check_drafter_tensors(cfg: DFlash2Config, found: dict[str, tuple[str, tuple]]) -> None:
    """found: name -> (dtype, shape). Raises one CheckpointError listing every problem."""
    expected = drafter_shapes(cfg)
    problems = [f"{n}: missing" for n in expected if n not in found]
    problems += [f"{n}: not a DFlash2 tensor" for n in found if n not in expected]
    problems += [f"{n}: shape {list(found[n][1])}, expected {list(s)}" for n, s in expected.items()
                 if n in found and tuple(found[n][1]) != s]
    problems += [f"{n}: dtype {found[n][0]}, expected a float type" for n in expected
                 if n in found and found[n][0] not in checkpoint.FLOAT]
    if problems:
        raise checkpoint.CheckpointError(f"drafter checkpoint does not match its config ({len(problems)} "
                                         "problem(s)): " + "; ".join(problems[:8]))


def write_drafter(path: str | Path, config_dict: dict, weights: dict[str, torch.Tensor]) -> Path:
    """config.json + model.safetensors (BF16), the published layout; tests use it for tiny drafters."""
    cfg = DFlash2Config.from_dict(config_dict)
    check_drafter_tensors(cfg, {n: ("BF16", tuple(w.shape)) for n, w in weights.items()})
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
    save_file({n: w.detach().to(torch.bfloat16).contiguous().cpu() for n, w in weights.items()},
              path / "model.safetensors", metadata={"format": "pt"})
    return path


def load_drafter(path: str | Path, target: GLMModel, dtype: torch.dtype | None = None) -> "DFlash2Drafter":
    """A local folder or Hugging Face id -> a drafter bound to the target's embedding and head."""
    path = checkpoint.resolve_model_path(path)
    cfg = DFlash2Config.from_file(path)
    cfg.check_target(target.config)
    files = checkpoint.checkpoint_files(path)
    found, _ = checkpoint.read_inventory(files)
    check_drafter_tensors(cfg, found)
    dtype = dtype or target.dtype
    device = target.w("embed_tokens.weight").device
    weights = {}
    for f in files:
        with safe_open(f, framework="pt") as st:
            for n in st.keys():
                weights[n] = st.get_tensor(n).to(device, dtype)
    return DFlash2Drafter(cfg, weights, target)


# ---------------------------------------------------------------------------------------------
# DFlash2 math (§1.1, §2.1, §2.6)


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX (rotate-half) RoPE at absolute positions. x [..., n, heads, hd], pos [..., n]."""
    half = x.shape[-1] // 2
    inv = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) * 2 / x.shape[-1])
    ang = pos.to(torch.float32)[..., None, None] * inv
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x.float()[..., :half], x.float()[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


def block_conv(y: torch.Tensor, base: torch.Tensor, delta: torch.Tensor, group: int) -> torch.Tensor:
    """§2.1.1 one side: out[i, c] = Σ_t (base[t, c] + δ[i, t, g(c)]) · y[i-t, c], zero before row 0.
    y [N, B, D], base [T, D], delta [N, B, T, G]."""
    out = torch.zeros_like(y, dtype=torch.float32)
    for t in range(base.shape[0]):
        w = base[t].float() + delta[:, :, t].float().repeat_interleave(group, -1)
        out += w * F.pad(y.float(), (0, 0, t, 0))[:, :y.shape[1]]
    return out.to(y.dtype)


@dataclass
class DraftContext:
    """A sequence's drafter cache: per layer the K/V of committed context rows (the last window)."""
    k: list[torch.Tensor]  # per layer [S, kv_heads, hd], RoPE applied
    v: list[torch.Tensor]
    pos: torch.Tensor  # [S] absolute positions


class DFlash2Drafter:
    """The DFlash2 draft model over a weight dict (checkpoint names), bound to the target model's
    embedding table and lm_head. `block_hidden` is differentiable (tests train tiny drafters)."""

    def __init__(self, config: DFlash2Config, weights: dict[str, torch.Tensor], target: GLMModel):
        config.check_target(target.config)
        check_drafter_tensors(config, {n: ("F32", tuple(w.shape)) for n, w in weights.items()})
        self.config, self.weights, self.target = config, weights, target
        self.contexts: dict[str, DraftContext] = {}

    def w(self, name: str) -> torch.Tensor:
        return self.weights[name]

    # -- context (KV injection, §1.1 and §2.4) ------------------------------------------------

    def context_kv(self, taps: torch.Tensor, pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """taps [S, n_taps·D] -> per layer (K [S, kvh, hd] with RoPE, V [S, kvh, hd])."""
        cfg = self.config
        ctx = rms_norm(linear(taps, self.w("fc.weight")), self.w("hidden_norm.weight"), cfg.rms_norm_eps)
        out = []
        for i in range(cfg.num_hidden_layers):
            p = f"layers.{i}.self_attn."
            k = linear(ctx, self.w(p + "k_proj.weight")).view(-1, cfg.num_key_value_heads, cfg.head_dim)
            k = rope(rms_norm(k, self.w(p + "k_norm.weight"), cfg.rms_norm_eps), pos, cfg.rope_theta)
            out.append((k, linear(ctx, self.w(p + "v_proj.weight")).view(-1, cfg.num_key_value_heads, cfg.head_dim)))
        return out

    # -- the block pass -----------------------------------------------------------------------

    def block_hidden(self, ids: torch.Tensor, pos: torch.Tensor, ctx: list[tuple[torch.Tensor, torch.Tensor]],
                     ctx_pos: torch.Tensor, ctx_visible: torch.Tensor) -> torch.Tensor:
        """ids, pos [N, B] (row 0 the anchor, then MASK); ctx per layer K/V [S, kvh, hd] at ctx_pos [S];
        block n sees the context rows ctx_visible[n] marks (its sequence's rows before its anchor) that
        are inside each layer's window, and its own rows. Returns the final-normed hidden [N, B, D]."""
        cfg = self.config
        x = self.target.w("embed_tokens.weight")[ids].to(self.w("norm.weight").dtype)
        for i in range(cfg.num_hidden_layers):
            p = f"layers.{i}."
            visible = ctx_visible[:, None, :]
            if cfg.windows[i] is not None:  # per-row window |q - k| < w (upstream, §9 point 7)
                visible = visible & (pos[:, :, None] - ctx_pos[None, None, :] < cfg.windows[i])
            x = x + self._sublayer(p + "attention_conv.", p + "input_layernorm.weight", x,
                                   lambda a: self._attention(p + "self_attn.", a, pos, ctx[i], visible))
            x = x + self._sublayer(p + "mlp_conv.", p + "post_attention_layernorm.weight", x,
                                   lambda a: self._mlp(p + "mlp.", a))
        return rms_norm(x, self.w("norm.weight"), cfg.rms_norm_eps)

    def _sublayer(self, conv: str, norm: str, x: torch.Tensor, f) -> torch.Tensor:
        """conv_1(f(conv_0(n))) with n the normed input; δ comes from n once for both sides (§2.1.1)."""
        cfg = self.config
        n = rms_norm(x, self.w(norm), cfg.rms_norm_eps)
        N, B, _ = n.shape
        delta = linear(n, self.w(conv + "kernel_projection.weight")).view(N, B, 2, cfg.conv_kernel_size, cfg.n_groups)
        base = self.w(conv + "base_kernel")
        y = f(block_conv(n, base[0], delta[:, :, 0], cfg.conv_group_size))
        return block_conv(y, base[1], delta[:, :, 1], cfg.conv_group_size)

    def _attention(self, p: str, a: torch.Tensor, pos: torch.Tensor, ctx: tuple[torch.Tensor, torch.Tensor],
                   visible: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        N, B, _ = a.shape
        H, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        q = rms_norm(linear(a, self.w(p + "q_proj.weight")).view(N, B, H, hd), self.w(p + "q_norm.weight"), eps)
        k = rms_norm(linear(a, self.w(p + "k_proj.weight")).view(N, B, kvh, hd), self.w(p + "k_norm.weight"), eps)
        v = linear(a, self.w(p + "v_proj.weight")).view(N, B, kvh, hd)
        q, k = rope(q, pos, cfg.rope_theta).float(), rope(k, pos, cfg.rope_theta).float()
        rep = H // kvh
        kc, vc = (t.float().repeat_interleave(rep, 1) for t in ctx)
        kb, vb = k.repeat_interleave(rep, 2), v.float().repeat_interleave(rep, 2)
        s_ctx = torch.einsum("nbhd,shd->nhbs", q, kc).masked_fill(~visible[:, None], -math.inf)
        s_blk = torch.einsum("nbhd,nchd->nhbc", q, kb)  # no causal mask inside the block
        prob = torch.softmax(torch.cat([s_ctx, s_blk], -1) / math.sqrt(hd), -1)
        S = kc.shape[0]
        o = torch.einsum("nhbs,shd->nbhd", prob[..., :S], vc) + torch.einsum("nhbc,nchd->nbhd", prob[..., S:], vb)
        return linear(o.reshape(N, B, H * hd).to(a.dtype), self.w(p + "o_proj.weight"))

    def _mlp(self, p: str, a: torch.Tensor) -> torch.Tensor:
        gate, up = linear(a, self.w(p + "gate_proj.weight")), linear(a, self.w(p + "up_proj.weight"))
        return linear(F.silu(gate) * up, self.w(p + "down_proj.weight"))

    # -- candidate selector (§2.1.2) ----------------------------------------------------------

    def select(self, logits: torch.Tensor, h: torch.Tensor, anchor: int, k: int, temperature: float,
               generator: torch.Generator) -> Draft:
        """Walk the top-K candidates of rows 1..k from the anchor: S_r(a, b) = U_r(b) + Σ_j A[a, j] z_r[j] Bc[b, j].
        Greedy takes the argmax; T > 0 samples softmax(S/T) and keeps it as q."""
        A = self.w("candidate_selector.predecessor_codebook")  # [vocab, rank]: gather rows, never copy it
        U, cand = torch.topk(logits[:k].float(), self.config.selector_top_k, dim=-1)
        z = linear(h[:k], self.w("candidate_selector.hidden_projection.weight")).float()
        edge = self.w("candidate_selector.successor_codebook")[cand].float() * z[:, None, :]  # [k, K, rank]
        tokens, q, prev = [], [], anchor
        for r in range(k):
            score = U[r] + edge[r] @ A[prev].float()
            if temperature == 0:
                j = int(score.argmax())
            else:
                probs = torch.softmax(score / temperature, -1)
                j = int(torch.multinomial(probs, 1, generator=generator))
                q.append(torch.zeros(logits.shape[-1], device=logits.device).index_put_((cand[r],), probs))
            prev = int(cand[r, j])
            tokens.append(prev)
        return Draft(tokens, torch.stack(q) if q else None)

    # -- the speculator interface the engine calls --------------------------------------------

    name = "dflash2"

    @property
    def max_draft(self) -> int:
        return self.config.block_size - 1

    @property
    def taps(self) -> tuple[int, ...]:
        return self.config.target_layer_ids

    def observe(self, key: str, start: int, rows: TargetPass, span: tuple[int, int],
                images: tuple[tuple[int, torch.Tensor], ...] = ()) -> None:
        """Committed rows start.. of one sequence: project their taps into the drafter cache. (An image's
        rows, `images`, reach the drafter through the taps.)"""
        with torch.no_grad():
            a, b = span
            pos = torch.arange(start, start + b - a, device=rows.taps.device)
            kv = self.context_kv(rows.taps[a:b], pos)
            old = self.contexts.get(key)
            windows = self.config.windows
            keep = None if None in windows else max(windows)  # rows any layer can still see
            if old is not None:
                kv = [(torch.cat([ok, k]), torch.cat([ov, v])) for (ok, ov), (k, v) in zip(zip(old.k, old.v), kv)]
                pos = torch.cat([old.pos, pos])
            if keep is not None:
                kv, pos = [(k[-keep:], v[-keep:]) for k, v in kv], pos[-keep:]
            self.contexts[key] = DraftContext([k for k, _ in kv], [v for _, v in kv], pos)

    def release(self, key: str) -> None:
        self.contexts.pop(key, None)

    def draft(self, requests: list[DraftRequest]) -> list[Draft]:
        """One block pass for all sequences (§2.6): each block sees only its own sequence's context."""
        cfg, device = self.config, self.w("norm.weight").device
        # Every drafting sequence has had a forward (admission recomputes at least its last prompt
        # token), so its context exists; rows a prefix-cache hit skipped are simply not in it.
        ctxs = [self.contexts[r.key] for r in requests]
        with torch.no_grad():
            kv = [(torch.cat([c.k[i] for c in ctxs]), torch.cat([c.v[i] for c in ctxs]))
                  for i in range(cfg.num_hidden_layers)]
            ctx_pos = torch.cat([c.pos for c in ctxs])
            owner = torch.cat([torch.full((len(c.pos),), n, device=device) for n, c in enumerate(ctxs)])
            anchor_pos = torch.tensor([r.position for r in requests], device=device)
            visible = (owner[None, :] == torch.arange(len(requests), device=device)[:, None]) & \
                      (ctx_pos[None, :] < anchor_pos[:, None])
            ids = torch.tensor([[r.token_ids[-1]] + [cfg.mask_token_id] * (cfg.block_size - 1) for r in requests],
                               device=device)
            pos = anchor_pos[:, None] + torch.arange(cfg.block_size, device=device)
            h = self.block_hidden(ids, pos, kv, ctx_pos, visible)[:, 1:1 + max(r.k for r in requests)]
            logits = linear(h, self.target.w("lm_head.weight")).float()
            return [self.select(logits[n], h[n], r.token_ids[-1], r.k, r.temperature, r.generator)
                    for n, r in enumerate(requests)]


def init_drafter_weights(cfg: DFlash2Config, seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    """Fresh fp32 weights as training starts them: norms 1, identity conv base (tap 0 = 1, §2.1.1),
    projections and codebooks N(0, std)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in drafter_shapes(cfg).items():
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape)
        elif name.endswith("base_kernel"):
            out[name] = torch.zeros(shape)
            out[name][:, 0] = 1
        else:
            out[name] = torch.randn(shape, generator=g) * std
    return out


# ---------------------------------------------------------------------------------------------
# MTP drafter (§5, glm53.md §4.7)


@dataclass
class _Pending:
    start: int  # position of the first row not yet fed to the MTP layer
    hidden: list[torch.Tensor] = field(default_factory=list)  # trunk final-norm rows from start on
    images: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (position, rows): an image's input rows

    def fed_images(self, n: int) -> tuple[tuple[int, torch.Tensor], ...]:
        """SeqChunk.images of the step that feeds the n rows from start: the chunk's tokens are those at
        start+1 .. start+n, so an image's rows sit one row earlier than in the trunk's chunk."""
        return chunk_images(self.images, self.start + 1, self.start + n + 1)


class MTPDrafter:
    """Layer 45 as an EAGLE-style chain: MTP at position t reads (h_t, token t+1), writes its DSA cache
    row t and predicts token t+2. Committed rows wait here until their next token is known; a draft
    first feeds them (their MTP cache rows then match the trunk), then chains k-1 steps on its own h'."""

    name = "mtp"
    taps: tuple[int, ...] = ()
    max_draft = 7

    def __init__(self, model: GLMModel, cache: CachePool):
        if not model.has_mtp:
            raise ValueError("speculator 'mtp' needs the checkpoint's MTP layer "
                             f"(layers.{model.config.num_hidden_layers}.*); this one has none")
        self.model, self.cache = model, cache
        self.pending: dict[str, _Pending] = {}

    def observe(self, key: str, start: int, rows: TargetPass, span: tuple[int, int],
                images: tuple[tuple[int, torch.Tensor], ...] = ()) -> None:
        """Committed rows start.. of one sequence (their chunk's `images`, SeqChunk.images) wait for the
        next draft, which feeds them with their next tokens."""
        a, b = span
        pend = self.pending.get(key)
        if pend is None or pend.start + sum(h.shape[0] for h in pend.hidden) != start:
            pend = self.pending[key] = _Pending(start)  # a hole (prefix hit): restart from here
        pend.hidden.append(rows.hidden[a:b])
        pend.images += [(start + r, im) for r, im in images if r < b - a]

    def release(self, key: str) -> None:
        self.pending.pop(key, None)

    def draft(self, requests: list[DraftRequest]) -> list[Draft]:
        with torch.no_grad():
            drafts = [Draft([], None) for _ in requests]
            qs: list[list[torch.Tensor]] = [[] for _ in requests]
            # Step 0: feed the committed rows (position pend.start .. anchor-1) with their next tokens.
            batch, hidden = [], []
            for r in requests:
                pend = self.pending.pop(r.key)
                n = sum(h.shape[0] for h in pend.hidden)
                next_tokens = torch.tensor(r.token_ids[pend.start + 1:pend.start + n + 1], device=self.cache.device)
                batch.append(SeqChunk(next_tokens, pend.start, r.block_table, r.slot, images=pend.fed_images(n)))
                hidden.append(torch.cat(pend.hidden))
            out = self.model.mtp_forward(torch.cat(hidden), batch, self.cache)
            live = list(range(len(requests)))
            for step in range(max(r.k for r in requests)):
                for j, i in enumerate(live):
                    tok, q = self._pick(out.logits[j], requests[i])
                    drafts[i].tokens.append(tok)
                    if q is not None:
                        qs[i].append(q)
                live_next = [i for i in live if len(drafts[i].tokens) < requests[i].k]
                if not live_next:
                    break
                h = out.hidden[[live.index(i) for i in live_next]]
                batch = [SeqChunk(torch.tensor([drafts[i].tokens[-1]], device=self.cache.device),
                                  requests[i].position + step, requests[i].block_table, requests[i].slot)
                         for i in live_next]
                out, live = self.model.mtp_forward(h, batch, self.cache), live_next
            for d, q in zip(drafts, qs):
                d.q = torch.stack(q) if q else None
            return drafts

    @staticmethod
    def _pick(logits: torch.Tensor, r: DraftRequest) -> tuple[int, torch.Tensor | None]:
        if r.temperature == 0:
            return int(logits.argmax()), None
        q = torch.softmax(logits.float() / r.temperature, -1)
        return int(torch.multinomial(q, 1, generator=r.generator)), q

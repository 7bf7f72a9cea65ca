"""Trains the built-in default model: a small GLM-5.3-Flash-architecture model on the Python
standard library, then exports it (BF16, and EXL3 experts at 2, 3 and 4 bits) and evaluates it.

    python train.py --out DIR --minutes M [--device cuda] [--resume]

The corpus is what every interpreter ships: the standard library's source files (a fixed, sorted
list; every HOLDOUT_EVERY-th file is held out for evaluation), plus question/answer chats built from
their docstrings and from `pydoc_data.topics` (the language reference), rendered with the real chat
template, so the model has seen the chat format it is served in. The tokenizer is default_model's.

Training runs the engine's own forward code, `GLMModel.forward` and `GLMModel.mtp_forward` with a
fresh CachePool per batch, over weights that are leaf tensors requiring grad, so the math lives in
model_glm.py (GLMModel.kda runs the batch's equal-length sequences side by side, so a step is not
launch-bound; `TrainingModel` only counts expert loads). The loss is next-token cross-entropy plus MTP_WEIGHT x the MTP
layer's next-next-token loss. The routers' e_score_correction_bias is not trained by gradient (it
only chooses experts): it follows DeepSeek-V3's auxiliary-loss-free balancing rule.

    python train.py --drafter --target default_weights/bf16 --out DIR --minutes M [--device cuda] [--resume]

trains the DFlash2 drafter (../shared/spec/dflash2.md) against the frozen trained model on the same
corpus, with §1.3's objective (`drafter_losses`), and writes DIR/dflash2 in the published layout;
copied to default_weights/dflash2 it is what `default_model.shipped_drafter()` finds.
"""
from __future__ import annotations

import argparse
import ast
import functools
import inspect
import json
import math
import os
import sysconfig
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

import chat
import checkpoint
import default_model
import dflash
import exl3
from cache import CachePool
from model_glm import GLMConfig, GLMModel, SeqChunk, route

HOLDOUT_EVERY = 20  # files 0, 20, 40, ... of the sorted list are held out
SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__", "encodings"}  # encodings: codec tables
BLOCK = 64  # cache block size used for training batches
MTP_WEIGHT = 0.3  # DeepSeek-V3's MTP loss weight for the first part of training
BITS = (2, 3, 4)
CODEBOOK = "mcg"
STATE_FILE = "train_state.pt"
TIMING_STEPS = 12  # steps timed to plan the schedule's length (fewer than the warm-up steps)

# The architecture at a small size (overrides of checkpoint.tiny_config_dict). hidden_size and
# moe_intermediate_size are 128 because EXL3 needs expert dims in multiples of 128; the BF16 export
# stays under 16 MiB. Mostly KDA with DSA on every third layer (the full model: every fourth).
MODEL = dict(
    hidden_size=128, intermediate_size=384, moe_intermediate_size=128,
    num_hidden_layers=6, first_k_dense_replace=1,
    layer_types=["linear_attention", "linear_attention", "deepseek_sparse_attention"] * 2,
    num_attention_heads=4, num_key_value_heads=4,
    n_routed_experts=16, num_experts_per_tok=2, n_shared_experts=1,
    q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_head_dim=32, v_head_dim=32,
    index_n_heads=16, index_head_dim=32, index_topk=64, index_kpool=4,
    linear_attn_config={"num_heads": 2, "head_dim": 64},
    max_position_embeddings=4096,
)


@dataclass
class Settings:
    seq_len: int = 256
    batch_size: int = 32
    lr: float = 4e-3  # 5e-3 trained stably in a 60-step CPU trial (batch 4 x 128), a bit faster than 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 40
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    bias_update: float = 1e-3  # DeepSeek-V3's γ for the routing-bias rule
    seed: int = 0


# ---------------------------------------------------------------------------------------------
# Corpus

def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path | None = None) -> list[Path]:
    """The standard library's .py files, sorted by relative path (tests and codec tables left out)."""
    root = root or stdlib_root()
    files = [p for p in root.rglob("*.py") if not SKIP_DIRS & set(p.relative_to(root).parts[:-1])]
    if not files:
        raise FileNotFoundError(f"no standard-library .py files under {root}")
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def split_files(files: list[Path]) -> tuple[list[Path], list[Path]]:
    """(train, held out): every HOLDOUT_EVERY-th file of the sorted list is held out."""
    held = files[::HOLDOUT_EVERY]
    return [f for i, f in enumerate(files) if i % HOLDOUT_EVERY], held


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def docstring_pairs(source: str, module: str) -> list[tuple[str, str]]:
    """(question, answer) for each documented module-level function or class: the first paragraph
    of its docstring answers "What does <module>.<name> do?"."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    pairs = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            doc = ast.get_docstring(node)
            if doc:
                answer = inspect.cleandoc(doc).split("\n\n")[0].strip()
                if len(answer) > 20:
                    pairs.append((f"What does {module}.{node.name} do?", answer[:800]))
    return pairs


def topic_pairs(root: Path) -> list[tuple[str, str]]:
    """(question, answer) from the language reference the interpreter ships (pydoc_data/topics.py,
    a module whose `topics` is a dict literal: topic -> text)."""
    path = root / "pydoc_data" / "topics.py"
    if not path.is_file():
        return []
    topics = next((ast.literal_eval(node.value) for node in ast.parse(read_text(path)).body
                   if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["topics"]), {})
    return [(f"Explain the Python topic '{k.replace('-', ' ')}'.", topics[k].strip()[:1500]) for k in sorted(topics)]


def chat_text(question: str, answer: str, template: str, thinking: bool) -> str:
    """One exchange as the server renders it (thinking on: empty reasoning), ended by <|endoftext|>."""
    mode = chat.resolve_thinking() if thinking else chat.resolve_thinking(enable_thinking=False)
    prompt = chat.render(template, [{"role": "user", "content": question}], thinking=mode)
    return prompt + ("</think>" if thinking else "") + answer


def documents(files: list[Path], root: Path, template: str, with_topics: bool) -> list[str]:
    """Source files, then the chats built from them (and from the language reference)."""
    texts = [read_text(f) for f in files]
    pairs = []
    for f, text in zip(files, texts):
        module = f.relative_to(root).with_suffix("").as_posix().replace("/", ".").removesuffix(".__init__")
        pairs += docstring_pairs(text, module)
    if with_topics:
        pairs += topic_pairs(root)
    return texts + [chat_text(q, a, template, thinking=i % 2 == 0) for i, (q, a) in enumerate(pairs)]


def encode(tok: Tokenizer, docs: list[str]) -> torch.Tensor:
    """One token stream: each document followed by <|endoftext|>."""
    eos = tok.token_to_id("<|endoftext|>")
    ids = []
    for enc in tok.encode_batch(docs):
        ids += enc.ids + [eos]
    return torch.tensor(ids, dtype=torch.long)


def make_tokenizer() -> Tokenizer:
    return default_model.build_tokenizer(default_model.corpus_texts())


@dataclass
class Corpus:
    train: torch.Tensor  # token stream
    held: torch.Tensor


def load_corpus(tok: Tokenizer, template: str, files: list[Path] | None = None, root: Path | None = None) -> Corpus:
    root = root or stdlib_root()
    train_files, held_files = split_files(files if files is not None else corpus_files(root))
    # The language reference is training material; the held-out set is source files and their docstrings.
    return Corpus(encode(tok, documents(train_files, root, template, with_topics=True)),
                  encode(tok, documents(held_files, root, template, with_topics=False)))


def windows(stream: torch.Tensor, seq_len: int) -> int:
    """How many windows of seq_len + 2 tokens (input, next, next-next) start every seq_len tokens."""
    return (stream.numel() - 2) // seq_len


def window(stream: torch.Tensor, i: int, seq_len: int) -> torch.Tensor:
    return stream[i * seq_len: i * seq_len + seq_len + 2]


def train_batch(stream: torch.Tensor, pos: int, s: Settings) -> torch.Tensor:
    """Batch at data position `pos` (windows consumed so far): epoch e reads the windows in the order
    of randperm(seed + e), so the position alone fixes the data."""
    n = windows(stream, s.seq_len)
    if n < 1:
        raise ValueError(f"the training stream has {stream.numel()} tokens, fewer than one window of {s.seq_len + 2}")
    rows, perms = [], {}
    for p in range(pos, pos + s.batch_size):
        epoch = p // n
        if epoch not in perms:
            perms[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(s.seed * 7919 + epoch))
        rows.append(window(stream, int(perms[epoch][p % n]), s.seq_len))
    return torch.stack(rows)


def held_batches(stream: torch.Tensor, seq_len: int, n_windows: int, batch_size: int) -> list[torch.Tensor]:
    """The first n_windows evenly spaced windows of the held-out stream, in batches (fixed)."""
    n = windows(stream, seq_len)
    if n < 1:
        raise ValueError(f"the held-out stream has {stream.numel()} tokens, fewer than one window of {seq_len + 2}")
    idx = [i * n // min(n, n_windows) for i in range(min(n, n_windows))]
    rows = torch.stack([window(stream, i, seq_len) for i in idx])
    return list(rows.split(batch_size))


# ---------------------------------------------------------------------------------------------
# Model and loss

def model_config(tok: Tokenizer, overrides: dict | None = None) -> dict:
    """The default model's config.json: MODEL (or `overrides`) over the tiny layout, with the tokenizer's ids."""
    eos = [tok.token_to_id(t) for t in default_model.EOS_TOKENS]
    over = {**(MODEL if overrides is None else overrides), "vocab_size": tok.get_vocab_size(),
            "eos_token_id": eos, "pad_token_id": eos[0]}
    return checkpoint.tiny_config_dict(**over)


def as_params(weights: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Leaf tensors on `device`; all but the routing biases (moved by the bias rule) require grad."""
    return {n: w.to(device).requires_grad_(not n.endswith("e_score_correction_bias")) for n, w in weights.items()}


def init_params(config: GLMConfig, seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    """fp32 leaf tensors: checkpoint.random_weights' values."""
    return as_params(checkpoint.random_weights(config, seed), device)


class TrainingModel(GLMModel):
    """GLMModel that counts, per MoE layer, how many tokens each expert received (for the bias rule).
    A training batch (sequences of one length, all at position 0) runs its KDA layers side by side
    in one pass: GLMModel.kda groups such chunks itself."""

    def __init__(self, config: GLMConfig, weights: dict):
        super().__init__(config, weights)
        self.loads: dict[str, torch.Tensor] = {}

    def moe(self, p: str, h: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            experts, _ = route(h, self.w(p + "gate.weight"), self.w(p + "gate.e_score_correction_bias"), self.config)
            counts = torch.bincount(experts.flatten(), minlength=self.config.n_routed_experts).float()
            self.loads[p] = self.loads.get(p, 0) + counts
        return super().moe(p, h)


@dataclass
class Losses:
    main: torch.Tensor  # next-token cross-entropy, nats per token
    mtp: torch.Tensor  # MTP next-next-token cross-entropy

    @property
    def total(self) -> torch.Tensor:
        return self.main + MTP_WEIGHT * self.mtp

    def __str__(self) -> str:
        return f"loss {self.main.item():.3f} mtp {self.mtp.item():.3f}"


def compute_losses(model: GLMModel, tokens: torch.Tensor, grad: bool = True) -> Losses:
    """tokens [B, T + 2]: trunk reads 0..T-1 and predicts 1..T; MTP reads h_t and token t+1 and predicts t+2."""
    cfg, device = model.config, tokens.device
    B, T = tokens.shape[0], tokens.shape[1] - 2
    per_seq = -(-T // BLOCK)
    cache = CachePool(cfg, num_blocks=B * per_seq, num_slots=B, block_size=BLOCK, dtype=torch.float32, device=device)
    tables = [torch.arange(i * per_seq, (i + 1) * per_seq, device=device) for i in range(B)]
    trunk = [SeqChunk(tokens[i, :T], 0, tables[i], i) for i in range(B)]
    nxt = [SeqChunk(tokens[i, 1:T + 1], 0, tables[i], i) for i in range(B)]
    with torch.set_grad_enabled(grad):
        out = model.forward(trunk, cache, all_logits=True)
        main = F.cross_entropy(out.logits, tokens[:, 1:T + 1].reshape(-1))
        draft = model.mtp_forward(out.hidden, nxt, cache, all_logits=True)
        mtp = F.cross_entropy(draft.logits, tokens[:, 2:].reshape(-1))
    return Losses(main, mtp)


def lr_at(step: int, total: int | None, s: "Settings | DrafterSettings") -> float:
    """Linear warm-up, then cosine from lr down to min_lr_ratio * lr at `total` (needed only after warm-up)."""
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    if total is None:
        raise ValueError(f"step {step} is past warm-up: the schedule needs total_steps")
    frac = min(1.0, (step - s.warmup_steps) / max(1, total - s.warmup_steps))
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


# ---------------------------------------------------------------------------------------------
# Trainer: state that a resume restores exactly

class Trainer:
    def __init__(self, config_dict: dict, settings: Settings, device: str | torch.device,
                 params: dict[str, torch.Tensor] | None = None):
        self.config_dict, self.settings, self.device = config_dict, settings, torch.device(device)
        self.config = GLMConfig.from_dict(config_dict)
        self.params = params if params is not None else init_params(self.config, settings.seed, self.device)
        self.model = TrainingModel(self.config, self.params)
        names = sorted(n for n, p in self.params.items() if p.requires_grad)
        # Weight decay on matrices; norms, biases, gates' constants and conv taps are left alone.
        decays = {n: self.params[n].dim() == 2 for n in names}
        decay = [self.params[n] for n in names if decays[n]]
        rest = [self.params[n] for n in names if not decays[n]]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": settings.weight_decay},
                                            {"params": rest, "weight_decay": 0.0}],
                                           lr=settings.lr, betas=(0.9, 0.95), eps=1e-8)
        self.step_index = 0  # optimizer steps done
        self.data_pos = 0  # training windows consumed
        self.total_steps: int | None = None  # fixed once the step time is known (or given)

    def step(self, stream: torch.Tensor) -> Losses:
        s = self.settings
        tokens = train_batch(stream, self.data_pos, s).to(self.device)
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step_index, self.total_steps, s)
        self.model.loads = {}
        losses = compute_losses(self.model, tokens)
        self.optimizer.zero_grad(set_to_none=True)
        losses.total.backward()
        torch.nn.utils.clip_grad_norm_([p for p in self.params.values() if p.requires_grad], s.grad_clip)
        self.optimizer.step()
        self._balance_experts()
        self.step_index += 1
        self.data_pos += s.batch_size
        return losses

    @torch.no_grad()
    def _balance_experts(self) -> None:
        """DeepSeek-V3 §2.1.2: b_i += γ · sign(mean load - load_i) per MoE layer, after each step."""
        for p, load in self.model.loads.items():
            self.params[p + "gate.e_score_correction_bias"] += self.settings.bias_update * torch.sign(load.mean() - load)

    def state(self) -> dict:
        cuda = self.device.type == "cuda"
        return {"config_dict": self.config_dict, "settings": asdict(self.settings),
                "params": {n: p.detach().cpu() for n, p in self.params.items()},
                "optimizer": self.optimizer.state_dict(), "step": self.step_index, "data_pos": self.data_pos,
                "total_steps": self.total_steps, "rng_cpu": torch.get_rng_state(),
                "rng_cuda": torch.cuda.get_rng_state(self.device) if cuda else None}

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        torch.save(self.state(), tmp)
        os.replace(tmp, path)  # a crash mid-save leaves the previous state intact

    @classmethod
    def load(cls, path: Path, device: str | torch.device) -> "Trainer":
        st = torch.load(path, map_location="cpu", weights_only=False)
        device = torch.device(device)
        params = as_params(st["params"], device)
        t = cls(st["config_dict"], Settings(**st["settings"]), device, params)
        t.optimizer.load_state_dict(st["optimizer"])
        t.step_index, t.data_pos, t.total_steps = st["step"], st["data_pos"], st["total_steps"]
        torch.set_rng_state(st["rng_cpu"])
        if st["rng_cuda"] is not None and device.type == "cuda":
            torch.cuda.set_rng_state(st["rng_cuda"], device)
        return t

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.params.items()}


# ---------------------------------------------------------------------------------------------
# Export: the real checkpoint layout, BF16 and EXL3 experts

def expert_groups(config: GLMConfig) -> list[tuple[str, str]]:
    """(MoE layer prefix, projection) for every stack of routed-expert linears, MTP layer included."""
    layers = [L for L in range(config.num_hidden_layers) if config.mlp_layer_types[L] == "sparse"]
    layers += [config.mtp_layer] if config.mtp_layer is not None else []
    return [(f"layers.{L}.mlp.", proj) for L in layers for proj in ("gate_proj", "up_proj", "down_proj")]


def split_stacked(lin: exl3.EXL3Linear, parts: int, names: list[str]) -> dict[str, exl3.EXL3Linear]:
    """An EXL3 linear of parts x [out, in] stacked along out -> one EXL3 linear per part. Valid
    because W = diag(suh) H_k Ŵ H_n diag(svh) mixes output columns only within 128-blocks (H_n),
    which the split never cuts (out % 128 == 0): each part keeps the shared suh and its svh slice."""
    out = lin.out_features // parts
    if out % exl3.HAD:
        raise ValueError(f"split_stacked: {parts} parts of {out} outputs; each must be a multiple of {exl3.HAD}")
    t = out // 16
    return {name: exl3.EXL3Linear(lin.trellis[:, i * t:(i + 1) * t].contiguous(), lin.suh.clone(),
                                  lin.svh[i * out:(i + 1) * out].contiguous(), lin.codebook, name=name)
            for i, name in enumerate(names)}


def quantize_experts(config: GLMConfig, weights: dict[str, torch.Tensor], bits: float,
                     scale: float | None = None) -> dict[str, exl3.EXL3Linear]:
    """EXL3 for every routed expert. The experts of one (layer, projection) are quantized as one
    stacked matrix (one Viterbi batch instead of n_routed_experts small ones; they share suh and
    the global scale), on the weights' device. No Hessian: exllamav3's no-calibration path."""
    out = {}
    for p, proj in expert_groups(config):
        names = [f"{p}experts.{e}.{proj}.weight" for e in range(config.n_routed_experts)]
        stacked = torch.cat([weights[n].float() for n in names])
        lin = exl3.quantize(stacked, bits, codebook=CODEBOOK, seed=zlib.crc32(f"{p}{proj}".encode()), scale=scale)
        out |= split_stacked(lin, len(names), names)
    return out


def export(out: Path, config_dict: dict, weights: dict[str, torch.Tensor], tok: Tokenizer,
           bits: tuple[float, ...] = BITS, scale: float | None = None) -> dict[str, Path]:
    """out/bf16 and out/exl3-<K>bit for each K: folders engine.load reads. Returns {variant: folder}."""
    config = GLMConfig.from_dict(config_dict)
    folders = {"bf16": out / "bf16"}
    checkpoint.write_checkpoint(folders["bf16"], config_dict, {n: w.cpu() for n, w in weights.items()})
    for k in bits:
        t0 = time.time()
        experts = quantize_experts(config, weights, k, scale)
        folders[f"exl3-{k}bit"] = out / f"exl3-{k}bit"
        checkpoint.write_checkpoint(folders[f"exl3-{k}bit"], config_dict,
                                    {n: experts.get(n, w) for n, w in weights.items()}, experts="exl3", codebook=CODEBOOK)
        print(f"exported EXL3 {k}-bit experts in {time.time() - t0:.1f} s", flush=True)
    for folder in folders.values():
        default_model.write_extras(folder, tok)
    return folders


# ---------------------------------------------------------------------------------------------
# Evaluation

@dataclass
class Evaluation:
    variant: str
    loss: float  # held-out next-token cross-entropy (nats)
    mtp_loss: float
    kl: float | None  # KL(BF16 || variant), nats per token
    top1: float | None  # fraction of positions where the variant's argmax equals BF16's
    megabytes: float


@torch.no_grad()
def held_logits(model: GLMModel, batches: list[torch.Tensor]) -> tuple[torch.Tensor, float, float]:
    """fp32 logits [positions, vocab] over the held-out batches, and the mean main and MTP losses."""
    logits, main, mtp = [], 0.0, 0.0
    for tokens in batches:
        tokens = tokens.to(model.weights["embed_tokens.weight"].device)
        T = tokens.shape[1] - 2
        cache = CachePool(model.config, num_blocks=tokens.shape[0] * -(-T // BLOCK), num_slots=tokens.shape[0],
                          block_size=BLOCK, dtype=model.dtype, device=tokens.device)
        per_seq = -(-T // BLOCK)
        tables = [torch.arange(i * per_seq, (i + 1) * per_seq, device=tokens.device) for i in range(tokens.shape[0])]
        out = model.forward([SeqChunk(tokens[i, :T], 0, tables[i], i) for i in range(len(tables))], cache, all_logits=True)
        draft = model.mtp_forward(out.hidden, [SeqChunk(tokens[i, 1:T + 1], 0, tables[i], i) for i in range(len(tables))],
                                  cache, all_logits=True)
        main += F.cross_entropy(out.logits, tokens[:, 1:T + 1].reshape(-1)).item() / len(batches)
        mtp += F.cross_entropy(draft.logits, tokens[:, 2:].reshape(-1)).item() / len(batches)
        logits.append(out.logits.cpu())
    return torch.cat(logits), main, mtp


def evaluate(folders: dict[str, Path], batches: list[torch.Tensor], device: torch.device) -> list[Evaluation]:
    """Each export loaded as the engine loads it (checkpoint.load_weights, bf16 on CUDA, fp32 on
    CPU); KL and top-1 agreement are against the BF16 export on the same held-out positions."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results, ref = [], None
    for variant, folder in folders.items():
        config = GLMConfig.from_file(folder)
        model = GLMModel(config, checkpoint.load_weights(folder, config, dtype, device, progress=False))
        logits, main, mtp = held_logits(model, batches)
        logp = torch.log_softmax(logits, -1)
        kl = top1 = None
        if ref is None:
            ref = logp
        else:
            kl = (ref.exp() * (ref - logp)).sum(-1).mean().item()
            top1 = (ref.argmax(-1) == logp.argmax(-1)).float().mean().item()
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**20
        results.append(Evaluation(variant, main, mtp, kl, top1, size))
        del model
    return results


def table(results: list[Evaluation]) -> str:
    rows = ["| variant | weights MiB | held-out loss | held-out MTP loss | KL(BF16 || variant) | top-1 agreement |",
            "|---|---|---|---|---|---|"]
    for r in results:
        kl = "-" if r.kl is None else f"{r.kl:.4f}"
        top1 = "-" if r.top1 is None else f"{100 * r.top1:.1f}%"
        rows.append(f"| {r.variant} | {r.megabytes:.1f} | {r.loss:.3f} | {r.mtp_loss:.3f} | {kl} | {top1} |")
    return "\n".join(rows)


def sample_replies(folder: Path, device: torch.device, prompts: list[str], max_tokens: int = 40) -> list[str]:
    """Greedy chat replies (thinking off) through the engine itself: engine.load + generate."""
    import engine
    eng = engine.load(folder, device=device, max_cache_tokens=4096, snapshot_bytes=0, progress=False)
    results = eng.generate([[{"role": "user", "content": p}] for p in prompts],
                           engine.SamplingParams(max_tokens=max_tokens, temperature=0.0),
                           thinking=chat.resolve_thinking(enable_thinking=False))
    return [r.text for r in results]


# ---------------------------------------------------------------------------------------------
# The DFlash2 drafter (../shared/spec/dflash2.md): trained against the frozen default model

# The published drafter's geometry (§2.2) scaled to the default model: hidden size and vocabulary are
# the target's (the drafter borrows its embedding and head), MLP 3x hidden like the target's dense
# layer, grouped-query heads of width 32, 2 layers instead of 5 (the target has 6 layers, not 45).
# Taps: like GLM's [5, 14, 24, 33, 42] of 45, KDA layers spread over the depth, the last one two
# layers before the top (§2.4). Block 8, 2-tap conv with groups of 16, selector top-16 as published;
# the selector rank is 32 instead of 256 (the hidden size is 128, not 4096).
DRAFTER = dict(num_hidden_layers=2, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2,
               head_dim=32, sliding_window=2048, block_size=8, target_layer_ids=[1, 3, 4],
               conv_kernel_size=2, conv_group_size=16, selector_rank=32, selector_top_k=16,
               max_position_embeddings=MODEL["max_position_embeddings"])
MASK_TOKEN = "[MASK]"  # a spare id inside the target vocabulary that the corpus never contains (§1.1)
DRAFTER_STATE_FILE = "drafter_state.pt"
SELECTOR_WEIGHT = 0.5  # SpecForge's dflash2_selector_loss_alpha role: weight of the selector's cross-entropy


def drafter_config(target: GLMConfig, tok: Tokenizer, overrides: dict | None = None) -> dict:
    """The drafter's config.json in the published key structure (fixtures/glm53/dflash2.config.json)."""
    d = {**DRAFTER, **(overrides or {})}
    n = d["num_hidden_layers"]
    eos = list(target.eos_token_ids)
    return {"architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "attention_bias": False,
            "attention_dropout": 0.0, "bos_token_id": None, "dtype": "bfloat16", "eos_token_id": eos,
            "pad_token_id": eos[0], "head_dim": d["head_dim"], "hidden_act": "silu",
            "hidden_size": target.hidden_size, "initializer_range": 0.02,
            "intermediate_size": d["intermediate_size"], "is_causal": False,
            "layer_types": ["sliding_attention"] * n, "max_position_embeddings": d["max_position_embeddings"],
            "max_window_layers": n, "num_attention_heads": d["num_attention_heads"], "num_hidden_layers": n,
            "num_key_value_heads": d["num_key_value_heads"], "num_target_layers": target.num_hidden_layers,
            "rms_norm_eps": 1e-5, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
            "sliding_window": d["sliding_window"], "tie_word_embeddings": False, "use_cache": False,
            "use_sliding_window": True, "vocab_size": target.vocab_size,
            "dflash_config": {"block_size": d["block_size"], "mask_token_id": tok.token_to_id(MASK_TOKEN),
                              "target_layer_ids": list(d["target_layer_ids"]),
                              "conv_kernel_size": d["conv_kernel_size"], "conv_group_size": d["conv_group_size"],
                              "selector_rank": d["selector_rank"], "selector_top_k": d["selector_top_k"]}}


@dataclass
class DrafterSettings:
    seq_len: int = 256
    batch_size: int = 32
    anchors: int = 32  # blocks per sequence, resampled every step (SpecForge: 512 per ~4K tokens, 1 in 8)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 40
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    gamma: float = 4.0  # position decay w_k = exp(-(k-1)/γ): ModelOpt's default for block 8 (§1.3)
    seed: int = 0


@dataclass
class DrafterLosses:
    main: torch.Tensor  # position-weighted cross-entropy of the drafter's head against the target's distribution
    selector: torch.Tensor  # the selector's K-way cross-entropy (gold = the target's argmax)
    head_top1: torch.Tensor  # [B-1] per block row: drafter head argmax == target argmax (teacher-forced)
    walk_top1: torch.Tensor  # [B-1] per block row: selector's choice from the gold predecessor == target argmax

    @property
    def total(self) -> torch.Tensor:
        return self.main + SELECTOR_WEIGHT * self.selector

    def __str__(self) -> str:
        return f"loss {self.main.item():.3f} selector {self.selector.item():.3f}"


def target_features(target: GLMModel, tokens: torch.Tensor, taps: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [N, T] -> (taps [N·T, n_taps·D], logits [N·T, vocab]): the frozen target's forward, each
    sequence from position 0 in a fresh cache, as train.py's model loss runs it."""
    N, T = tokens.shape
    per_seq = -(-T // BLOCK)
    cache = CachePool(target.config, num_blocks=N * per_seq, num_slots=N, block_size=BLOCK, dtype=target.dtype,
                      device=tokens.device)
    chunks = [SeqChunk(tokens[i], 0, torch.arange(i * per_seq, (i + 1) * per_seq, device=tokens.device), i)
              for i in range(N)]
    with torch.no_grad():
        out = target.forward(chunks, cache, all_logits=True, taps=taps)
    return out.taps.float(), out.logits.float()


def drafter_losses(drafter: dflash.DFlash2Drafter, tokens: torch.Tensor, anchors: int, generator: torch.Generator,
                   s: DrafterSettings) -> DrafterLosses:
    """dflash2.md §1.3 on tokens [N, T]. Each sequence gets `anchors` random anchors a in 1..T-2 (at
    least one context row and one predicted row); block [x_a, MASK x (B-1)] sits at positions a..a+B-1,
    sees its own sequence's context rows < a and its own rows (bidirectionally), nothing of other
    blocks. Row k predicts the token at a+k. The labels are the target's own next-token distribution
    at a+k-1 (ModelOpt's self logit distillation, a §1.3 variant): greedy verification accepts the
    target's argmax, not the corpus's next token. Rows past the sequence end are left out; rows are
    weighted exp(-(k-1)/γ). The selector (§2.1.2) is trained by a K-way cross-entropy over the head's
    top-K from the teacher-forced predecessor x_{a+k-1}, with the gold token (the target's argmax)
    put in place of the K-th candidate when it is missing."""
    cfg, target = drafter.config, drafter.target
    N, T = tokens.shape
    B, device = cfg.block_size, tokens.device
    taps, target_logits = target_features(target, tokens, cfg.target_layer_ids)
    ctx_pos = torch.arange(T, device=device).repeat(N)
    owner = torch.arange(N, device=device).repeat_interleave(T)
    ctx = drafter.context_kv(taps, ctx_pos)

    a = torch.randint(1, T - 1, (N, anchors), generator=generator).to(device).flatten()  # [M] anchors
    seq = torch.arange(N, device=device).repeat_interleave(anchors)  # [M] their sequences
    pos = a[:, None] + torch.arange(B, device=device)  # [M, B]
    ids = torch.cat([tokens[seq, a][:, None], torch.full_like(pos[:, 1:], cfg.mask_token_id)], 1)
    visible = (owner[None, :] == seq[:, None]) & (ctx_pos[None, :] < a[:, None])
    h = drafter.block_hidden(ids, pos, ctx, ctx_pos, visible)[:, 1:]  # [M, B-1, D]
    logits = F.linear(h, target.w("lm_head.weight").float())  # the target's head, frozen

    prev = pos[:, 1:] - 1  # the position whose target row labels block row k
    valid = prev < T
    rows = seq[:, None] * T + prev.clamp(max=T - 1)  # flat target rows
    p = torch.softmax(target_logits[rows], -1)  # [M, B-1, V]
    gold = p.argmax(-1)
    weight = torch.exp(-torch.arange(B - 1, device=device) / s.gamma) * valid
    ce = -(p * torch.log_softmax(logits, -1)).sum(-1)
    main = (ce * weight).sum() / weight.sum()

    w = drafter.weights
    U, cand = torch.topk(logits.detach(), cfg.selector_top_k, -1)  # [M, B-1, K]
    hit = cand == gold[..., None]
    missing = ~hit.any(-1)
    cand = torch.where(missing[..., None] & (torch.arange(cfg.selector_top_k, device=device) == cfg.selector_top_k - 1),
                       gold[..., None], cand)
    U = torch.gather(logits.detach(), -1, cand)
    pred = tokens[seq[:, None], prev.clamp(max=T - 1)]  # teacher-forced predecessor x_{a+k-1}
    z = F.linear(h, w["candidate_selector.hidden_projection.weight"])
    score = U + torch.einsum("mrj,mrj,mrkj->mrk", w["candidate_selector.predecessor_codebook"][pred], z,
                             w["candidate_selector.successor_codebook"][cand])
    label = (cand == gold[..., None]).float().argmax(-1)
    sel = F.cross_entropy(score.flatten(0, 1), label.flatten(), reduction="none").view_as(weight)
    selector = (sel * weight).sum() / weight.sum()
    with torch.no_grad():
        head_top1 = ((logits.argmax(-1) == gold) & valid).sum(0) / valid.sum(0).clamp(min=1)
        walk = torch.where(missing, -1, label)  # a walk over the head's own top-K cannot pick a missing gold
        walk_top1 = ((score.argmax(-1) == walk) & valid).sum(0) / valid.sum(0).clamp(min=1)
    return DrafterLosses(main, selector, head_top1, walk_top1)


class DrafterTrainer:
    """The drafter's fp32 leaf weights, AdamW and the data position; the target is frozen."""

    def __init__(self, config_dict: dict, target: GLMModel, settings: DrafterSettings, device: str | torch.device,
                 params: dict[str, torch.Tensor] | None = None):
        self.config_dict, self.settings, self.device = config_dict, settings, torch.device(device)
        self.config = dflash.DFlash2Config.from_dict(config_dict)
        if params is None:
            params = dflash.init_drafter_weights(self.config, seed=settings.seed)
        self.params = {n: w.to(self.device).requires_grad_() for n, w in params.items()}
        self.drafter = dflash.DFlash2Drafter(self.config, self.params, target)
        names = sorted(self.params)
        decay = [self.params[n] for n in names if self.params[n].dim() == 2]
        rest = [self.params[n] for n in names if self.params[n].dim() != 2]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": settings.weight_decay},
                                            {"params": rest, "weight_decay": 0.0}],
                                           lr=settings.lr, betas=(0.9, 0.95), eps=1e-8)
        self.step_index = 0
        self.data_pos = 0
        self.total_steps: int | None = None

    def anchors(self, step: int) -> torch.Generator:
        """The anchor sampler of one step: a function of the step alone, so a resume replays it."""
        return torch.Generator().manual_seed(self.settings.seed * 7919 + step)

    def step(self, stream: torch.Tensor) -> DrafterLosses:
        s = self.settings
        tokens = train_batch(stream, self.data_pos, s)[:, :s.seq_len].to(self.device)
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step_index, self.total_steps, s)
        losses = drafter_losses(self.drafter, tokens, s.anchors, self.anchors(self.step_index), s)
        self.optimizer.zero_grad(set_to_none=True)
        losses.total.backward()
        torch.nn.utils.clip_grad_norm_(list(self.params.values()), s.grad_clip)
        self.optimizer.step()
        self.step_index += 1
        self.data_pos += s.batch_size
        return losses

    def state(self) -> dict:
        return {"config_dict": self.config_dict, "settings": asdict(self.settings),
                "params": {n: p.detach().cpu() for n, p in self.params.items()},
                "optimizer": self.optimizer.state_dict(), "step": self.step_index, "data_pos": self.data_pos,
                "total_steps": self.total_steps}

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        torch.save(self.state(), tmp)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path, target: GLMModel, device: str | torch.device) -> "DrafterTrainer":
        st = torch.load(path, map_location="cpu", weights_only=False)
        t = cls(st["config_dict"], target, DrafterSettings(**st["settings"]), device, st["params"])
        t.optimizer.load_state_dict(st["optimizer"])
        t.step_index, t.data_pos, t.total_steps = st["step"], st["data_pos"], st["total_steps"]
        return t

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.params.items()}


def load_target(path: Path, device: torch.device) -> GLMModel:
    """The frozen target in fp32 (its BF16 export: the drafter learns the weights the engine serves)."""
    config = GLMConfig.from_file(path)
    return GLMModel(config, checkpoint.load_weights(path, config, torch.float32, device, progress=False))


@torch.no_grad()
def evaluate_drafter(drafter: dflash.DFlash2Drafter, batches: list[torch.Tensor], s: DrafterSettings) -> DrafterLosses:
    """The losses and per-row agreement on held-out windows with fixed anchors, averaged over batches."""
    g = torch.Generator().manual_seed(12345)
    device = drafter.w("norm.weight").device
    parts = [drafter_losses(drafter, b[:, :s.seq_len].to(device), s.anchors, g, s) for b in batches]
    return DrafterLosses(*(sum(getattr(p, f) for p in parts) / len(parts)
                           for f in ("main", "selector", "head_top1", "walk_top1")))


def drafter_report(ev: DrafterLosses) -> str:
    head = " ".join(f"{100 * x:.0f}" for x in ev.head_top1.tolist())
    walk = " ".join(f"{100 * x:.0f}" for x in ev.walk_top1.tolist())
    return (f"held-out loss {ev.main.item():.3f} selector {ev.selector.item():.3f}; top-1 agreement with the "
            f"target by block row 1..{len(ev.head_top1)} (teacher-forced, %): head {head}; selector {walk}")


# ---------------------------------------------------------------------------------------------
# Command line

def held_check(model: GLMModel, tokens: torch.Tensor) -> str:
    ev = compute_losses(model, tokens, grad=False)
    return f"held-out loss {ev.main.item():.3f} mtp {ev.mtp.item():.3f} (first {tokens.shape[0]} windows)"


def run_schedule(trainer: "Trainer | DrafterTrainer", stream: torch.Tensor, minutes: float, state_path: Path,
                 save_every: float, held_check) -> None:
    """Steps until trainer.total_steps or the budget: the step count is planned from the first steps'
    time when not given; a held-out check every 50 steps (`held_check()` -> a line); the state is
    saved every `save_every` minutes and at the end, so --resume continues exactly."""
    budget, device = minutes * 60, trainer.device
    t_train, last_save, timed = time.time(), time.time(), []
    while trainer.total_steps is None or trainer.step_index < trainer.total_steps:
        if time.time() - t_train > budget:
            print(f"training budget spent at step {trainer.step_index}", flush=True)
            break
        t0 = time.time()
        losses = trainer.step(stream)
        if device.type == "cuda":
            torch.cuda.synchronize()
        timed.append(time.time() - t0)
        if trainer.total_steps is None and len(timed) == TIMING_STEPS:
            per_step = sum(timed[2:]) / len(timed[2:])  # the first steps carry start-up costs
            # 5% margin for the held-out checks and state saves, so the schedule runs to its end
            trainer.total_steps = trainer.step_index + max(1, int(0.95 * (budget - (time.time() - t_train)) / per_step))
            print(f"{per_step:.3f} s per step: planning {trainer.total_steps} steps", flush=True)
        if trainer.step_index % 10 == 0 or trainer.step_index == 1:
            if not math.isfinite(losses.total.item()):
                raise FloatingPointError(f"step {trainer.step_index}: the loss is {losses.total.item()}; "
                                         f"the last good state is {state_path}")
            print(f"step {trainer.step_index}: {losses} lr {trainer.optimizer.param_groups[0]['lr']:.2e} "
                  f"({timed[-1]:.2f} s/step)", flush=True)
        if trainer.step_index % 50 == 0:
            print(f"step {trainer.step_index}: {held_check()}", flush=True)
        if time.time() - last_save > save_every * 60:
            trainer.save(state_path)
            last_save = time.time()
    if trainer.total_steps is None:
        trainer.total_steps = trainer.step_index
    trainer.save(state_path)
    s = trainer.settings
    print(f"trained {trainer.step_index} steps ({trainer.data_pos * s.seq_len:,} tokens) in "
          f"{time.time() - t_train:.0f} s; state in {state_path}", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="folder for the training state and the exports")
    ap.add_argument("--minutes", required=True, type=float, help="wall-clock training budget (export and evaluation come after)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--resume", action="store_true", help=f"continue from OUT/{STATE_FILE} (OUT/{DRAFTER_STATE_FILE})")
    ap.add_argument("--steps", type=int, help="total optimizer steps (default: as many as the budget allows, "
                                                "estimated from the first steps' time)")
    ap.add_argument("--save-every", type=float, default=2.0, help="minutes between training-state saves")
    ap.add_argument("--drafter", action="store_true", help="train the DFlash2 drafter against --target instead")
    ap.add_argument("--target", type=Path, help="with --drafter: the trained model's BF16 export (default_weights/bf16)")
    args = ap.parse_args(argv)
    if args.drafter != (args.target is not None):
        ap.error("--drafter and --target go together")

    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    tok = make_tokenizer()
    template = default_model.TEMPLATE.read_text()
    corpus = load_corpus(tok, template)
    print(f"corpus: {corpus.train.numel():,} training tokens, {corpus.held.numel():,} held out "
          f"({time.time() - t_start:.0f} s to build)", flush=True)
    (train_drafter if args.drafter else train_model)(args, tok, corpus, device)
    print(f"total {time.time() - t_start:.0f} s", flush=True)


def train_model(args: argparse.Namespace, tok: Tokenizer, corpus: Corpus, device: torch.device) -> None:
    state_path = args.out / STATE_FILE
    if args.resume:
        if not state_path.is_file():
            raise FileNotFoundError(f"--resume: {state_path} does not exist")
        trainer = Trainer.load(state_path, device)
        print(f"resumed at step {trainer.step_index} of {trainer.total_steps}", flush=True)
    else:
        torch.manual_seed(Settings().seed)
        trainer = Trainer(model_config(tok), Settings(), device)
    if args.steps is not None:
        trainer.total_steps = args.steps
    s = trainer.settings
    n_params = sum(p.numel() for p in trainer.params.values())
    print(f"model: {n_params / 1e6:.2f} M parameters, batch {s.batch_size} x {s.seq_len} tokens, device {device}", flush=True)
    held = held_batches(corpus.held, s.seq_len, 64, 16)
    run_schedule(trainer, corpus.train, args.minutes, state_path, args.save_every,
                 functools.partial(held_check, trainer.model, held[0].to(device)))

    t0 = time.time()
    folders = export(args.out, trainer.config_dict, trainer.weights(), tok)
    print(f"exported {', '.join(folders)} in {time.time() - t0:.0f} s", flush=True)
    del trainer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    t0 = time.time()
    results = evaluate(folders, held, device)
    print(f"evaluated on {sum(b.shape[0] for b in held)} held-out windows of {s.seq_len} tokens "
          f"in {time.time() - t0:.0f} s", flush=True)
    print(table(results), flush=True)
    (args.out / "eval.json").write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    prompts = ["What does json.dumps do?", "Explain the Python topic 'assert'."]
    for variant in ("bf16", f"exl3-{max(BITS)}bit"):
        for p, reply in zip(prompts, sample_replies(folders[variant], device, prompts)):
            print(f"[{variant}] {p!r} -> {reply!r}", flush=True)


def train_drafter(args: argparse.Namespace, tok: Tokenizer, corpus: Corpus, device: torch.device) -> None:
    """The DFlash2 drafter against the frozen --target; writes OUT/dflash2 (config.json + BF16
    model.safetensors, the published layout) and OUT/dflash2/eval.json."""
    target = load_target(args.target, device)
    state_path = args.out / DRAFTER_STATE_FILE
    if args.resume:
        if not state_path.is_file():
            raise FileNotFoundError(f"--resume: {state_path} does not exist")
        trainer = DrafterTrainer.load(state_path, target, device)
        print(f"resumed at step {trainer.step_index} of {trainer.total_steps}", flush=True)
    else:
        trainer = DrafterTrainer(drafter_config(target.config, tok), target, DrafterSettings(), device)
    if args.steps is not None:
        trainer.total_steps = args.steps
    s, cfg = trainer.settings, trainer.config
    n_params = sum(p.numel() for p in trainer.params.values())
    print(f"drafter: {n_params / 1e6:.2f} M parameters, {cfg.num_hidden_layers} layers, taps "
          f"{list(cfg.target_layer_ids)}, block {cfg.block_size}, mask id {cfg.mask_token_id}; batch "
          f"{s.batch_size} x {s.seq_len} tokens, {s.anchors} blocks per sequence, device {device}", flush=True)
    held = held_batches(corpus.held, s.seq_len, 64, 16)
    run_schedule(trainer, corpus.train, args.minutes, state_path, args.save_every,
                 lambda: drafter_report(evaluate_drafter(trainer.drafter, held[:1], s)))
    folder = dflash.write_drafter(args.out / "dflash2", trainer.config_dict, trainer.weights())
    drafter = dflash.load_drafter(folder, target)  # the BF16 file, read back as the engine reads it
    ev = evaluate_drafter(drafter, held, s)
    print(f"exported {folder}: {drafter_report(ev)} ({sum(b.shape[0] for b in held)} windows)", flush=True)
    (folder / "eval.json").write_text(json.dumps(
        {"steps": trainer.step_index, "tokens": trainer.data_pos * s.seq_len, "held_out_loss": ev.main.item(),
         "held_out_selector_loss": ev.selector.item(), "head_top1_by_row": ev.head_top1.tolist(),
         "selector_top1_by_row": ev.walk_top1.tolist()}, indent=2) + "\n")


if __name__ == "__main__":
    main()

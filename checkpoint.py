"""GLM-5.3-Flash checkpoints: tensor names and shapes, reading (BF16/FP8/EXL3 safetensors), writing.

`expected_tensors` is the one place that knows the checkpoint layout (spec glm53.md §2). Names used
in memory drop the checkpoint prefix (`model.language_model.` or, text-only, `model.`);
`lm_head.weight` keeps its name. The format of each tensor is read from the files themselves (key
suffixes and dtypes), never from `quantization_config`, so mixed checkpoints (EXL3 experts with an
FP8 or BF16 core) need no special casing. The last section builds a tiny random model (config and
weights) for the built-in default model and the tests.
"""
from __future__ import annotations

import copy
import json
import math
import zlib
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

import exl3
import fp8

TEXT_PREFIXES = ("model.language_model.", "model.")
VISION_PREFIX = "model.visual."
HEAD_NAME = "lm_head.weight"
FLOAT = frozenset({"BF16", "F16", "F32"})
LINEAR = FLOAT | {"F8_E4M3"}
EXL3_SUFFIXES = exl3.TENSOR_KEYS


class CheckpointError(ValueError):
    """A checkpoint does not match the config: names the tensor(s) and the shapes/dtypes involved."""


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtypes: frozenset[str]
    linear: bool = False  # a projection [out, in]: may be stored FP8 block-128 or EXL3
    fp32: bool = False  # kept in fp32 after loading, whatever the model dtype


@dataclass(frozen=True)
class Stored:
    """Where one expected tensor lives. `format`: "plain" | "fp8" | "exl3" ("missing" only inside a
    failed check); `keys`: role ("weight", "weight_scale_inv" or an EXL3 suffix) -> checkpoint key."""
    format: str
    keys: dict[str, str]


@dataclass
class Inventory:
    specs: dict[str, TensorSpec]  # expected_tensors(config)
    stored: dict[str, Stored]
    skipped: list[str] = field(default_factory=list)  # vision tower keys (and MTP keys left out), read by nobody


# ---------------------------------------------------------------------------------------------
# Layout (spec §2)

def _t(*shape: int, fp32: bool = False) -> TensorSpec:
    return TensorSpec(tuple(shape), FLOAT, fp32=fp32)


def _lin(out_features: int, in_features: int) -> TensorSpec:
    return TensorSpec((out_features, in_features), LINEAR, linear=True)


def is_dsa_layer(config: Any, layer: int) -> bool:
    """The MTP layer (index num_hidden_layers) is always DSA (spec §2.6)."""
    return layer >= config.num_hidden_layers or config.layer_types[layer] == "dsa"


def _hc_tensors(config: Any) -> dict[str, TensorSpec]:
    hc, d = config.hc_mult, config.hidden_size
    out: dict[str, TensorSpec] = {}
    for sub in ("attn", "ffn"):
        out[f"hc_{sub}_fn"] = _t((2 + hc) * hc, hc * d)
        out[f"hc_{sub}_base"] = _t((2 + hc) * hc, fp32=True)
        out[f"hc_{sub}_scale"] = _t(3, fp32=True)
    return out


def _kda_tensors(config: Any) -> dict[str, TensorSpec]:
    d, h, dh = config.hidden_size, config.linear_num_heads, config.linear_head_dim
    c = h * dh
    out = {f"{x}_proj.weight": _lin(c, d) for x in "qkv"}
    out |= {f"{x}_conv1d.weight": _t(c, 1, config.linear_conv_kernel) for x in "qkv"}
    out |= {
        "f_a_proj.weight": _lin(dh, d), "f_b_proj.weight": _lin(c, dh),
        "g_a_proj.weight": _lin(dh, d), "g_b_proj.weight": _lin(c, dh),
        "b_proj.weight": _lin(h, d),
        "A_log": _t(h, fp32=True), "dt_bias": _t(c, fp32=True),
        "o_norm.weight": _t(dh), "o_proj.weight": _lin(d, c),
    }
    return out


def _dsa_tensors(config: Any) -> dict[str, TensorSpec]:
    d, nh = config.hidden_size, config.num_attention_heads
    qr, kvr = config.q_lora_rank, config.kv_lora_rank
    # NoPE MLA: GLMConfig rejects qk_rope_head_dim != 0, so there are no RoPE rows or columns.
    nope, vd = config.qk_nope_head_dim, config.v_head_dim
    ih, idim = config.index_n_heads, config.index_head_dim
    return {
        "q_a_proj.weight": _lin(qr, d),
        "q_a_layernorm.weight": _t(qr),
        "q_b_proj.weight": _lin(nh * nope, qr),
        "kv_a_proj_with_mqa.weight": _lin(kvr, d),
        "kv_a_layernorm.weight": _t(kvr),
        "kv_b_proj.weight": _lin(nh * (nope + vd), kvr),
        "o_proj.weight": _lin(d, nh * vd),
        "indexer.wq_b.weight": _lin(ih * idim, qr),
        "indexer.wk.weight": _lin(idim, d),
        "indexer.k_norm.weight": _t(idim),
        "indexer.k_norm.bias": _t(idim),
        "indexer.weights_proj.weight": _lin(ih, d),
        "indexer.index_kpool_compress_gate": _t(idim, d),
        "indexer.index_kpool_compress_ape": _t(config.index_kpool, idim),
    }


def _mlp_tensors(config: Any, dense: bool) -> dict[str, TensorSpec]:
    d = config.hidden_size
    if dense:
        i = config.intermediate_size
        return {"gate_proj.weight": _lin(i, d), "up_proj.weight": _lin(i, d), "down_proj.weight": _lin(d, i)}
    i, si = config.moe_intermediate_size, config.moe_intermediate_size * config.n_shared_experts
    # The router computes in fp32 (spec §2.5), as transformers keeps it.
    out = {"gate.weight": _t(config.n_routed_experts, d, fp32=True),
           "gate.e_score_correction_bias": _t(config.n_routed_experts, fp32=True)}
    for e in range(config.n_routed_experts):
        out |= {f"experts.{e}.gate_proj.weight": _lin(i, d), f"experts.{e}.up_proj.weight": _lin(i, d),
                f"experts.{e}.down_proj.weight": _lin(d, i)}
    out |= {"shared_experts.gate_proj.weight": _lin(si, d), "shared_experts.up_proj.weight": _lin(si, d),
            "shared_experts.down_proj.weight": _lin(d, si)}
    return out


def _layer_tensors(config: Any, layer: int) -> dict[str, TensorSpec]:
    d = config.hidden_size
    mtp = layer == config.num_hidden_layers
    out = {"input_layernorm.weight": _t(d), "post_attention_layernorm.weight": _t(d)}
    if mtp:  # the MTP layer reuses the trunk's embed_tokens and lm_head and has no mHC (spec §2.6)
        out |= {"enorm.weight": _t(d), "hnorm.weight": _t(d), "eh_proj.weight": _lin(d, 2 * d),
                "shared_head.norm.weight": _t(d)}
    else:
        out |= _hc_tensors(config)
    attn = _dsa_tensors(config) if is_dsa_layer(config, layer) else _kda_tensors(config)
    out |= {f"self_attn.{k}": v for k, v in attn.items()}
    dense = not mtp and config.mlp_layer_types[layer] == "dense"
    out |= {f"mlp.{k}": v for k, v in _mlp_tensors(config, dense).items()}
    return {f"layers.{layer}.{k}": v for k, v in out.items()}


def expected_tensors(config: Any) -> dict[str, TensorSpec]:
    """Every language-model tensor the config implies, by in-memory name (checkpoint prefix dropped)."""
    d, v = config.hidden_size, config.vocab_size
    out = {"embed_tokens.weight": _t(v, d)}
    n_layers = config.num_hidden_layers + config.num_nextn_predict_layers
    if config.num_nextn_predict_layers not in (0, 1):
        raise CheckpointError(f"num_nextn_predict_layers={config.num_nextn_predict_layers}: only 0 or 1 is supported")
    for layer in range(n_layers):
        out |= _layer_tensors(config, layer)
    out["norm.weight"] = _t(d)
    out[HEAD_NAME] = _lin(v, d)
    return out


def fp8_in_official_release(config: Any, name: str) -> bool:
    """Whether the official FP8 checkpoint stores this linear as F8_E4M3 + weight_scale_inv (spec §3)."""
    parts = name.split(".")
    if parts[0] != "layers":
        return False
    layer, rest = int(parts[1]), ".".join(parts[2:])
    if rest.startswith("mlp.") and rest.endswith("_proj.weight"):
        return True  # dense MLP, shared experts, routed experts
    dsa_fp8 = ("q_a_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight", "o_proj.weight")
    return is_dsa_layer(config, layer) and rest in {f"self_attn.{x}" for x in dsa_fp8}


def is_routed_expert(name: str) -> bool:
    return ".mlp.experts." in name


# Projections model_glm multiplies itself (as fp32 tensors), so they stay tensors whatever the format.
TENSOR_PROJECTIONS = ("kv_b_proj.weight", "indexer.weights_proj.weight")


def is_fp8_core(name: str, spec: TensorSpec) -> bool:
    """A non-routed projection that may run as an FP8 block-128 linear (`fp8.FP8Linear`)."""
    return spec.linear and not is_routed_expert(name) and not name.endswith(TENSOR_PROJECTIONS)


# ---------------------------------------------------------------------------------------------
# Inventory check (headers only)

def _text_prefix(keys: list[str]) -> str:
    if any(k.startswith(TEXT_PREFIXES[0]) for k in keys):
        return TEXT_PREFIXES[0]
    return TEXT_PREFIXES[1]


def _fmt(shape) -> str:
    return "[" + ", ".join(str(x) for x in shape) + "]"


def _check_exl3(base: str, spec: TensorSpec, inventory: Mapping[str, tuple[str, tuple]],
                problems: list[str]) -> dict[str, str]:
    """Claim `<base>.{trellis, suh|su, svh|sv, mcg|mul1, bias}` for a linear of shape [out, in]
    (exl3.md §1.1: the trellis is (in/16, out/16, words); the codebook is the marker's presence)."""
    out_f, in_f = spec.shape
    keys = {s: f"{base}.{s}" for s in EXL3_SUFFIXES if f"{base}.{s}" in inventory}
    markers = [m for m in ("mcg", "mul1") if m in keys]
    if len(markers) > 1:
        problems.append(f"{base}: has both .mcg and .mul1 codebook markers")
    for m in markers:
        dtype, shape = inventory[keys[m]]
        if not dtype.startswith(("I", "U")) or math.prod(shape) != 1:
            problems.append(f"{keys[m]}: codebook marker is {dtype} {_fmt(shape)}, expected one integer")
    dtype, shape = inventory[keys["trellis"]]
    if in_f % exl3.HAD or out_f % exl3.HAD:
        problems.append(f"{base}: stored as EXL3, but EXL3 needs both dims of [{out_f}, {in_f}] to be multiples of 128")
    elif dtype != "I16" or len(shape) != 3 or tuple(shape[:2]) != (in_f // 16, out_f // 16):
        problems.append(f"{keys['trellis']}: EXL3 trellis is {dtype} {_fmt(shape)}, expected I16 "
                        f"[{in_f // 16}, {out_f // 16}, 16*K] for a [{out_f}, {in_f}] linear")
    else:
        try:
            exl3.bits_from_width(shape[2], markers[0] if markers else "3inst", keys["trellis"])
        except ValueError as e:
            problems.append(str(e))
    vectors = {"suh": (FLOAT, in_f), "svh": (FLOAT, out_f), "bias": (FLOAT, out_f),
               "su": ({"I16"}, in_f // 16), "sv": ({"I16"}, out_f // 16)}
    for suffix, (dtypes, n) in vectors.items():
        if suffix in keys:
            dtype, shape = inventory[keys[suffix]]
            if dtype not in dtypes or tuple(shape) != (n,):
                problems.append(f"{keys[suffix]}: is {dtype} {_fmt(shape)}, expected {'/'.join(sorted(dtypes))} [{n}]")
    for one, legacy in (("suh", "su"), ("svh", "sv")):
        if one not in keys and legacy not in keys:
            problems.append(f"{base}.{one}: missing (EXL3 linear {base} has a trellis but neither {one} nor {legacy})")
    return keys


def _claim(spec: TensorSpec, key: str, inventory: Mapping[str, tuple[str, tuple]],
           problems: list[str]) -> Stored | None:
    """The keys that hold one expected tensor (None if absent), appending any fault to `problems`.
    A faulty tensor's keys are still returned, so they are not reported again as unexpected."""
    base = key.removesuffix(".weight")
    if key not in inventory:
        if spec.linear and key.endswith(".weight") and f"{base}.trellis" in inventory:
            return Stored("exl3", _check_exl3(base, spec, inventory, problems))
        problems.append(f"{key}: missing (expected {_fmt(spec.shape)})")
        orphan = key + "_scale_inv"  # reported with its weight, not again as unexpected
        return Stored("missing", {"weight_scale_inv": orphan}) if orphan in inventory else None
    dtype, shape = inventory[key]
    scale_key = key + "_scale_inv"
    keys = {"weight": key} | ({"weight_scale_inv": scale_key} if scale_key in inventory and spec.linear else {})
    if tuple(shape) != spec.shape:
        problems.append(f"{key}: shape {_fmt(shape)} in the checkpoint, {_fmt(spec.shape)} expected from the config")
    elif dtype not in spec.dtypes:
        problems.append(f"{key}: dtype {dtype}, expected one of {sorted(spec.dtypes)}")
    elif dtype == "F8_E4M3":
        if scale_key not in inventory:
            problems.append(f"{scale_key}: missing (FP8 weight {key} needs its block scales)")
        else:
            s_dtype, s_shape = inventory[scale_key]
            if s_dtype != "F32" or tuple(s_shape) != fp8.scale_grid(*spec.shape):
                problems.append(f"{scale_key}: is {s_dtype} {_fmt(s_shape)}, "
                                f"expected F32 {_fmt(fp8.scale_grid(*spec.shape))}")
        return Stored("fp8", keys)
    elif "weight_scale_inv" in keys:  # a scale next to an unquantized weight: left unclaimed
        del keys["weight_scale_inv"]
    return Stored("plain", keys)


def _raise(problems: list[str], what: str) -> None:
    if problems:
        shown = problems[:20]
        more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
        raise CheckpointError(f"{what}: {len(problems)} problem(s)\n  " + "\n  ".join(shown) + more)


def check_inventory(inventory: Mapping[str, tuple[str, tuple]], config: Any, mtp: bool = True) -> Inventory:
    """Match checkpoint keys (name -> (safetensors dtype, shape)) against the config's layout.

    Every language-model tensor must be present with the shape the config implies, as a plain
    float tensor, FP8 block-128 (+ `weight_scale_inv`) or EXL3 (linears only); `model.visual.*` is
    skipped; anything else is an error. All problems are reported together, each naming its key.
    mtp=False: the MTP layer's tensors are checked but left out of `stored` (nobody reads them)."""
    keys = list(inventory)
    prefix = _text_prefix(keys)
    problems: list[str] = []
    stored: dict[str, Stored] = {}
    claimed: set[str] = set()
    specs = expected_tensors(config)
    for name, spec in specs.items():
        key = name if name == HEAD_NAME else prefix + name
        before = len(problems)
        s = _claim(spec, key, inventory, problems)
        if s is not None:
            claimed.update(s.keys.values())
            if len(problems) == before:
                stored[name] = s
    skipped = [k for k in keys if k.startswith(VISION_PREFIX)]
    problems += [f"{k}: unexpected tensor (not in the layout the config implies)" for k in keys
                 if k not in claimed and not k.startswith(VISION_PREFIX)]
    _raise(problems, "checkpoint does not match the config")
    if not mtp and config.mtp_layer is not None:
        mine = f"layers.{config.mtp_layer}."
        skipped += [k for name, s in stored.items() if name.startswith(mine) for k in s.keys.values()]
        stored = {name: s for name, s in stored.items() if not name.startswith(mine)}
    return Inventory(specs, stored, skipped)


# ---------------------------------------------------------------------------------------------
# Reading

def resolve_model_path(path_or_hf_id: str | Path) -> Path:
    """A local checkpoint folder as is; anything else is a Hugging Face Hub id to download."""
    path = Path(path_or_hf_id).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{path} is a file; a checkpoint is a folder (config.json + *.safetensors)")
    from huggingface_hub import snapshot_download
    try:
        return Path(snapshot_download(repo_id=str(path_or_hf_id)))
    except Exception as e:  # offline, unknown repo, invalid id: all end here with the cause attached
        raise CheckpointError(
            f"{str(path_or_hf_id)!r} is not a local folder, and downloading it from the Hugging Face Hub "
            f"failed ({type(e).__name__}: {e})") from e


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those the index names, else model.safetensors, else all."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.exists():
                raise CheckpointError(f"{f.name}: named by {index.name} but not found in {path}")
        return files
    if (path / "model.safetensors").exists():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no .safetensors files in {path}")
    return files


def read_inventory(files: list[Path]) -> tuple[dict[str, tuple[str, tuple]], dict[str, Path]]:
    """(name -> (dtype, shape), name -> file) from the safetensors headers alone."""
    inventory: dict[str, tuple[str, tuple]] = {}
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(f, framework="pt") as st:
            for k in st.keys():
                if k in where:
                    raise CheckpointError(f"{k}: stored twice, in {where[k].name} and {f.name}")
                sl = st.get_slice(k)
                inventory[k] = (sl.get_dtype(), tuple(sl.get_shape()))
                where[k] = f
    index = files[0].parent / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        disagree = sorted(set(weight_map) ^ set(where))
        if disagree:
            raise CheckpointError(f"{disagree[0]}: in only one of {index.name} and the shard headers "
                                  f"({len(disagree)} key(s) disagree)")
        for k, f in weight_map.items():
            if where[k].name != f:
                raise CheckpointError(f"{k}: {index.name} says {f}, the tensor is in {where[k].name}")
    return inventory, where


_FLOAT_BYTES = {"BF16": 2, "F16": 2, "F32": 4}


def weight_bytes(path: str | Path, config: Any, dtype: torch.dtype = torch.bfloat16, *,
                 mtp: bool = True) -> dict[str, int]:
    """Bytes each weight will take once loaded (what `load_weights` makes of it), by in-memory name,
    from the headers alone: plain and FP8 tensors in `dtype` (fp32 ones in fp32; FP8 is dequantized),
    an EXL3 linear as its int16 trellis, fp16 suh/svh and its bias as stored. placement.py plans
    devices from these. (On CPU an EXL3 linear also keeps its decoded Ŵ, not counted here.)
    mtp=False: without the MTP layer's, as load_weights(mtp=False) leaves them out."""
    inventory, _ = read_inventory(checkpoint_files(Path(path)))
    plan = check_inventory(inventory, config, mtp)
    size = torch.empty((), dtype=dtype).element_size()
    out = {}
    for name, s in plan.stored.items():
        spec = plan.specs[name]
        if s.format == "exl3":
            out_f, in_f = spec.shape
            out[name] = 2 * math.prod(inventory[s.keys["trellis"]][1]) + 2 * (in_f + out_f)
            if "bias" in s.keys:
                b_dtype, b_shape = inventory[s.keys["bias"]]
                out[name] += _FLOAT_BYTES[b_dtype] * math.prod(b_shape)
        else:
            out[name] = math.prod(spec.shape) * (4 if spec.fp32 else size)
    return out


def load_weights(path: str | Path, config: Any, dtype: torch.dtype = torch.bfloat16,
                 device: str | torch.device | Callable[[str], torch.device] = "cpu",
                 progress: bool = True, *, fp8_core: str | None = None, mtp: bool = True) -> dict[str, Any]:
    """Language-model weights by in-memory name: tensors in `dtype` (fp32 ones stay fp32), FP8
    dequantized, EXL3 linears as `exl3.EXL3Linear`. The inventory is checked before any data is read.
    `device` is one device for every weight, or a function of the in-memory name (a placement).
    mtp=False: the MTP layer's tensors are checked but not read (a model without its speculator:
    `config.without_mtp()`).

    fp8_core "amax" | "pow2": every non-routed projection (`is_fp8_core`) becomes an `fp8.FP8Linear`,
    half the bytes of BF16: stored FP8 as stored (the checkpoint's scales), anything else quantized
    here with that scale rule (`fp8.quantize_fp8_block`)."""
    if fp8_core is not None and fp8_core not in fp8.SCALE_RULES:
        raise ValueError(f"fp8_core must be one of {fp8.SCALE_RULES} or None, got {fp8_core!r}")
    files = checkpoint_files(Path(path))
    inventory, where = read_inventory(files)
    plan = check_inventory(inventory, config, mtp)
    device_of = device if callable(device) else (lambda name, d=torch.device(device): d)
    weights: dict[str, Any] = {}
    with ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(f, framework="pt")) for f in files}

        def get(key: str) -> torch.Tensor:
            return handles[where[key]].get_tensor(key)

        for name, s in tqdm(plan.stored.items(), desc="loading weights", unit="tensor", disable=not progress):
            device = device_of(name)
            if s.format == "exl3":
                parts = {suffix: get(key) for suffix, key in s.keys.items()}
                weights[name] = exl3.EXL3Linear.from_tensors(parts, name=name).to(device)
                continue
            want = torch.float32 if plan.specs[name].fp32 else dtype
            w = get(s.keys["weight"]).to(device)
            if fp8_core and is_fp8_core(name, plan.specs[name]):
                weights[name] = (fp8.FP8Linear(w, get(s.keys["weight_scale_inv"]).to(device), name=name)
                                 if s.format == "fp8" else fp8.FP8Linear.from_weight(w, fp8_core, name=name))
                continue
            if s.format == "fp8":
                w = fp8.dequantize_fp8_block(w, get(s.keys["weight_scale_inv"]).to(device), want)
            weights[name] = w.to(want)
    return weights


# ---------------------------------------------------------------------------------------------
# Writing

def _config_object(config_dict: dict) -> Any:
    # Imported here, not at the top: model_glm sits above this module (DESIGN.md).
    from model_glm import GLMConfig
    return GLMConfig.from_dict(config_dict)


def _bits_for(bits: float | Mapping[int, float], name: str) -> float:
    if isinstance(bits, Mapping):
        layer = int(name.split(".")[1])
        if layer not in bits:
            raise CheckpointError(f"{name}: no EXL3 bits given for layer {layer} (bits has layers {sorted(bits)})")
        return bits[layer]
    return bits


def _exl3_quantization_config(linears: dict[str, exl3.EXL3Linear], original: dict | None) -> dict:
    """exllamav3's keys (exl3.md §1.2): `bits` is the weight-count average K of the EXL3 linears."""
    sizes = {n: lin.in_features * lin.out_features for n, lin in linears.items()}
    codebooks = sorted({lin.codebook for lin in linears.values()})
    qc = {"quant_method": "exl3",
          "bits": sum(lin.bits * sizes[n] for n, lin in linears.items()) / sum(sizes.values()),
          "head_bits": linears[HEAD_NAME].bits if HEAD_NAME in linears else 16,
          "codebook": codebooks[0] if len(codebooks) == 1 else codebooks}
    if original is not None:
        qc["original_quantization_config"] = original
    return qc


def _encode(config: Any, weights: Mapping[str, Any], experts: str, core: str, bits, codebook: str,
            progress: bool) -> tuple[dict[str, torch.Tensor], dict[str, exl3.EXL3Linear]]:
    """In-memory weights -> checkpoint tensors (in-memory names) in the requested formats, and
    the EXL3 linears among them."""
    specs = expected_tensors(config)
    out: dict[str, torch.Tensor] = {}
    linears: dict[str, exl3.EXL3Linear] = {}
    for name, w in tqdm(weights.items(), desc="encoding weights", unit="tensor", disable=not progress):
        fmt = experts if is_routed_expert(name) else core
        if isinstance(w, exl3.EXL3Linear) or fmt == "exl3":
            lin = w if isinstance(w, exl3.EXL3Linear) else \
                exl3.quantize(w.float(), _bits_for(bits, name), codebook=codebook, seed=zlib.crc32(name.encode()))
            linears[name] = lin
            out |= {f"{name.removesuffix('.weight')}.{k}": t for k, t in lin.tensors().items()}
        elif fmt == "fp8" and fp8_in_official_release(config, name):
            out[name], out[name + "_scale_inv"] = fp8.quantize_fp8_block(w, "amax")
        elif specs[name].fp32:
            out[name] = w.float().contiguous()
        else:
            out[name] = w.to(torch.bfloat16).contiguous()
    return out, linears


def write_checkpoint(path: str | Path, config_dict: dict, weights: Mapping[str, Any], experts: str = "bf16",
                     core: str = "bf16", bits: float | Mapping[int, float] = 4, codebook: str = "mcg",
                     shard_size: int = 4 << 30, progress: bool = False) -> Path:
    """Write the real layout: config.json, generation_config.json, model-0000i-of-0000N.safetensors
    + model.safetensors.index.json (or one model.safetensors).

    `weights` uses in-memory names (as `load_weights` returns them). `experts` ("bf16" | "fp8" |
    "exl3") is the routed experts' format, `core` ("bf16" | "fp8") the rest's; FP8 applies to the
    linears the official release quantizes (spec §3). EXL3 experts get `bits` (one value, or one
    per layer index) with `codebook`. An `EXL3Linear` value is written as it is."""
    if experts not in ("bf16", "fp8", "exl3"):
        raise CheckpointError(f"experts={experts!r}: expected 'bf16', 'fp8' or 'exl3'")
    if core not in ("bf16", "fp8"):
        raise CheckpointError(f"core={core!r}: expected 'bf16' or 'fp8'")
    config = _config_object(config_dict)
    specs = expected_tensors(config)
    problems = [f"{n}: missing from the weights to write" for n in specs if n not in weights]
    problems += [f"{n}: not a tensor of this model's layout" for n in weights if n not in specs]
    for n, w in weights.items():
        if n not in specs:
            continue
        if isinstance(w, exl3.EXL3Linear):
            if not specs[n].linear or (w.out_features, w.in_features) != specs[n].shape:
                problems.append(f"{n}: an EXL3 linear [out {w.out_features}, in {w.in_features}], "
                                f"expected {'a linear ' if specs[n].linear else 'a plain tensor '}{_fmt(specs[n].shape)}")
        elif tuple(w.shape) != specs[n].shape:
            problems.append(f"{n}: shape {_fmt(w.shape)}, expected {_fmt(specs[n].shape)}")
    _raise(problems, "weights do not match the config")

    tensors, linears = _encode(config, weights, experts, core, bits, codebook, progress)
    prefix = TEXT_PREFIXES[0] if "text_config" in config_dict else TEXT_PREFIXES[1]
    tensors = {(k if k == HEAD_NAME else prefix + k): t for k, t in tensors.items()}

    cfg = dict(config_dict)
    fp8_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                  "weight_block_size": [fp8.BLOCK, fp8.BLOCK]}
    any_fp8 = core == "fp8" or experts == "fp8"
    if linears:
        cfg["quantization_config"] = _exl3_quantization_config(linears, fp8_config if any_fp8 else None)
    elif any_fp8:
        cfg["quantization_config"] = fp8_config
    else:
        cfg.pop("quantization_config", None)

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    text = config_dict.get("text_config", config_dict)
    generation = {"eos_token_id": text.get("eos_token_id"), "pad_token_id": text.get("pad_token_id"),
                  "temperature": 1.0, "top_p": 0.95}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    _write_shards(path, tensors, shard_size)
    return path


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _write_shards(path: Path, tensors: dict[str, torch.Tensor], shard_size: int) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k in sorted(tensors):
        t = tensors[k]
        if shards[-1] and size + _nbytes(t) > shard_size:
            shards.append({})
            size = 0
        shards[-1][k] = t.detach().cpu().contiguous()
        size += _nbytes(t)
    for stale in list(path.glob("model*.safetensors")) + list(path.glob("model.safetensors.index.json")):
        stale.unlink()
    if len(shards) == 1:
        save_file(shards[0], path / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path / fname, metadata={"format": "pt"})
        weight_map |= {k: fname for k in shard}
    index = {"metadata": {"total_size": sum(_nbytes(t) for t in tensors.values())}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# A tiny random model: the built-in default model and the tests (spec glm53.md §7.2). The config is
# the real multimodal layout (top level + `text_config` + a tiny `vision_config`), so the same dict
# feeds this engine and transformers' `Glm5NextConfig` oracle. Deterministic in its arguments.

_TINY_TEXT = dict(
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
_TINY_LINEAR_ATTN = {"num_heads": 4, "head_dim": 32, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0}
_TINY_VISION = dict(model_type="glm5_next_vision", depth=1, hidden_size=32, num_heads=2, intermediate_size=64,
                    out_hidden_size=256, projection_intermediate_size=64)


def tiny_config_dict(**overrides: Any) -> dict:
    """config.json of a 4-layer model: layers 1 and 3 DSA, 0 and 2 KDA, layer 0 dense, 8 experts
    top-2, MTP on. `overrides` are text_config fields; per-layer lists follow `num_hidden_layers`
    (DSA on odd layers) and `first_k_dense_replace` unless given."""
    text = {**copy.deepcopy(_TINY_TEXT), **overrides}
    n = text["num_hidden_layers"]
    dsa = [i for i in range(n) if i % 2 == 1]
    text.setdefault("layer_types", ["deepseek_sparse_attention" if i in dsa else "linear_attention"
                                    for i in range(n)])
    text.setdefault("mlp_layer_types", ["dense" if i < text["first_k_dense_replace"] else "sparse"
                                        for i in range(n)])
    text.setdefault("indexer_types", ["full"] * n)
    lin = {**_TINY_LINEAR_ATTN, **text.get("linear_attn_config", {})}
    lin["kda_layers"] = [i for i, t in enumerate(text["layer_types"]) if t == "linear_attention"]
    lin["full_attn_layers"] = [i for i, t in enumerate(text["layer_types"]) if t != "linear_attention"]
    text["linear_attn_config"] = lin
    return {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next",
            "tie_word_embeddings": False, "text_config": text, "vision_config": dict(_TINY_VISION)}


def random_init(name: str, spec: TensorSpec, g: torch.Generator) -> torch.Tensor:
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
    for name, spec in expected_tensors(config).items():
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        w = random_init(name, spec, g)
        out[name] = w if spec.fp32 else w.to(torch.bfloat16).float()
    return out

"""GLM-5.3-Flash's vision tower: an image -> the rows that stand for it in the language model's input, in place of
the <|image|> tokens the chat template writes (spec glm53.md §1.2: `vision_config`, the 347 `model.visual.*`
tensors; transformers' Glm5NextImageProcessor (its PIL backend) and Glm5NextVisionModel are the oracle).

An image is resized, aspect kept, into a canvas of whole 28-pixel cells within a budget of tokens (bicubic, black
padding right and below), scaled to [0, 1], normalized with CLIP's mean and std and cut into 14-pixel patches, each
written twice: the patch embedding reads two frames, and an image is a video of one frame held for two. Each 2x2
block of patches becomes one token, so an image of gh x gw patches stands for gh * gw / 4 <|image|> tokens; the
patches are laid out block by block, so a block's four patches are consecutive rows.

The tower, on the patches of one image (attention never crosses images; a run takes several at once):
    x = patch_embed(patches)                                   a linear over the 3 x 2 x 14 x 14 values
    depth blocks:  x = x + attn(rms_norm(x)),  x = x + mlp(rms_norm(x))
        attn: q, k, v = qkv(x); q, k = rms_norm per head; the axial rotary embedding of the patch's row and
              column; softmax(q k^T / sqrt(head_dim)) v over all the image's patches; proj
        mlp: down(silu(min(gate(x), limit)) * clamp(up(x), -limit, limit))
    x = rms_norm(x); y = downsample(the block's four rows)     a linear over 4 x hidden (a 2x2 conv)
    rows = merger(y): proj, LayerNorm, GELU, then the clamped SwiGLU of the MLP above (no biases)
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import math
import urllib.request
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
PREFIX = "model.visual."
IMAGE_TOKEN_ID = 154854  # <|image|> (spec glm53.md §1), where config.json names none


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int  # the language model's hidden size
    projection_intermediate_size: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    attention_bias: bool = True
    # the image processor's: its budget, in tokens of temporal_patch_size x 28 x 28 pixels, and normalization
    min_image_tokens: int = 16
    max_image_tokens: int = 8000
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD

    @classmethod
    def from_dict(cls, d: dict, processor: dict | None = None) -> VisionConfig:
        """config.json's vision_config (other keys, e.g. image_size, are not read), with the image processor's
        settings (`processor`: processor_config.json's image_processor) where the checkpoint has them."""
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"vision_config.hidden_act {d['hidden_act']!r}: the tower's MLPs are SiLU-gated")
        rope = d.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision_config.rope_parameters.rope_type {rope['rope_type']!r}: only axial")
        names = {f.name for f in fields(cls)}
        cfg = cls(**{k: v for k, v in d.items() if k in names},
                  **({"rope_theta": float(rope["rope_theta"])} if "rope_theta" in rope else {}))
        p = processor or {}
        tower = {"patch_size": cfg.patch_size, "temporal_patch_size": cfg.temporal_patch_size,
                 "merge_size": cfg.spatial_merge_size, "patch_expand_factor": 1}
        for key, value in tower.items():
            if key in p and p[key] != value:
                raise ValueError(f"the image processor's {key} {p[key]} is not the tower's {value}")
        settings = {k: int(p[k]) for k in ("min_image_tokens", "max_image_tokens") if k in p}
        settings |= {k: tuple(p[k]) for k in ("image_mean", "image_std") if k in p}
        return replace(cfg, **settings)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def cell(self) -> int:
        """The side in pixels of the square one token covers."""
        return self.patch_size * self.spatial_merge_size


# ---------------------------------------------------------------------------------------------
# The image processor


MAX_IMAGE_BYTES = 20 << 20  # an image a request sends or names: as OpenAI's limit for one image
FETCH_TIMEOUT_S = 10


def open_image(source):
    """A PIL image from what a request gives: a PIL image, its file's bytes, a data URL (`data:image/png;base64,
    ...`) or an http(s) URL (fetched). A ValueError says what could not be read."""
    from PIL import Image

    if isinstance(source, Image.Image):
        return source
    if isinstance(source, str) and source.startswith("data:"):
        head, sep, body = source.partition(",")
        if not sep or not head.endswith(";base64"):
            raise ValueError(f"an image data URL must be data:<type>;base64,<data>; got {source[:40]!r}...")
        try:
            source = base64.b64decode(body, validate=True)
        except binascii.Error as e:
            raise ValueError(f"the image data URL's base64 is not valid: {e}") from None
    elif isinstance(source, str) and source.startswith(("http://", "https://")):
        source = _fetch(source)
    if not isinstance(source, bytes):
        raise ValueError(f"an image is a data URL, an http(s) URL, bytes or a PIL image; got {str(source)[:40]!r}")
    if len(source) > MAX_IMAGE_BYTES:
        raise ValueError(f"the image has {len(source)} bytes, more than {MAX_IMAGE_BYTES}")
    try:
        image = Image.open(io.BytesIO(source))
        image.load()
    except Exception as e:  # (PIL raises several kinds for a file it cannot read)
        raise ValueError(f"the image could not be decoded: {e}") from None
    return image


def _fetch(url: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as r:
            data = r.read(MAX_IMAGE_BYTES + 1)
    except (OSError, ValueError) as e:
        raise ValueError(f"the image at {url[:100]} could not be fetched: {e}") from None
    return data


def canvas(height: int, width: int, cfg: VisionConfig) -> tuple[int, int]:
    """The padded canvas (height, width), whole cells, for an image of height x width pixels: the image's own
    size rounded up, scaled up to min_image_tokens or down (by the tallest content height that fits, found by
    bisection) to max_image_tokens (transformers' smart_resize for a two-frame image)."""
    f, c = cfg.temporal_patch_size, cfg.cell
    lo_pixels, hi_pixels = cfg.min_image_tokens * f * c * c, cfg.max_image_tokens * f * c * c

    def align(v: int) -> int:
        return math.ceil(v / c) * c

    h, w = align(height), align(width)
    if f * h * w < lo_pixels:
        scale = math.sqrt(lo_pixels / (f * height * width))
        h, w = align(max(1, math.ceil(height * scale))), align(max(1, math.ceil(width * scale)))
    if f * h * w > hi_pixels:
        if hi_pixels < f * c * c:
            raise ValueError(f"max_image_tokens {cfg.max_image_tokens}: not one {c}x{c} cell fits")
        h, w, low, high = c, c, 1, height
        while low <= high:
            content = (low + high) // 2
            ch, cw = align(content), align(max(1, math.floor(width * content / height)))
            if f * ch * cw <= hi_pixels:
                h, w, low = ch, cw, content + 1
            else:
                high = content - 1
    return h, w


def canvas_pixels(image, cfg: VisionConfig) -> tuple[np.ndarray, tuple[int, int]]:
    """A PIL image resized into its canvas (canvas) and padded black right and below: uint8 [th, tw, 3], and its
    grid of patches (gh, gw)."""
    from PIL import Image

    rgb = image.convert("RGB")
    width, height = rgb.size
    th, tw = canvas(height, width, cfg)
    f, c = cfg.temporal_patch_size, cfg.cell
    scale = min(th / height, tw / width)
    if f * height * width >= f * c * c * cfg.min_image_tokens:  # (a small image is scaled up, a large one not)
        scale = min(1.0, scale)
    ch, cw = max(1, min(th, math.floor(height * scale))), max(1, min(tw, math.floor(width * scale)))
    if (ch, cw) != (height, width):
        rgb = rgb.resize((cw, ch), Image.BICUBIC)
    pixels = np.zeros((th, tw, 3), dtype=np.uint8)
    pixels[:ch, :cw] = np.asarray(rgb)
    return pixels, (th // cfg.patch_size, tw // cfg.patch_size)


def patchify(pixels: torch.Tensor, cfg: VisionConfig) -> torch.Tensor:
    """A canvas's uint8 pixels [th, tw, 3] (on any device) -> its patches, fp32 [gh * gw, 3 * 2 * 14 * 14] in block
    order: scaled to [0, 1], normalized, each patch written as its frames."""
    mean, std = (torch.tensor(v, device=pixels.device)[:, None, None] for v in (cfg.image_mean, cfg.image_std))
    x = (pixels.permute(2, 0, 1).float() / 255.0 - mean) / std
    p, m, f = cfg.patch_size, cfg.spatial_merge_size, cfg.temporal_patch_size
    gh, gw = pixels.shape[0] // p, pixels.shape[1] // p
    x = x.reshape(3, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)  # blocks, block rows, patch
    x = x[:, :, :, :, :, None].expand(-1, -1, -1, -1, -1, f, -1, -1)  # each patch as f frames
    return x.reshape(gh * gw, 3 * f * p * p)


def image_patches(image, cfg: VisionConfig) -> tuple[torch.Tensor, tuple[int, int]]:
    """A PIL image -> its patches, fp32 [gh * gw, 3 * 2 * 14 * 14] in block order, and its grid (gh, gw)."""
    pixels, grid = canvas_pixels(image, cfg)
    return patchify(torch.from_numpy(pixels), cfg), grid


def image_tokens(grid: tuple[int, int], cfg: VisionConfig) -> int:
    return grid[0] * grid[1] // cfg.spatial_merge_size ** 2


@dataclass(frozen=True)
class Prepared:
    """An image resized into its canvas (canvas_pixels: uint8, an eighth of its fp32 patches' bytes; the tower
    makes the patches on its device), its grid, the <|image|> tokens it stands for, and a digest of its pixels
    (the prefix cache's key for it)."""
    pixels: torch.Tensor
    grid: tuple[int, int]
    tokens: int
    digest: bytes

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]


def prepare(source, cfg: VisionConfig) -> Prepared:
    """An image as a request gives it (open_image) made ready for the tower: the CPU's part of reading it."""
    pixels, grid = canvas_pixels(open_image(source), cfg)
    return Prepared(torch.from_numpy(pixels), grid, image_tokens(grid, cfg),
                    hashlib.blake2b(pixels, digest_size=16).digest())


def write_out(ids: list[int], image_token_id: int, images: list[Prepared]) -> tuple[list[int], list[int]]:
    """A prompt with its i-th <|image|> token (one per image, as the chat template writes it) written out to
    images[i].tokens of them, the model's input, and the position where each image starts."""
    at = [i for i, t in enumerate(ids) if t == image_token_id]
    if len(at) != len(images):
        raise ValueError(f"the prompt has {len(at)} <|image|> tokens for {len(images)} images: one each (the chat "
                         f"template writes it), which is written out to the image's size")
    out, starts, prev = [], [], 0
    for i, image in zip(at, images):
        out += ids[prev:i]
        starts.append(len(out))
        out += [image_token_id] * image.tokens
        prev = i + 1
    return out + ids[prev:], starts


def runs(images: list[Prepared], cfg: VisionConfig) -> list[list[Prepared]]:
    """Images, in order, cut into tower runs of at most the patches of one image of the processor's largest size:
    the activations of one run are at most the largest image's."""
    cap, out, size = cfg.max_image_tokens * cfg.spatial_merge_size ** 2, [], 0
    for image in images:
        if not out or size + image.num_patches > cap:
            out.append([])
            size = 0
        out[-1].append(image)
        size += image.num_patches
    return out


# ---------------------------------------------------------------------------------------------
# The tower


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)), the division in fp32 (torch's fused kernel: 1 launch, not 6)."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def clamped_swiglu(x: torch.Tensor, w: dict[str, torch.Tensor], p: str, limit: float) -> torch.Tensor:
    gate = F.linear(x, w[p + "gate_proj.weight"], w.get(p + "gate_proj.bias")).clamp(max=limit)
    up = F.linear(x, w[p + "up_proj.weight"], w.get(p + "up_proj.bias")).clamp(-limit, limit)
    return F.linear(F.silu(gate) * up, w[p + "down_proj.weight"], w.get(p + "down_proj.bias"))


def positions(grid: tuple[int, int], cfg: VisionConfig) -> torch.Tensor:
    """Each patch's (row, column) in the image, [gh * gw, 2], in block order."""
    gh, gw, m = *grid, cfg.spatial_merge_size
    rows, cols = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
    block = lambda t: t.reshape(gh // m, m, gw // m, m).transpose(1, 2).flatten()
    return torch.stack([block(rows), block(cols)], -1)


def rotary(pos: torch.Tensor, cfg: VisionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The axial rotary embedding's cos and sin, [n, head_dim]: a quarter of the head's frequencies on the row,
    a quarter on the column, the whole written twice (rotate-half pairs i with i + head_dim / 2)."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half)
    angles = pos[..., None].float() * inv_freq  # [n, 2, half / 2]
    angles = torch.cat([angles[:, 0], angles[:, 1]], -1)
    angles = torch.cat([angles, angles], -1)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    x1, x2 = xf.chunk(2, -1)
    return (xf * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]).to(x.dtype)


@dataclass(frozen=True)
class Group:
    """A tower run's images of one size n (attention never crosses images): the indices of their rows in the run,
    by which one attention call takes them all, stacked."""
    rows: torch.Tensor  # [images * n]: the images' rows in the run, image after image
    images: int
    n: int


def groups(grids: list[tuple[int, int]], device: torch.device) -> list[Group]:
    """The images of a run (in its row order) grouped by their number of patches."""
    sizes = [gh * gw for gh, gw in grids]
    starts = np.cumsum([0] + sizes)
    out = []
    for n in dict.fromkeys(sizes):
        of = [i for i, size in enumerate(sizes) if size == n]
        rows = torch.cat([torch.arange(starts[i], starts[i] + n) for i in of]).to(device)
        out.append(Group(rows, len(of), n))
    return out


def attention(x: torch.Tensor, w: dict[str, torch.Tensor], p: str, cfg: VisionConfig,
              cos: torch.Tensor, sin: torch.Tensor, by_size: list[Group]) -> torch.Tensor:
    N, H = x.shape[0], cfg.num_heads
    q, k, v = F.linear(x, w[p + "qkv.weight"], w.get(p + "qkv.bias")).reshape(N, 3, H, -1).unbind(1)
    q = rotate(rms_norm(q, w[p + "q_norm.weight"], cfg.rms_norm_eps), cos, sin)
    k = rotate(rms_norm(k, w[p + "k_norm.weight"], cfg.rms_norm_eps), cos, sin)
    o = torch.empty_like(q)
    for g in by_size:
        # [images, H, n, d], contiguous: torch's flash kernel takes it (a 3-D or strided input fell back to the
        # fp32 math path: 14x slower at 1024 patches on an H100)
        qg, kg, vg = (t[g.rows].reshape(g.images, g.n, H, -1).transpose(1, 2).contiguous() for t in (q, k, v))
        o[g.rows] = F.scaled_dot_product_attention(qg, kg, vg).transpose(1, 2).reshape(g.images * g.n, H, -1)
    return F.linear(o.reshape(N, -1), w[p + "proj.weight"], w.get(p + "proj.bias"))


class VisionTower:
    """The tower over weights named as the checkpoint's, less the `model.visual.` prefix; `image_token_id`: the
    placeholder token its rows replace (config.json's image_token_id)."""

    def __init__(self, cfg: VisionConfig, weights: dict[str, torch.Tensor], image_token_id: int = IMAGE_TOKEN_ID):
        self.cfg, self.image_token_id = cfg, image_token_id
        missing = [n for n in expected_names(cfg) if n not in weights]
        if missing:
            raise ValueError(f"vision tower: missing {[PREFIX + n for n in missing[:5]]} "
                             f"({len(missing)} of {len(expected_names(cfg))} tensors)")
        self.w = weights
        self.device, self.dtype = weights["patch_embed.proj.weight"].device, weights["patch_embed.proj.weight"].dtype

    def read(self, images: list[Prepared]) -> list[torch.Tensor]:
        """Prepared images -> each one's rows, in one run: their patches made on the tower's device."""
        return self([(patchify(im.pixels.to(self.device), self.cfg), im.grid) for im in images])

    @torch.no_grad()
    def __call__(self, images: list[tuple[torch.Tensor, tuple[int, int]]]) -> list[torch.Tensor]:
        """Images' (patches, grid) (image_patches) -> each one's rows for the language model, [tokens,
        out_hidden_size]. One run takes them all: its linear layers on all their patches at once, its attention on
        the images of each size at once (a prompt's sixteen screenshots: one run, not sixteen)."""
        cfg, w = self.cfg, self.w
        for i, (patches, grid) in enumerate(images):
            if patches.shape[0] != grid[0] * grid[1]:
                raise ValueError(f"image {i}: {patches.shape[0]} patches for a grid of {grid[0]}x{grid[1]}")
        grids = [grid for _, grid in images]
        embed = w["patch_embed.proj.weight"]
        x = F.linear(torch.cat([patches for patches, _ in images]).to(self.device, self.dtype),
                     embed.reshape(embed.shape[0], -1), w["patch_embed.proj.bias"])
        cos, sin = (t.to(self.device) for t in rotary(torch.cat([positions(g, cfg) for g in grids]), cfg))
        by_size = groups(grids, self.device)
        for b in range(cfg.depth):
            p = f"blocks.{b}."
            x = x + attention(rms_norm(x, w[p + "norm1.weight"], cfg.rms_norm_eps), w, p + "attn.", cfg, cos, sin,
                              by_size)
            x = x + clamped_swiglu(rms_norm(x, w[p + "norm2.weight"], cfg.rms_norm_eps), w, p + "mlp.",
                                   cfg.swiglu_limit)
        x = rms_norm(x, w["post_layernorm.weight"], cfg.rms_norm_eps)
        m2 = cfg.spatial_merge_size ** 2
        down = w["downsample.weight"]  # [out, hidden, m, m]: the block's patch (i, j) is its row i * m + j
        blocks = x.reshape(-1, m2, cfg.hidden_size).transpose(1, 2).reshape(-1, cfg.hidden_size * m2)
        y = F.linear(blocks, down.reshape(down.shape[0], -1), w["downsample.bias"])
        y = F.linear(y, w["merger.proj.weight"])
        y = F.gelu(F.layer_norm(y, (y.shape[-1],), w["merger.post_projection_norm.weight"],
                                w["merger.post_projection_norm.bias"]))
        return list(clamped_swiglu(y, w, "merger.", cfg.swiglu_limit).split([image_tokens(g, cfg) for g in grids]))


def stored(path: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """The checkpoint's `model.visual.*` tensors, name -> (file, shape), from the headers (empty for a text-only
    checkpoint): read once, for weight_bytes and load."""
    import checkpoint

    inventory, where = checkpoint.read_inventory(checkpoint.checkpoint_files(path))
    return {k: (where[k], shape) for k, (_, shape) in inventory.items() if k.startswith(PREFIX)}


def weight_bytes(tensors: dict[str, tuple[Path, tuple[int, ...]]], dtype: torch.dtype) -> int:
    """What the tower of these tensors (stored) takes once loaded in `dtype`."""
    size = torch.empty((), dtype=dtype).element_size()
    return sum(math.prod(shape) * size for _, shape in tensors.values())


def load(path: Path, tensors: dict[str, tuple[Path, tuple[int, ...]]], dtype: torch.dtype,
         device: str | torch.device) -> VisionTower | None:
    """The checkpoint's vision tower (config.json's vision_config, its `tensors` (stored) in `dtype` on `device`);
    None for a text-only checkpoint, one without those tensors."""
    if not tensors:
        return None
    config = json.loads((path / "config.json").read_text())
    if "vision_config" not in config:
        raise ValueError(f"{path}: {len(tensors)} {PREFIX}* tensors but no vision_config in config.json")
    weights = {}
    for f in sorted({f for f, _ in tensors.values()}):
        with safe_open(f, framework="pt") as st:
            weights |= {k[len(PREFIX):]: st.get_tensor(k).to(device, dtype) for k, (g, _) in tensors.items() if g == f}
    return VisionTower(VisionConfig.from_dict(config["vision_config"], _processor_config(path)), weights,
                       config.get("image_token_id", IMAGE_TOKEN_ID))


def _processor_config(path: Path) -> dict:
    """The image processor's settings the checkpoint ships: processor_config.json's image_processor (transformers
    5), else preprocessor_config.json; none (transformers' defaults) where it ships neither."""
    if (path / "processor_config.json").is_file():
        return json.loads((path / "processor_config.json").read_text()).get("image_processor") or {}
    if (path / "preprocessor_config.json").is_file():
        return json.loads((path / "preprocessor_config.json").read_text())
    return {}


def expected_names(cfg: VisionConfig) -> list[str]:
    block = ["attn.k_norm.weight", "attn.q_norm.weight", "attn.proj.weight", "attn.qkv.weight", "mlp.down_proj.weight",
             "mlp.gate_proj.weight", "mlp.up_proj.weight", "norm1.weight", "norm2.weight"]
    if cfg.attention_bias:
        block += ["attn.proj.bias", "attn.qkv.bias", "mlp.down_proj.bias", "mlp.gate_proj.bias", "mlp.up_proj.bias"]
    return [f"blocks.{b}.{n}" for b in range(cfg.depth) for n in block] + [
        "downsample.bias", "downsample.weight", "merger.down_proj.weight", "merger.gate_proj.weight",
        "merger.post_projection_norm.bias", "merger.post_projection_norm.weight", "merger.proj.weight",
        "merger.up_proj.weight", "patch_embed.proj.bias", "patch_embed.proj.weight", "post_layernorm.weight"]

"""EXL3, exllamav3's trellis weight format (spec: shared/spec/exl3.md).

Reading order: bitrates (§1.1), codebooks (§2.3), the tail-biting ring and its packing (§2.1-2.2),
the tile order (§3), Hadamard + channel factors (§4), `EXL3Linear`, the quantizer (§8), files (§1).
Everything here is plain torch and runs on CPU or GPU; `exl3_kernels.py` holds the fast CUDA twins of
`unpack` and `x @ dequantize(...)`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor

CODEBOOKS = ("3inst", "mcg", "mul1")
MARKER_VALUES = {"mcg": 0xCBAC1FED, "mul1": 0x83DCD12D}  # §1.1: only the key's presence matters
INTEGER_BITS = (1, 2, 3, 4, 5, 6, 7, 8)
HALF_BITS = (1.5, 2.5, 3.5)  # MUL1 only
TENSOR_KEYS = ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1", "bias")
TILE = 16
HAD = 128
CODEBOOK_SCALE = 1.24371088  # std of the 3INST codebook; exllamav3 divides input scales by -this
EXLLAMAV3_VERSION = "1.6.5"

# §2.3 multipliers / constants
INST3_MUL, INST3_ADD = 89226354, 64248484
MCG_MUL = 0xCBAC1FED
MUL1_MUL = 0x83DCD12D
MUL1_K_INV = 0.00676727294921875  # fp16 0x1EEE
MUL1_BIAS = -3.453125  # 1024 * k_inv + k_bias, exact in fp32


# ---------------------------------------------------------------------------------------------
# Bitrates (§1.1, §1.3)


def _check_codebook(codebook: str, name: str = "codebook") -> None:
    if codebook not in CODEBOOKS:
        raise ValueError(f"{name}: unknown EXL3 codebook {codebook!r}; expected one of {CODEBOOKS}")


def check_bits(bits: float, codebook: str, name: str = "bits") -> float:
    """Return `bits` as a float if (bits, codebook) is a legal EXL3 pair, else raise ValueError."""
    _check_codebook(codebook, name)
    if float(bits) in HALF_BITS:
        if codebook != "mul1":
            raise ValueError(f"{name}: half-integer K = {bits} exists only for the mul1 codebook, not {codebook!r}")
    elif float(bits) not in INTEGER_BITS:
        raise ValueError(f"{name}: K = {bits} is not a legal EXL3 bitrate; expected 1..8 or 1.5/2.5/3.5")
    return float(bits)


def bits_from_width(width: int, codebook: str, name: str = "trellis") -> float:
    """K from the trellis last dim: 16*K words, or 16*KA + 8 for half rates (§0 step 1)."""
    if width % 16 == 0:
        bits = width / 16
    elif width % 16 == 8:
        bits = (width - 8) / 16 + 0.5
    else:
        raise ValueError(f"{name}: last dim {width} is neither 16*K nor 16*KA+8 int16 words")
    return check_bits(bits, codebook, f"{name} (last dim {width})")


def trellis_width(bits: float) -> int:
    """int16 words per 16x16 tile."""
    return int(16 * bits)


@lru_cache(maxsize=None)
def symbol_bits(bits: float) -> tuple[int, ...]:
    """d_t, the bits position t adds to the ring: K, or KA at even t and KA+1 at odd t (§2.1)."""
    if float(bits).is_integer():
        return (int(bits),) * 256
    ka = int(bits)
    return tuple(ka + (t & 1) for t in range(256))


@lru_cache(maxsize=None)
def ring_ends(bits: float) -> tuple[int, ...]:
    """E(t): ring bit where position t's window ends; (t+1)K, or floor((t+1)(2KA+1)/2) (§2.2)."""
    if float(bits).is_integer():
        return tuple((t + 1) * int(bits) for t in range(256))
    ka = int(bits)
    return tuple(((t + 1) * (2 * ka + 1)) >> 1 for t in range(256))


# ---------------------------------------------------------------------------------------------
# Codebooks (§2.3): a 16-bit state -> one fp16 value


def _fp16_from_bits(u16: Tensor) -> Tensor:
    return ((u16 ^ 0x8000) - 0x8000).to(torch.int16).view(torch.float16)


def decode_codebook(states: Tensor, codebook: str) -> Tensor:
    """fp16 codebook value of each 16-bit state, with the single fp16 round-to-nearest-even (§2.3)."""
    _check_codebook(codebook)
    x = states.to(torch.int64) & 0xFFFF
    if codebook == "mul1":
        x = (x * MUL1_MUL) & 0xFFFFFFFF
        byte_sum = (x & 255) + ((x >> 8) & 255) + ((x >> 16) & 255) + (x >> 24)
        # k_inv * s - 3.453125 is exact in fp32, so rounding it once to fp16 equals the GPU's fp16 FMA
        return (byte_sum.to(torch.float32) * MUL1_K_INV + MUL1_BIAS).half()
    if codebook == "3inst":
        x = (x * INST3_MUL + INST3_ADD) & 0xFFFFFFFF
    else:
        x = (x * MCG_MUL) & 0xFFFFFFFF
    x = (x & 0x8FFF8FFF) ^ 0x3B603B60
    # both halves lie in +-[0.125, 2), so their fp32 sum is exact and .half() is the one RNE
    return (_fp16_from_bits(x & 0xFFFF).float() + _fp16_from_bits(x >> 16).float()).half()


@lru_cache(maxsize=None)
def codebook_lut(codebook: str, device: str = "cpu") -> Tensor:
    """All 65536 codebook values (fp16), indexed by state."""
    return decode_codebook(torch.arange(65536, device=device), codebook)


# ---------------------------------------------------------------------------------------------
# The packed ring (§2.1, §2.2) and the tile order (§3)


@lru_cache(maxsize=None)
def _window_words(bits: float, device: str) -> tuple[Tensor, Tensor, Tensor]:
    """For each position: the two uint32 words holding ring bits [E-16, E) and the shift to apply."""
    ring = int(256 * bits)
    start = (torch.tensor(ring_ends(bits), device=device) - 16) % ring
    first = start // 32
    second = (first + 1) % (ring // 32)
    return first, second, 32 - start % 32


def unpack_states(trellis: Tensor, bits: float) -> Tensor:
    """int16 (..., words) -> int64 (..., 256): the 16-bit state of every stream position.

    The words are read as little-endian uint32, bits MSB-first; each state is the 16-bit window
    ending at E(t), wrapping around the ring (tail-biting)."""
    words = trellis.to(torch.int64) & 0xFFFF
    u32 = words[..., 0::2] | (words[..., 1::2] << 16)
    first, second, shift = _window_words(float(bits), str(trellis.device))
    window48 = (u32[..., first] << 16) | (u32[..., second] >> 16)  # 32 + 16 bits, window inside
    return (window48 >> shift) & 0xFFFF


@lru_cache(maxsize=None)
def _pack_bits(bits: float, device: str) -> tuple[Tensor, Tensor]:
    """For each ring bit p: the position t whose symbol holds it, and its bit index in state_t."""
    ends = torch.tensor(ring_ends(bits), device=device)
    p = torch.arange(int(256 * bits), device=device)
    t = torch.searchsorted(ends, p, right=True)
    return t, ends[t] - 1 - p


def pack_states(states: Tensor, bits: float) -> Tensor:
    """int (..., 256) states -> int16 (..., words): the inverse of `unpack_states`, laid out exactly
    as exllamav3's pack kernels write it (MSB-first stream, uint32 words stored little-endian)."""
    position, bit = _pack_bits(float(bits), str(states.device))
    ring_bits = (states.to(torch.int64)[..., position] >> bit) & 1
    ring_bits = ring_bits.view(*states.shape[:-1], -1, 32)
    u32 = (ring_bits << torch.arange(31, -1, -1, device=states.device)).sum(-1)
    words = torch.stack([u32 & 0xFFFF, u32 >> 16], dim=-1).flatten(-2)
    return ((words ^ 0x8000) - 0x8000).to(torch.int16)


@lru_cache(maxsize=None)
def stream_to_tile(device: str = "cpu") -> Tensor:
    """Tile index r*16 + c of stream position t (the mma B-fragment order, §3)."""
    t = torch.arange(256, device=device)
    lane, j = t // 8, t % 8
    row = 2 * (lane % 4) + (j & 1) + 8 * ((j >> 1) & 1)
    col = lane // 4 + 8 * ((j >> 2) & 1)
    return row * 16 + col


@lru_cache(maxsize=None)
def tile_to_stream(device: str = "cpu") -> Tensor:
    return torch.argsort(stream_to_tile(device))


def tiles_to_matrix(stream: Tensor) -> Tensor:
    """(A, B, 256) values in stream order -> (16A, 16B) matrix; tile (a, b) at rows 16a.., cols 16b.."""
    a, b, _ = stream.shape
    tiles = stream[..., tile_to_stream(str(stream.device))].view(a, b, TILE, TILE)
    return tiles.permute(0, 2, 1, 3).reshape(a * TILE, b * TILE)


def matrix_to_tiles(w: Tensor) -> Tensor:
    """(16A, 16B) matrix -> (A, B, 256) in stream order; inverse of `tiles_to_matrix`."""
    k, n = w.shape
    tiles = w.reshape(k // TILE, TILE, n // TILE, TILE).permute(0, 2, 1, 3).reshape(k // TILE, n // TILE, 256)
    return tiles[..., stream_to_tile(str(w.device))]


def _check_trellis(trellis: Tensor, codebook: str, name: str) -> float:
    if trellis.dtype != torch.int16:
        raise ValueError(f"{name}: trellis must be int16, got {trellis.dtype} with shape {tuple(trellis.shape)}")
    if trellis.dim() != 3:
        raise ValueError(f"{name}: trellis must be (k/16, n/16, words), got shape {tuple(trellis.shape)}")
    return bits_from_width(trellis.shape[-1], codebook, f"{name} trellis {tuple(trellis.shape)}")


def unpack(trellis: Tensor, codebook: str) -> Tensor:
    """int16 trellis (k/16, n/16, words) -> fp16 Ŵ (k, n) in the rotated basis, bit-exact (§0 1-5)."""
    bits = _check_trellis(trellis, codebook, "unpack")
    values = codebook_lut(codebook, str(trellis.device))[unpack_states(trellis, bits)]
    return tiles_to_matrix(values)


# ---------------------------------------------------------------------------------------------
# Hadamard rotation and channel factors (§4)


@lru_cache(maxsize=None)
def hadamard_128(device: str = "cpu", dtype: torch.dtype = torch.float32) -> Tensor:
    """Normalized 128x128 Sylvester Hadamard, H[i, j] = (-1)^popcount(i & j) / sqrt(128)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < HAD:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(HAD)).to(device=device, dtype=dtype)


def had_right(x: Tensor) -> Tensor:
    """x · H_n for x[..., n]: every 128-block of the last dim times H, in fp32."""
    x = x.float()
    h = hadamard_128(str(x.device))
    return (x.reshape(*x.shape[:-1], -1, HAD) @ h).reshape(x.shape)


def had_left(x: Tensor) -> Tensor:
    """H_k · x for x[k, n]: every 128-row block times H (H is symmetric), in fp32."""
    return had_right(x.float().transpose(0, 1)).transpose(0, 1)


def _check_factor(v: Tensor, size: int, what: str, name: str) -> Tensor:
    if not v.is_floating_point():
        raise ValueError(f"{name}.{what}: must be a float tensor, got {v.dtype} with shape {tuple(v.shape)}")
    if tuple(v.shape) != (size,):
        raise ValueError(f"{name}.{what}: shape {tuple(v.shape)} does not match the trellis, expected ({size},)")
    return v.half()


def dequantize(trellis: Tensor, suh: Tensor, svh: Tensor, codebook: str) -> Tensor:
    """fp16 W (in, out) = diag(suh) · H_k · Ŵ · H_n · diag(svh), computed in fp32, rounded once."""
    inner = unpack(trellis, codebook)
    k, n = inner.shape
    if k % HAD or n % HAD:
        raise ValueError(f"dequantize: trellis {tuple(trellis.shape)} gives W {k}x{n}; both must be multiples of 128")
    suh = _check_factor(suh, k, "suh", "dequantize")
    svh = _check_factor(svh, n, "svh", "dequantize")
    w = had_left(had_right(inner))
    return (suh.float()[:, None] * w * svh.float()[None, :]).half()


def signs_from_bits(packed: Tensor, size: int, name: str) -> Tensor:
    """Legacy su/sv: bit i of int16 word j is the sign of element 16j+i, set => -1. Returns fp16 ±1."""
    if packed.dtype != torch.int16 or tuple(packed.shape) != (size // 16,):
        raise ValueError(f"{name}: legacy packed signs must be int16 ({size // 16},), "
                         f"got {packed.dtype} {tuple(packed.shape)}")
    bit = (packed.to(torch.int64)[:, None] >> torch.arange(16, device=packed.device)) & 1
    return (1 - 2 * bit).flatten().half()


# ---------------------------------------------------------------------------------------------
# One EXL3 linear


GEMV_MAX_ROWS = 8  # exllamav3's GEMV covers m <= 8; more rows decode the weight once and use a GEMM


@dataclass(eq=False)
class EXL3Linear:
    """y = x · W + bias with W = diag(suh) H Ŵ H diag(svh), stored as exllamav3 stores it."""

    trellis: Tensor
    suh: Tensor
    svh: Tensor
    codebook: str = "3inst"
    bias: Tensor | None = None
    name: str = ""
    _inner: Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        label = self.name or "EXL3Linear"
        self.bits = _check_trellis(self.trellis, self.codebook, label)
        self.in_features = self.trellis.shape[0] * TILE
        self.out_features = self.trellis.shape[1] * TILE
        if self.in_features % HAD or self.out_features % HAD:
            raise ValueError(f"{label}: trellis {tuple(self.trellis.shape)} gives W {self.in_features}x"
                             f"{self.out_features}; both dims must be multiples of 128")
        self.suh = _check_factor(self.suh, self.in_features, "suh", label)
        self.svh = _check_factor(self.svh, self.out_features, "svh", label)
        if self.bias is not None:
            self.bias = _check_factor(self.bias, self.out_features, "bias", label)

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor], name: str = "") -> "EXL3Linear":
        """Build from on-disk suffixes (trellis, suh|su, svh|sv, mcg|mul1 marker, bias)."""
        label = name or "EXL3Linear"
        unknown = sorted(set(tensors) - set(TENSOR_KEYS))
        if unknown:
            raise ValueError(f"{label}: unknown EXL3 tensor(s) {unknown}; expected some of {TENSOR_KEYS}")
        if "trellis" not in tensors:
            raise ValueError(f"{label}.trellis: missing")
        markers = [m for m in ("mcg", "mul1") if m in tensors]
        if len(markers) > 1:
            raise ValueError(f"{label}: both .mcg and .mul1 codebook markers present")
        codebook = markers[0] if markers else "3inst"
        trellis = tensors["trellis"]
        _check_trellis(trellis, codebook, f"{label}.trellis")
        k, n = trellis.shape[0] * TILE, trellis.shape[1] * TILE
        suh = _factor_or_signs(tensors, "suh", "su", k, label)
        svh = _factor_or_signs(tensors, "svh", "sv", n, label)
        return cls(trellis, suh, svh, codebook, tensors.get("bias"), name)

    def tensors(self) -> dict[str, Tensor]:
        """On-disk tensors (names without the module prefix)."""
        out = {"trellis": self.trellis, "suh": self.suh, "svh": self.svh}
        if self.codebook in MARKER_VALUES:
            out[self.codebook] = torch.tensor(MARKER_VALUES[self.codebook] - (1 << 32), dtype=torch.int32)
        if self.bias is not None:
            out["bias"] = self.bias
        return out

    def to(self, device: torch.device | str) -> "EXL3Linear":
        bias = None if self.bias is None else self.bias.to(device)
        return EXL3Linear(self.trellis.to(device), self.suh.to(device), self.svh.to(device),
                          self.codebook, bias, self.name)

    def inner(self) -> Tensor:
        """Ŵ (in, out) fp16, decoded once and kept."""
        if self._inner is None:
            self._inner = unpack(self.trellis, self.codebook)
        return self._inner

    def weight(self) -> Tensor:
        """W (in, out) fp16 in the original basis."""
        return dequantize(self.trellis, self.suh, self.svh, self.codebook)

    def __call__(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self.name or 'EXL3Linear'}: input shape {tuple(x.shape)} does not match "
                             f"in_features {self.in_features} (trellis {tuple(self.trellis.shape)})")
        rows = x.reshape(-1, self.in_features)
        y = self._forward_cuda(rows) if rows.is_cuda else self._forward_torch(rows)
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _forward_torch(self, x: Tensor) -> Tensor:
        """((((x ⊙ suh) · H) · Ŵ) · H) ⊙ svh in fp32 (§4)."""
        x_rot = had_right(x.float() * self.suh.float())
        return had_right(x_rot @ self.inner().float()) * self.svh.float()

    def _forward_cuda(self, x: Tensor) -> Tensor:
        import exl3_kernels  # the Triton twins exist only where there is a GPU

        if x.shape[0] <= GEMV_MAX_ROWS:
            return exl3_kernels.exl3_gemv(x.half(), self.trellis, self.suh, self.svh, self.codebook).float()
        x_rot = had_right(x.float() * self.suh.float()).half()
        y = x_rot @ exl3_kernels.exl3_decode(self.trellis, self.codebook)
        return had_right(y) * self.svh.float()


def _factor_or_signs(tensors: dict[str, Tensor], key: str, legacy: str, size: int, label: str) -> Tensor:
    if key in tensors:
        return _check_factor(tensors[key], size, key, label)
    if legacy in tensors:
        return signs_from_bits(tensors[legacy], size, f"{label}.{legacy}")
    raise ValueError(f"{label}.{key}: missing (neither .{key} nor legacy .{legacy} present)")


# ---------------------------------------------------------------------------------------------
# Quantizer (§8): tail-biting Viterbi over 16x16 tiles, regularization, global scale, LDLQ

# The traceback re-reads every step's per-node costs (fp32, 257 x 2^(16-K) per tile); this bounds
# that history per batch of tiles. Small CPU batches also keep the per-step arrays near the cache.
VITERBI_HISTORY_BYTES = {"cpu": 1 << 27, "cuda": 1 << 32}
VITERBI_MAX_TILES = {"cpu": 16, "cuda": 4096}


def viterbi(tiles: Tensor, bits: float, codebook: str) -> Tensor:
    """Best tail-biting trellis path for each tile: (N, 256) fp32 targets in stream order -> (N, 256)
    int64 states whose codebook values minimize the squared error (§8.1 step 6).

    The trellis node between positions t and t+1 is the low 16 - d_{t+1} bits of state_t; the
    state at t adds d_t new low bits to its predecessor node. Pass 1 runs unconstrained from
    position 128 around the ring and reads the node its best path has before position 0; pass 2
    runs 0..255 with position 0's predecessor forced to that node and traces back from the same
    node at 255, so the ring closes. Costs are fp32 (exllamav3 uses fp16)."""
    bits = check_bits(bits, codebook)
    kind = tiles.device.type if tiles.device.type in VITERBI_MAX_TILES else "cpu"
    per_tile = 257 * (65536 >> min(symbol_bits(bits))) * 4
    batch = max(1, min(VITERBI_MAX_TILES[kind], VITERBI_HISTORY_BYTES[kind] // per_tile))
    tiles = tiles.float()
    return torch.cat([_viterbi_batch(tiles[i:i + batch], bits, codebook) for i in range(0, len(tiles), batch)])


def _viterbi_batch(w: Tensor, bits: float, codebook: str) -> Tensor:
    n_tiles, device = w.shape[0], w.device
    d = symbol_bits(bits)
    value = codebook_lut(codebook, str(device)).float()
    # (value - w)^2 = value^2 - 2 w value + w^2; w^2 is the same for every state, so it is dropped
    sq, m2 = value * value, -2 * value
    steps = {(d[t], d[(t + 1) % 256]) for t in range(256)}
    layouts = {(dt, dn): _state_layout(dt, dn, sq, m2) for dt, dn in steps}
    nodes_max = 65536 >> min(d)
    history = torch.empty(n_tiles, 257, nodes_max, device=device)  # cost of each node before step i
    cand = torch.empty(n_tiles, 65536, device=device)
    best = torch.empty(n_tiles * nodes_max, device=device)
    states = torch.empty(n_tiles, 256, dtype=torch.int64, device=device)
    rows = torch.arange(n_tiles, device=device)

    def forward(order: list[int], start_cost: Tensor) -> None:
        history[:, 0, :start_cost.shape[1]] = start_cost
        for i, t in enumerate(order):
            dt, dn = d[t], d[(t + 1) % 256]
            high = 65536 >> (dt + dn)
            sq_t, m2_t, choice_last = layouts[dt, dn]
            # pred = choice << (16 - dt - dn) | high bits of the next node
            pred_cost = history[:, i, :65536 >> dt].view(n_tiles, 1 << dn, high)
            pred_cost = pred_cost.transpose(1, 2).unsqueeze(1) if choice_last else pred_cost.unsqueeze(1)
            c = cand.view(n_tiles, *sq_t.shape)
            torch.add(sq_t, pred_cost, out=c)
            c.addcmul_(w[:, t].view(-1, 1, 1, 1), m2_t)
            r = best[:n_tiles * (65536 >> dn)].view(n_tiles, 1 << dt, high)
            torch.amin(c, dim=3 if choice_last else 2, out=r)
            # r is [low, high]; the next node is high << dt | low
            history[:, i + 1, :65536 >> dn].view(n_tiles, high, 1 << dt).copy_(r.transpose(1, 2))

    def backward(order: list[int], node: Tensor, steps: int) -> Tensor:
        """Walk the last `steps` positions of `order` back from `node`; return the node before them."""
        for i in range(len(order) - 1, len(order) - 1 - steps, -1):
            t = order[i]
            dt, dn = d[t], d[(t + 1) % 256]
            choice = torch.arange(1 << dn, device=device) << (16 - dn)
            s = choice[None, :] | node[:, None]
            pred = s >> dt
            cost = history[:, i, :65536 >> dt].gather(1, pred) + sq[s] + w[:, t:t + 1] * m2[s]
            states[:, t] = s[rows, cost.argmin(1)]
            node = states[:, t] >> dt
        return node

    first = list(range(128, 256)) + list(range(128))
    forward(first, torch.zeros(n_tiles, 65536 >> d[128], device=device))
    end_node = history[:, 256, :65536 >> d[128]].argmin(1)
    ring_node = backward(first, end_node, 128)

    start_cost = torch.full((n_tiles, 65536 >> d[0]), math.inf, device=device)
    start_cost[rows, ring_node] = 0.0
    second = list(range(256))
    forward(second, start_cost)
    backward(second, ring_node, 256)
    return states


def _state_layout(dt: int, dn: int, sq: Tensor, m2: Tensor) -> tuple[Tensor, Tensor, bool]:
    """Per-state terms for a step adding dt bits before a node of 16 - dn bits, laid out as
    [low dt bits, choice, high] (state = (choice << (16 - dt - dn) | high) << dt | low) so the
    predecessor cost broadcasts over `low` and the minimum runs over `choice`. When `high` is
    short, torch reduces a middle dim slowly, so `choice` goes last instead."""
    high = 65536 >> (dt + dn)
    choice_last = high < 64
    out = []
    for x in (sq, m2):
        x = x.view(1 << dn, high, 1 << dt).permute(2, 0, 1)
        out.append((x.transpose(1, 2) if choice_last else x).contiguous())
    return out[0], out[1], choice_last


def quantize_tiles(tiles: Tensor, bits: float, codebook: str) -> tuple[Tensor, Tensor]:
    """(N, 256) targets in stream order -> (decoded fp32 values, int64 states)."""
    states = viterbi(tiles, bits, codebook)
    return codebook_lut(codebook, str(tiles.device))[states].float(), states


SIGMA_REG = 0.025  # Hessian damping, fraction of its mean diagonal
# LDLQ feedback inflates the slabs the Viterbi sees; exllamav3 inflates its scale-search sample by
# this factor (measured by its author), so the chosen scale fits the recursion's real inputs
LDLQ_DRIFT = {1.0: 1.08, 1.5: 1.035, 2.0: 1.018, 2.5: 1.009, 3.0: 1.004}
COARSE_SCALES = [0.1 + 0.2 * i for i in range(10)]
FINE_STEP = 0.075


def _random_signs(size: int, generator: torch.Generator, device: torch.device) -> Tensor:
    return (torch.randint(0, 2, (size,), generator=generator) * 2 - 1).float().to(device)


def regularize(w: Tensor, su_sign: Tensor, sv_sign: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """W (in, out) fp32 -> (W_reg, su, sv) with W = diag(su) H_k W_reg H_n diag(sv) (§4).

    Output columns are divided by sign x RMS/mean RMS (output scales always on, as with
    exllamav3's `out_scales: always`), rotated by H_n; input rows by sign x RMS / -1.24371088,
    rotated by H_k. Columns that are all zero get svh = 0."""
    out_rms = w.square().mean(0).sqrt()
    out_scale = out_rms / out_rms.mean() if out_rms.mean() > 1e-30 else out_rms
    zero_cols = out_scale < 1e-30
    sv = sv_sign * torch.where(zero_cols, torch.full_like(out_scale, 0.1), out_scale)
    w_reg = had_right(w / sv)
    sv = torch.where(zero_cols, torch.zeros_like(sv), sv)
    in_rms = w_reg.square().mean(1).sqrt()
    su = su_sign * torch.where(in_rms < 1e-30, torch.full_like(in_rms, 0.1), in_rms) / -CODEBOOK_SCALE
    return had_left(w_reg / su[:, None]), su, sv


def sample_scale_tiles(w_reg: Tensor, width: int = 3) -> Tensor:
    """Tiles for the global scale search, in stream order: a wrapped diagonal `width` tiles wide
    (every tile row and column appears) plus the tiles with the highest and lowest RMS."""
    tiles = matrix_to_tiles(w_reg)
    a, b, _ = tiles.shape
    diag = max(a, b)
    i = torch.arange(diag, device=w_reg.device).repeat_interleave(width)
    j = i + torch.arange(width, device=w_reg.device).repeat(diag)
    picked = [tiles[i % a, j % b]]
    flat = tiles.reshape(a * b, 256)
    extremes = min(max(8, diag * width // 16), (a * b + 1) // 2)
    ms = flat.square().mean(1)
    picked += [flat[ms.topk(extremes).indices], flat[ms.topk(extremes, largest=False).indices]]
    return torch.cat(picked)


def _scale_mse(tiles: Tensor, scales: list[float], bits: float, codebook: str) -> list[float]:
    """MSE of quantizing tiles * s, measured back in the unscaled domain, for each s (one batch)."""
    q, _ = quantize_tiles(torch.cat([tiles * s for s in scales]), bits, codebook)
    q = q.view(len(scales), *tiles.shape)
    s = torch.tensor(scales, device=tiles.device).view(-1, 1, 1)
    return (q / s - tiles).square().mean((1, 2)).tolist()


def global_scale(w_reg: Tensor, bits: float, codebook: str, drift: float = 1.0) -> float:
    """Scale g for W_reg: coarse grid 0.1..1.9 on a third of the sample, a 5-point grid around the
    best on the whole sample, then a parabola through the best three (§8.1 step 4)."""
    tiles = sample_scale_tiles(w_reg) * drift
    coarse = _scale_mse(tiles[::3], COARSE_SCALES, bits, codebook)
    center = COARSE_SCALES[min(range(len(coarse)), key=coarse.__getitem__)]
    fine = [center + FINE_STEP * (i - 2) for i in range(5)]
    mse = _scale_mse(tiles, fine, bits, codebook)
    best = min(range(5), key=mse.__getitem__)
    offset = 0.0
    if 0 < best < 4:
        y0, y1, y2 = mse[best - 1:best + 2]
        curvature = y0 - 2 * y1 + y2
        offset = max(-0.5, min(0.5, 0.5 * (y0 - y2) / curvature)) if curvature > 0 else 0.0
    return max(fine[best] + offset * FINE_STEP, 0.01)


def block_ldl(h: Tensor, block: int = TILE) -> Tensor:
    """H = L D Lᵀ with L block-unit-lower-triangular (16x16 blocks); returns L with its diagonal
    blocks zeroed, i.e. the LDLQ feedback matrix. Adds damping and retries if Cholesky fails."""
    k = h.shape[0]
    for _ in range(10):
        chol, info = torch.linalg.cholesky_ex(h)
        if info.item() == 0:
            break
        h = h + 2 * SIGMA_REG * h.diagonal().mean() * torch.eye(k, device=h.device)
    else:
        raise ValueError(f"hessian: Cholesky failed after 10 damping retries (shape {tuple(h.shape)})")
    m = k // block
    diag_blocks = chol.view(m, block, m, block).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
    lower = torch.einsum("rmi,mij->rmj", chol.view(k, m, block), torch.linalg.inv(diag_blocks))
    lower = lower.reshape(k, k)
    blocks = lower.view(m, block, m, block)
    idx = torch.arange(m, device=h.device)
    blocks[idx, :, idx, :] = 0
    return lower


def ldlq(w_reg: Tensor, feedback: Tensor, bits: float, codebook: str) -> tuple[Tensor, Tensor]:
    """LDLQ: quantize 16-row slabs from the bottom up; each slab's target is its rows plus
    Lᵀ·(W - Q) of the slabs already quantized below it. Returns (Q, states (k/16, n/16, 256))."""
    k, n = w_reg.shape
    q = torch.zeros_like(w_reg)
    states = torch.empty(k // TILE, n // TILE, 256, dtype=torch.int64, device=w_reg.device)
    for a in reversed(range(k // TILE)):
        rows, below = slice(TILE * a, TILE * (a + 1)), slice(TILE * (a + 1), k)
        target = w_reg[rows] + feedback[below, rows].T @ (w_reg[below] - q[below])
        values, states[a] = quantize_tiles(matrix_to_tiles(target)[0], bits, codebook)
        q[rows] = tiles_to_matrix(values[None])
    return q, states


def _check_weight(weight: Tensor, hessian: Tensor | None) -> None:
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight: expected a 2-D float [out, in] tensor, got {weight.dtype} {tuple(weight.shape)}")
    if weight.shape[0] % HAD or weight.shape[1] % HAD:
        raise ValueError(f"weight: shape {tuple(weight.shape)} must have both dims multiples of 128")
    if hessian is not None and tuple(hessian.shape) != (weight.shape[1], weight.shape[1]):
        raise ValueError(f"hessian: shape {tuple(hessian.shape)} does not match weight {tuple(weight.shape)}, "
                         f"expected ({weight.shape[1]}, {weight.shape[1]})")
    for name, t in (("weight", weight), ("hessian", hessian)):
        if t is not None and not torch.isfinite(t).all():
            raise ValueError(f"{name}: contains inf or NaN (shape {tuple(t.shape)})")


def quantize(weight: Tensor, bits: float, codebook: str = "3inst", hessian: Tensor | None = None,
             seed: int = 0, *, scale: float | None = None) -> EXL3Linear:
    """Quantize an HF-layout weight [out, in] to EXL3 (§8). Without a Hessian every tile is
    quantized on its own (exllamav3's no-calibration path); with H = E[xᵀx] (in, in), LDLQ.
    `scale` fixes the global scale g instead of searching for it (the search quantizes ~5x the
    tiles of a 128x128 weight). Runs on the weight's device. suh/svh are stored as computed
    (exllamav3 1.6 refits them by least squares afterwards; not done here)."""
    _check_weight(weight, hessian)
    bits = check_bits(bits, codebook)
    device = weight.device
    generator = torch.Generator().manual_seed(seed)
    w = weight.detach().float().T.contiguous()
    k, n = w.shape
    w_reg, su, sv = regularize(w, _random_signs(k, generator, device), _random_signs(n, generator, device))
    if scale is None:
        scale = global_scale(w_reg, bits, codebook, LDLQ_DRIFT.get(bits, 1.0) if hessian is not None else 1.0)
    w_reg, su = w_reg * scale, su / scale
    if hessian is None:
        _, states = quantize_tiles(matrix_to_tiles(w_reg).reshape(-1, 256), bits, codebook)
        states = states.view(k // TILE, n // TILE, 256)
    else:
        h = hessian.detach().float().to(device)
        h = h + SIGMA_REG * h.diagonal().mean() * torch.eye(k, device=device)
        # The error metric seen by W_reg: E = diag(su) H E_reg H diag(sv), so H_reg = H diag(su) h diag(su) H
        h_reg = had_left(had_right(su[:, None] * h * su[None, :]))
        _, states = ldlq(w_reg, block_ldl(h_reg), bits, codebook)
    return EXL3Linear(pack_states(states, bits), su.half(), sv.half(), codebook, name="quantize")


def proxy_error(weight: Tensor, lin: EXL3Linear, hessian: Tensor | None = None) -> float:
    """tr(E H Eᵀ) / tr(W H Wᵀ) for the HF-layout weight [out, in]; NMSE when H is None."""
    w = weight.float().T.to(lin.trellis.device)
    e = w - lin.weight().float()
    if hessian is None:
        return (e.square().sum() / w.square().sum()).item()
    h = hessian.float().to(w.device)
    return ((e * (h @ e)).sum() / (w * (h @ w)).sum()).item()


# ---------------------------------------------------------------------------------------------
# Files (§1): safetensors tensors `<prefix>.<name>` and the quantization_config metadata


def flatten_exl3(linears: dict[str, EXL3Linear]) -> dict[str, Tensor]:
    """{prefix: EXL3Linear} -> {"<prefix>.<name>": tensor} with exllamav3's names/dtypes/shapes."""
    return {f"{prefix}.{name}": t.contiguous().cpu()
            for prefix, lin in linears.items() for name, t in lin.tensors().items()}


def save_exl3(path: str | Path, linears: dict[str, EXL3Linear]) -> None:
    from safetensors.torch import save_file

    save_file(flatten_exl3(linears), str(path))


def load_exl3(source: str | Path | dict[str, Tensor]) -> dict[str, EXL3Linear]:
    """Every EXL3 linear (a prefix with a `.trellis`) in a safetensors file or a flat tensor dict."""
    if not isinstance(source, dict):
        from safetensors.torch import load_file

        source = load_file(str(source))
    prefixes = [key[:-len(".trellis")] for key in source if key.endswith(".trellis")]
    out = {}
    for prefix in prefixes:
        tensors = {name: source[f"{prefix}.{name}"] for name in TENSOR_KEYS if f"{prefix}.{name}" in source}
        out[prefix] = EXL3Linear.from_tensors(tensors, prefix)
    return out


def _storage_entry(prefix: str, lin: EXL3Linear) -> dict:
    stored = {f"{prefix}.{name}": {"shape": list(t.shape), "n_bytes": t.numel() * t.element_size(),
                                   "dtype": str(t.dtype).removeprefix("torch.")}
              for name, t in lin.tensors().items()}
    entry = {"stored_tensors": stored, "quant_format": "exl3",
             "bits_per_weight": int(lin.bits) if lin.bits.is_integer() else lin.bits}
    if lin.codebook in MARKER_VALUES:
        entry[f"{lin.codebook}_multiplier"] = MARKER_VALUES[lin.codebook]
    return entry


def quantization_config(bits: float, codebook: str = "mul1", head_bits: int = 6, out_scales: str = "always",
                        calibration: tuple[int, int] = (250, 2048), version: str = EXLLAMAV3_VERSION,
                        tensor_storage: dict[str, EXL3Linear] | None = None) -> dict:
    """config.json's `quantization_config` as exllamav3 writes it (§1.2); with `tensor_storage`, the
    per-module map of quantization_config.json. exllamav3's loader reads none of it."""
    _check_codebook(codebook)
    if out_scales not in ("always", "never", "auto"):
        raise ValueError(f"out_scales: {out_scales!r} is not one of 'always', 'never', 'auto'")
    cfg = {"quant_method": "exl3", "version": version, "bits": bits, "head_bits": head_bits,
           "calibration": {"rows": calibration[0], "cols": calibration[1]}, "out_scales": out_scales,
           "codebook": codebook}
    if tensor_storage is not None:
        cfg["tensor_storage"] = {prefix: _storage_entry(prefix, lin) for prefix, lin in tensor_storage.items()}
    return cfg

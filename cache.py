"""Paged cache memory for the forward pass (DESIGN.md "cache.py"), allocated once, up front.

DSA layers keep per-token rows in blocks of `block_size` positions (a sequence's block_table says
which blocks it owns); KDA layers keep a fixed-size recurrent state per sequence slot. Which block
or slot belongs to whom is prefix_cache.py's and engine.py's business, not this file's. Each layer's rows
live on that layer's device (placement.py); a pool on one device holds plain tensors.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

import torch

if TYPE_CHECKING:
    from model_glm import GLMConfig


class LayerRows:
    """One cache tensor whose layer rows (axis 0) are split over devices in runs of consecutive rows.

    `rows[r, ...]` (r an int) is a view on row r's device, as for a plain tensor. `rows[:, ...]`
    reads every row onto the first run's device (a copy, not a view), and `rows[:, ...] = value`
    writes each run's rows to its device: callers that read all rows write back by assignment.
    """

    def __init__(self, parts: list[torch.Tensor], starts: list[int]):
        self.parts, self.starts = parts, starts  # run i holds rows starts[i] .. starts[i] + len(parts[i]) - 1
        first = parts[0]
        self.shape = torch.Size((sum(p.shape[0] for p in parts), *first.shape[1:]))
        self.dtype, self.device = first.dtype, first.device

    def element_size(self) -> int:
        return self.parts[0].element_size()

    def _run(self, row: int) -> tuple[torch.Tensor, int]:
        if not 0 <= row < self.shape[0]:
            raise IndexError(f"cache row {row} is outside 0..{self.shape[0] - 1}")
        i = max(j for j, s in enumerate(self.starts) if s <= row)
        return self.parts[i], row - self.starts[i]

    def _split(self, key) -> tuple[int | slice, tuple]:
        first, rest = (key[0], key[1:]) if isinstance(key, tuple) else (key, ())
        if isinstance(first, int) or (isinstance(first, slice) and first == slice(None)):
            return first, rest
        raise TypeError(f"LayerRows: index the layer axis with an int or ':', got {first!r}")

    def __getitem__(self, key) -> torch.Tensor:
        first, rest = self._split(key)
        if isinstance(first, int):
            part, local = self._run(first)
            return part[(local, *_on(rest, part.device))]
        return torch.cat([p[(slice(None), *_on(rest, p.device))].to(self.device) for p in self.parts])

    def __setitem__(self, key, value) -> None:
        first, rest = self._split(key)
        if isinstance(first, int):
            part, local = self._run(first)
            part[(local, *_on(rest, part.device))] = _on(value, part.device)
            return
        for p, s in zip(self.parts, self.starts):
            p[(slice(None), *_on(rest, p.device))] = _on(value[s:s + p.shape[0]] if isinstance(value, torch.Tensor)
                                                         else value, p.device)


def _on(x, device: torch.device):
    """Index tensors and values follow the rows they address (a tuple: each of its tensors)."""
    if isinstance(x, tuple):
        return tuple(_on(t, device) for t in x)
    return x.to(device) if isinstance(x, torch.Tensor) else x


# Positions of a sequence's indexer keys and gate scores its slot keeps (§4.4: they are needed only until
# their pool completes). A pass writes its last TAIL_RING positions at position % TAIL_RING; the next pass
# starts where the accepted rows end and reads back the at most kpool - 1 before it: they are intact as
# long as a pass leaves at most TAIL_RING - (kpool - 1) rows rejected (a speculator's drafts, engine.py).
TAIL_RING = 64


def layer_bytes(config: "GLMConfig", layer: int, block_size: int, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes per block, bytes per slot) of one layer's cache rows: a DSA layer (trunk or MTP) pays
    per block (latent, pooled keys) and per slot (the tail ring of indexer keys and gate scores), a KDA
    layer per slot (fp32 state and conv window). The one place that states the row sizes; CachePool
    allocates exactly these."""
    e = torch.empty((), dtype=dtype).element_size()
    if layer == config.mtp_layer or config.layer_types[layer] == "dsa":
        dI = config.index_head_dim
        return e * block_size * (config.kv_lora_rank + dI // config.index_kpool), e * 2 * TAIL_RING * dI
    H, d = config.linear_num_heads, config.linear_head_dim
    return 0, 4 * H * d * d + e * 3 * (config.linear_conv_kernel - 1) * H * d


def pool_bytes(config: "GLMConfig", num_blocks: int, num_slots: int, block_size: int,
               dtype: torch.dtype) -> dict[int, int]:
    """Bytes of each layer's rows (trunk, then MTP) in a pool of num_blocks blocks and num_slots
    slots: what a placement plan reserves for the cache (placement.plan's `cache`)."""
    out = {}
    for L in range(config.num_hidden_layers + config.num_nextn_predict_layers):
        per_block, per_slot = layer_bytes(config, L, block_size, dtype)
        out[L] = num_blocks * per_block + num_slots * per_slot
    return out


class CachePool:
    """Tensors (row = a DSA or KDA layer, see dsa_index / kda_index):

    latent     [n_dsa, num_blocks, block_size, kv_lora_rank]        MLA latent after kv_a_layernorm
    index_k    [n_dsa, num_slots, TAIL_RING, index_head_dim]        indexer keys k^I of a sequence's last positions
    gate       [n_dsa, num_slots, TAIL_RING, index_head_dim]        k-pool gate scores γ of the same positions
                                                                    (position % TAIL_RING: the slot's tail ring)
    pooled     [n_dsa, num_blocks, block_size // index_kpool, index_head_dim]  pooled keys K_p
    kda_state  [n_kda, num_slots, H, d_k, d_v] fp32                 KDA recurrent state
    conv_state [n_kda, num_slots, 3, conv_kernel - 1, H * d]        q, k, v pre-conv rows, oldest first

    n_dsa counts the trunk DSA layers plus the MTP layer (last row) when the config has one.

    `device` is one device, or a list with `layer_device` giving each layer's index into it (layers
    not listed: entry 0). With every row on entry 0 the six are plain tensors; otherwise each is a
    `LayerRows` whose runs of rows sit on their layers' devices. `device` (the attribute) is the
    first entry, where rows read across devices arrive.
    """

    def __init__(self, config: "GLMConfig", num_blocks: int, num_slots: int, block_size: int = 64,
                 dtype: torch.dtype = torch.bfloat16, device: str | torch.device | Sequence[str | torch.device] = "cpu",
                 layer_device: Mapping[int, int] | None = None):
        if block_size < 1 or block_size % config.index_kpool:
            raise ValueError(f"CachePool: block_size ({block_size}) must be a positive multiple of "
                             f"index_kpool ({config.index_kpool}) so that no k-pool spans two blocks")
        if num_blocks < 1 or num_slots < 1:
            raise ValueError(f"CachePool: need at least one block and one slot, got num_blocks="
                             f"{num_blocks}, num_slots={num_slots}")
        devices = [torch.device(d) for d in ([device] if isinstance(device, (str, torch.device)) else device)]
        layer_device = dict(layer_device or {})
        bad = {L: i for L, i in layer_device.items() if not 0 <= i < len(devices)}
        if bad:
            raise ValueError(f"CachePool: layer_device {bad} points outside the {len(devices)} device(s)")
        self.config = config
        self.num_blocks, self.num_slots, self.block_size = num_blocks, num_slots, block_size
        self.dtype, self.device = dtype, devices[0]

        dsa_layers = config.dsa_layers + ((config.mtp_layer,) if config.mtp_layer is not None else ())
        self._dsa_rows = {layer: row for row, layer in enumerate(dsa_layers)}
        self._kda_rows = {layer: row for row, layer in enumerate(config.kda_layers)}
        H, d, dI = config.linear_num_heads, config.linear_head_dim, config.index_head_dim

        def rows(layers: Sequence[int], *shape: int, dt: torch.dtype = dtype) -> torch.Tensor | LayerRows:
            if not layers:  # a model cut to layers of the other kind (bench.py --layers 2: KDA only)
                return torch.zeros((0, *shape), dtype=dt, device=devices[0])
            where = [layer_device.get(L, 0) for L in layers]
            starts = [r for r in range(len(where)) if r == 0 or where[r] != where[r - 1]]
            ends = starts[1:] + [len(where)]
            parts = [torch.zeros((e - s, *shape), dtype=dt, device=devices[where[s]]) for s, e in zip(starts, ends)]
            if len(parts) == 1 and where[0] == 0:
                return parts[0]
            return LayerRows(parts, starts)

        self.latent = rows(dsa_layers, num_blocks, block_size, config.kv_lora_rank)
        self.index_k = rows(dsa_layers, num_slots, TAIL_RING, dI)
        self.gate = rows(dsa_layers, num_slots, TAIL_RING, dI)
        self.pooled = rows(dsa_layers, num_blocks, block_size // config.index_kpool, dI)
        self.kda_state = rows(config.kda_layers, num_slots, H, d, d, dt=torch.float32)
        self.conv_state = rows(config.kda_layers, num_slots, 3, config.linear_conv_kernel - 1, H * d)

    def dsa_index(self, layer: int) -> int:
        """Row of a DSA layer (trunk or MTP) in latent / index_k / gate / pooled."""
        if layer not in self._dsa_rows:
            raise ValueError(f"layer {layer} is not a DSA layer (DSA layers: {sorted(self._dsa_rows)})")
        return self._dsa_rows[layer]

    def kda_index(self, layer: int) -> int:
        """Row of a KDA layer in kda_state / conv_state."""
        if layer not in self._kda_rows:
            raise ValueError(f"layer {layer} is not a KDA layer (KDA layers: {sorted(self._kda_rows)})")
        return self._kda_rows[layer]

    def bytes_per_token(self) -> int:
        """DSA cache bytes one position costs over all DSA rows (pooled keys amortized per token)."""
        return sum(layer_bytes(self.config, L, self.block_size, self.dtype)[0] for L in self._dsa_rows) // self.block_size

    def bytes_per_sequence(self) -> int:
        """Bytes one sequence slot costs whatever its length: the KDA rows' recurrent and conv state, the DSA
        rows' tail rings."""
        rows = (*self._kda_rows, *self._dsa_rows)
        return sum(layer_bytes(self.config, L, self.block_size, self.dtype)[1] for L in rows)

    def kda_bytes_per_sequence(self) -> int:
        """The KDA part of bytes_per_sequence: what a prefix-cache snapshot of a slot holds."""
        return sum(layer_bytes(self.config, L, self.block_size, self.dtype)[1] for L in self._kda_rows)

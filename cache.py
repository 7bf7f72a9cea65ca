"""Paged cache memory for the forward pass (DESIGN.md "cache.py"), allocated once, up front.

DSA layers keep per-token rows in blocks of `block_size` positions (a sequence's block_table says
which blocks it owns); KDA layers keep a fixed-size recurrent state per sequence slot. Which block
or slot belongs to whom is the engine's business (engine.py), not this file's.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from model_glm import GLMConfig


class CachePool:
    """Tensors (row = a DSA or KDA layer, see dsa_index / kda_index):

    latent     [n_dsa, num_blocks, block_size, kv_lora_rank]        MLA latent after kv_a_layernorm
    index_k    [n_dsa, num_blocks, block_size, index_head_dim]      indexer keys k^I
    gate       [n_dsa, num_blocks, block_size, index_head_dim]      k-pool gate scores γ
    pooled     [n_dsa, num_blocks, block_size // index_kpool, index_head_dim]  pooled keys K_p
    kda_state  [n_kda, num_slots, H, d_k, d_v] fp32                 KDA recurrent state
    conv_state [n_kda, num_slots, 3, conv_kernel - 1, H * d]        q, k, v pre-conv rows, oldest first

    n_dsa counts the trunk DSA layers plus the MTP layer (last row) when the config has one.
    """

    def __init__(self, config: "GLMConfig", num_blocks: int, num_slots: int, block_size: int = 64,
                 dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"):
        if block_size < 1 or block_size % config.index_kpool:
            raise ValueError(f"CachePool: block_size ({block_size}) must be a positive multiple of "
                             f"index_kpool ({config.index_kpool}) so that no k-pool spans two blocks")
        if num_blocks < 1 or num_slots < 1:
            raise ValueError(f"CachePool: need at least one block and one slot, got num_blocks="
                             f"{num_blocks}, num_slots={num_slots}")
        self.config = config
        self.num_blocks, self.num_slots, self.block_size = num_blocks, num_slots, block_size
        self.dtype, self.device = dtype, torch.device(device)

        dsa_layers = config.dsa_layers + ((config.mtp_layer,) if config.mtp_layer is not None else ())
        self._dsa_rows = {layer: row for row, layer in enumerate(dsa_layers)}
        self._kda_rows = {layer: row for row, layer in enumerate(config.kda_layers)}
        n_dsa, n_kda = len(self._dsa_rows), len(self._kda_rows)
        H, d, dI = config.linear_num_heads, config.linear_head_dim, config.index_head_dim

        def zeros(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dt, device=self.device)

        self.latent = zeros(n_dsa, num_blocks, block_size, config.kv_lora_rank)
        self.index_k = zeros(n_dsa, num_blocks, block_size, dI)
        self.gate = zeros(n_dsa, num_blocks, block_size, dI)
        self.pooled = zeros(n_dsa, num_blocks, block_size // config.index_kpool, dI)
        self.kda_state = zeros(n_kda, num_slots, H, d, d, dt=torch.float32)
        self.conv_state = zeros(n_kda, num_slots, 3, config.linear_conv_kernel - 1, H * d)

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
        per_block = sum(t[0, 0].numel() * t.element_size() for t in (self.latent, self.index_k, self.gate, self.pooled))
        return len(self._dsa_rows) * per_block // self.block_size

    def bytes_per_sequence(self) -> int:
        """KDA bytes one sequence slot costs (recurrent + conv state), whatever its length."""
        return sum(t[:, 0].numel() * t.element_size() for t in (self.kda_state, self.conv_state))

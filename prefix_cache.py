"""Which cache blocks are whose, and the prefix cache over them (DESIGN.md "prefix_cache.py").

`BlockManager` hands out the paged cache's blocks (cache.py holds their memory) with reference counts, so
sequences with a common prefix share its blocks; a full block is registered under a chained hash of its
tokens (`block_hash`) and stays matchable after its owners release it, until it is handed out again. A DSA
block alone cannot restart a sequence: the KDA layers need their recurrent state at that boundary, which
`SnapshotStore` keeps (an LRU within a byte budget). The engine (engine.py) decides when to match, snapshot
and release.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence as Seq

import numpy as np
import torch


def block_hash(prev: bytes, tokens: Seq[int], images: bytes = b"") -> bytes:
    """Chained hash: a block's identity is its tokens (and the digests of the images its <|image|> tokens stand
    for) and everything before them."""
    return hashlib.blake2b(prev + np.asarray(tokens, dtype=np.int64).tobytes() + images, digest_size=16).digest()


@dataclass
class Snapshot:
    kda_state: torch.Tensor  # [n_kda, H, d_k, d_v] after the boundary's last token
    conv_state: torch.Tensor  # [n_kda, 3, conv_kernel - 1, H * d]
    copied: "torch.cuda.Event | None" = None  # the GPU -> pinned CPU copies are done (SnapshotStore.get waits)
    slot: int | None = None  # the pinned arena's slot it lives in (SnapshotStore.pin)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.kda_state, self.conv_state))


class SnapshotStore:
    """KDA snapshots at block boundaries, keyed by the hash of the boundary's last block.

    LRU within `max_bytes` (the full model's snapshot is ~141 MiB, so the budget bounds them).
    With `pin` (the engine calls it when its cache is on a GPU and the store on the CPU), the store
    is an arena of pinned slots allocated once, and a GPU slot's snapshot is copied into one without
    blocking (`get` waits for the copy). H200, full model: a pageable copy took 90 ms, and pinning
    fresh memory for each snapshot was slower still; a prompt takes two.
    """

    def __init__(self, max_bytes: int, device: torch.device):
        self.max_bytes, self.device = max_bytes, device
        self.items: OrderedDict[bytes, Snapshot] = OrderedDict()
        self.nbytes = 0
        self.arena: tuple[torch.Tensor, torch.Tensor] | None = None  # [slots, ...] pinned, kda and conv
        self.free: list[int] = []

    def pin(self, kda_state: torch.Tensor, conv_state: torch.Tensor) -> None:
        """Allocates the pinned arena for snapshots shaped like these (one sequence's slot)."""
        size = Snapshot(kda_state, conv_state).nbytes
        if self.device.type != "cpu" or not 0 < size <= self.max_bytes:
            return
        slots = self.max_bytes // size
        self.clear()
        self.arena = tuple(torch.empty((slots, *t.shape), dtype=t.dtype, pin_memory=True)
                           for t in (kda_state, conv_state))
        self.free = list(range(slots))

    def __contains__(self, h: bytes) -> bool:
        return h in self.items

    def put(self, h: bytes, kda_state: torch.Tensor, conv_state: torch.Tensor) -> None:
        if h in self.items:
            self.items.move_to_end(h)
            return
        size = Snapshot(kda_state, conv_state).nbytes
        if size > self.max_bytes:
            return
        pinned = self.arena is not None and kda_state.is_cuda and self.arena[0].shape[1:] == kda_state.shape
        while self.nbytes + size > self.max_bytes or (pinned and not self.free):
            self.discard(next(iter(self.items)))
        if pinned:
            # The GPU slot may change in the next forward: that is queued after these copies.
            i = self.free.pop()
            kda, conv = (a[i].copy_(t, non_blocking=True) for a, t in zip(self.arena, (kda_state, conv_state)))
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(kda_state.device))
            self.items[h] = Snapshot(kda, conv, copied, i)
        else:
            self.items[h] = Snapshot(kda_state.to(self.device, copy=True), conv_state.to(self.device, copy=True))
        self.nbytes += size

    def get(self, h: bytes) -> Snapshot:
        self.items.move_to_end(h)
        snap = self.items[h]
        if snap.copied is not None:
            snap.copied.synchronize()
        return snap

    def discard(self, h: bytes) -> None:
        snap = self.items.pop(h, None)
        if snap is not None:
            self.nbytes -= snap.nbytes
            if snap.slot is not None:  # a later copy into the slot is queued after this one's
                self.free.append(snap.slot)

    def clear(self) -> None:
        self.items.clear()
        self.nbytes = 0
        self.free = list(range(len(self.arena[0]))) if self.arena is not None else []


class BlockManager:
    """Physical DSA blocks: reference counts, the hash -> block map of full blocks, LRU reuse.

    A free block keeps its hash (and stays findable) until it is handed out again; free blocks are
    handed out least recently freed first. Evicting a block also drops the snapshot keyed by it,
    which could never be used again.
    """

    def __init__(self, num_blocks: int, snapshots: SnapshotStore):
        self.num_blocks, self.snapshots = num_blocks, snapshots
        self.ref = [0] * num_blocks
        self.hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    def num_free(self) -> int:
        return len(self.free)

    def allocate(self) -> int:
        b, _ = self.free.popitem(last=False)
        h = self.hash[b]
        if h is not None:
            if self.cached.get(h) == b:
                del self.cached[h]
                self.snapshots.discard(h)
            self.hash[b] = None
        self.ref[b] = 1
        return b

    def share(self, b: int) -> None:
        if self.ref[b] == 0:
            del self.free[b]
        self.ref[b] += 1

    def release(self, blocks: list[int]) -> None:
        # Reversed: a sequence's first blocks are the most shareable, so they are evicted last.
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None

    def register(self, b: int, h: bytes) -> None:
        self.hash[b] = h
        self.cached[h] = b

    def match(self, hashes: list[bytes], max_blocks: int) -> tuple[int, int]:
        """(hit, common): blocks restorable (DSA blocks and a KDA snapshot), blocks cached at all."""
        common = next((i for i, h in enumerate(hashes) if h not in self.cached), len(hashes))
        hit = next((k for k in range(min(common, max_blocks), 0, -1) if hashes[k - 1] in self.snapshots), 0)
        return hit, common

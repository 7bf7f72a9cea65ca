"""Which device holds each weight and cache row when one process drives several devices.

A plan is made before any weight is read, from the config and the bytes each weight will take once
loaded (`checkpoint.weight_bytes`):
- the embedding, the final norm and lm_head sit on the first device (the engine samples there);
- a layer split gives each layer (the trunk in order, then MTP) to one device in contiguous runs,
  chosen so that the fullest device is as empty as it can be (load relative to its budget);
- with `split_experts`, device d of n also holds routed experts [d·E/n, (d+1)·E/n) of every MoE
  layer: each device computes the routed sum over its own experts and the layer's device adds the
  partial sums (model_glm.GLMModel.moe); the layer split then balances the rest.
A plan that does not fit (weights + the cache rows of its layers > what a device may use) is refused
with the numbers of every device.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

import checkpoint

if TYPE_CHECKING:
    from model_glm import GLMConfig

_LAYER = re.compile(r"layers\.(\d+)\.")
_EXPERT = re.compile(r"layers\.\d+\.mlp\.experts\.(\d+)\.")


class PlacementError(ValueError):
    """A device list or plan we cannot run: names the device and the numbers."""


def parse_devices(devices: str | Sequence[str | torch.device]) -> tuple[torch.device, ...]:
    """"cuda:0,cuda:1" or a list -> devices. "cuda" means cuda:0. A CUDA device may appear once
    (its free memory is its budget); "cpu" may repeat: that is how tests run the multi-device path."""
    items = [s.strip() for s in devices.split(",")] if isinstance(devices, str) else list(devices)
    if not items:
        raise PlacementError("devices: the list is empty")
    out = []
    for s in items:
        try:
            d = torch.device(s)
        except (RuntimeError, TypeError):
            raise PlacementError(f"devices: {s!r} is not a device (expected cpu, cuda or cuda:N)") from None
        if d.type not in ("cpu", "cuda"):
            raise PlacementError(f"devices: {s!r} is a {d.type} device; only cpu and cuda are supported")
        if d.type == "cuda":
            d = torch.device("cuda", d.index or 0)
            count = torch.cuda.device_count()
            if d.index >= count:
                raise PlacementError(f"devices: {s!r} asked for, but this machine has {count} CUDA device(s)")
            if d in out:
                raise PlacementError(f"devices: {d} is listed twice")
        out.append(d)
    return tuple(out)


@dataclass(frozen=True)
class Placement:
    """What goes where. Devices are referred to by their index in `devices` (two entries may be the
    same device: the layout is still the one of two devices)."""

    devices: tuple[torch.device, ...]
    layer_device: tuple[int, ...]  # per layer id: the trunk, then MTP
    n_trunk: int  # trunk layers; a layer id past them is the MTP layer
    split_experts: bool
    n_experts: int
    weight_bytes: tuple[int, ...]  # per device
    cache_bytes: tuple[int, ...]  # per device: the cache rows planned for (see plan's `cache`)
    budget: tuple[int | None, ...]  # per device: bytes it may use, None = not limited

    def device(self, layer: int) -> torch.device:
        return self.devices[self.layer_device[layer]]

    def experts_on(self, d: int) -> range:
        """Routed experts device index d holds under the expert split (of every MoE layer)."""
        n, E = len(self.devices), self.n_experts
        return range(d * E // n, (d + 1) * E // n)

    def expert_groups(self, layer: int) -> list[tuple[torch.device, range]]:
        """(device, expert ids) whose routed sum is computed there, one entry per device index."""
        if not self.split_experts:
            return [(self.device(layer), range(self.n_experts))]
        return [(self.devices[d], self.experts_on(d)) for d in range(len(self.devices))]

    def index_of(self, name: str) -> int:
        """Device index of a weight (in-memory name)."""
        layer, expert = _LAYER.match(name), _EXPERT.match(name)
        if expert is not None and self.split_experts:
            e = int(expert.group(1))
            return next(d for d in range(len(self.devices)) if e in self.experts_on(d))
        return self.layer_device[int(layer.group(1))] if layer is not None else 0

    def device_of(self, name: str) -> torch.device:
        """Where `checkpoint.load_weights` puts a weight."""
        return self.devices[self.index_of(name)]

    def describe(self) -> str:
        """The plan as printed before loading: per device what it holds and its bytes."""
        n = len(self.devices)
        mode = "layer split" + (f", routed experts split {n} ways" if self.split_experts else "")
        lines = [f"placement: {n} device(s), {mode}"]
        for d in range(n):
            held = ["embed_tokens, norm, lm_head"] if d == 0 else []
            held += _runs([L for L, i in enumerate(self.layer_device) if i == d], self.n_trunk)
            if self.split_experts:
                r = self.experts_on(d)
                held.append(f"experts {r.start}-{r.stop - 1} of every MoE layer")
            need = self.weight_bytes[d] + self.cache_bytes[d]
            budget = "no limit given" if self.budget[d] is None else f"of {_size(self.budget[d])}"
            lines.append(f"  [{d}] {str(self.devices[d]):7s} {'; '.join(held) or 'nothing'}: weights "
                         f"{_size(self.weight_bytes[d])} + cache {_size(self.cache_bytes[d])} = {_size(need)} {budget}")
        return "\n".join(lines)


def plan(config: "GLMConfig", sizes: Mapping[str, int], devices: Sequence[str | torch.device], *,
         split_experts: bool = False, budgets: Sequence[int | None] | None = None,
         cache: Mapping[int, int] | None = None) -> Placement:
    """Place weights of `sizes` (bytes by in-memory name, every tensor of the config) and the cache
    (`cache`: bytes of each layer's rows) on `devices` within `budgets` (bytes each may use; None =
    no limit). Raises PlacementError, with every device's numbers, when a device overflows."""
    devices = tuple(torch.device(d) for d in devices)
    n = len(devices)
    budgets = tuple(budgets) if budgets is not None else (None,) * n
    if len(budgets) != n:
        raise PlacementError(f"placement: {len(budgets)} memory budgets for {n} devices")
    if any(b is not None and b <= 0 for b in budgets):
        raise PlacementError(f"placement: memory budgets must be positive, got {list(budgets)}")
    if split_experts and n > config.n_routed_experts:
        raise PlacementError(f"placement: cannot split {config.n_routed_experts} experts over {n} devices")
    expected = checkpoint.expected_tensors(config)
    missing = [k for k in expected if k not in sizes]
    if missing:
        raise PlacementError(f"placement: no size for weight {missing[0]!r} ({len(missing)} missing)")
    n_layers = config.num_hidden_layers + config.num_nextn_predict_layers
    cache = dict(cache or {})

    probe = Placement(devices, (0,) * n_layers, config.num_hidden_layers, split_experts, config.n_routed_experts, (0,) * n, (0,) * n, budgets)
    fixed, load = [0] * n, [0] * n_layers  # bytes bound to a device / bytes that follow their layer
    for name in expected:
        layer, expert = _LAYER.match(name), _EXPERT.match(name)
        if layer is None or (expert is not None and split_experts):
            fixed[probe.index_of(name)] += sizes[name]
        else:
            load[int(layer.group(1))] += sizes[name]
    for L, b in cache.items():
        load[L] += b

    # Balance against the budgets when every device has one, else split the load evenly.
    layer_device = _balance(load, fixed, [b if None not in budgets else 1 for b in budgets])
    weights, cache_bytes = list(fixed), [0] * n
    for L, d in enumerate(layer_device):
        weights[d] += load[L] - cache.get(L, 0)
        cache_bytes[d] += cache.get(L, 0)
    p = Placement(devices, tuple(layer_device), config.num_hidden_layers, split_experts, config.n_routed_experts,
                  tuple(weights), tuple(cache_bytes), budgets)
    over = [d for d in range(n) if budgets[d] is not None and weights[d] + cache_bytes[d] > budgets[d]]
    if over:
        why = "; ".join(f"[{d}] {devices[d]} needs {_size(weights[d] + cache_bytes[d])} (weights "
                        f"{_size(weights[d])} + cache {_size(cache_bytes[d])}), has {_size(budgets[d])}"
                        for d in over)
        raise PlacementError(f"placement does not fit: {why}\n{p.describe()}")
    return p


def sizes_of(weights: Mapping[str, Any]) -> dict[str, int]:
    """Bytes of loaded weights (a tensor, or an EXL3Linear's trellis, suh, svh and bias)."""
    def nbytes(w: Any) -> int:
        if isinstance(w, torch.Tensor):
            return w.numel() * w.element_size()
        if hasattr(w, "trellis"):  # not tensors(): that adds the codebook marker, which is not kept
            return sum(nbytes(t) for t in (w.trellis, w.suh, w.svh, w.bias) if t is not None)
        return sum(nbytes(t) for t in w.tensors().values())
    return {k: nbytes(w) for k, w in weights.items()}


def _balance(load: list[int], fixed: list[int], caps: list[int]) -> list[int]:
    """Contiguous runs of layers over devices (in order) minimizing max_d (fixed_d + run_d) / cap_d:
    bisection on that ratio; at a given ratio, filling each device in turn as far as it goes is
    feasible exactly when some layout is."""
    def fill(r: float) -> list[int] | None:
        out, d, used = [], 0, fixed[0]
        for b in load:
            while used + b > r * caps[d]:
                d += 1
                if d == len(caps):
                    return None
                used = fixed[d]
            out.append(d)
            used += b
        tail_ok = all(fixed[e] <= r * caps[e] for e in range(d, len(caps)))
        return out if tail_ok else None

    lo, hi = 0.0, (sum(load) + sum(fixed)) / min(caps) + 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fill(mid) is not None else (mid, hi)
    return fill(hi)


def _runs(layers: list[int], n_trunk: int) -> list[str]:
    """[0, 1, 2, 5] -> ["layers 0-2", "layer 5"]; the MTP layer is named as such."""
    out, trunk = [], [L for L in layers if L < n_trunk]
    i = 0
    while i < len(trunk):
        j = i
        while j + 1 < len(trunk) and trunk[j + 1] == trunk[j] + 1:
            j += 1
        out.append(f"layer {trunk[i]}" if i == j else f"layers {trunk[i]}-{trunk[j]}")
        i = j + 1
    return out + [f"MTP layer {L}" for L in layers if L >= n_trunk]


def _size(b: int) -> str:
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.2f} MiB"

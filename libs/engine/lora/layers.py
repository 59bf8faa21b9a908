"""Per-row low-rank updates in the forward: every adaptable linear wrapped once at start.

:func:`install` is called by :class:`~libs.engine.model_runner.ModelRunner` once, after the
linears are in their final form (format, ``engine.fuse_projections``, packed CPU kernels) and
before the forward is compiled or captured. Each of attention's and the MLP's projections
becomes a :class:`LoraLinear` around the layer that was there, which still computes the base
output exactly as before (GGUF blocks, int4/int8, packed or plain float weights). On top of it,
for every token row ``t`` whose sequence runs adapter slot ``s_t`` (0: none)::

    y_t = base(x_t) + B_{s_t} (A_{s_t} x_t)      (the scale folded into B at load)

computed for all rows at once with dense ops and one mask, no data-dependent shapes:

- ``lora_a`` ``[P, S, R, in]``: the A of every part (``P``: 3 for a fused q/k/v, 2 for
  gate/up, else 1) of every slot (``S = engine.max_loras``) padded to ``R =
  engine.max_lora_rank``;
- ``h = x @ A_all^T`` ``[T, P, S, R]``, times the step's mask ``[T, 1, S, 1]`` (1 at each
  row's slot, all 0 for a row without adapter), so each row keeps only its own adapter's
  ``R`` columns;
- per part, ``h_p`` ``[T, S*R] @ B_p`` ``[S*R, out_p]``: the zeros of the other slots add
  nothing, so a row's update is its own adapter's, and a row without one gets exactly 0.

The cost is ``S*R*(P*in + out)`` multiply-adds a row per linear whatever the adapters in the
step (the price of static shapes: one compiled graph and one CUDA graph per bucket serve any
mix). The mask is a buffer of ``capacity`` rows written in place before every step
(:meth:`LoraBank.set_rows`), like the positions; the A/B stacks are buffers written in place
when an adapter is loaded, so compiled graphs and captured CUDA graphs read the new weights at
their old addresses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from libs.engine.config import EngineSettings
from libs.engine.lora.adapter import TARGETS, Adapter, LoraTargets

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")
# A fused layer's name → the projections it holds, in output order (libs/engine/fuse.py).
FUSED = {"qkv_proj": QKV, "gate_up_proj": GATE_UP}


def rows_capacity(settings: EngineSettings) -> int:
    """Most token rows one forward carries: the batched-token budget, or a CUDA graph's
    bucket (padded rows, engine.cuda_graph_batch_sizes / cuda_graph_max_tokens)."""
    return max(
        settings.max_num_batched_tokens,
        settings.max_num_seqs,
        settings.cuda_graph_max_tokens,
        max(settings.cuda_graph_batch_sizes),
    )


@dataclass(slots=True)
class LoraBank:
    """The adapter slots' tensors across every wrapped layer, and the step's row mask.

    Owned by the runner (:func:`install`); :class:`~libs.engine.lora.slots.LoraSlots` writes
    adapters into slots, the runner writes the rows before each forward."""

    num_slots: int  # S = engine.max_loras (slot ids 1..S; 0 is "no adapter")
    max_rank: int  # R
    mask: torch.Tensor  # [capacity, S] in the compute dtype: 1 at (row, its slot - 1)
    layers: list[LoraLinear] = field(default_factory=list)
    # The forward skips the update in a step where no row has an adapter; False under
    # torch.compile and CUDA graphs, whose one traced forward must serve every step.
    skip_idle: bool = True
    active: bool = False  # some row of the current step has an adapter

    @property
    def capacity(self) -> int:
        return int(self.mask.shape[0])

    def set_rows(self, slots: Sequence[int]) -> None:
        """The slot of every token row of the coming forward (``[T]``, 0: none)."""
        if len(slots) > self.capacity:
            raise ValueError(f"{len(slots)} rows exceed the LoRA mask's {self.capacity}")
        rows = [i for i, s in enumerate(slots) if s]
        if not rows and not self.active:
            return  # already all zeros
        host = torch.zeros(self.mask.shape, dtype=self.mask.dtype)
        if rows:
            host[rows, [slots[i] - 1 for i in rows]] = 1
        self.mask.copy_(host)
        self.active = bool(rows)

    @torch.no_grad()
    def write(self, slot: int, adapter: Adapter | None) -> None:
        """Put ``adapter``'s weights into ``slot`` (1..S) of every layer; None zeros it."""
        for layer in self.layers:
            layer.write(slot - 1, adapter)

    def nbytes(self) -> int:
        return sum(layer.lora_nbytes() for layer in self.layers)

    def targets(self, base_names: set[str]) -> LoraTargets:
        """What an adapter must fit to go into these slots."""
        linears = {
            name: (layer.in_features, n)
            for layer in self.layers
            for name, n in zip(layer.part_names, layer.part_sizes, strict=True)
        }
        return LoraTargets(linears, frozenset(base_names), self.max_rank)


class LoraLinear(nn.Module):
    """``base(x)`` plus each row's adapter update (see the module docstring); any leading
    shape of ``x``, last dim ``in_features``."""

    lora_a: torch.Tensor  # [P, S, R, in]
    lora_mask: torch.Tensor  # [capacity, S], shared by every layer (the bank's)

    def __init__(
        self, base: nn.Module, parts: list[tuple[str, int]], bank: LoraBank, dtype: torch.dtype
    ) -> None:
        """``parts``: (the original projection's module name, its output features) in the
        order the base layer's output concatenates them."""
        super().__init__()
        self.base = base
        self.in_features = int(base.in_features)  # type: ignore[arg-type]
        self.out_features = sum(n for _, n in parts)
        self.part_names = [name for name, _ in parts]
        self.part_sizes = [n for _, n in parts]
        self.bank = bank
        s, r = bank.num_slots, bank.max_rank
        device = bank.mask.device
        a = torch.zeros(len(parts), s, r, self.in_features, dtype=dtype, device=device)
        self.register_buffer("lora_a", a, persistent=False)
        for p, (_, n) in enumerate(parts):  # lora_b{p}: [out_p, S*R]
            b = torch.zeros(n, s * r, dtype=dtype, device=device)
            self.register_buffer(f"lora_b{p}", b, persistent=False)
        self.register_buffer("lora_mask", bank.mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        bank = self.bank
        if bank.skip_idle and not bank.active:
            return y
        parts, s, r = len(self.part_sizes), bank.num_slots, bank.max_rank
        x2 = x.reshape(-1, self.in_features)  # [T, in]
        t = x2.shape[0]
        a = self.lora_a.view(-1, self.in_features)  # [P*S*R, in]
        h = F.linear(x2.to(a.dtype), a).view(t, parts, s, r)
        h = h * self.lora_mask[:t].view(t, 1, s, 1)  # each row: its own slot's columns
        deltas = [
            F.linear(h[:, p].reshape(t, s * r), getattr(self, f"lora_b{p}")) for p in range(parts)
        ]
        delta = deltas[0] if parts == 1 else torch.cat(deltas, dim=-1)  # [T, out]
        return y + delta.view(y.shape).to(y.dtype)

    @torch.no_grad()
    def write(self, index: int, adapter: Adapter | None) -> None:
        """Slot ``index`` (0-based column) of this layer: ``adapter``'s A/B for each part it
        adapts, zeros elsewhere."""
        s, r = self.bank.num_slots, self.bank.max_rank
        for p, name in enumerate(self.part_names):
            b_p = getattr(self, f"lora_b{p}").view(-1, s, r)  # [out_p, S, R]
            self.lora_a[p, index].zero_()
            b_p[:, index].zero_()
            pair = adapter.weights.get(name) if adapter is not None else None
            if pair is None:
                continue
            a, b = pair  # [rank, in], [out_p, rank]
            k = a.shape[0]
            self.lora_a[p, index, :k].copy_(a)
            b_p[:, index, :k].copy_(b)

    def lora_nbytes(self) -> int:
        tensors = [self.lora_a] + [getattr(self, f"lora_b{p}") for p in range(len(self.part_sizes))]
        return sum(t.numel() * t.element_size() for t in tensors)

    def extra_repr(self) -> str:
        return f"lora: {'+'.join(n.rsplit('.', 1)[-1] for n in self.part_names)}"


def _adaptable(model: nn.Module) -> list[tuple[str, str, list[tuple[str, int]]]]:
    """(parent module name, child name, parts) of every linear an adapter may target, parts
    named as in the unfused model (what PEFT's tensors name)."""
    found = []
    for parent_name, parent in model.named_modules():
        prefix = f"{parent_name}." if parent_name else ""
        for child, module in parent.named_children():
            if child in FUSED:
                names = FUSED[child]
                sizes = list(parent.strait_split)  # type: ignore[arg-type]
                parts = [(prefix + n, int(k)) for n, k in zip(names, sizes, strict=True)]
            elif child in TARGETS and hasattr(module, "in_features"):
                parts = [(prefix + child, int(module.out_features))]  # type: ignore[arg-type]
            else:
                continue
            found.append((parent_name, child, parts))
    return found


def adaptable_linears(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Every adaptable projection's name → ``(in_features, out_features)``."""
    out: dict[str, tuple[int, int]] = {}
    for parent_name, child, parts in _adaptable(model):
        layer = model.get_submodule(f"{parent_name}.{child}".lstrip("."))
        in_features = int(layer.in_features)  # type: ignore[arg-type]
        for name, n in parts:
            out[name] = (in_features, n)
    return out


def bank_bytes(model: nn.Module, settings: EngineSettings, dtype: torch.dtype) -> int:
    """Bytes :func:`install` will take for ``model``'s stacks (0 with ``engine.max_loras`` 0):
    ``S * R * (in + out)`` per projection, plus the mask."""
    if settings.max_loras == 0:
        return 0
    per = settings.max_loras * settings.max_lora_rank
    total = sum(per * (i + o) for i, o in adaptable_linears(model).values())
    total += rows_capacity(settings) * settings.max_loras
    return total * dtype.itemsize


def install(
    model: nn.Module, settings: EngineSettings, device: torch.device, dtype: torch.dtype
) -> LoraBank | None:
    """Wrap every adaptable linear of ``model`` in place (None with ``engine.max_loras`` 0)."""
    if settings.max_loras == 0:
        return None
    mask = torch.zeros(rows_capacity(settings), settings.max_loras, dtype=dtype, device=device)
    bank = LoraBank(settings.max_loras, settings.max_lora_rank, mask)
    for parent_name, child, parts in _adaptable(model):
        parent = model.get_submodule(parent_name) if parent_name else model
        layer = LoraLinear(getattr(parent, child), parts, bank, dtype)
        setattr(parent, child, layer)
        bank.layers.append(layer)
    if not bank.layers:
        raise ValueError("engine.max_loras > 0, but the model has no adaptable linears")
    return bank

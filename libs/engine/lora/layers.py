"""Per-row low-rank updates in the forward: every adaptable linear wrapped once at start.

:func:`install` is called by :class:`~libs.engine.model_runner.ModelRunner` once, after the
linears are in their final form (format, ``engine.fuse_projections``, packed CPU kernels) and
before the forward is compiled or captured. Each of attention's and the MLP's projections
becomes a :class:`LoraLinear` around the layer that was there, which still computes the base
output exactly as before (GGUF blocks, int4/int8, packed or plain float weights). On top of it,
for every token row ``t`` whose sequence runs adapter slot ``s_t`` (0: none)::

    y_t = base(x_t) + B_{s_t} (A_{s_t} x_t)      (the scale folded into B at load)

The stacks: ``lora_a`` ``[S, P, R, in]``, the A of every part (``P``: 3 for a fused q/k/v, 2
for gate/up, else 1) of every slot (``S = engine.max_loras``) padded to ``R =
engine.max_lora_rank``; ``lora_b{p}`` ``[S, R, out_p]``, part ``p``'s B of every slot. Two
ways to apply them (decision 0036):

- **Grouped** (the eager forward, ``LoraBank.eager``): before the step the rows with an
  adapter are grouped by slot (:class:`RowGroups`: ``G`` slots present, each padded to the
  largest group's ``M`` rows); a layer gathers those rows ``[G, M, in]``, multiplies by the
  present slots' A (one ``bmm`` for all parts) and each part's B (one ``bmm`` a part), and adds
  the result into the base output at the rows' indices. Base rows cost nothing; a step
  without adapter rows skips the update.
- **Dense** (under ``engine.compile`` and in CUDA graphs, whose one traced forward must serve
  any mix with static shapes): ``h = x @ A_all^T`` ``[T, S, P, R]`` times the step's mask
  ``[T, S, 1, 1]`` (1 at the row's slot), then per part ``h_p`` ``[T, S*R] @ B_p``
  ``[S*R, out_p]``: the zeros of the other slots add nothing. ``S*R*(P*in + out)``
  multiply-adds a row per linear whatever the mix; the mask is a buffer of ``capacity`` rows
  written in place before every step (:meth:`LoraBank.set_rows`), like the positions.

The stacks are buffers written in place when an adapter is loaded, so compiled graphs and
captured CUDA graphs read the new weights at their old addresses.
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


@dataclass(frozen=True, slots=True)
class RowGroups:
    """A step's adapter rows grouped by slot, for the grouped (eager) update."""

    rows: torch.Tensor  # int64 [G*M]: each present slot's token rows in turn, padded by row 0
    groups: int  # G: slots with rows in the step
    width: int  # M: rows of the largest group
    slots: torch.Tensor | None  # int64 [G]: the present slots' columns; None: all S in order
    real: torch.Tensor | None  # [G*M, 1]: 1 for a row, 0 for padding; None: no padding


def row_groups(slots: Sequence[int], num_slots: int, device: torch.device) -> RowGroups | None:
    """``slots`` (each token row's slot, 0: none) grouped by slot; None when no row has one."""
    by_slot: dict[int, list[int]] = {}
    for i, s in enumerate(slots):
        if s:
            by_slot.setdefault(s, []).append(i)
    if not by_slot:
        return None
    present = sorted(by_slot)
    width = max(len(r) for r in by_slot.values())
    rows: list[int] = []
    for s in present:
        rows += by_slot[s] + [0] * (width - len(by_slot[s]))
    padded = width * len(present) > sum(len(r) for r in by_slot.values())
    real = None
    if padded:
        flags = [[float(j < len(by_slot[s]))] for s in present for j in range(width)]
        real = torch.tensor(flags, device=device)
    every = present == list(range(1, num_slots + 1))
    columns = None if every else torch.tensor([s - 1 for s in present], device=device)
    index = torch.tensor(rows, dtype=torch.int64, device=device)
    return RowGroups(index, len(present), width, columns, real)


@dataclass(slots=True)
class LoraBank:
    """The adapter slots' tensors across every wrapped layer, and the step's row mask.

    Owned by the runner (:func:`install`); :class:`~libs.engine.lora.slots.LoraSlots` writes
    adapters into slots, the runner writes the rows before each forward."""

    num_slots: int  # S = engine.max_loras (slot ids 1..S; 0 is "no adapter")
    max_rank: int  # R
    mask: torch.Tensor  # [capacity, S] in the compute dtype: 1 at (row, its slot - 1)
    layers: list[LoraLinear] = field(default_factory=list)
    # The forward runs eager: the update is grouped by adapter and skipped in a step where no
    # row has one. False under torch.compile and CUDA graphs, whose one traced forward must
    # serve every step: the dense masked update.
    eager: bool = True
    active: bool = False  # some row of the current step has an adapter
    groups: RowGroups | None = None  # the current step's rows by slot (eager)

    @property
    def capacity(self) -> int:
        return int(self.mask.shape[0])

    def set_rows(self, slots: Sequence[int]) -> None:
        """The slot of every token row of the coming forward (``[T]``, 0: none)."""
        if len(slots) > self.capacity:
            raise ValueError(f"{len(slots)} rows exceed the LoRA mask's {self.capacity}")
        if self.eager:
            self.groups = row_groups(slots, self.num_slots, self.mask.device)
            self.active = self.groups is not None
            return
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

    lora_a: torch.Tensor  # [S, P, R, in]
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
        a = torch.zeros(s, len(parts), r, self.in_features, dtype=dtype, device=device)
        self.register_buffer("lora_a", a, persistent=False)
        for p, (_, n) in enumerate(parts):  # lora_b{p}: [S, R, out_p]
            b = torch.zeros(s, r, n, dtype=dtype, device=device)
            self.register_buffer(f"lora_b{p}", b, persistent=False)
        self.register_buffer("lora_mask", bank.mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        bank = self.bank
        if bank.eager and bank.groups is None:
            return y  # no row of the step has an adapter
        x2 = x.reshape(-1, self.in_features).to(self.lora_a.dtype)  # [T, in]
        y2 = y.reshape(x2.shape[0], self.out_features)
        if bank.groups is not None:
            return self._grouped(x2, y2, bank.groups).view(y.shape)
        return (y2 + self._dense(x2).to(y.dtype)).view(y.shape)

    def _part_b(self, p: int) -> torch.Tensor:
        return getattr(self, f"lora_b{p}")  # type: ignore[no-any-return]

    def _grouped(self, x2: torch.Tensor, y2: torch.Tensor, g: RowGroups) -> torch.Tensor:
        """``y2`` (the base output, fresh: added into in place) plus the update of the rows in
        ``g``: one ``bmm`` over the slots present for all parts' A, one a part for B."""
        parts, r, d_in = len(self.part_sizes), self.bank.max_rank, self.in_features
        a = self.lora_a if g.slots is None else self.lora_a.index_select(0, g.slots)
        xs = x2.index_select(0, g.rows)
        if g.real is not None:
            xs = xs * g.real  # padding rows: zero input, zero update
        a = a.view(g.groups, parts * r, d_in).transpose(1, 2)
        h = torch.bmm(xs.view(g.groups, g.width, d_in), a)  # [G, M, P*R]
        start = 0
        for p, n in enumerate(self.part_sizes):
            b = self._part_b(p) if g.slots is None else self._part_b(p).index_select(0, g.slots)
            delta = torch.bmm(h[:, :, p * r : (p + 1) * r], b).view(-1, n)  # [G*M, out_p]
            y2[:, start : start + n].index_add_(0, g.rows, delta.to(y2.dtype))
            start += n
        return y2

    def _dense(self, x2: torch.Tensor) -> torch.Tensor:
        """Every row's update ``[T, out]`` over every slot, the mask keeping its own."""
        parts, s, r = len(self.part_sizes), self.bank.num_slots, self.bank.max_rank
        t = x2.shape[0]
        h = F.linear(x2, self.lora_a.view(-1, self.in_features)).view(t, s, parts, r)
        h = h * self.lora_mask[:t].view(t, s, 1, 1)  # each row: its own slot's columns
        deltas = [
            h[:, :, p].reshape(t, s * r) @ self._part_b(p).view(s * r, n)
            for p, n in enumerate(self.part_sizes)
        ]
        return deltas[0] if parts == 1 else torch.cat(deltas, dim=-1)  # [T, out]

    @torch.no_grad()
    def write(self, index: int, adapter: Adapter | None) -> None:
        """Slot ``index`` (0-based) of this layer: ``adapter``'s A/B for each part it adapts,
        zeros elsewhere."""
        self.lora_a[index].zero_()
        for p, name in enumerate(self.part_names):
            b_p = self._part_b(p)
            b_p[index].zero_()
            pair = adapter.weights.get(name) if adapter is not None else None
            if pair is None:
                continue
            a, b = pair  # [rank, in], [out_p, rank]
            k = a.shape[0]
            self.lora_a[index, p, :k].copy_(a)
            b_p[index, :k].copy_(b.t())

    def lora_nbytes(self) -> int:
        tensors = [self.lora_a] + [self._part_b(p) for p in range(len(self.part_sizes))]
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

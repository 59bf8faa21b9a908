"""The adapters an engine holds: at most ``engine.max_loras``, by name, least recently used
evicted first when idle.

Owned by :class:`~libs.engine.engine.LLMEngine` (engine thread only). ``acquire`` gives a
request its adapter's slot (loading it from ``engine.lora_dir`` when it is not loaded, evicting
the least recently used adapter that no running request holds) and ``release`` gives it back
when the request ends; ``load`` / ``unload`` are the run-time controls (``strait adapters``).

Slot ids are 1..``max_loras`` (0: no adapter), the rows of :class:`LoraBank`'s stacks. An
unloaded adapter's name is forgotten at once (a later request naming it loads it again from the
directory); its slot is cleared when the last request running on it ends, so a running request
always finishes on the weights it started with.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from libs.engine import metrics
from libs.engine.lora.adapter import Adapter, AdapterError, LoraTargets, check_name, read_adapter
from libs.engine.lora.layers import LoraBank

log = logging.getLogger("strait.engine")


class NoFreeSlot(Exception):
    """Every slot holds an adapter that a running request uses (``engine.max_loras``)."""

    code = "no_capacity"  # its ErrorCode where a worker says it back (AdapterReply)


@dataclass(slots=True)
class Loaded:
    """One slot's adapter, and the requests running on it."""

    adapter: Adapter
    refs: int = 0
    unloaded: bool = False  # forgotten by name; cleared when refs reaches 0

    @property
    def key(self) -> str:
        """What salts its sequences' block hashes: no KV reuse across adapters (or across
        two versions of one name)."""
        return f"lora:{self.adapter.name}@{self.adapter.digest}"


class LoraSlots:
    """Adapters by name in the bank's slots (see the module docstring)."""

    def __init__(self, bank: LoraBank, targets: LoraTargets, directory: str | Path = "") -> None:
        self.bank = bank
        self.targets = targets
        self.directory = Path(directory) if directory else None
        self.slots: dict[int, Loaded] = {}  # slot id → its adapter
        self.by_name: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self.loads = 0
        self.evictions = 0

    # ------------------------------------------------------------------ names

    def path_of(self, name: str) -> Path | None:
        """The directory ``name`` loads from (``engine.lora_dir/<name>``), or None."""
        check_name(name)
        if self.directory is None:
            return None
        path = self.directory / name
        return path if path.is_dir() else None

    def loaded(self) -> list[str]:
        return sorted(self.by_name)

    def key(self, slot: int) -> str:
        return self.slots[slot].key

    def name(self, slot: int) -> str:
        return self.slots[slot].adapter.name

    # ------------------------------------------------------------------ requests

    def acquire(self, name: str) -> int:
        """The slot of adapter ``name`` for one request (loaded if needed; see ``load``);
        the request must ``release`` it. AdapterError when it cannot be read, NoFreeSlot when
        every slot is busy, KeyError when it is neither loaded nor in the directory."""
        slot = self.by_name.get(name)
        if slot is None:
            slot = self.load(name)
        self.by_name.move_to_end(name)
        self.slots[slot].refs += 1
        return slot

    def release(self, slot: int) -> None:
        loaded = self.slots[slot]
        loaded.refs -= 1
        if loaded.refs == 0 and loaded.unloaded:
            self._clear(slot)

    # ------------------------------------------------------------------ run-time control

    def load(self, name: str, path: str | Path | None = None) -> int:
        """Read ``name`` (from ``path``, else the directory) and put it in a slot; its slot.
        Loading a name already loaded reads it again into a fresh slot (the old one drains)."""
        source = Path(path) if path is not None else self.path_of(name)
        if source is None:
            raise KeyError(name)
        adapter = read_adapter(name, source, self.targets)  # whole and checked, or raises
        slot = self._free_slot()
        if name in self.by_name:
            self.unload(name)
        self.bank.write(slot, adapter)
        self.slots[slot] = Loaded(adapter)
        self.by_name[name] = slot
        self.loads += 1
        metrics.LORA_LOADS.labels(adapter=name).inc()
        log.info(
            "LoRA adapter %s loaded into slot %d (rank %d, %s)", name, slot, adapter.rank, source
        )
        return slot

    def unload(self, name: str) -> bool:
        """Forget ``name``; its slot is cleared now, or when its last running request ends.
        False when it is not loaded."""
        slot = self.by_name.pop(name, None)
        if slot is None:
            return False
        loaded = self.slots[slot]
        loaded.unloaded = True
        if loaded.refs == 0:
            self._clear(slot)
        return True

    def _free_slot(self) -> int:
        for slot in range(1, self.bank.num_slots + 1):
            if slot not in self.slots:
                return slot
        for name, slot in self.by_name.items():  # least recently used first
            if self.slots[slot].refs == 0:
                self.unload(name)
                self.evictions += 1
                metrics.LORA_EVICTIONS.labels(adapter=name).inc()
                log.info("LoRA adapter %s evicted from slot %d (least recently used)", name, slot)
                return slot
        raise NoFreeSlot(
            f"all {self.bank.num_slots} LoRA slots run requests; raise engine.max_loras"
        )

    def _clear(self, slot: int) -> None:
        self.bank.write(slot, None)
        del self.slots[slot]


__all__ = ["AdapterError", "LoraSlots", "NoFreeSlot"]

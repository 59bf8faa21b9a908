"""LoRA adapters over one base model: many fine-tunes served in one batch (docs/engine.md,
"LoRA adapters").

- :mod:`.adapter`: read and check one adapter directory in PEFT's format (refused whole, never
  half-loaded);
- :mod:`.layers`: the wrapped linears, each row's update by its slot: rows grouped by adapter
  in the eager forward, dense over every slot with a row mask under ``engine.compile`` and in
  CUDA graphs;
- :mod:`.slots`: the adapters an engine holds, at most ``engine.max_loras``, LRU-evicted when
  idle.

The runner installs the layers (``ModelRunner.lora``, None with ``engine.max_loras = 0``, the
default: the forward is then untouched); the engine gives each request's sequences the slot of
the adapter it names and salts their block hashes with it.
"""

from libs.engine.lora.adapter import (
    CONFIG_FILE,
    MAX_RANK,
    TARGETS,
    WEIGHTS_FILE,
    Adapter,
    AdapterError,
    LoraTargets,
    check_name,
    read_adapter,
)
from libs.engine.lora.layers import LoraBank, LoraLinear, bank_bytes, install
from libs.engine.lora.slots import LoraSlots, NoFreeSlot

__all__ = [
    "CONFIG_FILE",
    "MAX_RANK",
    "TARGETS",
    "WEIGHTS_FILE",
    "Adapter",
    "AdapterError",
    "LoraBank",
    "LoraLinear",
    "LoraSlots",
    "LoraTargets",
    "NoFreeSlot",
    "bank_bytes",
    "check_name",
    "install",
    "read_adapter",
]

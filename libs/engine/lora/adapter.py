"""Reading one LoRA adapter from disk in PEFT's format, checked whole before anything is kept.

Called by :class:`~libs.engine.lora.slots.LoraSlots` when an adapter is loaded (at a request
that names it, or by ``strait adapters load``). A directory holds

- ``adapter_config.json``: ``peft_type`` "LORA", ``r``, ``lora_alpha``, ``target_modules``
  (names among :data:`TARGETS`), ``use_rslora``, ``base_model_name_or_path``;
- ``adapter_model.safetensors``: per adapted linear ``<path>.lora_A.weight`` ``[r, in]`` and
  ``<path>.lora_B.weight`` ``[out, r]``, ``<path>`` the module's name in the base model under
  PEFT's ``base_model.model.`` prefix.

The update of a linear is ``scale * B (A x)`` with ``scale = lora_alpha / r`` (``lora_alpha /
sqrt(r)`` with ``use_rslora``). :func:`read_adapter` returns an :class:`Adapter` only when every
field and tensor fits the base (:class:`LoraTargets`) and the engine's bounds; otherwise it
raises :class:`AdapterError` naming what does not fit. Nothing is written into the serving
tensors until then, so a refused adapter is never half-loaded.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The linears an adapter may adapt: attention's and the MLP's projections (llama family names).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Highest rank any engine takes (``engine.max_lora_rank`` is at most this).
MAX_RANK = 64
# PEFT's prefix of module paths in saved adapters (``PeftModel.base_model.model``).
PEFT_PREFIX = "base_model.model."
# An adapter's name: a model name on the wire (``model``) and a directory name on disk.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# PEFT options that change the update's form: refused (their value when off).
UNSUPPORTED: dict[str, Any] = {
    "use_dora": False,
    "fan_in_fan_out": False,
    "bias": "none",
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "layer_replication": None,
    "lora_bias": False,
    "alora_invocation_tokens": None,
    "target_parameters": None,
    "trainable_token_indices": None,
    "use_qalora": False,
    "kasa_config": None,
}
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


class AdapterError(ValueError):
    """An adapter the engine refuses; the message names the field or tensor that does not fit."""


@dataclass(frozen=True, slots=True)
class LoraTargets:
    """What an adapter must fit: the base model's adaptable linears (module name →
    ``(in_features, out_features)``), the names it answers to as a base, and the rank bound."""

    linears: dict[str, tuple[int, int]]
    base_names: frozenset[str]
    max_rank: int


@dataclass(slots=True)
class Adapter:
    """One checked adapter, on the CPU in float32: per adapted linear ``(A [r, in], B [out, r]
    already multiplied by the scale)``."""

    name: str
    path: Path
    rank: int
    scale: float
    base: str  # base_model_name_or_path as the config gives it ("" when absent)
    digest: str  # of the weights file: tells two adapters of one name apart (prefix cache)
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of its tensors as read (float32)."""
        return sum(a.numel() * 4 + b.numel() * 4 for a, b in self.weights.values())


def check_name(name: str) -> str:
    """``name`` if it can name an adapter (a directory and a model name), else AdapterError."""
    if not NAME_PATTERN.match(name):
        raise AdapterError(
            f"adapter name {name!r}: letters, digits, '.', '_' or '-', 1 to 128 characters"
        )
    return name


def read_config(path: Path) -> dict[str, Any]:
    """The adapter's config, with what Strait cannot serve refused."""
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise AdapterError(f"{path}: no {CONFIG_FILE}") from None
    except (OSError, ValueError) as e:
        raise AdapterError(f"{path / CONFIG_FILE}: unreadable ({e})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path / CONFIG_FILE}: not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise AdapterError(f"peft_type {peft_type!r}: only LORA adapters are served")
    for key, off in UNSUPPORTED.items():
        value = config.get(key, off)
        if value not in (off, None, [], {}):
            raise AdapterError(f"{key} = {value!r} is not supported (only {off!r})")
    return config


def _rank_and_scale(config: dict[str, Any], max_rank: int) -> tuple[int, float]:
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise AdapterError(f"rank r = {r!r}: a positive integer is needed")
    if r > max_rank:
        raise AdapterError(
            f"rank r = {r} exceeds engine.max_lora_rank = {max_rank} (at most {MAX_RANK})"
        )
    alpha = config.get("lora_alpha", r)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterError(f"lora_alpha = {alpha!r}: a number is needed")
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return r, float(scale)


def _check_targets(config: dict[str, Any]) -> None:
    targets = config.get("target_modules")
    if isinstance(targets, str):  # a regex over module paths: the tensors' names decide
        return
    if not isinstance(targets, list) or not targets:
        raise AdapterError(f"target_modules = {targets!r}: a list of module names is needed")
    for t in targets:
        if t not in TARGETS:
            raise AdapterError(f"target module {t!r} is not served (only {', '.join(TARGETS)})")


def _check_base(config: dict[str, Any], targets: LoraTargets) -> str:
    base = config.get("base_model_name_or_path") or ""
    if not isinstance(base, str):
        raise AdapterError(f"base_model_name_or_path = {base!r}: a string is needed")
    if base and targets.base_names:
        known = {n.rstrip("/").rsplit("/", 1)[-1].lower() for n in targets.base_names if n}
        if base.rstrip("/").rsplit("/", 1)[-1].lower() not in known:
            raise AdapterError(
                f"base model {base!r} is not this pool's ({', '.join(sorted(known))})"
            )
    return base


def _pair_tensors(
    tensors: dict[str, torch.Tensor], targets: LoraTargets, rank: int, scale: float
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each adapted linear's ``(A, scale * B)``, every name and shape checked."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(f"tensor {key!r} is not a LoRA A/B weight")
        module = m["module"].removeprefix(PEFT_PREFIX)
        if module not in targets.linears:
            leaf = module.rsplit(".", 1)[-1]
            what = "target module" if leaf not in TARGETS else "module"
            raise AdapterError(f"{what} {module!r} is not an adaptable linear of the base model")
        halves.setdefault(module, {})[m["ab"]] = t
    if not halves:
        raise AdapterError(f"{WEIGHTS_FILE} holds no LoRA weights")
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{module}: lora_A and lora_B are both needed")
        a, b = ab["A"], ab["B"]
        d_in, d_out = targets.linears[module]
        if tuple(a.shape) != (rank, d_in) or tuple(b.shape) != (d_out, rank):
            raise AdapterError(
                f"{module}: shapes A {tuple(a.shape)} and B {tuple(b.shape)} do not fit the base "
                f"model's {d_in} -> {d_out} linear at rank {rank} (A ({rank}, {d_in}), "
                f"B ({d_out}, {rank}))"
            )
        if not (a.is_floating_point() and b.is_floating_point()):
            raise AdapterError(f"{module}: LoRA weights must be floating point")
        a32, b32 = a.float(), b.float() * scale
        if not (torch.isfinite(a32).all() and torch.isfinite(b32).all()):
            raise AdapterError(f"{module}: LoRA weights hold NaN or infinity")
        out[module] = (a32.contiguous(), b32.contiguous())
    return out


def read_adapter(name: str, path: str | Path, targets: LoraTargets) -> Adapter:
    """The adapter in directory ``path``, checked against ``targets``; AdapterError if any
    part does not fit (see the module)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    check_name(name)
    path = Path(path)
    config = read_config(path)
    rank, scale = _rank_and_scale(config, targets.max_rank)
    _check_targets(config)
    base = _check_base(config, targets)
    try:
        raw = (path / WEIGHTS_FILE).read_bytes()
    except FileNotFoundError:
        raise AdapterError(f"{path}: no {WEIGHTS_FILE}") from None
    try:
        tensors = load(raw)
    except (SafetensorError, ValueError) as e:
        raise AdapterError(f"{path / WEIGHTS_FILE}: unreadable ({e})") from None
    weights = _pair_tensors(tensors, targets, rank, scale)
    digest = hashlib.blake2b(raw, digest_size=8).hexdigest()
    return Adapter(name, path, rank, scale, base, digest, weights)

"""Strait's CPU kernels (the C++ sources beside this module), compiled on first use and cached.

The model runner calls :func:`load` once at start when ``engine.cpu_kernels`` allows it; the
result is the compiled module (``pack_weight``, ``packed_linear``, ``paged_row_attention``,
``paged_attention``, ``argmax_rows``; ``packed_linear`` and ``paged_attention`` also as
``torch.ops.strait.*``, see ``ops.py``) or ``None`` when the kernels are off, the device is not
a CPU, the dtype is not float32, or (under ``auto``) the build failed. ``make kernels`` / ``python -m libs.engine.kernels`` builds
them ahead of time so a worker's first start does not wait for the compiler (~40 s here).

Why the kernels exist (MKL's fp32 GEMV and small-M GEMMs, SDPA over a padded gather):
docs/decisions/0005-cpu-kernels.md.
"""

from __future__ import annotations

import hashlib
import logging
import platform
import sys
import threading
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger("strait.engine")

HERE = Path(__file__).parent
# One translation unit per kernel family, and the one that binds them into the module (torch's
# loader compiles each into its own object, in parallel where the machine has the cores).
SOURCES = tuple(
    HERE / name
    for name in (
        "packed_linear.cpp",
        "block_linear.cpp",
        "paged_attention.cpp",
        "sampler.cpp",
        "bindings.cpp",
    )
)
# What the sources include: the ISA macros and helpers, the entry points, the block format and
# its per-ISA tiles.
HEADERS = tuple(
    HERE / name
    for name in (
        "cpu_isa.h",
        "kernels.h",
        "block_layout.h",
        "block_tiles_avx2.h",
        "block_tiles_avx512.h",
    )
)
Mode = Literal["auto", "on", "off"]

_lock = threading.Lock()
_loaded: dict[str, Any] = {}


def cpu_tag() -> str:
    """Short hash of this CPU's feature flags: builds use -march=native, so a build cached for
    one CPU is never loaded on another."""
    flags = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags += line
                    break
    except OSError:
        pass
    return hashlib.sha256(flags.encode()).hexdigest()[:8]


def source_tag() -> str:
    """Short hash of every source and header: part of the build's name, so an edited checkout
    (or a second checkout, beside this one, of other code) builds into its own directory of the
    shared extensions cache instead of rebuilding, and replacing, another's build."""
    h = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:8]


# Extra compiler flags and module-name suffix per build variant. "native": everything this CPU
# has (the engine's build). "avx2": AVX-512 off and no dispatcher ops, for tests that hold the
# AVX2 path against the AVX-512 one in the same process.
VARIANTS: dict[str, tuple[list[str], str]] = {
    "native": ([], ""),
    "avx2": (["-mno-avx512f", "-DSTRAIT_NO_OPS"], "_avx2"),
}


def build(variant: str = "native") -> Any:
    """Compile (or load the cached build of) the kernels; raises when the build fails."""
    with _lock:
        if variant in _loaded:
            return _loaded[variant]
        from torch.utils.cpp_extension import load as load_extension

        from libs.engine.kernels.build_lock import build_directory, exclusive_build

        flags, suffix = VARIANTS[variant]
        name = f"strait_cpu_kernels_{cpu_tag()}_{source_tag()}{suffix}"
        with exclusive_build(build_directory(name)):
            module = load_extension(
                name=name,
                sources=[str(path) for path in SOURCES],
                extra_cflags=["-O3", "-march=native", "-fopenmp", *flags],
                # libgomp resolves to the copy torch has already loaded (same soname), so the
                # kernels share torch's OpenMP thread pool instead of starting a second one.
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        if variant == "native":
            from libs.engine.kernels.ops import register_fakes

            register_fakes()
        # Importable by name: a graph loaded from disk (libs/engine/aot.py) finds the ops there.
        sys.modules.setdefault(module.__name__, module)
        _loaded[variant] = module
        return module


def load(mode: Mode, device: str, dtype: str) -> Any | None:
    """The kernels for a model on ``device`` in ``dtype``, or ``None`` when they do not apply.

    ``on`` raises when they cannot be used; ``auto`` logs why and returns ``None``."""
    if mode == "off":
        return None
    if not device.startswith("cpu") or dtype != "float32":
        if mode == "on":
            raise ValueError(
                f"engine.cpu_kernels=on needs a float32 CPU model, not {dtype} on {device}"
            )
        return None
    try:
        return build()
    except Exception as e:  # a missing compiler or headers: fall back to torch's kernels
        if mode == "on":
            raise
        log.warning("CPU kernels unavailable, using torch's (%s: %s)", type(e).__name__, e)
        return None

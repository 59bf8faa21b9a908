"""Does the one-row linear follow the machine's memory rate? Prints, every ~2 s, the engine
bench's bandwidth probe (``bench.engine.measure_bandwidth_gb_s``: best of ten ``sum`` passes
over a 512 MiB buffer) and, right after it, the rate at which ``packed_linear`` reads
SmolLM2-135M-shaped layer weights at one row (random weights, packed and on huge pages as in
the engine).

Run: ``.venv/bin/python -m bench.memory_states [seconds]`` (default 120). On the 2-core VM
both rates switch together between ~31-34 GB/s and bursts of ~50-57 GB/s lasting seconds;
the engine bench's c=1 ratio depends on which state its probe caught (docs/performance.md).
"""

from __future__ import annotations

import sys
import time

import torch

LINEAR_PASSES = 5
# SmolLM2-135M: hidden 576, 3 KV heads of 64, MLP 1536, 30 layers; (out, in) per linear
HIDDEN, KV, MLP, LAYERS = 576, 192, 1536, 30
LAYER_SHAPES = [
    (HIDDEN, HIDDEN),
    (KV, HIDDEN),
    (KV, HIDDEN),
    (HIDDEN, HIDDEN),
    (MLP, HIDDEN),
    (MLP, HIDDEN),
    (HIDDEN, MLP),
]


def main(argv: list[str] | None = None) -> int:
    from torch import nn

    from bench.engine import measure_bandwidth_gb_s
    from libs.engine import kernels
    from libs.engine.kernels.linear import PackedLinear, pack_linears

    args = sys.argv[1:] if argv is None else argv
    seconds = float(args[0]) if args else 120.0
    k = kernels.build()
    # Packed and moved into one huge-page arena by the engine's own loader.
    model = nn.Sequential(
        *(nn.Linear(kdim, n, bias=False) for _ in range(LAYERS) for n, kdim in LAYER_SHAPES)
    )
    pack_linears(model, k)
    layers = [m for m in model if isinstance(m, PackedLinear)]
    weight_bytes = sum(m.packed.numel() * 4 for m in layers)
    xs = {HIDDEN: torch.randn(1, HIDDEN), MLP: torch.randn(1, MLP)}

    def linears_gb_s() -> float:
        best = float("inf")
        for _ in range(LINEAR_PASSES):
            t = time.perf_counter()
            for m in layers:  # the kernel directly: no module-call overhead in the rate
                k.packed_linear(xs[m.in_features], m.packed, m.out_features, None)
            best = min(best, time.perf_counter() - t)
        return weight_bytes / best / 1e9

    print(f"{weight_bytes / 2**20:.0f} MiB of layer weights, {torch.get_num_threads()} threads")
    print("    t s   probe GB/s   one-row linears GB/s   linears / probe")
    t0 = time.time()
    while time.time() - t0 < seconds:
        probe, lin = measure_bandwidth_gb_s(), linears_gb_s()
        print(f"{time.time() - t0:7.0f} {probe:12.1f} {lin:22.1f} {lin / probe:17.0%}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

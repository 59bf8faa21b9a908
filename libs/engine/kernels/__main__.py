"""``python -m libs.engine.kernels``: build the CPU kernels ahead of a worker's first start."""

import time

from libs.engine import kernels

t0 = time.perf_counter()
print("building Strait's CPU kernels (cached after the first build)...", flush=True)
module = kernels.build()
print(
    f"CPU kernels ready in {time.perf_counter() - t0:.1f} s "
    f"(AVX2: {module.avx2}, AVX-512: {module.avx512}, VNNI: {module.vnni})"
)

"""One build of the CPU kernels at a time across processes, and no stale lock left behind.

torch's extension loader takes a lock *file* (``<build dir>/lock``, its ``FileBaton``) around
every load, even one that only finds the build up to date, and a process that finds the file
waits until it disappears. A worker killed in that window (``kill -9`` during start-up, a
supervisor stopping a fleet that is still starting) leaves the file, and every later worker on
the machine waits for it forever. :func:`exclusive_build` (called by ``libs.engine.kernels.build``)
holds an ``flock`` around the load: the kernel drops it when its holder dies, so whoever holds
it knows no other Strait process is inside torch's build, and a lock file it finds is stale.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("strait.engine")

FLOCK_NAME = "strait.flock"
BATON_NAME = "lock"  # torch.utils.file_baton.FileBaton's file in the build directory


def build_directory(name: str) -> Path:
    """Where torch builds the extension ``name`` (``TORCH_EXTENSIONS_DIR`` or its default root,
    with its per-Python/device subdirectory)."""
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(name, verbose=False))


@contextmanager
def exclusive_build(build_dir: Path) -> Iterator[None]:
    """Hold the cross-process build lock of ``build_dir``; remove a stale torch lock file."""
    build_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(build_dir / FLOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        baton = build_dir / BATON_NAME
        if baton.exists():
            log.warning(
                "removing a stale kernel build lock (a process died while loading the kernels)",
                extra={"path": str(baton)},
            )
            baton.unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # releases the flock

from __future__ import annotations

import subprocess
import sys

import pytest

from libs.engine.hashing import ROOT_HASH, block_hash, chain_hashes

pytestmark = pytest.mark.unit


def test_chain_hash_covers_full_blocks_and_depends_on_everything_before() -> None:
    ids = list(range(10))
    hashes = chain_hashes(ids, 4, "m")
    assert len(hashes) == 2  # the trailing 2 tokens form no full block
    assert hashes[0] == block_hash(ROOT_HASH, [0, 1, 2, 3], "m")
    assert hashes[1] == block_hash(hashes[0], [4, 5, 6, 7], "m")
    # Same block tokens after a different prefix → different hash.
    other = chain_hashes([9, 9, 9, 9, 4, 5, 6, 7], 4, "m")
    assert other[1] != hashes[1]
    # The model id is part of the hash.
    assert chain_hashes(ids, 4, "other")[0] != hashes[0]
    assert all(-(2**63) <= h < 2**63 for h in hashes)


def test_hash_is_stable_across_processes() -> None:
    code = (
        "from libs.engine.hashing import chain_hashes;"
        "print(chain_hashes(list(range(32)), 16, 'smollm2'))"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
            cwd=".",
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1
    assert outs.pop().strip() == str(chain_hashes(list(range(32)), 16, "smollm2"))

"""Steps replayed as CUDA graphs (decision 0018).

A step of a 135M model on a GPU is a thousand small kernels: launched one by one from Python it
costs ~18 ms whatever the batch (performance.md, "CUDA"); replayed from a captured graph, the
launches cost the GPU microseconds and the host nothing. A graph replays fixed shapes at fixed
addresses. Its rows are tokens, each one query over its own sequence's blocks seeing keys
``0..p`` at position ``p`` (both attentions here read a row's keys through its own table and
length, whatever the other rows are), so the runner sends here every step of decode tokens
and, up to ``engine.cuda_graph_max_tokens`` tokens, steps that carry prompt tokens (each
token's row given its sequence's table; the runner keeps the logits of the rows that sample).
The runner

- pads the rows to the next of ``engine.cuda_graph_batch_sizes`` and the block-table width to
  the next power of two: one graph per (rows, width) pair, captured the first time a step
  needs it (a few forwards' time) and kept;
- writes a step's inputs as one ``int64`` vector into a host staging buffer and copies it to
  the graph's input buffer with one host-to-device copy; everything else is replayed: the
  inputs' split into token ids, positions, KV slots, context lengths and block tables, the
  attention mask built from the lengths, the forward, the float32 logits;
- points padding rows at a scratch block no sequence holds (their K/V land there, they attend
  one key of it), so they never touch a sequence's cache.

The logits come back ``[rows, vocab]`` in the graph's own output buffer, valid until the next
replay; the sampler takes its arg-max on the device and copies back only the token ids.

**Running ahead** (``engine.cuda_run_ahead``): after a step of plain-greedy decode rows the
runner launches the rows' next step before the host has seen this one's tokens —
:meth:`DecodeGraphs.launch_ahead` stages the next positions, slots and tables and copies the
arg-max ids into the graph's input on the device, so the GPU runs step N+1 while the host
updates, detokenizes and schedules after step N. The next ``execute`` uses that replay when its
step is exactly the one launched (same rows, positions, slots, tables, and the ids that came
back), and drops it otherwise (a sequence stopped, a request arrived): its K/V writes went to
slots the real step rewrites with the same values, or to blocks that were freed, which are
always written before they are read.

Capturing is a function handed in (:data:`Capture`): :func:`cuda_capture` on a GPU,
:func:`eager_capture` (the same bookkeeping, every replay a plain call) on a CPU, where the
tests check padding, buckets and buffers against the eager step.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from libs.engine.attention import AttentionMetadata, KvCache

log = logging.getLogger("strait.engine")

# capture(fn) -> replay: runs ``fn`` (the forward over the graph's input buffers) as often as
# warming up needs, records it, and returns a callable that re-runs the recording and returns
# ``fn``'s output tensor (the same tensor every time, refilled).
Capture = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]
# forward(**model inputs) -> the model's output (``.logits``)
Forward = Callable[..., Any]


def eager_capture(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """No graph: every replay calls ``fn`` again (CPU tests of the bookkeeping)."""
    fn()
    return fn


def cuda_capture(pool: Any = None) -> Capture:
    """Capture with ``torch.cuda.CUDAGraph``, all graphs in one memory pool (they never run at
    the same time; each graph's output stays allocated while the graph lives)."""
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()

    def capture(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        # Warm up on a side stream (cuBLAS workspaces, lazy inits, a compiled forward's
        # autotuning) so none of it is recorded.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    return capture


def batch_bucket(rows: int, sizes: Sequence[int]) -> int | None:
    """The smallest of the sorted ``sizes`` that holds ``rows``; None when none does."""
    i = bisect.bisect_left(sizes, rows)
    return sizes[i] if i < len(sizes) else None


def width_bucket(width: int, max_width: int) -> int | None:
    """Block-table columns padded to a power of two, at least 2 (a compiled graph keeps sizes
    0 and 1 apart from the rest); None past ``max_width`` (a longer sequence than the model
    takes)."""
    w = 2
    while w < width:
        w *= 2
    return w if w <= max(2, max_width) else None


@dataclass(slots=True)
class _Graph:
    rows: int
    width: int
    staging: torch.Tensor  # host [rows * (4 + width)] int64, pinned on CUDA
    inputs: torch.Tensor  # the same on the device, read by the graph
    replay: Callable[[], torch.Tensor]  # -> logits [rows, vocab] float32
    step: Callable[[], torch.Tensor]  # what the graph recorded, callable eagerly (profiling)
    # CUDA: recorded after the last copy out of `staging`; the next staging waits for it (a
    # step launched ahead may still be queued behind the one running).
    copied: Any = None


class DecodeGraphs:
    """The step graphs of one model runner, keyed by (rows, table width)."""

    def __init__(
        self,
        forward: Forward,
        cache: KvCache,
        scratch_block: int,
        batch_sizes: Sequence[int],
        max_width: int,
        capture: Capture,
        *,
        dynamic: bool = False,
        triton: bool = False,
    ) -> None:
        """``forward``: the model call (eager or compiled); ``scratch_block``: a cache block no
        sequence is ever given (padding rows write and read it); ``dynamic``: mark the sizes
        that differ between graphs dynamic (a compiled ``forward`` then compiles once for every
        bucket instead of once each); ``triton``: attention by Triton's paged kernel
        (``libs/engine/triton_attention.py``) instead of a gather and SDPA."""
        self.forward = forward
        self.cache = cache
        self.scratch_block = scratch_block
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_width = max_width
        self.capture = capture
        self.dynamic = dynamic
        self.triton = triton
        self.device = cache.data.device
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.replays = 0
        self.failed = False  # a capture failed: every step runs eager
        bs = cache.block_size
        max_rows = self.batch_sizes[-1]
        # Constants the graphs read: key positions for the mask, row indices.
        self._key_pos = torch.arange(max(2, max_width) * bs, device=self.device)
        self._row_idx = torch.arange(max_rows, device=self.device)

    def bucket(self, rows: int, width: int) -> tuple[int, int] | None:
        """The (rows, width) graph a step of ``rows`` decode tokens over at most ``width``
        blocks replays; None when the step is larger than every graph (it runs eager)."""
        r = batch_bucket(rows, self.batch_sizes)
        w = width_bucket(width, self.max_width)
        return None if r is None or w is None else (r, w)

    def warm_up(self) -> None:
        """Capture the graphs of the two smallest batch sizes at the narrowest width before
        serving: the first capture of a compiled forward compiles it (one row is its own
        compile, two and more share one), which would otherwise stall the first request."""
        for rows in self.batch_sizes[:2]:
            if (rows, 2) not in self.graphs:
                self._capture(rows, 2)

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        tables: list[list[int]],
    ) -> torch.Tensor | None:
        """Logits ``[B, vocab]`` float32 of a step of B token rows (row ``i`` at
        ``positions[i]`` of its sequence, its K/V to ``slots[i]``, its sequence's blocks
        ``tables[i]``), or None when no graph holds it. The tensor is the graph's output
        buffer: read it before the next call."""
        b = len(input_ids)
        key = self.bucket(b, max(len(t) for t in tables))
        if key is None:
            return None
        g = self.graphs.get(key)
        if g is None:
            if self.failed:
                return None
            try:
                g = self._capture(*key)
            except Exception:
                # A forward that does not capture (a host sync in a model's code, say) serves
                # eager from here on: slower, the same answers.
                log.exception("decode graph (%d rows, %d blocks) did not capture; eager", *key)
                self.failed = True
                return None
        self._stage(g, input_ids, positions, slots, tables)
        self.replays += 1
        return g.replay()[:b]

    def launch_ahead(
        self,
        ids: torch.Tensor,
        positions: list[int],
        slots: list[int],
        tables: list[list[int]],
    ) -> torch.Tensor | None:
        """Queue the replay of a step of decode rows whose token ids are ``ids`` (``[B]``
        int64 on the device, not yet on the host); returns its logits ``[B, vocab]`` (valid
        until the next replay), or None when no captured graph holds the step (it is not
        captured here: the step then runs normally)."""
        b = len(positions)
        key = self.bucket(b, max(len(t) for t in tables))
        g = None if key is None or self.failed else self.graphs.get(key)
        if g is None:
            return None
        self._stage(g, [0] * b, positions, slots, tables)
        g.inputs[:b].copy_(ids)  # on the device, queued after the staged copy
        self.replays += 1
        return g.replay()[:b]

    def _stage(
        self,
        g: _Graph,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        tables: list[list[int]],
    ) -> None:
        """Fill the graph's inputs: one host vector, one copy to the device. Rows past ``B``
        are padding over the scratch block."""
        r, w = g.rows, g.width
        pad = r - len(input_ids)
        scratch_slot = self.scratch_block * self.cache.block_size
        flat = list(input_ids)
        flat += [0] * pad
        flat += positions
        flat += [0] * pad
        flat += slots
        flat += [scratch_slot] * pad
        flat += [p + 1 for p in positions]  # context lengths
        flat += [1] * pad
        for t in tables:
            flat += t
            flat += [t[-1]] * (w - len(t))  # the kernel masks a row past its own blocks
        flat += [self.scratch_block] * (w * pad)
        if g.copied is not None:
            g.copied.synchronize()  # the last copy out of the pinned buffer has run
        g.staging.copy_(torch.tensor(flat, dtype=torch.int64))
        g.inputs.copy_(g.staging, non_blocking=True)
        if self.device.type == "cuda":
            g.copied = torch.cuda.Event()
            g.copied.record()

    def _logits(
        self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        out = self.forward(
            input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=0, strait_attn=meta
        )
        return out.logits[0].float()  # [rows, vocab]

    def _capture(self, rows: int, width: int) -> _Graph:
        n = rows * (4 + width)
        pin = self.device.type == "cuda"
        staging = torch.empty(n, dtype=torch.int64, pin_memory=pin)
        inputs = torch.empty(n, dtype=torch.int64, device=self.device)
        bs = self.cache.block_size
        # The graph's own tensors, filled from `inputs` inside the graph (copies, so the model
        # sees inputs that alias nothing).
        ids = torch.empty(1, rows, dtype=torch.int64, device=self.device)
        pos = torch.empty(1, rows, dtype=torch.int64, device=self.device)
        slots = torch.empty(rows, dtype=torch.int64, device=self.device)
        lens = torch.empty(rows, dtype=torch.int64, device=self.device)
        # The block tables: flat for the gather (sdpa), [rows, width] for Triton's kernel.
        block_ids = torch.empty(rows * width, dtype=torch.int64, device=self.device)
        tables = torch.empty(rows, width, dtype=torch.int64, device=self.device)
        token_idx = self._row_idx[:rows].clone()
        key_pos = self._key_pos[: width * bs]
        if self.dynamic:
            if rows > 1:
                for t in (ids, pos):
                    torch._dynamo.mark_dynamic(t, 1)
                for t in (slots, token_idx, lens, tables):
                    torch._dynamo.mark_dynamic(t, 0)
            torch._dynamo.mark_dynamic(block_ids, 0)
            torch._dynamo.mark_dynamic(tables, 1)

        def step() -> torch.Tensor:
            ids.view(-1).copy_(inputs[:rows])
            pos.view(-1).copy_(inputs[rows : 2 * rows])
            slots.copy_(inputs[2 * rows : 3 * rows])
            lens.copy_(inputs[3 * rows : 4 * rows])
            if self.triton:
                tables.copy_(inputs[4 * rows :].view(rows, width))
                meta = AttentionMetadata(
                    cache=self.cache,
                    slot_mapping=slots,
                    decode_token_idx=token_idx,
                    decode_all=True,
                    row_tables=tables,
                    row_lens=lens,
                )
                return self._logits(ids, pos, meta)
            block_ids.copy_(inputs[4 * rows :])
            # [1, rows, 1, width * block_size]: True where the key is inside the row's context.
            mask = (key_pos.unsqueeze(0) < lens.unsqueeze(1))[:, None, :].unsqueeze(0)
            if self.dynamic:
                if rows > 1:
                    torch._dynamo.mark_dynamic(mask, 1)
                torch._dynamo.mark_dynamic(mask, 3)
            meta = AttentionMetadata(
                cache=self.cache,
                slot_mapping=slots,
                decode_token_idx=token_idx,
                decode_block_ids=block_ids,
                decode_mask=mask,
                decode_all=True,
            )
            return self._logits(ids, pos, meta)

        # Capture over padding only: warm-up and capture write K/V into the scratch block.
        g = _Graph(rows, width, staging, inputs, step, step)
        self._stage(g, [], [], [], [])
        g.replay = self.capture(step)
        self.graphs[(rows, width)] = g
        return g

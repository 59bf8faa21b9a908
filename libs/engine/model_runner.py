"""Runs one packed forward per step over the scheduled tokens of every sequence.

Owned by the engine; called once per step with the scheduler's output. It

- runs any ``AutoModelForCausalLM`` (llama / qwen2 / mistral families) loaded with Strait's
  paged attention (:mod:`libs.engine.attention`) selected, ``use_cache=False`` so transformers
  keeps no cache of its own (:mod:`libs.engine.loader`);
- owns the :class:`~libs.engine.attention.KvCache` tensors, sized from the settings
  (:func:`~libs.engine.loader.num_kv_blocks`);
- packs prefill chunks and decode tokens into one ``[1, T]`` batch with absolute positions,
  builds the attention metadata, and asks for logits only at sampled positions
  (``logits_to_keep`` as a long tensor).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import time
import types
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from libs.engine import attention, fuse, kernels, lora, quant, triton_attention
from libs.engine.aot import AotForward
from libs.engine.attention import AttentionMetadata, KvCache, PrefillSegment
from libs.engine.config import EngineSettings
from libs.engine.cuda_graphs import Capture, DecodeGraphs, batch_bucket, cuda_capture
from libs.engine.kernels.linear import PackedLinear, pack_linears
from libs.engine.loader import DTYPES, ModelShape, num_kv_blocks
from libs.engine.scheduler import ScheduledSeq

log = logging.getLogger("strait.engine")


@dataclass(slots=True)
class _Ahead:
    """A step launched ahead (:meth:`ModelRunner.run_ahead`): what it computes, and its logits
    (the graph's output buffer, valid until the next replay)."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    tables: list[list[int]]
    logits: torch.Tensor

    def is_step(
        self, input_ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]]
    ) -> bool:
        return (
            input_ids == self.input_ids
            and positions == self.positions
            and slots == self.slots
            and tables == self.tables
        )


def own_forward_entry() -> Callable[..., Any]:
    """A new ``entry(model, **inputs) -> model(**inputs)`` with a code object of its own, for
    one runner to compile. Dynamo keeps compiled graphs per code object, and graphs of a
    model's own ``forward`` are shared by every model of its class in the process, told apart
    only by guards on their modules (~5,700 for a 30-layer llama, ~0.8 ms a call even when
    only the guards that tell graphs apart are checked). Through its own entry a runner's
    graphs serve only its model, so the runner compiles with the guards on modules off."""

    def entry(model: torch.nn.Module, **inputs: Any) -> Any:
        return model(**inputs)

    return types.FunctionType(entry.__code__.replace(), entry.__globals__, entry.__name__)


def pad_tables(tables: list[list[int]], width: int) -> list[list[int]]:
    """Block tables padded to ``width`` columns with each row's last block (the kernels and
    the decode mask never read a row past its own blocks)."""
    return [t + [t[-1]] * (width - len(t)) for t in tables]


def example_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    """A step's forward inputs with fresh tensors for compiling from: copies of the small ones,
    and an alias (same storage, new tensor) of the KV cache, so that marks the compiler leaves
    on them never reach the engine's own tensors."""
    meta: AttentionMetadata = inputs["strait_attn"]
    cache = copy.copy(meta.cache)
    cache.data = meta.cache.data.detach()

    def fresh(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.clone()

    example_meta = dataclasses.replace(
        meta,
        cache=cache,
        slot_mapping=meta.slot_mapping.clone(),
        block_tables=fresh(meta.block_tables),
        context_lens=fresh(meta.context_lens),
    )
    out = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    out["strait_attn"] = example_meta
    return out


class ModelRunner:
    """One packed forward per step; owns the model and the KV cache tensors."""

    def __init__(
        self,
        model: torch.nn.Module,
        settings: EngineSettings,
        *,
        graph_capture: Capture | None = None,
        on_stage: Callable[[str], None] | None = None,
    ) -> None:
        """``graph_capture``: how decode steps are captured as graphs (default: CUDA graphs on a
        CUDA device with ``engine.cuda_graphs``, none elsewhere; tests pass
        :func:`~libs.engine.cuda_graphs.eager_capture` to run the bookkeeping on a CPU).
        ``on_stage``: told each stage of the start ("loading_kernels", "loading_graphs",
        "capturing_graphs"; the worker announces them, ``WorkerStarting``)."""
        stage = on_stage or (lambda _stage: None)
        attention.register()
        # NOTE: switches the given model to paged attention (it no longer runs without metadata).
        model.set_attn_implementation(attention.ATTENTION_NAME)  # type: ignore[operator]
        self.model = model
        self.device = torch.device(settings.device)
        self.dtype = DTYPES[settings.dtype]
        self.kv_dtype = DTYPES[settings.kv_dtype]  # engine.kv_cache_dtype, "auto" resolved
        self.block_size = settings.block_size
        self.shape = ModelShape.of(model.config)
        self.num_blocks = self._kv_blocks(settings)
        # Strait's CPU kernels, or None for torch's (engine.cpu_kernels; decision 0005).
        stage("loading_kernels")
        self.kernels = kernels.load(settings.cpu_kernels, settings.device, settings.dtype)
        self._choose_attention(settings)
        if graph_capture is None and self.device.type == "cuda" and settings.cuda_graphs:
            graph_capture = cuda_capture()
        if self.kernel_attention:
            graph_capture = None
        # Decode-step graphs pad their rows onto one block beyond the pool's (decision 0018).
        scratch = 1 if graph_capture is not None else 0
        self.kv_cache = KvCache(
            self.shape.num_layers,
            self.num_blocks + scratch,
            self.block_size,
            self.shape.num_kv_heads,
            self.shape.head_dim,
            self.kv_dtype,
            self.device,
        )
        self.groups = self.shape.num_heads // self.shape.num_kv_heads
        self._prepare_weights(settings)
        self.lora = self._install_lora(settings, graph_capture is not None)
        # The forward under torch.compile (engine.compile; needs the kernels' ops): graphs kept
        # on disk ahead of time (engine.compile_aot, libs/engine/aot.py), or torch.compile's
        # own per-process compile.
        self.compiled: Any = None
        self.aot: AotForward | None = None
        self.graphs: DecodeGraphs | None = None  # decode steps as graphs (set below)
        # Steps with prompt tokens replay graphs up to this many tokens (decision 0018).
        self.graph_max_tokens = settings.cuda_graph_max_tokens
        self.prompt_graph_steps = 0  # steps with prompt tokens that replayed a graph
        self.last_step_graphed = False  # the last step replayed a graph (run_ahead needs it)
        self._ahead: _Ahead | None = None  # the step launched ahead, if any
        self.ahead_launched = 0
        self.ahead_used = 0
        self._host_ids: torch.Tensor | None = None  # [max rows] int64, pinned on CUDA
        self.compiled_shape_classes: set[bool] = set()  # tokens == 1 for each graph run
        self.compiled_steps = 0
        if settings.compile and self.kernel_attention and self.num_blocks >= 5:
            self._compile_forward(settings, stage)
        if graph_capture is not None:
            stage("capturing_graphs")
            self.graphs = self._decode_graphs(settings, graph_capture)
        elif settings.compile and self.aot is None and self.compiled is None:
            log.warning(
                "engine.compile needs the CPU kernels, a float32 KV cache and 5 KV blocks; "
                "running eager"
            )
        self._log_kv_cache(settings)

    def _kv_blocks(self, settings: EngineSettings) -> int:
        """The KV blocks the budget holds, once LoRA adapter slots (engine.max_loras) have
        taken their bytes out of it; ``__init__`` calls it before anything is allocated, and
        raises when not one block fits."""
        lora_bytes = lora.bank_bytes(self.model, settings, self.dtype)
        num_blocks = num_kv_blocks(settings, self.shape, self.device, lora_bytes)
        if num_blocks < 1:
            raise ValueError(
                "the KV budget holds no block; raise engine.kv_cache_bytes or "
                "engine.kv_cache_memory_fraction"
                + (" (or lower engine.max_loras / max_lora_rank)" if lora_bytes else "")
            )
        return num_blocks

    def _choose_attention(self, settings: EngineSettings) -> None:
        """Sets ``kernel_attention`` and ``row_attention``, once the kernels are loaded
        (``__init__``): which paged attention every step runs."""
        # The paged attention kernel reads a float32 cache; a narrower one goes through torch's
        # attention (the linears and the arg-max still use the kernels).
        self.kernel_attention = self.kernels is not None and self.kv_dtype == torch.float32
        # Triton's paged kernel for every step's attention (engine.cuda_attention), else torch's
        # gather + SDPA; the CPU kernels take precedence where they serve.
        self.row_attention = not self.kernel_attention and (
            settings.cuda_attention == "triton"
            or (
                settings.cuda_attention == "auto"
                and self.device.type == "cuda"
                and triton_attention.supports(self.shape.head_dim)
            )
        )

    def _prepare_weights(self, settings: EngineSettings) -> None:
        """The model's linears fused (engine.fuse_projections), on huge pages and packed for
        the CPU kernels; ``__init__`` calls it after the KV cache is allocated and before the
        LoRA layers wrap the linears."""
        if settings.fuse_projections:
            fuse.fuse_projections(self.model)
        quant.levels_to_huge_pages(self.model)
        if self.kernels is not None:
            n = pack_linears(self.model, self.kernels)
            log.info("CPU kernels: %d linear layers packed, paged attention", n)
        log.info("weights: %s", self.weights_summary())

    def _compile_forward(self, settings: EngineSettings, stage: Callable[[str], None]) -> None:
        """The forward under torch.compile (``engine.compile``, with the CPU kernels' paged
        attention), ahead of time or per process, warmed up; ``__init__`` calls it once the
        weights and the LoRA layers are in place."""
        if settings.compile_aot:
            directory = Path(settings.compile_dir) if settings.compile_dir else None
            self.aot = AotForward(self.model, settings, directory, settings.compile_background)
        else:
            # The model's modules never change after start: no guards on them (see
            # own_forward_entry for why that is safe; ~0.5 ms a step less in dynamo).
            guards = torch.compiler.skip_guard_on_all_nn_modules_unsafe
            self.compiled = torch.compile(
                own_forward_entry(), options={"cpp_wrapper": True, "guard_filter_fn": guards}
            )
        stage("loading_graphs")
        log.info("engine.compile: preparing the forward's graphs (cached on disk after)...")
        t0 = time.perf_counter()
        self.warm_up()
        log.info("engine.compile: graphs ready in %.1f s", time.perf_counter() - t0)

    def _log_kv_cache(self, settings: EngineSettings) -> None:
        """The start's last log line (``__init__``): the KV cache's size and the attention."""
        log.info(
            "KV cache: %d blocks of %d tokens in %s (%.1f MiB), %s attention",
            self.num_blocks,
            self.block_size,
            settings.kv_dtype,
            self.kv_cache.data.numel() * self.kv_cache.data.element_size() / 2**20,
            "Strait's paged"
            if self.kernel_attention
            else "Strait's Triton paged"
            if self.row_attention
            else "torch's",
        )

    def _install_lora(self, settings: EngineSettings, graphs: bool) -> lora.LoraBank | None:
        """The adapters' wrapped linears (engine.max_loras; None when 0), installed before
        the forward is compiled or captured: a traced forward must compute every step's
        update, so only the eager one skips it in steps without adapter rows."""
        bank = lora.install(self.model, settings, self.device, self.dtype)
        if bank is not None:
            bank.eager = not (settings.compile or graphs)
            log.info(
                "LoRA: %d slots of rank %d on %d linears (%.1f MiB of the KV budget)",
                bank.num_slots,
                bank.max_rank,
                len(bank.layers),
                bank.nbytes() / 2**20,
            )
        return bank

    def _decode_graphs(self, settings: EngineSettings, capture: Capture) -> DecodeGraphs:
        """Decode steps as graphs (decision 0018); with ``engine.compile`` the captured forward
        is inductor's, compiled once with the sizes that differ between graphs symbolic."""
        forward: Callable[..., Any] = self.model
        if settings.compile:
            compiled = torch.compile(own_forward_entry())

            def forward(**inputs: Any) -> Any:
                return compiled(self.model, **inputs)

        max_len = self.shape.context_limit(settings.max_model_len)
        # The buckets up to the first that holds max_num_seqs rows (or max_num_seqs itself),
        # and likewise up to engine.cuda_graph_max_tokens for steps with prompt tokens.
        listed = sorted(settings.cuda_graph_batch_sizes)
        sizes: set[int] = set()
        for limit in (settings.max_num_seqs, self.graph_max_tokens):
            if limit > 0:
                sizes.update(n for n in listed if n < limit)
                sizes.add(batch_bucket(limit, listed) or limit)
        use_triton = self.row_attention
        graphs = DecodeGraphs(
            forward,
            self.kv_cache,
            scratch_block=self.num_blocks,
            batch_sizes=sorted(sizes),
            max_width=-(-max_len // self.block_size),
            capture=capture,
            dynamic=settings.compile,
            triton=use_triton,
        )
        log.info(
            "decode steps as graphs: up to %d rows (%s), %s forward, %s attention",
            graphs.batch_sizes[-1],
            ", ".join(map(str, graphs.batch_sizes)),
            "compiled" if settings.compile else "eager",
            "Triton's paged" if use_triton else "gather + SDPA",
        )
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                graphs.warm_up()
        except Exception:
            log.exception("decode graphs did not capture at start; steps run eager")
            graphs.failed = True
        log.info("decode graphs: first captures in %.1f s", time.perf_counter() - t0)
        return graphs

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """Run the scheduled tokens; returns logits ``[S, vocab]`` (float32) for the entries of
        ``batch`` that sample, in batch order: one row each, plus one per proposed token
        (``ScheduledSeq.spec``). Sequence state is not modified."""
        input_ids: list[int] = []  # [T] packed tokens
        positions: list[int] = []  # [T] absolute position of each token in its sequence
        slots: list[int] = []  # [T] flat KV slot each token's K/V is written to
        keep: list[int] = []  # packed positions whose logits are sampled
        tables: list[list[int]] = []  # per entry: the blocks covering its context after the step
        token_entry: list[int] = []  # [T] index into `tables` of each token's sequence
        lora_rows: list[int] = []  # [T] LoRA slot of each token's sequence (0: none)
        bs = self.block_size
        for i, item in enumerate(batch):
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start : start + n])
            input_ids.extend(item.spec)  # proposed tokens: after the last one, as a chunk
            n += len(item.spec)
            positions.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            tables.append(table[: -(-(start + n) // bs)])
            token_entry.extend([i] * n)
            lora_rows.extend([seq.lora_slot] * n)
            if item.samples:  # the last token's logits, then each proposal's
                keep.extend(range(len(input_ids) - 1 - len(item.spec), len(input_ids)))
        if self.lora is not None:
            self.lora.set_rows(lora_rows)
        return self._forward(input_ids, positions, slots, keep, tables, token_entry)

    def _forward(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        keep: list[int],
        tables: list[list[int]],
        token_entry: list[int],
    ) -> torch.Tensor:
        """One forward over packed tokens (see :meth:`execute`); returns logits ``[S, vocab]``."""
        ahead, self._ahead = self._ahead, None
        decode_only = len(keep) == len(input_ids) == len(tables)
        if ahead is not None and decode_only and ahead.is_step(input_ids, positions, slots, tables):
            self.ahead_used += 1  # already queued on the device by run_ahead
            self.last_step_graphed = True
            return ahead.logits
        self.last_step_graphed = False
        if self.graphs is not None:
            logits = self._graph_step(input_ids, positions, slots, keep, tables, token_entry)
            if logits is not None:
                self.last_step_graphed = True
                return logits
        meta = AttentionMetadata(
            cache=self.kv_cache, slot_mapping=torch.tensor(slots, device=self.device)
        )
        num_keep = len(keep)
        if self.kernel_attention:
            width = max(len(t) for t in tables)
            if self.compiling:
                # At least two table columns and, past one token, two sampled rows (repeats of
                # the last, dropped below): dynamo specialises sizes 0 and 1, which would be
                # more graphs. The kernel reads only each row's first blocks.
                width = max(width, 2)
                keep = keep + [len(input_ids) - 1] * (min(2, len(input_ids)) - len(keep))
            padded = torch.tensor(pad_tables(tables, width))
            # Every token is one query row over its sequence's blocks: [T, width], [T].
            meta.kernels = self.kernels
            meta.block_tables = padded[token_entry] if len(token_entry) > len(tables) else padded
            meta.context_lens = torch.tensor(positions) + 1
        elif self.row_attention:
            # Triton's kernel on CUDA: every token one query row over its sequence's blocks.
            width = max(len(t) for t in tables)
            padded = torch.tensor(pad_tables(tables, width))
            rows = padded[token_entry] if len(token_entry) > len(tables) else padded
            meta.row_tables = rows.to(self.device)
            meta.row_lens = torch.tensor(positions, device=self.device) + 1
        else:
            self._torch_attention_metadata(meta, positions, tables, token_entry)

        inputs = {
            "input_ids": torch.tensor([input_ids], device=self.device),
            "position_ids": torch.tensor([positions], device=self.device),
            "use_cache": False,
            "logits_to_keep": torch.tensor(keep, dtype=torch.long, device=self.device),
            "strait_attn": meta,
        }
        out = self._run_compiled(inputs, meta) if self.compiling else None
        if out is None:  # eager: engine.compile off, or this class's graph is compiling
            out = self.model(**inputs)
        return out.logits[0, :num_keep].float()  # [S, vocab]

    def _graph_step(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        keep: list[int],
        tables: list[list[int]],
        token_entry: list[int],
    ) -> torch.Tensor | None:
        """The step as a graph's replay (decision 0018), or None when no graph holds it. Every
        token is one row over its own sequence's blocks (both attentions in the graphs read a
        row's keys 0..p whatever the other rows are), so a step of decode tokens and one that
        carries prompt tokens differ only in which rows' logits are kept."""
        assert self.graphs is not None
        if len(keep) == len(input_ids) == len(tables):
            # Every row one decode token that samples: every row's logits, in order.
            return self.graphs.run(input_ids, positions, slots, tables)
        if len(input_ids) > self.graph_max_tokens:
            return None
        rows = [tables[e] for e in token_entry]
        logits = self.graphs.run(input_ids, positions, slots, rows)
        if logits is None:
            return None
        self.prompt_graph_steps += 1
        return logits.index_select(0, torch.tensor(keep, dtype=torch.long, device=logits.device))

    @torch.inference_mode()
    def run_ahead(self, batch: list[ScheduledSeq], logits: torch.Tensor) -> list[int]:
        """The arg-max token of each row of a graphed step of decode rows (``batch``, whose
        ``logits`` :meth:`execute` just returned), with the rows' next step launched on the
        device before this returns (``engine.cuda_run_ahead``; see ``cuda_graphs``): the ids
        go into the next graph's input on the device, and the host waits only for their copy
        back, not for the step behind it. The engine calls this instead of sampling when
        every row is plain greedy and each row's next slot has its block
        (``seq.block_table`` covers ``start + 2`` tokens); sequence state is not modified."""
        assert self.graphs is not None
        b = len(batch)
        ids = logits[:b].argmax(dim=-1)
        if self._host_ids is None or self._host_ids.numel() < b:
            pin = self.device.type == "cuda"
            n = self.graphs.batch_sizes[-1]
            self._host_ids = torch.empty(max(n, b), dtype=torch.int64, pin_memory=pin)
        host = self._host_ids[:b]
        host.copy_(ids, non_blocking=True)
        copied = None
        if self.device.type == "cuda":
            copied = torch.cuda.Event()
            copied.record()
        bs = self.block_size
        positions = [item.start + 1 for item in batch]
        slots, tables = [], []
        for item, p in zip(batch, positions, strict=True):
            table = item.seq.block_table
            slots.append(table[p // bs] * bs + p % bs)
            tables.append(table[: p // bs + 1])
        out = self.graphs.launch_ahead(ids, positions, slots, tables)
        if copied is not None:
            copied.synchronize()  # this step's ids, not the step queued behind them
        token_ids = [int(t) for t in host.tolist()]
        if out is not None:
            self.ahead_launched += 1
            self._ahead = _Ahead(token_ids, positions, slots, tables, out)
        return token_ids

    def _torch_attention_metadata(
        self,
        meta: AttentionMetadata,
        positions: list[int],
        tables: list[list[int]],
        token_entry: list[int],
    ) -> None:
        """Fill ``meta`` for torch's kernels (no CPU kernels): sequences with one token form
        the padded decode batch, longer runs are prefill segments with their own masks."""
        bs = self.block_size
        dec_idx, dec_tables, dec_lens = [], [], []
        start = 0  # first packed position of the entry
        # Each entry's tokens are one contiguous run of token_entry.
        for (_, run), table in zip(itertools.groupby(token_entry), tables, strict=True):
            n = len(list(run))
            ctx_len = positions[start] + n
            if n == 1:
                dec_idx.append(start)
                dec_tables.append(table)
                dec_lens.append(ctx_len)
            else:
                mask = attention.causal_mask(ctx_len - n, n, ctx_len, self.groups)
                meta.prefills.append(
                    PrefillSegment(
                        q_start=start,
                        q_len=n,
                        ctx_len=ctx_len,
                        block_ids=torch.tensor(table, device=self.device),
                        mask=mask.to(self.device),
                    )
                )
            start += n
        if dec_idx:
            max_blocks = max(len(t) for t in dec_tables)
            padded = pad_tables(dec_tables, max_blocks)
            lens = torch.tensor(dec_lens)
            meta.decode_token_idx = torch.tensor(dec_idx, device=self.device)
            meta.decode_block_ids = torch.tensor(padded, device=self.device).view(-1)
            # [1, B, 1, L_max] True where the key position is inside the sequence.
            mask = torch.arange(max_blocks * bs).unsqueeze(0) < lens.unsqueeze(1)
            meta.decode_mask = mask[None, :, None, :].to(self.device)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile both graphs before serving, so no request waits for the compiler. Called
        by :meth:`__init__` when ``engine.compile`` is on. Writes junk K/V into blocks 0-2,
        which no sequence holds yet (a block's slots are written before they are read)."""
        if not self.compiling:
            return
        bs = self.block_size
        # One token over two blocks; then four tokens (a 3-token chunk and a decode token)
        # over three, two of them sampled. Symbolic sizes traced with equal values are assumed
        # always equal, so tokens (4), sampled rows (2), table width (3) and the cache's block
        # count (>= 5, see __init__) must all differ here.
        self._forward([0], [bs], [bs], [0], [[0, 1]], [0])
        ctx = 2 * bs + 1
        self._forward(
            input_ids=[0] * 4,
            positions=[ctx - 3, ctx - 2, ctx - 1, ctx - 1],
            slots=[ctx - 3, ctx - 2, ctx - 1, ctx - 1],
            keep=[2, 3],
            tables=[[0, 1, 2], [0, 1, 2]],
            token_entry=[0, 0, 0, 1],
        )

    def _run_compiled(self, inputs: dict[str, Any], meta: AttentionMetadata) -> Any | None:
        """The compiled forward, over two graphs: one token, several; ``None`` while the
        step's graph compiles in the background (``engine.compile_background``: run eager).

        Only the sizes that vary are symbolic (tokens and sampled rows, except in the
        one-token graph, the block-table width, at least two, see :meth:`_forward`, and the
        cache's block count); the weights and the rest of the cache's shape are static.

        With ``engine.compile_aot`` the runner picks the graph by its class and
        :class:`~libs.engine.aot.AotForward` checks every guard on a graph's first call only.
        Otherwise, once a graph has run with every guard checked (those on the model's modules
        are never installed, see :func:`own_forward_entry`), later calls check only the guards
        that tell the two apart. Either way nothing else the guards check (dtypes, devices, the
        metadata's layout) changes after start."""
        assert meta.block_tables is not None and meta.context_lens is not None
        one = meta.block_tables.shape[0] == 1
        first = one not in self.compiled_shape_classes
        if self.aot is not None:
            # A saved graph's guards reject tensors with marked sizes: the sizes are marked on
            # an example (copies of this step's inputs over an alias of the cache), never on
            # the tensors the engine keeps.
            out = self.aot.run(one, inputs, lambda: self._dynamic(one, example_inputs(inputs)))
            if out is None:
                return None
        elif first:
            out = self.compiled(self.model, **self._dynamic(one, inputs))
        else:
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                out = self.compiled(self.model, **self._dynamic(one, inputs))
        self.compiled_steps += 1
        self.compiled_shape_classes.add(one)
        return out

    @staticmethod
    def _dynamic(one: bool, inputs: dict[str, Any]) -> dict[str, Any]:
        """Mark the sizes that vary between steps of a shape class dynamic (see
        :meth:`_run_compiled`); returns ``inputs``."""
        meta: AttentionMetadata = inputs["strait_attn"]
        assert meta.block_tables is not None and meta.context_lens is not None
        if not one:
            for t in (inputs["input_ids"], inputs["position_ids"]):
                torch._dynamo.mark_dynamic(t, 1)
            for t in (inputs["logits_to_keep"], meta.slot_mapping, meta.context_lens):
                torch._dynamo.mark_dynamic(t, 0)
            torch._dynamo.mark_dynamic(meta.block_tables, 0)
        torch._dynamo.mark_dynamic(meta.block_tables, 1)
        # The cache's block count follows the memory budget; symbolic, one compiled graph (and
        # one disk-cache entry) serves every budget.
        torch._dynamo.mark_dynamic(meta.cache.data, 3)
        return inputs

    @property
    def compiling(self) -> bool:
        """True when steps run a compiled forward (``engine.compile`` took effect)."""
        return self.compiled is not None or self.aot is not None

    @property
    def forward_kind(self) -> str:
        """What the steps run, for the worker's beat: "compiled", "eager", or "compiling"
        (eager steps while a graph compiles in the background). Read from any thread."""
        if self.aot is not None:
            return self.aot.state
        return "compiled" if self.compiled is not None else "eager"

    def _linear_layers(self) -> list[tuple[str, int]]:
        """(kind, bytes of weights and scales one forward reads) of every linear layer."""
        out = []
        for m in self.model.modules():
            if isinstance(m, quant.WeightOnlyLinear):
                out.append((m.kind, m.weight_bytes()))
            elif isinstance(m, PackedLinear):
                out.append(("fp32-packed", m.packed.numel() * m.packed.element_size()))
            elif isinstance(m, torch.nn.Linear):
                dtype = str(m.weight.dtype).removeprefix("torch.")
                out.append((dtype, m.weight.numel() * m.weight.element_size()))
        return out

    def linear_weight_bytes(self) -> int:
        """Bytes of linear weights (scales included) one forward reads, in their format."""
        return sum(n for _, n in self._linear_layers())

    def weights_summary(self) -> str:
        """One line: each linear kind and how many, and the bytes a forward reads."""
        layers = self._linear_layers()
        kinds = Counter(kind for kind, _ in layers)
        listed = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
        return f"{listed}; {sum(n for _, n in layers) / 2**20:.1f} MiB of linears a step"

    # ------------------------------------------------------------------ block data

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """K/V of ``block_ids``: ``[layers, 2, kv_heads, len(block_ids), block_size, head_dim]``."""
        idx = torch.tensor(block_ids, device=self.device)
        return self.kv_cache.data.index_select(3, idx).cpu()

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Inverse of :meth:`read_blocks`."""
        idx = torch.tensor(block_ids, device=self.device)
        self.kv_cache.data.index_copy_(3, idx, data.to(self.device, self.kv_dtype))

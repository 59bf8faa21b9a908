"""The prefill worker of a disaggregated pool: computes prompts, hands requests to decode.

Used by ``strait worker`` with ``worker.role = "prefill"`` (``strait prefill``). Takes
assignments from the router exactly as an aggregated worker does (``Worker.on_assignment``: same
acceptance, duplicates, cancel, beats with role ``prefill``), but :meth:`PrefillWorker.serve`
runs only the prompt and the first token:

    prepare → [prefix-cache service: lookup, fetch, import] → engine prefill (first token,
    prompt blocks exported) → done here when the request ends at its first token; otherwise
    hand off (offer → KV chunks → commit; ``services/prefill/handoff.py``) to the first
    decode worker of ``Assignment.decode_workers`` that accepts → [store new blocks in the
    cache service]

The stream belongs to this worker until a decode worker commits: the optional ``Routed`` echo,
and, when the request ends here or every handoff fails, its tokens or a typed error. After a
commit the decode worker writes everything else (from ``HandoffOffer.next_seq``).

A migrated request (``Assignment.migration``: its decode worker was lost mid-stream) is computed
with the output already streamed (replayed, not resent), and its next token is handed off with
it; the decode worker reads the replayed tokens from the offer's assignment.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Protocol

import msgspec
from nats.aio.client import Client as NATS
from opentelemetry import trace
from opentelemetry.context import Context

from libs.backend import BackendError, PreparedPrompt
from libs.engine.async_engine import AsyncEngineBackend, PrefillResult
from libs.engine.hashing import chain_hashes
from libs.engine.kv_transfer import KvBlocks
from libs.engine.tools import ToolCallCollector, ToolSpec
from libs.flow.tenant import engine_tenant, tenant_of
from libs.log import fields
from libs.protocol import (
    Assignment,
    Routed,
    Usage,
)
from libs.settings import Settings
from libs.wire.stream_writer import StreamWriter
from services.prefill.handoff import HandoffSender
from services.worker import metrics
from services.worker.base import Worker

log = logging.getLogger("strait.prefill")


class PrefixCache(Protocol):
    """What the prefill worker needs of the prefix-cache service's client
    (libs/wire/kv_cache_client.CacheClient): both fail soft (None / nothing) — a cache is optional."""

    async def fetch(self, model_id: str, block_hashes: list[int]) -> KvBlocks | None: ...

    async def store(self, kv: KvBlocks) -> None: ...


class PrefillWorker(Worker):
    def __init__(
        self,
        nc: NATS,
        settings: Settings,
        backend: AsyncEngineBackend,
        cache: PrefixCache | None = None,
        worker_id: str = "",
    ) -> None:
        super().__init__(nc, settings, backend, worker_id)
        self.engine = backend
        self.log = log
        self.cache = cache
        self.handoff = HandoffSender(self)
        self._stores: set[asyncio.Task[None]] = set()

    async def serve(self, a: Assignment, parent: Context) -> None:
        req = a.request
        # A migrated request: another worker streamed its output; this stream goes on after.
        mig = a.migration
        out = StreamWriter(
            self.nc,
            req.reply_subject or self.subjects.stream(req.request_id),
            req.request_id,
            mig.next_seq if mig is not None else 1,
            owner=self.owns_streams,
            key=req.key,
        )
        started = time.perf_counter()
        status, error_code = "ok", ""
        usage = Usage()
        decode_worker = ""
        span = self.begin("prefill", a, parent)
        try:
            decode_worker = await self._run(a, out, usage, span, started)
        except (Exception, asyncio.CancelledError) as e:
            status, error_code = await self.fail(out, e)
        finally:
            self.finish(
                req.key,
                span,
                status,
                error_code,
                started,
                decode_worker=decode_worker or None,
                prompt_tokens=usage.prompt_tokens,
                cached_tokens=usage.cached_tokens,
            )

    async def _run(
        self, a: Assignment, out: StreamWriter, usage: Usage, span: trace.Span, started: float
    ) -> str:
        """Prompt and first token here, then the handoff: the decode worker that committed
        ("" when the request ended here)."""
        req, mig = a.request, a.migration
        replayed = mig.output_token_ids if mig is not None else []
        if req.want_route and mig is None:
            await out.send(Routed(seq=out.next_seq(), request_id=req.request_id, route=a.route))
        prompt = await self._prepare(a)
        usage.prompt_tokens = len(prompt.token_ids)
        usage.completion_tokens = len(replayed)  # counted once, here or by the decode side
        if mig is not None and mig.finished:
            # Every delta was streamed; only the stream's end was lost with the worker.
            await self.send_finished(out, a, usage, None, time.perf_counter() - started)
            return ""
        res = await self._prefill(a, prompt, usage, span)
        prefill_s = time.perf_counter() - started
        tenant = metrics.tenant_label(tenant_of(req))
        metrics.TTFT.labels(req.priority, tenant).observe(prefill_s)
        self._store_later(res)
        if req.sampling.n == 1 and (
            res.chunk.finish_reason == "stop" or req.sampling.max_tokens <= len(replayed) + 1
        ):
            usage.completion_tokens += len(res.chunk.token_ids)
            await self._finish_here(out, a, res, usage, prefill_s, started)
            return ""
        if not a.decode_workers:
            raise BackendError(
                "no_worker",
                "no live decode worker in the pool",
                retry_after_s=self.settings.fleet.retry_after_s,
            )
        return await self.handoff.hand_off(a, out, prompt, res, usage, prefill_s, span)

    async def _prepare(self, a: Assignment) -> PreparedPrompt:
        """The request's prompt, on a thread (templating, tokenizing, grammar)."""
        req = a.request
        prompt = await asyncio.to_thread(
            functools.partial(
                self.backend.prepare,
                prompt=req.prompt,
                prompt_token_ids=req.prompt_token_ids,
                messages=req.messages,
                sampling=req.sampling,
                tools=ToolSpec.of(req),
            )
        )
        prompt.lora = self.adapter_of(req.model)
        return prompt

    async def _prefill(
        self, a: Assignment, prompt: PreparedPrompt, usage: Usage, span: trace.Span
    ) -> PrefillResult:
        """The engine's prefill (after the cache service's blocks, when it has some), its
        prompt counts in ``usage``, the metrics and ``span``."""
        req, mig = a.request, a.migration
        replayed = mig.output_token_ids if mig is not None else []
        from_service = await self._fetch_cached(prompt)
        # n > 1: compute the prompt only; the decode worker samples every choice's first
        # token from the same logits, as an aggregated worker would.
        many = req.sampling.n > 1
        one = msgspec.structs.replace(req.sampling, n=1) if many else req.sampling
        res = await self.engine.prefill(
            req.key, prompt, one, req.priority, replayed, engine_tenant(req)
        )
        cached = res.chunk.num_cached_tokens
        # Local and imported hits (a migration's replayed output is computed like prompt).
        usage.cached_tokens = min(cached, usage.prompt_tokens)
        self.count_prompt(usage.prompt_tokens + len(replayed), cached)
        span.set_attributes(
            {
                "strait.prompt_tokens": usage.prompt_tokens,
                "strait.cached_tokens": usage.cached_tokens,
                "strait.computed_tokens": usage.prompt_tokens - cached,
                "strait.cache_service_tokens": from_service,
                "strait.running": self.backend.load().running,
            }
        )
        return res

    # ------------------------------------------------------------ done at the first token

    async def _finish_here(
        self,
        out: StreamWriter,
        a: Assignment,
        res: PrefillResult,
        usage: Usage,
        prefill_s: float,
        started: float,
    ) -> None:
        tools = ToolSpec.of(a.request)
        calls = None
        if tools and tools.parsed:
            collector = ToolCallCollector(tools, 1)
            if a.migration is not None:
                collector.texts[0] = a.migration.output_text
            calls = collector.add(res.chunk)
        await self.send_chunk(out, res.chunk, calls)
        await self.send_finished(out, a, usage, prefill_s, time.perf_counter() - started)

    # ------------------------------------------------------------ prefix-cache service

    async def _fetch_cached(self, prompt: PreparedPrompt) -> int:
        """Import the longest cached prefix the cache service holds beyond this engine's own;
        returns the prompt tokens it covers (0 when there is no service or no hit)."""
        if self.cache is None:
            return 0
        model_id = self.backend.model_id
        block_size = self.backend.load().block_size
        # Full blocks before the last prompt token (that one is always computed, for logits).
        n = (len(prompt.token_ids) - 1) // block_size
        hashes = chain_hashes(prompt.token_ids[: n * block_size], block_size, model_id)
        if not hashes:
            return 0
        kv = await self.cache.fetch(model_id, hashes)
        if kv is None:
            return 0
        try:
            await self.engine.import_prefix(kv)
        except BackendError as e:
            log.warning("cached blocks did not fit", extra=fields(error=str(e)))
            return 0
        return len(kv.header.block_hashes) * kv.header.block_size

    def _store_later(self, res: PrefillResult) -> None:
        """Offer the prompt's full blocks to the cache service, off the critical path."""
        if self.cache is None or res.kv is None:
            return
        task = asyncio.create_task(self.cache.store(res.kv))
        self._stores.add(task)
        task.add_done_callback(self._stores.discard)
